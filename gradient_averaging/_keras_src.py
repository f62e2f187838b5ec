"""Every use of Keras's private modules (`keras.src`), behind a check of the version.

`accumulate` builds on Keras's data adapters and its loss scaling for distribution, which
Keras does not export and may change in any release: this module imports them once, and
refuses, in one line, a Keras it was not tested on. requirements.txt pins that version;
pyproject.toml bounds it.
"""

import keras

SUPPORTED = (3, 15)  # major, minor: Keras 3.15.x
SUPPORTED_RANGE = ">=3.15,<3.16"


def check_version(version):
    """Raises ImportError, in one line, unless `version` is a supported Keras release."""
    try:
        release = tuple(int(part) for part in version.split(".")[:2])
    except ValueError:
        release = None
    if release != SUPPORTED:
        raise ImportError(
            f"gradient_averaging's Keras fit path supports keras{SUPPORTED_RANGE} (it uses "
            f"keras.src internals); keras {version} is installed: "
            f"pip install 'keras{SUPPORTED_RANGE}'")


check_version(keras.__version__)

# Imported only after the check: another release may not have them.
from keras.src.losses.loss import unscale_loss_for_distribution  # noqa: E402
from keras.src.trainers import data_adapters  # noqa: E402
from keras.src.trainers.data_adapters.array_slicing import train_validation_split  # noqa: E402
from keras.src.trainers.data_adapters.data_adapter import DataAdapter  # noqa: E402

__all__ = ["DataAdapter", "check_version", "data_adapters", "loss_tracker", "symbolic_build",
           "train_validation_split", "unscale_loss_for_distribution"]


def symbolic_build(model, data_batch):
    """Builds a model's metrics and optimizer variables from one batch's spec, as fit
    does from its first batch (Model._symbolic_build), in the model's strategy scope."""
    with model.distribute_strategy.scope():
        model._symbolic_build(data_batch=data_batch)  # noqa: SLF001


def loss_tracker(model):
    """The Mean metric that fit's logs call `loss` (Trainer._loss_tracker)."""
    return model._loss_tracker  # noqa: SLF001
