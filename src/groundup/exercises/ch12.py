"""Checkers for chapter 12 (pretrained models: GPT-2, LLaMA and SmolLM2 in our GPT): a Q8_0 quantizer and a Q6_K
decoder, bit for bit against the ``gguf`` package; the permutation between the two pairings of rotary embeddings;
undoing llama.cpp's reordering of the rows of W_Q and W_K; a GGUF metadata array read from raw bytes; LLaMA's
parameter count; and the book's parameter name of a GGUF tensor.

Every checker computes the expected values before it calls the reader's function, from a reference that does not
share the reader's task where there is one (the ``gguf`` package's quantizer, decoder, writer and reader; the
package's GPT built on the meta device; the package's own table of GGUF names), hands the function copies of its
inputs (and says so if the function changed them in place), checks the type of what comes back, and refuses
answers that call the package's own solution (``groundup.quantization``, ``groundup.kquants``, ``groundup.gguf``,
``groundup.pretrained``, the package's GPT) or the ``gguf`` package's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import numbers
import random
import struct
import sys
import tempfile
import textwrap
import threading
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

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
from groundup.layers import TransformerBlock
from groundup.models import GPT, GPTConfig
from groundup.positional import RotaryEmbedding

__all__ = ["check_quantize_q8_0", "check_dequantize_q6_k", "check_rotary_permutation", "check_unpermute_rows",
           "check_read_array", "check_llama_parameter_count", "check_book_name"]


# ---- shared: refusing the package's solutions ------------------------------------------------------------------


@contextlib.contextmanager
def _calls_into(files: tuple[str, ...]):
    """Record (in the yielded list) every Python function of ``files`` that another thread (the reader's worker)
    calls while the body runs: a checker uses it to tell the reader's own code from a call of the package's
    solution or of the ``gguf`` package, however it is reached (a function, a method, a class). Importing one of
    the modules is not a call."""
    seen: list[str] = []
    judge = threading.get_ident()
    previous = sys.getprofile()

    def importing(frame) -> bool:  # the module's own code runs as it is imported: not a call of the solution
        while frame is not None:
            if frame.f_code.co_name == "<module>" and frame.f_code.co_filename.replace("\\", "/").endswith(files):
                return True
            frame = frame.f_back
        return False

    def profile(frame, event, arg):
        if event == "call" and threading.get_ident() != judge:
            filename = frame.f_code.co_filename.replace("\\", "/")
            if filename.endswith(files) and not importing(frame):
                seen.append(f"{Path(filename).parent.name}.{Path(filename).stem}.{frame.f_code.co_qualname}")

    sys.setprofile(profile)
    try:
        yield seen
    finally:
        sys.setprofile(previous)


def _call(fn: Callable, *args, call: str, names: tuple[str, ...], files: tuple[str, ...], hint: str,
          forbid: tuple = ()):
    """``call_reader(fn, *args)``, refusing (with ``hint``) an answer that called into ``files`` or ``forbid``, even
    one that then raised or caught the error."""
    with _calls_into(files) as seen:
        try:
            out = call_reader(fn, *args, call=call, names=names, forbid=forbid)
        except ReaderError:
            if not seen:
                raise
            out = None
    expect(not seen, f"{call} calls {seen[0] if seen else ''}", hint)
    return out


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


_QUANT_FILES = ("groundup/quantization.py", "groundup/kquants.py", "groundup/quantized_linear.py",
                "groundup/gguf.py", "gguf/quants.py", "gguf/gguf_reader.py", "gguf/lazy.py")


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

    def checks():
        cases = _q8_0_cases()
        expected = [torch.from_numpy(gguf_quants.quantize(x.numpy(), GGMLQuantizationType.Q8_0).reshape(-1).copy())
                    for _, x in cases]
        for (what, x), want in zip(cases, expected):
            call = f"my_quantize_q8_0(x) for {what}, x of shape {tuple(x.shape)}"
            out = _call(fn, x, call=call, names=("x",), files=_QUANT_FILES, hint=hint,
                        forbid=(_q8_0_variant, _round_half_away, _q8_0_cases))
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


_Q6_K_LAYOUT = ("Weight i of a super-block: its half h = i // 128 and p = i % 128; the low four bits are in ql "
                "byte 64 h + p % 64 (low nibble if p < 64, else high), the top two bits are bits 2 (p // 32) and "
                "2 (p // 32) + 1 of qh byte 32 h + p % 32; x_i = d * scale[i // 16] * (q - 32), with the scales as "
                "int8 and d the float16 in the last two bytes.")


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
            ("super-blocks with d = 65504, -2^-24 (the smallest float16), 0 and -1.5, scales -128 and 127, all "
             "q = 63 and all q = 0", torch.cat([extremes, all_zero_q]).reshape(-1))]


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

    def checks():
        cases = _q6_k_cases()
        expected = [torch.from_numpy(gguf_quants.dequantize(raw.numpy(), GGMLQuantizationType.Q6_K).copy())
                    for _, raw in cases]
        for (what, raw), want in zip(cases, expected):
            if not torch.isfinite(want).all():
                raise RuntimeError(f"the checker's case {what!r} decodes to non-finite numbers")
            n = raw.numel() // _Q6_K_BYTES
            call = f"my_dequantize_q6_k(raw) for {what} ({raw.numel()} bytes)"
            got = _call(fn, raw, call=call, names=("raw",), files=_QUANT_FILES, hint=hint,
                        forbid=(_q6_k_variant, _q6_k_cases))
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
                      "the largest and the smallest d, the extreme scales and q.")


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
    ``rope_interleaved(x[perm], t) == rope_half(x, t)[perm]`` for every vector x and position t."""

    def checks():
        g = torch.Generator().manual_seed(3)
        for d in (2, 4, 8, 16):
            expected = [j for i in range(d // 2) for j in (i, i + d // 2)]
            call = f"my_rotary_permutation({d})"
            perm = _expect_index_list(call_reader(fn, d, call=call), d, call)
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
        out = _call(fn, weight, n_heads, call=call, names=("weight", "n_heads"), files=("groundup/pretrained.py",),
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
    files = ("groundup/gguf.py", "gguf/gguf_reader.py")

    def checks():
        data, arrays = _gguf_file_with_arrays()
        for key, element_type, want, start, end in arrays:
            name = _GGUF_ELEMENT_TYPES[element_type][0]
            call = f"my_read_array(data, {start}) for {key} ({len(want)} {name} values)"
            out = _call(fn, data, start, call=call, names=("data", "offset"), files=files, hint=hint, forbid=forbid)
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
                out = _call(fn, data[:cut], key[3], call=call, names=("data", "offset"), files=files, hint=hint,
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

_COUNT_HINT = ("The exercise is to count with a formula, without building a model: add up W_E, the n_layers "
               "blocks, the final norm and, if untied, U.")


@functools.cache
def _count_builders() -> tuple:
    """What a count must not call: the package's GPT and its blocks and, where transformers is installed, its LLaMA
    model and decoder layer (imported here, not when the reader's function runs, so that a function importing
    transformers itself is caught too)."""
    forbid = [Forbidden(GPT, "__init__", label="groundup.models.GPT", hint=_COUNT_HINT),
              Forbidden(TransformerBlock, "__init__", label="groundup.layers.TransformerBlock", hint=_COUNT_HINT)]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from transformers.models.llama import modeling_llama
        forbid += [Forbidden(modeling_llama.LlamaModel, "__init__", label="transformers.LlamaModel",
                             hint=_COUNT_HINT),
                   Forbidden(modeling_llama.LlamaDecoderLayer, "__init__", label="transformers.LlamaDecoderLayer",
                             hint=_COUNT_HINT)]
    except Exception:  # noqa: BLE001 -- without a working transformers there is nothing of it to call
        pass
    return tuple(forbid)


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
    tied), compared with the package's GPT of that shape built on the meta device; building a model (the package's
    GPT, transformers' LLaMA) is refused."""
    forbid = (*_count_builders(), _gpt_count.__wrapped__, _count_cases, _count_hints,
              Forbidden(sys.modules[__name__], "_gpt_count", label="groundup.exercises.ch12._gpt_count"))

    def checks():
        for case in _count_cases():
            expected = _gpt_count(*case)
            call = f"my_llama_parameter_count{case}"
            got = expect_integer(call_reader(fn, *case, call=call, forbid=forbid), call,
                                 "Return the number of parameters as an int.")
            n_layers, d, n_heads, n_kv, d_ff, vocab, tied = case
            expect(got == expected, f"{call} = {got:,}, expected {expected:,}", _count_hints(case, expected).get(
                got, "Per block: W_Q and W_O (d_model x d_model), W_K and W_V ((n_kv_heads * d_h) x d_model), "
                "W_gate, W_in and W_out (d_FFN x d_model each) and two RMSNorm gains (d_model each); then W_E, the "
                "final gain and, if untied, U."))

    return run_checks("Exercise 12.6 (LLaMA's parameter count)", checks,
                      "Right for LLaMA 2 7B (6,738,415,616), LLaMA 2 70B's shape (68,976,648,192), SmolLM2-135M "
                      "(134,515,008) and four tiny shapes, two of them new on every run.")


# ---- Exercise 12.7: the book's name of a GGUF tensor ---------------------------------------------------------

_PART_HINTS = {"attn_norm": "attn_norm is the RMSNorm before attention: the block's norm_1.",
               "ffn_norm": "ffn_norm is the RMSNorm before the FFN: the block's norm_2.",
               "attn_q": "attn_q is W_Q: attention.W_q.", "attn_k": "attn_k is W_K: attention.W_k.",
               "attn_v": "attn_v is W_V: attention.W_v.", "attn_output": "attn_output is W_O: attention.W_o.",
               "ffn_gate": "ffn_gate is SwiGLU's gate: ffn.W_gate.",
               "ffn_up": "ffn_up is SwiGLU's up projection, which the book's FeedForward calls ffn.W_in.",
               "ffn_down": "ffn_down is SwiGLU's down projection, which the book's FeedForward calls ffn.W_out.",
               "token_embd": "token_embd is W_E: the GPT's token_embedding.",
               "output_norm": "output_norm is the final RMSNorm: final_norm.",
               "output": "output is the unembedding U: unembedding."}

_UNKNOWN_NAMES = ("blk.x.attn_q.weight", "blk.3.attn_q.bias", "token_embd", "blk.3.attn_q",
                  "blk.3.ffn_gate_exps.weight", "rope_freqs.weight", "output_norm.bias", "blk..attn_k.weight",
                  "blk.-1.attn_k.weight", "blk.3.attn_qkv.weight", "")


def _book_names() -> dict[str, str]:
    """GGUF name -> the book's parameter name, from the package's own table (groundup.pretrained): an untied model
    of 1,000 blocks and SmolLM2's tied one of 30."""
    from groundup.pretrained import gguf_tensor_names

    names = {}
    for n_layers, tied in ((1000, False), (30, True)):
        config = GPTConfig(vocab_size=16, context_length=8, d_model=8, n_layers=n_layers, n_heads=2, n_kv_heads=1,
                           d_ff=16, positional="rope", norm="rmsnorm", activation="swiglu", bias=False,
                           tie_weights=tied)
        names.update({theirs: ours for ours, theirs in gguf_tensor_names(config).items()})
    return names


def check_book_name(fn: Callable) -> Verdict:
    """Exercise 12.7: ``fn(gguf_name) -> name``, the parameter of the book's GPT that a LLaMA GGUF file's tensor
    loads into ("blk.17.ffn_gate.weight" -> "blocks.17.ffn.W_gate.weight"); a name the GPT has no parameter for
    raises KeyError or ValueError. Compared with the package's table (groundup.pretrained.gguf_tensor_names,
    inverted), whose use is refused."""
    hint = ("This exercise asks for the table itself: groundup.pretrained is the book's loader. Split the name "
            "at its dots and look the part up in a dict of your own.")
    forbid = (_book_names,)
    files = ("groundup/pretrained.py",)

    def checks():
        table = _book_names()
        rng = random.Random(127)
        blocks = [0, 1, 9, 29] + rng.sample(range(30, 1000), 3)
        names = ["token_embd.weight", "output_norm.weight", "output.weight"] + [
            name for name in table if name.startswith("blk.") and int(name.split(".")[1]) in blocks]
        for name in names:
            call = f"my_book_name({name!r})"
            got = _call(fn, name, call=call, names=("gguf_name",), files=files, hint=hint, forbid=forbid)
            expect(isinstance(got, str), f"{call} returned {type(got).__name__}, expected a str",
                   "Did you forget the `return` statement?" if got is None else "Return the name as a str.")
            part = name.split(".")[-2]
            expect(got == table[name], f"{call} = {got!r}, expected the GPT's {table[name]!r}",
                   _PART_HINTS.get(part, "") + " Print [n for n, _ in smol.named_parameters()][:12] to see the "
                   "book's names.")
        for name in _UNKNOWN_NAMES:
            call = f"my_book_name({name!r})"
            try:
                got = _call(fn, name, call=call, names=("gguf_name",), files=files, hint=hint, forbid=forbid)
            except ReaderError as err:
                expect(isinstance(err.error, (KeyError, ValueError)), f"{call} raised {type(err.error).__name__}: "
                       f"{err.error}", "For a name the book's GPT has no parameter for, raise KeyError or ValueError "
                       "on purpose (a dict lookup raises KeyError), not whatever error comes up first.")
                continue
            raise Mismatch(f"{call} returned {got!r}, but the book's GPT has no parameter for {name!r}",
                           "Check every part of the name (the block number is a whole number, the last part is "
                           "'weight', the middle part one of the nine of a block) and raise KeyError or ValueError "
                           "for anything else.")

    return run_checks("Exercise 12.7 (the book's name of a GGUF tensor)", checks,
                      f"All {9 * 7 + 3} names tried (blocks 0 to 999, the embedding, the norms, U) map to the book's "
                      f"parameters, and {len(_UNKNOWN_NAMES)} names that are not a parameter raise an error.")
