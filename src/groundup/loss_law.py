"""Loss against parameters and tokens (chapter 7): a small power-law fit.

    fit = fit_loss_law(n_params, n_tokens, losses)           # L = K N^-a D^-b, least squares on log L
    fit["a"], fit["b"], predict_loss(fit, 2e6, 1e7)

Scaling studies (Kaplan et al. 2020; Hoffmann et al. 2022) fit the final loss of many runs as a function of the
number of parameters N and of training tokens D, e.g. ``L = E + A / N^a + B / D^b``: five numbers, fitted on
hundreds of runs spanning orders of magnitude. A handful of runs supports far less. With the irreducible loss
``E`` fixed (0 by default), ``log(L - E) = log K - a log N - b log D`` is linear in its three unknowns, so ordinary
least squares gives them exactly, with no starting point or optimizer to tune; trying several ``E`` shows how
much the exponents depend on that assumption.
"""

from __future__ import annotations

import math

import torch

__all__ = ["fit_loss_law", "predict_loss"]


def _positive_list(name: str, values) -> list[float]:
    values = [float(v) for v in values]
    if not all(math.isfinite(v) and v > 0 for v in values):
        raise ValueError(f"{name} must hold positive finite numbers, got {values}")
    return values


def fit_loss_law(n_params, n_tokens, losses, *, irreducible: float = 0.0) -> dict:
    """Fit ``L = E + K N^-a D^-b`` with ``E = irreducible`` fixed, by least squares on ``log(L - E)``.

    Returns ``{"K", "a", "b", "E", "points", "rms_log_residual", "residuals"}``: the residuals are
    ``L - predicted`` per point, in the units of the loss. Needs at least 4 points (3 unknowns and one degree of
    freedom) with at least two distinct values of N and of D, and every loss above ``irreducible``.
    """
    n = _positive_list("n_params", n_params)
    d = _positive_list("n_tokens", n_tokens)
    loss = _positive_list("losses", losses)
    if not len(n) == len(d) == len(loss):
        raise ValueError(f"n_params, n_tokens and losses must be as long as each other, got {len(n)}, {len(d)}, "
                         f"{len(loss)}")
    if len(loss) < 4:
        raise ValueError(f"need at least 4 points to fit 3 numbers with one to spare, got {len(loss)}")
    if len(set(n)) < 2 or len(set(d)) < 2:
        raise ValueError("n_params and n_tokens must each take at least two different values")
    if not all(v > irreducible for v in loss):
        raise ValueError(f"every loss must exceed irreducible = {irreducible}, got a minimum of {min(loss)}")
    X = torch.tensor([[1.0, -math.log(ni), -math.log(di)] for ni, di in zip(n, d)], dtype=torch.float64)
    y = torch.tensor([math.log(v - irreducible) for v in loss], dtype=torch.float64).unsqueeze(1)
    coef = torch.linalg.lstsq(X, y).solution.squeeze(1)
    fit = {"K": math.exp(coef[0].item()), "a": coef[1].item(), "b": coef[2].item(), "E": float(irreducible),
           "points": len(loss)}
    log_res = (y.squeeze(1) - X @ coef).tolist()
    fit["rms_log_residual"] = math.sqrt(sum(r * r for r in log_res) / len(log_res))
    fit["residuals"] = [v - predict_loss(fit, ni, di) for v, ni, di in zip(loss, n, d)]
    return fit


def predict_loss(fit: dict, n_params: float, n_tokens: float) -> float:
    """The fitted law's loss for ``n_params`` parameters trained on ``n_tokens`` tokens."""
    return fit["E"] + fit["K"] * n_params ** -fit["a"] * n_tokens ** -fit["b"]
