"""Results files and their statistics: atomic JSON, the post's summary line."""

import json
import math
import os
import tempfile


class ResultsError(OSError):
    """A results file cannot be written or read; the message names it."""


def atomic_write_text(path, text):
    """Writes `text` to `path` through a temp file and a rename: never half-written."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=os.path.basename(path))
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_write_json(path, obj):
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")


def check_writable(path):
    """Fails early, before any training, if `path` could not be written later.

    Raises:
      ResultsError: the directory is missing, not writable, or `path` is a directory.
    """
    directory = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise ResultsError(f"--results {path}: is a directory")
    if not os.path.isdir(directory):
        raise ResultsError(f"--results {path}: directory {directory} does not exist")
    try:
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-probe-")
    except OSError as e:
        raise ResultsError(f"--results {path}: cannot write in {directory} ({e.strerror})") \
            from None
    os.close(fd)
    os.unlink(tmp)


def mean_std(values):
    """Mean and population standard deviation (the post's numpy default, ddof=0)."""
    n = len(values)
    if n == 0:
        return math.nan, math.nan
    mean = sum(values) / n
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / n)


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
    mean, std = mean_std(best_accuracies)
    return f"mean accuracy ({len(best_accuracies)} runs): {mean:.3g} +/- {std:.3g}"


def results_document(config, runs):
    """The results JSON: the full config beside every run and the summary."""
    mean, std = mean_std([r["best_accuracy"] for r in runs])
    return {"config": dict(config), "runs": list(runs),
            "mean_accuracy": mean, "std_accuracy": std}
