"""The run loop: both engines evaluate, checkpoint and count on one cadence."""

import json
import re

import pytest

from experiment import checkpoint
from tests.helpers import run_main_in_process

# 20 windows of 2; the third (iterations 5-6) is skipped, so 19 updates.
CADENCE_FLAGS = ("--average-gradients=2", "--batch-size=10", "--iterations=40",
                 "--eval-every=0", "--eval-every-updates=2", "--inject-nonfinite=5",
                 "--verbose", "--reps=1")
# Every 2nd update: update 2 at iteration 4, then update u at iteration 2 (u + 1).
EXPECTED_EVALUATIONS = [(4, 2)] + [(2 * (u + 1), u) for u in range(4, 19, 2)] + [(40, 19)]


@pytest.fixture
def saves(monkeypatch):
    """The iterations at which RunCheckpoint.save is called (the real save still runs)."""
    calls = []
    real_save = checkpoint.RunCheckpoint.save

    def save(self, engine, iteration, state):
        calls.append(iteration)
        return real_save(self, engine, iteration, state)

    monkeypatch.setattr(checkpoint.RunCheckpoint, "save", save)
    return calls


@pytest.mark.parametrize("engine", ["tf1", "tf2"])
def test_engines_evaluate_and_checkpoint_on_the_same_cadence(tmp_path, capsys, saves, engine,
                                                             mnist_quick_dir):
    results = tmp_path / "r.json"
    (tmp_path / "ckpt").mkdir()
    run_main_in_process(*CADENCE_FLAGS, f"--engine={engine}", f"--results={results}",
                        f"--data-dir={mnist_quick_dir}",
                        f"--checkpoint-dir={tmp_path / 'ckpt'}", "--checkpoint-every=2")
    printed = [int(i) for i in re.findall(r"^Iteration (\d+):", capsys.readouterr().out, re.M)]
    (run,) = json.loads(results.read_text())["runs"]
    evaluations = [(e["iteration"], e["updates"]) for e in run["evaluations"]]
    assert evaluations == EXPECTED_EVALUATIONS
    assert printed == [i for i, _ in EXPECTED_EVALUATIONS]
    assert (run["updates"], run["skipped_windows"]) == (19, 1)
    assert saves == [i for i, _ in EXPECTED_EVALUATIONS[:-1]]  # every 2nd update, once
    assert run["best_accuracy"] == max(e["accuracy"] for e in run["evaluations"])
    assert run["final_accuracy"] == run["evaluations"][-1]["accuracy"]
