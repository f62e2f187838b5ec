"""Gradient accumulation in TF2: your own Keras model and dataset, tf.distribute, Keras fit.

The same update as the TF1 mechanism in `trainer.py`, written the TF2 way:

    with strategy.scope():                       # optional: tf.distribute
        model = make_model()
        optimizer = keras.optimizers.Adam(1e-3)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
    fit_accumulated(model, dataset, optimizer, loss_fn, average_gradients=8)

or, keeping Keras's `compile`/`fit`, `accumulate(model, average_gradients=8)`: an
AccumulatingModel whose `train_step` runs WindowAccumulator's loop (`_sum_window`) over a
window of Keras's batches, with Keras's compiled loss and metrics (below).

Two classes train a window of N micro-batches, to the same weights (bit for bit, as
measured here):
  * `WindowAccumulator`, one compiled call per window (`fit_accumulated`'s default and
    the `--engine=tf2` engine's): the N micro-batches stacked on a new leading axis, a
    loop inside the call computes, under a `tf.GradientTape`, the gradient of the SUM of
    each micro-batch's per-sample losses and adds them up, then the sum divided by the
    window's samples is applied with the optimizer. Two micro-batches are in flight at a
    time, so the activations held are those of two, whatever N. The loop runs the model
    on its weights' values (`stateless_call`) and carries its other state (dropout's seed
    generators) from one micro-batch to the next, so the masks are drawn in the same order
    as below.
  * `GradientAccumulator`, one call per micro-batch, for loops that need Python between
    micro-batches: `accumulate` adds the summed gradient into accumulator variables and
    the samples into a counter; `apply` divides, applies and zeroes.
Dividing summed per-sample gradients by the sample count makes the applied gradient
exactly that of the mean loss over every sample of the window, whatever the sizes of its
micro-batches (a short last slice, a partial window; stacked, the shorter ones are padded
and their sizes passed beside them). A window in which any loss or gradient is NaN or Inf
is discarded whole instead (the replicas vote first): the optimizer does not step, so its
`iterations`, and any LR schedule, stay put.

Under a `tf.distribute` strategy each micro-batch is the GLOBAL one: every replica takes
its slice of it (replica r of K takes samples [n*r//K, n*(r+1)//K)), so the result does not
depend on the replica count. Sums stay on their replica (loop values in the one-call
window; replica-local SyncOnRead variables in the per-micro-batch path): a micro-batch
communicates nothing; once per window a one-number vote (is anything non-finite?) is
summed over the replicas, and the optimizer all-reduces (sums) the replicas' shares of
the mean.
"""

import collections
import logging
import math

import keras
import numpy as np
import tensorflow as tf
# Keras's own data handling, for `accumulate`'s fit (pinned: Keras 3.15).
from keras.src.losses import loss as loss_module
from keras.src.trainers import data_adapters
from keras.src.trainers.data_adapters import array_slicing
from keras.src.trainers.data_adapters import data_adapter as data_adapter_module

import averaging_optimizer

# Ops that communicate between replicas; a test counts them in the compiled steps.
ALL_REDUCE_OPS = ("CollectiveReduce", "CollectiveReduceV2", "CollectiveReduceV3",
                  "CollectiveGather", "CollectiveGatherV2", "NcclAllReduce")
# Micro-batches the one-call window may run at once (the tf1 `fused` strategy's
# FUSED_PARALLEL_ITERATIONS): one's backward pass beside the next one's forward pass, for
# the activations of one more micro-batch; it also bounds the activations held to two
# micro-batches' whatever N. (On 2 cores, 1 and 2 measured alike, within noise.)
WINDOW_PARALLEL_ITERATIONS = 2

FitSummary = collections.namedtuple(
    "FitSummary", ["micro_batches", "updates", "partial_window", "skipped_windows"],
    defaults=(0,))


# ---------------------------------------------------------------- shared by every path


def stack_window(micro_batches):
    """N global micro-batches as one stacked window: (xs, ys, sizes) numpy arrays.

    Args:
      micro_batches: a sequence of (x, y); x and y may be nested structures of arrays.

    Returns:
      (xs, ys, sizes): each array stacked on a new leading axis, [N, B, ...], with B the
      largest micro-batch; shorter micro-batches are padded with zeros, which the window
      step leaves out by `sizes` (int32 [N], each micro-batch's samples).
    """
    if not micro_batches:
        raise ValueError("a window needs at least one micro-batch")
    micro_batches = [tf.nest.map_structure(np.asarray, tuple(batch)) for batch in micro_batches]
    sizes = np.array([len(tf.nest.flatten(batch)[0]) for batch in micro_batches], np.int32)
    width = sizes.max()

    def stack(*arrays):
        out = np.zeros((len(arrays), width) + arrays[0].shape[1:], arrays[0].dtype)
        for row, array in zip(out, arrays):
            row[:len(array)] = array
        return out

    xs, ys = tf.nest.map_structure(stack, *micro_batches)
    return xs, ys, sizes


def _replica_slice(batch):
    """This replica's share of a global micro-batch: samples [n*r//K, n*(r+1)//K).

    Returns:
      (the share, n: the global micro-batch's samples, the share's samples).
    """
    ctx = tf.distribute.get_replica_context()
    first = tf.nest.flatten(batch)[0]
    n = tf.shape(first, out_type=tf.int64)[0]
    r = tf.cast(ctx.replica_id_in_sync_group, tf.int64)
    k = ctx.num_replicas_in_sync
    start, stop = n * r // k, n * (r + 1) // k
    return (tf.nest.map_structure(lambda t: None if t is None else t[start:stop], batch),
            n, stop - start)


def _local_variable(initial_value, aggregation, name):
    """A replica-local variable: updates stay on the replica; a cross-replica read aggregates."""
    return tf.Variable(initial_value, trainable=False, name=name,
                       synchronization=tf.VariableSynchronization.ON_READ,
                       aggregation=aggregation)


def _loss_sum(loss_fn, y, outputs, regularization, n_local):
    """The sum of a micro-batch's per-sample losses, regularization once per sample."""
    losses = loss_fn(y, outputs)
    if losses.shape.rank == 0:
        raise ValueError("loss_fn must return one loss per sample, not their mean "
                         "(use a Keras loss with reduction=None)")
    loss_sum = tf.reduce_sum(tf.cast(losses, tf.float32))
    if regularization:  # regularizers count once per sample, so once per mean
        loss_sum += tf.cast(n_local, tf.float32) * tf.add_n(regularization)
    return loss_sum


def _gradient_tensors(grads):
    """The gradients as tensors, and which variables the loss does not reach (None)."""
    no_gradient = [g is None for g in grads]
    if all(no_gradient):
        raise ValueError("no variable receives a gradient from the loss")
    return [None if g is None else tf.convert_to_tensor(g) for g in grads], no_gradient


def _not_finite(tensors):
    """1.0 where any of `tensors` holds a NaN or Inf, else 0.0: one replica's vote."""
    return 1.0 - tf.cast(averaging_optimizer.all_finite(tensors), tf.float32)


def _sum_window(micro_gradients, variables, state, data, sizes):
    """The one-call window's loop over the micro-batches: sums their gradients.

    At most WINDOW_PARALLEL_ITERATIONS micro-batches are in flight. The body touches no
    variable (a StatelessWhile, so no iteration waits on another's variable reads): the
    model runs on the weights' values, and the gradient sums and the model's other state
    (dropout's seed generators; Keras's metrics under `accumulate`) are loop values, so
    the seeds advance in micro-batch order, as a call per micro-batch draws them.

    Args:
      micro_gradients: (weights, state, batch) -> (loss_sum, n_global, grads, state)
        for one global micro-batch; grads holds None where the loss does not reach.
      variables: the trainable variables.
      state: a nested structure of tensors carried from micro-batch to micro-batch.
      data: a nested structure of [N, B, ...] tensors; micro-batch i is t[i, :sizes[i]].
      sizes: int [N], each micro-batch's samples.

    Returns:
      (sums, state, nonfinite, loss_total, samples_total): one gradient sum per
      variable, the state after the last micro-batch, the count of micro-batches whose
      loss was not finite, and the finite ones' float64 loss sum and samples.
    """
    zero = tf.constant(0.0, tf.float64)
    weights = [tf.convert_to_tensor(v) for v in variables]

    def body(i, state, sums, nonfinite, loss_total, samples_total):
        batch = tf.nest.map_structure(lambda t: t[i, :sizes[i]], data)
        loss_sum, n_global, grads, state = micro_gradients(weights, state, batch)
        sums = [s if g is None else s + g for s, g in zip(sums, grads)]
        finite = tf.math.is_finite(loss_sum)
        nonfinite += 1.0 - tf.cast(finite, tf.float32)
        loss_total += tf.where(finite, tf.cast(loss_sum, tf.float64), zero)
        samples_total += tf.where(finite, tf.cast(n_global, tf.float64), zero)
        return i + 1, state, sums, nonfinite, loss_total, samples_total

    _, state, sums, nonfinite, loss_total, samples_total = tf.while_loop(
        lambda i, *_: i < tf.shape(sizes)[0], body,
        (tf.constant(0), state, [tf.zeros(v.shape, v.dtype) for v in variables],
         tf.constant(0.0), zero, zero),
        parallel_iterations=WINDOW_PARALLEL_ITERATIONS)
    return sums, state, nonfinite, loss_total, samples_total


def _apply_shares(optimizer, variables, shares, no_gradient):
    """Replica function: applies this replica's shares of the mean (the optimizer sums them)."""
    optimizer.apply_gradients(zip(shares, [v for v, none in zip(variables, no_gradient)
                                           if not none]))


def _apply_unless_nonfinite(strategy, optimizer, variables, shares, no_gradient, nonfinite,
                            check_finite, non_empty=True):
    """Cross-replica: applies the replicas' shares of the mean unless a replica voted
    non-finite (check_finite) or the window is empty.

    Returns:
      A bool tensor: whether the window was applied.
    """
    def apply():
        # Run from the cross-replica context, inside the branch: the optimizer's
        # all-reduce must not cross into a branch from a replica function.
        strategy.extended.call_for_each_replica(
            _apply_shares, args=(optimizer, variables, shares, no_gradient))
        return tf.constant(True)

    apply_it = tf.convert_to_tensor(non_empty)
    if check_finite:
        votes = strategy.reduce(tf.distribute.ReduceOp.SUM, nonfinite, axis=None)
        apply_it = tf.logical_and(apply_it, votes == 0)
    return tf.cond(apply_it, apply, lambda: tf.constant(False))


class _Trainer:
    """What both paths share: the model, optimizer and strategy, and their counters.

    Attributes:
      updates: updates applied so far (as the optimizer's `iterations` counts them).
      skipped_windows: windows discarded for a non-finite value (check_finite).
      loss_total, samples_total: replica-local float64 variables, monitoring only (never
        reset): the running sum of finite per-sample losses and their samples.
    """

    def __init__(self, model, optimizer, loss_fn, strategy=None, check_finite=True):
        """Builds the optimizer beside the model's variables.

        Args:
          model: a Keras model; created under `strategy.scope()` if a strategy is used.
          optimizer: a Keras optimizer, created under the same scope.
          loss_fn: (y_true, y_pred) -> per-sample losses, shape [batch] (e.g. a Keras
            loss with reduction=None); the applied gradient is that of their mean.
          strategy: a tf.distribute.Strategy, or None for the default (one device).
          check_finite: discard (not apply) a window holding a NaN or Inf loss or
            gradient; costs one small reduction per window.
        """
        self.model = model
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.strategy = strategy or tf.distribute.get_strategy()
        self.check_finite = check_finite
        self.variables = list(model.trainable_variables)
        if not self.variables:
            raise ValueError("the model has no trainable variables")
        with self.strategy.scope():
            if not optimizer.built:
                optimizer.build(self.variables)
            self._make_variables()
            self.loss_total = _local_variable(tf.constant(0.0, tf.float64),
                                              tf.VariableAggregation.SUM, "loss_total")
            self.samples_total = _local_variable(
                tf.constant(0.0, tf.float64), tf.VariableAggregation.ONLY_FIRST_REPLICA,
                "samples_total")
        self._no_gradient = None  # which variables the loss does not reach (set when traced)
        self.updates = 0
        self.skipped_windows = 0

    def _make_variables(self):
        """Creates the path's own variables, under the strategy's scope."""

    def _counted(self, applied):
        if applied:
            self.updates += 1
        else:
            self.skipped_windows += 1
        return applied

    def loss_totals(self):
        """(sum of per-sample training losses, samples) so far, over all replicas.

        Micro-batches whose loss was not finite are left out of both.
        """
        return float(self.loss_total.read_value()), float(self.samples_total.read_value())


class _FitCounts:
    """A fit's micro-batches and log lines, the same for both paths; its updates and
    discarded windows are the trainer's counts (_Trainer._counted) since the fit began."""

    def __init__(self, trainer, average_gradients):
        self.trainer = trainer
        self.n = averaging_optimizer.check_average_gradients(average_gradients)
        self.micro_batches = self.partial = 0
        self._before = (trainer.updates, trainer.skipped_windows)

    def window(self, applied, size):
        """Logs a discarded window of `size` micro-batches, ended at self.micro_batches."""
        if not applied:
            logging.warning("non-finite loss or gradient in micro-batches %d-%d: the "
                            "window was discarded, not applied",
                            self.micro_batches - size + 1, self.micro_batches)
        return applied

    def summary(self, warn_partial, applied):
        if warn_partial and self.partial and applied:
            logging.warning("%d micro-batches is not a multiple of average_gradients=%d: "
                            "the last %d were applied as one update of their mean",
                            self.micro_batches, self.n, self.partial)
        updates, skipped = self._before
        return FitSummary(self.micro_batches, self.trainer.updates - updates, self.partial,
                          self.trainer.skipped_windows - skipped)


# ---------------------------------------------------------------- one call per window


class WindowAccumulator(_Trainer):
    """Trains a whole window of N micro-batches in one compiled call.

    Attributes:
      window_step: tf.function(xs, ys, sizes) -> bool: trains one stacked window and
        says whether it was applied (compiled on the first window; see apply_stacked).
    """

    def __init__(self, model, optimizer, loss_fn, strategy=None, check_finite=True):
        super().__init__(model, optimizer, loss_fn, strategy, check_finite)
        self.window_step = None  # compiled on the first stacked window

    def _micro_gradients(self, weights, non_trainable, batch):
        """This replica's loss sum and gradients for its slice of one micro-batch, with
        the model's weights and other state passed in and out as values."""
        (x, y), n_global, n_local = _replica_slice(batch)
        with tf.GradientTape() as tape:
            tape.watch(weights)
            outputs, non_trainable, regularization = self.model.stateless_call(
                weights, non_trainable, x, training=True, return_losses=True)
            loss_sum = _loss_sum(self.loss_fn, y, outputs, regularization, n_local)
        grads, self._no_gradient = _gradient_tensors(tape.gradient(loss_sum, weights))
        return loss_sum, n_global, grads, non_trainable

    def _replica_window(self, xs, ys, sizes):
        """One whole window on this replica: micro-batch i is xs[i, :sizes[i]] (global).

        The model's other state is written back once, after the loop.

        Returns:
          (shares, nonfinite): this replica's share of the window's mean gradient, one
          per variable that gets a gradient, and its count of non-finite values.
        """
        state_variables = self.model.non_trainable_variables
        sums, state, nonfinite, loss_total, samples_total = _sum_window(
            self._micro_gradients, self.variables,
            [tf.convert_to_tensor(v) for v in state_variables], (xs, ys), sizes)
        for variable, value in zip(state_variables, state):
            variable.assign(value)
        self.loss_total.assign_add(loss_total)
        self.samples_total.assign_add(samples_total)
        count = tf.cast(tf.reduce_sum(sizes), tf.float32)
        # This replica's share of the mean; the optimizer all-reduces (sums) the shares.
        shares = [total / tf.cast(count, total.dtype)
                  for total, none in zip(sums, self._no_gradient) if not none]
        return shares, nonfinite + _not_finite(shares)  # a sum is finite only if every term was

    def _compile_window_step(self, xs, ys, sizes):
        def spec(t):
            t = tf.convert_to_tensor(t)
            return tf.TensorSpec([None, None] + t.shape[2:].as_list(), t.dtype)

        signature = tf.nest.map_structure(spec, (xs, ys)) + (
            tf.TensorSpec([None], tf.convert_to_tensor(sizes).dtype),)

        @tf.function(input_signature=signature)
        def window_step(xs, ys, sizes):
            shares, nonfinite = self.strategy.run(self._replica_window, args=(xs, ys, sizes))
            # An empty window (N = 0) trains nothing: build_window runs one.
            return _apply_unless_nonfinite(self.strategy, self.optimizer, self.variables,
                                           shares, self._no_gradient, nonfinite,
                                           self.check_finite, tf.size(sizes) > 0)

        return window_step

    def build_window(self, xs, ys, sizes):
        """Compiles the window step for windows stacked like (xs, ys, sizes), untrained.

        `apply_stacked` does this on its first window; call it first to keep the tracing
        and TensorFlow's set-up of the function (about 1.3 s for the post's ConvNet here)
        out of a timed loop: it runs the step once on an empty window, which trains
        nothing. Any N and B then run without retracing. Under a multi-worker strategy
        every worker must call it (the empty window still votes).
        """
        if self.window_step is None:
            self.window_step = self._compile_window_step(xs, ys, sizes)
            self.window_step(*tf.nest.map_structure(lambda t: t[:0], (xs, ys, sizes)))

    def apply_window(self, micro_batches):
        """Trains one whole window, given as its N global micro-batches, in one call.

        The window's micro-batches may differ in size (each weighs by its samples).

        Args:
          micro_batches: a sequence of (x, y) global micro-batches.

        Returns:
          True where the window was applied, False where it was discarded.
        """
        return self.apply_stacked(*stack_window(micro_batches))

    def apply_stacked(self, xs, ys, sizes):
        """Trains one whole window, stacked as `stack_window` returns it, in one call.

        The N micro-batches run in one compiled call (`window_step`): inside it a loop
        sums their gradients, and the sample-weighted mean is applied, or the window is
        discarded whole where a loss or gradient is NaN or Inf (check_finite). At most
        WINDOW_PARALLEL_ITERATIONS micro-batches are in flight, so the activations held
        are those of two micro-batches, not of N.

        Args:
          xs, ys: the micro-batches stacked on a new leading axis, [N, B, ...] and
            [N, B]; micro-batch i is xs[i, :sizes[i]], ys[i, :sizes[i]]. Numpy arrays
            are copied into tensors on each call; tensors (e.g. a tf.gather from the
            training set) are not.
          sizes: int [N], each micro-batch's samples.

        Returns:
          True where the window was applied, False where it was discarded.
        """
        self.build_window(xs, ys, sizes)
        return self._counted(bool(self.window_step(xs, ys, sizes)))

    def fit(self, dataset, average_gradients, callback=None, warn_partial=True):
        """One pass over `dataset`, one compiled call per N micro-batches.

        A trailing partial window is applied as the mean over its samples. A window with
        a non-finite loss or gradient is discarded, with a warning (check_finite).

        Args:
          dataset: an iterable of (x, y) global micro-batches (e.g. a tf.data.Dataset,
            padded and stacked in its own pipeline; anything else is buffered here).
            Under a multi-worker strategy every worker must yield the same batches.
          average_gradients: N, micro-batches per update.
          callback: called as callback(micro_batch) for each micro-batch (1-based),
            after its window's update.
          warn_partial: log a warning when a partial window is applied.

        Returns:
          FitSummary(micro_batches, updates, partial_window, skipped_windows):
          partial_window is the number of micro-batches in the trailing partial window
          (0 if none).
        """
        counts = _FitCounts(self, average_gradients)
        applied = False
        for xs, ys, sizes in _windows(dataset, counts.n):
            size = len(sizes)
            applied = self.apply_stacked(xs, ys, sizes)
            counts.micro_batches += size
            counts.window(applied, size)
            counts.partial = size % counts.n
            if callback is not None:
                for micro_batch in range(counts.micro_batches - size + 1,
                                         counts.micro_batches + 1):
                    callback(micro_batch)
        return counts.summary(warn_partial, applied)


def _windows(dataset, average_gradients):
    """(xs, ys, sizes) windows of `average_gradients` micro-batches, as stack_window's.

    A tf.data.Dataset is padded and stacked in its own pipeline, a window ahead; any
    other iterable is buffered here.
    """
    if isinstance(dataset, tf.data.Dataset):
        for batch, sizes in _stacked_windows(dataset, average_gradients).prefetch(1):
            yield (*batch, sizes)
        return
    window = []
    for batch in dataset:
        window.append(batch)
        if len(window) == average_gradients:
            yield stack_window(window)
            window = []
    if window:
        yield stack_window(window)


def _stacked_windows(dataset, average_gradients):
    """A dataset of micro-batches as one of stacked windows: (batch, sizes), each
    component of the micro-batches' tuple `batch` padded and stacked, [N, B, ...]."""
    def with_size(*batch):
        return batch, tf.shape(tf.nest.flatten(batch)[0])[0]

    return dataset.map(with_size).padded_batch(average_gradients)


# ---------------------------------------------------------------- one call per micro-batch


class GradientAccumulator(_Trainer):
    """Sums micro-batch gradients in variables, one call per micro-batch; applies their
    sample-weighted mean once per window.

    Attributes:
      micro_step: tf.function(x, y): adds one global micro-batch's summed gradients.
      apply_step: tf.function() -> bool: applies sums / samples unless the open window
        holds a NaN or Inf loss or gradient on any replica (the replicas' vote), then
        zeroes the sums either way; says whether it applied.
      sums, samples: the window's replica-local gradient sums and sample count.
      window: micro-batches accumulated since the last update (a Python count).
    """

    def _make_variables(self):
        self.sums = [_local_variable(tf.zeros(v.shape, v.dtype), tf.VariableAggregation.SUM,
                                     f"accumulator_{i}")
                     for i, v in enumerate(self.variables)]
        # Every replica sees the whole global micro-batch, so each counts all samples.
        self.samples = _local_variable(0.0, tf.VariableAggregation.ONLY_FIRST_REPLICA,
                                       "window_samples")
        # Micro-batches of the open window whose loss was not finite, on this replica (the
        # gradient sums are checked when the window closes: a sum is finite only if every
        # term was).
        self.nonfinite = _local_variable(0.0, tf.VariableAggregation.SUM, "window_nonfinite")
        self.micro_step = None  # compiled on the first batch, with its shapes
        self.apply_step = tf.function(self._apply_step)
        self.window = 0

    def _replica_micro(self, x, y):
        """Adds this replica's slice of one global micro-batch to its sums."""
        (x, y), n_global, n_local = _replica_slice((x, y))
        with tf.GradientTape() as tape:
            loss_sum = _loss_sum(self.loss_fn, y, self.model(x, training=True),
                                 self.model.losses, n_local)
        grads, self._no_gradient = _gradient_tensors(tape.gradient(loss_sum, self.variables))
        for total, g in zip(self.sums, grads):
            if g is not None:
                total.assign_add(g)
        self.samples.assign_add(tf.cast(n_global, tf.float32))
        finite = tf.math.is_finite(loss_sum)
        self.nonfinite.assign_add(1.0 - tf.cast(finite, tf.float32))
        # A NaN must not poison the running loss that the logs report.
        self.loss_total.assign_add(tf.where(finite, tf.cast(loss_sum, tf.float64), 0.0))
        self.samples_total.assign_add(
            tf.where(finite, tf.cast(n_global, tf.float64), tf.constant(0.0, tf.float64)))

    def _replica_shares(self):
        """This replica's share of the mean (the optimizer sums them) and its vote."""
        count = self.samples.read_value()
        shares = [total.read_value() / tf.cast(count, total.dtype)
                  for total, none in zip(self.sums, self._no_gradient) if not none]
        return shares, self.nonfinite.read_value() + _not_finite(self.sums)

    def _replica_reset(self):
        for total in self.sums:
            total.assign(tf.zeros_like(total))
        self.samples.assign(0.0)
        self.nonfinite.assign(0.0)

    def _compile_micro_step(self, x, y):
        def spec(t):
            t = tf.convert_to_tensor(t)
            return tf.TensorSpec([None] + t.shape[1:].as_list(), t.dtype)

        signature = tf.nest.map_structure(spec, (x, y))

        @tf.function(input_signature=signature)
        def micro_step(x, y):
            self.strategy.run(self._replica_micro, args=(x, y))

        micro_step.get_concrete_function()  # traces it, so apply_step knows _no_gradient
        return micro_step

    def _apply_step(self):
        shares, nonfinite = self.strategy.run(self._replica_shares)
        applied = _apply_unless_nonfinite(self.strategy, self.optimizer, self.variables,
                                          shares, self._no_gradient, nonfinite,
                                          self.check_finite)
        with tf.control_dependencies([applied]):
            self.strategy.run(self._replica_reset)
        return tf.identity(applied)

    def build(self, x, y):
        """Compiles the micro-step for batches shaped like (x, y), without training."""
        if self.micro_step is None:
            self.micro_step = self._compile_micro_step(x, y)

    def accumulate(self, x, y):
        """Adds one global micro-batch (x, y) to the open window."""
        self.build(x, y)
        self.micro_step(x, y)
        self.window += 1

    def apply(self):
        """Applies the mean gradient of the open window (full or partial).

        With check_finite, a window holding a NaN or Inf loss or gradient is discarded
        instead: nothing is applied, the optimizer does not step, the sums are zeroed.

        Returns:
          True where the window was applied, False where it was discarded.
        """
        if not self.window:
            raise ValueError("no micro-batch accumulated since the last update")
        self.window = 0
        return self._counted(bool(self.apply_step()))

    def fit(self, dataset, average_gradients, callback=None, warn_partial=True):
        """One pass over `dataset`, one call per micro-batch, an update every N.

        As WindowAccumulator.fit; callback(micro_batch) runs after each micro-batch,
        after the update it completed, if any.
        """
        counts = _FitCounts(self, average_gradients)
        for x, y in dataset:
            self.accumulate(x, y)
            counts.micro_batches += 1
            if self.window == counts.n:
                counts.window(self.apply(), counts.n)
            if callback is not None:
                callback(counts.micro_batches)
        counts.partial = self.window
        applied = bool(counts.partial) and counts.window(self.apply(), counts.partial)
        return counts.summary(warn_partial, applied)


def fit_accumulated(model, dataset, optimizer, loss_fn, average_gradients, strategy=None,
                    callback=None, one_call=True):
    """Trains a Keras model on `dataset`, one update per `average_gradients` micro-batches.

    Each update applies the gradient of the mean loss over all samples of its window, as
    one batch of those samples would; see WindowAccumulator.fit for the arguments.

    Args:
      one_call: train each window in one compiled call (WindowAccumulator); False: one
        call per micro-batch (GradientAccumulator).

    Returns:
      FitSummary(micro_batches, updates, partial_window, skipped_windows).
    """
    trainer = WindowAccumulator if one_call else GradientAccumulator
    return trainer(model, optimizer, loss_fn, strategy).fit(dataset, average_gradients,
                                                            callback=callback)


# ---------------------------------------------------------------- Keras compile / fit


def accumulate(model, average_gradients, check_finite=True):
    """`model` for Keras's `compile`/`fit`, training with exact gradient averaging.

        with strategy.scope():                        # optional: tf.distribute
            model = tf2_accumulator.accumulate(make_model(), average_gradients=8)
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy",
                      metrics=["accuracy"])
        model.fit(x, y, batch_size=32, epochs=3, callbacks=[...])   # 8 x 32 per update

    Each update applies the gradient of the mean loss over the window's samples, as one
    batch of N*B would, for any optimizer: a short last batch and the partial window at
    an epoch's end weigh by their samples. See AccumulatingModel.

    Args:
      model: a Keras model (made under the strategy's scope if one is used).
      average_gradients: N, micro-batches (fit's batch_size) per update.
      check_finite: discard (not apply) a window holding a NaN or Inf loss or gradient.

    Returns:
      An AccumulatingModel wrapping `model` (which it shares: its weights are `model`'s).
    """
    return AccumulatingModel(model, average_gradients, check_finite=check_finite)


@keras.saving.register_keras_serializable(package="tf2_accumulator")
class AccumulatingModel(keras.Model):
    """A Keras model whose `fit` applies one update per window of N micro-batches.

    Written as Keras's "customizing what happens in fit()" guide says: `train_step` is
    overridden, and `fit` only regroups the batches Keras makes of its inputs (numpy, a
    tf.data.Dataset...; shuffled as Keras shuffles them) into windows of N, so that one
    `train_step`, one compiled call, trains a whole window: the one-call window's loop
    (`_sum_window`, as WindowAccumulator's) sums the micro-batches' gradients, the
    sample-weighted mean is applied, and Keras's loss tracker and compiled metrics are
    updated per micro-batch inside the loop, as Keras's own train_step updates them.
    Windows never cross an epoch's end: the last, partial one is applied before
    `on_epoch_end`. Everything else is Keras's own: callbacks see one batch per update
    (the progress bar counts updates), `evaluate`, `predict` and validation run the
    wrapped model, `save`/`load_model` round-trip (with this module imported).

    Attributes:
      model: the wrapped Keras model.
      average_gradients: N.
      skipped_windows: windows discarded for a non-finite loss or gradient so far.
    """

    def __init__(self, model, average_gradients, check_finite=True, **kwargs):
        super().__init__(**kwargs)
        self.model = model
        self.average_gradients = averaging_optimizer.check_average_gradients(average_gradients)
        self.check_finite = check_finite
        # Counted once per window (the first replica's count), never saved.
        self._skipped = _local_variable(tf.constant(0, tf.int64),
                                        tf.VariableAggregation.ONLY_FIRST_REPLICA,
                                        "skipped_windows")
        self._no_gradient = None  # which variables the loss does not reach (set when traced)

    def call(self, inputs, training=None):
        return self.model(inputs, training=training)

    @property
    def skipped_windows(self):
        return int(self._skipped.read_value())

    def get_config(self):
        config = super().get_config()
        config.update(model=keras.saving.serialize_keras_object(self.model),
                      average_gradients=self.average_gradients,
                      check_finite=self.check_finite)
        return config

    @classmethod
    def from_config(cls, config, custom_objects=None):
        model = keras.saving.deserialize_keras_object(config.pop("model"),
                                                      custom_objects=custom_objects)
        return cls(model, **config)

    def fit(self, x=None, y=None, batch_size=None, epochs=1, verbose="auto", callbacks=None,
            validation_split=0.0, validation_data=None, shuffle=True, class_weight=None,
            sample_weight=None, initial_epoch=0, steps_per_epoch=None,
            validation_steps=None, validation_batch_size=None, validation_freq=1):
        """Keras's `fit`, one update per N batches of `batch_size` (the micro-batches).

        The arguments are Keras's; `steps_per_epoch` counts micro-batches and must be
        a multiple of N. The returned History has one entry per epoch as usual; callbacks
        receive one batch per update.
        """
        if validation_split and validation_data is None:
            (x, y, sample_weight), validation_data = array_slicing.train_validation_split(
                (x, y, sample_weight), validation_split=validation_split)
        if steps_per_epoch is not None:
            if steps_per_epoch % self.average_gradients:
                raise ValueError(f"steps_per_epoch={steps_per_epoch} counts micro-batches: "
                                 f"it must be a multiple of average_gradients="
                                 f"{self.average_gradients}")
            steps_per_epoch //= self.average_gradients
        windows = self._windows(x, y, sample_weight, batch_size, shuffle, class_weight)
        # Keras would build the metrics from the first element: a window. A micro-batch's.
        self._symbolic_build(data_batch=windows.micro_batches.get_tf_dataset().element_spec)
        return super().fit(windows, epochs=epochs, verbose=verbose, callbacks=callbacks,
                           validation_data=validation_data, initial_epoch=initial_epoch,
                           steps_per_epoch=steps_per_epoch, validation_steps=validation_steps,
                           validation_batch_size=validation_batch_size or batch_size,
                           validation_freq=validation_freq)

    def _windows(self, x, y, sample_weight, batch_size, shuffle, class_weight):
        """The _WindowAdapter of fit's inputs; the last one again for the same tf.data
        dataset (a new pipeline's first iterator costs ~0.3 s here, a pass over it
        again ~10 ms: fit called again and again on one dataset must not pay it each
        time)."""
        replicas = self.distribute_strategy.num_replicas_in_sync
        if data_adapters.is_tf_dataset(x):
            cached = getattr(self, "_last_windows", None)
            if cached is not None and cached[0] is x and cached[1] == class_weight:
                return cached[2]
        micro_batches = data_adapters.get_data_adapter(
            x, y, sample_weight,
            batch_size=batch_size or (None if data_adapters.is_tf_dataset(x) else 32),
            shuffle=shuffle and not data_adapters.is_tf_dataset(x), class_weight=class_weight)
        windows = _WindowAdapter(micro_batches, self.average_gradients, replicas)
        if data_adapters.is_tf_dataset(x):
            self._last_windows = (x, class_weight, windows)
        return windows

    def train_step(self, data):
        """Trains one window (Keras calls it in each replica's context).

        Args:
          data: (batch, sizes) as _WindowAdapter makes it: Keras's micro-batch tuple
            (x, y[, sample_weight]) stacked and padded, [N, B, ...], and int [N] sizes;
            under K > 1 replicas each replica's copy of the window on a leading axis.
        """
        if self.distribute_strategy.num_replicas_in_sync > 1:
            data = tf.nest.map_structure(lambda t: t[0], data)  # every replica: all of it
        batch, sizes = data
        trainable = self.trainable_variables
        non_trainable = self.non_trainable_variables
        metrics = self.metrics_variables
        count = tf.cast(tf.reduce_sum(sizes), tf.float32)

        def micro_gradients(weights, state, micro_batch):
            (x, y, sample_weight), n_global, n_local = _replica_slice(
                keras.utils.unpack_x_y_sample_weight(micro_batch))
            non_trainable_values, metrics_values = state
            with tf.GradientTape() as tape:
                tape.watch(weights)
                # As Keras's JAX trainer: the model, then the loss, on values.
                y_pred, non_trainable_values = self.stateless_call(
                    weights, non_trainable_values, x, training=True)
                loss, (_, non_trainable_values, metrics_values) = self.stateless_compute_loss(
                    weights, non_trainable_values, metrics_values, x=x, y=y, y_pred=y_pred,
                    sample_weight=sample_weight, training=True)
                loss = loss_module.unscale_loss_for_distribution(loss)
                n = tf.cast(n_local, tf.float32)
                # The micro-batch's part of the window's mean loss, scaled (mixed
                # precision) as Keras scales a batch's: the float16 gradients are those
                # of the direct batch, and their sum is the mean's gradient.
                scaled = self.optimizer.scale_loss(loss * (n / count))
            grads, self._no_gradient = _gradient_tensors(tape.gradient(scaled, weights))
            loss_sum = tf.cast(loss, tf.float32) * n
            with keras.StatelessScope(state_mapping=list(zip(metrics, metrics_values))) as scope:
                self._loss_tracker.update_state(loss, sample_weight=n_local)
                self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
            # A non-finite micro-batch (its window is discarded) is left out of the logs.
            finite = tf.math.is_finite(loss_sum)
            metrics_values = [tf.where(finite, scope.get_current_value(v), old)
                              for v, old in zip(metrics, state[1])]
            state = (non_trainable_values, metrics_values)
            return loss_sum, n_global, grads, state

        sums, state, nonfinite, _, _ = _sum_window(
            micro_gradients, trainable,
            ([tf.convert_to_tensor(v) for v in non_trainable],
             [tf.convert_to_tensor(v) for v in metrics]), batch, sizes)
        for variable, value in zip(non_trainable + metrics, state[0] + state[1]):
            variable.assign(value)
        # This replica's share of the mean (its micro-batch parts summed).
        shares = [total for total, none in zip(sums, self._no_gradient) if not none]
        applied = tf.distribute.get_replica_context().merge_call(
            self._apply_window, args=(shares, nonfinite + _not_finite(shares)))
        self._skipped.assign_add(1 - tf.cast(applied, tf.int64))
        return self.get_metrics_result()

    def _apply_window(self, strategy, shares, nonfinite):
        """Cross-replica: applies the window unless non-finite (see check_finite).

        A LossScaleOptimizer is given every window: it skips a non-finite one itself,
        and lowers its scale, which a window discarded before it would never do.
        """
        variables = self.trainable_variables
        scaled = isinstance(self.optimizer, keras.optimizers.LossScaleOptimizer)
        applied = _apply_unless_nonfinite(strategy, self.optimizer, variables, shares,
                                          self._no_gradient, nonfinite,
                                          self.check_finite and not scaled)
        if scaled:
            votes = strategy.reduce(tf.distribute.ReduceOp.SUM, nonfinite, axis=None)
            applied = votes == 0
        return applied


class _WindowAdapter(data_adapter_module.DataAdapter):
    """Keras's data adapter of the micro-batches, regrouped into stacked windows of N.

    Each epoch's windows are its micro-batches in Keras's order, N at a time, the last
    one partial; a window is (batch, sizes) as `_stacked_windows` makes it. Under K > 1
    replicas a window is repeated on a new leading axis K times, so that Keras's
    distribution of the dataset gives every replica the whole window (each takes its
    slice of each micro-batch, as the other paths do).
    """

    def __init__(self, micro_batches, average_gradients, replicas):
        self.micro_batches = micro_batches
        self.n = average_gradients
        self.replicas = replicas
        self._windows = None

    def get_tf_dataset(self):
        if self._windows is None:  # built once: Keras asks at every fit
            windows = _stacked_windows(self.micro_batches.get_tf_dataset(), self.n)
            if self.replicas > 1:
                windows = windows.map(lambda *window: tf.nest.map_structure(
                    lambda t: tf.repeat(t[tf.newaxis], self.replicas, axis=0), window))
            self._windows = windows.prefetch(tf.data.AUTOTUNE)
        return self._windows

    @property
    def num_batches(self):
        micro = self.micro_batches.num_batches
        return None if micro is None else math.ceil(micro / self.n)

    @property
    def batch_size(self):
        return self.replicas if self.replicas > 1 else None

    @property
    def has_partial_batch(self):
        return False

    @property
    def partial_batch_size(self):
        return None

    def on_epoch_begin(self):
        self.micro_batches.on_epoch_begin()

    def on_epoch_end(self):
        self.micro_batches.on_epoch_end()


def count_all_reduces(concrete_function):
    """Number of cross-replica reduction ops in a traced function and its library."""
    graph_def = concrete_function.graph.as_graph_def()
    nodes = list(graph_def.node)
    for function in graph_def.library.function:
        nodes.extend(function.node_def)
    return sum(node.op in ALL_REDUCE_OPS for node in nodes)
