"""groundup.quantized_linear: a linear layer computing from GGUF blocks, against dequantize-then-F.linear, and a
GPT loaded with its matrices kept quantized against the float32 one (tests/test_smollm2.py has the real model's
greedy tokens)."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType

from groundup import quantization as Q
from groundup.quantization import BLOCK_TYPES, block_parts
from groundup.quantized_linear import QuantizedEmbedding, QuantizedLinear, _BlockWeight

NAMES = [Q.TYPE_NAMES[t] for t in BLOCK_TYPES]


def _raw(name: str, rows: int, cols: int, seed: int = 0) -> tuple[torch.Tensor, int]:
    ggml_type = int(GGMLQuantizationType[name])
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)) * 0.05
    return Q.quantize(x, ggml_type), ggml_type


def test_every_gguf_block_type_is_kept():
    assert sorted(NAMES) == sorted(["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"])


@pytest.mark.parametrize("name", NAMES)
def test_the_kept_numbers_give_dequantize_bit_for_bit(name):
    raw, ggml_type = _raw(name, 64, 512)
    q, step, offset, group = block_parts(raw, ggml_type, (64, 512))
    assert q.dtype == torch.int8 and q.shape == (64, 512) and step.shape == (64, 512 // group)
    assert (offset is None) == (name in ("Q8_0", "Q4_0", "Q5_0", "Q3_K", "Q6_K"))
    layer = QuantizedLinear.from_gguf(raw, ggml_type, (64, 512))
    assert torch.equal(layer.weight, Q.dequantize(raw, ggml_type, (64, 512)))
    # one byte a weight, plus 4 bytes per group for the step (and the offset)
    per_weight = layer.numbers.n_bytes() / (64 * 512)
    assert per_weight == 1 + 4 / group * (1 if offset is None else 2)


@pytest.mark.parametrize("name", ["Q4_1", "Q8_0", "Q6_K"])
@pytest.mark.parametrize("rows", [1, 7])
def test_forward_equals_f_linear_on_the_dequantized_matrix(name, rows, monkeypatch):
    # Slices of 64 rows, so that a 1,000-row matrix takes 16 of them, the last one short.
    monkeypatch.setattr("groundup.quantized_linear.SLICE_ELEMENTS", 64 * 512)
    raw, ggml_type = _raw(name, 1000, 512, seed=1)
    layer = QuantizedLinear.from_gguf(raw, ggml_type, (1000, 512))
    assert layer.rows_per_slice == 64
    x = torch.randn(2, rows, 512, generator=torch.Generator().manual_seed(2))
    expected = F.linear(x, Q.dequantize(raw, ggml_type, (1000, 512)))
    got = layer(x)
    assert got.shape == (2, rows, 1000)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_the_embedding_looks_up_the_same_rows():
    raw, ggml_type = _raw("Q8_0", 50, 64)
    numbers = _BlockWeight(*block_parts(raw, ggml_type, (50, 64)), ggml_type=ggml_type)
    embedding, unembedding = QuantizedEmbedding(numbers), QuantizedLinear(numbers)
    ids = torch.tensor([[3, 49, 0], [7, 7, 12]])
    full = Q.dequantize(raw, ggml_type, (50, 64))
    assert torch.equal(embedding(ids), full[ids])
    assert unembedding.numbers is embedding.numbers  # tied: one copy of the numbers
    with pytest.raises(ValueError, match=r"ids must lie in \[0, 49\].*got 50"):
        embedding(torch.tensor([50]))
    with pytest.raises(TypeError, match="integer dtype"):
        embedding(torch.tensor([1.0]))


def test_bad_input_is_refused_naming_it():
    raw, ggml_type = _raw("Q4_K", 4, 256)
    layer = QuantizedLinear.from_gguf(raw, ggml_type, (4, 256))
    with pytest.raises(ValueError, match=r"x must have shape \[\.\.\., 256\]"):
        layer(torch.zeros(3, 255))
    with pytest.raises(TypeError, match="computes in float32.*bfloat16"):
        layer(torch.zeros(1, 256, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="2-D block-quantized tensor, got F32"):
        block_parts(torch.zeros(16, dtype=torch.uint8), Q.F32, (2, 2))
    with pytest.raises(ValueError, match="raw holds 10 bytes"):
        QuantizedLinear.from_gguf(torch.zeros(10, dtype=torch.uint8), Q.Q8_0, (1, 32))


def test_a_gguf_model_kept_quantized_computes_what_the_float32_one_does(tmp_path):
    # A small LLaMA-shaped file written by the gguf package, every matrix in another block type.
    gguf = pytest.importorskip("gguf")
    from groundup.models import GPT, GPTConfig
    from groundup.pretrained import byte_level_alphabet, gguf_tensor_names, load_gguf

    config = GPTConfig(vocab_size=257, context_length=32, d_model=256, n_layers=2, n_heads=4, n_kv_heads=2,
                       d_ff=512, positional="rope", rope_pairing="interleaved", norm="rmsnorm", norm_position="pre",
                       activation="swiglu", bias=False, tie_weights=True, rope_base=10000.0, norm_eps=1e-5)
    torch.manual_seed(0)
    model = GPT(config)
    writer = gguf.GGUFWriter(tmp_path / "small.gguf", "llama")
    for key, value in {"embedding_length": 256, "block_count": 2, "feed_forward_length": 512,
                       "attention.head_count": 4, "attention.head_count_kv": 2, "context_length": 32,
                       "vocab_size": 257}.items():
        writer.add_uint32(f"llama.{key}", value)
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    writer.add_float32("llama.rope.freq_base", 10000.0)
    writer.add_string("tokenizer.ggml.model", "gpt2")
    writer.add_array("tokenizer.ggml.tokens", [*byte_level_alphabet(), "Ġt"])  # bytes, and one merge
    writer.add_array("tokenizer.ggml.token_type", [1] * 257)
    writer.add_array("tokenizer.ggml.merges", ["Ġ t"])
    kinds = iter(["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"] * 3)
    params = dict(model.named_parameters())
    for ours, theirs in gguf_tensor_names(config).items():
        value = params[ours].detach().float().numpy()
        if value.ndim == 2:
            qtype = GGMLQuantizationType[next(kinds)]
            writer.add_tensor(theirs, Q.quantize(torch.from_numpy(value), int(qtype)).numpy()
                              .reshape(value.shape[0], -1), raw_dtype=qtype)
        else:
            writer.add_tensor(theirs, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    dense, _ = load_gguf(tmp_path / "small.gguf")
    kept, _ = load_gguf(tmp_path / "small.gguf", keep_quantized=True)
    assert isinstance(kept.blocks[1].ffn.W_out, QuantizedLinear) and isinstance(kept.token_embedding,
                                                                                  QuantizedEmbedding)
    assert kept.unembedding.numbers is kept.token_embedding.numbers
    assert not any(t.is_meta for t in [*kept.parameters(), *kept.buffers()])
    ids = torch.randint(0, 257, (2, 20), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(kept(ids)[0], dense(ids)[0], rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="keep_quantized=True computes in float32"):
        load_gguf(tmp_path / "small.gguf", keep_quantized=True, dtype=torch.bfloat16)
    np.testing.assert_array_equal(kept.final_norm.weight.detach().numpy(), dense.final_norm.weight.detach().numpy())


def test_inference_mode_gradients_and_a_converted_model():
    raw, ggml_type = _raw("Q4_1", 300, 64)
    layer = QuantizedLinear.from_gguf(raw, ggml_type, (300, 64))
    layer.rows_per_slice = 128  # three slices
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():  # a scratch buffer first made here must still serve outside inference mode
        inside = layer(x)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), inside)
    w = Q.dequantize(raw, ggml_type, (300, 64))
    x.requires_grad_(True)
    layer(x).square().sum().backward()  # the slices autograd keeps are not overwritten by the next ones
    expected = x.detach().clone().requires_grad_(True)
    F.linear(expected, w).square().sum().backward()
    torch.testing.assert_close(x.grad, expected.grad, rtol=1e-4, atol=1e-5)
    layer.to(torch.bfloat16)
    with pytest.raises(TypeError, match="block steps are torch.bfloat16, not float32.*load it again"):
        layer(x.detach())


def test_a_nan_scale_is_refused_when_kept_quantized_too():
    raw, ggml_type = _raw("Q8_0", 2, 32)
    raw[:2] = torch.tensor([np.nan], dtype=torch.float16).view(torch.uint8)
    with pytest.raises(ValueError, match="holds a NaN or infinite step"):
        block_parts(raw, ggml_type, (2, 32))
