"""Checkpoints of one run: everything it needs to continue exactly where it stopped.

A run's directory holds
  * `model.ckpt-<iteration>.*`: the engine's variables (Engine.write_variables): the
    tf1 engine's Saver checkpoint of every global variable (weights, Adam's slots and
    beta powers, the global step, and the `graph`/`optimizer` averagers' accumulators),
    or the tf2 engine's tf.train.Checkpoint (weights, dropout's seed states, Adam's
    slots and iterations, the running loss totals);
  * `window-<iteration>.npz`: the open accumulation window (Engine.window_state), in
    the form it is kept: gradients, running sums, or buffered inputs (the `fused`
    averager's feeds, the tf2 engine's mini-batches);
  * `state.json`: counters, the data position, the best accuracy so far, and the
    identity of the configuration; it names the two files above and is written last,
    atomically, so it only ever points at files that are complete.
A finished run's `state.json` holds its result instead, so that reps are not redone.

A save that fails (a full disk, a lost permission) raises results.WriteError and leaves
the checkpoint in force as it was; what it wrote is removed, and so is whatever a failed
or interrupted save left (partial files, tf2's `model.ckpt-<i>_temp/` directories, the
`.tmp-*` files of atomic writes) when the run is loaded again: nothing in the directory
but what `state.json` names survives, so the next save never trips over it. That clean-up
assumes one run per directory, which main.py's lock (runlock.py) ensures.

Under --distribute=multi_worker the chief (worker 0) alone writes and cleans the
directory; every other worker reads the chief's checkpoint to resume (so the directory
must be one every worker reads: a file system they share, on several machines) and, at
each save, writes its own part (the variables, as TensorFlow's multi-worker checkpointing
has every worker write) to a directory of its own, removed once written.
"""

import hashlib
import io
import json
import os
import re
import shutil
import zipfile

import numpy as np
import tensorflow as tf

from experiment import config
from experiment import faults
from experiment import results

STATE_FILE = "state.json"
CHECKPOINT_PREFIX = "model.ckpt"
# Names a save writes, or leaves when it fails, beside state.json: anything of these that
# state.json does not name is a previous checkpoint or the debris of a failed save.
SAVED_NAMES = (CHECKPOINT_PREFIX + "-", "window-", ".tmp-")


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message names the file and the reason."""


class RunCheckpoint:
    """The checkpoint directory of one run (one rep)."""

    def __init__(self, directory, identity, own_part=None):
        """
        Args:
          directory: this run's directory (created on first save).
          identity: the settings that shape training (model, N, B, seed, averager,
            ...); a checkpoint made with other values is refused, never mixed in.
          own_part: a multi_worker worker other than the chief: it reads `directory` and
            writes nothing there; each save writes its variables under `own_part`, then
            removes it.
        """
        self.directory = directory
        self.identity = dict(identity)
        self.state_path = os.path.join(directory, STATE_FILE)
        self.own_part = own_part
        self.in_force = None  # the state that state.json holds: loaded, or last saved

    def load(self):
        """Returns the saved state, or None where this run has no checkpoint yet; removes
        what state.json does not name (a usable checkpoint only).

        Raises:
          CheckpointError: unreadable, of another configuration, or missing its files.
        """
        state = self.read()
        if state is not None:
            self.in_force = state
        self._remove_stale()
        return state

    def read(self):
        """The saved state, checked as `load` checks it, or None; changes nothing.

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
            raise CheckpointError(f"{self.state_path}: unreadable checkpoint state ({e}); "
                                  f"{self._move_aside()}") from None
        self._check_identity(saved_identity)
        if not state.get("finished"):
            for name in (state.get("checkpoint", "") + ".index", state.get("window", "")):
                if not os.path.isfile(os.path.join(self.directory, name)):
                    raise CheckpointError(f"{self.state_path}: names {name}, which is "
                                          f"missing; {self._move_aside()}")
        return state

    def _move_aside(self):
        """The advice for a checkpoint that cannot be used: keep it, out of the way."""
        return (f"move {self.directory} aside (keep it until you know why) to start this "
                "run over")

    def in_force_line(self):
        """Which checkpoint the same command would resume from, for a failure's message
        (a worker other than the chief reads it from the chief's state.json)."""
        in_force = self.in_force
        if self.own_part:
            try:
                with open(self.state_path) as f:
                    in_force = json.load(f)
            except (OSError, ValueError):
                pass
        if in_force and not in_force.get("finished"):
            return (f"the checkpoint in force is "
                    f"{os.path.join(self.directory, in_force['checkpoint'])} (iteration "
                    f"{in_force['iteration']}): the same command resumes from it")
        return "no checkpoint of this run is in force yet: the same command starts it over"

    def _check_identity(self, saved):
        # A setting renamed since (--strategy is --distribute) still names the same thing.
        saved = {config.RENAMED.get(key, key): value for key, value in saved.items()}
        for key, value in self.identity.items():
            if key == "workers" and key in saved and saved[key] != value:
                raise CheckpointError(
                    f"checkpoint {self.directory} was made by {saved[key]} workers, this job "
                    f"has {value}: a multi_worker run resumes with as many workers as made "
                    f"its checkpoint (how each mini-batch is split shapes its bits); start "
                    f"{saved[key]}, or use another checkpoint directory")
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
        state in force.

        A save at the iteration of the checkpoint in force writes nothing: that checkpoint
        holds this very state (a periodic save and a stop's at one iteration), and writing
        over the files state.json names could damage it.

        Raises:
          results.WriteError: a file could not be written; the checkpoint in force is
            unchanged, this save's files are removed, and the message names both.
        """
        prefix = f"{CHECKPOINT_PREFIX}-{iteration}"
        if self.in_force and self.in_force.get("checkpoint") == prefix:
            return self.in_force
        path = os.path.join(self.directory, prefix)
        window_name = f"window-{iteration}.npz"
        if self.own_part:
            self._write_own_part(engine, prefix)
            self.in_force = dict(state, identity=self.identity, finished=False,
                                 checkpoint=prefix, window=window_name)
            return self.in_force
        try:
            os.makedirs(self.directory, exist_ok=True)
            faults.check(path)
            engine.write_variables(path)
            buffer = io.BytesIO()
            np.savez(buffer, **engine.window_state())
            results.atomic_write_bytes(os.path.join(self.directory, window_name),
                                       buffer.getvalue())
            full = dict(state, identity=self.identity, finished=False,
                        checkpoint=prefix, window=window_name)
            results.atomic_write_json(self.state_path, full)
        # ValueError: a tf1 Saver's "Parent directory of ... doesn't exist".
        except (OSError, tf.errors.OpError, ValueError) as e:
            self._remove_stale()
            raise results.WriteError(f"cannot write the checkpoint {path} "
                                     f"({results.cause(e)}); {self.in_force_line()}") from None
        self.in_force = full
        self._remove_stale()
        return full

    def _write_own_part(self, engine, prefix):
        """A worker's part of a save: its variables, under own_part, then removed.

        Raises:
          results.WriteError: they could not be written.
        """
        path = os.path.join(self.own_part, prefix)
        try:
            engine.write_variables(path)
        except (OSError, tf.errors.OpError, ValueError) as e:
            raise results.WriteError(f"cannot write this worker's part of the checkpoint "
                                     f"{path} ({results.cause(e)}); "
                                     f"{self.in_force_line()}") from None
        finally:
            shutil.rmtree(self.own_part, ignore_errors=True)

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
        except CheckpointError as e:  # the engine's own message names the file
            raise CheckpointError(f"{e}; {self._move_aside()}") from None
        except (tf.errors.OpError, ValueError, OSError, EOFError, zipfile.BadZipFile) as e:
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise CheckpointError(f"checkpoint {self.directory} is corrupt ({reason}); "
                                  f"{self._move_aside()}") from None

    def save_finished(self, result):
        """Replaces the checkpoint by the run's result.

        Raises:
          results.WriteError: state.json could not be written; the checkpoint in force is
            unchanged.
        """
        finished = {"identity": self.identity, "finished": True, "result": result}
        if self.own_part:  # the chief writes it
            self.in_force = finished
            return
        try:
            os.makedirs(self.directory, exist_ok=True)
            results.atomic_write_json(self.state_path, finished)
        except OSError as e:
            raise results.WriteError(f"the run finished, but {self.state_path} cannot be "
                                     f"written ({results.cause(e)}); "
                                     f"{self.in_force_line()}") from None
        self.in_force = finished
        self._remove_stale()

    def _remove_stale(self):
        """Removes what state.json does not name: the previous checkpoint's files, and what
        failed or interrupted saves left (partial files, tf2's `<prefix>_temp/`
        directories, `.tmp-*` files). Best effort: what cannot be removed now is removed
        by a later save or load. A worker other than the chief removes only its own part
        (left by a save it was killed in)."""
        if self.own_part:
            shutil.rmtree(self.own_part, ignore_errors=True)
            return
        if self.in_force is None and os.path.exists(self.state_path):
            return  # never loaded: what it names is unknown, so nothing is stale
        state = self.in_force or {}
        prefix, window = state.get("checkpoint"), state.get("window")  # none once finished
        named = prefix and re.compile(re.escape(prefix) + r"\.(index|data-\d+-of-\d+)")
        try:
            names = os.listdir(self.directory)
        except OSError:
            return
        for name in names:
            if not name.startswith(SAVED_NAMES) or name == window or (
                    named and named.fullmatch(name)):
                continue
            path = os.path.join(self.directory, name)
            try:
                if os.path.isdir(path) and not os.path.islink(path):
                    shutil.rmtree(path)
                else:
                    os.remove(path)
            except OSError:
                pass


def holds_checkpoints(directory):
    """Whether `directory` (a --checkpoint-dir) holds a checkpoint of any of its runs."""
    names = os.listdir(directory) if os.path.isdir(directory) else ()
    return any(os.path.isfile(os.path.join(directory, name, STATE_FILE)) for name in names)


def digest_arrays(values):
    """sha256 of the arrays' bytes, in order: equal digests, equal weights (both engines).

    What a resumed run is compared by against one never interrupted.
    """
    digest = hashlib.sha256()
    for value in values:
        digest.update(np.ascontiguousarray(value).tobytes())
    return digest.hexdigest()
