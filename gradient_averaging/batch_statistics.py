"""Batch statistics under accumulation: the moving statistics of the layers that keep
them (Keras's BatchNormalization), one step per update on the window's moments.

A layer kind that keeps batch statistics is supported by `_keras_src.batch_norm_layers`
(which finds the layers, by type) and `_keras_src.captured_moments` (which records each
call's moments): docs/batch-norm.md says how to add one.
"""

import collections
import logging

import numpy as np
import tensorflow as tf

from gradient_averaging import arguments
from gradient_averaging import window as window_lib


class BatchStatistics:
    """A model's BatchNormalization layers under accumulation: their moving statistics.

    With bn_statistics="update" (the default) a layer in training mode takes one
    moving-average step per update, on the mean and (biased) variance of every value the
    window reduced for it, as the direct batch computes them: each mini-batch's moments
    are kept as float64 sums, around the moving mean (count, sum and sum of squares of
    x - moving mean, so no large numbers cancel), added across mini-batches and, under a
    tf.distribute strategy, across replicas (one all-reduce per update), and merged
    once. A layer called twice in a forward pass steps twice, in order. A skipped window
    leaves them as they were. The normalization inside each forward pass stays that of
    the mini-batch (of the replica's share): one pass cannot know the window's.
    "mini_batch" is Keras's own behaviour: a step per mini-batch on its moments.
    """

    def __init__(self, model, bn_statistics="update"):
        self.per_update = arguments.check_bn_statistics(bn_statistics) == "update"
        self.layers = []
        # Only a model with batch norm needs Keras's internals (_keras_src checks them).
        if any(v.name in ("moving_mean", "moving_variance")
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
        """The flat float64 vector of a window's sums: count, sum, sum of squares per call
        and channel, then per layer the mini-batches that gave it one value a channel."""
        return sum(3 * channels for _, channels in self.keys) + len(self.layers)

    def capture(self, moments):
        """While the block runs a forward pass: its layers' moments, into `moments`."""
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
        """Learns the calls a forward pass makes (`keys`), from a pass traced on `x` whose
        results are never used."""
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
        """Cross-replica, once per window, from its sums (all replicas'): per update, one
        moving-average step per call where `move` (a bool tensor) says the window counts.

        Returns:
          the window's count, per layer, of mini-batches that gave it one value a channel
          (for warn_single_values).
        """
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
            for index, seen, mean, variance in steps:  # in call order: a step per call
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
