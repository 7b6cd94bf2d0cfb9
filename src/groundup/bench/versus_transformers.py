"""Our generation against Hugging Face ``transformers``' on the same GPT-2-shaped model, same threads.

GPT-2 small's shape (12 layers, d_model 768, 12 heads, vocabulary 50,257, context 1024) with random weights:
``transformers.GPT2LMHeadModel`` is built from ``GPT2Config()``, and our :class:`~groundup.models.GPT` gets the very
same weights through :func:`groundup.pretrained.gpt2_state_dict` (the converter that loads GPT-2 checkpoints).
Both generate greedily, float32, with their KV caches, from the same 64-token prompt:

* prefill: the time to generate 1 token (the whole prompt through the model, then one token);
* decode: the time per further token, ``(time for N tokens - time for 1) / (N - 1)`` with N = 128.

Each round times the four runs (ours and theirs, 1 and N tokens) alternately; ratios are ours / theirs per
round, median and quartiles. Goal: our generation at most 0.75x transformers' time.

:func:`prefill_and_decode` is written for any pair of models; another section can reuse it.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch

from groundup.bench import Row, alternate, ratio_row

PROMPT_TOKENS, NEW_TOKENS, ROUNDS = 64, 128, 5


def gpt2_pair(seed: int = 0, **overrides):
    """``(ours, theirs)``: our GPT and transformers' GPT2LMHeadModel with identical random GPT-2-small weights.

    ``overrides`` are ``GPT2Config`` fields (e.g. ``n_layer=1`` for a small stand-in in tests).
    """
    from transformers import GPT2Config, GPT2LMHeadModel

    from groundup.models import GPT
    from groundup.pretrained import gpt2_config, gpt2_state_dict

    torch.manual_seed(seed)
    hf_config = GPT2Config(**overrides)
    theirs = GPT2LMHeadModel(hf_config).eval()
    config = gpt2_config(hf_config.to_dict())
    ours = GPT(config)
    missing, unexpected = ours.load_state_dict(gpt2_state_dict(dict(theirs.state_dict()), config)[0], strict=False)
    if unexpected or set(missing) - {"unembedding.weight"}:  # the unembedding is tied to the embedding
        raise AssertionError(f"GPT-2 weights did not fit our GPT: missing {missing}, unexpected {unexpected}")
    return ours.eval(), theirs


def hf_greedy(model) -> Callable[[torch.Tensor, int], torch.Tensor]:
    """``generate(prompt, n)`` for a transformers model: greedy, exactly ``n`` new tokens (no early stop)."""
    def generate(prompt: torch.Tensor, n: int) -> torch.Tensor:
        return model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n, min_new_tokens=n,
                              do_sample=False, pad_token_id=0)
    return generate


def our_greedy(model) -> Callable[[torch.Tensor, int], torch.Tensor]:
    """``generate(prompt, n)`` for one of our models: greedy, with the KV cache."""
    from groundup.generation import generate

    return lambda prompt, n: generate(model, prompt, n, greedy=True)


def prefill_and_decode(ours: Callable, theirs: Callable, prompt: torch.Tensor, n_new: int, *,
                       rounds: int = ROUNDS) -> tuple[dict[str, list[float]], dict[str, torch.Tensor]]:
    """Per-round seconds: ``prefill_*`` (1 new token) and ``decode_*`` (per token after the first), ours/theirs.

    Also returns the generated sequences, to compare.
    """
    outputs = {}

    def timed(name, fn, n):
        def call():
            outputs[name] = fn(prompt, n)
        return call

    with torch.no_grad():
        t = alternate({"one_ours": timed("one_ours", ours, 1), "one_theirs": timed("one_theirs", theirs, 1),
                       "all_ours": timed("ours", ours, n_new), "all_theirs": timed("theirs", theirs, n_new)},
                      repeat=rounds, warmup=1)
    times = {f"prefill_{side}": t[f"one_{side}"] for side in ("ours", "theirs")}
    for side in ("ours", "theirs"):
        times[f"decode_{side}"] = [(a - b) / (n_new - 1) for a, b in zip(t[f"all_{side}"], t[f"one_{side}"],
                                                                         strict=True)]
        times[f"all_{side}"] = t[f"all_{side}"]
    return times, outputs


def comparison_rows(label: str, times: dict[str, list[float]], n_prompt: int, n_new: int, target: str) -> list[Row]:
    """The rows of one ours-vs-theirs generation comparison."""
    med = {k: statistics.median(v) for k, v in times.items()}
    return [
        Row(f"{label}: generate {n_new} tokens after {n_prompt}, ours", med["all_ours"], "s",
            f"{n_new / med['all_ours']:.1f} tokens/s"),
        Row("  same, transformers", med["all_theirs"], "s", f"{n_new / med['all_theirs']:.1f} tokens/s"),
        ratio_row("  time ratio, whole generation", times["all_ours"], times["all_theirs"], "transformers' time",
                  target),
        Row(f"  prefill ({n_prompt} tokens + 1), ours", med["prefill_ours"] * 1e3, "ms",
            f"transformers {med['prefill_theirs'] * 1e3:.1f} ms"),
        ratio_row("  time ratio, prefill", times["prefill_ours"], times["prefill_theirs"], "transformers' time"),
        Row("  decode, per token, ours", med["decode_ours"] * 1e3, "ms",
            f"transformers {med['decode_theirs'] * 1e3:.1f} ms"),
        ratio_row("  time ratio, decode", times["decode_ours"], times["decode_theirs"], "transformers' time"),
    ]


def run() -> list[Row]:
    ours, theirs = gpt2_pair()
    prompt = torch.randint(0, ours.config.vocab_size, (1, PROMPT_TOKENS), generator=torch.Generator().manual_seed(0))
    times, outputs = prefill_and_decode(our_greedy(ours), hf_greedy(theirs), prompt, NEW_TOKENS)
    rows = comparison_rows(f"GPT-2 small shape, random weights, {torch.get_num_threads()} threads", times,
                           PROMPT_TOKENS, NEW_TOKENS, "target <= 0.75x")
    same = int((outputs["ours"] == outputs["theirs"]).all(dim=0).sum()) - PROMPT_TOKENS
    rows.append(Row("  same greedy tokens as transformers", same, f"of {NEW_TOKENS}", "float32 on both sides"))
    return rows
