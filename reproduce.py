"""The post's whole table from one command, side by side with the post's numbers.

    python reproduce.py --reps=10 --results-dir=results        # what `make reproduce` runs

Every run is its own `main.py --reps=1 --seed=S --results=FILE` process, so the table
comes from the real command line. Runs go to JOBS processes at a time, with TensorFlow's
thread pools split between them. Each finished run is a file of its own, written
atomically by main.py and keyed by configuration and seed: a stopped reproduction keeps
its finished runs, and the same command carries on from there. At the end it writes one
results JSON per configuration and `table.md` (the table, then a verdict generated from
the numbers) and prints them.

This driver never imports TensorFlow; its flags are defined only when it runs as a
script, so tests can import it beside main.py's flags.
"""

import collections
import concurrent.futures
import datetime
import glob
import importlib.metadata
import json
import math
import os
import platform
import shlex
import subprocess
import sys
import threading
import time

from absl import app
from absl import flags as absl_flags

import results

# The strategy every run uses: fused is the fastest and ends with the same weights, bit for
# bit, as the post's stack (tests/test_trainer.py checks it); ACCUMULATE=stack for the post's.
DEFAULT_ACCUMULATE = "fused"

ROOT = os.path.dirname(os.path.abspath(__file__))
MAIN = os.path.join(ROOT, "main.py")

# The post's table: (N, B, iterations) -> its mean and population std of the per-run best.
POST_TABLE = collections.OrderedDict([
    ((1, 100, 1000), (95.0, 0.172)),
    ((5, 20, 5000), (94.9, 0.325)),
    ((10, 10, 10000), (95.1, 0.36)),
    ((20, 5, 20000), (95.2, 0.303)),
])
POST_RUNS = 10
# Everything else that shapes a run, pinned to the post's values so that the table does
# not drift if main.py's defaults ever change; a stored run must match all of it.
POST_FLAGS = {"learning-rate": 1e-3, "lr-schedule": "constant", "dropout": 0.5,
              "model": "convnet", "engine": "tf1"}
EVAL_EVERY = 100                # the post's cadence: every 100 iterations
FAIR_EVAL_EVERY_UPDATES = 100   # FAIR=1: every 100 updates, whatever N
LEVEL = 0.95
ALPHA = 0.05
# Rough single-thread seconds of one run on a 2-core machine, for the first ETA only:
# process start-up, per mini-batch, per evaluation of the 10,000 test images.
PRIOR_START, PRIOR_ITERATION, PRIOR_EVALUATION = 6.0, 0.004, 0.15

Setting = collections.namedtuple("Setting", ["average_gradients", "batch_size", "iterations"])


class ReproduceError(Exception):
    """Bad settings or stored results that cannot be used; the message says which."""


class RunSpec(collections.namedtuple("RunSpec", ["setting", "rep", "seed", "path", "flags"])):
    """One run of the table: its configuration, seed, results file and main.py flags."""

    @property
    def label(self):
        return results.run_label(self.setting)

    # The results file names the run (configuration and seed): it is the identity.
    def __hash__(self):
        return hash(self.path)

    def __eq__(self, other):
        return isinstance(other, RunSpec) and self.path == other.path


# ---------------------------------------------------------------- the plan


def scaled_setting(post_key, scale):
    """The configuration with its updates divided by `scale` (at least one update).

    Every configuration of the post applies iterations / N = 1000 updates; dividing the
    updates keeps that equal across N and keeps iterations a multiple of N.
    """
    n, b, iterations = post_key
    return Setting(n, b, max(1, iterations // n // scale) * n)


def evaluations(setting, eval_every, eval_every_updates):
    """How many test-set evaluations one run makes (the periodic ones and the final one)."""
    if eval_every_updates:
        return (setting.iterations - 1) // setting.average_gradients // eval_every_updates + 1
    if eval_every:
        return (setting.iterations - 1) // eval_every + 1
    return 1


def run_flags(setting, seed, fair, accumulate):
    """main.py's flags that make this run (results, threads and logging aside)."""
    return dict(POST_FLAGS, **{
        "average-gradients": setting.average_gradients, "batch-size": setting.batch_size,
        "iterations": setting.iterations, "reps": 1, "seed": seed,
        "eval-every": 0 if fair else EVAL_EVERY,
        "eval-every-updates": FAIR_EVAL_EVERY_UPDATES if fair else 0,
        "accumulate": accumulate})


def plan(out_dir, reps, seed, scale, fair, accumulate):
    """Every run of the table, in table order: a list of RunSpec."""
    specs = []
    for post_key in POST_TABLE:
        setting = scaled_setting(post_key, scale)
        for rep, run_seed in enumerate(range(seed, seed + reps)):
            name = f"{results.run_label(setting)}-seed{run_seed}.json"
            specs.append(RunSpec(setting, rep, run_seed, os.path.join(out_dir, "runs", name),
                                 run_flags(setting, run_seed, fair, accumulate)))
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
    """The finished run stored for `spec`, or None if there is none yet.

    Raises:
      ReproduceError: the file is unreadable, or was made with other settings (a results
        directory is never silently reused for a different experiment).
    """
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


# ---------------------------------------------------------------- running


class Progress:
    """One line per finished run, with an ETA for the whole reproduction."""

    def __init__(self, todo, jobs, log):
        self.todo, self.jobs, self.log = list(todo), jobs, log
        self.finished_count = 0
        self.seconds = collections.defaultdict(list)  # label -> seconds of its runs
        self.waiting = set(self.todo)
        self.running = {}  # RunSpec -> perf_counter at launch
        self.lock = threading.Lock()

    @staticmethod
    def prior(spec):
        """A guess of a run's seconds from its size, before anything is measured."""
        n_eval = evaluations(spec.setting, spec.flags["eval-every"],
                             spec.flags["eval-every-updates"])
        return (PRIOR_START + PRIOR_ITERATION * spec.setting.iterations
                + PRIOR_EVALUATION * n_eval)

    def estimate(self, spec):
        """A run's seconds: the mean measured for its configuration, else the prior scaled
        by how the configurations measured so far compared with their priors."""
        if self.seconds[spec.label]:
            return _mean(self.seconds[spec.label])
        measured = [s for s in {s.label: s for s in self.todo}.values()
                    if self.seconds[s.label]]
        if not measured:
            return self.prior(spec)
        ratio = (sum(_mean(self.seconds[s.label]) for s in measured)
                 / sum(self.prior(s) for s in measured))
        return self.prior(spec) * ratio

    def eta(self):
        now = time.perf_counter()
        left = sum(self.estimate(s) for s in self.waiting)
        left += sum(max(0.0, self.estimate(s) - (now - t)) for s, t in self.running.items())
        return left / self.jobs

    def launched(self, spec):
        with self.lock:
            self.waiting.discard(spec)
            self.running[spec] = time.perf_counter()

    def finished(self, spec, run, seconds):
        with self.lock:
            self.running.pop(spec, None)
            self.finished_count += 1
            self.seconds[spec.label].append(seconds)
            width = len(str(len(self.todo)))
            self.log(f"[{self.finished_count:{width}d}/{len(self.todo)}] "
                     f"N={spec.setting.average_gradients} B={spec.setting.batch_size} "
                     f"rep {spec.rep + 1} (seed {spec.seed}): "
                     f"best {results.fmt_accuracy(run['best_accuracy'])} "
                     f"final {results.fmt_accuracy(run['final_accuracy'])}, "
                     f"{seconds:.0f} s; ETA {fmt_duration(self.eta())}")


def _mean(values):
    return sum(values) / len(values)


def fmt_duration(seconds):
    """12 s, 4 min 05 s, 1 h 02 min."""
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds // 3600} h {seconds // 60 % 60:02d} min"


def say(line):
    """Prints a line in one write, so lines from parallel runs never interleave."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


class Runner:
    """Runs main.py processes, JOBS at a time; stops launching on a failure or Ctrl-C."""

    def __init__(self, jobs, threads, tb_dir, verbose, progress, log):
        self.jobs, self.threads, self.tb_dir = jobs, threads, tb_dir
        self.verbose, self.progress, self.log = verbose, progress, log
        self.processes = set()
        self.lock = threading.Lock()
        self.stopping = False

    def command(self, spec):
        flags = [f"--{name}={value}" for name, value in spec.flags.items()]
        flags += [f"--threads={self.threads}", f"--results={spec.path}",
                  f"--logdir={self.tb_dir}"]
        return [sys.executable, MAIN] + flags + (["--verbose"] if self.verbose else [])

    def run_one(self, spec):
        """Runs one main.py process; returns its run, or None if stopped before it began."""
        with self.lock:
            if self.stopping:
                return None
            # A run that was stopped part-way left events that would overlap the new ones.
            event_dir = results.event_dir(self.tb_dir, spec.setting, spec.seed)
            for path in glob.glob(os.path.join(event_dir, "events.out.tfevents.*")):
                os.unlink(path)
            start = time.perf_counter()
            process = subprocess.Popen(self.command(spec), cwd=ROOT, text=True,
                                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            self.processes.add(process)
        self.progress.launched(spec)
        tail = collections.deque(maxlen=20)
        prefix = f"  N={spec.setting.average_gradients} seed {spec.seed}: "
        for line in process.stdout:
            line = line.rstrip()
            if line:
                tail.append(line)
            if self.verbose and line.startswith("Iteration"):
                self.log(prefix + line)
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
        self.progress.finished(spec, run, seconds)
        return run

    def stop(self, kill):
        """No new runs; with `kill`, also ends the running ones (this driver's own children)."""
        with self.lock:
            self.stopping = True
            if kill:
                for process in self.processes:
                    process.terminate()

    def run_all(self, todo):
        """Runs every spec of `todo`, longest first (the best packing of JOBS slots)."""
        order = sorted(todo, key=Progress.prior, reverse=True)
        with concurrent.futures.ThreadPoolExecutor(self.jobs) as pool:
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


# ---------------------------------------------------------------- the table


Row = collections.namedtuple("Row", [
    "setting", "post", "n", "best", "best_ci", "final", "p_best", "p_final", "post_p",
    "updates", "evaluations", "seconds", "gap"])


def summarize(setting, runs, reference_runs, post, evaluation_count):
    """The numbers of one row of the table.

    Args:
      setting: the configuration (N, B, iterations).
      runs: its runs (dicts as main.py writes them).
      reference_runs: the N=1 row's runs, the baseline of the Welch tests.
      post: (mean, population std) of the post's 10 runs, or None.
      evaluation_count: test-set evaluations per run.
    """
    best = [r["best_accuracy"] for r in runs]
    final = [r["final_accuracy"] for r in runs]
    post_p = math.nan
    if post is not None:
        post_mean, post_std = post  # the post reports the population std (ddof=0)
        post_p = results.welch_from_moments(
            _mean(best), results.sample_variance(best), len(best), post_mean,
            post_std ** 2 * POST_RUNS / (POST_RUNS - 1), POST_RUNS).p
    return Row(
        setting=setting, post=post, n=len(runs),
        best=results.mean_std(best), best_ci=results.confidence_interval(best, LEVEL),
        final=results.mean_std(final),
        p_best=results.welch_t_test(best, [r["best_accuracy"] for r in reference_runs]).p,
        p_final=results.welch_t_test(final, [r["final_accuracy"] for r in reference_runs]).p,
        post_p=post_p, updates=sorted({r["updates"] for r in runs}),
        evaluations=evaluation_count,
        seconds=_mean([r["train_seconds"] + r["eval_seconds"] for r in runs]),
        gap=_mean([b - f for b, f in zip(best, final)]))


def fmt_mean_std(mean_std, digits=2):
    mean, std = mean_std
    return f"{mean:.{digits}f} ± {std:.{digits + 1}f}"


def fmt_p(p):
    """A p-value as tables print it: 0.41, 0.012, < 0.001; n/a without a test."""
    if math.isnan(p):
        return "n/a"
    return "< 0.001" if p < 0.001 else f"{p:.2g}"


def fmt_interval(interval):
    low, high = interval
    return "n/a" if math.isnan(low) else f"[{low:.2f}, {high:.2f}]"


TABLE_HEADER = ("| N | B | iterations | updates | evaluations | post: best | ours: best "
                "| 95% CI of ours | p vs N=1 | ours: final | p vs N=1 (final) | s/run |")


def table_lines(rows):
    """The markdown table, one row per configuration, N first."""
    lines = [TABLE_HEADER, "|" + "---|" * TABLE_HEADER.count(" | ") + "---|"]
    for row in rows:
        s = row.setting
        reference = s.average_gradients == rows[0].setting.average_gradients
        post = f"{row.post[0]:.1f} ± {row.post[1]:g}" if row.post else "n/a"
        lines.append(" | ".join([
            f"| {s.average_gradients}", str(s.batch_size), str(s.iterations),
            "/".join(str(u) for u in row.updates), str(row.evaluations), post,
            fmt_mean_std(row.best), fmt_interval(row.best_ci),
            "(reference)" if reference else fmt_p(row.p_best), fmt_mean_std(row.final),
            "(reference)" if reference else fmt_p(row.p_final), f"{row.seconds:.0f} |"]))
    return lines


def _listing(rows):
    return ", ".join(f"N={r.setting.average_gradients}" for r in rows)


def verdict_lines(rows, fair, scale):
    """A short verdict generated from the numbers: the post, N=1, the protocol's bias."""
    lines = ["**Verdict** (generated from the numbers above)", ""]
    if scale > 1:
        lines.append(f"- SCALE={scale}: every run applied 1/{scale} of the post's updates. "
                     "This is a smoke test of the pipeline; its numbers say nothing about "
                     "the post.")
    if min(r.n for r in rows) < 2:
        lines.append("- Fewer than 2 runs per configuration: no spread, so no confidence "
                     "interval and no test. Use REPS=10 (the default) for a verdict.")
        return lines

    compared = [r for r in rows if r.post]
    if compared:
        lines.append("- Against the post: " + _post_verdict(compared, fair))
    others = rows[1:]
    for name, field in (("best", "best"), ("final", "final")):
        p_values = [getattr(r, "p_" + field) for r in others]
        differ = [r for r, p in zip(others, p_values) if p < ALPHA]
        if not differ:
            lines.append(f"- Averaging against one large batch ({name} accuracy): no N "
                         f"differs from N=1 at the 5% level (Welch p = "
                         + ", ".join(fmt_p(p) for p in p_values) + ").")
            continue
        lines.append(
            f"- Averaging against one large batch ({name} accuracy): "
            + "; ".join(f"N={r.setting.average_gradients} differs from N=1 "
                        f"(p = {fmt_p(getattr(r, 'p_' + field))}, "
                        f"{getattr(r, field)[0] - getattr(rows[0], field)[0]:+.2f} points)"
                        for r in differ)
            + ("; the others do not" if len(differ) < len(others) else "")
            + " (5% level).")
    lines.append(f"  With {rows[0].n} runs per configuration, p > 0.05 means that no "
                 "difference was detected, not that none exists.")

    gaps = ", ".join(f"N={r.setting.average_gradients} {r.gap:+.2f}" for r in rows)
    counts = ", ".join(f"N={r.setting.average_gradients} {r.evaluations}" for r in rows)
    if fair:
        lines.append(f"- The protocol: every configuration was evaluated on the same cadence "
                     f"(evaluations per run: {counts}), so no N gets more chances. The best "
                     f"is still picked on the test set itself, so it is optimistic (best "
                     f"minus final, on average: {gaps} points).")
    else:
        lines.append(f"- What the post's protocol favours: the best accuracy is picked on "
                     f"the test set itself, so it is optimistic (best minus final, on "
                     f"average: {gaps} points), and it favours configurations evaluated "
                     f"more often (evaluations per run: {counts}). The final accuracy has "
                     f"neither bias; `make reproduce FAIR=1` evaluates every N every "
                     f"{FAIR_EVAL_EVERY_UPDATES} updates.")
    return lines


def _post_verdict(rows, fair):
    """Do our rows match the post's: its mean inside our CI, and Welch on its summary."""
    inside, outside = [], []
    for r in rows:
        (inside if r.best_ci[0] <= r.post[0] <= r.best_ci[1] else outside).append(r)
    if not outside:
        text = ("every configuration matches: the post's mean lies inside our 95% "
                f"confidence interval for {_listing(inside)}.")
    else:
        details = "; ".join(
            f"N={r.setting.average_gradients}: ours {r.best[0]:.2f} "
            f"({'above' if r.best[0] > r.post[0] else 'below'} the post's {r.post[0]:.1f})"
            for r in outside)
        text = (f"{len(inside)} of {len(rows)} configurations match (the post's mean lies "
                "inside our 95% confidence interval"
                + (f" for {_listing(inside)}" if inside else "") + f"); {details}.")
    differ = [r for r in rows if r.post_p < ALPHA]
    text += (" Welch's test against the post's own mean and std (10 runs; it allows for "
             "the post's noise as well as ours) finds "
             + (f"a difference at the 5% level for {_listing(differ)}."
                if differ else "no difference at the 5% level for any N."))
    if fair:
        text += " (The post evaluated every 100 iterations, not on this table's cadence.)"
    return text


def machine():
    """The machine in a few words, for the record."""
    cpu = platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f
                        if line.startswith("model name")), cpu)
    except OSError:
        pass
    try:
        tf_version = importlib.metadata.version("tensorflow")
    except importlib.metadata.PackageNotFoundError:
        tf_version = "?"
    return (f"{os.cpu_count()} CPU cores ({cpu}), {platform.system()} {platform.release()}, "
            f"Python {platform.python_version()}, TensorFlow {tf_version}")


def table_document(rows, fair, scale, command, timing):
    """table.md: what made it, the table, what the columns mean, the verdict."""
    protocol = (f"every configuration evaluated every {FAIR_EVAL_EVERY_UPDATES} updates"
                if fair else f"the post's protocol, evaluated every {EVAL_EVERY} iterations")
    lines = [f"# The post's table, reproduced ({protocol})", "",
             f"Made by `{command}` on {datetime.date.today().isoformat()}, {machine()}.",
             timing, ""]
    lines += table_lines(rows)
    lines += ["",
              "Accuracies in percent on the 10,000 test images, mean ± population std over "
              "the runs (the post's convention). *best*: the best of a run's evaluations, "
              "as the post reported; *final*: the accuracy after the last update. "
              "*95% CI*: Student-t interval for our mean best (sample std). *p vs N=1*: "
              "two-sided Welch t-test of this row's runs against the N=1 row's. *s/run*: "
              "mean seconds of training plus evaluation per run (process start-up aside).",
              ""]
    lines += verdict_lines(rows, fair, scale)
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- the whole reproduction


def reproduce(results_dir, reps=10, seed=0, jobs=0, threads=0, scale=1, fair=False,
              accumulate=DEFAULT_ACCUMULATE, verbose=False, command="python reproduce.py",
              log=say):
    """Runs whatever the table still lacks, then writes and returns table.md's text.

    Raises:
      ReproduceError: bad settings, stored runs made with other settings, a failed run.
    """
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
    stored = {spec: load_run(spec) for spec in specs}
    todo = [spec for spec in specs if stored[spec] is None]
    log(f"{len(specs)} runs ({reps} per configuration): {len(specs) - len(todo)} already "
        f"done in {os.path.join(out_dir, 'runs')}, {len(todo)} to run, {jobs} at a time "
        f"with {threads} TensorFlow thread{'s' if threads > 1 else ''} each")
    start = time.perf_counter()
    if todo:
        runner = Runner(jobs, threads, tb_dir, verbose, Progress(todo, jobs, log), log)
        runner.run_all(todo)
        stored.update({spec: load_run(spec) for spec in todo})
    wall = time.perf_counter() - start

    by_setting = collections.OrderedDict()
    for spec in specs:
        by_setting.setdefault(spec.setting, []).append(spec)
    rows, reference = [], None
    for post_key, (setting, group) in zip(POST_TABLE, by_setting.items()):
        runs = [stored[spec] for spec in group]
        reference = reference or runs
        config = dict(read_document(group[0].path)["config"])
        path = os.path.join(out_dir, results.run_label(setting) + ".json")
        config.update(reps=reps, seed=seed, results=path)
        results.atomic_write_json(path, results.results_document(config, runs))
        flags = group[0].flags
        rows.append(summarize(setting, runs, reference, POST_TABLE[post_key] if scale == 1
                              else None, evaluations(setting, flags["eval-every"],
                                                     flags["eval-every-updates"])))
    timing = (f"This invocation ran {len(todo)} of the {len(specs)} runs in "
              f"{fmt_duration(wall)} of wall time, {jobs} process{'es' if jobs > 1 else ''} "
              f"at a time with {threads} thread{'s' if threads > 1 else ''} each"
              + (f"; the other {len(specs) - len(todo)} were done by an earlier invocation."
                 if len(todo) < len(specs) else "."))
    text = table_document(rows, fair, scale, command, timing)
    results.atomic_write_text(os.path.join(out_dir, "table.md"), text)
    return text


# ---------------------------------------------------------------- command line


def define_flags():
    """The driver's flags (dashed, with underscore aliases, as main.py's)."""
    def define(kind, name, default, help_text, **kwargs):
        alias = name.replace("-", "_")
        getattr(absl_flags, "DEFINE_" + kind)(
            name, default, help_text + (f" (also --{alias})" if alias != name else ""),
            **kwargs)
        if alias != name:
            absl_flags.DEFINE_alias(alias, name)

    define("integer", "reps", 10, "Runs per configuration; run r uses seed + r.", lower_bound=1)
    define("string", "results-dir", "results",
           "Where runs, per-configuration results, table.md and TensorBoard events go.")
    define("integer", "jobs", 0, "main.py processes at a time (0: one per CPU core).",
           lower_bound=0)
    define("integer", "threads", 0,
           "TensorFlow threads per process (0: the CPU cores divided among the jobs).",
           lower_bound=0)
    define("bool", "fair", False,
           f"Evaluate every configuration every {FAIR_EVAL_EVERY_UPDATES} updates, not the "
           f"post's every {EVAL_EVERY} iterations; writes under RESULTS_DIR/fair.")
    define("integer", "scale", 1,
           "Divide every configuration's updates by this (at least one), for quick tests.",
           lower_bound=1)
    define("integer", "seed", 0, "Seed of the first run of every configuration.",
           lower_bound=0)
    define("string", "accumulate", DEFAULT_ACCUMULATE,
           "main.py's --accumulate for every run; fused is the fastest and gives the same "
           "weights, bit for bit, as the post's stack.")
    define("bool", "verbose", False, "Pass --verbose on: every run's evaluation lines.")


def main(argv):
    if len(argv) > 1:
        print(f"error: unexpected arguments: {' '.join(argv[1:])}", file=sys.stderr)
        return 2
    FLAGS = absl_flags.FLAGS
    command = shlex.join(["python", os.path.basename(sys.argv[0])] + sys.argv[1:])
    try:
        text = reproduce(FLAGS.results_dir, reps=FLAGS.reps, seed=FLAGS.seed, jobs=FLAGS.jobs,
                         threads=FLAGS.threads, scale=FLAGS.scale, fair=FLAGS.fair,
                         accumulate=FLAGS.accumulate, verbose=FLAGS.verbose, command=command)
    except ReproduceError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted: finished runs are kept; the same command carries on from them",
              file=sys.stderr)
        return 130
    print()
    print(text, end="")
    return 0


def parse_flags(argv):
    try:
        return absl_flags.FLAGS(argv)
    except absl_flags.Error as e:
        print(f"error: {str(e).splitlines()[0]}", file=sys.stderr)
        sys.exit(2)


def run():
    define_flags()
    app.run(main, flags_parser=parse_flags)


if __name__ == "__main__":
    run()
