"""AveragingOptimizer: gradient averaging as a drop-in tf.compat.v1.train.Optimizer.

Legacy TF1 code changes one line, where the optimizer is made:

    opt = AveragingOptimizer(tf.compat.v1.train.AdamOptimizer(1e-3), average_gradients=8)
    train_op = opt.minimize(loss, global_step=global_step)   # run once per mini-batch
    ...
    sess.run(opt.flush_op())                                 # a trailing partial window
    # under MonitoredTrainingSession: chief_only_hooks=[opt.flush_hook()], which flushes
    # before the final checkpoint

Each run of `train_op` adds its mini-batch's gradients to accumulator variables; the
Nth run also applies their (weighted) mean with the wrapped optimizer and resets the
window. The window lives only in variables, so a Saver, MonitoredTrainingSession
checkpoints and hooks see an ordinary one-op-per-step training loop, and `global_step`
counts updates, not mini-batches. A lock makes each run's add-and-maybe-apply atomic, so
runs from several threads never mix windows; the wrapped optimizer's variables keep the
names they have without the wrapper, so checkpoints move between plain and wrapped runs.
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
from gradient_averaging.window import zero_sums
from gradient_averaging.window import zeros

v1 = tf.compat.v1

# The collection that holds each AveragingOptimizer's flush op, so that a graph imported
# from a meta graph or a SavedModel finds it (the train op is in GraphKeys.TRAIN_OP).
FLUSH_OPS = "averaging_optimizer_flush_ops"
_COUNT_LIMIT = 2 ** 62  # ResourceCountUpTo's ceiling: never reached


def _values(grad):
    return grad.values if isinstance(grad, tf.IndexedSlices) else grad


def _zero_rows(acc, touched, rows, summed):
    """Zeroes only the window's rows: O(rows x width), not O(table). (A scalar update
    would need no zeros, but scatters it row by row, several times slower.)"""
    return tf.group(
        acc.scatter_update(tf.IndexedSlices(tf.zeros_like(summed), rows)),
        tf.raw_ops.ResourceScatterUpdate(  # a scalar update: no zeros the table's size
            resource=touched.handle, indices=rows, updates=tf.constant(False)))


def _outermost_graph():
    """The graph a Session runs: the caller may be inside a cond/while branch's graph."""
    with tf.init_scope():
        return v1.get_default_graph()


def _absolute(scope):
    """`scope` (a graph's get_name_scope()) as a string name_scope re-enters as is."""
    return scope + "/" if scope else ""


def _top_level(item, graph):
    """Whether a collection item can be fetched from `graph` itself: not an op or tensor
    of a cond/while branch (a function graph, or a v1 control-flow context)."""
    op = item.op if isinstance(item, tf.Tensor) else item
    if not isinstance(op, tf.Operation):
        return True  # variables, v1 control-flow contexts, savers...
    return (op.graph is graph
            and op._get_control_flow_context() is None)  # noqa: SLF001 (no public API)


@contextlib.contextmanager
def _collections_kept_clean(graph):
    """Drops what the block adds to `graph`'s collections from inside branches.

    cond_v2's branch graphs share the outer graph's collections, so the wrapped
    optimizer's apply op (added to TRAIN_OP), or a summary made in `after_update`, would
    name an op the outer graph lacks, and import_meta_graph would fail on it. Variables
    (slots, beta powers, EMA shadows: made under init_scope in `graph`) stay. TRAIN_OP
    keeps nothing the block adds: the caller puts the train op itself there.
    """
    before = {key: {id(item) for item in graph.get_collection(key)}
              for key in graph.get_all_collection_keys()}
    yield
    for key in graph.get_all_collection_keys():
        old = before.get(key, set())
        items = graph.get_collection_ref(key)
        items[:] = [item for item in items if id(item) in old or (
            key != v1.GraphKeys.TRAIN_OP and _top_level(item, graph))]


class _Window:
    """One graph's window: accumulators, counters, its lock and the flush op."""

    def __init__(self, scope, variables, sparse):
        """Creates the variables in name scope `scope`, outside any caller context.

        `tf.Variable` (not get_variable) ignores the caller's variable scope and its
        reuse/AUTO_REUSE, and `scope` is unique in the graph, so two optimizers never
        share a window, and a graph rebuilt the same way gets the same names (which a
        Saver's checkpoint needs). The window is the same at every N, so a checkpoint
        restores into a graph with another N. Call under init_scope: it drops the
        caller's control dependencies and cond/while contexts, so the initializers need
        no feed.

        Args:
          scope: an absolute name scope, ending in "/".
          variables: the trained variables.
          sparse: var -> whether its gradient is an IndexedSlices.
        """
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
            self.skipped_windows = _window_variable(tf.constant(0, tf.int64),
                                                    "skipped_windows")
            # Beside the count, so that workers sharing the window on a parameter server
            # (replica_device_setter) share the lock too.
            with tf.device(self.count.device):
                self.mutex = tf.raw_ops.MutexV2(shared_name=scope + "lock", name="lock")

    def variables(self):
        return (list(self.accumulators.values()) + list(self.touched.values())
                + [self.count, self.weight_sum, self.skipped_windows])

    @contextlib.contextmanager
    def locked(self, after):
        """Ops built in the block run holding the window's lock, taken once the tensors
        in `after` are computed (a mini-batch's gradients: never under the lock).

        The lock is released when its tensor dies, right after the block's ops ran (or
        the run failed). Yields a _Held: append to its `ops` the ops the release waits
        for; after the block, its `released` op is the end of the locked work.
        """
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
    """What `_Window.locked` yields: the locked ops, then the op that ends them."""

    def __init__(self):
        self.ops, self.released = [], None


def _window_variable(initial_value, name):
    """A non-trainable global resource variable: saved by a Saver, never trained."""
    return v1.Variable(initial_value, trainable=False, name=name, use_resource=True,
                       collections=[v1.GraphKeys.GLOBAL_VARIABLES])


class FlushHook(v1.train.SessionRunHook):
    """Runs an AveragingOptimizer's flush op when the session ends (AveragingOptimizer.
    flush_hook). A MonitoredSession ends its hooks in the order they are listed, at the
    end of the data (OutOfRangeError) as after a stop, and its CheckpointSaverHook saves
    the final checkpoint in its own `end`: this hook must come before it."""

    def __init__(self, flush_op):
        self.flush_op = flush_op

    def end(self, session):
        session.run(self.flush_op)


class AveragingOptimizer(v1.train.Optimizer):
    """Applies the mean gradient of N mini-batches with any v1 optimizer.

    `minimize` / `apply_gradients` return one op, run once per mini-batch with that
    mini-batch's feed, from one thread or several. With N == 1 the gradients go straight
    to the wrapped optimizer (with `transform_gradients`, `check_finite` and
    `after_update` still honoured), so training is that of the wrapped optimizer exactly.
    """

    def __init__(self, optimizer, average_gradients, check_finite=True,
                 transform_gradients=None, name=None, after_update=None):
        """Wraps `optimizer`.

        Args:
          optimizer: a tf.compat.v1.train.Optimizer; its compute_gradients computes the
            gradients, its apply_gradients applies the mean (its variables, slots and
            Adam's beta powers, get the names they have without the wrapper).
          average_gradients: N, mini-batches per update; an int >= 1.
          check_finite: skip a window (nothing applied, global_step unchanged)
            whose gradients, sums or averaged gradients hold a NaN or Inf, counting it
            in `skipped_windows`.
          transform_gradients: optional function from the averaged list of
            (gradient, variable) pairs to the list to apply, e.g. clipping by global
            norm; it runs once per update, on the mean, not per mini-batch.
          name: name scope of the window's variables; default "Averaging" + the
            wrapped optimizer's name.
          after_update: optional function of no arguments that builds ops to run once
            per applied update, after the apply, in the same run (an EMA of the
            weights: `lambda: ema.apply(var_list)`); it may return an op, a list of ops
            or None. It is called once for the train op and once for `flush_op`.

        Raises:
          ValueError: `optimizer` is not a v1 Optimizer, or N < 1.
          TypeError: N is not an int (a bool, None, a float...).
        """
        if not isinstance(optimizer, v1.train.Optimizer):
            raise ValueError(f"optimizer must be a tf.compat.v1.train.Optimizer, got "
                             f"{type(optimizer).__name__}")
        self._n = check_average_gradients(average_gradients)
        for arg, fn in (("transform_gradients", transform_gradients),
                        ("after_update", after_update)):
            if fn is not None and not callable(fn):
                raise TypeError(f"{arg} must be a function or None, got {type(fn).__name__}")
        super().__init__(use_locking=False, name=name or "Averaging" + optimizer.get_name())
        self._optimizer = optimizer
        self._check_finite = check_finite
        self._transform = transform_gradients
        self._after_update = after_update
        self._windows = {}  # outermost graph -> _Window

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
          weight: as in `minimize`: the update is sum(w_k g_k) / sum(w_k); a window
            whose weights sum to zero or less is skipped (counted in skipped_windows).

        Returns:
          One op to run per mini-batch, with that mini-batch's feed; also added to
          GraphKeys.TRAIN_OP, as a plain optimizer's apply op is.

        Raises:
          ValueError: no variable has a gradient, or `weight` is not a scalar.
          RuntimeError: this optimizer already built its op in this graph.
        """
        return self._build(grads_and_vars, global_step, name, weight, apply_when_full=True)

    def accumulate_gradients(self, grads_and_vars, global_step=None, name=None, weight=None):
        """As apply_gradients, but the op only adds the mini-batch: `flush_op()` applies.

        For a loop that decides itself when a window ends (the experiment's `graph`
        averager runs it N times, then flush_op); `global_step` is the one flush_op
        advances.
        """
        return self._build(grads_and_vars, global_step, name, weight, apply_when_full=False)

    def flush_op(self):
        """The op (no feed needed) that applies an open partial window; else a no-op.

        Also in the graph's collection FLUSH_OPS, and named "<window scope>/flush".

        Raises:
          RuntimeError: minimize/apply_gradients has not been built in this graph.
        """
        return self._window("flush_op").flush_op

    def flush_hook(self):
        """A SessionRunHook that runs flush_op() as the session ends, so that the final
        checkpoint holds the partial window's update (at the end of the data, or after a
        stop hook).

        MonitoredTrainingSession puts `chief_only_hooks` before its CheckpointSaverHook
        and `hooks` after it: pass this one in `chief_only_hooks` (or list it before a
        CheckpointSaverHook of your own). In `hooks` it flushes after the final save,
        and that checkpoint does not hold the update.

        Raises:
          RuntimeError: minimize/apply_gradients has not been built in this graph.
        """
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
        """This graph's window: accumulators, touched rows, count, weight sum, skipped.

        A plain run's checkpoint has none of them: restore it with
        `Saver(var_list=[v for v in global_variables() if v not in window_variables()])`.
        """
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

    # ------------------------------------------------------------------ the window

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
        # The wrapped optimizer is called in the caller's name scope, wherever it is
        # built, so that its non-slot variables (Adam's beta powers) are named as without
        # the wrapper.
        caller_scope = _absolute(v1.get_default_graph().get_name_scope())
        with tf.init_scope(), v1.name_scope(name, self.get_name()) as scope:
            window = self._windows[graph] = _Window(
                scope, [v for _, v in pairs], {v: isinstance(g, tf.IndexedSlices)
                                               for g, v in pairs})
        with _collections_kept_clean(graph), v1.name_scope(scope):
            if self._n == 1 and apply_when_full:
                train_op = self._direct_or_window(pairs, window, global_step, weight,
                                                  caller_scope)
            else:
                train_op = self._accumulate_then(pairs, window, global_step, weight,
                                                 caller_scope, apply_when_full)
            train_op = tf.group(train_op, name="train")
        # Built now, not in flush_op(): the graph may be finalized by then.
        with _collections_kept_clean(graph), tf.init_scope(), v1.name_scope(scope):
            with window.locked([]) as held:
                held.ops.append(tf.cond(window.count.read_value() > 0,
                                        lambda: self._apply_window(window, global_step,
                                                                   caller_scope),
                                        tf.no_op))
            window.flush_op = tf.group(held.released, name="flush")
            v1.add_to_collection(FLUSH_OPS, window.flush_op)
        v1.add_to_collection(v1.GraphKeys.TRAIN_OP, train_op)
        return train_op

    def _accumulate_then(self, pairs, window, global_step, weight, caller_scope,
                         apply_when_full):
        """Under the lock: adds the mini-batch, counts it, applies a full window."""
        inputs = [_values(g) for g, _ in pairs] + ([] if weight is None else [weight])
        with window.locked(inputs) as held:
            added = []
            for g, v in pairs:
                # A gradient summed in a wider type is cast after the last add: one
                # widened copy at a time.
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
                        held.ops.append(self._apply_window(window, global_step, caller_scope))
                else:
                    # One op adds 1 and returns the count before (ResourceCountUpTo).
                    before = tf.raw_ops.ResourceCountUpTo(
                        resource=window.count.handle, limit=_COUNT_LIMIT, T=tf.int64)
                    full = before >= self._n - 1
                    held.ops.append(tf.cond(
                        full, lambda: self._apply_window(window, global_step, caller_scope),
                        tf.no_op))
        return held.released

    def _direct_or_window(self, pairs, window, global_step, weight, caller_scope):
        """N == 1: the wrapped optimizer's apply of the gradients as they are (its bits),
        unless a window is open (restored from a run with another N) or the mini-batch's
        weight is not positive: then as N > 1 (applied with the open window, or
        skipped)."""
        use_window = window.count.read_value() > 0
        if weight is not None:
            use_window = tf.logical_or(use_window, tf.cast(weight, tf.float64) <= 0)
        return tf.cond(
            use_window,
            lambda: self._accumulate_then(pairs, window, global_step, weight, caller_scope,
                                          apply_when_full=True),
            lambda: self._apply_or_skip(pairs, window, global_step, reset=list,
                                        caller_scope=caller_scope))

    def _accumulate(self, window, grad, var, weight):
        """Adds weight * grad to var's accumulator; sparse rows by scatter_add."""
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

    def _apply_window(self, window, global_step, caller_scope):
        """The mean of the window, applied by the wrapped optimizer; then a reset.

        Each dense accumulator is divided in place, one after another, and the wrapped
        optimizer reads the mean from it: one quotient the size of a variable alive at a
        time, and no copy of the window. Sparse accumulators are applied as IndexedSlices
        of the touched rows only, so a sparse-aware optimizer (Momentum, Adagrad...)
        leaves the other rows' slots alone, as it would for the whole batch at once; only
        those rows are reset.
        """
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
                    divided.append(acc.assign(acc.read_value() / total, read_value=False))
                with tf.control_dependencies(divided[-1:]):
                    grad = tf.cast(acc.read_value(), var.dtype.base_dtype)
                dense.append(acc)
            pairs.append((grad, var))

        def reset():
            # One after another, zeros written into each sum's buffer (not added: the
            # wrapped optimizer may have applied a non-finite mean, which no addition
            # zeroes).
            ops = zero_sums(dense)
            for r in resets:
                with tf.control_dependencies(ops[-1:]):
                    ops.append(r())
            return ops + [window.count.assign(0, read_value=False),
                          window.weight_sum.assign(0, read_value=False)]

        return self._apply_or_skip(pairs, window, global_step, reset, caller_scope,
                                   positive=weight_sum > 0)

    def _apply_or_skip(self, averaged, window, global_step, reset, caller_scope,
                       positive=None):
        """Transforms and applies the `averaged` pairs, then builds `reset()` after it.

        A window whose weights sum to zero or less (`positive` false) or, with
        check_finite, holds a non-finite value, only resets, and counts itself in
        skipped_windows.
        """
        pairs = list(self._transform(averaged)) if self._transform else averaged

        def apply():
            with v1.name_scope(caller_scope):
                applied = self._optimizer.apply_gradients(pairs, global_step=global_step)
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
    """The largest micro-batch B whose run of `train_op` (the AveragingOptimizer
    `optimizer`'s, in `session`) fits in the device's memory, for updates of E samples:
    micro_batch's one search (largest_that_fits) on runs of `train_op` on the first B
    samples of `feed` into an empty window (the update once: `flush_op` on a window of
    one sample), every global and local variable loaded back after each, so that training
    goes on as if nothing ran. Train each update as found.average_gradients runs of the
    op, the last on found.last samples, each mini-batch's samples its `weight`, then
    `flush_op`. `feed`: one batch's feed_dict (a value whose leading dimension is its
    samples is cut, repeated where a trial needs more; any other fed as it is); budget,
    margin: as micro_batch.find_micro_batch's; device: where the graph trains (None: the
    first GPU, else the CPU). Returns a micro_batch.MicroBatch. Raises ValueError (bad
    arguments, a device whose memory or peak cannot be read) and NothingFits."""
    start = time.perf_counter()
    device = device or device_lib.default_device()
    search = micro_batch_lib.Search.on_devices([device], effective_batch, budget, margin)
    search.start = start
    trials = _GraphTrials(session, optimizer, train_op, feed, device)
    trials.peak(1)  # the first run sets the graph up (Grappler allocates): not a trial
    return micro_batch_lib.largest_that_fits(trials.peak, trials.update, search).found()


class _GraphTrials:
    """find_micro_batch's trials on a TF1 graph: every variable loaded back after each."""

    def __init__(self, session, optimizer, train_op, feed, device):
        self.session, self.train_op, self.device = session, train_op, device
        with session.graph.as_default():
            self.variables = v1.global_variables() + v1.local_variables()
        self.saved = session.run(self.variables)
        self.values = {key: np.asarray(value) for key, value in feed.items()}
        self.samples = next((len(v) for v in self.values.values() if v.ndim), None)
        if not self.samples:
            raise ValueError("feed holds no batch: no value has a leading dimension of samples")
        self.count, self.flush = optimizer.window_count, optimizer.flush_op()

    def _restore(self):
        for variable, value in zip(self.variables, self.saved):
            variable.load(value, self.session)

    def _run(self, size):
        index = np.arange(size) % self.samples
        self.count.load(0, self.session)
        self.session.run(self.train_op, {
            key: value[index] if value.ndim and len(value) == self.samples else value
            for key, value in self.values.items()})

    def peak(self, size):
        try:
            return device_lib.measured_peak(lambda: self._run(size), [self.device])
        finally:
            self._restore()

    def update(self):
        try:
            self._run(1)
            return device_lib.measured_peak(lambda: self.session.run(self.flush),
                                            [self.device])
        finally:
            self._restore()
