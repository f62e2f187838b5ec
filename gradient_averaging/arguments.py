"""Checks of every path's arguments, before anything is built: a wrong one is a ValueError (a
TypeError for N of the wrong type) whose line names it, what it must be and what was given."""

import numbers

BN_STATISTICS = ("update", "mini_batch")


def check_average_gradients(value, name="average_gradients"):
    """N as a Python int >= 1 (ValueError); numpy integers pass, a bool or float is a TypeError."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int >= 1 (mini-batches per update), "
                        f"got {value!r} ({type(value).__name__})")
    if value < 1:
        raise ValueError(f"{name} must be an int >= 1 (mini-batches per update), got {value}")
    return int(value)


def check_parallel_mini_batches(value):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError("parallel_mini_batches must be an int >= 1 (mini-batches whose "
                         f"passes may run at once), got {value!r}")
    return int(value)


def _check_int(value, name, what):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name} must be {what}. Received: {name}={value!r}")
    return int(value)


def check_effective_batch(value, name="effective_batch"):
    return _check_int(value, name, "an int >= 1 (samples per update)")


def check_micro_batch_size(value, name="micro_batch_size"):
    """B as an int >= 1, or "auto" (found by find_micro_batch)."""
    if value == "auto":
        return value
    return _check_int(value, name, "'auto' or an int >= 1 (samples per mini-batch and "
                      "replica)")


def check_window(average_gradients, micro_batch_size):
    """(N, None) for N mini-batches per update, or (1, micro_batch_size) for each batch one
    update cut into mini-batches of that size (N then None or 1); else a ValueError."""
    if micro_batch_size is None:
        if average_gradients is None:
            raise ValueError("give average_gradients=N (mini-batches per update) or "
                             "micro_batch_size='auto' or B (each batch one update)")
        return check_average_gradients(average_gradients), None
    if average_gradients is not None and (isinstance(average_gradients, bool)
                                          or average_gradients != 1):
        raise ValueError(
            f"average_gradients={average_gradients!r} and micro_batch_size="
            f"{micro_batch_size!r} contradict each other: give average_gradients=N for N "
            "mini-batches per update, or micro_batch_size for each batch to be one update "
            "(its effective batch) cut into mini-batches of that size")
    return 1, check_micro_batch_size(micro_batch_size)


def check_margin(margin):
    """The budget's fraction kept free, in [0, 1), or None (device.default_margin)."""
    if margin is None:
        return None
    if isinstance(margin, bool) or not isinstance(margin, numbers.Real) or not 0 <= margin < 1:
        raise ValueError(f"margin must be a fraction of the budget in [0, 1). "
                         f"Received: margin={margin!r}")
    return float(margin)


def check_budget(budget):
    """The budget in bytes, an int >= 1, or None (the device's memory)."""
    if budget is None:
        return None
    return _check_int(budget, "budget", "the device memory to use, in bytes (an int >= 1)")


def check_bn_statistics(bn_statistics):
    """One of BN_STATISTICS: a moving-statistics step per update or per mini-batch."""
    if bn_statistics not in BN_STATISTICS:
        raise ValueError(f"bn_statistics must be one of {', '.join(BN_STATISTICS)}; "
                         f"got {bn_statistics!r}")
    return bn_statistics
