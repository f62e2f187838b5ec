"""make gpu-check: the GPU tests and the device sections of the bench, into GPU.md.

    python -m tools.gpu_check                 # writes GPU.md
    python -m tools.gpu_check --quick         # the device section scaled down

On a GPU: GPU_TESTS with the GPU visible (GPU_TESTS=1; the rest of the suite hides it), the
device section and the tensor-memory table on the GPU's allocator. Without one, GPU.md says so.
"""

import os
import shlex
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree

from experiment import cli

cli.import_tensorflow_quietly()  # first: its C++ start-up lines would reach stderr
# ruff: noqa: E402 (the imports below follow the quiet TensorFlow import)

import tensorflow as tf
from absl import app
from absl import flags

from experiment import results
from tools import bench_device
from tools import bench_tensor_memory
from tools import common
from tools.bench_section import Run
from tools.bench_section import header
from tools.bench_section import table
from tools.bench_section import targets_table

FLAGS = flags.FLAGS
GPU_TESTS = ("tests/experiment/test_gpu.py", "tests/library/test_keras_fit.py")
TESTS_TIMEOUT = 1200
OUTCOMES = {"failure": "failed", "error": "error", "skipped": "skipped"}  # a case's, in turn


def run_gpu_tests():
    """GPU_TESTS under pytest with the GPU visible; [(test, outcome, first line)]."""
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "junit.xml")
        try:
            proc = subprocess.run(
                [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                 f"--junitxml={report}", *GPU_TESTS], cwd=common.ROOT, capture_output=True,
                text=True, timeout=TESTS_TIMEOUT, env=dict(os.environ, GPU_TESTS="1"))
        except subprocess.TimeoutExpired:
            return [("all", "not finished", f"timed out after {TESTS_TIMEOUT} s")]
        if not os.path.exists(report):
            tail = (proc.stdout + proc.stderr).strip().splitlines() or ["no output"]
            return [("all", "not run", tail[-1])]
        return _outcomes(ElementTree.parse(report).getroot())


def _outcomes(root):
    """[(test, outcome, first line)] of a junit report, by the first of OUTCOMES a case has."""
    out = []
    for case in root.iter("testcase"):
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        element = next((e for e in map(case.find, OUTCOMES) if e is not None), None)
        outcome = "passed" if element is None else OUTCOMES[element.tag]
        text = "" if element is None else element.get("message") or element.text or ""
        out.append((name, outcome, (text.strip().splitlines() or [""])[0]))
    return out


def render(tests, section, device, targets, command, elapsed, tensor_memory=None):
    """GPU.md's text; `device`, `tensor_memory`: the sections' results (None: no GPU)."""
    build = tf.sysconfig.get_build_info()
    lines = header("GPU check", command, elapsed) + [
        "TensorFlow's build (`tf.sysconfig.get_build_info()`): "
        + ", ".join(f"{k}={v}" for k, v in build.items()) + ".", ""]
    if device is None:
        return "\n".join(lines + [
            "**No GPU was found** here: the GPU paths are not yet measured on a GPU. `make "
            "gpu-check` on a machine with one rewrites this file.", "",
            *targets_table(targets)]) + "\n"
    lines += ["## Device", ""] + table(
        ("device", "name", "compute capability", "driver", "memory"),
        [[g[k] for k in ("name", "device_name", "compute_capability", "driver", "memory")]
         for g in device["gpu"]])
    passed = sum(outcome == "passed" for _, outcome, _ in tests)
    lines += ["", "## Tests with the GPU visible", "",
              f"`GPU_TESTS=1 pytest {' '.join(GPU_TESTS)}`: {passed} of {len(tests)} passed.",
              ""] + table(("test", "outcome", "message"), [
                  (name, outcome, line.replace("|", "/")) for name, outcome, line in tests])
    lines += ["", *targets_table(targets), "", *section.markdown(device)]
    if tensor_memory is not None:  # the bench's tensor-memory table, on the GPU's allocator
        lines += ["", *bench_tensor_memory.TensorMemory().markdown(tensor_memory)]
    return "\n".join(lines) + "\n"


def check(output, quick=False, command="python -m tools.gpu_check", log=print):
    """Measures what this machine has and writes GPU.md at `output`; returns its text."""
    start = time.perf_counter()
    section, run = bench_device.Device(quick), Run(log=log)
    tests, sections = [], [section]
    if bench_device.gpus():
        log(f"GPU tests ({', '.join(GPU_TESTS)}) with the GPU visible")
        tests = run_gpu_tests()
        for name, outcome, line in tests:
            log(f"  {outcome}: {name}" + (f" -- {line}" if line else ""))
        sections.append(bench_tensor_memory.TensorMemory(quick, gpu=True))
    targets = run.measure(sections)
    text = render(tests, section, run.results[section.name], targets, command,
                  time.perf_counter() - start, run.results.get("tensor_memory"))
    results.atomic_write_text(output, text)
    return text


def main_check(argv):
    if len(argv) > 1:
        cli.fail(f"unexpected arguments: {' '.join(argv[1:])}")
    try:
        results.check_writable(FLAGS.output, "--output")
    except results.ResultsError as e:
        cli.fail(str(e))
    command = shlex.join(["python", "-m", "tools.gpu_check", *sys.argv[1:]])
    try:
        check(FLAGS.output, FLAGS.quick, command)
    except OSError as e:  # the disk filled or the directory went since the check
        cli.fail(f"--output {FLAGS.output}: cannot write it ({results.cause(e)})", code=1)
    print(f"Wrote {FLAGS.output}")


if __name__ == "__main__":
    from absl import logging
    logging.set_verbosity(logging.WARNING)
    # Defined here: tools.bench defines the same names, and a test process may import both.
    cli.define("string", "output", "GPU.md", "Markdown file to write.")
    cli.define("bool", "quick", False, "The device section scaled down (a smoke test).")
    app.run(main_check, flags_parser=cli.parse_flags)
