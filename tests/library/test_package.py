"""What `pip install` ships and what it needs: one package, gradient_averaging, whose TF1
part imports no Keras, installed beside a newer Keras and TensorFlow without taking them
back; a saved model loads in a fresh process that imports the package alone (and what one
without it gets); and a model saved by the first release (0.1.0, `tf2_accumulator`) still
loads. (What the Keras part checks of the Keras it finds: test_keras_internals.py.)"""

import io
import os
import re
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
def checkout(tmp_path_factory):
    """A copy of the checkout to build from (an in-tree build would write build/ into it)."""
    source = tmp_path_factory.mktemp("install") / "checkout"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(
        ".venv*", ".git", "__pycache__", "results", "*.png", "tests", "docs"))
    return source


@pytest.fixture(scope="module")
def installed(checkout):
    """The checkout, built offline with the venv's setuptools from a copy, installed into a
    target directory."""
    source = checkout
    target = checkout.parent / "site-packages"
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
    # From the oldest release tested to the next major one: pip never takes a newer Keras
    # or TensorFlow back to install the package (test_pip_keeps_...).
    ranges = {name: set(spec.split(",")) for name, spec in (
        re.fullmatch(r"Requires-Dist: ([\w-]+) ?\(?([^)]*)\)?", line).groups()
        for line in requires)}
    oldest, newest = _keras_src.TESTED
    assert ranges == {"keras": {">={}.{}".format(*oldest), f"<{newest[0] + 1}"},
                      "tensorflow": {">=2.20", "<3"}}, requires


def fake_wheel(directory, name, version):
    """A wheel of `name` `version` that installs its metadata and nothing else: as pip's
    resolver sees an installed release."""
    info = f"{name}-{version}.dist-info"
    files = {f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\n"
                              "Tag: py3-none-any\n"}
    files[f"{info}/RECORD"] = "".join(f"{path},,\n" for path in [*files, f"{info}/RECORD"])
    with zipfile.ZipFile(directory / f"{name}-{version}-py3-none-any.whl", "w") as wheel:
        for path, text in files.items():
            wheel.writestr(path, text)


def test_pip_keeps_a_keras_and_a_tensorflow_newer_than_the_pins(checkout, tmp_path):
    """A user's Keras 3.16 and TensorFlow 2.23 (newer than requirements.txt's; metadata
    only) stay as they are when the package's wheel (built offline, as `installed`) is
    installed beside them, though the wheels beside it offer the pins to go back to."""
    wheels = tmp_path / "wheels"
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-index",
         "--no-build-isolation", "--disable-pip-version-check", "--wheel-dir", str(wheels),
         str(checkout)], capture_output=True, text=True, timeout=180)
    assert built.returncode == 0, built.stderr[-3000:]
    for name, version in (("keras", "3.16.0"), ("keras", "3.15.1"),
                          ("tensorflow", "2.23.0"), ("tensorflow", "2.21.0")):
        fake_wheel(wheels, name, version)
    venv = tmp_path / "venv"  # no pip of its own: this one installs into it
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                   timeout=60)
    pip = [sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"),
           "--disable-pip-version-check"]
    offline = ["install", "--no-index", "--find-links", str(wheels)]
    for wanted in (["keras==3.16.0", "tensorflow==2.23.0"], ["gradient-averaging"]):
        done = subprocess.run(pip + offline + wanted, capture_output=True, text=True,
                              timeout=180)
        assert done.returncode == 0, done.stderr[-3000:]
    assert "Uninstalling" not in done.stdout, done.stdout
    listed = subprocess.run(pip + ["list", "--format=freeze"], capture_output=True,
                            text=True, timeout=180).stdout.split()
    assert {"keras==3.16.0", "tensorflow==2.23.0"} <= set(listed), listed
    assert any(line.startswith("gradient-averaging==") for line in listed), listed


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


@pytest.mark.slow
def test_the_tf1_part_imports_and_trains_without_keras(tmp_path):
    done = run_python(WITHOUT_KERAS, cwd=tmp_path, path=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["0.0", "[]"]  # one update of the mean: 1 - 0.5 * 2


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


# A fresh process that imports the package and nothing of it by name: `import
# gradient_averaging` loads neither Keras nor keras_fit, and a saved AccumulatingModel
# then loads (Keras imported after the package, as a user's script may).
LOAD_AFTER_IMPORT_GRADIENT_AVERAGING = """
import sys

import numpy as np

import gradient_averaging
print(sorted(m for m in sys.modules
             if m.split(".")[0] in ("keras", "tensorflow") or m.startswith("gradient_averaging.")))
import keras
loaded = keras.models.load_model("m.keras")
print(type(loaded).__name__, loaded.average_gradients, loaded.count_params())
np.testing.assert_array_equal(loaded.predict(np.load("x.npy"), verbose=0), np.load("y.npy"))
"""
# A process without the package: Keras cannot find the class; the wrapped model, saved
# alone (`.model.save`), is plain Keras and loads.
LOAD_WITHOUT_THE_PACKAGE = """
import sys

import numpy as np

sys.modules["gradient_averaging"] = None  # `import gradient_averaging` now fails
import keras
try:
    keras.models.load_model("m.keras")
except TypeError as e:
    print(str(e).split(". ")[0])
plain = keras.models.load_model("plain.keras")
print(type(plain).__name__)
np.testing.assert_array_equal(plain.predict(np.load("x.npy"), verbose=0), np.load("y.npy"))
"""


@pytest.mark.slow
def test_a_saved_model_loads_in_a_fresh_process_after_import_gradient_averaging(tmp_path):
    model = keras_fit.accumulate(keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)]),
                                 average_gradients=2)
    model.compile(optimizer="sgd", loss="mse")
    x = np.arange(24, dtype=np.float32).reshape(6, 4) / 24
    model.fit(x, x[:, :3], batch_size=3, epochs=1, verbose=0)
    model.save(tmp_path / "m.keras")
    model.model.save(tmp_path / "plain.keras")  # for serving: the plain Keras model
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", model.predict(x, verbose=0))
    env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="3")
    processes = [subprocess.Popen([sys.executable, "-c", script], cwd=tmp_path, env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for script in (LOAD_AFTER_IMPORT_GRADIENT_AVERAGING, LOAD_WITHOUT_THE_PACKAGE)]
    (with_package, _), (without, _) = outputs = [p.communicate(timeout=180) for p in processes]
    for process, (_, err) in zip(processes, outputs):
        assert process.returncode == 0, err[-3000:]
    assert with_package.splitlines() == ["['gradient_averaging._saving']",
                                         "AccumulatingModel 2 15"], with_package
    assert without.splitlines() == ["Could not locate class 'AccumulatingModel'",
                                    "Sequential"], without


def test_import_gradient_averaging_loads_neither_keras_nor_tensorflow(tmp_path):
    done = run_python("import sys\nimport gradient_averaging\n"
                      "print(sorted(m for m in sys.modules if m.split('.')[0] in "
                      "('keras', 'tensorflow', 'numpy') or m.startswith('gradient_averaging.')))",
                      cwd=tmp_path, path=ROOT, timeout=60)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["['gradient_averaging._saving']"]


def test_the_stand_in_keras_finds_builds_the_accumulating_model(monkeypatch):
    """Where Keras is imported already, `import gradient_averaging` registers the stand-in
    at once (keras_fit's own class, once imported, takes the name); loading builds the
    real class from a saved config."""
    from gradient_averaging import _saving

    registry = keras.saving.get_custom_objects()
    assert registry[_saving.REGISTERED_NAME] is keras_fit.AccumulatingModel
    monkeypatch.delitem(registry, _saving.REGISTERED_NAME)
    _saving.register_when_keras_is_imported()
    stand_in = keras.saving.get_registered_object(_saving.REGISTERED_NAME)
    assert stand_in is _saving.AccumulatingModelStandIn
    model = keras_fit.accumulate(keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)]),
                                 average_gradients=2)
    config = keras.saving.serialize_keras_object(model)
    assert config["registered_name"] == _saving.REGISTERED_NAME
    rebuilt = keras.saving.deserialize_keras_object(config)
    assert type(rebuilt) is keras_fit.AccumulatingModel and rebuilt.average_gradients == 2
