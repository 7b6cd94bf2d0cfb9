"""``python -m groundup.bench`` / ``make bench``: the package's performance figures, measured in one run.

One submodule per section (``matmul``, ``tokenizers``, ``attention``, ...), each with a ``run()`` that returns
a list of :class:`Row`. Times are medians of several repetitions. A comparison times its sides alternately, round
by round (:func:`alternate`), and reports the median of the per-round ratios with its quartiles
(:func:`ratio_note`): a busy neighbour then slows both sides of a round alike, where timing one side after the
other would charge the whole slowdown to one of them. Tests never assert times.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class Row:
    """One line of the report: what was measured, the median, and an optional comparison."""

    name: str
    value: float
    unit: str
    note: str = ""


def median_time(fn: Callable[[], object], *, repeat: int = 5, warmup: int = 1) -> float:
    """Median wall-clock seconds of ``fn()`` over ``repeat`` calls, after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def alternate(fns: dict[str, Callable[[], object]], *, repeat: int = 5, warmup: int = 1,
              clock: Callable[[], float] = time.perf_counter) -> dict[str, list[float]]:
    """Seconds of each function in each of ``repeat`` rounds; every round calls every function once.

    The order within a round turns over from one round to the next (a b, b a, ...), so neither side always
    runs right after the other (warm caches, a neighbour's burst). ``clock``: wall-clock time by default;
    ``time.process_time`` counts this process's CPU seconds, which other processes inflate far less (only
    meaningful when both sides run on one thread).
    """
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    order = list(fns)
    for r in range(repeat):
        for name in order if r % 2 == 0 else order[::-1]:
            start = clock()
            fns[name]()
            times[name].append(clock() - start)
    return times


def ratio_quartiles(a: list[float], b: list[float]) -> tuple[float, float, float]:
    """Median and quartiles (25 %, 75 %) of the per-round ratios ``a[i] / b[i]``."""
    ratios = sorted(x / y for x, y in zip(a, b, strict=True))
    if len(ratios) == 1:
        return ratios[0], ratios[0], ratios[0]
    q1, q2, q3 = statistics.quantiles(ratios, n=4, method="inclusive")
    return q2, q1, q3


def ratio_note(a: list[float], b: list[float], versus: str, target: str = "") -> str:
    """``"0.93x versus (quartiles 0.90-0.97, 5 rounds)"``, plus the target if given."""
    median, q1, q3 = ratio_quartiles(a, b)
    note = f"{median:.2f}x {versus} (quartiles {q1:.2f}-{q3:.2f}, {len(a)} alternating rounds)"
    return f"{note}; {target}" if target else note


def ratio_row(name: str, a: list[float], b: list[float], versus: str, target: str = "") -> Row:
    """A row whose value is the median per-round ratio ``a / b``."""
    return Row(name, ratio_quartiles(a, b)[0], "x", ratio_note(a, b, versus, target))


def format_rows(title: str, rows: list[Row]) -> str:
    """The section as aligned text."""
    width = max((len(r.name) for r in rows), default=0)
    lines = [title, "-" * len(title)]
    for r in rows:
        lines.append(f"{r.name:<{width}}  {r.value:>12.4g} {r.unit:<10} {r.note}".rstrip())
    return "\n".join(lines)
