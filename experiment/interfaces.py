"""The contracts between the run loop and its engines.

Each member has one line on what it must do; a third engine is checked against these,
not reverse-engineered from the two that exist. What happened to a window is one type,
trainer.Outcome, from an averager's `step` up to the loop; the averagers' own contract
(--accumulate) is trainer.Averager.
"""

import typing

from trainer import Outcome


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
        """Trains a trailing partial window, weighted as the averager weights it."""

    def window_size(self) -> int:
        """Mini-batches in the open window."""

    def loss_totals(self) -> tuple[float, int]:
        """(sum of the finite per-sample training losses, their samples), running."""

    def evaluate(self, split, chunk) -> float:
        """Accuracy on the whole split (data.Split), in percent, `chunk` images per call
        (device_memory.evaluation_chunk)."""

    def out_of_memory(self) -> tuple[int, ...]:
        """The mini-batch sizes that ran out of memory and were trained again at half."""

    def weights_sha256(self) -> str:
        """checkpoint.digest_arrays of the trainable weights, in a fixed order."""

    def write_variables(self, path) -> None:
        """Writes every variable a resumed run needs to the files `path`.*."""

    def read_variables(self, path) -> None:
        """Restores what write_variables wrote (CheckpointError, or TensorFlow's)."""

    def window_state(self) -> dict[str, typing.Any]:
        """The open window as named numpy arrays (beside the variables)."""

    def restore_window(self, arrays, state) -> None:
        """Reopens the saved window; `state`: the loop's saved state (open_window,
        loss_totals)."""


class EngineModule(typing.Protocol):
    """An engine's module (config.ENGINES): its Engine class and two functions."""

    Engine: type

    def prepare(self, config) -> None:
        """Process-wide set-up before TensorFlow's runtime starts (ValueError: cannot)."""

    def identity(self, config) -> dict:
        """Settings a checkpoint must share beyond config.IDENTITY_FIELDS."""
