"""The statistics of the results: mean and spread, Student-t intervals, Welch's t-test
(Student's t from scipy.stats)."""

import collections
import math

from scipy import stats as scipy_stats

Welch = collections.namedtuple("Welch", ["t", "df", "p"])


def mean(values):
    """The arithmetic mean of a non-empty sequence."""
    return sum(values) / len(values)


def mean_std(values):
    """Mean and population standard deviation (the post's numpy default, ddof=0)."""
    n = len(values)
    if n == 0:
        return math.nan, math.nan
    mean = sum(values) / n
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / n)


def sample_variance(values):
    """Unbiased variance (ddof=1), the one t statistics use; nan below two values."""
    n = len(values)
    if n < 2:
        return math.nan
    mean = sum(values) / n
    return sum((v - mean) ** 2 for v in values) / (n - 1)


def t_cdf(t, df):
    """P(T <= t) for Student's t with `df` (> 0, not necessarily whole) degrees of freedom."""
    return float(scipy_stats.t.cdf(t, df))


def t_quantile(probability, df):
    """The t with t_cdf(t, df) == probability."""
    if not 0.0 < probability < 1.0:
        raise ValueError(f"probability must be in (0, 1), got {probability}")
    return float(scipy_stats.t.ppf(probability, df))


def confidence_interval(values, level=0.95):
    """Student-t interval for the mean of `values`: mean +/- t * s / sqrt(n), s with ddof=1.

    Returns (low, high); (nan, nan) below two values.
    """
    n = len(values)
    if n < 2:
        return math.nan, math.nan
    mean = sum(values) / n
    half = t_quantile((1.0 + level) / 2.0, n - 1) * math.sqrt(sample_variance(values) / n)
    return mean - half, mean + half


def welch_from_moments(mean1, var1, n1, mean2, var2, n2):
    """Welch's unequal-variance t-test from summary statistics (variances with ddof=1):
    Welch(t, df, p), p two-sided; all nan when either sample has fewer than two values."""
    if n1 < 2 or n2 < 2:
        return Welch(math.nan, math.nan, math.nan)
    se1, se2 = var1 / n1, var2 / n2
    if se1 + se2 == 0:  # both samples constant: the means are equal or certainly not
        same = mean1 == mean2
        return Welch(0.0 if same else math.copysign(math.inf, mean1 - mean2),
                     math.nan, 1.0 if same else 0.0)
    t = (mean1 - mean2) / math.sqrt(se1 + se2)
    df = (se1 + se2) ** 2 / (se1 ** 2 / (n1 - 1) + se2 ** 2 / (n2 - 1))
    return Welch(t, df, float(2.0 * scipy_stats.t.sf(abs(t), df)))


def welch_t_test(a, b):
    """Welch's t-test of two samples: does the mean of `a` differ from that of `b`?"""
    return welch_from_moments(sum(a) / len(a) if a else math.nan, sample_variance(a), len(a),
                              sum(b) / len(b) if b else math.nan, sample_variance(b), len(b))
