"""Gradient accumulation in TF2: a GradientTape loop for your own Keras model, tf.distribute.

The same update as the TF1 mechanism in `trainer.py`, written the TF2 way, for your own
Keras model and dataset:

    with strategy.scope():                       # optional: tf.distribute
        model = make_model()
        optimizer = keras.optimizers.Adam(1e-3)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
    fit_accumulated(model, dataset, optimizer, loss_fn, average_gradients=8)

`GradientAccumulator` trains a window of N micro-batches one of two ways, to the same
weights (bit for bit, as measured here):
  * one compiled call per window (`apply_window`, `apply_stacked`; `fit`'s default): the
    N micro-batches stacked on a new leading axis, a loop inside the call computes, under
    a `tf.GradientTape`, the gradient of the SUM of each micro-batch's per-sample losses
    and adds them up, then the sum divided by the window's samples is applied with the
    optimizer. Two micro-batches are in flight at a time, so the activations held are
    those of two, whatever N. The loop runs the model on its weights' values
    (`stateless_call`) and carries its other state (dropout's seed generators) from one
    micro-batch to the next, so the masks are drawn in the same order as below.
  * one call per micro-batch, for loops that need Python between micro-batches: the
    micro-step (`accumulate`) adds the summed gradient into accumulator variables and
    the samples into a counter; the apply-step (`apply`) divides, applies and zeroes.
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

The `--engine=tf2` side of `main.py` (engine_tf2.py) trains the post's ConvNet with it,
one `apply_stacked` call per window.
"""

import collections
import logging

import numpy as np
import tensorflow as tf

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


# ---------------------------------------------------------------- the accumulator


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
    """This replica's share of a global micro-batch: samples [n*r//K, n*(r+1)//K)."""
    ctx = tf.distribute.get_replica_context()
    first = tf.nest.flatten(batch)[0]
    n = tf.shape(first, out_type=tf.int64)[0]
    r = tf.cast(ctx.replica_id_in_sync_group, tf.int64)
    k = ctx.num_replicas_in_sync
    start, stop = n * r // k, n * (r + 1) // k
    return tf.nest.map_structure(lambda t: t[start:stop], batch), n, stop - start


def _local_variable(initial_value, aggregation, name):
    """A replica-local variable: updates stay on the replica; a cross-replica read aggregates."""
    return tf.Variable(initial_value, trainable=False, name=name,
                       synchronization=tf.VariableSynchronization.ON_READ,
                       aggregation=aggregation)


class GradientAccumulator:
    """Sums micro-batch gradients; applies their sample-weighted mean once per window.

    Attributes:
      window_step: tf.function(xs, ys, sizes) -> bool: trains one stacked window and
        says whether it was applied (compiled on the first window; see apply_stacked).
      micro_step: tf.function(x, y): adds one global micro-batch's summed gradients.
      apply_step: tf.function(): applies accumulators / samples, then zeroes them.
      check_step: tf.function() -> bool: whether the open window holds a NaN or Inf loss
        or gradient on any replica (the replicas' vote, summed).
      discard_step: tf.function(): zeroes the accumulators without applying them.
      window: micro-batches accumulated since the last update (a Python count).
      updates: updates applied so far.
      skipped_windows: windows discarded for a non-finite value (check_finite).
    """

    def __init__(self, model, optimizer, loss_fn, strategy=None, check_finite=True):
        """Creates the accumulators beside the model's variables.

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
            self.sums = [_local_variable(tf.zeros(v.shape, v.dtype), tf.VariableAggregation.SUM,
                                         f"accumulator_{i}")
                         for i, v in enumerate(self.variables)]
            # Every replica sees the whole global micro-batch, so each counts all samples.
            self.samples = _local_variable(0.0, tf.VariableAggregation.ONLY_FIRST_REPLICA,
                                           "window_samples")
            # Micro-batches of the open window whose loss was not finite, on this replica
            # (the gradient sums are checked when the window closes: a sum is finite only
            # if every term was).
            self.nonfinite = _local_variable(0.0, tf.VariableAggregation.SUM,
                                             "window_nonfinite")
            # Monitoring only (never reset): the running loss sum and samples trained.
            self.loss_total = _local_variable(tf.constant(0.0, tf.float64),
                                              tf.VariableAggregation.SUM, "loss_total")
            self.samples_total = _local_variable(
                tf.constant(0.0, tf.float64), tf.VariableAggregation.ONLY_FIRST_REPLICA,
                "samples_total")
        self._no_gradient = None  # which variables the loss does not reach (set when traced)
        self.micro_step = None  # compiled on the first batch, with its shapes
        self.window_step = None  # compiled on the first stacked window
        self.apply_step = tf.function(self._apply_step)
        self.check_step = tf.function(self._check_step)
        self.discard_step = tf.function(self._discard_step)
        self.window = 0
        self.updates = 0  # apply() calls, as the optimizer's `iterations` counts them
        self.skipped_windows = 0

    @property
    def state_variables(self):
        """The accumulator's variables, each replica's copy apart: what a checkpoint of
        the open window must hold (a replica-local variable saved whole would be its
        cross-replica aggregate, and restored split evenly, not as it was)."""
        return [local for v in self.sums + [self.samples, self.nonfinite, self.loss_total,
                                            self.samples_total]
                for local in self.strategy.experimental_local_results(v)]

    # The replica functions.
    def _loss_sum(self, y, outputs, regularization, n_local):
        losses = self.loss_fn(y, outputs)
        if losses.shape.rank == 0:
            raise ValueError("loss_fn must return one loss per sample, not their mean "
                             "(use a Keras loss with reduction=None)")
        loss_sum = tf.reduce_sum(tf.cast(losses, tf.float32))
        if regularization:  # regularizers count once per sample, so once per mean
            loss_sum += tf.cast(n_local, tf.float32) * tf.add_n(regularization)
        return loss_sum

    def _checked(self, grads):
        """The gradients as tensors (None where the loss does not reach the variable)."""
        self._no_gradient = [g is None for g in grads]
        if all(self._no_gradient):
            raise ValueError("no variable receives a gradient from the loss")
        return [None if g is None else tf.convert_to_tensor(g) for g in grads]

    def _micro_gradients(self, x, y):
        """This replica's loss sum and its gradients for its slice of one micro-batch.

        Returns:
          (loss_sum, n_global, grads).
        """
        (x, y), n_global, n_local = _replica_slice((x, y))
        with tf.GradientTape() as tape:
            loss_sum = self._loss_sum(y, self.model(x, training=True), self.model.losses,
                                      n_local)
        return loss_sum, n_global, self._checked(tape.gradient(loss_sum, self.variables))

    def _stateless_gradients(self, trainable, non_trainable, x, y):
        """As _micro_gradients, with the model's state passed in and out as values.

        Args:
          trainable, non_trainable: the values of the model's trainable and
            non-trainable variables (the latter include dropout's seed states).

        Returns:
          (loss_sum, n_global, grads, non_trainable after the call).
        """
        (x, y), n_global, n_local = _replica_slice((x, y))
        with tf.GradientTape() as tape:
            tape.watch(trainable)
            outputs, non_trainable, regularization = self.model.stateless_call(
                trainable, non_trainable, x, training=True, return_losses=True)
            loss_sum = self._loss_sum(y, outputs, regularization, n_local)
        grads = self._checked(tape.gradient(loss_sum, trainable))
        return loss_sum, n_global, grads, non_trainable

    def _replica_micro(self, x, y):
        loss_sum, n_global, grads = self._micro_gradients(x, y)
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

    def _replica_nonfinite(self):
        bad = self.nonfinite.read_value()
        for total in self.sums:
            bad += 1.0 - tf.cast(tf.reduce_all(tf.math.is_finite(total)), tf.float32)
        return bad

    def _replica_reset(self):
        for total in self.sums:
            total.assign(tf.zeros_like(total))
        self.samples.assign(0.0)
        self.nonfinite.assign(0.0)

    def _replica_window(self, xs, ys, sizes):
        """One whole window on this replica: micro-batch i is xs[i, :sizes[i]] (global).

        A loop over the micro-batches, at most WINDOW_PARALLEL_ITERATIONS in flight. Its
        body touches no variable (a StatelessWhile, so no iteration waits on another's
        variable reads): the model runs on the weights' values (stateless_call), and the
        gradient sums and the model's other state (dropout's seed generators) are loop
        values, so the seeds advance in micro-batch order, as `accumulate` draws them.
        The state is written back once, after the loop.

        Returns:
          (shares, nonfinite): this replica's share of the window's mean gradient, one
          per variable that gets a gradient, and its count of non-finite values.
        """
        zero = tf.constant(0.0, tf.float64)
        trainable = [tf.convert_to_tensor(v) for v in self.variables]
        state_variables = self.model.non_trainable_variables

        def body(i, state, sums, nonfinite, loss_total, samples_total):
            batch = tf.nest.map_structure(lambda t: t[i, :sizes[i]], (xs, ys))
            loss_sum, n_global, grads, state = self._stateless_gradients(trainable, state,
                                                                         *batch)
            sums = [s if g is None else s + g for s, g in zip(sums, grads)]
            finite = tf.math.is_finite(loss_sum)
            nonfinite += 1.0 - tf.cast(finite, tf.float32)
            loss_total += tf.where(finite, tf.cast(loss_sum, tf.float64), zero)
            samples_total += tf.where(finite, tf.cast(n_global, tf.float64), zero)
            return i + 1, state, sums, nonfinite, loss_total, samples_total

        _, state, sums, nonfinite, loss_total, samples_total = tf.while_loop(
            lambda i, *_: i < tf.shape(sizes)[0], body,
            (tf.constant(0), [tf.convert_to_tensor(v) for v in state_variables],
             [tf.zeros(v.shape, v.dtype) for v in self.variables], tf.constant(0.0), zero,
             zero),
            parallel_iterations=WINDOW_PARALLEL_ITERATIONS)
        for variable, value in zip(state_variables, state):
            variable.assign(value)
        self.loss_total.assign_add(loss_total)
        self.samples_total.assign_add(samples_total)
        count = tf.cast(tf.reduce_sum(sizes), tf.float32)
        # This replica's share of the mean, as the apply-step's.
        shares = [total / tf.cast(count, total.dtype)
                  for total, none in zip(sums, self._no_gradient) if not none]
        for total in shares:  # a sum is finite only if every gradient in it was
            nonfinite += 1.0 - tf.cast(tf.reduce_all(tf.math.is_finite(total)), tf.float32)
        return shares, nonfinite

    def _replica_apply_shares(self, shares):
        """Applies the mean gradient from each replica's share (the optimizer sums them)."""
        applied = [v for v, none in zip(self.variables, self._no_gradient) if not none]
        self.optimizer.apply_gradients(zip(shares, applied))

    def _replica_apply(self):
        count = self.samples.read_value()
        # This replica's share of the mean; the optimizer all-reduces (sums) the shares.
        grads = [None if none else total.read_value() / tf.cast(count, total.dtype)
                 for total, none in zip(self.sums, self._no_gradient)]
        self.optimizer.apply_gradients(
            [(g, v) for g, v in zip(grads, self.variables) if g is not None])
        self._replica_reset()

    # The compiled steps.
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

    def _compile_window_step(self, xs, ys, sizes):
        def spec(t):
            t = tf.convert_to_tensor(t)
            return tf.TensorSpec([None, None] + t.shape[2:].as_list(), t.dtype)

        signature = tf.nest.map_structure(spec, (xs, ys)) + (
            tf.TensorSpec([None], tf.convert_to_tensor(sizes).dtype),)

        @tf.function(input_signature=signature)
        def window_step(xs, ys, sizes):
            shares, nonfinite = self.strategy.run(self._replica_window, args=(xs, ys, sizes))

            def apply():
                # Run from the cross-replica context, inside the branch: the optimizer's
                # all-reduce must not cross into a branch from a replica function.
                self.strategy.run(self._replica_apply_shares, args=(shares,))
                return tf.constant(True)

            # An empty window (N = 0) trains nothing: build_window runs one.
            apply_it = tf.size(sizes) > 0
            if self.check_finite:
                votes = self.strategy.reduce(tf.distribute.ReduceOp.SUM, nonfinite, axis=None)
                apply_it = tf.logical_and(apply_it, votes == 0)
            return tf.cond(apply_it, apply, lambda: tf.constant(False))

        return window_step

    def _apply_step(self):
        self.strategy.run(self._replica_apply)

    def _check_step(self):
        votes = self.strategy.run(self._replica_nonfinite)
        return self.strategy.reduce(tf.distribute.ReduceOp.SUM, votes, axis=None) > 0

    def _discard_step(self):
        self.strategy.run(self._replica_reset)

    def build(self, x, y):
        """Compiles the micro-step for batches shaped like (x, y), without training.

        `accumulate` does this on its first batch; call it first where an open window is
        restored from a checkpoint and may be applied before any new micro-batch.
        """
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
        instead: nothing is applied, the optimizer does not step, the accumulators are
        zeroed.

        Returns:
          True where the window was applied, False where it was discarded.
        """
        if not self.window:
            raise ValueError("no micro-batch accumulated since the last update")
        if self.micro_step is None:
            raise ValueError("an open window restored from a checkpoint needs build(x, y) "
                             "before it is applied")
        applied = not (self.check_finite and bool(self.check_step()))
        if applied:
            self.apply_step()
            self.updates += 1
        else:
            self.discard_step()
            self.skipped_windows += 1
        self.window = 0
        return applied

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

        Equal to `accumulate` on each micro-batch then `apply`, to rounding; the window's
        micro-batches may differ in size (each weighs by its samples).

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

        Raises:
          ValueError: a window opened by `accumulate` is still open.
        """
        if self.window:
            raise ValueError("apply() the window opened by accumulate() first")
        self.build_window(xs, ys, sizes)
        applied = bool(self.window_step(xs, ys, sizes))
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

    def fit(self, dataset, average_gradients, callback=None, warn_partial=True,
            one_call=True):
        """One pass over `dataset`, applying the mean gradient every N micro-batches.

        A trailing partial window is applied as the mean over its samples. A window with
        a non-finite loss or gradient is discarded, with a warning (check_finite).

        Args:
          dataset: an iterable of (x, y) global micro-batches (e.g. a tf.data.Dataset).
            Under a multi-worker strategy every worker must yield the same batches.
          average_gradients: N, micro-batches per update.
          callback: called as callback(micro_batch) after each micro-batch (1-based),
            after the update it completed, if any; with one_call, after its window's.
          warn_partial: log a warning when a partial window is applied.
          one_call: train each window in one compiled call (`apply_stacked`), N
            micro-batches stacked (a tf.data.Dataset in its own pipeline, anything else
            buffered here); False: one call per micro-batch (`accumulate`, `apply`).

        Returns:
          FitSummary(micro_batches, updates, partial_window, skipped_windows):
          partial_window is the number of micro-batches in the trailing partial window
          (0 if none).
        """
        if average_gradients < 1:
            raise ValueError(f"average_gradients must be >= 1, got {average_gradients}")
        micro_batches = updates = skipped = partial = 0

        def count(applied, size):
            nonlocal updates, skipped
            if applied:
                updates += 1
            else:
                skipped += 1
                logging.warning("non-finite loss or gradient in micro-batches %d-%d: the "
                                "window was discarded, not applied",
                                micro_batches - size + 1, micro_batches)
            return applied

        if one_call:
            for xs, ys, sizes in _windows(dataset, average_gradients):
                size = len(sizes)
                applied = self.apply_stacked(xs, ys, sizes)
                micro_batches += size
                count(applied, size)
                partial = size % average_gradients
                if callback is not None:
                    for micro_batch in range(micro_batches - size + 1, micro_batches + 1):
                        callback(micro_batch)
        else:
            for x, y in dataset:
                self.accumulate(x, y)
                micro_batches += 1
                if self.window == average_gradients:
                    count(self.apply(), average_gradients)
                if callback is not None:
                    callback(micro_batches)
            partial = self.window
            applied = partial and count(self.apply(), partial)
        if warn_partial and partial and applied:
            logging.warning("%d micro-batches is not a multiple of average_gradients=%d: "
                            "the last %d were applied as one update of their mean",
                            micro_batches, average_gradients, partial)
        return FitSummary(micro_batches, updates, partial, skipped)


def _windows(dataset, average_gradients):
    """(xs, ys, sizes) windows of `average_gradients` micro-batches, as stack_window's.

    A tf.data.Dataset is padded and stacked in its own pipeline, a window ahead; any
    other iterable is buffered here.
    """
    if isinstance(dataset, tf.data.Dataset):
        def with_size(x, y):
            return x, y, tf.shape(tf.nest.flatten(x)[0])[0]

        yield from dataset.map(with_size).padded_batch(average_gradients).prefetch(1)
        return
    window = []
    for batch in dataset:
        window.append(batch)
        if len(window) == average_gradients:
            yield stack_window(window)
            window = []
    if window:
        yield stack_window(window)


def fit_accumulated(model, dataset, optimizer, loss_fn, average_gradients, strategy=None,
                    callback=None, one_call=True):
    """Trains a Keras model on `dataset`, one update per `average_gradients` micro-batches.

    Each update applies the gradient of the mean loss over all samples of its window, as
    one batch of those samples would; see GradientAccumulator for the arguments.

    Returns:
      FitSummary(micro_batches, updates, partial_window, skipped_windows).
    """
    accumulator = GradientAccumulator(model, optimizer, loss_fn, strategy)
    return accumulator.fit(dataset, average_gradients, callback=callback, one_call=one_call)


def count_all_reduces(concrete_function):
    """Number of cross-replica reduction ops in a traced function and its library."""
    graph_def = concrete_function.graph.as_graph_def()
    nodes = list(graph_def.node)
    for function in graph_def.library.function:
        nodes.extend(function.node_def)
    return sum(node.op in ALL_REDUCE_OPS for node in nodes)
