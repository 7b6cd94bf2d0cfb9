"""The parts of a transformer block (chapter 6): the norms, the feed-forward network, and the blocks.

A block reads from and writes to the *residual stream* ``x`` of shape ``(batch, seq, d_model)``::

    Post-LN (the seeds' equations, Vaswani et al. 2017)   Pre-LN (GPT-2 onwards, Xiong et al. 2020)
    x = norm_1(x + attention(x))                          x = x + attention(norm_1(x))
    x = norm_2(x + ffn(x))                                x = x + ffn(norm_2(x))

The blocks take any ``config`` object with the fields ``d_model, n_heads, d_ff, norm, norm_position,
dropout`` (for example :class:`groundup.models.GPTConfig`).
"""

from __future__ import annotations

import numbers

import torch
import torch.nn.functional as F
from torch import nn

from groundup.attention import MultiHeadAttention
from groundup.linear import Linear
from groundup.norms import (  # noqa: F401 (LayerNorm, RMSNorm: public here too)
    NORMS,
    LayerNorm,
    RMSNorm,
    _check_last_dim,
    _dtype_error,
    make_norm,
)
from groundup.utils import positive_int

NORM_POSITIONS = ("pre", "post")
ACTIVATIONS = ("relu", "gelu", "gelu_tanh", "swiglu")


class FeedForward(nn.Module):
    """FFN(x) = W_out φ(W_in x + β_in) + β_out, applied to every position separately and identically.

    ``W_in`` maps d_model → d_ff (the hidden size d_FFN), ``W_out`` maps back. ``activation`` chooses φ:

    * ``"relu"``; ``"gelu"`` (exact, x Φ(x) with the erf); ``"gelu_tanh"`` (the tanh approximation
      ``0.5 x (1 + tanh(sqrt(2/π)(x + 0.044715 x^3)))`` that GPT-2 uses, ``F.gelu(approximate="tanh")``);
    * ``"swiglu"`` (Shazeer 2020, as in LLaMA): a third matrix ``W_gate`` (d_model → d_ff) and
      ``FFN(x) = W_out (silu(W_gate x + β_gate) ⊙ (W_in x + β_in)) + β_out``. It has 3 d_model d_ff weights
      instead of 2, so ``d_ff ≈ 8/3 d_model`` keeps the parameter count of a 4 d_model GELU FFN.

    ``bias=False`` removes every bias (LLaMA has none).
    """

    def __init__(self, d_model: int, d_ff: int, *, activation: str = "gelu", dropout: float = 0.0,
                 bias: bool = True):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
        if not isinstance(bias, bool):
            raise TypeError(f"bias must be True or False, got {bias!r}")
        d_model, d_ff = positive_int("d_model", d_model), positive_int("d_ff", d_ff)
        _check_dropout(dropout)
        self.d_model, self.d_ff, self.activation = d_model, d_ff, activation
        if activation == "swiglu":
            self.W_gate = Linear(d_model, d_ff, bias=bias)  # weight [d_ff, d_model]
        self.W_in = Linear(d_model, d_ff, bias=bias)  # weight [d_ff, d_model], bias β_in
        self.W_out = Linear(d_ff, d_model, bias=bias)  # weight [d_model, d_ff], bias β_out
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check_last_dim(x, self.d_model, "FeedForward")
        try:
            h = self.W_in(x)
        except RuntimeError as err:
            raise _dtype_error("FeedForward", x, self.W_in.weight, err) from err
        if self.activation == "relu":
            h = F.relu(h)
        elif self.activation == "gelu":
            h = F.gelu(h)
        elif self.activation == "gelu_tanh":
            h = F.gelu(h, approximate="tanh")
        else:
            h = F.silu(self.W_gate(x)) * h
        return self.dropout(self.W_out(h))

    def extra_repr(self) -> str:
        return f"activation={self.activation!r}"


def _check_stream(x, d_model: int, name: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} expects x to be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 3 or x.shape[-1] != d_model:
        raise ValueError(f"{name} expects x of shape (batch, seq, d_model={d_model}), got {tuple(x.shape)}")


def _check_dropout(dropout) -> None:
    if isinstance(dropout, bool) or not isinstance(dropout, numbers.Real):
        raise TypeError(f"dropout must be a number in [0, 1) (a probability), got {type(dropout).__name__} "
                        f"{dropout!r}")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"dropout must be in [0, 1), got {dropout!r}")


def _check_config(config) -> None:
    for name in ("d_model", "n_heads", "d_ff"):
        positive_int(f"config.{name}", getattr(config, name))
    _check_dropout(config.dropout)
    if config.d_model % config.n_heads != 0:
        raise ValueError(f"d_model ({config.d_model}) must be divisible by n_heads ({config.n_heads})")
    if config.norm_position not in NORM_POSITIONS:
        raise ValueError(f"norm_position must be one of {NORM_POSITIONS}, got {config.norm_position!r}")
    if config.norm not in NORMS:
        raise ValueError(f"norm must be one of {NORMS}, got {config.norm!r}")
    if getattr(config, "parallel_block", False) and config.norm_position != "pre":
        raise ValueError("parallel_block=True needs norm_position='pre' (x + Attn(LN(x)) + FFN(LN(x)))")


class TransformerBlock(nn.Module):
    """One block T^(ℓ): self-attention and a feed-forward network, each with a residual connection and a norm.

    ``config.norm_position`` chooses Post-LN ("post", the seeds' equations) or Pre-LN ("pre"); ``config.norm``
    chooses LayerNorm or RMSNorm. Masks and positional information are passed to :meth:`forward`, so the same
    block serves a causal decoder (GPT) and a bidirectional encoder.

    Optional config fields (read with defaults, so older configs still work): ``activation``, ``bias`` (all
    linear layers), ``n_kv_heads`` and ``qk_norm`` (see :class:`MultiHeadAttention`), ``norm_eps`` and
    ``parallel_block``: attention and FFN read the same normalised stream and both write to it,
    ``x + Attn(LN(x)) + FFN(LN(x))`` with one norm (GPT-J, PaLM; Pre-LN only; the block has no ``norm_2``);
    ``ffn=False``: an attention-only block ``x + Attn(LN(x))``, with no ``ffn`` and no ``norm_2`` (chapter 14's
    induction-head models, :class:`groundup.induction.AttentionOnlyConfig`).
    """

    def __init__(self, config):
        super().__init__()
        _check_config(config)
        self.norm_position, self.d_model = config.norm_position, config.d_model
        self.parallel = getattr(config, "parallel_block", False)
        bias, eps = getattr(config, "bias", True), getattr(config, "norm_eps", None)
        self.norm_1 = make_norm(config.norm, config.d_model, eps)
        attn_kwargs = {} if eps is None else {"norm_eps": eps}
        self.attention = MultiHeadAttention(config.d_model, config.n_heads, dropout=config.dropout, bias=bias,
                                            n_kv_heads=getattr(config, "n_kv_heads", None),
                                            qk_norm=getattr(config, "qk_norm", False), **attn_kwargs)
        self.has_ffn = getattr(config, "ffn", True)
        if not isinstance(self.has_ffn, bool):
            raise TypeError(f"config.ffn must be True or False, got {self.has_ffn!r}")
        if self.has_ffn and not self.parallel:
            self.norm_2 = make_norm(config.norm, config.d_model, eps)
        if self.has_ffn:
            self.ffn = FeedForward(config.d_model, config.d_ff, activation=getattr(config, "activation", "gelu"),
                                   bias=bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor, *, mask=None, attn_bias=None, rotary=None, positions=None,
                cache=None, is_causal: bool = False) -> torch.Tensor:
        """Map the residual stream ``x`` (batch, seq, d_model) to the next layer's stream, same shape.

        The keywords go to :meth:`MultiHeadAttention.forward` (``is_causal=True``: the causal mask, without
        materialising it where the fused kernel can skip the masked blocks).
        """
        _check_stream(x, self.d_model, "TransformerBlock")
        def attend(h):
            return self.dropout(self.attention(h, mask=mask, attn_bias=attn_bias, rotary=rotary,
                                               positions=positions, cache=cache, is_causal=is_causal))

        if not self.has_ffn:  # attention only: x + Attn(LN(x)) (Pre-LN) or LN(x + Attn(x)) (Post-LN)
            return x + attend(self.norm_1(x)) if self.norm_position == "pre" else self.norm_1(x + attend(x))
        if self.parallel:
            h = self.norm_1(x)
            x = x + attend(h) + self.dropout(self.ffn(h))
        elif self.norm_position == "pre":
            x = x + attend(self.norm_1(x))  # read (normalised) from the stream, write the result back
            x = x + self.dropout(self.ffn(self.norm_2(x)))
        else:
            x = self.norm_1(x + attend(x))  # x^(ℓ−1,*) = LayerNorm(x + Attention(x))
            x = self.norm_2(x + self.dropout(self.ffn(x)))  # x^(ℓ) = LayerNorm(x^(ℓ−1,*) + FFN(x^(ℓ−1,*)))
        return x


class DecoderBlock(nn.Module):
    """A decoder block of an encoder–decoder model: causal self-attention, cross-attention, FFN.

    The cross-attention takes its queries from the decoder's stream and its keys and values from the
    encoder's output ``memory`` (batch, source_seq, d_model). Each sub-layer has a residual connection and a
    norm, placed as ``config.norm_position`` says.
    """

    def __init__(self, config):
        super().__init__()
        _check_config(config)
        self.norm_position = config.norm_position
        self.d_model = d = config.d_model
        self.norm_1 = make_norm(config.norm, d)
        self.self_attention = MultiHeadAttention(d, config.n_heads, dropout=config.dropout)
        self.norm_2 = make_norm(config.norm, d)
        self.cross_attention = MultiHeadAttention(d, config.n_heads, dropout=config.dropout)
        self.norm_3 = make_norm(config.norm, d)
        self.ffn = FeedForward(d, config.d_ff, activation=getattr(config, "activation", "gelu"))
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor, memory: torch.Tensor, *, mask=None, memory_mask=None, attn_bias=None,
                rotary=None, positions=None, cache=None) -> torch.Tensor:
        """``mask``: the decoder's self-attention mask (usually causal); ``memory_mask``: which encoder
        positions each decoder position may attend to (e.g. padding), broadcastable to (..., seq, source_seq).
        """
        _check_stream(x, self.d_model, "DecoderBlock")
        if not isinstance(memory, torch.Tensor) or memory.dim() != 3 or memory.shape[-1] != self.d_model:
            shape = tuple(memory.shape) if isinstance(memory, torch.Tensor) else type(memory).__name__
            raise ValueError(f"memory must have shape (batch, source_seq, {self.d_model}), got {shape}")
        sublayers = [
            (self.norm_1, lambda h: self.self_attention(h, mask=mask, attn_bias=attn_bias, rotary=rotary,
                                                        positions=positions, cache=cache)),
            (self.norm_2, lambda h: self.cross_attention(h, memory, mask=memory_mask)),
            (self.norm_3, self.ffn),
        ]
        for norm, f in sublayers:
            if self.norm_position == "pre":
                x = x + self.dropout(f(norm(x)))
            else:
                x = norm(x + self.dropout(f(x)))
        return x
