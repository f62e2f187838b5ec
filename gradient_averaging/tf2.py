"""Gradient accumulation in a TF2 training loop: your own Keras model, dataset and loss.

The same update as the post's TF1 mechanism (`trainer.py` in the checkout), written the
TF2 way:

    with strategy.scope():                       # optional: tf.distribute
        model = make_model()
        optimizer = keras.optimizers.Adam(1e-3)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
    fit_accumulated(model, dataset, optimizer, loss_fn, average_gradients=8)

Two classes train a window of N mini-batches, to the same weights (bit for bit), both on
the one window step (window_step.WindowStep: sums in place, the vote, the apply):
  * `WindowAccumulator`, one compiled call per window (`fit_accumulated`'s default): a
    loop inside the call hands the window's mini-batches to the step one at a time,
    taken from a tf.data iterator (`fit`) or from a stacked window (`apply_stacked`).
  * `MiniBatchAccumulator`, one call per mini-batch, for loops that need Python between
    mini-batches (or your own `train_step`): `accumulate` adds a mini-batch, `apply`
    applies the window.
Each mini-batch adds the gradient of the SUM of its per-sample losses; the window's sum
divided by its samples is applied, exactly the gradient of the mean loss over every
sample of the window, whatever the sizes of its mini-batches (a short last one, a partial
window). The model runs on its weights' values (`stateless_call`); its other state
(dropout's seed generators) is written back after each mini-batch.

Under a `tf.distribute` strategy each mini-batch is the GLOBAL one, and replica r of K
receives only its share of it (replicas.py). Sums stay on their replica: a mini-batch
communicates nothing; once per window a one-number vote (is anything non-finite?) is
summed over the replicas, and the optimizer all-reduces (sums) the replicas' shares of
the mean.
"""

import collections
import itertools
import logging

import numpy as np
import tensorflow as tf

from gradient_averaging import arguments
from gradient_averaging import batch_statistics as statistics_lib
from gradient_averaging import micro_batch as micro_batch_lib
from gradient_averaging import replicas as replicas_lib
from gradient_averaging import window as window_lib
from gradient_averaging import window_step as step_lib

FitSummary = collections.namedtuple(
    "FitSummary", ["mini_batches", "updates", "partial_window", "skipped_windows",
                   "micro_batch"],
    defaults=(0, None))


def stack_window(mini_batches):
    """N global mini-batches of (x, y) as one stacked window: (xs, ys, sizes) arrays.

    Args:
      mini_batches: a sequence of (x, y); x and y may be nested structures of arrays.

    Returns:
      (xs, ys, sizes): each array stacked on a new leading axis, [N, B, ...], with B the
      largest mini-batch; shorter mini-batches are padded with zeros, which the window
      step leaves out by `sizes` (int32 [N], each mini-batch's samples).
    """
    (xs, ys), sizes = window_lib.stack_padded([tuple(batch) for batch in mini_batches])
    return xs, ys, sizes


def _loss_parts(loss_fn, y, outputs, pass_losses, n_local):
    """A mini-batch's loss as window_step.Parts: loss_fn's losses summed and divided by
    the samples, or, where it returns (losses, weights), the weighted sum divided by
    the summed weights; the pass's add_loss losses once per sample."""
    out = loss_fn(y, outputs)
    if isinstance(out, tuple) and len(out) == 2:
        losses, weights = out
        losses = tf.cast(losses, window_lib.accumulator_dtype(losses))
        weights = tf.broadcast_to(tf.cast(weights, losses.dtype), tf.shape(losses))
        parts = [window_lib.Part(tf.reduce_sum(losses * weights), tf.reduce_sum(weights), None,
                               "weights")]
    else:
        if out.shape.rank == 0:
            raise ValueError("loss_fn must return one loss per sample, not their mean (use a "
                             "Keras loss with reduction=None), or (losses, weights)")
        parts = [window_lib.Part(tf.reduce_sum(tf.cast(out, window_lib.accumulator_dtype(out))),
                               n_local, None, window_lib.SAMPLES)]
    if pass_losses:  # each a mean over the samples: once per sample
        # In float32: a float16 layer's activity loss (mixed precision) is float16.
        parts.append(window_lib.Part(tf.cast(n_local, tf.float32) * tf.add_n(
            [tf.cast(loss, tf.float32) for loss in pass_losses]), n_local, None,
            window_lib.SAMPLES))
    return parts


def _has_activity_regularizer(model):
    """Whether any layer of `model` (nested models' too) has an activity regularizer."""
    return any(getattr(layer, "activity_regularizer", None) is not None
               or _has_activity_regularizer(layer) for layer in getattr(model, "layers", ()))


def _spec(t, leading):
    """A TensorSpec of `t` (a tensor, an array or a TensorSpec) with its first `leading`
    axes of any size. An array's is read off it, not copied into a tensor: apply_effective
    takes one per window."""
    numeric = isinstance(t, np.ndarray) and t.dtype.kind in "biufc"  # not text, objects
    if not (numeric or isinstance(t, tf.TensorSpec) or tf.is_tensor(t)):
        t = tf.convert_to_tensor(t)
    return tf.TensorSpec([None] * leading + tf.TensorShape(t.shape)[leading:].as_list(),
                         tf.as_dtype(t.dtype))


class _Accumulator:
    """What both accumulators share: the model, optimizer and strategy, the window step,
    a mini-batch's pass, their counters.

    Attributes:
      updates: updates applied so far (as the optimizer's `iterations` counts them).
      skipped_windows: windows skipped for a non-finite value (check_finite).
      loss_total, samples_total: replica-local float64 variables, monitoring only (never
        reset): the running sum of finite per-sample losses and their samples.
      statistics: the model's batch_statistics.BatchStatistics.
      step: the window_step.WindowStep.
      apply_step: tf.function() -> (applied, single): applies the open window
        (WindowStep.apply).
    """

    def __init__(self, model, optimizer, loss_fn, strategy=None, check_finite=True,
                 bn_statistics="update", jit_compile=False, *, average_gradients=None):
        """Builds the optimizer beside the model's variables.

        Args:
          model: a Keras model; created under `strategy.scope()` if a strategy is used.
          optimizer: a Keras optimizer, created under the same scope.
          loss_fn: (y_true, y_pred) -> per-sample losses, shape [batch] (e.g. a Keras
            loss with reduction=None); the applied gradient is that of their mean.
          strategy: a tf.distribute.Strategy, or None for the default (one device).
          check_finite: skip (not apply) a window holding a NaN or Inf loss or
            gradient; costs one small reduction per window.
          bn_statistics: "update": BatchNormalization layers take one moving-average step
            per update, on the window's statistics (see batch_statistics);
            "mini_batch": a step per mini-batch, as Keras takes them.
          jit_compile: compile each mini-batch's pass (forward and backward) with XLA.
          average_gradients: N, mini-batches per update, for `fit` (as `accumulate` and
            AveragingOptimizer take it where they are made).
        """
        self.average_gradients = (None if average_gradients is None
                                  else arguments.check_average_gradients(average_gradients))
        self.model = model
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.strategy = strategy or tf.distribute.get_strategy()
        self.check_finite = check_finite
        self.jit_compile = bool(jit_compile)
        self.variables = list(model.trainable_variables)
        if not self.variables:
            raise ValueError("the model has no trainable variables")
        self.statistics = statistics_lib.BatchStatistics(model, bn_statistics)
        summed_activity = None
        if _has_activity_regularizer(model):  # Keras's internals only for such a model
            from gradient_averaging import _keras_src
            summed_activity = _keras_src.summed_activity(model)
        with self.strategy.scope():
            if not optimizer.built:
                optimizer.build(self.variables)
            self.loss_total = replicas_lib.local_variable(
                tf.constant(0.0, tf.float64), tf.VariableAggregation.SUM, "loss_total")
            self.samples_total = replicas_lib.local_variable(
                tf.constant(0.0, tf.float64), tf.VariableAggregation.ONLY_FIRST_REPLICA,
                "samples_total")
        self.step = step_lib.WindowStep(
            self.strategy, optimizer, self.variables, self.statistics, check_finite,
            summed_activity, self._log)
        self._pass = (tf.function(self._gradients, jit_compile=True)
                      if self.jit_compile else self._gradients)
        self.apply_step = tf.function(self.step.apply)
        self._effective_windows = {}  # apply_effective's, by the batches' signature
        self._found = {}  # the MicroBatch fit_effective found, by what changes it
        self.parallel_mini_batches = 1  # one call per mini-batch (WindowAccumulator's own)
        self.updates = 0
        self.skipped_windows = 0

    def _gradients(self, weights, state, x, y, n_local):
        """One mini-batch's pass on values (XLA compiles it under jit_compile):
        (per term, the gradients of its sum, the model's other state, the parts' values,
        the batch-norm sums)."""
        def objective(outputs, pass_losses, unused_state):
            return _loss_parts(self.loss_fn, y, outputs, pass_losses, n_local), None

        step = self.step.mini_batch_gradients(self.model, weights, state, x, objective)
        return (step.gradients, step.state, step.parts,
                step_lib.pass_moments(self.statistics, step))

    def _replica_mini_batches(self, batches, n_locals):
        """Adds this replica's shares of a group of global mini-batches to the window, in
        order; their passes may run at once (step_lib.run_passes). Returns a token that
        exists once all are added."""
        def run(batch, weights, state):
            (x, y), n_local = batch
            gradients, state, parts, moments = self._pass(weights, state, x, y, n_local)
            return (gradients, parts, moments), state

        results = step_lib.run_passes(run, list(zip(batches, n_locals)), self.variables,
                                      self.model.non_trainable_variables)
        tokens = []
        for (gradients, parts, moments), n_local in zip(results, n_locals):
            finite = tf.reduce_all(tf.math.is_finite(parts))
            tokens.append(self.step.add(gradients, moments, n_local, finite, parts))
        return step_lib.last_of(tokens)

    def _add(self, batches):
        """Cross-replica: adds a group of global mini-batches (x, y), in order, each
        replica its shares."""
        shares = [replicas_lib.distribute(self.strategy, batch) for batch in batches]
        return self.strategy.run(self._replica_mini_batches, args=(
            [share for share, _ in shares], [n_local for _, n_local in shares]))

    def _build(self, x, y):
        """The window step's batch-norm sums and its parts (one pass traced), for
        mini-batches like (x, y) (tensors, arrays or specs): once, before training."""
        x_spec, y_spec = (tf.nest.map_structure(lambda t: _spec(t, 1), t) for t in (x, y))
        self.step.build_statistics(self.model, x_spec)

        @tf.function(input_signature=[x_spec, y_spec])
        def one_pass(x, y):  # traced only, for the parts of the loss
            self._gradients([tf.convert_to_tensor(v) for v in self.variables],
                            [tf.convert_to_tensor(v) for v in self.model.non_trainable_variables],
                            x, y, tf.shape(tf.nest.flatten(x)[0])[0])

        self.step.learn_layout(one_pass.get_concrete_function)

    def _log(self, loss, unused_parts, samples, all_samples):
        """WindowStep's log_loss: the running totals (loss_totals)."""
        self.loss_total.assign_add(loss * tf.cast(samples, tf.float64))
        self.samples_total.assign_add(all_samples)

    def _counted(self, applied, single):
        applied = bool(applied)
        if self.statistics:
            self.statistics.warn_single_values(single)
        if applied:
            self.updates += 1
        else:
            self.skipped_windows += 1
        return applied

    def trial_window(self, spec):
        """The micro_batch.Trial of this accumulator (find_micro_batch's trials): the add
        training runs for batches like `spec` ((x, y), a tf.data element spec or a batch),
        the window step, the variables a trial may change, training's apply."""
        windows = self._windows(spec)
        state = (self.model.trainable_variables + list(self.optimizer.variables)
                 + windows.state)
        return micro_batch_lib.Trial(windows.add_batch, self.step, state,
                                     self.parallel_mini_batches
                                     * self.strategy.num_replicas_in_sync, self.apply_step)

    def _windows(self, spec):
        """The micro_batch.EffectiveWindows adding batches like `spec` (one trace per
        spec, for any samples and any B)."""
        signature = tf.nest.map_structure(lambda t: _spec(t, 1), tuple(spec))
        key = repr(signature)
        if key not in self._effective_windows:
            self._effective_windows[key] = micro_batch_lib.EffectiveWindows(
                self._effective_add(signature), self.step,
                self.model.non_trainable_variables + [self.loss_total, self.samples_total])
        return self._effective_windows[key]

    def fit_effective(self, dataset, micro_batch_size="auto", callback=None, budget=None,
                      margin=None):
        """One pass over `dataset`, each batch an effective batch: one update each, as
        mini-batches of `micro_batch_size` per replica, the last one shorter. "auto": the
        largest that fits, found before training on the first batch (find_micro_batch,
        within `budget` bytes less `margin`; again only where E, the batches' spec,
        budget or margin changed). A tf.data dataset's element spec says where batches
        differ beyond their samples (sequences padded per batch). callback(mini_batch)
        runs after each mini-batch's update. Returns the FitSummary, its micro_batch B's
        cut (halved where a window ran out of memory: apply_effective). Raises
        micro_batch.OutOfMemory (in an update, or under several replicas) and
        micro_batch.NothingFits (one sample does not fit)."""
        size = arguments.check_micro_batch_size(micro_batch_size)
        budget, margin = arguments.check_budget(budget), arguments.check_margin(margin)
        counts = _FitCounts(self, 1)
        batches = iter(dataset)
        first = next(batches, None)
        if first is None:  # nothing to train on
            return counts.summary(False, False)
        first = tuple(first)
        spec = dataset.element_spec if isinstance(dataset, tf.data.Dataset) else first
        samples = int(tf.shape(tf.nest.flatten(first)[0])[0])
        key = (samples, self._windows(spec), budget, margin)  # what changes B found
        if size != "auto":
            found = micro_batch_lib.plan(samples, size, self.strategy.num_replicas_in_sync)
        elif key in self._found:
            found = self._found[key]
        else:
            found = micro_batch_lib.find_micro_batch(self, first, samples, budget, margin, spec)
        for batch in itertools.chain([first], batches):
            applied, count, found = self.apply_effective(batch, found, spec)
            counts.mini_batches += count
            counts.window(applied, count)
            if callback is not None:
                for mini_batch in range(counts.mini_batches - count + 1,
                                        counts.mini_batches + 1):
                    callback(mini_batch)
        if size == "auto":
            self._found[key] = found
        return counts.summary(False, applied)._replace(micro_batch=found)

    def apply_effective(self, batch, found, spec=None):
        """Trains the effective batch `batch` (x, y) as one update, in mini-batches of
        found's B per replica (a micro_batch.MicroBatch), the last one shorter; `spec`:
        the batches' (a tf.data element spec; None: `batch`'s). Returns (applied: False
        where the window was skipped, the mini-batches, `found`, B halved where a window
        ran out of memory: micro_batch.EffectiveWindows, whose errors it raises)."""
        windows = self._windows(batch if spec is None else spec)
        if self.step.rescale:
            self.step.expected.assign(micro_batch_lib.mini_batches_of(
                batch, found.micro_batch_size * self.strategy.num_replicas_in_sync))
        count, found = windows.add(tuple(batch), found)
        applied, single = windows.apply(self.apply_step)
        return self._counted(bool(applied), single.numpy()), count, found

    def loss_totals(self):
        """(sum of per-sample training losses, samples) so far, over all replicas.

        Mini-batches whose loss was not finite are left out of both.
        """
        return float(self.loss_total.read_value()), float(self.samples_total.read_value())


def _window_size(accumulator):
    """N for a fit: the accumulator's."""
    if accumulator.average_gradients is None:
        raise ValueError(f"{type(accumulator).__name__} has no average_gradients: make "
                         "it with average_gradients=N")
    return accumulator.average_gradients


class _FitCounts:
    """A fit's mini-batches and log lines, the same for both accumulators; its updates and
    skipped windows are the accumulator's counts (_Accumulator._counted) since it began."""

    def __init__(self, accumulator, average_gradients):
        self.accumulator = accumulator
        self.average_gradients = average_gradients
        self.mini_batches = self.partial = 0
        self._before = (accumulator.updates, accumulator.skipped_windows)

    def window(self, applied, size):
        """Logs a skipped window of `size` mini-batches, ended at self.mini_batches."""
        if not applied:
            logging.warning("non-finite loss or gradient in mini-batches %d-%d: the "
                            "window was skipped, not applied",
                            self.mini_batches - size + 1, self.mini_batches)
        return applied

    def summary(self, warn_partial, applied):
        if warn_partial and self.partial and applied:
            logging.warning("%d mini-batches is not a multiple of average_gradients=%d: "
                            "the last %d were applied as one update of their mean",
                            self.mini_batches, self.average_gradients, self.partial)
        updates, skipped = self._before
        return FitSummary(self.mini_batches, self.accumulator.updates - updates, self.partial,
                          self.accumulator.skipped_windows - skipped)


# ---------------------------------------------------------------- one call per window


class WindowAccumulator(_Accumulator):
    """Trains a whole window of N mini-batches in one compiled call.

    Attributes:
      window_step: tf.function(xs, ys, sizes) -> (applied, single): trains one stacked
        window (compiled on the first; see apply_stacked).
      parallel_mini_batches: P, the mini-batches whose passes the window loop runs at
        once (1, the default: one mini-batch's activations alive at a time, as B alone
        holds; each one more costs a mini-batch's activations and gradients, and may be
        faster where one pass leaves the device idle: small mini-batches).
    """

    def __init__(self, *args, parallel_mini_batches=1, **kwargs):
        super().__init__(*args, **kwargs)
        self.parallel_mini_batches = arguments.check_parallel_mini_batches(
            parallel_mini_batches)
        self.window_step = None  # compiled on the first stacked window
        self._iterator_steps = {}  # N -> the tf.function pulling N mini-batches

    def _compile_window_step(self, xs, ys, sizes):
        signature = tf.nest.map_structure(lambda t: _spec(t, 2), (xs, ys)) + (
            tf.TensorSpec([None], tf.convert_to_tensor(sizes).dtype),)
        self._build(*tf.nest.map_structure(lambda t: t[0], (xs, ys)))

        @tf.function(input_signature=signature)
        def window_step(xs, ys, sizes):
            sizes = tf.cast(sizes, tf.int32)

            def mini_batch(i):
                return tf.nest.map_structure(lambda t: t[i, :sizes[i]], (xs, ys))

            window_lib.in_groups(tf.size(sizes), lambda indices: self._add(
                [mini_batch(i) for i in indices]), self.parallel_mini_batches)
            return self.step.apply()  # an empty window (N = 0) applies nothing

        return window_step

    def build_window(self, xs, ys, sizes):
        """Compiles the window step for windows stacked like (xs, ys, sizes), untrained.

        `apply_stacked` does this on its first window; call it first to keep the tracing
        and TensorFlow's set-up of the function out of a timed loop: it runs the step once
        on an empty window, which trains nothing. Any N and B then run without retracing.
        Under a multi-worker strategy every worker must call it (the empty window still
        votes). Under jit_compile XLA compiles each mini-batch's pass for each shape it
        meets, on the first of each.
        """
        if self.window_step is None:
            self.window_step = self._compile_window_step(xs, ys, sizes)
            self.window_step(*tf.nest.map_structure(lambda t: t[:0], (xs, ys, sizes)))

    def apply_window(self, mini_batches):
        """Trains one whole window, given as its N global mini-batches, in one call.

        The window's mini-batches may differ in size (each weighs by its samples).

        Args:
          mini_batches: a sequence of (x, y) global mini-batches.

        Returns:
          True where the window was applied, False where it was skipped.
        """
        return self.apply_stacked(*stack_window(mini_batches))

    def apply_stacked(self, xs, ys, sizes):
        """Trains one whole window, stacked as `stack_window` returns it, in one call.

        The loop in the call hands mini-batch i, xs[i, :sizes[i]], to the window step, one
        at a time; the sample-weighted mean is applied, or the window is skipped whole
        where a loss or gradient is NaN or Inf (check_finite). The stacked inputs
        themselves are the window's N x B samples: `fit` on a tf.data dataset takes the
        mini-batches one at a time instead.

        Args:
          xs, ys: the mini-batches stacked on a new leading axis, [N, B, ...] and
            [N, B]. Numpy arrays are copied into tensors on each call; tensors (e.g. a
            tf.gather from the training set) are not.
          sizes: int [N], each mini-batch's samples.

        Returns:
          True where the window was applied, False where it was skipped.
        """
        self.build_window(xs, ys, sizes)
        if self.step.rescale:
            self.step.expected.assign(len(sizes))
        return self._counted(*(v.numpy() for v in self.window_step(xs, ys, sizes)))

    def _effective_add(self, signature):
        """The tf.function adding one effective batch (x, y) to the open window as
        mini-batches of `size` samples per replica, one at a time: (batch, size) ->
        mini-batches; one trace for every batch size and micro-batch."""
        self._build(*signature)
        replicas = self.strategy.num_replicas_in_sync

        @tf.function(input_signature=[signature, tf.TensorSpec([], tf.int32)])
        def add(batch, size):
            return window_lib.cut(batch, size * replicas, self._add,
                                  self.parallel_mini_batches)

        return add

    def _iterator_step(self, average_gradients, element_spec):
        """The tf.function that pulls one window of up to N mini-batches from an
        iterator, one at a time, and applies it: -> (mini-batches, applied, single)."""
        if average_gradients not in self._iterator_steps:
            self._build(*element_spec)

            @tf.function
            def window_from(iterator):
                count = step_lib.window_from(self.strategy, iterator, average_gradients,
                                             self._add, self.parallel_mini_batches)
                applied, single = self.step.apply()
                return count, applied, single

            self._iterator_steps[average_gradients] = window_from
        return self._iterator_steps[average_gradients]

    def fit(self, dataset, *, callback=None, warn_partial=True):
        """One pass over `dataset`, one compiled call per N mini-batches.

        The call takes the window's mini-batches from the dataset's iterator one at a
        time, so a window's inputs are never all on the device at once. A trailing
        partial window is applied as the mean over its samples. A window with a
        non-finite loss or gradient is skipped, with a warning (check_finite).

        Args:
          dataset: a tf.data.Dataset of (x, y) global mini-batches, or any iterable of
            them (made a dataset here). Under a multi-worker strategy every worker must
            yield the same batches.
          callback: called as callback(mini_batch) for each mini-batch (1-based),
            after its window's update.
          warn_partial: log a warning when a partial window is applied.

        Returns:
          FitSummary(mini_batches, updates, partial_window, skipped_windows):
          partial_window is the number of mini-batches in the trailing partial window
          (0 if none).
        """
        counts = _FitCounts(self, _window_size(self))
        dataset = _as_dataset(dataset)
        applied = False
        if dataset is None:  # nothing to train on
            return counts.summary(warn_partial, applied)
        window_from = self._iterator_step(counts.average_gradients, dataset.element_spec)
        if self.step.rescale:
            self.step.expected.assign(counts.average_gradients)
        iterator = iter(dataset)
        while True:
            size, applied, single = window_from(iterator)
            size = int(size)
            if not size:
                break
            applied = self._counted(bool(applied), single.numpy())
            counts.mini_batches += size
            counts.window(applied, size)
            counts.partial = size % counts.average_gradients
            if callback is not None:
                for mini_batch in range(counts.mini_batches - size + 1,
                                        counts.mini_batches + 1):
                    callback(mini_batch)
            if counts.partial:
                break
        return counts.summary(warn_partial, applied)


def _as_dataset(dataset):
    """`dataset` as a tf.data.Dataset of (x, y) (None where an iterable is empty)."""
    if isinstance(dataset, tf.data.Dataset):
        return dataset
    iterator = iter(dataset)
    try:
        first = next(iterator)
    except StopIteration:
        return None
    first = tf.nest.map_structure(tf.convert_to_tensor, tuple(first))
    return tf.data.Dataset.from_generator(
        lambda: (tuple(batch) for batch in itertools.chain([first], iterator)),
        output_signature=tf.nest.map_structure(lambda t: _spec(t, 1), first))


# ---------------------------------------------------------------- one call per mini-batch


class MiniBatchAccumulator(_Accumulator):
    """Sums mini-batch gradients in variables, one call per mini-batch; applies their
    sample-weighted mean once per window.

    Attributes:
      mini_batch_step: tf.function(x, y): adds one global mini-batch's summed gradients.
      apply_step: tf.function() -> (applied, single): applies sums / samples unless the
        open window holds a NaN or Inf loss or gradient on any replica (the replicas'
        vote), then opens the next window either way.
      window: mini-batches accumulated since the last update (a Python count).
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.mini_batch_step = None  # compiled on the first batch, with its shapes
        self.window = 0

    @property
    def sums(self):
        """The window's replica-local gradient sums (every term's, in order)."""
        return [total for term in self.step.sums or [] for total in term]

    @property
    def samples(self):
        """The open window's samples, each replica's (a replica-local variable)."""
        return self.step.samples

    def build(self, x, y):
        """Compiles the mini-batch step for batches shaped like (x, y), without training."""
        if self.mini_batch_step is None:
            signature = tf.nest.map_structure(lambda t: _spec(t, 1), (x, y))
            self._build(x, y)

            def mini_batch_step(x, y):
                self._add([(x, y)])

            self.mini_batch_step = tf.function(mini_batch_step, input_signature=signature)
            if self.step.rescale:
                self.step.expected.assign(self.average_gradients or 1)
            # Traced now: apply_step needs to know which variables get a gradient.
            self.mini_batch_step.get_concrete_function()

    def accumulate(self, x, y):
        """Adds one global mini-batch (x, y) to the open window."""
        self.build(x, y)
        self.mini_batch_step(x, y)
        self.window += 1

    def apply(self):
        """Applies the mean gradient of the open window (full or partial).

        With check_finite, a window holding a NaN or Inf loss or gradient is skipped
        instead: nothing is applied, the optimizer does not step, the window is emptied.

        Returns:
          True where the window was applied, False where it was skipped.
        """
        if not self.window:
            raise ValueError("no mini-batch accumulated since the last update")
        self.window = 0
        return self._counted(*(v.numpy() for v in self.apply_step()))

    def _effective_add(self, signature):
        """Adds one effective batch (x, y) to the open window as mini-batches of `size`
        samples per replica, one call each: (batch, size) -> mini-batches. The window is
        applied by the caller (fit_effective)."""
        self.build(*signature)  # for batches shaped like the signature, in any axis it opens
        replicas = self.strategy.num_replicas_in_sync

        def add(batch, size):
            size = int(size) * replicas
            samples = int(tf.shape(tf.nest.flatten(batch)[0])[0])
            count = max(1, -(-samples // size))
            try:
                for i in range(count):
                    self.accumulate(*tf.nest.map_structure(
                        lambda t, i=i: t[i * size:(i + 1) * size], batch))
            finally:
                self.window = 0  # applied, or discarded, by the caller
            return count

        return add

    def fit(self, dataset, *, callback=None, warn_partial=True):
        """One pass over `dataset`, one call per mini-batch, an update every N.

        As WindowAccumulator.fit; callback(mini_batch) runs after each mini-batch,
        after the update it completed, if any.
        """
        counts = _FitCounts(self, _window_size(self))
        for x, y in dataset:
            self.accumulate(x, y)
            counts.mini_batches += 1
            if self.window == counts.average_gradients:
                counts.window(self.apply(), counts.average_gradients)
            if callback is not None:
                callback(counts.mini_batches)
        counts.partial = self.window
        applied = bool(counts.partial) and counts.window(self.apply(), counts.partial)
        return counts.summary(warn_partial, applied)


def fit_accumulated(model, dataset, optimizer, loss_fn, average_gradients=None, strategy=None,
                    callback=None, one_call=True, check_finite=True, bn_statistics="update",
                    jit_compile=False, micro_batch_size=None, budget=None,
                    margin=None, parallel_mini_batches=1):
    """Trains a Keras model on `dataset`, one update per `average_gradients` mini-batches,
    or, given `micro_batch_size` instead, one update per batch of `dataset` (each an
    effective batch) trained as mini-batches of that size ("auto": the largest that
    fits; see _Accumulator.fit_effective).

    Each update applies the gradient of the mean loss over all samples of its window, as
    one batch of those samples would; see WindowAccumulator.fit and _Accumulator for the
    arguments.

    Args:
      one_call: train each window in one compiled call (WindowAccumulator); False: one
        call per mini-batch (MiniBatchAccumulator).
      parallel_mini_batches: with one_call, P, the mini-batches whose passes the
        window runs at once (WindowAccumulator.parallel_mini_batches).

    Returns:
      FitSummary(mini_batches, updates, partial_window, skipped_windows, micro_batch).

    Raises:
      ValueError: both average_gradients (other than 1) and micro_batch_size, or
        neither, or a bad value, or parallel_mini_batches without one_call (before any
        training).
    """
    average_gradients, micro_batch_size = arguments.check_window(average_gradients,
                                                                 micro_batch_size)
    budget, margin = arguments.check_budget(budget), arguments.check_margin(margin)
    parallel_mini_batches = arguments.check_parallel_mini_batches(parallel_mini_batches)
    if one_call:
        accumulator = WindowAccumulator(
            model, optimizer, loss_fn, strategy, check_finite, bn_statistics, jit_compile,
            average_gradients=average_gradients, parallel_mini_batches=parallel_mini_batches)
    elif parallel_mini_batches != 1:
        raise ValueError("parallel_mini_batches needs one_call=True: one call per "
                         "mini-batch runs one pass at a time")
    else:
        accumulator = MiniBatchAccumulator(
            model, optimizer, loss_fn, strategy, check_finite, bn_statistics, jit_compile,
            average_gradients=average_gradients)
    if micro_batch_size is None:
        return accumulator.fit(dataset, callback=callback)
    return accumulator.fit_effective(dataset, micro_batch_size, callback=callback,
                                     budget=budget, margin=margin)
