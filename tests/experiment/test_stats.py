"""stats.py against values derived here by other means: closed forms of Student's t for
whole degrees of freedom, Simpson's rule on its density, textbook examples."""

import math

import pytest

from experiment import stats


def t_density(x, df):
    return (math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2))
            / math.sqrt(df * math.pi) * (1 + x * x / df) ** (-(df + 1) / 2))


def two_sided_p_by_simpson(t, df, steps=20000):
    """1 - 2 * (integral of the density from 0 to |t|): no incomplete beta involved."""
    h = abs(t) / steps
    total = t_density(0, df) + t_density(abs(t), df)
    total += sum((4 if k % 2 else 2) * t_density(k * h, df) for k in range(1, steps))
    return 1 - 2 * total * h / 3


def test_mean_and_population_std():
    assert stats.mean_std([1, 2, 3, 4]) == (2.5, math.sqrt(1.25))
    assert stats.sample_variance([1, 2, 3, 4]) == pytest.approx(5 / 3)


def test_welch_equal_variances_against_closed_form():
    # Sample variances 5/3 each, n = 4: t = -2 / sqrt(5/6), df = 2n - 2 = 6 exactly.
    # For even df the two-sided p is (1 - |t|/sqrt(df+t^2) * sum_k C(2k,k)/4^k (1+t^2/df)^-k),
    # here 1 - (2/3)(1 + 5/18 + 25/216) = 23/324.
    welch = stats.welch_t_test([1, 2, 3, 4], [3, 4, 5, 6])
    assert welch.t == pytest.approx(-2 / math.sqrt(5 / 6), rel=1e-12)
    assert welch.df == pytest.approx(6, rel=1e-12)
    assert welch.p == pytest.approx(23 / 324, rel=1e-10)


def test_welch_textbook_example_against_integration():
    # Welch's test, unequal variances, fractional df (Wikipedia's first example:
    # t = -2.46, df = 24.99, p = 0.021).
    a = [27.5, 21.0, 19.0, 23.6, 17.0, 17.9, 16.9, 20.1, 21.9, 22.6, 23.1, 19.6, 19.0, 21.7,
         21.4]
    b = [27.1, 22.0, 20.8, 23.4, 23.4, 23.5, 25.8, 22.0, 24.8, 20.2, 21.9, 22.1, 22.9, 20.5,
         24.4]
    ma, mb = sum(a) / 15, sum(b) / 15
    va = sum((x - ma) ** 2 for x in a) / 14
    vb = sum((x - mb) ** 2 for x in b) / 14
    t = (ma - mb) / math.sqrt(va / 15 + vb / 15)
    df = (va / 15 + vb / 15) ** 2 / ((va / 15) ** 2 / 14 + (vb / 15) ** 2 / 14)
    welch = stats.welch_t_test(a, b)
    assert (round(welch.t, 2), round(welch.df, 2), round(welch.p, 3)) == (-2.46, 24.99, 0.021)
    assert welch.t == pytest.approx(t, rel=1e-12)
    assert welch.df == pytest.approx(df, rel=1e-12)
    assert welch.p == pytest.approx(two_sided_p_by_simpson(t, df), rel=1e-9)


@pytest.mark.parametrize("t", [-3.5, -0.4, 0.0, 1.3, 12.0])
def test_t_cdf_against_closed_forms(t):
    assert stats.t_cdf(t, 1) == pytest.approx(0.5 + math.atan(t) / math.pi, abs=1e-13)
    assert stats.t_cdf(t, 2) == pytest.approx(0.5 + t / (2 * math.sqrt(2 + t * t)),
                                                abs=1e-13)
    normal = 0.5 * (1 + math.erf(t / math.sqrt(2)))
    assert stats.t_cdf(t, 1e7) == pytest.approx(normal, abs=1e-6)


def test_confidence_intervals_by_hand():
    # n = 2: df = 1, the Cauchy quantile tan(0.475 pi); s = sqrt(2), s / sqrt(n) = 1.
    low, high = stats.confidence_interval([94.0, 96.0])
    q = math.tan(0.475 * math.pi)
    assert (low, high) == (pytest.approx(95 - q), pytest.approx(95 + q))
    # n = 3: df = 2, quantile 0.95 / sqrt(2 * 0.975 * 0.025); s = 0.1.
    q2 = 0.95 / math.sqrt(2 * 0.975 * 0.025)
    low, high = stats.confidence_interval([94.9, 95.0, 95.1])
    assert high - 95.0 == pytest.approx(q2 * 0.1 / math.sqrt(3), rel=1e-9)
    assert 95.0 - low == pytest.approx(q2 * 0.1 / math.sqrt(3), rel=1e-9)
    assert round(stats.t_quantile(0.975, 9), 3) == 2.262  # the printed tables' value
    assert math.isnan(stats.confidence_interval([95.0])[0])
