"""Device memory: evaluation fits where training fits, and a run that does not fit says so
in one line.

The CPU is made a device of a few MiB as a GPU would be one of a few GiB: the BFC
allocator with a limit, set in the environment of a main.py process (device.CPU_BFC_ENV,
memory.CPU_LIMIT_ENV). oneDNN is off there, so that an OOM inside a convolution raises
instead of ending the process, and one inter-op thread makes the peak repeatable.
"""

import json
import math
import re

import numpy as np
import pytest
import tensorflow as tf

import main  # noqa: F401  (defines main.py's flags in this process)
import model
from experiment import config as config_lib
from experiment import device_memory as memory
from experiment import engine_tf1
from experiment import loop
from gradient_averaging import device
from tests.helpers import one_line_exit
from tests.helpers import run_cli
from tests.helpers import run_main_in_process

ENGINES = ("tf1", "tf2")
BFC = {device.CPU_BFC_ENV: "true", "TF_ENABLE_ONEDNN_OPTS": "0", "TF_NUM_INTEROP_THREADS": "1"}
# The short run the evaluation test makes under a limit: B=5, so that a training step
# needs a small part of what the whole test set in one call did.
SHORT = dict(average_gradients=2, batch_size=5, iterations=2, eval_every=0)
# The training steps of SHORT in each engine (as main.py takes them, op determinism on),
# in a process of its own under the BFC allocator without a limit: prints each engine's
# peak, counted from its start (the tf1 session closed first; a leftover only adds).
TRAINING_PEAKS = """
import json, sys
import tensorflow as tf
from experiment import config as config_lib, data, loop
tf.config.experimental.enable_op_determinism()
datasets = data.load_mnist(sys.argv[2])
peaks = {}
for engine_name in json.loads(sys.argv[1]):
    config = config_lib.Config(engine=engine_name, **json.loads(sys.argv[3]))
    tf.config.experimental.reset_memory_stats("CPU:0")
    engine = loop.engine_module(engine_name).Engine(config, seed=0)
    batches = data.batches(datasets.train, 0, config.batch_size, 0, config.iterations)
    for iteration, (images, labels) in enumerate(batches, start=1):
        engine.step(images, labels, iteration)
    peaks[engine_name] = tf.config.experimental.get_memory_info("CPU:0")["peak"]
    engine.close()
print(json.dumps(peaks))
"""


def flags_of(config):
    return [f"--engine={config.engine}", f"--average-gradients={config.average_gradients}",
            f"--batch-size={config.batch_size}", f"--iterations={config.iterations}",
            f"--eval-every={config.eval_every}", "--reps=1"]


@pytest.fixture(scope="module")
def training_peaks(tmp_path_factory, mnist_dir):
    """{engine: bytes} at the peak of SHORT's training, one probe process for both."""
    probe = tmp_path_factory.mktemp("probe") / "training_peaks.py"
    probe.write_text(TRAINING_PEAKS)
    proc = run_cli(json.dumps(ENGINES), mnist_dir, json.dumps(SHORT), script=str(probe),
                   env=BFC)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("engine", ENGINES)
def test_evaluation_fits_under_a_limit_training_fits_under(tmp_path, mnist, mnist_dir,
                                                           training_peaks, engine):
    """The whole test set in one call needs many times a training step at B=5 of the
    convnet; under a limit just above that step's peak, the run evaluates all of it."""
    config = config_lib.Config(engine=engine, **SHORT)
    # 2 MiB over the peak: the allocator's rounding, and the peak's spread over processes
    limit = math.ceil(training_peaks[engine] / memory.MIB) + 2
    whole_test_set = len(mnist.test.labels) * memory.forward_bytes(config.model)
    assert whole_test_set > memory.FORWARD_MARGIN * limit * memory.MIB
    results = tmp_path / "results.json"
    proc = run_cli(*flags_of(config), f"--data-dir={mnist_dir}", f"--results={results}",
                   env=dict(BFC, **{memory.CPU_LIMIT_ENV: str(limit)}))
    assert proc.returncode == 0, proc.stderr[-2000:]
    evaluations = json.loads(results.read_text())["runs"][0]["evaluations"]
    assert [e["iteration"] for e in evaluations] == [config.iterations]


@pytest.mark.slow
@pytest.mark.parametrize("engine", ENGINES)
def test_a_batch_that_does_not_fit_gives_one_line_and_keeps_the_checkpoint(
        tmp_path, mnist_quick, mnist_quick_dir, engine):
    config = config_lib.Config(engine=engine, average_gradients=2, batch_size=500, iterations=4,
                         eval_every=0)
    limit = 8  # MiB: less than the activations a training step at B keeps for its gradients
    assert config.batch_size * sum(model.activation_sizes(config.model)) * 4 > limit * memory.MIB
    rep = tmp_path / "rep-0"
    with pytest.raises(loop.Stopped):  # a checkpoint after one mini-batch, without a limit
        loop.train_once(config, mnist_quick, seed=0, checkpoint_dir=str(rep),
                        should_stop=lambda: "SIGINT")
    saved = {path.name: path.read_bytes() for path in rep.iterdir()}

    proc = run_cli(*flags_of(config), f"--checkpoint-dir={tmp_path}",
                   f"--data-dir={mnist_quick_dir}",
                   env=dict(BFC, **{memory.CPU_LIMIT_ENV: str(limit)}))
    assert proc.returncode == 1
    [line] = proc.stderr.splitlines()
    n, b = config.average_gradients, config.batch_size
    assert line.startswith(f"error: out of memory at N={n}, B={b} (device memory {limit} MiB): "
                           "try "), line
    suggested = re.search(r"--average-gradients=(\d+) --batch-size=(\d+)", line).groups()
    new_n, new_b = map(int, suggested)
    assert new_n * new_b == n * b and new_b < b
    assert f"{tmp_path} keeps what this run saved" in line
    assert {path.name: path.read_bytes() for path in rep.iterdir()} == saved


# What cuBLAS's failed allocation on a GPU surfaces as (no ResourceExhaustedError).
CUBLAS_MESSAGE = ("Graph execution error:\n\nDetected at node convnet/MatMul\nAttempting to "
                  "perform BLAS operation using StreamExecutor without BLAS support: "
                  "CUBLAS_STATUS_ALLOC_FAILED\n\t [[{{node convnet/MatMul}}]]")


@pytest.mark.parametrize("error, batch_size, expected", [
    (tf.errors.InternalError(None, None, CUBLAS_MESSAGE), 100,
     "try --average-gradients=6 --batch-size=50 (the same 300 samples per update)"),
    (tf.errors.ResourceExhaustedError(None, None, "OOM when allocating tensor"), 9,
     "try --average-gradients=9 --batch-size=3 (the same 27 samples per update)"),
    (tf.errors.ResourceExhaustedError(None, None, "OOM when allocating tensor"), 1,
     "one sample per mini-batch does not fit on this device, and no N makes a mini-batch "
     "smaller (a larger N needs no less memory)"),
])
def test_an_out_of_memory_error_gets_one_line_that_suggests_smaller_batches(
        capsys, monkeypatch, mnist_quick_dir, error, batch_size, expected):
    def run_out_of_memory(*unused):
        raise error

    monkeypatch.setattr(engine_tf1.Engine, "step", run_out_of_memory)
    no_statistics(monkeypatch)  # the line names no memory
    line = one_line_exit(capsys, run_main_in_process, "--average-gradients=3",
                         f"--batch-size={batch_size}", f"--data-dir={mnist_quick_dir}", code=1)
    assert line == f"error: out of memory at N=3, B={batch_size}: {expected}"


def test_another_internal_error_is_raised_as_it_is(monkeypatch, mnist_quick_dir):
    def fail(*unused):
        raise tf.errors.InternalError(None, None, "a kernel's own failure")

    monkeypatch.setattr(engine_tf1.Engine, "step", fail)
    with pytest.raises(tf.errors.InternalError):
        run_main_in_process(f"--data-dir={mnist_quick_dir}")


@pytest.mark.parametrize("name", sorted(model.LAYERS))
def test_activation_sizes_are_the_keras_models_layer_outputs(name):
    net = model.keras_model(name)
    assert model.activation_sizes(name) == [int(np.prod(net.layers[0].input.shape[1:]))] + [
        int(np.prod(layer.output.shape[1:])) for layer in net.layers]


@pytest.mark.parametrize("engine", ENGINES)
def test_the_accuracy_is_the_same_in_any_chunk(mnist_quick, engine):
    config = config_lib.Config(engine=engine, average_gradients=1, batch_size=7)
    trained = loop.engine_module(engine).Engine(config, seed=0)
    images, labels = mnist_quick.train.images[:7], mnist_quick.train.labels[:7]
    trained.step(images, labels, 1)
    test = mnist_quick.test  # 1,000 images: chunks of 7 leave a short one at the end
    accuracies = {chunk: trained.evaluate(test, chunk) for chunk in (7, 700, len(test.labels))}
    assert len(set(accuracies.values())) == 1, accuracies
    trained.close()


def no_statistics(monkeypatch):
    """A device whose allocator keeps no statistics: TensorFlow's default CPU allocator
    on most machines, but not all (on one of this project's machines, 2026-11-26, it
    kept some without TF_CPU_ALLOCATOR_USE_BFC)."""
    monkeypatch.setattr(memory, "statistics", lambda device_name: None)


def test_the_chunk_is_a_multiple_of_b_and_at_most_max_chunk_without_statistics(monkeypatch):
    # No statistics: no limit, the quickest chunk.
    no_statistics(monkeypatch)
    assert memory.evaluation_chunk(7, "convnet") == 7 * (memory.MAX_CHUNK // 7)
    assert memory.evaluation_chunk(memory.MAX_CHUNK * 3, "convnet") == memory.MAX_CHUNK * 3


@pytest.mark.slow
def test_effective_batch_auto_trains_under_a_limit_the_direct_batch_does_not_fit(
        tmp_path, mnist_quick_dir):
    """--effective-batch-size=E --batch-size=auto under a limit: the micro-batch is found
    on the device, said in one line, and the run trains within the limit and records E,
    B, N and the last mini-batch; the direct batch of E runs out of memory there. (The
    models have dropout: test_effective_batch.py checks the updates' exactness.)"""
    limit, effective = 64, 2003  # MiB; a prime E: no micro-batch divides it
    env = dict(BFC, **{memory.CPU_LIMIT_ENV: str(limit)})
    common = ("--engine=tf2", "--eval-every=0", "--reps=1", f"--data-dir={mnist_quick_dir}")
    direct = run_cli(*common, f"--batch-size={effective}", "--iterations=1", env=env)
    assert direct.returncode == 1 and "error: out of memory at N=1" in direct.stderr
    results = tmp_path / "r.json"
    proc = run_cli(*common, f"--effective-batch-size={effective}", "--batch-size=auto",
                   "--iterations=30", f"--results={results}", env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    record = json.loads(results.read_text())["config"]
    b, n, last = record["batch-size"], record["average-gradients"], record["last-mini-batch"]
    assert record["effective-batch-size"] == effective and record["batch-size-given"] == "auto"
    assert 1 <= b < effective and n == math.ceil(effective / b)
    assert (n - 1) * b + last == effective and 1 <= last <= b
    assert proc.stdout.splitlines()[0].startswith(
        f"effective batch {effective} = {n - 1} x {b} + {last}; largest mini-batch that "
        f"fits: {b} (peak ")


@pytest.mark.slow
def test_a_given_micro_batch_that_runs_out_of_memory_is_halved_and_the_run_goes_on(tmp_path,
                                                                                   mnist_quick_dir):
    """--effective-batch-size=E with a --batch-size that does not fit (the tf2 engine, one
    replica): the window is trained again at half B, one line each time, until it fits;
    the run ends as usual and its record names the sizes that ran out of memory."""
    limit, effective = 64, 2003
    results = tmp_path / "r.json"
    proc = run_cli("--engine=tf2", "--eval-every=0", "--reps=1", f"--data-dir={mnist_quick_dir}",
                   f"--effective-batch-size={effective}", f"--batch-size={effective}",
                   "--iterations=1", f"--results={results}",
                   env=dict(BFC, **{memory.CPU_LIMIT_ENV: str(limit)}))
    assert proc.returncode == 0, proc.stderr[-2000:]
    halvings = re.findall(r"out of memory at micro-batch (\d+): this window and the rest "
                          r"train as micro-batches of (\d+)", proc.stderr)
    run = json.loads(results.read_text())["runs"][0]
    assert halvings and halvings[0][0] == str(effective), proc.stderr[-2000:]
    assert [int(ran_out) for ran_out, _ in halvings] == run["out_of_memory"]
    assert all(int(half) == int(ran_out) // 2 for ran_out, half in halvings)
    assert run["updates"] == 1
