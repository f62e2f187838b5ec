"""The post's whole table from one command, side by side with the post's numbers.

    python -m experiment.reproduce --reps=10 --results-dir=results   # what `make reproduce` runs

Each run is its own `main.py --reps=1 --seed=S --results=FILE` process, JOBS at a time with
TensorFlow's threads split between them, stored by configuration and seed, so a stopped
reproduction carries on. Then a results JSON per configuration, two figures and table.md.
This driver never imports TensorFlow; its flags are defined only when run as a script.
"""

import collections
import concurrent.futures
import contextlib
import dataclasses
import glob
import json
import os
import shlex
import subprocess
import sys
import threading
import time

from absl import app
from absl import flags as absl_flags

from experiment import cli
from experiment import config as experiment_config
from experiment import figures
from experiment import progress
from experiment import reproduce_table
from experiment import results
from experiment.reproduce_table import EVAL_EVERY
from experiment.reproduce_table import FAIR_EVAL_EVERY_UPDATES
from experiment.reproduce_table import POST_TABLE

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAIN = os.path.join(ROOT, "main.py")  # each run is the real command line
DEFAULT_ACCUMULATE = "fused"  # the fastest; the post's stack's weights, bit for bit
# The rest of a run pinned to the post's values, not main.py's defaults; a stored run must match.
POST_FLAGS = experiment_config.POST_VALUES
CURVES_PNG, BEST_PNG = "accuracy_curves.png", "best_accuracy.png"  # table.md links these
# Rough seconds of a run: start-up, per mini-batch, per evaluation (longest first; the ETA).
PRIOR_START, PRIOR_ITERATION, PRIOR_EVALUATION = 6.0, 0.004, 0.15

Setting = collections.namedtuple("Setting", ["average_gradients", "batch_size", "iterations"])


class ReproduceError(Exception):
    """Bad settings or stored results that cannot be used; the message says which."""


class RunSpec(collections.namedtuple("RunSpec", ["setting", "rep", "seed", "path", "flags"])):
    """One run of the table: its configuration, seed, results file (its identity) and
    main.py flags."""

    @property
    def config(self):
        """The experiment Config main.py will run."""
        return experiment_config.from_values(experiment_config.Config, self.flags)


def plan(out_dir, reps, seed, scale, fair, accumulate):
    """Every run of the table, in table order: a list of RunSpec. A configuration's updates
    (not iterations) are divided by `scale`, at least one: equal across N, iterations a
    multiple of N. Its main.py flags, results, threads and logging aside, are the post's."""
    specs = []
    for n, b, iterations in POST_TABLE:
        setting = Setting(n, b, max(1, iterations // n // scale) * n)
        for rep, run_seed in enumerate(range(seed, seed + reps)):
            name = f"{results.run_label(setting)}-seed{run_seed}.json"
            flags = dict(POST_FLAGS, **{
                "average-gradients": n, "batch-size": b, "iterations": setting.iterations,
                "reps": 1, "seed": run_seed, "eval-every": 0 if fair else EVAL_EVERY,
                "eval-every-updates": FAIR_EVAL_EVERY_UPDATES if fair else 0,
                "accumulate": accumulate})
            specs.append(RunSpec(setting, rep, run_seed, os.path.join(out_dir, "runs", name),
                                 flags))
    return specs


def read_document(path):
    """A results JSON as main.py wrote it, or None if there is none."""
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise ReproduceError(f"{path}: cannot read ({e}); remove it to redo that run") \
            from None


def load_run(spec):
    """The run stored for `spec` or None; ReproduceError if unreadable or of other settings."""
    document = read_document(spec.path)
    if document is None:
        return None
    stored = document.get("config", {}) if isinstance(document, dict) else {}
    for name, wanted in spec.flags.items():
        if stored.get(name) != wanted:
            raise ReproduceError(
                f"{spec.path} was made with --{name}={stored.get(name)}, not {wanted}: use "
                "another RESULTS_DIR, or remove that file to redo the run")
    runs = document.get("runs")
    if not (isinstance(runs, list) and len(runs) == 1 and runs[0].get("seed") == spec.seed):
        raise ReproduceError(f"{spec.path}: expected exactly one run, of seed {spec.seed}")
    return runs[0]


def prior(spec):
    """A guess of a run's seconds from its size (runs differ in length)."""
    n_eval = experiment_config.evaluations(spec.config)
    return PRIOR_START + PRIOR_ITERATION * spec.setting.iterations + PRIOR_EVALUATION * n_eval


def fmt_duration(seconds):
    """12 s, 4 min 05 s, 1 h 02 min."""
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds // 3600} h {seconds // 60 % 60:02d} min"


def say(line):
    """Prints a line in one write, so parallel runs' lines never interleave."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


class Runner:
    """Runs `todo`'s main.py processes, JOBS at a time, longest first (the best packing of
    the slots), a line per finished run with an ETA: the wall time so far x prior(left) /
    prior(done). Stops launching on a failure or Ctrl-C."""

    def __init__(self, todo, jobs, threads, tb_dir, verbose, log):
        self.todo, self.jobs, self.threads = todo, jobs, threads
        self.tb_dir, self.verbose, self.log = tb_dir, verbose, log
        self.left, self.done, self.count = sum(map(prior, todo)), 0.0, 0
        self.start = time.perf_counter()
        self.bar = None  # run_all's
        self.processes, self.stopping = set(), False
        self.lock = threading.RLock()  # eta() is asked from the bar's thread too

    def eta(self):
        """Seconds left; safe from any thread."""
        with self.lock:
            if not self.done:
                return self.left / self.jobs
            return (time.perf_counter() - self.start) * self.left / self.done

    def finished(self, spec, run, seconds):
        with self.lock:
            self.count += 1
            self.left -= prior(spec)
            self.done += prior(spec)
            self.log(f"[{self.count:{len(str(len(self.todo)))}d}/{len(self.todo)}] "
                     f"N={spec.setting.average_gradients} B={spec.setting.batch_size} "
                     f"rep {spec.rep + 1} (seed {spec.seed}): "
                     f"best {results.fmt_accuracy(run['best_accuracy'])} "
                     f"final {results.fmt_accuracy(run['final_accuracy'])}, "
                     f"{seconds:.0f} s; ETA {fmt_duration(self.eta())}")
            if self.bar is not None:
                self.bar.update()

    def run_one(self, spec):
        """Runs one main.py process; returns its run, or None if stopped before it began."""
        command = [sys.executable, MAIN, *(f"--{k}={v}" for k, v in spec.flags.items()),
                   f"--threads={self.threads}", f"--results={spec.path}",
                   f"--logdir={self.tb_dir}"] + (["--verbose"] if self.verbose else [])
        with self.lock:
            if self.stopping:
                return None
            # A stopped run's events would overlap the new ones.
            event_dir = results.event_dir(self.tb_dir, spec.setting, spec.seed)
            for path in glob.glob(os.path.join(event_dir, "events.out.tfevents.*")):
                try:
                    os.unlink(path)
                except OSError:  # old curves beside the new: untidy, not wrong numbers
                    pass
            start = time.perf_counter()
            process = subprocess.Popen(command, cwd=ROOT, text=True,
                                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            self.processes.add(process)
        tail = collections.deque(maxlen=20)
        for line in process.stdout:
            line = line.rstrip()
            if line:
                tail.append(line)
            if self.verbose and line.startswith("Iteration"):
                self.log(f"  N={spec.setting.average_gradients} seed {spec.seed}: {line}")
        status = process.wait()
        seconds = time.perf_counter() - start
        with self.lock:
            self.processes.discard(process)
            if self.stopping and status != 0:
                return None
        if status != 0:
            reason = tail[-1] if tail else "no output"
            raise ReproduceError(f"N={spec.setting.average_gradients} seed {spec.seed}: "
                                 f"main.py exited with status {status}: {reason}")
        run = load_run(spec)
        if run is None:
            raise ReproduceError(f"{spec.path}: main.py finished but wrote no results")
        self.finished(spec, run, seconds)
        return run

    def stop(self, kill):
        """No new runs; with `kill`, also ends the running ones (this driver's own children)."""
        with self.lock:
            self.stopping = True
            if kill:
                for process in self.processes:
                    process.terminate()

    def run_all(self):
        """Runs every run of `todo`; ReproduceError on the first that fails."""
        order = sorted(self.todo, key=prior, reverse=True)
        with progress.Bar(len(order), "reproduce", unit="run", remaining=self.eta) as bar, \
                concurrent.futures.ThreadPoolExecutor(self.jobs) as pool:
            self.bar, self.log = bar, bar.wrap(self.log)
            futures = [pool.submit(self.run_one, spec) for spec in order]
            try:
                for future in concurrent.futures.as_completed(futures):
                    future.result()
            except ReproduceError:
                self.stop(kill=False)
                if self.processes:
                    self.log(f"a run failed: waiting for the {len(self.processes)} running "
                             "run(s) to finish and be kept (Ctrl-C ends them)")
                raise
            except BaseException:
                self.stop(kill=True)
                raise


def reproduce(results_dir, reps=10, seed=0, jobs=0, threads=0, scale=1, fair=False,
              accumulate=DEFAULT_ACCUMULATE, verbose=False,
              command="python -m experiment.reproduce", log=say):
    """Runs what the table lacks, writes and returns table.md's text; ReproduceError on bad
    settings, stored runs of other settings, or a failed run."""
    if reps < 1 or scale < 1 or jobs < 0 or threads < 0 or seed < 0:
        raise ReproduceError("reps and scale must be at least 1; jobs, threads and seed "
                             "not negative")
    cores = os.cpu_count() or 1
    jobs = jobs or cores
    threads = threads or max(1, cores // jobs)
    out_dir = os.path.join(results_dir, "fair") if fair else results_dir
    tb_dir = os.path.join(out_dir, "tb")
    try:
        os.makedirs(os.path.join(out_dir, "runs"), exist_ok=True)
        os.makedirs(tb_dir, exist_ok=True)
    except OSError as e:
        raise ReproduceError(f"{out_dir}: cannot create ({e.strerror})") from None

    specs = plan(out_dir, reps, seed, scale, fair, accumulate)
    runs = [load_run(spec) for spec in specs]
    todo = [spec for spec, run in zip(specs, runs) if run is None]
    log(f"{len(specs)} runs ({reps} per configuration): {len(specs) - len(todo)} already "
        f"done in {os.path.join(out_dir, 'runs')}, {len(todo)} to run, {jobs} at a time "
        f"with {threads} TensorFlow thread{'s' if threads > 1 else ''} each")
    start = time.perf_counter()
    if todo:
        Runner(todo, jobs, threads, tb_dir, verbose, log).run_all()
        runs = [run or load_run(spec) for spec, run in zip(specs, runs)]
    wall = time.perf_counter() - start

    rows = _summaries(specs, runs, out_dir, reps, seed, scale)
    timing = (f"This invocation ran {len(todo)} of the {len(specs)} runs in "
              f"{fmt_duration(wall)} of wall time, {jobs} process{'es' if jobs > 1 else ''} "
              f"at a time with {threads} thread{'s' if threads > 1 else ''} each"
              + (f"; the other {len(specs) - len(todo)} were done by an earlier invocation."
                 if len(todo) < len(specs) else "."))
    drawn, notes = draw_figures(out_dir, [(spec.setting.average_gradients, run)
                                          for spec, run in zip(specs, runs)], scale == 1, log)
    text = reproduce_table.table_document(rows, fair, scale, command, timing, drawn, notes)
    path = os.path.join(out_dir, "table.md")
    with _writing(path, out_dir):
        results.atomic_write_text(path, text)
    return text


def _summaries(specs, runs, out_dir, reps, seed, scale):
    """The table's rows, one per configuration (`reps` consecutive specs, N=1's first: the
    tests' reference), each one's results JSON written beside."""
    rows = []
    for i, post in enumerate(POST_TABLE.values()):
        first, group = specs[i * reps], runs[i * reps:(i + 1) * reps]
        config = dict(read_document(first.path)["config"])
        path = os.path.join(out_dir, results.run_label(first.setting) + ".json")
        config.update(reps=reps, seed=seed, results=path)
        with _writing(path, out_dir):
            results.atomic_write_json(path, results.results_document(config, group))
        rows.append(reproduce_table.summarize(first.setting, group, runs[:reps],
                                              post if scale == 1 else None,
                                              experiment_config.evaluations(first.config)))
    return rows


@contextlib.contextmanager
def _writing(path, out_dir, what=""):
    """A block that writes `path`: its OSError a ReproduceError saying the runs are kept."""
    try:
        yield
    except OSError as e:
        raise ReproduceError(f"{path}: cannot write{what} ({results.cause(e)}); the finished "
                             f"runs are kept in {os.path.join(out_dir, 'runs')}: the same "
                             "command writes it from them without running them again") from None


def draw_figures(out_dir, pairs, with_post, log):
    """The two figures of `pairs`, (N, run) per run, next to table.md -> (names drawn, notes):
    one with nothing to draw is left out with a note; ReproduceError where one is unwritable."""
    curves_by_n, best_by_n = figures.runs_to_inputs(pairs)
    post = {key[0]: mean_std for key, mean_std in POST_TABLE.items()} if with_post else {}
    post_means = {n: mean for n, (mean, _) in post.items()}
    drawn, notes = [], []
    for name, draw, data, marks in ((CURVES_PNG, figures.accuracy_curves, curves_by_n,
                                     post_means),
                                    (BEST_PNG, figures.best_accuracy_spread, best_by_n, post)):
        path = os.path.join(out_dir, name)
        try:
            with _writing(path, out_dir, " the figure"):
                draw(data, marks or None, path)
        except ValueError as e:
            notes.append(f"{name} not drawn: {e}.")
            continue
        drawn.append(name)
    without = sum(1 for _, run in pairs if not run.get("evaluations"))
    if without and CURVES_PNG in drawn:
        notes.append(f"{without} of {len(pairs)} runs recorded no evaluations (made before "
                     f"they were kept) and are not in {CURVES_PNG}.")
    for note in notes:
        log(note)
    return drawn, notes


def define_flags():
    """The driver's flags; those passed on to main.py keep its definitions, with help for here."""
    main_py = experiment_config.SETTINGS
    Setting = experiment_config.Setting
    cli.define_all([
        dataclasses.replace(main_py["reps"], help="Runs per configuration; run r uses seed + r."),
        Setting("results-dir", "string", "results",
                "Where runs, per-configuration results, table.md and TensorBoard events go."),
        Setting("jobs", "integer", 0, "main.py processes at a time (0: one per CPU core).",
                lower=0),
        dataclasses.replace(main_py["threads"], help="TensorFlow threads per process (0: the "
                            "CPU cores divided among the jobs)."),
        Setting("fair", "bool", False,
                f"Evaluate every configuration every {FAIR_EVAL_EVERY_UPDATES} updates, not "
                f"the post's every {EVAL_EVERY} iterations; writes under RESULTS_DIR/fair."),
        Setting("scale", "integer", 1, "Divide every configuration's updates by this (at "
                "least one), for quick tests.", lower=1),
        dataclasses.replace(main_py["seed"], help="Seed of the first run of every "
                            "configuration."),
        dataclasses.replace(main_py["accumulate"], default=DEFAULT_ACCUMULATE,
                            help="main.py's --accumulate for every run; fused is the fastest "
                            "and gives the same weights, bit for bit, as the post's stack."),
        dataclasses.replace(main_py["verbose"], help="Pass --verbose on: every run's "
                            "evaluation lines."),
    ])


def main(argv):
    if len(argv) > 1:
        cli.fail(f"unexpected arguments: {' '.join(argv[1:])}")
    FLAGS = absl_flags.FLAGS
    command = shlex.join(["python", "-m", "experiment.reproduce"] + sys.argv[1:])
    try:
        text = reproduce(FLAGS["results-dir"].value, reps=FLAGS.reps, seed=FLAGS.seed,
                         jobs=FLAGS.jobs, threads=FLAGS.threads, scale=FLAGS.scale,
                         fair=FLAGS.fair, accumulate=FLAGS.accumulate, verbose=FLAGS.verbose,
                         command=command)
    except ReproduceError as e:
        cli.fail(str(e), code=1)
    except KeyboardInterrupt:
        print("interrupted: finished runs are kept; the same command carries on from them",
              file=sys.stderr)
        return 130
    print()
    print(text, end="")
    return 0


if __name__ == "__main__":
    define_flags()
    app.run(main, flags_parser=cli.parse_flags)
