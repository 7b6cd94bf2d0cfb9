"""The runs behind chapter 13's instruction tuning, stored in src/groundup/results/chapter13.json.

    OMP_NUM_THREADS=1 python tools/ch13_results.py                                # every entry (about half an hour)
    OMP_NUM_THREADS=1 python tools/ch13_results.py --entry base                   # zero-shot and 3-shot only
    OMP_NUM_THREADS=1 python tools/ch13_results.py --entry lora --seed 1          # one masked fine-tune
    OMP_NUM_THREADS=1 python tools/ch13_results.py --entry lora-nomask --seed 0   # the fine-tune without the mask
    OMP_NUM_THREADS=1 python tools/ch13_results.py --entry lora-weighted --seed 0  # ... the answer weighted as masked
    OMP_NUM_THREADS=1 python tools/ch13_results.py --entry base-eval --n-eval 1000   # every prediction, base model
    OMP_NUM_THREADS=1 python tools/ch13_results.py --entry lora --seed 0 --n-test 1000   # ... and of a fine-tune

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
- ``lora-weighted``: the control of the two: the prompt's tokens are targets as with ``--no-mask``, but the answer's
  tokens keep the total weight the masked loss gives them (:func:`answer_weighted_loss`). Averaged over all
  tokens the answer's targets get only about an eighth of the weight the masked loss gives them; this run tells
  "the prompt is trained too" apart from "the answer is trained less". Not a ``groundup finetune`` flag: the
  run is ``--no-mask``'s, with the loss replaced while it trains.

- ``base-eval``: the base model zero-shot and with :func:`groundup.instructions.format_shots` (one training date in
  each of the task's 11 input formats, a weekday among them) on the first ``--n-eval`` held-out dates, answered
  in batches (:func:`groundup.instructions.evaluate_answers`: the same greedy replies as one at a time). The entry
  stores every raw reply (``predictions``, in question order: question ``i`` is ``date_instructions("test",
  n_eval)[i]``), the ids of those cut at ``max_new_tokens`` (``unended``), the exact match with its 95 % Wilson
  interval, the errors by kind and by field and the exact match per input format
  (:func:`groundup.instructions.score_predictions`), the exact McNemar test of the two prompts on the same questions,
  and the seconds per question. No validation losses.

- ``ch10``: chapter 10's encoder-decoder, trained from scratch as ``groundup train --task dates --seed S`` trains it
  (:data:`groundup.runs.DATES_MODEL`, :data:`groundup.runs.DATES_TRAINING`; seeds 0, 1 and 2 by default, about
  20 s each), then asked the same first ``--n-eval`` held-out dates (chapter 10's test set is those dates) by
  greedy decoding; the same held-out record as ``base-eval``'s per seed (``seeds``), no shots.

``--n-test N`` adds the same held-out record (``held_out``: scores, errors and every reply, batched answers on the
first N test dates) to a ``lora`` or ``lora-nomask`` entry, whose key then ends in ``/test{N}``.

Every fine-tune also records ``answer_val_loss``: at step 0 and at every evaluation, the mean loss on the answer
tokens of the same ``eval_batches`` fixed validation batches that a masked run's ``val_loss`` averages (for
``lora`` the two curves are equal after step 0), so every run is drawn on one axis.

Every fine-tune also measures forgetting: ``general_text_loss`` holds the loss on :data:`GENERAL`'s text before
and after tuning (:func:`general_text_loss`).

Every entry but ``base-eval`` also measures two losses of its model on the first ``--n-eval`` validation dates, each
the mean next-token cross-entropy in nats per target token, pooled over the examples: ``answer`` over the answer's
tokens and its ``<|im_end|>`` (what the masked loss trains), ``all`` over every token of the example after the first
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
    date_format,
    date_instructions,
    encode_instructions,
    evaluate_answers,
    exact_match_eval,
    format_shots,
    instruction_batches,
    score_predictions,
)
from groundup.significance import mcnemar_test
from groundup.training import evaluate, train

OUT = Path(__file__).resolve().parents[1] / "src" / "groundup" / "results" / "chapter13.json"
ENTRIES = ("base", "lora", "lora-nomask", "base-eval", "lora-weighted", "ch10")
FINETUNE = dict(steps=40, batch_size=8, rank=8, alpha=16.0, targets=["W_q", "W_v"], lr=2e-3, warmup=4, context=128,
                n_train=1000, eval_interval=10, eval_batches=4)
"""The fine-tunes' settings (``groundup finetune`` flags): 40 steps take about 1.5 minutes with two threads on two
idle cores (2.3 s a step), 4.5 minutes on one thread of a busy machine (6.5 s a step, measured), plus about
two minutes of answering the held-out dates."""
SHOTS = 3
MAX_NEW_TOKENS = finetuning.FINETUNE_DEFAULTS["max_new_tokens"]
ENVIRONMENT = ("OMP_NUM_THREADS", "MKL_CBWR", "ATEN_CPU_CAPABILITY")
BATCH_SIZE = 32
"""Questions answered together by the batched evaluation (``--batch-size``): the replies do not depend on it, up
to float32 rounding of an argmax near-tie."""


def command(entry: str, seed: int | None, n_eval: int, threads: int, n_test: int | None = None,
            batch_size: int = BATCH_SIZE) -> str:
    seed_part = "" if seed is None else f" --seed {seed}"
    test_part = "" if n_test is None else f" --n-test {n_test}"
    batch_part = f" --batch-size {batch_size}" if entry == "base-eval" or n_test is not None else ""
    return (f"OMP_NUM_THREADS={threads} python tools/ch13_results.py --entry {entry}{seed_part} --n-eval {n_eval}"
            f"{test_part}{batch_part}")


def held_out_record(model, tokenizer, test, shots=(), *, batch_size: int = BATCH_SIZE) -> tuple[dict, list]:
    """``(record, predictions)``: every question of ``test`` answered in batches after ``shots``, scored.

    The record: ``n``, ``correct``, ``exact_match``, ``interval`` (95 % Wilson, rounded to 5 decimals), ``kinds``,
    ``fields`` and ``by_format`` (:func:`groundup.instructions.score_predictions`), ``predictions`` (every raw
    reply, in question order), ``unended`` (the ids of the replies cut at ``MAX_NEW_TOKENS``) and the seconds it
    took, in all and per question."""
    start = time.perf_counter()
    predictions = evaluate_answers(model, tokenizer, test, shots=shots, max_new_tokens=MAX_NEW_TOKENS,
                                   batch_size=batch_size)
    seconds = time.perf_counter() - start
    record = score_predictions(predictions, shots)
    record["interval"] = [round(v, 5) for v in record["interval"]]
    record.update(predictions=[p.text for p in predictions], unended=[p.id for p in predictions if not p.ended],
                  seconds=round(seconds, 1), seconds_per_question=round(seconds / len(test), 3))
    return record, predictions


def paired(a_name: str, a, b_name: str, b) -> dict:
    """The exact McNemar test of two lists of predictions of the same questions (A against B)."""
    test = mcnemar_test([p.correct for p in a], [p.correct for p in b])
    return {"a": a_name, "b": b_name, "a_only": test.a_only, "b_only": test.b_only, "both": test.both,
            "neither": test.neither, "p_value": test.p_value}


def answer_weighted_loss(logits: torch.Tensor, targets: torch.Tensor, answer: torch.Tensor) -> torch.Tensor:
    """The control's loss: every target counted, the answer's with the total weight the masked loss gives them.

    With ``N`` counted targets (``targets != -100``) of which ``N_a`` are the answer's (``answer``, a bool tensor
    of ``targets``' shape), the loss is ``(1/N) sum_prompt l + (1/N_a) sum_answer l``: the prompt's targets as in the
    unmasked mean, the answer's as in the masked one. Per-token cross-entropy ``l`` in float32."""
    losses = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE_INDEX,
                             reduction="none")
    counted = targets.flatten() != IGNORE_INDEX
    answer = answer.flatten() & counted
    return losses[counted & ~answer].sum() / counted.sum() + losses[answer].sum() / answer.sum()


def weighted_batches(data, batch_size: int, context_length: int, generator: torch.Generator):
    """``((ids, answer), targets)``: :func:`instruction_batches` of ``data = (unmasked, masked)`` drawing the same
    examples from both (one ``randint`` call each, from the same generator state); ``answer`` marks the targets the
    masked labels keep."""
    unmasked, masked = data
    state = generator.get_state()
    inputs, targets = instruction_batches(unmasked, batch_size, context_length, generator)
    _, masked_targets = instruction_batches(masked, batch_size, context_length, torch.Generator().set_state(state))
    return (*inputs, masked_targets != IGNORE_INDEX), targets


class answer_weighted:
    """Within ``with answer_weighted(model):``, ``model(ids, answer, targets)`` returns the logits and
    :func:`answer_weighted_loss`; every other call is the model's own forward."""

    def __init__(self, model):
        self.model = model

    def __enter__(self):
        plain = self.model.forward

        def forward(idx, *args, **kwargs):
            if len(args) == 2 and not kwargs:
                answer, targets = args
                logits, _ = plain(idx)
                return logits, answer_weighted_loss(logits, targets, answer)
            return plain(idx, *args, **kwargs)

        self.model.forward = forward
        return self.model

    def __exit__(self, *exc):
        del self.model.forward  # the class's forward again
        return False


def answer_curve_loss(model, masked_val, config) -> float:
    """The answer-token loss on the fixed validation batches a masked run's ``val_loss`` averages."""
    n_c = config.context_length or model.config.context_length
    return evaluate(model, masked_val, batch_size=config.batch_size, context_length=n_c,
                    max_batches=config.eval_batches, batches=instruction_batches)


GENERAL = dict(corpus="shakespeare", start="middle", tokens=4096, window=512)
"""The general text forgetting is measured on: ``tokens`` tokens of the Shakespeare corpus from its middle
character on (a scene of Macbeth), cut into windows of ``window`` tokens (or the model's context, if shorter)."""


def general_text_loss(model, tokenizer) -> float:
    """Mean next-token loss (nats per token) of ``model`` on :data:`GENERAL`'s text: what tuning may forget."""
    from groundup.data import load_corpus

    text = load_corpus(GENERAL["corpus"])
    ids = torch.tensor(tokenizer.encode_ordinary(text[len(text) // 2:len(text) // 2 + 8 * GENERAL["tokens"]]))
    ids = ids[:GENERAL["tokens"] + 1]
    window = min(GENERAL["window"], model.config.context_length)
    total, count = 0.0, 0
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for start in range(0, GENERAL["tokens"], window):
            x = ids[start:start + window + 1]
            logits = model(x[None, :-1])[0][0]
            total += F.cross_entropy(logits.double(), x[1:], reduction="sum").item()
            count += len(x) - 1
    model.train(was_training)
    return round(total / count, 5)


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


def run_base_eval(n_eval: int, *, batch_size: int = BATCH_SIZE) -> dict:
    """The base model zero-shot and with :func:`format_shots` on the first ``n_eval`` held-out dates, every
    prediction kept (:func:`held_out_record`), and the paired test of the two prompts."""
    start = time.perf_counter()
    model, tokenizer = finetuning.load_base()
    model.eval()
    test = date_instructions("test", n_eval, seed=finetuning.DATA_SEED)
    shots = format_shots(finetuning.DATA_SEED)
    k_shot = f"{len(shots)}_shot"
    dates = [prompt.rsplit(": ", 1)[-1] for prompt, _ in shots]
    entry = {"n_eval": n_eval, "max_new_tokens": MAX_NEW_TOKENS, "batch_size": batch_size,
             "shots": [[date, answer] for date, (_, answer) in zip(dates, shots)],
             "shot_formats": [date_format(date) for date in dates]}
    found = {}
    for name, given in (("zero_shot", ()), (k_shot, shots)):
        entry[name], found[name] = held_out_record(model, tokenizer, test, given, batch_size=batch_size)
    entry["mcnemar"] = paired(k_shot, found[k_shot], "zero_shot", found["zero_shot"])
    entry["wall_seconds"] = round(time.perf_counter() - start, 1)
    return entry


def run_finetune(seed: int, *, mask_prompt: bool = True, n_eval: int = 50, out=None,
                 settings: dict = FINETUNE, n_test: int | None = None, batch_size: int = BATCH_SIZE,
                 weighted: bool = False) -> dict:
    """One fine-tune as ``groundup finetune`` runs it, then its exact match on the test dates and its losses.

    The run is built by :mod:`groundup.finetuning` itself (its parser and ``_prepare``), trained by
    :func:`groundup.training.train` with :func:`instruction_batches`, and its adapters-only checkpoint is left in
    ``out`` (a temporary folder when None). With ``n_test`` the entry also holds ``held_out``: the first
    ``n_test`` held-out dates answered in batches and scored, every reply kept (:func:`held_out_record`).
    ``weighted`` (with ``mask_prompt=False``) trains with :func:`answer_weighted_loss` instead of the plain mean."""
    if weighted and mask_prompt:
        raise ValueError("weighted=True is the control of the unmasked run: give mask_prompt=False")
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(out) if out is not None else Path(tmp) / "ft"
        argv = finetune_args(folder, seed, n_eval, mask_prompt, settings)
        parser = argparse.ArgumentParser(prog="groundup")
        finetuning.add_finetune_parser(parser.add_subparsers(dest="command"))
        args = parser.parse_args(["finetune", *argv])
        model, tokenizer, run, config, (train_data, val_data), test, _ = finetuning._prepare(args, folder)
        if mask_prompt:  # the run's own data are already the masked ones
            masked_train, masked_val = train_data, val_data
        else:
            train_pairs, val_pairs = finetuning._task_pairs(run)[:2]
            masked_train, masked_val = finetuning._encode(tokenizer, dict(run, mask_prompt=True), train_pairs,
                                                          val_pairs)
        general_before = general_text_loss(model, tokenizer)
        curve = [answer_curve_loss(model, masked_val, config)]
        record = lambda step, model: curve.append(answer_curve_loss(model, masked_val, config))  # noqa: E731
        if weighted:
            with answer_weighted(model):
                history = train(model, (train_data, masked_train), (val_data, masked_val), config,
                                extra={"finetune": run}, batches=weighted_batches, callback=record)
        else:
            history = train(model, train_data, val_data, config, extra={"finetune": run},
                            batches=instruction_batches, callback=record)
        trained = time.perf_counter() - start
        score, predictions = exact_match_eval(model, tokenizer, test, max_new_tokens=MAX_NEW_TOKENS)
        val = date_instructions("val", n_eval, seed=finetuning.DATA_SEED)
        losses = token_losses(model, tokenizer, val, run["context"])
        general = {**GENERAL, "before": general_before, "after": general_text_loss(model, tokenizer)}
        if n_test is not None:
            held = date_instructions("test", n_test, seed=finetuning.DATA_SEED)
            held_out = held_out_record(model, tokenizer, held, batch_size=batch_size)[0]
    argv[1] = "DIR"  # the run folder is not part of the result
    more = {} if n_test is None else {"n_test": n_test, "batch_size": batch_size, "held_out": held_out}
    loss = {"loss": "answer_weighted_loss"} if weighted else {}
    return {**more, **loss, "seed": seed, "mask_prompt": mask_prompt, "n_eval": n_eval, "settings": dict(settings),
            "finetune_args": argv, "max_new_tokens": MAX_NEW_TOKENS,
            "exact_match": score, "correct": round(score * len(test)), "examples": examples(test, predictions),
            "eval_step": history.eval_step, "val_loss": [round(v, 5) for v in history.val_loss],
            "val_loss_counts": ("answer tokens" if mask_prompt else
                                "all tokens, answer weighted as masked" if weighted else "all tokens"),
            "answer_val_loss": [round(v, 5) for v in curve], "answer_val_step": [0, *history.eval_step],
            "general_text_loss": general,
            "train_loss": [round(v, 5) for v in history.train_loss], "val_token_loss": losses,
            "train_seconds_per_step": round(history.seconds[-1] / history.step[-1], 2),
            "wall_seconds_training": round(trained, 1), "wall_seconds": round(time.perf_counter() - start, 1)}


def run_ch10(seeds, n_eval: int) -> dict:
    """Chapter 10's model trained from scratch for each of ``seeds``, scored on the first ``n_eval`` held-out dates
    with the instruction-tuned models' record (:func:`held_out_record`'s fields but ``unended``)."""
    from groundup.instructions import Prediction
    from groundup.models import EncoderDecoder
    from groundup.runs import DATES_MODEL, DATES_TRAINING, _dates_data, _dates_model_config
    from groundup.seq2seq import batches, collate, greedy_decode
    from groundup.training import TrainConfig

    start = time.perf_counter()
    src_tok, tgt_tok, train_data, val_data, test_pairs = _dates_data()
    test_pairs = test_pairs[:n_eval]
    config = _dates_model_config(lambda flag, key: DATES_MODEL[key], (src_tok.vocab_size, tgt_tok.vocab_size))
    questions = date_instructions("test", n_eval, seed=finetuning.DATA_SEED)
    if [answer for _, answer in questions] != [target for _, target in test_pairs]:
        raise RuntimeError("chapter 10's test dates are not the instructions' held-out dates")
    found = {}
    for seed in seeds:
        t0 = time.perf_counter()
        torch.manual_seed(seed)
        model = EncoderDecoder(config)
        history = train(model, train_data, val_data, TrainConfig(**DATES_TRAINING, seed=seed, progress=False),
                        batches=batches)
        trained = time.perf_counter() - t0
        src = collate([src_tok.encode(source) for source, _ in test_pairs])
        replies = [tgt_tok.decode(ids) for ids in greedy_decode(model.eval(), src)]
        predictions = [Prediction(i, date_format(source), target, reply, True, reply.strip())
                       for i, ((source, target), reply) in enumerate(zip(test_pairs, replies))]
        record = score_predictions(predictions)
        record["interval"] = [round(v, 5) for v in record["interval"]]
        record.update(predictions=replies, unended=[], val_loss=round(history.val_loss[-1], 5),
                      train_seconds=round(trained, 1), seconds=round(time.perf_counter() - t0, 1))
        found[str(seed)] = record
    return {"n_eval": n_eval, "model": dict(DATES_MODEL), "training": dict(DATES_TRAINING),
            "parameters": sum(p.numel() for p in model.parameters()),
            "examples_seen": DATES_TRAINING["batch_size"] * DATES_TRAINING["max_steps"],
            "seeds": found, "wall_seconds": round(time.perf_counter() - start, 1)}


def store(key: str, entry: dict) -> None:
    """Add one entry to the JSON file (several commands may run at once: see tools/results_file.py)."""
    add_entry(OUT, key, entry, header={
        "about": ("Runs for chapter 13: SmolLM2-135M-Instruct on the dates task (tools/ch13_results.py) and the "
                  "which-play classification (tools/ch13_classification.py); each entry says which command made it.")})


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--entry", choices=ENTRIES, action="append", help="base, lora, lora-nomask, base-eval (default: "
                   "base, lora and lora-nomask)")
    p.add_argument("--seed", type=int, action="append", help="fine-tune seeds (default: 0 1 2 for lora, 0 for "
                   "lora-nomask and lora-weighted)")
    p.add_argument("--n-eval", type=int, default=50, help="held-out test (and validation) dates (default: 50)")
    p.add_argument("--n-test", type=int, help="lora, lora-nomask: also answer the first N held-out test dates in "
                   "batches and store every reply (the key ends in /testN)")
    p.add_argument("--batch-size", type=int, default=BATCH_SIZE, help="questions answered together by base-eval "
                   f"and --n-test (default: {BATCH_SIZE})")
    p.add_argument("--keep", metavar="DIR", help="keep each fine-tune's run folder under DIR")
    a = p.parse_args(argv)
    for flag, value in (("--n-eval", a.n_eval), ("--n-test", a.n_test), ("--batch-size", a.batch_size)):
        if value is not None and value < 1:
            p.error(f"{flag} must be a positive integer, got {value}")
    threads = int(os.environ.get("OMP_NUM_THREADS", "1"))
    torch.set_num_threads(threads)
    jobs = []
    for entry in a.entry or list(ENTRIES[:3]):
        if entry in ("base", "base-eval", "ch10"):
            jobs.append((entry, None))
        else:
            jobs += [(entry, s) for s in a.seed or ([0, 1, 2] if entry == "lora" else [0])]
    for entry, seed in jobs:
        n_test = None
        if entry == "base":
            key, result = f"base/n{a.n_eval}", run_base(a.n_eval)
        elif entry == "base-eval":
            key, result = f"base-eval/n{a.n_eval}", run_base_eval(a.n_eval, batch_size=a.batch_size)
        elif entry == "ch10":
            key, result = f"ch10/n{a.n_eval}", run_ch10(a.seed or [0, 1, 2], a.n_eval)
        else:
            n_test = a.n_test
            key = f"{entry}/seed{seed}/n{a.n_eval}" + ("" if n_test is None else f"/test{n_test}")
            out = Path(a.keep) / key.replace("/", "_") if a.keep else None
            result = run_finetune(seed, mask_prompt=entry == "lora", n_eval=a.n_eval, out=out, n_test=n_test,
                                  batch_size=a.batch_size, weighted=entry == "lora-weighted")
        environment = {k: os.environ.get(k) for k in ENVIRONMENT}
        store(key, {"command": command(entry, seed, a.n_eval, threads, n_test, a.batch_size), "entry": entry,
                    **result, "threads": torch.get_num_threads(), "environment": environment})
        shown = {k: v for k, v in result.items() if k in ("exact_match", "wall_seconds", "val_token_loss")}
        for k, v in result.items():
            if isinstance(v, dict) and "predictions" in v:  # a held-out record: its scores, not its replies
                shown[k] = {f: v[f] for f in ("correct", "n", "interval", "kinds", "seconds_per_question")}
            elif k in ("zero_shot", "3_shot", "mcnemar"):
                shown[k] = v
            elif k == "seeds":  # ch10: each seed's record
                shown[k] = {seed: {f: r[f] for f in ("correct", "n", "interval", "kinds")} for seed, r in v.items()}
        print(key, shown, flush=True)


if __name__ == "__main__":
    sys.exit(main())
