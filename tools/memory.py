"""Peak tensor memory of each training path, as a device's allocator counts it.

    python -m tools.memory --model=convnet --n=2 --n=32 --paths=accumulate,window

Host RSS hides a step under TensorFlow's floor; the BFC allocator (the GPU's, or the CPU's with
TF_CPU_ALLOCATOR_USE_BFC=true) counts live tensors and, under TF_CPU_BFC_MEM_LIMIT_IN_MB, raises an
OOM as a device that size would. A figure is one fresh process (a probe): a warm-up update, the
peak reset, a measured update. One inter-op thread, as a GPU runs one stream (the peak depends on
op order); oneDNN off, so a convolution's OOM raises instead of crashing; the CPU's allocator one
region, as a GPU's (one growing by regions runs out before its limit). The BFC allocator hands out
a free chunk of up to twice the request whole, so the peak varies between processes: a figure is
the median of several probes, growth in N uses usual_peak. The parent imports no TensorFlow.
"""

import concurrent.futures
import functools
import os
import re
import shlex
import statistics
import sys
import time

import numpy as np
from absl import flags

from experiment import cli
from experiment import results
from tools import bench_probe
from tools import bench_section
from tools import models

FLAGS = flags.FLAGS

MIB = 1 << 20
# The paths (_PATHS): alone (B alone), direct and keras are references; the _p2 paths run
# parallel_mini_batches=2.
PATHS = ("alone", "direct", "keras", "accumulate", "window", "mini_batch", "tf1",
         "accumulate_p2", "window_p2")
# The TF1 graph's own direct batch and B alone (plain Adam): the tf1 path's weights' reference
# and its bound (a TF1 session holds its variables' initial zeros for as long as it lives).
TF1_REFERENCES = ("tf1_direct", "tf1_alone")
REFERENCES = TF1_REFERENCES + ("dense_direct",)
# dense_direct: the direct batch with an Embedding's gradient made dense before Adam, the
# accumulating paths' weights' reference on a language model (the window applies its mean dense).
MARGIN, MARGIN_MIN_MB = 0.05, 4.0  # the bound's margin
PROBE_TIMEOUT = 600  # seconds
PROFILE_TOP = 8  # the tensors a profiled probe lists, alive at its peak
RESERVE_MB = 2048  # the CPU's one region where a probe has no limit (above every peak)


def probe_env(limit_mb=None, gpu=False):
    """The environment of a probe process (set before TensorFlow starts in it)."""
    env = dict(os.environ, TF_CPU_ALLOCATOR_USE_BFC="true", TF_NUM_INTEROP_THREADS="1",
               TF_ENABLE_ONEDNN_OPTS="0", TF_CPP_MIN_LOG_LEVEL="2")
    if not gpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    env.pop("TF_CPU_BFC_MEM_LIMIT_IN_MB", None)
    if limit_mb and not gpu:  # a GPU's limit is a logical device, set in the probe
        env["TF_CPU_BFC_MEM_LIMIT_IN_MB"] = str(int(limit_mb))
    return env


def probe(model, path, n, b, limit_mb=None, gpu=False, timeout=PROBE_TIMEOUT, save=None,
          micro_batch=None, timed=0, held=None, jit_compile=False, profile=False):
    """One measurement in a fresh process.

    Args:
      save: a .npz file for the trainable weights after the two updates, or None.
      micro_batch: accumulate only: one effective batch of N*B cut into micro-batches of
        this size ("auto": found by fit).
      timed: updates timed after the measured one; update_ms is the fastest of all.
      held: for growth in N: samples (at least N*B) held on the device before the warm-up,
        the same at every N; None: N*B samples in a tf.data dataset.
      jit_compile: direct and accumulate only: compiled with XLA.
      profile: adds at_peak and largest_by_op (_profiled).

    Returns:
      The spec, seconds, and either peak_mb, current_mb (before the update), update_ms,
      weights_mb, largest_mb, accumulators_mb, oom=False (with micro_batch also
      micro_batch_size, search_s, trials, halved); or oom=True, phase, message; or error.
    """
    if model not in models.MODELS or path not in PATHS + REFERENCES:
        raise ValueError(f"model must be one of {models.MODELS} and path one of {PATHS}. "
                         f"Received: model={model!r}, path={path!r}")
    spec = dict(model=model, path=path, n=int(n), b=int(b), limit_mb=limit_mb, gpu=bool(gpu),
                save=None if save is None else str(save), micro_batch=micro_batch,
                timed=int(timed), held=held, profile=bool(profile),
                **({"jit_compile": True} if jit_compile else {}))
    if path.startswith("tf1") and model not in models.TF1_MODELS:
        return dict(spec, error=f"no TF1 graph of the {model} model", seconds=0.0)
    return bench_probe.spawn(run_probe, spec, probe_env(limit_mb, gpu), timeout)


def probes(specs, jobs=1, log=None):
    """probe(**spec) for each spec, `jobs` at a time (times depend on it), in the specs' order."""
    def one(spec):
        result = probe(**spec)
        if log:
            log(probe_line(result))
        return result

    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        return list(pool.map(one, specs))


def probe_line(result):
    what = f"{result['model']} {result['path']} N={result['n']} B={result['b']}"
    if result.get("error"):
        return f"{what}: {result['error']}"
    if result.get("oom"):
        return f"{what}: OOM in the {result['phase']} ({result['seconds']:.1f} s)"
    line = f"{what}: peak {result['peak_mb']:.1f} MiB ({result['seconds']:.1f} s)"
    if result.get("at_peak"):
        line += "; alive at the peak, of the update's: " + at_peak_text(result["at_peak"])
    return line


def at_peak_text(rows):
    """A profiled probe's tensors alive at its peak, in one line."""
    return ", ".join(f"{op} {shape} {mb:.1f}".replace("  ", " ") for op, shape, mb in rows)


# Held to bound_mb without the accumulators; the others (a TF1 session, two passes at once) with.
ONE_PASS_TF2 = ("accumulate", "window", "mini_batch")


def bound_mb(alone_mb, largest_mb, accumulators_mb=0.0):
    """B alone's peak plus one temporary of the largest variable (the sums stand in for the
    gradients B alone holds), plus `accumulators_mb` where the sums come on top (in their
    accumulation dtype), plus MARGIN of that, MARGIN_MIN_MB at least."""
    base = alone_mb + largest_mb + accumulators_mb
    return base + max(MARGIN * base, MARGIN_MIN_MB)


def summarize(results):
    """One path's probes as one row: the medians, every peak, the OOMs and errors."""
    first = results[0]
    row = {key: first[key] for key in ("model", "path", "n", "b", "limit_mb", "gpu")}
    measured = [r for r in results if "peak_mb" in r]
    row.update(probes=len(results), peaks=[r["peak_mb"] for r in measured],
               ooms=sum(bool(r.get("oom")) for r in results),
               errors=sorted({r["error"] for r in results if r.get("error")}),
               seconds=statistics.median(r["seconds"] for r in results))
    row["peak_mb"] = statistics.median(row["peaks"]) if measured else None
    row["current_mb"] = (statistics.median(r["current_mb"] for r in measured)
                         if measured else None)
    for key in ("weights_mb", "largest_mb", "accumulators_mb"):  # the model's, not the run's
        row[key] = measured[0][key] if measured else None
    return row


def with_ratios(rows):
    """Adds bound_mb and the peak's ratios to it, alone, direct and keras (None where missing);
    a TF1 row's alone and direct are tf1_alone and tf1_direct where measured."""
    peaks = {row["path"]: row["peak_mb"] for row in rows}
    sizes = next((row for row in rows if row["weights_mb"] is not None), None)

    def ratio(peak, reference):
        return peak / reference if peak is not None and reference else None

    def ratios(row):
        tf1 = row["path"].startswith("tf1") and "tf1_alone" in peaks
        alone, direct = (peaks.get("tf1_alone"), peaks.get("tf1_direct")) if tf1 else (
            peaks.get("alone"), peaks.get("direct"))
        bound = None
        if alone is not None and sizes:
            one_pass = row["path"] in ONE_PASS_TF2 + ("alone", "direct", "keras")
            bound = bound_mb(alone, sizes["largest_mb"],
                             0.0 if one_pass else sizes["accumulators_mb"])
        references = {"bound": bound, "alone": alone, "direct": direct,
                      "keras": peaks.get("keras")}
        return dict(row, bound_mb=bound, **{f"to_{name}": ratio(row["peak_mb"], reference)
                                            for name, reference in references.items()})

    return [ratios(row) for row in rows]


def table(model, n, b, paths=PATHS, repeats=3, limit_mb=None, jobs=1, gpu=False,
          log=None, held=None, profile=False):
    """Every path's row (summarize's, with_ratios') at N x B in `paths`' order; probes alternate."""
    specs = [dict(model=model, path=path, n=n, b=b, limit_mb=limit_mb, gpu=gpu, held=held,
                  profile=profile) for _ in range(repeats) for path in paths]
    results = probes(specs, jobs, log)
    return with_ratios([summarize([r for r in results if r["path"] == path])
                        for path in paths])


def usual_peak(peaks, within=0.01):
    """The median of the mode most peaks landed in (a peak lands in one of a few, by where the
    allocator found room): a mode holds the peaks within `within` of its lowest; None if none."""
    modes = []
    for peak in sorted(peaks):
        if modes and peak <= modes[-1][0] * (1 + within):
            modes[-1].append(peak)
        else:
            modes.append([peak])
    if not modes:
        return None
    return statistics.median(max(modes, key=len))  # max keeps the first (lower) of a tie


def growth(tables):
    """{n: table rows} (one B) -> per path its usual_peak at each N and largest N's / smallest's."""
    ns = sorted(tables)
    rows = []
    for path in [row["path"] for row in tables[ns[0]]]:
        probed = {n: sorted(next(row["peaks"] for row in tables[n] if row["path"] == path))
                  for n in ns}
        peaks = {n: usual_peak(probed[n]) for n in ns}
        first, last = peaks[ns[0]], peaks[ns[-1]]
        rows.append({"path": path, "peaks": peaks, "probed": probed,
                     "growth": last / first if first and last is not None else None})
    return rows


def _number(value, digits=2):
    return "–" if value is None else f"{value:.{digits}f}"


_mb = functools.partial(_number, digits=1)


def _peak(row):
    if row["peak_mb"] is None:
        return "OOM" if row["ooms"] else "error"
    return _mb(row["peak_mb"]) + (f" ({row['ooms']} OOM)" if row["ooms"] else "")


def markdown(rows):
    """A table's rows as markdown, with a line on the model and the bound."""
    first = rows[0]
    sizes = next((row for row in rows if row["weights_mb"] is not None), first)
    limit = f", a limit of {first['limit_mb']} MiB" if first["limit_mb"] else ""
    alone = next((row for row in rows if row["path"] == "alone"), first)
    moonshot = (None if alone["peak_mb"] is None else
                alone["peak_mb"] + max(MARGIN * alone["peak_mb"], MARGIN_MIN_MB))
    with_sums = next((row["bound_mb"] for row in rows if row["path"].endswith("_p2")), None)
    lines = [f"{first['model']}, N={first['n']} x B={first['b']}{limit}: weights "
             f"{_mb(sizes['weights_mb'])} MiB, accumulators {_mb(sizes['accumulators_mb'])}"
             f" MiB, largest variable {_mb(sizes['largest_mb'])} MiB; bound "
             f"{_mb(alone['bound_mb'])} MiB (B alone + largest variable, "
             f"+{MARGIN:.0%}, {MARGIN_MIN_MB:.0f} MiB at least), the moonshot "
             f"{_mb(moonshot)} MiB (B alone + {MARGIN:.0%})"
             + ("" if with_sums is None else
                f"; the _p2 rows' bound {_mb(with_sums)} MiB (B alone + accumulators + "
                "largest variable + 5%)") + ". Peak MiB, median of "
             f"{first['probes']} probes (one process each)."
             + tf1_bound(rows), ""]
    header = ("path", "peak", "before the update", "peak / bound", "/ B alone", "/ direct",
              "/ Keras's", "s per probe")
    lines += bench_section.table(header, [
        (row["path"], _peak(row), _mb(row["current_mb"]),
         *(_number(row[f"to_{k}"]) for k in ("bound", "alone", "direct", "keras")),
         f"{row['seconds']:.1f}") for row in rows])
    lines += [f"- {row['path']}: {e}" for row in rows for e in row["errors"]]
    lines += [f"- {row['path']}, alive at its peak (a profiled probe, {row['at_peak_mb']:.1f} "
              f"MiB), of what the update allocated, MiB: {at_peak_text(row['at_peak'])}"
              for row in rows if row.get("at_peak")]
    return "\n".join(lines) + "\n"


def tf1_bound(rows):
    """The sentence on the TF1 rows' bound, where it is their own B alone's."""
    tf1 = next((row for row in rows if row["path"] == "tf1_alone"), None)
    if tf1 is None:
        return ""
    return (f" The tf1 rows' B alone and direct batch are the TF1 graph's own (plain Adam "
            f"in a session: tf1_alone, tf1_direct), so their bound is "
            f"{_mb(tf1['bound_mb'])} MiB (B alone + accumulators + largest variable + 5%): "
            "a TF1 session holds the zeros its variables were initialized from for as long "
            "as it lives, whatever it trains.")


def growth_markdown(rows):
    """growth's rows as markdown (the ratio to 3 digits: the target is 2%)."""
    ns = sorted(rows[0]["peaks"])
    header = ("path", *(f"N={n}" for n in ns), f"N={ns[-1]} / N={ns[0]}",
              *(f"every probe, N={n}" for n in ns))
    lines = bench_section.table(header, [
        (row["path"], *(_mb(row["peaks"][n]) for n in ns), _number(row["growth"], 3),
         *(", ".join(_mb(p) for p in row["probed"][n]) for n in ns)) for row in rows])
    return "\n".join(lines) + "\n"


_adam = functools.partial(models.adam, epsilon=models.ADAM_EPSILON)


def _compiled(model, optimizer=None, jit_compile="auto"):
    model.compile(optimizer=optimizer or _adam(), loss=models.loss(), jit_compile=jit_compile)
    return model


def _fit(model, x, y, batch_size, samples):
    """One update: fit on a dataset built once (fit on arrays rebuilds its pipeline each call,
    on the CPU's allocator, which a GPU's does not see)."""
    dataset = _dataset(x, y, batch_size, samples)
    return lambda: model.fit(dataset, epochs=1, verbose=0)


def _keras_path(net, update, *more):
    """A path's result for the Keras model `net`, trained by `update`."""
    trainable = net.trainable_weights
    return (update, net.weights, trainable, lambda: [v.numpy() for v in trainable], *more)


def _path_alone(model, n, b, x, y):
    # N updates at B, the input pipeline running beside them as beside a window's mini-batches.
    net = _compiled(models.keras_model(model))
    return _keras_path(net, _fit(net, x, y, b, n * b))


def _path_direct(model, n, b, x, y, jit_compile="auto", dense_rows=False):
    net = _compiled(models.keras_model(model, dense_rows), jit_compile=jit_compile)
    return _keras_path(net, _fit(net, x, y, n * b, n * b))


def _path_keras(model, n, b, x, y):
    net = _compiled(models.keras_model(model), _adam(gradient_accumulation_steps=n))
    return _keras_path(net, _fit(net, x, y, b, n * b))


def _path_accumulate(model, n, b, x, y, micro_batch=None, parallel=1, jit_compile="auto"):
    from gradient_averaging.keras_fit import accumulate
    net = models.keras_model(model)
    if micro_batch is None:
        cut = _compiled(accumulate(net, n, parallel_mini_batches=parallel))
        return _keras_path(net, _fit(cut, x, y, b, n * b))
    cut = _compiled(accumulate(net, micro_batch_size=micro_batch), jit_compile=jit_compile)
    update = _fit(cut, x, y, n * b, n * b)  # "auto": the first call searches, then trains

    def found():  # the micro-batch fit cut the effective batch by, and its search
        m = cut.micro_batch
        return dict(micro_batch_size=m.micro_batch_size, search_s=m.seconds,
                    trials=[(size, peak and peak / MIB) for size, peak in m.trials],
                    halved=list(m.out_of_memory))

    return _keras_path(net, update, found)


def _dataset(x, y, b, samples):
    """The first `samples` of x, y in batches of b. Arrays stay on the host, each batch made a
    tensor as it runs (from_tensor_slices copied them whole into the measured allocator in
    some processes only); device tensors (`held`) are sliced."""
    import tensorflow as tf
    if not isinstance(x, np.ndarray):
        return tf.data.Dataset.from_tensor_slices((x, y)).take(samples).batch(b)

    samples = min(samples, len(x))  # as take would

    def batches():
        for start in range(0, samples, b):
            end = min(start + b, samples)
            yield x[start:end], y[start:end]

    # Cardinality told: on a dataset of unknown length Keras 3.15's fit ran a step too many.
    return tf.data.Dataset.from_generator(batches, output_signature=(
        tf.TensorSpec((None,) + x.shape[1:], tf.as_dtype(x.dtype)),
        tf.TensorSpec((None,) + y.shape[1:], tf.as_dtype(y.dtype)))).apply(
            tf.data.experimental.assert_cardinality(-(-samples // b)))


def _path_window(model, n, b, x, y, parallel=1):
    # One accumulator for warm-up and update keeps its tracing (and grappler's constant
    # folding, which allocates on the CPU) out of the measured update.
    from gradient_averaging.tf2 import WindowAccumulator
    net = models.keras_model(model)
    accumulator = WindowAccumulator(net, _adam(), models.sample_loss(model),
                                    average_gradients=n, parallel_mini_batches=parallel)
    dataset = _dataset(x, y, b, n * b)
    return _keras_path(net, functools.partial(accumulator.fit, dataset))


def _path_mini_batch(model, n, b, x, y):
    from gradient_averaging.tf2 import MiniBatchAccumulator
    net = models.keras_model(model)
    accumulator = MiniBatchAccumulator(net, _adam(), models.sample_loss(model))
    dataset = _dataset(x, y, b, n * b)

    def update():
        for mini_x, mini_y in dataset:
            accumulator.accumulate(mini_x, mini_y)
        accumulator.apply()

    return _keras_path(net, update)


def _path_tf1(model, n, b, x, y, plain=None):
    """AveragingOptimizer(Adam, N) run per mini-batch of B; plain Adam on N*B at once
    (plain="direct") or on N batches of B (plain="alone")."""
    import tensorflow as tf

    from gradient_averaging.tf1 import AveragingOptimizer
    v1 = tf.compat.v1
    graph = tf.Graph()
    with graph.as_default():
        v1.set_random_seed(models.SEED)
        images = v1.placeholder(tf.float32, (None,) + models.INPUT_SHAPES[model])
        labels = v1.placeholder(tf.int32, (None,))
        logits = models.tf1_logits(model, images)
        weights = v1.trainable_variables()
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=labels, logits=logits))
        optimizer = v1.train.AdamOptimizer()
        train_op = (optimizer if plain else AveragingOptimizer(optimizer, n)).minimize(loss)
        init = v1.global_variables_initializer()
    graph.finalize()
    session = v1.Session(graph=graph, config=v1.ConfigProto(inter_op_parallelism_threads=1))
    session.run(init)
    x, y = np.asarray(x)[:n * b], np.asarray(y)[:n * b]
    size = n * b if plain == "direct" else b
    feeds = [{images: x[i:i + size], labels: y[i:i + size]} for i in range(0, n * b, size)]

    def update():  # the N-th run applies the window (plain: each run an update)
        for feed in feeds:
            session.run(train_op, feed)

    return update, weights, weights, lambda: session.run(weights)


# A path: (model, n, b, x, y of N*B samples) -> (one update, weights, trainable weights,
# a function of the trainable values[, a function of more result keys]).
_PATHS = {"alone": _path_alone, "direct": _path_direct, "keras": _path_keras,
          "dense_direct": functools.partial(_path_direct, dense_rows=True),
          "accumulate": _path_accumulate, "window": _path_window,
          "mini_batch": _path_mini_batch, "tf1": _path_tf1,
          "tf1_direct": lambda *args: _path_tf1(*args, plain="direct"),
          "tf1_alone": lambda *args: _path_tf1(*args, plain="alone"),
          "accumulate_p2": functools.partial(_path_accumulate, parallel=2),
          "window_p2": functools.partial(_path_window, parallel=2)}


def _sizes(weights, trainable):
    """MiB: weights, largest trainable variable, accumulators (in window.accumulator_dtype)."""
    import tensorflow as tf

    from gradient_averaging import window

    def mib(v, dtype=None):
        return int(np.prod([int(d) for d in v.shape])) * (dtype or tf.as_dtype(v.dtype)).size / MIB

    return dict(weights_mb=sum(map(mib, weights)), largest_mb=max(map(mib, trainable)),
                accumulators_mb=sum(mib(v, window.accumulator_dtype(v)) for v in trainable))


def _milliseconds(run):
    start = time.perf_counter()
    run()
    return 1e3 * (time.perf_counter() - start)


def _profiled(update, top=PROFILE_TOP):
    """Runs `update` under the profiler: ([ms], the `top` tensors it allocated alive at its peak
    as [op, shape, MiB], largest first, plus a row summing the rest, {op name without scopes
    and number: its largest allocation, MiB})."""
    import tempfile

    import tensorflow as tf
    with tempfile.TemporaryDirectory() as logdir:
        tf.profiler.experimental.start(logdir)
        try:
            times = [_milliseconds(update)]
        finally:
            tf.profiler.experimental.stop()
        planes = list(bench_section.xplanes(logdir))
    events = []
    for plane in planes:
        names = {key: m.name for key, m in plane.event_metadata.items()}
        stat_names = {key: m.name for key, m in plane.stat_metadata.items()}
        for line in plane.lines:
            for event in line.events:
                kind = names.get(event.metadata_id)
                if kind not in ("MemoryAllocation", "MemoryDeallocation"):
                    continue
                stats = {stat_names[s.metadata_id]: _stat(s, stat_names)
                         for s in event.stats}
                if str(stats.get("allocator_name", "")).startswith("bfc"):
                    events.append((line.timestamp_ns * 1000 + event.offset_ps, kind, stats))
    events.sort(key=lambda e: e[0])
    live, peak, at_peak, largest = {}, -1, {}, {}
    for _, kind, stats in events:
        if kind == "MemoryAllocation":
            live[stats["addr"]] = (stats.get("tf_op") or "?", stats.get("shape") or "",
                                   stats.get("allocation_bytes") or 0)
            op_type = re.sub(r"_\d+$", "", live[stats["addr"]][0].rsplit("/", 1)[-1])
            largest[op_type] = max(largest.get(op_type, 0), live[stats["addr"]][2] / MIB)
            if stats.get("bytes_allocated", 0) > peak:
                peak, at_peak = stats["bytes_allocated"], dict(live)
        else:
            live.pop(stats["addr"], None)
    tensors = sorted(at_peak.values(), key=lambda t: -t[2])
    rows = [[op, shape, nbytes / MIB] for op, shape, nbytes in tensors[:top]]
    rest = sum(nbytes for _, _, nbytes in tensors[top:])
    if rest:
        rows.append([f"{len(tensors) - top} more", "", rest / MIB])
    return times, rows, largest


def _stat(stat, names):
    """An XStat's value (a string it refers to by id, as a string)."""
    kind = stat.WhichOneof("value")
    return names.get(stat.ref_value) if kind == "ref_value" else getattr(stat, kind)


def run_probe(spec):
    """One measurement in this process (started with probe_env's environment): probe's dict."""
    import gc

    import tensorflow as tf
    tf.config.threading.set_inter_op_parallelism_threads(1)
    device = "CPU:0"
    if spec["gpu"]:
        gpus = tf.config.list_physical_devices("GPU")
        if not gpus:
            return dict(spec, error="no GPU visible to the probe")
        if spec["limit_mb"]:
            tf.config.set_logical_device_configuration(gpus[0], [
                tf.config.LogicalDeviceConfiguration(memory_limit=int(spec["limit_mb"]))])
        device = "GPU:0"
    else:  # one region, as a GPU's memory: the limit's (less what the start holds)
        from gradient_averaging import device as device_lib
        device_lib.reserve_cpu_memory(None if spec["limit_mb"] else RESERVE_MB)
    phase = "warm-up"
    cut = {k: spec[k] for k in ("micro_batch", "jit_compile") if spec.get(k)}
    try:
        x, y = models.data(spec["model"], max(spec["n"] * spec["b"], spec.get("held") or 0))
        if spec.get("held"):
            # The same samples at every N, so growth is the path's; copied, as a constant
            # from an array landed in the measured allocator in some processes only.
            x, y = (tf.raw_ops.DeepCopy(x=tf.constant(a)) for a in (x, y))
        update, weights, trainable, values, *more = _PATHS[spec["path"]](
            spec["model"], spec["n"], spec["b"], x, y, **cut)
        warmup_ms = _milliseconds(update)  # traces; with "auto", the search's windows
        phase = "update"
        gc.collect()  # the warm-up's garbage (cycles hold tensors) is not the update's
        current = tf.config.experimental.get_memory_info(device)["current"]
        tf.config.experimental.reset_memory_stats(device)
        if spec.get("profile"):
            times, at_peak, largest = _profiled(update)
        else:
            times, at_peak, largest = [_milliseconds(update)], None, None
        peak = tf.config.experimental.get_memory_info(device)["peak"]
        if spec.get("save"):  # the trainable weights after the two updates
            np.savez(spec["save"], *values())
        times += [_milliseconds(update) for _ in range(spec.get("timed", 0))]
    except tf.errors.ResourceExhaustedError as e:
        lines = str(e).strip().splitlines() or [type(e).__name__]
        message = next((line for line in lines if "OOM" in line), lines[0])
        return dict(spec, oom=True, phase=phase, message=message.strip()[:300])
    return dict(spec, oom=False, device=device, peak_mb=peak / MIB, current_mb=current / MIB,
                update_ms=min(times), warmup_ms=warmup_ms,
                **({} if at_peak is None else {"at_peak": at_peak, "largest_by_op": largest}),
                **_sizes(weights, trainable), **(more[0]() if more else {}))


def define_flags():
    """Defined only when run as a script, so that the bench and tests can import this."""
    cli.define("enum", "model", "convnet", "The model.", enum_values=list(models.MODELS))
    cli.define("multi_integer", "n", [8], "N, mini-batches per update; several "
               "(--n=2 --n=32) add a table of the peak's growth in N.", lower_bound=1)
    cli.define("integer", "b", 32, "B, samples per mini-batch.", lower_bound=1)
    cli.define("integer", "repeats", 3, "Probes per figure (their median).", lower_bound=1)
    cli.define("integer", "limit-mb", None, "The device's memory in MiB (default: all).",
               lower_bound=1)
    cli.define("list", "paths", list(PATHS), "Paths to measure, of: " + ", ".join(PATHS))
    cli.define("integer", "jobs", 1, "Probes at a time.", lower_bound=1)
    cli.define("bool", "gpu", False, "Measure the GPU's allocator (GPU:0), not the CPU's.")
    cli.define("bool", "profile", False, "Profile each probe's update: the tensors alive "
               "at its peak (logged).")


def main(argv):
    if len(argv) > 1:
        cli.fail(f"unexpected arguments: {' '.join(argv[1:])}")
    unknown = [p for p in FLAGS.paths if p not in PATHS]
    if unknown:
        cli.fail(f"--paths: unknown {', '.join(unknown)}; choose from {', '.join(PATHS)}")
    print(f"`{shlex.join(['python', '-m', 'tools.memory'] + sys.argv[1:])}` on "
          f"{results.machine()}\n")

    def log(line):
        print("  " + line, file=sys.stderr, flush=True)

    tables = {}
    for n in sorted(set(FLAGS.n)):
        tables[n] = table(FLAGS.model, n, FLAGS.b, FLAGS.paths, FLAGS.repeats,
                          FLAGS["limit-mb"].value, FLAGS.jobs, FLAGS.gpu, log,
                          held=max(FLAGS.n) * FLAGS.b if len(set(FLAGS.n)) > 1 else None,
                          profile=FLAGS.profile)
        print(markdown(tables[n]), flush=True)
    if len(tables) > 1:
        print(f"Growth in N at B={FLAGS.b}, peak MiB:\n")
        print(growth_markdown(growth(tables)))
    return 0


if __name__ == "__main__":
    from absl import app
    define_flags()
    app.run(main, flags_parser=cli.parse_flags)
