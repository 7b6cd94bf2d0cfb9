"""The runs behind chapter 13's instruction tuning, stored in src/groundup/results/chapter13.json.

    OMP_NUM_THREADS=1 python tools/ch13_results.py                                # every entry (about half an hour)
    OMP_NUM_THREADS=1 python tools/ch13_results.py --entry base                   # zero-shot and 3-shot only
    OMP_NUM_THREADS=1 python tools/ch13_results.py --entry lora --seed 1          # one masked fine-tune
    OMP_NUM_THREADS=1 python tools/ch13_results.py --entry lora-nomask --seed 0   # the fine-tune without the mask

Three kinds of entry, all on chapter 10's dates task as instructions (:mod:`groundup.instructions`) for
SmolLM2-135M-Instruct, scored on the first ``--n-eval`` held-out test dates (50 by default) by greedy exact match
(:func:`groundup.instructions.exact_match_eval`):

- ``base``: the model as downloaded, zero-shot and with 3 shots (the first three training dates as earlier chat
  turns).
- ``lora``: a LoRA fine-tune made exactly as ``groundup finetune`` makes one (its run is built by
  :mod:`groundup.finetuning`'s own functions from the flags in ``finetune_args``, which the entry stores), with
  the loss on the answer tokens only; seeds 0, 1 and 2 by default.
- ``lora-nomask``: the same fine-tune with ``--no-mask``: the prompt's tokens (system message, chat template and
  instruction) are targets too.

Every entry also measures two losses of its model on the first ``--n-eval`` validation dates, each the mean
next-token cross-entropy in nats per target token, pooled over the examples: ``answer`` over the answer's tokens
and its ``<|im_end|>`` (what the masked loss trains), ``all`` over every token of the example after the first
(what the unmasked loss trains). The training loop's own curve (``val_loss``) averages ``eval_batches`` fixed
random batches of the validation dates with the loss the run trains: answer tokens for ``lora``, all tokens for
``lora-nomask``.

Each entry records the command that made it, its settings, its wall time and the threads PyTorch used; running a
command again replaces its entry. The adapters are written to a temporary folder (``--keep DIR`` keeps them).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from results_file import add_entry

from groundup import finetuning
from groundup.instructions import (
    IGNORE_INDEX,
    date_instructions,
    encode_instructions,
    exact_match_eval,
    instruction_batches,
)
from groundup.training import train

OUT = Path(__file__).resolve().parents[1] / "src" / "groundup" / "results" / "chapter13.json"
ENTRIES = ("base", "lora", "lora-nomask")
FINETUNE = dict(steps=40, batch_size=8, rank=8, alpha=16.0, targets=["W_q", "W_v"], lr=2e-3, warmup=4, context=128,
                n_train=1000, eval_interval=10, eval_batches=4)
"""The fine-tunes' settings (``groundup finetune`` flags): 40 steps take about 1.5 minutes with two threads on two
idle cores (2.3 s a step), 4.5 minutes on one thread of a busy machine (6.5 s a step, measured), plus about
two minutes of answering the held-out dates."""
SHOTS = 3
MAX_NEW_TOKENS = finetuning.FINETUNE_DEFAULTS["max_new_tokens"]
ENVIRONMENT = ("OMP_NUM_THREADS", "MKL_CBWR", "ATEN_CPU_CAPABILITY")


def command(entry: str, seed: int | None, n_eval: int, threads: int) -> str:
    seed_part = "" if seed is None else f" --seed {seed}"
    return f"OMP_NUM_THREADS={threads} python tools/ch13_results.py --entry {entry}{seed_part} --n-eval {n_eval}"


def finetune_args(out, seed: int, n_eval: int, mask_prompt: bool, settings: dict = FINETUNE) -> list[str]:
    """The ``groundup finetune`` arguments of a fine-tune (without the leading ``finetune``)."""
    argv = ["--out", str(out), "--no-progress", "--seed", str(seed), "--n-eval", str(n_eval)]
    for key, value in settings.items():
        flag = "--" + key.replace("_", "-")
        argv += [flag, *value] if isinstance(value, list) else [flag, str(value)]
    return argv + ([] if mask_prompt else ["--no-mask"])


def token_losses(model, tokenizer, pairs, context_length: int) -> dict:
    """``{"answer": ..., "all": ...}``: mean next-token cross-entropy (nats per target token, pooled over ``pairs``)
    on the answer tokens with their ``<|im_end|>``, and on every token after the first."""
    found = {}
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for name, mask in (("answer", True), ("all", False)):
            data = encode_instructions(tokenizer, pairs, context_length=context_length, mask_prompt=mask)
            total, count = 0.0, 0
            for x, y in zip(data.ids, data.labels):
                logits = model(x[None])[0][0]
                total += F.cross_entropy(logits.double(), y, ignore_index=IGNORE_INDEX, reduction="sum").item()
                count += int((y != IGNORE_INDEX).sum())
            found[name] = round(total / count, 5)
            found[f"{name}_tokens"] = count
    model.train(was_training)
    return found


def examples(pairs, predictions, n: int = 3) -> list[dict]:
    return [{"date": prompt.rsplit(": ", 1)[-1], "expected": answer, "answer": predicted}
            for (prompt, answer), predicted in list(zip(pairs, predictions))[:n]]


def run_base(n_eval: int) -> dict:
    """Zero-shot and ``SHOTS``-shot exact match of the base model, and its losses on the validation dates."""
    start = time.perf_counter()
    model, tokenizer = finetuning.load_base()
    model.eval()
    test = date_instructions("test", n_eval, seed=finetuning.DATA_SEED)
    shots = date_instructions("train", SHOTS, seed=finetuning.DATA_SEED)
    entry = {"n_eval": n_eval, "max_new_tokens": MAX_NEW_TOKENS, "shots": [list(s) for s in shots]}
    for name, given in (("zero_shot", ()), (f"{SHOTS}_shot", shots)):
        score, predictions = exact_match_eval(model, tokenizer, test, shots=given, max_new_tokens=MAX_NEW_TOKENS)
        entry[name] = {"exact_match": score, "correct": round(score * n_eval),
                       "examples": examples(test, predictions)}
    val = date_instructions("val", n_eval, seed=finetuning.DATA_SEED)
    entry["val_token_loss"] = token_losses(model, tokenizer, val, model.config.context_length)
    entry["wall_seconds"] = round(time.perf_counter() - start, 1)
    return entry


def run_finetune(seed: int, *, mask_prompt: bool = True, n_eval: int = 50, out=None,
                 settings: dict = FINETUNE) -> dict:
    """One fine-tune as ``groundup finetune`` runs it, then its exact match on the test dates and its losses.

    The run is built by :mod:`groundup.finetuning` itself (its parser and ``_prepare``), trained by
    :func:`groundup.training.train` with :func:`instruction_batches`, and its adapters-only checkpoint is left in
    ``out`` (a temporary folder when None)."""
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(out) if out is not None else Path(tmp) / "ft"
        argv = finetune_args(folder, seed, n_eval, mask_prompt, settings)
        parser = argparse.ArgumentParser(prog="groundup")
        finetuning.add_finetune_parser(parser.add_subparsers(dest="command"))
        args = parser.parse_args(["finetune", *argv])
        model, tokenizer, run, config, (train_data, val_data), test, _ = finetuning._prepare(args, folder)
        history = train(model, train_data, val_data, config, extra={"finetune": run}, batches=instruction_batches)
        trained = time.perf_counter() - start
        score, predictions = exact_match_eval(model, tokenizer, test, max_new_tokens=MAX_NEW_TOKENS)
        val = date_instructions("val", n_eval, seed=finetuning.DATA_SEED)
        losses = token_losses(model, tokenizer, val, run["context"])
    argv[1] = "DIR"  # the run folder is not part of the result
    return {"seed": seed, "mask_prompt": mask_prompt, "n_eval": n_eval, "settings": dict(settings),
            "finetune_args": argv, "max_new_tokens": MAX_NEW_TOKENS,
            "exact_match": score, "correct": round(score * len(test)), "examples": examples(test, predictions),
            "eval_step": history.eval_step, "val_loss": [round(v, 5) for v in history.val_loss],
            "val_loss_counts": "answer tokens" if mask_prompt else "all tokens",
            "train_loss": [round(v, 5) for v in history.train_loss], "val_token_loss": losses,
            "train_seconds_per_step": round(history.seconds[-1] / history.step[-1], 2),
            "wall_seconds_training": round(trained, 1), "wall_seconds": round(time.perf_counter() - start, 1)}


def store(key: str, entry: dict) -> None:
    """Add one entry to the JSON file (several commands may run at once: see tools/results_file.py)."""
    add_entry(OUT, key, entry, header={
        "about": ("Runs for chapter 13: SmolLM2-135M-Instruct on the dates task (tools/ch13_results.py) and the "
                  "which-play classification (tools/ch13_classification.py); each entry says which command made it.")})


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--entry", choices=ENTRIES, action="append", help="base, lora, lora-nomask (default: all)")
    p.add_argument("--seed", type=int, action="append", help="fine-tune seeds (default: 0 1 2 for lora, 0 for "
                   "lora-nomask)")
    p.add_argument("--n-eval", type=int, default=50, help="held-out test (and validation) dates (default: 50)")
    p.add_argument("--keep", metavar="DIR", help="keep each fine-tune's run folder under DIR")
    a = p.parse_args(argv)
    if a.n_eval < 1:
        p.error(f"--n-eval must be a positive integer, got {a.n_eval}")
    threads = int(os.environ.get("OMP_NUM_THREADS", "1"))
    torch.set_num_threads(threads)
    jobs = []
    for entry in a.entry or list(ENTRIES):
        if entry == "base":
            jobs.append((entry, None))
        else:
            jobs += [(entry, s) for s in a.seed or ([0, 1, 2] if entry == "lora" else [0])]
    for entry, seed in jobs:
        if entry == "base":
            key, result = f"base/n{a.n_eval}", run_base(a.n_eval)
        else:
            key = f"{entry}/seed{seed}/n{a.n_eval}"
            out = Path(a.keep) / key.replace("/", "_") if a.keep else None
            result = run_finetune(seed, mask_prompt=entry == "lora", n_eval=a.n_eval, out=out)
        environment = {k: os.environ.get(k) for k in ENVIRONMENT}
        store(key, {"command": command(entry, seed, a.n_eval, threads), "entry": entry, **result,
                    "threads": torch.get_num_threads(), "environment": environment})
        print(key, {k: v for k, v in result.items() if k in ("exact_match", "zero_shot", "3_shot", "wall_seconds",
                                                              "val_token_loss")}, flush=True)


if __name__ == "__main__":
    sys.exit(main())
