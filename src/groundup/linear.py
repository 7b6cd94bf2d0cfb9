"""The linear layer ``y = x W^T + b``, and a faster way to compute it for a single row (a decode step).

Generating text feeds a model one token at a time, so each linear layer multiplies one row ``x`` by its weight
``W`` (``out_features x in_features``): a matrix-vector product, two flops per entry of ``W``, so its speed is
the speed at which ``W`` streams in from memory. ``F.linear`` hands it to the BLAS library as a matrix product
with one row. On some CPUs that call streams ``W`` at about half the memory's speed: on the book's 2-core AMD
EPYC (Zen 4) machine, with PyTorch's MKL, GPT-2 small's 12 layers took 24-27 ms per token through ``F.linear``
and 15 ms when ``W`` was cut into four blocks of rows and the four products run as one batched ``torch.matmul``;
its 50,257 x 768 unembedding 12.1-12.3 ms against 6.8-7.2 ms (medians of alternated runs at two times
on the same day). Each output is still the dot product of ``x`` with one row of ``W``, and the results were
identical bit for bit in every shape tried, under MKL's reproducible mode and ATen's portable kernels too
(``tests/test_linear.py`` checks it on the machine it runs on). That was measured with one BLAS, Intel's MKL
(the one PyTorch's x86 builds use), on one CPU; another CPU may gain nothing, and another BLAS may round the
blocks differently, so the path is taken only where PyTorch computes with MKL. ``python -m groundup.bench
versus_transformers`` measures the whole generation.

:func:`linear` takes that path only for one row, in float32 (not under autocast, which would compute in another
precision), with no gradient recorded, and for a weight of at least ``BLOCKED_MIN_ELEMENTS`` entries (small
matrices sit in the cache, where the extra call costs more than it saves). Everywhere else it is ``F.linear``.
:class:`Linear` is ``nn.Linear`` computing with it; the book's attention and feed-forward layers are made of it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["ALIGN", "BLOCKED", "BLOCKED_MIN_ELEMENTS", "BLOCKS", "Linear", "linear"]

BLOCKS = 4  # blocks of rows of W (2 to 16 measured alike)
ALIGN = 32  # each block holds a multiple of this many rows (see linear)
BLOCKED_MIN_ELEMENTS = 1 << 18  # 262,144 entries (1 MB of float32): below this, F.linear
BLOCKED = torch.backends.mkl.is_available()  # the BLAS the path was measured and tested with (see above)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``: ``x @ weight^T + bias``; for a single row, computed in blocks of rows.

    The single-row path (see the module's docstring) multiplies ``x`` by ``BLOCKS`` equal blocks of rows of
    ``weight`` in one batched matmul, and the rows left over (fewer than ``BLOCKS * ALIGN``) with ``F.linear``.
    Each block starts at, and holds, a multiple of ``ALIGN`` rows: BLAS kernels take rows a few at a time (4
    here) and finish a left-over few by other code, which rounds differently; aligned blocks give every row
    the same code as one ``F.linear`` call does.
    """
    out_features, in_features = weight.shape
    if (not BLOCKED or x.numel() != in_features or x.dtype != torch.float32 or weight.dtype != torch.float32
            or (bias is not None and bias.dtype != torch.float32)
            or weight.numel() < BLOCKED_MIN_ELEMENTS or out_features < BLOCKS * ALIGN
            or x.device.type != "cpu" or weight.device.type != "cpu" or not weight.is_contiguous()
            or torch.is_autocast_enabled("cpu")
            or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                             or (bias is not None and bias.requires_grad)))):
        return F.linear(x, weight, bias)
    rows = out_features - out_features % (BLOCKS * ALIGN)
    blocks = weight[:rows].view(BLOCKS, rows // BLOCKS, in_features).transpose(1, 2)
    y = torch.matmul(x.reshape(1, 1, in_features), blocks).reshape(rows)
    if rows < out_features:
        y = torch.cat([y, F.linear(x.reshape(in_features), weight[rows:])])
    y = y.view(*x.shape[:-1], out_features)
    return y if bias is None else y + bias


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters, state-dict names, initialisation and printout) computing with :func:`linear`."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 (nn.Linear's own argument name)
        return linear(input, self.weight, self.bias)
