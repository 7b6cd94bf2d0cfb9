"""Attention: every position as a weighted sum of the values of the positions it may attend to.

Chapter 5 builds these from first principles:

* :func:`causal_mask` -- the lower-triangular "may attend" mask of a causal language model;
* :func:`scaled_dot_product_attention` -- ``softmax(q kᵀ / √d_k + bias, masked by -inf) v``, written out,
  returning the attention weights as well as the output;
* :class:`KVCache` -- the keys and values of the positions seen so far, for fast generation (chapter 8);
* :class:`MultiHeadAttention` -- learned projections ``W_q, W_k, W_v``, ``n_heads`` heads in parallel,
  concatenation and the output projection ``W_o``; self- and cross-attention, masks, additive biases
  (relative / ALiBi), rotary embeddings and a KV cache.

Masks follow :func:`torch.nn.functional.scaled_dot_product_attention`: a boolean mask with ``True`` where a
query **may** attend to a key (note that :class:`torch.nn.MultiheadAttention` uses the opposite convention).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def causal_mask(n: int, *, n_keys: int | None = None, device=None) -> torch.Tensor:
    """The ``(n, n)`` boolean mask of a causal model: query ``i`` may attend to keys ``j <= i``.

    With ``n_keys`` (at least ``n``), the mask is ``(n, n_keys)`` for ``n`` new queries that come after
    ``n_keys - n`` cached positions: query ``i`` sits at position ``n_keys - n + i`` and may attend to every
    key up to and including that position.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be a positive integer (the sequence length), got {n!r}")
    n_keys = n if n_keys is None else n_keys
    if isinstance(n_keys, bool) or not isinstance(n_keys, int) or n_keys < n:
        raise ValueError(f"n_keys must be an integer >= n = {n}, got {n_keys!r}")
    return torch.ones(n, n_keys, dtype=torch.bool, device=device).tril(diagonal=n_keys - n)


def _check_mask_and_bias(mask, bias, scores_shape: torch.Size) -> None:
    for name, t in (("mask", mask), ("bias", bias)):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor or None, got {type(t).__name__}")
        if name == "mask" and t.dtype != torch.bool:
            raise TypeError(f"mask must be a bool tensor (True = may attend), got dtype {t.dtype}; "
                            "for an additive float mask use bias")
        if name == "bias" and not t.is_floating_point():
            raise TypeError(f"bias must be a floating-point tensor (added to the scores), "
                            f"got dtype {t.dtype}")
        try:
            ok = torch.broadcast_shapes(t.shape, scores_shape) == scores_shape
        except RuntimeError:
            ok = False
        if not ok:
            raise ValueError(f"{name} of shape {tuple(t.shape)} must broadcast to the scores' shape "
                             f"(..., n_q, n_k) = {tuple(scores_shape)}")


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() < 2:
            raise ValueError(f"{name} must have shape (..., seq, dim), got shape {tuple(t.shape)}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k must have the same last dimension d_k, got q {tuple(q.shape)} "
                         f"and k {tuple(k.shape)}")
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(f"k and v must have the same number of positions n_k (dim -2), "
                         f"got k {tuple(k.shape)} and v {tuple(v.shape)}")


def attention_weights(q: torch.Tensor, k: torch.Tensor, *, mask: torch.Tensor | None = None,
                      bias: torch.Tensor | None = None) -> torch.Tensor:
    """``softmax(q kᵀ / √d_k + bias)`` over the keys, with masked entries set to -inf before the softmax.

    Masked weights are exactly 0. A query that may attend to no key at all gets all-zero weights.
    """
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    _check_mask_and_bias(mask, bias, scores.shape)
    if bias is not None:
        scores = scores + bias
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(scores, dim=-1)
    if mask is not None:  # rows with every key masked are 0/0 = nan after the softmax: make them 0
        weights = weights.masked_fill(~mask, 0.0)
    return weights


def scaled_dot_product_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                                 mask: torch.Tensor | None = None,
                                 bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention written out: ``weights = softmax(q kᵀ / √d_k + bias)`` (masked by -inf), ``out = weights v``.

    Shapes: ``q (..., n_q, d_k)``, ``k (..., n_k, d_k)``, ``v (..., n_k, d_v)``; ``mask`` is boolean and
    broadcastable to ``(..., n_q, n_k)`` with ``True`` where the query may attend to the key; ``bias`` is a
    float tensor broadcastable to the same shape, added to the scaled scores. Returns ``(out (..., n_q, d_v),
    weights (..., n_q, n_k))``; masked weights are exactly 0 and every other row sums to 1.
    """
    _check_qkv(q, k, v)
    weights = attention_weights(q, k, mask=mask, bias=bias)
    return weights @ v, weights


class KVCache:
    """The keys and values of every position processed so far, so generation computes each only once.

    ``k`` and ``v`` have shape ``(batch, n_heads, seq_so_far, d_head)`` (``None`` while empty); ``len(cache)``
    is the number of cached positions. :class:`MultiHeadAttention` calls :meth:`append` with the keys and
    values of the new positions and attends over everything returned.
    """

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def __len__(self) -> int:
        return 0 if self.k is None else self.k.shape[-2]

    def reset(self) -> None:
        """Forget every cached position."""
        self.k = None
        self.v = None

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Add the keys/values of new positions (dim -2) and return all cached keys and values."""
        if k.shape != v.shape:
            raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
        if self.k is None:
            self.k, self.v = k, v
        else:
            if k.shape[:-2] != self.k.shape[:-2] or k.shape[-1] != self.k.shape[-1]:
                raise ValueError(f"new keys of shape {tuple(k.shape)} do not match the cached keys of shape "
                                 f"{tuple(self.k.shape)} (batch, n_heads, seq, d_head)")
            self.k = torch.cat([self.k, k], dim=-2)
            self.v = torch.cat([self.v, v], dim=-2)
        return self.k, self.v


class MultiHeadAttention(nn.Module):
    """Multi-head attention: ``W_o · concat(head_1, ..., head_{n_heads})``, each head attending on its own.

    ``W_q``, ``W_k``, ``W_v`` map ``d_model`` to ``n_heads * d_head`` (all heads' projections in one matrix,
    head ``h`` owning rows ``h*d_head:(h+1)*d_head``); ``W_o`` maps the concatenated heads back to
    ``d_model``. ``dropout`` is applied to the attention weights while training.

    Without ``need_weights`` the heads run through PyTorch's fused
    :func:`torch.nn.functional.scaled_dot_product_attention`; with it, through
    :func:`scaled_dot_product_attention` (the written-out version), which also returns the weights. Both
    compute the same function.
    """

    def __init__(self, d_model: int, n_heads: int, *, d_head: int | None = None, bias: bool = True,
                 dropout: float = 0.0):
        super().__init__()
        for name, value in (("d_model", d_model), ("n_heads", n_heads)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if d_head is None:
            if d_model % n_heads:
                raise ValueError(f"d_model = {d_model} is not divisible by n_heads = {n_heads}; choose "
                                 f"n_heads that divides d_model, or give d_head explicitly")
            d_head = d_model // n_heads
        if isinstance(d_head, bool) or not isinstance(d_head, int) or d_head < 1:
            raise ValueError(f"d_head must be a positive integer or None, got {d_head!r}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout!r}")
        self.d_model, self.n_heads, self.d_head, self.dropout = d_model, n_heads, d_head, dropout
        inner = n_heads * d_head
        self.W_q = nn.Linear(d_model, inner, bias=bias)
        self.W_k = nn.Linear(d_model, inner, bias=bias)
        self.W_v = nn.Linear(d_model, inner, bias=bias)
        self.W_o = nn.Linear(inner, d_model, bias=bias)

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, n_heads={self.n_heads}, d_head={self.d_head}, dropout={self.dropout}"

    def _split_heads(self, t: torch.Tensor) -> torch.Tensor:
        """``(batch, seq, n_heads * d_head) -> (batch, n_heads, seq, d_head)``."""
        b, n, _ = t.shape
        return t.view(b, n, self.n_heads, self.d_head).transpose(1, 2)

    def _project(self, x: torch.Tensor, context: torch.Tensor | None, need_kv: bool):
        """Queries from ``x``, keys and values from ``context`` (or ``x``); one fused matmul when possible."""
        if context is None and need_kv:  # self-attention: one (d_model -> 3 * inner) matmul instead of three
            w = torch.cat([self.W_q.weight, self.W_k.weight, self.W_v.weight])
            b = None if self.W_q.bias is None else torch.cat([self.W_q.bias, self.W_k.bias, self.W_v.bias])
            return F.linear(x, w, b).chunk(3, dim=-1)
        q = self.W_q(x)
        if not need_kv:
            return q, None, None
        src = x if context is None else context
        w = torch.cat([self.W_k.weight, self.W_v.weight])
        b = None if self.W_k.bias is None else torch.cat([self.W_k.bias, self.W_v.bias])
        k, v = F.linear(src, w, b).chunk(2, dim=-1)
        return q, k, v

    def _check_input(self, name: str, t, batch: int | None = None) -> None:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 3 or t.shape[-1] != self.d_model:
            raise ValueError(f"{name} must have shape (batch, seq, d_model={self.d_model}), "
                             f"got {tuple(t.shape)}")
        if batch is not None and t.shape[0] != batch:
            raise ValueError(f"{name} must have the same batch size as x ({batch}), got {tuple(t.shape)}")

    def forward(self, x: torch.Tensor, context: torch.Tensor | None = None, *,
                mask: torch.Tensor | None = None, attn_bias: torch.Tensor | None = None, rotary=None,
                positions: torch.Tensor | None = None, cache: KVCache | None = None,
                need_weights: bool = False):
        """Attend from the positions of ``x`` to those of ``context`` (cross-attention) or of ``x`` (self).

        ``x (batch, n_q, d_model)``; ``context (batch, n_k, d_model)``; ``mask`` boolean, broadcastable to
        ``(batch, n_heads, n_q, n_k)``, ``True`` = may attend (pass ``causal_mask(n)`` for a GPT);
        ``attn_bias`` float, broadcastable to the same shape (relative position bias, ALiBi
        ``[n_heads, n_q, n_k]``); ``rotary`` a :class:`groundup.positional.RotaryEmbedding` applied to queries
        and keys at ``positions`` (default ``arange(n_q)`` offset by ``len(cache)``); ``cache`` a
        :class:`KVCache`: in self-attention the new keys/values are appended and the queries attend over every
        cached position (with several new queries, pass ``causal_mask(n_q, n_keys=len(cache) + n_q)``); in
        cross-attention the context's keys/values are computed on the first call and reused afterwards.

        Returns ``out (batch, n_q, d_model)``, or ``(out, weights (batch, n_heads, n_q, n_k))`` with
        ``need_weights=True``.
        """
        self._check_input("x", x)
        batch, n_q, _ = x.shape
        cross_cached = cache is not None and context is not None and len(cache) > 0
        if context is not None:
            self._check_input("context", context, batch)
        q, k, v = self._project(x, context, need_kv=not cross_cached)
        q = self._split_heads(q)
        if k is not None:
            k, v = self._split_heads(k), self._split_heads(v)
        if rotary is not None:
            if context is not None:
                raise ValueError("rotary embeddings are for self-attention; got a context (cross-attention)")
            if positions is None:
                start = 0 if cache is None else len(cache)
                positions = torch.arange(start, start + n_q, device=x.device)
            if positions.shape != (n_q,):
                raise ValueError(f"positions must have shape (n_q,) = ({n_q},), got {tuple(positions.shape)}")
            q, k = rotary.apply_rotary(q, positions), rotary.apply_rotary(k, positions)
        if cache is not None:
            if cross_cached:
                k, v = cache.k, cache.v
            else:
                k, v = cache.append(k, v)
        if need_weights:
            weights = attention_weights(q, k, mask=mask, bias=attn_bias)
            dropped = F.dropout(weights, self.dropout) if self.training and self.dropout > 0 else weights
            heads = dropped @ v
        else:
            heads = self._fused_attention(q, k, v, mask, attn_bias)
        out = self.W_o(heads.transpose(1, 2).reshape(batch, n_q, self.n_heads * self.d_head))
        return (out, weights) if need_weights else out

    def _fused_attention(self, q, k, v, mask, attn_bias) -> torch.Tensor:
        """The same attention through PyTorch's fused kernel (no weights are materialised for the caller)."""
        scores_shape = torch.Size((q.shape[0], self.n_heads, q.shape[-2], k.shape[-2]))
        _check_mask_and_bias(mask, attn_bias, scores_shape)
        if attn_bias is not None:
            attn_mask = attn_bias.to(q.dtype)
            if mask is not None:
                attn_mask = attn_mask.masked_fill(~mask, float("-inf"))
        else:
            attn_mask = mask
        dropout_p = self.dropout if self.training else 0.0
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p)
