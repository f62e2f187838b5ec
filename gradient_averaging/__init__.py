"""Gradient averaging (accumulation) for TensorFlow: apply the mean gradient of N
mini-batches of B samples once, and the update is that of one batch of N*B.

One module per kind of user, each importable alone:
  * gradient_averaging.tf1: `AveragingOptimizer`, a drop-in tf.compat.v1 optimizer
    wrapper for graph-mode code (imports no Keras);
  * gradient_averaging.tf2: `WindowAccumulator`, `MiniBatchAccumulator` and
    `fit_accumulated`, for your own TF2 training loop and tf.distribute;
  * gradient_averaging.keras_fit: `accumulate(model, N)`, for Keras's compile/fit;
  * gradient_averaging.micro_batch: the largest micro-batch that fits in the device's
    memory, for an effective batch (`accumulate(model, micro_batch_size="auto")`,
    `fit_accumulated(..., micro_batch_size="auto")`);
  * gradient_averaging.window_step: the one window step the TF2 paths share (sums added
    in place, the vote, the apply), on replicas (a mini-batch's split) and
    batch_statistics (the moving statistics of batch norm under accumulation);
  * gradient_averaging.window: the pieces every path shares (N's check, stacking, the
    in-place sums, the TF1 graph's loop), for writing a window step of your own.
The names below also import from the package itself, each loading only its module.
A model saved from `accumulate` loads in any process that imports the package
(gradient_averaging._saving registers it with Keras, without importing Keras).
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

_saving.register_when_keras_is_imported()


def __getattr__(name):
    """Loads a name's module on first use, so `from gradient_averaging import
    AveragingOptimizer` imports neither Keras nor the TF2 path."""
    if name not in _EXPORTS:
        raise AttributeError(f"module 'gradient_averaging' has no attribute {name!r}")
    return getattr(importlib.import_module(f"gradient_averaging.{_EXPORTS[name]}"), name)
