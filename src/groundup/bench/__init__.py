"""``python -m groundup.bench`` / ``make bench``: the package's performance figures, measured in one run.

One submodule per section (``matmul``, ``tokenizers``, ``attention``, ...), each with a ``run()`` that returns
a list of :class:`Row`. Times are medians of several repetitions; comparisons are ratios measured in the same
run, because this kind of machine is shared and noisy. Tests never assert times.
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


def format_rows(title: str, rows: list[Row]) -> str:
    """The section as aligned text."""
    width = max((len(r.name) for r in rows), default=0)
    lines = [title, "-" * len(title)]
    for r in rows:
        lines.append(f"{r.name:<{width}}  {r.value:>12.4g} {r.unit:<10} {r.note}".rstrip())
    return "\n".join(lines)
