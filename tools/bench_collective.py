"""The bench's collective section: one exchange of the gradients per update, on two workers.

Two local worker processes (MultiWorkerMirroredStrategy, one CPU replica each, their own
TF_CONFIG) train the same windows two ways, at N in {1, 4, 16} mini-batches per update:

  * `window`: the library's window step (WindowAccumulator.apply_stacked, the command
    line's tf2 engine): the gradients are summed on each replica and exchanged once,
    by the optimizer, when the window is applied;
  * `per mini-batch`: built here, the way a training step written for a strategy
    accumulates after the exchange: each mini-batch's gradients are all-reduced at once
    (inside a tf.range loop: one op in the graph, run N times) and summed, then applied
    once; Keras's Adam all-reduces what it is given under a strategy, so the apply adds
    one exchange (of the sums divided by the replicas, which it sums back): N + 1.

The collectives are counted as they run: a profiler trace of one window names each
collective op executed, as many times as it ran; its bytes are those of its input in the
traced graph. The gradients' exchange (every op of more than SMALL elements) is listed
apart from the small counts and votes (the samples, the non-finite vote).
"""

import concurrent.futures
import json
import os
import statistics
import sys
import tempfile
import time

from tools import bench_probe
from tools.bench_section import Section
from tools.bench_section import Target
from tools.bench_section import status
from tools.bench_section import table

SMALL = 64  # elements: a collective of at most this many is a count or a vote
PATHS = ("window", "per mini-batch")


# ---------------------------------------------------------------- in each worker


def collective_probe(spec):
    """One worker's measurements (run by bench_probe in a process with its TF_CONFIG):
    {"n": {path: {"ms": [per window], "collectives": [{"name", "runs", "bytes"}]}}}."""
    import tensorflow as tf

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    results = {}
    for n in spec["n"]:
        built = {path: _build(strategy, path, n, spec, index) for path in PATHS}
        for window, _ in built.values():
            for _ in range(spec["warmup"]):
                window()
        times = {path: [] for path in PATHS}
        for _ in range(spec["windows"]):  # interleaved: the machine's load falls on both
            for path, (window, _) in built.items():
                start = time.perf_counter()
                window()
                times[path].append(1e3 * (time.perf_counter() - start))
        results[str(n)] = {path: dict(ms=times[path], collectives=_profile(
            *built[path], traced=index == 0)) for path in PATHS}
    return results


def _profile(window, function, traced):
    """[{"name", "runs", "bytes"}] of the collectives one window runs: traced on worker 0
    alone (every worker runs the same; a worker other than the chief was seen to crash
    in the profiler's teardown, twice in six pairs); the others only train the window."""
    import tensorflow as tf

    if not traced:
        window()
        return []
    with tempfile.TemporaryDirectory() as logdir:
        tf.profiler.experimental.start(logdir)
        window()
        tf.profiler.experimental.stop()
        runs = executed_collectives(logdir)
    sizes = collective_bytes(function.graph)
    return [{"name": name, "runs": count, "bytes": sizes.get(graph_name(name, sizes))}
            for name, count in sorted(runs.items())]


def _build(strategy, path, n, spec, index):
    """(a function that trains one window of `path`, its traced tf.function)."""
    import keras
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
        optimizer = keras.optimizers.Adam(1e-3)
    if path == "window":
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


class PerMiniBatchExchange:
    """The gradients of each mini-batch all-reduced as soon as computed, summed on each
    worker, and applied once per window (by Adam, which exchanges them once more)."""

    def __init__(self, net, optimizer, strategy, global_batch):
        import tensorflow as tf

        self.net, self.optimizer, self.strategy = net, optimizer, strategy
        self.global_batch = global_batch
        # Plain variables, one per worker: each holds the exchanged (global) sums.
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
    """{op name as traced: times it ran} of the collective ops in a profiler trace."""
    import glob

    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    counts = {}
    for path in glob.glob(os.path.join(logdir, "**", "*.xplane.pb"), recursive=True):
        with open(path, "rb") as f:
            space = xplane_pb2.XSpace.FromString(f.read())
        for plane in space.planes:
            for line in plane.lines:
                for event in line.events:
                    name, _, op = plane.event_metadata[event.metadata_id].name.partition(":")
                    if op.startswith("Collective"):
                        counts[name] = counts.get(name, 0) + 1
    return counts


def collective_bytes(graph, seen=None):
    """{op name: bytes of its input} of the collective ops of a traced function's graph
    and the functions it calls (a cond's branches, a loop's body)."""
    seen = set() if seen is None else seen
    sizes = {}
    for op in graph.get_operations():
        if op.type.startswith("Collective") and op.inputs:
            tensor = op.inputs[0]
            elements = tensor.shape.num_elements()
            sizes[op.name] = None if elements is None else elements * tensor.dtype.size
    for function in getattr(graph, "_functions", {}).values():
        inner = getattr(function, "graph", None)
        if inner is not None and id(inner) not in seen:
            seen.add(id(inner))
            sizes.update(collective_bytes(inner, seen))
    return sizes


def graph_name(traced, sizes):
    """The graph op a traced name is (the trace prefixes the calling ops' names)."""
    matches = [name for name in sizes if traced == name or traced.endswith("/" + name)]
    return max(matches, key=len) if matches else None


# ---------------------------------------------------------------- the section


def two_workers(spec, timeout=bench_probe.TIMEOUT):
    """collective_probe on two worker processes on 127.0.0.1; returns worker 0's result
    (or the first error)."""
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
    """Per N and path: the median ms per update, the gradients' exchanges and bytes, and
    the small collectives."""
    rows = {}
    for n, paths in probe.items():
        ratios = [a / b for a, b in zip(paths["window"]["ms"], paths["per mini-batch"]["ms"])]
        for path, measured in paths.items():
            big = [c for c in measured["collectives"]
                   if c["bytes"] is None or c["bytes"] > 4 * SMALL]
            small = [c for c in measured["collectives"] if c not in big]
            rows[(int(n), path)] = dict(
                ms=statistics.median(measured["ms"]),
                exchanges=sum(c["runs"] for c in big),
                gradient_bytes=sum(c["runs"] * (c["bytes"] or 0) for c in big),
                small=small, ratio=statistics.median(ratios) if path == "window" else 1.0)
    return rows


class Collective(Section):
    name, title = "collective", "One exchange of the gradients per update (two workers)"
    FULL = dict(n=(1, 4, 16), b=32, model="convnet", warmup=2, windows=10)
    QUICK = dict(n=(1, 4), b=8, model="convnet", warmup=1, windows=2)

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
        if "error" in result:
            return [Target("the gradients exchanged once per update, whatever N",
                           "probe failed", "missed")]
        rows = self._rows(result)
        windows = {n: r for (n, path), r in rows.items() if path == "window"}
        once = all(r["exchanges"] == 1 for r in windows.values())
        bytes_ = {r["gradient_bytes"] for r in windows.values()}
        ratios = {n: r["ratio"] for n, r in windows.items() if n > 1}
        worst = max(ratios, key=ratios.get) if ratios else None
        return [
            Target("the gradients exchanged once per update, whatever N (two workers)",
                   f"{'1' if once else 'not 1'} exchange of {'/'.join(map(str, bytes_))} "
                   f"bytes at N={', '.join(map(str, sorted(windows)))}", status(
                       once and len(bytes_) == 1)),
            Target("time per update at or under the per-mini-batch exchange's, N > 1",
                   f"worst {ratios[worst]:.2f}x at N={worst}" if worst else "not measured",
                   status(bool(ratios) and max(ratios.values()) <= 1.0)),
        ]

    def markdown(self, result):
        lines = [f"## {self.title}", "",
                 f"Two worker processes on 127.0.0.1 (MultiWorkerMirroredStrategy, one CPU "
                 f"replica each), the {self.settings['model']}, global mini-batches of "
                 f"B={self.settings['b']}; `window` is the library's window step (the command "
                 "line's), `per mini-batch` all-reduces each mini-batch's gradients as they "
                 "come and Adam exchanges their sums once more (N + 1 exchanges; built in "
                 "tools/bench_collective.py). The collectives are those a "
                 "profiler trace of one window saw run, each as often as it ran; bytes are "
                 "its input's, as reduced (a ring sends about as much again over the wire); "
                 f"ms per update are the median of {self.settings['windows']} windows, the two "
                 "paths' windows interleaved, and `window / per mini-batch` the median of "
                 "their per-round ratios.", ""]
        if "error" in result:
            return lines + [f"The probe failed: {result['error']}"]
        body = []
        for (n, path), r in sorted(self._rows(result).items()):
            small = ", ".join(f"{c['name'].rsplit('/', 1)[-1]} x{c['runs']} ({c['bytes']} B)"
                              for c in r["small"]) or "none"
            body.append((n, path, r["exchanges"], r["gradient_bytes"], small, f"{r['ms']:.1f}",
                         f"{r['ratio']:.2f}x" if path == "window" else ""))
        return lines + table(("N", "path", "gradient exchanges", "gradient bytes",
                              "small collectives (counts, votes)", "ms per update",
                              "window / per mini-batch"), body)


def main():
    """Runs the section alone and prints its markdown (the bench runs it in its place)."""
    from tools.bench_section import Run

    section = Collective(quick="--quick" in sys.argv)
    result = section.measure(Run())
    print("\n".join(section.markdown(result)))
    for target in section.targets(result):
        print(target)


if __name__ == "__main__":
    main()
