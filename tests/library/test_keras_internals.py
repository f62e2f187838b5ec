"""What the package checks of the Keras it finds (gradient_averaging/_keras_src.py): each
internal it uses, not the version number. Every one is there on the Keras installed (the
pins', the oldest's in `make test-low`, the next's pre-release in `make test-next`); one
missing or changed refuses the paths that need it, in one line naming it and the version,
and only those; a release the tests do not pin warns once and runs."""

import os
import re
import subprocess
import sys
import types

import keras
import numpy as np
import pytest
import tensorflow as tf

from gradient_averaging import _keras_src
from tests.helpers import ROOT


def run_python(code, timeout=240):
    env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="3")
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, env=env)


def test_every_internal_the_package_uses_is_in_this_keras():
    assert _keras_src.check_internals() == {}
    assert _keras_src.FAILED == {}
    paths = {path for internal in _keras_src.INTERNALS for path in internal.paths}
    assert paths == {_keras_src.FIT, _keras_src.APPLY, _keras_src.BATCH_NORM,
                     _keras_src.BN_UPDATE, _keras_src.ACTIVITY, _keras_src.REGULARIZED}


def test_the_tested_releases_are_the_pins_of_the_oldest_and_the_newest():
    def pinned(name):
        with open(os.path.join(ROOT, name)) as f:
            version, = re.findall(r"^keras==(\d+)\.(\d+)\.", f.read(), re.M)
        return tuple(int(part) for part in version)

    assert _keras_src.TESTED == (pinned("requirements-low.txt"), pinned("requirements.txt"))
    assert _keras_src.TESTED_RANGE == "3.12 to 3.15"
    assert _keras_src.TESTED_PINS == ">=3.12,<3.16"


def _owner(target):
    """(the object holding the target's last name, that name): the class in the MRO that
    defines a member, so that monkeypatch removes it for every subclass."""
    module, _, attributes = target.partition(":")
    parent, name = (f"{module}:{attributes.rpartition('.')[0]}", attributes.rpartition(".")[2])
    owner = _keras_src._resolve(parent)  # noqa: SLF001 (the resolver under test)
    if isinstance(owner, type):
        owner = next(cls for cls in owner.__mro__ if name in vars(cls))
    return owner, name


class _Changed:
    """A class a Keras might put in an internal's place: made with any arguments, it has
    none of the members the package uses."""

    def __init__(self, *args, **kwargs):
        pass


# What each kind of internal becomes when Keras changes it: a function that takes no
# argument and whose code uses nothing, or a class without the members.
CHANGED = {"takes": lambda: None, "mentions": lambda: None, "has": _Changed,
           "exists": _Changed}


@pytest.mark.parametrize("how", ["removed", "changed"])
@pytest.mark.parametrize("internal", _keras_src.INTERNALS,
                         ids=[internal.name.split(" ")[0] for internal in _keras_src.INTERNALS])
def test_an_internal_removed_or_changed_refuses_its_paths_in_one_line(internal, how,
                                                                      monkeypatch):
    if ":" not in internal.target:  # a module: gone from the import system, or emptied
        monkeypatch.setitem(sys.modules, internal.target,
                            None if how == "removed" else types.ModuleType("changed"))
    else:
        owner, name = _owner(internal.target)
        if how == "removed":
            monkeypatch.delattr(owner, name)
        else:
            monkeypatch.setattr(owner, name, CHANGED[internal.kind])
    failed = _keras_src.check_internals([internal])
    assert set(failed) == set(internal.paths)
    for path, failure in failed.items():
        assert failure.startswith(f"{internal.name}: ")
        line = _keras_src.refusal(path, failure, "3.16.0")
        assert len(line.splitlines()) == 1
        assert line.startswith(f"gradient_averaging's {path} cannot run on keras 3.16.0: ")
        assert "tested on Keras 3.12 to 3.15: pip install 'keras>=3.12,<3.16'" in line


def test_keras_calls_update_step_once_per_variable_in_their_order():
    """What _keras_src.one_variable_at_a_time relies on: within it, Keras's apply calls
    the optimizer's own update_step (gradient, variable, learning_rate) once for each
    variable, in the order given, and the update is Keras's."""
    variables = [keras.Variable(np.full([n], 1.0, np.float32)) for n in (2, 3, 1)]
    optimizer = keras.optimizers.SGD(0.5)
    optimizer.build(variables)
    calls = []
    with _keras_src.one_variable_at_a_time(optimizer):
        ordered = optimizer.__dict__["update_step"]

        def spy(gradient, variable, learning_rate):
            calls.append(int(variable.shape[0]))  # the variables' sizes tell them apart
            ordered(gradient, variable, learning_rate)

        optimizer.__dict__["update_step"] = spy
        tf.function(lambda: optimizer.apply_gradients(
            [(tf.ones_like(v), v) for v in variables]))()  # traced, as every path applies
        optimizer.__dict__["update_step"] = ordered
    assert "update_step" not in optimizer.__dict__
    assert calls == [2, 3, 1]
    for v in variables:
        np.testing.assert_array_equal(v.numpy(), 0.5)


# A Keras without data_adapters.is_tf_dataset: accumulate is refused at its import, in one
# line; the TF2 loop needs no such internal, and trains.
WITHOUT_AN_INTERNAL = """
import keras
import keras.src.trainers.data_adapters
import numpy as np
import tensorflow as tf

del keras.src.trainers.data_adapters.is_tf_dataset
try:
    import gradient_averaging.keras_fit
except ImportError as error:
    print("refused:", error)
from gradient_averaging import fit_accumulated

x = np.ones((8, 3), np.float32)
model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
summary = fit_accumulated(model, tf.data.Dataset.from_tensor_slices((x, x[:, :1])).batch(2),
                          keras.optimizers.SGD(0.1), keras.losses.MeanSquaredError(reduction=None),
                          average_gradients=2)
print("updates:", summary.updates)
"""


@pytest.mark.slow  # 8 to 10 s: TensorFlow in a fresh process, and a TF2 loop traced
def test_a_keras_without_an_internal_refuses_only_the_path_that_needs_it():
    done = run_python(WITHOUT_AN_INTERNAL)
    assert done.returncode == 0, done.stderr[-3000:]
    refused, updates = done.stdout.splitlines()
    assert refused == (
        f"refused: gradient_averaging's Keras fit path (accumulate) cannot run on keras "
        f"{keras.__version__}: it needs keras.src.trainers.data_adapters.is_tf_dataset(...): "
        f"module 'keras.src.trainers.data_adapters' has no attribute 'is_tf_dataset' (tested "
        f"on Keras 3.12 to 3.15: pip install 'keras>=3.12,<3.16')")
    assert updates == "updates: 2"


# Keras calling itself 3.16.0: one warning at import, naming the releases tested, and
# accumulate trains (2 updates of 2 x 4 samples).
A_NEWER_RELEASE = """
import warnings

import keras
import numpy as np

keras.__version__ = "3.16.0"
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    from gradient_averaging import accumulate
for warning in caught:
    if "gradient_averaging" in str(warning.message):
        print("warned:", warning.category.__name__, warning.message)
x = np.ones((16, 3), np.float32)
model = accumulate(keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)]), 2)
model.compile(optimizer="sgd", loss="mse")
model.fit(x, x[:, :1], batch_size=4, epochs=1, verbose=0)
print("updates:", int(model.optimizer.iterations))
"""


@pytest.mark.slow  # 8 to 10 s: TensorFlow in a fresh process, and Keras fit traced
def test_a_newer_keras_release_warns_once_and_accumulate_trains():
    done = run_python(A_NEWER_RELEASE)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines() == [
        "warned: UserWarning gradient_averaging: keras 3.16.0 is newer than the Keras "
        "releases it is tested on (3.12 to 3.15); every Keras internal it uses is there, so "
        "it runs",
        "updates: 2"]


@pytest.mark.parametrize("version, relation", [
    ("3.16.0", "newer than"), ("3.16.0.dev2026102704", "newer than"), ("4.0.0", "newer than"),
    ("3.11.3", "older than"), ("nightly", "not one of")])
def test_a_release_the_tests_do_not_pin_warns_and_names_what_is_refused(version, relation):
    with pytest.warns(UserWarning) as caught:
        _keras_src.check_release(version, {})
    assert len(caught) == 1
    assert str(caught[0].message) == (
        f"gradient_averaging: keras {version} is {relation} the Keras releases it is tested "
        f"on (3.12 to 3.15); every Keras internal it uses is there, so it runs")
    with pytest.warns(UserWarning, match=r"; the Keras fit path \(accumulate\) lack"):
        _keras_src.check_release(version, {_keras_src.FIT: "x: y"})


@pytest.mark.parametrize("version", ["3.12.0", "3.13.2", "3.14.1", "3.15.0", "3.15.1"])
def test_a_tested_release_does_not_warn(version, recwarn):
    _keras_src.check_release(version, {})
    assert not recwarn.list


def test_a_refused_path_raises_import_error_in_one_line(monkeypatch):
    monkeypatch.setattr(_keras_src, "FAILED", {_keras_src.BN_UPDATE: "Thing._moments: gone"})
    _keras_src.require(_keras_src.FIT, _keras_src.BATCH_NORM)  # not refused
    with pytest.raises(ImportError) as error:
        _keras_src.require(_keras_src.BN_UPDATE)
    assert str(error.value) == (
        f"gradient_averaging's batch-norm statistics per update (bn_statistics='update') "
        f"cannot run on keras {keras.__version__}: it needs Thing._moments: gone (tested on "
        f"Keras 3.12 to 3.15: pip install 'keras>=3.12,<3.16')")


def test_the_check_renames_no_layer_of_the_user():
    _keras_src.check_internals()
    layer = keras.layers.BatchNormalization()
    again = keras.layers.BatchNormalization()
    _keras_src.check_internals()
    after = keras.layers.BatchNormalization()
    # Keras numbers unnamed layers in order: the check's own (named) ones take no number.
    number = [int(n.rpartition("_")[2]) if n != "batch_normalization" else 0
              for n in (layer.name, again.name, after.name)]
    assert number == [number[0], number[0] + 1, number[0] + 2]


def test_docs_library_md_shows_the_warning_and_the_refusal_as_written(monkeypatch):
    with open(os.path.join(ROOT, "docs", "library.md")) as f:
        text = f.read()
    with pytest.warns(UserWarning) as caught:
        _keras_src.check_release("3.16.0", {})
    assert f"\nUserWarning: {caught[0].message}\n" in text
    internal, = (i for i in _keras_src.INTERNALS if i.target.endswith(":is_tf_dataset"))
    monkeypatch.delattr(keras.src.trainers.data_adapters, "is_tf_dataset")
    failure = _keras_src.check_internals([internal])[_keras_src.FIT]
    assert f"\nImportError: {_keras_src.refusal(_keras_src.FIT, failure, '3.17.0')}\n" in text
