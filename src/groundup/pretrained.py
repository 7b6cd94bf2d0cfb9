"""Load published checkpoints (Hugging Face format) into the package's own :class:`~groundup.models.GPT`.

* :func:`load_gpt2` -- a ``GPT2LMHeadModel`` checkpoint (``config.json`` + ``model.safetensors``): Pre-LN,
  LayerNorm (eps 1e-5), learned positions, tanh-approximate GELU, biases everywhere, tied embeddings. GPT-2's
  ``Conv1D`` layers store their weight as ``[in, out]`` (the transpose of ``nn.Linear``), and ``c_attn`` holds
  ``W_q, W_k, W_v`` side by side; both are undone here.
* :func:`load_llama` -- a ``LlamaForCausalLM`` checkpoint: RMSNorm, SwiGLU, rotate-half RoPE (``rope_pairing=
  "half"``), grouped-query attention, no biases, usually untied embeddings.

Checkpoints are untrusted input: tensors are read with ``safetensors.torch.load_file`` (no pickle), every
expected tensor must be present with the expected shape, and unexpected tensors are refused; errors name the
tensor.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from groundup.models import GPT, GPTConfig

__all__ = ["CheckpointError", "load_gpt2", "load_llama", "gpt2_state_dict", "llama_state_dict"]

GPT2_NAMES = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")
# buffers some GPT-2 exports carry (the causal mask); they are not weights and are ignored
_GPT2_IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias")


class CheckpointError(ValueError):
    """A checkpoint does not match what the loader expects (missing/unexpected tensor, wrong shape, config)."""


def _read_folder(path: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    config_file, weights_file = path / "config.json", path / "model.safetensors"
    for f in (config_file, weights_file):
        if not f.is_file():
            raise FileNotFoundError(f"{f} not found: a Hugging Face checkpoint folder needs config.json and "
                                    f"model.safetensors (sharded checkpoints are not supported)")
    with open(config_file, encoding="utf-8") as fh:
        hf_config = json.load(fh)
    if not isinstance(hf_config, dict):
        raise CheckpointError(f"{config_file} must hold a JSON object")
    from safetensors.torch import load_file  # no pickle: safe for untrusted files

    return hf_config, load_file(str(weights_file))


def _resolve(name_or_path, allowed_names: tuple[str, ...], cache_dir) -> Path:
    path = Path(name_or_path)
    if path.is_dir():
        return path
    if str(name_or_path) not in allowed_names:
        raise FileNotFoundError(f"{name_or_path!r} is neither a checkpoint folder nor one of {allowed_names}")
    return _download(str(name_or_path), cache_dir)


def _download(repo_id: str, cache_dir) -> Path:
    """Download config.json + model.safetensors through huggingface_hub, verifying the weights' sha256."""
    try:
        import huggingface_hub
    except ImportError as err:
        raise ImportError(f"downloading {repo_id!r} needs the optional package huggingface_hub "
                          f"(pip install huggingface_hub), or pass a local checkpoint folder") from err
    import hashlib

    try:
        folder = None
        for filename in ("config.json", "model.safetensors"):
            local = huggingface_hub.hf_hub_download(repo_id, filename, cache_dir=cache_dir)
            folder = Path(local).parent
            if filename == "model.safetensors":
                info = huggingface_hub.get_hf_file_metadata(huggingface_hub.hf_hub_url(repo_id, filename))
                expected = (info.etag or "").strip('"')
                if len(expected) == 64:  # LFS files: the etag is the sha256 of the content
                    digest = hashlib.sha256()
                    with open(local, "rb") as fh:
                        for chunk in iter(lambda: fh.read(1 << 20), b""):
                            digest.update(chunk)
                    if digest.hexdigest() != expected:
                        os.remove(local)
                        raise CheckpointError(f"{filename} of {repo_id!r}: sha256 {digest.hexdigest()} does not "
                                              f"match the published {expected}; the corrupt file was deleted")
    except CheckpointError:
        raise
    except Exception as err:  # offline, hub unreachable, ...
        raise ConnectionError(f"could not download {repo_id!r} ({type(err).__name__}: {err}); without network, "
                              f"pass the path of a local folder holding config.json and model.safetensors") from err
    return folder


def _check_and_load(model: GPT, state: dict[str, torch.Tensor], source: dict[str, str]) -> GPT:
    """Load ``state`` (our names) into ``model`` after checking names and shapes; ``source`` maps to HF names."""
    expected = model.state_dict()
    if model.config.tie_weights:
        expected.pop("unembedding.weight", None)
    for name, ref in expected.items():
        if name not in state:
            raise CheckpointError(f"checkpoint is missing tensor {source.get(name, name)!r} (for {name})")
        if tuple(state[name].shape) != tuple(ref.shape):
            raise CheckpointError(f"tensor {source.get(name, name)!r} has shape {tuple(state[name].shape)}, "
                                  f"expected {tuple(ref.shape)} (for {name})")
    with torch.no_grad():
        for name, ref in expected.items():
            ref.copy_(state[name].to(ref.dtype))
    return model


def _take(tensors: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    if name not in tensors:
        raise CheckpointError(f"checkpoint is missing tensor {name!r}")
    return tensors.pop(name)


def _cfg(hf: dict, key: str, default=None):
    if key in hf:
        return hf[key]
    if default is None:
        raise CheckpointError(f"config.json has no {key!r}")
    return default


def gpt2_config(hf: dict) -> GPTConfig:
    """The :class:`GPTConfig` of a GPT-2 ``config.json`` (as a dict)."""
    arch = hf.get("architectures") or ["GPT2LMHeadModel"]
    if hf.get("model_type", "gpt2") != "gpt2" or arch[0] not in ("GPT2LMHeadModel", "GPT2Model"):
        raise CheckpointError(f"not a GPT-2 checkpoint: model_type={hf.get('model_type')!r}, architectures={arch}")
    act = hf.get("activation_function", "gelu_new")
    activations = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu", "relu": "relu"}
    if act not in activations:
        raise CheckpointError(f"unsupported GPT-2 activation_function {act!r}")
    d = _cfg(hf, "n_embd")
    return GPTConfig(vocab_size=_cfg(hf, "vocab_size"), context_length=_cfg(hf, "n_positions"), d_model=d,
                     n_layers=_cfg(hf, "n_layer"), n_heads=_cfg(hf, "n_head"), d_ff=hf.get("n_inner") or 4 * d,
                     positional="learned", norm="layernorm", norm_position="pre", tie_weights=True,
                     activation=activations[act], norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)))


def gpt2_state_dict(tensors: dict[str, torch.Tensor], config: GPTConfig) -> tuple[dict, dict]:
    """Rename/transposes GPT-2 tensors to :class:`GPT` names; returns ``(state, source names)``.

    Raises :class:`CheckpointError` naming any missing or unexpected tensor.
    """
    t = {k.removeprefix("transformer."): v for k, v in tensors.items()}
    for k in [k for k in t if k.endswith(_GPT2_IGNORED_SUFFIXES)]:
        del t[k]
    lm_head = t.pop("lm_head.weight", None)
    state, src = {}, {}

    def put(ours, theirs, transform=None):
        value = _take(t, theirs)
        state[ours], src[ours] = (transform(value) if transform else value), theirs

    put("token_embedding.weight", "wte.weight")
    put("position_embedding.weight", "wpe.weight")
    d = config.d_model
    for i in range(config.n_layers):
        p, o = f"h.{i}.", f"blocks.{i}."
        for ln, ours in (("ln_1", "norm_1"), ("ln_2", "norm_2")):
            put(o + ours + ".weight", p + ln + ".weight")
            put(o + ours + ".bias", p + ln + ".bias")
        w, b = _take(t, p + "attn.c_attn.weight"), _take(t, p + "attn.c_attn.bias")
        if w.shape != (d, 3 * d) or b.shape != (3 * d,):
            raise CheckpointError(f"tensor {p + 'attn.c_attn.weight'!r} / bias have shapes {tuple(w.shape)} / "
                                  f"{tuple(b.shape)}, expected {(d, 3 * d)} / {(3 * d,)}")
        for j, name in enumerate("qkv"):  # Conv1D: [in, out] -> nn.Linear [out, in]
            state[o + f"attention.W_{name}.weight"] = w[:, j * d:(j + 1) * d].t()
            state[o + f"attention.W_{name}.bias"] = b[j * d:(j + 1) * d]
            src[o + f"attention.W_{name}.weight"] = p + "attn.c_attn.weight"
            src[o + f"attention.W_{name}.bias"] = p + "attn.c_attn.bias"
        put(o + "attention.W_o.weight", p + "attn.c_proj.weight", torch.t)
        put(o + "attention.W_o.bias", p + "attn.c_proj.bias")
        put(o + "ffn.W_in.weight", p + "mlp.c_fc.weight", torch.t)
        put(o + "ffn.W_in.bias", p + "mlp.c_fc.bias")
        put(o + "ffn.W_out.weight", p + "mlp.c_proj.weight", torch.t)
        put(o + "ffn.W_out.bias", p + "mlp.c_proj.bias")
    put("final_norm.weight", "ln_f.weight")
    put("final_norm.bias", "ln_f.bias")
    if t:
        raise CheckpointError(f"unexpected tensor(s) in the checkpoint: {sorted(t)[:5]}")
    if lm_head is not None and not torch.equal(lm_head, state["token_embedding.weight"]):
        raise CheckpointError("tensor 'lm_head.weight' differs from 'wte.weight', but GPT-2 ties them")
    return state, src


def load_gpt2(name_or_path: str | os.PathLike = "gpt2", *, cache_dir=None, dtype: torch.dtype = torch.float32,
              tokenizer: bool = True):
    """A :class:`GPT` with GPT-2's weights and its tokenizer: returns ``(model, tokenizer)`` (model in eval mode).

    ``name_or_path`` is a local folder with ``config.json`` and ``model.safetensors`` (no network needed) or one
    of ``"gpt2"``, ``"gpt2-medium"``, ``"gpt2-large"``, ``"gpt2-xl"``, downloaded through the optional package
    ``huggingface_hub`` and cached; the weights' sha256 is checked against the hub's published LFS hash (the
    etag). Offline, a name fails with ``ConnectionError``. ``tokenizer=False`` returns ``(model, None)``.
    """
    hf, tensors = _read_folder(_resolve(name_or_path, GPT2_NAMES, cache_dir))
    config = gpt2_config(hf)
    state, src = gpt2_state_dict(tensors, config)
    model = _check_and_load(GPT(config), state, src).to(dtype).eval()
    tok = None
    if tokenizer:
        from groundup.tokenizers import load_gpt2_tokenizer

        tok = load_gpt2_tokenizer()
    return model, tok


def llama_config(hf: dict) -> GPTConfig:
    """The :class:`GPTConfig` of a LLaMA ``config.json`` (as a dict)."""
    arch = hf.get("architectures") or ["LlamaForCausalLM"]
    if hf.get("model_type", "llama") != "llama" or arch[0] != "LlamaForCausalLM":
        raise CheckpointError(f"not a LlamaForCausalLM checkpoint: model_type={hf.get('model_type')!r}, "
                              f"architectures={arch}")
    if hf.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"unsupported hidden_act {hf.get('hidden_act')!r} (LLaMA uses silu)")
    if hf.get("attention_bias", False) or hf.get("mlp_bias", False):
        raise CheckpointError("attention_bias/mlp_bias checkpoints are not supported")
    scaling = hf.get("rope_scaling")
    if scaling not in (None, {}) and (scaling or {}).get("rope_type", scaling.get("type")) != "default":
        raise CheckpointError(f"rope_scaling {scaling!r} is not supported")
    d, n_heads = _cfg(hf, "hidden_size"), _cfg(hf, "num_attention_heads")
    head_dim = hf.get("head_dim") or d // n_heads
    if head_dim * n_heads != d:
        raise CheckpointError(f"head_dim={head_dim} with {n_heads} heads != hidden_size={d}: not supported")
    rope_theta = hf.get("rope_theta")
    if rope_theta is None:
        rope_theta = (hf.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    return GPTConfig(vocab_size=_cfg(hf, "vocab_size"), context_length=_cfg(hf, "max_position_embeddings"),
                     d_model=d, n_layers=_cfg(hf, "num_hidden_layers"), n_heads=n_heads,
                     d_ff=_cfg(hf, "intermediate_size"), positional="rope", rope_pairing="half",
                     rope_base=float(rope_theta), norm="rmsnorm", norm_position="pre", activation="swiglu",
                     bias=False, n_kv_heads=hf.get("num_key_value_heads") or n_heads,
                     tie_weights=bool(hf.get("tie_word_embeddings", False)),
                     norm_eps=float(hf.get("rms_norm_eps", 1e-6)))


def llama_state_dict(tensors: dict[str, torch.Tensor], config: GPTConfig) -> tuple[dict, dict]:
    """Rename LLaMA tensors to :class:`GPT` names; returns ``(state, source names)``."""
    t = dict(tensors)
    state, src = {}, {}

    def put(ours, theirs):
        state[ours], src[ours] = _take(t, theirs), theirs

    put("token_embedding.weight", "model.embed_tokens.weight")
    for i in range(config.n_layers):
        p, o = f"model.layers.{i}.", f"blocks.{i}."
        put(o + "norm_1.weight", p + "input_layernorm.weight")
        for ours, theirs in (("W_q", "q_proj"), ("W_k", "k_proj"), ("W_v", "v_proj"), ("W_o", "o_proj")):
            put(o + f"attention.{ours}.weight", p + f"self_attn.{theirs}.weight")
        put(o + "norm_2.weight", p + "post_attention_layernorm.weight")
        for ours, theirs in (("W_gate", "gate_proj"), ("W_in", "up_proj"), ("W_out", "down_proj")):
            put(o + f"ffn.{ours}.weight", p + f"mlp.{theirs}.weight")
    put("final_norm.weight", "model.norm.weight")
    lm_head = t.pop("lm_head.weight", None)
    if config.tie_weights:
        if lm_head is not None and not torch.equal(lm_head, state["token_embedding.weight"]):
            raise CheckpointError("tie_word_embeddings is true but 'lm_head.weight' differs from the embedding")
    else:
        if lm_head is None:
            raise CheckpointError("checkpoint is missing tensor 'lm_head.weight' (tie_word_embeddings is false)")
        state["unembedding.weight"], src["unembedding.weight"] = lm_head, "lm_head.weight"
    t = {k: v for k, v in t.items() if not k.endswith("rotary_emb.inv_freq")}  # a buffer, not a weight
    if t:
        raise CheckpointError(f"unexpected tensor(s) in the checkpoint: {sorted(t)[:5]}")
    return state, src


def load_llama(path: str | os.PathLike, *, dtype: torch.dtype = torch.float32) -> GPT:
    """A :class:`GPT` with the weights of a local Hugging Face ``LlamaForCausalLM`` folder (eval mode).

    The folder needs ``config.json`` and ``model.safetensors``. The tokenizer is not loaded (LLaMA
    checkpoints ship their own SentencePiece/BPE files).
    """
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"{path} is not a checkpoint folder")
    hf, tensors = _read_folder(path)
    config = llama_config(hf)
    state, src = llama_state_dict(tensors, config)
    return _check_and_load(GPT(config), state, src).to(dtype).eval()
