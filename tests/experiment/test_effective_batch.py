"""--effective-batch-size=E: the command line says the batch per update, and cuts it into
mini-batches of --batch-size (or of the largest that fits: --batch-size=auto), the last
one shorter; each update is still that batch's.

In this process: the flags' contradictions, each engine's cut window against the direct
batch of E, and what the run prints and records. Under a memory limit (a main.py process
with the CPU as a BFC device): test_device_memory.py.
"""

import json

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.compat import v1

import main  # noqa: F401  (defines main.py's flags in this process)
from experiment import config as config_lib
from experiment import data
from experiment import loop
from tests.helpers import one_line_exit
from tests.helpers import run_main_in_process

E, B = 23, 5  # a prime E: no B but 1 and E divides it, so the last mini-batch is 3


@pytest.mark.parametrize("flags, message", [
    (["--effective-batch-size=20", "--average-gradients=2"],
     "--effective-batch-size=E replaces --average-gradients"),
    (["--batch-size=auto"], "--batch-size=auto finds the micro-batch of an effective batch"),
    (["--batch-size=auto", "--effective-batch-size=20"],
     "--batch-size=auto measures the tf2 engine's pass"),
    (["--effective-batch-size=23", "--batch-size=5"],
     "--batch-size does not divide --effective-batch-size"),
    (["--effective-batch-size=-1"], "--effective-batch-size=-1"),
    (["--batch-size=some"], "--batch-size=some"),
])
def test_contradictory_or_bad_flags_are_one_line_before_training(capsys, flags, message):
    line = one_line_exit(capsys, run_main_in_process, *flags)
    assert message in line, line


def weights(engine):
    """The trainable weights of either engine, as arrays."""
    if hasattr(engine, "net"):
        return [v.numpy() for v in engine.net.trainable_variables]
    graph = engine.run_graph.graph
    return engine.sess.run(graph.get_collection(v1.GraphKeys.TRAINABLE_VARIABLES))


def trained(config, mnist, windows):
    """An engine of `config` after `windows` windows of the loop's own batches."""
    engine = loop.engine_module(config.engine).Engine(config, seed=0)
    n = config.average_gradients
    sizes = [config_lib.mini_batch_size(config, i) for i in range(1, n * windows + 1)]
    for iteration, (images, labels) in enumerate(
            data.batches(mnist.train, 0, lambda i: sizes[i], 0, len(sizes)), start=1):
        engine.step(images, labels, iteration)
    return engine


@pytest.mark.parametrize("engine, accumulate", [
    pytest.param("tf2", "stack", marks=pytest.mark.slow), ("tf1", "fused")])
def test_each_window_of_e_cut_by_b_ends_like_the_direct_batch_of_e(mnist, engine, accumulate):
    """4 x 5 + 3 per update, three updates, dropout off: the direct batch of 23's weights.
    The samples are the same because the loop starts each mini-batch where the last
    ended (config.samples_before), the last mini-batch of a window E's rest."""
    common = dict(engine=engine, accumulate=accumulate, dropout=0.0, eval_every=0)
    cut = config_lib.with_micro_batch(
        config_lib.Config(effective_batch_size=E, batch_size=B, **common), B)
    assert (cut.average_gradients, config_lib.mini_batch_size(cut, 5)) == (5, 3)
    direct = config_lib.Config(average_gradients=1, batch_size=E, **common)
    got, want = weights(trained(cut, mnist, 3)), weights(trained(direct, mnist, 3))
    moved = weights(trained(direct, mnist, 0))
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    assert max(np.abs(b - c).max() for b, c in zip(want, moved)) > 1e-3  # it trained


def test_the_run_says_how_e_is_cut_and_records_e_b_n_and_the_last(tmp_path, capsys,
                                                                  mnist_quick_dir):
    results = tmp_path / "r.json"
    run_main_in_process("--engine=tf2", f"--effective-batch-size={E}", f"--batch-size={B}",
                        "--iterations=10", "--eval-every=0", f"--results={results}",
                        f"--data-dir={mnist_quick_dir}")
    out = capsys.readouterr().out
    assert out.splitlines()[0] == f"effective batch {E} = 4 x {B} + 3"
    document = json.loads(results.read_text())
    record = document["config"]
    assert (record["effective-batch-size"], record["batch-size"], record["average-gradients"],
            record["last-mini-batch"]) == (E, B, 5, 3)
    assert document["runs"][0]["updates"] == 2
    tf.keras.backend.clear_session()


@pytest.mark.parametrize("engine, accumulate", [("tf2", "stack"), ("tf1", "fused")])
def test_a_run_stopped_mid_window_resumes_where_e_left_off(tmp_path, mnist_quick, engine,
                                                           accumulate):
    """Stopped after 7 mini-batches (one window of 4 x 5 + 3, then 2 of the next): the
    resumed run starts at sample 33 (config.samples_before), not 35, and ends with the
    uninterrupted run's bits."""
    cfg = config_lib.with_micro_batch(config_lib.Config(
        engine=engine, accumulate=accumulate, effective_batch_size=E, batch_size=B,
        iterations=15, eval_every=0), B)
    uninterrupted = loop.train_once(cfg, mnist_quick, seed=1)
    directory = str(tmp_path / "ckpt")
    calls = [0]

    def stop_after_seven():
        calls[0] += 1
        return "SIGINT" if calls[0] == 7 else None

    with pytest.raises(loop.Stopped, match="2 mini-batches in the open window"):
        loop.train_once(cfg, mnist_quick, seed=1, checkpoint_dir=directory,
                        should_stop=stop_after_seven)
    resumed = loop.train_once(cfg, mnist_quick, seed=1, checkpoint_dir=directory)
    assert resumed["weights_sha256"] == uninterrupted["weights_sha256"]
    assert resumed["updates"] == uninterrupted["updates"] == 3
