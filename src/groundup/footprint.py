"""How much memory a model needs, known before it is built: absurd sizes are refused, never allocated.

A configuration read from a file or typed on the command line is untrusted input: ``vocab_size`` 10⁹ in a
checkpoint, ``--positional learned --context 100000000`` or ``--d-model 100000`` would make a model's constructor
ask for tens or hundreds of gigabytes, and the program would die in the allocator or swap the machine to a halt.
Here the model is first built on PyTorch's ``meta`` device (shapes without storage: instantaneous, no memory), its
parameters and buffers are counted, and the total is compared with the memory of the device it is meant for.

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

__all__ = ["meta_model", "model_bytes", "training_bytes", "device_memory", "check_fits", "check_state_dict",
           "format_bytes"]


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
    vocab, layers = _vocab_and_layers(model.config)
    tokens = batch_size * context_length
    trainable = _bytes(p for p in model.parameters() if p.requires_grad)
    parts = {"parameters": _bytes(model.parameters()) + 3 * trainable, "buffers": _bytes(model.buffers()),
             "activations": 4 * tokens * (2 * vocab + layers * model.config.d_model)}
    parts["total"] = sum(parts.values())
    return parts


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
