"""Whole models built from the blocks of :mod:`groundup.layers`: the decoder-only GPT (chapter 6) and the
encoder–decoder transformer (chapter 10).

``GPT`` is nanoGPT-direct: token embedding (+ an absolute positional encoding) → ``n_layers`` causal
:class:`~groundup.layers.TransformerBlock` s → final norm (Pre-LN only) → unembedding → logits, and the mean
next-token cross-entropy when targets are given.

``MaskedLM`` (chapter 9) is the same stack without the causal mask -- a bidirectional encoder, BERT's shape --
trained to predict the tokens at masked positions (see :mod:`groundup.masking`).
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
from groundup.layers import ACTIVATIONS, NORM_POSITIONS, NORMS, DecoderBlock, TransformerBlock, make_norm
from groundup.positional import (
    ROPE_PAIRINGS,
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

def _check_block_options(config, positionals: tuple) -> None:
    """The checks GPTConfig and EncoderDecoderConfig share: heads, positions, norms, dropout, tying."""
    if config.d_model % config.n_heads:
        raise ValueError(f"d_model ({config.d_model}) must be divisible by n_heads ({config.n_heads})")
    if config.positional not in positionals:
        raise ValueError(f"positional must be one of {positionals}, got {config.positional!r}")
    if config.positional == "rope" and config.d_head % 2:
        raise ValueError(f"positional='rope' needs an even d_head = d_model / n_heads, got {config.d_head}")
    if config.positional == "sinusoidal" and config.d_model % 2:
        raise ValueError(f"positional='sinusoidal' needs an even d_model, got {config.d_model}")
    if config.norm not in NORMS:
        raise ValueError(f"norm must be one of {NORMS}, got {config.norm!r}")
    if config.norm_position not in NORM_POSITIONS:
        raise ValueError(f"norm_position must be one of {NORM_POSITIONS}, got {config.norm_position!r}")
    if isinstance(config.dropout, bool) or not isinstance(config.dropout, numbers.Real) \
            or not 0.0 <= config.dropout < 1.0:
        raise ValueError(f"dropout must be a number in [0, 1), got {config.dropout!r}")
    if not isinstance(config.tie_weights, bool):
        raise ValueError(f"tie_weights must be True or False, got {config.tie_weights!r}")


def _check_modern_options(config) -> None:
    """Checks for GPTConfig's modern-block fields (activation, bias, GQA, QK-norm, parallel, RoPE, eps)."""
    if config.activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {config.activation!r}")
    for name in ("bias", "qk_norm", "parallel_block"):
        if not isinstance(getattr(config, name), bool):
            raise ValueError(f"{name} must be True or False, got {getattr(config, name)!r}")
    if config.n_kv_heads is not None:
        k = config.n_kv_heads
        if isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 1 or config.n_heads % k:
            raise ValueError(f"n_kv_heads must be None or a positive integer dividing n_heads ({config.n_heads}), "
                             f"got {k!r}")
        config.n_kv_heads = int(k)
    if config.parallel_block and config.norm_position != "pre":
        raise ValueError("parallel_block=True needs norm_position='pre'")
    if config.rope_pairing not in ROPE_PAIRINGS:
        raise ValueError(f"rope_pairing must be one of {ROPE_PAIRINGS}, got {config.rope_pairing!r}")
    base = config.rope_base
    if isinstance(base, bool) or not isinstance(base, numbers.Real) or not math.isfinite(base) or base <= 1:
        raise ValueError(f"rope_base must be a finite number > 1, got {base!r}")
    eps = config.norm_eps
    if eps is not None and (isinstance(eps, bool) or not isinstance(eps, numbers.Real)
                            or not math.isfinite(eps) or eps <= 0):
        raise ValueError(f"norm_eps must be None or a positive number, got {eps!r}")


def _check_targets(targets, inputs: torch.Tensor, name: str) -> None:
    """Targets must be an integer tensor of token ids shaped like the model's ``inputs`` (called ``name``)."""
    if not isinstance(targets, torch.Tensor) or targets.dtype.is_floating_point \
            or targets.dtype.is_complex or targets.dtype == torch.bool:
        got = targets.dtype if isinstance(targets, torch.Tensor) else type(targets).__name__
        raise TypeError(f"targets must be an integer torch.Tensor of token ids, got {got}")
    if targets.shape != inputs.shape:
        raise ValueError(f"targets must have the same shape as {name} {tuple(inputs.shape)}, "
                         f"got {tuple(targets.shape)}")


def _check_attention_mask(attention_mask, batch: int, total: int) -> torch.Tensor:
    """``attention_mask`` as a bool tensor, or a clear error unless it is bool or 0/1 integers of shape
    ``(batch, total)``."""
    expected = f"(batch, cached + new tokens) = ({batch}, {total})"
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.dtype.is_floating_point \
            or attention_mask.dtype.is_complex:
        got = attention_mask.dtype if isinstance(attention_mask, torch.Tensor) else type(attention_mask).__name__
        raise TypeError(f"attention_mask must be a bool or 0/1 integer torch.Tensor of shape {expected} (True/1 = "
                        f"a real token, False/0 = padding), got {got}")
    if tuple(attention_mask.shape) != (batch, total):
        raise ValueError(f"attention_mask must have shape {expected}, got {tuple(attention_mask.shape)}")
    if attention_mask.dtype != torch.bool:
        if bool(((attention_mask != 0) & (attention_mask != 1)).any()):
            raise ValueError("attention_mask must hold 0 (padding) and 1 (a real token) only, got values "
                             f"{sorted(set(attention_mask.unique().tolist()) - {0, 1})[:5]}")
        attention_mask = attention_mask.bool()
    return attention_mask


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
    activation: str = "gelu"  # FFN φ: "relu", "gelu", "gelu_tanh" (GPT-2) or "swiglu" (LLaMA)
    bias: bool = True  # biases in every linear layer (LLaMA: False)
    n_kv_heads: int | None = None  # grouped-query attention; None = n_heads
    qk_norm: bool = False  # RMSNorm of each query and key head
    parallel_block: bool = False  # x + Attn(LN(x)) + FFN(LN(x)) (GPT-J, PaLM)
    rope_pairing: str = "interleaved"  # "half" for LLaMA / GPT-NeoX checkpoints
    rope_base: float = 10000.0
    norm_eps: float | None = None  # None keeps each norm's default

    def __post_init__(self):
        if self.d_ff is None:
            self.d_ff = 4 * self.d_model
        for name in ("vocab_size", "context_length", "d_model", "n_layers", "n_heads", "d_ff"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
            if type(value) is not int:  # a NumPy integer, say: store the plain int
                setattr(self, name, int(value))
        _check_block_options(self, POSITIONALS)
        _check_modern_options(self)

    @property
    def d_head(self) -> int:
        """The size of one attention head, d_model / n_heads."""
        return self.d_model // self.n_heads


class GPT(nn.Module):
    """A decoder-only transformer language model: ``forward(idx, targets=None) -> (logits, loss)``.

    Initialisation follows GPT-2/nanoGPT: linear weights N(0, 0.02²), biases 0, and the two projections that
    write into the residual stream (``W_o``, ``W_out``) scaled down by ``1/sqrt(2 n_layers)`` so the stream's
    variance does not grow with depth. The token embedding starts small, tied to the unembedding or not
    (``init="small"``: entries N(0, 0.02²), GPT-2's start); an untied unembedding starts with entries
    N(0, 1/d_model). Chapter 3's runs of an untied model credit rows at RMS 1 (``init="rms"``) only with a faster
    start next to a fixed position table, and saw them end level or behind; to start there anyway, set
    ``model.token_embedding.init = "rms"`` and call ``model.token_embedding.reset_parameters()``.
    """

    causal = True
    """Position i attends to positions <= i only (a decoder). :class:`MaskedLM` sets it to False."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        if not isinstance(config, GPTConfig):
            raise TypeError(f"config must be a GPTConfig, got {type(config).__name__}")
        self.config = c = config
        self.token_embedding = TokenEmbedding(c.vocab_size, c.d_model, init="small")
        if c.positional == "learned":
            self.position_embedding = LearnedPositionalEmbedding(c.context_length, c.d_model)
        elif c.positional == "sinusoidal":
            self.register_buffer("position_encoding", sinusoidal_encoding(c.context_length, c.d_model),
                                 persistent=False)
        elif c.positional == "relative":  # one learned b_{t-i} per head, shared by all layers (as in T5)
            self.relative_bias = RelativePositionBias(c.n_heads, c.context_length, bidirectional=not self.causal)
        elif c.positional == "alibi":
            self.register_buffer("alibi", alibi_bias(c.n_heads, c.context_length), persistent=False)
        elif c.positional == "rope":
            self.rotary = RotaryEmbedding(c.d_head, base=c.rope_base, pairing=c.rope_pairing)
        self.dropout = nn.Dropout(c.dropout)
        self.blocks = nn.ModuleList(TransformerBlock(c) for _ in range(c.n_layers))
        # Post-LN blocks already end in a norm; Pre-LN leaves the stream unnormalised, so normalise once more.
        self.final_norm = make_norm(c.norm, c.d_model, c.norm_eps) if c.norm_position == "pre" else nn.Identity()
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
                cache: list[KVCache] | None = None, last_only: bool = False,
                attention_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits ``(batch, seq, vocab_size)`` for token ids ``idx (batch, seq)``, and the loss.

        ``targets`` (same shape as ``idx``, usually ``idx`` shifted by one) gives ``loss``, the mean
        cross-entropy of the next-token predictions (positions whose target is -100 are ignored; on the CPU,
        targets that ignore every position raise ``ValueError`` instead of giving a nan loss); without
        targets ``loss`` is None. ``cache`` (from :meth:`new_cache`) makes ``idx`` continue the positions
        already cached, for generation with a KV cache. ``last_only=True`` unembeds the last position only and
        returns logits ``(batch, 1, vocab_size)``: generation reads nothing else, and for a large vocabulary the
        unembedding of every prompt position is most of a prefill's work (SmolLM2: 49,152 x 576 per row). The
        last row equals the full forward's last row up to rounding (a matrix-vector product instead of a
        matrix product may sum in another order). It cannot be combined with ``targets``.

        ``attention_mask`` (bool or 0/1 integers, shape ``(batch, cached + new tokens)``, Hugging Face's
        convention: True/1 a real token, False/0 padding) runs a batch of padded sequences: see
        :meth:`hidden_states`. The logits at padded positions are meaningless (finite).
        """
        c = self.config
        if not isinstance(last_only, bool):
            raise TypeError(f"last_only must be True or False, got {last_only!r}")
        if last_only and targets is not None:
            raise ValueError("last_only=True gives the last position's logits only; the loss needs every "
                             "position's: pass targets without last_only")
        hidden = self.hidden_states(idx, cache=cache, attention_mask=attention_mask)
        if last_only:
            hidden = hidden[:, -1:, :]
        logits = self.unembedding(hidden)  # logits_i = U x_i^(n_L)

        loss = None
        if targets is not None:
            _check_targets(targets, idx, "idx")
            try:
                loss = F.cross_entropy(logits.reshape(-1, c.vocab_size), targets.reshape(-1).long())
            except IndexError as err:  # the kernel's own range check ("Target 300 is out of bounds.")
                raise ValueError(f"targets must lie in [0, {c.vocab_size - 1}] (vocab_size={c.vocab_size}) or be "
                                 f"-100 (ignored): {err}") from None
            # Every target ignored: the mean over no positions is 0/0 = nan. Checked only when the loss is nan
            # and only on the CPU, where it costs nothing (on a GPU it would wait for the device every step); not
            # while torch.compile traces, where the test of a value would break the graph (the loss is then nan).
            if loss.device.type == "cpu" and not torch.compiler.is_compiling() and torch.isnan(loss) \
                    and bool((targets == -100).all()):
                raise ValueError("every target is -100 (ignored): the mean loss over no positions is undefined; "
                                 "give at least one target in [0, vocab_size)")
        return logits, loss

    def hidden_states(self, idx: torch.Tensor, *, cache: list[KVCache] | None = None,
                      attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The final hidden states ``(batch, seq, d_model)`` for token ids ``idx (batch, seq)``.

        The vectors the unembedding reads, after the final norm (Pre-LN) or the last block's norm (Post-LN):
        ``forward``'s logits are ``unembedding(hidden_states(idx))``. A task head (chapter 13's
        :class:`~groundup.classification.ClassifierHead`) reads them instead of the logits. ``cache`` as in
        :meth:`forward`.

        ``attention_mask (batch, cached + new tokens)``, True/1 for a real token and False/0 for padding, covers
        the cached positions too. Each token's position is then the number of real tokens before it in its row
        (pads count 0), no query attends to a padded key, and ALiBi's or the relative bias's distances are
        differences of those positions: a left-padded sequence gets the positions, the attention and so the
        outputs it would get alone (up to rounding), in every positional family. A pad's own output is
        meaningless but finite (it attends to itself only, so no softmax row is empty).
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
        mask = None
        if attention_mask is None:
            positions = torch.arange(start, total, device=idx.device)
        else:
            real = _check_attention_mask(attention_mask, idx.shape[0], total).to(idx.device)
            key_positions = (real.long().cumsum(dim=1) - 1).clamp(min=0)  # (batch, total): real tokens before
            positions = key_positions[:, start:]  # (batch, n): the new tokens' own
            itself = torch.arange(total, device=idx.device) == torch.arange(start, total, device=idx.device)[:, None]
            # (batch, 1, n, total): the real keys, and each query's own key, so that no softmax row is empty (a pad
            # attending nothing gives nan in PyTorch < 2.5, which the pads' keys and values would carry to every row)
            mask = real[:, None, None, :] | itself

        x = self.token_embedding(idx)  # x_i^(0) = F(W_E[Ind(i)], PosEmbed(i)) with F = addition
        if c.positional == "learned":
            x = x + self.position_embedding(positions)
        elif c.positional == "sinusoidal":
            x = x + self.position_encoding[positions]
        x = self.dropout(x)

        attn_bias = None
        if c.positional in ("relative", "alibi"):
            table = self.relative_bias(total) if c.positional == "relative" else self.alibi[:, :total, :total]
            if mask is None:
                attn_bias = table[:, start:, :]
            else:  # entry [b, h, t, i] = table[h, position of query t, position of key i] in row b
                attn_bias = table[:, positions[:, :, None], key_positions[:, None, :]].transpose(0, 1)
        rotary = self.rotary if c.positional == "rope" else None
        for layer, block in enumerate(self.blocks):
            x = block(x, mask=mask, attn_bias=attn_bias, rotary=rotary, positions=positions, is_causal=self.causal,
                      cache=None if cache is None else cache[layer])  # is_causal: causal_mask(n, n_keys=total)
        return self.final_norm(x)


@dataclass
class MaskedLMConfig(GPTConfig):
    """The hyperparameters of a :class:`MaskedLM`: those of :class:`GPTConfig`, plus the mask token.

    The mask token [MASK] is one of the model's ``vocab_size`` ids: ``mask_token_id`` (None: the last id,
    ``vocab_size - 1``). With a tokenizer of n_V tokens, use ``vocab_size = n_V + 1`` and the default, so the
    tokenizer's ids 0 .. n_V - 1 keep their meaning and id n_V is [MASK] (chapter 9 does this).
    """

    mask_token_id: int | None = None

    def __post_init__(self):
        super().__post_init__()
        if self.mask_token_id is None:
            self.mask_token_id = self.vocab_size - 1
        value = self.mask_token_id
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not 0 <= value < self.vocab_size:
            raise ValueError(f"mask_token_id must be an integer in [0, vocab_size) = [0, {self.vocab_size}), "
                             f"got {value!r}")
        self.mask_token_id = int(value)


class MaskedLM(GPT):
    """A masked (missing-token) language model: a bidirectional transformer encoder, as BERT.

    The same stack, initialisation and checks as :class:`GPT`, with one difference: no causal mask, so every
    position attends to every position, before and after it. ``forward(idx, targets=None) -> (logits, loss)``
    gives logits for the token *at* each position i (a GPT's logits at i are for the token at i + 1), and the
    loss is the mean cross-entropy over the positions whose target is not -100 -- the masked positions, as
    :func:`groundup.masking.mask_tokens` makes the targets. It is not a generator: there is no KV cache.
    """

    causal = False

    def __init__(self, config: MaskedLMConfig):
        if not isinstance(config, MaskedLMConfig):
            raise TypeError(f"config must be a MaskedLMConfig, got {type(config).__name__}")
        super().__init__(config)

    def new_cache(self):
        raise TypeError("a MaskedLM has no KV cache: it is not a generator (every position sees the whole "
                        "sequence, so nothing can be computed once and kept)")

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, *,
                attention_mask: torch.Tensor | None = None, **kwargs):
        """Logits ``(batch, seq, vocab_size)`` for the token at every position of ``idx (batch, seq)``, and the loss.

        ``targets`` (same shape as ``idx``): the original token at the masked positions, -100 elsewhere; ``loss``
        is the mean cross-entropy over the masked positions only (None without targets). ``attention_mask``
        ``(batch, seq)`` (True/1 a real token, False/0 padding) as in :meth:`GPT.hidden_states`: no position
        attends to padding, on either side.
        """
        if kwargs:
            raise TypeError(f"MaskedLM.forward takes idx, targets and attention_mask only, got {', '.join(kwargs)} "
                            "(a masked LM has no KV cache)")
        return super().forward(idx, targets, attention_mask=attention_mask)


# --------------------------------------------------------------------------------------------------------
# The encoder–decoder transformer of "Attention is all you need" (chapter 10)
# --------------------------------------------------------------------------------------------------------

ENCODER_DECODER_POSITIONALS = ("sinusoidal", "learned")
"""The absolute positional encodings :class:`EncoderDecoderConfig` accepts (added to both stacks' inputs)."""


def _check_ids(name: str, ids, vocab_size: int, context_length: int) -> None:
    """A clear error unless ``ids`` is a (batch, seq) integer tensor with 1 <= seq <= context_length, in range."""
    if not isinstance(ids, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of integer token ids, got {type(ids).__name__}")
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise TypeError(f"{name} must hold integer token ids (e.g. torch.long), got dtype {ids.dtype}")
    if ids.dim() != 2 or ids.shape[0] == 0 or ids.shape[1] == 0:
        raise ValueError(f"{name} must have shape (batch, seq) with batch, seq >= 1, got {tuple(ids.shape)}")
    if ids.shape[1] > context_length:
        raise ValueError(f"{name} has length {ids.shape[1]}, which exceeds context_length {context_length}")
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= vocab_size:
        raise ValueError(f"{name} holds token ids from {lo} to {hi}, outside its vocabulary: ids must be in "
                         f"[0, {vocab_size - 1}]")


@dataclass
class EncoderDecoderConfig:
    """The hyperparameters of an :class:`EncoderDecoder` (the seeds' symbols in brackets).

    A sibling of :class:`GPTConfig` with the same names and defaults where they mean the same thing. The source
    and the target have vocabularies of their own (``src_vocab_size``, ``tgt_vocab_size``) that share the ids of
    the three special tokens: ``pad_id`` (padding, ignored everywhere), ``start_id`` (the first token of every
    decoder input) and ``end_id`` (the decoder's last prediction). ``context_length`` (n_C) bounds the source
    and the decoder input separately. The encoder has ``n_encoder_layers`` blocks, the decoder
    ``n_decoder_layers``. ``positional`` is "sinusoidal" (Vaswani et al. 2017) or "learned", added to the
    token embeddings of both stacks. ``tie_weights`` shares the decoder's embedding matrix with the unembedding
    U (both index the target vocabulary).
    """

    src_vocab_size: int = 64
    tgt_vocab_size: int = 64
    context_length: int = 32  # n_C, for the source and for the decoder input
    d_model: int = 64  # d_M
    n_encoder_layers: int = 2
    n_decoder_layers: int = 2
    n_heads: int = 4  # n_H
    d_ff: int | None = None  # d_FFN; None means 4 * d_model
    positional: str = "sinusoidal"
    norm: str = "layernorm"
    norm_position: str = "pre"
    dropout: float = 0.0
    tie_weights: bool = True
    pad_id: int = 0
    start_id: int = 1
    end_id: int = 2

    def __post_init__(self):
        if self.d_ff is None:
            self.d_ff = 4 * self.d_model
        for name in ("src_vocab_size", "tgt_vocab_size", "context_length", "d_model", "n_encoder_layers",
                     "n_decoder_layers", "n_heads", "d_ff"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
            setattr(self, name, int(value))
        for name in ("pad_id", "start_id", "end_id"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
                raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
            setattr(self, name, int(value))
            limit = min(self.src_vocab_size, self.tgt_vocab_size) if name == "pad_id" else self.tgt_vocab_size
            if value >= limit:
                raise ValueError(f"{name} = {value} is outside the vocabulary (size {limit})")
        if len({self.pad_id, self.start_id, self.end_id}) != 3:
            raise ValueError(f"pad_id, start_id and end_id must be three different ids, got {self.pad_id}, "
                             f"{self.start_id}, {self.end_id}")
        _check_block_options(self, ENCODER_DECODER_POSITIONALS)

    @property
    def d_head(self) -> int:
        """The size of one attention head, d_model / n_heads."""
        return self.d_model // self.n_heads


class EncoderDecoder(nn.Module):
    """The encoder–decoder transformer of Vaswani et al. (2017): ``forward(src, tgt_in, targets=None)``.

    * The **encoder** embeds the source ids (+ positions) and runs ``n_encoder_layers`` bidirectional
      :class:`~groundup.layers.TransformerBlock` s whose only mask hides the source's padding: the output
      ``memory`` holds one contextual embedding per source token.
    * The **decoder** embeds the decoder input ``tgt_in`` -- the target shifted right behind the start token,
      ``[start, y_1, ..., y_n]`` -- and runs ``n_decoder_layers`` :class:`~groundup.layers.DecoderBlock` s:
      causal self-attention (position i sees the decoder inputs up to i, i.e. ``y_<i`` and the start token),
      cross-attention with queries from the decoder and keys and values from ``memory`` (padded source
      positions masked), and the FFN. The unembedding turns its output into logits over the target vocabulary
      for ``targets = [y_1, ..., y_n, end]``: teacher forcing, every position predicting the next target
      token from the true ones before it.
    * The **loss** is the mean cross-entropy over the real target positions: targets equal to ``pad_id`` (or
      -100) are ignored, and they must sit exactly where ``tgt_in`` is padded.

    Padding is ``pad_id`` anywhere after a sequence's tokens; a padded position changes no output at a real one.
    Initialisation as :class:`GPT`: linear weights N(0, 0.02²), biases 0, the projections that write into the
    residual stream scaled by ``1/sqrt(number of residual writes in that stack)`` (2 per encoder block, 3 per
    decoder block). The target embedding starts at N(0, 0.02²) (``init="small"``), tied or not; the source
    embedding, never tied, at RMS 1 per row (``init="rms"``, chapter 3's derivation).
    """

    def __init__(self, config: EncoderDecoderConfig):
        super().__init__()
        if not isinstance(config, EncoderDecoderConfig):
            raise TypeError(f"config must be an EncoderDecoderConfig, got {type(config).__name__}")
        self.config = c = config
        self.src_embedding = TokenEmbedding(c.src_vocab_size, c.d_model, init="rms")
        self.tgt_embedding = TokenEmbedding(c.tgt_vocab_size, c.d_model, init="small")
        if c.positional == "learned":
            self.src_position = LearnedPositionalEmbedding(c.context_length, c.d_model)
            self.tgt_position = LearnedPositionalEmbedding(c.context_length, c.d_model)
        else:
            self.register_buffer("position_encoding", sinusoidal_encoding(c.context_length, c.d_model),
                                 persistent=False)
        self.dropout = nn.Dropout(c.dropout)
        self.encoder = nn.ModuleList(TransformerBlock(c) for _ in range(c.n_encoder_layers))
        self.decoder = nn.ModuleList(DecoderBlock(c) for _ in range(c.n_decoder_layers))
        pre = c.norm_position == "pre"  # Post-LN blocks end in a norm already
        self.encoder_norm = make_norm(c.norm, c.d_model) if pre else nn.Identity()
        self.decoder_norm = make_norm(c.norm, c.d_model) if pre else nn.Identity()
        self.unembedding = Unembedding(c.d_model, c.tgt_vocab_size,
                                       tied_to=self.tgt_embedding if c.tie_weights else None)
        self._init_weights()

    @torch.no_grad()
    def _init_weights(self) -> None:
        c = self.config
        scale = {"encoder": INIT_STD / math.sqrt(2 * c.n_encoder_layers),
                 "decoder": INIT_STD / math.sqrt(3 * c.n_decoder_layers)}
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                is_residual = name.endswith("attention.W_o") or name.endswith("ffn.W_out")
                module.weight.normal_(0.0, scale[name.split(".")[0]] if is_residual else INIT_STD)
                if module.bias is not None:
                    module.bias.zero_()

    def _embed(self, ids: torch.Tensor, table: TokenEmbedding, which: str) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        x = table(ids)  # x_i^(0) = W_E[Ind(i)] + PosEmbed(i)
        if self.config.positional == "learned":
            x = x + getattr(self, f"{which}_position")(positions)
        else:
            x = x + self.position_encoding[positions]
        return self.dropout(x)

    def encode(self, src: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The encoder: ``memory (batch, src_len, d_model)`` and ``src_mask (batch, src_len)`` (True = a token).

        Every source position attends to every non-padded source position, before and after it.
        """
        c = self.config
        _check_ids("src", src, c.src_vocab_size, c.context_length)
        src_mask = src != c.pad_id
        empty = ~src_mask.any(dim=1)
        if empty.any():
            raise ValueError(f"src row {int(empty.nonzero()[0])} is all padding (pad_id={c.pad_id}): every source "
                             "needs at least one token")
        mask = src_mask[:, None, None, :]  # (batch, 1, 1, src_len): no query attends to a padded key
        x = self._embed(src, self.src_embedding, "src")
        for block in self.encoder:
            x = block(x, mask=mask)
        return self.encoder_norm(x), src_mask

    def decode(self, tgt_in: torch.Tensor, memory: torch.Tensor, src_mask: torch.Tensor) -> torch.Tensor:
        """The decoder: logits ``(batch, tgt_len, tgt_vocab_size)`` for the decoder input ``tgt_in``.

        ``memory`` and ``src_mask`` come from :meth:`encode` (they must have the same batch and length).
        ``tgt_in`` must begin with ``start_id``; position i predicts the token after ``tgt_in[:, i]``.
        """
        c = self.config
        _check_ids("tgt_in", tgt_in, c.tgt_vocab_size, c.context_length)
        if not isinstance(memory, torch.Tensor) or memory.dim() != 3 or memory.shape[-1] != c.d_model:
            got = tuple(memory.shape) if isinstance(memory, torch.Tensor) else type(memory).__name__
            raise ValueError(f"memory must have shape (batch, src_len, d_model={c.d_model}), got {got}")
        if not isinstance(src_mask, torch.Tensor) or src_mask.dtype != torch.bool \
                or tuple(src_mask.shape) != tuple(memory.shape[:2]):
            got = (f"{src_mask.dtype} of shape {tuple(src_mask.shape)}" if isinstance(src_mask, torch.Tensor)
                   else type(src_mask).__name__)
            raise ValueError(f"src_mask must be a bool tensor of shape (batch, src_len) = {tuple(memory.shape[:2])}, "
                             f"the padding mask of memory (from encode), got {got}: mismatched padding masks")
        if tgt_in.shape[0] != memory.shape[0]:
            raise ValueError(f"tgt_in has batch size {tgt_in.shape[0]} but memory {memory.shape[0]}")
        if not bool((tgt_in[:, 0] == c.start_id).all()):
            raise ValueError(f"every decoder input must begin with the start token (start_id={c.start_id}): "
                             "tgt_in = [start] + target, the target shifted right by one")
        n = tgt_in.shape[1]
        tgt_mask = tgt_in != c.pad_id
        # causal and, for robustness, no attention to padded decoder inputs (with right-padding the causal mask
        # already hides them from every real position)
        self_mask = causal_mask(n, device=tgt_in.device) & tgt_mask[:, None, None, :]
        memory_mask = src_mask[:, None, None, :]  # queries from the decoder, keys and values from the encoder
        x = self._embed(tgt_in, self.tgt_embedding, "tgt")
        for block in self.decoder:
            x = block(x, memory, mask=self_mask, memory_mask=memory_mask)
        return self.unembedding(self.decoder_norm(x))

    def forward(self, src: torch.Tensor, tgt_in: torch.Tensor,
                targets: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits ``(batch, tgt_len, tgt_vocab_size)`` of the next target token at every decoder position, and the
        loss: the mean cross-entropy against ``targets`` (same shape as ``tgt_in``) over its non-padded positions
        (None without targets)."""
        c = self.config
        memory, src_mask = self.encode(src)
        logits = self.decode(tgt_in, memory, src_mask)
        loss = None
        if targets is not None:
            _check_targets(targets, tgt_in, "tgt_in")
            ignored = (targets == c.pad_id) | (targets == -100)
            if not torch.equal(ignored, tgt_in == c.pad_id):
                raise ValueError("the padding of targets does not match that of tgt_in (mismatched padding masks): "
                                 f"targets must be padded (pad_id={c.pad_id} or -100) exactly where tgt_in is; build "
                                 "both from one sequence y: tgt_in = [start] + y, targets = y + [end]")
            kept = targets[~ignored]
            if kept.numel() and (int(kept.min()) < 0 or int(kept.max()) >= c.tgt_vocab_size):
                raise ValueError(f"targets must lie in [0, {c.tgt_vocab_size - 1}] (tgt_vocab_size="
                                 f"{c.tgt_vocab_size}), or be pad_id / -100 (ignored)")
            loss = F.cross_entropy(logits.reshape(-1, c.tgt_vocab_size),
                                   targets.masked_fill(ignored, -100).reshape(-1).long())
        return logits, loss
