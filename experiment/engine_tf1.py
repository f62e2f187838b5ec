"""The tf1 engine: the post's graph, built once, and a session that trains it.

loop.py drives it (as it drives engine_tf2.py) through interfaces.Engine.
"""

import numpy as np
import tensorflow as tf

import model
from experiment import averagers
from experiment import checkpoint
from experiment import data

v1 = tf.compat.v1


def prepare(config):
    """Nothing process-wide to set up: the tf1 engine trains on one device."""
    del config


def identity(config):
    """Settings a checkpoint must share beyond the run's Config: none here."""
    del config
    return {}


class RunGraph:
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

            def mini_batch_loss(images, labels, dropout_seed):
                return model.build(config.model, images, labels, self.training,
                                   dropout_seed, config.dropout).loss

            self.averager = averagers.make_averager(
                config.accumulate, self.ops.loss, optimizer, config.average_gradients,
                var_list=v1.trainable_variables(), global_step=self.global_step,
                loss_fn=mini_batch_loss,
                inputs=[self.images, self.labels, self.dropout_seed], check_finite=True)
            self.init_op = v1.global_variables_initializer()
            self.saver = v1.train.Saver(max_to_keep=2)
        self.graph.finalize()  # nothing may add ops inside the loop

    def session(self):
        threads = self.config.threads
        session_config = v1.ConfigProto(intra_op_parallelism_threads=threads,
                                        inter_op_parallelism_threads=threads)
        return v1.Session(graph=self.graph, config=session_config)

    def evaluate(self, sess, split, chunk):
        """Accuracy on the whole split, in percent, `chunk` images per call."""
        correct = 0
        for start in range(0, len(split.labels), chunk):
            stop = start + chunk
            correct += sess.run(self.ops.num_correct,
                                {self.images: split.images[start:stop],
                                 self.labels: split.labels[start:stop]})
        return 100.0 * correct / len(split.labels)


class Engine:
    """One tf1 run (an interfaces.Engine): its RunGraph, initialized in a session."""

    def __init__(self, config, seed, optimizer=None):
        self.config, self.seed = config, seed
        self.run_graph = RunGraph(config, seed, optimizer)
        self.averager = self.run_graph.averager
        self.sess = self.run_graph.session()
        self.sess.run(self.run_graph.init_op)
        self._loss_sum, self._samples = 0.0, 0  # finite training losses, per sample
        self._sizes = []  # samples of the mini-batches whose losses are still to come

    def summary(self):
        """A line for the verbose log about how it trains; none here."""
        return None

    def close(self):
        self.sess.close()

    def step(self, images, labels, iteration):
        """Trains one mini-batch, its dropout seeded by (seed, iteration)."""
        run_graph = self.run_graph
        self._sizes.append(len(labels))
        losses, outcome = self.averager.step(self.sess, {
            run_graph.images: images, run_graph.labels: labels, run_graph.training: True,
            run_graph.dropout_seed: np.array([self.seed, iteration], np.int64)})
        self._add_losses(losses)
        return outcome

    def flush(self):
        losses, outcome = self.averager.flush(self.sess)
        self._add_losses(losses)
        return outcome

    def _add_losses(self, losses):
        # Each the mean over one mini-batch, in the order of step's calls.
        for loss in losses:
            size = self._sizes.pop(0) if self._sizes else self.config.batch_size
            if np.isfinite(loss):
                self._loss_sum += float(loss) * size
                self._samples += size

    def window_size(self):
        return self.averager.window_size()

    def loss_totals(self):
        return self._loss_sum, self._samples

    def evaluate(self, split, chunk):
        return self.run_graph.evaluate(self.sess, split, chunk)

    def out_of_memory(self):
        """None ever: on this engine an out-of-memory error stops the run (main.py's
        one line), nothing is trained again."""
        return ()

    def weights_sha256(self):
        return checkpoint.digest_arrays(self.sess.run(
            self.run_graph.graph.get_collection(v1.GraphKeys.TRAINABLE_VARIABLES)))

    # ---------------------------------------------------------------- checkpoints

    def write_variables(self, path):
        """Every global variable (weights, Adam's slots, the global step, the `graph`
        averager's window), by the RunGraph's Saver."""
        with self.run_graph.graph.as_default():  # a Saver works in graph mode only
            self.run_graph.saver.save(self.sess, path, write_meta_graph=False,
                                      write_state=False)

    def read_variables(self, path):
        with self.run_graph.graph.as_default():
            self.run_graph.saver.restore(self.sess, path)

    def window_state(self):
        """The averager's open window (gradients, sums or fed inputs)."""
        return self.averager.window_state()

    def restore_window(self, arrays, state):
        self.averager.restore_window(self.sess, arrays)
        self._loss_sum, self._samples = state["loss_totals"]
        self._sizes = [self.config.batch_size] * self.window_size()
