"""README's "The mechanism": the post's GradientAverager on a TF1 graph of your own.

Run from the repository root (it imports this repository's trainer.py):
    .venv/bin/python -m examples.gradient_averager
"""

import numpy as np
import tensorflow as tf

import trainer

rng = np.random.default_rng(0)
batches = [(rng.normal(size=(16, 4)), rng.normal(size=(16, 1))) for _ in range(20)]

with tf.Graph().as_default():
    x = tf.compat.v1.placeholder(tf.float32, [None, 4])
    y = tf.compat.v1.placeholder(tf.float32, [None, 1])
    w = tf.compat.v1.get_variable("w", [4, 1])
    loss = tf.reduce_mean((tf.matmul(x, w) - y) ** 2)
    updates = tf.compat.v1.train.get_or_create_global_step()  # counts updates
    averager = trainer.GradientAverager(loss, tf.compat.v1.train.AdamOptimizer(1e-3), 8,
                                        global_step=updates)
    with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        for xb, yb in batches:                      # your mini-batches
            averager.step(sess, {x: xb, y: yb})     # applies every 8th call
        averager.flush(sess)                        # the partial window, if any (4 here)
        print("updates applied:", sess.run(updates))  # 20 mini-batches at N=8: 3
