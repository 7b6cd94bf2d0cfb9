"""LoRA from scratch (groundup.lora), checked against the definition and against peft's LoRA."""

import copy
import math

import pytest
import torch
from torch import nn

from groundup.lora import (
    LoRALinear,
    attach_lora,
    base_fingerprint,
    count_parameters,
    load_lora,
    lora_layers,
    lora_parameter_count,
    lora_state_dict,
    merge_lora,
    save_lora,
    unmerge_lora,
)
from groundup.models import GPT, EncoderDecoder, EncoderDecoderConfig, GPTConfig, MaskedLM, MaskedLMConfig

TINY = dict(vocab_size=40, context_length=16, d_model=32, n_layers=2, n_heads=4)


def tiny_gpt(seed=0, dtype=torch.float32, **overrides):
    torch.manual_seed(seed)
    return GPT(GPTConfig(**{**TINY, **overrides})).to(dtype).eval()


def tiny_models(dtype=torch.float32):
    """A GPT, a masked LM and an encoder-decoder, each with a function giving its logits on fixed inputs."""
    torch.manual_seed(0)
    gpt = GPT(GPTConfig(**TINY, positional="rope")).to(dtype).eval()
    mlm = MaskedLM(MaskedLMConfig(**TINY)).to(dtype).eval()
    ed = EncoderDecoder(EncoderDecoderConfig(src_vocab_size=30, tgt_vocab_size=30, context_length=16, d_model=32,
                                             n_heads=4)).to(dtype).eval()
    idx = torch.randint(0, 39, (3, 12))
    src, tgt = torch.randint(3, 30, (3, 10)), torch.randint(3, 30, (3, 7))
    tgt[:, 0] = 1  # the start token
    return [(gpt, lambda m: m(idx)[0]), (mlm, lambda m: m(idx)[0]), (ed, lambda m: m(src, tgt)[0])]


def randomise_b(model, seed=1):
    """Give every adapter a non-zero B (as training would), so the adapters change the function."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for a in lora_layers(model).values():
            a.B.copy_(torch.randn(a.B.shape, generator=g, dtype=torch.float64).to(a.B.dtype) * 0.1)


@pytest.mark.parametrize("which", [0, 1, 2])
@pytest.mark.parametrize("targets", [("W_q", "W_v"), ("W_q", "W_k", "W_v", "W_o", "W_in", "W_out")])
def test_attaching_leaves_the_model_unchanged(which, targets):
    model, logits = tiny_models()[which]
    with torch.no_grad():
        before = logits(model)
    adapters = attach_lora(model, targets, r=4, alpha=8)
    assert adapters and all(torch.count_nonzero(a.B) == 0 for a in adapters.values())
    with torch.no_grad():
        after = logits(model)
    # B = 0 adds exact zeros; W_q, W_k, W_v computed one by one instead of stacked give the same bits too
    assert torch.equal(before, after)


@pytest.mark.parametrize("which", [0, 1, 2])
def test_merged_equals_unmerged_and_unmerge_restores_the_weights(which):
    # float64: merged (x (W + s B A)^T) and unmerged (x W^T + s (x A^T) B^T) round differently; in float64 the
    # difference is ~1e-16 relative, so a tolerance of 1e-12 tests the algebra, not the rounding.
    model, logits = tiny_models(torch.float64)[which]
    originals = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        base_logits = logits(model)
    attach_lora(model, ("W_q", "W_v", "W_out"), r=3, alpha=6)
    randomise_b(model)
    with torch.no_grad():
        unmerged = logits(model)
        merge_lora(model)
        assert all(a.merged for a in lora_layers(model).values())
        merged = logits(model)
        unmerge_lora(model)
        again = logits(model)
    assert (unmerged - base_logits).abs().max() > 1e-3  # the adapters change the function
    torch.testing.assert_close(merged, unmerged, rtol=0, atol=1e-12)
    torch.testing.assert_close(again, unmerged, rtol=0, atol=1e-12)
    for name, a in lora_layers(model).items():  # W + D - D = W up to one rounding of |W + D|
        w0 = originals[name + ".weight"]
        assert (a.base.weight - w0).abs().max() <= 4 * torch.finfo(torch.float64).eps * (w0.abs().max() + 1)


def test_merge_equals_the_definition_on_one_layer():
    torch.manual_seed(0)
    base = nn.Linear(7, 5, dtype=torch.float64)
    w0 = base.weight.detach().clone()
    layer = LoRALinear(base, r=2, alpha=3.0)
    with torch.no_grad():
        layer.B.normal_()
    x = torch.randn(4, 7, dtype=torch.float64)
    expected = x @ (w0 + 1.5 * layer.B @ layer.A).T + base.bias  # scale alpha / r = 1.5
    torch.testing.assert_close(layer(x), expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(layer.weight, w0 + 1.5 * layer.B @ layer.A, rtol=0, atol=1e-14)
    layer.merge()
    torch.testing.assert_close(base.weight, w0 + 1.5 * layer.B @ layer.A, rtol=0, atol=1e-14)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), expected, rtol=0, atol=1e-12)
    with pytest.raises(RuntimeError, match="unmerge_lora"):
        layer(x)  # merged adapters cannot learn: training a merged model is refused
    with pytest.raises(RuntimeError, match="already merged"):
        layer.merge()
    layer.unmerge()
    with pytest.raises(RuntimeError, match="not merged"):
        layer.unmerge()


def test_initialisation_is_kaiming_uniform_and_b_zero():
    torch.manual_seed(0)
    layer = LoRALinear(nn.Linear(256, 64), r=16, alpha=16)
    bound = 1 / math.sqrt(256)  # kaiming_uniform(a=sqrt(5)): gain sqrt(2 / 6), bound gain * sqrt(3 / fan_in)
    assert layer.A.abs().max() <= bound and layer.A.abs().max() > 0.98 * bound
    assert abs(layer.A.var().item() - bound**2 / 3) < 0.1 * bound**2 / 3  # uniform(-b, b) has variance b^2 / 3
    assert torch.count_nonzero(layer.B) == 0 and layer.scale == 1.0


def test_only_adapters_receive_gradients():
    model = tiny_gpt()
    attach_lora(model, ("W_q", "W_v"), r=4, alpha=8)
    idx = torch.randint(0, 40, (2, 10))
    _, loss = model(idx, idx)
    loss.backward()
    with_grad = {n for n, p in model.named_parameters() if p.grad is not None}
    expected = {f"blocks.{i}.attention.{w}.{ab}" for i in range(2) for w in ("W_q", "W_v") for ab in ("A", "B")}
    assert with_grad == expected
    assert {n for n, p in model.named_parameters() if p.requires_grad} == expected
    for a in lora_layers(model).values():
        # at B = 0 the gradient of A, s B^T (dL/dy) x, is exactly zero; B's, s (dL/dy) (A x)^T, is not
        assert torch.count_nonzero(a.A.grad) == 0 and a.B.grad.abs().max() > 0
    model.zero_grad()
    randomise_b(model)
    model(idx, idx)[1].backward()
    assert all(a.A.grad.abs().max() > 0 for a in lora_layers(model).values())


def test_training_steps_move_only_the_adapters_and_inference_sees_them():
    model = tiny_gpt()
    idx = torch.randint(0, 40, (4, 12))
    with torch.no_grad():
        base_logits = model(idx)[0]  # also fills the attention's stacked-weight cache with the base weights
    frozen = {n: p.detach().clone() for n, p in model.named_parameters()}
    attach_lora(model, ("W_q", "W_k", "W_v"), r=2, alpha=4)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(5):
        opt.zero_grad()
        model(idx, idx)[1].backward()
        opt.step()
    for name, p in model.named_parameters():
        if not (name.endswith(".A") or name.endswith(".B")):
            assert torch.equal(p, frozen[name.replace(".base.", ".")]), name
    with torch.no_grad():
        tuned = model(idx)[0]
        merge_lora(model)
        merged = model(idx)[0]
    assert (tuned - base_logits).abs().max() > 1e-3  # inference uses the adapters, not a stale stacked copy
    torch.testing.assert_close(merged, tuned, rtol=1e-4, atol=1e-5)


def test_dropout_acts_on_the_adapter_input_while_training_only():
    torch.manual_seed(0)
    layer = LoRALinear(nn.Linear(16, 8), r=4, alpha=4, dropout=0.5)
    with torch.no_grad():
        layer.B.normal_()
    x = torch.randn(64, 16)
    layer.eval()
    clean = layer(x)
    layer.train()
    torch.manual_seed(1)
    dropped = layer(x)
    torch.manual_seed(1)
    mask = nn.functional.dropout(torch.ones_like(x), 0.5, training=True)
    expected = layer.base(x) + (x * mask) @ layer.A.T @ layer.B.T * layer.scale
    torch.testing.assert_close(dropped, expected)
    assert (dropped - clean).abs().max() > 1e-3


def test_equals_peft_lora_on_one_layer():
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    base = nn.Linear(24, 12, dtype=torch.float64)
    ours = LoRALinear(copy.deepcopy(base), r=4, alpha=12)
    config = peft.LoraConfig(r=4, lora_alpha=12, lora_dropout=0.0)
    theirs = peft.tuners.lora.Linear(copy.deepcopy(base), "default", config, r=4, lora_alpha=12)
    with torch.no_grad():
        ours.B.normal_()
        theirs.lora_A["default"].weight.copy_(ours.A)
        theirs.lora_B["default"].weight.copy_(ours.B)
    assert theirs.scaling["default"] == ours.scale == 3.0
    x = torch.randn(5, 7, 24, dtype=torch.float64)
    torch.testing.assert_close(ours(x), theirs(x), rtol=0, atol=1e-13)
    torch.testing.assert_close(ours.delta_weight(), theirs.get_delta_weight("default"), rtol=0, atol=1e-14)
    ours.merge()
    theirs.merge()
    torch.testing.assert_close(ours.base.weight, theirs.base_layer.weight, rtol=0, atol=1e-14)
    ours.unmerge()
    theirs.unmerge()
    torch.testing.assert_close(ours.base.weight, theirs.base_layer.weight, rtol=0, atol=1e-14)


def test_equals_peft_lora_on_a_whole_gpt():
    peft = pytest.importorskip("peft")
    model = tiny_gpt(dtype=torch.float64)
    theirs = peft.inject_adapter_in_model(peft.LoraConfig(r=4, lora_alpha=8, target_modules=["W_q", "W_v"]),
                                          copy.deepcopy(model))
    attach_lora(model, ("W_q", "W_v"), r=4, alpha=8)
    randomise_b(model)
    with torch.no_grad():
        for name, a in lora_layers(model).items():
            peft_layer = theirs.get_submodule(name)
            peft_layer.lora_A["default"].weight.copy_(a.A)
            peft_layer.lora_B["default"].weight.copy_(a.B)
    assert {n for n, p in theirs.named_parameters() if p.requires_grad} == {
        n.replace(".A", ".lora_A.default.weight").replace(".B", ".lora_B.default.weight")
        for n, p in model.named_parameters() if p.requires_grad}
    idx = torch.randint(0, 40, (3, 16))
    with torch.no_grad():
        torch.testing.assert_close(model(idx)[0], theirs(idx)[0], rtol=0, atol=1e-12)


def test_counting_trainable_parameters():
    model = tiny_gpt()
    total = count_parameters(model)
    tied = model.state_dict()  # holds the tied matrix twice, as token_embedding.weight and unembedding.weight
    assert total == sum(t.numel() for k, t in tied.items() if k != "unembedding.weight")
    attach_lora(model, ("W_q", "W_v", "W_in"), r=4, alpha=8)
    # per block: W_q, W_v are 32 -> 32, W_in 32 -> 128; r (in + out) each: 2 (4 * 64 * 2 + 4 * 160) = 2304
    expected = 2 * (4 * (32 + 32) * 2 + 4 * (32 + 128))
    assert count_parameters(model, trainable_only=True) == expected == 2304
    assert lora_parameter_count([(32, 32), (32, 32), (128, 32)] * 2, r=4) == expected
    assert count_parameters(model) == total + expected


def test_bad_arguments_are_refused_clearly():
    base = nn.Linear(8, 4)
    with pytest.raises(ValueError, match="r .*positive integer, got 0"):
        LoRALinear(base, r=0, alpha=1)
    with pytest.raises(ValueError, match=r"r = 5 exceeds min\(in_features, out_features\) = 4"):
        LoRALinear(base, r=5, alpha=1)
    with pytest.raises(ValueError, match="alpha"):
        LoRALinear(base, r=2, alpha=0)
    with pytest.raises(ValueError, match="dropout"):
        LoRALinear(base, r=2, alpha=1, dropout=1.0)
    with pytest.raises(TypeError, match="nn.Linear"):
        LoRALinear(nn.Conv1d(2, 2, 1), r=1, alpha=1)
    model = tiny_gpt()
    with pytest.raises(ValueError, match=r"targets \['W_x'\] name no nn.Linear .*'W_q'"):
        attach_lora(model, ("W_q", "W_x"))
    with pytest.raises(ValueError, match="positive integer, got 0"):
        attach_lora(model, ("W_q",), r=0)
    assert not lora_layers(model)  # nothing attached by a refused call
    attach_lora(model, ("W_q",), r=2)
    with pytest.raises(ValueError, match="already has LoRA adapters"):
        attach_lora(model, ("W_v",))
    with pytest.raises(ValueError, match="no LoRA adapters"):
        merge_lora(tiny_gpt())


def test_an_impossible_rank_names_the_smallest_bound_among_all_the_layers():
    # grouped-query attention: W_q is 32 -> 32, W_v 32 -> 8 (one key-value head of 8), W_in 32 -> 128
    for r in (40, 20):  # above every bound, then above W_v's only: the same bound both times, before anything attaches
        model = tiny_gpt(n_kv_heads=1)
        with pytest.raises(ValueError, match=rf"^r = {r} exceeds 8, the smallest min\(in_features, out_features\) "
                                             r"among the layers to adapt \(blocks.0.attention.W_v: 32 -> 8\): an "
                                             r"update of rank above 8 is impossible there, so r must be at most 8$"):
            attach_lora(model, ("W_q", "W_v", "W_in"), r=r)
        assert not lora_layers(model) and all(p.requires_grad for p in model.parameters())
    assert len(attach_lora(tiny_gpt(n_kv_heads=1), ("W_q", "W_v", "W_in"), r=8)) == 6


# ---- the adapters alone, saved and loaded ---------------------------------------------------------------------

def trained_adapter(seed=0):
    model = tiny_gpt(seed)
    base = copy.deepcopy(model)
    attach_lora(model, ("W_q", "W_v"), r=4, alpha=8)
    randomise_b(model)
    return base, model


def test_a_checkpoint_of_adapters_alone_reloads_onto_the_base(tmp_path):
    base, model = trained_adapter()
    path = tmp_path / "adapter.pt"
    save_lora(model, path)
    state = torch.load(path, weights_only=True)
    assert set(state["A"]) == set(state["B"]) == {f"blocks.{i}.attention.{w}" for i in range(2) for w in ("W_q",
                                                                                                           "W_v")}
    assert sum(t.numel() for d in (state["A"], state["B"]) for t in d.values()) == count_parameters(
        model, trainable_only=True)  # the adapters alone, not the base's weights
    load_lora(base, path)
    idx = torch.randint(0, 40, (2, 16))
    with torch.no_grad():
        assert torch.equal(base(idx)[0], model(idx)[0])
    assert count_parameters(base, trainable_only=True) == count_parameters(model, trainable_only=True)
    randomise_b(base, seed=5)  # onto a model with adapters already attached: the file's values replace them
    load_lora(base, lora_state_dict(model))
    with torch.no_grad():
        assert torch.equal(base(idx)[0], model(idx)[0])


def test_an_adapter_for_another_base_is_refused():
    _, model = trained_adapter(seed=0)
    state = lora_state_dict(model)
    other = tiny_gpt(seed=1)  # same shapes, other weights
    with pytest.raises(ValueError, match="another base model"):
        load_lora(other, state)
    assert not lora_layers(other)  # refused before anything was attached
    with pytest.raises(ValueError, match="another base model"):
        load_lora(tiny_gpt(seed=0, dtype=torch.float64), state)  # the same base in another dtype
    wider = tiny_gpt(seed=0, d_model=64)
    with pytest.raises(ValueError, match=r"blocks.0.attention.W_q is \[32, 32\] .* this model's is \[64, 64\]"):
        load_lora(wider, state)
    deeper_names = {k.replace("blocks.1", "blocks.5"): v for k, v in state["layers"].items()}
    with pytest.raises(ValueError, match="'blocks.5.attention.W_q', which this GPT does not have"):
        load_lora(tiny_gpt(), {**state, "layers": deeper_names, "A": {k.replace("blocks.1", "blocks.5"): v for k, v
                                                                      in state["A"].items()},
                               "B": {k.replace("blocks.1", "blocks.5"): v for k, v in state["B"].items()}})
    attached = tiny_gpt(seed=0)
    attach_lora(attached, ("W_q", "W_v"), r=2, alpha=8)
    with pytest.raises(ValueError, match="r = 2, alpha = 8; the file's has r = 4"):
        load_lora(attached, state)
    merge_lora(model)
    with pytest.raises(ValueError, match="unmerge_lora"):
        lora_state_dict(model)


def test_fingerprint_is_of_the_adapted_layers_base_weights():
    base, model = trained_adapter()
    names = list(lora_layers(model))
    assert base_fingerprint(base, names) == base_fingerprint(model, names)
    with torch.no_grad():
        base.blocks[0].ffn.W_in.weight.add_(1.0)  # not an adapted layer: same fingerprint
        assert base_fingerprint(base, names) == base_fingerprint(model, names)
        base.blocks[1].attention.W_v.bias[3] += 1e-6
    assert base_fingerprint(base, names) != base_fingerprint(model, names)


def test_hostile_adapter_files_are_refused_before_allocating(tmp_path):
    base, model = trained_adapter()
    state = lora_state_dict(model)
    name = "blocks.0.attention.W_q"

    def refused(bad, match):
        path = tmp_path / "bad.pt"
        torch.save(bad, path)
        with pytest.raises(ValueError, match=match):
            load_lora(copy.deepcopy(base), path)

    refused({**state, "r": 10**12}, r"r = 1000000000000 exceeds min\(out, in\) = 32")  # would attach 10^12 x 32
    refused({**state, "r": 0}, "r must be a positive integer, got 0")
    huge = torch.zeros(1).expand(10**6, 10**6)  # stored as one number; a copy would need 4 TB
    refused({**state, "A": {**state["A"], name: huge}}, r"A of layer blocks.0.attention.W_q must be .* \(4, 32\)")
    refused({**state, "B": {**state["B"], name: torch.zeros(32, 5)}}, r"shape \(32, 4\) \(r = 4\), got \(32, 5\)")
    refused({**state, "B": {**state["B"], name: torch.zeros(32, 4, dtype=torch.long)}}, "floating-point")
    refused({**state, "layers": {**state["layers"], name: [10**9, 32]}}, r"is \[1000000000, 32\]")
    refused({**state, "A": {}}, "one tensor for each of its layers")
    refused({**state, "format": "other"}, "not a LoRA adapter state")
    refused([1, 2, 3], "not a LoRA adapter state")
    refused({**state, "version": 99}, "version 99")
    # values: not finite, or too large to compute with in the model's float32 (one entry is enough)
    for part, value, match in (("A", math.nan, "A of layer blocks.0.attention.W_q holds values that are not finite"),
                               ("B", -math.inf, "B of layer blocks.0.attention.W_q holds values that are not finite"),
                               ("A", 1e38, r"A x reaches 1e\+38, beyond 1.84e\+19"),
                               ("B", 1e38, r"\(alpha / r\) B A x reaches .*, beyond 1.84e\+19")):
        bad = state[part][name].clone()
        bad[1, 2] = value
        refused({**state, part: {**state[part], name: bad}}, match)
    as_float64 = state["A"][name].double()
    as_float64[0, 0] = 1e300  # finite in float64, inf in the float32 model it would be copied into
    refused({**state, "A": {**state["A"], name: as_float64}}, "not finite in torch.float32")
    (tmp_path / "junk.pt").write_bytes(b"not a torch file")
    with pytest.raises(ValueError, match="junk.pt is not a LoRA adapter file"):
        load_lora(base, tmp_path / "junk.pt")

    class Evil:
        def __reduce__(self):
            return (print, ("ran code from the file",))

    torch.save({**state, "evil": Evil()}, tmp_path / "evil.pt")
    with pytest.raises(ValueError, match="evil.pt is not a LoRA adapter file"):  # weights_only: nothing runs
        load_lora(base, tmp_path / "evil.pt")
    assert not lora_layers(base)
