"""Gradient averaging on MNIST: the post's experiment from the command line.

    python main.py --average-gradients=5 --batch-size=20 --iterations=5000
"""

import contextlib
import logging as std_logging

from absl import app
from absl import logging

import flags  # neither imports TensorFlow: the flags are checked first
from experiment import cli
from experiment import config as config_lib

FLAGS = flags.FLAGS


def main(argv):
    if len(argv) > 1:
        cli.fail(f"unexpected arguments: {' '.join(argv[1:])}")
    # These import TensorFlow: only now, with every flag good.
    from experiment import data
    from experiment import loop
    from experiment import results

    config, runs = flags.train_config(), flags.runs()
    with cli.one_line_errors():  # a configuration refused here, or a worker lost
        loop.prepare(config)  # devices are fixed once TensorFlow's runtime starts
        config, cut = loop.effective_batch(config)  # --batch-size=auto: found here
    if cut:
        print(cut, flush=True)
    with (contextlib.ExitStack() as held,  # the checkpoint directory's lock, to the end
          cli.StopSignals() as stop,
          cli.one_line_errors(config, runs.checkpoint_dir, stop)):
        runs = results.check_outputs(config, runs, held)
        datasets = data.load_mnist(runs.data_dir)
        loop.train_reps(config, datasets, runs, record(config), stop)


def record(config):
    """What the results file says made the runs: every flag's value, and the window as
    trained (B found where --batch-size=auto; N and the last mini-batch derived from E)."""
    values = flags.all_values()
    if config.effective_batch_size:
        values.update({"batch-size": config.batch_size,
                       "average-gradients": config.average_gradients,
                       "last-mini-batch": config_lib.mini_batch_size(
                           config, config.average_gradients),
                       "batch-size-given": flags.value("batch-size")})
    return values


def parse_flags_then_import_tensorflow(argv):
    """app.run's flags_parser: help and bad flags are answered (and exit) before the
    slow TensorFlow import; then TensorFlow, quietly, deterministic unless
    --nodeterministic."""
    args = cli.parse_flags(argv)
    cli.import_tensorflow_quietly()
    import tensorflow as tf
    if FLAGS.deterministic:
        tf.config.experimental.enable_op_determinism()  # same flags, same bits
    return args


def run():
    logging.set_verbosity(logging.WARNING)
    logging.get_absl_handler().setFormatter(std_logging.Formatter("%(levelname)s: %(message)s"))
    app.run(main, flags_parser=parse_flags_then_import_tensorflow)


if __name__ == "__main__":
    run()
