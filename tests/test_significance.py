"""groundup.significance: the Wilson interval against published values and its defining equation, McNemar's test
against binomial tail probabilities worked by hand (and statsmodels/scipy when installed)."""

import math
import random
from statistics import NormalDist

import pytest

from groundup.significance import McNemarResult, mcnemar_test, wilson_interval

Z95 = NormalDist().inv_cdf(0.975)


@pytest.mark.parametrize("correct, n, lo, hi", [(0, 20, 0.0, 0.1611), (1, 29, 0.0061, 0.1718),
                                                (81, 263, 0.2553, 0.3662), (15, 148, 0.0624, 0.1605)])
def test_wilson_interval_matches_newcombe_1998(correct, n, lo, hi):
    got = wilson_interval(correct, n)
    assert got == pytest.approx((lo, hi), abs=6e-5)


def test_wilson_interval_is_the_root_pair_of_its_equation():
    for correct, n in [(0, 50), (35, 50), (50, 50), (693, 1000), (1, 2)]:
        p_hat = correct / n
        lo, hi = wilson_interval(correct, n)
        assert 0 <= lo <= p_hat <= hi <= 1
        for p in (lo, hi):  # (p_hat - p)^2 = z^2 p (1 - p) / n
            assert (p_hat - p) ** 2 == pytest.approx(Z95 ** 2 * p * (1 - p) / n, abs=1e-12)
        assert wilson_interval(n - correct, n) == pytest.approx((1 - hi, 1 - lo), abs=1e-12)
    assert wilson_interval(0, 50)[1] == pytest.approx(Z95 ** 2 / (50 + Z95 ** 2), abs=1e-12)  # 0.0713
    lo95, hi95 = wilson_interval(35, 50)
    lo99, hi99 = wilson_interval(35, 50, confidence=0.99)
    assert lo99 < lo95 and hi99 > hi95


def test_wilson_interval_against_statsmodels():
    proportion = pytest.importorskip("statsmodels.stats.proportion")
    for correct, n in [(0, 50), (35, 50), (693, 1000), (999, 1000)]:
        assert wilson_interval(correct, n) == pytest.approx(
            proportion.proportion_confint(correct, n, alpha=0.05, method="wilson"), abs=1e-12)


@pytest.mark.parametrize("args, message", [((3, 2), "at most n"), ((-1, 5), "correct"), ((1, 0), "n must"),
                                           ((True, 5), "correct"), ((1.5, 5), "correct")])
def test_wilson_interval_refuses_bad_counts(args, message):
    with pytest.raises(ValueError, match=message):
        wilson_interval(*args)
    with pytest.raises(ValueError, match="confidence"):
        wilson_interval(1, 5, confidence=1.0)


def _pairs(a_only, b_only, both, neither):
    a = [True] * a_only + [False] * b_only + [True] * both + [False] * neither
    b = [False] * a_only + [True] * b_only + [True] * both + [False] * neither
    return a, b


@pytest.mark.parametrize("a_only, b_only, p", [(1, 7, 18 / 256), (7, 1, 18 / 256), (0, 5, 2 / 32), (0, 6, 2 / 64),
                                               (3, 3, 1.0), (0, 0, 1.0), (2, 3, 1.0)])
def test_exact_mcnemar_by_hand(a_only, b_only, p):
    result = mcnemar_test(*_pairs(a_only, b_only, 4, 5))
    assert isinstance(result, McNemarResult) and result.exact and result.statistic is None
    assert (result.a_only, result.b_only, result.both, result.neither, result.n) == (a_only, b_only, 4, 5,
                                                                                   a_only + b_only + 9)
    assert result.p_value == pytest.approx(p, rel=1e-15)
    assert result.difference == pytest.approx((a_only - b_only) / result.n)


def test_exact_mcnemar_is_the_binomial_tail_and_ignores_agreements():
    rng = random.Random(0)
    for _ in range(20):
        b, c = rng.randrange(40), rng.randrange(40)
        m = b + c
        tail = sum(math.comb(m, i) for i in range(min(b, c) + 1)) / 2 ** m
        p = mcnemar_test(*_pairs(b, c, rng.randrange(9), rng.randrange(9))).p_value
        assert p == pytest.approx(min(1.0, 2 * tail), rel=1e-12)
        assert p == mcnemar_test(*_pairs(b, c, 0, 0)).p_value  # only the discordant questions count


def test_exact_mcnemar_against_scipy():
    stats = pytest.importorskip("scipy.stats")
    for b, c in [(1, 7), (12, 30), (100, 140)]:
        assert mcnemar_test(*_pairs(b, c, 3, 3)).p_value == pytest.approx(
            stats.binomtest(b, b + c, 0.5).pvalue, rel=1e-9)


def test_chi_square_mcnemar_with_continuity_correction():
    result = mcnemar_test(*_pairs(10, 25, 50, 15), exact=False)
    assert not result.exact and result.statistic == pytest.approx(14 ** 2 / 35)  # (|10 - 25| - 1)^2 / 35 = 5.6
    assert result.p_value == pytest.approx(0.017961, abs=2e-6)  # P(chi^2_1 > 5.6)
    # the approximation approaches the exact test for many discordant questions
    exact = mcnemar_test(*_pairs(200, 260, 0, 0)).p_value
    assert mcnemar_test(*_pairs(200, 260, 0, 0), exact=False).p_value == pytest.approx(exact, rel=0.05)
    assert mcnemar_test(*_pairs(0, 0, 3, 3), exact=False).p_value == 1.0


def test_mcnemar_refuses_bad_input():
    with pytest.raises(ValueError, match="same questions"):
        mcnemar_test([True, False], [True])
    with pytest.raises(ValueError, match="empty"):
        mcnemar_test([], [])
    with pytest.raises(TypeError, match=r"b_correct\[1\]"):
        mcnemar_test([True, False], [True, 2])
    with pytest.raises(TypeError, match="sequence"):
        mcnemar_test("TF", "TT")
    assert mcnemar_test([1, 0], [0, 0]).a_only == 1
