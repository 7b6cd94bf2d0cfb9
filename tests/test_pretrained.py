"""groundup.pretrained against transformers' own GPT-2 and LLaMA (tiny random models, no network)."""

import json
from pathlib import Path

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


# ---- downloading by name (huggingface_hub's network calls replaced by a local fake; its cache is real) ----------


def _fake_hub(monkeypatch, source, *, etag=None, fail=None):
    """Fake ``hf_hub_download`` / ``get_hf_file_metadata``; files land in huggingface_hub's real cache layout
    (``models--REPO/blobs/ETAG``, ``snapshots/COMMIT/NAME`` linking to it, ``refs/main``), so the real
    ``try_to_load_from_cache`` finds them. ``calls`` lists every network call."""
    import hashlib
    import shutil

    import huggingface_hub

    calls = []
    published = etag if etag is not None else hashlib.sha256((source / "model.safetensors").read_bytes()).hexdigest()

    def hf_hub_download(repo_id, filename, cache_dir=None):
        calls.append(("download", filename))
        if fail is not None:
            raise fail
        repo = Path(cache_dir) / f"models--{repo_id}"
        blob_name = published if filename == "model.safetensors" else hashlib.sha1(filename.encode()).hexdigest()
        blob, link = repo / "blobs" / blob_name, repo / "snapshots" / ("c" * 40) / filename
        for folder in (blob.parent, link.parent, repo / "refs"):
            folder.mkdir(parents=True, exist_ok=True)
        shutil.copy(source / filename, blob)
        link.unlink(missing_ok=True)
        link.symlink_to(Path("..") / ".." / "blobs" / blob_name)
        (repo / "refs" / "main").write_text("c" * 40)
        return str(link)

    class Meta:
        def __init__(self, url):
            calls.append(("metadata", url))
            if fail is not None:
                raise fail
            self.etag = published

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", hf_hub_download)
    monkeypatch.setattr(huggingface_hub, "hf_hub_url", lambda repo_id, filename: f"hub://{repo_id}/{filename}")
    monkeypatch.setattr(huggingface_hub, "get_hf_file_metadata", Meta)
    return calls


def _same_weights(a, b):
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(x, y), name


def test_a_name_downloads_verifies_and_loads(gpt2_dir, tmp_path, monkeypatch):
    import hashlib

    d, hf = gpt2_dir
    calls = _fake_hub(monkeypatch, d)
    model, tok = load_gpt2("gpt2", cache_dir=tmp_path, tokenizer=False)
    assert tok is None and calls == [("metadata", "hub://gpt2/model.safetensors"), ("download", "config.json"),
                                     ("download", "model.safetensors")]
    _same_weights(model, load_gpt2(d, tokenizer=False)[0])
    digest = hashlib.sha256((d / "model.safetensors").read_bytes()).hexdigest()
    record = tmp_path / "models--gpt2" / "snapshots" / ("c" * 40) / "model.safetensors.sha256"
    assert record.read_text() == f"{digest}  model.safetensors\n"  # sha256sum's format


def test_a_verified_download_loads_offline_without_the_network(gpt2_dir, tmp_path, monkeypatch):
    from huggingface_hub.errors import OfflineModeIsEnabled

    d, _ = gpt2_dir
    _fake_hub(monkeypatch, d)
    first, _ = load_gpt2("gpt2", cache_dir=tmp_path, tokenizer=False)
    calls = _fake_hub(monkeypatch, d, fail=OfflineModeIsEnabled("HF_HUB_OFFLINE=1"))
    again, _ = load_gpt2("gpt2", cache_dir=tmp_path, tokenizer=False)
    assert calls == []  # no network call at all: the digest recorded at download time is the reference
    _same_weights(again, first)


def test_a_cached_download_corrupted_after_verification_is_deleted_and_refused(gpt2_dir, tmp_path, monkeypatch):
    d, _ = gpt2_dir
    _fake_hub(monkeypatch, d)
    load_gpt2("gpt2", cache_dir=tmp_path, tokenizer=False)
    snapshot = tmp_path / "models--gpt2" / "snapshots" / ("c" * 40)
    blob = (snapshot / "model.safetensors").resolve()
    data = bytearray(blob.read_bytes())
    data[-1] ^= 1
    blob.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="not the .* verified when it was downloaded; the corrupt file"):
        load_gpt2("gpt2", cache_dir=tmp_path, tokenizer=False)
    assert not blob.exists() and not (snapshot / "model.safetensors").is_symlink()
    assert not (snapshot / "model.safetensors.sha256").exists()


def test_a_download_with_the_wrong_sha256_is_deleted_and_refused(gpt2_dir, tmp_path, monkeypatch):
    d, _ = gpt2_dir
    _fake_hub(monkeypatch, d, etag="0" * 64)
    with pytest.raises(CheckpointError, match="does not match the published"):
        load_gpt2("gpt2", cache_dir=tmp_path, tokenizer=False)
    repo = tmp_path / "models--gpt2"
    assert not (repo / "blobs" / ("0" * 64)).exists()  # the blob itself, not only the snapshot's link
    assert not (repo / "snapshots" / ("c" * 40) / "model.safetensors").is_symlink()


def test_weights_the_hub_publishes_no_sha256_for_are_refused(gpt2_dir, tmp_path, monkeypatch):
    d, _ = gpt2_dir
    calls = _fake_hub(monkeypatch, d, etag="a1b2c3")  # a git blob's etag, not an LFS sha256
    with pytest.raises(CheckpointError, match="publishes no sha256"):
        load_gpt2("gpt2", cache_dir=tmp_path, tokenizer=False)
    assert [c[0] for c in calls] == ["metadata"]


def test_offline_a_name_fails_with_a_clear_message(gpt2_dir, tmp_path, monkeypatch):
    d, _ = gpt2_dir
    calls = _fake_hub(monkeypatch, d, fail=OSError("network is unreachable"))
    with pytest.raises(ConnectionError, match="could not download 'gpt2'.*pass the path of a local folder"):
        load_gpt2("gpt2", cache_dir=tmp_path, tokenizer=False)
    assert calls == [("metadata", "hub://gpt2/model.safetensors")]  # hf_hub_download (which retries) never runs
    with pytest.raises(FileNotFoundError, match="neither a checkpoint folder nor one of"):
        load_gpt2("no-such-model-or-folder", tokenizer=False)


def test_without_network_a_name_fails_after_one_request_without_retries(tmp_path, monkeypatch):
    """The real huggingface_hub against a closed local port (as with no route to the hub): one refused request,
    no "Retrying in 1s [Retry 1/5]" (before, five retries took about 25 s)."""
    import logging
    import socket

    from huggingface_hub import constants

    with socket.socket() as s:  # a port nothing listens on: connections are refused at once
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    endpoint = f"http://127.0.0.1:{port}"
    monkeypatch.setattr(constants, "ENDPOINT", endpoint)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", endpoint + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    hub_logger = logging.getLogger("huggingface_hub")
    hub_logger.addHandler(handler)
    try:
        with pytest.raises(ConnectionError, match="could not download 'gpt2'"):
            load_gpt2("gpt2", cache_dir=tmp_path, tokenizer=False)
    finally:
        hub_logger.removeHandler(handler)
    assert not [r for r in records if "Retry" in r.getMessage()]


# ---- hostile and careless checkpoint folders: refused with a message naming the file or tensor, nothing allocated


def _edit_config(src, dst, **changes):
    dst.mkdir()
    (dst / "model.safetensors").write_bytes((src / "model.safetensors").read_bytes())
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_a_config_with_absurd_sizes_is_refused_before_allocating(gpt2_dir, llama_dir, tmp_path):
    """vocab_size 10^9 (96 GB of float32) and n_inner 10^10 (1.9 TB) are checked against the file's header."""
    g, _ = gpt2_dir
    with pytest.raises(CheckpointError, match=r"'wte.weight' has shape \(60, 24\), but config.json implies "
                                              r"\(1000000000, 24\)"):
        load_gpt2(_edit_config(g, tmp_path / "a", vocab_size=10**9), tokenizer=False)
    with pytest.raises(CheckpointError, match=r"h.0.mlp.c_fc.weight.*implies \(10000000000, 24\)"):
        load_gpt2(_edit_config(g, tmp_path / "b", n_inner=10**10), tokenizer=False)
    with pytest.raises(CheckpointError, match="missing tensor 'h.2.ln_1.weight'"):
        load_gpt2(_edit_config(g, tmp_path / "c", n_layer=10**9), tokenizer=False)
    with pytest.raises(CheckpointError, match=r"'wpe.weight' has shape \(32, 24\), but config.json implies"):
        load_gpt2(_edit_config(g, tmp_path / "d", n_positions=10**8), tokenizer=False)
    ll, _ = llama_dir
    with pytest.raises(CheckpointError, match=r"mlp.gate_proj.weight' has shape \(48, 32\), but config.json implies "
                                              r"\(10000000000, 32\)"):
        load_llama(_edit_config(ll, tmp_path / "e", intermediate_size=10**10))


def test_a_config_json_that_is_not_json_names_the_file(gpt2_dir, tmp_path):
    g, _ = gpt2_dir
    bad = _edit_config(g, tmp_path / "a")
    (bad / "config.json").write_text('{"n_embd": 24,')
    with pytest.raises(CheckpointError, match=f"{bad / 'config.json'} is not valid JSON"):
        load_gpt2(bad, tokenizer=False)
    (bad / "config.json").write_bytes(b"\xff\xfe{}")
    with pytest.raises(CheckpointError, match="config.json is not valid JSON .*UnicodeDecodeError"):
        load_gpt2(bad, tokenizer=False)
    (bad / "config.json").write_text("[1, 2]")
    with pytest.raises(CheckpointError, match="config.json must hold a JSON object, got list"):
        load_gpt2(bad, tokenizer=False)
    (bad / "config.json").write_text(" " * (5 << 20) + "{}")
    with pytest.raises(CheckpointError, match="config.json holds 5,242,882 bytes"):
        load_gpt2(bad, tokenizer=False)
    with pytest.raises(CheckpointError, match=r"config.json: the config's 'n_embd' must be a positive integer"):
        load_gpt2(_edit_config(g, tmp_path / "b", n_embd="big"), tokenizer=False)


def test_a_truncated_model_safetensors_is_refused_naming_the_file(gpt2_dir, llama_dir, tmp_path):
    for (src, _), load in ((gpt2_dir, lambda p: load_gpt2(p, tokenizer=False)), (llama_dir, load_llama)):
        bad = _edit_config(src, tmp_path / f"cut{len(list(tmp_path.iterdir()))}")
        data = (bad / "model.safetensors").read_bytes()
        for size in (len(data) - 1, 100, 3):
            (bad / "model.safetensors").write_bytes(data[:size])
            with pytest.raises(CheckpointError, match=f"{bad / 'model.safetensors'} is not a complete safetensors"):
                load(bad)


def test_integer_weights_are_refused_not_cast(gpt2_dir, tmp_path):
    g, _ = gpt2_dir
    name = next(k for k in load_file(str(g / "model.safetensors")) if k.endswith("h.0.ln_1.weight"))
    bad = _corrupt(g, tmp_path / "a", lambda t: t.update({name: t[name].to(torch.int8)}))
    short = name.removeprefix("transformer.")  # the messages name GPT-2's tensors without the prefix
    with pytest.raises(CheckpointError, match=f"'{short}' is stored as int8: this loader reads floating-point"):
        load_gpt2(bad, tokenizer=False)
    with pytest.raises(TypeError, match="dtype must be one of"):
        load_gpt2(g, tokenizer=False, dtype=torch.int8)


def test_weights_that_are_not_finite_in_the_models_dtype_are_refused(gpt2_dir, tmp_path):
    g, _ = gpt2_dir
    name = next(k for k in load_file(str(g / "model.safetensors")) if k.endswith("h.1.attn.c_proj.weight"))

    def set_first(value, dtype):
        def edit(t):
            t[name] = t[name].to(dtype)
            t[name][0, 0] = value
        return edit

    huge = _corrupt(g, tmp_path / "a", set_first(1e300, torch.float64))  # inf once cast to float32
    short = name.removeprefix("transformer.")
    with pytest.raises(CheckpointError, match=f"'{short}' holds values that are not finite in torch.float32"):
        load_gpt2(huge, tokenizer=False)
    assert load_gpt2(huge, tokenizer=False, dtype=torch.float64)[0] is not None  # float64 holds 1e300
    with pytest.raises(CheckpointError, match="not finite"):
        load_gpt2(_corrupt(g, tmp_path / "b", set_first(float("nan"), torch.float32)), tokenizer=False)
    big = _corrupt(g, tmp_path / "c", set_first(1e5, torch.float32))
    with pytest.raises(CheckpointError, match="not finite in torch.float16"):
        load_gpt2(big, tokenizer=False, dtype=torch.float16)


def test_the_command_line_reports_a_hostile_checkpoint_without_a_traceback(gpt2_dir, tmp_path, capsys):
    from groundup.cli import main

    g, _ = gpt2_dir
    bad = _edit_config(g, tmp_path / "a", vocab_size=10**9)
    assert main(["sample", "--pretrained", str(bad), "--prompt", "Hi"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "config.json implies (1000000000, 24)" in err and "Traceback" not in err
