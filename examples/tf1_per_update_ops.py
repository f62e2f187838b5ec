"""Ops that must run once per update, not once per mini-batch: an EMA of the weights and
a counter with `after_update=`; clipping by global norm with `transform_gradients=`.

The cifar10 multi-GPU idiom, `ema.apply(...)` under `control_dependencies([train_op])`,
would step the EMA at every mini-batch run of the wrapper's train op; and
`compute_gradients` -> `clip_by_global_norm` -> `apply_gradients` would clip each
mini-batch instead of the mean. Both are checked here against the direct batch.

    .venv/bin/python -m examples.tf1_per_update_ops  (docs/tf1-code.md, "Per-update ops")
"""


import numpy as np
import tensorflow as tf

from examples.toy_windows import toy_windows
from gradient_averaging import AveragingOptimizer

v1 = tf.compat.v1
N = 3
minibatches, direct = toy_windows(N, windows=3, batch=4)  # each window as one batch


def clip(pairs, clip_norm=0.05):
    grads, _ = tf.clip_by_global_norm([g for g, _ in pairs], clip_norm)
    return list(zip(grads, [v for _, v in pairs]))


def train(accumulate):
    with tf.Graph().as_default():
        x = v1.placeholder(tf.float64, [None, 3])
        y = v1.placeholder(tf.float64, [None, 1])
        w = v1.get_variable("w", initializer=tf.constant([[0.5], [-0.2], [0.1]], tf.float64))
        loss = tf.reduce_mean(tf.square(tf.matmul(x, w) - y))
        ema = v1.train.ExponentialMovingAverage(decay=0.9)
        updates = v1.get_variable("updates", initializer=tf.constant(0, tf.int64),
                                  trainable=False)
        if accumulate:
            optimizer = AveragingOptimizer(
                v1.train.MomentumOptimizer(0.5, 0.9), average_gradients=N,
                transform_gradients=clip,                       # on the mean, per update
                after_update=lambda: [ema.apply([w]), updates.assign_add(1)])
            train_op = optimizer.minimize(loss)
        else:                                                   # the direct batch, as usual
            optimizer = v1.train.MomentumOptimizer(0.5, 0.9)
            train_op = optimizer.apply_gradients(clip(optimizer.compute_gradients(loss)))
            with tf.control_dependencies([train_op]):
                train_op = tf.group(ema.apply([w]), updates.assign_add(1))
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            for xb, yb in (minibatches if accumulate else direct):
                sess.run(train_op, {x: xb, y: yb})
            return sess.run([w, ema.average(w), updates])


(w, shadow, updates), (direct_w, direct_shadow, direct_updates) = train(True), train(False)
assert updates == direct_updates == 3, (updates, direct_updates)
np.testing.assert_allclose(w, direct_w, rtol=1e-10)
np.testing.assert_allclose(shadow, direct_shadow, rtol=1e-10)
print(f"{updates} updates; weights {w.ravel()}, their EMA {shadow.ravel()}, as the direct batch")
