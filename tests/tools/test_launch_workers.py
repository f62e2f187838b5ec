"""tools/launch_workers.py without TensorFlow: `echo` stands in for python, so each "worker"
prints the command line it was given and exits (the real job is in test_tf2.py)."""

import re

from tools import launch_workers


def test_live_launch_names_each_worker_then_lets_worker_0_write_as_it_runs(capfd):
    codes, outputs = launch_workers.launch(["--reps=1", "--results=r.json"], workers=3,
                                           timeout=30, python="echo", live=True)
    assert codes == [0, 0, 0]
    printed = capfd.readouterr().out.splitlines()
    assert [re.sub(r":\d+:", ":PORT:", line) for line in printed[:3]] == [
        f"worker {i} at 127.0.0.1:PORT: {launch_workers.role(i)}" for i in range(3)]
    ports = {line.split(":")[1] for line in printed[:3]}
    assert len(ports) == 3  # each worker its own address
    # Worker 0 wrote to this process's stdout itself (so its bar can reach a terminal); the
    # others were captured, without the outputs only worker 0 writes.
    assert "--engine=tf2" in printed[3] and printed[3].endswith("--reps=1 --results=r.json")
    assert outputs[0] == ""
    assert all(out.strip().endswith("multi_worker --reps=1") for out in outputs[1:])


def test_quiet_launch_captures_every_worker(capfd):
    codes, outputs = launch_workers.launch(["--reps=1"], workers=2, timeout=30, python="echo")
    assert codes == [0, 0] and capfd.readouterr().out == ""
    assert all("--reps=1" in out for out in outputs)
