"""Each chapter-14 checker accepts the reference solution, rejects plausible wrong answers with the right hint,
refuses the package's own solution and treats the unattempted stub kindly."""

import copy

import pytest
import torch

from groundup import interpretability as interp
from groundup.exercises import ch14
from groundup.exercises.ch14 import (
    check_find_induction_circuit,
    check_head_dla,
    check_head_patching,
    check_k_composition,
    check_k_composition_row,
    check_logit_lens_ranks,
    check_mean_ablation,
    k_composition,
    permute_heads,
    planted_model,
)
from groundup.induction import AttentionOnlyConfig, hand_built_induction_model, in_context_loss
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


def _mean_ablated(model, tokens, layer, head, mean):
    d_head = model.config.d_model // model.config.n_heads

    def pre_hook(module, args):
        z = args[0].clone()
        z[..., head * d_head:(head + 1) * d_head] = mean
        return (z,) + args[1:]

    handle = model.blocks[layer].attention.W_o.register_forward_pre_hook(pre_hook)
    try:
        return in_context_loss(model, tokens)
    finally:
        handle.remove()


def _head_mean(model, ids, layer, head, dims=(0,)):
    d_head = model.config.d_model // model.config.n_heads
    seen = []
    handle = model.blocks[layer].attention.W_o.register_forward_pre_hook(
        lambda module, args: seen.append(args[0][..., head * d_head:(head + 1) * d_head]))
    try:
        with torch.no_grad():
            model(ids)
    finally:
        handle.remove()
    return seen[0].mean(dims)


def mean_ablation_solution(model, tokens, reference, layer, head):
    return _mean_ablated(model, tokens, layer, head, _head_mean(model, reference, layer, head))


def k_composition_solution(w_qk, w_ov):
    norm = torch.linalg.matrix_norm
    return float(norm(w_qk @ w_ov) / (norm(w_qk) * norm(w_ov)))


def k_composition_row_solution(model, head):
    early = interp.head_matrices(model, 0, head)
    w_ov = early["W_O"] @ early["W_V"]
    row = []
    for j in range(model.config.n_heads):
        late = interp.head_matrices(model, 1, j)
        row.append(k_composition_solution(late["W_Q"].T @ late["W_K"], w_ov))
    return torch.tensor(row)


def _stream(model, ids):
    """The residual stream with hooks of the reader's own (the package's residual_stream is refused)."""
    entries = []
    hooks = [model.blocks[0].register_forward_pre_hook(lambda m, args: entries.append(args[0]))]
    hooks += [block.register_forward_hook(lambda m, args, out: entries.append(out)) for block in model.blocks]
    try:
        with torch.no_grad():
            model(ids)
    finally:
        for h in hooks:
            h.remove()
    return entries


def lens_ranks(model, ids, targets, *, norm=True, one_based=False):
    with torch.no_grad():
        lens = torch.stack([model.unembedding(model.final_norm(x[0]) if norm else x[0])
                            for x in _stream(model, ids)])
    target_logit = lens.gather(-1, targets.expand(lens.shape[:-1])[..., None])
    return (lens > target_logit).sum(-1) + int(one_based)


def lens_solution(model, ids, targets):
    return lens_ranks(model, ids, targets)


def _head_z(model, ids, position):
    z = {}
    hooks = [block.attention.W_o.register_forward_pre_hook(
        lambda m, args, layer=layer: z.__setitem__(layer, args[0][0, position].detach()))
        for layer, block in enumerate(model.blocks)]
    try:
        with torch.no_grad():
            model(ids)
    finally:
        for h in hooks:
            h.remove()
    return z


def dla_parts(model, ids, position, token, *, frozen=True, centred=True, own_norm=False, shift=0, rest_ffn_only=False,
              bias=True):
    """The reference solution, with switches for the mistakes the checker names."""
    c = model.config
    z, stream = _head_z(model, ids, position), _stream(model, ids)
    norm = model.final_norm
    x = stream[-1][0, position]
    layernorm = getattr(norm, "bias", None) is not None
    var = x.var(unbiased=False) if layernorm else x.pow(2).mean()
    u = model.unembedding.weight[token].detach()
    read = u * norm.weight.detach() / (torch.sqrt(var + norm.eps) if frozen else 1.0)

    def part(p):
        if own_norm:
            return float(model.unembedding(norm(p)).detach()[token])
        return float(((p - p.mean()) if layernorm and centred else p) @ read)

    heads, rest = torch.zeros(c.n_layers, c.n_heads), torch.zeros(c.n_layers)
    d_head = c.d_model // c.n_heads
    with torch.no_grad():
        for layer, block in enumerate(model.blocks):
            w_o = block.attention.W_o.weight.detach()
            outs = [w_o[:, h * d_head:(h + 1) * d_head] @ z[layer][h * d_head:(h + 1) * d_head]
                    for h in range(c.n_heads)]
            heads[layer] = torch.tensor([part(outs[(h + shift) % c.n_heads]) for h in range(c.n_heads)])
            written = stream[layer + 1][0, position] - stream[layer][0, position] - sum(outs)
            if rest_ffn_only and block.attention.W_o.bias is not None:
                written = written - block.attention.W_o.bias.detach()
            rest[layer] = part(written)
    b = float(u @ norm.bias.detach()) if layernorm and bias else 0.0
    return {"heads": heads, "rest": rest, "embedding": part(stream[0][0, position]), "bias": b}


def dla_solution(model, ids, position, token):
    return dla_parts(model, ids, position, token)


def head_patching(model, clean, corrupted, answer, wrong, *, noising=False, norm="gap", whole_layer=False,
                  last_only=False, shift=0):
    """The reference solution, with switches for the mistakes the checker names."""
    c = model.config
    d_head = c.d_model // c.n_heads
    source, target = (corrupted, clean) if noising else (clean, corrupted)
    source_z = interp.head_outputs(model, source)

    def lds(ids, layer=None, head=None):
        def patch(module, args):
            x = args[0].clone()
            k = (head + shift) % c.n_heads
            cols = slice(None) if whole_layer else slice(k * d_head, (k + 1) * d_head)
            pos = slice(-1, None) if last_only else slice(None)
            x[:, pos, cols] = source_z[layer][:, pos].flatten(-2)[..., cols]
            return (x,)
        hook = None if layer is None else model.blocks[layer].attention.W_o.register_forward_pre_hook(patch)
        try:
            with torch.no_grad():
                last = model(ids)[0][:, -1]
        finally:
            if hook is not None:
                hook.remove()
        rows = torch.arange(last.shape[0])
        return last[rows, answer] - last[rows, wrong]

    ld_clean, ld_corrupted = lds(clean), lds(corrupted)
    table = torch.zeros(c.n_layers, c.n_heads)
    for layer in range(c.n_layers):
        for h in range(c.n_heads):
            ld = lds(target, layer, h)
            if norm == "gap":
                table[layer, h] = (ld.mean() - ld_corrupted.mean()) / (ld_clean.mean() - ld_corrupted.mean())
            elif norm == "none":
                table[layer, h] = ld.mean() - ld_corrupted.mean()
            elif norm == "clean":
                table[layer, h] = ld.mean() / ld_clean.mean()
            else:  # "per example"
                table[layer, h] = ((ld - ld_corrupted) / (ld_clean - ld_corrupted)).mean()
    return table


def patching_solution(model, clean, corrupted, answer, wrong):
    return head_patching(model, clean, corrupted, answer, wrong)


def stub(*args):
    raise NotImplementedError


def verdict(checker, fn, capsys):
    ok = checker(fn)
    return bool(ok), " ".join(capsys.readouterr().out.split())  # the verdict's line breaks undone


@pytest.mark.parametrize("checker, solution", [(check_find_induction_circuit, find_solution),
                                               (check_mean_ablation, mean_ablation_solution),
                                               (check_k_composition, k_composition_solution),
                                               (check_k_composition_row, k_composition_row_solution),
                                               (check_logit_lens_ranks, lens_solution),
                                               (check_head_dla, dla_solution),
                                               (check_head_patching, patching_solution)])
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


def _raw_head(model, layer, h):  # the raw weights (head_matrices itself is refused); the norms' γ are 1 here
    att = model.blocks[layer].attention
    rows = slice(h * att.d_head, (h + 1) * att.d_head)
    w = {name: getattr(att, f"W_{name[-1].lower()}").weight.detach()[rows] for name in ("W_Q", "W_K", "W_V")}
    w["W_O"] = att.W_o.weight.detach()[:, rows]
    w["W_QK"], w["W_OV"] = w["W_Q"].T @ w["W_K"], w["W_O"] @ w["W_V"]
    w["tokens OV"] = w["W_OV"] @ model.token_embedding.weight.detach().T  # what the head writes for each token
    return w


_SIZES = {f"{name} {kind}": (lambda w, name=name, kind=kind: torch.linalg.matrix_norm(w[name], kind))
          for name in ("W_Q", "W_K", "W_V", "W_O", "W_QK", "W_OV", "tokens OV") for kind in ("fro", 2, "nuc")}


def _pick(model, layer, size, largest):
    values = [float(size(_raw_head(model, layer, h))) for h in range(model.config.n_heads)]
    return values.index(max(values) if largest else min(values))


@pytest.mark.parametrize("largest", [True, False], ids=["largest", "smallest"])
@pytest.mark.parametrize("name", ["W_O fro", "W_V fro", "W_Q fro", "W_K fro", "W_OV fro", "W_QK 2", "tokens OV nuc"])
def test_find_rejects_guessing_from_the_size_of_the_weights(name, largest, capsys):
    """Neither the head with the larger weights nor the one with the smaller passes (the review's counterexample:
    the smallest W_O slice in each layer passed when the decoys always had the larger weights)."""
    def by_weights(model, tokens):
        return (0, _pick(model, 0, _SIZES[name], largest)), (1, _pick(model, 1, _SIZES[name], largest))

    for _ in range(2):  # the cases are drawn afresh: the rule must fail on every draw, not by luck
        ok, out = verdict(check_find_induction_circuit, by_weights, capsys)
        assert not ok and "it is" in out and ("Score every head" in out or "attends from i" in out), out


def _diagonal_scores(model, tokens, offset, second_half=False, start=0):
    """Per layer and head: the mean attention from i to i - offset over i = offset + start .. 2H-1 (i = H .. 2H-1
    if second_half)."""
    half = tokens.shape[1] // 2
    diagonals = [p.diagonal(-offset, -2, -1) for p in interp.attention_patterns(model, tokens)]
    return torch.stack([d[..., half - offset if second_half else start:] for d in diagonals]).mean((1, 3))


def _per_layer(pick):
    """A finder that applies ``pick(model, tokens, layer) -> head`` in each layer."""
    return lambda model, tokens: ((0, pick(model, tokens, 0)), (1, pick(model, tokens, 1)))


_PREV = 1  # (14.3): i - 1


@pytest.mark.parametrize("cheat, wrong_layer", [
    (_per_layer(lambda m, t, layer: int(_diagonal_scores(m, t, _PREV)[layer].argmax())), "induction"),
    (_per_layer(lambda m, t, layer: int(_diagonal_scores(m, t, 0)[layer].argmin())), None),
    (_per_layer(lambda m, t, layer: int(_diagonal_scores(m, t, 0, layer == 1)[layer].argmin())), None),
    (_per_layer(lambda m, t, layer: int(_diagonal_scores(m, t, _PREV if layer == 0 else t.shape[1] // 2, layer == 1)
                                        [layer].argmax())), "induction"),
    (_per_layer(lambda m, t, layer: int(_diagonal_scores(m, t, _PREV)[layer].argmax() if layer == 0 else
                                        _diagonal_scores(m, t, _PREV)[layer].argmin())), "induction"),
    (_per_layer(lambda m, t, layer: int(_diagonal_scores(m, t, _PREV)[layer].argmax() if layer == 0 else
                                        _diagonal_scores(m, t, 0)[layer].argmax())), "induction"),
    (_per_layer(lambda m, t, layer: int(_diagonal_scores(m, t, 0)[layer].argmin() if layer == 0 else
                                        _diagonal_scores(m, t, t.shape[1] // 2 - 1, True)[layer].argmax())),
     "previous-token"),
    (_per_layer(lambda m, t, layer: int(_diagonal_scores(m, t, 0, start=1)[layer].argmin() if layer == 0
                                        else _diagonal_scores(m, t, t.shape[1] // 2 - 1, True)[layer].argmax())),
     "previous-token"),
], ids=["(a) best previous-token score in both layers", "(b) least attention to itself in both layers",
        "(b) least attention to itself, second half in layer 1", "induction score off by one (i - H)",
        "layer 1: the worse previous-token score", "layer 1: the most attention to itself",
        "layer 0: least attention to itself", "layer 0: least attention to itself after position 0"])
def test_find_rejects_shortcuts_through_the_attention_patterns(cheat, wrong_layer, capsys):
    """Shortcuts that never compute (14.4), or (14.3) in layer 0, fail on every draw: the realistic decoys (an
    i - 2 head; a duplicate-token head that is a previous-token head in the first half) catch them or their
    opposites, the self-attending decoys catch the opposites."""
    for _ in range(3):  # the cases are drawn afresh: the rule must fail on every draw, not by luck
        ok, out = verdict(check_find_induction_circuit, cheat, capsys)
        assert not ok and f"says the {wrong_layer or ''}" in out and "it is" in out, out


@pytest.mark.parametrize("realistic", [False, True], ids=["self-attending decoys", "realistic decoys"])
@pytest.mark.parametrize("larger", [(True, True), (True, False), (False, True), (False, False)])
def test_disguised_model_orders_every_size_and_keeps_the_function(larger, realistic):
    g = torch.Generator().manual_seed(sum(2 ** i * b for i, b in enumerate(larger)))
    for vocab, context in ((16, 16), (24, 20)):
        model, planted = planted_model(vocab, context, False, False, decoy_larger=larger, generator=g,
                                       realistic_decoys=realistic)
        assert planted == ((0, 0), (1, 0))
        for layer, decoy_larger in enumerate(larger):
            heads = [_raw_head(model, layer, h) for h in range(2)]
            big, small = heads[::-1] if decoy_larger else heads
            for name, size in _SIZES.items():  # by every measure, with a margin
                assert float(size(big)) > 1.5 * float(size(small)), (layer, name)
        reference = hand_built_induction_model(vocab, context, decoy_gain=1.0)  # the decoys scaled, not disguised
        if realistic:
            ch14._retarget_decoys(reference)
        for layer, decoy_larger in enumerate(larger):
            ch14._scale_decoy(reference, layer, decoy_larger)
        reference.eval()
        tokens = ch14._permutation_repeats(6, context // 2, vocab, g)
        with torch.no_grad():
            torch.testing.assert_close(model(tokens)[0], reference(tokens)[0], rtol=0, atol=1e-3)
        for got, want in zip(interp.attention_patterns(model, tokens), interp.attention_patterns(reference, tokens)):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
        assert in_context_loss(model, tokens) < 1e-4
        prev, ind = _scores(model, tokens)  # the planted heads as before, the decoys where they were put
        assert prev[0].tolist()[0] > 0.99 and ind[1, 0] > 0.99 and ind[1, 1] < 0.01
        assert prev[0, 1] < (1.01 / (context - 1) if realistic else 0.01)  # an i - 2 head: position 1 to 0
        patterns, half = interp.attention_patterns(model, tokens), context // 2
        decoy_0, decoy_1 = patterns[0][:, 1], patterns[1][:, 1]
        if realistic:  # i - 2; the earlier copy of the token (i - H), else i - 1: never the token after it
            assert decoy_0.diagonal(-2, -2, -1).min() > 0.99 and decoy_1.diagonal(-half, -2, -1).min() > 0.99
            assert decoy_1.diagonal(-1, -2, -1)[:, :half - 1].min() > 0.99 and prev[1, 1] > 3 * prev[1, 0]
        else:
            assert decoy_0.diagonal(0, -2, -1).min() > 0.99 and decoy_1.diagonal(0, -2, -1).min() > 0.99


def test_find_draws_both_directions_in_both_layers(capsys, monkeypatch):
    drawn = []

    def spy(*args, **kwargs):
        drawn.append((kwargs["decoy_larger"], kwargs["realistic_decoys"], args[2:4]))
        return planted_model(*args, **kwargs)

    monkeypatch.setattr(ch14, "planted_model", spy)
    for _ in range(3):
        drawn.clear()
        assert verdict(check_find_induction_circuit, find_solution, capsys)[0]
        assert sorted(larger for larger, _, _ in drawn) == [(False, False), (False, True), (True, False), (True, True)]
        for kind in (False, True):  # each kind of decoy with the planted head at 0 and at 1, in both layers
            swaps = [swap for _, realistic, swap in drawn if realistic == kind]
            assert len(swaps) == 2 and swaps[0][0] != swaps[1][0] and swaps[0][1] != swaps[1][1], drawn
    with pytest.raises(ValueError, match="generator"):
        planted_model(16, 16, False, False, decoy_larger=(True, False))


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


def test_mean_ablation_checker_agrees_with_the_package():
    """The checker's own hooks give what interp.ablate_heads(mode="mean") with per-position means gives."""
    model = ch14._random_model(14)
    g = torch.Generator().manual_seed(3)
    tokens, reference = ch14._permutation_repeats(8, 8, 16, g), ch14._permutation_repeats(12, 8, 16, g)
    means = interp.mean_head_outputs(model, reference, per_position=True)
    for layer, head in ((0, 2), (1, 3)):
        z = ch14._record_run(model, reference)[2][layer][..., head, :].mean(0)
        ours = ch14._replaced_loss(model, tokens, layer, head, z)
        with interp.ablate_heads(model, [(layer, head)], mode="mean", means=means):
            package = in_context_loss(model, tokens)
        assert ours == pytest.approx(package, abs=1e-6)
        assert abs(ours - in_context_loss(model, tokens)) > 1e-3  # the ablation changes something


def test_mean_ablation_names_the_usual_mistakes(capsys):
    def zeroed(model, tokens, reference, layer, head):
        return _mean_ablated(model, tokens, layer, head, 0.0)

    ok, out = verdict(check_mean_ablation, zeroed, capsys)
    assert not ok and "zero ablation" in out

    def one_mean(model, tokens, reference, layer, head):
        return _mean_ablated(model, tokens, layer, head, _head_mean(model, reference, layer, head, (0, 1)))

    ok, out = verdict(check_mean_ablation, one_mean, capsys)
    assert not ok and "each position" in out

    def means_of_tokens(model, tokens, reference, layer, head):
        return _mean_ablated(model, tokens, layer, head, _head_mean(model, tokens, layer, head))

    ok, out = verdict(check_mean_ablation, means_of_tokens, capsys)
    assert not ok and "from `reference`" in out

    def unchanged(model, tokens, reference, layer, head):
        return in_context_loss(model, tokens)

    ok, out = verdict(check_mean_ablation, unchanged, capsys)
    assert not ok and "did not change" in out

    def next_head(model, tokens, reference, layer, head):
        other = (head + 1) % model.config.n_heads
        return mean_ablation_solution(model, tokens, reference, layer, other)

    ok, out = verdict(check_mean_ablation, next_head, capsys)  # on the hand-built model: a decoy, no change
    assert not ok and "did not change" in out

    def next_head_on_random_model(model, tokens, reference, layer, head):
        if model.config.n_heads == 2:
            return mean_ablation_solution(model, tokens, reference, layer, head)
        return next_head(model, tokens, reference, layer, head)

    ok, out = verdict(check_mean_ablation, next_head_on_random_model, capsys)
    assert not ok and "another head" in out
    ok, out = verdict(check_mean_ablation, lambda *args: "0.5", capsys)
    assert not ok and "float" in out


def test_mean_ablation_rejects_a_hook_left_behind(capsys):
    def never_removed(model, tokens, reference, layer, head):
        d_head = model.config.d_model // model.config.n_heads
        mean = _head_mean(model, reference, layer, head)

        def pre_hook(module, args):
            z = args[0].clone()
            z[..., head * d_head:(head + 1) * d_head] = mean
            return (z,)

        model.blocks[layer].attention.W_o.register_forward_pre_hook(pre_hook)
        return in_context_loss(model, tokens)

    ok, out = verdict(check_mean_ablation, never_removed, capsys)
    assert not ok and "left 1 hook(s)" in out and "handle.remove()" in out


def test_mean_ablation_draws_new_sequences_on_every_call(capsys):
    seen = []

    def remembers(model, tokens, reference, layer, head):
        seen.append(reference.tolist())
        return mean_ablation_solution(model, tokens, reference, layer, head)

    for _ in range(2):
        assert verdict(check_mean_ablation, remembers, capsys)[0]
    assert seen[0] != seen[len(seen) // 2]


@pytest.mark.parametrize("cheat, name", [("ablate_heads", "ablate_heads"), ("means", "mean_head_outputs"),
                                         ("outputs", "head_outputs")])
def test_mean_ablation_refuses_the_packages_tools(cheat, name, capsys):
    def calls_package(model, tokens, reference, layer, head):
        if cheat == "outputs":
            mean = interp.head_outputs(model, reference)[layer][:, :, head].mean(0)
            return _mean_ablated(model, tokens, layer, head, mean)
        if cheat == "means":
            means = interp.mean_head_outputs(model, reference, per_position=True)
            return _mean_ablated(model, tokens, layer, head, means[layer][:, head])
        c = model.config
        means = [torch.zeros(tokens.shape[1], c.n_heads, c.d_model // c.n_heads) for _ in range(c.n_layers)]
        means[layer][:, head] = _head_mean(model, reference, layer, head)
        with interp.ablate_heads(model, [(layer, head)], mode="mean", means=means):
            return in_context_loss(model, tokens)

    ok, out = verdict(check_mean_ablation, calls_package, capsys)
    assert not ok and name in out
    model = GPT(AttentionOnlyConfig(vocab_size=8, context_length=8, d_model=16, n_heads=2)).eval()
    with interp.ablate_heads(model, [(0, 0)]):  # the tripwire is gone afterwards
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


# --- Exercise 14.3, second part: the row of the K-composition table ----------------------------------------------


@pytest.mark.parametrize("seed, norm", [(1431, "layernorm"), (1432, "rmsnorm")])
def test_k_composition_row_expected_is_the_packages_table(seed, norm):
    model = ch14._composition_model(seed, norm)
    table = interp.composition_scores(model, 0, 1, kind="k")
    for head in range(3):
        row = ch14._row(model, head, lambda late, early: k_composition(late[0], early[1]))
        torch.testing.assert_close(row.float(), table[head], rtol=1e-5, atol=1e-6)
    assert float((table - table.T).abs().max()) > 0.02  # a column is not a row
    raw = ch14._row(model, 0, lambda late, early: k_composition(late[0], early[1]), fold=False)
    assert float((raw.float() - table[0]).abs().max()) > 0.01  # the norm's gains matter


def _raw_row(model, head, *, transpose_qk=False, reverse=False, column=False, v_composition=False):
    """Rows computed from the raw weights (no norm folded in), or from head_matrices with one mistake."""
    def circuits(layer, h):
        m = interp.head_matrices(model, layer, h)
        return m["W_Q"].T @ m["W_K"], m["W_O"] @ m["W_V"]

    row = []
    for j in range(model.config.n_heads):
        late, early = (circuits(1, head), circuits(0, j)) if column else (circuits(1, j), circuits(0, head))
        w_qk = late[1] if v_composition else (late[0].T if transpose_qk else late[0])
        row.append(k_composition_solution(early[1], w_qk) if reverse else k_composition_solution(w_qk, early[1]))
    return torch.tensor(row)


def _unfolded_row(model, head):
    att0, d_head = model.blocks[0].attention, model.blocks[0].attention.d_head
    rows0 = slice(head * d_head, (head + 1) * d_head)
    w_ov = att0.W_o.weight.detach()[:, rows0] @ att0.W_v.weight.detach()[rows0]
    att1 = model.blocks[1].attention
    return torch.tensor([k_composition_solution(att1.W_q.weight.detach()[j * d_head:(j + 1) * d_head].T
                                                @ att1.W_k.weight.detach()[j * d_head:(j + 1) * d_head], w_ov)
                         for j in range(model.config.n_heads)])


@pytest.mark.parametrize("wrong, hint", [
    (_unfolded_row, "Fold the block's first norm"),
    (lambda m, h: _raw_row(m, h, transpose_qk=True), "Q-composition"),
    (lambda m, h: _raw_row(m, h, v_composition=True), "V-composition"),
    (lambda m, h: _raw_row(m, h, reverse=True), "not W_OV @ W_QK"),
    (lambda m, h: _raw_row(m, h, column=True), "a column of the table"),
    (lambda m, h: k_composition_row_solution(m, h).tolist(), "tensor of n_heads floats"),
    (lambda m, h: k_composition_row_solution(m, h)[None], "One score per head"),
])
def test_k_composition_row_names_the_usual_mistakes(wrong, hint, capsys):
    ok, out = verdict(check_k_composition_row, wrong, capsys)
    assert not ok and hint in out, out


def test_k_composition_row_refuses_the_packages_table(capsys):
    ok, out = verdict(check_k_composition_row, lambda m, h: interp.composition_scores(m, 0, 1, kind="k")[h], capsys)
    assert not ok and "composition_scores" in out
    ok, out = verdict(check_k_composition_row, lambda m, h: torch.tensor(
        [ch14.k_composition(*pair) for pair in [(torch.eye(2), torch.eye(2))] * 3]), capsys)
    assert not ok and "k_composition" in out


# --- Exercise 14.7: the logit lens as ranks ---------------------------------------------------------------------


@pytest.mark.parametrize("seed, norm", [(1471, "layernorm"), (1472, "rmsnorm")])
def test_lens_expected_is_the_packages_lens(seed, norm):
    model = ch14._random_gpt(seed, norm)
    ids, targets = torch.randint(0, 40, (1, 10)), torch.randint(0, 40, (10,))
    logits, stream, _ = ch14._record_run(model, ids)
    for got, want in zip(stream, interp.residual_stream(model, ids)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    ranks = ch14._ranks(ch14._lens(model, stream, model.final_norm), targets)
    package = interp.logit_lens(model, ids)[:, 0]
    assert torch.equal(ranks, (package > package.gather(-1, targets.expand(4, 10)[..., None])).sum(-1))
    assert torch.equal(ranks[-1], (logits[0] > logits[0].gather(-1, targets[:, None])).sum(-1))
    assert ranks.dtype == torch.int64 and ranks.shape == (4, 10) and 0 <= int(ranks.min()) < int(ranks.max()) < 40
    assert (ranks[1:] != ranks[:-1]).float().mean() > 0.5  # every block moves the ranks: off-by-one shows


def test_lens_accepts_another_way_of_ranking(capsys):
    def by_sorting(model, ids, targets):
        with torch.no_grad():
            lens = torch.stack([model.unembedding(model.final_norm(x[0])) for x in _stream(model, ids)])
        order = lens.argsort(-1, descending=True)
        return (order == targets[:, None]).long().argmax(-1)

    ok, out = verdict(check_logit_lens_ranks, by_sorting, capsys)
    assert ok, out


def _bare_norm_ranks(model, ids, targets):
    norm = torch.nn.functional.layer_norm if model.config.norm == "layernorm" else torch.nn.functional.rms_norm
    with torch.no_grad():
        lens = torch.stack([model.unembedding(norm(x[0], (model.config.d_model,))) for x in _stream(model, ids)])
    return (lens > lens.gather(-1, targets.expand(lens.shape[:-1])[..., None])).sum(-1)


@pytest.mark.parametrize("wrong, hint", [
    (lambda m, i, t: lens_ranks(m, i, t, norm=False), "Apply the model's final norm"),
    (_bare_norm_ranks, "Use the model's own final norm"),
    (lambda m, i, t: lens_ranks(m, i, t, one_based=True), "you counted from 1"),
    (lambda m, i, t: m.config.vocab_size - 1 - lens_ranks(m, i, t), "from the bottom"),
    (lambda m, i, t: torch.zeros(m.config.n_layers + 1, t.shape[0], dtype=torch.long), "top token"),
    (lambda m, i, t: torch.cat([lens_ranks(m, i, t)[1:], lens_ranks(m, i, t)[-1:]]), "one block late"),
    (lambda m, i, t: torch.cat([lens_ranks(m, i, t)[:1], lens_ranks(m, i, t)[:-1]]), "one block early"),
    (lambda m, i, t: lens_ranks(m, i, t)[1:], "n_layers + 1 stream entries"),
    (lambda m, i, t: lens_ranks(m, i, t).T, "without the batch dimension"),
    (lambda m, i, t: lens_ranks(m, i, t).float(), "integer tensor"),
    (lambda m, i, t: lens_ranks(m, i, t).int(), "torch.int64"),
    (lambda m, i, t: lens_ranks(m, i, t).tolist(), "(n_layers + 1, seq) int64 tensor"),
])
def test_lens_names_the_usual_mistakes(wrong, hint, capsys):
    ok, out = verdict(check_logit_lens_ranks, wrong, capsys)
    assert not ok and hint in out, out


def test_lens_refuses_the_packages_lens_and_stream(capsys):
    def calls_lens(model, ids, targets):
        lens = interp.logit_lens(model, ids)[:, 0]
        return (lens > lens.gather(-1, targets.expand(lens.shape[:-1])[..., None])).sum(-1)

    ok, out = verdict(check_logit_lens_ranks, calls_lens, capsys)
    assert not ok and "logit_lens" in out

    def calls_stream(model, ids, targets):
        with torch.no_grad():
            lens = torch.stack([model.unembedding(model.final_norm(x[0]))
                                for x in interp.residual_stream(model, ids)])
        return (lens > lens.gather(-1, targets.expand(lens.shape[:-1])[..., None])).sum(-1)

    ok, out = verdict(check_logit_lens_ranks, calls_stream, capsys)
    assert not ok and "residual_stream" in out
    def calls_private_recorder(model, ids, targets):
        interp._record(model, ids, stream=True, heads=False)
        return lens_solution(model, ids, targets)

    ok, out = verdict(check_logit_lens_ranks, calls_private_recorder, capsys)
    assert not ok and "_record" in out
    model = ch14._random_gpt(1471, "layernorm")  # the tripwires are gone afterwards
    assert len(interp.residual_stream(model, torch.zeros(1, 3, dtype=torch.long))) == 4
    assert interp.logit_lens(model, torch.zeros(1, 3, dtype=torch.long)).shape == (4, 1, 3, 40)


# --- Exercise 14.8: direct logit attribution per head -------------------------------------------------------------


@pytest.mark.parametrize("seed, norm", [(1481, "layernorm"), (1482, "rmsnorm")])
def test_dla_expected_is_the_packages_and_adds_up(seed, norm):
    model = ch14._random_gpt(seed, norm)
    ids = torch.randint(0, 40, (1, 10))
    position, token = 6, 17
    parts = ch14._dla(model, ids, position, token)
    package = interp.direct_logit_attribution(model, ids, torch.full_like(ids, token))
    torch.testing.assert_close(parts["heads"].float(), package["heads"][:, :, 0, position], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(parts["rest"].float(), package["rest"][:, 0, position], rtol=1e-4, atol=1e-5)
    assert float(parts["embedding"]) == pytest.approx(float(package["embedding"][0, position]), abs=1e-5)
    assert float(parts["bias"]) == pytest.approx(float(package["bias"][0, position]), abs=1e-5)
    assert (float(parts["bias"]) != 0.0) == (norm == "layernorm")
    with torch.no_grad():
        logit = float(model(ids)[0][0, position, token])
    total = float(parts["embedding"] + parts["heads"].sum() + parts["rest"].sum() + parts["bias"])
    assert total == pytest.approx(logit, abs=1e-4)
    assert float(parts["heads"].abs().max()) > 0.5  # the heads write into the logit at this scale


@pytest.mark.parametrize("wrong, hint", [
    (lambda m, i, p, t: dla_parts(m, i, p, t, frozen=False), "final norm's σ at that position"),
    (lambda m, i, p, t: dla_parts(m, i, p, t, centred=False), "LayerNorm subtracts the mean"),
    (lambda m, i, p, t: dla_parts(m, i, p, t, own_norm=True), "not applied to each part on its own"),
    (lambda m, i, p, t: dla_parts(m, i, p, t, shift=1), "next head's slice"),
    (lambda m, i, p, t: dla_parts(m, i, i.shape[1] - 1, t), "not at the last position"),
    (lambda m, i, p, t: dla_parts(m, i, p, t, bias=False), "the final norm's shift β"),
    (lambda m, i, p, t: dla_parts(m, i, p, t, rest_ffn_only=True), "the rest of each block"),
    (lambda m, i, p, t: {**dla_parts(m, i, p, t), "heads": dla_parts(m, i, p, t)["heads"].T}, "One row per layer"),
    (lambda m, i, p, t: {k: v for k, v in dla_parts(m, i, p, t).items() if k != "bias"}, "without 'bias'"),
    (lambda m, i, p, t: dla_parts(m, i, p, t)["heads"], "a dict of the parts"),
])
def test_dla_names_the_usual_mistakes(wrong, hint, capsys):
    ok, out = verdict(check_head_dla, wrong, capsys)
    assert not ok and hint in out, out


def test_dla_without_gamma_is_named(capsys):
    def no_gamma(model, ids, position, token):
        clone = copy.deepcopy(model)
        with torch.no_grad():
            clone.final_norm.weight.fill_(1.0)
        parts = dla_parts(clone, ids, position, token)
        return parts

    ok, out = verdict(check_head_dla, no_gamma, capsys)
    assert not ok and "gain γ" in out, out


def test_dla_refuses_the_packages_attribution_and_head_outputs(capsys):
    def calls_package(model, ids, position, token):
        parts = interp.direct_logit_attribution(model, ids, torch.full_like(ids, token))
        return {"heads": parts["heads"][:, :, 0, position], "rest": parts["rest"][:, 0, position],
                "embedding": float(parts["embedding"][0, position]), "bias": float(parts["bias"][0, position])}

    ok, out = verdict(check_head_dla, calls_package, capsys)
    assert not ok and "direct_logit_attribution" in out

    def calls_head_outputs(model, ids, position, token):
        interp.head_outputs(model, ids)
        return dla_solution(model, ids, position, token)

    ok, out = verdict(check_head_dla, calls_head_outputs, capsys)
    assert not ok and "head_outputs" in out

    def calls_stream(model, ids, position, token):  # reading the stream is allowed
        interp.residual_stream(model, ids)
        return dla_solution(model, ids, position, token)

    assert verdict(check_head_dla, calls_stream, capsys)[0]


# --- Exercise 14.9: activation patching per head ------------------------------------------------------------------


def test_patching_expected_agrees_with_a_hand_computation_of_the_last_layer():
    """Patching a head of the last block of an attention-only model only adds W_O^h (z_clean - z_corrupted) to
    the final stream: its effect on the logits follows without a patched run."""
    model = ch14._patch_model(1492, "attention-only")
    clean, corrupted, answer, wrong = ch14._patching_case(model, torch.Generator().manual_seed(5))
    patched = ch14._head_patches(model, clean, corrupted, answer, wrong)
    _, stream, z_corrupted = ch14._record_run(model, corrupted)
    _, _, z_clean = ch14._record_run(model, clean)
    w_o = model.blocks[-1].attention.W_o.weight.detach()
    d_head = w_o.shape[1] // 4
    for h in range(4):
        cols = slice(h * d_head, (h + 1) * d_head)
        final = stream[-1] + (z_clean[-1][:, :, h] - z_corrupted[-1][:, :, h]) @ w_o[:, cols].T
        with torch.no_grad():
            logits = model.unembedding(model.final_norm(final))
        torch.testing.assert_close(patched[-1, h], ch14._logit_diff(logits, answer, wrong), rtol=1e-4, atol=1e-4)
    table = head_patching(model, clean, corrupted, answer, wrong)
    assert float(table.abs().max()) > 0.1 and float(table.std()) > 0.05  # heads differ: a table worth reading


@pytest.mark.parametrize("wrong, hint", [
    (lambda *a: head_patching(*a, noising=True), "That is noising (the clean run"),
    (lambda *a: 1 - head_patching(*a, noising=True), "the share of the effect lost"),
    (lambda *a: head_patching(*a, norm="none"), "Normalise: subtract LD(corrupted)"),
    (lambda *a: head_patching(*a, norm="clean"), "not LD(patched) / LD(clean)"),
    (lambda *a: head_patching(*a, norm="per example"), "ratio of means"),
    (lambda *a: head_patching(*a, whole_layer=True), "you patched the whole layer"),
    (lambda m, *a: torch.ones(m.config.n_layers, m.config.n_heads), "Every entry is 1"),
    (lambda *a: head_patching(*a, last_only=True), "not only at the last one"),
    (lambda *a: head_patching(*a, shift=1), "the next head's slice"),
    (lambda *a: head_patching(*a).T, "you returned the transpose"),
    (lambda *a: head_patching(*a).tolist(), "(n_layers, n_heads) tensor"),
])
def test_patching_names_the_usual_mistakes(wrong, hint, capsys):
    ok, out = verdict(check_head_patching, wrong, capsys)
    assert not ok and hint in out, out


@pytest.mark.parametrize("name", ["residual_patching", "patch_residual", "ablate_heads"])
def test_patching_refuses_the_packages_interventions(name, capsys):
    def calls_package(model, clean, corrupted, answer, wrong):
        if name == "residual_patching":
            interp.residual_patching(model, clean, corrupted, answer, wrong)
        elif name == "patch_residual":
            with interp.patch_residual(model, 1, interp.residual_stream(model, clean)[1]):
                pass
        else:
            with interp.ablate_heads(model, [(0, 0)]):
                pass
        return patching_solution(model, clean, corrupted, answer, wrong)

    ok, out = verdict(check_head_patching, calls_package, capsys)
    assert not ok and name in out, out


def test_new_checkers_take_about_a_second(capsys):
    import time

    for checker, solution in ((check_logit_lens_ranks, lens_solution), (check_head_dla, dla_solution),
                              (check_head_patching, patching_solution)):
        start = time.perf_counter()
        assert verdict(checker, solution, capsys)[0]
        assert time.perf_counter() - start < 5.0, checker.__name__
