"""How much memory a model needs, known before it is built: absurd sizes are refused, never allocated.

A configuration read from a file or typed on the command line is untrusted input: ``vocab_size`` 10⁹ in a
checkpoint, ``--positional learned --context 100000000`` or ``--d-model 100000`` would make a model's constructor
ask for tens or hundreds of gigabytes, and the program would die in the allocator or swap the machine to a halt.
Here the sizes are counted from the configuration alone, by arithmetic (:func:`parameter_count`,
:func:`buffer_bytes`: chapter 6's count, the same numbers the built model has), and the total is compared with the
memory of the device it is meant for. Nothing is built first: even a model on PyTorch's ``meta`` device (shapes
without storage) costs a Python object per layer, and ``--layers 100000`` would take many minutes to build.
:func:`meta_model` builds one when the tensors' shapes themselves are needed (to compare with a file's).

The bound: refuse when a *lower* estimate of the need exceeds the device's total memory (the machine's physical
memory for the CPU, the GPU's own memory for CUDA). For using a model the estimate is its parameters and buffers;
for training it adds a gradient and AdamW's two moments per trainable parameter (float32: 16 bytes per parameter in
all), the logits of one batch and their gradient, and one activation of the residual stream per block. Everything
else a run needs comes on top, so what this refuses can never fit, and what it lets through may still be too big (the
allocator then says so, as for any program); it exists to stop absurd sizes before they cost anything.
"""

from __future__ import annotations

import os

import torch
from torch import nn

__all__ = ["meta_model", "model_bytes", "training_bytes", "parameter_count", "buffer_bytes", "config_model_bytes",
           "config_training_bytes", "device_memory", "check_fits", "check_state_dict", "format_bytes"]


def meta_model(cls, config) -> nn.Module:
    """``cls(config)`` built on the meta device: every tensor has its shape and dtype but no storage."""
    with torch.device("meta"):
        return cls(config)


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def model_bytes(model: nn.Module) -> int:
    """Bytes of ``model``'s parameters and buffers (works on a meta model)."""
    return _bytes(model.parameters()) + _bytes(model.buffers())


def _vocab_and_layers(config) -> tuple[int, int]:
    """The output vocabulary and the number of blocks of a GPT-like or encoder-decoder configuration."""
    vocab = getattr(config, "vocab_size", None) or getattr(config, "tgt_vocab_size", 0)
    layers = getattr(config, "n_layers", None)
    if layers is None:
        layers = getattr(config, "n_encoder_layers", 0) + getattr(config, "n_decoder_layers", 0)
    return vocab, layers


def training_bytes(model: nn.Module, batch_size: int, context_length: int) -> dict:
    """A lower estimate of the memory that training ``model`` (possibly a meta model) takes, in bytes, by part.

    ``parameters``: weights, gradients and AdamW's two moments, 4 copies of every trainable parameter (Muon keeps
    less for its matrices, but the rest of the parameters use AdamW) and 1 of every frozen one (``requires_grad``
    off: LoRA's base, chapter 13); ``buffers``: the model's fixed tables;
    ``activations``: the logits of one batch of ``batch_size`` x ``context_length`` tokens and their gradient,
    plus one d_model-wide activation per block. ``total`` adds them up.
    """
    trainable = _bytes(p for p in model.parameters() if p.requires_grad)
    return _training_parts(model.config, _bytes(model.parameters()), trainable, _bytes(model.buffers()),
                           batch_size, context_length)


def _training_parts(config, parameter_bytes: int, trainable_bytes: int, buffer_bytes_: int, batch_size: int,
                    context_length: int) -> dict:
    """:func:`training_bytes`'s parts from the sizes of a model's tensors and its configuration."""
    vocab, layers = _vocab_and_layers(config)
    tokens = batch_size * context_length
    parts = {"parameters": parameter_bytes + 3 * trainable_bytes, "buffers": buffer_bytes_,
             "activations": 4 * tokens * (2 * vocab + layers * config.d_model)}
    parts["total"] = sum(parts.values())
    return parts


# --- the same sizes from a configuration alone: arithmetic, nothing built ------------------------------------------

def _norm_parameters(config, d: int) -> int:
    """LayerNorm has a gain and a bias per feature (γ, β), RMSNorm a gain only."""
    return 2 * d if config.norm == "layernorm" else d


def _linear_parameters(d_in: int, d_out: int, bias: bool) -> int:
    return d_in * d_out + (d_out if bias else 0)


def _attention_parameters(config, bias: bool = True, n_kv_heads: int | None = None, qk_norm: bool = False) -> int:
    """W_q and W_o (d_M x d_M), W_k and W_v (d_M x n_kv d_head: smaller with grouped-query attention), biases if
    ``bias``, and QK-norm's two RMSNorm gains of d_head."""
    d, d_head = config.d_model, config.d_model // config.n_heads
    inner, inner_kv = config.n_heads * d_head, (n_kv_heads or config.n_heads) * d_head
    return (2 * _linear_parameters(d, inner_kv, bias) + _linear_parameters(d, inner, bias)
            + _linear_parameters(inner, d, bias) + (2 * d_head if qk_norm else 0))


def _ffn_parameters(config, activation: str = "gelu", bias: bool = True) -> int:
    """W_in (d_M -> d_FFN) and W_out (d_FFN -> d_M); SwiGLU adds the gate W_gate (d_M -> d_FFN)."""
    d, f = config.d_model, config.d_ff
    total = _linear_parameters(d, f, bias) + _linear_parameters(f, d, bias)
    return total + (_linear_parameters(d, f, bias) if activation == "swiglu" else 0)


def _block_parameters(config) -> int:
    """One :class:`~groundup.layers.TransformerBlock` of ``config`` (its optional fields read with the block's
    defaults): norm_1, attention, and unless the block is parallel or attention-only norm_2, and the FFN."""
    bias, ffn = getattr(config, "bias", True), getattr(config, "ffn", True)
    total = _norm_parameters(config, config.d_model) + _attention_parameters(
        config, bias, getattr(config, "n_kv_heads", None), getattr(config, "qk_norm", False))
    if ffn and not getattr(config, "parallel_block", False):
        total += _norm_parameters(config, config.d_model)
    if ffn:
        total += _ffn_parameters(config, getattr(config, "activation", "gelu"), bias)
    return total


def parameter_count(config) -> int:
    """The number of parameters of the model the book builds from ``config``, counted from the configuration alone:
    ``sum(p.numel() for p in model.parameters())`` without building it (a tied matrix counts once).

    A :class:`~groundup.models.GPTConfig` (or a subclass: chapter 14's attention-only blocks) gives a
    :class:`~groundup.models.GPT`, a :class:`~groundup.models.MaskedLMConfig` a :class:`~groundup.models.MaskedLM`,
    an :class:`~groundup.models.EncoderDecoderConfig` an :class:`~groundup.models.EncoderDecoder`. Chapter 6's count:
    the token embedding n_V d_M (and an untied unembedding as many again), a learned position table n_C d_M (relative
    positions: one bias per head and offset; sinusoidal, ALiBi, RoPE: none), ``n_layers`` blocks of attention, FFN
    and norms, and the final norm of a Pre-LN stack.
    """
    from groundup.models import EncoderDecoderConfig, GPTConfig, MaskedLMConfig

    if not isinstance(config, (GPTConfig, EncoderDecoderConfig)):
        raise TypeError(f"config must be a GPTConfig or an EncoderDecoderConfig, got {type(config).__name__}")
    d = config.d_model
    if isinstance(config, EncoderDecoderConfig):
        total = (config.src_vocab_size + config.tgt_vocab_size) * d
        total += 2 * config.context_length * d if config.positional == "learned" else 0
        total += config.n_encoder_layers * _block_parameters(config)
        decoder_block = 3 * _norm_parameters(config, d) + 2 * _attention_parameters(config) + _ffn_parameters(
            config, getattr(config, "activation", "gelu"))
        total += config.n_decoder_layers * decoder_block
        total += 2 * _norm_parameters(config, d) if config.norm_position == "pre" else 0
        return total + (0 if config.tie_weights else config.tgt_vocab_size * d)
    total = config.vocab_size * d
    if config.positional == "learned":
        total += config.context_length * d
    elif config.positional == "relative":  # offsets 0..n_C (causal) or -n_C..n_C (a masked LM sees both ways)
        offsets = 2 * config.context_length + 1 if isinstance(config, MaskedLMConfig) else config.context_length + 1
        total += config.n_heads * offsets
    total += config.n_layers * _block_parameters(config)
    total += _norm_parameters(config, d) if config.norm_position == "pre" else 0
    return total + (0 if config.tie_weights else config.vocab_size * d)


def buffer_bytes(config) -> int:
    """Bytes of the fixed tables (buffers) of the model the book builds from ``config`` (see
    :func:`parameter_count`): a sinusoidal table n_C x d_M and ALiBi's n_H x n_C x n_C biases in float32, RoPE's
    d_head / 2 frequencies in float64."""
    c = config
    if c.positional == "sinusoidal":
        return 4 * c.context_length * c.d_model
    if c.positional == "alibi":
        return 4 * c.n_heads * c.context_length ** 2
    if c.positional == "rope":
        return 8 * (c.d_model // c.n_heads // 2)
    return 0


def config_model_bytes(config) -> int:
    """:func:`model_bytes` of the model ``config`` describes (float32 parameters), without building it."""
    return 4 * parameter_count(config) + buffer_bytes(config)


def config_training_bytes(config, batch_size: int, context_length: int) -> dict:
    """:func:`training_bytes` of a new model built from ``config`` (every parameter trainable), without building it:
    the same parts and the same numbers, from arithmetic alone, so an absurd ``n_layers`` costs nothing to refuse."""
    parameters = 4 * parameter_count(config)
    return _training_parts(config, parameters, parameters, buffer_bytes(config), batch_size, context_length)


def device_memory(device=None) -> int | None:
    """Total memory of ``device`` in bytes: physical memory for the CPU (or None where the system does not say),
    the GPU's memory for CUDA; None for devices this does not know."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type == "cuda" and torch.cuda.is_available():
        index = device.index if device.index is not None else torch.cuda.current_device()
        return torch.cuda.get_device_properties(index).total_memory
    if device.type != "cpu":
        return None
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not a POSIX system that reports it
        return None


def format_bytes(n: float) -> str:
    """``n`` bytes in GB (10⁹ bytes) with a precision that suits its size: 0.03 GB, 1.5 GB, 320 GB."""
    gb = n / 1e9
    return f"{gb:,.0f} GB" if gb >= 100 else f"{gb:.1f} GB" if gb >= 1 else f"{gb:.2g} GB"


def check_fits(needed: int, what: str, *, device=None, advice: str = "") -> None:
    """Raise ``ValueError`` when ``needed`` bytes exceed ``device``'s memory: "``what`` needs at least ...".

    ``what`` names the input that asked for it (a flag with its value, a file); ``advice`` ends the message.
    """
    available = device_memory(device)
    if available is not None and needed > available:
        where = "this machine's" if device is None or torch.device(device).type == "cpu" else f"the {device}'s"
        raise ValueError(f"{what} needs at least {format_bytes(needed)} of memory, more than {where} "
                         f"{format_bytes(available)}{'; ' + advice if advice else ''}")


def check_state_dict(model: nn.Module, state_dict: dict, source) -> None:
    """Raise ``ValueError`` unless ``state_dict`` has exactly ``model``'s entries with the same shapes.

    With a meta ``model`` this compares a stored configuration with the stored tensors before anything is
    allocated: a file whose configuration claims sizes its tensors do not have is refused, naming ``source``.
    """
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    stored = {name: tuple(t.shape) for name, t in state_dict.items() if isinstance(t, torch.Tensor)}
    missing = sorted(set(expected) - set(stored))
    unexpected = sorted(set(state_dict) - set(expected))
    wrong = [f"{name} {stored[name]} (the configuration says {shape})" for name, shape in expected.items()
             if name in stored and stored[name] != shape]
    if missing or unexpected or wrong:
        what = "; ".join(part for part in (
            f"missing {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}" if missing else "",
            f"unexpected {', '.join(unexpected[:3])}{' ...' if len(unexpected) > 3 else ''}" if unexpected else "",
            f"shape {', '.join(wrong[:3])}{' ...' if len(wrong) > 3 else ''}" if wrong else "") if part)
        raise ValueError(f"{source}: the stored weights do not match the stored model configuration ({what})")
