"""Gradient accumulation in TF2: a GradientTape loop, Keras models, tf.data, tf.distribute.

The same update as the TF1 mechanism in `trainer.py`, written the TF2 way, for your own
Keras model and dataset:

    with strategy.scope():                       # optional: tf.distribute
        model = make_model()
        optimizer = keras.optimizers.Adam(1e-3)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
    fit_accumulated(model, dataset, optimizer, loss_fn, average_gradients=8)

Two compiled functions do the work (`GradientAccumulator`):
  * the micro-step computes, under a `tf.GradientTape`, the gradient of the SUM of the
    per-sample losses of one micro-batch and adds it into accumulator variables, with the
    number of samples into a counter;
  * the apply-step divides the sums by the count and applies that mean with the
    optimizer, then zeroes the accumulators.
Dividing summed per-sample gradients by the sample count makes the applied gradient
exactly that of the mean loss over every sample of the window, whatever the sizes of its
micro-batches (a short last slice, a partial window). A window in which any loss or
gradient is NaN or Inf is discarded whole instead (a check-step votes first): the
optimizer does not step, so its `iterations`, and any LR schedule, stay put.

Under a `tf.distribute` strategy each micro-batch is the GLOBAL one: every replica takes
its slice of it (replica r of K takes samples [n*r//K, n*(r+1)//K)), so the result does not
depend on the replica count. The accumulators are replica-local (SyncOnRead): a micro-step
communicates nothing; once per window a one-number vote (is anything non-finite?) is
summed over the replicas, and the apply-step all-reduces the summed gradients (inside the
Keras optimizer, which sums the replicas' contributions).

`prepare` and `train_once` are the `--engine=tf2` side of `main.py`: the post's ConvNet as a
Keras model, MNIST through tf.data in the core's sample order, the same output.
"""

import collections
import json
import logging
import os
import time

import keras
import numpy as np
import tensorflow as tf
from tensorflow.core.framework import summary_pb2

import checkpoint
import data
import experiment  # imports this module only inside train_once, so no import cycle
import model as tf1_model

EVAL_BATCH = experiment.EVAL_BATCH
# Ops that communicate between replicas; a test counts them in the compiled steps.
ALL_REDUCE_OPS = ("CollectiveReduce", "CollectiveReduceV2", "CollectiveReduceV3",
                  "CollectiveGather", "CollectiveGatherV2", "NcclAllReduce")

# Marks an event as a scalar for TensorBoard (what tf.summary.scalar adds, without
# needing the tensorboard package installed).
SCALAR_METADATA = summary_pb2.SummaryMetadata(
    plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name="scalars")
).SerializeToString()

FitSummary = collections.namedtuple(
    "FitSummary", ["micro_batches", "updates", "partial_window", "skipped_windows"],
    defaults=(0,))


class ConfigError(ValueError):
    """The tf2 engine cannot run this configuration here; the message says why."""


# ---------------------------------------------------------------- the accumulator


def _replica_slice(batch):
    """This replica's share of a global micro-batch: samples [n*r//K, n*(r+1)//K)."""
    ctx = tf.distribute.get_replica_context()
    first = tf.nest.flatten(batch)[0]
    n = tf.shape(first, out_type=tf.int64)[0]
    r = tf.cast(ctx.replica_id_in_sync_group, tf.int64)
    k = ctx.num_replicas_in_sync
    start, stop = n * r // k, n * (r + 1) // k
    return tf.nest.map_structure(lambda t: t[start:stop], batch), n, stop - start


def _local_variable(initial_value, aggregation, name):
    """A replica-local variable: updates stay on the replica; a cross-replica read aggregates."""
    return tf.Variable(initial_value, trainable=False, name=name,
                       synchronization=tf.VariableSynchronization.ON_READ,
                       aggregation=aggregation)


class GradientAccumulator:
    """Sums micro-batch gradients in variables; applies their sample-weighted mean.

    Attributes:
      micro_step: tf.function(x, y): adds one global micro-batch's summed gradients.
      apply_step: tf.function(): applies accumulators / samples, then zeroes them.
      check_step: tf.function() -> bool: whether the open window holds a NaN or Inf loss
        or gradient on any replica (the replicas' vote, summed).
      discard_step: tf.function(): zeroes the accumulators without applying them.
      window: micro-batches accumulated since the last update (a Python count).
      updates: updates applied so far.
      skipped_windows: windows discarded for a non-finite value (check_finite).
    """

    def __init__(self, model, optimizer, loss_fn, strategy=None, check_finite=True):
        """Creates the accumulators beside the model's variables.

        Args:
          model: a Keras model; created under `strategy.scope()` if a strategy is used.
          optimizer: a Keras optimizer, created under the same scope.
          loss_fn: (y_true, y_pred) -> per-sample losses, shape [batch] (e.g. a Keras
            loss with reduction=None); the applied gradient is that of their mean.
          strategy: a tf.distribute.Strategy, or None for the default (one device).
          check_finite: discard (not apply) a window holding a NaN or Inf loss or
            gradient; costs one small reduction per window.
        """
        self.model = model
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.strategy = strategy or tf.distribute.get_strategy()
        self.check_finite = check_finite
        self.variables = list(model.trainable_variables)
        if not self.variables:
            raise ValueError("the model has no trainable variables")
        with self.strategy.scope():
            if not optimizer.built:
                optimizer.build(self.variables)
            self.sums = [_local_variable(tf.zeros(v.shape, v.dtype), tf.VariableAggregation.SUM,
                                         f"accumulator_{i}")
                         for i, v in enumerate(self.variables)]
            # Every replica sees the whole global micro-batch, so each counts all samples.
            self.samples = _local_variable(0.0, tf.VariableAggregation.ONLY_FIRST_REPLICA,
                                           "window_samples")
            # Micro-batches of the open window whose loss was not finite, on this replica
            # (the gradient sums are checked when the window closes: a sum is finite only
            # if every term was).
            self.nonfinite = _local_variable(0.0, tf.VariableAggregation.SUM,
                                             "window_nonfinite")
            # Monitoring only (never reset): the running loss sum and samples trained.
            self.loss_total = _local_variable(tf.constant(0.0, tf.float64),
                                              tf.VariableAggregation.SUM, "loss_total")
            self.samples_total = _local_variable(
                tf.constant(0.0, tf.float64), tf.VariableAggregation.ONLY_FIRST_REPLICA,
                "samples_total")
        self._no_gradient = None  # which variables the loss does not reach (set when traced)
        self.micro_step = None  # compiled on the first batch, with its shapes
        self.apply_step = tf.function(self._apply_step)
        self.check_step = tf.function(self._check_step)
        self.discard_step = tf.function(self._discard_step)
        self.window = 0
        self.updates = 0  # apply() calls, as the optimizer's `iterations` counts them
        self.skipped_windows = 0

    @property
    def state_variables(self):
        """The accumulator's variables, each replica's copy apart: what a checkpoint of
        the open window must hold (a replica-local variable saved whole would be its
        cross-replica aggregate, and restored split evenly, not as it was)."""
        return [local for v in self.sums + [self.samples, self.nonfinite, self.loss_total,
                                            self.samples_total]
                for local in self.strategy.experimental_local_results(v)]

    # The replica functions.
    def _replica_micro(self, x, y):
        (x, y), n_global, n_local = _replica_slice((x, y))
        with tf.GradientTape() as tape:
            losses = self.loss_fn(y, self.model(x, training=True))
            if losses.shape.rank == 0:
                raise ValueError("loss_fn must return one loss per sample, not their mean "
                                 "(use a Keras loss with reduction=None)")
            loss_sum = tf.reduce_sum(tf.cast(losses, tf.float32))
            if self.model.losses:  # regularizers count once per sample, so once per mean
                loss_sum += tf.cast(n_local, tf.float32) * tf.add_n(self.model.losses)
        grads = tape.gradient(loss_sum, self.variables)
        self._no_gradient = [g is None for g in grads]
        if all(self._no_gradient):
            raise ValueError("no variable receives a gradient from the loss")
        for total, g in zip(self.sums, grads):
            if g is not None:
                total.assign_add(tf.convert_to_tensor(g))
        self.samples.assign_add(tf.cast(n_global, tf.float32))
        finite = tf.math.is_finite(loss_sum)
        self.nonfinite.assign_add(1.0 - tf.cast(finite, tf.float32))
        # A NaN must not poison the running loss that the logs report.
        self.loss_total.assign_add(tf.where(finite, tf.cast(loss_sum, tf.float64), 0.0))
        self.samples_total.assign_add(
            tf.where(finite, tf.cast(n_global, tf.float64), tf.constant(0.0, tf.float64)))

    def _replica_nonfinite(self):
        bad = self.nonfinite.read_value()
        for total in self.sums:
            bad += 1.0 - tf.cast(tf.reduce_all(tf.math.is_finite(total)), tf.float32)
        return bad

    def _replica_reset(self):
        for total in self.sums:
            total.assign(tf.zeros_like(total))
        self.samples.assign(0.0)
        self.nonfinite.assign(0.0)

    def _replica_apply(self):
        count = self.samples.read_value()
        # This replica's share of the mean; the optimizer all-reduces (sums) the shares.
        grads = [None if none else total.read_value() / tf.cast(count, total.dtype)
                 for total, none in zip(self.sums, self._no_gradient)]
        self.optimizer.apply_gradients(
            [(g, v) for g, v in zip(grads, self.variables) if g is not None])
        self._replica_reset()

    # The compiled steps.
    def _compile_micro_step(self, x, y):
        def spec(t):
            t = tf.convert_to_tensor(t)
            return tf.TensorSpec([None] + t.shape[1:].as_list(), t.dtype)

        signature = tf.nest.map_structure(spec, (x, y))

        @tf.function(input_signature=signature)
        def micro_step(x, y):
            self.strategy.run(self._replica_micro, args=(x, y))

        micro_step.get_concrete_function()  # traces it, so apply_step knows _no_gradient
        return micro_step

    def _apply_step(self):
        self.strategy.run(self._replica_apply)

    def _check_step(self):
        votes = self.strategy.run(self._replica_nonfinite)
        return self.strategy.reduce(tf.distribute.ReduceOp.SUM, votes, axis=None) > 0

    def _discard_step(self):
        self.strategy.run(self._replica_reset)

    def build(self, x, y):
        """Compiles the micro-step for batches shaped like (x, y), without training.

        `accumulate` does this on its first batch; call it first where an open window is
        restored from a checkpoint and may be applied before any new micro-batch.
        """
        if self.micro_step is None:
            self.micro_step = self._compile_micro_step(x, y)

    def accumulate(self, x, y):
        """Adds one global micro-batch (x, y) to the open window."""
        self.build(x, y)
        self.micro_step(x, y)
        self.window += 1

    def apply(self):
        """Applies the mean gradient of the open window (full or partial).

        With check_finite, a window holding a NaN or Inf loss or gradient is discarded
        instead: nothing is applied, the optimizer does not step, the accumulators are
        zeroed.

        Returns:
          True where the window was applied, False where it was discarded.
        """
        if not self.window:
            raise ValueError("no micro-batch accumulated since the last update")
        if self.micro_step is None:
            raise ValueError("an open window restored from a checkpoint needs build(x, y) "
                             "before it is applied")
        applied = not (self.check_finite and bool(self.check_step()))
        if applied:
            self.apply_step()
            self.updates += 1
        else:
            self.discard_step()
            self.skipped_windows += 1
        self.window = 0
        return applied

    def loss_totals(self):
        """(sum of per-sample training losses, samples) so far, over all replicas.

        Micro-batches whose loss was not finite are left out of both.
        """
        return float(self.loss_total.read_value()), float(self.samples_total.read_value())

    def fit(self, dataset, average_gradients, callback=None, warn_partial=True):
        """One pass over `dataset`, applying the mean gradient every N micro-batches.

        A trailing partial window is applied as the mean over its samples. A window with
        a non-finite loss or gradient is discarded, with a warning (check_finite).

        Args:
          dataset: an iterable of (x, y) global micro-batches (e.g. a tf.data.Dataset).
            Under a multi-worker strategy every worker must yield the same batches.
          average_gradients: N, micro-batches per update.
          callback: called as callback(micro_batch) after each micro-batch (1-based),
            after the update it completed, if any.
          warn_partial: log a warning when a partial window is applied.

        Returns:
          FitSummary(micro_batches, updates, partial_window, skipped_windows):
          partial_window is the number of micro-batches in the trailing partial window
          (0 if none).
        """
        if average_gradients < 1:
            raise ValueError(f"average_gradients must be >= 1, got {average_gradients}")
        micro_batches = updates = skipped = 0

        def close(size):
            """Applies or discards the window; returns whether it was applied."""
            nonlocal updates, skipped
            applied = self.apply()
            if applied:
                updates += 1
            else:
                skipped += 1
                logging.warning("non-finite loss or gradient in micro-batches %d-%d: the "
                                "window was discarded, not applied",
                                micro_batches - size + 1, micro_batches)
            return applied

        for x, y in dataset:
            self.accumulate(x, y)
            micro_batches += 1
            if self.window == average_gradients:
                close(self.window)
            if callback is not None:
                callback(micro_batches)
        partial = self.window
        if partial:
            applied = close(partial)
            if warn_partial and applied:
                logging.warning("%d micro-batches is not a multiple of average_gradients=%d: "
                                "the last %d were applied as one update of their mean",
                                micro_batches, average_gradients, partial)
        return FitSummary(micro_batches, updates, partial, skipped)


def fit_accumulated(model, dataset, optimizer, loss_fn, average_gradients, strategy=None,
                    callback=None):
    """Trains a Keras model on `dataset`, one update per `average_gradients` micro-batches.

    Each update applies the gradient of the mean loss over all samples of its window, as
    one batch of those samples would; see GradientAccumulator for the arguments.

    Returns:
      FitSummary(micro_batches, updates, partial_window, skipped_windows).
    """
    accumulator = GradientAccumulator(model, optimizer, loss_fn, strategy)
    return accumulator.fit(dataset, average_gradients, callback=callback)


def count_all_reduces(concrete_function):
    """Number of cross-replica reduction ops in a traced function and its library."""
    graph_def = concrete_function.graph.as_graph_def()
    nodes = list(graph_def.node)
    for function in graph_def.library.function:
        nodes.extend(function.node_def)
    return sum(node.op in ALL_REDUCE_OPS for node in nodes)


# ---------------------------------------------------------------- learning rate


def learning_rate(value, schedule="constant", decay_steps=100, decay_rate=0.96):
    """Adam's learning rate: a number, or a schedule over optimizer updates.

    The optimizer's `iterations` count `apply_gradients` calls, one per update, so the
    schedule advances once per update whatever the number of micro-batches.
    """
    if schedule == "constant":
        return value
    if schedule == "exponential":
        return keras.optimizers.schedules.ExponentialDecay(value, decay_steps, decay_rate)
    raise ValueError(f"unknown learning-rate schedule {schedule!r}")


# ---------------------------------------------------------------- the models


def conv_net(dropout=0.5, seed=0):
    """The post's ConvNet (model.conv_net) as a Keras model: 44,426 parameters.

    Glorot-uniform kernels seeded by (seed, layer), zero biases, linear logits; input
    dropout min(0.2, dropout), hidden dropout `dropout`, none at all when it is 0.
    """
    layers = _Layers(seed)
    return keras.Sequential(
        [keras.Input(data.IMAGE_SHAPE), layers.dropout(min(tf1_model.INPUT_DROPOUT_CAP, dropout)),
         layers.conv(6), keras.layers.MaxPool2D(2), layers.dropout(dropout),
         layers.conv(16), keras.layers.MaxPool2D(2), layers.dropout(dropout),
         keras.layers.Flatten(),
         layers.dense(120, "relu"), layers.dropout(dropout),
         layers.dense(84, "relu"), layers.dropout(dropout),
         layers.dense(data.NUM_CLASSES)], name="convnet")


def mlp(dropout=0.5, seed=0, hidden=(4096, 4096)):
    """model.mlp as a Keras model: 784-4096-4096-10."""
    layers = _Layers(seed)
    stack = [keras.Input(data.IMAGE_SHAPE), keras.layers.Flatten(),
             layers.dropout(min(tf1_model.INPUT_DROPOUT_CAP, dropout))]
    for width in hidden:
        stack += [layers.dense(width, "relu"), layers.dropout(dropout)]
    return keras.Sequential(stack + [layers.dense(data.NUM_CLASSES)], name="mlp")


class _Layers:
    """Layer factories with per-layer seeds, so initial weights depend on the seed only.

    Kernels and dropout layers count separately: turning dropout off changes no kernel.
    """

    def __init__(self, seed):
        self.kernel_seed, self.dropout_seed = seed * 100, seed * 100 + 50

    def _kernel_initializer(self):
        self.kernel_seed += 1
        return keras.initializers.GlorotUniform(self.kernel_seed)

    def conv(self, filters):
        return keras.layers.Conv2D(filters, 5, padding="valid", activation="relu",
                                   kernel_initializer=self._kernel_initializer())

    def dense(self, units, activation=None):
        return keras.layers.Dense(units, activation=activation,
                                  kernel_initializer=self._kernel_initializer())

    def dropout(self, rate):
        if rate <= 0:
            return keras.layers.Identity()
        self.dropout_seed += 1
        return keras.layers.Dropout(rate, seed=self.dropout_seed)


MODELS = {"convnet": conv_net, "mlp": mlp}


def sparse_cross_entropy(labels, logits):
    """Per-sample softmax cross-entropy of int labels: the ConvNet's loss, unreduced."""
    return tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits)


# ---------------------------------------------------------------- tf.data


def mnist_batches(split, batch_size, iterations, seed, position=0):
    """`iterations` mini-batches of `split` through tf.data, in data.SampleStream's order.

    The index batches come from the same SampleStream as the tf1 engine's, so both
    engines see the same samples in the same order; tf.data gathers the images.
    `position` (samples already consumed) starts the stream where a resumed run stopped.
    """
    def index_batches():
        stream = data.SampleStream(len(split.labels), seed, position)
        for _ in range(iterations):
            yield stream.next_indices(batch_size)

    images, labels = tf.constant(split.images), tf.constant(split.labels)
    indices = tf.data.Dataset.from_generator(
        index_batches, output_signature=tf.TensorSpec([None], tf.int64))
    return indices.map(lambda i: (tf.gather(images, i), tf.gather(labels, i))) \
        .prefetch(tf.data.AUTOTUNE)


# ---------------------------------------------------------------- the engine

_SETUP = {}  # this process's set-up: TensorFlow allows one per process
DEFAULT_SETUP = ("none", 0, 0)  # (strategy, replicas, threads) that changes nothing


def prepare(config):
    """Process-wide set-up for --engine=tf2: threads, logical devices, the strategy.

    Must run before TensorFlow initializes its runtime (before any op runs), and only
    once per process with anything but the defaults.

    Returns:
      The tf.distribute.Strategy to train under.

    Raises:
      ConfigError: the devices or TF_CONFIG do not allow this configuration, or the
        process was already set up otherwise.
    """
    if config.strategy == "multi_worker":
        _check_tf_config()
    setup = (config.strategy, config.replicas, config.threads)
    if _SETUP:
        if _SETUP["setup"] != setup:
            raise ConfigError("this process is already set up as --strategy=%s --replicas=%d "
                              "--threads=%d; TensorFlow allows one set-up per process"
                              % _SETUP["setup"])
        return _SETUP["strategy"]
    if setup == DEFAULT_SETUP:
        return tf.distribute.get_strategy()
    try:
        if config.threads:
            tf.config.threading.set_intra_op_parallelism_threads(config.threads)
            tf.config.threading.set_inter_op_parallelism_threads(config.threads)
        if config.strategy == "mirrored":
            strategy = tf.distribute.MirroredStrategy(_mirrored_devices(config.replicas))
        elif config.strategy == "multi_worker":
            strategy = tf.distribute.MultiWorkerMirroredStrategy()
        else:
            strategy = tf.distribute.get_strategy()
    except RuntimeError as e:  # TensorFlow's runtime already started
        raise ConfigError(f"--strategy={config.strategy} --replicas={config.replicas} "
                          f"--threads={config.threads} must be set up before TensorFlow "
                          f"starts: {str(e).splitlines()[0]}") from None
    _SETUP.update(setup=setup, strategy=strategy)
    return strategy


def _mirrored_devices(replicas):
    """The first `replicas` GPUs (0: all); without GPUs, the CPU split into that many."""
    gpus = tf.config.list_physical_devices("GPU")
    if gpus:
        if replicas > len(gpus):
            raise ConfigError(f"--replicas={replicas} but only {len(gpus)} GPUs are visible")
        return [f"/gpu:{i}" for i in range(replicas or len(gpus))]
    if replicas > 1:
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(replicas)])
    return [d.name for d in tf.config.list_logical_devices("CPU")][:max(replicas, 1)]


def _check_tf_config():
    """One clear line for a malformed TF_CONFIG (unset means a single local worker)."""
    raw = os.environ.get("TF_CONFIG")
    if not raw:
        return
    try:
        tf_config = json.loads(raw)
        workers = tf_config["cluster"]["worker"]
        index = tf_config["task"]["index"]
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"TF_CONFIG is not a cluster spec with a worker task ({e})") from None
    if not 0 <= int(index) < len(workers):
        raise ConfigError(f"TF_CONFIG: task index {index} but {len(workers)} workers")


def train_once(config, datasets, seed, verbose=False, log=print, logdir=None,
               checkpoint_dir=None, checkpoint_every=experiment.CHECKPOINT_EVERY,
               should_stop=None):
    """The tf2 engine's run: as experiment.train_once, through GradientAccumulator.

    Evaluates every `config.eval_every` iterations (micro-batches), or every
    `config.eval_every_updates` updates, and once at the end. Windows with a non-finite
    loss or gradient are discarded as `config.on_nonfinite` and `max_bad_windows` say.

    Args:
      logdir: TensorBoard events as the tf1 engine writes them (`train/loss` per update,
        `test/accuracy` per evaluation, against updates applied).
      checkpoint_dir: this run's checkpoint directory (checkpoint.RunCheckpoint's files,
        the variables in a tf.train.Checkpoint): saved every `checkpoint_every` updates,
        when stopped, and when finished; resumed from when present. Not with
        multi_worker (every worker would write the same files).
      should_stop: called after every mini-batch; a non-empty return (e.g. "SIGTERM")
        saves a checkpoint and raises Stopped.

    Returns:
      the dict of experiment.train_once.

    Raises:
      experiment.Stopped: by `should_stop` or by non-finite windows.
      checkpoint.CheckpointError: the checkpoint is unusable or of another configuration.
      ConfigError: a checkpoint directory with --strategy=multi_worker.
    """
    if checkpoint_dir and config.strategy == "multi_worker":
        raise ConfigError("--checkpoint-dir does not work with --strategy=multi_worker")
    strategy = prepare(config)
    saved = None
    if checkpoint_dir:
        # The replica count shapes the saved window (one copy per replica), so it counts.
        ckpt = checkpoint.RunCheckpoint(checkpoint_dir, dict(
            experiment.identity(config, seed), strategy=config.strategy,
            replicas=strategy.num_replicas_in_sync))
        saved = ckpt.load()
        if saved and saved["finished"]:
            return saved["result"]
    with strategy.scope():
        net = MODELS[config.model](config.dropout, seed)
        optimizer = keras.optimizers.Adam(learning_rate(
            config.learning_rate, config.lr_schedule, config.lr_decay_steps,
            config.lr_decay_rate))
    accumulator = GradientAccumulator(net, optimizer, sparse_cross_entropy, strategy)
    accumulator.build(datasets.train.images[:1], datasets.train.labels[:1])
    # Everything a resumed run needs: the weights with dropout's seed-generator states
    # (net.variables holds both), Adam's slots and iterations, the open window.
    variables = _CheckpointFiles(model=list(net.variables), optimizer=list(optimizer.variables),
                                 window=accumulator.state_variables)
    if verbose:
        replicas = strategy.num_replicas_in_sync
        log(f"Strategy {config.strategy}: {replicas} replica{'s' * (replicas != 1)} in sync")
    writer = tf.summary.create_file_writer(logdir) if logdir else None
    run = _Training(config, datasets, net, accumulator, writer, verbose, log)
    if saved:
        ckpt.restore(None, variables, saved)
        run.restore(saved)

    def save():
        if checkpoint_dir:
            ckpt.save(None, variables, run.iteration, run.state(), window={})

    def stop(reason):
        save()
        where = (f"checkpoint in {checkpoint_dir}; run the same command to resume"
                 if checkpoint_dir else "no --checkpoint-dir, so this run is lost")
        raise experiment.Stopped(f"{reason}; stopped at iteration {run.iteration} "
                                 f"({accumulator.window} mini-batches in the open window); "
                                 f"{where}")

    batches = iter(mnist_batches(datasets.train, config.batch_size,
                                 config.iterations - run.iteration, seed,
                                 position=run.iteration * config.batch_size))
    while run.iteration < config.iterations:
        start = time.perf_counter()
        x, y = next(batches)
        closed = run.step(x, y)
        run.train_seconds += time.perf_counter() - start
        verdict = run.bad_windows_verdict() if closed else None
        if verdict:
            stop(verdict)
        if run.eval_due(closed):
            run.evaluate()
        if closed and accumulator.updates and accumulator.updates % checkpoint_every == 0:
            save()
        reason = should_stop() if should_stop else None
        if reason:
            stop(f"interrupted by {reason}")

    held = accumulator.window
    if held:
        start = time.perf_counter()
        applied = accumulator.apply()
        run.close_window(applied)
        run.train_seconds += time.perf_counter() - start
        if applied:
            logging.warning("--iterations=%d is not a multiple of --average-gradients=%d: "
                        "the last %d mini-batches were applied as one update of their "
                        "mean", config.iterations, config.average_gradients, held)
        verdict = run.bad_windows_verdict()
        if verdict:
            stop(verdict)
    final_accuracy = run.evaluate()
    if writer:
        writer.close()
    result = {"seed": seed, "best_accuracy": run.best_accuracy,
              "best_iteration": run.best_iteration, "final_accuracy": final_accuracy,
              "updates": int(optimizer.iterations.numpy()),
              "skipped_windows": accumulator.skipped_windows,
              "train_seconds": run.train_seconds, "eval_seconds": run.eval_seconds,
              "weights_sha256": weights_digest(net)}
    if checkpoint_dir:
        ckpt.save_finished(result)
    return result


class _CheckpointFiles:
    """A tf.train.Checkpoint behind the two calls RunCheckpoint makes of a tf1 Saver."""

    def __init__(self, **objects):
        self.checkpoint = tf.train.Checkpoint(**objects)

    def save(self, unused_sess, prefix, global_step, **unused_saver_options):
        return self.checkpoint.write(f"{prefix}-{global_step}")

    def restore(self, unused_sess, prefix):
        try:
            self.checkpoint.read(prefix).assert_consumed()
        # What TensorFlow raises for a truncated, corrupt or foreign checkpoint.
        except (tf.errors.OpError, AssertionError, ValueError, IndexError, OSError) as e:
            message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise checkpoint.CheckpointError(f"{prefix}: unusable checkpoint ({message})") \
                from None


def weights_digest(net):
    """experiment.digest_arrays of a Keras model's trainable variables."""
    return experiment.digest_arrays(v.numpy() for v in net.trainable_variables)


class _Training:
    """One tf2 run's loop state, evaluation and logging, on the tf1 engine's cadence."""

    def __init__(self, config, datasets, net, accumulator, writer, verbose, log):
        self.config, self.test, self.accumulator = config, datasets.test, accumulator
        self.writer, self.verbose, self.log = writer, verbose, log
        self.iteration = 0
        self.best_accuracy, self.best_iteration = -1.0, 0
        self.train_seconds = self.eval_seconds = 0.0
        self.consecutive_bad = 0
        self.last_bad = None
        self.window_start = 1  # first iteration of the open window
        self.eval_totals = self.update_totals = (0.0, 0.0)  # loss totals at the last mark
        self.test_images = tf.constant(self.test.images)
        self.test_labels = tf.constant(self.test.labels)

        @tf.function
        def num_correct(images, labels):
            predicted = tf.argmax(net(images, training=False), axis=1)
            return tf.reduce_sum(tf.cast(tf.equal(predicted, labels), tf.int64))

        self.num_correct = num_correct

    # ------------------------------------------------ checkpoint state

    def state(self):
        accumulator = self.accumulator
        # The data position is the samples consumed; tf.data's prefetch runs ahead of it.
        return {"iteration": self.iteration,
                "position": self.iteration * self.config.batch_size,
                "updates": accumulator.updates, "skipped_windows": accumulator.skipped_windows,
                "open_window": accumulator.window, "consecutive_bad": self.consecutive_bad,
                "last_bad": self.last_bad, "window_start": self.window_start,
                "best_accuracy": self.best_accuracy, "best_iteration": self.best_iteration,
                "train_seconds": self.train_seconds, "eval_seconds": self.eval_seconds,
                "eval_totals": list(self.eval_totals),
                "update_totals": list(self.update_totals)}

    def restore(self, state):
        accumulator = self.accumulator
        accumulator.updates, accumulator.skipped_windows = (state["updates"],
                                                            state["skipped_windows"])
        accumulator.window = state["open_window"]
        self.iteration = state["iteration"]
        self.consecutive_bad, self.last_bad = state["consecutive_bad"], state["last_bad"]
        self.window_start = state["window_start"]
        self.best_accuracy, self.best_iteration = state["best_accuracy"], state["best_iteration"]
        self.train_seconds, self.eval_seconds = state["train_seconds"], state["eval_seconds"]
        self.eval_totals = tuple(state["eval_totals"])
        self.update_totals = tuple(state["update_totals"])

    # ------------------------------------------------ the loop

    def step(self, x, y):
        """Trains one mini-batch; returns True where it closed a window."""
        self.iteration += 1
        if self.iteration in self.config.inject_nonfinite:
            x = np.array(x)
            x[0] = np.nan
        self.accumulator.accumulate(x, y)
        if self.accumulator.window < self.config.average_gradients:
            return False
        self.close_window(self.accumulator.apply())
        return True

    def close_window(self, applied):
        """Accounts for a window just applied (True) or discarded (False)."""
        if applied:
            self.consecutive_bad = 0
            self.record_update()
        else:
            self.consecutive_bad += 1
            self.last_bad = f"iterations {self.window_start}-{self.iteration}"
            logging.warning(experiment.DISCARDED_WINDOW, self.last_bad,
                            self.accumulator.skipped_windows)
            if self.writer:  # the next update's loss leaves this window out
                self.update_totals = self.accumulator.loss_totals()
        self.window_start = self.iteration + 1

    def bad_windows_verdict(self):
        """Why training must stop over non-finite windows, or None."""
        return experiment.bad_windows_verdict(self.config, self.consecutive_bad,
                                              self.last_bad)

    def _mean_loss_since(self, mark):
        totals = self.accumulator.loss_totals()
        samples = totals[1] - mark[1]
        return ((totals[0] - mark[0]) / samples if samples else float("nan")), totals

    def eval_due(self, closed):
        config = self.config
        if self.iteration >= config.iterations:
            return False  # the final evaluation follows the last update
        if config.eval_every and self.iteration % config.eval_every == 0:
            return True
        updates = self.accumulator.updates
        return bool(config.eval_every_updates and closed and updates
                    and updates % config.eval_every_updates == 0)

    def _scalar(self, tag, value):
        """A scalar event at the current update (tf.summary.write: no TensorBoard needed)."""
        with self.writer.as_default():
            tf.summary.write(tag, tf.constant(value, tf.float32), step=self.accumulator.updates,
                             metadata=SCALAR_METADATA)

    def record_update(self):
        """The update's mean training loss as a `train/loss` event (with a logdir)."""
        if self.writer:
            loss, self.update_totals = self._mean_loss_since(self.update_totals)
            self._scalar("train/loss", loss)

    def evaluate(self):
        start = time.perf_counter()
        correct = sum(int(self.num_correct(self.test_images[i:i + EVAL_BATCH],
                                           self.test_labels[i:i + EVAL_BATCH]))
                      for i in range(0, len(self.test.labels), EVAL_BATCH))
        accuracy = 100.0 * correct / len(self.test.labels)
        if accuracy > self.best_accuracy:
            self.best_accuracy, self.best_iteration = accuracy, self.iteration
        if self.verbose:
            loss, self.eval_totals = self._mean_loss_since(self.eval_totals)
            self.log(f"Iteration {self.iteration}: loss {loss:.4f}, accuracy {accuracy:.2f}")
        if self.writer:
            self._scalar("test/accuracy", accuracy)
        self.eval_seconds += time.perf_counter() - start
        return accuracy
