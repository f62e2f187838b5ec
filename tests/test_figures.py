"""tools/figures.py: each figure is written as a real PNG from records shaped as the tools
make them, with the post's marks where given; missing and empty data are handled."""

import math

import numpy as np
import pytest
from matplotlib import colors
from matplotlib import image

from tools import figures

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


def speed_rows():
    """bench's speed_section rows, with the keys the figure does not use left in."""
    labels = ("direct", "stack", "running", "graph", "fused", "keras", "keras_long", "tf2")
    rows = []
    for n, b in ((1, 100), (5, 20), (20, 5)):
        ratios = {k: 1.0 + 0.1 * i * (n > 1) for i, k in enumerate(labels)}
        rows.append({"n": n, "b": b, "times": {}, "profiles": {}, "keras_best": "keras",
                     "median_ms": {k: 50.0 * r for k, r in ratios.items()},
                     "vs_direct": {k: {"ratio": r, "q1": 0.95 * r, "q3": 1.05 * r}
                                   for k, r in ratios.items()},
                     "keras_vs_fused": {"ratio": 2.0, "q1": 1.9, "q3": 2.1}})
    return rows


def probe(peak_mb):
    return {"peak_mb": peak_mb, "baseline_mb": 500.0, "increment_mb": peak_mb - 500.0,
            "import_mb": 400.0}


def memory_section():
    """bench's memory_section dict; one strategy's probe failed."""
    return {"samples": 16384, "n": 128, "b": 128, "direct": probe(2900.0),
            "small": probe(620.0), "accumulated": {"stack": probe(700.0),
                                                   "fused": {"error": "probe failed (1)"}}}


def host_section():
    """bench's host_memory_section dict; large N of stack skipped for lack of memory."""
    table = {(s, n): probe(600.0 + (130.0 * n if s == "stack" else 130.0))
             for s in ("stack", "fused") for n in (1, 2, 4) if (s, n) != ("stack", 4)}
    return {"grad_mb": 65.0, "params": 16_000_000, "ns": (1, 2, 4),
            "strategies": ("stack", "fused"), "table": table,
            "skipped": {("stack", 4): "skipped: needs ~5 GB"}}


@pytest.mark.parametrize("memory, host", [(True, True), (False, False)])
def test_bench_ratios_draw_speed_and_the_memory_that_was_measured(tmp_path, memory, host):
    path = figures.bench_ratios(speed_rows(), memory_section() if memory else None,
                                str(tmp_path / "bench.png"), host=host_section() if host else None)
    assert_png(path)
    width = image.imread(path).shape[1]
    assert width == pytest.approx(5.2 * figures.DPI * (3 if memory else 1), abs=2)


def test_bench_ratios_refuse_nothing_measured(tmp_path):
    failed = dict(memory_section(), direct={"error": "probe failed (137)"})
    with pytest.raises(ValueError, match="nothing|no speed rows"):
        figures.bench_ratios([], failed, str(tmp_path / "bench.png"))
    with pytest.raises(ValueError, match="no speed rows"):
        figures.bench_ratios([], None, str(tmp_path / "bench.png"))
