"""Checkers for chapter 13 (adapting a pretrained model): a LoRA layer's forward pass, merging an adapter into its
weight, counting LoRA's trainable parameters, the labels of instruction tuning masked to the answer, attaching
adapters to a model by hand (module surgery), and a short tuning of the adapters whose result is checked.

Every checker computes the expected values before it calls the reader's function, hands the function copies of
its inputs (and says so if the function changed them in place), and refuses answers that call the package's own
solution (``groundup.lora``, ``groundup.instructions``, ``groundup.classification.fine_tune``,
``groundup.training.train``) or ``peft``. The two exercises that change a model in place (13.7, 13.8) get a model
that the checker copies or builds in the reader's thread, and everything that runs the reader's modules runs
there too; what the checker then judges is plain tensors: the parameters, the logits, the losses.
"""

from __future__ import annotations

import copy
import functools
import numbers
import random
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from groundup.classification import ClassifierHead, classifier_for, fine_tune
from groundup.exercises.checking import (
    Forbidden,
    Mismatch,
    Verdict,
    call_reader,
    expect,
    expect_close,
    expect_integer,
    expect_tensor,
    expect_type,
    run_checks,
)
from groundup.instructions import encode_instructions
from groundup.lora import LoRALinear, attach_lora, lora_parameter_count, merge_lora
from groundup.models import GPT, GPTConfig
from groundup.training import train

__all__ = ["check_lora_forward", "check_merge", "check_lora_parameter_count", "check_answer_labels",
           "check_lora_surgery", "check_adapter_training", "LORA_TARGETS"]

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


# ---- Exercise 13.7 -----------------------------------------------------------------------------------------

_SURGERY_HINT = ("The exercise is to do the surgery yourself, with the chapter's LoRA class, named_modules and "
                 "setattr: groundup.lora (attach_lora, LoRALinear) and peft are the book's and the library's own "
                 "solutions, so calling them proves nothing.")


@functools.cache
def _surgery_solutions() -> tuple:
    """What module surgery must not call: the package's attach_lora and LoRA layer, and peft's injection where
    peft is installed (imported here, so that a function importing peft itself is caught too)."""
    forbid = [attach_lora, Forbidden(LoRALinear, "__init__", label="groundup.lora.LoRALinear", hint=_SURGERY_HINT)]

    def peft_injection():
        from peft import get_peft_model, inject_adapter_in_model
        from peft.tuners.tuners_utils import BaseTuner
        return [get_peft_model, inject_adapter_in_model,
                Forbidden(BaseTuner, "__init__", label="peft's LoRA model (get_peft_model)", hint=_SURGERY_HINT)]

    return tuple(forbid + _if_installed(peft_injection))


_SURGERY_CONFIG = {"vocab_size": 20, "context_length": 8, "d_model": 16, "n_layers": 2, "n_heads": 2}
_SURGERY_CASES = ((("W_q", "W_v"), 2, 4), (("ffn.W_out",), 1, 1), (("W_o", "W_k"), 3, 6))
"""(targets, r, alpha): the attention's query and value (Hu et al.'s choice), the feed-forward's output layer named
by a dotted suffix, and W_O with W_K, where matching by substring would also catch the feed-forward's W_out."""


def _matching(names, targets, rule: str) -> list[str]:
    """The names that ``targets`` pick by ``rule``: "suffix" (the exercise's: the name or a dotted suffix of it),
    "substring" or "last" (the last part of the name only)."""
    if rule == "suffix":
        return [n for n in names if any(n == t or n.endswith("." + t) for t in targets)]
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


def _merged_logits(model: GPT, ids: torch.Tensor, updates: dict[str, torch.Tensor]) -> torch.Tensor:
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
    if set(got) == set(_matching(linear, targets, "substring")):
        return ("Match whole names or dotted suffixes, not substrings: name == t or name.endswith('.' + t). 'W_o' "
                "must not match blocks.0.ffn.W_out.")
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
    unchanged at the start and those of the merged weights ``W + (alpha / r) B A`` once ``B`` is set.
    Calling ``groundup.lora``'s ``attach_lora`` or ``LoRALinear``, or peft's injection, is refused."""
    forbid = _surgery_solutions()  # before the check: importing peft changes torch's globals

    def checks():
        torch.manual_seed(137)  # run_checks puts the reader's random state back afterwards
        g = torch.Generator().manual_seed(1307)
        reference = GPT(GPTConfig(**_SURGERY_CONFIG)).eval()
        ids = torch.randint(0, _SURGERY_CONFIG["vocab_size"], (3, _SURGERY_CONFIG["context_length"]), generator=g)
        with torch.no_grad():
            base_logits = reference(ids)[0]
        linear = {n: m for n, m in reference.named_modules() if isinstance(m, nn.Linear)}
        for targets, r, alpha in _SURGERY_CASES:
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

            call = f"my_add_lora(model, {targets!r}, r={r}, alpha={alpha}) on a 2-block GPT"
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
                      "On three target sets your surgery replaces exactly the matching layers, trains only "
                      "the adapters (r (d_in + d_out) numbers each), keeps the pretrained weights, and the adapted "
                      "model computes the merged weights W + (alpha / r) B A.")


# ---- Exercise 13.8 -----------------------------------------------------------------------------------------

_TRAINING_CASES = ((30, 1e-2, True), (3, 5e-2, False))
"""(steps, lr, judged in full): a tuning that takes the toy task's loss from ln 2 to below 0.01, whose result is
judged, then three steps at another rate, whose losses alone are."""
_TUNED_TARGETS, _TUNED_RANK = ("W_q", "W_v"), 2


@functools.cache
def _training_solutions() -> tuple:
    """What the loop must not call: the package's training loops and merges."""
    hint = ("The exercise is to write the loop yourself, and merging is the checker's part: fine_tune, "
            "groundup.training.train and the merges of groundup.lora are the book's own, so calling them proves "
            "nothing.")
    return (fine_tune, train, merge_lora,
            Forbidden(LoRALinear, "merge", label="groundup.lora.LoRALinear.merge", hint=hint))


def _toy_task(n: int, seed: int, length: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` sequences of two classes told apart by their tokens: class 0 uses tokens 1-4, class 1 tokens 5-8."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.arange(n) % 2
    return torch.randint(1, 5, (n, length), generator=g) + 4 * labels[:, None], labels


def _tuned_head(seed: int = 0):
    """A tiny GPT body (random weights: the task needs none) with rank-2 adapters on W_q and W_v and a 2-class
    head, everything else frozen (``classifier_for``); and the plain body before the adapters."""
    torch.manual_seed(seed)
    body = GPT(GPTConfig(vocab_size=10, context_length=8, d_model=16, n_layers=2, n_heads=2)).eval()
    head = classifier_for(copy.deepcopy(body), 2, "lora", seed=seed, lora_rank=_TUNED_RANK,
                          lora_targets=_TUNED_TARGETS)
    assert all(m.p == 0 for m in head.modules() if isinstance(m, nn.Dropout))  # the losses are deterministic
    return head, body


def _training_run(head: nn.Module, ids: torch.Tensor, labels: torch.Tensor, steps: int, lr: float, *,
                  weight_decay: float = 0.0, sgd: bool = False,
                  zero_grad: bool = True) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The exercise's loop on a copy of ``head`` (or a mistaken one): the ``steps`` losses before each update and,
    last, the loss after the final update; and the trained copy's parameters."""
    head = copy.deepcopy(head).train()
    trainable = [p for p in head.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(trainable, lr=lr) if sgd else \
        torch.optim.AdamW(trainable, lr=lr, weight_decay=weight_decay, fused=True)
    losses = []
    for _ in range(steps):
        loss = F.cross_entropy(head(ids), labels)
        if zero_grad:
            optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    with torch.no_grad():
        losses.append(F.cross_entropy(head(ids), labels).item())
    return losses, {n: p.detach().clone() for n, p in head.named_parameters()}


def _same_losses(got: list[float], expected: list[float]) -> bool:
    return len(got) == len(expected) and torch.allclose(torch.tensor(got, dtype=torch.float64),
                                                        torch.tensor(expected, dtype=torch.float64),
                                                        rtol=1e-5, atol=1e-7)


def _predictions(head: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return head.eval()(ids).argmax(dim=1)


def _merged_head(head: ClassifierHead, body: GPT, state: dict[str, torch.Tensor]) -> ClassifierHead:
    """A head on a copy of the plain ``body`` (no adapters) whose adapted layers hold ``W + (alpha / r) B A`` and
    whose linear layer is that of ``state``, a state dict of ``head`` (the checker's merge: every adapted layer of
    ``head`` with its own scale, from ``state``'s ``base.weight``, ``A`` and ``B``)."""
    plain = ClassifierHead(copy.deepcopy(body), head.linear.out_features, pooling=head.pooling)
    with torch.no_grad():
        for name, m in head.body.named_modules():
            if isinstance(m, LoRALinear):
                key = f"body.{name}."
                plain.body.get_submodule(name).weight.copy_(
                    state[key + "base.weight"] + m.scale * (state[key + "B"] @ state[key + "A"]))
        plain.linear.weight.copy_(state["linear.weight"])
        plain.linear.bias.copy_(state["linear.bias"])
    return plain


def check_adapter_training(fn: Callable) -> Verdict:
    """Exercise 13.8: ``fn(head, ids, labels, steps, lr) -> losses``: train the parameters of ``head`` (a
    ``ClassifierHead`` with LoRA adapters, everything else frozen) that require gradients, with
    ``torch.optim.AdamW(..., lr=lr, weight_decay=0.0)`` on ``F.cross_entropy(head(ids), labels)``, the full batch
    at every one of ``steps`` steps; return the ``steps`` losses (floats), each before its update. Judged against
    the checker's own run of that loop: the losses, the frozen weights bit for bit, the tuned head's accuracy on
    held-out examples (100 %), and the predictions of the body with the adapters merged, ``W + (alpha / r) B A``
    (computed by the checker). Calling ``fine_tune``, ``groundup.training.train`` or a LoRA merge is refused."""
    forbid = _training_solutions()
    import torch._dynamo  # noqa: F401 -- an optimizer's first step imports it, and it patches torch.manual_seed:
    # imported before the checks, whose end would take the patch for the reader's

    def checks():
        head, body = _tuned_head()
        ids, labels = _toy_task(32, seed=0)
        test_ids, test_labels = _toy_task(64, seed=1)
        before = {k: v.detach().clone() for k, v in head.state_dict().items()}
        frozen = [n for n, p in head.named_parameters() if not p.requires_grad]
        trains = [n for n, p in head.named_parameters() if p.requires_grad]
        for steps, lr, in_full in _TRAINING_CASES:
            ran, reference = _training_run(head, ids, labels, steps, lr)
            expected, after = ran[:-1], ran[1:]
            wrong = {"Record each step's loss before its update (loss.item() of the loss you call backward on), "
                     "not after it.": after,
                     "Use AdamW with weight_decay=0.0: its default, 0.01, also shrinks the adapters a little every "
                     "step.": _training_run(head, ids, labels, steps, lr, weight_decay=0.01)[0][:-1],
                     "Use torch.optim.AdamW, not SGD: with the same learning rate SGD barely moves.":
                     _training_run(head, ids, labels, steps, lr, sgd=True)[0][:-1],
                     "Call optimizer.zero_grad() every step: otherwise each step's gradients add to the earlier "
                     "ones.": _training_run(head, ids, labels, steps, lr, zero_grad=False)[0][:-1]}
            crashed = []

            def train_a_copy(crashed=crashed, steps=steps, lr=lr):  # the reader's thread: the head is copied here
                try:
                    given, x, y = copy.deepcopy(head), ids.clone(), labels.clone()
                except Exception as err:  # noqa: BLE001 -- the checker's own failure, raised as such below
                    crashed.append(err)
                    return None
                losses = fn(given, x, y, steps, lr)
                try:
                    return losses, {k: v.detach().clone() for k, v in given.state_dict().items()}
                except Exception as err:  # noqa: BLE001 -- as above
                    crashed.append(err)
                    return None

            call = f"my_train_adapters(head, ids, labels, steps={steps}, lr={lr:g}) on {len(ids)} sequences"
            report = call_reader(train_a_copy, call=call, forbid=forbid)
            if crashed:
                raise crashed[0]
            losses, state = report

            if isinstance(losses, torch.Tensor):
                raise Mismatch(f"{call} returned a tensor, expected a list of {steps} floats",
                               "Return a list of Python floats: losses.append(loss.item()) at every step.")
            expect_type(losses, (list, tuple), call, f"a list of {steps} floats",
                        "Did you forget the `return` statement? Return the list of the losses." if losses is None
                        else "Return a list of the losses, one float per step.")
            if any(isinstance(x, torch.Tensor) for x in losses):
                raise Mismatch(f"{call} returned a list of tensors, expected floats",
                               "Append loss.item(), a Python float, not the loss tensor: a tensor keeps its whole "
                               "graph (and memory) alive.")
            expect(all(isinstance(x, numbers.Real) and not isinstance(x, bool) for x in losses),
                   f"{call} returned a list of {', '.join(sorted({type(x).__name__ for x in losses}))}, expected "
                   "floats", "Return the losses as numbers: loss.item().")
            got = [float(x) for x in losses]
            expect(len(got) == steps, f"{call} returned {len(got)} losses, expected {steps}",
                   "One loss per step, the one computed before that step's update: the loss after the last update "
                   "is not asked for." if len(got) == steps + 1 else f"Run exactly steps = {steps} updates and "
                   "record one loss at each.")

            expect(state.keys() == before.keys() and all(state[k].shape == before[k].shape for k in before),
                   f"{call} changed the head's layers (its parameters are not the ones it was given)",
                   "Train the head as it is: do not add, remove or replace layers.")
            changed = [n for n in frozen if not torch.equal(state[n], before[n])]
            expect(not changed, f"{call} changed {len(changed)} frozen parameters ({', '.join(changed[:2])}, ...)",
                   "Train only the parameters that require gradients: give the optimizer [p for p in "
                   "head.parameters() if p.requires_grad] and leave requires_grad as it is, so the pretrained "
                   "weights stay as they were.")
            expect(any(not torch.equal(state[n], before[n]) for n in trains),
                   f"{call}: the head it was given did not change",
                   "Train the head you are given, in place: not a copy of it.")

            if not _same_losses(got, expected):
                for hint, value in wrong.items():
                    if _same_losses(got, value) and not _same_losses(value, expected):
                        raise Mismatch(f"{call}: the losses are not those of the exercise's loop", hint)
                if abs(got[0] - len(ids) * expected[0]) < 1e-4 * len(ids) * expected[0]:
                    raise Mismatch(f"{call}: the first loss is {got[0]:.4g}, {len(ids)} times the expected "
                                   f"{expected[0]:.4g}", "Use the mean loss over the batch, F.cross_entropy's "
                                   "default, not the sum.")
                k = next(i for i, (a, b) in enumerate(zip(got, expected)) if abs(a - b) > 1e-5 * abs(b) + 1e-7)
                raise Mismatch(f"{call}: loss {k} is {got[k]:.6g}, expected {expected[k]:.6g}",
                               "Each step: loss = F.cross_entropy(head(ids), labels) on the whole batch, "
                               "optimizer.zero_grad(), loss.backward(), optimizer.step(), with "
                               "AdamW(trainable parameters, lr=lr, weight_decay=0.0) made once, before the loop.")
            off = [n for n in trains if not torch.allclose(state[n], reference[n], rtol=1e-4, atol=1e-5)]
            expect(not off, f"{call}: the losses are right, but the trained {', '.join(off[:2])} are not those of "
                   "the same loop run by the checker", "Return the losses of the training of `head` itself, and "
                   "leave its parameters as the last update left them.")
            if not in_full:
                continue
            expect(got[-1] < got[0] / 2, f"{call}: the loss went from {got[0]:.4g} to {got[-1]:.4g}",
                   "The loss should fall to well under half its start on this easy task.")

            tuned = copy.deepcopy(head)
            tuned.load_state_dict(state)
            predicted = _predictions(tuned, test_ids)
            accuracy = (predicted == test_labels).double().mean().item()
            expect(accuracy == 1.0, f"{call}: the tuned head classifies {accuracy:.0%} of {len(test_ids)} held-out "
                   "sequences right, expected all", "Train the adapters and the head's linear layer, the parameters "
                   "that require gradients, for all the steps.")
            # The reader's parameters are the reference's by now, so a merge that predicts otherwise is the
            # checker's failure, not the reader's: an AssertionError, reported as the book's bug.
            merged = _predictions(_merged_head(head, body, state), test_ids)
            assert torch.equal(merged, predicted), "the merged body predicts otherwise than the tuned head"

    return run_checks("Exercise 13.8 (a short tuning that checks its result)", checks,
                      "Your loop's losses are the reference run's, step for step (ln 2 down to under 0.01 in 30 "
                      "steps); the frozen weights are bit for bit as they were; the tuned head gets every held-out "
                      "example right, and so does the body with the adapters merged into its weights.")
