"""Device memory: evaluation fits where training fits.

The CPU is made a device of a few MiB as a GPU would be one of a few GiB: the BFC
allocator with a limit, set in the environment of a main.py process (memory.CPU_BFC_ENV,
memory.CPU_LIMIT_ENV). oneDNN is off there, so that an OOM inside a convolution raises
instead of ending the process, and one inter-op thread makes the peak repeatable.
"""

import json
import math

import numpy as np
import pytest

from experiment import loop
from experiment import memory
import model
from tests.helpers import run_cli

ENGINES = ("tf1", "tf2")
BFC = {memory.CPU_BFC_ENV: "true", "TF_ENABLE_ONEDNN_OPTS": "0", "TF_NUM_INTEROP_THREADS": "1"}
# The training steps of a run at `config` (as main.py takes them, op determinism on), in a
# process of its own under the BFC allocator without a limit: prints the device's peak.
TRAINING_PEAK = """
import json, sys
import tensorflow as tf
from experiment import data, loop
tf.config.experimental.enable_op_determinism()
config = loop.Config(**json.loads(sys.argv[1]))
datasets = data.load_mnist(sys.argv[2])
engine = loop.engine_module(config.engine).Engine(config, seed=0)
batches = data.batches(datasets.train, 0, config.batch_size, 0, config.iterations)
for iteration, (images, labels) in enumerate(batches, start=1):
    engine.step(images, labels, iteration)
print(tf.config.experimental.get_memory_info("CPU:0")["peak"])
"""


def flags_of(config):
    return [f"--engine={config.engine}", f"--average-gradients={config.average_gradients}",
            f"--batch-size={config.batch_size}", f"--iterations={config.iterations}",
            f"--eval-every={config.eval_every}", "--reps=1"]


def training_peak(tmp_path, config, data_dir):
    probe = tmp_path / "training_peak.py"
    probe.write_text(TRAINING_PEAK)
    fields = ("engine", "average_gradients", "batch_size", "iterations")
    proc = run_cli(json.dumps({f: getattr(config, f) for f in fields}), data_dir,
                   script=str(probe), env=BFC)
    assert proc.returncode == 0, proc.stderr
    return int(proc.stdout.split()[-1])


@pytest.mark.parametrize("engine", ENGINES)
def test_evaluation_fits_under_a_limit_training_fits_under(tmp_path, mnist_dir, engine):
    """The whole test set in one call needs many times a training step at B=5 of the
    convnet; under a limit just above that step's peak, the run evaluates all of it."""
    config = loop.Config(engine=engine, average_gradients=2, batch_size=5, iterations=2,
                         eval_every=0)
    peak = training_peak(tmp_path, config, mnist_dir)
    # 2 MiB over the peak: the allocator's rounding, and the peak's spread over processes
    limit = math.ceil(peak / memory.MIB) + 2
    results = tmp_path / "results.json"
    proc = run_cli(*flags_of(config), f"--data-dir={mnist_dir}", f"--results={results}",
                   env=dict(BFC, **{memory.CPU_LIMIT_ENV: str(limit)}))
    assert proc.returncode == 0, proc.stderr[-2000:]
    evaluations = json.loads(results.read_text())["runs"][0]["evaluations"]
    assert [e["iteration"] for e in evaluations] == [2]


@pytest.mark.parametrize("name", sorted(model.LAYERS))
def test_activation_sizes_are_the_keras_models_layer_outputs(name):
    net = model.keras_model(name)
    assert model.activation_sizes(name) == [int(np.prod(net.layers[0].input.shape[1:]))] + [
        int(np.prod(layer.output.shape[1:])) for layer in net.layers]


@pytest.mark.parametrize("engine", ENGINES)
def test_the_accuracy_is_the_same_in_any_chunk(mnist_quick, engine):
    config = loop.Config(engine=engine, average_gradients=1, batch_size=7)
    trained = loop.engine_module(engine).Engine(config, seed=0)
    images, labels = mnist_quick.train.images[:7], mnist_quick.train.labels[:7]
    trained.step(images, labels, 1)
    test = mnist_quick.test  # 1,000 images: chunks of 7 leave a short one at the end
    accuracies = {chunk: trained.evaluate(test, chunk) for chunk in (7, 700, len(test.labels))}
    assert len(set(accuracies.values())) == 1, accuracies
    trained.close()


def test_the_chunk_is_a_multiple_of_b_and_at_most_max_chunk_without_statistics():
    # This process's CPU allocator keeps no statistics: no limit, the quickest chunk.
    assert memory.statistics(memory.device()) is None
    assert memory.evaluation_chunk(7, "convnet") == 7 * (memory.MAX_CHUNK // 7)
    assert memory.evaluation_chunk(memory.MAX_CHUNK * 3, "convnet") == memory.MAX_CHUNK * 3
