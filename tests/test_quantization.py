"""Tests for groundup.quantization: GGML's Q8_0 and Q4_1 blocks against the gguf package, byte for byte, and against
the error bounds the formats imply."""

import math
import os
import struct
import subprocess
import sys

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


@pytest.mark.parametrize("name", ["Q8_0", "Q4_1", "Q4_0", "Q5_0", "Q5_1", "BF16"])
def test_quantized_bytes_equal_the_gguf_package(name):
    x = _data()
    expected = gguf_quants.quantize(x.numpy(), GGMLQuantizationType[name]).reshape(-1)
    got = Q.quantize(x, getattr(Q, name))
    assert got.dtype == torch.uint8 and got.dim() == 1
    np.testing.assert_array_equal(got.numpy(), expected)


TYPES = ["F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]
BLOCK_TYPES = [name for name in TYPES if name.startswith("Q")]


@pytest.mark.parametrize("name", TYPES)
def test_type_numbers_and_block_layouts_are_ggmls(name):
    gguf_type = GGMLQuantizationType[name]
    assert getattr(Q, name, None) == int(gguf_type) or getattr(Q.kquants, name) == int(gguf_type)
    assert Q.BLOCK_LAYOUT[int(gguf_type)] == GGML_QUANT_SIZES[gguf_type]
    assert Q.TYPE_NAMES[int(gguf_type)] == name and Q.TYPE_NUMBERS[name] == int(gguf_type)


# Where each block type keeps its float16 numbers (byte offsets): random bytes there could be NaN or infinite.
FLOAT16_AT = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
              "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def _random_block_bytes(n_blocks: int, ggml_type: int, seed: int) -> np.ndarray:
    """Random bytes in the type's layout, with finite float16 scales (random bytes could be nan or inf)."""
    rng = np.random.default_rng(seed)
    _, block_bytes = Q.BLOCK_LAYOUT[ggml_type]
    raw = rng.integers(0, 256, size=(n_blocks, block_bytes), dtype=np.uint8)
    for at in FLOAT16_AT[Q.TYPE_NAMES[ggml_type]]:
        raw[:, at:at + 2] = (rng.standard_normal((n_blocks, 1)) * 0.1).astype(np.float16).view(np.uint8)
    return raw.reshape(-1)


@pytest.mark.parametrize("name", BLOCK_TYPES)
def test_dequantize_equals_the_gguf_package_exactly(name):
    ggml_type = int(GGMLQuantizationType[name])
    per_block = Q.BLOCK_LAYOUT[ggml_type][0]
    shape = (12, 3 * per_block)
    raw = _random_block_bytes(12 * 3, ggml_type, seed=ggml_type)
    expected = gguf_quants.dequantize(raw.reshape(12, -1), GGMLQuantizationType(ggml_type))
    got = Q.dequantize(torch.from_numpy(raw), ggml_type, shape)
    assert got.dtype == torch.float32 and got.shape == shape
    np.testing.assert_array_equal(got.numpy(), expected)


def _random_bytes_of(name: str, n_weights: int, seed: int) -> np.ndarray:
    """Random finite data of type ``name`` as its bytes, 1-D uint8."""
    ggml_type = Q.TYPE_NUMBERS[name]
    if ggml_type in Q.BLOCK_TYPES:
        return _random_block_bytes(n_weights // Q.BLOCK_LAYOUT[ggml_type][0], ggml_type, seed)
    values = np.random.default_rng(seed).standard_normal(n_weights).astype(np.float32)
    if name == "F16":
        return values.astype(np.float16).view(np.uint8)
    return values.view(np.uint8) if name == "F32" else values.view(np.uint16)[1::2].copy().view(np.uint8)  # BF16


def _gguf_dequantized(raw: np.ndarray, name: str) -> np.ndarray:
    plain = {"F32": np.float32, "F16": np.float16}
    return gguf_quants.dequantize(raw.view(plain[name]) if name in plain else raw, GGMLQuantizationType[name])


@pytest.mark.parametrize("name", TYPES)
def test_dequantize_slice_by_slice_and_into_out_equals_the_gguf_package(name, monkeypatch):
    # dequantize decodes DECODE_SLICE weights at a time; five blocks a slice cut these 36 blocks into 8 slices, the
    # last one short. Every block decodes on its own, so the result is gguf's bit for bit, new or written into out.
    ggml_type = Q.TYPE_NUMBERS[name]
    per_block = Q.BLOCK_LAYOUT[ggml_type][0]
    monkeypatch.setattr(Q, "DECODE_SLICE", 5 * per_block)
    shape = (12, 3 * per_block)
    raw = _random_bytes_of(name, 36 * per_block, seed=ggml_type)
    expected = _gguf_dequantized(raw, name).reshape(shape)
    got = Q.dequantize(torch.from_numpy(raw), ggml_type, shape)
    np.testing.assert_array_equal(got.numpy(), expected)
    out = torch.full(shape, float("nan"))
    assert Q.dequantize(torch.from_numpy(raw), ggml_type, shape, out=out) is out
    np.testing.assert_array_equal(out.numpy(), expected)


def test_dequantize_returns_a_new_tensor_even_for_f32():
    raw = torch.from_numpy(np.arange(64, dtype=np.float32).view(np.uint8).copy())
    got = Q.dequantize(raw, Q.F32, (2, 32))
    raw.zero_()  # the bytes change (a mapped file's copy-on-write pages, say): the result does not
    assert got.reshape(-1).tolist() == list(range(64))


@pytest.mark.parametrize(("out", "error", "message"), [
    ([0.0] * 64, TypeError, "out must be a torch.Tensor"),
    (torch.zeros(2, 32, dtype=torch.float64), ValueError, "float32 tensor of shape \\(2, 32\\), got torch.float64"),
    (torch.zeros(64), ValueError, "of shape \\(2, 32\\), got torch.float32 tensor of shape \\(64,\\)"),
    (torch.zeros(32, 2).t(), ValueError, "got a non-contiguous torch.float32"),
])
def test_out_must_be_a_contiguous_float32_tensor_of_the_shape(out, error, message):
    with pytest.raises(error, match=message):
        Q.dequantize(torch.zeros(68, dtype=torch.uint8), Q.Q8_0, (2, 32), out=out)


def test_nan_values_are_counted_across_slices(monkeypatch):
    monkeypatch.setattr(Q, "DECODE_SLICE", 32)  # one block a slice
    raw = np.zeros((4, 34), dtype=np.uint8)
    raw[[0, 3], :2] = np.array([np.nan], dtype=np.float16).view(np.uint8)  # NaN scales in the first and last block
    raw[:, 2:] = 1
    with pytest.raises(ValueError, match="Q8_0 data of shape \\(4, 32\\) decodes to 64 NaN or infinite"):
        Q.dequantize(torch.from_numpy(raw.reshape(-1)), Q.Q8_0, (4, 32))


_MEMORY_SCRIPT = """
import sys
import torch
from groundup import quantization as Q

def peak_kib():  # the most this process has held resident (not ru_maxrss: it starts at the parent's size)
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))

torch.set_num_threads(1)
ggml_type, shape = Q.TYPE_NUMBERS[sys.argv[1]], (2048, 4096)  # a 32 MiB float32 matrix
Q.dequantize(torch.zeros(Q.n_bytes((8, 4096), ggml_type), dtype=torch.uint8), ggml_type, (8, 4096))  # warm up
raw = torch.zeros(Q.n_bytes(shape, ggml_type), dtype=torch.uint8)
parameter = torch.ones(shape)
before = peak_kib()
Q.dequantize(raw, ggml_type, shape, out=parameter)
sliced = peak_kib() - before
before = peak_kib()
parameter.copy_(Q.dequantize(raw, ggml_type, shape))  # the whole tensor decoded, then copied: the method sees it
print(sliced / 1024, (peak_kib() - before) / 1024)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
@pytest.mark.parametrize("name", ["Q4_1", "Q6_K"])
def test_decoding_into_a_parameter_adds_a_slice_not_a_tensor(name):
    # Peak resident memory (VmHWM) in a fresh process: torch's allocations are invisible to tracemalloc. Measured:
    # decoding a 32 MiB matrix into its parameter adds 3.6-5.9 MiB; decoding it into a new tensor to copy in adds
    # 30-32 MiB more (decoded whole, with all its temporaries alive at once, it took 120-128 MiB).
    result = subprocess.run([sys.executable, "-c", _MEMORY_SCRIPT, name], capture_output=True, text=True, check=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    sliced, whole = map(float, result.stdout.split())
    assert whole >= 24, whole  # the measurement sees a 32 MiB tensor
    assert sliced < 12, sliced


def test_bfloat16_refuses_values_beyond_its_range():
    # As F16 refuses finite values beyond float16's largest number, BF16 refuses those beyond bfloat16's
    # ((2 - 2^-7) 2^127): rounded, they would be stored as infinities.
    largest = torch.finfo(torch.bfloat16).max
    assert Q.BFLOAT16_MAX == largest
    ok = torch.tensor([largest, -largest, 1.0])
    assert torch.equal(Q.round_trip(ok, Q.BF16), ok)
    for value in (3.4e38, -3.39e38, torch.finfo(torch.float32).max):
        with pytest.raises(ValueError, match=r"too large for BF16: a value reaches 3\.\d+e\+38, beyond bfloat16's "
                                             r"largest number 3\.3895e\+38"):
            Q.quantize(torch.tensor([1.0, value, 0.0]), Q.BF16)
    with pytest.raises(ValueError, match="beyond float16's largest number 65504"):
        Q.quantize(torch.tensor([1.0, 7e4]), Q.F16)


def test_bfloat16_dequantizes_as_the_gguf_package_does():
    values = torch.randn(4, 8, generator=torch.Generator().manual_seed(3)).bfloat16()
    raw = values.reshape(-1).view(torch.uint8)
    expected = gguf_quants.dequantize(raw.numpy(), GGMLQuantizationType.BF16).reshape(4, 8)
    got = Q.dequantize(raw, Q.BF16, (4, 8))
    np.testing.assert_array_equal(got.numpy(), expected)
    assert torch.equal(got, values.float())


def _q4_k_scale_bytes(scales: list[int], mins: list[int]) -> bytes:
    """Eight 6-bit scales and minimums packed as Q4_K packs them, written out from the rule (not from the package)."""
    out = [0] * 12
    for j in range(4):
        out[j] = scales[j] | (scales[j + 4] >> 4) << 6
        out[j + 4] = mins[j] | (mins[j + 4] >> 4) << 6
        out[j + 8] = (scales[j + 4] & 0x0F) | (mins[j + 4] & 0x0F) << 4
    return bytes(out)


def test_one_q4_k_super_block_decoded_by_hand():
    # x = d s_j q - dmin m_j for sub-block j = weight // 32; 32 bytes of nibbles serve two sub-blocks: the low nibbles
    # the first, the high nibbles the second (llama.cpp's block_q4_K). Scales 4-7 above 15 test the packed top bits.
    scales, mins = [1, 2, 3, 4, 17, 33, 50, 63], [0, 5, 9, 63, 16, 31, 48, 62]
    q = [(7 * i + i // 32) % 16 for i in range(256)]
    nibbles = [q[64 * c + i] | q[64 * c + 32 + i] << 4 for c in range(4) for i in range(32)]
    raw = struct.pack("<ee", 0.5, 0.25) + _q4_k_scale_bytes(scales, mins) + bytes(nibbles)
    got = Q.dequantize(torch.tensor(list(raw), dtype=torch.uint8), Q.kquants.Q4_K, (256,))
    assert got.tolist() == [0.5 * scales[i // 32] * q[i] - 0.25 * mins[i // 32] for i in range(256)]


def test_one_q6_k_super_block_decoded_by_hand():
    # q = 6 bits - 32: low nibbles in ql (weights 0-63 of each half in the low halves of 64 bytes, 64-127 in the high
    # halves), top two bits in qh (bits 2k, 2k + 1 of byte i for weight 32 k + i of each half); 16 signed scales.
    q = [(5 * i + 3) % 64 for i in range(256)]
    ql = [q[128 * h + i] & 15 | (q[128 * h + 64 + i] & 15) << 4 for h in range(2) for i in range(64)]
    qh = [sum((q[128 * h + 32 * k + i] >> 4) << 2 * k for k in range(4)) for h in range(2) for i in range(32)]
    scales = [(-1) ** j * (j + 1) for j in range(16)]
    raw = bytes(ql) + bytes(qh) + struct.pack("<16b", *scales) + struct.pack("<e", 0.125)
    got = Q.dequantize(torch.tensor(list(raw), dtype=torch.uint8), Q.kquants.Q6_K, (256,))
    assert got.tolist() == [0.125 * scales[i // 16] * (q[i] - 32) for i in range(256)]


@pytest.mark.parametrize("name", ["Q8_0", "Q4_K", "F16"])
def test_a_nan_scale_or_value_is_refused(name):
    ggml_type = int(GGMLQuantizationType[name])
    raw = np.zeros(Q.BLOCK_LAYOUT[ggml_type][1] * (1 if name != "F16" else 32), dtype=np.uint8)
    raw[:2] = np.array([np.nan], dtype=np.float16).view(np.uint8)
    with pytest.raises(ValueError, match="decodes to 1.* NaN or infinite" if name == "F16" else "NaN or infinite"):
        Q.dequantize(torch.from_numpy(raw), ggml_type, (Q.BLOCK_LAYOUT[ggml_type][0] * (32 if name == "F16" else 1),))


K_TYPES = {"Q2_K": (16, 2, False), "Q3_K": (16, 3, True), "Q4_K": (32, 4, False), "Q5_K": (32, 5, False),
           "Q6_K": (16, 6, True)}  # sub-block size, bits of q, signed q


@pytest.mark.parametrize("name", K_TYPES)
def test_k_quant_encoder_writes_valid_blocks_with_the_error_of_its_step(name):
    # The encoder is a min-max rule, so its error must be that of a uniform quantizer whose step is each sub-block's
    # range over its levels: RMS step / sqrt(12), computed here from the data (the scales' own 6-bit rounding moves
    # it a few per cent). gguf.quants decodes its bytes as ours do.
    ggml_type = int(GGMLQuantizationType[name])
    x = torch.randn(256, 512, generator=torch.Generator().manual_seed(ggml_type))
    raw = Q.quantize(x, ggml_type)
    assert raw.numel() == Q.n_bytes((256, 512), ggml_type)
    got = Q.dequantize(raw, ggml_type, (256, 512))
    np.testing.assert_array_equal(got.numpy(), gguf_quants.dequantize(raw.numpy().reshape(256, -1),
                                                                      GGMLQuantizationType[name]))
    sub, bits, signed = K_TYPES[name]
    xs = x.reshape(-1, sub)
    step = (xs.abs().amax(1) / 2 ** (bits - 1) if signed
            else (xs.amax(1) - xs.amin(1).clamp(max=0)) / (2**bits - 1))
    ratio = ((got - x).pow(2).mean() / (step.pow(2).mean() / 12)).sqrt().item()
    assert 0.85 < ratio < 1.1, ratio


def test_k_quant_edge_blocks_decode_exactly():
    # An all-zero super-block, and one whose sub-blocks are zero but one: no division by a zero step.
    x = torch.zeros(2, 256)
    x[1, 40] = -2.0
    for name, (sub, _, _) in K_TYPES.items():
        got = Q.round_trip(x, int(GGMLQuantizationType[name]))
        assert torch.equal(got[0], x[0]) and torch.isfinite(got).all(), name
        spiked = slice(40 // sub * sub, 40 // sub * sub + sub)       # the spike's sub-block; the others stay 0
        assert got[1, :spiked.start].abs().max() == 0 and got[1, spiked.stop:].abs().max() == 0, name
        assert abs(got[1, 40].item() + 2.0) < 2e-3 and (got[1, spiked] - x[1, spiked]).abs().max() < 0.01, name


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
    ((torch.zeros(18, dtype=torch.uint8), 15, (32,)), ValueError, "ggml_type must be one of"),
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
@pytest.mark.parametrize("quantizer", [Q.quantize_q8_0, Q.quantize_q4_1, Q.quantize_q4_0, Q.quantize_q5_0,
                                       Q.quantize_q5_1])
def test_bad_inputs_to_the_quantizers_are_refused(quantizer, x, error, message):
    with pytest.raises(error, match=message):
        quantizer(x)
