"""The averaging mechanism: exactness against one big batch, update counts, partial windows."""

import math

import numpy as np
import pytest
import tensorflow as tf

import model
import trainer
from experiment import averagers
from experiment import config as config_lib
from experiment import data
from experiment import engine_tf1
from experiment import loop
from trainer import Outcome

v1 = tf.compat.v1
N, B = 4, 25


def batches(mnist, count, size, seed=0):
    stream = data.SampleStream(len(mnist.train.labels), seed)
    return [stream.next_batch(mnist.train, size) for _ in range(count)]


def build_run(n, optimizer="sgd", accumulate="stack", seed=3):
    """An engine_tf1.RunGraph with dropout off; `optimizer` sgd swaps Adam for plain SGD."""
    config = config_lib.Config(average_gradients=n, batch_size=B, dropout=0.0,
                               accumulate=accumulate)
    if optimizer == "sgd":
        return engine_tf1.RunGraph(config, seed, optimizer=v1.train.GradientDescentOptimizer(0.1))
    return engine_tf1.RunGraph(config, seed)


def weights(sess):
    return sess.run(v1.trainable_variables())


def test_convnet_has_the_posts_parameter_count():
    run = build_run(1, optimizer="adam")
    with run.graph.as_default():
        assert model.count_parameters() == 44426
    assert run.graph.finalized


def test_fed_mean_gradient_equals_the_gradient_of_the_concatenated_batch(mnist):
    run = build_run(N)
    feeds = batches(mnist, N, B)
    with run.session() as sess:
        sess.run(run.init_op)
        window = [sess.run(run.averager.grad_op, {run.images: x, run.labels: y})
                  for x, y in feeds]
        mean = trainer.average_gradients(window)
        big = sess.run(run.averager.grad_op,
                       {run.images: np.concatenate([x for x, _ in feeds]),
                        run.labels: np.concatenate([y for _, y in feeds])})
    assert len(mean) == len(big) == 10
    for m, g in zip(mean, big):
        assert m.shape == g.shape
        np.testing.assert_allclose(m, g, rtol=1e-5, atol=1e-7)
    # the mean is not trivially equal to any single mini-batch's gradient
    assert not np.allclose(window[0][0], big[0], rtol=1e-3)


def test_average_gradients_is_the_posts_stack_mean():
    window = [[np.full((2, 3), k, np.float32), np.array([k, -k], np.float32)]
              for k in (1.0, 2.0, 6.0)]
    mean = trainer.average_gradients(window)
    np.testing.assert_array_equal(mean[0], np.full((2, 3), 3.0))
    np.testing.assert_array_equal(mean[1], [3.0, -3.0])


def test_one_sgd_update_of_n_mini_batches_equals_the_big_batch_update(mnist):
    feeds = batches(mnist, N, B)
    averaged, direct = build_run(N), build_run(1)
    with averaged.session() as sess:
        sess.run(averaged.init_op)
        start = weights(sess)
        for x, y in feeds:
            averaged.averager.step(sess, {averaged.images: x, averaged.labels: y})
        after_averaged = weights(sess)
    with direct.session() as sess:
        sess.run(direct.init_op)
        np.testing.assert_array_equal(weights(sess)[0], start[0])  # same seed, same start
        direct.averager.step(sess, {direct.images: np.concatenate([x for x, _ in feeds]),
                                    direct.labels: np.concatenate([y for _, y in feeds])})
        after_direct = weights(sess)
    for a, d, s in zip(after_averaged, after_direct, start):
        assert not np.array_equal(a, s)
        np.testing.assert_allclose(a, d, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("iterations,n", [(12, 4), (10, 3), (7, 1), (2, 5)])
def test_apply_runs_ceil_iterations_over_n_times_and_adam_counts_them(mnist, iterations, n):
    run = build_run(n, optimizer="adam")
    applied, closed = [], []
    with run.session() as sess:
        sess.run(run.init_op)
        for x, y in batches(mnist, iterations, 5):
            closed.append(run.averager.step(sess, {run.images: x, run.labels: y})[1])
            applied.append(run.averager.updates)
        held = run.averager.window_size()
        _, flushed = run.averager.flush(sess)
        expected = math.ceil(iterations / n)
        assert run.averager.updates == expected
        assert sess.run(run.global_step) == expected
        beta1_power = [v for v in run.graph.get_collection("variables")
                       if "beta1_power" in v.name]
        assert len(beta1_power) == 1  # Adam's step count lives in beta1^(t+1)
        np.testing.assert_allclose(sess.run(beta1_power[0]), 0.9 ** (expected + 1), rtol=1e-5)
    assert held == iterations % n and flushed is (Outcome.APPLIED if held else Outcome.NONE)
    # updates happen exactly at every N-th mini-batch, and the step says so
    assert applied == [(k + 1) // n for k in range(iterations)]
    assert closed == [Outcome.APPLIED if (k + 1) % n == 0 else Outcome.NONE
                      for k in range(iterations)]


def test_partial_window_applies_the_mean_of_what_it_holds(mnist):
    run = build_run(3)
    feeds = batches(mnist, 11, B)
    with run.session() as sess:
        sess.run(run.init_op)
        for x, y in feeds[:9]:
            run.averager.step(sess, {run.images: x, run.labels: y})
        assert run.averager.updates == 3 and run.averager.window_size() == 0
        before = weights(sess)
        tail = feeds[9:]
        grads = [sess.run(run.averager.grad_op, {run.images: x, run.labels: y}) for x, y in tail]
        for x, y in tail:
            run.averager.step(sess, {run.images: x, run.labels: y})
        assert run.averager.window_size() == 2
        assert run.averager.flush(sess) == ([], Outcome.APPLIED)
        assert run.averager.flush(sess) == ([], Outcome.NONE)  # nothing left to apply
        after = weights(sess)
    assert run.averager.updates == 4
    mean = trainer.average_gradients(grads)
    for b, a, g in zip(before, after, mean):
        np.testing.assert_allclose(a, b - 0.1 * g, rtol=1e-5, atol=1e-6)


def test_works_on_a_users_graph_and_skips_variables_without_gradient():
    rng = np.random.default_rng(0)
    xs = rng.normal(size=(64, 3)).astype(np.float32)
    ys = rng.normal(size=(64, 1)).astype(np.float32)
    with tf.Graph().as_default():
        x = v1.placeholder(tf.float32, [None, 3])
        y = v1.placeholder(tf.float32, [None, 1])
        w = v1.get_variable("w", [3, 1], initializer=v1.ones_initializer())
        unused = v1.get_variable("unused", [2], initializer=v1.zeros_initializer())
        frozen = v1.get_variable("frozen", [1], initializer=v1.ones_initializer())
        loss = tf.reduce_mean((tf.matmul(x, w) * frozen - y) ** 2)
        averager = trainer.GradientAverager(loss, v1.train.GradientDescentOptimizer(0.5), 4,
                                            var_list=[w, unused])
        assert averager.variables == [w]  # `unused` has no gradient, `frozen` not listed
        assert len(averager.grad_placeholders) == 1
        big_grad = tf.gradients(loss, w)[0]
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            expected = sess.run(w) - 0.5 * sess.run(big_grad, {x: xs, y: ys})
            for k in range(4):
                averager.step(sess, {x: xs[16 * k:16 * (k + 1)], y: ys[16 * k:16 * (k + 1)]})
            np.testing.assert_allclose(sess.run(w), expected, rtol=1e-5)
            np.testing.assert_array_equal(sess.run(frozen), [1.0])


def test_rejects_n_below_one_and_unknown_averagers():
    with tf.Graph().as_default():
        w = v1.get_variable("w", [1])
        loss = tf.reduce_sum(w)
        with pytest.raises(ValueError, match="average_gradients"):
            trainer.GradientAverager(loss, v1.train.GradientDescentOptimizer(1.0), 0)
        with pytest.raises(ValueError, match="unknown averager"):
            averagers.make_averager("magic", loss, v1.train.GradientDescentOptimizer(1.0), 2)


@pytest.mark.slow
def test_every_averager_ends_with_the_same_bits_with_dropout_on(mnist_quick):
    """Same samples, same stateless dropout masks, sums in the same order: same weights.

    This is what lets `make reproduce` use the fastest averager without changing a number.
    """
    digests = {}
    for averager in averagers.AVERAGERS:
        config = config_lib.Config(average_gradients=4, batch_size=10, iterations=42,
                                   eval_every=0, dropout=0.5, accumulate=averager)
        digests[averager] = loop.train_once(config, mnist_quick, seed=5)["weights_sha256"]
    assert len(set(digests.values())) == 1, digests
    other_seed = loop.train_once(config, mnist_quick, seed=6)["weights_sha256"]
    assert other_seed != digests["stack"]
