"""The command line and Keras fit on a GPU: what `make gpu-check` runs with the GPU visible.

The rest of the suite hides GPUs (tests/conftest.py); here they are visible only under
GPU_TESTS=1, and every test skips, saying so, where none is. Each command-line test runs
main.py as a process, as a user would, and checks that it trains (exit 0, the post's
line) and that op determinism holds on the GPU (the same flags twice, the same weights).
That an op without a deterministic kernel gets main.py's one line is tested on the CPU,
by injecting TensorFlow's error (test_jit_and_determinism.py).
"""

import json

import pytest
import tensorflow as tf

from gradient_averaging import keras_fit
from tests.helpers import run_cli
from tests.library import toys

GPUS = tf.config.list_physical_devices("GPU")
pytestmark = pytest.mark.skipif(
    not GPUS, reason="no GPU visible (the suite hides GPUs; make gpu-check runs these tests "
                     "with GPU_TESTS=1 where there is one)")

SHORT = ("--reps=1", "--eval-every=0", "--batch-size=32", "--iterations=12",
         "--average-gradients=3", "--seed=3")


def trained_sha(tmp_path, name, *args):
    """Runs main.py; its weights_sha256, after checking it trained without a traceback."""
    results = tmp_path / f"{name}.json"
    proc = run_cli(*SHORT, *args, f"--results={results}", timeout=300)
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.returncode == 0, proc.stderr.strip().splitlines()[-1:]
    assert "Training finished" in proc.stdout
    return json.loads(results.read_text())["runs"][0]["weights_sha256"]


@pytest.mark.parametrize("name, args", [
    ("tf1", ("--engine=tf1",)),
    ("tf1-fused", ("--engine=tf1", "--accumulate=fused")),
    ("tf2", ("--engine=tf2",)),
    ("tf2-xla-mlp", ("--engine=tf2", "--jit-compile", "--model=mlp")),
])
def test_a_run_on_the_gpu_is_deterministic(tmp_path, name, args):
    assert trained_sha(tmp_path, name + "-a", *args) == trained_sha(tmp_path, name + "-b", *args)


def test_xla_with_the_convnet_trains_without_determinism(tmp_path):
    trained_sha(tmp_path, "xla", "--engine=tf2", "--jit-compile", "--nodeterministic")


def test_mirrored_trains_on_every_visible_gpu(tmp_path):
    proc = run_cli(*SHORT, "--engine=tf2", "--distribute=mirrored", "--verbose", timeout=300)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    assert f"--distribute=mirrored: {len(GPUS)} replica" in proc.stdout


def test_keras_fit_on_the_gpu_compiles_with_xla_and_equals_the_direct_batch():
    """Keras's jit_compile="auto" turns XLA on here (a GPU, no strategy, no op
    determinism in this process); TF32 is off in GPU_TESTS processes (tests/conftest.py)."""
    assert not tf.config.experimental.tensor_float_32_execution_enabled()
    x, y = toys.data()
    reference = toys.compiled(toys.tiny_model(), toys.sgd())
    toys.fit(reference, x, y, toys.N * toys.B)
    model = toys.compiled(keras_fit.accumulate(toys.tiny_model(), toys.N), toys.sgd())
    toys.fit(model, x, y, toys.B)
    assert model.jit_compile is True  # Keras's choice on a GPU, kept through fit
    assert "GPU" in model.trainable_variables[0].value.device  # trained on the GPU
    assert toys.max_difference(model, reference) < 1e-5
    assert toys.max_difference(model, toys.tiny_model()) > 1e-2  # it trained
