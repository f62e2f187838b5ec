"""The `--engine=tf2` side of main.py: the post's ConvNet as a Keras model, MNIST through
tf.data in the core's sample order, tf.distribute set-up, the same output and JSON.

The accumulation itself, usable on your own Keras model, is tf2_accumulator.py.
"""

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
from tf2_accumulator import GradientAccumulator

EVAL_BATCH = experiment.EVAL_BATCH
# Marks an event as a scalar for TensorBoard (what tf.summary.scalar adds, without
# needing the tensorboard package installed).
SCALAR_METADATA = summary_pb2.SummaryMetadata(
    plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name="scalars")
).SerializeToString()


class ConfigError(ValueError):
    """The tf2 engine cannot run this configuration here; the message says why."""


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
