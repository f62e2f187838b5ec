"""A TF1 masked sequence loss under AveragingOptimizer: each run's weight is its valid
tokens, so the window applies sum(w_i g_i) / sum(w_i), the gradient of the token mean
over the whole window, as the direct batch of its sequences has it. Equal weights (no
`weight`) would weigh a mini-batch of one token like one of eighty.

    .venv/bin/python -m examples.tf1_masked_sequences
"""

import numpy as np
import tensorflow as tf

from gradient_averaging import AveragingOptimizer

v1 = tf.compat.v1
V, T, SAMPLES = 20, 12, 84
rng = np.random.default_rng(0)
lengths = rng.integers(1, T + 1, size=SAMPLES)
lengths[rng.random(SAMPLES) < 0.3] = 1                       # very unequal lengths
ids = rng.integers(1, V, size=(SAMPLES, T)) * (np.arange(T) < lengths[:, None])
labels = rng.integers(0, V, size=(SAMPLES, T))


def train(average_gradients, batch_size, epochs=3, weighted=True):
    """The tagger's weights after `epochs` passes in mini-batches of `batch_size`, each
    run weighed by its valid tokens (`weighted`) or all alike."""
    with tf.Graph().as_default():
        x = v1.placeholder(tf.int32, [None, T])
        y = v1.placeholder(tf.int32, [None, T])
        length = v1.placeholder(tf.int32, [None])
        init = v1.glorot_uniform_initializer(seed=1)
        table = v1.get_variable("table", [V, 8], initializer=init)
        kernel = v1.get_variable("kernel", [8, V], initializer=init)
        logits = tf.einsum("btd,dv->btv", tf.nn.embedding_lookup(table, x), kernel)
        mask = tf.sequence_mask(length, T, dtype=tf.float32)
        per_token = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits)
        valid = tf.reduce_sum(mask)                                 # this run's weight
        loss = tf.math.divide_no_nan(tf.reduce_sum(per_token * mask), valid)  # token mean
        optimizer = AveragingOptimizer(v1.train.GradientDescentOptimizer(0.5),
                                       average_gradients)
        train_op = optimizer.minimize(loss, weight=valid if weighted else None)
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            for _ in range(epochs):
                for start in range(0, SAMPLES, batch_size):
                    batch = slice(start, start + batch_size)
                    sess.run(train_op, {x: ids[batch], y: labels[batch],
                                        length: lengths[batch]})
                sess.run(optimizer.flush_op())                      # the epoch's last window
            return sess.run([table, kernel])


direct = train(1, 32)                                               # batches of 32
accumulated = train(4, 8)                                           # 4 x 8 per update
difference = max(float(np.abs(a - b).max()) for a, b in zip(direct, accumulated))
print(f"max weight difference from the direct batch: {difference:.1e}")  # ~1e-7
