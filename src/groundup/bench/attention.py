"""Attention speed: our MultiHeadAttention vs torch.nn.MultiheadAttention, our explicit path vs SDPA.

The shape is a small GPT's: batch 8, sequence 256, d_model 384, 6 heads (d_head 64). Every figure is the median
forward+backward time; the two sides of each comparison are timed alternately, round by round, and the ratio
is the median of the per-round ratios (with its quartiles).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from groundup.attention import MultiHeadAttention, causal_mask, scaled_dot_product_attention
from groundup.bench import Row, alternate, ratio_note

BATCH, SEQ, D_MODEL, N_HEADS = 8, 256, 384, 6


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

    def pair(label, a, b, versus):
        t = alternate({"a": _fwd_bwd(a), "b": _fwd_bwd(b)}, repeat=9, warmup=2)
        ta, tb = statistics.median(t["a"]), statistics.median(t["b"])
        rows.append(Row(label, ta * 1e3, "ms", ratio_note(t["a"], t["b"], f"{versus} ({tb * 1e3:.1f} ms)")))

    pair(f"MultiHeadAttention fwd+bwd {shape}", lambda: ours(x), lambda: ref(x, x, x, need_weights=False)[0],
         "nn.MultiheadAttention")
    pair("  same, causal mask", lambda: ours(x, mask=mask),
         lambda: ref(x, x, x, attn_mask=~mask, need_weights=False)[0], "nn.MultiheadAttention")
    pair("  same, need_weights=True (explicit path)", lambda: ours(x, mask=mask, need_weights=True)[0],
         lambda: ours(x, mask=mask), "the SDPA path")
    d_head = D_MODEL // N_HEADS
    q, k, v = (torch.randn(BATCH, N_HEADS, SEQ, d_head, requires_grad=True) for _ in range(3))
    pair(f"scaled_dot_product_attention fwd+bwd ({BATCH}, {N_HEADS}, {SEQ}, {d_head}) causal",
         lambda: scaled_dot_product_attention(q, k, v, mask=mask)[0],
         lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask), "F.scaled_dot_product_attention")
    return rows
