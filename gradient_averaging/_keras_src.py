"""Every use of Keras's internals, behind a check of the version.

`accumulate` builds on Keras's data adapters, its loss scaling for distribution and two
private Model methods; the batch-norm statistics on BatchNormalization's `_moments`; the
weighting of activity regularizers on how this Keras adds their losses.
Keras exports none of them and may change any in a release: this module is the one place
that touches them, and it refuses, in one line, a Keras it was not tested on.
requirements.txt pins the newest, requirements-low.txt the oldest; pyproject.toml bounds them.
"""

import contextlib
import functools

import keras
import tensorflow as tf

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
from keras.src.losses.loss import unscale_loss_for_distribution  # noqa: E402
from keras.src.trainers import data_adapters  # noqa: E402
from keras.src.trainers.data_adapters.array_slicing import train_validation_split  # noqa: E402
from keras.src.trainers.data_adapters.data_adapter import DataAdapter  # noqa: E402

__all__ = ["DataAdapter", "activity_losses_weighted", "batch_norm_layers", "captured_moments",
           "check_version", "data_adapters", "losses_from_the_pass", "loss_tracker",
           "symbolic_build", "train_validation_split", "unscale_loss_for_distribution",
           "with_row_mask"]


def symbolic_build(model, data_batch):
    """Builds a model's metrics and optimizer variables from one batch's spec, as fit
    does from its first batch (Model._symbolic_build), in the model's strategy scope."""
    with model.distribute_strategy.scope():
        model._symbolic_build(data_batch=data_batch)  # noqa: SLF001


def loss_tracker(model):
    """The Mean metric that fit's logs call `loss` (Trainer._loss_tracker)."""
    return model._loss_tracker  # noqa: SLF001


# ---------------------------------------------------------------- batch normalization


def batch_norm_layers(model, per_update, padded):
    """The model's BatchNormalization layers whose moments the window captures (nested
    ones included, each once): all of them where the statistics step once per update
    or the mini-batches are padded (XLA), none otherwise.

    Raises:
      ValueError: a layer the window cannot train: synchronized=True (its forward pass
        all-reduces every mini-batch, which fails inside the window loop under a
        strategy), or, where its moments are captured, renorm=True (its corrections
        depend on each batch's spread) or a subclass with its own `call` or `_moments`.
    """
    base = keras.layers.BatchNormalization
    captured = per_update or padded
    found = []
    for layer in model._flatten_layers(include_self=False):  # noqa: SLF001 (each once)
        if not isinstance(layer, base):
            continue
        if layer.synchronized:
            raise ValueError(
                f"BatchNormalization layer {layer.name!r} has synchronized=True: its "
                "forward pass all-reduces every mini-batch, which the window's loop cannot "
                "do under a strategy; use synchronized=False (with bn_statistics='update', "
                "the default, the window's statistics are pooled across replicas anyway)")
        why = ("renorm=True" if getattr(layer, "renorm", False)
               else "a subclass with its own call or _moments"
               if type(layer).call is not base.call
               or type(layer)._moments is not base._moments  # noqa: SLF001
               else None)
        if why and captured:
            fix = ("pass bn_statistics='mini_batch' for Keras's own per-mini-batch steps"
                   if per_update else "compile without jit_compile (XLA pads mini-batches "
                   "and the padding must stay out of its statistics)")
            raise ValueError(f"BatchNormalization layer {layer.name!r} has {why}: gradient "
                             f"averaging cannot give it the window's statistics; {fix}")
        if captured:
            found.append(layer)
    return found


@contextlib.contextmanager
def captured_moments(layers, row_mask, records):
    """While the block runs the model forward: each layer's batch moments, appended to
    `records` as (layer index, count, mean, variance) per call, counts and moments per
    channel; padded rows (row_mask False) enter neither the normalization nor the
    statistics, and an empty batch normalizes with zeros, not NaN."""
    for index, layer in enumerate(layers):
        object.__setattr__(layer, "_moments", functools.partial(
            _moments, layer, type(layer)._moments.__get__(layer), index,  # noqa: SLF001
            row_mask, records))
    try:
        yield records
    finally:
        for layer in layers:
            object.__delattr__(layer, "_moments")


def _moments(layer, original, index, row_mask, records, inputs, mask):
    axes = list(layer._reduction_axes)  # noqa: SLF001
    weights = None
    if row_mask is not None:
        weights = tf.reshape(tf.cast(row_mask, inputs.dtype),
                             [-1] + [1] * (len(inputs.shape) - 1))
    if mask is not None:
        keep = tf.cast(tf.expand_dims(mask, -1), inputs.dtype)
        weights = keep if weights is None else weights * keep
    if weights is None:  # Keras's own moments, so the forward pass is Keras's
        mean, variance = original(inputs, None)
        size = tf.reduce_prod(tf.gather(tf.shape(inputs), axes))
        count = tf.cast(size, tf.float64) * tf.ones_like(mean, tf.float64)
    else:
        weights = tf.broadcast_to(weights, tf.shape(inputs))
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


def with_row_mask(outputs, row_mask):
    """`outputs` whose Keras masks leave out padded rows (row_mask False): Keras's losses
    then average over the real rows only, and its metrics count only them, weighted or
    not. A mask an output already has is kept too."""
    from keras.src.backend.common import masking

    def masked(t):
        rank = len(t.shape)
        rows = tf.reshape(row_mask, [-1] + [1] * max(rank - 2, 0))
        mask = tf.broadcast_to(rows, tf.shape(t)[:max(rank - 1, 1)])
        existing = masking.get_keras_mask(t)
        t = tf.identity(t)  # a tensor of its own: the mask is an attribute of it
        masking.set_keras_mask(t, mask if existing is None
                               else tf.logical_and(tf.cast(existing, tf.bool), mask))
        return t

    return tf.nest.map_structure(masked, outputs)


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


@contextlib.contextmanager
def activity_losses_weighted(model, scale, row_mask=None):
    """While the block runs the model forward on a mini-batch: each activity regularizer's
    loss weighted so that the window's update is the direct batch's.

    The accumulating paths weigh a mini-batch's losses by its share of the window's
    samples, right for a per-sample mean. From Keras 3.14 an activity regularizer's loss
    is one (its value divided by the batch's rows); before, Keras adds the value, a sum
    over the rows, which the direct batch counts whole: it is multiplied by `scale`.
    Padded rows (row_mask False) enter the regularizer as zeros (L1 and L2 give them no
    loss), and a per-sample loss is a mean over the other rows.

    Args:
      model: the Keras model (its layers and nested ones).
      scale: the window's samples over the mini-batch's (this replica's share's, at
        least one), a float32 tensor; None where the window's samples are not known yet.
      row_mask: bool [B] where the mini-batch is padded, else None.

    Raises:
      ValueError: the model has an activity regularizer, this Keras adds its value as it
        is and `scale` is None.
    """
    layers = [layer for layer in model._flatten_layers()  # noqa: SLF001
              if layer.activity_regularizer is not None]
    means = _activity_losses_are_means()
    if not layers or (means and row_mask is None):
        yield
        return
    if not means and scale is None:
        raise ValueError(
            f"layer {layers[0].name!r} has an activity regularizer, whose loss Keras "
            f"{keras.__version__} adds as a sum over the batch: the per-mini-batch path "
            "cannot weigh it before the window's samples are known; use WindowAccumulator "
            "(fit_accumulated's default) or Keras>=3.14")
    originals = [layer.activity_regularizer for layer in layers]
    for layer, original in zip(layers, originals):
        object.__setattr__(layer, "activity_regularizer", functools.partial(
            _weighted, original, None if means else scale, row_mask))
    try:
        yield
    finally:
        for layer, original in zip(layers, originals):
            object.__setattr__(layer, "activity_regularizer", original)


def _weighted(regularizer, scale, row_mask, outputs):
    """regularizer(outputs), padded rows as zeros, times `scale`; with `scale` None (Keras
    divides by all the rows), times the rows over the real ones."""
    batch_major = (row_mask is not None and outputs.shape.rank
                   and outputs.shape[0] == row_mask.shape[0])
    if batch_major:
        rows = tf.reshape(row_mask, [-1] + [1] * (outputs.shape.rank - 1))
        outputs = tf.where(rows, outputs, tf.zeros_like(outputs))
    loss = regularizer(outputs)
    if scale is None:
        if not batch_major:
            return loss
        real = tf.reduce_sum(tf.cast(row_mask, loss.dtype))
        scale = tf.cast(tf.shape(outputs)[0], loss.dtype) / tf.maximum(real, 1.0)
    return loss * tf.cast(scale, loss.dtype)


@contextlib.contextmanager
def losses_from_the_pass(model, losses):
    """`model.losses` inside the block: the losses the forward pass on values returned
    (add_loss's and the regularizers'), as Keras's JAX trainer makes compute_loss see
    them (Layer._losses_override); outside a pass they would be lost."""
    if losses:
        model._losses_override = list(losses)  # noqa: SLF001
    try:
        yield
    finally:
        if losses:
            model._losses_override = []  # noqa: SLF001
