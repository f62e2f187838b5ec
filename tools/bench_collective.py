"""The bench's collective section: one exchange of the gradients per update, on two workers.

Two local workers (one CPU replica each) train the same windows on the library's three paths,
which exchange the summed gradients once per window, and on `per mini-batch`, built here, which
all-reduces each mini-batch's (N + 1 exchanges). Collectives are counted from profiler traces,
their bytes read from the traced graph. `--ops`: the traced windows' time by kind of event.
"""

import collections
import concurrent.futures
import json
import os
import re
import statistics
import sys
import tempfile
import time

from tools import bench_probe
from tools import launch_workers
from tools import models
from tools.bench_contenders import interleaved
from tools.bench_section import Section
from tools.bench_section import Target
from tools.bench_section import status
from tools.bench_section import table
from tools.bench_section import trace_events
from tools.bench_section import worst

SMALL = 64  # elements: a collective of at most this many is a count or a vote
BASELINE = "per mini-batch"
SETTLE = 0.2  # seconds a traced window's events are given before the profiler stops
OPS = 16  # --ops: the kinds of events listed, each path's longest
PATHS = ("accumulate + fit", "fit_accumulated", "command line", BASELINE)


def collective_probe(spec):
    """One worker's {"n": {path: {"ms": [per window], "collectives": [{"name", "runs", "bytes",
    "ms"}][, "ops": {kind of event: ms}]}}}; worker 0's alone traced."""
    import tensorflow as tf

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    results = {}
    for n in spec["n"]:
        paths = [_Path(path, *_build(strategy, path, n, spec, index)) for path in PATHS]
        times = interleaved(paths, 1, spec["windows"], warmups=spec["warmup"])
        results[str(n)] = {}
        for path in paths:
            collectives, ops = _profile(path, traced=index == 0, traces=spec["traces"])
            results[str(n)][path.label] = dict(ms=[1e3 * t for t in times[path.label]],
                                               collectives=collectives,
                                               **({"ops": ops} if spec.get("ops") else {}))
    return results


class _Path:
    """A path as a contender: `window()` trains one window, `function` is its traced step."""

    def __init__(self, label, window, function):
        self.label, self.window, self.function = label, window, function

    def train(self, updates):
        for _ in range(updates):
            self.window()


def _profile(path, traced, traces):
    """([{"name", "runs", "bytes", "ms"}] of a window's collectives, {kind: ms}) from `traces`
    windows: runs the most any trace saw (a loaded profiler can miss one), ms the median. Only
    worker 0 traces (another worker's profiler teardown can crash); the others only train."""
    import tensorflow as tf

    if not traced:
        path.train(traces)
        return [], {}
    seen, kinds = [], []
    for _ in range(traces):
        with tempfile.TemporaryDirectory() as logdir:
            tf.profiler.experimental.start(logdir)
            path.window()
            time.sleep(SETTLE)
            tf.profiler.experimental.stop()
            runs, by_kind = traced_events(logdir)
        seen.append(runs)
        kinds.append(by_kind)
    sizes = collective_bytes(path.function.graph)
    collectives = [{"name": name, "runs": max(runs.get(name, (0, 0))[0] for runs in seen),
                    "bytes": sizes.get(graph_name(name, sizes)),
                    "ms": statistics.median(runs.get(name, (0, 0.0))[1] for runs in seen)}
                   for name in sorted({name for runs in seen for name in runs})]
    ops = {kind: statistics.median(k.get(kind, 0.0) for k in kinds)
           for kind in {kind for k in kinds for kind in k}}
    return collectives, ops


def traced_events(logdir):
    """A trace's ({op name as traced: (times it ran, ms in it)} of its collective ops, {kind:
    ms} of its events): an op's kind is its type (a function's ms hold its ops')."""
    collectives, kinds = {}, collections.Counter()
    for _, event, ms in trace_events(logdir):
        name, _, op = event.partition(":")
        if op.startswith("Collective"):
            runs, total = collectives.get(name, (0, 0.0))
            collectives[name] = (runs + 1, total + ms)
        kind = event if "::" in event else op or event  # tf.data's events: A::B
        kinds[re.sub(r"_\d+$", "", kind)] += ms  # less a traced function's number
    return collectives, dict(kinds)


def _build(strategy, path, n, spec, index):
    """(a function that trains one window of `path`, its traced tf.function); the window's N
    global mini-batches are the same on every worker."""
    import numpy as np
    import tensorflow as tf

    import model
    from experiment import engine_tf2
    from gradient_averaging import keras_fit
    from gradient_averaging.tf2 import WindowAccumulator

    rng = np.random.default_rng(0)
    b = spec["b"]
    xs = rng.random((n, b, 28, 28, 1), np.float32)
    ys = rng.integers(0, 10, (n, b)).astype(np.int64)
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
        accumulator = WindowAccumulator(net, optimizer, engine_tf2.sparse_cross_entropy,
                                        strategy, average_gradients=n)
        step = accumulator._iterator_step(n, dataset.element_spec)  # noqa: SLF001 (fit's own step)
        iterator = iter(dataset)

        def window():
            count, applied, _ = step(iterator)
            assert int(count) == n and bool(applied)

        window()  # traced on the first window
        return window, step.get_concrete_function(iterator)
    if path == "command line":
        accumulator = WindowAccumulator(net, optimizer, engine_tf2.sparse_cross_entropy,
                                        strategy)
        sizes = np.full(n, b, np.int32)
        accumulator.build_window(xs, ys, sizes)
        return (lambda: accumulator.apply_stacked(xs, ys, sizes),
                accumulator.window_step.get_concrete_function())
    share = b // strategy.num_replicas_in_sync  # this worker's part of each mini-batch
    local = (xs[:, index * share:(index + 1) * share], ys[:, index * share:(index + 1) * share])
    exchange = per_mini_batch_exchange(net, optimizer, strategy, b)

    def window():
        with strategy.scope():
            exchange(*local).numpy()

    with strategy.scope():
        return window, exchange.get_concrete_function(*local)


def per_mini_batch_exchange(net, optimizer, strategy, global_batch):
    """A window step that all-reduces each mini-batch's gradients as computed, sums them and
    applies them once (by Adam, which exchanges them once more)."""
    import tensorflow as tf

    from experiment import engine_tf2

    variables = net.trainable_variables
    sums = [tf.Variable(tf.zeros(v.shape, v.dtype), trainable=False)  # the exchanged sums
            for v in variables]

    def add(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(engine_tf2.sparse_cross_entropy(
                y, net(x, training=True))) / global_batch
        gradients = tf.distribute.get_replica_context().all_reduce(
            tf.distribute.ReduceOp.SUM, tape.gradient(loss, variables))
        return [s.assign_add(g) for s, g in zip(sums, gradients)]

    def apply(n):
        """Replica context: Adam, given each replica's share of the mean (it sums them)."""
        shares = [s / tf.cast(n * strategy.num_replicas_in_sync, s.dtype) for s in sums]
        optimizer.apply_gradients(zip(shares, variables))
        return tf.constant(True)

    @tf.function
    def window(xs, ys):
        n = tf.shape(xs)[0]
        for i in tf.range(n):
            strategy.run(add, args=(xs[i], ys[i]))
        applied = strategy.run(apply, args=(n,))
        with tf.control_dependencies(tf.nest.flatten(applied)):
            resets = [s.assign(tf.zeros_like(s)) for s in sums]
        with tf.control_dependencies(resets):
            return tf.identity(n)

    return window


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


def two_workers(spec, timeout=bench_probe.TIMEOUT):
    """collective_probe on two local workers: worker 0's result, or {"error"}."""
    envs = launch_workers.worker_envs(2, {"CUDA_VISIBLE_DEVICES": ""})
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        done = list(pool.map(
            lambda env: bench_probe.spawn(collective_probe, spec, env, timeout), envs))
    errors = [f"worker {i}: {r['error']}" for i, r in enumerate(done) if "error" in r]
    return {"error": "; ".join(errors)} if errors else done[0]


def summarize(probe):
    """{(N, path): ms, exchanges, gradient_bytes, collective_ms, small, ratio (to BASELINE)}."""
    rows = {}
    for n, paths in probe.items():
        if n == "seconds":
            continue
        for path, measured in paths.items():
            big = [c for c in measured["collectives"]
                   if c["bytes"] is None or c["bytes"] > 4 * SMALL]
            ratios = [a / b for a, b in zip(measured["ms"], paths[BASELINE]["ms"])]
            rows[(int(n), path)] = dict(
                ms=statistics.median(measured["ms"]),
                exchanges=sum(c["runs"] for c in big),
                gradient_bytes=sum(c["runs"] * (c["bytes"] or 0) for c in big),
                collective_ms=sum(c.get("ms", 0.0) for c in measured["collectives"]),
                small=[c for c in measured["collectives"] if c not in big],
                ratio=statistics.median(ratios))
    return rows


class Collective(Section):
    name, title = "collective", "One exchange of the gradients per update (two workers)"
    FULL = dict(n=(1, 4, 16), b=32, model="convnet", warmup=2, windows=30, traces=3)
    QUICK = dict(n=(1, 4), b=8, model="convnet", warmup=1, windows=2, traces=3)
    ONCE = "the gradients exchanged once per update, whatever N, on every path (two workers)"
    TIME = "time per update of every path at or under the per-mini-batch exchange's, N > 1"

    def measure(self, run):
        probe = two_workers(dict(self.settings))
        if "error" in probe:  # should a worker crash natively (see _profile), once more
            run.log(f"  collective: {probe['error']}; measuring again")
            probe = two_workers(dict(self.settings))
        run.step()
        if "error" in probe:
            run.log(f"  collective: {probe['error']}")
            return {"error": probe["error"]}
        rows = summarize(probe)
        for (n, path), row in sorted(rows.items()):
            run.log(f"  N={n} {path}: {row['ms']:.1f} ms, {row['exchanges']} gradient "
                    f"exchanges, {row['gradient_bytes']} bytes")
        return {"rows": rows}

    def targets(self, result):
        rows = {key: r for key, r in result.get("rows", {}).items() if key[1] != BASELINE}
        time = worst(self.TIME, {f"({path} at N={n})": r["ratio"]
                                 for (n, path), r in rows.items() if n > 1},
                     1.0, failed="error" in result)
        if "error" in result:
            return [Target(self.ONCE, "probe failed", "missed"), time]
        bytes_ = {r["gradient_bytes"] for r in rows.values()}
        twice = sorted((key for key, r in rows.items() if r["exchanges"] != 1),
                       key=lambda key: (key[1], key[0]))
        if twice:
            once = "; ".join(f"{path}: {rows[(n, path)]['exchanges']} at N={n}"
                             for n, path in twice)
        else:
            once = (f"1 exchange of {'/'.join(map(str, sorted(bytes_)))} bytes on every path "
                    f"at N={', '.join(map(str, sorted({n for n, _ in rows})))}")
        return [Target(self.ONCE, once, status(not twice and len(bytes_) == 1)), time]

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
        for (n, path), r in sorted(result["rows"].items(),
                                   key=lambda item: (item[0][0], PATHS.index(item[0][1]))):
            small = ", ".join(f"{c['name']} x{c['runs']} ({c['bytes']} B)"
                              for c in r["small"]) or "none"
            body.append((n, f"`{path}`", r["exchanges"], r["gradient_bytes"], small,
                         f"{r['ms']:.1f}", f"{r['collective_ms']:.1f}",
                         f"{r['ratio']:.2f}x" if path != BASELINE else ""))
        return lines + table(("N", "path", "gradient exchanges", "gradient bytes",
                              "small collectives (counts, votes)", "ms per update",
                              "ms in collectives", "/ per mini-batch"), body)


def print_ops(section):
    """--ops: per N, the ms in each kind of event, each path's OPS longest."""
    probe = two_workers(dict(section.settings, ops=True))
    if "error" in probe:
        sys.exit(f"error: {probe['error']}")
    for n, paths in probe.items():
        if n == "seconds":
            continue
        ops = {path: paths[path]["ops"] for path in PATHS}
        kinds = dict.fromkeys(kind for path in PATHS
                              for kind in sorted(ops[path], key=ops[path].get, reverse=True)[:OPS])
        print(f"\nN={n}: ms in each kind of event, the median of "
              f"{section.settings['traces']} traced windows")
        print("\n".join(table(("event", *PATHS), [
            (kind[:60], *(f"{ops[path].get(kind, 0):.2f}" for path in PATHS)) for kind in kinds])))


def main():
    """python -m tools.bench_collective [--quick] [--ops]: the section alone, its markdown."""
    from tools.bench_section import Run

    section = Collective(quick="--quick" in sys.argv)
    if "--ops" in sys.argv:
        print_ops(section)
        return
    result = section.measure(Run())
    print("\n".join(section.markdown(result)))
    for target in section.targets(result):
        print(target)


if __name__ == "__main__":
    main()
