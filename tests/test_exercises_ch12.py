"""Each chapter-12 checker accepts the reference solution, rejects plausible wrong answers with the right hint,
treats the unattempted stub kindly and reports answers that modify their inputs."""

import pytest
import torch
from gguf import GGMLQuantizationType
from gguf import quants as gguf_quants

from groundup import quantization as Q
from groundup.exercises import checking as _checking
from groundup.exercises.ch12 import (
    check_decode_q4_1_block,
    check_gguf_bytes,
    check_gpt2_parameter_count,
    check_rotary_permutation,
    check_split_c_attn,
    gguf_tensor_bytes,
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
    assert not ok and "(8) = [0, 2, 4, 6, 1, 3, 5, 7]" in out and "positions 0 and 1 of x[perm] together" in out, out
    assert "Which two dimensions does rotate-half pair at frequency 0?" in out
    assert "must take" not in out, "the hint does not give the answer away"


def test_a_swapped_pair_is_named(capsys):
    ok, out = verdict(check_rotary_permutation, lambda d: [1, 0] if d == 2 else permutation_solution(d), capsys)
    assert not ok and "Positions 0 and 1 hold the right pair of dimensions in the wrong order" in out, out


def test_non_permutation_is_rejected(capsys):
    ok, out = verdict(check_rotary_permutation, lambda d: [0] * d, capsys)
    assert not ok and "not a permutation" in out, out


def test_tensor_permutation_is_accepted(capsys):
    ok, out = verdict(check_rotary_permutation, lambda d: torch.tensor(permutation_solution(d)), capsys)
    assert ok, out


@pytest.mark.parametrize("answer, message, hint", [
    (lambda d: [float(i) for i in permutation_solution(d)], "returned a list whose entries are float (e.g. 0.0)",
     "The entries must be ints: indices into x (int(i) for i in ...)."),
    (lambda d: [True, False], "returned a list whose entries are bool (e.g. True)", "The entries must be ints"),
    (lambda d: torch.tensor(permutation_solution(d), dtype=torch.float32),
     "returned a tensor whose entries are float (e.g. 0.0)", "The entries must be ints"),
    (lambda d: permutation_solution(d)[:-1], "returned a list of 1 entry, expected 2",
     "Return a list of 2 ints: one index of x for each position"),
    (lambda d: "0 1", "returned str", "Return a list of 2 ints"),
])
def test_an_answer_of_the_wrong_kind_is_told_what_is_wrong_with_it(answer, message, hint, capsys):
    ok, out = verdict(check_rotary_permutation, answer, capsys)
    out = " ".join(out.split())
    assert not ok and f"my_rotary_permutation(2) {message}" in out and hint in out, out


# --- 12.6 and 12.7: quantization -----------------------------------------------------------------------------


def decode_q4_1_solution(block):
    d, m = block[:4].view(torch.float16).float()
    packed = block[4:]
    q = torch.cat([packed & 0x0F, packed >> 4]).float()
    return d * q + m


def gguf_bytes_solution(n_layers, d_model, n_heads, n_kv_heads, d_ff, vocab_size, matrices, embedding):
    size = {"F32": 4, "F16": 2, "Q8_0": 34 / 32, "Q4_1": 20 / 32}
    d_kv = d_model // n_heads * n_kv_heads
    per_block = 2 * d_model * d_model + 2 * d_model * d_kv + 3 * d_model * d_ff
    return round(n_layers * per_block * size[matrices] + vocab_size * d_model * size[embedding]
                 + (2 * n_layers + 1) * d_model * 4)


@pytest.mark.parametrize("checker, solution", [(check_decode_q4_1_block, decode_q4_1_solution),
                                               (check_gguf_bytes, gguf_bytes_solution)])
def test_quantization_references_pass_and_stubs_are_not_attempted(checker, solution, capsys):
    ok, out = verdict(checker, solution, capsys)
    assert ok and "✅" in out, out
    ok, out = verdict(checker, stub, capsys)
    assert not ok and "not attempted yet" in out


def test_q4_1_neighbouring_nibbles_are_named(capsys):
    def neighbours(block):
        d, m = block[:4].view(torch.float16).float()
        packed = block[4:]
        return d * torch.stack([packed & 0x0F, packed >> 4], dim=1).reshape(-1).float() + m

    ok, out = verdict(check_decode_q4_1_block, neighbours, capsys)
    assert not ok and "not neighbours" in out, out


def test_q4_1_without_the_minimum_is_named(capsys):
    ok, out = verdict(check_decode_q4_1_block, lambda b: decode_q4_1_solution(b) - b[2:4].view(torch.float16).float(),
                      capsys)
    assert not ok and "x = d q + m" in out, out


@pytest.mark.parametrize("package_call", [
    lambda b: Q.dequantize(b, Q.Q4_1, (32,)),
    lambda b: Q.q4_1_decode_blocks(*(t.view(torch.float16) for t in b[:4].reshape(2, 2)),
                                   Q.unpack_nibbles(b[4:][None]))[0],
    lambda b: torch.from_numpy(gguf_quants.dequantize(b.numpy(), GGMLQuantizationType.Q4_1)),
])
def test_q4_1_package_decoders_are_refused(package_call, capsys):
    ok, out = verdict(check_decode_q4_1_block, package_call, capsys)
    assert not ok and "decode the bytes yourself" in out, out


def test_q4_1_answers_that_are_not_plain_dense_tensors_are_refused(capsys):
    ok, out = verdict(check_decode_q4_1_block, lambda b: decode_q4_1_solution(b).to_sparse(), capsys)
    assert not ok and "layout torch.sparse_coo" in out, out
    ok, out = verdict(check_decode_q4_1_block, lambda b: decode_q4_1_solution(b).tolist(), capsys)
    assert not ok and "returned list" in out, out


def test_gguf_bytes_is_the_file_of_smollm2_and_the_parameter_count_of_its_gpt():
    # The file's tensor data: 98,362,432 bytes in all, of which the first 1,785,664 are header, metadata and table.
    assert gguf_tensor_bytes(30, 576, 9, 3, 1536, 49152, "Q4_1", "Q8_0") == 98_362_432 - 1_785_664
    def count(vocab_size, n_layers):  # SmolLM2's GPT, small enough to build here
        config = GPTConfig(vocab_size=vocab_size, context_length=64, d_model=576, n_layers=n_layers, n_heads=9,
                           n_kv_heads=3, d_ff=1536, positional="rope", norm="rmsnorm", activation="swiglu", bias=False)
        return sum(p.numel() for p in GPT(config).parameters())

    one_block = count(32, 2) - count(32, 1)
    n_parameters = count(32, 1) + 29 * one_block + (49152 - 32) * (count(33, 1) - count(32, 1))
    assert n_parameters == 134_515_008
    assert gguf_tensor_bytes(30, 576, 9, 3, 1536, 49152, "F32", "F32") == 4 * n_parameters


def test_gguf_bytes_without_block_scales_is_named(capsys):
    def four_bits(n_layers, d_model, n_heads, n_kv_heads, d_ff, vocab_size, matrices, embedding):
        size = {"F32": 4, "F16": 2, "Q8_0": 1, "Q4_1": 0.5}
        d_kv = d_model // n_heads * n_kv_heads
        per_block = 2 * d_model * d_model + 2 * d_model * d_kv + 3 * d_model * d_ff
        return round(n_layers * per_block * size[matrices] + vocab_size * d_model * size[embedding]
                     + (2 * n_layers + 1) * d_model * 4)

    ok, out = verdict(check_gguf_bytes, four_bits, capsys)
    assert not ok and "34 bytes per 32 numbers" in out, out


def test_gguf_bytes_with_full_size_key_value_heads_is_named(capsys):
    ok, out = verdict(check_gguf_bytes, lambda n, d, h, kv, f, v, m, e: gguf_bytes_solution(n, d, h, h, f, v, m, e),
                      capsys)
    assert not ok and "grouped-query attention" in out, out


@pytest.fixture(autouse=True)
def _unwrapped_verdicts(monkeypatch):
    """Match hints as whole lines; tests/test_checking.py tests the wrapping to the book's width."""
    monkeypatch.setattr(_checking, "MESSAGE_WIDTH", 10_000)


def test_the_checkers_own_count_is_refused(capsys):
    from groundup.exercises.ch12 import gpt2_parameters

    ok, out = verdict(check_gpt2_parameter_count, gpt2_parameters, capsys)
    assert not ok and "calls groundup.exercises.ch12.gpt2_parameters" in out, out
    assert gpt2_parameters(12, 768, 50257, 1024) == 124_439_808, "the function works again afterwards"


# --- the package's own solutions are refused (bypasses a review found) -------------------------------------------


def test_counting_a_gpt_built_on_the_meta_device_is_refused(capsys):
    def built(n_layers, d_model, vocab_size, context_length):
        config = GPTConfig(vocab_size=vocab_size, context_length=context_length, d_model=d_model, n_layers=n_layers,
                           n_heads=1, positional="learned")
        with torch.device("meta"):
            return sum(p.numel() for p in GPT(config).parameters())

    assert built(2, 8, 65, 16) == gpt2_parameters(2, 8, 65, 16), "the trick gives the right number"
    ok, out = verdict(check_gpt2_parameter_count, built, capsys)
    assert not ok and "calls groundup.models.GPT" in out and "without building a model" in out, out
    assert built(2, 8, 65, 16) == gpt2_parameters(2, 8, 65, 16), "GPT can be built again afterwards"


def test_counting_a_transformers_gpt2_is_refused(capsys):
    from transformers import GPT2Config, GPT2LMHeadModel

    def built(n_layers, d_model, vocab_size, context_length):
        config = GPT2Config(n_layer=n_layers, n_embd=d_model, n_head=1, vocab_size=vocab_size,
                            n_positions=context_length)
        with torch.device("meta"):
            return GPT2LMHeadModel(config).num_parameters()

    assert built(2, 8, 65, 16) == gpt2_parameters(2, 8, 65, 16), "the trick gives the right number"
    ok, out = verdict(check_gpt2_parameter_count, built, capsys)
    assert not ok and "calls transformers" in out and "without building a model" in out, out
    assert built(2, 8, 65, 16) == gpt2_parameters(2, 8, 65, 16), "GPT2LMHeadModel can be built again afterwards"


def test_the_checkers_own_q4_1_decoder_is_refused(capsys):
    from groundup.exercises import ch12

    def reference(block):
        return torch.tensor(ch12._q4_1_reference(bytes(block.tolist())))

    ok, out = verdict(check_decode_q4_1_block, reference, capsys)
    assert not ok and "calls groundup.exercises.ch12._q4_1_reference" in out, out
    block = bytes.fromhex("003800c0") + bytes(range(16))  # d = 0.5, m = -2, q = 0, ..., 15 then all 0
    assert ch12._q4_1_reference(block) == [0.5 * q - 2 for q in range(16)] + [-2.0] * 16, "it works afterwards"


def test_the_checkers_own_byte_count_is_refused(capsys):
    ok, out = verdict(check_gguf_bytes, lambda *args: gguf_tensor_bytes(*args), capsys)
    assert not ok and "calls groundup.exercises.ch12.gguf_tensor_bytes" in out, out
    assert gguf_tensor_bytes(30, 576, 9, 3, 1536, 49152, "Q4_1", "Q8_0") == 96_576_768, "it works afterwards"


def test_the_byte_count_may_use_the_chapters_n_bytes(capsys):
    """The chapter computes sizes with Q.n_bytes before the exercise: an answer built on it is the reader's own."""
    types = {"F32": Q.F32, "F16": Q.F16, "Q8_0": Q.Q8_0, "Q4_1": Q.Q4_1}

    def with_n_bytes(n_layers, d_model, n_heads, n_kv_heads, d_ff, vocab_size, matrices, embedding):
        d_kv = d_model // n_heads * n_kv_heads
        per_block = 2 * d_model * d_model + 2 * d_model * d_kv + 3 * d_model * d_ff
        return (Q.n_bytes((n_layers * per_block,), types[matrices]) + Q.n_bytes((vocab_size * d_model,),
                types[embedding]) + Q.n_bytes(((2 * n_layers + 1) * d_model,), Q.F32))

    ok, out = verdict(check_gguf_bytes, with_n_bytes, capsys)
    assert ok, out
