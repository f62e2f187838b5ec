"""BENCHMARKS.png (tools/bench.py's bench_figure): it reads at README width, shows every bar
inside its axes and names every contender in a legend of its own colour."""

import pytest
from matplotlib import image
from matplotlib.container import BarContainer

from experiment import figures
from tests.experiment.test_figures import assert_legends_off_the_axes
from tests.experiment.test_figures import assert_png
from tests.experiment.test_figures import inside
from tools import bench


def speed_rows():
    """bench_speed.Speed's rows, every contender the bench races, with the keys the figure
    does not use left in."""
    from tools.bench_speed import LABELS as labels

    rows = []
    for n, b in ((1, 100), (5, 20), (20, 5)):
        ratios = {k: 1.0 + 0.1 * i * (n > 1) for i, k in enumerate(labels)}
        rows.append({"n": n, "b": b, "times": {}, "profiles": {},
                     "median_ms": {k: 50.0 * r for k, r in ratios.items()},
                     "vs_direct": {k: {"ratio": r, "q1": 0.95 * r, "q3": 1.05 * r}
                                   for k, r in ratios.items()}})
    return rows


def test_bench_figure_reads_at_readme_width_shows_every_bar_and_names_every_contender(
        tmp_path):
    from tools.bench_speed import CONTENDERS  # the names the bench draws
    fig, ax = bench.bench_figure(speed_rows(), CONTENDERS)
    path = tmp_path / "bench.png"
    path.write_bytes(figures.png_bytes(fig))
    assert_png(path)
    assert image.imread(path).shape[1] <= 1000  # README width, not a strip
    for row in speed_rows():
        for v in row["vs_direct"].values():
            assert inside(v["q3"], ax.get_ylim()) and inside(v["q1"], ax.get_ylim())
    names = [t.get_text() for leg in fig.legends for t in leg.texts]
    for label in speed_rows()[0]["vs_direct"]:
        assert any(name.startswith(label + ":") for name in names), (label, names)
    assert_legends_off_the_axes(fig, [ax])
    assert_legends_inside_the_figure(fig)
    assert_a_colour_per_contender(ax, len(speed_rows()[0]["vs_direct"]) - 1)
    with pytest.raises(ValueError, match="no speed rows"):
        bench.bench_figure([], CONTENDERS)



def assert_a_colour_per_contender(ax, contenders):
    """Each contender's bars share one colour, and no two contenders share theirs."""
    by_label = {}
    for container in ax.containers:
        if isinstance(container, BarContainer):
            by_label[container.get_label()] = {bar.get_facecolor() for bar in container.patches}
    assert len(by_label) == contenders
    assert all(len(colours) == 1 for colours in by_label.values()), by_label
    assert len({colours.pop() for colours in by_label.values()}) == contenders


def assert_legends_inside_the_figure(fig):
    """Every legend of `fig` lies whole inside the figure: no entry cut at its edges."""
    renderer = fig.canvas.get_renderer()
    fig.draw(renderer)
    for legend in fig.legends:
        box = legend.get_window_extent(renderer)
        assert fig.bbox.x0 <= box.x0 and box.x1 <= fig.bbox.x1, (box, fig.bbox)
        assert fig.bbox.y0 <= box.y0 and box.y1 <= fig.bbox.y1, (box, fig.bbox)
