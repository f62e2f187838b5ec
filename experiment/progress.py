"""Live progress on a terminal: a bar per training run, and an overall bar for the tools.

A bar is drawn only when its stream (stderr by default) is a terminal. Otherwise nothing is
created and nothing is written, not even a carriage return, so logs and pipes stay byte for
byte as they were. Lines printed while a bar is shown must go through `write` (or a log
function made by `wrap`, or any output inside `paused()`): the bar is cleared first and
redrawn after, so the terminal is not garbled, and the line itself is written unchanged by
the caller's own log function.

The callers never see tqdm: the run loop drives a `RunProgress` (and, for several runs, a
`RunsClock` they share), the tools a `Bar`.
"""

import contextlib
import os
import sys
import threading
import time

import tqdm

# Seconds between redraws caused by progress: cheap even at one call per mini-batch.
MININTERVAL = 0.5
# A bar is also redrawn this often while nothing advances, so that its elapsed time and ETA
# keep moving through a long evaluation or a long run of a tool.
REFRESH_SECONDS = 1.0
# The size of a terminal that reports none (0 x 0: the pseudo-terminal of `script -qc` run
# without a terminal of its own), where tqdm would trim the bar to nothing and hide it.
FALLBACK_COLUMNS, FALLBACK_ROWS = 100, 24
# Without tqdm's rate and unit: used when the caller supplies its own estimate of the time left.
FORMAT_WITH_REMAINING = "{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} " \
                        "[{elapsed}<{remaining}{postfix}]"
# A run's bar with the elapsed time and ETA of all the runs beside the run's own, and before
# the postfix (a narrow terminal cuts the line's end): `run 1/10:  36%|##   | 364/1000
# [00:20<00:36, all runs 00:21<07:12, updates=364, accuracy=94.10%]` (no rate: no room).
FORMAT_WITH_ALL_RUNS = "{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} " \
                       "[{elapsed}<{remaining}, all runs {all_elapsed}<{all_remaining}{postfix}]"


def terminal_size(stream):
    """(columns, rows) of the terminal `stream` writes to, with fallbacks for unknown ones."""
    try:
        columns, rows = os.get_terminal_size(stream.fileno())
    except (AttributeError, ValueError, OSError):
        columns, rows = 0, 0
    # tqdm leaves the last column free: writing there wraps the line on some terminals.
    return (columns - 1 if columns > 0 else FALLBACK_COLUMNS,
            rows if rows > 0 else FALLBACK_ROWS)


def is_terminal(stream):
    """Whether `stream` is a terminal; a closed or file-less stream is not."""
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


class _Tqdm(tqdm.tqdm):
    """tqdm whose ETA can come from the caller (`seconds_left`, when not None) and whose
    line can carry more fields (`extra_fields`: a function of the bar giving a dict, read
    at every draw, for its bar_format)."""

    monitor_interval = 0  # no monitor thread: our own ticker redraws

    def __init__(self, *args, seconds_left=None, extra_fields=None, **kwargs):
        # Both before tqdm's first draw, which reads them.
        self.seconds_left, self.extra_fields = seconds_left, extra_fields
        super().__init__(*args, **kwargs)

    @property
    def format_dict(self):
        values = super().format_dict
        if self.seconds_left is not None and self.total:
            # tqdm derives the time left as (total - n) / rate: give it the rate that makes
            # that the caller's estimate (and 0 once everything is done).
            values["rate"] = max(self.total - self.n, 1e-9) / max(self.seconds_left, 1e-9)
        if self.extra_fields:
            values.update(self.extra_fields(self))
        return values


class _Progress:
    """One bar on `stream`, or nothing at all when `stream` is not a terminal."""

    def __init__(self, total, description, stream=None, enabled=None, unit="it", initial=0,
                 remaining=None, bar_format=None, extra_fields=None):
        stream = sys.stderr if stream is None else stream
        self.enabled = is_terminal(stream) if enabled is None else enabled
        self._stream = stream
        self._bar = None
        if not self.enabled:
            return
        # A fixed size: tqdm's own probe takes a 0 x 0 terminal for one of -1 x -1.
        columns, rows = terminal_size(stream)
        self._bar = _Tqdm(total=total, desc=description, file=stream, unit=unit,
                          initial=initial, mininterval=MININTERVAL, smoothing=0,
                          ncols=columns, nrows=rows, leave=True,
                          bar_format=bar_format or (FORMAT_WITH_REMAINING if remaining else None),
                          seconds_left=remaining() if remaining else None,
                          extra_fields=extra_fields)
        self._remaining = remaining
        self._stop = threading.Event()
        self._ticker = threading.Thread(target=self._tick, name="progress", daemon=True)
        self._ticker.start()

    def _tick(self):
        while not self._stop.wait(REFRESH_SECONDS):
            self._estimate()
            self._bar.refresh()

    def _estimate(self):
        """Asks the caller for the time left, from the ticker only, outside tqdm's lock: the
        caller's estimate may take a lock of its own, which a thread writing through this
        bar or updating it may hold (while waiting for tqdm's lock, or not re-entrantly)."""
        if self._remaining:
            self._bar.seconds_left = self._remaining()

    @contextlib.contextmanager
    def paused(self):
        """A block whose output (prints, logging.warning) finds the bar cleared; the bar is
        redrawn after it."""
        if self._bar is None:
            yield
            return
        with tqdm.tqdm.external_write_mode(file=self._stream):
            yield
            # What the block wrote must reach the terminal before the bar is redrawn.
            sys.stdout.flush()
            sys.stderr.flush()

    def write(self, line, log=print):
        """Writes `line` with `log` (print by default) with the bar cleared around it."""
        with self.paused():
            log(line)

    def wrap(self, log=print):
        """A log function like `log` that clears the bar around each line; `log` itself,
        unchanged, when there is no bar."""
        if self._bar is None:
            return log
        return lambda line: self.write(line, log)

    @contextlib.contextmanager
    def printing_through(self):
        """A block whose prints to sys.stdout go through `write`, a line at a time: for code
        that prints on its own (and so cannot be given a log function). Without a bar,
        sys.stdout is left alone."""
        if self._bar is None:
            yield
            return
        writer = _LineWriter(self, sys.stdout)
        try:
            with contextlib.redirect_stdout(writer):
                yield
        finally:
            writer.finish()

    def close(self):
        """Draws the bar a last time and leaves it on its line; idempotent."""
        if self._bar is None:
            return
        self._stop.set()
        self._ticker.join()
        self._bar.close()
        self._bar = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


class _LineWriter:
    """A text stream that hands each complete line to a bar's `write`, for `stream`."""

    def __init__(self, bar, stream):
        self._bar, self._stream, self._pending = bar, stream, ""

    def write(self, text):
        self._pending += text
        *lines, self._pending = self._pending.split("\n")
        for line in lines:
            self._bar.write(line, lambda text: self._stream.write(text + "\n"))
        return len(text)

    def flush(self):
        self._stream.flush()

    def finish(self):
        """Writes what is left of an unfinished last line."""
        if self._pending:
            self._bar.write(self._pending, lambda text: self._stream.write(text))
            self._pending = ""


class RunsClock:
    """The time of all the runs of one command (its reps), shared by their bars, for an ETA
    over all of them: the seconds per iteration so far (training, evaluations and each
    run's set-up, all since the clock started) times the iterations left in all runs."""

    def __init__(self, runs, clock=time.monotonic):
        """
        Args:
          runs: how many runs there are in all (each of the same iterations).
          clock: seconds from a fixed point (a test passes its own).
        """
        self.runs, self._clock = runs, clock
        self._start = clock()
        self._trained = 0  # iterations trained by the bars already closed

    def fields(self, run_index, total, n, trained):
        """The bar's all-runs fields while run `run_index` (from 1) of `total` iterations is
        at iteration `n`, having trained `trained` of them under this clock."""
        elapsed = self._clock() - self._start
        done = self._trained + trained
        left = (total - n) + (self.runs - run_index) * total
        remaining = elapsed / done * left if done else None
        return {"all_elapsed": tqdm.tqdm.format_interval(elapsed),
                "all_remaining": "?" if remaining is None
                else tqdm.tqdm.format_interval(remaining)}

    def run_closed(self, trained):
        """A run's bar closed after training `trained` iterations."""
        self._trained += trained


class RunProgress(_Progress):
    """The bar of one training run: `run r/R`, iteration / total, updates applied, the last
    evaluated accuracy, elapsed time and ETA (from the run's average iteration rate), and,
    given a RunsClock, the elapsed time and ETA of all the runs."""

    def __init__(self, total, run_index, runs, stream=None, enabled=None, initial=0,
                 clock=None):
        """
        Args:
          total: the run's iterations (mini-batches).
          run_index: this run's number, counted from 1.
          runs: how many runs there are in all.
          stream: where the bar goes (default: sys.stderr at the time of the call).
          enabled: draw the bar; default: whether `stream` is a terminal.
          initial: the iteration a resumed run starts from (its ETA counts only new ones).
          clock: the RunsClock of all the runs, or None: then the bar shows this run only.
        """
        self._clock, self._initial = clock, initial

        def all_runs(bar):
            return clock.fields(run_index, bar.total, bar.n, bar.n - initial)

        super().__init__(total, f"run {run_index}/{runs}", stream, enabled, initial=initial,
                         bar_format=FORMAT_WITH_ALL_RUNS if clock else None,
                         extra_fields=all_runs if clock else None)
        self._updates, self._accuracy = None, None

    def advance(self, iteration, updates):
        """The run has done `iteration` mini-batches and applied `updates` updates."""
        if self._bar is None:
            return
        if updates != self._updates:
            self._updates = updates
            self._bar.set_postfix_str(self._postfix(), refresh=False)
        self._bar.update(iteration - self._bar.n)

    def evaluated(self, accuracy):
        """The test accuracy (percent) of the evaluation just made."""
        if self._bar is None:
            return
        self._accuracy = accuracy
        self._bar.set_postfix_str(self._postfix(), refresh=False)

    def _postfix(self):
        accuracy = "-" if self._accuracy is None else f"{self._accuracy:.2f}%"
        return f"updates={self._updates or 0}, accuracy={accuracy}"

    def close(self):
        """Draws the bar a last time, leaves it on its line and tells the RunsClock what
        this run trained; idempotent."""
        trained = None if self._bar is None else self._bar.n - self._initial
        super().close()  # its last draw still counts this run's iterations as the current run's
        if trained is not None and self._clock is not None:
            self._clock.run_closed(trained)


class Bar(_Progress):
    """An overall bar of a tool: items done / total with elapsed time and ETA."""

    def __init__(self, total, description, stream=None, enabled=None, unit="it",
                 remaining=None):
        """
        Args:
          total: how many items (runs, measurements) there are to do.
          description: what is being done, shown before the bar.
          stream: where the bar goes (default: sys.stderr at the time of the call).
          enabled: draw the bar; default: whether `stream` is a terminal.
          unit: the items' name in the rate (items/s), when tqdm estimates the ETA.
          remaining: optional function giving the seconds left, for items of unequal length
            (tqdm's ETA assumes equal ones); the bar then shows no rate. It is called here,
            then once every REFRESH_SECONDS from the bar's own thread (never from `update`,
            `note` or `write`, so the caller may hold its own lock around those).
        """
        super().__init__(total, description, stream, enabled, unit=unit, remaining=remaining)

    def update(self, n=1):
        """`n` more items are done."""
        if self._bar is not None:
            self._bar.update(n)

    def note(self, text):
        """A short status shown after the counts (e.g. the item now running)."""
        if self._bar is not None:
            self._bar.set_postfix_str(text, refresh=False)
