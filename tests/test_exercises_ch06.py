"""Each chapter-6 checker accepts the reference solution (the notebook's hidden one), rejects plausible wrong
answers with a helpful message, and treats the unattempted stub kindly."""

import pytest
import torch

from groundup.exercises import checking as _checking
from groundup.exercises.ch06 import (
    check_layer_norm,
    check_parameter_count,
    check_pre_ln_block,
    check_rms_norm,
    check_swiglu,
)

# --- reference solutions (the same code as the notebook's hidden solution cells) ---------------------------


def layer_norm(x, weight, bias, eps):
    mu = x.mean(dim=-1, keepdim=True)
    var = (x - mu).pow(2).mean(dim=-1, keepdim=True)
    return weight * (x - mu) / torch.sqrt(var + eps) + bias


def rms_norm(x, weight, eps):
    return weight * x / torch.sqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)


def pre_ln_block(x, block, mask):
    x = x + block.attention(block.norm_1(x), mask=mask)
    return x + block.ffn(block.norm_2(x))


def count_parameters(c):
    d, f = c.d_model, c.d_ff
    norm = 2 * d if c.norm == "layernorm" else d
    block = 4 * (d * d + d) + (d * f + f) + (f * d + d) + 2 * norm
    total = c.vocab_size * d + c.n_layers * block
    if c.positional == "learned":
        total += c.context_length * d
    if c.positional == "relative":
        total += c.n_heads * (c.context_length + 1)
    if c.norm_position == "pre":
        total += norm
    if not c.tie_weights:
        total += c.vocab_size * d
    return total


def swiglu(x, W_gate, W_in, W_out):
    return (torch.nn.functional.silu(x @ W_gate.T) * (x @ W_in.T)) @ W_out.T


def stub(*args):
    raise NotImplementedError


# --- wrong answers --------------------------------------------------------------------------------------------


def layer_norm_unbiased(x, weight, bias, eps):
    return weight * (x - x.mean(-1, keepdim=True)) / torch.sqrt(x.var(-1, keepdim=True) + eps) + bias


def layer_norm_seeds_eps(x, weight, bias, eps):
    mu = x.mean(dim=-1, keepdim=True)
    sigma = (x - mu).pow(2).mean(dim=-1, keepdim=True).sqrt()
    return weight * (x - mu) / (sigma + eps) + bias


def layer_norm_no_affine(x, weight, bias, eps):
    return torch.nn.functional.layer_norm(x, x.shape[-1:], eps=eps)


def rms_norm_centred(x, weight, eps):
    return torch.nn.functional.layer_norm(x, x.shape[-1:], weight, None, eps)


def rms_norm_euclidean(x, weight, eps):
    return weight * x / torch.sqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def post_ln_block(x, block, mask):
    x = block.norm_1(x + block.attention(x, mask=mask))
    return block.norm_2(x + block.ffn(x))


def pre_ln_block_no_mask(x, block, mask):
    x = x + block.attention(block.norm_1(x))
    return x + block.ffn(block.norm_2(x))


def pre_ln_block_no_second_residual(x, block, mask):
    x = x + block.attention(block.norm_1(x), mask=mask)
    return block.ffn(block.norm_2(x))


def count_forgets_tying(c):
    return count_parameters(c) + (c.vocab_size * c.d_model if c.tie_weights else 0)


def count_always_final_norm(c):
    extra = 2 * c.d_model if c.norm == "layernorm" else c.d_model
    return count_parameters(c) + (extra if c.norm_position == "post" else 0)


def count_float(c):
    return float(count_parameters(c))


def swiglu_silu_on_up(x, W_gate, W_in, W_out):
    return ((x @ W_gate.T) * torch.nn.functional.silu(x @ W_in.T)) @ W_out.T


def swiglu_sigmoid(x, W_gate, W_in, W_out):
    return (torch.sigmoid(x @ W_gate.T) * (x @ W_in.T)) @ W_out.T


def swiglu_plain_ffn(x, W_gate, W_in, W_out):
    return torch.nn.functional.silu(x @ W_in.T) @ W_out.T


# --- tests ----------------------------------------------------------------------------------------------------

CHECKERS = [
    (check_layer_norm, layer_norm),
    (check_rms_norm, rms_norm),
    (check_pre_ln_block, pre_ln_block),
    (check_parameter_count, count_parameters),
    (check_swiglu, swiglu),
]


@pytest.mark.parametrize("checker,solution", CHECKERS)
def test_reference_solution_passes(checker, solution, capsys):
    assert checker(solution).passed is True
    assert "✅" in capsys.readouterr().out


@pytest.mark.parametrize("checker,solution", CHECKERS)
def test_stub_is_not_attempted(checker, solution, capsys):
    assert checker(stub).passed is False
    assert "not attempted yet" in capsys.readouterr().out


@pytest.mark.parametrize("checker,wrong,hint", [
    (check_layer_norm, layer_norm_unbiased, "unbiased variance"),
    (check_layer_norm, layer_norm_seeds_eps, "seeds' σ + ε"),
    (check_layer_norm, layer_norm_no_affine, "forgot the learned scale and shift"),
    (check_rms_norm, rms_norm_centred, "does not centre"),
    (check_rms_norm, rms_norm_euclidean, "mean of the squares"),
    (check_pre_ln_block, post_ln_block, "Post-LN"),
    (check_pre_ln_block, pre_ln_block_no_mask, "Pass mask=mask"),
    (check_pre_ln_block, pre_ln_block_no_second_residual, "second residual connection"),
    (check_parameter_count, count_forgets_tying, "count it once"),
    (check_parameter_count, count_always_final_norm, "only Pre-LN has a final norm"),
    (check_parameter_count, count_float, "Return a Python int"),
    (check_swiglu, swiglu_silu_on_up, "SiLU goes on the gate"),
    (check_swiglu, swiglu_sigmoid, "not sigmoid(z) alone"),
    (check_swiglu, swiglu_plain_ffn, "That is a plain FFN"),
])
def test_wrong_answers_are_rejected_with_a_hint(checker, wrong, hint, capsys):
    assert checker(wrong).passed is False
    out = capsys.readouterr().out
    assert "❌" in out and hint in out, out


def test_crashing_solution_becomes_a_verdict(capsys):
    def crashes(x, weight, bias, eps):
        return x @ torch.ones(3, 3)

    assert check_layer_norm(crashes).passed is False
    assert "raised RuntimeError" in capsys.readouterr().out


def test_float32_norms_of_float64_inputs_pass(capsys):
    assert check_layer_norm(lambda x, w, b, eps: layer_norm(x.float(), w.float(), b.float(), eps)), \
        capsys.readouterr().out
    assert check_rms_norm(lambda x, w, eps: rms_norm(x.float(), w.float(), eps)), capsys.readouterr().out


def test_a_float32_wrong_layer_norm_gets_its_hint_not_a_checker_crash(capsys):
    assert not check_layer_norm(lambda x, w, b, eps: layer_norm_unbiased(x.float(), w.float(), b.float(), eps))
    out = capsys.readouterr().out
    assert "unbiased variance" in out and "checker itself crashed" not in out


def test_a_block_that_zeroes_its_parameters_fails(capsys):
    def zero_block(x, block, mask):
        for p in block.parameters():
            p.zero_()
        return pre_ln_block(x, block, mask)

    assert not check_pre_ln_block(zero_block)
    assert "changed its input block in place" in capsys.readouterr().out


def test_swiglu_solution_equals_the_llama_mlp_of_transformers():
    """The reference solution is the FFN of LLaMA as the transformers library implements it."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=8, intermediate_size=20, num_attention_heads=2, num_key_value_heads=2,
                         hidden_act="silu", mlp_bias=False)
    mlp = LlamaMLP(config).double()
    x = torch.randn(3, 4, 8, dtype=torch.float64)
    expected = mlp(x)
    got = swiglu(x, mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight)
    torch.testing.assert_close(got, expected)
    assert expected.abs().max() > 0.01


@pytest.fixture(autouse=True)
def _unwrapped_verdicts(monkeypatch):
    """Match hints as whole lines; tests/test_checking.py tests the wrapping to the book's width."""
    monkeypatch.setattr(_checking, "MESSAGE_WIDTH", 10_000)


def test_calling_the_blocks_own_forward_is_refused(capsys):
    assert not check_pre_ln_block(lambda x, block, mask: block(x, mask=mask))
    out = capsys.readouterr().out
    assert "calls groundup.layers.TransformerBlock.forward" in out, out
