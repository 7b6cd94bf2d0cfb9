"""Whole models built from the blocks of :mod:`groundup.layers`: the decoder-only GPT (chapter 6).

``GPT`` is nanoGPT-direct: token embedding (+ an absolute positional encoding) → ``n_layers`` causal
:class:`~groundup.layers.TransformerBlock` s → final norm (Pre-LN only) → unembedding → logits, and the mean
next-token cross-entropy when targets are given.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from groundup.attention import KVCache, causal_mask
from groundup.embeddings import TokenEmbedding, Unembedding
from groundup.layers import NORM_POSITIONS, NORMS, TransformerBlock, make_norm
from groundup.positional import (
    LearnedPositionalEmbedding,
    RelativePositionBias,
    RotaryEmbedding,
    alibi_bias,
    sinusoidal_encoding,
)

POSITIONALS = ("learned", "sinusoidal", "none", "relative", "alibi", "rope")
"""The positional families of chapter 4 that :class:`GPTConfig` accepts."""

INIT_STD = 0.02
"""Standard deviation of every linear layer's weights at initialisation (GPT-2, nanoGPT)."""


@dataclass
class GPTConfig:
    """The hyperparameters of a :class:`GPT` (the seeds' symbols in brackets).

    ``d_ff`` (d_FFN) defaults to ``4 * d_model`` (GPT's choice; the seeds quote d_FFN ≈ 2 d_M).
    ``positional`` picks how position enters: added to the input ("learned", "sinusoidal"), added to the
    attention scores ("relative", "alibi"), rotating queries and keys ("rope"), or not at all ("none").
    ``norm_position`` is "pre" (GPT-2 onwards) or "post" (the original transformer); ``tie_weights`` shares
    the embedding matrix W_E with the unembedding U.
    """

    vocab_size: int = 256  # n_V
    context_length: int = 128  # n_C
    d_model: int = 128  # d_M
    n_layers: int = 4  # n_L
    n_heads: int = 4  # n_H
    d_ff: int | None = None  # d_FFN; None means 4 * d_model
    positional: str = "learned"
    norm: str = "layernorm"
    norm_position: str = "pre"
    dropout: float = 0.0
    tie_weights: bool = True

    def __post_init__(self):
        if self.d_ff is None:
            self.d_ff = 4 * self.d_model
        for name in ("vocab_size", "context_length", "d_model", "n_layers", "n_heads", "d_ff"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
            if type(value) is not int:  # a NumPy integer, say: store the plain int
                setattr(self, name, int(value))
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})")
        if self.positional not in POSITIONALS:
            raise ValueError(f"positional must be one of {POSITIONALS}, got {self.positional!r}")
        if self.positional == "rope" and self.d_head % 2:
            raise ValueError(f"positional='rope' needs an even d_head = d_model / n_heads, got {self.d_head}")
        if self.positional == "sinusoidal" and self.d_model % 2:
            raise ValueError(f"positional='sinusoidal' needs an even d_model, got {self.d_model}")
        if self.norm not in NORMS:
            raise ValueError(f"norm must be one of {NORMS}, got {self.norm!r}")
        if self.norm_position not in NORM_POSITIONS:
            raise ValueError(f"norm_position must be one of {NORM_POSITIONS}, got {self.norm_position!r}")
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, numbers.Real) \
                or not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be a number in [0, 1), got {self.dropout!r}")
        if not isinstance(self.tie_weights, bool):
            raise ValueError(f"tie_weights must be True or False, got {self.tie_weights!r}")

    @property
    def d_head(self) -> int:
        """The size of one attention head, d_model / n_heads."""
        return self.d_model // self.n_heads


class GPT(nn.Module):
    """A decoder-only transformer language model: ``forward(idx, targets=None) -> (logits, loss)``.

    Initialisation follows GPT-2/nanoGPT: linear weights N(0, 0.02²), biases 0, and the two projections that
    write into the residual stream (``W_o``, ``W_out``) scaled down by ``1/sqrt(2 n_layers)`` so the stream's
    variance does not grow with depth. The token embedding starts small (``init="small"``) when tied to the
    unembedding, otherwise at RMS 1 per row (``init="rms"``, chapter 3) with an untied unembedding of entries
    N(0, 1/d_model).
    """

    def __init__(self, config: GPTConfig):
        super().__init__()
        if not isinstance(config, GPTConfig):
            raise TypeError(f"config must be a GPTConfig, got {type(config).__name__}")
        self.config = c = config
        self.token_embedding = TokenEmbedding(c.vocab_size, c.d_model, init="small" if c.tie_weights else "rms")
        if c.positional == "learned":
            self.position_embedding = LearnedPositionalEmbedding(c.context_length, c.d_model)
        elif c.positional == "sinusoidal":
            self.register_buffer("position_encoding", sinusoidal_encoding(c.context_length, c.d_model),
                                 persistent=False)
        elif c.positional == "relative":  # one learned b_{t-i} per head, shared by all layers (as in T5)
            self.relative_bias = RelativePositionBias(c.n_heads, c.context_length, bidirectional=False)
        elif c.positional == "alibi":
            self.register_buffer("alibi", alibi_bias(c.n_heads, c.context_length), persistent=False)
        elif c.positional == "rope":
            self.rotary = RotaryEmbedding(c.d_head)
        self.dropout = nn.Dropout(c.dropout)
        self.blocks = nn.ModuleList(TransformerBlock(c) for _ in range(c.n_layers))
        # Post-LN blocks already end in a norm; Pre-LN leaves the stream unnormalised, so normalise once more.
        self.final_norm = make_norm(c.norm, c.d_model) if c.norm_position == "pre" else nn.Identity()
        self.unembedding = Unembedding(c.d_model, c.vocab_size, tied_to=self.token_embedding if c.tie_weights
                                       else None)
        self._init_weights()

    @torch.no_grad()
    def _init_weights(self) -> None:
        residual_std = INIT_STD / math.sqrt(2 * self.config.n_layers)
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                is_residual = name.endswith("attention.W_o") or name.endswith("ffn.W_out")
                module.weight.normal_(0.0, residual_std if is_residual else INIT_STD)
                if module.bias is not None:
                    module.bias.zero_()

    def new_cache(self) -> list[KVCache]:
        """An empty KV cache for :meth:`forward`: one :class:`~groundup.attention.KVCache` per block."""
        return [KVCache() for _ in self.blocks]

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, *,
                cache: list[KVCache] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits ``(batch, seq, vocab_size)`` for token ids ``idx (batch, seq)``, and the loss.

        ``targets`` (same shape as ``idx``, usually ``idx`` shifted by one) gives ``loss``, the mean
        cross-entropy of the next-token predictions (positions whose target is -100 are ignored; on the CPU,
        targets that ignore every position raise ``ValueError`` instead of giving a nan loss); without
        targets ``loss`` is None. ``cache`` (from :meth:`new_cache`) makes ``idx`` continue the positions
        already cached, for generation with a KV cache.
        """
        c = self.config
        if not isinstance(idx, torch.Tensor):
            raise TypeError(f"idx must be a torch.Tensor of integer token ids, got {type(idx).__name__}")
        if idx.dtype.is_floating_point or idx.dtype.is_complex or idx.dtype == torch.bool:
            raise TypeError(f"idx must hold integer token ids (e.g. torch.long), got dtype {idx.dtype}")
        if idx.dim() != 2 or idx.shape[1] == 0:
            raise ValueError(f"idx must have shape (batch, seq) with seq >= 1, got {tuple(idx.shape)}")
        if cache is not None and len(cache) != c.n_layers:
            raise ValueError(f"cache must hold one KVCache per layer ({c.n_layers}), got {len(cache)}")
        start = len(cache[0]) if cache is not None else 0
        n, total = idx.shape[1], start + idx.shape[1]
        if total > c.context_length:
            what = f"{n} new tokens after {start} cached" if start else f"{n} tokens"
            raise ValueError(f"sequence length {total} ({what}) exceeds context_length {c.context_length}")
        positions = torch.arange(start, total, device=idx.device)

        x = self.token_embedding(idx)  # x_i^(0) = F(W_E[Ind(i)], PosEmbed(i)) with F = addition
        if c.positional == "learned":
            x = x + self.position_embedding(positions)
        elif c.positional == "sinusoidal":
            x = x + self.position_encoding[positions]
        x = self.dropout(x)

        mask = causal_mask(n, n_keys=total, device=idx.device)
        attn_bias = None
        if c.positional == "relative":
            attn_bias = self.relative_bias(total)[:, start:, :]
        elif c.positional == "alibi":
            attn_bias = self.alibi[:, start:total, :total]
        rotary = self.rotary if c.positional == "rope" else None
        for layer, block in enumerate(self.blocks):
            x = block(x, mask=mask, attn_bias=attn_bias, rotary=rotary, positions=positions,
                      cache=None if cache is None else cache[layer])
        logits = self.unembedding(self.final_norm(x))  # logits_i = U x_i^(n_L)

        loss = None
        if targets is not None:
            if not isinstance(targets, torch.Tensor) or targets.dtype.is_floating_point \
                    or targets.dtype.is_complex or targets.dtype == torch.bool:
                got = targets.dtype if isinstance(targets, torch.Tensor) else type(targets).__name__
                raise TypeError(f"targets must be an integer torch.Tensor of token ids, got {got}")
            if targets.shape != idx.shape:
                raise ValueError(f"targets must have the same shape as idx {tuple(idx.shape)}, "
                                 f"got {tuple(targets.shape)}")
            try:
                loss = F.cross_entropy(logits.reshape(-1, c.vocab_size), targets.reshape(-1).long())
            except IndexError as err:  # the kernel's own range check ("Target 300 is out of bounds.")
                raise ValueError(f"targets must lie in [0, {c.vocab_size - 1}] (vocab_size={c.vocab_size}) or be "
                                 f"-100 (ignored): {err}") from None
            # Every target ignored: the mean over no positions is 0/0 = nan. Checked only when the loss is nan
            # and only on the CPU, where it costs nothing (on a GPU it would wait for the device every step).
            if loss.device.type == "cpu" and torch.isnan(loss) and bool((targets == -100).all()):
                raise ValueError("every target is -100 (ignored): the mean loss over no positions is undefined; "
                                 "give at least one target in [0, vocab_size)")
        return logits, loss
