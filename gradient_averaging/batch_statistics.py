"""Batch norm's moving statistics under accumulation (docs/batch-norm.md). A layer kind is added in
_keras_src's `batch_norm_layers` (finds the layers) and `captured_moments` (their moments)."""

import collections
import logging

import numpy as np
import tensorflow as tf

from gradient_averaging import arguments
from gradient_averaging import window as window_lib


class BatchStatistics:
    """A model's BatchNormalization moving statistics. bn_statistics="update": one step per update
    (per call, in order), on the mean and biased variance of all the window's values: float64 count,
    sum and sum of squares of x - moving mean (so no large numbers cancel), summed over mini-batches
    and replicas (one all-reduce); a skipped window leaves them. A pass normalizes by its own
    (replica's) mini-batch: it cannot know the window's. "mini_batch": Keras's own steps."""

    def __init__(self, model, bn_statistics="update"):
        self.per_update = arguments.check_bn_statistics(bn_statistics) == "update"
        self.layers = []
        if any(v.name in ("moving_mean", "moving_variance")  # batch norm alone needs _keras_src
               for v in model.non_trainable_variables):
            from gradient_averaging import _keras_src
            self._internals = _keras_src
            self.layers = _keras_src.batch_norm_layers(model, self.per_update)
        position = {id(v): i for i, v in enumerate(model.non_trainable_variables)}
        self._moving = {position[id(layer.moving_mean)] for layer in self.layers} | {
            position[id(layer.moving_variance)] for layer in self.layers}
        self._shift_positions = [position[id(layer.moving_mean)] for layer in self.layers]
        self.keys = None  # (layer index, channels) per call, in a forward pass's order
        self._warned = set()

    def __bool__(self):
        return bool(self.layers)

    @property
    def size(self):
        """The length of a window's float64 sums: count, sum, sum of squares per call and channel,
        then per layer the mini-batches that gave it one value a channel."""
        return sum(3 * channels for _, channels in self.keys) + len(self.layers)

    def capture(self, moments):
        return self._internals.captured_moments(self.layers, moments)

    def held(self, before, after):
        """The model's other state after a pass, the moving statistics as before it."""
        if not self.per_update:
            return after
        return [b if i in self._moving else a for i, (b, a) in enumerate(zip(before, after))]

    def shifts(self, non_trainable):
        """Each layer's moving mean at the window's start, float64: the sums' origin."""
        return [tf.cast(non_trainable[i], tf.float64) for i in self._shift_positions]

    def discover(self, model, weights, non_trainable, x):
        """Learns the calls a forward pass makes (`keys`) from a pass traced on `x`, unused."""
        if self.keys is not None or not self.layers:
            return
        moments = []
        with self.capture(moments):
            model.stateless_call(weights, non_trainable, x, training=True)
        self.keys = [(index, int(np.prod(mean.shape))) for index, _, mean, _ in moments]

    def zeros(self):
        return tf.zeros([self.size], tf.float64)

    def add(self, total, moments, shifts):
        """`total` plus one pass's moments (as `capture` recorded them)."""
        by_layer = collections.defaultdict(list)
        for index, count, mean, variance in moments:
            by_layer[index].append((count, mean, variance))
        parts, single = [], [0.0] * len(self.layers)
        for index, channels in self.keys:
            count, mean, variance = by_layer[index].pop(0)
            count = tf.reshape(tf.stop_gradient(count), [channels])
            offset = tf.reshape(tf.cast(tf.stop_gradient(mean), tf.float64), [channels]) \
                - tf.reshape(shifts[index], [channels])
            variance = tf.reshape(tf.cast(tf.stop_gradient(variance), tf.float64), [channels])
            parts += [count, count * offset, count * (variance + tf.square(offset))]
            single[index] = tf.maximum(tf.convert_to_tensor(single[index], tf.float64),
                                       tf.cast(tf.reduce_any(tf.equal(count, 1.0)),
                                               tf.float64))
        return total + tf.concat(parts + [tf.cast(tf.stack(single), tf.float64)], 0)

    def end_window(self, total, move):
        """Once per window, cross-replica, on all replicas' sums: the steps where `move` (a bool
        tensor) holds; returns the per-layer single-value counts for warn_single_values."""
        if self.per_update:
            self._step(total, move)
        return total[self.size - len(self.layers):]

    def _step(self, total, move):
        shifts = [tf.cast(layer.moving_mean, tf.float64) for layer in self.layers]
        steps, start = [], 0
        for index, channels in self.keys:
            count, s1, s2 = (total[start + k * channels:start + (k + 1) * channels]
                             for k in range(3))
            start += 3 * channels
            safe = tf.maximum(count, 1.0)
            offset = s1 / safe
            mean = tf.reshape(shifts[index], [channels]) + offset
            variance = tf.maximum(s2 / safe - tf.square(offset), 0.0)
            steps.append((index, count > 0, mean, variance))
        finite = window_lib.all_finite([total])

        def assign():
            for index, seen, mean, variance in steps:  # in call order
                layer = self.layers[index]
                for variable, value in ((layer.moving_mean, mean),
                                        (layer.moving_variance, variance)):
                    old = tf.cast(variable, tf.float64)
                    shape = tf.shape(old)
                    new = tf.reshape(tf.where(seen, tf.reshape(old, [-1]) * layer.momentum
                                              + value * (1.0 - layer.momentum),
                                              tf.reshape(old, [-1])), shape)
                    variable.assign(tf.cast(new, variable.dtype))
            return tf.constant(True)

        return tf.cond(tf.logical_and(move, finite), assign, lambda: tf.constant(False))

    def warn_single_values(self, counts):
        """One warning per layer that normalized one value a channel (a dead layer)."""
        for layer, count in zip(self.layers, np.asarray(counts)):
            if count > 0 and layer.name not in self._warned:
                self._warned.add(layer.name)
                logging.warning(
                    "BatchNormalization layer %r normalized a single value per channel in "
                    "a mini-batch (or a replica's share of one): its output was its beta, "
                    "whatever the input. Use GroupNormalization or LayerNormalization, a "
                    "larger mini-batch, or freeze the layer (trainable=False).", layer.name)
