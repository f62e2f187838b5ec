"""README's "Use it in your TF1 code": AveragingOptimizer under MonitoredTrainingSession,
stopped mid-window and resumed from its checkpoint to the uninterrupted run's weights.

    .venv/bin/python -m examples.tf1_monitored_session
"""

import os
import tempfile

import numpy as np
import tensorflow as tf

from gradient_averaging import AveragingOptimizer

v1 = tf.compat.v1
rng = np.random.RandomState(0)
feeds = [(rng.rand(8, 4), rng.randint(3, size=8)) for _ in range(12)]


def train(checkpoint_dir, minibatches):
    """Builds the graph and runs `minibatches` through MonitoredTrainingSession."""
    with tf.Graph().as_default():
        images = v1.placeholder(tf.float64, [None, 4])
        labels = v1.placeholder(tf.int64, [None])
        weights = v1.get_variable("weights", [4, 3], tf.float64,
                                  initializer=v1.glorot_uniform_initializer(seed=1))
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=labels, logits=tf.matmul(images, weights)))
        optimizer = AveragingOptimizer(v1.train.AdamOptimizer(1e-2), average_gradients=4)
        train_op = optimizer.minimize(loss, global_step=v1.train.get_or_create_global_step())
        hooks = [v1.train.NanTensorHook(loss),
                 v1.train.StopAtStepHook(last_step=3)]          # 3 updates = 12 mini-batches
        with v1.train.MonitoredTrainingSession(checkpoint_dir=checkpoint_dir,
                                               hooks=hooks) as sess:
            for xb, yb in minibatches:
                if sess.should_stop():
                    break
                sess.run(train_op, feed_dict={images: xb, labels: yb})


with tempfile.TemporaryDirectory() as tmp:
    train(os.path.join(tmp, "once"), feeds)
    train(os.path.join(tmp, "twice"), feeds[:6])    # stopped mid-window: 1 update + 2
    train(os.path.join(tmp, "twice"), feeds[6:])    # resumed from its checkpoint
    final = {}
    for run in ("once", "twice"):
        reader = v1.train.load_checkpoint(os.path.join(tmp, run))
        final[run] = (reader.get_tensor("weights"), reader.get_tensor("global_step"))

assert final["once"][1] == final["twice"][1] == 3, final
np.testing.assert_array_equal(final["twice"][0], final["once"][0])
print("stopped after 6 mini-batches and resumed: the uninterrupted run's weights, 3 updates")
