"""The other TF1 accumulation strategies: where the window of N mini-batches lives.

Each applies exactly the post's update (trainer.GradientAverager, `stack`) and differs
only in where the window is kept: a numpy running sum (`running`), accumulator
variables in the graph, applied by a run of its own (`graph`) or by the Nth mini-batch's
run (`optimizer`, trainer.AveragingOptimizer's train op), or the window's inputs, run as
one session call per update (`fused`). Each is an interfaces.Averager, as
GradientAverager is; registry.STRATEGIES names them for --accumulate (a name and a line
of help there, the class here: docs/extending.md).
"""

import numpy as np
import tensorflow as tf

import registry
import trainer
from averaging_optimizer import accumulator_dtype, all_finite
from interfaces import Averager, Outcome

v1 = tf.compat.v1

STRATEGIES = tuple(registry.STRATEGIES)
# Micro-batches the fused loop runs at once. With 1, small kernels leave a core idle;
# with 2, one micro-batch's forward pass overlaps the previous one's backward pass:
# measured here, fused trained N=5 x B=20 in 1.25x to 1.4x direct's time, against 1.8x
# with 1, for the activations of one more micro-batch. The sums still add up in order.
FUSED_PARALLEL_ITERATIONS = 2
# TensorFlow feeds a numpy array without copying it when its data is this aligned.
FEED_ALIGNMENT = 64


def make_averager(strategy, loss, optimizer, num_batches, var_list=None, global_step=None,
                  loss_fn=None, inputs=None, check_finite=False):
    """Builds the named strategy; `fused` also needs `loss_fn` and `inputs`.

    With N == 1 every strategy is the post's `optimizer.minimize(loss)`.
    """
    if strategy not in registry.STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; choose from {', '.join(STRATEGIES)}")
    cls = registry.STRATEGIES[strategy].load() if num_batches != 1 else trainer.GradientAverager
    if cls.BUILDS_FROM_LOSS_FN:
        if loss_fn is None or inputs is None:
            raise ValueError(f"the {strategy} strategy needs loss_fn and inputs")
        return cls(loss_fn, inputs, optimizer, num_batches, var_list, global_step, check_finite)
    return cls(loss, optimizer, num_batches, var_list, global_step, check_finite)


def _check_window(num_batches):
    if num_batches == 1:
        raise ValueError("N == 1 has no window; make_averager builds GradientAverager")


class RunningSumAverager(trainer.GradientAverager):
    """`running`: the post's graph, the window one numpy sum per variable (O(params)).

    The ops are GradientAverager's (`grad_op`, the placeholders, `apply_op`), and so is
    the step; only the window differs: each mini-batch's gradients are added into the
    sum as they come; float16 and bfloat16 gradients into a float32 sum, which 20
    gradients of 4e3 do not overflow.
    """

    def __init__(self, loss, optimizer, num_batches, var_list=None, global_step=None,
                 check_finite=False):
        _check_window(num_batches)
        super().__init__(loss, optimizer, num_batches, var_list, global_step, check_finite)
        self._sum_types = [accumulator_dtype(g).as_numpy_dtype for g in self.grad_op]
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
    """`graph`: the window in variables (trainer.AveragingOptimizer's); N + 1 runs.

    Each mini-batch runs `[loss, accumulate_op]`, which adds its gradients to the
    accumulators (float32 for float16 and bfloat16 gradients); after N, `apply_op`
    applies their mean and resets them. The window (accumulators, count, weight sum,
    discarded windows) is variables in a name scope of their own, so two averagers
    share a graph under any variable scope or reuse, a Saver keeps the open window, and
    the count a step closes on is the variable's, read after the run: what a checkpoint
    restored. With check_finite a window whose mean holds a NaN or Inf is discarded.
    """

    APPLIES_IN_STEP = False

    def __init__(self, loss, optimizer, num_batches, var_list=None, global_step=None,
                 check_finite=False):
        super().__init__(num_batches)
        _check_window(num_batches)
        self.loss = loss
        self.optimizer = trainer.AveragingOptimizer(optimizer, num_batches, check_finite)
        pairs = optimizer.compute_gradients(loss, var_list=var_list)
        if self.APPLIES_IN_STEP:
            step_op = self.optimizer.apply_gradients(pairs, global_step=global_step)
        else:
            step_op = self.optimizer.accumulate_gradients(pairs, global_step=global_step)
        # (mini-batches in the window, windows discarded), read after the op has run
        self.step_op = self._then_read_window(step_op)
        self.apply_op = self._then_read_window(self.optimizer.flush_op())
        self._count = 0  # the window's count as last read
        self._skipped = 0  # the optimizer's discarded windows as last read

    def _then_read_window(self, op):
        with tf.control_dependencies([op]):
            return [self.optimizer.window_count.read_value(),
                    self.optimizer.skipped_windows.read_value()]

    def step(self, sess, feed_dict):
        loss, window = sess.run([self.loss, self.step_op], feed_dict)
        closed = self._read(window)
        if self._count >= self.num_batches:
            closed = self._read(sess.run(self.apply_op))
        return [loss], closed

    def _read(self, window):
        """The Outcome the run that read `window` (count, discarded so far) had."""
        count, skipped = (int(value) for value in window)
        discarded, self._count, self._skipped = skipped > self._skipped, count, skipped
        return Outcome.NONE if count else self._closed(not discarded)

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
    """`optimizer`: trainer.AveragingOptimizer's train op as it is: N runs per update.

    Each mini-batch runs `[loss, train_op]`; the Nth run also applies the mean and
    resets the window, as in a user's TF1 loop; `flush` runs its flush_op.
    """

    APPLIES_IN_STEP = True


class FusedAverager(Averager):
    """`fused`: one session call per update, an in-graph loop over the micro-batches.

    The N micro-batches are fed together, stacked on a new leading axis (shorter ones
    padded); a `tf.while_loop` (FUSED_PARALLEL_ITERATIONS micro-batches in flight, so
    peak activation memory is that of two micro-batches, not of N) computes each
    micro-batch's gradients with the optimizer's own compute_gradients and adds them up,
    in order, float16 and bfloat16 into float32 sums; the mean is applied in the same
    call. Micro-batches of unequal sizes n_k are weighted: sum(n_k g_k) / sum(n_k).
    Host memory holds only the window's inputs.
    """

    BUILDS_FROM_LOSS_FN = True

    def __init__(self, loss_fn, inputs, optimizer, num_batches, var_list=None,
                 global_step=None, check_finite=False):
        """Builds the ops in the default graph.

        Args:
          loss_fn: maps tensors shaped like `inputs` (one micro-batch) to a scalar loss,
            building the model again: variables it creates with tf.Variable are the
            model's existing ones, handed out in creation order; get_variable must reuse
            (e.g. AUTO_REUSE).
          inputs: the per-micro-batch placeholders that `step`'s feed_dict fills; those
            with an unknown leading dimension hold the samples (counted for the weights);
            other keys of the feed_dict (e.g. a `training` flag) are passed through.
          optimizer, num_batches, var_list, global_step, check_finite: as for
            trainer.GradientAverager.
        """
        super().__init__(num_batches)
        _check_window(num_batches)
        self.inputs = list(inputs)
        self.variables = list(v1.trainable_variables() if var_list is None else var_list)
        existing = v1.global_variables()
        self.window_inputs = [
            v1.placeholder(p.dtype, [None] + p.shape.as_list(), name="window_" + p.op.name)
            for p in self.inputs]
        self._batched = [bool(p.shape.rank) and tf.compat.dimension_value(p.shape[0]) is None
                         for p in self.inputs]
        # Samples per micro-batch; weights n_k / max(n): exactly 1.0 where all are equal.
        self.sizes = v1.placeholder(tf.int32, [None], name="window_sizes")
        num_micro = tf.shape(self.sizes)[0]
        weights = tf.cast(self.sizes, tf.float64) / tf.cast(tf.reduce_max(self.sizes),
                                                            tf.float64)
        no_gradient = []

        def body(i, losses, sums):
            micro = [w[i][:self.sizes[i]] if batched else w[i]
                     for w, batched in zip(self.window_inputs, self._batched)]
            with _reusing(existing):
                loss = loss_fn(*micro)
            pairs = optimizer.compute_gradients(loss * tf.cast(weights[i], loss.dtype),
                                                var_list=self.variables)
            no_gradient[:] = [g is None for g, _ in pairs]
            grads = [tf.zeros_like(s) if g is None else tf.cast(tf.convert_to_tensor(g), s.dtype)
                     for (g, _), s in zip(pairs, sums)]
            return (i + 1, losses.write(i, tf.cast(loss, tf.float32)),
                    [s + g for s, g in zip(sums, grads)])

        zeros = [tf.zeros(v.shape, accumulator_dtype(v)) for v in self.variables]
        _, losses, sums = tf.while_loop(
            lambda i, *_: i < num_micro, body,
            [tf.constant(0), tf.TensorArray(tf.float32, size=num_micro), zeros],
            parallel_iterations=FUSED_PARALLEL_ITERATIONS)
        weight_sum = tf.reduce_sum(weights)
        pairs = [(tf.cast(s / tf.cast(weight_sum, s.dtype), v.dtype.base_dtype), v)
                 for s, v, none in zip(sums, self.variables, no_gradient) if not none]
        if not pairs:
            raise ValueError("no variable receives a gradient from the loss")
        self.variables = [v for _, v in pairs]
        self.losses = losses.stack()
        # A sum is finite only if every gradient in it was: checking the sums suffices.
        if check_finite:
            self.finite = all_finite([self.losses] + [s for s, _ in pairs])
            self.apply_op = trainer.apply_if(self.finite, lambda: optimizer.apply_gradients(
                pairs, global_step=global_step))
        else:
            self.finite = tf.constant(True)
            self.apply_op = optimizer.apply_gradients(pairs, global_step=global_step)
        self._window = []  # the feed dicts of the open window

    def step(self, sess, feed_dict):
        """Keeps the micro-batch; at N runs the whole update in one call.

        Returns:
          (losses, outcome): the window's N losses where it ran, else [].
        """
        self._window.append(feed_dict)
        if len(self._window) == self.num_batches:
            return self._run_window(sess)
        return [], Outcome.NONE

    def _run_window(self, sess):
        try:  # whatever happens, the next step starts a new window
            feed = dict(self._window[-1])
            for p, w in zip(self.inputs, self.window_inputs):
                del feed[p]
                feed[w] = aligned_stack([f[p] for f in self._window])
            feed[self.sizes] = self._sizes()
            losses, _, finite = sess.run([self.losses, self.apply_op, self.finite], feed)
        finally:
            self._window = []
        return list(losses), self._closed(finite)

    def _sizes(self):
        """Samples of each micro-batch: the leading dimension of its first batched input."""
        batched = [p for p, b in zip(self.inputs, self._batched) if b]
        return np.array([len(f[batched[0]]) if batched else 1 for f in self._window], np.int32)

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


def aligned_stack(arrays):
    """np.stack into a FEED_ALIGNMENT-aligned buffer; shorter arrays zero-padded.

    A session copies a fed array that is not so aligned (numpy's usually is not); fed
    aligned, the window's inputs are not copied again (measured: at N=128 x B=128, a
    window of 51 MB of images, the fused run's peak RSS fell from +230 MB to +142 MB).
    """
    arrays = [np.asarray(a) for a in arrays]
    first = arrays[0]
    length = max(len(a) for a in arrays) if first.ndim else None
    shape = (len(arrays),) + ((length,) + first.shape[1:] if first.ndim else ())
    nbytes = int(np.prod(shape)) * first.dtype.itemsize
    raw = np.empty(nbytes + FEED_ALIGNMENT, np.uint8)
    start = -raw.ctypes.data % FEED_ALIGNMENT
    out = raw[start:start + nbytes].view(first.dtype).reshape(shape)
    if all(a.shape == first.shape for a in arrays):
        return np.stack(arrays, out=out)
    out[...] = 0
    for k, a in enumerate(arrays):
        out[k, :len(a)] = a
    return out
