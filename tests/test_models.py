"""Tests for groundup.models: GPTConfig validation, GPT's forward pass, causality, loss, parameter count."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch_reference import encoder_layer_like

from groundup.layers import LayerNorm, RMSNorm
from groundup.models import GPT, POSITIONALS, GPTConfig

SMALL = dict(vocab_size=37, context_length=16, d_model=32, n_layers=2, n_heads=4)


def small(**kw) -> GPTConfig:
    return GPTConfig(**{**SMALL, **kw})


def formula_count(c: GPTConfig) -> int:
    """Parameter count by the chapter's formula, written independently of the model code."""
    d, f, V, C, H = c.d_model, c.d_ff, c.vocab_size, c.context_length, c.n_heads
    norm = 2 * d if c.norm == "layernorm" else d
    per_block = 4 * (d * d + d) + (d * f + f) + (f * d + d) + 2 * norm
    total = V * d + c.n_layers * per_block
    total += {"learned": C * d, "relative": H * (C + 1)}.get(c.positional, 0)
    total += norm if c.norm_position == "pre" else 0
    total += 0 if c.tie_weights else V * d
    return total


# ---- GPTConfig -------------------------------------------------------------------------------------------


def test_config_defaults_and_d_ff():
    c = GPTConfig()
    assert c.d_ff == 4 * c.d_model and c.d_head == c.d_model // c.n_heads
    assert (c.positional, c.norm, c.norm_position, c.tie_weights) == ("learned", "layernorm", "pre", True)
    assert GPTConfig(d_model=64, d_ff=128).d_ff == 128


@pytest.mark.parametrize("kw,match", [
    (dict(d_model=30, n_heads=4), r"d_model \(30\) must be divisible by n_heads \(4\)"),
    (dict(positional="absolute"), "positional must be one of"),
    (dict(norm="batchnorm"), "norm must be one of"),
    (dict(norm_position="sandwich"), "norm_position must be one of"),
    (dict(dropout=1.0), r"dropout must be a number in \[0, 1\)"),
    (dict(n_layers=0), "n_layers must be a positive integer"),
    (dict(vocab_size=2.5), "vocab_size must be a positive integer"),
    (dict(tie_weights="yes"), "tie_weights must be True or False"),
    (dict(d_model=12, n_heads=4, positional="rope"), "needs an even d_head"),
])
def test_config_validation(kw, match):
    with pytest.raises(ValueError, match=match):
        small(**kw)


# ---- GPT forward -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("positional", POSITIONALS)
def test_forward_shapes_and_loss_none(positional):
    torch.manual_seed(0)
    model = GPT(small(positional=positional))
    idx = torch.randint(0, 37, (3, 9))
    logits, loss = model(idx)
    assert logits.shape == (3, 9, 37) and loss is None


@pytest.mark.parametrize("positional", POSITIONALS)
@pytest.mark.parametrize("norm_position", ["pre", "post"])
def test_causality_future_token_never_changes_earlier_logits(positional, norm_position):
    torch.manual_seed(0)
    model = GPT(small(positional=positional, norm_position=norm_position)).eval()
    if positional == "relative":  # the bias starts at 0; give it values so it matters
        with torch.no_grad():
            model.relative_bias.bias.normal_()
    idx = torch.randint(0, 37, (2, 12))
    changed = idx.clone()
    changed[:, 7] = (changed[:, 7] + 1) % 37
    a, _ = model(idx)
    b, _ = model(changed)
    torch.testing.assert_close(a[:, :7], b[:, :7], atol=1e-5, rtol=0)
    assert (a[:, 7:] - b[:, 7:]).abs().max() > 1e-4  # ... but does change that position and later ones


def test_positional_none_one_layer_cannot_see_order_of_earlier_tokens():
    # Without positions, one block's output at the last position depends only on the *multiset* of tokens
    # it attends to (attention is a weighted sum): swapping two earlier tokens leaves those logits unchanged.
    torch.manual_seed(0)
    model = GPT(small(positional="none", n_layers=1)).eval()
    idx = torch.tensor([[1, 2, 3, 4, 5]])
    swapped = torch.tensor([[2, 1, 3, 4, 5]])
    torch.testing.assert_close(model(idx)[0][0, -1], model(swapped)[0][0, -1], atol=1e-5, rtol=0)
    learned = GPT(small(positional="learned", n_layers=1)).eval()
    assert not torch.allclose(learned(idx)[0][0, -1], learned(swapped)[0][0, -1], atol=1e-5)


def test_loss_at_initialisation_is_close_to_ln_vocab_size():
    torch.manual_seed(0)
    c = GPTConfig(vocab_size=65, context_length=32, d_model=64, n_layers=4, n_heads=4)
    idx = torch.randint(0, 65, (8, 32))
    _, loss = GPT(c)(idx, torch.roll(idx, -1, dims=1))
    assert abs(loss.item() - math.log(65)) < 0.05


def test_untied_loss_at_initialisation_is_ln_vocab_plus_half_logit_variance():
    # Untied, the unembedding has entries N(0, 1/d_model) (chapter 3): logits have variance ≈ 1 and
    # E[loss] ≈ ln n_V + 1/2 (the log-sum-exp of n_V Gaussians of variance s² is ≈ ln n_V + s²/2).
    torch.manual_seed(0)
    c = GPTConfig(vocab_size=65, context_length=32, d_model=64, n_layers=4, n_heads=4, tie_weights=False)
    idx = torch.randint(0, 65, (8, 32))
    _, loss = GPT(c)(idx, torch.roll(idx, -1, dims=1))
    assert abs(loss.item() - (math.log(65) + 0.5)) < 0.2


def test_loss_is_mean_cross_entropy_of_logits():
    torch.manual_seed(0)
    model = GPT(small())
    idx, targets = torch.randint(0, 37, (2, 10)), torch.randint(0, 37, (2, 10))
    logits, loss = model(idx, targets)
    log_probs = logits.log_softmax(-1)
    manual = -log_probs.gather(-1, targets[..., None]).mean()
    torch.testing.assert_close(loss, manual)
    torch.testing.assert_close(loss, F.cross_entropy(logits.transpose(1, 2), targets))


def test_weight_tying_shares_one_parameter():
    model = GPT(small(tie_weights=True))
    assert model.unembedding.weight is model.token_embedding.weight
    untied = GPT(small(tie_weights=False))
    assert untied.unembedding.weight is not untied.token_embedding.weight


@pytest.mark.parametrize("seed", [0, 1])
def test_untied_token_embedding_starts_small_like_the_tied_one(seed):
    # chapter 3's runs: rows at RMS 1 end no better than N(0, 0.02^2), so tied or not W_E starts at 0.02
    shape = dict(vocab_size=256, context_length=16, d_model=64, n_layers=1, n_heads=4)
    torch.manual_seed(seed)
    tied = GPT(GPTConfig(**shape))
    torch.manual_seed(seed)
    untied = GPT(GPTConfig(**shape, tie_weights=False))
    w = untied.token_embedding.weight
    assert untied.token_embedding.init == "small"
    torch.testing.assert_close(w, tied.token_embedding.weight, rtol=0, atol=0)  # the same first draw
    # the first draw after the seed, written independently: 0.02 times standard normals
    torch.testing.assert_close(w, 0.02 * torch.randn(256, 64, generator=torch.Generator().manual_seed(seed)))
    assert abs(w.std().item() - 0.02) < 0.001 and abs(w.mean().item()) < 0.001  # 16,384 entries
    # the untied unembedding keeps its own N(0, 1/d_model)
    assert abs(untied.unembedding.weight.std().item() * math.sqrt(64) - 1) < 0.05


def test_encoder_decoder_target_embedding_starts_small_tied_or_not():
    from groundup.models import EncoderDecoder, EncoderDecoderConfig

    for tie in (True, False):
        torch.manual_seed(0)
        m = EncoderDecoder(EncoderDecoderConfig(src_vocab_size=200, tgt_vocab_size=300, d_model=64,
                                                tie_weights=tie))
        assert abs(m.tgt_embedding.weight.std().item() - 0.02) < 0.001
        row_rms = m.src_embedding.weight.pow(2).mean(dim=1).sqrt()  # the source keeps rows at RMS 1
        torch.testing.assert_close(row_rms, torch.ones(200))


def test_an_rms_start_is_still_one_call_away():
    from groundup.embeddings import TokenEmbedding

    assert TokenEmbedding(5, 3).init == "rms"  # chapter 3's module keeps its derivation's default
    torch.manual_seed(0)
    model = GPT(small(tie_weights=False))
    model.token_embedding.init = "rms"
    model.token_embedding.reset_parameters()
    row_rms = model.token_embedding.weight.pow(2).mean(dim=1).sqrt()
    torch.testing.assert_close(row_rms, torch.ones(SMALL["vocab_size"]))
    assert not torch.allclose(row_rms, torch.full_like(row_rms, 0.02), atol=0.01)


@pytest.mark.parametrize("kw", [
    {}, dict(tie_weights=False), dict(norm="rmsnorm"), dict(norm_position="post"), dict(positional="relative"),
    dict(positional="rope", norm="rmsnorm"), dict(positional="sinusoidal"), dict(positional="alibi", d_ff=50),
])
def test_parameter_count_matches_formula(kw):
    c = small(**kw)
    assert sum(p.numel() for p in GPT(c).parameters()) == formula_count(c)


def test_norm_choices_and_final_norm():
    assert isinstance(GPT(small()).final_norm, LayerNorm)
    assert isinstance(GPT(small(norm="rmsnorm")).final_norm, RMSNorm)
    assert isinstance(GPT(small(norm_position="post")).final_norm, nn.Identity)


def test_residual_projections_are_scaled_at_init():
    torch.manual_seed(0)
    model = GPT(GPTConfig(d_model=128, n_layers=8, n_heads=4, vocab_size=50))
    w_in = torch.cat([b.ffn.W_in.weight.flatten() for b in model.blocks])
    w_out = torch.cat([b.ffn.W_out.weight.flatten() for b in model.blocks])
    assert abs(w_in.std().item() - 0.02) < 0.001
    assert abs(w_out.std().item() - 0.02 / math.sqrt(16)) < 0.0005


# ---- errors ----------------------------------------------------------------------------------------------


def test_too_long_input_names_both_numbers():
    model = GPT(small())
    with pytest.raises(ValueError, match="sequence length 17.*context_length 16"):
        model(torch.zeros(1, 17, dtype=torch.long))


def test_bad_idx():
    model = GPT(small())
    with pytest.raises(TypeError, match="idx must hold integer token ids"):
        model(torch.zeros(1, 4))
    with pytest.raises(TypeError, match="idx must be a torch.Tensor"):
        model([[1, 2, 3]])
    with pytest.raises(ValueError, match=r"idx must have shape \(batch, seq\)"):
        model(torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match=r"targets must have the same shape as idx \(1, 4\)"):
        model(torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 3, dtype=torch.long))
    with pytest.raises(TypeError, match="config must be a GPTConfig"):
        GPT(dict(SMALL))


# ---- KV cache (used by chapter 8) ------------------------------------------------------------------------


@pytest.mark.parametrize("positional", POSITIONALS)
def test_cached_forward_equals_full_forward(positional):
    torch.manual_seed(0)
    model = GPT(small(positional=positional)).eval()
    if positional == "relative":
        with torch.no_grad():
            model.relative_bias.bias.normal_()
    idx = torch.randint(0, 37, (2, 10))
    full, _ = model(idx)
    cache = model.new_cache()
    first, _ = model(idx[:, :6], cache=cache)
    steps = [model(idx[:, t:t + 1], cache=cache)[0] for t in range(6, 10)]
    torch.testing.assert_close(torch.cat([first, *steps], dim=1), full, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match=r"sequence length 17 \(7 new tokens after 10 cached\).*16"):
        model(idx[:, :7], cache=cache)


# ---- attention_mask: left-padded batches (chapter 8's batched generation) -----------------------------------


def random_gpt(positional, cls=GPT, config_cls=GPTConfig, **kw):
    """A float64 model whose every weight is N(0, 0.5²) (peaked, position-sensitive outputs; the relative bias too)."""
    torch.manual_seed(0)
    model = cls(config_cls(**{**SMALL, "positional": positional, **kw})).double().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, 0.5)
    return model


def left_padded(prompts, pad_id=0):
    width = max(map(len, prompts))
    idx = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for row, p in enumerate(prompts):
        idx[row, width - len(p):], mask[row, width - len(p):] = torch.tensor(p), 1
    return idx, mask


PROMPTS = [[5], [3, 1, 4, 1, 5], [9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3]]


@pytest.mark.parametrize("use_cache", [False, True])
@pytest.mark.parametrize("positional", POSITIONALS)
def test_padded_forward_gives_each_row_its_logits_alone(positional, use_cache):
    """Left-padded rows with an attention mask: on the real positions the logits equal the row's own unpadded
    forward (float64, 1e-10), in every positional family, in one pass or prefill + one token at a time with the
    KV cache (the mask covering cached and new keys); the pads' logits are finite."""
    model = random_gpt(positional)
    idx, mask = left_padded(PROMPTS, pad_id=7)
    with torch.no_grad():
        if use_cache:
            cache = model.new_cache()
            parts = [model(idx[:, :6], cache=cache, attention_mask=mask[:, :6])[0]]
            parts += [model(idx[:, t:t + 1], cache=cache, attention_mask=mask[:, :t + 1])[0]
                      for t in range(6, idx.shape[1])]
            logits = torch.cat(parts, dim=1)
        else:
            logits, _ = model(idx, attention_mask=mask)
        assert torch.isfinite(logits).all()
        for row, prompt in enumerate(PROMPTS):
            alone, _ = model(torch.tensor([prompt]))
            torch.testing.assert_close(logits[row, -len(prompt):], alone[0], rtol=0, atol=1e-10)
            if len(prompt) > 1:  # the positions' logits differ from one another (no constant output)
                assert not torch.allclose(logits[row, -len(prompt):], alone[0].roll(1, 0), atol=1e-3)


@pytest.mark.parametrize("positional", ["learned", "rope", "alibi", "relative"])
def test_without_the_mask_padding_would_change_the_rows(positional):
    """The test above can fail: the same padded batch without attention_mask gives other logits for short rows."""
    model = random_gpt(positional)
    idx, mask = left_padded(PROMPTS)
    with torch.no_grad():
        masked, _ = model(idx, attention_mask=mask)
        plain, _ = model(idx)
        ones, _ = model(idx, attention_mask=torch.ones_like(mask, dtype=torch.bool))
    assert (masked[1, -5:] - plain[1, -5:]).abs().max() > 0.1
    torch.testing.assert_close(masked[2], plain[2], rtol=0, atol=1e-10)  # the longest row has no padding
    torch.testing.assert_close(ones, plain, rtol=0, atol=1e-10)  # an all-ones mask changes nothing


@pytest.mark.parametrize("positional", POSITIONALS)
def test_padding_in_the_middle_is_skipped_by_positions_and_biases(positional):
    """Positions count real tokens, and ALiBi's and the relative bias's distances are differences of positions
    (not of columns): a row with pads between its tokens gives, at its real columns, the logits of the row
    without them. (Left padding alone cannot tell the two distances apart.)"""
    model = random_gpt(positional)
    idx = torch.tensor([[3, 0, 0, 1, 4, 0, 1, 5], [0, 0, 9, 2, 6, 0, 0, 0]])
    mask = torch.tensor([[1, 0, 0, 1, 1, 0, 1, 1], [0, 0, 1, 1, 1, 0, 0, 0]])
    with torch.no_grad():
        logits, _ = model(idx, attention_mask=mask)
        for row in range(2):
            alone, _ = model(idx[row][mask[row].bool()][None])
            torch.testing.assert_close(logits[row][mask[row].bool()], alone[0], rtol=0, atol=1e-10)


def test_a_row_of_padding_only_stays_finite_and_leaves_the_others_alone():
    model = random_gpt("rope")
    idx = torch.tensor([[1, 2, 3], [4, 5, 6]])
    with torch.no_grad():
        logits, _ = model(idx, attention_mask=torch.tensor([[0, 0, 0], [1, 1, 1]]))
        alone, _ = model(idx[1:])
    assert torch.isfinite(logits).all()
    torch.testing.assert_close(logits[1], alone[0], rtol=0, atol=1e-10)


def test_masked_lm_takes_an_attention_mask_on_either_side():
    from groundup.models import MaskedLM, MaskedLMConfig

    model = random_gpt("relative", cls=MaskedLM, config_cls=MaskedLMConfig)
    idx = torch.tensor([[3, 1, 4, 0, 0], [0, 2, 7, 1, 8]])
    with torch.no_grad():
        logits, _ = model(idx, attention_mask=torch.tensor([[1, 1, 1, 0, 0], [0, 1, 1, 1, 1]]))
        torch.testing.assert_close(logits[0, :3], model(idx[:1, :3])[0][0], rtol=0, atol=1e-10)
        torch.testing.assert_close(logits[1, 1:], model(idx[1:, 1:])[0][0], rtol=0, atol=1e-10)


def test_bad_attention_masks_name_the_argument_and_the_shape():
    model = GPT(small())
    idx = torch.zeros(2, 5, dtype=torch.long)
    with pytest.raises(TypeError, match=r"attention_mask must be a bool or 0/1 integer .*\(2, 5\).*list"):
        model(idx, attention_mask=[[1] * 5] * 2)
    with pytest.raises(TypeError, match="attention_mask.*torch.float32"):
        model(idx, attention_mask=torch.ones(2, 5))
    with pytest.raises(ValueError, match=r"attention_mask must have shape \(batch, cached \+ new tokens\) = "
                                         r"\(2, 5\), got \(2, 4\)"):
        model(idx, attention_mask=torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"attention_mask must hold 0 \(padding\) and 1 .*\[2\]"):
        model(idx, attention_mask=torch.full((2, 5), 2))
    cache = model.new_cache()
    model(idx, cache=cache, attention_mask=torch.ones(2, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"= \(2, 6\), got \(2, 1\)"):  # the cached keys need their mask too
        model(idx[:, :1], cache=cache, attention_mask=torch.ones(2, 1, dtype=torch.bool))


def test_gpt_matches_a_model_built_from_torch_builtins():
    # Pre-LN GPT with learned positions = nn.Embedding + nn.TransformerEncoderLayer(norm_first) stack
    # + nn.LayerNorm + tied linear read-out, with the same weights.
    torch.manual_seed(0)
    c = small(d_ff=48)
    model = GPT(c).eval()
    layers = [encoder_layer_like(block, c.d_model, c.n_heads, c.d_ff, norm_first=True) for block in model.blocks]
    final = nn.LayerNorm(c.d_model)
    final.load_state_dict(model.final_norm.state_dict())
    idx = torch.randint(0, c.vocab_size, (2, 11))
    h = F.embedding(idx, model.token_embedding.weight) + model.position_embedding.weight[:11]
    mask = nn.Transformer.generate_square_subsequent_mask(11)
    for layer in layers:
        h = layer(h, src_mask=mask)
    expected = F.linear(final(h), model.token_embedding.weight)
    torch.testing.assert_close(model(idx)[0], expected, atol=1e-5, rtol=1e-5)


# ---- hardening: numerics and API traps ------------------------------------------------------------------


def _tiny(**kw):
    return GPTConfig(**{**dict(vocab_size=11, context_length=8, d_model=16, n_layers=2, n_heads=2), **kw})


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("positional,norm", [("learned", "layernorm"), ("rope", "rmsnorm"), ("alibi", "layernorm")])
def test_gpt_in_half_precision_stays_finite_and_close_to_float32(dtype, positional, norm):
    torch.manual_seed(0)
    model = GPT(_tiny(positional=positional, norm=norm, tie_weights=False))
    with torch.no_grad():
        model.token_embedding.weight.mul_(300.0)  # a stream around 300: x² overflows float16
    idx = torch.randint(0, 11, (2, 8))
    expected, _ = model(idx)
    half = GPT(model.config)
    half.load_state_dict(model.state_dict())
    logits, loss = half.to(dtype)(idx, idx)
    assert logits.dtype == dtype and torch.isfinite(logits).all() and torch.isfinite(loss)
    torch.testing.assert_close(logits.float(), expected, atol=0.1, rtol=0.05)
    assert torch.isfinite(GPT(model.config).half()(idx)[0]).all()


def test_gpt_rejects_bool_targets():
    model = GPT(_tiny())
    idx = torch.randint(0, 11, (2, 8))
    with pytest.raises(TypeError, match="targets must be an integer torch.Tensor of token ids, got torch.bool"):
        model(idx, idx > 5)


def test_gpt_rejects_targets_that_ignore_every_position():
    model = GPT(_tiny())
    idx = torch.randint(0, 11, (2, 8))
    with pytest.raises(ValueError, match="every target is -100"):
        model(idx, torch.full_like(idx, -100))
    targets = torch.full_like(idx, -100)
    targets[0, 0] = 3
    assert torch.isfinite(model(idx, targets)[1])


@pytest.mark.parametrize("bad", [11, -1, 300])
def test_gpt_targets_out_of_range_name_the_argument(bad):
    model = GPT(_tiny())
    idx = torch.randint(0, 11, (2, 8))
    targets = idx.clone()
    targets[1, 2] = bad
    with pytest.raises(ValueError, match=r"targets must lie in \[0, 10\] \(vocab_size=11\) or be -100"):
        model(idx, targets)


def test_gpt_accepts_small_integer_dtypes_and_numpy_sizes():
    np = pytest.importorskip("numpy")
    config = _tiny(d_model=np.int64(16), n_heads=np.int32(2), context_length=np.int64(8))
    assert type(config.d_model) is int and config.d_head == 8
    torch.manual_seed(0)
    model = GPT(config)
    idx = torch.randint(0, 11, (2, 8))
    logits, loss = model(idx, idx)
    for dtype in (torch.int16, torch.int32, torch.uint8):
        other, other_loss = model(idx.to(dtype), idx.to(dtype))
        assert torch.equal(other, logits) and torch.equal(other_loss, loss)


def test_gpt_config_rejects_zero_heads_and_string_dropout():
    with pytest.raises(ValueError, match="n_heads must be a positive integer, got 0"):
        _tiny(n_heads=0)
    with pytest.raises(ValueError, match=r"dropout must be a number in \[0, 1\), got '0.1'"):
        _tiny(dropout="0.1")


# --- modern block options in GPTConfig ----------------------------------------------------------------------

def test_llama_style_gpt_builds_runs_and_generates_with_cache():
    from groundup.generation import generate

    for tie in (False, True):
        torch.manual_seed(0)
        c = GPTConfig(vocab_size=50, context_length=16, d_model=32, n_layers=2, n_heads=4, d_ff=88,
                      norm="rmsnorm", activation="swiglu", positional="rope", rope_pairing="half",
                      rope_base=500000.0, n_kv_heads=2, bias=False, tie_weights=tie, norm_eps=1e-5, qk_norm=True)
        m = GPT(c).double().eval()
        assert not any(n.endswith("bias") for n, _ in m.named_parameters())
        assert m.blocks[0].attention.W_k.weight.shape == (16, 32)
        assert m.rotary.pairing == "half" and m.rotary.base == 500000.0
        assert m.final_norm.eps == 1e-5 and m.blocks[0].norm_1.eps == 1e-5
        idx = torch.randint(0, 50, (2, 5))
        logits, loss = m(idx, idx)
        assert logits.shape == (2, 5, 50) and torch.isfinite(loss)
        a = generate(m, idx, 8, greedy=True, use_cache=True)
        b = generate(m, idx, 8, greedy=True, use_cache=False)
        assert torch.equal(a, b)


def test_parallel_block_equals_closed_form():
    from groundup.attention import causal_mask
    from groundup.layers import TransformerBlock

    torch.manual_seed(1)
    c = GPTConfig(d_model=16, n_heads=2, parallel_block=True, activation="gelu_tanh")
    blk = TransformerBlock(c).double()
    assert not hasattr(blk, "norm_2")
    x = torch.randn(2, 4, 16, dtype=torch.float64)
    h = blk.norm_1(x)
    ref = x + blk.attention(h, mask=causal_mask(4)) + blk.ffn(h)
    torch.testing.assert_close(blk(x, mask=causal_mask(4)), ref, rtol=0, atol=1e-12)


def test_default_modern_fields_are_unchanged_behaviour():
    torch.manual_seed(2)
    m = GPT(GPTConfig(vocab_size=30, context_length=8, d_model=16, n_heads=2, n_layers=1))
    names = {n for n, _ in m.named_parameters()}
    assert "blocks.0.norm_2.weight" in names and "blocks.0.attention.W_k.bias" in names
    assert not any("W_gate" in n or "q_norm" in n for n in names)


@pytest.mark.parametrize("kwargs, match", [
    ({"activation": "tanh"}, "activation"), ({"bias": 1}, "bias"), ({"n_kv_heads": 3}, "n_kv_heads"),
    ({"qk_norm": "yes"}, "qk_norm"), ({"parallel_block": True, "norm_position": "post"}, "parallel_block"),
    ({"rope_pairing": "rotate"}, "rope_pairing"), ({"rope_base": 1.0}, "rope_base"), ({"norm_eps": 0}, "norm_eps"),
])
def test_gptconfig_modern_option_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GPTConfig(d_model=16, n_heads=4, **kwargs)
