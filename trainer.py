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

A window in which any loss or gradient is NaN or Inf is skipped whole instead of
applied (counted in `skipped_windows`; `check_finite=False` turns the check off).

Each `step` says what it did to the window with an `Outcome`. The experiment's other
averagers (experiment/averagers.py: a running sum, variables, one session call per
update) keep the same interface; the helpers below the class are shared with them.
This file imports only TensorFlow, numpy and the gradient_averaging library.
"""

import dataclasses
import enum

import numpy as np
import tensorflow as tf

from gradient_averaging.arguments import check_average_gradients
from gradient_averaging.window import accumulator_dtype
from gradient_averaging.window import all_finite

v1 = tf.compat.v1


class Outcome(enum.Enum):
    """What a `step` or `flush` did to the window of mini-batches."""
    NONE = "none"  # no window closed: it is still open (or there was none to flush)
    APPLIED = "applied"  # a window closed and its mean was applied: one update
    SKIPPED = "skipped"  # a window closed holding a NaN or Inf and was skipped whole

    @classmethod
    def closed(cls, finite):
        """The outcome of a window that closed, finite or not."""
        return cls.APPLIED if finite else cls.SKIPPED


@dataclasses.dataclass
class WindowCounts:
    """Closed windows, counted from their outcomes: the one place they are counted."""
    updates: int = 0  # windows applied
    skipped_windows: int = 0  # windows skipped

    def count(self, outcome):
        """Counts `outcome` (NONE counts nothing) and returns it."""
        self.updates += outcome is Outcome.APPLIED
        self.skipped_windows += outcome is Outcome.SKIPPED
        return outcome


class Averager:
    """Where a TF1 window lives until its mean is applied, and how: the interface every
    averager keeps (GradientAverager below is the post's; the experiment's --accumulate
    picks one). This base checks N and counts the windows a subclass closes (`_closed`).
    """

    def __init__(self, average_gradients):
        self.average_gradients = check_average_gradients(average_gradients)
        self.counts = WindowCounts()  # since this averager was built

    @property
    def updates(self):
        """Updates applied so far."""
        return self.counts.updates

    @property
    def skipped_windows(self):
        """Windows skipped for a NaN or Inf so far (check_finite)."""
        return self.counts.skipped_windows

    def _closed(self, finite):
        """The Outcome of a window that just closed, counted."""
        return self.counts.count(Outcome.closed(finite))

    def step(self, sess, feed_dict):
        """Trains one mini-batch: (the losses that became known, list; Outcome)."""
        raise NotImplementedError

    def flush(self, sess):
        """Closes a trailing partial window: (losses, Outcome); NONE where none is open."""
        raise NotImplementedError

    def window_size(self):
        """Mini-batches in the open window."""
        raise NotImplementedError

    def window_state(self):
        """The open window as named numpy arrays, for a checkpoint."""
        raise NotImplementedError

    def restore_window(self, sess, state):
        """Reopens the window `window_state` saved, its graph's variables restored."""
        raise NotImplementedError


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


class GradientAverager(Averager):
    """The post's averager (`stack`): N numpy gradient lists, stacked and averaged.

    Attributes:
      grad_op: list of gradient tensors (N > 1).
      grad_placeholders: one placeholder per gradient (N > 1).
      apply_op: applies the gradients fed to the placeholders (N > 1).
      train_op: `optimizer.minimize(loss)` (N == 1).
      finite: bool tensor, whether this mini-batch's loss and gradients are finite.
      updates: optimizer updates applied so far.
      skipped_windows: windows skipped for a non-finite value (check_finite).
    """

    def __init__(self, loss, optimizer, average_gradients, var_list=None, global_step=None,
                 check_finite=True):
        """Builds the ops in the default graph.

        Args:
          loss: scalar loss tensor of one mini-batch.
          optimizer: a tf.compat.v1.train.Optimizer.
          average_gradients: N, the mini-batches averaged into one update.
          var_list: variables to train; default all trainable ones. Variables whose
            gradient is None are left out.
          global_step: optional variable incremented once per update.
          check_finite: skip windows holding a NaN or Inf loss or gradient.
        """
        super().__init__(average_gradients)
        self.loss = loss
        self._window, self._bad = [], False
        if average_gradients == 1:
            self.train_op, self.finite = minimize(loss, optimizer, var_list, global_step,
                                                  check_finite)
            return
        pairs = gradients_and_variables(loss, optimizer, var_list)
        self.variables = [v for _, v in pairs]
        self.grad_op = [g for g, _ in pairs]
        self.finite = all_finite([loss] + self.grad_op) if check_finite else tf.constant(True)
        self.grad_placeholders = [
            v1.placeholder(g.dtype, g.shape, name="mean_" + v.op.name.replace("/", "_"))
            for g, v in pairs]
        self.apply_op = optimizer.apply_gradients(
            zip(self.grad_placeholders, self.variables), global_step=global_step)

    def step(self, sess, feed_dict):
        """Runs one mini-batch; applies the mean when the window holds N.

        Returns:
          (losses, outcome): this mini-batch's loss in a list, and the Outcome
          for the window.
        """
        if self.average_gradients == 1:
            loss, _, finite = sess.run([self.loss, self.train_op, self.finite], feed_dict)
            return [loss], self._closed(finite)
        loss, grads, finite = sess.run([self.loss, self.grad_op, self.finite], feed_dict)
        self._add(grads)
        self._bad = self._bad or not finite
        if self.window_size() == self.average_gradients:
            return [loss], self._close(sess)
        return [loss], Outcome.NONE

    def _close(self, sess):
        """Applies the window's mean, or skips a window that saw a NaN or Inf."""
        finite = not self._bad
        if finite:
            sess.run(self.apply_op, feed_dict=dict(zip(self.grad_placeholders, self._mean())))
        self._clear()
        return self._closed(finite)

    def flush(self, sess):
        """Applies a trailing partial window, if any.

        Returns:
          ([], outcome): Outcome.NONE where the window was empty.
        """
        return [], (self._close(sess) if self.window_size() else Outcome.NONE)

    # The window itself: a subclass keeps it elsewhere (the experiment's `running`).

    def _add(self, grads):
        """Adds one mini-batch's numpy gradients to the window."""
        self._window.append(grads)

    def _mean(self):
        """The window's mean gradients, one array per placeholder."""
        return average_gradients(self._window)

    def _clear(self):
        self._window, self._bad = [], False

    def window_size(self):
        """Mini-batches collected towards the next update."""
        return len(self._window)

    def window_state(self):
        """The open window as named numpy arrays, for a checkpoint."""
        return dict({f"grad|{k}|{i}": g for k, grads in enumerate(self._window)
                     for i, g in enumerate(grads)}, bad=np.array(self._bad))

    def restore_window(self, sess, state):
        """Reopens a window saved by `window_state` (numpy: `sess` is not needed)."""
        self._bad = bool(state["bad"])
        grads = {}  # mini-batch k -> {variable i: gradient}
        for key, value in state.items():
            if key != "bad":
                k, i = (int(p) for p in key.split("|")[1:])
                grads.setdefault(k, {})[i] = value
        self._window = [[g[i] for i in sorted(g)] for _, g in sorted(grads.items())]


# ---------------------------------------------------------------- shared by every averager


def gradients_and_variables(loss, optimizer, var_list):
    """(grad, var) pairs from compute_gradients, without variables that get no gradient."""
    pairs = optimizer.compute_gradients(loss, var_list=var_list)
    pairs = [(tf.convert_to_tensor(g), v) for g, v in pairs if g is not None]
    if not pairs:
        raise ValueError("no variable receives a gradient from the loss")
    return pairs


def apply_if(finite, apply_fn):
    """Runs the update built by `apply_fn` only where `finite` is True."""
    return tf.cond(finite, lambda: tf.group(apply_fn()), tf.no_op)


def minimize(loss, optimizer, var_list, global_step, check_finite):
    """N == 1 for every averager: (train_op, finite), the post's `optimizer.minimize`.

    Checked, it is minimize's two halves with the apply guarded.
    """
    if not check_finite:
        return (optimizer.minimize(loss, var_list=var_list, global_step=global_step),
                tf.constant(True))
    pairs = gradients_and_variables(loss, optimizer, var_list)
    finite = all_finite([loss] + [g for g, _ in pairs])
    return apply_if(finite, lambda: optimizer.apply_gradients(
        pairs, global_step=global_step)), finite
