"""Generation with and without the KV cache (chapter 8).

A GPT with context 256 (6 layers, d_model 384, 6 heads, vocabulary 65, learned positions: the shape of
nanoGPT's Shakespeare-char model) generates 255 tokens greedily after a 1-token prompt, so the sequence fills
the whole context. With the cache every step runs one new token through the model; without it every step
re-runs the whole sequence so far. Both are timed alternately (median of a few runs); the target is a speed-up
of at least 4x. The same comparison at 32, 64 and 128 new tokens shows how the gain grows with length.
"""

from __future__ import annotations

import statistics

import torch

from groundup.bench import Row, alternate, ratio_row
from groundup.generation import generate
from groundup.models import GPT, GPTConfig

CONFIG = dict(vocab_size=65, context_length=256, d_model=384, n_layers=6, n_heads=6, positional="learned")
NEW_TOKENS = 255  # after a 1-token prompt: the sequence ends exactly at the context length
LENGTHS = (32, 64, 128)


def kv_cache_bytes(config: GPTConfig, n_tokens: int, *, batch: int = 1, bytes_per_number: int = 4) -> int:
    """Memory of a full KV cache: ``2 (K and V) · n_layers · n_kv_heads · d_head · bytes_per_number`` per token.

    ``n_kv_heads`` is the number of key/value heads (grouped-query attention caches only those); ``n_heads`` where
    the configuration leaves it None (multi-head attention)."""
    n_kv_heads = config.n_heads if config.n_kv_heads is None else config.n_kv_heads
    return 2 * config.n_layers * n_kv_heads * config.d_head * bytes_per_number * n_tokens * batch


def generation_times(model: GPT, n_new: int, *, repeat: int = 3, warmup: int = 1) -> dict[bool, list[float]]:
    """Seconds per round to generate ``n_new`` tokens greedily from a 1-token prompt, with (True) and without
    (False) the cache, timed alternately round by round. Checks on the way that both produce the same tokens."""
    prompt = torch.zeros(1, 1, dtype=torch.long, device=next(model.parameters()).device)
    results = {}

    def run(use_cache):
        results[use_cache] = generate(model, prompt, n_new, greedy=True, use_cache=use_cache)
        if prompt.device.type == "cuda":
            torch.cuda.synchronize()

    times = alternate({True: lambda: run(True), False: lambda: run(False)}, repeat=max(repeat, 1), warmup=warmup)
    if not torch.equal(results[True], results[False]):
        raise AssertionError("cached and uncached greedy generation produced different tokens")
    return times


def time_generation(model: GPT, n_new: int, *, repeat: int = 3, warmup: int = 1) -> tuple[float, float]:
    """Median seconds to generate ``n_new`` tokens greedily from a 1-token prompt, with and without the cache.

    The two variants are timed alternately, so both see the same machine load. Checks on the way that both
    produce the same tokens.
    """
    times = generation_times(model, n_new, repeat=repeat, warmup=warmup)
    return statistics.median(times[True]), statistics.median(times[False])


def speedup_by_length(model: GPT, lengths, *, repeat: int = 3, warmup: int = 1) -> list[tuple[int, float, float]]:
    """``(n_new, seconds with the cache, seconds without)`` for each generated length in ``lengths``."""
    return [(n, *time_generation(model, n, repeat=repeat, warmup=warmup)) for n in lengths]


def run() -> list[Row]:
    torch.manual_seed(0)
    config = GPTConfig(**CONFIG)
    model = GPT(config).eval()
    shape = (f"{config.n_layers} layers, d_model {config.d_model}, {config.n_heads} heads, context "
             f"{config.context_length}")
    rows = []
    times = generation_times(model, NEW_TOKENS, repeat=3)
    t_cached, t_uncached = statistics.median(times[True]), statistics.median(times[False])
    rows.append(Row(f"generate {NEW_TOKENS} tokens, greedy, KV cache ({shape})", t_cached, "s",
                    f"{NEW_TOKENS / t_cached:.0f} tokens/s"))
    rows.append(Row("  same, without the cache", t_uncached, "s", f"{NEW_TOKENS / t_uncached:.0f} tokens/s"))
    rows.append(ratio_row("  speed-up of the KV cache", times[False], times[True], "the cached time", "target >= 4x"))
    memory = kv_cache_bytes(config, 1 + NEW_TOKENS)
    rows.append(Row(f"  KV cache memory, float32, {1 + NEW_TOKENS} tokens", memory / 2**20, "MiB",
                    f"2 n_L n_H d_head x 4 bytes = {kv_cache_bytes(config, 1) / 1024:.0f} KiB per token"))
    for n, t_c, t_u in speedup_by_length(model, LENGTHS):
        rows.append(Row(f"  speed-up at {n} new tokens", t_u / t_c, "x",
                        f"{t_c * 1e3:.0f} ms cached, {t_u * 1e3:.0f} ms uncached"))
    return rows
