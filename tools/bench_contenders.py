"""The contenders of the speed section, and how they take turns against the clock.

Every contender trains the post's ConvNet on real MNIST through `train(updates)`: the TF1
graphs as `main.py` trains them, Keras 3's built-in accumulation, the tf2 engine. Keras
loads only inside the Keras and tf2 contenders, so that a memory probe, which imports this
module, measures TensorFlow alone.
"""

import collections
import statistics
import time

import tensorflow as tf

from experiment import data
from experiment import engine_tf1
from experiment import loop
from experiment import averagers

SEED = 0
ENDLESS = 10 ** 9  # mini-batches a contender may draw: more than any benchmark trains


class SessionContender:
    """One TF1 graph training through the tf1 engine's `step`, as `main.py`'s loop does."""

    def __init__(self, label, config, datasets):
        self.label, self.config = label, config
        self.engine = engine_tf1.Engine(config, SEED)
        self.batches = data.batches(datasets.train, SEED, config.batch_size, 0, ENDLESS)
        self.iteration = 0

    def train(self, updates):
        for _ in range(updates * self.config.average_gradients):
            self.iteration += 1
            self.engine.step(*next(self.batches), self.iteration)

    def close(self):
        self.engine.close()


class KerasContender:
    """Keras 3's built-in accumulation: Adam(gradient_accumulation_steps=N) on B samples.

    mode "fit": model.fit over a tf.data pipeline of B-sized batches, `steps_per_execution`
    mini-batches per compiled call (Keras's own way to cut per-step overhead);
    mode "train_on_batch": one call per mini-batch. No XLA: under op determinism (on in
    main.py and here) Keras turns jit_compile off.
    """

    def __init__(self, label, n, b, datasets, mode="fit", steps_per_execution=1):
        import keras
        import model  # Keras loads only where a Keras contender runs
        keras.utils.set_random_seed(SEED)
        self.label, self.n, self.b, self.mode = label, n, b, mode
        self.model = model.keras_model("convnet", 0.5, SEED)  # the tf2 engine's ConvNet
        accumulation_steps = n if n > 1 else None
        self.model.compile(
            optimizer=keras.optimizers.Adam(1e-3, gradient_accumulation_steps=accumulation_steps),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            jit_compile=False, steps_per_execution=steps_per_execution)
        self.train_split = datasets.train
        self.stream = data.SampleStream(len(datasets.train.labels), SEED)
        self.dataset = (tf.data.Dataset.from_tensor_slices(tuple(datasets.train))
                        .repeat().batch(b, drop_remainder=True).prefetch(2))

    def train(self, updates):
        if self.mode == "fit":
            self.model.fit(self.dataset, steps_per_epoch=updates * self.n, epochs=1, verbose=0,
                           shuffle=False)
            return
        for _ in range(updates * self.n):
            self.model.train_on_batch(*self.stream.next_batch(self.train_split, self.b))

    def close(self):
        pass


class TF2Contender(SessionContender):
    """The tf2 engine as `main.py --engine=tf2` trains it: engine_tf2.Engine's `step`
    buffers N mini-batches and trains the window in one compiled call; `train` and
    `close` are SessionContender's, only the engine differs."""

    def __init__(self, label, n, b, datasets):
        from experiment import engine_tf2  # Keras loads only where a tf2 contender runs
        self.label = label
        self.config = loop.Config(engine="tf2", average_gradients=n, batch_size=b)
        self.engine = engine_tf2.Engine(self.config, SEED)
        self.batches = data.batches(datasets.train, SEED, b, 0, ENDLESS)
        self.iteration = 0


def tf1_contenders(n, b, datasets):
    """The direct batch N*B (the post's minimize) and every averager at N x B."""
    contenders = [SessionContender("direct", loop.Config(
        average_gradients=1, batch_size=n * b), datasets)]
    for averager in averagers.AVERAGERS:
        contenders.append(SessionContender(averager, loop.Config(
            average_gradients=n, batch_size=b, accumulate=averager), datasets))
    return contenders


def keras_modes(n, updates):
    """Ways to train with Keras's accumulation: the setup section compares the plain ones
    with one call per update; the speed section times the two that are fastest."""
    return {"train_on_batch": dict(mode="train_on_batch"),
            "fit, steps_per_execution=1": dict(mode="fit", steps_per_execution=1),
            "fit, steps_per_execution=N": dict(mode="fit", steps_per_execution=n),
            "fit, steps_per_execution=N*U": dict(mode="fit", steps_per_execution=n * updates)}


# The Keras contenders of the speed section, by label; a target takes the faster one.
KERAS_CONTENDERS = {"keras": "fit, steps_per_execution=N",
                    "keras_long": "fit, steps_per_execution=N*U"}


# ---------------------------------------------------------------- timing


def interleaved(contenders, updates, repeats):
    """Seconds per update of each contender, `repeats` rounds, turns rotating per round.

    Returns:
      {label: [seconds per update, one per round]}.
    """
    for c in contenders:
        c.train(updates)  # warm-up: graph optimisation, allocator, oneDNN primitives
    times = collections.defaultdict(list)
    for r in range(repeats):
        shift = r % len(contenders)
        for c in contenders[shift:] + contenders[:shift]:
            start = time.perf_counter()
            c.train(updates)
            times[c.label].append((time.perf_counter() - start) / updates)
    return dict(times)


def paired_ratio(times, label, base):
    """Median and quartiles of the per-round ratio label / base."""
    ratios = sorted(a / b for a, b in zip(times[label], times[base]))
    q = statistics.quantiles(ratios, n=4, method="inclusive") if len(ratios) > 1 \
        else [ratios[0]] * 3
    return {"ratio": statistics.median(ratios), "q1": q[0], "q3": q[2]}


def keras_vs_fused(times):
    """The faster Keras contender's label, and fused's speed-up over it."""
    best = min(KERAS_CONTENDERS, key=lambda k: statistics.median(times[k]))
    return best, paired_ratio(times, best, "fused")
