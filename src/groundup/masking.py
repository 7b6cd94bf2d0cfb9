"""BERT's masking procedure (chapter 9): which positions a masked language model must fill in, and with what input.

    inputs, targets = mask_tokens(ids, mask_token_id=84, vocab_size=85, generator=g)
    batches = masked_lm_batches(mask_token_id=84, vocab_size=85)   # for groundup.training.train(..., batches=)

Devlin et al. (2019) select 15 % of the positions of each sequence; the model must predict the original token at
each selected position. Of the selected positions, 80 % are shown to the model as the mask token [MASK], 10 % as a
random token and 10 % unchanged. The targets hold the original token at the selected positions and -100
(ignored by the loss) everywhere else, so the loss counts the selected positions only.

As in BERT's own data pipeline, every sequence of n tokens gets exactly ``max(1, round(rate * n))`` selected
positions, drawn uniformly without replacement (so no sequence is without a target); the choice between
[MASK], random and unchanged is drawn independently for each selected position. All randomness comes from the
``torch.Generator`` passed in, so a masked batch is reproducible.
"""

from __future__ import annotations

import math
import numbers

import torch

from groundup.data import get_batch

__all__ = ["NOT_SELECTED", "MASKED", "RANDOM", "UNCHANGED", "masking_plan", "apply_masking", "mask_tokens",
           "masked_lm_batches", "BERT_RATE", "BERT_MASK_FRACTION", "BERT_RANDOM_FRACTION"]

BERT_RATE = 0.15
"""The fraction of positions selected for prediction (Devlin et al. 2019)."""
BERT_MASK_FRACTION = 0.8
"""Of the selected positions, the fraction shown as [MASK]."""
BERT_RANDOM_FRACTION = 0.1
"""Of the selected positions, the fraction shown as a random token (the rest, 10 %, are shown unchanged)."""

NOT_SELECTED, MASKED, RANDOM, UNCHANGED = 0, 1, 2, 3
"""What :func:`masking_plan` decides for each position: not predicted, or predicted with the input shown as
[MASK], as a random token, or unchanged."""


def _check_generator(generator) -> None:
    if not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator (e.g. torch.Generator().manual_seed(0)), got "
                        f"{type(generator).__name__}")


def _check_fraction(name: str, value, *, allow_zero: bool = True) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise TypeError(f"{name} must be a number in [0, 1], got {value!r}")
    low_ok = value >= 0 if allow_zero else value > 0
    if not (low_ok and value <= 1):
        raise ValueError(f"{name} must be in {'[0, 1]' if allow_zero else '(0, 1]'}, got {value!r}")
    return float(value)


def _check_proportions(rate, mask_fraction, random_fraction) -> tuple[float, float, float]:
    rate = _check_fraction("rate", rate, allow_zero=False)
    mask_fraction = _check_fraction("mask_fraction", mask_fraction)
    random_fraction = _check_fraction("random_fraction", random_fraction)
    if mask_fraction + random_fraction > 1 + 1e-12:
        raise ValueError(f"mask_fraction + random_fraction must be at most 1 (the rest stay unchanged), got "
                         f"{mask_fraction} + {random_fraction} = {mask_fraction + random_fraction}")
    return rate, mask_fraction, random_fraction


def masking_plan(shape, *, generator: torch.Generator, rate: float = BERT_RATE,
                 mask_fraction: float = BERT_MASK_FRACTION, random_fraction: float = BERT_RANDOM_FRACTION
                 ) -> torch.Tensor:
    """For token ids of ``shape`` ``(..., n)``: a LongTensor of the same shape saying what happens at each position.

    Each row of ``n`` positions gets exactly ``max(1, round(rate * n))`` selected positions (uniformly, without
    replacement); each selected position is :data:`MASKED` with probability ``mask_fraction``, :data:`RANDOM` with
    probability ``random_fraction`` and :data:`UNCHANGED` otherwise. The others are :data:`NOT_SELECTED`.
    """
    _check_generator(generator)
    rate, mask_fraction, random_fraction = _check_proportions(rate, mask_fraction, random_fraction)
    shape = torch.Size(shape)
    if len(shape) == 0 or shape[-1] < 1 or any(s < 0 for s in shape):
        raise ValueError(f"shape must be (..., n) with n >= 1 positions, got {tuple(shape)}")
    n = shape[-1]
    k = max(1, round(rate * n))
    ranks = torch.rand(shape, generator=generator).argsort(dim=-1).argsort(dim=-1)  # a random permutation per row
    selected = ranks < k
    u = torch.rand(shape, generator=generator)
    kind = torch.where(u < mask_fraction, MASKED, torch.where(u < mask_fraction + random_fraction, RANDOM, UNCHANGED))
    return torch.where(selected, kind, NOT_SELECTED)


def _check_ids(ids, mask_token_id, vocab_size) -> torch.Tensor:
    if not isinstance(ids, torch.Tensor):
        raise TypeError(f"ids must be a torch.Tensor of token ids, got {type(ids).__name__}")
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise TypeError(f"ids must hold integer token ids, got dtype {ids.dtype}")
    for name, value in (("vocab_size", vocab_size), ("mask_token_id", mask_token_id)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"{name} must be an integer, got {value!r}")
    if vocab_size < 2:
        raise ValueError(f"vocab_size must be at least 2 (the mask token and one other), got {vocab_size}")
    if not 0 <= mask_token_id < vocab_size:
        raise ValueError(f"mask_token_id must lie in [0, vocab_size) = [0, {vocab_size}), got {mask_token_id}")
    if ids.numel():
        if ids.min() < 0 or ids.max() >= vocab_size:
            raise ValueError(f"ids must lie in [0, {vocab_size}) for vocab_size={vocab_size}, got values from "
                             f"{ids.min().item()} to {ids.max().item()}")
        if bool((ids == mask_token_id).any()):
            raise ValueError(f"ids already contain the mask token id {mask_token_id}: mask the original text (the "
                             "mask token must not occur in it)")
    return ids.long()


def apply_masking(ids: torch.Tensor, plan: torch.Tensor, *, mask_token_id: int, vocab_size: int,
                  generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``(inputs, targets)`` for ``ids`` corrupted as ``plan`` (from :func:`masking_plan`) says.

    ``inputs`` is ``ids`` with :data:`MASKED` positions set to ``mask_token_id`` and :data:`RANDOM` positions set
    to a token drawn uniformly from the ``vocab_size - 1`` ids other than the mask token (it may, by chance, be the
    original token, as in BERT). ``targets`` holds the original ids at the selected positions and -100 elsewhere.
    """
    _check_generator(generator)
    ids = _check_ids(ids, mask_token_id, vocab_size)
    if not isinstance(plan, torch.Tensor) or plan.shape != ids.shape:
        got = tuple(plan.shape) if isinstance(plan, torch.Tensor) else type(plan).__name__
        raise ValueError(f"plan must be a tensor of the shape of ids {tuple(ids.shape)}, got {got}")
    random_ids = torch.randint(vocab_size - 1, ids.shape, generator=generator)
    random_ids = random_ids + (random_ids >= mask_token_id).long()  # skip the mask token's id
    inputs = torch.where(plan == MASKED, mask_token_id, torch.where(plan == RANDOM, random_ids, ids))
    targets = torch.where(plan == NOT_SELECTED, -100, ids)
    return inputs, targets


def mask_tokens(ids: torch.Tensor, *, mask_token_id: int, vocab_size: int, generator: torch.Generator,
                rate: float = BERT_RATE, mask_fraction: float = BERT_MASK_FRACTION,
                random_fraction: float = BERT_RANDOM_FRACTION) -> tuple[torch.Tensor, torch.Tensor]:
    """BERT's masking of token ids ``(..., n)``: ``(inputs, targets)`` for a :class:`~groundup.models.MaskedLM`.

    Selects ``max(1, round(rate * n))`` positions of each row; of those, a fraction ``mask_fraction`` (80 %) is
    shown as ``mask_token_id``, ``random_fraction`` (10 %) as a random token other than the mask token, and the
    rest (10 %) unchanged. ``targets`` holds the original ids at the selected positions and -100 elsewhere.
    ``vocab_size`` is the model's (it counts the mask token). Only ``generator`` supplies randomness.
    """
    _check_generator(generator)
    _check_proportions(rate, mask_fraction, random_fraction)
    ids = _check_ids(ids, mask_token_id, vocab_size)
    plan = masking_plan(ids.shape, generator=generator, rate=rate, mask_fraction=mask_fraction,
                        random_fraction=random_fraction)
    return apply_masking(ids, plan, mask_token_id=mask_token_id, vocab_size=vocab_size, generator=generator)


def masked_lm_batches(mask_token_id: int, vocab_size: int, *, rate: float = BERT_RATE,
                      mask_fraction: float = BERT_MASK_FRACTION, random_fraction: float = BERT_RANDOM_FRACTION):
    """A ``batches`` function for :func:`groundup.training.train` and ``evaluate`` that trains a masked LM.

    ``batches(data, batch_size, context_length, generator)`` draws ``batch_size`` random windows of
    ``context_length`` tokens from the 1-D ids ``data`` and masks them with :func:`mask_tokens`, using only
    ``generator``; it returns ``((inputs,), targets)``, so each step minimises ``model(inputs, targets)``'s loss.
    """
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, numbers.Integral) or vocab_size < 2:
        raise ValueError(f"vocab_size must be an integer >= 2, got {vocab_size!r}")
    if isinstance(mask_token_id, bool) or not isinstance(mask_token_id, numbers.Integral) \
            or not 0 <= mask_token_id < vocab_size:
        raise ValueError(f"mask_token_id must be an integer in [0, vocab_size) = [0, {vocab_size}), "
                         f"got {mask_token_id!r}")
    _check_proportions(rate, mask_fraction, random_fraction)

    def batches(data, batch_size, context_length, generator):
        _check_generator(generator)
        windows, _ = get_batch(data, batch_size, context_length, generator=generator)
        inputs, targets = mask_tokens(windows, mask_token_id=mask_token_id, vocab_size=vocab_size,
                                      generator=generator, rate=rate, mask_fraction=mask_fraction,
                                      random_fraction=random_fraction)
        return (inputs,), targets

    batches.__doc__ = (f"Random windows masked with rate={rate}, mask_fraction={mask_fraction}, "
                       f"random_fraction={random_fraction}, mask_token_id={mask_token_id}.")
    return batches
