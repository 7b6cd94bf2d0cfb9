"""Checkers for chapter 12 (from our GPT to GPT-2 and LLaMA): splitting GPT-2's fused ``c_attn``, counting GPT-2's
parameters, the permutation between the two pairings of rotary embeddings, decoding a Q4_1 block by hand and
counting the bytes of a model stored in GGUF.

Every checker computes the expected values before it calls the reader's function, hands the function copies of
its inputs (and says so if the function changed them in place), and checks the type of what comes back.
"""

from __future__ import annotations

import contextlib
import functools
import numbers
import struct
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

from groundup.exercises.checking import (
    Forbidden,
    Mismatch,
    Verdict,
    call_reader,
    expect,
    expect_close,
    expect_number,
    expect_tensor,
    run_checks,
)
from groundup.layers import TransformerBlock
from groundup.models import GPT
from groundup.positional import RotaryEmbedding

__all__ = ["check_split_c_attn", "check_gpt2_parameter_count", "check_rotary_permutation",
           "check_decode_q4_1_block", "check_gguf_bytes"]


# ---- Exercise 12.1 -----------------------------------------------------------------------------------------


def check_split_c_attn(fn: Callable) -> Verdict:
    """Exercise 12.1: ``fn(weight, bias) -> (W_q, W_k, W_v, b_q, b_k, b_v)``: GPT-2's fused ``c_attn`` (a
    ``Conv1D`` with ``weight`` of shape ``(d, 3d)`` and ``bias`` of shape ``(3d,)``, computing ``x @ weight + bias``)
    split into three ``nn.Linear``-style ``(d, d)`` weights (``x @ W.T``) and their biases."""

    def checks():
        g = torch.Generator().manual_seed(12)
        for d in (4, 6, 12):
            weight = torch.randn(d, 3 * d, generator=g, dtype=torch.float64)
            bias = torch.randn(3 * d, generator=g, dtype=torch.float64)
            expected = [weight[:, i * d:(i + 1) * d].T.clone() for i in range(3)] + \
                       [bias[i * d:(i + 1) * d].clone() for i in range(3)]
            x = torch.randn(5, d, generator=g, dtype=torch.float64)
            fused = x @ weight + bias  # what GPT-2 computes: [q | k | v] side by side
            call = f"my_split_c_attn(weight, bias) with d = {d}"
            out = call_reader(fn, weight, bias, call=call, names=("weight", "bias"))
            expect(isinstance(out, (tuple, list)) and len(out) == 6, f"{call} returned {type(out).__name__}",
                   "Return six tensors: (W_q, W_k, W_v, b_q, b_k, b_v).")
            names = ("W_q", "W_k", "W_v", "b_q", "b_k", "b_v")
            got = [expect_tensor(t, f"{call}: {name}") for t, name in zip(out, names)]
            for i, name in enumerate(names[:3]):
                w = got[i]
                if w.shape == (d, d) and torch.allclose(w.to(torch.float64), expected[i].T):
                    raise Mismatch(f"{call}: {name} is the transpose of what nn.Linear needs",
                                   "Conv1D computes x @ weight, nn.Linear computes x @ W.T: transpose each block.")
                expect_close(w, expected[i], f"{call}: {name}",
                             "Columns 0..d-1 of weight produce q, d..2d-1 produce k, 2d..3d-1 produce v; "
                             "nn.Linear stores (out, in), the transpose of a Conv1D block.", rtol=0, atol=0)
            for i, name in enumerate(names[3:]):
                expect_close(got[3 + i], expected[3 + i], f"{call}: {name}",
                             "The bias splits into the same three slices as the columns.", rtol=0, atol=0)
            q = x @ got[0].T.to(torch.float64) + got[3]
            expect_close(q, fused[:, :d], f"{call}: x @ W_q.T + b_q against GPT-2's q", rtol=1e-12, atol=1e-12)

    return run_checks("Exercise 12.1 (splitting c_attn)", checks,
                      "Your W_q, W_k, W_v and biases reproduce GPT-2's fused projection for d = 4, 6 and 12.")


# ---- Exercise 12.2 -----------------------------------------------------------------------------------------


def gpt2_parameters(n_layers: int, d_model: int, vocab_size: int, context_length: int) -> int:
    """GPT-2's parameter count: tied embedding, learned positions, biases everywhere, d_FFN = 4 d_M."""
    d = d_model
    block = 2 * d + (3 * d * d + 3 * d) + (d * d + d) + 2 * d + (4 * d * d + 4 * d) + (4 * d * d + d)
    return vocab_size * d + context_length * d + n_layers * block + 2 * d


_BUILDING_HINT = ("The exercise is to count without building a model: add up the parameters of the embeddings, of "
                  "n_layers blocks (each with two LayerNorms, c_attn, c_proj, c_fc and mlp c_proj) and of the final "
                  "LayerNorm.")


@functools.cache
def _model_builders() -> tuple[Forbidden, ...]:
    """The constructors a count must not call: the package's GPT and its blocks, and, where transformers is
    installed, GPT-2's model (which every GPT-2 head model builds) and its blocks. (Imported here, not when the
    reader's function runs, so that a function importing transformers itself is caught too.)"""
    builders = [(GPT, "groundup.models.GPT"), (TransformerBlock, "groundup.layers.TransformerBlock")]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from transformers.models.gpt2 import modeling_gpt2
        builders += [(modeling_gpt2.GPT2Model, "transformers.GPT2Model"),
                     (modeling_gpt2.GPT2Block, "transformers.GPT2Block")]
    except Exception:  # noqa: BLE001 -- without a working transformers there is nothing of it to call
        pass
    return tuple(Forbidden(cls, "__init__", label=label, hint=_BUILDING_HINT) for cls, label in builders)


def check_gpt2_parameter_count(fn: Callable) -> Verdict:
    """Exercise 12.2: ``fn(n_layers, d_model, vocab_size, context_length) -> int``, GPT-2's parameter count,
    without building a model: calling the checker's own count or constructing the package's GPT (or transformers'
    GPT-2), even on the meta device, is refused."""
    forbid = (gpt2_parameters, *_model_builders())

    def checks():
        cases = [(12, 768, 50257, 1024), (24, 1024, 50257, 1024), (36, 1280, 50257, 1024), (48, 1600, 50257, 1024),
                 (1, 4, 10, 8), (2, 8, 65, 16)]
        for n_layers, d, vocab, context in cases:
            expected = gpt2_parameters(n_layers, d, vocab, context)
            call = f"my_gpt2_parameter_count({n_layers}, {d}, {vocab}, {context})"
            got = call_reader(fn, n_layers, d, vocab, context, call=call, forbid=forbid)
            got = expect_number(got, call, "Return the number of parameters as an int.")
            untied = expected + vocab * d
            hints = {untied: "GPT-2 ties the unembedding U to W_E: count that matrix once.",
                     expected - context * d: "Count the learned positional table (context_length x d_model) too.",
                     expected - 2 * d: "Count the final LayerNorm's gamma and beta (2 d_model).",
                     expected - n_layers * 13 * d - 2 * d: "Count the biases and the LayerNorms' gamma and beta."}
            expect_close(got, expected, call, hints.get(got, "Per block: two LayerNorms (2 d each), c_attn "
                         "(3 d^2 + 3 d), attention c_proj (d^2 + d), c_fc (4 d^2 + 4 d), mlp c_proj (4 d^2 + d)."),
                         rtol=0, atol=0.5)

    return run_checks("Exercise 12.2 (GPT-2's parameter count)", checks,
                      "Right for GPT-2 small (124,439,808), medium, large and XL, and for two tiny shapes.")


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


# ---- Exercises 12.6 and 12.7: quantization -----------------------------------------------------------------

_FLOAT16_PAIR = struct.Struct("<ee")


def _q4_1_reference(block: bytes) -> list[float]:
    """One Q4_1 block decoded with the standard library alone: d, m (float16), then q[j] | q[j + 16] << 4."""
    d, m = _FLOAT16_PAIR.unpack(block[:4])
    packed = block[4:]
    q = [b & 0x0F for b in packed] + [b >> 4 for b in packed]
    return [float(torch.tensor(d * v, dtype=torch.float32) + torch.tensor(m, dtype=torch.float32)) for v in q]


def _q4_1_wrong_readings(block: bytes) -> dict[str, list[float]]:
    """The block read in the plausible wrong ways, each with the hint that names the mistake."""
    d, m = _FLOAT16_PAIR.unpack(block[:4])
    packed = block[4:]
    low, high = [b & 0x0F for b in packed], [b >> 4 for b in packed]
    neighbours = [v for pair in zip(low, high) for v in pair]
    return {
        "Byte j holds q[j] (low four bits) and q[j + 16] (high four bits): the first 16 numbers are the low "
        "halves of the 16 bytes, the last 16 the high halves, not neighbours.": [d * v + m for v in neighbours],
        "The low four bits of byte j are q[j], the high four bits q[j + 16] (you swapped them).":
            [d * v + m for v in high + low],
        "The first float16 is the step d, the second the minimum m.": [m * v + d for v in low + high],
        "Q4_1 adds the block's minimum: x = d q + m.": [d * v for v in low + high],
        "Q4_1's q runs from 0 to 15 and the minimum m is added; subtracting 8 is Q4_0's rule.":
            [d * (v - 8) for v in low + high],
    }


def _random_q4_1_block(g: torch.Generator) -> bytes:
    d = float(torch.rand((), generator=g)) * 0.01 + 1e-4
    m = -float(torch.rand((), generator=g)) * 0.1
    packed = torch.randint(0, 256, (16,), generator=g).tolist()
    return _FLOAT16_PAIR.pack(d, m) + bytes(packed)


_PACKAGE_DECODERS = ("groundup/quantization.py", "groundup/gguf.py", "gguf/quants.py", "gguf/gguf_reader.py")
_OWN_DECODERS = (_q4_1_reference, _q4_1_wrong_readings)  # this checker's decoding, refused through tripwires


@contextlib.contextmanager
def _calls_into(files: tuple[str, ...]):
    """Record (in the yielded list) every Python function called from ``files`` while the body runs: a checker
    uses it to tell the reader's own decoding from a call of the package's solution."""
    seen: list[str] = []
    previous = sys.getprofile()

    def profile(frame, event, arg):
        if event == "call":
            filename = frame.f_code.co_filename.replace("\\", "/")
            if filename.endswith(files):
                seen.append(f"{Path(filename).parent.name}.{Path(filename).stem}.{frame.f_code.co_name}")

    sys.setprofile(profile)
    try:
        yield seen
    finally:
        sys.setprofile(previous)


def _plain_real_tensor(value, call: str, expected: str) -> torch.Tensor:
    """``value`` if it is a plain dense real floating-point tensor holding numbers, else a Mismatch."""
    expect(type(value) is torch.Tensor, f"{call} returned {type(value).__name__}, expected {expected}",
           f"Return {expected}." + (" Did you forget the `return` statement?" if value is None else ""))
    expect(value.layout == torch.strided and not value.is_meta and value.is_floating_point(),
           f"{call} returned a tensor of dtype {value.dtype} and layout {value.layout}, expected {expected}",
           "Return an ordinary dense tensor of floats, e.g. torch.float32.")
    return value.detach().cpu()


def check_decode_q4_1_block(fn: Callable) -> Verdict:
    """Exercise 12.6: ``fn(block) -> x``, one Q4_1 block (a uint8 tensor of 20 bytes: float16 d, float16 m, 16
    bytes of packed 4-bit q) decoded into its 32 numbers ``x = d q + m``, written by hand (the package's, the
    ``gguf`` package's and this checker's own decoders are refused)."""

    def checks():
        g = torch.Generator().manual_seed(126)
        hand = _FLOAT16_PAIR.pack(0.5, -2.0) + bytes((3 * j % 16) | ((3 * (j + 16) % 16) << 4) for j in range(16))
        blocks = [hand] + [_random_q4_1_block(g) for _ in range(5)]
        expected = [torch.tensor(_q4_1_reference(b), dtype=torch.float64) for b in blocks]
        wrong = [{hint: torch.tensor(x, dtype=torch.float64) for hint, x in _q4_1_wrong_readings(b).items()}
                 for b in blocks]
        for k, block in enumerate(blocks):
            call = f"my_decode_q4_1_block(block) for block {k + 1} of {len(blocks)} ({block[:4].hex()}...)"
            with _calls_into(_PACKAGE_DECODERS) as seen:
                out = call_reader(fn, torch.tensor(list(block), dtype=torch.uint8), call=call, names=("block",),
                                  forbid=_OWN_DECODERS)
            expect(not seen, f"{call} called {seen[0] if seen else ''}",
                   "This exercise asks you to decode the bytes yourself: read d and m with "
                   "block[:4].view(torch.float16), then split each byte into its two halves with & 0x0F and >> 4.")
            got = _plain_real_tensor(out, call, "a tensor of 32 floats").reshape(-1)
            expect(got.numel() == 32, f"{call} returned {got.numel()} numbers, expected 32",
                   "A block holds 32 numbers: two per byte of the 16 packed bytes.")
            rtol, atol = 1e-6, 1e-6 * float(expected[k].abs().max())
            for hint, x in wrong[k].items():
                if torch.allclose(got.to(torch.float64), x, rtol=rtol, atol=atol) and \
                        not torch.allclose(x, expected[k], rtol=rtol, atol=atol):
                    raise Mismatch(f"{call}: the 32 numbers are the block read the wrong way", hint)
            expect_close(got, expected[k], call, "x = d q + m, with d and m the two float16 numbers at the start "
                         "and q[j], q[j + 16] the low and high four bits of byte j.", rtol=rtol, atol=atol)

    return run_checks("Exercise 12.6 (decoding a Q4_1 block)", checks,
                      "Your decoder reads llama.cpp's Q4_1 blocks: a block of round numbers and five random ones.")


_BYTES_PER_NUMBER = {"F32": 4.0, "F16": 2.0, "Q8_0": 34 / 32, "Q4_1": 20 / 32}


def gguf_tensor_bytes(n_layers: int, d_model: int, n_heads: int, n_kv_heads: int, d_ff: int, vocab_size: int,
                      matrices: str, embedding: str) -> int:
    """The bytes of a LLaMA-style model's tensors in a GGUF file: the block matrices in ``matrices``, the (tied)
    embedding in ``embedding``, the RMSNorm vectors in F32 (as llama.cpp stores them)."""
    d, d_kv = d_model, d_model // n_heads * n_kv_heads
    per_block = d * d + 2 * d * d_kv + d * d + 3 * d * d_ff  # W_Q, W_K, W_V, W_O; gate, up, down
    numbers = {matrices: 0, embedding: 0, "F32": 0}
    numbers[matrices] += n_layers * per_block
    numbers[embedding] += vocab_size * d
    numbers["F32"] += (2 * n_layers + 1) * d
    return round(sum(_BYTES_PER_NUMBER[kind] * count for kind, count in numbers.items()))


def check_gguf_bytes(fn: Callable) -> Verdict:
    """Exercise 12.7: ``fn(n_layers, d_model, n_heads, n_kv_heads, d_ff, vocab_size, matrices, embedding) -> int``,
    the bytes of a LLaMA-style model's tensors stored in GGUF with the given formats (norms in F32, U tied).
    Calling :func:`gguf_tensor_bytes`, the checker's own answer, is refused; ``quantization.n_bytes``, which the
    chapter uses for one tensor's bytes before the exercise, is allowed."""

    def checks():
        cases = [(30, 576, 9, 3, 1536, 49152, "Q4_1", "Q8_0"), (30, 576, 9, 3, 1536, 49152, "Q8_0", "Q8_0"),
                 (30, 576, 9, 3, 1536, 49152, "F32", "F32"), (24, 2048, 32, 32, 8192, 49152, "Q4_1", "Q8_0"),
                 (2, 64, 4, 2, 96, 320, "F16", "Q4_1")]
        for case in cases:
            expected = gguf_tensor_bytes(*case)
            n_layers, d, n_heads, n_kv, d_ff, vocab, matrices, embedding = case
            call = f"my_gguf_bytes{case}"
            got = expect_number(call_reader(fn, *case, call=call, forbid=(gguf_tensor_bytes,)), call,
                                "Return the number of bytes as an int.")
            d_kv = d // n_heads * n_kv
            matrix_numbers = n_layers * (2 * d * d + 2 * d * d_kv + 3 * d * d_ff)
            norms = (2 * n_layers + 1) * d
            bits = {"Q8_0": 8, "Q4_1": 4, "F16": 16, "F32": 32}
            hints = {
                round((matrix_numbers * bits[matrices] + vocab * d * bits[embedding] + norms * 32) / 8):
                    "Each block of 32 numbers also stores its float16 scale (and, in Q4_1, its float16 minimum): "
                    "Q8_0 takes 34 bytes per 32 numbers, Q4_1 20 bytes.",
                expected + round(vocab * d * _BYTES_PER_NUMBER[embedding]):
                    "U is tied to W_E: the embedding is stored once.",
                expected - norms * 4: "Count the RMSNorm vectors too (2 per block and the final one), in F32.",
                expected + round(2 * n_layers * d * (d - d_kv) * _BYTES_PER_NUMBER[matrices]):
                    f"With grouped-query attention W_K and W_V have n_kv_heads * d_head = {d_kv} rows, not d_model.",
            }
            if isinstance(got, float) and not float(got).is_integer():
                raise Mismatch(f"{call} = {got}, not a whole number of bytes",
                               "Every format stores whole blocks: count blocks times bytes per block.")
            expect(abs(got - expected) < 0.5, f"{call} = {got:,.0f} bytes, which is not right",
                   hints.get(round(got), "Per block: W_Q and W_O (d x d), W_K and W_V (d_kv x d), gate, up and "
                         "down (d_ff x d) in `matrices`; two RMSNorm vectors in F32. Then the embedding in "
                         "`embedding` and the final norm."))

    return run_checks("Exercise 12.7 (the bytes of a quantized model)", checks,
                      "Right for SmolLM2-135M in Q4_1 (96,576,768 bytes, as in its file), Q8_0 and F32, SmolLM2-1.7B's "
                      "shape and a toy.")
