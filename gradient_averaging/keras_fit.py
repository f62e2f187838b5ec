"""`accumulate(model, N)`: Keras's compile/fit with exact gradient averaging.

    with strategy.scope():                        # optional: tf.distribute
        model = accumulate(make_model(), average_gradients=8)
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    model.fit(x, y, batch_size=32, epochs=3, callbacks=[...])   # 8 x 32 per update

    model = accumulate(make_model(), micro_batch_size="auto")   # or: the micro-batch found
    model.compile(...)
    model.fit(x, y, batch_size=2048, epochs=3)    # one update per 2,048, cut to fit"""

import contextlib
import math
import tempfile

import keras
import tensorflow as tf

from gradient_averaging import _keras_src
from gradient_averaging import arguments
from gradient_averaging import batch_statistics as statistics_lib
from gradient_averaging import micro_batch as micro_batch_lib
from gradient_averaging import replicas as replicas_lib
from gradient_averaging import window as window_lib
from gradient_averaging import window_step as step_lib

_keras_src.require(_keras_src.FIT)

# The trainer's steps a model may override; AccumulatingModel runs Keras's own instead.
OWN_STEPS = ("train_step", "compute_loss", "compute_metrics", "test_step")


def accumulate(model, average_gradients=None, check_finite=True, bn_statistics="update", *,
               micro_batch_size=None, budget=None, margin=None, parallel_mini_batches=1):
    """An AccumulatingModel of `model` (sharing its weights): each update applies the gradient of
    the mean loss over its window's samples, as one batch of N*B would, for any optimizer.

    Args:
      model: made in the strategy's scope if any; its class must not override OWN_STEPS (TypeError).
      average_gradients: N, mini-batches (fit's batch_size) per update.
      check_finite: skip, not apply, a window with a NaN or Inf loss or gradient.
      bn_statistics: "update": BatchNormalization takes one moving-average step per update, on
        the window's statistics; "mini_batch": one per mini-batch, as Keras does.
      micro_batch_size: instead of N: each batch fit is given is one update, trained in
        mini-batches of this many samples per replica; "auto": the largest that fits.
      budget, margin: with "auto", memory to use in bytes, fraction kept free (None: the device's).
      parallel_mini_batches: P, mini-batch passes run at once; each beyond 1 costs a mini-batch's
        activations and gradients, and may be faster on small mini-batches."""
    own = [name for name in OWN_STEPS
           if getattr(type(model), name) is not getattr(keras.Model, name)]
    if own:
        raise TypeError(
            f"{type(model).__name__} overrides {', '.join(own)}, which accumulate() would "
            "replace without running it; accumulate inside your own training loop instead, "
            "with gradient_averaging.MiniBatchAccumulator (accumulate(x, y) per mini-batch, "
            "apply() every N)")
    return AccumulatingModel(model, average_gradients, check_finite, bn_statistics,
                             micro_batch_size, budget, margin, parallel_mini_batches)


def _any_samples(spec):
    def relaxed(t):
        if isinstance(t, tf.TensorSpec) and t.shape.rank:
            return tf.TensorSpec([None] + t.shape[1:].as_list(), t.dtype)
        return t

    return tf.nest.map_structure(relaxed, spec)


def _with_added_losses(parts, pass_losses, n):
    """`parts` and, as one Part, a pass's add_loss losses (each a mean over the `n` samples)."""
    if pass_losses:
        total = tf.add_n([tf.reduce_sum(tf.cast(loss, keras.config.floatx()))
                          for loss in pass_losses])
        parts.append(window_lib.Part(total * tf.cast(n, total.dtype), n, None, window_lib.SAMPLES))
    return parts


def _run_batches(iterator, steps, run):
    """`run(batch)` on each of up to `steps` batches -> the last logs; StopIteration if none."""
    logs = None
    for step in range(steps):
        try:
            batch = next(iterator)
        except (StopIteration, tf.errors.OutOfRangeError):
            if not step:
                raise StopIteration from None
            break
        logs = run(batch)
    return logs


# The first release's package name, so that its .keras files load.
@keras.saving.register_keras_serializable(package="tf2_accumulator")
class AccumulatingModel(_keras_src.SpecBuilt, keras.Model):
    """A Keras model whose `fit` applies one update per window of N mini-batches.

    `fit` hands Keras's loop windows of N mini-batches; the train function adds a window's
    mini-batches to the window step (shared with the TF2 accumulators; metrics updated as Keras's
    train_step would) and applies their sample-weighted mean; an epoch's partial last window is
    applied before `on_epoch_end`. Callbacks see one batch per update; `evaluate`, `predict` and
    validation run the wrapped `model` (`make_test_function` says when in mini-batches);
    `save`/`load_model` round-trip where gradient_averaging is imported.
    With a micro_batch_size (N is 1) each batch is a window cut per replica into mini-batches,
    trained again at half the micro-batch where a replica runs out of memory. Several workers
    each read all the data, autosharded (docs/multi-worker.md). Attributes: accumulate's args."""

    def __init__(self, model, average_gradients=None, check_finite=True,
                 bn_statistics="update", micro_batch_size=None, budget=None,
                 margin=None, parallel_mini_batches=1, **kwargs):
        super().__init__(**kwargs)
        self.parallel_mini_batches = arguments.check_parallel_mini_batches(parallel_mini_batches)
        self.model = model
        if model.built:  # its weights are ours: count_params(), summary() before fit
            self.built = True
        self.average_gradients, self.micro_batch_size = arguments.check_window(
            average_gradients, micro_batch_size)
        self.budget = arguments.check_budget(budget)
        self.margin = arguments.check_margin(margin)
        self._cut = None  # the micro_batch.MicroBatch fit cuts its batches by
        self._cut_for = None  # what _cut was made for (_cut_batches)
        self.check_finite = check_finite
        self.bn_statistics = arguments.check_bn_statistics(bn_statistics)
        self._window = None  # the window_step.WindowStep, made by fit
        self._single_values = None
        self._skipped = None  # windows skipped so far, never saved

    @property
    def micro_batch(self):
        """The MicroBatch fit cuts by (halved after running out of memory); None before fit."""
        return self._cut

    def call(self, inputs, training=None):
        return self.model(inputs, training=training)

    @property
    def skipped_windows(self):
        """Windows skipped so far for a non-finite loss or gradient."""
        return 0 if self._skipped is None else int(self._skipped.read_value())

    def get_config(self):
        config = super().get_config()
        config.update(model=keras.saving.serialize_keras_object(self.model),
                      average_gradients=self.average_gradients,
                      check_finite=self.check_finite, bn_statistics=self.bn_statistics,
                      micro_batch_size=self.micro_batch_size, budget=self.budget,
                      margin=self.margin, parallel_mini_batches=self.parallel_mini_batches)
        return config

    @classmethod
    def from_config(cls, config, custom_objects=None):
        model = keras.saving.deserialize_keras_object(config.pop("model"),
                                                      custom_objects=custom_objects)
        return cls(model, **config)

    def fit(self, x=None, y=None, batch_size=None, epochs=1, verbose="auto", callbacks=None,
            *, validation_split=0.0, validation_data=None, shuffle=True, class_weight=None,
            sample_weight=None, steps_per_epoch=None, **kwargs):
        """Keras's fit; steps_per_epoch counts mini-batches, a multiple of N (else ValueError)."""
        kwargs["validation_batch_size"] = kwargs.get("validation_batch_size") or batch_size
        if self.micro_batch_size is not None and batch_size is not None:
            arguments.check_effective_batch(batch_size, "batch_size")
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
        spec = windows.get_tf_dataset().element_spec
        _keras_src.symbolic_build(self, spec)  # first: the window step needs optimizer variables
        self._make_window(spec)
        if self.micro_batch_size is not None:
            self._cut_batches(windows)
        if self._window.statistics:
            callbacks = list(callbacks or []) + [
                _SingleValueWarning(self._window.statistics, self._single_values)]
        try:
            with self._chief_writes(callbacks):
                return super().fit(windows, epochs=epochs, verbose=verbose,
                                   callbacks=callbacks, validation_data=validation_data,
                                   steps_per_epoch=steps_per_epoch, **kwargs)
        except replicas_lib.COLLECTIVE_ERRORS as error:
            if replicas_lib.workers(self.distribute_strategy) == 1:
                raise
            raise replicas_lib.WorkerFailed(
                "a collective with another worker failed in fit: that worker failed or went "
                "away (its own output says why); a collective strategy cannot go on, or "
                "retry, without it: start every worker again (a "
                "keras.callbacks.BackupAndRestore resumes from its last backup)", error) from None

    def _chief_writes(self, callbacks):
        """Off the chief, Keras 3's writing callbacks (no worker logic) run in step but write to a
        temporary directory; BackupAndRestore restores from backup_dir, which all must read."""
        strategy = self.distribute_strategy
        if replicas_lib.workers(strategy) == 1 or strategy.extended.should_checkpoint:
            return contextlib.nullcontext()
        if isinstance(callbacks, keras.callbacks.CallbackList):
            callbacks = callbacks.callbacks
        return _keras_src.elsewhere(list(callbacks or []),
                                    tempfile.mkdtemp(prefix="gradient_averaging_worker_"))

    def _make_window(self, spec):
        """The window step and its counters, again after a new compile (another optimizer)."""
        if self._window is not None and self._window.optimizer is self.optimizer:
            return
        statistics = statistics_lib.BatchStatistics(self, self.bn_statistics)
        window = step_lib.WindowStep(
            self.distribute_strategy, self.optimizer, self.trainable_variables, statistics,
            self.check_finite, _keras_src.summed_activity(self),
            lambda loss, parts, samples, _: _keras_src.log_window(self, loss, parts, samples))
        x = keras.utils.unpack_x_y_sample_weight(spec)[0]
        window.build_statistics(self, _any_samples(x))
        with self.distribute_strategy.scope():
            self._single_values = tf.Variable(tf.zeros([len(statistics.layers)], tf.float64),
                                              trainable=False)
            if self._skipped is None:
                self._skipped = tf.Variable(tf.constant(0, tf.int64), trainable=False)
        self._window = window
        self.train_function = None

        @tf.function(input_signature=[_any_samples(spec)])
        def one_pass(data):  # traced only, for the parts of the loss
            x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
            self._mini_batch_pass(
                *([tf.convert_to_tensor(v) for v in variables] for variables in (
                    self.trainable_variables, self.non_trainable_variables,
                    self.metrics_variables)),
                x, y, sample_weight, tf.shape(tf.nest.flatten(x)[0])[0])

        window.learn_layout(one_pass.get_concrete_function)

    def _cut_batches(self, windows):
        """The MicroBatch of fit's first batch, made again where its samples, window step or
        spec changed; "auto" searches with the pipeline's batches prefetched, as in training."""
        dataset = windows.get_tf_dataset()
        batches = iter(dataset)
        first = next(batches)
        samples = int(tf.shape(tf.nest.flatten(first)[0])[0])
        key = (samples, self._window, repr(_any_samples(dataset.element_spec)))
        if self._cut_for == key:
            return
        if self.micro_batch_size == "auto":
            self._cut = micro_batch_lib.find_micro_batch(
                self, first, samples, self.budget, self.margin, dataset.element_spec)
        else:
            self._cut = micro_batch_lib.plan(samples, self.micro_batch_size,
                                             self.distribute_strategy.num_replicas_in_sync)
        self._cut_for = key

    def trial_window(self, spec):
        """The micro_batch.Trial of batches like `spec` (the same samples on every replica)."""
        self.make_train_function()
        state = (self.trainable_variables + self.non_trainable_variables
                 + list(self.optimizer.variables) + self.metrics_variables
                 + [self._skipped, self._single_values])
        return micro_batch_lib.Trial(self._effective_windows(spec).add_batch, self._window,
                                     state, self.parallel_mini_batches, self._apply_window)

    def _windows(self, x, y, sample_weight, batch_size, shuffle, class_weight):
        """The _WindowAdapter of fit's inputs; the last one for the same dataset (slow to start)."""
        is_dataset = _keras_src.data_adapters.is_tf_dataset(x)
        cached = getattr(self, "_last_windows", (None, None, None))
        if is_dataset and cached[0] is x and cached[1] == class_weight:
            return cached[2]
        mini_batches = _keras_src.data_adapters.get_data_adapter(
            x, y, sample_weight, batch_size=batch_size or (None if is_dataset else 32),
            shuffle=shuffle and not is_dataset, class_weight=class_weight)
        windows = _WindowAdapter(mini_batches, self.average_gradients)
        if is_dataset:
            self._last_windows = (x, class_weight, windows)
        return windows

    def make_train_function(self, force=False):
        """Keras's train function: steps_per_execution windows a call; StopIteration at the end."""
        if self.train_function is not None and not force:
            return self.train_function
        if self._window is None:
            raise RuntimeError("the train function is made by fit(); call fit")
        if self._window.rescale:
            self._window.expected.assign(self.average_gradients)
        self._pass = (tf.function(self._mini_batch_pass, jit_compile=True)
                      if self.jit_compile else self._mini_batch_pass)
        self._apply_window = tf.function(self._apply_counted)  # its own call: trials time it
        self._adds = {}  # the EffectiveWindows by the batches' spec (_effective_windows)
        self.train_function = (self._window_train_function() if self.micro_batch_size is None
                               else self._effective_train_function())
        return self.train_function

    def _replica_mini_batches(self, group):
        """Replica context: adds mini-batches; passes may run at once, each on the last's state."""
        window = self._window
        state, metrics = self.non_trainable_variables, self.metrics_variables

        def run(data, weights, values):
            x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
            n_local = tf.shape(tf.nest.flatten(x)[0])[0]
            (gradients, state_values, metrics_values, parts,
             moments) = self._pass(weights, values[:len(state)], values[len(state):],
                                   x, y, sample_weight, n_local)
            finite = window_lib.finite(parts)
            # A non-finite mini-batch (its window is skipped) is left out of the logs.
            metrics_values = [tf.where(finite, value, before) for value, before in
                              zip(metrics_values, values[len(state):])]
            return ((gradients, moments, n_local, finite, parts),
                    list(state_values) + metrics_values)

        results = step_lib.run_passes(run, group, self.trainable_variables, state + metrics)
        return step_lib.last_of([window.add(*result) for result in results])

    def _window_train_function(self):
        strategy = self.distribute_strategy
        average_gradients = self.average_gradients

        @tf.function
        def window_from(iterator):
            count = step_lib.window_from(
                strategy, iterator, average_gradients,
                lambda group: strategy.run(self._replica_mini_batches, args=(group,)),
                self.parallel_mini_batches)
            return count, self._apply_counted(count)[1]

        self._window_function = window_from  # traced on the first window

        def train_function(iterator):
            logs = None
            for _ in range(self.steps_per_execution):
                count, step_logs = window_from(iterator)
                if not int(count):
                    break
                logs = step_logs
            if logs is None:
                raise StopIteration
            return logs

        return train_function

    def _effective_windows(self, spec):
        """The EffectiveWindows of batches like `spec`, one trace for any samples and size: each
        replica cuts its share (of a plain tensor: the whole) into mini-batches."""
        key = repr(spec)
        if key not in self._adds:
            strategy = self.distribute_strategy

            def replica_add(data, size):
                return window_lib.cut(data, size, self._replica_mini_batches,
                                      self.parallel_mini_batches)

            def add(data, size):
                added = strategy.run(replica_add, args=(data, size))
                return strategy.experimental_local_results(added)[0]

            signature = [_any_samples(spec), tf.TensorSpec([], tf.int32)]
            self._adds[key] = micro_batch_lib.EffectiveWindows(
                tf.function(add, input_signature=signature), self._window,
                self.non_trainable_variables + self.metrics_variables)
        return self._adds[key]

    def _effective_train_function(self):
        """The train function of effective batches: each taken eagerly, added, then applied."""
        window, replicas = self._window, self.distribute_strategy.num_replicas_in_sync

        def train_function(iterator):
            windows = self._effective_windows(iterator.element_spec)

            def train_window(batch):
                if window.rescale:
                    window.expected.assign(micro_batch_lib.mini_batches_of(
                        batch, self._cut.micro_batch_size * replicas))
                _, self._cut = windows.add(batch, self._cut)
                return windows.apply(self._apply_window)[1]

            return _run_batches(iterator, self.steps_per_execution, train_window)

        return train_function

    def _apply_counted(self, count=None):
        """Applies the window -> (applied, logs), counting a skip (with a `count`, only if > 0)."""
        applied, single = self._window.apply()
        skipped = (tf.logical_not(applied) if count is None
                   else tf.logical_and(count > 0, tf.logical_not(applied)))
        self._skipped.assign_add(tf.cast(skipped, tf.int64))
        self._single_values.assign_add(single)
        return applied, self.get_metrics_result()

    def make_test_function(self, force=False):
        """Keras's own on one device without a micro_batch_size; else each batch is evaluated in
        training's mini-batches (whole before an "auto" fit), its loss the summed losses over the
        summed divisors of all mini-batches and replicas (Keras's averages the replicas' means)."""
        strategy = self.distribute_strategy
        if self.micro_batch_size is None and strategy.num_replicas_in_sync == 1:
            return super().make_test_function(force)
        if self.test_function is not None and not force:
            return self.test_function

        @tf.function(reduce_retracing=True)
        def test_batch(data, size):
            strategy.run(self._replica_test, args=(data, size))
            return self.get_metrics_result()

        def test(batch):
            if isinstance(batch, tuple):  # test_on_batch's (x, y, None)
                batch = tuple(t for t in batch if t is not None)
            size = (self._cut.micro_batch_size if self._cut is not None  # per replica; 0: whole
                    else self.micro_batch_size if isinstance(self.micro_batch_size, int) else 0)
            return test_batch(batch, tf.constant(size, tf.int32))

        def test_function(iterator):
            return _run_batches(iterator, self.steps_per_execution, test)

        self.test_function = test_function
        return test_function

    def _replica_test(self, data, size):
        """Replica context: evaluates in mini-batches of `size` (0: whole), logs the loss."""
        samples = tf.shape(tf.nest.flatten(data)[0], out_type=tf.int32)[0]
        size = tf.where(size > 0, size, tf.maximum(samples, 1))
        count = tf.maximum((samples + size - 1) // size, 1)

        def mini_batch(i):
            return tf.nest.map_structure(lambda t: t[i * size:(i + 1) * size], data)

        def body(i, total):
            return i + 1, total + self._evaluated_parts(mini_batch(i))

        _, total = tf.while_loop(lambda i, _: i < count, body,
                                 (tf.constant(1), self._evaluated_parts(mini_batch(0))),
                                 parallel_iterations=window_lib.PARALLEL_ITERATIONS)
        total = tf.distribute.get_replica_context().all_reduce(
            tf.distribute.ReduceOp.SUM, total[:-1])
        loss, part_values = step_lib.loss_of(total)
        loss += step_lib.regularization(self.trainable_variables)
        _keras_src.log_window(self, loss, part_values, tf.cast(samples, tf.float32))

    def _evaluated_parts(self, data):
        """Updates the metrics on one mini-batch -> its parts' values, then its samples."""
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        n = tf.shape(tf.nest.flatten(x)[0])[0]
        records = []
        summed_activity = _keras_src.summed_activity(self)
        with summed_activity(records) if summed_activity else contextlib.nullcontext():
            y_pred = self(x, training=False)
        parts = _with_added_losses(_keras_src.loss_parts(self, y, y_pred, sample_weight),
                                   step_lib.data_losses(self, self.losses), n)
        if records:
            parts.append(window_lib.Part(tf.add_n([tf.cast(r, tf.float32) for r in records]),
                                       None, None, None))
        self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
        return tf.concat([step_lib.part_values(parts), [tf.cast(n, tf.float64)]], 0)

    def _mini_batch_pass(self, weights, non_trainable, metrics_values, x, y, sample_weight,
                         n_local):
        """A mini-batch's pass on values -> (terms' gradients, state, metrics, parts, moments)."""
        window = self._window

        def objective(y_pred, pass_losses, non_trainable_values):
            parts = _with_added_losses(_keras_src.loss_parts(self, y, y_pred, sample_weight),
                                       pass_losses, n_local)
            if not parts:
                raise ValueError("No loss to compute. Provide a `loss` argument in "
                                 "`compile()`.")
            return parts, (y_pred, non_trainable_values)

        step = window.mini_batch_gradients(self, weights, non_trainable, x, objective)
        y_pred, non_trainable_values = step.extra
        metrics = self.metrics_variables
        with keras.StatelessScope(state_mapping=list(zip(metrics, metrics_values))) as scope:
            self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
        return (step.gradients, non_trainable_values,
                [scope.get_current_value(v) for v in metrics], step.parts,
                step_lib.pass_moments(window.statistics, step))


class _SingleValueWarning(keras.callbacks.Callback):
    def __init__(self, statistics, single_values):
        super().__init__()
        self.statistics, self.single_values = statistics, single_values
        self._first = False

    def on_epoch_begin(self, epoch, logs=None):
        self._first = True

    def on_train_batch_end(self, batch, logs=None):
        if self._first:
            self._first = False
            self.on_epoch_end()

    def on_epoch_end(self, epoch=None, logs=None):
        self.statistics.warn_single_values(self.single_values.numpy())


class _WindowAdapter(_keras_src.DataAdapter):
    """Keras's adapter of the mini-batches, counted in windows of N: one train call each."""

    has_partial_batch, partial_batch_size = False, None

    def __init__(self, mini_batches, average_gradients):
        self.mini_batches = mini_batches
        self.average_gradients = average_gradients
        self._dataset = None

    def get_tf_dataset(self):
        if self._dataset is None:  # built once: Keras asks at every fit
            self._dataset = self.mini_batches.get_tf_dataset()
        return self._dataset

    @property
    def num_batches(self):
        mini_batches = self.mini_batches.num_batches
        if mini_batches is None:
            return None
        return math.ceil(mini_batches / self.average_gradients)

    @property
    def batch_size(self):
        return self.mini_batches.batch_size

    def on_epoch_begin(self):
        self.mini_batches.on_epoch_begin()

    def on_epoch_end(self):
        self.mini_batches.on_epoch_end()
