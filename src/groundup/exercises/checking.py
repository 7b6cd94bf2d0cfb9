"""The small toolkit every chapter's checkers are written with.

A checker is a function ``check_<name>(fn)`` that hands ``run_checks`` a title and a function of no
arguments (the *judge*) that exercises ``fn`` and raises :class:`Mismatch` (through :func:`expect`,
:func:`expect_close` or :func:`expect_tensor`) at the first wrong answer. ``run_checks`` turns the outcome into a
printed verdict, wrapped to :data:`MESSAGE_WIDTH` characters, and returns a :class:`Verdict`, true when the
reader's function passed.

The book promises that the verdict is right, so a checker should:

1. compute every expected value *before* it calls the reader's function;
2. call the reader's function through :func:`call_reader`, which hands it deep copies of the arguments, runs it
   out of the judge's reach (see :mod:`groundup.exercises.sandbox`: a thread of its own, a time bound whose
   verdict comes on time even when the reader's code catches ``BaseException``, patches of torch and of the book
   put back, tripwires on the package's own solution named in ``forbid``), reports an argument the function
   changed in place, turns a crash of the reader's code into a :class:`ReaderError` (never mistaken for a crash
   of the checker), accepts only plain dense real tensors on the CPU (no subclass, no sparse, meta or complex
   tensor) and checks the type of what came back; an exercise that refuses a library's (or the book's) own
   implementation calls through :func:`call_refusing` instead, which swaps the code of each function in its
   :class:`Shortcuts` for a tripwire during the call, so a reference saved before the check is caught too;
3. compare with :func:`expect_close`, whose tolerance widens to fit a float32 / float16 answer, and cast to one
   dtype before any comparison in hint code (``torch.allclose`` of a float32 and a float64 tensor raises).

``run_checks`` then bounds the time the reader's code runs (:data:`DEFAULT_TIMEOUT`), restores the global state
the reader's function may change (default dtype, grad/anomaly mode, thread count, the Python, NumPy and torch
random generators), keeps ``sys.exit()`` and any other ``BaseException`` from escaping, and tells the reader's
error from a crash of the checker itself, which it reports as the book's fault with a request to report it.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import linecache
import math
import numbers
import os
import random
import re
import sys
import textwrap
import types
from collections.abc import Callable, Iterable
from typing import NamedTuple

import torch

from groundup.exercises import sandbox
from groundup.exercises.sandbox import CheckerTimeout, Forbidden

__all__ = ["DEFAULT_TIMEOUT", "MESSAGE_WIDTH", "CheckerTimeout", "Forbidden", "Mismatch", "ReaderError", "Shortcuts",
           "Verdict", "call_reader", "call_refusing", "collect_shortcuts", "expect", "expect_close", "expect_integer",
           "expect_number", "expect_tensor", "expect_type", "function_code", "module_functions", "package_functions",
           "run_checks", "tolerance_for"]

DEFAULT_TIMEOUT = float(os.environ.get("GROUNDUP_CHECK_TIMEOUT", "10"))
"""Seconds the reader's code may run in one check before it is declared stuck (``$GROUNDUP_CHECK_TIMEOUT``)."""

MESSAGE_WIDTH = 80
"""Verdicts are wrapped to this many characters, the width the book shows."""

class Mismatch(AssertionError):
    """A wrong answer: ``what`` says what was tested and what came back, ``hint`` how to fix it."""

    def __init__(self, what: str, hint: str = ""):
        super().__init__(what)
        self.what = what
        self.hint = hint


class ReaderError(Exception):
    """The reader's function raised ``error`` (or called ``sys.exit()``) during ``call``."""

    def __init__(self, call: str, error: BaseException, hint: str = ""):
        super().__init__(f"{call} raised {type(error).__name__}: {error}")
        self.call = call
        self.error = error
        self.hint = hint


def expect(condition: bool, what: str, hint: str = "") -> None:
    """Raise :class:`Mismatch` with ``what`` and ``hint`` unless ``condition`` holds."""
    if not condition:
        raise Mismatch(what, hint)


def _describe(value) -> str:
    text = repr(value)
    if len(text) > 40:
        text = text[:37] + "..."
    return f"the {type(value).__name__} {text}" if not isinstance(value, torch.Tensor) else "a Tensor"


def expect_type(value, types, call: str, expected: str | None = None, hint: str = ""):
    """Raise :class:`Mismatch` naming the expected type unless ``value`` is an instance of ``types``; return it."""
    if not isinstance(value, types):
        names = expected or " or ".join(t.__name__ for t in (types if isinstance(types, tuple) else (types,)))
        if value is None:
            hint = hint or "Did you forget the `return` statement?"
        raise Mismatch(f"{call} returned {_describe(value)}, expected {names}", hint or f"Return {names}.")
    return value


def _tensor_problem(t: torch.Tensor) -> tuple[str, str] | None:
    """Why ``t`` cannot be judged as an answer (what it is, how to fix it), or ``None`` for a plain tensor."""
    if type(t) not in (torch.Tensor, torch.nn.Parameter):
        return (f"a {type(t).__name__} (a subclass of torch.Tensor)",
                "Return a plain torch.Tensor: the result of torch operations or torch.tensor(...).")
    if t.layout != torch.strided or t.is_nested:
        return (f"a tensor with layout {t.layout}" if not t.is_nested else "a nested tensor",
                "Return a dense tensor: call .to_dense() on a sparse one.")
    if t.is_meta:
        return ("a tensor on the meta device, which has a shape but holds no numbers",
                "Compute the values: create tensors on the CPU (leave out device='meta').")
    if t.device.type != "cpu":
        return f"a tensor on {t.device}", "Return the tensor on the CPU: add .cpu()."
    if t.is_quantized:
        return "a quantized tensor", "Return an ordinary tensor: call .dequantize() on it."
    if t.is_complex():
        return ("a complex tensor", "The answer is real: return a real tensor (taking the real part would "
                "silently drop the imaginary one, so the checker will not do it for you).")
    return None


def _check_tensor(t: torch.Tensor, call: str) -> torch.Tensor:
    problem = _tensor_problem(t)
    if problem is not None:
        raise Mismatch(f"{call} returned {problem[0]}", problem[1])
    return t


def _plain(value, call: str, depth: int = 0):
    """``value`` with every container made a plain list / tuple / dict (a subclass could lie about its items), and
    every tensor in it checked to be one the checker can judge; numbers of a subclass become plain numbers."""
    if isinstance(value, torch.Tensor):
        return _check_tensor(value, call)
    if depth > 6:
        return value
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, tuple):
        return tuple(_plain(v, call, depth + 1) for v in tuple.__iter__(value))
    if isinstance(value, list):
        return [_plain(v, call, depth + 1) for v in list.__iter__(value)]
    if isinstance(value, dict):
        return {k: _plain(v, call, depth + 1) for k, v in dict.items(value)}
    return value


def expect_tensor(value, call: str, hint: str = "Return a torch.Tensor.") -> torch.Tensor:
    """Raise :class:`Mismatch` unless ``call`` (shown to the reader) returned a plain, dense, real CPU tensor;
    return it."""
    if value is None and hint == "Return a torch.Tensor.":
        hint = "Did you forget the `return` statement? Return a torch.Tensor."
    expect(isinstance(value, torch.Tensor), f"{call} returned a {type(value).__name__}, expected a torch.Tensor",
           hint)
    return _check_tensor(value, call)


def expect_number(value, call: str, hint: str = "") -> float:
    """Raise :class:`Mismatch` unless ``call`` returned a real number (a Python/NumPy number or a one-element
    tensor); return it as a float. Strings such as ``"4.0"``, ``None``, lists, booleans and complex numbers are
    refused."""
    if isinstance(value, torch.Tensor):
        _check_tensor(value, call)
        if value.numel() == 1 and value.dtype != torch.bool:
            return float(value.detach().reshape(()).item())
    elif isinstance(value, numbers.Real) and not isinstance(value, bool):
        return float(value)
    expect_type(value, (), call, "a number (a float)", hint or (
        "Did you forget the `return` statement? Return a number (a float)." if value is None
        else "Return a number (a float), not a string or a list."))
    raise AssertionError("unreachable")  # pragma: no cover


def expect_integer(value, call: str, hint: str = "") -> int:
    """Raise :class:`Mismatch` unless ``call`` returned a whole number as an int (a Python/NumPy integer or a
    one-element integer tensor); a float, even ``2.0``, is refused. Return it as an int."""
    if isinstance(value, torch.Tensor):
        _check_tensor(value, call)
        if value.numel() == 1 and not value.is_floating_point() and value.dtype != torch.bool:
            return int(value.reshape(()).item())
    elif isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return int(value)
    if isinstance(value, (float, torch.Tensor)) or isinstance(value, numbers.Real) and not isinstance(value, bool):
        raise Mismatch(f"{call} returned {_describe(value)}, expected an int",
                       hint or "Return a whole number as an int: use // rather than / (or int(...)).")
    expect_type(value, (), call, "an int", hint or (
        "Did you forget the `return` statement? Return an int." if value is None else "Return an int."))
    raise AssertionError("unreachable")  # pragma: no cover


def _as_float_tensor(x) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x.detach().to(torch.float64)
    if isinstance(x, (str, bytes, complex)) or x is None:
        raise TypeError("not a real number")
    return torch.as_tensor(x, dtype=torch.float64)


# The loosest precision of an answer sets the smallest tolerance a comparison may use.
_DTYPE_TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.complex64: (1e-5, 1e-5),
                    torch.float16: (1e-2, 1e-2), torch.bfloat16: (2e-2, 2e-2)}


def tolerance_for(*values, rtol: float = 0.0, atol: float = 0.0) -> tuple[float, float]:
    """``(rtol, atol)`` at least as loose as the precision of the least precise tensor among ``values``."""
    for v in values:
        if isinstance(v, torch.Tensor) and v.dtype in _DTYPE_TOLERANCE:
            r, a = _DTYPE_TOLERANCE[v.dtype]
            rtol, atol = max(rtol, r), max(atol, a)
    return rtol, atol


def expect_close(got, expected, what: str, hint: str = "", *, rtol: float = 1e-4, atol: float = 1e-6) -> None:
    """Check that ``got`` equals ``expected`` (numbers or tensors) within tolerance; shape must match.

    Both are compared in float64; the tolerance widens to fit a float32 / float16 / bfloat16 tensor, so a correct
    answer computed in lower precision passes.
    """
    if isinstance(got, torch.Tensor):
        problem = _tensor_problem(got)
        if problem is not None:
            raise Mismatch(f"{what}: got {problem[0]}", problem[1])
    try:
        g = _as_float_tensor(got)
    except (TypeError, ValueError, RuntimeError):
        raise Mismatch(f"{what}: expected a number or tensor, got {type(got).__name__}", hint) from None
    e = _as_float_tensor(expected)
    rtol, atol = tolerance_for(got, expected, rtol=rtol, atol=atol)
    if g.shape != e.shape:
        raise Mismatch(f"{what}: expected shape {tuple(e.shape)}, got {tuple(g.shape)}", hint)
    if not torch.allclose(g, e, rtol=rtol, atol=atol, equal_nan=False):
        if g.numel() == 1:
            detail = f"expected {e.item():.6g}, got {g.item():.6g}"
        else:
            worst = (g - e).abs().nan_to_num(nan=math.inf).max().item()
            detail = f"largest difference from the expected values is {worst:.3g}"
        raise Mismatch(f"{what}: {detail}", hint)


# ---- calling the reader's function ------------------------------------------------------------------------------


def _same(a, b, depth: int = 0) -> bool:
    """Whether ``b`` (the copy handed to the reader) still equals ``a`` (the checker's original)."""
    if depth > 20:
        return True
    if isinstance(a, torch.Tensor):
        if type(b) is not type(a) or a.shape != b.shape or a.dtype != b.dtype or b.layout != a.layout:
            return False
        if a.is_floating_point() or a.is_complex():
            return bool(((a == b) | (a.isnan() & b.isnan())).all())
        return torch.equal(a, b)
    if isinstance(a, torch.nn.Module):
        sa, sb = a.state_dict(), b.state_dict()
        return sa.keys() == sb.keys() and all(_same(sa[k], sb[k], depth + 1) for k in sa)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y, depth + 1) for x, y in zip(a, b))
    if isinstance(a, dict):
        return type(a) is type(b) and a.keys() == b.keys() and all(_same(a[k], b[k], depth + 1) for k in a)
    if isinstance(a, (set, frozenset, str, bytes, numbers.Number)) or a is None:
        return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))
    if type(a).__eq__ is object.__eq__:
        return True  # no notion of equality (a tokenizer with lazy caches, ...): not judged
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 -- an object we cannot compare is taken as unchanged
        return True


_IN_PLACE_HINT = ("Do not change the caller's arguments: compute new values instead (`x = x / n` rather than "
                  "`x /= n`, `x.masked_fill(...)` rather than `x[...] = ...`, `ids + [new]` rather than "
                  "`ids.append(new)`), or start from a copy (`x.clone()`, `list(ids)`).")


def _is_stub(err: NotImplementedError) -> bool:
    """Whether ``err`` is the exercise's stub (``raise NotImplementedError`` in the reader's own code), not an
    operation torch does not implement (e.g. on a sparse tensor), which is a real error."""
    tb = err.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if tb is None or not sandbox.is_reader_file(tb.tb_frame.f_code.co_filename):
        return False
    line = linecache.getline(tb.tb_frame.f_code.co_filename, tb.tb_lineno)
    return bool(re.match(r"\s*raise\s+NotImplementedError\b", line)) if line else not err.args


_EXIT_HINT = "Return a value instead: sys.exit() would stop the whole program (in a notebook, the kernel)."


def _package_call_hint(label: str, forbid: tuple) -> str:
    for item in forbid:
        if isinstance(item, Forbidden) and item.label == label and item.hint:
            return item.hint
    return (f"The exercise is to compute it yourself: {label.rsplit('.', 1)[-1]} is the book's own solution, "
            "so calling it proves nothing. Use torch operations and Python.")


def _judged_outcome(outcome: sandbox.Outcome, call: str, forbid: tuple):
    """The reader's return value, or the exception that turns ``outcome`` into a verdict."""
    if outcome.tripped is not None:
        raise Mismatch(f"{call} calls {outcome.tripped}", _package_call_hint(outcome.tripped, forbid))
    if outcome.timed_out:
        raise CheckerTimeout(call, outcome.abandoned)
    err = outcome.error
    if err is None:
        return outcome.value
    if isinstance(err, NotImplementedError) and _is_stub(err):
        raise err
    if isinstance(err, KeyboardInterrupt):
        raise err
    if isinstance(err, SystemExit):
        raise ReaderError(call, err, _EXIT_HINT) from None
    raise ReaderError(call, err) from err


def call_reader(fn: Callable, *args, call: str | None = None, names: tuple[str, ...] | list[str] | None = None,
                returns=None, expected: str | None = None, forbid: Iterable = (), **kwargs):
    """Call the reader's ``fn(*args, **kwargs)`` the safe way and return what it returned.

    - ``fn`` gets deep copies of the arguments, so the checker's own inputs (and the expected values computed
      from them) cannot change; afterwards an argument the function changed in place is reported as a
      :class:`Mismatch` naming it (``names`` gives the argument names; otherwise positions are counted).
    - ``fn`` runs out of the judge's reach and within the time bound (:mod:`groundup.exercises.sandbox`);
      ``forbid`` names package functions (or :class:`Forbidden` attributes) that it must not call: a call is a
      :class:`Mismatch` saying so.
    - An exception raised by ``fn`` (or ``sys.exit()``, or any other ``BaseException``) becomes a
      :class:`ReaderError`, so ``run_checks`` reports it as the reader's error; the stub's own
      ``raise NotImplementedError`` and ``KeyboardInterrupt`` pass through.
    - What comes back is made plain (containers of a subclass become lists / tuples / dicts) and every tensor in
      it must be a plain, dense, real CPU tensor. With ``returns`` (a type or a tuple of types), a value of another
      type is a :class:`Mismatch` that names the expected type (``expected`` spells it out, e.g. ``"a pair (out,
      weights)"``).

    ``call`` is how the call is shown to the reader, e.g. ``"attention(q, k, v)"``.
    """
    call = call or f"{getattr(fn, '__name__', 'your function')}(...)"
    forbid = tuple(forbid)
    try:
        given_args, given_kwargs = copy.deepcopy(args), copy.deepcopy(kwargs)
    except Exception:  # noqa: BLE001 -- an argument that cannot be copied is handed over as it is
        given_args, given_kwargs = args, kwargs
    got = _judged_outcome(sandbox.call(fn, given_args, given_kwargs, forbid), call, forbid)
    for i, (original, given) in enumerate(zip(args, given_args)):
        if given is not original and not _same(original, given):
            name = names[i] if names and i < len(names) else f"argument {i + 1}"
            raise Mismatch(f"{call} changed its input {name} in place", _IN_PLACE_HINT)
    for key, original in kwargs.items():
        if given_kwargs[key] is not original and not _same(original, given_kwargs[key]):
            raise Mismatch(f"{call} changed its input {key} in place", _IN_PLACE_HINT)
    got = _plain(got, call)
    if returns is not None:
        expect_type(got, returns, call, expected)
    return got


# ---- refusing shortcuts ----------------------------------------------------------------------------------------
#
# An exercise that asks for arithmetic a library (or the book's own code, or the checker's reference) already does
# refuses those calls while the reader's function runs, through the tripwires of ``call_reader(forbid=...)``: the
# *code* of each plain Python function is swapped for a tripwire (``sandbox``), so every reference to it is caught:
# an alias taken before the check (``from torch.nn.utils import clip_grad_norm_ as c``), a method saved from its
# class (``f = MinPLogitsWarper.__call__``), a bound method or an instance built before the check. The function
# under a decorator's ``functools.wraps`` chain is the one swapped (:func:`function_code`). A call is recorded even
# if the reader's code catches the exception. The checker computes its expected values before, with none of this
# in place, and the tripwires are gone again when the reader's function returns.


class Shortcuts(NamedTuple):
    """What :func:`call_refusing` refuses (``forbid``, for :func:`call_reader`), the name to show for each
    tripwire's label (``names``), the hint for a label of its own (``hints``) and for the others (``hint``); a hint
    may name the function called with ``{name}``."""

    forbid: tuple
    names: dict[str, str]
    hint: str
    hints: dict[str, str]


def function_code(fn) -> types.FunctionType | None:
    """The plain function under ``fn``'s decorators (``functools.wraps`` chains: torch's ``no_grad``, the
    optimizers' ``_use_grad_for_differentiable``, ``functools.cache``), whose code does the work; None when it is a
    closure or not a Python function (its code cannot be swapped: refuse it with :class:`Forbidden`)."""
    try:
        inner = inspect.unwrap(fn)
    except Exception:  # noqa: BLE001 -- a cycle of __wrapped__, or an object whose attributes raise
        return None
    return inner if isinstance(inner, types.FunctionType) and not inner.__code__.co_freevars else None


def package_functions(*fns) -> list[tuple[types.FunctionType, str]]:
    """(the plain function under it, its own label) for each of ``fns`` that has one: entries for
    :func:`collect_shortcuts`."""
    return [(inner, sandbox._label(inner)) for inner in map(function_code, fns) if inner is not None]


def module_functions(module: types.ModuleType) -> list[tuple[types.FunctionType, str]]:
    """(function, label) for every function ``module`` defines (under its decorators; not those it imports), read
    when called, so that a function added later is included: entries for :func:`collect_shortcuts`."""
    found = []
    for value in list(vars(module).values()):
        if not callable(value) or isinstance(value, type):
            continue
        inner = function_code(value)
        if inner is not None and inner.__module__ == module.__name__:
            found.append((inner, sandbox._label(inner)))
    return found


def collect_shortcuts(entries: Iterable, hint: str) -> Shortcuts:
    """The :class:`Shortcuts` of ``entries``: (a plain function or a :class:`Forbidden`, the name to show) or
    (..., the name to show, its hint); the others get ``hint``. A function (or attribute) met twice keeps its first
    name and hint."""
    forbid, names, hints, seen = [], {}, {}, set()
    for item, shown, *own_hint in entries:
        key = id(item) if not isinstance(item, Forbidden) else (id(item.owner), item.attribute)
        if key in seen:
            continue
        seen.add(key)
        forbid.append(item)
        label = item.label if isinstance(item, Forbidden) else sandbox._label(item)
        names.setdefault(label, shown)
        if own_hint:
            hints.setdefault(label, own_hint[0])
    return Shortcuts(tuple(forbid), names, hint, hints)


def call_refusing(fn: Callable, *args, call: str, names: tuple[str, ...], shortcuts: Shortcuts,
                  crash_hint: str = ""):
    """``call_reader(fn, *args)`` with ``shortcuts`` refused: a call of one is a :class:`Mismatch` that names the
    function called (as ``shortcuts.names`` shows it) with its hint. With ``crash_hint``, a crash of the reader's
    function is reported with that hint."""
    try:
        return call_reader(fn, *args, call=call, names=names, forbid=shortcuts.forbid)
    except Mismatch as refused:
        prefix = f"{call} calls "
        if not refused.what.startswith(prefix):
            raise
        label = refused.what[len(prefix):]
        name = shortcuts.names.get(label, label)
        raise Mismatch(prefix + name, shortcuts.hints.get(label, shortcuts.hint).format(name=name)) from None
    except ReaderError as err:
        if not crash_hint:
            raise
        raise ReaderError(err.call, err.error, crash_hint) from None


# ---- global state ----------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _restored_global_state():
    """Put back what a reader's function may change globally: dtype, grad/anomaly mode, threads, RNG states."""
    dtype, grad, anomaly = torch.get_default_dtype(), torch.is_grad_enabled(), torch.is_anomaly_enabled()
    threads = torch.get_num_threads()
    python_state = random.getstate()
    numpy = sys.modules.get("numpy")
    numpy_state = numpy.random.get_state() if numpy is not None else None
    try:
        with torch.random.fork_rng(devices=[]):  # checkers may seed; the reader's random state stays as it was
            yield
    finally:
        torch.set_default_dtype(dtype)
        torch.set_grad_enabled(grad)
        torch.set_anomaly_enabled(anomaly)
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        random.setstate(python_state)
        if numpy_state is not None:
            numpy.random.set_state(numpy_state)


# ---- the verdict ------------------------------------------------------------------------------------------------


class Verdict:
    """What a checker returns: true when the reader's function passed.

    The checker has already printed the verdict, so in a notebook a ``Verdict`` displays nothing (a bare
    ``True``/``False`` under the message would only repeat it); in code use it as a bool. ``checker_error`` is
    true when the checker itself crashed (the book's fault, not the reader's).
    """

    def __init__(self, passed: bool, *, checker_error: bool = False):
        self.passed = passed
        self.checker_error = checker_error

    def __bool__(self) -> bool:
        return self.passed

    def __repr__(self) -> str:
        return f"Verdict(passed={self.passed})"

    def _ipython_display_(self) -> None:
        pass


def _report_url() -> str | None:
    """The issues page of the repository named in ``[project.urls]`` of pyproject.toml (the one place the address
    is kept): from the installed package's metadata, or from the pyproject.toml of the source tree this file is
    in (a clone used without installing); None when neither names it."""
    try:
        from importlib.metadata import metadata

        entries = [e.partition(",") for e in metadata("groundup").get_all("Project-URL") or []]
        urls = {label.strip().lower(): url.strip() for label, _, url in entries}
    except Exception:  # noqa: BLE001 -- not installed: try the source tree
        try:
            import tomllib
            from pathlib import Path

            project = tomllib.loads((Path(__file__).resolve().parents[3] / "pyproject.toml").read_text())["project"]
            urls = {k.lower(): v for k, v in project.get("urls", {}).items()} if project.get("name") == "groundup" \
                else {}
        except Exception:  # noqa: BLE001 -- the message then names no address
            urls = {}
    url = urls.get("repository")
    return url.rstrip("/") + "/issues" if isinstance(url, str) and url else None


def _say(text: str, indent: str = "   ", first: str = "") -> None:
    """Print ``text`` wrapped to :data:`MESSAGE_WIDTH`, continuation lines indented by ``indent``; code in
    backticks (`raise NotImplementedError`) is kept on one line."""
    glued = re.sub(r"`[^`]*`", lambda m: m.group(0).replace(" ", "\0"), text)
    print(textwrap.fill(glued, MESSAGE_WIDTH, initial_indent=first, subsequent_indent=indent,
                        break_long_words=False, break_on_hyphens=False).replace("\0", " "))


def _failed(title: str, what: str, hint: str = "") -> Verdict:
    _say(f"❌ {title}: {what}")
    if hint:
        _say(f"Hint: {hint}", first="   ", indent="         ")
    return Verdict(False)


def _reader_error(title: str, err: BaseException, hint: str = "") -> Verdict:
    if isinstance(err, SystemExit):
        return _failed(title, f"your function called sys.exit({'' if err.code is None else repr(err.code)})",
                       hint or _EXIT_HINT)
    return _failed(title, f"your function raised {type(err).__name__}: {err}".rstrip(": "), hint)


def _checker_crashed(title: str, err: BaseException) -> Verdict:
    _say(f"⚠️ {title}: the checker itself crashed ({type(err).__name__}: {err}). This is a bug in the book, "
         "not a verdict on your code.")
    url = _report_url()
    where = f"at {url}" if url else "on the book's repository (its issues page)"
    _say(f"Please report it {where}, with the code of your function.", first="   ")
    return Verdict(False, checker_error=True)


def run_checks(title: str, checks: Callable[[], None], success: str = "", *,
               timeout: float | None = None) -> Verdict:
    """Run ``checks``, print one verdict (plus a hint when it failed) and return the :class:`Verdict`.

    ``timeout`` (default :data:`DEFAULT_TIMEOUT` seconds; ``0`` or a negative number: no bound) bounds the time
    the reader's code may run, summed over its calls (:func:`groundup.exercises.sandbox.bounded`; the reader's
    function runs in a worker thread). Ctrl-C / the notebook's interrupt button stops the cell. Global state
    is restored afterwards; a patch of torch or of the book that the reader's code made while the checker ran
    (from a thread of its own, say) voids the verdict and is put back, and one made before the check is lifted
    while it runs (:func:`groundup.exercises.sandbox.pristine`).
    """
    seconds = DEFAULT_TIMEOUT if timeout is None else timeout
    try:
        with sandbox.pristine(), _restored_global_state():
            snapshot = sandbox.Snapshot()
            sandbox.bounded(checks, seconds if seconds > 0 else None)
            patched = snapshot.restore()
        if patched:
            return _failed(title, "your code replaced " + ", ".join(sorted(set(patched))[:5]) + " while the "
                           "checker ran, so the verdict cannot be trusted (the originals are back)",
                           "Leave torch and the book's functions as they are, and run the check again.")
    except NotImplementedError as err:
        if not _is_stub(err):
            return _crash_or_reader_error(title, err)
        _say(f"⏳ {title}: not attempted yet. Replace `raise NotImplementedError` with your code "
             "and run the cell again.")
        return Verdict(False)
    except Mismatch as m:
        return _failed(title, m.what, m.hint)
    except CheckerTimeout as err:
        if err.args[1:] == (True,):  # the reader's code could not be stopped
            return _failed(title, f"your function did not finish within {seconds:g} s, and it is still running "
                           "in the background: it catches the exception that should stop it",
                           "Restart the kernel to stop it. Then look for a loop that never ends, and for a bare "
                           "`except:` or an `except BaseException:` that catches everything.")
        return _failed(title, f"your function did not finish within {seconds:g} s",
                       "Look for a loop that never ends: a `while` whose condition never becomes false, or an "
                       "index that is never advanced. (A correct but very slow function also ends up here.)")
    except ReaderError as err:
        return _reader_error(title, err.error, err.hint)
    except SystemExit as err:
        return _reader_error(title, err)
    except KeyboardInterrupt:
        raise
    except BaseException as err:  # noqa: BLE001 -- a crash becomes a verdict, never a traceback
        return _crash_or_reader_error(title, err)
    _say(f"✅ {title}: correct." + (f" {success}" if success else ""))
    return Verdict(True)


def _crash_or_reader_error(title: str, err: BaseException) -> Verdict:
    if sandbox.raised_in_reader_code(err):
        return _reader_error(title, err)
    return _checker_crashed(title, err)
