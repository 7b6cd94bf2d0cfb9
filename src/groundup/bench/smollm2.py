"""SmolLM2-135M-Instruct in the book's GPT versus ``transformers``' LlamaForCausalLM, on the same GGUF file.

Three models are loaded from the cached ``SmolLM2-135M-Instruct.Q4_1.gguf``: the book's GPT dequantized to float32,
the book's GPT with its matrices kept as blocks (``load_gguf(..., keep_quantized=True)``: ``QuantizedLinear``, one
byte a weight, computing in float32) and transformers' (dequantized to float32). They run with the same threads and
generate greedily: a 64-token prompt (the first 64 tokens of
the Shakespeare corpus), then 128 new tokens. Measured, alternating the models round by round:

* end to end: each library's own generation call (``groundup.generation.generate``, ``model.generate``);
* prefill: one forward pass over the 64-token prompt into an empty KV cache, unembedding the last position only
  (``last_only=True``; ``logits_to_keep=1`` for transformers, which its ``generate`` also asks for);
* decode: the 127 one-token forward passes after it (each with the KV cache), per token.

Peak memory is measured in two child processes, one per library, as the growth of the peak resident set size
(``VmHWM``, see :func:`_peak_rss_bytes`) from after the imports to after loading the model and generating: the
loaded weights, the dequantization's temporaries and the KV cache. The target: ours at least as fast as
transformers (ratio >= 1.0) with peak memory no higher; the kept-quantized model's loaded parameters and buffers at
most 0.4x the float32 model's, and its decode at least 0.5x as fast. Run with ``python -m groundup.bench smollm2``;
the main entry point of this module (``python -m groundup.bench.smollm2 --memory ours|quantized|transformers``) is
what the child processes run.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys

import torch

from groundup.bench import Row, alternate, ratio_row

PROMPT_TOKENS = 64
NEW_TOKENS = 128
ROUNDS = 3


def _prompt(tokenizer) -> torch.Tensor:
    from groundup.data import load_corpus

    ids = tokenizer.encode(load_corpus("shakespeare")[:2000])[:PROMPT_TOKENS]
    return torch.tensor([ids])


def load_ours():
    from groundup.pretrained import load_smollm2

    return load_smollm2()


def load_quantized():
    from groundup.pretrained import load_smollm2

    return load_smollm2(keep_quantized=True)


def loaded_bytes(model) -> int:
    """Bytes of a model's parameters and buffers, each storage counted once (a tied matrix is one)."""
    storages = {}
    for t in [*model.parameters(), *model.buffers()]:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values())


def load_transformers():
    """transformers' LlamaForCausalLM from the same cached file (float32)."""
    import transformers

    from groundup.data import locate_smollm2

    path = locate_smollm2()
    previous = os.environ.get("TQDM_DISABLE")
    os.environ["TQDM_DISABLE"] = "1"  # its GGUF loader draws a tqdm bar of its own
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                                  dtype=torch.float32)
    finally:
        if previous is None:
            del os.environ["TQDM_DISABLE"]
        else:
            os.environ["TQDM_DISABLE"] = previous
    return model.eval()


def generate_ours(model, idx: torch.Tensor) -> torch.Tensor:
    from groundup.generation import generate

    return generate(model, idx, NEW_TOKENS, greedy=True, use_cache=True)


def generate_transformers(model, idx: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(idx, attention_mask=torch.ones_like(idx), max_new_tokens=NEW_TOKENS,
                              min_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)


@torch.no_grad()
def prefill_decode_ours(model, idx: torch.Tensor) -> tuple[float, float]:
    """Seconds of the prefill and of the ``NEW_TOKENS - 1`` cached one-token steps after it (greedy)."""
    import time

    from groundup.attention import reusing_stacked_weights

    with reusing_stacked_weights():  # as generate runs: W_Q, W_K, W_V stacked once per call, not per token
        cache = model.new_cache()
        start = time.perf_counter()
        logits, _ = model(idx, cache=cache, last_only=True)
        prefill = time.perf_counter() - start
        token = logits[:, -1].argmax(-1, keepdim=True)
        start = time.perf_counter()
        for _ in range(NEW_TOKENS - 1):
            logits, _ = model(token, cache=cache, last_only=True)
            token = logits[:, -1].argmax(-1, keepdim=True)
    return prefill, time.perf_counter() - start


@torch.no_grad()
def prefill_decode_transformers(model, idx: torch.Tensor) -> tuple[float, float]:
    import time

    from transformers import DynamicCache

    cache = DynamicCache()
    start = time.perf_counter()
    out = model(idx, past_key_values=cache, use_cache=True, logits_to_keep=1)
    prefill = time.perf_counter() - start
    token = out.logits[:, -1].argmax(-1, keepdim=True)
    start = time.perf_counter()
    for _ in range(NEW_TOKENS - 1):
        out = model(token, past_key_values=out.past_key_values, use_cache=True)
        token = out.logits[:, -1].argmax(-1, keepdim=True)
    return prefill, time.perf_counter() - start


def _peak_rss_bytes() -> int:
    """This process's peak resident set size. Linux: ``VmHWM`` of /proc/self/status, the high-water mark of this
    program's own memory (``ru_maxrss`` survives exec: a child started by a 1.5 GB parent would start at 1.5 GB)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)


def memory_child(which: str, ids: list[int]) -> dict:
    """In a fresh process: peak RSS growth from after the imports to after loading and generating from ``ids``.

    The prompt ids come from the parent, so nothing but the imports runs before the baseline is taken (a
    transient peak there would hide the growth).
    """
    import transformers  # noqa: F401  (imported by both sides, so the baseline is the same)

    import groundup.pretrained  # noqa: F401

    idx = torch.tensor([ids])
    before = _peak_rss_bytes()
    if which in ("ours", "quantized"):
        model, _ = load_ours() if which == "ours" else load_quantized()
        generate_ours(model, idx)
    else:
        generate_transformers(load_transformers(), idx)
    return {"which": which, "peak_growth": _peak_rss_bytes() - before}


def _memory(which: str, ids: list[int]) -> int | None:
    cmd = [sys.executable, "-m", "groundup.bench.smollm2", "--memory", which, "--ids", ",".join(map(str, ids))]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if result.returncode != 0:
        print(f"[smollm2] memory child for {which} failed: {result.stderr.strip()[-300:]}", file=sys.stderr)
        return None
    return json.loads(result.stdout.strip().splitlines()[-1])["peak_growth"]


def _speed_rows() -> tuple[list[Row], list[int]]:
    """The three models in this process, timed alternately: end to end, then prefill and decode separately."""
    model, tok = load_ours()
    quantized, _ = load_quantized()
    hf = load_transformers()
    idx = _prompt(tok)
    threads = torch.get_num_threads()
    results = {}

    def ours():
        results["ours"] = generate_ours(model, idx)

    def kept():
        results["quantized"] = generate_ours(quantized, idx)

    def theirs():
        results["transformers"] = generate_transformers(hf, idx)

    times = alternate({"ours": ours, "quantized": kept, "transformers": theirs}, repeat=ROUNDS, warmup=1)
    same = torch.equal(results["ours"], results["transformers"])
    rows = []
    what = f"SmolLM2-135M float32, {threads} threads, {PROMPT_TOKENS}-token prompt + {NEW_TOKENS} greedy tokens"
    for name, label in (("ours", "book's GPT (generate)"), ("quantized", "book's GPT, kept quantized"),
                        ("transformers", "transformers LlamaForCausalLM")):
        t = sorted(times[name])[len(times[name]) // 2]
        rows.append(Row(f"{label}: {what}" if name == "ours" else f"  {label}", NEW_TOKENS / t, "tokens/s",
                        f"{t:.2f} s median of {ROUNDS}"))
    rows.append(ratio_row("  speed of ours / transformers", times["transformers"], times["ours"], "transformers",
                          f"target >= 1.0x; same {NEW_TOKENS} tokens: {'yes' if same else 'no'}"))
    same_q = torch.equal(results["ours"], results["quantized"])
    rows.append(ratio_row("  speed of kept-quantized / float32 (ours)", times["ours"], times["quantized"], "float32",
                          f"target >= 0.5x; same {NEW_TOKENS} tokens: {'yes' if same_q else 'no'}"))
    rows.append(Row("  loaded parameters + buffers, kept-quantized / float32",
                    loaded_bytes(quantized) / loaded_bytes(model), "x",
                    f"{loaded_bytes(quantized) / 2**20:.0f} MiB against {loaded_bytes(model) / 2**20:.0f} MiB; "
                    "target <= 0.4x"))
    split = {"ours": [], "quantized": [], "transformers": []}
    fns = {"ours": lambda: split["ours"].append(prefill_decode_ours(model, idx)),
           "quantized": lambda: split["quantized"].append(prefill_decode_ours(quantized, idx)),
           "transformers": lambda: split["transformers"].append(prefill_decode_transformers(hf, idx))}
    alternate(fns, repeat=ROUNDS, warmup=0)
    for name in ("ours", "quantized", "transformers"):
        prefill = sorted(p for p, _ in split[name])[ROUNDS // 2]
        decode = sorted(d for _, d in split[name])[ROUNDS // 2] / (NEW_TOKENS - 1)
        rows.append(Row(f"  prefill of {PROMPT_TOKENS} tokens, {name}", prefill * 1e3, "ms",
                        f"{PROMPT_TOKENS / prefill:.0f} tokens/s"))
        rows.append(Row(f"  decode per token (KV cache), {name}", decode * 1e3, "ms", f"{1 / decode:.1f} tokens/s"))
    rows.append(ratio_row("  decode speed, kept-quantized / float32", [d for _, d in split["ours"]],
                          [d for _, d in split["quantized"]], "float32", "target >= 0.5x, aim 1x"))
    rows.append(ratio_row("  prefill speed, kept-quantized / float32", [p for p, _ in split["ours"]],
                          [p for p, _ in split["quantized"]], "float32", "reported, no target"))
    return rows, idx[0].tolist()


def run() -> list[Row]:
    import transformers  # noqa: F401  (a missing optional dependency skips the section)

    rows, ids = _speed_rows()  # the models are freed when it returns
    memory = {name: _memory(name, ids) for name in ("ours", "quantized", "transformers")}
    for name in ("ours", "quantized", "transformers"):
        if memory[name] is not None:
            rows.append(Row(f"  peak RSS growth (load + generate), {name}", memory[name] / 2**20, "MiB",
                            "child process, from after the imports"))
    if None not in memory.values() and memory["transformers"] > 0:
        rows.append(Row("  peak memory of ours / transformers", memory["ours"] / memory["transformers"], "x",
                        "target <= 1.0x"))
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--memory", choices=("ours", "quantized", "transformers"), required=True)
    parser.add_argument("--ids", required=True, help="the prompt's token ids, comma-separated")
    args = parser.parse_args(argv)
    print(json.dumps(memory_child(args.memory, [int(i) for i in args.ids.split(",")])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
