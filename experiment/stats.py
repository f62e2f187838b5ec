"""The statistics of the results: mean and spread, Student-t intervals, Welch's t-test.

No scipy: the table's confidence intervals and Welch t-tests need Student's t
distribution; its CDF is a regularized incomplete beta function, evaluated here by a
continued fraction.
"""

import collections
import math

BETA_EPSILON = 1e-15
BETA_MAX_TERMS = 500

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


def _beta_fraction(a, b, x):
    """The continued fraction of I_x(a, b), by the modified Lentz method."""
    tiny = 1e-300

    def clamp(v):
        return v if abs(v) > tiny else tiny

    c, d = 1.0, 1.0 / clamp(1.0 - (a + b) * x / (a + 1.0))
    fraction = d
    for m in range(1, BETA_MAX_TERMS + 1):
        for numerator in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                          -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1.0 / clamp(1.0 + numerator * d)
            c = clamp(1.0 + numerator / c)
            fraction *= d * c
        if abs(d * c - 1.0) < BETA_EPSILON:
            return fraction
    raise ArithmeticError(f"incomplete beta: no convergence for a={a}, b={b}, x={x}")


def regularized_incomplete_beta(a, b, x):
    """I_x(a, b) for a, b > 0 and 0 <= x <= 1."""
    if not 0.0 <= x <= 1.0:
        raise ValueError(f"x must be in [0, 1], got {x}")
    if x in (0.0, 1.0):
        return x
    log_front = (math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b)
                 + a * math.log(x) + b * math.log1p(-x))
    # The fraction converges fast only below the mean of the beta distribution.
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(log_front) * _beta_fraction(a, b, x) / a
    return 1.0 - math.exp(log_front) * _beta_fraction(b, a, 1.0 - x) / b


def t_cdf(t, df):
    """P(T <= t) for Student's t with `df` (> 0, not necessarily whole) degrees of freedom."""
    if math.isinf(t):
        return 1.0 if t > 0 else 0.0
    tail = 0.5 * regularized_incomplete_beta(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t > 0 else tail


def t_quantile(probability, df):
    """The t with t_cdf(t, df) == probability, by bisection (monotone, so it cannot miss)."""
    if not 0.0 < probability < 1.0:
        raise ValueError(f"probability must be in (0, 1), got {probability}")
    if probability < 0.5:
        return -t_quantile(1.0 - probability, df)
    low, high = 0.0, 1.0
    while t_cdf(high, df) < probability:
        low, high = high, high * 2.0
    for _ in range(200):
        middle = (low + high) / 2.0
        if middle in (low, high):
            break
        low, high = (middle, high) if t_cdf(middle, df) < probability else (low, middle)
    return (low + high) / 2.0


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
    """Welch's unequal-variance t-test from summary statistics (variances with ddof=1).

    Returns:
      Welch(t, df, p): p is two-sided; all nan when either sample has fewer than two values.
    """
    if n1 < 2 or n2 < 2:
        return Welch(math.nan, math.nan, math.nan)
    se1, se2 = var1 / n1, var2 / n2
    if se1 + se2 == 0:  # both samples constant: the means are equal or certainly not
        same = mean1 == mean2
        return Welch(0.0 if same else math.copysign(math.inf, mean1 - mean2),
                     math.nan, 1.0 if same else 0.0)
    t = (mean1 - mean2) / math.sqrt(se1 + se2)
    df = (se1 + se2) ** 2 / (se1 ** 2 / (n1 - 1) + se2 ** 2 / (n2 - 1))
    p = regularized_incomplete_beta(df / 2.0, 0.5, df / (df + t * t))
    return Welch(t, df, p)


def welch_t_test(a, b):
    """Welch's t-test of two samples: does the mean of `a` differ from that of `b`?"""
    return welch_from_moments(sum(a) / len(a) if a else math.nan, sample_variance(a), len(a),
                              sum(b) / len(b) if b else math.nan, sample_variance(b), len(b))
