"""Batch norm under accumulation, measured: BatchNormalization and GroupNormalization at
N x B against the direct batch of N*B, on MNIST.

    python -m tools.batch_norm            # a few minutes
    python -m tools.batch_norm --quick    # a smoke test (a few updates)

Every configuration on the same samples in the same order: test accuracy in inference mode
and how far its moving statistics end from the direct batch's, into docs/batch-norm.md.
"""

import datetime
import os
import shlex
import sys
import time

from experiment import cli

cli.import_tensorflow_quietly()
# ruff: noqa: E402 (the imports below follow the quiet TensorFlow import)

import keras
import numpy as np
from absl import app
from absl import flags

from experiment import data
from experiment import results
from gradient_averaging import accumulate
from tools import common
from tools import models

FLAGS = flags.FLAGS

UPDATES, WINDOW = 300, 100  # updates of WINDOW samples each
CONFIGS = ((1, 100), (20, 5), (100, 1))  # (N, B): the direct batch first
BEGIN, END = "<!-- table: python -m tools.batch_norm -->", "<!-- end of table -->"


def conv_net(norm):
    """The ConvNet, its normalization layers made by `norm(channels)`."""
    init = keras.initializers.GlorotUniform
    return keras.Sequential([
        keras.Input(data.IMAGE_SHAPE),
        keras.layers.Conv2D(6, 5, kernel_initializer=init(models.SEED + 1)), norm(6),
        keras.layers.ReLU(), keras.layers.MaxPool2D(2),
        keras.layers.Conv2D(16, 5, kernel_initializer=init(models.SEED + 2)), norm(16),
        keras.layers.ReLU(), keras.layers.MaxPool2D(2), keras.layers.Flatten(),
        keras.layers.Dense(120, kernel_initializer=init(models.SEED + 3)), norm(120),
        keras.layers.ReLU(), keras.layers.Dense(data.NUM_CLASSES,
                                                kernel_initializer=init(models.SEED + 4))])


NORMS = {"BatchNormalization": lambda channels: keras.layers.BatchNormalization(),
         "GroupNormalization": lambda channels: keras.layers.GroupNormalization(
             groups=2 if channels == 6 else 4)}


def statistics(model):
    return [v.numpy() for layer in model.layers
            if isinstance(layer, keras.layers.BatchNormalization)
            for v in (layer.moving_mean, layer.moving_variance)]


def train(norm, n, b, bn_statistics, x, y, datasets):
    """One configuration: (test accuracy %, its model, seconds)."""
    keras.utils.set_random_seed(models.SEED)
    model = conv_net(NORMS[norm])
    fitted = model if n == 1 else accumulate(model, n, bn_statistics=bn_statistics)
    fitted.compile(optimizer=models.adam(), loss=models.loss(), metrics=["accuracy"])
    start = time.perf_counter()
    fitted.fit(x, y, batch_size=b, epochs=1, shuffle=False, verbose=0)
    seconds = time.perf_counter() - start
    logits = model.predict(datasets.test.images, batch_size=1000, verbose=0)
    accuracy = float(np.mean(logits.argmax(axis=1) == datasets.test.labels))
    return 100.0 * accuracy, model, seconds


def measure(updates, log=print):
    datasets = data.load_mnist()
    x, y = next(data.batches(datasets.train, models.SEED, updates * WINDOW, 0, 1))
    rows = []
    for norm in NORMS:
        reference = None
        for n, b in CONFIGS:
            for mode in (("update", "mini_batch") if n > 1 and norm.startswith("Batch")
                         else ("update",)):
                accuracy, model, seconds = train(norm, n, b, mode, x, y, datasets)
                if reference is None:
                    reference = statistics(model)
                off = max((float(np.abs(a - r).max()) for a, r in
                           zip(statistics(model), reference)), default=None)
                rows.append((norm, n, b, mode if n > 1 else "(direct)", accuracy, off))
                log(f"{norm} N={n} B={b} {rows[-1][3]}: accuracy {accuracy:.2f}%, "
                    f"statistics off by {'-' if off is None else f'{off:.2g}'}, "
                    f"{seconds:.0f} s")
    return rows


def table(rows, command, updates):
    lines = [f"Measured {datetime.date.today()} by `{command}` on {results.machine()}: "
             f"{updates} updates of {WINDOW} samples, Adam 1e-3, momentum 0.99, test "
             "accuracy on the 10,000 test images in inference mode.", "",
             "| normalization | N x B | moving statistics | moving-average steps | test "
             "accuracy | moving statistics: largest difference from the direct batch's |",
             "|---|---|---|---|---|---|"]
    for norm, n, b, mode, accuracy, off in rows:
        how = {"update": "a step per update (`bn_statistics=\"update\"`, the default)",
               "mini_batch": "a step per mini-batch (`\"mini_batch\"`, Keras's own)",
               "(direct)": "the direct batch"}[mode]
        steps = f"{updates * (n if mode == 'mini_batch' else 1):,}"
        if not norm.startswith("Batch"):
            how, steps = "none (normalizes each sample alone)", "-"
        lines.append(f"| {norm} | {n} x {b} | {how} | {steps} | {accuracy:.2f}% | "
                     f"{'-' if off is None else f'{off:.2g}'} |")
    return "\n".join(lines) + "\n"


def main(argv):
    if len(argv) > 1:
        cli.fail(f"unexpected arguments: {' '.join(argv[1:])}")
    command = shlex.join(["python", "-m", "tools.batch_norm"] + sys.argv[1:])
    updates = 2 if FLAGS.quick else UPDATES
    path = FLAGS.output
    if not FLAGS.quick:  # before minutes of training: a bad --output is found at once
        try:
            with open(path) as f:
                doc = f.read()
            head, rest = doc.split(BEGIN, 1)
            _, tail = rest.split(END, 1)
        except (OSError, ValueError) as e:
            cli.fail(f"--output {path}: needs a table between {BEGIN} and {END} ({e})")
    text = table(measure(updates), command, updates)
    print(text)
    if FLAGS.quick:
        return
    try:
        results.atomic_write_text(path, f"{head}{BEGIN}\n{text}{END}{tail}")
    except OSError as e:
        cli.fail(f"--output {path}: cannot write ({results.cause(e)})", code=1)


def define_flags():
    """Defined only when run as a script, so tests can import it beside other tools."""
    cli.define("bool", "quick", False, "A few updates only (a smoke test); writes nothing.")
    cli.define("string", "output", os.path.join(common.ROOT, "docs", "batch-norm.md"),
               "The markdown file whose table is rewritten.")


if __name__ == "__main__":
    define_flags()
    app.run(main, flags_parser=cli.parse_flags)
