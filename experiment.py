"""The MNIST experiment: one training run, and the repeated runs of a configuration.

It takes plain values (a `Config`), never the command-line flags, so that a test or a
script can run it directly.
"""

import dataclasses
import logging
import time

import numpy as np
import tensorflow as tf

import data
import model
import trainer

v1 = tf.compat.v1

EVAL_BATCH = 10000


@dataclasses.dataclass(frozen=True)
class Config:
    """One configuration of the experiment (the flags that shape a run)."""
    average_gradients: int = 1
    batch_size: int = 100
    iterations: int = 1000
    learning_rate: float = 1e-3
    dropout: float = 0.5
    eval_every: int = 100
    accumulate: str = "stack"
    model: str = "convnet"
    threads: int = 0


class Run:
    """The graph of one run, built once; `train` drives the session loop over it."""

    def __init__(self, config, seed, optimizer=None):
        """Builds the graph; `optimizer` defaults to Adam at config.learning_rate."""
        self.config = config
        self.graph = tf.Graph()
        with self.graph.as_default():
            v1.set_random_seed(seed)
            self.images = v1.placeholder(tf.float32, (None,) + data.IMAGE_SHAPE, "images")
            self.labels = v1.placeholder(tf.int64, [None], "labels")
            self.training = v1.placeholder_with_default(False, [], "training")
            self.ops = model.build(config.model, self.images, self.labels, self.training,
                                   config.dropout)
            self.global_step = v1.train.get_or_create_global_step()
            optimizer = optimizer or v1.train.AdamOptimizer(config.learning_rate)

            def micro_batch_loss(images, labels):
                return model.build(config.model, images, labels, self.training,
                                   config.dropout).loss

            self.averager = trainer.make_averager(
                config.accumulate, self.ops.loss, optimizer, config.average_gradients,
                var_list=v1.trainable_variables(), global_step=self.global_step,
                loss_fn=micro_batch_loss, inputs=[self.images, self.labels])
            self.init_op = v1.global_variables_initializer()
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


def train_once(config, datasets, seed, verbose=False, log=print):
    """Trains one run from scratch and evaluates it on the test set.

    Evaluates every `config.eval_every` iterations (mini-batches) and once at the end.

    Returns:
      dict with seed, best_accuracy, best_iteration, final_accuracy, updates,
      train_seconds (evaluation excluded) and eval_seconds.
    """
    run = Run(config, seed)
    n = config.average_gradients
    stream = data.SampleStream(len(datasets.train.labels), seed)
    best_accuracy, best_iteration = -1.0, 0
    train_seconds = eval_seconds = 0.0
    recent_losses = []

    with run.session() as sess:
        sess.run(run.init_op)

        def evaluate(iteration):
            nonlocal best_accuracy, best_iteration, eval_seconds
            start = time.perf_counter()
            accuracy = run.evaluate(sess, datasets.test)
            eval_seconds += time.perf_counter() - start
            if accuracy > best_accuracy:
                best_accuracy, best_iteration = accuracy, iteration
            if verbose:
                loss = np.mean(recent_losses) if recent_losses else float("nan")
                log(f"Iteration {iteration}: loss {loss:.4f}, accuracy {accuracy:.2f}")
            recent_losses.clear()
            return accuracy

        for iteration in range(1, config.iterations + 1):
            start = time.perf_counter()
            images, labels = stream.next_batch(datasets.train, config.batch_size)
            recent_losses += run.averager.step(
                sess, {run.images: images, run.labels: labels, run.training: True})
            train_seconds += time.perf_counter() - start
            if config.eval_every and iteration % config.eval_every == 0 \
                    and iteration < config.iterations:
                evaluate(iteration)

        start = time.perf_counter()
        held = run.averager.flush(sess)
        train_seconds += time.perf_counter() - start
        if held:
            logging.warning("--iterations=%d is not a multiple of --average-gradients=%d: "
                            "the last %d mini-batches were applied as one update of their "
                            "mean", config.iterations, n, held)
        final_accuracy = evaluate(config.iterations)
        updates = int(sess.run(run.global_step))

    return {"seed": seed, "best_accuracy": best_accuracy, "best_iteration": best_iteration,
            "final_accuracy": final_accuracy, "updates": updates,
            "train_seconds": train_seconds, "eval_seconds": eval_seconds}
