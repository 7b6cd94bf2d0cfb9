"""Quantization by hand: GGML's block formats Q8_0 and Q4_1 (and plain F32/F16), as GGUF files store weights.

A quantized matrix is cut, row by row, into blocks of ``BLOCK_SIZE = 32`` consecutive numbers; each block keeps one or
two float16 numbers that set its scale and 32 small integers:

- **Q8_0** (34 bytes a block): a scale ``d = max|x| / 127`` and ``q = round(x / d)`` in [-127, 127], one signed byte
  each, so that ``x ≈ d q``.
- **Q4_1** (20 bytes a block): a step ``d = (max x - min x) / 15``, the minimum ``m = min x`` and
  ``q = round((x - m) / d)`` in [0, 15], four bits each, two to a byte, so that ``x ≈ d q + m``.

The bytes are laid out exactly as llama.cpp lays them out (its ``block_q8_0`` and ``block_q4_1``): the float16 numbers
first, little-endian, then the integers; in Q4_1, byte ``j`` of a block holds ``q[j]`` in its low four bits and
``q[j + 16]`` in its high four bits. The quantizers round as llama.cpp's reference quantizers do (Q8_0: half away from
zero, the division done as a multiplication by ``1 / d`` in float32; Q4_1: ``trunc(... + 0.5)``), so their bytes equal
the ``gguf`` package's, and dequantization computes ``d * q`` and ``d * q + m`` in float32 as it does (tests check
both). Everything is vectorised over blocks: a block is a row of a ``(n_blocks, 32)`` tensor.

Type numbers are GGML's (``gguf.GGMLQuantizationType``): F32 = 0, F16 = 1, Q4_1 = 3, Q8_0 = 8.
"""

import math
import numbers

import torch

BLOCK_SIZE = 32
F32, F16, Q4_1, Q8_0 = 0, 1, 3, 8
TYPE_NAMES = {F32: "F32", F16: "F16", Q4_1: "Q4_1", Q8_0: "Q8_0"}
# (numbers per block, bytes per block) for each type, as GGML's type traits give them.
BLOCK_LAYOUT = {F32: (1, 4), F16: (1, 2),
                Q4_1: (BLOCK_SIZE, 2 + 2 + BLOCK_SIZE // 2), Q8_0: (BLOCK_SIZE, 2 + BLOCK_SIZE)}
FLOAT16_MAX = 65504.0


# ---------------------------------------------------------------------------------------------------------------
# Checking the caller's arguments (before anything is allocated)
# ---------------------------------------------------------------------------------------------------------------

def _check_type(ggml_type) -> int:
    if isinstance(ggml_type, bool) or not isinstance(ggml_type, numbers.Integral) or int(ggml_type) not in BLOCK_LAYOUT:
        known = ", ".join(f"{name}={number}" for number, name in TYPE_NAMES.items())
        raise ValueError(f"ggml_type must be one of {known}, got {ggml_type!r}")
    return int(ggml_type)


def _check_shape(shape, ggml_type: int) -> tuple[int, ...]:
    """The shape as a tuple of Python ints; for block types its last (contiguous) size must be a multiple of 32."""
    if not isinstance(shape, (tuple, list, torch.Size)):
        raise TypeError(f"shape must be a tuple of non-negative integers, got {type(shape).__name__}")
    for size in shape:
        if isinstance(size, bool) or not isinstance(size, numbers.Integral) or size < 0:
            raise ValueError(f"shape must be a tuple of non-negative integers, got {tuple(shape)!r}")
    shape = tuple(int(size) for size in shape)
    per_block = BLOCK_LAYOUT[ggml_type][0]
    row = shape[-1] if shape else 1
    if row % per_block:
        raise ValueError(f"shape {shape} cannot hold {TYPE_NAMES[ggml_type]} blocks: its last size ({row}) must be a "
                         f"multiple of {per_block}, since a block of {per_block} numbers never spans two rows")
    return shape


def n_bytes(shape, ggml_type: int) -> int:
    """How many bytes a tensor of this shape takes in this format: blocks × bytes per block (Python ints, exact)."""
    ggml_type = _check_type(ggml_type)
    shape = _check_shape(shape, ggml_type)
    per_block, block_bytes = BLOCK_LAYOUT[ggml_type]
    return math.prod(shape) // per_block * block_bytes


def _check_raw(raw, ggml_type: int, shape: tuple[int, ...]) -> torch.Tensor:
    """The bytes as a contiguous ``(n_blocks, block_bytes)`` uint8 tensor, after checking their count."""
    if not isinstance(raw, torch.Tensor):
        raise TypeError(f"raw must be a torch.Tensor of bytes (dtype uint8), got {type(raw).__name__}")
    if raw.dtype != torch.uint8 or raw.dim() != 1:
        raise ValueError(f"raw must be a 1-D tensor of dtype uint8 (the bytes), got dtype {raw.dtype} with shape "
                         f"{tuple(raw.shape)}")
    expected = n_bytes(shape, ggml_type)
    if raw.numel() != expected:
        per_block, block_bytes = BLOCK_LAYOUT[ggml_type]
        raise ValueError(f"raw holds {raw.numel():,} bytes, but shape {shape} in {TYPE_NAMES[ggml_type]} needs "
                         f"{expected:,} ({math.prod(shape) // per_block:,} blocks of {block_bytes} bytes)")
    return raw.reshape(-1, BLOCK_LAYOUT[ggml_type][1])


def _check_floats(x, per_row: int = BLOCK_SIZE) -> torch.Tensor:
    """``x`` as float32 blocks ``(n_blocks, 32)``: a finite floating tensor whose last size is a multiple of 32."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"x must be a floating-point torch.Tensor, got {type(x).__name__}"
                        + (f" of dtype {x.dtype}" if isinstance(x, torch.Tensor) else ""))
    row = x.shape[-1] if x.dim() else 1
    if row % per_row:
        raise ValueError(f"x's last size must be a multiple of {per_row} (one block), got shape {tuple(x.shape)}")
    x = x.detach().to(torch.float32)
    if not torch.isfinite(x).all():
        raise ValueError("x must be finite: a block holding inf or nan has no float16 scale")
    return x.reshape(-1, per_row)


def _to_float16(value: torch.Tensor, what: str) -> torch.Tensor:
    if value.numel() and value.abs().max() > FLOAT16_MAX:
        raise ValueError(f"x is too large for this format: a block's {what} reaches {value.abs().max().item():.4g}, "
                         f"beyond float16's largest number {FLOAT16_MAX:g}")
    return value.to(torch.float16)


def _float16_bytes(value: torch.Tensor) -> torch.Tensor:
    """float16 numbers ``(n,)`` as their little-endian bytes ``(n, 2)``."""
    return value.contiguous().view(torch.uint8).reshape(-1, 2)


def _float16_from_bytes(pairs: torch.Tensor) -> torch.Tensor:
    """Bytes ``(n, 2)`` (little-endian) as float16 numbers ``(n,)`` widened to float32."""
    return pairs.contiguous().view(torch.float16).reshape(-1).to(torch.float32)


# ---------------------------------------------------------------------------------------------------------------
# Q8_0: x ≈ d q, d = max|x| / 127, q = round(x / d) in [-127, 127]
# ---------------------------------------------------------------------------------------------------------------

def round_half_away(x: torch.Tensor) -> torch.Tensor:
    """Round to the nearest integer, halves away from zero (C's ``roundf``; ``torch.round`` rounds halves to even).

    ``floor(a) + floor(2 (a - floor(a)))`` for ``a = |x|``: both steps are exact in floating point, unlike
    ``floor(a + 0.5)``, which rounds 0.49999997 up.
    """
    a = x.abs()
    whole = a.floor()
    return x.sign() * (whole + (2 * (a - whole)).floor())


def q8_0_encode_blocks(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks ``(n, 32)`` float32 -> the scale ``d`` (float16, ``(n,)``) and ``q`` (int8, ``(n, 32)``)."""
    d = blocks.abs().amax(dim=1) / 127
    inverse = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    q = round_half_away(blocks * inverse[:, None])
    return _to_float16(d, "scale d = max|x| / 127"), q.to(torch.int8)


def q8_0_decode_blocks(d: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``x = d q`` in float32, block by block: ``d`` ``(n,)``, ``q`` ``(n, 32)`` -> ``(n, 32)``."""
    x = q.to(torch.float32, copy=True)  # a new buffer even when q is already float32
    return x.mul_(d.to(torch.float32)[:, None])  # in place: one buffer for the whole tensor, not two


def quantize_q8_0(x: torch.Tensor) -> torch.Tensor:
    """``x`` (last size a multiple of 32) as Q8_0 bytes, 1-D uint8: per block 2 bytes of ``d``, then 32 of ``q``."""
    d, q = q8_0_encode_blocks(_check_floats(x))
    return torch.cat([_float16_bytes(d), q.view(torch.uint8)], dim=1).reshape(-1)


def dequantize_q8_0(raw: torch.Tensor, shape) -> torch.Tensor:
    """Q8_0 bytes -> a float32 tensor of ``shape`` (PyTorch order: the last size is the contiguous one)."""
    shape = _check_shape(shape, Q8_0)
    blocks = _check_raw(raw, Q8_0, shape)
    d = _float16_from_bytes(blocks[:, :2])
    q = blocks[:, 2:].contiguous().view(torch.int8)
    return q8_0_decode_blocks(d, q).reshape(shape)


# ---------------------------------------------------------------------------------------------------------------
# Q4_1: x ≈ d q + m, d = (max x - min x) / 15, m = min x, q = round((x - m) / d) in [0, 15]
# ---------------------------------------------------------------------------------------------------------------

def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """4-bit numbers ``(n, 32)`` -> bytes ``(n, 16)``: byte j = ``q[j]`` (low four bits) | ``q[j + 16]`` << 4."""
    half = q.shape[1] // 2
    return q[:, :half] | (q[:, half:] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Bytes ``(n, 16)`` -> 4-bit numbers ``(n, 32)``: the low halves of the bytes first, then the high halves."""
    q = torch.empty(packed.shape[0], 2, packed.shape[1], dtype=torch.uint8)
    torch.bitwise_and(packed, 0x0F, out=q[:, 0])
    torch.bitwise_right_shift(packed, 4, out=q[:, 1])
    return q.view(packed.shape[0], -1)


def q4_1_encode_blocks(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Blocks ``(n, 32)`` float32 -> step ``d`` and minimum ``m`` (float16, ``(n,)``) and ``q`` (uint8 0..15)."""
    low = blocks.amin(dim=1)
    d = (blocks.amax(dim=1) - low) / 15
    inverse = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    q = torch.trunc((blocks - low[:, None]) * inverse[:, None] + 0.5).clamp(0, 15)
    return _to_float16(d, "step d = (max - min) / 15"), _to_float16(low, "minimum m"), q.to(torch.uint8)


def q4_1_decode_blocks(d: torch.Tensor, m: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``x = d q + m`` in float32, block by block: ``d``, ``m`` ``(n,)``, ``q`` ``(n, 32)`` -> ``(n, 32)``."""
    x = q.to(torch.float32, copy=True)  # a new buffer even when q is already float32
    # In place, one buffer for the whole tensor; two roundings (d q, then + m), exactly as llama.cpp and gguf.
    return x.mul_(d.to(torch.float32)[:, None]).add_(m.to(torch.float32)[:, None])


def quantize_q4_1(x: torch.Tensor) -> torch.Tensor:
    """``x`` (last size a multiple of 32) as Q4_1 bytes, 1-D uint8: per block ``d``, ``m`` (2 bytes each), 16 of q."""
    d, m, q = q4_1_encode_blocks(_check_floats(x))
    return torch.cat([_float16_bytes(d), _float16_bytes(m), pack_nibbles(q)], dim=1).reshape(-1)


def dequantize_q4_1(raw: torch.Tensor, shape) -> torch.Tensor:
    """Q4_1 bytes -> a float32 tensor of ``shape`` (PyTorch order: the last size is the contiguous one)."""
    shape = _check_shape(shape, Q4_1)
    blocks = _check_raw(raw, Q4_1, shape)
    d, m = _float16_from_bytes(blocks[:, :4]).view(-1, 2).unbind(dim=1)
    return q4_1_decode_blocks(d, m, unpack_nibbles(blocks[:, 4:])).reshape(shape)


# ---------------------------------------------------------------------------------------------------------------
# Any of the four types
# ---------------------------------------------------------------------------------------------------------------

def dequantize(raw: torch.Tensor, ggml_type: int, shape) -> torch.Tensor:
    """A GGUF tensor's bytes (1-D uint8) -> float32 of ``shape``, for F32, F16, Q4_1 and Q8_0.

    ``shape`` is in PyTorch order, the contiguous size last (GGUF's tensor table lists the sizes the other way
    round: ``ne[0]`` first). The byte count is checked against the shape before anything is allocated.
    """
    ggml_type = _check_type(ggml_type)
    shape = _check_shape(shape, ggml_type)
    if ggml_type == Q8_0:
        return dequantize_q8_0(raw, shape)
    if ggml_type == Q4_1:
        return dequantize_q4_1(raw, shape)
    blocks = _check_raw(raw, ggml_type, shape)
    dtype = torch.float32 if ggml_type == F32 else torch.float16
    return blocks.contiguous().view(dtype).reshape(shape).to(torch.float32)


def quantize(x: torch.Tensor, ggml_type: int) -> torch.Tensor:
    """``x`` in one of the four formats, as 1-D uint8 bytes (F32 and F16: the numbers' little-endian bytes)."""
    ggml_type = _check_type(ggml_type)
    if ggml_type == Q8_0:
        return quantize_q8_0(x)
    if ggml_type == Q4_1:
        return quantize_q4_1(x)
    x = _check_floats(x, per_row=1)
    dtype = torch.float32 if ggml_type == F32 else torch.float16
    if dtype == torch.float16:
        x = _to_float16(x, "value")
    return x.to(dtype).contiguous().view(torch.uint8).reshape(-1)


def round_trip(x: torch.Tensor, ggml_type: int) -> torch.Tensor:
    """``dequantize(quantize(x))``: what a weight becomes once stored in the format, same shape, float32."""
    return dequantize(quantize(x, ggml_type), ggml_type, tuple(x.shape))
