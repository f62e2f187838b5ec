"""AveragingOptimizer: gradient averaging as a drop-in tf.compat.v1.train.Optimizer.

Legacy TF1 code changes one line, where the optimizer is made:

    opt = AveragingOptimizer(tf.compat.v1.train.AdamOptimizer(1e-3), average_gradients=8)
    train_op = opt.minimize(loss, global_step=global_step)   # run once per mini-batch
    ...
    sess.run(opt.flush_op())                                 # a trailing partial window

Each run of `train_op` adds its mini-batch's gradients to accumulator variables; the
Nth run also applies their (weighted) mean with the wrapped optimizer and resets the
window. The window lives only in variables, so a Saver, MonitoredTrainingSession
checkpoints and hooks see an ordinary one-op-per-step training loop, and `global_step`
counts updates, not mini-batches.
"""

import functools
import numbers

import tensorflow as tf

v1 = tf.compat.v1

# Types whose sums overflow or lose precision too soon: they accumulate in float32.
LOW_PRECISION = (tf.float16, tf.bfloat16)


def accumulator_dtype(value):
    """The dtype a sum of `value`'s (a variable's, a gradient's or a numpy array's) values
    is kept in."""
    dtype = tf.as_dtype(value.dtype).base_dtype
    return tf.float32 if dtype in LOW_PRECISION else dtype


def check_average_gradients(value, name="average_gradients"):
    """N, mini-batches per update, checked once for every caller (library, flags, engines).

    Args:
      value: the N given; an int >= 1 (a numpy integer too; not a bool, not a float).
      name: the argument's name, for the error message.

    Returns:
      `value` as a Python int.

    Raises:
      TypeError: `value` is not an integer (None, a bool, a float, a string...).
      ValueError: `value` < 1.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int >= 1 (mini-batches per update), "
                        f"got {value!r} ({type(value).__name__})")
    if value < 1:
        raise ValueError(f"{name} must be an int >= 1 (mini-batches per update), got {value}")
    return int(value)


def all_finite(tensors):
    """A scalar bool tensor: no NaN or Inf in any of `tensors` (dense tensors)."""
    tensors = list(tensors)
    if not tensors:
        return tf.constant(True)
    return tf.reduce_all(tf.stack([tf.reduce_all(tf.math.is_finite(t)) for t in tensors]))


def _values(grad):
    return grad.values if isinstance(grad, tf.IndexedSlices) else grad


def _zero(acc):
    return [acc.assign(tf.zeros_like(acc), read_value=False)]


def _zero_rows(acc, touched, rows, summed):
    """Zeroes only the window's rows: O(rows x width), not O(table)."""
    return [acc.scatter_update(tf.IndexedSlices(tf.zeros_like(summed), rows)),
            touched.assign(tf.zeros_like(touched), read_value=False)]


class _Window:
    """One graph's window: accumulators, counters and the flush op, all variables."""

    def __init__(self, scope, variables, sparse):
        """Creates the variables in name scope `scope`, outside any caller context.

        `tf.Variable` (not get_variable) ignores the caller's variable scope and its
        reuse/AUTO_REUSE, and `scope` is unique in the graph, so two optimizers never
        share a window, and a graph rebuilt the same way gets the same names (which a
        Saver's checkpoint needs). init_scope drops the caller's control dependencies
        and cond/while contexts, so the initializers need no feed.

        Args:
          scope: an absolute name scope, ending in "/".
          variables: the trained variables; empty with N == 1 (nothing accumulates).
          sparse: var -> whether its gradient is an IndexedSlices.
        """
        self.accumulators = {}  # var -> dense accumulator shaped like var
        self.touched = {}  # var -> bool [rows] (sparse gradients only): rows in the window
        self.flush_op = None
        with tf.init_scope(), v1.name_scope(scope):
            for var in variables:
                with tf.device(var.device):
                    self.accumulators[var] = _window_variable(
                        tf.zeros(var.shape, accumulator_dtype(var)),
                        var.op.name + "/accumulator")
                    if sparse[var]:
                        self.touched[var] = _window_variable(
                            tf.zeros(var.shape[:1], tf.bool), var.op.name + "/touched")
            if variables:
                self.count = _window_variable(tf.constant(0, tf.int64), "count")
                # float64 holds sample counts exactly; cast to each accumulator's type.
                self.weight_sum = _window_variable(tf.constant(0, tf.float64), "weight_sum")
            self.skipped_windows = _window_variable(tf.constant(0, tf.int64),
                                                    "skipped_windows")

    def variables(self):
        counters = [self.count, self.weight_sum] if self.accumulators else []
        return (list(self.accumulators.values()) + list(self.touched.values()) + counters
                + [self.skipped_windows])


def _window_variable(initial_value, name):
    """A non-trainable global resource variable: saved by a Saver, never trained."""
    return v1.Variable(initial_value, trainable=False, name=name, use_resource=True,
                       collections=[v1.GraphKeys.GLOBAL_VARIABLES])


class AveragingOptimizer(v1.train.Optimizer):
    """Applies the mean gradient of N mini-batches with any v1 optimizer.

    `minimize` / `apply_gradients` return one op, run once per mini-batch with that
    mini-batch's feed. With N == 1 the gradients go straight to the wrapped optimizer
    (with `transform_gradients` and `check_finite` still honoured), so training is that
    of the wrapped optimizer exactly.
    """

    def __init__(self, optimizer, average_gradients, check_finite=False,
                 transform_gradients=None, name=None):
        """Wraps `optimizer`.

        Args:
          optimizer: a tf.compat.v1.train.Optimizer; its compute_gradients computes the
            gradients, its apply_gradients applies the mean (slots placed as usual).
          average_gradients: N, mini-batches per update; an int >= 1.
          check_finite: discard a window (nothing applied, global_step unchanged)
            whose gradients, sums or averaged gradients hold a NaN or Inf, counting it
            in `skipped_windows`.
          transform_gradients: optional function from the averaged list of
            (gradient, variable) pairs to the list to apply, e.g. clipping by global
            norm; it runs once per update, on the mean, not per mini-batch.
          name: name scope of the window's variables; default "Averaging" + the
            wrapped optimizer's name.

        Raises:
          ValueError: N < 1, or `optimizer` is not a v1 Optimizer.
        """
        if not isinstance(optimizer, v1.train.Optimizer):
            raise ValueError(f"optimizer must be a tf.compat.v1.train.Optimizer, got "
                             f"{type(optimizer).__name__}")
        super().__init__(use_locking=False, name=name or "Averaging" + optimizer.get_name())
        self._optimizer = optimizer
        self._n = check_average_gradients(average_gradients)
        self._check_finite = check_finite
        self._transform = transform_gradients
        self._windows = {}  # graph -> _Window

    @property
    def average_gradients(self):
        return self._n

    # ------------------------------------------------------------------ the v1 interface

    def compute_gradients(self, *args, **kwargs):
        """The wrapped optimizer's own compute_gradients (loss scaling, clipping...)."""
        return self._optimizer.compute_gradients(*args, **kwargs)

    def minimize(self, loss, global_step=None, var_list=None,
                 gate_gradients=v1.train.Optimizer.GATE_OP, aggregation_method=None,
                 colocate_gradients_with_ops=False, name=None, grad_loss=None, weight=None):
        """compute_gradients then apply_gradients; the op to run once per mini-batch.

        Args:
          weight: this mini-batch's weight in the mean, a scalar (e.g. its sample
            count); None counts every mini-batch equally. Others as in v1 minimize.
        """
        grads_and_vars = self.compute_gradients(
            loss, var_list=var_list, gate_gradients=gate_gradients,
            aggregation_method=aggregation_method,
            colocate_gradients_with_ops=colocate_gradients_with_ops, grad_loss=grad_loss)
        return self.apply_gradients(grads_and_vars, global_step=global_step, name=name,
                                    weight=weight)

    def apply_gradients(self, grads_and_vars, global_step=None, name=None, weight=None):
        """Builds the op that accumulates one mini-batch and applies every Nth run.

        Args:
          grads_and_vars: (gradient, variable) pairs of one mini-batch, as returned by
            compute_gradients; pairs whose gradient is None are left out.
          global_step: optional variable, incremented once per applied update.
          name: name of the returned op.
          weight: as in `minimize`: the update is sum(w_k g_k) / sum(w_k).

        Returns:
          One op to run per mini-batch, with that mini-batch's feed.

        Raises:
          ValueError: no variable has a gradient, or `weight` is not a scalar.
          RuntimeError: this optimizer already built its op in this graph.
        """
        return self._build(grads_and_vars, global_step, name, weight, apply_when_full=True)

    def accumulate_gradients(self, grads_and_vars, global_step=None, name=None, weight=None):
        """As apply_gradients, but the op only adds the mini-batch: `flush_op()` applies.

        For a loop that decides itself when a window ends (strategies.GraphAverager runs
        it N times, then flush_op); `global_step` is the one flush_op advances.
        """
        return self._build(grads_and_vars, global_step, name, weight, apply_when_full=False)

    def _build(self, grads_and_vars, global_step, name, weight, apply_when_full):
        grads_and_vars = list(grads_and_vars)  # a zip is read twice below
        pairs = [(g, v) for g, v in grads_and_vars if g is not None]
        if not pairs:
            raise ValueError("no variable receives a gradient: check the loss and var_list "
                             f"({[v.name for _, v in grads_and_vars]})")
        graph = v1.get_default_graph()
        if graph in self._windows:
            raise RuntimeError(f"{self.get_name()} already built its train op in this graph; "
                               "it holds one window: make one AveragingOptimizer per train op")
        if weight is not None:
            weight = tf.convert_to_tensor(weight)
            if weight.shape.rank not in (None, 0):
                raise ValueError(f"weight must be a scalar, got shape {weight.shape}")
        sparse = {v: isinstance(g, tf.IndexedSlices) for g, v in pairs}
        with v1.name_scope(name, self.get_name()) as scope:
            if self._n == 1 and apply_when_full:
                window = self._windows[graph] = _Window(scope, [], {})
                with tf.init_scope(), v1.name_scope(scope):
                    window.flush_op = tf.no_op(name="flush")
                return tf.group(self._apply_or_skip(pairs, window, global_step, reset=list),
                                name=scope)
            window = self._windows[graph] = _Window(scope, [v for _, v in pairs], sparse)
            accumulate = [self._accumulate(window, g, v, weight) for g, v in pairs]
            accumulate.append(window.weight_sum.assign_add(
                tf.constant(1, tf.float64) if weight is None else tf.cast(weight, tf.float64),
                read_value=False))
            with tf.control_dependencies(accumulate):
                if apply_when_full:
                    full = window.count.assign_add(1) >= self._n
                    applied = tf.cond(full, lambda: self._apply_window(window, global_step),
                                      tf.no_op)
                else:
                    applied = window.count.assign_add(1, read_value=False)
            train_op = tf.group(applied, name=scope)
        # Built now, not in flush_op(): the graph may be finalized by then.
        with tf.init_scope(), v1.name_scope(scope):
            window.flush_op = tf.group(tf.cond(
                window.count.read_value() > 0, lambda: self._apply_window(window, global_step),
                tf.no_op), name="flush")
        return train_op

    def flush_op(self):
        """The op (no feed needed) that applies an open partial window; else a no-op.

        Raises:
          RuntimeError: minimize/apply_gradients has not been built in this graph.
        """
        return self._window("flush_op").flush_op

    @property
    def skipped_windows(self):
        """int64 variable: windows discarded by check_finite in this graph."""
        return self._window("skipped_windows").skipped_windows

    @property
    def window_count(self):
        """int64 variable: mini-batches in the open window (None with N == 1: no window)."""
        return getattr(self._window("window_count"), "count", None)

    def get_slot(self, var, name):
        """The wrapped optimizer's slots, plus "accumulator" (and "touched" for sparse)."""
        window = self._windows.get(var.graph)
        if window is not None and name == "accumulator":
            return window.accumulators.get(var)
        if window is not None and name == "touched":
            return window.touched.get(var)
        return self._optimizer.get_slot(var, name)

    def get_slot_names(self):
        return self._optimizer.get_slot_names() + ["accumulator", "touched"]

    def variables(self):
        """The wrapped optimizer's variables and this graph's window variables."""
        window = self._windows.get(v1.get_default_graph())
        return self._optimizer.variables() + (window.variables() if window else [])

    # ------------------------------------------------------------------ the window

    def _window(self, what):
        window = self._windows.get(v1.get_default_graph())
        if window is None:
            raise RuntimeError(f"{what}: call minimize or apply_gradients of {self.get_name()} "
                               "in this graph first")
        return window

    def _accumulate(self, window, grad, var, weight):
        """Adds weight * grad to var's accumulator; sparse rows by scatter_add."""
        acc = window.accumulators[var]
        values = tf.cast(_values(grad), acc.dtype)
        if weight is not None:
            values = values * tf.cast(weight, acc.dtype)
        if not isinstance(grad, tf.IndexedSlices):
            return acc.assign_add(values, read_value=False)
        touched = window.touched[var]
        return tf.group(
            acc.scatter_add(tf.IndexedSlices(values, grad.indices)),
            touched.scatter_update(tf.IndexedSlices(
                tf.ones_like(grad.indices, tf.bool), grad.indices)))

    def _apply_window(self, window, global_step):
        """The mean of the window, applied by the wrapped optimizer; then a reset.

        Sparse accumulators are applied as IndexedSlices of the touched rows only, so a
        sparse-aware optimizer (Momentum, Adagrad...) leaves the other rows' slots
        alone, as it would for the whole batch at once; only those rows are reset.
        """
        pairs, resets = [], []
        for var, acc in window.accumulators.items():
            weight_sum = tf.cast(window.weight_sum, acc.dtype)
            if var in window.touched:
                touched = window.touched[var]
                rows = tf.where(touched)[:, 0]
                summed = tf.gather(acc, rows)
                grad = tf.IndexedSlices(tf.cast(summed / weight_sum, var.dtype.base_dtype),
                                        rows, tf.shape(var, out_type=tf.int64))
                resets.append(functools.partial(_zero_rows, acc, touched, rows, summed))
            else:
                grad = tf.cast(acc / weight_sum, var.dtype.base_dtype)
                resets.append(functools.partial(_zero, acc))
            pairs.append((grad, var))

        def reset():
            return [op for r in resets for op in r()] + [
                window.count.assign(0, read_value=False),
                window.weight_sum.assign(0, read_value=False)]

        return self._apply_or_skip(pairs, window, global_step, reset)

    def _apply_or_skip(self, averaged, window, global_step, reset):
        """Transforms and applies the `averaged` pairs, then builds `reset()` after it.

        With check_finite, a window with a non-finite value only resets, and counts
        itself in skipped_windows.
        """
        pairs = list(self._transform(averaged)) if self._transform else averaged

        def apply():
            applied = self._optimizer.apply_gradients(pairs, global_step=global_step)
            with tf.control_dependencies([applied]):  # the reads of the means come first
                return tf.group(*reset())

        if not self._check_finite:
            return apply()

        def skip():
            return tf.group(*reset(), window.skipped_windows.assign_add(1, read_value=False))

        finite = all_finite([_values(g) for g, _ in averaged + pairs if g is not None])
        return tf.cond(finite, apply, skip)
