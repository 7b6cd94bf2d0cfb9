"""Each chapter-12 checker accepts the reference solution, rejects plausible wrong answers with the right hint,
treats the unattempted stub kindly and reports answers that modify their inputs."""

import pytest
import torch

from groundup.exercises.ch12 import (
    check_gpt2_parameter_count,
    check_rotary_permutation,
    check_split_c_attn,
    gpt2_parameters,
)
from groundup.models import GPT, GPTConfig

# --- reference solutions (the notebook's hidden solutions) ----------------------------------------------------


def split_solution(weight, bias):
    d = weight.shape[0]
    w_q, w_k, w_v = (weight[:, i * d:(i + 1) * d].T for i in range(3))
    b_q, b_k, b_v = bias.split(d)
    return w_q, w_k, w_v, b_q, b_k, b_v


def count_solution(n_layers, d_model, vocab_size, context_length):
    d = d_model
    per_block = 12 * d * d + 13 * d
    return vocab_size * d + context_length * d + n_layers * per_block + 2 * d


def permutation_solution(d_head):
    return [j for i in range(d_head // 2) for j in (i, i + d_head // 2)]


def stub(*args):
    raise NotImplementedError


def verdict(checker, fn, capsys):
    ok = checker(fn)
    return bool(ok), capsys.readouterr().out


@pytest.mark.parametrize("checker, solution", [(check_split_c_attn, split_solution),
                                               (check_gpt2_parameter_count, count_solution),
                                               (check_rotary_permutation, permutation_solution)])
def test_reference_passes_and_stub_is_not_attempted(checker, solution, capsys):
    ok, out = verdict(checker, solution, capsys)
    assert ok and "✅" in out, out
    ok, out = verdict(checker, stub, capsys)
    assert not ok and "not attempted yet" in out


# --- 12.1 --------------------------------------------------------------------------------------------------


def test_split_without_transposing_is_named(capsys):
    def untransposed(weight, bias):
        d = weight.shape[0]
        return (*(weight[:, i * d:(i + 1) * d] for i in range(3)), *bias.split(d))

    ok, out = verdict(check_split_c_attn, untransposed, capsys)
    assert not ok and "transpose of what nn.Linear needs" in out, out


def test_split_in_the_wrong_order_is_rejected(capsys):
    def swapped(weight, bias):
        w_q, w_k, w_v, b_q, b_k, b_v = split_solution(weight, bias)
        return w_k, w_q, w_v, b_k, b_q, b_v

    ok, out = verdict(check_split_c_attn, swapped, capsys)
    assert not ok and "W_q" in out and "Columns 0..d-1 of weight produce q" in out, out


def test_split_in_place_is_reported(capsys):
    def in_place(weight, bias):
        out = split_solution(weight.clone(), bias.clone())
        bias.zero_()
        return out

    ok, out = verdict(check_split_c_attn, in_place, capsys)
    assert not ok and "in place" in out, out


# --- 12.2 --------------------------------------------------------------------------------------------------


def test_the_closed_form_counts_a_gpt2_shaped_gpt():
    config = GPTConfig(vocab_size=65, context_length=16, d_model=8, n_layers=2, n_heads=2, positional="learned")
    model = GPT(config)
    assert sum(p.numel() for p in model.parameters()) == gpt2_parameters(2, 8, 65, 16)
    assert gpt2_parameters(12, 768, 50257, 1024) == 124_439_808


def test_untied_count_is_named(capsys):
    ok, out = verdict(check_gpt2_parameter_count, lambda n, d, v, c: count_solution(n, d, v, c) + v * d, capsys)
    assert not ok and "ties the unembedding" in out, out


def test_count_without_positions_is_named(capsys):
    ok, out = verdict(check_gpt2_parameter_count, lambda n, d, v, c: count_solution(n, d, v, c) - c * d, capsys)
    assert not ok and "positional table" in out, out


def test_count_as_string_is_refused(capsys):
    ok, out = verdict(check_gpt2_parameter_count, lambda n, d, v, c: "124M", capsys)
    assert not ok and "as an int" in out, out


# --- 12.3 --------------------------------------------------------------------------------------------------


def test_inverse_permutation_is_rejected(capsys):
    def inverse(d):
        perm = permutation_solution(d)
        inv = [0] * d
        for i, p in enumerate(perm):
            inv[p] = i
        return inv

    ok, out = verdict(check_rotary_permutation, inverse, capsys)
    assert not ok and "position 2i must take i" in out, out


def test_non_permutation_is_rejected(capsys):
    ok, out = verdict(check_rotary_permutation, lambda d: [0] * d, capsys)
    assert not ok and "not a permutation" in out, out


def test_tensor_permutation_is_accepted(capsys):
    ok, out = verdict(check_rotary_permutation, lambda d: torch.tensor(permutation_solution(d)), capsys)
    assert ok, out
