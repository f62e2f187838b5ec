"""Runs main.py as the workers of one MultiWorkerMirroredStrategy job on this machine.

    python -m tools.launch_workers --workers=2 -- --average-gradients=5 --batch-size=20 ...

Each worker trains its slice of the same global mini-batches. Worker 0 alone writes to this
terminal, `--results`, `--logdir` and the checkpoints (every worker resumes from them); where
a worker fails or --timeout passes, the others are stopped, none left waiting for a peer.
"""

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

from tools import common

HOST = "127.0.0.1"
CHIEF_ONLY_FLAGS = ("--results", "--logdir")


def free_ports(count):
    """Ports the kernel reports free on 127.0.0.1 (held open together, so distinct)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind((HOST, 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def chief_only(args):
    """The arguments minus the outputs only worker 0 writes (CHIEF_ONLY_FLAGS)."""
    kept, rest = [], iter(args)
    for arg in rest:
        if arg in CHIEF_ONLY_FLAGS:
            next(rest, None)  # its value is the next argument
        elif not arg.startswith(tuple(f + "=" for f in CHIEF_ONLY_FLAGS)):
            kept.append(arg)
    return kept


def role(index):
    """What worker `index` does, in words."""
    if index == 0:
        return "chief: its output follows; writes --results, --logdir and the checkpoints"
    return "worker: trains its slice of each mini-batch; its output is shown if it fails"


def worker_envs(count, env=None):
    """This environment, `env` added, and TF_CONFIG for each of `count` workers on free ports of
    HOST, worker 0 first."""
    cluster = {"worker": [f"{HOST}:{p}" for p in free_ports(count)]}
    return [dict(os.environ, **(env or {}), TF_CONFIG=json.dumps(
        {"cluster": cluster, "task": {"type": "worker", "index": index}}))
        for index in range(count)]


def start(worker_args, outputs, python=sys.executable, env=None, live=False):
    """A Popen per `worker_args` entry (worker 0 first), its output to `outputs`' file (None:
    this process's); `live` prints a line per worker first."""
    envs = worker_envs(len(worker_args), env)
    if live:
        for index, address in enumerate(json.loads(envs[0]["TF_CONFIG"])["cluster"]["worker"]):
            print(f"worker {index} at {address}: {role(index)}", flush=True)
    return [subprocess.Popen(
        [python, common.MAIN, "--engine=tf2", "--distribute=multi_worker", *args],
        cwd=common.ROOT, env=worker_env, stdout=output,
        stderr=None if output is None else subprocess.STDOUT, text=True)
        for args, output, worker_env in zip(worker_args, outputs, envs)]


def launch(args, workers=2, timeout=300, python=sys.executable, env=None, live=False):
    """Runs the workers to completion: (exit codes, outputs), worker 0 first; `env` is added to
    this environment; with `live` worker 0 writes to this terminal (its output then "")."""
    logs = [None if live and index == 0 else tempfile.TemporaryFile(mode="w+")
            for index in range(workers)]
    procs = start([args if index == 0 else chief_only(args) for index in range(workers)],
                  logs, python=python, env=env, live=live)
    deadline = time.monotonic() + timeout
    try:  # until all are done, one fails or the time is up
        while (any(p.poll() is None for p in procs) and all(p.poll() in (None, 0) for p in procs)
               and time.monotonic() <= deadline):
            time.sleep(0.2)
    finally:
        for p in procs:  # a worker whose peer is gone would wait for it forever
            if p.poll() is None:
                p.kill()
                p.wait()
    outputs = [_read(log) for log in logs]
    codes = [p.returncode for p in procs]
    if time.monotonic() > deadline and any(c != 0 for c in codes):
        outputs[0] += f"\nerror: the workers did not finish within {timeout} s\n"
    return codes, outputs


def _read(log):
    """A worker's output, the file closed ("" where it wrote to this terminal)."""
    if log is None:
        return ""
    with log:
        log.seek(0)
        return log.read()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2, help="worker processes (>= 1)")
    parser.add_argument("--timeout", type=float, default=600,
                        help="seconds before every worker is stopped")
    own, args = parser.parse_known_args()
    if own.workers < 1:
        parser.error("--workers must be at least 1")
    if args and args[0] == "--":
        args = args[1:]
    codes, outputs = launch(args, own.workers, own.timeout, live=True)
    print(outputs[0], end="")
    for index, (code, output) in enumerate(zip(codes, outputs)):
        if code != 0 and index > 0:
            print(f"--- worker {index} (exit {code}):\n{output}", end="", file=sys.stderr)
    sys.exit(0 if all(c == 0 for c in codes) else 1)


if __name__ == "__main__":
    main()
