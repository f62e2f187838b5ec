"""`accumulate(model, N)`: Keras's compile/fit with exact gradient averaging.

    with strategy.scope():                        # optional: tf.distribute
        model = accumulate(make_model(), average_gradients=8)
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy",
                      metrics=["accuracy"])
    model.fit(x, y, batch_size=32, epochs=3, callbacks=[...])   # 8 x 32 per update

The AccumulatingModel's `train_step` trains a whole window of Keras's batches in one
compiled call with the TF2 path's window loop and mini-batch step (gradient_averaging.tf2),
on Keras's compiled loss and metrics.
"""

import math

import keras
import tensorflow as tf

from gradient_averaging import _keras_src
from gradient_averaging import tf2
from gradient_averaging import window as window_lib


# The trainer's steps a model may override; AccumulatingModel runs Keras's own instead.
OWN_STEPS = ("train_step", "compute_loss", "compute_metrics", "test_step")


def accumulate(model, average_gradients, check_finite=True, bn_statistics="update"):
    """`model` for Keras's `compile`/`fit`, training with exact gradient averaging.

    Each update applies the gradient of the mean loss over the window's samples, as one
    batch of N*B would, for any optimizer: a short last batch and the partial window at
    an epoch's end weigh by their samples. See AccumulatingModel.

    Args:
      model: a Keras model (made under the strategy's scope if one is used), whose class
        keeps Keras's own `train_step`.
      average_gradients: N, mini-batches (fit's batch_size) per update.
      check_finite: skip (not apply) a window holding a NaN or Inf loss or gradient.
      bn_statistics: "update": BatchNormalization layers take one moving-average step
        per update on the window's statistics (the direct batch's); "mini_batch": a step
        per mini-batch, as Keras takes them (tf2._BatchNormStatistics).

    Returns:
      An AccumulatingModel wrapping `model` (which it shares: its weights are `model`'s).

    Raises:
      TypeError: `model`'s class overrides a step of Keras's trainer (train_step,
        compute_loss, compute_metrics, test_step), which the AccumulatingModel would
        replace without running it.
    """
    own = [name for name in OWN_STEPS
           if getattr(type(model), name) is not getattr(keras.Model, name)]
    if own:
        raise TypeError(
            f"{type(model).__name__} overrides {', '.join(own)}, which accumulate() would "
            "replace without running it; accumulate inside your own training loop instead, "
            "with gradient_averaging.GradientAccumulator (accumulate(x, y) per mini-batch, "
            "apply() every N)")
    return AccumulatingModel(model, average_gradients, check_finite=check_finite,
                             bn_statistics=bn_statistics)


# Registered under the name the first release used, so that its .keras files load.
@keras.saving.register_keras_serializable(package="tf2_accumulator")
class AccumulatingModel(keras.Model):
    """A Keras model whose `fit` applies one update per window of N mini-batches.

    Written as Keras's "customizing what happens in fit()" guide says: `train_step` is
    overridden, and `fit` only regroups the batches Keras makes of its inputs (numpy, a
    tf.data.Dataset...; shuffled as Keras shuffles them) into windows of N, so that one
    `train_step`, one compiled call, trains a whole window: the window loop sums the
    mini-batches' gradients, the sample-weighted mean is applied, and Keras's loss
    tracker and compiled metrics are updated per mini-batch inside the loop, as Keras's
    own train_step updates them. Windows never cross an epoch's end: the last, partial
    one is applied before `on_epoch_end`. Everything else is Keras's own: callbacks see
    one batch per update (the progress bar counts updates), `evaluate`, `predict` and
    validation run the wrapped model, `save`/`load_model` round-trip (with this module
    imported).

    Attributes:
      model: the wrapped Keras model.
      average_gradients: N.
      skipped_windows: windows skipped for a non-finite loss or gradient so far.
    """

    def __init__(self, model, average_gradients, check_finite=True, bn_statistics="update",
                 **kwargs):
        super().__init__(**kwargs)
        self.model = model
        self.average_gradients = window_lib.check_average_gradients(average_gradients)
        self.check_finite = check_finite
        self.bn_statistics = tf2._check_bn_statistics(bn_statistics)  # noqa: SLF001
        self._statistics = None  # _BatchNormStatistics, made by fit
        self._single_values = None
        # Counted once per window (the first replica's count), never saved.
        self._skipped = tf2._local_variable(tf.constant(0, tf.int64),  # noqa: SLF001
                                            tf.VariableAggregation.ONLY_FIRST_REPLICA,
                                            "skipped_windows")
        self._no_gradient = None  # which variables the loss does not reach (set when traced)

    def call(self, inputs, training=None):
        return self.model(inputs, training=training)

    @property
    def skipped_windows(self):
        return int(self._skipped.read_value())

    def get_config(self):
        config = super().get_config()
        config.update(model=keras.saving.serialize_keras_object(self.model),
                      average_gradients=self.average_gradients,
                      check_finite=self.check_finite, bn_statistics=self.bn_statistics)
        return config

    @classmethod
    def from_config(cls, config, custom_objects=None):
        model = keras.saving.deserialize_keras_object(config.pop("model"),
                                                      custom_objects=custom_objects)
        return cls(model, **config)

    def fit(self, x=None, y=None, batch_size=None, epochs=1, verbose="auto", callbacks=None,
            validation_split=0.0, validation_data=None, shuffle=True, class_weight=None,
            sample_weight=None, initial_epoch=0, steps_per_epoch=None,
            validation_steps=None, validation_batch_size=None, validation_freq=1):
        """Keras's `fit`, one update per N batches of `batch_size` (the mini-batches).

        The arguments are Keras's; `steps_per_epoch` counts mini-batches and must be
        a multiple of N. The returned History has one entry per epoch as usual; callbacks
        receive one batch per update.
        """
        if validation_split and validation_data is None:
            (x, y, sample_weight), validation_data = _keras_src.train_validation_split(
                (x, y, sample_weight), validation_split=validation_split)
        if steps_per_epoch is not None:
            if steps_per_epoch % self.average_gradients:
                raise ValueError(f"steps_per_epoch={steps_per_epoch} counts mini-batches: "
                                 f"it must be a multiple of average_gradients="
                                 f"{self.average_gradients}")
            steps_per_epoch //= self.average_gradients
        windows = self._windows(x, y, sample_weight, batch_size, shuffle, class_weight)
        # Keras would build the metrics from the first element: a window. A mini-batch's.
        _keras_src.symbolic_build(self, windows.mini_batches.get_tf_dataset().element_spec)
        padded = bool(self.jit_compile)
        if self._statistics is None or self._statistics.padded != padded:
            self._statistics = tf2._BatchNormStatistics(self, self.bn_statistics, padded)
            with self.distribute_strategy.scope():
                self._single_values = tf.Variable(
                    tf.zeros([len(self._statistics.layers)], tf.float64), trainable=False)
            self.train_function = None  # traced again with them
        if self._statistics:
            callbacks = list(callbacks or []) + [_SingleValueWarning(self)]
        return super().fit(windows, epochs=epochs, verbose=verbose, callbacks=callbacks,
                           validation_data=validation_data, initial_epoch=initial_epoch,
                           steps_per_epoch=steps_per_epoch, validation_steps=validation_steps,
                           validation_batch_size=validation_batch_size or batch_size,
                           validation_freq=validation_freq)

    def _windows(self, x, y, sample_weight, batch_size, shuffle, class_weight):
        """The _WindowAdapter of fit's inputs; the last one again for the same tf.data
        dataset (a new pipeline's first iterator is slow, a pass over it again fast: fit
        called again and again on one dataset must not pay it each time)."""
        replicas = self.distribute_strategy.num_replicas_in_sync
        is_dataset = _keras_src.data_adapters.is_tf_dataset(x)
        if is_dataset:
            cached = getattr(self, "_last_windows", None)
            if cached is not None and cached[0] is x and cached[1] == class_weight:
                return cached[2]
        mini_batches = _keras_src.data_adapters.get_data_adapter(
            x, y, sample_weight, batch_size=batch_size or (None if is_dataset else 32),
            shuffle=shuffle and not is_dataset, class_weight=class_weight)
        windows = _WindowAdapter(mini_batches, self.average_gradients, replicas)
        if is_dataset:
            self._last_windows = (x, class_weight, windows)
        return windows

    def train_step(self, data):
        """Trains one window (Keras calls it in each replica's context).

        Args:
          data: (batch, sizes, global_sizes) as _WindowAdapter makes it: this replica's
            share of Keras's mini-batch tuples (x, y[, sample_weight]) stacked and padded,
            [N, B, ...], its int [N] sizes, and the global mini-batches' sizes; under
            K > 1 replicas each on a leading axis of one.
        """
        if self.distribute_strategy.num_replicas_in_sync > 1:
            data = tf.nest.map_structure(lambda t: t[0], data)
        batch, sizes, global_sizes = data
        # Under XLA (Keras's jit_compile) every mini-batch runs at the window's padded
        # width, a shape known when traced; its padding weighs nothing.
        padded = bool(self.jit_compile)
        statistics = self._batch_norm(padded)
        trainable = self.trainable_variables
        non_trainable = self.non_trainable_variables
        metrics = self.metrics_variables
        weights = [tf.convert_to_tensor(v) for v in trainable]
        state = [tf.convert_to_tensor(v) for v in non_trainable]
        count = tf.cast(tf.reduce_sum(global_sizes), tf.float32)
        if statistics:
            statistics.discover(self, weights, state, keras.utils.unpack_x_y_sample_weight(
                tf2._first_rows(batch))[0])
        shifts = statistics.shifts(state) if statistics else []

        def mini_batch(i, mini_batch_data, carried):
            x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(mini_batch_data)
            non_trainable_values, metrics_values, nonfinite, moments = carried
            n_local = sizes[i]
            n = tf.cast(n_local, tf.float32)
            mask = (window_lib.row_mask(n_local, tf.shape(tf.nest.flatten(x)[0])[0])
                    if padded else None)

            def objective(y_pred, pass_losses, non_trainable_values):
                if padded:  # Keras's losses and metrics leave masked rows out
                    y_pred = _keras_src.with_row_mask(y_pred, mask)
                # As Keras's JAX trainer: the model, then the loss, on values, with the
                # pass's add_loss and regularization losses.
                with _keras_src.losses_from_the_pass(self, pass_losses):
                    loss, (_, non_trainable_values, metrics_after) = \
                        self.stateless_compute_loss(
                            weights, non_trainable_values, metrics_values, x=x, y=y,
                            y_pred=y_pred, sample_weight=sample_weight, training=True)
                loss = _keras_src.unscale_loss_for_distribution(loss)
                # The mini-batch's part of the window's mean loss, scaled (mixed
                # precision) as Keras scales a batch's: the float16 gradients are those
                # of the direct batch, and their sum is the mean's gradient.
                scaled = self.optimizer.scale_loss(loss * (n / count))
                return scaled, (loss, y_pred, non_trainable_values, metrics_after)

            with _keras_src.activity_losses_weighted(self, count / tf.maximum(n, 1.0), mask):
                step = tf2._mini_batch_gradients(self, weights, non_trainable_values, x,
                                                objective, statistics or None, mask)
            self._no_gradient = step.no_gradient
            loss, y_pred, non_trainable_values, metrics_after = step.extra
            with keras.StatelessScope(state_mapping=list(zip(metrics, metrics_after))) as scope:
                _keras_src.loss_tracker(self).update_state(loss, sample_weight=n_local)
                self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
            # A non-finite mini-batch (its window is skipped) is left out of the logs.
            finite = tf.math.is_finite(tf.cast(loss, tf.float32) * n)
            metrics_values = [tf.where(finite, scope.get_current_value(v), old)
                              for v, old in zip(metrics, metrics_values)]
            nonfinite += 1.0 - tf.cast(finite, tf.float32)
            if statistics:
                moments = statistics.add(moments, step.moments, shifts)
            return step.gradients, (non_trainable_values, metrics_values, nonfinite, moments)

        sums, (non_trainable_values, metrics_values, nonfinite, moments) = \
            window_lib.sum_window(
                mini_batch, [tf.zeros(v.shape, v.dtype) for v in trainable],
                (state, [tf.convert_to_tensor(v) for v in metrics], tf.constant(0.0),
                 statistics.zeros() if statistics else tf.zeros([0], tf.float64)),
                batch, sizes, padded=padded)
        for variable, value in zip(non_trainable + metrics,
                                   non_trainable_values + metrics_values):
            variable.assign(value)
        # This replica's share of the mean (its mini-batch parts summed).
        shares = [total for total, none in zip(sums, self._no_gradient) if not none]
        applied = tf.distribute.get_replica_context().merge_call(
            self._apply_window, args=(shares, nonfinite + tf2._not_finite(shares), moments))
        self._skipped.assign_add(1 - tf.cast(applied, tf.int64))
        return self.get_metrics_result()

    def _apply_window(self, strategy, shares, nonfinite, moments):
        """Cross-replica: applies the window unless non-finite (see check_finite), and
        steps the batch-norm statistics once.

        (tf2._apply_window: a LossScaleOptimizer is given every window.)
        """
        applied, counts = tf2._apply_window(  # noqa: SLF001  (the package's own)
            strategy, self.optimizer, self.trainable_variables, shares, self._no_gradient,
            nonfinite, self.check_finite)
        statistics = self._statistics
        if statistics:
            total = strategy.reduce(tf.distribute.ReduceOp.SUM, moments, axis=None)
            self._single_values.assign_add(statistics.end_window(total, counts))
        return applied

    def _batch_norm(self, padded):
        """The _BatchNormStatistics of this fit (made in `fit`, outside the trace)."""
        if self._statistics is None or self._statistics.padded != padded:
            raise RuntimeError("train_step runs inside fit(); call fit, not train_step")
        return self._statistics


class _SingleValueWarning(keras.callbacks.Callback):
    """Warns, once per layer, of a BatchNormalization layer that normalized one value
    per channel: checked after each epoch's first window and at each epoch's end."""

    def __init__(self, accumulating):
        super().__init__()
        self.accumulating = accumulating
        self._first = False

    def on_epoch_begin(self, epoch, logs=None):
        self._first = True

    def on_train_batch_end(self, batch, logs=None):
        if self._first:
            self._first = False
            self._check()

    def on_epoch_end(self, epoch, logs=None):
        self._check()

    def _check(self):
        statistics = self.accumulating._statistics  # noqa: SLF001
        if statistics:
            statistics.warn_single_values(self.accumulating._single_values.numpy())  # noqa: SLF001


class _WindowAdapter(_keras_src.DataAdapter):
    """Keras's data adapter of the mini-batches, regrouped into stacked windows of N.

    Each epoch's windows are its mini-batches in Keras's order, N at a time, the last
    one partial; a window is (batch, sizes, global_sizes) as window.stacked_windows
    stacks it. Under K > 1 replicas a window is each replica's share
    (tf2._replica_share) on a new leading axis of K, so that Keras's distribution of the
    dataset hands every replica its own share and nothing more.
    """

    def __init__(self, mini_batches, average_gradients, replicas):
        self.mini_batches = mini_batches
        self.average_gradients = average_gradients
        self.replicas = replicas
        self._windows = None

    def get_tf_dataset(self):
        if self._windows is None:  # built once: Keras asks at every fit
            windows = window_lib.stacked_windows(self.mini_batches.get_tf_dataset(),
                                                 self.average_gradients)
            windows = windows.map(self._shares if self.replicas > 1
                                  else lambda batch, sizes: (batch, sizes, sizes))
            self._windows = windows.prefetch(tf.data.AUTOTUNE)
        return self._windows

    def _shares(self, batch, sizes):
        shares = [tf2._replica_share(batch, sizes, r, self.replicas)
                  for r in range(self.replicas)]
        batch = tf.nest.map_structure(lambda *t: tf.stack(t), *[s[0] for s in shares])
        local_sizes = tf.stack([s[1] for s in shares])
        return batch, local_sizes, tf.tile(sizes[tf.newaxis], [self.replicas, 1])

    @property
    def num_batches(self):
        mini_batches = self.mini_batches.num_batches
        if mini_batches is None:
            return None
        return math.ceil(mini_batches / self.average_gradients)

    @property
    def batch_size(self):
        return self.replicas if self.replicas > 1 else None

    @property
    def has_partial_batch(self):
        return False

    @property
    def partial_batch_size(self):
        return None

    def on_epoch_begin(self):
        self.mini_batches.on_epoch_begin()

    def on_epoch_end(self):
        self.mini_batches.on_epoch_end()
