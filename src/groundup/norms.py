"""The two normalisations of chapter 6, LayerNorm and RMSNorm, and ``make_norm`` that picks one by name.

They live apart from :mod:`groundup.layers` because attention (QK-norm) and the blocks both need them: with the
norms here, ``attention`` and ``layers`` import this module and never each other.
"""

from __future__ import annotations

import numbers

import torch
import torch.nn.functional as F
from torch import nn

from groundup.utils import positive_int

NORMS = ("layernorm", "rmsnorm")


def _check_last_dim(x: torch.Tensor, d: int, name: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} expects a torch.Tensor, got {type(x).__name__}")
    if x.dim() == 0 or x.shape[-1] != d:
        raise ValueError(f"{name} expects x with last dimension {d}, got shape {tuple(x.shape)}")


def _check_norm_args(d, eps) -> int:
    d = positive_int("d", d)
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real):
        raise TypeError(f"eps must be a positive number, got {type(eps).__name__} {eps!r}")
    if not eps > 0:
        raise ValueError(f"eps must be > 0, got {eps!r}")
    return d


def _dtype_error(name: str, x: torch.Tensor, weight: torch.Tensor, err: Exception) -> Exception:
    """A clear TypeError when ``x`` and the module's ``weight`` disagree in dtype, else ``err`` itself."""
    if x.dtype != weight.dtype:
        return TypeError(f"{name} got x of dtype {x.dtype} but its weight is {weight.dtype}; convert one to the "
                         f"other (x.to({weight.dtype}) or module.to({x.dtype}))")
    return err


class LayerNorm(nn.Module):
    """LayerNorm(x) = γ ⊙ (x − μ(x)) / sqrt(σ²(x) + ε) + β over the last dimension (PyTorch's ε placement).

    The seeds write σ(x) + ε with σ the (biased) standard deviation; PyTorch and most models put ε under the
    square root. Both only matter when σ is tiny; chapter 6 shows the difference is negligible.
    """

    def __init__(self, d: int, *, eps: float = 1e-5):
        super().__init__()
        d = _check_norm_args(d, eps)
        self.d, self.eps = d, eps
        self.weight = nn.Parameter(torch.ones(d))  # γ
        self.bias = nn.Parameter(torch.zeros(d))  # β

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check_last_dim(x, self.d, "LayerNorm")
        # The formula above, written out step by step in chapter 6 (mean, biased variance 1/d, ε under the root);
        # here through PyTorch's fused kernel, which computes the same and is much faster in training. In
        # float16/bfloat16 the kernel computes the mean and variance in float32 (x² would overflow float16 for
        # |x| > 256), as torch.nn.LayerNorm does.
        try:
            return F.layer_norm(x, (self.d,), self.weight, self.bias, self.eps)
        except RuntimeError as err:
            raise _dtype_error("LayerNorm", x, self.weight, err) from err

    def extra_repr(self) -> str:
        return f"{self.d}, eps={self.eps}"


class RMSNorm(nn.Module):
    """RMSNorm(x) = γ ⊙ x / sqrt(mean(x²) + ε) (Zhang & Sennrich 2019): no centring, no shift β."""

    def __init__(self, d: int, *, eps: float = 1e-6):
        super().__init__()
        d = _check_norm_args(d, eps)
        self.d, self.eps = d, eps
        self.weight = nn.Parameter(torch.ones(d))  # γ

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check_last_dim(x, self.d, "RMSNorm")
        # The formula above, as PyTorch's fused kernel (mean(x²) in float32 for float16/bfloat16 inputs).
        try:
            return F.rms_norm(x, (self.d,), self.weight, self.eps)
        except RuntimeError as err:
            raise _dtype_error("RMSNorm", x, self.weight, err) from err

    def extra_repr(self) -> str:
        return f"{self.d}, eps={self.eps}"


def make_norm(kind: str, d: int, eps: float | None = None) -> nn.Module:
    """The norm named by ``kind`` ("layernorm" or "rmsnorm") for vectors of size ``d``.

    ``eps`` None keeps each norm's own default (LayerNorm 1e-5, RMSNorm 1e-6).
    """
    kwargs = {} if eps is None else {"eps": eps}
    if kind == "layernorm":
        return LayerNorm(d, **kwargs)
    if kind == "rmsnorm":
        return RMSNorm(d, **kwargs)
    raise ValueError(f"norm must be one of {NORMS}, got {kind!r}")
