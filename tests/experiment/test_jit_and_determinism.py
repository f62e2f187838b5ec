"""--jit-compile (XLA for the tf2 engine's window) and --deterministic (op determinism).

main.py enables op determinism before it trains; the in-process runs here do not (it is
process-wide), so a test that needs it turns it on and off itself. TensorFlow refuses the
convnet's XLA gradient under determinism, on this CPU too: the real error is tested here,
and what a GPU raises for an op without a deterministic kernel is injected.
"""

import json

import numpy as np
import pytest
import tensorflow as tf
from absl.testing import flagsaver
from tensorflow.python.framework import config as tf_config

import main  # noqa: F401  (defines main.py's flags in this process)
from experiment import cli
from experiment import config as config_lib
from experiment import engine_tf1
from experiment import engine_tf2
from tests.helpers import one_line_exit
from tests.helpers import run_main_in_process

# Two windows: XLA compiles one shape.
SHORT = ("--engine=tf2", "--average-gradients=3", "--batch-size=10", "--iterations=6",
         "--eval-every=0")
# What a GPU raises for an op without a deterministic kernel (the unsorted segment sum's
# wording), with the node as TensorFlow names it.
GPU_MESSAGE = ("Graph execution error:\n\nDetected at node gradient_tape/Seg/Unsorted "
               "defined at (most recent call last):\n<stack traces unavailable>\nA "
               "deterministic GPU implementation of unsorted segment reduction op is not "
               "available.\n\t [[{{node gradient_tape/Seg/UnsortedSegmentSum}}]] "
               "[Op:__inference_train_1]")


@pytest.mark.parametrize("args, message", [
    (["--jit-compile"], "--jit-compile needs --engine=tf2"),
    (["--engine=tf2", "--jit-compile"], "--jit-compile with --model=convnet needs "
                                        "--nodeterministic"),
])
def test_jit_compile_is_refused_in_one_line_where_it_cannot_run(capsys, args, message):
    with flagsaver.flagsaver():
        err = one_line_exit(capsys, cli.parse_flags, ["main.py", *args])
    assert message in err


@pytest.mark.parametrize("args", [["--engine=tf2", "--jit-compile", "--nodeterministic"],
                                  ["--engine=tf2", "--jit-compile", "--model=mlp"],
                                  ["--deterministic=false"]])
def test_jit_compile_parses_where_determinism_allows_it(args):
    import flags
    with flagsaver.flagsaver():
        cli.parse_flags(["main.py", *args])
        config = flags.train_config()
    assert config.jit_compile == ("--jit-compile" in args)
    assert config.deterministic is False or "--model=mlp" in args


def test_jit_compile_reaches_the_window_and_a_checkpoint_records_it(
        tmp_path, capsys, monkeypatch, mnist_quick_dir):
    """One XLA run, its checkpoint refused to a run without XLA, which trains to other
    bits. (That an XLA run repeats its bits is tools/weights_check.sh's tf2-jit-mlp-n3
    line, compared by hand across runs.)"""
    made = []
    real = engine_tf2.WindowAccumulator

    def spy(*args, **kwargs):
        made.append(kwargs.get("jit_compile"))
        return real(*args, **kwargs)

    monkeypatch.setattr(engine_tf2, "WindowAccumulator", spy)
    checkpoints = f"--checkpoint-dir={tmp_path / 'ck'}"
    common = (*SHORT, "--nodeterministic", f"--data-dir={mnist_quick_dir}", checkpoints)
    run_main_in_process(*common, "--jit-compile", f"--results={tmp_path / 'r.json'}")
    assert made == [True]  # the flag reached the engine's accumulator
    assert json.loads((tmp_path / "r.json").read_text())["runs"][0]["updates"] == 2
    capsys.readouterr()
    err = one_line_exit(capsys, run_main_in_process, *common)
    assert "records other settings (jit_compile)" in err
    assert made == [True]  # refused before an engine was made


def test_under_determinism_xla_refuses_the_convnets_gradient_and_the_line_says_so():
    """Why the rule above exists, on this CPU: the real error, and the line main.py makes
    of it. If TensorFlow ever compiles it, this fails and the rule can go."""
    config = config_lib.Config(engine="tf2", average_gradients=2, batch_size=4, jit_compile=True)
    tf.config.experimental.enable_op_determinism()
    try:
        engine = engine_tf2.Engine(config, seed=0)
        images = np.zeros((4, 28, 28, 1), np.float32)
        labels = np.zeros(4, np.int64)
        engine.step(images, labels, 1)
        with pytest.raises(tf.errors.UnimplementedError) as raised:
            engine.step(images, labels, 2)
    finally:
        tf_config.disable_op_determinism()
    line = cli.missing_deterministic_kernel(raised.value)
    assert "deterministic XLA implementation" in line and "(node MaxPoolGrad)" in line
    assert "run with --nodeterministic" in line and "\n" not in line


def test_an_op_without_a_deterministic_gpu_kernel_gets_one_line_not_a_traceback(
        capsys, monkeypatch, mnist_quick_dir):
    def raise_like_a_gpu(*unused):
        raise tf.errors.UnimplementedError(None, None, GPU_MESSAGE)

    monkeypatch.setattr(engine_tf1.Engine, "step", raise_like_a_gpu)
    err = one_line_exit(capsys, run_main_in_process, f"--data-dir={mnist_quick_dir}")
    assert err == ("error: op determinism is on and TensorFlow has no deterministic kernel "
                   "here: A deterministic GPU implementation of unsorted segment reduction "
                   "op is not available (node UnsortedSegmentSum); run with "
                   "--nodeterministic to train without op determinism (runs may then "
                   "differ in their last bits)")
    # Without determinism, or for another error, the line would be wrong: raised as is.
    with pytest.raises(tf.errors.UnimplementedError):
        run_main_in_process("--nodeterministic", f"--data-dir={mnist_quick_dir}")

    def raise_other(*unused):
        raise tf.errors.InvalidArgumentError(None, None, "Incompatible shapes: [4] vs. [3]")

    monkeypatch.setattr(engine_tf1.Engine, "step", raise_other)
    with pytest.raises(tf.errors.InvalidArgumentError):
        run_main_in_process(f"--data-dir={mnist_quick_dir}")
