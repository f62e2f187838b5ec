"""The repository root and its command line, which the tools launch (the machine in words is
experiment.results.machine, the quiet TensorFlow import cli.import_tensorflow_quietly)."""

import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAIN = os.path.join(ROOT, "main.py")  # the tools launch the real command line
