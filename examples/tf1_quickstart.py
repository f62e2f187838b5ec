"""README's TF1 snippet: AveragingOptimizer wraps your v1 optimizer; the loop stays as it was.

    .venv/bin/python -m examples.tf1_quickstart
"""

import numpy as np
import tensorflow as tf

from gradient_averaging import AveragingOptimizer

v1 = tf.compat.v1
rng = np.random.default_rng(0)
batches = [(rng.normal(size=(16, 4)), rng.normal(size=(16, 1))) for _ in range(20)]

with tf.Graph().as_default():
    x, y = v1.placeholder(tf.float32, [None, 4]), v1.placeholder(tf.float32, [None, 1])
    loss = tf.reduce_mean((tf.matmul(x, v1.get_variable("w", [4, 1])) - y) ** 2)
    optimizer = AveragingOptimizer(v1.train.AdamOptimizer(1e-3), average_gradients=8)
    updates = v1.train.get_or_create_global_step()                # counts updates
    train_op = optimizer.minimize(loss, global_step=updates)      # the one-line change
    with v1.Session() as sess:
        sess.run(v1.global_variables_initializer())
        for xb, yb in batches:                                    # your mini-batches
            sess.run(train_op, {x: xb, y: yb})                    # applies every 8th run
        sess.run(optimizer.flush_op())                            # the partial window (4)
        print("updates applied:", sess.run(updates))              # 20 at N=8: 3
