"""AveragingOptimizer: one op per mini-batch, exact against the direct batch of N*B.

Every model here is tiny, dropout-free and float64 (unless the dtype is the point), so
"exact" means allclose at rtol 1e-10: only the order of the sums differs.
"""

import contextlib
import json
import os
import re
import runpy
import socket
import subprocess
import sys
import threading

import numpy as np
import pytest
import tensorflow as tf

from gradient_averaging import AveragingOptimizer
from gradient_averaging.arguments import check_average_gradients
from gradient_averaging.tf1 import FLUSH_OPS
from gradient_averaging.window import all_finite
from tests.helpers import ROOT
from tests.library import tf1_micro_batch_run
from tests.library.tf1_toys import B1
from tests.library.tf1_toys import EMBEDDING
from tests.library.tf1_toys import IDS
from tests.library.tf1_toys import OPTIMIZERS
from tests.library.tf1_toys import RNG
from tests.library.tf1_toys import ROWS
from tests.library.tf1_toys import RTOL
from tests.library.tf1_toys import SPARSE_OPTIMIZERS
from tests.library.tf1_toys import TARGETS
from tests.library.tf1_toys import W1
from tests.library.tf1_toys import W2
from tests.library.tf1_toys import WIDTH
from tests.library.tf1_toys import Model
from tests.library.tf1_toys import X
from tests.library.tf1_toys import Y
from tests.library.tf1_toys import assert_close
from tests.library.tf1_toys import concatenated
from tests.library.tf1_toys import minibatches
from tests.library.tf1_toys import mlp
from tests.library.tf1_toys import train
from tests.library.tf1_toys import train_embedding

v1 = tf.compat.v1
# ---------------------------------------------------------------- exactness, every optimizer

@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_n_minibatches_update_like_the_direct_batch(name, n):
    feeds = minibatches([4] * (2 * n))
    averaged, step = train(OPTIMIZERS[name], feeds, n)
    direct, direct_step = train(OPTIMIZERS[name], concatenated(feeds, n))
    assert step == direct_step == 2  # global_step counts updates, not mini-batches
    if n == 1:  # delegated straight to the wrapped optimizer: the same ops
        for a, d in zip(averaged, direct):
            np.testing.assert_array_equal(a, d)
    assert_close(averaged, direct)
    assert not np.allclose(averaged[0], W1)


def test_adam_slots_and_beta_powers_advance_once_per_update():
    with tf.Graph().as_default():
        model = mlp()
        adam = v1.train.AdamOptimizer(0.05, beta1=0.9, beta2=0.99)
        opt = AveragingOptimizer(adam, 3)
        train_op = opt.minimize(model.loss)
        beta1_power, beta2_power = adam._get_beta_accumulators()  # noqa: SLF001 (no public getter)
        saved = set(v1.global_variables())
        assert {beta1_power, beta2_power} | {adam.get_slot(v, "m") for v in model.variables} \
            <= saved  # outside the cond, saved by a Saver
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            for x, y in minibatches([4] * 7):
                sess.run(train_op, {model.x: x, model.y: y})
            powers = sess.run([beta1_power, beta2_power])
            count, = [v for v in opt.variables() if v.op.name == "AveragingAdam/count"]
            window = sess.run([opt.accumulator(model.variables[0]), count])
    beta = np.float32([0.9, 0.99])  # float32 variables: the initial value times 2 updates
    np.testing.assert_array_equal(powers, beta * beta * beta)
    assert window[1] == 1 and np.any(window[0] != 0)  # the 7th mini-batch waits


def test_weighted_short_last_minibatch_equals_the_direct_batch_of_82():
    feeds = minibatches([25, 25, 25, 7])
    for name in ("sgd", "adam"):
        averaged, _ = train(OPTIMIZERS[name], feeds, 4, weighted=True)
        direct, _ = train(OPTIMIZERS[name], concatenated(feeds, 4))
        unweighted, _ = train(OPTIMIZERS[name], feeds, 4)
        assert_close(averaged, direct)
        assert not np.allclose(unweighted[0], direct[0], rtol=1e-6)  # weights matter here


def test_a_masked_sequence_loss_weighed_by_its_valid_tokens_is_the_direct_batch():
    """examples/tf1_masked_sequences.py: each run's weight its valid tokens
    (tf.sequence_mask), so the window's update is the token mean's over all its
    sequences; weighing the runs alike, as the post does, is not."""
    example = runpy.run_path(os.path.join(ROOT, "examples", "tf1_masked_sequences.py"))
    assert example["difference"] < 1e-5
    direct, alike = example["direct"], example["train"](4, 8, weighted=False)
    assert max(float(np.abs(a - b).max()) for a, b in zip(direct, alike)) > 1e-3


def test_flush_op_applies_a_partial_window_and_is_a_noop_on_an_empty_one():
    feeds = minibatches([4, 4])
    flushed, step = train(OPTIMIZERS["adam"], feeds, 3, flush=True)
    direct, _ = train(OPTIMIZERS["adam"], concatenated(feeds, 2))
    assert step == 1
    assert_close(flushed, direct)
    untouched, step = train(OPTIMIZERS["adam"], [], 3, flush=True)
    assert step == 0
    assert_close(untouched, [W1, B1, W2], rtol=0, atol=0)
    full, step = train(OPTIMIZERS["adam"], minibatches([4] * 3), 3, flush=True)
    assert step == 1  # the window was applied and reset by the 3rd run: nothing to flush


@pytest.mark.parametrize("weighted", [False, True])
def test_accumulate_gradients_only_adds_and_flush_op_applies_any_window(weighted):
    """The loop decides when a window ends (the experiment's `graph` averager): 5 mini-batches with
    N=3 stay open until flushed, then update as the direct batch of 5 (weighted: 5 of
    unequal sizes)."""
    feeds = minibatches([4, 6, 4, 3, 5] if weighted else [4] * 5)
    with tf.Graph().as_default():
        model = mlp()
        global_step = v1.train.get_or_create_global_step()
        opt = AveragingOptimizer(OPTIMIZERS["adam"](), 3)
        weight = tf.cast(tf.shape(model.x)[0], tf.float64) if weighted else None
        accumulate = opt.accumulate_gradients(
            opt.compute_gradients(model.loss), global_step=global_step, weight=weight)
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            for x, y in feeds:
                sess.run(accumulate, {model.x: x, model.y: y})
            assert sess.run([opt.window_count, global_step]) == [5, 0]
            sess.run(opt.flush_op())
            assert sess.run([opt.window_count, global_step]) == [0, 1]
            accumulated = sess.run(model.variables)
    direct, _ = train(OPTIMIZERS["adam"], concatenated(feeds, 5))
    assert_close(accumulated, direct)


# ---------------------------------------------------------------- bad use

def test_bad_use_gets_one_clear_error():
    for n, error in ((0, ValueError), (-1, ValueError), (2.5, TypeError), (2.0, TypeError),
                     (True, TypeError), (None, TypeError), ("4", TypeError)):
        with pytest.raises(error, match=r"^average_gradients must be an int >= 1"):
            AveragingOptimizer(v1.train.GradientDescentOptimizer(0.1), n)
    assert AveragingOptimizer(v1.train.GradientDescentOptimizer(0.1),
                              np.int64(3)).average_gradients == 3
    assert check_average_gradients(np.int32(2), "n") == 2
    with pytest.raises(TypeError, match=r"^--average-gradients must be an int >= 1.*False"):
        check_average_gradients(False, "--average-gradients")
    with pytest.raises(ValueError, match="v1.train.Optimizer"):
        AveragingOptimizer(tf.keras.optimizers.SGD(0.1), 2)
    for arg in ("transform_gradients", "after_update"):
        with pytest.raises(TypeError, match=f"^{arg} must be a function"):
            AveragingOptimizer(v1.train.GradientDescentOptimizer(0.1), 2, **{arg: [1]})
    with tf.Graph().as_default():
        model = mlp()
        unused = v1.get_variable("unused", [3], tf.float64)
        opt = AveragingOptimizer(v1.train.GradientDescentOptimizer(0.1), 2)
        with pytest.raises(RuntimeError, match="minimize or apply_gradients"):
            opt.flush_op()
        with pytest.raises(RuntimeError, match="minimize or apply_gradients"):
            opt.skipped_windows  # noqa: B018 (reading it raises)
        with pytest.raises(ValueError, match="no variable receives a gradient"):
            opt.minimize(model.loss, var_list=[unused])
        with pytest.raises(ValueError, match="scalar"):
            opt.minimize(model.loss, weight=tf.ones([2]))
        opt.minimize(model.loss)
        with pytest.raises(RuntimeError, match="one window"):
            opt.minimize(model.loss)


# ---------------------------------------------------------------- hooks and sessions

def test_monitored_session_hooks_fetch_the_loss_and_stop_after_k_updates(tmp_path):
    n, updates = 3, 2
    feeds = minibatches([4] * 12)
    with tf.Graph().as_default():
        model = mlp()
        global_step = v1.train.get_or_create_global_step()
        v1.summary.scalar("loss", model.loss)
        opt = AveragingOptimizer(OPTIMIZERS["adam"](), n)
        train_op = opt.minimize(model.loss, global_step=global_step)
        hooks = [v1.train.NanTensorHook(model.loss),
                 v1.train.LoggingTensorHook({"loss": model.loss}, every_n_iter=1),
                 v1.train.StopAtStepHook(last_step=updates)]
        runs = 0
        with v1.train.MonitoredTrainingSession(checkpoint_dir=str(tmp_path), hooks=hooks,
                                               save_summaries_steps=1) as sess:
            while not sess.should_stop():
                x, y = feeds[runs]
                sess.run(train_op, {model.x: x, model.y: y})
                runs += 1
        with v1.Session() as sess:
            v1.train.Saver().restore(sess, v1.train.latest_checkpoint(str(tmp_path)))
            weights, step = sess.run(model.variables), sess.run(global_step)
    assert runs == updates * n and step == updates
    direct, _ = train(OPTIMIZERS["adam"], concatenated(feeds[:runs], n))
    assert_close(weights, direct)
    assert any(name.startswith("events.") for name in os.listdir(tmp_path))


def test_update_ops_run_once_per_minibatch_and_flush_needs_no_feed():
    """Batch norm's moving mean, from tf.nn.moments, under control_dependencies(UPDATE_OPS)."""
    decay, n = 0.9, 3
    with tf.Graph().as_default():
        model = mlp()
        hidden = tf.matmul(model.x, model.variables[0])
        mean, variance = tf.nn.moments(hidden, axes=[0])
        moving_mean = v1.get_variable("moving_mean", initializer=tf.zeros([5], tf.float64),
                                      trainable=False)
        v1.add_to_collection(v1.GraphKeys.UPDATE_OPS, v1.assign(
            moving_mean, decay * moving_mean + (1 - decay) * mean))
        normalized = (hidden - mean) / tf.sqrt(variance + 1e-3)
        loss = model.loss + tf.reduce_mean(tf.square(normalized[:, :2] - model.y))
        opt = AveragingOptimizer(OPTIMIZERS["sgd"](), n)
        with tf.control_dependencies(v1.get_collection(v1.GraphKeys.UPDATE_OPS)):
            train_op = opt.minimize(loss)
        expected = np.zeros(5)
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            for k, (x, y) in enumerate(minibatches([4] * 5)):
                _, batch_mean = sess.run([train_op, mean], {model.x: x, model.y: y})
                expected = decay * expected + (1 - decay) * batch_mean
                np.testing.assert_allclose(sess.run(moving_mean), expected, rtol=RTOL)
                changed = not np.array_equal(sess.run(model.variables[0]), W1)
                assert changed == (k + 1 >= n)  # weights move at the Nth mini-batch only
            after_updates = sess.run(model.variables[0])
            sess.run(opt.flush_op())  # the 2 open mini-batches; the update ops do not run
            assert not np.array_equal(sess.run(model.variables[0]), after_updates)
            np.testing.assert_allclose(sess.run(moving_mean), expected, rtol=RTOL)


class _StopAfter(v1.train.SessionRunHook):
    """Asks the session to stop after `runs` runs: a stop that leaves a window open."""

    def __init__(self, runs):
        self.runs, self.done = runs, 0

    def after_run(self, run_context, run_values):
        self.done += 1
        if self.done >= self.runs:
            run_context.request_stop()


@pytest.mark.parametrize("end, where, runs, saved_step", [
    ("end of data", "chief_only_hooks", 24, 5),  # 4 windows of 5, then 4 mini-batches
    ("stop hook", "chief_only_hooks", 13, 3),  # 2 windows, then 3
    ("end of data", "hooks", 24, 4),  # TensorFlow's order: after the final save
])
def test_flush_hook_applies_the_last_window_before_the_final_checkpoint(
        tmp_path, end, where, runs, saved_step):
    """MonitoredTrainingSession over a tf.data input that runs out, or stopped by a hook:
    with flush_hook() in chief_only_hooks the final checkpoint holds the partial window's
    update, at the direct batch's weights and global step; in `hooks` it does not."""
    n = 5
    feeds = minibatches([4] * 24)
    with tf.Graph().as_default():
        x, y = v1.data.make_one_shot_iterator(
            tf.data.Dataset.from_tensor_slices((X, Y)).batch(4)).get_next()
        model = mlp(x, y)
        global_step = v1.train.get_or_create_global_step()
        opt = AveragingOptimizer(OPTIMIZERS["adam"](), n)
        train_op = opt.minimize(model.loss, global_step=global_step)
        hooks = {where: [opt.flush_hook()]}
        if end == "stop hook":
            hooks.setdefault("hooks", []).append(_StopAfter(runs))
        done = 0
        with v1.train.MonitoredTrainingSession(checkpoint_dir=str(tmp_path), **hooks) as sess:
            while not sess.should_stop():  # OutOfRangeError ends the session at the data's end
                sess.run(train_op)
                done += 1
    assert done == runs
    checkpoint = tf.train.load_checkpoint(str(tmp_path))
    assert checkpoint.get_tensor("global_step") == saved_step
    windows = concatenated(feeds[:runs], n)  # the direct batch of each window
    assert len(windows) == saved_step + (where == "hooks")  # there, the last is not in it
    direct, _ = train(OPTIMIZERS["adam"], windows[:saved_step])
    assert_close([checkpoint.get_tensor(name) for name in ("w1", "b1", "w2")], direct)


# ---------------------------------------------------------------- checkpoints

def _build_adam(n=3):
    model = mlp()
    global_step = v1.train.get_or_create_global_step()
    train_op = AveragingOptimizer(OPTIMIZERS["adam"](), n).minimize(
        model.loss, global_step=global_step)
    return model, global_step, train_op


def test_saver_mid_window_restores_the_open_window_exactly(tmp_path):
    feeds = minibatches([4] * 8)
    uninterrupted, _ = train(OPTIMIZERS["adam"], feeds, 3)
    path = str(tmp_path / "model.ckpt")
    with tf.Graph().as_default():
        model, _, train_op = _build_adam()
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            for x, y in feeds[:4]:  # 1 update and 1 mini-batch of the next window
                sess.run(train_op, {model.x: x, model.y: y})
            v1.train.Saver().save(sess, path)
    with tf.Graph().as_default():
        model, global_step, train_op = _build_adam()
        with v1.Session() as sess:
            v1.train.Saver().restore(sess, path)
            assert sess.run(global_step) == 1
            for x, y in feeds[4:]:
                sess.run(train_op, {model.x: x, model.y: y})
            resumed, step = sess.run(model.variables), sess.run(global_step)
    assert step == 2
    for r, u in zip(resumed, uninterrupted):
        np.testing.assert_array_equal(r, u)


def test_monitored_session_stopped_mid_window_resumes_to_the_same_weights(tmp_path):
    feeds = minibatches([4] * 8)
    uninterrupted, _ = train(OPTIMIZERS["adam"], feeds, 3)
    for part in (feeds[:4], feeds[4:]):  # stops after 1 update + 1 mini-batch
        with tf.Graph().as_default():
            model, global_step, train_op = _build_adam()
            with v1.train.MonitoredTrainingSession(checkpoint_dir=str(tmp_path)) as sess:
                for x, y in part:
                    sess.run(train_op, {model.x: x, model.y: y})
    with tf.Graph().as_default():
        model, global_step, _ = _build_adam()
        with v1.Session() as sess:
            v1.train.Saver().restore(sess, v1.train.latest_checkpoint(str(tmp_path)))
            resumed, step = sess.run(model.variables), sess.run(global_step)
    assert step == 2
    assert_close(resumed, uninterrupted)


# ---------------------------------------------------------------- two optimizers

def test_two_optimizers_under_auto_reuse_keep_separate_windows():
    """A GAN's D (SGD, N=2) and G (Adam, N=3), built in one AUTO_REUSE scope."""
    feeds = minibatches([4] * 6)
    with tf.Graph().as_default():
        ops, models, opts = [], [], []
        for scope, name, n in (("d", "sgd", 2), ("g", "adam", 3)):
            with v1.variable_scope("gan", reuse=v1.AUTO_REUSE), v1.variable_scope(scope):
                model = mlp()
                opt = AveragingOptimizer(OPTIMIZERS[name](), n)
                ops.append(opt.minimize(model.loss, var_list=model.variables))
            models.append(model)
            opts.append(opt)
        d_window, g_window = ({v for v in o.variables() if "Averaging" in v.name} for o in opts)
        assert d_window and g_window and not d_window & g_window
        assert len({v.name for v in d_window | g_window}) == len(d_window | g_window)
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            for x, y in feeds:
                sess.run(ops, {m.x: x for m in models} | {m.y: y for m in models})
            d, g = (sess.run(m.variables) for m in models)
    assert_close(d, train(OPTIMIZERS["sgd"], concatenated(feeds, 2))[0])
    assert_close(g, train(OPTIMIZERS["adam"], concatenated(feeds, 3))[0])


# ---------------------------------------------------------------- float16 and check_finite

def _linear(dtype, size=3):
    """loss = sum(w * c): the gradient of w is the fed c, whatever w is."""
    c = v1.placeholder(dtype, [size], name="c")
    w = v1.get_variable("w", initializer=tf.zeros([size], dtype))
    return Model(c, None, tf.reduce_sum(w * c), [w])


@pytest.mark.parametrize("dtype", [tf.float16, tf.bfloat16])
def test_low_precision_gradients_sum_in_float32(dtype):
    numpy_dtype = dtype.as_numpy_dtype
    grads = (4000.0 + 7.0 * np.arange(20)[:, None] + np.arange(3)).astype(numpy_dtype)
    if dtype == tf.float16:
        with np.errstate(over="ignore"):
            assert np.isinf(np.sum(grads, axis=0, dtype=np.float16)).all()  # the trap
    with tf.Graph().as_default():
        model = _linear(dtype)
        opt = AveragingOptimizer(v1.train.GradientDescentOptimizer(1.0), 20)
        train_op = opt.minimize(model.loss)
        assert opt.accumulator(model.variables[0]).dtype.base_dtype == tf.float32
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            for g in grads:
                sess.run(train_op, {model.x: g})
            w = sess.run(model.variables[0])
    expected = -grads.astype(np.float32).mean(axis=0).astype(numpy_dtype)
    assert np.isfinite(w.astype(np.float32)).all()
    np.testing.assert_array_equal(w, expected)


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_check_finite_skips_the_window_and_counts_it(bad, n):
    grads = np.arange(6 * n, dtype=np.float32).reshape(2 * n, 3) / 10
    grads[n // 2, 1] = bad  # in the first window
    with tf.Graph().as_default():
        model = _linear(tf.float32)
        global_step = v1.train.get_or_create_global_step()
        opt = AveragingOptimizer(v1.train.GradientDescentOptimizer(0.5), n,
                                 check_finite=True)
        train_op = opt.minimize(model.loss, global_step=global_step)
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            for g in grads[:n]:
                sess.run(train_op, {model.x: g})
            assert sess.run([opt.skipped_windows, global_step]) == [1, 0]
            np.testing.assert_array_equal(sess.run(model.variables[0]), np.zeros(3))
            if n > 1:  # reset: nothing of the bad window is left to poison the next
                np.testing.assert_array_equal(
                    sess.run(opt.accumulator(model.variables[0])), np.zeros(3))
            for g in grads[n:]:
                sess.run(train_op, {model.x: g})
            assert sess.run([opt.skipped_windows, global_step]) == [1, 1]
            w = sess.run(model.variables[0])
    np.testing.assert_allclose(w, -0.5 * grads[n:].mean(axis=0), rtol=1e-6)


# ---------------------------------------------------------------- memory

def test_no_executor_keeps_a_variable_sized_constant_of_the_window():
    """Grappler folds a zeros_like of a known shape into a constant, which the executor
    that runs it keeps for good: one per accumulator, per branch and per op. The window's
    initializers, train op and flush op (each run, the apply included) hold none."""
    with tf.Graph().as_default():
        x = v1.placeholder(tf.float32, [None, 64])
        w = tf.Variable(tf.ones([64, 32]), name="w")
        opt = AveragingOptimizer(v1.train.AdamOptimizer(0.1), 2)
        train_op = opt.minimize(tf.reduce_sum(tf.matmul(x, w)))
        feed = {x: np.ones([3, 64], np.float32)}
        consts = []
        with v1.Session() as sess:
            for fetch in (v1.global_variables_initializer(), train_op, train_op, train_op,
                          opt.flush_op()):
                metadata = v1.RunMetadata()
                sess.run(fetch, feed, options=v1.RunOptions(output_partition_graphs=True),
                         run_metadata=metadata)
                consts += [(node.name, node.attr["value"].tensor.tensor_shape)
                           for graph in metadata.partition_graphs for node in graph.node
                           if node.op == "Const" and node.name.startswith("AveragingAdam/")]
    assert consts and not [c for c in consts if tf.TensorShape(c[1]) == w.shape], consts


# ---------------------------------------------------------------- sparse gradients

@pytest.mark.parametrize("name", sorted(SPARSE_OPTIMIZERS))
def test_sparse_gradients_stay_sparse_and_match_the_direct_batch(name):
    feeds = list(zip(np.array(IDS), TARGETS))
    averaged, tables, wrapped, opt, window = train_embedding(SPARSE_OPTIMIZERS[name], feeds, 2)
    direct, direct_tables, _, _, _ = train_embedding(
        SPARSE_OPTIMIZERS[name], concatenated(feeds, 2))
    assert_close(averaged, direct)
    assert_close(tables, direct_tables)
    if name != "adam":  # sparse-aware: rows 0-3 stay still while window 2 touches 5-8
        np.testing.assert_array_equal(tables[1][:4], tables[0][:4])
        np.testing.assert_array_equal(tables[1][9], EMBEDDING[9])
    if name == "momentum":  # the accumulated table gradient reached Momentum sparse
        assert all(types[0] is tf.IndexedSlices for types in wrapped.applied_types)
    # memory: one dense accumulator per variable (the table's only one), left zeroed
    table_sized = [a for a in window if a.shape == (ROWS, WIDTH)]
    assert len(table_sized) == 1 and not table_sized[0].any()
    assert [a.dtype for a in window if a.shape == (ROWS,)] == [bool]  # touched rows


# ---------------------------------------------------------------- legacy models, hooks

class HalvedGradientDescent(v1.train.GradientDescentOptimizer):
    """A wrapper-style optimizer whose compute_gradients rescales (as loss scaling does)."""

    calls = 0

    def compute_gradients(self, *args, **kwargs):
        HalvedGradientDescent.calls += 1
        return [(None if g is None else 0.5 * g, v)
                for g, v in super().compute_gradients(*args, **kwargs)]


def tutorial_inference():
    """The TF1 tutorial's mnist.inference, small: tf.Variable layers, name scopes."""
    images = v1.placeholder(tf.float64, [None, 4], name="images")
    labels = v1.placeholder(tf.int32, [None], name="labels")
    hidden = images
    for scope, shape in (("hidden1", (4, 6)), ("hidden2", (6, 5)), ("softmax_linear", (5, 3))):
        with v1.name_scope(scope):
            weights = tf.Variable(RNG.randn(*shape) / 2, name="weights")
            biases = tf.Variable(np.zeros(shape[1]), name="biases")
            hidden = tf.matmul(hidden, weights) + biases
            if scope != "softmax_linear":
                hidden = tf.nn.relu(hidden)
    loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=labels, logits=hidden))
    return Model(images, labels, loss, v1.trainable_variables())


def test_tf_variable_model_uses_the_wrapped_compute_gradients():
    labels = (X[:, 0] > 0).astype(np.int32) + (X[:, 1] > 0)
    feeds = [(X[k:k + 5], labels[k:k + 5]) for k in range(0, 30, 5)]
    state = RNG.get_state()

    def build():
        RNG.set_state(state)  # the same initial weights in both graphs
        return tutorial_inference()

    HalvedGradientDescent.calls = 0
    averaged, _ = train(lambda: HalvedGradientDescent(0.4), feeds, 3, build=build)
    assert HalvedGradientDescent.calls == 1
    direct, _ = train(lambda: v1.train.GradientDescentOptimizer(0.2),
                      concatenated(feeds, 3), build=build)
    assert_close(averaged, direct)


def test_transform_gradients_clips_the_mean_by_global_norm():
    grads = np.array([[3.0, 0.0, 4.0], [1.0, 2.0, 0.0], [2.0, 1.0, 2.0]])

    def clip(pairs):
        clipped, _ = tf.clip_by_global_norm([g for g, _ in pairs], 1.5)
        return list(zip(clipped, [v for _, v in pairs]))

    with tf.Graph().as_default():
        model = _linear(tf.float64)
        opt = AveragingOptimizer(v1.train.GradientDescentOptimizer(0.1), 3,
                                 transform_gradients=clip)
        train_op = opt.minimize(model.loss)
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            for g in grads:
                sess.run(train_op, {model.x: g})
            w = sess.run(model.variables[0])
    mean = grads.mean(axis=0)  # norm 3: clipped to 1.5 (per mini-batch it would differ)
    learning_rate = np.float64(np.float32(0.1))  # a float32 tensor, cast to the variable's
    np.testing.assert_allclose(w, -learning_rate * mean * 1.5 / np.linalg.norm(mean),
                               rtol=RTOL)


# ---------------------------------------------------------------- the docs and legacy mode

DOCS = os.path.join(ROOT, "docs", "tf1-code.md")


def test_docs_examples_run_in_order(tmp_path, monkeypatch, capsys):
    """docs/tf1-code.md's Python blocks, as one script (later ones reuse earlier names)."""
    with open(DOCS) as f:
        blocks = re.findall(r"```python\n(.*?)```", f.read(), flags=re.S)
    assert len(blocks) >= 7
    monkeypatch.chdir(tmp_path)  # checkpoints and summaries land here
    namespace = {}
    for k, block in enumerate(blocks):
        exec(compile(block, f"{DOCS} [python block {k}]", "exec"), namespace)
    out = capsys.readouterr().out
    assert "part 0 ran 6 mini-batches" in out and "part 1 ran 6 mini-batches" in out
    assert "[-4000.0, -4100.0, -4200.0]" in out and "\n3\n" in out


LEGACY = """
import numpy as np, tensorflow as tf
tf.compat.v1.disable_v2_behavior()  # reference variables and v1 cond, as in legacy code
from tests.library import tf1_toys as t
for name in ("adam", "momentum"):
    feeds = t.minibatches([4] * 6)
    t.assert_close(t.train(t.OPTIMIZERS[name], feeds, 3)[0],
                   t.train(t.OPTIMIZERS[name], t.concatenated(feeds, 3))[0])
feeds = list(zip(np.array(t.IDS), t.TARGETS))
t.assert_close(t.train_embedding(t.SpyMomentum, feeds, 2)[0],
               t.train_embedding(t.SpyMomentum, t.concatenated(feeds, 2))[0])
print("legacy ok")
"""


@pytest.mark.slow
def test_legacy_v1_behavior():
    """Under disable_v2_behavior (a separate process: it is global)."""
    env = dict(os.environ, PYTHONPATH=ROOT)
    done = subprocess.run([sys.executable, "-c", LEGACY], capture_output=True, text=True,
                          env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "legacy ok" in done.stdout


def test_all_finite_is_one_scalar_over_every_tensor():
    with tf.Graph().as_default(), v1.Session() as sess:
        ok = all_finite([tf.ones([2, 3]), tf.constant(1.0, tf.float64)])
        nan = all_finite([tf.ones([2]), tf.constant([1.0, np.nan])])
        inf = all_finite([tf.constant([-np.inf], tf.float16)])
        assert ok.shape == () and ok.dtype == tf.bool
        assert sess.run([ok, nan, inf, all_finite([])]) == [True, False, False, True]


def test_all_finite_sees_opposite_infinities_and_does_not_overflow_a_narrow_type():
    """float32 is checked by its sum: +Inf and -Inf together sum to NaN, not to a finite
    number. float16 is checked element by element: finite values whose sum is over
    float16's largest (65504) are finite."""
    with tf.Graph().as_default(), v1.Session() as sess:
        checks = [all_finite([tf.constant([np.inf, -np.inf, 1.0])]),
                  all_finite([tf.constant([np.inf, -np.inf], tf.float64)]),
                  all_finite([tf.fill([8], tf.constant(60000.0, tf.float16))]),
                  all_finite([tf.constant([3e38, 1.0])])]
        assert sess.run(checks) == [False, False, True, True]


# ---------------------------------------------------------------- export

def _feeds_xy(feeds):
    return [{"x:0": x, "y:0": y} for x, y in feeds]


def test_meta_graph_and_saved_model_load_and_continue_mid_window_exactly(tmp_path):
    """Saved with 1 update and 1 mini-batch open; re-imported without the Python code, the
    train op (GraphKeys.TRAIN_OP) and flush op (FLUSH_OPS) continue to the bits of an
    uninterrupted run, and the graph serves inference."""
    feeds = _feeds_xy(minibatches([4] * 9))
    ckpt, exported = str(tmp_path / "model.ckpt"), str(tmp_path / "saved_model")
    with tf.Graph().as_default() as graph:
        model, global_step, train_op = _build_adam()
        opt_flush, = v1.get_collection(FLUSH_OPS)
        assert v1.get_collection(v1.GraphKeys.TRAIN_OP) == [train_op]
        for key in graph.get_all_collection_keys():  # nothing from inside a cond's branch
            for item in graph.get_collection(key):
                assert getattr(item, "graph", graph) is graph, (key, item)
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            for feed in feeds[:4]:
                sess.run(train_op, feed)
            v1.train.Saver().save(sess, ckpt)
            v1.saved_model.simple_save(sess, exported, {"x": model.x}, {"loss": model.loss})
            for feed in feeds[4:]:
                sess.run(train_op, feed)
            sess.run(opt_flush)  # the 9th mini-batch, alone
            uninterrupted = sess.run(model.variables + [global_step])
    assert uninterrupted[-1] == 3

    def resume(sess):
        train, = v1.get_collection(v1.GraphKeys.TRAIN_OP)
        flush = sess.graph.get_operation_by_name(v1.get_collection(FLUSH_OPS)[0].name)
        assert flush.name == "AveragingAdam/flush" and train.name == "AveragingAdam/train"
        loss = sess.run("Mean:0", feeds[0])  # inference: the loss of the restored weights
        assert np.isfinite(loss)
        for feed in feeds[4:]:
            sess.run(train, feed)
        sess.run(flush)
        variables = {v.op.name: v for v in v1.global_variables()}
        return sess.run([variables[k] for k in ("w1", "b1", "w2", "global_step")])

    with tf.Graph().as_default():
        saver = v1.train.import_meta_graph(ckpt + ".meta")
        with v1.Session() as sess:
            saver.restore(sess, ckpt)
            from_meta = resume(sess)
    with tf.Graph().as_default():
        with v1.Session() as sess:
            v1.saved_model.loader.load(sess, [v1.saved_model.tag_constants.SERVING], exported)
            from_saved_model = resume(sess)
    for resumed in (from_meta, from_saved_model):
        for r, u in zip(resumed, uninterrupted):
            np.testing.assert_array_equal(r, u)


# ---------------------------------------------------------------- threads

@pytest.mark.parametrize("weighted", [False, True])
def test_concurrent_runs_never_mix_windows(weighted):
    """8 threads x 150 runs of one train op (N=2, every gradient 1.0, weights random):
    each update must be the mean of exactly 2 mini-batches, so with SGD at rate 1 every
    weight is exactly -updates, and updates * N + the open count is every run. Without
    the lock, most such trials end with NaN, or a count or mean that is off."""
    n, threads, runs = 2, 8, 150
    with tf.Graph().as_default():
        w = tf.Variable(tf.zeros([256], tf.float64))
        weight = v1.placeholder(tf.float64, [])
        global_step = v1.train.get_or_create_global_step()
        opt = AveragingOptimizer(v1.train.GradientDescentOptimizer(1.0), n)
        train_op = opt.minimize(tf.reduce_sum(w), global_step=global_step,
                                weight=weight if weighted else None)
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())

            def work(seed):
                rng = np.random.RandomState(seed)
                for _ in range(runs):
                    sess.run(train_op, {weight: rng.uniform(1, 2)})

            workers = [threading.Thread(target=work, args=(k,)) for k in range(threads)]
            for t in workers:
                t.start()
            for t in workers:
                t.join()
            weights, updates, count, skipped = sess.run(
                [w, global_step, opt.window_count, opt.skipped_windows])
    assert updates * n + count == threads * runs and skipped == 0
    np.testing.assert_array_equal(weights, np.full(256, -float(updates)))


# ---------------------------------------------------------------- names and slots

@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_wrapped_optimizer_variables_and_slots_answer_as_without_the_wrapper(name, n):
    def build(wrap):
        model = mlp()
        wrapped = OPTIMIZERS[name]()
        opt = AveragingOptimizer(wrapped, n) if wrap else wrapped
        with v1.name_scope("train"):
            opt.minimize(model.loss, global_step=v1.train.get_or_create_global_step())
        return model, wrapped, opt

    with tf.Graph().as_default():
        model, plain, _ = build(wrap=False)
        plain_names = sorted(v.op.name for v in v1.global_variables())
        plain_slots = plain.get_slot_names()
    with tf.Graph().as_default():
        model, wrapped, opt = build(wrap=True)
        window = opt.window_variables()
        assert sorted(v.op.name for v in v1.global_variables() if v not in window) == plain_names
        assert opt.get_slot_names() == plain_slots
        for slot in plain_slots:  # Adagrad's own "accumulator" included
            for var in model.variables:
                assert opt.get_slot(var, slot) is wrapped.get_slot(var, slot) is not None
        assert opt.variables() == wrapped.variables() + window
        assert {v.op.name for v in window} == {
            f"train/{opt.get_name()}/{leaf}" for leaf in ("count", "weight_sum",
                                                          "skipped_windows")} | {
            f"train/{opt.get_name()}/{v.op.name}/accumulator" for v in model.variables}
        assert opt.accumulator(model.variables[0]) in window


def _window_free_saver(opt):
    """The documented way to read a plain run's checkpoint into a wrapped graph."""
    window = opt.window_variables()
    return v1.train.Saver(var_list=[v for v in v1.global_variables() if v not in window])


def test_checkpoints_move_between_plain_and_wrapped_runs(tmp_path, n=3):
    """plain 2 updates -> wrapped 2 updates (N mini-batches each) -> plain 2 updates equals
    6 plain updates on the direct batches (Adam's powers and slots carried across; N=1's
    bits are the plain optimizer's: test_n_minibatches_update_like_the_direct_batch)."""
    feeds = minibatches([4] * (6 * n))
    direct = concatenated(feeds, n)
    expected, expected_step = train(OPTIMIZERS["adam"], direct)
    path = str(tmp_path / "model.ckpt")
    for part, wrap in enumerate((False, True, False)):
        with tf.Graph().as_default():
            model = mlp()
            global_step = v1.train.get_or_create_global_step()
            opt = AveragingOptimizer(OPTIMIZERS["adam"](), n) if wrap else OPTIMIZERS["adam"]()
            train_op = opt.minimize(model.loss, global_step=global_step)
            with v1.Session() as sess:
                sess.run(v1.global_variables_initializer())
                if part:
                    (_window_free_saver(opt) if wrap else v1.train.Saver()).restore(sess, path)
                for x, y in (feeds[2 * n:4 * n] if wrap else direct[2 * part:2 * part + 2]):
                    sess.run(train_op, {model.x: x, model.y: y})
                v1.train.Saver().save(sess, path)
                weights, step = sess.run(model.variables), sess.run(global_step)
    assert step == expected_step == 6
    assert_close(weights, expected)


# ---------------------------------------------------------------- another N

def test_open_window_restored_into_another_n_is_applied_not_dropped(tmp_path):
    """N=4 saved with 3 mini-batches open: in a graph with N=1 or 2 the next run closes
    that window with them, with N=5 flush_op does, as the direct batch of 4 would."""
    feeds = minibatches([4] * 8)
    path = str(tmp_path / "model.ckpt")
    with tf.Graph().as_default():
        model, global_step, train_op = _build_adam(n=4)
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            for x, y in feeds[:7]:
                sess.run(train_op, {model.x: x, model.y: y})
            v1.train.Saver().save(sess, path)
    direct, _ = train(OPTIMIZERS["adam"], concatenated(feeds, 4))
    for new_n in (1, 2, 5):
        with tf.Graph().as_default():
            model = mlp()
            global_step = v1.train.get_or_create_global_step()
            opt = AveragingOptimizer(OPTIMIZERS["adam"](), new_n)
            train_op = opt.minimize(model.loss, global_step=global_step)
            with v1.Session() as sess:
                v1.train.Saver().restore(sess, path)
                assert sess.run(opt.window_count) == 3
                sess.run(train_op, {model.x: feeds[7][0], model.y: feeds[7][1]})
                assert sess.run(opt.window_count) == (4 if new_n == 5 else 0)
                sess.run(opt.flush_op())
                resumed, step = sess.run(model.variables), sess.run(global_step)
        assert step == 2, new_n
        assert_close(resumed, direct)


# ---------------------------------------------------------------- graph contexts

def _in_process_cluster():
    """A parameter server and a worker in this process, on free local ports."""
    def free_port():
        with socket.socket() as s:
            s.bind(("localhost", 0))
            return s.getsockname()[1]
    cluster = tf.train.ClusterSpec({"ps": [f"localhost:{free_port()}"],
                                    "worker": [f"localhost:{free_port()}"]})
    tf.distribute.Server(cluster, job_name="ps", task_index=0)
    return cluster, tf.distribute.Server(cluster, job_name="worker", task_index=0).target


GRAPH_CONTEXTS = ["cond", "while_loop", "loss_scale_outside_dynamic",
                  "loss_scale_inside_dynamic", "loss_scale_inside_fixed",
                  "replica_device_setter"]


@pytest.mark.parametrize("context", GRAPH_CONTEXTS)
def test_any_graph_context_trains_like_the_direct_batch(context):
    """minimize inside a caller's cond or while_loop, inside or outside a loss-scale
    optimizer, under replica_device_setter: 6 mini-batches with N=4 (the last 2 flushed)
    update as the direct batches of 4 and 2; variables() holds the window."""
    dtype = tf.float32 if "loss_scale" in context else tf.float64
    grads = (np.arange(18).reshape(6, 3) / 7 - 1).astype(dtype.as_numpy_dtype)
    loss_scale = tf.compat.v1.train.experimental.MixedPrecisionLossScaleOptimizer
    target, device = "", contextlib.nullcontext
    if context == "replica_device_setter":
        cluster, target = _in_process_cluster()

        def device():
            return v1.device(v1.train.replica_device_setter(ps_tasks=1, cluster=cluster))

    def run(direct):
        with tf.Graph().as_default(), device():
            c = v1.placeholder(dtype, [None, 3], name="c")
            w = tf.Variable(tf.ones([3], dtype), name="w")
            global_step = v1.train.get_or_create_global_step()

            def loss_of(row):
                return tf.reduce_sum(tf.square(w) * row)

            adam = v1.train.AdamOptimizer(0.1)
            if direct:
                opt = wrapper = adam
            elif context == "loss_scale_outside_dynamic":
                wrapper = AveragingOptimizer(adam, 4)
                opt = loss_scale(wrapper, "dynamic")
            else:
                scale = 128.0 if context == "loss_scale_inside_fixed" else "dynamic"
                wrapped = loss_scale(adam, scale) if "inside" in context else adam
                opt = wrapper = AveragingOptimizer(wrapped, 4)
            if context == "cond" and not direct:
                train = tf.cond(v1.placeholder_with_default(True, []),
                                lambda: opt.minimize(loss_of(c[0]), global_step=global_step),
                                tf.no_op)
            elif context == "while_loop" and not direct:  # every fed row in one run
                def body(i):
                    with tf.control_dependencies([opt.minimize(loss_of(c[i]),
                                                               global_step=global_step)]):
                        return i + 1
                train = tf.while_loop(lambda i: i < tf.shape(c)[0], body, [0])
            else:
                train = opt.minimize(loss_of(c[0]), global_step=global_step)
            with v1.Session(target) as sess:
                sess.run(v1.global_variables_initializer())
                if direct:
                    for rows in (grads[:4], grads[4:]):
                        sess.run(train, {c: rows.mean(axis=0, keepdims=True)})
                    return sess.run([w, global_step])
                for rows in ([grads] if context == "while_loop" else grads[:, None]):
                    sess.run(train, {c: rows})
                assert sess.run(wrapper.window_count) == 2
                sess.run(wrapper.flush_op())
                assert set(wrapper.window_variables()) <= set(wrapper.variables())
                if context == "replica_device_setter":
                    assert {v.device for v in wrapper.variables()} == {w.device}
                return sess.run([w, global_step])

    (averaged, step), (direct, direct_step) = run(direct=False), run(direct=True)
    assert step == direct_step == 2
    np.testing.assert_allclose(averaged, direct, rtol=1e-6 if dtype == tf.float32 else RTOL)


# ---------------------------------------------------------------- per-update ops

def test_after_update_steps_an_ema_once_per_update_as_the_direct_batch():
    """An EMA of the weights attached with after_update= (N=3, 8 mini-batches, the last 2
    flushed) equals the cifar10 idiom's EMA, ema.apply under control_dependencies([train
    op]), on the 3 direct batches."""
    feeds = minibatches([4] * 8)

    def shadows(n, attach):
        with tf.Graph().as_default():
            model = mlp()
            global_step = v1.train.get_or_create_global_step()
            ema = v1.train.ExponentialMovingAverage(0.5)
            after = (lambda: ema.apply(model.variables)) if attach == "after_update" else None
            opt = OPTIMIZERS["adam"]() if n is None else AveragingOptimizer(
                OPTIMIZERS["adam"](), n, after_update=after)
            train_op = opt.minimize(model.loss, global_step=global_step)
            if attach == "control_dependencies":
                with tf.control_dependencies([train_op]):
                    train_op = ema.apply(model.variables)
            with v1.Session() as sess:
                sess.run(v1.global_variables_initializer())
                for x, y in (feeds if n else concatenated(feeds, 3)):
                    sess.run(train_op, {model.x: x, model.y: y})
                if n:
                    sess.run(opt.flush_op())
                return sess.run([ema.average(v) for v in model.variables] + [global_step])

    direct = shadows(None, "control_dependencies")
    attached = shadows(3, "after_update")
    assert attached[-1] == direct[-1] == 3
    assert_close(attached, direct)


# ---------------------------------------------------------------- bad use

@pytest.mark.parametrize("n, weights", [(4, [1, -1, 1, -1]), (4, [0, 0, 0, 0]),
                                        (4, [1, -3, 0.5, 0]), (1, [0]), (1, [-2])])
def test_window_whose_weights_sum_to_zero_or_less_is_skipped_and_counted(n, weights):
    grads = np.arange(3 * 2 * n, dtype=np.float64).reshape(2 * n, 3) / 10 + 1
    good_weights = np.arange(1.0, n + 1)
    with tf.Graph().as_default():
        model = _linear(tf.float64)
        weight = v1.placeholder(tf.float64, [])
        global_step = v1.train.get_or_create_global_step()
        opt = AveragingOptimizer(v1.train.GradientDescentOptimizer(1.0), n)
        train_op = opt.minimize(model.loss, global_step=global_step, weight=weight)
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            for g, k in zip(grads[:n], weights):
                sess.run(train_op, {model.x: g, weight: k})
            assert sess.run([opt.skipped_windows, global_step, opt.window_count]) == [1, 0, 0]
            np.testing.assert_array_equal(sess.run(model.variables[0]), np.zeros(3))
            np.testing.assert_array_equal(sess.run(opt.accumulator(model.variables[0])),
                                          np.zeros(3))
            for g, k in zip(grads[n:], good_weights):  # the next window is whole
                sess.run(train_op, {model.x: g, weight: k})
            assert sess.run([opt.skipped_windows, global_step]) == [1, 1]
            w = sess.run(model.variables[0])
    expected = -np.average(grads[n:], axis=0, weights=good_weights)
    np.testing.assert_allclose(w, expected, rtol=RTOL)


@pytest.mark.slow
def test_find_micro_batch_trains_a_graph_the_direct_batch_does_not_fit_in(tmp_path):
    """tf1.find_micro_batch under a 48 MiB limit (a process of its own, the CPU as a BFC
    device): the plain direct batch of a prime E runs out of memory there; the graph
    finds B (no B divides E: the last mini-batch is shorter), the search leaves the
    weights as they were, and two updates cut into mini-batches of B, each weighted by
    its samples, reach the direct batch's weights (computed here, without the limit)."""
    from tools import memory
    proc = subprocess.run(
        [sys.executable, "-m", "tests.library.tf1_micro_batch_run", f"--out={tmp_path}"],
        cwd=ROOT, env=memory.probe_env(48), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    found, e = result["found"], tf1_micro_batch_run.E
    assert result["direct"] == "out of memory" and result["unchanged"]
    assert 1 < found["micro_batch_size"] < e and found["effective_batch"] == e
    assert found["last"] < found["micro_batch_size"] and found["peak"] <= 48 << 20
    with np.load(tmp_path / "tf1.npz") as saved:
        got = [saved[f"arr_{i}"] for i in range(len(saved.files))]
    want = tf1_micro_batch_run.direct()
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
