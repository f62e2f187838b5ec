"""Warm start: a plain optimizer's checkpoint continues with accumulation, and an
accumulating run's checkpoint continues without it.

The wrapped optimizer's variables (slots, Adam's beta powers, global_step) keep their
plain names, so the one thing a plain checkpoint lacks is the window. Restore everything
else with `Saver(var_list=...)`; the window starts empty from its initializer. Under
MonitoredTrainingSession the same Saver goes into `Scaffold(init_fn=...)`, which runs
only when checkpoint_dir has no checkpoint yet.

    .venv/bin/python -m examples.tf1_warm_start      (docs/tf1-code.md, "Warm start")
"""

import os
import tempfile

import numpy as np
import tensorflow as tf

from examples.toy_windows import toy_windows
from gradient_averaging import AveragingOptimizer

v1 = tf.compat.v1
N = 4
minibatches, direct = toy_windows(N, windows=4, batch=5)  # each window as one batch


def build(n):
    """The model; n=None: the plain optimizer, else wrapped with N=n."""
    x = v1.placeholder(tf.float64, [None, 3])
    y = v1.placeholder(tf.float64, [None, 1])
    w = v1.get_variable("w", initializer=tf.constant([[0.5], [-0.2], [0.1]], tf.float64))
    loss = tf.reduce_mean(tf.square(tf.matmul(tf.tanh(x), w) - y))
    optimizer = v1.train.AdamOptimizer(0.05)
    if n:
        optimizer = AveragingOptimizer(optimizer, average_gradients=n)
    train_op = optimizer.minimize(loss, global_step=v1.train.get_or_create_global_step())
    return x, y, w, optimizer, train_op


def not_in_window(optimizer):
    """Every global variable but the window's: what a plain checkpoint has."""
    window = optimizer.window_variables()
    return [v for v in v1.global_variables() if v not in window]


with tempfile.TemporaryDirectory() as tmp:
    plain_ckpt, wrapped_dir = os.path.join(tmp, "plain.ckpt"), os.path.join(tmp, "wrapped")

    with tf.Graph().as_default():                  # 1. plain: updates 1 and 2
        x, y, w, _, train_op = build(None)
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            for xb, yb in direct[:2]:
                sess.run(train_op, {x: xb, y: yb})
            v1.train.Saver().save(sess, plain_ckpt)

    with tf.Graph().as_default():                  # 2. wrapped, N=4: updates 3 and 4
        x, y, w, optimizer, train_op = build(N)
        warm_start = v1.train.Saver(var_list=not_in_window(optimizer))
        scaffold = v1.train.Scaffold(
            init_fn=lambda scaffold, sess: warm_start.restore(sess, plain_ckpt))
        with v1.train.MonitoredTrainingSession(checkpoint_dir=wrapped_dir,
                                               scaffold=scaffold) as sess:
            for xb, yb in minibatches[2 * N:4 * N]:
                sess.run(train_op, {x: xb, y: yb})

    with tf.Graph().as_default():                  # 3. plain again, from the wrapped run
        x, y, w, _, train_op = build(None)
        with v1.Session() as sess:
            v1.train.Saver().restore(sess, v1.train.latest_checkpoint(wrapped_dir))
            assert sess.run(v1.train.get_global_step()) == 4
            for xb, yb in direct[2:]:              # the same two batches once more
                sess.run(train_op, {x: xb, y: yb})
            resumed = sess.run(w)

with tf.Graph().as_default():                      # the reference: plain throughout
    x, y, w, _, train_op = build(None)
    with v1.Session() as sess:
        sess.run(v1.global_variables_initializer())
        for xb, yb in direct + direct[2:]:
            sess.run(train_op, {x: xb, y: yb})
        reference = sess.run(w)

np.testing.assert_allclose(resumed, reference, rtol=1e-10)
print("plain -> accumulated (N=4) -> plain ends at the plain run's weights:", resumed.ravel())
