"""Training runs from the shell: ``groundup train`` and ``groundup sample``.

A run folder holds what training writes and sampling reads::

    run/checkpoint.pt    model, optimizer, schedule, random states, step, configs, history (see groundup.training)
    run/history.json     the loss curves as plain JSON, for plotting
    run/tokenizer.json   the character tokenizer the model's ids belong to

``groundup train`` defaults to the book's CPU recipe (chapter 7): a 4-layer GPT with rotary positions on
characters, AdamW with warm-up and cosine decay. ``--resume`` continues an interrupted run exactly.
``--objective masked`` trains a masked language model (chapter 9) of the same shape instead: a bidirectional
encoder fed BERT-masked windows (the tokenizer's characters plus one [MASK] id). It is not a generator, so
``groundup sample`` refuses such a run.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import math
import sys
import time
from pathlib import Path

import torch

from groundup.data import CORPORA, load_corpus, train_val_split
from groundup.masking import BERT_RATE, masked_lm_batches
from groundup.models import GPT, POSITIONALS, GPTConfig, MaskedLM, MaskedLMConfig
from groundup.tokenizers import CharTokenizer
from groundup.training import CHECKPOINT_NAME, TrainConfig, load_checkpoint, train

TOKENIZER_NAME = "tokenizer.json"

# The CPU recipe (chapter 7 shows the search that chose it, tools/recipe_trial.py ran it): 7500 steps are about
# ten minutes of training on a 2-core laptop CPU; --max-tokens and --minutes give other budgets.
RECIPE_MODEL = dict(context_length=128, d_model=192, n_layers=4, n_heads=6, positional="rope", dropout=0.0)
RECIPE_TRAINING = dict(batch_size=8, max_steps=7500, learning_rate=2e-3, warmup_steps=50, weight_decay=0.1,
                       grad_clip=1.0, eval_interval=250, eval_batches=20)


def _text_and_source(args) -> tuple[str, dict]:
    if args.text:
        path = Path(args.text).expanduser()
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise ValueError(f"cannot read --text {path}: {err}") from None
        source = {"text_file": str(path)}
    else:
        text = load_corpus(args.corpus)
        source = {"corpus": args.corpus}
    source["sha256"] = hashlib.sha256(text.encode("utf-8")).hexdigest()
    return text, source


def _recipe(key: str) -> str:
    value = {**RECIPE_MODEL, **RECIPE_TRAINING}[key]
    return f" (recipe: {value})"


def add_train_parser(sub) -> None:
    p = sub.add_parser(
        "train", help="train a character-level GPT (the book's CPU recipe)",
        description="Train a character-level GPT on a corpus and write checkpoints, the tokenizer and the loss "
                    "curves to --out. The defaults are the book's CPU recipe (chapter 7). Ctrl-C saves a "
                    "checkpoint; --resume continues from it and ends exactly as an uninterrupted run would.")
    p.add_argument("--out", required=True, metavar="DIR",
                   help="run folder: checkpoint.pt, tokenizer.json, history.json")
    p.add_argument("--resume", action="store_true",
                   help="continue the run in --out with its stored settings (give no model or training options)")
    p.add_argument("--objective", choices=("next", "masked"), default=None,
                   help="next: a GPT predicting the next token (default); masked: a masked language model "
                        "(chapter 9) filling in BERT-masked characters")
    p.add_argument("--mask-rate", type=float, help=f"--objective masked: fraction of positions to predict "
                   f"(default: {BERT_RATE}; of those 80 %% [MASK], 10 %% random, 10 %% unchanged)")
    source = p.add_mutually_exclusive_group()
    source.add_argument("--corpus", choices=sorted(CORPORA), default="shakespeare", help="a named corpus")
    source.add_argument("--text", metavar="FILE", help="train on this UTF-8 text file instead of a named corpus")
    m = p.add_argument_group("model (a GPTConfig)")
    m.add_argument("--context", type=int, help="context length n_C" + _recipe("context_length"))
    m.add_argument("--d-model", type=int, help="embedding size d_M" + _recipe("d_model"))
    m.add_argument("--layers", type=int, help="number of blocks n_L" + _recipe("n_layers"))
    m.add_argument("--heads", type=int, help="attention heads n_H" + _recipe("n_heads"))
    m.add_argument("--positional", choices=POSITIONALS, help="positional encoding (chapter 4)" + _recipe("positional"))
    m.add_argument("--dropout", type=float, help="dropout probability" + _recipe("dropout"))
    t = p.add_argument_group("training (a TrainConfig)")
    t.add_argument("--batch-size", type=int, help="windows per step" + _recipe("batch_size"))
    budget = t.add_mutually_exclusive_group()
    budget.add_argument("--max-steps", type=int, help="number of updates" + _recipe("max_steps"))
    budget.add_argument("--max-tokens", type=int, help="training tokens (sets --max-steps to this / (batch x context))")
    budget.add_argument("--minutes", type=float, help="train for this many minutes: the cosine runs over the time, "
                        "not the steps (not reproducible: it depends on the machine's speed)")
    t.add_argument("--lr", type=float, help="peak learning rate" + _recipe("learning_rate"))
    t.add_argument("--min-lr", type=float, help="final learning rate of the cosine (default: lr / 10)")
    t.add_argument("--warmup", type=int, help="linear warm-up steps" + _recipe("warmup_steps"))
    t.add_argument("--weight-decay", type=float, help="AdamW weight decay, matrices only" + _recipe("weight_decay"))
    t.add_argument("--grad-clip", type=float, help="clip the global gradient norm to this, 0: no clipping"
                   + _recipe("grad_clip"))
    t.add_argument("--eval-interval", type=int, help="evaluate and checkpoint every this many steps"
                   + _recipe("eval_interval"))
    t.add_argument("--eval-batches", type=int, help="validation batches per evaluation, 0: the whole validation "
                   "set" + _recipe("eval_batches"))
    t.add_argument("--seed", type=int, help="seed of the initialisation, dropout and batch order (default: 0)")
    t.add_argument("--device", help="cpu, cuda, ... (default: cuda when available, else cpu)")
    t.add_argument("--threads", type=int, help="CPU threads PyTorch may use (default: PyTorch's choice)")
    t.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(handler=train_command)


_MODEL_AND_TRAINING_FLAGS = ("context", "d_model", "layers", "heads", "positional", "dropout", "batch_size",
                             "max_steps", "max_tokens", "minutes", "lr", "min_lr", "warmup", "weight_decay",
                             "grad_clip", "eval_interval", "eval_batches", "seed", "objective", "mask_rate")


def _masked_batches(model, rate: float):
    """The batches function of a masked-LM run (None for a GPT): BERT masking at ``rate``."""
    if not isinstance(model, MaskedLM):
        return None
    return masked_lm_batches(model.config.mask_token_id, model.config.vocab_size, rate=rate)


def _configs_from_args(args, vocab_size: int) -> tuple[GPTConfig, TrainConfig]:
    """The recipe, with every option the user gave in its place."""
    def pick(flag: str, key: str):
        value = getattr(args, flag)
        return {**RECIPE_MODEL, **RECIPE_TRAINING}[key] if value is None else value

    model_config = GPTConfig(vocab_size=vocab_size, context_length=pick("context", "context_length"),
                             d_model=pick("d_model", "d_model"), n_layers=pick("layers", "n_layers"),
                             n_heads=pick("heads", "n_heads"), positional=pick("positional", "positional"),
                             dropout=pick("dropout", "dropout"))
    batch_size = pick("batch_size", "batch_size")
    max_steps = pick("max_steps", "max_steps")
    if args.minutes is not None:
        max_steps = 10**9  # the time budget ends the run
    if args.max_tokens is not None:
        if args.max_tokens < 1:
            raise ValueError(f"--max-tokens must be positive, got {args.max_tokens}")
        max_steps = max(1, math.ceil(args.max_tokens / (batch_size * model_config.context_length)))
    train_config = TrainConfig(
        batch_size=batch_size, max_steps=max_steps, learning_rate=pick("lr", "learning_rate"), min_lr=args.min_lr,
        warmup_steps=min(pick("warmup", "warmup_steps"), max_steps), weight_decay=pick("weight_decay", "weight_decay"),
        grad_clip=pick("grad_clip", "grad_clip") or None,
        eval_interval=min(pick("eval_interval", "eval_interval"), max_steps),
        eval_batches=pick("eval_batches", "eval_batches") or None, out_dir=args.out,
        time_budget=None if args.minutes is None else args.minutes * 60,
        seed=0 if args.seed is None else args.seed, device=args.device, progress=not args.no_progress)
    return model_config, train_config


def train_command(args) -> int:
    out = Path(args.out).expanduser()
    args.out = str(out)
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        if args.resume:
            given = [f"--{k.replace('_', '-')}" for k in _MODEL_AND_TRAINING_FLAGS if getattr(args, k) is not None]
            if given:
                raise ValueError(f"--resume continues with the stored settings; do not give {', '.join(given)}")
            model, ckpt = load_checkpoint(out / CHECKPOINT_NAME)
            stored = ckpt.get("train_config")
            source = ckpt.get("extra", {}).get("source", {})
            if not isinstance(stored, dict) or not isinstance(source, dict):
                raise ValueError(f"{out / CHECKPOINT_NAME} holds no training settings to resume with")
            args.corpus, args.text = source.get("corpus", "shakespeare"), source.get("text_file")
            text, now = _text_and_source(args)
            if now["sha256"] != source.get("sha256"):
                raise ValueError("the training text changed since the run started; resume needs the same text")
            tokenizer = CharTokenizer.load(out / TOKENIZER_NAME)
            mask_rate = ckpt.get("extra", {}).get("mask_rate", BERT_RATE)
            train_config = TrainConfig(**{**stored, "resume": True, "out_dir": str(out),
                                          "progress": not args.no_progress, "device": args.device})
            print(f"resuming {out} at step {ckpt['step']} of {train_config.max_steps}", flush=True)
        else:
            if (out / CHECKPOINT_NAME).exists():
                raise ValueError(f"{out / CHECKPOINT_NAME} exists: add --resume to continue it, "
                                 "or choose another --out")
            masked = args.objective == "masked"
            if args.mask_rate is not None and not masked:
                raise ValueError("--mask-rate is for masked language models: add --objective masked")
            mask_rate = BERT_RATE if args.mask_rate is None else args.mask_rate
            text, source = _text_and_source(args)
            tokenizer = CharTokenizer.from_text(text)
            # a masked LM's vocabulary is the tokenizer's characters plus [MASK], the last id
            model_config, train_config = _configs_from_args(args, tokenizer.vocab_size + masked)
            torch.manual_seed(train_config.seed)
            if masked:
                masked_lm_batches(tokenizer.vocab_size, tokenizer.vocab_size + 1, rate=mask_rate)  # checks the rate
                model = MaskedLM(MaskedLMConfig(**dataclasses.asdict(model_config)))
            else:
                model = GPT(model_config)
            out.mkdir(parents=True, exist_ok=True)
            tokenizer.save(out / TOKENIZER_NAME)
            n_params = sum(p.numel() for p in model.parameters())
            what = "masked language model (BERT masking)" if masked else "GPT"
            print(f"training a {n_params / 1e6:.2f} M-parameter {what} on {len(text):,} characters "
                  f"({tokenizer.vocab_size} distinct) for {train_config.max_steps} steps of "
                  f"{train_config.batch_size} x {model_config.context_length} tokens; run folder {out}", flush=True)
        ids = torch.tensor(tokenizer.encode(text), dtype=torch.long)
        train_ids, val_ids = train_val_split(ids, 0.1)
        started = time.perf_counter()
        history = train(model, train_ids, val_ids, train_config, extra={"source": source, "mask_rate": mask_rate},
                        batches=_masked_batches(model, mask_rate))
    except KeyboardInterrupt as stop:
        print(f"\n{stop or 'interrupted'}; continue with: groundup train --out {out} --resume", file=sys.stderr)
        return 130
    except (ValueError, TypeError, FileNotFoundError, FileExistsError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    minutes = (time.perf_counter() - started) / 60
    val = history.val_loss[-1]
    then = (f"sample with: groundup sample {out}" if not isinstance(model, MaskedLM) else
            f"a masked language model (not a generator): load it with groundup.training.load_checkpoint('{out}')")
    where = "at masked positions " if isinstance(model, MaskedLM) else ""
    print(f"done: step {history.step[-1]}, validation loss {where}{val:.4f} nats ({val / math.log(2):.3f} bits per "
          f"character), {history.tokens[-1]:,} training tokens, {minutes:.1f} minutes this session; {then}")
    return 0


def add_sample_parser(sub) -> None:
    p = sub.add_parser(
        "sample", help="generate text from a trained run", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Generate text from the model in a run folder written by 'groundup train' (chapter 8).")
    p.add_argument("run", metavar="DIR", help="a run folder (holds checkpoint.pt and tokenizer.json)")
    p.add_argument("--prompt", default="\n", help="the text to continue")
    p.add_argument("--tokens", type=int, default=500, help="how many new tokens (characters) to generate")
    p.add_argument("--temperature", type=float, default=0.8, help="divide the logits by this (> 0)")
    p.add_argument("--top-k", type=int, help="sample only from the k most probable tokens")
    p.add_argument("--top-p", type=float, help="sample only from the smallest set of tokens with probability >= p")
    p.add_argument("--greedy", action="store_true", help="always take the most probable token (no sampling)")
    p.add_argument("--no-cache", action="store_true", help="recompute every position at every step (no KV cache)")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling")
    p.add_argument("--device", help="cpu, cuda, ... (default: cuda when available, else cpu)")
    p.set_defaults(handler=sample_command)


def sample_command(args) -> int:
    from groundup.generation import generate
    from groundup.utils import default_device

    folder = Path(args.run).expanduser()
    try:
        if not (folder / CHECKPOINT_NAME).is_file():
            raise FileNotFoundError(f"{folder} holds no {CHECKPOINT_NAME}: give a folder written by "
                                    f"'groundup train --out {folder}'")
        device = torch.device(args.device) if args.device else default_device()
        model, _ = load_checkpoint(folder / CHECKPOINT_NAME, device=device)
        if not getattr(model, "causal", True):
            raise ValueError(f"{folder} holds a {type(model).__name__}, a masked language model: it is not a "
                             "generator (it fills in masked positions from both sides, chapter 9); sample from a "
                             "run trained with --objective next")
        tokenizer = CharTokenizer.load(folder / TOKENIZER_NAME)
        if tokenizer.vocab_size != model.config.vocab_size:
            raise ValueError(f"{folder / TOKENIZER_NAME} has {tokenizer.vocab_size} tokens but the model "
                             f"{model.config.vocab_size}: the folder mixes two runs")
        prompt = torch.tensor([tokenizer.encode(args.prompt)], dtype=torch.long, device=device)
        generator = torch.Generator(device=device).manual_seed(args.seed)
        out = generate(model, prompt, args.tokens, temperature=args.temperature, top_k=args.top_k,
                       top_p=args.top_p, greedy=args.greedy, use_cache=not args.no_cache, generator=generator)
        text = tokenizer.decode(out[0].tolist())
    except (ValueError, TypeError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    try:
        print(text)
        sys.stdout.flush()
    except BrokenPipeError:  # e.g. piped into head: stop quietly
        sys.stderr.close()
        return 0
    return 0
