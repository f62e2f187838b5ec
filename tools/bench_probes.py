"""Memory measurements, each in a fresh process (`python -m tools.bench --probe=JSON`).

A process's peak RSS is only clean in a process that did nothing else: each probe builds
its graph, trains, reads the kernel's peak-RSS counter and prints one JSON line.
"""

import json
import os
import resource
import statistics
import subprocess
import sys
import time

import tensorflow as tf

from experiment import data
from experiment import engine_tf1
from experiment import loop
from tools import bench_contenders
from tools import bench_profile
from tools import common

v1 = tf.compat.v1
MB = 1 << 20
HOST_MODEL, HOST_BATCH = "mlp", 16  # the host-memory sweep: gradients dominate memory


def _status_mb(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _reset_peak():
    """Resets the kernel's peak-RSS counter (VmHWM); False where the kernel cannot."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def run_probe(spec):
    """One memory measurement in this (fresh) process; returns a JSON-able dict.

    The probe keeps only the samples it trains on, so that the 55,000 training images
    (170 MB as float32) do not hide what the averagers change; then it measures the peak
    RSS while training `updates` updates, against the RSS just before.
    """
    tf2 = spec["averager"] == "tf2"  # the tf2 engine, its window buffered as inputs
    config = loop.Config(average_gradients=spec["n"], batch_size=spec["b"],
                         accumulate="stack" if tf2 else spec["averager"], model=spec["model"],
                         iterations=spec["n"] * spec["updates"], engine="tf2" if tf2 else "tf1")
    import_mb = _status_mb("VmRSS")  # TensorFlow imported, nothing else yet
    datasets = data.load_mnist()
    samples = spec["n"] * spec["b"] * spec["updates"]
    idx = data.SampleStream(len(datasets.train.labels),
                            bench_contenders.SEED).next_indices(samples)
    train = data.Split(datasets.train.images[idx], datasets.train.labels[idx])
    del datasets  # the full MNIST must not count in the peak
    if tf2:
        from experiment import engine_tf2  # Keras loads only in a tf2 probe
        engine = engine_tf2.Engine(config, bench_contenders.SEED)
    else:
        engine = engine_tf1.Engine(config, bench_contenders.SEED)
    try:
        batches = data.batches(train, bench_contenders.SEED, config.batch_size, 0,
                               config.iterations)
        baseline = _status_mb("VmRSS")
        exact = _reset_peak()
        start = time.perf_counter()
        for iteration, (images, labels) in enumerate(batches, 1):
            engine.step(images, labels, iteration)
        seconds = time.perf_counter() - start
        # Without the reset, the process's lifetime peak (MNIST's loading included).
        peak = _status_mb("VmHWM") if exact else \
            resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    finally:
        engine.close()
    return dict(spec, import_mb=import_mb, baseline_mb=baseline, peak_mb=peak,
                increment_mb=peak - baseline, exact_peak=exact,
                seconds_per_update=seconds / spec["updates"],
                parameters=engine.net.count_params() if tf2 else sum(
                    v.shape.num_elements() for v in
                    engine.run_graph.graph.get_collection(v1.GraphKeys.TRAINABLE_VARIABLES)))


def run_kernels_probe(spec):
    """Direct against fused, interleaved, in this process (started with oneDNN off)."""
    datasets = data.load_mnist()
    out = []
    for n, b in spec["configs"]:
        contenders = [bench_contenders.SessionContender("direct", loop.Config(
            average_gradients=1, batch_size=n * b), datasets),
            bench_contenders.SessionContender("fused", loop.Config(
                average_gradients=n, batch_size=b, accumulate="fused"), datasets)]
        times = bench_contenders.interleaved(contenders, spec["updates"], spec["repeats"])
        ops = bench_profile.profile(contenders[0], 1)["top"]
        out.append({"n": n, "b": b, "direct_ms": 1e3 * statistics.median(times["direct"]),
                    "fused_ms": 1e3 * statistics.median(times["fused"]),
                    "ratio": bench_contenders.paired_ratio(times, "fused", "direct")["ratio"],
                    "onednn_ops": any(t.startswith("_Mkl") for t, _ in ops)})
        for c in contenders:
            c.close()
    return {"kernels": out}


def spawn_probe(spec, env=None):
    return subprocess.Popen(
        [sys.executable, "-m", "tools.bench", "--probe=" + json.dumps(spec)],
        cwd=common.ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=dict(os.environ, **(env or {})))


def probe_result(spec, proc, timeout=None):
    """The probe's JSON line, or the spec with an `error`."""
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return dict(spec, error=f"probe timed out after {timeout} s")
    if proc.returncode:
        tail = (stderr.strip().splitlines() or ["no output"])[-1]
        return dict(spec, error=f"probe failed ({proc.returncode}): {tail}")
    return json.loads(stdout.strip().splitlines()[-1])


def probe_all(specs, jobs):
    """Runs each spec in a fresh `python -m tools.bench --probe` process, `jobs` at a time."""
    out, pending = {}, list(specs)
    while pending:
        batch, pending = pending[:jobs], pending[jobs:]
        procs = [(spec, spawn_probe(spec)) for spec in batch]
        for spec, proc in procs:
            key = json.dumps(spec, sort_keys=True)
            out[key] = probe_result(spec, proc)
            print(f"  probe {describe_probe(spec)}: " + (
                out[key].get("error") or f"peak {out[key]['peak_mb']:.0f} MB, "
                f"+{out[key]['increment_mb']:.0f} MB in training"), flush=True)
    return out


def describe_probe(spec):
    s = spec["averager"] if spec["n"] > 1 else "direct"
    return f"{spec['model']} {s} N={spec['n']} B={spec['b']}"


def mem_available_mb():
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 1024
    return float("inf")
