"""Gradient averaging on MNIST: the post's experiment from the command line.

    python main.py --average-gradients=5 --batch-size=20 --iterations=5000
"""

import contextlib
import logging as std_logging
import signal
import sys

from absl import app
from absl import logging

import flags  # neither imports TensorFlow: the flags are checked first
from experiment import cli
from experiment import config as config_lib

FLAGS = flags.FLAGS


class StopSignals:
    """SIGINT and SIGTERM ask the training loop to stop after the current mini-batch.

    The loop then saves its checkpoint and the process exits 128 + the signal's number.
    A second signal ends the process at once.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.received = None
        self._previous = {}

    def __enter__(self):
        self._previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        return self

    def __exit__(self, *unused):
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def _handle(self, signum, frame):
        if self.received:
            sys.exit(128 + signum)
        self.received = signal.Signals(signum)

    def __call__(self):
        return self.received.name if self.received else None


def main(argv):
    if len(argv) > 1:
        cli.fail(f"unexpected arguments: {' '.join(argv[1:])}")
    # The training modules import TensorFlow: only now, with every flag good.
    import tensorflow as tf

    from experiment import checkpoint
    from experiment import data
    from experiment import loop
    from experiment import memory
    from experiment import results
    from experiment import runlock
    from gradient_averaging import micro_batch

    config, runs = flags.train_config(), flags.runs()
    try:
        loop.prepare(config)  # devices are fixed once TensorFlow's runtime starts
        config, cut = loop.effective_batch(config)  # --batch-size=auto: found here
    except ValueError as e:  # the engine cannot run this configuration here
        cli.fail(str(e))
    if cut:
        print(cut, flush=True)
    with contextlib.ExitStack() as held:  # the checkpoint directory's lock, to the end
        try:
            runs = results.check_outputs(config, runs, held)
            datasets = data.load_mnist(runs.data_dir)
        except (data.DataError, results.ResultsError, runlock.LockError) as e:
            cli.fail(str(e))

        with StopSignals() as stop:
            try:
                loop.train_reps(config, datasets, runs, record(config), stop)
            except checkpoint.CheckpointError as e:
                cli.fail(str(e))
            except micro_batch.NothingFits as e:  # one sample ran out of memory in training
                cli.fail(str(e), code=1)
            except results.WriteError as e:  # a full disk, a lost permission
                cli.fail(str(e), code=1)
            except loop.Stopped as e:
                cli.fail(str(e), code=128 + stop.received if stop.received else 3)
            except tf.errors.OpError as e:  # the device's memory ran out (the checkpoint
                # in force stays), or an op has no deterministic kernel here
                line = memory.out_of_memory(e, config.average_gradients, config.batch_size,
                                            runs.checkpoint_dir, config.effective_batch_size)
                if line is not None:
                    cli.fail(line, code=1)
                line = cli.missing_deterministic_kernel(e) if config.deterministic else None
                if line is None:
                    raise
                cli.fail(line)


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
