"""Host memory: the peak RSS of a fresh process while it trains (a probe each), at a large
effective batch against the direct batch and B alone, and as N grows.

RSS holds TensorFlow's own floor of several hundred MB beside what training adds, and
counts the host, not a device: it says little of what accumulation saves on a GPU.
"""

import resource

import numpy as np
import tensorflow as tf

from experiment import averagers
from experiment import config
from experiment import data
from experiment import engine_tf1
from tools import bench_probe
from tools.bench_contenders import SEED
from tools.bench_section import Section, Target, status, worst

MB = 1 << 20
STATUS = "/proc/self/status"
ACCUMULATED_VS_ALONE, ACCUMULATED_VS_DIRECT = 1.25, 0.25
FLAT_GRADIENTS_PER_N = 0.1  # "flat in N": what one more mini-batch may add, in gradients
FLAT = ("running", "graph", "fused", "tf2")  # the averagers that keep no window of gradients


def _proc_mb(path, field):
    """A field of /proc/self/status or /proc/meminfo (kB there), in MB; NaN if absent."""
    with open(path) as f:
        return next((int(line.split()[1]) / 1024 for line in f
                     if line.startswith(field + ":")), float("nan"))


def _reset_peak():
    """Resets the kernel's peak-RSS counter (VmHWM); False where the kernel cannot."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def rss_probe(spec):
    """Peak RSS in this probe process while it trains `updates` updates, against its RSS
    just before. It keeps only the samples it trains on, so that the 55,000 training
    images (170 MB as float32) do not hide what the averagers change."""
    tf2 = spec["averager"] == "tf2"  # the tf2 engine, its window buffered as inputs
    cfg = config.Config(average_gradients=spec["n"], batch_size=spec["b"], model=spec["model"],
                        accumulate="stack" if tf2 else spec["averager"],
                        iterations=spec["n"] * spec["updates"], engine="tf2" if tf2 else "tf1")
    import_mb = _proc_mb(STATUS, "VmRSS")  # TensorFlow imported, nothing else yet
    datasets = data.load_mnist()
    idx = data.SampleStream(len(datasets.train.labels), SEED).next_indices(
        spec["n"] * spec["b"] * spec["updates"])
    train = data.Split(datasets.train.images[idx], datasets.train.labels[idx])
    del datasets  # the full MNIST must not count in the peak
    if tf2:
        from experiment import engine_tf2  # Keras loads only in a tf2 probe
        engine = engine_tf2.Engine(cfg, SEED)
    else:
        engine = engine_tf1.Engine(cfg, SEED)
    try:
        baseline, exact = _proc_mb(STATUS, "VmRSS"), _reset_peak()
        for iteration, (images, labels) in enumerate(
                data.batches(train, SEED, cfg.batch_size, 0, cfg.iterations), 1):
            engine.step(images, labels, iteration)
        # Without the reset, the process's lifetime peak (MNIST's loading included).
        peak = _proc_mb(STATUS, "VmHWM") if exact else \
            resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    finally:
        engine.close()
    parameters = engine.net.count_params() if tf2 else sum(
        v.shape.num_elements() for v in
        engine.run_graph.graph.get_collection(tf.compat.v1.GraphKeys.TRAINABLE_VARIABLES))
    return dict(spec, import_mb=import_mb, baseline_mb=baseline, peak_mb=peak,
                increment_mb=peak - baseline, parameters=parameters)


def _probes(run, specs, jobs=1):
    out = []
    for p in bench_probe.probe_all(rss_probe, specs, jobs):
        what = f"{p['model']} {p['averager'] if p['n'] > 1 else 'direct'} N={p['n']} B={p['b']}"
        run.log(f"  {what}: " + (p.get("error") or f"peak {p['peak_mb']:.0f} MB, "
                                 f"+{p['increment_mb']:.0f} MB in training"))
        out.append(p)
    return out


class PeakMemory(Section):
    name, title = "memory", "Peak host memory at a large effective batch"
    FULL = dict(samples=16384, b=128, averagers=averagers.AVERAGERS, jobs=1)
    QUICK = dict(samples=512, b=128, averagers=("fused",), jobs=3)

    def measure(self, run):
        s, b = self.settings["samples"], self.settings["b"]
        n = s // b
        spec = lambda averager, n, b, updates: dict(  # noqa: E731
            model="convnet", averager=averager, n=n, b=b, updates=updates)
        run.log(f"Peak host memory: {s} samples direct against {n} x {b} accumulated")
        direct, alone, *accumulated = _probes(
            run, [spec("stack", 1, s, 2), spec("stack", 1, b, 2 * n)]
            + [spec(a, n, b, 2) for a in self.settings["averagers"]], self.settings["jobs"])
        return dict(samples=s, n=n, b=b, direct=direct, alone=alone,
                    accumulated={p["averager"]: p for p in accumulated})

    def targets(self, m):
        failed = any("error" in p for p in (m["direct"], m["alone"], *m["accumulated"].values()))
        peaks = {a: p["peak_mb"] for a, p in m["accumulated"].items() if "peak_mb" in p}
        ratios = lambda ref: {f"({a})": peak / m[ref]["peak_mb"] for a, peak in  # noqa: E731
                              peaks.items()} if "peak_mb" in m[ref] else {}
        return [worst(f"accumulated peak <= {ACCUMULATED_VS_ALONE}x that of B={m['b']} alone",
                      ratios("alone"), ACCUMULATED_VS_ALONE, failed=failed),
                worst(f"accumulated peak <= {ACCUMULATED_VS_DIRECT:g} of the direct batch's",
                      ratios("direct"), ACCUMULATED_VS_DIRECT, failed=failed)]

    def markdown(self, m):
        lines = [f"## {self.title}: {m['samples']} samples per update", "",
                 "The post's ConvNet; the peak RSS of a fresh process (a probe) while it trains "
                 "2 updates (B alone: as many samples), against its RSS just before training. "
                 "A probe keeps only the samples it trains on, resets the kernel's peak-RSS "
                 "counter (`/proc/self/clear_refs`), trains and reads `VmHWM`. RSS holds "
                 "TensorFlow's own floor"
                 + (f" ({m['direct']['import_mb']:.0f} MB right after importing it)"
                    if "import_mb" in m["direct"] else "")
                 + ": what training adds is the column to compare.", "",
                 "| run | N x B | peak MB | before MB | training adds MB | peak / B alone | "
                 "peak / direct |", "|---|---|---|---|---|---|---|"]
        rows = [("direct", m["direct"]), (f"B={m['b']} alone", m["alone"]),
                *m["accumulated"].items()]
        for label, p in rows:
            cells = [p.get("error", "")] if "error" in p else [
                f"{p['peak_mb']:.0f}", f"{p['baseline_mb']:.0f}", f"{p['increment_mb']:.0f}"] + [
                f"{p['peak_mb'] / m[ref]['peak_mb']:.2f}" if "peak_mb" in m[ref] else ""
                for ref in ("alone", "direct")]
            lines.append(f"| {label} | {p['n']} x {p['b']} | " + " | ".join(cells) + " |")
        return lines


def host_slope(host, averager):
    """Least-squares MB per added mini-batch over the measured N > 1, or None."""
    points = [(n, host["table"][(averager, n)]["peak_mb"]) for n in host["ns"]
              if n > 1 and "peak_mb" in host["table"].get((averager, n), {})]
    if len(points) < 2:
        return None
    ns, mbs = np.array(points, dtype=float).T
    return float(np.polyfit(ns, mbs, 1)[0])


class HostGrowth(Section):
    name, title = "host", "Host memory as N grows"
    FULL = dict(model="mlp", b=16, ns=(1, 2, 4, 8, 16, 32, 64),
                averagers=(*averagers.AVERAGERS, "tf2"))
    QUICK = None

    def measure(self, run):
        s = self.settings
        spec = lambda averager, n: dict(  # noqa: E731
            model=s["model"], averager=averager, n=n, b=s["b"], updates=1)
        run.log(f"Host memory as N grows ({s['model']}, B={s['b']})")
        (first,) = _probes(run, [spec(s["averagers"][0], 1)])  # N=1: minimize, for all
        grad_mb = 4 * first.get("parameters", float("nan")) / MB
        specs, skipped = [], {}
        for a in s["averagers"]:
            for n in s["ns"][1:]:
                # stack keeps N gradients and stacks them: about 2N copies at the apply.
                need = 1024 + (2 * n if a == "stack" else 4) * grad_mb
                if need > 0.8 * _proc_mb("/proc/meminfo", "MemAvailable"):
                    skipped[(a, n)] = f"skipped: needs ~{need / 1024:.1f} GB"
                else:
                    specs.append(spec(a, n))
        table = {(a, 1): first for a in s["averagers"]}
        table.update({(p["averager"], p["n"]): p for p in _probes(run, specs)})
        return dict(grad_mb=grad_mb, parameters=first.get("parameters", 0), ns=s["ns"],
                    averagers=s["averagers"], table=table, skipped=skipped)

    def targets(self, h):
        out = []
        for a in (a for a in FLAT if a in h["averagers"]):
            name, slope = f"host memory of {a} flat in N", host_slope(h, a)
            if slope is None:
                out.append(Target(name, "not measured", "not measured"))
                continue
            per_n = slope / h["grad_mb"]
            out.append(Target(name, f"{slope:+.1f} MB per added mini-batch ({per_n:+.3f} "
                                    "gradients)", status(per_n < FLAT_GRADIENTS_PER_N)))
        return out

    def markdown(self, h):
        lines = [f"## {self.title}", "",
                 f"`--model={self.settings['model']}` ({h['parameters']:,} parameters: one "
                 f"gradient is {h['grad_mb']:.0f} MB), B={self.settings['b']}, one update; "
                 "peak RSS in MB of a probe while it trains (at N=1 every averager is "
                 "`minimize`).", "", "| N | " + " | ".join(h["averagers"]) + " |",
                 "|---" * (len(h["averagers"]) + 1) + "|"]
        for n in h["ns"]:
            cells = [h["skipped"].get((a, n), "-") if (a, n) not in h["table"] else
                     h["table"][(a, n)].get("error") or f"{h['table'][(a, n)]['peak_mb']:.0f}"
                     for a in h["averagers"]]
            lines.append(f"| {n} | " + " | ".join(cells) + " |")
        slopes = [(a, host_slope(h, a)) for a in h["averagers"]]
        slopes = [f"{a} {m:+.1f} MB ({m / h['grad_mb']:+.3f} gradients)"
                  for a, m in slopes if m is not None]
        if slopes:
            lines += ["", "Least-squares growth per added mini-batch, over N > 1: "
                      + ", ".join(slopes) + f". Flat means under {FLAT_GRADIENTS_PER_N} "
                      "gradients; keeping the window's gradients costs at least one."]
        return lines
