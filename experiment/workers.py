"""The workers of one --distribute=multi_worker job: who writes, that all were given the
same settings, and the line for a worker that is lost.

Each worker is a process with its own TF_CONFIG, training every global mini-batch in
lockstep with the others: every collective (an all-reduce, a gather) must be run by every
worker, in the same order. So the workers agree at start on what shapes their collectives
(`differing`: a gather of one hash per setting), and worker 0, the chief, alone writes what
one file receives (the checkpoint, the results, the events); the others write only what
TensorFlow's checkpointing makes every worker write, in a directory of their own
(`own_directory`), removed after each save.

TensorFlow is imported only where a collective runs: results.py asks `task` which worker
this is without it.
"""

import hashlib
import json
import os
import re

import numpy as np

from experiment import config as config_lib

# Settings each worker may have of its own: the chief alone writes --results and
# --logdir; --data-dir's files are compared instead of its path (DATA), and
# --checkpoint-dir's presence instead of its path (CHECKPOINTS).
PER_WORKER = ("threads", "data-dir", "results", "logdir", "checkpoint-dir")
DATA = "data-dir (its files' contents)"
CHECKPOINTS = "checkpoint-dir (given or not)"


def task():
    """(this worker's index, the workers' addresses) from TF_CONFIG: (0, []) without a
    cluster (a single local worker). A cluster with a `chief` task counts it first, as
    TensorFlow does: it is worker 0, and `worker` I is worker I + 1."""
    try:
        tf_config = json.loads(os.environ.get("TF_CONFIG") or "{}")
        cluster, me = tf_config["cluster"], tf_config["task"]
        chief = list(cluster.get("chief", ()))
        index = int(me["index"]) + (0 if me.get("type") == "chief" else len(chief))
        return index, chief + list(cluster["worker"])
    except (ValueError, KeyError, TypeError):
        return 0, []


def count(config):
    """The workers of a run of `config`: 1 unless --distribute=multi_worker."""
    return max(1, len(task()[1])) if config.distribute == "multi_worker" else 1


def index(config):
    """This worker's index: 0 (the chief) unless it is another multi_worker worker."""
    return task()[0] if config.distribute == "multi_worker" else 0


def own_directory(checkpoint_dir, worker):
    """Where worker `worker` (not the chief) writes under a --checkpoint-dir: its lock,
    and its part of each save, removed once written."""
    return os.path.join(checkpoint_dir, f".worker-{worker}")


def own_part(checkpoint_dir, config):
    """Where this worker writes its part of the saves of the run in `checkpoint_dir`
    (DIR/rep-<r>): None for the chief, which writes the checkpoint itself."""
    worker = index(config)
    if not worker:
        return None
    parent, rep = os.path.split(os.path.normpath(checkpoint_dir))
    return os.path.join(own_directory(parent, worker), rep)


def name(worker):
    """`worker 1 (127.0.0.1:PORT)`: a worker by its index and address."""
    addresses = task()[1]
    address = f" ({addresses[worker]})" if 0 <= worker < len(addresses) else ""
    return f"worker {worker}{address}"


# ---------------------------------------------------------------- the same settings


def settings(config, runs):
    """{setting: value} that must be equal on every worker: every flag but PER_WORKER,
    and whether checkpoints are kept."""
    values = {}
    for flag, setting in config_lib.SETTINGS.items():
        owner = config if setting.owner is config_lib.Config else runs
        if flag not in PER_WORKER and owner is not None:
            values[flag] = getattr(owner, setting.attribute)
    if runs is not None:
        values[CHECKPOINTS] = bool(runs.checkpoint_dir)
    return values


def data_digest(datasets):
    """sha256 of every split's images and labels: equal on workers that read the same data."""
    digest = hashlib.sha256()
    for split in datasets:
        for array in split:
            digest.update(memoryview(np.ascontiguousarray(array)).cast("B"))
    return digest.hexdigest()


def _hash(value):
    """A setting's value as a non-negative int64."""
    return int(hashlib.sha256(repr(value).encode()).hexdigest()[:15], 16)


def gather(strategy, row):
    """Every worker's `row` (ints), worker 0's first: one collective all-gather, which
    every worker must run at the same point."""
    import tensorflow as tf  # here, not at import: results.py imports this module

    local = strategy.num_replicas_in_sync // count_from(strategy)
    value = strategy.experimental_distribute_values_from_function(
        lambda unused_context: tf.constant([row], tf.int64))
    rows = np.asarray(strategy.gather(value, axis=0))
    return rows[::local]  # each worker's replicas hold the same row


def count_from(strategy):
    """The workers of a strategy's cluster (1 without one)."""
    resolver = getattr(strategy, "cluster_resolver", None)
    spec = resolver.cluster_spec().as_dict() if resolver else {}
    return max(1, len(spec.get("worker", ())) + len(spec.get("chief", ())))


def differing(strategy, values, flags=()):
    """Exchanges `values` ({name: value}) with the other workers.

    Args:
      flags: names of booleans to OR over the workers (each worker's own value in
        `values` is not compared).

    Returns:
      (the names whose values are not equal on every worker, sorted; {flag: whether any
      worker has it}).
    """
    names = sorted(set(values) - set(flags))
    rows = gather(strategy, [_hash(values[n]) for n in names]
                  + [int(bool(values[f])) for f in flags])
    differ = [n for column, n in enumerate(names) if len(set(rows[:, column])) > 1]
    return differ, {f: bool(rows[:, len(names) + i].any()) for i, f in enumerate(flags)}


def differ_line(names, values, worker, workers):
    """The one line for settings that are not equal on every worker."""
    first = names[0]
    more = f" (and {', '.join('--' + n for n in names[1:])})" if names[1:] else ""
    return (f"the {workers} workers were not given the same settings: --{first} differs{more}; "
            f"this one, worker {worker}, has {values[first]!r}. Start every worker with the "
            f"same flags (each may have its own --threads, --data-dir path, --results and "
            f"--logdir, which only worker 0 writes)")


# ---------------------------------------------------------------- a lost worker

# What TensorFlow's errors say of the peer they lost: the coordination service's list of
# tasks that stopped sending heartbeats, else the remote target a call failed on.
_UNHEALTHY = re.compile(r"unhealthy[^\n]*\n\s*/job:\w+/replica:\d+/task:(\d+)")
_TASK = re.compile(r"/job:\w+/(?:replica:\d+/)?task:(\d+)")
# Beyond the library's errors of a collective whose peer died, cannot be reached or timed
# out (gradient_averaging.replicas.COLLECTIVE_ERRORS), two the command line takes for a
# lost worker too: a failed precondition, and an internal error that names a collective.
MORE_LOST_ERRORS = ("FailedPreconditionError", "InternalError")


def lost_reason(error, config):
    """Why a collective failed, where a peer worker is lost (else None): `worker 1
    (127.0.0.1:PORT) cannot be reached (...)`."""
    from gradient_averaging import replicas  # TensorFlow's: imported where one failed

    if config.distribute != "multi_worker" or not (
            isinstance(error, replicas.COLLECTIVE_ERRORS)
            or type(error).__name__ in MORE_LOST_ERRORS):
        return None
    text = str(getattr(error, "message", None) or error)
    if type(error).__name__ == "DeadlineExceededError":
        return (f"no answer from the other workers within --worker-timeout="
                f"{config.worker_timeout} s (a collective timed out)")
    if type(error).__name__ == "InternalError" and "ollective" not in text:
        return None
    me = index(config)
    found = _UNHEALTHY.search(text)
    peers = [int(found.group(1))] if found else [
        int(t) for t in _TASK.findall(text) if int(t) != me]
    if "heartbeat" in text:
        how = "it stopped sending heartbeats"
    elif "Connection reset" in text or "ailed to connect" in text or "refused" in text:
        how = "its connection was lost"
    else:
        how = text.strip().splitlines()[0][:200]
    who = name(peers[0]) if peers else "another worker"
    return f"{who} cannot be reached ({how})"
