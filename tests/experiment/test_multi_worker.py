"""The command line on several workers (--distribute=multi_worker): resuming, refusals,
a lost worker. Real worker processes on 127.0.0.1, each with its own TF_CONFIG
(tools.launch_workers); the in-process tests check one worker's part alone."""

import contextlib
import json
import os
import re
import signal
import time

import pytest
import tensorflow as tf
from tensorflow.core.util import event_pb2

from experiment import checkpoint
from experiment import config as config_lib
from experiment import engine_tf2
from experiment import results
from experiment import runlock
from experiment import workers
from tests.helpers import run_cli
from tools import launch_workers

CPU_ONLY = {"CUDA_VISIBLE_DEVICES": "", "TF_CPP_MIN_LOG_LEVEL": "3"}
# Windows of 4 mini-batches of 24 (12 a worker), dropout on, a checkpoint every update;
# the final evaluation prints the loss since the start (--verbose), which a resumed run
# must also have kept.
ARGS = ("--average-gradients=4", "--batch-size=24", "--iterations=160", "--eval-every=0",
        "--reps=1", "--checkpoint-every=1", "--verbose")
LOSS_LINE = re.compile(r"^Iteration 160: loss [\d.]+, accuracy [\d.]+$", re.M)


def tf_config(index, workers_=2):
    return json.dumps({"cluster": {"worker": [f"127.0.0.1:{1000 + i}" for i in range(workers_)]},
                       "task": {"type": "worker", "index": index}})


def start(worker_args, tmp_path, tag):
    """Starts one worker per list of arguments; returns (processes, their log paths)."""
    paths = [tmp_path / f"{tag}-worker{i}.log" for i in range(len(worker_args))]
    procs = launch_workers.start(worker_args, [open(p, "w") for p in paths], env=CPU_ONLY)
    return procs, paths


def wait(procs, timeout):
    """Waits for every process; returns the seconds each ran past the call (None: killed
    at `timeout`)."""
    begin, ended = time.monotonic(), [None] * len(procs)
    while None in ended and time.monotonic() - begin < timeout:
        for i, proc in enumerate(procs):
            if ended[i] is None and proc.poll() is not None:
                ended[i] = time.monotonic() - begin
        time.sleep(0.1)
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return ended


def one_error_line(path):
    """The only line of a worker's log, an `error: ` line."""
    lines = path.read_text().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


# ---------------------------------------------------------------- killed and resumed


@pytest.mark.slow
def test_workers_killed_mid_run_resume_to_the_uninterrupted_weights(tmp_path, mnist_dir):
    """Both workers kill -9'ed while they train, then the same command: the weights of
    the run never interrupted, bit for bit; another number of workers is refused.

    The run never interrupted also writes events (--logdir, which launch_workers gives the
    chief alone): every worker then reads the loss totals after each window."""
    def args(tag):
        return [*ARGS, f"--data-dir={mnist_dir}", f"--checkpoint-dir={tmp_path / tag}",
                f"--results={tmp_path / tag}.json"]

    codes, outputs = launch_workers.launch([*args("whole"), f"--logdir={tmp_path / 'events'}"],
                                           timeout=400, env=CPU_ONLY)
    assert codes == [0, 0], outputs
    (events,) = (tmp_path / "events").rglob("events.out.tfevents.*")
    losses = [event_pb2.Event.FromString(record.numpy()).step
              for record in tf.data.TFRecordDataset(str(events))
              if "train/loss" in str(event_pb2.Event.FromString(record.numpy()).summary)]
    assert losses == list(range(1, 41))  # one per update
    (whole,) = json.loads((tmp_path / "whole.json").read_text())["runs"]
    whole_loss = LOSS_LINE.findall(outputs[0])
    assert len(whole_loss) == 1, outputs[0]

    procs, logs = start([args("killed"), args("killed")], tmp_path, "killed")
    state = tmp_path / "killed" / "rep-0" / checkpoint.STATE_FILE
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and all(p.poll() is None for p in procs):
        try:
            if json.loads(state.read_text())["iteration"] >= 40:
                break
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.05)
    for proc in procs:
        proc.kill()
    wait(procs, 30)
    saved = json.loads(state.read_text())
    assert not saved["finished"] and 40 <= saved["iteration"] < 160, logs[0].read_text()
    # The chief alone wrote the run's directory; worker 1 only its lock, in its own.
    assert sorted(os.listdir(tmp_path / "killed")) == [".lock", ".worker-1", "rep-0"]
    assert os.listdir(tmp_path / "killed" / ".worker-1") in ([".lock"], [".lock", "rep-0"])

    codes, outputs = launch_workers.launch(args("killed"), timeout=400, env=CPU_ONLY)
    assert codes == [0, 0], outputs
    (resumed,) = json.loads((tmp_path / "killed.json").read_text())["runs"]
    assert resumed["weights_sha256"] == whole["weights_sha256"]
    for key in ("final_accuracy", "updates", "evaluations"):
        assert resumed[key] == whole[key]
    # The loss since the start, summed over both workers, survived the kill too.
    assert LOSS_LINE.findall(outputs[0]) == whole_loss
    assert os.listdir(tmp_path / "killed" / ".worker-1") == [".lock"]

    # One worker (no TF_CONFIG: a single local worker) is refused the 2 workers' checkpoint.
    proc = run_cli("--engine=tf2", "--distribute=multi_worker", *args("killed"), env=CPU_ONLY)
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        f"error: checkpoint {tmp_path / 'killed' / 'rep-0'} was made by 2 workers, this "
        "job has 1: a multi_worker run resumes with as many workers as made its checkpoint "
        "(how each mini-batch is split shapes its bits); start 2, or use another "
        "checkpoint directory"], proc.stderr

    # Worker 1 given a directory without the chief's checkpoint (as on a machine that does
    # not share the chief's file system): both refuse.
    procs, logs = start([args("killed"), [*args("killed")[:-2], f"--checkpoint-dir={tmp_path}"
                                          "/elsewhere"]], tmp_path, "elsewhere")
    wait(procs, 300)
    assert [p.returncode for p in procs] == [2, 2]
    for log, (index, found, directory) in zip(logs, [(0, "a finished run", "killed"),
                                                     (1, "no checkpoint", "elsewhere")]):
        assert one_error_line(log) == (
            f"error: --checkpoint-dir: worker {index} finds {found} in "
            f"{tmp_path / directory / 'rep-0'}, another worker finds otherwise: every worker "
            "must read the directory the chief (worker 0) writes, under the same flags (on "
            "several machines, a file system they share)")


# ---------------------------------------------------------------- refusals


@pytest.mark.slow
def test_workers_given_other_settings_refuse_in_one_line(tmp_path, mnist_dir):
    """The issue's pair: worker 0 with --average-gradients=4, worker 1 with 2. Each
    exits 2 in one line naming the flag, before any training."""
    common = ["--batch-size=24", "--iterations=40", "--eval-every=0", "--reps=1",
              f"--data-dir={mnist_dir}"]
    procs, logs = start([["--average-gradients=4", *common], ["--average-gradients=2", *common]],
                        tmp_path, "other")
    wait(procs, 300)
    assert [p.returncode for p in procs] == [2, 2]
    for index, (log, n) in enumerate(zip(logs, (4, 2))):
        assert one_error_line(log) == (
            f"error: the 2 workers were not given the same settings: --average-gradients "
            f"differs; this one, worker {index}, has {n}. Start every worker with the same "
            "flags (each may have its own --threads, --data-dir path, --results and "
            "--logdir, which only worker 0 writes)")


@pytest.mark.slow
def test_workers_given_other_data_refuse_in_one_line(tmp_path, mnist_dirs):
    """The same flags, but worker 1's --data-dir holds fewer test images."""
    common = ["--batch-size=24", "--iterations=40", "--eval-every=0", "--reps=1"]
    procs, logs = start([[*common, f"--data-dir={d}"] for d in mnist_dirs], tmp_path, "data")
    wait(procs, 300)
    assert [p.returncode for p in procs] == [2, 2]
    assert "--data-dir (its files' contents) differs; this one, worker 1, has '" in (
        one_error_line(logs[1]))


# ---------------------------------------------------------------- a lost worker


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGINT])
def test_a_lost_worker_stops_the_other_in_one_line_within_the_timeout(tmp_path, mnist_dir,
                                                                      signum):
    """Worker 1 killed, or stopped by Ctrl-C, while they train: worker 0 stops within
    --worker-timeout (20 s), in one line naming worker 1 and the checkpoint in force.
    Stopped by a signal, worker 1 saves no checkpoint of its own (a save is a collective):
    its line names the one in force."""
    args = ["--average-gradients=4", "--batch-size=24", "--iterations=100000",
            "--eval-every=0", "--reps=1", "--checkpoint-every=5", "--worker-timeout=20",
            f"--data-dir={mnist_dir}", f"--checkpoint-dir={tmp_path / 'ckpt'}"]
    procs, logs = start([args, args], tmp_path, "lost")
    state = tmp_path / "ckpt" / "rep-0" / checkpoint.STATE_FILE
    deadline = time.monotonic() + 300
    while not state.exists() and time.monotonic() < deadline and procs[0].poll() is None:
        time.sleep(0.1)
    procs[1].send_signal(signum)
    seconds = wait(procs, 120)
    assert procs[0].returncode == 3 and seconds[0] is not None and seconds[0] <= 20
    in_force = json.loads(state.read_text())
    where = (rf"stopped at iteration \d+ \(\d mini-batches in the open window\); the checkpoint "
             rf"in force is {re.escape(str(tmp_path / 'ckpt' / 'rep-0'))}/model\.ckpt-"
             rf"{in_force['iteration']} \(iteration {in_force['iteration']}\): the same command "
             r"resumes from it")
    line = one_error_line(logs[0])
    assert re.fullmatch(r"error: run 1 of 1: worker 1 \(127\.0\.0\.1:\d+\) cannot be reached "
                        rf"\([^)]*\); {where}", line), line
    if signum == signal.SIGINT:
        assert procs[1].returncode == 128 + signum
        assert re.fullmatch(f"error: run 1 of 1: interrupted by SIGINT; {where}",
                            one_error_line(logs[1]))


# ---------------------------------------------------------------- one worker's part, alone


@pytest.fixture
def worker_1(monkeypatch):
    """This process as worker 1 of 2 (its TF_CONFIG only; no strategy is made)."""
    monkeypatch.setenv("TF_CONFIG", tf_config(1))
    return config_lib.Config(engine="tf2", distribute="multi_worker", average_gradients=2,
                             batch_size=4)


def test_a_worker_other_than_the_chief_writes_only_in_its_own_directory(tmp_path, worker_1):
    """check_outputs: worker 1 locks and checks .worker-1 only, and drops --results and
    --logdir (the chief writes them); a second worker 1 on that directory is refused."""
    runs = config_lib.Runs(checkpoint_dir=str(tmp_path / "ckpt"), results_path=str(
        tmp_path / "r.json"), logdir=str(tmp_path / "logs"))
    with contextlib.ExitStack() as held:
        kept = results.check_outputs(worker_1, runs, held)
        assert (kept.results_path, kept.logdir) == (None, None)
        assert os.listdir(tmp_path) == ["ckpt"]
        assert os.listdir(tmp_path / "ckpt") == [".worker-1"]
        with pytest.raises(runlock.LockError, match="in use by another run"):
            results.check_outputs(worker_1, runs, contextlib.ExitStack())


def test_a_worker_saves_its_part_apart_and_reads_the_chiefs_checkpoint(tmp_path, mnist_quick,
                                                                      worker_1):
    """RunCheckpoint with own_part (what worker 1 gets): a save writes the variables there
    and removes them, nothing in the chief's directory; load reads the chief's state and
    removes nothing of it."""
    chief_config = config_lib.Config(engine="tf2", average_gradients=2, batch_size=4)
    engine = engine_tf2.Engine(chief_config, seed=0)
    for iteration, (images, labels) in enumerate(
            [(mnist_quick.train.images[:4], mnist_quick.train.labels[:4])] * 3, start=1):
        engine.step(images, labels, iteration)
    directory, own = tmp_path / "rep-0", tmp_path / ".worker-1" / "rep-0"
    assert workers.own_part(str(directory), worker_1) == str(own)
    state = {"iteration": 3, "open_window": 1, "loss_totals": list(engine.loss_totals())}
    chief = checkpoint.RunCheckpoint(str(directory), {"seed": 0})
    chief.save(engine, 3, state)
    written = sorted(os.listdir(directory))
    reader = checkpoint.RunCheckpoint(str(directory), {"seed": 0}, str(own))
    assert reader.load()["iteration"] == 3
    os.makedirs(own / "debris")  # what a save killed midway leaves
    reader.save(engine, 5, dict(state, iteration=5))
    assert sorted(os.listdir(directory)) == written and not own.exists()
    assert reader.in_force_line().startswith(  # the chief's state.json, not its own
        f"the checkpoint in force is {directory}/model.ckpt-3 (iteration 3)")
    reader.save_finished({"seed": 0})
    assert json.loads((directory / checkpoint.STATE_FILE).read_text())["iteration"] == 3


def test_lost_reason_names_the_worker_that_stopped_sending_heartbeats(worker_1):
    """The texts TensorFlow's collectives failed with in this suite's runs (worker 1's
    heartbeats lost; the chief's connection reset), and a collective's timeout."""
    config = config_lib.Config(engine="tf2", distribute="multi_worker", worker_timeout=20)
    heartbeats = tf.errors.UnavailableError(None, None, (
        "Collective ops is aborted by: Error reported from /job:worker/task:1: The following "
        "tasks are unhealthy (stopped sending heartbeats):\n/job:worker/replica:0/task:0\n"
        "The tasks have crashed."))
    assert workers.lost_reason(heartbeats, config) == (
        "worker 0 (127.0.0.1:1000) cannot be reached (it stopped sending heartbeats)")
    reset = tf.errors.UnavailableError(None, None, (
        "Collective ops is aborted by: recvmsg:Connection reset by peer\nAdditional GRPC error "
        "information from remote target /job:worker/replica:0/task:0 while calling "
        "/tensorflow.WorkerService/RecvBuf"))
    assert workers.lost_reason(reset, config) == (
        "worker 0 (127.0.0.1:1000) cannot be reached (its connection was lost)")
    timed_out = tf.errors.DeadlineExceededError(None, None, "Collective has timed out")
    assert workers.lost_reason(timed_out, config) == (
        "no answer from the other workers within --worker-timeout=20 s (a collective timed "
        "out)")
    out_of_memory = tf.errors.ResourceExhaustedError(None, None, "OOM")
    assert workers.lost_reason(out_of_memory, config) is None
    assert workers.lost_reason(reset, config_lib.Config()) is None  # one process: not lost


def test_a_cluster_with_a_chief_task_counts_it_as_worker_0(monkeypatch):
    cluster = {"chief": ["host0:1"], "worker": ["host1:1", "host2:1"]}
    for task, index in ((("chief", 0), 0), (("worker", 0), 1), (("worker", 1), 2)):
        monkeypatch.setenv("TF_CONFIG", json.dumps(
            {"cluster": cluster, "task": {"type": task[0], "index": task[1]}}))
        assert workers.task() == (index, ["host0:1", "host1:1", "host2:1"])
    monkeypatch.setenv("TF_CONFIG", tf_config(1))
    assert workers.task() == (1, ["127.0.0.1:1000", "127.0.0.1:1001"])
