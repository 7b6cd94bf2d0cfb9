"""The learning-rate range test (chapter 7): train briefly while the learning rate grows exponentially.

    lrs, losses = lr_range_test(model, train_ids, TrainConfig(batch_size=12), steps=150)
    suggest_lr(lrs, losses)     # {"steepest": ..., "minimum_over_10": ...}

Smith (2017, *Cyclical learning rates for training neural networks*) and fastai's ``lr_find``: start from a tiny
learning rate ``lr_min`` and multiply it by the same factor at every step until it reaches ``lr_max``,

    lr_k = lr_min * (lr_max / lr_min) ** (k / (steps - 1)),     k = 0 ... steps - 1,

recording the training loss of each step's batch. While the rate is too small the loss barely moves; in a middle
range it falls fast; past some rate it turns and explodes. Two rules of thumb read a peak learning rate off the
curve (averaged over neighbouring steps): the rate where the loss falls fastest per factor of the learning rate,
and a tenth of the rate where it is lowest. Both are heuristics read off one short run without warm-up or decay,
in which the loss at step k also reflects the training done at every smaller rate before it: a starting point for
tuning the peak of a real schedule, not a replacement for it (chapter 7 compares them with tuned peaks).
"""

from __future__ import annotations

import copy
import math
import statistics

import torch
from torch import nn

from groundup.training import (
    TrainConfig,
    _backward,
    _check_data,
    _check_model,
    _clip_gradients,
    _context_length,
    _make_optimizer,
    _next_batch,
)

__all__ = ["lr_range_test", "range_test_lrs", "smooth_losses", "moving_average", "suggest_lr"]


def range_test_lrs(lr_min: float, lr_max: float, steps: int) -> list[float]:
    """The ``steps`` learning rates of the test: ``lr_min`` to ``lr_max``, each the previous times one factor."""
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 2:
        raise ValueError(f"steps must be an integer >= 2, got {steps!r}")
    for name, value in (("lr_min", lr_min), ("lr_max", lr_max)):
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
            raise ValueError(f"{name} must be a positive number, got {value!r}")
    if not lr_min < lr_max:
        raise ValueError(f"lr_min ({lr_min}) must be smaller than lr_max ({lr_max})")
    ratio = lr_max / lr_min
    return [lr_min * ratio ** (k / (steps - 1)) for k in range(steps)]


def lr_range_test(model: nn.Module, train_data, config: TrainConfig | None = None, *, lr_min: float = 1e-6,
                  lr_max: float = 1.0, steps: int = 100, stop_factor: float | None = 4.0,
                  smoothing: float = 0.98) -> tuple[list[float], list[float]]:
    """Train a copy of ``model`` for up to ``steps`` steps at exponentially growing learning rates; ``(lrs, losses)``.

    ``config`` supplies everything but the schedule: batch size, context length, optimizer and its settings, the
    gradient clipping and the seed of the batch sampler (the default ``TrainConfig()``: AdamW as :func:`train`
    uses it). Step ``k`` uses the learning rate ``range_test_lrs(lr_min, lr_max, steps)[k]`` for every parameter
    group, and ``losses[k]`` is the training loss of its batch, measured before its update. The test stops early
    (as fastai's does) once the smoothed loss (:func:`smooth_losses`) exceeds ``stop_factor`` times its lowest
    value so far or a loss is not finite (that step is not recorded); ``stop_factor=None`` runs every step.
    ``model`` itself is left untouched (the test trains a deep copy), and so is the global random state
    (dropout draws from a saved and restored one).
    """
    _check_model(model)
    config = TrainConfig(progress=False) if config is None else config
    if not isinstance(config, TrainConfig):
        raise TypeError(f"config must be a TrainConfig or None, got {type(config).__name__}")
    if stop_factor is not None and not (isinstance(stop_factor, (int, float)) and stop_factor > 1):
        raise ValueError(f"stop_factor must be a number > 1 or None, got {stop_factor!r}")
    lrs = range_test_lrs(lr_min, lr_max, steps)
    n_c = _context_length(model, config)
    train_data = _check_data("train_data", train_data, n_c)
    device = next(model.parameters()).device
    trial = copy.deepcopy(model).train()
    optimizer = _make_optimizer(trial, config, device)
    generator = torch.Generator().manual_seed(config.seed)
    recorded, best = [], math.inf
    with torch.random.fork_rng(devices=[]):
        for lr in lrs:  # train's step (groundup.training) at the test's rate instead of its schedule
            for group in optimizer.param_groups:
                group["lr"] = lr
            inputs, targets = _next_batch(train_data, None, config.batch_size, n_c, generator)
            value = _backward(trial, inputs, targets, device, optimizer).item()
            if not math.isfinite(value):
                break
            recorded.append(value)
            smoothed = smooth_losses(recorded, smoothing)[-1]
            best = min(best, smoothed)
            if stop_factor is not None and smoothed > stop_factor * best:
                break
            _clip_gradients(trial, config.grad_clip)
            optimizer.step()
    return lrs[:len(recorded)], recorded


def smooth_losses(losses, smoothing: float = 0.98) -> list[float]:
    """fastai's smoothing: an exponential moving average with weight ``smoothing`` on the past, divided by
    ``1 - smoothing ** (k + 1)`` so that the first values are not pulled towards 0 (Adam's bias correction)."""
    if not 0 <= smoothing < 1:
        raise ValueError(f"smoothing must be in [0, 1), got {smoothing!r}")
    out, avg = [], 0.0
    for k, value in enumerate(losses):
        avg = smoothing * avg + (1 - smoothing) * float(value)
        out.append(avg / (1 - smoothing ** (k + 1)))
    return out


def moving_average(losses, window: int = 9) -> list[float]:
    """The mean of each loss and its ``window // 2`` neighbours on either side (fewer at the ends): a centred
    average, so unlike :func:`smooth_losses` it does not shift the curve towards later steps (an exponential
    average with weight 0.98 on the past lags by 0.98 / 0.02 = 49 steps only on a steady slope; in chapter 7's
    stored range tests of 150 steps its minimum came 29 to 36 steps late, 15 to 28 times higher in the rate)."""
    if not isinstance(window, int) or isinstance(window, bool) or window < 1 or window % 2 == 0:
        raise ValueError(f"window must be an odd positive integer, got {window!r}")
    values, half = [float(v) for v in losses], window // 2
    return [statistics.fmean(values[max(0, k - half):k + half + 1]) for k in range(len(values))]


def suggest_lr(lrs, losses, window: int = 9, skip_end: int = 5) -> dict:
    """Rules of thumb read off a range test's curve, averaged by :func:`moving_average`: ``steepest`` (where the
    loss falls fastest against log(lr), by central differences), ``minimum`` (the rate of the lowest loss) and
    ``minimum_over_10`` (a tenth of it). The last ``skip_end`` points, where the loss shoots up, are left out."""
    if len(lrs) != len(losses):
        raise ValueError(f"lrs and losses must be as long as each other, got {len(lrs)} and {len(losses)}")
    averaged = moving_average(losses, window)
    n = len(averaged) - skip_end
    if n < 3:
        raise ValueError(f"need at least {skip_end + 3} points to suggest a learning rate, got {len(lrs)}")
    logs = [math.log(lr) for lr in lrs]
    slopes = [(averaged[k + 1] - averaged[k - 1]) / (logs[k + 1] - logs[k - 1]) for k in range(1, n - 1)]
    steepest = 1 + min(range(len(slopes)), key=slopes.__getitem__)
    lowest = min(range(n), key=averaged.__getitem__)
    return {"steepest": lrs[steepest], "minimum": lrs[lowest], "minimum_over_10": lrs[lowest] / 10}
