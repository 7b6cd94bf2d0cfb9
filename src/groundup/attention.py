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

import contextlib
import math
import numbers

import torch
import torch.nn.functional as F
from torch import nn

from groundup.linear import Linear, linear
from groundup.norms import RMSNorm
from groundup.utils import positive_int, version_counter

_HALF_DTYPES = (torch.float16, torch.bfloat16)


def causal_mask(n: int, *, n_keys: int | None = None, device=None) -> torch.Tensor:
    """The ``(n, n)`` boolean mask of a causal model: query ``i`` may attend to keys ``j <= i``.

    With ``n_keys`` (at least ``n``), the mask is ``(n, n_keys)`` for ``n`` new queries that come after
    ``n_keys - n`` cached positions: query ``i`` sits at position ``n_keys - n + i`` and may attend to every
    key up to and including that position.
    """
    if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 1:
        raise ValueError(f"n must be a positive integer (the sequence length), got {n!r}")
    n = int(n)
    n_keys = n if n_keys is None else n_keys
    if isinstance(n_keys, bool) or not isinstance(n_keys, numbers.Integral) or n_keys < n:
        raise ValueError(f"n_keys must be an integer >= n = {n}, got {n_keys!r}")
    return torch.ones(n, int(n_keys), dtype=torch.bool, device=device).tril(diagonal=n_keys - n)


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

    Masked weights are exactly 0. A query that may attend to no key at all (every key masked, or a bias of -inf
    on every key) gets all-zero weights, as in PyTorch's fused kernel.

    In float16/bfloat16 the scores are computed in float32, with the 1/√d_k scale applied *before* the product
    (as PyTorch does): a half-precision q·k overflows to inf (then nan) already for entries of size ~100.
    The weights are returned in the dtype of ``q``. float32 and float64 follow the formula exactly as written.
    """
    if q.dtype in _HALF_DTYPES:
        scores = (q.float() / math.sqrt(q.shape[-1])) @ k.float().transpose(-2, -1)
    else:
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    _check_mask_and_bias(mask, bias, scores.shape)
    if bias is not None:
        scores = scores + bias
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    dead = None
    if bias is not None:
        # A row whose bias is -inf on every key (that the mask leaves) would be 0/0 = nan after the softmax: give
        # it all-zero weights, the fused kernel's result. Zeroing its scores first keeps the gradients finite.
        dead = (scores == float("-inf")).all(dim=-1, keepdim=True)
        scores = scores.masked_fill(dead, 0.0)
    weights = torch.softmax(scores, dim=-1)
    if mask is not None:  # rows with every key masked are 0/0 = nan after the softmax: make them 0
        weights = weights.masked_fill(~mask, 0.0)
    if dead is not None:
        weights = weights.masked_fill(dead, 0.0)
    return weights.to(q.dtype)


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

    In cross-attention the cache holds the keys and values of one ``context`` (:meth:`set_context`); ``context``
    remembers which tensor they came from, so that a different context is never answered from the old one.
    """

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.context: torch.Tensor | None = None  # the cross-attention context k and v were computed from
        self._context_version: int | None = None

    def __len__(self) -> int:
        return 0 if self.k is None else self.k.shape[-2]

    def reset(self) -> None:
        """Forget every cached position."""
        self.k = None
        self.v = None
        self.context = None
        self._context_version = None

    def holds(self, context: torch.Tensor) -> bool:
        """Whether the cached keys/values are those of this very ``context`` tensor (unchanged since)."""
        return self.k is not None and self.context is context and self._context_version == version_counter(context)

    def set_context(self, context: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Replace the cache by the keys/values ``k``, ``v`` of a cross-attention ``context``."""
        if k.shape != v.shape:
            raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
        self.k, self.v = k, v
        self.context, self._context_version = context, version_counter(context)

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Add the keys/values of new positions (dim -2) and return all cached keys and values."""
        if k.shape != v.shape:
            raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
        if self.context is not None:
            raise ValueError("this KVCache holds the keys and values of a cross-attention context; use a separate "
                             "KVCache for self-attention (or reset() it first)")
        if self.k is None:
            self.k, self.v = k, v
        else:
            if k.shape[:-2] != self.k.shape[:-2] or k.shape[-1] != self.k.shape[-1]:
                raise ValueError(f"new keys of shape {tuple(k.shape)} do not match the cached keys of shape "
                                 f"{tuple(self.k.shape)} (batch, n_heads, seq, d_head)")
            self.k = torch.cat([self.k, k], dim=-2)
            self.v = torch.cat([self.v, v], dim=-2)
        return self.k, self.v


def _sdpa_has_gqa() -> bool:
    import inspect

    try:
        return "enable_gqa" in inspect.signature(F.scaled_dot_product_attention).parameters
    except (TypeError, ValueError):  # a builtin without a signature: try it
        try:
            t = torch.zeros(1, 2, 1, 1)
            F.scaled_dot_product_attention(t, t[:, :1], t[:, :1], enable_gqa=True)
            return True
        except TypeError:
            return False


_SDPA_HAS_GQA = _sdpa_has_gqa()

#: The layer types attention stacks into one matmul (a subclass, e.g. with hooks of its own, computes alone).
FUSABLE = (nn.Linear, Linear)


class _Reuse:
    """Which :func:`reusing_stacked_weights` block is open: 0 for none, else a number no earlier block had."""

    epoch = 0
    opened = 0


_REUSE = _Reuse()


@contextlib.contextmanager
def reusing_stacked_weights():
    """Within this block, attention layers stack W_Q, W_K, W_V once and reuse the stacked copy (inference only).

    ``generate`` runs its loop inside one, so a decode step does not concatenate the three weight matrices anew
    for every token. The weights must not change inside the block except by edits that bump their version
    counters; each block starts afresh, so nothing kept in one is used in another.
    """
    outer = _REUSE.epoch
    _REUSE.opened += 1
    _REUSE.epoch = _REUSE.opened
    try:
        yield
    finally:
        _REUSE.epoch = outer


def _stack(layers) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The weights of linear ``layers`` stacked along the output dimension, and their biases (or None)."""
    weight = torch.cat([layer.weight for layer in layers])
    return weight, None if layers[0].bias is None else torch.cat([layer.bias for layer in layers])


class MultiHeadAttention(nn.Module):
    """Multi-head attention: ``W_o · concat(head_1, ..., head_{n_heads})``, each head attending on its own.

    ``W_q``, ``W_k``, ``W_v`` map ``d_model`` to ``n_heads * d_head`` (all heads' projections in one matrix,
    head ``h`` owning rows ``h*d_head:(h+1)*d_head``); ``W_o`` maps the concatenated heads back to
    ``d_model``. ``dropout`` is applied to the attention weights while training.

    Without ``need_weights`` the heads run through PyTorch's fused
    :func:`torch.nn.functional.scaled_dot_product_attention`; with it, through
    :func:`scaled_dot_product_attention` (the written-out version), which also returns the weights. Both
    compute the same function.

    ``n_kv_heads`` (grouped-query attention, Ainslie et al. 2023): ``W_k`` and ``W_v`` produce only
    ``n_kv_heads`` heads (``n_kv_heads`` must divide ``n_heads``); query head ``h`` uses key/value head
    ``h // (n_heads // n_kv_heads)``. ``n_kv_heads=1`` is multi-query attention (Shazeer 2019); ``None`` means
    ``n_heads`` (ordinary multi-head attention). A :class:`KVCache` then stores only the ``n_kv_heads`` heads,
    which is the memory saving. ``qk_norm=True`` applies an RMSNorm over ``d_head`` (one learned γ shared by
    the heads, ``q_norm`` and ``k_norm``) to every query and key head, before the rotary embedding.
    """

    def __init__(self, d_model: int, n_heads: int, *, d_head: int | None = None, bias: bool = True,
                 dropout: float = 0.0, n_kv_heads: int | None = None, qk_norm: bool = False,
                 norm_eps: float = 1e-6):
        super().__init__()
        d_model, n_heads = positive_int("d_model", d_model), positive_int("n_heads", n_heads)
        if d_head is None:
            if d_model % n_heads:
                raise ValueError(f"d_model = {d_model} is not divisible by n_heads = {n_heads}; choose "
                                 f"n_heads that divides d_model, or give d_head explicitly")
            d_head = d_model // n_heads
        if isinstance(d_head, bool) or not isinstance(d_head, numbers.Integral) or d_head < 1:
            raise ValueError(f"d_head must be a positive integer or None, got {d_head!r}")
        d_head = int(d_head)
        if isinstance(dropout, bool) or not isinstance(dropout, numbers.Real):
            raise TypeError(f"dropout must be a number in [0, 1) (a probability), got {type(dropout).__name__} "
                            f"{dropout!r}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout!r}")
        if n_kv_heads is None:
            n_kv_heads = n_heads
        n_kv_heads = positive_int("n_kv_heads", n_kv_heads)
        if n_heads % n_kv_heads:
            raise ValueError(f"n_kv_heads = {n_kv_heads} must divide n_heads = {n_heads} (each key/value head "
                             f"serves a group of n_heads / n_kv_heads query heads)")
        if not isinstance(bias, bool):
            raise TypeError(f"bias must be True or False, got {bias!r}")
        if not isinstance(qk_norm, bool):
            raise TypeError(f"qk_norm must be True or False, got {qk_norm!r}")
        self.d_model, self.n_heads, self.d_head, self.dropout = d_model, n_heads, d_head, dropout
        self.n_kv_heads, self.qk_norm = n_kv_heads, qk_norm
        inner, inner_kv = n_heads * d_head, n_kv_heads * d_head
        self.W_q = Linear(d_model, inner, bias=bias)
        self.W_k = Linear(d_model, inner_kv, bias=bias)
        self.W_v = Linear(d_model, inner_kv, bias=bias)
        self.W_o = Linear(inner, d_model, bias=bias)
        if qk_norm:
            self.q_norm = RMSNorm(d_head, eps=norm_eps)
            self.k_norm = RMSNorm(d_head, eps=norm_eps)

    def extra_repr(self) -> str:
        extra = "" if self.n_kv_heads == self.n_heads else f", n_kv_heads={self.n_kv_heads}"
        extra += ", qk_norm=True" if self.qk_norm else ""
        return (f"d_model={self.d_model}, n_heads={self.n_heads}, d_head={self.d_head}, dropout={self.dropout}"
                f"{extra}")

    def _split_heads(self, t: torch.Tensor, n_heads: int | None = None) -> torch.Tensor:
        """``(batch, seq, n_heads * d_head) -> (batch, n_heads, seq, d_head)``."""
        b, n, _ = t.shape
        return t.view(b, n, self.n_heads if n_heads is None else n_heads, self.d_head).transpose(1, 2)

    def _expand_kv(self, t: torch.Tensor) -> torch.Tensor:
        """Repeat each of the ``n_kv_heads`` key/value heads for its group of query heads."""
        group = self.n_heads // self.n_kv_heads
        return t if group == 1 else t.repeat_interleave(group, dim=-3)

    def _project(self, x: torch.Tensor, context: torch.Tensor | None, need_kv: bool):
        """Queries from ``x``, keys and values from ``context`` (or ``x``); one fused matmul when possible."""
        if context is None and need_kv and self._fusable(("W_q", "W_k", "W_v")):  # one matmul instead of three
            w, b = self._stacked_weights(("W_q", "W_k", "W_v"))
            inner, inner_kv = self.n_heads * self.d_head, self.n_kv_heads * self.d_head
            return linear(x, w, b).split([inner, inner_kv, inner_kv], dim=-1)
        q = self.W_q(x)
        if not need_kv:
            return q, None, None
        if not self._fusable(("W_k", "W_v")):  # e.g. LoRA adapters (groundup.lora): each layer computes itself
            source = x if context is None else context
            return q, self.W_k(source), self.W_v(source)
        w, b = self._stacked_weights(("W_k", "W_v"))
        k, v = linear(x if context is None else context, w, b).chunk(2, dim=-1)
        return q, k, v

    def _fusable(self, names: tuple[str, ...]) -> bool:
        """Whether the layers ``names`` are plain linear layers, whose weights may be stacked into one matmul."""
        return all(type(getattr(self, name)) in FUSABLE for name in names)

    def _stacked_weights(self, names: tuple[str, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The weights (and biases) of the layers ``names`` stacked into one matrix (and one vector).

        Stacked anew on every call, except inside :func:`reusing_stacked_weights` (which ``generate`` enters),
        where autograd does not record the weights: there the stacked copy is made once and reused until the
        context ends or a weight changes (replaced, moved, converted, or edited in place with a version-counter
        bump). The reuse is tied to one ``with`` block because a tensor's version counter does not see every
        edit: the fused AdamW step (``fused=True``, what ``train`` uses) updates the weights in place without
        bumping it, and ``.data`` edits bypass it too, so a copy kept across an optimizer step would be stale.
        """
        layers = [getattr(self, name) for name in names]
        tensors = [layer.weight for layer in layers] + [layer.bias for layer in layers if layer.bias is not None]
        if not _REUSE.epoch or (torch.is_grad_enabled() and any(t.requires_grad for t in tensors)):
            return _stack(layers)
        stamp = [_REUSE.epoch] + [(t.data_ptr(), version_counter(t)) for t in tensors]
        cached = self.__dict__.setdefault("_stacked", {}).get(names)
        if cached is not None and len(cached[0]) == len(tensors) and all(
                a is t for a, t in zip(cached[0], tensors, strict=True)) and cached[1] == stamp:
            return cached[2]
        with torch.inference_mode(False), torch.no_grad():  # a plain tensor, usable outside inference mode too
            stacked = _stack(layers)
        self._stacked[names] = (tensors, stamp, stacked)
        return stacked

    def clear_stacked_weights(self) -> None:
        """Forget the stacked projection weights kept for inference (see :meth:`_stacked_weights`)."""
        self.__dict__.get("_stacked", {}).clear()

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
                need_weights: bool = False, is_causal: bool = False):
        """Attend from the positions of ``x`` to those of ``context`` (cross-attention) or of ``x`` (self).

        ``x (batch, n_q, d_model)``; ``context (batch, n_k, d_model)``; ``mask`` boolean, ``True`` = may attend,
        of shape ``(n_q, n_k)`` (the same for every example and head; pass ``causal_mask(n)`` for a GPT) or 4-D,
        broadcastable to ``(batch, n_heads, n_q, n_k)``: ``(batch, 1, n_q, n_k)`` per example (padding),
        ``(1, n_heads, n_q, n_k)`` per head. A 3-D mask ``(m, n_q, n_k)`` with ``m > 1`` is refused: broadcasting
        would read ``m`` as heads, silently, even when the caller meant examples (when batch == n_heads).
        ``attn_bias`` float, broadcastable to the same shape; a 3-D ``attn_bias`` is always per head,
        ``[n_heads, n_q, n_k]`` (relative position bias, ALiBi); a per-example bias must be 4-D
        ``(batch, 1, n_q, n_k)``. ``rotary`` a :class:`groundup.positional.RotaryEmbedding` applied to queries
        and keys at ``positions`` (default ``arange(n_q)`` offset by ``len(cache)``; ``(batch, n_q)`` gives each
        example its own, as for left-padded prompts); ``cache`` a
        :class:`KVCache`: in self-attention the new keys/values are appended and the queries attend over every
        cached position (with several new queries, pass ``causal_mask(n_q, n_keys=len(cache) + n_q)``); in
        cross-attention the context's keys/values are computed on the first call and reused while the same
        context tensor is passed; a different context (another tensor, or this one changed in place) replaces
        them.

        ``is_causal=True`` adds the causal mask, ``causal_mask(n_q, n_keys=n_k)`` (the last query sees every
        key, the cache's included), to ``mask`` if one is given. It computes the same as passing that mask, but
        without a cache and without ``attn_bias`` the fused kernel then skips the masked blocks instead of
        reading a mask (faster, and no ``n_q x n_k`` mask in memory; chapter 5 measures it).

        Returns ``out (batch, n_q, d_model)``, or ``(out, weights (batch, n_heads, n_q, n_k))`` with
        ``need_weights=True``.
        """
        self._check_input("x", x)
        batch, n_q, _ = x.shape
        if isinstance(mask, torch.Tensor) and mask.dim() == 3 and mask.shape[0] != 1:
            raise ValueError(f"mask of shape {tuple(mask.shape)} is ambiguous: a 3-D mask would apply per head. "
                             f"Pass (batch, 1, n_q, n_k) for one mask per example, (1, n_heads, n_q, n_k) for one "
                             f"per head, or (n_q, n_k) for all")
        if cache is not None and not isinstance(cache, KVCache):
            raise TypeError(f"cache must be a KVCache or None, got {type(cache).__name__}")
        if not isinstance(is_causal, bool):
            raise TypeError(f"is_causal must be True or False, got {is_causal!r}")
        if context is not None:
            self._check_input("context", context, batch)
            if cache is not None and cache.context is None and len(cache) > 0:
                raise ValueError("this KVCache holds self-attention keys and values; use a separate KVCache for "
                                 "cross-attention")
        cross_cached = cache is not None and context is not None and cache.holds(context)
        try:
            q, k, v = self._project(x, context, need_kv=not cross_cached)
        except RuntimeError as err:
            for name, t in (("x", x), ("context", context)):
                if t is not None and t.dtype != self.W_q.weight.dtype:
                    raise TypeError(f"{name} has dtype {t.dtype} but the attention's weights are "
                                    f"{self.W_q.weight.dtype}; convert one to the other (e.g. x.to("
                                    f"{self.W_q.weight.dtype}) or module.to({t.dtype}))") from err
            raise
        q = self._split_heads(q)
        if k is not None:
            k, v = self._split_heads(k, self.n_kv_heads), self._split_heads(v, self.n_kv_heads)
        if self.qk_norm:
            q = self.q_norm(q)
            if k is not None:
                k = self.k_norm(k)
        if rotary is not None:
            if context is not None:
                raise ValueError("rotary embeddings are for self-attention; got a context (cross-attention)")
            if positions is None:
                start = 0 if cache is None else len(cache)
                positions = torch.arange(start, start + n_q, device=x.device)
            if positions.shape not in ((n_q,), (batch, n_q)):
                raise ValueError(f"positions must have shape (n_q,) = ({n_q},) or (batch, n_q) = ({batch}, {n_q}), "
                                 f"got {tuple(positions.shape)}")
            q, k = rotary.apply_rotary(q, positions), rotary.apply_rotary(k, positions)
        if cache is not None:
            if cross_cached:
                k, v = cache.k, cache.v
            elif context is not None:
                cache.set_context(context, k, v)  # first call, or a new context: never attend over an old one
            else:
                k, v = cache.append(k, v)
        causal_kernel = is_causal and mask is None and attn_bias is None and not need_weights \
            and q.shape[-2] == k.shape[-2]  # the fused kernel's own causal mask (aligned at the first key)
        if is_causal and not causal_kernel and q.shape[-2] > 1:  # one query, the newest, sees every key
            causal = causal_mask(q.shape[-2], n_keys=k.shape[-2], device=q.device)
            mask = causal if mask is None else mask & causal
        if need_weights:
            k, v = self._expand_kv(k), self._expand_kv(v)
            weights = attention_weights(q, k, mask=mask, bias=attn_bias)
            dropped = F.dropout(weights, self.dropout) if self.training and self.dropout > 0 else weights
            heads = dropped @ v
        else:
            heads = self._fused_attention(q, k, v, mask, attn_bias, causal_kernel)
        out = self.W_o(heads.transpose(1, 2).reshape(batch, n_q, self.n_heads * self.d_head))
        return (out, weights) if need_weights else out

    def _fused_attention(self, q, k, v, mask, attn_bias, is_causal=False) -> torch.Tensor:
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
        if self.n_kv_heads != self.n_heads:
            if _SDPA_HAS_GQA:
                return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p,
                                                      is_causal=is_causal, enable_gqa=True)
            k, v = self._expand_kv(k), self._expand_kv(v)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal)
