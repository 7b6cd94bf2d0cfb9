"""Checkers for chapter 13 (adapting a pretrained model): a LoRA layer's forward pass, merging an adapter into its
weight, counting LoRA's trainable parameters, and the labels of instruction tuning masked to the answer.

Every checker computes the expected values before it calls the reader's function, hands the function copies of
its inputs (and says so if the function changed them in place), and refuses answers that call the package's own
solution (``groundup.lora``, ``groundup.instructions``) or ``peft``.
"""

from __future__ import annotations

import functools
import random
import warnings
from collections.abc import Callable

import torch

from groundup.exercises.checking import (
    Forbidden,
    Mismatch,
    Verdict,
    call_reader,
    expect,
    expect_close,
    expect_integer,
    expect_tensor,
    run_checks,
)
from groundup.instructions import encode_instructions
from groundup.lora import LoRALinear, attach_lora, lora_parameter_count
from groundup.models import GPT

__all__ = ["check_lora_forward", "check_merge", "check_lora_parameter_count", "check_answer_labels",
           "LORA_TARGETS"]

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
    """What an answer must not call: the package's LoRA layer, and peft's where peft is installed (imported here,
    so that a function importing peft itself is caught too)."""
    forbid = [Forbidden(LoRALinear, "forward", label="groundup.lora.LoRALinear.forward", hint=_LORA_HINT),
              Forbidden(LoRALinear, "delta_weight", label="groundup.lora.LoRALinear.delta_weight", hint=_LORA_HINT),
              Forbidden(LoRALinear, "merge", label="groundup.lora.LoRALinear.merge", hint=_LORA_HINT)]

    def peft_layer():
        from peft.tuners.lora import layer as peft_layer
        return [Forbidden(peft_layer.Linear, "forward", label="peft's LoRA Linear.forward", hint=_LORA_HINT),
                Forbidden(peft_layer.Linear, "get_delta_weight", label="peft's LoRA Linear.get_delta_weight",
                          hint=_LORA_HINT)]

    return tuple(forbid + _if_installed(peft_layer))


def _cases(g: torch.Generator) -> list[dict]:
    """Random layers and adapters: (batch shape, d_in, d_out, r, alpha), in float64."""
    cases = []
    for lead, d_in, d_out, r, alpha in (((3,), 6, 4, 2, 5.0), ((2, 5), 8, 8, 1, 1.0), ((4,), 5, 7, 3, 16.0),
                                        ((1, 3), 12, 6, 4, 8.0)):
        cases.append({"x": torch.randn(*lead, d_in, generator=g, dtype=torch.float64),
                      "W": torch.randn(d_out, d_in, generator=g, dtype=torch.float64),
                      "b": torch.randn(d_out, generator=g, dtype=torch.float64),
                      "A": torch.randn(r, d_in, generator=g, dtype=torch.float64),
                      "B": torch.randn(d_out, r, generator=g, dtype=torch.float64),
                      "alpha": alpha})
    return cases


def _forward_hints(case: dict) -> dict[str, torch.Tensor]:
    """The plausible wrong forward passes of ``case``, each keyed by the hint that names the mistake."""
    x, W, b, A, B, alpha = (case[k] for k in ("x", "W", "b", "A", "B", "alpha"))
    r, d_out, d_in = A.shape[0], W.shape[0], W.shape[1]
    base, low = x @ W.T + b, x @ A.T @ B.T
    wrong = {"The scale divides alpha by the rank r = A.shape[0], not by d_out = W.shape[0].":
             base + (alpha / d_out) * low,
             "The scale divides alpha by the rank r = A.shape[0], not by d_in = W.shape[1].":
             base + (alpha / d_in) * low,
             "Scale the update by alpha / r: you left the scale out.": base + low,
             "The scale is alpha / r, not alpha.": base + alpha * low,
             "The scale is alpha / r, not r / alpha.": base + (r / alpha) * low,
             "Add the layer's bias b: the frozen layer computes x W^T + b.": x @ W.T + (alpha / r) * low,
             "The update is added to the frozen layer's output, not used instead of it.": (alpha / r) * low}
    return {hint: value for hint, value in wrong.items() if value.shape == base.shape}


def _match_hint(got: torch.Tensor, wrong: dict[str, torch.Tensor], expected: torch.Tensor) -> str | None:
    for hint, value in wrong.items():
        if got.shape == value.shape and torch.allclose(got.to(torch.float64), value, rtol=1e-6, atol=1e-8) \
                and not torch.allclose(value, expected, rtol=1e-6, atol=1e-8):
            return hint
    return None


# ---- Exercise 13.1 -----------------------------------------------------------------------------------------


def check_lora_forward(fn: Callable) -> Verdict:
    """Exercise 13.1: ``fn(x, W, b, A, B, alpha) -> y``, a LoRA layer's output
    ``y = x W^T + b + (alpha / r) (x A^T) B^T`` for ``x`` of shape ``(..., d_in)``, the frozen ``W`` (d_out, d_in)
    and ``b`` (d_out,), the adapter's ``A`` (r, d_in) and ``B`` (d_out, r)."""
    forbid = _lora_solutions()  # before the check: importing peft changes torch's globals

    def checks():
        cases = _cases(torch.Generator().manual_seed(131))
        for case in cases:
            x, W, b, A, B, alpha = (case[k] for k in ("x", "W", "b", "A", "B", "alpha"))
            r = A.shape[0]
            expected = x @ W.T + b + (alpha / r) * ((x @ A.T) @ B.T)
            wrong = _forward_hints(case)
            call = (f"my_lora_forward(x, W, b, A, B, alpha={alpha:g}) with x of shape {tuple(x.shape)}, "
                    f"W {tuple(W.shape)}, r = {r}")
            got = expect_tensor(call_reader(fn, x, W, b, A, B, alpha, call=call,
                                            names=("x", "W", "b", "A", "B", "alpha"), forbid=forbid),
                                call)
            expect(tuple(got.shape) == tuple(expected.shape),
                   f"{call} returned shape {tuple(got.shape)}, expected {tuple(expected.shape)}",
                   "The output has the input's leading dimensions and d_out features: x A^T is (..., r), then "
                   "times B^T gives (..., d_out).")
            hint = _match_hint(got, wrong, expected)
            if hint:
                raise Mismatch(f"{call}: the output is a LoRA layer computed the wrong way", hint)
            expect_close(got, expected, call, "y = x W^T + b + (alpha / r) * (x A^T) B^T, with r = A.shape[0].",
                         rtol=1e-10, atol=1e-10)

    return run_checks("Exercise 13.1 (a LoRA forward pass)", checks,
                      "Your layer equals W x + b + (alpha / r) B A x for four shapes, ranks 1 to 4.")


# ---- Exercise 13.2 -----------------------------------------------------------------------------------------


def check_merge(fn: Callable) -> Verdict:
    """Exercise 13.2: ``fn(W, A, B, alpha) -> W_merged = W + (alpha / r) B A``, a new tensor (``W`` unchanged), so
    that the plain layer ``x W_merged^T + b`` computes what the adapted layer did."""
    forbid = _lora_solutions()  # before the check: importing peft changes torch's globals

    def checks():
        cases = _cases(torch.Generator().manual_seed(132))
        for case in cases:
            x, W, b, A, B, alpha = (case[k] for k in ("x", "W", "b", "A", "B", "alpha"))
            r = A.shape[0]
            expected = W + (alpha / r) * (B @ A)
            adapted = x @ W.T + b + (alpha / r) * ((x @ A.T) @ B.T)
            wrong = {"The scale divides alpha by the rank r = A.shape[0], not by d_out = W.shape[0].":
                     W + (alpha / W.shape[0]) * (B @ A),
                     "The scale divides alpha by the rank r = A.shape[0], not by d_in = W.shape[1].":
                     W + (alpha / W.shape[1]) * (B @ A),
                     "Scale the update by alpha / r: you left the scale out.": W + B @ A,
                     "The scale is alpha / r, not alpha.": W + alpha * (B @ A),
                     "The scale is alpha / r, not r / alpha.": W + (r / alpha) * (B @ A),
                     "Return the merged weight W + (alpha / r) B A, not the update alone.": (alpha / r) * (B @ A),
                     "Unmerging subtracts the update; merging adds it.": W - (alpha / r) * (B @ A)}
            call = f"my_merge(W, A, B, alpha={alpha:g}) with W of shape {tuple(W.shape)}, r = {r}"
            got = expect_tensor(call_reader(fn, W, A, B, alpha, call=call, names=("W", "A", "B", "alpha"),
                                            forbid=forbid), call)
            if tuple(got.shape) == tuple(W.shape[::-1]) and W.shape[0] != W.shape[1]:
                raise Mismatch(f"{call} returned shape {tuple(got.shape)}, the transpose of W's {tuple(W.shape)}",
                               "The update B A has W's shape (d_out, d_in): B is (d_out, r), A is (r, d_in).")
            expect(tuple(got.shape) == tuple(W.shape), f"{call} returned shape {tuple(got.shape)}, expected W's "
                   f"{tuple(W.shape)}", "The update B A has W's shape (d_out, d_in): B is (d_out, r), A is (r, d_in).")
            hint = _match_hint(got, wrong, expected)
            if hint:
                raise Mismatch(f"{call}: not the merged weight", hint)
            expect_close(got, expected, call, "W_merged = W + (alpha / r) B A.", rtol=1e-10, atol=1e-10)
            expect_close(x @ got.to(torch.float64).T + b, adapted, f"{call}: the merged layer's output against the "
                         "adapted layer's", rtol=1e-10, atol=1e-10)

    return run_checks("Exercise 13.2 (merging an adapter)", checks,
                      "The plain layer with your merged weight computes exactly what the adapted layer did.")


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


@functools.cache
def _count_builders() -> tuple:
    """What a count must not call: the package's count, adapters and GPT, the checker's own shapes, and, where they
    are installed, transformers' LLaMA model and blocks and peft's LoRA model and layers (imported here, not when the
    reader's function runs, so that a function importing them itself is caught too)."""
    forbid = [lora_parameter_count, attach_lora, _lora_shapes,
              Forbidden(LoRALinear, "__init__", label="groundup.lora.LoRALinear", hint=_COUNT_HINT),
              Forbidden(GPT, "__init__", label="groundup.models.GPT", hint=_COUNT_HINT)]

    def llama():
        from transformers.models.llama import modeling_llama
        return [Forbidden(modeling_llama.LlamaModel, "__init__", label="transformers.LlamaModel", hint=_COUNT_HINT),
                Forbidden(modeling_llama.LlamaDecoderLayer, "__init__", label="transformers.LlamaDecoderLayer",
                          hint=_COUNT_HINT)]

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
    ``n_layers`` LLaMA-style blocks. Calling the package's count, attaching adapters or building a model (the
    package's GPT, transformers' LLaMA, peft's LoRA model) is refused; the cases after SmolLM2's are new each call."""
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


def _answer_labels(ids: torch.Tensor, prompt_length: int) -> torch.Tensor:
    labels = torch.full_like(ids, IGNORE_INDEX)
    labels[prompt_length - 1:-1] = ids[prompt_length:]
    return labels


def check_answer_labels(fn: Callable) -> Verdict:
    """Exercise 13.4: ``fn(ids, prompt_length) -> labels``: the next-token targets of one instruction example
    (``ids``: 1-D int64, the prompt's ``prompt_length`` tokens, then the answer and its end token), with -100 (not
    trained) wherever the target is a prompt token and at the last position. Calling
    ``groundup.instructions.encode_instructions`` is refused."""

    def checks():
        g = torch.Generator().manual_seed(random.SystemRandom().randrange(2**31))  # new ids every call
        cases = [(torch.tensor([5, 6, 7, 8, 9, 10]), 3), (torch.tensor([1, 2, 3]), 2), (torch.tensor([4, 4, 9]), 1)]
        cases += [(torch.randint(0, 1000, (n,), generator=g), p) for n, p in ((40, 31), (76, 66), (12, 1))]
        for ids, p in cases:
            expected = _answer_labels(ids, p)
            n = len(ids)
            wrong = {
                "Position i predicts token i + 1, so the labels are the ids shifted left by one (the targets of "
                "chapter 7's next-token loss), not the ids themselves.": torch.where(
                    torch.arange(n) >= p, ids, torch.full_like(ids, IGNORE_INDEX)),
                "The last prompt position (index prompt_length - 1) predicts the answer's first token: keep its "
                "target. Only targets that are prompt tokens are masked.": torch.where(
                    torch.arange(n) >= p, expected, torch.full_like(ids, IGNORE_INDEX)),
                "The end token <|im_end|> belongs to the answer: the position before it (index len(ids) - 2) "
                "must be trained to predict it, or the model never learns to stop.": torch.cat(
                    [expected[:-2], torch.tensor([IGNORE_INDEX, IGNORE_INDEX])]),
                "The last position has no next token: its label is -100.": torch.cat(
                    [expected[:-1], ids[-1:]]),
                "Mask the prompt's targets with -100 (the index the loss ignores): here the prompt is trained "
                "too.": torch.cat([ids[1:], torch.tensor([IGNORE_INDEX])]),
            }
            call = f"my_answer_labels(ids, prompt_length={p}) with {n} ids"
            got = expect_tensor(call_reader(fn, ids, p, call=call, names=("ids", "prompt_length"),
                                            forbid=(encode_instructions, _answer_labels)), call)
            expect(not got.is_floating_point() and got.dtype != torch.bool,
                   f"{call} returned a tensor of dtype {got.dtype}", "Labels are token ids: an int64 tensor.")
            expect(tuple(got.shape) == (n,), f"{call} returned shape {tuple(got.shape)}, expected ({n},)",
                   "One label per position, the same length as ids.")
            if not torch.equal(got.long(), expected):
                for hint, value in wrong.items():
                    if torch.equal(got.long(), value) and not torch.equal(value, expected):
                        raise Mismatch(f"{call}: wrong labels", hint)
                first = int((got.long() != expected).nonzero()[0])
                raise Mismatch(f"{call}: label {first} is {int(got[first])}, expected {int(expected[first])}",
                               "Go through the positions one by one: which of them predict a token of the answer "
                               "(its <|im_end|> included), and which token does each predict?")

    return run_checks("Exercise 13.4 (labels masked to the answer)", checks,
                      "Your labels train exactly the answer's tokens, as groundup.instructions does.")
