"""Results files: atomic writes, checks before training, the post's result lines."""

import dataclasses
import errno
import importlib.metadata
import json
import logging
import os
import platform
import tempfile

from experiment import faults
from experiment import runlock
from experiment import stats
from experiment import workers


class ResultsError(OSError):
    """A results file cannot be written or read; the message names it."""


class WriteError(OSError):
    """A file could not be written while a run went on (full disk, lost permission, a
    directory removed): the message names it, the cause, and what is kept."""


# The system's words for the causes a write most often fails with, which TensorFlow's
# errors carry inside longer messages.
_CAUSES = tuple(os.strerror(code) for code in (
    errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOENT,
    errno.ENOTDIR, errno.EISDIR, errno.EIO, errno.ENOLCK))
# A start-up probe writes this much: creating an empty file needs no space, a block does.
PROBE_BYTES = 4096


def cause(error):
    """Why a write failed, in a few words: the system's (No space left on device,
    Permission denied, No such file or directory), else the error's first line.

    Args:
      error: an OSError, or a TensorFlow error (tf.errors.OpError) or ValueError raised by
        a TensorFlow save, whose message holds the system's words.
    """
    if isinstance(error, OSError) and error.errno and error.strerror:
        return error.strerror
    text = str(error).strip()
    for words in _CAUSES:
        if words.lower() in text.lower():
            return words
    if "doesn't exist" in text or "does not exist" in text:
        return os.strerror(errno.ENOENT)
    return text.splitlines()[0] if text else type(error).__name__


def _unlink_quietly(path):
    """Removes a temp file; a failure here must not hide the error being handled."""
    try:
        os.unlink(path)
    except OSError:
        pass


def _write_temp(path, payload):
    """`payload` in a new temp file beside `path`, synced to disk; returns its path."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=os.path.basename(path))
    try:
        os.chmod(tmp, 0o666 & ~_UMASK)  # mkstemp's 0600 is for temp files, not results
        with os.fdopen(fd, "wb") as f:
            faults.check(path)
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        _unlink_quietly(tmp)
        raise
    return tmp


def atomic_write_bytes(path, payload):
    """Writes `payload` to `path` through a temp file and a rename: never half-written."""
    atomic_write_files([(path, payload)])


def atomic_write_files(items):
    """Writes files that belong together (a report and its figure), each through a temp
    file: every payload is on disk before any file is replaced, so a failed write (a full
    disk) leaves the old set whole, never a new one beside an old one. The renames come
    last and need no space.

    Args:
      items: (path, bytes) pairs.
    """
    temps = []
    try:
        for path, payload in items:
            temps.append((_write_temp(path, payload), path))
        for tmp, path in temps:
            os.replace(tmp, path)
    except BaseException:
        for tmp, _ in temps:
            _unlink_quietly(tmp)
        raise


def _umask():
    mask = os.umask(0)
    os.umask(mask)
    return mask


# Read once, at import: setting the umask to read it is not safe beside other threads.
_UMASK = _umask()


def atomic_write_text(path, text):
    atomic_write_bytes(path, text.encode())


def atomic_write_json(path, obj):
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")


def check_writable(path, flag="--results"):
    """Fails early, before any training, if `path` could not be written later.

    Raises:
      ResultsError: the directory is missing, not writable or full, or `path` is a
        directory; the message names `flag`, the option that gave `path`.
    """
    directory = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise ResultsError(f"{flag} {path}: is a directory")
    if not os.path.isdir(directory):
        raise ResultsError(f"{flag} {path}: directory {directory} does not exist")
    _probe(directory, f"{flag} {path}: cannot write in {directory}")


def check_directory(path, flag):
    """Creates directory `path` if needed and checks a little can be written there, before
    any training.

    Raises:
      ResultsError: naming `flag` and the reason; its errno is the system's.
    """
    _probe(path, f"{flag} {path}: cannot write there", create=True)


def check_outputs(config, runs, held):
    """Checks, before any training, every directory the runs will write, and locks the
    checkpoint directory for this process.

    A full disk under --logdir is a warning, not an error (events are a run's curves,
    not its results): the runs go on without events. Every other failure is an error.

    Args:
      config, runs: the config.Config and config.Runs to train.
      held: a contextlib.ExitStack that holds the lock (runlock.DirectoryLock) until it
        closes.

    Under multi_worker, a worker other than the chief writes no results or events (the
    chief does), and locks and checks only its own directory under the checkpoint
    directory (workers.own_directory), whose runs it reads.

    Returns:
      `runs`, without its logdir where that is full (without its results and logdir on
      a worker other than the chief).

    Raises:
      ResultsError: a path that cannot be written; runlock.LockError: the checkpoint
        directory is in use by another run, or cannot be locked.
    """
    worker = workers.index(config)
    if worker:
        runs = dataclasses.replace(runs, results_path=None, logdir=None)
        if runs.checkpoint_dir:
            own = workers.own_directory(runs.checkpoint_dir, worker)
            check_directory(own, "--checkpoint-dir")
            held.enter_context(runlock.DirectoryLock(own))
        return runs
    if runs.results_path:
        check_writable(runs.results_path)
    seeds = range(runs.seed, runs.seed + runs.reps)
    if runs.logdir:
        try:
            check_directory(runs.logdir, "--logdir")
            for seed in seeds:
                check_directory(event_dir(runs.logdir, config, seed), "--logdir")
        except ResultsError as e:
            if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            logging.warning("%s; the runs go on without TensorBoard events", e)
            runs = dataclasses.replace(runs, logdir=None)
    if runs.checkpoint_dir:
        check_directory(runs.checkpoint_dir, "--checkpoint-dir")
        held.enter_context(runlock.DirectoryLock(runs.checkpoint_dir))
        for rep in range(runs.reps):  # the directories really written, under the lock
            check_directory(os.path.join(runs.checkpoint_dir, f"rep-{rep}"),
                            "--checkpoint-dir")
    return runs


def _probe(directory, failure, create=False):
    """Writes PROBE_BYTES to a new file in `directory` (with `create`, made first) and
    removes it. An early warning, not a guarantee: it proves a little space, not that a
    checkpoint fits.

    Raises:
      ResultsError: `failure` and the system's reason.
    """
    try:
        if create:
            os.makedirs(directory, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-probe-")
    except OSError as e:
        raise _probe_error(failure, e) from None
    try:
        with os.fdopen(fd, "wb") as f:
            faults.check(tmp)
            f.write(b"\0" * PROBE_BYTES)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        raise _probe_error(failure, e) from None
    finally:
        _unlink_quietly(tmp)


def _probe_error(failure, error):
    refused = ResultsError(f"{failure} ({cause(error)})")
    refused.errno = error.errno
    return refused


def run_label(config):
    """A configuration's short name for files and TensorBoard runs: n5-b20-it5000.

    Args:
      config: anything with average_gradients, batch_size and iterations attributes.
    """
    return f"n{config.average_gradients}-b{config.batch_size}-it{config.iterations}"


def event_dir(logdir, config, seed):
    """Where one run's TensorBoard events go: LOGDIR/<config>/seed<S>; None without LOGDIR."""
    return os.path.join(logdir, run_label(config), f"seed{seed}") if logdir else None


def fmt_accuracy(percent):
    """An accuracy in percent as the post printed it (95.4), to two decimals at most."""
    return f"{round(percent, 2):g}"


def run_line(run):
    """The post's per-run line, with the final accuracy beside it."""
    return (f"Training finished. Best accuracy: {fmt_accuracy(run['best_accuracy'])} at "
            f"iteration {run['best_iteration']}. "
            f"Final accuracy: {fmt_accuracy(run['final_accuracy'])}.")


def summary_line(best_accuracies):
    """The post's closing line: mean and population std, 3 significant digits."""
    mean, std = stats.mean_std(best_accuracies)
    return f"mean accuracy ({len(best_accuracies)} runs): {mean:.3g} +/- {std:.3g}"


def results_document(config, runs):
    """The results JSON: the full config beside every run and the summary."""
    mean, std = stats.mean_std([r["best_accuracy"] for r in runs])
    return {"config": dict(config), "runs": list(runs),
            "mean_accuracy": mean, "std_accuracy": std}


def machine():
    """The machine and the software in a few words, for the record beside the numbers (the
    versions read without importing the packages: TensorFlow is slow)."""
    def version(package):
        try:
            return importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            return "?"

    cpu = platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f
                        if line.startswith("model name")), cpu)
    except OSError:
        pass
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / (1 << 30)
    return (f"{os.cpu_count()} cores ({cpu}), {memory:.1f} GiB RAM, {platform.system()} "
            f"{platform.release()}; Python {platform.python_version()}, TensorFlow "
            f"{version('tensorflow')}, Keras {version('keras')}, numpy {version('numpy')}")
