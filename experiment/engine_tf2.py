"""The tf2 engine: the post's ConvNet as a Keras model (model.keras_model), trained one
compiled call per window on MNIST in the tf1 engine's sample order, tf.distribute set-up.

loop.py drives it, as engine_tf1.py, through interfaces.Engine. The accumulation itself,
usable on your own Keras model, is the library's gradient_averaging.tf2.
"""

import gc
import json
import os

import keras
import numpy as np
import tensorflow as tf

import model
from experiment import checkpoint
from experiment import data
from experiment import workers
from gradient_averaging import micro_batch
from gradient_averaging.tf2 import WindowAccumulator
from trainer import Outcome


class ConfigError(ValueError):
    """The tf2 engine cannot run this configuration here; the message says why."""


# ---------------------------------------------------------------- learning rate


def learning_rate(value, schedule="constant", decay_steps=100, decay_rate=0.96):
    """Adam's learning rate: a number, or a schedule over optimizer updates.

    The optimizer's `iterations` count `apply_gradients` calls, one per update, so the
    schedule advances once per update whatever the number of mini-batches.
    """
    if schedule == "constant":
        return value
    if schedule == "exponential":
        return keras.optimizers.schedules.ExponentialDecay(value, decay_steps, decay_rate)
    raise ValueError(f"unknown learning-rate schedule {schedule!r}")


# ---------------------------------------------------------------- the loss


def sparse_cross_entropy(labels, logits):
    """Per-sample softmax cross-entropy of int labels: the ConvNet's loss, unreduced."""
    return tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits)


# ---------------------------------------------------------------- the engine

_SETUP = {}  # this process's set-up: TensorFlow allows one per process
DEFAULT_SETUP = ("none", 0, 0)  # (distribute, replicas, threads) that changes nothing


def prepare(config):
    """Process-wide set-up for the tf2 engine: threads, logical devices, the strategy.

    Must run before TensorFlow initializes its runtime (before any op runs), and only
    once per process with anything but the defaults.

    Returns:
      The tf.distribute.Strategy to train under.

    Raises:
      ConfigError: the devices or TF_CONFIG do not allow this configuration, or the
        process was already set up otherwise.
    """
    if config.distribute == "multi_worker":
        _check_tf_config()
    setup = (config.distribute, config.replicas, config.threads)
    if _SETUP:
        if _SETUP["setup"] != setup:
            distribute, replicas, threads = _SETUP["setup"]
            raise ConfigError(f"this process is already set up as distribute={distribute} "
                              f"replicas={replicas:d} threads={threads:d}; TensorFlow allows "
                              "one set-up per process")
        return _SETUP["strategy"]
    if setup == DEFAULT_SETUP:
        return tf.distribute.get_strategy()
    try:
        if config.threads:
            tf.config.threading.set_intra_op_parallelism_threads(config.threads)
            tf.config.threading.set_inter_op_parallelism_threads(config.threads)
        if config.distribute == "mirrored":
            strategy = tf.distribute.MirroredStrategy(_mirrored_devices(config.replicas))
        elif config.distribute == "multi_worker":  # a collective that waits longer fails
            strategy = tf.distribute.MultiWorkerMirroredStrategy(
                communication_options=tf.distribute.experimental.CommunicationOptions(
                    timeout_seconds=config.worker_timeout or None))
        else:
            strategy = tf.distribute.get_strategy()
    except RuntimeError as e:  # TensorFlow's runtime already started
        raise ConfigError(f"distribute={config.distribute} replicas={config.replicas} "
                          f"threads={config.threads} must be set up before TensorFlow "
                          f"starts: {str(e).splitlines()[0]}") from None
    _SETUP.update(setup=setup, strategy=strategy)
    return strategy


def _mirrored_devices(replicas):
    """The first `replicas` GPUs (0: all); without GPUs, the CPU split into that many."""
    gpus = tf.config.list_physical_devices("GPU")
    if gpus:
        if replicas > len(gpus):
            raise ConfigError(f"replicas={replicas} but only {len(gpus)} GPUs are visible")
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


def identity(config):
    """Settings a checkpoint must share beyond the run's Config.

    The replica count shapes the saved loss totals (one copy per replica), so it counts.
    XLA (jit_compile) trains to other bits, so a run with it resumes only from its own
    checkpoints; it is recorded only where on, so checkpoints made before the flag existed
    still resume without it. Under multi_worker the number of workers is recorded first
    (before the replicas it implies), so that the refusal names it.
    """
    cluster = {"workers": workers.count(config)} if config.distribute == "multi_worker" else {}
    return dict({"distribute": config.distribute, **cluster,
                 "replicas": prepare(config).num_replicas_in_sync},
                **({"jit_compile": True} if config.jit_compile else {}))


def find_micro_batch(config):
    """The micro-batch of config's effective batch that fits in the device's memory:
    the library's search (gradient_averaging.micro_batch.find_micro_batch) on the
    accumulator a run builds (the model, Adam), on zeros of MNIST's shapes, let go after.

    Raises:
      ValueError: the device's memory cannot be read, or nothing fits (NothingFits).
    """
    strategy = prepare(config)
    with strategy.scope():
        net = model.keras_model(config.model, config.dropout, 0)
        optimizer = keras.optimizers.Adam(config.learning_rate)
    accumulator = WindowAccumulator(net, optimizer, sparse_cross_entropy, strategy,
                                    jit_compile=config.jit_compile,
                                    parallel_mini_batches=config.parallel_mini_batches)
    samples = config.effective_batch_size  # MNIST's shapes; the values do not matter
    zeros = (np.zeros((samples,) + data.IMAGE_SHAPE, data.IMAGE_DTYPE),
             np.zeros(samples, data.LABEL_DTYPE))
    try:
        return micro_batch.find_micro_batch(accumulator, zeros, samples)
    finally:
        del net, optimizer, accumulator
        gc.collect()  # the trials' model let go before the run builds its own


class Engine:
    """One tf2 run (an interfaces.Engine): the Keras model, Adam and a WindowAccumulator,
    under the tf.distribute strategy, each mini-batch's pass compiled by XLA with jit_compile.

    `step` copies each mini-batch into a window buffer, and the N-th trains the window:
    in one compiled call (WindowAccumulator.apply_stacked), or with an effective batch on
    one replica as one effective batch (apply_effective), which trains again at half the
    micro-batch where it runs out of memory. The open window is the buffered inputs,
    which a checkpoint saves as arrays.
    """

    def __init__(self, config, seed):
        self.config, self.seed = config, seed
        self.strategy = prepare(config)
        with self.strategy.scope():
            self.net = model.keras_model(config.model, config.dropout, seed)
            self.optimizer = keras.optimizers.Adam(learning_rate(
                config.learning_rate, config.lr_schedule, config.lr_decay_steps,
                config.lr_decay_rate))
        self.accumulator = WindowAccumulator(
            self.net, self.optimizer, sparse_cross_entropy, self.strategy,
            jit_compile=config.jit_compile, parallel_mini_batches=config.parallel_mini_batches)
        n, b = config.average_gradients, config.batch_size
        self._images = np.zeros((n, b) + data.IMAGE_SHAPE, data.IMAGE_DTYPE)
        self._labels = np.zeros((n, b), data.LABEL_DTYPE)
        self._sizes = np.zeros(n, np.int32)
        self._open = 0  # mini-batches buffered in the open window
        # With an effective batch, on one replica: how windows are cut, B halved where one
        # runs out of memory (apply_effective); else each window in one call as buffered.
        self.micro_batch = (micro_batch.plan(config.effective_batch_size, b)
                            if config.effective_batch_size
                            and self.strategy.num_replicas_in_sync == 1 else None)
        if self.micro_batch is None:  # compiled now, out of the timed loop (and every
            # worker must run it)
            self.accumulator.build_window(self._images, self._labels, self._sizes)
        # Everything a resumed run needs beside the buffered window: the weights with
        # dropout's seed-generator states (net.variables holds both), Adam's slots and
        # iterations, and the running loss totals (each replica's copy apart).
        totals = [local for v in (self.accumulator.loss_total, self.accumulator.samples_total)
                  for local in self.strategy.experimental_local_results(v)]
        self.variables = tf.train.Checkpoint(model=list(self.net.variables),
                                             optimizer=list(self.optimizer.variables),
                                             loss_totals=totals)

        @tf.function(input_signature=(  # one trace for every chunk size
            tf.TensorSpec((None,) + data.IMAGE_SHAPE, data.IMAGE_DTYPE),
            tf.TensorSpec((None,), data.LABEL_DTYPE)))
        def num_correct(images, labels):
            predicted = tf.argmax(self.net(images, training=False), axis=1)
            return tf.reduce_sum(tf.cast(tf.equal(predicted, labels), tf.int64))

        self._num_correct = num_correct

    def summary(self):
        """A line for the verbose log: the tf.distribute strategy and its replicas."""
        replicas = self.strategy.num_replicas_in_sync
        return (f"--distribute={self.config.distribute}: {replicas} "
                f"replica{'s' * (replicas != 1)} in sync")

    def close(self):
        """Nothing to release: the model lives as long as the engine."""

    def step(self, images, labels, iteration):
        """Buffers one mini-batch; the N-th trains the window.

        Dropout draws from the model's seed generators (saved with the checkpoint), not
        from `iteration` as the tf1 engine's does.
        """
        size = len(labels)
        self._images[self._open, :size] = images
        self._labels[self._open, :size] = labels
        self._sizes[self._open] = size
        self._open += 1
        if self._open < self.config.average_gradients:
            return Outcome.NONE
        return self._train_window()

    def _train_window(self):
        open_ = self._open
        if self.micro_batch is None:
            applied = self.accumulator.apply_stacked(
                self._images[:open_], self._labels[:open_], self._sizes[:open_])
        else:
            applied = self._train_effective(open_)
        self._open = 0
        return Outcome.closed(applied)

    def _train_effective(self, open_):
        """Trains the open window as one effective batch, in mini-batches of
        self.micro_batch's B: halved, for this window and the rest of the run, where one
        runs out of memory (the library says so in one line)."""
        sizes = self._sizes[:open_]
        # Only a window's last mini-batch may be short: the buffer's rows, flattened, hold
        # the window's samples in order.
        assert (sizes[:-1] == self.config.batch_size).all(), sizes
        samples = int(sizes.sum())
        batch = (self._images[:open_].reshape((-1,) + data.IMAGE_SHAPE)[:samples],
                 self._labels[:open_].reshape(-1)[:samples])
        applied, _, self.micro_batch = self.accumulator.apply_effective(
            batch, self.micro_batch)
        return applied

    def out_of_memory(self):
        """The micro-batches that ran out of memory in training, each then halved."""
        return self.micro_batch.out_of_memory if self.micro_batch else ()

    def flush(self):
        """Trains a trailing partial window, weighted by its samples."""
        return self._train_window() if self._open else Outcome.NONE

    def window_size(self):
        return self._open

    def loss_totals(self):
        """(sum of finite per-sample training losses, samples) of the windows trained."""
        return self.accumulator.loss_totals()

    def evaluate(self, split, chunk):
        """Accuracy on the whole split, in percent, `chunk` images per call."""
        correct = sum(int(self._num_correct(split.images[i:i + chunk], split.labels[i:i + chunk]))
                      for i in range(0, len(split.labels), chunk))
        return 100.0 * correct / len(split.labels)

    def weights_sha256(self):
        return weights_digest(self.net)

    # ---------------------------------------------------------------- checkpoints

    def write_variables(self, path):
        """The weights with dropout's seed-generator states, Adam's slots and iterations,
        and the running loss totals, as a tf.train.Checkpoint."""
        self.variables.write(path)

    def read_variables(self, path):
        try:
            self.variables.read(path).assert_consumed()
        # What TensorFlow raises for a truncated, corrupt or foreign checkpoint.
        except (tf.errors.OpError, AssertionError, ValueError, IndexError, OSError) as e:
            message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise checkpoint.CheckpointError(f"{path}: unusable checkpoint ({message})") \
                from None

    def window_state(self):
        """The buffered mini-batches of the open window."""
        open_ = self._open
        return {"images": self._images[:open_], "labels": self._labels[:open_],
                "sizes": self._sizes[:open_]}

    def restore_window(self, arrays, state):
        """Buffers the saved window again.

        Raises:
          ValueError: the arrays do not hold state's open window.
        """
        open_ = state["open_window"]
        try:
            sizes = arrays["sizes"]
            if len(sizes) != open_:
                raise ValueError(f"{len(sizes)} buffered mini-batches, the state says {open_}")
            self._sizes[:open_] = sizes
            for i, size in enumerate(sizes):
                self._images[i, :size] = arrays["images"][i, :size]
                self._labels[i, :size] = arrays["labels"][i, :size]
        except (KeyError, ValueError, IndexError) as e:  # RunCheckpoint names the file
            raise ValueError(f"its window file does not hold the open window ({e})") from None
        self._open = open_
        if self.config.distribute == "multi_worker":
            self._restore_loss_totals(*state["loss_totals"])

    def _restore_loss_totals(self, loss, samples):
        """The loss totals of a multi_worker checkpoint, from the state's sums over every
        replica: the variables hold a copy per replica and the chief saved only its own,
        so the first replica takes the loss sum (read as a SUM) and every replica the
        samples (read from the first)."""
        for i, local in enumerate(self.strategy.experimental_local_results(
                self.accumulator.loss_total)):
            local.assign(loss if workers.index(self.config) == 0 and i == 0 else 0.0)
        for local in self.strategy.experimental_local_results(self.accumulator.samples_total):
            local.assign(samples)


def weights_digest(net):
    """checkpoint.digest_arrays of a Keras model's trainable variables."""
    return checkpoint.digest_arrays(v.numpy() for v in net.trainable_variables)
