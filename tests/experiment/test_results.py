"""results.py: a failed write never leaves a half-written results file behind."""

import json
import os

import pytest

from experiment import results


@pytest.mark.parametrize("failing", ["fsync", "replace"])
def test_atomic_write_failure_keeps_the_old_file(tmp_path, monkeypatch, failing):
    path = tmp_path / "run.json"
    results.atomic_write_json(str(path), {"old": True})

    def fail(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(results.os, failing, fail)
    with pytest.raises(OSError):
        results.atomic_write_json(str(path), {"new": "x" * 100000})
    monkeypatch.undo()
    with open(path) as f:
        assert json.load(f) == {"old": True}
    assert os.listdir(tmp_path) == ["run.json"]  # no temp file left behind
