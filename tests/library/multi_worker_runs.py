"""Keras fit through accumulate on the workers of one MultiWorkerMirroredStrategy, for
test_multi_worker: each worker is this module in a process of its own, with its own
TF_CONFIG on 127.0.0.1 (start() starts them).

    TF_CONFIG=... python -m tests.library.multi_worker_runs --out=DIR [--runs=a,b]
    TF_CONFIG=... python -m tests.library.multi_worker_runs --out=DIR --resume [--kill-epoch=K]
    TF_CONFIG=... python -m tests.library.multi_worker_runs --out=DIR --auto [--wide]

Each worker trains every run of RUNS (tests/library/toys's tiny models and data, as
Keras's distributed guide writes it: model and compile in the strategy's scope, fit,
evaluate and predict outside) and writes DIR/worker<index>.npz: per run its weights,
History, evaluation, predictions and batch-norm moving statistics. Each worker reads the
whole data; Keras's autosharding gives each its half of every global batch.

--resume: one run of RESUME_EPOCHS epochs (n_numpy's model) with Keras's writing
callbacks, BackupAndRestore (DIR/backup, a backup each epoch), ModelCheckpoint
(DIR/checkpoint.weights.h5) and TensorBoard (DIR/tensorboard); with --kill-epoch=K worker
1 kills itself (SIGKILL) after the second window of epoch K.

--auto: micro_batch_size="auto" on tests/library/micro_batch_runs's sequence MLP, effective
batches of AUTO_E, each worker under the memory limit its environment gives
(TF_CPU_BFC_MEM_LIMIT_IN_MB); DIR/worker<index>.npz holds the weights, the micro-batch
trained at and the largest one this worker's own trials found to fit. --wide: a model of
large weights and small activations instead (WIDE), searched with a budget no device
holds and no margin: a worker whose memory limit is under what the update needs
runs out of memory in the update, with its collectives in flight.
"""

import argparse
import json
import os
import subprocess
import sys
import time

from tools.launch_workers import HOST
from tools.launch_workers import free_ports

EPOCHS = 2
RESUME_EPOCHS = 4
AUTO_E = 178  # two replicas' shares of 89 (a prime): micro_batch_runs.MIRRORED_E
# --wide: 1,024 features into 4,096 units (16 MiB of weights, 64 MiB with Adam's slots and
# the window's sums; a sample's pass adds its 16 MiB gradient, the update more).
WIDE = 1024, 4096
HEARTBEAT_S = 30  # the coordination service's heartbeat timeout (coordinate)


def runs():
    """name -> (model maker, optimizer maker, fit's data source, fit's batch_size)."""
    from gradient_averaging import keras_fit
    from tests.library import sequences
    from tests.library import toys

    def accumulate(**kwargs):
        return lambda: keras_fit.accumulate(toys.tiny_model(), **kwargs)

    mini_batches = dict(average_gradients=toys.N)
    micro_batches = dict(micro_batch_size=toys.B // 4)  # a replica's 40 of E=80: 8 of 5
    # The ways to give the window, on the two kinds of data (a run costs its workers
    # tens of seconds under load: not every pairing); batch norm apart (its weights are
    # not the direct batch's: each forward pass normalizes by a worker's share).
    return {
        # accumulate(model, 1): plain training, Keras fit where Keras's own fails.
        "one_dataset": (accumulate(average_gradients=1), toys.sgd, "tf.data",
                        toys.N * toys.B),
        "n_numpy": (accumulate(**mini_batches), toys.sgd, "numpy", toys.B),
        "micro_dataset": (accumulate(**micro_batches), toys.OPTIMIZERS["adam"], "tf.data",
                          toys.N * toys.B),
        "bn": (lambda: keras_fit.accumulate(toys.bn_model(), toys.N), toys.sgd, "numpy",
               toys.B),
        # Padded token sequences under a mask: the workers sum the window's valid tokens.
        "sequences_n": (lambda: keras_fit.accumulate(sequences.tagger(), sequences.N),
                        sequences.sgd, "numpy", sequences.B),
    }


def plain_model(name):
    """The model a run wraps, plain: its direct batch's."""
    from tests.library import sequences
    from tests.library import toys
    return {"bn": toys.bn_model, "sequences_n": sequences.tagger}.get(name, toys.tiny_model)


def direct_batch(name):
    """The direct batch's size for a run: its window's samples."""
    from tests.library import sequences
    from tests.library import toys
    return sequences.N * sequences.B if name.startswith("sequences") else toys.N * toys.B


def run_data(name):
    """A run's (x, y)."""
    from tests.library import sequences
    from tests.library import toys
    if name.startswith("sequences"):
        ids, labels, _ = sequences.sequences(empty=(slice(8, 16),))
        return ids, labels
    return toys.data()


def train(make_model, make_optimizer, source, batch_size, strategy=None, epochs=EPOCHS,
          callbacks=None, data=None, validation_batch=None):
    """A run: (weights, History's history, evaluate's list, predict's array, moving
    statistics), the model made and compiled in `strategy`'s scope (if any), on `data`
    ((x, y); toys.data()'s by default), validated in batches of `validation_batch`
    (None: batch_size)."""
    import contextlib

    from tests.library import toys
    x, y = data or toys.data()
    with strategy.scope() if strategy else contextlib.nullcontext():
        model = toys.compiled(make_model(), make_optimizer())
    # Validation in the direct batch's batches: a masked loss is each batch's token mean.
    validation = (x[:64], y[:64])
    history = toys.fit(model, x, y, batch_size, source, epochs=epochs,
                       validation_data=validation, validation_batch_size=validation_batch,
                       callbacks=callbacks).history
    return (model.get_weights(), history, model.evaluate(x, y, verbose=0),
            model.predict(x, verbose=0), toys.moving_statistics(model))


def writing_callbacks(out, kill_epoch=None):
    """BackupAndRestore, ModelCheckpoint and TensorBoard under `out`; with `kill_epoch`,
    on worker 1, one that kills its process (SIGKILL) mid-epoch."""
    import signal

    import keras

    class Kill(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

        def on_train_batch_end(self, batch, logs=None):
            if self.epoch == kill_epoch and batch == 1:
                os.kill(os.getpid(), signal.SIGKILL)

    index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    kill = [Kill()] if kill_epoch is not None and index == 1 else []
    return [keras.callbacks.BackupAndRestore(os.path.join(out, "backup")),
            keras.callbacks.ModelCheckpoint(os.path.join(out, "checkpoint.weights.h5"),
                                            save_weights_only=True),
            keras.callbacks.TensorBoard(os.path.join(out, "tensorboard")), *kill]


def auto_micro_batch(strategy=None):
    """The --auto run (or, without a strategy, its direct batch): {weights/i, and with
    a strategy micro_batch (trained at), own (the largest its own search found)}."""
    import contextlib

    import keras

    from gradient_averaging import keras_fit
    from tests.library import micro_batch_runs
    from tests.library import toys
    x, y = micro_batch_runs.data()
    with strategy.scope() if strategy else contextlib.nullcontext():
        model = micro_batch_runs.model()
        if strategy:
            model = keras_fit.accumulate(model, micro_batch_size="auto")
        toys.compiled(model, keras.optimizers.Adam(1e-3))
    model.fit(x, y, batch_size=AUTO_E, epochs=1, shuffle=False, verbose=0)
    out = {f"weights/{i}": w for i, w in enumerate(model.get_weights())}
    if strategy:
        found = model.micro_batch
        limit = found.budget * (1 - found.margin)
        out["micro_batch"] = found.micro_batch_size
        out["own"] = max(size for size, peak in found.trials
                         if peak is not None and peak <= limit)
        if found.predicted:  # its whole share, taken untried
            out["own"] = -(-found.effective_batch // found.replicas)
    return out


def wide_update(strategy):
    """The --auto --wide run: fit searches, and raises where the update does not fit."""
    import keras
    import numpy as np

    from gradient_averaging import keras_fit
    from tests.library import toys
    features, units = WIDE
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, features)).astype(np.float32)
    y = rng.integers(0, 10, 64)
    init = keras.initializers.GlorotUniform
    with strategy.scope():
        model = keras.Sequential([keras.Input((features,)),
                                  keras.layers.Dense(units, kernel_initializer=init(1)),
                                  keras.layers.Dense(10, kernel_initializer=init(2))])
        model = keras_fit.accumulate(model, micro_batch_size="auto", budget=1 << 30,
                                     margin=0.0)
        toys.compiled(model, keras.optimizers.Adam(1e-3))
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)


def coordinate(tf):
    """Configures the coordination service as MultiWorkerMirroredStrategy would, with a
    heartbeat timeout of HEARTBEAT_S: the default (10 s) is shorter than a worker's
    heartbeat thread can starve on a loaded 2-core machine, and the service then
    aborts every worker's collectives. A killed worker is noticed within it."""
    from tensorflow.python.distribute import collective_all_reduce_strategy as strategy_lib
    from tensorflow.python.distribute import multi_worker_util
    from tensorflow.python.eager import context
    cluster = tf.distribute.cluster_resolver.TFConfigClusterResolver().cluster_spec()
    context.context().configure_coordination_service(
        service_type="standalone",
        service_leader=multi_worker_util.coordination_leader(cluster),
        heartbeat_timeout_in_ms=HEARTBEAT_S * 1000,
        coordinated_jobs=[strategy_lib.coordination_config_pb2.CoordinatedJob(
            name="worker", num_tasks=cluster.num_tasks("worker"))])


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--runs", default=",".join(runs()))
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--kill-epoch", type=int)
    parser.add_argument("--auto", action="store_true")
    parser.add_argument("--wide", action="store_true")
    args = parser.parse_args()
    import numpy as np
    import tensorflow as tf
    coordinate(tf)
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    made = runs()
    arrays, logs = {}, {}
    if args.wide:
        wide_update(strategy)
        return
    if args.auto:
        arrays = auto_micro_batch(strategy)
        np.savez(os.path.join(args.out, f"worker{index}.npz"), **arrays)
        return
    names = ["n_numpy"] if args.resume else args.runs.split(",")
    for name in names:
        callbacks = writing_callbacks(args.out, args.kill_epoch) if args.resume else None
        weights, history, evaluation, predictions, moving = train(
            *made[name], strategy, epochs=RESUME_EPOCHS if args.resume else EPOCHS,
            callbacks=callbacks, data=run_data(name), validation_batch=direct_batch(name))
        for i, w in enumerate(weights):
            arrays[f"{name}/weights/{i}"] = w
        for i, s in enumerate(moving):
            arrays[f"{name}/moving/{i}"] = s
        arrays[f"{name}/predict"] = predictions
        logs[name] = {"history": history, "evaluate": evaluation}
    arrays["logs"] = np.array(json.dumps(logs))
    np.savez(os.path.join(args.out, f"worker{index}.npz"), **arrays)


# ---------------------------------------------------------------- the test's side


def start(module_args, workers=2, envs=None, log_dir=None):
    """Starts `python -m MODULE_ARGS` as the workers of one cluster on 127.0.0.1, each
    with its own TF_CONFIG (and its own entries of `envs`, one dict per worker); their
    output goes to log_dir/worker<i>.log (or is discarded). Returns the Popen objects:
    the caller must kill() them (stop()), in a `finally`."""
    from tests.helpers import CPU_ONLY
    from tests.helpers import ROOT
    ports = free_ports(workers)
    cluster = {"worker": [f"{HOST}:{p}" for p in ports]}
    procs = []
    for index in range(workers):
        env = dict(os.environ, **CPU_ONLY, **((envs or [{}] * workers)[index]),
                   PYTHONPATH=ROOT, TF_CONFIG=json.dumps(
                       {"cluster": cluster, "task": {"type": "worker", "index": index}}))
        log = (open(os.path.join(log_dir, f"worker{index}.log"), "a") if log_dir
               else subprocess.DEVNULL)
        procs.append(subprocess.Popen([sys.executable, "-m", *module_args], cwd=ROOT, env=env,
                                      stdout=log, stderr=subprocess.STDOUT))
        if log_dir:
            log.close()  # the child holds its own copy
    return procs


def wait(procs, timeout):
    """Waits for every process to end, at most `timeout` seconds in all, stopping early
    where one failed (its peers would wait for it). Returns their exit codes (None for
    one still running)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        codes = [p.poll() for p in procs]
        if all(c is not None for c in codes) or any(c not in (None, 0) for c in codes):
            return codes
        time.sleep(0.2)
    return [p.poll() for p in procs]


def stop(procs):
    """Kills every process still running, and reaps it."""
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()


def logs(log_dir, workers=2):
    """The workers' output, for an assertion's message (each log's last 3,000 chars)."""
    out = []
    for index in range(workers):
        path = os.path.join(log_dir, f"worker{index}.log")
        if os.path.exists(path):
            with open(path) as f:
                out.append(f"--- worker {index}:\n{f.read()[-3000:]}")
    return "\n".join(out)


if __name__ == "__main__":
    main()
