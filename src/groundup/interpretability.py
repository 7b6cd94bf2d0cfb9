"""Looking inside a trained transformer (chapter 14), with PyTorch's own forward hooks on the book's modules.

Every tool here attaches ``register_forward_hook`` / ``register_forward_pre_hook`` to the modules of a
:class:`~groundup.models.GPT` (its ``blocks``, each block's ``attention`` and that attention's ``W_o``) and
removes them when it is done, also on an error:

* **reading**: :func:`attention_patterns` (every head's attention weights), :func:`residual_stream` (the stream
  after the embedding and after every block), :func:`head_outputs` (each head's output before ``W_o``);
* **the logit lens** (nostalgebraist 2020): :func:`logit_lens` decodes the stream after every block with the
  final norm and the unembedding; :func:`direct_logit_attribution` splits a logit into what each head, each
  block's rest and the embeddings write into it (the final norm's divisor frozen);
* **head scores** on attention patterns: :func:`previous_token_scores`, :func:`induction_scores`; and on the
  weights: :func:`copying_scores` (from :func:`copying_ranks`), :func:`ov_eigenvalue_scores`,
  :func:`composition_scores` (Elhage et al. 2021);
* **interventions**: :func:`ablate_heads` (zero or mean ablation, a context manager), :func:`remove_from_inputs`
  (some heads' output taken out of what a later block's queries, keys or values read, or one head's of it:
  composition tested by an intervention), :func:`patch_residual` (a context manager) and
  :func:`residual_patching` (activation patching per layer and position, Meng et al. 2022; Wang et al. 2022; also
  per example), with :func:`logit_difference` as the metric.

Layers and heads count from 0 in code: "layer 1" of the prose is ``layer=0``. The stream index ``layer`` runs
over ``0 .. n_layers``: 0 is the input of block 0 (the embeddings), ``l`` the output of block ``l - 1``.

Weight-based scores read the matrices of one head, in PyTorch's convention (``W_q.weight`` is
``[n_heads * d_head, d_model]``, head ``h`` owns rows ``h d_head .. (h+1) d_head - 1``; ``W_o.weight`` is
``[d_model, n_heads * d_head]``, head ``h`` owns those columns; with grouped-query attention query head ``h``
reads key/value head ``h // (n_heads / n_kv_heads)``):

    W_OV^h = W_O^h W_V^h N        (d_model x d_model: what head h writes, given what it reads)
    W_QK^h = (W_Q^h N)ᵀ (W_K^h N) (d_model x d_model: score = x_iᵀ W_QK^h x_j / √d_head)

where ``N`` is the linear part of the block's first norm (Pre-LN): ``diag(γ)`` for RMSNorm, ``diag(γ) (I - 11ᵀ/d)``
for LayerNorm; the division by the RMS (a positive factor per position) and all biases are left out. With RoPE
the true score also rotates queries and keys by position: the unrotated ``W_QK`` is then an approximation.
"""

from __future__ import annotations

import contextlib
import numbers
from collections.abc import Iterable, Sequence

import torch
from torch import nn

from groundup.attention import KVCache
from groundup.layers import LayerNorm, RMSNorm
from groundup.models import GPT
from groundup.utils import positive_int

ABLATIONS = ("zero", "mean")
COMPOSITIONS = ("q", "k", "v")


# ---------------------------------------------------------------------------------------------------------------
# checks and small helpers


def _check_model(model) -> GPT:
    if not isinstance(model, GPT):
        raise TypeError(f"model must be a groundup.models.GPT, got {type(model).__name__}")
    return model


def _check_layer(model: GPT, layer, *, stream: bool = False, name: str = "layer") -> int:
    n = model.config.n_layers + (1 if stream else 0)
    if isinstance(layer, bool) or not isinstance(layer, numbers.Integral) or not 0 <= layer < n:
        what = "stream index (0 = embeddings, l = after block l-1)" if stream else "block index"
        raise ValueError(f"{name} must be a {what} in 0 .. {n - 1}, got {layer!r}")
    return int(layer)


def _check_head(model: GPT, head, name: str = "head") -> int:
    n = model.config.n_heads
    if isinstance(head, bool) or not isinstance(head, numbers.Integral) or not 0 <= head < n:
        raise ValueError(f"{name} must be a head index in 0 .. {n - 1}, got {head!r}")
    return int(head)


@contextlib.contextmanager
def _hooks():
    """Collect hook handles; remove them all on exit (also on an error)."""
    handles: list = []
    try:
        yield handles
    finally:
        for handle in handles:
            handle.remove()


@contextlib.contextmanager
def _inspecting(model: nn.Module):
    """Eval mode (no dropout) and no gradients; the model's mode is restored on exit."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(was_training)


def _weight(layer: nn.Module) -> torch.Tensor:
    """The weight of an ``nn.Linear`` (or of the frozen base of a LoRA layer: the adapters are left out)."""
    return (layer.base if hasattr(layer, "base") else layer).weight.detach()


# ---------------------------------------------------------------------------------------------------------------
# reading activations


@contextlib.contextmanager
def recording_attention(model: GPT, layers: Iterable[int] | None = None):
    """A context manager that records attention weights: yields a dict ``{layer: weights}`` that every forward
    pass inside the ``with`` block fills with ``(batch, n_heads, n_q, n_k)`` tensors (the last pass wins).

    A forward pre-hook on each block's ``attention`` adds ``need_weights=True`` to its call and a forward hook
    takes the weights out of the returned ``(out, weights)``, so the block sees its usual output. The attention
    then runs the written-out softmax instead of PyTorch's fused kernel: the same values up to float rounding.
    """
    _check_model(model)
    chosen = range(model.config.n_layers) if layers is None else [_check_layer(model, i) for i in layers]
    recorded: dict[int, torch.Tensor] = {}

    def pre(module, args, kwargs):
        return args, {**kwargs, "need_weights": True}

    def make_post(layer):
        def post(module, args, output):
            out, weights = output
            recorded[layer] = weights.detach()
            return out
        return post

    with _hooks() as handles:
        for layer in chosen:
            attention = model.blocks[layer].attention
            handles.append(attention.register_forward_pre_hook(pre, with_kwargs=True))
            handles.append(attention.register_forward_hook(make_post(layer)))
        yield recorded


def attention_patterns(model: GPT, idx: torch.Tensor) -> list[torch.Tensor]:
    """Every layer's attention weights for token ids ``idx (batch, seq)``: a list of ``n_layers`` tensors
    ``(batch, n_heads, seq, seq)``; entry ``[b, h, i, j]`` is how much position ``i`` attends to ``j``.

    Eval mode, no gradients (see :func:`recording_attention`).
    """
    with _inspecting(_check_model(model)), recording_attention(model) as recorded:
        model(idx)
    return [recorded[i] for i in range(model.config.n_layers)]


def _record(model: GPT, idx: torch.Tensor, *, stream: bool, heads: bool):
    """One forward pass that records the residual stream and / or each head's output (the hooks of
    :func:`residual_stream` and :func:`head_outputs`), in eval mode without gradients."""
    _check_model(model)
    c = model.config
    entries: dict[int, torch.Tensor] = {}
    outputs: dict[int, torch.Tensor] = {}

    def first(module, args):
        entries[0] = args[0].detach()

    def make_after(layer):
        def after(module, args, output):
            entries[layer + 1] = output.detach()
        return after

    def make_pre(layer):
        def pre(module, args):
            x = args[0]
            outputs[layer] = x.detach().reshape(*x.shape[:-1], c.n_heads, x.shape[-1] // c.n_heads)
        return pre

    with _inspecting(model), _hooks() as handles:
        if stream:
            handles.append(model.blocks[0].register_forward_pre_hook(first))
        for layer, block in enumerate(model.blocks):
            if stream:
                handles.append(block.register_forward_hook(make_after(layer)))
            if heads:
                handles.append(block.attention.W_o.register_forward_pre_hook(make_pre(layer)))
        model(idx)
    return ([entries[i] for i in range(c.n_layers + 1)] if stream else None,
            [outputs[i] for i in range(c.n_layers)] if heads else None)


def residual_stream(model: GPT, idx: torch.Tensor) -> list[torch.Tensor]:
    """The residual stream for token ids ``idx (batch, seq)``: ``n_layers + 1`` tensors ``(batch, seq, d_model)``.

    Entry 0 is the input of the first block (token embedding plus positional embedding), entry ``l`` the output
    of block ``l - 1``; the last is what the final norm and the unembedding turn into the logits. Read by a
    forward pre-hook on block 0 and a forward hook on every block. Eval mode, no gradients.
    """
    return _record(model, idx, stream=True, heads=False)[0]


def head_outputs(model: GPT, idx: torch.Tensor) -> list[torch.Tensor]:
    """Each head's output before the output projection, per layer: ``n_layers`` tensors
    ``(batch, seq, n_heads, d_head)``.

    A forward pre-hook on every ``attention.W_o`` reads its input, the heads concatenated: block ``l``'s
    attention output is ``W_o(out.flatten(-2))``, so head ``h`` contributes ``W_O^h out[..., h, :]`` (plus its
    share of nothing: the bias ``b_O`` belongs to no head). Eval mode, no gradients.
    """
    return _record(model, idx, stream=False, heads=True)[1]


def mean_head_outputs(model: GPT, idx: torch.Tensor, *, per_position: bool = False) -> list[torch.Tensor]:
    """The mean of :func:`head_outputs` over a reference batch ``idx``, for mean ablation (:func:`ablate_heads`).

    One tensor per layer: ``(n_heads, d_head)``, averaged over the batch and the positions, or with
    ``per_position=True`` ``(seq, n_heads, d_head)``, averaged over the batch only (then the ablated runs must
    have the reference's length).
    """
    if not isinstance(per_position, bool):
        raise TypeError(f"per_position must be True or False, got {per_position!r}")
    dims = (0,) if per_position else (0, 1)
    return [out.mean(dim=dims) for out in head_outputs(model, idx)]


# ---------------------------------------------------------------------------------------------------------------
# the logit lens


def logit_lens(model: GPT, idx: torch.Tensor, *, positions: Sequence[int] | int | None = None) -> torch.Tensor:
    """The logit lens: decode the residual stream after every block as if it were the last.

    ``lens[l] = unembedding(final_norm(x^(l)))`` for the stream entries ``x^(0..n_layers)`` of
    :func:`residual_stream`, shape ``(n_layers + 1, batch, len(positions), vocab_size)``. The last entry is the
    model's own logits (bit for bit with all positions; with a few, up to rounding, as ``GPT``'s ``last_only``:
    2e-5 on SmolLM2). ``positions`` (an index or a list; None: all) keeps only those positions before
    unembedding, which saves memory for a large vocabulary (SmolLM2: 49,152 logits a position and layer).
    Softmax it for probabilities, or take ``argmax(-1)`` for each layer's top prediction.
    """
    stream = residual_stream(model, idx)
    if positions is not None:
        index = [positions] if isinstance(positions, numbers.Integral) else list(positions)
        seq = stream[0].shape[1]
        for p in index:
            if isinstance(p, bool) or not isinstance(p, numbers.Integral) or not -seq <= p < seq:
                raise ValueError(f"positions must be indices into the sequence (length {seq}), got {positions!r}")
        stream = [x[:, index] for x in stream]
    with _inspecting(model):
        return torch.stack([model.unembedding(model.final_norm(x)) for x in stream])


def _final_scale(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The final norm's division, per position ``(batch, seq, 1)``: 1 / RMS (RMSNorm), 1 / std (LayerNorm)."""
    if isinstance(norm, RMSNorm):
        return torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps)
    if isinstance(norm, LayerNorm):
        return torch.rsqrt(x.var(-1, unbiased=False, keepdim=True) + norm.eps)
    return torch.ones_like(x[..., :1])


def direct_logit_attribution(model: GPT, idx: torch.Tensor, targets: torch.Tensor, *,
                             centred: bool = False) -> dict[str, torch.Tensor]:
    """Direct logit attribution: how much each part of the model writes, straight through the final norm and the
    unembedding, into the logit of ``targets`` (token ids, same shape as ``idx``, one a position).

    The final stream is a sum, ``x^(n_L) = x^(0) + Σ_l (Σ_h W_O^h z^h_l + r_l)``: the embeddings, every head's
    output (:func:`head_outputs`) and the rest of each block ``r_l`` (its FFN's output and ``W_o``'s bias).
    The final norm is *not* linear: it divides by the RMS (RMSNorm) or the standard deviation (LayerNorm) of
    ``x^(n_L)``. Here that divisor is **frozen**: taken from this run, one number per position, and applied to
    every part; with it fixed, ``logit_t = u_tᵀ N_f x^(n_L) / σ + const`` is linear, so the parts add up to the
    model's logit exactly (up to rounding). What a part would contribute *if it were removed* is a different
    question (removing it changes σ and everything downstream): for that, ablate it.

    Returns ``{"embedding": (batch, seq), "heads": (n_layers, n_heads, batch, seq), "rest": (n_layers, batch,
    seq), "bias": (batch, seq)}`` (``bias``: the final LayerNorm's β and the unembedding's bias, 0 without
    them); their sum is ``logits[b, i, targets[b, i]]``. ``centred=True`` attributes the logit minus the mean
    of all the position's logits instead (``u_t`` replaced by ``u_t - mean_s u_s``): a part that raises every
    logit alike changes no probability, and then scores 0. One forward pass; needs Pre-LN blocks.
    """
    _check_model(model)
    if model.config.norm_position != "pre":
        raise ValueError("direct_logit_attribution needs Pre-LN blocks (norm_position='pre'): a Post-LN block "
                         "normalises the stream itself, so it is no sum of the parts' outputs")
    if not isinstance(centred, bool):
        raise TypeError(f"centred must be True or False, got {centred!r}")
    if not isinstance(targets, torch.Tensor) or not isinstance(idx, torch.Tensor) or targets.shape != idx.shape:
        raise ValueError(f"targets must be a tensor of token ids shaped like idx {tuple(getattr(idx, 'shape', ()))}"
                         f", got {getattr(targets, 'shape', type(targets).__name__)}")
    v = model.config.vocab_size
    if targets.is_floating_point() or targets.dtype == torch.bool or int(targets.min()) < 0 \
            or int(targets.max()) >= v:
        raise ValueError(f"targets must hold token ids in 0 .. {v - 1}")
    stream, outputs = _record(model, idx, stream=True, heads=True)
    u = _weight(model.unembedding).float()
    rows = u[targets.long()]  # (batch, seq, d_model)
    bias = torch.zeros(targets.shape)
    if getattr(model.unembedding, "bias", None) is not None:
        b = model.unembedding.bias.detach().float()
        bias = bias + (b[targets.long()] - (b.mean() if centred else 0.0))
    if centred:
        rows = rows - u.mean(0)
    if isinstance(model.final_norm, LayerNorm) and model.final_norm.bias is not None:
        bias = bias + rows @ model.final_norm.bias.detach().float()
    # logit per unit of the stream at each position: σ-frozen u_tᵀ N_f
    read = (rows @ _norm_map(model.final_norm, model.config.d_model, u)) * _final_scale(
        model.final_norm, stream[-1].float())
    heads, rest = [], []
    for layer, block in enumerate(model.blocks):
        w_o = _weight(block.attention.W_o).float()  # (d_model, n_heads * d_head)
        z = outputs[layer].float()  # (batch, seq, n_heads, d_head)
        per_head = (read @ w_o).reshape(z.shape) * z  # u_tᵀ N_f W_O^h z^h / σ, summed over d_head below
        heads.append(per_head.sum(-1).permute(2, 0, 1))
        written = (z.flatten(-2) @ w_o.T).float()
        rest.append(((stream[layer + 1].float() - stream[layer].float() - written) * read).sum(-1))
    return {"embedding": (stream[0].float() * read).sum(-1), "heads": torch.stack(heads),
            "rest": torch.stack(rest), "bias": bias}


# ---------------------------------------------------------------------------------------------------------------
# scores from attention patterns


def _check_pattern(pattern) -> torch.Tensor:
    if not isinstance(pattern, torch.Tensor) or not pattern.is_floating_point():
        raise TypeError(f"pattern must be a float torch.Tensor of attention weights, got "
                        f"{pattern.dtype if isinstance(pattern, torch.Tensor) else type(pattern).__name__}")
    if pattern.dim() == 3:
        pattern = pattern[None]
    if pattern.dim() != 4 or pattern.shape[-1] != pattern.shape[-2]:
        raise ValueError(f"pattern must have shape (batch, n_heads, seq, seq) or (n_heads, seq, seq) (one layer "
                         f"of attention_patterns), got {tuple(pattern.shape)}")
    return pattern


def previous_token_scores(pattern: torch.Tensor) -> torch.Tensor:
    """Each head's previous-token score: its mean attention from a position to the one just before it.

        score_h = mean over examples b and positions i = 1 .. n-1 of A_h[b, i, i-1]

    ``pattern``: one layer of :func:`attention_patterns`, ``(batch, n_heads, seq, seq)``. Returns ``(n_heads,)``
    in [0, 1]; 1 means the head always looks exactly one token back (the first half of an induction circuit).
    """
    pattern = _check_pattern(pattern)
    if pattern.shape[-1] < 2:
        raise ValueError("previous_token_scores needs sequences of at least 2 positions")
    return pattern.diagonal(offset=-1, dim1=-2, dim2=-1).mean(dim=(0, 2))


def induction_scores(pattern: torch.Tensor) -> torch.Tensor:
    """Each head's induction (prefix-matching) score on repeated sequences (Olsson et al. 2022).

    For a sequence of ``2H`` tokens whose second half repeats the first (:func:`~groundup.induction.repeated_random
    _tokens`), the token at position ``i >= H`` occurred before at ``i - H``; an induction head attends from
    ``i`` to the token *after* that earlier copy, ``i - H + 1``:

        score_h = mean over examples b and positions i = H .. 2H-1 of A_h[b, i, i - H + 1]

    ``pattern``: one layer of :func:`attention_patterns` on such sequences, ``(batch, n_heads, 2H, 2H)``.
    Returns ``(n_heads,)`` in [0, 1] (a head attending uniformly scores about 1/i, the random baseline).
    """
    pattern = _check_pattern(pattern)
    n = pattern.shape[-1]
    if n % 2 or n < 4:
        raise ValueError(f"induction_scores needs repeated sequences of even length >= 4, got length {n}")
    half = n // 2
    return pattern.diagonal(offset=-(half - 1), dim1=-2, dim2=-1)[..., 1:].mean(dim=(0, 2))


# ---------------------------------------------------------------------------------------------------------------
# scores from the weights


def _norm_map(norm: nn.Module, d: int, like: torch.Tensor) -> torch.Tensor:
    """The linear part of a norm as a ``d x d`` matrix: diag(γ) (RMSNorm), diag(γ)(I - 11ᵀ/d) (LayerNorm)."""
    eye = torch.eye(d, dtype=like.dtype, device=like.device)
    if isinstance(norm, RMSNorm):
        return torch.diag(norm.weight.detach().to(like.dtype))
    if isinstance(norm, LayerNorm):
        return torch.diag(norm.weight.detach().to(like.dtype)) @ (eye - 1.0 / d)
    return eye  # nn.Identity (a Post-LN model reads the stream as it is)


def _input_map(model: GPT, layer: int, like: torch.Tensor) -> torch.Tensor:
    block = model.blocks[layer]
    norm = block.norm_1 if model.config.norm_position == "pre" else nn.Identity()
    return _norm_map(norm, model.config.d_model, like)


def head_matrices(model: GPT, layer: int, head: int) -> dict[str, torch.Tensor]:
    """One head's matrices, in the column-vector convention, the block's norm folded in (module docstring).

    Returns ``{"W_Q": (d_head, d_model), "W_K": ..., "W_V": ..., "W_O": (d_model, d_head)}`` with ``N`` (the
    linear part of ``norm_1``) folded into ``W_Q``, ``W_K`` and ``W_V``: ``q_h = W_Q x``, ``W_OV = W_O W_V`` and
    ``W_QK = W_Qᵀ W_K``. Biases are left out. Detached float copies of the weights.
    """
    _check_model(model)
    layer, head = _check_layer(model, layer), _check_head(model, head)
    attention = model.blocks[layer].attention
    d_head, group = attention.d_head, attention.n_heads // attention.n_kv_heads
    rows = slice(head * d_head, (head + 1) * d_head)
    kv_rows = slice((head // group) * d_head, (head // group + 1) * d_head)
    w_q = _weight(attention.W_q).float()
    n = _input_map(model, layer, w_q)
    return {"W_Q": w_q[rows] @ n, "W_K": _weight(attention.W_k).float()[kv_rows] @ n,
            "W_V": _weight(attention.W_v).float()[kv_rows] @ n, "W_O": _weight(attention.W_o).float()[:, rows]}


def _heads(model: GPT, layer: int) -> list[dict[str, torch.Tensor]]:
    return [head_matrices(model, layer, h) for h in range(model.config.n_heads)]


def _ov_factors(model: GPT, layer: int, head: dict[str, torch.Tensor], tokens: torch.Tensor | None):
    """``A (vocab, d_head)`` and ``B (d_head, n_tokens)`` with ``U N_f W_O W_V W_E[tokens]ᵀ = A B``."""
    w_e = model.token_embedding.weight.detach().float()
    if tokens is not None:
        w_e = w_e[tokens]
    u = _weight(model.unembedding).float()
    n_f = _norm_map(model.final_norm, model.config.d_model, u)
    return u @ (n_f @ head["W_O"]), head["W_V"] @ w_e.T


def _check_tokens(model: GPT, tokens) -> torch.Tensor | None:
    if tokens is None:
        return None
    tokens = torch.as_tensor(tokens)
    v = model.config.vocab_size
    if tokens.dim() != 1 or tokens.numel() == 0 or tokens.is_floating_point() or tokens.dtype == torch.bool \
            or int(tokens.min()) < 0 or int(tokens.max()) >= v:
        raise ValueError(f"tokens must be a non-empty 1-D list of token ids in 0 .. {v - 1}, got {tokens!r}")
    return tokens.long()


def copying_ranks(model: GPT, layer: int, *, tokens: Sequence[int] | torch.Tensor | None = None,
                  chunk: int = 1024) -> torch.Tensor:
    """Where each token's own logit ranks in its column of each head's OV circuit (see :func:`copying_scores`).

        rank_h(t) = #{s != t : M^h[s, t] >= M^h[t, t]}   (0: token t's own logit is the column's strict maximum)

    with ``M^h = U N_f W_O^h W_V^h N W_Eᵀ``: how many other tokens head ``h``'s direct path raises at least as
    much as ``t`` itself when it attends to ``t``. A random matrix gives ranks spread evenly over
    ``0 .. vocab_size - 1``. ``tokens`` restricts the columns to those ids; ``chunk`` columns are computed at a
    time. Returns ``(n_heads, n_tokens)`` (int64).
    """
    _check_model(model)
    layer = _check_layer(model, layer)
    tokens = _check_tokens(model, tokens)
    chunk = positive_int("chunk", chunk)
    ids = torch.arange(model.config.vocab_size) if tokens is None else tokens
    ranks = torch.empty(model.config.n_heads, ids.numel(), dtype=torch.long)
    for h, head in enumerate(_heads(model, layer)):
        a, b = _ov_factors(model, layer, head, tokens)
        for start in range(0, ids.numel(), chunk):
            m = a @ b[:, start:start + chunk]  # (vocab, chunk)
            own = ids[start:start + chunk]
            diagonal = m[own, torch.arange(own.numel())]
            ranks[h, start:start + own.numel()] = (m >= diagonal).sum(dim=0) - 1  # the diagonal counts itself
    return ranks


def copying_scores(model: GPT, layer: int, *, tokens: Sequence[int] | torch.Tensor | None = None,
                   chunk: int = 1024) -> torch.Tensor:
    """Each head's copying score: the fraction of tokens that its OV circuit, read straight out through the
    unembedding, maps to themselves.

        M^h = U N_f W_O^h W_V^h N W_Eᵀ   (vocab x vocab; column t: the logits head h adds when it attends to t)
        score_h = fraction of tokens t with M^h[t, t] > M^h[s, t] for every s != t

    ``N_f`` is the final norm's linear part. A head that copies (an induction head, which attends to the token
    it should predict) raises the logit of the very token it attends to, so its column's largest entry is on the
    diagonal; a random matrix scores about 1/vocab_size. Unlike the eigenvalue score (:func:`ov_eigenvalue_scores`,
    Elhage et al.'s), it counts only what decides a prediction, the top logit, and it reads the same on any
    vocabulary size. It is the *direct path* only: what later layers make of the head's output is ignored.

    ``tokens`` restricts the columns to those ids (SmolLM2's full matrix is 49,152²: pass a sample); ``chunk``
    columns are computed at a time. The fraction of :func:`copying_ranks` equal to 0. Returns ``(n_heads,)``.
    """
    ranks = copying_ranks(model, layer, tokens=tokens, chunk=chunk)
    return (ranks == 0).sum(dim=1) / ranks.shape[1]


def ov_eigenvalue_scores(model: GPT, layer: int) -> torch.Tensor:
    """Each head's eigenvalue copying score (Elhage et al. 2021): ``Σ λ / Σ |λ|`` over the eigenvalues λ of the
    OV circuit ``M^h = U N_f W_O^h W_V^h N W_Eᵀ`` (see :func:`copying_scores`).

    Real part of the ratio, in [-1, 1]: near 1 when the eigenvalues are mostly positive (the circuit maps tokens
    to themselves, or to tokens the unembedding treats alike: copying), near -1 for suppression, near 0 for
    neither. ``M^h = A B`` with ``A`` vocab x d_head, so its nonzero eigenvalues are those of the small
    ``B A`` (d_head x d_head): cheap even for a large vocabulary. A head whose circuit is zero scores 0.
    """
    _check_model(model)
    layer = _check_layer(model, layer)
    scores = []
    for head in _heads(model, layer):
        a, b = _ov_factors(model, layer, head, None)
        eig = torch.linalg.eigvals(b.double() @ a.double())
        total = float(eig.abs().sum())
        scores.append(float(eig.sum().real) / total if total > 0 else 0.0)
    return torch.tensor(scores)


def composition_scores(model: GPT, layer1: int, layer2: int, *, kind: str = "k") -> torch.Tensor:
    """How much each head of ``layer2`` reads what each head of ``layer1`` writes (Elhage et al. 2021).

        score(h1, h2) = ||W_A^{h2} W_OV^{h1}||_F / (||W_A^{h2}||_F ||W_OV^{h1}||_F)

    with ``W_A = W_QK`` for K-composition (``kind="k"``: the later head's *keys* read the earlier head's output;
    an induction head's keys read a previous-token head's), ``W_QKᵀ`` for Q-composition (``"q"``: its queries)
    and ``W_OV^{h2}`` for V-composition (``"v"``: its values). By the submultiplicativity of the Frobenius norm
    the score is in [0, 1]. Unrelated random matrices of the same shapes already score well above 0, so compare
    a pair with the other pairs (or with random matrices of the same shapes), not with 0. A head with zero weights
    scores 0. Returns ``(n_heads, n_heads)``: rows ``h1`` (``layer1``), columns ``h2`` (``layer2``).
    """
    _check_model(model)
    layer1 = _check_layer(model, layer1, name="layer1")
    layer2 = _check_layer(model, layer2, name="layer2")
    if layer1 >= layer2:
        raise ValueError(f"layer1 must come before layer2 (composition reads an earlier head's output), got "
                         f"layer1={layer1}, layer2={layer2}")
    if kind not in COMPOSITIONS:
        raise ValueError(f"kind must be one of {COMPOSITIONS}, got {kind!r}")
    ov1 = [h["W_O"] @ h["W_V"] for h in _heads(model, layer1)]
    later = []
    for h in _heads(model, layer2):
        qk = h["W_Q"].T @ h["W_K"]
        later.append({"k": qk, "q": qk.T, "v": h["W_O"] @ h["W_V"]}[kind])
    scores = torch.zeros(len(ov1), len(later))
    for i, w_b in enumerate(ov1):
        for j, w_a in enumerate(later):
            denominator = float(torch.linalg.matrix_norm(w_a) * torch.linalg.matrix_norm(w_b))
            if denominator > 0:
                scores[i, j] = float(torch.linalg.matrix_norm(w_a @ w_b)) / denominator
    return scores


# ---------------------------------------------------------------------------------------------------------------
# interventions


def _check_heads(model: GPT, heads) -> dict[int, list[int]]:
    try:
        pairs = [tuple(p) for p in heads]
    except TypeError:
        raise TypeError(f"heads must be an iterable of (layer, head) pairs, got {heads!r}") from None
    chosen: dict[int, list[int]] = {}
    for pair in pairs:
        if len(pair) != 2:
            raise ValueError(f"heads must be (layer, head) pairs, got {pair!r}")
        layer, head = _check_layer(model, pair[0]), _check_head(model, pair[1])
        chosen.setdefault(layer, []).append(head)
    return chosen


@contextlib.contextmanager
def ablate_heads(model: GPT, heads: Iterable[tuple[int, int]], *, mode: str = "zero",
                 means: Sequence[torch.Tensor] | None = None):
    """A context manager in which the given heads are ablated: ``with ablate_heads(model, [(1, 0)]): ...``.

    ``heads``: ``(layer, head)`` pairs. The heads are concatenated just before the output projection ``W_o``, so a
    forward pre-hook on each ablated layer's ``attention.W_o`` replaces head ``h``'s slice
    ``[h d_head, (h+1) d_head)`` of its input: by zeros (``mode="zero"``: the head contributes nothing but the
    shared bias) or by its mean output (``mode="mean"``: ``means`` from :func:`mean_head_outputs` on reference
    inputs, which keeps the typical output and removes only what depends on this input). Every other head, and
    the rest of the model, computes as before. The hooks are removed on exit, also after an error.
    """
    _check_model(model)
    if mode not in ABLATIONS:
        raise ValueError(f"mode must be one of {ABLATIONS}, got {mode!r}")
    chosen = _check_heads(model, heads)
    c = model.config
    if mode == "mean":
        if means is None or len(means) != c.n_layers:
            raise ValueError(f"mode='mean' needs means: one tensor per layer ({c.n_layers}), from mean_head_outputs")
    elif means is not None:
        raise ValueError("means are for mode='mean'; zero ablation takes none")

    def make_pre(layer, heads_here):
        def pre(module, args):
            x = args[0]
            d_head = x.shape[-1] // c.n_heads
            split = x.reshape(*x.shape[:-1], c.n_heads, d_head).clone()
            for h in heads_here:
                if mode == "zero":
                    split[..., h, :] = 0.0
                else:
                    mean = means[layer][..., h, :].to(x.dtype)
                    if mean.dim() == 2 and mean.shape[0] != x.shape[-2]:
                        raise ValueError(f"per-position means of layer {layer} cover {mean.shape[0]} positions, "
                                         f"the input has {x.shape[-2]}")
                    split[..., h, :] = mean
            return (split.reshape(x.shape),) + tuple(args[1:])
        return pre

    with _hooks() as handles:
        for layer, heads_here in chosen.items():
            handles.append(model.blocks[layer].attention.W_o.register_forward_pre_hook(make_pre(layer, heads_here)))
        yield model


def _check_sources(model: GPT, sources, layer: int) -> list[tuple[int, int]]:
    """``sources``: one ``(layer, head)`` pair or a list of them, each once and before block ``layer``; in order."""
    if isinstance(sources, tuple) and len(sources) == 2 and all(isinstance(s, numbers.Integral) for s in sources):
        sources = [sources]
    sources = list(sources)
    _check_heads(model, sources)
    pairs = [(int(a), int(b)) for a, b in sources]
    if not pairs or len(set(pairs)) != len(pairs):
        raise ValueError(f"sources must name at least one (layer, head) pair, each once, got {sources!r}")
    if max(a for a, _ in pairs) >= layer:
        raise ValueError(f"layer ({layer}) must come after the source heads' layers ({sorted({a for a, _ in pairs})})")
    return pairs


def _written(model: GPT, source: tuple[int, int], z: torch.Tensor) -> torch.Tensor:
    """What head ``source = (layer, head)`` writes into the stream, ``W_O^h z^h`` (no bias), from its output ``z``
    ``(..., d_head)`` (the head's slice of ``W_o``'s input, as in :func:`head_outputs`)."""
    layer, head = source
    d_head = z.shape[-1]
    return z @ _weight(model.blocks[layer].attention.W_o)[:, head * d_head:(head + 1) * d_head].T.to(z.dtype)


@contextlib.contextmanager
def _projecting(attention: nn.Module, project):
    """``attention`` computes its queries, keys and values with ``project(x, context, need_kv)`` instead of its
    ``_project`` method (an instance attribute shadows the method; the previous state is restored on exit)."""
    before = attention.__dict__.get("_project")
    attention._project = project
    try:
        yield
    finally:
        if before is None:
            del attention._project
        else:
            attention._project = before


@contextlib.contextmanager
def remove_from_inputs(model: GPT, sources, layer: int, paths: Iterable[str] = ("k",), *, head: int | None = None,
                       outputs: Sequence[torch.Tensor] | None = None):
    """A context manager in which block ``layer``'s attention reads its queries, keys and / or values (``paths``,
    any of ``"q"``, ``"k"``, ``"v"``) from the stream *without* the direct output of the heads ``sources``: one
    ``(layer0, head0)`` pair or a list of them, all in blocks before ``layer``.

    Head ``(l, h)`` writes ``c = W_O^h z^h`` into the stream (no bias), and the stream carries ``c`` unchanged to
    the later blocks. A forward pre-hook on each source's ``W_o`` records its ``z``, one on block ``layer`` takes
    that block's input ``x`` and computes ``N(x - Σ c)`` (``N``: the block's first norm), and the attention's
    projections for the chosen ``paths`` read it instead of ``N(x)``. Everything else still sees every ``c``: the
    other paths, the residual connection, the FFNs, later blocks, the unembedding. Two modes:

    * ``head=None``: every head of block ``layer`` reads the reduced stream through those paths. In an
      attention-only model, with all three paths and ``layer = layer0 + 1``, the block's attention computes
      exactly what it computes with the sources zero-ablated (an FFN in between would also see ``c``; it is not
      removed from what the FFN wrote).
    * ``head=h``: only head ``h`` of block ``layer`` does; every other head of the block (with grouped-query
      attention its key/value neighbours too: ``h`` gets keys and values of its own) computes as before. A
      forward pre-hook on the attention runs it a second time, with ``need_weights=True`` and its projections
      reading the reduced stream, keeps head ``h``'s pattern and output, and a pre-hook on ``W_o`` puts that output
      into head ``h``'s slice of the real call. With nothing removed that is the model's own computation up to
      float rounding (the written-out softmax for the fused kernel). Not with a KV cache.

    Yields a dict that every forward pass fills: ``"written"``, the removed ``Σ c`` ``(batch, seq, d_model)``; with
    ``head`` also ``"pattern"`` ``(batch, seq, seq)`` and ``"z"`` ``(batch, seq, d_head)``, head ``h``'s
    attention weights and output in this pass. ``outputs`` (:func:`head_outputs` of the same token ids) supplies
    the sources' ``z`` instead of recording it, so that a pass may start at block ``layer`` (with the run's stream
    entry ``layer``) without running the blocks before it again. Needs Pre-LN blocks. While the context is on, the
    block's ``W_q``, ``W_k``, ``W_v`` are computed one by one (not in one stacked matmul: the attention's
    ``_project`` is shadowed); the hooks are removed and ``_project`` restored on exit, also after an error.
    """
    _check_model(model)
    layer = _check_layer(model, layer)
    sources = _check_sources(model, sources, layer)
    chosen = tuple(paths)  # "kv" is ("k", "v")
    if not chosen or any(p not in COMPOSITIONS for p in chosen):
        raise ValueError(f"paths must be a non-empty selection of {COMPOSITIONS}, got {paths!r}")
    if head is not None:
        head = _check_head(model, head)
    if outputs is not None and len(outputs) != model.config.n_layers:
        raise ValueError(f"outputs must be head_outputs of the run: one tensor per layer ({model.config.n_layers})")
    block = model.blocks[layer]
    if getattr(block, "norm_position", "pre") != "pre":
        raise ValueError("remove_from_inputs needs Pre-LN blocks (x + attention(norm_1(x)))")
    attention, n_heads = block.attention, model.config.n_heads
    recorded: dict[tuple[int, int], torch.Tensor] = {}
    seen: dict[str, torch.Tensor] = {}
    state: dict = {"inner": False, "reduced": None}

    def make_record(source_layer):  # on a source layer's W_o: its heads' outputs z, as head_outputs reads them
        def record(module, args):
            d_head = args[0].shape[-1] // n_heads
            for s in sources:
                if s[0] == source_layer:
                    recorded[s] = args[0][..., s[1] * d_head:(s[1] + 1) * d_head]
        return record

    def reduce(module, args):  # on block `layer`: N(x - Σ c) for the chosen paths
        x = args[0]
        z = recorded if outputs is None else {s: outputs[s[0]][..., s[1], :] for s in sources}
        if any(s not in z for s in sources):
            raise ValueError(f"block {layer} ran without the sources' outputs of this pass: pass outputs= (their "
                             "head_outputs) when a pass starts after them")
        written = sum(_written(model, s, z[s]) for s in sources)
        if written.shape != x.shape:
            raise ValueError(f"the sources wrote {tuple(written.shape)}, the block reads {tuple(x.shape)}: outputs "
                             "must come from the same token ids")
        seen["written"], state["reduced"] = written, block.norm_1(x - written.to(x.dtype))
        recorded.clear()

    def project(x, context=None, need_kv=True):  # the projections, the chosen paths reading the reduced stream
        reads = {p: state["reduced"] if p in chosen else x for p in COMPOSITIONS}
        return attention.W_q(reads["q"]), attention.W_k(reads["k"]), attention.W_v(reads["v"])

    cut = None if head is None else slice(head * attention.d_head, (head + 1) * attention.d_head)

    def second_pass(module, args, kwargs):  # head mode: run the attention again on the reduced stream
        if kwargs.get("cache") is not None:
            raise ValueError("remove_from_inputs with head= does not work with a KV cache")
        state["inner"] = True
        try:
            with _projecting(attention, project):
                _, weights = attention.forward(*args, **{**kwargs, "need_weights": True})
        finally:
            state["inner"] = False
        seen["pattern"] = weights[:, head].detach()

    def swap_head(module, args):  # head mode: the second pass's output of the head into the real call
        if state["inner"]:
            seen["z"] = args[0][..., cut].detach().clone()
            return None
        x = args[0].clone()
        x[..., cut] = seen["z"].to(x.dtype)
        return (x,) + tuple(args[1:])

    with _hooks() as handles, (_projecting(attention, project) if head is None else contextlib.nullcontext()):
        if outputs is None:
            for source_layer in dict.fromkeys(a for a, _ in sources):
                handles.append(model.blocks[source_layer].attention.W_o.register_forward_pre_hook(
                    make_record(source_layer)))
        handles.append(block.register_forward_pre_hook(reduce))
        if head is not None:
            handles.append(attention.register_forward_pre_hook(second_pass, with_kwargs=True))
            handles.append(attention.W_o.register_forward_pre_hook(swap_head))
        yield seen


def _stream_hook(model: GPT, layer: int, replace):
    """Register ``replace(x) -> x`` on stream entry ``layer`` (block input, or the last block's output)."""
    if layer < model.config.n_layers:
        def pre(module, args):
            return (replace(args[0]),) + tuple(args[1:])
        return model.blocks[layer].register_forward_pre_hook(pre)

    def post(module, args, output):
        return replace(output)
    return model.blocks[-1].register_forward_hook(post)


@contextlib.contextmanager
def patch_residual(model: GPT, layer: int, stream: torch.Tensor, *, positions: Sequence[int] | None = None):
    """A context manager in which the residual stream entry ``layer`` (as in :func:`residual_stream`) is replaced,
    at ``positions`` (None: all), by the same positions of ``stream`` ``(batch, seq, d_model)``, usually another
    run's :func:`residual_stream` entry. The run must have the same batch size and length as ``stream``.
    """
    _check_model(model)
    layer = _check_layer(model, layer, stream=True)
    if not isinstance(stream, torch.Tensor) or stream.dim() != 3 or stream.shape[-1] != model.config.d_model:
        got = tuple(stream.shape) if isinstance(stream, torch.Tensor) else type(stream).__name__
        raise ValueError(f"stream must have shape (batch, seq, d_model={model.config.d_model}), got {got}")
    index = slice(None) if positions is None else list(positions)

    def replace(x):
        if x.shape != stream.shape:
            raise ValueError(f"the patched run's stream has shape {tuple(x.shape)}, the patch {tuple(stream.shape)}: "
                             "use runs of the same batch size and length")
        x = x.clone()
        x[:, index] = stream[:, index].to(x.dtype)
        return x

    with _hooks() as handles:
        handles.append(_stream_hook(model, layer, replace))
        yield model


def logit_difference(logits: torch.Tensor, answer, wrong) -> torch.Tensor:
    """``logits[b, -1, answer_b] - logits[b, -1, wrong_b]`` for each example ``b``: how much the model prefers the
    right next token to the wrong one at the last position. ``answer`` / ``wrong``: an id, or one per example.
    """
    if not isinstance(logits, torch.Tensor) or logits.dim() != 3:
        got = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise ValueError(f"logits must have shape (batch, seq, vocab_size), got {got}")
    last = logits[:, -1, :]
    rows = torch.arange(last.shape[0])
    answer, wrong = _per_example("answer", answer, last.shape[0]), _per_example("wrong", wrong, last.shape[0])
    if int(torch.cat([answer, wrong]).min()) < 0 or int(torch.cat([answer, wrong]).max()) >= last.shape[-1]:
        raise ValueError(f"answer and wrong must be token ids in 0 .. {last.shape[-1] - 1}")
    return last[rows, answer] - last[rows, wrong]


def _per_example(name: str, ids, batch: int) -> torch.Tensor:
    """A token id, or one per example, as a ``(batch,)`` long tensor."""
    t = torch.as_tensor(ids)
    if t.is_floating_point() or t.dtype == torch.bool or t.dim() > 1 or (t.dim() == 1 and t.numel() != batch):
        raise ValueError(f"{name} must be a token id or one id per example ({batch}), got {ids!r}")
    return t.long().expand(batch).clone()


def _check_ids(name: str, idx, model: GPT) -> torch.Tensor:
    if not isinstance(idx, torch.Tensor) or idx.dtype.is_floating_point or idx.dtype == torch.bool or idx.dim() != 2:
        got = f"{idx.dtype} {tuple(idx.shape)}" if isinstance(idx, torch.Tensor) else type(idx).__name__
        raise ValueError(f"{name} must be an integer tensor of token ids (batch, seq), got {got}")
    return idx


def _run_from(model: GPT, x: torch.Tensor, layer: int, *, start: int = 0,
              cache: Sequence[KVCache] | None = None) -> torch.Tensor:
    """Blocks ``layer .. n_layers - 1`` on the stream entry ``x`` ``(batch, n, d_model)`` of the positions
    ``start .. start + n - 1`` (entry ``layer`` of :func:`residual_stream`): returns the last entry, before the
    final norm. What ``GPT.forward`` computes after block ``layer - 1``, with the blocks' hooks, so that an
    intervention at or after block ``layer`` need not run the blocks before it again. ``cache`` (the KV cache of
    ``GPT.forward`` on the whole sequences) supplies the keys and values of the positions before ``start``, so that
    ``x`` may be the sequences' tail. RoPE, learned or sinusoidal positions (not a relative or ALiBi bias, which
    ``GPT.forward`` builds itself). Eval mode, no gradients."""
    c = model.config
    if c.positional in ("relative", "alibi"):
        raise ValueError(f"running from a stream entry needs positions that the stream or RoPE carries, not "
                         f"{c.positional!r}")
    blocks = list(model.blocks)[layer:]
    caches = [None] * len(blocks)
    if cache is not None:
        caches = [KVCache() for _ in blocks]
        for kv, full in zip(caches, cache[layer:], strict=True):
            if start > 0:
                kv.k, kv.v = full.k[..., :start, :], full.v[..., :start, :]
    positions = torch.arange(start, start + x.shape[1])
    with _inspecting(model):
        for block, kv in zip(blocks, caches, strict=True):
            x = block(x, rotary=model.rotary if c.positional == "rope" else None, positions=positions,
                      is_causal=model.causal, cache=kv)
    return x


def _last_logit_difference(model: GPT, final: torch.Tensor, answer, wrong) -> torch.Tensor:
    """:func:`logit_difference` at the last position, from the last stream entry ``final`` (before the final norm)."""
    with torch.no_grad():
        return logit_difference(model.unembedding(model.final_norm(final[:, -1:])).float(), answer, wrong)


def _patching_per_example(model: GPT, corrupted, clean_stream, corrupted_stream, answer, wrong, chosen,
                          differ) -> dict[str, torch.Tensor]:
    """``residual_patching(..., per_example=True)``: every patch a run of blocks ``l ..`` on positions ``p ..``."""
    ld_clean = _last_logit_difference(model, clean_stream[-1], answer, wrong)
    ld_corrupted = _last_logit_difference(model, corrupted_stream[-1], answer, wrong)
    cache = model.new_cache()
    with _inspecting(model):
        model(corrupted, cache=cache, last_only=True)
    ld = ld_corrupted.expand(len(chosen), corrupted.shape[1], -1).clone()  # (entries, seq, batch)
    for row, layer in enumerate(chosen):
        for p in differ[row].nonzero().flatten().tolist():
            x = corrupted_stream[layer][:, p:].clone()
            x[:, 0] = clean_stream[layer][:, p]
            ld[row, p] = _last_logit_difference(model, _run_from(model, x, layer, start=p, cache=cache), answer,
                                                wrong)
    return {"ld_clean": ld_clean, "ld_corrupted": ld_corrupted, "ld": ld, "patched": differ,
            "restored": (ld - ld_corrupted) / (ld_clean - ld_corrupted)}


def residual_patching(model: GPT, clean: torch.Tensor, corrupted: torch.Tensor, answer, wrong, *,
                      layers: Sequence[int] | None = None, per_example: bool = False):
    """Activation patching of the residual stream: how much of the clean run's logit difference comes back when
    one position of one stream entry of the corrupted run is replaced by the clean run's.

        LD(run) = mean over examples of logit_difference(run's logits, answer, wrong)
        restored[l, p] = (LD(corrupted, with x^(l)[p] from clean) - LD(corrupted)) / (LD(clean) - LD(corrupted))

    ``clean`` and ``corrupted``: token ids ``(batch, seq)`` of the same shape (a minimal pair: the same text with,
    say, two names swapped); ``answer`` / ``wrong``: the clean run's right next token and the corrupted run's
    (ids, or one per example). Returns ``(n_layers + 1, seq)``: 1 where patching that one vector restores the
    whole clean behaviour, 0 where it changes nothing. Entry ``l`` is the stream of :func:`residual_stream` (0:
    the embeddings). Each stream entry is one forward pass of the corrupted batch repeated ``seq`` times, one
    position patched in each copy; only the last position is unembedded. Eval mode, no gradients.

    ``layers`` (stream indices; None: all ``n_layers + 1``) patches only those entries, one forward pass each, and
    returns their rows in that order, ``(len(layers), seq)``: on a deep model every second or third entry shows
    the picture at a fraction of the cost.

    A position whose clean and corrupted stream vectors are equal in every example (in a causal model: every
    position before the first token that differs) would be patched with itself: its entry is 0 by definition and
    it is not run, which saves most of the work when the pair differs late in the prompt.

    ``per_example=True`` keeps the examples apart and returns a dict of tensors: ``ld_clean``, ``ld_corrupted``
    ``(batch,)``, the two runs' logit differences; ``ld`` ``(len(layers), seq, batch)``, the patched runs', and
    ``restored``, the fraction per example, ``(ld - ld_corrupted) / (ld_clean - ld_corrupted)`` (infinite or nan
    for an example whose two runs agree); ``patched`` ``(len(layers), seq)``, False where the position was not run
    (``ld`` is then ``ld_corrupted``). The mean over the examples of ``ld``, normalised as above, is the default
    result up to float rounding: here each patch runs only what it can change, blocks ``l ..`` on positions
    ``p ..``, the earlier positions' keys and values taken from a KV cache of the corrupted run (RoPE, learned or
    sinusoidal positions). Swap ``clean`` and ``corrupted`` for noising (how much of the clean behaviour one
    corrupted vector destroys).
    """
    _check_model(model)
    clean, corrupted = _check_ids("clean", clean, model), _check_ids("corrupted", corrupted, model)
    if clean.shape != corrupted.shape:
        raise ValueError(f"clean and corrupted must have the same shape (batch, seq), got {tuple(clean.shape)} and "
                         f"{tuple(corrupted.shape)}")
    if not isinstance(per_example, bool):
        raise TypeError(f"per_example must be True or False, got {per_example!r}")
    batch, seq = clean.shape
    chosen = list(range(model.config.n_layers + 1)) if layers is None else \
        [_check_layer(model, layer, stream=True, name="layers") for layer in layers]
    if not chosen:
        raise ValueError("layers must name at least one stream entry (or be None for all)")
    clean_stream, corrupted_stream = residual_stream(model, clean), residual_stream(model, corrupted)
    differ = torch.stack([(clean_stream[layer] != corrupted_stream[layer]).any(dim=-1).any(dim=0)
                          for layer in chosen])  # (len(chosen), seq): the positions worth patching
    if per_example:
        return _patching_per_example(model, corrupted, clean_stream, corrupted_stream, answer, wrong, chosen, differ)
    with _inspecting(model):
        ld_clean = float(logit_difference(model(clean, last_only=True)[0], answer, wrong).mean())
        ld_corrupted = float(logit_difference(model(corrupted, last_only=True)[0], answer, wrong).mean())
    if ld_clean == ld_corrupted:
        raise ValueError("the clean and corrupted runs give the same logit difference: nothing to restore (choose "
                         "a minimal pair whose answers differ)")
    answer, wrong = _per_example("answer", answer, batch), _per_example("wrong", wrong, batch)
    restored = torch.zeros(len(chosen), seq)
    for row, layer in enumerate(chosen):
        positions = differ[row].nonzero().flatten()
        if positions.numel() == 0:
            continue
        k = positions.numel()
        repeated = corrupted.repeat(k, 1)  # copy c (rows c*batch .. (c+1)*batch - 1) gets position positions[c]
        rows, copies = torch.arange(k * batch), positions.repeat_interleave(batch)
        patch = clean_stream[layer][torch.arange(batch).repeat(k), copies]  # (k * batch, d_model)

        def replace(x, patch=patch, rows=rows, copies=copies):
            x = x.clone()
            x[rows, copies] = patch.to(x.dtype)
            return x

        with _inspecting(model), _hooks() as handles:
            handles.append(_stream_hook(model, layer, replace))
            logits = model(repeated, last_only=True)[0]
        ld = logit_difference(logits, answer.repeat(k), wrong.repeat(k))
        restored[row, positions] = (ld.view(k, batch).mean(dim=1) - ld_corrupted) / (ld_clean - ld_corrupted)
    return restored
