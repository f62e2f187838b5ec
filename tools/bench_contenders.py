"""What the bench races, how they take turns against the clock, and where their time goes.

A contender has a `label` and `train(updates)` (and `close()` where it holds a session);
race() is the one runner every speed section uses. Keras loads only inside the contenders
that use it: a probe without them measures TensorFlow.
"""

import collections
import gc
import re
import statistics
import sys
import tempfile
import time

import tensorflow as tf

from experiment import config
from experiment import data
from tools import models
from tools.bench_section import trace_events

ENDLESS = 10 ** 9  # mini-batches a contender may draw: more than any benchmark trains
# An op's class: the first pattern its type matches.
OP_CLASSES = (("conv", r"Conv2D"), ("pool", r"MaxPool"), ("matmul", r"MatMul"),
              ("dropout RNG", r"Random"), ("finite check", r"^(IsFinite|All)$"),
              ("variable updates", r"ApplyAdam|AssignAddVariable|AssignVariable"))
CONTAINER_OPS = ("While", "If", "PartitionedCall", "Case")  # time of ops they hold


class SessionContender:
    """An engine's `step` on `train` (a data.Split), as main.py's loop: the tf1 engine with
    `averager`, or with "tf2" the tf2 engine (Keras loads only then)."""

    def __init__(self, label, n, b, train, averager="stack", model="convnet", parallel=1):
        tf2 = averager == "tf2"
        cfg = config.Config(average_gradients=n, batch_size=b, model=model, engine="tf2"
                            if tf2 else "tf1", accumulate="stack" if tf2 else averager,
                            parallel_mini_batches=parallel)
        self.label, self.n, self.iteration = label, n, 0
        self.engine = config.ENGINES[cfg.engine].load().Engine(cfg, models.SEED)
        self.batches = data.batches(train, models.SEED, b, 0, ENDLESS)

    def train(self, updates):
        for _ in range(updates * self.n):
            self.iteration += 1
            self.engine.step(*next(self.batches), self.iteration)

    def close(self):
        self.engine.close()


class Fit:
    """Keras fit: `n` batches of `dataset` per update, `per_call` of them a call (None:
    train_on_batch each)."""

    def __init__(self, label, net, dataset, n, per_call, optimizer, jit_compile=False):
        self.label, self.net, self.dataset, self.n, self.per_call = label, net, dataset, n, per_call
        net.compile(optimizer=optimizer, loss=models.loss(), jit_compile=jit_compile,
                    steps_per_execution=per_call or 1)
        self.batches = None if per_call else iter(dataset)

    def train(self, updates):
        if self.per_call:
            self.net.fit(self.dataset, steps_per_epoch=updates * self.n, epochs=1, verbose=0,
                         shuffle=False)
            return
        for _ in range(updates * self.n):
            self.net.train_on_batch(*next(self.batches))


class TrainOp:
    """TF1 train ops in their own session, run in turn, one per mini-batch, on fixed feeds in
    turn; `build(*args)` makes ([train op], [feed dict]) in the graph."""

    def __init__(self, label, build, *args):
        self.label, self.graph, self.k = label, tf.Graph(), 0
        with self.graph.as_default():
            self.train_ops, self.feeds = build(*args)
            init = tf.compat.v1.global_variables_initializer()
        self.graph.finalize()
        self.sess = tf.compat.v1.Session(graph=self.graph)
        self.sess.run(init)

    def train(self, runs):
        for _ in range(runs):
            self.sess.run(self.train_ops[self.k % len(self.train_ops)],
                          self.feeds[self.k % len(self.feeds)])
            self.k += 1

    def close(self):
        self.sess.close()


def keras_contender(label, n, b, datasets, per_call=1, accumulate=False, parallel=1):
    """A Fit of the post's ConvNet on MNIST: Adam(gradient_accumulation_steps=N), or with
    `accumulate` accumulate(model, N) with plain Adam."""
    import keras

    from gradient_averaging import keras_fit
    keras.utils.set_random_seed(models.SEED)
    net = models.post_model("convnet")()
    if accumulate:
        net = keras_fit.accumulate(net, average_gradients=n, parallel_mini_batches=parallel)
    steps = n if n > 1 and not accumulate else None
    return Fit(label, net, batched(endless(tuple(datasets.train)), b), n, per_call,
               models.adam(gradient_accumulation_steps=steps))


def endless(samples):
    """`samples` (a tuple of arrays) as an endless dataset."""
    return tf.data.Dataset.from_tensor_slices(samples).repeat()


def batched(base, b):
    """`base` in batches of B, prefetched: what every Keras contender trains on."""
    return base.batch(b, drop_remainder=True).prefetch(2)


class Window:
    """WindowAccumulator.fit, on one dataset per block length, made once (a new dataset's
    first iterator costs a few updates, which a run pays once)."""

    def __init__(self, label, net, dataset, n, jit_compile=False):
        from gradient_averaging.tf2 import WindowAccumulator
        self.label, self.dataset, self.n, self.blocks = label, dataset, n, {}
        self.accumulator = WindowAccumulator(net, models.adam(), models.loss(None),
                                             average_gradients=n, jit_compile=jit_compile)

    def train(self, updates):
        if updates not in self.blocks:
            self.blocks[updates] = self.dataset.take(updates * self.n)
        self.accumulator.fit(self.blocks[updates])


class MiniBatch:
    """A MiniBatchAccumulator: accumulate per mini-batch, apply per N."""

    def __init__(self, label, net, dataset, n, jit_compile=False):
        from gradient_averaging.tf2 import MiniBatchAccumulator
        self.label, self.n, self.batches = label, n, iter(dataset)
        self.accumulator = MiniBatchAccumulator(net, models.adam(), models.loss(None),
                                                jit_compile=jit_compile)

    def train(self, updates):
        for _ in range(updates):
            for _ in range(self.n):
                self.accumulator.accumulate(*next(self.batches))
            self.accumulator.apply()


class Apply:
    """Adam on constant gradients, N - 1 applies per update in one call, as inside a step."""

    def __init__(self, label, net, n, jit_compile=False):
        self.label, self.n = label, n
        optimizer, variables = models.adam(), net.trainable_variables
        optimizer.build(variables)
        gradients = [tf.fill(v.shape, tf.constant(1e-3, v.dtype)) for v in variables]

        @tf.function(jit_compile=jit_compile)
        def applies(count):
            for _ in tf.range(count):
                optimizer.apply_gradients(zip(gradients, variables))

        self.applies = applies
        applies(tf.constant(1))  # traced

    def train(self, updates):
        self.applies(tf.constant(updates * (self.n - 1)))


def contender(label, n, b, datasets, updates):
    """The contender of that label at N x B (bench_speed.CONTENDERS; "_p2": two passes at
    once), trained in blocks of `updates` (keras_long's one call)."""
    parallel, base = (2, label[:-3]) if label.endswith("_p2") else (1, label)
    if base == "keras_fit":
        return keras_contender(label, n, b, datasets, accumulate=True, parallel=parallel)
    if base in ("keras", "keras_long"):
        return keras_contender(label, n, b, datasets, n * updates if base == "keras_long" else n)
    if base.endswith("direct"):  # one batch of N*B
        n, b = 1, n * b
    averager = "tf2" if base.startswith("tf2") else "stack" if base == "direct" else base
    return SessionContender(label, n, b, datasets.train, averager, parallel=parallel)


def race(contenders, updates, repeats, profiled=(), classes=OP_CLASSES):
    """The one runner: `contenders` interleaved, then the labels `profiled` names (or a
    function of the CPU times returns) profiled, then all released (sessions closed, models
    freed, the list emptied): (wall, cpu, profiles): {label: [seconds per update, one per
    round]} of each clock, {label: profile}."""
    try:
        cpu = {}
        wall = interleaved(contenders, updates, repeats, cpu=cpu)
        traced = profiled(cpu) if callable(profiled) else profiled
        profiles = {c.label: profile(c, updates, classes) for c in contenders
                    if c.label in traced}
    finally:
        for c in contenders:
            if hasattr(c, "close"):
                c.close()
        contenders.clear()
        if "keras" in sys.modules:
            sys.modules["keras"].utils.clear_session()
        gc.collect()
    return wall, cpu, profiles


def clocked(times, **ratios):
    """`times` -> {"times", "median_ms": {label: ms}} and, per `ratios` {name: (labels,
    base)}, {name: {label: paired ratio to base}}."""
    return dict(times=times, median_ms={k: 1e3 * statistics.median(t) for k, t in times.items()},
                **{name: {k: paired_ratio(times, k, base) for k in labels}
                   for name, (labels, base) in ratios.items()})


def race_labels(spec, datasets=None, profiled=False):
    """The contenders of spec's "labels" at its N x B, raced (its "updates", "repeats") on
    `datasets` (None: its own MNIST, as a probe, bench_probe.py): {"n", "b", "times",
    "median_ms", "vs_direct" (paired ratios), "profiles" ({label: profile} with `profiled`)}."""
    n, b, labels, updates = spec["n"], spec["b"], spec["labels"], spec["updates"]
    datasets = data.load_mnist() if datasets is None else datasets
    wall, _, profiles = race([contender(label, n, b, datasets, updates) for label in labels],
                             updates, spec["repeats"], labels if profiled else ())
    return dict(n=n, b=b, profiles=profiles, **clocked(wall, vs_direct=(wall, "direct")))


def interleaved(contenders, updates, repeats, cpu=None, warmups=1):
    """{label: [seconds per update, one per round]}, turns rotating per round (a shared
    machine's drift hits all alike), after `warmups` untimed blocks; `cpu`, a dict, gets
    the same of this process's CPU seconds (which leave out other processes' load)."""
    for c in contenders:
        for _ in range(warmups):  # graph optimisation, allocator, oneDNN primitives
            c.train(updates)
    times = collections.defaultdict(list)
    for r in range(repeats):
        shift = r % len(contenders)
        for c in contenders[shift:] + contenders[:shift]:
            start, start_cpu = time.perf_counter(), time.process_time()
            c.train(updates)
            times[c.label].append((time.perf_counter() - start) / updates)
            if cpu is not None:
                cpu.setdefault(c.label, []).append((time.process_time() - start_cpu) / updates)
    return dict(times)


def paired_ratio(times, label, base):
    """Median and quartiles of the per-round ratio label / base."""
    ratios = sorted(a / b for a, b in zip(times[label], times[base]))
    q = statistics.quantiles(ratios, n=4, method="inclusive") if len(ratios) > 1 \
        else [ratios[0]] * 3
    return {"ratio": statistics.median(ratios), "q1": q[0], "q3": q[2]}


def profile(contender, updates, classes):
    """Per update of a traced block: {"wall_ms", "cpu_ms", "kernel_ms": {op class (the first
    of `classes` whose pattern its type matches, else "other"): kernel ms summed over threads,
    ops that hold others left out}}."""
    kernel_ms = collections.Counter()
    with tempfile.TemporaryDirectory(prefix="bench-profile-") as logdir:
        tf.profiler.experimental.start(logdir)
        start, start_cpu = time.perf_counter(), time.process_time()
        contender.train(updates)
        wall, cpu = time.perf_counter() - start, time.process_time() - start_cpu
        tf.profiler.experimental.stop()
        for line, name, ms in trace_events(logdir):
            op_type = name.rsplit(":", 1)[-1]  # an op's; "::": executor bookkeeping, not an op
            if (not line.startswith("tf_Compute") or ":" not in name or "::" in name
                    or op_type.endswith(CONTAINER_OPS) or op_type.startswith("__")):
                continue
            kernel_ms[next((kind for kind, pattern in classes if re.search(pattern, op_type)),
                           "other")] += ms / updates
    return {"wall_ms": 1e3 * wall / updates, "cpu_ms": 1e3 * cpu / updates,
            "kernel_ms": dict(kernel_ms)}
