"""What every command of this project shares: settings as dashed flags, help, one-line errors.

No TensorFlow at import, so that a command parses and checks its flags (and answers
`--help`) before the slow import; import_tensorflow_quietly does it when called.

The dashed names are the public interface (the post's `--average-gradients`). Each also
answers to its underscore spelling, and a renamed flag (config.RENAMED) to its old name
with a warning: parse_flags rewrites those spellings before absl parses, so absl knows
each flag once and `--help` lists it once.
"""

import contextlib
import inspect
import os
import re
import signal
import sys

from absl import flags

from experiment import config

HELP, FULL_HELP = ("--help", "-h", "--helpshort", "-help"), ("--helpfull", "-helpfull")
_HELP_MODULES = []  # the modules that defined flags through `define_all`, for --help


def fail(message, code=2):
    """Bad input: one clear line on stderr and a non-zero exit, no traceback."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(code)


class StopSignals:
    """SIGINT and SIGTERM ask the training loop to stop after the current mini-batch.

    The loop then saves its checkpoint and the process exits 128 + the signal's number.
    A second signal ends the process at once.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.received = None
        self._previous = {}

    def __enter__(self):
        self._previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        return self

    def __exit__(self, *unused):
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def _handle(self, signum, frame):
        if self.received:
            sys.exit(128 + signum)
        self.received = signal.Signals(signum)

    def __call__(self):
        return self.received.name if self.received else None


@contextlib.contextmanager
def one_line_errors(config=None, checkpoint_dir=None, stop=None):
    """Every error a run can meet, as its one line on stderr and its exit code
    (docs/bad-input.md lists them); any other error propagates, traceback and all.

    Args:
      config: the config.Config being trained; None around the set-up before training,
        where a ValueError is the engine refusing the configuration here (exit 2) and a
        loop.Stopped a multi_worker peer lost (exit 3).
      checkpoint_dir: the run's --checkpoint-dir, which an out-of-memory line names.
      stop: the StopSignals of the training loop: a stopped run exits 128 + its signal.
    """
    try:
        yield
    except Exception as error:  # each kind is looked up; any other is raised again
        line, code = _line_and_code(error, config, checkpoint_dir, stop)
        if line is None:
            raise
        fail(line, code)


def _line_and_code(error, config, checkpoint_dir, stop):
    """one_line_errors' table: (the line, the exit code) for `error`, or (None, None)."""
    import tensorflow as tf

    from experiment import checkpoint
    from experiment import data
    from experiment import device_memory
    from experiment import loop
    from experiment import results
    from experiment import runlock
    from gradient_averaging import micro_batch

    if config is None:  # the set-up: a configuration refused here, or a worker lost
        codes = {ValueError: 2, loop.Stopped: 3}
        return next(((str(error), c) for kind, c in codes.items() if isinstance(error, kind)),
                    (None, None))
    codes = {  # the error's own text is its line
        data.DataError: 2,  # --data-dir: missing, unreadable or corrupt files
        results.ResultsError: 2,  # an output path that cannot be written
        runlock.LockError: 2,  # the checkpoint directory is another run's
        checkpoint.CheckpointError: 2,  # a checkpoint of other settings, or unreadable
        micro_batch.NothingFits: 1,  # one sample ran out of memory in training
        results.WriteError: 1,  # a full disk, a lost permission
        loop.Stopped: 128 + stop.received if stop and stop.received else 3,
    }
    code = next((c for kind, c in codes.items() if isinstance(error, kind)), None)
    if code is not None:
        return str(error), code
    if not isinstance(error, tf.errors.OpError):
        return None, None
    # The device's memory ran out (the checkpoint in force stays), or an op has no
    # deterministic kernel here.
    line = device_memory.out_of_memory(error, config.average_gradients, config.batch_size,
                                checkpoint_dir, config.effective_batch_size)
    if line is not None:
        return line, 1
    return (missing_deterministic_kernel(error) if config.deterministic else None), 2


def missing_deterministic_kernel(error):
    """The one line for an op TensorFlow cannot run deterministically here, or None.

    Under op determinism TensorFlow refuses an op that has no deterministic kernel on the
    device (many GPU kernels; XLA's max-pooling gradient anywhere) when it first runs,
    with an OpError ("A deterministic GPU implementation of ... is not available",
    "... do not yet have a deterministic XLA implementation") whose text names the node.

    Args:
      error: what training raised (a tf.errors.OpError, read as text only).
    """
    text = str(getattr(error, "message", None) or error)
    reason = next((line.strip() for line in text.splitlines()
                   if "determinis" in line.lower()), None)
    if reason is None:
        return None
    node = re.search(r"\{\{node ([^}]+)\}\}", text)
    op = f" (node {node.group(1).rsplit('/', 1)[-1]})" if node else ""
    return (f"op determinism is on and TensorFlow has no deterministic kernel here: "
            f"{reason.rstrip('.')}{op}; run with --nodeterministic to train without op "
            f"determinism (runs may then differ in their last bits)")


def define(kind, name, default, help,  # noqa: A002 (absl's name)
           lower_bound=None, upper_bound=None, enum_values=None):
    """One flag of a tool's own (absl's DEFINE_<kind> arguments), as define_all defines
    a config.Setting."""
    define_all([config.Setting(name, kind, default, help, lower=lower_bound,
                                 upper=upper_bound, choices=enum_values)],
               module=inspect.currentframe().f_back.f_globals["__name__"])


def define_all(definitions, flag_values=flags.FLAGS, module=None):
    """Defines config.Setting (with its bounds, choices and check) and config.Rule
    objects as absl flags and validators, filed under `module` (default: the caller's)
    for --help."""
    module = module or inspect.currentframe().f_back.f_globals["__name__"]
    if module == "__main__":  # absl files a script's flags under its path
        module = sys.argv[0]
    if module not in _HELP_MODULES:
        _HELP_MODULES.append(module)
    for definition in definitions:
        if isinstance(definition, config.Rule):
            flags.register_multi_flags_validator(list(definition.names), definition.predicate,
                                                 message=definition.message,
                                                 flag_values=flag_values)
        else:
            _define(definition, flag_values, module)


def _define(setting, flag_values, module):
    kwargs = dict(flag_values=flag_values, module_name=module)
    if setting.lower is not None:
        kwargs["lower_bound"] = setting.lower
    if setting.upper is not None:
        kwargs["upper_bound"] = setting.upper
    if setting.kind == "enum":
        flags.DEFINE_enum(setting.name, setting.default, list(setting.choices), setting.help,
                          **kwargs)
    elif setting.auto:
        flags.DEFINE(_IntegerOrAuto(setting.lower, setting.upper), setting.name,
                     setting.default, setting.help, serializer=flags.ArgumentSerializer(),
                     **{k: v for k, v in kwargs.items() if not k.endswith("_bound")})
    else:
        default = list(setting.default) if setting.kind == "multi_integer" else setting.default
        getattr(flags, "DEFINE_" + setting.kind)(setting.name, default, setting.help, **kwargs)
        if setting.kind in _NUMBER_PARSERS:  # absl's validators keep their own parser
            flag_values[setting.name].parser = _NUMBER_PARSERS[setting.kind](setting.lower,
                                                                              setting.upper)
    if setting.check:
        predicate, must = setting.check
        flags.register_validator(setting.name, predicate, message=f"--{setting.name} {must}",
                                 flag_values=flag_values)


class _SaysWhatItTakes:
    """For absl's number parsers: a value that is no number is answered with what the flag
    takes, in the words of absl's range check ("'abc' is not a positive integer"), not
    with Python's ("invalid literal for int() with base 10: 'abc'")."""

    def convert(self, argument):
        try:
            return super().convert(argument)
        except ValueError:
            raise ValueError(f"{argument!r} is not {self.syntactic_help}") from None


class _Integer(_SaysWhatItTakes, flags.IntegerParser):
    pass


class _Float(_SaysWhatItTakes, flags.FloatParser):
    pass


# The parser of each kind of number flag (a multi_integer's, of each of its values).
_NUMBER_PARSERS = {"integer": _Integer, "multi_integer": _Integer, "float": _Float}


class _IntegerOrAuto(_Integer):
    """An integer flag that also takes `auto` (config.AUTO: found when the run starts)."""

    def __init__(self, lower_bound=None, upper_bound=None):
        super().__init__(lower_bound, upper_bound)
        self.syntactic_help += " or auto"

    def parse(self, argument):
        if isinstance(argument, str) and argument.strip().lower() == "auto":
            return config.AUTO
        return super().parse(argument)


def parse_flags(argv, flag_values=flags.FLAGS):
    """absl's `flags_parser`: parses argv; help is printed (exit 0), a bad flag is one
    `fail` line. Underscore spellings and renamed flags are rewritten first."""
    args = _public_names(argv, flag_values)
    if any(arg in FULL_HELP for arg in _flag_args(args)):
        _print_help(flag_values, full=True)
    if any(arg in HELP for arg in _flag_args(args)):
        _print_help(flag_values, full=False)
    try:
        return flag_values(args)
    except flags.Error as e:
        fail(str(e).splitlines()[0])


def _flag_args(argv):
    """The arguments before a `--` (after it, nothing is a flag)."""
    args = list(argv[1:])
    return args[:args.index("--")] if "--" in args else args


def _public_names(argv, flag_values):
    """argv with `--a_b` as `--a-b` and a renamed flag under its new name (warned once)."""
    out, flags_done = [argv[0]], False
    for arg in argv[1:]:
        flags_done = flags_done or arg == "--"
        if flags_done or not arg.startswith("-") or arg in ("-", "--"):
            out.append(arg)
            continue
        dashes = "--" if arg.startswith("--") else "-"
        name, equals, value = arg[len(dashes):].partition("=")
        negated = name.startswith("no") and name not in flag_values
        base = name[2:] if negated else name
        public = base.replace("_", "-")
        if public in config.RENAMED:
            new = config.RENAMED[public]
            print(f"warning: --{public} was renamed --{new} (the tf.distribute strategy; "
                  f"--accumulate picks the averager)", file=sys.stderr)
            public = new
        if public != base and public in flag_values:
            arg = dashes + ("no" if negated else "") + public + equals + value
        out.append(arg)
    return out


def _print_help(flag_values, full):
    """The command's docstring, the spellings note, and its flags, each once; exit 0."""
    doc = (getattr(sys.modules["__main__"], "__doc__", None) or "").strip()
    renamed = ", ".join(f"--{old} is the old name of --{new}"
                        for old, new in config.RENAMED.items())
    print(f"{doc}\n\nEvery dashed flag also answers to its underscore spelling "
          f"(--average_gradients for --average-gradients); {renamed}.\n")
    if full:
        print(flag_values.get_help())
    else:
        print("\n".join(flag_values.module_help(module) for module in _HELP_MODULES))
        print("\n--helpfull lists absl's own flags too.")
    sys.exit(0)


def import_tensorflow_quietly():
    """Imports TensorFlow with fd 2 closed: its C++ start-up lines ignore log levels.

    Errors still surface: stderr is restored before an import failure propagates.
    """
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            try:
                import tensorflow as tf
                tf.config.list_physical_devices()  # device probing logs too
            finally:
                os.dup2(saved, 2)
    finally:
        os.close(saved)
    tf.get_logger().setLevel("ERROR")
