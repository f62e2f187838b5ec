"""The command line's flags: settings.py's definitions as absl flags, and their values.

Only this module and main.py read flags; everything else takes the plain values these
functions return. No TensorFlow here: main.py parses and checks every flag before it
imports TensorFlow, so `--help` and a bad flag are answered at once.
"""

from absl import flags

import cli
import settings

FLAGS = flags.FLAGS

cli.define_all(settings.DEFINITIONS)


def value(name):
    """A flag's value by its public (dashed) name."""
    return FLAGS[name].value


def all_values():
    """Every setting's value by its public name, sorted: the results file's record."""
    return {name: value(name) for name in sorted(settings.SETTINGS)}


def train_config():
    """The settings.Config (the shape of one run) the flags describe."""
    return settings.from_values(settings.Config, all_values())


def runs():
    """The settings.Runs (reps, seed, output, checkpoints) the flags describe."""
    return settings.from_values(settings.Runs, all_values())


def data_dir():
    return value("data-dir")
