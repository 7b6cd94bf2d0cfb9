"""Each chapter-13 checker accepts the reference solution, rejects plausible wrong answers with the right hint,
treats the unattempted stub kindly, refuses the package's own solution and reports answers that modify their
inputs. The checkers' own expected values are checked against independent references: groundup.lora's layer and
peft's, attach_lora on a real model, groundup.instructions' encoder, and merge_lora on a tuned classifier."""

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from tiny_chat_base import tiny_base
from torch import nn

from groundup.exercises.ch13 import (
    LORA_TARGETS,
    check_adapter_training,
    check_answer_labels,
    check_lora_forward,
    check_lora_parameter_count,
    check_lora_surgery,
    check_merge,
)
from groundup.instructions import encode_instructions, instruction_messages
from groundup.lora import LoRALinear, attach_lora, count_parameters, lora_parameter_count, merge_lora
from groundup.models import GPT, GPTConfig
from groundup.pretrained import encode_chat

# --- reference solutions (the notebook's hidden solutions) ----------------------------------------------------


def forward_solution(x, W, b, A, B, alpha):
    r = A.shape[0]
    return x @ W.T + b + (alpha / r) * (x @ A.T) @ B.T


def merge_solution(W, A, B, alpha):
    return W + (alpha / A.shape[0]) * B @ A


def lora_shapes(d_model, n_heads, n_kv_heads, d_ff):
    d_kv = d_model // n_heads * n_kv_heads
    return {"W_q": (d_model, d_model), "W_k": (d_kv, d_model), "W_v": (d_kv, d_model),
            "W_o": (d_model, d_model), "W_gate": (d_ff, d_model), "W_in": (d_ff, d_model),
            "W_out": (d_model, d_ff)}


def count_solution(n_layers, d_model, n_heads, n_kv_heads, d_ff, r, targets):
    shapes = lora_shapes(d_model, n_heads, n_kv_heads, d_ff)
    return n_layers * sum(r * (shapes[t][0] + shapes[t][1]) for t in targets)


def labels_solution(ids, prompt_length):
    labels = torch.full_like(ids, -100)
    labels[prompt_length - 1:-1] = ids[prompt_length:]
    return labels


class LoRA(nn.Module):  # the chapter's adapter, as the notebook defines it
    def __init__(self, base, r, alpha):
        super().__init__()
        self.base, self.r, self.scale = base, r, alpha / r
        for p in base.parameters():
            p.requires_grad_(False)
        self.A = nn.Parameter(torch.empty(r, base.in_features))
        nn.init.kaiming_uniform_(self.A, a=math.sqrt(5))
        self.B = nn.Parameter(torch.zeros(base.out_features, r))

    def forward(self, x):
        return self.base(x) + self.scale * (x @ self.A.T) @ self.B.T


def matches(name, targets):
    return any(name == t or name.endswith("." + t) for t in targets)


def surgery_solution(model, targets, r, alpha, *, wrapper=LoRA, match=matches, freeze=True):
    if freeze:
        for p in model.parameters():
            p.requires_grad_(False)
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and match(n, targets)]
    for name in names:
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, wrapper(model.get_submodule(name), r, alpha))
    return names


def training_solution(head, ids, labels, steps, lr):
    optimizer = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=lr, weight_decay=0.0,
                                  fused=True)
    losses = []
    for _ in range(steps):
        loss = F.cross_entropy(head(ids), labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def stub(*args):
    raise NotImplementedError


def verdict(checker, fn, capsys):
    ok = checker(fn)
    return bool(ok), capsys.readouterr().out


CHECKERS = [(check_lora_forward, forward_solution), (check_merge, merge_solution),
            (check_lora_parameter_count, count_solution), (check_answer_labels, labels_solution),
            (check_lora_surgery, surgery_solution), (check_adapter_training, training_solution)]


@pytest.mark.parametrize("checker, solution", CHECKERS)
def test_reference_passes_and_stub_is_not_attempted(checker, solution, capsys):
    ok, out = verdict(checker, solution, capsys)
    assert ok and "✅" in out, out
    ok, out = verdict(checker, stub, capsys)
    assert not ok and "not attempted yet" in out, out


def test_a_float32_answer_passes(capsys):
    def in_float32(x, W, b, A, B, alpha):
        return forward_solution(*(t.float() for t in (x, W, b, A, B)), alpha)

    ok, out = verdict(check_lora_forward, in_float32, capsys)
    assert ok, out


# --- the checkers' formulas against independent references ------------------------------------------------------


def test_the_forward_formula_is_groundups_and_peft_layer():
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    base = nn.Linear(10, 6, dtype=torch.float64)
    ours = LoRALinear(copy.deepcopy(base), r=3, alpha=6.0)
    with torch.no_grad():
        ours.B.normal_()
    config = peft.LoraConfig(r=3, lora_alpha=6, lora_dropout=0.0)
    theirs = peft.tuners.lora.Linear(copy.deepcopy(base), "default", config, r=3, lora_alpha=6)
    with torch.no_grad():
        theirs.lora_A["default"].weight.copy_(ours.A)
        theirs.lora_B["default"].weight.copy_(ours.B)
    x = torch.randn(4, 10, dtype=torch.float64)
    with torch.no_grad():
        expected = forward_solution(x, base.weight, base.bias, ours.A, ours.B, 6.0)
        torch.testing.assert_close(ours(x), expected, rtol=0, atol=1e-12)
        torch.testing.assert_close(theirs(x), expected, rtol=0, atol=1e-12)
        ours.merge()
        torch.testing.assert_close(ours.base.weight, merge_solution(base.weight, ours.A, ours.B, 6.0),
                                   rtol=0, atol=1e-13)


def test_the_count_formula_is_what_attach_lora_trains():
    config = GPTConfig(vocab_size=32, context_length=8, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=24,
                       norm="rmsnorm", activation="swiglu", positional="rope", bias=False)
    for targets in (("W_q", "W_v"), LORA_TARGETS, ("W_k", "W_out")):
        model = GPT(config)
        attach_lora(model, targets, r=2)
        shapes = lora_shapes(16, 4, 2, 24)
        assert count_parameters(model, trainable_only=True) == count_solution(2, 16, 4, 2, 24, 2, targets) == \
            lora_parameter_count([shapes[t] for t in targets] * 2, 2)


def test_smollm2_count_is_the_stored_runs():
    assert count_solution(30, 576, 9, 3, 1536, 8, ("W_q", "W_v")) == 460_800


def test_the_labels_are_groundup_instructions():
    _, tokenizer = tiny_base()

    pairs = [("what is 2 + 2?", "4"), ("Write this date: may third", "2001-05-03")]
    data = encode_instructions(tokenizer, pairs, context_length=512)
    for (prompt, _), ids, labels in zip(pairs, data.ids, data.labels):
        p = len(encode_chat(tokenizer, instruction_messages(prompt)))
        assert torch.equal(labels_solution(ids, p), labels)


# --- wrong answers get the hint that names the mistake ----------------------------------------------------------


@pytest.mark.parametrize("wrong, words", [
    (lambda x, W, b, A, B, alpha: x @ W.T + b + (x @ A.T) @ B.T, "left the scale out"),
    (lambda x, W, b, A, B, alpha: x @ W.T + b + alpha * (x @ A.T) @ B.T, "not alpha."),
    (lambda x, W, b, A, B, alpha: x @ W.T + (alpha / A.shape[0]) * (x @ A.T) @ B.T, "bias"),
    (lambda x, W, b, A, B, alpha: (alpha / A.shape[0]) * (x @ A.T) @ B.T, "not used instead"),
    (lambda x, W, b, A, B, alpha: x @ W.T + b + (alpha / W.shape[0]) * (x @ A.T) @ B.T, "not by d_out"),
    (lambda x, W, b, A, B, alpha: x @ W.T + b + (alpha / W.shape[1]) * (x @ A.T) @ B.T, "not by d_in"),
])
def test_forward_mistakes_are_named(wrong, words, capsys):
    ok, out = verdict(check_lora_forward, wrong, capsys)
    assert not ok and words in out, out


def test_forward_calling_the_package_is_refused(capsys):
    def package(x, W, b, A, B, alpha):
        base = nn.Linear(W.shape[1], W.shape[0], dtype=W.dtype)
        layer = LoRALinear(base, A.shape[0], alpha)
        with torch.no_grad():
            base.weight.copy_(W)
            base.bias.copy_(b)
            layer.A.copy_(A)
            layer.B.copy_(B)
            return layer(x)

    ok, out = verdict(check_lora_forward, package, capsys)
    assert not ok and "groundup.lora" in out, out


def test_forward_calling_peft_is_refused(capsys):
    peft = pytest.importorskip("peft")

    def with_peft(x, W, b, A, B, alpha):
        base = nn.Linear(W.shape[1], W.shape[0], dtype=W.dtype)
        config = peft.LoraConfig(r=A.shape[0], lora_alpha=alpha)
        layer = peft.tuners.lora.Linear(base, "default", config, r=A.shape[0], lora_alpha=alpha)
        with torch.no_grad():
            base.weight.copy_(W)
            base.bias.copy_(b)
            layer.lora_A["default"].weight.copy_(A)
            layer.lora_B["default"].weight.copy_(B)
            return layer(x)

    ok, out = verdict(check_lora_forward, with_peft, capsys)
    assert not ok and "peft" in out, out


@pytest.mark.parametrize("wrong, words", [
    (lambda W, A, B, alpha: W + B @ A, "left the scale out"),
    (lambda W, A, B, alpha: (alpha / A.shape[0]) * B @ A, "not the update alone"),
    (lambda W, A, B, alpha: W - (alpha / A.shape[0]) * B @ A, "merging adds"),
    (lambda W, A, B, alpha: (W + (alpha / A.shape[0]) * B @ A).T, "transpose"),
    (lambda W, A, B, alpha: W + (alpha / W.shape[0]) * B @ A, "not by d_out"),
])
def test_merge_mistakes_are_named(wrong, words, capsys):
    ok, out = verdict(check_merge, wrong, capsys)
    assert not ok and words in out, out


def test_merge_in_place_is_reported(capsys):
    def in_place(W, A, B, alpha):
        W += (alpha / A.shape[0]) * B @ A
        return W

    ok, out = verdict(check_merge, in_place, capsys)
    assert not ok and "in place" in out, out


def test_merge_through_the_package_is_refused(capsys):
    def package(W, A, B, alpha):
        base = nn.Linear(W.shape[1], W.shape[0], dtype=W.dtype)
        layer = LoRALinear(base, A.shape[0], alpha)
        with torch.no_grad():
            base.weight.copy_(W)
            layer.A.copy_(A)
            layer.B.copy_(B)
        layer.merge()
        return base.weight.detach().clone()

    ok, out = verdict(check_merge, package, capsys)
    assert not ok and "groundup.lora" in out, out


@pytest.mark.parametrize("wrong, words", [
    (lambda n, d, h, kv, ff, r, t: n * sum(a * b for a, b in (lora_shapes(d, h, kv, ff)[x] for x in t)),
     "number of weights"),
    (lambda n, d, h, kv, ff, r, t: count_solution(1, d, h, kv, ff, r, t), "n_layers blocks"),
    (lambda n, d, h, kv, ff, r, t: count_solution(n, d, h, h, ff, r, t), "grouped-query"),
    (lambda n, d, h, kv, ff, r, t: float(count_solution(n, d, h, kv, ff, r, t)), "int"),
    (lambda n, d, h, kv, ff, r, t: count_solution(n, d, h, kv, ff, r, t[1:]), "leaves out W_q"),
])
def test_count_mistakes_are_named(wrong, words, capsys):
    ok, out = verdict(check_lora_parameter_count, wrong, capsys)
    assert not ok and words in out, out


def test_count_with_the_package_is_refused(capsys):
    def package(n_layers, d_model, n_heads, n_kv_heads, d_ff, r, targets):
        shapes = lora_shapes(d_model, n_heads, n_kv_heads, d_ff)
        return lora_parameter_count([shapes[t] for t in targets] * n_layers, r)

    ok, out = verdict(check_lora_parameter_count, package, capsys)
    assert not ok and "lora_parameter_count" in out, out


def test_count_fallback_hint_does_not_give_the_solution(capsys):
    ok, out = verdict(check_lora_parameter_count, lambda *args: count_solution(*args) + 1, capsys)
    assert not ok and "times the right one" in out and "(d_ff, d_model)" not in out, out


def test_count_solution_helpers_are_not_exported_and_are_refused(capsys):
    from groundup.exercises import ch13

    assert not hasattr(ch13, "lora_shapes") and not any("shape" in name for name in ch13.__all__)

    def theirs(n_layers, d_model, n_heads, n_kv_heads, d_ff, r, targets):
        shapes = ch13._lora_shapes(d_model, n_heads, n_kv_heads, d_ff)
        return n_layers * sum(r * (shapes[t][0] + shapes[t][1]) for t in targets)

    ok, out = verdict(check_lora_parameter_count, theirs, capsys)
    assert not ok and "_lora_shapes" in out, out


def test_count_cases_are_new_every_call(capsys):
    seen = []

    def recording(*args):
        seen.append(args)
        return count_solution(*args)

    assert verdict(check_lora_parameter_count, recording, capsys)[0]
    assert verdict(check_lora_parameter_count, recording, capsys)[0]
    assert len(seen) == 12 and seen[0] == seen[6] == (30, 576, 9, 3, 1536, 8, ("W_q", "W_v"))
    assert seen[1:6] != seen[7:12]
    assert any(kv < h and {"W_k", "W_v"} & set(t) for _, _, h, kv, _, _, t in seen[1:6])


def test_count_from_a_remembered_table_fails(capsys):
    table = {(30, 576, 9, 3, 1536, 8, ("W_q", "W_v")): 460_800,  # the old fixed cases and their answers
             (30, 576, 9, 3, 1536, 1, ("W_q", "W_v")): 57_600,
             (32, 4096, 32, 32, 11008, 8, ("W_q", "W_v")): 4_194_304}
    ok, out = verdict(check_lora_parameter_count, lambda *args: table.get(args, 0), capsys)
    assert not ok and "expected" in out, out


def test_count_with_transformers_llama_is_refused(capsys):
    pytest.importorskip("transformers")

    def with_llama(n_layers, d_model, n_heads, n_kv_heads, d_ff, r, targets):
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(vocab_size=8, hidden_size=d_model, intermediate_size=d_ff,
                             num_hidden_layers=n_layers, num_attention_heads=n_heads,
                             num_key_value_heads=n_kv_heads)
        with torch.device("meta"):
            model = LlamaForCausalLM(config)
        names = {"W_q": "q_proj", "W_k": "k_proj", "W_v": "v_proj", "W_o": "o_proj", "W_gate": "gate_proj",
                 "W_in": "up_proj", "W_out": "down_proj"}
        return sum(r * (m.in_features + m.out_features) for name, m in model.named_modules()
                   if name.split(".")[-1] in {names[t] for t in targets})

    ok, out = verdict(check_lora_parameter_count, with_llama, capsys)
    assert not ok and "transformers.Llama" in out, out


def test_count_with_peft_is_refused(capsys):
    peft = pytest.importorskip("peft")

    def with_peft(n_layers, d_model, n_heads, n_kv_heads, d_ff, r, targets):
        d_kv = d_model // n_heads * n_kv_heads
        block = nn.ModuleDict({"q_proj": nn.Linear(d_model, d_model), "v_proj": nn.Linear(d_model, d_kv)})
        model = peft.get_peft_model(nn.Sequential(*[copy.deepcopy(block) for _ in range(n_layers)]),
                                    peft.LoraConfig(r=r, target_modules=["q_proj", "v_proj"]))
        return sum(p.numel() for p in model.parameters() if p.requires_grad)

    ok, out = verdict(check_lora_parameter_count, with_peft, capsys)
    assert not ok and "peft" in out, out


@pytest.mark.parametrize("wrong, words", [
    (lambda ids, p: torch.where(torch.arange(len(ids)) >= p, ids, -100), "shifted left"),
    (lambda ids, p: torch.cat([labels_solution(ids, p)[:-2], torch.tensor([-100, -100])]), "<|im_end|>"),
    (lambda ids, p: torch.where(torch.arange(len(ids)) >= p, labels_solution(ids, p), -100), "first token"),
    (lambda ids, p: torch.cat([labels_solution(ids, p)[:-1], ids[-1:]]), "no next token"),
    (lambda ids, p: torch.cat([ids[1:], torch.tensor([-100])]), "prompt is trained"),
    (lambda ids, p: labels_solution(ids, p).float(), "int64"),
])
def test_label_mistakes_are_named(wrong, words, capsys):
    ok, out = verdict(check_answer_labels, wrong, capsys)
    assert not ok and words in out, out


def test_labels_in_place_are_reported(capsys):
    def in_place(ids, prompt_length):
        ids[:prompt_length] = 0
        return labels_solution(ids.clone(), prompt_length)

    ok, out = verdict(check_answer_labels, in_place, capsys)
    assert not ok and "in place" in out, out


def test_labels_through_the_package_are_refused(capsys):
    from groundup import instructions

    def package(ids, prompt_length):
        try:
            instructions.encode_instructions(None, [("a", "b")], context_length=8)
        except TypeError:
            pass
        return labels_solution(ids, prompt_length)

    ok, out = verdict(check_answer_labels, package, capsys)
    assert not ok and "encode_instructions" in out, out


def test_labels_through_the_checkers_own_solution_are_refused(capsys):
    from groundup.exercises import ch13

    ok, out = verdict(check_answer_labels, lambda ids, p: ch13._answer_labels(ids, p), capsys)
    assert not ok and "_answer_labels" in out, out


def test_labels_fallback_hint_does_not_give_the_solution(capsys):
    def off_by_one(ids, prompt_length):
        labels = labels_solution(ids, prompt_length)
        labels[prompt_length - 1] = 7
        return labels

    ok, out = verdict(check_answer_labels, off_by_one, capsys)
    assert not ok and "one by one" in out and "ids[i + 1]" not in out, out


# --- Exercise 13.7: module surgery ------------------------------------------------------------------------------


def test_the_surgery_is_attach_lora_and_the_checkers_merge_is_its_forward():
    from groundup.exercises import ch13

    torch.manual_seed(0)
    model = GPT(GPTConfig(**ch13._SURGERY_CONFIG)).eval()
    ids = torch.randint(0, 20, (2, 8))
    for targets, r, alpha in ch13._SURGERY_CASES:
        ours, theirs = copy.deepcopy(model), copy.deepcopy(model)
        names = surgery_solution(ours, targets, r, alpha)
        adapters = attach_lora(theirs, targets, r=r, alpha=alpha)
        assert names == list(adapters) == ch13._matching(dict(model.named_modules()), targets, "suffix")
        assert [n for n, p in ours.named_parameters() if p.requires_grad] == \
            [n for n, p in theirs.named_parameters() if p.requires_grad]
        assert count_parameters(ours, trainable_only=True) == count_parameters(theirs, trainable_only=True)
        updates = {}
        with torch.no_grad():
            for name in names:
                mine = ours.get_submodule(name)
                mine.B.normal_()
                adapters[name].A.copy_(mine.A)
                adapters[name].B.copy_(mine.B)
                updates[name] = (alpha / r) * mine.B.double() @ mine.A.double()
            torch.testing.assert_close(ours(ids)[0], theirs(ids)[0], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(ours(ids)[0].double(), ch13._merged_logits(model, ids, updates),
                                       rtol=1e-4, atol=1e-5)


class RandomB(LoRA):
    def __init__(self, base, r, alpha):
        super().__init__(base, r, alpha)
        nn.init.normal_(self.B)


class ScaledByAlpha(LoRA):
    def __init__(self, base, r, alpha):
        super().__init__(base, r, alpha)
        self.scale = alpha


class NewLayer(LoRA):
    def __init__(self, base, r, alpha):
        super().__init__(nn.Linear(base.in_features, base.out_features), r, alpha)


class TransposedA(LoRA):
    def __init__(self, base, r, alpha):
        super().__init__(base, r, alpha)
        self.A = nn.Parameter(self.A.detach().T.clone())

    def forward(self, x):
        return self.base(x) + self.scale * (x @ self.A) @ self.B.T


def frozen_after(model, targets, r, alpha):
    names = surgery_solution(model, targets, r, alpha, freeze=False)
    for p in model.parameters():
        p.requires_grad_(False)
    return names


def loop_variable(model, targets, r, alpha):
    for p in model.parameters():
        p.requires_grad_(False)
    names = []
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and matches(name, targets):
            module = LoRA(module, r, alpha)  # noqa: PLW2901 -- the mistake under test
            names.append(name)
    return names


def no_return(model, targets, r, alpha):
    surgery_solution(model, targets, r, alpha)


def the_modules(model, targets, r, alpha):
    names = surgery_solution(model, targets, r, alpha)
    return [model.get_submodule(n) for n in names]


def a_dict(model, targets, r, alpha):
    names = surgery_solution(model, targets, r, alpha)
    return {n: model.get_submodule(n) for n in names}


@pytest.mark.parametrize("wrong, words", [
    (lambda m, t, r, a: surgery_solution(m, t, r, a, wrapper=RandomB), "B starts at zero"),
    (lambda m, t, r, a: surgery_solution(m, t, r, a, wrapper=ScaledByAlpha), "scaled by alpha"),
    (lambda m, t, r, a: surgery_solution(m, t, r, a, wrapper=NewLayer), "Wrap the model's own layer"),
    (lambda m, t, r, a: surgery_solution(m, t, r, a, wrapper=TransposedA), "transpose"),
    (lambda m, t, r, a: surgery_solution(m, t, r, a, freeze=False), "Freeze every parameter"),
    (frozen_after, "before you attach"),
    (lambda m, t, r, a: surgery_solution(m, t, r, a, match=lambda n, ts: any(x in n for x in ts)),
     "not substrings"),
    (lambda m, t, r, a: surgery_solution(m, t, r, a, match=lambda n, ts: n.rsplit(".", 1)[-1] in ts),
     "dotted suffix"),
    (loop_variable, "still the original nn.Linear"),
    (no_return, "forget the `return`"),
    (the_modules, "not the modules"),
    (a_dict, "of a dict's keys"),
])
def test_surgery_mistakes_are_named(wrong, words, capsys):
    ok, out = verdict(check_lora_surgery, wrong, capsys)
    assert not ok and words in " ".join(out.split()), out  # the verdict is wrapped to 80 columns


def test_surgery_with_attach_lora_is_refused(capsys):
    ok, out = verdict(check_lora_surgery, lambda m, t, r, a: list(attach_lora(m, t, r=r, alpha=a)), capsys)
    assert not ok and "attach_lora" in out, out


def test_surgery_with_the_packages_layer_is_refused(capsys):
    ok, out = verdict(check_lora_surgery, lambda m, t, r, a: surgery_solution(m, t, r, a, wrapper=LoRALinear),
                      capsys)
    assert not ok and "groundup.lora.LoRALinear" in out, out


def test_surgery_with_peft_is_refused(capsys):
    peft = pytest.importorskip("peft")

    def with_peft(model, targets, r, alpha):
        names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and matches(n, targets)]
        peft.inject_adapter_in_model(peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=names), model)
        return names

    ok, out = verdict(check_lora_surgery, with_peft, capsys)
    assert not ok and "peft" in out, out


def test_surgery_checkers_own_failure_is_not_blamed_on_the_reader(monkeypatch, capsys):
    from groundup.exercises import ch13

    # A builtin that raises a TypeError on these arguments: the error comes from the checker's own frames only (a
    # function defined here would count as the reader's code, being outside the package).
    monkeypatch.setattr(ch13, "_surgery_report", math.sqrt)
    verdict_ = check_lora_surgery(surgery_solution)
    out = capsys.readouterr().out
    assert not verdict_ and verdict_.checker_error and "bug in the book" in " ".join(out.split()), out


# --- Exercise 13.8: a short tuning ------------------------------------------------------------------------------


def test_the_tuning_reference_falls_and_its_merge_is_merge_lora():
    from groundup.exercises import ch13

    head, body = ch13._tuned_head()
    ids, labels = ch13._toy_task(32, seed=0)
    (steps, lr, _), (short, short_lr, _) = ch13._TRAINING_CASES
    losses, reference = ch13._training_run(head, ids, labels, steps, lr)
    tuned = copy.deepcopy(head)
    assert training_solution(tuned, ids, labels, steps, lr) == losses[:-1]  # the same loop, bit for bit
    assert losses[0] == pytest.approx(math.log(2)) and losses[steps - 1] < 0.01
    for name, p in tuned.named_parameters():
        assert torch.equal(p, reference[name])
    decayed = ch13._training_run(head, ids, labels, steps, lr, weight_decay=0.01)[0]
    assert not ch13._same_losses(decayed[:-1], losses[:-1])  # the checker can tell weight decay apart
    assert not ch13._same_losses(ch13._training_run(head, ids, labels, short, short_lr)[0][:-1],
                                 ch13._training_run(head, ids, labels, short, short_lr, sgd=True)[0][:-1])
    test_ids, _ = ch13._toy_task(64, seed=1)
    merged = copy.deepcopy(tuned).eval()
    merge_lora(merged.body)
    with torch.no_grad():
        torch.testing.assert_close(ch13._merged_head(head, body, tuned.state_dict()).eval()(test_ids),
                                   merged(test_ids), rtol=1e-4, atol=1e-5)


def trainer(*, record_after=False, weight_decay=0.0, unfreeze=False, sgd=False, zero_grad=True,
            reduction="mean", extra_loss=False, as_tensors=False):
    def train(head, ids, labels, steps, lr):
        if unfreeze:
            for p in head.parameters():
                p.requires_grad_(True)
        params = [p for p in head.parameters() if p.requires_grad]
        optimizer = torch.optim.SGD(params, lr=lr) if sgd else \
            torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
        losses = []
        for _ in range(steps):
            loss = F.cross_entropy(head(ids), labels, reduction=reduction)
            if zero_grad:
                optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if record_after:
                with torch.no_grad():
                    loss = F.cross_entropy(head(ids), labels)
            losses.append(loss.detach() if as_tensors else loss.item())
        if extra_loss:
            with torch.no_grad():
                losses.append(F.cross_entropy(head(ids), labels).item())
        return losses

    return train


class Sub(torch.Tensor):
    pass


@pytest.mark.parametrize("wrong, words", [
    (trainer(record_after=True), "before its update"),
    (trainer(weight_decay=0.01), "weight_decay=0.0"),
    (trainer(unfreeze=True), "Train only the parameters that require gradients"),
    (trainer(sgd=True), "not SGD"),
    (trainer(zero_grad=False), "zero_grad() every step"),
    (trainer(reduction="sum"), "not the sum"),
    (trainer(extra_loss=True), "not asked for"),
    (trainer(as_tensors=True), "loss.item()"),
    (lambda *args: torch.tensor(training_solution(*args)), "returned a tensor"),
    (lambda *args: [torch.tensor(x).as_subclass(Sub) for x in training_solution(*args)], "subclass"),
    (lambda *args: [str(x) for x in training_solution(*args)], "as numbers"),
    (lambda head, *args: training_solution(copy.deepcopy(head), *args), "in place"),
    (lambda *args: training_solution(*args) and None, "forget the `return`"),
])
def test_training_mistakes_are_named(wrong, words, capsys):
    ok, out = verdict(check_adapter_training, wrong, capsys)
    assert not ok and words in " ".join(out.split()), out  # the verdict is wrapped to 80 columns


def test_training_with_fine_tune_is_refused(capsys):
    from groundup.classification import fine_tune

    def with_fine_tune(head, ids, labels, steps, lr):
        fine_tune(head, ids, labels, steps=steps, batch_size=len(ids), lr=lr)
        return [0.0] * steps

    ok, out = verdict(check_adapter_training, with_fine_tune, capsys)
    assert not ok and "fine_tune" in out, out


def test_training_with_a_merge_is_refused(capsys):
    def and_merge(head, ids, labels, steps, lr):
        losses = training_solution(head, ids, labels, steps, lr)
        merge_lora(head.body)
        return losses

    ok, out = verdict(check_adapter_training, and_merge, capsys)
    assert not ok and "merge_lora" in out, out
