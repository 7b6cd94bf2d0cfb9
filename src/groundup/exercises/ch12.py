"""Checkers for chapter 12 (pretrained models: GPT-2, LLaMA and SmolLM2 in our GPT): a Q8_0 quantizer and a Q6_K
decoder, bit for bit against the ``gguf`` package; the permutation between the two pairings of rotary embeddings;
undoing llama.cpp's reordering of the rows of W_Q and W_K; a GGUF metadata array read from raw bytes; LLaMA's
parameter count; and a GGUF file of one tensor written by hand.

Every checker computes the expected values before it calls the reader's function, from a reference that does not
share the reader's task where there is one (the ``gguf`` package's quantizer, decoder, writer and reader; the
package's GPT built on the meta device; the ``gguf`` package's reader and the package's), hands the function copies
of its inputs (and says so if the function changed them in place), checks the type of what comes back, and refuses
answers that call the package's own solution (``groundup.quantization``, ``groundup.kquants``, ``groundup.gguf``,
``groundup.pretrained``, ``groundup.positional``, a torch.nn.Module) or the ``gguf`` package's (its quantizer,
decoder, reader or writer). A record of the calls the reader's function makes (:class:`_Watch`) finds those calls
however they are reached, and a copy of one of their functions under another file or name too; the record sees the
reader's thread only, so starting a thread or a process is refused, and tripwires on the main entry points catch a
thread started before the check.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import importlib.util
import numbers
import os
import random
import signal
import struct
import sys
import tempfile
import textwrap
import threading
import types
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from groundup.exercises import sandbox
from groundup.exercises.checking import (
    MESSAGE_WIDTH,
    Forbidden,
    Mismatch,
    ReaderError,
    Verdict,
    call_reader,
    expect,
    expect_integer,
    run_checks,
)
from groundup.models import GPT, GPTConfig
from groundup.positional import RotaryEmbedding

__all__ = ["check_quantize_q8_0", "check_dequantize_q6_k", "check_rotary_permutation", "check_unpermute_rows",
           "check_read_array", "check_llama_parameter_count", "check_write_gguf"]


# ---- shared: refusing the package's solutions, threads and processes --------------------------------------------

_SPAWN_HINT = ("Compute the answer in your function itself: the checker watches the thread your function runs in, "
               "so it refuses new threads and processes (threading, concurrent.futures, multiprocessing, "
               "subprocess, os.system) and signals, in which a call of the book's or gguf's solution would go "
               "unseen.")
_PROFILE_HINT = "Leave sys.setprofile alone: the checker records the calls your function makes with it."


def _code_objects(code: types.CodeType):
    """``code`` and every code object defined inside it (functions, methods, classes), recursively."""
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _code_objects(const)


def _code_key(code: types.CodeType) -> tuple:
    """What a function's code is, whatever its file, name or line: its bytecode, constants, global and attribute
    names and local names (a copy with another ``co_filename`` or ``co_name`` has the same key)."""
    return code.co_code, code.co_consts, code.co_names, code.co_varnames


@functools.cache
def _module_code(module: str) -> tuple[str, dict[tuple, str]]:
    """The real path of ``module``'s file (found, not imported) and the keys of the functions it defines (compiled
    afresh from its source) -> their names; comprehensions and lambdas are left out (generic: other files have
    the same ones)."""
    spec = importlib.util.find_spec(module)
    origin = spec.origin if spec is not None and spec.origin else ""
    keys: dict[tuple, str] = {}
    if origin.endswith(".py"):
        source = Path(origin).read_text(encoding="utf-8")
        for code in _code_objects(compile(source, origin, "exec")):
            if not code.co_name.startswith("<"):
                keys.setdefault(_code_key(code), f"{module}.{code.co_qualname}")
    return os.path.realpath(origin) if origin else "", keys


@functools.cache
def _watched_code(modules: tuple[str, ...]) -> tuple[dict[str, str], dict[tuple, str]]:
    """The real paths of ``modules``' files -> their names, and their functions' keys -> their names."""
    files: dict[str, str] = {}
    keys: dict[tuple, str] = {}
    for module in modules:
        origin, module_keys = _module_code(module)
        if origin:
            files[origin] = module
        keys.update(module_keys)
    return files, keys


@functools.cache
def _package_folder(package: str) -> str:
    """The real path of ``package``'s folder, ending with a separator ("" if it is not installed)."""
    spec = importlib.util.find_spec(package)
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    return os.path.join(os.path.realpath(folders[0]), "") if folders else ""


@functools.cache
def _spawners() -> tuple[dict[types.CodeType, str], dict[int, tuple[object, str]]]:
    """What starts a thread, a process or an interpreter, or sends a signal (whose handler runs in the main thread):
    Python functions (by code object) and built-in functions (by id, kept alive in the value) -> how the verdict
    names them; sys.setprofile (the recorder's off switch) is among the built-ins."""
    import _posixsubprocess
    import _thread
    import concurrent.futures
    import multiprocessing.process
    import subprocess

    python = {threading.Thread.start: "starts a thread (threading.Thread.start)",
              concurrent.futures.ThreadPoolExecutor.submit: "starts a thread (concurrent.futures.ThreadPoolExecutor)",
              concurrent.futures.ProcessPoolExecutor.submit:
              "starts a process (concurrent.futures.ProcessPoolExecutor)",
              multiprocessing.process.BaseProcess.start: "starts a process (multiprocessing.Process.start)",
              subprocess.Popen.__init__: "starts a process (subprocess.Popen)"}
    builtin = {_thread.start_new_thread: "starts a thread (_thread.start_new_thread)",
               sys.setprofile: "switches off the checker's record of calls (sys.setprofile)"}
    for name in ("system", "fork", "forkpty", "posix_spawn", "posix_spawnp", "execv", "execve"):
        if hasattr(os, name):
            builtin[getattr(os, name)] = f"starts a process (os.{name})"
    builtin[_posixsubprocess.fork_exec] = "starts a process (_posixsubprocess.fork_exec)"
    for module in ("_xxsubinterpreters", "_interpreters"):  # an interpreter of its own runs unwatched in this thread
        with contextlib.suppress(ImportError):
            builtin[importlib.import_module(module).create] = f"starts an interpreter ({module}.create)"
    if hasattr(_thread, "start_joinable_thread"):  # Python 3.13
        builtin[_thread.start_joinable_thread] = "starts a thread (_thread.start_joinable_thread)"
    # a signal's handler runs in the main thread, which may be the judge's: unwatched too
    for owner, name in ((os, "kill"), (os, "killpg"), (signal, "raise_signal"), (signal, "pthread_kill"),
                        (signal, "setitimer"), (signal, "alarm")):
        if hasattr(owner, name):
            builtin[getattr(owner, name)] = f"sends a signal ({owner.__name__}.{name})"
    return ({f.__code__: label for f, label in python.items()},
            {id(f): (f, label) for f, label in builtin.items()})


@functools.cache
def _source_readers() -> dict[types.CodeType, str]:
    """Functions that read a file's text (``inspect.getsource`` goes through linecache) -> "argument naming the
    file:the function's name"."""
    import linecache
    import tokenize

    readers = {linecache.getlines: "filename", linecache.updatecache: "filename", tokenize.open: "filename",
               Path.read_text: "self", Path.read_bytes: "self"}
    return {f.__code__: f"{argument}:{f.__module__}.{f.__qualname__}" for f, argument in readers.items()}


_real_path = functools.lru_cache(maxsize=4096)(os.path.realpath)


class _Watch:
    """While it is active, a profile function (``sys.setprofile``; the sandbox runs the reader's function with the
    judge's) records in ``seen``, as (what, hint), what the reader's function does that the checker refuses:

    - a call of a Python function of ``modules`` or of ``packages`` (importing one of them is not a call), or of a
      function whose code is one of theirs under another file or name (its key, :func:`_code_key`);
    - reading the source of one of their files (through linecache, as ``inspect.getsource`` does, tokenize or
      pathlib);
    - starting a thread, a process or an interpreter, or sending a signal (the recorder sees the reader's thread
      only: other threads, processes and the main thread's signal handlers would be out of its sight), or switching
      the recorder off: these are stopped on the spot, with an exception.

    The judge's own thread is not watched."""

    def __init__(self, modules: tuple[str, ...], packages: tuple[str, ...], hint: str):
        self.hint, self.seen = hint, []
        self.files, self.keys = _watched_code(modules)
        self.folders = {folder: package for package in packages if (folder := _package_folder(package))}
        self.spawn_code, self.spawn_builtins = _spawners()
        self.readers = _source_readers()
        self.verdicts: dict[int, tuple[types.CodeType, str, str]] = {}  # id(code) -> (code, kind, label)
        self.judge = threading.get_ident()
        self.run_code = sandbox._run.__code__  # the worker's frame that sets and unsets the profile

    def module_of(self, filename) -> str:
        """The watched module ``filename`` is the file of ("" if none)."""
        if not isinstance(filename, str) or not filename or filename.startswith("<"):
            return ""
        path = _real_path(filename)
        if path in self.files:
            return self.files[path]
        for folder, package in self.folders.items():
            if path.startswith(folder):
                return f"{package}.{Path(path[len(folder):]).with_suffix('').as_posix().replace('/', '.')}"
        return ""

    def judge_code(self, code: types.CodeType) -> tuple[str, str]:
        """(kind, label) of ``code``: "file" (a function of a watched module), "copy" (one's code elsewhere),
        "spawn", "reader" or "" (none of these)."""
        if code in self.spawn_code:
            return "spawn", self.spawn_code[code]
        if code in self.readers:
            return "reader", self.readers[code]
        module = self.module_of(code.co_filename)
        if module:
            return "file", f"{module}.{code.co_qualname}"
        label = self.keys.get(_code_key(code)) if not code.co_name.startswith("<") else None
        return ("copy", label) if label else ("", "")

    def importing(self, frame) -> bool:
        """Whether a watched module's own code runs as it is imported: not a call of the solution."""
        while frame is not None:
            if frame.f_code.co_name == "<module>" and self.module_of(frame.f_code.co_filename):
                return True
            frame = frame.f_back
        return False

    def stop(self, what: str, hint: str):
        self.seen.append((what, hint))
        raise sandbox.PackageCall(what)

    def profile(self, frame, event, arg):
        if event == "c_call":
            entry = self.spawn_builtins.get(id(arg))
            if entry is not None and entry[0] is arg and frame.f_code is not self.run_code and \
                    threading.get_ident() != self.judge:
                self.stop(entry[1], _PROFILE_HINT if arg is sys.setprofile else _SPAWN_HINT)
            return
        if event != "call" or threading.get_ident() == self.judge:
            return
        code = frame.f_code
        verdict = self.verdicts.get(id(code))
        if verdict is None:
            try:
                kind_and_label = self.judge_code(code)
            except Exception:  # noqa: BLE001 -- an odd file name, say: never the reader's error
                kind_and_label = ("", "")
            verdict = self.verdicts[id(code)] = (code, *kind_and_label)
        _, kind, label = verdict
        if not kind:
            return
        if kind == "spawn":
            self.stop(label, _SPAWN_HINT)
        elif kind == "reader":
            argument, reader = label.split(":")
            target = frame.f_locals.get(argument)
            module = self.module_of(os.fspath(target)) if isinstance(target, (str, os.PathLike)) else ""
            if module:
                self.seen.append((f"reads the source of {module} ({reader})", self.hint))
        elif kind == "copy" or not self.importing(frame):
            self.seen.append((f"calls {label}", self.hint))


@contextlib.contextmanager
def _watching(modules: tuple[str, ...], packages: tuple[str, ...], hint: str):
    """A :class:`_Watch` active while the body runs (the reader's function picks up the judge's profile)."""
    watch = _Watch(modules, packages, hint)
    previous = sys.getprofile()
    sys.setprofile(watch.profile)
    try:
        yield watch
    finally:
        sys.setprofile(previous)


def _call(fn: Callable, *args, call: str, names: tuple[str, ...], hint: str, modules: tuple[str, ...] = (),
          packages: tuple[str, ...] = (), forbid: tuple = ()):
    """``call_reader(fn, *args)``, refusing (with ``hint``) an answer that called into ``modules`` or ``packages``
    or ``forbid``, even one that then raised or caught the error, and one that started a thread or a process."""
    with _watching(modules, packages, hint) as watch:
        try:
            out = call_reader(fn, *args, call=call, names=names, forbid=forbid)
        except ReaderError:
            if not watch.seen:
                raise
            out = None
        except Mismatch as refused:  # a tripwire of ``forbid`` (or an input changed in place)
            if watch.seen:  # what the record saw came first (a tripwire inside gguf's quantize_blocks, say)
                out = None
            elif not refused.what.startswith(f"{call} calls ") or _own_hint(refused.what, forbid):
                raise
            else:  # the exercise's hint unless the item has its own
                raise Mismatch(refused.what, hint) from None
    if watch.seen:
        what, why = watch.seen[0]
        raise Mismatch(f"{call} {what}", why)
    return out


def _own_hint(what: str, forbid: tuple) -> bool:
    """Whether the tripwire named at the end of ``what`` is a :class:`Forbidden` with a hint of its own."""
    return any(isinstance(item, Forbidden) and item.hint and what.endswith(f" calls {item.label}") for item in forbid)


def _gguf_missing(title: str) -> Verdict | None:
    """A verdict saying that the ``gguf`` package, the reference of the checker ``title``, is missing; else None."""
    try:
        import gguf  # noqa: F401
        import gguf.quants  # noqa: F401
    except Exception as err:  # noqa: BLE001 -- missing or broken: either way there is nothing to compare with
        print(textwrap.fill(f"⚠️ {title}: this checker compares your answer with the gguf package (llama.cpp's "
                            f"Python library), which could not be imported ({type(err).__name__}: {err}). Install "
                            "it with `pip install gguf` and run the cell again.", MESSAGE_WIDTH,
                            subsequent_indent="   ", break_long_words=False, break_on_hyphens=False))
        return Verdict(False, checker_error=True)
    return None


_QUANT_MODULES = ("groundup.quantization", "groundup.kquants", "groundup.quantized_linear", "groundup.gguf",
                  "gguf.quants", "gguf.gguf_reader", "gguf.lazy")


def _entry_points(*names: str) -> tuple:
    """The plain functions ``module.attribute`` among ``names``, for tripwires (which also catch a call from a thread
    that was already running: the record of calls sees the reader's own thread only)."""
    found = []
    for name in names:
        module, _, attribute = name.rpartition(".")
        fn = getattr(sys.modules.get(module) or importlib.import_module(module), attribute, None)
        if isinstance(fn, types.FunctionType) and not fn.__code__.co_freevars:
            found.append(fn)
    return tuple(found)


def _expect_bytes_tensor(value, call: str, n: int, what: str) -> torch.Tensor:
    """``value`` if it is a 1-D torch.uint8 tensor of ``n`` bytes, else a Mismatch saying what it is instead."""
    if isinstance(value, (bytes, bytearray, np.ndarray)):
        raise Mismatch(f"{call} returned a {type(value).__name__}, expected a 1-D torch.uint8 tensor",
                       "Turn it into a tensor: torch.frombuffer(bytearray(b), dtype=torch.uint8) for bytes, "
                       "torch.from_numpy(a) for a NumPy array.")
    expect(isinstance(value, torch.Tensor), f"{call} returned {type(value).__name__}, expected a 1-D torch.uint8 "
           "tensor", "Did you forget the `return` statement?" if value is None else "Return a torch.uint8 tensor.")
    if value.dtype == torch.int8:
        raise Mismatch(f"{call} returned a torch.int8 tensor, expected torch.uint8",
                       "The bytes are the same, only their type differs: return t.view(torch.uint8).")
    expect(value.dtype == torch.uint8, f"{call} returned a tensor of dtype {value.dtype}, expected torch.uint8",
           "Return the bytes themselves: d as two bytes (d.view(torch.uint8) of a float16 tensor) and each q_j "
           "as one byte (q.to(torch.int8).view(torch.uint8)).")
    expect(value.dim() == 1, f"{call} returned a tensor of shape {tuple(value.shape)}, expected a 1-D tensor of "
           f"{n} bytes", "Put the blocks one after the other: t.reshape(-1).")
    expect(value.numel() == n, f"{call} returned {value.numel()} bytes, expected {n} ({what})",
           "Every block of 32 weights takes 34 bytes: 2 for d (float16), then 32 for the q_j (one byte each)."
           if value.numel() != n * 36 // 34 else
           "d takes 2 bytes: it is stored as a float16 (d.to(torch.float16)), not a float32.")
    return value


# ---- Exercise 12.1: a Q8_0 quantizer -----------------------------------------------------------------------


def _round_half_away(v: torch.Tensor) -> torch.Tensor:
    """C's roundf: to the nearest integer, halves away from zero (exact in floating point)."""
    a = v.abs()
    whole = a.floor()
    return v.sign() * (whole + (2 * (a - whole)).floor())


_ROUNDINGS = {"away": _round_half_away, "even": torch.round, "trunc": torch.trunc,
              "floor": lambda v: v.sign() * (v.abs() + 0.5).floor()}


def _q8_0_variant(x: torch.Tensor, *, rounding: str = "away", divide: bool = False, scale: str = "float32",
                  order: str = "d first") -> torch.Tensor:
    """Q8_0 bytes of ``x`` computed the right way (the defaults) or one of the plausible wrong ways."""
    blocks = x.reshape(-1, 32).to(torch.float64 if scale == "float64" else torch.float32)
    d = blocks.abs().amax(dim=1, keepdim=True) / 127
    if scale == "float16":
        d = d.to(torch.float16).to(torch.float32)
    zero = d == 0
    v = torch.where(zero, 0.0, blocks / torch.where(zero, 1.0, d)) if divide else \
        blocks * torch.where(zero, 0.0, 1 / torch.where(zero, 1.0, d))
    q = _ROUNDINGS[rounding](v).clamp(-128, 127).to(torch.int8).view(torch.uint8)
    scale_bytes = d.to(torch.float16).view(torch.uint8)
    if order == "big-endian":
        scale_bytes = scale_bytes.flip(1)
    parts = [q, scale_bytes] if order == "q first" else [scale_bytes, q]
    return torch.cat(parts, dim=1).reshape(-1)


_Q8_0_MISTAKES = (
    ({"rounding": "even"}, "torch.round rounds halves to the even integer (2.5 -> 2, -2.5 -> -2); llama.cpp's "
     "roundf rounds them away from zero (2.5 -> 3, -2.5 -> -3)."),
    ({"rounding": "floor"}, "floor(|v| + 0.5) is not roundf in float32: for v = 0.49999997 the sum v + 0.5 is "
     "itself rounded, to 1.0, before the floor. Round in two exact steps: with a = |v|, floor(a) + floor(2 (a - "
     "floor(a))), times the sign of v."),
    ({"rounding": "trunc"}, "Converting to int8 cuts the fraction off (2.7 -> 2, -2.7 -> -2): round first."),
    ({"divide": True}, "llama.cpp multiplies by the reciprocal, q_j = roundf(x_j * id) with id = 1/d computed once "
     "per block in float32, rather than dividing by d: x_j * (1/d) and x_j / d can differ in the last bit, and a "
     "value on a tie then rounds the other way."),
    ({"scale": "float16"}, "Compute id = 1/d from the float32 d = max|x| / 127; only the copy of d written to the "
     "block is rounded to float16."),
    ({"scale": "float64"}, "Compute in float32, as llama.cpp does: d, 1/d and x_j * (1/d) in float64 round "
     "differently."),
    ({"order": "q first"}, "Each block starts with d (2 bytes), then come its 32 q_j."),
    ({"order": "big-endian"}, "d is stored little-endian: its low byte first (what d.to(torch.float16)"
     ".view(torch.uint8) gives on every common machine)."),
)


def _q8_0_blocks_with_divide_mismatch() -> torch.Tensor:
    """A block whose largest |x| gives a d for which x * (1/d) and x / d round differently for some x_j on a tie:
    found by a seeded search, so that the block is the same on every run."""
    rng = np.random.default_rng(1207)
    amax = rng.uniform(0.5, 2.0, 4096).astype(np.float32)
    d = amax / np.float32(127)
    inv = np.float32(1) / d
    k = np.arange(127, dtype=np.float32) + np.float32(0.5)
    x = (k[None, :] * d[:, None]).astype(np.float32)
    by_inverse = np.floor(x * inv[:, None] + np.float32(0.5))
    by_division = np.floor(x / d[:, None] + np.float32(0.5))
    hits = np.nonzero((by_inverse != by_division).any(axis=1))[0]
    if hits.size == 0:
        raise RuntimeError("no block found where x * (1/d) and x / d round differently")
    row = hits[0]
    values = x[row][by_inverse[row] != by_division[row]][:15]
    block = np.zeros(32, dtype=np.float32)
    block[0] = amax[row]
    block[1:1 + values.size] = values
    block[16:16 + values.size] = -values
    return torch.from_numpy(block)


def _q8_0_cases() -> list[tuple[str, torch.Tensor]]:
    """(description, x) for the checker: float32 matrices whose rows are a whole number of 32-weight blocks."""
    g = torch.Generator().manual_seed(1201)
    scales = torch.tensor([1e-3, 0.02, 1.0, 300.0]).repeat_interleave(32)
    random_rows = torch.randn(3, 128, generator=g) * scales
    ties = torch.tensor([127.0, 2.5, -2.5, 0.5, -0.5, 1.5, -1.5, 3.5, -3.5, 126.5, -126.5, 0.49999997, -0.49999997,
                         1.4999999, -1.4999999, 63.5, -63.5, 0.0, 2.4999998, 7.5, -7.5, 11.5, 20.5, -20.5, 99.5,
                         -99.5, 100.5, 0.25, -0.75, 5.5, -5.5, 9.5])
    negative = torch.randn(32, generator=g)
    negative[7] = -4.0  # the largest |x| is negative: its q is -127
    opposite = torch.linspace(-1.0, 1.0, 32)  # -1 and +1: q = -127 and 127
    huge = torch.randn(32, generator=g) * 0.01
    huge[20] = 5000.0  # one outlier: the block's other q_j round to 0 or +-1
    divide = _q8_0_blocks_with_divide_mismatch()
    return [("three rows of random weights at scales 0.001, 0.02, 1 and 300", random_rows),
            ("a block of ties x/d = k + 1/2 (d = 1) and values just below them, and the same block / 16",
             torch.stack([ties, ties / 16])),
            ("a block whose largest |x| is negative, a block from -1 to 1, an all-zero block, a block with one huge "
             "weight", torch.stack([negative, opposite, torch.zeros(32), huge]).reshape(2, 64)),
            ("a block where x_j * (1/d) lies on a tie", divide[None]),
            ("an 8 x 256 matrix of weights like a model's", torch.randn(8, 256, generator=g) * 0.02)]


def _q8_0_difference(x: torch.Tensor, got: torch.Tensor, expected: torch.Tensor) -> str:
    """Where ``got`` first differs from ``expected``, said in terms of the block, d and the q_j."""
    cols = x.shape[1]
    for b in range(expected.numel() // 34):
        e, o = expected[34 * b:34 * b + 34], got[34 * b:34 * b + 34]
        if torch.equal(e, o):
            continue
        per_row = cols // 32
        first = 32 * (b % per_row)
        where = f"block {b} (row {b // per_row}, weights {first}..{first + 31})"
        if not torch.equal(e[:2], o[:2]):
            d_e, d_o = e[:2].view(torch.float16).item(), o[:2].view(torch.float16).item()
            return f"{where}: d is {d_o:.6g} (bytes {o[:2].tolist()}), expected {d_e:.6g} (bytes {e[:2].tolist()})"
        j = int((e[2:] != o[2:]).nonzero()[0])
        q_e, q_o = int(e[2 + j:3 + j].view(torch.int8)), int(o[2 + j:3 + j].view(torch.int8))
        value = float(x.reshape(-1, 32)[b, j])
        return f"{where}: q_{j} is {q_o}, expected {q_e} (x_{j} = {value!r})"
    return "the bytes differ"


def check_quantize_q8_0(fn: Callable) -> Verdict:
    """Exercise 12.1: ``fn(x) -> raw``, a float32 matrix (rows a whole number of 32-weight blocks) as llama.cpp's
    Q8_0 bytes (a 1-D torch.uint8 tensor), bit for bit those of ``gguf.quants.quantize``. Calls into the package's
    quantization modules and the ``gguf`` package are refused."""
    title = "Exercise 12.1 (a Q8_0 quantizer)"
    missing = _gguf_missing(title)
    if missing is not None:
        return missing
    from gguf import GGMLQuantizationType
    from gguf import quants as gguf_quants

    hint = ("This exercise asks for the quantizer itself: groundup.quantization and the gguf package are the "
            "book's and llama.cpp's solutions. Use torch operations on the block (abs, amax, floor, ...).")

    entry_points = _entry_points("gguf.quants.quantize", "gguf.quants.np_roundf", "groundup.quantization.quantize",
                                 "groundup.quantization.quantize_q8_0", "groundup.quantization.round_half_away",
                                 "groundup.quantization.q8_0_encode_blocks")

    def checks():
        cases = _q8_0_cases()
        expected = [torch.from_numpy(gguf_quants.quantize(x.numpy(), GGMLQuantizationType.Q8_0).reshape(-1).copy())
                    for _, x in cases]
        for (what, x), want in zip(cases, expected):
            call = f"my_quantize_q8_0(x) for {what}, x of shape {tuple(x.shape)}"
            out = _call(fn, x, call=call, names=("x",), modules=_QUANT_MODULES, hint=hint,
                        forbid=(_q8_0_variant, _round_half_away, _q8_0_cases, *entry_points))
            got = _expect_bytes_tensor(out, call, want.numel(), f"{x.numel() // 32} blocks of 34 bytes")
            if torch.equal(got, want):
                continue
            for change, mistake in _Q8_0_MISTAKES:
                if torch.equal(got, _q8_0_variant(x, **change)):
                    raise Mismatch(f"{call}: {_q8_0_difference(x, got, want)}", mistake)
            zero_block = [b for b in range(want.numel() // 34) if not want[34 * b:34 * b + 34].any()]
            if any(not torch.equal(got[34 * b:34 * b + 34], want[34 * b:34 * b + 34]) for b in zero_block):
                raise Mismatch(f"{call}: {_q8_0_difference(x, got, want)}",
                               "An all-zero block has d = 0: write d = 0 and every q_j = 0 (llama.cpp sets "
                               "id = 0 rather than dividing by zero).")
            raise Mismatch(f"{call}: {_q8_0_difference(x, got, want)}",
                           "Per block of 32: d = max|x_j| / 127 and id = 1/d (0 if d = 0) in float32, q_j = "
                           "roundf(x_j * id) with halves away from zero; write d as a little-endian float16, then "
                           "the 32 q_j as int8.")

    return run_checks(title, checks, "Your bytes are gguf.quants.quantize's, bit for bit: random weights at four "
                      "scales, ties, negative extremes, an all-zero block, an outlier and several rows.")


# ---- Exercise 12.2: decoding Q6_K --------------------------------------------------------------------------

_Q6_K_BYTES = 210


def _q6_k_variant(raw: torch.Tensor, *, offset: int = 32, signed_scales: bool = True, nibbles: str = "halves",
                  high: str = "pairs", d_first: bool = False) -> torch.Tensor:
    """Q6_K super-blocks decoded the right way (the defaults, ggml's dequantize_row_q6_K) or a plausible wrong
    way: float32 ``(n * 256,)``."""
    blocks = raw.reshape(-1, _Q6_K_BYTES)
    n = blocks.shape[0]
    body, d_bytes = (blocks[:, 2:], blocks[:, :2]) if d_first else (blocks[:, :208], blocks[:, 208:])
    ql, qh = body[:, :128].to(torch.int64), body[:, 128:192].to(torch.int64)
    scales = body[:, 192:208].contiguous().view(torch.int8 if signed_scales else torch.uint8)
    d = d_bytes.contiguous().view(torch.float16).to(torch.float32)  # (n, 1)
    if nibbles == "halves":  # per half: low nibbles of its 64 bytes -> weights 0-63, high nibbles -> 64-127
        low = (ql.reshape(n, 2, 1, 64) >> torch.tensor([0, 4]).reshape(1, 1, 2, 1)) & 0x0F
    elif nibbles == "whole":  # low nibbles of all 128 bytes -> weights 0-127, high -> 128-255
        low = (ql.reshape(n, 1, 128) >> torch.tensor([0, 4]).reshape(1, 2, 1)) & 0x0F
    else:  # "neighbours": byte b -> weights 2b (low) and 2b + 1 (high)
        low = (ql.reshape(n, 128, 1) >> torch.tensor([0, 4]).reshape(1, 1, 2)) & 0x0F
    if high == "pairs":  # bits 2k, 2k+1 of byte l of a half -> weight 32 k + l of that half
        top = (qh.reshape(n, 2, 1, 32) >> torch.tensor([0, 2, 4, 6]).reshape(1, 1, 4, 1)) & 3
    elif high == "reversed":
        top = (qh.reshape(n, 2, 1, 32) >> torch.tensor([6, 4, 2, 0]).reshape(1, 1, 4, 1)) & 3
    else:  # "neighbours": byte b -> weights 4b..4b+3
        top = (qh.reshape(n, 64, 1) >> torch.tensor([0, 2, 4, 6]).reshape(1, 1, 4)) & 3
    q = (low.reshape(n, 256) | (top.reshape(n, 256) << 4)) - offset
    step = d * scales.to(torch.float32)  # (n, 16), exact: float16 d times an 8-bit integer
    return (step.repeat_interleave(16, dim=1) * q.to(torch.float32)).reshape(-1)


_Q6_K_MISTAKES = (
    ({"offset": 0}, "q is stored with an offset: the 6 bits hold 0..63 for q - 32 in -32..31. Subtract 32."),
    ({"signed_scales": False}, "The 16 scales are signed bytes: read bytes 192..207 as torch.int8 "
     "(raw[192:208].view(torch.int8)), not as uint8."),
    ({"nibbles": "neighbours"}, "The two nibbles of a ql byte are not neighbouring weights. In each half of 128 "
     "weights (ql bytes 0-63, then 64-127), byte l gives weight l (low nibble, l < 64) and weight 64 + l (high "
     "nibble)."),
    ({"nibbles": "whole"}, "ql is split in two halves: bytes 0-63 serve weights 0-127 (low nibbles 0-63, high "
     "nibbles 64-127), bytes 64-127 serve weights 128-255 the same way."),
    ({"high": "reversed"}, "The bit pairs of a qh byte count from the lowest: bits 0-1 of qh byte l go to weight l "
     "of its half, bits 2-3 to weight 32 + l, bits 4-5 to 64 + l, bits 6-7 to 96 + l."),
    ({"high": "neighbours"}, "The four bit pairs of a qh byte are not neighbouring weights: in each half (qh bytes "
     "0-31, then 32-63), byte l gives the top two bits of weights l, 32 + l, 64 + l and 96 + l of that half."),
    ({"d_first": True}, "d is at the end of the super-block: bytes 208-209 of the 210 (ql, qh, scales, then d)."),
)


_Q6_K_LAYOUT = ("A super-block is two halves of 128 weights, each with 64 ql bytes and 32 qh bytes of its own. In a "
                "half, the low nibble of ql byte l gives the low four bits of weight l and its high nibble those of "
                "weight 64 + l; the bit pairs of qh byte l, from the lowest, give the top two bits of weights l, "
                "32 + l, 64 + l and 96 + l. Then x = d * s * (q - 32), with the scale s of the weight's sub-block "
                "of 16 read as int8 and d the float16 in the last two bytes.")


def _q6_k_cases() -> list[tuple[str, torch.Tensor]]:
    """(description, raw) for the checker: random super-blocks with a finite float16 d, then extremes."""
    g = torch.Generator().manual_seed(1202)

    def super_blocks(d_values, fill=None):
        raw = torch.randint(0, 256, (len(d_values), _Q6_K_BYTES), generator=g, dtype=torch.uint8)
        if fill is not None:
            raw[:, :192] = fill
        raw[:, 208:] = torch.tensor(d_values, dtype=torch.float16).reshape(-1, 1).view(torch.uint8)
        return raw

    rand_d = (torch.randn(4, generator=g) * 1e-3).tolist()
    extremes = super_blocks([65504.0, -2.0 ** -24, 0.0, -1.5], fill=None)
    extremes[0, 192:208] = torch.tensor([-128, 127] * 8, dtype=torch.int8).view(torch.uint8)
    extremes[3, :192] = 0xFF  # every q = 63 - 32 = 31
    all_zero_q = super_blocks([0.75], fill=0)  # every q = 0 - 32 = -32
    return [("one super-block of random bytes with d = 1", super_blocks([1.0]).reshape(-1)),
            ("four random super-blocks with d of size about 0.001", super_blocks(rand_d).reshape(-1)),
            ("super-blocks with d = 65504, -2^-24 (the negative float16 of smallest magnitude), 0 and -1.5, scales "
             "-128 and 127, all q = 63 and all q = 0", torch.cat([extremes, all_zero_q]).reshape(-1))]


def check_dequantize_q6_k(fn: Callable) -> Verdict:
    """Exercise 12.2: ``fn(raw) -> x``, Q6_K super-blocks (a 1-D torch.uint8 tensor of n * 210 bytes) decoded into
    their n * 256 float32 numbers, equal to ``gguf.quants.dequantize``'s. Calls into the package's quantization
    modules and the ``gguf`` package are refused."""
    title = "Exercise 12.2 (decoding Q6_K)"
    missing = _gguf_missing(title)
    if missing is not None:
        return missing
    from gguf import GGMLQuantizationType
    from gguf import quants as gguf_quants

    hint = ("This exercise asks you to take the bytes apart yourself: groundup.quantization, groundup.kquants and "
            "the gguf package are the book's and llama.cpp's decoders. Use slicing, view, & and >>.")

    entry_points = _entry_points("gguf.quants.dequantize", "groundup.quantization.dequantize",
                                 "groundup.quantization.dequantize_parts", "groundup.quantization.block_parts")

    def checks():
        cases = _q6_k_cases()
        expected = [torch.from_numpy(gguf_quants.dequantize(raw.numpy(), GGMLQuantizationType.Q6_K).copy())
                    for _, raw in cases]
        for (what, raw), want in zip(cases, expected):
            if not torch.isfinite(want).all():
                raise RuntimeError(f"the checker's case {what!r} decodes to non-finite numbers")
            n = raw.numel() // _Q6_K_BYTES
            call = f"my_dequantize_q6_k(raw) for {what} ({raw.numel()} bytes)"
            got = _call(fn, raw, call=call, names=("raw",), modules=_QUANT_MODULES, hint=hint,
                        forbid=(_q6_k_variant, _q6_k_cases, *entry_points))
            expect(type(got) is torch.Tensor, f"{call} returned {type(got).__name__}, expected a float32 tensor",
                   "Did you forget the `return` statement?" if got is None else "Return a 1-D torch.float32 tensor.")
            expect(got.dtype == torch.float32, f"{call} returned a tensor of dtype {got.dtype}, expected "
                   "torch.float32", "Compute in float32, as llama.cpp does: d (float16) widened to float32, times "
                   "the scale, times q - 32.")
            expect(got.shape == (256 * n,), f"{call} returned shape {tuple(got.shape)}, expected ({256 * n},)",
                   "Each super-block of 210 bytes holds 256 weights; put them one after the other in a 1-D tensor.")
            if torch.equal(got, want):
                continue
            mistake = next((advice for change, advice in _Q6_K_MISTAKES
                            if torch.equal(got, _q6_k_variant(raw, **change))), _Q6_K_LAYOUT)
            i = int((got != want).nonzero()[0])
            raise Mismatch(f"{call}: weight {i % 256} of super-block {i // 256} is {got[i].item():.6g}, expected "
                           f"{want[i].item():.6g}", mistake)

    return run_checks(title, checks, "Your numbers are gguf.quants.dequantize's, bit for bit: random super-blocks, "
                      "extreme d (65504, -2^-24, 0), the extreme scales and q.")


# ---- Exercise 12.3 -----------------------------------------------------------------------------------------


def _rope(x: torch.Tensor, t: int, half: bool) -> torch.Tensor:
    """Rotary embedding of one vector at position t: interleaved pairs (2i, 2i+1) or halves (i, i + d/2)."""
    rotary = RotaryEmbedding(x.shape[-1], pairing="half" if half else "interleaved")
    return rotary.apply_rotary(x[None], torch.tensor([t]))[0]


def _rotary_hint(perm: list[int]) -> str:
    """Where ``perm`` first goes wrong, without giving the whole permutation away."""
    half = len(perm) // 2
    for i in range(half):
        a, b = perm[2 * i], perm[2 * i + 1]
        if {a, b} == {i, i + half}:
            if a != i:
                return (f"Positions {2 * i} and {2 * i + 1} hold the right pair of dimensions in the wrong order: a "
                        "rotation turns the first of a pair towards the second, so the order matters.")
            continue
        return (f"The interleaved pairing rotates positions {2 * i} and {2 * i + 1} of x[perm] together at "
                f"frequency {i}, but rotate-half does not rotate x[{a}] and x[{b}] together at that frequency. "
                f"Which two dimensions does rotate-half pair at frequency {i}?")
    return ""


def _expect_index_list(perm, d: int, call: str) -> list[int]:
    """``perm`` (a list, tuple or 1-D tensor of ``d`` integers) as a list of ints; a :class:`Mismatch` naming what is
    wrong with it otherwise (the container, the length, or the kind of its entries)."""
    kind = "a tensor" if isinstance(perm, torch.Tensor) else f"a {type(perm).__name__}"
    if isinstance(perm, torch.Tensor):
        perm = perm.tolist() if perm.dim() == 1 else perm
    expect(isinstance(perm, (list, tuple)), f"{call} returned {type(perm).__name__}", f"Return a list of {d} ints.")
    expect(len(perm) == d, f"{call} returned {kind} of {len(perm)} {'entry' if len(perm) == 1 else 'entries'}, "
           f"expected {d}", f"Return a list of {d} ints: one index of x for each position of x[perm].")
    bad = [i for i in perm if not isinstance(i, numbers.Integral) or isinstance(i, bool)]
    if bad:
        raise Mismatch(f"{call} returned {kind} whose entries are {type(bad[0]).__name__} (e.g. {bad[0]!r})",
                       "The entries must be ints: indices into x (int(i) for i in ...).")
    return [int(i) for i in perm]


def check_rotary_permutation(fn: Callable) -> Verdict:
    """Exercise 12.3: ``fn(d_head) -> perm`` (a list of d_head ints) with
    ``rope_interleaved(x[perm], t) == rope_half(x, t)[perm]`` for every vector x and position t. Calls into the
    package's rotary embedding and loader (groundup.positional, groundup.pretrained) and into transformers, with
    which a permutation could be searched for rather than found, are refused."""
    hint = ("This exercise asks you to find the permutation by pairing the dimensions yourself: groundup.positional, "
            "groundup.pretrained and transformers are the book's and Hugging Face's rotary code. Build the list "
            "from the two pairings: which dimensions does each rotate together at frequency i?")

    def checks():
        g = torch.Generator().manual_seed(3)
        for d in (2, 4, 8, 16):
            expected = [j for i in range(d // 2) for j in (i, i + d // 2)]
            call = f"my_rotary_permutation({d})"
            perm = _expect_index_list(_call(fn, d, call=call, names=("d_head",), hint=hint,
                                            modules=("groundup.positional", "groundup.pretrained"),
                                            packages=("transformers",), forbid=(_rope, _rotary_hint)), d, call)
            expect(sorted(perm) == list(range(d)), f"{call} = {list(perm)} is not a permutation of 0..{d - 1}",
                   "Every index must appear exactly once.")
            x = torch.randn(d, generator=g, dtype=torch.float64)
            for t in (0, 1, 7):
                lhs, rhs = _rope(x[list(perm)], t, half=False), _rope(x, t, half=True)[list(perm)]
                if not torch.allclose(lhs, rhs, rtol=1e-12, atol=1e-12):
                    raise Mismatch(f"{call} = {list(perm)}: rotating x[perm] with interleaved pairs differs from "
                                   f"permuting the rotate-half result at position t = {t}",
                                   _rotary_hint(list(perm)) if perm != expected else "")

    return run_checks("Exercise 12.3 (rotate-half to interleaved)", checks,
                      "Your permutation turns LLaMA's rotate-half pairing into the book's interleaved one.")


# ---- Exercise 12.4: undoing llama.cpp's permutation of W_Q and W_K -------------------------------------------


def _llama_cpp_permute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """What llama.cpp's converter (convert_hf_to_gguf.py, ``permute``) does to the rows of W_Q or W_K: within each
    head, row ``i`` goes to ``2i`` and row ``i + d_h/2`` to ``2i + 1``."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _unpermute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """The inverse of :func:`_llama_cpp_permute`: the file's rows back in Hugging Face's rotate-half order."""
    return w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_TINY_LLAMA = dict(vocab_size=40, context_length=12, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48,
                   positional="rope", norm="rmsnorm", activation="swiglu", bias=False, tie_weights=False)


def _tiny_gguf_model() -> tuple[GPT, torch.Tensor, torch.Tensor]:
    """A random LLaMA-style GPT with the interleaved pairing of a GGUF file (float64), a batch of tokens and its
    logits."""
    g = torch.Generator().manual_seed(1204)
    model = GPT(GPTConfig(**_TINY_LLAMA, rope_pairing="interleaved")).double().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.3)
        idx = torch.randint(0, _TINY_LLAMA["vocab_size"], (2, 10), generator=g)
        return model, idx, model(idx)[0]


def _half_model_logits(model: GPT, rows: dict[str, torch.Tensor], idx: torch.Tensor) -> torch.Tensor:
    """The logits of ``model`` rebuilt with the rotate-half pairing and the rows of W_q / W_k given in ``rows``."""
    half = GPT(dataclasses.replace(model.config, rope_pairing="half")).double().eval()
    state = {**model.state_dict(), **{name: t.to(torch.float64) for name, t in rows.items()}}
    half.load_state_dict(state)
    with torch.no_grad():
        return half(idx)[0]


_UNPERMUTE_MISTAKES = (
    (_llama_cpp_permute, "That is the converter's own permutation (row i of a head to row 2i, row i + d_h/2 to row "
     "2i + 1), applied a second time. Undo it instead: row 2i of each head goes back to row i, row 2i + 1 to row "
     "i + d_h/2. With Exercise 12.3's perm of one head: out[perm] = w, not w[perm]."),
    (lambda w, n: _unpermute(w, 1), "Each head's rows are permuted on their own: split the rows into n_heads blocks "
     "of d_h = rows / n_heads, un-permute every block, and keep the blocks in their order."),
    (lambda w, n: w.clone(), "The rows must move: the file's row 2i of a head is Hugging Face's row i, its row "
     "2i + 1 is row i + d_h/2."),
    (lambda w, n: _unpermute(w.T.contiguous(), n).T if w.shape[1] % (2 * n) == 0 else w.clone(),
     "Permute the rows (the output dimensions, one per row), not the columns."),
)


def check_unpermute_rows(fn: Callable) -> Verdict:
    """Exercise 12.4: ``fn(weight, n_heads) -> rows``: W_Q or W_K as a GGUF file stores it (rows of each of the
    ``n_heads`` heads reordered by llama.cpp's converter) back in Hugging Face's rotate-half order. Checked on random
    matrices against the inverse of the converter's permutation, then on a tiny random LLaMA: the GPT with
    ``rope_pairing="half"`` and the un-permuted rows must compute the logits of the GGUF-style GPT with
    ``rope_pairing="interleaved"``. Calls into groundup.pretrained are refused."""
    hint = ("This exercise asks for the permutation itself: write it with reshape and transpose, or index the rows "
            "with Exercise 12.3's perm (groundup.pretrained is the book's loader).")

    def judge(call: str, weight: torch.Tensor, n_heads: int, want: torch.Tensor) -> torch.Tensor:
        out = _call(fn, weight, n_heads, call=call, names=("weight", "n_heads"), modules=("groundup.pretrained",),
                    hint=hint, forbid=(_unpermute, _llama_cpp_permute, _half_model_logits, _tiny_gguf_model))
        expect(type(out) is torch.Tensor, f"{call} returned {type(out).__name__}, expected a tensor",
               "Did you forget the `return` statement?" if out is None else "Return a torch.Tensor.")
        expect(out.shape == weight.shape, f"{call} returned shape {tuple(out.shape)}, expected "
               f"{tuple(weight.shape)}", "Return the same rows in another order: the shape does not change.")
        expect(out.dtype == weight.dtype, f"{call} returned dtype {out.dtype}, expected {weight.dtype}",
               "A permutation moves numbers without computing anything: keep the dtype of weight.")
        if not torch.equal(out, want):
            for mistake, advice in _UNPERMUTE_MISTAKES:
                if torch.equal(out, mistake(weight, n_heads)):
                    raise Mismatch(f"{call}: the rows are in the wrong order", advice)
            d_h = weight.shape[0] // n_heads
            row = int((out != want).any(dim=1).nonzero()[0])
            raise Mismatch(f"{call}: row {row} (row {row % d_h} of head {row // d_h}, d_h = {d_h}) is not the "
                           "expected one", "Within each head, Hugging Face's row i is the file's row 2i and its "
                           "row i + d_h/2 is the file's row 2i + 1.")
        return out

    def checks():
        g = torch.Generator().manual_seed(124)
        shapes = [(1, 8, 3, torch.float64), (2, 16, 5, torch.float32), (3, 8, 4, torch.float64),
                  (8, 4, 6, torch.float32), (1, 2, 3, torch.float64)]
        for n_heads, d_h, d_in, dtype in shapes:
            weight = torch.randn(n_heads * d_h, d_in, generator=g, dtype=dtype)
            want = _unpermute(weight, n_heads)
            if not torch.equal(_llama_cpp_permute(want, n_heads), weight):
                raise RuntimeError("the checker's un-permutation is not the inverse of the converter's")
            judge(f"my_unpermute_rows(weight, n_heads={n_heads}) for weight {tuple(weight.shape)} (d_h = {d_h})",
                  weight, n_heads, want)
        model, idx, logits = _tiny_gguf_model()
        params = dict(model.named_parameters())
        heads = {"W_q": model.config.n_heads, "W_k": model.config.n_kv_heads}
        names = [f"blocks.{i}.attention.{w}.weight" for i in range(model.config.n_layers) for w in heads]
        wanted = {name: _unpermute(params[name].detach(), heads[name.split(".")[-2]]) for name in names}
        if not torch.allclose(_half_model_logits(model, wanted, idx), logits, rtol=1e-10, atol=1e-10):
            raise RuntimeError("the checker's un-permuted model does not compute the GGUF model's logits")
        rows = {}
        for name in names:
            weight, n = params[name].detach().clone(), heads[name.split(".")[-2]]
            call = (f"my_unpermute_rows(weight, n_heads={n}) for {name} {tuple(weight.shape)} of a tiny LLaMA with "
                    f"{model.config.n_heads} query and {model.config.n_kv_heads} key/value heads")
            rows[name] = judge(call, weight, n, wanted[name])
        got = _half_model_logits(model, rows, idx)
        expect(torch.allclose(got, logits, rtol=1e-10, atol=1e-10), "the GPT with rope_pairing='half' and your rows "
               "does not compute the GGUF model's logits", "Return the rows of weight, reordered, and nothing else.")

    return run_checks("Exercise 12.4 (un-permuting W_Q and W_K)", checks,
                      "Your rows undo llama.cpp's permutation for 1 to 8 heads, and a tiny LLaMA with grouped-query "
                      "attention computes the same logits with rotate-half pairing and your rows as with interleaved "
                      "pairing and the file's.")


# ---- Exercise 12.5: a metadata array from raw bytes ----------------------------------------------------------

_GGUF_ELEMENT_TYPES = {0: ("uint8", "<B"), 1: ("int8", "<b"), 2: ("uint16", "<H"), 3: ("int16", "<h"),
                       4: ("uint32", "<I"), 5: ("int32", "<i"), 6: ("float32", "<f"), 7: ("bool", "<?"),
                       8: ("string", ""), 10: ("uint64", "<Q"), 11: ("int64", "<q"), 12: ("float64", "<d")}


def _array_cases() -> list[tuple[str, int, list]]:
    """(key, element type, values) of the arrays the checker writes: every element type, extreme values, non-ASCII
    strings and an empty string, a long array; float32 values as they read back."""
    rng = random.Random(125)

    def f32(values):
        return [struct.unpack("<f", struct.pack("<f", v))[0] for v in values]

    return [
        ("test.strings", 8, ["hello", "", "Ġthe", "naïve café", "日本語", "🙂 ok", "x" * 40]),
        ("test.uint8", 0, [0, 1, 127, 128, 255]),
        ("test.int8", 1, [-128, -1, 0, 1, 127]),
        ("test.uint16", 2, [0, 258, 65535]),
        ("test.int16", 3, [-32768, -2, 32767]),
        ("test.int32", 5, [-2 ** 31, -5, 0, 2 ** 31 - 1]),
        ("test.uint32", 4, [0, 305419896, 2 ** 32 - 1]),
        ("test.float32", 6, f32([0.1, -2.5, 1e30, 1e-40, -0.0])),
        ("test.bools", 7, [True, False, True, True]),
        ("test.uint64", 10, [2 ** 64 - 1, 0, 2 ** 40 + 3]),
        ("test.int64", 11, [-2 ** 63, -1, 2 ** 63 - 1]),
        ("test.float64", 12, [0.1, -1e300, 5e-324, 2.0 ** 60]),
        ("test.long", 5, [rng.randint(-2 ** 31, 2 ** 31 - 1) for _ in range(300)]),
        ("test.merges", 8, [f"{rng.choice('abcdeé')} {rng.choice('xyzß')}" for _ in range(50)]),
    ]


def _fields(path: Path) -> dict[str, tuple[int, int | None, list]]:
    """Per metadata key of the GGUF file at ``path``, in file order, as ``gguf.GGUFReader`` reads it: (the offset of
    the key-value pair, the element type of an array or None, the value). The reader, which maps the file, is let
    go before returning."""
    import gguf

    reader = gguf.GGUFReader(path)
    fields = {name: (int(f.offset), int(f.types[-1]) if len(f.types) > 1 else None, f.contents())
              for name, f in reader.fields.items() if not name.startswith("GGUF.")}
    del reader
    return fields


def _gguf_file_with_arrays() -> tuple[bytes, list[tuple[str, int, list, int, int]]]:
    """A GGUF file written by ``gguf.GGUFWriter`` with the arrays of :func:`_array_cases` (scalars between them),
    plus an empty array spliced in by hand (the writer refuses empty arrays); its bytes and, per array, (key,
    element type, values, offset of the element type, offset just past the array), found by ``gguf.GGUFReader``."""
    import gguf
    from gguf import GGUFValueType

    cases = _array_cases()
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as folder:
        path = Path(folder) / "arrays.gguf"
        writer = gguf.GGUFWriter(path, "llama")
        for k, (key, element_type, values) in enumerate(cases):
            writer.add_key_value(key, values, GGUFValueType.ARRAY, sub_type=GGUFValueType(element_type))
            if k % 3 == 1:
                writer.add_string(f"test.between.{k}", "a scalar between two arrays")
            elif k % 3 == 2:
                writer.add_uint32(f"test.between.{k}", k)
        writer.add_uint32("test.end", 7)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_tensors_to_file()
        writer.close()
        data = bytearray(path.read_bytes())
        insert = _fields(path)["test.end"][0]
        key = b"test.empty"
        data[insert:insert] = struct.pack("<Q", len(key)) + key + struct.pack("<IIQ", 9, 5, 0)
        struct.pack_into("<Q", data, 16, struct.unpack_from("<Q", data, 16)[0] + 1)
        path.write_bytes(data)
        fields = _fields(path)
    names = list(fields)
    arrays = []
    for key, element_type, values in [*cases, ("test.empty", 5, [])]:
        offset, read_type, read = fields[key]
        if read != values or (values and read_type != element_type):
            raise RuntimeError(f"gguf.GGUFReader reads {key} as {read!r}, the checker wrote {values!r}")
        start = offset + 8 + len(key.encode()) + 4  # past the key (length and bytes) and the value type
        arrays.append((key, element_type, values, start, fields[names[names.index(key) + 1]][0]))
    return bytes(data), arrays


def _plain_values(values, element_type: int, call: str) -> list:
    """The reader's values as plain Python values of the element type's kind, or a Mismatch saying what is wrong."""
    expect(isinstance(values, list), f"{call} returned values of type {type(values).__name__}, expected a list",
           "Return the values as a Python list (list(...) of a tuple or an array).")
    name = _GGUF_ELEMENT_TYPES[element_type][0]
    plain = []
    for v in values:
        if element_type == 8:
            if isinstance(v, (bytes, bytearray)):
                raise Mismatch(f"{call} returned a string as {type(v).__name__} ({bytes(v)[:20]!r})",
                               "Decode each string's bytes: b.decode('utf-8').")
            expect(isinstance(v, str), f"{call} returned a {type(v).__name__} among the strings", "Return strs.")
        elif element_type == 7:
            expect(isinstance(v, (bool, np.bool_)), f"{call} returned {v!r} ({type(v).__name__}) in an array of "
                   "bools (type 7)", "Type 7 is bool: one byte, 0 or 1, returned as False or True.")
            v = bool(v)
        elif element_type in (6, 12):
            expect(isinstance(v, numbers.Real) and not isinstance(v, (bool, np.bool_)),
                   f"{call} returned {v!r} ({type(v).__name__}) in an array of {name}", "Return floats.")
            v = float(v)
        else:
            expect(isinstance(v, numbers.Integral) and not isinstance(v, (bool, np.bool_)),
                   f"{call} returned {v!r} ({type(v).__name__}) in an array of {name}",
                   "Return ints (struct.unpack_from with the right format gives them).")
            v = int(v)
        plain.append(v)
    return plain


def _array_hint(element_type: int, got: list, want: list) -> str:
    """What most likely went wrong when an array of ``element_type`` reads as ``got`` instead of ``want``."""
    name, fmt = _GGUF_ELEMENT_TYPES[element_type]
    if element_type == 8:
        return ("After the uint32 element type comes the count, a uint64 (8 bytes). Each string is a uint64 length n "
                "(8 bytes, little-endian), then exactly n bytes of UTF-8, with no zero at the end: read the length, "
                "then the n bytes, then decode them.")
    if len(got) != len(want):
        return ("After the uint32 element type comes the count, a uint64 (8 bytes): then exactly count elements "
                f"of {struct.calcsize(fmt)} bytes each.")
    signed = fmt[1].islower()
    return (f"Type {element_type} is {name}: {struct.calcsize(fmt)} bytes, little-endian"
            + (", signed (two's complement)" if signed and element_type not in (6, 7, 12) else "") +
            f"; struct's format {fmt!r} reads it.")


def check_read_array(fn: Callable) -> Verdict:
    """Exercise 12.5: ``fn(data, offset) -> (values, next_offset)``, the GGUF metadata array whose value starts at
    ``offset`` of ``data`` (its uint32 element type, then a uint64 count, then the elements) as a Python list, and
    the offset just past it. Checked on a file written by ``gguf.GGUFWriter`` with every element type (and an empty
    array), and on the file cut short: then any exception is right, returning values is not. Calls into
    groundup.gguf and the gguf package's reader are refused."""
    title = "Exercise 12.5 (a metadata array from raw bytes)"
    missing = _gguf_missing(title)
    if missing is not None:
        return missing
    import gguf

    hint = ("This exercise asks you to read the bytes yourself with struct.unpack_from: groundup.gguf and "
            "gguf.GGUFReader are the book's and llama.cpp's readers.")
    forbid = (Forbidden(gguf.GGUFReader, "__init__", label="gguf.GGUFReader", hint=hint), _gguf_file_with_arrays,
              _array_cases, _fields)
    modules = ("groundup.gguf", "gguf.gguf_reader")

    def checks():
        data, arrays = _gguf_file_with_arrays()
        for key, element_type, want, start, end in arrays:
            name = _GGUF_ELEMENT_TYPES[element_type][0]
            call = f"my_read_array(data, {start}) for {key} ({len(want)} {name} values)"
            out = _call(fn, data, start, call=call, names=("data", "offset"), modules=modules, hint=hint, forbid=forbid)
            kind = f"{len(out)} items" if isinstance(out, (tuple, list)) else type(out).__name__
            expect(isinstance(out, (tuple, list)) and len(out) == 2, f"{call} returned {kind}, expected a pair "
                   "(values, next_offset)", "Return two things: the list of values and the offset just past the "
                   "array." if out is not None else "Did you forget the `return` statement?")
            values, next_offset = out
            got = _plain_values(values, element_type, call)
            if got != want or any(_negative(a) != _negative(b) for a, b in zip(got, want)):
                first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
                shown = (f"{len(got)} values, expected {len(want)}" if len(got) != len(want) else
                         f"value {first} is {got[first]!r}, expected {want[first]!r}")
                raise Mismatch(f"{call}: {shown}", _array_hint(element_type, got, want))
            next_offset = expect_integer(next_offset, f"{call}: next_offset")
            expect(next_offset == end, f"{call}: next_offset = {next_offset}, expected {end}", "The array takes "
                   f"{end - start} bytes from offset {start}: 4 for the element type, 8 for the count, then the "
                   "elements (a string: its 8-byte length and its bytes). Return the offset after the last one.")
        strings = next(a for a in arrays if a[0] == "test.strings")
        longest = strings[2].index(max(strings[2], key=len))
        cut_in_string = strings[4] - 8  # inside the bytes of the last string ("x" * 40)
        cuts = [(strings[3] + 6, "inside the count of test.strings"),
                (cut_in_string, f"8 bytes before the end of the last string of test.strings (index {longest})"),
                (next(a for a in arrays if a[0] == "test.int64")[4] - 3, "inside the last number of test.int64")]
        for cut, where in cuts:
            key = next(a for a in arrays if a[3] <= cut < a[4])
            call = f"my_read_array(data[:{cut}], {key[3]}), the file cut {where}"
            try:
                out = _call(fn, data[:cut], key[3], call=call, names=("data", "offset"), modules=modules, hint=hint,
                            forbid=forbid)
            except ReaderError:
                continue  # any exception is a right answer to data that ends too soon
            raise Mismatch(f"{call} returned {str(out)[:60]} instead of raising an exception",
                           "When the data ends before the array does, raise an error (struct.unpack_from raises "
                           "struct.error by itself; a slice past the end silently gives fewer bytes, so check a "
                           "string's length before you decode it).")

    return run_checks(title, checks, "Your reader gets every element type of a file gguf.GGUFWriter wrote (strings "
                      "with non-ASCII characters, numbers of every size, bools, an empty array) and the offset past "
                      "each, and refuses data that ends too soon.")


def _negative(value) -> bool:
    """Whether ``value`` is a negative float, -0.0 included (it compares equal to 0.0)."""
    return isinstance(value, float) and str(value).startswith("-")


# ---- Exercise 12.6: LLaMA's parameter count ------------------------------------------------------------------

_COUNT_HINT = ("The exercise is to count with a formula, without building a model (any torch.nn.Module, on any "
               "device): add up W_E, the n_layers blocks, the final norm and, if untied, U.")


@functools.cache
def _gpt_count(n_layers: int, d_model: int, n_heads: int, n_kv_heads: int, d_ff: int, vocab_size: int,
               tied: bool) -> int:
    """The parameters of the package's LLaMA-style GPT of this shape, built on the meta device (no memory)."""
    config = GPTConfig(vocab_size=vocab_size, context_length=16, d_model=d_model, n_layers=n_layers, n_heads=n_heads,
                       n_kv_heads=n_kv_heads, d_ff=d_ff, positional="rope", norm="rmsnorm", activation="swiglu",
                       bias=False, tie_weights=tied)
    with torch.device("meta"):
        return sum(p.numel() for p in GPT(config).parameters())


def _count_cases() -> list[tuple[int, int, int, int, int, int, bool]]:
    """LLaMA 2 7B, LLaMA 2 70B's shape, SmolLM2-135M, two tiny shapes, and two tiny shapes drawn afresh on every call
    (so that a table of remembered answers fails)."""
    rng = random.SystemRandom()
    cases = [(32, 4096, 32, 32, 11008, 32000, False), (80, 8192, 64, 8, 28672, 32000, False),
             (30, 576, 9, 3, 1536, 49152, True), (2, 8, 2, 1, 12, 10, False), (1, 4, 1, 1, 4, 3, True)]
    for tied in (False, True):
        n_heads = rng.choice((2, 4, 6, 8))
        n_kv = rng.choice([k for k in range(1, n_heads) if n_heads % k == 0])
        d_model = n_heads * rng.choice((2, 4, 8))
        cases.append((rng.randint(1, 6), d_model, n_heads, n_kv, rng.randint(1, 5) * d_model + rng.choice((0, 8)),
                      rng.randint(5, 99), tied))
    return cases


def _count_hints(case: tuple, expected: int) -> dict[int, str]:
    """Wrong counts keyed to the mistake that gives them."""
    n_layers, d, n_heads, n_kv, d_ff, vocab, tied = case
    d_kv = d // n_heads * n_kv
    hints = {
        expected + vocab * d: "U is tied to W_E (tied is True): the one shared matrix counts once." if tied else
        "W_E and U are one vocab_size x d_model matrix each: your count has a third.",
        expected - vocab * d: "U is its own matrix when tied is False: count it as well as W_E." if not tied else
        "Count the embedding W_E (vocab_size x d_model), which U shares.",
        expected + n_layers * 2 * d * (d - d_kv): f"With n_kv_heads = {n_kv} of {n_heads} heads, W_K and W_V have "
        f"n_kv_heads * d_h = {d_kv} rows each, not d_model.",
        expected - d: "Count the final RMSNorm's gamma (d_model numbers) too.",
        expected - (2 * n_layers + 1) * d: "Count the RMSNorms' gamma: two per block and the final one.",
        expected + (2 * n_layers + 1) * d: "RMSNorm has a gain gamma but no shift beta.",
        expected + n_layers * (2 * d + 2 * d_kv + 2 * d_ff + d): "LLaMA's linear layers have no biases.",
        expected - n_layers * d * d_ff: "SwiGLU has three matrices: W_gate and W_in (d_FFN x d_model) and W_out "
        "(d_model x d_FFN).",
    }
    hints.pop(expected, None)
    return hints


def check_llama_parameter_count(fn: Callable) -> Verdict:
    """Exercise 12.6: ``fn(n_layers, d_model, n_heads, n_kv_heads, d_ff, vocab_size, tied) -> int``, the parameters
    of a LLaMA-style model (RMSNorm with gamma only, SwiGLU, no biases, grouped-query attention, U counted unless
    tied), compared with the package's GPT of that shape built on the meta device; building a model (any
    torch.nn.Module: the package's GPT, transformers' LLaMA or Mistral) is refused."""
    forbid = (Forbidden(torch.nn.Module, "__init__", label="torch.nn.Module.__init__ (it builds a model)",
                        hint=_COUNT_HINT), _gpt_count.__wrapped__, _count_cases, _count_hints,
              Forbidden(sys.modules[__name__], "_gpt_count", label="groundup.exercises.ch12._gpt_count"))

    _gpt_count(1, 4, 1, 1, 4, 3, True)  # the first model on the meta device imports torch._dynamo, which patches
    # torch.manual_seed: before the checks, whose end would take the patch for the reader's

    def checks():
        for case in _count_cases():
            expected = _gpt_count(*case)
            call = f"my_llama_parameter_count{case}"
            got = expect_integer(_call(fn, *case, call=call, names=(), hint=_COUNT_HINT, forbid=forbid), call,
                                 "Return the number of parameters as an int.")
            n_layers, d, n_heads, n_kv, d_ff, vocab, tied = case
            expect(got == expected, f"{call} = {got:,}, expected {expected:,}", _count_hints(case, expected).get(
                got, "Per block: W_Q and W_O (d_model x d_model), W_K and W_V ((n_kv_heads * d_h) x d_model), "
                "W_gate, W_in and W_out (d_FFN x d_model each) and two RMSNorm gains (d_model each); then W_E, the "
                "final gain and, if untied, U."))

    return run_checks("Exercise 12.6 (LLaMA's parameter count)", checks,
                      "Right for LLaMA 2 7B (6,738,415,616), LLaMA 2 70B's shape (68,976,648,192), SmolLM2-135M "
                      "(134,515,008) and four tiny shapes, two of them new on every run.")


# ---- Exercise 12.7: a one-tensor GGUF writer ------------------------------------------------------------------

_GGUF_KEY, _GGUF_VALUE = "general.architecture", "llama"
_GGUF_ALIGNMENT = 32


def _one_tensor_gguf(name: str, tensor: torch.Tensor, *, sizes: str = "contiguous first", padding: bool = True,
                     offset: str = "data", strings: str = "length", length: str = "bytes", values: str = "rows",
                     ) -> tuple[bytes, list[tuple[int, int, str]]]:
    """The GGUF file of the exercise (the defaults) or one written with a plausible mistake; and its fields as
    (start, end, what) for telling the reader where a file first differs."""
    fields: list[tuple[int, int, str]] = []
    out = bytearray()

    def put(raw: bytes, what: str) -> None:
        fields.append((len(out), len(out) + len(raw), what))
        out.extend(raw)

    def string(text: str, what: str) -> None:
        raw = text.encode("utf-8")
        if strings == "length":
            put(struct.pack("<Q", len(text) if length == "characters" else len(raw)), f"the length of {what}")
        put(raw, f"the UTF-8 bytes of {what}")

    dims = tuple(tensor.shape) if sizes == "pytorch" else tuple(reversed(tensor.shape))
    put(b"GGUF", "the magic b'GGUF'")
    put(struct.pack("<I", 3), "the version (uint32 3)")
    put(struct.pack("<Q", 1), "the tensor count (uint64 1)")
    put(struct.pack("<Q", 1), "the metadata count (uint64 1)")
    string(_GGUF_KEY, f"the key {_GGUF_KEY!r}")
    put(struct.pack("<I", 8), "the value type (uint32 8, a string)")
    string(_GGUF_VALUE, f"the value {_GGUF_VALUE!r}")
    string(name, f"the tensor name {name!r}")
    put(struct.pack("<I", len(dims)), "n_dims (uint32)")
    put(struct.pack(f"<{len(dims)}Q", *dims), "the sizes (uint64 each, contiguous first)")
    put(struct.pack("<I", 0), "the tensor type (uint32 0, F32)")
    table_end = len(out) + 8
    data_start = -(-table_end // _GGUF_ALIGNMENT) * _GGUF_ALIGNMENT if padding else table_end
    put(struct.pack("<Q", data_start if offset == "file" else 0), "the tensor's offset (uint64 0)")
    put(bytes(data_start - table_end), f"the zero padding up to byte {data_start} (a multiple of 32)")
    t = tensor.detach()
    if values == "storage":  # the memory of a non-contiguous tensor, in its own order
        t = torch.as_strided(t, (t.numel(),), (1,), t.storage_offset())
    put(t.to(torch.float64 if values == "float64" else torch.float32).contiguous().numpy().tobytes(),
        "the data (float32, little-endian, row by row)")
    return bytes(out), fields


_GGUF_MISTAKES = (
    ({"sizes": "pytorch"}, "GGUF lists the sizes contiguous first: ne[0] is the length of a row (PyTorch's last "
     "dimension), so a tensor of PyTorch shape (3, 5) has the sizes 5, 3. Write reversed(tensor.shape)."),
    ({"padding": False}, "The data section starts at the next multiple of 32 after the tensor table "
     "(general.alignment, 32 when the file does not set it): write zero bytes up to it."),
    ({"offset": "file"}, "A tensor's offset counts from the start of the data section, not from the start of the "
     "file: the first (and only) tensor has offset 0."),
    ({"strings": "none"}, "A string is its length as a uint64 (8 bytes, little-endian), then its UTF-8 bytes: the "
     "key, the string value and the tensor name alike."),
    ({"length": "characters"}, "A string's length counts bytes, not characters: len(text.encode('utf-8')), more "
     "than len(text) when the text has non-ASCII characters."),
    ({"values": "storage"}, "Write the values row by row, in the tensor's logical order: a transposed tensor is "
     "not contiguous in memory (tensor.contiguous().numpy().tobytes() gives the right order)."),
    ({"values": "float64"}, "F32 (type 0) stores each value in 4 bytes: convert to float32 (numpy's tobytes of a "
     "float64 array gives 8 bytes a value)."),
)

_GGUF_FIELD_HINTS = (
    ("the magic", "A GGUF file starts with the four bytes b'GGUF'."),
    ("the version", "After the magic: the version 3 as a little-endian uint32 (struct.pack('<I', 3))."),
    ("count", "Then the tensor count and the metadata count, a uint64 each ('<Q'): 1 and 1."),
    ("the length of", "A string is its length in bytes as a uint64 ('<Q'), then its UTF-8 bytes."),
    ("the UTF-8 bytes", "A string is its length in bytes as a uint64 ('<Q'), then its UTF-8 bytes, with no zero at "
     "the end."),
    ("the value type", "After the key: the value type as a uint32, 8 for a string."),
    ("n_dims", "After the tensor's name: its number of dimensions as a uint32 (len(tensor.shape))."),
    ("the sizes", "Then one uint64 per dimension, contiguous first: reversed(tensor.shape)."),
    ("the tensor type", "Then the tensor's type as a uint32: 0 for F32."),
    ("the tensor's offset", "Then its offset as a uint64, counted from the start of the data section: 0."),
    ("padding", "After the tensor table, zero bytes up to the next multiple of 32."),
    ("the data", "Then the values as little-endian float32, row by row: tensor.contiguous().numpy().tobytes()."),
)


def _gguf_cases() -> list[tuple[str, torch.Tensor, str]]:
    """(name, tensor, description) of the files the checker asks for: shapes from 1 x 1 to 576 x 7, one and two
    dimensions, names with non-ASCII characters, a tensor that is not contiguous, special float values."""
    g = torch.Generator().manual_seed(1207)
    special = torch.tensor([[0.0, -0.0, 1e-45, -3.4e38], [3.4e38, -1e-30, 2.0 ** -126, 1 / 3],
                            [65504.0, -1.5, 0.1, 7.0]]).repeat(1, 2)
    transposed = torch.randn(6, 4, generator=g).T
    return [("token_embd.weight", torch.randn(3, 5, generator=g), "a 3 x 5 tensor"),
            ("w", torch.tensor([[1.5]]), "a 1 x 1 tensor"),
            ("blk.0.ffn_down.weight", torch.randn(576, 7, generator=g) * 0.02, "a 576 x 7 tensor"),
            ("output_norm.weight", torch.randn(8, generator=g), "a 1-D tensor of 8 values"),
            ("größe.gewicht", torch.randn(2, 3, generator=g), "a 2 x 3 tensor with a non-ASCII name"),
            ("重み.🙂", special, "a 3 x 8 tensor of special values (-0, a subnormal, +-3.4e38) with a non-ASCII "
             "name"),
            ("blk.1.attn_k.weight", transposed, "a 4 x 6 tensor that is the transpose of another (not contiguous "
             "in memory)")]


def _read_back(path: Path) -> tuple[str | None, dict | None, list | None]:
    """What the two readers find in the file at ``path``: (the first error, else None; the metadata; the tensors as
    (name, type, PyTorch shape, float32 values)), read by groundup.gguf.read_gguf (which checks every size against
    the file first) and then by gguf.GGUFReader; both must agree."""
    import gguf

    from groundup.gguf import read_gguf

    try:
        ours = read_gguf(path)
        found = [(name, info.ggml_type, tuple(info.shape), ours.tensor(name).clone()) for name, info in
                 ours.tensors.items()]
        metadata = dict(ours.metadata)
        del ours
    except Exception as err:  # noqa: BLE001 -- a file the reader wrote: its errors are the verdict
        return f"groundup.gguf.read_gguf: {err}", None, None
    try:
        reader = gguf.GGUFReader(path)
        theirs = {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}
        version = int(reader.fields["GGUF.version"].parts[0][0])
        tensors = [(t.name, int(t.tensor_type), tuple(int(n) for n in reversed(t.shape.tolist())),
                    torch.from_numpy(np.array(t.data, dtype=np.float32))) for t in reader.tensors]
        del reader
    except Exception as err:  # noqa: BLE001
        return f"gguf.GGUFReader: {type(err).__name__}: {err}", None, None
    if version != 3:
        return f"the version is {version}, expected 3", metadata, found
    if theirs != metadata or len(tensors) != len(found) or any(
            (a[:3], _bits(a[3])) != (b[:3], _bits(b[3].reshape(b[2])))
            for a, b in zip(found, tensors)):
        return "gguf.GGUFReader and groundup.gguf.read_gguf read the file differently", metadata, found
    return None, metadata, found


def _type_name(ggml_type: int) -> str:
    """The name of a GGML tensor type (F32 for 0), or its number if unknown."""
    from groundup.gguf import GGML_TYPE_NAMES

    return GGML_TYPE_NAMES.get(ggml_type, str(ggml_type))


def _bits(t: torch.Tensor) -> bytes:
    """The float32 values of ``t`` as bytes: equal for equal bits (-0.0 differs from 0.0, a NaN equals itself)."""
    return t.to(torch.float32).contiguous().numpy().tobytes()


def _first_difference(data: bytes, want: bytes, fields: list[tuple[int, int, str]]) -> tuple[str, str]:
    """Where ``data`` first differs from ``want``, named by the field of the layout it falls in, and a hint."""
    i = next((k for k, (a, b) in enumerate(zip(data, want)) if a != b), min(len(data), len(want)))
    start, end, what = next((f for f in fields if f[0] <= i < f[1]), (i, i, "the end of the file"))
    if i >= len(data):
        where = f"the file ends at byte {len(data)}, inside {what} (bytes {start}..{end - 1})"
    elif i >= len(want):
        where = f"the file goes on past byte {len(want) - 1}, where the data ends: {len(data)} bytes in all"
        return where, "Write nothing after the data."
    else:
        where = (f"byte {i} (in {what}, bytes {start}..{end - 1}) is {data[i]}, expected {want[i]}; that field is "
                 f"{data[start:end][:16].hex(' ')} instead of {want[start:end][:16].hex(' ')}")
    hint = next((h for key, h in _GGUF_FIELD_HINTS if key in what), "")
    return where, hint


def check_write_gguf(fn: Callable) -> Verdict:
    """Exercise 12.7: ``fn(path, name, tensor)`` writes a GGUF version 3 file holding one metadata entry
    (``general.architecture`` = ``"llama"``) and one F32 tensor (a float32 tensor of one or two dimensions),
    which gguf.GGUFReader and groundup.gguf.read_gguf must read back exactly: the entry, the name, the shape and
    every value's bits. Named mistakes: sizes in PyTorch's order, no alignment padding, the offset counted from the
    file's start, strings without their length or with their length in characters, the values in memory order or
    as float64. gguf's writer (gguf.GGUFWriter) is refused."""
    title = "Exercise 12.7 (a one-tensor GGUF writer)"
    missing = _gguf_missing(title)
    if missing is not None:
        return missing
    import gguf

    hint = ("This exercise asks you to write the bytes yourself with struct.pack: gguf.GGUFWriter is llama.cpp's "
            "writer.")
    forbid = (Forbidden(gguf.GGUFWriter, "__init__", label="gguf.GGUFWriter", hint=hint), _one_tensor_gguf,
              _gguf_cases, _read_back, _first_difference)

    def checks():
        cases = _gguf_cases()
        expected = [_one_tensor_gguf(name, tensor) for name, tensor, _ in cases]
        with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as folder:
            for k, ((name, tensor, what), (want, fields)) in enumerate(zip(cases, expected)):
                path = Path(folder) / f"case{k}.gguf"
                problem = _read_back(_written(path, want))[0]
                if problem is not None:
                    raise RuntimeError(f"the checker's own file for {what} does not read back: {problem}")
                path.unlink()
                call = f"my_write_gguf(path, {name!r}, tensor) for {what}"
                _call(fn, path, name, tensor, call=call, names=("path", "name", "tensor"), hint=hint,
                      modules=("gguf.gguf_writer",), forbid=forbid)
                expect(path.is_file(), f"{call} wrote no file at path", "Open the file with open(path, 'wb') and "
                       "write the bytes to it.")
                data = path.read_bytes()
                if data == want:
                    continue
                for change, mistake in _GGUF_MISTAKES:
                    if data == _one_tensor_gguf(name, tensor, **change)[0]:
                        raise Mismatch(f"{call}: {_first_difference(data, want, fields)[0]}", mistake)
                problem, metadata, found = _read_back(path)
                if problem is None:
                    expect(metadata == {_GGUF_KEY: _GGUF_VALUE}, f"{call}: the file's metadata is {metadata}, "
                           f"expected {{{_GGUF_KEY!r}: {_GGUF_VALUE!r}}}", "Write exactly one metadata entry: the "
                           f"key {_GGUF_KEY!r}, the value type 8 (a string), the value {_GGUF_VALUE!r}.")
                    shape = tuple(tensor.shape)
                    if len(found) == 1 and found[0][:3] == (name, 0, shape) and \
                            _bits(found[0][3]) == _bits(tensor):
                        continue  # another valid file (say, zero bytes after the data): the readers read it right
                    problem = (f"the readers find the tensors {[(n, _type_name(t), s) for n, t, s, _ in found]} "
                               f"(name, type, PyTorch shape), expected [({name!r}, 'F32', {shape})]"
                               if [f[:3] for f in found] != [(name, 0, shape)] else "the readers find other values")
                where, field_hint = _first_difference(data, want, fields)
                raise Mismatch(f"{call}: {problem}; {where}", field_hint)

    return run_checks(title, checks, "gguf.GGUFReader and groundup's read_gguf read your files back exactly: the "
                      "entry, the names (non-ASCII too), the shapes from 1 x 1 to 576 x 7 and 1-D, every value's "
                      "bits, a transposed tensor in its logical order.")


def _written(path: Path, data: bytes) -> Path:
    """``path``, after writing ``data`` to it."""
    path.write_bytes(data)
    return path
