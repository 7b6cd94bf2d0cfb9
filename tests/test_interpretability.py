"""Tests for groundup.interpretability: hooks that read, ablate and patch, against hand computations."""

import math

import pytest
import torch
import torch.nn.functional as F

from groundup.induction import AttentionOnlyConfig, hand_built_induction_model, in_context_loss, repeated_random_tokens
from groundup.interpretability import (
    _run_from,  # the blocks from one stream entry on (the chapter 14 tool's)
    ablate_heads,
    attention_patterns,
    composition_scores,
    copying_scores,
    direct_logit_attribution,
    head_matrices,
    head_outputs,
    induction_scores,
    logit_difference,
    logit_lens,
    mean_head_outputs,
    ov_eigenvalue_scores,
    patch_residual,
    previous_token_scores,
    recording_attention,
    remove_from_inputs,
    residual_patching,
    residual_stream,
)
from groundup.linear import Linear
from groundup.models import GPT, GPTConfig


def _gpt(seed=0, **overrides):
    torch.manual_seed(seed)
    config = dict(vocab_size=11, context_length=12, d_model=16, n_layers=2, n_heads=4, d_ff=24, tie_weights=False)
    model = GPT(GPTConfig(**{**config, **overrides}))
    with torch.no_grad():  # weights well away from the small initialisation, biases and norm gains included
        g = torch.Generator().manual_seed(seed + 1)
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.3)
    return model.eval()


def _ids(batch=3, seq=10, vocab=11, seed=0):
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _no_hooks(model):
    return all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def _permutation_repeats(n_seq, vocab_size, seed=0):
    g = torch.Generator().manual_seed(seed)
    first = torch.stack([torch.randperm(vocab_size, generator=g) for _ in range(n_seq)])
    return torch.cat([first, first], dim=1)


# ---- hooks that change nothing ----------------------------------------------------------------------------


@pytest.mark.parametrize("overrides", [{}, {"norm": "rmsnorm", "positional": "rope", "n_kv_heads": 2}])
def test_hooks_that_do_nothing_leave_logits_bit_equal(overrides):
    model, idx = _gpt(**overrides), _ids()
    with torch.no_grad():
        logits, _ = model(idx)
    stream = residual_stream(model, idx)
    for layer in range(len(stream)):
        with patch_residual(model, layer, stream[layer]), torch.no_grad():
            assert torch.equal(model(idx)[0], logits)
    one = idx[:1]  # the mean over a batch of one is that example's own output: mean ablation changes nothing
    means = mean_head_outputs(model, one, per_position=True)
    with torch.no_grad():
        one_logits, _ = model(one)
    with ablate_heads(model, [(0, 1), (1, 3)], mode="mean", means=means), torch.no_grad():
        assert torch.equal(model(one)[0], one_logits)
    assert torch.equal(logit_lens(model, idx)[-1], logits)  # reading hooks leave the output alone too
    assert _no_hooks(model)


def test_hooks_are_removed_after_an_error():
    model = _gpt()
    with pytest.raises(RuntimeError, match="inside"):
        with ablate_heads(model, [(0, 0)]), recording_attention(model):
            raise RuntimeError("inside")
    assert _no_hooks(model)


def test_attention_patterns_are_the_softmax_of_each_head():
    model, idx = _gpt(), _ids()
    patterns = attention_patterns(model, idx)
    assert len(patterns) == 2 and patterns[0].shape == (3, 4, 10, 10)
    block = model.blocks[0]
    with torch.no_grad():
        x = model.token_embedding(idx) + model.position_embedding(torch.arange(10))
        _, expected = block.attention(block.norm_1(x), need_weights=True, is_causal=True)
        q = block.attention.W_q(block.norm_1(x)).view(3, 10, 4, 4).transpose(1, 2)
        k = block.attention.W_k(block.norm_1(x)).view(3, 10, 4, 4).transpose(1, 2)
        scores = (q @ k.transpose(-1, -2) / 2.0).masked_fill(~torch.ones(10, 10, dtype=torch.bool).tril(),
                                                             float("-inf"))
    torch.testing.assert_close(patterns[0], expected, rtol=0, atol=0)
    torch.testing.assert_close(patterns[0], scores.softmax(-1), rtol=1e-5, atol=1e-6)
    with recording_attention(model, layers=[1]) as recorded, torch.no_grad():
        logits, _ = model(idx)
    assert list(recorded) == [1]
    torch.testing.assert_close(logits, model(idx)[0], rtol=1e-5, atol=1e-5)  # the written-out softmax: rounding


# ---- ablation ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["zero", "mean"])
def test_ablating_a_head_removes_exactly_its_contribution(mode):
    model, idx = _gpt(), _ids()
    heads = head_outputs(model, idx)  # (batch, seq, n_heads, d_head) per layer
    means = mean_head_outputs(model, _ids(seed=5, batch=6))
    for layer, head in [(0, 2), (1, 0)]:
        attention, outputs = model.blocks[layer].attention, {}
        handle = attention.register_forward_hook(lambda m, a, out, outputs=outputs: outputs.__setitem__("out", out))
        try:
            with ablate_heads(model, [(layer, head)], mode=mode, means=means if mode == "mean" else None), \
                    torch.no_grad():
                model(idx)
        finally:
            handle.remove()
        concatenated = heads[layer].clone()
        concatenated[:, :, head] = 0.0 if mode == "zero" else means[layer][head]
        with torch.no_grad():
            expected = attention.W_o(concatenated.flatten(-2))
        assert torch.equal(outputs["out"], expected)
        # the same thing written with the head's own W_O slice: the change is exactly that head's contribution
        w_o = attention.W_o.weight[:, head * 4:(head + 1) * 4]
        with torch.no_grad():
            full = attention.W_o(heads[layer].flatten(-2))
            change = (heads[layer][:, :, head] - concatenated[:, :, head]) @ w_o.T
        torch.testing.assert_close(full - outputs["out"], change, rtol=1e-5, atol=1e-6)


def test_ablation_errors():
    model = _gpt()
    with pytest.raises(ValueError, match="mode"), ablate_heads(model, [(0, 0)], mode="resample"):
        pass
    with pytest.raises(ValueError, match="means"), ablate_heads(model, [(0, 0)], mode="mean"):
        pass
    with pytest.raises(ValueError, match="head"), ablate_heads(model, [(0, 4)]):
        pass
    with pytest.raises(ValueError, match="layer"), ablate_heads(model, [(2, 0)]):
        pass
    means = mean_head_outputs(model, _ids(seq=6), per_position=True)
    with pytest.raises(ValueError, match="positions"), ablate_heads(model, [(0, 0)], mode="mean", means=means):
        model(_ids(seq=7))
    assert _no_hooks(model)


# ---- scores on hand-set and known patterns --------------------------------------------------------------


def test_pattern_scores_follow_their_formulas():
    n, h = 8, 4
    shift = torch.zeros(n, n)
    shift[0, 0] = 1.0
    shift[torch.arange(1, n), torch.arange(n - 1)] = 1.0
    uniform = torch.ones(n, n).tril() / torch.arange(1, n + 1)[:, None]
    induction = torch.zeros(n, n)
    for i in range(n):
        induction[i, i - h + 1 if i >= h else 0] = 1.0
    pattern = torch.stack([shift, uniform, induction])[None]
    prev = previous_token_scores(pattern)
    assert prev[0] == 1.0 and float(prev[2]) == pytest.approx(1 / 7)  # only i = 1 attends to 0 = i - 1
    assert float(prev[1]) == pytest.approx(sum(1 / (i + 1) for i in range(1, n)) / (n - 1))
    ind = induction_scores(pattern)
    assert ind[2] == 1.0 and ind[0] == 0.0
    assert float(ind[1]) == pytest.approx(sum(1 / (i + 1) for i in range(h, n)) / h)
    with pytest.raises(ValueError, match="even"):
        induction_scores(pattern[..., :7, :7])


def test_scores_find_the_planted_heads_of_the_hand_built_model():
    model = hand_built_induction_model(10, 20)
    patterns = attention_patterns(model, _permutation_repeats(4, 10))
    prev = torch.stack([previous_token_scores(p) for p in patterns])
    ind = torch.stack([induction_scores(p) for p in patterns])
    assert prev[0, 0] > 0.999 and prev.flatten()[1:].max() < 0.2
    assert ind[1, 0] > 0.999 and torch.cat([ind[0], ind[1, 1:]]).max() < 0.1
    assert copying_scores(model, 1).tolist() == [1.0, 0.0] and copying_scores(model, 0).tolist() == [0.0, 0.0]
    eig = ov_eigenvalue_scores(model, 1)
    assert float(eig[0]) == pytest.approx(1.0) and float(eig[1]) == 0.0
    k = composition_scores(model, 0, 1, kind="k")
    assert k[0, 0] > 0.1 and k.flatten()[1:].abs().max() == 0.0
    # by hand: W_QK = a (I on TOK <- PREV) + a (1 on TOK) (-2 POS_0)ᵀ, ||.||² = a² (v + 4 v); W_OV = I/s (TOK -> PREV);
    # the product is a/s I (v entries): the score is 1 / sqrt(5 v), however sharp the heads
    assert float(k[0, 0]) == pytest.approx(1 / math.sqrt(5 * 10), rel=1e-5)
    assert composition_scores(model, 0, 1, kind="q").abs().max() == 0.0  # the induction query reads TOK only
    # the interventions agree: each planted head is needed, the decoys are not
    tokens = _permutation_repeats(4, 10, seed=1)
    assert in_context_loss(model, tokens) < 1e-6
    for heads in ([(0, 0)], [(1, 0)]):
        with ablate_heads(model, heads):
            assert in_context_loss(model, tokens) > 2.0
    with ablate_heads(model, [(0, 1), (1, 1)]):
        assert in_context_loss(model, tokens) < 1e-6


def test_copying_scores_match_the_full_ov_matrix():
    model = _gpt(norm="rmsnorm")
    for layer in range(2):
        u, w_e = model.unembedding.weight.detach(), model.token_embedding.weight.detach()
        gamma_f, gamma = model.final_norm.weight.detach(), model.blocks[layer].norm_1.weight.detach()
        att = model.blocks[layer].attention
        expected_top, expected_eig = [], []
        for h in range(4):
            rows = slice(4 * h, 4 * h + 4)
            m = (u * gamma_f) @ att.W_o.weight.detach()[:, rows] @ att.W_v.weight.detach()[rows] @ (w_e * gamma).T
            expected_top.append(float((m.argmax(0) == torch.arange(11)).float().mean()))
            eig = torch.linalg.eigvals(m.double())
            expected_eig.append(float(eig.sum().real / eig.abs().sum()))
        assert copying_scores(model, layer).tolist() == pytest.approx(expected_top)
        assert copying_scores(model, layer, chunk=3).tolist() == pytest.approx(expected_top)
        torch.testing.assert_close(ov_eigenvalue_scores(model, layer), torch.tensor(expected_eig), atol=1e-5, rtol=0)
    tokens = [0, 3, 7]
    subset = copying_scores(model, 0, tokens=tokens)
    assert subset.shape == (4,) and ((subset * 3).round() == subset * 3).all()
    with pytest.raises(ValueError, match="tokens"):
        copying_scores(model, 0, tokens=[11])


def test_composition_scores_are_frobenius_ratios_of_the_raw_matrices():
    model = _gpt(norm="rmsnorm", n_kv_heads=2)
    with torch.no_grad():
        for block in model.blocks:
            block.norm_1.weight.fill_(1.0)  # γ = 1: the folded matrices are the raw weights
    a1, a2 = model.blocks[0].attention, model.blocks[1].attention
    torch.set_grad_enabled(False)
    try:
        _check_composition(model, a1, a2)
    finally:
        torch.set_grad_enabled(True)
    with pytest.raises(ValueError, match="before"):
        composition_scores(model, 1, 0)
    with pytest.raises(ValueError, match="kind"):
        composition_scores(model, 0, 1, kind="o")


def _check_composition(model, a1, a2):
    k = composition_scores(model, 0, 1, kind="k")
    v = composition_scores(model, 0, 1, kind="v")
    for h1 in range(4):
        ov1 = a1.W_o.weight[:, 4 * h1:4 * h1 + 4] @ a1.W_v.weight[4 * (h1 // 2):4 * (h1 // 2) + 4]
        for h2 in range(4):
            kv = slice(4 * (h2 // 2), 4 * (h2 // 2) + 4)  # query heads 0, 1 read key/value head 0
            qk2 = a2.W_q.weight[4 * h2:4 * h2 + 4].T @ a2.W_k.weight[kv]
            ov2 = a2.W_o.weight[:, 4 * h2:4 * h2 + 4] @ a2.W_v.weight[kv]
            for got, w_a in ((k[h1, h2], qk2), (v[h1, h2], ov2)):
                expected = torch.linalg.norm(w_a @ ov1) / (torch.linalg.norm(w_a) * torch.linalg.norm(ov1))
                assert float(got) == pytest.approx(float(expected), rel=1e-4)
    assert 0 < k.min() and k.max() < 1


def test_head_matrices_fold_the_layernorm():
    model, x = _gpt(), torch.randn(5, 16)
    block = model.blocks[0]
    with torch.no_grad():
        block.norm_1.bias.zero_()
        normed = block.norm_1(x)  # γ (x - μ) / σ
        sigma = (x - x.mean(-1, keepdim=True)).pow(2).mean(-1, keepdim=True).add(block.norm_1.eps).sqrt()
        q = head_matrices(model, 0, 1)["W_Q"] @ x.T / sigma.T
        expected = normed @ block.attention.W_q.weight[4:8].T  # head 1's query without its bias
    torch.testing.assert_close(q, expected.T, rtol=1e-4, atol=1e-5)


# ---- logit lens and patching ------------------------------------------------------------------------------


def test_logit_lens_decodes_every_stream_entry():
    model, idx = _gpt(), _ids()
    lens = logit_lens(model, idx)
    assert lens.shape == (3, 3, 10, 11)
    with torch.no_grad():
        x = model.token_embedding(idx) + model.position_embedding(torch.arange(10))
        expected = [model.unembedding(model.final_norm(x))]
        for block in model.blocks:
            x = block(x, is_causal=True)
            expected.append(model.unembedding(model.final_norm(x)))
        logits, _ = model(idx)
    assert torch.equal(lens[-1], logits)
    for got, want in zip(lens, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(logit_lens(model, idx, positions=[-1])[:, :, 0], lens[:, :, -1])
    with pytest.raises(ValueError, match="positions"):
        logit_lens(model, idx, positions=[10])


def test_patching_the_whole_clean_stream_reproduces_the_clean_logits():
    model = _gpt(positional="rope", norm="rmsnorm")
    clean, corrupted = _ids(seed=1), _ids(seed=2)
    with torch.no_grad():
        clean_logits, _ = model(clean)
    stream = residual_stream(model, clean)
    for layer in range(3):
        with patch_residual(model, layer, stream[layer]), torch.no_grad():
            assert torch.equal(model(corrupted)[0], clean_logits)
    with patch_residual(model, 1, stream[1]), pytest.raises(ValueError, match="same batch size and length"):
        model(corrupted[:, :5])
    assert _no_hooks(model)


def test_residual_patching_localises_the_copied_token():
    """A prompt that ends in the second copy of token t_k: the hand-built model predicts t_{k+1}, read from position
    k+1. The corrupted prompt changes that one token; only its position carries the difference until layer 2."""
    model = hand_built_induction_model(10, 20)
    clean = _permutation_repeats(1, 10)[:, :14]  # ends at position 13 = 10 + 3: predicts the token at 4
    corrupted = clean.clone()
    corrupted[0, 4] = clean[0, 9]  # a token not otherwise in the prompt's last stretch
    answer, wrong = int(clean[0, 4]), int(corrupted[0, 4])
    with torch.no_grad():
        assert model(clean)[0][0, -1].argmax() == answer and model(corrupted)[0][0, -1].argmax() == wrong
    restored = residual_patching(model, clean, corrupted, answer, wrong)
    assert restored.shape == (3, 14)
    expected = torch.zeros(3, 14)
    expected[0, 4] = expected[1, 4] = expected[2, 13] = 1.0
    torch.testing.assert_close(restored, expected, atol=1e-4, rtol=0)
    assert (restored[:, :4] == 0).all()  # the streams agree before the changed token: not run, exactly 0
    ld = logit_difference(model(clean)[0].detach(), answer, wrong)
    assert ld.shape == (1,) and float(ld) > 10
    with pytest.raises(ValueError, match="same shape"):
        residual_patching(model, clean, corrupted[:, :5], answer, wrong)
    with pytest.raises(ValueError, match="same logit difference"):
        residual_patching(model, clean, clean, answer, wrong)


def test_residual_patching_agrees_with_patch_residual_one_position_at_a_time():
    model = _gpt()
    clean, corrupted = _ids(batch=2, seq=6, seed=3), _ids(batch=2, seq=6, seed=4)
    answer, wrong = torch.tensor([1, 2]), torch.tensor([3, 4])
    restored = residual_patching(model, clean, corrupted, answer, wrong)
    stream = residual_stream(model, clean)
    with torch.no_grad():
        ld_clean = logit_difference(model(clean)[0], answer, wrong).mean()
        ld_corrupted = logit_difference(model(corrupted)[0], answer, wrong).mean()
    for layer, p in [(0, 5), (1, 2), (2, 5), (2, 0)]:
        with patch_residual(model, layer, stream[layer], positions=[p]), torch.no_grad():
            ld = logit_difference(model(corrupted)[0], answer, wrong).mean()
        expected = (ld - ld_corrupted) / (ld_clean - ld_corrupted)
        assert float(restored[layer, p]) == pytest.approx(float(expected), abs=1e-4)
    assert float(restored[2, 5]) == pytest.approx(1.0, abs=1e-4) and abs(float(restored[2, 0])) < 1e-4
    some = residual_patching(model, clean, corrupted, answer, wrong, layers=[2, 0])
    assert some.shape == (2, 6)
    torch.testing.assert_close(some, restored[[2, 0]], atol=1e-6, rtol=0)
    for bad in ([3], [-1], [], [True]):
        with pytest.raises(ValueError, match="layers"):
            residual_patching(model, clean, corrupted, answer, wrong, layers=bad)


def _smol_like(seed=0, **overrides):
    """A small random model shaped like SmolLM2: RoPE, RMSNorm, SwiGLU, grouped-query attention, tied, no biases."""
    config = dict(vocab_size=40, context_length=16, d_model=32, n_layers=4, n_heads=8, n_kv_heads=2, positional="rope",
                  norm="rmsnorm", activation="swiglu", bias=False, tie_weights=True)
    return _gpt(seed, **{**config, **overrides})


def test_run_from_any_stream_entry_is_the_forward_pass():
    model, ids = _smol_like(), _ids(batch=4, seq=12, vocab=40)
    stream = residual_stream(model, ids)
    for layer in range(len(stream)):
        assert torch.equal(_run_from(model, stream[layer], layer), stream[-1])
    # the tail of the sequences, the keys and values of the positions before it from a KV cache of the whole
    cache = model.new_cache()
    with torch.no_grad():
        model(ids, cache=cache)
    for layer, p in ((1, 5), (3, 11), (2, 0)):
        tail = _run_from(model, stream[layer][:, p:], layer, start=p, cache=cache)
        torch.testing.assert_close(tail, stream[-1][:, p:], atol=1e-5, rtol=1e-5)
    assert [len(kv) for kv in cache] == [12] * 4  # the run's cache is read, not extended
    with pytest.raises(ValueError, match="positions"):
        _run_from(_gpt(positional="alibi"), stream[1][..., :16], 1)


def test_residual_patching_per_example_averages_to_the_batch_result():
    model = _smol_like()
    g = torch.Generator().manual_seed(9)
    clean = torch.randint(0, 40, (5, 9), generator=g)
    corrupted = clean.clone()
    corrupted[:, 4] = (corrupted[:, 4] + 7) % 40
    answer, wrong = torch.randint(0, 40, (5,), generator=g), torch.randint(0, 40, (5,), generator=g)
    res = residual_patching(model, clean, corrupted, answer, wrong, per_example=True)
    assert res["ld"].shape == res["restored"].shape == (5, 9, 5) and res["patched"].shape == (5, 9)
    assert res["patched"][0].tolist() == [False] * 4 + [True] + [False] * 4  # the embeddings differ at 4 only
    assert not res["patched"][:, :4].any() and res["patched"][1:, 4:].all()
    # the batch result is the normalised mean over the examples
    batch = residual_patching(model, clean, corrupted, answer, wrong)
    mean = (res["ld"].mean(-1) - res["ld_corrupted"].mean()) / (res["ld_clean"].mean() - res["ld_corrupted"].mean())
    torch.testing.assert_close(mean, batch, atol=1e-5, rtol=1e-5)
    assert (batch[:, 4:].abs() > 1e-2).any()  # something is restored, so the check could fail
    with torch.no_grad():
        ld_clean = logit_difference(model(clean)[0], answer, wrong)
        ld_corrupted = logit_difference(model(corrupted)[0], answer, wrong)
    torch.testing.assert_close(res["ld_clean"], ld_clean, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(res["ld_corrupted"], ld_corrupted, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(res["restored"], (res["ld"] - ld_corrupted) / (ld_clean - ld_corrupted), atol=1e-4,
                               rtol=1e-4)
    # every patch, example by example, is patch_residual's run of the corrupted prompt
    stream = residual_stream(model, clean)
    for layer, p in ((0, 4), (2, 6), (3, 8)):
        with patch_residual(model, layer, stream[layer], positions=[p]), torch.no_grad():
            torch.testing.assert_close(res["ld"][layer, p], logit_difference(model(corrupted)[0], answer, wrong),
                                       atol=1e-4, rtol=1e-4)
    # the last entry at the last position is the logit itself: patched, it is the clean run's, exactly
    assert torch.equal(res["ld"][-1, -1], res["ld_clean"]) and torch.equal(res["restored"][-1, -1], torch.ones(5))
    assert torch.equal(res["ld"][-1, :-1], res["ld_corrupted"].expand(8, 5))  # earlier positions: read by nothing
    assert torch.equal(res["ld"][:, :4], res["ld_corrupted"].expand(5, 4, 5))  # equal streams: not run
    # one example patched alone gives the same as in the batch; layers= picks rows
    one = residual_patching(model, clean[2:3], corrupted[2:3], answer[2:3], wrong[2:3], per_example=True)
    torch.testing.assert_close(one["ld"][..., 0], res["ld"][..., 2], atol=1e-5, rtol=1e-5)
    some = residual_patching(model, clean, corrupted, answer, wrong, layers=[3, 1], per_example=True)
    assert torch.equal(some["ld"], res["ld"][[3, 1]]) and torch.equal(some["patched"], res["patched"][[3, 1]])
    with pytest.raises(TypeError, match="per_example"):
        residual_patching(model, clean, corrupted, answer, wrong, per_example=1)


def test_scores_on_a_random_model_sit_near_their_baselines():
    model = _gpt()
    tokens = repeated_random_tokens(8, 5, 11, torch.Generator().manual_seed(0))
    for pattern in attention_patterns(model, tokens):
        for scores in (previous_token_scores(pattern), induction_scores(pattern)):
            assert scores.shape == (4,) and ((scores > 0) & (scores < 0.9)).all()
    assert math.isfinite(float(F.softmax(logit_lens(model, tokens)[0, 0, 0], -1).sum()))


def _attention_output(model, layer, ids):
    seen = {}
    handle = model.blocks[layer].attention.register_forward_hook(lambda m, args, out: seen.setdefault("out", out))
    try:
        with torch.no_grad():
            logits = model(ids)[0]
    finally:
        handle.remove()
    return seen["out"], logits


def _attention_only(seed):
    torch.manual_seed(seed)
    model = GPT(AttentionOnlyConfig(vocab_size=11, context_length=12, d_model=16, n_heads=4, tie_weights=False))
    with torch.no_grad():  # away from the small initialisation, biases and norm gains included
        g = torch.Generator().manual_seed(seed + 1)
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.3)
    return model.eval()


def test_remove_from_inputs_on_all_paths_is_the_ablation_seen_by_the_next_block():
    model, ids = _attention_only(3), _ids()
    kinds = [type(m) for m in model.modules()]
    plain, plain_logits = _attention_output(model, 1, ids)
    with ablate_heads(model, [(0, 2)]):
        ablated, _ = _attention_output(model, 1, ids)
    with remove_from_inputs(model, (0, 2), 1, "qkv"):
        removed, logits = _attention_output(model, 1, ids)
    torch.testing.assert_close(removed, ablated, atol=1e-5, rtol=0)
    assert (removed - plain).abs().max() > 1e-2  # the head matters, so the check could fail
    assert not torch.equal(logits, plain_logits)
    # the hooks and the unfused projections are gone afterwards
    assert torch.equal(_attention_output(model, 1, ids)[0], plain)
    assert [type(m) for m in model.modules()] == kinds and type(model.blocks[1].attention.W_k) is Linear
    assert all(not m._forward_pre_hooks for m in model.modules())
    assert "_project" not in model.blocks[1].attention.__dict__


def test_remove_from_inputs_changes_only_the_chosen_paths():
    model, ids = _attention_only(4), _ids()
    block = model.blocks[1]
    stream = residual_stream(model, ids)[1]
    with ablate_heads(model, [(0, 1)]):
        without = residual_stream(model, ids)[1]  # the stream into block 1 without head 0.1's output
    seen = {}
    handles = [getattr(block.attention, name).register_forward_hook(
        lambda m, args, out, name=name: seen.__setitem__(name, out)) for name in ("W_q", "W_k", "W_v")]
    try:
        for paths in ("k", "q", "v", "kv"):
            seen.clear()
            with remove_from_inputs(model, (0, 1), 1, paths):
                _attention_output(model, 1, ids)
            assert sorted(seen) == ["W_k", "W_q", "W_v"]  # computed one by one while the hooks are on
            with torch.no_grad():
                for p in "qkv":
                    linear = getattr(block.attention, f"W_{p}")
                    expected = linear(block.norm_1(without if p in paths else stream))
                    torch.testing.assert_close(seen[f"W_{p}"], expected, atol=1e-5, rtol=0)
            assert not torch.allclose(seen["W_k"], block.attention.W_k(block.norm_1(stream)).detach(),
                                      atol=1e-3) or "k" not in paths
    finally:
        for handle in handles:
            handle.remove()
    # a head that writes nothing removes nothing
    with torch.no_grad():
        model.blocks[0].attention.W_o.weight[:, 4:8] = 0.0
    plain, _ = _attention_output(model, 1, ids)
    with remove_from_inputs(model, (0, 1), 1, "qkv"):
        torch.testing.assert_close(_attention_output(model, 1, ids)[0], plain, atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="after the source"):
        with remove_from_inputs(model, (1, 0), 1):
            pass
    with pytest.raises(ValueError, match="paths"):
        with remove_from_inputs(model, (0, 0), 1, "x"):
            pass


def test_remove_from_inputs_takes_several_sources_out_as_their_sum():
    """All heads of block 0 taken out of block 1's queries, keys and values: block 1's attention computes what it
    computes with them zero-ablated, and ``written`` is what they add to the stream (the attention's output less
    ``W_o``'s bias)."""
    model, ids = _attention_only(5), _ids()
    everything = [(0, h) for h in range(4)]
    plain, _ = _attention_output(model, 1, ids)
    with ablate_heads(model, everything):
        ablated, _ = _attention_output(model, 1, ids)
    with remove_from_inputs(model, everything, 1, "qkv") as seen:
        removed, _ = _attention_output(model, 1, ids)
    torch.testing.assert_close(removed, ablated, atol=1e-5, rtol=0)
    assert (removed - plain).abs().max() > 1e-2
    first, _ = _attention_output(model, 0, ids)
    torch.testing.assert_close(seen["written"], first - model.blocks[0].attention.W_o.bias.detach(), atol=1e-5,
                               rtol=0)
    # one pair is a list of one pair; the order of the sources does not matter beyond rounding
    with remove_from_inputs(model, (0, 2), 1, "k") as one, remove_from_inputs(model, [(0, 2)], 1, "v") as listed:
        _attention_output(model, 1, ids)
    assert torch.equal(one["written"], listed["written"])
    with remove_from_inputs(model, everything[::-1], 1, "qkv"):
        torch.testing.assert_close(_attention_output(model, 1, ids)[0], removed, atol=1e-5, rtol=0)
    assert _no_hooks(model) and "_project" not in model.blocks[1].attention.__dict__
    for bad, match in (([], "at least one"), ([(0, 1), (0, 1)], "each once"), ([(1, 0)], "after the source"),
                       ([(0, 4)], "head"), ([(0, 1, 2)], "pairs")):
        with pytest.raises(ValueError, match=match), remove_from_inputs(model, bad, 1):
            pass


def test_remove_from_inputs_for_one_head_is_the_block_wide_removal_for_that_head():
    """``head=h`` gives head h the pattern and output it has when the whole block reads the reduced stream, and
    leaves every other head of the block (its key/value neighbours included) as it was."""
    model, ids = _smol_like(), _ids(batch=4, seq=12, vocab=40)
    sources = [(1, 3), (0, 2), (1, 6)]
    plain_outputs, plain_patterns = head_outputs(model, ids), attention_patterns(model, ids)
    for path in ("q", "k", "v", "qkv"):
        with remove_from_inputs(model, sources, 2, path), recording_attention(model, [2]) as patterns:
            whole = head_outputs(model, ids)
        for head in (5, 0):
            with remove_from_inputs(model, sources, 2, path, head=head) as seen:
                outputs = head_outputs(model, ids)
            torch.testing.assert_close(seen["pattern"], patterns[2][:, head], atol=1e-6, rtol=1e-6)
            torch.testing.assert_close(seen["z"], whole[2][..., head, :], atol=1e-6, rtol=1e-6)
            assert torch.equal(outputs[2][..., head, :], seen["z"])  # the real call carries the head's new output
            assert (seen["z"] - plain_outputs[2][..., head, :]).abs().max() > 1e-3  # it did change
            others = [h for h in range(8) if h != head]
            torch.testing.assert_close(outputs[2][..., others, :], plain_outputs[2][..., others, :], atol=1e-6,
                                       rtol=1e-6)
            assert all(torch.equal(outputs[e], plain_outputs[e]) for e in (0, 1))  # the blocks before: untouched
            if path == "v":  # the values move no attention (the written-out softmax for the fused one: rounding)
                torch.testing.assert_close(seen["pattern"], plain_patterns[2][:, head], atol=1e-5, rtol=1e-5)
    assert _no_hooks(model) and "_project" not in model.blocks[2].attention.__dict__


def test_remove_from_inputs_for_each_head_equals_zeroing_the_sources_in_an_attention_only_model():
    model, ids = _attention_only(6), _ids()
    sources = [(0, h) for h in range(4)]
    with ablate_heads(model, sources):
        patterns, outputs = attention_patterns(model, ids), head_outputs(model, ids)
    for head in range(4):
        with remove_from_inputs(model, sources, 1, "qkv", head=head) as seen, torch.no_grad():
            model(ids)
        torch.testing.assert_close(seen["pattern"], patterns[1][:, head], atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(seen["z"], outputs[1][..., head, :], atol=1e-5, rtol=1e-5)


def test_remove_from_inputs_from_the_runs_outputs_lets_a_pass_start_at_the_target_block():
    model, ids = _smol_like(seed=1), _ids(batch=4, seq=12, vocab=40)
    stream, outputs = residual_stream(model, ids), head_outputs(model, ids)
    sources = [(0, 3), (1, 1)]
    for head in (None, 4):
        with remove_from_inputs(model, sources, 3, "qk", head=head) as whole:
            final = residual_stream(model, ids)[-1]
        with remove_from_inputs(model, sources, 3, "qk", head=head, outputs=outputs) as given:
            assert torch.equal(_run_from(model, stream[3], 3), final)
        assert torch.equal(given["written"], whole["written"]) and not torch.equal(final, stream[-1])
        if head is not None:
            assert torch.equal(given["z"], whole["z"]) and torch.equal(given["pattern"], whole["pattern"])
        # recorded in the pass, the sources must run in it
        with pytest.raises(ValueError, match="outputs="), remove_from_inputs(model, sources, 3, head=head):
            _run_from(model, stream[3], 3)
        with pytest.raises(ValueError, match="same token ids"), \
                remove_from_inputs(model, sources, 3, head=head, outputs=outputs):
            _run_from(model, stream[3][:2], 3)


def test_remove_from_inputs_of_a_silent_source_changes_nothing():
    model, ids = _smol_like(seed=2), _ids(batch=4, seq=12, vocab=40)
    with torch.no_grad():
        model.blocks[0].attention.W_o.weight[:, 3 * 4:4 * 4] = 0.0  # head 0.3 writes nothing
    stream, patterns, outputs = residual_stream(model, ids), attention_patterns(model, ids), head_outputs(model, ids)
    for paths in ("q", "k", "v", "qkv"):
        with remove_from_inputs(model, (0, 3), 2, paths, head=6) as seen:
            final = residual_stream(model, ids)[-1]
        assert torch.equal(seen["written"], torch.zeros_like(stream[0]))
        torch.testing.assert_close(final, stream[-1], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(seen["pattern"], patterns[2][:, 6], atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(seen["z"], outputs[2][..., 6, :], atol=1e-6, rtol=1e-6)
    cache = model.new_cache()
    with pytest.raises(ValueError, match="KV cache"), remove_from_inputs(model, (0, 3), 2, head=6), torch.no_grad():
        model(ids, cache=cache)
    assert _no_hooks(model) and "_project" not in model.blocks[2].attention.__dict__


# ---- direct logit attribution --------------------------------------------------------------------------


@pytest.mark.parametrize("overrides", [{}, {"norm": "rmsnorm", "positional": "rope", "n_kv_heads": 2, "bias": False,
                                            "activation": "swiglu", "tie_weights": True}])
@pytest.mark.parametrize("centred", [False, True])
def test_direct_logit_attribution_adds_up_to_the_models_logits(overrides, centred):
    model, idx = _gpt(**overrides), _ids()
    targets = _ids(seed=5)
    with torch.no_grad():
        logits, _ = model(idx)
    if centred:
        logits = logits - logits.mean(-1, keepdim=True)
    expected = logits.gather(-1, targets[..., None])[..., 0]
    parts = direct_logit_attribution(model, idx, targets, centred=centred)
    assert parts["heads"].shape == (2, 4, 3, 10) and parts["rest"].shape == (2, 3, 10)
    total = parts["embedding"] + parts["heads"].sum((0, 1)) + parts["rest"].sum(0) + parts["bias"]
    torch.testing.assert_close(total, expected, atol=2e-4, rtol=1e-4)
    assert _no_hooks(model)


def test_direct_logit_attribution_of_one_head_by_hand():
    """Head 1.2's part, from its output, W_O's columns, the frozen LayerNorm divisor and the unembedding."""
    model, idx, targets = _gpt(), _ids(), _ids(seed=5)
    parts = direct_logit_attribution(model, idx, targets)
    z = head_outputs(model, idx)[1][..., 2, :]  # (batch, seq, d_head)
    w_o = model.blocks[1].attention.W_o.weight.detach()[:, 8:12]
    x = residual_stream(model, idx)[-1]
    sigma = (x.var(-1, unbiased=False, keepdim=True) + model.final_norm.eps).sqrt()
    c = z @ w_o.T
    normed = model.final_norm.weight.detach() * (c - c.mean(-1, keepdim=True)) / sigma
    by_hand = (normed * model.unembedding.weight.detach()[targets]).sum(-1)
    torch.testing.assert_close(parts["heads"][1, 2], by_hand, atol=1e-5, rtol=1e-5)
    # an attention-only model without biases has no rest: every block is its heads
    attn_only = GPT(AttentionOnlyConfig(vocab_size=11, context_length=12, d_model=16, n_layers=2, n_heads=4,
                                        bias=False)).eval()
    rest = direct_logit_attribution(attn_only, idx, targets)["rest"]
    assert rest.abs().max() < 1e-6


def test_direct_logit_attribution_errors():
    model, idx = _gpt(), _ids()
    with pytest.raises(ValueError, match="shaped like idx"):
        direct_logit_attribution(model, idx, idx[:, :3])
    with pytest.raises(ValueError, match="token ids in 0 .. 10"):
        direct_logit_attribution(model, idx, idx + 11)
    with pytest.raises(TypeError, match="centred"):
        direct_logit_attribution(model, idx, idx, centred=1)
    with pytest.raises(ValueError, match="Pre-LN"):
        direct_logit_attribution(_gpt(norm_position="post"), idx, idx)
