"""progress.py: bars on terminals only, with the numbers a user watches; nothing otherwise."""

import io
import os
import pty
import re
import select
import subprocess
import sys
import threading

import pytest

from experiment import progress
from tests.helpers import ROOT
from tests.helpers import run_main_in_process

ELAPSED_AND_ETA = re.compile(r"\[\d\d:\d\d<\d\d:\d\d")
ALL_RUNS_ELAPSED_AND_ETA = re.compile(r"\[\d\d:\d\d<\d\d:\d\d, all runs \d\d:\d\d<\d\d:\d\d, ")
# A short "training run" in a child process, printing the post's kind of lines through the
# bar; its stderr is whatever the test gives it.
CHILD = """
from experiment import progress
with progress.RunProgress(300, 1, 1) as bar:
    log = bar.wrap(print)
    for iteration in range(1, 301):
        bar.advance(iteration, iteration // 5)
        if iteration % 100 == 0:
            bar.evaluated(90.0 + iteration / 100)
            log(f"Iteration {iteration}: accuracy {90.0 + iteration / 100}")
print("Training finished.")
"""


class TerminalStream(io.StringIO):
    """A stream that says it is a terminal, to see what the bar writes."""

    def isatty(self):
        return True


def read_all(fd):
    """Everything written so far to the pseudo-terminal whose master end is `fd`."""
    chunks = []
    while select.select([fd], [], [], 0.2)[0]:
        try:
            chunk = os.read(fd, 65536)
        except OSError:  # the other end is closed: nothing more to read
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks).decode()


def test_run_bar_on_a_pseudo_terminal_shows_run_counts_accuracy_elapsed_and_eta():
    master, slave = pty.openpty()  # reports a 0 x 0 size, as under `script -qc`
    try:
        with os.fdopen(slave, "w", closefd=False) as stream:
            with progress.RunProgress(200, 2, 3, stream=stream) as bar:
                assert bar.enabled
                for iteration in range(1, 201):
                    bar.advance(iteration, iteration // 5)
                bar.evaluated(95.25)
        text = read_all(master)
    finally:
        os.close(master)
        os.close(slave)
    last = text.replace("\r\n", "\n").split("\r")[-1]  # the bar as it was last drawn
    assert "run 2/3" in last
    assert "200/200" in last and "100%" in last
    assert "updates=40" in last and "accuracy=95.25%" in last
    assert ELAPSED_AND_ETA.search(last), last


def test_all_runs_eta_is_the_seconds_per_iteration_so_far_times_the_iterations_left():
    now = [100.0]
    clock = progress.RunsClock(3, clock=lambda: now[0])
    now[0] += 10.0  # 50 iterations of run 1 in 10 s (set-up included); 50 + 2 x 100 left
    assert clock.fields(1, 100, 50, 50) == {"all_elapsed": "00:10", "all_remaining": "00:50"}
    assert clock.fields(1, 100, 0, 0)["all_remaining"] == "?"  # nothing trained yet
    stream = TerminalStream()
    with progress.RunProgress(100, 1, 3, stream=stream, clock=clock) as bar:
        bar.advance(100, 100)
        now[0] += 10.0
    last = stream.getvalue().split("\r")[-1]
    assert "run 1/3" in last and "100/100" in last and ", all runs 00:20<00:40," in last
    # Its bar told the clock run 1 trained 100. Run 2 resumed at 40, trained 10 more in 5 s:
    # 110 iterations in 25 s, 50 + 100 left.
    now[0] += 5.0
    assert clock.fields(2, 100, 50, 10)["all_remaining"] == "00:34"


def test_accuracy_shows_a_dash_before_the_first_evaluation():
    stream = TerminalStream()
    with progress.RunProgress(10, 1, 1, stream=stream) as bar:
        bar.advance(3, 3)
    assert "3/10" in stream.getvalue() and "updates=3, accuracy=-" in stream.getvalue()


def test_nothing_is_written_when_the_stream_is_not_a_terminal():
    stream, lines = io.StringIO(), []
    with progress.RunProgress(100, 1, 2, stream=stream) as bar:
        assert not bar.enabled
        log = bar.wrap(lines.append)
        assert log == lines.append  # the caller's own function, untouched
        for iteration in range(1, 101):
            bar.advance(iteration, iteration)
        bar.evaluated(95.0)
        log("Iteration 100")
        bar.write("Training finished.", lines.append)
    with progress.Bar(4, "reproduce", stream=stream, remaining=lambda: 10.0) as overall:
        overall.update(4)
        overall.note("done")
    assert stream.getvalue() == ""
    assert lines == ["Iteration 100", "Training finished."]


@pytest.mark.parametrize("enabled", [True, False])
def test_enabled_overrides_the_terminal_check(enabled):
    stream = io.StringIO() if enabled else TerminalStream()
    with progress.Bar(3, "bench", stream=stream, enabled=enabled) as bar:
        bar.update(3)
    assert ("3/3" in stream.getvalue()) == enabled


def test_lines_are_written_with_the_bar_cleared_and_the_bar_redrawn_after():
    stream, seen = TerminalStream(), []

    def log(line):
        seen.append((line, stream.getvalue()))

    with progress.RunProgress(50, 1, 1, stream=stream) as bar:
        bar.advance(20, 4)
        bar.wrap(log)("Iteration 20: accuracy 91.5")
        after = len(stream.getvalue())
    (line, before), = seen
    assert line == "Iteration 20: accuracy 91.5"
    cleared = before.split("\r")[-2]  # tqdm clears by overwriting the bar with spaces
    assert before.endswith("\r") and cleared.strip() == "" and cleared
    assert "20/50" in stream.getvalue()[len(before):after]  # drawn again after the line


def test_overall_bar_uses_the_callers_estimate_of_the_time_left():
    stream = TerminalStream()
    with progress.Bar(5, "reproduce", stream=stream, remaining=lambda: 125.0) as bar:
        first = stream.getvalue()
        bar.update(2)
        bar.note("N=20 seed 3")
    assert "reproduce" in first and "0/5" in first and "<02:05]" in first
    last = stream.getvalue().split("\r")[-1]
    assert "2/5" in last and "<02:05, N=20 seed 3]" in last


def test_an_estimate_taking_the_callers_lock_cannot_deadlock_a_writer_holding_it(monkeypatch):
    monkeypatch.setattr(progress, "REFRESH_SECONDS", 0.001)  # redraw as often as possible
    lock, finished = threading.Lock(), threading.Event()

    def remaining():
        with lock:
            return 60.0

    def tool():  # as reproduce logs a finished run and counts it under its own lock
        with progress.Bar(300, "reproduce", stream=TerminalStream(), remaining=remaining) as bar:
            for i in range(300):
                with lock:
                    bar.write(f"run {i} finished", lambda line: None)
                    bar.update()
        finished.set()

    threading.Thread(target=tool, daemon=True).start()
    assert finished.wait(20), "deadlock between the caller's lock and the bar's"


def test_overall_bar_without_an_estimate_uses_its_rate():
    stream = TerminalStream()
    with progress.Bar(3, "bench", stream=stream, unit="measurement") as bar:
        bar.update(3)
    last = stream.getvalue().split("\r")[-1]
    assert "bench" in last and "3/3" in last and "measurement/s" in last
    assert ELAPSED_AND_ETA.search(last), last


def _child(stderr):
    return subprocess.run([sys.executable, "-c", CHILD], cwd=ROOT, stdout=subprocess.PIPE,
                          stderr=stderr, timeout=60, check=True).stdout


def test_stdout_is_byte_identical_with_and_without_a_terminal_on_stderr():
    piped = subprocess.run([sys.executable, "-c", CHILD], cwd=ROOT, capture_output=True,
                           timeout=60, check=True)
    assert piped.stderr == b""
    assert b"\r" not in piped.stdout
    master, slave = pty.openpty()
    try:
        with_terminal = _child(slave)
        bar = read_all(master)
    finally:
        os.close(master)
        os.close(slave)
    assert with_terminal == piped.stdout
    assert piped.stdout.decode().splitlines() == [
        "Iteration 100: accuracy 91.0", "Iteration 200: accuracy 92.0",
        "Iteration 300: accuracy 93.0", "Training finished."]
    assert "run 1/1" in bar and "300/300" in bar and "accuracy=93.00%" in bar


def test_output_inside_paused_finds_the_bar_cleared():
    stream, seen = TerminalStream(), []
    with progress.Bar(4, "bench", stream=stream) as bar:
        bar.update(1)
        with bar.paused():
            seen.append(stream.getvalue())
        redrawn = stream.getvalue()[len(seen[0]):]
    assert seen[0].endswith("\r") and seen[0].split("\r")[-2].strip() == ""
    assert "1/4" in redrawn
    piped = io.StringIO()
    with progress.Bar(4, "bench", stream=piped) as quiet, quiet.paused():
        print("a line", file=piped)
    assert piped.getvalue() == "a line\n"


def test_prints_inside_printing_through_find_the_bar_cleared(monkeypatch):
    stream = TerminalStream()  # the bar and stdout share a terminal, as on a console
    monkeypatch.setattr(sys, "stdout", stream)
    with progress.Bar(2, "bench", stream=stream) as bar:
        with bar.printing_through():
            print("Speed at N=5 x B=20", flush=True)
            print("no newline", end="")
        bar.update(2)
    text = stream.getvalue()
    before, after = text.split("Speed at N=5 x B=20\n")
    assert before.endswith("\r") and before.split("\r")[-2].strip() == ""  # cleared
    assert "0/2" in after.split("no newline")[0]  # redrawn between the lines
    piped = io.StringIO()
    monkeypatch.setattr(sys, "stdout", piped)
    with progress.Bar(2, "bench", stream=piped) as quiet, quiet.printing_through():
        assert sys.stdout is piped  # no bar: stdout left alone
        print("a line")
    assert piped.getvalue() == "a line\n"


# main.py in this process (no TensorFlow start-up): 40 mini-batches, an evaluation every 20.
MAIN_ARGS = ("--iterations=40", "--batch-size=10", "--eval-every=20", "--verbose")


def _main_output(monkeypatch, capsys, stderr, data_dir):
    """main.py's stdout, with `stderr` as sys.stderr while it runs."""
    monkeypatch.setattr(sys, "stderr", stderr)
    run_main_in_process(*MAIN_ARGS, f"--data-dir={data_dir}")
    monkeypatch.undo()
    return capsys.readouterr().out


def test_main_shows_a_bar_on_a_terminal_and_its_lines_are_those_of_a_pipe(
        monkeypatch, capsys, mnist_quick_dir):
    master, slave = pty.openpty()
    try:
        with os.fdopen(slave, "w", closefd=False) as terminal:
            with_terminal = _main_output(monkeypatch, capsys, terminal, mnist_quick_dir)
        bar = read_all(master)
    finally:
        os.close(master)
        os.close(slave)
    last = bar.replace("\r\n", "\n").split("\r")[-1]
    assert "run 1/1" in last and "40/40" in last and "updates=40, accuracy=" in last
    assert ELAPSED_AND_ETA.search(bar), bar

    piped = io.StringIO()
    assert _main_output(monkeypatch, capsys, piped, mnist_quick_dir) == with_terminal
    assert piped.getvalue() == ""  # not a terminal: nothing at all, no carriage return
    assert "\r" not in with_terminal
    assert [line.split(":")[0] for line in with_terminal.splitlines()] == [
        "Iteration 20", "Iteration 40", "Training finished. Best accuracy",
        "mean accuracy (1 runs)"]
    assert "all runs" not in bar  # one run: its own ETA is the whole


def test_main_with_two_runs_shows_the_eta_of_all_runs_beside_each_runs_own(
        monkeypatch, capsys, mnist_quick_dir):
    master, slave = pty.openpty()
    try:
        with os.fdopen(slave, "w", closefd=False) as terminal:
            monkeypatch.setattr(sys, "stderr", terminal)
            run_main_in_process("--iterations=5", "--batch-size=10", "--eval-every=0",
                                "--reps=2", f"--data-dir={mnist_quick_dir}")
            monkeypatch.undo()
        bar = read_all(master)
    finally:
        os.close(master)
        os.close(slave)
    assert "mean accuracy (2 runs)" in capsys.readouterr().out
    # Each run's bar as it was last drawn (each is left on its own line).
    drawn = [line.split("\r")[-1] for line in bar.replace("\r\n", "\n").split("\n") if line]
    first, second = [line for line in drawn if line.startswith(("run 1/2", "run 2/2"))]
    assert "run 1/2" in first and "5/5" in first and "run 2/2" in second
    assert ALL_RUNS_ELAPSED_AND_ETA.search(first), first
    assert re.search(r", all runs \d\d:\d\d<00:00, ", second), second  # all done
