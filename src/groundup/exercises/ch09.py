"""Checkers for chapter 9 (masked language models): the masked loss, BERT's corruption of the inputs, and the
masked-token accuracy.

Every checker computes the expected values before it calls the reader's function, hands the function copies of
its inputs (and says so if the function changed them in place), and checks the type of what comes back.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from groundup import masking
from groundup.exercises import sandbox
from groundup.exercises.checking import (
    Forbidden,
    Verdict,
    call_reader,
    expect,
    expect_close,
    expect_number,
    run_checks,
)
from groundup.masking import MASKED, RANDOM, masking_plan

__all__ = ["check_masked_loss", "check_apply_masking", "check_masked_accuracy"]


def _loss_cases():
    g = torch.Generator().manual_seed(91)
    cases = []
    for batch, seq, vocab in ((2, 8, 5), (3, 16, 11)):
        logits = torch.randn(batch, seq, vocab, generator=g, dtype=torch.float64) * 2
        targets = torch.randint(0, vocab, (batch, seq), generator=g)
        keep = torch.rand(batch, seq, generator=g) < 0.25
        keep[:, 0] = True  # at least one selected position per row
        cases.append((logits, torch.where(keep, targets, -100)))
    return cases


# ---- Exercise 9.1 ------------------------------------------------------------------------------------------


def _leaves_positions_to_ignore_index(args: tuple, kwargs: dict) -> bool:
    """Whether a call of torch's cross-entropy / NLL kernel (input, target, weight, reduction, ignore_index, ...)
    has targets equal to ignore_index, i.e. leaves the selection of the positions to it."""
    target = args[1] if len(args) > 1 else kwargs.get("target")
    ignore_index = args[4] if len(args) > 4 else kwargs.get("ignore_index", -100)
    return isinstance(target, torch.Tensor) and bool((target == ignore_index).any())


_IGNORE_INDEX_HINT = ("The exercise asks you to select the positions yourself, without ignore_index: build the "
                      "boolean mask targets != -100 and average -log P(target) over those positions only.")
_IGNORE_INDEX_LABEL = "a cross-entropy that skips the -100 targets by ignore_index"
_IGNORE_INDEX = tuple(Forbidden(torch._C._nn, name, when=_leaves_positions_to_ignore_index,
                                label=_IGNORE_INDEX_LABEL, hint=_IGNORE_INDEX_HINT)
                      for name in ("cross_entropy_loss", "nll_loss", "nll_loss_nd", "nll_loss2d"))
_NLL_KERNELS = (torch.ops.aten.nll_loss_forward.default, torch.ops.aten.nll_loss2d_forward.default)


class _IgnoreIndexWatch(TorchDispatchMode):
    """Sees every operator the reader's code runs, however it was reached (``F.cross_entropy``,
    ``torch.ops.aten.nll_loss_forward``, an overload kept from before the check), and refuses the NLL kernels every
    cross-entropy ends in when they are left to skip targets equal to their ``ignore_index``."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _NLL_KERNELS and _leaves_positions_to_ignore_index(args, kwargs):
            sandbox._trip(_IGNORE_INDEX_LABEL)  # recorded even if the reader's code catches it
        return func(*args, **kwargs)


def _watched(fn: Callable) -> Callable:
    """``fn`` run under :class:`_IgnoreIndexWatch` (a dispatch mode is per thread: entered in the reader's worker)."""

    def masked_loss(*args):
        with _IgnoreIndexWatch():
            return fn(*args)

    return masked_loss


def check_masked_loss(fn: Callable) -> Verdict:
    """Exercise 9.1: ``fn(logits, targets)`` is the mean cross-entropy over the positions whose target is not -100."""

    def checks():
        cases = _loss_cases()
        expected = [F.cross_entropy(lg.flatten(0, 1), t.flatten(), ignore_index=-100).item() for lg, t in cases]
        for (logits, targets), want in zip(cases, expected):
            call = f"masked_loss(logits of shape {tuple(logits.shape)}, targets with {(targets != -100).sum().item()} "\
                   "selected positions)"
            got = expect_number(call_reader(_watched(fn), logits, targets, call=call, names=("logits", "targets"),
                                            forbid=_IGNORE_INDEX), call)
            hint = ("Average -log softmax(logits)[target] over the selected positions only: select them with the "
                    "boolean mask targets != -100 (logits[selected], targets[selected]).")
            selected = targets != -100
            log_probs = logits.log_softmax(-1)
            picked = -log_probs.gather(-1, targets.clamp(min=0)[..., None])[..., 0]
            if abs(got - picked.mean().item()) < 1e-6:
                hint = ("You averaged over every position: the unselected ones (target -100) must not count, neither "
                        "in the sum nor in the number you divide by.")
            elif abs(got - (picked * selected).sum().item() / targets.numel()) < 1e-6:
                hint = ("You summed over the selected positions but divided by the number of all positions: divide by "
                        "the number of selected positions.")
            elif abs(got - (picked * selected).sum().item()) < 1e-6:
                hint = "That is the sum over the selected positions: take the mean."
            expect_close(got, want, call, hint, rtol=1e-6, atol=1e-8)

    return run_checks("Exercise 9.1 (the masked loss)", checks,
                      "Only the selected positions count: what the model outputs elsewhere cannot change the loss.")


# ---- Exercise 9.2 ------------------------------------------------------------------------------------------


def _reference_corrupt(ids, plan, mask_id, random_ids):
    inputs = torch.where(plan == MASKED, mask_id, torch.where(plan == RANDOM, random_ids, ids))
    return inputs, torch.where(plan == 0, -100, ids)


def check_apply_masking(fn: Callable) -> Verdict:
    """Exercise 9.2: ``fn(ids, plan, mask_id, random_ids) -> (inputs, targets)`` corrupts ``ids`` as ``plan`` says."""

    def checks():
        g = torch.Generator().manual_seed(92)
        cases = []
        for shape in ((1, 20), (4, 32)):
            ids = torch.randint(0, 10, shape, generator=g)
            plan = masking_plan(shape, generator=g, rate=0.3)
            random_ids = torch.randint(0, 10, shape, generator=g)
            cases.append((ids, plan, 10, random_ids))
        expected = [_reference_corrupt(*c) for c in cases]
        for (ids, plan, mask_id, random_ids), (want_in, want_t) in zip(cases, expected):
            call = f"apply_masking(ids of shape {tuple(ids.shape)}, plan, mask_id={mask_id}, random_ids)"
            got = call_reader(fn, ids, plan, mask_id, random_ids, call=call,
                              names=("ids", "plan", "mask_id", "random_ids"), returns=tuple,
                              forbid=(masking.apply_masking, masking.mask_tokens),
                              expected="a pair (inputs, targets)")
            expect(len(got) == 2 and all(isinstance(t, torch.Tensor) for t in got),
                   f"{call} returned a tuple of {len(got)} items", "Return a pair of tensors (inputs, targets).")
            inputs, targets = got
            expect(inputs.shape == ids.shape and targets.shape == ids.shape,
                   f"{call} returned shapes {tuple(inputs.shape)}, {tuple(targets.shape)}",
                   "Both outputs have the shape of ids.")
            wrong_targets = targets != want_t
            if bool(wrong_targets.any()):
                hint = "targets: the original id at every selected position (plan != 0), -100 everywhere else."
                if bool((targets[plan == 0] != -100).any()):
                    hint = ("Positions the plan did not select (plan == 0) must have target -100, so the loss "
                            "ignores them.")
                elif bool((targets[plan != 0] == inputs[plan != 0]).all()) and bool((plan == MASKED).any()):
                    hint = ("The targets are the original ids, not the corrupted inputs: the model must predict what "
                            "was there before masking.")
                expect(False, f"{call}: the targets are wrong at {int(wrong_targets.sum())} position(s)", hint)
            wrong = inputs != want_in
            if bool(wrong.any()):
                kinds = sorted({int(k) for k in plan[wrong].tolist()})
                names = {0: "unselected (plan 0: keep the id)", 1: "[MASK] (plan 1: mask_id)",
                         2: "random (plan 2: random_ids at that position)", 3: "unchanged (plan 3: keep the id)"}
                expect(False, f"{call}: the inputs are wrong at {int(wrong.sum())} position(s), of kind(s) "
                       + ", ".join(names[k] for k in kinds),
                       "1 → mask_id, 2 → the random id at that position, 0 and 3 → the original id.")

    return run_checks("Exercise 9.2 (BERT's corruption)", checks,
                      "80 % [MASK], 10 % random, 10 % unchanged, and the targets remember the originals.")


# ---- Exercise 9.3 ------------------------------------------------------------------------------------------


def check_masked_accuracy(fn: Callable) -> Verdict:
    """Exercise 9.3: ``fn(logits, targets)`` is the fraction of selected positions whose argmax is the target."""

    def checks():
        cases = _loss_cases()
        expected = []
        for logits, targets in cases:
            sel = targets != -100
            expected.append((logits.argmax(-1)[sel] == targets[sel]).double().mean().item())
        for (logits, targets), want in zip(cases, expected):
            call = f"masked_accuracy(logits of shape {tuple(logits.shape)}, targets)"
            got = expect_number(call_reader(fn, logits, targets, call=call, names=("logits", "targets")), call)
            hint = "Compare logits.argmax(-1) with the targets at the selected positions only, and average."
            if abs(got - (logits.argmax(-1) == targets).double().mean().item()) < 1e-9:
                hint = "You counted every position: keep only those with targets != -100."
            elif abs(got - 100 * want) < 1e-6:
                hint = "Return a fraction between 0 and 1, not a percentage."
            expect_close(got, want, call, hint, rtol=1e-6, atol=1e-7)  # a float32 mean is fine

    return run_checks("Exercise 9.3 (masked-token accuracy)", checks,
                      "Accuracy is measured where the loss is: at the selected positions.")
