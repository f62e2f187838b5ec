"""The window step, written once for every TF2 path (both accumulators and Keras fit):
one mini-batch's pass added into the window's sums, in place; the window's vote and
apply.

Memory is why a user accumulates, so the step holds no more than B alone does plus one
accumulator per trainable variable: the sums are replica-local variables, added to in
place as each mini-batch's gradients are made, and zeroed in place as the window
closes (window.zero_sums: never in a buffer made amid a pass); a mini-batch reaches the
step alone (the window loop hands over one at a time, so one mini-batch's activations
are alive at once); the mean is divided in place, one variable at a time
(window.divide_in_place).

The applied gradient is the sum of every sample's loss gradient divided by the window's
samples: exactly the mean loss's over the window, whatever the sizes of its mini-batches.
An activity regularizer's loss that Keras adds as a raw sum over the batch (before 3.14)
counts once per window, not once per sample: its gradients are summed apart, in a second
accumulator made only for such a model, and added undivided (WindowStep.activity_sums).
A window in which any loss or gradient is NaN or Inf is skipped whole (the replicas vote
first): the optimizer does not step, so its `iterations`, and an LR schedule, stay put.
"""

import collections
import contextlib
import threading

import keras
import tensorflow as tf

from gradient_averaging import _keras_src
from gradient_averaging import replicas as replicas_lib
from gradient_averaging import window as window_lib

MiniBatch = collections.namedtuple(
    "MiniBatch", ["gradients", "no_gradient", "state", "extra", "moments", "activity"])


def mini_batch_gradients(model, weights, non_trainable, x, objective, statistics=None,
                         summed_activity=None, optimizer=None):
    """One mini-batch's forward and backward pass, on values: every path's pass.

    Args:
      model: the Keras model, run by `stateless_call` in training mode.
      weights, non_trainable: the values of its trainable and other variables.
      x: the mini-batch's inputs (this replica's share).
      objective: (outputs, regularization losses, non_trainable) -> (the scalar to
        differentiate, anything else to return), computed under the tape.
      statistics: the model's batch_statistics.BatchStatistics, or None.
      summed_activity: the WindowStep's (see there), or None: the activity
        regularizers' losses are left out of the regularization losses and
        differentiated apart, a second backward pass on the same tape.
      optimizer: scales the activity losses as it scales the loss (summed_activity).

    Returns:
      MiniBatch(gradients: a tensor, rows (tf.IndexedSlices: an embedding's, added
      as rows, window.add_rows) or None per weight, no_gradient: which are None,
      state: the model's other state after the pass (batch norm's moving statistics
      as they were, where they step once per update), extra: what `objective`
      returned beside its scalar, moments: the batch-norm moments of the pass,
      activity: (the activity losses' gradients, a tensor, rows or None per weight,
      their float32 sum), or None where summed_activity is).
    """
    moments, records = [], []
    capture = statistics.capture(moments) if statistics else contextlib.nullcontext()
    apart = summed_activity(records) if summed_activity else contextlib.nullcontext()
    with tf.GradientTape(persistent=bool(summed_activity)) as tape:
        tape.watch(weights)
        with capture, apart:
            outputs, after, regularization = model.stateless_call(
                weights, non_trainable, x, training=True, return_losses=True)
        if statistics:
            after = statistics.held(non_trainable, after)
        value, extra = objective(outputs, regularization, after)
        if records:
            activity_loss = tf.add_n([tf.cast(loss, tf.float32) for loss in records])
            # A sum weighed as it is (no mean to take), scaled as the loss is.
            activity_value = scaled_objective(optimizer, activity_loss, 1)
    grads = tape.gradient(value, weights)
    activity = None
    if records:
        activity_grads = tape.gradient(activity_value, weights)
        # A weight that only the activity losses reach still has a loss gradient, zero,
        # so that it is applied (a weight without one is left out of the apply); made as
        # the pass runs, not a constant that Grappler folds and the executor keeps.
        grads = [window_lib.zeros(w.shape, w.dtype) if g is None and a is not None else g
                 for g, a, w in zip(grads, activity_grads, weights)]
        activity = (activity_grads, activity_loss)
    no_gradient = [g is None for g in grads]
    if all(no_gradient):
        raise ValueError("no variable receives a gradient from the loss")
    return MiniBatch(grads, no_gradient, after, extra, moments, activity)


@contextlib.contextmanager
def one_variable_at_a_time(optimizer):
    """Within the block, `optimizer` (a LossScaleOptimizer's inner one) updates its
    variables one after another, each once the one before is written.

    A window's shares all exist when its apply starts, so the executor ran the
    optimizer's updates of several variables at once, each with its temporaries the
    size of its variable (Adam: two or three): the language model's accumulate path
    peaked there, with three 31 MiB temporaries of its two tables alive. B alone's
    gradients come one by one out of the backward pass, which spreads its updates.
    Keras calls `update_step` once per variable (its TensorFlow optimizer's
    _distributed_tf_update_step); each call's gradient is made to wait for the
    previous variable's value after its update (a read, ordered after the update's
    writes by the function's automatic control dependencies; it shares the buffer)."""
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    # A strategy's replicas enter the block at once, in threads of their own, and Keras
    # updates the variables once, in a merge call that all of them wait in: the
    # wrapper is put on as the first enters and taken off as the last leaves.
    with _ORDERED:
        depth = inner.__dict__.get(_DEPTH, 0)
        if not depth:
            own, written = inner.update_step, []

            def update_step(gradient, variable, learning_rate):
                with tf.control_dependencies(written):
                    gradient = tf.identity(gradient)
                own(gradient, variable, learning_rate)
                written[:] = [tf.convert_to_tensor(variable)]

            inner.__dict__["update_step"] = update_step
        inner.__dict__[_DEPTH] = depth + 1
    try:
        yield
    finally:
        with _ORDERED:
            inner.__dict__[_DEPTH] -= 1
            if not inner.__dict__[_DEPTH]:
                del inner.__dict__["update_step"], inner.__dict__[_DEPTH]


_ORDERED = threading.Lock()
_DEPTH = "_gradient_averaging_ordered_depth"


def pass_moments(statistics, step):
    """A pass's batch-norm moments as the float64 sums the window adds (None without
    statistics), taken around the moving means, which hold still within a window."""
    if not statistics:
        return None
    return statistics.add(statistics.zeros(), step.moments, statistics.shifts(step.state))


def scaled_objective(optimizer, loss_sum, n_local):
    """The scalar to differentiate for a mini-batch's loss sum (unscaled() makes its
    gradients those of the sum).

    Under a LossScaleOptimizer (mixed precision) the scaled loss is the mini-batch's
    mean, as Keras scales a batch's: its float16 gradients keep the magnitude of a
    direct batch's; they are made gradients of the sum again in float32.
    """
    if not isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return loss_sum
    return optimizer.scale_loss(loss_sum / _mean_over(n_local))


def unscaled(optimizer, gradients, n_local):
    """The gradients of scaled_objective's scalar as those of the loss sum (the
    LossScaleOptimizer unscales what it applies by its own scale)."""
    if not isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return gradients
    mean_over = _mean_over(n_local)
    return [None if g is None else _times(g, tf.cast(mean_over, g.dtype)) for g in gradients]


def _times(gradient, factor):
    """A gradient times a scalar; rows (tf.IndexedSlices) stay rows."""
    if isinstance(gradient, tf.IndexedSlices):
        return tf.IndexedSlices(gradient.values * factor, gradient.indices,
                                gradient.dense_shape)
    return gradient * factor


def _mean_over(n_local):
    return tf.maximum(tf.cast(n_local, tf.float32), 1.0)


def run_passes(run, batches, weight_variables, state_variables):
    """Replica context: the passes of a group of mini-batches, all on the weights read
    once, each on the model's other state as the pass before left it (values, not
    variables), so that nothing orders one pass's ops after another's but their data: a
    group's passes may run at once (the window loop's in-place additions run its
    iterations one after another). The state is written back once, after the last.

    Args:
      run: (batch, weight values, state values) -> (result, state values after the pass).
      batches: the group's mini-batches, in order.
      weight_variables: the variables the passes differentiate by (read, never written).
      state_variables: the variables `run`'s state values are read from and written to.

    Returns:
      Each pass's result, in order.
    """
    weights = [tf.convert_to_tensor(v) for v in weight_variables]
    state = [tf.convert_to_tensor(v) for v in state_variables]
    results = []
    for batch in batches:
        result, state = run(batch, weights, state)
        results.append(result)
    for variable, value in zip(state_variables, state):
        variable.assign(value)
    return results


def window_from(strategy, iterator, average_gradients, add, parallel=1):
    """Cross-replica: the window loop that pulls up to N mini-batches from `iterator`,
    one after another, and hands them to `add` in lists, up to `parallel` at a time (see
    run_passes). The window's last mini-batch is never pulled past: the next window's
    first stays queued. Returns the mini-batches added (an int32 scalar tensor)."""
    def more(i, optional):
        return tf.logical_and(i < average_gradients, optional.has_value())

    def body(i, optional):
        fetched, present = [optional], []
        for j in range(1, parallel):  # present: has mini-batch i + j a value?
            last = fetched[-1]
            fetched.append(tf.cond(i + j < average_gradients, iterator.get_next_as_optional,
                                   lambda last=last: last))
            present.append(tf.logical_and(i + j < average_gradients, fetched[-1].has_value()))
            if j > 1:
                present[-1] = tf.logical_and(present[-1], present[-2])

        def adds(group):
            def branch():
                added = add([o.get_value() for o in fetched[:group]])
                with tf.control_dependencies(strategy.experimental_local_results(added)):
                    return tf.constant(group)
            return branch

        if parallel == 1:
            added, group = add([optional.get_value()]), 1
        else:
            group = tf.switch_case(tf.add_n([tf.cast(p, tf.int32) for p in present]),
                                   [adds(g) for g in range(1, parallel + 1)])
            added = group
        last = fetched[-1]
        return i + group, next_after(strategy, added, lambda: tf.cond(
            i + group < average_gradients, iterator.get_next_as_optional, lambda: last))

    count, _ = tf.while_loop(more, body, (tf.constant(0), iterator.get_next_as_optional()),
                             parallel_iterations=window_lib.PARALLEL_ITERATIONS)
    return count


def last_of(tokens):
    """One token for a group's tokens (WindowStep.add's): it exists once all do."""
    if len(tokens) == 1:
        return tokens[0]
    with tf.control_dependencies(tokens):
        return tf.identity(tokens[-1])


def next_after(strategy, added, fetch):
    """Runs `fetch` (the window's next mini-batch from an iterator) once the tokens that
    WindowStep.add returned exist. An iterator's op completes on tf.data's threads: left
    free, it finishes mid-pass and reorders the pass's ops, and the peak moves with the
    order (measured: by two activations, from process to process)."""
    with tf.control_dependencies(strategy.experimental_local_results(added)):
        return fetch()


class WindowStep:
    """A window's state on each replica, and the two things done with it: add a
    mini-batch (`add`, in a replica's context), apply the window (`apply`, across).

    Attributes:
      sums: replica-local gradient sums, one per trainable variable, in its
        accumulation type.
      mini_batches: mini-batches added to the open window.
      samples: the open window's samples on this replica (its shares' samples).
      nonfinite: mini-batches of the open window whose loss was not finite, on this
        replica (the sums are checked when the window closes: a sum is finite only if
        every term was).
      statistics_sums: the window's batch-norm sums (made by `build_statistics`).
      no_gradient: which variables the loss does not reach (known once traced).
      summed_activity: where this Keras adds activity regularizers' losses as raw sums
        over the batch (before 3.14; _keras_src.summed_activity): records -> a context
        manager under which the forward pass records them apart; else None.
      activity_sums: with summed_activity, replica-local sums of their gradients, kept
        apart: the direct batch of the window's E samples adds the raw sum over all
        of them, so they enter the applied gradient as they are, not divided by E.
      activity_losses: with summed_activity, their sum over the open window's finite
        mini-batches on this replica (for the logs).
    """

    def __init__(self, strategy, optimizer, variables, statistics, check_finite,
                 summed_activity=None, log_loss=None):
        """See the attributes; `log_loss`, with summed_activity: a function run in each
        replica's context as a window closes, given the window's activity losses as the
        direct batch's logs count them (its samples times their sum), to add to the
        logged loss."""
        # The apply orders Keras's update_step calls (one_variable_at_a_time).
        _keras_src.require(_keras_src.APPLY)
        self.strategy = strategy
        self.optimizer = optimizer
        self.variables = list(variables)
        self.statistics = statistics
        self.check_finite = check_finite
        self.summed_activity = summed_activity
        self.log_loss = log_loss
        self.no_gradient = None
        self.activity_no_gradient = None
        self.statistics_sums = None
        self.activity_sums = self.activity_losses = None
        with strategy.scope():
            self.sums = self._accumulators("window_sum")
            self.mini_batches = replicas_lib.local_variable(
                0, tf.VariableAggregation.ONLY_FIRST_REPLICA, "window_mini_batches")
            self.samples = replicas_lib.local_variable(
                0.0, tf.VariableAggregation.SUM, "window_samples")
            self.nonfinite = replicas_lib.local_variable(
                0.0, tf.VariableAggregation.SUM, "window_nonfinite")
            if summed_activity:  # one more accumulator, only for such a model
                self.activity_sums = self._accumulators("window_activity_sum")
                self.activity_losses = replicas_lib.local_variable(
                    0.0, tf.VariableAggregation.SUM, "window_activity_losses")

    def _accumulators(self, name):
        """One replica-local sum per trainable variable, in its accumulation type."""
        return [replicas_lib.local_variable(
            tf.zeros(v.shape, window_lib.accumulator_dtype(v)),
            tf.VariableAggregation.SUM, f"{name}_{i}") for i, v in enumerate(self.variables)]

    def mini_batch_gradients(self, model, weights, non_trainable, x, objective):
        """The module's mini_batch_gradients with this window's statistics, its
        activity regularizers' losses apart where they are summed, and its optimizer."""
        return mini_batch_gradients(model, weights, non_trainable, x, objective,
                                    self.statistics or None, self.summed_activity,
                                    self.optimizer)

    def build_statistics(self, model, x_spec):
        """Learns the calls a forward pass makes on inputs like `x_spec` and makes their
        sums: once, outside any trace, before the first `add`."""
        if not self.statistics or self.statistics_sums is not None:
            return

        @tf.function(input_signature=[x_spec])
        def discover(x):
            self.statistics.discover(model, [tf.convert_to_tensor(v) for v in self.variables],
                                     [tf.convert_to_tensor(v)
                                      for v in model.non_trainable_variables], x)

        with self.strategy.scope():
            discover.get_concrete_function()
            self.statistics_sums = replicas_lib.local_variable(
                self.statistics.zeros(), tf.VariableAggregation.SUM, "statistics_sums")

    def add(self, gradients, moments, n_local, finite, activity=None):
        """Replica context: adds one mini-batch's pass to the window.

        Args:
          gradients: the gradients of its share's loss sum, a tensor or None each.
          moments: its batch-norm sums (`pass_moments`), or None without statistics.
          n_local: the samples of this replica's share.
          finite: bool scalar, whether its loss was finite.
          activity: the pass's MiniBatch.activity.

        Returns:
          A token (n_local) that exists once the mini-batch is added: a window loop
          fetches the next mini-batch after it (see `next_after`).
        """
        ops = window_lib.add_in_place(self.sums, gradients)
        if activity is not None:
            activity_gradients, activity_loss = activity
            self.activity_no_gradient = [g is None for g in activity_gradients]
            ops += window_lib.add_in_place(self.activity_sums, activity_gradients)
            finite = tf.logical_and(finite, tf.math.is_finite(activity_loss))
            ops.append(self.activity_losses.assign_add(tf.where(finite, activity_loss, 0.0)))
        if self.statistics:
            ops.append(self.statistics_sums.assign_add(moments))
        ops += [self.mini_batches.assign_add(1),
                self.samples.assign_add(tf.cast(n_local, tf.float32)),
                self.nonfinite.assign_add(1.0 - tf.cast(finite, tf.float32))]
        with tf.control_dependencies(ops):
            return tf.identity(n_local)

    def _shares(self):
        """Replica context: this replica's share of the mean (the optimizer sums the
        shares), its vote (1.0 where anything was not finite) and whether its sums are
        finite after the division (for _reset)."""
        sums = [total for total, none in zip(self.sums, self.no_gradient) if not none]
        samples = tf.distribute.get_replica_context().all_reduce(
            tf.distribute.ReduceOp.SUM, self.samples.read_value())
        addends = None
        if self.activity_no_gradient is not None:
            addends = [None if apart else total for total, apart, none in zip(
                self.activity_sums, self.activity_no_gradient, self.no_gradient)
                if not none]
            if self.log_loss:
                self.log_loss(samples * self.activity_losses.read_value())
        shares, finite = window_lib.divide_in_place(sums, samples, addends)
        return shares, self.nonfinite.read_value() + 1.0 - tf.cast(finite, tf.float32), finite

    def _reset(self, finite=False):
        """Replica context: opens the next window. `finite`: whether every sum is
        finite (window.zero_sums); False where not known."""
        # Its counts say the window is empty once its sums are.
        with tf.control_dependencies(
                window_lib.zero_sums(self.sums + (self.activity_sums or []), finite)):
            self.mini_batches.assign(0)
            self.samples.assign(0.0)
            self.nonfinite.assign(0.0)
            if self.activity_losses is not None:
                self.activity_losses.assign(0.0)
            if self.statistics:
                self.statistics_sums.assign(tf.zeros_like(self.statistics_sums))

    def discard(self):
        """Cross-replica: empties the open window without applying it (the micro-batch
        search's trials: gradient_averaging.micro_batch)."""
        self.strategy.run(self._reset)

    def apply(self):
        """Cross-replica: applies the window's mean unless a replica voted non-finite
        (check_finite) or the window is empty, steps the batch statistics once, and
        opens the next window.

        A LossScaleOptimizer is given every window: it skips a non-finite one itself, and
        lowers its scale, which a window skipped before it would never do.

        Returns:
          (applied, single): bool tensor; float64 [layers], per batch-norm layer the
          mini-batches that gave it one value a channel.
        """
        strategy, optimizer = self.strategy, self.optimizer
        shares, nonfinite, finite = strategy.run(self._shares)
        variables = [v for v, none in zip(self.variables, self.no_gradient) if not none]

        def apply_shares(shares):
            with one_variable_at_a_time(optimizer):
                optimizer.apply_gradients([(tf.cast(share, v.dtype), v)
                                           for share, v in zip(shares, variables)])

        def apply():
            # Run from the cross-replica context, inside the branch: the optimizer's
            # all-reduce must not cross into a branch from a replica function.
            strategy.extended.call_for_each_replica(apply_shares, args=(shares,))
            return tf.constant(True)

        non_empty = self.mini_batches.read_value() > 0
        scaled = isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
        votes = (strategy.reduce(tf.distribute.ReduceOp.SUM, nonfinite, axis=None)
                 if self.check_finite or scaled else None)
        apply_it = non_empty
        if self.check_finite and not scaled:
            apply_it = tf.logical_and(apply_it, votes == 0)
        ran = tf.cond(apply_it, apply, lambda: tf.constant(False))
        # Under a LossScaleOptimizer a window it skipped still counts for the batch
        # statistics, as the direct batch's statistics move on a skipped step.
        applied, counts = (tf.logical_and(ran, votes == 0), ran) if scaled else (ran, ran)
        single = tf.zeros([0], tf.float64)
        if self.statistics:  # a SUM replica-local variable, read across replicas: summed
            single = self.statistics.end_window(self.statistics_sums.read_value(), counts)
        with tf.control_dependencies([applied, single]):
            strategy.run(self._reset, args=(finite,))
        return tf.identity(applied), tf.identity(single)
