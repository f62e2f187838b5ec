"""Faults while a run writes (a full disk, a lost permission, a second run on one checkpoint
directory): one line, nothing lost, and the same command resumes at its first try.

The faults are injected (experiment/faults.py): the chosen write raises ENOSPC, EACCES or
ENOLCK as the file system would, so these tests need neither root nor a mount.
Runs compare with each other here, so they evaluate on QUICK_TEST_IMAGES test images."""

import errno
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys

import numpy as np
import pytest

from experiment import checkpoint
from experiment import config
from experiment import data
from experiment import engine_tf1
from experiment import events
from experiment import faults
from experiment import loop
from experiment import results
from experiment import runlock
from tests.helpers import ROOT
from tests.helpers import one_line_exit
from tests.helpers import run_main_in_process

NO_SPACE = os.strerror(errno.ENOSPC)


# ---------------------------------------------------------------- the injection point

def test_a_rule_fails_the_chosen_writes_in_process_or_from_the_environment(tmp_path,
                                                                          monkeypatch):
    path = str(tmp_path / "rep-0" / "model.ckpt-5")
    with faults.injected("ENOSPC", "*/model.ckpt-*", first=2, count=2) as rule:
        faults.check(str(tmp_path / "state.json"))  # not matched, not counted
        faults.check(path)  # the first matching write goes through
        for _ in range(2):
            with pytest.raises(OSError) as raised:
                faults.check(path)
            assert (raised.value.errno, raised.value.filename) == (errno.ENOSPC, path)
        faults.check(path)  # its count is spent
        assert rule.seen == 4
    faults.check(path)  # the block is over
    monkeypatch.setenv(faults.FAULTS_ENV, "EACCES:*/r.json")
    with pytest.raises(PermissionError):
        faults.check(str(tmp_path / "r.json"))
    monkeypatch.setenv(faults.FAULTS_ENV, "ENOSUCH:*")
    with pytest.raises(ValueError, match="is not ERRNO:PATTERN"):
        faults.check(path)


def test_start_up_probes_write_bytes_so_a_full_disk_fails_them(tmp_path, monkeypatch):
    """An empty file needs no space: the probe writes PROBE_BYTES, and removes them."""
    sizes = []
    unlink = results._unlink_quietly  # noqa: SLF001 (the step under test)
    monkeypatch.setattr(results, "_unlink_quietly",
                        lambda p: sizes.append(os.path.getsize(p)) or unlink(p))
    results.check_writable(str(tmp_path / "r.json"))
    assert sizes == [results.PROBE_BYTES] and sizes[0] > 0 and os.listdir(tmp_path) == []
    with faults.injected("ENOSPC", "*/.tmp-probe-*"):
        with pytest.raises(results.ResultsError) as raised:
            results.check_directory(str(tmp_path / "ck"), "--checkpoint-dir")
    assert str(raised.value) == f"--checkpoint-dir {tmp_path / 'ck'}: cannot write there " \
        f"({NO_SPACE})"
    assert raised.value.errno == errno.ENOSPC and os.listdir(tmp_path / "ck") == []


# ---------------------------------------------------------------- checkpoints, one save

class FakeEngine:
    """The checkpoint half of an interfaces.Engine, writing its variables as the tf2 engine
    does: a `<prefix>_temp/` directory first, then the merged files (the temp directory is
    left behind when the write fails, as TensorFlow leaves it)."""

    def write_variables(self, path):
        os.makedirs(path + "_temp")
        with open(os.path.join(path + "_temp", "part-00000-of-00001.index"), "wb") as f:
            f.write(b"part")
        faults.check(path + ".data-00000-of-00001")
        for suffix in (".data-00000-of-00001", ".index"):
            with open(path + suffix, "wb") as f:
                f.write(b"variables")
        shutil.rmtree(path + "_temp")

    def read_variables(self, path):
        del path

    def window_state(self):
        return {"images": np.zeros((1, 2))}

    def restore_window(self, arrays, state):
        del arrays, state


IDENTITY = {"seed": 0}
IN_FORCE_10 = ["model.ckpt-10.data-00000-of-00001", "model.ckpt-10.index", "state.json",
               "window-10.npz"]


@pytest.mark.parametrize("victim", ["*.data-*", "*/window-*", "*/state.json"])
def test_a_failed_save_keeps_the_checkpoint_in_force_and_leaves_nothing(tmp_path, victim):
    ckpt = checkpoint.RunCheckpoint(str(tmp_path), IDENTITY)
    ckpt.save(FakeEngine(), 10, {"iteration": 10})
    with faults.injected("ENOSPC", victim):
        with pytest.raises(results.WriteError) as raised:
            ckpt.save(FakeEngine(), 20, {"iteration": 20})
    assert str(raised.value) == (
        f"cannot write the checkpoint {tmp_path}/model.ckpt-20 ({NO_SPACE}); the checkpoint "
        f"in force is {tmp_path}/model.ckpt-10 (iteration 10): the same command resumes "
        "from it")
    assert sorted(os.listdir(tmp_path)) == IN_FORCE_10
    assert checkpoint.RunCheckpoint(str(tmp_path), IDENTITY).load()["iteration"] == 10


def test_what_failed_or_killed_saves_left_never_blocks_the_next(tmp_path):
    checkpoint.RunCheckpoint(str(tmp_path), IDENTITY).save(FakeEngine(), 10, {"iteration": 10})
    (tmp_path / "model.ckpt-20_temp").mkdir()  # a tf2 save that failed
    (tmp_path / "model.ckpt-20_temp" / "part-00000-of-00001.index").write_bytes(b"part")
    (tmp_path / "model.ckpt-10.data-00000-of-00001.tempstate42").write_bytes(b"")  # tf1's
    (tmp_path / ".tmp-1x2y3zwindow-20.npz").write_bytes(b"half")  # a killed atomic write
    ckpt = checkpoint.RunCheckpoint(str(tmp_path), IDENTITY)
    assert ckpt.load()["iteration"] == 10
    assert sorted(os.listdir(tmp_path)) == IN_FORCE_10
    (tmp_path / "model.ckpt-15_temp").mkdir()  # left after loading: removed by the save
    ckpt.save(FakeEngine(), 20, {"iteration": 20})
    assert sorted(os.listdir(tmp_path)) == [name.replace("10", "20") for name in IN_FORCE_10]


def test_a_second_save_at_the_iteration_in_force_writes_nothing(tmp_path):
    ckpt = checkpoint.RunCheckpoint(str(tmp_path), IDENTITY)
    ckpt.save(FakeEngine(), 10, {"iteration": 10})
    with faults.injected("ENOSPC", "*"):  # any write would fail
        assert ckpt.save(FakeEngine(), 10, {"iteration": 10})["checkpoint"] == "model.ckpt-10"


def test_a_corrupt_checkpoint_is_to_be_moved_aside_not_deleted(tmp_path):
    """With one run per directory, a corrupt checkpoint is really corrupt: worth keeping."""
    ckpt = checkpoint.RunCheckpoint(str(tmp_path), IDENTITY)
    state = ckpt.save(FakeEngine(), 10, {"iteration": 10})
    (tmp_path / "window-10.npz").write_bytes(b"PK\x03\x04 cut short")
    with pytest.raises(checkpoint.CheckpointError) as raised:
        ckpt.restore(FakeEngine(), state)
    assert str(raised.value).startswith(f"checkpoint {tmp_path} is corrupt (")
    assert str(raised.value).endswith(f"; move {tmp_path} aside (keep it until you know why) "
                                      "to start this run over")


def test_a_stop_at_a_checkpoint_iteration_does_not_write_over_that_checkpoint(tmp_path,
                                                                             mnist_quick):
    """A periodic save and the stop's at iteration 10: only the first writes model.ckpt-10."""
    directory = tmp_path / "ckpt"
    with faults.injected("ENOSPC", f"{directory}/model.ckpt-10", first=2):
        with pytest.raises(loop.Stopped) as raised:
            loop.train_once(config.Config(average_gradients=5, batch_size=10, iterations=30,
                                        eval_every=0), mnist_quick, seed=0,
                            checkpoint_dir=str(directory), checkpoint_every=2,
                            should_stop=lambda: "SIGINT" if os.path.exists(
                                directory / checkpoint.STATE_FILE) else None)
    assert str(raised.value).endswith(f"stopped at iteration 10 (0 mini-batches in the open "
                                      f"window); checkpoint in {directory}; run the same "
                                      "command to resume")


def test_an_error_while_closing_does_not_hide_why_the_run_stopped(tmp_path, monkeypatch,
                                                                  mnist_quick):
    def close(self):
        raise RuntimeError("close failed")

    monkeypatch.setattr(engine_tf1.Engine, "close", close)
    monkeypatch.setattr(events.Writer, "close", close)
    with pytest.raises(loop.Stopped, match="interrupted by SIGINT"):
        loop.train_once(config.Config(average_gradients=2, batch_size=10, iterations=4,
                                    eval_every=0), mnist_quick, seed=0,
                        logdir=str(tmp_path / "tb"), should_stop=lambda: "SIGINT")


# ---------------------------------------------------------------- whole runs through main

def terminate_after(count, batches):
    """data.batches that sends this process SIGTERM as it hands out the count-th batch."""
    def wrapped(*args, **kwargs):
        for i, batch in enumerate(batches(*args, **kwargs), 1):
            if i == count:
                os.kill(os.getpid(), signal.SIGTERM)
            yield batch
    return wrapped


# Checkpoints every 2 updates: at iterations 10, 20, 30 and 40.
RUN = ("--average-gradients=5", "--batch-size=10", "--iterations=40", "--eval-every=20",
       "--checkpoint-every=2")


@pytest.fixture(scope="module", params=["tf1", "tf2"])
def uninterrupted(request, tmp_path_factory, mnist_quick_dir):
    """RUN on one engine, never stopped: (the engine, its result record)."""
    path = tmp_path_factory.mktemp("uninterrupted") / "alone.json"
    run_main_in_process(*RUN, f"--engine={request.param}", f"--data-dir={mnist_quick_dir}",
                        f"--results={path}")
    (record,) = json.loads(path.read_text())["runs"]
    return request.param, record


def checkpointed(engine, tmp_path, mnist_quick_dir):
    """The command that runs RUN with checkpoints: (its results, its checkpoints, it)."""
    ck, part = tmp_path / "ck", tmp_path / "part.json"
    command = [*RUN, f"--engine={engine}", f"--data-dir={mnist_quick_dir}",
               f"--checkpoint-dir={ck}", f"--results={part}"]
    return part, ck / "rep-0", command


@pytest.mark.slow
def test_a_full_disk_stops_in_one_line_and_the_same_command_resumes_exactly(
        uninterrupted, tmp_path, capsys, monkeypatch, mnist_quick_dir):
    engine, expected = uninterrupted
    part, rep, command = checkpointed(engine, tmp_path, mnist_quick_dir)
    capsys.readouterr()
    full_disk = f"{rep}/[!.]*"  # every checkpoint file (not the start-up probe)
    in_force = f"the checkpoint in force is {rep}/model.ckpt-10 (iteration 10): the same " \
        "command resumes from it"

    # The disk fills after the first checkpoint: the second stops the run.
    with faults.injected("ENOSPC", full_disk, first=4):  # its variables, window, state.json
        error = one_line_exit(capsys, run_main_in_process, *command, code=1)
    assert error == (f"error: run 1 of 1: cannot write the checkpoint {rep}/model.ckpt-20 "
                     f"({NO_SPACE}); {in_force}")
    assert sorted(os.listdir(rep)) == IN_FORCE_10

    # The same command, the disk still full, SIGTERM at iteration 13: the stop's save fails.
    monkeypatch.setattr(data, "batches", terminate_after(3, data.batches))
    with faults.injected("ENOSPC", full_disk):
        error = one_line_exit(capsys, run_main_in_process, *command, code=128 + signal.SIGTERM)
    monkeypatch.undo()
    assert error == (f"error: run 1 of 1: interrupted by SIGTERM; stopped at iteration 13 (3 "
                     f"mini-batches in the open window); cannot write the checkpoint "
                     f"{rep}/model.ckpt-13 ({NO_SPACE}); {in_force}")
    assert sorted(os.listdir(rep)) == IN_FORCE_10

    # Space freed, with what a killed save leaves: it resumes and ends as if never stopped.
    (rep / "model.ckpt-20_temp").mkdir()
    (rep / ".tmp-abc123window-20.npz").write_bytes(b"half")
    run_main_in_process(*command)
    (resumed,) = json.loads(part.read_text())["runs"]
    for key in ("weights_sha256", "best_accuracy", "best_iteration", "final_accuracy"):
        assert resumed[key] == expected[key], key
    assert os.listdir(rep) == [checkpoint.STATE_FILE]


def block_after(count, batches, path):
    """data.batches that makes `path` a directory as it hands out the count-th batch, so
    that TensorFlow's own write of that file fails, as a real fault makes it fail."""
    def wrapped(*args, **kwargs):
        for i, batch in enumerate(batches(*args, **kwargs), 1):
            if i == count:
                os.makedirs(path)
            yield batch
    return wrapped


def test_tensorflows_own_failing_save_is_one_line_and_the_run_resumes(
        uninterrupted, tmp_path, capsys, monkeypatch, mnist_quick_dir):
    """No injection: the second checkpoint's index file is a directory when TensorFlow
    merges its checkpoint into it (SaveV2 / MergeV2Checkpoints fail as on a real fault)."""
    engine, expected = uninterrupted
    part, rep, command = checkpointed(engine, tmp_path, mnist_quick_dir)
    blocker = rep / "model.ckpt-20.index"
    monkeypatch.setattr(data, "batches", block_after(15, data.batches, str(blocker)))
    capsys.readouterr()
    error = one_line_exit(capsys, run_main_in_process, *command, code=1)
    monkeypatch.undo()
    assert error.startswith(f"error: run 1 of 1: cannot write the checkpoint "
                            f"{rep}/model.ckpt-20 (")
    assert error.endswith(f"the checkpoint in force is {rep}/model.ckpt-10 (iteration 10): "
                          "the same command resumes from it")
    assert not blocker.exists()  # the failed checkpoint's files are cleared away
    run_main_in_process(*command)
    (resumed,) = json.loads(part.read_text())["runs"]
    assert resumed["weights_sha256"] == expected["weights_sha256"]


def test_a_full_logdir_warns_once_and_the_run_finishes(tmp_path, capsys, caplog,
                                                      mnist_quick_dir):
    common = ["--average-gradients=2", "--batch-size=10", "--iterations=20", "--eval-every=4",
              f"--data-dir={mnist_quick_dir}"]
    # At the start, the probe of the run's own event directory fails; mid-run, its first
    # event (after the two probes and the writer's creation).
    for when, rule in (("start", dict(pattern=f"{tmp_path}/tb-start/*/.tmp-probe-*")),
                       ("mid-run", dict(pattern=f"{tmp_path}/tb-mid-run/*", first=4))):
        logdir, path = tmp_path / f"tb-{when}", tmp_path / f"{when}.json"
        caplog.clear()
        with caplog.at_level(logging.WARNING), faults.injected("ENOSPC", **rule) as injected:
            run_main_in_process(*common, f"--logdir={logdir}", f"--results={path}")
        warnings = [r.getMessage() for r in caplog.records if "--logdir" in r.getMessage()]
        assert len(warnings) == 1 and NO_SPACE in warnings[0], (when, warnings)
        assert len(json.loads(path.read_text())["runs"]) == 1, when
        assert "Training finished" in capsys.readouterr().out
        events = list(logdir.rglob("events.out.tfevents*"))
        assert (len(events), injected.seen) == ((0, 1) if when == "start" else (1, 4))


def test_a_failed_results_write_stops_before_the_next_run_and_loses_no_run(
        tmp_path, capsys, mnist_quick_dir):
    ck, path = tmp_path / "ck", tmp_path / "r.json"
    command = ["--average-gradients=5", "--batch-size=10", "--iterations=10", "--eval-every=0",
               "--reps=3", f"--checkpoint-dir={ck}", f"--results={path}",
               f"--data-dir={mnist_quick_dir}"]
    with faults.injected("ENOSPC", str(path), first=2):
        error = one_line_exit(capsys, run_main_in_process, *command, code=1)
    assert error == (f"error: --results {path}: cannot write ({NO_SPACE}); it holds run 1, "
                     f"not run 2's record: {ck}/rep-1 keeps it: once the file can be written, "
                     "the same command writes it without training again; run 3 was not "
                     "started")
    assert len(json.loads(path.read_text())["runs"]) == 1
    assert not os.path.exists(ck / "rep-2" / checkpoint.STATE_FILE)  # never started
    kept = json.loads((ck / "rep-1" / checkpoint.STATE_FILE).read_text())["result"]
    run_main_in_process(*command)
    runs = json.loads(path.read_text())["runs"]
    assert len(runs) == 3 and runs[1] == kept  # its own seconds: not trained again
    without = loop._results_not_written(  # noqa: SLF001 (the message under test)
        config.Runs(results_path="r.json", reps=1), 1,
        OSError(errno.EACCES, os.strerror(errno.EACCES)))
    assert without == ("--results r.json: cannot write (Permission denied); run 1's record is "
                       "not in it: without --checkpoint-dir it is lost (its line is above)")


# ---------------------------------------------------------------- one run per directory

def test_a_checkpoint_directory_in_use_is_refused_until_its_holder_dies(tmp_path, capsys,
                                                                       mnist_quick_dir):
    ck = tmp_path / "ck"
    ck.mkdir()
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nfrom experiment import runlock\n"
         "runlock.DirectoryLock(sys.argv[1]).acquire()\nprint('held', flush=True)\n"
         "time.sleep(300)", str(ck)],
        cwd=ROOT, stdout=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONPATH=ROOT))
    command = ["--average-gradients=2", "--batch-size=10", "--iterations=4", "--eval-every=0",
               f"--checkpoint-dir={ck}", f"--data-dir={mnist_quick_dir}"]
    try:
        assert holder.stdout.readline() == "held\n"
        error = one_line_exit(capsys, run_main_in_process, *command, code=2)
        assert error == (f"error: --checkpoint-dir {ck} is in use by another run "
                         f"({holder.pid}@{socket.gethostname()}, per {ck}/.lock); wait for it "
                         "to end, or use another --checkpoint-dir")
        assert os.listdir(ck) == [runlock.LOCK_FILE]  # the refused run wrote nothing there
    finally:
        holder.kill()  # kill -9: the kernel releases its lock
        holder.wait()
    run_main_in_process(*command)
    assert "Training finished" in capsys.readouterr().out
    assert (ck / runlock.LOCK_FILE).read_text() == runlock.holder_text() + "\n"
    with faults.injected("ENOLCK", f"{ck}/.lock"):
        error = one_line_exit(capsys, run_main_in_process, *command, code=2)
    assert error == (f"error: --checkpoint-dir {ck}: cannot lock {ck}/.lock (No locks "
                     "available): this file system has no locks; use a directory on a local "
                     "disk")
