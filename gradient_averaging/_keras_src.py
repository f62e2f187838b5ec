"""Every use of Keras's internals, each checked at import.

`accumulate` builds on Keras's data adapters, its loss scaling for distribution and two
private Model methods, and replaces a third (SpecBuilt: Keras's build, which fails under
several workers); the batch-norm statistics on BatchNormalization's `_moments`; the
weighting of activity regularizers on how this Keras adds their losses; every TF2 path's
apply on Keras calling `update_step` once per variable (window_step.one_variable_at_a_time).
Keras exports none of them and may change any in a release: this module is the one place
that touches them. INTERNALS lists each, with the paths that need it and what it must be;
all are checked once, at import, by reading Keras's classes and code (the only objects
made are a Model, a Layer, a BatchNormalization and a BackupAndRestore, named and without
variables: milliseconds). A path whose internal is missing or changed is refused where it
starts (`require`), in one line naming the internal and the Keras version; every other
path runs. The version number refuses nothing: a release the tests do not pin warns
once, naming the tested ones (TESTED), and runs.
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
import types
import warnings

import keras
import tensorflow as tf

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
    takes((FIT,), "keras.src.losses.loss:unscale_loss_for_distribution", None),
    # The model built from its data's spec (SpecBuilt), where Keras's fit and evaluate
    # call _maybe_symbolic_build with their epoch iterator.
    takes((FIT,), "keras:Model._symbolic_build", None, data_batch=None),
    takes((FIT,), "keras:Model._maybe_symbolic_build", None, iterator=None, data_batch=None),
    mentions((FIT,), "keras:Model.fit", "_maybe_symbolic_build", why="SpecBuilt"),
    mentions((FIT,), "keras:Model.evaluate", "_maybe_symbolic_build", why="SpecBuilt"),
    mentions((FIT,), "keras.src.trainers.epoch_iterator:EpochIterator.__init__",
             "data_adapter", why="SpecBuilt reads the iterator's adapter"),
    has((FIT,), "keras:Model", lambda cls: cls(name=_PROBE), "_distribute_strategy",
        "_loss_tracker"),
    # fit's logged loss (add_to_logged_loss) and the pass's losses (losses_from_the_pass).
    mentions((FIT,), "keras:metrics.Mean.__init__", "total",
             why="the loss tracker's total"),
    has((FIT,), _LAYERS, lambda cls: cls(name=_PROBE), "_losses_override"),
    mentions((FIT,), f"{_LAYERS}.losses", "_losses_override", why="losses_from_the_pass"),
    has((FIT,), "keras.callbacks:BackupAndRestore", lambda cls: cls(_PROBE), *_BACKUP_PATHS),
    # Every TF2 path's apply (window_step.one_variable_at_a_time): Keras's TensorFlow
    # optimizer calls update_step(gradient, variable, learning_rate), once per variable,
    # through the attribute, so an instance's own update_step is the one called.
    takes((APPLY, FIT), "keras:optimizers.Optimizer.update_step", None, None, None, None),
    mentions((APPLY, FIT),
             "keras.src.backend.tensorflow.optimizer:TFOptimizer._distributed_tf_update_step",
             "update_step", why="window_step.one_variable_at_a_time orders its calls"),
    # The layers of a model, nested ones each once.
    takes((BATCH_NORM, BN_UPDATE, ACTIVITY), f"{_LAYERS}._flatten_layers", None,
          include_self=False),
    has((BATCH_NORM, BN_UPDATE), _BN, lambda cls: cls(name=_PROBE), "synchronized"),
    # The window's batch-norm statistics: each pass's moments, captured in _moments.
    takes((BN_UPDATE,), f"{_BN}._moments", None, None, None),
    mentions((BN_UPDATE,), f"{_BN}.call", "_moments", why="captured_moments"),
    has((BN_UPDATE,), _BN, lambda cls: cls(name=_PROBE), "_reduction_axes"),
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
unscale_loss_for_distribution = _internal("keras.src.losses.loss:unscale_loss_for_distribution")

__all__ = ["DataAdapter", "SpecBuilt", "activity_losses_apart", "add_to_logged_loss",
           "batch_norm_layers", "captured_moments", "check_internals", "check_release",
           "data_adapters", "elsewhere", "require",
           "losses_from_the_pass", "loss_tracker", "summed_activity", "summed_activity_layers",
           "symbolic_build", "train_validation_split", "unscale_loss_for_distribution"]


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
           keras.callbacks.BackupAndRestore: ("backup_dir", *_BACKUP_PATHS)}


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
    """The layers of `model` (nested ones too, each once) whose activity regularizer this
    Keras adds as a raw sum over the batch's rows: all that have one before 3.14, none
    from 3.14 on, where the loss is a per-sample mean that every path weighs as it weighs
    any loss. The direct batch of a window's E samples adds the sum over all of them, so a
    mini-batch's activity term must weigh E times its loss's, and E is known only when
    the window closes: the window step sums these gradients apart (window_step)."""
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


def add_to_logged_loss(model, loss_sum):
    """Replica context: adds `loss_sum` to the sum of per-sample losses behind fit's
    `loss` log (the loss tracker's total), its samples already counted."""
    total = loss_tracker(model).total
    total.assign_add(tf.cast(loss_sum, total.dtype))


@contextlib.contextmanager
def losses_from_the_pass(model, losses):
    """`model.losses` inside the block: the losses the forward pass on values returned
    (add_loss's and the regularizers'), as Keras's JAX trainer makes compute_loss see
    them (Layer._losses_override); outside a pass they would be lost."""
    if losses:
        model._losses_override = list(losses)
    try:
        yield
    finally:
        if losses:
            model._losses_override = []
