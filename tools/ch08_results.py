"""Chapter 8's stored results, in src/groundup/results/chapter08.json.

    python tools/ch08_results.py                                # the decoding sweep (about 80 s, one thread)
    python tools/ch08_results.py --entry smollm2-repeats        # SmolLM2 repeating phrases (about 30 min)
    python tools/ch08_results.py --entry kv-timing              # the KV cache timed on the fast kernels

**decoding-sweep.** For every decoding setting of ``SETTINGS`` and every seed of ``SEEDS``, chapter 7's model
(:func:`groundup.training.chapter7_model`, in eval mode) writes ``N_SAMPLES`` samples of ``N_NEW`` characters after
``PROMPT`` with :func:`groundup.generation.generate` (``generator=torch.Generator().manual_seed(seed)``), and the
samples are measured as the notebook's "Use it" section explains:

- ``distinct_words``: the mean over the samples of :func:`distinct_words` (distinct words over words, within one
  sample);
- ``shared_4grams``: :func:`shared_4grams` of the samples (how much of one sample's character 4-grams occur in
  another sample of the same setting, over all ordered pairs);
- ``repetition``: the mean over the samples of :func:`repetition` (the fraction of 10-character strings that
  already occurred earlier in the same sample);
- ``own_loss``: the mean over the samples of the model's own mean loss on the generated characters
  (:func:`mean_loss`, chapter 8's definition: consecutive windows of the model's context, each starting afresh);
- ``repeating``: how many samples have a repetition above 0.

The entry keeps, per setting, one row in the order of ``COLUMNS`` per seed (the floats exactly as computed: JSON
writes a float so that it reads back the same), and seed 0's token ids (prompt included, ``N_SAMPLES`` rows),
which the chapter decodes and judges. It is exactly what the notebook's cell computed before it loaded this file:
the same calls, on the same arithmetic the notebooks run on (``nbval_lanes.ARITHMETIC``: every library that picks
code for the CPU capped; set here if the shell did not) and on one thread, as the notebook sets.

**smollm2-repeats.** Xu et al. (2022)'s measurement of self-reinforcement on SmolLM2-135M-Instruct
(:func:`groundup.pretrained.load_smollm2`): ``N_PHRASES`` phrases of ``PHRASE_TOKENS`` tokens, each repeated
``SMOL_COPIES`` times in one sequence, and :func:`copy_probabilities` (the notebook's function: the mean probability
of each copy's tokens given everything before them). Two kinds of phrase: ``real``, :func:`smollm2_phrases` (the
first ``PHRASE_TOKENS`` tokens of the held-out Shakespeare text after a space, with a space in front, no line
break), and ``random``, token ids drawn uniformly from the vocabulary. Per kind it stores each phrase's tokens and
its row of copy probabilities (rounded to 6 digits), so that the notebook can compute intervals and re-check a
slice live.

**kv-timing.** The timing of the notebook's Figure 8.4, on the *fast* kernels (this command does not cap the
arithmetic, and uses every core: the setting of ``make bench``): the benchmark model of
:mod:`groundup.bench.generation` generates ``KV_LENGTHS`` new tokens greedily from a one-token prompt, with and
without the cache, timed alternately after a warm-up, ``KV_REPEATS`` rounds; every round's seconds are stored, so
the notebook draws medians and quartiles. Then the overhead hypothesis: :func:`profile_cached_step` runs the cached
generation of the longest length under ``torch.profiler`` and splits its time per generated token into the
operators' own time by kind (matrix products, attention, copies into the cache, norms and the rest) and the time no
operator accounts for (Python and PyTorch's dispatch), with the number of operator calls per token, and
:func:`copy_bandwidth`, the speed of a plain 256 MiB copy on the same machine (for the memory-bound hypothesis).

Every entry records the command, the machine and its wall time (the one number that is not reproducible). Running
a command again replaces its entry.
"""

from __future__ import annotations

import argparse
import itertools
import math
import statistics
import sys
import time
from pathlib import Path

from results_file import add_entry, machine, on_notebook_arithmetic

ENTRIES = ("decoding-sweep", "smollm2-repeats", "kv-timing")


def _entry_from_argv(argv) -> str:
    parser = argparse.ArgumentParser(description="Chapter 8's stored results.")
    parser.add_argument("--entry", choices=ENTRIES, default="decoding-sweep",
                        help="which entry of chapter08.json to measure (default: decoding-sweep)")
    return parser.parse_args(argv).entry


if __name__ == "__main__" and _entry_from_argv(sys.argv[1:]) != "kv-timing":
    on_notebook_arithmetic()  # kv-timing measures the fast kernels: nothing capped

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import groundup  # noqa: E402
from groundup.generation import generate  # noqa: E402

OUT = Path(__file__).resolve().parents[1] / "src" / "groundup" / "results" / "chapter08.json"
KEY = "decoding-sweep"
COMMAND = "python tools/ch08_results.py"
PROMPT = "KING.\nMy lord, "
COLUMNS = ["distinct_words", "shared_4grams", "repetition", "own_loss", "repeating"]

# The notebook's definitions (tests/test_ch08_results.py checks that they compute the same).
SETTINGS = {
    "greedy": dict(greedy=True),
    "T = 0.5": dict(temperature=0.5),
    "T = 1.0": dict(temperature=1.0),
    "T = 1.5": dict(temperature=1.5),
    "top-k 5": dict(top_k=5),
    "top-p 0.9": dict(top_p=0.9),
    "T 0.8, top-p 0.9": dict(temperature=0.8, top_p=0.9),
}
N_SAMPLES, N_NEW, SEEDS = 8, 150, [0, 1, 2]


def distinct_words(t):
    words = t.split()
    return len(set(words)) / max(len(words), 1)


def shared_4grams(texts):
    grams = [{t[i:i + 4] for i in range(len(t) - 3)} for t in texts]
    return statistics.mean(len(a & b) / max(len(a), 1)
                           for a, b in itertools.permutations(grams, 2))


def repetition(t, n=10):
    grams = [t[i:i + n] for i in range(len(t) - n + 1)]
    seen, repeated = set(), 0
    for s in grams:
        repeated += s in seen
        seen.add(s)
    return repeated / len(grams)


def copy_probabilities(model, phrases, n_copies):
    """(N, n_copies): the mean probability the model gives each copy's tokens when
    the phrases (N, L) are repeated n_copies times (the first token is not scored)."""
    x = phrases.repeat(1, n_copies)
    with torch.no_grad():
        logits, _ = model(x)
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    p = logp.gather(-1, x[:, 1:, None])[..., 0].exp()
    p = torch.cat([torch.full_like(p[:, :1], float("nan")), p], dim=1)
    return p.reshape(len(x), n_copies, -1).nanmean(dim=-1)


def mean_loss(model, ids):
    """The model's mean next-token loss (nats per token) on each row of ids (batch, L),
    predicting tokens 2..L in consecutive windows of n_C (each window starts afresh, as
    when the validation loss is measured)."""
    n_C = model.config.context_length
    batch, L = ids.shape
    n_windows = math.ceil((L - 1) / n_C)
    padded = torch.full((batch, n_windows * n_C + 1), -100)
    padded[:, :L] = ids
    starts = torch.arange(n_windows) * n_C
    inputs = torch.stack([padded[:, s:s + n_C] for s in starts], dim=1).reshape(-1, n_C)
    targets = (torch.stack([padded[:, s + 1:s + n_C + 1] for s in starts], dim=1)
               .reshape(-1, n_C))
    with torch.no_grad():
        # padding (-100) only ever appears as an ignored target
        logits, _ = model(inputs.clamp(min=0))
    losses = (F.cross_entropy(logits.transpose(1, 2), targets, reduction="none")
              .reshape(batch, -1))
    counted = (targets != -100).reshape(batch, -1)
    return (losses.sum(-1) / counted.sum(-1)).tolist()


def sample(model, prompt, name, seed):
    """The notebook's ``sample``: N_SAMPLES samples of N_NEW characters with the setting ``name``, prompt
    included."""
    return generate(model, prompt.repeat(N_SAMPLES, 1), N_NEW,
                    generator=torch.Generator().manual_seed(seed), **SETTINGS[name])


def measure_row(model, tokenizer, prompt, ids):
    """The notebook's ``measure``: one seed's row of ``COLUMNS`` for its samples ``ids``."""
    texts = [tokenizer.decode(row[prompt.shape[1]:].tolist()) for row in ids]
    # the generated characters
    loss = statistics.mean(mean_loss(model, ids[:, prompt.shape[1] - 1:]))
    reps = [repetition(t) for t in texts]
    repeating = sum(rep > 0 for rep in reps)  # samples with at least one repeat
    return (statistics.mean(map(distinct_words, texts)), shared_4grams(texts),
            statistics.mean(reps), loss, repeating)


def sweep(model, tokenizer, prompt, names=tuple(SETTINGS), seeds=SEEDS):
    """``(results, sample_ids)``: ``results[name]``, one :func:`measure_row` per seed; ``sample_ids[name]``, the
    first seed's samples."""
    results, sample_ids = {}, {}
    for name in names:
        rows = []
        for seed in seeds:
            ids = sample(model, prompt, name, seed)
            rows.append(measure_row(model, tokenizer, prompt, ids))
            sample_ids.setdefault(name, ids)
        results[name] = rows
    return results, sample_ids


def measure_sweep() -> dict:
    """The decoding-sweep entry: chapter 7's model, one thread, the sweep."""
    from groundup.training import chapter7_model

    tick = time.perf_counter()
    groundup.set_seed(0)
    torch.set_num_threads(1)  # as the notebook
    model, tokenizer = chapter7_model()
    model.eval()
    prompt = torch.tensor([tokenizer.encode(PROMPT)])
    results, sample_ids = sweep(model, tokenizer, prompt)
    return {"command": COMMAND,
            "model": "chapter 7's GPT (groundup.training.chapter7_model), eval mode",
            "prompt": PROMPT, "settings": SETTINGS, "n_samples": N_SAMPLES, "n_new": N_NEW, "seeds": SEEDS,
            "columns": COLUMNS,
            "results": {name: [list(row) for row in rows] for name, rows in results.items()},
            "sample_ids": {name: ids.tolist() for name, ids in sample_ids.items()},
            "machine": machine(), "wall_seconds": round(time.perf_counter() - tick, 1)}


# ---- smollm2-repeats --------------------------------------------------------------------------------------

N_PHRASES, PHRASE_TOKENS, SMOL_COPIES, PHRASE_SEED, SMOL_BATCH = 200, 12, 8, 0, 25


def smollm2_phrases(tokenizer, text: str, n: int = N_PHRASES, length: int = PHRASE_TOKENS,
                    seed: int = PHRASE_SEED) -> torch.Tensor:
    """``(n, length)`` token ids: at random word starts of ``text`` (characters after a space), the first
    ``length`` tokens of a space and the next 200 characters, skipping those with a line break."""
    g = torch.Generator().manual_seed(seed)
    starts = [i + 1 for i, ch in enumerate(text[:-300]) if ch == " " and text[i + 1] not in " \n"]
    order = torch.randperm(len(starts), generator=g).tolist()
    rows = []
    for k in order:
        s = starts[k]
        ids = tokenizer.encode(" " + text[s:s + 200])[:length]
        if len(ids) == length and "\n" not in tokenizer.decode(ids):
            rows.append(ids)
            if len(rows) == n:
                break
    return torch.tensor(rows)


def random_phrases(vocab_size: int, n: int = N_PHRASES, length: int = PHRASE_TOKENS,
                   seed: int = PHRASE_SEED) -> torch.Tensor:
    """``(n, length)`` token ids drawn uniformly from the vocabulary."""
    return torch.randint(0, vocab_size, (n, length), generator=torch.Generator().manual_seed(seed + 1))


def copy_probabilities_batched(model, phrases: torch.Tensor, n_copies: int, batch: int = SMOL_BATCH,
                               log=None) -> torch.Tensor:
    """:func:`copy_probabilities` in batches of ``batch`` phrases (the same numbers, less memory)."""
    rows = []
    for start in range(0, len(phrases), batch):
        rows.append(copy_probabilities(model, phrases[start:start + batch], n_copies))
        if log:
            log(f"{start + len(rows[-1])}/{len(phrases)}")
    return torch.cat(rows)


def measure_smollm2_repeats(log=print) -> dict:
    from groundup.data import load_corpus, train_val_split
    from groundup.pretrained import load_smollm2

    tick = time.perf_counter()
    torch.set_num_threads(1)  # as the notebook's live slice
    model, tokenizer = load_smollm2()
    model.eval()
    _, val_text = train_val_split(load_corpus("shakespeare"), 0.1)
    entry = {"command": f"{COMMAND} --entry smollm2-repeats",
             "model": "SmolLM2-135M-Instruct (groundup.pretrained.load_smollm2), float32",
             "n_phrases": N_PHRASES, "phrase_tokens": PHRASE_TOKENS, "copies": SMOL_COPIES, "seed": PHRASE_SEED}
    for kind, phrases in [("real", smollm2_phrases(tokenizer, val_text)),
                          ("random", random_phrases(model.config.vocab_size))]:
        probs = copy_probabilities_batched(model, phrases, SMOL_COPIES, log=lambda m, k=kind: log(f"{k}: {m}"))
        entry[kind] = {"phrases": phrases.tolist(),
                       "probabilities": [[round(v, 6) for v in row] for row in probs.tolist()]}
    entry.update(machine=machine(), wall_seconds=round(time.perf_counter() - tick, 1))
    return entry


# ---- kv-timing --------------------------------------------------------------------------------------------

KV_LENGTHS, KV_REPEATS = [32, 64, 128, 255], 9

#: Operator kinds of :func:`profile_cached_step`: a kind takes the operators whose names contain one of its words.
OPERATOR_KINDS = {
    "matrix products": ("addmm", "aten::mm", "bmm", "matmul", "linear"),
    "attention": ("scaled_dot_product", "softmax", "baddbmm"),
    "copies (cache, cat)": ("cat", "copy_", "clone", "contiguous", "stack"),
    "norms": ("layer_norm", "rms_norm"),
}


def operator_kind(name: str) -> str:
    return next((kind for kind, words in OPERATOR_KINDS.items() if any(w in name for w in words)), "other operators")


def profile_cached_step(model, n_new: int) -> dict:
    """Seconds per generated token of cached greedy generation of ``n_new`` tokens from a one-token prompt, split
    into the operators' own CPU time by kind (top-level ATen operators' self time) and the rest (no operator:
    Python, dispatch); also the operator calls per token and the wall time of the same generation unprofiled."""
    from torch.profiler import ProfilerActivity, profile

    prompt = torch.zeros(1, 1, dtype=torch.long)
    generate(model, prompt, n_new, greedy=True)  # warm-up
    tick = time.perf_counter()
    generate(model, prompt, n_new, greedy=True)
    plain = time.perf_counter() - tick
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        tick = time.perf_counter()
        generate(model, prompt, n_new, greedy=True)
        wall = time.perf_counter() - tick
    by_kind, calls = {}, 0
    for event in prof.key_averages():
        if not event.key.startswith("aten::"):
            continue
        kind = operator_kind(event.key)
        by_kind[kind] = by_kind.get(kind, 0.0) + event.self_cpu_time_total / 1e6
        calls += event.count
    accounted = sum(by_kind.values())
    return {"n_new": n_new, "seconds_per_token_unprofiled": plain / n_new, "seconds_per_token_profiled": wall / n_new,
            "operator_seconds_per_token": {k: v / n_new for k, v in sorted(by_kind.items())},
            "unaccounted_seconds_per_token": (wall - accounted) / n_new, "operator_calls_per_token": calls / n_new}


def copy_bandwidth(megabytes: int = 256, repeat: int = 5) -> float:
    """Bytes a plain float32 copy of ``megabytes`` MiB moves per second (read plus written), the median of
    ``repeat`` copies after one warm-up: the memory speed a memory-bound operation can reach."""
    x = torch.ones(megabytes * 2**20 // 4)
    y = torch.empty_like(x)
    times = []
    for _ in range(repeat + 1):
        tick = time.perf_counter()
        y.copy_(x)
        times.append(time.perf_counter() - tick)
    return 2 * x.numel() * 4 / statistics.median(times[1:])


def measure_kv_timing(log=print) -> dict:
    from groundup.bench.generation import CONFIG, generation_times
    from groundup.models import GPT, GPTConfig

    tick = time.perf_counter()
    torch.manual_seed(0)
    model = GPT(GPTConfig(**CONFIG)).eval()
    times = {}
    for n in KV_LENGTHS:
        t = generation_times(model, n, repeat=KV_REPEATS, warmup=1)
        times[str(n)] = {"cached": t[True], "uncached": t[False]}
        log(f"{n}: cached {statistics.median(t[True]):.3f} s, uncached {statistics.median(t[False]):.3f} s")
    profile_row = profile_cached_step(model, KV_LENGTHS[-1])
    profile_row["copy_bytes_per_second"] = copy_bandwidth()
    return {"command": f"{COMMAND} --entry kv-timing", "model": {"config": CONFIG, "weights": "random, seed 0"},
            "lengths": KV_LENGTHS, "repeats": KV_REPEATS, "warmup": 1, "seconds": times, "profile": profile_row,
            "machine": machine(), "wall_seconds": round(time.perf_counter() - tick, 1)}


HEADER = {
    "about": ("Chapter 8's stored results: the decoding-settings sweep on chapter 7's model, SmolLM2 repeating "
              "phrases, the KV cache's timing; see tools/ch08_results.py's docstring for what is measured. Made by "
              "the command each entry names."),
    "arithmetic": ("tools/nbval_lanes.py's ARITHMETIC (ATen, MKL, oneDNN, glibc's libm and NumPy capped), one "
                   "thread, for decoding-sweep and smollm2-repeats: the arithmetic the notebooks run on, so every "
                   "x86-64 CPU computes these numbers alike; kv-timing runs on the fast kernels, every core")}


def main(argv=None) -> None:
    name = _entry_from_argv(sys.argv[1:] if argv is None else argv)
    entry = {"decoding-sweep": measure_sweep, "smollm2-repeats": measure_smollm2_repeats,
             "kv-timing": measure_kv_timing}[name]()
    add_entry(OUT, name, entry, header=HEADER)
    print(f"{name}: {entry['wall_seconds']} s, stored in {OUT}")
    if name == "decoding-sweep":
        for setting, rows in entry["results"].items():
            print(f"{setting:<18}", [[round(x, 4) for x in row] for row in rows])


if __name__ == "__main__":
    main()
