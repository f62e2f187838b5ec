"""The tools' one probe protocol: function(spec) in a fresh process (a peak must not see this
process's state; some settings TensorFlow reads at start), its dict back with `seconds`; a
failure (an error, a crash, a timeout) is the spec with one `error` line.
"""

import concurrent.futures
import importlib
import json
import os
import signal
import subprocess
import sys
import time

from experiment import cli
from tools import common

TIMEOUT = 600  # seconds


def probe(function, spec, env=None, timeout=TIMEOUT):
    """spawn() under op determinism, `env` added; where a kernel has no deterministic one, again
    without (`determinism_error` says why)."""
    env = dict(os.environ, **(env or {}))
    result = spawn(function, dict(spec, deterministic=True), env, timeout)
    if result.pop("determinism", False):
        refused = result["error"]
        result = spawn(function, dict(spec, deterministic=False), env, timeout)
        result.pop("determinism", None)
        result["determinism_error"] = refused
    return result


def probe_all(function, specs, jobs=1, env=None):
    """probe() of each spec, `jobs` processes at a time; yields the results in order."""
    with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
        yield from pool.map(lambda spec: probe(function, spec, env), specs)


def spawn(function, spec, env=None, timeout=TIMEOUT):
    """function(spec) in a fresh process whose environment is `env` (None: this one's)."""
    module = sys.modules[function.__module__].__spec__.name  # its name, also as __main__
    start = time.perf_counter()
    try:
        done = subprocess.run(
            [sys.executable, "-m", "tools.bench_probe", f"{module}:{function.__name__}",
             json.dumps(spec)], cwd=common.ROOT, env=env, capture_output=True, text=True,
            timeout=timeout)
    except subprocess.TimeoutExpired:
        return dict(spec, error=f"probe timed out after {timeout} s",
                    seconds=time.perf_counter() - start)
    seconds, code = time.perf_counter() - start, done.returncode
    if code in (-signal.SIGSEGV, 128 + signal.SIGSEGV):
        return dict(spec, error="segmentation fault (exit 139)", seconds=seconds)
    lines = done.stdout.strip().splitlines()
    if code or not lines:
        why = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit {code}"
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return dict(spec, error=f"probe failed ({why}): {tail}", seconds=seconds)
    return dict(json.loads(lines[-1]), seconds=seconds)


def main(argv):
    """The probe process: argv is [program, MODULE:FUNCTION, JSON spec]."""
    if len(argv) != 3 or ":" not in argv[1]:
        cli.fail("usage: python -m tools.bench_probe MODULE:FUNCTION JSON (the tools' probes)")
    try:
        spec = json.loads(argv[2])
    except json.JSONDecodeError as e:
        cli.fail(f"probe spec: not JSON ({e})")
    cli.import_tensorflow_quietly()
    import tensorflow as tf
    deterministic = spec.get("deterministic", False)
    if deterministic:
        tf.config.experimental.enable_op_determinism()
    module, name = argv[1].split(":")
    try:
        result = getattr(importlib.import_module(module), name)(spec)
    except tf.errors.OpError as e:
        line = cli.missing_deterministic_kernel(e) if deterministic else None
        result = dict(spec, error=line or str(e).strip().splitlines()[0])
        if line:
            result["determinism"] = True
    print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv)
