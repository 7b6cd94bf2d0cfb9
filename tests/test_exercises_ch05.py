"""Each chapter-5 checker accepts the reference solution (the notebook's hidden one), rejects a plausible wrong
answer with a helpful message, and treats the unattempted stub kindly."""

import math
import re

import pytest
import torch

from groundup.exercises import checking as _checking
from groundup.exercises.ch05 import check_attention, check_mha_parameters, check_padding_mask, check_split_heads

# --- reference solutions (the same code as the notebook's hidden solution cells) ---------------------------


def attention(q, k, v, mask=None):
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(scores, dim=-1)
    return weights @ v, weights


def padding_mask(lengths, n):
    keep = torch.arange(n) < lengths[:, None]  # (batch, n): True for real tokens
    return keep[:, None, None, :]


def split_heads(x, n_heads):
    batch, seq, d_model = x.shape
    return x.view(batch, seq, n_heads, d_model // n_heads).transpose(1, 2)


def mha_parameters(d_model, n_heads, d_head):
    inner = n_heads * d_head
    return 3 * (d_model * inner + inner) + (inner * d_model + d_model)


def stub(*args, **kwargs):
    raise NotImplementedError


# --- wrong answers --------------------------------------------------------------------------------------------


def attention_unscaled(q, k, v, mask=None):
    weights = torch.softmax(q @ k.transpose(-2, -1), dim=-1)
    return weights @ v, weights


def attention_divided_by_d_k(q, k, v, mask=None):
    scores = q @ k.transpose(-2, -1) / q.shape[-1]  # d_k instead of sqrt(d_k)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(scores, dim=-1)
    return weights @ v, weights


def attention_mask_after_softmax(q, k, v, mask=None):
    weights = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), dim=-1)
    if mask is not None:
        weights = weights.masked_fill(~mask, 0.0)
    return weights @ v, weights


def attention_softmax_over_queries(q, k, v, mask=None):
    weights = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), dim=-2)
    return weights @ v, weights


def padding_mask_inverted(lengths, n):
    return ~padding_mask(lengths, n)


def padding_mask_flat(lengths, n):
    return torch.arange(n) < lengths[:, None]


def split_heads_no_transpose(x, n_heads):
    batch, seq, d_model = x.shape
    return x.reshape(batch, n_heads, seq, d_model // n_heads)


def mha_parameters_no_bias(d_model, n_heads, d_head):
    return 4 * d_model * n_heads * d_head


def mha_parameters_square(d_model, n_heads, d_head):
    return 4 * d_model * d_model + 4 * d_model  # ignores d_head


# --- tests ----------------------------------------------------------------------------------------------------

CASES = [
    (check_attention, attention, [
        (attention_unscaled, "sqrt"),
        (attention_divided_by_d_k, r"divided by d_k = 16, not by sqrt\(d_k\) = 4"),
        (attention_mask_after_softmax, "Mask before normalising"),
        (attention_softmax_over_queries, "last dimension"),
    ]),
    (check_padding_mask, padding_mask, [
        (padding_mask_inverted, "True means 'may attend'"),
        (padding_mask_flat, r"\(batch, 1, 1, n\)"),
    ]),
    (check_split_heads, split_heads, [(split_heads_no_transpose, "transpose")]),
    (check_mha_parameters, mha_parameters, [
        (mha_parameters_no_bias, "biases"),
        (mha_parameters_square, "n_heads\\*d_head"),
    ]),
]


@pytest.mark.parametrize("checker, solution", [(c, s) for c, s, _ in CASES])
def test_checker_accepts_reference_solution(checker, solution, capsys):
    assert checker(solution).passed is True
    assert "✅" in capsys.readouterr().out


@pytest.mark.parametrize("checker, wrong, hint",
                         [(c, w, h) for c, _, wrongs in CASES for w, h in wrongs])
def test_checker_rejects_wrong_solution_with_hint(checker, wrong, hint, capsys):
    assert checker(wrong).passed is False
    out = capsys.readouterr().out
    assert "❌" in out
    assert "Hint:" in out
    assert re.search(hint, out), out


@pytest.mark.parametrize("checker", [c for c, _, _ in CASES])
def test_checker_handles_stub(checker, capsys):
    assert checker(stub).passed is False
    assert "not attempted yet" in capsys.readouterr().out


def test_attention_checker_rejects_mask_that_leaves_masked_weights_nonzero(capsys):
    def attention_ignores_mask(q, k, v, mask=None):
        return attention(q, k, v)

    assert check_attention(attention_ignores_mask).passed is False
    assert "masked weights are not exactly 0" in capsys.readouterr().out


def test_attention_that_scales_q_in_place_is_reported_not_misjudged(capsys):
    def scales_q_in_place(q, k, v, mask=None):
        q /= math.sqrt(q.shape[-1])
        scores = q @ k.transpose(-2, -1)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        weights = torch.softmax(scores, dim=-1)
        return weights @ v, weights

    assert not check_attention(scales_q_in_place)
    out = capsys.readouterr().out
    assert "changed its input q in place" in out and "without the scaling" not in out


def test_float32_attention_of_float64_inputs_passes(capsys):
    def in_float32(q, k, v, mask=None):
        return attention(q.float(), k.float(), v.float(), mask)

    assert check_attention(in_float32), capsys.readouterr().out


def test_attention_returning_one_tensor_names_the_pair(capsys):
    assert not check_attention(lambda q, k, v, mask=None: attention(q, k, v, mask)[0])
    assert "expected a pair (out, weights)" in capsys.readouterr().out


@pytest.fixture(autouse=True)
def _unwrapped_verdicts(monkeypatch):
    """Match hints as whole lines; tests/test_checking.py tests the wrapping to the book's width."""
    monkeypatch.setattr(_checking, "MESSAGE_WIDTH", 10_000)


def test_the_packages_attention_is_refused(capsys):
    from groundup.attention import attention_weights, scaled_dot_product_attention

    def via_the_package(q, k, v, mask=None):
        return scaled_dot_product_attention(q, k, v, mask=mask), attention_weights(q, k, mask=mask)

    assert not check_attention(via_the_package)
    assert "calls groundup.attention.scaled_dot_product_attention" in capsys.readouterr().out
