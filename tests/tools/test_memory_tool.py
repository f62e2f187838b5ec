"""tools/memory.py: a real probe (a fresh process each, run two at a time), its OOM report
under a limit, and the bound, ratios and tables computed from rows made here."""

import subprocess

import pytest

from tests.helpers import run_cli
from tools import memory
from tools import models

CONVNET_PARAMETERS = 56_970  # 3 convolutions (32, 64, 64 filters of 3x3) and a dense layer
CONVNET_LARGEST = 3 * 3 * 64 * 64  # the third convolution's kernel


@pytest.fixture(scope="module")
def measured():
    """(a plain step of the convnet, the MLP alone on a device smaller than its 64 MiB
    kernel), both probed at once."""
    return memory.probes([dict(model="convnet", path="alone", n=2, b=8),
                          dict(model="mlp", path="alone", n=2, b=8, limit_mb=48)], jobs=2)


@pytest.mark.slow
def test_a_probe_measures_a_peak_above_what_it_held_before(measured):
    result = measured[0]
    assert not result.get("error") and result["oom"] is False, result
    assert result["device"] == "CPU:0"
    assert result["peak_mb"] > result["current_mb"] > 0
    assert result["current_mb"] >= result["weights_mb"]  # the weights live on the device
    assert result["accumulators_mb"] * memory.MIB == 4 * CONVNET_PARAMETERS
    assert result["weights_mb"] == result["accumulators_mb"]  # no non-trainable weights
    assert result["largest_mb"] * memory.MIB == 4 * CONVNET_LARGEST


@pytest.mark.slow
def test_a_run_that_does_not_fit_comes_back_as_an_oom(measured):
    result = measured[1]
    assert result["oom"] is True and "peak_mb" not in result, result
    assert result["phase"] == "warm-up" and "OOM" in result["message"]
    assert result["limit_mb"] == 48 and result["path"] == "alone"


def test_a_crash_comes_back_as_one_line(monkeypatch):
    def crashed(returncode):
        return lambda *a, **k: subprocess.CompletedProcess(a, returncode, "", "boom\n")

    monkeypatch.setattr(subprocess, "run", crashed(-11))
    assert memory.probe("mlp", "alone", 2, 8)["error"] == "segmentation fault (exit 139)"
    monkeypatch.setattr(subprocess, "run", crashed(1))
    assert memory.probe("mlp", "alone", 2, 8)["error"] == "probe failed (exit 1): boom"
    assert "no TF1 graph" in memory.probe("bn", "tf1", 2, 8)["error"]
    with pytest.raises(ValueError, match="path='sideways'"):
        memory.probe("mlp", "sideways", 2, 8)


@pytest.mark.slow
def test_the_accumulate_path_with_a_micro_batch_trains_and_says_how_fit_cut_the_batch():
    """In this process (the probe's own process would run it under a limit)."""
    x, y = models.data("convnet", 9)
    path = memory._path_accumulate  # noqa: SLF001 (the probe's own pieces, run here)
    update, _, _, values, found = path("convnet", 1, 9, x, y, micro_batch=4)
    before = values()
    update()
    assert found() == {"micro_batch_size": 4, "search_s": None, "trials": [], "halved": []}
    assert all((a != b).any() for a, b in zip(before, values()))


def test_the_bound_is_alone_plus_the_largest_variable_plus_a_margin():
    assert memory.bound_mb(300.0, 64.0) == pytest.approx(364.0 * 1.05)
    assert memory.bound_mb(50.0, 0.25) == pytest.approx(50.25 + 4.0)  # 4 MiB at least
    # the TF1 graph's and the _p2 paths': the accumulators too
    assert memory.bound_mb(300.0, 64.0, 76.0) == pytest.approx(440.0 * 1.05)


def _row(path, peak, ooms=0):
    return dict(model="mlp", path=path, n=8, b=32, limit_mb=None, gpu=False, probes=1,
                peaks=[] if peak is None else [peak], ooms=ooms, errors=[], seconds=1.0,
                peak_mb=peak, current_mb=None if peak is None else peak / 2,
                weights_mb=None if peak is None else 76.0,
                largest_mb=None if peak is None else 64.0,
                accumulators_mb=None if peak is None else 76.0)


def test_each_path_is_compared_with_the_bound_and_the_references():
    rows = memory.with_ratios([_row("alone", 300.0), _row("direct", 400.0),
                               _row("keras", 500.0), _row("window", 600.0),
                               _row("tf1", None, ooms=3)])
    window = rows[3]
    assert window["bound_mb"] == pytest.approx(382.2)  # 300 + 64, +5%
    assert window["to_bound"] == pytest.approx(600.0 / 382.2)
    assert (window["to_alone"], window["to_direct"], window["to_keras"]) == pytest.approx(
        (2.0, 1.5, 1.2))
    assert rows[4]["to_bound"] is None  # an OOM has no peak
    text = memory.markdown(rows)
    assert "| window | 600.0 | 300.0 | 1.57 | 2.00 | 1.50 | 1.20 | 1.0 |" in text
    assert "| tf1 | OOM |" in text
    no_alone = memory.with_ratios([_row("window", 600.0)])[0]
    assert no_alone["bound_mb"] is None and no_alone["to_alone"] is None


def test_a_tf1_row_is_compared_with_the_tf1_graphs_own_b_alone_and_direct_batch():
    rows = memory.with_ratios([_row("alone", 300.0), _row("direct", 400.0),
                               _row("keras", 500.0), _row("tf1", 540.0),
                               _row("tf1_alone", 360.0), _row("tf1_direct", 450.0)])
    tf1 = rows[3]
    assert rows[2]["bound_mb"] == pytest.approx(382.2)  # 300 + 64, +5%
    assert tf1["bound_mb"] == pytest.approx((360.0 + 76.0 + 64.0) * 1.05)
    assert (tf1["to_alone"], tf1["to_direct"], tf1["to_keras"]) == pytest.approx(
        (1.5, 1.2, 540.0 / 500.0))
    assert f"so their bound is {tf1['bound_mb']:.1f} MiB" in memory.markdown(rows)
    # without its own B alone, a TF1 row takes Keras's
    assert memory.with_ratios([_row("alone", 300.0), _row("tf1", 540.0)])[1][
        "bound_mb"] == pytest.approx(462.0)  # 300 + 76 + 64, +5%


def test_the_median_of_the_probes_is_the_figure():
    probes = [dict(model="mlp", path="window", n=8, b=32, limit_mb=None, gpu=False,
                   peak_mb=peak, current_mb=1.0, weights_mb=2.0, largest_mb=1.0,
                   accumulators_mb=2.0, oom=False, seconds=5.0) for peak in (9.0, 7.0, 30.0)]
    probes.append(dict(probes[0], oom=True, peak_mb=None))
    del probes[-1]["peak_mb"]
    row = memory.summarize(probes)
    assert row["peak_mb"] == 9.0 and row["peaks"] == [9.0, 7.0, 30.0]
    assert row["ooms"] == 1 and row["probes"] == 4


def test_growth_is_the_largest_n_over_the_smallest_by_the_peak_most_probes_landed_on():
    # Each N's probes land in modes: a median would compare 61 with 49, the lowest 49
    # with 61; most probes landed on 61 (within 1%) at both.
    tables = {32: [dict(_row("window", 61.2), peaks=[61.2, 49.0, 61.3, 69.0, 61.2])],
              2: [dict(_row("window", 49.1), peaks=[49.1, 61.0, 49.1, 61.1, 61.0])]}
    (row,) = memory.growth(tables)
    assert row["peaks"] == {2: 61.0, 32: 61.2} and row["growth"] == pytest.approx(61.2 / 61.0)
    assert ("| window | 61.0 | 61.2 | 1.003 | 49.1, 49.1, 61.0, 61.0, 61.1 | "
            "49.0, 61.2, 61.2, 61.3, 69.0 |" in memory.growth_markdown([row]))


def test_the_usual_peak_is_the_largest_mode_the_lower_of_a_tie():
    assert memory.usual_peak([]) is None
    assert memory.usual_peak([83.0]) == 83.0
    assert memory.usual_peak([49.1, 61.0, 49.2, 61.1]) == pytest.approx(49.15)
    assert memory.usual_peak([100.0, 100.5, 101.5, 300.0]) == 100.25  # 101.5: another mode


def test_help_and_bad_paths():
    done = run_cli("--help", module="tools.memory", timeout=60)
    assert done.returncode == 0 and "--paths" in done.stdout and "--limit-mb" in done.stdout
    done = run_cli("--paths=alone,sideways", module="tools.memory", timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "error: --paths: unknown sideways; choose from " + ", ".join(memory.PATHS)]
