"""experiment/figures.py: each figure is written as a real PNG from records shaped as
`make reproduce` makes them, with the post's marks where given; missing and empty data are
handled; every data point lies inside its axes, legends lie outside them."""

import math

import numpy as np
import pytest
from matplotlib import colors
from matplotlib import image

from experiment import figures

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
MIN_PNG_BYTES = 10_000  # an empty canvas of these sizes is a few kB; drawn panels are more
POST_MEAN_STD = {1: (95.0, 0.172), 5: (94.9, 0.325), 20: (95.2, 0.303)}


def run_record(seed, n, final=95.0, with_evaluations=True, iterations_per_eval=100,
               updates=200):
    """A run as main.py records it (the keys a results file's "runs" list holds)."""
    evaluations = []
    for iteration in range(iterations_per_eval, updates * n + 1, iterations_per_eval):
        u = iteration // n
        evaluations.append({"iteration": iteration, "updates": u,
                            "accuracy": round(final - 60 * math.exp(-u / 30) + 0.1 * seed, 2)})
    run = {"seed": seed, "best_accuracy": max(e["accuracy"] for e in evaluations),
           "best_iteration": evaluations[-1]["iteration"],
           "final_accuracy": evaluations[-1]["accuracy"], "updates": updates,
           "train_seconds": 1.0, "eval_seconds": 0.1}
    if with_evaluations:
        run["evaluations"] = evaluations
    return run


def pairs():
    """Three N, three runs each; one run of N=5 was recorded before evaluations were kept."""
    return [(n, run_record(seed, n, with_evaluations=(n, seed) != (5, 2)))
            for n in (20, 1, 5) for seed in range(3)]


def assert_png(path):
    with open(path, "rb") as f:
        content = f.read()
    assert content.startswith(PNG_SIGNATURE)
    assert len(content) > MIN_PNG_BYTES


def pixels_of(path, colour):
    """How many pixels of the PNG at `path` have (about) the colour `colour`."""
    rgb = image.imread(path)[..., :3]
    return int(np.sum(np.all(np.abs(rgb - colors.to_rgb(colour)) < 0.02, axis=-1)))


def test_records_become_curves_and_bests_with_old_runs_in_the_bests_only():
    curves, bests = figures.runs_to_inputs(pairs())
    assert list(curves) == [1, 5, 20] and list(bests) == [1, 5, 20]
    assert [len(curves[n]) for n in curves] == [3, 2, 3]
    assert [len(bests[n]) for n in bests] == [3, 3, 3]
    first = run_record(0, 20)
    assert curves[20][0] == [(e["updates"], e["accuracy"]) for e in first["evaluations"]]
    assert bests[20][0] == first["best_accuracy"]


def test_runs_evaluated_at_different_updates_share_a_grid_without_extrapolation():
    grid, values = figures.common_grid([[(10, 90.0), (20, 94.0)], [(15, 92.0), (25, 96.0)]])
    assert grid.tolist() == [10, 15, 20, 25]
    np.testing.assert_allclose(values[0, :3], [90.0, 92.0, 94.0])
    np.testing.assert_allclose(values[1, 1:], [92.0, 94.0, 96.0])
    assert math.isnan(values[0, 3]) and math.isnan(values[1, 0])


@pytest.mark.parametrize("post", [True, False])
def test_accuracy_curves_are_drawn_with_the_posts_marks_when_given(tmp_path, post):
    curves, _ = figures.runs_to_inputs(pairs())
    path = str(tmp_path / "curves.png")
    marks = {n: mean for n, (mean, _) in POST_MEAN_STD.items()} if post else None
    assert figures.accuracy_curves(curves, marks, path) == path
    assert_png(path)
    assert pixels_of(path, figures.OURS) > 1000
    assert (pixels_of(path, figures.POST) > 100) == post


def inside(value, limits):
    low, high = sorted(limits)
    return low <= value <= high


def assert_legends_off_the_axes(fig, axes):
    """Every legend of `fig` (the figure's, its subfigures', the axes') covers no axes."""
    renderer = fig.canvas.get_renderer()
    fig.draw(renderer)
    legends = list(fig.legends) + [leg for sub in fig.subfigs for leg in sub.legends]
    legends += [ax.get_legend() for ax in axes if ax.get_legend()]
    assert legends
    for legend in legends:
        box = legend.get_window_extent(renderer)
        for ax in axes:
            assert not box.overlaps(ax.get_window_extent(renderer)), legend


def test_every_evaluation_of_every_run_is_inside_its_panels_axes():
    # N=20's first evaluation (5 updates, 44%) lies far below what the late updates reach:
    # the axis breaks, and it is drawn in the lower part.
    curves, _ = figures.runs_to_inputs(pairs())
    fig, axes_by_n = figures.curves_figure(curves, {1: 95.0, 20: 95.2})
    assert sorted(axes_by_n) == [1, 5, 20]
    for n, runs in curves.items():
        axes = axes_by_n[n]
        assert len(axes) == 2  # broken: the early points on their own scale below
        for run in runs:
            for updates, accuracy in run:
                assert inside(updates, axes[0].get_xlim())
                assert any(inside(accuracy, ax.get_ylim()) for ax in axes), (n, accuracy)
        assert inside(95.2 if n == 20 else 95.0, axes[0].get_ylim()) or n == 5
        assert axes[0].get_ylim()[0] > 75  # the upper part is zoomed on the end of training
    assert_legends_off_the_axes(fig, [ax for axes in axes_by_n.values() for ax in axes])


def test_curves_close_together_get_one_axis_that_holds_them_all():
    curves = {1: [[(10, 68.0), (20, 70.0), (30, 72.0)]], 5: [[(10, 67.0), (30, 71.0)]]}
    _, axes_by_n = figures.curves_figure(curves, None)
    for n, (run,) in curves.items():
        (ax,) = axes_by_n[n]
        assert all(inside(a, ax.get_ylim()) and inside(u, ax.get_xlim()) for u, a in run)


def test_accuracy_curves_skip_n_without_evaluations_and_refuse_none(tmp_path):
    old = [(n, run_record(seed, n, with_evaluations=False)) for n in (1, 5) for seed in (0, 1)]
    new = [(20, run_record(0, 20))]
    curves, _ = figures.runs_to_inputs(old + new)
    assert curves[1] == [] and len(curves[20]) == 1
    assert_png(figures.accuracy_curves(curves, {20: 95.2}, str(tmp_path / "one.png")))
    curves, _ = figures.runs_to_inputs(old)
    with pytest.raises(ValueError, match="no run has evaluations"):
        figures.accuracy_curves(curves, {}, str(tmp_path / "none.png"))
    with pytest.raises(ValueError, match="no run has evaluations"):
        figures.accuracy_curves({}, {}, str(tmp_path / "empty.png"))
    assert not (tmp_path / "none.png").exists()


def test_best_accuracy_spread_shows_runs_and_the_posts_error_bars(tmp_path):
    _, bests = figures.runs_to_inputs(pairs())
    path = figures.best_accuracy_spread(bests, POST_MEAN_STD, str(tmp_path / "spread.png"))
    assert_png(path)
    assert pixels_of(path, figures.POST) > 100
    with pytest.raises(ValueError, match="no runs"):
        figures.best_accuracy_spread({1: []}, POST_MEAN_STD, str(tmp_path / "empty.png"))


@pytest.mark.parametrize("scale", [1, 10])
def test_table_links_each_figure_and_says_where_the_posts_marks_are_not_drawn(scale):
    from experiment import reproduce_table  # the figures above, linked from table.md

    text = "\n".join(reproduce_table.figure_lines(
        ["accuracy_curves.png", "best_accuracy.png"], ["x.png not drawn: why."], scale))
    assert "![accuracy_curves.png](accuracy_curves.png)" in text and "- x.png not drawn" in text
    assert ("the post's numbers are not drawn" in text) == (scale > 1)
