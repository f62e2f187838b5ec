"""tools/bench*.py: the quick benchmark runs end to end; targets are judged and explained."""

import os
import statistics

import pytest
from absl.testing import flagsaver

from experiment import cli
from experiment import faults
from experiment import results
from tests.helpers import ROOT, run_cli
from experiment import averagers
from tools import bench_contenders
from tools import bench_report
from tools import bench_targets

STATUSES = {"met", "missed", "within noise", "not measured"}


def _profile(wall_ms, conv_ms, conv_calls):
    return {"wall_ms": wall_ms, "kernel_ms": {"conv": conv_ms, "other": 1.0},
            "calls": {"conv": conv_calls, "other": 50}, "top": []}


def _row(n, b, fused_ratio, stack_ratios, stack=2.0):
    """A speed row as speed_section makes it, from chosen per-round ratios (stack's and
    fused's to direct, the others' to stack)."""
    ratios = {"direct": [1.0, 1.0, 1.0], "fused": [fused_ratio] * 3, "keras": [3.0] * 3}
    times = {k: [r * 0.01 for r in v] for k, v in ratios.items()}
    times["stack"] = [0.01 * stack] * 3
    for s, rs in stack_ratios.items():
        times[s] = [0.01 * stack * r for r in rs]
    for s in averagers.AVERAGERS:  # averagers a test does not name: as fast as stack
        times.setdefault(s, list(times["stack"]))
    times["keras_long"] = [0.04] * 3
    return {"n": n, "b": b, "times": times, "keras_best": "keras",
            "profiles": {"direct": _profile(10.0, 6.0, 6), "fused": _profile(12.0, 9.0, 30),
                         "stack": _profile(20.0, 9.0, 30), "running": _profile(20.0, 9.0, 30),
                         "graph": _profile(20.0, 9.0, 30), "keras": _profile(30.0, 9.0, 30)},
            "median_ms": {k: 1e3 * statistics.median(v) for k, v in times.items()},
            "vs_direct": {k: bench_contenders.paired_ratio(times, k, "direct") for k in times},
            "vs_stack": {k: bench_contenders.paired_ratio(times, k, "stack") for k in times},
            "keras_vs_fused": bench_contenders.keras_vs_fused(times)[1]}


def test_targets_are_judged_from_the_ratios_and_missed_ones_explained():
    speed = [_row(5, 20, 1.10, {"running": [0.9, 0.95, 0.99], "graph": [0.9] * 3}),
             _row(20, 5, 1.80, {"running": [0.98, 1.02, 1.05], "graph": [1.1, 1.2, 1.3]})]
    eigen = {"kernels": [{"n": 20, "b": 5, "direct_ms": 11.0, "fused_ms": 12.1, "ratio": 1.1,
                          "onednn_ops": False}]}
    targets = {t["target"]: t for t in bench_targets.evaluate_targets(speed, None, None, eigen)}
    assert targets["fused <= 1.15x direct at N=5/B=20"]["status"] == "met"
    missed = targets["fused <= 1.5x direct at N=20/B=5"]
    assert missed["status"] == "missed" and missed["measured"] == "1.80x"
    assert missed["why"].startswith("Missed by 20%.")
    # the profile's account: 30 conv calls of 0.3 ms against 6 of 1 ms
    assert "conv 9.00 ms in 30 calls (300 us a call) for fused" in missed["why"]
    assert "run 5x as often" in missed["why"]
    assert "with oneDNN off (TF_ENABLE_ONEDNN_OPTS=0, TensorFlow's Eigen kernels, a separate " \
        "process), fused took 1.10x direct here" in missed["why"]
    assert targets["running never slower than stack (N > 1)"]["status"] == "within noise"
    assert targets["graph never slower than stack (N > 1)"]["status"] == "missed"
    keras = targets["fused >= 2x faster than Keras's accumulation, every (N, B)"]
    assert keras["status"] == "missed" and keras["measured"].startswith("worst 1.67x")
    assert all(t["status"] in STATUSES for t in targets.values())


def test_tf2_targets_pair_each_round_with_fused_and_keras():
    fast, slow = _row(5, 20, 1.10, {}), _row(20, 5, 1.30, {})
    fast["times"]["tf2"] = [t * r for t, r in zip(fast["times"]["fused"], (1.2, 1.0, 1.1))]
    slow["times"]["tf2"] = [t * r for t, r in zip(slow["times"]["fused"], (1.1, 1.3, 1.25))]
    slow["times"]["keras"] = [t * 1.2 for t in slow["times"]["tf2"][:2]] + [0.001]
    for row in (fast, slow):
        row["profiles"]["tf2"] = _profile(15.0, 9.0, 30)
        row["median_ms"]["tf2"] = 1e3 * statistics.median(row["times"]["tf2"])
    targets = {t["target"]: t for t in bench_targets.tf2_targets([fast, slow])}
    assert targets["tf2 <= 1.15x fused at N=5/B=20"]["measured"] == "1.10x"
    assert targets["tf2 <= 1.15x fused at N=5/B=20"]["status"] == "met"
    missed = targets["tf2 <= 1.15x fused at N=20/B=5"]
    assert missed["status"] == "missed" and missed["measured"] == "1.25x"
    assert missed["why"].startswith("Missed by 9% (paired rounds, quartiles 1.18-1.27).")
    keras = targets["tf2 faster than Keras's accumulation with steps_per_execution=N (N > 1)"]
    # the median of the paired rounds, not the ratio of medians: one fast Keras round
    # does not decide it
    assert keras["status"] == "met" and keras["measured"] == "worst 0.83x Keras at N=20/B=5"
    slow["times"]["keras"] = [t * 0.9 for t in slow["times"]["tf2"]]
    targets = {t["target"]: t for t in bench_targets.tf2_targets([fast, slow])}
    assert targets[keras["target"]]["status"] == "missed"
    without = {t["target"]: t["status"] for t in bench_targets.tf2_targets([_row(5, 20, 1, {})])}
    assert set(without.values()) == {"not measured"}


def test_noise_floor_comes_from_the_identical_graphs_at_n_1():
    same = _row(1, 100, 1.0, {"running": [1.1, 1.12, 1.2], "graph": [1.0] * 3}, stack=1.0)
    slower = _row(20, 5, 1.8, {"running": [1.02, 1.05, 1.08], "graph": [1.15, 1.2, 1.3]})
    assert abs(bench_targets.noise_floor([same, slower]) - 0.12) < 1e-9  # running's 1.12x at N=1
    targets = {t["target"]: t for t in bench_targets.evaluate_targets([same, slower], None, None)}
    assert targets["running never slower than stack (N > 1)"]["status"] == "within noise"
    assert "identical graphs differed by up to 12%" in \
        targets["running never slower than stack (N > 1)"]["why"]
    assert targets["graph never slower than stack (N > 1)"]["status"] == "missed"


def _probe(peak, before, imported=540):
    return {"peak_mb": peak, "baseline_mb": before, "increment_mb": peak - before,
            "import_mb": imported}


def test_memory_targets_use_peak_rss_and_host_memory_its_growth_per_mini_batch():
    mem = {"samples": 16384, "n": 128, "b": 128, "direct": _probe(1464, 680),
           "small": _probe(706, 680), "accumulated": {"running": _probe(706, 679),
                                                      "fused": _probe(810, 668)}}
    grad = 76.4
    host = {"grad_mb": grad, "params": 20037642, "ns": (1, 2, 4, 8), "skipped": {},
            "averagers": ("stack", "running"),
            "table": {("stack", 2): {"peak_mb": 1100}, ("stack", 4): {"peak_mb": 1100 + 4 * grad},
                      ("stack", 8): {"peak_mb": 1100 + 12 * grad},
                      ("running", 2): {"peak_mb": 1226}, ("running", 4): {"peak_mb": 1229},
                      ("running", 8): {"peak_mb": 1220}}}
    targets = {t["target"]: t for t in bench_targets.evaluate_targets([], mem, host)}
    small = targets["accumulated peak <= 1.25x that of B=128 alone"]
    assert small["status"] == "met" and small["measured"] == "worst 1.15x (fused)"
    direct = targets["accumulated peak <= 0.25 of the direct batch's"]
    assert direct["status"] == "missed" and "540 MB of it right after importing" in direct["why"]
    running = targets["host memory of running flat in N"]
    assert running["status"] == "met" and running["measured"].startswith("-1.2 MB per added")
    assert abs(bench_targets.host_slope(host, "stack") / grad - 2.0) < 1e-6
    text = "\n".join(bench_report.host_markdown(host))
    assert "stack +152.8 MB (+2.000 gradients)" in text


def test_quick_bench_runs_end_to_end_and_writes_its_markdown(tmp_path):
    committed = os.path.join(ROOT, "BENCHMARKS.md")
    before = open(committed).read() if os.path.exists(committed) else None
    out = tmp_path / "quick.md"
    proc = run_cli("--quick", f"--output={out}", module="tools.bench", timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = out.read_text()
    for heading in ("## Targets", "## Speed", "## Profile", "## The same on Eigen kernels",
                    "## Peak memory at 512 samples", "## Method"):
        assert heading in text, heading
    assert f"`python -m tools.bench --quick --output={out}`" in text and "TensorFlow 2." in text
    rows = [line.split(" | ") for line in text.splitlines()
            if line.startswith("| ") and line.rstrip().endswith(tuple(STATUSES) + ("|",))]
    statuses = [r[-1].strip(" |") for r in rows if r[-1].strip(" |") in STATUSES]
    assert len(statuses) >= 8 and "met" in statuses
    for line in text.splitlines():  # every missed target is explained
        if line.startswith("| ") and line.endswith("| missed |"):
            assert f"- **{line.split(' | ')[0][2:]}** (missed)" in text
    assert "Targets:" in proc.stdout
    with open(tmp_path / "quick.png", "rb") as f:  # the ratios, next to the markdown
        assert f.read(8) == b"\x89PNG\r\n\x1a\n" and len(f.read()) > 10_000
    assert "![Speed and memory ratios](quick.png)" in text
    assert "\r" not in proc.stdout + proc.stderr  # no bar when stderr is not a terminal
    after = open(committed).read() if os.path.exists(committed) else None
    assert after == before  # --output went elsewhere


def test_bad_input_gets_one_line_and_a_nonzero_exit(tmp_path, capsys):
    """In this process (tools.bench's flags beside main.py's); the quick bench above
    runs it as a process."""
    from tools import bench
    for args, message in [
            ([f"--output={tmp_path}/missing/b.md", "--quick"],
             f"--output {tmp_path}/missing/b.md: directory"),
            (["--probe=not json"], "--probe: not JSON"),
            (["--quick=maybe"], "--quick")]:
        with flagsaver.flagsaver(), pytest.raises(SystemExit) as exit_info:
            bench.main_bench(cli.parse_flags(["bench", *args]))
        assert exit_info.value.code not in (0, None), args
        captured = capsys.readouterr()
        lines = captured.err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], \
            (args, captured.err[-500:])
        assert not os.path.exists(tmp_path / "missing"), args


@pytest.mark.parametrize("victim", ["BENCHMARKS.png", "BENCHMARKS.md"])
def test_a_full_disk_keeps_the_previous_benchmarks_pair(tmp_path, victim):
    """Either file of the pair cannot be written: one line, and the old pair stays whole."""
    md, png = tmp_path / "BENCHMARKS.md", tmp_path / "BENCHMARKS.png"
    bench_report.write(str(md), "old report\n", str(png), b"old figure")
    with faults.injected("ENOSPC", str(tmp_path / victim)):
        with pytest.raises(results.WriteError) as raised:
            bench_report.write(str(md), "new report\n", str(png), b"new figure")
    assert str(raised.value) == (f"cannot write {png} and {md} (No space left on device); "
                                 "what was there before is kept")
    assert (md.read_text(), png.read_bytes()) == ("old report\n", b"old figure")
    assert sorted(os.listdir(tmp_path)) == ["BENCHMARKS.md", "BENCHMARKS.png"]
    # A run that draws no figure: its markdown alone, not beside the older figure.
    bench_report.write(str(md), "no figure\n", str(png), None)
    assert sorted(os.listdir(tmp_path)) == ["BENCHMARKS.md"]
