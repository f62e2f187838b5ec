"""The contracts between the run loop, its engines and the accumulation strategies.

Each member has one line on what it must do; a third engine or a sixth strategy is
checked against these, not reverse-engineered from the two that exist. What happened to
a window is one type, `Outcome`, from a strategy's `step` up to the loop.
"""

import dataclasses
import enum
import typing

from averaging_optimizer import check_average_gradients


class Outcome(enum.Enum):
    """What a `step` or `flush` did to the window of mini-batches."""
    NONE = "none"  # no window closed: it is still open (or there was none to flush)
    APPLIED = "applied"  # a window closed and its mean was applied: one update
    DISCARDED = "discarded"  # a window closed holding a NaN or Inf and was dropped whole

    @classmethod
    def closed(cls, finite):
        """The outcome of a window that closed, finite or not."""
        return cls.APPLIED if finite else cls.DISCARDED


@dataclasses.dataclass
class WindowCounts:
    """Closed windows, counted from their outcomes: the one place they are counted."""
    updates: int = 0  # windows applied
    skipped_windows: int = 0  # windows discarded

    def count(self, outcome):
        """Counts `outcome` (NONE counts nothing) and returns it."""
        self.updates += outcome is Outcome.APPLIED
        self.skipped_windows += outcome is Outcome.DISCARDED
        return outcome


class Averager:
    """The strategy protocol (--accumulate): where a TF1 window lives until its mean is
    applied. trainer.GradientAverager is the reference; strategies.py holds the others;
    registry.STRATEGIES names each. strategies.make_averager builds one in the default
    graph as cls(loss, optimizer, num_batches, var_list, global_step, check_finite), or,
    where BUILDS_FROM_LOSS_FN, as cls(loss_fn, inputs, optimizer, num_batches, ...).

    This base class checks N and counts the windows a subclass closes (`_closed`).
    """

    BUILDS_FROM_LOSS_FN = False  # True: builds its model again per micro-batch (fused)

    def __init__(self, num_batches):
        self.num_batches = check_average_gradients(num_batches)
        self.counts = WindowCounts()  # since this averager was built

    @property
    def updates(self):
        """Updates applied so far."""
        return self.counts.updates

    @property
    def skipped_windows(self):
        """Windows discarded for a NaN or Inf so far (check_finite)."""
        return self.counts.skipped_windows

    def _closed(self, finite):
        """The Outcome of a window that just closed, counted."""
        return self.counts.count(Outcome.closed(finite))

    def step(self, sess, feed_dict):
        """Trains one mini-batch: (the losses that became known, list; Outcome)."""
        raise NotImplementedError

    def flush(self, sess):
        """Closes a trailing partial window: (losses, Outcome); NONE where none is open."""
        raise NotImplementedError

    def window_size(self):
        """Mini-batches in the open window."""
        raise NotImplementedError

    def window_state(self):
        """The open window as named numpy arrays, for a checkpoint."""
        raise NotImplementedError

    def restore_window(self, sess, state):
        """Reopens the window `window_state` saved, its graph's variables restored."""
        raise NotImplementedError


class Engine(typing.Protocol):
    """One run's training as loop.py drives it: engine_tf1.Engine, engine_tf2.Engine.

    Built as Engine(config, seed): initialized, ready to step. The loop owns the data
    stream, the counters, the cadence and the checkpoint files; an engine trains.
    """

    def summary(self) -> typing.Optional[str]:
        """A line for the verbose log about how it trains, or None."""

    def close(self) -> None:
        """Releases what it holds (a session)."""

    def step(self, images, labels, iteration) -> Outcome:
        """Trains mini-batch number `iteration` (from 1); says what its window did."""

    def flush(self) -> Outcome:
        """Trains a trailing partial window, weighted as the strategy weights it."""

    def window_size(self) -> int:
        """Mini-batches in the open window."""

    def loss_totals(self) -> typing.Tuple[float, int]:
        """(sum of the finite per-sample training losses, their samples), running."""

    def evaluate(self, split) -> float:
        """Accuracy on the whole split (data.Split), in percent."""

    def weights_sha256(self) -> str:
        """checkpoint.digest_arrays of the trainable weights, in a fixed order."""

    def write_variables(self, path) -> None:
        """Writes every variable a resumed run needs to the files `path`.*."""

    def read_variables(self, path) -> None:
        """Restores what write_variables wrote (CheckpointError, or TensorFlow's)."""

    def window_arrays(self) -> typing.Dict[str, typing.Any]:
        """The open window as named numpy arrays (beside the variables)."""

    def restore_window(self, arrays, state) -> None:
        """Reopens the saved window; `state`: the loop's saved state (open_window,
        loss_totals)."""


class EngineModule(typing.Protocol):
    """An engine's module (registry.ENGINES): its Engine class and two functions."""

    Engine: type

    def prepare(self, config) -> None:
        """Process-wide set-up before TensorFlow's runtime starts (ValueError: cannot)."""

    def identity(self, config) -> dict:
        """Settings a checkpoint must share beyond settings.IDENTITY_FIELDS."""
