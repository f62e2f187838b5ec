"""Every use of Keras's internals and every patch of a Keras object, each checked at import.

Keras exports none of them and may change any in a release, so this module is the one
place that touches them. INTERNALS lists each with the paths that need it; all are
checked once, at import, by reading Keras's classes and code (milliseconds; the objects
made are named and hold no variables). A path whose internal is missing or changed is
refused where it starts (`require`), in one line naming the internal and the Keras
version; every other path runs. The version number refuses nothing: a release the
tests do not pin warns once, naming the tested ones (TESTED), and runs.
"""

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

# The Keras releases (major, minor) the tests pin, oldest and newest: requirements-low.txt and
# requirements.txt; `make test-next` runs the library's tests on the next one's pre-release.
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

# One internal: the paths that need it, its name as a refusal names it, its kind (the
# helper below that made it), its target ("module:attribute...") and its check: () -> None,
# raising (AttributeError, ImportError, LookupError...) where it is missing or changed.
Internal = collections.namedtuple("Internal", ["paths", "name", "kind", "target", "check"])


def _resolve(target):
    """The object at "module:attribute.attribute..."; raises where there is none."""
    module, _, attributes = target.partition(":")
    value = importlib.import_module(module)
    for attribute in filter(None, attributes.split(".")):
        value = getattr(value, attribute)
    return value


def _code_names(function):
    """Every name `function`'s code (its nested functions' too) loads, stores or calls."""
    function = inspect.unwrap(getattr(function, "fget", function))
    names, codes = set(), [getattr(function, "__code__", None)]  # None: not Python's
    codes = [code for code in codes if code is not None]
    while codes:
        code = codes.pop()
        names.update(code.co_names)
        codes.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
    return names


def takes(paths, target, *args, **kwargs):
    """The function at `target` exists and takes the call the package makes (`args`,
    `kwargs`: placeholders, `self` included for a method)."""
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
    """Keras's function at `target` exists and its code still uses each of `names` (an
    attribute it sets or reads, a method it calls): `why` says what relies on it."""
    def check():
        missing = sorted(set(names) - _code_names(_resolve(target)))
        if missing:
            raise LookupError(f"its code no longer uses {', '.join(missing)}")
    return Internal(paths, f"{target.replace(':', '.')} using {', '.join(names)} ({why})",
                    "mentions", target, check)


def has(paths, target, make, *attributes):
    """A fresh instance of the class at `target` (`make`: class -> instance, built
    without variables) has each of `attributes`."""
    def check():
        instance = make(_resolve(target))
        missing = [a for a in attributes if not hasattr(instance, a)]
        if missing:
            raise LookupError(f"an instance has no {', '.join(missing)}")
    return Internal(paths, f"{target.replace(':', '.')}().{', .'.join(attributes)}", "has",
                    target, check)


def exists(paths, target, *members):
    """The object at `target` exists, with each of `members`."""
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
    # accumulate: Keras's data adapters and its loss scaling for distribution, as Keras's
    # own fit uses them; an adapter of the package's own passed through as it is.
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
    # The model built from its data's spec (SpecBuilt), where Keras's fit and evaluate
    # call _maybe_symbolic_build with their epoch iterator.
    takes((FIT,), "keras:Model._symbolic_build", None, data_batch=None),
    takes((FIT,), "keras:Model._maybe_symbolic_build", None, iterator=None, data_batch=None),
    mentions((FIT,), "keras:Model.fit", "_maybe_symbolic_build", why="SpecBuilt"),
    mentions((FIT,), "keras:Model.evaluate", "_maybe_symbolic_build", why="SpecBuilt"),
    mentions((FIT,), "keras.src.trainers.epoch_iterator:EpochIterator.__init__",
             "data_adapter", why="SpecBuilt reads the iterator's adapter"),
    has((FIT,), "keras:Model", lambda cls: cls(name=_PROBE), "_distribute_strategy",
        "_loss_tracker", "_compile_loss"),
    # The compiled loss in parts (loss_parts, log_window): each of CompileLoss's flat
    # losses swapped for a recorder, reduced as Loss.__call__ reduces it.
    exists((FIT,), f"{_COMPILE_LOSS}.Loss", "loss", "loss_weights"),
    mentions((FIT,), f"{_COMPILE_LOSS}.call", "_flat_losses", why="loss_parts"),
    mentions((FIT,), f"{_COMPILE_LOSS}.build", "_flat_losses", why="loss_parts"),
    exists((FIT,), _COMPILE_LOSS, "metrics"),
    has((FIT,), f"{_LOSS}:Loss", lambda cls: cls(name=_PROBE), "reduction", "dtype", "name"),
    takes((FIT,), f"{_LOSS}:Loss.call", None, None, None),
    takes((FIT,), f"{_LOSS}:reduce_weighted_values", None, None, None, None, None),
    takes((FIT,), f"{_LOSS}:apply_mask", None, None, None, reduction="sum"),
    takes((FIT,), f"{_LOSS}:squeeze_or_expand_to_same_rank", None, None),
    takes((FIT,), "keras.src.backend.common.masking:get_keras_mask", None),
    exists((FIT,), "keras.src.tree", "flatten", "map_structure"),
    exists((FIT,), "keras.src.ops", "convert_to_tensor"),
    has((FIT,), "keras.callbacks:BackupAndRestore", lambda cls: cls(_PROBE), *_BACKUP_PATHS),
    # Every TF2 path's apply (one_variable_at_a_time): Keras's TensorFlow
    # optimizer calls update_step(gradient, variable, learning_rate), once per variable,
    # through the attribute, so an instance's own update_step is the one called.
    takes((APPLY, FIT), "keras:optimizers.Optimizer.update_step", None, None, None, None),
    mentions((APPLY, FIT),
             "keras.src.backend.tensorflow.optimizer:TFOptimizer._distributed_tf_update_step",
             "update_step", why="one_variable_at_a_time orders its calls"),
    # The layers of a model, nested ones each once.
    takes((BATCH_NORM, BN_UPDATE, ACTIVITY), f"{_LAYERS}._flatten_layers", None,
          include_self=False),
    has((BATCH_NORM, BN_UPDATE), _BN, lambda cls: cls(name=_PROBE), "synchronized"),
    # The window's batch-norm statistics: each pass's moments, captured in _moments.
    takes((BN_UPDATE,), f"{_BN}._moments", None, None, None),
    mentions((BN_UPDATE,), f"{_BN}.call", "_moments", why="captured_moments"),
    has((BN_UPDATE,), _BN, lambda cls: cls(name=_PROBE), "_reduction_axes"),
    # A pass's losses without the weights' regularization (without_weight_regularization):
    # Layer.losses lists the layers' own losses first, the weights' after.
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
    """Warns, once, where Keras `version` is not a release the tests pin (TESTED); what
    runs is decided by the internals (`failed`: check_internals'), not the version."""
    match = re.match(r"(\d+)\.(\d+)", version)
    release = (int(match[1]), int(match[2])) if match else None
    if release is not None and TESTED[0] <= release <= TESTED[1]:
        return
    relation = ("newer than" if release is not None and release > TESTED[1] else
                "older than" if release is not None else "not one of")
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
    """Builds a model's metrics and optimizer variables from one batch's spec, as fit
    does from its first batch (Model._symbolic_build), in the model's strategy scope."""
    with model.distribute_strategy.scope():
        model._symbolic_build(data_batch=data_batch)


class SpecBuilt:
    """Mixin for a keras.Model: fit and evaluate build it from their data's element spec,
    never from a batch. Keras's own build reduces the first distributed batch eagerly,
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
           keras.callbacks.BackupAndRestore: ("backup_dir", *_BACKUP_PATHS)}


@contextlib.contextmanager
def elsewhere(callbacks, directory):
    """While the block runs, Keras's callbacks that write (ModelCheckpoint, TensorBoard,
    BackupAndRestore) write under `directory` (made, and removed after): a worker that is
    not the chief. A BackupAndRestore's directory is copied there first, so it restores
    what the chief saved."""
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
    """The model's BatchNormalization layers (nested ones each once) whose moments the
    window captures: all where the statistics step once per update, none otherwise.
    ValueError for a layer the window cannot train: synchronized=True, or, where its
    moments are captured, renorm=True or a subclass with its own `call` or `_moments`."""
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
    """The layers of `model` (nested ones each once) whose activity regularizer this Keras
    adds as a raw sum over the batch (before 3.14; from 3.14 a per-sample mean, weighed
    as any loss): the direct batch adds the sum over all the window's samples, so the
    window step sums these apart, a part divided by nothing."""
    if _activity_losses_are_means():
        return []
    require(ACTIVITY)
    return [layer for layer in model._flatten_layers()
            if getattr(layer, "activity_regularizer", None) is not None]


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
    require(REGULARIZED)
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


@contextlib.contextmanager
def one_variable_at_a_time(optimizer):
    """Within the block, `optimizer` (a LossScaleOptimizer's inner one) updates its
    variables one after another: each gradient waits for the previous variable's new
    value. A window's gradients all exist as its apply starts, so otherwise several
    updates run at once, each with temporaries the size of its variable. A strategy's
    replicas enter at once, in threads, and Keras updates once, in a merge call they
    all wait in: the first to enter patches, the last to leave restores."""
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
