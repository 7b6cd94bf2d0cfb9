"""Checked values for the command line's flags: an out-of-range value is a usage error that names the flag.

Each function here makes an argparse ``type=``: it turns the text after the flag into a value or raises
``argparse.ArgumentTypeError``, which argparse prints as ``groundup train: error: argument --d-model: must be a
positive integer, got -3`` (exit status 2) before anything runs, in the words of the flag the user typed rather
than those of the Python parameter it ends up in.
"""

from __future__ import annotations

import argparse
import math

import torch

__all__ = ["integer", "number", "seed", "device", "SEED_MAX", "MIN_TEMPERATURE"]

SEED_MAX = 2**64 - 1
"""The largest seed a ``torch.Generator`` takes (seeds are unsigned 64-bit integers)."""

MIN_TEMPERATURE = 1e-3
"""The smallest sampling temperature accepted: below it sampling is greedy decoding in all but name (a logit gap
of 0.01 is already a factor e^10), and far below it the division overflows float32 (1e-40 gives inf and NaN)."""


def integer(minimum: int, maximum: int | None = None, *, what: str | None = None):
    """A type for an integer flag in ``[minimum, maximum]``; ``what`` describes the range in the message."""
    what = what or (f"an integer from {minimum} to {maximum}" if maximum is not None else
                    "a positive integer" if minimum == 1 else f"an integer >= {minimum}")

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None
        if value < minimum or (maximum is not None and value > maximum):
            raise argparse.ArgumentTypeError(f"must be {what}, got {value}")
        return value

    return parse


def number(low: float, high: float = math.inf, *, low_open: bool = False, high_open: bool = False,
           what: str | None = None, hint: str = ""):
    """A type for a finite number flag in the interval from ``low`` to ``high`` (open ends where asked).

    ``what`` describes the range (default: the interval), ``hint`` is added to the message (what to use instead).
    """
    if what is None:
        if math.isinf(high):
            what = f"a number {'>' if low_open else '>='} {low:g}"
        else:
            what = f"a number in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        ok = (math.isfinite(value) and (value > low if low_open else value >= low)
              and (value < high if high_open else value <= high))
        if not ok:
            raise argparse.ArgumentTypeError(f"must be {what}, got {text}{'; ' + hint if hint else ''}")
        return value

    return parse


seed = integer(0, SEED_MAX, what=f"an integer from 0 to 2**64 - 1 = {SEED_MAX}")
"""A type for ``--seed``: what ``torch.Generator.manual_seed`` takes, refused with a clear message otherwise."""


def _unavailable(device: torch.device) -> str | None:
    """Why ``device`` cannot be used here, or None when it can."""
    if device.type == "cpu":
        return None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return "no CUDA GPU is available here" + ("" if torch.version.cuda else
                                                      " (this PyTorch is a CPU-only build)")
        if device.index is not None and device.index >= torch.cuda.device_count():
            return f"there {'is' if torch.cuda.device_count() == 1 else 'are'} only {torch.cuda.device_count()} " \
                   f"CUDA GPU(s) here, numbered from 0"
        return None
    if device.type == "mps":
        mps = getattr(torch.backends, "mps", None)
        return None if mps is not None and mps.is_available() else "Apple's MPS is not available here"
    return "the book's programs run on cpu, cuda or mps"


def device(text: str) -> str:
    """A type for ``--device``: ``cpu``, ``cuda``, ``cuda:N`` or ``mps``, and only if it is present here."""
    try:
        parsed = torch.device(text)
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(f"unknown device {text!r}: use cpu, cuda, cuda:N or mps") from None
    problem = _unavailable(parsed)
    if problem:
        raise argparse.ArgumentTypeError(f"cannot use {text!r}: {problem}; use --device cpu (or leave --device out)")
    return text
