"""Running the reader's function for a checker: in a thread of its own, for a bounded time, with the
interpreter's state put back afterwards and the package's own solutions out of reach.

:func:`call` (what ``call_reader`` uses) runs the reader's function in a fresh worker thread while the checker
(the *judge*) waits. So the frames above the reader's code are the worker's alone: the judge's frames, which hold
the expected values, are in another thread, and while the reader's code runs, the ways to reach them
(``sys._current_frames``, ``gc.get_objects``, ``gc.get_referrers``) are switched off. Around each call:

- **time**: the calls of one check share a budget (:func:`budget`). Past it the judge stops waiting and
  injects :class:`CheckerTimeout` into the worker every 10 ms for a second; a worker that still runs (a loop
  that catches ``BaseException``, or one long C call) is left behind as a daemon thread and the verdict says so.
  The verdict comes on time either way. :func:`bounded` also bounds reader's code that a judge runs itself.
- **patches**: public functions of ``torch``, ``torch.nn.functional``, ``math``, ``operator`` and ``builtins``,
  the methods of ``torch.Tensor`` and ``torch.nn.Module``, and everything in the ``groundup`` modules (and their
  classes) that the reader's function replaced or added are put back before the judge looks at the answer; the
  default dtype is restored. (Torch function / dispatch modes are per thread: the worker's die with it.)
- **package calls**: functions the judge names in ``forbid`` (the package's own solution) are swapped for
  tripwires during the call. A call is recorded even if the reader's code catches the exception.

The worker runs with the judge's grad mode and ``sys.setprofile`` function (both are per thread).

This is a judge for honest mistakes and casual tricks, not a security boundary: code running in the same
interpreter can always read memory through ``ctypes`` or patch torch's C kernels.
"""

from __future__ import annotations

import builtins
import contextlib
import ctypes
import gc
import math
import operator
import os
import signal
import site
import sys
import sysconfig
import threading
import time
import types
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

__all__ = ["CheckerTimeout", "Forbidden", "Outcome", "PackageCall", "Snapshot", "bounded", "budget", "call",
           "is_reader_file", "pristine", "raised_in_reader_code"]


class CheckerTimeout(BaseException):
    """Raised inside the reader's code that ran past the time bound.

    A ``BaseException`` (like ``KeyboardInterrupt``) so that the reader's ``except Exception:`` cannot swallow it.
    """


class PackageCall(BaseException):
    """The reader's function called a package function the checker forbade (the package's own solution)."""


@dataclass(frozen=True)
class Forbidden:
    """An attribute (``owner.attribute``, e.g. ``torch._C._nn, "nll_loss"``) the reader's function must not call;
    with ``when(args, kwargs)`` only the calls it returns true for count; ``label`` names the call in the verdict
    and ``hint`` says what to do instead. Plain Python functions can be forbidden directly (every reference to
    them is caught); this form is for builtins and calls under a condition."""

    owner: object
    attribute: str
    when: Callable | None = None
    label: str = ""
    hint: str = ""


class Outcome:
    """What one call of the reader's function did: its return ``value`` or the ``error`` it raised, whether it
    ran past the bound (``timed_out``) and could not be stopped (``abandoned``), the forbidden function it called
    (``tripped``, or ``None``) and the names it had patched (``patched``, put back)."""

    def __init__(self):
        self.value = None
        self.error: BaseException | None = None
        self.timed_out = False
        self.tripped: str | None = None
        self.patched: list[str] = []
        self.abandoned = False
        self.seconds = 0.0


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


def is_reader_file(filename: str) -> bool:
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


def raised_in_reader_code(err: BaseException) -> bool:
    """Whether reader's code is among the frames ``err`` passed through."""
    tb = err.__traceback__
    while tb is not None:
        if is_reader_file(tb.tb_frame.f_code.co_filename):
            return True
        tb = tb.tb_next
    return False


def _reader_code_on_stack(frame, stop: types.CodeType | None = None) -> bool:
    while frame is not None and frame.f_code is not stop:
        if is_reader_file(frame.f_code.co_filename):
            return True
        frame = frame.f_back
    return False


def _async_raise(ident: int, exc: type[BaseException] | None) -> None:
    """Schedule ``exc`` in thread ``ident`` (raised at its next bytecode check); ``None`` clears a pending one."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident), ctypes.py_object(exc) if exc else None)


# ---- the time bound ---------------------------------------------------------------------------------------------

_BUDGET = threading.local()


@contextlib.contextmanager
def budget(seconds: float | None):
    """Within the block, the reader's calls through :func:`call` share ``seconds`` (``None``: no bound)."""
    previous = getattr(_BUDGET, "left", None)
    _BUDGET.left = [seconds]
    try:
        yield
    finally:
        _BUDGET.left = previous


def _seconds_left() -> float | None:
    left = getattr(_BUDGET, "left", None)
    return None if left is None else left[0]


def _spend(seconds: float) -> None:
    left = getattr(_BUDGET, "left", None)
    if left is not None and left[0] is not None:
        left[0] = max(left[0] - seconds, 0.0)


_GRACE = 1.0  # seconds of injected CheckerTimeouts before a worker is left behind


def _stop(worker: threading.Thread, done: threading.Event, exc: type[BaseException]) -> bool:
    """Inject ``exc`` into ``worker`` until it is ``done`` (true) or :data:`_GRACE` seconds passed (false)."""
    deadline = time.perf_counter() + _GRACE
    while not done.is_set() and time.perf_counter() < deadline:
        _async_raise(worker.ident, exc)
        done.wait(0.01)
    return done.is_set()


class _Alarm:
    """A SIGALRM bound for reader's code a judge runs itself, in the main thread.

    After ``seconds`` it raises :class:`CheckerTimeout`, and again every half second until the exception escapes.
    It raises only while the reader's code is on the stack, so a slow checker is not blamed on the reader. A timer
    another library had set is restored afterwards.
    """

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.active = False

    def _handler(self, signum, frame):
        if self.active and _reader_code_on_stack(frame, bounded.__code__):  # the frames below are the caller's
            raise CheckerTimeout(self.seconds)

    def __enter__(self):
        self.previous_handler = signal.signal(signal.SIGALRM, self._handler)
        self.previous_timer = signal.setitimer(signal.ITIMER_REAL, 0)
        self.active = True
        signal.setitimer(signal.ITIMER_REAL, self.seconds, 0.5)
        return self

    def __exit__(self, *exc) -> None:
        self.active = False
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, self.previous_handler)
        delay, interval = self.previous_timer
        if delay > 0:
            signal.setitimer(signal.ITIMER_REAL, max(delay - self.seconds, 0.001), interval)


def _in_thread(checks: Callable[[], None], seconds: float) -> None:
    """Off the main thread: run ``checks`` in a worker and wait at most ``seconds`` (plus the grace period)."""
    outcome: dict[str, BaseException] = {}
    grad = torch.is_grad_enabled()

    def work():
        try:
            with torch.set_grad_enabled(grad), budget(seconds):  # the budget is per thread: carry it over
                checks()
        except BaseException as err:  # noqa: BLE001 -- handed to the calling thread
            outcome["error"] = err

    done = threading.Event()
    worker = threading.Thread(target=_signalling(work, done), name="groundup-checker", daemon=True)
    worker.start()
    if not done.wait(seconds + 2 * _GRACE):  # the judge's own calls give up after seconds + _GRACE
        _stop(worker, done, CheckerTimeout)
        raise CheckerTimeout(seconds)
    if "error" in outcome:
        raise outcome["error"]


def bounded(checks: Callable[[], None], seconds: float | None) -> None:
    """Run a judge's ``checks`` with the budget ``seconds`` for the reader's code (``None``: no bound): the calls
    through :func:`call` share it, and reader's code the judge runs itself is stopped after it too."""
    with budget(seconds):
        if seconds is None:
            checks()
        elif threading.current_thread() is threading.main_thread() and hasattr(signal, "setitimer"):
            with _Alarm(seconds):
                checks()
        else:
            _in_thread(checks, seconds)


# ---- what the reader's function may patch ------------------------------------------------------------------------


def _public(key: str, value) -> bool:
    return not key.startswith("_") and not isinstance(value, types.ModuleType)


def _everything(key: str, value) -> bool:
    return not isinstance(value, types.ModuleType)


def _guarded(book: bool = True) -> list[tuple[object, Callable, bool]]:
    """(namespace, which of its entries are guarded, whether entries the reader added are removed); the groundup
    modules and their classes too with ``book``."""
    guarded = [(m, _public, False) for m in (torch, F, torch.linalg, torch.special, math, operator, builtins)]
    guarded += [(torch.Tensor, _everything, True), (torch.nn.Module, _everything, True)]
    for name, module in list(sys.modules.items()) if book else ():
        if module is None or not (name == "groundup" or name.startswith("groundup.")):
            continue
        guarded.append((module, _everything, True))
        for value in list(vars(module).values()):
            if isinstance(value, type) and value.__module__ == name:
                guarded.append((value, _everything, True))
    return guarded


class Snapshot:
    """The guarded namespaces' contents now; :meth:`restore` puts them back and names what had changed."""

    def __init__(self, book: bool = True):
        self.entries = [(ns, pick, strict, dict(vars(ns))) for ns, pick, strict in _guarded(book)]

    def restore(self) -> list[str]:
        changed = []
        for ns, pick, strict, saved in self.entries:
            now = vars(ns)
            if len(now) == len(saved) and not any(map(operator.is_not, now.values(), saved.values())):
                continue  # unchanged (compared in C: this runs after every call of the reader's function)
            now = dict(now)
            for key, value in saved.items():
                if now.get(key, _MISSING) is not value and pick(key, value):
                    changed.append(_name(ns, key))
                    setattr(ns, key, value)
            if strict:
                for key in now.keys() - saved.keys() - _RUNTIME_CACHES:
                    if pick(key, now[key]):
                        changed.append(_name(ns, key))
                        delattr(ns, key)
        return changed


_MISSING = object()
_RUNTIME_CACHES = {"__slotnames__"}  # what Python itself adds to a class (copy.deepcopy caches its slot names)


def _name(namespace, key: str) -> str:
    return f"{getattr(namespace, '__name__', type(namespace).__name__)}.{key}"


_PRISTINE = Snapshot(book=False)  # torch's functions when the checkers were imported (the book's still load)


@contextlib.contextmanager
def pristine():
    """Within the block, torch's guarded functions are as they were when the checkers were imported: a patch the
    reader made before the check (a notebook cell that replaced ``torch.allclose``) is lifted for the check and
    put back after it."""
    users = Snapshot()
    _PRISTINE.restore()
    try:
        yield
    finally:
        users.restore()


# ---- keeping the judge out of reach -----------------------------------------------------------------------------

_REAL = {"_current_frames": sys._current_frames, "get_objects": gc.get_objects, "get_referrers": gc.get_referrers,
         "get_referents": gc.get_referents}


def _only_this_thread():
    return {threading.get_ident(): sys._getframe(1)}


def _nothing(*args, **kwargs):
    return []


_SWAPPED: dict[tuple[int, str], tuple[object, str, object]] = {}  # (id(owner), name) -> the true original


def _swap(owner, name: str, stand_in: Callable[[object], object]) -> tuple[int, str]:
    """Set ``owner.name`` to ``stand_in(original)``, remembering the true original even if a call that was left
    behind still has it swapped; return the key :func:`_put_back` takes."""
    key = (id(owner), name)
    if key not in _SWAPPED:
        _SWAPPED[key] = (owner, name, getattr(owner, name))
    setattr(owner, name, stand_in(_SWAPPED[key][2]))
    return key


def _put_back(keys: list[tuple[int, str]]) -> None:
    for key in keys:
        entry = _SWAPPED.pop(key, None)
        if entry is not None:
            setattr(*entry)


def _hide_judge() -> list[tuple[int, str]]:
    """Switch off the ways from the reader's code to other threads' frames and to arbitrary objects; return what
    :func:`_put_back` needs to switch them on again."""
    names = [(sys, "_current_frames", _only_this_thread), (gc, "get_objects", _nothing),
             (gc, "get_referrers", _nothing), (gc, "get_referents", _nothing)]
    if hasattr(sys, "_current_exceptions"):
        names.append((sys, "_current_exceptions", dict))
    return [_swap(owner, name, lambda original, new=stand_in: new) for owner, name, stand_in in names]


# ---- tripwires for the package's own solutions ------------------------------------------------------------------

_TRIPPED: list[Outcome] = []  # the outcome of the call in progress (at most one entry)


def _trip(label: str) -> None:
    if _TRIPPED and _TRIPPED[0].tripped is None:
        _TRIPPED[0].tripped = label
    raise PackageCall(label)


def _tripwire_template(*args, **kwargs):
    # Runs with the forbidden function's globals, so it reaches this module through __import__ only.
    __import__("groundup.exercises.sandbox", fromlist=["_trip"])._trip(
        __import__("sys")._getframe(0).f_code.co_name)


def _label(fn) -> str:
    module = getattr(fn, "__module__", "") or ""
    return f"{module}.{fn.__qualname__}" if module else fn.__qualname__


def _check_forbid(forbid: Iterable) -> tuple:
    forbid = tuple(forbid)
    for item in forbid:
        if not isinstance(item, Forbidden) and not (isinstance(item, types.FunctionType)
                                                    and not item.__code__.co_freevars):
            raise TypeError(f"forbid: cannot set a tripwire on {item!r} (a closure or a builtin); "
                            "name it with Forbidden(owner, attribute)")
    return forbid


def _set_tripwires(forbid: tuple) -> list[tuple[int, str]]:
    """Swap each forbidden function for a tripwire; return what :func:`_put_back` needs to undo it."""
    keys = []
    for item in forbid:
        if isinstance(item, Forbidden):
            keys.append(_swap(item.owner, item.attribute, lambda original, i=item: _conditional_tripwire(original, i)))
        else:  # a plain function: its code is swapped, so every reference to it is caught
            code = _tripwire_template.__code__.replace(co_name=_label(item))
            keys.append(_swap(item, "__code__", lambda original, c=code: c))
    return keys


def _conditional_tripwire(original: Callable, item: Forbidden) -> Callable:
    label = item.label or f"{getattr(item.owner, '__name__', item.owner)}.{item.attribute}"

    def tripwire(*args, **kwargs):
        if item.when is None or item.when(args, kwargs):
            _trip(label)
        return original(*args, **kwargs)

    return tripwire


# ---- one call of the reader's function --------------------------------------------------------------------------


def _signalling(body: Callable[[], None], done: threading.Event) -> Callable[[], None]:
    """``body`` that sets ``done`` when it ends, however it ends. (The caller waits on ``done``, not on
    ``Thread.join``: a join that Ctrl-C interrupts marks a running thread as stopped in Python 3.11.)"""

    def run():
        try:
            body()
        finally:
            while not done.is_set():
                with contextlib.suppress(BaseException):
                    done.set()

    return run


def _run(fn: Callable, args: tuple, kwargs: dict, outcome: Outcome, grad: bool, profile: Callable | None) -> None:
    """The worker's body: call the reader's function, keep what it returned or raised."""
    try:
        if profile is not None:
            sys.setprofile(profile)
        try:
            with torch.set_grad_enabled(grad):
                outcome.value = fn(*args, **kwargs)
        except BaseException as err:  # noqa: BLE001 -- everything the reader's code raises is judged
            outcome.error = err
        finally:
            sys.setprofile(None)
    except BaseException:  # noqa: BLE001,S110 -- a CheckerTimeout injected just as the reader's code returned
        pass


def call(fn: Callable, args: tuple, kwargs: dict, forbid: Iterable = ()) -> Outcome:
    """Call the reader's ``fn(*args, **kwargs)`` in a worker thread with the protections of this module and
    return the :class:`Outcome`. Ctrl-C (``KeyboardInterrupt``) while it runs stops the worker and is re-raised.
    """
    forbid = _check_forbid(forbid)
    outcome = Outcome()
    snapshot = Snapshot()
    dtype = torch.get_default_dtype()
    done = threading.Event()
    grad, profile = torch.is_grad_enabled(), sys.getprofile()
    worker = threading.Thread(target=_signalling(lambda: _run(fn, args, kwargs, outcome, grad, profile), done),
                              name="groundup-reader", daemon=True)
    seconds = _seconds_left()
    saved: list = []
    _TRIPPED[:] = [outcome]
    start = time.perf_counter()
    try:
        saved += _set_tripwires(forbid)
        saved += _hide_judge()
        worker.start()
        try:
            finished = done.wait(seconds)
        except BaseException as err:  # Ctrl-C, or the bound on the judge itself, while the reader's code runs
            _stop(worker, done, KeyboardInterrupt if isinstance(err, KeyboardInterrupt) else CheckerTimeout)
            raise
        if not finished:
            outcome.timed_out = True
            outcome.abandoned = not _stop(worker, done, CheckerTimeout)
    finally:
        outcome.seconds = time.perf_counter() - start
        _spend(outcome.seconds)
        _put_back(saved[::-1])
        torch.set_default_dtype(dtype)
        outcome.patched = snapshot.restore()
        if _TRIPPED and _TRIPPED[0] is outcome:
            _TRIPPED.clear()
    return outcome
