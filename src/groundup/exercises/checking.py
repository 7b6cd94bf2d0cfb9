"""The small toolkit every chapter's checkers are written with.

A checker is a function ``check_<name>(fn)`` that hands ``run_checks`` a title and a function of no
arguments that exercises ``fn`` and raises :class:`Mismatch` (through :func:`expect`, :func:`expect_close` or
:func:`expect_tensor`) at the first wrong answer. ``run_checks`` turns the outcome into a printed verdict and
returns a :class:`Verdict`, true when the reader's function passed.

The book promises that the verdict is right, so a checker should:

1. compute every expected value *before* it calls the reader's function;
2. call the reader's function through :func:`call_reader`, which hands it deep copies of the arguments, reports
   an argument the function changed in place, turns a crash of the reader's code into a :class:`ReaderError`
   (never mistaken for a crash of the checker) and checks the type of what came back;
3. compare with :func:`expect_close`, whose tolerance widens to fit a float32 / float16 answer, and cast to one
   dtype before any comparison in hint code (``torch.allclose`` of a float32 and a float64 tensor raises).

``run_checks`` then bounds the time of the whole check (:data:`DEFAULT_TIMEOUT`), restores the global state the
reader's function may change (default dtype, grad mode, anomaly mode, thread count, the Python, NumPy and torch
random generators), keeps ``sys.exit()`` from escaping, and tells the reader's error from a crash of the checker
itself, which it reports as the book's fault with a request to report it.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import math
import numbers
import os
import random
import signal
import site
import sys
import sysconfig
import threading
from collections.abc import Callable
from pathlib import Path

import torch

__all__ = ["DEFAULT_TIMEOUT", "CheckerTimeout", "Mismatch", "ReaderError", "Verdict", "call_reader", "expect",
           "expect_close", "expect_number", "expect_tensor", "expect_type", "run_checks", "tolerance_for"]

DEFAULT_TIMEOUT = float(os.environ.get("GROUNDUP_CHECK_TIMEOUT", "10"))
"""Seconds a checker may run before the reader's function is declared stuck (``$GROUNDUP_CHECK_TIMEOUT``)."""

_REPORT_URL = "https://github.com/groundup-book/transformers-from-the-ground-up/issues"


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


class CheckerTimeout(BaseException):
    """Raised inside a check that ran past its time bound.

    A ``BaseException`` (like ``KeyboardInterrupt``) so that the reader's ``except Exception:`` cannot swallow it.
    """


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


def expect_tensor(value, call: str, hint: str = "Return a torch.Tensor.") -> torch.Tensor:
    """Raise :class:`Mismatch` unless ``call`` (shown to the reader) returned a tensor; return it."""
    if value is None and hint == "Return a torch.Tensor.":
        hint = "Did you forget the `return` statement? Return a torch.Tensor."
    expect(isinstance(value, torch.Tensor), f"{call} returned a {type(value).__name__}, expected a torch.Tensor",
           hint)
    return value


def expect_number(value, call: str, hint: str = "") -> float:
    """Raise :class:`Mismatch` unless ``call`` returned a real number (a Python/NumPy number or a one-element
    tensor); return it as a float. Strings such as ``"4.0"``, ``None``, lists and booleans are refused."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.dtype.is_complex \
            and value.dtype != torch.bool:
        return float(value.detach().reshape(()).item())
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return float(value)
    expect_type(value, (), call, "a number (a float)", hint or (
        "Did you forget the `return` statement? Return a number (a float)." if value is None
        else "Return a number (a float), not a string or a list."))
    raise AssertionError("unreachable")  # pragma: no cover


def _as_float_tensor(x) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x.detach().to(torch.float64)
    if isinstance(x, (str, bytes)) or x is None:
        raise TypeError("not a number")
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
        if not isinstance(b, torch.Tensor) or a.shape != b.shape or a.dtype != b.dtype:
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


def call_reader(fn: Callable, *args, call: str | None = None, names: tuple[str, ...] | list[str] | None = None,
                returns=None, expected: str | None = None, **kwargs):
    """Call the reader's ``fn(*args, **kwargs)`` the safe way and return what it returned.

    - ``fn`` gets deep copies of the arguments, so the checker's own inputs (and the expected values computed
      from them) cannot change; afterwards an argument the function changed in place is reported as a
      :class:`Mismatch` naming it (``names`` gives the argument names; otherwise positions are counted).
    - An exception raised by ``fn`` (or ``sys.exit()``) becomes a :class:`ReaderError`, so ``run_checks`` reports
      it as the reader's error; ``NotImplementedError`` (the stub) and ``KeyboardInterrupt`` pass through.
    - With ``returns`` (a type or a tuple of types), a value of another type is a :class:`Mismatch` that names the
      expected type (``expected`` spells it out, e.g. ``"a pair (out, weights)"``).

    ``call`` is how the call is shown to the reader, e.g. ``"attention(q, k, v)"``.
    """
    call = call or f"{getattr(fn, '__name__', 'your function')}(...)"
    try:
        given_args, given_kwargs = copy.deepcopy(args), copy.deepcopy(kwargs)
    except Exception:  # noqa: BLE001 -- an argument that cannot be copied is handed over as it is
        given_args, given_kwargs = args, kwargs
    try:
        got = fn(*given_args, **given_kwargs)
    except (NotImplementedError, KeyboardInterrupt, CheckerTimeout):
        raise
    except SystemExit as err:
        raise ReaderError(call, err, "Return a value instead: sys.exit() would stop the whole program (in a "
                                     "notebook, the kernel).") from None
    except Exception as err:  # noqa: BLE001 -- the reader's crash is part of the verdict
        raise ReaderError(call, err) from err
    for i, (original, given) in enumerate(zip(args, given_args)):
        if given is not original and not _same(original, given):
            name = names[i] if names and i < len(names) else f"argument {i + 1}"
            raise Mismatch(f"{call} changed its input {name} in place", _IN_PLACE_HINT)
    for key, original in kwargs.items():
        if given_kwargs[key] is not original and not _same(original, given_kwargs[key]):
            raise Mismatch(f"{call} changed its input {key} in place", _IN_PLACE_HINT)
    if returns is not None:
        expect_type(got, returns, call, expected)
    return got


# ---- telling the reader's code from the book's ------------------------------------------------------------------


def _library_roots() -> tuple[str, ...]:
    roots = {str(Path(__file__).resolve().parents[1])}  # the groundup package
    for key in ("stdlib", "platstdlib", "purelib", "platlib"):
        with contextlib.suppress(KeyError):
            roots.add(str(Path(sysconfig.get_path(key)).resolve()))
    with contextlib.suppress(Exception):
        roots.update(str(Path(p).resolve()) for p in site.getsitepackages())
    with contextlib.suppress(Exception):
        roots.add(str(Path(site.getusersitepackages()).resolve()))
    return tuple(r.rstrip(os.sep) + os.sep for r in roots)


_LIBRARY_ROOTS = _library_roots()
_FILE_VERDICT: dict[str, bool] = {}


def _is_reader_file(filename: str) -> bool:
    """Whether code from ``filename`` is the reader's: anything but the groundup package, the standard library
    and installed packages (a notebook cell, a script, a test)."""
    if filename not in _FILE_VERDICT:
        if filename.startswith("<frozen"):
            verdict = False
        elif filename.startswith("<"):
            verdict = True  # <ipython-input-...>, <string>, <stdin>
        else:
            try:
                resolved = str(Path(filename).resolve())
            except (OSError, ValueError):
                resolved = filename
            verdict = not resolved.startswith(_LIBRARY_ROOTS)
        _FILE_VERDICT[filename] = verdict
    return _FILE_VERDICT[filename]


def _raised_in_reader_code(err: BaseException) -> bool:
    tb = err.__traceback__
    while tb is not None:
        if _is_reader_file(tb.tb_frame.f_code.co_filename):
            return True
        tb = tb.tb_next
    return False


def _running_reader_code(frame) -> bool:
    """Whether reader's code is on the stack between ``frame`` and the ``run_checks`` that is running."""
    while frame is not None and frame.f_code is not run_checks.__code__:
        if _is_reader_file(frame.f_code.co_filename):
            return True
        frame = frame.f_back
    return False


# ---- the time bound ---------------------------------------------------------------------------------------------


class _Alarm:
    """A SIGALRM time bound for code running in the main thread (where a notebook runs its cells).

    After ``seconds`` it raises :class:`CheckerTimeout` in the running code, and again every half second until the
    exception escapes (a reader's bare ``except:`` cannot hold it for long). It raises only while the reader's code
    is on the stack, so a slow checker is not blamed on the reader. Ctrl-C / the notebook's interrupt button still
    raise ``KeyboardInterrupt`` as usual. A timer another library had set is restored afterwards.
    """

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.active = False
        self.fired = False

    def _handler(self, signum, frame):
        if self.active and _running_reader_code(frame):
            self.fired = True
            raise CheckerTimeout(self.seconds)

    def __enter__(self):
        self.previous_handler = signal.signal(signal.SIGALRM, self._handler)
        self.previous_timer = signal.setitimer(signal.ITIMER_REAL, 0)
        self.active = True
        signal.setitimer(signal.ITIMER_REAL, self.seconds, 0.5)
        return self

    def disarm(self) -> None:
        if not self.active:
            return
        self.active = False
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, self.previous_handler)
        delay, interval = self.previous_timer
        if delay > 0:
            signal.setitimer(signal.ITIMER_REAL, max(delay - self.seconds, 0.001), interval)

    def __exit__(self, *exc) -> None:
        self.disarm()


def _run_in_thread(checks: Callable[[], None], seconds: float) -> None:
    """Run ``checks`` in a worker thread and wait at most ``seconds`` (the path off the main thread, where
    signals cannot be used).

    On timeout :class:`CheckerTimeout` is raised here, and also injected into the worker, which stops at its next
    Python instruction. A worker stuck inside one long C call (a huge matrix product) cannot be stopped from
    outside: it is a daemon thread, keeps running in the background until that call returns, then stops; it
    never blocks the interpreter's exit. Its result is discarded.
    """
    outcome: dict[str, BaseException] = {}
    grad = torch.is_grad_enabled()

    def work():
        try:
            with torch.set_grad_enabled(grad):  # grad mode is per thread: carry the caller's over
                checks()
        except BaseException as err:  # noqa: BLE001 -- handed to the calling thread
            outcome["error"] = err

    worker = threading.Thread(target=work, name="groundup-checker", daemon=True)
    worker.start()
    worker.join(seconds)
    if worker.is_alive():
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(worker.ident), ctypes.py_object(CheckerTimeout))
        worker.join(0.5)
        raise CheckerTimeout(seconds)
    if "error" in outcome:
        raise outcome["error"]


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


def _report_url() -> str:
    try:
        from importlib.metadata import metadata

        for entry in metadata("groundup").get_all("Project-URL") or []:
            label, _, url = entry.partition(",")
            if label.strip().lower() == "repository":
                return url.strip().rstrip("/") + "/issues"
    except Exception:  # noqa: BLE001 -- the fallback address is as good
        pass
    return _REPORT_URL


def _failed(title: str, what: str, hint: str = "") -> Verdict:
    print(f"❌ {title}: {what}")
    if hint:
        print(f"   Hint: {hint}")
    return Verdict(False)


def _reader_error(title: str, err: BaseException, hint: str = "") -> Verdict:
    if isinstance(err, SystemExit):
        return _failed(title, f"your function called sys.exit({'' if err.code is None else repr(err.code)})",
                       hint or "Return a value instead: sys.exit() would stop the whole program (in a notebook, "
                               "the kernel).")
    return _failed(title, f"your function raised {type(err).__name__}: {err}", hint)


def run_checks(title: str, checks: Callable[[], None], success: str = "", *,
               timeout: float | None = None) -> Verdict:
    """Run ``checks``, print one verdict line (plus a hint line when it failed) and return the :class:`Verdict`.

    ``timeout`` (default :data:`DEFAULT_TIMEOUT` seconds; ``0`` or a negative number: no bound) bounds the time
    the reader's code may run. In the main thread a SIGALRM timer interrupts it (see :class:`_Alarm`); elsewhere
    the checks run in a worker thread (see :func:`_run_in_thread` for what happens to a runaway thread). Either
    way Ctrl-C / the notebook's interrupt button stops the cell. Global state is restored afterwards.
    """
    seconds = DEFAULT_TIMEOUT if timeout is None else timeout
    alarm = None
    try:
        with _restored_global_state():
            if seconds <= 0:
                checks()
            elif threading.current_thread() is threading.main_thread() and hasattr(signal, "setitimer"):
                alarm = _Alarm(seconds)
                with alarm:
                    checks()
            else:
                _run_in_thread(checks, seconds)
    except NotImplementedError:
        print(f"⏳ {title}: not attempted yet. Replace `raise NotImplementedError` with your code "
              "and run the cell again.")
        return Verdict(False)
    except Mismatch as m:
        return _failed(title, m.what, m.hint)
    except CheckerTimeout:
        return _failed(title, f"your function did not finish within {seconds:g} s",
                       "Look for a loop that never ends: a `while` whose condition never becomes false, or an "
                       "index that is never advanced. (A correct but very slow function also ends up here.)")
    except ReaderError as err:
        return _reader_error(title, err.error, err.hint)
    except SystemExit as err:
        return _reader_error(title, err)
    except Exception as err:  # noqa: BLE001 -- a crash becomes a verdict, never a traceback
        if _raised_in_reader_code(err):
            return _reader_error(title, err)
        print(f"⚠️ {title}: the checker itself crashed ({type(err).__name__}: {err}). This is a bug in the book, "
              "not a verdict on your code.")
        print(f"   Please report it at {_report_url()}, with the code of your function.")
        return Verdict(False, checker_error=True)
    finally:
        if alarm is not None:
            alarm.disarm()
    print(f"✅ {title}: correct." + (f" {success}" if success else ""))
    return Verdict(True)
