"""Gradient accumulation in a TF2 training loop: your own Keras model, dataset and loss.

The same update as the post's TF1 mechanism (`trainer.py` in the checkout), written the
TF2 way:

    with strategy.scope():                       # optional: tf.distribute
        model = make_model()
        optimizer = keras.optimizers.Adam(1e-3)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
    fit_accumulated(model, dataset, optimizer, loss_fn, average_gradients=8)

Two classes train a window of N mini-batches, to the same weights (bit for bit):
  * `WindowAccumulator`, one compiled call per window (`fit_accumulated`'s default): the
    N mini-batches stacked on a new leading axis, the window loop (window.sum_window)
    computes, under a `tf.GradientTape`, the gradient of the SUM of each mini-batch's
    per-sample losses and adds them up; the sum divided by the window's samples is
    applied with the optimizer. The loop runs the model on its weights' values
    (`stateless_call`) and carries its other state (dropout's seed generators) from one
    mini-batch to the next, so the masks are drawn in the same order as below.
  * `GradientAccumulator`, one call per mini-batch, for loops that need Python between
    mini-batches (or your own `train_step`): `accumulate` adds the summed gradient into
    accumulator variables and the samples into a counter; `apply` divides, applies and
    zeroes.
Dividing summed per-sample gradients by the sample count makes the applied gradient
exactly that of the mean loss over every sample of the window, whatever the sizes of its
mini-batches (a short last one, a partial window; stacked, the shorter ones are padded
and their sizes passed beside them). A window in which any loss or gradient is NaN or
Inf is skipped whole instead (the replicas vote first): the optimizer does not step, so
its `iterations`, and any LR schedule, stay put.

Under a `tf.distribute` strategy each mini-batch is the GLOBAL one: replica r of K
receives only its share of it, samples [n*r//K, n*(r+1)//K), cut on the host, so the
result does not depend on the replica count and nothing a replica receives grows with K.
Sums stay on their replica (loop values in the one-call window; replica-local SyncOnRead
variables in the per-mini-batch path): a mini-batch communicates nothing; once per window
a one-number vote (is anything non-finite?) is summed over the replicas, and the
optimizer all-reduces (sums) the replicas' shares of the mean.
"""

import collections
import contextlib
import logging

import keras
import numpy as np
import tensorflow as tf

from gradient_averaging import window as window_lib

FitSummary = collections.namedtuple(
    "FitSummary", ["mini_batches", "updates", "partial_window", "skipped_windows"],
    defaults=(0,))


# ---------------------------------------------------------------- shared by every path


def stack_window(mini_batches):
    """N global mini-batches of (x, y) as one stacked window: (xs, ys, sizes) arrays.

    Args:
      mini_batches: a sequence of (x, y); x and y may be nested structures of arrays.

    Returns:
      (xs, ys, sizes): each array stacked on a new leading axis, [N, B, ...], with B the
      largest mini-batch; shorter mini-batches are padded with zeros, which the window
      step leaves out by `sizes` (int32 [N], each mini-batch's samples).
    """
    (xs, ys), sizes = window_lib.stack_window([tuple(batch) for batch in mini_batches])
    return xs, ys, sizes


def _replica_share(data, sizes, replica, replicas):
    """Replica `replica`'s share of each stacked mini-batch: samples [n*r//K, n*(r+1)//K).

    Args:
      data: a nested structure of [N, B, ...] tensors.
      sizes: int32 [N], the global mini-batches' samples.
      replica, replicas: r and K.

    Returns:
      (share, local_sizes): each tensor [N, ceil(B/K), ...], the share of mini-batch i
      first in row i and zeros after it; int32 [N], the share's samples.
    """
    sizes = tf.convert_to_tensor(sizes, tf.int32)
    start, stop = sizes * replica // replicas, sizes * (replica + 1) // replicas
    local_sizes = stop - start
    first = tf.nest.flatten(data)[0]
    width = -(-tf.shape(first)[1] // replicas)
    rows = tf.range(width)[tf.newaxis]
    inside = rows < local_sizes[:, tf.newaxis]  # [N, width]
    index = tf.minimum(start[:, tf.newaxis] + rows, tf.maximum(tf.shape(first)[1] - 1, 0))

    def cut(t):
        share = tf.gather(t, index, batch_dims=1)
        mask = tf.reshape(inside, tf.concat([tf.shape(inside), tf.ones(
            [tf.rank(share) - 2], tf.int32)], 0))
        return tf.where(mask, share, tf.zeros_like(share))

    return tf.nest.map_structure(cut, data), local_sizes


def _distribute(strategy, data, sizes):
    """The stacked window as each replica's share, cut on the host (cross-replica
    context): (per-replica data, per-replica local sizes); as given on one replica."""
    replicas = strategy.num_replicas_in_sync
    if replicas == 1:
        return data, sizes
    host = tf.nest.flatten(data)[0].device or "/cpu:0"

    def share(context):
        with tf.device(host):
            cut = _replica_share(data, sizes, context.replica_id_in_sync_group, replicas)
        return tf.nest.map_structure(tf.identity, cut)  # on the replica's device

    return strategy.experimental_distribute_values_from_function(share)


def _local_variable(initial_value, aggregation, name):
    """A replica-local variable: updates stay on the replica; a cross-replica read aggregates."""
    return tf.Variable(initial_value, trainable=False, name=name,
                       synchronization=tf.VariableSynchronization.ON_READ,
                       aggregation=aggregation)


def _loss_sum(loss_fn, y, outputs, regularization, n_local, row_mask=None):
    """The sum of a mini-batch's per-sample losses, regularization once per sample;
    padded rows (row_mask False) left out."""
    losses = loss_fn(y, outputs)
    if losses.shape.rank == 0:
        raise ValueError("loss_fn must return one loss per sample, not their mean "
                         "(use a Keras loss with reduction=None)")
    losses = tf.cast(losses, tf.float32)
    if row_mask is not None:
        losses = tf.where(row_mask, losses, tf.zeros_like(losses))
    loss_sum = tf.reduce_sum(losses)
    if regularization:  # regularizers count once per sample, so once per mean
        loss_sum += tf.cast(n_local, tf.float32) * tf.add_n(regularization)
    return loss_sum


def _activity_losses_weighted(model, scale, row_mask):
    """_keras_src.activity_losses_weighted: Keras's internals only for a model with an
    activity regularizer."""
    if all(layer.activity_regularizer is None
           for layer in model._flatten_layers()):  # noqa: SLF001
        return contextlib.nullcontext()
    from gradient_averaging import _keras_src
    return _keras_src.activity_losses_weighted(model, scale, row_mask)


def _gradient_tensors(grads):
    """The gradients as tensors, and which variables the loss does not reach (None)."""
    no_gradient = [g is None for g in grads]
    if all(no_gradient):
        raise ValueError("no variable receives a gradient from the loss")
    return [None if g is None else tf.convert_to_tensor(g) for g in grads], no_gradient


_MiniBatch = collections.namedtuple(
    "_MiniBatch", ["gradients", "no_gradient", "state", "extra", "moments"])


def _mini_batch_gradients(model, weights, non_trainable, x, objective, statistics=None,
                         row_mask=None):
    """One mini-batch's forward and backward pass, on values: every path's step.

    Args:
      model: the Keras model, run by `stateless_call` in training mode.
      weights, non_trainable: the values of its trainable and other variables.
      x: the mini-batch's inputs (this replica's share).
      objective: (outputs, regularization losses, non_trainable) -> (the scalar to
        differentiate, anything else to return), computed under the tape.
      statistics: the model's _BatchNormStatistics, or None.
      row_mask: bool [B] where x is padded (its rows from the mini-batch's size on
        weigh nothing, batch normalization included); None where every row counts.

    Returns:
      _MiniBatch(gradients: a tensor or None per weight, no_gradient: which are None,
      state: the model's other state after the pass (batch norm's moving statistics
      as they were, where they step once per update), extra: what `objective`
      returned beside its scalar, moments: the batch-norm moments of the pass).
    """
    moments = []
    capture = (statistics.capture(row_mask, moments) if statistics is not None
               else contextlib.nullcontext())
    with tf.GradientTape() as tape:
        tape.watch(weights)
        with capture:
            outputs, after, regularization = model.stateless_call(
                weights, non_trainable, x, training=True, return_losses=True)
        if statistics is not None:
            after = statistics.held(non_trainable, after)
        value, extra = objective(outputs, regularization, after)
    grads, no_gradient = _gradient_tensors(tape.gradient(value, weights))
    return _MiniBatch(grads, no_gradient, after, extra, moments)


def _first_rows(data):
    """The first mini-batch of a stacked window as one batch of B rows (none where the
    window is empty): an input to trace a forward pass on, whatever N."""
    def rows(t):
        tail = t.shape[2:].as_list()
        if None in tail:
            return t[0]
        return tf.reshape(t[:1], [-1] + tail)

    return tf.nest.map_structure(rows, data)


def _not_finite(tensors):
    """1.0 where any of `tensors` holds a NaN or Inf, else 0.0: one replica's vote."""
    return 1.0 - tf.cast(window_lib.all_finite(tensors), tf.float32)


def _apply_shares(optimizer, variables, shares, no_gradient):
    """Replica function: applies this replica's shares of the mean (the optimizer sums them)."""
    optimizer.apply_gradients(zip(shares, [v for v, none in zip(variables, no_gradient)
                                           if not none]))


def _apply_window(strategy, optimizer, variables, shares, no_gradient, nonfinite,
                  check_finite, non_empty=True):
    """Cross-replica: applies the replicas' shares of the mean unless a replica voted
    non-finite (check_finite) or the window is empty.

    A LossScaleOptimizer is given every window: it skips a non-finite one itself, and
    lowers its scale, which a window skipped before it would never do.

    Returns:
      (applied, counts): bool tensors, whether the window was applied, and whether it
      counts for the batch-norm statistics (every non-empty window under a
      LossScaleOptimizer, as the direct batch's statistics move on a skipped step).
    """
    def apply():
        # Run from the cross-replica context, inside the branch: the optimizer's
        # all-reduce must not cross into a branch from a replica function.
        strategy.extended.call_for_each_replica(
            _apply_shares, args=(optimizer, variables, shares, no_gradient))
        return tf.constant(True)

    non_empty = tf.convert_to_tensor(non_empty)
    scaled = isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
    votes = (strategy.reduce(tf.distribute.ReduceOp.SUM, nonfinite, axis=None)
             if check_finite or scaled else None)
    apply_it = non_empty
    if check_finite and not scaled:
        apply_it = tf.logical_and(apply_it, votes == 0)
    applied = tf.cond(apply_it, apply, lambda: tf.constant(False))
    if scaled:
        return tf.logical_and(applied, votes == 0), applied
    return applied, applied


BN_STATISTICS = ("update", "mini_batch")


def _check_bn_statistics(bn_statistics):
    if bn_statistics not in BN_STATISTICS:
        raise ValueError(f"bn_statistics must be one of {', '.join(BN_STATISTICS)}; "
                         f"got {bn_statistics!r}")
    return bn_statistics


class _BatchNormStatistics:
    """A model's BatchNormalization layers under accumulation: their moving statistics.

    With bn_statistics="update" (the default) a layer in training mode takes one
    moving-average step per update, on the mean and (biased) variance of every value the
    window reduced for it, as the direct batch computes them: each mini-batch's moments
    are kept as float64 sums, around the moving mean (count, sum and sum of squares of
    x - moving mean, so no large numbers cancel), added across mini-batches and, under a
    tf.distribute strategy, across replicas (one all-reduce per update), and merged
    once. A layer called twice in a forward pass steps twice, in order. A skipped window
    leaves them as they were. The normalization inside each forward pass stays that of
    the mini-batch (of the replica's share): one pass cannot know the window's.
    "mini_batch" is Keras's own behaviour: a step per mini-batch on its moments.

    Padded rows (an XLA window) enter neither the normalization nor the statistics.
    """

    def __init__(self, model, bn_statistics="update", padded=False):
        self.per_update = _check_bn_statistics(bn_statistics) == "update"
        self.padded = padded
        self.layers = []
        # Only a model with batch norm needs Keras's internals (and their version check).
        if any(v.name in ("moving_mean", "moving_variance")
               for v in model.non_trainable_variables):
            from gradient_averaging import _keras_src
            self._internals = _keras_src
            self.layers = _keras_src.batch_norm_layers(model, self.per_update, padded)
        position = {id(v): i for i, v in enumerate(model.non_trainable_variables)}
        self._moving = {position[id(layer.moving_mean)] for layer in self.layers} | {
            position[id(layer.moving_variance)] for layer in self.layers}
        self._shift_positions = [position[id(layer.moving_mean)] for layer in self.layers]
        self.keys = None  # (layer index, channels) per call, in a forward pass's order
        self._warned = set()

    def __bool__(self):
        return bool(self.layers)

    @property
    def size(self):
        """The flat float64 vector of a window's sums: count, sum, sum of squares per call
        and channel, then per layer the mini-batches that gave it one value a channel."""
        return sum(3 * channels for _, channels in self.keys) + len(self.layers)

    def capture(self, row_mask, moments):
        return self._internals.captured_moments(self.layers, row_mask, moments)

    def held(self, before, after):
        """The model's other state after a pass, the moving statistics as before it."""
        if not self.per_update:
            return after
        return [b if i in self._moving else a for i, (b, a) in enumerate(zip(before, after))]

    def shifts(self, non_trainable):
        """Each layer's moving mean at the window's start, float64: the sums' origin."""
        return [tf.cast(non_trainable[i], tf.float64) for i in self._shift_positions]

    def discover(self, model, weights, non_trainable, x):
        """Learns the calls a forward pass makes (`keys`), from a pass traced on `x` whose
        results are never used."""
        if self.keys is not None or not self.layers:
            return
        moments = []
        with self.capture(None, moments):
            model.stateless_call(weights, non_trainable, x, training=True)
        self.keys = [(index, int(np.prod(mean.shape))) for index, _, mean, _ in moments]

    def zeros(self):
        return tf.zeros([self.size], tf.float64)

    def add(self, total, moments, shifts):
        """`total` plus one pass's moments (as `capture` recorded them)."""
        by_layer = collections.defaultdict(list)
        for index, count, mean, variance in moments:
            by_layer[index].append((count, mean, variance))
        parts, single = [], [0.0] * len(self.layers)
        for index, channels in self.keys:
            count, mean, variance = by_layer[index].pop(0)
            count = tf.reshape(tf.stop_gradient(count), [channels])
            offset = tf.reshape(tf.cast(tf.stop_gradient(mean), tf.float64), [channels]) \
                - tf.reshape(shifts[index], [channels])
            variance = tf.reshape(tf.cast(tf.stop_gradient(variance), tf.float64), [channels])
            parts += [count, count * offset, count * (variance + tf.square(offset))]
            single[index] = tf.maximum(tf.convert_to_tensor(single[index], tf.float64),
                                       tf.cast(tf.reduce_any(tf.equal(count, 1.0)),
                                               tf.float64))
        return total + tf.concat(parts + [tf.cast(tf.stack(single), tf.float64)], 0)

    def end_window(self, total, move):
        """Cross-replica, once per window, from its sums (all replicas'): per update, one
        moving-average step per call where `move` (a bool tensor) says the window counts.

        Returns:
          the window's count, per layer, of mini-batches that gave it one value a channel
          (for warn_single_values).
        """
        if self.per_update:
            self._step(total, move)
        return total[self.size - len(self.layers):]

    def _step(self, total, move):
        shifts = [tf.cast(layer.moving_mean, tf.float64) for layer in self.layers]
        steps, start = [], 0
        for index, channels in self.keys:
            count, s1, s2 = (total[start + k * channels:start + (k + 1) * channels]
                             for k in range(3))
            start += 3 * channels
            safe = tf.maximum(count, 1.0)
            offset = s1 / safe
            mean = tf.reshape(shifts[index], [channels]) + offset
            variance = tf.maximum(s2 / safe - tf.square(offset), 0.0)
            steps.append((index, count > 0, mean, variance))
        finite = window_lib.all_finite([total])

        def assign():
            for index, seen, mean, variance in steps:  # in call order: a step per call
                layer = self.layers[index]
                for variable, value in ((layer.moving_mean, mean),
                                        (layer.moving_variance, variance)):
                    old = tf.cast(variable, tf.float64)
                    shape = tf.shape(old)
                    new = tf.reshape(tf.where(seen, tf.reshape(old, [-1]) * layer.momentum
                                              + value * (1.0 - layer.momentum),
                                              tf.reshape(old, [-1])), shape)
                    variable.assign(tf.cast(new, variable.dtype))
            return tf.constant(True)

        return tf.cond(tf.logical_and(move, finite), assign, lambda: tf.constant(False))

    def warn_single_values(self, counts):
        """One warning per layer that normalized one value a channel (a dead layer)."""
        for layer, count in zip(self.layers, np.asarray(counts)):
            if count > 0 and layer.name not in self._warned:
                self._warned.add(layer.name)
                logging.warning(
                    "BatchNormalization layer %r normalized a single value per channel in "
                    "a mini-batch (or a replica's share of one): its output was its beta, "
                    "whatever the input. Use GroupNormalization or LayerNormalization, a "
                    "larger mini-batch, or freeze the layer (trainable=False).", layer.name)


class _Accumulator:
    """What both accumulators share: the model, optimizer and strategy, their counters.

    Attributes:
      updates: updates applied so far (as the optimizer's `iterations` counts them).
      skipped_windows: windows skipped for a non-finite value (check_finite).
      loss_total, samples_total: replica-local float64 variables, monitoring only (never
        reset): the running sum of finite per-sample losses and their samples.
      statistics: the model's _BatchNormStatistics.
    """

    PADDED = False  # mini-batches reach the loss padded to a shape known when traced

    def __init__(self, model, optimizer, loss_fn, strategy=None, check_finite=True,
                 bn_statistics="update", jit_compile=False):
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
            per update, on the window's statistics (see _BatchNormStatistics);
            "mini_batch": a step per mini-batch, as Keras takes them.
          jit_compile: compile the gradient computation with XLA.
        """
        self.model = model
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.strategy = strategy or tf.distribute.get_strategy()
        self.check_finite = check_finite
        self.jit_compile = bool(jit_compile)
        self.padded = self.PADDED and self.jit_compile
        self.variables = list(model.trainable_variables)
        if not self.variables:
            raise ValueError("the model has no trainable variables")
        self.statistics = _BatchNormStatistics(model, bn_statistics, self.padded)
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

    def _mini_batch(self, weights, non_trainable, x, y, n_local, row_mask=None,
                    samples=None):
        """This replica's loss sum and its gradients for its share of one mini-batch.

        Under a LossScaleOptimizer (mixed precision) the scaled loss is the share's part
        of a mean over `samples` (the window's, where known): its float16 gradients have
        the direct batch's magnitude, as Keras scales a batch's loss; they are made
        gradients of the sum again in float32.

        Returns:
          _MiniBatch, its `extra` the loss sum.
        """
        scaled = isinstance(self.optimizer, keras.optimizers.LossScaleOptimizer)
        mean_over = tf.maximum(tf.cast(n_local if samples is None else samples, tf.float32),
                               1.0)

        def objective(outputs, regularization, unused_state):
            loss_sum = _loss_sum(self.loss_fn, y, outputs, regularization, n_local, row_mask)
            if scaled:  # the LossScaleOptimizer unscales what it applies
                return self.optimizer.scale_loss(loss_sum / mean_over), loss_sum
            return loss_sum, loss_sum

        activity_scale = (None if samples is None
                          else mean_over / tf.maximum(tf.cast(n_local, tf.float32), 1.0))
        with _activity_losses_weighted(self.model, activity_scale, row_mask):
            step = _mini_batch_gradients(self.model, weights, non_trainable, x, objective,
                                         self.statistics or None, row_mask)
        if scaled:
            step = step._replace(gradients=[
                None if g is None else g * tf.cast(mean_over, g.dtype) for g in step.gradients])
        self._no_gradient = step.no_gradient
        return step

    def _counted(self, applied):
        if applied:
            self.updates += 1
        else:
            self.skipped_windows += 1
        return applied

    def loss_totals(self):
        """(sum of per-sample training losses, samples) so far, over all replicas.

        Mini-batches whose loss was not finite are left out of both.
        """
        return float(self.loss_total.read_value()), float(self.samples_total.read_value())


class _FitCounts:
    """A fit's mini-batches and log lines, the same for both accumulators; its updates and
    skipped windows are the accumulator's counts (_Accumulator._counted) since it began."""

    def __init__(self, accumulator, average_gradients):
        self.accumulator = accumulator
        self.average_gradients = window_lib.check_average_gradients(average_gradients)
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
      window_step: tf.function(xs, ys, sizes) -> bool: trains one stacked window and
        says whether it was applied (compiled on the first window; see apply_stacked).
    """

    PADDED = True  # under XLA: a window's loop needs shapes known when traced

    def __init__(self, model, optimizer, loss_fn, strategy=None, check_finite=True,
                 bn_statistics="update", jit_compile=False):
        """As _Accumulator; with jit_compile the window's loop (the gradients of all its
        mini-batches) is one XLA computation, each mini-batch run at the window's padded
        width, its padding masked out of the losses and the batch-norm statistics."""
        super().__init__(model, optimizer, loss_fn, strategy, check_finite, bn_statistics,
                         jit_compile)
        self.window_step = None  # compiled on the first stacked window
        self._window_values = (tf.function(self._sum_window, jit_compile=True)
                               if self.jit_compile else self._sum_window)

    def _sum_window(self, weights, state, data, sizes, global_sizes):
        """The window loop on values (XLA compiles it whole under jit_compile): this
        replica's share of mini-batch i is data[i, :sizes[i]].

        Returns:
          (gradient sums, the model's other state, non-finite mini-batches, the finite
          ones' float64 loss sum and samples, the batch-norm sums).
        """
        zero = tf.constant(0.0, tf.float64)
        statistics = self.statistics
        if statistics:
            statistics.discover(self.model, weights, state, _first_rows(data[0]))
        shifts = statistics.shifts(state) if statistics else []
        window_samples = tf.reduce_sum(global_sizes)

        def mini_batch(i, batch, carried):
            (x, y), n_global = batch
            non_trainable, nonfinite, loss_total, samples_total, moments = carried
            n_local = sizes[i]
            mask = (window_lib.row_mask(n_local, tf.shape(tf.nest.flatten(x)[0])[0])
                    if self.padded else None)
            step = self._mini_batch(weights, non_trainable, x, y, n_local, mask,
                                    samples=window_samples)
            finite = tf.math.is_finite(step.extra)
            nonfinite += 1.0 - tf.cast(finite, tf.float32)
            loss_total += tf.where(finite, tf.cast(step.extra, tf.float64), zero)
            samples_total += tf.where(finite, tf.cast(n_global, tf.float64), zero)
            if statistics:
                moments = statistics.add(moments, step.moments, shifts)
            return step.gradients, (step.state, nonfinite, loss_total, samples_total, moments)

        sums, carried = window_lib.sum_window(
            mini_batch, [tf.zeros(v.shape, v.dtype) for v in self.variables],
            (state, tf.constant(0.0), zero, zero,
             statistics.zeros() if statistics else tf.zeros([0], tf.float64)),
            (data, window_lib.Unbatched(global_sizes)), sizes, padded=self.padded)
        return (sums, *carried)

    def _replica_window(self, data, sizes, global_sizes):
        """One whole window on this replica; the model's other state is written back once,
        after the loop.

        Returns:
          (shares, nonfinite, statistics): this replica's share of the window's mean
          gradient, one per variable that gets a gradient, its count of non-finite
          values, and its batch-norm sums.
        """
        state_variables = self.model.non_trainable_variables
        sums, state, nonfinite, loss_total, samples_total, statistics = self._window_values(
            [tf.convert_to_tensor(v) for v in self.variables],
            [tf.convert_to_tensor(v) for v in state_variables], data, sizes, global_sizes)
        for variable, value in zip(state_variables, state):
            variable.assign(value)
        self.loss_total.assign_add(loss_total)
        self.samples_total.assign_add(samples_total)
        count = tf.cast(tf.reduce_sum(global_sizes), tf.float32)
        # This replica's share of the mean; the optimizer all-reduces (sums) the shares.
        shares = [total / tf.cast(count, total.dtype)
                  for total, none in zip(sums, self._no_gradient) if not none]
        # A sum is finite only if every term was.
        return shares, nonfinite + _not_finite(shares), statistics

    def _compile_window_step(self, xs, ys, sizes):
        def spec(t):
            t = tf.convert_to_tensor(t)
            return tf.TensorSpec([None, None] + t.shape[2:].as_list(), t.dtype)

        signature = tf.nest.map_structure(spec, (xs, ys)) + (
            tf.TensorSpec([None], tf.convert_to_tensor(sizes).dtype),)

        @tf.function(input_signature=signature)
        def window_step(xs, ys, sizes):
            sizes = tf.cast(sizes, tf.int32)
            data, local_sizes = _distribute(self.strategy, (xs, ys), sizes)
            shares, nonfinite, statistics = self.strategy.run(
                self._replica_window, args=(data, local_sizes, sizes))
            # An empty window (N = 0) trains nothing: build_window runs one.
            applied, counts = _apply_window(self.strategy, self.optimizer, self.variables,
                                            shares, self._no_gradient, nonfinite,
                                            self.check_finite, tf.size(sizes) > 0)
            single = tf.zeros([0], tf.float64)
            if self.statistics:
                single = self.statistics.end_window(self.strategy.reduce(
                    tf.distribute.ReduceOp.SUM, statistics, axis=None), counts)
            return applied, single

        return window_step

    def build_window(self, xs, ys, sizes):
        """Compiles the window step for windows stacked like (xs, ys, sizes), untrained.

        `apply_stacked` does this on its first window; call it first to keep the tracing
        and TensorFlow's set-up of the function out of a timed loop: it runs the step once
        on an empty window, which trains nothing. Any N and B then run without retracing.
        Under a multi-worker strategy every worker must call it (the empty window still
        votes). Under jit_compile it only traces: XLA compiles for each shape the window
        step meets (an empty window's loop does not compile), on the first of each.
        """
        if self.window_step is None:
            self.window_step = self._compile_window_step(xs, ys, sizes)
            if self.jit_compile:
                self.window_step.get_concrete_function()
            else:
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

        The N mini-batches run in one compiled call (`window_step`): inside it the window
        loop sums their gradients, and the sample-weighted mean is applied, or the window
        is skipped whole where a loss or gradient is NaN or Inf (check_finite). The
        activations of at most two mini-batches are held at a time, whatever N.

        Args:
          xs, ys: the mini-batches stacked on a new leading axis, [N, B, ...] and
            [N, B]; mini-batch i is xs[i, :sizes[i]], ys[i, :sizes[i]]. Numpy arrays
            are copied into tensors on each call; tensors (e.g. a tf.gather from the
            training set) are not.
          sizes: int [N], each mini-batch's samples.

        Returns:
          True where the window was applied, False where it was skipped.
        """
        self.build_window(xs, ys, sizes)
        applied, single = self.window_step(xs, ys, sizes)
        if self.statistics:
            self.statistics.warn_single_values(single)
        return self._counted(bool(applied))

    def fit(self, dataset, average_gradients, callback=None, warn_partial=True):
        """One pass over `dataset`, one compiled call per N mini-batches.

        A trailing partial window is applied as the mean over its samples. A window with
        a non-finite loss or gradient is skipped, with a warning (check_finite).

        Args:
          dataset: an iterable of (x, y) global mini-batches (e.g. a tf.data.Dataset,
            padded and stacked in its own pipeline; anything else is buffered here).
            Under a multi-worker strategy every worker must yield the same batches.
          average_gradients: N, mini-batches per update.
          callback: called as callback(mini_batch) for each mini-batch (1-based),
            after its window's update.
          warn_partial: log a warning when a partial window is applied.

        Returns:
          FitSummary(mini_batches, updates, partial_window, skipped_windows):
          partial_window is the number of mini-batches in the trailing partial window
          (0 if none).
        """
        counts = _FitCounts(self, average_gradients)
        applied = False
        for xs, ys, sizes in _windows(dataset, counts.average_gradients):
            size = len(sizes)
            applied = self.apply_stacked(xs, ys, sizes)
            counts.mini_batches += size
            counts.window(applied, size)
            counts.partial = size % counts.average_gradients
            if callback is not None:
                for mini_batch in range(counts.mini_batches - size + 1,
                                        counts.mini_batches + 1):
                    callback(mini_batch)
        return counts.summary(warn_partial, applied)


def _windows(dataset, average_gradients):
    """(xs, ys, sizes) windows of `average_gradients` mini-batches, as stack_window's.

    A tf.data.Dataset is padded and stacked in its own pipeline, a window ahead; any
    other iterable is buffered here.
    """
    if isinstance(dataset, tf.data.Dataset):
        for batch, sizes in window_lib.stacked_windows(dataset, average_gradients).prefetch(1):
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


# ---------------------------------------------------------------- one call per mini-batch


class GradientAccumulator(_Accumulator):
    """Sums mini-batch gradients in variables, one call per mini-batch; applies their
    sample-weighted mean once per window.

    Attributes:
      mini_batch_step: tf.function(x, y): adds one global mini-batch's summed gradients.
      apply_step: tf.function() -> bool: applies sums / samples unless the open window
        holds a NaN or Inf loss or gradient on any replica (the replicas' vote), then
        zeroes the sums either way; says whether it applied.
      sums, samples: the window's replica-local gradient sums and sample count.
      window: mini-batches accumulated since the last update (a Python count).
    """

    def _make_variables(self):
        self.sums = [_local_variable(tf.zeros(v.shape, v.dtype), tf.VariableAggregation.SUM,
                                     f"accumulator_{i}")
                     for i, v in enumerate(self.variables)]
        # Every replica counts the whole global mini-batch's samples.
        self.samples = _local_variable(0.0, tf.VariableAggregation.ONLY_FIRST_REPLICA,
                                       "window_samples")
        # Mini-batches of the open window whose loss was not finite, on this replica (the
        # gradient sums are checked when the window closes: a sum is finite only if every
        # term was).
        self.nonfinite = _local_variable(0.0, tf.VariableAggregation.SUM, "window_nonfinite")
        self.statistics_sums = None  # the window's batch-norm sums, made with the step
        self.mini_batch_step = None  # compiled on the first batch, with its shapes
        self.apply_step = tf.function(self._apply_step)
        self._gradient_values = (tf.function(self._gradients, jit_compile=True)
                                 if self.jit_compile else self._gradients)
        self.window = 0

    def _gradients(self, weights, state, x, y, n_local):
        """One mini-batch's gradients on values (XLA compiles it under jit_compile):
        (gradients, the model's other state, the loss sum, the batch-norm sums)."""
        step = self._mini_batch(weights, state, x, y, n_local)
        statistics = self.statistics
        moments = (statistics.add(statistics.zeros(), step.moments, statistics.shifts(state))
                   if statistics else tf.zeros([0], tf.float64))
        return step.gradients, step.state, step.extra, moments

    def _replica_mini_batch(self, data, local_size, n_global):
        """Adds this replica's share of one global mini-batch to its sums."""
        x, y = tf.nest.map_structure(lambda t: t[0, :local_size[0]], data)
        state_variables = self.model.non_trainable_variables
        grads, state, loss_sum, moments = self._gradient_values(
            [tf.convert_to_tensor(v) for v in self.variables],
            [tf.convert_to_tensor(v) for v in state_variables], x, y, local_size[0])
        for variable, value in zip(state_variables, state):
            variable.assign(value)
        for total, g in zip(self.sums, grads):
            if g is not None:
                total.assign_add(g)
        if self.statistics:
            self.statistics_sums.assign_add(moments)
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
        if self.statistics:
            self.statistics_sums.assign(tf.zeros_like(self.statistics_sums))

    def _compile_mini_batch_step(self, x, y):
        def spec(t):
            t = tf.convert_to_tensor(t)
            return tf.TensorSpec([None] + t.shape[1:].as_list(), t.dtype)

        signature = tf.nest.map_structure(spec, (x, y))

        if self.statistics:  # the calls a forward pass makes, then a sum for each
            @tf.function(input_signature=signature[:1])
            def discover(x):
                self.statistics.discover(self.model, [tf.convert_to_tensor(v)
                                                      for v in self.variables],
                                         [tf.convert_to_tensor(v)
                                          for v in self.model.non_trainable_variables], x)

            with self.strategy.scope():
                discover.get_concrete_function()
                self.statistics_sums = _local_variable(
                    self.statistics.zeros(), tf.VariableAggregation.SUM, "statistics_sums")

        @tf.function(input_signature=signature)
        def mini_batch_step(x, y):
            # A window of one mini-batch, so that each replica receives only its share.
            n_global = tf.shape(tf.nest.flatten(x)[0])[0]
            data, local_size = _distribute(
                self.strategy, tf.nest.map_structure(lambda t: t[tf.newaxis], (x, y)),
                n_global[tf.newaxis])
            self.strategy.run(self._replica_mini_batch, args=(data, local_size, n_global))

        mini_batch_step.get_concrete_function()  # traced now: apply_step needs _no_gradient
        return mini_batch_step

    def _apply_step(self):
        shares, nonfinite = self.strategy.run(self._replica_shares)
        applied, counts = _apply_window(self.strategy, self.optimizer, self.variables,
                                        shares, self._no_gradient, nonfinite,
                                        self.check_finite)
        single = tf.zeros([0], tf.float64)
        if self.statistics:  # a SUM replica-local variable, read across replicas: summed
            single = self.statistics.end_window(self.statistics_sums.read_value(), counts)
        with tf.control_dependencies([applied, single]):
            self.strategy.run(self._replica_reset)
        return tf.identity(applied), tf.identity(single)

    def build(self, x, y):
        """Compiles the mini-batch step for batches shaped like (x, y), without training."""
        if self.mini_batch_step is None:
            self.mini_batch_step = self._compile_mini_batch_step(x, y)

    def accumulate(self, x, y):
        """Adds one global mini-batch (x, y) to the open window."""
        self.build(x, y)
        self.mini_batch_step(x, y)
        self.window += 1

    def apply(self):
        """Applies the mean gradient of the open window (full or partial).

        With check_finite, a window holding a NaN or Inf loss or gradient is skipped
        instead: nothing is applied, the optimizer does not step, the sums are zeroed.

        Returns:
          True where the window was applied, False where it was skipped.
        """
        if not self.window:
            raise ValueError("no mini-batch accumulated since the last update")
        self.window = 0
        applied, single = self.apply_step()
        if self.statistics:
            self.statistics.warn_single_values(single)
        return self._counted(bool(applied))

    def fit(self, dataset, average_gradients, callback=None, warn_partial=True):
        """One pass over `dataset`, one call per mini-batch, an update every N.

        As WindowAccumulator.fit; callback(mini_batch) runs after each mini-batch,
        after the update it completed, if any.
        """
        counts = _FitCounts(self, average_gradients)
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


def fit_accumulated(model, dataset, optimizer, loss_fn, average_gradients, strategy=None,
                    callback=None, one_call=True, check_finite=True, bn_statistics="update",
                    jit_compile=False):
    """Trains a Keras model on `dataset`, one update per `average_gradients` mini-batches.

    Each update applies the gradient of the mean loss over all samples of its window, as
    one batch of those samples would; see WindowAccumulator.fit and _Accumulator for the
    arguments.

    Args:
      one_call: train each window in one compiled call (WindowAccumulator); False: one
        call per mini-batch (GradientAccumulator).

    Returns:
      FitSummary(mini_batches, updates, partial_window, skipped_windows).
    """
    accumulator = WindowAccumulator if one_call else GradientAccumulator
    return accumulator(model, optimizer, loss_fn, strategy, check_finite, bn_statistics,
                       jit_compile).fit(dataset, average_gradients, callback=callback)
