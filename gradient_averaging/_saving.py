"""A saved AccumulatingModel loads in any process that has run `import gradient_averaging`.

Keras finds a saved custom class by its registered name in its registry of custom objects
(`keras.saving.get_custom_objects()`), which `keras_fit` fills when it is imported. The
package imports `keras_fit` only on use, and imports no Keras itself (the TF1 part must
not), so this module puts a stand-in under that name instead, once Keras is imported: at
once where it already is, else by a one-shot import hook that runs after Keras's own
`__init__`. Loading a file then imports `keras_fit`, whose class replaces the stand-in.
`import gradient_averaging` costs this module and one finder on `sys.meta_path` (removed
when Keras is imported), nothing of Keras, TensorFlow or the TF2 path.
"""

import importlib
import sys

# keras_fit's registration (package "tf2_accumulator", the first release's name, so that
# its files load too).
REGISTERED_NAME = "tf2_accumulator>AccumulatingModel"


class AccumulatingModelStandIn:
    """In Keras's registry until keras_fit is imported: builds the real AccumulatingModel."""

    @classmethod
    def from_config(cls, config, custom_objects=None):
        # By name, on first load, as the package's own exports load (no import edge
        # from the package's start-up to the Keras path).
        keras_fit = importlib.import_module(f"{__package__}.keras_fit")
        return keras_fit.AccumulatingModel.from_config(config, custom_objects)


def _register(keras):
    """The stand-in under REGISTERED_NAME, unless keras_fit's class is there already."""
    get_custom_objects = getattr(getattr(keras, "saving", None), "get_custom_objects", None)
    if get_custom_objects is not None:  # Keras 3's; without it loading fails as before
        get_custom_objects().setdefault(REGISTERED_NAME, AccumulatingModelStandIn)


class _AfterKerasImport:
    """A finder on sys.meta_path: finds `keras` with the finders after it, and registers
    the stand-in once Keras's `__init__` has run; then leaves sys.meta_path. (No
    importlib.abc base, nor importlib.util: they would cost `import gradient_averaging`
    18 ms and 3 ms of modules.)"""

    def find_spec(self, name, path=None, target=None):
        if name != "keras":
            return None
        sys.meta_path.remove(self)  # one shot
        for finder in list(sys.meta_path):
            spec = finder.find_spec(name, path, target) if hasattr(finder, "find_spec") else None
            if spec is not None:
                break
        else:
            return None
        if not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_register(module):
            exec_module(module)
            _register(module)

        spec.loader.exec_module = exec_then_register  # this spec's own loader object
        return spec


def register_when_keras_is_imported():
    """Registers the stand-in now if Keras is imported, else when it is (never where it
    cannot be: `sys.modules["keras"] = None`)."""
    if "keras" in sys.modules:
        if sys.modules["keras"] is not None:
            _register(sys.modules["keras"])
    elif not any(isinstance(finder, _AfterKerasImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _AfterKerasImport())
