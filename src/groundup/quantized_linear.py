"""A linear layer that keeps its weights as GGUF blocks and computes from them (chapter 12).

Dequantizing a GGUF file to float32 (:func:`groundup.pretrained.load_gguf`) makes every weight 4 bytes again:
SmolLM2's 98 MB file becomes a 538 MB model. :class:`QuantizedLinear` keeps what a block holds instead: the small
integers ``q``, one byte each (int8; 4- and 5-bit values are unpacked from their nibbles once, at load), and per
group of 16 or 32 weights the float32 step ``d`` (times the k-quants' sub-block scale) and, where the type has one,
the offset ``m`` (minus ``dmin m_j`` for the k-quants), so that

    W[o, i] = q[o, i] * step[o, i // group] (+ offset[o, i // group])

exactly as :func:`groundup.quantization.dequantize` computes it, bit for bit (the numbers are
:func:`groundup.quantization.block_parts`'). That is 1.125 to 1.5 bytes a weight (an int8 per weight, 4 bytes of step
per group of 32 or 16, as many again for an offset).

``forward`` never holds the float32 matrix: it dequantizes ``q * step`` a slice of rows at a time (``SLICE_ELEMENTS``
weights, a multiple of 32 rows: 2 MB of float32 for rows of up to 16,384 numbers) into a buffer the cache keeps, and
multiplies ``x`` by it with :func:`groundup.linear.linear` into the slice of the output those rows make. The offsets
need no pass over the matrix: an offset is shared by the group's weights, so its part of ``x W^T`` is ``offset[o, g]``
times the sum of ``x`` over group g, one small matrix product for all rows (``x_sums @ offset^T``). The result equals
``F.linear(x, dequantize(...))`` to float32 rounding (the sums are added in another order), not bit for bit.

:class:`QuantizedEmbedding` is the row lookup ``W_E[ids]`` from the same numbers; a tied unembedding shares them.
"""

from __future__ import annotations

import threading

import torch
from torch import nn

from groundup import quantization
from groundup.linear import linear

__all__ = ["QuantizedEmbedding", "QuantizedLinear", "SLICE_ELEMENTS"]

#: Weights dequantized per slice of rows in ``forward`` (2 MB of float32; rounded down to a multiple of 32 rows).
SLICE_ELEMENTS = 1 << 19


_scratch = threading.local()  # per thread: {device: float32 buffer}; freed with its thread


def _scratch_buffer(n: int, device: torch.device) -> torch.Tensor:
    """A float32 buffer of at least ``n`` numbers, kept between calls (per device and thread): PyTorch's CPU allocator
    returns large blocks to the system, so a fresh 2 MB buffer per layer call would be page-faulted in anew every
    time (measured: decode 2-3x slower and erratic). Forward passes in one thread use it one layer at a time. It is
    made outside inference mode (an inference tensor could not be written outside it later) and always float32."""
    buffers = _scratch.__dict__.setdefault("buffers", {})
    buffer = buffers.get(device)
    if buffer is None or buffer.numel() < n:
        with torch.inference_mode(False):
            buffer = buffers[device] = torch.empty(n, dtype=torch.float32, device=device)
    return buffer


class _BlockWeight(nn.Module):
    """The numbers of a block-quantized ``(rows, cols)`` matrix as buffers, and its rows dequantized on demand."""

    def __init__(self, q: torch.Tensor, step: torch.Tensor, offset: torch.Tensor | None, group: int,
                 ggml_type: int):
        super().__init__()
        self.register_buffer("q", q)
        self.register_buffer("step", step)
        self.register_buffer("offset", offset)
        self.group = group
        self.ggml_type = ggml_type

    def rows(self, index) -> torch.Tensor:
        """Rows ``index`` (a slice or a tensor of indices) of the matrix, float32, ``q * step + offset``."""
        offset = None if self.offset is None else self.offset[index]
        return quantization.dequantize_parts(self.q[index], self.step[index], offset, self.group)

    def scaled_rows_into(self, start: int, stop: int, out: torch.Tensor | None) -> torch.Tensor:
        """``q * step`` (no offset) of rows ``start:stop`` as ``(rows, cols)``: into the float32 buffer ``out``, or a
        new tensor when ``out`` is None."""
        n, cols = stop - start, self.q.shape[1]
        q, step = self.q[start:stop].view(n, -1, self.group), self.step[start:stop].unsqueeze(-1)
        if out is None:
            return torch.mul(q, step).view(n, cols)
        w = out[:n * cols].view(n, -1, self.group)
        torch.mul(q, step, out=w)
        return w.view(n, cols)

    def check_float32(self, what: str) -> None:
        """The steps and offsets must still be float32 (``model.to(torch.bfloat16)`` would have rounded them)."""
        if self.step.dtype != torch.float32 or (self.offset is not None and self.offset.dtype != torch.float32):
            raise TypeError(f"{what}'s block steps are {self.step.dtype}, not float32: a kept-quantized model computes "
                            "in float32 and its steps must stay so (do not call model.to(dtype), .half() or "
                            ".bfloat16() on it; load it again)")

    def n_bytes(self) -> int:
        """Bytes these buffers take."""
        return sum(t.numel() * t.element_size() for t in (self.q, self.step, self.offset) if t is not None)


class QuantizedLinear(nn.Module):
    """``y = x W^T`` (no bias) with ``W`` (``out_features x in_features``) kept as GGUF block numbers.

    Build it with :meth:`from_gguf` from a tensor's bytes; ``weight`` dequantizes the whole matrix (for checks only:
    ``forward`` never does)."""

    def __init__(self, numbers: _BlockWeight):
        super().__init__()
        self.numbers = numbers
        self.out_features, self.in_features = numbers.q.shape
        rows = max(32, SLICE_ELEMENTS // self.in_features // 32 * 32)
        self.rows_per_slice = min(rows, self.out_features)

    @classmethod
    def from_gguf(cls, raw: torch.Tensor, ggml_type: int, shape) -> QuantizedLinear:
        """From a GGUF tensor's bytes (1-D uint8), its GGML type and its PyTorch shape ``(out, in)``."""
        return cls(_BlockWeight(*quantization.block_parts(raw, ggml_type, shape), ggml_type=int(ggml_type)))

    @property
    def weight(self) -> torch.Tensor:
        return self.numbers.rows(slice(None))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32:
            raise TypeError(f"QuantizedLinear computes in float32, got x of dtype {x.dtype}")
        if x.dim() == 0 or x.shape[-1] != self.in_features:
            raise ValueError(f"x must have shape [..., {self.in_features}], got {tuple(x.shape)}")
        self.numbers.check_float32("QuantizedLinear")
        out = x.new_empty(*x.shape[:-1], self.out_features)
        # Autograd keeps the slices a product used: with a gradient to compute each needs its own tensor.
        needs_grad = torch.is_grad_enabled() and x.requires_grad
        buffer = None if needs_grad else _scratch_buffer(self.rows_per_slice * self.in_features, x.device)
        for start in range(0, self.out_features, self.rows_per_slice):
            stop = min(start + self.rows_per_slice, self.out_features)
            out[..., start:stop] = linear(x, self.numbers.scaled_rows_into(start, stop, buffer))
        if self.numbers.offset is not None:  # sum_i offset[o, i // group] x_i = sum_g offset[o, g] (sum of group g)
            sums = x.view(*x.shape[:-1], -1, self.numbers.group).sum(dim=-1)
            out += sums @ self.numbers.offset.T
        return out

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"type={quantization.TYPE_NAMES[self.numbers.ggml_type]}")


class QuantizedEmbedding(nn.Module):
    """The lookup ``W_E[ids]`` from block numbers (shared with a tied :class:`QuantizedLinear` unembedding)."""

    def __init__(self, numbers: _BlockWeight):
        super().__init__()
        self.numbers = numbers
        self.vocab_size, self.d_model = numbers.q.shape

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.dtype.is_floating_point or ids.dtype == torch.bool:
            raise TypeError(f"ids must have an integer dtype (e.g. torch.long), got {ids.dtype}")
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size):
            bad = int(ids.min()) if int(ids.min()) < 0 else int(ids.max())
            raise ValueError(f"ids must lie in [0, {self.vocab_size - 1}] (vocab_size={self.vocab_size}), got {bad}")
        self.numbers.check_float32("QuantizedEmbedding")
        return self.numbers.rows(ids.long())

    def extra_repr(self) -> str:
        return (f"vocab_size={self.vocab_size}, d_model={self.d_model}, "
                f"type={quantization.TYPE_NAMES[self.numbers.ggml_type]}")
