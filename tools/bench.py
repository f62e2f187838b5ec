"""Benchmarks the averagers and writes BENCHMARKS.md.

    python -m tools.bench            # the full benchmark (README gives how long)
    python -m tools.bench --quick    # a smoke test: every section scaled down, no host sweep

Accumulation exists to save memory, so it must not cost speed; this measures both, in
one run, on this machine:
  * speed: training seconds per update (no evaluation) of the direct batch N*B, of each
    averager at N x B, of Keras 3's built-in `gradient_accumulation_steps` and of the tf2
    engine, for the post's four (N, B). The contenders take turns (round robin, rotating
    who goes first), so drift of a shared machine hits them alike; ratios are paired per
    round, and at N=1, where every averager is the same graph, they show the noise.
  * a profile of each (tf.profiler, one block of updates), to say where the time goes,
    and fused against direct again on Eigen kernels (oneDNN off, a fresh process);
  * peak memory, each measurement in a fresh process (`--probe`): a large effective
    batch direct against accumulated, and the host memory of each averager as N grows.
  * on a GPU, peak device memory and speed (bench_device.py); without one, "no GPU".
Each target is printed and written as met or missed, with its ratio, and the
ratios are drawn into a PNG next to the markdown (BENCHMARKS.png), which links it. On a
terminal, stderr shows a bar of the measurements done and the time left.

This file drives the sections; the contenders and their timing (bench_contenders.py), the
profile (bench_profile.py), the memory probes (bench_probes.py), the targets
(bench_targets.py) and the markdown (bench_report.py) live beside it.
"""

import json
import os
import shlex
import statistics
import time

from experiment import cli

cli.import_tensorflow_quietly()  # first: its C++ start-up lines would reach stderr

import tensorflow as tf  # noqa: E402
from absl import app  # noqa: E402
from absl import flags  # noqa: E402

from experiment import data  # noqa: E402
from experiment import progress  # noqa: E402
from experiment import results  # noqa: E402
from experiment import averagers  # noqa: E402
from tools import bench_contenders  # noqa: E402
from tools import bench_device  # noqa: E402
from tools import bench_keras_fit  # noqa: E402
from tools import bench_probes  # noqa: E402
from tools import bench_profile  # noqa: E402
from tools import bench_report  # noqa: E402
from tools import bench_targets  # noqa: E402
from tools import bench_tf1_wrapper  # noqa: E402
from tools import figures  # noqa: E402
from tools.bench_probes import HOST_BATCH, HOST_MODEL  # noqa: E402

FLAGS = flags.FLAGS

CONFIGS = ((1, 100), (5, 20), (10, 10), (20, 5))  # the post's (N, B)
# Speed: a measurement is a block of UPDATES updates, after one untimed block.
FULL = dict(configs=CONFIGS, updates=20, repeats=7, keras_setup=True, mem_samples=16384,
            mem_batch=128, host_ns=(1, 2, 4, 8, 16, 32, 64),
            host_averagers=averagers.AVERAGERS + ("tf2",),
            mem_averagers=averagers.AVERAGERS, probe_jobs=1)
# Quick: a smoke test of every code path, each fresh process (TensorFlow's and MNIST's
# start-up) counted; no host-memory sweep (its probe is the memory probes' code
# on another model).
QUICK = dict(configs=((5, 20),), updates=1, repeats=2, keras_setup=False, mem_samples=512,
             mem_batch=128, host_ns=(), host_averagers=("stack",),
             mem_averagers=("fused",), probe_jobs=3)

cli.define("bool", "quick", False,
           "Every section scaled down, without the host-memory sweep (a smoke test).")
cli.define("string", "output", "BENCHMARKS.md", "Markdown file to write.")
cli.define("string", "probe", None, "Internal: one memory measurement, as JSON; prints JSON.")


# ---------------------------------------------------------------- the sections


def keras_setup_section(datasets, settings, n=5, b=20):
    """Keras used plainly (a call per mini-batch) against one compiled call per update."""
    updates = settings["updates"]
    modes = {label: kw for label, kw in bench_contenders.keras_modes(n, updates).items()
             if not label.endswith("U")}
    contenders = [bench_contenders.KerasContender(label, n, b, datasets, **kw)
                  for label, kw in modes.items()]
    times = bench_contenders.interleaved(contenders, updates, max(2, settings["repeats"] // 2))
    medians = {label: statistics.median(t) for label, t in times.items()}
    print(f"Keras at N={n} x B={b}: " + ", ".join(
        f"{label}: {1e3 * s:.1f} ms" for label, s in medians.items()), flush=True)
    return {"n": n, "b": b, "medians": medians}


def speed_section(datasets, settings, measured=lambda: None):
    """One row per (N, B); `measured` is called after each."""
    rows = []
    for n, b in settings["configs"]:
        print(f"Speed at N={n} x B={b} (direct: B={n * b})", flush=True)
        contenders = bench_contenders.tf1_contenders(n, b, datasets)
        modes = bench_contenders.keras_modes(n, settings["updates"])
        contenders += [bench_contenders.KerasContender(label, n, b, datasets, **modes[mode])
                       for label, mode in bench_contenders.KERAS_CONTENDERS.items()]
        contenders.append(bench_contenders.TF2Contender("tf2", n, b, datasets))
        keras_fit = bench_keras_fit.KerasFitContender(n, b, datasets)  # timed, kept apart
        times = bench_contenders.interleaved(contenders + [keras_fit], settings["updates"],
                                             settings["repeats"])
        keras_fit_row = bench_keras_fit.split_times(times)
        profiles = {c.label: bench_profile.profile(c, settings["updates"]) for c in contenders}
        for c in contenders:
            c.close()
        keras_best, keras_ratio = bench_contenders.keras_vs_fused(times)
        row = {"n": n, "b": b, "times": times, "profiles": profiles, "keras_best": keras_best,
               "median_ms": {k: 1e3 * statistics.median(t) for k, t in times.items()},
               "vs_direct": {k: bench_contenders.paired_ratio(times, k, "direct") for k in times},
               "vs_stack": {k: bench_contenders.paired_ratio(times, k, "stack") for k in times},
               "keras_vs_fused": keras_ratio, bench_keras_fit.LABEL: keras_fit_row}
        print("  " + ", ".join(f"{k}: {row['median_ms'][k]:.1f} ms "
                               f"({row['vs_direct'][k]['ratio']:.2f}x)" for k in times),
              flush=True)
        rows.append(row)
        measured()
    return rows


def kernels_section(settings):
    """The fused/direct comparison again, on TensorFlow's Eigen kernels instead of
    oneDNN's (TF_ENABLE_ONEDNN_OPTS=0 only acts at start-up: a fresh process)."""
    configs = [c for c in settings["configs"] if c in bench_targets.FUSED_LIMITS]
    if not configs:
        return None
    spec = {"kernels": True, "configs": configs, "updates": settings["updates"],
            "repeats": settings["repeats"]}
    print("Fused against direct with oneDNN off", flush=True)
    result = bench_probes.probe_result(
        spec, bench_probes.spawn_probe(spec, {"TF_ENABLE_ONEDNN_OPTS": "0"}))
    print("  " + (result.get("error") or ", ".join(
        f"N={r['n']} x B={r['b']}: {r['ratio']:.2f}x" for r in result["kernels"])), flush=True)
    return result


def memory_section(settings):
    """Direct batch of S samples against B x (S/B) accumulated, and against B alone."""
    s, b = settings["mem_samples"], settings["mem_batch"]
    n = s // b
    direct = dict(model="convnet", averager="stack", n=1, b=s, updates=2)
    small = dict(model="convnet", averager="stack", n=1, b=b, updates=2 * n)
    accumulated = [dict(model="convnet", averager=k, n=n, b=b, updates=2)
                   for k in settings["mem_averagers"]]
    print(f"Peak memory: {s} samples direct against {n} x {b} accumulated", flush=True)
    out = bench_probes.probe_all([direct, small] + accumulated, settings["probe_jobs"])
    get = lambda spec: out[json.dumps(spec, sort_keys=True)]  # noqa: E731
    return {"samples": s, "n": n, "b": b, "direct": get(direct), "small": get(small),
            "accumulated": {spec["averager"]: get(spec) for spec in accumulated}}


def host_memory_section(settings):
    """Peak RSS of each averager as N grows, on a model whose gradients dominate memory."""
    params = 784 * 4096 + 4096 + 4096 * 4096 + 4096 + 4096 * 10 + 10
    grad_mb = 4 * params / bench_probes.MB
    specs, skipped = [], {}
    for averager in settings["host_averagers"]:
        for n in settings["host_ns"]:
            if n == 1 and averager != settings["host_averagers"][0]:
                continue  # N=1 is `minimize` whatever the averager: measured once
            spec = dict(model=HOST_MODEL, averager=averager, n=n, b=HOST_BATCH, updates=1)
            # stack keeps N gradients and stacks them: about 2N copies at the apply.
            need = 1024 + (2 * n * grad_mb if averager == "stack" else 4 * grad_mb)
            if need > 0.8 * bench_probes.mem_available_mb():
                skipped[(averager, n)] = f"skipped: needs ~{need / 1024:.1f} GB, " \
                    f"{bench_probes.mem_available_mb() / 1024:.1f} GB available"
            else:
                specs.append(spec)
    print(f"Host memory as N grows ({HOST_MODEL}, B={HOST_BATCH})", flush=True)
    out = bench_probes.probe_all(specs, settings["probe_jobs"])
    table = {(spec["averager"], spec["n"]): out[json.dumps(spec, sort_keys=True)]
             for spec in specs}
    for averager in settings["host_averagers"]:
        if (settings["host_averagers"][0], 1) in table:
            table[(averager, 1)] = table[(settings["host_averagers"][0], 1)]
    return {"grad_mb": grad_mb, "params": params, "table": table, "skipped": skipped,
            "ns": settings["host_ns"], "averagers": settings["host_averagers"]}


# ---------------------------------------------------------------- the run


def measure(datasets, settings, measured, lap):
    """Every section: (keras_setup, speed, kernels, memory, host memory); `measured` is
    called after each section, and after each (N, B) of the speed section."""
    keras_setup = None
    if settings["keras_setup"]:
        keras_setup = keras_setup_section(datasets, settings)
        lap("Keras used plainly")
        measured()
    speed = speed_section(datasets, settings, measured)
    lap("speed")
    kernels = kernels_section(settings)
    lap("oneDNN off")
    measured()
    mem = memory_section(settings)
    lap("peak memory")
    measured()
    host = None
    if settings["host_ns"]:
        host = host_memory_section(settings)
        lap("host memory")
        measured()
    return keras_setup, speed, kernels, mem, host


def main_bench(argv):
    if len(argv) > 1:
        cli.fail(f"unexpected arguments: {' '.join(argv[1:])}")
    if FLAGS.probe:
        try:
            spec = json.loads(FLAGS.probe)
        except json.JSONDecodeError as e:
            cli.fail(f"--probe: not JSON ({e})")
        print(json.dumps(bench_probes.run_kernels_probe(spec) if spec.get("kernels")
                         else bench_probes.run_probe(spec)))
        return
    output = FLAGS.output
    try:
        results.check_writable(output, "--output")
    except results.ResultsError as e:
        cli.fail(str(e))
    settings = QUICK if FLAGS.quick else FULL
    command = "python -m tools.bench" + (" --quick" if FLAGS.quick else "") + (
        f" --output={shlex.quote(output)}" if output != "BENCHMARKS.md" else "")
    start = last = time.perf_counter()

    def lap(section):
        nonlocal last
        now = time.perf_counter()
        print(f"({section}: {now - last:.0f} s)", flush=True)
        last = now

    try:
        datasets = data.load_mnist()
    except data.DataError as e:
        cli.fail(str(e))
    lap("MNIST")
    # The bar counts sections, a (N, B) of the speed section each: enough to see where
    # the bench is and, roughly, how long is left.
    steps = (bool(settings["keras_setup"]) + len(settings["configs"]) + 2
             + bool(settings["host_ns"]))
    with progress.Bar(steps, "bench", unit="measurement") as bar, bar.printing_through():
        keras_setup, speed, kernels, mem, host = measure(datasets, settings, bar.update, lap)
    wrapper = bench_tf1_wrapper.measure(  # AveragingOptimizer against the plain optimizer
        bench_tf1_wrapper.QUICK if FLAGS.quick else bench_tf1_wrapper.FULL)
    lap("AveragingOptimizer")
    device = bench_device.measure(  # on a GPU: its peak memory and speed ("no GPU" without)
        bench_device.QUICK if FLAGS.quick else bench_device.FULL)
    lap("device")
    targets = (bench_targets.evaluate_targets(speed, mem, host, kernels)
               + bench_keras_fit.targets(speed))
    targets += bench_tf1_wrapper.targets(wrapper) + bench_targets.device_targets(device)
    bench_report.print_targets(targets)
    figure = os.path.splitext(output)[0] + ".png"
    try:
        png = figures.png_bytes(figures.bench_figure(speed, mem, host)[0])
        drawn = os.path.basename(figure)
    except ValueError as e:  # nothing measured that a figure could show
        png = drawn = None
        print(f"{figure} not drawn: {e}")
    text = bench_report.render(command, settings, speed, keras_setup, mem, host, targets,
                               time.perf_counter() - start, kernels, figure=drawn)
    text += "\n" + bench_tf1_wrapper.markdown(wrapper, command)
    text += "\n" + "\n".join(bench_device.markdown(device))
    try:
        bench_report.write(output, text, figure, png)
    except results.WriteError as e:
        cli.fail(str(e), code=1)
    print(f"\nWrote {output}" + (f" and {figure}" if drawn else "")
          + f" in {(time.perf_counter() - start) / 60:.1f} minutes.")


if __name__ == "__main__":
    from absl import logging
    logging.set_verbosity(logging.WARNING)
    tf.config.experimental.enable_op_determinism()  # as main.py trains
    app.run(main_bench, flags_parser=cli.parse_flags)
