"""Attention speed: our MultiHeadAttention vs torch.nn.MultiheadAttention, our explicit path vs SDPA.

The shape is a small GPT's: batch 8, sequence 256, d_model 384, 6 heads (d_head 64). Every figure is the median
forward+backward time; the two sides of each comparison are timed alternately in the same run.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from groundup.attention import MultiHeadAttention, causal_mask, scaled_dot_product_attention
from groundup.bench import Row

BATCH, SEQ, D_MODEL, N_HEADS = 8, 256, 384, 6


def paired_medians(a: Callable[[], object], b: Callable[[], object], *, repeat: int = 9,
                   warmup: int = 2) -> tuple[float, float]:
    """Median seconds of ``a()`` and of ``b()``, timed alternately so both see the same machine load."""
    for _ in range(warmup):
        a()
        b()
    ta, tb = [], []
    for _ in range(repeat):
        for fn, times in ((a, ta), (b, tb)):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
    return statistics.median(ta), statistics.median(tb)


def _fwd_bwd(fn: Callable[[], torch.Tensor]) -> Callable[[], None]:
    return lambda: fn().sum().backward()


def _copy_weights(ours: MultiHeadAttention, ref: nn.MultiheadAttention) -> None:
    with torch.no_grad():
        ref.in_proj_weight.copy_(torch.cat([ours.W_q.weight, ours.W_k.weight, ours.W_v.weight]))
        ref.in_proj_bias.copy_(torch.cat([ours.W_q.bias, ours.W_k.bias, ours.W_v.bias]))
        ref.out_proj.weight.copy_(ours.W_o.weight)
        ref.out_proj.bias.copy_(ours.W_o.bias)


def run() -> list[Row]:
    torch.manual_seed(0)
    ours = MultiHeadAttention(D_MODEL, N_HEADS)
    ref = nn.MultiheadAttention(D_MODEL, N_HEADS, batch_first=True)
    _copy_weights(ours, ref)
    x = torch.randn(BATCH, SEQ, D_MODEL, requires_grad=True)
    mask = causal_mask(SEQ)
    shape = f"({BATCH}, {SEQ}, {D_MODEL}), {N_HEADS} heads"
    rows = []

    t_ours, t_ref = paired_medians(_fwd_bwd(lambda: ours(x)),
                                   _fwd_bwd(lambda: ref(x, x, x, need_weights=False)[0]))
    rows.append(Row(f"MultiHeadAttention fwd+bwd {shape}", t_ours * 1e3, "ms",
                    f"{t_ours / t_ref:.2f}x nn.MultiheadAttention ({t_ref * 1e3:.1f} ms)"))

    t_ours, t_ref = paired_medians(_fwd_bwd(lambda: ours(x, mask=mask)),
                                   _fwd_bwd(lambda: ref(x, x, x, attn_mask=~mask, need_weights=False)[0]))
    rows.append(Row("  same, causal mask", t_ours * 1e3, "ms",
                    f"{t_ours / t_ref:.2f}x nn.MultiheadAttention ({t_ref * 1e3:.1f} ms)"))

    t_expl, t_fast = paired_medians(_fwd_bwd(lambda: ours(x, mask=mask, need_weights=True)[0]),
                                    _fwd_bwd(lambda: ours(x, mask=mask)))
    rows.append(Row("  same, need_weights=True (explicit path)", t_expl * 1e3, "ms",
                    f"{t_expl / t_fast:.2f}x the SDPA path ({t_fast * 1e3:.1f} ms)"))

    d_head = D_MODEL // N_HEADS
    q, k, v = (torch.randn(BATCH, N_HEADS, SEQ, d_head, requires_grad=True) for _ in range(3))
    t_expl, t_sdpa = paired_medians(_fwd_bwd(lambda: scaled_dot_product_attention(q, k, v, mask=mask)[0]),
                                    _fwd_bwd(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask)))
    rows.append(Row(f"scaled_dot_product_attention fwd+bwd ({BATCH}, {N_HEADS}, {SEQ}, {d_head}) causal",
                    t_expl * 1e3, "ms", f"{t_expl / t_sdpa:.2f}x F.scaled_dot_product_attention "
                    f"({t_sdpa * 1e3:.1f} ms)"))
    return rows
