"""BENCHMARKS.md: the targets, then the speed, profile, memory tables and the method."""

import datetime
import os

from experiment import averagers
from experiment import results
from tools import bench_contenders
from tools import bench_keras_fit
from tools import bench_targets
from tools import common
from tools import figures
from tools.bench_probes import HOST_BATCH, HOST_MODEL
from tools.bench_targets import FLAT_GRADIENTS_PER_N


def _ms_ratio(row, label):
    r = row["vs_direct"][label]
    return f"{row['median_ms'][label]:.1f} ms, {r['ratio']:.2f}x"


def render(command, settings, speed, keras_setup, mem, host, targets, elapsed, kernels=None,
           figure=None):
    """The markdown; `figure`: the file name of the ratios' PNG next to it, linked, or None."""
    lines = ["# Benchmarks: gradient accumulation, speed and memory", "",
             f"Written by `{command}` on {datetime.datetime.now():%Y-%m-%d %H:%M} in "
             f"{elapsed / 60:.1f} minutes.", "", f"Machine: {common.machine()}.", "",
             "Ratios are within this one run; CPU timings on a shared machine are noisy, so "
             "compare ratios, not times across runs.", ""]
    lines += bench_targets.table_lines(targets)
    noise = bench_targets.noise_floor(speed)
    if noise is not None:
        lines += ["", f"This run's noise: at N=1 every averager is the post's `minimize`, the "
                  f"same graph as `direct`, and their ratios to it came out up to "
                  f"{noise:.0%} away from 1. An averager whose ratio to `stack` is above 1 "
                  f"by less than that, or below 1 in a quarter of the rounds, is \"within "
                  f"noise\": this run cannot tell it apart from `stack`."]
    lines += bench_targets.missed_lines(targets)
    if figure:
        lines += ["", f"![Speed and memory ratios]({figure})", "",
                  figures.bench_caption(speed, mem, host)]
    if speed:
        labels = (["direct"] + list(averagers.AVERAGERS)
                  + list(bench_contenders.KERAS_CONTENDERS) + ["tf2"])
        lines += ["", "## Speed: training time per update", "",
                  f"Each update trains N*B samples of real MNIST (the post's ConvNet, dropout "
                  f"on, Adam 1e-3). Median of {settings['repeats']} interleaved rounds of "
                  f"{settings['updates']} updates each, after one untimed block; the ratio is "
                  f"the median of the per-round ratios to `direct` (one batch of N*B, the "
                  f"post's `minimize`). At N=1 every averager is that same `minimize`: their "
                  f"spread there is this run's noise floor.", "",
                  "| N x B | " + " | ".join(labels) + " | faster Keras / fused |",
                  "|---" * (len(labels) + 2) + "|"]
        for row in speed:
            lines.append(f"| {row['n']} x {row['b']} | " + " | ".join(
                _ms_ratio(row, k) for k in labels)
                + f" | {row['keras_vs_fused']['ratio']:.2f}x |")
        lines += ["", "`keras`, `keras_long`: the same ConvNet as a Keras 3 model, "
                  "`Adam(1e-3, gradient_accumulation_steps=N)`, `model.fit` on a tf.data "
                  "pipeline of B-sized batches, with `steps_per_execution` N (one compiled "
                  "call per update, as `fused`) or N*U (one per timed block): Keras's own "
                  "way to cut the per-step overhead, and its fastest measured here (the plain "
                  "ways are below). Everything runs under op determinism, as `main.py` does, "
                  "under which Keras compiles no XLA."]
        lines += ["", "`tf2`: `--engine=tf2` (engine_tf2.py): the same ConvNet as a Keras 3 "
                  "model; the engine buffers N mini-batches (numpy, the post's order) and "
                  "trains the window in one compiled tf.function call: a loop over the "
                  "mini-batches inside it, two in flight, one Adam update.",
                  "", "`--jit-compile` (XLA for the tf2 window) is not timed here: under op "
                  "determinism (on in `main.py` and here) TensorFlow has no XLA gradient of "
                  "max pooling, so with the ConvNet it runs only with `--nodeterministic`; "
                  "its speed on this CPU is in docs/tf2-engine.md."]
        lines += bench_keras_fit.report(speed)
    if keras_setup:
        lines += ["", f"### Keras used plainly (N={keras_setup['n']} x B={keras_setup['b']})",
                  "", "A call per mini-batch against one compiled call per update.", "",
                  "| how | ms per update |", "|---|---|"]
        lines += [f"| {label} | {1e3 * s:.1f} |" for label, s in keras_setup["medians"].items()]
    if speed:
        lines += ["", "## Profile: where one update's time goes", "",
                  "tf.profiler over one block of updates per contender, after the timed "
                  "rounds; kernel milliseconds per update, summed over threads (so they can "
                  "exceed the wall time), by op class. Tracing slows the small ops most.", ""]
        for row in speed:
            labels = list(row["profiles"])
            classes = sorted({c for p in row["profiles"].values() for c in p["kernel_ms"]})
            lines += [f"N={row['n']} x B={row['b']}:", "",
                      "| | " + " | ".join(labels) + " |", "|---" * (len(labels) + 1) + "|",
                      "| wall ms, timed rounds | " + " | ".join(
                          f"{row['median_ms'][k]:.1f}" for k in labels) + " |",
                      "| wall ms, traced | " + " | ".join(
                          f"{row['profiles'][k]['wall_ms']:.1f}" for k in labels) + " |"]
            for c in classes:
                lines.append(f"| {c} | " + " | ".join(
                    f"{row['profiles'][k]['kernel_ms'].get(c, 0):.2f}" for k in labels) + " |")
            lines.append("")
    if kernels:
        lines += kernels_markdown(kernels, speed)
    if mem:
        lines += memory_markdown(mem)
    if host:
        lines += host_markdown(host)
    lines += ["", "## Method", "",
              "- Speed: every contender is built once (its own graph and session, or Keras "
              "model), trained one untimed block, then timed in rounds in which each trains "
              "one block; the order rotates every round. Data: the post's sample stream "
              "(TF1 contenders, through the tf1 engine's `step`, as `main.py`'s loop "
              "trains) or tf.data (Keras); evaluation is not timed.",
              "- Memory: each number is a fresh `python -m tools.bench --probe` process: it "
              "builds the graph, keeps only the samples it will train on, resets the kernel's "
              "peak-RSS counter (`/proc/self/clear_refs`), trains, and reads `VmHWM`. "
              "\"Before\" is its RSS just before training, \"import\" right after importing "
              "TensorFlow.", ""]
    return "\n".join(lines)


def kernels_markdown(kernels, speed):
    if "error" in kernels:
        return ["", "## oneDNN off", "", kernels["error"]]
    rows = {(r["n"], r["b"]): r for r in speed}
    out = ["", "## The same on Eigen kernels (oneDNN off)", "",
           "`direct` and `fused` again, interleaved as above, in a process started with "
           "`TF_ENABLE_ONEDNN_OPTS=0`, so TensorFlow runs its Eigen kernels instead of "
           "oneDNN's. `main.py` keeps TensorFlow's default (oneDNN on); this only tests where "
           "fused's gap to the direct batch comes from.", "",
           "| N x B | direct, oneDNN | direct, Eigen | fused, oneDNN | fused, Eigen | "
           "fused / direct, oneDNN | fused / direct, Eigen |", "|---|---|---|---|---|---|---|"]
    for k in kernels["kernels"]:
        r = rows[(k["n"], k["b"])]
        note = "" if not k["onednn_ops"] else " (oneDNN ops still seen!)"
        out.append(f"| {k['n']} x {k['b']} | {r['median_ms']['direct']:.1f} ms | "
                   f"{k['direct_ms']:.1f} ms | {r['median_ms']['fused']:.1f} ms | "
                   f"{k['fused_ms']:.1f} ms | {r['vs_direct']['fused']['ratio']:.2f}x | "
                   f"{k['ratio']:.2f}x{note} |")
    return out


def memory_markdown(mem):
    rows = [("direct", f"1 x {mem['samples']}", mem["direct"]),
            (f"B={mem['b']} alone", f"1 x {mem['b']}", mem["small"])]
    rows += [(s, f"{mem['n']} x {mem['b']}", p) for s, p in mem["accumulated"].items()]
    out = ["", f"## Peak memory at {mem['samples']} samples per update", "",
           "The post's ConvNet; peak RSS of a fresh process while it trains 2 updates (B "
           "alone: as many samples), against its RSS before training.", "",
           "| run | N x B | peak MB | before MB | training adds MB | peak / B alone | "
           "peak / direct |", "|---|---|---|---|---|---|---|"]
    for label, shape, p in rows:
        if "error" in p:
            out.append(f"| {label} | {shape} | {p['error']} | | | | |")
            continue
        small, direct = mem["small"].get("peak_mb"), mem["direct"].get("peak_mb")
        out.append(f"| {label} | {shape} | {p['peak_mb']:.0f} | {p['baseline_mb']:.0f} | "
                   f"{p['increment_mb']:.0f} | "
                   + (f"{p['peak_mb'] / small:.2f} | " if small else "| ")
                   + (f"{p['peak_mb'] / direct:.2f} |" if direct else "|"))
    return out


def host_markdown(host):
    out = ["", "## Host memory as N grows", "",
           f"`--model={HOST_MODEL}` ({host['params']:,} parameters: one gradient is "
           f"{host['grad_mb']:.0f} MB), B={HOST_BATCH}, one update; peak RSS in MB of a fresh "
           "process while it trains (at N=1 every averager is `minimize`).", "",
           "| N | " + " | ".join(host["averagers"]) + " |",
           "|---" * (len(host["averagers"]) + 1) + "|"]
    for n in host["ns"]:
        cells = []
        for s in host["averagers"]:
            p = host["table"].get((s, n))
            cells.append(host["skipped"].get((s, n), "-") if p is None else
                         p.get("error") or f"{p['peak_mb']:.0f}")
        out.append(f"| {n} | " + " | ".join(cells) + " |")
    slopes = [(s, bench_targets.host_slope(host, s)) for s in host["averagers"]]
    slopes = [f"{s} {m:+.1f} MB ({m / host['grad_mb']:+.3f} gradients)"
              for s, m in slopes if m is not None]
    if slopes:
        out += ["", "Least-squares growth per added mini-batch, over N > 1: "
                + ", ".join(slopes) + f". Flat means under {FLAT_GRADIENTS_PER_N} gradients; "
                "keeping the window's gradients costs at least one."]
    return out


def print_targets(targets):
    print("\nTargets:")
    for t in targets:
        print(f"  {t['status']:>13}: {t['target']} -- {t['measured']}")


def write(output, text, figure=None, png=None):
    """Writes BENCHMARKS.md (`text` at `output`) and its figure (`png` bytes at `figure`)
    as a pair: neither is replaced unless both are written, so a full disk leaves the
    previous pair, never a new half beside an old one.

    Raises:
      results.WriteError: naming both files, the cause, and that the previous ones stay.
    """
    items = [(figure, png)] if png is not None else []
    items.append((output, text.encode()))
    try:
        results.atomic_write_files(items)
    except OSError as e:
        names = " and ".join(path for path, _ in items)
        raise results.WriteError(f"cannot write {names} ({results.cause(e)}); what was "
                                 "there before is kept") from None
    if png is None and figure and os.path.exists(figure):
        os.remove(figure)  # an older run's figure must not sit beside this markdown
