"""The multi-seed, multi-head runs behind chapter 4's length-generalisation experiment, stored in
src/groundup/results/chapter04.json.

    OMP_NUM_THREADS=1 python tools/ch04_results.py                        # everything (about 10 minutes)
    OMP_NUM_THREADS=1 python tools/ch04_results.py --heads 2 --seeds 0    # a subset

The task and the model are the notebook's ("Use it"): copy the token 3 places back, vocabulary 16, train on
sequences of 32 tokens for 300 AdamW steps (lr 3e-3, batch 64), a 2-layer pre-norm model with d_model 32, then
test on 64 sequences of each length 32, 64, 128, 256 (the same test batches for every run). A run is one
(encoding, number of heads, seed): the seed sets the initial weights (``torch.manual_seed(seed)``) and the training
batches (generator seed ``1 + 1000 * seed``); seed 0 with 2 heads is the notebook's run. Each run records its final
training loss, its accuracy at each test length and, at N = 256, its accuracy over the position ranges
t = 3..31, 32..63, 64..127, 128..255. Training uses one CPU thread, so a run gives the same numbers every time.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from results_file import add_entry
from torch import nn

from groundup.positional import (
    LearnedPositionalEmbedding,
    RelativePositionBias,
    RotaryEmbedding,
    alibi_bias,
    sinusoidal_encoding,
)

OUT = Path(__file__).resolve().parents[1] / "src" / "groundup" / "results" / "chapter04.json"
VOCAB, K_BACK, TRAIN_LEN, TEST_LENS = 16, 3, 32, [32, 64, 128, 256]
D_MODEL, N_LAYERS, STEPS, BATCH = 32, 2, 300, 64
ENCODINGS = ["none", "sinusoidal", "learned", "relative", "alibi", "rope"]
RANGES = [(3, 32), (32, 64), (64, 128), (128, 256)]


class Block(nn.Module):
    def __init__(self, n_heads):
        super().__init__()
        self.n_heads = n_heads
        self.norm1, self.norm2 = nn.LayerNorm(D_MODEL), nn.LayerNorm(D_MODEL)
        self.qkv, self.proj = nn.Linear(D_MODEL, 3 * D_MODEL), nn.Linear(D_MODEL, D_MODEL)
        self.mlp = nn.Sequential(nn.Linear(D_MODEL, 4 * D_MODEL), nn.GELU(), nn.Linear(4 * D_MODEL, D_MODEL))

    def forward(self, x, bias, rotary):
        batch, n, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(batch, n, 3, self.n_heads, D_MODEL // self.n_heads).permute(
            2, 0, 3, 1, 4)
        if rotary is not None:
            q, k = rotary.apply_rotary(q, torch.arange(n)), rotary.apply_rotary(k, torch.arange(n))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        x = x + self.proj(out.transpose(1, 2).reshape(batch, n, D_MODEL))
        return x + self.mlp(self.norm2(x))


class TinyModel(nn.Module):
    """The notebook's TinyModel with the number of heads as an argument."""

    def __init__(self, positional, n_heads):
        super().__init__()
        self.positional, self.n_heads = positional, n_heads
        self.embed = nn.Embedding(VOCAB, D_MODEL)
        self.blocks = nn.ModuleList(Block(n_heads) for _ in range(N_LAYERS))
        self.norm, self.head = nn.LayerNorm(D_MODEL), nn.Linear(D_MODEL, VOCAB)
        if positional == "learned":
            self.pos = LearnedPositionalEmbedding(TRAIN_LEN, D_MODEL)
        if positional == "relative":
            self.rel = RelativePositionBias(n_heads, max_distance=8, bidirectional=False)
        self.rotary = RotaryEmbedding(D_MODEL // n_heads) if positional == "rope" else None

    def forward(self, idx):
        n = idx.shape[1]
        x = self.embed(idx)
        if self.positional == "sinusoidal":
            x = x + sinusoidal_encoding(n, D_MODEL)
        if self.positional == "learned":
            x = x + self.pos(torch.arange(n))
        bias = torch.zeros(self.n_heads, n, n).masked_fill(torch.ones(n, n).triu(1).bool(), float("-inf"))
        if self.positional == "relative":
            bias = bias + self.rel(n)
        if self.positional == "alibi":
            bias = bias + alibi_bias(self.n_heads, n)
        for block in self.blocks:
            x = block(x, bias, self.rotary)
        return self.head(self.norm(x))


def copy_task(n, batch, generator):
    x = torch.randint(VOCAB, (batch, n), generator=generator)
    return x, x.roll(K_BACK, dims=1)


def run(positional: str, n_heads: int, seed: int) -> dict:
    torch.manual_seed(seed)
    model = TinyModel(positional, n_heads)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    data = torch.Generator().manual_seed(1 + 1000 * seed)
    for _ in range(STEPS):
        x, y = copy_task(TRAIN_LEN, BATCH, data)
        loss = F.cross_entropy(model(x)[:, K_BACK:].reshape(-1, VOCAB), y[:, K_BACK:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    entry = {"train_loss": round(loss.item(), 4), "accuracy": [], "accuracy_by_position_256": None}
    with torch.no_grad():
        for n in TEST_LENS:
            if positional == "learned" and n > TRAIN_LEN:
                entry["accuracy"].append(None)
                continue
            x, y = copy_task(n, 64, torch.Generator().manual_seed(2))
            correct = (model(x).argmax(-1) == y).float()
            entry["accuracy"].append(round(correct[:, K_BACK:].mean().item(), 4))
            if n == 256:
                per_t = correct.mean(0)
                entry["accuracy_by_position_256"] = [round(per_t[a:b].mean().item(), 4) for a, b in RANGES]
    return entry


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--heads", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--encodings", nargs="+", default=ENCODINGS, choices=ENCODINGS)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    add_entry(OUT, "_config", {
        "task": f"copy the token {K_BACK} back, vocabulary {VOCAB}, chance {1 / VOCAB:.4f}",
        "model": f"{N_LAYERS} pre-norm layers, d_model {D_MODEL}, causal attention, MLP 4x",
        "training": f"{STEPS} AdamW steps, lr 3e-3, batch {BATCH}, sequences of {TRAIN_LEN}",
        "test_lengths": TEST_LENS, "position_ranges_256": RANGES,
        "seed": "torch.manual_seed(seed) for the weights, generator 1 + 1000 * seed for the batches",
        "command": "OMP_NUM_THREADS=1 python tools/ch04_results.py",
    }, section=None)
    for n_heads in args.heads:
        for seed in args.seeds:
            for enc in args.encodings:
                entry = run(enc, n_heads, seed)
                add_entry(OUT, f"{enc}/heads{n_heads}/seed{seed}", entry, section=None)
                print(enc, n_heads, seed, entry, file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
