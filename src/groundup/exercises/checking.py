"""The small toolkit every chapter's checkers are written with.

A checker is a function ``check_<name>(fn)`` that hands ``run_checks`` a title and a function of no
arguments that exercises ``fn`` and raises :class:`Mismatch` (through :func:`expect`, :func:`expect_close` or
:func:`expect_tensor`) at the first wrong answer. ``run_checks`` turns the outcome into a printed verdict and
returns a :class:`Verdict`, true when the reader's function passed.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class Mismatch(AssertionError):
    """A wrong answer: ``what`` says what was tested and what came back, ``hint`` how to fix it."""

    def __init__(self, what: str, hint: str = ""):
        super().__init__(what)
        self.what = what
        self.hint = hint


def expect(condition: bool, what: str, hint: str = "") -> None:
    """Raise :class:`Mismatch` with ``what`` and ``hint`` unless ``condition`` holds."""
    if not condition:
        raise Mismatch(what, hint)


def expect_tensor(value, call: str, hint: str = "Return a torch.Tensor.") -> torch.Tensor:
    """Raise :class:`Mismatch` unless ``call`` (shown to the reader) returned a tensor; return it."""
    expect(isinstance(value, torch.Tensor), f"{call} returned a {type(value).__name__}", hint)
    return value


def _as_float_tensor(x) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x.detach().to(torch.float64)
    return torch.as_tensor(x, dtype=torch.float64)


def expect_close(got, expected, what: str, hint: str = "", *, rtol: float = 1e-4, atol: float = 1e-6) -> None:
    """Check that ``got`` equals ``expected`` (numbers or tensors) within tolerance; shape must match."""
    try:
        g = _as_float_tensor(got)
    except (TypeError, ValueError, RuntimeError):
        raise Mismatch(f"{what}: expected a number or tensor, got {type(got).__name__}", hint) from None
    e = _as_float_tensor(expected)
    if g.shape != e.shape:
        raise Mismatch(f"{what}: expected shape {tuple(e.shape)}, got {tuple(g.shape)}", hint)
    if not torch.allclose(g, e, rtol=rtol, atol=atol, equal_nan=False):
        if g.numel() == 1:
            detail = f"expected {e.item():.6g}, got {g.item():.6g}"
        else:
            worst = (g - e).abs().max().item()
            detail = f"largest difference from the expected values is {worst:.3g}"
        raise Mismatch(f"{what}: {detail}", hint)


class Verdict:
    """What a checker returns: true when the reader's function passed.

    The checker has already printed the verdict, so in a notebook a ``Verdict`` displays nothing (a bare
    ``True``/``False`` under the message would only repeat it); in code use it as a bool.
    """

    def __init__(self, passed: bool):
        self.passed = passed

    def __bool__(self) -> bool:
        return self.passed

    def __repr__(self) -> str:
        return f"Verdict(passed={self.passed})"

    def _ipython_display_(self) -> None:
        pass


def run_checks(title: str, checks: Callable[[], None], success: str = "") -> Verdict:
    """Run ``checks``, print one verdict line (plus a hint line when it failed) and return the :class:`Verdict`."""
    try:
        with torch.random.fork_rng(devices=[]):  # checkers may seed; the reader's random state stays as it was
            checks()
    except NotImplementedError:
        print(f"⏳ {title}: not attempted yet. Replace `raise NotImplementedError` with your code "
              "and run the cell again.")
        return Verdict(False)
    except Mismatch as m:
        print(f"❌ {title}: {m.what}")
        if m.hint:
            print(f"   Hint: {m.hint}")
        return Verdict(False)
    except Exception as err:  # noqa: BLE001 -- any crash in the reader's code becomes a verdict, not a traceback
        print(f"❌ {title}: your function raised {type(err).__name__}: {err}")
        return Verdict(False)
    print(f"✅ {title}: correct." + (f" {success}" if success else ""))
    return Verdict(True)
