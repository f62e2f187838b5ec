"""What the tests share that is not a fixture: the repository root, MNIST as IDX files,
and the command line run as a process or in this one."""

import gzip
import os
import struct
import subprocess
import sys

import numpy as np
import pytest
from absl.testing import flagsaver

from experiment import cli
from experiment import data

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Evaluations on this many test images (0.15 s, not 1.5 s for 10,000) where a test
# compares runs with each other, not with the post's accuracy.
QUICK_TEST_IMAGES = 1000
# small_raw's sizes: a small but valid training file, and a few test images.
N_TRAIN_SMALL, N_TEST_SMALL = data.VALIDATION_SIZE + 100, 50
# A process that must not see a GPU (logical CPU devices, CPU-only bits).
CPU_ONLY = {"CUDA_VISIBLE_DEVICES": "", "TF_CPP_MIN_LOG_LEVEL": "3"}


def idx_images(images_uint8):
    n = len(images_uint8)
    return struct.pack(">IIII", data.IDX_IMAGES_MAGIC, n, 28, 28) + images_uint8.tobytes()


def idx_labels(labels_uint8):
    return struct.pack(">II", data.IDX_LABELS_MAGIC, len(labels_uint8)) + labels_uint8.tobytes()


def as_bytes(split):
    return np.round(split.images * 255).astype(np.uint8)


def write_idx_dir(directory, raw, gz=False):
    """Writes raw = (train images, train labels, test images, test labels) as IDX files."""
    train_x, train_y, test_x, test_y = raw
    contents = {"train_images": idx_images(train_x), "train_labels": idx_labels(train_y),
                "test_images": idx_images(test_x), "test_labels": idx_labels(test_y)}
    os.makedirs(directory, exist_ok=True)
    for key, payload in contents.items():
        path = os.path.join(directory, data.IDX_FILES[key] + (".gz" if gz else ""))
        with open(path, "wb") as f:
            f.write(gzip.compress(payload, compresslevel=1) if gz else payload)
    return str(directory)


def run_cli(*args, timeout=300, script="main.py", module=None, env=None, python_args=()):
    """Runs `python main.py ARGS` (or `python -m MODULE ARGS`, a tool) from the repository
    root; returns the CompletedProcess."""
    program = ["-m", module] if module else [os.path.join(ROOT, script)]
    environment = dict(os.environ, **(env or {}))
    environment["PYTHONPATH"] = os.pathsep.join(
        [ROOT] + [p for p in [environment.get("PYTHONPATH")] if p])
    return subprocess.run([sys.executable, *python_args, *program, *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout, env=environment)


def run_main_in_process(*args):
    """Parses ARGS with the real flag parser and calls main.main, restoring the flags."""
    import main  # defines main.py's flags in this process, once

    with flagsaver.flagsaver():
        cli.parse_flags(["main.py", "--reps=1", "--iterations=1", *args])
        main.main(["main.py"])


def one_line_exit(capsys, fn, *args, code=2):
    """fn(*args) exits with `code`, one line on stderr, `error: ...`; returns that line."""
    with pytest.raises(SystemExit) as exit_info:
        fn(*args)
    assert exit_info.value.code == code
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def saved_arrays(path):
    """The arrays an np.savez of positional arrays wrote (a probe's or a run's weights),
    in order."""
    with np.load(path) as arrays:
        return [arrays[f"arr_{i}"] for i in range(len(arrays.files))]


def assert_probe_trained_to(probed, reference):
    """A memory probe (tools.memory.probe's result, the weights it saved) ran without an
    out-of-memory error and trained to the weights saved at `reference`."""
    result, saved = probed
    assert not result.get("oom") and "error" not in result, result
    for got, want in zip(saved_arrays(saved), saved_arrays(reference), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
