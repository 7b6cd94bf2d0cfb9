"""groundup.attention against PyTorch's built-ins (F.scaled_dot_product_attention, nn.MultiheadAttention)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from groundup.attention import (
    KVCache,
    MultiHeadAttention,
    causal_mask,
    reusing_stacked_weights,
    scaled_dot_product_attention,
)


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _qkv(*batch, n_q=5, n_k=7, d_k=8, d_v=6, seed=0):
    g = _gen(seed)
    return (torch.randn(*batch, n_q, d_k, generator=g), torch.randn(*batch, n_k, d_k, generator=g),
            torch.randn(*batch, n_k, d_v, generator=g))


def _copy_to_torch(ours: MultiHeadAttention) -> nn.MultiheadAttention:
    """An nn.MultiheadAttention holding exactly our weights (its in_proj stacks W_q, W_k, W_v)."""
    ref = nn.MultiheadAttention(ours.d_model, ours.n_heads, batch_first=True, bias=ours.W_q.bias is not None)
    with torch.no_grad():
        ref.in_proj_weight.copy_(torch.cat([ours.W_q.weight, ours.W_k.weight, ours.W_v.weight]))
        ref.out_proj.weight.copy_(ours.W_o.weight)
        if ours.W_q.bias is not None:
            ref.in_proj_bias.copy_(torch.cat([ours.W_q.bias, ours.W_k.bias, ours.W_v.bias]))
            ref.out_proj.bias.copy_(ours.W_o.bias)
    return ref


# ---------------------------------------------------------------- causal_mask


def test_causal_mask_is_lower_triangle():
    m = causal_mask(4)
    assert m.dtype == torch.bool and m.shape == (4, 4)
    expected = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.bool)
    assert torch.equal(m, expected)


def test_causal_mask_with_cached_keys_is_bottom_right_aligned():
    m = causal_mask(2, n_keys=5)
    assert torch.equal(m, causal_mask(5)[3:])


@pytest.mark.parametrize("bad", [0, -1, 2.0, True])
def test_causal_mask_rejects_bad_n(bad):
    with pytest.raises(ValueError, match="n must be a positive integer"):
        causal_mask(bad)
    with pytest.raises(ValueError, match="n_keys must be an integer >= n"):
        causal_mask(3, n_keys=2)


# ---------------------------------------------------------------- scaled_dot_product_attention


def test_sdpa_matches_torch_without_mask():
    q, k, v = _qkv(2, 3)
    out, w = scaled_dot_product_attention(q, k, v)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v))
    assert w.shape == (2, 3, 5, 7)
    torch.testing.assert_close(w.sum(-1), torch.ones(2, 3, 5))


def test_sdpa_closed_form_on_tiny_example():
    # one query, two keys: scores (1*1, 1*-1)/sqrt(1) -> weights softmax([1, -1])
    q, k, v = torch.tensor([[1.0]]), torch.tensor([[1.0], [-1.0]]), torch.tensor([[10.0], [20.0]])
    out, w = scaled_dot_product_attention(q, k, v)
    p = torch.exp(torch.tensor(1.0)) / (torch.exp(torch.tensor(1.0)) + torch.exp(torch.tensor(-1.0)))
    torch.testing.assert_close(w, torch.stack([p, 1 - p]).view(1, 2))
    torch.testing.assert_close(out, (10 * p + 20 * (1 - p)).view(1, 1))


def test_sdpa_scales_by_sqrt_dk():
    q, k, v = _qkv(n_q=3, n_k=3, d_k=16)
    _, w = scaled_dot_product_attention(q, k, v)
    torch.testing.assert_close(w, torch.softmax(q @ k.T / 4.0, dim=-1))


def test_sdpa_matches_torch_with_causal_mask_and_masked_weights_are_exactly_zero():
    q, k, v = _qkv(2, n_q=6, n_k=6)
    m = causal_mask(6)
    out, w = scaled_dot_product_attention(q, k, v, mask=m)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, attn_mask=m))
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=True))
    assert (w[..., ~m] == 0).all()
    assert (w[..., m] > 0).all()


def test_sdpa_matches_torch_with_padding_mask_bias_and_both():
    q, k, v = _qkv(2, 3, n_q=4, n_k=5)
    pad = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)[:, None, None, :]  # (2,1,1,5)
    bias = torch.randn(3, 4, 5, generator=_gen(1))
    out, w = scaled_dot_product_attention(q, k, v, mask=pad)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, attn_mask=pad))
    assert (w[0, :, :, 3:] == 0).all()
    out, _ = scaled_dot_product_attention(q, k, v, bias=bias)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, attn_mask=bias))
    out, _ = scaled_dot_product_attention(q, k, v, mask=pad, bias=bias)
    combined = bias.masked_fill(~pad, float("-inf"))
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, attn_mask=combined))


def test_sdpa_fully_masked_row_gives_zero_weights_and_finite_gradients():
    q, k, v = (t.requires_grad_() for t in _qkv(n_q=2, n_k=3))
    mask = torch.tensor([[True, False, True], [False, False, False]])
    out, w = scaled_dot_product_attention(q, k, v, mask=mask)
    assert torch.equal(w[1], torch.zeros(3)) and torch.equal(out[1], torch.zeros(6))
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


def test_sdpa_gradients_match_torch():
    q, k, v = (t.requires_grad_() for t in _qkv(2, n_q=4, n_k=4))
    m = causal_mask(4)
    grads = torch.autograd.grad(scaled_dot_product_attention(q, k, v, mask=m)[0].square().sum(), (q, k, v))
    ref = torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, attn_mask=m).square().sum(), (q, k, v))
    for g, r in zip(grads, ref, strict=True):
        torch.testing.assert_close(g, r)


def test_sdpa_rejects_bad_inputs():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="same last dimension d_k"):
        scaled_dot_product_attention(q, k[:, :3], v)
    with pytest.raises(ValueError, match="same number of positions n_k"):
        scaled_dot_product_attention(q, k, v[:4])
    with pytest.raises(ValueError, match=r"q must have shape \(\.\.\., seq, dim\)"):
        scaled_dot_product_attention(q[0, 0], k, v)
    with pytest.raises(TypeError, match="mask must be a bool tensor"):
        scaled_dot_product_attention(q, k, v, mask=torch.ones(5, 7))
    with pytest.raises(ValueError, match=r"mask of shape \(5, 5\) must broadcast"):
        scaled_dot_product_attention(q, k, v, mask=causal_mask(5))
    with pytest.raises(TypeError, match="bias must be a floating-point tensor"):
        scaled_dot_product_attention(q, k, v, bias=torch.ones(5, 7, dtype=torch.long))
    with pytest.raises(ValueError, match=r"bias of shape \(2, 5, 7\) must broadcast"):
        scaled_dot_product_attention(q, k, v, bias=torch.zeros(2, 5, 7))


# ---------------------------------------------------------------- MultiHeadAttention


def test_mha_parameters_and_shapes():
    mha = MultiHeadAttention(12, 3)
    assert mha.d_head == 4
    names = [n for n, _ in mha.named_parameters()]
    assert names == [f"W_{p}.{t}" for p in "qkvo" for t in ("weight", "bias")]
    assert mha.W_q.weight.shape == (12, 12) and mha.W_o.weight.shape == (12, 12)
    wide = MultiHeadAttention(10, 3, d_head=5, bias=False)
    assert wide.W_k.weight.shape == (15, 10) and wide.W_o.weight.shape == (10, 15) and wide.W_o.bias is None
    out, w = wide(torch.randn(2, 4, 10), need_weights=True)
    assert out.shape == (2, 4, 10) and w.shape == (2, 3, 4, 4)


def test_mha_rejects_bad_configuration():
    with pytest.raises(ValueError, match=r"d_model = 10 is not divisible by n_heads = 3"):
        MultiHeadAttention(10, 3)
    with pytest.raises(ValueError, match="n_heads must be a positive integer"):
        MultiHeadAttention(10, 0)
    with pytest.raises(ValueError, match="d_head must be a positive integer"):
        MultiHeadAttention(10, 2, d_head=0)
    with pytest.raises(ValueError, match=r"dropout must be in \[0, 1\)"):
        MultiHeadAttention(10, 2, dropout=1.0)


def test_mha_rejects_bad_inputs():
    mha = MultiHeadAttention(8, 2)
    with pytest.raises(ValueError, match=r"x must have shape \(batch, seq, d_model=8\), got \(3, 8\)"):
        mha(torch.randn(3, 8))
    with pytest.raises(ValueError, match=r"x must have shape \(batch, seq, d_model=8\), got \(1, 3, 6\)"):
        mha(torch.randn(1, 3, 6))
    with pytest.raises(ValueError, match="context must have the same batch size as x"):
        mha(torch.randn(2, 3, 8), torch.randn(1, 4, 8))
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        mha([[1.0] * 8])
    with pytest.raises(ValueError, match="mask of shape"):
        mha(torch.randn(1, 3, 8), mask=causal_mask(4))
    with pytest.raises(TypeError, match="mask must be a bool tensor"):
        mha(torch.randn(1, 3, 8), mask=torch.ones(3, 3))


@pytest.mark.parametrize("need_weights", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_mha_matches_torch_self_attention(need_weights, causal):
    torch.manual_seed(0)
    ours = MultiHeadAttention(16, 4)
    ref = _copy_to_torch(ours)
    x = torch.randn(3, 6, 16, requires_grad=True)
    mask = causal_mask(6) if causal else None
    got = ours(x, mask=mask, need_weights=need_weights)
    exp, exp_w = ref(x, x, x, attn_mask=None if mask is None else ~mask, need_weights=True,
                     average_attn_weights=False)
    if need_weights:
        got, w = got
        torch.testing.assert_close(w, exp_w)
    torch.testing.assert_close(got, exp)
    g_ours = torch.autograd.grad(got.square().sum(), [x, ours.W_q.weight, ours.W_v.weight, ours.W_o.bias])
    g_ref = torch.autograd.grad(exp.square().sum(), [x, ref.in_proj_weight, ref.out_proj.bias])
    torch.testing.assert_close(g_ours[0], g_ref[0])
    torch.testing.assert_close(g_ours[1], g_ref[1][:16])
    torch.testing.assert_close(g_ours[2], g_ref[1][32:])
    torch.testing.assert_close(g_ours[3], g_ref[2])


def test_mha_matches_torch_cross_attention_with_padding_mask():
    torch.manual_seed(1)
    ours = MultiHeadAttention(12, 3, bias=False)
    ref = _copy_to_torch(ours)
    x, ctx = torch.randn(2, 4, 12), torch.randn(2, 7, 12)
    keep = torch.tensor([[True] * 7, [True] * 5 + [False] * 2])
    got, w = ours(x, ctx, mask=keep[:, None, None, :], need_weights=True)
    exp, exp_w = ref(x, ctx, ctx, key_padding_mask=~keep, average_attn_weights=False)
    torch.testing.assert_close(got, exp)
    torch.testing.assert_close(w, exp_w)
    assert (w[1, :, :, 5:] == 0).all()
    torch.testing.assert_close(ours(x, ctx, mask=keep[:, None, None, :]), exp)


def test_mha_fast_and_explicit_paths_agree_with_bias_and_mask():
    torch.manual_seed(2)
    mha = MultiHeadAttention(16, 4)
    x = torch.randn(2, 5, 16)
    bias = torch.randn(4, 5, 5)
    fast = mha(x, mask=causal_mask(5), attn_bias=bias)
    slow, w = mha(x, mask=causal_mask(5), attn_bias=bias, need_weights=True)
    torch.testing.assert_close(fast, slow)
    assert (w[..., ~causal_mask(5)] == 0).all()


def test_mha_kv_cache_step_by_step_equals_full_causal_pass():
    torch.manual_seed(3)
    mha = MultiHeadAttention(16, 2)
    x = torch.randn(2, 6, 16)
    full = mha(x, mask=causal_mask(6))
    cache = KVCache()
    first = mha(x[:, :3], mask=causal_mask(3), cache=cache)   # prefill 3 positions
    assert len(cache) == 3 and cache.k.shape == (2, 2, 3, 8)
    steps = [mha(x[:, t:t + 1], cache=cache) for t in range(3, 6)]  # then one token at a time
    torch.testing.assert_close(torch.cat([first, *steps], dim=1), full)
    assert len(cache) == 6
    cache.reset()
    assert len(cache) == 0 and cache.k is None and cache.v is None
    # several new positions at once need the bottom-right-aligned causal mask
    mha(x[:, :4], mask=causal_mask(4), cache=cache)
    rest = mha(x[:, 4:], mask=causal_mask(2, n_keys=6), cache=cache)
    torch.testing.assert_close(rest, full[:, 4:])


def test_kv_cache_rejects_mismatched_shapes():
    cache = KVCache()
    with pytest.raises(ValueError, match="k and v must have the same shape"):
        cache.append(torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 5))
    cache.append(torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4))
    with pytest.raises(ValueError, match="do not match the cached keys"):
        cache.append(torch.zeros(1, 3, 1, 4), torch.zeros(1, 3, 1, 4))


def test_mha_cross_attention_cache_reuses_the_context():
    torch.manual_seed(4)
    mha = MultiHeadAttention(8, 2)
    x, ctx = torch.randn(1, 3, 8), torch.randn(1, 5, 8)
    cache = KVCache()
    first = mha(x[:, :1], ctx, cache=cache)
    assert len(cache) == 5
    later = mha(x[:, 1:], ctx, cache=cache)
    assert len(cache) == 5
    torch.testing.assert_close(torch.cat([first, later], 1), mha(x, ctx))


class _Rotary:
    """A minimal rotary embedding (pairs (2i, 2i+1) rotated by angle position * base^(-2i/d))."""

    def __init__(self, d_head, base=10000.0):
        self.inv_freq = base ** (-torch.arange(0, d_head, 2, dtype=torch.float32) / d_head)

    def apply_rotary(self, x, positions):
        angles = positions[:, None].float() * self.inv_freq  # (seq, d/2)
        cos, sin = angles.cos(), angles.sin()
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)


def test_mha_rotary_rotates_queries_and_keys_at_their_positions():
    torch.manual_seed(5)
    mha = MultiHeadAttention(8, 2)
    rot = _Rotary(4)
    x = torch.randn(1, 5, 8)
    got, w = mha(x, rotary=rot, mask=causal_mask(5), need_weights=True)
    q = mha.W_q(x).view(1, 5, 2, 4).transpose(1, 2)
    k = mha.W_k(x).view(1, 5, 2, 4).transpose(1, 2)
    pos = torch.arange(5)
    _, exp_w = scaled_dot_product_attention(rot.apply_rotary(q, pos), rot.apply_rotary(k, pos), k,
                                            mask=causal_mask(5))
    torch.testing.assert_close(w, exp_w)
    # with a cache the default positions continue where the cache ends
    cache = KVCache()
    parts = [mha(x[:, :2], rotary=rot, mask=causal_mask(2), cache=cache)]
    parts += [mha(x[:, t:t + 1], rotary=rot, cache=cache) for t in range(2, 5)]
    torch.testing.assert_close(torch.cat(parts, 1), got)
    with pytest.raises(ValueError, match=r"positions must have shape \(n_q,\)"):
        mha(x, rotary=rot, positions=torch.arange(4))


def test_mha_dropout_only_while_training():
    torch.manual_seed(6)
    mha = MultiHeadAttention(8, 2, dropout=0.5)
    x = torch.randn(2, 6, 8)
    mha.eval()
    torch.testing.assert_close(mha(x), mha(x))
    torch.testing.assert_close(mha(x), mha(x, need_weights=True)[0])
    mha.train()
    assert not torch.allclose(mha(x), mha(x))
    out, w = mha(x, need_weights=True)
    torch.testing.assert_close(w.sum(-1), torch.ones(2, 2, 6))  # the returned weights are before dropout


def test_mha_is_causal_equals_the_explicit_causal_mask_everywhere():
    torch.manual_seed(4)
    mha = MultiHeadAttention(16, 4)
    ref = _copy_to_torch(mha)
    x = torch.randn(2, 6, 16, requires_grad=True)
    got = mha(x, is_causal=True)
    exp, _ = ref(x, x, x, attn_mask=~causal_mask(6))  # PyTorch's module, True = may not attend
    torch.testing.assert_close(got, exp)
    torch.testing.assert_close(torch.autograd.grad(got.sum(), x)[0], torch.autograd.grad(exp.sum(), x)[0])
    out, w = mha(x, is_causal=True, need_weights=True)  # the written-out path builds the mask itself
    torch.testing.assert_close(out, exp)
    assert (w[..., ~causal_mask(6)] == 0).all()
    # with a bias, a padding mask, or cached keys the mask is materialised, aligned at the last key
    bias = torch.randn(4, 6, 6)
    torch.testing.assert_close(mha(x, attn_bias=bias, is_causal=True), mha(x, attn_bias=bias, mask=causal_mask(6)))
    keep = torch.tensor([[True] * 6, [True] * 4 + [False] * 2])[:, None, None, :]
    torch.testing.assert_close(mha(x, mask=keep, is_causal=True), mha(x, mask=keep & causal_mask(6)))
    full = mha(x, mask=causal_mask(6))
    cache = KVCache()
    first = mha(x[:, :4], cache=cache, is_causal=True)
    two = mha(x[:, 4:], cache=cache, is_causal=True)  # 2 new queries after 4 cached keys
    torch.testing.assert_close(torch.cat([first, two], dim=1), full)
    cache.reset()
    steps = [mha(x[:, t:t + 1], cache=cache, is_causal=True) for t in range(6)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full)
    with pytest.raises(TypeError, match="is_causal must be True or False"):
        mha(x, is_causal=1)


def test_mha_is_causal_uses_the_kernels_own_causal_mask(monkeypatch):
    seen = []
    real = F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        seen.append((kwargs.get("attn_mask") is None, kwargs.get("is_causal", False)))
        return real(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    mha = MultiHeadAttention(8, 2)
    x = torch.randn(1, 3, 8)
    mha(x, is_causal=True)
    mha(x, mask=causal_mask(3))
    assert seen == [(True, True), (False, False)]


def test_mha_uses_torch_fused_kernel_only_when_no_weights_are_requested(monkeypatch):
    calls = []
    real = F.scaled_dot_product_attention

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", counting)
    mha = MultiHeadAttention(8, 2)
    x = torch.randn(1, 3, 8)
    mha(x)
    assert len(calls) == 1
    mha(x, need_weights=True)
    assert len(calls) == 1


def test_mha_fully_masked_query_gives_zero_attention_on_both_paths():
    torch.manual_seed(7)
    mha = MultiHeadAttention(8, 2, bias=False)
    x = torch.randn(1, 3, 8)
    mask = torch.tensor([[False, False, False], [True, True, False], [True, True, True]])
    fast = mha(x, mask=mask)
    slow, w = mha(x, mask=mask, need_weights=True)
    assert torch.equal(w[0, :, 0], torch.zeros(2, 3))
    torch.testing.assert_close(fast, slow)
    torch.testing.assert_close(fast[0, 0], torch.zeros(8))  # no bias: zero heads give a zero output


# ---- hardening: numerics and API traps ------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_sdpa_half_precision_large_scores_stay_finite_and_match_torch(dtype):
    g = _gen(7)
    # entries around 100: q·k ≈ 640 000 overflows float16 (max 65 504) unless scaled and accumulated in float32
    q = (torch.randn(2, 2, 4, 64, generator=g) + 100).to(dtype)
    k = (torch.randn(2, 2, 6, 64, generator=g) + 100).to(dtype)
    v = torch.randn(2, 2, 6, 64, generator=g).to(dtype)
    mask = causal_mask(4, n_keys=6)
    out, weights = scaled_dot_product_attention(q, k, v, mask=mask)
    assert out.dtype == weights.dtype == dtype
    assert torch.isfinite(out).all() and torch.isfinite(weights).all()
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(out.float(), expected.float(), atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_mha_half_precision_paths_agree(dtype):
    torch.manual_seed(0)
    mha = MultiHeadAttention(16, 2).to(dtype)
    x = (torch.randn(2, 5, 16) * 30).to(dtype)
    fast = mha(x, mask=causal_mask(5))
    explicit, _ = mha(x, mask=causal_mask(5), need_weights=True)
    assert torch.isfinite(explicit).all()
    torch.testing.assert_close(explicit.float(), fast.float(), atol=5e-2, rtol=5e-2)


def test_sdpa_row_with_all_minus_inf_bias_gives_zero_weights_and_finite_gradients():
    q, k, v = _qkv(2, n_q=3, n_k=4)
    q.requires_grad_(True)
    bias = torch.zeros(3, 4)
    bias[1] = float("-inf")
    out, weights = scaled_dot_product_attention(q, k, v, bias=bias)
    assert torch.equal(weights[:, 1], torch.zeros(2, 4)) and torch.equal(out[:, 1], torch.zeros(2, 6))
    torch.testing.assert_close(weights[:, [0, 2]].sum(-1), torch.ones(2, 2))
    out.sum().backward()
    assert torch.isfinite(q.grad).all()
    # -inf from the bias on some keys and the mask on the others: still a row with nothing to attend to
    mask = torch.ones(3, 4, dtype=torch.bool)
    mask[2, :2] = False
    bias[2, 2:] = float("-inf")
    _, weights = scaled_dot_product_attention(q.detach(), k, v, bias=bias, mask=mask)
    assert torch.equal(weights[:, 2], torch.zeros(2, 4))


def test_mha_all_minus_inf_bias_row_agrees_on_fused_and_explicit_paths():
    torch.manual_seed(0)
    mha = MultiHeadAttention(8, 2).eval()
    x = torch.randn(2, 3, 8)
    bias = torch.zeros(2, 3, 3)
    bias[:, 1, :] = float("-inf")
    fast = mha(x, attn_bias=bias)
    explicit, weights = mha(x, attn_bias=bias, need_weights=True)
    assert torch.isfinite(explicit).all()
    torch.testing.assert_close(explicit, fast)
    torch.testing.assert_close(explicit[:, 1], mha.W_o.bias.expand(2, 8))  # no key: only W_o's bias remains
    assert torch.equal(weights[:, :, 1], torch.zeros(2, 2, 3))


def test_cross_attention_cache_refreshes_for_a_new_context():
    torch.manual_seed(4)
    mha = MultiHeadAttention(8, 2)
    x = torch.randn(2, 1, 8)
    cache = KVCache()
    mha(x[:1], torch.randn(1, 5, 8), cache=cache)
    other = torch.randn(2, 7, 8)  # a different context, even a different batch size
    torch.testing.assert_close(mha(x, other, cache=cache), mha(x, other))
    assert cache.k.shape == (2, 2, 7, 4)
    other.mul_(2.0)  # changed in place: the cached keys would be stale
    torch.testing.assert_close(mha(x, other, cache=cache), mha(x, other))


def test_kv_cache_refuses_to_mix_self_and_cross_attention():
    mha = MultiHeadAttention(8, 2)
    x, ctx = torch.randn(1, 1, 8), torch.randn(1, 4, 8)
    cross = KVCache()
    mha(x, ctx, cache=cross)
    with pytest.raises(ValueError, match="cross-attention context"):
        mha(x, cache=cross)
    own = KVCache()
    mha(x, cache=own)
    with pytest.raises(ValueError, match="holds self-attention keys"):
        mha(x, ctx, cache=own)
    with pytest.raises(TypeError, match="cache must be a KVCache"):
        mha(x, cache=[])


def test_mha_refuses_ambiguous_3d_mask_when_batch_equals_n_heads():
    mha = MultiHeadAttention(8, 2)
    x = torch.randn(2, 3, 8)  # batch 2 == n_heads 2
    per_example = torch.ones(2, 3, 3, dtype=torch.bool)
    per_example[1, :, 0] = False
    for need_weights in (False, True):
        with pytest.raises(ValueError, match=r"ambiguous.*\(batch, 1, n_q, n_k\)"):
            mha(x, mask=per_example, need_weights=need_weights)
    # the unambiguous spellings work, and a per-example mask really is per example
    _, w = mha(x, mask=per_example[:, None], need_weights=True)
    assert torch.equal(w[1, :, :, 0], torch.zeros(2, 3)) and (w[0, :, :, 0] > 0).all()
    _, w = mha(x, mask=per_example[1][None, None].expand(1, 2, 3, 3), need_weights=True)
    assert torch.equal(w[:, :, :, 0], torch.zeros(2, 2, 3))
    mha(x, mask=per_example[:1])  # leading dimension 1: the same for everyone, no ambiguity


def test_mha_3d_attn_bias_is_per_head_as_documented():
    torch.manual_seed(1)
    mha = MultiHeadAttention(8, 2)
    x = torch.randn(2, 3, 8)
    bias = torch.zeros(2, 3, 3)
    bias[1, :, 0] = float("-inf")  # head 1 never looks at key 0, in every example
    _, w = mha(x, attn_bias=bias, need_weights=True)
    assert torch.equal(w[:, 1, :, 0], torch.zeros(2, 3)) and (w[:, 0, :, 0] > 0).all()


def test_mha_dtype_mismatch_and_bad_arguments_get_clear_errors():
    mha = MultiHeadAttention(8, 2)
    with pytest.raises(TypeError, match=r"x has dtype torch.float64 but the attention's weights are torch.float32"):
        mha(torch.randn(1, 3, 8, dtype=torch.float64))
    with pytest.raises(TypeError, match="dropout must be a number"):
        MultiHeadAttention(8, 2, dropout="0.1")
    with pytest.raises(ValueError, match="n_heads must be a positive integer, got 0"):
        MultiHeadAttention(8, 0)


def test_mha_and_causal_mask_accept_numpy_integers():
    np = pytest.importorskip("numpy")
    mha = MultiHeadAttention(np.int64(8), np.int32(2))
    assert (mha.d_model, mha.n_heads, mha.d_head) == (8, 2, 4) and type(mha.d_head) is int
    assert torch.equal(causal_mask(np.int64(3)), causal_mask(3))


# --- grouped-query attention and QK-norm ------------------------------------------------------------------

def _gqa_reference(mha, x, mask):
    """Explicit GQA: project, repeat each K/V head for its group, written-out softmax attention."""
    b, n, _ = x.shape
    h, g, dh = mha.n_heads, mha.n_kv_heads, mha.d_head
    q = (x @ mha.W_q.weight.T + mha.W_q.bias).view(b, n, h, dh).transpose(1, 2)
    k = (x @ mha.W_k.weight.T + mha.W_k.bias).view(b, n, g, dh).transpose(1, 2)
    v = (x @ mha.W_v.weight.T + mha.W_v.bias).view(b, n, g, dh).transpose(1, 2)
    idx = torch.arange(h) // (h // g)
    k, v = k[:, idx], v[:, idx]
    s = (q @ k.transpose(-1, -2)) / dh**0.5
    s = s.masked_fill(~mask, float("-inf"))
    o = torch.softmax(s, dim=-1) @ v
    return o.transpose(1, 2).reshape(b, n, h * dh) @ mha.W_o.weight.T + mha.W_o.bias


@pytest.mark.parametrize("n_kv_heads", [1, 2, 4])
def test_gqa_matches_explicit_repeat_and_torch_enable_gqa(n_kv_heads):
    from groundup.attention import KVCache, MultiHeadAttention, causal_mask

    torch.manual_seed(0)
    mha = MultiHeadAttention(16, 4, n_kv_heads=n_kv_heads).double().eval()
    assert mha.W_k.weight.shape == (4 * n_kv_heads, 16)
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    mask = causal_mask(5)
    ref = _gqa_reference(mha, x, mask)
    torch.testing.assert_close(mha(x, mask=mask), ref, rtol=0, atol=1e-12)
    out_w, w = mha(x, mask=mask, need_weights=True)
    torch.testing.assert_close(out_w, ref, rtol=0, atol=1e-12)
    assert w.shape == (2, 4, 5, 5)
    # PyTorch's own enable_gqa path on the same projections
    q = mha._split_heads(mha.W_q(x))
    k, v = mha._split_heads(mha.W_k(x), n_kv_heads), mha._split_heads(mha.W_v(x), n_kv_heads)
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(mha.W_o(o.transpose(1, 2).reshape(2, 5, 16)), ref, rtol=0, atol=1e-12)
    # the cache stores only n_kv_heads heads, and incremental decoding gives the same outputs
    cache = KVCache()
    steps = [mha(x[:, t:t + 1], cache=cache) for t in range(5)]
    assert cache.k.shape == (2, n_kv_heads, 5, 4)
    torch.testing.assert_close(torch.cat(steps, dim=1), ref, rtol=0, atol=1e-12)


def test_gqa_default_is_unchanged_and_errors():
    from groundup.attention import MultiHeadAttention

    torch.manual_seed(3)
    a = MultiHeadAttention(12, 3)
    torch.manual_seed(3)
    b = MultiHeadAttention(12, 3, n_kv_heads=3)
    x = torch.randn(1, 4, 12)
    assert torch.equal(a(x), b(x))
    assert a.n_kv_heads == 3 and not a.qk_norm
    with pytest.raises(ValueError, match="n_kv_heads"):
        MultiHeadAttention(12, 3, n_kv_heads=2)
    with pytest.raises(ValueError, match="n_kv_heads"):
        MultiHeadAttention(12, 3, n_kv_heads=0)
    with pytest.raises(TypeError, match="qk_norm"):
        MultiHeadAttention(12, 3, qk_norm=1)


def test_qk_norm_normalises_heads_before_rotary():
    from groundup.attention import MultiHeadAttention, causal_mask
    from groundup.positional import RotaryEmbedding

    torch.manual_seed(4)
    mha = MultiHeadAttention(8, 2, n_kv_heads=1, qk_norm=True, bias=False).double()
    with torch.no_grad():
        mha.q_norm.weight.uniform_(0.5, 1.5)
        mha.k_norm.weight.uniform_(0.5, 1.5)
    rope = RotaryEmbedding(4, pairing="half")
    x = torch.randn(1, 3, 8, dtype=torch.float64)
    pos = torch.arange(3)

    def rms(t, w):
        return t / torch.sqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6) * w

    q = rope(rms((x @ mha.W_q.weight.T).view(1, 3, 2, 4).transpose(1, 2), mha.q_norm.weight), pos)
    k = rope(rms((x @ mha.W_k.weight.T).view(1, 3, 1, 4).transpose(1, 2), mha.k_norm.weight), pos)
    v = (x @ mha.W_v.weight.T).view(1, 3, 1, 4).transpose(1, 2)
    s = (q @ k.transpose(-1, -2)) / 2.0
    s = s.masked_fill(~causal_mask(3), float("-inf"))
    o = (torch.softmax(s, -1) @ v).transpose(1, 2).reshape(1, 3, 8) @ mha.W_o.weight.T
    torch.testing.assert_close(mha(x, mask=causal_mask(3), rotary=rope), o, rtol=0, atol=1e-12)


# ---------------------------------------------------------------- stacked projection weights kept for inference


def _fresh_output(attn, x, context=None):
    """The output with the weights stacked anew (autograd records the weights, so nothing is reused)."""
    with torch.enable_grad():
        return attn(x, context).detach()


def _edits():
    """Ways a weight changes between two forward passes, each applied to a MultiHeadAttention."""
    def no_grad_edit(a):
        with torch.no_grad():
            a.W_k.weight.mul_(2)

    def optimizer_step(a):
        opt = torch.optim.SGD(a.parameters(), lr=0.1)
        with torch.enable_grad():
            a(torch.randn(2, 4, a.d_model, generator=_gen(5))).square().sum().backward()
        opt.step()

    def load_state_dict(a):
        a.load_state_dict(MultiHeadAttention(a.d_model, a.n_heads, n_kv_heads=a.n_kv_heads).state_dict())

    def replace_layer(a):
        a.W_v = nn.Linear(a.d_model, a.W_v.out_features)

    def replace_parameter(a):
        a.W_q.bias = nn.Parameter(torch.randn(a.W_q.out_features))

    def swap_storage(a):
        a.W_k.weight.data = a.W_k.weight.data * 3  # a new storage: another data_ptr

    return [no_grad_edit, optimizer_step, load_state_dict, replace_layer, replace_parameter, swap_storage]


@pytest.mark.parametrize("n_kv_heads", [None, 2])
@pytest.mark.parametrize("edit", _edits(), ids=lambda f: f.__name__)
def test_stacked_weights_are_reused_at_inference_and_renewed_after_any_edit(n_kv_heads, edit):
    torch.manual_seed(0)
    attn = MultiHeadAttention(16, 4, n_kv_heads=n_kv_heads)
    x = torch.randn(2, 5, 16, generator=_gen(1))
    fresh_before = _fresh_output(attn, x)
    with torch.no_grad(), reusing_stacked_weights():
        before = attn(x)
        stacked = attn._stacked_weights(("W_q", "W_k", "W_v"))
        assert attn._stacked_weights(("W_q", "W_k", "W_v")) is stacked  # no concatenation on the second call
        assert torch.equal(attn(x), before)
        edit(attn)  # inside the same block: the kept copy must be renewed
        after = attn(x)
    assert torch.equal(before, fresh_before)  # bit for bit the stacking done while training
    assert torch.equal(after, _fresh_output(attn, x))
    assert not torch.allclose(after, before)  # the edit did change the output: a stale copy would fail above


def test_stacked_weights_are_not_kept_outside_a_reuse_block():
    attn = MultiHeadAttention(16, 4)
    with torch.no_grad():
        assert attn._stacked_weights(("W_q", "W_k", "W_v")) is not attn._stacked_weights(("W_q", "W_k", "W_v"))


def test_stacked_weights_are_fresh_after_a_fused_adamw_step():
    # The fused AdamW step (train's optimizer) edits the weights in place without bumping their version
    # counters: a copy kept from one evaluation to the next would be stale (it was, and chapter 7's validation
    # losses moved). Each reuse block starts afresh.
    torch.manual_seed(0)
    attn = MultiHeadAttention(16, 4)
    x = torch.randn(2, 5, 16, generator=_gen(1))
    opt = torch.optim.AdamW(attn.parameters(), lr=0.1, fused=True)
    with torch.no_grad(), reusing_stacked_weights():
        before = attn(x)
    versions = [p._version for p in attn.parameters()]
    attn(x).square().sum().backward()
    opt.step()
    assert [p._version for p in attn.parameters()] == versions  # why the block, not the counter, decides
    with torch.no_grad(), reusing_stacked_weights():
        after = attn(x)
    assert torch.equal(after, _fresh_output(attn, x)) and not torch.allclose(after, before)


def test_stacked_weights_for_cross_attention_follow_edits_too():
    torch.manual_seed(0)
    attn = MultiHeadAttention(16, 4)
    x, context = torch.randn(2, 3, 16, generator=_gen(1)), torch.randn(2, 6, 16, generator=_gen(2))
    with torch.inference_mode():
        before = attn(x, context)
    assert torch.equal(before, _fresh_output(attn, x, context))
    with torch.no_grad():
        attn.W_v.bias.add_(1.0)
        after = attn(x, context)
    assert torch.equal(after, _fresh_output(attn, x, context)) and not torch.allclose(after, before)


def test_stacked_weights_made_in_inference_mode_serve_frozen_training():
    # Frozen weights, an input that needs gradients (an adapter or a prompt being trained): the kept copy made under
    # inference_mode must be an ordinary tensor that autograd can save.
    torch.manual_seed(0)
    attn = MultiHeadAttention(16, 4).requires_grad_(False)
    x = torch.randn(2, 5, 16, generator=_gen(1), requires_grad=True)
    with reusing_stacked_weights():
        with torch.inference_mode():
            attn(x.detach())
        attn(x).sum().backward()
    ref = MultiHeadAttention(16, 4)
    ref.load_state_dict(attn.state_dict())
    x2 = x.detach().clone().requires_grad_(True)
    ref(x2).sum().backward()
    assert torch.equal(x.grad, x2.grad)


def test_training_gradients_reach_every_projection():
    torch.manual_seed(0)
    attn = MultiHeadAttention(16, 4)
    with torch.no_grad():
        attn(torch.randn(1, 3, 16))  # a kept copy exists; training must not use it
    ref = _copy_to_torch(attn)
    x = torch.randn(2, 5, 16, generator=_gen(1))
    attn(x).sum().backward()
    ref(x, x, x, need_weights=False)[0].sum().backward()
    grads = torch.cat([attn.W_q.weight.grad, attn.W_k.weight.grad, attn.W_v.weight.grad])
    torch.testing.assert_close(grads, ref.in_proj_weight.grad, rtol=1e-5, atol=1e-5)
