"""Training throughput (chapter 7): our GPT's training step against the same architecture from PyTorch's modules.

At nanoGPT's CPU shape (4 layers, 4 heads, d_model 128, context 64, batch 12, vocabulary 65, learned
positions, no dropout) and at the book's CPU recipe (4 layers, 6 heads, d_model 192, context 128, batch 8,
rotary positions), one training step is what :func:`groundup.training.train` does: forward, loss, backward,
gradient clipping, fused AdamW (at the recipe's shape also Muon + AdamW, the recipe's optimizer). The
reference at nanoGPT's shape is the same model built from
``nn.TransformerEncoderLayer(norm_first=True)`` with a causal mask, a final ``nn.LayerNorm`` and a tied
``nn.Linear`` head, trained the same way. The two are timed alternately, step by step; the figure is the median step and
the ratio the median of the per-round ratios, with its quartiles.

Throughput is given in tokens per second and as a fraction of the machine's float32 matmul peak (measured in
the same run), counting ``6 N`` FLOPs per token for the ``N`` parameters of the matrix products (the weights
touched once forward and twice backward) plus ``12 n_L n_C d_M`` for the attention scores and their use
(Kaplan et al. 2020; nanoGPT's ``estimate_mfu``): :func:`groundup.bench.throughput.flops_per_token`, derived and
checked against PyTorch's FLOP counter there.
"""

from __future__ import annotations

import statistics

import torch
from torch import nn

from groundup.bench import Row, alternate, ratio_row
from groundup.bench.matmul import matmul_peak_gflops
from groundup.bench.throughput import flops_per_token
from groundup.models import GPT, GPTConfig
from groundup.runs import RECIPE_MODEL, RECIPE_TRAINING
from groundup.training import MuonAdamW, param_groups

NANOGPT_CPU = dict(vocab_size=65, context_length=64, d_model=128, n_layers=4, n_heads=4, positional="learned")
NANOGPT_BATCH = 12
RECIPE = dict(vocab_size=65, **{k: v for k, v in RECIPE_MODEL.items() if k != "dropout"})
RECIPE_BATCH = RECIPE_TRAINING["batch_size"]


class TorchModulesGPT(nn.Module):
    """The same Pre-LN GPT from PyTorch's own modules: the reference our training step must keep up with."""

    def __init__(self, c: GPTConfig):
        super().__init__()
        self.token_embedding = nn.Embedding(c.vocab_size, c.d_model)
        self.position_embedding = nn.Embedding(c.context_length, c.d_model)
        layer = nn.TransformerEncoderLayer(c.d_model, c.n_heads, c.d_ff, dropout=0.0, activation="gelu",
                                           batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, c.n_layers, enable_nested_tensor=False)
        self.final_norm = nn.LayerNorm(c.d_model)
        self.head = nn.Linear(c.d_model, c.vocab_size, bias=False)
        self.head.weight = self.token_embedding.weight
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(c.context_length))

    def forward(self, idx, targets):
        n = idx.shape[1]
        x = self.token_embedding(idx) + self.position_embedding(torch.arange(n))
        x = self.blocks(x, mask=self.mask[:n, :n], is_causal=True)
        logits = self.head(self.final_norm(x))
        return logits, nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _step_fn(model: nn.Module, batch: int, n_c: int, vocab: int, optimizer: str = "adamw"):
    if optimizer == "muon":
        optimizer = MuonAdamW(model, lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1, fused=True)
    else:
        optimizer = torch.optim.AdamW(param_groups(model, 0.1), lr=1e-3, fused=True)
    return train_step_fn(model, optimizer, batch, n_c, vocab)


def train_step_fn(model: nn.Module, optimizer: torch.optim.Optimizer, batch: int, n_c: int, vocab: int):
    """One training step of ``model`` (``model(x, y) -> (logits, loss)``) on a fixed random batch, as a function."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randint(0, vocab, (batch, n_c), generator=g), torch.randint(0, vocab, (batch, n_c), generator=g)

    def step():
        _, loss = model(x, y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()

    return step


def run() -> list[Row]:
    peak = matmul_peak_gflops()
    rows = []
    torch.manual_seed(0)
    small = GPTConfig(**NANOGPT_CPU)
    ours, ref = GPT(small), TorchModulesGPT(small)
    times = alternate({"ours": _step_fn(ours, NANOGPT_BATCH, small.context_length, small.vocab_size),
                       "ref": _step_fn(ref, NANOGPT_BATCH, small.context_length, small.vocab_size)},
                      repeat=30, warmup=5)
    t = {name: statistics.median(v) for name, v in times.items()}
    tokens = NANOGPT_BATCH * small.context_length
    for name, label in (("ours", "GPT"), ("ref", "nn.TransformerEncoderLayer GPT")):
        rate = tokens / t[name]
        rows.append(Row(f"train step, {label}, nanoGPT CPU shape", t[name] * 1e3, "ms",
                        f"{rate:,.0f} tokens/s, {flops_per_token(small) * rate / 1e9 / peak:.0%} of the matmul peak"))
    rows.append(ratio_row("train step ratio", times["ours"], times["ref"], "nn.TransformerEncoderLayer GPT's time",
                          "target <= 1"))

    # The recipe's optimizer (Muon + AdamW) against AdamW alone, timed alternately: Newton-Schulz costs extra matrix
    # products per step that the model FLOPs (and so the fraction of peak) do not count.
    recipe = GPTConfig(**RECIPE)
    models = {name: GPT(recipe) for name in ("adamw", "muon")}
    times = alternate({name: _step_fn(m, RECIPE_BATCH, recipe.context_length, recipe.vocab_size, name)
                       for name, m in models.items()}, repeat=10, warmup=2)
    t = {name: statistics.median(v) for name, v in times.items()}
    n_params = sum(p.numel() for p in models["adamw"].parameters())
    chosen = RECIPE_TRAINING["optimizer"]
    for name, label in (("adamw", "AdamW"), ("muon", "Muon + AdamW")):
        rate = RECIPE_BATCH * recipe.context_length / t[name]
        mark = ", the recipe's" if name == chosen else ""
        rows.append(Row(f"train step, CPU recipe, {label}{mark} ({n_params / 1e6:.2f} M parameters)", t[name] * 1e3,
                        "ms", f"{rate:,.0f} tokens/s, {flops_per_token(recipe) * rate / 1e9 / peak:.0%} of the "
                        f"matmul peak ({peak:.0f} GFLOP/s, {torch.get_num_threads()} threads)"))
    rows.append(ratio_row("train step ratio, CPU recipe", times["muon"], times["adamw"], "AdamW's time (Muon + AdamW / "
                          "AdamW)"))
    return rows
