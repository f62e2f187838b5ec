"""`accumulate(model, N)`: Keras's compile/fit with exact gradient averaging.

    with strategy.scope():                        # optional: tf.distribute
        model = accumulate(make_model(), average_gradients=8)
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy",
                      metrics=["accuracy"])
    model.fit(x, y, batch_size=32, epochs=3, callbacks=[...])   # 8 x 32 per update

or, the batch you want and the micro-batch that fits found for you:

    model = accumulate(make_model(), micro_batch_size="auto")
    model.compile(...)
    model.fit(x, y, batch_size=2048, epochs=3)    # one update per 2,048, cut to fit

The AccumulatingModel's train function trains a whole window of Keras's batches in one
compiled call, on the one window step (gradient_averaging.window_step) that the TF2
accumulators use too, with Keras's compiled loss and metrics. With a micro-batch size it
takes each batch from Keras's iterator first, so that a window that runs out of memory
can be trained again at half the micro-batch (micro_batch.EffectiveWindows); "auto" finds
it before training (micro_batch.find_micro_batch).
"""

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

# Refused here, in one line, where this Keras lacks or changed an internal fit relies on.
_keras_src.require(_keras_src.FIT)

# The trainer's steps a model may override; AccumulatingModel runs Keras's own instead.
OWN_STEPS = ("train_step", "compute_loss", "compute_metrics", "test_step")


def accumulate(model, average_gradients=None, check_finite=True, bn_statistics="update", *,
               micro_batch_size=None, budget=None, margin=None, parallel_mini_batches=1):
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
        per mini-batch, as Keras takes them (batch_statistics.BatchStatistics).
      micro_batch_size: instead of N: each batch fit is given (its batch_size, or a
        dataset's batches) is one update, its effective batch, trained as mini-batches
        of this many samples per replica, the last one shorter; "auto": the largest
        that fits, found before fit trains, on its first batch
        (micro_batch.find_micro_batch).
      budget: with "auto", the device memory to use in bytes (None: the device's).
      margin: with "auto", the fraction of the budget kept free (None: the device's
        default, device.default_margin).
      parallel_mini_batches: P, the mini-batches whose passes a window runs at once: 1
        holds one mini-batch's activations at a time, as B alone does; each one more
        costs a mini-batch's activations and gradients, and may be faster where one
        pass leaves the device idle (small mini-batches).

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
            "with gradient_averaging.MiniBatchAccumulator (accumulate(x, y) per mini-batch, "
            "apply() every N)")
    return AccumulatingModel(model, average_gradients, check_finite=check_finite,
                             bn_statistics=bn_statistics, micro_batch_size=micro_batch_size,
                             budget=budget, margin=margin,
                             parallel_mini_batches=parallel_mini_batches)


def _any_samples(spec):
    """`spec` (an element spec) with its tensors' first axis, the samples, of any size."""
    def relaxed(t):
        if isinstance(t, tf.TensorSpec) and t.shape.rank:
            return tf.TensorSpec([None] + t.shape[1:].as_list(), t.dtype)
        return t

    return tf.nest.map_structure(relaxed, spec)


def _next_batch(iterator, step):
    """The next batch of Keras's iterator for a call's `step`-th step (of compile's
    steps_per_execution), or None where it ended; StopIteration where it ended before
    the call's first, as Keras's own train and test functions end an epoch."""
    try:
        return next(iterator)
    except (StopIteration, tf.errors.OutOfRangeError):
        if not step:
            raise StopIteration from None
        return None


# Registered under the name the first release used, so that its .keras files load.
@keras.saving.register_keras_serializable(package="tf2_accumulator")
class AccumulatingModel(_keras_src.SpecBuilt, keras.Model):
    """A Keras model whose `fit` applies one update per window of N mini-batches.

    Keras's `fit` runs as it is; what changes is its train function
    (`make_train_function`, which Keras lets a model override): one call takes the
    next N of the mini-batches Keras makes of its inputs (numpy, a tf.data.Dataset...;
    shuffled as Keras shuffles them) from Keras's iterator, one at a time, hands each to
    the window step (its gradients added into the window's sums, Keras's loss tracker
    and compiled metrics updated as Keras's own train_step updates them), and applies
    the sample-weighted mean. Windows never cross an epoch's end: the last, partial one
    is applied before `on_epoch_end`. Everything else is Keras's own: callbacks see one
    batch per update (the progress bar counts updates), `evaluate`, `predict` and
    validation run the wrapped model, `save`/`load_model` round-trip (in any process
    that imports gradient_averaging: _saving.py). Under Keras's jit_compile, XLA
    compiles each mini-batch's pass.

    With a micro_batch_size, each batch Keras makes is one window, an effective batch:
    the train function takes it from Keras's iterator, a call cuts it, on each replica,
    into mini-batches of that size and adds them, and another applies the window. On one
    replica, a window that runs out of memory is trained again at half the micro-batch,
    which the rest of the run keeps (micro_batch.EffectiveWindows); "auto" finds it
    before training (fit's _cut_batches). `evaluate` (and fit's validation) evaluates
    each batch in mini-batches of the micro-batch too.

    Under a MultiWorkerMirroredStrategy of several workers (one TF_CONFIG each), where
    Keras 3's own fit fails (keras-team/keras#20585), fit, evaluate and predict run: the
    model is built from its data's spec, not from a first batch reduced eagerly
    (_keras_src.SpecBuilt), and evaluation reads the metrics across the replicas as the
    train function does. Each worker reads the whole data; Keras's autosharding gives
    each replica its share of every global batch (docs/multi-worker.md).

    Attributes:
      model: the wrapped Keras model.
      average_gradients: N (1 where each batch is an effective batch).
      micro_batch_size: None, "auto" or B per replica, as given.
      micro_batch: the micro_batch.MicroBatch fit cuts its batches by (B halved where a
        window ran out of memory), or None before fit.
      parallel_mini_batches: P, the mini-batches whose passes a window runs at once.
      skipped_windows: windows skipped for a non-finite loss or gradient so far.
    """

    def __init__(self, model, average_gradients=None, check_finite=True,
                 bn_statistics="update", micro_batch_size=None, budget=None,
                 margin=None, parallel_mini_batches=1, **kwargs):
        super().__init__(**kwargs)
        self.parallel_mini_batches = arguments.check_parallel_mini_batches(
            parallel_mini_batches)
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
        return self._cut

    def call(self, inputs, training=None):
        return self.model(inputs, training=training)

    @property
    def skipped_windows(self):
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
        """Keras's `fit`, one update per N batches of `batch_size` (the mini-batches), or
        with a micro_batch_size one update per batch (the effective batch).

        The arguments are Keras's, those after `callbacks` by keyword (the ones this does
        not read, `**kwargs`, passed on as given, so that Keras's own signature holds);
        `steps_per_epoch` counts mini-batches and must be a multiple of N. The returned
        History has one entry per epoch as usual; callbacks receive one batch per update.
        With a micro_batch_size, validation evaluates each batch in mini-batches of the
        micro-batch (make_test_function).
        """
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
        # Keras would build the metrics from its first element too; built here, before
        # the window step, whose variables need the optimizer's.
        _keras_src.symbolic_build(self, spec)
        self._make_window(spec)
        if self.micro_batch_size is not None:
            self._cut_batches(windows)
        if self._window.statistics:
            callbacks = list(callbacks or []) + [_SingleValueWarning(self)]
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
        """Under several workers, on a worker other than the chief: Keras's callbacks
        that write (ModelCheckpoint, TensorBoard, BackupAndRestore; Keras 3's have no
        worker logic) write to a directory of this worker's own, removed after fit, so
        that each file is written once, by the chief. Every worker still runs them (a
        save reads the variables, in step with the other workers). A BackupAndRestore
        restores from its backup_dir on every worker: where the workers are machines,
        that directory must be on storage they all read (docs/multi-worker.md)."""
        strategy = self.distribute_strategy
        if replicas_lib.workers(strategy) == 1 or strategy.extended.should_checkpoint:
            return contextlib.nullcontext()
        if isinstance(callbacks, keras.callbacks.CallbackList):
            callbacks = callbacks.callbacks
        return _keras_src.elsewhere(list(callbacks or []),
                                    tempfile.mkdtemp(prefix="gradient_averaging_worker_"))

    def _make_window(self, spec):
        """The window step for this model and optimizer (again after a new compile), its
        counters, and the train function to be traced again with them."""
        window = self._window
        if window is not None and window.optimizer is self.optimizer:
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
        """Each batch an effective batch: the MicroBatch that cuts them, of fit's first
        batch's samples, made before training, again only where those, the window step
        (a new compile: another optimizer) or the batches' spec changed. "auto": found
        while fit's input pipeline holds what it holds in training (its next batches,
        prefetched: on the CPU, device memory)."""
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
        """The micro_batch.Trial of this model (find_micro_batch's trials): the add fit
        trains batches like `spec` by (Keras's (x, y[, sample_weight])), given the same
        samples on every replica, the window step, the variables a trial may change,
        training's apply."""
        self.make_train_function()
        state = (self.trainable_variables + self.non_trainable_variables
                 + list(self.optimizer.variables) + self.metrics_variables
                 + [self._skipped, self._single_values])
        return micro_batch_lib.Trial(self._effective_windows(spec).add_batch, self._window,
                                     state, self.parallel_mini_batches, self._apply_window)

    def _windows(self, x, y, sample_weight, batch_size, shuffle, class_weight):
        """The _WindowAdapter of fit's inputs; the last one again for the same tf.data
        dataset (a new pipeline's first iterator is slow, a pass over it again fast: fit
        called again and again on one dataset must not pay it each time)."""
        is_dataset = _keras_src.data_adapters.is_tf_dataset(x)
        if is_dataset:
            cached = getattr(self, "_last_windows", None)
            if cached is not None and cached[0] is x and cached[1] == class_weight:
                return cached[2]
        mini_batches = _keras_src.data_adapters.get_data_adapter(
            x, y, sample_weight, batch_size=batch_size or (None if is_dataset else 32),
            shuffle=shuffle and not is_dataset, class_weight=class_weight)
        windows = _WindowAdapter(mini_batches, self.average_gradients)
        if is_dataset:
            self._last_windows = (x, class_weight, windows)
        return windows

    def make_train_function(self, force=False):
        """Keras's train function, compile's steps_per_execution windows per call (fewer
        where the iterator ends): -> the logs, or StopIteration where the iterator had
        no mini-batch left."""
        if self.train_function is not None and not force:
            return self.train_function
        if self._window is None:
            raise RuntimeError("the train function is made by fit(); call fit")
        if self._window.rescale:
            self._window.expected.assign(self.average_gradients)
        self._pass = (tf.function(self._mini_batch_pass, jit_compile=True)
                      if self.jit_compile else self._mini_batch_pass)
        # The effective batch's apply, a call of its own; the search's trials measure it.
        self._apply_window = tf.function(self._apply_counted)
        self._adds = {}  # the EffectiveWindows by the batches' spec (_effective_windows)
        self.train_function = (self._window_train_function() if self.micro_batch_size is None
                               else self._effective_train_function())
        return self.train_function

    def _replica_mini_batches(self, group):
        """Replica context: adds a group of mini-batches to the window. Their passes may
        run at once: each on the model's state and the metrics as the one before left
        them, as values (step_lib.run_passes)."""
        window = self._window
        state, metrics = self.non_trainable_variables, self.metrics_variables

        def run(data, weights, values):
            x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
            n_local = tf.shape(tf.nest.flatten(x)[0])[0]
            (gradients, state_values, metrics_values, parts,
             moments) = self._pass(weights, values[:len(state)], values[len(state):],
                                   x, y, sample_weight, n_local)
            finite = tf.reduce_all(tf.math.is_finite(parts))
            # A non-finite mini-batch (its window is skipped) is left out of the logs.
            metrics_values = [tf.where(finite, value, before) for value, before in
                              zip(metrics_values, values[len(state):])]
            return ((gradients, moments, n_local, finite, parts),
                    list(state_values) + metrics_values)

        results = step_lib.run_passes(run, group, self.trainable_variables, state + metrics)
        return step_lib.last_of([window.add(*result) for result in results])

    def _window_train_function(self):
        """The train function of windows of N mini-batches, each window one call."""
        window, strategy = self._window, self.distribute_strategy
        average_gradients = self.average_gradients

        @tf.function
        def window_from(iterator):
            count = step_lib.window_from(
                strategy, iterator, average_gradients,
                lambda group: strategy.run(self._replica_mini_batches, args=(group,)),
                self.parallel_mini_batches)
            applied, single = window.apply()
            self._skipped.assign_add(tf.cast(
                tf.logical_and(count > 0, tf.logical_not(applied)), tf.int64))
            self._single_values.assign_add(single)
            return count, self.get_metrics_result()

        self._window_function = window_from  # traced on the first window

        def train_function(iterator):
            # A call is compile's steps_per_execution steps (windows), as Keras counts them.
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
        """The micro_batch.EffectiveWindows of batches like `spec` (any samples): each
        replica cuts its share (a plain tensor under a strategy: the whole) into
        mini-batches of the size given, one trace for any samples and size."""
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
        """The train function where each batch is an effective batch: it takes the batch
        from Keras's iterator, eagerly, adds it as mini-batches of the MicroBatch's B
        (again at half B where it runs out of memory, on one replica:
        micro_batch.EffectiveWindows), then applies the window in a call of its own."""
        window, replicas = self._window, self.distribute_strategy.num_replicas_in_sync

        def train_function(iterator):
            windows = self._effective_windows(iterator.element_spec)
            logs = None
            for step in range(self.steps_per_execution):  # a window each
                batch = _next_batch(iterator, step)
                if batch is None:
                    break
                if window.rescale:
                    window.expected.assign(micro_batch_lib.mini_batches_of(
                        batch, self._cut.micro_batch_size * replicas))
                _, self._cut = windows.add(batch, self._cut)
                _, logs = windows.apply(self._apply_window)
            return logs

        return train_function

    def _apply_counted(self):
        """Applies the window, counts a skipped one and the batch-norm layers' single
        values: -> (applied, the metrics' results)."""
        applied, single = self._window.apply()
        self._skipped.assign_add(tf.cast(tf.logical_not(applied), tf.int64))
        self._single_values.assign_add(single)
        return applied, self.get_metrics_result()

    def make_test_function(self, force=False):
        """Keras's test function on one device without a micro_batch_size; else one that
        evaluates each batch in mini-batches of the micro-batch training uses (the
        whole batch before fit knows one), so that evaluation fits where training does,
        and divides as training does: the batch's loss is the sums of its mini-batches'
        and replicas' losses over the sums of their divisors (one all-reduce), as on one
        device. (Keras's own, under a strategy, averages the replicas' means; under
        several workers it reduces each step's logs along an axis they do not have, and
        fails: keras-team/keras#20585.) The compiled metrics are Keras's, over the batch."""
        strategy = self.distribute_strategy
        if self.micro_batch_size is None and strategy.num_replicas_in_sync == 1:
            return super().make_test_function(force)
        if self.test_function is not None and not force:
            return self.test_function

        @tf.function(reduce_retracing=True)
        def test_batch(data, size):
            strategy.run(self._replica_test, args=(data, size))
            return self.get_metrics_result()

        def test_function(iterator):
            logs = None
            for step in range(self.steps_per_execution):
                batch = _next_batch(iterator, step)
                if batch is None:
                    break
                # test_on_batch's (x, y, None): no sample weights to cut.
                if isinstance(batch, tuple):
                    batch = tuple(t for t in batch if t is not None)
                logs = test_batch(batch, tf.constant(self._evaluated_by(), tf.int32))
            return logs

        self.test_function = test_function
        return test_function

    def _replica_test(self, data, size):
        """Replica context: evaluates this replica's share of a batch in mini-batches of
        `size` (0: whole), one at a time, and logs the batch's loss across replicas."""
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
        """One mini-batch evaluated: its compiled metrics updated, and its parts' values
        (window_step.part_values) with its samples after them."""
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        n = tf.shape(tf.nest.flatten(x)[0])[0]
        records = []
        summed_activity = _keras_src.summed_activity(self)
        with summed_activity(records) if summed_activity else contextlib.nullcontext():
            y_pred = self(x, training=False)
        parts = _keras_src.loss_parts(self, y, y_pred, sample_weight)
        pass_losses = step_lib.data_losses(self, self.losses)
        if pass_losses:
            total = tf.add_n([tf.reduce_sum(tf.cast(loss, keras.config.floatx()))
                              for loss in pass_losses])
            parts.append(window_lib.Part(total * tf.cast(n, total.dtype), n, None,
                                       window_lib.SAMPLES))
        if records:
            parts.append(window_lib.Part(tf.add_n([tf.cast(r, tf.float32) for r in records]),
                                       None, None, None))
        self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
        return tf.concat([step_lib.part_values(parts), [tf.cast(n, tf.float64)]], 0)

    def _evaluated_by(self):
        """The mini-batch evaluation cuts a batch into, per replica; 0: none (the whole
        batch)."""
        if self._cut is not None:
            return self._cut.micro_batch_size
        if isinstance(self.micro_batch_size, int):
            return self.micro_batch_size
        return 0

    def _mini_batch_pass(self, weights, non_trainable, metrics_values, x, y, sample_weight,
                         n_local):
        """One mini-batch's pass on values, on Keras's compiled loss and metrics (XLA
        compiles it under jit_compile): (per term, the gradients of its sum, the model's
        other state, the metrics' values, the parts' values, the batch-norm sums)."""
        window = self._window

        def objective(y_pred, pass_losses, non_trainable_values):
            parts = _keras_src.loss_parts(self, y, y_pred, sample_weight)
            if pass_losses:  # add_loss's, each a mean over the samples, as Keras adds them
                total = tf.add_n([tf.reduce_sum(tf.cast(loss, keras.config.floatx()))
                                  for loss in pass_losses])
                parts.append(window_lib.Part(total * tf.cast(n_local, total.dtype), n_local,
                                           None, window_lib.SAMPLES))
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
        statistics = self.accumulating._window.statistics  # noqa: SLF001 (this module's model)
        if statistics:
            values = self.accumulating._single_values.numpy()  # noqa: SLF001 (this module's model)
            statistics.warn_single_values(values)


class _WindowAdapter(_keras_src.DataAdapter):
    """Keras's data adapter of the mini-batches, counted in windows of N: Keras runs the
    train function once per window, and each call takes the window's mini-batches from
    Keras's iterator of them (the last window of an epoch partial)."""

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
