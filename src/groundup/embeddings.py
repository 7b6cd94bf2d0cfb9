"""Token embeddings and the unembedding (chapter 3).

The embedding matrix ``W_E`` (``TokenEmbedding.weight``, shape ``[vocab_size, d_model]``) turns token ids into
vectors: multiplying a one-hot vector by it picks out one row, so the forward pass is a row lookup. The
unembedding ``U`` (``Unembedding.weight``, also ``[vocab_size, d_model]``) turns a final hidden vector ``x`` into
logits ``U x``, one per vocabulary entry; softmax turns those into next-token probabilities.

Initialisation follows the RMS-norm argument of chapter 3: every token's vector has RMS norm 1, so the input of
the first block is at RMS 1; the unembedding's entries are of order ``1/sqrt(d_model)``, so a hidden vector at
RMS 1 gives logits of order 1. :class:`~groundup.models.GPT` starts its token embedding small instead
(``init="small"``, tied or not), the start chapter 3's training runs favour or tie with.
"""

from __future__ import annotations

import math
import numbers

import torch
import torch.nn.functional as F
from torch import nn

from groundup.linear import linear

INITS = ("rms", "normal", "small")
"""The initialisations :class:`TokenEmbedding` accepts (see its docstring)."""

SMALL_STD = 0.02
"""Standard deviation of ``init="small"``: GPT-2's (and nanoGPT's) choice for its embedding matrices."""

_INTEGER_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def rms(x: torch.Tensor, dim: int = -1, *, keepdim: bool = False) -> torch.Tensor:
    """The RMS norm ``||x||_RMS = sqrt(mean_i x_i^2)`` along ``dim`` (the Euclidean norm divided by ``sqrt(n)``)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        x = x.to(torch.get_default_dtype())
    return x.pow(2).mean(dim=dim, keepdim=keepdim).sqrt()


def _check_size(name: str, value) -> int:
    """``value`` as an int (Python or NumPy integers), or a ValueError naming ``name``."""
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


class TokenEmbedding(nn.Module):
    """The embedding matrix ``W_E`` as a module: ``forward(ids)`` returns ``W_E[ids]``, shape ``[..., d_model]``.

    ``init`` chooses how ``weight`` (``[vocab_size, d_model]``, trainable) starts:

    - ``"rms"`` (default): Gaussian rows rescaled so that **every row has RMS norm exactly 1**, i.e.
      ``sqrt(mean_j W_E[k, j]^2) == 1`` for every token ``k``. A one-hot input has RMS ``1/sqrt(vocab_size)``;
      the lookup hands the next layer a vector at RMS 1, the scale the rest of the network is built for.
    - ``"normal"``: entries ``N(0, 1)``, PyTorch's ``nn.Embedding`` default: RMS 1 *in expectation* only (each
      row's RMS fluctuates around 1 by about ``1/sqrt(2 d_model)``).
    - ``"small"``: entries ``N(0, 0.02^2)``, GPT-2's choice (rows at RMS 0.02); sensible with weight tying,
      where the same matrix also serves as the unembedding, and :class:`~groundup.models.GPT`'s start, tied or not.
    """

    def __init__(self, vocab_size: int, d_model: int, *, init: str = "rms"):
        super().__init__()
        vocab_size, d_model = _check_size("vocab_size", vocab_size), _check_size("d_model", d_model)
        if init not in INITS:
            raise ValueError(f"init must be one of {', '.join(repr(i) for i in INITS)}; got {init!r}")
        self.vocab_size = vocab_size
        self.d_model = d_model
        self.init = init
        self.weight = nn.Parameter(torch.empty(vocab_size, d_model))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """(Re-)draw ``weight`` according to ``self.init`` from PyTorch's global random generator."""
        if self.init == "rms":
            w = torch.randn(self.vocab_size, self.d_model)
            # w / rms(w), written with rsqrt: torch's float32 sqrt calls MKL's, whose last bit depends on the CPU's
            # maker (tools/nbval_lanes.py), and these weights are trained; rsqrt is 1 / (IEEE sqrt) on every CPU.
            self.weight.copy_(w * w.pow(2).mean(dim=-1, keepdim=True).rsqrt())
        elif self.init == "normal":
            self.weight.normal_(0.0, 1.0)
        else:
            self.weight.normal_(0.0, SMALL_STD)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Look up the rows of ``weight`` for integer token ids of any shape; returns ``[*ids.shape, d_model]``.

        Only cheap checks run on every call (a tensor, an integer dtype): the ids are never reduced (no
        ``ids.min()`` / ``ids.max()``), because turning such a reduction into a Python number makes the host wait
        for a GPU at every step. The range is checked by the lookup itself: on the CPU an id outside
        ``[0, vocab_size)`` raises ``ValueError`` naming it (the ids are inspected only then, when the step has
        failed anyway); on a GPU the lookup's own device-side assertion fails.
        """
        if not isinstance(ids, torch.Tensor):
            raise TypeError(f"ids must be a torch.Tensor of integer token ids, got {type(ids).__name__}")
        if ids.dtype not in _INTEGER_DTYPES:
            raise TypeError(f"ids must have an integer dtype (e.g. torch.long), got {ids.dtype}")
        try:
            # F.embedding is the row lookup W_E[ids]; its backward is a fast scatter-add of rows. It checks the
            # range itself on the CPU, so a valid batch costs no extra pass over the ids (and no host sync on GPU).
            return F.embedding(ids.long(), self.weight)
        except IndexError:
            lo, hi = int(ids.min()), int(ids.max())
            bad = lo if lo < 0 else hi
            raise ValueError(f"ids must lie in [0, {self.vocab_size - 1}] (vocab_size={self.vocab_size}), "
                             f"got {bad}") from None

    def extra_repr(self) -> str:
        return f"vocab_size={self.vocab_size}, d_model={self.d_model}, init={self.init!r}"


class Unembedding(nn.Module):
    """The unembedding ``U`` as a module: ``forward(x)`` returns the logits ``U x``, shape ``[..., vocab_size]``.

    Untied, ``weight`` (``[vocab_size, d_model]``) starts with entries ``N(0, 1/d_model)``: a hidden vector at
    RMS 1 then gives logits of variance ``d_model * (1/d_model) * 1 = 1``. With ``tied_to=<TokenEmbedding>``
    (or an ``nn.Embedding``) there is no new parameter: ``weight`` *is* that embedding's ``weight`` (the same
    ``nn.Parameter``), so the model stores one ``[vocab_size, d_model]`` matrix and both uses train it. A tied
    matrix keeps the embedding's scale: with rows at RMS 1 (``init="rms"``) the logits of a hidden vector at RMS 1
    have standard deviation about ``sqrt(d_model)``, which is why tied models usually start the shared matrix
    small (``init="small"``) or scale the logits by ``1/sqrt(d_model)``.
    """

    def __init__(self, d_model: int, vocab_size: int, *, tied_to: nn.Module | None = None):
        super().__init__()
        d_model, vocab_size = _check_size("d_model", d_model), _check_size("vocab_size", vocab_size)
        self.d_model = d_model
        self.vocab_size = vocab_size
        if tied_to is None:
            self.weight = nn.Parameter(torch.randn(vocab_size, d_model) / math.sqrt(d_model))
        else:
            if not isinstance(tied_to, (TokenEmbedding, nn.Embedding)):
                raise TypeError(f"tied_to must be a TokenEmbedding (or nn.Embedding) or None, "
                                f"got {type(tied_to).__name__}")
            shape = tuple(tied_to.weight.shape)
            if shape != (vocab_size, d_model):
                raise ValueError(f"tied_to.weight must have shape (vocab_size, d_model) = ({vocab_size}, {d_model}) "
                                 f"to be tied, got {shape}")
            self.weight = tied_to.weight
        self.tied = tied_to is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits ``x @ U^T`` for hidden vectors ``x`` of shape ``[..., d_model]``."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        if not x.is_floating_point():
            raise TypeError(f"x must be a floating-point tensor, got {x.dtype}")
        if x.dim() == 0 or x.shape[-1] != self.d_model:
            raise ValueError(f"x must have shape [..., d_model={self.d_model}], got {tuple(x.shape)}")
        try:
            return linear(x, self.weight)
        except RuntimeError as err:
            if x.dtype != self.weight.dtype:
                raise TypeError(f"x has dtype {x.dtype} but the unembedding's weight is {self.weight.dtype}; "
                                f"convert one to the other (x.to({self.weight.dtype}) or module.to({x.dtype}))"
                                ) from err
            raise

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, vocab_size={self.vocab_size}, tied={self.tied}"
