"""Tests for groundup.layers: norms and FFN against PyTorch's built-ins, blocks against hand-written equations."""

import math
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch_reference import encoder_layer_like

from groundup.layers import DecoderBlock, FeedForward, LayerNorm, RMSNorm, TransformerBlock


@dataclass
class Cfg:
    d_model: int = 16
    n_heads: int = 4
    d_ff: int = 32
    norm: str = "layernorm"
    norm_position: str = "pre"
    dropout: float = 0.0


def _randomise(module: nn.Module, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g))


# ---- LayerNorm -------------------------------------------------------------------------------------------


def test_layernorm_matches_torch_with_random_gamma_beta():
    torch.manual_seed(0)
    ours, ref = LayerNorm(10, eps=1e-5), nn.LayerNorm(10, eps=1e-5)
    _randomise(ours, 1)
    ref.load_state_dict(ours.state_dict())
    x = torch.randn(3, 7, 10) * 5 + 2
    torch.testing.assert_close(ours(x), ref(x))
    assert ours(x).shape == (3, 7, 10)


def test_layernorm_initial_output_has_mean_0_var_1():
    x = torch.randn(4, 64) * 3 + 7
    y = LayerNorm(64)(x)
    torch.testing.assert_close(y.mean(-1), torch.zeros(4), atol=1e-5, rtol=0)
    torch.testing.assert_close(y.var(-1, unbiased=False), torch.ones(4), atol=1e-3, rtol=0)


def test_layernorm_eps_inside_sqrt_like_torch_for_tiny_variance():
    x = torch.tensor([[1.0, 1.0 + 1e-3, 1.0 - 1e-3, 1.0]])
    ours, ref = LayerNorm(4, eps=1e-2), nn.LayerNorm(4, eps=1e-2)
    torch.testing.assert_close(ours(x), ref(x))
    # the seeds' placement σ + ε would give a visibly different answer here
    seeds = (x - x.mean()) / (x.std(unbiased=False) + 1e-2)
    assert not torch.allclose(ours(x), seeds, atol=1e-3)


def test_layernorm_gradients_match_torch():
    x = torch.randn(5, 8, requires_grad=True)
    x2 = x.detach().clone().requires_grad_(True)
    ours, ref = LayerNorm(8), nn.LayerNorm(8)
    _randomise(ours, 3)
    ref.load_state_dict(ours.state_dict())
    ours(x).pow(2).sum().backward()
    ref(x2).pow(2).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad)
    torch.testing.assert_close(ours.weight.grad, ref.weight.grad)


def test_layernorm_bad_inputs():
    with pytest.raises(ValueError, match="last dimension 8"):
        LayerNorm(8)(torch.randn(2, 7))
    with pytest.raises(TypeError, match="torch.Tensor"):
        LayerNorm(8)([1.0] * 8)
    with pytest.raises(ValueError, match="d must be a positive integer"):
        LayerNorm(0)
    with pytest.raises(ValueError, match="eps must be > 0"):
        LayerNorm(4, eps=0.0)


# ---- RMSNorm ---------------------------------------------------------------------------------------------


def test_rmsnorm_matches_torch():
    ours, ref = RMSNorm(12, eps=1e-6), nn.RMSNorm(12, eps=1e-6)
    _randomise(ours, 2)
    ref.load_state_dict(ours.state_dict())
    x = torch.randn(2, 5, 12) * 4
    torch.testing.assert_close(ours(x), ref(x))


def test_rmsnorm_output_has_rms_1_and_no_bias():
    x = torch.randn(6, 32) * 10 + 3
    y = RMSNorm(32)(x)
    torch.testing.assert_close(y.pow(2).mean(-1).sqrt(), torch.ones(6), atol=1e-4, rtol=0)
    assert [n for n, _ in RMSNorm(4).named_parameters()] == ["weight"]


def test_rmsnorm_bad_shape():
    with pytest.raises(ValueError, match="last dimension 12"):
        RMSNorm(12)(torch.randn(3, 11))


# ---- FeedForward -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("activation,phi", [("relu", F.relu), ("gelu", F.gelu)])
def test_feedforward_equals_formula(activation, phi):
    torch.manual_seed(0)
    ffn = FeedForward(8, 20, activation=activation)
    x = torch.randn(3, 4, 8)
    W_in, b_in = ffn.W_in.weight, ffn.W_in.bias
    W_out, b_out = ffn.W_out.weight, ffn.W_out.bias
    assert W_in.shape == (20, 8) and W_out.shape == (8, 20)
    expected = phi(x @ W_in.T + b_in) @ W_out.T + b_out
    torch.testing.assert_close(ffn(x), expected)


def test_feedforward_matches_torch_sequential():
    torch.manual_seed(0)
    ffn = FeedForward(8, 16, activation="gelu")
    ref = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
    ref[0].load_state_dict(ffn.W_in.state_dict())
    ref[2].load_state_dict(ffn.W_out.state_dict())
    x = torch.randn(2, 3, 8)
    torch.testing.assert_close(ffn(x), ref(x))


def test_feedforward_is_positionwise():
    torch.manual_seed(0)
    ffn = FeedForward(8, 16)
    x = torch.randn(1, 5, 8)
    rowwise = torch.stack([ffn(x[:, i]) for i in range(5)], dim=1)
    torch.testing.assert_close(ffn(x), rowwise)


def test_feedforward_bad_arguments():
    with pytest.raises(ValueError, match="activation must be one of"):
        FeedForward(8, 16, activation="tanh")
    with pytest.raises(ValueError, match="d_ff must be a positive integer"):
        FeedForward(8, 0)
    with pytest.raises(ValueError, match="last dimension 8"):
        FeedForward(8, 16)(torch.randn(2, 9))


# ---- TransformerBlock ------------------------------------------------------------------------------------


@pytest.mark.parametrize("norm_position", ["pre", "post"])
def test_block_equals_its_equations(norm_position):
    torch.manual_seed(0)
    block = TransformerBlock(Cfg(norm_position=norm_position)).eval()
    x = torch.randn(2, 6, 16)
    mask = torch.ones(6, 6, dtype=torch.bool).tril()
    attn, ffn, n1, n2 = block.attention, block.ffn, block.norm_1, block.norm_2
    if norm_position == "pre":
        h = x + attn(n1(x), mask=mask)
        expected = h + ffn(n2(h))
    else:
        h = n1(x + attn(x, mask=mask))
        expected = n2(h + ffn(h))
    torch.testing.assert_close(block(x, mask=mask), expected)


def test_post_ln_block_output_is_normalised_pre_ln_is_not():
    torch.manual_seed(0)
    x = torch.randn(2, 5, 16) * 3
    post = TransformerBlock(Cfg(norm_position="post"))(x)
    pre = TransformerBlock(Cfg(norm_position="pre"))(x)
    torch.testing.assert_close(post.mean(-1), torch.zeros(2, 5), atol=1e-5, rtol=0)
    assert pre.var(-1, unbiased=False).mean() > 4  # the stream keeps its scale: x passes through unchanged


def test_block_with_rmsnorm_uses_rmsnorm():
    block = TransformerBlock(Cfg(norm="rmsnorm"))
    assert isinstance(block.norm_1, RMSNorm) and isinstance(block.norm_2, RMSNorm)


def test_block_causal_mask_keeps_earlier_positions_fixed():
    torch.manual_seed(0)
    block = TransformerBlock(Cfg()).eval()
    mask = torch.ones(6, 6, dtype=torch.bool).tril()
    x = torch.randn(1, 6, 16)
    x2 = x.clone()
    x2[0, 4] += 1.0
    y, y2 = block(x, mask=mask), block(x2, mask=mask)
    torch.testing.assert_close(y[0, :4], y2[0, :4])
    assert not torch.allclose(y[0, 4], y2[0, 4])


def test_block_bad_config():
    with pytest.raises(ValueError, match=r"d_model \(18\) must be divisible by n_heads \(4\)"):
        TransformerBlock(Cfg(d_model=18))
    with pytest.raises(ValueError, match="norm_position must be one of"):
        TransformerBlock(Cfg(norm_position="middle"))
    with pytest.raises(ValueError, match="norm must be one of"):
        TransformerBlock(Cfg(norm="batchnorm"))


def test_block_bad_input_shapes():
    block = TransformerBlock(Cfg())
    expected = r"TransformerBlock expects x of shape \(batch, seq, d_model=16\), got \(2, 5, 8\)"
    with pytest.raises(ValueError, match=expected):
        block(torch.randn(2, 5, 8))
    with pytest.raises(ValueError, match=r"got \(5, 16\)"):
        block(torch.randn(5, 16))
    with pytest.raises(TypeError, match="torch.Tensor"):
        block([[0.0] * 16])
    with pytest.raises(ValueError, match=r"DecoderBlock expects x of shape"):
        DecoderBlock(Cfg())(torch.randn(1, 3, 12), torch.randn(1, 4, 16))


def test_block_parameter_count():
    d, f = 16, 32
    block = TransformerBlock(Cfg(d_model=d, d_ff=f))
    expected = 4 * (d * d + d) + (d * f + f) + (f * d + d) + 2 * 2 * d
    assert sum(p.numel() for p in block.parameters()) == expected


# ---- DecoderBlock ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("norm_position", ["pre", "post"])
def test_decoder_block_equals_its_equations(norm_position):
    torch.manual_seed(0)
    block = DecoderBlock(Cfg(norm_position=norm_position)).eval()
    x, memory = torch.randn(2, 5, 16), torch.randn(2, 7, 16)
    mask = torch.ones(5, 5, dtype=torch.bool).tril()
    sa, ca, ffn = block.self_attention, block.cross_attention, block.ffn
    n1, n2, n3 = block.norm_1, block.norm_2, block.norm_3
    if norm_position == "pre":
        h = x + sa(n1(x), mask=mask)
        h = h + ca(n2(h), memory)
        expected = h + ffn(n3(h))
    else:
        h = n1(x + sa(x, mask=mask))
        h = n2(h + ca(h, memory))
        expected = n3(h + ffn(h))
    torch.testing.assert_close(block(x, memory, mask=mask), expected)


def test_decoder_block_reads_memory_and_respects_memory_mask():
    torch.manual_seed(0)
    block = DecoderBlock(Cfg()).eval()
    x, memory = torch.randn(1, 3, 16), torch.randn(1, 4, 16)
    memory2 = memory.clone()
    memory2[0, 3] += 5.0
    assert not torch.allclose(block(x, memory), block(x, memory2))
    keep = torch.tensor([[True, True, True, False]])  # (n_q=1 broadcast, n_k): position 3 is padding
    torch.testing.assert_close(block(x, memory, memory_mask=keep), block(x, memory2, memory_mask=keep))


def test_decoder_block_bad_memory():
    with pytest.raises(ValueError, match=r"memory must have shape \(batch, source_seq, 16\)"):
        DecoderBlock(Cfg())(torch.randn(1, 3, 16), torch.randn(1, 4, 8))


def test_gelu_is_exact_erf_form():
    ffn = FeedForward(1, 1, activation="gelu")
    with torch.no_grad():
        ffn.W_in.weight.fill_(1.0)
        ffn.W_in.bias.zero_()
        ffn.W_out.weight.fill_(1.0)
        ffn.W_out.bias.zero_()
    x = torch.tensor([[1.0]])
    assert math.isclose(ffn(x).item(), 0.5 * (1 + math.erf(1 / math.sqrt(2))), rel_tol=1e-6)


@pytest.mark.parametrize("norm_position", ["pre", "post"])
def test_block_matches_torch_transformer_encoder_layer(norm_position):
    torch.manual_seed(0)
    cfg = Cfg(d_model=16, n_heads=4, d_ff=40, norm_position=norm_position)
    block = TransformerBlock(cfg).eval()
    _randomise(block.norm_1, 5)
    _randomise(block.norm_2, 6)
    ref = encoder_layer_like(block, 16, 4, 40, norm_first=norm_position == "pre")
    x = torch.randn(2, 7, 16)
    causal = torch.ones(7, 7, dtype=torch.bool).tril()
    torch_mask = nn.Transformer.generate_square_subsequent_mask(7)  # float: -inf above the diagonal
    torch.testing.assert_close(block(x, mask=causal), ref(x, src_mask=torch_mask), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(block(x), ref(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("norm_position", ["pre", "post"])
def test_decoder_block_matches_torch_transformer_decoder_layer(norm_position):
    torch.manual_seed(0)
    block = DecoderBlock(Cfg(d_model=16, n_heads=4, d_ff=24, norm_position=norm_position)).eval()
    for k, norm in enumerate((block.norm_1, block.norm_2, block.norm_3)):
        _randomise(norm, 10 + k)
    ref = nn.TransformerDecoderLayer(16, 4, 24, dropout=0.0, activation="gelu", batch_first=True,
                                     norm_first=norm_position == "pre", layer_norm_eps=1e-5)
    with torch.no_grad():
        for ours, theirs in ((block.self_attention, ref.self_attn), (block.cross_attention, ref.multihead_attn)):
            theirs.in_proj_weight.copy_(torch.cat([ours.W_q.weight, ours.W_k.weight, ours.W_v.weight]))
            theirs.in_proj_bias.copy_(torch.cat([ours.W_q.bias, ours.W_k.bias, ours.W_v.bias]))
            theirs.out_proj.load_state_dict(ours.W_o.state_dict())
        ref.linear1.load_state_dict(block.ffn.W_in.state_dict())
        ref.linear2.load_state_dict(block.ffn.W_out.state_dict())
        for ours, theirs in ((block.norm_1, ref.norm1), (block.norm_2, ref.norm2), (block.norm_3, ref.norm3)):
            theirs.load_state_dict(ours.state_dict())
    ref.eval()
    x, memory = torch.randn(2, 5, 16), torch.randn(2, 7, 16)
    causal = torch.ones(5, 5, dtype=torch.bool).tril()
    torch_causal = nn.Transformer.generate_square_subsequent_mask(5)
    padding = torch.tensor([[False] * 5 + [True] * 2, [False] * 7])  # torch: True = padding (may not attend)
    ours = block(x, memory, mask=causal, memory_mask=~padding[:, None, None, :])
    theirs = ref(x, memory, tgt_mask=torch_causal, memory_key_padding_mask=padding)
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)


# ---- hardening: numerics and API traps ------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("scale", [1.0, 300.0, 3000.0])
def test_norms_in_half_precision_match_torch_modules_for_large_inputs(dtype, scale):
    # around 300, x² overflows float16 (max 65 504): the statistics must be computed in float32
    g = torch.Generator().manual_seed(0)
    x = (scale + scale * 0.01 * torch.randn(4, 6, 32, generator=g)).to(dtype)
    ours_ln, ref_ln = LayerNorm(32).to(dtype), nn.LayerNorm(32, eps=1e-5).to(dtype)
    ours_rms, ref_rms = RMSNorm(32).to(dtype), nn.RMSNorm(32, eps=1e-6).to(dtype)
    _randomise(ours_ln), _randomise(ours_rms)
    ref_ln.load_state_dict(ours_ln.state_dict()), ref_rms.load_state_dict(ours_rms.state_dict())
    for ours, ref in ((ours_ln, ref_ln), (ours_rms, ref_rms)):
        got, expected = ours(x), ref(x)
        assert got.dtype == dtype and torch.isfinite(got).all()
        assert got.abs().amax() > 0.1, "not all zeros"
        torch.testing.assert_close(got, expected, atol=0, rtol=0)
    # and they are close to the float32 result
    torch.testing.assert_close(ours_rms(x).float(), ours_rms.float()(x.float()), atol=0.05, rtol=0.02)


def test_norms_and_ffn_name_a_dtype_mismatch():
    x = torch.randn(2, 8, dtype=torch.float64)
    with pytest.raises(TypeError, match=r"LayerNorm got x of dtype torch.float64 but its weight is torch.float32"):
        LayerNorm(8)(x)
    with pytest.raises(TypeError, match=r"FeedForward got x of dtype torch.float64"):
        FeedForward(8, 16)(x)


def test_block_config_with_zero_heads_or_string_dropout_is_a_clear_error():
    with pytest.raises(ValueError, match="config.n_heads must be a positive integer, got 0"):
        TransformerBlock(Cfg(n_heads=0))
    with pytest.raises(ValueError, match="config.n_heads must be a positive integer, got 0"):
        DecoderBlock(Cfg(n_heads=0))
    with pytest.raises(TypeError, match="dropout must be a number"):
        TransformerBlock(Cfg(dropout="0.1"))
    with pytest.raises(TypeError, match="dropout must be a number"):
        FeedForward(8, 16, dropout="0.1")
    with pytest.raises(TypeError, match="eps must be a positive number"):
        LayerNorm(8, eps="1e-5")


def test_layers_accept_numpy_integer_sizes():
    np = pytest.importorskip("numpy")
    assert LayerNorm(np.int64(8)).d == 8 and type(RMSNorm(np.int32(8)).d) is int
    assert FeedForward(np.int64(8), np.int64(16))(torch.randn(2, 8)).shape == (2, 8)


# --- modern FFN options ------------------------------------------------------------------------------------

def test_feedforward_gelu_tanh_closed_form():
    torch.manual_seed(0)
    ffn = FeedForward(6, 10, activation="gelu_tanh").double()
    x = torch.randn(2, 3, 6, dtype=torch.float64)
    h = x @ ffn.W_in.weight.T + ffn.W_in.bias
    phi = 0.5 * h * (1 + torch.tanh(math.sqrt(2 / math.pi) * (h + 0.044715 * h**3)))
    ref = phi @ ffn.W_out.weight.T + ffn.W_out.bias
    torch.testing.assert_close(ffn(x), ref, rtol=0, atol=1e-12)
    assert not torch.allclose(ffn(x), FeedForward(6, 10, activation="gelu").double()(x))


def test_feedforward_swiglu_matches_transformers_llama_mlp():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    torch.manual_seed(1)
    ref = LlamaMLP(LlamaConfig(hidden_size=8, intermediate_size=20, num_attention_heads=2,
                                   num_key_value_heads=2, hidden_act="silu", mlp_bias=False)).double()
    ffn = FeedForward(8, 20, activation="swiglu", bias=False).double()
    with torch.no_grad():
        ffn.W_gate.weight.copy_(ref.gate_proj.weight)
        ffn.W_in.weight.copy_(ref.up_proj.weight)
        ffn.W_out.weight.copy_(ref.down_proj.weight)
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    torch.testing.assert_close(ffn(x), ref(x), rtol=0, atol=1e-12)
    # closed form
    closed = (F.silu(x @ ffn.W_gate.weight.T) * (x @ ffn.W_in.weight.T)) @ ffn.W_out.weight.T
    torch.testing.assert_close(ffn(x), closed, rtol=0, atol=1e-12)
    # 3 matrices of d_model*d_ff: d_ff = 8/3 d_model matches a 4 d_model two-matrix FFN
    n_swiglu = sum(p.numel() for p in FeedForward(12, 32, activation="swiglu", bias=False).parameters())
    n_gelu = sum(p.numel() for p in FeedForward(12, 48, bias=False).parameters())
    assert n_swiglu == n_gelu == 2 * 12 * 48


def test_feedforward_bias_false_has_no_biases():
    for act in ("relu", "gelu", "gelu_tanh", "swiglu"):
        ffn = FeedForward(4, 8, activation=act, bias=False)
        assert all(not name.endswith("bias") for name, _ in ffn.named_parameters())
    assert FeedForward(4, 8, activation="swiglu").W_gate.bias is not None
    with pytest.raises(TypeError, match="bias"):
        FeedForward(4, 8, bias=1)
    with pytest.raises(ValueError, match="activation"):
        FeedForward(4, 8, activation="silu")
