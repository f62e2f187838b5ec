"""accumulate + Keras fit on two worker processes (MultiWorkerMirroredStrategy, one CPU
replica each, 127.0.0.1; tests/library/multi_worker_runs), against one process.

Keras 3.15's own fit fails there (keras-team/keras#20585); the AccumulatingModel's
trains to the one-process direct batch's weights, History (validation included),
evaluation and predictions, with N mini-batches per update and with a micro-batch size,
on numpy arrays and on a tf.data dataset each worker reads whole; batch norm's moving
statistics take the direct batch's steps, pooled across the workers.
"""

import json
import os

import numpy as np
import pytest

from tests.library import multi_worker_runs as runs_lib
from tests.library import toys

TIMEOUT = 420  # seconds for the workers' runs, on a loaded 2-core machine


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
            make = toys.bn_model if name == "bn" else toys.tiny_model
            references[name] = runs_lib.train(make, make_optimizer, source,
                                              toys.N * toys.B)
        codes = runs_lib.wait(procs, TIMEOUT)
        assert codes == [0, 0], runs_lib.logs(out)
    finally:
        runs_lib.stop(procs)
    return [saved(out, i) for i in range(2)], references


@pytest.mark.slow
@pytest.mark.parametrize("name", ["n_numpy", "micro_dataset"])
def test_fit_on_two_workers_equals_the_one_process_direct_batch(workers, name):
    results, references = workers
    weights, history, evaluation, predictions, _ = references[name]
    for result in results:  # each worker ends with the same model
        for got, want in zip(arrays(result, name, "weights"), weights, strict=True):
            np.testing.assert_allclose(got, want, atol=1e-5)
        logged = json.loads(str(result["logs"]))[name]
        assert sorted(logged["history"]) == sorted(history)  # val_ included
        for key, values in history.items():
            np.testing.assert_allclose(logged["history"][key], values, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(logged["evaluate"], evaluation, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(result[f"{name}/predict"], predictions, atol=1e-5)
    initial = toys.tiny_model().get_weights()
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
