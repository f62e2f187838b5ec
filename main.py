"""Gradient averaging on MNIST: the post's experiment from the command line.

    python main.py --average-gradients=5 --batch-size=20 --iterations=5000
"""

import os
import sys


def _import_tensorflow_quietly():
    """Imports TensorFlow with fd 2 closed: its C++ start-up lines ignore log levels.

    Errors still surface: stderr is restored before an import failure propagates.
    """
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            try:
                import tensorflow as tf
                tf.config.list_physical_devices()  # device probing logs too
            finally:
                os.dup2(saved, 2)
    finally:
        os.close(saved)
    tf.get_logger().setLevel("ERROR")


_import_tensorflow_quietly()

from absl import app  # noqa: E402
from absl import flags as absl_flags  # noqa: E402
from absl import logging  # noqa: E402

import data  # noqa: E402
import experiment  # noqa: E402
import flags  # noqa: E402
import results  # noqa: E402

FLAGS = flags.FLAGS
absl_flags.adopt_module_key_flags(flags)  # --help lists this project's flags


def fail(message):
    """Bad input: one clear line on stderr and a non-zero exit, no traceback."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def parse_flags(argv):
    try:
        return FLAGS(argv)
    except absl_flags.Error as e:
        fail(str(e).splitlines()[0])


def main(argv):
    if len(argv) > 1:
        fail(f"unexpected arguments: {' '.join(argv[1:])}")
    config = flags.train_config()
    results_path = flags.value("results")
    try:
        if results_path:
            results.check_writable(results_path)
        datasets = data.load_mnist(flags.value("data-dir"))
    except (data.DataError, results.ResultsError) as e:
        fail(str(e))

    runs = []
    for rep in range(flags.value("reps")):
        run = experiment.train_once(config, datasets, seed=flags.value("seed") + rep,
                                    verbose=flags.value("verbose"))
        runs.append(run)
        print(results.run_line(run), flush=True)
        if results_path:
            results.atomic_write_json(results_path,
                                      results.results_document(flags.all_values(), runs))
    print(results.summary_line([r["best_accuracy"] for r in runs]))


def run():
    logging.set_verbosity(logging.WARNING)
    app.run(main, flags_parser=parse_flags)


if __name__ == "__main__":
    run()
