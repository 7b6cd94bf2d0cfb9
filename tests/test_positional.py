"""Tests for groundup.positional: every encoding against its closed form, plus RoPE's key properties."""

import math

import pytest
import torch

from groundup.positional import (
    LearnedPositionalEmbedding,
    RelativePositionBias,
    RotaryEmbedding,
    alibi_bias,
    alibi_slopes,
    relative_position_bucket,
    sinusoidal_encoding,
)

# ---------------------------------------------------------------- sinusoidal


def test_sinusoidal_exact_values():
    P = sinusoidal_encoding(50, 8)
    assert P.shape == (50, 8) and P.dtype == torch.float32
    for k in (0, 1, 7, 49):
        for i in range(4):
            angle = k / 10000.0 ** (2 * i / 8)
            assert P[k, 2 * i].item() == pytest.approx(math.sin(angle), abs=1e-7)
            assert P[k, 2 * i + 1].item() == pytest.approx(math.cos(angle), abs=1e-7)
    # position 0: sin 0 = 0 in even columns, cos 0 = 1 in odd columns
    torch.testing.assert_close(P[0], torch.tensor([0.0, 1.0] * 4))
    # the first pair has frequency 1: P[1, 0:2] = (sin 1, cos 1)
    torch.testing.assert_close(P[1, :2], torch.tensor([math.sin(1.0), math.cos(1.0)]))


def test_sinusoidal_base_and_bounded():
    P = sinusoidal_encoding(1000, 4, base=100.0)
    assert P[3, 2].item() == pytest.approx(math.sin(3 / 100.0 ** 0.5), abs=1e-7)
    assert P.abs().max().item() <= 1.0
    # every row has squared norm d/2 (sin^2 + cos^2 = 1 per pair)
    torch.testing.assert_close(P.pow(2).sum(-1), torch.full((1000,), 2.0))


def test_sinusoidal_shift_is_a_rotation():
    """P(k + delta) = M_delta P(k) with M_delta block-diagonal 2x2 rotations, the same for every k."""
    d, delta = 6, 5
    P = sinusoidal_encoding(40, d).double()
    M = torch.zeros(d, d, dtype=torch.float64)
    for i in range(d // 2):
        w = delta / 10000.0 ** (2 * i / d)
        # (sin(a+b), cos(a+b)) = [[cos b, sin b], [-sin b, cos b]] (sin a, cos a)
        M[2 * i:2 * i + 2, 2 * i:2 * i + 2] = torch.tensor([[math.cos(w), math.sin(w)], [-math.sin(w), math.cos(w)]])
    torch.testing.assert_close(P[:-delta] @ M.T, P[delta:], atol=1e-6, rtol=0)


@pytest.mark.parametrize("args, kwargs, exc, match", [
    ((10, 7), {}, ValueError, "d_model must be even"),
    ((0, 8), {}, ValueError, "n_positions must be an integer >= 1"),
    ((10.0, 8), {}, TypeError, "n_positions must be an int"),
    ((10, 8), {"base": 0.5}, ValueError, "base must be"),
])
def test_sinusoidal_rejects_bad_arguments(args, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        sinusoidal_encoding(*args, **kwargs)


# ---------------------------------------------------------------- learned absolute


def test_learned_is_a_table_lookup():
    torch.manual_seed(0)
    emb = LearnedPositionalEmbedding(16, 4)
    assert emb.weight.shape == (16, 4)
    assert 0.005 < emb.weight.std().item() < 0.05  # GPT-2 style N(0, 0.02^2)
    out = emb(torch.tensor([[0, 3], [15, 3]]))
    assert out.shape == (2, 2, 4)
    torch.testing.assert_close(out[0, 1], emb.weight[3])
    torch.testing.assert_close(out[1, 0], emb.weight[15])
    out.sum().backward()
    assert emb.weight.grad[3].tolist() == [2.0] * 4 and emb.weight.grad[1].tolist() == [0.0] * 4


def test_learned_rejects_bad_positions():
    emb = LearnedPositionalEmbedding(8, 4)
    with pytest.raises(ValueError, match="positions must be < context_length=8"):
        emb(torch.arange(9))
    with pytest.raises(ValueError, match="positions must be >= 0"):
        emb(torch.tensor([-1]))
    with pytest.raises(TypeError, match="integer tensor"):
        emb(torch.tensor([0.0, 1.0]))
    with pytest.raises(TypeError, match="torch.Tensor"):
        emb([0, 1])
    with pytest.raises(ValueError, match="context_length must be an integer >= 1"):
        LearnedPositionalEmbedding(0, 4)


# ---------------------------------------------------------------- relative bias


def test_relative_bias_entries_are_b_of_offset():
    rpb = RelativePositionBias(2, 3)
    assert rpb.bias.shape == (2, 7)
    with torch.no_grad():
        rpb.bias.copy_(torch.arange(14.0).view(2, 7))  # entry j of head h holds 7h + j, offset = j - 3
    B = rpb(6)
    assert B.shape == (2, 6, 6)
    for h in range(2):
        for t in range(6):
            for i in range(6):
                offset = max(-3, min(3, t - i))
                assert B[h, t, i].item() == 7 * h + offset + 3
    # b depends only on t - i: constant along each diagonal
    assert B[0, 5, 4] == B[0, 1, 0] and B[1, 4, 0] == B[1, 5, 0]  # both clipped at 3


def test_relative_bias_causal_table_and_gradient():
    rpb = RelativePositionBias(1, 4, bidirectional=False)
    assert rpb.bias.shape == (1, 5)
    idx = rpb.index(6)
    assert idx[5, 0].item() == 4 and idx[3, 1].item() == 2 and idx[1, 3].item() == 0
    rpb(6)[0, 2, 0].backward()  # offset 2
    assert rpb.bias.grad.tolist() == [[0.0, 0.0, 1.0, 0.0, 0.0]]


def _t5_bucket_reference(offset, num_buckets, max_distance, bidirectional):
    """Scalar transcription of T5's _relative_position_bucket (relative_position = key - query = -offset)."""
    n = offset
    ret = 0
    if bidirectional:
        num_buckets //= 2
        ret += num_buckets if n < 0 else 0
        n = abs(n)
    else:
        n = max(n, 0)
    max_exact = num_buckets // 2
    if n < max_exact:
        return ret + n
    val = max_exact + int(math.log(n / max_exact) / math.log(max_distance / max_exact) * (num_buckets - max_exact))
    return ret + min(val, num_buckets - 1)


@pytest.mark.parametrize("bidirectional", [True, False])
def test_t5_buckets_match_reference(bidirectional):
    offsets = torch.arange(-300, 301)
    got = relative_position_bucket(offsets, num_buckets=32, max_distance=128, bidirectional=bidirectional)
    expected = [_t5_bucket_reference(o, 32, 128, bidirectional) for o in offsets.tolist()]
    assert got.tolist() == expected
    if bidirectional:  # hand-picked values of T5's default (32 buckets, max distance 128)
        assert got[300 + 0].item() == 0 and got[300 + 7].item() == 7 and got[300 + 8].item() == 8
        assert got[300 + 127].item() == 15 and got[300 + 300].item() == 15
        assert got[300 - 1].item() == 17 and got[300 - 300].item() == 31


def test_relative_bias_with_buckets():
    rpb = RelativePositionBias(3, 64, num_buckets=16)
    assert rpb.bias.shape == (3, 16)
    with torch.no_grad():
        rpb.bias.copy_(torch.arange(48.0).view(3, 16))
    B = rpb(100)
    offsets = torch.arange(100)[:, None] - torch.arange(100)[None, :]
    expected_idx = relative_position_bucket(offsets, num_buckets=16, max_distance=64)
    torch.testing.assert_close(B[2], 32.0 + expected_idx.float())


def test_relative_bias_rejects_bad_arguments():
    with pytest.raises(ValueError, match="n_heads must be an integer >= 1"):
        RelativePositionBias(0, 4)
    with pytest.raises(ValueError, match="max_distance must exceed"):
        RelativePositionBias(2, 4, num_buckets=32)
    with pytest.raises(TypeError, match="n must be an int"):
        RelativePositionBias(2, 4)(torch.tensor(5))


# ---------------------------------------------------------------- ALiBi


def test_alibi_slopes_and_bias():
    torch.testing.assert_close(alibi_slopes(8), torch.tensor([2.0 ** -k for k in range(1, 9)]))
    torch.testing.assert_close(alibi_slopes(4), torch.tensor([1 / 4, 1 / 16, 1 / 64, 1 / 256]))
    B = alibi_bias(4, 5)
    assert B.shape == (4, 5, 5)
    assert B[0, 4, 0].item() == -1.0  # slope 1/4, distance 4
    assert B[1, 3, 1].item() == -2 / 16
    assert B[3, 2, 2].item() == 0.0
    assert B[0, 0, 3].item() == -3 / 4  # i > t: symmetric |t - i| (removed by the causal mask)
    for h in range(4):
        for t in range(5):
            for i in range(t + 1):
                assert B[h, t, i].item() == pytest.approx(-(2.0 ** (-8 * (h + 1) / 4)) * (t - i))


def test_alibi_slopes_for_head_counts_that_are_not_powers_of_two():
    # The ALiBi reference rule, written out by hand: the 2^k slopes of the largest power of two below n_heads,
    # then the odd-numbered slopes (1st, 3rd, ...) of the 2^(k+1)-head sequence 2^(-8h/2^(k+1)).
    expected = {
        1: [2.0 ** -8],
        3: [2.0 ** -4, 2.0 ** -8, 2.0 ** -2],
        5: [2.0 ** -2, 2.0 ** -4, 2.0 ** -6, 2.0 ** -8, 2.0 ** -1],
        6: [2.0 ** -2, 2.0 ** -4, 2.0 ** -6, 2.0 ** -8, 2.0 ** -1, 2.0 ** -3],
        12: [2.0 ** -k for k in range(1, 9)] + [2.0 ** -0.5, 2.0 ** -1.5, 2.0 ** -2.5, 2.0 ** -3.5],
    }
    for n_heads, slopes in expected.items():
        torch.testing.assert_close(alibi_slopes(n_heads), torch.tensor(slopes), rtol=1e-6, atol=0)
    for n_heads in (16, 32):  # powers of two: the plain geometric sequence, as before
        h = torch.arange(1, n_heads + 1, dtype=torch.float64)
        torch.testing.assert_close(alibi_slopes(n_heads), (2.0 ** (-8 * h / n_heads)).float())
    for n_heads in range(1, 40):  # distinct, in (0, 1), and the bias uses them
        m = alibi_slopes(n_heads)
        assert m.shape == (n_heads,) and len(set(m.tolist())) == n_heads and bool(((m > 0) & (m < 1)).all())
    torch.testing.assert_close(alibi_bias(6, 4)[:, 3, 0], -3 * alibi_slopes(6))


def test_alibi_rejects_bad_arguments():
    with pytest.raises(ValueError, match="n_heads must be an integer >= 1"):
        alibi_bias(0, 4)
    with pytest.raises(TypeError, match="n must be an int"):
        alibi_bias(2, 4.0)


# ---------------------------------------------------------------- RoPE


def test_rope_closed_form_2d_and_pairs():
    rope = RotaryEmbedding(4, base=100.0)
    x = torch.tensor([[1.0, 2.0, 3.0, -1.0]] * 3, dtype=torch.float64)
    out = rope.apply_rotary(x, torch.tensor([0, 1, 7]))
    torch.testing.assert_close(out[0], x[0])  # position 0: identity
    for row, t in ((1, 1), (2, 7)):
        for i, (a, b) in enumerate(((1.0, 2.0), (3.0, -1.0))):
            w = t * 100.0 ** (-2 * i / 4)
            R = torch.tensor([[math.cos(w), -math.sin(w)], [math.sin(w), math.cos(w)]], dtype=torch.float64)
            torch.testing.assert_close(out[row, 2 * i:2 * i + 2], R @ torch.tensor([a, b], dtype=torch.float64))


def test_rope_offset_invariance_and_norm():
    torch.manual_seed(0)
    rope = RotaryEmbedding(16)
    q, k = torch.randn(16, dtype=torch.float64), torch.randn(16, dtype=torch.float64)

    def score(t, i):
        rq = rope.apply_rotary(q[None], torch.tensor([t]))[0]
        rk = rope.apply_rotary(k[None], torch.tensor([i]))[0]
        return (rq @ rk).item()

    for t, i, shift in ((5, 2, 10), (3, 9, 100), (0, 0, 1234)):
        assert score(t, i) == pytest.approx(score(t + shift, i + shift), abs=1e-9)
    assert score(5, 2) != pytest.approx(score(5, 3), abs=1e-3)  # but it does depend on the offset
    x = torch.randn(2, 3, 50, 16)
    out = rope(x, torch.arange(50))
    torch.testing.assert_close(out.norm(dim=-1), x.norm(dim=-1))


def test_rope_equals_complex_multiplication():
    """Independent reference: pair (2i, 2i+1) as a complex number, multiplied by exp(j t theta_i)."""
    torch.manual_seed(1)
    x = torch.randn(2, 4, 12, 8)
    pos = torch.arange(3, 15)
    theta = 10000.0 ** (-torch.arange(0, 8, 2, dtype=torch.float64) / 8)
    rot = torch.polar(torch.ones(12, 4, dtype=torch.float64), pos[:, None].double() * theta)
    expected = torch.view_as_real(torch.view_as_complex(x.double().reshape(2, 4, 12, 4, 2)) * rot).flatten(-2)
    got = RotaryEmbedding(8).apply_rotary(x, pos)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, expected.float())


def test_rope_computes_the_angles_once_per_positions_tensor_and_notices_every_change(monkeypatch):
    rope = RotaryEmbedding(8)
    calls = []
    angles = rope.angles
    monkeypatch.setattr(rope, "angles", lambda positions: calls.append(1) or angles(positions))
    x = torch.randn(2, 5, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0))

    def fresh(positions, dtype=torch.float64, **kw):  # a new module: no memo
        return RotaryEmbedding(8, **kw).apply_rotary(x.to(dtype), positions)

    pos = torch.arange(5)
    first = rope.apply_rotary(x, pos)
    assert torch.equal(rope.apply_rotary(x, pos), first) and len(calls) == 1  # 60 calls of a forward: 1 angle
    pos.add_(3)  # the same tensor changed in place
    assert torch.equal(rope.apply_rotary(x, pos), fresh(pos)) and len(calls) == 2
    same_values = torch.arange(3, 8)  # another tensor with the same values: recomputed, same result
    assert torch.equal(rope.apply_rotary(x, same_values), fresh(pos)) and len(calls) == 3
    assert rope.apply_rotary(x.float(), same_values).dtype == torch.float32 and len(calls) == 4
    rope.position_scale = 2.0
    assert torch.equal(rope.apply_rotary(x, same_values), fresh(same_values, position_scale=2.0))
    rope.pairing = "half"
    assert torch.equal(rope.apply_rotary(x, same_values), fresh(same_values, position_scale=2.0, pairing="half"))
    with torch.inference_mode():  # inference tensors have no version counter: still rotated, and correctly
        inference_positions = torch.arange(5)
        assert torch.equal(rope.apply_rotary(x, inference_positions),
                           fresh(inference_positions, position_scale=2.0, pairing="half"))


def _rope_as_written(rope, x, positions):
    """The rotation exactly as the docstring writes it: one pair at a time, cos and sin products."""
    angles = rope.angles(positions)
    cos, sin = torch.cos(angles).to(x.dtype), torch.sin(angles).to(x.dtype)
    if rope.pairing == "half":
        half = rope.d_head // 2
        a, b = x[..., :half], x[..., half:]
        return torch.cat((a * cos - b * sin, a * sin + b * cos), dim=-1)
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("pairing", ["interleaved", "half"])
def test_rope_equals_the_written_formula_bit_for_bit(dtype, pairing):
    # x * C + swapped(x) * S forms the same products and sums as the formula, so not even the last bit moves
    # (a - b is a + (-b) in IEEE arithmetic, and a sum of two terms does not depend on their order).
    rope = RotaryEmbedding(64, base=100000.0, pairing=pairing)
    x = (torch.randn(2, 70, 9, 64, generator=torch.Generator().manual_seed(0)) * 3).to(dtype).transpose(1, 2)
    positions = torch.arange(5, 75)
    for inp in (x, x.contiguous()):  # attention hands over a transposed, non-contiguous view
        out = rope.apply_rotary(inp, positions)
        assert torch.equal(out, _rope_as_written(rope, inp, positions)) and out.is_contiguous()


@pytest.mark.parametrize("pairing", ["interleaved", "half"])
def test_rope_with_positions_per_example_rotates_each_row_at_its_own(pairing):
    """Positions (batch, seq), for left-padded batches: row b equals the (seq,) rotation at positions[b], bit for
    bit, for x (batch, heads, seq, d) and (batch, seq, d); a positions batch that does not match x is refused."""
    rope = RotaryEmbedding(8, pairing=pairing)
    x = torch.randn(3, 2, 5, 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    pos = torch.tensor([[0, 0, 0, 1, 2], [0, 1, 2, 3, 4], [7, 3, 9, 0, 1]])
    got = rope.apply_rotary(x, pos)
    for b in range(3):
        assert torch.equal(got[b], RotaryEmbedding(8, pairing=pairing).apply_rotary(x[b], pos[b]))
        assert torch.equal(rope.apply_rotary(x[:, 0], pos)[b], RotaryEmbedding(8, pairing=pairing)
                           .apply_rotary(x[b, 0], pos[b]))
    assert rope.angles(pos).shape == (3, 5, 4)
    with pytest.raises(ValueError, match=r"\(batch, seq\) for x of shape \(batch, ..., seq, d_head\)"):
        rope.apply_rotary(x, pos[:2])
    with pytest.raises(ValueError, match=r"shape \(seq,\) or \(batch, seq\)"):
        rope.angles(pos[None])


def test_rope_rejects_bad_arguments():
    with pytest.raises(ValueError, match="d_head must be even"):
        RotaryEmbedding(7)
    rope = RotaryEmbedding(8)
    with pytest.raises(ValueError, match=r"d_head=8"):
        rope.apply_rotary(torch.zeros(3, 6), torch.arange(3))
    with pytest.raises(ValueError, match="one entry per sequence position"):
        rope.apply_rotary(torch.zeros(3, 8), torch.arange(4))
    with pytest.raises(ValueError, match=r"shape \(seq,\)"):
        rope.apply_rotary(torch.zeros(3, 8), torch.zeros(1, 3, dtype=torch.long))
    with pytest.raises(TypeError, match="integer tensor"):
        rope.apply_rotary(torch.zeros(3, 8), torch.arange(3.0))
    with pytest.raises(TypeError, match="floating-point"):
        rope.apply_rotary(torch.zeros(3, 8, dtype=torch.long), torch.arange(3))


# ---------------------------------------------------------------- plots of chapter 4


def test_plot_positional_encoding_is_labelled():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from groundup.plotting import plot_positional_encoding

    fig = plot_positional_encoding(sinusoidal_encoding(20, 8))
    ax = fig.axes[0]
    assert ax.get_title() == "Sinusoidal positional encoding"
    assert ax.get_xlabel() == "dimension" and ax.get_ylabel() == "position k"
    assert ax.images[0].get_array().shape == (20, 8) and len(fig.axes) == 2  # heat map + colour bar
    plt.close(fig)
    with pytest.raises(ValueError, match="table must have shape"):
        plot_positional_encoding(torch.zeros(3))


def test_plot_length_generalisation_is_labelled():
    import math as m

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from groundup.plotting import plot_length_generalisation

    fig = plot_length_generalisation({"rope": [1.0, 0.9], "learned": [1.0, None]}, [32, 64], train_length=32)
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["rope", "learned"]
    assert "sequence length" in ax.get_xlabel() and "accuracy" in ax.get_ylabel()
    assert m.isnan(ax.lines[1].get_ydata()[1])  # a length the method cannot run at is left empty
    plt.close(fig)
    with pytest.raises(ValueError, match="has 1 values but lengths has 2"):
        plot_length_generalisation({"rope": [1.0]}, [32, 64])
    with pytest.raises(ValueError, match="at least one method"):
        plot_length_generalisation({}, [32])


# ---- hardening: API traps --------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64])
def test_learned_positions_of_any_integer_dtype_are_positions_not_a_mask(dtype):
    torch.manual_seed(0)
    emb = LearnedPositionalEmbedding(8, 4)
    positions = torch.tensor([[0, 1, 1], [7, 2, 0]], dtype=dtype)
    out = emb(positions)
    assert out.shape == (2, 3, 4)
    assert torch.equal(out, emb.weight[positions.long()])
    assert torch.equal(out[0, 1], emb.weight[1]) and torch.equal(out[1, 0], emb.weight[7])


def test_positional_sizes_accept_numpy_integers():
    np = pytest.importorskip("numpy")
    assert torch.equal(sinusoidal_encoding(np.int64(5), np.int64(8)), sinusoidal_encoding(5, 8))
    assert torch.equal(alibi_bias(np.int32(2), np.int64(4)), alibi_bias(2, 4))
    emb = LearnedPositionalEmbedding(np.int64(8), np.int64(4))
    assert type(emb.context_length) is int and emb.weight.shape == (8, 4)
    assert RotaryEmbedding(np.int64(4)).d_head == 4
    assert RelativePositionBias(np.int64(2), np.int64(3))(np.int64(4)).shape == (2, 4, 4)


# --- RoPE pairings and position interpolation (modern block) -------------------------------------------------

def test_rope_half_pairing_matches_transformers_llama():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from groundup.positional import RotaryEmbedding

    torch.manual_seed(0)
    d, n = 8, 6
    rope = RotaryEmbedding(d, base=500.0, pairing="half")
    q = torch.randn(2, 3, n, d, dtype=torch.float64)
    k = torch.randn(2, 3, n, d, dtype=torch.float64)
    pos = torch.arange(n)
    inv = 1.0 / (500.0 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    freqs = pos.to(torch.float64)[:, None] * inv[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)[None]  # [1, n, d]
    q_ref, k_ref = apply_rotary_pos_emb(q, k, emb.cos(), emb.sin())
    torch.testing.assert_close(rope(q, pos), q_ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(rope(k, pos), k_ref, rtol=0, atol=1e-12)


def test_rope_pairings_agree_up_to_a_permutation():
    from groundup.positional import RotaryEmbedding

    torch.manual_seed(1)
    d, n = 10, 7
    x = torch.randn(3, n, d, dtype=torch.float64)
    pos = torch.arange(n)
    # perm[j] = interleaved index that lands at half-layout index j: j<d/2 -> 2j, j>=d/2 -> 2(j-d/2)+1
    perm = torch.cat((torch.arange(0, d, 2), torch.arange(1, d, 2)))
    inter = RotaryEmbedding(d)(x, pos)
    half = RotaryEmbedding(d, pairing="half")(x[..., perm], pos)
    torch.testing.assert_close(half, inter[..., perm], rtol=0, atol=1e-12)


def test_rope_interleaved_default_unchanged_and_position_scale():
    from groundup.positional import RotaryEmbedding

    torch.manual_seed(2)
    d, n = 8, 5
    x = torch.randn(2, n, d, dtype=torch.float64)
    pos = torch.arange(n)
    rope = RotaryEmbedding(d)
    assert torch.equal(rope(x, pos), RotaryEmbedding(d, pairing="interleaved", position_scale=1.0)(x, pos))
    # closed form of the interleaved rotation
    theta = 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = pos.to(torch.float64)[:, None] * theta
    ref = torch.empty_like(x)
    ref[..., 0::2] = x[..., 0::2] * ang.cos() - x[..., 1::2] * ang.sin()
    ref[..., 1::2] = x[..., 0::2] * ang.sin() + x[..., 1::2] * ang.cos()
    torch.testing.assert_close(rope(x, pos), ref, rtol=0, atol=1e-12)
    # position interpolation: scale s at position t == scale 1 at position t/s (t = 0, 4, 8, ... with s = 4)
    scaled = RotaryEmbedding(d, position_scale=4.0)
    torch.testing.assert_close(scaled.angles(4 * pos), rope.angles(pos), rtol=0, atol=1e-12)
    torch.testing.assert_close(scaled(x, 4 * pos), rope(x, pos), rtol=0, atol=1e-12)


def test_rope_option_errors():
    from groundup.positional import RotaryEmbedding

    with pytest.raises(ValueError, match="pairing"):
        RotaryEmbedding(8, pairing="rotate")
    with pytest.raises(ValueError, match="position_scale"):
        RotaryEmbedding(8, position_scale=0.5)
    with pytest.raises(TypeError, match="position_scale"):
        RotaryEmbedding(8, position_scale="2")
