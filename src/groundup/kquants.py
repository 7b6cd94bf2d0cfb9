"""k-quants: GGML's 256-weight super-blocks (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K), decoded by hand.

The files readers download (``Q4_K_M``, ``Q5_K_M``, ``Q6_K`` ...) store most matrices in these types. A super-block
holds ``QK_K = 256`` consecutive weights of one row, cut into sub-blocks (16 of 16 weights, or 8 of 32); each
sub-block has its own small integer scale (and, for the types with a minimum, a small integer minimum), and the
super-block one or two float16 numbers that scale those integers in turn. So a weight is

    x = d * s_j * q - dmin * m_j      (Q2_K, Q4_K, Q5_K: sub-block j's scale s_j and minimum m_j)
    x = d * s_j * q                   (Q3_K, Q6_K: a signed q, no minimum)

with ``q`` of 2, 3, 4, 5 or 6 bits. Quantizing the scales too is what brings the cost per weight close to the
bits of ``q`` alone: Q4_K spends 4.5 bits a weight (144 bytes per 256), where Q4_1's float16 step and minimum per 32
weights make 5.

The layouts are llama.cpp's (``block_q2_K`` ... ``block_q6_K`` in ``ggml-common.h``). :func:`parts` reads a
``(n, block_bytes)`` uint8 tensor of super-blocks into the integers ``q`` and each group's step ``d s_j`` and offset
``-dmin m_j``, computed in float32 as ``gguf.quants.dequantize`` computes them; :func:`groundup.quantization.dequantize`
multiplies them out, and the weights equal gguf's bit for bit (tests check every type on random blocks and in a file
the ``gguf`` package writes).

The encoders below use a plain min-max rule per sub-block (llama.cpp searches for the scale of least squared error),
so their bytes differ from ``llama-quantize``'s; their error is that of a uniform quantizer with each sub-block's
step, which a test checks.
"""

import torch

QK_K = 256
Q2_K, Q3_K, Q4_K, Q5_K, Q6_K = 10, 11, 12, 13, 14
#: Bytes per super-block of 256 weights, as GGML's type traits give them.
BLOCK_BYTES = {Q2_K: 84, Q3_K: 110, Q4_K: 144, Q5_K: 176, Q6_K: 210}
TYPE_NAMES = {Q2_K: "Q2_K", Q3_K: "Q3_K", Q4_K: "Q4_K", Q5_K: "Q5_K", Q6_K: "Q6_K"}


def _split(blocks: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    """The columns of ``blocks`` cut into consecutive fields of ``sizes`` bytes (their sum is the block's size)."""
    assert sum(sizes) == blocks.shape[1]
    return list(torch.split(blocks, sizes, dim=1))


def _float16(pair: torch.Tensor) -> torch.Tensor:
    """Bytes ``(n, 2)`` (little-endian) -> float16 numbers widened to float32, ``(n,)``."""
    return pair.contiguous().view(torch.float16).reshape(-1).to(torch.float32)


def _bits(x: torch.Tensor, shifts: range, mask: int) -> torch.Tensor:
    """``(x >> s) & mask`` for every shift ``s``: ``x`` ``(..., k)`` uint8 -> ``(..., len(shifts), k)``."""
    s = torch.tensor(list(shifts), dtype=torch.uint8).view(-1, 1)
    return (x.unsqueeze(-2) >> s) & mask


def _scales_and_mins_k4(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K's and Q5_K's 12 bytes -> eight 6-bit scales and eight 6-bit minimums, ``(n, 8)`` each.

    Bytes 0-3 hold scales 0-3 in their low six bits, bytes 4-7 minimums 0-3; scales and minimums 4-7 keep their low
    four bits in bytes 8-11 (scale low, minimum high) and their top two bits in the spare top bits of bytes 0-7.
    """
    a, b, c = packed.reshape(-1, 3, 4).unbind(dim=1)
    scales = torch.cat([a & 63, (c & 0x0F) | ((a >> 2) & 0x30)], dim=1)
    mins = torch.cat([b & 63, (c >> 4) | ((b >> 2) & 0x30)], dim=1)
    return scales, mins


# Each ``_parts_*`` function reads a type's super-blocks ``(n, block_bytes)`` into ``(q, step, offset, group)``: the
# integers q (int8, ``(n, 256)``), each group's step ``d s_j`` and offset ``-dmin m_j`` (float32, ``(n, 256 / group)``;
# None for the types without a minimum) and the group size. ``q * step + offset`` (groundup.quantization.dequantize)
# is gguf.quants' ``d s_j * q - dmin m_j`` bit for bit: the same float32 products, and ``a - b`` is ``a + (-b)``.

def _parts_q2_k(blocks: torch.Tensor):
    """Q2_K: 16 scale bytes (scale low nibble, minimum high), 64 bytes of 2-bit q, then ``d`` and ``dmin``.

    Each 32 bytes of q serve 128 weights: bits 0-1 of byte i are weight i, bits 2-3 weight i + 32, and so on."""
    scales, qs, d, dmin = _split(blocks, [16, 64, 2, 2])
    q = _bits(qs.reshape(-1, 2, 32), range(0, 8, 2), 3).reshape(-1, QK_K)
    step = _float16(d)[:, None] * (scales & 0x0F).to(torch.float32)
    return q.to(torch.int8), step, -(_float16(dmin)[:, None] * (scales >> 4).to(torch.float32)), 16


def _parts_q3_k(blocks: torch.Tensor):
    """Q3_K: 32 bytes of high bits, 64 bytes of the low 2 bits, 12 bytes of 6-bit signed scales, then ``d``.

    ``q`` = low two bits - 4 where the high bit is 0 (so -4..3); scale j = its 6 bits - 32. The low two bits are laid
    out as in Q2_K; the high bit of weight ``32 k + i`` is bit k of byte i of the mask."""
    hmask, qs, packed, d = _split(blocks, [32, 64, 12, 2])
    low, high = packed[:, :8], packed[:, 8:]
    scales = (torch.cat([low & 0x0F, low >> 4], dim=1)                            # low four bits of scales 0-15
              | (_bits(high, range(0, 8, 2), 3).reshape(-1, 16) << 4))            # top two bits
    step = _float16(d)[:, None] * (scales.to(torch.int8) - 32).to(torch.float32)
    q_low = _bits(qs.reshape(-1, 2, 32), range(0, 8, 2), 3).reshape(-1, QK_K).to(torch.int8)
    q_high = _bits(hmask, range(8), 1).reshape(-1, QK_K).to(torch.int8)
    return q_low - ((1 - q_high) << 2), step, None, 16


def _parts_q4_k(blocks: torch.Tensor, fifth_bits: bool = False):
    """Q4_K: ``d``, ``dmin``, 12 bytes of 6-bit scales and minimums, then 128 bytes of 4-bit q. Each 32 bytes of q
    serve two sub-blocks of 32: the low nibbles the first, the high nibbles the second.

    Q5_K (``fifth_bits``): the same, with 32 bytes of fifth bits before the nibbles: bit j of byte i tops weight
    ``32 j + i``."""
    if fifth_bits:
        d, dmin, packed, qh, qs = _split(blocks, [2, 2, 12, 32, 128])
    else:
        d, dmin, packed, qs = _split(blocks, [2, 2, 12, 128])
    q = _bits(qs.reshape(-1, 4, 32), (0, 4), 0x0F).reshape(-1, 8, 32)
    if fifth_bits:
        q = q | (_bits(qh, range(8), 1) << 4)
    scales, mins = _scales_and_mins_k4(packed)
    step = _float16(d)[:, None] * scales.to(torch.float32)
    return q.reshape(-1, QK_K).to(torch.int8), step, -(_float16(dmin)[:, None] * mins.to(torch.float32)), 32


def _parts_q6_k(blocks: torch.Tensor):
    """Q6_K: 128 bytes of low nibbles, 64 bytes of top two bits, 16 signed 8-bit scales, then ``d``; q = 6 bits - 32.

    Each half of 128 weights takes 64 bytes of nibbles (low nibbles weights 0-63, high nibbles 64-127) and 32 bytes
    of top bits (bits 2k, 2k + 1 of byte i top weight ``32 k + i``)."""
    ql, qh, scales, d = _split(blocks, [128, 64, 16, 2])
    low = _bits(ql.reshape(-1, 2, 64), (0, 4), 0x0F).reshape(-1, QK_K)
    high = _bits(qh.reshape(-1, 2, 32), range(0, 8, 2), 3).reshape(-1, QK_K)
    step = _float16(d)[:, None] * scales.contiguous().view(torch.int8).to(torch.float32)
    return (low | (high << 4)).to(torch.int8) - 32, step, None, 16


_PARTS = {Q2_K: _parts_q2_k, Q3_K: _parts_q3_k, Q4_K: _parts_q4_k, Q5_K: lambda b: _parts_q4_k(b, fifth_bits=True),
          Q6_K: _parts_q6_k}


def _check_k_type(ggml_type) -> int:
    if ggml_type not in BLOCK_BYTES:
        raise ValueError(f"ggml_type must be a k-quant type ({', '.join(f'{n}={t}' for t, n in TYPE_NAMES.items())}), "
                         f"got {ggml_type!r}")
    return ggml_type


def parts(blocks: torch.Tensor, ggml_type: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int]:
    """Super-blocks ``(n, BLOCK_BYTES[ggml_type])`` uint8 -> ``(q, step, offset, group)`` (see above): what
    :func:`groundup.quantization.dequantize` multiplies out and :class:`groundup.quantized_linear.QuantizedLinear`
    keeps, one byte a weight."""
    return _PARTS[_check_k_type(ggml_type)](blocks)


# ---------------------------------------------------------------------------------------------------------------
# Encoding: a plain min-max rule, not llama.cpp's search (which tries several scales per sub-block and keeps the one
# of least squared error). Same layouts, so every block decodes as above; a little more error than llama.cpp's.
# ---------------------------------------------------------------------------------------------------------------

def _float16_rounded(x: torch.Tensor) -> torch.Tensor:
    """float32 -> float16 and back (the super-block's numbers as the file will hold them); too large is an error."""
    if x.numel() and x.abs().max() > 65504:
        raise ValueError(f"x is too large for a k-quant: a super-block scale reaches {x.abs().max().item():.4g}, "
                         "beyond float16's largest number 65504")
    return x.to(torch.float16).to(torch.float32)


def _float16_pair(x: torch.Tensor) -> torch.Tensor:
    """float32 ``(n,)`` (already float16 values) -> bytes ``(n, 2)``."""
    return x.to(torch.float16).view(torch.uint8).reshape(-1, 2)


def _divide(x: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """``x / step``, 0 where the step is 0 (an all-zero sub-block)."""
    return torch.where(step == 0, torch.zeros_like(x), x / torch.where(step == 0, torch.ones_like(step), step))


def _encode_with_mins(x: torch.Tensor, sub: int, q_bits: int, scale_bits: int):
    """Sub-blocks of ``sub`` weights as ``x ≈ d s_j q - dmin m_j`` (Q2_K, Q4_K, Q5_K), each block by min and max.

    Returns ``d``, ``dmin`` (float16 values, ``(n,)``), the integer scales and minimums ``(n, 256 / sub)`` and q
    ``(n, 256)``, all uint8."""
    xs = x.reshape(x.shape[0], -1, sub)
    low = xs.amin(dim=2).clamp(max=0)                       # a minimum is subtracted, so it is at most 0
    step = (xs.amax(dim=2) - low) / (2**q_bits - 1)          # sub-block j's step d s_j
    top = 2**scale_bits - 1
    d = _float16_rounded(step.amax(dim=1) / top)
    dmin = _float16_rounded((-low).amax(dim=1) / top)
    scales = _divide(step, d[:, None]).round().clamp(0, top)
    mins = _divide(-low, dmin[:, None]).round().clamp(0, top)
    q = _divide(xs + (dmin[:, None] * mins)[:, :, None], (d[:, None] * scales)[:, :, None])
    q = q.round().clamp(0, 2**q_bits - 1)
    return d, dmin, scales.to(torch.uint8), mins.to(torch.uint8), q.reshape(x.shape[0], QK_K).to(torch.uint8)


def _encode_signed(x: torch.Tensor, q_bits: int, scale_top: int):
    """16 sub-blocks of 16 as ``x ≈ d s_j q`` with signed q (Q3_K, Q6_K): each sub-block's step from its entry of
    largest magnitude, ``d = max |step| / scale_top``. Returns ``d`` (float16 values), the signed scales and q
    ``(n, 256)`` shifted to be non-negative (``q + 2^(q_bits - 1)``), as integers."""
    xs = x.reshape(x.shape[0], 16, 16)
    extreme = xs.gather(2, xs.abs().argmax(dim=2, keepdim=True)).squeeze(2)
    half = 2 ** (q_bits - 1)
    step = extreme / -half                                  # the extreme entry becomes q = -half exactly
    d = _float16_rounded(step.abs().amax(dim=1) / scale_top)
    scales = _divide(step, d[:, None]).round().clamp(-scale_top, scale_top)
    q = _divide(xs, (d[:, None] * scales)[:, :, None]).round().clamp(-half, half - 1) + half
    return d, scales.to(torch.int16), q.reshape(x.shape[0], QK_K).to(torch.uint8)


def _pack_bits(values: torch.Tensor, width: int) -> torch.Tensor:
    """``(n, k, c)`` values of ``width`` bits -> bytes ``(n, c)``: value ``[j, i]`` at bits ``width * j`` of byte i."""
    shifts = (torch.arange(values.shape[1], dtype=torch.int32) * width).view(1, -1, 1)
    return (values.to(torch.int32) << shifts).sum(dim=1).to(torch.uint8)


def _pack_scales_k4(scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """Eight 6-bit scales and minimums ``(n, 8)`` -> Q4_K's 12 bytes (the inverse of ``_scales_and_mins_k4``)."""
    s, m = scales.to(torch.int32), mins.to(torch.int32)
    a = s[:, :4] | ((s[:, 4:] >> 4) << 6)
    b = m[:, :4] | ((m[:, 4:] >> 4) << 6)
    c = (s[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4)
    return torch.cat([a, b, c], dim=1).to(torch.uint8)


def encode_q2_k(x: torch.Tensor) -> torch.Tensor:
    """Rows of 256 weights ``(n, 256)`` float32 -> Q2_K super-blocks ``(n, 84)``."""
    d, dmin, scales, mins, q = _encode_with_mins(x, 16, 2, 4)
    qs = _pack_bits(q.reshape(-1, 2, 4, 32).flatten(0, 1), 2).reshape(-1, 64)
    return torch.cat([scales | (mins << 4), qs, _float16_pair(d), _float16_pair(dmin)], dim=1)


def encode_q3_k(x: torch.Tensor) -> torch.Tensor:
    """Rows of 256 weights -> Q3_K super-blocks ``(n, 110)``: 3-bit q - 4, 6-bit scales - 32."""
    d, scales, u = _encode_signed(x, 3, 31)
    hmask = _pack_bits((u >> 2).reshape(-1, 8, 32), 1)
    qs = _pack_bits((u & 3).reshape(-1, 2, 4, 32).flatten(0, 1), 2).reshape(-1, 64)
    s = (scales + 32).to(torch.int32)                                                # 0..63
    low = (s[:, :8] & 0x0F) | ((s[:, 8:] & 0x0F) << 4)
    high = _pack_bits((s >> 4).reshape(-1, 4, 4), 2)                               # bits 2k of byte i: s[4k + i]
    return torch.cat([hmask, qs, low.to(torch.uint8), high, _float16_pair(d)], dim=1)


def encode_q4_k(x: torch.Tensor) -> torch.Tensor:
    """Rows of 256 weights -> Q4_K super-blocks ``(n, 144)``."""
    d, dmin, scales, mins, q = _encode_with_mins(x, 32, 4, 6)
    qs = _pack_bits(q.reshape(-1, 2, 32), 4).reshape(-1, 128)                        # sub-blocks 2c, 2c + 1
    return torch.cat([_float16_pair(d), _float16_pair(dmin), _pack_scales_k4(scales, mins), qs], dim=1)


def encode_q5_k(x: torch.Tensor) -> torch.Tensor:
    """Rows of 256 weights -> Q5_K super-blocks ``(n, 176)``."""
    d, dmin, scales, mins, q = _encode_with_mins(x, 32, 5, 6)
    qh = _pack_bits((q >> 4).reshape(-1, 8, 32), 1)
    qs = _pack_bits((q & 0x0F).reshape(-1, 2, 32), 4).reshape(-1, 128)
    return torch.cat([_float16_pair(d), _float16_pair(dmin), _pack_scales_k4(scales, mins), qh, qs], dim=1)


def encode_q6_k(x: torch.Tensor) -> torch.Tensor:
    """Rows of 256 weights -> Q6_K super-blocks ``(n, 210)``: 6-bit q - 32, signed 8-bit scales."""
    d, scales, u = _encode_signed(x, 6, 127)
    halves = u.reshape(-1, 2, 128)
    ql = (halves[:, :, :64] & 0x0F) | ((halves[:, :, 64:] & 0x0F) << 4)              # (n, 2, 64)
    qh = _pack_bits((halves >> 4).reshape(-1, 4, 32), 2).reshape(-1, 64)
    return torch.cat([ql.reshape(-1, 128), qh, scales.to(torch.int8).view(torch.uint8), _float16_pair(d)], dim=1)


ENCODERS = {Q2_K: encode_q2_k, Q3_K: encode_q3_k, Q4_K: encode_q4_k, Q5_K: encode_q5_k, Q6_K: encode_q6_k}


def encode(x: torch.Tensor, ggml_type: int) -> torch.Tensor:
    """Rows of 256 finite float32 weights ``(n, 256)`` -> super-blocks ``(n, BLOCK_BYTES[ggml_type])`` uint8."""
    return ENCODERS[_check_k_type(ggml_type)](x)
