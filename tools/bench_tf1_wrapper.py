"""What AveragingOptimizer's train op costs against the plain optimizer's, per mini-batch.

On the post's ConvNet (dense gradients, Adam) and an embedding table (sparse, Momentum); each
contender a TrainOp fed a few fixed random batches (the values do not change the speed).
"""

import collections
import contextlib
from unittest import mock

import numpy as np
import tensorflow as tf

import model
from gradient_averaging import AveragingOptimizer
from gradient_averaging import tf1
from tools import bench_contenders as bc
from tools.bench_section import Section
from tools.bench_section import quartiles
from tools.bench_section import table
from tools.bench_section import worst

v1 = tf.compat.v1

DENSE_N, DENSE_B = 5, 20  # the post's (5, 20)
SPARSE_N, SPARSE_B, ROWS, WIDTH = 4, 128, 50000, 64  # docs/tf1-code.md's table


def _dense_model():
    images = v1.placeholder(tf.float32, [None, 28, 28, 1], name="images")
    labels = v1.placeholder(tf.int64, [None], name="labels")
    ops = model.build("convnet", images, labels, tf.constant(False),
                      tf.constant([0, 0], tf.int64), dropout=0.0)
    rng = np.random.RandomState(0)
    feeds = [{images: rng.rand(DENSE_B, 28, 28, 1).astype(np.float32),
              labels: rng.randint(10, size=DENSE_B)} for _ in range(8)]
    return ops.loss, feeds, v1.train.AdamOptimizer(1e-3)


def _sparse_model():
    ids = v1.placeholder(tf.int32, [None], name="ids")
    target = v1.placeholder(tf.float32, [None], name="target")
    table = tf.Variable(tf.random.normal([ROWS, WIDTH], seed=3), name="table")
    loss = tf.reduce_mean(tf.square(
        tf.reduce_sum(tf.nn.embedding_lookup(table, ids), axis=1) - target))
    rng = np.random.RandomState(0)
    feeds = [{ids: rng.randint(ROWS, size=SPARSE_B), target: rng.rand(SPARSE_B)}
             for _ in range(8)]
    return loss, feeds, v1.train.MomentumOptimizer(0.01, 0.9)


# build: () -> (loss, [feed dict], optimizer) in the graph; held_to: what the wrapper is held
# to, limit: the most it may take of it. Sparse gradients are held to the floor, as no design
# brings them near the plain run.
Model = collections.namedtuple("Model", "build n b held_to limit")
MODELS = {"dense": Model(_dense_model, DENSE_N, DENSE_B, "plain", 1.05),
          "sparse": Model(_sparse_model, SPARSE_N, SPARSE_B, "floor", 1.35)}
# label -> (N, lock): None for the plain optimizer's minimize.
CONTENDERS = {"plain": (None, True), "wrapped": ("N", True), "unlocked": ("N", False),
              "wrapped N=1": (1, True)}


def _floor(build, n, b):
    """A TrainOp's build of the least any accumulating design runs: N train ops in turn, no
    counter, branch, lock or finiteness check; each adds its gradient (sparse: its rows, ids
    kept), the last also applies the sum / N and then zeroes what it applied."""
    loss, feeds, optimizer = build()
    pairs = optimizer.compute_gradients(loss)
    sums = [tf.Variable(tf.zeros(v.shape, v.dtype), trainable=False) for _, v in pairs]
    ids = [tf.Variable(tf.zeros([n, b], tf.int32), trainable=False)
           if isinstance(g, tf.IndexedSlices) else None for g, _ in pairs]

    def add(k):
        ops = []
        for (g, _), total, window_ids in zip(pairs, sums, ids):
            ops += [total.assign_add(g, read_value=False)] if window_ids is None else [
                v1.scatter_add(total, g.indices, g.values),
                v1.scatter_update(window_ids, [k], g.indices[None])]
        return ops

    def zero(total, rows):
        """What was applied of `total`, zeroed: the whole sum, or its rows."""
        if rows is None:
            return total.assign(tf.zeros_like(total))
        return v1.scatter_update(total, rows, tf.zeros([tf.size(rows), *total.shape[1:]],
                                                       total.dtype))

    def apply():
        rows = [None if w is None else tf.unique(tf.reshape(w, [-1]))[0] for w in ids]
        means = [(total / n if r is None else tf.IndexedSlices(tf.gather(total, r) / n, r), v)
                 for (_, v), total, r in zip(pairs, sums, rows)]
        with tf.control_dependencies([optimizer.apply_gradients(means)]):
            return tf.group(*map(zero, sums, rows))

    ops = [tf.group(*add(k)) for k in range(n - 1)]
    with tf.control_dependencies(add(n - 1)):
        ops.append(apply())
    return ops, feeds


def _unlocked(window, after):
    """The window lock taken out, to time it: the block it guards a plain group of its ops."""
    del window, after
    held = tf1._Held()  # noqa: SLF001 (the lock, timed alone)
    yield held
    held.released = tf.group(*held.ops)


def _train_op(build, n, locked):
    """A TrainOp's build: the optimizer in AveragingOptimizer(n) unless n is None."""
    loss, feeds, optimizer = build()
    if n is not None:
        optimizer = AveragingOptimizer(optimizer, n)
    unlocked = mock.patch.object(tf1._Window, "locked",  # noqa: SLF001 (as _unlocked)
                                 contextlib.contextmanager(_unlocked))
    with contextlib.nullcontext() if locked else unlocked:
        return [optimizer.minimize(loss)], feeds


class Wrapper(Section):
    name, title = "wrapper", "AveragingOptimizer's train op against the plain optimizer's"
    FULL, QUICK = dict(rounds=15, windows=10), dict(rounds=2, windows=1)  # block: windows*N

    def measure(self, run):
        """{model: {"n", "b", "times", "median_ms", "vs_plain", "vs_floor": {label: paired
        ratio}, "lock": wrapped / unlocked}}."""
        out = {}
        for name, (build, n, b, *_) in MODELS.items():
            contenders = [bc.TrainOp(label, _train_op, build, n if size == "N" else size, locked)
                          for label, (size, locked) in CONTENDERS.items()]
            contenders.append(bc.TrainOp("floor", _floor, build, n, b))
            times, _, _ = bc.race(contenders, self.settings["windows"] * n,
                                  self.settings["rounds"])
            out[name] = dict(n=n, b=b, lock=bc.paired_ratio(times, "wrapped", "unlocked"),
                             **bc.clocked(times, vs_plain=([k for k in times if k != "plain"],
                                                           "plain"),
                                          vs_floor=(("plain", "wrapped", "unlocked"), "floor")))
            run.log(f"AveragingOptimizer, {name} at N={n} x B={b}: " + ", ".join(
                f"{k}: {r['ratio']:.3f}x plain" for k, r in out[name]["vs_plain"].items()))
        return out

    def targets(self, result):
        out = []
        for name, row in result.items():
            base, limit = MODELS[name].held_to, MODELS[name].limit
            what = "the plain optimizer's" if base == "plain" else "the floor's"
            out.append(worst(f"AveragingOptimizer's train op <= {limit}x {what}, {name} "
                             f"(N={row['n']}, B={row['b']})",
                             {name: row[f"vs_{base}"]["wrapped"]}, limit))
        return out

    def markdown(self, result):
        return self.heading(
            "Per mini-batch run at the same B: the ConvNet with Adam (dense gradients) and "
            f"a {ROWS} x {WIDTH} table with Momentum (sparse gradients). Median ms per "
            "run; ratios paired per round (median, quartiles). `unlocked`: without the "
            "window's lock. `floor`: N train ops in turn, the last also applying, with no "
            "count, branch, lock or finiteness check: the least any design that adds each "
            "run's gradient runs (docs/tf1-code.md).") + table(
            ("model", "N x B", "plain ms", "wrapped ms", "floor ms", "wrapped / plain",
             "unlocked / plain", "N=1 / plain", "floor / plain", "wrapped / floor",
             "the lock: wrapped / unlocked"),
            [(name, f"{row['n']} x {row['b']}", *(f"{row['median_ms'][k]:.2f}" for k in (
                "plain", "wrapped", "floor")), *(quartiles(row["vs_plain"][k]) for k in (
                    "wrapped", "unlocked", "wrapped N=1", "floor")),
              quartiles(row["vs_floor"]["wrapped"]), quartiles(row["lock"]))
             for name, row in result.items()])

