"""GPT-2's tokenizer (:func:`groundup.tokenizers.load_gpt2_tokenizer`) against tiktoken built from the same ranks.

* The whole 5 MB Shakespeare corpus, with our chunk cache emptied before every run (cold, the case that counts:
  the first time a reader encodes a text), then warm; the ids must be identical to tiktoken's. Target: at least
  0.5x tiktoken's speed cold, that is at most 2x its time (in wall-clock seconds, and in CPU seconds, which a
  busy machine disturbs less). The regular-expression split alone is timed too: it
  is a floor that pure Python cannot go below (the ``regex`` package is C code, and tiktoken splits and merges in
  Rust in less time than ``regex`` takes to split).
* One random word of 2k to 32k lowercase letters (a single chunk, the worst case for BPE): the time for each
  length and the exponent k of a fitted ``time ~ n^k`` (target: about 1, linear). Both encoders run on one
  thread, so these are CPU seconds of this process (the fastest of 3 runs), which other processes on the machine
  inflate far less than wall-clock seconds.

tiktoken is a dev dependency; it is built offline from the verified ranks file (``tiktoken.get_encoding`` would
download it).
"""

from __future__ import annotations

import math
import random
import statistics
import string
import time

from groundup.bench import Row, alternate, ratio_row
from groundup.tokenizers import GPT2_SPLIT_PATTERN, load_gpt2_tokenizer, read_tiktoken_ranks

WORD_LENGTHS = (2_000, 4_000, 8_000, 16_000, 32_000)


def tiktoken_gpt2():
    """tiktoken's encoder for GPT-2's ranks (the same verified file as ours), without its special token."""
    import tiktoken

    from groundup.data import locate_asset

    ranks = read_tiktoken_ranks(locate_asset("gpt2.tiktoken")[0])
    return tiktoken.Encoding("gpt2-offline", pat_str=GPT2_SPLIT_PATTERN, mergeable_ranks=ranks, special_tokens={})


def fitted_exponent(lengths, seconds) -> float:
    """The slope of the least-squares line through ``(log n, log t)``: k in ``t ~ n^k``."""
    xs, ys = [math.log(n) for n in lengths], [math.log(t) for t in seconds]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)


def random_word(n: int, seed: int = 0) -> str:
    """``n`` random lowercase letters: one chunk for GPT-2's split pattern."""
    rng = random.Random(seed)
    return "".join(rng.choice(string.ascii_lowercase) for _ in range(n))


def cpu_seconds(fn, repeat: int = 3) -> float:
    """The fewest CPU seconds (this process, all threads) of ``repeat`` calls of ``fn``."""
    times = []
    for _ in range(repeat):
        start = time.process_time()
        fn()
        times.append(time.process_time() - start)
    return min(times)


def run() -> list[Row]:
    from groundup.data import load_corpus

    ours, ref = load_gpt2_tokenizer(), tiktoken_gpt2()
    corpus = load_corpus("shakespeare")
    mb = len(corpus.encode()) / 1e6
    ids = {}

    def ours_cold():
        ours._cache.clear()
        ids["ours"] = ours.encode_ordinary(corpus)

    def ours_warm():
        ids["warm"] = ours.encode_ordinary(corpus)

    def reference():
        ids["tiktoken"] = ref.encode_ordinary(corpus)

    def split_only():
        ours._split(corpus)

    t = alternate({"cold": ours_cold, "tiktoken": reference, "split": split_only}, repeat=5, warmup=1)
    cpu = alternate({"cold": ours_cold, "tiktoken": reference}, repeat=3, warmup=0, clock=time.process_time)
    if not ids["ours"] == ids["tiktoken"]:
        raise AssertionError("GPT-2's tokenizer and tiktoken gave different ids on the corpus")
    warm = alternate({"warm": ours_warm, "tiktoken": reference}, repeat=3, warmup=1)
    if not ids["warm"] == ids["tiktoken"]:
        raise AssertionError("GPT-2's tokenizer with a warm cache and tiktoken gave different ids on the corpus")
    cold_s, ref_s = statistics.median(t["cold"]), statistics.median(t["tiktoken"])
    note = f"{mb:.2f} MB corpus, {len(ids['ours']):,} ids, identical to tiktoken's"
    rows = [
        Row("GPT-2 tokenizer, cold cache", cold_s, "s", f"{note}, {mb / cold_s:.2f} MB/s"),
        Row("tiktoken (Rust), same ranks", ref_s, "s", f"{mb / ref_s:.2f} MB/s"),
        ratio_row("  speed vs tiktoken, cold", t["tiktoken"], t["cold"], "tiktoken's speed",
                  "target >= 0.5x"),
        ratio_row("  same, in CPU seconds", cpu["tiktoken"], cpu["cold"], "tiktoken's speed",
                  "both on one thread: the figure a busy machine disturbs least"),
        ratio_row("  speed vs tiktoken, warm cache", warm["tiktoken"], warm["warm"], "tiktoken's speed"),
        ratio_row("  regex split alone / tiktoken's whole encode", t["split"], t["tiktoken"], "tiktoken's time",
                  "the floor of a Python tokenizer that splits with the regex package"),
    ]
    seconds, ref_seconds = [], []
    for n in WORD_LENGTHS:
        word = random_word(n)
        if ours.encode_ordinary(word) != ref.encode_ordinary(word):
            raise AssertionError(f"GPT-2's tokenizer and tiktoken gave different ids on a {n}-letter word")
        seconds.append(cpu_seconds(lambda w=word: (ours._cache.clear(), ours.encode_ordinary(w))))
        ref_seconds.append(cpu_seconds(lambda w=word: ref.encode_ordinary(w)))
    for n, s, r in zip(WORD_LENGTHS, seconds, ref_seconds, strict=True):
        rows.append(Row(f"one random word of {n:,} letters", s * 1e3, "ms CPU", f"tiktoken {r * 1e3:.1f} ms"))
    rows.append(Row("  fitted exponent k, time ~ n^k", fitted_exponent(WORD_LENGTHS, seconds), "",
                    f"target about 1 (linear); tiktoken {fitted_exponent(WORD_LENGTHS, ref_seconds):.2f}"))
    return rows
