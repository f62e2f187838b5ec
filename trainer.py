"""Gradient averaging for TF1 graphs: apply the mean gradient of N mini-batches.

The post's mechanism, usable on any graph (it knows nothing about MNIST):

    averager = GradientAverager(loss, tf.compat.v1.train.AdamOptimizer(1e-3), 5)
    ...
    for batch in batches:
        averager.step(sess, {x: batch.x, y: batch.y})   # applies every 5th call
    averager.flush(sess)                                # a trailing partial window

With N == 1 it is plain `optimizer.minimize(loss)`. With N > 1:
  * `grad_op`: the gradient tensors from `optimizer.compute_gradients(loss)`,
  * `grad_placeholders`: one placeholder per gradient, same dtype and shape,
  * `apply_op`: `optimizer.apply_gradients(zip(grad_placeholders, variables))`,
and `step` runs `[loss, grad_op]`, keeps the numpy gradients, and when it holds N of
them feeds `average_gradients(window)` into the placeholders and runs `apply_op`.

The other strategies (`STRATEGIES`) apply exactly the same update and differ only in
where the window lives: a numpy running sum (`running`), accumulator variables in the
graph (`graph`), or one session call per update with an in-graph loop over the
micro-batches (`fused`). All of them share `step(sess, feed_dict)`, `flush(sess)`, and
`window_state()` / `restore_window(...)` for checkpoints.

With `check_finite=True`, a window in which any loss or gradient is NaN or Inf is
discarded whole instead of applied (counted in `skipped_windows`).
"""

import numpy as np
import tensorflow as tf

from averaging_optimizer import AveragingOptimizer  # noqa: F401  (trainer.AveragingOptimizer)

v1 = tf.compat.v1

# Micro-batches the fused loop runs at once. With 1, small kernels leave a core idle;
# with 2, one micro-batch's forward pass overlaps the previous one's backward pass:
# measured here, fused trained N=5 x B=20 in 1.25x to 1.4x direct's time, against 1.8x
# with 1, for the activations of one more micro-batch. The sums still add up in order.
FUSED_PARALLEL_ITERATIONS = 2
# TensorFlow feeds a numpy array without copying it when its data is this aligned.
FEED_ALIGNMENT = 64


def average_gradients(window):
    """The post's mean: stack each variable's N gradients and average them.

    Args:
      window: N lists of numpy arrays; window[k][i] is mini-batch k's gradient of
        variable i, shaped like variable i.

    Returns:
      A list with one array per variable: np.stack([w[i] for w in window]).mean(0).
    """
    return [np.stack(grads, axis=0).mean(axis=0) for grads in zip(*window)]


def _gradients_and_variables(loss, optimizer, var_list):
    """(grad, var) pairs from compute_gradients, without variables that get no gradient."""
    pairs = optimizer.compute_gradients(loss, var_list=var_list)
    pairs = [(tf.convert_to_tensor(g), v) for g, v in pairs if g is not None]
    if not pairs:
        raise ValueError("no variable receives a gradient from the loss")
    return pairs


def _all_finite(tensors):
    return tf.reduce_all(tf.stack([tf.reduce_all(tf.math.is_finite(t)) for t in tensors]))


def _guarded(finite, apply_fn):
    """Runs the update built by `apply_fn` only where `finite` is True."""
    return tf.cond(finite, lambda: tf.group(apply_fn()), tf.no_op)


def _check_n(average_gradients):
    if average_gradients < 1:
        raise ValueError(f"average_gradients must be >= 1, got {average_gradients}")


def _aligned_stack(arrays):
    """np.stack into a FEED_ALIGNMENT-aligned buffer.

    A session copies a fed array that is not so aligned (numpy's usually is not); fed
    aligned, the window's inputs are not copied again (measured: at N=128 x B=128, a
    window of 51 MB of images, the fused run's peak RSS fell from +230 MB to +142 MB).
    """
    first = np.asarray(arrays[0])
    shape = (len(arrays),) + first.shape
    nbytes = int(np.prod(shape)) * first.dtype.itemsize
    raw = np.empty(nbytes + FEED_ALIGNMENT, np.uint8)
    start = -raw.ctypes.data % FEED_ALIGNMENT
    out = raw[start:start + nbytes].view(first.dtype).reshape(shape)
    return np.stack(arrays, out=out)


class GradientAverager:
    """The post's strategy (`stack`): N numpy gradient lists, stacked and averaged.

    Attributes:
      grad_op: list of gradient tensors (N > 1).
      grad_placeholders: one placeholder per gradient (N > 1).
      apply_op: applies the gradients fed to the placeholders (N > 1).
      train_op: `optimizer.minimize(loss)` (N == 1).
      finite: bool tensor, whether this mini-batch's loss and gradients are finite.
      updates: optimizer updates applied so far.
      skipped_windows: windows discarded for a non-finite value (check_finite).
    """

    def __init__(self, loss, optimizer, average_gradients, var_list=None, global_step=None,
                 check_finite=False):
        """Builds the ops in the default graph.

        Args:
          loss: scalar loss tensor of one mini-batch.
          optimizer: a tf.compat.v1.train.Optimizer.
          average_gradients: N, the number of mini-batches per update.
          var_list: variables to train; default all trainable ones. Variables whose
            gradient is None are skipped.
          global_step: optional variable incremented once per update.
          check_finite: discard windows holding a NaN or Inf loss or gradient.
        """
        _check_n(average_gradients)
        self.average_gradients = average_gradients
        self.loss = loss
        self.check_finite = check_finite
        self.updates = self.skipped_windows = 0
        if average_gradients == 1:
            if check_finite:  # minimize's two halves, the apply guarded
                pairs = _gradients_and_variables(loss, optimizer, var_list)
                self.finite = _all_finite([loss] + [g for g, _ in pairs])
                self.train_op = _guarded(self.finite, lambda: optimizer.apply_gradients(
                    pairs, global_step=global_step))
            else:
                self.train_op = optimizer.minimize(loss, var_list=var_list,
                                                   global_step=global_step)
                self.finite = tf.constant(True)
            self._start_window()
            return
        pairs = _gradients_and_variables(loss, optimizer, var_list)
        self.variables = [v for _, v in pairs]
        self.grad_op = [g for g, _ in pairs]
        self.finite = _all_finite([loss] + self.grad_op) if check_finite else tf.constant(True)
        self._build_update(optimizer, pairs, global_step)
        self._start_window()

    def _build_update(self, optimizer, pairs, global_step):
        """The ops of one update: here placeholders for the mean and `apply_op`."""
        self.grad_placeholders = [
            v1.placeholder(g.dtype, g.shape, name="mean_" + v.op.name.replace("/", "_"))
            for g, v in pairs]
        self.apply_op = optimizer.apply_gradients(
            zip(self.grad_placeholders, self.variables), global_step=global_step)
        self.minibatch_op = self.grad_op

    # ------------------------------------------------ the window, as this strategy keeps it

    def _start_window(self):
        self._bad = False
        self._build_window()

    def _build_window(self):
        self._window = []

    def window_size(self):
        """Mini-batches collected towards the next update."""
        return len(self._window) if self.average_gradients > 1 else 0

    def _collect(self, grads):
        self._window.append(grads)

    def _apply_window(self, sess):
        mean = average_gradients(self._window)
        sess.run(self.apply_op, feed_dict=dict(zip(self.grad_placeholders, mean)))

    def _discard_window(self, sess):
        """Drops the window's contents (the caller starts a new one)."""

    def _window_arrays(self):
        return {f"grad|{k}|{i}": g for k, grads in enumerate(self._window)
                for i, g in enumerate(grads)}

    def _restore_window_arrays(self, arrays, graph):
        for key in sorted(arrays, key=lambda k: tuple(int(p) for p in k.split("|")[1:])):
            k, i = (int(p) for p in key.split("|")[1:])
            if i == 0:
                self._window.append([])
            self._window[k].append(arrays[key])

    # ------------------------------------------------ the shared interface

    def step(self, sess, feed_dict):
        """Runs one mini-batch; applies the update when the window holds N.

        Returns:
          The training losses that became known in this call (one here).
        """
        if self.average_gradients == 1:
            loss, _, finite = sess.run([self.loss, self.train_op, self.finite], feed_dict)
            if finite:
                self.updates += 1
            else:
                self.skipped_windows += 1
            return [loss]
        loss, fetched, finite = sess.run([self.loss, self.minibatch_op, self.finite],
                                         feed_dict)
        self._collect(fetched)
        self._bad = self._bad or not finite
        if self.window_size() == self.average_gradients:
            self.apply(sess)
        return [loss]

    def apply(self, sess):
        """Applies the mean of the open window (full or partial) and starts a new one.

        A window that saw a non-finite value is discarded instead.

        Returns:
          The losses that became known in this call (the fused strategy's).
        """
        if self._bad:
            self._discard_window(sess)
            self.skipped_windows += 1
        else:
            self._apply_window(sess)
            self.updates += 1
        self._start_window()
        return []

    def flush(self, sess):
        """Applies a trailing partial window, if any; returns how many mini-batches it held."""
        held = self.window_size()
        if held:
            self.apply(sess)
        return held

    def window_state(self):
        """The open window as named numpy arrays, for a checkpoint."""
        return dict(self._window_arrays(), bad=np.array(self._bad))

    def restore_window(self, state, graph):
        """Reopens a window saved by `window_state` (in a graph built the same way)."""
        self._start_window()
        self._bad = bool(state["bad"])
        self._restore_window_arrays({k: v for k, v in state.items() if k != "bad"}, graph)


class RunningSumAverager(GradientAverager):
    """`running`: one numpy buffer per variable holds the sum; host memory O(params)."""

    def _build_window(self):
        self._sum, self._count = None, 0

    def window_size(self):
        return self._count

    def _collect(self, grads):
        if self._sum is None:
            self._sum = grads  # fresh arrays from sess.run, ours to update in place
        else:
            for total, g in zip(self._sum, grads):
                np.add(total, g, out=total)
        self._count += 1

    def _apply_window(self, sess):
        mean = [total / np.asarray(self._count, total.dtype) for total in self._sum]
        sess.run(self.apply_op, feed_dict=dict(zip(self.grad_placeholders, mean)))

    def _window_arrays(self):
        arrays = {f"sum|{i}": s for i, s in enumerate(self._sum or [])}
        return dict(arrays, count=np.array(self._count))

    def _restore_window_arrays(self, arrays, graph):
        self._count = int(arrays.pop("count"))
        if arrays:
            self._sum = [arrays[f"sum|{i}"] for i in range(len(arrays))]


class GraphAverager(GradientAverager):
    """`graph`: accumulator variables in the graph; no gradient leaves it.

    Each mini-batch runs `[loss, accumulate_op]` (assign_add into the accumulators);
    `apply_op` applies accumulators / count and resets them, in one op. Being
    variables, the accumulators are saved with the model by a tf.train.Saver.
    """

    def _build_update(self, optimizer, pairs, global_step):
        with v1.variable_scope("gradient_accumulators"):
            self.accumulators = [
                v1.get_variable(v.op.name.replace("/", "_"), shape=g.shape, dtype=g.dtype,
                                initializer=v1.zeros_initializer(), trainable=False)
                for g, v in pairs]
            self.count = v1.get_variable("count", shape=[], dtype=tf.int32,
                                         initializer=v1.zeros_initializer(), trainable=False)
        self.accumulate_op = tf.group(
            [a.assign_add(g) for a, g in zip(self.accumulators, self.grad_op)]
            + [self.count.assign_add(1)])
        self.reset_op = tf.group([a.assign(tf.zeros_like(a)) for a in self.accumulators]
                                 + [self.count.assign(0)])
        mean = [a / tf.cast(self.count, a.dtype) for a in self.accumulators]
        applied = optimizer.apply_gradients(zip(mean, self.variables), global_step=global_step)
        with tf.control_dependencies([applied]):
            self.apply_op = tf.group([a.assign(tf.zeros_like(a)) for a in self.accumulators]
                                     + [self.count.assign(0)])
        self.minibatch_op = self.accumulate_op

    def _build_window(self):
        self._count = 0  # mirrors the `count` variable without a session call

    def window_size(self):
        return self._count

    def _collect(self, unused_fetched):
        self._count += 1

    def _apply_window(self, sess):
        sess.run(self.apply_op)

    def _discard_window(self, sess):
        sess.run(self.reset_op)

    def _window_arrays(self):
        return {"count": np.array(self._count)}  # the sums are variables, in the Saver's file

    def _restore_window_arrays(self, arrays, graph):
        self._count = int(arrays["count"])


class FusedAverager(GradientAverager):
    """`fused`: one session call per update, an in-graph loop over the micro-batches.

    The N micro-batches are fed together, stacked on a new leading axis; a
    `tf.while_loop` (FUSED_PARALLEL_ITERATIONS micro-batches in flight, so peak
    activation memory is that of two micro-batches, not of N) computes each
    micro-batch's gradients and adds them up, in order; the mean is applied in the same
    call. Host memory holds only the window's inputs.
    """

    def __init__(self, loss_fn, inputs, optimizer, average_gradients, var_list=None,
                 global_step=None, check_finite=False):
        """Builds the ops in the default graph.

        Args:
          loss_fn: maps tensors shaped like `inputs` (one micro-batch) to a scalar loss;
            it must reuse the model's variables (e.g. get_variable with AUTO_REUSE).
          inputs: the per-micro-batch placeholders that `step`'s feed_dict fills;
            other keys of the feed_dict (e.g. a `training` flag) are passed through.
          optimizer, average_gradients, var_list, global_step, check_finite: as for
            GradientAverager.
        """
        _check_n(average_gradients)
        self.average_gradients = average_gradients
        self.check_finite = check_finite
        self.updates = self.skipped_windows = 0
        self.inputs = list(inputs)
        self.variables = list(v1.trainable_variables() if var_list is None else var_list)
        self.window_inputs = [
            v1.placeholder(p.dtype, [None] + p.shape.as_list(), name="window_" + p.op.name)
            for p in self.inputs]
        num_micro = tf.shape(self.window_inputs[0])[0]
        no_gradient = []

        def body(i, losses, sums):
            loss = loss_fn(*[w[i] for w in self.window_inputs])
            grads = tf.gradients(loss, self.variables)
            no_gradient[:] = [g is None for g in grads]
            grads = [tf.zeros_like(v) if g is None else tf.convert_to_tensor(g)
                     for g, v in zip(grads, self.variables)]
            return i + 1, losses.write(i, loss), [s + g for s, g in zip(sums, grads)]

        zeros = [tf.zeros(v.shape, v.dtype.base_dtype) for v in self.variables]
        _, losses, sums = tf.while_loop(
            lambda i, *_: i < num_micro, body,
            [tf.constant(0), tf.TensorArray(tf.float32, size=num_micro), zeros],
            parallel_iterations=FUSED_PARALLEL_ITERATIONS)
        pairs = [(s / tf.cast(num_micro, s.dtype), v)
                 for s, v, none in zip(sums, self.variables, no_gradient) if not none]
        if not pairs:
            raise ValueError("no variable receives a gradient from the loss")
        self.variables = [v for _, v in pairs]
        self.losses = losses.stack()
        # A sum is finite only if every gradient in it was: checking the sums suffices.
        self.finite = (_all_finite([self.losses] + [s for s, _ in pairs]) if check_finite
                       else tf.constant(True))
        if check_finite:
            self.apply_op = _guarded(self.finite, lambda: optimizer.apply_gradients(
                pairs, global_step=global_step))
        else:
            self.apply_op = optimizer.apply_gradients(pairs, global_step=global_step)
        self._start_window()

    def window_size(self):
        return len(self._window)

    def step(self, sess, feed_dict):
        """Keeps the micro-batch; at N runs the whole update in one call.

        Returns:
          The window's N losses when it ran, else an empty list.
        """
        self._collect(feed_dict)
        if self.window_size() == self.average_gradients:
            return self.apply(sess)
        return []

    def apply(self, sess):
        feed = dict(self._window[-1])
        for p, w in zip(self.inputs, self.window_inputs):
            del feed[p]
            feed[w] = _aligned_stack([f[p] for f in self._window])
        losses, _, finite = sess.run([self.losses, self.apply_op, self.finite], feed)
        if finite:
            self.updates += 1
        else:
            self.skipped_windows += 1
        self._start_window()
        return list(losses)

    def _window_arrays(self):
        return {f"feed|{k}|{key.name}": np.asarray(value)
                for k, feed in enumerate(self._window) for key, value in feed.items()}

    def _restore_window_arrays(self, arrays, graph):
        for name, value in arrays.items():
            _, k, tensor_name = name.split("|", 2)
            while len(self._window) <= int(k):
                self._window.append({})
            self._window[int(k)][graph.get_tensor_by_name(tensor_name)] = value


STRATEGIES = ("stack", "running", "graph", "fused")


def make_averager(strategy, loss, optimizer, average_gradients, var_list=None,
                  global_step=None, loss_fn=None, inputs=None, check_finite=False):
    """Builds the named strategy; `fused` also needs `loss_fn` and `inputs`.

    With N == 1 every strategy is the post's `optimizer.minimize(loss)`.
    """
    if strategy == "fused" and average_gradients > 1:
        if loss_fn is None or inputs is None:
            raise ValueError("the fused strategy needs loss_fn and inputs")
        return FusedAverager(loss_fn, inputs, optimizer, average_gradients, var_list,
                             global_step, check_finite)
    classes = {"stack": GradientAverager, "running": RunningSumAverager,
               "graph": GraphAverager, "fused": GradientAverager}
    if strategy not in classes:
        raise ValueError(f"unknown strategy {strategy!r}; choose from {', '.join(STRATEGIES)}")
    return classes[strategy](loss, optimizer, average_gradients, var_list, global_step,
                             check_finite)
