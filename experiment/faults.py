"""Fault injection for the write paths: a chosen write fails as a full disk or a lost
permission would make it fail, so that tests need neither root nor a mount.

Every file the command line and the tools write (checkpoints, windows, state.json,
results, TensorBoard events, tables, figures, BENCHMARKS, the start-up probes, the
checkpoint directory's lock) is announced to `check(path)` just before it is written.
A rule makes some of those writes raise OSError(errno) instead, naming the path:

    ERRNO:PATTERN[:FIRST[:COUNT]]

ERRNO is a name of the errno module (ENOSPC, EACCES, ENOLCK...); PATTERN an fnmatch
pattern of the absolute path (`*` also matches `/`); FIRST the first matching write to
fail (1: the first); COUNT how many fail from there (default: every later one, as a full
disk stays full). Rules come from the environment variable FAULTS_ENV, `;`-separated
(for a whole process: a subprocess test), or from `injected` (in the test's process).
Without rules, `check` does nothing.
"""

import contextlib
import dataclasses
import errno as errno_lib
import fnmatch
import os

FAULTS_ENV = "GRADIENT_AVERAGING_FAULTS"


@dataclasses.dataclass
class Rule:
    """Fail writes to paths matching `pattern` with `errno`, from the `first` matching one,
    `count` of them (None: all)."""
    errno: int
    pattern: str
    first: int = 1
    count: int = None
    seen: int = 0  # matching writes so far

    def fails(self, path):
        """Counts `path` if it matches; whether this write is one to fail."""
        if not fnmatch.fnmatchcase(path, self.pattern):
            return False
        self.seen += 1
        return self.seen >= self.first and (self.count is None
                                             or self.seen < self.first + self.count)


def parse(spec):
    """The rules of an ERRNO:PATTERN[:FIRST[:COUNT]];... string.

    Raises:
      ValueError: an unknown errno name or a malformed rule.
    """
    rules = []
    for part in filter(None, (p.strip() for p in spec.split(";"))):
        name, _, rest = part.partition(":")
        pattern, first, count = (rest.split(":") + [None, None])[:3]
        code = getattr(errno_lib, name, None)
        if not isinstance(code, int) or not pattern:
            raise ValueError(f"{FAULTS_ENV}: {part!r} is not ERRNO:PATTERN[:FIRST[:COUNT]]")
        rules.append(Rule(code, pattern, int(first or 1), int(count) if count else None))
    return rules


_injected = []  # rules of this process's `injected` blocks
_from_env = {}  # the environment's value -> its rules (their counts), parsed once


def _rules():
    spec = os.environ.get(FAULTS_ENV)
    if not spec:
        return _injected
    if spec not in _from_env:
        _from_env[spec] = parse(spec)
    return _from_env[spec] + _injected


def check(path):
    """Called just before `path` is written; raises the injected error if a rule says so.

    Every rule counts the write, so rules on one path keep their own counts.

    Raises:
      OSError: with the rule's errno, its message and `path`.
    """
    rules = _rules()
    if not rules:
        return
    path = os.path.abspath(path)
    failing = [rule for rule in rules if rule.fails(path)]
    if failing:
        code = failing[0].errno
        raise OSError(code, os.strerror(code), path)


@contextlib.contextmanager
def injected(error, pattern, first=1, count=None):
    """Within the block, writes to paths matching `pattern` fail with `error` (an errno
    name such as "ENOSPC", or its number), from the `first` matching one on, `count` of
    them (None: all). Yields the Rule, whose `seen` counts the matching writes."""
    code = getattr(errno_lib, error) if isinstance(error, str) else error
    rule = Rule(code, pattern, first, count)
    _injected.append(rule)
    try:
        yield rule
    finally:
        _injected.remove(rule)
