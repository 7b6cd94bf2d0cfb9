"""Throughput of a training step (chapter 7): tokens per second and model FLOPs utilisation (MFU), eager and compiled.

One training step is what :func:`groundup.training.train` does with a batch: forward and loss, ``zero_grad``,
backward, the loss read back (``loss.item()``), the global gradient norm clipped to 1 (and read back), one
optimizer step (AdamW, fused, as ``train`` makes it; the schedule's bookkeeping is left out). Its throughput is
``tokens per second = batch x context / seconds per step``.

**The FLOP count** (PaLM's MFU, Chowdhery et al. 2022, appendix B; Kaplan et al. 2020, section 2.1). Count the
floating-point operations of the matrix products only, a multiply and an add being two. A weight matrix of ``N_i``
entries multiplies each token's vector once going forward (``2 N_i`` FLOPs) and twice going backward (the gradient of
its input and the gradient of the weight, ``4 N_i``): ``6 N`` per token for the ``N`` weights of every matrix product
-- W_Q, W_K, W_V, W_O and the feed-forward matrices of each layer, and the unembedding (with tied weights the
embedding table counts once, as the unembedding: a lookup multiplies nothing). Attention adds two products per
layer that touch no weight: the scores ``Q K^T`` and their use ``A V``, each ``2 n_C d_attn`` FLOPs per query token
(``d_attn = n_H d_head``, which is d_model here) over the ``n_C`` keys of a window, ``4 n_C d_attn`` forward and
twice that backward::

    FLOPs per token = 6 N + 12 n_L n_C d_attn        (n_C: the training window, not the model's maximum)
    FLOPs per step  = (6 N + 12 n_L n_C d_attn) x batch x n_C

The attention term counts the whole ``n_C x n_C`` square, as PaLM does and as :class:`torch.utils.flop_counter.
FlopCounterMode` does for a fused attention kernel, although a causal kernel skips about half of it (the blocks
above the diagonal). The count leaves out everything that is not a matrix product: layer norms, softmax (inside
the fused kernel), GELU, rotary embedding, residual and bias additions, the cross-entropy, the embedding lookup and
its scatter-add backward, gradient clipping and AdamW. For chapter 7's GPT those are a few percent of the count
(about 8,000 FLOPs per token and layer forward against 1.3 million in its products; AdamW's ~15 per parameter per
step against ~5 million per token).

:func:`counted_flops` checks the formula: :class:`FlopCounterMode` on one step counts only matrix products too. It
counts what the kernels do, and a fused (flash) attention kernel's backward recomputes the scores ``Q K^T`` rather
than keep them from the forward pass: one more ``2 n_C d_attn`` per token and layer, :func:`recomputed_flops`
(PaLM leaves such recomputation out of MFU: it counts the model's FLOPs, not the hardware's). The two counts agree
exactly once that is taken off -- ``counted = formula + recomputed`` where the fused kernel runs (a causal mask and
no bias: chapter 7's GPT, where formula / counted = 0.9875), ``counted = formula`` where attention is computed with
explicit products (a relative or ALiBi bias); ``tests/test_bench_throughput.py`` checks both on small models.

**MFU** = achieved FLOP/s (the formula's FLOPs per step / the median seconds per step) / the machine's float32
matmul peak, measured in the same process and at the same thread count by :func:`groundup.bench.matmul.
matmul_peak_gflops` (a 1024 x 1024 product: the peak of the BLAS this step's products call, not the CPU's
datasheet figure, which also counts vector units the BLAS cannot keep busy).

**Eager against compiled.** :func:`measure_throughput` times the eager step and the same step with
``torch.compile(model)`` (forward and backward compiled, as nanoGPT does; the clipping and the fused AdamW stay
eager, the optimizer being a single fused kernel already), each on its own copy of the model and optimizer from the
same seed. The first compiled step (which compiles, in a fresh compiler cache so that it is the time a reader's
first run pays) is timed on its own; then both sides take ``warmup`` untimed steps and ``steps`` alternating timed
steps (:func:`groundup.bench.alternate`): a busy neighbour slows both sides of a round alike.

**Graph breaks** (:func:`graph_breaks`, ``torch._dynamo.explain``; :func:`model_graph_breaks`): the package's GPT
compiles into one graph with no break, its forward and loss, in all six positional families. It used to break 13
times (14 graphs) at chapter 7's shape: at ``positional.py``'s range check ``int(positions.min())``, at the rotary
factors' memo (its version-counter test) and at the models' check for a loss over no targets (``torch.isnan(loss)``
tested in Python). Those three now skip the value-reading test while ``torch.compile`` traces
(``torch.compiler.is_compiling()``), so eager calls compute and check exactly as before. A whole training step
(without reading the loss back) still breaks 3 times, all inside ``torch.optim``, on purpose: ``zero_grad`` is
marked not to be traced, ``Optimizer.step`` calls ``torch._dynamo.graph_break()`` around the update (so that the
update compiles as an in-place, no-grad graph; PyTorch issue 104053), and the fused AdamW kernel is excluded from
tracing. Compiling the model (what :func:`measure_throughput` does) leaves those parts eager anyway.
"""

from __future__ import annotations

import contextlib
import copy
import os
import statistics
import tempfile
import time
from collections.abc import Callable

import torch
from torch import nn

from groundup.bench import Row, alternate, ratio_quartiles
from groundup.bench.matmul import matmul_peak_gflops
from groundup.embeddings import Unembedding
from groundup.models import GPT, GPTConfig
from groundup.training import (
    CHAPTER7_MODEL,
    CHAPTER7_TRAINING,
    TrainConfig,
    _backward,
    _clip_gradients,
    _make_optimizer,
)
from groundup.utils import default_device, threads

CHAPTER7_VOCAB = 84
"""The characters of chapter 7's corpus (the Gutenberg Shakespeare): the vocabulary of its GPT."""
CHAPTER7_BATCH = CHAPTER7_TRAINING["batch_size"]


# ---- counting -----------------------------------------------------------------------------------------------------


def matmul_weights(model: nn.Module) -> int:
    """``N``: the entries of every weight matrix a matrix product multiplies by -- the linear layers' weights and the
    unembedding (a tied table once). Embedding tables that are only looked up, biases, norms' gains and position
    tables or biases are not counted."""
    seen, total = set(), 0
    for module in model.modules():
        if isinstance(module, (nn.Linear, Unembedding)) and id(module.weight) not in seen:
            seen.add(id(module.weight))
            total += module.weight.numel()
    return total


def flops_per_token(config: GPTConfig, n_c: int | None = None) -> int:
    """``6 N + 12 n_L n_C d_attn``: the forward-and-backward FLOPs of the matrix products per token of a window of
    ``n_c`` tokens (default: the model's ``context_length``); see the module's docstring."""
    n_c = config.context_length if n_c is None else n_c
    with torch.device("meta"):  # the shapes only: no memory, no initialisation
        n = matmul_weights(GPT(config))
    return 6 * n + 12 * config.n_layers * n_c * config.n_heads * config.d_head


def flops_per_step(config: GPTConfig, batch_size: int, n_c: int | None = None) -> int:
    """:func:`flops_per_token` times the ``batch_size x n_c`` tokens of one step."""
    n_c = config.context_length if n_c is None else n_c
    return flops_per_token(config, n_c) * batch_size * n_c


def recomputed_flops(config: GPTConfig, batch_size: int, n_c: int | None = None) -> int:
    """FLOPs a flash-attention backward spends recomputing the scores ``Q K^T``: ``2 n_C d_attn`` per token and
    layer, ``2 n_L batch n_C^2 d_attn`` a step. Hardware FLOPs, not model FLOPs: :func:`flops_per_token` leaves them
    out."""
    n_c = config.context_length if n_c is None else n_c
    return 2 * config.n_layers * batch_size * n_c * n_c * config.n_heads * config.d_head


def _cpu_attention_formulas() -> dict:
    """FlopCounterMode's attention formulas for PyTorch's CPU attention kernels, which it has no entry for (it knows
    the GPU's flash, memory-efficient and cuDNN kernels): without them it would count attention as zero on a CPU."""
    from torch.utils import flop_counter

    def forward(query, key, value, *args, out_shape=None, **kwargs) -> int:
        return flop_counter.sdpa_flop_count(query, key, value)

    def backward(grad_out, query, key, value, *args, out_shape=None, **kwargs) -> int:
        return flop_counter.sdpa_backward_flop_count(grad_out, query, key, value)

    aten = torch.ops.aten
    return {aten._scaled_dot_product_flash_attention_for_cpu: forward,
            aten._scaled_dot_product_flash_attention_for_cpu_backward: backward}


def counted_flops(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> int:
    """The FLOPs :class:`torch.utils.flop_counter.FlopCounterMode` counts in one forward, loss and backward of
    ``model(x, y)`` (the gradients are left in the model; the optimizer's update multiplies no matrices)."""
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False, custom_mapping=_cpu_attention_formulas())
    with counter:
        _, loss = model(x, y)
        loss.backward()
    model.zero_grad(set_to_none=True)
    return counter.get_total_flops()


# ---- the arithmetic of throughput ---------------------------------------------------------------------------------


def tokens_per_second(batch_size: int, n_c: int, seconds: float) -> float:
    """``batch_size x n_c`` tokens in ``seconds`` per step."""
    return batch_size * n_c / seconds


def achieved_gflops(flops: float, seconds: float) -> float:
    """``flops`` done in ``seconds``, in GFLOP/s."""
    return flops / seconds / 1e9


def mfu(flops: float, seconds: float, peak_gflops: float) -> float:
    """Model FLOPs utilisation: the achieved rate (``flops`` in ``seconds``) as a fraction of ``peak_gflops``."""
    return achieved_gflops(flops, seconds) / peak_gflops


def quartiles(values: list[float]) -> tuple[float, float, float]:
    """``(first quartile, median, third quartile)`` of ``values`` (inclusive method; one value: itself thrice)."""
    if len(values) == 1:
        return values[0], values[0], values[0]
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q2, q3


# ---- the step, timed ----------------------------------------------------------------------------------------------


def training_step(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor,
                  grad_clip: float | None = 1.0) -> Callable[[], float]:
    """One training step of ``train`` on the fixed batch ``(x, y)`` as a function returning the loss: forward and
    loss, backward, clipping, the update (on a GPU the two values read back make each call wait for the device)."""
    device = x.device

    def step() -> float:
        loss = _backward(model, (x,), y, device, optimizer).item()
        _clip_gradients(model, grad_clip)
        optimizer.step()
        return loss

    return step


@contextlib.contextmanager
def _fresh_compiler_cache():
    """Compile into an empty cache folder (and no in-memory caches), so a compile time is a first run's."""
    torch._dynamo.reset()
    with tempfile.TemporaryDirectory(prefix="groundup-inductor-") as folder:
        try:
            from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir
        except ImportError:  # another PyTorch: set the variable the compiler reads
            before = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = folder
            try:
                yield
            finally:
                if before is None:
                    del os.environ["TORCHINDUCTOR_CACHE_DIR"]
                else:
                    os.environ["TORCHINDUCTOR_CACHE_DIR"] = before
        else:
            with temporary_cache_dir(folder):
                yield
    torch._dynamo.reset()


def _timing_summary(seconds: list[float], flops: int, tokens: int, peak: float) -> dict:
    q1, median, q3 = quartiles(seconds)
    return {"seconds_per_step": {"median": median, "q1": q1, "q3": q3}, "per_step": list(seconds),
            "tokens_per_second": tokens / median, "achieved_gflops": achieved_gflops(flops, median),
            "mfu": mfu(flops, median, peak)}


def measure_throughput(config: GPTConfig, batch_size: int, *, n_c: int | None = None, steps: int = 20,
                       warmup: int = 3, compile: bool = True, n_threads: int | None = None,
                       device: str | torch.device | None = None, peak_gflops: float | None = None,
                       train_config: TrainConfig | None = None, seed: int = 0) -> dict:
    """Time the training step of ``GPT(config)`` on batches of ``batch_size x n_c`` tokens, eager and (with
    ``compile``) under ``torch.compile``, and put it against the FLOP count and the matmul peak.

    ``n_threads``: PyTorch's CPU threads for the whole measurement, the peak's included (None: as set).
    ``device``: None for :func:`groundup.utils.default_device`. ``peak_gflops``: None measures it with
    :func:`groundup.bench.matmul.matmul_peak_gflops` at the same thread count (and on the same device), before and
    after the steps, and takes the higher of the two.
    ``train_config``: the optimizer's settings (default: chapter 7's, ``CHAPTER7_TRAINING``).

    Returns a dict: the shape (``device``, ``threads``, ``batch_size``, ``context_length``, ``tokens_per_step``,
    ``parameters``, ``matmul_weights``), ``flops_per_step`` (``formula``, ``counted`` by FlopCounterMode, their
    ``ratio``, and :func:`recomputed_flops`), ``matmul_peak_gflops`` (both measurements in
    ``matmul_peak_gflops_before_after``), and per side (``eager``, ``compiled``) the median seconds per step with
    its quartiles, every timed step, tokens/s, achieved GFLOP/s and ``mfu``; with ``compile`` also
    ``compile_seconds`` (the first compiled step, compilation included) and ``eager_over_compiled`` (the median and
    quartiles of the per-round ratios eager / compiled: above 1, compiling is faster). Times are never checked.
    """
    n_c = config.context_length if n_c is None else n_c
    device = torch.device(device) if device is not None else default_device()
    train_config = train_config or TrainConfig(**CHAPTER7_TRAINING)
    with threads(n_threads) if n_threads is not None else contextlib.nullcontext():
        peaks = [peak_gflops] if peak_gflops is not None else [matmul_peak_gflops(device=device)]
        torch.manual_seed(seed)
        model = GPT(config).to(device)
        g = torch.Generator().manual_seed(seed)
        x = torch.randint(0, config.vocab_size, (batch_size, n_c), generator=g).to(device)
        y = torch.randint(0, config.vocab_size, (batch_size, n_c), generator=g).to(device)
        counted = counted_flops(model, x, y)
        formula = flops_per_step(config, batch_size, n_c)
        tokens = batch_size * n_c
        result = {"device": str(device), "threads": torch.get_num_threads(), "batch_size": batch_size,
                  "context_length": n_c, "tokens_per_step": tokens,
                  "parameters": sum(p.numel() for p in model.parameters()), "matmul_weights": matmul_weights(model),
                  "flops_per_step": {"formula": formula, "counted": counted, "ratio": formula / counted,
                                     "recomputed_by_flash_backward": recomputed_flops(config, batch_size, n_c)}}
        models = {"eager": model}
        if compile:
            models["compiled"] = copy.deepcopy(model)
        optimizers = {name: _make_optimizer(m, train_config, device) for name, m in models.items()}
        with _fresh_compiler_cache() if compile else contextlib.nullcontext():
            fns = {"eager": training_step(model, optimizers["eager"], x, y, train_config.grad_clip)}
            if compile:
                fns["compiled"] = training_step(torch.compile(models["compiled"]), optimizers["compiled"], x, y,
                                                train_config.grad_clip)
                start = time.perf_counter()
                fns["compiled"]()
                result["compile_seconds"] = time.perf_counter() - start
            times = alternate(fns, repeat=steps, warmup=warmup)
        if peak_gflops is None:  # again after the steps: a busy neighbour lowers a measurement, never raises it
            peaks.append(matmul_peak_gflops(device=device))
        peak = max(peaks)
        result["matmul_peak_gflops"] = peak
        result["matmul_peak_gflops_before_after"] = peaks
        for name, seconds in times.items():
            result[name] = _timing_summary(seconds, formula, tokens, peak)
        if compile:
            ratio, q1, q3 = ratio_quartiles(times["eager"], times["compiled"])
            result["eager_over_compiled"] = {"median": ratio, "q1": q1, "q3": q3}
    return result


# ---- graph breaks -------------------------------------------------------------------------------------------------


def graph_breaks(fn: Callable, *args) -> dict:
    """What ``torch._dynamo.explain(fn)(*args)`` finds: ``graphs``, ``breaks`` and each break's ``reasons`` (its first
    line and where in the code it happened). Runs ``fn`` once (a training step updates the model)."""
    torch._dynamo.reset()
    try:
        explained = torch._dynamo.explain(fn)(*args)
    finally:
        torch._dynamo.reset()
    reasons = []
    for b in explained.break_reasons:
        frame = b.user_stack[-1] if b.user_stack else None
        where = f"{os.path.basename(frame.filename)}:{frame.lineno} in {frame.name}" if frame else "?"
        reasons.append(f"{b.reason.strip().splitlines()[0]} ({where})")
    return {"graphs": explained.graph_count, "breaks": explained.graph_break_count, "reasons": reasons}


def model_graph_breaks(config: GPTConfig, batch_size: int, n_c: int | None = None, *, seed: int = 0) -> dict:
    """:func:`graph_breaks` of ``GPT(config)``'s forward and loss, and of a whole training step (chapter 7's AdamW,
    as :func:`training_step`), on the CPU: ``{"forward_and_loss": ..., "training_step": ...}``."""
    n_c = config.context_length if n_c is None else n_c
    torch.manual_seed(seed)
    model = GPT(config)
    g = torch.Generator().manual_seed(seed)
    x, y = (torch.randint(0, config.vocab_size, (batch_size, n_c), generator=g) for _ in range(2))
    optimizer = _make_optimizer(model, TrainConfig(**CHAPTER7_TRAINING), torch.device("cpu"))

    def forward_and_loss(x, y):
        return model(x, y)[1]

    def step(x, y):
        _, loss = model(x, y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        return loss

    return {"forward_and_loss": graph_breaks(forward_and_loss, x, y), "training_step": graph_breaks(step, x, y)}


# ---- make bench ---------------------------------------------------------------------------------------------------


def chapter7_config() -> GPTConfig:
    """Chapter 7's GPT: ``CHAPTER7_MODEL`` with the corpus's 84 characters."""
    return GPTConfig(vocab_size=CHAPTER7_VOCAB, **CHAPTER7_MODEL)


def run() -> list[Row]:
    """Chapter 7's training step, eager, at this process's thread count: its time, tokens/s and MFU, and the FLOP
    count by formula against FlopCounterMode's. (Compiling takes minutes: ``tools/ch07_throughput.py`` measures it.)"""
    config = chapter7_config()
    r = measure_throughput(config, CHAPTER7_BATCH, compile=False, steps=20, warmup=3)
    eager, flops = r["eager"], r["flops_per_step"]
    shape = (f"chapter 7's GPT ({r['parameters'] / 1e6:.2f} M parameters, batch {CHAPTER7_BATCH} x "
             f"{config.context_length})")
    return [
        Row(f"train step, {shape}", eager["seconds_per_step"]["median"] * 1e3, "ms",
            f"{eager['tokens_per_second']:,.0f} tokens/s, {eager['achieved_gflops']:.1f} GFLOP/s = {eager['mfu']:.0%} "
            f"of the matmul peak ({r['matmul_peak_gflops']:.0f} GFLOP/s, {r['threads']} threads, {r['device']})"),
        Row("FLOPs per step, 6N + 12 n_L n_C d_M", flops["formula"] / 1e9, "GFLOP",
            f"FlopCounterMode counts {flops['counted'] / 1e9:.4f} GFLOP (formula / counter = {flops['ratio']:.4f})"),
    ]
