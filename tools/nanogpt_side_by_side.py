"""Our training step against nanoGPT's own model, side by side in one process (chapter 7's speed criterion).

    python tools/nanogpt_side_by_side.py PATH/TO/nanoGPT/model.py [--rounds 300] [--threads 2]

nanoGPT is not a dependency of the book and nothing of it is copied: give the path of its ``model.py`` from a
checkout of Karpathy's repository, and this script imports it from there. Both models get nanoGPT's CPU shape
(4 layers, 4 heads, d_model 128, context 64, batch 12, vocabulary 65, no dropout) with the same architecture
(learned positions, Pre-LN, GELU, tied embeddings), once without biases (nanoGPT's ``train.py`` default, what its
CPU recipe runs) and once with them (``GPTConfig``'s default, and ``make bench``'s). One step is what each trains
with: forward, loss, backward, clipping at 1, then the optimizer each project configures (nanoGPT's
``configure_optimizers``, AdamW with the fused kernel only on CUDA; ours :func:`groundup.training.param_groups`
with fused AdamW, as :func:`groundup.training.train` does).

The two steps alternate one by one, the order swapped every round, so both see the same machine load. Printed:
each model's median step, the ratio of the medians, and the median and quartiles of the per-round ratios
(ours / nanoGPT; below 1 means ours is faster).
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time
from pathlib import Path

import torch

from groundup.bench.training import NANOGPT_BATCH, NANOGPT_CPU, _step_fn, train_step_fn
from groundup.models import GPT, GPTConfig


def load_nanogpt(path: Path):
    """nanoGPT's ``model`` module, imported from ``path`` (its ``GPT`` and ``GPTConfig``)."""
    if not path.is_file():
        raise SystemExit(f"{path} is not a file: give the path of model.py in a checkout of nanoGPT")
    spec = importlib.util.spec_from_file_location("nanogpt_model", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not hasattr(module, "GPT") or not hasattr(module, "GPTConfig"):
        raise SystemExit(f"{path} defines no GPT and GPTConfig: is it nanoGPT's model.py?")
    return module


def nanogpt_step(nano, bias: bool):
    c = NANOGPT_CPU
    model = nano.GPT(nano.GPTConfig(block_size=c["context_length"], vocab_size=c["vocab_size"], n_layer=c["n_layers"],
                                    n_head=c["n_heads"], n_embd=c["d_model"], dropout=0.0, bias=bias))
    optimizer = model.configure_optimizers(0.1, 1e-3, (0.9, 0.99), "cpu")
    return train_step_fn(model, optimizer, NANOGPT_BATCH, c["context_length"], c["vocab_size"])


def compare(nano, bias: bool, rounds: int) -> str:
    torch.manual_seed(0)
    config = GPTConfig(**NANOGPT_CPU, bias=bias)
    ours = _step_fn(GPT(config), NANOGPT_BATCH, config.context_length, config.vocab_size)
    theirs = nanogpt_step(nano, bias)
    for _ in range(10):
        ours(), theirs()
    t_ours, t_theirs, ratios = [], [], []
    for r in range(rounds):
        timed = [(ours, t_ours), (theirs, t_theirs)]
        for fn, times in timed if r % 2 else timed[::-1]:
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        ratios.append(t_ours[-1] / t_theirs[-1])
    q1, median, q3 = statistics.quantiles(ratios, n=4)
    m_ours, m_theirs = statistics.median(t_ours), statistics.median(t_theirs)
    return (f"{'with' if bias else 'without'} biases: nanoGPT {m_theirs * 1e3:.2f} ms, groundup {m_ours * 1e3:.2f} ms "
            f"per step; ratio of medians {m_ours / m_theirs:.3f}, per-round ratio median {median:.3f} "
            f"(quartiles {q1:.3f}-{q3:.3f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_py", type=Path, help="nanoGPT's model.py, from a checkout of its repository")
    parser.add_argument("--rounds", type=int, default=300, help="alternating steps per model and configuration")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default 2, the machine's cores)")
    args = parser.parse_args()
    if args.rounds < 4:
        parser.error("--rounds must be at least 4 (the quartiles need them)")
    torch.set_num_threads(args.threads)
    nano = load_nanogpt(args.model_py)
    print(f"nanoGPT's CPU shape, batch {NANOGPT_BATCH}, {args.threads} threads, {args.rounds} alternating rounds; "
          f"ratio = groundup / nanoGPT")
    for bias in (False, True):
        print(compare(nano, bias, args.rounds))


if __name__ == "__main__":
    main()
