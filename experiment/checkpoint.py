"""Checkpoints of one run: everything it needs to continue exactly where it stopped.

A run's directory holds
  * `model.ckpt-<iteration>.*`: the engine's variables (Engine.write_variables): the
    tf1 engine's Saver checkpoint of every global variable (weights, Adam's slots and
    beta powers, the global step, and the `graph`/`optimizer` strategies' accumulators),
    or the tf2 engine's tf.train.Checkpoint (weights, dropout's seed states, Adam's
    slots and iterations, the running loss totals);
  * `window-<iteration>.npz`: the open accumulation window (Engine.window_arrays), in
    the form it is kept: gradients, running sums, or buffered inputs (the `fused`
    strategy's feeds, the tf2 engine's mini-batches);
  * `state.json`: counters, the data position, the best accuracy so far, and the
    identity of the configuration; it names the two files above and is written last,
    atomically, so it only ever points at files that are complete.
A finished run's `state.json` holds its result instead, so that reps are not redone.
"""

import hashlib
import io
import json
import os
import zipfile

import numpy as np
import tensorflow as tf

from experiment import config
from experiment import results

STATE_FILE = "state.json"
CHECKPOINT_PREFIX = "model.ckpt"


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message names the file and the reason."""


class RunCheckpoint:
    """The checkpoint directory of one run (one rep)."""

    def __init__(self, directory, identity):
        """
        Args:
          directory: this run's directory (created on first save).
          identity: the settings that shape training (model, N, B, seed, strategy,
            ...); a checkpoint made with other values is refused, never mixed in.
        """
        self.directory = directory
        self.identity = dict(identity)
        self.state_path = os.path.join(directory, STATE_FILE)

    def load(self):
        """Returns the saved state, or None where this run has no checkpoint yet.

        Raises:
          CheckpointError: unreadable, of another configuration, or missing its files.
        """
        if not os.path.exists(self.state_path):
            return None
        try:
            with open(self.state_path) as f:
                state = json.load(f)
            saved_identity = state["identity"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{self.state_path}: unreadable checkpoint state ({e})") \
                from None
        self._check_identity(saved_identity)
        if not state.get("finished"):
            for name in (state.get("checkpoint", "") + ".index", state.get("window", "")):
                if not os.path.isfile(os.path.join(self.directory, name)):
                    raise CheckpointError(f"{self.state_path}: names {name}, which is missing")
        return state

    def _check_identity(self, saved):
        # A setting renamed since (--strategy is --distribute) still names the same thing.
        saved = {config.RENAMED.get(key, key): value for key, value in saved.items()}
        for key, value in self.identity.items():
            if key in saved and saved[key] != value:
                raise CheckpointError(
                    f"checkpoint {self.directory} was made with {key}={saved[key]}, this run "
                    f"has {value}; use another checkpoint directory")
        missing = sorted(set(self.identity) ^ set(saved))
        if missing:
            raise CheckpointError(f"checkpoint {self.directory} records other settings "
                                  f"({', '.join(missing)}); use another checkpoint directory")

    def save(self, engine, iteration, state):
        """Saves an interfaces.Engine's variables and window, then `state`; returns the
        state written."""
        os.makedirs(self.directory, exist_ok=True)
        prefix = f"{CHECKPOINT_PREFIX}-{iteration}"
        engine.write_variables(os.path.join(self.directory, prefix))
        window_name = f"window-{iteration}.npz"
        buffer = io.BytesIO()
        np.savez(buffer, **engine.window_arrays())
        results.atomic_write_bytes(os.path.join(self.directory, window_name),
                                   buffer.getvalue())
        full = dict(state, identity=self.identity, finished=False,
                    checkpoint=prefix, window=window_name)
        results.atomic_write_json(self.state_path, full)
        self._remove_stale(keep={prefix, window_name})
        return full

    def restore(self, engine, state):
        """Restores what `save` saved of an interfaces.Engine (variables, then window).

        Raises:
          CheckpointError: a checkpoint or window file is truncated or corrupt.
        """
        try:
            engine.read_variables(os.path.join(self.directory, state["checkpoint"]))
            with np.load(os.path.join(self.directory, state["window"])) as arrays:
                window = {key: arrays[key] for key in arrays.files}
            engine.restore_window(window, state)
        except CheckpointError:
            raise
        except (tf.errors.OpError, ValueError, OSError, EOFError, zipfile.BadZipFile) as e:
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise CheckpointError(f"checkpoint {self.directory} is corrupt ({reason}); "
                                  "delete it to start this run again") from None

    def save_finished(self, result):
        os.makedirs(self.directory, exist_ok=True)
        results.atomic_write_json(self.state_path, {"identity": self.identity,
                                                    "finished": True, "result": result})
        self._remove_stale(keep=set())

    def _remove_stale(self, keep):
        """Deletes checkpoint and window files that state.json no longer names."""
        stems = {name.split(".data")[0].split(".index")[0] for name in keep}
        for name in os.listdir(self.directory):
            stale_ckpt = name.startswith(CHECKPOINT_PREFIX + "-") and \
                name.split(".data")[0].split(".index")[0] not in stems
            stale_window = name.startswith("window-") and name not in keep
            if stale_ckpt or stale_window:
                os.remove(os.path.join(self.directory, name))


def digest_arrays(values):
    """sha256 of the arrays' bytes, in order: equal digests, equal weights (both engines).

    What a resumed run is compared by against one never interrupted.
    """
    digest = hashlib.sha256()
    for value in values:
        digest.update(np.ascontiguousarray(value).tobytes())
    return digest.hexdigest()
