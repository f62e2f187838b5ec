"""The command line's flags: experiment/config.py's settings as absl flags, and their values.

Only this module and main.py read flags; everything else takes the plain values these
functions return. No TensorFlow here: main.py parses and checks every flag before it
imports TensorFlow, so `--help` and a bad flag are answered at once.
"""

from absl import flags

from experiment import cli
from experiment import config

FLAGS = flags.FLAGS

cli.define_all(list(config.SETTINGS.values()) + list(config.RULES))


def value(name):
    """A flag's value by its public (dashed) name."""
    return FLAGS[name].value


def all_values():
    """Every setting's value by its public name, sorted: the results file's record."""
    return {name: value(name) for name in sorted(config.SETTINGS)}


def train_config():
    """The config.Config (the shape of one run) the flags describe: with an effective
    batch, its N derived from a given B (--batch-size=auto leaves B at config.AUTO, for
    main.py to find on the device)."""
    train = config.from_values(config.Config, all_values())
    if train.batch_size == config.AUTO:
        return train
    return config.with_micro_batch(train, train.batch_size)


def runs():
    """The config.Runs (reps, seed, data, output, checkpoints) the flags describe."""
    return config.from_values(config.Runs, all_values())
