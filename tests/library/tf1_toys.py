"""Tiny TF1 models, data and training loops that the AveragingOptimizer tests share.

Every model here is tiny, dropout-free and float64 (unless the dtype is the point), so
"exact" means allclose at rtol 1e-10: only the order of the sums differs.
"""

import collections

import numpy as np
import tensorflow as tf

from gradient_averaging import AveragingOptimizer

v1 = tf.compat.v1
RTOL, ATOL = 1e-10, 1e-12

RNG = np.random.RandomState(0)
X = RNG.randn(96, 4)
Y = RNG.randn(96, 2)
W1, B1, W2 = RNG.randn(4, 5), RNG.randn(5) * 0.1, RNG.randn(5, 2)

OPTIMIZERS = {
    "sgd": lambda: v1.train.GradientDescentOptimizer(0.1),
    "adam": lambda: v1.train.AdamOptimizer(0.05),
    "momentum": lambda: v1.train.MomentumOptimizer(0.1, 0.9),
    "rmsprop": lambda: v1.train.RMSPropOptimizer(0.01),
    "adagrad": lambda: v1.train.AdagradOptimizer(0.1),
}

Model = collections.namedtuple("Model", "x y loss variables")


def mlp(x=None, y=None):
    """x [B, 4] -> tanh(5) -> 2, mean squared error over the batch; x and y are fed
    placeholders unless given (an input pipeline's tensors)."""
    x = v1.placeholder(tf.float64, [None, 4], name="x") if x is None else x
    y = v1.placeholder(tf.float64, [None, 2], name="y") if y is None else y
    w1 = v1.get_variable("w1", initializer=tf.constant(W1))
    b1 = v1.get_variable("b1", initializer=tf.constant(B1))
    w2 = v1.get_variable("w2", initializer=tf.constant(W2))
    out = tf.matmul(tf.tanh(tf.matmul(x, w1) + b1), w2)
    return Model(x, y, tf.reduce_mean(tf.square(out - y)), [w1, b1, w2])


def minibatches(sizes, start=0):
    """Consecutive (x, y) mini-batches of the given sizes."""
    bounds = np.cumsum([start] + list(sizes))
    return [(X[a:b], Y[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]


def concatenated(feeds, n):
    """Each window of n mini-batches as one direct batch."""
    return [tuple(np.concatenate(part) for part in zip(*feeds[k:k + n]))
            for k in range(0, len(feeds), n)]


def train(make_optimizer, feeds, n=None, weighted=False, flush=False, build=mlp, **kwargs):
    """Runs the train op once per (x, y) feed.

    Args:
      n: None for the plain optimizer, else AveragingOptimizer(optimizer, n, **kwargs).
      weighted: weight each mini-batch by its sample count.
      flush: run flush_op at the end.

    Returns:
      (the model's variables' values, global_step).
    """
    with tf.Graph().as_default() as graph:
        model = build()
        global_step = v1.train.get_or_create_global_step()
        if n is None:
            train_op = make_optimizer().minimize(model.loss, global_step=global_step)
        else:
            opt = AveragingOptimizer(make_optimizer(), n, **kwargs)
            weight = tf.cast(tf.shape(model.x)[0], tf.float64) if weighted else None
            train_op = opt.minimize(model.loss, global_step=global_step, weight=weight)
        init = v1.global_variables_initializer()
        graph.finalize()  # the loop and flush_op build nothing
        with v1.Session() as sess:
            sess.run(init)
            for x, y in feeds:
                sess.run(train_op, {model.x: x, model.y: y})
            if flush:
                sess.run(opt.flush_op())
            return sess.run(model.variables), sess.run(global_step)


def assert_close(actual, expected, rtol=RTOL, atol=ATOL):
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        np.testing.assert_allclose(a, e, rtol=rtol, atol=atol)



# ---------------------------------------------------------------- sparse gradients

ROWS, WIDTH = 10, 3
EMBEDDING = RNG.randn(ROWS, WIDTH)
# Two windows of N=2; rows 0-3 are touched only in the first, 5-8 only in the second.
IDS = [[0, 1, 1], [2, 0, 3], [5, 6, 5], [8, 7, 7]]
TARGETS = RNG.randn(4, 3)


class SpyMomentum(v1.train.MomentumOptimizer):
    """Momentum that records the gradient types it is asked to apply."""

    def __init__(self):
        super().__init__(0.1, 0.9)
        self.applied_types = []

    def apply_gradients(self, grads_and_vars, *args, **kwargs):
        self.applied_types.append([type(g) for g, _ in grads_and_vars])
        return super().apply_gradients(grads_and_vars, *args, **kwargs)


SPARSE_OPTIMIZERS = {"momentum": SpyMomentum,
                     "adagrad": lambda: v1.train.AdagradOptimizer(0.1),
                     "adam": lambda: v1.train.AdamOptimizer(0.05)}


def embedding_model():
    ids = v1.placeholder(tf.int32, [None], name="ids")
    target = v1.placeholder(tf.float64, [None], name="target")
    table = v1.get_variable("table", initializer=tf.constant(EMBEDDING))
    w = v1.get_variable("w", initializer=tf.constant([0.5, -1.0, 2.0], tf.float64))
    pred = tf.reduce_sum(tf.nn.embedding_lookup(table, ids) * w, axis=1)
    return Model(ids, target, tf.reduce_mean(tf.square(pred - target)), [table, w])


def train_embedding(make_optimizer, feeds, n=None):
    """Like `train`; also returns the table after each update and the optimizers."""
    with tf.Graph().as_default():
        model = embedding_model()
        wrapped = make_optimizer()
        opt = wrapped if n is None else AveragingOptimizer(wrapped, n)
        train_op = opt.minimize(model.loss)
        tables = []
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            for k, (ids, target) in enumerate(feeds):
                sess.run(train_op, {model.x: ids, model.y: target})
                if (k + 1) % (n or 1) == 0:
                    tables.append(sess.run(model.variables[0]))
            window = [sess.run(v) for v in opt.variables() if v not in wrapped.variables()]
            return sess.run(model.variables), tables, wrapped, opt, window
