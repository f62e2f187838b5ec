"""accumulate + Keras fit on two worker processes (MultiWorkerMirroredStrategy, one CPU
replica each, 127.0.0.1; tests/library/multi_worker_runs), against one process.

Keras 3.15's own fit fails there (keras-team/keras#20585); the AccumulatingModel's
trains to the one-process direct batch's weights, History (validation included),
evaluation and predictions, with one mini-batch per update (accumulate(model, 1): the
way to run fit there), N per update, and a micro-batch size,
on numpy arrays and on a tf.data dataset each worker reads whole; batch norm's moving
statistics take the direct batch's steps, pooled across the workers. Keras's writing
callbacks write once, from the chief; BackupAndRestore resumes a job whose worker was
killed (kill -9) to the uninterrupted run's weights. micro_batch_size="auto" under a
memory limit per worker: each worker searches its own device, all train at the smallest
micro-batch any found; where one runs out of memory in the search's update (its
collectives in flight), every worker ends with one line.
"""

import glob
import json
import os
import re
import signal

import numpy as np
import pytest

from gradient_averaging import replicas as replicas_lib
from tests.library import multi_worker_runs as runs_lib
from tests.library import toys

TIMEOUT = 420  # seconds for the workers' runs, on a loaded 2-core machine
# Each worker's device (the CPU as a BFC allocator): worker 1 holds a replica's whole
# share of the effective batch (89 samples), worker 0 not.
LIMITS_MB = (64, 160)
WIDE_LIMIT_MB = 89  # over a wide model's pass of one sample (81 MiB), under its update (97)
LOST_PEER_TIMEOUT = 120  # seconds for a worker to end once its peer was killed
# How WorkerFailed's line ends: what this worker's collective raised, one of the errors
# the library takes for a lost peer.
NAMED_CAUSE = (r"\(here, (" + "|".join(e.__name__ for e in replicas_lib.COLLECTIVE_ERRORS)
               + r"): .+\)$")


def saved(out, index):
    with np.load(os.path.join(out, f"worker{index}.npz")) as arrays:
        return dict(arrays)


def arrays(saved_run, name, kind):
    keys = sorted((k for k in saved_run if k.startswith(f"{name}/{kind}/")),
                  key=lambda k: int(k.rsplit("/", 1)[1]))
    return [saved_run[k] for k in keys]


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    """Both workers' saved runs, and the one-process references made meanwhile."""
    out = str(tmp_path_factory.mktemp("multi_worker"))
    procs = runs_lib.start(["tests.library.multi_worker_runs", f"--out={out}"],
                           log_dir=out)
    try:
        references = {}
        for name, (_, make_optimizer, source, _) in runs_lib.runs().items():
            # The direct batch: the plain model, one process, batches of N x B.
            references[name] = runs_lib.train(runs_lib.plain_model(name), make_optimizer,
                                              source, runs_lib.direct_batch(name),
                                              data=runs_lib.run_data(name),
                                              validation_batch=runs_lib.direct_batch(name))
        codes = runs_lib.wait(procs, TIMEOUT)
        assert codes == [0, 0], runs_lib.logs(out)
    finally:
        runs_lib.stop(procs)
    return [saved(out, i) for i in range(2)], references


@pytest.mark.slow
@pytest.mark.parametrize("name", ["one_dataset", "n_numpy", "micro_dataset", "sequences_n"])
def test_fit_on_two_workers_equals_the_one_process_direct_batch(workers, name):
    results, references = workers
    weights, history, evaluation, predictions, _ = references[name]
    for result in results:  # each worker ends with the same model
        for got, want in zip(arrays(result, name, "weights"), weights, strict=True):
            np.testing.assert_allclose(got, want, atol=1e-5)
        logged = json.loads(str(result["logs"]))[name]
        assert sorted(logged["history"]) == sorted(history)  # val_ included
        for key, values in history.items():
            np.testing.assert_allclose(logged["history"][key], values, rtol=1e-5, atol=1e-6,
                                       err_msg=key)
        np.testing.assert_allclose(logged["evaluate"], evaluation, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(result[f"{name}/predict"], predictions, atol=1e-5)
    initial = runs_lib.plain_model(name)().get_weights()
    assert max(float(np.abs(w - i).max()) for w, i in zip(weights, initial)) > 1e-2  # trained


@pytest.mark.slow
def test_batch_norm_statistics_step_once_per_update_across_the_workers(workers):
    """BatchNormalization on the inputs: its moving statistics depend on no weight, so
    the window's, pooled over both workers' shares, are the direct batch's."""
    results, references = workers
    moving = references["bn"][4]
    assert moving
    for result in results:
        for got, want in zip(arrays(result, "bn", "moving"), moving, strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_backup_and_restore_resumes_a_job_whose_worker_was_killed(tmp_path):
    """Worker 1 is killed (SIGKILL) mid-epoch 2; the chief's fit ends in one line (its
    collective with the dead worker fails); both start again with the same command and
    end with the uninterrupted run's weights. Each file was written by the chief only; a
    worker that ends removes the directory it wrote to instead (the killed one cannot)."""
    out = str(tmp_path)
    temporary = [tmp_path / f"tmp{i}" for i in range(2)]
    envs = []
    for directory in temporary:
        directory.mkdir()
        envs.append({"TMPDIR": str(directory)})
    command = ["tests.library.multi_worker_runs", f"--out={out}", "--resume"]
    chiefs = []
    procs = runs_lib.start([*command, "--kill-epoch=2"], envs=envs, log_dir=out)
    try:
        chiefs.append(procs[0].pid)
        # The one-process direct batch, uninterrupted, meanwhile.
        weights, history, *_ = runs_lib.train(toys.tiny_model, toys.sgd, "numpy",
                                              toys.N * toys.B, epochs=runs_lib.RESUME_EPOCHS)
        codes = runs_lib.wait(procs, TIMEOUT)
        assert codes[1] == -signal.SIGKILL, runs_lib.logs(out)
        # The chief's collective with it fails: fit raises one line, and the chief ends.
        assert procs[0].wait(timeout=LOST_PEER_TIMEOUT) != 0
        with open(os.path.join(out, "worker0.log")) as f:
            failed = [line for line in f.read().splitlines() if "WorkerFailed: " in line]
        # One line, naming what this worker's collective raised.
        assert len(failed) == 1 and re.search(
            r"WorkerFailed: a collective with another worker failed in fit: .* "
            + NAMED_CAUSE, failed[0]), failed
    finally:
        runs_lib.stop(procs)
    with open(os.path.join(out, "backup", "training_metadata.json")) as f:
        assert json.load(f)["epoch"] == 2  # epochs 0 and 1 backed up
    killed = {str(d): sorted(d.glob("gradient_averaging_worker_*")) for d in temporary}
    procs = runs_lib.start(command, envs=envs, log_dir=out)
    try:
        chiefs.append(procs[0].pid)
        assert runs_lib.wait(procs, TIMEOUT) == [0, 0], runs_lib.logs(out)
    finally:
        runs_lib.stop(procs)
    for index in range(2):
        result = saved(out, index)
        for got, want in zip(arrays(result, "n_numpy", "weights"), weights, strict=True):
            np.testing.assert_allclose(got, want, atol=1e-5)
        resumed = json.loads(str(result["logs"]))["n_numpy"]["history"]
        for key, values in history.items():  # epochs 2 and 3 only
            np.testing.assert_allclose(resumed[key], values[2:], rtol=1e-5, atol=1e-6)
    assert os.path.exists(os.path.join(out, "checkpoint.weights.h5"))
    assert not os.path.exists(os.path.join(out, "backup"))  # deleted at the end
    events = glob.glob(os.path.join(out, "tensorboard", "**", "events.out.tfevents.*"),
                       recursive=True)
    # events.out.tfevents.TIME.HOST.PID.N.v2: the chief's processes', never worker 1's.
    assert events and {int(os.path.basename(e).split(".")[-3]) for e in events} == set(chiefs)
    for directory in temporary:  # only what the killed process could not remove
        assert sorted(directory.glob("gradient_averaging_worker_*")) == killed[str(directory)]


@pytest.mark.slow
def test_auto_micro_batch_agrees_on_the_smallest_that_any_worker_found(tmp_path):
    out = str(tmp_path)
    envs = [{"TF_CPU_ALLOCATOR_USE_BFC": "true", "TF_NUM_INTEROP_THREADS": "1",
             "TF_ENABLE_ONEDNN_OPTS": "0", "TF_CPU_BFC_MEM_LIMIT_IN_MB": str(limit)}
            for limit in LIMITS_MB]
    procs = runs_lib.start(["tests.library.multi_worker_runs", f"--out={out}", "--auto"],
                           envs=envs, log_dir=out)
    try:
        direct = runs_lib.auto_micro_batch()  # the direct batch, one process, no limit
        assert runs_lib.wait(procs, TIMEOUT) == [0, 0], runs_lib.logs(out)
    finally:
        runs_lib.stop(procs)
    results = [saved(out, i) for i in range(2)]
    own = [int(result["own"]) for result in results]
    assert own[0] < own[1]  # each measured its own device
    for result in results:
        assert int(result["micro_batch"]) == own[0]  # both train at the smaller
        for key, want in direct.items():  # the direct batch's weights
            np.testing.assert_allclose(result[key], want, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_out_of_memory_in_the_searchs_update_ends_every_worker_in_one_line(tmp_path):
    """Worker 0's device holds a sample's pass but not the update, which runs out of
    memory with its collectives in flight: worker 0 says so, and worker 1, left in
    them, says another worker failed; neither waits for the other."""
    out = str(tmp_path)
    bfc = {"TF_CPU_ALLOCATOR_USE_BFC": "true", "TF_NUM_INTEROP_THREADS": "1",
           "TF_ENABLE_ONEDNN_OPTS": "0"}
    envs = [dict(bfc, TF_CPU_BFC_MEM_LIMIT_IN_MB=str(WIDE_LIMIT_MB)), bfc]
    procs = runs_lib.start(["tests.library.multi_worker_runs", f"--out={out}", "--wide"],
                           envs=envs, log_dir=out)
    try:
        runs_lib.wait(procs, TIMEOUT)
        for p in procs:
            p.wait(timeout=LOST_PEER_TIMEOUT)
    finally:
        runs_lib.stop(procs)
    assert [p.returncode != 0 for p in procs] == [True, True], runs_lib.logs(out)
    lines = []
    for index in range(2):
        with open(os.path.join(out, f"worker{index}.log")) as f:
            lines.append([line for line in f.read().splitlines()
                          if line.startswith("gradient_averaging.")])
    assert len(lines[0]) == 1 and lines[0][0].startswith(
        "gradient_averaging.micro_batch.NothingFits: the update (the optimizer's apply) ran "
        "out of the device's memory"), lines
    assert "a collective strategy cannot retry one worker alone" in lines[0][0]
    assert len(lines[1]) == 1 and lines[1][0].startswith(
        "gradient_averaging.replicas.WorkerFailed: another worker failed in the micro-batch "
        "search"), lines
    assert re.search(NAMED_CAUSE, lines[1][0]), lines


@pytest.mark.parametrize("cluster, expected", [
    ({"worker": ["127.0.0.1:1", "127.0.0.1:2"]}, 2),
    ({"chief": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"]}, 2),  # the chief is a worker
    ({"chief": ["127.0.0.1:1"]}, 1)])
def test_the_workers_of_a_cluster_count_its_chief(cluster, expected, monkeypatch):
    import tensorflow as tf

    from gradient_averaging import replicas

    first = "chief" if "chief" in cluster else "worker"
    monkeypatch.setenv("TF_CONFIG", json.dumps(
        {"cluster": cluster, "task": {"type": first, "index": 0}}))

    class Strategy:  # what replicas.workers reads of a MultiWorkerMirroredStrategy
        cluster_resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()

    assert replicas.workers(Strategy()) == expected
