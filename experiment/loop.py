"""The run loop: one training run of either engine, and the reps of a configuration.

Engine-neutral: the evaluation cadence, the counters, the best accuracy, checkpoints and
resume, the verdicts on non-finite windows, what goes into TensorBoard events (written by
events.py) and the result record live here once; an engine (engine_tf1.py, engine_tf2.py)
only trains, evaluates, and saves its variables. It takes plain values (config.Config,
config.Runs), never the command-line flags, so that a test or a script can run it
directly.

The engine's contract is interfaces.Engine (and interfaces.EngineModule for its module);
config.ENGINES names the engines and loads one on use.
"""

import contextlib
import dataclasses
import logging
import os
import time

import numpy as np
import tensorflow as tf

from experiment import checkpoint
from experiment import config as config_lib
from experiment import data
from experiment import device_memory
from experiment import events
from experiment import progress
from experiment import results
from experiment import workers
from experiment.config import IDENTITY_FIELDS
from experiment.config import Runs
from experiment.config import evaluation_due
from gradient_averaging import micro_batch
from trainer import Outcome
from trainer import WindowCounts

CHECKPOINT_EVERY = Runs().checkpoint_every  # updates
# The warning for a skipped window: (where, windows skipped so far).
SKIPPED_WINDOW = "non-finite loss or gradient in %s: the window was skipped, not applied " \
                   "(%d so far)"


class Stopped(Exception):
    """Training stopped before the end; the message says where and what was kept."""


class WorkerLost(Stopped):
    """A multi_worker worker died, cannot be reached, or did not answer a collective
    within --worker-timeout; the message names it and the checkpoint in force."""


class WorkersDiffer(checkpoint.CheckpointError):
    """The workers of a multi_worker job were not given the same settings, data or
    checkpoint; the message names what differs."""


def engine_module(name):
    """The engine's module; Keras and tf.distribute load only for the tf2 engine."""
    return config_lib.ENGINES[name].load()


def prepare(config):
    """The engine's process-wide set-up; call it before TensorFlow's runtime starts.
    Under multi_worker, the workers then check they were given the same Config (before
    anything else runs a collective: --batch-size=auto's search does).

    Raises:
      ValueError: the engine cannot run this configuration here; the message says why
        (WorkersDiffer: the workers' settings differ).
    """
    engine_module(config.engine).prepare(config)
    _agree(config, workers.settings(config, None))


def _agree(config, values, flags=()):
    """workers.differing under multi_worker: raises WorkersDiffer, naming the first
    setting that is not equal on every worker (every worker raises it), or WorkerLost;
    returns {flag: whether any worker has it} ({} without several workers)."""
    if config.distribute != "multi_worker":
        return {}
    with _losing_workers(config, "no run has started"):
        differ, any_of = workers.differing(engine_module(config.engine).prepare(config),
                                           values, flags)
    if differ:
        raise WorkersDiffer(workers.differ_line(differ, values, workers.index(config),
                                                workers.count(config)))
    return any_of


@contextlib.contextmanager
def _losing_workers(config, where):
    """Turns what a collective raises where a peer worker is lost into WorkerLost:
    `reason; where` (where: a str, or a callable giving it once the error is known)."""
    try:
        yield
    except tf.errors.OpError as e:
        reason = workers.lost_reason(e, config)
        if reason is None:
            raise
        raise WorkerLost(f"{reason}; {where() if callable(where) else where}") from None


def _agree_at_start(config, runs, datasets):
    """Under multi_worker, that every worker was given the same settings and data;
    returns whether any worker writes events (the chief, given --logdir): every worker
    then reads the loss totals after each window, a collective."""
    if config.distribute != "multi_worker":
        return False
    values = dict(workers.settings(config, runs), events=bool(runs.logdir),
                  **{workers.DATA: workers.data_digest(datasets)})
    return _agree(config, values, flags=("events",))["events"]


def bad_windows_verdict(config, consecutive_bad, last_bad):
    """Why training must stop over non-finite windows, or None."""
    if not consecutive_bad:
        return None
    if config.on_nonfinite == "abort":
        return f"non-finite loss or gradient in {last_bad} and on_nonfinite=abort"
    if consecutive_bad >= config.max_bad_windows:
        return (f"{consecutive_bad} consecutive windows had a non-finite loss or "
                f"gradient (max_bad_windows={config.max_bad_windows})")
    return None


def effective_batch(config):
    """`config` with its micro-batch found on the device where --batch-size=auto, and the
    line that says how its effective batch is cut (None without one).

    Raises:
      ValueError: the micro-batch cannot be found (the device's memory unknown; nothing
        fits: micro_batch.NothingFits); the message says why. WorkerLost: a multi_worker
        peer is lost while the workers agree on it.
    """
    if not config.effective_batch_size:
        return config, None
    if config.batch_size == config_lib.AUTO:
        with _losing_workers(config, "no run has started"):  # the search's update agrees
            found = engine_module("tf2").find_micro_batch(config)  # auto needs --engine=tf2
        config = config_lib.with_micro_batch(config, found.micro_batch_size * found.replicas)
    else:  # the whole mini-batch, as --batch-size is
        found = micro_batch.plan(config.effective_batch_size, config.batch_size)
    return config, micro_batch.describe(found)


def train_reps(config, datasets, runs, record=None, should_stop=None, log=None):
    """The reps of one configuration; each finished run is logged and written at once.

    Args:
      record: what the results file says made the runs (e.g. every flag's value).
      should_stop, log: as for train_once.

    Returns:
      The runs' result dicts.

    Raises:
      Stopped: a run stopped early (the message names the rep); WorkerLost: a
        multi_worker peer is lost.
      checkpoint.CheckpointError: a rep's checkpoint is unusable or of another config;
        WorkersDiffer: the multi_worker workers' settings, data or checkpoint differ.
      results.WriteError: a checkpoint or the results file could not be written; no
        later rep is started (the message names the rep and what is kept).
    """
    log = log or _print
    finished = []
    events = _agree_at_start(config, runs, datasets)
    if runs.checkpoint_dir:
        line = resume_line(config, runs, _saved_states(config, runs))
        if line:
            log(line)
    # The reps' bars share it, to show an ETA for all of them beside each run's own.
    clock = progress.RunsClock(runs.reps) if runs.reps > 1 else None
    for rep in range(runs.reps):
        seed = runs.seed + rep
        try:
            run = train_once(
                config, datasets, seed, verbose=runs.verbose, log=log,
                logdir=results.event_dir(runs.logdir, config, seed),
                checkpoint_dir=runs.checkpoint_dir and _rep_dir(runs, rep),
                checkpoint_every=runs.checkpoint_every, should_stop=should_stop,
                run_index=rep + 1, runs=runs.reps, clock=clock, read_losses=events)
        except (Stopped, results.WriteError) as e:
            raise type(e)(f"run {rep + 1} of {runs.reps}: {e}") from None
        finished.append(run)
        log(results.run_line(run))
        if runs.results_path:
            try:
                results.atomic_write_json(runs.results_path,
                                          results.results_document(record or {}, finished))
            except OSError as e:  # never train on when the results cannot be kept
                raise results.WriteError(_results_not_written(runs, len(finished), e)) \
                    from None
    log(results.summary_line([r["best_accuracy"] for r in finished]))
    return finished


def _rep_dir(runs, rep):
    """Run `rep`'s checkpoint directory (from 0): DIR/rep-<rep>."""
    return os.path.join(runs.checkpoint_dir, f"rep-{rep}")


def _saved_states(config, runs):
    """Each rep's checkpoint state (None where it has none), read, not loaded; under
    multi_worker, the same on every worker (else WorkersDiffer, as train_once raises)."""
    states = []
    with _losing_workers(config, "no run has started"):
        for rep in range(runs.reps):
            ckpt = run_checkpoint(config, runs.seed + rep, _rep_dir(runs, rep))
            states.append(ckpt.read())
            _agree_on_checkpoint(config, ckpt, states[-1])
    return states


def resume_line(config, runs, states):
    """The one line that says where a command run again continues, or None where it
    starts afresh: nothing left to train (every run finished), or the run it resumes and
    the update it resumes after, or the run it goes on with.

    Args:
      states: each rep's saved checkpoint state (RunCheckpoint.read), None where it has none.
    """
    done = [rep + 1 for rep, state in enumerate(states) if state and state.get("finished")]
    where = runs.checkpoint_dir
    if len(done) == runs.reps:
        return (f"nothing left to train: the {runs.reps} runs in {where} are finished "
                f"(their results as saved)" if runs.reps > 1 else
                f"nothing left to train: the run in {where} is finished (its result as saved)")
    done_part = "" if not done else (
        f"; {_numbered('run', done)} " + ("is finished (its result as saved)" if len(done) == 1
                                          else "are finished (their results as saved)"))
    rep = next(rep for rep, state in enumerate(states) if not (state and state.get("finished")))
    state = states[rep]
    if state is None:  # the next run starts afresh
        return f"resuming with run {rep + 1} of {runs.reps} in {where}{done_part}" if done \
            else None
    updates = -(-config.iterations // config.average_gradients)  # ceil(iterations / N)
    return (f"resuming run {rep + 1} of {runs.reps} after update {state['updates']} of "
            f"{updates} (iteration {state['iteration']} of {config.iterations}), from its "
            f"checkpoint in {_rep_dir(runs, rep)}{done_part}")


def _numbered(noun, numbers):
    """'run 2', 'runs 1-3', 'runs 1, 3-4': increasing numbers, ranges joined."""
    spans = []
    for number in numbers:
        if spans and spans[-1][1] == number - 1:
            spans[-1][1] = number
        else:
            spans.append([number, number])
    text = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)
    return f"{noun}{'' if len(numbers) == 1 else 's'} {text}"


def _results_not_written(runs, count, error):
    """What a failed results write keeps, after the `count`-th run finished."""
    saved = (f"it holds runs 1-{count - 1}, not run {count}'s record" if count > 2
             else "it holds run 1, not run 2's record" if count == 2
             else "run 1's record is not in it")
    if runs.checkpoint_dir:
        kept = (f"{os.path.join(runs.checkpoint_dir, f'rep-{count - 1}')} keeps it: once "
                f"the file can be written, the same command writes it without training again")
    else:
        kept = "without --checkpoint-dir it is lost (its line is above)"
    left = runs.reps - count
    not_started = ("" if not left else f"; run {runs.reps} was not started" if left == 1
                   else f"; runs {count + 1}-{runs.reps} were not started")
    return (f"--results {runs.results_path}: cannot write ({results.cause(error)}); {saved}: "
            f"{kept}{not_started}")


def _print(line):
    print(line, flush=True)


def _warning(line):
    logging.warning("%s", line)


def is_chief(config):
    """Whether this process is the one that reports: not a multi_worker worker other than
    task 0 (every worker trains the same run; one progress bar on a shared terminal)."""
    return workers.index(config) == 0


def train_once(config, datasets, seed, verbose=False, log=None, logdir=None,
               checkpoint_dir=None, checkpoint_every=CHECKPOINT_EVERY, should_stop=None,
               run_index=1, runs=1, clock=None, read_losses=False):
    """Trains one run with config.engine (resuming it from `checkpoint_dir`) and tests it,
    every `config.eval_every` mini-batches (or `eval_every_updates` updates) and at the end,
    with a progress bar on stderr where that is a terminal.

    logdir: this run's TensorBoard events (`train/loss`, `test/accuracy`, against updates);
    checkpoint_dir: saved every `checkpoint_every` updates, when stopped and when done;
    should_stop: called after every mini-batch, a non-empty return ("SIGTERM") saves and
    raises Stopped; run_index, runs, clock: for the bar; read_losses: read the loss totals
    after each window without `logdir` too (a multi_worker worker: the read is a collective).

    Returns the result dict (results.py lists its keys). Raises Stopped, WorkerLost,
    checkpoint.CheckpointError (WorkersDiffer), results.WriteError (naming the one in force).
    """
    log = log or _print
    module = engine_module(config.engine)
    ckpt = saved = run = None

    def where():
        """Where a run stopped by a lost worker stands."""
        kept = (ckpt.in_force_line() if ckpt
                else "no checkpoint directory, so this run is lost")
        if run is None:
            return kept
        return (f"stopped at iteration {run.iteration} ({run.engine.window_size()} "
                f"mini-batches in the open window); {kept}")

    with _losing_workers(config, where):
        if checkpoint_dir:
            ckpt = run_checkpoint(config, seed, checkpoint_dir)
            saved = ckpt.load()
            _agree_on_checkpoint(config, ckpt, saved)
            if saved and saved["finished"]:
                return saved["result"]
        engine = module.Engine(config, seed)
        writer = events.Writer(logdir, _warning) if logdir else None
        closers = [engine.close] + ([writer.close] if writer else [])
        try:
            if verbose and engine.summary():
                log(engine.summary())
            run = _Run(config, datasets, seed, engine, ckpt, checkpoint_every, writer,
                       verbose, log, (run_index, runs, clock), read_losses)
            if saved:
                run.restore(saved)
            result = run.train(should_stop)
        except BaseException:
            for close in closers:  # an error while closing must not hide the one raised
                try:
                    close()
                except Exception:
                    pass
            raise
    for close in closers:
        close()
    if ckpt:
        ckpt.save_finished(result)
    return result


def run_checkpoint(config, seed, checkpoint_dir):
    """The checkpoint.RunCheckpoint of the run of `config` and `seed` in `checkpoint_dir`."""
    # E only where set: checkpoints made before it existed still resume without it.
    identity = dict({key: getattr(config, key) for key in IDENTITY_FIELDS
                     if key != "effective_batch_size" or config.effective_batch_size},
                    seed=seed, **engine_module(config.engine).identity(config))
    return checkpoint.RunCheckpoint(checkpoint_dir, identity,
                                    workers.own_part(checkpoint_dir, config))


def _agree_on_checkpoint(config, ckpt, saved):
    """Under multi_worker, that every worker found the same checkpoint (none, finished,
    or the same iteration): the chief's, in a directory they all read.

    Raises:
      WorkersDiffer: a worker found another.
    """
    found = (None if not saved else "finished" if saved["finished"]
             else (saved["iteration"], saved["checkpoint"]))
    try:
        _agree(config, {"checkpoint": found})
    except WorkersDiffer:
        seen = ("no checkpoint" if found is None else "a finished run" if found == "finished"
                else f"the checkpoint of iteration {found[0]}")
        raise WorkersDiffer(
            f"--checkpoint-dir: worker {workers.index(config)} finds {seen} in "
            f"{ckpt.directory}, another worker finds otherwise: every worker must read the "
            f"directory the chief (worker 0) writes, under the same flags (on several "
            f"machines, a file system they share)") from None


class _Run:
    """One run's loop and the state a checkpoint must hold to continue it."""

    def __init__(self, config, datasets, seed, engine, ckpt, checkpoint_every, writer,
                 verbose, log, position=(1, 1, None), read_losses=False):
        self.config, self.datasets, self.seed = config, datasets, seed
        self.engine, self.ckpt, self.checkpoint_every = engine, ckpt, checkpoint_every
        self.writer = writer
        self.read_losses = bool(writer) or read_losses  # after each window (train_once)
        if writer:
            writer.warn = self._warn
        self.verbose, self.log = verbose, log
        self.position = position  # (run index from 1, runs, RunsClock or None): the bar's
        self.bar = None  # a progress.RunProgress while train() runs
        self.iteration = 0
        self.counts = WindowCounts()  # the run's updates and skipped windows
        self.best_accuracy, self.best_iteration = -1.0, 0
        self.evaluations = []
        self.eval_chunk = None  # test images per evaluation call, set by the first one
        self.train_seconds = self.eval_seconds = 0.0
        self.consecutive_bad = 0
        self.last_bad = None
        self.window_start = 1  # first iteration of the open window
        # Loss totals at the last evaluation and the last closed window: the losses
        # since then are what the verbose log and the train/loss events report.
        self.eval_mark = self.update_mark = (0.0, 0)

    # ------------------------------------------------ checkpoint state

    # What a checkpoint keeps of the loop, beside the counts and the engine's part.
    SAVED = ("iteration", "consecutive_bad", "last_bad", "window_start", "best_accuracy",
             "best_iteration", "evaluations", "train_seconds", "eval_seconds", "eval_mark",
             "update_mark")

    def state(self):
        return dict({name: getattr(self, name) for name in self.SAVED},
                    **dataclasses.asdict(self.counts),
                    position=config_lib.samples_before(self.config, self.iteration),
                    open_window=self.engine.window_size(),
                    loss_totals=self.engine.loss_totals())

    def restore(self, state):
        self.ckpt.restore(self.engine, state)
        for name in self.SAVED:
            setattr(self, name, state[name])
        self.counts = WindowCounts(state["updates"], state["skipped_windows"])

    def save(self):
        if self.ckpt:
            self.ckpt.save(self.engine, self.iteration, self.state())

    def stop(self, reason, save=True):
        """Saves a checkpoint (unless not `save`) and raises Stopped, saying where (or,
        when the save fails or is not made, which checkpoint is in force)."""
        if not self.ckpt:
            where = "no checkpoint directory, so this run is lost"
        elif not save:
            where = self.ckpt.in_force_line()
        else:
            try:
                self.save()
                where = f"checkpoint in {self.ckpt.directory}; run the same command to resume"
            except results.WriteError as e:
                where = str(e)
        raise self._stopped(reason, where)

    def _stopped(self, reason, where):
        return Stopped(f"{reason}; stopped at iteration {self.iteration} ("
                       f"{self.engine.window_size()} mini-batches in the open window); {where}")

    def periodic_save(self, should_stop):
        """The checkpoint every checkpoint_every updates. When it fails, a signal that
        came meanwhile still ends the run as interrupted.

        Raises:
          results.WriteError: the save failed.
          Stopped: the save failed and `should_stop` asks to stop.
        """
        try:
            self.save()
        except results.WriteError as e:
            reason = should_stop() if should_stop else None
            if not reason:
                raise
            raise self._stopped(f"interrupted by {reason}", str(e)) from None

    def _warn(self, line):
        """A warning, with the bar (if any) cleared around it."""
        if self.bar is None:
            _warning(line)
        else:
            self.bar.write(line, _warning)

    # ------------------------------------------------ the loop

    def train(self, should_stop):
        """The run, with its bar on stderr while it trains (a terminal only; the chief
        only): the log's lines and the warnings are written with the bar cleared around
        them, so they reach the terminal, and any pipe, unchanged."""
        run_index, runs, clock = self.position
        bar = progress.RunProgress(self.config.iterations, run_index, runs, clock=clock,
                                   enabled=None if is_chief(self.config) else False,
                                   initial=self.iteration)
        log, self.bar, self.log = self.log, bar, bar.wrap(self.log)
        try:
            return self._train(should_stop)
        finally:
            bar.close()
            self.log = log

    def _train(self, should_stop):
        config, engine = self.config, self.engine
        first = self.iteration + 1  # a window's last mini-batch is E's rest (with E)
        batches = data.batches(
            self.datasets.train, self.seed,
            lambda index: config_lib.mini_batch_size(config, first + index),
            config_lib.samples_before(config, self.iteration), config.iterations - self.iteration)
        while self.iteration < config.iterations:
            self.iteration += 1
            start = time.perf_counter()
            images, labels = next(batches)
            if self.iteration in config.inject_nonfinite:
                images = np.array(images)
                images[0] = np.nan
            closed = self.counts.count(engine.step(images, labels, self.iteration))
            self.train_seconds += time.perf_counter() - start
            self.close_window(closed)
            self.bar.advance(self.iteration, self.counts.updates)
            if evaluation_due(config, self.iteration, self.counts.updates,
                              closed is Outcome.APPLIED):
                self.evaluate()
            if closed is Outcome.APPLIED and self.counts.updates % self.checkpoint_every == 0:
                self.periodic_save(should_stop)
            reason = should_stop() if should_stop else None
            if reason:
                # A save is a collective under multi_worker, and a signal may reach the
                # workers at different mini-batches: the periodic checkpoint stays.
                self.stop(f"interrupted by {reason}",
                          save=self.config.distribute != "multi_worker")

        held = engine.window_size()
        start = time.perf_counter()
        closed = self.counts.count(engine.flush())
        self.train_seconds += time.perf_counter() - start
        self.close_window(closed)
        self.bar.advance(self.iteration, self.counts.updates)
        if closed is Outcome.APPLIED:
            self._warn(f"iterations={config.iterations} is not a multiple of "
                       f"average_gradients={config.average_gradients}: the last {held} "
                       "mini-batches were applied as one update of their mean")
        final_accuracy = self.evaluate()
        return {"seed": self.seed, "best_accuracy": self.best_accuracy,
                "best_iteration": self.best_iteration, "final_accuracy": final_accuracy,
                "updates": self.counts.updates, "skipped_windows": self.counts.skipped_windows,
                "train_seconds": self.train_seconds, "eval_seconds": self.eval_seconds,
                "weights_sha256": engine.weights_sha256(), "evaluations": self.evaluations,
                "out_of_memory": [int(b) for b in engine.out_of_memory()]}

    def close_window(self, closed):
        """Accounts for a window the engine just closed (Outcome.NONE: none was); stops
        where the non-finite windows say so."""
        if closed is Outcome.NONE:
            return
        if closed is Outcome.SKIPPED:
            self.consecutive_bad += 1
            self.last_bad = f"iterations {self.window_start}-{self.iteration}"
            self._warn(SKIPPED_WINDOW % (self.last_bad, self.counts.skipped_windows))
            if self.read_losses:  # the next update's loss leaves this window out
                self.update_mark = self.engine.loss_totals()
        else:
            self.consecutive_bad = 0
            if self.read_losses:
                loss, self.update_mark = self._mean_loss_since(self.update_mark)
                if loss is not None and self.writer:
                    self.writer.scalar("train/loss", loss, self.counts.updates)
        self.window_start = self.iteration + 1
        verdict = bad_windows_verdict(self.config, self.consecutive_bad, self.last_bad)
        if verdict:
            self.stop(verdict)

    def _mean_loss_since(self, mark):
        """(mean training loss since `mark` or None without samples, the totals now)."""
        totals = self.engine.loss_totals()
        samples = totals[1] - mark[1]
        return ((totals[0] - mark[0]) / samples if samples else None), totals

    def evaluate(self):
        start = time.perf_counter()
        if self.eval_chunk is None:  # once, after training: see device_memory.evaluation_chunk
            self.eval_chunk = device_memory.evaluation_chunk(self.config.batch_size,
                                                      self.config.model)
        accuracy = self.engine.evaluate(self.datasets.test, self.eval_chunk)
        self.eval_seconds += time.perf_counter() - start
        updates = self.counts.updates
        self.evaluations.append({"iteration": self.iteration, "updates": updates,
                                 "accuracy": accuracy})
        if accuracy > self.best_accuracy:
            self.best_accuracy, self.best_iteration = accuracy, self.iteration
        self.bar.evaluated(accuracy)
        if self.verbose:
            loss, self.eval_mark = self._mean_loss_since(self.eval_mark)
            loss = float("nan") if loss is None else loss
            self.log(f"Iteration {self.iteration}: loss {loss:.4f}, accuracy {accuracy:.2f}")
        if self.writer:
            self.writer.scalar("test/accuracy", accuracy, updates)
        return accuracy
