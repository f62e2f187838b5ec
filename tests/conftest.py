"""Shared test fixtures: the real MNIST once per session, as arrays and as IDX files.

The suite sees no GPU. Its checks are about this CPU's bits and tolerances (runs equal bit
for bit, N x B against the direct batch to 1e-6) and its logical devices (two CPU replicas
for MirroredStrategy); a GPU has other kernels, TF32 matmuls and its own devices. So every
test process, and every process a test starts, runs with CUDA_VISIBLE_DEVICES empty,
unless GPU_TESTS=1: `make gpu-check` sets it to run the GPU tests (tests that need a GPU
skip without one, saying so) with the GPU visible, TF32 off in the test processes (the
exactness tests compare float32 with float32; main.py's runs keep TensorFlow's default).
"""

import os

if os.environ.get("GPU_TESTS") != "1":  # before TensorFlow starts in any test process
    os.environ["CUDA_VISIBLE_DEVICES"] = ""

import numpy as np
import pytest

from experiment import cli
from experiment import data
from tests.helpers import N_TEST_SMALL
from tests.helpers import N_TRAIN_SMALL
from tests.helpers import QUICK_TEST_IMAGES
from tests.helpers import as_bytes
from tests.helpers import write_idx_dir

cli.import_tensorflow_quietly()  # before any test module imports TensorFlow
if os.environ.get("GPU_TESTS") == "1":  # float32 is float32: no TF32 matmuls on the GPU
    import tensorflow as tf
    tf.config.experimental.enable_tensor_float_32_execution(False)

@pytest.fixture(scope="session")
def mnist():
    return data.load_mnist()


@pytest.fixture(scope="session")
def mnist_quick(mnist):
    """The real MNIST with only the first QUICK_TEST_IMAGES test images."""
    return mnist._replace(test=data.Split(mnist.test.images[:QUICK_TEST_IMAGES],
                                          mnist.test.labels[:QUICK_TEST_IMAGES]))


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


@pytest.fixture(scope="session")
def small_raw(mnist):
    """The first training images (validation, then train) and test images, as bytes."""
    train_x = np.concatenate([as_bytes(mnist.validation), as_bytes(mnist.train)])
    train_y = np.concatenate([mnist.validation.labels, mnist.train.labels]).astype(np.uint8)
    return (train_x[:N_TRAIN_SMALL], train_y[:N_TRAIN_SMALL],
            as_bytes(mnist.test)[:N_TEST_SMALL], mnist.test.labels[:N_TEST_SMALL].astype(np.uint8))
