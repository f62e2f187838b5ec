"""The MNIST experiment: one training run, and the repeated runs of a configuration.

It takes plain values (a `Config`), never the command-line flags, so that a test or a
script can run it directly.
"""

import contextlib
import dataclasses
import hashlib
import logging
import time

import numpy as np
import tensorflow as tf

import checkpoint
import data
import model
import trainer

v1 = tf.compat.v1

EVAL_BATCH = 10000
CHECKPOINT_EVERY = 100  # updates
# What a resumed run must share with the checkpoint it resumes (and the seed).
IDENTITY_FIELDS = ("engine", "model", "average_gradients", "batch_size", "iterations",
                   "learning_rate", "dropout", "accumulate", "lr_schedule",
                   "lr_decay_steps", "lr_decay_rate")


@dataclasses.dataclass(frozen=True)
class Config:
    """One configuration of the experiment (the flags that shape a run)."""
    average_gradients: int = 1
    batch_size: int = 100
    iterations: int = 1000
    learning_rate: float = 1e-3
    dropout: float = 0.5
    eval_every: int = 100
    eval_every_updates: int = 0
    accumulate: str = "stack"
    model: str = "convnet"
    threads: int = 0
    engine: str = "tf1"
    lr_schedule: str = "constant"
    lr_decay_steps: int = 100
    lr_decay_rate: float = 0.96
    strategy: str = "none"
    replicas: int = 0
    on_nonfinite: str = "skip"  # or "abort"
    max_bad_windows: int = 10
    inject_nonfinite: tuple = ()  # iterations whose batch is made NaN (a testing aid)


class Run:
    """The graph of one run, built once, finalized before any session runs it."""

    def __init__(self, config, seed, optimizer=None):
        """Builds the graph; `optimizer` defaults to Adam at config.learning_rate."""
        self.config = config
        self.graph = tf.Graph()
        with self.graph.as_default():
            v1.set_random_seed(seed)
            self.images = v1.placeholder(tf.float32, (None,) + data.IMAGE_SHAPE, "images")
            self.labels = v1.placeholder(tf.int64, [None], "labels")
            self.training = v1.placeholder_with_default(False, [], "training")
            self.dropout_seed = v1.placeholder_with_default(
                tf.constant([seed, 0], tf.int64), [2], "dropout_seed")
            self.ops = model.build(config.model, self.images, self.labels, self.training,
                                   self.dropout_seed, config.dropout)
            self.global_step = v1.train.get_or_create_global_step()
            self.learning_rate = config.learning_rate
            if config.lr_schedule == "exponential":  # global_step counts updates
                self.learning_rate = v1.train.exponential_decay(
                    config.learning_rate, self.global_step, config.lr_decay_steps,
                    config.lr_decay_rate)
            optimizer = optimizer or v1.train.AdamOptimizer(self.learning_rate)

            def micro_batch_loss(images, labels, dropout_seed):
                return model.build(config.model, images, labels, self.training,
                                   dropout_seed, config.dropout).loss

            self.averager = trainer.make_averager(
                config.accumulate, self.ops.loss, optimizer, config.average_gradients,
                var_list=v1.trainable_variables(), global_step=self.global_step,
                loss_fn=micro_batch_loss,
                inputs=[self.images, self.labels, self.dropout_seed], check_finite=True)
            self.init_op = v1.global_variables_initializer()
            self.saver = v1.train.Saver(max_to_keep=2)
        self.graph.finalize()  # nothing may add ops inside the loop

    def session(self):
        threads = self.config.threads
        session_config = v1.ConfigProto(intra_op_parallelism_threads=threads,
                                        inter_op_parallelism_threads=threads)
        return v1.Session(graph=self.graph, config=session_config)

    def evaluate(self, sess, split):
        """Accuracy on the whole split, in percent."""
        correct = 0
        for start in range(0, len(split.labels), EVAL_BATCH):
            stop = start + EVAL_BATCH
            correct += sess.run(self.ops.num_correct,
                                {self.images: split.images[start:stop],
                                 self.labels: split.labels[start:stop]})
        return 100.0 * correct / len(split.labels)


def _scalars(step_values):
    """A Summary proto of simple values: written from Python, so the graph needs no ops."""
    return v1.Summary(value=[v1.Summary.Value(tag=tag, simple_value=float(value))
                             for tag, value in step_values.items()])


class Stopped(Exception):
    """Training stopped before the end; the message says where and what was kept."""


# Both engines' warning for a discarded window: (where, windows discarded so far).
DISCARDED_WINDOW = "non-finite loss or gradient in %s: the window was discarded, not applied " \
                   "(%d so far)"


def bad_windows_verdict(config, consecutive_bad, last_bad):
    """Why training must stop over non-finite windows, or None (both engines)."""
    if not consecutive_bad:
        return None
    if config.on_nonfinite == "abort":
        return f"non-finite loss or gradient in {last_bad} and --on-nonfinite=abort"
    if consecutive_bad >= config.max_bad_windows:
        return (f"{consecutive_bad} consecutive windows had a non-finite loss or "
                f"gradient (--max-bad-windows={config.max_bad_windows})")
    return None


def identity(config, seed):
    """The settings a checkpoint must share with the run that resumes it."""
    return dict({key: getattr(config, key) for key in IDENTITY_FIELDS}, seed=seed)


def digest_arrays(values):
    """sha256 of the arrays' bytes, in order: equal digests, equal weights (both engines)."""
    digest = hashlib.sha256()
    for value in values:
        digest.update(np.ascontiguousarray(value).tobytes())
    return digest.hexdigest()


def weights_digest(sess, graph):
    """digest_arrays of every trainable variable of a TF1 graph."""
    return digest_arrays(sess.run(graph.get_collection(v1.GraphKeys.TRAINABLE_VARIABLES)))


class Training:
    """One run's session loop, and the state a checkpoint must hold to continue it."""

    def __init__(self, config, datasets, seed, sess, run, writer=None, verbose=False,
                 log=print):
        self.config, self.datasets, self.seed = config, datasets, seed
        self.sess, self.run, self.writer = sess, run, writer
        self.verbose, self.log = verbose, log
        self.stream = data.SampleStream(len(datasets.train.labels), seed)
        self.iteration = 0
        self.best_accuracy, self.best_iteration = -1.0, 0
        self.train_seconds = self.eval_seconds = 0.0
        self.consecutive_bad = 0
        self.last_bad = None
        self.window_start = 1  # first iteration of the open window
        self.recent_losses, self.update_losses = [], []
        self.applied = self.skipped = 0  # as the averager counts them

    # ------------------------------------------------ checkpoint state

    def state(self):
        averager = self.run.averager
        return {"iteration": self.iteration, "position": self.stream.position,
                "updates": averager.updates, "skipped_windows": averager.skipped_windows,
                "consecutive_bad": self.consecutive_bad, "window_start": self.window_start,
                "best_accuracy": self.best_accuracy, "best_iteration": self.best_iteration,
                "train_seconds": self.train_seconds, "eval_seconds": self.eval_seconds}

    def restore(self, state, window):
        averager = self.run.averager
        averager.restore_window(window, self.run.graph)
        averager.updates, averager.skipped_windows = state["updates"], state["skipped_windows"]
        self.applied, self.skipped = averager.updates, averager.skipped_windows
        self.iteration, self.stream.position = state["iteration"], state["position"]
        self.consecutive_bad, self.window_start = state["consecutive_bad"], state["window_start"]
        self.best_accuracy, self.best_iteration = state["best_accuracy"], state["best_iteration"]
        self.train_seconds, self.eval_seconds = state["train_seconds"], state["eval_seconds"]

    # ------------------------------------------------ the loop

    def evaluate(self):
        start = time.perf_counter()
        accuracy = self.run.evaluate(self.sess, self.datasets.test)
        self.eval_seconds += time.perf_counter() - start
        if accuracy > self.best_accuracy:
            self.best_accuracy, self.best_iteration = accuracy, self.iteration
        if self.verbose:
            losses = self.recent_losses
            loss = np.mean(losses) if losses else float("nan")
            self.log(f"Iteration {self.iteration}: loss {loss:.4f}, accuracy {accuracy:.2f}")
        if self.writer:
            self.writer.add_summary(_scalars({"test/accuracy": accuracy}), self.applied)
        self.recent_losses.clear()
        return accuracy

    def step(self):
        """Trains one mini-batch; returns True where it closed a window."""
        run, config = self.run, self.config
        self.iteration += 1
        start = time.perf_counter()
        images, labels = self.stream.next_batch(self.datasets.train, config.batch_size)
        if self.iteration in config.inject_nonfinite:
            images = images.copy()
            images[0] = np.nan
        losses = run.averager.step(self.sess, {
            run.images: images, run.labels: labels, run.training: True,
            run.dropout_seed: np.array([self.seed, self.iteration], np.int64)})
        self.train_seconds += time.perf_counter() - start
        finite = [x for x in losses if np.isfinite(x)]
        self.recent_losses += finite
        self.update_losses += finite
        return self.close_window()

    def close_window(self):
        """Accounts for a window the averager just closed: "applied", "discarded" or None."""
        averager, writer = self.run.averager, self.writer
        if averager.skipped_windows > self.skipped:
            self.skipped = averager.skipped_windows
            self.consecutive_bad += 1
            self.last_bad = f"iterations {self.window_start}-{self.iteration}"
            logging.warning(DISCARDED_WINDOW, self.last_bad, self.skipped)
            outcome = "discarded"
        elif averager.updates > self.applied:
            self.applied = averager.updates
            self.consecutive_bad = 0
            if writer and self.update_losses:
                writer.add_summary(_scalars({"train/loss": np.mean(self.update_losses)}),
                                   self.applied)
            outcome = "applied"
        else:
            return None
        self.update_losses.clear()
        self.window_start = self.iteration + 1
        return outcome

    def bad_windows_verdict(self):
        """Why training must stop over non-finite windows, or None."""
        return bad_windows_verdict(self.config, self.consecutive_bad, self.last_bad)

    def eval_due(self, closed):
        config = self.config
        if self.iteration >= config.iterations:
            return False  # the final evaluation follows the flush
        if config.eval_every and self.iteration % config.eval_every == 0:
            return True
        return bool(config.eval_every_updates and closed == "applied"
                    and self.applied % config.eval_every_updates == 0)


def train_once(config, datasets, seed, verbose=False, log=print, logdir=None,
               checkpoint_dir=None, checkpoint_every=CHECKPOINT_EVERY, should_stop=None):
    """Trains one run (resuming it from `checkpoint_dir` if saved there) and tests it.

    Evaluates every `config.eval_every` iterations (mini-batches), or every
    `config.eval_every_updates` optimizer updates, and once at the end.

    Args:
      logdir: if set, this run's TensorBoard event files go there: `train/loss` (the
        mean loss of each update's mini-batches) and `test/accuracy` (each evaluation),
        both against the number of updates applied, which every N shares.
      checkpoint_dir: this run's checkpoint directory: saved every `checkpoint_every`
        updates, when stopped, and when finished; resumed from when present.
      should_stop: called after every mini-batch; a non-empty return (e.g. "SIGTERM")
        saves a checkpoint and raises Stopped.

    Returns:
      dict with seed, best_accuracy, best_iteration, final_accuracy, updates,
      skipped_windows, train_seconds (evaluation excluded), eval_seconds and
      weights_sha256.

    Raises:
      Stopped: by `should_stop` or by non-finite windows (see Config.on_nonfinite).
      checkpoint.CheckpointError: the checkpoint is unusable or of another configuration.
    """
    if config.engine == "tf2":  # Keras and tf.distribute load only for this engine
        import tf2_trainer
        return tf2_trainer.train_once(config, datasets, seed, verbose=verbose, log=log,
                                      logdir=logdir, checkpoint_dir=checkpoint_dir,
                                      checkpoint_every=checkpoint_every,
                                      should_stop=should_stop)
    saved = None
    if checkpoint_dir:
        ckpt = checkpoint.RunCheckpoint(checkpoint_dir, identity(config, seed))
        saved = ckpt.load()
        if saved and saved["finished"]:
            return saved["result"]
    run = Run(config, seed)

    with run.session() as sess, _event_writer(run.graph, logdir) as writer:
        sess.run(run.init_op)
        training = Training(config, datasets, seed, sess, run, writer, verbose, log)
        if saved:
            training.restore(saved, ckpt.restore(sess, run.saver, saved))

        def save():
            if checkpoint_dir:
                ckpt.save(sess, run.saver, training.iteration, training.state(),
                          run.averager.window_state())

        def stop(reason):
            save()
            where = (f"checkpoint in {checkpoint_dir}; run the same command to resume"
                     if checkpoint_dir else "no --checkpoint-dir, so this run is lost")
            raise Stopped(f"{reason}; stopped at iteration {training.iteration} "
                          f"({run.averager.window_size()} mini-batches in the open window); "
                          f"{where}")

        while training.iteration < config.iterations:
            closed = training.step()
            verdict = training.bad_windows_verdict() if closed else None
            if verdict:
                stop(verdict)
            if training.eval_due(closed):
                training.evaluate()
            if closed == "applied" and training.applied % checkpoint_every == 0:
                save()
            reason = should_stop() if should_stop else None
            if reason:
                stop(f"interrupted by {reason}")

        start = time.perf_counter()
        held = run.averager.flush(sess)
        training.train_seconds += time.perf_counter() - start
        if held and training.close_window() == "applied":
            logging.warning("--iterations=%d is not a multiple of --average-gradients=%d: "
                            "the last %d mini-batches were applied as one update of their "
                            "mean", config.iterations, config.average_gradients, held)
        verdict = training.bad_windows_verdict() if held else None
        if verdict:
            stop(verdict)
        final_accuracy = training.evaluate()
        result = {"seed": seed, "best_accuracy": training.best_accuracy,
                  "best_iteration": training.best_iteration, "final_accuracy": final_accuracy,
                  "updates": int(sess.run(run.global_step)),
                  "skipped_windows": run.averager.skipped_windows,
                  "train_seconds": training.train_seconds,
                  "eval_seconds": training.eval_seconds,
                  "weights_sha256": weights_digest(sess, run.graph)}
    if checkpoint_dir:
        ckpt.save_finished(result)
    return result


@contextlib.contextmanager
def _event_writer(graph, logdir):
    """A FileWriter for `logdir` (None without one); TF1's writer needs a graph context."""
    if not logdir:
        yield None
        return
    with graph.as_default():
        writer = v1.summary.FileWriter(logdir)
    try:
        yield writer
    finally:
        writer.close()
