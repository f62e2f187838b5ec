"""The figures beside table.md (`make reproduce`), as PNG files written whole or not at all;
the bench draws BENCHMARKS.png with the same canvas.

matplotlib's Agg canvas, without pyplot (no display, no global state); accuracies in percent.
"""

import collections
import io

import numpy as np
from matplotlib import ticker
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from experiment import results

DPI = 120
PANEL_INCHES = (4.0, 3.4)  # one subplot
OURS, POST = "tab:blue", "tab:red"
# The curves' upper part starts below the values after this fraction of the updates (the
# first evaluations would squeeze the ~95% region); earlier points go below a marked break.
CURVE_ZOOM_FROM = 0.2
CURVE_COLUMNS = 2  # panels per row: the post's four N in a 2 x 2 grid that reads in a README
CURVE_HEIGHTS = (3, 1)  # the part above a break against the part below it
MARKED_POINTS = 30  # curves with this few evaluations get a marker at each (one is a dot)
JITTER = 0.08  # half-width of the strip of per-run points, in category widths
SEED = 0       # the strip's jitter is drawn the same every time


def runs_to_inputs(pairs):
    """(N, run) pairs, runs as main.py records them -> ({N: [[(updates, accuracy), ...] per run
    with evaluations]}, {N: [best per run]}), N increasing; runs without evaluations count too."""
    curves_by_n, best_by_n = {}, {}
    for n, run in sorted(pairs, key=lambda pair: pair[0]):
        best_by_n.setdefault(n, []).append(run["best_accuracy"])
        curves = curves_by_n.setdefault(n, [])
        if run.get("evaluations"):
            curves.append([(e["updates"], e["accuracy"]) for e in run["evaluations"]])
    return curves_by_n, best_by_n


def common_grid(curves):
    """Runs' curves on the union of their update counts: (grid, values[run, point]), each run
    linear between its evaluations and NaN outside them (no values invented past its ends)."""
    grid = np.unique(np.concatenate([[u for u, _ in curve] for curve in curves]))
    values = np.full((len(curves), len(grid)), np.nan)
    for i, curve in enumerate(curves):
        updates, accuracy = np.array(sorted(curve), dtype=float).T
        inside = (grid >= updates[0]) & (grid <= updates[-1])
        values[i, inside] = np.interp(grid[inside], updates, accuracy)
    return grid, values


def accuracy_curves(curves_by_n, post_accuracy, path):
    """Test accuracy against updates applied, a panel per N, written to `path`."""
    fig, _ = curves_figure(curves_by_n, post_accuracy)
    return _save(fig, path)


Panel = collections.namedtuple("Panel", ["n", "runs", "grid", "mean", "lo", "hi", "post"])


def curves_figure(curves_by_n, post_accuracy):
    """Test accuracy against updates applied: (Figure, {N: its panel's axes, upper first}).

    Per N the runs' mean, a band from the lowest to the highest run, the post's accuracy
    (`post_accuracy`: {N: mean best} or None) dashed. ValueError where no run has evaluations.
    """
    panels = _panels(curves_by_n, post_accuracy)
    upper_low, high, lower_low, broken = _curve_limits(panels)
    columns = min(len(panels), CURVE_COLUMNS)
    rows = -(-len(panels) // columns)
    fig = figure(PANEL_INCHES[0] * columns, PANEL_INCHES[1] * rows)
    cells = fig.add_gridspec(rows, columns)
    counts = {panel.runs for panel in panels}
    labels = {"band": "ours: lowest to highest run" + (
                  f" ({min(counts)} runs)" if len(counts) == 1 else ""),
              "mean": "ours: mean of the runs" if max(counts) > 1 else "ours: 1 run",
              "post": "post: its mean best accuracy"}
    axes_by_n = {}
    for i, panel in enumerate(panels):
        cell = cells[i // columns, i % columns]
        if broken:
            parts = cell.subgridspec(2, 1, height_ratios=CURVE_HEIGHTS, hspace=0.0)
            axes = [fig.add_subplot(parts[0])]
            axes.append(fig.add_subplot(parts[1], sharex=axes[0]))
        else:
            axes = [fig.add_subplot(cell)]
        for ax in axes:
            _draw_curve(ax, panel, labels)
        axes[0].set_ylim(upper_low, high)
        axes[0].set_title(f"N={panel.n}" + (
            "" if panel.post is None else f" (post: {panel.post:.1f}%)"))
        if broken:
            axes[1].set_ylim(lower_low, upper_low)
            axes[1].yaxis.set_major_locator(ticker.MaxNLocator(2))
            _mark_break(*axes)
        axes[-1].set_xlabel("updates applied")
        if i % columns == 0:
            axes[0].set_ylabel("test accuracy (%)")
        axes_by_n[panel.n] = axes
    _legend(fig, fig.axes, ncol=3, fontsize="small", title_fontsize="small",
            title="the y-axis is broken at //: below it, the first evaluations on a scale "
                  "of their own" if broken else None)
    fig.suptitle("Test accuracy during training")
    return fig, axes_by_n


def _panels(curves_by_n, post_accuracy):
    """A Panel per N evaluated: its runs' count, grid, mean, lowest, highest; the post's."""
    panels = []
    for n, curves in sorted(curves_by_n.items()):
        if curves:
            grid, values = common_grid(curves)
            panels.append(Panel(n, len(curves), grid, np.nanmean(values, axis=0),
                                np.nanmin(values, axis=0), np.nanmax(values, axis=0),
                                (post_accuracy or {}).get(n)))
    if not panels:
        raise ValueError("accuracy curves: no run has evaluations to draw (runs recorded "
                         "before evaluations were kept have none)")
    return panels


def _curve_limits(panels):
    """(upper part's low, top, lower part's low, broken): broken where the points before
    CURVE_ZOOM_FROM would take more of the axis than the later ones."""
    posts = [p.post for p in panels if p.post is not None]
    late = [p.lo[p.grid >= p.grid[0] + CURVE_ZOOM_FROM * (p.grid[-1] - p.grid[0])]
            for p in panels]
    upper_low = min([*(np.min(values) for values in late), *posts]) - 1.0
    high = min(100.0, max([*(np.max(p.hi) for p in panels), *posts]) + 0.5)
    lowest = min(np.min(p.lo) for p in panels)
    broken = upper_low - lowest > high - upper_low
    if not broken:
        upper_low = min(upper_low, lowest - 0.04 * (high - lowest))
    return upper_low, high, lowest - 0.04 * (upper_low - lowest), broken


def _draw_curve(ax, panel, labels):
    """One part of a panel: the runs' band, their mean, the post's line, with `labels`."""
    if panel.runs > 1:
        ax.fill_between(panel.grid, panel.lo, panel.hi, color=OURS, alpha=0.25, linewidth=0,
                        label=labels["band"])
    ax.plot(panel.grid, panel.mean, color=OURS, linewidth=1.5, label=labels["mean"],
            marker="o" if len(panel.grid) <= MARKED_POINTS else None, markersize=3)
    if panel.post is not None:
        ax.axhline(panel.post, color=POST, linestyle="--", linewidth=1.2, label=labels["post"])
    ax.grid(alpha=0.3)


def _legend(fig, axes, **options):
    """The figure's legend below its axes: each label of `axes`' artists once."""
    handles = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, handle)
    fig.legend(handles.values(), handles.keys(), loc="outside lower center", **options)


def _mark_break(upper, lower):
    """Joins a panel's two axes as one y-axis broken between them, marked //."""
    upper.spines.bottom.set_visible(False)
    lower.spines.top.set_visible(False)
    upper.tick_params(axis="x", bottom=False, labelbottom=False)
    marks = dict(marker=[(-1, -0.5), (1, 0.5)], markersize=9, linestyle="none", color="black",
                 mec="black", mew=1, clip_on=False)
    upper.plot([0, 1], [0, 0], transform=upper.transAxes, **marks)
    lower.plot([0, 1], [1, 1], transform=lower.transAxes, **marks)


def best_accuracy_spread(best_by_n, post_mean_std, path):
    """Per N a jittered strip of the runs' bests, their mean a bar, beside the post's mean +/-
    population std (`post_mean_std`: {N: (mean, std)} or None). ValueError where no runs."""
    columns = [(n, bests) for n, bests in sorted(best_by_n.items()) if bests]
    if not columns:
        raise ValueError("best accuracy spread: no runs to draw")
    rng = np.random.default_rng(SEED)
    ax = figure(max(PANEL_INCHES[0], 1.1 * len(columns) + 1.2), PANEL_INCHES[1]).subplots()
    for x, (n, bests) in enumerate(columns):
        ax.scatter(x - 0.12 + rng.uniform(-JITTER, JITTER, len(bests)), bests, s=18,
                   color=OURS, alpha=0.75, zorder=3, label="ours: best of each run")
        ax.hlines(np.mean(bests), x - 0.12 - 1.6 * JITTER, x - 0.12 + 1.6 * JITTER,
                  color="black", linewidth=1.5, zorder=4, label="ours: mean")
        post = (post_mean_std or {}).get(n)
        if post is not None:
            ax.errorbar(x + 0.2, post[0], yerr=post[1], fmt="s", color=POST, capsize=4,
                        markersize=5, label="post: mean +/- std (10 runs)")
    ax.set_xticks(range(len(columns)), [f"N={n}" for n, _ in columns])
    ax.set_xlim(-0.6, len(columns) - 0.4)
    ax.set_ylabel("best test accuracy of a run (%)")
    ax.set_title("Best accuracy per run")
    ax.grid(axis="y", alpha=0.3)
    _legend(ax.figure, [ax], ncol=3, fontsize="small")
    return _save(ax.figure, path)


def figure(width, height):
    """A figure of that size in inches, on the Agg canvas, laid out by constrained layout
    (BENCHMARKS.png's too)."""
    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def png_bytes(fig):
    """The figure as PNG bytes, at DPI."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=DPI)
    return buffer.getvalue()


def _save(fig, path):
    results.atomic_write_bytes(path, png_bytes(fig))
    return path
