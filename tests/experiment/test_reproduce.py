"""The reproduction of the post's table (experiment/reproduce.py): the table, resume, events, make.

The table is checked against numbers worked out by hand; resume and `make reproduce` with
real, tiny runs. Its statistics are tests/experiment/test_stats.py's.
"""

import glob
import json
import math
import os
import shutil
import subprocess
import sys

import pytest
import tensorflow as tf
from absl import flags as absl_flags
from absl.testing import flagsaver

import flags
from experiment import config
from experiment import faults
from experiment import loop
from experiment import reproduce
from experiment import reproduce_table
from experiment import results
from tests.helpers import ROOT
from tests.helpers import run_cli

v1 = tf.compat.v1
MAKE_TIMEOUT = 300
SMOKE_SCALE = 1000  # every configuration applies one update


# ---------------------------------------------------------------- the table


def plant(spec, best, final, **config_changes):
    """A finished run file for `spec`, as main.py would have written it."""
    config = dict(spec.flags, threads=1, results=spec.path, logdir=None, verbose=False)
    config.update(config_changes)
    updates = spec.setting.iterations // spec.setting.average_gradients
    run = {"seed": spec.seed, "best_accuracy": best, "best_iteration": 1,
           "final_accuracy": final, "updates": updates, "train_seconds": 2.0,
           "eval_seconds": 1.0}
    os.makedirs(os.path.dirname(spec.path), exist_ok=True)
    results.atomic_write_json(spec.path, results.results_document(config, [run]))


# Best accuracies of three runs per N (the final is 0.1 lower): N=5 sits 0.6 above N=1,
# and above the post's 94.9; the others lie within their intervals around the post's.
BESTS = {1: [94.9, 95.0, 95.1], 5: [95.5, 95.6, 95.7], 10: [95.0, 95.1, 95.2],
         20: [95.1, 95.2, 95.3]}


def planted_table(tmp_path, fair=False):
    out_dir = str(tmp_path / "fair") if fair else str(tmp_path)
    specs = reproduce.plan(out_dir, reps=3, seed=0, scale=1, fair=fair,
                           accumulate=reproduce.DEFAULT_ACCUMULATE)
    for spec in specs:
        best = BESTS[spec.setting.average_gradients][spec.rep]
        plant(spec, best, best - 0.1)
    logged = []
    text = reproduce.reproduce(str(tmp_path), reps=3, fair=fair, log=logged.append)
    return specs, text, logged


def test_table_and_verdict_from_numbers_worked_by_hand(tmp_path):
    specs, text, logged = planted_table(tmp_path)
    assert "12 already done" in logged[0] and "0 to run" in logged[0]
    # Planted runs, as runs recorded before evaluations were kept, have no curves: that
    # figure is left out with a note; the spread of the best accuracies is drawn.
    assert logged[1:] == [f"{reproduce.CURVES_PNG} not drawn: accuracy curves: no run has "
                          "evaluations to draw (runs recorded before evaluations were kept "
                          "have none)."]
    assert not os.path.exists(tmp_path / reproduce.CURVES_PNG)
    assert os.path.getsize(tmp_path / reproduce.BEST_PNG) > 10_000
    assert f"![{reproduce.BEST_PNG}]({reproduce.BEST_PNG})" in text
    assert f"- {logged[1]}" in text and f"]({reproduce.CURVES_PNG})" not in text
    with open(tmp_path / "table.md") as f:
        assert f.read() == text
    rows = [line for line in text.splitlines() if line.startswith("| ")][1:]
    assert [row.split(" | ")[0] for row in rows] == ["| 1", "| 5", "| 10", "| 20"]
    cells = {row.split(" | ")[0][2:]: row.split(" | ") for row in rows}
    header = reproduce_table.TABLE_HEADER.split(" | ")
    column = {name: header.index(name) for name in header}
    # N=1: mean 95.0, population std sqrt(0.02 / 3); CI 95 +/- 4.3027 * 0.1 / sqrt(3).
    assert cells["1"][column["post: best"]] == "95.0 ± 0.172"
    assert cells["1"][column["ours: best"]] == "95.00 ± 0.082"
    assert cells["1"][column["95% CI of ours"]] == "[94.75, 95.25]"
    assert cells["1"][column["ours: final"]] == "94.90 ± 0.082"
    assert cells["5"][column["95% CI of ours"]] == "[95.35, 95.85]"
    # Equal variances, n = 3 each: df = 4; t^2 = 54 (N=5), 1.5 (N=10), 6 (N=20); for
    # df = 4 the two-sided p is 1 - sqrt(t^2 / (4 + t^2)) * (1 + 0.5 / (1 + t^2 / 4)).
    for n, t2 in ((5, 54.0), (10, 1.5), (20, 6.0)):
        p = 1 - math.sqrt(t2 / (4 + t2)) * (1 + 0.5 / (1 + t2 / 4))
        assert cells[str(n)][column["p vs N=1"]] == reproduce_table.fmt_p(p)
        assert cells[str(n)][column["p vs N=1 (final)"]] == reproduce_table.fmt_p(p)
    assert cells["5"][column["p vs N=1"]] == "0.0018"
    assert [cells[n][column["evaluations"]] for n in ("1", "5", "10", "20")] == \
        ["10", "50", "100", "200"]
    assert {cells[n][column["updates"]] for n in cells} == {"1000"}

    verdict = text[text.index("**Verdict**"):]
    assert "3 of 4 configurations match" in verdict
    assert "N=5: ours 95.60 (above the post's 94.9)" in verdict
    assert "finds a difference at the 5% level for N=5." in verdict
    assert "N=5 differs from N=1 (p = 0.0018, +0.60 points); the others do not" in verdict
    assert "favours configurations evaluated more often" in verdict

    with open(tmp_path / "n5-b20-it5000.json") as f:
        document = json.load(f)
    assert document["mean_accuracy"] == pytest.approx(95.6)
    assert document["std_accuracy"] == pytest.approx(math.sqrt(0.02 / 3))
    assert [r["seed"] for r in document["runs"]] == [0, 1, 2]
    assert document["config"]["reps"] == 3 and document["config"]["average-gradients"] == 5


def test_fair_table_has_its_own_directory_and_cadence(tmp_path):
    specs, text, _ = planted_table(tmp_path, fair=True)
    assert all(s.flags["eval-every"] == 0 and s.flags["eval-every-updates"] == 100
               for s in specs)
    assert os.path.exists(tmp_path / "fair" / "table.md")
    assert not os.path.exists(tmp_path / "table.md")
    assert "every configuration evaluated every 100 updates" in text
    assert "here every N is evaluated as often" in text
    rows = [line for line in text.splitlines() if line.startswith("| ")][1:]
    assert [row.split(" | ")[4] for row in rows] == ["10"] * 4  # evaluations per run


def test_a_figure_that_cannot_be_written_is_one_error(tmp_path):
    run = {"best_accuracy": 95.0, "evaluations": [
        {"iteration": 100, "updates": 100, "accuracy": 94.0},
        {"iteration": 200, "updates": 200, "accuracy": 95.0}]}
    os.mkdir(tmp_path / reproduce.BEST_PNG)  # a directory where the figure should go
    with pytest.raises(reproduce.ReproduceError, match="best_accuracy.png: cannot write"):
        reproduce.draw_figures(str(tmp_path), [(1, run), (5, run)], True, print)


def test_a_full_disk_under_the_results_dir_is_one_error_and_every_file_stays(tmp_path):
    """A per-configuration JSON, a figure or table.md cannot be written: one line, and the
    table's files and the finished runs are as they were, with no temp file beside them."""
    planted_table(tmp_path)
    before = {path: path.read_bytes() for path in tmp_path.rglob("*") if path.is_file()}
    for victim, what in (("n5-b20-it5000.json", ""), (reproduce.BEST_PNG, " the figure"),
                         ("table.md", "")):
        with faults.injected("ENOSPC", str(tmp_path / victim)):
            with pytest.raises(reproduce.ReproduceError) as raised:
                reproduce.reproduce(str(tmp_path), reps=3, log=lambda line: None)
        assert str(raised.value) == (
            f"{tmp_path / victim}: cannot write{what} (No space left on device); the finished "
            f"runs are kept in {tmp_path / 'runs'}: the same command writes it from them "
            "without running them again")
        assert {path: path.read_bytes() for path in tmp_path.rglob("*")
                if path.is_file()} == before, victim


def test_runs_made_with_other_settings_are_refused(tmp_path):
    specs = reproduce.plan(str(tmp_path), reps=1, seed=0, scale=1, fair=False,
                           accumulate=reproduce.DEFAULT_ACCUMULATE)
    plant(specs[0], 95.0, 95.0, **{"learning-rate": 0.01})
    with pytest.raises(reproduce.ReproduceError, match="--learning-rate=0.01, not 0.001"):
        reproduce.reproduce(str(tmp_path), reps=1, log=lambda line: None)
    # The command line says so in one line, without a traceback, before any training.
    process = run_cli(f"--results-dir={tmp_path}", "--reps=1", module="experiment.reproduce",
                      timeout=60)
    assert process.returncode == 1
    assert process.stderr.strip().count("\n") == 0
    assert process.stderr.startswith("error: ") and "--learning-rate" in process.stderr


@pytest.mark.parametrize("argument, named", [("--scale=0", "--scale"),
                                             ("--jobs=two", "--jobs"), ("extra", "extra")])
def test_bad_driver_input_is_one_line(argument, named):
    process = run_cli(argument, module="experiment.reproduce", timeout=60)
    assert process.returncode == 2
    assert process.stderr.startswith("error: ") and named in process.stderr
    assert process.stderr.strip().count("\n") == 0 and not process.stdout


# ---------------------------------------------------------------- cadence and events


def scalars(logdir):
    """{tag: [(step, value), ...]} from the event files in `logdir`."""
    found = {}
    for path in glob.glob(os.path.join(logdir, "events.out.tfevents.*")):
        for event in v1.train.summary_iterator(path):
            for value in event.summary.value:
                found.setdefault(value.tag, []).append((event.step, value.simple_value))
    return found


@pytest.mark.parametrize("accumulate", ["stack", "fused"])
def test_eval_every_updates_cadence_and_event_files(mnist_quick, tmp_path, accumulate):
    # N=3, 20 iterations: updates at iterations 3, 6, ..., 18, and the partial window of
    # 2 at the end is the 7th. Every 2 updates: iterations 6, 12, 18, then the final 20.
    short = config.Config(average_gradients=3, batch_size=10, iterations=20, eval_every=0,
                          eval_every_updates=2, accumulate=accumulate, threads=1)
    lines = []
    run = loop.train_once(short, mnist_quick, seed=0, verbose=True, log=lines.append,
                                logdir=str(tmp_path))
    assert [line.split(":")[0] for line in lines] == \
        ["Iteration 6", "Iteration 12", "Iteration 18", "Iteration 20"]
    assert run["updates"] == 7
    found = scalars(str(tmp_path))
    assert [step for step, _ in found["test/accuracy"]] == [2, 4, 6, 7]
    assert found["test/accuracy"][-1][1] == pytest.approx(run["final_accuracy"], abs=1e-4)
    losses = found["train/loss"]
    assert [step for step, _ in losses][:6] == [1, 2, 3, 4, 5, 6]
    assert all(math.isfinite(v) and v > 0 for _, v in losses)


def test_eval_every_updates_needs_the_iteration_cadence_off():
    with flagsaver.flagsaver():
        with pytest.raises(absl_flags.IllegalFlagValueError, match="--eval-every=0"):
            flags.FLAGS(["main.py", "--eval-every-updates=5"])
    with flagsaver.flagsaver():
        flags.FLAGS(["main.py", "--eval-every=0", "--eval-every-updates=5"])
        config = flags.train_config()
    assert (config.eval_every, config.eval_every_updates) == (0, 5)


def test_evaluation_counts_match_the_loop():
    """The count reproduce's ETA uses is the loop's own cadence (config.evaluation_due)."""
    count = config.evaluations
    assert count(config.Config(average_gradients=3, batch_size=10, iterations=20,
                                 eval_every=0, eval_every_updates=2)) == 4  # as seen above
    assert count(config.Config(average_gradients=20, batch_size=5, iterations=20000)) == 200
    assert count(config.Config(iterations=1000)) == 10
    spec = reproduce.plan("out", reps=1, seed=0, scale=1, fair=True, accumulate="fused")[3]
    assert (spec.config.average_gradients, count(spec.config)) == (20, 10)  # every 100 updates


def test_the_eta_scales_the_time_so_far_by_the_prior_seconds_left(monkeypatch):
    specs = reproduce.plan("out", reps=1, seed=0, scale=1, fair=False, accumulate="fused")
    now = [0.0]
    monkeypatch.setattr(reproduce.time, "perf_counter", lambda: now[0])
    lines = []
    tracker = reproduce.Runner(specs, 2, 1, None, False, lines.append)
    total = sum(map(reproduce.prior, specs))
    assert tracker.eta() == pytest.approx(total / 2)  # nothing done: the priors, 2 at a time
    now[0] = 120.0
    run = {"best_accuracy": 0.9, "final_accuracy": 0.8}
    tracker.finished(specs[0], run, 120.0)
    done = reproduce.prior(specs[0])
    assert tracker.eta() == pytest.approx(120.0 * (total - done) / done)
    assert lines[0].startswith("[1/4] N=1 B=100 rep 1 (seed 0): ") and "ETA" in lines[0]


# ---------------------------------------------------------------- make reproduce, resume


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """`make reproduce` with one tiny run per configuration: (results dir, stdout)."""
    results_dir = str(tmp_path_factory.mktemp("reproduce") / "results")
    process = subprocess.run(
        ["make", "--no-print-directory", "-o", ".venv/.installed", "reproduce",
         f"PY={sys.executable}", "REPS=1", f"SCALE={SMOKE_SCALE}", "JOBS=2",
         f"RESULTS_DIR={results_dir}"],
        cwd=ROOT, capture_output=True, text=True, timeout=MAKE_TIMEOUT)
    assert process.returncode == 0, process.stdout[-2000:] + process.stderr[-2000:]
    return results_dir, process.stdout


@pytest.mark.slow
def test_make_reproduce_writes_runs_results_table_and_events(made):
    results_dir, stdout = made
    labels = ["n1-b100-it1", "n5-b20-it5", "n10-b10-it10", "n20-b5-it20"]
    for label in labels:
        with open(os.path.join(results_dir, label + ".json")) as f:
            document = json.load(f)
        assert set(document) == {"config", "runs", "mean_accuracy", "std_accuracy"}
        (run,) = document["runs"]
        assert run["updates"] == 1 and run["seed"] == 0
        assert document["mean_accuracy"] == run["best_accuracy"]
        assert os.path.exists(os.path.join(results_dir, "runs", label + "-seed0.json"))
        found = scalars(os.path.join(results_dir, "tb", label, "seed0"))
        assert [step for step, _ in found["test/accuracy"]] == [1]
        assert [step for step, _ in found["train/loss"]] == [1]
    progress = [line for line in stdout.splitlines() if line.startswith("[")]
    assert len(progress) == 4 and all("ETA" in line and "best" in line for line in progress)
    with open(os.path.join(results_dir, "table.md")) as f:
        table = f.read()
    assert table in stdout  # printed at the end
    assert table.count("\n| ") == 5  # header and four rows
    assert "SCALE=1000" in table and "smoke test" in table
    for name in (reproduce.CURVES_PNG, reproduce.BEST_PNG):  # drawn next to it, linked
        with open(os.path.join(results_dir, name), "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n" and len(f.read()) > 10_000
        assert f"![{name}]({name})" in table
    assert not any(f"{name} not drawn" in table  # neither figure was skipped
                   for name in (reproduce.CURVES_PNG, reproduce.BEST_PNG))


@pytest.mark.slow
def test_resume_runs_only_what_is_missing(made, tmp_path):
    results_dir = str(tmp_path / "results")
    shutil.copytree(made[0], results_dir)
    runs_dir = os.path.join(results_dir, "runs")
    missing = os.path.join(runs_dir, "n5-b20-it5-seed0.json")
    os.unlink(missing)
    kept = {}
    for path in glob.glob(os.path.join(runs_dir, "*.json")):
        with open(path, "rb") as f:
            kept[path] = (os.stat(path).st_mtime_ns, f.read())
    assert len(kept) == 3

    logged = []
    reproduce.reproduce(results_dir, reps=1, scale=SMOKE_SCALE, jobs=2, log=logged.append)
    assert "3 already done" in logged[0] and "1 to run" in logged[0]
    progress = [line for line in logged if line.startswith("[")]
    assert len(progress) == 1 and "N=5 B=20" in progress[0]
    for path, (mtime, content) in kept.items():
        with open(path, "rb") as f:
            assert (os.stat(path).st_mtime_ns, f.read()) == (mtime, content)
    with open(missing) as f:
        assert json.load(f)["runs"][0]["updates"] == 1


def test_help_lists_the_tools_own_flags():
    """A tool run as `python -m` files its flags under its path, as absl does for a
    script; --help must find them there."""
    proc = run_cli("--help", module="experiment.reproduce", timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    for flag in ("--results-dir", "--jobs", "--[no]fair", "--scale", "--reps"):
        assert flag in proc.stdout, flag
