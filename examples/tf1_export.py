"""Export and re-import: a Saver meta graph and a SavedModel, saved mid-window, load
without this library's Python code and continue training to the same weights.

    .venv/bin/python -m examples.tf1_export      (docs/tf1-code.md, "Export")
"""

import os
import tempfile

import numpy as np
import tensorflow as tf

from gradient_averaging import FLUSH_OPS
from gradient_averaging import AveragingOptimizer

v1 = tf.compat.v1
rng = np.random.RandomState(0)
feeds = [(rng.rand(8, 4).astype(np.float32), rng.rand(8, 1).astype(np.float32))
         for _ in range(7)]

with tempfile.TemporaryDirectory() as tmp, tf.Graph().as_default():
    x = v1.placeholder(tf.float32, [None, 4], name="x")
    y = v1.placeholder(tf.float32, [None, 1], name="y")
    w = v1.get_variable("w", [4, 1], initializer=v1.ones_initializer())
    prediction = tf.identity(tf.matmul(x, w), name="prediction")
    loss = tf.reduce_mean(tf.square(prediction - y))
    global_step = v1.train.get_or_create_global_step()
    optimizer = AveragingOptimizer(v1.train.AdamOptimizer(0.1), average_gradients=3)
    train_op = optimizer.minimize(loss, global_step=global_step)
    with v1.Session() as sess:
        sess.run(v1.global_variables_initializer())
        for xb, yb in feeds[:4]:                    # 1 update and 1 mini-batch open
            sess.run(train_op, {x: xb, y: yb})
        v1.train.Saver().save(sess, os.path.join(tmp, "model.ckpt"))
        v1.saved_model.simple_save(sess, os.path.join(tmp, "saved_model"),
                                   inputs={"x": x}, outputs={"prediction": prediction})
        for xb, yb in feeds[4:]:
            sess.run(train_op, {x: xb, y: yb})
        uninterrupted = sess.run(w)

    def continue_training(sess):
        """What a script that has only the exported graph does: ops by collection."""
        train, = v1.get_collection(v1.GraphKeys.TRAIN_OP)
        flush, = v1.get_collection(FLUSH_OPS)       # also by name: "AveragingAdam/flush"
        for xb, yb in feeds[4:]:
            sess.run(train, {"x:0": xb, "y:0": yb})
        weights, = [v for v in v1.global_variables() if v.op.name == "w"]
        return sess.run(weights), flush

    with tf.Graph().as_default():                   # 1. the Saver's meta graph
        saver = v1.train.import_meta_graph(os.path.join(tmp, "model.ckpt.meta"))
        with v1.Session() as sess:
            saver.restore(sess, os.path.join(tmp, "model.ckpt"))
            from_meta, flush = continue_training(sess)
            sess.run(flush)                         # nothing open: a no-op
    with tf.Graph().as_default():                   # 2. the SavedModel
        with v1.Session() as sess:
            v1.saved_model.loader.load(sess, [v1.saved_model.tag_constants.SERVING],
                                       os.path.join(tmp, "saved_model"))
            print("prediction:", sess.run("prediction:0", {"x:0": np.ones([1, 4])}).ravel())
            from_saved_model, _ = continue_training(sess)

assert np.array_equal(from_meta, uninterrupted), (from_meta, uninterrupted)
assert np.array_equal(from_saved_model, uninterrupted), (from_saved_model, uninterrupted)
print("both re-imported graphs continued to the uninterrupted run's weights")
