"""Training a language model (chapter 7): AdamW, warm-up + cosine schedule, clipping, evaluation, checkpoints.

    config = TrainConfig(batch_size=16, max_steps=2000, learning_rate=2e-3, out_dir="run")
    history = train(model, train_ids, val_ids, config)     # a progress bar, checkpoints in run/
    evaluate(model, val_ids, batch_size=16)                 # mean next-token loss over the held-out text

The objective is the seeds' pretraining loss: the mean over every position of every window of
``-log P(next token | the tokens before it)``. Every step draws ``batch_size`` random windows from the training
ids with a ``torch.Generator`` of its own (seeded by ``config.seed``), so the data order is reproducible and
resumable.

Checkpoints hold everything a run needs to continue exactly where it stopped: the model, the optimizer, the
schedule, both random states (PyTorch's global one, which dropout draws from, and the batch sampler's), the
step, both configs and the history. They are written atomically (a temporary file in the same folder, fsync,
rename) and read with ``torch.load(..., weights_only=True)``, which loads tensors and plain containers and never
runs code from the file. A run killed at any moment resumes from its last checkpoint and ends with bit for bit
the parameters of a run that was never interrupted; Ctrl-C saves a checkpoint at the end of the current step.

A model carrying LoRA adapters (chapter 13, :mod:`groundup.lora`) is checkpointed *adapters-only*: the adapters
with the fingerprint of the pretrained weights they were trained beside (:func:`~groundup.lora.lora_state_dict`)
and the optimizer's state, which covers only the trainable parameters -- a few MB instead of the whole frozen base.
Loading or resuming such a checkpoint needs the base model, already loaded, and refuses another base.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import math
import os
import re
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from groundup.data import get_batch
from groundup.footprint import check_fits, check_state_dict, config_model_bytes, meta_model, parameter_count
from groundup.lora import load_lora, lora_layers, lora_state_dict
from groundup.models import GPT, EncoderDecoder, EncoderDecoderConfig, GPTConfig, MaskedLM, MaskedLMConfig
from groundup.utils import atomic_write_bytes, default_device, threads

__all__ = ["TrainConfig", "History", "train", "evaluate", "lr_at", "param_groups", "MuonAdamW", "muon_parameters",
           "save_checkpoint", "load_checkpoint", "read_checkpoint", "checkpoint_path", "counted_targets",
           "TrainingDiverged", "check_random_states",
           "remove_stale_temporary_files", "CHECKPOINT_NAME", "HISTORY_NAME"]

CHECKPOINT_NAME = "checkpoint.pt"
"""The file name :func:`train` writes its checkpoint to inside ``TrainConfig.out_dir``."""
HISTORY_NAME = "history.json"
"""The file name :func:`train` writes the loss curves to inside ``TrainConfig.out_dir`` (plain JSON)."""
CHECKPOINT_FORMAT = "groundup-checkpoint"
CHECKPOINT_VERSION = 1
MODEL_CLASSES = {"GPT": (GPT, GPTConfig), "MaskedLM": (MaskedLM, MaskedLMConfig),
                 "EncoderDecoder": (EncoderDecoder, EncoderDecoderConfig)}


@dataclass
class TrainConfig:
    """How to train: batch, length of the run, optimizer, schedule, evaluation and checkpoints.

    ``learning_rate`` is the peak: it rises linearly over ``warmup_steps`` and then follows a cosine down to
    ``min_lr`` (default ``learning_rate / 10``) at ``max_steps`` (see :func:`lr_at`). AdamW's ``weight_decay``
    applies to matrices only (:func:`param_groups`). ``optimizer="muon"`` updates the weight matrices of the
    blocks' linear layers with Muon instead (momentum, then the update orthogonalised by a Newton-Schulz
    iteration; PyTorch's ``torch.optim.Muon`` with its learning rate matched to AdamW's update size) and
    everything else with AdamW (:class:`MuonAdamW`). ``optimizer="sgd"`` is stochastic gradient descent (7.3)
    with heavy-ball momentum ``beta1`` (``torch.optim.SGD``: ``b <- beta1 b + g``, ``θ <- θ - lr b``; ``beta1=0``
    is plain SGD; ``beta2`` is unused) and ``weight_decay`` on the matrices, added to their gradient.
    ``grad_clip`` caps the global gradient norm (None: no clipping). Every ``eval_interval`` steps (and at the last
    step) the validation loss is measured on ``eval_batches`` batches of non-overlapping windows (None: the whole
    validation set), and a checkpoint is written to ``out_dir`` (None: no checkpoints). ``resume=True`` continues
    from the checkpoint in ``out_dir``.

    ``time_budget`` (seconds) trains for a fixed time instead: after the warm-up the cosine runs over the
    remaining time rather than the remaining steps, and training stops when the time is spent (``max_steps``
    still caps the number of steps). Such a run depends on the machine's speed, so it is not reproducible and a
    resumed run is not bit-identical to an uninterrupted one; step-based runs are both.
    """

    batch_size: int = 16
    context_length: int | None = None  # None: the model's context_length
    max_steps: int = 2000
    learning_rate: float = 2e-3
    min_lr: float | None = None
    warmup_steps: int = 100
    weight_decay: float = 0.1
    optimizer: str = "adamw"
    beta1: float = 0.9
    beta2: float = 0.99
    grad_clip: float | None = 1.0
    eval_interval: int = 250
    eval_batches: int | None = 20
    time_budget: float | None = None
    out_dir: str | None = None
    resume: bool = False
    seed: int = 0
    device: str | None = None
    progress: bool = True

    def __post_init__(self):
        for name in ("batch_size", "max_steps", "eval_interval"):
            _check_int(name, getattr(self, name), minimum=1)
        _check_int("warmup_steps", self.warmup_steps, minimum=0)
        _check_int("seed", self.seed, minimum=0)
        if self.context_length is not None:
            _check_int("context_length", self.context_length, minimum=1)
        if self.eval_batches is not None:
            _check_int("eval_batches", self.eval_batches, minimum=1)
        _check_float("learning_rate", self.learning_rate, positive=True)
        if self.min_lr is None:
            self.min_lr = self.learning_rate / 10
        _check_float("min_lr", self.min_lr)
        if self.min_lr > self.learning_rate:
            raise ValueError(f"min_lr ({self.min_lr}) must not exceed learning_rate ({self.learning_rate})")
        _check_float("weight_decay", self.weight_decay)
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {self.optimizer!r}")
        for name in ("beta1", "beta2"):
            value = getattr(self, name)
            _check_float(name, value)
            if not value < 1:
                raise ValueError(f"{name} must be in [0, 1), got {value!r}")
        if self.grad_clip is not None:
            _check_float("grad_clip", self.grad_clip, positive=True)
        if self.time_budget is not None:
            _check_float("time_budget", self.time_budget, positive=True)
        for name in ("resume", "progress"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.out_dir is not None and not isinstance(self.out_dir, (str, os.PathLike)):
            raise TypeError(f"out_dir must be a path or None, got {type(self.out_dir).__name__}")
        if self.out_dir is not None:
            self.out_dir = os.fspath(self.out_dir)
        if self.resume and self.out_dir is None:
            raise ValueError("resume=True needs out_dir: the folder whose checkpoint to continue from")


def _check_int(name: str, value, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def _check_float(name: str, value, *, positive: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise TypeError(f"{name} must be a finite number, got {value!r}")
    if value < 0 or (positive and value == 0):
        raise ValueError(f"{name} must be {'> 0' if positive else '>= 0'}, got {value!r}")


@dataclass
class History:
    """What happened during training: one entry per step, and one per evaluation."""

    step: list[int] = field(default_factory=list)  # 1, 2, ...: the number of updates made
    train_loss: list[float] = field(default_factory=list)  # the loss of that step's batch
    lr: list[float] = field(default_factory=list)  # the learning rate that step used
    grad_norm: list[float] = field(default_factory=list)  # the global gradient norm before clipping
    eval_step: list[int] = field(default_factory=list)
    val_loss: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)  # training tokens seen at each evaluation
    seconds: list[float] = field(default_factory=list)  # training time at each evaluation (not reproducible)

    def add_step(self, step: int, train_loss: float, lr: float, grad_norm: float) -> None:
        """Record update number ``step``: its batch's loss, its learning rate, its gradient norm before clipping."""
        self.step.append(step)
        self.train_loss.append(train_loss)
        self.lr.append(lr)
        self.grad_norm.append(grad_norm)

    def add_evaluation(self, step: int, val_loss: float, tokens: int, seconds: float) -> None:
        """Record the evaluation after update number ``step``."""
        self.eval_step.append(step)
        self.val_loss.append(val_loss)
        self.tokens.append(tokens)
        self.seconds.append(seconds)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> History:
        names = {f.name for f in dataclasses.fields(cls)}
        if not isinstance(d, dict) or set(d) != names:
            raise ValueError(f"a history must be a dict with the keys {sorted(names)}")
        return cls(**{k: list(v) for k, v in d.items()})


def lr_at(step: int, config: TrainConfig, *, progress: float | None = None) -> float:
    """The learning rate of update number ``step`` (0-based): linear warm-up, then cosine decay.

    ``lr(s) = lr_max (s + 1) / warmup`` for ``s < warmup``; afterwards, with ``p = (s - warmup) / (max_steps -
    warmup)`` running from 0 to 1, ``lr(s) = min_lr + (lr_max - min_lr) (1 + cos(π p)) / 2``. A time-budgeted
    run passes ``progress`` (the fraction of the post-warm-up time spent) as ``p`` instead.
    """
    _check_int("step", step, minimum=0)
    peak, low, warm = config.learning_rate, config.min_lr, config.warmup_steps
    if step < warm:
        return peak * (step + 1) / warm
    if progress is None:
        progress = (step - warm) / max(config.max_steps - warm, 1)
    progress = min(max(progress, 0.0), 1.0)
    return low + (peak - low) * 0.5 * (1.0 + math.cos(math.pi * progress))


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """AdamW's two parameter groups: matrices (decayed) and vectors -- biases, norm scales -- (not decayed).

    Weight decay pulls every decayed weight towards 0 at each step. That is a sensible prior for the weight
    matrices (and embeddings), whose size sets how strongly the inputs are mixed; for a bias or a norm's
    γ, β it would only push a shift towards 0 and a scale towards 0 instead of towards 1, for no benefit.
    Tied parameters appear once (``named_parameters`` yields each tensor once).
    """
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def muon_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters Muon updates: the weight matrices of the ``nn.Linear`` layers inside the model (W_Q, W_K,
    W_V, W_O, the FFN's), not the embedding, positional table or unembedding, and no vectors."""
    return [m.weight for m in model.modules() if isinstance(m, nn.Linear) and m.weight.requires_grad]


class MuonAdamW(torch.optim.Optimizer):
    """Muon for the blocks' weight matrices (:func:`muon_parameters`), AdamW for every other parameter.

    Muon (Jordan et al. 2024) keeps a momentum of each matrix's gradient and replaces it by the nearest
    semi-orthogonal matrix (five Newton-Schulz iterations) before the step, so every direction of the matrix
    moves by the same amount. PyTorch's ``torch.optim.Muon`` does the work; ``adjust_lr_fn="match_rms_adamw"``
    scales its step to the size of an AdamW step, so both share one learning rate and one schedule. The two
    optimizers' parameter groups are this optimizer's ``param_groups`` (the same dicts), so a learning-rate
    scheduler drives both; ``state_dict`` holds both states.
    """

    def __init__(self, model: nn.Module, *, lr: float, betas: tuple[float, float], weight_decay: float,
                 fused: bool = False):
        matrices = muon_parameters(model)
        if not matrices:
            raise ValueError("optimizer='muon' needs a model with nn.Linear layers; this one has none")
        chosen = {id(p) for p in matrices}
        rest = [p for p in model.parameters() if p.requires_grad and id(p) not in chosen]
        groups = [{"params": [p for p in rest if p.dim() >= 2], "weight_decay": weight_decay},
                  {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0}]
        self.adamw = torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, betas=betas, fused=fused)
        self.muon = torch.optim.Muon(matrices, lr=lr, weight_decay=weight_decay, adjust_lr_fn="match_rms_adamw")
        super().__init__(matrices + rest, {"lr": lr})
        self.param_groups = self.adamw.param_groups + self.muon.param_groups  # shared with the two optimizers

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("MuonAdamW.step does not take a closure")
        self.adamw.step()
        self.muon.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.adamw.zero_grad(set_to_none=set_to_none)
        self.muon.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return {"adamw": self.adamw.state_dict(), "muon": self.muon.state_dict()}

    def load_state_dict(self, state_dict: dict) -> None:
        if not isinstance(state_dict, dict) or set(state_dict) != {"adamw", "muon"}:
            raise ValueError("a MuonAdamW state must hold 'adamw' and 'muon' (was it saved with optimizer='adamw'?)")
        self.adamw.load_state_dict(state_dict["adamw"])
        self.muon.load_state_dict(state_dict["muon"])
        self.param_groups = self.adamw.param_groups + self.muon.param_groups


OPTIMIZERS = ("adamw", "muon", "sgd")


def _make_optimizer(model: nn.Module, config: TrainConfig, device: torch.device) -> torch.optim.Optimizer:
    # The fused kernel updates all parameters in one pass (about 3x faster than the per-tensor loop here).
    fused = device.type in ("cpu", "cuda")
    if config.optimizer == "muon":
        return MuonAdamW(model, lr=config.learning_rate, betas=(config.beta1, config.beta2),
                         weight_decay=config.weight_decay, fused=fused)
    if config.optimizer == "sgd":
        return torch.optim.SGD(param_groups(model, config.weight_decay), lr=config.learning_rate,
                               momentum=config.beta1, fused=fused)
    return torch.optim.AdamW(param_groups(model, config.weight_decay), lr=config.learning_rate,
                             betas=(config.beta1, config.beta2), fused=fused)


def _check_data(name: str, data, context_length: int) -> torch.Tensor:
    if not isinstance(data, torch.Tensor):
        data = torch.as_tensor(data)
    if data.dim() != 1 or data.dtype.is_floating_point or data.dtype == torch.bool:
        raise ValueError(f"{name} must be a 1-D sequence of integer token ids, got {data.dtype} of shape "
                         f"{tuple(data.shape)}")
    if len(data) < context_length + 1:
        raise ValueError(f"{name} has {len(data)} tokens; windows of context_length={context_length} need at least "
                         f"{context_length + 1}")
    return data


EVAL_SEED = 1234
"""The seed of the generator :func:`evaluate` draws its batches from when given ``batches``: every evaluation of
a run sees the same held-out batches."""


def _draw(batches, data, batch_size: int, context_length: int, generator: torch.Generator):
    """One batch from a ``batches`` function, checked: (inputs tuple, targets tensor)."""
    out = batches(data, batch_size, context_length, generator)
    if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], tuple)
            and all(isinstance(t, torch.Tensor) for t in (*out[0], out[1]))):
        raise TypeError("batches(data, batch_size, context_length, generator) must return (inputs, targets): a "
                        "tuple of tensors for the model's positional arguments and a tensor of targets, got "
                        f"{type(out).__name__}")
    return out


@torch.no_grad()
def evaluate(model: nn.Module, data, *, batch_size: int = 16, context_length: int | None = None,
             max_batches: int | None = None, batches=None) -> float:
    """The mean next-token loss of ``model`` on ``data``, over non-overlapping windows (deterministic).

    The windows ``data[s : s + context_length + 1]`` start at ``s = 0, n_C, 2 n_C, ...``; every token after the
    first of each window is predicted once, from up to ``n_C - 1`` tokens before it, as in training. With
    ``max_batches``, only that many batches are used, spread evenly over the text (cheaper, same every time).
    The model is put in eval mode (no dropout) and restored afterwards.

    Models trained on something other than next-token windows (a masked LM, an encoder–decoder) pass the same
    ``batches`` function as to :func:`train`; the loss is then the mean of ``model(*inputs, targets)``'s loss
    over ``max_batches`` batches drawn from a generator seeded with :data:`EVAL_SEED` (the same batches every
    time).
    """
    n_c = context_length or model.config.context_length
    if batches is not None:
        if max_batches is None:
            raise ValueError("evaluate with batches= needs max_batches (how many batches to average)")
        _check_int("max_batches", max_batches, minimum=1)
        _check_int("batch_size", batch_size, minimum=1)
        generator = torch.Generator().manual_seed(EVAL_SEED)
        device = next(model.parameters()).device
        was_training = model.training
        model.eval()
        try:
            losses = []
            for _ in range(max_batches):
                inputs, targets = _draw(batches, data, batch_size, n_c, generator)
                _, loss = model(*(t.to(device) for t in inputs), targets.to(device))
                losses.append(loss.item())
        finally:
            model.train(was_training)
        return sum(losses) / len(losses)
    data = _check_data("data", data, n_c)
    _check_int("batch_size", batch_size, minimum=1)
    starts = torch.arange(0, len(data) - n_c, n_c)
    n_batches = math.ceil(len(starts) / batch_size)
    if max_batches is not None and max_batches < n_batches:
        _check_int("max_batches", max_batches, minimum=1)
        keep = torch.linspace(0, len(starts) - 1, max_batches * batch_size).round().long().unique()
        starts = starts[keep]
    device = next(model.parameters()).device
    offsets = torch.arange(n_c + 1)
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    try:
        for chunk in starts.split(batch_size):
            windows = data[chunk[:, None] + offsets].long().to(device)
            logits, _ = model(windows[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1).float(), windows[:, 1:].flatten(), reduction="sum")
            total += loss.item()
            count += windows[:, 1:].numel()
    finally:
        model.train(was_training)
    return total / count


def _model_name(model: nn.Module) -> str:
    for name, (cls, _) in MODEL_CLASSES.items():
        if type(model) is cls:
            return name
    raise TypeError(f"checkpoints hold the book's models ({', '.join(MODEL_CLASSES)}), got {type(model).__name__}")


def save_checkpoint(path, model: nn.Module, *, optimizer=None, scheduler=None, step: int = 0,
                    train_config: TrainConfig | None = None, history: History | None = None,
                    generator: torch.Generator | None = None, extra: dict | None = None) -> None:
    """Write everything needed to rebuild ``model`` and continue training into ``path``, atomically.

    The file is first written to a temporary file in the same folder, flushed to disk, then renamed over
    ``path``: a reader (or a crash) sees the old checkpoint or the new one, never half of one. ``extra`` may
    hold more plain data (numbers, strings, lists, dicts, tensors).

    A model with LoRA adapters (:func:`groundup.lora.attach_lora`) is saved adapters-only: ``"model"`` holds
    :func:`~groundup.lora.lora_state_dict` (the adapters and the SHA-256 fingerprint of the adapted layers'
    pretrained weights), ``"trainable"`` any other parameter that requires gradients (a task head, say), and
    ``"adapters_only"`` is True. The frozen base is not stored: :func:`load_checkpoint` needs it as ``model``.
    """
    adapters = lora_layers(model)
    state = {
        "format": CHECKPOINT_FORMAT,
        "version": CHECKPOINT_VERSION,
        "model_class": _model_name(model),
        "model_config": dataclasses.asdict(model.config),
        "model": lora_state_dict(model) if adapters else model.state_dict(),
        "optimizer": None if optimizer is None else optimizer.state_dict(),
        "scheduler": None if scheduler is None else scheduler.state_dict(),
        "step": step,
        "train_config": None if train_config is None else dataclasses.asdict(train_config),
        "history": None if history is None else history.as_dict(),
        "torch_rng": torch.get_rng_state(),
        "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "sampler_rng": None if generator is None else generator.get_state(),
        "extra": extra or {},
    }
    if adapters:
        state["adapters_only"] = True
        state["trainable"] = _trainable_outside_adapters(model)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    atomic_write_bytes(path, buffer.getvalue())


def _trainable_outside_adapters(model: nn.Module) -> dict[str, torch.Tensor]:
    """The parameters of an adapted model that learn besides the adapters' A and B (none after attach_lora)."""
    in_adapters = {id(p) for layer in lora_layers(model).values() for p in (layer.A, layer.B)}
    return {name: p.detach().clone() for name, p in model.named_parameters()
            if p.requires_grad and id(p) not in in_adapters}


def _load_adapters(path: Path, model: nn.Module, ckpt: dict, optimizer) -> None:
    """Put an adapters-only checkpoint's adapters (and other trainable parameters) onto ``model``, the base."""
    if optimizer is not None and not lora_layers(model):
        raise ValueError(f"{path} holds LoRA adapters, but the model given has none: attach them (attach_lora with "
                         "the run's targets, r and alpha) before building the optimizer that resumes the run")
    try:
        load_lora(model, ckpt["model"])
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from None
    stored = ckpt.get("trainable", {})
    params = dict(model.named_parameters())
    if not isinstance(stored, dict):
        raise ValueError(f"{path} is not a valid groundup checkpoint: 'trainable' is not a dict")
    for name, t in stored.items():
        p = params.get(name)
        if p is None or not isinstance(t, torch.Tensor) or t.shape != p.shape:
            raise ValueError(f"{path}: the stored trainable parameter {name!r} does not fit the model")
        with torch.no_grad():
            p.copy_(t)
        p.requires_grad_(True)


_REQUIRED = {"format": str, "version": int, "model_class": str, "model_config": dict, "model": dict, "step": int}


def checkpoint_path(path) -> Path:
    """``path`` as a file: a run folder's ``checkpoint.pt``, or ``path`` itself."""
    path = Path(path)
    return path / CHECKPOINT_NAME if path.is_dir() else path


def read_checkpoint(path) -> dict:
    """The checkpoint at ``path`` (a file, or a run folder) as a dict, its structure checked; no model is built.

    Read as :func:`load_checkpoint` reads it (``weights_only=True``, untrusted): for the settings and the
    ``extra`` of a run, or to see whether it is adapters-only (``ckpt.get("adapters_only")``) before loading it.
    """
    path = checkpoint_path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint at {path}: train a model first (groundup train --out FOLDER)")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 -- an unpickling error, a truncated zip, anything: a corrupt file
        raise ValueError(f"{path} is not a readable groundup checkpoint ({type(err).__name__}: {err})") from None
    if not isinstance(ckpt, dict):
        raise ValueError(f"{path} is not a groundup checkpoint (expected a dict, got {type(ckpt).__name__})")
    for key, kind in _REQUIRED.items():
        if not isinstance(ckpt.get(key), kind) or isinstance(ckpt.get(key), bool):
            raise ValueError(f"{path} is not a valid groundup checkpoint: {key!r} is missing or not a {kind.__name__}")
    if ckpt["format"] != CHECKPOINT_FORMAT or ckpt["version"] != CHECKPOINT_VERSION:
        raise ValueError(f"{path} has format {ckpt['format']!r} version {ckpt['version']}, expected "
                         f"{CHECKPOINT_FORMAT!r} version {CHECKPOINT_VERSION}")
    if ckpt["model_class"] not in MODEL_CLASSES:
        raise ValueError(f"{path} holds an unknown model class {ckpt['model_class']!r}; known: "
                         f"{', '.join(MODEL_CLASSES)}")
    if not isinstance(ckpt.get("adapters_only", False), bool):
        raise ValueError(f"{path} is not a valid groundup checkpoint: 'adapters_only' is not True or False")
    return ckpt


def _check_stored_sizes(path: Path, config, state_dict: dict) -> None:
    """Refuse a stored model configuration that the stored tensors cannot be, counted without building anything.

    The configuration (already validated by its dataclass) gives the number of stored numbers by arithmetic
    (:func:`~groundup.footprint.parameter_count`, plus the tied embedding a second time: ``state_dict`` keeps it
    under both names; buffers are not stored), and every block holds at least 4 tensors (W_q, W_k, W_v, W_o). The
    tensors are already in memory (``weights_only=True``), so counting their numbers allocates nothing. A file
    whose configuration claims ``n_layers=100000`` over a small state dict is refused here, before a single block
    is built (even on the meta device a block costs milliseconds and a Python object per tensor).
    """
    tensors = [t for t in state_dict.values() if isinstance(t, torch.Tensor)]
    stored = sum(t.numel() for t in tensors)
    if hasattr(config, "n_layers"):
        blocks, out_vocab = config.n_layers, config.vocab_size
    else:  # an EncoderDecoderConfig
        blocks, out_vocab = config.n_encoder_layers + config.n_decoder_layers, config.tgt_vocab_size
    claimed = parameter_count(config) + (out_vocab * config.d_model if config.tie_weights else 0)
    if claimed != stored or len(tensors) < 4 * blocks:
        raise ValueError(f"{path} is inconsistent: the stored weights do not match the stored model configuration "
                         f"(it describes {claimed:,} numbers in {blocks:,} blocks, at least {4 * blocks:,} tensors; "
                         f"the file holds {stored:,} numbers in {len(tensors):,} tensors); nothing was built")


def load_checkpoint(path, model: nn.Module | None = None, *, optimizer=None, scheduler=None,
                    device=None) -> tuple[nn.Module, dict]:
    """Read a checkpoint written by :func:`save_checkpoint`; return ``(model, checkpoint)``.

    Without ``model``, the model is built from the configuration stored in the file. The file is untrusted
    input: it is read with ``weights_only=True`` (tensors and plain containers only; nothing in it runs), and
    every part is checked, with a ``ValueError`` naming what is wrong. ``optimizer`` and ``scheduler``, when
    given, get their stored states.

    An adapters-only checkpoint (a model with LoRA adapters, see :func:`save_checkpoint`) needs ``model``: the
    base model with its pretrained weights already loaded, with or without the adapters attached (without them
    they are attached, as :func:`~groundup.lora.load_lora` does; to resume training, attach them before building
    the optimizer). A base whose fingerprint differs from the one the adapters were trained on is refused.
    """
    path = checkpoint_path(path)
    ckpt = read_checkpoint(path)
    cls, config_cls = MODEL_CLASSES[ckpt["model_class"]]
    adapters_only = ckpt.get("adapters_only", False)
    if adapters_only and model is None:
        raise ValueError(f"{path} holds LoRA adapters only, not a whole model: load the base model they were "
                         "trained on (e.g. groundup.pretrained.load_smollm2()) and pass it as model")
    if not adapters_only and model is not None and lora_layers(model):
        raise ValueError(f"{path} holds a whole model (no adapters), but the model given carries LoRA adapters: "
                         "load it into a model without adapters")
    if model is None:
        try:
            config = config_cls(**ckpt["model_config"])
        except (TypeError, ValueError) as err:
            raise ValueError(f"{path} has an invalid model configuration: {err}") from None
        _check_stored_sizes(path, config, ckpt["model"])  # untrusted sizes: by arithmetic, before building anything
        check_fits(config_model_bytes(config), f"the model configuration in {path}",
                   advice="the file describes a model too large for this machine; nothing was built")
        check_state_dict(meta_model(cls, config), ckpt["model"], path)  # names and shapes, still no storage
        model = cls(config)
    elif dataclasses.asdict(model.config) != ckpt["model_config"]:
        raise ValueError(f"{path} was saved from a model with a different configuration: "
                         f"{ckpt['model_config']} (given: {dataclasses.asdict(model.config)})")
    if adapters_only:
        _load_adapters(path, model, ckpt, optimizer)
    else:
        try:
            model.load_state_dict(ckpt["model"])
        except RuntimeError as err:
            raise ValueError(f"{path}: the stored weights do not fit the model: {err}") from None
    if device is not None:
        model.to(device)
    for name, obj in (("optimizer", optimizer), ("scheduler", scheduler)):
        if obj is not None:
            if not isinstance(ckpt.get(name), dict):
                raise ValueError(f"{path} holds no {name} state to resume from")
            try:
                obj.load_state_dict(ckpt[name])
            except (KeyError, ValueError, RuntimeError, TypeError) as err:
                raise ValueError(f"{path}: the stored {name} state does not fit: {err}") from None
    return model, ckpt


def train(model: nn.Module, train_data, val_data, config: TrainConfig, *, extra: dict | None = None,
          callback=None, batches=None, accumulate: int = 1, distributed: bool = False) -> History:
    """Train ``model`` on ``train_data`` (1-D token ids), evaluating on ``val_data``; return the :class:`History`.

    One step: draw ``batch_size`` random windows, compute the mean next-token loss, backpropagate, clip the
    global gradient norm, update with AdamW at the scheduled learning rate. A tqdm progress bar shows the loss,
    the validation loss and the throughput in tokens per second. With ``out_dir``, a checkpoint and the
    history (JSON) are written there at every evaluation and at the end; with ``resume=True`` training
    continues from that checkpoint and ends exactly as an uninterrupted run would. Ctrl-C stops at the end of
    the current step, writes a checkpoint (when there is an ``out_dir``) and raises ``KeyboardInterrupt``.
    ``extra`` (plain data, e.g. where the training text came from) is stored in every checkpoint.
    A model with LoRA adapters (:func:`groundup.lora.attach_lora`: only the adapters learn) is checkpointed
    adapters-only, a few MB instead of the frozen base (see :func:`save_checkpoint`); to resume, give the same
    base model with the same adapters attached, and a checkpoint of adapters for another base is refused.
    ``callback(step, model)``, if given, is called after every evaluation (e.g. to sample text); it must leave
    the global random state alone (use a ``torch.Generator`` of its own) for runs to stay reproducible.

    ``batches`` replaces next-token windows for models trained on another objective (chapters 9 and 10):
    ``batches(data, batch_size, context_length, generator) -> (inputs, targets)`` draws one batch using only
    ``generator`` for its randomness (so runs stay resumable), and each step minimises the loss of
    ``model(*inputs, targets)``. ``train_data`` and ``val_data`` are then whatever that function reads, and the
    evaluations average ``config.eval_batches`` fixed held-out batches (see :func:`evaluate`).

    ``accumulate`` and ``distributed`` split each step's batch of ``config.batch_size`` rows without changing
    what is computed (chapter 11). Every process draws the same whole batch from the same generator; with
    ``distributed=True`` (a ``torch.distributed`` process group must be initialised, e.g. by ``torchrun``) process
    ``r`` of ``p`` keeps rows ``r B/p ... (r+1) B/p - 1``, runs the model wrapped in ``DistributedDataParallel``
    (which all-reduces the gradients during ``backward``), and only process 0 writes checkpoints, the history, the
    progress bar and calls ``callback``. ``accumulate=a`` cuts each process's rows into ``a`` micro-batches whose
    gradients are summed before one update: gradient accumulation, the single-process twin. Each micro-batch's
    loss is weighted by the number of targets it counts (:func:`counted_targets`), so both give the gradient of
    the mean loss over the whole batch's counted targets, padded batches included; the recorded loss is that mean.
    What "the same" means (chapter 11): ``p`` processes make bit for bit the updates of one process accumulating
    ``p`` micro-batches (same rows, same arithmetic; ``p`` a power of two, one thread per process); one process
    on the whole batch adds the same numbers in another order, so its parameters differ by float32 rounding (which
    AdamW enlarges to up to a learning rate per step in entries whose gradient is itself rounding noise, and
    Muon's bfloat16 orthogonalisation to about bfloat16's rounding, 2^-8, times the step size). The batch
    sampler's state does not depend on ``p`` or ``a``, so a run can resume with a different number of processes.
    All processes share one global random stream (dropout), and a time budget is refused (processes would
    disagree about when time is up).

    A loss or gradient norm that is not finite (a diverged run: too high a learning rate, no clipping) stops
    training with :class:`TrainingDiverged` before the update; the last checkpoint written stays the last good one.
    """
    n_c, train_data, val_data = _checked_inputs(model, train_data, val_data, config, batches)
    rank, world = _split_check(config, accumulate, distributed)
    device = torch.device(config.device) if config.device else default_device()
    model.to(device)
    optimizer = _make_optimizer(model, config, device)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_at(s, config) / config.learning_rate)
    generator = torch.Generator().manual_seed(config.seed)  # the batch sampler's own random stream
    saver = _Checkpoints(config, rank, model, optimizer, scheduler, generator, extra)
    history, start = saver.resume(device) if config.resume else (History(), 0)
    forward = model if not distributed else _wrap_ddp(model, device)  # DDP all-reduces gradients in backward
    whole_batch = world == 1 and accumulate == 1
    tokens_per_step = config.batch_size * n_c
    model.train()
    bar = _progress_bar(config if rank == 0 else dataclasses.replace(config, progress=False), start)
    with _StopRequest() as stop, bar:
        clock = _Clock(config, history, start, tokens_per_step)
        for step in range(start, config.max_steps):
            if clock.time_is_up(step, optimizer):  # a time budget; it also sets the rate by the time spent
                break
            inputs, targets = _next_batch(train_data, batches, config.batch_size, n_c, generator)
            if whole_batch:
                loss = _backward(model, inputs, targets, device, optimizer)
            else:  # several processes and/or micro-batches (chapter 11)
                loss = _split_step(forward, inputs, targets, device, optimizer, rank, world, accumulate, stop)
            loss, grad_norm = loss.item(), _clip_gradients(model, config.grad_clip)
            # a diverged run stops before the update, while the parameters are still those of the last step
            saver.stop_if_diverged(step + 1, "the training loss", loss)
            saver.stop_if_diverged(step + 1, "the gradient norm", grad_norm)
            lr = _update(optimizer, scheduler)
            history.add_step(step + 1, loss, lr, grad_norm)
            bar.update(1)
            done, out_of_time = step + 1, clock.out_of_time()
            if done % config.eval_interval == 0 or done == config.max_steps or out_of_time:
                tokens_per_second = clock.pause(done)
                val = _validation_loss(model, val_data, config, n_c, batches, saver, done)
                history.add_evaluation(done, val, done * tokens_per_step, clock.seconds)
                bar.set_postfix(loss=f"{loss:.3f}", val=f"{val:.3f}", tok_s=f"{tokens_per_second:,.0f}",
                                refresh=False)
                saver.save(done, history)
                if callback is not None and rank == 0:
                    callback(done, model)
                    model.train()
                clock.restart(done)
            elif done % 10 == 0:
                bar.set_postfix(loss=f"{loss:.3f}", refresh=False)
            if out_of_time:
                break
            # several processes stop at the step they agreed on (a Ctrl-C arriving after the all-reduce counts
            # at the next step: acted on at once, it would stop one process a step before the others)
            if stop.agreed if world > 1 else stop.requested:
                _interrupt(done, history, saver)
    if distributed:
        del forward
        _wait_for_process_zero()
    model.eval()
    return history


# ---- the steps of train, in the order it takes them ------------------------------------------------------------


def _check_model(model) -> None:
    """A ``TypeError`` unless ``model`` is one of the book's models (a module with a ``config``)."""
    if not isinstance(model, nn.Module) or not hasattr(model, "config"):
        raise TypeError(f"model must be one of the book's models (GPT, ...), got {type(model).__name__}")


def _context_length(model: nn.Module, config: TrainConfig) -> int:
    """The length of the training windows: ``config.context_length``, else the model's; no longer than the model's."""
    n_c = config.context_length or model.config.context_length
    if n_c > model.config.context_length:
        raise ValueError(f"context_length {n_c} exceeds the model's context_length {model.config.context_length}")
    return n_c


def _checked_inputs(model, train_data, val_data, config, batches) -> tuple[int, object, object]:
    """:func:`train`'s arguments checked, with a clear error: ``(context length, train_data, val_data)``, the data
    as 1-D tensors of token ids unless a ``batches`` function reads them."""
    _check_model(model)
    if not isinstance(config, TrainConfig):
        raise TypeError(f"config must be a TrainConfig, got {type(config).__name__}")
    n_c = _context_length(model, config)
    if batches is None:
        train_data = _check_data("train_data", train_data, n_c)
        val_data = _check_data("val_data", val_data, n_c)
    elif not callable(batches):
        raise TypeError(f"batches must be a function (data, batch_size, context_length, generator) -> (inputs, "
                        f"targets), got {type(batches).__name__}")
    elif not config.eval_batches:
        raise ValueError("a run with batches= evaluates on config.eval_batches fixed batches: give eval_batches "
                         "(a number, not None)")
    return n_c, train_data, val_data


class _Checkpoints:
    """Where a run keeps its checkpoint and history (``config.out_dir``; None: nowhere), and what it last saved.

    Made before training starts: it refuses to overwrite another run's checkpoint (without ``resume``) and to
    resume from a missing one, creates the folder and removes the temporary files a killed run left there.
    """

    def __init__(self, config: TrainConfig, rank: int, model, optimizer, scheduler, generator, extra):
        self.config, self.rank, self.extra = config, rank, extra
        self.model, self.optimizer, self.scheduler, self.generator = model, optimizer, scheduler, generator
        self.out = Path(config.out_dir) if config.out_dir else None
        self.path = self.out / CHECKPOINT_NAME if self.out else None
        self.saved = None  # the step of the last checkpoint on disk
        if self.out is None:
            return
        if self.path.exists() and not config.resume:
            raise FileExistsError(f"{self.path} exists: pass resume=True (--resume) to continue that run, or choose "
                                  "another out_dir")
        if config.resume and not self.path.exists():
            raise FileNotFoundError(f"resume=True, but {self.path} does not exist")
        self.out.mkdir(parents=True, exist_ok=True)
        if rank == 0:
            remove_stale_temporary_files(self.out)

    def resume(self, device) -> tuple[History, int]:
        """Load the checkpoint into the model, optimizer and schedule, restore both random states (PyTorch's
        global one, which dropout draws from, and the batch sampler's); ``(history, step)`` to continue from."""
        _, ckpt = load_checkpoint(self.path, self.model, optimizer=self.optimizer, scheduler=self.scheduler)
        self.model.to(device)
        start = ckpt["step"]
        history = History.from_dict(ckpt["history"])
        _check_resumed_step(self.path, start, self.config, history)
        check_random_states(ckpt, self.path)
        torch.set_rng_state(ckpt["torch_rng"])
        if ckpt["cuda_rng"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(ckpt["cuda_rng"])
        self.generator.set_state(ckpt["sampler_rng"])
        self.saved = start
        return history, start

    def stop_if_diverged(self, step: int, what: str, value: float) -> None:
        """Raise :class:`TrainingDiverged` if ``value`` (``what``, at ``step``) is not finite."""
        if not math.isfinite(value):
            raise TrainingDiverged(_diverged_message(step, what, value, self.config, self.out, self.saved))

    def save(self, step: int, history: History) -> None:
        """Write the checkpoint and the history (process 0 only), never over a good checkpoint with a diverged
        model (every process checks the same parameters, so all reach the same verdict)."""
        if self.out is None:
            return
        if not all(bool(torch.isfinite(p).all()) for p in self.model.parameters()):
            raise TrainingDiverged(_diverged_message(step, "a parameter", math.nan, self.config, self.out, self.saved))
        if self.rank != 0:
            return
        self.saved = step
        save_checkpoint(self.path, self.model, optimizer=self.optimizer, scheduler=self.scheduler, step=step,
                        train_config=self.config, history=history, generator=self.generator, extra=self.extra)
        atomic_write_bytes(self.out / HISTORY_NAME, json.dumps(history.as_dict()).encode())


def _progress_bar(config: TrainConfig, start: int):
    """A tqdm bar over the steps (over time: no total), starting at ``start``; silent when ``progress`` is off."""
    from tqdm import tqdm

    total = None if config.time_budget is not None else config.max_steps
    return tqdm(total=total, initial=start, disable=not config.progress, unit="step",
                mininterval=1.0, dynamic_ncols=True, leave=True)


class _StopRequest:
    """Turns Ctrl-C (SIGINT) into a request that the loop honours at the end of the current step."""

    def __init__(self):
        self.requested = False
        self.agreed = False  # several processes: whether any had asked at the last all-reduce (see _split_step)
        self._previous = None

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.requested:  # a second Ctrl-C: stop at once
            raise KeyboardInterrupt
        self.requested = True

    def __exit__(self, *exc):
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
        return False


class _Clock:
    """A run's training time (evaluations left out, resumed runs included) and, with ``config.time_budget``, the
    learning-rate schedule over that time."""

    def __init__(self, config: TrainConfig, history: History, start: int, tokens_per_step: int):
        self.config, self.tokens_per_step = config, tokens_per_step
        self.seconds = history.seconds[-1] if history.seconds else 0.0  # trained before the current stretch
        self.warm_seconds = None  # a time-budgeted run: when the warm-up ended
        self.tick, self.tick_step = time.perf_counter(), start  # when and at which step the stretch began

    def spent(self) -> float:
        """Seconds of training so far, the current stretch included."""
        return self.seconds + time.perf_counter() - self.tick

    def time_is_up(self, step: int, optimizer) -> bool:
        """Before step ``step`` of a time-budgeted run past its warm-up: whether the time is spent, and if not, set
        every group's learning rate to the cosine's value at the fraction of the post-warm-up time spent
        (:func:`lr_at` with ``progress``). A step-based run (or one still warming up) leaves the rate to the
        scheduler: False."""
        if self.config.time_budget is None:
            return False
        spent, warmup = self.spent(), self.config.warmup_steps
        if step == warmup or self.warm_seconds is None and step > warmup:
            self.warm_seconds = spent if step == warmup else 0.0
        if self.warm_seconds is None:
            return False
        if spent >= self.config.time_budget:
            return True
        progress = (spent - self.warm_seconds) / max(self.config.time_budget - self.warm_seconds, 1e-9)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, self.config, progress=progress)
        return False

    def out_of_time(self) -> bool:
        """Whether a time-budgeted run has spent its time (a step-based run: never)."""
        return self.config.time_budget is not None and self.spent() >= self.config.time_budget

    def pause(self, step: int) -> float:
        """End the stretch of training at ``step`` (an evaluation follows); its training tokens per second."""
        now = time.perf_counter()
        self.seconds += now - self.tick
        return (step - self.tick_step) * self.tokens_per_step / max(now - self.tick, 1e-9)

    def restart(self, step: int) -> None:
        """Start a new stretch of training after the evaluation at ``step``."""
        self.tick, self.tick_step = time.perf_counter(), step


def _next_batch(data, batches, batch_size: int, context_length: int, generator: torch.Generator):
    """The next training batch, ``(inputs, targets)`` with ``inputs`` a tuple of the model's arguments: random
    next-token windows of ``data`` (:func:`~groundup.data.get_batch`), or what ``batches`` draws; either way from
    ``generator`` alone, so the data order is reproducible and resumable."""
    if batches is None:
        x, y = get_batch(data, batch_size, context_length, generator=generator)
        return (x,), y
    return _draw(batches, data, batch_size, context_length, generator)


def _backward(model: nn.Module, inputs: tuple, targets: torch.Tensor, device, optimizer) -> torch.Tensor:
    """Forward and backward of one whole batch: the old gradients cleared, the gradient of the batch's mean loss
    left in the parameters; returns that loss."""
    _, loss = model(*(t.to(device) for t in inputs), targets.to(device))
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    return loss


def _clip_gradients(model: nn.Module, grad_clip: float | None) -> float:
    """Scale the gradients so that their global norm is at most ``grad_clip`` (None: leave them); the norm before."""
    clip = grad_clip if grad_clip is not None else math.inf
    return torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item()


def _update(optimizer, scheduler) -> float:
    """One update at the scheduled learning rate, then the schedule's next rate; returns the rate used."""
    lr = optimizer.param_groups[0]["lr"]
    optimizer.step()
    scheduler.step()
    return lr


def _validation_loss(model, val_data, config: TrainConfig, n_c: int, batches, saver: _Checkpoints,
                     step: int) -> float:
    """The validation loss after ``step`` (:func:`evaluate` on ``config.eval_batches`` batches); the model is back
    in training mode afterwards, and a loss that is not finite stops the run."""
    val = evaluate(model, val_data, batch_size=config.batch_size, context_length=n_c,
                   max_batches=config.eval_batches, batches=batches)
    model.train()
    saver.stop_if_diverged(step, "the validation loss", val)
    return val


def _interrupt(step: int, history: History, saver: _Checkpoints) -> None:
    """Ctrl-C: save a checkpoint at ``step`` (unless its evaluation just did) and raise ``KeyboardInterrupt``."""
    if history.eval_step[-1:] != [step]:
        saver.save(step, history)
    where = f"; checkpoint saved in {saver.out}" if saver.out else ""
    raise KeyboardInterrupt(f"training interrupted after step {step}{where}")


def _wait_for_process_zero() -> None:
    """Several processes: when train returns on any of them, process 0's last checkpoint is on disk."""
    import torch.distributed as dist

    dist.barrier()


class TrainingDiverged(ValueError):
    """Training stopped because a loss or gradient norm was not finite (nan or inf): the run diverged.

    Raised before the update that would have spread the nan into the parameters; the checkpoint in ``out_dir``
    (if any) is the last one written with finite values. A ``ValueError``, so the command line reports it as an
    error with the message, which says what to change.
    """


def _diverged_message(step: int, what: str, value: float, config: TrainConfig, out: Path | None,
                      saved: int | None) -> str:
    kept = (f"the last good checkpoint (step {saved}) in {out} is kept" if out and saved is not None
            else "no checkpoint was written" if out else "nothing was saved (no out_dir)")
    clip = ("clip the gradients (--grad-clip 1, TrainConfig.grad_clip=1.0; now off)" if config.grad_clip is None
            else f"clip the gradients harder (--grad-clip, now {config.grad_clip:g})")
    return (f"training diverged at step {step}: {what} is {value} (not finite); {kept}. Start a new run (another "
            f"--out / out_dir) with a lower learning rate (--lr, TrainConfig.learning_rate; now "
            f"{config.learning_rate:g}) or {clip}")


def check_random_states(ckpt: dict, path: Path) -> None:
    """Resuming restores the stored random states: refuse damaged ones (``path`` names the checkpoint) with a
    message instead of a traceback."""
    for key in ("torch_rng", "sampler_rng"):
        try:
            torch.Generator().set_state(ckpt.get(key))
        except (RuntimeError, TypeError, ValueError) as err:
            raise ValueError(f"{path} holds a damaged random state ({key}: {str(err).splitlines()[0]}): the run "
                             "cannot continue exactly") from None


def _check_resumed_step(path: Path, step: int, config: TrainConfig, history: History) -> None:
    """A clear error unless a checkpoint's step fits the run it resumes: 0 <= step <= max_steps, its history as long."""
    if not 0 <= step <= config.max_steps:
        raise ValueError(f"{path} says it was saved at step {step}, outside this run's 0 .. max_steps = "
                         f"{config.max_steps}: a damaged or edited checkpoint; start a new run")
    if len(history.step) != step or history.step[-1:] not in ([], [step]):
        raise ValueError(f"{path} says it was saved at step {step} but its history holds {len(history.step)} steps: "
                         "a damaged or edited checkpoint; start a new run")


STALE_TEMPORARY = re.compile(rf"^\.({re.escape(CHECKPOINT_NAME)}|{re.escape(HISTORY_NAME)})\.[A-Za-z0-9_]+\.tmp$")
"""The temporary files :func:`groundup.utils.atomic_write_bytes` writes before renaming a checkpoint or history
(``.checkpoint.pt.<random>.tmp``): left behind only when a process was killed (SIGKILL) in the middle of a write."""


def remove_stale_temporary_files(folder) -> list[Path]:
    """Delete the half-written checkpoint and history temporaries a killed run left in ``folder``; return them.

    Each can be as large as a checkpoint. :func:`train` calls this when it starts or resumes a run in its
    ``out_dir`` (only one run writes a folder at a time, so no write is in progress).
    """
    removed = []
    for path in Path(folder).iterdir():
        if STALE_TEMPORARY.match(path.name) and path.is_file() and not path.is_symlink():
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed


def _split_check(config: TrainConfig, accumulate: int, distributed: bool) -> tuple[int, int]:
    """(rank, world size) of this process, after checking that the batch splits evenly."""
    _check_int("accumulate", accumulate, minimum=1)
    if not isinstance(distributed, bool):
        raise TypeError(f"distributed must be True or False, got {distributed!r}")
    rank, world = 0, 1
    if distributed:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError("distributed=True needs an initialised torch.distributed process group: launch with "
                             "torchrun (python -m groundup.distributed, groundup train --nproc N)")
        rank, world = dist.get_rank(), dist.get_world_size()
        if config.time_budget is not None:
            raise ValueError("a time budget (--minutes) cannot be used with several processes: their clocks would "
                             "disagree about the schedule and the end; give a number of steps")
    if config.batch_size % (world * accumulate):
        raise ValueError(f"batch_size {config.batch_size} must be divisible by processes x accumulation steps = "
                         f"{world} x {accumulate}: every micro-batch holds the same number of rows")
    return rank, world


def _wrap_ddp(model: nn.Module, device: torch.device) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    ids = [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" \
        else None
    # the book's buffers (masks, rotary tables) are constants, the same on every process: no sync at every forward
    return DistributedDataParallel(model, device_ids=ids, forward_sync_buffers=False)


IGNORE_INDEX = -100
"""The target value every model of the book leaves out of its loss (PyTorch's ``cross_entropy`` default)."""


def counted_targets(model: nn.Module, targets: torch.Tensor) -> int:
    """How many of ``targets`` the model's loss averages over: all but the ignored ones.

    Every model of the book returns the *mean* cross-entropy over the targets that count: a GPT over those that
    are not -100 (all of them for next-token windows; the masked positions of a masked LM), an
    :class:`~groundup.models.EncoderDecoder` over those that are neither -100 nor its ``pad_id``. The mean times
    this count is the sum of the per-token losses, which is what adds up exactly across micro-batches.
    """
    ignored = targets == IGNORE_INDEX
    if isinstance(model, EncoderDecoder):
        ignored |= targets == model.config.pad_id
    return int(targets.numel() - ignored.sum())


def _split_step(forward: nn.Module, inputs: tuple, y: torch.Tensor, device, optimizer, rank: int, world: int,
                accumulate: int, stop) -> torch.Tensor:
    """Forward and backward of this process's rows of the whole batch, in ``accumulate`` micro-batches.

    Leaves the gradient of the whole batch's mean loss in every parameter and returns that mean, the same number
    on every process. The whole batch's mean is ``(sum over micro-batches m of n_m L_m) / N``, where ``L_m`` is
    micro-batch m's mean loss over its ``n_m`` counted targets (:func:`counted_targets`) and ``N`` the count of
    the whole batch; so each micro-batch backpropagates ``L_m n_m / N``, times the number of processes because
    DDP divides the summed gradients by it. Averaging the ``L_m`` instead would weigh a micro-batch of short,
    padded targets as much as one of long targets (equal only when every micro-batch counts as many targets, as
    next-token windows do). Every process holds the whole batch, so ``N`` needs no communication; the summed
    losses are all-reduced. A stop request (Ctrl-C) on any process is shared with the others, so all stop at the
    same step.
    """
    model = getattr(forward, "module", forward)  # DDP wraps the model
    rows = y.shape[0] // world
    micro = rows // accumulate
    whole = counted_targets(model, y)
    optimizer.zero_grad(set_to_none=True)
    total = torch.zeros((), dtype=torch.float64)
    for i in range(accumulate):
        lo = rank * rows + i * micro
        part = [t[lo:lo + micro].to(device) for t in (*inputs, y)]
        counted = counted_targets(model, y[lo:lo + micro])
        # only the last micro-batch's backward all-reduces: DDP's no_sync keeps the others local
        sync = world == 1 or i == accumulate - 1
        with contextlib.nullcontext() if sync else forward.no_sync():
            _, loss = forward(*part[:-1], part[-1])
            (loss * (counted * world / whole)).backward()
        total += loss.detach().double().cpu() * counted
    if world > 1:
        import torch.distributed as dist

        shared = torch.stack([total, torch.tensor(float(stop.requested), dtype=torch.float64)]).to(device)
        dist.all_reduce(shared)  # the summed losses of all processes, and how many were asked to stop (NCCL: on GPU)
        shared = shared.cpu()
        total = shared[0]
        stop.agreed = bool(shared[1] > 0)
        stop.requested = stop.requested or stop.agreed  # (a Ctrl-C since the all-reduce is not lost)
    return (total / whole).to(torch.float32)


# --------------------------------------------------------------------------------------------------------
# The chapter 7 model, which later chapters reuse
# --------------------------------------------------------------------------------------------------------

CHAPTER7_MODEL = dict(context_length=64, d_model=128, n_layers=4, n_heads=4, positional="rope")
"""The chapter 7 GPT's shape (with ``vocab_size`` from the corpus's characters)."""
CHAPTER7_TRAINING = dict(batch_size=12, max_steps=2000, learning_rate=3e-3, warmup_steps=100, eval_interval=250,
                         eval_batches=20, seed=0)
"""How chapter 7 trains it: 2000 steps, about 6.5 to 7 minutes of one core here (385 s under nbval, AMD EPYC)."""


ARITHMETIC_VARIABLES = ("MKL_CBWR", "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA",
                        "ONEDNN_DEFAULT_FPMATH_MODE", "GLIBC_TUNABLES", "NPY_DISABLE_CPU_FEATURES")
"""The environment variables that choose which code computes chapter 7's training on this CPU: MKL's code path and
instruction set, oneDNN's (PyTorch's GELU), glibc's libm variants and NumPy's. The book's checked notebook runs set
every one (``tools/nbval_lanes.py`` says why each); ``ATEN_CPU_CAPABILITY`` is read back from PyTorch instead."""


def _arithmetic() -> dict:
    """The settings in force that decide the last bits of chapter 7's training: PyTorch's CPU kernels
    (``ATEN_CPU_CAPABILITY`` can lower them) and every variable of :data:`ARITHMETIC_VARIABLES`."""
    return {"cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "environment": {k: os.environ.get(k) for k in ARITHMETIC_VARIABLES}}


def chapter7_path(cache_dir=None) -> Path:
    """Where :func:`chapter7_model` keeps the chapter 7 model trained under the arithmetic in force (the corpus
    cache folder, ``models/``; e.g. ``chapter07-compatible-default-1a2b3c4d.pt``: MKL's code path, PyTorch's kernels
    and a digest of the other :data:`ARITHMETIC_VARIABLES`).

    One file per arithmetic, so that the checked notebook runs and runs on the machine's fastest kernels do not
    overwrite each other's model and retrain it at every switch."""
    import hashlib

    from groundup.data import corpus_cache_dir

    settings = _arithmetic()
    digest = hashlib.sha256(json.dumps(settings["environment"], sort_keys=True).encode()).hexdigest()[:8]
    tag = f"{settings['environment']['MKL_CBWR'] or 'auto'}-{settings['cpu_capability']}-{digest}".lower()
    return corpus_cache_dir(cache_dir) / "models" / f"chapter07-{re.sub(r'[^a-z0-9_.-]+', '_', tag)}.pt"


CHAPTER7_SAMPLE = dict(prompt="\n", max_new_tokens=120, temperature=0.8, seed=0)
"""How chapter 7 samples its model before and during training (:func:`chapter7_sample`)."""


class Chapter7Run(NamedTuple):
    """Chapter 7's training run: the model (in eval mode), its tokenizer, its :class:`History` and the samples
    taken along the way, ``{step: text}`` for step 0 and every evaluation."""

    model: GPT
    tokenizer: object
    history: History
    samples: dict


def chapter7_sample(model: GPT, tokenizer) -> str:
    """120 characters sampled from ``model`` after a newline at temperature 0.8, from a generator seeded with 0.

    Chapter 7 calls it before training and after every evaluation (``train``'s callback), so that the same random
    numbers show what the model learned between the stages; :func:`train_chapter7_model` does the same, so a model
    trained by another chapter's :func:`chapter7_model` call stores the same samples (see :data:`CHAPTER7_SAMPLE`).
    """
    from groundup.generation import generate

    prompt = torch.tensor([tokenizer.encode(CHAPTER7_SAMPLE["prompt"])])
    out = generate(model, prompt, CHAPTER7_SAMPLE["max_new_tokens"], temperature=CHAPTER7_SAMPLE["temperature"],
                   generator=torch.Generator().manual_seed(CHAPTER7_SAMPLE["seed"]))
    return tokenizer.decode(out[0, prompt.shape[1]:].tolist())


def train_chapter7_model(*, progress: bool = False, cache_dir=None) -> Chapter7Run:
    """Train chapter 7's character-level GPT on the Shakespeare corpus and store it; return the :class:`Chapter7Run`.

    Exactly what chapter 7 runs: the corpus's characters as the vocabulary, the first 90 % for training,
    ``torch.manual_seed(0)`` before building ``GPT(GPTConfig(**CHAPTER7_MODEL))``, then :func:`train` with
    ``TrainConfig(**CHAPTER7_TRAINING)`` on one CPU thread, sampling with :func:`chapter7_sample` before training and
    after every evaluation. The result is saved for :func:`load_chapter7_run` and :func:`chapter7_model`. The
    weights are the same on every machine under the book's checked arithmetic (``tools/nbval_lanes.py``: MKL's
    reproducible code path, PyTorch's plain x86-64 kernels, oneDNN, glibc's libm and NumPy capped at levels every
    CPU the book runs on has); the kernels each picks for the CPU it finds differ between CPUs in the last bits.
    It is saved while the one thread is still in force, so :func:`chapter7_model` reuses it.
    """
    from groundup.char_data import char_corpus

    tokenizer, train_ids, val_ids = char_corpus("shakespeare")
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=tokenizer.vocab_size, **CHAPTER7_MODEL))
    with threads(1):
        samples = {0: chapter7_sample(model, tokenizer)}
        history = train(model, train_ids, val_ids, TrainConfig(**CHAPTER7_TRAINING, progress=progress),
                        callback=lambda step, m: samples.__setitem__(step, chapter7_sample(m, tokenizer)))
        save_chapter7_model(model, tokenizer, history, samples, cache_dir=cache_dir)  # records the one thread
    return Chapter7Run(model.eval(), tokenizer, history, samples)


def save_chapter7_model(model: GPT, tokenizer, history: History, samples: dict, *, cache_dir=None) -> Path:
    """Store the chapter 7 run -- the model, its tokenizer's characters, its history and the samples taken during
    training (``{step: text}``, step 0 and every evaluation) -- for :func:`load_chapter7_run`.

    Call it with one CPU thread in force (as chapter 7 trains): only such a model is reused, because only its
    weights are the same on every machine. PyTorch's CPU kernels in force (``torch.backends.cpu.get_cpu_capability()``,
    which ``ATEN_CPU_CAPABILITY`` can lower) and every variable of :data:`ARITHMETIC_VARIABLES` are recorded too: a
    model is reused only under the same arithmetic (see :func:`train_chapter7_model`).
    """
    expected = [0, *history.eval_step]
    if not isinstance(samples, dict) or sorted(samples) != expected or not all(
            isinstance(t, str) for t in samples.values()):
        raise ValueError(f"samples must map the steps {expected} (before training and at each evaluation) to the "
                         f"text sampled there, got {samples!r:.200}")
    path = chapter7_path(cache_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_checkpoint(path, model, history=history, train_config=TrainConfig(**CHAPTER7_TRAINING),
                    extra={"chars": list(tokenizer.chars), "threads": torch.get_num_threads(),
                           "samples": [[step, samples[step]] for step in expected], **_arithmetic()})
    return path


def load_chapter7_run(*, cache_dir=None) -> Chapter7Run | None:
    """The stored chapter 7 run (:class:`Chapter7Run`), or None if there is none that today's chapter 7 would make.

    None when no file is stored, when it was trained with another ``CHAPTER7_MODEL`` or ``CHAPTER7_TRAINING``, on
    more than one thread or under other arithmetic (PyTorch's CPU kernels or any of :data:`ARITHMETIC_VARIABLES`:
    its weights would differ in the last bits), when it holds no samples (files stored before they were kept) or
    when it is damaged or not a checkpoint (it is read with ``weights_only=True``, so nothing in it runs). The
    caller then trains afresh.
    """
    from groundup.tokenizers import CharTokenizer

    path = chapter7_path(cache_dir)
    if not path.is_file():
        return None
    try:
        model, ckpt = load_checkpoint(path)
        extra = ckpt["extra"]
        history = History.from_dict(ckpt["history"])
        samples = {int(step): text for step, text in extra["samples"]}
        current = (ckpt["model_class"] == "GPT" and ckpt["train_config"] == dataclasses.asdict(
            TrainConfig(**CHAPTER7_TRAINING)) and {k: ckpt["model_config"][k] for k in CHAPTER7_MODEL} == CHAPTER7_MODEL
            and extra.get("threads") == 1  # trained as chapter 7 trains it: the same weights anywhere
            and all(extra.get(k) == v for k, v in _arithmetic().items())  # kernels, MKL, oneDNN, libm, NumPy
            and sorted(samples) == [0, *history.eval_step] and all(isinstance(t, str) for t in samples.values()))
        tokenizer = CharTokenizer(extra["chars"])
    except (ValueError, KeyError, TypeError):
        return None  # a damaged file, or one without samples: train afresh
    return Chapter7Run(model.eval(), tokenizer, history, samples) if current else None


def chapter7_model(*, cache_dir=None, progress: bool = False):
    """The chapter 7 model and its tokenizer, ``(model, tokenizer)``, trained once and then loaded.

    If chapter 7 (or an earlier call) stored a run that today's chapter 7 would make (:func:`load_chapter7_run`), its
    model is loaded; otherwise the model is trained now (about seven minutes on one thread) and stored, samples
    included (:func:`train_chapter7_model`). The model is returned in eval mode.
    """
    run = load_chapter7_run(cache_dir=cache_dir) or train_chapter7_model(progress=progress, cache_dir=cache_dir)
    return run.model, run.tokenizer
