"""``groundup finetune``: instruction tuning SmolLM2-135M-Instruct with LoRA, from the shell (chapter 13).

    groundup finetune --out ft/                        # the dates task: dates in words -> ISO 8601
    groundup finetune --out ft/ --data task.jsonl      # {"prompt": ..., "answer": ...} per line
    groundup finetune --out ft/ --resume               # continue after Ctrl-C, exactly

The pretrained weights stay frozen; rank-``--rank`` adapters (:func:`groundup.lora.attach_lora`) on the
``--targets`` projections of every block learn, with the next-token loss on the answer tokens only (the prompt's
targets are masked; ``--no-mask`` trains on them too). Training is :func:`groundup.training.train` with
``batches=instruction_batches`` (:mod:`groundup.instructions`), so a run has its progress bar, its checkpoints in
``--out`` (adapters-only: the adapters, the optimizer and the fingerprint of the base, a few MB), Ctrl-C saving
a checkpoint and ``--resume`` ending bit for bit as an uninterrupted run would. At the end the held-out exact
match (greedy decoding, :func:`groundup.instructions.exact_match_eval`) and the validation loss are printed.

The run folder::

    ft/checkpoint.pt    adapters, optimizer, schedule, random states, step, settings (extra["finetune"]), history
    ft/history.json     the loss curves as plain JSON
"""

from __future__ import annotations

import math
import os
import re
import sys
import time
from pathlib import Path

import torch

from groundup import flags
from groundup.data import sha256_bytes
from groundup.footprint import check_fits, training_bytes
from groundup.lora import DEFAULT_TARGETS, attach_lora, check_base, count_parameters
from groundup.run_folder import describe_error, interrupted_message, run_lock
from groundup.training import CHECKPOINT_NAME, TrainConfig, read_checkpoint, train
from groundup.utils import default_device

__all__ = ["add_finetune_parser", "finetune_command", "load_base", "load_adapters", "read_finetune_run",
           "FINETUNE_DEFAULTS", "BASE_NAME"]

BASE_NAME = "smollm2"
"""The base model ``groundup finetune`` adapts: SmolLM2-135M-Instruct (:func:`groundup.pretrained.load_smollm2`)."""

FINETUNE_DEFAULTS = dict(rank=8, alpha=16.0, steps=40, batch_size=8, lr=2e-3, warmup=4, seed=0, context=128,
                         n_train=1000, n_eval=50, eval_interval=10, eval_batches=4, max_new_tokens=16)
"""The defaults of ``groundup finetune``: chapter 13's settings, those of its stored runs (``tools/ch13_results.py``'s
``FINETUNE``), so ``groundup finetune --out ft/ --seed 0`` is the chapter's run of seed 0. A step of 8 dates (about
75 tokens each) takes about 2.3 s with two threads on two otherwise idle CPU cores (measured; 12 s on one thread of
a busy machine); answering the 50 held-out dates about two minutes there."""

DATA_SEED = 0
"""The seed of the data: chapter 10's split of the dates, and the held-out draw of a --data file (not --seed)."""

# the TrainConfig fields and the flags that set them, for messages in the words the user typed
_FLAG_OF_FIELD = {"batch_size": "--batch-size", "max_steps": "--steps", "learning_rate": "--lr",
                  "warmup_steps": "--warmup", "eval_interval": "--eval-interval", "eval_batches": "--eval-batches",
                  "seed": "--seed", "context_length": "--context"}
_SETTING_FLAGS = ("task", "data", "rank", "alpha", "targets", "steps", "batch_size", "lr", "warmup", "seed",
                  "context", "no_mask", "n_train", "n_eval", "eval_interval", "eval_batches")


def load_base(name: str = BASE_NAME):
    """The base model and its tokenizer, ``(model, tokenizer)``: SmolLM2-135M-Instruct in float32.

    The one place the command loads weights (tests replace it by a tiny model)."""
    if name != BASE_NAME:
        raise ValueError(f"unknown base model {name!r}: groundup finetune adapts {BASE_NAME}")
    from groundup.pretrained import load_smollm2

    return load_smollm2()


def _default(key: str) -> str:
    return f" (default: {FINETUNE_DEFAULTS[key]})"


def add_finetune_parser(sub) -> None:
    p = sub.add_parser(
        "finetune", help="fine-tune SmolLM2 with LoRA on an instruction task (chapter 13)",
        description="Instruction-tune SmolLM2-135M-Instruct with low-rank adapters (LoRA): the pretrained weights "
                    "stay frozen, rank --rank adapters on the --targets projections learn to answer the task's "
                    "prompts (the loss counts only the answer tokens unless --no-mask). Checkpoints in --out hold "
                    "only the adapters (a few MB) and the base's fingerprint; Ctrl-C saves one, --resume continues "
                    "and ends exactly as an uninterrupted run would. At the end, prints the held-out exact match "
                    "(greedy decoding) and the validation loss.")
    p.add_argument("--out", required=True, metavar="DIR", help="run folder: checkpoint.pt (adapters only), "
                   "history.json")
    p.add_argument("--resume", action="store_true",
                   help="continue the run in --out with its stored settings (give no task, adapter or training "
                        "options)")
    source = p.add_mutually_exclusive_group()
    source.add_argument("--task", choices=("dates",), help="dates: chapter 10's dates in words to ISO 8601 "
                        "(train on its training split, the validation loss on its validation split, exact match "
                        "on its held-out test dates) (default, unless --data)")
    source.add_argument("--data", metavar="FILE.jsonl", help="a task file instead: one JSON object "
                        "{\"prompt\": ..., \"answer\": ...} per line; --n-eval examples (a fixed random draw) are "
                        "held out for the validation loss and the exact match, the rest (at most --n-train) train")
    a = p.add_argument_group("adapters (groundup.lora)")
    a.add_argument("--rank", type=flags.integer(1), help="rank r of every adapter, a positive integer"
                   + _default("rank"))
    a.add_argument("--alpha", type=flags.number(0, low_open=True), help="the update is scaled by alpha / r"
                   + _default("alpha"))
    a.add_argument("--targets", nargs="+", metavar="NAME", help="the projections to adapt in every block: W_q, "
                   "W_k, W_v, W_o (attention), W_in, W_gate, W_out (feed-forward) (default: "
                   f"{' '.join(DEFAULT_TARGETS)}, as in the LoRA paper)")
    t = p.add_argument_group("training (a TrainConfig: AdamW, no weight decay, warm-up + cosine, clipping at 1)")
    t.add_argument("--steps", type=flags.integer(1), help="number of updates" + _default("steps"))
    t.add_argument("--batch-size", type=flags.integer(1), help="examples per step" + _default("batch_size"))
    t.add_argument("--lr", type=flags.number(0, low_open=True), help="peak learning rate" + _default("lr"))
    t.add_argument("--warmup", type=flags.integer(0), help="linear warm-up steps" + _default("warmup"))
    t.add_argument("--seed", type=flags.seed, help="seed of the adapters' initialisation and the batch order "
                   "(the data's split is fixed)" + _default("seed"))
    t.add_argument("--context", type=flags.integer(2), help="the longest example in tokens (chat template, prompt, "
                   "answer and <|im_end|>); a longer one is refused" + _default("context"))
    t.add_argument("--no-mask", action="store_true", help="train on the prompt's tokens too, not only the answer's")
    t.add_argument("--n-train", type=flags.integer(1), help="training examples (at most)" + _default("n_train"))
    t.add_argument("--n-eval", type=flags.integer(1), help="held-out examples for the validation loss and the exact "
                   "match" + _default("n_eval"))
    t.add_argument("--eval-interval", type=flags.integer(1), help="evaluate and checkpoint every this many steps"
                   + _default("eval_interval"))
    t.add_argument("--eval-batches", type=flags.integer(1), help="held-out batches per validation loss"
                   + _default("eval_batches"))
    t.add_argument("--threads", type=flags.integer(1, 1024),
                   help="CPU threads PyTorch may use, 1 to 1024 (default: PyTorch's choice)")
    t.add_argument("--device", type=flags.device, help="cpu, cuda, cuda:N or mps (default: cuda when available, "
                   "else cpu)")
    t.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(handler=finetune_command)


# ---- the settings of a run, and its data ----------------------------------------------------------------------

def _settings_from_args(args, out: Path) -> dict:
    """What a new run is: the task and the adapters' and training's settings, every default in place."""
    d = FINETUNE_DEFAULTS

    def pick(key):
        value = getattr(args, key)
        return d[key] if value is None else value

    settings = {"base": BASE_NAME, "task": None if args.data else "dates", "rank": pick("rank"),
                "alpha": float(pick("alpha")), "targets": list(args.targets or DEFAULT_TARGETS),
                "context": pick("context"), "mask_prompt": not args.no_mask, "n_train": pick("n_train"),
                "n_eval": pick("n_eval")}
    if args.data:
        path = Path(args.data).expanduser().absolute()
        settings.update(data_file=str(path), data_file_from_run=os.path.relpath(path, out.absolute()))
    steps = pick("steps")
    settings["train"] = dict(batch_size=pick("batch_size"), max_steps=steps, learning_rate=pick("lr"),
                             warmup_steps=min(pick("warmup"), steps), weight_decay=0.0, optimizer="adamw",
                             grad_clip=1.0, eval_interval=min(pick("eval_interval"), steps),
                             eval_batches=pick("eval_batches"), seed=pick("seed"), context_length=settings["context"])
    return settings


def _read_data_file(settings: dict, out: Path | None) -> tuple[list, str]:
    """The --data file's (prompt, answer) pairs and the SHA-256 of its bytes; errors name --data."""
    from groundup.instructions import read_task_file

    path = Path(settings["data_file"])
    relative = settings.get("data_file_from_run")
    if not path.is_file() and out is not None and isinstance(relative, str) and (out / relative).is_file():
        path = out / relative  # the run folder and the file moved together
    try:
        pairs = read_task_file(path)
        digest = sha256_bytes(path.read_bytes())
    except (ValueError, OSError) as err:
        raise ValueError(f"--data: {describe_error(err)}") from None
    return pairs, digest


def _task_pairs(settings: dict, out: Path | None = None) -> tuple[list, list, list, str | None]:
    """``(train, val, test, data_sha256)``: the (prompt, answer) pairs to train on, for the validation loss and
    for the exact match, and the --data file's SHA-256 (None for the dates task)."""
    from groundup.instructions import date_instructions

    n_train, n_eval = settings["n_train"], settings["n_eval"]
    if settings["task"] == "dates":
        return (date_instructions("train", n_train, seed=DATA_SEED), date_instructions("val", n_eval, seed=DATA_SEED),
                date_instructions("test", n_eval, seed=DATA_SEED), None)
    pairs, digest = _read_data_file(settings, out)
    if len(pairs) <= n_eval:
        raise ValueError(f"--data {settings['data_file']} holds {len(pairs)} examples: too few to hold out "
                         f"--n-eval {n_eval} and train on the rest; give a smaller --n-eval or more examples")
    order = torch.randperm(len(pairs), generator=torch.Generator().manual_seed(DATA_SEED)).tolist()
    held = [pairs[i] for i in order[:n_eval]]
    return [pairs[i] for i in order[n_eval:n_eval + n_train]], held, held, digest


def _encode(tokenizer, settings: dict, train_pairs, val_pairs):
    """The training and validation examples as ids and labels; an example too long names --context."""
    from groundup.instructions import encode_instructions

    where = f"--data {settings['data_file']}" if settings["task"] is None else "the dates task"
    encoded = []
    for name, pairs in (("training", train_pairs), ("validation", val_pairs)):
        try:
            encoded.append(encode_instructions(tokenizer, pairs, context_length=settings["context"],
                                               mask_prompt=settings["mask_prompt"]))
        except ValueError as err:
            raise ValueError(f"--context {settings['context']} is too short for {where}: its {name} {err}") from None
    return encoded


def _attach(model, settings: dict):
    """The adapters of ``settings`` on ``model`` (errors name --rank or --targets)."""
    torch.manual_seed(settings["train"]["seed"])  # A's random initialisation
    try:
        return attach_lora(model, settings["targets"], r=settings["rank"], alpha=settings["alpha"])
    except ValueError as err:
        flag = "--rank" if str(err).startswith("r ") else "--targets"
        value = settings["rank"] if flag == "--rank" else " ".join(settings["targets"])
        raise ValueError(f"{flag} {value}: {err}") from None


def _check_base(ckpt: dict, model, flag: str, where: Path) -> None:
    """Refuse adapters trained on another base (their stored fingerprint against ``model``'s), naming ``flag``."""
    try:
        check_base(model, ckpt.get("model"))
    except ValueError as err:
        raise ValueError(f"{flag} {where}: {err}") from None


def read_finetune_run(folder: Path, flag: str) -> tuple[dict, dict]:
    """``(checkpoint, settings)`` of a ``groundup finetune`` run folder; an error naming ``flag`` otherwise."""
    if Path(folder).is_file():
        raise ValueError(f"{flag} {folder} is a file: give the run folder groundup finetune wrote (it holds "
                         f"{CHECKPOINT_NAME})")
    if not (Path(folder) / CHECKPOINT_NAME).is_file():
        raise ValueError(f"{flag} {folder}: no {CHECKPOINT_NAME} there: fine-tune first "
                         f"(groundup finetune --out {folder})")
    try:
        ckpt = read_checkpoint(Path(folder) / CHECKPOINT_NAME)
    except (ValueError, FileNotFoundError) as err:
        raise ValueError(f"{flag} {folder}: {err}") from None
    settings = ckpt.get("extra", {}).get("finetune") if isinstance(ckpt.get("extra"), dict) else None
    if not ckpt.get("adapters_only") or not isinstance(settings, dict):
        raise ValueError(f"{flag} {folder}: not a run of groundup finetune (its checkpoint holds "
                         f"{'LoRA adapters' if ckpt.get('adapters_only') else 'a whole model'} without the "
                         "command's settings)")
    return ckpt, settings


def load_adapters(model, folder, *, flag: str = "--adapter", merge: bool = True) -> dict:
    """Put the adapters of the ``groundup finetune`` run in ``folder`` onto ``model`` (its base); return the run's
    settings. Merged into the weights by default (inference: the plain layers' speed). Errors name ``flag``: not
    such a run, or adapters trained on another base."""
    from groundup.lora import load_lora, merge_lora

    folder = Path(folder).expanduser()
    ckpt, settings = read_finetune_run(folder, flag)
    try:
        load_lora(model, ckpt["model"])  # refuses adapters for another base, before anything is attached
    except ValueError as err:
        raise ValueError(f"{flag} {folder}: {err}") from None
    if merge:
        merge_lora(model)
    return settings


# ---- the command ------------------------------------------------------------------------------------------------

def _in_flags(message: str) -> str:
    """``message`` with TrainConfig's field names replaced by the flags of this command that set them."""
    pattern = r"(?<![\w-])(" + "|".join(_FLAG_OF_FIELD) + r")(?!\w)"
    return re.sub(pattern, lambda m: _FLAG_OF_FIELD[m.group(1)], message)


def _check_memory(model, settings: dict, config: TrainConfig, train_data, *, resumed: bool) -> None:
    """Refuse a --batch-size whose training cannot fit in the device's memory, before anything of its size is
    allocated (as ``groundup train`` does: :mod:`groundup.footprint`'s lower estimate against the total memory).

    The estimate: the model, gradients and AdamW's moments of the adapters alone (the base is frozen), and for a
    batch the logits, their gradient and one activation per block for every token of its padded examples, at least
    ``batch_size`` times the shortest training example."""
    shortest = min(len(ids) for ids in train_data.ids)
    batch = config.batch_size
    device = torch.device(config.device) if config.device else default_device()
    needed = training_bytes(model, batch, shortest)["total"]
    given = "the run's stored --batch-size" if resumed else "--batch-size"
    check_fits(needed, f"{given} {batch} (batches of at least {batch:,} x {shortest} tokens, {settings['base']} "
                       f"with rank-{settings['rank']} adapters)", device=device,
               advice="resume it on a machine with more memory" if resumed else "choose a smaller --batch-size")


def _prepare(args, out: Path):
    """``(model, tokenizer, settings, train_config, data, test_pairs, announce)`` of a new or resumed run."""
    if args.resume:
        given = [f"--{k.replace('_', '-')}" for k in _SETTING_FLAGS if getattr(args, k) not in (None, False)]
        if given:
            raise ValueError(f"--resume continues with the stored settings; do not give {', '.join(given)}")
        ckpt, settings = read_finetune_run(out, "--resume")
    else:
        if (out / CHECKPOINT_NAME).exists():
            raise ValueError(f"{out / CHECKPOINT_NAME} exists: add --resume to continue it, or choose another --out")
        settings = _settings_from_args(args, out)
    train_pairs, val_pairs, test_pairs, digest = _task_pairs(settings, out)
    if args.resume and digest != settings.get("data_sha256"):
        raise ValueError(f"--resume: the --data file {settings['data_file']} changed since the run started; resuming "
                         "needs the same examples")
    settings["data_sha256"] = digest
    try:
        train_config = TrainConfig(**settings["train"], out_dir=str(out), resume=args.resume, device=args.device,
                                   progress=not args.no_progress)
    except (ValueError, TypeError) as err:
        raise ValueError(_in_flags(str(err))) from None
    model, tokenizer = load_base(settings["base"])
    if settings["context"] > model.config.context_length:
        raise ValueError(f"--context {settings['context']} exceeds the context length of {settings['base']}, "
                         f"{model.config.context_length} tokens")
    if args.resume:
        _check_base(ckpt, model, "--resume", out)
    data = _encode(tokenizer, settings, train_pairs, val_pairs)
    _attach(model, settings)
    _check_memory(model, settings, train_config, data[0], resumed=args.resume)
    what = "the dates task" if settings["task"] == "dates" else f"--data {settings['data_file']}"
    announce = (f"resuming {out} at step {ckpt['step']} of {train_config.max_steps}" if args.resume else
                f"fine-tuning {settings['base']} ({count_parameters(model) / 1e6:.1f} M parameters, frozen) with "
                f"rank-{settings['rank']} adapters on {' '.join(settings['targets'])} "
                f"({count_parameters(model, trainable_only=True):,} trainable) on {what}: {len(train_pairs):,} "
                f"training examples, {train_config.max_steps} steps of {train_config.batch_size}; run folder {out}")
    return model, tokenizer, settings, train_config, data, test_pairs, announce


def finetune_command(args) -> int:
    from groundup.instructions import exact_match_eval, instruction_batches

    out = Path(args.out).expanduser()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        with run_lock(out, command="finetune"):  # on the way out: no lock left, and no folder it made for nothing
            model, tokenizer, settings, config, (train_data, val_data), test_pairs, announce = _prepare(args, out)
            print(announce, flush=True)
            history = train(model, train_data, val_data, config, extra={"finetune": settings},
                            batches=instruction_batches)
            start = time.perf_counter()
            score, predictions = exact_match_eval(model, tokenizer, test_pairs,
                                                  max_new_tokens=FINETUNE_DEFAULTS["max_new_tokens"],
                                                  progress=not args.no_progress)
            answering = time.perf_counter() - start
    except KeyboardInterrupt as stop:
        print(f"\n{interrupted_message(stop, out, 'finetune')}", file=sys.stderr)
        return 130
    except (ValueError, TypeError, OSError) as err:
        print(f"error: {describe_error(err)}", file=sys.stderr)
        return 1
    for (prompt, answer), predicted in list(zip(test_pairs, predictions))[:3]:
        shown = prompt.rsplit(": ", 1)[-1] if settings["task"] == "dates" else prompt  # the date in words
        print(f"  {shown if len(shown) <= 60 else '...' + shown[-57:]!r} -> {predicted!r} (expected {answer!r})")
    per_step = history.seconds[-1] / history.step[-1] if history.seconds else math.nan  # evaluations left out
    print(f"done: step {history.step[-1]}, training loss {history.train_loss[-1]:.4f}, validation loss "
          f"{history.val_loss[-1]:.4f} nats per {'answer ' if settings['mask_prompt'] else ''}token; held-out exact "
          f"match {score:.1%} of {len(test_pairs)} (greedy decoding, {answering:.0f} s); {per_step:.2f} s per "
          f"training step; adapters in {out / CHECKPOINT_NAME}; ask with: groundup sample --pretrained "
          f"{settings['base']} --adapter {out} --chat --greedy --prompt \"{test_pairs[0][0]}\"")
    return 0
