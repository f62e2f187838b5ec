"""Shared test fixtures: the real MNIST once per session, and the CLI as a subprocess."""

import os
import subprocess
import sys

import pytest
from absl.testing import flagsaver

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import main  # noqa: E402  (imports TensorFlow quietly, before any test module does)
import cli  # noqa: E402
import data  # noqa: E402


@pytest.fixture(scope="session")
def mnist():
    return data.load_mnist()


def run_cli(*args, timeout=300, script="main.py", module=None, env=None):
    """Runs `python main.py ARGS` (or `python -m MODULE ARGS`, a tool) from the repository
    root; returns the CompletedProcess."""
    program = ["-m", module] if module else [os.path.join(ROOT, script)]
    return subprocess.run([sys.executable, *program, *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, **(env or {})))


def run_main_in_process(*args):
    """Parses ARGS with the real flag parser and calls main.main, restoring the flags."""
    with flagsaver.flagsaver():
        cli.parse_flags(["main.py", "--reps=1", "--iterations=1", *args])
        main.main(["main.py"])
