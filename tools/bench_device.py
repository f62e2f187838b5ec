"""Peak device memory and speed on a GPU: the sections `make bench` and `make gpu-check`
add where TensorFlow sees a GPU; without one they say "no GPU" and measure nothing.

Accumulation exists for a GPU's memory, so the number that matters is the device's peak,
not the host's RSS (bench_probes.py). At a size where activations dominate (the post's
ConvNet, N=8 x B=256): the direct batch N*B, B alone, each tf1 averager (--accumulate)
and the tf2 engine at N x B, each its engine's own direct batch and B alone beside it.
Each memory measurement is a fresh process (`python -m tools.bench_device JSON`), as the
host probes are: it trains one update untimed (tracing, cuDNN's autotuning), resets
the device's peak (`tf.config.experimental.reset_memory_stats('GPU:0')`), trains
`updates` updates and reads `get_memory_info('GPU:0')['peak']`.

Speed: the direct batch, every averager and the tf2 engine (and the tf2 engine's own
direct batch) take turns in one fresh process (bench_contenders.interleaved), ratios
paired per round.

Every process runs under op determinism, as main.py does; a probe that TensorFlow
refuses for an op without a deterministic kernel on the device is run again without it,
and says so.
"""

import json
import statistics
import subprocess
import sys

from experiment import cli
from experiment import config
from tools import common

GPU = "GPU:0"
MB = 1 << 20
FULL = dict(n=8, b=256, updates=4, speed_configs=((8, 32), (8, 256)), speed_updates=20,
            repeats=7)
QUICK = dict(n=2, b=32, updates=1, speed_configs=((2, 32),), speed_updates=2, repeats=2)
CONTENDERS = tuple(config.AVERAGERS) + ("tf2",)  # at N x B; tf2 is the tf2 engine's window
PROBE_TIMEOUT = 600


# ---------------------------------------------------------------- this machine's GPUs


def gpus():
    """The GPUs TensorFlow sees, with their details and the driver's (nvidia-smi) where
    it answers: [{name, device_name, compute_capability, driver, memory}]."""
    import tensorflow as tf
    smi = _nvidia_smi()
    out = []
    for i, gpu in enumerate(tf.config.list_physical_devices("GPU")):
        details = tf.config.experimental.get_device_details(gpu)
        row = smi[i] if i < len(smi) else {}
        out.append(dict(name=gpu.name, device_name=details.get("device_name", "?"),
                        compute_capability=".".join(
                            map(str, details.get("compute_capability") or ())) or "?",
                        driver=row.get("driver", "?"), memory=row.get("memory", "?")))
    return out


def _nvidia_smi():
    try:
        text = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
             "--format=csv,noheader"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    rows = [[cell.strip() for cell in line.split(",")] for line in text.splitlines()]
    return [dict(name=r[0], driver=r[1], memory=r[2]) for r in rows if len(r) == 3]


def build_info():
    """TensorFlow's build (tf.sysconfig.get_build_info()): CUDA, cuDNN, compute
    capabilities compiled for; as a plain dict."""
    import tensorflow as tf
    return {key: value for key, value in tf.sysconfig.get_build_info().items()}


# ---------------------------------------------------------------- the probes (fresh processes)


def _contender(label, averager, n, b, datasets):
    from tools import bench_contenders
    if averager == "tf2":
        return bench_contenders.TF2Contender(label, n, b, datasets)
    return bench_contenders.SessionContender(label, config.Config(
        average_gradients=n, batch_size=b, accumulate=averager), datasets)


def memory_probe(spec, datasets):
    """One peak-memory measurement on the device, in this (fresh) process."""
    import time

    import tensorflow as tf
    contender = _contender("probe", spec["averager"], spec["n"], spec["b"], datasets)
    try:
        contender.train(1)  # untimed: tracing, autotuning, the allocator's first chunks
        tf.config.experimental.reset_memory_stats(GPU)
        before = tf.config.experimental.get_memory_info(GPU)["current"]
        start = time.perf_counter()
        contender.train(spec["updates"])
        seconds = time.perf_counter() - start
        peak = tf.config.experimental.get_memory_info(GPU)["peak"]
    finally:
        contender.close()
    return dict(spec, before_mb=before / MB, peak_mb=peak / MB,
                increment_mb=(peak - before) / MB,
                seconds_per_update=seconds / spec["updates"])


def speed_probe(spec, datasets):
    """Every contender at (N, B), interleaved rounds, in this (fresh) process."""
    from tools import bench_contenders
    n, b = spec["n"], spec["b"]
    contenders = bench_contenders.tf1_contenders(n, b, datasets) + [  # direct, the averagers
        _contender("tf2", "tf2", n, b, datasets),
        _contender("tf2_direct", "tf2", 1, n * b, datasets)]
    try:
        times = bench_contenders.interleaved(contenders, spec["updates"], spec["repeats"])
    finally:
        for c in contenders:
            c.close()
    return dict(spec, median_ms={k: 1e3 * statistics.median(t) for k, t in times.items()},
                vs_direct={k: bench_contenders.paired_ratio(times, k, "direct") for k in times},
                tf2_vs_tf2_direct=bench_contenders.paired_ratio(times, "tf2", "tf2_direct"))


def run_probe(spec):
    """A probe process's work: op determinism as main.py sets it, MNIST, one probe."""
    cli.import_tensorflow_quietly()
    import tensorflow as tf
    if spec["deterministic"]:
        tf.config.experimental.enable_op_determinism()
    from experiment import data
    datasets = data.load_mnist()
    try:
        return (memory_probe if spec["kind"] == "memory" else speed_probe)(spec, datasets)
    except tf.errors.OpError as e:
        line = cli.missing_deterministic_kernel(e) if spec["deterministic"] else None
        return dict(spec, error=line or str(e).strip().splitlines()[0],
                    determinism=line is not None)


def probe(spec, log=print):
    """Runs `spec` in a fresh process, under op determinism; where TensorFlow has no
    deterministic kernel for it, again without (the result says `deterministic: False`
    and why)."""
    result = _spawn(dict(spec, deterministic=True))
    if result.pop("determinism", False):
        log(f"  {describe(spec)}: {result['error']}; measuring again without determinism")
        result = dict(_spawn(dict(spec, deterministic=False)),
                      determinism_error=result["error"])
        result.pop("determinism", None)
    log(f"  {describe(spec)}: " + (result.get("error") or (
        f"peak {result['peak_mb']:.0f} MB (+{result['increment_mb']:.0f} MB in training)"
        if spec["kind"] == "memory" else
        ", ".join(f"{k} {v:.1f} ms" for k, v in result["median_ms"].items()))))
    return result


def _spawn(spec):
    from tools import bench_probes  # TensorFlow: not in a probe process before its quiet import
    proc = subprocess.Popen([sys.executable, "-m", "tools.bench_device", json.dumps(spec)],
                            cwd=common.ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    return bench_probes.probe_result(spec, proc, PROBE_TIMEOUT)


def describe(spec):
    if spec["kind"] == "speed":
        return f"speed at N={spec['n']} x B={spec['b']}"
    what = spec["averager"] if spec["role"] == "accumulated" else spec["role"]
    return f"{spec['engine']} {what} N={spec['n']} B={spec['b']}"


# ---------------------------------------------------------------- the sections


def memory_specs(settings):
    """The memory probes: per engine, its direct batch and B alone, then N x B."""
    n, b, updates = settings["n"], settings["b"], settings["updates"]
    base = dict(kind="memory", updates=updates)
    specs = []
    for engine, plain, names in (("tf1", "stack", tuple(config.AVERAGERS)),
                                 ("tf2", "tf2", ("tf2",))):
        specs.append(dict(base, role="direct", engine=engine, averager=plain, n=1, b=n * b))
        specs.append(dict(base, role="alone", engine=engine, averager=plain, n=1, b=b))
        specs += [dict(base, role="accumulated", engine=engine, averager=s, n=n, b=b)
                  for s in names]
    return specs


def measure(settings, log=print, found=None):
    """The device sections, or {"gpu": None} where TensorFlow sees no GPU.

    Args:
      found: gpus(), where the caller has it already.

    Returns:
      {"gpu": [gpus()], "settings", "memory": [probe results], "speed": [probe results]}.
    """
    found = found or gpus()
    if not found:
        log("Device memory and speed: no GPU")
        return {"gpu": None}
    log(f"Device memory on {found[0]['device_name']}: N={settings['n']} x B={settings['b']}")
    memory = [probe(spec, log) for spec in memory_specs(settings)]
    log("Device speed")
    speed = [probe(dict(kind="speed", n=n, b=b, updates=settings["speed_updates"],
                        repeats=settings["repeats"]), log)
             for n, b in settings["speed_configs"]]
    return {"gpu": found, "settings": settings, "memory": memory, "speed": speed}


def memory_table(device):
    """{engine: {"direct": probe, "alone": probe, "accumulated": {averager: probe}}}."""
    table = {}
    for p in device["memory"]:
        engine = table.setdefault(p["engine"], {"accumulated": {}})
        if p["role"] == "accumulated":
            engine["accumulated"][p["averager"]] = p
        else:
            engine[p["role"]] = p
    return table


NO_GPU = ("no GPU: TensorFlow sees no GPU on this machine, so peak device memory and "
          "speed on a device were not measured (the host-memory sections stand); "
          "`make gpu-check` measures them where there is one.")


def markdown(device):
    """The device sections of BENCHMARKS.md and GPU.md."""
    lines = ["## Device memory and speed (GPU)", ""]
    if not device["gpu"]:
        return lines + [NO_GPU, ""]
    s = device["settings"]
    lines += [f"On {', '.join(g['device_name'] for g in device['gpu'])}, the post's ConvNet. "
              f"Peak device memory (`get_memory_info('{GPU}')['peak']`) while training "
              f"{s['updates']} updates, after one untimed update and "
              f"`reset_memory_stats('{GPU}')`; a fresh process each; \"before\" is the "
              "device memory in use when the peak was reset (weights, optimizer slots).", "",
              "| engine | run | N x B | peak MB | before MB | training adds MB | "
              "peak / B alone | peak / direct |", "|---|---|---|---|---|---|---|---|"]
    for engine, runs in memory_table(device).items():
        rows = [("direct", runs.get("direct")), ("B alone", runs.get("alone"))]
        rows += list(runs["accumulated"].items())
        for label, p in rows:
            if p is None:
                continue
            shape = f"{p['n']} x {p['b']}"
            if "error" in p:
                lines.append(f"| {engine} | {label} | {shape} | {p['error']} | | | | |")
                continue
            alone, direct = (runs.get(k, {}).get("peak_mb") for k in ("alone", "direct"))
            lines.append(
                f"| {engine} | {label} | {shape} | {p['peak_mb']:.1f} | {p['before_mb']:.1f} | "
                f"{p['increment_mb']:.1f} | "
                + (f"{p['peak_mb'] / alone:.2f}" if alone else "") + " | "
                + (f"{p['peak_mb'] / direct:.2f}" if direct else "") + " |")
    undeterministic = [p for p in device["memory"] + device["speed"]
                       if "determinism_error" in p]
    if undeterministic:
        lines += ["", "Measured without op determinism (TensorFlow refused it): " + "; ".join(
            f"{describe(p)} ({p['determinism_error']})" for p in undeterministic) + "."]
    labels = ["direct", *CONTENDERS, "tf2_direct"]
    lines += ["", "### Speed on the device", "",
              f"Milliseconds per update, median of {s['repeats']} interleaved rounds of "
              f"{s['speed_updates']} updates after one untimed block; the ratio is the median "
              "of the per-round ratios to `direct` (tf1, one batch of N*B). `tf2_direct`: the "
              "tf2 engine at N=1 on N*B, the tf2 window's own direct batch.", "",
              "| N x B | " + " | ".join(labels) + " | tf2 / tf2_direct |",
              "|---" * (len(labels) + 2) + "|"]
    for p in device["speed"]:
        if "error" in p:
            lines.append(f"| {p['n']} x {p['b']} | {p['error']} |")
            continue
        lines.append(f"| {p['n']} x {p['b']} | " + " | ".join(
            f"{p['median_ms'][k]:.1f} ms, {p['vs_direct'][k]['ratio']:.2f}x" for k in labels)
            + f" | {p['tf2_vs_tf2_direct']['ratio']:.2f}x |")
    return lines + [""]


if __name__ == "__main__":  # a probe: one JSON spec in, one JSON line out
    print(json.dumps(run_probe(json.loads(sys.argv[1]))))
