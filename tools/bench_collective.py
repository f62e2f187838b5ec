"""The bench's collective section: one exchange of the gradients per update, on two workers.

Two local workers (one CPU replica each) train the same windows on the library's three paths,
which exchange the summed gradients once per window, and on `per mini-batch`, built here, which
all-reduces each mini-batch's (N + 1 exchanges). Collectives are counted from profiler traces,
their bytes read from the traced graph. `--ops`: the traced windows' time by kind of event.
"""

import concurrent.futures
import json
import os
import re
import statistics
import sys
import tempfile

from tools import bench_probe
from tools import models
from tools.bench_contenders import interleaved
from tools.bench_section import Section
from tools.bench_section import Target
from tools.bench_section import status
from tools.bench_section import table
from tools.bench_section import trace_events

SMALL = 64  # elements: a collective of at most this many is a count or a vote
BASELINE = "per mini-batch"
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
        built = {path: _build(strategy, path, n, spec, index) for path in PATHS}
        times = interleaved([_Windows(path, window) for path, (window, _) in built.items()],
                            1, spec["windows"], warmups=spec["warmup"])
        results[str(n)] = {}
        for path in PATHS:
            collectives, ops = _profile(*built[path], traced=index == 0,
                                        traces=spec["traces"])
            results[str(n)][path] = dict(ms=[1e3 * t for t in times[path]],
                                         collectives=collectives,
                                         **({"ops": ops} if spec.get("ops") else {}))
    return results


class _Windows:
    """A path's windows as a contender."""

    def __init__(self, label, window):
        self.label, self.window = label, window

    def train(self, updates):
        for _ in range(updates):
            self.window()


def _profile(window, function, traced, traces):
    """([{"name", "runs", "bytes", "ms"}] of a window's collectives, {kind: ms}) from `traces`
    windows: runs the most any trace saw (a loaded profiler can miss one), ms the median. Only
    worker 0 traces (another worker's profiler teardown can crash); the others only train."""
    import tensorflow as tf

    if not traced:
        for _ in range(traces):
            window()
        return [], {}
    seen, kinds = [], []
    for _ in range(traces):
        with tempfile.TemporaryDirectory() as logdir:
            tf.profiler.experimental.start(logdir)
            window()
            tf.profiler.experimental.stop()
            seen.append(executed_collectives(logdir))
            kinds.append(events_by_kind(logdir))
    sizes = collective_bytes(function.graph)
    names = sorted({name for runs in seen for name in runs})
    collectives = [{"name": name, "runs": max(runs.get(name, (0, 0))[0] for runs in seen),
                    "bytes": sizes.get(graph_name(name, sizes)),
                    "ms": statistics.median(runs.get(name, (0, 0.0))[1] for runs in seen)}
                   for name in names]
    ops = {kind: statistics.median(k.get(kind, 0.0) for k in kinds)
           for kind in {kind for k in kinds for kind in k}}
    return collectives, ops


def _build(strategy, path, n, spec, index):
    """(a function that trains one window of `path`, its traced tf.function)."""
    import numpy as np

    import model
    from experiment import engine_tf2
    from gradient_averaging.tf2 import WindowAccumulator

    rng = np.random.default_rng(0)  # the same global window on every worker
    b = spec["b"]
    xs = rng.random((n, b, 28, 28, 1), np.float32)
    ys = rng.integers(0, 10, (n, b)).astype(np.int64)
    with strategy.scope():
        net = model.keras_model(spec["model"], 0.0, 0)
        optimizer = models.adam()
    if path in ("accumulate + fit", "fit_accumulated"):
        import tensorflow as tf  # the window's N global mini-batches, repeated
        dataset = tf.data.Dataset.from_tensor_slices(
            (xs.reshape((n * b,) + xs.shape[2:]), ys.reshape(n * b))).batch(b).repeat()
        return (_keras_fit if path == "accumulate + fit" else _fit_accumulated)(
            strategy, net, optimizer, dataset, n)
    if path == "command line":
        accumulator = WindowAccumulator(net, optimizer, engine_tf2.sparse_cross_entropy,
                                        strategy)
        sizes = np.full(n, b, np.int32)
        accumulator.build_window(xs, ys, sizes)

        def window():
            accumulator.apply_stacked(xs, ys, sizes)

        function = accumulator.window_step.get_concrete_function()
    else:
        share = b // strategy.num_replicas_in_sync  # this worker's part of each mini-batch
        local = (xs[:, index * share:(index + 1) * share], ys[:, index * share:(index + 1) * share])
        exchange = PerMiniBatchExchange(net, optimizer, strategy, b)

        def window():
            with strategy.scope():
                exchange.window(*local).numpy()

        with strategy.scope():
            function = exchange.window.get_concrete_function(*local)
    return window, function


def _keras_fit(strategy, net, optimizer, dataset, n):
    """accumulate(net, n) fit once (making its train function), then a window by that train
    function on `dataset` distributed as fit's own."""

    from gradient_averaging import keras_fit

    with strategy.scope():
        accumulating = keras_fit.accumulate(net, n)
        accumulating.compile(optimizer=optimizer, jit_compile=False, loss=models.loss())
    accumulating.fit(dataset, epochs=1, steps_per_epoch=n, verbose=0)
    iterator = iter(strategy.experimental_distribute_dataset(dataset))
    train_function = accumulating.train_function

    def window():
        train_function(iterator)  # reads the window's count: the update has run

    traced = accumulating._window_function  # noqa: SLF001 (the bench reads the traced graph)
    return window, traced.get_concrete_function(iterator)


def _fit_accumulated(strategy, net, optimizer, dataset, n):
    """A window by the step fit_accumulated's `fit` calls once per window (its loop aside)."""
    from experiment import engine_tf2
    from gradient_averaging.tf2 import WindowAccumulator

    accumulator = WindowAccumulator(net, optimizer, engine_tf2.sparse_cross_entropy, strategy,
                                    average_gradients=n)
    step = accumulator._iterator_step(n, dataset.element_spec)  # noqa: SLF001 (fit's own step, one update a call)
    iterator = iter(dataset)

    def window():
        count, applied, _ = step(iterator)
        assert int(count) == n and bool(applied)

    window()  # traced on the first window
    return window, step.get_concrete_function(iterator)


class PerMiniBatchExchange:
    """Each mini-batch's gradients all-reduced as computed, summed, applied once per window
    (by Adam, which exchanges them once more)."""

    def __init__(self, net, optimizer, strategy, global_batch):
        import tensorflow as tf

        self.net, self.optimizer, self.strategy = net, optimizer, strategy
        self.global_batch = global_batch
        # Per worker, the exchanged (global) sums.
        self.sums = [tf.Variable(tf.zeros(v.shape, v.dtype), trainable=False)
                     for v in net.trainable_variables]
        self.window = tf.function(self._window)

    def _add(self, x, y):
        import tensorflow as tf

        from experiment import engine_tf2

        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(engine_tf2.sparse_cross_entropy(
                y, self.net(x, training=True))) / self.global_batch
        gradients = tape.gradient(loss, self.net.trainable_variables)
        gradients = tf.distribute.get_replica_context().all_reduce(
            tf.distribute.ReduceOp.SUM, gradients)
        return [s.assign_add(g) for s, g in zip(self.sums, gradients)]

    def _apply(self, n):
        """Replica context: Adam, given each replica's share of the mean (it sums them)."""
        import tensorflow as tf

        shares = [s / tf.cast(n * self.strategy.num_replicas_in_sync, s.dtype)
                  for s in self.sums]
        self.optimizer.apply_gradients(zip(shares, self.net.trainable_variables))
        return tf.constant(True)

    def _window(self, xs, ys):
        import tensorflow as tf

        n = tf.shape(xs)[0]
        for i in tf.range(n):
            self.strategy.run(self._add, args=(xs[i], ys[i]))
        applied = self.strategy.run(self._apply, args=(n,))
        with tf.control_dependencies(tf.nest.flatten(applied)):
            resets = [s.assign(tf.zeros_like(s)) for s in self.sums]
        with tf.control_dependencies(resets):
            return tf.identity(n)


def executed_collectives(logdir):
    """{op name as traced: (times it ran, ms in it)} of a trace's collective ops."""
    counts = {}
    for _, event, duration in trace_events(logdir):
        name, _, op = event.partition(":")
        if op.startswith("Collective"):
            runs, ms = counts.get(name, (0, 0.0))
            counts[name] = (runs + 1, ms + duration)
    return counts


def events_by_kind(logdir):
    """{kind: ms} of a trace's events, an op's kind its type (a function's ms hold its ops')."""
    kinds = {}
    for _, event, duration in trace_events(logdir):
        kind = event if "::" in event else event.partition(":")[2] or event  # tf.data's: A::B
        kind = re.sub(r"_\d+$", "", kind)  # a traced function's number
        kinds[kind] = kinds.get(kind, 0.0) + duration
    return kinds


def collective_bytes(graph, seen=None):
    """{op name: input bytes} of the collective ops in a graph and the functions it calls; None
    where sizes differ (counted with the gradients: a wrong size cannot pass for a count)."""
    seen = set() if seen is None else seen
    found = []
    for op in graph.get_operations():
        if op.type.startswith("Collective") and op.inputs:
            tensor = op.inputs[0]
            elements = tensor.shape.num_elements()
            found.append((op.name, None if elements is None else elements * tensor.dtype.size))
    for function in getattr(graph, "_functions", {}).values():
        inner = getattr(function, "graph", None)
        if inner is not None and id(inner) not in seen:
            seen.add(id(inner))
            found += collective_bytes(inner, seen).items()
    sizes = {}
    for name, size in found:
        sizes[name] = size if sizes.get(name, size) == size else None
    return sizes


def graph_name(traced, sizes):
    """The graph op a traced name is (the trace prefixes the calling ops' names)."""
    matches = [name for name in sizes if traced == name or traced.endswith("/" + name)]
    return max(matches, key=len) if matches else None


def two_workers(spec, timeout=bench_probe.TIMEOUT):
    """collective_probe on two local workers: worker 0's result, or {"error"}."""
    from tools import launch_workers

    ports = launch_workers.free_ports(2)
    cluster = {"worker": [f"127.0.0.1:{p}" for p in ports]}
    envs = [dict(os.environ, CUDA_VISIBLE_DEVICES="", TF_CONFIG=json.dumps(
        {"cluster": cluster, "task": {"type": "worker", "index": i}})) for i in range(2)]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        done = list(pool.map(lambda env: bench_probe.spawn(collective_probe, spec, env,
                                                           timeout), envs))
    errors = [f"worker {i}: {r['error']}" for i, r in enumerate(done) if "error" in r]
    return {"error": "; ".join(errors)} if errors else done[0]


def summarize(probe):
    """{(N, path): ms, exchanges, gradient_bytes, collective_ms, small, ratio (to BASELINE)}."""
    rows = {}
    for n, paths in probe.items():
        for path, measured in paths.items():
            big = [c for c in measured["collectives"]
                   if c["bytes"] is None or c["bytes"] > 4 * SMALL]
            small = [c for c in measured["collectives"] if c not in big]
            ratios = [a / b for a, b in zip(measured["ms"], paths[BASELINE]["ms"])]
            rows[(int(n), path)] = dict(
                ms=statistics.median(measured["ms"]),
                exchanges=sum(c["runs"] for c in big),
                gradient_bytes=sum(c["runs"] * (c["bytes"] or 0) for c in big),
                collective_ms=sum(c.get("ms", 0.0) for c in measured["collectives"]),
                small=small, ratio=statistics.median(ratios))
    return rows


class Collective(Section):
    name, title = "collective", "One exchange of the gradients per update (two workers)"
    FULL = dict(n=(1, 4, 16), b=32, model="convnet", warmup=2, windows=30, traces=3)
    QUICK = dict(n=(1, 4), b=8, model="convnet", warmup=1, windows=2, traces=2)

    def measure(self, run):
        probe = two_workers(dict(self.settings))
        if "error" in probe:  # should a worker crash natively (see _profile), once more
            run.log(f"  collective: {probe['error']}; measuring again")
            probe = two_workers(dict(self.settings))
        run.step()
        if "error" in probe:
            run.log(f"  collective: {probe['error']}")
            return {"error": probe["error"]}
        rows = summarize({n: p for n, p in probe.items() if n not in ("seconds",)})
        for (n, path), row in sorted(rows.items()):
            run.log(f"  N={n} {path}: {row['ms']:.1f} ms, {row['exchanges']} gradient "
                    f"exchanges, {row['gradient_bytes']} bytes")
        return {"rows": {f"{n} {path}": row for (n, path), row in rows.items()}}

    def _rows(self, result):
        return {(int(key.split(" ", 1)[0]), key.split(" ", 1)[1]): row
                for key, row in result.get("rows", {}).items()}

    def targets(self, result):
        once_target = "the gradients exchanged once per update, whatever N, on every path " \
                      "(two workers)"
        time_target = "time per update of every path at or under the per-mini-batch " \
                      "exchange's, N > 1"
        if "error" in result:
            return [Target(once_target, "probe failed", "missed"),
                    Target(time_target, "probe failed", "missed")]
        rows = {key: r for key, r in self._rows(result).items() if key[1] != BASELINE}
        bytes_ = {r["gradient_bytes"] for r in rows.values()}
        twice = sorted((key for key, r in rows.items() if r["exchanges"] != 1),
                       key=lambda key: (key[1], key[0]))
        at = ", ".join(map(str, sorted({n for n, _ in rows})))
        if twice:
            once = "; ".join(f"{path}: {rows[(n, path)]['exchanges']} at N={n}"
                             for n, path in twice)
        else:
            once = (f"1 exchange of {'/'.join(map(str, sorted(bytes_)))} bytes on every path "
                    f"at N={at}")
        ratios = {key: r["ratio"] for key, r in rows.items() if key[0] > 1}
        worst = max(ratios, key=ratios.get) if ratios else None
        return [
            Target(once_target, once, status(not twice and len(bytes_) == 1)),
            Target(time_target, f"worst {ratios[worst]:.2f}x ({worst[1]} at N={worst[0]})"
                   if worst else "not measured",
                   status(bool(ratios) and max(ratios.values()) <= 1.0)),
        ]

    def markdown(self, result):
        lines = self.heading(
            "Two worker processes on 127.0.0.1 (MultiWorkerMirroredStrategy, one CPU "
            f"replica each), the {self.settings['model']}, global mini-batches of "
            f"B={self.settings['b']}, the same window on every path, each path driven "
            "by its own step function, one call per update: `accumulate + fit` is "
            "`accumulate(model, N)`'s train function (fit's) on an iterator of the "
            "dataset distributed as fit distributes it; `fit_accumulated` is the "
            "window step that `fit_accumulated`'s loop calls, on an iterator of the "
            "dataset; `command line` is the tf2 engine's window step on the window "
            "stacked in memory (WindowAccumulator.apply_stacked); `per mini-batch`, "
            "built in tools/bench_collective.py on the stacked window, all-reduces "
            "each mini-batch's gradients as they come and Adam exchanges their sums "
            "once more (N + 1 exchanges). The collectives are those a profiler trace "
            "of a window saw run, each as often as it ran (the most any of "
            f"{self.settings['traces']} traced windows saw), and the ms in them (the "
            "median of those windows', the wait for the other worker included); bytes "
            "are an op's input in the traced graph, as reduced (a ring sends about as "
            "much again over the wire). Every op of more than "
            f"{4 * SMALL} bytes is an exchange of the gradients; the small ones are "
            "the window's samples and its non-finite vote (the window step's two), "
            "and in Keras's train function the loss tracker's total and count, read "
            "across the replicas for fit's logs (`Cast_2/`, `div_no_nan/`). ms per "
            f"update are the median of {self.settings['windows']} windows, the four "
            "paths' windows interleaved in rounds, and `/ per mini-batch` the median "
            "of the per-round ratios.")
        if "error" in result:
            return lines + [f"The probe failed: {result['error']}"]
        body = []
        order = {path: i for i, path in enumerate(PATHS)}
        for (n, path), r in sorted(self._rows(result).items(),
                                   key=lambda item: (item[0][0], order[item[0][1]])):
            small = ", ".join(f"{c['name']} x{c['runs']} ({c['bytes']} B)"
                              for c in r["small"]) or "none"
            body.append((n, f"`{path}`", r["exchanges"], r["gradient_bytes"], small,
                         f"{r['ms']:.1f}", f"{r['collective_ms']:.1f}",
                         f"{r['ratio']:.2f}x" if path != BASELINE else ""))
        return lines + table(("N", "path", "gradient exchanges", "gradient bytes",
                              "small collectives (counts, votes)", "ms per update",
                              "ms in collectives", "/ per mini-batch"), body)


def main():
    """python -m tools.bench_collective [--quick] [--ops]: the section alone, its markdown."""
    from tools.bench_section import Run

    section = Collective(quick="--quick" in sys.argv)
    if "--ops" in sys.argv:
        section.settings = dict(section.settings, ops=True)
        probe = two_workers(dict(section.settings))
        if "error" in probe:
            sys.exit(f"error: {probe['error']}")
        for n, paths in probe.items():
            if n == "seconds":
                continue
            ops = {path: paths[path]["ops"] for path in PATHS}
            kinds = list(dict.fromkeys(kind for path in PATHS for kind in sorted(
                ops[path], key=lambda kind, path=path: -ops[path][kind])[:OPS]))
            print("\n".join([f"\nN={n}: ms in each kind of event, the median of "
                               f"{section.settings['traces']} traced windows", *table(
                ("event", *PATHS), [(kind[:60], *(f"{ops[path].get(kind, 0):.2f}"
                                                  for path in PATHS)) for kind in kinds])]))
        return
    result = section.measure(Run())
    print("\n".join(section.markdown(result)))
    for target in section.targets(result):
        print(target)


if __name__ == "__main__":
    main()
