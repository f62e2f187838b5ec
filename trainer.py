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

With `check_finite=True`, a window in which any loss or gradient is NaN or Inf is
discarded whole instead of applied (counted in `skipped_windows`).

strategies.py holds the other places a window can live (a running sum, variables, one
session call per update); they implement the same small protocol as GradientAverager:
`step(sess, feed_dict)` and `flush(sess)`, each returning the losses that became known
and what happened to the window (None, APPLIED or DISCARDED), `window_size()`, and
`window_state()` / `restore_window(state, graph)` for checkpoints. The helpers below
the class are shared with them.
"""

import numpy as np
import tensorflow as tf

from averaging_optimizer import AveragingOptimizer  # noqa: F401  (trainer.AveragingOptimizer)
from averaging_optimizer import accumulator_dtype

v1 = tf.compat.v1

# What a strategy's step or flush did to the window it closed (None: still open).
APPLIED, DISCARDED = "applied", "discarded"


def average_gradients(window):
    """The post's mean: stack each variable's N gradients and average them.

    Args:
      window: N lists of numpy arrays; window[k][i] is mini-batch k's gradient of
        variable i, shaped like variable i.

    Returns:
      A list with one array per variable: np.stack([w[i] for w in window]).mean(0),
      summed in float32 for float16 and bfloat16 (numpy does so for float16 only).
    """
    means = []
    for grads in zip(*window):
        sum_type = accumulator_dtype(grads[0]).as_numpy_dtype
        mean = np.stack(grads, axis=0).mean(axis=0, dtype=sum_type)
        means.append(mean.astype(grads[0].dtype, copy=False))
    return means


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

    def __init__(self, loss, optimizer, num_batches, var_list=None, global_step=None,
                 check_finite=False):
        """Builds the ops in the default graph.

        Args:
          loss: scalar loss tensor of one mini-batch.
          optimizer: a tf.compat.v1.train.Optimizer.
          num_batches: N, the mini-batches averaged into one update.
          var_list: variables to train; default all trainable ones. Variables whose
            gradient is None are skipped.
          global_step: optional variable incremented once per update.
          check_finite: discard windows holding a NaN or Inf loss or gradient.
        """
        check_num_batches(num_batches)
        self.num_batches = num_batches
        self.loss = loss
        self.updates = self.skipped_windows = 0
        self._window, self._bad = [], False
        if num_batches == 1:
            self.train_op, self.finite = minimize(loss, optimizer, var_list, global_step,
                                                  check_finite)
            return
        pairs = gradients_and_variables(loss, optimizer, var_list)
        self.variables = [v for _, v in pairs]
        self.grad_op = [g for g, _ in pairs]
        self.finite = finite_check([loss] + self.grad_op, check_finite)
        self.grad_placeholders = [
            v1.placeholder(g.dtype, g.shape, name="mean_" + v.op.name.replace("/", "_"))
            for g, v in pairs]
        self.apply_op = optimizer.apply_gradients(
            zip(self.grad_placeholders, self.variables), global_step=global_step)

    def step(self, sess, feed_dict):
        """Runs one mini-batch; applies the mean when the window holds N.

        Returns:
          (losses, closed): this mini-batch's loss in a list, and None, APPLIED or
          DISCARDED for the window.
        """
        if self.num_batches == 1:
            loss, _, finite = sess.run([self.loss, self.train_op, self.finite], feed_dict)
            return [loss], count_window(self, finite)
        loss, grads, finite = sess.run([self.loss, self.grad_op, self.finite], feed_dict)
        self._window.append(grads)
        self._bad = self._bad or not finite
        if len(self._window) == self.num_batches:
            return [loss], self._close(sess)
        return [loss], None

    def _close(self, sess):
        """Applies the window's mean, or discards a window that saw a NaN or Inf."""
        finite = not self._bad
        if finite:
            mean = average_gradients(self._window)
            sess.run(self.apply_op, feed_dict=dict(zip(self.grad_placeholders, mean)))
        self._window, self._bad = [], False
        return count_window(self, finite)

    def flush(self, sess):
        """Applies a trailing partial window, if any.

        Returns:
          ([], closed): closed is None where the window was empty.
        """
        return [], (self._close(sess) if self._window else None)

    def window_size(self):
        """Mini-batches collected towards the next update."""
        return len(self._window)

    def window_state(self):
        """The open window as named numpy arrays, for a checkpoint."""
        return dict({f"grad|{k}|{i}": g for k, grads in enumerate(self._window)
                     for i, g in enumerate(grads)}, bad=np.array(self._bad))

    def restore_window(self, state, unused_graph):
        """Reopens a window saved by `window_state`."""
        self._bad = bool(state["bad"])
        grads = {}  # mini-batch k -> {variable i: gradient}
        for key, value in state.items():
            if key != "bad":
                k, i = (int(p) for p in key.split("|")[1:])
                grads.setdefault(k, {})[i] = value
        self._window = [[g[i] for i in sorted(g)] for _, g in sorted(grads.items())]


# ---------------------------------------------------------------- shared by every strategy


def check_num_batches(num_batches):
    if num_batches < 1:
        raise ValueError(f"average_gradients must be >= 1, got {num_batches}")


def gradients_and_variables(loss, optimizer, var_list):
    """(grad, var) pairs from compute_gradients, without variables that get no gradient."""
    pairs = optimizer.compute_gradients(loss, var_list=var_list)
    pairs = [(tf.convert_to_tensor(g), v) for g, v in pairs if g is not None]
    if not pairs:
        raise ValueError("no variable receives a gradient from the loss")
    return pairs


def finite_check(tensors, check_finite):
    """A bool tensor: every value of `tensors` is finite (constant True when unchecked)."""
    if not check_finite:
        return tf.constant(True)
    return tf.reduce_all(tf.stack([tf.reduce_all(tf.math.is_finite(t)) for t in tensors]))


def apply_if(finite, apply_fn):
    """Runs the update built by `apply_fn` only where `finite` is True."""
    return tf.cond(finite, lambda: tf.group(apply_fn()), tf.no_op)


def minimize(loss, optimizer, var_list, global_step, check_finite):
    """N == 1 for every strategy: (train_op, finite), the post's `optimizer.minimize`.

    Checked, it is minimize's two halves with the apply guarded.
    """
    if not check_finite:
        return (optimizer.minimize(loss, var_list=var_list, global_step=global_step),
                tf.constant(True))
    pairs = gradients_and_variables(loss, optimizer, var_list)
    finite = finite_check([loss] + [g for g, _ in pairs], True)
    return apply_if(finite, lambda: optimizer.apply_gradients(
        pairs, global_step=global_step)), finite


def count_window(averager, finite):
    """Counts a closed window in `averager`'s updates or skipped_windows; returns which."""
    if finite:
        averager.updates += 1
        return APPLIED
    averager.skipped_windows += 1
    return DISCARDED
