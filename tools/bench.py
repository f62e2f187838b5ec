"""make bench: every section of the benchmark, measured on this machine, into BENCHMARKS.md.

    python -m tools.bench            # the full benchmark (README gives how long)
    python -m tools.bench --quick    # a smoke test: every section scaled down, some left out
    python -m tools.bench --sections=wrapper --output=wrapper.md   # one section alone

Accumulation saves memory, so it must not cost speed: the sections measure both, in
BENCHMARKS.md's order, after every target and the speed figure (BENCHMARKS.png).
"""

import os
import shlex
import sys
import time

from experiment import cli

cli.import_tensorflow_quietly()  # first: its C++ start-up lines would reach stderr
# ruff: noqa: E402 (the imports below follow the quiet TensorFlow import)

import numpy as np
import tensorflow as tf
from absl import app
from absl import flags

from experiment import data
from experiment import figures
from experiment import progress
from experiment import results
from tools import bench_collective
from tools import bench_device
from tools import bench_floor
from tools import bench_memory
from tools import bench_micro_batch
from tools import bench_speed
from tools import bench_tensor_memory
from tools import bench_tf1_wrapper
from tools.bench_section import Run
from tools.bench_section import header
from tools.bench_section import targets_table

FLAGS = flags.FLAGS

SECTIONS = (bench_tensor_memory.TensorMemory, bench_micro_batch.MicroBatchSearch,
            bench_floor.Floor, bench_floor.FloorXLA, bench_floor.LanguageModelSpeed,
            bench_speed.Speed, bench_speed.KerasPlain, bench_speed.Kernels,
            bench_memory.HostGrowth, bench_tf1_wrapper.Wrapper, bench_collective.Collective,
            bench_device.Device)

BENCH_INCHES = (8.0, 5.6)  # the bench figure as it reads at README width (~960 px)
# Every contender its own colour: tab10's ten, then five darker ones of tab20b's.
BENCH_COLOURS = tuple(f"C{i}" for i in range(10)) + (
    "#393b79", "#637939", "#8c6d31", "#843c39", "#7b4173")
BENCH_LEGEND_COLUMNS = 2  # the longest name (about 60 characters) fits twice across

cli.define("bool", "quick", False, "Every section scaled down, some left out (a smoke test).")
cli.define("string", "output", "BENCHMARKS.md", "Markdown file to write.")
cli.define("list", "sections", None, "Only these sections, by name: " + ", ".join(
    cls.name for cls in SECTIONS))


def bench_figure(speed, names):
    """The bench's speed ratios, not saved: (Figure, axes). Per (N, B) of `speed` (Speed's rows,
    {"n", "b", "vs_direct": {label: paired ratio}}) a bar per contender, whiskers its "q1" and
    "q3" where held; `names`: {label: words}. ValueError: no rows, more labels than colours."""
    if not speed:
        raise ValueError("bench ratios: no speed rows to draw")
    labels = [k for k in speed[0]["vs_direct"] if k != "direct"]
    if len(labels) > len(BENCH_COLOURS):
        raise ValueError(f"bench ratios: {len(labels)} contenders, {len(BENCH_COLOURS)} "
                         "colours (BENCH_COLOURS)")
    quartiles = all("q1" in v for row in speed for v in row["vs_direct"].values())
    fig = figures.figure(*BENCH_INCHES)
    ax = fig.subplots()
    width = 0.8 / len(labels)
    for i, label in enumerate(labels):
        r = [row["vs_direct"][label] for row in speed]
        ratio = np.array([v["ratio"] for v in r])
        spread = None if not quartiles else np.maximum(
            [[v["ratio"] - v["q1"] for v in r], [v["q3"] - v["ratio"] for v in r]], 0)
        ax.bar(np.arange(len(speed)) - 0.4 + (i + 0.5) * width, ratio, width, yerr=spread,
               capsize=2, label=f"{label}: {names[label]}", color=BENCH_COLOURS[i],
               error_kw={"linewidth": 0.8})
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--",
               label=f"direct: {names['direct']} (= 1)")
    ax.set_ylim(0, 1.08 * max(max(v.get("q3", 0), v["ratio"]) for row in speed
                              for v in row["vs_direct"].values()))
    ax.set_xticks(range(len(speed)), [f"{row['n']} x {row['b']}" for row in speed])
    ax.set_xlabel("N x B: N mini-batches of B samples per update")
    ax.set_ylabel("time per update / direct's")
    ax.set_title("Speed: median ratio to direct" + (", whiskers the quartiles" if quartiles
                                                    else "") + " (lower is faster)",
                 fontsize="medium")
    ax.grid(axis="y", alpha=0.3)
    fig.legend(loc="outside lower center", ncol=BENCH_LEGEND_COLUMNS, fontsize="x-small")
    fig.suptitle("Gradient accumulation: speed (make bench)")
    return fig, ax


def render(command, sections, run, targets, elapsed, figure=None):
    """BENCHMARKS.md: what made it, the targets, the figure (a file name or None), the parts."""
    lines = header("Benchmarks: gradient accumulation, speed and memory", command, elapsed) + [
        "Ratios are within this one run; CPU timings on a shared machine are noisy, so "
        "compare ratios, not times across runs.", "", *targets_table(targets)]
    if figure:
        lines += ["", f"![Speed ratios]({figure})", "",
                  "Time per update against the direct batch of N*B (the median of the per-round "
                  "ratios, whiskers their quartiles; below the dashed line is faster)."]
    for section in sections:
        part = section.markdown(run.results[section.name])
        lines += [""] + part if part else []
    return "\n".join(lines) + "\n"


def write(output, text, figure=None, png=None):
    """Writes `text` at `output` and `png` at `figure` as a pair (never a new half beside an
    old one); results.WriteError where they cannot be, the previous pair kept."""
    items = ([(figure, png)] if png is not None else []) + [(output, text.encode())]
    try:
        results.atomic_write_files(items)
    except OSError as e:
        names = " and ".join(path for path, _ in items)
        raise results.WriteError(f"cannot write {names} ({results.cause(e)}); what was "
                                 "there before is kept") from None
    if png is None and figure and os.path.exists(figure):
        os.remove(figure)  # an older run's figure must not sit beside this markdown


def main_bench(argv):
    if len(argv) > 1:
        cli.fail(f"unexpected arguments: {' '.join(argv[1:])}")
    output = FLAGS.output
    try:
        results.check_writable(output, "--output")
    except results.ResultsError as e:
        cli.fail(str(e))
    unknown = set(FLAGS.sections or ()) - {cls.name for cls in SECTIONS}
    if unknown:
        cli.fail(f"--sections: no section {', '.join(sorted(unknown))}")
    command = shlex.join(["python", "-m", "tools.bench", *sys.argv[1:]])
    start = time.perf_counter()
    try:
        datasets = data.load_mnist()
    except data.DataError as e:
        cli.fail(str(e))
    sections = [s for s in (cls(FLAGS.quick) for cls in SECTIONS) if s.settings is not None
                and s.name in (FLAGS.sections or [s.name])]
    with progress.Bar(sum(s.steps() for s in sections), "bench", unit="measurement") as bar, \
            bar.printing_through():
        run = Run(datasets, log=lambda line: print(line, flush=True), advance=bar.update)
        targets = run.measure(sections)
    print("\nTargets:")
    for t in targets:
        print(f"  {t.status:>13}: {t.target} -- {t.measured}")
    figure = os.path.splitext(output)[0] + ".png"
    try:
        fig, _ = bench_figure(run.results.get("speed"), bench_speed.CONTENDERS)
        png = figures.png_bytes(fig)
        drawn = os.path.basename(figure)
    except ValueError as e:  # nothing measured that a figure could show
        png = drawn = None
        print(f"{figure} not drawn: {e}")
    text = render(command, sections, run, targets, time.perf_counter() - start, drawn)
    try:
        write(output, text, figure, png)
    except results.WriteError as e:
        cli.fail(str(e), code=1)
    print(f"\nWrote {output}" + (f" and {figure}" if drawn else "")
          + f" in {(time.perf_counter() - start) / 60:.1f} minutes.")


if __name__ == "__main__":
    from absl import logging
    logging.set_verbosity(logging.WARNING)
    tf.config.experimental.enable_op_determinism()  # as main.py trains
    app.run(main_bench, flags_parser=cli.parse_flags)
