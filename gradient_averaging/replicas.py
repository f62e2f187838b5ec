"""Each GLOBAL mini-batch split across the replicas on the host, so the result does not depend on
the replica count and a replica receives only its share; and a window's replica-local variables."""

import tensorflow as tf


def replica_share(data, sizes, replica, replicas):
    """Replica r of K's (`replica`, `replicas`) share of each stacked mini-batch, samples
    [n*r//K, n*(r+1)//K). `data`: nested [N, B, ...] tensors; `sizes`: int32 [N], each global
    mini-batch's samples. Returns (share, local_sizes): tensors [N, ceil(B/K), ...], row i the
    share of mini-batch i then zeros; int32 [N], each share's samples."""
    sizes = tf.convert_to_tensor(sizes, tf.int32)
    start, stop = sizes * replica // replicas, sizes * (replica + 1) // replicas
    local_sizes = stop - start
    first = tf.nest.flatten(data)[0]
    width = -(-tf.shape(first)[1] // replicas)
    rows = tf.range(width)[tf.newaxis]
    inside = rows < local_sizes[:, tf.newaxis]  # [N, width]
    index = tf.minimum(start[:, tf.newaxis] + rows, tf.maximum(tf.shape(first)[1] - 1, 0))

    def cut(t):
        share = tf.gather(t, index, batch_dims=1)
        mask = tf.reshape(inside, tf.concat([tf.shape(inside), tf.ones(
            [tf.rank(share) - 2], tf.int32)], 0))
        return tf.where(mask, share, tf.zeros_like(share))

    return tf.nest.map_structure(cut, data), local_sizes


def distribute(strategy, batch):
    """One global mini-batch as each replica's share, cut on the host (cross-replica
    context): per-replica (share, its samples); on one replica, (batch, its samples)."""
    size = tf.shape(tf.nest.flatten(batch)[0], out_type=tf.int32)[0]
    replicas = strategy.num_replicas_in_sync
    if replicas == 1:
        return batch, size
    host = tf.nest.flatten(batch)[0].device or "/cpu:0"

    def share(context):
        with tf.device(host):
            cut, local = replica_share(tf.nest.map_structure(lambda t: t[tf.newaxis], batch),
                                       size[tf.newaxis], context.replica_id_in_sync_group,
                                       replicas)
            cut = tf.nest.map_structure(lambda t: t[0, :local[0]], cut)
        return tf.nest.map_structure(tf.identity, (cut, local[0]))  # on the replica's device

    return strategy.experimental_distribute_values_from_function(share)


class WorkerFailed(RuntimeError):
    """A peer worker failed or left during a collective. Its one-line message: `message` (what
    to do), then this worker's error's first line: evidence where no worker's output says why."""

    def __init__(self, message, error):
        # The first line after a graph error's header and its node's (indented) traceback.
        lines = (getattr(error, "message", None) or str(error)).splitlines()
        cause = [line for line in lines if line.strip() and not line[0].isspace()
                 and not line.startswith(("Graph execution error", "Detected at node"))]
        super().__init__(f"{message} (here, {type(error).__name__}: "
                         f"{cause[0][:200] if cause else ''})")


# What a collective raises on a worker whose peer failed or went away.
COLLECTIVE_ERRORS = (tf.errors.UnavailableError, tf.errors.AbortedError,
                     tf.errors.CancelledError, tf.errors.DeadlineExceededError)


def workers(strategy):
    """Worker processes in `strategy`'s cluster (1 without one), the chief counted as a worker,
    as TensorFlow and experiment/workers.py count them."""
    resolver = getattr(strategy, "cluster_resolver", None)
    if resolver is None:
        return 1
    tasks = resolver.cluster_spec().as_dict()
    return max(1, len(tasks.get("chief", [])) + len(tasks.get("worker", [])))


def local_variable(initial_value, aggregation, name):
    """A replica-local variable: updates stay on the replica; a cross-replica read aggregates."""
    return tf.Variable(initial_value, trainable=False, name=name,
                       synchronization=tf.VariableSynchronization.ON_READ,
                       aggregation=aggregation)
