"""The bench's probe: a measurement in a fresh process, given a JSON spec, returning JSON.

Where a measurement must not see this process's state (a peak RSS, a device allocator's
peak) or needs a setting TensorFlow reads only at start (TF_ENABLE_ONEDNN_OPTS),
probe(function, spec) runs `python -m tools.bench_probe MODULE:FUNCTION JSON`: TensorFlow
imported quietly, op determinism on as main.py sets it, function(spec)'s dict printed as
one JSON line. A failure comes back as the spec with an `error` line, never raised.
"""

import concurrent.futures
import importlib
import json
import os
import subprocess
import sys

from experiment import cli
from tools import common

TIMEOUT = 600  # seconds


def probe(function, spec, env=None, timeout=TIMEOUT):
    """function(spec) in a fresh process, `env` added to its environment; where TensorFlow
    has no deterministic kernel for it, again without op determinism (the result's
    `determinism_error` says why)."""
    result = _spawn(function, dict(spec, deterministic=True), env, timeout)
    if result.pop("determinism", False):
        refused = result["error"]
        result = _spawn(function, dict(spec, deterministic=False), env, timeout)
        result.pop("determinism", None)
        result["determinism_error"] = refused
    return result


def probe_all(function, specs, jobs=1, env=None):
    """probe() of each spec, `jobs` processes at a time; yields the results in order."""
    with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
        yield from pool.map(lambda spec: probe(function, spec, env), specs)


def _spawn(function, spec, env, timeout):
    try:
        done = subprocess.run(
            [sys.executable, "-m", "tools.bench_probe",
             f"{function.__module__}:{function.__name__}", json.dumps(spec)],
            cwd=common.ROOT, capture_output=True, text=True, timeout=timeout,
            env=dict(os.environ, **(env or {})))
    except subprocess.TimeoutExpired:
        return dict(spec, error=f"probe timed out after {timeout} s")
    lines = done.stdout.strip().splitlines()
    if done.returncode or not lines:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return dict(spec, error=f"probe failed ({done.returncode}): {tail}")
    return json.loads(lines[-1])


def main(argv):
    """The probe process: argv is [program, MODULE:FUNCTION, JSON spec]."""
    if len(argv) != 3 or ":" not in argv[1]:
        cli.fail("usage: python -m tools.bench_probe MODULE:FUNCTION JSON (the bench's probes)")
    try:
        spec = json.loads(argv[2])
    except json.JSONDecodeError as e:
        cli.fail(f"probe spec: not JSON ({e})")
    cli.import_tensorflow_quietly()
    import tensorflow as tf
    deterministic = spec.get("deterministic", True)
    if deterministic:
        tf.config.experimental.enable_op_determinism()
    module, name = argv[1].split(":")
    try:
        result = getattr(importlib.import_module(module), name)(spec)
    except tf.errors.OpError as e:
        line = cli.missing_deterministic_kernel(e) if deterministic else None
        result = dict(spec, error=line or str(e).strip().splitlines()[0],
                      determinism=line is not None)
    print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv)
