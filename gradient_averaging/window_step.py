"""The window step shared by every TF2 path (both accumulators, Keras fit): each mini-batch's pass
added in place into the window's sums, then the window's vote and apply.

Memory: batch B's footprint plus one accumulator per trainable variable. The sums are replica-local
(a mini-batch communicates nothing), added to and zeroed in place (no buffer made mid-pass); one
mini-batch is alive at a time; the mean is written into the sums, applied a variable at a time.

Exactness: a loss is a sum over a divisor (samples, valid tokens, summed sample weights, or none),
so each mini-batch adds its sum's gradient and its divisor and the window divides once: the direct
batch's gradient, whatever the mini-batches hold. Parts with different divisors are separate terms,
an accumulator and backward pass each; weight regularization is differentiated once, at the apply.
A window with any non-finite loss or gradient is skipped whole (the replicas vote): the optimizer's
`iterations` and LR schedule stay put."""

import collections
import contextlib
import functools

import keras
import tensorflow as tf

from gradient_averaging import _keras_src
from gradient_averaging import replicas as replicas_lib
from gradient_averaging import window as window_lib

Pass = collections.namedtuple("Pass", ["gradients", "state", "extra", "moments", "parts"])


def _terms(parts, keys):
    """The parts summed by term, in the order of `keys`: [(weighted sum, divisor)]."""
    totals = {}
    for part in parts:
        value = tf.cast(part.numerator, window_lib.accumulator_dtype(part.numerator))
        if part.weight is not None:
            value = value * tf.cast(part.weight, value.dtype)
        if part.term in totals:
            totals[part.term] = (totals[part.term][0] + value, totals[part.term][1])
        else:
            totals[part.term] = (value, part.divisor)
    return [totals[key] for key in keys]


def part_values(parts):
    """float64 [2 x parts]: each part's weighted numerator, then its divisor (0 for none)."""
    numerators, divisors = [], []
    for part in parts:
        value = tf.cast(part.numerator, tf.float64)
        if part.weight is not None:
            value *= tf.cast(part.weight, tf.float64)
        numerators.append(value)
        divisors.append(tf.constant(0.0, tf.float64) if part.divisor is None
                        else tf.cast(part.divisor, tf.float64))
    return tf.stack(numerators + divisors)


def loss_of(values):
    """(the loss, each part's value) from part_values summed over a window or batch; a divisor
    of 0 (none, or no valid token, whose numerator is 0 too) divides as 1."""
    numerators, divisors = tf.split(values, 2)
    part_values = numerators / window_lib.nonzero(divisors, divisors.dtype)
    return tf.reduce_sum(part_values), part_values


def regularization(variables):
    """The weight regularization of `variables`, a float64 scalar: Keras adds it once a batch."""
    losses = [tf.cast(v.regularizer(v), tf.float64) for v in variables
              if getattr(v, "regularizer", None) is not None]
    return tf.add_n(losses) if losses else tf.constant(0.0, tf.float64)


def data_losses(model, losses):
    if not any(getattr(v, "regularizer", None) is not None for v in model.trainable_weights):
        return list(losses)
    return _keras_src.without_weight_regularization(model, losses)


def pass_moments(statistics, step):
    """A pass's batch-norm moments as float64 sums, around the moving means (fixed in a window)."""
    if not statistics:
        return None
    return statistics.add(statistics.zeros(), step.moments, statistics.shifts(step.state))


def _times(gradient, factor):
    if isinstance(gradient, tf.IndexedSlices):
        return tf.IndexedSlices(gradient.values * factor, gradient.indices,
                                gradient.dense_shape)
    return gradient * factor


def run_passes(run, batches, weight_variables, state_variables):
    """Replica context: `run(batch, weights, state) -> (result, state)` over `batches`, results
    in order. The weights are read once and only state values chain the passes, so a group's
    passes may run at once; the state is written back to `state_variables` once, at the end."""
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
    """Cross-replica window loop: hands up to N mini-batches from `iterator` to `add` in lists of
    up to `parallel`, never pulling past the window's last. Returns the count added (int32)."""
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
    """Runs `fetch` (the next mini-batch) once WindowStep.add's tokens exist: left free, the
    iterator's op completes mid-pass on tf.data's threads, reorders the pass and moves the peak."""
    with tf.control_dependencies(strategy.experimental_local_results(added)):
        return fetch()


class WindowStep:
    """A window's state per replica: `add` a mini-batch (replica context), `apply` (cross-replica).

    Attributes:
      layout, terms: each part's term in the objective's order; the distinct terms.
      sums: per term, a replica-local sum per trainable variable; an overwrite_with_gradient
        variable (float8's scales and histories) keeps the window's maximum, as Keras does.
      mini_batches, samples, nonfinite: this replica's counts for the open window (a sum is
        finite only if every addend was, so the sums are checked once, at the close).
      expected: a window's mini-batches: under loss scaling or float8 a pass differentiates
        numerator / (expected x divisor), the direct batch's magnitudes, and scales back.
      summed_activity: None, or _keras_src.summed_activity's (Keras before 3.14)."""

    def __init__(self, strategy, optimizer, variables, statistics, check_finite,
                 summed_activity=None, log_loss=None):
        """`log_loss`: None, or run per replica as a window closes, on the loss as the direct
        batch's logs count it, each part's value (float64 [parts]) and the samples of the
        window's finite mini-batches on this replica and on all."""
        _keras_src.require(_keras_src.APPLY)  # apply orders update_step (one_variable_at_a_time)
        self.strategy = strategy
        self.optimizer = optimizer
        self.variables = list(variables)
        self.statistics = statistics
        self.check_finite = check_finite
        self.summed_activity = summed_activity
        self.log_loss = log_loss
        self.layout = self.terms = self.sums = self.parts = None
        self.no_gradient = None
        self.statistics_sums = None
        self.overwrite = [bool(getattr(v, "overwrite_with_gradient", False))
                          for v in self.variables]
        self.regularizers = [getattr(v, "regularizer", None) for v in self.variables]
        self.rescale = (isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
                        or any(self.overwrite))
        self._discovered = None
        with strategy.scope():
            self.mini_batches = replicas_lib.local_variable(
                0, tf.VariableAggregation.ONLY_FIRST_REPLICA, "window_mini_batches")
            self.samples = replicas_lib.local_variable(
                0.0, tf.VariableAggregation.SUM, "window_samples")
            self.logged_samples = replicas_lib.local_variable(
                0.0, tf.VariableAggregation.SUM, "window_logged_samples")
            self.nonfinite = replicas_lib.local_variable(
                0.0, tf.VariableAggregation.SUM, "window_nonfinite")
            self.expected = tf.Variable(1.0, trainable=False, name="window_expected",
                                        aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)

    def learn_layout(self, trace):
        """Learns the parts from `trace()` (traces one pass, before any other); makes the sums."""
        if self.layout is not None:
            return
        self._discovered = {}
        try:
            with self.strategy.scope():
                trace()
            discovered = self._discovered
        finally:
            self._discovered = None
        self.layout, self.no_gradient = discovered["layout"], discovered["no_gradient"]
        self.terms = tuple(dict.fromkeys(self.layout))
        with self.strategy.scope():
            self.sums = [self._accumulators(f"window_sum{'_' + str(t) if t else ''}")
                         for t in range(len(self.terms))]
            self.parts = replicas_lib.local_variable(
                tf.zeros([2 * len(self.layout)], tf.float64), tf.VariableAggregation.SUM,
                "window_parts")

    def _accumulators(self, name):
        return [replicas_lib.local_variable(
            tf.zeros(v.shape, window_lib.accumulator_dtype(v)),
            tf.VariableAggregation.SUM, f"{name}_{i}") for i, v in enumerate(self.variables)]

    def mini_batch_gradients(self, model, weights, non_trainable, x, objective):
        """One mini-batch's forward and backward pass on `weights` (values) and this replica's share
        `x`; `objective(outputs, losses without weight regularization, non_trainable) -> (Parts,
        extra)` runs under the tape. Returns a Pass: gradients per term, per weight (a tensor, rows
        or None); the state after, batch norm's moving statistics held (stepped once an update)."""
        moments, records = [], []
        statistics = self.statistics or None
        capture = statistics.capture(moments) if statistics else contextlib.nullcontext()
        apart = (self.summed_activity(records) if self.summed_activity
                 else contextlib.nullcontext())
        keys = self.terms
        with tf.GradientTape(persistent=keys is None or len(keys) > 1) as tape:
            tape.watch(weights)
            with capture, apart:
                outputs, after, losses = model.stateless_call(
                    weights, non_trainable, x, training=True, return_losses=True)
            if statistics:
                after = statistics.held(non_trainable, after)
            parts, extra = objective(outputs, data_losses(model, losses), after)
            parts = list(parts)
            if records:  # a sum weighed as it is: no divisor
                parts.append(window_lib.Part(
                    tf.add_n([tf.cast(loss, tf.float32) for loss in records]), None, None, None))
            keys = self._checked_layout(parts)
            scaled = [self._scaled(total, divisor) for total, divisor in _terms(parts, keys)]
        gradients = [self._unscaled(tape.gradient(value, weights), factor)
                     for value, factor in scaled]
        no_gradient = [[g is None for g in term] for term in gradients]
        if all(all(term) for term in zip(*no_gradient)):
            raise ValueError("no variable receives a gradient from the loss")
        if self._discovered is not None:
            self._discovered["no_gradient"] = no_gradient
        return Pass(gradients, after, extra, moments, part_values(parts))

    def _checked_layout(self, parts):
        """The terms of `parts`, which must be laid out as learn_layout learned them."""
        layout = tuple(part.term for part in parts)
        if self._discovered is not None:
            self._discovered["layout"] = layout
            return tuple(dict.fromkeys(layout))
        if layout != self.layout:
            raise ValueError(f"the loss's parts changed from {self.layout} to {layout}: "
                             "a window needs the same parts in every mini-batch")
        return self.terms

    def _scaled(self, total, divisor):
        """(the scalar to differentiate for a term's weighted sum, the factor that takes its
        gradients back to the sum's, or None): see `expected`."""
        if not self.rescale:
            return total, None
        share = tf.cast(self.expected.read_value(), total.dtype)
        if divisor is not None:
            share = share * window_lib.nonzero(divisor, total.dtype)
        value = total / share
        if isinstance(self.optimizer, keras.optimizers.LossScaleOptimizer):
            value = self.optimizer.scale_loss(value)
        return value, share

    def _unscaled(self, gradients, factor):
        """Gradients as of the term's weighted sum (a LossScaleOptimizer divides out its scale)."""
        if factor is None:
            return gradients
        return [g if g is None or overwrite else _times(g, tf.cast(factor, g.dtype))
                for g, overwrite in zip(gradients, self.overwrite)]

    def build_statistics(self, model, x_spec):
        """Makes the sums of a forward pass's calls on `x_spec`: outside any trace, before `add`."""
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

    def add(self, gradients, moments, n_local, finite, parts):
        """Replica context: adds a pass (per term, `gradients` of its weighted sum; pass_moments or
        None; this replica's `n_local` samples; `finite`: window.finite(parts), which keras_fit's
        logs read too; Pass.parts). Returns n_local once it is added: next_after's token."""
        ops = []
        for sums, term in zip(self.sums, gradients):
            ops += window_lib.add_in_place(
                [s for s, overwrite in zip(sums, self.overwrite) if not overwrite],
                [g for g, overwrite in zip(term, self.overwrite) if not overwrite])
            ops += [s.assign(tf.maximum(s, tf.cast(g, s.dtype)), read_value=False)
                    for s, g, overwrite in zip(sums, term, self.overwrite)
                    if overwrite and g is not None]
        ops.append(self.parts.assign_add(tf.where(finite, parts, tf.zeros_like(parts))))
        if self.statistics:
            ops.append(self.statistics_sums.assign_add(moments))
        n = tf.cast(n_local, tf.float32)
        ops += [self.mini_batches.assign_add(1),
                self.samples.assign_add(n),
                self.logged_samples.assign_add(tf.where(finite, n, 0.0)),
                self.nonfinite.assign_add(1.0 - tf.cast(finite, tf.float32))]
        with tf.control_dependencies(ops):
            return tf.identity(n_local)

    def _shares(self):
        """Replica context: (this replica's share of the mean, which the optimizer sums over
        replicas; its vote, nonzero where anything was not finite). One all-reduce of the parts'
        sums gives every term its divisor; each mean, regularization's gradient added, is written
        into its first term's sum (window.divide_in_place)."""
        context = tf.distribute.get_replica_context()
        samples = self.logged_samples.read_value()
        values = context.all_reduce(tf.distribute.ReduceOp.SUM, tf.concat(
            [self.parts.read_value(), [tf.cast(samples, tf.float64)]], 0))
        count = len(self.layout)
        divisors = values[count:2 * count]
        term_divisors = [None if key is None else divisors[self.layout.index(key)]
                         for key in self.terms]
        replicas = self.strategy.num_replicas_in_sync
        regularization = []

        def addend(i):
            regularizer, variable = self.regularizers[i], self.variables[i]
            value = tf.convert_to_tensor(variable)
            with tf.GradientTape() as tape:
                tape.watch(value)
                loss = tf.cast(regularizer(value), tf.float32)
            regularization.append(loss)
            gradient = tape.gradient(loss, value) / replicas
            if isinstance(self.optimizer, keras.optimizers.LossScaleOptimizer):
                gradient = self.optimizer.scale_loss(gradient)
            return gradient

        reached = [i for i, r in enumerate(self._reached()) if r]
        terms = [[None if none[i] else sums[i] for i in reached]
                 for sums, none in zip(self.sums, self.no_gradient)]

        def divide():
            shares, finite = window_lib.divide_in_place(
                terms, term_divisors,
                [functools.partial(addend, i) if self.regularizers[i] else None
                 for i in reached],
                [self.overwrite[i] for i in reached])
            return shares, finite, tf.add_n(regularization) if regularization else 0.0

        def empty():  # nothing added since the sums were zeroed: nothing to divide
            return ([total.read_value() for total in window_lib.first_sums(terms)],
                    tf.constant(True), 0.0)

        # No collective in the cond: there, an update's OOM crashes the process (test_multi_worker).
        shares, finite, regularized = tf.cond(self._holds_mini_batches(), divide, empty)
        if self.log_loss:
            loss, values_of_parts = loss_of(values[:2 * count])
            with tf.control_dependencies([finite]):
                if any(self.regularizers[i] for i in reached):
                    loss += tf.cast(regularized, tf.float64)
                self.log_loss(loss, values_of_parts, samples, values[-1])
        return shares, self.nonfinite.read_value() + 1.0 - tf.cast(finite, tf.float32)

    def _reached(self):
        """Per variable, whether any term's gradient reaches it (those are applied)."""
        return [not all(term[i] for term in self.no_gradient)
                for i in range(len(self.variables))]

    def _holds_mini_batches(self):
        """Whether the open window holds a mini-batch (every replica counts each, so all agree)."""
        return self.mini_batches.read_value() > 0

    def _reset(self):
        """Replica context: opens the next window, its sums zeroed in place unless none was added (a
        branch in each pass that wrote its first would move the pass's buffers), then its counts."""
        def zero():
            with tf.control_dependencies(
                    window_lib.zero_sums([s for sums in self.sums for s in sums])):
                return tf.constant(True)

        with tf.control_dependencies([tf.cond(self._holds_mini_batches(), zero,
                                              lambda: tf.constant(False))]):
            self.mini_batches.assign(0)
            self.samples.assign(0.0)
            self.logged_samples.assign(0.0)
            self.nonfinite.assign(0.0)
            self.parts.assign(tf.zeros_like(self.parts))
            if self.statistics:
                self.statistics_sums.assign(tf.zeros_like(self.statistics_sums))

    def discard(self):
        """Cross-replica: empties the open window unapplied (micro_batch's search trials)."""
        self.strategy.run(self._reset)

    def apply(self):
        """Cross-replica: applies the window's mean unless it is empty or a replica voted non-finite
        (check_finite), steps the batch statistics once and opens the next window; returns (applied,
        BatchStatistics.end_window's counts). A LossScaleOptimizer gets every window: it skips a
        non-finite one itself and lowers its scale, which a window skipped before it could not."""
        strategy, optimizer = self.strategy, self.optimizer
        shares, nonfinite = strategy.run(self._shares)
        variables = [v for v, reached in zip(self.variables, self._reached()) if reached]

        def apply_shares(shares):
            with _keras_src.one_variable_at_a_time(optimizer):
                optimizer.apply_gradients([(tf.cast(share, v.dtype), v)
                                           for share, v in zip(shares, variables)])

        def apply():
            # Called cross-replica inside the branch: an all-reduce may not enter it from a replica.
            strategy.extended.call_for_each_replica(apply_shares, args=(shares,))
            return tf.constant(True)

        non_empty = self._holds_mini_batches()
        scaled = isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
        votes = (strategy.reduce(tf.distribute.ReduceOp.SUM, nonfinite, axis=None)
                 if self.check_finite or scaled else None)
        apply_it = non_empty
        if self.check_finite and not scaled:
            apply_it = tf.logical_and(apply_it, votes == 0)
        ran = tf.cond(apply_it, apply, lambda: tf.constant(False))
        # A window a LossScaleOptimizer skipped steps the batch statistics, as a direct batch does.
        applied, counts = (tf.logical_and(ran, votes == 0), ran) if scaled else (ran, ran)
        single = tf.zeros([0], tf.float64)
        if self.statistics:  # a SUM replica-local variable, read across replicas: summed
            single = self.statistics.end_window(self.statistics_sums.read_value(), counts)
        with tf.control_dependencies([applied, single]):
            strategy.run(self._reset)
        return tf.identity(applied), tf.identity(single)
