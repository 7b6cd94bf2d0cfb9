"""groundup.pretrained against transformers' own GPT-2 and LLaMA (tiny random models, no network)."""

import json

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM  # noqa: E402

from groundup.generation import generate  # noqa: E402
from groundup.pretrained import CheckpointError, load_gpt2, load_llama  # noqa: E402


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    torch.manual_seed(0)
    hf = GPT2LMHeadModel(GPT2Config(vocab_size=60, n_positions=32, n_embd=24, n_layer=2, n_head=3,
                                    bos_token_id=0, eos_token_id=0)).eval()
    d = tmp_path_factory.mktemp("gpt2")
    hf.save_pretrained(d)
    return d, hf


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def llama_dir(request, tmp_path_factory):
    torch.manual_seed(1)
    cfg = LlamaConfig(vocab_size=70, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32, rms_norm_eps=1e-5,
                      rope_theta=5000.0, tie_word_embeddings=request.param)
    hf = LlamaForCausalLM(cfg).eval()
    d = tmp_path_factory.mktemp("llama")
    hf.save_pretrained(d)
    return d, hf


def _compare(ours, hf, vocab, tol=1e-10):
    """Equal logits/loss in float64 and identical greedy generations (ours with and without cache, and hf's).

    transformers' LLaMA computes RMSNorm and the RoPE frequencies in float32 even in a float64 model, so its
    logits are only float32-accurate: ``tol`` says how close we can ask.
    """
    ours, hf = ours.double(), hf.double()
    idx = torch.randint(0, vocab, (2, 9), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        out = hf(idx, labels=idx)
        logits, _ = ours(idx)
        _, loss = ours(idx[:, :-1], idx[:, 1:])
    torch.testing.assert_close(logits, out.logits, rtol=tol, atol=tol)
    # transformers computes its loss in float32; compare with the float64 loss of its own logits too
    ref_loss = F.cross_entropy(out.logits[:, :-1].reshape(-1, vocab), idx[:, 1:].reshape(-1))
    torch.testing.assert_close(loss, ref_loss, rtol=tol, atol=tol)
    torch.testing.assert_close(loss.float(), out.loss, rtol=1e-6, atol=1e-6)
    a = generate(ours, idx[:, :4], 10, greedy=True, use_cache=True)
    b = generate(ours, idx[:, :4], 10, greedy=True, use_cache=False)
    assert torch.equal(a, b)
    with torch.no_grad():
        ref = hf.generate(idx[:, :4], max_new_tokens=10, do_sample=False, pad_token_id=0)
    assert torch.equal(a, ref)


def test_gpt2_matches_transformers(gpt2_dir):
    d, hf = gpt2_dir
    model, tok = load_gpt2(d, tokenizer=False)
    assert tok is None and model.config.activation == "gelu_tanh"
    _compare(model, hf, 60)


def test_llama_matches_transformers(llama_dir):
    d, hf = llama_dir
    model = load_llama(d)
    c = model.config
    assert (c.n_kv_heads, c.rope_pairing, c.rope_base, c.norm_eps) == (2, "half", 5000.0, 1e-5)
    _compare(model, hf, 70, tol=1e-6)


def _corrupt(src, dst, edit):
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    tensors = load_file(str(src / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def test_corrupt_checkpoints_name_the_tensor(gpt2_dir, llama_dir, tmp_path):
    g, _ = gpt2_dir
    name = next(k for k in load_file(str(g / "model.safetensors")) if k.endswith("h.1.mlp.c_fc.weight"))
    with pytest.raises(CheckpointError, match="h.1.mlp.c_fc.weight"):
        load_gpt2(_corrupt(g, tmp_path / "a", lambda t: t.pop(name)), tokenizer=False)
    with pytest.raises(CheckpointError, match="h.1.mlp.c_fc.weight"):
        load_gpt2(_corrupt(g, tmp_path / "b", lambda t: t.update({name: t[name][:, :5].contiguous()})),
                  tokenizer=False)
    with pytest.raises(CheckpointError, match="unexpected.*extra.weight"):
        load_gpt2(_corrupt(g, tmp_path / "c", lambda t: t.update({"extra.weight": torch.zeros(2)})),
                  tokenizer=False)
    ll, _ = llama_dir
    with pytest.raises(CheckpointError, match="model.layers.0.self_attn.k_proj.weight"):
        load_llama(_corrupt(ll, tmp_path / "d", lambda t: t.pop("model.layers.0.self_attn.k_proj.weight")))
    # an unknown architecture
    bad = _corrupt(g, tmp_path / "e", lambda t: None)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["model_type"], cfg["architectures"] = "bert", ["BertModel"]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="not a GPT-2"):
        load_gpt2(bad, tokenizer=False)
    with pytest.raises(CheckpointError, match="not a LlamaForCausalLM"):
        load_llama(bad)
    with pytest.raises(FileNotFoundError, match="neither"):
        load_gpt2(tmp_path / "nowhere", tokenizer=False)


# ---- downloading by name (huggingface_hub replaced by a local fake: no network here) ---------------------------


def _fake_hub(monkeypatch, source, *, etag=None, fail=None):
    import hashlib
    import shutil

    import huggingface_hub

    calls = []

    def hf_hub_download(repo_id, filename, cache_dir=None):
        calls.append((repo_id, filename))
        if fail is not None:
            raise fail
        target = cache_dir / repo_id / filename
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(source / filename, target)
        return str(target)

    class Meta:
        def __init__(self, url):
            data = (source / "model.safetensors").read_bytes()
            self.etag = etag if etag is not None else f'"{hashlib.sha256(data).hexdigest()}"'

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", hf_hub_download)
    monkeypatch.setattr(huggingface_hub, "hf_hub_url", lambda repo_id, filename: f"hub://{repo_id}/{filename}")
    monkeypatch.setattr(huggingface_hub, "get_hf_file_metadata", Meta)
    return calls


def test_a_name_downloads_verifies_and_loads(gpt2_dir, tmp_path, monkeypatch):
    d, hf = gpt2_dir
    calls = _fake_hub(monkeypatch, d)
    model, tok = load_gpt2("gpt2", cache_dir=tmp_path, tokenizer=False)
    assert tok is None and calls == [("gpt2", "config.json"), ("gpt2", "model.safetensors")]
    local, _ = load_gpt2(d, tokenizer=False)
    for (name, a), b in zip(model.state_dict().items(), local.state_dict().values()):
        assert torch.equal(a, b), name


def test_a_download_with_the_wrong_sha256_is_deleted_and_refused(gpt2_dir, tmp_path, monkeypatch):
    d, _ = gpt2_dir
    _fake_hub(monkeypatch, d, etag='"' + "0" * 64 + '"')
    with pytest.raises(CheckpointError, match="does not match the published"):
        load_gpt2("gpt2", cache_dir=tmp_path, tokenizer=False)
    assert not (tmp_path / "gpt2" / "model.safetensors").exists()


def test_offline_a_name_fails_with_a_clear_message(gpt2_dir, tmp_path, monkeypatch):
    d, _ = gpt2_dir
    _fake_hub(monkeypatch, d, fail=OSError("network is unreachable"))
    with pytest.raises(ConnectionError, match="could not download 'gpt2'.*pass the path of a local folder"):
        load_gpt2("gpt2", cache_dir=tmp_path, tokenizer=False)
    with pytest.raises(FileNotFoundError, match="neither a checkpoint folder nor one of"):
        load_gpt2("no-such-model-or-folder", tokenizer=False)
