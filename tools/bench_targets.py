"""The project's targets, each judged from this run's measurements and, where missed,
explained from its profile: what it asks, what was measured, met / within noise / missed.
"""

import numpy as np

from experiment import averagers
from tools import bench_device
from tools import bench_probes
from tools.bench_contenders import paired_ratio

# The targets.
FUSED_LIMITS = {(5, 20): 1.15, (20, 5): 1.5}
KERAS_SPEEDUP = 2.0
ACCUMULATED_VS_SMALL, ACCUMULATED_VS_DIRECT = 1.25, 0.25
FLAT_GRADIENTS_PER_N = 0.1  # host memory "flat in N": what one more mini-batch may add
TF2_VS_FUSED = 1.15  # the tf2 engine's window against tf1's fused, at the FUSED_LIMITS configs
# On a GPU (bench_device.py): device memory at N x B against B alone and the direct batch
# of N*B, and time against the direct batch's at every B of at least DEVICE_SPEED_MIN_B.
DEVICE_VS_ALONE, DEVICE_VS_DIRECT = 1.1, 0.3
DEVICE_SPEED, DEVICE_SPEED_MIN_B = 1.1, 32


def _classes_delta(slow, fast):
    """Op classes sorted by how much more kernel time `slow` spends than `fast`."""
    classes = set(slow["kernel_ms"]) | set(fast["kernel_ms"])
    return sorted(classes, key=lambda c: fast["kernel_ms"].get(c, 0) - slow["kernel_ms"].get(c, 0))


def _class_line(cls, a, b, la, lb):
    ka, kb = a["kernel_ms"].get(cls, 0.0), b["kernel_ms"].get(cls, 0.0)
    ca, cb = a["calls"].get(cls, 0.0), b["calls"].get(cls, 0.0)
    per = lambda k, c: f"{1e3 * k / c:.0f} us" if c else "-"  # noqa: E731
    return (f"{cls} {ka:.2f} ms in {ca:.0f} calls ({per(ka, ca)} a call) for {la} against "
            f"{kb:.2f} ms in {cb:.0f} calls ({per(kb, cb)}) for {lb}")


def explain_profile(row, slow, fast, per_call=False):
    """A measured account of why `slow` takes longer than `fast` at this configuration.

    Wall times are the timed rounds' medians (tracing slows some contenders more than
    others); kernel times come from the profile. `per_call`: `slow` runs the kernels of
    `fast` on 1/N of the samples N times; say what a call costs.
    """
    a, b = row["profiles"][slow], row["profiles"][fast]
    wa, wb = row["median_ms"][slow], row["median_ms"][fast]
    ka, kb = sum(a["kernel_ms"].values()), sum(b["kernel_ms"].values())
    order = _classes_delta(a, b)
    text = (f"Profile at N={row['n']} x B={row['b']} (tf.profiler over one block of updates; "
            f"kernel time per update, summed over threads): {slow} {wa:.1f} ms wall, "
            f"{ka:.1f} ms in kernels; {fast} {wb:.1f} ms wall, {kb:.1f} ms in "
            f"kernels. Largest differences: "
            + "; ".join(_class_line(c, a, b, slow, fast) for c in order[:3]) + ".")
    top = order[0]
    ca, cb = a["calls"].get(top, 0), b["calls"].get(top, 0)
    if per_call and ca > cb > 0 and b["kernel_ms"].get(top):
        per_a, per_b = a["kernel_ms"][top] / ca, b["kernel_ms"][top] / cb
        text += (f" The {top} kernels run {ca / cb:.0f}x as often on {cb / ca:.2g} of the "
                 f"samples each; one call costs {per_a / per_b:.2f} of a call on all of them, "
                 f"so per update they cost {a['kernel_ms'][top] / b['kernel_ms'][top]:.2f}x")
        text += (": a cost per call that does not shrink with the batch." if
                 per_a / per_b > 1.2 * cb / ca else ".")
    dw, dk = wa - wb, ka - kb
    text += f" Wall time differs by {dw:+.1f} ms per update, kernel time by {dk:+.1f} ms"
    text += (": most of the difference is outside the kernels (session or function calls, "
             "Python, feeding, the input pipeline)." if dk < dw / 2 else ".")
    return text


def explain_fused(row, kernels=None):
    """Why fused trails the direct batch, with `stack` as the reference that runs the same
    mini-batch kernels one mini-batch at a time, and the same pair on Eigen kernels."""
    text = explain_profile(row, "fused", "direct", per_call=True)
    profiles = row["profiles"]
    if "stack" in profiles:
        ks, kd, kf = (sum(profiles[k]["kernel_ms"].values()) for k in ("stack", "direct", "fused"))
        text += (f" For reference, `stack` runs the same mini-batch kernels one mini-batch "
                 f"at a time: {ks:.1f} ms of kernels per update against direct's {kd:.1f} "
                 f"({ks / kd:.2f}x); fused's {kf:.1f} ms are measured with two mini-batches "
                 f"sharing the cores.")
    eigen = [k for k in (kernels or {}).get("kernels", [])
             if (k["n"], k["b"]) == (row["n"], row["b"]) and not k["onednn_ops"]]
    if eigen:
        k = eigen[0]
        text += (f" The check: with oneDNN off (TF_ENABLE_ONEDNN_OPTS=0, TensorFlow's Eigen "
                 f"kernels, a separate process), fused took {k['ratio']:.2f}x direct here, "
                 f"direct itself {k['direct_ms']:.1f} ms against {row['median_ms']['direct']:.1f} "
                 f"with oneDNN, fused {k['fused_ms']:.1f} against "
                 f"{row['median_ms']['fused']:.1f}: the gap follows the kernels' cost per call.")
    return text


def explain_keras(row):
    """Why fused is not KERAS_SPEEDUP times faster than Keras at this configuration."""
    keras = row["keras_best"]
    slow, fast = (keras, "fused") if row["median_ms"][keras] >= row["median_ms"]["fused"] \
        else ("fused", keras)
    kk, kf = (sum(row["profiles"][k]["kernel_ms"].values()) for k in (keras, "fused"))
    text = (explain_profile(row, slow, fast) + f" Kernel time per update: {keras} "
            f"{kk:.1f} ms, fused {kf:.1f} ms ({kk / kf:.2f}x).")
    if kk < 1.5 * kf:
        text += (f" Keras too runs its loop in one compiled call here; with kernel times "
                 f"this close, fused could be {KERAS_SPEEDUP:g}x faster only if Keras spent "
                 f"more time outside its kernels than fused spends in all.")
    return text


def _status(ok, noisy=False):
    return "met" if ok else ("within noise" if noisy else "missed")


def _judged(target, measured, ok, why):
    """One target's row: met or missed, and the reason only where it was missed."""
    return dict(target=target, measured=measured, status=_status(ok), why=None if ok else why)


def table_lines(targets):
    """The markdown of the targets: a table, target, measured and status."""
    return (["## Targets", "", "| target | measured | status |", "|---|---|---|"]
            + [f"| {t['target']} | {t['measured']} | {t['status']} |" for t in targets])


def missed_lines(targets):
    """The markdown of why targets were missed, for those that say; [] if none does."""
    whys = [t for t in targets if t.get("why")]
    if not whys:
        return []
    return (["", "### Why targets were missed", ""]
            + [f"- **{t['target']}** ({t['status']}). {t['why']}" for t in whys])


def noise_floor(speed):
    """How far apart identical graphs came out in this run, or None.

    At N=1 every averager builds the post's `minimize`, the same graph as `direct`: their
    ratios to it differ from 1 by noise alone.
    """
    for row in speed:
        if row["n"] == 1:
            return max(abs(row["vs_direct"][s]["ratio"] - 1) for s in averagers.AVERAGERS)
    return None


def evaluate_targets(speed, mem, host, kernels=None):
    """Each target: what it asks, the measured value, met / within noise / missed, why."""
    rows = {(r["n"], r["b"]): r for r in speed}
    noise = noise_floor(speed)
    targets = []
    for (n, b), limit in FUSED_LIMITS.items():
        name = f"fused <= {limit}x direct at N={n}/B={b}"
        if (n, b) not in rows:
            targets.append(dict(target=name, measured="not measured", status="not measured"))
            continue
        r = rows[(n, b)]["vs_direct"]["fused"]
        ok = r["ratio"] <= limit
        targets.append(dict(target=name, measured=f"{r['ratio']:.2f}x", status=_status(ok),
                            why=None if ok else f"Missed by {r['ratio'] / limit - 1:.0%}. "
                            + explain_fused(rows[(n, b)], kernels)))
    accumulating = [r for r in speed if r["n"] > 1]  # at N=1 every averager is minimize
    for s in ("running", "graph", "fused"):
        if not accumulating:
            break
        worst = max(accumulating, key=lambda r: r["vs_stack"][s]["ratio"])
        r = worst["vs_stack"][s]
        ok = r["ratio"] <= 1.0
        noisy = r["q1"] <= 1.0 or (noise is not None and r["ratio"] - 1 <= noise)
        why = None
        if not ok:
            why = (f"{s} at N={worst['n']}/B={worst['b']}: {r['ratio']:.3f}x stack (paired "
                   f"rounds, quartiles {r['q1']:.3f}-{r['q3']:.3f}"
                   + (f"; identical graphs differed by up to {noise:.0%} in this run"
                      if noise is not None else "")
                   + ("; so this run cannot tell the two apart). " if noisy else "). ")
                   + explain_profile(worst, s, "stack"))
        targets.append(dict(target=f"{s} never slower than stack (N > 1)",
                            measured=f"worst {r['ratio']:.2f}x at N={worst['n']}/B={worst['b']}",
                            status=_status(ok, noisy), why=why))
    if speed:
        worst = min(speed, key=lambda r: r["keras_vs_fused"]["ratio"])
        r = worst["keras_vs_fused"]
        ok = r["ratio"] >= KERAS_SPEEDUP
        targets.append(dict(
            target=f"fused >= {KERAS_SPEEDUP:g}x faster than Keras's accumulation, every (N, B)",
            measured=f"worst {r['ratio']:.2f}x at N={worst['n']}/B={worst['b']}",
            status=_status(ok),
            why=None if ok else f"Missed by {1 - r['ratio'] / KERAS_SPEEDUP:.0%} at "
            f"N={worst['n']}/B={worst['b']} (Keras as `{worst['keras_best']}`, the faster "
            f"there). " + explain_keras(worst)))
    targets += tf2_targets(speed)
    if mem:
        targets += memory_targets(mem)
    if host:
        targets += host_targets(host)
    return targets


def tf2_targets(speed):
    """The tf2 engine against tf1's fused (paired rounds) and against Keras's faster
    accumulation, in the same run."""
    rows = {(r["n"], r["b"]): r for r in speed if "tf2" in r["times"]}
    out = []
    for n, b in FUSED_LIMITS:
        name = f"tf2 <= {TF2_VS_FUSED}x fused at N={n}/B={b}"
        if (n, b) not in rows:
            out.append(dict(target=name, measured="not measured", status="not measured"))
            continue
        row = rows[(n, b)]
        r = paired_ratio(row["times"], "tf2", "fused")
        out.append(_judged(name, f"{r['ratio']:.2f}x", r["ratio"] <= TF2_VS_FUSED,
                           f"Missed by {r['ratio'] / TF2_VS_FUSED - 1:.0%} (paired rounds, "
                           f"quartiles {r['q1']:.2f}-{r['q3']:.2f}). "
                           + explain_profile(row, "tf2", "fused")))
    # "keras": Keras's accumulation with steps_per_execution=N (bench_contenders.
    # KERAS_CONTENDERS), one compiled call per update.
    ratios = {key: paired_ratio(row["times"], "tf2", "keras")
              for key, row in rows.items() if row["n"] > 1}
    if ratios:
        key = max(ratios, key=lambda k: ratios[k]["ratio"])
        worst, r = rows[key], ratios[key]
        out.append(_judged(
            "tf2 faster than Keras's accumulation with steps_per_execution=N (N > 1)",
            f"worst {r['ratio']:.2f}x Keras at N={worst['n']}/B={worst['b']}", r["ratio"] < 1.0,
            f"tf2 took {r['ratio']:.2f}x Keras's time at N={worst['n']}/B={worst['b']}. "
            + explain_profile(worst, "tf2", "keras")))
    return out


def memory_targets(mem):
    """Peak RSS accumulated against B alone and against the direct batch of N*B."""
    small, direct = mem["small"], mem["direct"]
    usable = {s: p for s, p in mem["accumulated"].items() if "error" not in p}
    if "error" in small or "error" in direct or not usable:
        return [dict(target="peak memory at the large effective batch", measured="probe failed",
                     status="missed", why=small.get("error") or direct.get("error"))]
    worst = max(usable, key=lambda s: usable[s]["peak_mb"])
    p = usable[worst]
    ratio_small, ratio_direct = p["peak_mb"] / small["peak_mb"], p["peak_mb"] / direct["peak_mb"]
    feed_mb = mem["samples"] * 784 * 4 / bench_probes.MB
    return [
        _judged(f"accumulated peak <= {ACCUMULATED_VS_SMALL}x that of B={mem['b']} alone",
                f"worst {ratio_small:.2f}x ({worst})", ratio_small <= ACCUMULATED_VS_SMALL,
                f"{worst} peaked at {p['peak_mb']:.0f} MB against {small['peak_mb']:.0f} MB "
                f"for B={mem['b']} alone: +{p['increment_mb']:.0f} MB over its RSS before "
                f"training against +{small['increment_mb']:.0f} MB. For scale, the window's "
                f"{mem['samples']} images are {feed_mb:.0f} MB as float32."),
        _judged(f"accumulated peak <= {ACCUMULATED_VS_DIRECT:g} of the direct batch's",
                f"worst {ratio_direct:.2f} ({worst})", ratio_direct <= ACCUMULATED_VS_DIRECT,
                f"A fixed floor decides it: RSS before training was {p['baseline_mb']:.0f} "
                f"MB ({p['import_mb']:.0f} MB of it right after importing TensorFlow), more "
                f"than a quarter of the direct batch's {direct['peak_mb']:.0f} MB peak. What "
                f"training adds is +{p['increment_mb']:.0f} MB accumulated against "
                f"+{direct['increment_mb']:.0f} MB direct "
                f"({p['increment_mb'] / max(direct['increment_mb'], 1e-9):.3f})."),
    ]


def host_slope(host, averager):
    """Least-squares MB per added mini-batch over the measured N > 1, or None."""
    points = [(n, host["table"][(averager, n)]["peak_mb"]) for n in host["ns"]
              if n > 1 and "peak_mb" in host["table"].get((averager, n), {})]
    if len(points) < 2:
        return None
    ns, mbs = np.array(points, dtype=float).T
    return float(np.polyfit(ns, mbs, 1)[0])


def host_targets(host):
    """Flat in N: less than FLAT_GRADIENTS_PER_N gradients more per added mini-batch
    (an averager that keeps the window's gradients adds at least one per mini-batch)."""
    out = []
    for s in ("running", "graph", "fused", "tf2"):
        if s not in host["averagers"]:
            continue
        slope = host_slope(host, s)
        if slope is None:
            out.append(dict(target=f"host memory of {s} flat in N", measured="not measured",
                            status="not measured"))
            continue
        per_n = slope / host["grad_mb"]
        out.append(_judged(
            f"host memory of {s} flat in N",
            f"{slope:+.1f} MB per added mini-batch ({per_n:+.3f} gradients)",
            per_n < FLAT_GRADIENTS_PER_N,
            f"{s} grew by {slope:.1f} MB per added mini-batch, {per_n:.2f} of a gradient "
            f"({host['grad_mb']:.0f} MB): more than {FLAT_GRADIENTS_PER_N} gradients per "
            "mini-batch."))
    return out


def device_targets(device):
    """On a GPU (bench_device.measure): each engine's accumulated peak device memory
    against its own B alone and direct batch, and the time of fused and of the tf2 window
    against their engine's direct batch at B >= DEVICE_SPEED_MIN_B. Without a GPU each is
    "not measured", its measured value "no GPU"."""
    b = DEVICE_SPEED_MIN_B
    names = [f"accumulated device peak <= {DEVICE_VS_ALONE}x that of B alone",
             f"accumulated device peak <= {DEVICE_VS_DIRECT:g} of the direct batch's",
             f"fused <= {DEVICE_SPEED}x the direct batch's time on the device, B >= {b}",
             f"tf2 <= {DEVICE_SPEED}x the tf2 direct batch's time on the device, B >= {b}"]
    if not device["gpu"]:
        return [dict(target=name, measured="no GPU", status="not measured") for name in names]
    return (_device_memory_targets(bench_device.memory_table(device), names[:2])
            + _device_speed_targets(device["speed"], names[2:]))


def _device_memory_targets(table, names):
    measured, failed = [], []
    for engine, runs in table.items():
        for averager, p in runs["accumulated"].items():
            probes = {"accumulated": p, "alone": runs.get("alone", {}),
                      "direct": runs.get("direct", {})}
            bad = [q.get("error", "not measured") for q in probes.values() if "peak_mb" not in q]
            if bad:
                failed.append(f"{engine} {averager}: {bad[0]}")
            else:
                measured.append((f"{engine} {averager}", probes))
    if not measured:
        return [dict(target=name, measured="probe failed", status="missed",
                     why="; ".join(failed)) for name in names]
    out = []
    for name, base, limit, what in ((names[0], "alone", DEVICE_VS_ALONE, "B alone"),
                                    (names[1], "direct", DEVICE_VS_DIRECT, "the direct batch")):
        label, probes = max(measured, key=lambda m: m[1]["accumulated"]["peak_mb"]
                            / m[1][base]["peak_mb"])
        p, ref = probes["accumulated"], probes[base]
        ratio = p["peak_mb"] / ref["peak_mb"]
        out.append(_judged(
            name, f"worst {ratio:.2f}x ({label})", ratio <= limit and not failed,
            f"{label} peaked at {p['peak_mb']:.1f} MB against {ref['peak_mb']:.1f} MB for "
            f"{what} ({p['before_mb']:.1f} MB in use before training, +{p['increment_mb']:.1f} "
            f"MB in training against +{ref['increment_mb']:.1f} MB)."
            + (" Not measured: " + "; ".join(failed) if failed else "")))
    return out


def _device_speed_targets(speed, names):
    rows = [r for r in speed if r["b"] >= DEVICE_SPEED_MIN_B]
    failed = [f"N={r['n']} x B={r['b']}: {r['error']}" for r in rows if "error" in r]
    rows = [r for r in rows if "error" not in r]
    out = []
    for name, ratio_of in ((names[0], lambda r: r["vs_direct"]["fused"]),
                           (names[1], lambda r: r["tf2_vs_tf2_direct"])):
        if not rows:
            out.append(dict(target=name, measured="not measured" if not failed else
                            "probe failed", status="not measured" if not failed else "missed",
                            why="; ".join(failed) or None))
            continue
        worst = max(rows, key=lambda r: ratio_of(r)["ratio"])
        r = ratio_of(worst)
        out.append(_judged(
            name, f"worst {r['ratio']:.2f}x at N={worst['n']}/B={worst['b']}",
            r["ratio"] <= DEVICE_SPEED and not failed,
            f"{r['ratio']:.2f}x at N={worst['n']}/B={worst['b']} (paired rounds, quartiles "
            f"{r['q1']:.2f}-{r['q3']:.2f}; milliseconds per update: "
            + ", ".join(f"{k} {v:.1f}" for k, v in worst["median_ms"].items()) + ")."
            + (" Not measured: " + "; ".join(failed) if failed else "")))
    return out
