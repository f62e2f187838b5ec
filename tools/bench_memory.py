"""Host memory as N grows: a probe's peak RSS over one update, for what a device's allocator
does not see (the numpy windows of the `stack` and `running` averagers)."""

import numpy as np

import model
from experiment import averagers
from experiment import data
from tools import bench_probe
from tools import models
from tools.bench_contenders import SessionContender
from tools.bench_section import Section
from tools.bench_section import Target
from tools.bench_section import status
from tools.bench_section import table

MB = 1 << 20
STATUS = "/proc/self/status"
FLAT_GRADIENTS_PER_N = 0.1  # "flat in N": what one more mini-batch may add, in gradients
FLAT = ("running", "graph", "fused", "tf2")  # the averagers that keep no window of gradients


def _proc_mb(path, field):
    """A field of /proc/self/status or /proc/meminfo (kB there), in MB; NaN if absent."""
    with open(path) as f:
        return next((int(line.split()[1]) / 1024 for line in f
                     if line.startswith(field + ":")), float("nan"))


def rss_probe(spec):
    """Peak RSS over `updates` updates against the RSS just before, only the samples it trains
    on kept (MNIST's 170 MB would hide the window)."""
    datasets = data.load_mnist()
    idx = data.SampleStream(len(datasets.train.labels), models.SEED).next_indices(
        spec["n"] * spec["b"] * spec["updates"])
    train = data.Split(datasets.train.images[idx], datasets.train.labels[idx])
    del datasets  # the full MNIST must not count in the peak
    contender = SessionContender("probe", spec["n"], spec["b"], train, spec["averager"],
                                 spec["model"])
    try:
        baseline = _proc_mb(STATUS, "VmRSS")
        with open("/proc/self/clear_refs", "w") as f:  # the peak (VmHWM) reset to now
            f.write("5")
        contender.train(spec["updates"])
        peak = _proc_mb(STATUS, "VmHWM")
    finally:
        contender.close()
    return dict(spec, baseline_mb=baseline, peak_mb=peak, increment_mb=peak - baseline)


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
                averagers=(*averagers.AVERAGERS, "tf2"), jobs=1)
    QUICK = dict(model="mlp", b=16, ns=(1, 2, 4), averagers=("fused",), jobs=3)

    def measure(self, run):
        s = self.settings
        run.log(f"Host memory as N grows ({s['model']}, B={s['b']})")
        grad_mb = 4 * model.keras_model(s["model"]).count_params() / MB
        runs, skipped = [(s["averagers"][0], 1)], {}  # N=1 is `minimize` for all: once
        for a in s["averagers"]:
            for n in s["ns"][1:]:
                # stack keeps N gradients and stacks them: about 2N copies at the apply.
                need = 1024 + (2 * n if a == "stack" else 4) * grad_mb
                if need > 0.8 * _proc_mb("/proc/meminfo", "MemAvailable"):
                    skipped[(a, n)] = f"skipped: needs ~{need / 1024:.1f} GB"
                else:
                    runs.append((a, n))
        table = {}
        for p in bench_probe.probe_all(rss_probe, [dict(
                model=s["model"], averager=a, n=n, b=s["b"], updates=1) for a, n in runs],
                s["jobs"]):
            run.log(f"  {p['averager']} N={p['n']}: " + (p.get("error") or (
                f"peak {p['peak_mb']:.0f} MB, +{p['increment_mb']:.0f} MB in training")))
            table[(p["averager"], p["n"])] = p
        table.update({(a, 1): table[runs[0]] for a in s["averagers"]})
        return dict(grad_mb=grad_mb, ns=s["ns"], averagers=s["averagers"], table=table,
                    skipped=skipped)

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
        def cell(a, n):
            p = h["table"].get((a, n))
            return h["skipped"].get((a, n), "-") if p is None else (
                p.get("error") or f"{p['peak_mb']:.0f}")

        slopes = [(a, host_slope(h, a)) for a in h["averagers"]]
        return self.heading(
            f"`--model={self.settings['model']}` (one gradient is {h['grad_mb']:.0f} MB), "
            f"B={self.settings['b']}, one update; peak RSS in MB of a probe while it trains "
            "(at N=1 every averager is `minimize`).") + table(
            ("N", *h["averagers"]), [(n, *(cell(a, n) for a in h["averagers"])) for n in h["ns"]]
        ) + ["", "Least-squares growth per added mini-batch, over N > 1: " + ", ".join(
            f"{a} {m:+.1f} MB ({m / h['grad_mb']:+.3f} gradients)" for a, m in slopes
            if m is not None) + f". Flat means under {FLAT_GRADIENTS_PER_N} gradients; keeping "
            "the window's gradients costs at least one."]
