"""Results files: atomic writes, checks before training, the post's result lines."""

import json
import os
import tempfile

from experiment import stats


class ResultsError(OSError):
    """A results file cannot be written or read; the message names it."""


def atomic_write_bytes(path, payload):
    """Writes `payload` to `path` through a temp file and a rename: never half-written."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=os.path.basename(path))
    try:
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp's 0600 is for temp files, not results
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _umask():
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write_text(path, text):
    atomic_write_bytes(path, text.encode())


def atomic_write_json(path, obj):
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")


def check_writable(path, flag="--results"):
    """Fails early, before any training, if `path` could not be written later.

    Raises:
      ResultsError: the directory is missing, not writable, or `path` is a directory; the
        message names `flag`, the option that gave `path`.
    """
    directory = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise ResultsError(f"{flag} {path}: is a directory")
    if not os.path.isdir(directory):
        raise ResultsError(f"{flag} {path}: directory {directory} does not exist")
    _probe(directory, f"{flag} {path}: cannot write in {directory}")


def check_directory(path, flag):
    """Creates directory `path` if needed and checks it is writable, before any training.

    Raises:
      ResultsError: naming `flag` and the reason.
    """
    _probe(path, f"{flag} {path}: cannot write there", create=True)


def _probe(directory, failure, create=False):
    """Creates (with `create`, the directory first) and removes a file in `directory`.

    Raises:
      ResultsError: `failure` and the system's reason.
    """
    try:
        if create:
            os.makedirs(directory, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-probe-")
    except OSError as e:
        raise ResultsError(f"{failure} ({e.strerror})") from None
    os.close(fd)
    os.unlink(tmp)


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
