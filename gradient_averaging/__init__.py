"""Gradient averaging (accumulation) for TensorFlow: apply the mean gradient of N
mini-batches of B samples once, and the update is that of one batch of N*B.

One module per kind of user, each importable alone:
  * tf1: `AveragingOptimizer`, a tf.compat.v1 optimizer wrapper for graph mode (no Keras);
  * tf2: `WindowAccumulator`, `MiniBatchAccumulator`, `fit_accumulated`, for your own loop;
  * keras_fit: `accumulate(model, N)`, for Keras's compile/fit;
  * micro_batch: the largest micro-batch that fits in device memory (`micro_batch_size="auto"`);
  * window_step: the window step the TF2 paths share, on replicas and batch_statistics;
  * window: the pieces every path shares, for writing a window step of your own.
The names below import from the package too, each loading only its module.
"""

import importlib

from gradient_averaging import _saving

__version__ = "0.3.0"

_EXPORTS = {
    "AveragingOptimizer": "tf1", "FLUSH_OPS": "tf1",
    "WindowAccumulator": "tf2", "MiniBatchAccumulator": "tf2", "fit_accumulated": "tf2",
    "FitSummary": "tf2",
    "accumulate": "keras_fit", "AccumulatingModel": "keras_fit",
    "find_micro_batch": "micro_batch", "MicroBatch": "micro_batch",
}

__all__ = sorted(_EXPORTS)

_saving.register_when_keras_is_imported()  # lets accumulate's saved models load, importing no Keras


def __getattr__(name):
    """Loads a name's module on first use: importing AveragingOptimizer loads no Keras, no TF2."""
    if name not in _EXPORTS:
        raise AttributeError(f"module 'gradient_averaging' has no attribute {name!r}")
    return getattr(importlib.import_module(f"gradient_averaging.{_EXPORTS[name]}"), name)
