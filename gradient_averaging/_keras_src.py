"""The one module that uses Keras's internals or patches Keras objects (Keras may change any in a
release). INTERNALS lists each with the paths needing it, checked at import (probes are named and
hold no variables); `require` refuses only a path whose internal is missing or changed."""

# ruff: noqa: SLF001 (Keras's internals are this module's purpose, each checked in INTERNALS)

import collections
import contextlib
import functools
import importlib
import inspect
import os
import re
import shutil
import threading
import types
import warnings

import keras
import tensorflow as tf

from gradient_averaging import window

# Oldest and newest Keras (major, minor) the tests pin: requirements-low.txt, requirements.txt.
TESTED = (3, 12), (3, 15)
TESTED_RANGE = "{}.{} to {}.{}".format(*TESTED[0], *TESTED[1])
TESTED_PINS = ">={}.{},<{}.{}".format(*TESTED[0], TESTED[1][0], TESTED[1][1] + 1)

# The paths a missing internal refuses, as the refusal names them.
FIT = "Keras fit path (accumulate)"
APPLY = "window's apply (every TF2 path)"
BATCH_NORM = "BatchNormalization support"
BN_UPDATE = "batch-norm statistics per update (bn_statistics='update')"
ACTIVITY = "activity regularizer weighting (a Keras before 3.14 sums its losses)"
REGULARIZED = "weight regularization (a model whose weights have a regularizer)"

# target: "module:attribute..."; kind: the helper below that made it; check: raises if it fails.
Internal = collections.namedtuple("Internal", ["paths", "name", "kind", "target", "check"])


def _resolve(target):
    module, _, attributes = target.partition(":")
    value = importlib.import_module(module)
    for attribute in filter(None, attributes.split(".")):
        value = getattr(value, attribute)
    return value


def _code_names(function):
    """Every name `function`'s code (its nested functions' too) loads, stores or calls."""
    function = inspect.unwrap(getattr(function, "fget", function))
    names, codes = set(), [function.__code__] if hasattr(function, "__code__") else []  # C's: none
    while codes:
        code = codes.pop()
        names.update(code.co_names)
        codes.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
    return names


def takes(paths, target, *args, **kwargs):
    """The function at `target` binds `args` and `kwargs` (placeholders; `self` for a method)."""
    shown = ", ".join(["..."] * len(args) + [f"{k}=..." for k in kwargs])
    name = f"{target.replace(':', '.')}({shown})"

    def check():
        signature = inspect.signature(_resolve(target))
        try:
            signature.bind(*args, **kwargs)
        except TypeError as e:
            raise LookupError(f"its signature is {signature} ({e})") from None
    return Internal(paths, name, "takes", target, check)


def mentions(paths, target, *names, why):
    """Keras's function at `target` still uses each of `names`; `why`: what relies on it."""
    def check():
        missing = sorted(set(names) - _code_names(_resolve(target)))
        if missing:
            raise LookupError(f"its code no longer uses {', '.join(missing)}")
    return Internal(paths, f"{target.replace(':', '.')} using {', '.join(names)} ({why})",
                    "mentions", target, check)


def has(paths, target, *attributes, make=lambda cls: cls(name=_PROBE)):
    """`make(the class at target)`, with no variables (default: named _PROBE), has `attributes`."""
    def check():
        instance = make(_resolve(target))
        missing = [a for a in attributes if not hasattr(instance, a)]
        if missing:
            raise LookupError(f"an instance has no {', '.join(missing)}")
    return Internal(paths, f"{target.replace(':', '.')}().{', .'.join(attributes)}", "has",
                    target, check)


def exists(paths, target, *members):
    def check():
        value = _resolve(target)
        missing = [m for m in members if not hasattr(value, m)]
        if missing:
            raise LookupError(f"it has no {', '.join(missing)}")
    shown = f" with {', '.join(members)}" if members else ""
    return Internal(paths, f"{target.replace(':', '.')}{shown}", "exists", target, check)


_LAYERS = "keras.src.layers.layer:Layer"
_BN = "keras.src.layers.normalization.batch_normalization:BatchNormalization"
_ADAPTERS = "keras.src.trainers.data_adapters"
_COMPILE_LOSS = "keras.src.trainers.compile_utils:CompileLoss"
_LOSS = "keras.src.losses.loss"
_PROBE = "gradient_averaging_probe"  # a name given, so no user's layer is renumbered
# The paths BackupAndRestore reads and writes beside its backup_dir (elsewhere).
_BACKUP_PATHS = ("_weights_path", "_training_metadata_path", "_prev_weights_path",
                 "_prev_training_metadata_path")

INTERNALS = (
    takes((FIT,), f"{_ADAPTERS}:get_data_adapter", None, None, None, batch_size=None,
          shuffle=False, class_weight=None),
    mentions((FIT,), f"{_ADAPTERS}:get_data_adapter", "DataAdapter",
             why="an adapter given is used as it is"),
    takes((FIT,), f"{_ADAPTERS}:is_tf_dataset", None),
    takes((FIT,), f"{_ADAPTERS}.array_slicing:train_validation_split", None,
          validation_split=0.1),
    exists((FIT,), f"{_ADAPTERS}.data_adapter:DataAdapter", "get_tf_dataset", "num_batches",
           "batch_size", "has_partial_batch", "partial_batch_size", "on_epoch_begin",
           "on_epoch_end"),
    # SpecBuilt: fit and evaluate call _maybe_symbolic_build with their epoch iterator.
    takes((FIT,), "keras:Model._symbolic_build", None, data_batch=None),
    takes((FIT,), "keras:Model._maybe_symbolic_build", None, iterator=None, data_batch=None),
    mentions((FIT,), "keras:Model.fit", "_maybe_symbolic_build", why="SpecBuilt"),
    mentions((FIT,), "keras:Model.evaluate", "_maybe_symbolic_build", why="SpecBuilt"),
    mentions((FIT,), "keras.src.trainers.epoch_iterator:EpochIterator.__init__",
             "data_adapter", why="SpecBuilt reads the iterator's adapter"),
    has((FIT,), "keras:Model", "_distribute_strategy", "_loss_tracker", "_compile_loss"),
    # loss_parts, log_window: CompileLoss's flat losses, reduced as Loss.__call__ reduces them.
    exists((FIT,), f"{_COMPILE_LOSS}.Loss", "loss", "loss_weights"),
    mentions((FIT,), f"{_COMPILE_LOSS}.call", "_flat_losses", why="loss_parts"),
    mentions((FIT,), f"{_COMPILE_LOSS}.build", "_flat_losses", why="loss_parts"),
    exists((FIT,), _COMPILE_LOSS, "metrics"),
    has((FIT,), f"{_LOSS}:Loss", "reduction", "dtype", "name"),
    takes((FIT,), f"{_LOSS}:Loss.call", None, None, None),
    takes((FIT,), f"{_LOSS}:reduce_weighted_values", None, None, None, None, None),
    takes((FIT,), f"{_LOSS}:apply_mask", None, None, None, reduction="sum"),
    takes((FIT,), f"{_LOSS}:squeeze_or_expand_to_same_rank", None, None),
    takes((FIT,), "keras.src.backend.common.masking:get_keras_mask", None),
    exists((FIT,), "keras.src.tree", "flatten", "map_structure"),
    exists((FIT,), "keras.src.ops", "convert_to_tensor"),
    has((FIT,), "keras.callbacks:BackupAndRestore", *_BACKUP_PATHS, make=lambda cls: cls(_PROBE)),
    # one_variable_at_a_time: TFOptimizer calls self.update_step per variable, so an instance's own.
    takes((APPLY, FIT), "keras:optimizers.Optimizer.update_step", None, None, None, None),
    mentions((APPLY, FIT),
             "keras.src.backend.tensorflow.optimizer:TFOptimizer._distributed_tf_update_step",
             "update_step", why="one_variable_at_a_time orders its calls"),
    takes((BATCH_NORM, BN_UPDATE, ACTIVITY), f"{_LAYERS}._flatten_layers", None,
          include_self=False),
    has((BATCH_NORM, BN_UPDATE), _BN, "synchronized"),
    takes((BN_UPDATE,), f"{_BN}._moments", None, None, None),
    mentions((BN_UPDATE,), f"{_BN}.call", "_moments", why="captured_moments"),
    has((BN_UPDATE,), _BN, "_reduction_axes"),
    # without_weight_regularization: Layer.losses lists the layers' own losses, then the weights'.
    mentions((REGULARIZED,), f"{_LAYERS}.losses", "_get_own_losses",
             "_get_regularization_losses", why="without_weight_regularization"),
    # An activity regularizer's loss recorded apart: Layer.__call__ reads the attribute.
    mentions((ACTIVITY,), f"{_LAYERS}.__call__", "activity_regularizer",
             why="activity_losses_apart"),
)


def check_internals(internals=INTERNALS):
    """{path: the first of its internals this Keras lacks or changed, and why}."""
    failed = {}
    for internal in internals:
        try:
            internal.check()
        except Exception as e:  # whatever a check raises is its internal's failure
            why = str(e).splitlines()[0] if str(e) else type(e).__name__
            for path in internal.paths:
                failed.setdefault(path, f"{internal.name}: {why}")
    return failed


def refusal(path, failure, version):
    """The one line that refuses `path` for `failure` (check_internals') on Keras `version`."""
    return (f"gradient_averaging's {path} cannot run on keras {version}: it needs "
            f"{failure} (tested on Keras {TESTED_RANGE}: pip install 'keras{TESTED_PINS}')")


def require(*paths):
    """Raises ImportError, in one line, where this Keras lacks an internal of `paths`."""
    for path in paths:
        if path in FAILED:
            raise ImportError(refusal(path, FAILED[path], keras.__version__))


def check_release(version, failed):
    """Warns once where Keras `version` is outside TESTED; only the internals (`failed`) refuse."""
    match = re.match(r"(\d+)\.(\d+)", version)
    release = (int(match[1]), int(match[2])) if match else None
    if release is not None and TESTED[0] <= release <= TESTED[1]:
        return
    relation = ("not one of" if release is None else
                "newer than" if release > TESTED[1] else "older than")
    outcome = (f"the {', '.join(sorted(failed))} lack Keras internals and are refused" if failed
               else "every Keras internal it uses is there, so it runs")
    warnings.warn(f"gradient_averaging: keras {version} is {relation} the Keras releases it "
                  f"is tested on ({TESTED_RANGE}); {outcome}", stacklevel=2)


FAILED = check_internals()
check_release(keras.__version__, FAILED)


def _internal(target):
    """The object at `target`, or None where this Keras has none (its paths are refused)."""
    try:
        return _resolve(target)
    except (AttributeError, ImportError):
        return None


data_adapters = _internal(_ADAPTERS)
train_validation_split = _internal(f"{_ADAPTERS}.array_slicing:train_validation_split")
DataAdapter = _internal(f"{_ADAPTERS}.data_adapter:DataAdapter")
ops = _internal("keras.src.ops")
tree = _internal("keras.src.tree")
get_keras_mask = _internal("keras.src.backend.common.masking:get_keras_mask")
loss_module = _internal("keras.src.losses.loss")

def symbolic_build(model, data_batch):
    """Builds the model's metrics and optimizer variables from `data_batch`'s spec, as fit does."""
    with model.distribute_strategy.scope():
        model._symbolic_build(data_batch=data_batch)


class SpecBuilt:
    """Mixin for a keras.Model: fit and evaluate build it from their data's spec, not from a batch
    that Keras reduces eagerly, which fails across workers (keras-team/keras#20585)."""

    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        if self._distribute_strategy is None:  # as Keras: built as its functions trace
            return
        if iterator is not None:
            data_batch = iterator.data_adapter.get_tf_dataset().element_spec
        symbolic_build(self, data_batch)


# The paths a writing callback of Keras writes to (and BackupAndRestore reads from).
_WRITES = {keras.callbacks.ModelCheckpoint: ("filepath",),
           keras.callbacks.TensorBoard: ("log_dir",),
           keras.callbacks.BackupAndRestore: ("backup_dir", *_BACKUP_PATHS)}


@contextlib.contextmanager
def elsewhere(callbacks, directory):
    """For a worker not the chief: while the block runs, Keras's callbacks in _WRITES write under
    `directory` (made, then removed), a BackupAndRestore's copied there first to restore it."""
    saved = [(callback, {name: getattr(callback, name) for name in names})
             for callback in callbacks for kind, names in _WRITES.items()
             if isinstance(callback, kind)]
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


# ---------------------------------------------------------------- batch normalization
def batch_norm_layers(model, per_update):
    """The model's BatchNormalization layers whose moments the window captures: all where
    `per_update`, else none. Raises ValueError for a layer the window cannot train."""
    require(BN_UPDATE if per_update else BATCH_NORM)
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
    """While the block runs, `records` gets each call's (layer index, count, mean, variance) per
    channel; masked values enter neither normalization nor moments; an empty batch gives zeros."""
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
    """Whether this Keras adds an activity regularizer's loss as a mean over rows (3.14 on)."""
    with tf.init_scope():  # eager, even while a step is traced
        layer = keras.layers.ActivityRegularization(l1=1.0, name=_PROBE)
        layer(tf.ones([2, 1]))
        loss, = layer.losses
        return float(loss) == 1.0


def summed_activity(model):
    """None, or records -> a context recording apart the activity losses this Keras adds as a
    batch's sum: the direct batch's is the window's sum, so the window sums them undivided."""
    if _activity_losses_are_means():
        return None
    require(ACTIVITY)
    layers = [layer for layer in model._flatten_layers()
              if getattr(layer, "activity_regularizer", None) is not None]
    return functools.partial(activity_losses_apart, layers) if layers else None


@contextlib.contextmanager
def activity_losses_apart(layers, records):
    """While the block runs the model forward, `layers`' activity losses go to `records`, a zero
    to add_loss in their place, so the pass can differentiate them apart."""
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
    require(REGULARIZED)
    regularized = sum(v.regularizer is not None for v in model.trainable_weights)
    return list(losses)[:len(losses) - regularized]


_SWAPPED = threading.Lock()


def loss_parts(model, y, y_pred, sample_weight):
    """One mini-batch's compiled loss as window.Parts, one per flat loss, in order: each one's
    numerator and divisor as Loss.__call__ reduces it (masks, sample weights, the reduction)."""
    compile_loss = model._compile_loss
    if compile_loss is None:
        return []
    records = []
    flat = compile_loss._flat_losses
    with _SWAPPED:  # threads swap in turn: a caller's, a MirroredStrategy's replicas tracing
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
    """(numerator, divisor, term) of one Keras loss: term SAMPLES where the divisor is the samples
    times a count fixed by the shapes (folded into the numerator), None where nothing divides,
    "own" otherwise (a mask, summed sample weights)."""
    samples = tf.shape(tree.flatten(y_pred)[0])[0]
    if (not isinstance(loss, loss_module.Loss)
            or type(loss).__call__ is not loss_module.Loss.__call__):
        # A __call__ of its own: its value taken as a mean over the samples.
        value = loss(y_true, y_pred, sample_weight)
        return value * tf.cast(samples, value.dtype), samples, window.SAMPLES
    in_mask = get_keras_mask(y_pred)
    dtype = loss.dtype
    with keras.name_scope(loss.name):  # public: keras-nightly's ops no longer has it
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
    # The mask as an unscaled weight: Keras's scaling by total / valid is the divisor below.
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
    """Replica context: logs the window's loss weighed by its samples (Keras weighs by a batch's
    static size, which fit's partial last batch lacks), and once per window each output's
    (`part_values`, weighted by loss_weights, in loss_parts' order), unweighted."""
    model._loss_tracker.update_state(loss, sample_weight=samples)  # fit's logs' `loss`
    compile_loss = model._compile_loss
    if compile_loss is None or len(compile_loss.metrics) < 2:
        return
    for index, (metric, entry) in enumerate(zip(compile_loss.metrics, compile_loss._flat_losses)):
        value = part_values[index]
        if entry.loss_weights is not None:
            weight = tf.cast(entry.loss_weights, value.dtype)
            value = tf.where(tf.equal(weight, 0), tf.zeros_like(value), value / weight)
        metric.update_state(value)


@contextlib.contextmanager
def one_variable_at_a_time(optimizer):
    """Within the block, `optimizer` (or its inner one) updates variables one after another: the
    window's gradients all exist at apply, so updates would overlap, each with variable-sized
    temporaries. Replicas enter together (threads): the first in patches, the last out restores."""
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    with _ORDERED:
        if not _ORDERED_DEPTH.get(id(inner)):
            own, written = inner.update_step, []

            def update_step(gradient, variable, learning_rate):
                with tf.control_dependencies(written):
                    gradient = tf.identity(gradient)
                own(gradient, variable, learning_rate)
                written[:] = [tf.convert_to_tensor(variable)]

            inner.__dict__["update_step"] = update_step  # past Keras's attribute tracking
        _ORDERED_DEPTH[id(inner)] = _ORDERED_DEPTH.get(id(inner), 0) + 1
    try:
        yield
    finally:
        with _ORDERED:
            _ORDERED_DEPTH[id(inner)] -= 1
            if not _ORDERED_DEPTH[id(inner)]:
                del _ORDERED_DEPTH[id(inner)], inner.__dict__["update_step"]


_ORDERED = threading.Lock()
_ORDERED_DEPTH = {}  # id(optimizer) -> the blocks it is in
