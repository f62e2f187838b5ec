"""Runs for test_micro_batch, in a process of their own: the CPU as the GPU's BFC allocator
(tools.memory.probe_env), under a memory limit or without one.

    python -m tests.library.micro_batch_runs --limit-mb=64 --out=DIR   # the trainings
    python -m tests.library.micro_batch_runs --out=DIR                 # the direct batches
    python -m tests.library.micro_batch_runs --limit-mb=64 --xla=CACHE --out=DIR  # XLA

Prints one JSON line: what each run found (the direct batch: its peak) and the CPU
seconds it took; the weights go to DIR as .npz files. The limited process has two
logical CPUs, for MirroredStrategy (logical devices must be set before TensorFlow
starts); they share one allocator. The model's activations dominate its memory and its
OOM comes from a matmul: Dense layers on every step of a sequence, so a mini-batch's
peak grows with its samples while the weights stay small.

The sequence runs train on token sequences padded per batch: the micro-batch is found on
the first batch, of short ones; the later batches are twice as long, so its mini-batches
run out of memory there, and the window is trained again at half the micro-batch.
"""

import argparse
import gc
import json
import os
import time

STEPS, FEATURES, UNITS, CLASSES = 64, 64, 512, 10
E = 211  # prime: no micro-batch but 1 and E divides it
SAMPLES = E + 52  # two updates an epoch: a whole effective batch and a short one
EPOCHS = 4  # of the runs that search on one replica
SMALL_E = 24  # the effective batch of the searches that check the state they leave
# Keras builds a model under a strategy from its first batch, which must split evenly
# across the replicas: two replicas' effective batch is 2 x 89, 89 a prime (a replica's
# share well over what it fits, whatever the runs before left in use).
MIRRORED_E = 178
# Token sequences: the effective batches' samples and padded lengths (the first SHORT,
# the first of which the search tries on, half as long as the others).
SHORT = 6
SEQUENCE_BATCHES = ((E, STEPS),) * SHORT + ((E, 2 * STEPS), (SAMPLES - E, 2 * STEPS))
VOCABULARY = 500
# The search's budget there, under the limit: it finds the micro-batch from below, without
# an out-of-memory error (each costs the allocator's 10 s wait), and the device runs out
# of memory at that micro-batch on the sequences twice as long (not at half of it).
SEQUENCE_BUDGET = 40 << 20


def data():
    import numpy as np
    rng = np.random.default_rng(0)
    x = rng.standard_normal((SAMPLES, STEPS, FEATURES)).astype(np.float32)
    return x, rng.integers(0, CLASSES, SAMPLES).astype(np.int32)


def model(batch_norm=False):
    """The sequence MLP, seeded; batch_norm=True: with batch norm and dropout between
    its layers (state that a trial must leave as it was)."""
    import keras
    init = keras.initializers.GlorotUniform
    middle = ([keras.layers.BatchNormalization(), keras.layers.Dropout(0.5, seed=3)]
              if batch_norm else [])
    return keras.Sequential([
        keras.Input((STEPS, FEATURES)),
        keras.layers.Dense(UNITS, activation="relu", kernel_initializer=init(1)), *middle,
        keras.layers.Dense(UNITS, activation="relu", kernel_initializer=init(2)),
        keras.layers.GlobalAveragePooling1D(),
        keras.layers.Dense(CLASSES, kernel_initializer=init(3))])


def sequences():
    """The effective batches of token sequences, (tokens, labels per token) each: every
    sequence at least half its batch's length, zero-padded to it (the padding masked)."""
    import numpy as np
    rng = np.random.default_rng(1)
    batches = []
    for samples, steps in SEQUENCE_BATCHES:
        lengths = rng.integers(steps // 2, steps + 1, samples)
        lengths[0] = steps
        tokens = rng.integers(1, VOCABULARY, (samples, steps)).astype(np.int32)
        tokens[np.arange(steps) >= lengths[:, None]] = 0
        batches.append((tokens, rng.integers(0, CLASSES, (samples, steps)).astype(np.int32)))
    return batches


def sequence_dataset():
    """sequences() as a dataset of its batches, of any length."""
    import functools

    import tensorflow as tf
    return functools.reduce(tf.data.Dataset.concatenate,
                            [tf.data.Dataset.from_tensors(batch) for batch in sequences()])


def sequence_model():
    """Embedded tokens (the padding masked), a wide Dense layer and the logits on every
    step: the loss is a mean over each batch's valid tokens. No dropout, no batch norm
    (the update is the direct batch's however the window is cut)."""
    import keras
    init = keras.initializers.GlorotUniform
    return keras.Sequential([
        keras.Input((None,), dtype="int32"),
        keras.layers.Embedding(VOCABULARY, FEATURES, mask_zero=True,
                               embeddings_initializer=keras.initializers.RandomUniform(seed=4)),
        keras.layers.Dense(UNITS, activation="relu", kernel_initializer=init(5)),
        keras.layers.Dense(CLASSES, kernel_initializer=init(6))])


def token_losses(y, logits):
    """fit_accumulated's loss_fn on the sequences: per-token losses, weighed by the
    valid tokens (y: labels, weights)."""
    import keras
    labels, weights = y
    return keras.losses.sparse_categorical_crossentropy(labels, logits,
                                                        from_logits=True), weights


def loss(reduction="sum_over_batch_size"):
    import keras
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=reduction)


def adam():
    """Adam with the exactness comparisons' epsilon (tools.models.ADAM_EPSILON): the
    default's turns float32's summation-order noise into steps where a gradient is near
    zero, and these runs compare several updates."""
    import keras

    from tools import models
    return keras.optimizers.Adam(1e-3, epsilon=models.ADAM_EPSILON)


def compiled(net, optimizer=None):
    net.compile(optimizer=optimizer or adam(), loss=loss())
    return net


def sequence_optimizer():
    """SGD for the sequences: the window applies an Embedding's gradient dense, and
    Keras's Adam squares a sparse one's rows before it sums a token's repeats (another
    second moment than the direct batch's dense one)."""
    import keras
    return keras.optimizers.SGD(0.2)


def save(out, name, variables):
    import numpy as np
    np.savez(os.path.join(out, f"{name}.npz"), *[v.numpy() for v in variables])


def found(micro_batch):
    return {key: value for key, value in micro_batch._asdict().items()}


def state(variables):
    """Every variable's value, on the host."""
    return [v.numpy().copy() for v in variables]


def unchanged(before, variables):
    import numpy as np
    return all(np.array_equal(a, v.numpy()) for a, v in zip(before, variables, strict=True))


def direct(out, effective_batch, name, epochs=1):
    """Keras fit on batches of E, without a limit: the reference weights, and the peak
    that shows it cannot fit under the limit."""
    import tensorflow as tf
    x, y = data()
    net = compiled(model())
    tf.config.experimental.reset_memory_stats("CPU:0")
    net.fit(x, y, batch_size=effective_batch, epochs=epochs, shuffle=False, verbose=0)
    peak = tf.config.experimental.get_memory_info("CPU:0")["peak"]
    save(out, name, net.trainable_variables)
    tf.config.experimental.reset_memory_stats("CPU:0")
    # The whole set as one batch: at E alone its peak lay within 3% of the limit, on
    # either side of it from process to process.
    loss = net.evaluate(x, y, batch_size=SAMPLES, verbose=0)
    return {"peak": peak, "evaluate_loss": loss,
            "evaluate_peak": tf.config.experimental.get_memory_info("CPU:0")["peak"]}


def direct_sequences(out):
    """Keras fit on the effective batches of sequences, without a limit."""
    net = compiled(sequence_model(), sequence_optimizer())
    net.fit(sequence_dataset(), verbose=0)
    save(out, "direct_sequences", net.trainable_variables)


def out_of_memory_said(run):
    """run()'s result, or {"error": its line that says OOM} where it ran out of memory
    all the same: the sequence tests fail on it, the runs after it still run."""
    import tensorflow as tf
    try:
        return run()
    except tf.errors.ResourceExhaustedError as error:
        lines = str(error).splitlines()
        return {"error": next((line for line in lines if "OOM" in line), lines[0])}


class Warnings:
    """The warning lines logged while it is open."""

    def __enter__(self):
        import logging
        self.lines = []
        self.handler = logging.Handler(logging.WARNING)
        self.handler.emit = lambda record: self.lines.append(record.getMessage())
        logging.getLogger().addHandler(self.handler)
        return self.lines

    def __exit__(self, *unused):
        import logging
        logging.getLogger().removeHandler(self.handler)


def keras_sequences(out):
    """Keras fit, micro_batch_size="auto", on the sequences: a window run out of memory
    is trained again at half the micro-batch."""
    from gradient_averaging import keras_fit
    net = sequence_model()
    accumulating = compiled(keras_fit.accumulate(net, micro_batch_size="auto",
                                                     budget=SEQUENCE_BUDGET),
                            sequence_optimizer())
    with Warnings() as lines:
        accumulating.fit(sequence_dataset(), verbose=0)
    save(out, "keras_sequences", net.trainable_variables)
    return {"found": found(accumulating.micro_batch), "warnings": lines,
            "updates": int(accumulating.optimizer.iterations)}


def tf2_sequences(out):
    """fit_accumulated, micro_batch_size="auto", on the sequences, each token weighed by
    its mask."""
    import tensorflow as tf

    from gradient_averaging import tf2
    net = sequence_model()
    with Warnings() as lines:
        weighted = sequence_dataset().map(
            lambda tokens, labels: (tokens, (labels, tf.cast(tokens > 0, tf.float32))))
        summary = tf2.fit_accumulated(net, weighted, sequence_optimizer(), token_losses,
                                      micro_batch_size="auto", budget=SEQUENCE_BUDGET)
    save(out, "tf2_sequences", net.trainable_variables)
    return {"found": found(summary.micro_batch), "warnings": lines,
            "updates": summary.updates, "mini_batches": summary.mini_batches}


def keras_auto(out):
    from gradient_averaging import keras_fit
    x, y = data()
    net = model()
    accumulating = compiled(keras_fit.accumulate(net, micro_batch_size="auto"))
    accumulating.fit(x, y, batch_size=E, epochs=EPOCHS, shuffle=False, verbose=0)
    save(out, "keras", net.trainable_variables)
    # Evaluated as one batch of the whole set, cut into mini-batches of the micro-batch.
    return {"found": found(accumulating.micro_batch),
            "updates": int(accumulating.optimizer.iterations),
            "evaluate_loss": accumulating.evaluate(x, y, batch_size=SAMPLES, verbose=0)}


def keras_even():
    """Keras fit, "auto", on data that E divides: the batches' spec fixes their size,
    and the search's trials are parts of them."""
    import numpy as np

    from gradient_averaging import keras_fit
    x, y = (np.concatenate([a, a])[:2 * E] for a in data())
    accumulating = compiled(keras_fit.accumulate(model(), micro_batch_size="auto"))
    accumulating.fit(x, y, batch_size=E, epochs=EPOCHS, shuffle=False, verbose=0)
    return {"found": found(accumulating.micro_batch),
            "updates": int(accumulating.optimizer.iterations)}


def tf2_auto(out):
    """fit_accumulated with "auto" for all epochs but the last, which it trains given the
    micro-batch found (a plan: each batch cut as that B cuts it)."""
    import tensorflow as tf

    from gradient_averaging import tf2
    x, y = data()
    net, optimizer = model(), adam()
    batches = tf.data.Dataset.from_tensor_slices((x, y)).batch(E)
    summary = tf2.fit_accumulated(net, batches.repeat(EPOCHS - 1), optimizer, loss(None),
                                  micro_batch_size="auto")
    last = tf2.fit_accumulated(net, batches, optimizer, loss(None),
                               micro_batch_size=summary.micro_batch.micro_batch_size)
    save(out, "tf2", net.trainable_variables)
    return {"found": found(summary.micro_batch),
            "updates": summary.updates + last.updates, "last_mini_batches": last.mini_batches}


def trials_leave_the_state():
    """Searches on a model with batch norm and dropout: every variable of the model, the
    optimizer and the trainer bit for bit as before, though the trials stepped the seeds
    and the update the weights, the optimizer and the moving statistics. On a small
    effective batch (SMALL_E): the state, not the size, is the point. Keras's model is
    fitted once first: fit builds what the trials run."""
    import keras

    from gradient_averaging import keras_fit
    from gradient_averaging import micro_batch
    from gradient_averaging import tf2
    x, y = data()
    sample = (x[:SMALL_E], y[:SMALL_E])
    accumulator = tf2.WindowAccumulator(model(batch_norm=True), keras.optimizers.Adam(1e-3),
                                        loss(None))
    tracked = (accumulator.model.variables + list(accumulator.optimizer.variables)
               + [accumulator.loss_total, accumulator.samples_total])
    before = state(tracked)
    tf2_found = micro_batch.find_micro_batch(accumulator, sample, SMALL_E)
    result = {"tf2": unchanged(before, tracked), "tf2_found": found(tf2_found)}

    accumulating = compiled(keras_fit.accumulate(model(batch_norm=True), micro_batch_size=4))
    accumulating.fit(*sample, batch_size=SMALL_E, shuffle=False, verbose=0)
    tracked = (accumulating.variables + list(accumulating.optimizer.variables)
               + accumulating.metrics_variables)
    before = state(tracked)
    keras_found = micro_batch.find_micro_batch(accumulating, sample, SMALL_E)
    result.update(keras=unchanged(before, tracked), keras_found=found(keras_found))
    return result


def mirrored(out, strategy):
    """Keras fit under two mirrored replicas, each batch cut on each replica into
    mini-batches of the size found for one replica."""
    from gradient_averaging import keras_fit
    x, y = data()
    with strategy.scope():
        net = model()
        accumulating = compiled(keras_fit.accumulate(net, micro_batch_size="auto"))
    accumulating.fit(x, y, batch_size=MIRRORED_E, shuffle=False, verbose=0)
    save(out, "mirrored", net.trainable_variables)
    return {"found": found(accumulating.micro_batch),
            "evaluate_loss": accumulating.evaluate(x, y, batch_size=MIRRORED_E, verbose=0)}


def nothing_fits():
    """A budget of 1 MiB: one sample's mini-batch needs more; one line says how much."""
    import keras

    from gradient_averaging import micro_batch
    from gradient_averaging import tf2
    x, y = data()
    accumulator = tf2.WindowAccumulator(model(), keras.optimizers.Adam(), loss(None))
    try:
        micro_batch.find_micro_batch(accumulator, (x[:4], y[:4]), E, budget=1 << 20)
    except micro_batch.NothingFits as error:
        return str(error)
    return None


def compilations(cache):
    """The XLA programs compiled so far in this process: one file each in the persistent
    cache folder (TF_XLA_FLAGS=--tf_xla_persistent_cache_directory=CACHE, empty at the
    start), a file per program, written as it is compiled."""
    return len(os.listdir(cache))


def xla_runs(cache):
    """Keras fit and fit_accumulated under jit_compile=True, "auto", on data of whole
    effective batches (no short batch an epoch): the XLA programs each compiled (its
    search's and its training's), beside what it found."""
    import numpy as np
    import tensorflow as tf

    from gradient_averaging import keras_fit
    from gradient_averaging import tf2
    x, y = (np.concatenate([a, a])[:2 * E] for a in data())

    def keras_xla():
        accumulating = keras_fit.accumulate(model(), micro_batch_size="auto")
        accumulating.compile(optimizer=adam(), loss=loss(), jit_compile=True)
        accumulating.fit(x, y, batch_size=E, epochs=EPOCHS, shuffle=False, verbose=0)
        return accumulating.micro_batch

    def tf2_xla():
        batches = tf.data.Dataset.from_tensor_slices((x, y)).batch(E).repeat(EPOCHS)
        return tf2.fit_accumulated(model(), batches, adam(), loss(None), jit_compile=True,
                                   micro_batch_size="auto").micro_batch

    results = {}
    for name, run in (("keras", keras_xla), ("tf2", tf2_xla)):
        before, start = compilations(cache), time.perf_counter()
        micro_batch = run()
        results[name] = {"found": found(micro_batch),
                         "compilations": compilations(cache) - before,
                         "seconds": time.perf_counter() - start}
    return results


def xla_hold():
    """One XLA program whose temporaries (three matmuls' outputs, 48 MiB on a 16 MiB
    input) are more than half the free memory of a 100 MiB device held as one region:
    its peak read without a hold, and with the margin held (Search.hold), against the
    search's limit."""
    import tensorflow as tf

    from gradient_averaging import device
    from gradient_averaging import micro_batch
    device.reserve_cpu_memory()
    search = micro_batch.Search.on_devices(["CPU:0"], 1, xla=True)

    @tf.function(jit_compile=True)
    def program(x):
        w = tf.eye(1024) * 0.5
        h = tf.matmul(x, w)
        h2 = tf.matmul(h, w)
        return tf.reduce_sum(h * tf.matmul(h2, w)) + tf.reduce_sum(h2)

    x = tf.ones([16 * 1024 // 4, 1024])  # one buffer: no hole left before it
    run = lambda: program(x).numpy()  # noqa: E731 (the same run twice)
    run()  # compiled outside the measures
    return {"limit": search.limit, "hold": search.hold,
            "without": device.measured_peak(run, ["CPU:0"]),
            "with": device.measured_peak(run, ["CPU:0"], search.hold)}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--limit-mb", type=int)
    parser.add_argument("--out", required=True)
    parser.add_argument("--xla", help="the XLA runs (xla_runs), counted in this cache folder")
    parser.add_argument("--hold", action="store_true", help="xla_hold alone")
    args = parser.parse_args()
    if args.hold:
        print(json.dumps(xla_hold()))
        return
    if args.xla:
        print(json.dumps(xla_runs(args.xla)))
        return
    if not args.limit_mb:
        results = {"direct": direct(args.out, E, "direct", EPOCHS),
                   "direct_mirrored": direct(args.out, MIRRORED_E, "direct_mirrored")}
        direct_sequences(args.out)
        print(json.dumps(results))
        return
    import keras
    import tensorflow as tf
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    two = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    # The sequence runs first: their search's budget is less than the device's memory,
    # and the later runs leave some of their inputs in use (the sequences are small).
    runs = {"keras_sequences": lambda: out_of_memory_said(lambda: keras_sequences(args.out)),
            "tf2_sequences": lambda: out_of_memory_said(lambda: tf2_sequences(args.out)),
            "mirrored": lambda: mirrored(args.out, two),
            "keras": lambda: keras_auto(args.out), "keras_even": keras_even,
            "tf2": lambda: tf2_auto(args.out),
            "trials": trials_leave_the_state, "nothing_fits": nothing_fits}
    results, seconds, in_use = {}, {}, {}
    for name, run in runs.items():
        in_use[name] = tf.config.experimental.get_memory_info("CPU:0")["current"] / (1 << 20)
        start = time.process_time()
        results[name] = run()
        # Most of what a run made goes (a few MiB of each model stay in Keras's and
        # TensorFlow's caches: the later runs measure them as memory in use).
        keras.backend.clear_session()
        gc.collect()
        seconds[name] = time.process_time() - start
    print(json.dumps(dict(results, cpu_seconds=seconds, in_use_mb=in_use)))


if __name__ == "__main__":
    from experiment import cli
    cli.import_tensorflow_quietly()
    main()
