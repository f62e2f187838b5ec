"""make gpu-check (tools/gpu_check.py) and the bench's device section (bench_device.py):
the no-GPU path as it runs here, and the GPU path's judging and GPU.md from made-up
measurements (this machine has no GPU to measure)."""

import os
import xml.etree.ElementTree as ElementTree

import pytest
import tensorflow as tf

from experiment import averagers
from tests.helpers import ROOT
from tools import bench_contenders
from tools import bench_device
from tools import bench_tensor_memory
from tools import gpu_check

FAKE_GPU = [dict(name="/physical_device:GPU:0", device_name="NVIDIA H100 80GB HBM3",
                 compute_capability="9.0", driver="550.54.15", memory="81559 MiB")]


def fake_device(accumulated_peak, speed_ratio, error=None):
    """A Device.measure() result: every probe of FULL with made-up peaks (direct 1000 MB,
    B alone 200 MB, each accumulated run `accumulated_peak`), one speed row whose fused
    and tf2 ratios are `speed_ratio`."""
    memory = []
    for spec in bench_device.memory_specs(bench_device.Device.FULL):
        peak = {"direct": 1000.0, "alone": 200.0}.get(spec["role"], accumulated_peak)
        memory.append(dict(spec, peak_mb=peak, before_mb=50.0, increment_mb=peak - 50.0))
    if error:
        memory[-1] = dict(memory[-1], error=error)
        del memory[-1]["peak_mb"]
    speed = []
    for b, r in ((16, 9.0), (256, speed_ratio)):  # B=16: under the speed targets' floor
        times = {k: [0.01 * (r if k in ("fused", "tf2") else 1.0)] * 3
                 for k in bench_device.LABELS}
        speed.append(dict(n=8, b=b, times=times,
                          median_ms={k: 1e3 * t[0] for k, t in times.items()},
                          vs_direct={k: bench_contenders.paired_ratio(times, k, "direct")
                                     for k in times}))
    return {"gpu": FAKE_GPU, "memory": memory, "speed": speed}


def test_without_a_gpu_gpu_check_runs_nothing_and_gpu_md_says_so(tmp_path, monkeypatch):
    def must_not_run(*unused):
        raise AssertionError("nothing is measured without a GPU")

    monkeypatch.setattr(gpu_check, "run_gpu_tests", must_not_run)
    monkeypatch.setattr(bench_device, "probe", must_not_run)
    monkeypatch.setattr(bench_device, "gpus", lambda: [])
    output = tmp_path / "GPU.md"
    text = gpu_check.check(str(output), log=lambda line: None)
    assert output.read_text() == text
    assert "**No GPU was found**" in text and "not yet measured on a GPU" in text
    build = tf.sysconfig.get_build_info()  # every key this TensorFlow's build has
    assert ", ".join(f"{k}={v}" for k, v in build.items()) in text
    rows = [line for line in text.splitlines() if line.endswith("| no GPU | not measured |")]
    assert len(rows) == 4
    assert "no GPU" in "\n".join(bench_device.Device().markdown(None))
    with open(os.path.join(ROOT, "Makefile")) as f:  # make gpu-check is this function's tool
        assert "gpu-check: install\n\t$(PY) -m tools.gpu_check" in f.read()


def test_gpu_md_names_the_build_keys_this_tensorflow_has(monkeypatch):
    """tf-nightly's build info has no cuda_version or cudnn_version: GPU.md says what there
    is, and asks for no key."""
    nightly = {"is_cuda_build": True, "is_rocm_build": False, "is_tensorrt_build": False}
    monkeypatch.setattr(tf.sysconfig, "get_build_info", lambda: dict(nightly))
    text = gpu_check.render([], bench_device.Device(), None, [], "python -m tools.gpu_check",
                            1.0)
    assert ("TensorFlow's build (`tf.sysconfig.get_build_info()`): is_cuda_build=True, "
            "is_rocm_build=False, is_tensorrt_build=False.") in text


def test_memory_probes_cover_every_averager_and_the_tf2_window_against_their_own_engine():
    specs = bench_device.memory_specs(bench_device.Device.FULL)
    n, b = bench_device.Device.FULL["n"], bench_device.Device.FULL["b"]
    assert n == 8 and b >= 256  # a size where activations dominate
    accumulated = {(s["engine"], s["averager"]) for s in specs if s["role"] == "accumulated"}
    assert accumulated == {("tf1", s) for s in averagers.AVERAGERS} | {("tf2", "tf2")}
    for engine in ("tf1", "tf2"):
        roles = {s["role"]: (s["n"], s["b"]) for s in specs if s["engine"] == engine}
        assert roles["direct"] == (1, n * b) and roles["alone"] == (1, b)


@pytest.mark.parametrize("peak, speed, statuses", [
    (210.0, 1.05, ["met", "met", "met", "met"]),      # 1.05x B alone, 0.21 of direct
    (230.0, 1.05, ["missed", "met", "met", "met"]),   # 1.15x B alone
    (200.0, 1.2, ["met", "met", "missed", "missed"]),  # 1.2x the direct batch's time
])
def test_device_targets_judge_peak_memory_and_time_against_their_limits(peak, speed, statuses):
    targets = bench_device.Device().targets(fake_device(peak, speed))
    assert [t.status for t in targets] == statuses
    assert targets[2].measured == f"{speed:.2f}x ({speed:.2f}-{speed:.2f})"  # B=16's 9x: not judged


def test_a_failed_probe_is_named_and_the_target_not_met():
    device = fake_device(210.0, 1.0, error="probe failed (1): OOM")
    targets = bench_device.Device().targets(device)
    assert [t.status for t in targets] == ["missed", "missed", "met", "met"]
    assert targets[0].measured.endswith("; a probe failed")
    assert "| tf2 | tf2 | 8 x 256 | probe failed (1): OOM |" in "\n".join(
        bench_device.Device().markdown(device))


def test_on_a_gpu_gpu_md_records_the_device_the_tests_every_number_and_the_targets(
        tmp_path, monkeypatch):
    tests = [("test_gpu::test_mirrored_trains_on_every_visible_gpu", "passed", ""),
             ("test_gpu::test_a_run_on_the_gpu_is_deterministic[tf2]", "failed",
              "error: op determinism is on and TensorFlow has no deterministic kernel here")]
    monkeypatch.setattr(bench_device, "gpus", lambda: FAKE_GPU)
    monkeypatch.setattr(gpu_check, "run_gpu_tests", lambda: tests)
    monkeypatch.setattr(bench_device.Device, "measure", lambda self, run: fake_device(230.0, 1.0))
    measured = []

    def tensor_memory(self, run):  # the tensor-memory table, read from the GPU's allocator
        measured.append(self.gpu)
        return dict(tables={}, growth=None)

    monkeypatch.setattr(bench_tensor_memory.TensorMemory, "measure", tensor_memory)
    text = gpu_check.check(str(tmp_path / "GPU.md"), log=lambda line: None)
    assert measured == [True] and f"## {bench_tensor_memory.TensorMemory.title}" in text
    assert "No GPU" not in text
    assert "| /physical_device:GPU:0 | NVIDIA H100 80GB HBM3 | 9.0 | 550.54.15 | 81559 MiB |" \
        in text
    assert "1 of 2 passed" in text and "| failed | error: op determinism is on" in text
    assert "| accumulated device peak <= 1.1x that of B alone | worst 1.15x (tf1 stack) | " \
           "missed |" in text
    assert "| tf1 | fused | 8 x 256 | 230.0 | 50.0 | 180.0 | 1.15 | 0.23 |" in text
    assert "| 8 x 256 | 10.0 ms, 1.00x |" in text


def test_junit_outcomes_are_read_per_test():
    root = ElementTree.fromstring(
        '<testsuites><testsuite><testcase classname="tests.experiment.test_gpu" name="a"/>'
        '<testcase classname="tests.experiment.test_gpu" name="b"><failure message="boom&#10;'
        'more">trace</failure></testcase><testcase classname="x.test_keras_fit" name="c">'
        '<skipped message="no GPU"/></testcase></testsuite></testsuites>')
    outcomes = gpu_check._outcomes(root)  # noqa: SLF001 (the parser under test)
    assert outcomes == [("test_gpu::a", "passed", ""),
                        ("test_gpu::b", "failed", "boom"),
                        ("test_keras_fit::c", "skipped", "no GPU")]


def test_a_probe_measured_without_determinism_is_named():
    line = "op determinism is on and TensorFlow has no deterministic kernel here: X"
    device = fake_device(210.0, 1.0)
    device["memory"][0]["determinism_error"] = line
    assert f"Measured without op determinism (TensorFlow refused it): tf1 direct N=1 " \
           f"B=2048 ({line})." in "\n".join(bench_device.Device().markdown(device))
