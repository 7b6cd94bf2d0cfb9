"""Tests for groundup.quantization: GGML's Q8_0 and Q4_1 blocks against the gguf package, byte for byte, and against
the error bounds the formats imply."""

import math
import struct

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gguf_quants

from groundup import quantization as Q


def _data(rows: int = 48, cols: int = 256, seed: int = 0) -> torch.Tensor:
    """Random rows at several scales, plus blocks that test the edges: all zero, constant, exact ties, one spike."""
    g = torch.Generator().manual_seed(seed)
    scales = torch.logspace(-6, 3, rows)[:, None]
    x = torch.randn(rows, cols, generator=g) * scales
    x[0, :32] = 0.0                                   # d = 0: every q is 0
    x[1, :32] = 0.75                                  # constant block
    x[2, :32] = torch.arange(-16, 16) + 0.5           # Q8_0 ties (d = 127 / 127 = 1): halves round away from zero
    x[2, 0] = 127.0
    x[3, :32] = torch.arange(32) % 15 + 0.5           # Q4_1 ties (m = 0, d = 15 / 15 = 1): (x - m) / d on halves
    x[3, 0], x[3, 1] = 0.0, 15.0
    x[4, :32] = 0.0
    x[4, 7] = -3.0                                    # one spike, the rest zero
    x[5, 32:64] = torch.randn(32, generator=g).abs() + 1  # all positive: Q4_1's m > 0
    return x


@pytest.mark.parametrize(("ours", "gguf_type"), [(Q.quantize_q8_0, GGMLQuantizationType.Q8_0),
                                                  (Q.quantize_q4_1, GGMLQuantizationType.Q4_1)])
def test_quantized_bytes_equal_the_gguf_package(ours, gguf_type):
    x = _data()
    expected = gguf_quants.quantize(x.numpy(), gguf_type).reshape(-1)
    got = ours(x)
    assert got.dtype == torch.uint8 and got.dim() == 1
    np.testing.assert_array_equal(got.numpy(), expected)


@pytest.mark.parametrize("name", ["F32", "F16", "Q4_1", "Q8_0"])
def test_type_numbers_and_block_layouts_are_ggmls(name):
    gguf_type = GGMLQuantizationType[name]
    assert getattr(Q, name) == int(gguf_type)
    assert Q.BLOCK_LAYOUT[int(gguf_type)] == GGML_QUANT_SIZES[gguf_type]


def _random_block_bytes(n_blocks: int, ggml_type: int, seed: int) -> np.ndarray:
    """Random bytes in the type's layout, with finite float16 scales (random bytes could be nan or inf)."""
    rng = np.random.default_rng(seed)
    _, block_bytes = Q.BLOCK_LAYOUT[ggml_type]
    raw = rng.integers(0, 256, size=(n_blocks, block_bytes), dtype=np.uint8)
    n_scales = 2 if ggml_type == Q.Q4_1 else 1
    scales = (rng.standard_normal((n_blocks, n_scales)) * 0.1).astype(np.float16)
    raw[:, :2 * n_scales] = scales.view(np.uint8)
    return raw.reshape(-1)


@pytest.mark.parametrize("ggml_type", [Q.Q8_0, Q.Q4_1])
def test_dequantize_equals_the_gguf_package_exactly(ggml_type):
    shape = (12, 96)
    raw = _random_block_bytes(12 * 96 // 32, ggml_type, seed=ggml_type)
    expected = gguf_quants.dequantize(raw.reshape(12, -1), GGMLQuantizationType(ggml_type))
    got = Q.dequantize(torch.from_numpy(raw), ggml_type, shape)
    assert got.dtype == torch.float32 and got.shape == shape
    np.testing.assert_array_equal(got.numpy(), expected)


@pytest.mark.parametrize(("ggml_type", "np_dtype"), [(Q.F32, np.float32), (Q.F16, np.float16)])
def test_plain_floats_dequantize_as_the_gguf_package_does(ggml_type, np_dtype):
    values = np.random.default_rng(1).standard_normal((3, 5)).astype(np_dtype)
    raw = values.reshape(-1).view(np.uint8)
    expected = gguf_quants.dequantize(raw.view(np_dtype), GGMLQuantizationType(ggml_type)).reshape(3, 5)
    got = Q.dequantize(torch.from_numpy(raw.copy()), ggml_type, (3, 5))
    np.testing.assert_array_equal(got.numpy(), expected)
    assert got.dtype == torch.float32
    back = Q.quantize(torch.from_numpy(values.astype(np.float32)), ggml_type)
    np.testing.assert_array_equal(back.numpy(), raw)


def test_one_q8_0_block_decoded_by_hand():
    q = list(range(-16, 16))
    raw = struct.pack("<e", 0.25) + struct.pack("<32b", *q)
    got = Q.dequantize(torch.tensor(list(raw), dtype=torch.uint8), Q.Q8_0, (32,))
    assert got.tolist() == [0.25 * v for v in q]


def test_one_q4_1_block_decoded_by_hand():
    # Byte j holds q[j] in its low four bits and q[j + 16] in its high four bits (llama.cpp's block_q4_1).
    q = [(3 * j) % 16 for j in range(32)]
    packed = [q[j] | (q[j + 16] << 4) for j in range(16)]
    raw = struct.pack("<ee", 0.5, -2.0) + bytes(packed)
    got = Q.dequantize(torch.tensor(list(raw), dtype=torch.uint8), Q.Q4_1, (1, 32))
    assert got.shape == (1, 32)
    assert got[0].tolist() == [0.5 * v - 2.0 for v in q]


def test_round_half_away_is_cs_roundf():
    values = torch.tensor([0.5, 1.5, 2.5, -0.5, -2.5, 0.49999997, -0.49999997, 126.5, 3.2, -3.7, 0.0])
    expected = [math.copysign(math.floor(abs(v) + 0.5), v) for v in values.double().tolist()]
    assert Q.round_half_away(values).tolist() == expected


def _fp16(values: torch.Tensor) -> torch.Tensor:
    return values.to(torch.float16).double()


def test_q8_0_error_is_at_most_half_a_step_plus_the_scales_rounding():
    # x = d q + e with |e| <= d/2, d = max|x|/127 exactly (float64 here); the file stores d16 = float16(d), so
    # |x - d16 q| <= d/2 + |d - d16| |q|, plus float32 rounding of x / d (a relative 2^-23, inside the slack).
    x = _data()
    blocks = x.double().reshape(-1, 32)
    d = blocks.abs().amax(dim=1, keepdim=True) / 127
    q = Q.quantize_q8_0(x).reshape(-1, 34)[:, 2:].contiguous().view(torch.int8).double()
    assert q.abs().max() <= 127
    error = (blocks - Q.round_trip(x, Q.Q8_0).double().reshape(-1, 32)).abs()
    bound = d / 2 * (1 + 2**-20) + (d - _fp16(d)).abs() * q.abs()
    assert (error <= bound).all()
    assert error.max() > 0.4 * (d / 2).max()  # the bound is nearly reached: it is the right one


def test_q4_1_error_is_at_most_half_a_step_plus_the_stored_numbers_rounding():
    # x = d q + m + e with |e| <= d/2, d = (max - min)/15, m = min; the file stores float16(d) and float16(m).
    x = _data()
    blocks = x.double().reshape(-1, 32)
    low, high = blocks.amin(dim=1, keepdim=True), blocks.amax(dim=1, keepdim=True)
    d = (high - low) / 15
    error = (blocks - Q.round_trip(x, Q.Q4_1).double().reshape(-1, 32)).abs()
    bound = d / 2 * (1 + 2**-20) + (d - _fp16(d)).abs() * 15 + (low - _fp16(low)).abs() + high.abs() * 2**-22
    assert (error <= bound).all()
    assert error.max() > 0.4 * (d / 2).max()


def test_blocks_follow_the_rows_of_a_matrix():
    x = _data(rows=6, cols=64)
    assert torch.equal(Q.quantize_q4_1(x), Q.quantize_q4_1(x.reshape(-1)))
    assert torch.equal(Q.round_trip(x, Q.Q8_0).reshape(-1), Q.round_trip(x.reshape(-1), Q.Q8_0))


def test_n_bytes_counts_blocks():
    assert Q.n_bytes((576, 1536), Q.Q4_1) == 576 * 1536 // 32 * 20
    assert Q.n_bytes((49152, 576), Q.Q8_0) == 49152 * 576 // 32 * 34
    assert Q.n_bytes((576,), Q.F32) == 576 * 4
    assert Q.n_bytes((2**40, 2**20), Q.Q8_0) == 2**60 // 32 * 34  # Python ints: no overflow


@pytest.mark.parametrize(("args", "error", "message"), [
    ((torch.zeros(33, dtype=torch.uint8), Q.Q8_0, (32,)), ValueError, "raw holds 33 bytes"),
    ((torch.zeros(33, dtype=torch.uint8), Q.Q8_0, (2**40, 32)), ValueError, "needs 37,383,395,344,384"),
    ((torch.zeros(20, dtype=torch.uint8), Q.Q4_1, (2, 16)), ValueError, "multiple of 32"),
    ((torch.zeros(20, dtype=torch.uint8), Q.Q4_1, (20,)), ValueError, "multiple of 32"),
    ((torch.zeros(20, dtype=torch.uint8), Q.Q4_1, (-32,)), ValueError, "non-negative"),
    ((torch.zeros(20, dtype=torch.uint8), Q.Q4_1, (True,)), ValueError, "non-negative"),
    ((torch.zeros(20, dtype=torch.uint8), Q.Q4_1, 32), TypeError, "shape must be a tuple"),
    ((torch.zeros(18, dtype=torch.uint8), 2, (32,)), ValueError, "ggml_type must be one of"),
    ((torch.zeros(34, dtype=torch.uint8), True, (32,)), ValueError, "ggml_type must be one of"),
    ((torch.zeros(34, dtype=torch.int8), Q.Q8_0, (32,)), ValueError, "dtype uint8"),
    ((torch.zeros(2, 34, dtype=torch.uint8), Q.Q8_0, (2, 32)), ValueError, "1-D"),
    ((bytes(34), Q.Q8_0, (32,)), TypeError, "raw must be a torch.Tensor"),
])
def test_hostile_arguments_are_refused_before_allocating(args, error, message):
    with pytest.raises(error, match=message):
        Q.dequantize(*args)


@pytest.mark.parametrize(("x", "error", "message"), [
    (torch.zeros(31), ValueError, "multiple of 32"),
    (torch.zeros(32, dtype=torch.int64), TypeError, "floating-point"),
    (torch.full((32,), float("nan")), ValueError, "finite"),
    (torch.full((32,), 1e7), ValueError, "float16"),
    ([0.0] * 32, TypeError, "torch.Tensor"),
])
@pytest.mark.parametrize("quantizer", [Q.quantize_q8_0, Q.quantize_q4_1])
def test_bad_inputs_to_the_quantizers_are_refused(quantizer, x, error, message):
    with pytest.raises(error, match=message):
        quantizer(x)
