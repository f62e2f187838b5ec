"""The figures of `make reproduce` and `make bench`, as PNG files.

Each function takes plain data (numbers in dicts and lists, shapes in its docstring), writes
one PNG and returns its path; the directory must exist. matplotlib draws through its Agg
canvas directly, without pyplot, so no display is needed and no global figure state is kept.
Accuracies are in percent, as main.py records them.
"""

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

DPI = 120
PANEL_INCHES = (4.0, 3.4)  # one subplot
OURS, POST = "tab:blue", "tab:red"
# The curves' y-axis starts below the lowest value seen after this fraction of the updates:
# the first evaluations (10% to 90%) would otherwise squeeze the ~95% region into a line.
CURVE_ZOOM_FROM = 0.2
CURVE_COLUMNS = 2  # panels per row: the post's four N in a 2 x 2 grid that reads in a README
MARKED_POINTS = 30  # curves with this few evaluations get a marker at each (one is a dot)
JITTER = 0.08  # half-width of the strip of per-run points, in category widths
SEED = 0       # the strip's jitter is drawn the same every time


def runs_to_inputs(pairs):
    """The inputs of `accuracy_curves` and `best_accuracy_spread` from result records.

    Args:
      pairs: (N, run) pairs; a run is a dict as main.py writes into a results file's "runs"
        list: "best_accuracy", and "evaluations": [{"iteration", "updates", "accuracy"}]
        (runs recorded before evaluations were kept have none: they count in the spread of
        the best accuracies, not in the curves).

    Returns:
      (curves_by_n, best_by_n): {N: [[(updates, accuracy), ...] per run with evaluations]}
      and {N: [best accuracy per run]}, both with N in increasing order.
    """
    curves_by_n, best_by_n = {}, {}
    for n, run in sorted(pairs, key=lambda pair: pair[0]):
        best_by_n.setdefault(n, []).append(run["best_accuracy"])
        curves = curves_by_n.setdefault(n, [])
        if run.get("evaluations"):
            curves.append([(e["updates"], e["accuracy"]) for e in run["evaluations"]])
    return curves_by_n, best_by_n


def common_grid(curves):
    """Runs' curves on the union of their update counts: (grid, values[run, point]).

    Each run is interpolated linearly between its own evaluations and is NaN outside them,
    so runs evaluated at slightly different update counts (a discarded window shifts them)
    are averaged without inventing values past a run's first or last evaluation.
    """
    grid = np.unique(np.concatenate([[u for u, _ in curve] for curve in curves]))
    values = np.full((len(curves), len(grid)), np.nan)
    for i, curve in enumerate(curves):
        updates, accuracy = np.array(sorted(curve), dtype=float).T
        inside = (grid >= updates[0]) & (grid <= updates[-1])
        values[i, inside] = np.interp(grid[inside], updates, accuracy)
    return grid, values


def accuracy_curves(curves_by_n, post_accuracy, path):
    """Test accuracy against updates applied, one panel per N (two panels a row).

    Each panel: the mean over the runs (on the common grid of `common_grid`) and a band from
    the lowest to the highest run at each point (no band for a single run), and the post's
    accuracy for that N as a dashed line. N with no run with evaluations get no panel. The
    y-axis starts just below the lowest value after the first CURVE_ZOOM_FROM of the updates,
    so the early evaluations run off the bottom and the end of training is readable.

    Args:
      curves_by_n: {N: [[(updates, accuracy), ...] per run]}, as `runs_to_inputs` gives.
      post_accuracy: {N: the post's accuracy}: its table's mean of the per-run best (the
        post reports no other accuracy per N); N missing, or None for all: no line (a
        scaled-down reproduction has nothing of the post's to compare with).
      path: the PNG to write.

    Raises:
      ValueError: no run has evaluations.
    """
    panels = [(n, curves) for n, curves in sorted(curves_by_n.items()) if curves]
    if not panels:
        raise ValueError("accuracy curves: no run has evaluations to draw (runs recorded "
                         "before evaluations were kept have none)")
    columns = min(len(panels), CURVE_COLUMNS)
    rows = -(-len(panels) // columns)
    fig = _figure(rows, columns)
    axes = fig.subplots(rows, columns, sharex=True, sharey=True, squeeze=False).ravel()
    for ax in axes[len(panels):]:
        ax.set_visible(False)
    low, high = 100.0, 0.0
    for ax, (n, curves) in zip(axes, panels):
        grid, values = common_grid(curves)
        mean = np.nanmean(values, axis=0)
        lo, hi = np.nanmin(values, axis=0), np.nanmax(values, axis=0)
        if len(curves) > 1:
            ax.fill_between(grid, lo, hi, color=OURS, alpha=0.25, linewidth=0,
                            label=f"ours: min-max of {len(curves)} runs")
        ax.plot(grid, mean, color=OURS, linewidth=1.5,
                label="ours: mean" if len(curves) > 1 else "ours: 1 run",
                marker="o" if len(grid) <= MARKED_POINTS else None, markersize=3)
        late = grid >= grid[0] + CURVE_ZOOM_FROM * (grid[-1] - grid[0])
        low, high = min(low, np.nanmin(lo[late])), max(high, np.nanmax(hi))
        post = (post_accuracy or {}).get(n)
        if post is not None:
            ax.axhline(post, color=POST, linestyle="--", linewidth=1.2,
                       label=f"post: {post:.1f}% (mean best)")
            low, high = min(low, post), max(high, post)
        ax.set_title(f"N={n}")
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right", fontsize="small")
    for ax in axes[:len(panels)]:
        ax.xaxis.set_tick_params(labelbottom=True)  # shared axes hide inner labels
        ax.set_xlabel("updates applied")
        if ax.get_subplotspec().is_first_col():
            ax.set_ylabel("test accuracy (%)")
    axes[0].set_ylim(low - 1.0, min(100.0, high + 0.5))
    fig.suptitle("Test accuracy during training")
    return _save(fig, path)


def best_accuracy_spread(best_by_n, post_mean_std, path):
    """Each N's per-run best accuracies beside the post's mean +/- std.

    Per N: our runs as a jittered strip of points with their mean as a short bar, and the
    post's mean with its std as an error bar to the right.

    Args:
      best_by_n: {N: [best accuracy of each run]}, as `runs_to_inputs` gives.
      post_mean_std: {N: (mean, std)} of the post's table (its std is the population std
        of its 10 runs); N missing or None: none drawn.
      path: the PNG to write.

    Raises:
      ValueError: no N has a run.
    """
    columns = [(n, bests) for n, bests in sorted(best_by_n.items()) if bests]
    if not columns:
        raise ValueError("best accuracy spread: no runs to draw")
    rng = np.random.default_rng(SEED)
    fig = _figure(1, 1, width=max(PANEL_INCHES[0], 1.1 * len(columns) + 1.2))
    ax = fig.subplots()
    labelled = set()

    def label(text):  # each legend entry once
        if text in labelled:
            return None
        labelled.add(text)
        return text

    for x, (n, bests) in enumerate(columns):
        ax.scatter(x - 0.12 + rng.uniform(-JITTER, JITTER, len(bests)), bests, s=18,
                   color=OURS, alpha=0.75, zorder=3, label=label("ours: best of each run"))
        ax.hlines(np.mean(bests), x - 0.12 - 1.6 * JITTER, x - 0.12 + 1.6 * JITTER,
                  color="black", linewidth=1.5, zorder=4, label=label("ours: mean"))
        post = (post_mean_std or {}).get(n)
        if post is not None:
            ax.errorbar(x + 0.2, post[0], yerr=post[1], fmt="s", color=POST, capsize=4,
                        markersize=5, label=label("post: mean +/- std (10 runs)"))
    ax.set_xticks(range(len(columns)), [f"N={n}" for n, _ in columns])
    ax.set_xlim(-0.6, len(columns) - 0.4)
    ax.set_ylabel("best test accuracy of a run (%)")
    ax.set_title("Best accuracy per run")
    ax.grid(axis="y", alpha=0.3)
    fig.legend(loc="outside lower center", ncol=3, fontsize="small")
    return _save(fig, path)


def bench_ratios(speed, memory, path, host=None):
    """The bench's ratios: time per update against the direct batch, peak memory against
    the direct batch and B alone, and (given `host`) host memory as N grows.

    Args:
      speed: bench's speed_section rows: [{"n", "b", "vs_direct": {label: {"ratio", "q1",
        "q3"}}, ...}], "direct" among the labels; bars are the medians of the paired
        per-round ratios, whiskers their quartiles.
      memory: bench's memory_section dict, or None: {"samples", "n", "b", "direct": probe,
        "small": probe, "accumulated": {strategy: probe}}, a probe {"peak_mb", ...} or
        {"error"}; strategies whose probe failed are left out.
      path: the PNG to write.
      host: bench's host_memory_section dict, or None: {"ns", "strategies", "table":
        {(strategy, N): probe}, ...}.

    Raises:
      ValueError: nothing to draw.
    """
    panels = []
    if speed:
        panels.append(lambda ax: _speed_panel(ax, speed))
    usable = _usable_memory(memory)
    if usable:
        panels.append(lambda ax: _memory_panel(ax, memory, usable))
    if host and any("peak_mb" in p for p in host["table"].values()):
        panels.append(lambda ax: _host_panel(ax, host))
    if not panels:
        raise ValueError("bench ratios: no speed rows and no successful memory probe to draw")
    fig = _figure(1, len(panels), width=5.2)
    for ax, draw in zip(fig.subplots(1, len(panels), squeeze=False)[0], panels):
        draw(ax)
    fig.suptitle("Gradient accumulation: speed and memory")
    return _save(fig, path)


def _speed_panel(ax, speed):
    labels = [k for k in speed[0]["vs_direct"] if k != "direct"]
    width = 0.8 / len(labels)
    for i, label in enumerate(labels):
        x = np.arange(len(speed)) - 0.4 + (i + 0.5) * width
        r = [row["vs_direct"][label] for row in speed]
        ratio = np.array([v["ratio"] for v in r])
        quartiles = np.array([[v["ratio"] - v["q1"] for v in r], [v["q3"] - v["ratio"] for v in r]])
        ax.bar(x, ratio, width, yerr=np.maximum(quartiles, 0), capsize=2, label=label,
               color=_colour(i), error_kw={"linewidth": 0.8})
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(speed)), [f"{row['n']} x {row['b']}" for row in speed])
    ax.set_xlabel("N x B (direct: one batch of N*B)")
    ax.set_ylabel("time per update / direct's")
    ax.set_title("Speed (median ratio, quartiles)")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize="x-small", ncol=2)


def _usable_memory(memory):
    """The accumulated probes that can be divided by both references, or {}."""
    if not memory or "peak_mb" not in memory["direct"] or "peak_mb" not in memory["small"]:
        return {}
    return {s: p for s, p in memory["accumulated"].items() if "peak_mb" in p}


def _memory_panel(ax, memory, usable):
    strategies = list(usable)
    x = np.arange(len(strategies))
    references = ((f"/ B={memory['b']} alone", memory["small"]["peak_mb"]),
                  (f"/ direct (1 x {memory['samples']})", memory["direct"]["peak_mb"]))
    for i, (label, reference) in enumerate(references):
        ratio = [usable[s]["peak_mb"] / reference for s in strategies]
        ax.bar(x - 0.2 + 0.4 * i, ratio, 0.4, label="peak " + label, color=_colour(i))
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xticks(x, strategies)
    ax.set_xlabel(f"strategy, {memory['n']} x {memory['b']} accumulated")
    ax.set_ylabel("peak RSS ratio")
    ax.set_title(f"Peak memory at {memory['samples']} samples per update")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize="x-small")


def _host_panel(ax, host):
    for i, strategy in enumerate(host["strategies"]):
        points = [(n, host["table"][(strategy, n)]["peak_mb"]) for n in host["ns"]
                  if "peak_mb" in host["table"].get((strategy, n), {})]
        if points:
            ns, mb = zip(*points)
            ax.plot(ns, mb, marker="o", markersize=3, label=strategy, color=_colour(i))
    ax.set_xscale("log", base=2)
    ax.set_xticks(host["ns"], [str(n) for n in host["ns"]])
    ax.set_xlabel("N (micro-batches per update)")
    ax.set_ylabel("peak RSS (MB)")
    ax.set_title("Host memory as N grows")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="x-small")


def _colour(i):
    return f"C{i % 10}"


def _figure(rows, columns, width=PANEL_INCHES[0]):
    fig = Figure(figsize=(width * columns, PANEL_INCHES[1] * rows), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _save(fig, path):
    fig.savefig(path, dpi=DPI)
    return path
