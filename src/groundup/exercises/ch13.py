"""Checkers for chapter 13 (adapting a pretrained model): rsLoRA's forward pass (the rank-stabilised scale
alpha / sqrt(r)) and the RMS of the update it keeps steady, swapping one merged adapter for another in place,
counting LoRA's trainable parameters, the labels of a multi-turn chat that train every assistant turn, attaching
adapters to a model by hand (module surgery), and early stopping on a held-out count with the best parameters put
back.

Every checker computes the expected values before it calls the reader's function, hands the function copies of
its inputs (and says so if the function changed them in place, where that is not the exercise), and refuses
answers that call the package's own solution (``groundup.lora``, ``groundup.instructions``,
``groundup.classification.fine_tune``, ``groundup.training.train``) or ``peft``. The three exercises that change
their input in place (13.2, 13.7, 13.8) get a weight or a model that the checker builds or copies in the reader's
thread, and everything that runs the reader's code runs there too; what the checker then judges is plain
tensors: the weight, the parameters, the logits.
"""

from __future__ import annotations

import copy
import functools
import math
import random
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

import groundup.lora
from groundup.attention import MultiHeadAttention
from groundup.classification import ClassifierHead, classifier_for, fine_tune
from groundup.exercises.checking import (
    Forbidden,
    Mismatch,
    ReaderError,
    Verdict,
    call_reader,
    expect,
    expect_close,
    expect_integer,
    expect_number,
    expect_tensor,
    expect_type,
    run_checks,
    tolerance_for,
)
from groundup.instructions import encode_instructions
from groundup.layers import FeedForward, TransformerBlock
from groundup.lora import LoRALinear, _matches, attach_lora, lora_parameter_count, merge_lora, unmerge_lora
from groundup.models import GPT, GPTConfig
from groundup.training import train

__all__ = ["check_rslora_forward", "check_update_rms", "check_adapter_swap", "check_lora_parameter_count",
           "check_chat_labels", "check_lora_surgery", "check_early_stopping", "LORA_TARGETS"]

_LORA_HINT = ("The exercise is to write the adapter yourself with matrix products: groundup.lora and peft are the "
              "book's and the library's own solutions, so calling them proves nothing.")


def _if_installed(forbidden: Callable[[], list]) -> list:
    """``forbidden()``, the Forbidden entries of a library it imports, or none where that library is missing or
    broken: then there is nothing of it for an answer to call. Imported here, not when the reader's function runs,
    so that a function importing the library itself is caught too."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return forbidden()
    except Exception:  # noqa: BLE001 -- any failure of an optional library means it cannot be called either
        return []


@functools.cache
def _lora_solutions() -> tuple:
    """What an answer must not call: the package's LoRA layer, and peft's where peft is installed, its forward
    and delta and building one at all (imported here, so that a function importing peft itself is caught too)."""
    forbid = [Forbidden(LoRALinear, "forward", label="groundup.lora.LoRALinear.forward", hint=_LORA_HINT),
              Forbidden(LoRALinear, "delta_weight", label="groundup.lora.LoRALinear.delta_weight", hint=_LORA_HINT),
              Forbidden(LoRALinear, "merge", label="groundup.lora.LoRALinear.merge", hint=_LORA_HINT)]

    def peft_layer():
        from peft.tuners.lora import layer as peft_layer
        return [Forbidden(peft_layer.Linear, "forward", label="peft's LoRA Linear.forward", hint=_LORA_HINT),
                Forbidden(peft_layer.Linear, "get_delta_weight", label="peft's LoRA Linear.get_delta_weight",
                          hint=_LORA_HINT),
                # building any of peft's LoRA layers (to read its scaling, say) goes through these two
                Forbidden(peft_layer.LoraLayer, "__init__", label="peft's LoraLayer", hint=_LORA_HINT),
                Forbidden(peft_layer.LoraLayer, "update_layer", label="peft's LoraLayer.update_layer",
                          hint=_LORA_HINT)]

    return tuple(forbid + _if_installed(peft_layer))


# ---- Exercise 13.1 -----------------------------------------------------------------------------------------

_RSLORA_CASES = (((2,), 4, 4, 4, 6.0), ((3,), 6, 10, 2, 5.0), ((2, 5), 32, 24, 16, 16.0), ((4,), 16, 12, 9, 2.0),
                 ((1, 3, 2), 20, 20, 1, 1.0))
"""(leading dimensions of x, d_in, d_out, r, alpha): first a square adapter of full rank, on which a transposed
factor gives wrong numbers instead of a shape error; then ranks 2, 16, 9 and 1, up to three leading dimensions."""


def _rslora_case(g: torch.Generator, lead: tuple[int, ...], d_in: int, d_out: int, r: int, alpha: float) -> dict:
    """A random frozen layer, adapter and input in float64, of the sizes a layer has: ``W`` and ``A`` of entries
    about 1/sqrt(d_in) (nn.Linear's and LoRA's initialisation), ``B`` about 1/sqrt(r), so that the frozen output
    and ``(x A^T) B^T`` are both of order one and a float32 answer is judged at float32's precision."""
    return {"x": torch.randn(*lead, d_in, generator=g, dtype=torch.float64),
            "W": torch.randn(d_out, d_in, generator=g, dtype=torch.float64) / math.sqrt(d_in),
            "b": torch.randn(d_out, generator=g, dtype=torch.float64),
            "A": torch.randn(r, d_in, generator=g, dtype=torch.float64) / math.sqrt(d_in),
            "B": torch.randn(d_out, r, generator=g, dtype=torch.float64) / math.sqrt(r),
            "alpha": alpha}


def _rslora_wrong(case: dict) -> list[tuple[str, torch.Tensor]]:
    """The plausible wrong outputs for ``case``, each with the hint that names the mistake (transposes only
    where the shapes let them through)."""
    x, W, b, A, B, alpha = (case[k] for k in ("x", "W", "b", "A", "B", "alpha"))
    r, d_out, d_in = A.shape[0], W.shape[0], W.shape[1]
    s = alpha / math.sqrt(r)
    base, low = x @ W.T + b, (x @ A.T) @ B.T
    wrong = [("That is plain LoRA's scale alpha / r (13.1). rsLoRA divides alpha by the square root of the rank: "
              "alpha / math.sqrt(r).", base + (alpha / r) * low),
             ("`r ** 1/2` is `(r ** 1) / 2`, half of r: the power binds tighter than the division. Write "
              "`r ** 0.5` or `math.sqrt(r)`.", base + (alpha / r / 2) * low),
             ("The square root is of the rank alone: alpha / math.sqrt(r), not math.sqrt(alpha / r).",
              base + math.sqrt(alpha / r) * low),
             ("Scale the update by alpha / sqrt(r): you left the scale out.", base + low),
             ("The scale is alpha / sqrt(r), not alpha.", base + alpha * low),
             ("The rank is r = A.shape[0], not d_in = W.shape[1].", base + (alpha / math.sqrt(d_in)) * low),
             ("The rank is r = A.shape[0], not d_out = W.shape[0].", base + (alpha / math.sqrt(d_out)) * low),
             ("Add the layer's bias b: the frozen layer computes x W^T + b.", x @ W.T + s * low),
             ("The update is added to the frozen layer's output, not used instead of it.", s * low)]
    if d_in == d_out:
        wrong.append(("The frozen layer is x W^T: W is (d_out, d_in), so x @ W.T.", x @ W + b + s * low))
    if d_in == d_out == r:
        transposed = ("The update is (x A^T) B^T: x @ A.T first, then @ B.T (A is (r, d_in), B is (d_out, r)); a "
                      "square adapter hides a transpose from the shapes.")
        wrong += [(transposed, base + s * (x @ A) @ B), (transposed, base + s * (x @ B) @ A)]
    return wrong


def _match_hint(got: torch.Tensor, wrong: list[tuple[str, torch.Tensor]], expected: torch.Tensor) -> str | None:
    """The hint of the first wrong value that ``got`` equals (one that differs from ``expected``)."""
    rtol, atol = tolerance_for(got, rtol=1e-8, atol=1e-10)  # float32's precision for a float32 answer
    for hint, value in wrong:
        if got.shape == value.shape and torch.allclose(got.to(torch.float64), value, rtol=rtol, atol=atol) \
                and not torch.allclose(value, expected, rtol=rtol, atol=atol):
            return hint
    return None


_FORWARD_SHAPES = ("Check the shapes: x is (..., d_in), W (d_out, d_in), A (r, d_in), B (d_out, r); the frozen "
                   "layer is x @ W.T + b and the update (x @ A.T) @ B.T.")
_SWAP_SHAPES = ("Check the shapes: A1 is (r1, d_in) and B1 (d_out, r1), so B1 @ A1 has W's shape (d_out, d_in); "
                "the same for A2 and B2.")


def _shape_error_hint(err: ReaderError, shapes: str) -> ReaderError:
    """``err`` with a hint when it is a shape error of a matrix product: ``shapes`` (a transposed factor), or
    torch.mm used on an input with several leading dimensions."""
    message = str(err.error)
    if not isinstance(err.error, RuntimeError) or err.hint:
        return err
    if "must be a matrix" in message:
        hint = ("x has leading dimensions (..., d_in), here more than one: use @ (torch.matmul), which works on "
                "the last two dimensions, not torch.mm or .mm, which take matrices only.")
    elif "shape" in message or "size" in message:
        hint = shapes
    else:
        return err
    return ReaderError(err.call, err.error, hint)


def check_rslora_forward(fn: Callable) -> Verdict:
    """Exercise 13.1: ``fn(x, W, b, A, B, alpha) -> y``, a rank-stabilised LoRA layer's output (rsLoRA,
    Kalajdzievski 2023): ``y = x W^T + b + (alpha / sqrt(r)) (x A^T) B^T`` for ``x`` of shape ``(..., d_in)``, the
    frozen ``W`` (d_out, d_in) and ``b`` (d_out,), the adapter's ``A`` (r, d_in) and ``B`` (d_out, r). Five shapes,
    ranks 1 to 16, one to three leading dimensions; calling groundup.lora's layer or peft's is refused."""
    forbid = _lora_solutions()  # before the check: importing peft changes torch's globals

    def checks():
        g = torch.Generator().manual_seed(1301)
        for shape in _RSLORA_CASES:
            case = _rslora_case(g, *shape)
            x, W, b, A, B, alpha = (case[k] for k in ("x", "W", "b", "A", "B", "alpha"))
            r = A.shape[0]
            expected = x @ W.T + b + (alpha / math.sqrt(r)) * ((x @ A.T) @ B.T)
            wrong = _rslora_wrong(case)
            call = (f"my_rslora_forward(x, W, b, A, B, alpha={alpha:g}) with x of shape {tuple(x.shape)}, "
                    f"W {tuple(W.shape)}, r = {r}")
            try:
                got = call_reader(fn, x, W, b, A, B, alpha, call=call, names=("x", "W", "b", "A", "B", "alpha"),
                                  forbid=forbid)
            except ReaderError as err:
                raise _shape_error_hint(err, _FORWARD_SHAPES) from err.error
            got = expect_tensor(got, call)
            expect(tuple(got.shape) == tuple(expected.shape),
                   f"{call} returned shape {tuple(got.shape)}, expected {tuple(expected.shape)}",
                   "The output has the input's leading dimensions and d_out features: x A^T is (..., r), then "
                   "times B^T gives (..., d_out).")
            hint = _match_hint(got, wrong, expected)
            if hint:
                raise Mismatch(f"{call}: the output is an adapted layer computed the wrong way", hint)
            expect_close(got, expected, call, "y = x W^T + b + (alpha / sqrt(r)) * (x A^T) B^T, with r = "
                         "A.shape[0].", rtol=1e-10, atol=1e-10)

    return run_checks("Exercise 13.1 (rsLoRA's forward pass)", checks,
                      "Your layer equals x W^T + b + (alpha / sqrt(r)) (x A^T) B^T for five shapes, ranks 1 to 16.")


_RMS_CASES = ((4, 256, 16.0, "lora"), (4, 256, 16.0, "rslora"), (64, 256, 16.0, "lora"), (256, 256, 16.0, "rslora"),
              (1, 256, 16.0, "lora"), (16, 576, 8.0, "rslora"), (8, 576, 16.0, "lora"), (9, 100, 2.0, "rslora"))
"""(r, d_in, alpha, scale): the exercise's d_in = 256 and alpha = 16 at ranks 1 to 256 under both scales, then
SmolLM2's width 576 and odd sizes, so that no single rank, width or alpha hides a wrong dependence on it."""

_RMS_TRIALS, _RMS_D_OUT, _RMS_INPUTS = 32, 64, 16
"""The checker's measurement: 32 draws of A (r, d_in) and B (d_out, r) with d_out = 64, each applied to 16 inputs
x; it lands within 10 % of the closed form on every case (asserted, so a checker that measures something else
says so as its own bug)."""


def _scale(alpha: float, r: int, scale: str) -> float:
    return alpha / r if scale == "lora" else alpha / math.sqrt(r)


def _measured_rms(g: torch.Generator, r: int, d_in: int, alpha: float, scale: str) -> float:
    """The RMS of ``s B A x`` measured on random A, B and x of standard-normal entries (float64)."""
    A = torch.randn(_RMS_TRIALS, r, d_in, generator=g, dtype=torch.float64)
    B = torch.randn(_RMS_TRIALS, _RMS_D_OUT, r, generator=g, dtype=torch.float64)
    x = torch.randn(_RMS_TRIALS, d_in, _RMS_INPUTS, generator=g, dtype=torch.float64)
    return _scale(alpha, r, scale) * (B @ (A @ x)).pow(2).mean().sqrt().item()


def _rms_wrong(r: int, d_in: int, alpha: float, scale: str) -> list[tuple[str, float]]:
    """The values the plausible mistakes give, each with the hint that names the mistake."""
    s, other = _scale(alpha, r, scale), _scale(alpha, r, "rslora" if scale == "lora" else "lora")
    adds = ("Variances add, not standard deviations: a sum of n independent terms of variance v has variance n v, "
            "so its RMS grows as sqrt(n), not n.")
    return [(f"scale={scale!r} means s = {'alpha / r' if scale == 'lora' else 'alpha / sqrt(r)'}: you used the "
             "other scale.", other * math.sqrt(r * d_in)),
            ("Multiply by the scale s: the update is s B A x.", math.sqrt(r * d_in)),
            ("That is the mean square (the variance of an entry), not its square root: the RMS is the square root "
             "of the mean of the squares.", s * r * d_in),
            ("That is the update's mean square, not its RMS: take the square root.", (s * s) * r * d_in),
            ("An entry of B (A x) sums r products B_ij (A x)_j, each of variance d_in: the rank enters the variance "
             "too.", s * math.sqrt(d_in)),
            ("An entry of A x sums d_in products of unit variance: d_in enters the variance too.", s * math.sqrt(r)),
            (adds, s * r * math.sqrt(d_in)), (adds, s * math.sqrt(r) * d_in)]


def check_update_rms(fn: Callable) -> Verdict:
    """Exercise 13.1 (b): ``fn(r, d_in, alpha, scale) -> float``, the predicted RMS of the update ``s B A x`` for
    ``A`` (r, d_in), ``B`` (d_out, r) and ``x`` (d_in,) of independent standard-normal entries, with
    ``s = alpha / r`` for ``scale="lora"`` and ``s = alpha / sqrt(r)`` for ``scale="rslora"``: an entry of ``A x``
    has variance ``d_in``, one of ``B (A x)`` variance ``r d_in``, so the RMS is ``s sqrt(r d_in)``:
    ``alpha sqrt(d_in / r)`` under LoRA's scale, ``alpha sqrt(d_in)`` under rsLoRA's. Eight cases, ranks 1 to 256;
    the checker measures every RMS first (seeded) and asserts that its closed form agrees with the measurement,
    then judges the answer against the closed form (a measured answer is refused: the exercise is the
    derivation)."""

    def checks():
        g = torch.Generator().manual_seed(13012)
        cases = []
        for r, d_in, alpha, scale in _RMS_CASES:
            exact = _scale(alpha, r, scale) * math.sqrt(r * d_in)
            measured = _measured_rms(g, r, d_in, alpha, scale)
            assert abs(measured / exact - 1) < 0.1, (r, d_in, alpha, scale, measured, exact)  # the checker's own
            cases.append((r, d_in, alpha, scale, exact, measured))
        for r, d_in, alpha, scale, exact, measured in cases:
            call = f"my_update_rms(r={r}, d_in={d_in}, alpha={alpha:g}, scale={scale!r})"
            got = expect_number(call_reader(fn, r, d_in, alpha, scale, call=call,
                                            names=("r", "d_in", "alpha", "scale")), call)
            what = (f"{call} = {got:.6g}, expected {exact:.6g} (the checker measured {measured:.4g} on "
                    f"{_RMS_TRIALS * _RMS_D_OUT * _RMS_INPUTS:,} entries of s B A x)")
            if math.isclose(got, exact, rel_tol=1e-6):
                continue
            hints = list(dict.fromkeys(hint for hint, value in _rms_wrong(r, d_in, alpha, scale) if math.isclose(
                got, value, rel_tol=1e-6) and not math.isclose(value, exact, rel_tol=1e-6)))
            if hints:  # alpha / r times r sqrt(d_in) is rsLoRA's alpha sqrt(d_in): two mistakes can give one value
                raise Mismatch(what, hints[0] if len(hints) == 1 else "Two mistakes give this value. Either: "
                               + " Or: ".join(hints))
            if math.isfinite(got) and math.isclose(got, exact, rel_tol=1e-3):
                raise Mismatch(what, "Your value agrees with the exact prediction to a few digits but not to all: "
                               "it looks rounded (or measured very precisely). Return the closed form's value "
                               "itself, s * math.sqrt(r * d_in), without rounding it.")
            if math.isfinite(got) and abs(got / measured - 1) < 0.15:
                raise Mismatch(what, "That is close to a measurement, not the exact prediction: derive the RMS "
                               "from the variance of one entry of A x, then of B (A x), and the scale s.")
            raise Mismatch(what, f"Your value is {got / exact:.3g} times the right one. Work out the variance of "
                           "one entry of A x, then of one entry of B (A x), and remember the scale s.")

    return run_checks("Exercise 13.1 (b) (the update's RMS)", checks,
                      "Your RMS is the exact s sqrt(r d_in), confirmed by the checker's measurement: under "
                      "alpha / r it shrinks as 1 / sqrt(r), under rsLoRA's alpha / sqrt(r) it is alpha sqrt(d_in) "
                      "at every rank.")


# ---- Exercise 13.2 -----------------------------------------------------------------------------------------

_SWAP_CASES = ((6, 5, 2, 2, 4.0, False), (16, 12, 4, 1, 8.0, False), (10, 24, 2, 8, 16.0, True))
"""(d_out, d_in, r1, r2, alpha, W a parameter that requires gradients): one rank for both adapters, then the old
adapter of higher rank than the new, then of lower rank, on a weight that requires gradients (as a model's does)."""

_SWAP_HINT = ("The exercise is to swap the adapters yourself with matrix products: the merges of groundup.lora and "
              "peft are the book's and the library's own, so calling them proves nothing.")


@functools.cache
def _swap_solutions() -> tuple:
    """What a swap must not call: the package's merges and its LoRA layer's, and peft's layer's where peft is
    installed (imported here, so that a function importing peft itself is caught too)."""
    forbid = [merge_lora, unmerge_lora] + [Forbidden(LoRALinear, name, label=f"groundup.lora.LoRALinear.{name}",
                                                     hint=_SWAP_HINT) for name in ("merge", "unmerge", "delta_weight")]

    def peft_layer():
        from peft.tuners.lora import layer as peft_layer
        return [Forbidden(peft_layer.Linear, name, label=f"peft's LoRA Linear.{name}", hint=_SWAP_HINT)
                for name in ("merge", "unmerge", "get_delta_weight")]

    return tuple(forbid + _if_installed(peft_layer))


def _swap_case(g: torch.Generator, d_out: int, d_in: int, r1: int, r2: int, alpha: float) -> dict:
    """A float32 base weight, two adapters of ranks ``r1`` and ``r2`` (A as LoRA draws it, of entries about
    1/sqrt(d_in); B as training leaves it, of entries about 0.3), and the base with the first merged: the merge
    computed in float64 and rounded once to float32, as a served weight holds it."""
    base = 0.5 * torch.randn(d_out, d_in, generator=g)
    A1, A2 = (torch.randn(r, d_in, generator=g) / math.sqrt(d_in) for r in (r1, r2))
    B1, B2 = (0.3 * torch.randn(d_out, r, generator=g) for r in (r1, r2))
    merged = (base.double() + (alpha / r1) * (B1.double() @ A1.double())).float()
    return {"base": base, "A1": A1, "B1": B1, "A2": A2, "B2": B2, "merged": merged}


def _rounding_bound(case: dict, alpha: float) -> torch.Tensor:
    """How far (per entry, float64) a float32 swap may land from the exact ``base + (alpha / r2) B2 A2``: the
    merged weight was rounded once, and the swap rounds every product and sum it makes, each by at most half a
    unit in the last place (eps / 2) of the number it rounds. A product B A of inner size r rounds r times, so the
    bound is eps (4 (|W| + |base|) + (r1 + 4) (alpha / r1) |B1| |A1| + (r2 + 4) (alpha / r2) |B2| |A2|): the
    classical bound with room to spare. Measured over 300 random cases and seven ways of writing the swap (two
    subtractions, addmm_, one combined update, the sum in float64), the largest error was 2.3 eps times these
    magnitudes without the rank factors."""
    eps = torch.finfo(torch.float32).eps
    A1, B1, A2, B2 = (case[k].double() for k in ("A1", "B1", "A2", "B2"))
    r1, r2 = A1.shape[0], A2.shape[0]
    return eps * (4 * (case["merged"].double().abs() + case["base"].double().abs())
                  + (r1 + 4) * (alpha / r1) * (B1.abs() @ A1.abs()) + (r2 + 4) * (alpha / r2) * (B2.abs() @ A2.abs()))


def _swap_wrong(case: dict, alpha: float) -> list[tuple[str, torch.Tensor]]:
    """The weights the plausible mistakes leave, in float64, each with the hint that names the mistake."""
    W = case["merged"].double()
    D1, D2 = (case[f"B{i}"].double() @ case[f"A{i}"].double() for i in (1, 2))
    s1, s2 = alpha / case["A1"].shape[0], alpha / case["A2"].shape[0]
    scales = ("Each adapter has its own scale alpha / r with its own rank: the old one was merged with alpha / r1 "
              "(r1 = A1.shape[0]), the new one with alpha / r2 (r2 = A2.shape[0]).")
    signs = ("Subtract the old adapter's update (alpha / r1) B1 A1, which W holds, and add the new one's "
             "(alpha / r2) B2 A2.")
    return [("Take the old adapter out first: W holds base + (alpha / r1) B1 A1, so subtract that update before "
             "adding the new one.", W + s2 * D2),
            (scales, W - s2 * D1 + s2 * D2), (scales, W - s1 * D1 + s1 * D2), (scales, W - s2 * D1 + s1 * D2),
            (signs, W + s1 * D1 + s2 * D2), (signs, W + s1 * D1 - s2 * D2), (signs, W - s1 * D1 - s2 * D2),
            ("Scale each update by alpha / r (its own adapter's r): you left the scales out.", W - D1 + D2),
            ("After taking the old adapter out, add the new one: (alpha / r2) B2 A2.", W - s1 * D1),
            ("W keeps the base weight: it ends as base + (alpha / r2) B2 A2, not the update alone.", s2 * D2)]


def _swap_inputs(case: dict, parameter: bool) -> tuple:
    """What the reader's swap gets, built afresh (in the reader's thread): ``W``, the merged weight (an
    ``nn.Parameter`` that requires gradients where ``parameter``), the adapters ``old`` and ``new``, and the address
    of W's memory."""
    W = case["merged"].clone()
    if parameter:
        W = nn.Parameter(W)  # requires gradients, as a model's weight does
    old, new = (case["A1"].clone(), case["B1"].clone()), (case["A2"].clone(), case["B2"].clone())
    return W, old, new, W.data_ptr()


def _swap_report(case: dict, W: torch.Tensor, old: tuple, new: tuple, memory: int, returned) -> dict:
    """What the reader's swap did, as plain values: what came back, whether W still has its memory, its
    requires_grad and numbers, and whether the adapters were left alone."""
    return {"returned": returned, "returned_W": returned is W,
            "same_memory": W.data_ptr() == memory and tuple(W.shape) == tuple(case["merged"].shape),
            "requires_grad": W.requires_grad, "W": W.detach().clone(),
            "adapters_kept": all(torch.equal(t, case[k]) for t, k in zip(old + new, ("A1", "B1", "A2", "B2")))}


def check_adapter_swap(fn: Callable) -> Verdict:
    """Exercise 13.2: ``fn(W, old, new, alpha) -> None``: ``W`` (d_out, d_in), float32, holds a base weight with
    the adapter ``old = (A1, B1)`` merged, ``base + (alpha / r1) B1 A1``; change it in place (its own memory, no
    new tensor) to hold ``base + (alpha / r2) B2 A2`` for ``new = (A2, B2)``, the ranks r1 and r2 read from the
    adapters. Judged within float32 rounding (:func:`_rounding_bound`): subtracting a merged update does not give
    the base weight back exactly. One case has ``W`` an ``nn.Parameter`` that requires gradients. The merges of
    groundup.lora and peft are refused."""
    forbid = _swap_solutions()  # before the check: importing peft changes torch's globals

    def checks():
        g = torch.Generator().manual_seed(1302)
        for d_out, d_in, r1, r2, alpha, parameter in _SWAP_CASES:
            case = _swap_case(g, d_out, d_in, r1, r2, alpha)
            expected = case["base"].double() + (alpha / r2) * (case["B2"].double() @ case["A2"].double())
            bound = _rounding_bound(case, alpha)
            wrong = _swap_wrong(case, alpha)
            crashed = []
            kind = "an nn.Parameter that requires gradients" if parameter else "a float32 tensor"
            call = (f"my_swap_adapter(W, old, new, alpha={alpha:g}) with W {kind} of shape ({d_out}, {d_in}), "
                    f"r1 = {r1}, r2 = {r2}")

            def swap(case=case, alpha=alpha, parameter=parameter, crashed=crashed):  # the reader's thread
                try:
                    W, old, new, memory = _swap_inputs(case, parameter)
                except Exception as err:  # noqa: BLE001 -- the checker's own failure, raised as such below
                    crashed.append(err)
                    return None
                returned = fn(W, old, new, alpha)
                try:
                    return _swap_report(case, W, old, new, memory, returned)
                except Exception as err:  # noqa: BLE001 -- as above
                    crashed.append(err)
                    return None

            try:
                with torch.enable_grad():  # as in a notebook: in-place changes of a parameter need torch.no_grad()
                    report = call_reader(swap, call=call, forbid=forbid)
            except ReaderError as err:
                if isinstance(err.error, RuntimeError) and "leaf Variable that requires grad" in str(err.error):
                    raise ReaderError(err.call, err.error, "W is a parameter that requires gradients, and autograd "
                                      "refuses to change such a tensor in place (it could not compute gradients "
                                      "through the change): do the update inside `with torch.no_grad():`, and "
                                      "leave W.requires_grad as it is.") from err.error
                raise _shape_error_hint(err, _SWAP_SHAPES) from err.error
            if crashed:
                raise crashed[0]
            returned = report["returned"]
            expect(report["same_memory"], f"{call}: W no longer uses its own memory (W.data = ... or W.set_(...) "
                   "gave it another tensor's)", "Change the numbers where they are, with in-place operations "
                   "(W -= ..., W.add_(...), W.addmm_(...)): the point is to keep one full-size weight, not to make "
                   "a new one.")
            expect(report["requires_grad"] == parameter, f"{call}: W.requires_grad is now "
                   f"{report['requires_grad']}, it was {parameter}", "Leave requires_grad as it is: use `with "
                   "torch.no_grad():` for the in-place update instead of switching gradients off for W.")
            expect(report["adapters_kept"], f"{call} changed the adapters old or new",
                   "Leave A1, B1, A2 and B2 as they are: compute with them, do not scale them in place.")
            got = report["W"].double()
            expect(bool(got.isfinite().all()), f"{call}: W holds {int((~got.isfinite()).sum())} numbers that are "
                   "NaN or infinite", "Subtract (alpha / r1) B1 A1 and add (alpha / r2) B2 A2: finite numbers give "
                   "finite numbers.")
            if torch.equal(report["W"], case["merged"]):
                if isinstance(returned, torch.Tensor):
                    raise Mismatch(f"{call} returned a new tensor and left W as it was",
                                   "Change W itself, in place (W -= ..., W += ..., W.addmm_(...)), and return "
                                   "nothing: the caller's W is the weight a served model uses, and a second "
                                   "full-size copy is what the exercise avoids.")
                raise Mismatch(f"{call} left W as it was", "`W = W - ...` makes a new tensor and only rebinds the "
                               "name W inside your function; change the caller's tensor with in-place operations: "
                               "W -= ..., W.add_(...), W.addmm_(...).")
            if not bool(((got - expected).abs() <= bound).all()):
                for hint, value in wrong:
                    if bool(((got - value).abs() <= bound).all()) and not bool(((value - expected).abs()
                                                                                <= bound).all()):
                        raise Mismatch(f"{call}: W does not hold the base weight with the new adapter merged",
                                       hint)
                worst = ((got - expected).abs() / bound).max().item()
                raise Mismatch(f"{call}: W differs from base + (alpha / r2) B2 A2 by up to {worst:.3g} times the "
                               "float32 rounding allowed", "W holds base + (alpha / r1) B1 A1; subtract "
                               "(alpha / r1) B1 A1 and add (alpha / r2) B2 A2, with r1 = A1.shape[0] and "
                               "r2 = A2.shape[0].")
            expect(not report["returned_W"], f"{call} returned W",
                   "Change W in place and return nothing: the caller already holds W, which now has the new "
                   "adapter merged, so the exercise's function returns None.")
            expect(returned is None, f"{call} returned {type(returned).__name__}, a value other than W",
                   "W now holds the answer, so return nothing (None): a returned copy would be a second full-size "
                   "weight.")

    return run_checks("Exercise 13.2 (swapping adapters in place)", checks,
                      "W holds the base weight with the new adapter merged, in its own memory, to float32 rounding "
                      "(merging and then unmerging is not exact in float32: (W + D) - D can differ from W in the "
                      "last bit), for ranks equal and different and for a weight that requires gradients.")


# ---- Exercise 13.3 -----------------------------------------------------------------------------------------

LORA_TARGETS = ("W_q", "W_k", "W_v", "W_o", "W_gate", "W_in", "W_out")
"""The projections of a LLaMA-style block that an adapter can sit on (groundup's names)."""


def _lora_shapes(d_model: int, n_heads: int, n_kv_heads: int, d_ff: int) -> dict[str, tuple[int, int]]:
    """``(out_features, in_features)`` of each projection of a LLaMA-style block (grouped-query attention: W_K and
    W_V have ``n_kv_heads * d_model / n_heads`` rows; a SwiGLU feed-forward: W_gate, W_in, W_out)."""
    d_kv = d_model // n_heads * n_kv_heads
    return {"W_q": (d_model, d_model), "W_k": (d_kv, d_model), "W_v": (d_kv, d_model), "W_o": (d_model, d_model),
            "W_gate": (d_ff, d_model), "W_in": (d_ff, d_model), "W_out": (d_model, d_ff)}


_COUNT_HINT = ("The exercise is to count with the formula r (d_in + d_out) per adapted matrix, without building "
               "adapters or a model.")
_SHAPES_HINT = ("write down each matrix's shape (d_out, d_in) from d_model, n_heads, n_kv_heads and d_ff (with "
                "grouped-query attention W_K and W_V have n_kv_heads * d_model / n_heads rows), then apply "
                "r (d_in + d_out).")
_BLOCK_HINT = ("Count without building a block, its attention or its feed-forward to read the layers' in_features "
               "and out_features: " + _SHAPES_HINT)
_LAYER_HINT = ("Count without building a model or any layer of one (an nn.Linear or nn.Embedding, of any library, "
               "even on the meta device) to read its shapes: " + _SHAPES_HINT)


@functools.cache
def _count_builders() -> tuple:
    """What a count must not call: the package's count, adapters, GPT and its parts (a block, its attention, its
    feed-forward: each would tell the layers' shapes), the checker's own shapes, and, where they are installed,
    transformers' LLaMA model, blocks, attention and MLP and peft's LoRA model and layers (imported here, not when
    the reader's function runs, so that a function importing them itself is caught too), and any nn.Linear or
    nn.Embedding at all, so that any other library's model (transformers' Mistral or Qwen2, ...) is caught too.
    Building is caught in ``__init__``, so a model built on the meta device is caught too."""
    forbid = [lora_parameter_count, attach_lora, _lora_shapes,
              Forbidden(LoRALinear, "__init__", label="groundup.lora.LoRALinear", hint=_COUNT_HINT),
              Forbidden(GPT, "__init__", label="groundup.models.GPT", hint=_COUNT_HINT),
              Forbidden(TransformerBlock, "__init__", label="groundup.layers.TransformerBlock", hint=_BLOCK_HINT),
              Forbidden(MultiHeadAttention, "__init__", label="groundup.attention.MultiHeadAttention",
                        hint=_BLOCK_HINT),
              Forbidden(FeedForward, "__init__", label="groundup.layers.FeedForward", hint=_BLOCK_HINT),
              # every model of every library (transformers' Mistral, Qwen2, ...) is built of these: caught last,
              # after the named builders above, which a model's __init__ reaches first
              Forbidden(nn.Linear, "__init__", label="torch.nn.Linear", hint=_LAYER_HINT),
              Forbidden(nn.Embedding, "__init__", label="torch.nn.Embedding", hint=_LAYER_HINT)]

    def llama():
        from transformers.models.llama import modeling_llama
        return [Forbidden(modeling_llama.LlamaModel, "__init__", label="transformers.LlamaModel", hint=_COUNT_HINT),
                Forbidden(modeling_llama.LlamaDecoderLayer, "__init__", label="transformers.LlamaDecoderLayer",
                          hint=_COUNT_HINT),
                Forbidden(modeling_llama.LlamaAttention, "__init__", label="transformers.LlamaAttention",
                          hint=_BLOCK_HINT),
                Forbidden(modeling_llama.LlamaMLP, "__init__", label="transformers.LlamaMLP", hint=_BLOCK_HINT)]

    def peft_model():
        from peft.tuners.lora import layer as peft_layer
        from peft.tuners.tuners_utils import BaseTuner
        return [Forbidden(BaseTuner, "__init__", label="peft's LoRA model (get_peft_model)", hint=_COUNT_HINT),
                Forbidden(peft_layer.LoraLayer, "update_layer", label="peft's LoRA layer", hint=_COUNT_HINT)]

    return tuple(forbid + _if_installed(llama) + _if_installed(peft_model))


SMOLLM2_SHAPE = (30, 576, 9, 3, 1536)
"""SmolLM2-135M's (n_layers, d_model, n_heads, n_kv_heads, d_ff)."""


def _count_cases() -> list[tuple[tuple[int, ...], int, tuple[str, ...]]]:
    """SmolLM2's adapters (the exercise states their count) and five LLaMA-style shapes, ranks and target sets drawn
    afresh on every call, so that a table of remembered answers fails; the second always has grouped-query
    attention with W_K or W_V adapted."""
    rng = random.SystemRandom()
    cases = [(SMOLLM2_SHAPE, 8, ("W_q", "W_v"))]
    for k in range(5):
        n_heads = rng.choice((4, 6, 8, 12, 16, 32))
        n_kv = rng.choice([d for d in range(1, n_heads) if n_heads % d == 0] if k == 1 else
                          [d for d in range(1, n_heads + 1) if n_heads % d == 0])
        d_model = n_heads * rng.choice((8, 16, 32, 64, 128))
        d_ff = rng.choice((2, 3, 4)) * d_model + rng.choice((0, 16, 64))
        targets = tuple(t for t in LORA_TARGETS if rng.random() < 0.5) or (rng.choice(LORA_TARGETS),)
        if k == 1 and not {"W_k", "W_v"} & set(targets):
            targets = (*targets, rng.choice(("W_k", "W_v")))
        cases.append(((rng.randint(1, 40), d_model, n_heads, n_kv, d_ff), rng.choice((1, 2, 4, 8, 16, 32, 64)),
                      tuple(t for t in LORA_TARGETS if t in targets)))
    return cases


def _count_hints(shape: tuple[int, ...], r: int, targets: tuple[str, ...], expected: int) -> dict[int, str]:
    """Wrong counts keyed to the mistake that gives them (none of them equal to the right count)."""
    n_layers, d_model, n_heads, n_kv, d_ff = shape
    shapes = _lora_shapes(d_model, n_heads, n_kv, d_ff)
    no_gqa = n_layers * sum(r * 2 * d_model if t in ("W_q", "W_k", "W_v", "W_o") else r * sum(shapes[t])
                            for t in targets)
    hints = {n_layers * sum(shapes[t][0] * shapes[t][1] for t in targets):
             "That is the number of weights of the adapted matrices (d_out * d_in each), not of their adapters.",
             expected // n_layers: "Every one of the n_layers blocks gets its own adapters.",
             n_layers * sum(r * shapes[t][1] for t in targets): "Count both factors of each adapter, A and B.",
             n_layers * sum(r * r for _ in targets): "A and B are not r x r: each has one side of length r.",
             no_gqa: "With grouped-query attention W_K and W_V have fewer rows than d_model: n_kv_heads heads of "
                     "d_model / n_heads numbers each."}
    if len(targets) > 1:
        for t in targets:
            hints.setdefault(expected - n_layers * r * sum(shapes[t]),
                             f"Count every projection named in targets: your count leaves out {t}.")
    hints.pop(expected, None)
    return hints


def check_lora_parameter_count(fn: Callable) -> Verdict:
    """Exercise 13.3: ``fn(n_layers, d_model, n_heads, n_kv_heads, d_ff, r, targets) -> int``, the trainable
    numbers of rank-``r`` adapters on the ``targets`` projections (names from :data:`LORA_TARGETS`) of every one of
    ``n_layers`` LLaMA-style blocks. Calling the package's count, attaching adapters or building a model or a part
    of one to read its shapes (the package's GPT, TransformerBlock, MultiHeadAttention or FeedForward,
    transformers' LLaMA model, decoder layer, attention or MLP, peft's LoRA model, and any ``nn.Linear`` or
    ``nn.Embedding``, so any other model too) is refused; the cases after SmolLM2's are new each call."""
    forbid = _count_builders()

    def checks():
        for shape, r, targets in _count_cases():
            n_layers, d_model, n_heads, n_kv, d_ff = shape
            shapes = _lora_shapes(d_model, n_heads, n_kv, d_ff)
            expected = n_layers * sum(r * (shapes[t][0] + shapes[t][1]) for t in targets)
            hints = _count_hints(shape, r, targets, expected)
            call = f"my_lora_parameter_count({n_layers}, {d_model}, {n_heads}, {n_kv}, {d_ff}, r={r}, {targets})"
            got = expect_integer(call_reader(fn, n_layers, d_model, n_heads, n_kv, d_ff, r, targets, call=call,
                                             forbid=forbid), call)
            fallback = (f"Your count is {got / expected:.3g} times the right one. Write down the shape (d_out, d_in) "
                        "of each matrix named in targets (grouped-query attention and d_ff matter), then apply "
                        "(13.3) to each, in every block.") if expected else ""
            expect(got == expected, f"{call} = {got:,}, expected {expected:,}", hints.get(got, fallback))

    return run_checks("Exercise 13.3 (LoRA's trainable parameters)", checks,
                      "Right for SmolLM2 (460,800 at r = 8 on W_q and W_v) and five shapes drawn at random.")


# ---- Exercise 13.4 -----------------------------------------------------------------------------------------

IGNORE_INDEX = -100
_CHAT_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
"""The chat template's special tokens; SmolLM2 gives them the ids 0, 1 and 2."""
_CHAT_VOCAB = 49_152
"""SmolLM2's vocabulary size: the ids of the checker's chats are spread over it, some above int16's 32,767."""

_CHAT_CASES = (
    ("one assistant turn, its span at the very end",
     [("user", "What is 2 + 2?"), ("assistant", "4")], True, False),
    ("two assistant turns",
     [("user", "Write this date: may third"), ("assistant", "2001-05-03"), ("user", "And june first?"),
      ("assistant", "2001-06-01")], False, False),
    ("three assistant turns and a system message, the last span at the very end",
     [("system", "Answer in one word."), ("user", "Capital of France?"), ("assistant", "Paris"),
      ("user", "Of Italy?"), ("assistant", "Rome"), ("user", "And Spain?"), ("assistant", "Madrid")], True, False),
    ("an empty answer (a span of <|im_end|> alone) and an answer given as two adjacent spans",
     [("user", "Say nothing."), ("assistant", ""), ("user", "Count to three."), ("assistant", "1, 2, 3")],
     False, True),
)
"""(description, messages as (role, content), whether the chat ends at the last <|im_end|> (as a training example
does) rather than with the template's newline after it, whether the last answer's span is split in two adjacent
spans (start, middle) and (middle, end))."""


def _chat_ids(messages: list[tuple[str, str]], ends_at_answer: bool, split: bool
              ) -> tuple[list[int], list[tuple[int, int]]]:
    """The token ids of a chat in SmolLM2's template (:func:`groundup.pretrained.encode_chat`, here with a
    byte-level tokenizer: a token per byte) and its assistant spans: each from the answer's first token to just
    past its ``<|im_end|>``, found as where :func:`encode_chat` of the messages before it stops."""
    from groundup.pretrained import encode_chat
    from groundup.tokenizers import BPETokenizer

    tokenizer = BPETokenizer(special_tokens=_CHAT_SPECIALS)
    chat = [{"role": role, "content": content} for role, content in messages]
    ids = encode_chat(tokenizer, chat, add_generation_prompt=False)
    end_id = tokenizer.special_ids["<|im_end|>"]
    spans = []
    for k, (role, content) in enumerate(messages):
        if role == "assistant":
            start = len(encode_chat(tokenizer, chat[:k], add_generation_prompt=True))
            end = start + len(tokenizer.encode_ordinary(content)) + 1
            assert ids[end - 1] == end_id and ids[start - 1] == ord("\n"), (start, end)  # the checker's own
            spans.append((start, end))
    if ends_at_answer:
        ids = ids[:spans[-1][1]]
    if split:
        start, end = spans.pop()
        spans += [(start, (start + end) // 2), ((start + end) // 2, end)]
    return ids, spans


def _chat_vocabulary(g: torch.Generator) -> torch.Tensor:
    """A map from the byte-level tokenizer's 259 ids to SmolLM2-like ones: the special tokens to 0, 1 and 2, the
    bytes to distinct ids drawn from 3 to 49,151, the newline (in every chat) above 32,767, so that int16 labels
    overflow."""
    while True:
        ids = 3 + torch.randperm(_CHAT_VOCAB - 3, generator=g)[:256]
        if int(ids[ord("\n")]) > torch.iinfo(torch.int16).max:
            return torch.cat([ids, torch.tensor([0, 1, 2])])


def _chat_labels(ids: torch.Tensor, spans) -> torch.Tensor:
    labels = torch.full_like(ids, IGNORE_INDEX)
    for start, end in spans:
        labels[start - 1:end - 1] = ids[start:end]
    return labels


def _labels_for_targets(ids: torch.Tensor, targets: torch.Tensor, masked: int = IGNORE_INDEX) -> torch.Tensor:
    """Labels that train exactly the positions whose next token is marked in ``targets`` (bool, one per token)."""
    return torch.cat([torch.where(targets[1:], ids[1:], torch.full_like(ids[1:], masked)),
                      torch.tensor([masked], dtype=ids.dtype)])


def _span_marks(n: int, spans, shift_start: int = 0, shift_end: int = 0) -> torch.Tensor:
    """A bool mask of length ``n`` marking the tokens start + shift_start to end + shift_end - 1 of each span."""
    marks = torch.zeros(n, dtype=torch.bool)
    for start, end in spans:
        marks[max(start + shift_start, 0):max(min(end + shift_end, n), 0)] = True
    return marks


def _chat_wrong(ids: torch.Tensor, spans) -> list[tuple[str, torch.Tensor]]:
    """The labels the plausible mistakes give, each with the hint that names the mistake."""
    n = len(ids)
    unshifted = torch.full_like(ids, IGNORE_INDEX)
    for start, end in spans:
        unshifted[start:end] = ids[start:end]
    first = spans[0][0]
    return [
        ("Position i predicts token i + 1: label i is ids[i + 1] (the ids shifted left by one, chapter 7's "
         "next-token targets), not ids[i].", unshifted),
        ("Off by one: you labelled each span's own positions. The position before a span (start - 1, the '\\n' "
         "after 'assistant') predicts the answer's first token, and the span's last position (its <|im_end|>) "
         "predicts the next turn, which is not trained: label the positions whose next token lies in the span.",
         _labels_for_targets(ids, _span_marks(n, spans, 1, 1))),
        ("The spans are half-open: (start, end) holds the tokens start to end - 1, so the token at end (what "
         "follows <|im_end|>) is not trained.", _labels_for_targets(ids, _span_marks(n, spans, 0, 1))),
        ("Each span includes the answer's <|im_end|>: the position before it must be trained to predict it, or "
         "the model never learns to end its turn.", _labels_for_targets(ids, _span_marks(n, spans, 0, -1))),
        ("Train every assistant turn: your labels train only the first answer. Go through all the spans.",
         _labels_for_targets(ids, _span_marks(n, spans[:1]))),
        ("Train every assistant turn: your labels train only the last answer (one prompt length, as for a "
         "single turn, leaves the earlier answers masked). Go through all the spans.",
         _labels_for_targets(ids, _span_marks(n, spans[-1:]))),
        ("Only the assistant's tokens are trained: the user's later turns and the template around them "
         "(<|im_start|>user, ...) get -100 too. One prompt length cannot say that; the spans can.",
         _labels_for_targets(ids, torch.arange(n) >= first)),
        ("Positions that are not trained get -100 (the index the loss ignores), not 0: 0 is a real token id "
         "(<|endoftext|>), so the model would be trained to predict it.",
         _labels_for_targets(ids, _span_marks(n, spans), masked=0)),
        ("Mask with -100 every position whose next token is outside the assistant spans: here the system and "
         "user turns are trained too.", _labels_for_targets(ids, torch.ones(n, dtype=torch.bool))),
    ]


def _chat_dtype_hint(dtype: torch.dtype) -> str:
    if dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
        return "Labels are token ids: an int64 tensor (torch.full_like(ids, -100) has ids' dtype)."
    return ("Return int64 labels, the dtype of ids (torch.full_like(ids, -100) keeps it): cross_entropy takes "
            "int64 targets, and a smaller integer type may not hold the ids (int16 stops at 32,767, and SmolLM2 "
            "has 49,152 tokens).")


def check_chat_labels(fn: Callable) -> Verdict:
    """Exercise 13.4: ``fn(ids, assistant_spans) -> labels``: the next-token targets of a multi-turn chat that
    train every assistant turn and nothing else. ``ids`` is 1-D int64, the chat in SmolLM2's template;
    ``assistant_spans`` lists the half-open token spans ``(start, end)`` of the assistant's answers, each the
    answer's tokens and its ``<|im_end|>``. Label ``i`` is ``ids[i + 1]`` where position ``i + 1`` lies in a span,
    -100 elsewhere and at the last position; the labels are int64, as ``ids``. Four chats (one, two and three
    assistant turns, an empty answer, spans at the very end and adjacent spans), their ids spread over SmolLM2's
    vocabulary afresh on every call. ``encode_instructions`` is refused."""
    forbid = (encode_instructions, _chat_labels, _labels_for_targets, _span_marks)

    def checks():
        g = torch.Generator().manual_seed(random.SystemRandom().randrange(2**31))  # new ids every call
        vocabulary = _chat_vocabulary(g)
        for description, messages, ends_at_answer, split in _CHAT_CASES:
            raw, spans = _chat_ids(messages, ends_at_answer, split)
            ids = vocabulary[torch.tensor(raw)]
            expected = _chat_labels(ids, spans)
            wrong = _chat_wrong(ids, spans)
            n = len(ids)
            call = f"my_chat_labels(ids, assistant_spans={spans}) on a chat of {n} tokens with {description}"
            got = expect_tensor(call_reader(fn, ids, spans, call=call, names=("ids", "assistant_spans"),
                                            forbid=forbid), call)
            expect(got.dtype == torch.int64, f"{call} returned a tensor of dtype {got.dtype}",
                   _chat_dtype_hint(got.dtype))
            expect(tuple(got.shape) == (n,), f"{call} returned shape {tuple(got.shape)}, expected ({n},)",
                   "One label per position, the same length as ids.")
            if torch.equal(got, expected):
                continue
            for hint, value in wrong:
                if torch.equal(got, value) and not torch.equal(value, expected):
                    raise Mismatch(f"{call}: wrong labels", hint)
            bad = (got != expected).nonzero().flatten()
            middle = spans[-1][0]
            one_dropped = [_labels_for_targets(ids, _span_marks(n, spans[:k] + spans[k + 1:]))
                           for k in (len(spans) - 2, len(spans) - 1)] if split else []
            if any(torch.equal(got, value) for value in one_dropped) or split and all(
                    abs(int(i) + 1 - middle) <= 1 for i in bad):
                raise Mismatch(f"{call}: label {int(bad[0])} is {int(got[bad[0]])}, expected "
                               f"{int(expected[bad[0]])}", f"Two spans can touch: here {spans[-2]} and then "
                               f"{spans[-1]}, the second starting where the first ends. Label each span on its "
                               "own, whatever the span before it was.")
            first = int(bad[0])
            raise Mismatch(f"{call}: label {first} is {int(got[first])}, expected {int(expected[first])}",
                           "Go through the positions one by one: which of them predict a token of an assistant "
                           "span (its <|im_end|> included), and which token does each predict?")

    return run_checks("Exercise 13.4 (labels for every assistant turn)", checks,
                      "Your labels train every assistant turn, each answer's <|im_end|> included, and nothing "
                      "else, for chats of one to three turns, spans at the very end and adjacent spans.")


# ---- Exercise 13.7 -----------------------------------------------------------------------------------------

_SURGERY_HINT = ("The exercise is to do the surgery yourself, with the chapter's LoRA class, named_modules and "
                 "setattr: groundup.lora (attach_lora, LoRALinear) and peft are the book's and the library's own "
                 "solutions, so calling them proves nothing.")


_MATCH_HINT = ("Write the name rule yourself, it is half the exercise: groundup.lora's _matches is the book's own. "
               "A layer's dotted name matches a target t when it equals t or ends with '.' + t.")


@functools.cache
def _surgery_solutions() -> tuple:
    """What module surgery must not call: the package's attach_lora, name rule (``_matches``) and LoRA layer, and
    peft's injection where peft is installed (imported here, so that a function importing peft itself is caught
    too)."""
    forbid = [attach_lora, Forbidden(LoRALinear, "__init__", label="groundup.lora.LoRALinear", hint=_SURGERY_HINT),
              # the package's name rule, half the exercise: its code is swapped (every reference to it is caught),
              # and its entry in groundup.lora too, which gives both the same label and so the hint
              _matches, Forbidden(groundup.lora, "_matches", label=f"{_matches.__module__}.{_matches.__qualname__}",
                                  hint=_MATCH_HINT)]

    def peft_injection():
        from peft import get_peft_model, inject_adapter_in_model
        from peft.tuners.lora import layer as peft_layer
        from peft.tuners.tuners_utils import BaseTuner
        return [get_peft_model, inject_adapter_in_model,
                Forbidden(BaseTuner, "__init__", label="peft's LoRA model (get_peft_model)", hint=_SURGERY_HINT),
                # peft's LoRA layers themselves, so that a wrapper around one (lora_A and lora_B shown as A and B)
                # is caught too: every one of them is built through LoraLayer.__init__ and update_layer
                Forbidden(peft_layer.LoraLayer, "__init__", label="peft's LoraLayer", hint=_SURGERY_HINT),
                Forbidden(peft_layer.LoraLayer, "update_layer", label="peft's LoraLayer.update_layer",
                          hint=_SURGERY_HINT),
                Forbidden(peft_layer.Linear, "__init__", label="peft's LoRA Linear (peft.tuners.lora.Linear)",
                          hint=_SURGERY_HINT),
                Forbidden(peft_layer.Linear, "forward", label="peft's LoRA Linear.forward", hint=_SURGERY_HINT)]

    return tuple(forbid + _if_installed(peft_injection))


_SURGERY_CONFIG = {"vocab_size": 20, "context_length": 8, "d_model": 16, "n_layers": 2, "n_heads": 2}


class _ProjBlock(nn.Module):
    """A residual block of two linear layers named ``proj`` and ``out_proj``: ``x + out_proj(tanh(proj(x)))``."""

    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.proj = nn.Linear(d, hidden)
        self.out_proj = nn.Linear(hidden, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.out_proj(torch.tanh(self.proj(x)))


class _ProjNet(nn.Module):
    """A small model whose layer names tell ``name.endswith("." + t)`` from ``name.endswith(t)``: its linear layers
    are ``blocks.0.proj``, ``blocks.0.out_proj``, ``blocks.1.proj``, ``blocks.1.out_proj``, ``proj`` and ``head``,
    so the target ``"proj"`` names ``proj`` and ``blocks.k.proj`` but not ``blocks.k.out_proj``. Its forward
    returns ``(logits, None)``, as GPT's does."""

    def __init__(self, vocab_size: int = 20, d: int = 12, hidden: int = 20, n_blocks: int = 2):
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, d)
        self.blocks = nn.ModuleList(_ProjBlock(d, hidden) for _ in range(n_blocks))
        self.proj = nn.Linear(d, d)
        self.head = nn.Linear(d, vocab_size)

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, None]:
        x = self.embedding(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(torch.tanh(self.proj(x))), None


_SURGERY_MODELS = {"gpt": (lambda: GPT(GPTConfig(**_SURGERY_CONFIG)), "a 2-block GPT"),
                   "proj": (_ProjNet, "a model with layers named proj and out_proj")}
_SURGERY_CASES = (("gpt", ("W_q", "W_v"), 2, 4), ("gpt", ("ffn.W_out",), 1, 1), ("gpt", ("W_o", "W_k"), 3, 6),
                  ("proj", ("proj",), 2, 4))
"""(model, targets, r, alpha): the attention's query and value (Hu et al.'s choice), the feed-forward's output layer
named by a dotted suffix, W_O with W_K, where matching by substring would also catch the feed-forward's W_out, and
"proj" on :class:`_ProjNet`, where ``name.endswith(t)`` without the dot would also catch ``out_proj``."""


def _matching(names, targets, rule: str) -> list[str]:
    """The names that ``targets`` pick by ``rule``: "suffix" (the exercise's: the name or a dotted suffix of it),
    "ending" (the name ends with the target, dot or not), "substring" or "last" (the last part of the name only)."""
    if rule == "suffix":
        return [n for n in names if any(n == t or n.endswith("." + t) for t in targets)]
    if rule == "ending":
        return [n for n in names if any(n.endswith(t) for t in targets)]
    if rule == "substring":
        return [n for n in names if any(t in n for t in targets)]
    return [n for n in names if n.rsplit(".", 1)[-1] in targets]


def _surgery_report(model: nn.Module, layers: dict[str, nn.Linear], chosen: list[str], ids: torch.Tensor,
                    new_B: dict[str, torch.Tensor]) -> dict:
    """What the reader's surgery did to ``model`` (the checker's copy, in the reader's thread): each chosen layer's
    replacement and its ``A`` and ``B`` (copies, before any forward pass), the other linear layers left in place,
    every parameter and which train; then the logits on ``ids`` as the surgery left the model, and again with each
    replacement's ``B`` set to ``new_B`` (a forward pass that raises is recorded, not raised: the reader's
    modules run there)."""
    modules = dict(model.named_modules())
    report = {"modules": {}, "untouched": [n for n, layer in layers.items() if n not in chosen
                                           and modules.get(n) is not layer]}
    for name in chosen:
        m = modules.get(name)
        entry = {"present": isinstance(m, nn.Module), "replaced": m is not layers[name], "type": type(m).__name__}
        for key in ("A", "B"):
            t = getattr(m, key, None) if isinstance(m, nn.Module) else None
            entry[key] = t.detach().clone() if isinstance(t, torch.Tensor) else None
            entry[key + "_parameter"] = isinstance(t, nn.Parameter)
            entry[key + "_trains"] = isinstance(t, torch.Tensor) and t.requires_grad
        report["modules"][name] = entry
    report["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    report["trainable"] = [n for n, p in model.named_parameters() if p.requires_grad]
    model.eval()
    with torch.no_grad():
        try:
            report["logits"] = model(ids)[0]  # GPT returns (logits, loss)
        except Exception as err:  # noqa: BLE001 -- the reader's modules failed: judged, not raised
            report["forward_error"] = f"{type(err).__name__}: {err}"
            return report
        bs = [getattr(modules.get(name), "B", None) for name in chosen]
        if all(isinstance(b, torch.Tensor) and b.shape == new_B[name].shape for b, name in zip(bs, chosen)):
            for b, name in zip(bs, chosen):
                b.copy_(new_B[name])
            try:
                report["logits_trained"] = model(ids)[0]
            except Exception as err:  # noqa: BLE001 -- as above
                report["forward_error"] = f"{type(err).__name__}: {err}"
    return report


def _merged_logits(model: nn.Module, ids: torch.Tensor, updates: dict[str, torch.Tensor]) -> torch.Tensor:
    """The logits of a float64 copy of the plain ``model`` whose layers ``updates`` names have ``W + update``."""
    merged = copy.deepcopy(model).double().eval()
    with torch.no_grad():
        for name, update in updates.items():
            merged.get_submodule(name).weight += update.double()
        return merged(ids)[0]


def _names_hint(got: list[str], chosen: list[str], linear: list[str], targets: tuple[str, ...]) -> str:
    """Why the names ``got`` are not the ``chosen`` ones, as a hint."""
    if len(set(got)) < len(got):
        return "Replace each layer once and return each name once."
    for rule, how in (("ending", "with the dot"), ("substring", "not substrings")):
        extra = [n for n in got if n not in chosen]
        if extra and set(got) == set(_matching(linear, targets, rule)):
            target = next(t for t in targets if t in extra[0])
            return (f"Match whole names or dotted suffixes, {how}: name == t or name.endswith('.' + t). "
                    f"'{target}' must not match {extra[0]}.")
    if set(got) == set(_matching(linear, targets, "last")):
        return ("A target can be a dotted suffix such as 'ffn.W_out': a name matches when it equals the target or "
                "ends with '.' + target (comparing the last part of the name alone misses those).")
    if got and not set(got) & set(linear):
        return ("Return the full dotted names that named_modules gives, like 'blocks.0.attention.W_q', not the "
                "targets or the modules.")
    missing = [n for n in chosen if n not in got]
    if missing:
        return (f"Your names leave out {', '.join(missing[:3])}: every block has its own layers, and every nn.Linear "
                "whose name matches a target is replaced.")
    return (f"{', '.join(n for n in got if n not in chosen)} match no target: replace only the nn.Linear layers "
            "whose name equals a target or ends with '.' + target.")


def check_lora_surgery(fn: Callable) -> Verdict:
    """Exercise 13.7: ``fn(model, targets, r, alpha) -> names``: attach adapters to ``model`` in place. Every
    ``nn.Linear`` whose dotted name equals one of ``targets`` or ends with ``"." + target`` is replaced, on its
    parent (``setattr``), by a LoRA layer around it (the chapter's ``LoRA(layer, r, alpha)``: parameters ``A``
    (r, d_in), random, and ``B`` (d_out, r), zero, output ``layer(x) + (alpha / r) (x A^T) B^T``); every other
    parameter is frozen; ``names`` lists the replaced layers. Judged by behaviour on a 2-block GPT, three target
    sets: the names, ``A`` and ``B``, exactly the adapters training, the pretrained weights kept, the logits
    unchanged at the start and those of the merged weights ``W + (alpha / r) B A`` once ``B`` is set; then on a
    model with layers named ``proj`` and ``out_proj`` (:class:`_ProjNet`), where the target ``"proj"`` must not
    name ``out_proj``. Calling ``groundup.lora``'s ``attach_lora`` or ``LoRALinear``, or peft's injection or LoRA
    layers, is refused."""
    forbid = _surgery_solutions()  # before the check: importing peft changes torch's globals

    def checks():
        torch.manual_seed(137)  # run_checks puts the reader's random state back afterwards
        g = torch.Generator().manual_seed(1307)
        references = {key: build().eval() for key, (build, _) in _SURGERY_MODELS.items()}
        ids = torch.randint(0, _SURGERY_CONFIG["vocab_size"], (3, _SURGERY_CONFIG["context_length"]), generator=g)
        with torch.no_grad():
            all_logits = {key: model(ids)[0] for key, model in references.items()}
        for key, targets, r, alpha in _SURGERY_CASES:
            reference, base_logits, described = references[key], all_logits[key], _SURGERY_MODELS[key][1]
            linear = {n: m for n, m in reference.named_modules() if isinstance(m, nn.Linear)}
            chosen = _matching(linear, targets, "suffix")
            assert chosen, targets  # the checker's own cases name layers of its model
            shapes = {n: tuple(linear[n].weight.shape) for n in chosen}  # (d_out, d_in)
            new_B = {n: 0.5 * torch.randn(shapes[n][0], r, generator=g) for n in chosen}
            count = sum(r * (d_out + d_in) for d_out, d_in in shapes.values())
            adapters = {f"{n}.{k}" for n in chosen for k in ("A", "B")}
            pristine, crashed = copy.deepcopy(reference), []

            def adapt_and_run(pristine=pristine, crashed=crashed, targets=targets, r=r, alpha=alpha,
                              chosen=chosen, new_B=new_B):  # the reader's thread: the model is built here
                try:
                    model = copy.deepcopy(pristine)
                    layers = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
                except Exception as err:  # noqa: BLE001 -- the checker's own failure, raised as such below
                    crashed.append(err)
                    return None
                names = fn(model, targets, r, alpha)
                try:
                    report = _surgery_report(model, layers, chosen, ids.clone(), new_B)
                except Exception as err:  # noqa: BLE001 -- as above
                    crashed.append(err)
                    return None
                report["names"] = names
                return report

            call = f"my_add_lora(model, {targets!r}, r={r}, alpha={alpha}) on {described}"
            report = call_reader(adapt_and_run, call=call, forbid=forbid)
            if crashed:
                raise crashed[0]

            names = report["names"]
            expect_type(names, (list, tuple), call, "a list of the replaced layers' names",
                        "Did you forget the `return` statement? Return the list of the names you replaced."
                        if names is None else "Return a list of the replaced layers' dotted names, like "
                        "['blocks.0.attention.W_q', ...] (list(...) of a dict's keys).")
            expect(all(isinstance(n, str) for n in names), f"{call} returned a list of "
                   f"{', '.join(sorted({type(n).__name__ for n in names if not isinstance(n, str)}))}, expected "
                   "names (str)", "Return the replaced layers' names, the strings named_modules gives, not the "
                   "modules.")
            expect(sorted(names) == sorted(chosen), f"{call} returned {len(names)} names, expected the {len(chosen)} "
                   f"layers {', '.join(chosen[:2])}{', ...' if len(chosen) > 2 else ''}",
                   _names_hint(list(names), chosen, list(linear), targets))

            for name, entry in report["modules"].items():
                d_out, d_in = shapes[name]
                expect(entry["present"], f"{call}: the model has no module {name} any more",
                       "Replace the layer with its LoRA wrapper under the same name; do not delete it.")
                expect(entry["replaced"], f"{call}: {name} is still the original nn.Linear",
                       "Replace the layer on its parent module: setattr(model.get_submodule(parent_name), "
                       "child_name, LoRA(layer, r, alpha)), with parent_name, _, child_name = name.rpartition('.'). "
                       "Assigning to the loop variable changes nothing in the model.")
                for key, shape in (("A", (r, d_in)), ("B", (d_out, r))):
                    t = entry[key]
                    expect(t is not None, f"{call}: the {entry['type']} that replaced {name} has no tensor {key}",
                           "The replacement keeps its adapter in two parameters named A (r, d_in) and B (d_out, r), "
                           "as the chapter's LoRA class does.")
                    if tuple(t.shape) == shape[::-1] and shape[0] != shape[1]:
                        raise Mismatch(f"{call}: {name}.{key} has shape {tuple(t.shape)}, the transpose of "
                                       f"{shape}", "A is (r, d_in) = (r, layer.in_features) and B is (d_out, r) = "
                                       "(layer.out_features, r).")
                    expect(tuple(t.shape) == shape, f"{call}: {name}.{key} has shape {tuple(t.shape)}, expected "
                           f"{shape} (r = {r}, layer {d_in} -> {d_out})", "A is (r, d_in) = (r, layer.in_features) "
                           "and B is (d_out, r) = (layer.out_features, r), with the r you were given.")
                    expect(entry[key + "_parameter"], f"{call}: {name}.{key} is a plain tensor, not an "
                           "nn.Parameter", "Make A and B nn.Parameter(...): a plain tensor attribute is not among "
                           "the model's parameters, so no optimizer would train it.")
                    expect(entry[key + "_trains"], f"{call}: {name}.{key} does not require gradients",
                           "The adapters are what trains: freeze the model's parameters before you attach the "
                           "adapters (or freeze only the wrapped layer's), not all parameters after.")
                expect(not entry["B"].any(), f"{call}: {name}.B is not zero at the start",
                       "B starts at zero (A random), so that the adapted model starts exactly as the pretrained one.")
                expect(bool(entry["A"].any()), f"{call}: {name}.A is all zeros at the start",
                       "A starts random (nn.init.kaiming_uniform_(A, a=math.sqrt(5))): with A and B both zero, "
                       "each one's gradient is zero and nothing learns.")
            expect(not report["untouched"], f"{call} replaced {', '.join(report['untouched'][:3])}, which no target "
                   "names", "Replace only the nn.Linear layers whose name equals a target or ends with '.' + target.")

            trainable = set(report["trainable"])
            extra = sorted(trainable - adapters)
            if extra:
                under = [n for n in extra if any(n.startswith(c + ".") for c in chosen)]
                raise Mismatch(f"{call}: {', '.join(extra[:3])}{', ...' if len(extra) > 3 else ''} still require "
                               f"gradients ({len(extra)} parameters besides the adapters)",
                               "The wrapped layer's weight and bias are frozen too: LoRA trains A and B alone."
                               if under else "Freeze every parameter of the model (p.requires_grad_(False) for p in "
                               "model.parameters()) before attaching: only the adapters' A and B train.")
            expect(trainable == adapters, f"{call}: {', '.join(sorted(adapters - trainable)[:3])} do not require "
                   "gradients", "Every adapter's A and B trains.")
            n_trainable = sum(report["params"][n].numel() for n in trainable)
            expect(n_trainable == count, f"{call}: {n_trainable:,} trainable numbers, expected r (d_in + d_out) "
                   f"summed over the layers = {count:,}", "Only A and B of each replaced layer train.")

            original = {n: p.detach() for n, p in reference.named_parameters()}
            for name in chosen:
                kept = [t for n, t in report["params"].items() if n.startswith(name + ".") and n not in adapters]
                for key in ("weight", "bias"):
                    w = getattr(linear[name], key)
                    expect(w is None or any(t.shape == w.shape and torch.equal(t, w) for t in kept),
                           f"{call}: the layer that replaced {name} does not hold the original {key}",
                           "Wrap the model's own layer (LoRA(layer, r, alpha)), do not build a new nn.Linear: the "
                           "adapter adapts the pretrained weights, which stay as they were.")
            changed = [n for n, t in original.items() if not any(n.startswith(c + ".") for c in chosen)
                       and not (n in report["params"] and torch.equal(report["params"][n], t))]
            expect(not changed, f"{call} changed {', '.join(changed[:3])}",
                   "Leave the model's other parameters as they are: only freeze them.")

            if "forward_error" in report:
                raise Mismatch(f"{call}: the adapted model's forward pass raised {report['forward_error']}",
                               "Each replacement takes the layer's input x (..., d_in) and returns (..., d_out): "
                               "layer(x) + (alpha / r) * (x @ A.T) @ B.T.")
            logits = expect_tensor(report["logits"], f"{call}: the adapted model")
            expect_close(logits, base_logits, f"{call}: the adapted model's logits with B = 0 against the "
                         "pretrained model's", "With B = 0 the adapted model computes exactly the pretrained one: "
                         "the replacement returns layer(x) plus the update, computed from the same x.",
                         rtol=1e-5, atol=1e-6)
            a = {n: report["modules"][n]["A"].to(torch.float64) for n in chosen}
            scaled = {"alpha": alpha, "1 (no scale)": 1.0, "r / alpha": r / alpha}
            wanted = _merged_logits(reference, ids, {n: (alpha / r) * new_B[n].double() @ a[n] for n in chosen})
            trained = expect_tensor(report["logits_trained"], f"{call}: the adapted model with B set")
            what = (f"{call}: with B set to random values, the adapted model's logits against the plain model's with "
                    "W + (alpha / r) B A")
            if trained.shape == wanted.shape and not torch.allclose(trained.double(), wanted, rtol=1e-4,
                                                                    atol=1e-5):
                for label, s in scaled.items():
                    if s != alpha / r and torch.allclose(trained.double(), _merged_logits(
                            reference, ids, {n: s * new_B[n].double() @ a[n] for n in chosen}), rtol=1e-4, atol=1e-5):
                        raise Mismatch(f"{what}: your update is scaled by {label}",
                                       f"Scale the update by alpha / r ({alpha:g} / {r} here).")
            expect_close(trained, wanted, what, "The replacement returns layer(x) + (alpha / r) * (x @ A.T) @ B.T.",
                         rtol=1e-4, atol=1e-5)

    return run_checks("Exercise 13.7 (attaching adapters by hand)", checks,
                      "On four target sets of two models your surgery replaces exactly the matching layers, "
                      "trains only the adapters (r (d_in + d_out) numbers each), keeps the pretrained weights, and "
                      "the adapted model computes the merged weights W + (alpha / r) B A.")


# ---- Exercise 13.8 -----------------------------------------------------------------------------------------

_STOPPING_CONFIG = {"vocab_size": 10, "context_length": 8, "d_model": 16, "n_layers": 2, "n_heads": 2}
_STOPPING_DROPOUT = 0.2
"""Dropout on the head's pooled features while training: so counting in train mode gives other answers."""
_STOPPING_SEED = 1308
"""The seed of the dropout masks, set before the checker's run and again before the reader's."""
_STOPPING_CASES = ((24, 6, 0, 40, 4, 3e-3), (16, 4, 1, 24, 2, 1e-2))
"""(training sequences, of which labels flipped, seed, steps, every, lr): the held-out count rises while the head
learns the tokens' rule, then falls while it learns the flipped labels by heart: 32 -> 61 (step 24) -> 53 of 64,
and 51 -> 64 (steps 6 and 8, a tie) -> 46. Measured with and without ATEN_CPU_CAPABILITY=default; that the best
comes well before the last step, and that the second case has a tie, is asserted by
tests/test_exercises_ch13.py.

Chosen so that any correct AdamW loop lands on the checker's run: AdamW fused, foreach or for-loop (the CPU's
default), the loss written as log_softmax and nll_loss or as a mean of per-example losses, and AdamW written out by
hand round differently, and Adam's normalisation amplifies that where a gradient is about its eps (1e-8): an
adapter's A gets its first gradients only once B has moved. The first case used to be (24, 6, 0, 30, 3, 5e-3),
where such a gradient at step 3 put foreach AdamW's parameters 3.2 times a tolerance of (rtol 1e-5, atol 1e-6)
away from fused AdamW's; now the six variants stay within 0.09 and 0.18 of that tolerance (0.14 and 0.15 with
ATEN_CPU_CAPABILITY=default) at every evaluation, with the same held-out counts, while AdamW's default
weight_decay=0.01 lands 65 and 51 times it away at the best step."""
_STOPPING_RTOL, _STOPPING_ATOL = 3e-5, 3e-6
"""How close the reader's trainable parameters must be to the checker's run: three times the tolerance the
measurements above are given in, so the largest honest difference is 0.06 of it and the default weight decay 17
times it; one training step moves a parameter by about lr (3e-3 or 1e-2), a thousand times more."""
_STOPPING_HELD_OUT = 64
_LOOP_HINT = ("Each step: loss = F.cross_entropy(head(ids), labels) on the whole batch, optimizer.zero_grad(), "
              "loss.backward(), optimizer.step(), with AdamW(trainable parameters, lr=lr, weight_decay=0.0) made "
              "once, before the loop (weight_decay=0.0: AdamW's default is 0.01); after steps every, 2 every, ... "
              "count the held-out examples right in eval mode, then back to train mode; keep the earliest best.")


def _toy_task(n: int, seed: int, flipped: int = 0, length: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` sequences of two classes told apart by their tokens: class 0 uses tokens 1-4, class 1 tokens 5-8; then
    the labels of ``flipped`` of them, drawn at random, are swapped (label noise)."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.arange(n) % 2
    ids = torch.randint(1, 5, (n, length), generator=g) + 4 * labels[:, None]
    wrong = torch.randperm(n, generator=g)[:flipped]
    labels[wrong] = 1 - labels[wrong]
    return ids, labels


def _stopping_head(seed: int) -> ClassifierHead:
    """A tiny GPT body (random weights: the task needs none) with rank-2 adapters on W_q and W_v, everything else
    frozen (``classifier_for``), and a 2-class head with dropout on its pooled features; in train mode."""
    torch.manual_seed(seed)
    body = GPT(GPTConfig(**_STOPPING_CONFIG))
    head = classifier_for(body, 2, "lora", seed=seed, lora_rank=2, lora_targets=("W_q", "W_v"))
    head.dropout.p = _STOPPING_DROPOUT
    return head.train()


def _stopping_data(n: int, flipped: int, seed: int) -> tuple[torch.Tensor, ...]:
    """The training sequences with their noisy labels, and clean held-out sequences."""
    return (*_toy_task(n, seed, flipped), *_toy_task(_STOPPING_HELD_OUT, seed + 10))


def _stopping_run(head: ClassifierHead, ids: torch.Tensor, labels: torch.Tensor, held_ids: torch.Tensor,
                  held_labels: torch.Tensor, steps: int, lr: float, every: int, *, eval_mode: bool = True,
                  back_to_train: bool = True) -> tuple[list[tuple], dict[str, torch.Tensor]]:
    """The exercise's training of a copy of ``head`` (or a mistaken one: counting in train mode, or never back in
    train mode after the first count): for every evaluation ``(step, held-out right, training right, trainable
    parameters)``, and the trainable parameters after the last step. The training count (in eval mode, so no
    dropout mask is drawn for it) is -1 where it would change the run."""
    head = copy.deepcopy(head).train()
    torch.manual_seed(_STOPPING_SEED)
    trainable = {n: p for n, p in head.named_parameters() if p.requires_grad}
    optimizer = torch.optim.AdamW(list(trainable.values()), lr=lr, weight_decay=0.0, fused=True)
    record = []
    for step in range(1, steps + 1):
        loss = F.cross_entropy(head(ids), labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % every == 0:
            if eval_mode:
                head.eval()
            with torch.no_grad():
                right = int((head(held_ids).argmax(dim=1) == held_labels).sum())
                seen = int((head(ids).argmax(dim=1) == labels).sum()) if eval_mode else -1
            if back_to_train:
                head.train()
            record.append((step, right, seen, {n: p.detach().clone() for n, p in trainable.items()}))
    return record, {n: p.detach().clone() for n, p in trainable.items()}


def _best(record: list[tuple], column: int = 1, *, latest: bool = False) -> tuple:
    """The evaluation of ``record`` with the most right in ``column`` (1 held-out, 2 training), the earliest of
    a tie (or the latest): ``(step, right, parameters)``."""
    counts = [entry[column] for entry in record]
    k = len(counts) - 1 - counts[::-1].index(max(counts)) if latest else counts.index(max(counts))
    return record[k][0], record[k][column], record[k][3]


def _state(module: nn.Module) -> dict[str, torch.Tensor]:
    """A copy of ``module``'s state dict."""
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _same_parameters(state: dict[str, torch.Tensor], params: dict[str, torch.Tensor]) -> bool:
    return all(state[n].shape == p.shape and torch.allclose(state[n], p, rtol=_STOPPING_RTOL, atol=_STOPPING_ATOL)
               for n, p in params.items())


def _stopping_mistakes(head: ClassifierHead, data: tuple, steps: int, lr: float, every: int, record: list[tuple],
                       final: dict[str, torch.Tensor]) -> list[tuple[str, tuple[int, int], dict]]:
    """The plausible mistakes as ``(hint, (best_step, best_right), trainable parameters left in the head)``."""
    in_train_mode, _ = _stopping_run(head, *data, steps, lr, every, eval_mode=False)
    stays_in_eval, _ = _stopping_run(head, *data, steps, lr, every, back_to_train=False)
    every_step, _ = _stopping_run(head, *data, steps, lr, 1)  # the same training: a count in eval mode draws nothing
    mistakes = [(_best(record, latest=True), "On a tie keep the earliest step: take a new copy only when the count "
                 "is strictly higher (`>`, not `>=`)."),
                (_best(record, 2), "Count the held-out examples (held_ids, held_labels), not the training batch: "
                 "the training count keeps rising as the head learns the flipped labels by heart, which is what "
                 "early stopping is there to catch."),
                (_best(in_train_mode), "Count in eval mode (head.eval(), under torch.no_grad()): in train mode "
                 "dropout drops random features, so the count is noisy, and it draws random numbers that the "
                 "training then misses."),
                (_best(every_step), f"Count the held-out examples only after every `every` = {every} steps (when "
                 "step % every == 0), not after each step: best_step is one of every, 2 every, 3 every, ..."),
                (_best(stays_in_eval), "Put the head back in train mode (head.train()) after each count: otherwise "
                 "the rest of the training runs without dropout."),
                ((steps, record[-1][1], final), "Return the best step and its count, not the last step's, and put "
                 "the parameters of the best step back into the head.")]
    return [(hint, (step, right), params) for (step, right, params), hint in mistakes]


def check_early_stopping(fn: Callable) -> Verdict:
    """Exercise 13.8: ``fn(head, ids, labels, held_ids, held_labels, steps, lr, every) -> (best_step,
    best_right)``: train the parameters of ``head`` (a ``ClassifierHead`` with LoRA adapters and dropout, in train
    mode) that require gradients with ``torch.optim.AdamW(..., lr=lr, weight_decay=0.0)`` (fused or not) on the
    cross-entropy of the whole batch for ``steps`` steps; after every ``every`` steps count the held-out examples
    the head gets right (eval mode, no gradients; train mode again after); keep a copy of the trainable parameters
    at the best count (a tie keeps the earliest step); at the end put that copy back into ``head`` and return the
    step (counted from 1) and its count. Judged against the checker's own run, made before the reader's function
    is called, on two toy tasks with flipped training labels where the held-out count rises and then falls: the
    pair, the trainable parameters left in the head (to a tolerance that fused, foreach and for-loop AdamW all meet,
    see :data:`_STOPPING_CASES`), the frozen ones bit for bit. ``fine_tune`` and
    ``groundup.training.train`` are refused."""
    forbid = (fine_tune, train)
    import torch._dynamo  # noqa: F401 -- an optimizer's first step imports it, and it patches torch.manual_seed:
    # imported before the checks, whose end would take the patch for the reader's

    def checks():
        for n, flipped, seed, steps, every, lr in _STOPPING_CASES:
            head, data = _stopping_head(seed), _stopping_data(n, flipped, seed)
            before = _state(head)
            frozen = [k for k, p in head.named_parameters() if not p.requires_grad]
            trains = [k for k, p in head.named_parameters() if p.requires_grad]
            record, final = _stopping_run(head, *data, steps, lr, every)
            best_step, best_right, best_params = _best(record)
            mistakes = _stopping_mistakes(head, data, steps, lr, every, record, final)
            crashed = []

            def stop_early(crashed=crashed, head=head, data=data, steps=steps, lr=lr, every=every):
                try:  # the reader's thread: the head is copied and the dropout seeded here
                    given, args = copy.deepcopy(head), [t.clone() for t in data]
                    torch.manual_seed(_STOPPING_SEED)
                except Exception as err:  # noqa: BLE001 -- the checker's own failure, raised as such below
                    crashed.append(err)
                    return None
                result = fn(given, *args, steps, lr, every)
                try:
                    return result, _state(given)
                except Exception as err:  # noqa: BLE001 -- as above
                    crashed.append(err)
                    return None

            call = (f"my_early_stopping(head, ids, labels, held_ids, held_labels, steps={steps}, lr={lr:g}, "
                    f"every={every}) on {n} training sequences ({flipped} labels flipped) and "
                    f"{_STOPPING_HELD_OUT} held-out ones")
            report = call_reader(stop_early, call=call, forbid=forbid)
            if crashed:
                raise crashed[0]
            result, state = report

            expect_type(result, (tuple, list), call, "a pair (best_step, best_right)",
                        "Did you forget the `return` statement? Return best_step, best_right." if result is None
                        else "Return the pair best_step, best_right.")
            expect(len(result) == 2, f"{call} returned {len(result)} values, expected 2",
                   "Return the pair best_step, best_right.")
            step, right = result
            if isinstance(right, float) and 0 <= right <= 1 or isinstance(right, torch.Tensor) and \
                    right.is_floating_point() and right.numel() == 1 and 0 <= float(right) <= 1:
                raise Mismatch(f"{call} returned best_right = {float(right):.4g}, a fraction",
                               "Return how many held-out examples the head gets right, an int (the count, not the "
                               "accuracy).")
            step = expect_integer(step, f"{call}: best_step")
            right = expect_integer(right, f"{call}: best_right")

            expect(state.keys() == before.keys() and all(state[k].shape == before[k].shape for k in before),
                   f"{call} changed the head's layers (its parameters are not the ones it was given)",
                   "Train the head as it is: do not add, remove or replace layers.")
            changed = [k for k in frozen if not torch.equal(state[k], before[k])]
            expect(not changed, f"{call} changed {len(changed)} frozen parameters ({', '.join(changed[:2])}, ...)",
                   "Train only the parameters that require gradients: give the optimizer [p for p in "
                   "head.parameters() if p.requires_grad] and leave requires_grad as it is.")
            expect(any(not torch.equal(state[k], before[k]) for k in trains),
                   f"{call}: the head it was given did not change",
                   "Train the head you are given, in place (not a copy of it), and put the best parameters back "
                   "into it.")

            if (step, right) == (best_step, best_right) and _same_parameters(state, best_params):
                continue
            for hint, pair, params in mistakes:
                if (step, right) == pair and _same_parameters(state, params) and not (
                        pair == (best_step, best_right) and _same_parameters(params, best_params)):
                    raise Mismatch(f"{call} returned ({step}, {right}), expected ({best_step}, {best_right}), "
                                   "with the parameters of that step" if pair != (best_step, best_right) else
                                   f"{call} returned the right step, but the head does not hold its parameters",
                                   hint)
            if (step, right) == (best_step, best_right):
                restore = ("Put the copy made at the best step back into the head's trainable parameters "
                           "(p.copy_(saved) under torch.no_grad()). The copy must be a clone: p.detach() alone "
                           "shares p's memory, so it follows every later step.")
                if _same_parameters(state, final):
                    raise Mismatch(f"{call} returned the right step, but the head still holds the parameters of "
                                   "the last step", restore)
                other = [entry[0] for entry in record if _same_parameters(state, entry[3])]
                if other:
                    raise Mismatch(f"{call} returned the right step, but the head holds the parameters of step "
                                   f"{other[0]}, not of step {best_step}", restore)
                raise Mismatch(f"{call} returned the right step, but the head's trainable parameters are none "
                               "that the exercise's training passes through: the training differs", _LOOP_HINT)
            if right == best_right and step in (best_step - 1, best_step // every, best_step // every - 1):
                raise Mismatch(f"{call} returned step {step} with {right} right, expected step {best_step}",
                               "Steps count from 1, and best_step is the number of steps taken when the count was "
                               f"made (a multiple of every = {every}), not the evaluation's index.")
            raise Mismatch(f"{call} returned ({step}, {right}), expected ({best_step}, {best_right})",
                           _LOOP_HINT)

    return run_checks("Exercise 13.8 (early stopping)", checks,
                      "On two tasks where the held-out count rises and then falls, your loop finds the best step "
                      "(the earliest of a tie), returns its count, and leaves the head holding the parameters it "
                      "had there; the frozen weights are bit for bit as they were.")
