"""What AveragingOptimizer's train op costs against the plain optimizer's, per mini-batch.

At the same B, one run of the wrapper's train op (add the mini-batch; every Nth run also
apply the mean) against one of the plain optimizer's (apply every run), on the post's
ConvNet (dense gradients, Adam) and on an embedding table (sparse gradients, Momentum);
also the wrapper without its lock and at N=1. Each contender is a TrainOp, its own graph
and session, fed a few fixed random batches (these ops' speed does not depend on the values).
"""

import contextlib
import statistics
from unittest import mock

import numpy as np
import tensorflow as tf

import model
from gradient_averaging import AveragingOptimizer
from gradient_averaging import tf1
from tools.bench_contenders import TrainOp
from tools.bench_contenders import interleaved
from tools.bench_contenders import paired_ratio
from tools.bench_contenders import release
from tools.bench_section import Section
from tools.bench_section import quartiles
from tools.bench_section import table
from tools.bench_section import worst

v1 = tf.compat.v1

DENSE_N, DENSE_B = 5, 20  # the post's (5, 20)
SPARSE_N, SPARSE_B, ROWS, WIDTH = 4, 128, 50000, 64  # docs/tf1-code.md's table
TARGET = 1.05


def _dense_model():
    images = v1.placeholder(tf.float32, [None, 28, 28, 1], name="images")
    labels = v1.placeholder(tf.int64, [None], name="labels")
    ops = model.build("convnet", images, labels, tf.constant(False),
                      tf.constant([0, 0], tf.int64), dropout=0.0)
    rng = np.random.RandomState(0)
    feeds = [{images: rng.rand(DENSE_B, 28, 28, 1).astype(np.float32),
              labels: rng.randint(10, size=DENSE_B)} for _ in range(8)]
    return ops.loss, feeds, lambda: v1.train.AdamOptimizer(1e-3)


def _sparse_model():
    ids = v1.placeholder(tf.int32, [None], name="ids")
    target = v1.placeholder(tf.float32, [None], name="target")
    table = tf.Variable(tf.random.normal([ROWS, WIDTH], seed=3), name="table")
    loss = tf.reduce_mean(tf.square(
        tf.reduce_sum(tf.nn.embedding_lookup(table, ids), axis=1) - target))
    rng = np.random.RandomState(0)
    feeds = [{ids: rng.randint(ROWS, size=SPARSE_B), target: rng.rand(SPARSE_B)}
             for _ in range(8)]
    return loss, feeds, lambda: v1.train.MomentumOptimizer(0.01, 0.9)


MODELS = {"dense": (_dense_model, DENSE_N), "sparse": (_sparse_model, SPARSE_N)}
# label -> (N, lock): None for the plain optimizer's minimize.
CONTENDERS = {"plain": (None, True), "wrapped": ("N", True), "unlocked": ("N", False),
              "wrapped N=1": (1, True)}


def _unlocked(window, after):
    """AveragingOptimizer's window lock taken out, to time what it costs: the block it
    guards becomes a plain group of the same ops."""
    del window, after
    held = tf1._Held()  # noqa: SLF001 (the lock, timed alone)
    yield held
    held.released = tf.group(*held.ops)


def _train_op(build, n, locked):
    """A bench_contenders.TrainOp's build: the model's loss and feeds, its optimizer
    (wrapped in AveragingOptimizer(N) unless n is None; its lock taken out unless
    `locked`), and the train op."""
    def train_op():
        loss, feeds, make_optimizer = build()
        optimizer = make_optimizer()
        if n is not None:
            optimizer = AveragingOptimizer(optimizer, n)
        unlocked = mock.patch.object(tf1._Window, "locked",  # noqa: SLF001 (as _unlocked)
                                     contextlib.contextmanager(_unlocked))
        with contextlib.nullcontext() if locked else unlocked:
            return optimizer.minimize(loss), feeds
    return train_op


class Wrapper(Section):
    name, title = "wrapper", "AveragingOptimizer's train op against the plain optimizer's"
    FULL, QUICK = dict(rounds=15, windows=10), dict(rounds=2, windows=1)  # block: windows*N

    def measure(self, run):
        """{model: {"n", "b", "ms": {label: median ms per run}, "vs_plain": {label: paired
        ratio}, "lock": wrapped / unlocked}}."""
        out = {}
        for name, (build, n) in MODELS.items():
            contenders = [TrainOp(label, _train_op(build, n if size == "N" else size, locked))
                          for label, (size, locked) in CONTENDERS.items()]
            # Seconds per run; a block of `windows` whole windows, after one untimed block.
            times = interleaved(contenders, self.settings["windows"] * n, self.settings["rounds"])
            release(contenders)
            out[name] = {"n": n, "b": DENSE_B if name == "dense" else SPARSE_B,
                         "ms": {k: 1e3 * statistics.median(t) for k, t in times.items()},
                         "vs_plain": {k: paired_ratio(times, k, "plain") for k in times
                                      if k != "plain"},
                         "lock": paired_ratio(times, "wrapped", "unlocked")}
            run.log(f"AveragingOptimizer, {name} at N={n} x B={out[name]['b']}: " + ", ".join(
                f"{k}: {r['ratio']:.3f}x plain" for k, r in out[name]["vs_plain"].items()))
        return out

    def targets(self, result):
        return [worst(f"AveragingOptimizer's train op <= {TARGET}x the plain optimizer's, "
                      f"{name} (N={row['n']}, B={row['b']})",
                      {name: row["vs_plain"]["wrapped"]}, TARGET)
                for name, row in result.items()]

    def markdown(self, result):
        return self.heading(
            "Per mini-batch run at the same B: the ConvNet with Adam (dense gradients) and "
            f"a {ROWS} x {WIDTH} table with Momentum (sparse gradients). Median ms per "
            "run; ratios paired per round (median, quartiles). `unlocked`: without the "
            "lock that makes concurrent runs atomic.") + table(
            ("model", "N x B", "plain ms", "wrapped ms", "wrapped / plain", "unlocked / plain",
             "N=1 / plain", "the lock: wrapped / unlocked"),
            [(name, f"{row['n']} x {row['b']}", f"{row['ms']['plain']:.2f}",
              f"{row['ms']['wrapped']:.2f}", *(quartiles(row["vs_plain"][k]) for k in (
                  "wrapped", "unlocked", "wrapped N=1")), quartiles(row["lock"]))
             for name, row in result.items()])

