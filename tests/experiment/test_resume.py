"""Long runs: interruption and exact resume, refusal to mix configs, determinism, NaNs.

Runs compare with each other here, so they evaluate on QUICK_TEST_IMAGES test images."""

import json
import os
import selectors
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import main  # noqa: F401  (defines main.py's flags in this process)
from experiment import averagers
from experiment import checkpoint
from experiment import cli
from experiment import config as config_lib
from experiment import loop
from tests.helpers import ROOT
from tests.helpers import one_line_exit
from tests.helpers import run_cli
from tests.helpers import run_main_in_process

SMALL = dict(average_gradients=5, batch_size=10, iterations=60, eval_every=20)


def config(**overrides):
    return config_lib.Config(**dict(SMALL, **overrides))


def stop_at(iteration_to_stop, counter):
    """A should_stop that asks to stop once, after the given mini-batch."""
    def should_stop():
        counter[0] += 1
        return "SIGINT" if counter[0] == iteration_to_stop else None
    return should_stop


# ---------------------------------------------------------------- exact resume, in process

@pytest.mark.parametrize("averager", averagers.AVERAGERS)
def test_stopped_mid_window_resumes_to_the_same_weights(tmp_path, mnist_quick, averager):
    cfg = config(accumulate=averager)
    uninterrupted = loop.train_once(cfg, mnist_quick, seed=4)
    directory = str(tmp_path / "ckpt")
    with pytest.raises(loop.Stopped, match="3 mini-batches in the open window"):
        loop.train_once(cfg, mnist_quick, seed=4, checkpoint_dir=directory,
                              should_stop=stop_at(23, [0]))  # 23 = 4 windows of 5, + 3
    state = json.load(open(os.path.join(directory, checkpoint.STATE_FILE)))
    assert state["iteration"] == 23 and state["updates"] == 4 and not state["finished"]
    resumed = loop.train_once(cfg, mnist_quick, seed=4, checkpoint_dir=directory)
    assert resumed["weights_sha256"] == uninterrupted["weights_sha256"]
    for key in ("best_accuracy", "best_iteration", "final_accuracy", "updates"):
        assert resumed[key] == uninterrupted[key]
    # a finished run is kept, not trained again
    again = loop.train_once(cfg, mnist_quick, seed=4, checkpoint_dir=directory)
    assert again == resumed
    assert os.listdir(directory) == [checkpoint.STATE_FILE]


def test_a_resumed_command_says_where_it_continues_and_a_finished_one_that_nothing_is_left(
        tmp_path, mnist_quick):
    """train_reps' first line: none on a fresh start; the run and the update it resumes
    after; nothing left to train once every run is finished."""
    cfg = config(iterations=30, eval_every=0)
    runs = config_lib.Runs(reps=2, checkpoint_dir=str(tmp_path))
    commands = []
    for should_stop in (stop_at(30 + 13, [0]), None, None):  # run 2 stops at iteration 13
        lines = []
        try:
            loop.train_reps(cfg, mnist_quick, runs, should_stop=should_stop, log=lines.append)
        except loop.Stopped:
            pass
        commands.append(lines)
    assert commands[0][0].startswith("Training finished.")  # run 1; nothing said first
    assert commands[1][0] == ("resuming run 2 of 2 after update 2 of 6 (iteration 13 of 30), "
                              f"from its checkpoint in {tmp_path}/rep-1; run 1 is finished "
                              "(its result as saved)")
    assert commands[2][0] == (f"nothing left to train: the 2 runs in {tmp_path} are finished "
                              "(their results as saved)")
    assert commands[1][1:] == commands[2][1:]  # the runs' lines and the summary, as saved


def test_the_resume_line_names_the_run_it_goes_on_with():
    runs = config_lib.Runs(reps=4, checkpoint_dir="ck")
    finished, partial = {"finished": True}, {"finished": False, "updates": 7, "iteration": 35}
    assert loop.resume_line(config(), runs, [None] * 4) is None
    assert loop.resume_line(config(), runs, [finished, finished, None, None]) == (
        "resuming with run 3 of 4 in ck; runs 1-2 are finished (their results as saved)")
    assert loop.resume_line(config(), runs, [partial, None, None, None]) == (
        "resuming run 1 of 4 after update 7 of 12 (iteration 35 of 60), from its checkpoint "
        "in ck/rep-0")
    assert loop.resume_line(config(), config_lib.Runs(reps=1, checkpoint_dir="ck"),
                            [finished]) == (
        "nothing left to train: the run in ck is finished (its result as saved)")


def test_periodic_checkpoints_keep_only_the_latest_files(tmp_path, mnist_quick):
    directory = str(tmp_path / "ckpt")
    with pytest.raises(loop.Stopped):
        loop.train_once(config(average_gradients=2), mnist_quick, seed=0,
                              checkpoint_dir=directory, checkpoint_every=3,
                              should_stop=stop_at(41, [0]))
    names = sorted(os.listdir(directory))
    assert names == ["model.ckpt-41.data-00000-of-00001", "model.ckpt-41.index",
                     "state.json", "window-41.npz"]


# ---------------------------------------------------------------- refusals

@pytest.mark.parametrize("change,named", [
    (dict(average_gradients=4), "average_gradients=5"),
    (dict(batch_size=20), "batch_size=10"),
    (dict(accumulate="graph"), "accumulate=stack"),
    (dict(model="mlp"), "model=convnet"),
])
def test_refuses_a_checkpoint_of_another_configuration(tmp_path, mnist_quick, change, named):
    directory = str(tmp_path / "ckpt")
    with pytest.raises(loop.Stopped):
        loop.train_once(config(), mnist_quick, seed=0, checkpoint_dir=directory,
                              should_stop=stop_at(7, [0]))
    with pytest.raises(checkpoint.CheckpointError, match=named):
        loop.train_once(config(**change), mnist_quick, seed=0, checkpoint_dir=directory)
    with pytest.raises(checkpoint.CheckpointError, match="seed=0"):
        loop.train_once(config(), mnist_quick, seed=1, checkpoint_dir=directory)


def test_cli_mismatch_corrupt_and_missing_checkpoints_give_one_line(tmp_path, capsys,
                                                                  mnist_quick_dir):
    base = ["--average-gradients=5", "--batch-size=10", "--iterations=30",
            f"--checkpoint-dir={tmp_path}", "--checkpoint-every=2", "--eval-every=0",
            f"--data-dir={mnist_quick_dir}"]
    state_path = tmp_path / "rep-0" / checkpoint.STATE_FILE
    run_main_in_process(*base)
    assert "Training finished" in capsys.readouterr().out
    assert "batch_size=10" in one_line_exit(capsys, run_main_in_process, *base, "--batch-size=20")
    state = json.loads(state_path.read_text())
    state.update(finished=False, checkpoint="model.ckpt-12", window="window-12.npz")
    state_path.write_text(json.dumps(state))
    assert "which is missing" in one_line_exit(capsys, run_main_in_process, *base)
    state_path.write_text('{"identity": {"model": "convnet"')  # cut short
    assert "unreadable checkpoint state" in one_line_exit(capsys, run_main_in_process, *base)


@pytest.mark.parametrize("victim", ["model.ckpt-20.data-00000-of-00001", "window-20.npz"])
def test_truncated_checkpoint_files_give_one_line(tmp_path, capsys, mnist_quick, mnist_quick_dir,
                                                  victim):
    directory = tmp_path / "rep-0"
    with pytest.raises(loop.Stopped):
        loop.train_once(config(), mnist_quick, seed=0, checkpoint_dir=str(directory),
                              should_stop=stop_at(20, [0]))
    path = directory / victim
    path.write_bytes(path.read_bytes()[:100])
    error = one_line_exit(capsys, run_main_in_process, "--average-gradients=5",
                          "--batch-size=10", "--iterations=60", "--eval-every=20",
                          f"--checkpoint-dir={tmp_path}", f"--data-dir={mnist_quick_dir}")
    assert "is corrupt" in error


# ---------------------------------------------------------------- real signals

def start(args):
    return subprocess.Popen([sys.executable, os.path.join(ROOT, "main.py"), *args], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for_line(proc, needle, timeout=120):
    """Reads stdout until a line holding `needle`; returns the lines read."""
    lines, selector = [], selectors.DefaultSelector()
    selector.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if selector.select(timeout=1):
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if needle in line:
                return lines
    proc.kill()
    raise AssertionError(f"never saw {needle!r}; got {lines}")


# Windows of 7 mini-batches of 10, evaluated every 30; stopped after iteration 30 (4 updates
# and 2 mini-batches in the open window), 180 iterations before the end.
KILLED_ARGS = ("--average-gradients=7", "--batch-size=10", "--iterations=210",
               "--eval-every=30", "--verbose")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, mnist_quick_dir):
    """Two reps of KILLED_ARGS in one process, never stopped: their result records."""
    path = tmp_path_factory.mktemp("uninterrupted") / "full.json"
    proc = run_cli(*KILLED_ARGS, "--reps=2", f"--data-dir={mnist_quick_dir}",
                   f"--results={path}")
    assert proc.returncode == 0, proc.stderr
    return json.loads(path.read_text())["runs"]


@pytest.mark.slow
def test_killed_run_resumes_to_the_uninterrupted_weights(tmp_path, uninterrupted,
                                                         mnist_quick_dir):
    """Ctrl-C in the second rep of a real process, then the same command again.

    SIGTERM takes the same handler (test_sigterm_and_a_second_signal_are_handled)."""
    signum, reps = signal.SIGINT, 2
    part = tmp_path / "part.json"
    resumable = [*KILLED_ARGS, f"--reps={reps}", f"--data-dir={mnist_quick_dir}",
                 f"--checkpoint-dir={tmp_path / 'ckpt'}", f"--results={part}"]
    proc = start(resumable)
    wait_for_line(proc, "Training finished")  # rep 1, whole
    wait_for_line(proc, "Iteration 30:")
    proc.send_signal(signum)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signum, err
    assert f"interrupted by {signal.Signals(signum).name}" in err and "Traceback" not in err
    assert "stopped at iteration" in err and "Training finished" not in out
    # the finished rep was written before the interruption
    assert len(json.loads(part.read_text())["runs"]) == 1
    resumed = run_cli(*resumable)
    assert resumed.returncode == 0, resumed.stderr
    expected = uninterrupted[:reps]
    got = json.loads(part.read_text())["runs"]
    assert [r["weights_sha256"] for r in got] == [r["weights_sha256"] for r in expected]
    assert [r["final_accuracy"] for r in got] == [r["final_accuracy"] for r in expected]
    # rep 1 ran whole in another process: the same flags give the same bits
    assert (got[0]["best_accuracy"], got[0]["best_iteration"]) == (
        expected[0]["best_accuracy"], expected[0]["best_iteration"])
    assert got[0]["weights_sha256"] != got[1]["weights_sha256"]  # each seed its own


def test_sigterm_and_a_second_signal_are_handled():
    """The first SIGINT or SIGTERM asks the loop to stop; a second ends the process."""
    for signum in (signal.SIGTERM, signal.SIGINT):
        before = signal.getsignal(signum)
        with cli.StopSignals() as stop:
            assert stop() is None
            os.kill(os.getpid(), signum)
            time.sleep(0.01)  # Python runs the handler between bytecodes
            assert stop() == signal.Signals(signum).name
            with pytest.raises(SystemExit) as exit_info:
                os.kill(os.getpid(), signum)
                time.sleep(0.01)
            assert exit_info.value.code == 128 + signum
        assert signal.getsignal(signum) == before  # restored


# ---------------------------------------------------------------- determinism

def test_dropout_masks_follow_the_seed_not_the_process(mnist_quick):
    a = loop.train_once(config(iterations=20), mnist_quick, seed=2)
    b = loop.train_once(config(iterations=20), mnist_quick, seed=2)
    c = loop.train_once(config(iterations=20), mnist_quick, seed=3)
    assert a["weights_sha256"] == b["weights_sha256"] != c["weights_sha256"]


# ---------------------------------------------------------------- non-finite numbers

@pytest.fixture(scope="module")
def stack_run_poisoned_at_14(mnist_quick):
    return loop.train_once(config(inject_nonfinite=(14,)), mnist_quick, seed=0)


@pytest.mark.parametrize("averager", averagers.AVERAGERS)
def test_a_nonfinite_window_is_skipped_whole(mnist_quick, stack_run_poisoned_at_14, averager):
    poisoned = loop.train_once(config(accumulate=averager, inject_nonfinite=(12,)),
                                     mnist_quick, seed=0)
    assert poisoned["skipped_windows"] == 1 and poisoned["updates"] == 11
    assert np.isfinite(poisoned["final_accuracy"])
    # the same as a run of the stack averager poisoned elsewhere in that window: the
    # skipped window changed nothing else
    assert poisoned["weights_sha256"] == stack_run_poisoned_at_14["weights_sha256"]
    clean = loop.train_once(config(accumulate=averager), mnist_quick, seed=0)
    assert clean["skipped_windows"] == 0 and clean["updates"] == 12


def test_nonfinite_at_n_equals_one_is_not_applied(mnist_quick):
    run = loop.train_once(config(average_gradients=1, iterations=15,
                                       inject_nonfinite=(3,)), mnist_quick, seed=0)
    assert run["skipped_windows"] == 1 and run["updates"] == 14


def test_abort_and_max_bad_windows_stop_with_a_checkpoint(tmp_path, mnist_quick):
    directory = str(tmp_path / "ckpt")
    with pytest.raises(loop.Stopped, match="iterations 11-15 and on_nonfinite=abort"):
        loop.train_once(config(on_nonfinite="abort", inject_nonfinite=(12,)), mnist_quick,
                              seed=0, checkpoint_dir=directory)
    assert json.load(open(os.path.join(directory, checkpoint.STATE_FILE)))["iteration"] == 15
    with pytest.raises(loop.Stopped, match="2 consecutive windows"):
        loop.train_once(config(max_bad_windows=2, inject_nonfinite=(3, 6, 7)), mnist_quick,
                              seed=0)
    # windows in between reset the count
    run = loop.train_once(config(max_bad_windows=2, inject_nonfinite=(3, 13)), mnist_quick,
                                seed=0)
    assert run["skipped_windows"] == 2


def test_cli_reports_skipped_windows_and_aborts_with_one_line(tmp_path, capsys, mnist_quick_dir):
    results = tmp_path / "r.json"
    base = ["--average-gradients=5", "--batch-size=10", "--iterations=30",
            f"--data-dir={mnist_quick_dir}"]
    run_main_in_process(*base, "--inject-nonfinite=7", f"--results={results}")
    assert json.loads(results.read_text())["runs"][0]["skipped_windows"] == 1
    error = one_line_exit(capsys, run_main_in_process, *base, "--inject-nonfinite=7",
                          "--on-nonfinite=abort", code=3)
    assert "iterations 6-10 and on_nonfinite=abort" in error


def test_a_checkpoint_made_before_strategy_was_renamed_distribute_is_accepted(tmp_path):
    """tf2 checkpoints recorded the tf.distribute strategy as `strategy`; it is `distribute`
    now, and the old key still matches (a different value is still refused)."""
    identity = dict(engine="tf2", seed=0, distribute="none", replicas=1)
    old = dict(identity, strategy=identity.pop("distribute"))
    (tmp_path / checkpoint.STATE_FILE).write_text(json.dumps(
        {"identity": old, "finished": True, "result": {"best_accuracy": 9.0}}))
    saved = checkpoint.RunCheckpoint(str(tmp_path), dict(identity, distribute="none")).load()
    assert saved["result"] == {"best_accuracy": 9.0}
    with pytest.raises(checkpoint.CheckpointError, match="made with distribute=none"):
        checkpoint.RunCheckpoint(str(tmp_path), dict(identity, distribute="mirrored")).load()
