"""Every use of Keras's internals, behind a check of the version.

`accumulate` builds on Keras's data adapters, its loss scaling for distribution and two
private Model methods, and replaces a third (SpecBuilt: Keras's build, which fails under
several workers); the batch-norm statistics on BatchNormalization's `_moments`; the
weighting of activity regularizers on how this Keras adds their losses.
Keras exports none of them and may change any in a release: this module is the one place
that touches them, and it refuses, in one line, a Keras it was not tested on.
requirements.txt pins the newest, requirements-low.txt the oldest; pyproject.toml bounds them.
"""

# ruff: noqa: SLF001 (Keras's internals are this module's purpose, behind check_version)

import contextlib
import functools
import os
import shutil
import threading

import keras
import tensorflow as tf

from gradient_averaging import window

# Keras releases (major, minor) from the first up to, not including, the second: 3.12 to 3.15.
SUPPORTED = (3, 12), (3, 16)
SUPPORTED_RANGE = ">={}.{},<{}.{}".format(*SUPPORTED[0], *SUPPORTED[1])  # as pyproject.toml


def check_version(version):
    """Raises ImportError, in one line, unless `version` is a supported Keras release."""
    try:
        release = tuple(int(part) for part in version.split(".")[:2])
    except ValueError:
        release = None
    if release is None or not SUPPORTED[0] <= release < SUPPORTED[1]:
        raise ImportError(
            f"gradient_averaging's Keras fit path supports keras{SUPPORTED_RANGE} (it uses "
            f"keras.src internals); keras {version} is installed: "
            f"pip install 'keras{SUPPORTED_RANGE}'")


check_version(keras.__version__)

# Imported only after the check: another release may not have them.
# ruff: noqa: E402 (these imports follow check_version on purpose)
from keras.src import ops
from keras.src import tree
from keras.src.backend.common.masking import get_keras_mask
from keras.src.losses import loss as loss_module
from keras.src.losses.loss import unscale_loss_for_distribution
from keras.src.trainers import data_adapters
from keras.src.trainers.data_adapters.array_slicing import train_validation_split
from keras.src.trainers.data_adapters.data_adapter import DataAdapter

__all__ = ["DataAdapter", "SpecBuilt", "activity_losses_apart", "batch_norm_layers",
           "captured_moments", "check_version", "data_adapters", "elsewhere", "log_window",
           "loss_parts", "loss_tracker", "summed_activity", "summed_activity_layers",
           "symbolic_build", "train_validation_split", "unscale_loss_for_distribution",
           "without_weight_regularization"]


def symbolic_build(model, data_batch):
    """Builds a model's metrics and optimizer variables from one batch's spec, as fit
    does from its first batch (Model._symbolic_build), in the model's strategy scope."""
    with model.distribute_strategy.scope():
        model._symbolic_build(data_batch=data_batch)


class SpecBuilt:
    """Mixin for a keras.Model: fit and evaluate build it from their data's element spec
    (its shapes and types), never from a batch. Keras's own build (the TensorFlow
    trainer's _maybe_symbolic_build), for a model made in a strategy's scope, takes the
    first distributed batch and reduces it eagerly with strategy.reduce("MEAN", ...),
    which fails under a MultiWorkerMirroredStrategy of several workers
    (keras-team/keras#20585)."""

    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        if self._distribute_strategy is None:  # as Keras: built as its functions trace
            return
        if iterator is not None:
            data_batch = iterator.data_adapter.get_tf_dataset().element_spec
        symbolic_build(self, data_batch)


# The paths a writing callback of Keras writes to (and BackupAndRestore reads from).
_WRITES = {keras.callbacks.ModelCheckpoint: ("filepath",),
           keras.callbacks.TensorBoard: ("log_dir",),
           keras.callbacks.BackupAndRestore: ("backup_dir", "_weights_path",
                                              "_training_metadata_path", "_prev_weights_path",
                                              "_prev_training_metadata_path")}


@contextlib.contextmanager
def elsewhere(callbacks, directory):
    """While the block runs, Keras's callbacks that write (ModelCheckpoint, TensorBoard,
    BackupAndRestore) write under `directory` (made, and removed after) instead: what a
    worker that is not the chief writes. A BackupAndRestore's directory is copied there
    first, so that it restores what the chief's saved. Their paths are put back after.
    Other callbacks are left as they are."""
    saved = []
    for callback in callbacks:
        for kind, names in _WRITES.items():
            if isinstance(callback, kind):
                saved.append((callback, {name: getattr(callback, name) for name in names}))
    os.makedirs(directory, exist_ok=True)
    try:
        for index, (callback, paths) in enumerate(saved):
            own = os.path.join(directory, str(index))
            if isinstance(callback, keras.callbacks.BackupAndRestore):
                if os.path.isdir(paths["backup_dir"]):
                    shutil.copytree(paths["backup_dir"], own)
                for name, path in paths.items():
                    setattr(callback, name, own if name == "backup_dir" else os.path.join(
                        own, os.path.relpath(path, paths["backup_dir"])))
            else:
                name, = paths
                setattr(callback, name, os.path.join(own, os.path.basename(paths[name])))
        yield
    finally:
        for callback, paths in saved:
            for name, path in paths.items():
                setattr(callback, name, path)
        shutil.rmtree(directory, ignore_errors=True)


def loss_tracker(model):
    """The Mean metric that fit's logs call `loss` (Trainer._loss_tracker)."""
    return model._loss_tracker


# ---------------------------------------------------------------- batch normalization


def batch_norm_layers(model, per_update):
    """The model's BatchNormalization layers whose moments the window captures (nested
    ones included, each once): all of them where the statistics step once per update,
    none otherwise.

    Raises:
      ValueError: a layer the window cannot train: synchronized=True (its forward pass
        all-reduces every mini-batch, which the window's replicas do not do in step),
        or, where its moments are captured, renorm=True (its corrections depend on each
        batch's spread) or a subclass with its own `call` or `_moments`.
    """
    base = keras.layers.BatchNormalization
    found = []
    for layer in model._flatten_layers(include_self=False):
        if not isinstance(layer, base):
            continue
        if layer.synchronized:
            raise ValueError(
                f"BatchNormalization layer {layer.name!r} has synchronized=True: its "
                "forward pass all-reduces every mini-batch, which the window step does not "
                "do under a strategy; use synchronized=False (with bn_statistics='update', "
                "the default, the window's statistics are pooled across replicas anyway)")
        why = ("renorm=True" if getattr(layer, "renorm", False)
               else "a subclass with its own call or _moments"
               if type(layer).call is not base.call
               or type(layer)._moments is not base._moments
               else None)
        if why and per_update:
            raise ValueError(f"BatchNormalization layer {layer.name!r} has {why}: gradient "
                             "averaging cannot give it the window's statistics; pass "
                             "bn_statistics='mini_batch' for Keras's own per-mini-batch steps")
        if per_update:
            found.append(layer)
    return found


@contextlib.contextmanager
def captured_moments(layers, records):
    """While the block runs the model forward: each layer's batch moments, appended to
    `records` as (layer index, count, mean, variance) per call, counts and moments per
    channel; masked values (a Keras mask) enter neither the normalization nor the
    statistics, and an empty batch normalizes with zeros, not NaN."""
    for index, layer in enumerate(layers):
        object.__setattr__(layer, "_moments", functools.partial(
            _moments, layer, type(layer)._moments.__get__(layer), index,
            records))
    try:
        yield records
    finally:
        for layer in layers:
            object.__delattr__(layer, "_moments")


def _moments(layer, original, index, records, inputs, mask):
    axes = list(layer._reduction_axes)
    if mask is None:  # Keras's own moments, so the forward pass is Keras's
        mean, variance = original(inputs, None)
        size = tf.reduce_prod(tf.gather(tf.shape(inputs), axes))
        count = tf.cast(size, tf.float64) * tf.ones_like(mean, tf.float64)
    else:
        weights = tf.broadcast_to(tf.cast(tf.expand_dims(mask, -1), inputs.dtype),
                                  tf.shape(inputs))
        total = tf.reduce_sum(weights, axes, keepdims=True)
        safe = tf.maximum(total, 1.0)
        mean = tf.reduce_sum(tf.where(weights > 0, inputs, 0.0), axes, keepdims=True) / safe
        centered = tf.where(weights > 0, inputs - mean, 0.0)
        variance = tf.reduce_sum(tf.square(centered), axes, keepdims=True) / safe
        mean, variance = tf.squeeze(mean), tf.squeeze(variance)
        count = tf.cast(tf.squeeze(total), tf.float64)
    empty = count <= 0
    mean = tf.where(empty, tf.zeros_like(mean), mean)
    variance = tf.where(empty, tf.zeros_like(variance), variance)
    records.append((index, count, mean, variance))
    return mean, variance


# ---------------------------------------------------------------- activity regularizers


@functools.cache
def _activity_losses_are_means():
    """Whether this Keras adds an activity regularizer's loss divided by the batch's rows
    (3.14 on) or its raw sum (before): found once, on a batch of two rows."""
    with tf.init_scope():  # eager, even while a step is traced
        layer = keras.layers.ActivityRegularization(l1=1.0, name="gradient_averaging_probe")
        layer(tf.ones([2, 1]))
        loss, = layer.losses
        return float(loss) == 1.0


def summed_activity(model):
    """For the window step: None, or where `model` has layers whose activity regularizer
    this Keras sums over the batch (summed_activity_layers), records -> the context
    manager under which a forward pass records their losses apart."""
    layers = summed_activity_layers(model)
    return functools.partial(activity_losses_apart, layers) if layers else None


def summed_activity_layers(model):
    """The layers of `model` (nested ones too, each once) whose activity regularizer this
    Keras adds as a raw sum over the batch's rows: all that have one before 3.14, none
    from 3.14 on, where the loss is a per-sample mean that every path weighs as it weighs
    any loss. The direct batch of a window's E samples adds the sum over all of them, so a
    mini-batch's activity term must weigh E times its loss's, and E is known only when
    the window closes: the window step sums these gradients apart (window_step)."""
    layers = [layer for layer in model._flatten_layers()
              if getattr(layer, "activity_regularizer", None) is not None]
    return [] if not layers or _activity_losses_are_means() else layers


@contextlib.contextmanager
def activity_losses_apart(layers, records):
    """While the block runs the model forward: each of `layers`' activity regularizer
    losses appended to `records`, not added to the pass's losses (Keras's add_loss
    receives a zero in its place), so the pass can differentiate them apart."""
    regularizers = [layer.activity_regularizer for layer in layers]
    for layer, regularizer in zip(layers, regularizers):
        object.__setattr__(layer, "activity_regularizer",
                           functools.partial(_recorded, regularizer, records))
    try:
        yield records
    finally:
        for layer, regularizer in zip(layers, regularizers):
            object.__setattr__(layer, "activity_regularizer", regularizer)


def _recorded(regularizer, records, output):
    loss = regularizer(output)
    records.append(loss)
    return tf.zeros_like(loss)


# ---------------------------------------------------------------- the loss, in parts


def without_weight_regularization(model, losses):
    """A pass's losses (stateless_call's, Layer.losses: the add_loss losses, then one
    per trainable weight with a regularizer) without the weight regularization's."""
    regularized = sum(v.regularizer is not None for v in model.trainable_weights)
    return list(losses)[:len(losses) - regularized]


_SWAPPED = threading.Lock()


def loss_parts(model, y, y_pred, sample_weight):
    """The compiled loss (compile's `loss`, `loss_weights`) of one mini-batch as
    window_step.Parts, one per output's loss, in the order of its flat losses: each
    loss's numerator and divisor as Keras's Loss.__call__ reduces it (a mask on y_pred
    or on the losses, sample weights, the reduction). Keras's CompileLoss matches the
    outputs, labels and sample weights to the losses; its per-output loss metrics are
    left as they are (log_window updates them once per window)."""
    compile_loss = model._compile_loss
    if compile_loss is None:
        return []
    records = []
    flat = compile_loss._flat_losses
    # Replicas trace one at a time (MirroredStrategy's threads take turns), the lock
    # only guards against a caller's threads.
    with _SWAPPED:
        compile_loss._flat_losses = [entry._replace(loss=functools.partial(
            _recorded_part, entry.loss, records)) for entry in flat]
        try:
            with keras.StatelessScope():  # the per-output loss metrics' updates dropped
                compile_loss(y, y_pred, sample_weight)
        finally:
            compile_loss._flat_losses = flat
    return [window.Part(tf.cast(numerator, compile_loss.dtype), divisor, entry.loss_weights,
                        term) for (numerator, divisor, term), entry in zip(records, flat)]


def _recorded_part(loss, records, y_true, y_pred, sample_weight=None):
    numerator, divisor, term = _part(loss, y_true, y_pred, sample_weight)
    records.append((numerator, divisor, term if term != "own" else ("loss", len(records))))
    return numerator


def _part(loss, y_true, y_pred, sample_weight):
    """(numerator, divisor, term) of one Keras loss: term "samples" where the divisor is
    the samples times a number fixed by the shapes (folded into the numerator), None
    where nothing divides, "own" otherwise (a mask, summed sample weights)."""
    samples = tf.shape(tree.flatten(y_pred)[0])[0]
    if (not isinstance(loss, loss_module.Loss)
            or type(loss).__call__ is not loss_module.Loss.__call__):
        # A __call__ of its own: its value taken as a mean over the samples.
        value = loss(y_true, y_pred, sample_weight)
        return value * tf.cast(samples, value.dtype), samples, window.SAMPLES
    in_mask = get_keras_mask(y_pred)
    dtype = loss.dtype
    with ops.name_scope(loss.name):
        y_pred = tree.map_structure(lambda t: ops.convert_to_tensor(t, dtype=dtype), y_pred)
        y_true = tree.map_structure(lambda t: ops.convert_to_tensor(t, dtype=dtype), y_true)
        values = loss.call(y_true, y_pred)
    out_mask = get_keras_mask(values)
    masks = [m for m in (in_mask, out_mask) if m is not None]
    mask = None if not masks else masks[0] if len(masks) == 1 else masks[0] & masks[1]
    values = ops.convert_to_tensor(values, dtype=dtype)
    if values.shape.rank == 0 or tuple(values.shape) == (0,):
        # Keras reduces nothing: the call's value, a mean over the samples.
        value = loss_module.reduce_weighted_values(values, sample_weight, mask,
                                                   loss.reduction, dtype)
        return value * tf.cast(samples, value.dtype), samples, window.SAMPLES
    if sample_weight is not None:
        sample_weight = ops.convert_to_tensor(sample_weight, dtype=dtype)
    # The mask as a weight, unscaled: Keras scales it by total / valid under
    # "sum_over_batch_size", which is the divisor below.
    weights = loss_module.apply_mask(sample_weight, mask, values.dtype, reduction="sum")
    if weights is not None:
        weighted, weights = loss_module.squeeze_or_expand_to_same_rank(
            values, tf.cast(weights, values.dtype))
        numerator = tf.reduce_sum(weighted * weights)
    else:
        numerator = tf.reduce_sum(values)
    if loss.reduction in (None, "none", "sum"):
        return numerator, None, None
    size = tf.cast(tf.size(values), values.dtype)
    if loss.reduction == "mean_with_sample_weight" and weights is not None:
        return numerator, tf.reduce_sum(weights), "own"
    if mask is not None:  # valid entries, as many per loss as Keras weighs them
        valid = tf.reduce_sum(tf.cast(mask, values.dtype))
        return numerator, valid * size / tf.cast(tf.size(mask), values.dtype), "own"
    per_sample = values.shape[1:]
    if not per_sample.is_fully_defined():
        return numerator, size, "own"
    if per_sample.num_elements() != 1:
        numerator /= per_sample.num_elements()
    return numerator, samples, window.SAMPLES


def log_window(model, loss, part_values, samples):
    """Replica context: the window's loss, and each output's (part_values, weighted by
    compile's loss_weights, in the order of loss_parts), into fit's logs as Keras logs a
    batch's: the loss weighed by the samples, each output's unweighted loss once per
    window (Keras weighs a batch's by its static size, which a batch of fit's data, its
    last one partial, does not have)."""
    loss_tracker(model).update_state(loss, sample_weight=samples)
    compile_loss = model._compile_loss
    if compile_loss is None or len(compile_loss.metrics) < 2:
        return
    for metric, entry, index in zip(compile_loss.metrics, compile_loss._flat_losses,
                                    range(len(compile_loss.metrics))):
        value = part_values[index]
        if entry.loss_weights is not None:
            weight = tf.cast(entry.loss_weights, value.dtype)
            value = tf.where(tf.equal(weight, 0), tf.zeros_like(value), value / weight)
        metric.update_state(value)
