"""How far a score can be trusted (chapter 13): an interval for a proportion, and a paired test of two systems.

    lo, hi = wilson_interval(35, 50)                 # 95 % Wilson score interval of 35 correct out of 50
    test = mcnemar_test(a_correct, b_correct)        # two systems on the same questions: exact McNemar test
    test.p_value, test.a_only, test.b_only

An exact-match score of ``k`` correct out of ``n`` questions is an estimate of the probability ``p`` that the
system answers a question of this kind correctly. :func:`wilson_interval` is the interval of Wilson (1927): the
``p`` for which the observed ``k / n`` lies within ``z`` standard errors ``sqrt(p (1 - p) / n)`` of ``p``, which
unlike the textbook ``k/n +- z sqrt(k/n (1 - k/n) / n)`` keeps its coverage near 0 and 1 (a score of 0/50 has the
interval [0, 7.1 %], not [0, 0]) (Newcombe, 1998).

Two systems scored on the *same* questions are compared question by question, not by their two intervals:
only the questions on which they disagree (``a_only``: A right and B wrong; ``b_only``: the reverse) carry
information about which is better. Under the hypothesis that both are equally good each disagreement goes
either way with probability 1/2, so ``a_only`` is Binomial(``a_only + b_only``, 1/2): :func:`mcnemar_test` gives
its exact two-sided p-value (McNemar, 1947, in its exact binomial form), or the chi-square approximation with
continuity correction on request.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from statistics import NormalDist

__all__ = ["wilson_interval", "McNemarResult", "mcnemar_test"]


def _count(name: str, value, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def wilson_interval(correct: int, n: int, *, confidence: float = 0.95) -> tuple[float, float]:
    """The Wilson score interval ``(lo, hi)`` for a proportion, from ``correct`` successes out of ``n``.

    With ``z`` the two-sided normal quantile of ``confidence`` (1.959964 for 95 %) and ``p_hat = correct / n``::

        centre    = (p_hat + z^2 / (2 n)) / (1 + z^2 / n)
        half      = z / (1 + z^2 / n) * sqrt(p_hat (1 - p_hat) / n + z^2 / (4 n^2))
        (lo, hi)  = (centre - half, centre + half)

    the roots in ``p`` of ``(p_hat - p)^2 = z^2 p (1 - p) / n``. Examples (Newcombe, 1998, Table I): 0 of 20 gives
    (0, 0.1611), 1 of 29 (0.0061, 0.1718), 81 of 263 (0.2553, 0.3662). The ends are clipped to [0, 1] (they leave
    it only by rounding).
    """
    n = _count("n", n, minimum=1)
    correct = _count("correct", correct)
    if correct > n:
        raise ValueError(f"correct must be at most n = {n}, got {correct}")
    if isinstance(confidence, bool) or not isinstance(confidence, numbers.Real) or not 0 < confidence < 1:
        raise ValueError(f"confidence must be a number in (0, 1), e.g. 0.95, got {confidence!r}")
    z = NormalDist().inv_cdf(0.5 + confidence / 2)
    p_hat = correct / n
    denominator = 1 + z * z / n
    centre = (p_hat + z * z / (2 * n)) / denominator
    half = z / denominator * math.sqrt(p_hat * (1 - p_hat) / n + z * z / (4 * n * n))
    return max(0.0, centre - half), min(1.0, centre + half)


@dataclass(frozen=True)
class McNemarResult:
    """A paired comparison of systems A and B on the same ``n`` questions.

    ``a_only``: questions A got right and B wrong; ``b_only``: the reverse; ``both`` and ``neither`` the rest.
    ``p_value``: two-sided, for the hypothesis that A and B are equally often right. ``exact``: whether it is the
    exact binomial p-value (else the chi-square approximation, whose ``statistic`` is then set)."""

    a_only: int
    b_only: int
    both: int
    neither: int
    p_value: float
    exact: bool
    statistic: float | None = None

    @property
    def n(self) -> int:
        return self.a_only + self.b_only + self.both + self.neither

    @property
    def difference(self) -> float:
        """A's accuracy minus B's: ``(a_only - b_only) / n``."""
        return (self.a_only - self.b_only) / self.n


def _flags(name: str, values) -> list[bool]:
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise TypeError(f"{name} must be a sequence of booleans (one per question), got {type(values).__name__}")
    out = []
    for i, v in enumerate(values):
        if not isinstance(v, (bool, int)) or v not in (0, 1):
            raise TypeError(f"{name}[{i}] must be True or False (or 1 or 0), got {v!r}")
        out.append(bool(v))
    return out


def mcnemar_test(a_correct, b_correct, *, exact: bool = True) -> McNemarResult:
    """McNemar's paired test of systems A and B from their per-question correctness (same questions, same order).

    With ``b = a_only`` and ``c = b_only`` (the discordant questions) and ``m = b + c``:

    * ``exact=True`` (default, valid for any counts): ``p = min(1, 2 P(X <= min(b, c)))`` for ``X ~
      Binomial(m, 1/2)``, computed in exact rational arithmetic (``p = 1`` when ``m = 0``). For ``b = 1, c = 7``:
      ``2 (1 + 8) / 2^8 = 0.0703125``.
    * ``exact=False``: the chi-square approximation with continuity correction, ``statistic = (|b - c| - 1)^2 /
      m`` (0 when ``|b - c| <= 1``) and ``p = P(chi^2_1 > statistic) = erfc(sqrt(statistic / 2))``; it needs
      ``m`` of about 25 or more to be close to the exact value.
    """
    a = _flags("a_correct", a_correct)
    b = _flags("b_correct", b_correct)
    if len(a) != len(b):
        raise ValueError(f"a_correct and b_correct must score the same questions, got {len(a)} and {len(b)} values")
    if not a:
        raise ValueError("a_correct and b_correct are empty: give one value per question")
    if not isinstance(exact, bool):
        raise TypeError(f"exact must be True or False, got {exact!r}")
    a_only = sum(x and not y for x, y in zip(a, b))
    b_only = sum(y and not x for x, y in zip(a, b))
    both = sum(x and y for x, y in zip(a, b))
    neither = len(a) - a_only - b_only - both
    m = a_only + b_only
    if exact:
        tail = sum(math.comb(m, i) for i in range(min(a_only, b_only) + 1))
        p = float(min(Fraction(1), Fraction(2 * tail, 2 ** m)))
        return McNemarResult(a_only, b_only, both, neither, p, True)
    statistic = 0.0 if m == 0 else max(abs(a_only - b_only) - 1, 0) ** 2 / m
    return McNemarResult(a_only, b_only, both, neither, math.erfc(math.sqrt(statistic / 2)), False, statistic)
