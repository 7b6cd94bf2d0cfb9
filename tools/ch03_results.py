"""The multi-seed runs behind chapter 3's experiments, stored in src/groundup/results/chapter03.json.

    OMP_NUM_THREADS=1 python tools/ch03_results.py                        # everything (about 20 minutes)
    OMP_NUM_THREADS=1 python tools/ch03_results.py --kind init --seed 1   # one kind, one seed

Two kinds of run, each on one CPU thread (so the numbers are the same on every run of this script):

- ``init``: does the scale of the token embedding matter once there is a real model on top? A small character-level
  GPT (``groundup.models.GPT``: 2 layers, d_model 64, 4 heads, context 64, untied, **sinusoidal** positions, which
  the original transformer adds to the token vectors and which have RMS exactly 1/sqrt(2) per position) is trained
  on Shakespeare's characters with AdamW (learning rate 1e-3, no weight decay, batch 32) for 600 steps, once with
  Post-LN blocks (the seeds' block equations) and once with Pre-LN blocks, from three starts of the token
  embedding W_E: ``rms`` (rows at RMS 1, chapter 3), ``linear`` (uniform in +-1/sqrt(n_V), the default of
  ``nn.Linear(n_V, d_M)`` applied to one-hot vectors: RMS 1/sqrt(3 n_V) = 0.063) and ``small`` (N(0, 0.02^2),
  GPT-2's). Everything else (blocks, unembedding, data order) is identical for a given seed. Recorded: the
  validation loss on 8 fixed batches every 25 steps up to 200 and every 100 after, and the mean RMS of W_E's rows.
- ``control``: the same Post-LN runs without any positional embedding (``positional="none"``; the causal mask
  alone tells a decoder something about order), to see whether the small starts still lag when nothing is added
  to the token vectors.
- ``words``: "similar words have similar embeddings". A word-level continuous-bag-of-words model: the average of the
  embeddings W_E of the two words on each side of a position goes through the unembedding U and softmax to predict
  the word at that position (a masked, missing-token model predicting the token at i, with no transformer in
  between), over the 3,000 most frequent lower-cased words of Shakespeare (all other words are one unknown token,
  never predicted), d_M = 64, Adam (learning rate 0.01, batch 512) for 2,000 steps (about one pass over the
  900,000 words). W_E starts ``small`` (N(0, 0.02^2)) or ``rms``. Recorded: the 5 nearest neighbours (cosine
  similarity of rows of W_E) of a list of query words, for each category of words the fraction of each member's
  5 nearest neighbours in the whole vocabulary that belong to the same category, and (seed 0) the 2-D principal
  component projection of the category words.

Each entry records the command that made it; running a command again replaces its entry.
"""

from __future__ import annotations

import argparse
import collections
import math
import re
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from results_file import add_entry

from groundup.char_data import char_corpus
from groundup.data import get_batch, load_corpus
from groundup.embeddings import TokenEmbedding, Unembedding, rms
from groundup.models import GPT, GPTConfig

OUT = Path(__file__).resolve().parents[1] / "src" / "groundup" / "results" / "chapter03.json"
SEEDS = (0, 1, 2)
INITS = ("rms", "linear", "small")
NORM_POSITIONS = ("post", "pre")
STEPS = 600
EVAL_STEPS = list(range(0, 201, 25)) + list(range(300, STEPS + 1, 100))
GPT_SHAPE = dict(context_length=64, d_model=64, n_layers=2, n_heads=4, positional="sinusoidal", tie_weights=False)

WORD_VOCAB, WORD_D, WORD_STEPS, WORD_LR, WORD_BATCH, WINDOW = 3000, 64, 2000, 1e-2, 512, 2
CATEGORIES = {
    "colours": ["white", "black", "red", "green", "blue", "yellow", "grey", "golden"],
    "numbers": ["two", "three", "four", "five", "six", "seven", "ten", "twenty", "hundred", "thousand"],
    "kinship": ["father", "mother", "brother", "sister", "son", "daughter", "uncle", "wife", "husband", "cousin"],
    "pronouns": ["he", "she", "they", "we", "thou", "you", "him", "her", "them", "us"],
}
QUERIES = ["white", "blue", "red", "black", "three", "ten", "father", "sister", "he", "thou", "king", "night"]


# ---- kind "init" ----------------------------------------------------------------------------------------------


def char_data():
    tokenizer, train_ids, val_ids = char_corpus("shakespeare")
    return tokenizer.vocab_size, train_ids, val_ids


def init_run(norm_position: str, init: str, seed: int, data, positional: str = "sinusoidal") -> dict:
    """Train the small GPT from one start of W_E; the validation loss and W_E's row RMS along the way."""
    n_v, train_ids, val_ids = data
    torch.manual_seed(seed)
    model = GPT(GPTConfig(vocab_size=n_v, norm_position=norm_position, **{**GPT_SHAPE, "positional": positional}))
    with torch.no_grad():  # the blocks and U are drawn first, identically for every init of the same seed
        w = model.token_embedding.weight
        if init == "rms":  # GPT starts W_E small; these are the RMS-1 rows it drew first when "rms" was its
            # untied default (the same numbers: the stored runs reproduce)
            z = torch.randn(n_v, w.shape[1], generator=torch.Generator().manual_seed(seed))
            w.copy_(z / rms(z, keepdim=True))
        elif init == "linear":
            bound = 1 / math.sqrt(n_v)
            w.uniform_(-bound, bound)
        elif init == "small":
            w.normal_(0.0, 0.02)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    g_train = torch.Generator().manual_seed(1000 + seed)
    g_val = torch.Generator().manual_seed(12345)
    val_batches = [get_batch(val_ids, 32, 64, generator=g_val) for _ in range(8)]
    val_loss, token_rms = [], []
    for step in range(STEPS + 1):
        if step in EVAL_STEPS:
            model.eval()
            with torch.no_grad():
                val_loss.append(round(sum(model(x, y)[1].item() for x, y in val_batches) / len(val_batches), 4))
                token_rms.append(round(rms(model.token_embedding.weight).mean().item(), 4))
            model.train()
        if step == STEPS:
            break
        x, y = get_batch(train_ids, 32, 64, generator=g_train)
        _, loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {"norm_position": norm_position, "positional": positional, "init": init, "seed": seed,
            "steps": EVAL_STEPS, "val_loss": val_loss, "token_rms": token_rms}


# ---- kind "words" ---------------------------------------------------------------------------------------------


def word_data():
    words = re.findall(r"[a-z]+(?:'[a-z]+)?", load_corpus("shakespeare").lower())
    counts = collections.Counter(words)
    vocab = ["<unk>"] + [w for w, _ in counts.most_common(WORD_VOCAB - 1)]
    index = {w: i for i, w in enumerate(vocab)}
    ids = torch.tensor([index.get(w, 0) for w in words])
    centres = torch.arange(WINDOW, len(ids) - WINDOW)
    centres = centres[ids[centres] != 0]  # the unknown word is never a target
    return vocab, index, ids, centres, {w: counts[w] for c in CATEGORIES.values() for w in c}


def word_run(init: str, seed: int, data) -> dict:
    vocab, index, ids, centres, counts = data
    torch.manual_seed(seed)
    embed, unembed = TokenEmbedding(WORD_VOCAB, WORD_D, init=init), Unembedding(WORD_D, WORD_VOCAB)
    opt = torch.optim.Adam([embed.weight, unembed.weight], lr=WORD_LR)
    g = torch.Generator().manual_seed(seed)
    offsets = torch.tensor([o for o in range(-WINDOW, WINDOW + 1) if o != 0])
    losses = []
    for step in range(WORD_STEPS):
        c = centres[torch.randint(len(centres), (WORD_BATCH,), generator=g)]
        h = embed(ids[c[:, None] + offsets]).mean(dim=1)  # the average of the context words' embeddings
        loss = F.cross_entropy(unembed(h), ids[c])
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 500 == 0 or step == WORD_STEPS - 1:
            losses.append([step, round(loss.item(), 3)])
    w = F.normalize(embed.weight.detach(), dim=1)
    sims = w @ w.T
    sims.fill_diagonal_(-2.0)  # a word is not its own neighbour
    sims[:, 0] = -2.0  # nor is the unknown word anyone's

    def neighbours(word, k=5):
        top = sims[index[word]].topk(k)
        return [[vocab[i], round(s, 3)] for i, s in zip(top.indices.tolist(), top.values.tolist())]

    precision = {}
    for name, members in CATEGORIES.items():
        hits = [sum(n in members for n, _ in neighbours(m)) / 5 for m in members]
        precision[name] = round(sum(hits) / len(hits), 4)
    out = {"init": init, "seed": seed, "loss": losses, "neighbours": {q: neighbours(q) for q in QUERIES},
           "precision_at_5": precision, "cos_white_blue": round(sims[index["white"], index["blue"]].item(), 3),
           "rank_of_blue_for_white": int((sims[index["white"]] > sims[index["white"], index["blue"]]).sum()) + 1,
           "counts": counts}
    if seed == 0:
        words = [m for members in CATEGORIES.values() for m in members]
        x = embed.weight.detach()[[index[m] for m in words]]
        x = x - x.mean(dim=0)
        _, _, v = torch.linalg.svd(x, full_matrices=False)
        xy = x @ v[:2].T
        xy = xy * torch.sign(xy[0])  # fix the arbitrary sign of each component: "white" lands at positive x, y
        out["pca"] = {m: [round(a, 4), round(b, 4)] for m, (a, b) in zip(words, xy.tolist())}
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kind", choices=("init", "control", "words", "all"), default="all")
    parser.add_argument("--seed", type=int, choices=SEEDS, default=None, help="one seed (default: all three)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    seeds = SEEDS if args.seed is None else (args.seed,)

    def save(key, entry, kind, seed):
        entry["command"] = f"OMP_NUM_THREADS=1 python tools/ch03_results.py --kind {kind} --seed {seed}"
        add_entry(OUT, key, entry, header={"about": (
            "Runs for chapter 3 (one CPU thread each, see tools/ch03_results.py); each entry says which command "
            "made it.")})
        print("stored", key, flush=True)

    if args.kind in ("init", "all"):
        data = char_data()
        for seed in seeds:
            for norm_position in NORM_POSITIONS:
                for init in INITS:
                    save(f"init/{norm_position}/{init}/seed{seed}", init_run(norm_position, init, seed, data),
                         "init", seed)
    if args.kind in ("control", "all"):
        data = char_data()
        for seed in seeds:
            for init in INITS:
                save(f"control/post-no-positions/{init}/seed{seed}",
                     init_run("post", init, seed, data, positional="none"), "control", seed)
    if args.kind in ("words", "all"):
        data = word_data()
        for seed in seeds:
            for init in ("small", "rms"):
                save(f"words/{init}/seed{seed}", word_run(init, seed, data), "words", seed)


if __name__ == "__main__":
    sys.exit(main())
