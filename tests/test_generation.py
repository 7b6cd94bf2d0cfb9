"""Tests for groundup.generation: the top-k and top-p filters, generate() with and without the KV cache, and beam_search
(also against transformers' generate(num_beams=...))."""

import math

import pytest
import torch
from torch import nn

from groundup.attention import KVCache
from groundup.generation import TOP_P_TOLERANCE, beam_search, generate, generate_batch, top_k_filter, top_p_filter
from groundup.models import GPT, POSITIONALS, GPTConfig, MaskedLM, MaskedLMConfig

INF = float("-inf")
SEEDS_PROBS = [0.1, 0.05, 0.03, 0.02]  # bananas, cherries, fruit, cake (the seeds' example)


def seeds_logits(dtype=torch.float32, shift=0.0):
    """Log-probabilities of the seeds' example: the four fruits, then 0.8 spread over 80 other tokens of 0.01."""
    probs = torch.tensor(SEEDS_PROBS + [0.01] * 80, dtype=torch.float64)
    return (probs.log() + shift).to(dtype)


def small_gpt(positional="learned", context_length=8, dtype=torch.float64, seed=0, **kw):
    torch.manual_seed(seed)
    config = GPTConfig(vocab_size=11, context_length=context_length, d_model=16, n_layers=2, n_heads=2,
                       positional=positional, **kw)
    return GPT(config).to(dtype)


def reference_greedy(model, idx, n):
    """Greedy decoding written independently: the full forward pass over the last n_C tokens, argmax."""
    out = idx.clone()
    with torch.no_grad():
        for _ in range(n):
            logits, _ = model(out[:, -model.config.context_length:])
            out = torch.cat([out, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return out


class FixedLogits(nn.Module):
    """A stand-in model whose next-token logits are always the same vector (for testing the sampling step)."""

    def __init__(self, logits):
        super().__init__()
        self.logits = nn.Parameter(torch.as_tensor(logits, dtype=torch.float64), requires_grad=False)
        self.config = GPTConfig(vocab_size=len(logits), context_length=4, d_model=2, n_layers=1, n_heads=1)

    def new_cache(self):
        return [KVCache()]

    def forward(self, idx, targets=None, *, cache=None):
        return self.logits.expand(idx.shape[0], idx.shape[1], -1), None


# ---- top_k_filter ----------------------------------------------------------------------------------------


def test_top_k_keeps_the_k_largest():
    logits = torch.tensor([[1.0, 5.0, 3.0, -2.0, 4.0], [0.0, -1.0, 2.0, 1.0, 3.0]])
    got = top_k_filter(logits, 2)
    assert torch.equal(got, torch.tensor([[INF, 5.0, INF, INF, 4.0], [INF, INF, 2.0, INF, 3.0]]))


def test_top_k_keeps_ties_at_the_boundary():
    logits = torch.tensor([1.0, 3.0, 3.0, 2.0, 3.0])
    assert torch.equal(top_k_filter(logits, 2), torch.tensor([INF, 3.0, 3.0, INF, 3.0]))
    assert torch.equal(top_k_filter(logits, 4), logits.masked_fill(logits < 2.0, INF))


def test_top_k_larger_than_the_vocabulary_keeps_everything():
    logits = torch.randn(3, 7)
    assert torch.equal(top_k_filter(logits, 7), logits)
    assert torch.equal(top_k_filter(logits, 100), logits)


def test_top_k_one_is_the_argmax_and_dtype_is_kept():
    logits = torch.randn(4, 9, dtype=torch.float64)
    got = top_k_filter(logits, 1)
    assert got.dtype == torch.float64
    assert torch.equal(torch.isfinite(got).nonzero()[:, 1], logits.argmax(-1))


def test_top_k_does_not_modify_its_input():
    logits = torch.randn(2, 6)
    before = logits.clone()
    out = top_k_filter(logits, 2)
    assert torch.equal(logits, before) and out.data_ptr() != logits.data_ptr()


@pytest.mark.parametrize("k", [0, -1, 1.5, True, "2", None])
def test_top_k_rejects_bad_k(k):
    with pytest.raises(ValueError, match="top_k must be an integer >= 1"):
        top_k_filter(torch.randn(5), k)


def test_filters_reject_bad_logits():
    for f, arg in ((top_k_filter, 2), (top_p_filter, 0.5)):
        with pytest.raises(TypeError, match="logits must be a torch.Tensor"):
            f([1.0, 2.0], arg)
        with pytest.raises(TypeError, match="floating-point"):
            f(torch.tensor([1, 2]), arg)
        with pytest.raises(ValueError, match="vocab_size >= 1"):
            f(torch.tensor(1.0), arg)
        with pytest.raises(ValueError, match="vocab_size >= 1"):
            f(torch.empty(2, 0), arg)


# ---- top_p_filter ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shift", [0.0, 3.7, -12.0])
def test_top_p_seeds_example_keeps_bananas_cherries_and_fruit(dtype, shift):
    got = top_p_filter(seeds_logits(dtype, shift), 0.18)
    assert torch.isfinite(got).nonzero().flatten().tolist() == [0, 1, 2]  # not cake
    assert got.dtype == dtype


def test_top_p_seeds_example_when_the_float_sum_misses_p_by_rounding():
    # the rest of the mass over 160 tokens of 0.005: after a float64 softmax the first three sum to 0.18 within a few
    # units in the last place, below it with PyTorch's AVX2 kernels (0.17999...) and above it with the plain ones
    # (ATEN_CPU_CAPABILITY=default: 0.18000000000000005); either way the filter keeps exactly those three
    probs = torch.tensor(SEEDS_PROBS + [0.005] * 160, dtype=torch.float64)
    assert torch.softmax(probs.log(), -1)[:3].sum().item() == pytest.approx(0.18, abs=1e-15)
    assert torch.isfinite(top_p_filter(probs.log(), 0.18)).nonzero().flatten().tolist() == [0, 1, 2]


def test_top_p_counts_a_float_shortfall_below_the_tolerance_as_reaching_p():
    # the first three tokens sum to 0.18 - 1e-9: "reaches" p within the tolerance, so the fourth is dropped
    probs = torch.tensor([0.1, 0.05, 0.03 - 1e-9, 0.02 + 1e-9] + [0.01] * 80, dtype=torch.float64)
    assert torch.isfinite(top_p_filter(probs.log(), 0.18)).sum() == 3
    # a real shortfall (1e-4 > the tolerance) keeps the token that crosses p
    probs = torch.tensor([0.1, 0.05, 0.03 - 1e-4, 0.02 + 1e-4] + [0.01] * 80, dtype=torch.float64)
    assert torch.isfinite(top_p_filter(probs.log(), 0.18)).sum() == 4
    assert TOP_P_TOLERANCE == 1e-6


def test_top_p_keeps_the_token_that_crosses_p():
    logits = seeds_logits(torch.float64)
    for p, kept in [(0.05, 1), (0.1, 1), (0.11, 2), (0.15, 2), (0.16, 3), (0.19, 4), (0.2, 4), (0.201, 5)]:
        assert torch.isfinite(top_p_filter(logits, p)).sum().item() == kept, p


def test_top_p_always_keeps_the_most_probable_token_and_p_one_keeps_all():
    logits = torch.tensor([[0.0, 2.0, 1.0], [5.0, -3.0, -40.0]])
    assert torch.equal(torch.isfinite(top_p_filter(logits, 1e-9)), torch.tensor([[0, 1, 0], [1, 0, 0]]).bool())
    assert torch.equal(top_p_filter(logits, 1.0), logits)  # even the 1e-20 token stays


def test_top_p_ties_in_index_order():
    logits = torch.zeros(6)  # six tokens of 1/6: p = 0.3 needs two of them, the two lowest indices
    assert torch.isfinite(top_p_filter(logits, 0.3)).nonzero().flatten().tolist() == [0, 1]
    logits = torch.tensor([0.0, 1.0, 0.0, 1.0])
    assert torch.isfinite(top_p_filter(logits, 0.5)).nonzero().flatten().tolist() == [1, 3]


def test_top_p_keeps_minus_inf_entries_removed():
    logits = torch.tensor([INF, 1.0, 0.0, INF])
    assert torch.equal(top_p_filter(logits, 0.99), torch.tensor([INF, 1.0, 0.0, INF]))


def reference_top_p(row, p):
    """A straightforward loop: add the most probable tokens one by one until their mass reaches p."""
    probs = torch.softmax(row.double(), -1).tolist()
    ranked = sorted(range(len(probs)), key=lambda i: (-probs[i], i))
    kept, mass = [], 0.0
    for i in ranked:
        kept.append(i)
        mass += probs[i]
        if mass >= p - TOP_P_TOLERANCE:
            break
    out = torch.full_like(row, INF)
    out[kept] = row[kept]
    return out


def test_top_p_matches_a_straightforward_reference_on_random_logits():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(50, 20, generator=g, dtype=torch.float64) * 2
    for p in [0.1, 0.5, 0.9, 0.999]:
        got = top_p_filter(logits, p)
        expected = torch.stack([reference_top_p(row, p) for row in logits])
        assert torch.equal(got, expected), p


def test_top_p_works_on_any_leading_shape_and_does_not_modify_input():
    logits = torch.randn(2, 3, 10)
    before = logits.clone()
    got = top_p_filter(logits, 0.7)
    assert torch.equal(logits, before) and got.shape == (2, 3, 10)
    assert torch.equal(got[1, 2], top_p_filter(logits[1, 2], 0.7))


@pytest.mark.parametrize("p", [0, 0.0, -0.1, 1.0001, 2, float("nan"), True, "0.5", None])
def test_top_p_rejects_p_outside_0_1(p):
    with pytest.raises(ValueError, match=r"top_p must be a number in \(0, 1\]"):
        top_p_filter(torch.randn(5), p)


# ---- generate: results ------------------------------------------------------------------------------------


def test_generate_returns_the_prompt_followed_by_new_ids():
    model = small_gpt()
    idx = torch.tensor([[1, 2, 3], [4, 5, 6]])
    out = generate(model, idx, 5, generator=torch.Generator().manual_seed(0))
    assert out.shape == (2, 8) and out.dtype == torch.long
    assert torch.equal(out[:, :3], idx)
    assert int(out.min()) >= 0 and int(out.max()) < 11
    assert torch.equal(generate(model, idx, 0), idx)
    assert torch.equal(generate(model, idx.int(), 2, greedy=True), generate(model, idx, 2, greedy=True))


@pytest.mark.parametrize("use_cache", [True, False])
def test_greedy_equals_the_argmax_continuation_also_past_the_context(use_cache):
    model = small_gpt(context_length=8)
    idx = torch.tensor([[3, 1, 4]])
    assert torch.equal(generate(model, idx, 12, greedy=True, use_cache=use_cache), reference_greedy(model, idx, 12))


@pytest.mark.parametrize("positional", POSITIONALS)
def test_cached_equals_uncached_in_every_family_past_the_context(positional):
    model = small_gpt(positional, context_length=8)
    idx = torch.tensor([[1, 5, 2], [7, 0, 9]])
    greedy = [generate(model, idx, 14, greedy=True, use_cache=c) for c in (True, False)]
    assert torch.equal(greedy[0], greedy[1])
    assert torch.equal(greedy[0], reference_greedy(model, idx, 14))
    sampled = [generate(model, idx, 14, temperature=1.5, top_k=8, top_p=0.95, use_cache=c,
                        generator=torch.Generator().manual_seed(3)) for c in (True, False)]
    assert torch.equal(sampled[0], sampled[1])


def test_cached_equals_uncached_in_float32_and_with_a_prompt_longer_than_the_context():
    model = small_gpt("rope", context_length=6, dtype=torch.float32)
    idx = torch.randint(0, 11, (3, 9), generator=torch.Generator().manual_seed(1))
    a = generate(model, idx, 10, use_cache=True, generator=torch.Generator().manual_seed(5))
    b = generate(model, idx, 10, use_cache=False, generator=torch.Generator().manual_seed(5))
    assert torch.equal(a, b)
    assert torch.equal(generate(model, idx, 4, greedy=True), reference_greedy(model, idx, 4))


def test_the_cache_runs_one_token_per_step_while_the_sequence_fits():
    model = small_gpt(context_length=8)
    lengths = []
    handle = model.token_embedding.register_forward_hook(lambda m, args, out: lengths.append(args[0].shape[1]))
    generate(model, torch.tensor([[1, 2, 3]]), 8, greedy=True)
    handle.remove()
    # prefill the 3-token prompt, then one token per step while the sequence (3 to 8 tokens) fits the context,
    # then the cropped window of the last 8 tokens (sequences of 9 and 10 tokens)
    assert lengths == [3, 1, 1, 1, 1, 1, 8, 8]


@pytest.mark.parametrize("positional", ["learned", "rope"])
def test_last_only_gives_the_full_forwards_last_row_with_and_without_the_cache(positional):
    model = small_gpt(positional, context_length=8)
    idx = torch.tensor([[1, 5, 2, 7], [7, 0, 9, 3]])
    full, _ = model(idx)
    last, loss = model(idx, last_only=True)
    assert last.shape == (2, 1, 11) and loss is None
    torch.testing.assert_close(last[:, 0], full[:, -1], rtol=0, atol=1e-12)
    cache = model.new_cache()
    model(idx[:, :3], cache=cache, last_only=True)
    step, _ = model(idx[:, 3:], cache=cache, last_only=True)
    torch.testing.assert_close(step[:, 0], full[:, -1], rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="targets"):
        model(idx, idx, last_only=True)
    with pytest.raises(TypeError, match="last_only"):
        model(idx, last_only=1)


def test_generate_unembeds_one_row_per_step_and_a_model_without_last_only_still_works():
    model = small_gpt(context_length=8)
    rows = []
    handle = model.unembedding.register_forward_hook(lambda m, args, out: rows.append(args[0].shape[1]))
    out = generate(model, torch.tensor([[1, 2, 3]]), 7, greedy=True)
    handle.remove()
    assert rows == [1] * 7  # the 3-token prefill, 4 cached steps, 2 cropped windows: one row each time
    assert torch.equal(out, reference_greedy(model, torch.tensor([[1, 2, 3]]), 7))
    fixed = FixedLogits([0.0, 2.0, 1.0])  # its forward has no last_only: generate must not pass it
    assert generate(fixed, torch.tensor([[0]]), 3, greedy=True).tolist() == [[0, 1, 1, 1]]


def test_a_generator_makes_sampling_reproducible():
    model = small_gpt()
    idx = torch.tensor([[1, 2]])
    a = generate(model, idx, 20, generator=torch.Generator().manual_seed(7))
    b = generate(model, idx, 20, generator=torch.Generator().manual_seed(7))
    c = generate(model, idx, 20, generator=torch.Generator().manual_seed(8))
    assert torch.equal(a, b) and not torch.equal(a, c)
    torch.manual_seed(11)
    d = generate(model, idx, 20)
    torch.manual_seed(11)
    assert torch.equal(d, generate(model, idx, 20))  # without a generator: the global random state


def test_a_batch_generates_each_row_as_if_alone_when_greedy():
    model = small_gpt("alibi")
    idx = torch.tensor([[1, 2, 3], [9, 8, 7], [0, 0, 0]])
    together = generate(model, idx, 10, greedy=True)
    alone = torch.cat([generate(model, idx[i:i + 1], 10, greedy=True) for i in range(3)])
    assert torch.equal(together, alone)


def test_top_k_one_and_a_tiny_top_p_or_temperature_are_greedy():
    model = small_gpt("relative")
    idx = torch.tensor([[4, 2], [1, 1]])
    greedy = generate(model, idx, 10, greedy=True)
    g = torch.Generator().manual_seed(0)
    assert torch.equal(generate(model, idx, 10, top_k=1, generator=g), greedy)
    assert torch.equal(generate(model, idx, 10, top_p=1e-9, generator=g), greedy)
    assert torch.equal(generate(model, idx, 10, temperature=1e-4, generator=g), greedy)


def test_greedy_ignores_the_sampling_options_and_the_generator():
    model = small_gpt()
    idx = torch.tensor([[4, 2]])
    g = torch.Generator().manual_seed(0)
    state = g.get_state()
    out = generate(model, idx, 6, greedy=True, temperature=3.0, top_k=2, top_p=0.5, generator=g)
    assert torch.equal(out, generate(model, idx, 6, greedy=True))
    assert torch.equal(g.get_state(), state)


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, None, None), (0.5, None, None), (2.0, None, None),
                                                       (1.0, 2, None), (1.0, None, 0.7), (0.8, 3, 0.9)])
def test_sampled_frequencies_follow_the_transformed_distribution(temperature, top_k, top_p):
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0], dtype=torch.float64)
    model = FixedLogits(logits)
    n = 20000
    out = generate(model, torch.zeros(n, 1, dtype=torch.long), 1, temperature=temperature, top_k=top_k,
                   top_p=top_p, generator=torch.Generator().manual_seed(0))
    freq = torch.bincount(out[:, 1], minlength=5).double() / n
    expected = logits / temperature  # temperature first, then top-k, then top-p
    if top_k is not None:
        expected = top_k_filter(expected, top_k)
    if top_p is not None:
        expected = top_p_filter(expected, top_p)
    expected = torch.softmax(expected, -1)
    assert (freq[expected == 0] == 0).all()
    assert torch.allclose(freq, expected, atol=4 * math.sqrt(0.25 / n))


def test_temperature_comes_before_top_p():
    # top-p after temperature 0.5: [0.88, 0.12] -> p=0.8 keeps one token; top-p on the raw logits would keep two
    model = FixedLogits([1.0, 0.0])
    out = generate(model, torch.zeros(500, 1, dtype=torch.long), 1, temperature=0.5, top_p=0.8,
                   generator=torch.Generator().manual_seed(0))
    assert (out[:, 1] == 0).all()


@pytest.mark.parametrize("training", [True, False])
def test_generate_runs_in_eval_mode_without_gradients_and_restores_the_flag(training):
    model = small_gpt(dropout=0.5)
    model.train(training)
    seen = []
    model.blocks[0].register_forward_hook(lambda m, a, o: seen.append((m.training, torch.is_grad_enabled())))
    out = generate(model, torch.tensor([[1, 2]]), 6, greedy=True)
    assert model.training is training
    assert all(flags == (False, False) for flags in seen)
    model.eval()
    assert torch.equal(out, reference_greedy(model, torch.tensor([[1, 2]]), 6))  # dropout was off


def test_generate_works_on_the_default_device():
    from groundup import default_device

    device = default_device()
    model = small_gpt().to(device)
    out = generate(model, torch.tensor([[1, 2]]), 4, generator=torch.Generator().manual_seed(0))
    assert out.device.type == device.type and out.shape == (1, 6)


# ---- generate: errors ------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(temperature=0), ValueError, "temperature must be a finite number > 0"),
    (dict(temperature=-1.0), ValueError, "temperature must be a finite number > 0"),
    (dict(temperature=float("inf")), ValueError, "temperature must be a finite number > 0"),
    (dict(temperature=float("nan")), ValueError, "temperature must be a finite number > 0"),
    (dict(temperature="hot"), ValueError, "temperature must be a finite number > 0"),
    (dict(top_k=0), ValueError, "top_k must be an integer >= 1"),
    (dict(top_k=2.0), ValueError, "top_k must be an integer >= 1"),
    (dict(top_p=0.0), ValueError, r"top_p must be a number in \(0, 1\]"),
    (dict(top_p=1.5), ValueError, r"top_p must be a number in \(0, 1\]"),
    (dict(greedy=1), TypeError, "greedy must be True or False"),
    (dict(use_cache=None), TypeError, "use_cache must be True or False"),
    (dict(generator=0), TypeError, "generator must be a torch.Generator"),
])
def test_generate_rejects_bad_sampling_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        generate(small_gpt(), torch.tensor([[1, 2]]), 3, **kwargs)


@pytest.mark.parametrize("n", [-1, 2.0, None, True])
def test_generate_rejects_a_bad_max_new_tokens(n):
    with pytest.raises(ValueError, match="max_new_tokens must be an integer >= 0"):
        generate(small_gpt(), torch.tensor([[1]]), n)


@pytest.mark.parametrize("idx, error, match", [
    (torch.zeros(1, 0, dtype=torch.long), ValueError, "the prompt is empty"),
    (torch.zeros(0, 3, dtype=torch.long), ValueError, "at least one prompt"),
    (torch.tensor([1, 2]), ValueError, r"shape \(batch, seq\).*unsqueeze\(0\)"),
    (torch.zeros(1, 2, 3, dtype=torch.long), ValueError, r"shape \(batch, seq\)"),
    (torch.tensor([[1, 11]]), ValueError, r"from 1 to 11, outside the vocabulary.*\[0, 10\]"),
    (torch.tensor([[-1, 3]]), ValueError, "outside the vocabulary"),
    (torch.tensor([[1.0, 2.0]]), TypeError, "integer token ids"),
    (torch.tensor([[True]]), TypeError, "integer token ids"),
    ([[1, 2]], TypeError, "idx must be a torch.Tensor"),
])
def test_generate_rejects_bad_prompts(idx, error, match):
    with pytest.raises(error, match=match):
        generate(small_gpt(), idx, 3)


def test_generate_rejects_something_that_is_not_a_model():
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        generate(lambda idx: idx, torch.tensor([[1]]), 3)
    with pytest.raises(TypeError, match="config with context_length and vocab_size"):
        generate(nn.Linear(2, 2), torch.tensor([[1]]), 3)


# ---- the benchmark section (python -m groundup.bench generation) --------------------------------------------


def test_bench_kv_cache_memory_formula_and_timing_helpers():
    from groundup.bench import generation as bench
    from groundup.bench.__main__ import SECTIONS

    assert "generation" in SECTIONS
    config = GPTConfig(**bench.CONFIG)
    assert bench.kv_cache_bytes(config, 1) == 2 * 6 * 6 * 64 * 4 == 18432  # 18 KiB per token in float32
    assert bench.kv_cache_bytes(config, 256, batch=2, bytes_per_number=2) == 18432 // 2 * 256 * 2
    model = small_gpt(context_length=8)
    rows = bench.speedup_by_length(model, [3, 7], repeat=1)
    assert [n for n, _, _ in rows] == [3, 7] and all(t > 0 for _, a, b in rows for t in (a, b))


def test_bench_alternates_sides_and_reports_median_ratio_with_quartiles():
    from groundup.bench import alternate, ratio_note, ratio_quartiles

    calls = []
    times = alternate({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, repeat=4, warmup=1)
    assert calls == ["a", "b"] + ["a", "b", "b", "a", "a", "b", "b", "a"]  # warm-up, then the order turns over
    assert [len(v) for v in times.values()] == [4, 4] and all(t >= 0 for v in times.values() for t in v)
    clock = iter([0.0, 1.0, 1.0, 3.0, 3.0, 6.0, 6.0, 10.0]).__next__  # any clock, e.g. time.process_time
    assert alternate({"a": lambda: None, "b": lambda: None}, repeat=2, warmup=0, clock=clock) == \
        {"a": [1.0, 4.0], "b": [2.0, 3.0]}  # rounds: a (0-1) b (1-3), then b (3-6) a (6-10)
    # per-round ratios 1, 2, 3, 4, 5: median 3, quartiles 2 and 4 (not the ratio of the medians, 3/1)
    a, b = [1.0, 4.0, 9.0, 16.0, 25.0], [1.0, 2.0, 3.0, 4.0, 5.0]
    assert ratio_quartiles(a, b) == (3.0, 2.0, 4.0)
    assert ratio_note(a, b, "theirs", "target <= 1") == \
        "3.00x theirs (quartiles 2.00-4.00, 5 alternating rounds); target <= 1"


def test_bench_prints_the_load_and_warns_above_the_core_count(monkeypatch):
    from groundup.bench import __main__ as bench_main

    monkeypatch.setattr(bench_main, "cores", lambda: 2)
    monkeypatch.setattr(bench_main.os, "getloadavg", lambda: (0.5, 0.4, 0.3))
    assert bench_main.load_line("start") == "load average at start: 0.50 0.40 0.30 (2 cores)"
    monkeypatch.setattr(bench_main.os, "getloadavg", lambda: (7.25, 5.0, 3.0))
    line = bench_main.load_line("end")
    assert line.startswith("load average at end: 7.25 5.00 3.00 (2 cores)\nWARNING: the load exceeds the 2 cores")
    assert "quiet machine" in bench_main.QUIET_NOTE


def test_bench_versus_transformers_builds_the_same_gpt2_on_both_sides():
    pytest.importorskip("transformers")
    from groundup.bench import versus_transformers as bench

    ours, theirs = bench.gpt2_pair(n_layer=2, n_embd=32, n_head=4, vocab_size=100, n_positions=64)
    prompt = torch.randint(0, 100, (1, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(ours(prompt)[0] if isinstance(ours(prompt), tuple) else ours(prompt),
                                   theirs(prompt).logits, rtol=1e-4, atol=1e-5)
    times, outputs = bench.prefill_and_decode(bench.our_greedy(ours), bench.hf_greedy(theirs), prompt, 5, rounds=2)
    assert torch.equal(outputs["ours"], outputs["theirs"]) and outputs["ours"].shape == (1, 11)
    assert sorted(times) == ["all_ours", "all_theirs", "decode_ours", "decode_theirs", "prefill_ours",
                             "prefill_theirs"] and all(len(v) == 2 for v in times.values())
    rows = bench.comparison_rows("stand-in", times, 6, 5, "target <= 0.75x")
    assert [r.unit for r in rows] == ["s", "s", "x", "ms", "x", "ms", "x"]


# ---- generate_batch: prompts of different lengths at once ----------------------------------------------------


def varied_gpt(positional, context_length=8, seed=0):
    """A small float64 GPT (64 tokens) whose weights are all N(0, 0.5²): peaked next-token distributions that
    change with the position and the prompt (at the 0.02 initialisation greedy decoding repeats one token)."""
    torch.manual_seed(seed)
    model = GPT(GPTConfig(vocab_size=64, context_length=context_length, d_model=32, n_layers=2, n_heads=2,
                          positional=positional)).double()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, 0.5, generator=g)
    return model


def one_at_a_time(model, prompts, n):
    """Each prompt's new tokens from generate on that prompt alone (greedy)."""
    return [generate(model, torch.tensor([p]), n, greedy=True)[0, len(p):].tolist() for p in prompts]


def cut_after(rows, stop):
    return [row[:row.index(stop) + 1] if stop in row else row for row in rows]


BATCH_PROMPTS = [torch.randint(0, 11, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (1, 5, 17)]


@pytest.mark.parametrize("context_length", [8, 24])
@pytest.mark.parametrize("use_cache", [True, False])
@pytest.mark.parametrize("positional", POSITIONALS)
def test_generate_batch_greedy_equals_one_prompt_at_a_time(positional, use_cache, context_length):
    """Prompts of 1, 5 and 17 tokens, 12 new ones: with context 8 the padded batch (17 to 29 columns) runs cropped
    windows from the start; with context 24 it uses the cache and crosses the context at step 8 (the 1- and
    5-token prompts alone never do). The padding matters: the same padded batch without its mask (generate on
    it, pads read as tokens) gives other tokens in some row."""
    model = varied_gpt(positional, context_length)
    expected = one_at_a_time(model, BATCH_PROMPTS, 12)
    assert generate_batch(model, BATCH_PROMPTS, 12, greedy=True, use_cache=use_cache, pad_id=3) == expected
    padded = torch.tensor([[3] * (17 - len(p)) + p for p in BATCH_PROMPTS])
    assert generate(model, padded, 12, greedy=True)[:, 17:].tolist() != expected


@pytest.mark.parametrize("context_length", [8, 24])
@pytest.mark.parametrize("positional", POSITIONALS)
def test_generate_batch_stops_each_row_after_its_first_stop_token(positional, context_length):
    """The stop token is the earliest token greedy decoding emits in some row but not in every row: a row ends
    with it, a row without it runs all 12 steps (past the context), and every row equals its one-at-a-time tokens
    cut after the first stop; the pad id changes nothing. A batch whose every row has stopped runs no further
    step."""
    model = varied_gpt(positional, context_length)
    expected = one_at_a_time(model, BATCH_PROMPTS, 12)
    stop = min((row.index(t), t) for row in expected for t in row if any(t not in other for other in expected))[1]
    want = cut_after(expected, stop)
    first = next(r for r, row in enumerate(want) if row[-1] == stop and len(row) < 12)
    assert any(len(row) == 12 and stop not in row for row in want)
    for pad_id in (0, stop, 10):
        assert generate_batch(model, BATCH_PROMPTS, 12, greedy=True, stop_id=stop, pad_id=pad_id) == want
    assert generate_batch(model, BATCH_PROMPTS, 12, greedy=True, stop_id=stop, use_cache=False) == want
    calls = []
    handle = model.token_embedding.register_forward_hook(lambda *args: calls.append(1))
    assert generate_batch(model, [BATCH_PROMPTS[first]], 12, greedy=True, stop_id=stop) == [want[first]]
    handle.remove()
    assert len(calls) == len(want[first]) < 12


def test_generate_batch_takes_tensors_returns_lists_and_restores_the_training_flag():
    model = varied_gpt("rope", context_length=24)
    model.train()
    got = generate_batch(model, [torch.tensor(p) for p in BATCH_PROMPTS], 5, greedy=True)
    assert model.training
    assert got == one_at_a_time(model, BATCH_PROMPTS, 5) and all(type(t) is int for row in got for t in row)
    assert generate_batch(model, BATCH_PROMPTS, 0) == [[], [], []]


def test_generate_batch_samples_a_single_prompt_as_generate_does():
    model = varied_gpt("alibi", context_length=8)
    prompt = BATCH_PROMPTS[1]
    for kwargs in ({}, {"temperature": 1.5, "top_k": 6, "top_p": 0.9}):
        got = generate_batch(model, [prompt], 14, generator=torch.Generator().manual_seed(4), **kwargs)
        alone = generate(model, torch.tensor([prompt]), 14, generator=torch.Generator().manual_seed(4), **kwargs)
        assert got == [alone[0, len(prompt):].tolist()]
    a, b = (generate_batch(model, BATCH_PROMPTS, 10, generator=torch.Generator().manual_seed(5)) for _ in range(2))
    assert a == b


def test_generate_batch_samples_each_row_from_its_own_distribution():
    """4000 rows, copies of a short and a long prompt, one token each: each prompt's frequencies follow its own
    next-token probabilities (computed alone), which differ from the other's."""
    model = varied_gpt("learned", context_length=24)
    short, long = BATCH_PROMPTS[1], BATCH_PROMPTS[2]
    got = torch.tensor(generate_batch(model, [short, long] * 2000, 1, generator=torch.Generator().manual_seed(6)))
    with torch.no_grad():
        probs = [torch.softmax(model(torch.tensor([p]))[0][0, -1], -1) for p in (short, long)]
    for rows, p in ((got[0::2, 0], probs[0]), (got[1::2, 0], probs[1])):
        freq = torch.bincount(rows, minlength=64).double() / len(rows)
        assert (freq - p).abs().max() < 0.04  # 2000 draws: standard error at most 0.011
    assert (probs[0] - probs[1]).abs().max() > 0.2


@pytest.mark.parametrize("prompts, kwargs, error, match", [
    ([], {}, ValueError, "prompts is empty"),
    ([[1], []], {}, ValueError, r"prompts\[1\] is empty"),
    ([[1, 11]], {}, ValueError, r"prompts\[0\] holds token id 11, outside the vocabulary.*\[0, 10\]"),
    ([[3], [-1]], {}, ValueError, r"prompts\[1\] holds token id -1"),
    (torch.tensor([[1, 2]]), {}, TypeError, "prompts must be a list .*use generate"),
    ([[1.0]], {}, TypeError, r"prompts\[0\] must be a list of int token ids"),
    ([torch.tensor([1.0])], {}, TypeError, r"prompts\[0\] must be a 1-D integer tensor"),
    ([[1]], {"stop_id": 11}, ValueError, r"stop_id must be a token id in \[0, vocab_size - 1\] = \[0, 10\]"),
    ([[1]], {"pad_id": -1}, ValueError, "pad_id must be a token id"),
    ([[1]], {"pad_id": None}, ValueError, "pad_id must be a token id"),
    ([[1]], {"temperature": 0}, ValueError, "temperature must be a finite number > 0"),
    ([[1]], {"top_k": 0}, ValueError, "top_k must be an integer >= 1"),
    ([[1]], {"top_p": 1.5}, ValueError, r"top_p must be a number in \(0, 1\]"),
    ([[1]], {"greedy": 1}, TypeError, "greedy must be True or False"),
])
def test_generate_batch_rejects_bad_arguments(prompts, kwargs, error, match):
    with pytest.raises(error, match=match):
        generate_batch(small_gpt(), prompts, 2, **kwargs)


def test_generate_batch_rejects_bad_models_and_lengths():
    with pytest.raises(ValueError, match="max_new_tokens must be an integer >= 0"):
        generate_batch(small_gpt(), [[1]], -1)
    with pytest.raises(TypeError, match="takes no attention_mask"):
        generate_batch(FixedLogits([0.0, 1.0]), [[1]], 2)
    with pytest.raises(TypeError, match="not a generator"):
        generate_batch(MaskedLM(MaskedLMConfig(vocab_size=11, context_length=8, d_model=16, n_layers=1, n_heads=2)),
                       [[1]], 2)

# ---- beam_search ------------------------------------------------------------------------------------------


class TableModel(nn.Module):
    """A stand-in GPT whose next-token log-probabilities depend on the last two tokens through a fixed table."""

    def __init__(self, vocab_size=3, seed=0, context_length=16):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        table = torch.randn(vocab_size, vocab_size, vocab_size, generator=g, dtype=torch.float64) * 2
        self.table = nn.Parameter(torch.log_softmax(table, dim=-1), requires_grad=False)
        self.config = GPTConfig(vocab_size=vocab_size, context_length=context_length, d_model=2, n_layers=1,
                                n_heads=1)

    def new_cache(self):
        return [KVCache()]

    def forward(self, idx, targets=None, *, cache=None):
        prev = torch.cat([idx[:, :1], idx[:, :-1]], dim=1)  # the first position's "previous" is itself
        return self.table[prev, idx], None


def brute_force_best(model, prompt, n):
    """Every continuation of length n scored by the model's summed log-probabilities: (best ids, its score)."""
    import itertools

    best, best_score = None, -math.inf
    for cont in itertools.product(range(model.config.vocab_size), repeat=n):
        seq = torch.tensor([prompt + list(cont)])
        score = sequence_log_prob(model, seq, len(prompt))
        if score > best_score:
            best, best_score = seq, score
    return best, best_score


def sequence_log_prob(model, seq, n_prompt):
    """sum_t log P(seq[t] | seq[:t]) over the continuation, from one full forward pass."""
    with torch.no_grad():
        logits, _ = model(seq)
    logp = torch.log_softmax(logits.double(), dim=-1)[0, n_prompt - 1:-1]
    return float(logp.gather(-1, seq[0, n_prompt:, None]).sum())


@pytest.mark.parametrize("use_cache", [True, False])
def test_beam_width_1_is_greedy_token_for_token_also_past_the_context(use_cache):
    model = small_gpt(context_length=6)
    idx = torch.tensor([[1, 2, 3], [4, 5, 0]])
    got = beam_search(model, idx, 9, beam_width=1, use_cache=use_cache)
    assert torch.equal(got, reference_greedy(model, idx, 9))
    assert torch.equal(got, generate(model, idx, 9, greedy=True))


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_a_wide_beam_finds_the_most_probable_sequence_by_brute_force(seed):
    model = TableModel(vocab_size=3, seed=seed)
    best, best_score = brute_force_best(model, [0], 4)
    got, score = beam_search(model, torch.tensor([[0]]), 4, beam_width=27, return_scores=True)
    assert torch.equal(got, best)
    assert float(score[0]) == pytest.approx(best_score, abs=1e-12)
    narrow, narrow_score = beam_search(model, torch.tensor([[0]]), 4, beam_width=2, return_scores=True)
    assert float(narrow_score[0]) <= best_score + 1e-12


def test_beam_search_beats_greedy_on_a_hand_set_distribution():
    """After token 0, token 1 is likelier (0.6) than 2 (0.4), but 1 is followed by a flat distribution over 3
    tokens (best 1/3) while 2 is followed by 0 with probability 0.9: 0.6/3 = 0.2 < 0.4 * 0.9 = 0.36."""
    probs = torch.full((3, 3, 3), 1 / 3, dtype=torch.float64)
    probs[:, 0] = torch.tensor([0.0, 0.6, 0.4], dtype=torch.float64)
    probs[:, 2] = torch.tensor([0.9, 0.05, 0.05], dtype=torch.float64)
    model = TableModel(vocab_size=3)
    model.table.data = probs.log()
    greedy = beam_search(model, torch.tensor([[0]]), 2, beam_width=1)
    assert greedy[0, 1:].tolist() == [1, 0]
    got, score = beam_search(model, torch.tensor([[0]]), 2, beam_width=2, return_scores=True)
    assert got[0, 1:].tolist() == [2, 0]
    assert float(score[0]) == pytest.approx(math.log(0.36), abs=1e-12)


@pytest.mark.parametrize("use_cache", [True, False])
def test_beam_scores_are_the_models_summed_log_probabilities_and_the_cache_changes_nothing(use_cache):
    model = small_gpt(context_length=6, positional="rope")
    idx = torch.tensor([[1, 2, 3], [7, 7, 0]])
    got, scores = beam_search(model, idx, 3, beam_width=4, return_scores=True, use_cache=use_cache)
    for row in range(2):
        assert float(scores[row]) == pytest.approx(sequence_log_prob(model, got[row:row + 1], 3), abs=1e-9)
        alone = beam_search(model, idx[row:row + 1], 3, beam_width=4)
        assert torch.equal(alone[0], got[row])  # a batch searches each row as if alone
    greedy = generate(model, idx, 3, greedy=True)
    for row in range(2):
        assert float(scores[row]) >= sequence_log_prob(model, greedy[row:row + 1], 3) - 1e-9
    other = beam_search(model, idx, 3, beam_width=4, use_cache=not use_cache)
    assert torch.equal(got, other)


def test_beam_search_with_an_end_token_stops_the_hypothesis_and_pads_it():
    """Token 2 is the end token. From 0, ending at once has probability 0.5 and 1 then the end 0.5 * 0.9 = 0.45:
    ranked by probability the short one wins; by log-probability per token (length_penalty=1) the long one does,
    log(0.45) / 2 = -0.40 > log(0.5) / 1 = -0.69. A finished hypothesis is padded with the end token."""
    probs = torch.full((3, 3, 3), 1 / 3, dtype=torch.float64)
    probs[:, 0] = torch.tensor([0.0, 0.5, 0.5], dtype=torch.float64)  # after 0: 1 or the end
    probs[:, 1] = torch.tensor([0.0, 0.1, 0.9], dtype=torch.float64)  # after 1: mostly the end
    model = TableModel(vocab_size=3)
    model.table.data = probs.log()
    got, score = beam_search(model, torch.tensor([[0]]), 4, beam_width=3, end_id=2, return_scores=True)
    assert got[0].tolist() == [0, 2, 2, 2, 2]
    assert float(score[0]) == pytest.approx(math.log(0.5), abs=1e-12)
    got, score = beam_search(model, torch.tensor([[0]]), 4, beam_width=3, end_id=2, length_penalty=1.0,
                             return_scores=True)
    assert got[0].tolist() == [0, 1, 2, 2, 2]
    assert float(score[0]) == pytest.approx(math.log(0.45), abs=1e-12)


@pytest.mark.parametrize("kwargs, match", [
    ({"beam_width": 0}, "beam_width must be an integer >= 1"),
    ({"beam_width": 2.0}, "beam_width must be an integer >= 1"),
    ({"length_penalty": -1.0}, "length_penalty must be a finite number >= 0"),
    ({"end_id": 11}, "end_id must be a token id"),
])
def test_beam_search_rejects_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        beam_search(small_gpt(), torch.tensor([[1]]), 2, **kwargs)


def test_beam_search_restores_the_training_flag():
    model = small_gpt()
    model.train()
    beam_search(model, torch.tensor([[1, 2]]), 2)
    assert model.training


# ---- beam_search against transformers' generate(num_beams=...) ----------------------------------------------

HF_VOCAB, HF_NEW = 64, 8


@pytest.fixture(scope="module")
def gpt2_pair(tmp_path_factory):
    """transformers' GPT2LMHeadModel with random weights large enough for peaked distributions (init 0.3, not
    0.02: the most probable next token has about 0.1-0.3 instead of about 1/64), and the same checkpoint loaded
    into the book's GPT by groundup.pretrained.load_gpt2."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("safetensors")
    from groundup.pretrained import load_gpt2

    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=HF_VOCAB, n_positions=64, n_embd=32, n_layer=2, n_head=2,
                                     initializer_range=0.3, bos_token_id=None, eos_token_id=None)
    hf = transformers.GPT2LMHeadModel(config).eval()
    hf.generation_config.pad_token_id = 0
    hf.generation_config.eos_token_id = None  # no end token unless a test passes one
    folder = tmp_path_factory.mktemp("gpt2_beam")
    hf.save_pretrained(folder)
    ours, _ = load_gpt2(folder, tokenizer=False)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, HF_VOCAB, (1, n), generator=g) for n in (1, 3, 5)]
    return ours, hf, prompts


def hf_beam(hf, prompt, width, *, n=HF_NEW, length_penalty=0.0, end_id=None, early_stopping=False):
    """transformers' deterministic beam search: (tokens, sequences_scores[0] or None for width 1, i.e. greedy)."""
    kwargs = {} if width == 1 else {"length_penalty": length_penalty, "early_stopping": early_stopping}
    with torch.no_grad():
        out = hf.generate(prompt, attention_mask=torch.ones_like(prompt), num_beams=width, max_new_tokens=n,
                          do_sample=False, num_return_sequences=1, eos_token_id=end_id, output_scores=True,
                          return_dict_in_generate=True, **kwargs)
    return out.sequences, (None if width == 1 else float(out.sequences_scores[0]))


def recording_beams(monkeypatch):
    """Make beam_search record, after every step, the last token of each surviving hypothesis, best-ranked first."""
    import groundup.generation as generation

    steps, step = [], generation.beam_step

    def recorded(*args, **kwargs):
        result = step(*args, **kwargs)
        token, scores = result[1], result[2]
        steps.append(token[0, scores[0].argsort(descending=True)].tolist())
        return result

    monkeypatch.setattr(generation, "beam_step", recorded)
    return steps


def test_beam_search_matches_transformers_without_an_end_token(gpt2_pair):
    """Widths 1-8, three prompts: the same tokens as generate(num_beams=k, do_sample=False), and the same score:
    transformers' sequences_scores is log P / n^length_penalty with n the number of new tokens."""
    ours, hf, prompts = gpt2_pair
    differs_from_greedy = 0
    for prompt in prompts:
        greedy = generate(ours, prompt, HF_NEW, greedy=True)
        for width in range(1, 9):
            got, score = beam_search(ours, prompt, HF_NEW, beam_width=width, return_scores=True)
            theirs, their_score = hf_beam(hf, prompt, width)
            assert torch.equal(got, theirs), (prompt.tolist(), width)
            differs_from_greedy += not torch.equal(got, greedy)
            if width > 1:
                assert float(score[0]) == pytest.approx(their_score, abs=1e-5)  # transformers sums in float32
            if width in (2, 5):  # the penalty only rescales the score when every hypothesis has n tokens
                for penalty in (1.0, 2.0):
                    got_p, score_p = beam_search(ours, prompt, HF_NEW, beam_width=width, length_penalty=penalty,
                                                 return_scores=True, use_cache=penalty == 1.0)
                    theirs_p, their_score_p = hf_beam(hf, prompt, width, length_penalty=penalty)
                    assert torch.equal(got_p, got) and torch.equal(theirs_p, got)
                    assert float(score_p[0]) / HF_NEW ** penalty == pytest.approx(their_score_p, abs=1e-5)
    assert differs_from_greedy >= 6  # the beams are not all greedy decoding in disguise (13 of 21 here)


def test_beam_search_with_an_end_token_matches_transformers_where_the_two_must_agree(gpt2_pair, monkeypatch):
    """With an end token the two searches differ in general (see beam_search's docstring); they must agree when
    no hypothesis in the beam ends with it before the last step and at the last step only the best one may: the
    search is then the one without an end token, and both return its best hypothesis (the book because it is
    finished or none is, transformers because max_new_tokens stops every hypothesis). Widths 1-6,
    length_penalty 0, 1, 2. Beam search is the same up to step j whatever max_new_tokens is, so the end token is
    one that first enters the beam at step j as its best hypothesis alone, with max_new_tokens = j (the latest
    such step); else a token no hypothesis ends with over HF_NEW steps."""
    ours, hf, prompts = gpt2_pair
    reached = 0
    for prompt in prompts:
        for width in range(1, 7):
            steps = recording_beams(monkeypatch)
            beam_search(ours, prompt, HF_NEW, beam_width=width)
            monkeypatch.undo()
            first = {}  # token -> (step, rank) where a hypothesis first ends with it
            for j, step in enumerate(steps):
                for rank, t in enumerate(step):
                    first.setdefault(t, (j, rank))
            alone = [(j + 1, t) for t, (j, rank) in first.items() if rank == 0 and t not in steps[j][1:]]
            n, end_id = max(alone) if alone else (HF_NEW, min(set(range(HF_VOCAB)) - set(first)))
            reached += bool(alone) and n > 1
            plain = beam_search(ours, prompt, n, beam_width=width)
            assert bool(alone) == (int(plain[0, -1]) == end_id)
            for penalty in (0.0, 1.0, 2.0):
                got, score = beam_search(ours, prompt, n, beam_width=width, length_penalty=penalty, end_id=end_id,
                                         return_scores=True)
                theirs, their_score = hf_beam(hf, prompt, width, n=n, length_penalty=penalty, end_id=end_id)
                assert torch.equal(got, plain) and torch.equal(theirs, plain), (prompt.tolist(), width, penalty)
                if width > 1:
                    assert float(score[0]) / n ** penalty == pytest.approx(their_score, abs=1e-5)  # float32 sums
    assert reached >= 10  # most cases (13 of 18) end with the end token, reached by the winner alone after 2+ steps


def test_generate_batch_matches_transformers_on_left_padded_prompts(gpt2_pair):
    """transformers' generate(input_ids, attention_mask, do_sample=False) on the same left-padded batch of a random
    GPT-2 (it derives the positions from the mask as cumsum - 1) gives the same new tokens, without an end token and
    with one that some rows emit (transformers pads a finished row with pad_token_id)."""
    ours, hf, _ = gpt2_pair
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, HF_VOCAB, (n,), generator=g).tolist() for n in (1, 5, 12, 3)]
    width = max(map(len, prompts))
    idx = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(idx)
    for row, p in enumerate(prompts):
        idx[row, width - len(p):], mask[row, width - len(p):] = torch.tensor(p), 1

    def theirs(end_id=None):
        with torch.no_grad():
            out = hf.generate(idx, attention_mask=mask, max_new_tokens=HF_NEW, do_sample=False, pad_token_id=0,
                              eos_token_id=end_id)
        return cut_after(out[:, width:].tolist(), end_id) if end_id is not None else out[:, width:].tolist()

    plain = theirs()
    assert generate_batch(ours, prompts, HF_NEW, greedy=True) == plain
    assert plain == [generate(ours, torch.tensor([p]), HF_NEW, greedy=True)[0, len(p):].tolist() for p in prompts]
    stop = next(t for t in plain[1][1:] if any(t not in row for row in plain))
    stopped = theirs(stop)
    assert generate_batch(ours, prompts, HF_NEW, greedy=True, stop_id=stop, pad_id=3) == stopped
    assert stopped == cut_after(plain, stop) and any(len(row) < HF_NEW for row in stopped)
