"""Gradient accumulation in a TF2 training loop: your own Keras model, dataset and loss.

    with strategy.scope():                       # optional: tf.distribute
        model, optimizer = make_model(), keras.optimizers.Adam(1e-3)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
    fit_accumulated(model, dataset, optimizer, loss_fn, average_gradients=8)

`WindowAccumulator` (one compiled call per window, the default) and `MiniBatchAccumulator`
(one call per mini-batch, for Python between them) run one window step (window_step) to the
same weights, bit for bit; dropout draws new masks for each mini-batch. Under `tf.distribute`
each mini-batch is the GLOBAL one, each replica training its share.
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
    "FitSummary", ["mini_batches", "updates", "partial_window", "skipped_windows", "micro_batch"],
    defaults=(0, None))


def stack_window(mini_batches):
    """N global mini-batches (x, y) (nested arrays) as one window (xs, ys, sizes): xs, ys stacked
    [N, B, ...], B the largest, shorter ones zero-padded; sizes, int32 [N], each one's samples."""
    (xs, ys), sizes = window_lib.stack_padded([tuple(batch) for batch in mini_batches])
    return xs, ys, sizes


def _loss_parts(loss_fn, y, outputs, pass_losses, n_local):
    """A mini-batch's loss as window_step.Parts: loss_fn's losses summed, over the samples (or
    weighted, over the summed weights); the pass's add_loss losses once per sample."""
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
    if pass_losses:  # float32: a float16 layer's activity loss (mixed precision) is float16
        parts.append(window_lib.Part(tf.cast(n_local, tf.float32) * tf.add_n(
            [tf.cast(loss, tf.float32) for loss in pass_losses]), n_local, None,
            window_lib.SAMPLES))
    return parts


def _has_activity_regularizer(model):
    return any(getattr(layer, "activity_regularizer", None) is not None
               or _has_activity_regularizer(layer) for layer in getattr(model, "layers", ()))


def _spec(t, leading):
    """A TensorSpec of `t` (tensor, array or spec), its first `leading` axes of any size; an
    array's is read off it, not copied to a tensor (apply_effective takes one per window)."""
    numeric = isinstance(t, np.ndarray) and t.dtype.kind in "biufc"  # not text, objects
    if not (numeric or isinstance(t, tf.TensorSpec) or tf.is_tensor(t)):
        t = tf.convert_to_tensor(t)
    return tf.TensorSpec([None] * leading + tf.TensorShape(t.shape)[leading:].as_list(),
                         tf.as_dtype(t.dtype))


class _Accumulator:
    """Both accumulators' base. updates, skipped_windows: windows applied (as optimizer.iterations
    counts) and skipped; apply_step: tf.function() -> (applied, single), applies the open window."""

    def __init__(self, model, optimizer, loss_fn, strategy=None, check_finite=True,
                 bn_statistics="update", jit_compile=False, *, average_gradients=None):
        """model, optimizer: Keras's, made in `strategy.scope()` given a tf.distribute `strategy`.
        loss_fn: (y_true, y_pred) -> per-sample losses [batch] (a Keras loss, reduction=None), or
          (losses, weights); the gradient applied is their mean's.
        check_finite: skip a window with a NaN or Inf loss or gradient (one reduction a window).
        bn_statistics: "update": one BatchNormalization moving-average step per update, on the
          window's statistics; "mini_batch": one per mini-batch, as Keras.
        jit_compile: XLA-compile each mini-batch's pass; average_gradients: N, for `fit`."""
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
        self.parallel_mini_batches = 1  # WindowAccumulator sets its own
        self.updates = 0
        self.skipped_windows = 0

    def _gradients(self, weights, state, x, y, n_local):
        """A mini-batch's pass: (per term its sum's gradients, state, parts, batch-norm sums)."""
        def objective(outputs, pass_losses, unused_state):
            return _loss_parts(self.loss_fn, y, outputs, pass_losses, n_local), None

        step = self.step.mini_batch_gradients(self.model, weights, state, x, objective)
        return (step.gradients, step.state, step.parts,
                step_lib.pass_moments(self.statistics, step))

    def _replica_mini_batches(self, batches, n_locals):
        """Adds this replica's shares of mini-batches in order; -> a token once all are added."""
        def run(batch, weights, state):
            (x, y), n_local = batch
            gradients, state, parts, moments = self._pass(weights, state, x, y, n_local)
            return (gradients, parts, moments), state

        results = step_lib.run_passes(run, list(zip(batches, n_locals)), self.variables,
                                      self.model.non_trainable_variables)
        tokens = []
        for (gradients, parts, moments), n_local in zip(results, n_locals):
            finite = window_lib.finite(parts)
            tokens.append(self.step.add(gradients, moments, n_local, finite, parts))
        return step_lib.last_of(tokens)

    def _add(self, batches):
        """Cross-replica: adds global mini-batches (x, y) in order, each replica its shares."""
        shares = [replicas_lib.distribute(self.strategy, batch) for batch in batches]
        return self.strategy.run(self._replica_mini_batches, args=(
            [share for share, _ in shares], [n_local for _, n_local in shares]))

    def _build(self, x, y):
        """Sets the window step up, once before training, for mini-batches like (x, y) or specs."""
        x_spec, y_spec = (tf.nest.map_structure(lambda t: _spec(t, 1), t) for t in (x, y))
        self.step.build_statistics(self.model, x_spec)

        @tf.function(input_signature=[x_spec, y_spec])
        def one_pass(x, y):  # traced only
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
        self.updates += applied
        self.skipped_windows += not applied
        return applied

    def trial_window(self, spec):
        """The micro_batch.Trial for batches like `spec` ((x, y), element spec or batch)."""
        windows = self._windows(spec)
        state = (self.model.trainable_variables + list(self.optimizer.variables)
                 + windows.state)
        return micro_batch_lib.Trial(windows.add_batch, self.step, state,
                                     self.parallel_mini_batches
                                     * self.strategy.num_replicas_in_sync, self.apply_step)

    def _windows(self, spec):
        signature = tf.nest.map_structure(lambda t: _spec(t, 1), tuple(spec))
        key = repr(signature)
        if key not in self._effective_windows:
            self._effective_windows[key] = micro_batch_lib.EffectiveWindows(
                self._effective_add(signature), self.step,
                self.model.non_trainable_variables + [self.loss_total, self.samples_total])
        return self._effective_windows[key]

    def fit_effective(self, dataset, micro_batch_size="auto", callback=None, budget=None,
                      margin=None):
        """One pass over `dataset`, one update per batch (an effective batch), as mini-batches of
        `micro_batch_size` per replica. "auto": the largest that fits `budget` bytes less `margin`,
        found (find_micro_batch) on the first batch before training, once per E, batch spec, budget
        and margin; a tf.data element spec says where batches differ beyond their samples (padded
        sequences). Returns the FitSummary, micro_batch the B trained (halved where out of memory).
        Raises micro_batch.OutOfMemory (in an update, or under several replicas), NothingFits."""
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
        """Trains the effective batch (x, y) as one update, mini-batches of `found`'s B per replica
        (a micro_batch.MicroBatch); `spec`: the batches' (None: `batch`'s). Returns (applied,
        mini-batches, `found`, B halved where out of memory); raises EffectiveWindows's errors."""
        windows = self._windows(batch if spec is None else spec)
        if self.step.rescale:
            self.step.expected.assign(micro_batch_lib.mini_batches_of(
                batch, found.micro_batch_size * self.strategy.num_replicas_in_sync))
        count, found = windows.add(tuple(batch), found)
        applied, single = windows.apply(self.apply_step)
        return self._counted(bool(applied), single.numpy()), count, found

    def loss_totals(self):
        """(sum of finite per-sample training losses, their samples) so far, all replicas."""
        return float(self.loss_total.read_value()), float(self.samples_total.read_value())


class _FitCounts:
    def __init__(self, accumulator, average_gradients=None):
        self.accumulator = accumulator
        self.average_gradients = average_gradients or accumulator.average_gradients
        if self.average_gradients is None:
            raise ValueError(f"{type(accumulator).__name__} has no average_gradients: make "
                             "it with average_gradients=N")
        self.mini_batches = self.partial = 0
        self._before = (accumulator.updates, accumulator.skipped_windows)

    def window(self, applied, size):
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


class WindowAccumulator(_Accumulator):
    """Trains a window of N mini-batches in one compiled call; arguments as _Accumulator's, and
    parallel_mini_batches: P, the passes run at once (1: one mini-batch's activations alive at a
    time; each more costs its activations and gradients, faster where one pass idles the device)."""

    def __init__(self, *args, parallel_mini_batches=1, **kwargs):
        super().__init__(*args, **kwargs)
        self.parallel_mini_batches = arguments.check_parallel_mini_batches(parallel_mini_batches)
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
        """Compiles the window step for windows stacked like (xs, ys, sizes), as apply_stacked
        does on its first: call it to keep tracing out of a timed loop. Any N and B then run
        untraced (under jit_compile XLA compiles each pass per new shape). It runs the step on
        an empty window, which trains nothing but votes: under multi-worker, call it on all."""
        if self.window_step is None:
            self.window_step = self._compile_window_step(xs, ys, sizes)
            self.window_step(*tf.nest.map_structure(lambda t: t[:0], (xs, ys, sizes)))

    def apply_window(self, mini_batches):
        """apply_stacked for one window given as its N global mini-batches (x, y), of any sizes."""
        return self.apply_stacked(*stack_window(mini_batches))

    def apply_stacked(self, xs, ys, sizes):
        """Trains one window stacked as stack_window returns it (all N x B samples at once), in
        one call, mini-batch i (xs[i, :sizes[i]]) at a time; returns whether it was applied.
        Numpy arrays are copied into tensors on each call; tensors (a tf.gather) are not."""
        self.build_window(xs, ys, sizes)
        if self.step.rescale:
            self.step.expected.assign(len(sizes))
        return self._counted(*(v.numpy() for v in self.window_step(xs, ys, sizes)))

    def _effective_add(self, signature):
        """tf.function (batch, size) -> mini-batches: adds batch cut into `size` per replica."""
        self._build(*signature)
        replicas = self.strategy.num_replicas_in_sync

        @tf.function(input_signature=[signature, tf.TensorSpec([], tf.int32)])
        def add(batch, size):
            return window_lib.cut(batch, size * replicas, self._add,
                                  self.parallel_mini_batches)

        return add

    def _iterator_step(self, average_gradients, element_spec):
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
        """One pass over `dataset`, a tf.data.Dataset of (x, y) global mini-batches or any iterable
        of them (under multi-worker, the same on every worker): one compiled call per N, taken from
        its iterator one at a time (a window's inputs are never all on the device). A trailing
        partial window is applied as its mean; a skipped window logs a warning. callback(mini_batch)
        runs for each mini-batch (1-based), after its window's update. Returns the FitSummary."""
        counts = _FitCounts(self)
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


class MiniBatchAccumulator(_Accumulator):
    """Sums mini-batch gradients in variables, one call per mini-batch (`accumulate`), and
    applies their sample-weighted mean once per window (`apply`); arguments as _Accumulator's.
    window: the mini-batches accumulated since the last update."""

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
            # Traced now: apply_step needs what gets a gradient; accumulate calls it directly.
            self._mini_batch_call = self.mini_batch_step.get_concrete_function()

    def accumulate(self, x, y):
        """Adds one global mini-batch (x, y) to the open window."""
        self.build(x, y)
        self._mini_batch_call(x, y)
        self.window += 1

    def apply(self):
        """Applies the open window's mean gradient (full or partial) and empties the window;
        returns False where it was skipped (a NaN or Inf on any replica; no optimizer step)."""
        if not self.window:
            raise ValueError("no mini-batch accumulated since the last update")
        self.window = 0
        return self._counted(*(v.numpy() for v in self.apply_step()))

    def _effective_add(self, signature):
        """As WindowAccumulator's, one call per mini-batch; the caller applies the window."""
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
        """As WindowAccumulator.fit, per mini-batch; callback after each, and any update it ends."""
        counts = _FitCounts(self)
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
    or, given `micro_batch_size` instead, one per batch of `dataset` (an effective batch)
    trained as mini-batches of that size ("auto": the largest that fits); returns the
    FitSummary. one_call=False: one call per mini-batch (MiniBatchAccumulator), not per
    window (WindowAccumulator); other arguments as theirs, their fit's and fit_effective's.
    Raises ValueError, before any training, for both average_gradients (other than 1) and
    micro_batch_size, or neither, a bad value, or parallel_mini_batches without one_call."""
    average_gradients, micro_batch_size = arguments.check_window(average_gradients,
                                                                 micro_batch_size)
    budget, margin = arguments.check_budget(budget), arguments.check_margin(margin)
    parallel_mini_batches = arguments.check_parallel_mini_batches(parallel_mini_batches)
    if not one_call and parallel_mini_batches != 1:
        raise ValueError("parallel_mini_batches needs one_call=True: one call per "
                         "mini-batch runs one pass at a time")
    kind, own = ((WindowAccumulator, dict(parallel_mini_batches=parallel_mini_batches))
                 if one_call else (MiniBatchAccumulator, {}))
    accumulator = kind(model, optimizer, loss_fn, strategy, check_finite, bn_statistics,
                       jit_compile, average_gradients=average_gradients, **own)
    if micro_batch_size is None:
        return accumulator.fit(dataset, callback=callback)
    return accumulator.fit_effective(dataset, micro_batch_size, callback=callback,
                                     budget=budget, margin=margin)
