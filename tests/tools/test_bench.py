"""tools/bench*.py: the section contract and the probe protocol, targets judged from the
measured ratios, and the quick benchmark end to end."""

import os
import statistics

import pytest
from absl.testing import flagsaver

from experiment import cli
from experiment import faults
from experiment import results
from tests.helpers import ROOT
from tests.helpers import run_cli
from tools import bench_contenders
from tools import bench_memory
from tools import bench_probe
from tools import bench_speed
from tools.bench_section import Run
from tools.bench_section import Section
from tools.bench_section import Target

STATUSES = {"met", "missed", "within noise", "not measured"}


def echo_probe(spec):
    """A probe for the protocol's test: its spec back with its process id, or a failure."""
    if spec.get("fail"):
        raise ValueError("boom")
    return dict(spec, pid=os.getpid())


def _row(n, b, **ratios):
    """A speed row as Speed.measure makes it: `ratios` gives a label's per-round times
    as ratios to direct's; every label it does not name is as fast as direct."""
    times = {k: [0.01 * r for r in ratios.get(k, [1.0] * 3)] for k in bench_speed.LABELS}
    return dict(n=n, b=b, times=times, profiles={},
                median_ms={k: 1e3 * statistics.median(t) for k, t in times.items()},
                vs_direct={k: bench_contenders.paired_ratio(times, k, "direct") for k in times})


def test_ratios_are_paired_per_round_not_taken_of_medians():
    r = bench_contenders.paired_ratio({"a": [1.0, 2.0, 3.0], "b": [1.0, 1.0, 30.0]}, "a", "b")
    assert r == {"ratio": 1.0, "q1": 0.55, "q3": 1.5}  # the medians' ratio would be 2.0


def test_speed_targets_are_judged_from_paired_ratios_and_keras_only_where_it_accumulates():
    speed = [_row(1, 100, running=[1.1, 1.12, 1.2], keras=[1.06] * 3, keras_long=[1.2] * 3),
             _row(5, 20, fused=[1.1] * 3, stack=[2.0] * 3, running=[1.9, 2.1, 2.2],
                  graph=[2.4] * 3, keras=[3.0] * 3, keras_long=[3.3] * 3, tf2=[1.2, 1.1, 1.0],
                  keras_fit=[2.7] * 3),
             _row(20, 5, fused=[1.8] * 3, stack=[4.0] * 3, keras=[4.0] * 3,
                  keras_long=[5.0] * 3, tf2=[2.0, 2.4, 2.3], tf2_p2=[1.6, 1.8, 1.9],
                  keras_fit_p2=[1.3] * 3)]
    targets = {t.target: t for t in bench_speed.Speed().targets(speed)}
    assert len(targets) == 12 and {t.status for t in targets.values()} <= STATUSES
    assert targets["fused <= 1.15x direct at N=5/B=20"] == Target(
        "fused <= 1.15x direct at N=5/B=20", "1.10x (1.10-1.10)", "met")
    assert targets["fused <= 1.5x direct at N=20/B=5"].status == "missed"
    # running at 1.05x stack (quartiles 1.00-1.08); identical graphs differed by 12% at N=1
    running = targets["running never slower than stack (N > 1)"]
    assert running.status == "within noise"
    assert running.measured == "worst 1.05x (1.00-1.08) at N=5/B=20"
    assert targets["graph never slower than stack (N > 1)"].status == "missed"
    assert targets["fused never slower than stack (N > 1)"].status == "met"
    # Keras at N=1 (1.06x fused's time) does not accumulate: the worst is N=20's 2.22x.
    keras = targets["fused >= 2x faster than Keras's accumulation (N > 1)"]
    assert keras.status == "met" and keras.measured.startswith("worst 2.22x")
    assert keras.measured.endswith("at N=20/B=5")
    assert targets["tf2 <= 1.15x fused at N=5/B=20"].status == "met"
    assert targets["tf2 <= 1.15x fused at N=20/B=5"] == Target(
        "tf2 <= 1.15x fused at N=20/B=5", "1.28x (1.19-1.31)", "missed")
    tf2_keras = targets["tf2 faster than Keras's accumulation with steps_per_execution=N (N > 1)"]
    assert tf2_keras.status == "met" and tf2_keras.measured.startswith("worst 0.57x")
    # Two passes at once, judged at B <= 10 only (N=5/B=20's rows are left out).
    assert targets["tf2 with two passes at once faster than one at a time (B <= 10)"] == Target(
        "tf2 with two passes at once faster than one at a time (B <= 10)",
        "0.80x (0.78-0.81)", "met")
    assert targets["keras_fit with two passes at once faster than one at a time "
                   "(B <= 10)"].status == "missed"
    fit = [t for name, t in targets.items() if name.startswith("fit with accumulate")]
    assert fit[0].measured == "0.90x (0.90-0.90)" and fit[0].status == "met"
    assert bench_speed.noise_floor(speed) == pytest.approx(0.12)  # running's 1.12x at N=1
    quick = bench_speed.Speed(quick=True).targets([speed[1]])
    assert {t.status for t in quick if "N=20/B=5" in t.target} == {"not measured"}


def test_host_memory_is_judged_by_its_growth_per_mini_batch():
    grad = 76.4
    host = {"grad_mb": grad, "ns": (1, 2, 4, 8), "skipped": {},
            "averagers": ("stack", "running"),
            "table": {("stack", 2): {"peak_mb": 1100}, ("stack", 4): {"peak_mb": 1100 + 4 * grad},
                      ("stack", 8): {"peak_mb": 1100 + 12 * grad},
                      ("running", 2): {"peak_mb": 1226}, ("running", 4): {"peak_mb": 1229},
                      ("running", 8): {"peak_mb": 1220}}}
    (running,) = bench_memory.HostGrowth().targets(host)
    assert running.status == "met" and running.measured.startswith("-1.2 MB per added")
    assert bench_memory.host_slope(host, "stack") / grad == pytest.approx(2.0)
    assert "stack +152.8 MB (+2.000 gradients)" in "\n".join(
        bench_memory.HostGrowth().markdown(host))


class _First(Section):
    name, title = "first", "The first"
    QUICK = None

    def measure(self, run):
        return 1


class _Second(Section):
    """It reads the section before it, and reports one of its three steps itself."""
    name, title = "second", "The second"

    def steps(self):
        return 3

    def measure(self, run):
        run.step()
        return run.results["first"] + 1

    def targets(self, result):
        return [Target("second is 2", str(result), "met" if result == 2 else "missed")]


def test_tensor_memory_targets_take_the_worst_path_against_bound_keras_and_growth():
    from tools import bench_tensor_memory
    from tools import memory

    def row(path, peak):
        return dict(model="mlp", path=path, n=8, b=32, limit_mb=None, gpu=False, probes=1,
                    peaks=[peak], ooms=0, errors=[], seconds=1.0, peak_mb=peak,
                    current_mb=0.0, weights_mb=80.0, largest_mb=64.0, accumulators_mb=80.0)

    rows = memory.with_ratios([row("alone", 360.0), row("direct", 375.0), row("keras", 525.0),
                               row("accumulate", 510.0), row("window", 530.0)])
    growth = [{"path": "window", "peaks": {2: 50.0, 32: 50.5}, "growth": 1.01},
              {"path": "accumulate", "peaks": {2: 50.0, 32: 52.0}, "growth": 1.04}]
    section = bench_tensor_memory.TensorMemory()
    bound, keras, flat = section.targets({"tables": {"mlp": rows}, "growth": growth})
    # The bound: 360 + 80 + 64 = 504, +5%: 529.2; window's 530 is over it.
    assert bound.status == "missed" and "(window)" in bound.measured
    # Keras's 525 + 5%: both under.
    assert keras.status == "met" and "(window)" in keras.measured
    assert flat.status == "missed" and "1.040 (accumulate)" in flat.measured


def test_micro_batch_bisects_to_the_largest_that_fits_and_judges_found_and_search(
        monkeypatch):
    from tools import bench_micro_batch
    from tools import memory
    # A fake device: the direct batch fits the mlp only; B fits up to `edge` (above it,
    # training runs out of memory and goes on at half B, as EffectiveWindows does), but
    # the convnet's found B not in a fresh process; the search finds `found` in `search`
    # seconds (each of its three repeats its own), the mlp's in 3 windows that it
    # trained, in a warm-up of 90, 62 then 60 s where a process given B takes 5 s for its
    # first (its second search finds 3500); an update is slower at a smaller B.
    edge, found = {"convnet": 100, "mlp": 4093}, {"convnet": 84, "mlp": iter([3600, 3500, 3600])}
    search = {"convnet": iter([30.0, 21.0, 20.0]), "mlp": iter([90.0, 62.0, 60.0])}
    windows = {"convnet": 2, "mlp": 3}
    sizes = []

    def _ms(size):
        return 100 + 1e4 / size

    def probe(model, path, n, b, limit_mb=None, micro_batch=None, timed=0):
        size = micro_batch
        if micro_batch == "auto":
            size = found[model] if model == "convnet" else next(found[model])
        if path == "direct":
            return dict(oom=model == "convnet", peak_mb=1.0, update_ms=1.0)
        sizes.append(size)
        if (model, micro_batch) == ("convnet", 84):
            return dict(oom=True)
        seconds = next(search[model]) if micro_batch == "auto" else None
        searched = dict(search_s=seconds, search_windows=windows[model],
                        trials=[(1, 1.0)] * 9,
                        warmup_ms=seconds * 1e3 if micro_batch == "auto" else 5_000.0)
        if size > edge[model]:
            return dict(oom=False, peak_mb=1.0, update_ms=_ms(size // 2),
                        micro_batch_size=size // 2, halved=[size], **searched)
        return dict(oom=False, peak_mb=1.0, update_ms=_ms(size), micro_batch_size=size,
                    **searched)

    monkeypatch.setattr(memory, "probe", probe)
    section = bench_micro_batch.MicroBatch()
    section.settings = dict(section.settings, runs=(("convnet", 257, (150,)),
                                                    ("mlp", 4093, (700,))))
    convnet, mlp = result = section.measure(Run(log=lambda line: None))
    # Three times the found B, then given to a fresh process (OOM); the direct batch ran
    # out of memory: B = E is not tried; bisection up from 84 to 2%.
    assert sizes[:13] == [84] * 6 + [170, 127, 105, 94, 99, 102, 100]
    assert convnet["probes"] == 7
    assert convnet["given"] == "OOM" and convnet["found_ms"] == _ms(84)  # the finder's
    assert (convnet["largest"], convnet["over"], convnet["largest_ms"]) == (100, 102, _ms(100))
    # The direct batch fits: B = E first, and it fits.
    assert sizes[13:] == [3600, 3600, 3500, 3500, 3600, 3600, 4093]
    assert (mlp["largest"], mlp["over"]) == (4093, None)
    assert mlp["given"] == "fits"
    assert mlp["epoch_s"] == pytest.approx(15 * _ms(3600) / 1e3)  # 60,000 / 4093: 15
    share, speed = section.targets(result)
    assert share == Target("micro-batch found >= 80% of the largest that fits",
                           "worst 0.84x convnet under 150 MiB", "met")
    assert speed.status == "missed"
    # The convnet's given B ran out of memory: its search's own seconds less its 2
    # windows at its own fastest update; the median of three.
    assert convnet["search_s"] == pytest.approx(21.0 - 2 * _ms(84) / 1e3)
    # The mlp's search added its 3 windows' warm-up less the given B's first update and
    # two more at its fastest: the median of three.
    assert mlp["search_s"] == pytest.approx(62.0 - 5.0 - 2 * _ms(3500) / 1e3)  # the 2nd
    assert speed.measured == f"worst {mlp['search_s'] / mlp['epoch_s']:.2f}x mlp under 700 MiB"
    text = "\n".join(section.markdown(result))
    assert ("| convnet | 257 | 150 | OOM | 84 (OOM) | 100 (102: OOM) | 0.84 | "
            "20.6 (29.6, 20.6, 19.6; 9, 2) |") in text
    assert "; 9, 3; B found 3600, 3500, 3600) |" in text
    assert "| mlp | 4093 | 700 | fits | 3600 (fits) | 4093 | 0.88 |" in text
    failed = section.targets([dict(mlp, error="probe failed (exit 1): boom")])
    assert [t.status for t in failed] == ["missed", "missed"]
    assert "| probe failed (exit 1): boom |" in "\n".join(section.markdown(
        [dict(mlp, error="probe failed (exit 1): boom")]))


def test_micro_batch_stops_at_a_search_that_fails(monkeypatch):
    from tools import bench_micro_batch
    from tools import memory
    calls = []

    def probe(model, path, n, b, limit_mb=None, micro_batch=None, timed=0):
        calls.append(micro_batch)
        if path == "direct":
            return dict(oom=True)
        if micro_batch == "auto" and calls.count("auto") == 2:
            return dict(error="probe failed (exit 1): boom")
        return dict(oom=False, peak_mb=1.0, update_ms=100.0, micro_batch_size=50,
                    search_s=1.0, search_windows=2, trials=[(1, 1.0)], warmup_ms=2000.0)

    monkeypatch.setattr(memory, "probe", probe)
    section = bench_micro_batch.MicroBatch()
    section.settings = dict(section.settings, runs=(("convnet", 257, (150,)),))
    row, = section.measure(Run(log=lambda line: None))
    assert row["error"] == "probe failed (exit 1): boom"
    assert calls == [None, "auto", 50, "auto"]  # no probe after the failed search


def test_micro_batch_probes_an_xla_row_compiled(monkeypatch):
    """A run marked XLA: every probe of its row's accumulate path compiled with
    jit_compile=True (the direct batch's not), and the row and its targets named so."""
    from tools import bench_micro_batch
    from tools import memory
    compiled = []

    def probe(model, path, n, b, limit_mb=None, micro_batch=None, timed=0, **kwargs):
        if path == "direct":  # not compiled: Keras's XLA step aborts where it runs out
            assert "jit_compile" not in kwargs
            return dict(oom=True)
        compiled.append(kwargs.get("jit_compile"))
        size = 64 if micro_batch == "auto" else micro_batch
        return dict(oom=size > 70, peak_mb=1.0, update_ms=100.0, micro_batch_size=size,
                    search_s=1.0, search_windows=1, trials=[(1, 1.0)], warmup_ms=2000.0)

    monkeypatch.setattr(memory, "probe", probe)
    section = bench_micro_batch.MicroBatch()
    section.settings = dict(section.settings, runs=(("convnet", 257, (150,), True),))
    result = section.measure(Run(log=lambda line: None))
    assert compiled and all(compiled), compiled
    assert (result[0]["found"], result[0]["largest"]) == (64, 70)
    assert "| convnet (XLA) | 257 | 150 | OOM | 64 (fits) | 70 (71: OOM) |" in "\n".join(
        section.markdown(result))
    share, _ = section.targets(result)
    assert share.measured == "0.91x"  # one row: no worst to name


def test_a_run_measures_each_section_in_turn_and_advances_the_bar_by_its_steps():
    advanced, lines = [], []
    run = Run(log=lines.append, advance=advanced.append)
    assert run.measure([_First(), _Second()]) == [Target("second is 2", "2", "met")]
    assert run.results == {"first": 1, "second": 2}
    assert advanced == [1, 1, 2] and lines[0].startswith("(The first: ")
    assert _First(quick=True).settings is None and _Second(quick=True).settings == {}


@pytest.mark.slow
def test_a_probe_runs_in_a_fresh_process_and_a_failure_is_one_line():
    ok, failed = bench_probe.probe_all(echo_probe, [{"x": 1}, {"fail": True}], jobs=2)
    assert ok["x"] == 1 and ok["deterministic"] is True and ok["pid"] != os.getpid()
    assert failed["error"] == "probe failed (exit 1): ValueError: boom"


def test_a_probe_refused_under_determinism_is_measured_again_without_it(monkeypatch):
    line = "op determinism is on and TensorFlow has no deterministic kernel here: X"
    calls = []

    def spawn(function, spec, env, timeout):
        calls.append(spec["deterministic"])
        if spec["deterministic"]:
            return dict(spec, error=line, determinism=True)
        return dict(spec, peak_mb=300.0)

    monkeypatch.setattr(bench_probe, "spawn", spawn)
    result = bench_probe.probe(echo_probe, {"x": 1})
    assert calls == [True, False]
    assert result == {"x": 1, "deterministic": False, "peak_mb": 300.0,
                      "determinism_error": line}


@pytest.mark.slow
def test_quick_bench_runs_end_to_end_and_writes_its_markdown(tmp_path):
    committed = os.path.join(ROOT, "BENCHMARKS.md")
    before = open(committed).read() if os.path.exists(committed) else None
    out = tmp_path / "quick.md"
    proc = run_cli("--quick", f"--output={out}", module="tools.bench", timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = out.read_text()
    for heading in ("## Targets", "## Speed", "## Profile", "## The same on Eigen kernels",
                    "## Host memory as N grows", "## AveragingOptimizer's train op",
                    "## Device memory and speed"):
        assert heading in text, heading
    assert "## Keras used plainly" not in text  # left out of --quick
    assert "## Tensor memory" in text and "| accumulate |" in text
    assert f"`python -m tools.bench --quick --output={out}`" in text and "TensorFlow 2." in text
    statuses = [line.split(" | ")[-1].strip(" |") for line in text.splitlines()
                if line.startswith("| ") and line.split(" | ")[-1].strip(" |") in STATUSES]
    assert len(statuses) >= 17 and "met" in statuses
    assert "Targets:" in proc.stdout
    with open(tmp_path / "quick.png", "rb") as f:  # the ratios, next to the markdown
        assert f.read(8) == b"\x89PNG\r\n\x1a\n" and len(f.read()) > 10_000
    assert "![Speed ratios](quick.png)" in text
    assert "\r" not in proc.stdout + proc.stderr  # no bar when stderr is not a terminal
    after = open(committed).read() if os.path.exists(committed) else None
    assert after == before  # --output went elsewhere


def test_bad_input_gets_one_line_and_a_nonzero_exit(tmp_path, capsys):
    """In this process (tools.bench's flags beside main.py's); the quick bench above
    runs it as a process."""
    from tools import bench
    runs = [(lambda args: bench.main_bench(cli.parse_flags(["bench", *args])), args, message)
            for args, message in [([f"--output={tmp_path}/missing/b.md", "--quick"],
                                   f"--output {tmp_path}/missing/b.md: directory"),
                                  (["--quick=maybe"], "--quick")]]
    runs += [(bench_probe.main, ["probe", "tools.bench_memory:rss_probe", "not json"],
              "probe spec: not JSON"), (bench_probe.main, ["probe"], "usage: ")]
    for main, args, message in runs:
        with flagsaver.flagsaver(), pytest.raises(SystemExit) as exit_info:
            main(args)
        assert exit_info.value.code not in (0, None), args
        captured = capsys.readouterr()
        lines = captured.err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], \
            (args, captured.err[-500:])
        assert not os.path.exists(tmp_path / "missing"), args


@pytest.mark.parametrize("victim", ["BENCHMARKS.png", "BENCHMARKS.md"])
def test_a_full_disk_keeps_the_previous_benchmarks_pair(tmp_path, victim):
    """Either file of the pair cannot be written: one line, and the old pair stays whole."""
    from tools import bench
    md, png = tmp_path / "BENCHMARKS.md", tmp_path / "BENCHMARKS.png"
    bench.write(str(md), "old report\n", str(png), b"old figure")
    with faults.injected("ENOSPC", str(tmp_path / victim)):
        with pytest.raises(results.WriteError) as raised:
            bench.write(str(md), "new report\n", str(png), b"new figure")
    assert str(raised.value) == (f"cannot write {png} and {md} (No space left on device); "
                                 "what was there before is kept")
    assert (md.read_text(), png.read_bytes()) == ("old report\n", b"old figure")
    assert sorted(os.listdir(tmp_path)) == ["BENCHMARKS.md", "BENCHMARKS.png"]
    # A run that draws no figure: its markdown alone, not beside the older figure.
    bench.write(str(md), "no figure\n", str(png), None)
    assert sorted(os.listdir(tmp_path)) == ["BENCHMARKS.md"]
