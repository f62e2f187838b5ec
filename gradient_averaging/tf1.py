"""AveragingOptimizer: gradient averaging as a drop-in tf.compat.v1.train.Optimizer.

    opt = AveragingOptimizer(tf.compat.v1.train.AdamOptimizer(1e-3), average_gradients=8)
    train_op = opt.minimize(loss, global_step=global_step)  # run once per mini-batch
    sess.run(opt.flush_op())  # a trailing partial window; or list opt.flush_hook()
"""

import contextlib
import functools
import time

import numpy as np
import tensorflow as tf

from gradient_averaging import device as device_lib
from gradient_averaging import micro_batch as micro_batch_lib
from gradient_averaging.arguments import check_average_gradients
from gradient_averaging.window import accumulator_dtype
from gradient_averaging.window import all_finite
from gradient_averaging.window import nonzero
from gradient_averaging.window import scalar_in_place
from gradient_averaging.window import zero_sums
from gradient_averaging.window import zeros

v1 = tf.compat.v1

FLUSH_OPS = "averaging_optimizer_flush_ops"  # where an imported meta graph or SavedModel finds them
_COUNT_LIMIT = 2 ** 62  # ResourceCountUpTo's ceiling: never reached


def _values(grad):
    return grad.values if isinstance(grad, tf.IndexedSlices) else grad


def _zero_rows(acc, touched, rows, summed):
    """Zeroes only the window's rows (`acc`'s from a block of zeros: a scalar update is slower)."""
    return tf.group(
        acc.scatter_update(tf.IndexedSlices(tf.zeros_like(summed), rows)),
        tf.raw_ops.ResourceScatterUpdate(  # a scalar update: no zeros the table's size
            resource=touched.handle, indices=rows, updates=tf.constant(False)))


def _outermost_graph():
    """The graph a Session runs: the caller may be inside a cond/while branch's graph."""
    with tf.init_scope():
        return v1.get_default_graph()


def _top_level(item, graph):
    """Whether a collection item can be fetched from `graph` itself, not a cond/while branch."""
    op = item.op if isinstance(item, tf.Tensor) else item
    return not isinstance(op, tf.Operation) or (  # else a variable, a v1 control-flow context...
        op.graph is graph
        and op._get_control_flow_context() is None)  # noqa: SLF001 (no public API)


@contextlib.contextmanager
def _collections_kept_clean(graph):
    """Drops what the block adds to `graph`'s collections from cond_v2 branches (import_meta_graph
    fails on an op the outer graph lacks); TRAIN_OP keeps nothing added: the caller adds it."""
    before = {key: {id(item) for item in graph.get_collection(key)}
              for key in graph.get_all_collection_keys()}
    yield
    for key in graph.get_all_collection_keys():
        old = before.get(key, set())
        items = graph.get_collection_ref(key)
        items[:] = [item for item in items if id(item) in old or (
            key != v1.GraphKeys.TRAIN_OP and _top_level(item, graph))]


class _Window:
    """One graph's window: accumulators, counters, its lock and the flush op; `global_step`
    and `caller_scope` (where the wrapped optimizer applies) for its updates, set by _build."""

    def __init__(self, scope, variables, sparse):
        """Call under init_scope (initializers need no feed). `scope` is absolute ("/"-ended) and
        unique, and tf.Variable ignores variable scope and reuse: optimizers never share a window,
        and a graph rebuilt alike gets the same names, as a Saver needs. Nothing depends on N:
        checkpoints restore across N. `sparse`: var -> whether its gradient is sparse."""
        self.accumulators = {}  # var -> dense accumulator shaped like var
        self.touched = {}  # var -> bool [rows] (sparse gradients only): rows in the window
        self.flush_op = None
        with v1.name_scope(scope):
            for var in variables:
                with tf.device(var.device):
                    self.accumulators[var] = _window_variable(
                        zeros(var.shape, accumulator_dtype(var)),
                        var.op.name + "/accumulator")
                    if sparse[var]:
                        self.touched[var] = _window_variable(
                            tf.zeros(var.shape[:1], tf.bool), var.op.name + "/touched")
            self.count = _window_variable(tf.constant(0, tf.int64), "count")
            # float64 holds sample counts exactly; cast to each accumulator's type.
            self.weight_sum = _window_variable(tf.constant(0, tf.float64), "weight_sum")
            self.skipped_windows = _window_variable(tf.constant(0, tf.int64), "skipped_windows")
            with tf.device(self.count.device):  # a parameter server's workers share the lock
                self.mutex = tf.raw_ops.MutexV2(shared_name=scope + "lock", name="lock")

    def variables(self):
        return (list(self.accumulators.values()) + list(self.touched.values())
                + [self.count, self.weight_sum, self.skipped_windows])

    @contextlib.contextmanager
    def locked(self, after):
        """Ops built in the block hold the window's lock, taken once `after` (a mini-batch's
        gradients: never under the lock) is computed, released even if the run fails. Yields a
        _Held: append to `ops` what the release waits for; then `released` ends the work."""
        held = _Held()
        # Both on the mutex's device: a lock cannot travel between devices.
        graph = v1.get_default_graph()
        with tf.control_dependencies(after), graph.colocate_with(self.mutex.op):
            lock = tf.raw_ops.MutexLock(mutex=self.mutex)
        with tf.control_dependencies([lock]):
            yield held
        with tf.control_dependencies(held.ops), graph.colocate_with(self.mutex.op):
            held.released = tf.raw_ops.ConsumeMutexLock(mutex_lock=lock)


class _Held:
    def __init__(self):
        self.ops, self.released = [], None


def _window_variable(initial_value, name):
    return v1.Variable(initial_value, trainable=False, name=name, use_resource=True,
                       collections=[v1.GraphKeys.GLOBAL_VARIABLES])


class FlushHook(v1.train.SessionRunHook):
    """Runs a flush op as the session ends (AveragingOptimizer.flush_hook says where to list it)."""

    def __init__(self, flush_op):
        self.flush_op = flush_op

    def end(self, session):
        session.run(self.flush_op)


class AveragingOptimizer(v1.train.Optimizer):
    """Applies the (weighted) mean gradient of N mini-batches with any v1 optimizer.

    `minimize`/`apply_gradients` return one op, run once per mini-batch with its feed, from any
    thread (a lock keeps runs from mixing windows): it adds the gradients to accumulator variables,
    and every Nth run applies their mean and resets them. The window lives only in variables, so
    Savers and hooks see one op per step and `global_step` counts updates; the wrapped optimizer's
    variables keep their unwrapped names, so checkpoints move between plain and wrapped runs. N == 1
    trains exactly as the wrapped optimizer (transform_gradients, check_finite and after_update
    still apply). The window accessors raise RuntimeError until this graph's train op is built."""

    def __init__(self, optimizer, average_gradients, check_finite=True,
                 transform_gradients=None, name=None, after_update=None):
        """Wraps `optimizer` (a v1 Optimizer), which computes the gradients and applies the mean.
        Raises ValueError (`optimizer` not a v1 Optimizer, N < 1), TypeError (N not an int).

        Args:
          average_gradients: N, mini-batches per update; an int >= 1.
          check_finite: skip a window whose gradients, sums or means hold a NaN or Inf
            (nothing applied, global_step unchanged), counting it in `skipped_windows`.
          transform_gradients: optional function from the averaged (gradient, variable)
            list to the list to apply (e.g. clipping by global norm), once per update.
          name: the window variables' name scope; default "Averaging" + the wrapped name.
          after_update: optional function of no arguments building ops to run after each
            applied update, in the same run (an EMA: `lambda: ema.apply(var_list)`); returns
            an op, a list of ops or None. Called twice: for the train op and for flush_op."""
        if not isinstance(optimizer, v1.train.Optimizer):
            raise ValueError(f"optimizer must be a tf.compat.v1.train.Optimizer, got "
                             f"{type(optimizer).__name__}")
        self._n = check_average_gradients(average_gradients)
        for arg, fn in (("transform_gradients", transform_gradients),
                        ("after_update", after_update)):
            if fn is not None and not callable(fn):
                raise TypeError(f"{arg} must be a function or None, got {type(fn).__name__}")
        super().__init__(use_locking=False, name=name or "Averaging" + optimizer.get_name())
        self._optimizer, self._check_finite = optimizer, check_finite
        self._transform, self._after_update = transform_gradients, after_update
        self._windows = {}  # outermost graph -> _Window

    @property
    def average_gradients(self):
        return self._n

    def compute_gradients(self, *args, **kwargs):
        """The wrapped optimizer's own compute_gradients (loss scaling, clipping...)."""
        return self._optimizer.compute_gradients(*args, **kwargs)

    def minimize(self, loss, global_step=None, var_list=None,
                 gate_gradients=v1.train.Optimizer.GATE_OP, aggregation_method=None,
                 colocate_gradients_with_ops=False, name=None, grad_loss=None, weight=None):
        """compute_gradients then apply_gradients. `weight`: this mini-batch's scalar weight
        (e.g. its sample count; None: all equal): the update is sum(w_k g_k) / sum(w_k), and a
        window whose weights sum to <= 0 is skipped (counted in skipped_windows)."""
        grads_and_vars = self.compute_gradients(
            loss, var_list=var_list, gate_gradients=gate_gradients,
            aggregation_method=aggregation_method,
            colocate_gradients_with_ops=colocate_gradients_with_ops, grad_loss=grad_loss)
        return self.apply_gradients(grads_and_vars, global_step=global_step, name=name,
                                    weight=weight)

    def apply_gradients(self, grads_and_vars, global_step=None, name=None, weight=None):
        """The op to run once per mini-batch (pairs with a None gradient left out), also added
        to GraphKeys.TRAIN_OP; `weight` as in `minimize`. Raises ValueError (no variable has a
        gradient, a non-scalar `weight`) and RuntimeError (its op already built in this graph)."""
        return self._build(grads_and_vars, global_step, name, weight, apply_when_full=True)

    def accumulate_gradients(self, grads_and_vars, global_step=None, name=None, weight=None):
        """As apply_gradients, but the op only adds the mini-batch; `flush_op()` applies the
        window and advances `global_step` (for a loop that ends windows itself)."""
        return self._build(grads_and_vars, global_step, name, weight, apply_when_full=False)

    def flush_op(self):
        """The op (no feed) applying an open partial window, else doing nothing; also in
        collection FLUSH_OPS, and named "<window scope>/flush"."""
        return self._window("flush_op").flush_op

    def flush_hook(self):
        """A SessionRunHook running flush_op() as the session ends, so the final checkpoint holds
        the partial window: hooks end in the order listed and a CheckpointSaverHook saves in its
        `end`, so list it in MonitoredTrainingSession's `chief_only_hooks`, not `hooks` (after)."""
        return FlushHook(self.flush_op())

    @property
    def skipped_windows(self):
        """int64 variable: windows skipped by check_finite, or for a weight sum <= 0."""
        return self._window("skipped_windows").skipped_windows

    @property
    def window_count(self):
        """int64 variable: mini-batches in the open window."""
        return self._window("window_count").count

    def accumulator(self, var):
        """The window's (dense) sum of weighted gradients for `var`; None if it has none."""
        return self._window("accumulator").accumulators.get(var)

    def window_variables(self):
        """This graph's window variables; a plain run's checkpoint has none, restore it with
        `Saver(var_list=[v for v in global_variables() if v not in window_variables()])`."""
        return self._window("window_variables").variables()

    def get_slot(self, var, name):
        """The wrapped optimizer's slot (the window has its own accessors)."""
        return self._optimizer.get_slot(var, name)

    def get_slot_names(self):
        """The wrapped optimizer's slot names."""
        return self._optimizer.get_slot_names()

    def variables(self):
        """The wrapped optimizer's variables and this graph's window variables."""
        window = self._windows.get(_outermost_graph())
        return self._optimizer.variables() + (window.variables() if window else [])

    def _window(self, what):
        window = self._windows.get(_outermost_graph())
        if window is None:
            raise RuntimeError(f"{what}: call minimize or apply_gradients of {self.get_name()} "
                               "in this graph first")
        return window

    def _build(self, grads_and_vars, global_step, name, weight, apply_when_full):
        grads_and_vars = list(grads_and_vars)  # a zip is read twice below
        pairs = [(g, v) for g, v in grads_and_vars if g is not None]
        if not pairs:
            raise ValueError("no variable receives a gradient: check the loss and var_list "
                             f"({[v.name for _, v in grads_and_vars]})")
        graph = _outermost_graph()
        if graph in self._windows:
            raise RuntimeError(f"{self.get_name()} already built its train op in this graph; "
                               "it holds one window: make one AveragingOptimizer per train op")
        if weight is not None:
            weight = tf.convert_to_tensor(weight)
            if weight.shape.rank not in (None, 0):
                raise ValueError(f"weight must be a scalar, got shape {weight.shape}")
        # The wrapped optimizer applies in the caller's scope, so its beta powers keep their names.
        caller_scope = v1.get_default_graph().get_name_scope()
        with tf.init_scope(), v1.name_scope(name, self.get_name()) as scope:
            window = self._windows[graph] = _Window(
                scope, [v for _, v in pairs], {v: isinstance(g, tf.IndexedSlices)
                                               for g, v in pairs})
        window.global_step, window.caller_scope = global_step, caller_scope and caller_scope + "/"
        with _collections_kept_clean(graph), v1.name_scope(scope):
            if self._n == 1 and apply_when_full:
                train_op = self._direct_or_window(pairs, window, weight)
            else:
                train_op = self._accumulate_then(pairs, window, weight, apply_when_full)
            train_op = tf.group(train_op, name="train")
        # Built now, not in flush_op(): the graph may be finalized by then.
        with _collections_kept_clean(graph), tf.init_scope(), v1.name_scope(scope):
            with window.locked([]) as held:
                held.ops.append(tf.cond(window.count.read_value() > 0,
                                        lambda: self._apply_window(window), tf.no_op))
            window.flush_op = tf.group(held.released, name="flush")
            v1.add_to_collection(FLUSH_OPS, window.flush_op)
        v1.add_to_collection(v1.GraphKeys.TRAIN_OP, train_op)
        return train_op

    def _accumulate_then(self, pairs, window, weight, apply_when_full):
        """Under the lock: adds the mini-batch, counts it, applies a full window."""
        inputs = [_values(g) for g, _ in pairs] + ([] if weight is None else [weight])
        with window.locked(inputs) as held:
            added = []
            for g, v in pairs:
                # A widening cast waits for the previous add: one widened copy at a time.
                widened = _values(g).dtype.base_dtype != window.accumulators[v].dtype
                with tf.control_dependencies(added[-1:] if widened else []):
                    added.append(self._accumulate(window, g, v, weight))
            added.append(window.weight_sum.assign_add(
                tf.constant(1, tf.float64) if weight is None else tf.cast(weight, tf.float64),
                read_value=False))
            with tf.control_dependencies(added):
                if not apply_when_full:
                    held.ops.append(window.count.assign_add(1, read_value=False))
                elif self._n == 1:  # always full
                    with tf.control_dependencies([window.count.assign_add(1)]):
                        held.ops.append(self._apply_window(window))
                else:
                    before = tf.raw_ops.ResourceCountUpTo(  # adds 1, returns the count before
                        resource=window.count.handle, limit=_COUNT_LIMIT, T=tf.int64)
                    full = before >= self._n - 1
                    held.ops.append(tf.cond(full, lambda: self._apply_window(window), tf.no_op))
        return held.released

    def _direct_or_window(self, pairs, window, weight):
        """N == 1: the gradients applied as they are (bit-exact), unless a window is open
        (restored from another N) or the weight is <= 0: then as N > 1."""
        use_window = window.count.read_value() > 0
        if weight is not None:
            use_window = tf.logical_or(use_window, tf.cast(weight, tf.float64) <= 0)
        return tf.cond(
            use_window,
            lambda: self._accumulate_then(pairs, window, weight, apply_when_full=True),
            lambda: self._apply_or_skip(pairs, window, reset=list))

    def _accumulate(self, window, grad, var, weight):
        acc = window.accumulators[var]
        values = tf.cast(_values(grad), acc.dtype)
        if weight is not None:
            values = values * tf.cast(weight, acc.dtype)
        if not isinstance(grad, tf.IndexedSlices):
            return acc.assign_add(values, read_value=False)
        return tf.group(
            acc.scatter_add(tf.IndexedSlices(values, grad.indices)),
            tf.raw_ops.ResourceScatterUpdate(  # a scalar update: no ones_like per run
                resource=window.touched[var].handle, indices=grad.indices,
                updates=tf.constant(True)))

    def _apply_window(self, window):
        """Applies the window's mean, then resets it. Dense sums are divided in their own buffers
        one by one (no quotient made: window.scalar_in_place); sparse sums apply and reset only
        the touched rows, so other rows' slots stay as the whole batch at once would leave them."""
        weight_sum = window.weight_sum.read_value()
        pairs, resets, divided, dense = [], [], [], []
        for var, acc in window.accumulators.items():
            total = tf.cast(weight_sum, acc.dtype)
            if var in window.touched:
                touched = window.touched[var]
                rows = tf.where(touched)[:, 0]
                summed = tf.gather(acc, rows)
                grad = tf.IndexedSlices(tf.cast(summed / total, var.dtype.base_dtype),
                                        rows, tf.shape(var, out_type=tf.int64))
                resets.append(functools.partial(_zero_rows, acc, touched, rows, summed))
            else:
                with tf.control_dependencies(divided[-1:]):
                    divided.append(scalar_in_place(  # a sum of 0 or less is skipped, not applied
                        tf.raw_ops.ResourceScatterDiv, acc, nonzero(total, acc.dtype)))
                with tf.control_dependencies(divided[-1:]):
                    grad = tf.cast(acc.read_value(), var.dtype.base_dtype)
                dense.append(acc)
            pairs.append((grad, var))

        def reset():  # the dense sums zeroed, then the sparse ones' rows one after another
            ops = zero_sums(dense)
            for r in resets:
                with tf.control_dependencies(ops[-1:]):
                    ops.append(r())
            return ops + [window.count.assign(0, read_value=False),
                          window.weight_sum.assign(0, read_value=False)]

        return self._apply_or_skip(pairs, window, reset, positive=weight_sum > 0)

    def _apply_or_skip(self, averaged, window, reset, positive=None):
        """Transforms and applies `averaged`, then `reset()`; a window with `positive` false or
        (with check_finite) a non-finite value only resets, counted in skipped_windows."""
        pairs = list(self._transform(averaged)) if self._transform else averaged

        def apply():
            with v1.name_scope(window.caller_scope):
                applied = self._optimizer.apply_gradients(pairs, global_step=window.global_step)
            with tf.control_dependencies([applied]):  # the reads of the means come first
                after = self._after_update() if self._after_update else None
                after = [op for op in tf.nest.flatten(after) if op is not None]
                return tf.group(applied, *reset(), *after)

        def skip():
            return tf.group(*reset(), window.skipped_windows.assign_add(1, read_value=False))

        good = positive
        if self._check_finite:
            checked = {id(g): _values(g) for g, _ in averaged + pairs if g is not None}
            finite = all_finite(checked.values())
            good = finite if good is None else tf.logical_and(good, finite)
        return apply() if good is None else tf.cond(good, apply, skip)


def find_micro_batch(session, optimizer, train_op, feed, effective_batch, budget=None,
                     margin=None, device=None):
    """The largest micro-batch (a micro_batch.MicroBatch) whose run of `optimizer`'s `train_op`
    fits `device`'s memory for updates of `effective_batch` samples; trials load every variable
    back. Train each update as found.average_gradients runs, the last on found.last samples,
    each weighted by its samples, then `flush_op`. `feed`: one batch's feed_dict; values with a
    leading samples dimension are cut or repeated. budget, margin: as micro_batch's. Raises
    ValueError (bad arguments, unreadable device memory or peak) and NothingFits."""
    start = time.perf_counter()
    device = device or device_lib.default_device()
    search = micro_batch_lib.Search.on_devices([device], effective_batch, budget, margin)
    search.start = start
    with session.graph.as_default():
        variables = v1.global_variables() + v1.local_variables()
    saved = session.run(variables)
    values = {key: np.asarray(value) for key, value in feed.items()}
    samples = next((len(v) for v in values.values() if v.ndim), None)
    if not samples:
        raise ValueError("feed holds no batch: no value has a leading dimension of samples")
    count, flush = optimizer.window_count, optimizer.flush_op()

    def run(size):
        index = np.arange(size) % samples
        count.load(0, session)
        session.run(train_op, {key: value[index] if value.ndim and len(value) == samples
                               else value for key, value in values.items()})

    def peak(size, then=None):  # of the run of `size` samples, or (`then`) of then() after it
        try:
            if then:
                run(size)
            return device_lib.measured_peak(then or (lambda: run(size)), [device])
        finally:
            for variable, value in zip(variables, saved):
                variable.load(value, session)

    peak(1)  # the first run sets the graph up (Grappler allocates): not a trial
    return micro_batch_lib.largest_that_fits(
        peak, lambda: peak(1, lambda: session.run(flush)), search).found()
