"""Low-rank adapters (LoRA; Hu et al. 2021) for the ``nn.Linear`` layers of the book's models (chapter 13).

A frozen pretrained layer ``y = W x + b`` gets a trainable update of rank ``r`` beside it:

    y = W x + b + (alpha / r) * B (A dropout(x)),   A: (r, d_in) random,  B: (d_out, r) zero

so training starts at the pretrained function (B = 0) and only ``r (d_in + d_out)`` numbers per layer learn.

    attach_lora(model, targets=("W_q", "W_v"), r=8, alpha=16)   # freezes everything else
    ... train ...
    save_lora(model, "adapter.pt")                              # the adapters alone, a few kB to MB
    load_lora(fresh_base_model, "adapter.pt")                   # refused for another base (SHA-256 fingerprint)
    merge_lora(model)                                           # W <- W + (alpha/r) B A: one matmul a layer
    unmerge_lora(model)                                         # W <- W - (alpha/r) B A: adapters back apart

The computation, the initialisation and the merge are those of ``peft``'s LoRA (``tests/test_lora.py`` checks
the outputs against ``peft.tuners.lora.Linear`` given the same A and B).
"""

from __future__ import annotations

import hashlib
import io
import math
import numbers
import os
import pickle
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from groundup.utils import atomic_write_bytes

LORA_FORMAT = "groundup-lora"
LORA_VERSION = 1
DEFAULT_TARGETS = ("W_q", "W_v")
"""Hu et al.'s choice: adapt the query and value projections of every attention layer."""


class LoRALinear(nn.Module):
    """A frozen ``nn.Linear`` plus a trainable low-rank update ``(alpha / r) B A``.

    ``A`` (``r x in_features``) starts as ``nn.Linear``'s own default weights, Kaiming-uniform with
    ``a = sqrt(5)`` (entries uniform in ±1/sqrt(in_features)), as in the LoRA paper's code and ``peft``: random,
    so the gradient reaching ``B`` is not zero, and small, so ``A x`` has the scale of a freshly initialised layer's
    output. ``B`` (``out_features x r``) starts at zero, so the adapted layer computes exactly the pretrained one
    until the first optimizer step. Dividing by ``r`` (scale ``alpha / r``) keeps the size of the update roughly
    independent of ``r``, so a learning rate found at one rank still works at another.

    ``dropout`` (a probability) is applied to the adapter's input only, while training. After :meth:`merge` the
    update lives inside ``base.weight`` and the forward pass is the plain layer's; :meth:`unmerge` subtracts it
    again (exact up to one floating-point rounding per weight: ``(W + D) - D`` may differ from ``W`` in the last
    bit of the dtype).
    """

    def __init__(self, base: nn.Linear, r: int, alpha: float, *, dropout: float = 0.0):
        super().__init__()
        if not isinstance(base, nn.Linear):
            raise TypeError(f"base must be an nn.Linear, got {type(base).__name__}")
        r = _check_rank(r, base)
        if isinstance(alpha, bool) or not isinstance(alpha, numbers.Real) or not math.isfinite(alpha) or alpha <= 0:
            raise ValueError(f"alpha must be a positive number (the update is scaled by alpha / r), got {alpha!r}")
        if isinstance(dropout, bool) or not isinstance(dropout, numbers.Real) or not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be a probability in [0, 1), got {dropout!r}")
        self.base, self.r, self.alpha, self.scale = base, r, float(alpha), float(alpha) / r
        factory = {"dtype": base.weight.dtype, "device": base.weight.device}
        self.A = nn.Parameter(torch.empty(r, base.in_features, **factory))
        self.B = nn.Parameter(torch.zeros(base.out_features, r, **factory))
        nn.init.kaiming_uniform_(self.A, a=math.sqrt(5))
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.merged = False

    @property
    def in_features(self) -> int:
        return self.base.in_features

    @property
    def out_features(self) -> int:
        return self.base.out_features

    @property
    def weight(self) -> torch.Tensor:
        """The layer's effective weight ``W + (alpha / r) B A`` (what a merged layer holds); read-only."""
        return self.base.weight if self.merged else self.base.weight + self.delta_weight()

    @property
    def bias(self) -> torch.Tensor | None:
        return self.base.bias

    def delta_weight(self) -> torch.Tensor:
        """The update ``(alpha / r) B A``, shape ``(out_features, in_features)``."""
        return (self.B @ self.A) * self.scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        if self.merged:
            if torch.is_grad_enabled() and (self.A.requires_grad or self.B.requires_grad):
                raise RuntimeError("this LoRA adapter is merged into its base weights, so it cannot learn: call "
                                   "unmerge_lora(model) before training (or run inference under torch.no_grad())")
            return out
        return out + F.linear(F.linear(self.dropout(x), self.A), self.B) * self.scale

    @torch.no_grad()
    def merge(self) -> None:
        """Add the update into ``base.weight`` (``W <- W + (alpha / r) B A``)."""
        if self.merged:
            raise RuntimeError("this LoRA adapter is already merged")
        self.base.weight += self.delta_weight()
        self.merged = True

    @torch.no_grad()
    def unmerge(self) -> None:
        """Take the update out of ``base.weight`` again (``W <- W - (alpha / r) B A``)."""
        if not self.merged:
            raise RuntimeError("this LoRA adapter is not merged")
        self.base.weight -= self.delta_weight()
        self.merged = False

    def extra_repr(self) -> str:
        return f"r={self.r}, alpha={self.alpha:g}, scale={self.scale:g}, merged={self.merged}"


def _check_rank(r, base: nn.Linear) -> int:
    if isinstance(r, bool) or not isinstance(r, numbers.Integral) or r < 1:
        raise ValueError(f"r (the adapter's rank) must be a positive integer, got {r!r}")
    limit = min(base.in_features, base.out_features)
    if r > limit:
        raise ValueError(f"r = {r} exceeds min(in_features, out_features) = {limit} of the adapted layer: an "
                         f"update of rank above {limit} is impossible, so r must be at most {limit}")
    return int(r)


def _check_rank_for_all(r, layers: dict[str, nn.Linear]) -> None:
    """Refuse a rank that one of ``layers`` cannot take, naming the smallest bound among them all (not the first
    layer's: SmolLM2's W_q is 576 x 576 but its W_v 192 x 576, so "at most 576" would be followed by "at most 192").
    A rank that is not a positive integer is left to :class:`LoRALinear`'s message."""
    if isinstance(r, bool) or not isinstance(r, numbers.Integral) or r < 1:
        return
    name = min(layers, key=lambda n: min(layers[n].in_features, layers[n].out_features))
    layer = layers[name]
    bound = min(layer.in_features, layer.out_features)
    if r > bound:
        raise ValueError(f"r = {r} exceeds {bound}, the smallest min(in_features, out_features) among the layers to "
                         f"adapt ({name}: {layer.in_features} -> {layer.out_features}): an update of rank above "
                         f"{bound} is impossible there, so r must be at most {bound}")


def _matches(name: str, targets: Iterable[str]) -> bool:
    """``blocks.0.attention.W_q`` matches the targets ``"W_q"`` and ``"attention.W_q"`` (a dotted suffix)."""
    return any(name == t or name.endswith("." + t) for t in targets)


def lora_layers(model: nn.Module) -> dict[str, LoRALinear]:
    """The model's adapted layers by module name (``"blocks.0.attention.W_q"`` ...), in module order."""
    return {name: m for name, m in model.named_modules() if isinstance(m, LoRALinear)}


def attach_lora(model: nn.Module, targets: Iterable[str] = DEFAULT_TARGETS, *, r: int = 8, alpha: float = 16.0,
                dropout: float = 0.0) -> dict[str, LoRALinear]:
    """Wrap every ``nn.Linear`` of ``model`` named by ``targets`` in a :class:`LoRALinear`; freeze the rest.

    ``targets`` are module names or dotted suffixes of them: ``"W_q"``, ``"W_k"``, ``"W_v"``, ``"W_o"`` (the
    attention projections of :class:`~groundup.attention.MultiHeadAttention`), ``"W_in"``, ``"W_out"``,
    ``"W_gate"`` (the feed-forward layers), ``"cross_attention.W_q"`` (only the encoder-decoder's
    cross-attention). Afterwards only the adapters' ``A`` and ``B`` require gradients: every other parameter of
    ``model`` is frozen (unfreeze a task head yourself, or attach before adding it). Returns the new layers by name.
    """
    if isinstance(targets, str):
        targets = (targets,)
    targets = tuple(targets)
    if not targets or not all(isinstance(t, str) and t for t in targets):
        raise ValueError(f"targets must be a non-empty sequence of layer names such as ('W_q', 'W_v'), got "
                         f"{targets!r}")
    if lora_layers(model):
        raise ValueError("model already has LoRA adapters; attach once (or start from the base model)")
    linear = {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    chosen = {name: m for name, m in linear.items() if _matches(name, targets)}
    missing = [t for t in targets if not any(_matches(name, (t,)) for name in chosen)]
    if missing:
        kinds = sorted({name.rsplit(".", 1)[-1] for name in linear})
        raise ValueError(f"targets {missing} name no nn.Linear layer of this {type(model).__name__}; its linear "
                         f"layers are called {kinds}")
    _check_rank_for_all(r, chosen)
    adapters = {name: LoRALinear(m, r, alpha, dropout=dropout) for name, m in chosen.items()}
    for p in model.parameters():
        p.requires_grad_(False)
    for name, adapter in adapters.items():
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, adapter)
        adapter.A.requires_grad_(True)
        adapter.B.requires_grad_(True)
    return adapters


def merge_lora(model: nn.Module) -> None:
    """Merge every adapter of ``model`` into its base weight: one matmul per adapted layer, no adapter path."""
    for adapter in _require_adapters(model).values():
        adapter.merge()


def unmerge_lora(model: nn.Module) -> None:
    """Undo :func:`merge_lora` (each weight back up to one rounding; see :class:`LoRALinear`)."""
    for adapter in _require_adapters(model).values():
        adapter.unmerge()


def count_parameters(model: nn.Module, *, trainable_only: bool = False) -> int:
    """The number of parameters of ``model`` (shared tensors counted once); only trainable ones if asked."""
    seen = {id(p): p for p in model.parameters()}
    return sum(p.numel() for p in seen.values() if p.requires_grad or not trainable_only)


def lora_parameter_count(shapes: Iterable[tuple[int, int]], r: int) -> int:
    """Trainable numbers of rank-``r`` adapters on layers of shapes ``(out_features, in_features)``: r (in + out)."""
    return sum(r * (d_in + d_out) for d_out, d_in in shapes)


def _require_adapters(model: nn.Module) -> dict[str, LoRALinear]:
    adapters = lora_layers(model)
    if not adapters:
        raise ValueError(f"this {type(model).__name__} has no LoRA adapters (call attach_lora first)")
    return adapters


# ---- the adapters alone: a small file, tied to the base it was trained on ----------------------------------------

def base_fingerprint(model: nn.Module, names: Iterable[str]) -> str:
    """SHA-256 of the base weights (name, dtype, shape, bytes of weight and bias) of the layers ``names``.

    An adapter is only meaningful on the weights it was trained beside; the fingerprint lets :func:`load_lora`
    refuse another base (or the same base in another dtype). The layers must not be merged.
    """
    digest = hashlib.sha256()
    for name in sorted(names):
        layer = model.get_submodule(name)
        if isinstance(layer, LoRALinear):
            if layer.merged:
                raise ValueError(f"layer {name} has its adapter merged into the weights; call unmerge_lora(model) "
                                 "first (the fingerprint is of the pretrained weights alone)")
            layer = layer.base
        if not isinstance(layer, nn.Linear):
            raise ValueError(f"layer {name} is a {type(layer).__name__}, not an nn.Linear")
        for kind, t in (("weight", layer.weight), ("bias", layer.bias)):
            if t is None:
                continue
            t = t.detach().to("cpu").contiguous()
            digest.update(f"{name}.{kind} {t.dtype} {tuple(t.shape)}\n".encode())
            digest.update(t.reshape(-1).view(torch.uint8).numpy())
    return digest.hexdigest()


def lora_state_dict(model: nn.Module) -> dict:
    """The adapters of ``model`` alone: ranks, scale, the base's fingerprint and every layer's ``A`` and ``B``."""
    adapters = _require_adapters(model)
    first = next(iter(adapters.values()))
    if any((a.r, a.alpha) != (first.r, first.alpha) for a in adapters.values()):
        raise ValueError("the adapters of this model have different r or alpha; lora_state_dict stores one of each")
    return {
        "format": LORA_FORMAT,
        "version": LORA_VERSION,
        "r": first.r,
        "alpha": first.alpha,
        "base_sha256": base_fingerprint(model, adapters),
        "layers": {name: [a.out_features, a.in_features] for name, a in adapters.items()},
        "A": {name: a.A.detach().clone() for name, a in adapters.items()},
        "B": {name: a.B.detach().clone() for name, a in adapters.items()},
    }


def save_lora(model: nn.Module, path: str | os.PathLike) -> None:
    """Write :func:`lora_state_dict` to ``path`` atomically (a crash leaves the old file or the new one)."""
    buffer = io.BytesIO()
    torch.save(lora_state_dict(model), buffer)
    atomic_write_bytes(path, buffer.getvalue())


def _check_state(state) -> tuple[int, float, dict]:
    """The rank, alpha and layer shapes of an adapter state, after checking its structure (nothing allocated)."""
    if not isinstance(state, dict) or state.get("format") != LORA_FORMAT:
        raise ValueError(f"not a LoRA adapter state: expected a dict with format {LORA_FORMAT!r} (from "
                         "lora_state_dict or save_lora)")
    if state.get("version") != LORA_VERSION:
        raise ValueError(f"LoRA adapter state of version {state.get('version')!r}; this groundup reads version "
                         f"{LORA_VERSION}")
    r, alpha, layers = state.get("r"), state.get("alpha"), state.get("layers")
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise ValueError(f"the adapter's r must be a positive integer, got {r!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha) or alpha <= 0:
        raise ValueError(f"the adapter's alpha must be a positive number, got {alpha!r}")
    if not isinstance(layers, dict) or not layers:
        raise ValueError("the adapter state names no layers")
    for key in ("A", "B"):
        if not isinstance(state.get(key), dict) or set(state[key]) != set(layers):
            raise ValueError(f"the adapter state's {key} must hold one tensor for each of its layers")
    if not isinstance(state.get("base_sha256"), str):
        raise ValueError("the adapter state has no base_sha256 fingerprint")
    return r, float(alpha), layers


def _check_fingerprint(model: nn.Module, state: dict) -> None:
    """Refuse adapters (a checked state) whose base fingerprint is not that of ``model``'s adapted layers."""
    fingerprint = base_fingerprint(model, state["layers"])
    if fingerprint != state["base_sha256"]:
        raise ValueError("these adapters were trained on another base model: the SHA-256 of the adapted layers' "
                         f"pretrained weights is {fingerprint[:16]}... here but {state['base_sha256'][:16]}... in "
                         "the adapters (other weights, or the same weights in another dtype)")


def check_base(model: nn.Module, state) -> None:
    """Refuse, with a ``ValueError``, an adapter state (:func:`lora_state_dict`) not made for ``model``: a state of
    the wrong structure, layers ``model`` lacks, or another base (the fingerprint of the adapted layers' weights).
    Nothing is attached or changed; :func:`load_lora` checks the same and more (shapes, r, alpha) as it loads."""
    _check_state(state)
    try:
        _check_fingerprint(model, state)
    except AttributeError as err:  # a layer name model does not have
        raise ValueError(f"the adapters do not fit this model ({err})") from None


def _check_finite(name: str, layer: nn.Module, A: torch.Tensor, B: torch.Tensor, scale: float) -> None:
    """Refuse an adapter (of checked shapes) that cannot compute finite numbers in ``layer``'s dtype.

    Every entry of ``A`` and ``B`` must be finite in that dtype (float64's 1e300 is inf in float32). And for inputs
    ``x`` whose entries are at most 1 in size, the adapter's ``A x`` and its output ``(alpha / r) B A x`` must stay
    below the square root of the dtype's largest number (1.8e19 in float32): what a layer outputs is squared next
    (RMSNorm's mean square, attention's dot products), so a larger output overflows there even where it is finite
    itself. Their worst cases over such inputs are absolute row sums, ``|A| 1`` and ``(alpha / r) |B| |A| 1``, so
    two small sums decide it. A single 1e38 in A or B is refused; a trained adapter (entries of order 0.01 to 1,
    row sums of tens) is some seventeen orders of magnitude inside the bound, so no file training writes is
    refused. The bound refuses files; it is not a promise about every input (real activations can exceed 1).
    """
    base = layer.base if isinstance(layer, LoRALinear) else layer
    dtype = base.weight.dtype
    for key, t in (("A", A), ("B", B)):
        if not bool(torch.isfinite(t.detach().to(dtype)).all()):
            raise ValueError(f"the adapter's {key} of layer {name} holds values that are not finite in {dtype} "
                             "(nan or inf; e.g. 1e300 overflows float32): a damaged or edited file")
    limit = math.sqrt(torch.finfo(dtype).max)
    a, b = A.detach().double().abs(), B.detach().double().abs()
    with torch.no_grad():
        a_x = a.sum(1)
        worst = {"A x": a_x.max().item(), "(alpha / r) B A x": scale * (b @ a_x).max().item()}
    for what, value in worst.items():
        if not value < limit:
            raise ValueError(f"the adapter of layer {name} is too large for {dtype}: for inputs x whose entries are "
                             f"at most 1, {what} reaches {value:.3g}, beyond {limit:.3g} (the square root of the "
                             f"largest {dtype} number: the next norm or dot product would overflow); its A holds "
                             f"entries up to {a.max().item():.3g}, its B up to {b.max().item():.3g}: a damaged or "
                             "edited file")


def load_lora(model: nn.Module, state_or_path, *, dropout: float = 0.0) -> dict[str, LoRALinear]:
    """Load adapters (a :func:`lora_state_dict` or a :func:`save_lora` file) onto ``model``; return them by name.

    A model without adapters gets them attached first (the stored layers, r and alpha; everything else frozen);
    a model with adapters must have the same layers, r and alpha. Refused with a ``ValueError`` naming what
    differs, before anything of the file's size is allocated: a missing layer, another layer shape, another
    rank or alpha, a tensor of the wrong shape or dtype, values that are not finite or too large to compute with
    in the model's dtype (NaN, inf, 1e38: see :func:`_check_finite`), or another base model (the SHA-256
    fingerprint of the adapted layers' pretrained weights). Files are read with ``weights_only=True`` and
    memory-mapped.
    """
    if isinstance(state_or_path, (str, os.PathLike)):
        try:
            state = torch.load(state_or_path, map_location="cpu", weights_only=True, mmap=True)
        except (pickle.UnpicklingError, RuntimeError, EOFError) as err:  # not a torch.save file of plain data
            raise ValueError(f"{os.fspath(state_or_path)} is not a LoRA adapter file written by save_lora: "
                             f"{str(err).splitlines()[0] if str(err) else type(err).__name__}") from err
    else:
        state = state_or_path
    r, alpha, layers = _check_state(state)
    modules = dict(model.named_modules())
    for name, shape in layers.items():
        layer = modules.get(name)
        if not isinstance(layer, (nn.Linear, LoRALinear)):
            raise ValueError(f"the adapter is for layer {name!r}, which this {type(model).__name__} does not have "
                             "as a linear layer: it was trained on another architecture")
        if list(shape) != [layer.out_features, layer.in_features]:
            raise ValueError(f"the adapter's layer {name} is {list(shape)} (out, in) but this model's is "
                             f"{[layer.out_features, layer.in_features]}: another architecture or size")
        if r > min(shape):
            raise ValueError(f"the adapter's r = {r} exceeds min(out, in) = {min(shape)} of layer {name}")
        for key, expected in (("A", (r, shape[1])), ("B", (shape[0], r))):
            t = state[key][name]
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != expected or not t.dtype.is_floating_point:
                got = f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"the adapter's {key} of layer {name} must be a floating-point tensor of shape "
                                 f"{expected} (r = {r}), got {got}")
        _check_finite(name, layer, state["A"][name], state["B"][name], alpha / r)
    present = lora_layers(model)
    if present and set(present) != set(layers):
        raise ValueError(f"the model's adapters are on {sorted(present)} but the file's on {sorted(layers)}")
    for name, a in present.items():
        if (a.r, a.alpha) != (r, alpha):
            raise ValueError(f"layer {name} has an adapter of r = {a.r}, alpha = {a.alpha:g}; the file's has r = "
                             f"{r}, alpha = {alpha:g}")
    _check_fingerprint(model, state)
    if not present:
        targets = tuple(layers)
        present = attach_lora(model, targets, r=r, alpha=alpha, dropout=dropout)
    with torch.no_grad():
        for name, a in present.items():
            a.A.copy_(state["A"][name])
            a.B.copy_(state["B"][name])
    return present
