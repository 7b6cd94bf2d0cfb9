"""Quantization by hand: GGML's block formats, as GGUF files store weights.

A quantized matrix is cut, row by row, into blocks of ``BLOCK_SIZE = 32`` consecutive numbers; each block keeps one or
two float16 numbers that set its scale and 32 small integers:

- **Q8_0** (34 bytes a block): a scale ``d = max|x| / 127`` and ``q = round(x / d)`` in [-127, 127], one signed byte
  each, so that ``x ≈ d q``.
- **Q4_1** (20 bytes a block): a step ``d = (max x - min x) / 15``, the minimum ``m = min x`` and
  ``q = round((x - m) / d)`` in [0, 15], four bits each, two to a byte, so that ``x ≈ d q + m``.
- **Q4_0** (18 bytes) and **Q5_0** (22 bytes): no minimum; ``d = x_max / -8`` (``/ -16``), where ``x_max`` is the
  entry of largest magnitude with its sign, and ``x ≈ d (q - 8)`` (``d (q - 16)``) with q of 4 (5) bits.
- **Q5_1** (24 bytes): Q4_1 with 5-bit q (``d = (max - min) / 31``).

In the 5-bit types the fifth bits of the 32 q come first, as one little-endian 32-bit word (bit i for ``q[i]``),
then the low four bits as in Q4_1. The k-quants (Q2_K ... Q6_K: super-blocks of 256 weights with quantized scales)
are decoded and encoded in :mod:`groundup.kquants`; F32, F16 and BF16 are plain numbers (BF16: the top 16 bits of
a float32).

The bytes are laid out exactly as llama.cpp lays them out (its ``block_q8_0``, ``block_q4_1`` ...): the float16 numbers
first, little-endian, then the integers; in Q4_1, byte ``j`` of a block holds ``q[j]`` in its low four bits and
``q[j + 16]`` in its high four bits. The quantizers round as llama.cpp's reference quantizers do (Q8_0: half away from
zero, the division done as a multiplication by ``1 / d`` in float32; the others: ``trunc(... + 0.5)``), so their bytes
equal the ``gguf`` package's, and dequantization computes ``d * q`` and ``d * q + m`` in float32 as it does (tests check
both). Everything is vectorised over blocks: a block is a row of a ``(n_blocks, 32)`` tensor.

Type numbers are GGML's (``gguf.GGMLQuantizationType``): F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7,
Q8_0 = 8, Q2_K ... Q6_K = 10 ... 14, BF16 = 30. A tensor that decodes to a NaN or an infinity (a NaN float16 scale,
say) is refused: no weight of a model is either.
"""

import math
import numbers

import torch

from groundup import kquants

BLOCK_SIZE = 32
F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, BF16 = 0, 1, 2, 3, 6, 7, 8, 30
TYPE_NAMES = {F32: "F32", F16: "F16", BF16: "BF16", Q4_0: "Q4_0", Q4_1: "Q4_1", Q5_0: "Q5_0", Q5_1: "Q5_1",
              Q8_0: "Q8_0", **kquants.TYPE_NAMES}
#: The type numbers by name ("Q4_K" -> 12).
TYPE_NUMBERS = {name: number for number, name in TYPE_NAMES.items()}
# (numbers per block, bytes per block) for each type, as GGML's type traits give them.
BLOCK_LAYOUT = {F32: (1, 4), F16: (1, 2), BF16: (1, 2),
                Q4_0: (BLOCK_SIZE, 2 + BLOCK_SIZE // 2), Q4_1: (BLOCK_SIZE, 2 + 2 + BLOCK_SIZE // 2),
                Q5_0: (BLOCK_SIZE, 2 + 4 + BLOCK_SIZE // 2), Q5_1: (BLOCK_SIZE, 2 + 2 + 4 + BLOCK_SIZE // 2),
                Q8_0: (BLOCK_SIZE, 2 + BLOCK_SIZE),
                **{t: (kquants.QK_K, size) for t, size in kquants.BLOCK_BYTES.items()}}
FLOAT16_MAX = 65504.0
BFLOAT16_MAX = torch.finfo(torch.bfloat16).max  # (2 - 2^-7) 2^127 = 3.3895e38


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
# Q4_0 and Q5_0: x ≈ d (q - 8) and d (q - 16), d = x_max / -8 (/ -16); Q5_1: x ≈ d q + m with 5-bit q
# ---------------------------------------------------------------------------------------------------------------

def _signed_max(blocks: torch.Tensor) -> torch.Tensor:
    """Each block's entry of largest magnitude, with its sign (the first such entry on a tie), ``(n,)``."""
    return blocks.gather(1, blocks.abs().argmax(dim=1, keepdim=True)).squeeze(1)


def _symmetric_encode(blocks: torch.Tensor, half: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_0 (``half`` 8) and Q5_0 (16): ``d = x_max / -half`` (float16) and ``q = trunc(x / d + half + 0.5)``.

    Dividing by the *signed* largest entry makes that entry exactly ``q = 0``, i.e. ``-half * d``; the opposite end
    reaches ``2 half - 1`` at most, so no level is wasted on a sign the block never uses in full."""
    d = _signed_max(blocks) / -half
    inverse = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    q = torch.trunc(blocks * inverse[:, None] + (half + 0.5)).clamp(0, 2 * half - 1)
    return _to_float16(d, f"scale d = x_max / -{half}"), q.to(torch.uint8)


def _fifth_bits(q: torch.Tensor) -> torch.Tensor:
    """5-bit numbers ``(n, 32)`` -> their top bits as one little-endian 32-bit word per block, bytes ``(n, 4)``."""
    weights = 1 << torch.arange(8, dtype=torch.int32)
    top = (q >> 4).to(torch.int32).view(-1, 4, 8)
    return (top * weights).sum(dim=2).to(torch.uint8)


def _with_fifth_bits(qh: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """Bytes of fifth bits ``(n, 4)`` and of nibbles ``(n, 16)`` -> 5-bit numbers ``(n, 32)`` (uint8)."""
    shifts = torch.arange(8, dtype=torch.uint8)
    top = ((qh[:, :, None] >> shifts) & 1).reshape(-1, 32)
    return unpack_nibbles(packed) | (top << 4)


def quantize_q4_0(x: torch.Tensor) -> torch.Tensor:
    """``x`` (last size a multiple of 32) as Q4_0 bytes: per block 2 bytes of ``d``, 16 of nibbles."""
    d, q = _symmetric_encode(_check_floats(x), 8)
    return torch.cat([_float16_bytes(d), pack_nibbles(q)], dim=1).reshape(-1)


def quantize_q5_0(x: torch.Tensor) -> torch.Tensor:
    """``x`` as Q5_0 bytes: per block 2 bytes of ``d``, 4 of fifth bits, 16 of low nibbles."""
    d, q = _symmetric_encode(_check_floats(x), 16)
    return torch.cat([_float16_bytes(d), _fifth_bits(q), pack_nibbles(q & 0x0F)], dim=1).reshape(-1)


def quantize_q5_1(x: torch.Tensor) -> torch.Tensor:
    """``x`` as Q5_1 bytes: per block ``d``, ``m`` (2 bytes each), 4 of fifth bits, 16 of low nibbles."""
    blocks = _check_floats(x)
    low = blocks.amin(dim=1)
    d = (blocks.amax(dim=1) - low) / 31
    inverse = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    q = torch.trunc((blocks - low[:, None]) * inverse[:, None] + 0.5).clamp(0, 31).to(torch.uint8)
    d, m = _to_float16(d, "step d = (max - min) / 31"), _to_float16(low, "minimum m")
    return torch.cat([_float16_bytes(d), _float16_bytes(m), _fifth_bits(q), pack_nibbles(q & 0x0F)],
                     dim=1).reshape(-1)


def _bfloat16_bytes(x: torch.Tensor) -> torch.Tensor:
    """float32 -> bfloat16's bytes, rounding to nearest even as GGML does (``ggml_compute_fp32_to_bf16``).

    A finite value beyond bfloat16's largest number is refused, as F16 refuses one beyond float16's: rounded, it
    would be stored as an infinity, which no weight is (and :func:`dequantize` refuses)."""
    if x.numel() and x.abs().max() > BFLOAT16_MAX:
        raise ValueError(f"x is too large for BF16: a value reaches {x.abs().max().item():.5g}, beyond bfloat16's "
                         f"largest number {BFLOAT16_MAX:.5g}")
    return x.to(torch.bfloat16).contiguous().view(torch.uint8).reshape(-1)


# ---------------------------------------------------------------------------------------------------------------
# Any of the types
# ---------------------------------------------------------------------------------------------------------------

_QUANTIZERS = {Q4_0: quantize_q4_0, Q4_1: quantize_q4_1, Q5_0: quantize_q5_0, Q5_1: quantize_q5_1,
               Q8_0: quantize_q8_0}
_PLAIN = {F32: torch.float32, F16: torch.float16, BF16: torch.bfloat16}
#: The types stored in blocks of small integers with their scales (every type but the plain F32, F16 and BF16).
BLOCK_TYPES = tuple(t for t in TYPE_NAMES if t not in _PLAIN)


def _legacy_parts(blocks: torch.Tensor, ggml_type: int):
    """32-weight blocks ``(n, block_bytes)`` -> ``(q, step, offset, 32)``: q int8 ``(n, 32)``, the step ``d`` and the
    offset ``m`` (Q4_1, Q5_1; else None) as float32 ``(n, 1)``, so that ``x = q * step + offset``."""
    if ggml_type == Q8_0:
        q = blocks[:, 2:].contiguous().view(torch.int8)
    elif ggml_type == Q4_0:
        q = unpack_nibbles(blocks[:, 2:]).to(torch.int8) - 8
    elif ggml_type == Q5_0:
        q = _with_fifth_bits(blocks[:, 2:6], blocks[:, 6:]).to(torch.int8) - 16
    elif ggml_type == Q4_1:
        q = unpack_nibbles(blocks[:, 4:]).to(torch.int8)
    else:  # Q5_1
        q = _with_fifth_bits(blocks[:, 4:8], blocks[:, 8:]).to(torch.int8)
    if ggml_type in (Q4_1, Q5_1):
        step, offset = _float16_from_bytes(blocks[:, :4]).view(-1, 2, 1).unbind(dim=1)
        return q, step, offset, BLOCK_SIZE
    return q, _float16_from_bytes(blocks[:, :2]).view(-1, 1), None, BLOCK_SIZE


def _parts(blocks: torch.Tensor, ggml_type: int):
    """Blocks of any of :data:`BLOCK_TYPES` -> ``(q, step, offset, group)`` (see :func:`block_parts`)."""
    return kquants.parts(blocks, ggml_type) if ggml_type in kquants.BLOCK_BYTES else _legacy_parts(blocks, ggml_type)


def dequantize_parts(q: torch.Tensor, step: torch.Tensor, offset: torch.Tensor | None, group: int) -> torch.Tensor:
    """``q * step + offset``, group by group, in float32 (two roundings, as llama.cpp and gguf), in ``q``'s shape:
    the weights of :func:`block_parts`' numbers (or of any rows of them)."""
    x = q.view(*q.shape[:-1], -1, group).to(torch.float32, copy=True).mul_(step.unsqueeze(-1))
    if offset is not None:
        x.add_(offset.unsqueeze(-1))
    return x.view(q.shape)


def block_parts(raw: torch.Tensor, ggml_type: int, shape) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None,
                                                                      int]:
    """A block-quantized 2-D tensor's bytes -> ``(q, step, offset, group)`` in its shape ``(rows, cols)``: ``q`` int8
    ``(rows, cols)``; ``step`` and ``offset`` float32 ``(rows, cols / group)`` (``offset`` None for the types without
    a minimum); ``group`` 16 or 32. ``q * step + offset`` is :func:`dequantize`'s result bit for bit. A NaN or
    infinite step or offset is refused (ValueError). What :class:`groundup.quantized_linear.QuantizedLinear` keeps."""
    ggml_type = _check_type(ggml_type)
    shape = _check_shape(shape, ggml_type)
    if len(shape) != 2 or ggml_type not in BLOCK_TYPES:
        raise ValueError(f"block_parts takes a 2-D block-quantized tensor, got {TYPE_NAMES[ggml_type]} of shape "
                         f"{shape}")
    q, step, offset, group = _parts(_check_raw(raw, ggml_type, shape), ggml_type)
    for name, value in (("step", step), ("offset", offset)):
        if value is not None and not bool(torch.isfinite(value).all()):
            raise ValueError(f"{TYPE_NAMES[ggml_type]} data of shape {shape} holds a NaN or infinite {name} (a NaN "
                             f"or infinite float16 scale in the bytes)")
    rows, cols = shape
    return (q.reshape(rows, cols).contiguous(), step.reshape(rows, -1).contiguous(),
            None if offset is None else offset.reshape(rows, -1).contiguous(), group)


#: How many weights :func:`dequantize` decodes at a time (rounded down to whole blocks): its temporaries (the small
#: integers, their float32 products, the finiteness check) are those of one such slice, whatever the tensor's size.
DECODE_SLICE = 2**18


def _check_out(out, shape: tuple[int, ...]) -> torch.Tensor:
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a torch.Tensor (float32, shape {shape}), got {type(out).__name__}")
    if out.dtype != torch.float32 or tuple(out.shape) != shape or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous float32 tensor of shape {shape}, got "
                         f"{'a non-contiguous ' if not out.is_contiguous() else ''}{out.dtype} tensor of shape "
                         f"{tuple(out.shape)}")
    return out


def dequantize(raw: torch.Tensor, ggml_type: int, shape, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """A GGUF tensor's bytes (1-D uint8) -> float32 of ``shape``, for every type of :data:`TYPE_NAMES`.

    ``shape`` is in PyTorch order, the contiguous size last (GGUF's tensor table lists the sizes the other way
    round: ``ne[0]`` first). The byte count is checked against the shape before anything is allocated, and a
    result holding a NaN or an infinity is refused (ValueError).

    The result is always a new tensor (never a view of ``raw``), or ``out`` -- a contiguous float32 tensor of
    ``shape``, a model's parameter say -- written in place. The blocks are decoded :data:`DECODE_SLICE` weights at a
    time, straight into the result, so the temporaries stay those of one slice (a few MiB) however large the tensor;
    every block is decoded on its own, so the numbers are the same as decoding the whole at once, bit for bit.
    """
    ggml_type = _check_type(ggml_type)
    shape = _check_shape(shape, ggml_type)
    blocks = _check_raw(raw, ggml_type, shape)
    out = torch.empty(shape, dtype=torch.float32) if out is None else _check_out(out, shape)
    per_block = BLOCK_LAYOUT[ggml_type][0]
    weights = out.view(-1, per_block)  # row i: the weights of block i
    step = max(1, DECODE_SLICE // per_block)
    bad = 0
    with torch.no_grad():  # out may be a parameter
        for start in range(0, blocks.shape[0], step):
            part, into = blocks[start:start + step], weights[start:start + step]
            if ggml_type in BLOCK_TYPES:
                into.copy_(dequantize_parts(*_parts(part, ggml_type)))
            else:  # the plain types: F32 copied, F16 and BF16 widened (both exact)
                into.copy_(part.contiguous().view(_PLAIN[ggml_type]))
            finite = torch.isfinite(into)
            if not bool(finite.all()):
                bad += into.numel() - int(finite.sum())
    if bad:
        raise ValueError(f"{TYPE_NAMES[ggml_type]} data of shape {shape} decodes to {bad:,} NaN or infinite "
                         f"value(s) (a NaN or infinite number, or scale, in the bytes)")
    return out


def quantize(x: torch.Tensor, ggml_type: int) -> torch.Tensor:
    """``x`` in any format of :data:`TYPE_NAMES`, as 1-D uint8 bytes (F32, F16, BF16: the numbers' bytes).

    The legacy block types give the ``gguf`` package's bytes; the k-quants (last size a multiple of 256) use a
    min-max rule per sub-block (:mod:`groundup.kquants`), not llama.cpp's search, so their bytes differ from
    llama-quantize's while decoding the same way."""
    ggml_type = _check_type(ggml_type)
    if ggml_type in _QUANTIZERS:
        return _QUANTIZERS[ggml_type](x)
    if ggml_type in kquants.ENCODERS:
        return kquants.encode(_check_floats(x, per_row=kquants.QK_K), ggml_type).reshape(-1)
    x = _check_floats(x, per_row=1)
    if ggml_type == BF16:
        return _bfloat16_bytes(x)
    if ggml_type == F16:
        x = _to_float16(x, "value")
    return x.to(_PLAIN[ggml_type]).contiguous().view(torch.uint8).reshape(-1)


def round_trip(x: torch.Tensor, ggml_type: int) -> torch.Tensor:
    """``dequantize(quantize(x))``: what a weight becomes once stored in the format, same shape, float32."""
    return dequantize(quantize(x, ggml_type), ggml_type, tuple(x.shape))
