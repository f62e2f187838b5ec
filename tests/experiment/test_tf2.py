"""The TF2 engine: the GradientTape accumulator, fit_accumulated, LR schedules, tf.distribute.

Logical devices and distribution strategies are process-global in TensorFlow, so every
test that uses a strategy runs in a subprocess; in this process only the default one runs.
"""

import json
import os
import re
import shutil

import keras
import numpy as np
import pytest
import tensorflow as tf
from absl.testing import flagsaver
from tensorflow.core.util import event_pb2

import main
import model as models
from experiment import checkpoint
from experiment import cli
from experiment import config as config_lib
from experiment import data
from experiment import engine_tf1
from experiment import engine_tf2
from experiment import loop
from gradient_averaging import tf2
from tests.helpers import run_cli
from tests.helpers import run_main_in_process
from tools import launch_workers
from trainer import Outcome

RUN_LINE = re.compile(r"^Training finished\. Best accuracy: ([\d.]+) at iteration (\d+)\. "
                      r"Final accuracy: ([\d.]+)\.$", re.M)
# Dropout off, a partial window (30 = 7 x 4 + 2) and a global batch of 121 that two
# replicas split unequally (60 / 61): every weighting by sample counts is exercised.
# The distributed tests split the CPU, even where a GPU is visible.
CPU_ONLY = {"CUDA_VISIBLE_DEVICES": ""}
DISTRIBUTED_ARGS = ("--engine=tf2", "--average-gradients=4", "--batch-size=121",
                    "--iterations=30", "--dropout=0", "--reps=1", "--eval-every=0")


def final_accuracies(output):
    return [float(m.group(3)) for m in RUN_LINE.finditer(output)]


def regression_mlp(seed=0):
    """A model that is not the ConvNet: a small MLP regressor with an L2 regularizer."""
    init = keras.initializers.GlorotUniform
    return keras.Sequential([
        keras.Input((3,)),
        keras.layers.Dense(8, activation="tanh", kernel_initializer=init(seed),
                           kernel_regularizer=keras.regularizers.L2(0.01)),
        keras.layers.Dense(1, kernel_initializer=init(seed + 1))])


def squared_error(y, prediction):
    return tf.square(y - prediction[:, 0])


def synthetic_data(n, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 3)).astype(np.float32)
    y = (x @ np.array([1.0, -2.0, 0.5], np.float32) + 0.1 * rng.normal(size=n)).astype(np.float32)
    return x, y


def weights(model):
    return [np.array(v) for v in model.get_weights()]


# ---------------------------------------------------------------- the model


def test_keras_convnet_matches_the_posts_architecture():
    net = models.keras_model("convnet", dropout=0.5, seed=3)
    assert net.count_params() == 44426
    assert net(np.zeros((2, 28, 28, 1), np.float32)).shape == (2, 10)
    kinds = [type(layer).__name__ for layer in net.layers]
    assert kinds.count("Dropout") == 5 and kinds.count("Conv2D") == 2
    assert all(not np.any(b) for b in net.get_weights()[1::2])  # zero biases
    same = models.keras_model("convnet", dropout=0.0, seed=3)
    other = models.keras_model("convnet", dropout=0.5, seed=4)
    assert "Dropout" not in [type(layer).__name__ for layer in same.layers]
    for a, b, c in zip(weights(net), weights(same), weights(other)):
        np.testing.assert_array_equal(a, b)  # the seed alone sets the initial weights
        assert a.shape == c.shape and (not np.any(a) or not np.array_equal(a, c))


# ---------------------------------------------------------------- exactness, one device


def test_unequal_mini_batches_apply_the_gradient_of_the_concatenated_batch():
    x, y = synthetic_data(16)
    slices = [(0, 1), (1, 5), (5, 16)]  # 1, 4 and 11 samples
    model = regression_mlp()
    start = weights(model)
    with tf.GradientTape() as tape:  # the reference: one batch of all 16 samples
        loss = tf.reduce_mean(squared_error(y, model(x, training=True))) + tf.add_n(model.losses)
    reference = [np.array(g) for g in tape.gradient(loss, model.trainable_variables)]

    accumulator = tf2.MiniBatchAccumulator(
        model, keras.optimizers.SGD(learning_rate=1.0), squared_error)
    for a, b in slices:
        accumulator.accumulate(x[a:b], y[a:b])
    accumulator.apply()
    applied = [w0 - w1 for w0, w1 in zip(start, weights(model))]  # SGD at lr 1: the gradient
    for got, want in zip(applied, reference):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)

    # The plain mean of the three mini-batch means is a different gradient: the test
    # above would see it.
    model_naive = regression_mlp()
    per_slice = []
    for a, b in slices:
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(squared_error(y[a:b], model_naive(x[a:b]))) + \
                tf.add_n(model_naive.losses)
        per_slice.append(tape.gradient(loss, model_naive.trainable_variables))
    naive = [np.mean([np.array(g[i]) for g in per_slice], axis=0) for i in range(len(reference))]
    assert max(np.abs(n - r).max() for n, r in zip(naive, reference)) > 1e-3
    # The window is emptied (its sums are assigned, not added to, by the next one's first).
    assert accumulator.window == 0 and float(accumulator.samples.read_value()) == 0.0
    assert int(accumulator.step.mini_batches.read_value()) == 0


def test_fit_accumulated_equals_big_batches_including_a_short_last_window():
    """40 samples in mini-batches of 4 at N=4: windows of 16, 16 and a partial 8."""
    x, y = synthetic_data(40, seed=1)
    dataset = tf.data.Dataset.from_tensor_slices((x, y))
    accumulated, direct = regression_mlp(seed=5), regression_mlp(seed=5)
    summary = tf2.fit_accumulated(accumulated, dataset.batch(4),
                                          keras.optimizers.Adam(0.05), squared_error,
                                          average_gradients=4)
    assert summary == tf2.FitSummary(mini_batches=10, updates=3, partial_window=2)
    summary = tf2.fit_accumulated(direct, dataset.batch(16),  # 16, 16, 8
                                          keras.optimizers.Adam(0.05), squared_error,
                                          average_gradients=1)
    assert summary == tf2.FitSummary(mini_batches=3, updates=3, partial_window=0)
    moved = False
    for a, b, w0 in zip(weights(accumulated), weights(direct), weights(regression_mlp(seed=5))):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
        moved |= not np.allclose(a, w0)
    assert moved


def test_a_mean_loss_is_refused():
    model = regression_mlp()
    x, y = synthetic_data(4)
    accumulator = tf2.MiniBatchAccumulator(
        model, keras.optimizers.SGD(0.1), lambda t, p: tf.reduce_mean(squared_error(t, p)))
    with pytest.raises(ValueError, match="one loss per sample"):
        accumulator.accumulate(x, y)


def infinite_loss_of_large_targets(y, prediction):
    """Squared error, plus an Inf loss (but no gradient) for targets above 100."""
    return squared_error(y, prediction) + tf.stop_gradient(
        tf.where(y > 100, tf.constant(np.inf, tf.float32), 0.0))


@pytest.mark.parametrize("poison", ["nan_input", "inf_loss_finite_gradient"])
def test_a_nonfinite_window_is_skipped_and_the_optimizer_does_not_step(poison):
    x, y = synthetic_data(12)
    bad_x, bad_y = x.copy(), y.copy()
    if poison == "nan_input":
        bad_x[5] = np.nan
    else:
        bad_y[5] = 1000.0
    model, optimizer = regression_mlp(), keras.optimizers.Adam(0.1)
    accumulator = tf2.MiniBatchAccumulator(model, optimizer,
                                                  infinite_loss_of_large_targets)
    start = weights(model)
    accumulator.accumulate(x[:4], y[:4])
    accumulator.accumulate(bad_x[4:8], bad_y[4:8])
    assert accumulator.apply() is False
    assert accumulator.skipped_windows == 1 and accumulator.updates == 0
    assert int(optimizer.iterations.numpy()) == 0  # LR schedules and update counts stay right
    for before, after in zip(start, weights(model)):
        np.testing.assert_array_equal(before, after)
    assert int(accumulator.step.mini_batches.read_value()) == 0  # the window emptied
    # The next window is applied as if the skipped one had never been.
    accumulator.accumulate(x[8:], y[8:])
    assert accumulator.apply() is True
    fresh = regression_mlp()
    fresh_accumulator = tf2.MiniBatchAccumulator(fresh, keras.optimizers.Adam(0.1),
                                                        squared_error)
    fresh_accumulator.accumulate(x[8:], y[8:])
    fresh_accumulator.apply()
    for got, want in zip(weights(model), weights(fresh)):
        np.testing.assert_array_equal(got, want)


# ---------------------------------------------------------------- LR schedules


def test_tf2_lr_schedule_counts_updates_not_mini_batches():
    x, y = synthetic_data(64)
    rates = {}
    for n in (1, 8):
        model = regression_mlp()
        optimizer = keras.optimizers.Adam(engine_tf2.learning_rate(0.1, "exponential", 2, 0.5))
        accumulator = tf2.MiniBatchAccumulator(model, optimizer, squared_error)
        for i in range(3 * n):  # three updates
            accumulator.accumulate(x[2 * i:2 * i + 2], y[2 * i:2 * i + 2])
            if accumulator.window == n:
                accumulator.apply()
        assert int(optimizer.iterations.numpy()) == 3
        rates[n] = float(optimizer.learning_rate.numpy())
    assert rates[1] == rates[8] == pytest.approx(0.1 * 0.5 ** 1.5)


def test_tf1_lr_schedule_counts_updates_not_mini_batches(mnist):
    rates = {}
    for n in (1, 8):
        config = config_lib.Config(average_gradients=n, batch_size=2, dropout=0.0,
                                   lr_schedule="exponential", learning_rate=0.1,
                                   lr_decay_steps=2, lr_decay_rate=0.5)
        run = engine_tf1.RunGraph(config, seed=0)
        with run.session() as sess:
            sess.run(run.init_op)
            for i in range(3 * n):  # three updates
                run.averager.step(sess, {run.images: mnist.train.images[2 * i:2 * i + 2],
                                         run.labels: mnist.train.labels[2 * i:2 * i + 2]})
            assert int(sess.run(run.global_step)) == 3
            rates[n] = float(sess.run(run.learning_rate))
    assert rates[1] == rates[8] == pytest.approx(0.1 * 0.5 ** 1.5)


# ---------------------------------------------------------------- the CLI engine


def tf2_config(**overrides):
    """A short tf2 run, dropout on: 12 windows of 5 mini-batches of 10."""
    return config_lib.Config(**dict(dict(engine="tf2", average_gradients=5, batch_size=10,
                                         iterations=60, eval_every=20), **overrides))


def stop_after(iteration, reason):
    """A should_stop that asks to stop once, after the given mini-batch."""
    calls = []

    def should_stop():
        calls.append(1)
        return reason if len(calls) == iteration else None

    return should_stop


@pytest.mark.slow
def test_tf2_stopped_mid_window_resumes_to_the_same_weights(tmp_path, mnist_quick):
    cfg = tf2_config()  # dropout on: the resumed run must draw the masks it would have
    uninterrupted = loop.train_once(cfg, mnist_quick, seed=4)
    directory = str(tmp_path / "ckpt")
    with pytest.raises(loop.Stopped, match=r"interrupted by SIGTERM; stopped at "
                       r"iteration 23 \(3 mini-batches in the open window\); checkpoint in"):
        loop.train_once(cfg, mnist_quick, seed=4, checkpoint_dir=directory,
                              checkpoint_every=2, should_stop=stop_after(23, "SIGTERM"))
    state = json.load(open(os.path.join(directory, checkpoint.STATE_FILE)))
    assert (state["iteration"], state["updates"], state["open_window"]) == (23, 4, 3)
    assert sorted(os.listdir(directory)) == [  # the periodic saves at updates 2 and 4 gone
        "model.ckpt-23.data-00000-of-00001", "model.ckpt-23.index", "state.json",
        "window-23.npz"]
    with pytest.raises(checkpoint.CheckpointError, match="made with batch_size=10"):
        loop.train_once(tf2_config(batch_size=20), mnist_quick, seed=4,
                              checkpoint_dir=directory)
    with pytest.raises(checkpoint.CheckpointError, match="made with engine=tf2"):
        loop.train_once(tf2_config(engine="tf1"), mnist_quick, seed=4,
                              checkpoint_dir=directory)
    corrupt = str(tmp_path / "corrupt")
    shutil.copytree(directory, corrupt)
    with open(os.path.join(corrupt, "model.ckpt-23.data-00000-of-00001"), "r+b") as f:
        f.truncate(100)
    with pytest.raises(checkpoint.CheckpointError, match="model.ckpt-23: unusable checkpoint"):
        loop.train_once(cfg, mnist_quick, seed=4, checkpoint_dir=corrupt)
    resumed = loop.train_once(cfg, mnist_quick, seed=4, checkpoint_dir=directory)
    assert resumed["weights_sha256"] == uninterrupted["weights_sha256"]
    for key in ("best_accuracy", "best_iteration", "final_accuracy", "updates"):
        assert resumed[key] == uninterrupted[key]
    # a finished run is kept, not trained again
    assert loop.train_once(cfg, mnist_quick, seed=4, checkpoint_dir=directory) == resumed
    assert os.listdir(directory) == [checkpoint.STATE_FILE]


def test_tf2_nonfinite_windows_are_skipped_whole(mnist_quick):
    # Windows 1-5 and 11-15 are bad, not in a row: the run goes on.
    poisoned = loop.train_once(tf2_config(inject_nonfinite=(2, 12), max_bad_windows=2),
                                     mnist_quick, seed=0)
    assert poisoned["skipped_windows"] == 2 and poisoned["updates"] == 10
    assert poisoned["final_accuracy"] > 12  # it learned: NaN weights would give ~9.8%
    # The bad samples elsewhere in the same windows: nothing of those windows was applied.
    reference = loop.train_once(tf2_config(inject_nonfinite=(4, 14)), mnist_quick, seed=0)
    assert poisoned["weights_sha256"] == reference["weights_sha256"]


def test_tf2_abort_and_max_bad_windows_stop_with_a_checkpoint(tmp_path, mnist_quick):
    directory = str(tmp_path / "ckpt")
    with pytest.raises(loop.Stopped, match="iterations 11-15 and on_nonfinite=abort; "
                                                 "stopped at iteration 15"):
        loop.train_once(tf2_config(on_nonfinite="abort", inject_nonfinite=(12,)), mnist_quick,
                              seed=0, checkpoint_dir=directory)
    state = json.load(open(os.path.join(directory, checkpoint.STATE_FILE)))
    assert (state["iteration"], state["updates"], state["skipped_windows"]) == (15, 2, 1)
    with pytest.raises(loop.Stopped, match="2 consecutive windows"):
        loop.train_once(tf2_config(max_bad_windows=2, inject_nonfinite=(3, 6, 7)),
                              mnist_quick, seed=0)


def test_tf2_cli_aborts_on_a_nonfinite_window_with_one_line(capsys):
    with pytest.raises(SystemExit) as exit_info:
        run_main_in_process("--engine=tf2", "--average-gradients=5", "--batch-size=10",
                            "--iterations=30", "--inject-nonfinite=7", "--on-nonfinite=abort")
    assert exit_info.value.code == 3
    errors = [line for line in capsys.readouterr().err.splitlines()
              if line.startswith("error: ")]
    assert len(errors) == 1 and "iterations 6-10 and on_nonfinite=abort" in errors[0]


@pytest.mark.slow
def test_tf2_engine_n_by_b_ends_like_one_batch_of_n_times_b(tmp_path, capsys, mnist_quick_dir):
    results = tmp_path / "tf2.json"
    common = ("--engine=tf2", "--dropout=0", "--eval-every=0", f"--data-dir={mnist_quick_dir}")
    run_main_in_process(*common, "--average-gradients=12", "--batch-size=10",
                        "--iterations=360", "--eval-every-updates=15", f"--results={results}",
                        f"--logdir={tmp_path / 'events'}")
    averaged_out = capsys.readouterr().out
    run_main_in_process(*common, "--average-gradients=1", "--batch-size=120",
                        "--iterations=30")
    direct_out = capsys.readouterr().out
    assert final_accuracies(averaged_out) == final_accuracies(direct_out)
    assert final_accuracies(direct_out)[0] > 50  # it learned
    assert "mean accuracy (1 runs):" in averaged_out
    doc = json.loads(results.read_text())
    assert doc["config"]["engine"] == "tf2"
    (run,) = doc["runs"]
    assert set(run) == {"seed", "best_accuracy", "best_iteration", "final_accuracy",
                        "updates", "skipped_windows", "train_seconds", "eval_seconds",
                        "weights_sha256", "evaluations", "out_of_memory"}
    assert run["out_of_memory"] == []  # nothing was halved
    assert run["updates"] == 30 and run["best_iteration"] in (180, 360)
    assert run["skipped_windows"] == 0 and len(run["weights_sha256"]) == 64
    assert run["final_accuracy"] == final_accuracies(averaged_out)[0]
    (events,) = (tmp_path / "events").rglob("events.out.tfevents.*")
    steps = {}
    for record in tf.data.TFRecordDataset(str(events)):
        event = event_pb2.Event.FromString(record.numpy())
        for value in event.summary.value:
            steps.setdefault(value.tag, []).append(event.step)
    assert steps["train/loss"] == list(range(1, 31))  # one per update
    assert steps["test/accuracy"] == [15, 30]  # every 15 updates, the last one final


@pytest.fixture(scope="module")
def distributed_args(mnist_dir):
    return (*DISTRIBUTED_ARGS, f"--data-dir={mnist_dir}")


@pytest.fixture(scope="module")
def single_process_accuracy(distributed_args):
    proc = run_cli(*distributed_args, env=CPU_ONLY)
    assert proc.returncode == 0, proc.stderr
    assert "not a multiple of average_gradients=4" in proc.stderr  # the partial window
    (accuracy,) = final_accuracies(proc.stdout)
    return accuracy


@pytest.mark.slow
def test_two_mirrored_replicas_end_like_one(single_process_accuracy, distributed_args):
    proc = run_cli(*distributed_args, "--distribute=mirrored", "--replicas=2", "--verbose",
                   env=CPU_ONLY)
    assert proc.returncode == 0, proc.stderr
    assert "--distribute=mirrored: 2 replicas in sync" in proc.stdout
    assert final_accuracies(proc.stdout) == [single_process_accuracy]


@pytest.mark.slow
def test_two_workers_train_together_and_end_like_one_process(single_process_accuracy,
                                                             distributed_args):
    codes, outputs = launch_workers.launch([*distributed_args[1:], "--verbose"], workers=2,
                                           timeout=240, env=CPU_ONLY)
    assert codes == [0, 0], outputs
    for output in outputs:
        assert "--distribute=multi_worker: 2 replicas in sync" in output
        assert final_accuracies(output) == [single_process_accuracy]


def test_parallel_mini_batches_train_the_same_bits_on_the_command_line(tmp_path,
                                                                     mnist_quick_dir):
    """--parallel-mini-batches=2 (dropout on): the weights of one pass at a time, with
    N=5 so that each window ends with one mini-batch alone."""
    shas = []
    for parallel in (1, 2):
        results = tmp_path / f"p{parallel}.json"
        run_main_in_process("--engine=tf2", "--average-gradients=5", "--batch-size=10",
                            "--iterations=20", "--eval-every=0", f"--data-dir={mnist_quick_dir}",
                            f"--parallel-mini-batches={parallel}", f"--results={results}")
        (run,) = json.loads(results.read_text())["runs"]
        assert run["updates"] == 4
        shas.append(run["weights_sha256"])
    assert shas[0] == shas[1]


@pytest.mark.parametrize("args, message", [
    (["--distribute=mirrored"], "--distribute needs --engine=tf2"),
    (["--parallel-mini-batches=2"], "--parallel-mini-batches needs --engine=tf2"),
    (["--engine=tf2", "--parallel-mini-batches=0"],
     "--parallel-mini-batches=0: 0 is not a positive"),
    (["--engine=tf2", "--replicas=2"], "--replicas needs --distribute=mirrored"),
    (["--engine=tf2", "--accumulate=fused"], "--accumulate picks a tf1 averager"),
    (["--lr-decay-rate=0"], "--lr-decay-rate must be in (0, 1]"),
])
def test_bad_tf2_flags_get_one_line(capsys, args, message):
    with flagsaver.flagsaver():
        with pytest.raises(SystemExit) as exit_info:
            cli.parse_flags(["main.py", *args])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_malformed_tf_config_gets_one_line(capsys, monkeypatch):
    monkeypatch.setenv("TF_CONFIG", "{not json")
    with flagsaver.flagsaver():
        cli.parse_flags(["main.py", "--engine=tf2", "--distribute=multi_worker", "--reps=1",
                         "--iterations=1", "--eval-every=0"])
        with pytest.raises(SystemExit) as exit_info:
            main.main(["main.py"])  # refused before any strategy is made
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: TF_CONFIG") and len(err.strip().splitlines()) == 1


def test_the_engine_trains_each_window_in_one_call_as_the_per_mini_batch_path(
        mnist, tmp_path):
    """engine_tf2.Engine buffers N mini-batches and trains them in one call, a partial
    window by its samples, with the ConvNet's dropout on; a saved open window resumes."""
    config = config_lib.Config(engine="tf2", average_gradients=3, batch_size=4)
    engine = engine_tf2.Engine(config, seed=1)
    batches = list(data.batches(mnist.train, 1, 4, 0, 8))  # windows of 3, 3 and a partial 2
    reference = tf2.MiniBatchAccumulator(  # one call per mini-batch
        models.keras_model("convnet", config.dropout, seed=1), keras.optimizers.Adam(1e-3),
        engine_tf2.sparse_cross_entropy)
    closed = []
    for iteration, (x, y) in enumerate(batches[:7], 1):
        closed.append(engine.step(x, y, iteration))
        reference.accumulate(x, y)
        if reference.window == 3:
            reference.apply()
    none, applied = Outcome.NONE, Outcome.APPLIED
    assert closed == [none, none, applied] * 2 + [none]
    # The open window, saved and restored into an engine that has trained on.
    ckpt = checkpoint.RunCheckpoint(str(tmp_path / "ckpt"), {})
    state = ckpt.save(engine, 7, {"open_window": engine.window_size()})
    window_file = os.path.join(ckpt.directory, state["window"])
    with open(window_file, "rb") as f:
        saved_window = f.read()
    np.savez(window_file)  # a window file without the open window: refused
    with pytest.raises(checkpoint.CheckpointError, match="does not hold the open window"):
        ckpt.restore(engine, state)
    with open(window_file, "wb") as f:
        f.write(saved_window)
    assert engine.step(*batches[7], 8) is none and engine.flush() is applied
    ckpt.restore(engine, ckpt.load())
    assert engine.window_size() == 1
    assert engine.step(*batches[7], 8) is none and engine.flush() is applied
    reference.accumulate(*batches[7])
    reference.apply()
    assert reference.updates == 3
    for a, b in zip(reference.model.get_weights(), engine.net.get_weights()):
        np.testing.assert_array_equal(a, b)
    assert engine.loss_totals() == pytest.approx(reference.loss_totals(), rel=1e-12)
    # Compiled once, in the engine's constructor: windows of 3 and 2 do not retrace.
    assert engine.accumulator.window_step.experimental_get_tracing_count() == 1
