"""Chapter 12's checkers: each accepts the notebook's hidden solution, rejects plausible wrong answers with the right
hint, refuses answers that call the package's own solution or the gguf package's (also from a thread or a process of
their own, or through a copy of its code), reports an answer that raises, treats the unattempted stub kindly and
reports answers that modify their inputs."""

import concurrent.futures
import inspect
import io
import os
import queue
import struct
import subprocess
import sys
import tempfile
import threading
import types
import warnings
from pathlib import Path

import gguf
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf import quants as gguf_quants

from groundup import kquants
from groundup import quantization as Q
from groundup.exercises import checking as _checking
from groundup.exercises.ch12 import (
    _gpt_count,
    _q8_0_cases,
    _unpermute,
    check_dequantize_q6_k,
    check_llama_parameter_count,
    check_quantize_q8_0,
    check_read_array,
    check_rotary_permutation,
    check_unpermute_rows,
    check_write_gguf,
)
from groundup.models import GPT, GPTConfig

# --- reference solutions (the notebook's hidden solutions) ----------------------------------------------------


def quantize_q8_0_solution(x):
    blocks = x.reshape(-1, 32)
    d = blocks.abs().amax(dim=1, keepdim=True) / 127
    inverse = torch.where(d == 0, 0.0, 1 / d)
    v = blocks * inverse
    a = v.abs()
    q = v.sign() * (a.floor() + (2 * (a - a.floor())).floor())
    return torch.cat([d.to(torch.float16).view(torch.uint8), q.to(torch.int8).view(torch.uint8)], dim=1).reshape(-1)


def dequantize_q6_k_solution(raw):
    blocks = raw.reshape(-1, 210)
    n = blocks.shape[0]
    ql = blocks[:, :128].reshape(n, 2, 1, 64).long()
    qh = blocks[:, 128:192].reshape(n, 2, 1, 32).long()
    scales = blocks[:, 192:208].contiguous().view(torch.int8).float()
    d = blocks[:, 208:].contiguous().view(torch.float16).float()
    low = (ql >> torch.tensor([0, 4]).reshape(2, 1)) & 0x0F
    high = (qh >> torch.tensor([0, 2, 4, 6]).reshape(4, 1)) & 0x03
    q = (low.reshape(n, 256) | high.reshape(n, 256) << 4) - 32
    return ((d * scales).repeat_interleave(16, dim=1) * q.float()).reshape(-1)


def permutation_solution(d_head):
    return [j for i in range(d_head // 2) for j in (i, i + d_head // 2)]


def unpermute_rows_solution(weight, n_heads):
    rows, d_in = weight.shape
    return weight.reshape(n_heads, rows // n_heads // 2, 2, d_in).transpose(1, 2).reshape(rows, d_in)


FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


def read_array_solution(data, offset, formats=FORMATS, length_format="<Q", count_format="<Q"):
    (element_type,) = struct.unpack_from("<I", data, offset)
    (count,) = struct.unpack_from(count_format, data, offset + 4)
    offset += 4 + struct.calcsize(count_format)
    values = []
    for _ in range(count):
        if element_type == 8:
            (length,) = struct.unpack_from(length_format, data, offset)
            offset += struct.calcsize(length_format)
            (raw,) = struct.unpack_from(f"{length}s", data, offset)
            values.append(raw.decode("utf-8"))
            offset += length
        else:
            values.append(struct.unpack_from(formats[element_type], data, offset)[0])
            offset += struct.calcsize(formats[element_type])
    return values, offset


def llama_count_solution(n_layers, d_model, n_heads, n_kv_heads, d_ff, vocab_size, tied):
    d_kv = d_model // n_heads * n_kv_heads
    block = 2 * d_model * d_model + 2 * d_kv * d_model + 3 * d_model * d_ff + 2 * d_model
    return vocab_size * d_model * (1 if tied else 2) + n_layers * block + d_model


def write_gguf_solution(path, name, tensor, *, sizes=None, align=32, offset=None, length="bytes",
                        entries=(("general.architecture", "llama"),), extra=b""):
    def string(text):
        raw = text.encode("utf-8")
        if length == "none":
            return raw
        return struct.pack("<Q", len(text) if length == "characters" else len(raw)) + raw

    dims = tuple(reversed(tensor.shape)) if sizes is None else sizes(tensor)
    head = b"GGUF" + struct.pack("<IQQ", 3, 1, len(entries))
    head += b"".join(string(key) + struct.pack("<I", 8) + string(value) for key, value in entries)
    table = string(name) + struct.pack(f"<I{len(dims)}QI", len(dims), *dims, 0)
    used = len(head) + len(table) + 8
    start = -(-used // align) * align
    table += struct.pack("<Q", start if offset == "file" else 0)
    Path(path).write_bytes(head + table + bytes(start - used) + tensor.contiguous().numpy().tobytes() + extra)


def stub(*args):
    raise NotImplementedError


def raises(*args):
    return 1 / 0


def verdict(checker, fn, capsys):
    ok = checker(fn)
    return bool(ok), capsys.readouterr().out


@pytest.fixture(autouse=True)
def _unwrapped_verdicts(monkeypatch):
    """Match hints as whole lines; tests/test_checking.py tests the wrapping to the book's width."""
    monkeypatch.setattr(_checking, "MESSAGE_WIDTH", 10_000)


SOLUTIONS = [(check_quantize_q8_0, quantize_q8_0_solution), (check_dequantize_q6_k, dequantize_q6_k_solution),
             (check_rotary_permutation, permutation_solution), (check_unpermute_rows, unpermute_rows_solution),
             (check_read_array, read_array_solution), (check_llama_parameter_count, llama_count_solution),
             (check_write_gguf, write_gguf_solution)]


@pytest.mark.parametrize("checker, solution", SOLUTIONS, ids=lambda f: getattr(f, "__name__", ""))
def test_reference_passes_the_stub_is_not_attempted_and_an_error_is_reported(checker, solution, capsys):
    ok, out = verdict(checker, solution, capsys)
    assert ok and "✅" in out, out
    ok, out = verdict(checker, stub, capsys)
    assert not ok and "not attempted yet" in out, out
    ok, out = verdict(checker, raises, capsys)
    assert not ok and "your function raised ZeroDivisionError" in out and "bug in the book" not in out, out


# --- 12.1: Q8_0 -----------------------------------------------------------------------------------------------


def q8_0(x, rounding="away", divide=False, d16=False):
    """Q8_0 written the right way or with one mistake, independently of the checker's own variants."""
    blocks = x.reshape(-1, 32)
    d = blocks.abs().amax(dim=1, keepdim=True) / 127
    if d16:
        d = d.half().float()
    v = torch.where(d == 0, 0.0, blocks / d) if divide else blocks * torch.where(d == 0, 0.0, 1 / d)
    if rounding == "away":
        a = v.abs()
        q = v.sign() * (a.floor() + (2 * (a - a.floor())).floor())
    elif rounding == "even":
        q = torch.round(v)
    else:
        q = v.sign() * (v.abs() + 0.5).floor()
    return torch.cat([d.half().view(torch.uint8), q.to(torch.int8).view(torch.uint8)], dim=1).reshape(-1)


def test_the_cases_are_quantized_by_the_solution_as_by_gguf():
    for _, x in _q8_0_cases():
        assert torch.equal(quantize_q8_0_solution(x), torch.from_numpy(
            gguf_quants.quantize(x.numpy(), GGMLQuantizationType.Q8_0).reshape(-1)))


@pytest.mark.parametrize("answer, message, hint", [
    (lambda x: q8_0(x, rounding="even"), "q_1 is 2, expected 3 (x_1 = 2.5)", "torch.round rounds halves to the even"),
    (lambda x: q8_0(x, rounding="floor"), "expected 0 (x_11 = 0.4999999701976776)",
     "floor(|v| + 0.5) is not roundf in float32"),
    (lambda x: q8_0(x, divide=True), "for a block where x_j * (1/d) lies on a tie", "multiplies by the reciprocal"),
    (lambda x: q8_0(x, d16=True), "is", "only the copy of d written to the block is rounded to float16"),
    (lambda x: q8_0(x).reshape(-1, 34)[:, [*range(2, 34), 0, 1]].reshape(-1), "block 0", "Each block starts with d"),
])
def test_q8_0_mistakes_are_named(answer, message, hint, capsys):
    ok, out = verdict(check_quantize_q8_0, answer, capsys)
    assert not ok and message in out and hint in out, out


@pytest.mark.parametrize("answer, message", [
    (lambda x: q8_0(x).view(torch.int8), "returned a torch.int8 tensor, expected torch.uint8"),
    (lambda x: q8_0(x).reshape(-1, 34), "expected a 1-D tensor"),
    (lambda x: bytes(q8_0(x).tolist()), "returned a bytes, expected a 1-D torch.uint8 tensor"),
    (lambda x: q8_0(x)[:-2], "bytes, expected"),
    (lambda x: q8_0(x.mul_(1.5)), "changed its input x in place"),
])
def test_q8_0_answers_of_the_wrong_kind_are_told_so(answer, message, capsys):
    ok, out = verdict(check_quantize_q8_0, answer, capsys)
    assert not ok and message in out, out


@pytest.mark.parametrize("answer, called", [
    (lambda x: Q.quantize(x, Q.Q8_0), "calls groundup.quantization.quantize"),
    (lambda x: Q.quantize_q8_0(x), "calls groundup.quantization.quantize_q8_0"),
    (lambda x: torch.from_numpy(gguf_quants.quantize(x.numpy(), GGMLQuantizationType.Q8_0).reshape(-1)),
     "calls gguf.quants.quantize"),
    (lambda x: torch.from_numpy(gguf_quants.Q8_0.quantize_blocks(x.reshape(-1, 32).numpy()).reshape(-1)),
     "calls gguf.quants.Q8_0.quantize_blocks"),
])
def test_q8_0_package_quantizers_are_refused(answer, called, capsys):
    ok, out = verdict(check_quantize_q8_0, answer, capsys)
    assert not ok and called in out and "asks for the quantizer itself" in out, out


def test_q8_0_the_checkers_own_variant_is_refused(capsys):
    from groundup.exercises import ch12

    ok, out = verdict(check_quantize_q8_0, lambda x: ch12._q8_0_variant(x), capsys)
    assert not ok and "calls groundup.exercises.ch12._q8_0_variant" in out, out
    assert torch.equal(ch12._q8_0_variant(torch.ones(32)), q8_0(torch.ones(32))), "it works again afterwards"


# --- 12.2: Q6_K -----------------------------------------------------------------------------------------------


def q6_k(raw, minus=32, scale_type=torch.int8, neighbours=False):
    """Q6_K decoded the right way or with one mistake."""
    blocks = raw.reshape(-1, 210)
    n = blocks.shape[0]
    ql = blocks[:, :128].long()
    if neighbours:
        low = (ql.reshape(n, 128, 1) >> torch.tensor([0, 4])) & 0x0F
    else:
        low = (ql.reshape(n, 2, 1, 64) >> torch.tensor([0, 4]).reshape(2, 1)) & 0x0F
    high = (blocks[:, 128:192].long().reshape(n, 2, 1, 32) >> torch.tensor([0, 2, 4, 6]).reshape(4, 1)) & 3
    q = (low.reshape(n, 256) | high.reshape(n, 256) << 4) - minus
    scales = blocks[:, 192:208].contiguous().view(scale_type).float()
    d = blocks[:, 208:].contiguous().view(torch.float16).float()
    return ((d * scales).repeat_interleave(16, dim=1) * q.float()).reshape(-1)


@pytest.mark.parametrize("answer, hint", [
    (lambda raw: q6_k(raw, minus=0), "Subtract 32"),
    (lambda raw: q6_k(raw, scale_type=torch.uint8), "The 16 scales are signed bytes"),
    (lambda raw: q6_k(raw, neighbours=True), "The two nibbles of a ql byte are not neighbouring weights"),
    (lambda raw: q6_k(raw).double(), "Compute in float32"),
    (lambda raw: q6_k(raw).reshape(-1, 256), "put them one after the other in a 1-D tensor"),
    (lambda raw: q6_k(raw) * (1 + 2 ** -20), "the low nibble of ql byte l gives the low four bits of weight l"),
])
def test_q6_k_mistakes_are_named(answer, hint, capsys):
    ok, out = verdict(check_dequantize_q6_k, answer, capsys)
    assert not ok and hint in out, out


@pytest.mark.parametrize("answer, called", [
    (lambda raw: Q.dequantize(raw, kquants.Q6_K, (raw.numel() // 210 * 256,)),
     "calls groundup.quantization.dequantize"),
    (lambda raw: kquants.parts(raw.reshape(-1, 210), kquants.Q6_K)[0].float(), "calls groundup.kquants.parts"),
    (lambda raw: torch.from_numpy(gguf_quants.dequantize(raw.numpy(), GGMLQuantizationType.Q6_K)),
     "calls gguf.quants.dequantize"),
])
def test_q6_k_package_decoders_are_refused(answer, called, capsys):
    ok, out = verdict(check_dequantize_q6_k, answer, capsys)
    assert not ok and called in out and "take the bytes apart yourself" in out, out


# --- 12.3: rotary permutation (unchanged exercise) ------------------------------------------------------------


def test_inverse_permutation_is_rejected(capsys):
    def inverse(d):
        perm = permutation_solution(d)
        inv = [0] * d
        for i, p in enumerate(perm):
            inv[p] = i
        return inv

    ok, out = verdict(check_rotary_permutation, inverse, capsys)
    assert not ok and "(8) = [0, 2, 4, 6, 1, 3, 5, 7]" in out and "positions 0 and 1 of x[perm] together" in out, out
    assert "Which two dimensions does rotate-half pair at frequency 0?" in out
    assert "must take" not in out, "the hint does not give the answer away"


def test_a_swapped_pair_is_named(capsys):
    ok, out = verdict(check_rotary_permutation, lambda d: [1, 0] if d == 2 else permutation_solution(d), capsys)
    assert not ok and "Positions 0 and 1 hold the right pair of dimensions in the wrong order" in out, out


def test_non_permutation_is_rejected(capsys):
    ok, out = verdict(check_rotary_permutation, lambda d: [0] * d, capsys)
    assert not ok and "not a permutation" in out, out


def test_tensor_permutation_is_accepted(capsys):
    ok, out = verdict(check_rotary_permutation, lambda d: torch.tensor(permutation_solution(d)), capsys)
    assert ok, out


@pytest.mark.parametrize("answer, message, hint", [
    (lambda d: [float(i) for i in permutation_solution(d)], "returned a list whose entries are float (e.g. 0.0)",
     "The entries must be ints: indices into x (int(i) for i in ...)."),
    (lambda d: [True, False], "returned a list whose entries are bool (e.g. True)", "The entries must be ints"),
    (lambda d: torch.tensor(permutation_solution(d), dtype=torch.float32),
     "returned a tensor whose entries are float (e.g. 0.0)", "The entries must be ints"),
    (lambda d: permutation_solution(d)[:-1], "returned a list of 1 entry, expected 2",
     "Return a list of 2 ints: one index of x for each position"),
    (lambda d: "0 1", "returned str", "Return a list of 2 ints"),
])
def test_an_answer_of_the_wrong_kind_is_told_what_is_wrong_with_it(answer, message, hint, capsys):
    ok, out = verdict(check_rotary_permutation, answer, capsys)
    out = " ".join(out.split())
    assert not ok and f"my_rotary_permutation(2) {message}" in out and hint in out, out


def searched_with_the_package(d_head):
    """Tries permutations with the package's rotary embedding until one fits: a search, not the pairing."""
    from itertools import permutations

    from groundup.positional import RotaryEmbedding

    x, t = torch.randn(1, d_head, dtype=torch.float64), torch.tensor([3])
    half, interleaved = RotaryEmbedding(d_head, pairing="half"), RotaryEmbedding(d_head)
    for perm in permutations(range(d_head)):
        perm = list(perm)
        if torch.allclose(interleaved.apply_rotary(x[:, perm], t), half.apply_rotary(x, t)[:, perm]):
            return perm
    raise AssertionError("none found")


def with_transformers(d_head):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from transformers.models.llama.modeling_llama import rotate_half

    rotate_half(torch.zeros(d_head))
    return permutation_solution(d_head)


@pytest.mark.parametrize("answer, refused", [
    (searched_with_the_package, "calls groundup.positional.RotaryEmbedding.__init__"),
    (with_transformers, "calls transformers.models.llama.modeling_llama.rotate_half"),
])
def test_permutation_searched_with_rotary_code_is_refused(answer, refused, capsys):
    ok, out = verdict(check_rotary_permutation, answer, capsys)
    assert not ok and refused in out and "pairing the dimensions yourself" in out, out


# --- 12.4: un-permuting W_Q and W_K ---------------------------------------------------------------------------


def llama_cpp_permute(w, n_heads):
    """convert_hf_to_gguf.py's permute, written out: the forward direction, the wrong answer."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, w.shape[1]).swapaxes(1, 2).reshape(w.shape)


def test_the_solution_inverts_llama_cpps_permutation_and_the_model_agrees():
    w = torch.randn(3 * 8, 5, dtype=torch.float64)
    assert torch.equal(unpermute_rows_solution(llama_cpp_permute(w, 3), 3), w)
    assert not torch.equal(llama_cpp_permute(w, 3), unpermute_rows_solution(w, 3)), "d_h = 8 tells them apart"


@pytest.mark.parametrize("answer, hint", [
    (llama_cpp_permute, "That is the converter's own permutation"),
    (lambda w, n: unpermute_rows_solution(w, 1), "Each head's rows are permuted on their own"),
    (lambda w, n: w.clone(), "The rows must move"),
    (lambda w, n: unpermute_rows_solution(w, n).float(), "keep the dtype of weight"),
    (lambda w, n: unpermute_rows_solution(w, n)[:, :1], "the shape does not change"),
])
def test_unpermute_mistakes_are_named(answer, hint, capsys):
    ok, out = verdict(check_unpermute_rows, answer, capsys)
    assert not ok and hint in out, out


def test_unpermute_gqa_key_rows_are_checked_with_their_own_head_count(capsys):
    """An answer that ignores n_heads and assumes the 4 query heads of the tiny model passes W_q, fails W_k."""
    def four_heads(w, n):
        return unpermute_rows_solution(w, 4 if w.shape[1] == 32 else n)  # d_model of the tiny model

    ok, out = verdict(check_unpermute_rows, four_heads, capsys)
    assert not ok and "blocks.0.attention.W_k.weight (16, 32)" in out and "2 key/value heads" in out, out


def test_unpermute_package_helpers_are_refused(capsys):
    from groundup import pretrained

    def with_the_loader(weight, n_heads):
        pretrained.llama_config({"hidden_size": 8, "num_attention_heads": 2})
        return unpermute_rows_solution(weight, n_heads)

    ok, out = verdict(check_unpermute_rows, with_the_loader, capsys)
    assert not ok and "calls groundup.pretrained.llama_config" in out and "groundup.pretrained is the book's" in out
    ok, out = verdict(check_unpermute_rows, _unpermute, capsys)
    assert not ok and "calls groundup.exercises.ch12._unpermute" in out, out


# --- 12.5: a metadata array -----------------------------------------------------------------------------------


def latin_1(data, offset):
    values, offset = read_array_solution(data, offset)
    return [v.encode("utf-8").decode("latin-1") if isinstance(v, str) else v for v in values], offset


def sliced_strings(data, offset):
    """Reads strings with a slice, which silently gives fewer bytes when the data ends too soon."""
    (element_type, count), offset = struct.unpack_from("<IQ", data, offset), offset + 12
    if element_type != 8:
        return read_array_solution(data, offset - 12)
    values = []
    for _ in range(count):
        (length,) = struct.unpack_from("<Q", data, offset)
        values.append(data[offset + 8:offset + 8 + length].decode("utf-8"))
        offset += 8 + length
    return values, offset


@pytest.mark.parametrize("answer, message, hint", [
    (lambda data, o: latin_1(data, o), "value 2 is 'Ä\\xa0the', expected 'Ġthe'",
     "Each string is a uint64 length n (8 bytes, little-endian), then exactly n bytes of UTF-8"),
    (lambda data, o: read_array_solution(data, o, count_format="<I"),
     "your function raised error: unpack_from requires a buffer", ""),
    (lambda data, o: read_array_solution(data, o, formats={**FORMATS, 1: "<B"}), "value 0 is 128, expected -128",
     "Type 1 is int8: 1 bytes, little-endian, signed"),
    (lambda data, o: read_array_solution(data, o, formats={**FORMATS, 7: "<B"}), "returned 1 (int) in an array of "
     "bools", "Type 7 is bool"),
    (lambda data, o: read_array_solution(data, o, formats={**FORMATS, 6: "<d"}), "for test.float32",
     "Type 6 is float32: 4 bytes"),
    (lambda data, o: (read_array_solution(data, o)[0], o), "next_offset", "Return the offset after the last one"),
    (lambda data, o: tuple(read_array_solution(data, o)[0]), "returned", "expected a pair (values, next_offset)"),
    (sliced_strings, "the file cut 8 bytes before the end of the last string of test.strings", "instead of raising"),
])
def test_array_mistakes_are_named(answer, message, hint, capsys):
    ok, out = verdict(check_read_array, answer, capsys)
    assert not ok and message in out and hint in out, out


def test_strings_left_as_bytes_are_told_to_decode(capsys):
    def undecoded(data, offset):
        (_, count), offset = struct.unpack_from("<IQ", data, offset), offset + 12
        values = []
        for _ in range(count):
            (length,) = struct.unpack_from("<Q", data, offset)
            values.append(data[offset + 8:offset + 8 + length])
            offset += 8 + length
        return values, offset

    ok, out = verdict(check_read_array, undecoded, capsys)
    assert not ok and "returned a string as bytes" in out and "decode('utf-8')" in out, out


@pytest.mark.parametrize("answer, called", [
    (lambda data, offset: gguf.GGUFReader(io.BytesIO(data)), "calls gguf.GGUFReader"),
    (lambda data, offset: via_package_cursor(data, offset), "calls groundup.gguf._Cursor.__init__"),
    (lambda data, offset: via_read_gguf(data, offset), "calls groundup.gguf.read_gguf"),
])
def test_array_readers_of_the_packages_are_refused(answer, called, capsys):
    ok, out = verdict(check_read_array, answer, capsys)
    assert not ok and called in out and "read the bytes yourself" in out, out


def via_package_cursor(data, offset):
    from groundup.gguf import _Cursor, _read_value

    cursor = _Cursor(data, len(data))
    cursor.pos = offset
    return _read_value(cursor, 9, "key"), cursor.pos


def via_read_gguf(data, offset):
    from groundup.gguf import read_gguf

    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "f.gguf").write_bytes(data)
        read_gguf(Path(folder) / "f.gguf")
    raise AssertionError("unreachable: the tripwire stops read_gguf")


def test_the_package_cursor_bypass_gives_the_right_answer():
    """What the refused answer above would get: the right values (so the refusal, not a wrong value, stops it)."""
    data = b"GGUF" + bytes(20) + struct.pack("<IQ", 5, 2) + struct.pack("<ii", -1, 7)
    assert via_package_cursor(data, 24) == ([-1, 7], 44) == read_array_solution(data, 24)


# --- 12.6: LLaMA's parameter count ----------------------------------------------------------------------------


def test_the_meta_gpt_counts_what_the_chapter_quotes():
    assert _gpt_count(32, 4096, 32, 32, 11008, 32000, False) == 6_738_415_616
    assert _gpt_count(30, 576, 9, 3, 1536, 49152, True) == 134_515_008
    assert llama_count_solution(80, 8192, 64, 8, 28672, 32000, False) == _gpt_count(80, 8192, 64, 8, 28672, 32000,
                                                                                     False) == 68_976_648_192


@pytest.mark.parametrize("answer, hint", [
    (lambda n, d, h, kv, f, v, tied: llama_count_solution(n, d, h, kv, f, v, tied) + (0 if tied else v * d),
     "W_E and U are one"),
    (lambda n, d, h, kv, f, v, tied: llama_count_solution(n, d, h, kv, f, v, True), "U is its own matrix"),
    (lambda n, d, h, kv, f, v, tied: llama_count_solution(n, d, h, h, f, v, tied), "W_K and W_V have"),
    (lambda n, d, h, kv, f, v, tied: llama_count_solution(n, d, h, kv, f, v, tied) - d, "the final RMSNorm's gamma"),
    (lambda n, d, h, kv, f, v, tied: llama_count_solution(n, d, h, kv, f, v, tied) + (2 * n + 1) * d,
     "no shift beta"),
    (lambda n, d, h, kv, f, v, tied: float(llama_count_solution(n, d, h, kv, f, v, tied)),
     "as an int"),
])
def test_count_mistakes_are_named(answer, hint, capsys):
    ok, out = verdict(check_llama_parameter_count, answer, capsys)
    assert not ok and hint in out, out


def test_counting_with_a_tied_matrix_counted_twice_is_named(capsys):
    ok, out = verdict(check_llama_parameter_count, lambda n, d, h, kv, f, v, tied:
                      llama_count_solution(n, d, h, kv, f, v, False), capsys)
    assert not ok and "my_llama_parameter_count(30, 576, 9, 3, 1536, 49152, True)" in out, out
    assert "the one shared matrix counts once" in out, out


def test_building_a_model_to_count_is_refused(capsys):
    def built(n_layers, d_model, n_heads, n_kv_heads, d_ff, vocab_size, tied):
        config = GPTConfig(vocab_size=vocab_size, d_model=d_model, n_layers=n_layers, n_heads=n_heads,
                           n_kv_heads=n_kv_heads, d_ff=d_ff, positional="rope", norm="rmsnorm",
                           activation="swiglu", bias=False, tie_weights=tied)
        with torch.device("meta"):
            return sum(p.numel() for p in GPT(config).parameters())

    ok, out = verdict(check_llama_parameter_count, built, capsys)
    assert not ok and "calls torch.nn.Module.__init__ (it builds a model)" in out, out
    assert "without building a model" in out, out
    assert built(1, 4, 1, 1, 4, 3, True) == llama_count_solution(1, 4, 1, 1, 4, 3, True), "GPT works afterwards"


def test_building_transformers_mistral_on_the_meta_device_is_refused(capsys):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from transformers import MistralConfig, MistralForCausalLM

    def mistral(n_layers, d_model, n_heads, n_kv_heads, d_ff, vocab_size, tied):
        config = MistralConfig(vocab_size=vocab_size, hidden_size=d_model, intermediate_size=d_ff,
                               num_hidden_layers=n_layers, num_attention_heads=n_heads,
                               num_key_value_heads=n_kv_heads, tie_word_embeddings=tied)
        with torch.device("meta"):
            return sum(p.numel() for p in MistralForCausalLM(config).parameters())

    assert mistral(2, 8, 2, 1, 12, 10, False) == llama_count_solution(2, 8, 2, 1, 12, 10, False), "it would count"
    ok, out = verdict(check_llama_parameter_count, mistral, capsys)
    assert not ok and "calls torch.nn.Module.__init__ (it builds a model)" in out, out
    assert "without building a model" in out, out


def test_the_checkers_own_count_is_refused(capsys):
    from groundup.exercises import ch12

    ok, out = verdict(check_llama_parameter_count, lambda *case: ch12._gpt_count(*case), capsys)
    assert not ok and "calls groundup.exercises.ch12._gpt_count" in out, out


# --- 12.7: a one-tensor GGUF writer --------------------------------------------------------------------------


def test_the_solutions_file_is_what_gguf_and_the_package_read(tmp_path):
    from groundup.gguf import read_gguf

    tensor = torch.randn(3, 5)
    write_gguf_solution(tmp_path / "f.gguf", "größe.w", tensor)
    reader = gguf.GGUFReader(tmp_path / "f.gguf")
    assert reader.fields["general.architecture"].contents() == "llama"
    assert [t.name for t in reader.tensors] == ["größe.w"] and reader.tensors[0].shape.tolist() == [5, 3]
    assert torch.equal(torch.from_numpy(reader.tensors[0].data.copy()), tensor)
    del reader
    assert torch.equal(read_gguf(tmp_path / "f.gguf").tensor("größe.w"), tensor)


@pytest.mark.parametrize("answer, message, hint", [
    (lambda p, n, t: write_gguf_solution(p, n, t, sizes=lambda t: tuple(t.shape)), "the sizes",
     "GGUF lists the sizes contiguous first"),
    (lambda p, n, t: write_gguf_solution(p, n, t, align=1), "zero padding",
     "The data section starts at the next multiple of 32"),
    (lambda p, n, t: write_gguf_solution(p, n, t, offset="file"), "the tensor's offset",
     "counts from the start of the data section, not from the start of the file"),
    (lambda p, n, t: write_gguf_solution(p, n, t, length="none"), "the length of the key",
     "A string is its length as a uint64"),
    (lambda p, n, t: write_gguf_solution(p, n, t, length="characters"), "größe.gewicht",
     "A string's length counts bytes, not characters"),
    (lambda p, n, t: Path(p).write_bytes(b"GGUF"), "the file ends at byte 4", "the version 3"),
])
def test_gguf_writer_mistakes_are_named(answer, message, hint, capsys):
    ok, out = verdict(check_write_gguf, answer, capsys)
    assert not ok and message in out and hint in out, out


def test_a_transposed_tensor_written_in_memory_order_is_named(capsys):
    def storage_order(path, name, tensor):
        write_gguf_solution(path, name, tensor)
        if not tensor.is_contiguous():
            data = bytearray(Path(path).read_bytes())
            memory = torch.as_strided(tensor, (tensor.numel(),), (1,)).numpy().tobytes()
            data[-len(memory):] = memory
            Path(path).write_bytes(data)

    ok, out = verdict(check_write_gguf, storage_order, capsys)
    assert not ok and "not contiguous in memory" in out and "in the tensor's logical order" in out, out


def test_another_valid_file_is_accepted_and_an_extra_entry_is_not(capsys):
    ok, out = verdict(check_write_gguf, lambda p, n, t: write_gguf_solution(p, n, t, extra=bytes(32)), capsys)
    assert ok, out

    def two_entries(path, name, tensor):
        write_gguf_solution(path, name, tensor, entries=(("general.architecture", "llama"), ("general.name", "x")))

    ok, out = verdict(check_write_gguf, two_entries, capsys)
    assert not ok and "the file's metadata is" in out and "Write exactly one metadata entry" in out, out


def test_a_function_that_writes_no_file_is_told_so(capsys):
    ok, out = verdict(check_write_gguf, lambda path, name, tensor: None, capsys)
    assert not ok and "wrote no file at path" in out and "open(path, 'wb')" in out, out


def test_ggufs_writer_is_refused(capsys):
    def with_gguf(path, name, tensor):
        writer = gguf.GGUFWriter(path, "llama")
        writer.add_tensor(name, tensor.contiguous().numpy())
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()

    ok, out = verdict(check_write_gguf, with_gguf, capsys)
    assert not ok and "calls gguf.GGUFWriter" in out and "write the bytes yourself" in out, out


# --- threads, processes and copies of the package's code --------------------------------------------------------


def in_a_thread(x):
    out = []
    worker = threading.Thread(target=lambda: out.append(gguf_quants.quantize(x.numpy(), GGMLQuantizationType.Q8_0)))
    worker.start()
    worker.join()
    return torch.from_numpy(out[0].reshape(-1).copy())


def in_an_executor(x):
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return torch.from_numpy(pool.submit(gguf_quants.quantize, x.numpy(), GGMLQuantizationType.Q8_0).result()
                                .reshape(-1).copy())


def thread_caught(x):
    try:
        threading.Thread(target=print).start()
    except BaseException:  # noqa: BLE001 -- the answer tries to carry on
        pass
    return quantize_q8_0_solution(x)


def profile_off(x):
    sys.setprofile(None)
    return torch.from_numpy(gguf_quants.quantize(x.numpy(), GGMLQuantizationType.Q8_0).reshape(-1).copy())


roundf_elsewhere = types.FunctionType(gguf_quants.np_roundf.__code__.replace(co_filename="mine.py", co_name="mine"),
                                      gguf_quants.np_roundf.__globals__)


def with_gguf_roundf(x):
    """Q8_0 with gguf's roundf under another file and name (a copy of its code object)."""
    blocks = x.reshape(-1, 32).numpy()
    d = abs(blocks).max(axis=1, keepdims=True) / 127
    inverse = torch.where(torch.from_numpy(d) == 0, 0.0, 1 / torch.from_numpy(d)).numpy()
    q = roundf_elsewhere(blocks * inverse)
    return torch.cat([torch.from_numpy(d).half().view(torch.uint8),
                      torch.from_numpy(q).to(torch.int8).view(torch.uint8)], dim=1).reshape(-1)


def reads_gguf_source(x):
    inspect.getsource(gguf_quants)
    return quantize_q8_0_solution(x)


def test_with_gguf_roundf_would_be_right():
    x = _q8_0_cases()[1][1]
    assert torch.equal(with_gguf_roundf(x), quantize_q8_0_solution(x)), "so the refusal, not a wrong byte, stops it"


@pytest.mark.parametrize("answer, refused", [
    (in_a_thread, "starts a thread (threading.Thread.start)"),
    (in_an_executor, "starts a thread (concurrent.futures.ThreadPoolExecutor)"),
    (thread_caught, "starts a thread (threading.Thread.start)"),
    (profile_off, "switches off the checker's record of calls (sys.setprofile)"),
    (with_gguf_roundf, "calls gguf.quants.np_roundf"),
    (reads_gguf_source, "reads the source of gguf.quants"),
])
def test_q8_0_through_threads_copies_and_sources_is_refused(answer, refused, capsys):
    ok, out = verdict(check_quantize_q8_0, answer, capsys)
    assert not ok and refused in out, out


def test_a_thread_started_before_the_check_is_caught_by_the_tripwires(capsys):
    requests, answers = queue.Queue(), queue.Queue()

    def serve():
        while (x := requests.get()) is not None:
            try:
                answers.put(gguf_quants.quantize(x, GGMLQuantizationType.Q8_0))
            except BaseException as err:  # noqa: BLE001 -- the tripwire: handed back
                answers.put(err)

    server = threading.Thread(target=serve, daemon=True)
    server.start()

    def ask(x):
        requests.put(x.numpy())
        got = answers.get(timeout=5)
        if isinstance(got, BaseException):
            raise RuntimeError("refused")
        return torch.from_numpy(got.reshape(-1).copy())

    try:
        ok, out = verdict(check_quantize_q8_0, ask, capsys)
    finally:
        requests.put(None)
    assert not ok and "calls gguf.quants.quantize" in out, out


def in_a_subprocess(raw):
    script = ("import sys, numpy as np, gguf\n"
              "raw = np.frombuffer(sys.stdin.buffer.read(), np.uint8)\n"
              "out = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q6_K)\n"
              "sys.stdout.buffer.write(out.astype(np.float32).tobytes())")
    out = subprocess.run([sys.executable, "-c", script], input=raw.numpy().tobytes(), capture_output=True,
                         check=True).stdout
    return torch.frombuffer(bytearray(out), dtype=torch.float32)


@pytest.mark.parametrize("answer, refused", [
    (in_a_subprocess, "starts a process (subprocess.Popen)"),
    (lambda raw: os.system("true") and None or dequantize_q6_k_solution(raw), "starts a process (os.system)"),
    (lambda raw: os.kill(os.getpid(), 0) or dequantize_q6_k_solution(raw), "sends a signal (os.kill)"),
])
def test_q6_k_in_another_process_is_refused(answer, refused, capsys):
    ok, out = verdict(check_dequantize_q6_k, answer, capsys)
    assert not ok and refused in out and "refuses new threads and processes" in out, out
    assert torch.equal(dequantize_q6_k_solution(torch.zeros(210, dtype=torch.uint8)), torch.zeros(256)), "no harm"


def test_the_subprocess_answer_would_be_right():
    raw = torch.randint(0, 256, (210,), dtype=torch.uint8)
    raw[208:] = torch.tensor([0.5], dtype=torch.float16).view(torch.uint8)
    assert torch.equal(in_a_subprocess(raw), dequantize_q6_k_solution(raw))
