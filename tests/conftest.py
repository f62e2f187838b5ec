"""Shared test fixtures: the real MNIST once per session, and the CLI as a subprocess."""

import gzip
import os
import struct
import subprocess
import sys

import numpy as np

import pytest
from absl.testing import flagsaver

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import cli  # noqa: E402
import main  # noqa: E402
import data  # noqa: E402

cli.import_tensorflow_quietly()  # before any test module imports TensorFlow


# Evaluations on this many test images (0.15 s, not 1.5 s for 10,000) where a test
# compares runs with each other, not with the post's accuracy.
QUICK_TEST_IMAGES = 1000


@pytest.fixture(scope="session")
def mnist():
    return data.load_mnist()


@pytest.fixture(scope="session")
def mnist_quick(mnist):
    """The real MNIST with only the first QUICK_TEST_IMAGES test images."""
    return mnist._replace(test=data.Split(mnist.test.images[:QUICK_TEST_IMAGES],
                                          mnist.test.labels[:QUICK_TEST_IMAGES]))


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


@pytest.fixture(scope="session")
def mnist_dirs(tmp_path_factory, mnist):
    """The same MNIST as IDX files for `--data-dir` (0.3 s to load, the pickle 3 s):
    (all 10,000 test images, the first QUICK_TEST_IMAGES)."""
    train_x = np.concatenate([as_bytes(mnist.validation), as_bytes(mnist.train)])
    train_y = np.concatenate([mnist.validation.labels, mnist.train.labels]).astype(np.uint8)
    test_x, test_y = as_bytes(mnist.test), mnist.test.labels.astype(np.uint8)
    base = tmp_path_factory.mktemp("mnist")
    full = write_idx_dir(base / "full", (train_x, train_y, test_x, test_y))
    quick = write_idx_dir(base / "quick", (train_x[:1], train_y[:1], test_x[:QUICK_TEST_IMAGES],
                                           test_y[:QUICK_TEST_IMAGES]))
    for key in ("train_images", "train_labels"):  # the same training files as `full`
        name = data.IDX_FILES[key]
        os.replace(os.path.join(full, name), os.path.join(quick, name))
        os.link(os.path.join(quick, name), os.path.join(full, name))
    return full, quick


@pytest.fixture(scope="session")
def mnist_dir(mnist_dirs):
    return mnist_dirs[0]


@pytest.fixture(scope="session")
def mnist_quick_dir(mnist_dirs):
    return mnist_dirs[1]


def run_cli(*args, timeout=300, script="main.py", module=None, env=None, python_args=()):
    """Runs `python main.py ARGS` (or `python -m MODULE ARGS`, a tool) from the repository
    root; returns the CompletedProcess."""
    program = ["-m", module] if module else [os.path.join(ROOT, script)]
    return subprocess.run([sys.executable, *python_args, *program, *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, **(env or {})))


def run_main_in_process(*args):
    """Parses ARGS with the real flag parser and calls main.main, restoring the flags."""
    with flagsaver.flagsaver():
        cli.parse_flags(["main.py", "--reps=1", "--iterations=1", *args])
        main.main(["main.py"])
