"""Each chapter-14 checker accepts the reference solution, rejects plausible wrong answers with the right hint,
refuses the package's own solution and treats the unattempted stub kindly."""

import copy

import pytest
import torch

from groundup import interpretability as interp
from groundup.exercises.ch14 import (
    check_find_induction_circuit,
    check_k_composition,
    check_zero_ablation,
    k_composition,
    permute_heads,
    planted_model,
)
from groundup.induction import AttentionOnlyConfig, in_context_loss
from groundup.models import GPT

# --- reference solutions (the notebook's hidden solutions) ----------------------------------------------------


def _scores(model, tokens):
    half = tokens.shape[1] // 2
    patterns = interp.attention_patterns(model, tokens)
    prev = torch.stack([p.diagonal(-1, -2, -1).mean((0, 2)) for p in patterns])
    ind = torch.stack([p.diagonal(-(half - 1), -2, -1)[..., 1:].mean((0, 2)) for p in patterns])
    return prev, ind


def find_solution(model, tokens):
    prev, ind = _scores(model, tokens)
    n = prev.shape[1]
    return divmod(int(prev.argmax()), n), divmod(int(ind.argmax()), n)


def ablation_solution(model, tokens, layer, head):
    d_head = model.config.d_model // model.config.n_heads

    def pre_hook(module, args):
        z = args[0].clone()
        z[..., head * d_head:(head + 1) * d_head] = 0.0
        return (z,) + args[1:]

    handle = model.blocks[layer].attention.W_o.register_forward_pre_hook(pre_hook)
    try:
        return in_context_loss(model, tokens)
    finally:
        handle.remove()


def k_composition_solution(w_qk, w_ov):
    norm = torch.linalg.matrix_norm
    return float(norm(w_qk @ w_ov) / (norm(w_qk) * norm(w_ov)))


def stub(*args):
    raise NotImplementedError


def verdict(checker, fn, capsys):
    ok = checker(fn)
    return bool(ok), " ".join(capsys.readouterr().out.split())  # the verdict's line breaks undone


@pytest.mark.parametrize("checker, solution", [(check_find_induction_circuit, find_solution),
                                               (check_zero_ablation, ablation_solution),
                                               (check_k_composition, k_composition_solution)])
def test_reference_passes_and_stub_is_not_attempted(checker, solution, capsys):
    ok, out = verdict(checker, solution, capsys)
    assert ok and "✅" in out, out
    ok, out = verdict(checker, stub, capsys)
    assert not ok and "not attempted yet" in out


# --- Exercise 14.1 -------------------------------------------------------------------------------------------


def test_permute_heads_keeps_the_function_and_moves_the_planted_heads():
    model, planted = planted_model(12, 12, False, False)
    swapped, moved = planted_model(12, 12, True, True)
    assert planted == ((0, 0), (1, 0)) and moved == ((0, 1), (1, 1))
    tokens = torch.cat([torch.randperm(12)[:6]] * 2)[None]
    with torch.no_grad():
        torch.testing.assert_close(model(tokens)[0], swapped(tokens)[0], atol=1e-5, rtol=0)
    prev, ind = _scores(swapped, tokens)
    assert prev[0].argmax() == 1 and ind[1].argmax() == 1
    with pytest.raises(ValueError, match="permutation"):
        permute_heads(model, 0, [0, 0])


def test_find_rejects_a_hard_coded_answer_and_the_wrong_order(capsys):
    ok, out = verdict(check_find_induction_circuit, lambda m, t: ((0, 0), (1, 0)), capsys)
    assert not ok and ("previous-token head is (0, 0); it is (0, 1)" in out and "Do not assume" in out
                       or "induction head is (1, 0); it is (1, 1)" in out)
    ok, out = verdict(check_find_induction_circuit, lambda m, t: find_solution(m, t)[::-1], capsys)
    assert not ok and "wrong way round" in out
    ok, out = verdict(check_find_induction_circuit, lambda m, t: (0, 1), capsys)
    assert not ok and "(layer, head)" in out


def _raw_head(model, layer, h):  # the raw weights (head_matrices itself is refused)
    att = model.blocks[layer].attention
    rows = slice(h * att.d_head, (h + 1) * att.d_head)
    return {"W_O": att.W_o.weight.detach()[:, rows], "W_V": att.W_v.weight.detach()[rows]}


def _largest(model, layer, size):
    n = model.config.n_heads
    return max(range(n), key=lambda h: float(size(_raw_head(model, layer, h))))


@pytest.mark.parametrize("size", [lambda m: m["W_O"].norm(), lambda m: (m["W_O"] @ m["W_V"]).norm()])
def test_find_rejects_guessing_from_the_size_of_the_weights(size, capsys):
    def by_weights(model, tokens):
        return (0, _largest(model, 0, size)), (1, _largest(model, 1, size))

    ok, out = verdict(check_find_induction_circuit, by_weights, capsys)
    assert not ok and "it is" in out


def test_find_draws_new_sequences_and_a_new_order_on_every_call(capsys):
    seen = []

    def remembers(model, tokens):
        seen.append((model.config.vocab_size, tokens.tolist()))
        return find_solution(model, tokens)

    for _ in range(3):
        assert verdict(check_find_induction_circuit, remembers, capsys)[0]
    calls = [seen[4 * k:4 * k + 4] for k in range(3)]
    assert calls[0] != calls[1] != calls[2]
    assert len({tuple(v for v, _ in call) for call in calls}) > 1 or calls[0][0][1] != calls[1][0][1]


def test_find_refuses_the_packages_scores(capsys):
    def calls_package(model, tokens):
        patterns = interp.attention_patterns(model, tokens)
        prev = torch.stack([interp.previous_token_scores(p) for p in patterns])
        ind = torch.stack([interp.induction_scores(p) for p in patterns])
        return divmod(int(prev.argmax()), 2), divmod(int(ind.argmax()), 2)

    ok, out = verdict(check_find_induction_circuit, calls_package, capsys)
    assert not ok and "previous_token_scores" in out

    def by_composition(model, tokens):  # the planted pair is the largest K-composition score
        k = interp.composition_scores(model, 0, 1, kind="k")
        return (0, int(k.max(1).values.argmax())), (1, int(k.max(0).values.argmax()))

    ok, out = verdict(check_find_induction_circuit, by_composition, capsys)
    assert not ok and "composition_scores" in out

    def by_copying_ranks(model, tokens):  # the heads whose OV circuits rank their own tokens highest
        best = [int(interp.copying_ranks(model, layer).float().mean(1).argmin()) for layer in range(2)]
        return (0, best[0]), (1, best[1])

    ok, out = verdict(check_find_induction_circuit, by_copying_ranks, capsys)
    assert not ok and "copying_ranks" in out


# --- Exercise 14.2 -------------------------------------------------------------------------------------------


def test_zero_ablation_names_the_usual_mistakes(capsys):
    ok, out = verdict(check_zero_ablation, lambda m, t, layer, head: in_context_loss(m, t), capsys)
    assert not ok and "did not change" in out

    def whole_layer(model, tokens, layer, head):
        handle = model.blocks[layer].attention.W_o.register_forward_pre_hook(
            lambda m, args: (torch.zeros_like(args[0]),))
        try:
            return in_context_loss(model, tokens)
        finally:
            handle.remove()

    ok, out = verdict(check_zero_ablation, whole_layer, capsys)
    assert not ok and "every head of the layer" in out

    def next_head(model, tokens, layer, head):
        return ablation_solution(model, tokens, layer, (head + 1) % model.config.n_heads)

    ok, out = verdict(check_zero_ablation, next_head, capsys)  # on the hand-built model: a decoy, no change
    assert not ok and "did not change" in out and "columns of head" in out

    def next_head_on_random_model(model, tokens, layer, head):
        if model.config.n_heads == 2:
            return ablation_solution(model, tokens, layer, head)
        return next_head(model, tokens, layer, head)

    ok, out = verdict(check_zero_ablation, next_head_on_random_model, capsys)
    assert not ok and "next head" in out
    ok, out = verdict(check_zero_ablation, lambda *args: "0.5", capsys)
    assert not ok and "float" in out


def test_zero_ablation_rejects_a_hook_left_behind_and_zeroed_value_rows(capsys):
    def never_removed(model, tokens, layer, head):
        d_head = model.config.d_model // model.config.n_heads
        model.blocks[layer].attention.W_o.register_forward_pre_hook(
            lambda m, args: (args[0].index_fill(-1, torch.arange(head * d_head, (head + 1) * d_head), 0.0),))
        return in_context_loss(model, tokens)

    ok, out = verdict(check_zero_ablation, never_removed, capsys)
    assert not ok and "left 1 hook(s)" in out and "handle.remove()" in out

    def zero_value_rows(model, tokens, layer, head):  # leaves the value bias: not the head's output set to 0
        d_head = model.config.d_model // model.config.n_heads
        model = copy.deepcopy(model)
        with torch.no_grad():
            model.blocks[layer].attention.W_v.weight[head * d_head:(head + 1) * d_head] = 0.0
        return in_context_loss(model, tokens)

    ok, out = verdict(check_zero_ablation, zero_value_rows, capsys)
    assert not ok and "on a random 4-head model" in out and "slice of W_o" in out


def test_zero_ablation_draws_new_sequences_on_every_call(capsys):
    seen = []

    def remembers(model, tokens, layer, head):
        seen.append(tokens.tolist())
        return ablation_solution(model, tokens, layer, head)

    for _ in range(2):
        assert verdict(check_zero_ablation, remembers, capsys)[0]
    assert seen[0] != seen[len(seen) // 2]


def test_zero_ablation_refuses_the_packages_ablate_heads(capsys):
    def calls_package(model, tokens, layer, head):
        with interp.ablate_heads(model, [(layer, head)]):
            return in_context_loss(model, tokens)

    ok, out = verdict(check_zero_ablation, calls_package, capsys)
    assert not ok and "ablate_heads" in out
    # the tripwire is gone afterwards: the package's function works again
    model = GPT(AttentionOnlyConfig(vocab_size=8, context_length=8, d_model=16, n_heads=2)).eval()
    with interp.ablate_heads(model, [(0, 0)]):
        pass


# --- Exercise 14.3 -------------------------------------------------------------------------------------------


def test_k_composition_matches_the_package_and_rejects_the_reversed_product(capsys):
    torch.manual_seed(0)
    model = GPT(AttentionOnlyConfig(vocab_size=8, context_length=8, d_model=16, n_heads=2)).eval()
    table = interp.composition_scores(model, 0, 1, kind="k")
    early, late = interp.head_matrices(model, 0, 1), interp.head_matrices(model, 1, 0)
    score = k_composition(late["W_Q"].T @ late["W_K"], early["W_O"] @ early["W_V"])
    assert score == pytest.approx(float(table[1, 0]), rel=1e-5)
    ok, out = verdict(check_k_composition, lambda a, b: k_composition_solution(b, a), capsys)
    assert not ok and "W_QK @ W_OV" in out
    ok, out = verdict(check_k_composition, lambda a, b: float(torch.linalg.matrix_norm(a @ b)), capsys)
    assert not ok and "Frobenius" in out


def test_k_composition_refuses_the_packages_scores(capsys):
    def calls_package(w_qk, w_ov):
        interp.composition_scores(GPT(AttentionOnlyConfig(vocab_size=8, context_length=8, d_model=16,
                                                          n_heads=2)), 0, 1)
        return k_composition_solution(w_qk, w_ov)

    ok, out = verdict(check_k_composition, calls_package, capsys)
    assert not ok and "composition_scores" in out


def _by_ablation(model, tokens):
    """Choose the heads by what zeroing them costs: an intervention, not the attention patterns."""
    def cost(layer, h):
        with interp.ablate_heads(model, [(layer, h)]):
            return in_context_loss(model, tokens)
    n = model.config.n_heads
    return (0, max(range(n), key=lambda h: cost(0, h))), (1, max(range(n), key=lambda h: cost(1, h)))


def _by_head_matrices(model, tokens):
    n = model.config.n_heads
    w_ov = [interp.head_matrices(model, 0, h) for h in range(n)]
    return (0, max(range(n), key=lambda h: float((w_ov[h]["W_O"] @ w_ov[h]["W_V"]).norm()))), (1, 0)


@pytest.mark.parametrize("cheat, name", [(_by_ablation, "ablate_heads"), (_by_head_matrices, "head_matrices")])
def test_find_refuses_interventions_and_the_weights(cheat, name, capsys):
    ok, out = verdict(check_find_induction_circuit, cheat, capsys)
    assert not ok and name in out


def test_zero_ablation_accepts_a_zeroed_copy_without_a_hook(capsys):
    """The task is the zero ablation, not the hook: a deep copy with the head's columns of W_o zeroed passes."""
    def zeroed_copy(model, tokens, layer, head):
        clone = copy.deepcopy(model)
        d_head = model.config.d_model // model.config.n_heads
        with torch.no_grad():
            clone.blocks[layer].attention.W_o.weight[:, head * d_head:(head + 1) * d_head] = 0.0
        return in_context_loss(clone, tokens)

    ok, out = verdict(check_zero_ablation, zeroed_copy, capsys)
    assert ok, out
