"""The experiment's other TF1 averagers: where the window of N mini-batches lives.

Each applies exactly the post's update (trainer.GradientAverager, `stack`) and differs
only in where the window is kept: a numpy running sum (`running`), accumulator
variables in the graph, applied by a run of its own (`graph`) or by the Nth mini-batch's
run (`optimizer`, the library's AveragingOptimizer train op), or the window's inputs, run
as one session call per update (`fused`). Each is a trainer.Averager, as
GradientAverager is; config.AVERAGERS names them for --accumulate (a name and a line of
help there, the class here: docs/extending.md).
"""

import numpy as np
import tensorflow as tf

import trainer
from experiment import config
from gradient_averaging import AveragingOptimizer
from gradient_averaging import window as window_lib
from trainer import Averager
from trainer import Outcome

v1 = tf.compat.v1

AVERAGERS = tuple(config.AVERAGERS)


def make_averager(name, loss, optimizer, average_gradients, var_list=None, global_step=None,
                  loss_fn=None, inputs=None, check_finite=True):
    """Builds the named averager; `fused` also needs `loss_fn` and `inputs`.

    With N == 1 every averager is the post's `optimizer.minimize(loss)`.
    """
    if name not in config.AVERAGERS:
        raise ValueError(f"unknown averager {name!r}; choose from {', '.join(AVERAGERS)}")
    cls = config.AVERAGERS[name].load() if average_gradients != 1 else trainer.GradientAverager
    if getattr(cls, "BUILDS_FROM_LOSS_FN", False):
        if loss_fn is None or inputs is None:
            raise ValueError(f"the {name} averager needs loss_fn and inputs")
        return cls(loss_fn, inputs, optimizer, average_gradients, var_list, global_step,
                   check_finite)
    return cls(loss, optimizer, average_gradients, var_list, global_step, check_finite)


def _check_window(average_gradients):
    if average_gradients == 1:
        raise ValueError("N == 1 has no window; make_averager builds GradientAverager")


class RunningSumAverager(trainer.GradientAverager):
    """`running`: the post's graph, the window one numpy sum per variable (O(params)).

    The ops are GradientAverager's (`grad_op`, the placeholders, `apply_op`), and so is
    the step; only the window differs: each mini-batch's gradients are added into the
    sum as they come; float16 and bfloat16 gradients into a float32 sum, which 20
    gradients of 4e3 do not overflow.
    """

    def __init__(self, loss, optimizer, average_gradients, var_list=None, global_step=None,
                 check_finite=True):
        _check_window(average_gradients)
        super().__init__(loss, optimizer, average_gradients, var_list, global_step, check_finite)
        self._sum_types = [window_lib.accumulator_dtype(g).as_numpy_dtype for g in self.grad_op]
        self._sum, self._count = None, 0

    def _add(self, grads):
        if self._sum is None:  # fresh arrays from sess.run (or casts), ours to update
            self._sum = [np.asarray(g, t) for g, t in zip(grads, self._sum_types)]
        else:
            for total, g in zip(self._sum, grads):
                np.add(total, g, out=total)
        self._count += 1

    def _mean(self):
        return [(total / np.asarray(self._count, total.dtype)).astype(
            p.dtype.as_numpy_dtype, copy=False) for total, p in zip(self._sum,
                                                                    self.grad_placeholders)]

    def _clear(self):
        self._sum, self._count, self._bad = None, 0, False

    def window_size(self):
        return self._count

    def window_state(self):
        return dict({f"sum|{i}": s for i, s in enumerate(self._sum or [])},
                    count=np.array(self._count), bad=np.array(self._bad))

    def restore_window(self, sess, state):
        self._count, self._bad = int(state["count"]), bool(state["bad"])
        sums = [key for key in state if key.startswith("sum|")]
        self._sum = [state[f"sum|{i}"] for i in range(len(sums))] if sums else None


class GraphAverager(Averager):
    """`graph`: the window in variables (AveragingOptimizer's); N + 1 runs.

    Each mini-batch runs `[loss, accumulate_op]`, which adds its gradients to the
    accumulators (float32 for float16 and bfloat16 gradients); after N, `apply_op`
    applies their mean and resets them. The window (accumulators, count, weight sum,
    skipped windows) is variables in a name scope of their own, so two averagers
    share a graph under any variable scope or reuse, a Saver keeps the open window, and
    the count a step closes on is the variable's, read after the run: what a checkpoint
    restored. With check_finite a window whose mean holds a NaN or Inf is skipped.
    """

    APPLIES_IN_STEP = False

    def __init__(self, loss, optimizer, average_gradients, var_list=None, global_step=None,
                 check_finite=True):
        super().__init__(average_gradients)
        _check_window(average_gradients)
        self.loss = loss
        self.optimizer = AveragingOptimizer(optimizer, average_gradients, check_finite)
        pairs = optimizer.compute_gradients(loss, var_list=var_list)
        if self.APPLIES_IN_STEP:
            step_op = self.optimizer.apply_gradients(pairs, global_step=global_step)
        else:
            step_op = self.optimizer.accumulate_gradients(pairs, global_step=global_step)
        # (mini-batches in the window, windows skipped), read after the op has run
        self.step_op = self._then_read_window(step_op)
        self.apply_op = self._then_read_window(self.optimizer.flush_op())
        self._count = 0  # the window's count as last read
        self._skipped = 0  # the optimizer's skipped windows as last read

    def _then_read_window(self, op):
        with tf.control_dependencies([op]):
            return [self.optimizer.window_count.read_value(),
                    self.optimizer.skipped_windows.read_value()]

    def step(self, sess, feed_dict):
        loss, window = sess.run([self.loss, self.step_op], feed_dict)
        closed = self._read(window)
        if self._count >= self.average_gradients:
            closed = self._read(sess.run(self.apply_op))
        return [loss], closed

    def _read(self, window):
        """The Outcome the run that read `window` (count, skipped so far) had."""
        count, skipped = (int(value) for value in window)
        skipped_one, self._count, self._skipped = skipped > self._skipped, count, skipped
        return Outcome.NONE if count else self._closed(not skipped_one)

    def flush(self, sess):
        return [], (self._read(sess.run(self.apply_op)) if self._count else Outcome.NONE)

    def window_size(self):
        return self._count

    def window_state(self):
        # The window is variables, in the Saver's file; the count only for window_size
        # until the next step reads it back.
        return {"count": np.array(self._count), "bad": np.array(False)}

    def restore_window(self, sess, state):
        """The window is the restored variables; the last reads are taken from them."""
        with sess.graph.as_default():  # the optimizer finds its window by the graph
            window = [self.optimizer.window_count, self.optimizer.skipped_windows]
        self._read(sess.run(window))


class OptimizerAverager(GraphAverager):
    """`optimizer`: AveragingOptimizer's train op as it is: N runs per update.

    Each mini-batch runs `[loss, train_op]`; the Nth run also applies the mean and
    resets the window, as in a user's TF1 loop; `flush` runs its flush_op.
    """

    APPLIES_IN_STEP = True


class FusedAverager(Averager):
    """`fused`: one session call per update, the window loop in the graph.

    The N mini-batches are fed together, stacked on a new leading axis (shorter ones
    padded); a TF1 window loop in the graph (_sum_window: one
    mini-batch at a time, so the activations held are one mini-batch's, not N's) computes
    each mini-batch's gradients with the optimizer's own compute_gradients and adds them
    up, in order, float16 and bfloat16 into float32 sums; the mean is applied in the same
    call. Mini-batches of unequal sizes n_k are weighted: sum(n_k g_k) / sum(n_k). Host
    memory holds only the window's inputs.
    """

    BUILDS_FROM_LOSS_FN = True

    def __init__(self, loss_fn, inputs, optimizer, average_gradients, var_list=None,
                 global_step=None, check_finite=True):
        """Builds the ops in the default graph. `loss_fn` maps tensors like `inputs` (one
        mini-batch's placeholders; those with an unknown leading dimension hold samples)
        to a scalar loss, building the model again on its existing variables (handed out
        in creation order; get_variable must reuse). The rest as trainer.GradientAverager's.
        """
        super().__init__(average_gradients)
        _check_window(average_gradients)
        self.inputs = list(inputs)
        self.variables = list(v1.trainable_variables() if var_list is None else var_list)
        existing = v1.global_variables()
        self.window_inputs = [
            v1.placeholder(p.dtype, [None] + p.shape.as_list(), name="window_" + p.op.name)
            for p in self.inputs]
        self._batched = [bool(p.shape.rank) and tf.compat.dimension_value(p.shape[0]) is None
                         for p in self.inputs]
        # Samples per mini-batch; weights n_k / max(n): exactly 1.0 where all are equal.
        self.sizes = v1.placeholder(tf.int32, [None], name="window_sizes")
        weights = tf.cast(self.sizes, tf.float64) / tf.cast(tf.reduce_max(self.sizes),
                                                            tf.float64)
        no_gradient = []

        def mini_batch(i, batch, losses):
            with _reusing(existing):
                loss = loss_fn(*batch)
            pairs = optimizer.compute_gradients(loss * tf.cast(weights[i], loss.dtype),
                                                var_list=self.variables)
            no_gradient[:] = [g is None for g, _ in pairs]
            grads = [None if g is None else tf.convert_to_tensor(g) for g, _ in pairs]
            return grads, losses.write(i, tf.cast(loss, tf.float32))

        zeros = [tf.zeros(v.shape, window_lib.accumulator_dtype(v)) for v in self.variables]
        sums, losses = _sum_window(
            mini_batch, zeros, tf.TensorArray(tf.float32, size=tf.shape(self.sizes)[0]),
            [w if batched else _Unbatched(w)
             for w, batched in zip(self.window_inputs, self._batched)], self.sizes)
        weight_sum = tf.reduce_sum(weights)
        pairs = [(tf.cast(s / tf.cast(weight_sum, s.dtype), v.dtype.base_dtype), v)
                 for s, v, none in zip(sums, self.variables, no_gradient) if not none]
        if not pairs:
            raise ValueError("no variable receives a gradient from the loss")
        self.variables = [v for _, v in pairs]
        self.losses = losses.stack()
        # A sum is finite only if every gradient in it was: checking the sums suffices.
        if check_finite:
            self.finite = window_lib.all_finite([self.losses] + [s for s, _ in pairs])
            self.apply_op = trainer.apply_if(self.finite, lambda: optimizer.apply_gradients(
                pairs, global_step=global_step))
        else:
            self.finite = tf.constant(True)
            self.apply_op = optimizer.apply_gradients(pairs, global_step=global_step)
        self._window = []  # the feed dicts of the open window

    def step(self, sess, feed_dict):
        """Keeps the mini-batch; at N runs the whole update in one call.

        Returns:
          (losses, outcome): the window's N losses where it ran, else [].
        """
        self._window.append(feed_dict)
        if len(self._window) == self.average_gradients:
            return self._run_window(sess)
        return [], Outcome.NONE

    def _run_window(self, sess):
        try:  # whatever happens, the next step starts a new window
            feed = dict(self._window[-1])
            sizes = None  # each mini-batch's samples: its first batched input's
            for p, w, batched in zip(self.inputs, self.window_inputs, self._batched):
                del feed[p]
                feed[w], samples = window_lib.stack_padded(
                    [f[p] for f in self._window], alignment=window_lib.FEED_ALIGNMENT)
                if batched and sizes is None:
                    sizes = samples
            feed[self.sizes] = np.ones(len(self._window), np.int32) if sizes is None else sizes
            losses, _, finite = sess.run([self.losses, self.apply_op, self.finite], feed)
        finally:
            self._window = []
        return list(losses), self._closed(finite)

    def flush(self, sess):
        return self._run_window(sess) if self._window else ([], Outcome.NONE)

    def window_size(self):
        return len(self._window)

    def window_state(self):
        return dict({f"feed|{k}|{key.name}": np.asarray(value)
                     for k, feed in enumerate(self._window) for key, value in feed.items()},
                    bad=np.array(False))  # a NaN shows only when the window runs

    def restore_window(self, sess, state):
        self._window = []
        for name, value in state.items():
            if name == "bad":
                continue
            _, k, tensor_name = name.split("|", 2)
            while len(self._window) <= int(k):
                self._window.append({})
            self._window[int(k)][sess.graph.get_tensor_by_name(tensor_name)] = value


def _sum_window(mini_batch_gradients, sums, state, data, sizes):
    """FusedAverager's window loop: sums each mini-batch's gradients in order, as loop values
    (without automatic control dependencies, a graph cannot order in-place additions). Returns
    (sums, state); at most window.PARALLEL_ITERATIONS mini-batches' activations held at once.

    Args:
      mini_batch_gradients: (i, batch, state) -> (gradients, state), a gradient None where the
        loss does not reach it; `batch`: `data` sliced [i, :sizes[i]] (an `_Unbatched`: [i]).
      sums: a zero tensor per gradient, in its sum's dtype.
      data: a nested structure of stacked tensors, [N, B, ...], or `_Unbatched` ones [N, ...].
    """
    def body(i, state, sums):
        batch = tf.nest.map_structure(
            lambda t: t.values[i] if isinstance(t, _Unbatched) else t[i, :sizes[i]], data)
        gradients, state = mini_batch_gradients(i, batch, state)
        sums = [s if g is None else s + tf.cast(g, s.dtype) for s, g in zip(sums, gradients)]
        return i + 1, state, sums

    _, state, sums = tf.while_loop(
        lambda i, *_: i < tf.shape(sizes)[0], body, (tf.constant(0), state, list(sums)),
        parallel_iterations=window_lib.PARALLEL_ITERATIONS)
    return sums, state


class _Unbatched:
    """Per-mini-batch values without a sample axis (a seed each): _sum_window hands i its row."""

    def __init__(self, values):
        self.values = values


def _reusing(existing):
    """A scope in which creating a variable returns the next of `existing` instead.

    So a loss_fn that builds its model with tf.Variable (which ignores variable-scope
    reuse) trains the model's variables: each creation takes the first unused variable
    of `existing` (in creation order) with its trainability, dtype and shape.
    """
    unused = list(existing)

    def creator(unused_next_creator, **kwargs):
        initial = kwargs.get("initial_value")
        shape = kwargs.get("shape")
        if shape is None and initial is not None and not callable(initial):
            shape = tf.convert_to_tensor(initial).shape
        dtype = kwargs.get("dtype")
        trainable = kwargs.get("trainable") in (None, True)
        for var in unused:
            if (var.trainable == trainable
                    and (dtype is None or var.dtype.base_dtype == tf.as_dtype(dtype).base_dtype)
                    and (shape is None or tf.TensorShape(shape).is_compatible_with(var.shape))):
                unused.remove(var)
                return var
        raise ValueError(f"loss_fn creates a variable ({kwargs.get('name')}, shape {shape}) "
                         "that the model built before it does not have")

    return tf.variable_creator_scope(creator)
