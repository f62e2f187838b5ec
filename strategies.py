"""The other TF1 accumulation strategies: where the window of N mini-batches lives.

Each applies exactly the post's update (trainer.GradientAverager, `stack`) and differs
only in where the window is kept: a numpy running sum (`running`), accumulator
variables in the graph (`graph`), or the window's inputs, run as one session call per
update (`fused`). They are siblings of GradientAverager with its protocol:
`step(sess, feed_dict)` and `flush(sess)` return (losses, closed) where closed is
None, trainer.APPLIED or trainer.DISCARDED; `window_size()`; `window_state()` and
`restore_window(state, graph)` for checkpoints; the `updates` and `skipped_windows`
counters.
"""

import numpy as np
import tensorflow as tf

import trainer

v1 = tf.compat.v1

STRATEGIES = ("stack", "running", "graph", "fused")
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
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; choose from {', '.join(STRATEGIES)}")
    if strategy == "stack" or num_batches == 1:
        return trainer.GradientAverager(loss, optimizer, num_batches, var_list, global_step,
                                        check_finite)
    if strategy == "fused":
        if loss_fn is None or inputs is None:
            raise ValueError("the fused strategy needs loss_fn and inputs")
        return FusedAverager(loss_fn, inputs, optimizer, num_batches, var_list, global_step,
                             check_finite)
    cls = RunningSumAverager if strategy == "running" else GraphAverager
    return cls(loss, optimizer, num_batches, var_list, global_step, check_finite)


def _check_window(num_batches):
    trainer.check_num_batches(num_batches)
    if num_batches == 1:
        raise ValueError("N == 1 has no window; make_averager builds GradientAverager")


class RunningSumAverager:
    """`running`: the post's graph, the window one numpy sum per variable (O(params)).

    The ops are a GradientAverager's (`grad_op`, the placeholders, `apply_op`); only the
    window differs: each mini-batch's gradients are added into the sum as they come.
    """

    def __init__(self, loss, optimizer, num_batches, var_list=None, global_step=None,
                 check_finite=False):
        _check_window(num_batches)
        self.num_batches = num_batches
        self.post = trainer.GradientAverager(loss, optimizer, num_batches, var_list,
                                             global_step, check_finite)
        self.updates = self.skipped_windows = 0
        self._sum, self._count, self._bad = None, 0, False

    def step(self, sess, feed_dict):
        post = self.post
        loss, grads, finite = sess.run([post.loss, post.grad_op, post.finite], feed_dict)
        if self._sum is None:
            self._sum = grads  # fresh arrays from sess.run, ours to update in place
        else:
            for total, g in zip(self._sum, grads):
                np.add(total, g, out=total)
        self._count += 1
        self._bad = self._bad or not finite
        if self._count == self.num_batches:
            return [loss], self._close(sess)
        return [loss], None

    def _close(self, sess):
        finite = not self._bad
        if finite:
            mean = [total / np.asarray(self._count, total.dtype) for total in self._sum]
            sess.run(self.post.apply_op, feed_dict=dict(zip(self.post.grad_placeholders, mean)))
        self._sum, self._count, self._bad = None, 0, False
        return trainer.count_window(self, finite)

    def flush(self, sess):
        return [], (self._close(sess) if self._count else None)

    def window_size(self):
        return self._count

    def window_state(self):
        return dict({f"sum|{i}": s for i, s in enumerate(self._sum or [])},
                    count=np.array(self._count), bad=np.array(self._bad))

    def restore_window(self, state, unused_graph):
        self._count, self._bad = int(state["count"]), bool(state["bad"])
        sums = [key for key in state if key.startswith("sum|")]
        self._sum = [state[f"sum|{i}"] for i in range(len(sums))] if sums else None


class GraphAverager:
    """`graph`: accumulator variables in the graph; no gradient leaves it.

    Each mini-batch runs `[loss, accumulate_op]` (assign_add into the accumulators);
    `apply_op` applies accumulators / count and resets them, in one op. Being
    variables, the accumulators are saved with the model by a tf.train.Saver.
    """

    def __init__(self, loss, optimizer, num_batches, var_list=None, global_step=None,
                 check_finite=False):
        _check_window(num_batches)
        self.num_batches, self.loss = num_batches, loss
        self.updates = self.skipped_windows = 0
        pairs = trainer.gradients_and_variables(loss, optimizer, var_list)
        self.variables = [v for _, v in pairs]
        self.grad_op = [g for g, _ in pairs]
        self.finite = trainer.finite_check([loss] + self.grad_op, check_finite)
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
        self._count, self._bad = 0, False  # _count mirrors `count` without a session call

    def step(self, sess, feed_dict):
        loss, _, finite = sess.run([self.loss, self.accumulate_op, self.finite], feed_dict)
        self._count += 1
        self._bad = self._bad or not finite
        if self._count == self.num_batches:
            return [loss], self._close(sess)
        return [loss], None

    def _close(self, sess):
        finite = not self._bad
        sess.run(self.apply_op if finite else self.reset_op)
        self._count, self._bad = 0, False
        return trainer.count_window(self, finite)

    def flush(self, sess):
        return [], (self._close(sess) if self._count else None)

    def window_size(self):
        return self._count

    def window_state(self):
        # The sums are variables, in the Saver's file.
        return {"count": np.array(self._count), "bad": np.array(self._bad)}

    def restore_window(self, state, unused_graph):
        self._count, self._bad = int(state["count"]), bool(state["bad"])


class FusedAverager:
    """`fused`: one session call per update, an in-graph loop over the micro-batches.

    The N micro-batches are fed together, stacked on a new leading axis; a
    `tf.while_loop` (FUSED_PARALLEL_ITERATIONS micro-batches in flight, so peak
    activation memory is that of two micro-batches, not of N) computes each
    micro-batch's gradients and adds them up, in order; the mean is applied in the same
    call. Host memory holds only the window's inputs.
    """

    def __init__(self, loss_fn, inputs, optimizer, num_batches, var_list=None,
                 global_step=None, check_finite=False):
        """Builds the ops in the default graph.

        Args:
          loss_fn: maps tensors shaped like `inputs` (one micro-batch) to a scalar loss;
            it must reuse the model's variables (e.g. get_variable with AUTO_REUSE).
          inputs: the per-micro-batch placeholders that `step`'s feed_dict fills;
            other keys of the feed_dict (e.g. a `training` flag) are passed through.
          optimizer, num_batches, var_list, global_step, check_finite: as for
            trainer.GradientAverager.
        """
        _check_window(num_batches)
        self.num_batches = num_batches
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
        self.finite = trainer.finite_check([self.losses] + [s for s, _ in pairs],
                                           check_finite)
        if check_finite:
            self.apply_op = trainer.apply_if(self.finite, lambda: optimizer.apply_gradients(
                pairs, global_step=global_step))
        else:
            self.apply_op = optimizer.apply_gradients(pairs, global_step=global_step)
        self._window = []  # the feed dicts of the open window

    def step(self, sess, feed_dict):
        """Keeps the micro-batch; at N runs the whole update in one call.

        Returns:
          (losses, closed): the window's N losses where it ran, else [].
        """
        self._window.append(feed_dict)
        if len(self._window) == self.num_batches:
            return self._run_window(sess)
        return [], None

    def _run_window(self, sess):
        feed = dict(self._window[-1])
        for p, w in zip(self.inputs, self.window_inputs):
            del feed[p]
            feed[w] = aligned_stack([f[p] for f in self._window])
        losses, _, finite = sess.run([self.losses, self.apply_op, self.finite], feed)
        self._window = []
        return list(losses), trainer.count_window(self, finite)

    def flush(self, sess):
        return self._run_window(sess) if self._window else ([], None)

    def window_size(self):
        return len(self._window)

    def window_state(self):
        return dict({f"feed|{k}|{key.name}": np.asarray(value)
                     for k, feed in enumerate(self._window) for key, value in feed.items()},
                    bad=np.array(False))  # a NaN shows only when the window runs

    def restore_window(self, state, graph):
        self._window = []
        for name, value in state.items():
            if name == "bad":
                continue
            _, k, tensor_name = name.split("|", 2)
            while len(self._window) <= int(k):
                self._window.append({})
            self._window[int(k)][graph.get_tensor_by_name(tensor_name)] = value


def aligned_stack(arrays):
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
