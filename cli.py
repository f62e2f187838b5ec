"""What every command of this project shares: dashed flags with aliases, one-line errors.

No TensorFlow at import, so that a tool can define its flags and reject bad input before
the slow import (import_tensorflow_quietly does it when called).
"""

import os
import sys

from absl import flags


def fail(message, code=2):
    """Bad input: one clear line on stderr and a non-zero exit, no traceback."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(code)


def parse_flags(argv, flag_values=flags.FLAGS):
    """absl's `flags_parser`: parses argv, and a bad flag becomes one `fail` line."""
    try:
        return flag_values(argv)
    except flags.Error as e:
        fail(str(e).splitlines()[0])


def define(kind, name, default, help, **kwargs):  # noqa: A002 (absl's own argument name)
    """Defines a flag and, for a dashed name, its underscore alias.

    The dashed names are the public interface (the post's `--average-gradients`); the
    alias lets `--average_gradients` work too, and the help text says so.

    Args:
      kind: the absl DEFINE_ suffix: "integer", "float", "string", "bool", "enum",
        "multi_integer", ...; an enum takes `enum_values=` among the kwargs.
      name: the public name.
      default, help: as for absl.
      **kwargs: passed to absl's DEFINE_<kind> (`lower_bound=`, `flag_values=`, ...).
    """
    # absl files a flag under the module that calls DEFINE_*; that must be our caller,
    # so that its --help section and get_flags_for_module() list the flag.
    kwargs.setdefault("module_name", sys._getframe(1).f_globals["__name__"])
    alias = name.replace("-", "_")
    if alias != name:
        help += f" (also --{alias})"
    if kind == "enum":
        flags.DEFINE_enum(name, default, kwargs.pop("enum_values"), help, **kwargs)
    else:
        getattr(flags, "DEFINE_" + kind)(name, default, help, **kwargs)
    if alias != name:
        flags.DEFINE_alias(alias, name, **{k: v for k, v in kwargs.items()
                                           if k in ("flag_values", "module_name")})


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
