"""The bench's collective section: one exchange of the gradients per update, on two workers.

Two local workers (one CPU replica each) train the same windows on the library's three paths,
which exchange the summed gradients once per window, and on `per mini-batch`, built here, which
all-reduces each mini-batch's (N + 1 exchanges). Collectives are counted from profiler traces,
their bytes read from the traced graph. The section alone:
`python -m tools.bench --sections=collective --output=F.md`.
"""

import collections
import concurrent.futures
import json
import os
import statistics
import tempfile
import time

import numpy as np
import tensorflow as tf

from tools import bench_probe
from tools import bench_section
from tools import launch_workers
from tools import models
from tools.bench_contenders import interleaved

SMALL = 64  # elements: a collective of at most this many is a count or a vote
BASELINE = "per mini-batch"
SETTLE = 0.2  # seconds a traced window's events are given before the profiler stops
PATHS = ("accumulate + fit", "fit_accumulated", "command line", BASELINE)


def collective_probe(spec):
    """One worker's {"n": {path: {"ms": [per window], "collectives": [{"name", "runs", "bytes",
    "ms"}]}}}; worker 0's alone traced."""
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    results = {}
    for n in spec["n"]:
        paths = [_Path(path, *_build(strategy, path, n, spec, index)) for path in PATHS]
        times = interleaved(paths, 1, spec["windows"], warmups=spec["warmup"])
        results[str(n)] = {path.label: {
            "ms": [1e3 * t for t in times[path.label]],
            "collectives": _profile(path, traced=index == 0, traces=spec["traces"])}
            for path in paths}
    return results


class _Path(collections.namedtuple("_Path", "label window function")):
    """A path as a contender: `window()` trains one window, `function` is its traced step."""

    def train(self, updates):
        for _ in range(updates):
            self.window()


def _profile(path, traced, traces):
    """[{"name", "runs", "bytes", "ms"}] of a window's collectives from `traces` traced windows:
    runs the most any trace saw (a loaded profiler can miss one), ms the median. Only worker 0
    traces (another worker's profiler teardown can crash); the others only train."""
    if not traced:
        path.train(traces)
        return []
    seen = []  # per trace: {op name as traced: [ms of each run]}
    for _ in range(traces):
        seen.append(collections.defaultdict(list))
        with tempfile.TemporaryDirectory() as logdir:
            tf.profiler.experimental.start(logdir)
            path.window()
            time.sleep(SETTLE)
            tf.profiler.experimental.stop()
            for _, event, ms in bench_section.trace_events(logdir):
                name, _, op = event.partition(":")
                if op.startswith("Collective"):
                    seen[-1][name].append(ms)
    sizes = collective_bytes(path.function.graph)
    return [{"name": name, "runs": max(len(runs.get(name, ())) for runs in seen),
             "bytes": sizes.get(graph_name(name, sizes)),
             "ms": statistics.median(sum(runs.get(name, ()), 0.0) for runs in seen)}
            for name in sorted({name for runs in seen for name in runs})]


def _build(strategy, path, n, spec, index):
    """(a function that trains one window of `path`, its traced tf.function); the window's N
    global mini-batches are the same on every worker."""
    import model
    from experiment import engine_tf2
    from gradient_averaging import keras_fit
    from gradient_averaging.tf2 import WindowAccumulator

    rng, b, loss = np.random.default_rng(0), spec["b"], engine_tf2.sparse_cross_entropy
    xs = rng.random((n, b, 28, 28, 1), np.float32)
    ys = rng.integers(0, 10, (n, b))
    dataset = tf.data.Dataset.from_tensor_slices(  # the window's N mini-batches, repeated
        (xs.reshape((n * b,) + xs.shape[2:]), ys.reshape(n * b))).batch(b).repeat()
    with strategy.scope():
        net = model.keras_model(spec["model"], 0.0, 0)
        optimizer = models.adam()
    if path == "accumulate + fit":  # fit once makes its train function
        with strategy.scope():
            accumulating = keras_fit.accumulate(net, n)
            accumulating.compile(optimizer=optimizer, jit_compile=False, loss=models.loss())
        accumulating.fit(dataset, epochs=1, steps_per_epoch=n, verbose=0)
        iterator = iter(strategy.experimental_distribute_dataset(dataset))  # as fit's own
        train_function = accumulating.train_function  # reads the window's count: it has run
        traced = accumulating._window_function  # noqa: SLF001 (the bench reads its graph)
        return lambda: train_function(iterator), traced.get_concrete_function(iterator)
    if path == "fit_accumulated":  # the step its `fit` calls once per window
        accumulator = WindowAccumulator(net, optimizer, loss, strategy, average_gradients=n)
        step = accumulator._iterator_step(n, dataset.element_spec)  # noqa: SLF001 (fit's own step)
        iterator = iter(dataset)

        def window():
            count, applied, _ = step(iterator)
            assert int(count) == n and bool(applied)

        window()  # traced on the first window
        return window, step.get_concrete_function(iterator)
    if path == "command line":
        accumulator = WindowAccumulator(net, optimizer, loss, strategy)
        sizes = np.full(n, b, np.int32)
        accumulator.build_window(xs, ys, sizes)
        return (lambda: accumulator.apply_stacked(xs, ys, sizes),
                accumulator.window_step.get_concrete_function())
    share = b // strategy.num_replicas_in_sync  # this worker's part of each mini-batch
    local = (xs[:, index * share:(index + 1) * share], ys[:, index * share:(index + 1) * share])
    return per_mini_batch_exchange(net, optimizer, loss, strategy, b, local)


def per_mini_batch_exchange(net, optimizer, loss, strategy, global_batch, local):
    """(a function that trains one window on this worker's `local` (xs, ys), its traced step):
    each mini-batch's gradients all-reduced as computed, summed and applied once (by Adam,
    which exchanges them once more)."""
    variables = net.trainable_variables
    sums = [tf.Variable(tf.zeros(v.shape, v.dtype), trainable=False) for v in variables]

    def add(x, y):
        with tf.GradientTape() as tape:
            mean = tf.reduce_sum(loss(y, net(x, training=True))) / global_batch
        gradients = tf.distribute.get_replica_context().all_reduce(
            tf.distribute.ReduceOp.SUM, tape.gradient(mean, variables))
        return [s.assign_add(g) for s, g in zip(sums, gradients)]

    def apply(n):  # in replica context: Adam, given each replica's share of the mean to sum
        shares = [s / tf.cast(n * strategy.num_replicas_in_sync, s.dtype) for s in sums]
        optimizer.apply_gradients(zip(shares, variables))
        return tf.constant(True)

    @tf.function
    def step(xs, ys):
        n = tf.shape(xs)[0]
        for i in tf.range(n):
            strategy.run(add, args=(xs[i], ys[i]))
        with tf.control_dependencies(tf.nest.flatten(strategy.run(apply, args=(n,)))):
            with tf.control_dependencies([s.assign(tf.zeros_like(s)) for s in sums]):
                return tf.identity(n)  # once the sums are applied and reset

    def window():
        with strategy.scope():
            step(*local).numpy()

    with strategy.scope():
        return window, step.get_concrete_function(*local)


def collective_bytes(graph):
    """{op name: input bytes} of the collective ops in a graph and the functions it calls; None
    where sizes differ (counted with the gradients: a wrong size cannot pass for a count)."""
    sizes, graphs, seen = {}, [graph], {id(graph)}
    while graphs:
        graph = graphs.pop()
        for op in graph.get_operations():
            if op.type.startswith("Collective") and op.inputs:
                tensor = op.inputs[0]
                elements = tensor.shape.num_elements()
                size = None if elements is None else elements * tensor.dtype.size
                sizes[op.name] = size if sizes.get(op.name, size) == size else None
        for function in getattr(graph, "_functions", {}).values():
            inner = getattr(function, "graph", None)
            if inner is not None and id(inner) not in seen:
                seen.add(id(inner))
                graphs.append(inner)
    return sizes


def graph_name(traced, sizes):
    """The graph op a traced name is (the trace prefixes the calling ops' names)."""
    matches = [name for name in sizes if traced == name or traced.endswith("/" + name)]
    return max(matches, key=len) if matches else None


def two_workers(spec):
    """collective_probe on two local workers: worker 0's result, or {"error"}."""
    envs = launch_workers.worker_envs(2, {"CUDA_VISIBLE_DEVICES": ""})
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        done = list(pool.map(lambda env: bench_probe.spawn(collective_probe, spec, env), envs))
    errors = [f"worker {i}: {r['error']}" for i, r in enumerate(done) if "error" in r]
    return {"error": "; ".join(errors)} if errors else done[0]


def summarize(probe):
    """{(N, path): ms, exchanges, gradient_bytes, collective_ms, small, ratio (to BASELINE)};
    a collective of more than 4 * SMALL bytes, or of sizes that differ, is an exchange."""
    rows = {}
    for n, paths in probe.items():
        if n == "seconds":
            continue
        for path, measured in paths.items():
            big = [c for c in measured["collectives"]
                   if c["bytes"] is None or c["bytes"] > 4 * SMALL]
            rows[(int(n), path)] = dict(
                ms=statistics.median(measured["ms"]),
                exchanges=sum(c["runs"] for c in big),
                gradient_bytes=sum(c["runs"] * (c["bytes"] or 0) for c in big),
                collective_ms=sum(c["ms"] for c in measured["collectives"]),
                small=[c for c in measured["collectives"] if c not in big],
                ratio=statistics.median(
                    a / b for a, b in zip(measured["ms"], paths[BASELINE]["ms"])))
    return rows


class Collective(bench_section.Section):
    name, title = "collective", "One exchange of the gradients per update (two workers)"
    FULL = dict(n=(1, 4, 16), b=32, model="convnet", warmup=2, windows=30, traces=3)
    QUICK = dict(n=(1, 4), b=8, model="convnet", warmup=1, windows=2, traces=3)
    ONCE = "the gradients exchanged once per update, whatever N, on every path (two workers)"
    TIME = "time per update of every path at or under the per-mini-batch exchange's, N > 1"

    def measure(self, run):
        for again in (True, False):  # should a worker crash natively (see _profile), once more
            probe = two_workers(dict(self.settings))
            if "error" not in probe:
                break
            run.log(f"  collective: {probe['error']}" + ("; measuring again" if again else ""))
        run.step()
        if "error" in probe:
            return {"error": probe["error"]}
        rows = summarize(probe)
        for (n, path), row in sorted(rows.items()):
            run.log(f"  N={n} {path}: {row['ms']:.1f} ms, {row['exchanges']} gradient "
                    f"exchanges, {row['gradient_bytes']} bytes")
        return {"rows": rows}

    def targets(self, result):
        if "error" in result:
            return [bench_section.Target(target, "probe failed", "missed")
                    for target in (self.ONCE, self.TIME)]
        rows = {key: r for key, r in result["rows"].items() if key[1] != BASELINE}
        time = bench_section.worst(self.TIME, {f"({path} at N={n})": r["ratio"]
                                               for (n, path), r in rows.items() if n > 1}, 1.0)
        twice = sorted((path, n) for (n, path), r in rows.items() if r["exchanges"] != 1)
        bytes_ = sorted({r["gradient_bytes"] for r in rows.values()})
        once = "; ".join(f"{path}: {rows[(n, path)]['exchanges']} at N={n}" for path, n in twice)
        once = once or (f"1 exchange of {'/'.join(map(str, bytes_))} bytes on every path at "
                        f"N={', '.join(map(str, sorted({n for n, _ in rows})))}")
        met = bench_section.status(not twice and len(bytes_) == 1)
        return [bench_section.Target(self.ONCE, once, met), time]

    def markdown(self, result):
        s = self.settings
        lines = self.heading(
            "Two worker processes on 127.0.0.1 (MultiWorkerMirroredStrategy, one CPU replica "
            f"each), the {s['model']}, global mini-batches of B={s['b']}, the same window on "
            "every path, each driven by its own step function, once per update; `per "
            "mini-batch` all-reduces each mini-batch's gradients (N + 1 exchanges). A "
            f"collective's runs: the most of {s['traces']} traced windows, its ms their "
            f"median; one of more than {4 * SMALL} bytes (its input in the graph) is an "
            f"exchange of the gradients. ms per update: the median of {s['windows']} "
            "interleaved windows, `/ per mini-batch` that of the per-round ratios. The method "
            "and the small collectives: [docs/multi-worker.md](docs/multi-worker.md#one-"
            "exchange-of-the-gradients-per-update-measured).")
        if "error" in result:
            return lines + [f"The probe failed: {result['error']}"]
        body = []
        for n, path in sorted(result["rows"], key=lambda key: (key[0], PATHS.index(key[1]))):
            r = result["rows"][(n, path)]
            small = ", ".join(f"{c['name']} x{c['runs']} ({c['bytes']} B)" for c in r["small"])
            body.append((n, f"`{path}`", r["exchanges"], r["gradient_bytes"], small or "none",
                         f"{r['ms']:.1f}", f"{r['collective_ms']:.1f}",
                         f"{r['ratio']:.2f}x" if path != BASELINE else ""))
        return lines + bench_section.table((
            "N", "path", "gradient exchanges", "gradient bytes",
            "small collectives (counts, votes)", "ms per update", "ms in collectives",
            "/ per mini-batch"), body)
