"""Every averager applies the direct batch's update; both models train.

Trained as main.py trains (engine_tf1.Engine), dropout off, the same seed: the N
mini-batches of B hold exactly the samples of the direct batch of N*B.
"""

import numpy as np
import pytest
import tensorflow as tf

import model
from experiment import averagers
from experiment import config as config_lib
from experiment import data
from experiment import engine_tf1
from gradient_averaging import window as window_lib
from trainer import Outcome
from trainer import WindowCounts

v1 = tf.compat.v1
N, B, UPDATES, SEED = 5, 20, 3, 7
MLP_PARAMETERS = 784 * 4096 + 4096 + 4096 * 4096 + 4096 + 4096 * 10 + 10


def train(mnist, kind, n, b, updates, sgd_rate=None):
    """Trainable weights before and after `updates` updates (Adam 1e-3, or plain SGD)."""
    config = config_lib.Config(average_gradients=n, batch_size=b, dropout=0.0, accumulate=kind)
    optimizer = v1.train.GradientDescentOptimizer(sgd_rate) if sgd_rate else None
    engine = engine_tf1.Engine(config, SEED, optimizer=optimizer)
    try:
        variables = engine.run_graph.graph.get_collection(v1.GraphKeys.TRAINABLE_VARIABLES)
        before = engine.sess.run(variables)
        counts = WindowCounts()
        for iteration, (images, labels) in enumerate(
                data.batches(mnist.train, SEED, b, 0, n * updates), start=1):
            counts.count(engine.step(images, labels, iteration))
        assert counts.updates == updates and engine.window_size() == 0
        return before, engine.sess.run(variables)
    finally:
        engine.close()


_CACHE = {}


def trained(mnist, kind, how):
    """Cached runs: "gradient" is one SGD step at rate 1 (before - after is exactly the
    applied mean gradient), "sgd" UPDATES steps at 0.1, "adam" UPDATES Adam updates.
    `kind` None is the direct batch of N*B."""
    key = (kind, how)
    if key not in _CACHE:
        n, b = (1, N * B) if kind is None else (N, B)
        updates, rate = {"gradient": (1, 1.0), "sgd": (UPDATES, 0.1), "adam": (UPDATES, None)}[how]
        _CACHE[key] = train(mnist, kind or "stack", n, b, updates, rate)
    return _CACHE[key]


@pytest.mark.parametrize("kind", averagers.AVERAGERS)
def test_applied_mean_gradient_is_the_direct_batch_gradient(mnist, kind):
    before, after = trained(mnist, kind, "gradient")
    d_before, d_after = trained(mnist, None, "gradient")
    for b, a, db, da in zip(before, after, d_before, d_after):
        np.testing.assert_array_equal(b, db)  # same seed, same start
        applied, expected = b - a, db - da
        assert np.abs(expected).max() > 1e-3  # a real gradient, not a no-op
        np.testing.assert_allclose(applied, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", averagers.AVERAGERS)
def test_weights_after_sgd_updates_are_the_direct_batch_weights(mnist, kind):
    before, after = trained(mnist, kind, "sgd")
    _, expected = trained(mnist, None, "sgd")
    for b, a, e in zip(before, after, expected):
        assert not np.array_equal(a, b)
        np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", averagers.AVERAGERS)
def test_weights_after_adam_updates_are_the_direct_batch_weights(mnist, kind):
    """Adam's step g / (sqrt(v) + 1e-8) turns float rounding into a visible difference
    where a gradient is near 1e-7 (one conv weight of 44,426 has such a gradient, and N
    mini-batches and one batch sum it in different orders). Elsewhere the weights must
    agree tightly."""
    before, after = trained(mnist, kind, "adam")
    _, expected = trained(mnist, None, "adam")
    g_before, g_after = trained(mnist, None, "gradient")
    for b, a, e, gb, ga in zip(before, after, expected, g_before, g_after):
        assert not np.array_equal(a, b)
        g = np.abs(gb - ga)  # the first update's gradient
        near_rounding = (g > 0) & (g <= 1e-5)
        assert near_rounding.mean() < 0.05
        np.testing.assert_allclose(a[~near_rounding], e[~near_rounding], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", [s for s in averagers.AVERAGERS if s != "stack"])
def test_averagers_apply_bit_identical_updates(mnist, kind):
    """Same mini-batch gradients, summed in the same order: the same bits as `stack`."""
    _, after = trained(mnist, kind, "adam")
    _, expected = trained(mnist, "stack", "adam")
    for a, e in zip(after, expected):
        np.testing.assert_array_equal(a, e)


@pytest.mark.parametrize("model_name,parameters", [("convnet", 44426),
                                                   ("mlp", MLP_PARAMETERS)])
def test_model_choice_builds_and_trains_a_step(mnist, model_name, parameters):
    config = config_lib.Config(batch_size=8, model=model_name)
    engine = engine_tf1.Engine(config, SEED)
    run = engine.run_graph
    with run.graph.as_default():
        assert model.count_parameters() == parameters
    try:
        variables = run.graph.get_collection(v1.GraphKeys.TRAINABLE_VARIABLES)
        before = engine.sess.run(variables)
        (images, labels), = data.batches(mnist.train, SEED, 8, 0, 1)
        # N=1: the step closes its window
        assert engine.step(images, labels, 1) is Outcome.APPLIED
        after = engine.sess.run(variables)
        logits = engine.sess.run(run.ops.logits, {run.images: mnist.test.images[:3]})
        assert engine.averager.updates == 1
        assert engine.loss_totals()[1] == 8  # the mini-batch's samples, its loss finite
    finally:
        engine.close()
    assert logits.shape == (3, 10)
    assert all(not np.array_equal(b, a) for b, a in zip(before, after))


def test_fused_window_is_stacked_into_a_buffer_a_session_feeds_without_a_copy():
    images = [np.random.default_rng(k).random((7, 28, 28, 1), np.float32) for k in range(3)]
    seeds = [np.array([SEED, k], np.int64) for k in range(3)]
    for arrays in (images, seeds):
        stacked, _ = window_lib.stack_padded(arrays, alignment=window_lib.FEED_ALIGNMENT)
        np.testing.assert_array_equal(stacked, np.stack(arrays))
        assert stacked.dtype == arrays[0].dtype and stacked.flags.c_contiguous
        assert stacked.ctypes.data % window_lib.FEED_ALIGNMENT == 0


# ---------------------------------------------------------------- TF1 code as users write it
# A tiny float64 model built with tf.Variable, as the TF1 tutorial builds mnist.inference:
# "exact" is allclose at rtol 1e-10, only the order of the sums differs.

RNG = np.random.RandomState(1)
X, Y = RNG.randn(200, 4), RNG.randn(200, 2)
W1, W2 = RNG.randn(4, 5), RNG.randn(5, 2)
RTOL, ATOL = 1e-10, 1e-12


class HalvingSGD(v1.train.GradientDescentOptimizer):
    """A wrapper's compute_gradients (as loss scaling or clipping wrappers have one)."""

    def compute_gradients(self, loss, **kwargs):
        return [(None if g is None else 0.5 * g, v)
                for g, v in super().compute_gradients(loss, **kwargs)]


OPTIMIZERS = {"sgd": lambda: v1.train.GradientDescentOptimizer(0.1),
              "adam": lambda: v1.train.AdamOptimizer(0.05),
              "halving_sgd": lambda: HalvingSGD(0.1)}


def tiny_loss(x, y):
    """x [B, 4] -> tanh(5) -> 2, mean squared error over the mini-batch."""
    w1, w2 = tf.Variable(W1, name="w1"), tf.Variable(W2, name="w2")
    return tf.reduce_mean(tf.square(tf.matmul(tf.tanh(tf.matmul(x, w1)), w2) - y))


def tiny_graph(kind, make_optimizer, n):
    x = v1.placeholder(tf.float64, [None, 4], "x")
    y = v1.placeholder(tf.float64, [None, 2], "y")
    averager = averagers.make_averager(
        kind, tiny_loss(x, y), make_optimizer(), n, loss_fn=tiny_loss, inputs=[x, y],
        global_step=v1.train.get_or_create_global_step(), check_finite=True)
    return x, y, averager


def tiny_batches(sizes):
    bounds = np.cumsum([0] + list(sizes))
    return [(X[a:b], Y[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]


def train_tiny(kind, make_optimizer, sizes, n):
    """The weights after training the mini-batches of `sizes`, N at a time, flushed."""
    with tf.Graph().as_default():
        x, y, averager = tiny_graph(kind, make_optimizer, n)
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            for images, labels in tiny_batches(sizes):
                averager.step(sess, {x: images, y: labels})
            averager.flush(sess)
            return sess.run(v1.trainable_variables())


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_fused_trains_a_tf_variable_model_weighting_unequal_minibatches(name):
    """A float64 loss, a model of tf.Variables built again by loss_fn, the optimizer's own
    compute_gradients, and a short last mini-batch weighted by its samples: windows of
    25, 25, 25, 7 and 10, 10, 10, 10 train exactly as direct batches of 82 and 40."""
    fused = train_tiny("fused", OPTIMIZERS[name], [25, 25, 25, 7, 10, 10, 10, 10], 4)
    direct = train_tiny("stack", OPTIMIZERS[name], [82, 40], 1)
    assert not np.allclose(direct[0], W1)
    for f, d in zip(fused, direct):
        np.testing.assert_allclose(f, d, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("kind", ["graph", "optimizer"])
def test_two_variable_windows_share_a_graph_under_auto_reuse(kind):
    """A GAN's two averagers, N=2 and N=3, in one reusing scope: each keeps its own
    window, so both train bit for bit as two `stack` averagers do."""
    def train(kind):
        with tf.Graph().as_default():
            x = v1.placeholder(tf.float64, [None, 4])
            y = v1.placeholder(tf.float64, [None, 2])
            with v1.variable_scope("gan", reuse=v1.AUTO_REUSE):
                d = v1.get_variable("d", initializer=W1)
                g = v1.get_variable("g", initializer=W2)
                loss = tf.reduce_mean(tf.square(tf.matmul(tf.tanh(tf.matmul(x, d)), g) - y))
                both = [averagers.make_averager(kind, sign * loss, v1.train.AdamOptimizer(0.05),
                                                n, var_list=[var])
                        for sign, n, var in ((1.0, 2, d), (-1.0, 3, g))]
            with v1.Session() as sess:
                sess.run(v1.global_variables_initializer())
                for images, labels in tiny_batches([8] * 6):
                    for averager in both:
                        averager.step(sess, {x: images, y: labels})
                assert [a.updates for a in both] == [3, 2]
                return sess.run([d, g])

    expected = train("stack")
    for a, e in zip(train(kind), expected):
        assert not np.array_equal(a, W1) and not np.array_equal(a, W2)
        np.testing.assert_array_equal(a, e)


@pytest.mark.parametrize("kind", ["graph", "optimizer"])
def test_a_saver_alone_restores_the_open_window_and_its_count(tmp_path, kind):
    """Saved after 2 mini-batches of a window of 3 and restored by a plain Saver (no
    restore_window): the 3rd mini-batch closes the window, as uninterrupted."""
    sizes, path = [8] * 8, str(tmp_path / "model.ckpt")

    def run(feeds, restore):
        with tf.Graph().as_default():
            x, y, averager = tiny_graph(kind, OPTIMIZERS["adam"], 3)
            saver = v1.train.Saver()
            with v1.Session() as sess:
                sess.run(v1.global_variables_initializer())
                if restore:
                    saver.restore(sess, path)
                closed = [averager.step(sess, {x: a, y: b})[1] for a, b in feeds]
                saver.save(sess, path)
                return closed, averager.flush(sess)[1], sess.run(v1.trainable_variables())

    feeds = tiny_batches(sizes)
    run(feeds[:2], restore=False)
    closed, flushed, resumed = run(feeds[2:], restore=True)
    none, applied = Outcome.NONE, Outcome.APPLIED
    assert closed == [applied, none, none, applied, none, none] and flushed is applied
    uninterrupted = run(feeds, restore=False)[2]
    direct = train_tiny("stack", OPTIMIZERS["adam"], [24, 24, 16], 1)
    for r, u, d in zip(resumed, uninterrupted, direct):
        np.testing.assert_array_equal(r, u)
        np.testing.assert_allclose(r, d, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("dtype", [tf.float16, tf.bfloat16])
@pytest.mark.parametrize("kind", averagers.AVERAGERS)
def test_low_precision_gradients_sum_in_float32_and_nonfinite_ones_are_caught(kind,
                                                                             dtype):
    """20 gradients of about 4e3: their float16 sum (8e4) would overflow 65504. A window
    with a real Inf is skipped whole."""
    with tf.Graph().as_default():
        grad = v1.placeholder(dtype, [3])
        w = tf.Variable(tf.zeros([3], dtype))

        def loss_fn(g):
            return tf.reduce_sum(w * g)  # its gradient is g

        averager = averagers.make_averager(
            kind, loss_fn(grad), v1.train.GradientDescentOptimizer(1.0), 20,
            loss_fn=loss_fn, inputs=[grad], check_finite=True)
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            for _ in range(20):
                averager.step(sess, {grad: [4000.0, 4096.0, 4224.0]})
            assert sess.run(w).astype(np.float32).tolist() == [-4000.0, -4096.0, -4224.0]
            for _ in range(19):
                averager.step(sess, {grad: [1.0, 1.0, 1.0]})
            assert averager.step(sess, {grad: [1.0, np.inf, 1.0]})[1] is Outcome.SKIPPED
            assert (averager.updates, averager.skipped_windows) == (1, 1)
            assert sess.run(w).astype(np.float32).tolist() == [-4000.0, -4096.0, -4224.0]
