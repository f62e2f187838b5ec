"""A saved AccumulatingModel loads in any process that has run `import gradient_averaging`.

Keras finds a saved class by name in `keras.saving.get_custom_objects()`, filled by importing
`keras_fit`, which the package imports only on use. So a stand-in holds the name once Keras is
imported; loading imports `keras_fit`, whose class replaces it. Start-up costs this module and one
`sys.meta_path` finder: no Keras (TF1 code must not need it), TensorFlow or TF2 path."""

import importlib
import sys

# keras_fit's name; "tf2_accumulator" is the first release's package, so its files load too.
REGISTERED_NAME = "tf2_accumulator>AccumulatingModel"


class AccumulatingModelStandIn:
    """In Keras's registry until keras_fit is imported: builds the real AccumulatingModel."""

    @classmethod
    def from_config(cls, config, custom_objects=None):
        # By name, on first load: no import edge from the package's start-up to Keras.
        keras_fit = importlib.import_module(f"{__package__}.keras_fit")
        return keras_fit.AccumulatingModel.from_config(config, custom_objects)


def _register(keras):
    get_custom_objects = getattr(getattr(keras, "saving", None), "get_custom_objects", None)
    if get_custom_objects is not None:  # Keras 3's; else no stand-in, and loading fails
        get_custom_objects().setdefault(REGISTERED_NAME, AccumulatingModelStandIn)


class _AfterKerasImport:
    """One-shot sys.meta_path finder: finds `keras` with the later finders and registers the
    stand-in after Keras's `__init__` runs. (No importlib.abc or importlib.util: slow to import.)"""

    def find_spec(self, name, path=None, target=None):
        if name != "keras":
            return None
        sys.meta_path.remove(self)
        finders = [finder for finder in sys.meta_path if hasattr(finder, "find_spec")]
        spec = next(filter(None, (f.find_spec(name, path, target) for f in finders)), None)
        if spec is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_register(module):
            exec_module(module)
            _register(module)

        spec.loader.exec_module = exec_then_register  # this spec's own loader object
        return spec


def register_when_keras_is_imported():
    """Registers the stand-in now if Keras is imported, else when it is."""
    if "keras" in sys.modules:
        if sys.modules["keras"] is not None:
            _register(sys.modules["keras"])
    elif not any(isinstance(finder, _AfterKerasImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _AfterKerasImport())
