"""What `pip install` ships and what it needs: one package, gradient_averaging, whose TF1
part imports no Keras and whose Keras part refuses a Keras it was not tested on; and a
model saved by the first release (0.1.0, `tf2_accumulator`) still loads."""

import io
import os
import shutil
import subprocess
import sys
import zipfile

import h5py
import keras
import numpy as np
import pytest

from gradient_averaging import _keras_src
from gradient_averaging import keras_fit
from tests.helpers import ROOT

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
EXPERIMENT = {"main", "flags", "model", "trainer", "data", "loop", "experiment", "tools"}


def run_python(code, cwd, path, timeout=180):
    env = dict(os.environ, PYTHONPATH=str(path), TF_CPP_MIN_LOG_LEVEL="3")
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout, env=env)


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """The checkout, built offline with the venv's setuptools from a copy (an in-tree
    build would write build/ into the checkout), installed into a target directory."""
    base = tmp_path_factory.mktemp("install")
    source = base / "checkout"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(
        ".venv", ".git", "__pycache__", "results", "*.png", "tests", "docs"))
    target = base / "site-packages"
    done = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index",
         "--no-build-isolation", "--disable-pip-version-check", "--target", str(target),
         str(source)], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    return target


def test_pip_installs_the_one_package_and_nothing_of_the_experiment(installed):
    top = {name.split(".")[0] for name in os.listdir(installed)
           if not name.endswith(".dist-info") and name != "__pycache__"}
    assert top == {"gradient_averaging"}, top
    assert not top & EXPERIMENT
    metadata, = installed.glob("*.dist-info/METADATA")
    requires = [line for line in metadata.read_text().splitlines()
                if line.startswith("Requires-Dist:")]
    keras_range, = (line.split("keras", 1)[1] for line in requires if " keras" in line)
    # The range _keras_src accepts is the one pip installs.
    assert set(keras_range.split(",")) == set(_keras_src.SUPPORTED_RANGE.split(",")), requires
    assert "Requires-Dist: tensorflow>=2.20" in requires, requires


def test_the_installed_package_imports_from_another_directory(installed, tmp_path):
    done = run_python(
        "import gradient_averaging as ga\n"
        "from gradient_averaging import AveragingOptimizer, accumulate, fit_accumulated\n"
        "print(ga.__file__)\n", cwd=tmp_path, path=installed)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().startswith(str(installed))


# TensorFlow's own import loads keras.src.optimizers when Keras is installed (inside a
# try), so "no Keras" is shown by making Keras unimportable: the TF1 part still trains.
WITHOUT_KERAS = """
import sys

sys.modules["keras"] = None  # `import keras` now raises ImportError
import tensorflow as tf
from gradient_averaging import AveragingOptimizer
v1 = tf.compat.v1
with tf.Graph().as_default():
    w = tf.Variable([1.0])
    opt = AveragingOptimizer(v1.train.GradientDescentOptimizer(0.5), 2)
    train_op = opt.minimize(tf.reduce_sum(w * w))
    with v1.Session() as sess:
        sess.run(v1.global_variables_initializer())
        for _ in range(2):
            sess.run(train_op)
        print(sess.run(w)[0])
loaded = sorted(m for m, module in sys.modules.items() if module is not None and (
    m.split(".")[0] == "keras"
    or m.startswith(("gradient_averaging.tf2", "gradient_averaging.keras"))))
print(loaded)
"""


def test_the_tf1_part_imports_and_trains_without_keras(tmp_path):
    done = run_python(WITHOUT_KERAS, cwd=tmp_path, path=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["0.0", "[]"]  # one update of the mean: 1 - 0.5 * 2


def test_another_keras_release_is_refused_in_one_line(monkeypatch):
    for version in ("3.12.0", "3.13.2", "3.14.1", "3.15.0", "3.15.1"):
        _keras_src.check_version(version)
    for version in ("3.11.3", "3.16.0", "4.0.0", "2.15.0", "nightly"):
        with pytest.raises(ImportError) as error:
            _keras_src.check_version(version)
        message = str(error.value)
        assert len(message.splitlines()) == 1
        assert f"keras {version} is installed" in message and "keras>=3.12,<3.16" in message


def test_a_keras_file_saved_by_the_first_release_loads():
    """Saved by 0.1.0's tf2_accumulator (registered as tf2_accumulator>AccumulatingModel):
    the same class and N, its Dense layer's weights as the file holds them, and its
    predictions those of that layer."""
    path = os.path.join(DATA, "accumulating_model_0.1.0.keras")
    loaded = keras.models.load_model(path)
    assert isinstance(loaded, keras_fit.AccumulatingModel)
    assert loaded.average_gradients == 3
    with zipfile.ZipFile(path) as archive, \
            h5py.File(io.BytesIO(archive.read("model.weights.h5")), "r") as weights:
        dense = weights["layers/sequential/layers/dense/vars"]
        kernel, bias = np.array(dense["0"]), np.array(dense["1"])
    assert kernel.shape == (4, 3) and np.any(bias != 0)  # trained: a fresh bias is zeros
    dense_layer = loaded.model.layers[-1]
    np.testing.assert_array_equal(dense_layer.kernel.numpy(), kernel)
    np.testing.assert_array_equal(dense_layer.bias.numpy(), bias)
    x = np.arange(24, dtype=np.float32).reshape(6, 4) / 24
    np.testing.assert_allclose(loaded.predict(x, verbose=0), x @ kernel + bias,
                               rtol=1e-6, atol=1e-7)
