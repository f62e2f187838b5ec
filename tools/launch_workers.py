"""Runs main.py as the workers of one MultiWorkerMirroredStrategy job on this machine.

    python -m tools.launch_workers --workers=2 -- --average-gradients=5 --batch-size=20 ...

Each worker is `main.py --engine=tf2 --distribute=multi_worker ARGS` with its own TF_CONFIG
on 127.0.0.1 (free ports): each trains its slice of the same global mini-batches. Worker 0
(the chief) writes to this terminal and alone writes `--results`, `--logdir` and the
checkpoints under `--checkpoint-dir` (which every worker is given: they resume from it);
another worker's output is shown if it fails. If a worker fails or the job runs past --timeout,
the others are stopped, so nothing is left waiting for a peer.
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
# Outputs one file or directory would receive from every worker: worker 0 writes them.
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
    kept, skip = [], False
    for arg in args:
        if skip:
            skip = False
        elif arg in CHIEF_ONLY_FLAGS:
            skip = True  # its value is the next argument
        elif not arg.startswith(tuple(f + "=" for f in CHIEF_ONLY_FLAGS)):
            kept.append(arg)
    return kept


def role(index):
    """What worker `index` does in the job, in a few words."""
    if index == 0:
        return "chief: its output follows; writes --results, --logdir and the checkpoints"
    return "worker: trains its slice of each mini-batch; its output is shown if it fails"


def start(worker_args, outputs, python=sys.executable, env=None, live=False):
    """Starts one worker per list of arguments in `worker_args` (worker 0's first), each
    `main.py --engine=tf2 --distribute=multi_worker ARGS` with its TF_CONFIG; returns
    their subprocess.Popen objects.

    `outputs`: per worker, the file its stdout and stderr go to (None: this process's).
    `live`: first print a line per worker (address, role).
    """
    ports = free_ports(len(worker_args))
    cluster = {"worker": [f"{HOST}:{p}" for p in ports]}
    if live:
        for index, address in enumerate(cluster["worker"]):
            print(f"worker {index} at {address}: {role(index)}", flush=True)
    procs = []
    for index, (args, output) in enumerate(zip(worker_args, outputs)):
        worker_env = dict(os.environ, **(env or {}), TF_CONFIG=json.dumps(
            {"cluster": cluster, "task": {"type": "worker", "index": index}}))
        procs.append(subprocess.Popen(
            [python, common.MAIN, "--engine=tf2", "--distribute=multi_worker", *args],
            cwd=common.ROOT, env=worker_env, stdout=output,
            stderr=None if output is None else subprocess.STDOUT, text=True))
    return procs


def launch(args, workers=2, timeout=300, python=sys.executable, env=None, live=False):
    """Runs the workers to completion; returns (exit codes, outputs), worker 0 first.

    `env` adds to (or overrides) this process's environment for every worker. `live`: first
    print a line per worker (address, role), then let worker 0 write to this process's
    stdout and stderr as it runs (its progress bar too, on a terminal); its output is then
    not captured ("").
    """
    logs = [None if live and index == 0 else tempfile.TemporaryFile(mode="w+")
            for index in range(workers)]
    procs = start([args if index == 0 else chief_only(args) for index in range(workers)],
                  logs, python=python, env=env, live=live)
    deadline = time.monotonic() + timeout
    try:
        while any(p.poll() is None for p in procs):
            failed = any(p.poll() not in (None, 0) for p in procs)
            if failed or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    finally:
        for p in procs:  # a worker whose peer is gone would wait for it forever
            if p.poll() is None:
                p.kill()
                p.wait()
    outputs = []
    for log in logs:
        if log is None:  # written as it came
            outputs.append("")
            continue
        log.seek(0)
        outputs.append(log.read())
        log.close()
    codes = [p.returncode for p in procs]
    if time.monotonic() > deadline and any(c != 0 for c in codes):
        outputs[0] += f"\nerror: the workers did not finish within {timeout} s\n"
    return codes, outputs


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
