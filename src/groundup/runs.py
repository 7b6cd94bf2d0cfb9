"""Training runs from the shell: ``groundup train`` (``groundup sample`` reads its run folders: groundup.sampling).

A run folder holds what training writes and sampling reads::

    run/checkpoint.pt    model, optimizer, schedule, random states, step, configs, history (see groundup.training)
    run/history.json     the loss curves as plain JSON, for plotting
    run/tokenizer.json   the character tokenizer the model's ids belong to
                         (a --task dates run: source_tokenizer.json and target_tokenizer.json instead)

``groundup train`` defaults to the book's CPU recipe (chapter 7): a 4-layer GPT with rotary positions on
characters, Muon for the blocks' weight matrices and AdamW for the rest, with warm-up and cosine decay. ``--resume``
continues an interrupted run exactly.
``--objective masked`` trains a masked language model (chapter 9) of the same shape instead: a bidirectional
encoder fed BERT-masked windows (the tokenizer's characters plus one [MASK] id). It is not a generator, so
``groundup sample`` refuses such a run.
``--task dates`` trains chapter 10's encoder-decoder on the package's dates task (dates in words to ISO 8601, the
data of :func:`groundup.seq2seq.date_splits`) instead of a language model on a text, and prints its held-out
exact-match accuracy at the end; ``groundup sample`` translates a ``--prompt`` with such a run (greedy decoding).

Each kind of run is one :class:`Task` in ``TASKS``: its recipe and its functions that configure, start, resume,
evaluate and report a run. Below: the shared pieces, the text task's functions, the dates task's functions, the table,
then what every run goes through (configurations, resuming, ``train_command``) and the argument parser.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from groundup import flags
from groundup.data import CORPORA, load_corpus, train_val_split
from groundup.footprint import check_fits, config_training_bytes, parameter_count
from groundup.masking import BERT_RATE, masked_lm_batches
from groundup.models import (
    ENCODER_DECODER_POSITIONALS,
    GPT,
    POSITIONALS,
    EncoderDecoder,
    EncoderDecoderConfig,
    GPTConfig,
    MaskedLM,
    MaskedLMConfig,
)
from groundup.run_folder import LOCKED_ENV, describe_error, interrupted_message, remove_if_unused, run_lock
from groundup.seq2seq import (
    Seq2SeqTokenizer,
    collate,
    date_splits,
    date_tokenizers,
    encode_pairs,
    exact_match,
    greedy_decode,
)
from groundup.seq2seq import batches as seq2seq_batches
from groundup.tokenizers import CharTokenizer
from groundup.training import (
    CHECKPOINT_NAME,
    OPTIMIZERS,
    TrainConfig,
    check_random_states,
    load_checkpoint,
    read_checkpoint,
    train,
)
from groundup.utils import default_device

TOKENIZER_NAME = "tokenizer.json"
SOURCE_TOKENIZER_NAME, TARGET_TOKENIZER_NAME = "source_tokenizer.json", "target_tokenizer.json"

# The CPU recipe (chapter 7 shows the search that chose it, tools/recipe_trial.py ran it): Muon for the blocks'
# matrices, AdamW for the rest; 4000 steps are about ten minutes of training on a 2-core laptop CPU; --max-tokens
# and --minutes give other budgets.
RECIPE_MODEL = dict(context_length=128, d_model=192, n_layers=4, n_heads=6, positional="rope", dropout=0.0)
RECIPE_TRAINING = dict(batch_size=8, max_steps=4000, learning_rate=2e-3, warmup_steps=50, weight_decay=0.1,
                       optimizer="muon", grad_clip=1.0, eval_interval=250, eval_batches=20)

# --task dates: chapter 10's encoder-decoder and its training, seed 0 of the chapter (n_layers blocks in the encoder
# and as many in the decoder; d_FFN = 2 d_M; Pre-LN; tied target embedding). About 20 s on one CPU thread.
DATES_MODEL = dict(context_length=16, d_model=64, n_layers=2, n_heads=4, positional="sinusoidal", dropout=0.0)
DATES_TRAINING = dict(batch_size=64, max_steps=400, learning_rate=3e-3, warmup_steps=50, weight_decay=0.01,
                      optimizer="adamw", grad_clip=1.0, eval_interval=50, eval_batches=4)
DATES_EXAMPLE = "the first of may, nineteen ninety"

MAX_TEXT_BYTES = 100 * 10**6
"""The largest --text file read (100 MB, 20 times the book's corpus): a character model's ids take 8 bytes per
character and a Python list of them 8 more, so this bounds what reading a file can cost (--text /dev/zero stops
here instead of filling the memory)."""
POSITIVE = flags.integer(1)


@dataclasses.dataclass
class _Run:
    """Everything a training session needs, made ready (and checked) before any training starts."""

    task: Task
    out: Path
    model: torch.nn.Module
    train_data: object
    val_data: object
    train_config: TrainConfig
    extra: dict
    batches: object = None
    announce: str = ""
    held_out: tuple | None = None  # what the task's evaluate needs: a dates run's (src_tok, tgt_tok, test_pairs)


@dataclasses.dataclass(frozen=True)
class Task:
    """One kind of run ``groundup train`` makes: the one place that knows it (``TASKS`` lists them).

    ``recipe``: the defaults of the model and training flags (RECIPE_MODEL's and RECIPE_TRAINING's keys);
    ``model_config(pick, vocab_size)``: the model's configuration, ``pick(flag, key)`` being the flag's value or the
    recipe's; ``new(args, out)``: a new run; ``resume(args, out, model, ckpt)``: the run of a checkpoint whose model
    is one of ``models``; ``evaluate(run)``: what is measured after training, inside the run folder's lock (None if
    nothing); ``done(run, history, evaluated, minutes)``: the last line printed. ``help``: --task's help for it
    (the default task, which has no --task, has none). ``smallest_vocab``: the smallest ``vocab_size`` argument of
    ``model_config`` its configuration accepts, for the size check made before any data is read."""

    name: str
    help: str | None
    models: tuple[type, ...]
    recipe: dict
    model_config: Callable
    new: Callable
    resume: Callable
    evaluate: Callable
    done: Callable
    smallest_vocab: object = 1


# --- the text task (the default: no --task): a GPT, or with --objective masked a MaskedLM, on a text -------------

def _read_text(path: Path, flag: str = "--text") -> str:
    """A UTF-8 text file of at most MAX_TEXT_BYTES, with errors that name ``flag`` and the file."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_TEXT_BYTES + 1)  # a device (/dev/zero) or a pipe too: never more than the bound
    except OSError as err:
        raise ValueError(f"cannot read {flag} {path}: {err.strerror or err}") from None
    if len(data) > MAX_TEXT_BYTES:
        raise ValueError(f"{flag} {path} is larger than {MAX_TEXT_BYTES // 10**6} MB, the most groundup train reads "
                         "(a character model of a larger text would need more memory than its ids are worth): give "
                         "a part of it")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{flag} {path} is not UTF-8 text (byte {err.start}: {err.reason})") from None
    if not text:
        raise ValueError(f"{flag} {path} is empty: give a file with some text to train on")
    return text


def _text_and_source(args, out: Path | None = None) -> tuple[str, dict]:
    """The training text and where it came from. A file is stored with its absolute path (a run resumes from any
    folder) and its path relative to the run folder ``out`` (a run still resumes after the run folder and the text
    moved together)."""
    if args.text:
        path = Path(args.text).expanduser().absolute()
        text = _read_text(path)
        source = {"text_file": str(path)}
        if out is not None:
            source["text_file_from_run"] = os.path.relpath(path, out.absolute())
    else:
        text = load_corpus(args.corpus)
        source = {"corpus": args.corpus}
    source["sha256"] = hashlib.sha256(text.encode("utf-8")).hexdigest()
    return text, source


def _stored_text_file(source: dict, out: Path) -> str | None:
    """The --text file a run was trained on: its stored path if it is there, else the path stored relative to the
    run folder (both moved), else the stored path (whose error names it)."""
    path = source.get("text_file")
    if path is None or Path(path).is_file():
        return path
    relative = source.get("text_file_from_run")
    if isinstance(relative, str) and (out / relative).is_file():
        return str(out / relative)
    return path


def _masked_batches(model, rate: float):
    """The batches function of a masked-LM run (None for a GPT): BERT masking at ``rate``."""
    if not isinstance(model, MaskedLM):
        return None
    return masked_lm_batches(model.config.mask_token_id, model.config.vocab_size, rate=rate)


def _text_model_config(pick, vocab_size: int) -> GPTConfig:
    """A language model's configuration, a GPT's (a masked LM's is made from it: see :func:`_new_text_run`)."""
    return GPTConfig(vocab_size=vocab_size, context_length=pick("context", "context_length"),
                     d_model=pick("d_model", "d_model"), n_layers=pick("layers", "n_layers"),
                     n_heads=pick("heads", "n_heads"), positional=pick("positional", "positional"),
                     dropout=pick("dropout", "dropout"))


def _new_text_run(args, out: Path) -> _Run:
    """A new language-model run (a GPT, or with --objective masked a masked LM) on a corpus or a --text file."""
    masked = args.objective == "masked"
    if args.mask_rate is not None and not masked:
        raise ValueError("--mask-rate is for masked language models: add --objective masked")
    mask_rate = BERT_RATE if args.mask_rate is None else args.mask_rate
    text, source = _text_and_source(args, out)
    tokenizer = CharTokenizer.from_text(text)
    # a masked LM's vocabulary is the tokenizer's characters plus [MASK], the last id
    model_config, train_config = _configs_from_args(args, tokenizer.vocab_size + masked)
    cls = MaskedLM if masked else GPT
    if masked:
        model_config = MaskedLMConfig(**dataclasses.asdict(model_config))
        masked_lm_batches(tokenizer.vocab_size, tokenizer.vocab_size + 1, rate=mask_rate)  # checks the rate
    _check_training_size(args, model_config, train_config)
    where = f"--text {args.text}" if args.text else f"--corpus {args.corpus}"
    try:
        train_data, val_data = train_val_split(torch.tensor(tokenizer.encode(text), dtype=torch.long), 0.1)
    except ValueError:  # a part would be empty
        raise ValueError(f"{where} has {len(text)} character{'s' if len(text) > 1 else ''}: too few to keep a tenth "
                         "for validation; give a longer text") from None
    if args.objective != "masked" and len(val_data) <= model_config.context_length:
        raise ValueError(f"{where} has {len(text):,} characters: too few for --context "
                         f"{model_config.context_length}, since the validation tenth needs more than one window; give "
                         f"a longer text or at most --context {max(len(val_data) - 1, 1)}")
    torch.manual_seed(train_config.seed)
    model = cls(model_config)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(out / TOKENIZER_NAME)
    n_params = sum(p.numel() for p in model.parameters())
    what = "masked language model (BERT masking)" if masked else "GPT"
    announce = (f"training a {n_params / 1e6:.2f} M-parameter {what} on {len(text):,} characters "
                f"({tokenizer.vocab_size} distinct) for {_steps(train_config)} of {train_config.batch_size} x "
                f"{model_config.context_length} tokens; run folder {out}")
    return _Run(TASKS["text"], out, model, train_data, val_data, train_config,
                {"source": source, "mask_rate": mask_rate}, _masked_batches(model, mask_rate), announce)


def _resume_text_run(args, out: Path, model, ckpt: dict) -> _Run:
    """A language-model run from its checkpoint: the same text (checked by its hash), tokenizer and masking."""
    extra = ckpt.get("extra", {})
    source = extra.get("source", {})
    if not isinstance(source, dict):
        raise ValueError(f"{out / CHECKPOINT_NAME} holds no training settings to resume with")
    args.corpus, args.text = source.get("corpus", "shakespeare"), _stored_text_file(source, out)
    try:
        text, now = _text_and_source(args)
    except ValueError as err:
        raise ValueError(f"{err} (the run in {out} was trained on it; resuming needs it)") from None
    if now["sha256"] != source.get("sha256"):
        raise ValueError("the training text changed since the run started; resume needs the same text")
    tokenizer = CharTokenizer.load(out / TOKENIZER_NAME)
    batches = _masked_batches(model, extra.get("mask_rate", BERT_RATE))
    train_data, val_data = train_val_split(torch.tensor(tokenizer.encode(text), dtype=torch.long), 0.1)
    return _continued(TASKS["text"], args, out, model, ckpt, train_data, val_data, batches)


def _no_evaluation(run: _Run) -> None:
    """A language model's run measures nothing after training: its validation loss is in the history."""
    return None


def _text_done(run: _Run, history, evaluated: None, minutes: float) -> str:
    """A language-model run's last line: its validation loss (in nats and bits per character) and what next."""
    val, out = history.val_loss[-1], run.out
    then = (f"sample with: groundup sample {out}" if not isinstance(run.model, MaskedLM) else
            f"a masked language model (not a generator): load it with groundup.training.load_checkpoint('{out}')")
    where = "at masked positions " if isinstance(run.model, MaskedLM) else ""
    return (f"done: step {history.step[-1]}, validation loss {where}{val:.4f} nats ({val / math.log(2):.3f} bits per "
            f"character), {history.tokens[-1]:,} training tokens, {minutes:.1f} minutes this session; {then}")


# --- the dates task (--task dates): chapter 10's EncoderDecoder translating dates in words to ISO 8601 ---------------

_DATES_HELP = (
    f"instead of a language model on a text, train chapter 10's encoder-decoder (EncoderDecoder) to "
    f"translate dates in words to ISO 8601 (\"{DATES_EXAMPLE}\" -> 1990-05-01) on the package's generated "
    f"data, and print its held-out exact-match accuracy (greedy decoding) at the end; then 'groundup sample "
    f"DIR --prompt ...' translates. --layers sets the encoder's and the decoder's blocks each; --objective, "
    f"--mask-rate and --max-tokens do not apply. Defaults: the chapter's run, "
    + ", ".join(f"{k} {v}" for k, v in {**DATES_MODEL, **DATES_TRAINING}.items()))


def _dates_model_config(pick, vocab_sizes: tuple[int, int]) -> EncoderDecoderConfig:
    """The encoder-decoder's configuration for (source, target) vocabularies: --layers blocks in the encoder and as
    many in the decoder; d_FFN = 2 d_M; Pre-LN."""
    layers = pick("layers", "n_layers")
    return EncoderDecoderConfig(
        src_vocab_size=vocab_sizes[0], tgt_vocab_size=vocab_sizes[1],
        context_length=pick("context", "context_length"),
        d_model=pick("d_model", "d_model"), d_ff=2 * pick("d_model", "d_model"), n_encoder_layers=layers,
        n_decoder_layers=layers, n_heads=pick("heads", "n_heads"), positional=pick("positional", "positional"),
        dropout=pick("dropout", "dropout"), norm_position="pre")


def _dates_data():
    """The dates task's tokenizers and data: ``(src_tok, tgt_tok, train_data, val_data, test_pairs)``."""
    src_tok, tgt_tok = date_tokenizers()
    train_pairs, val_pairs, test_pairs = date_splits()
    return src_tok, tgt_tok, encode_pairs(train_pairs, src_tok, tgt_tok), encode_pairs(val_pairs, src_tok, tgt_tok), \
        test_pairs


def load_dates_tokenizers(folder: Path, model: EncoderDecoder) -> tuple[Seq2SeqTokenizer, Seq2SeqTokenizer]:
    """A dates run's (source, target) tokenizers, checked against its model."""
    pair = []
    for name, size in ((SOURCE_TOKENIZER_NAME, model.config.src_vocab_size),
                       (TARGET_TOKENIZER_NAME, model.config.tgt_vocab_size)):
        tokenizer = Seq2SeqTokenizer.load(folder / name)
        if tokenizer.vocab_size != size:
            raise ValueError(f"{folder / name} has {tokenizer.vocab_size} tokens but the model {size}: the folder "
                             "mixes two runs")
        pair.append(tokenizer)
    return pair[0], pair[1]


def _check_dates_options(args) -> None:
    """Options that make no sense with --task dates: a clear error naming them."""
    given = [flag for flag, value in (("--objective", args.objective), ("--mask-rate", args.mask_rate),
                                      ("--max-tokens", args.max_tokens)) if value is not None]
    if given:
        raise ValueError(f"--task dates trains an encoder-decoder on generated dates: {' and '.join(given)} "
                         f"{'does' if len(given) == 1 else 'do'} not apply (--objective and --mask-rate are for "
                         "language models on a text; give --max-steps or --minutes for the length of the run)")
    if args.positional is not None and args.positional not in ENCODER_DECODER_POSITIONALS:
        raise ValueError(f"--positional {args.positional} is not available with --task dates: the encoder-decoder "
                         f"adds absolute positions, one of {', '.join(ENCODER_DECODER_POSITIONALS)}")
    if args.eval_batches == 0:
        raise ValueError("--task dates evaluates on a fixed number of validation batches: give --eval-batches "
                         "1 or more (0, the whole validation set, is for text runs)")


def _new_dates_run(args, out: Path) -> _Run:
    """A new --task dates run: chapter 10's encoder-decoder on the dates task."""
    _check_dates_options(args)
    src_tok, tgt_tok, train_data, val_data, test_pairs = _dates_data()
    model_config, train_config = _configs_from_args(args, (src_tok.vocab_size, tgt_tok.vocab_size))
    longest = max(max(map(len, data.src + data.tgt)) for data in (train_data, val_data)) + 1
    if model_config.context_length < longest:
        raise ValueError(f"--context {model_config.context_length} is too short for --task dates: its "
                         f"sources and decoder inputs have up to {longest} tokens")
    _check_training_size(args, model_config, train_config)
    torch.manual_seed(train_config.seed)
    model = EncoderDecoder(model_config)
    out.mkdir(parents=True, exist_ok=True)
    src_tok.save(out / SOURCE_TOKENIZER_NAME)
    tgt_tok.save(out / TARGET_TOKENIZER_NAME)
    n_params = sum(p.numel() for p in model.parameters())
    announce = (f"training a {n_params / 1e3:.0f} k-parameter encoder-decoder on the dates task ({len(train_data):,} "
                f"training and {len(val_data)} validation examples; {len(test_pairs):,} held-out test dates) for "
                f"{_steps(train_config)} of {train_config.batch_size} examples; run folder {out}")
    return _Run(TASKS["dates"], out, model, train_data, val_data, train_config, {"task": "dates"}, seq2seq_batches,
                announce, held_out=(src_tok, tgt_tok, test_pairs))


def _resume_dates_run(args, out: Path, model, ckpt: dict) -> _Run:
    """A dates run from its checkpoint (one written by --task dates), with the package's dates data."""
    if ckpt.get("extra", {}).get("task") != "dates":
        raise ValueError(f"{out / CHECKPOINT_NAME} holds an encoder-decoder that was not trained by "
                         "'groundup train --task dates': resume it from Python")
    src_tok, tgt_tok, train_data, val_data, test_pairs = _dates_data()
    if (src_tok, tgt_tok) != load_dates_tokenizers(out, model):
        raise ValueError("the dates task's vocabularies changed since the run started; resume needs the "
                         "same package version")
    return _continued(TASKS["dates"], args, out, model, ckpt, train_data, val_data, seq2seq_batches,
                      held_out=(src_tok, tgt_tok, test_pairs))


def _held_out_exact_match(run: _Run) -> float:
    """Greedy decoding of every test source; the fraction written exactly right."""
    model, (src_tok, tgt_tok, test_pairs) = run.model, run.held_out
    device = next(model.parameters()).device
    src = collate([src_tok.encode(s) for s, _ in test_pairs]).to(device)
    predictions = [tgt_tok.decode(p) for p in greedy_decode(model, src)]
    return exact_match(predictions, [t for _, t in test_pairs])


def _dates_done(run: _Run, history, accuracy: float, minutes: float) -> str:
    """A dates run's last line: its validation loss, its held-out exact match, and how to translate with it."""
    val, test_pairs = history.val_loss[-1], run.held_out[2]
    return (f"done: step {history.step[-1]}, validation loss {val:.4f} nats per target token, "
            f"{history.step[-1] * run.train_config.batch_size:,} training examples drawn, {minutes:.1f} minutes this "
            f"session; held-out exact match {accuracy:.1%} of {len(test_pairs):,} test dates (greedy decoding); "
            f"translate with: groundup sample {run.out} --prompt \"{DATES_EXAMPLE}\"")


# --- the table: a new task is one more entry (and its functions above) ---------------------------------------------

TASKS = {
    "text": Task(name="text", help=None, models=(GPT, MaskedLM), recipe={**RECIPE_MODEL, **RECIPE_TRAINING},
                 model_config=_text_model_config, new=_new_text_run, resume=_resume_text_run,
                 evaluate=_no_evaluation, done=_text_done),
    "dates": Task(name="dates", help=_DATES_HELP, models=(EncoderDecoder,), recipe={**DATES_MODEL, **DATES_TRAINING},
                  model_config=_dates_model_config, new=_new_dates_run, resume=_resume_dates_run,
                  evaluate=_held_out_exact_match, done=_dates_done,
                  smallest_vocab=(1, 3)),  # the source holds pad_id 0, the target pad, start and end (0, 1, 2)
}
DEFAULT_TASK = "text"
"""The task of a run without --task."""


def _task_of_args(args) -> Task:
    """The task the command line asks for: --task, or the default."""
    return TASKS[args.task or DEFAULT_TASK]


def _task_holding(model, path: Path) -> Task:
    """The task whose runs hold ``model``'s kind of model (each of the book's models belongs to one task)."""
    for task in TASKS.values():
        if isinstance(model, task.models):
            return task
    raise ValueError(f"{path} holds a {type(model).__name__}, which groundup train does not train: resume it from "
                     "Python")


# --- every run: configurations from the flags, resuming, training ---------------------------------------------------

# the configurations' field names and the flags that set them, for messages in the words the user typed
_FLAG_OF_FIELD = {"context_length": "--context", "d_model": "--d-model", "n_layers": "--layers", "n_heads": "--heads",
                  "positional": "--positional", "dropout": "--dropout", "batch_size": "--batch-size",
                  "max_steps": "--max-steps", "learning_rate": "--lr", "min_lr": "--min-lr",
                  "warmup_steps": "--warmup", "weight_decay": "--weight-decay", "grad_clip": "--grad-clip",
                  "eval_interval": "--eval-interval", "eval_batches": "--eval-batches", "seed": "--seed",
                  "time_budget": "--minutes (in seconds)", "optimizer": "--optimizer"}


def _in_flags(message: str) -> str:
    """``message`` with the configurations' field names replaced by the flags that set them."""
    pattern = r"(?<![\w-])(" + "|".join(_FLAG_OF_FIELD) + r")(?!\w)"
    return re.sub(pattern, lambda m: _FLAG_OF_FIELD[m.group(1)], message)


def _configs_from_args(args, vocab_size: int | tuple[int, int]
                       ) -> tuple[GPTConfig | EncoderDecoderConfig, TrainConfig]:
    """The recipe of the run's task, with every option the user gave in its place, for a model of ``vocab_size``
    tokens (the dates task's: (source, target) sizes). A setting the configurations refuse (--d-model not divisible
    by --heads, say) is a ``ValueError`` that names the flags."""
    try:
        return _build_configs(args, vocab_size)
    except ValueError as err:
        raise ValueError(_in_flags(str(err))) from None


def _build_configs(args, vocab_size: int | tuple[int, int]) -> tuple[GPTConfig | EncoderDecoderConfig, TrainConfig]:
    """:func:`_configs_from_args` before its errors are put in the flags' words."""
    task = _task_of_args(args)

    def pick(flag: str, key: str):
        value = getattr(args, flag)
        return task.recipe[key] if value is None else value

    model_config = task.model_config(pick, vocab_size)
    batch_size = pick("batch_size", "batch_size")
    max_steps = pick("max_steps", "max_steps")
    if args.minutes is not None:
        max_steps = 10**9  # the time budget ends the run
    if args.max_tokens is not None:
        max_steps = max(1, args.max_tokens // (batch_size * model_config.context_length))  # never over the budget
    train_config = TrainConfig(
        batch_size=batch_size, max_steps=max_steps, learning_rate=pick("lr", "learning_rate"), min_lr=args.min_lr,
        warmup_steps=min(pick("warmup", "warmup_steps"), max_steps), weight_decay=pick("weight_decay", "weight_decay"),
        optimizer=pick("optimizer", "optimizer"),
        grad_clip=pick("grad_clip", "grad_clip") or None,
        eval_interval=min(pick("eval_interval", "eval_interval"), max_steps),
        eval_batches=pick("eval_batches", "eval_batches") or None, out_dir=args.out,
        time_budget=None if args.minutes is None else args.minutes * 60,
        seed=0 if args.seed is None else args.seed, device=args.device, progress=not args.no_progress)
    return model_config, train_config


def _steps(config: TrainConfig) -> str:
    """How long a run lasts, as the user asked: a number of steps, or --minutes."""
    if config.time_budget is not None:
        return f"{config.time_budget / 60:g} minutes (--minutes)"
    return f"{config.max_steps} steps"


_SIZE_FLAGS = ("d_model", "layers", "context", "heads", "batch_size", "positional")
PROCESS_BYTES = 200 * 10**6
"""A lower bound on what one more Python process with PyTorch loaded takes before any model (measured: about
230 MB resident on Linux), counted for each process of ``--nproc``."""


def _check_training_size(args, model_config, train_config, *, vocabulary_known: bool = True) -> None:
    """Refuse a model too large to train here before it is built, naming the flags: its sizes are counted from the
    configuration alone (groundup.footprint), so --layers 100000 is refused as fast as --layers 4 is accepted.
    ``vocabulary_known=False``: the check from the flags before the data is read, with the smallest vocabulary the
    task's model can have (:func:`_refuse_absurd_sizes`); its parameter count is then a lower one."""
    needed = config_training_bytes(model_config, train_config.batch_size, model_config.context_length)
    nproc = getattr(args, "nproc", None) or 1
    device = torch.device(train_config.device) if train_config.device else default_device()
    cpu = device.type == "cpu"
    copies = nproc if cpu else 1  # every process holds a copy; on GPUs each its own GPU
    given = " ".join(f"--{k.replace('_', '-')} {getattr(args, k)}" for k in _SIZE_FLAGS
                     if getattr(args, k, None) is not None)
    n_params = parameter_count(model_config)
    what = (f"training this model ({'' if vocabulary_known else 'at least '}{n_params:,} parameters"
            f"{'; ' + given if given else ''}"
            f"{f'; {nproc} processes' if copies > 1 else ''})")
    advice = "choose smaller values" if given else "choose a smaller --d-model, --layers, --context or --batch-size"
    if copies > 1:
        advice += " or fewer processes (--nproc)"
    # One layer's attention weights, batch x n_H x n_C^2 float32 numbers: what the written-out attention (chapter 5)
    # holds; the fused kernel training uses does not keep them all, but computes every one, so this is the bound
    # that stops a --context whose steps would never end (100,000 with the defaults: 1.9 TB) before anything starts.
    attention = 4 * train_config.batch_size * model_config.n_heads * model_config.context_length ** 2
    per_process = needed["total"] + attention + (PROCESS_BYTES if nproc > 1 else 0)
    check_fits(per_process * copies, what, device=device, advice=advice)


def _refuse_absurd_sizes(args) -> None:
    """The size check of a new run from its flags alone, before its folder is created (locked) or any data is read:
    --layers 100000 is refused at once, and leaves nothing behind. The vocabulary is not known yet, so the model's is
    taken as small as the task's model allows (a lower estimate: what this refuses, the check with the real
    vocabulary would refuse too). Settings the configurations refuse are left to the run's own preparation, which
    reports them in its order."""
    if args.resume:
        return
    task = _task_of_args(args)
    try:
        model_config, train_config = _configs_from_args(args, task.smallest_vocab)
    except ValueError:
        return
    _check_training_size(args, model_config, train_config, vocabulary_known=False)


def _continued(task: Task, args, out: Path, model, ckpt: dict, train_data, val_data, batches,
               held_out: tuple | None = None) -> _Run:
    """A resumed run of ``task``: the checkpoint's training settings with this session's --no-progress and
    --device, its size checked."""
    train_config = TrainConfig(**{**ckpt["train_config"], "resume": True, "out_dir": str(out),
                                  "progress": not args.no_progress, "device": args.device})
    _check_training_size(args, model.config, train_config)
    return _Run(task, out, model, train_data, val_data, train_config, ckpt.get("extra", {}), batches,
                announce=f"resuming {out} at step {ckpt['step']} of {train_config.max_steps}", held_out=held_out)


def _resumed_run(args, out: Path) -> _Run:
    """The run in ``out``, ready to continue with its stored settings (its task's ``resume`` reads its data)."""
    given = [f"--{k.replace('_', '-')}" for k in _MODEL_AND_TRAINING_FLAGS if getattr(args, k) is not None]
    if given:
        raise ValueError(f"--resume continues with the stored settings; do not give {', '.join(given)}")
    if read_checkpoint(out / CHECKPOINT_NAME).get("adapters_only"):
        raise ValueError(f"{out} holds LoRA adapters (a groundup finetune run): continue it with groundup finetune "
                         f"--out {out} --resume")
    model, ckpt = load_checkpoint(out / CHECKPOINT_NAME)
    stored, extra = ckpt.get("train_config"), ckpt.get("extra", {})
    if not isinstance(stored, dict) or not isinstance(extra, dict):
        raise ValueError(f"{out / CHECKPOINT_NAME} holds no training settings to resume with")
    check_random_states(ckpt, out / CHECKPOINT_NAME)
    return _task_holding(model, out / CHECKPOINT_NAME).resume(args, out, model, ckpt)


def _prepare(args, out: Path) -> _Run:
    """The run to train in ``out``: resumed, or new (after checking that ``out`` holds none)."""
    if args.resume:
        return _resumed_run(args, out)
    if (out / CHECKPOINT_NAME).exists():
        raise ValueError(f"{out / CHECKPOINT_NAME} exists: add --resume to continue it, or choose another --out")
    return _task_of_args(args).new(args, out)


def train_command(args) -> int:
    """``groundup train``: prepare the run, train it, print its task's last line; the exit status (1 after an
    error, 130 after Ctrl-C)."""
    if not args.out.strip():
        print("error: --out is empty: give a folder for the run (it is created if need be)", file=sys.stderr)
        return 1
    out = Path(args.out).expanduser()
    args.out = str(out)
    if args.threads:
        torch.set_num_threads(args.threads)
    problem = _parallel_problem(args)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 1
    from groundup.distributed import rank_and_world

    distributed = _parallel_options(args)["distributed"]
    rank = rank_and_world()[0]
    try:
        _refuse_absurd_sizes(args)
    except ValueError as err:
        print(f"error: {describe_error(err)}", file=sys.stderr)
        return 1
    created = not out.exists()
    try:
        with run_lock(out, distributed, rank):
            run = _prepare(args, out)
            _check_split(args, run.train_config)
            if not distributed and (args.nproc or 1) > 1:  # --nproc N: this command in N processes (chapter 11)
                del run
                return _launch(args, out)
            print(run.announce, flush=True)
            started = time.perf_counter()
            history = train(run.model, run.train_data, run.val_data, run.train_config, extra=run.extra,
                            batches=run.batches, **_parallel_options(args))
            evaluated = run.task.evaluate(run)
    except KeyboardInterrupt as stop:
        if rank == 0:
            print(f"\n{interrupted_message(stop, out)}", file=sys.stderr)
        remove_if_unused(out, created)
        return 130
    except (ValueError, TypeError, OSError) as err:
        print(f"error: {describe_error(err)}", file=sys.stderr)
        remove_if_unused(out, created)
        return 1
    minutes = (time.perf_counter() - started) / 60
    print(run.task.done(run, history, evaluated, minutes))
    return 0


def _parallel_options(args) -> dict:
    """train's data-parallel options (chapter 11): distributed inside torchrun's processes, --accumulate."""
    return {"distributed": torch.distributed.is_available() and torch.distributed.is_initialized(),
            "accumulate": getattr(args, "accumulate", None) or 1}


def _parallel_problem(args) -> str | None:
    """What is wrong with ``--nproc`` / ``--accumulate`` here, or None."""
    from groundup.distributed import rank_and_world

    nproc = getattr(args, "nproc", None)
    for flag, value in (("--nproc", nproc), ("--accumulate", getattr(args, "accumulate", None))):
        if value is not None and value < 1:
            return f"{flag} must be a positive integer, got {value}"
    if _parallel_options(args)["distributed"]:
        world = rank_and_world()[1]
        if nproc is not None and nproc != world:
            return f"--nproc {nproc}, but torchrun started {world} processes"
    elif (nproc or 1) > 1:
        if "train" not in (getattr(args, "argv", None) or []):
            return "--nproc needs the command line it was given (run groundup train from a shell)"
        if getattr(args, "minutes", None) is not None:
            return (f"--minutes cannot be used with --nproc {nproc}: the processes' clocks would disagree about the "
                    "schedule and the end; give --max-steps or --max-tokens")
    return None


def _check_split(args, config: TrainConfig) -> None:
    """The batch must cut into equal micro-batches: processes x accumulation steps must divide it."""
    from groundup.distributed import rank_and_world

    world = rank_and_world()[1] if _parallel_options(args)["distributed"] else getattr(args, "nproc", None) or 1
    accumulate = getattr(args, "accumulate", None) or 1
    if config.batch_size % (world * accumulate):
        raise ValueError(f"the batch of {config.batch_size} windows (--batch-size) must be divisible by --nproc x "
                         f"--accumulate = {world} x {accumulate}: every micro-batch holds the same number of rows")


def _launch(args, out: Path) -> int:
    """Run this command in ``--nproc`` processes started by torchrun, which this process waits for while it holds
    the run folder's lock for them; their exit status (130 after Ctrl-C, forwarded to them: see
    :func:`groundup.distributed.launch`)."""
    from groundup.distributed import launch

    argv = list(args.argv)
    argv = argv[argv.index("train") + 1:]
    # the processes need no --nproc (torchrun's own parser would even take it for its --nproc-per-node)
    keep = [a for i, a in enumerate(argv) if not (a == "--nproc" or a.startswith("--nproc=")
                                                  or (i > 0 and argv[i - 1] == "--nproc"))]
    return launch(args.nproc, keep, env={LOCKED_ENV: str(out.absolute())})


# --- the command line ----------------------------------------------------------------------------------------------

def _recipe(key: str) -> str:
    """A flag's help's tail: its default, the text task's recipe."""
    return f" (recipe: {TASKS[DEFAULT_TASK].recipe[key]})"


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
    p.add_argument("--mask-rate", type=flags.number(0, 1, low_open=True),
                   help=f"--objective masked: fraction of positions to predict "
                   f"(default: {BERT_RATE}; of those 80 %% [MASK], 10 %% random, 10 %% unchanged)")
    source = p.add_mutually_exclusive_group()
    source.add_argument("--corpus", choices=sorted(CORPORA), default="shakespeare",
                        help="a named corpus: shakespeare (Project Gutenberg's Shakespeare, 42 works, 5.06 M "
                        "characters; the default) or tinyshakespeare (char-rnn's and nanoGPT's 1.1 M characters)")
    source.add_argument("--text", metavar="FILE", help="train on this UTF-8 text file instead of a named corpus "
                        f"(at most {MAX_TEXT_BYTES // 10**6} MB)")
    source.add_argument(
        "--task", choices=tuple(name for name in TASKS if name != DEFAULT_TASK),
        help="; ".join(f"{name}: {task.help}" for name, task in TASKS.items() if task.help))
    m = p.add_argument_group("model (a GPTConfig; with --task dates an EncoderDecoderConfig)")
    m.add_argument("--context", type=POSITIVE, help="context length n_C" + _recipe("context_length"))
    m.add_argument("--d-model", type=POSITIVE, help="embedding size d_M" + _recipe("d_model"))
    m.add_argument("--layers", type=POSITIVE, help="number of blocks n_L" + _recipe("n_layers"))
    m.add_argument("--heads", type=POSITIVE, help="attention heads n_H" + _recipe("n_heads"))
    m.add_argument("--positional", choices=POSITIONALS, help="positional encoding (chapter 4)" + _recipe("positional"))
    m.add_argument("--dropout", type=flags.number(0, 1, high_open=True),
                   help="dropout probability" + _recipe("dropout"))
    t = p.add_argument_group("training (a TrainConfig)")
    t.add_argument("--batch-size", type=POSITIVE, help="windows per step" + _recipe("batch_size"))
    budget = t.add_mutually_exclusive_group()
    budget.add_argument("--max-steps", type=POSITIVE, help="number of updates" + _recipe("max_steps"))
    budget.add_argument("--max-tokens", type=POSITIVE, help="at most this many training tokens (sets --max-steps to "
                        "this // (batch x context), at least 1)")
    budget.add_argument("--minutes", type=flags.number(0, low_open=True),
                        help="train for this many minutes: the cosine runs over the time, "
                        "not the steps (not reproducible: it depends on the machine's speed)")
    t.add_argument("--lr", type=flags.number(0, low_open=True), help="peak learning rate" + _recipe("learning_rate"))
    t.add_argument("--min-lr", type=flags.number(0), help="final learning rate of the cosine (default: lr / 10)")
    t.add_argument("--warmup", type=flags.integer(0), help="linear warm-up steps" + _recipe("warmup_steps"))
    t.add_argument("--weight-decay", type=flags.number(0), help="weight decay, matrices only" + _recipe("weight_decay"))
    t.add_argument("--optimizer", choices=OPTIMIZERS, help="adamw; muon: Muon for the blocks' weight matrices and "
                   "AdamW for the rest; or sgd: SGD (7.3) with heavy-ball momentum 0.9, which wants a far larger --lr "
                   "(0.3 in chapter 7's comparison) and --weight-decay 0 (chapter 7)" + _recipe("optimizer"))
    t.add_argument("--grad-clip", type=flags.number(0), help="clip the global gradient norm to this, 0: no clipping"
                   + _recipe("grad_clip"))
    t.add_argument("--eval-interval", type=POSITIVE, help="evaluate and checkpoint every this many steps"
                   + _recipe("eval_interval"))
    t.add_argument("--eval-batches", type=flags.integer(0), help="validation batches per evaluation, 0: the whole "
                   "validation set" + _recipe("eval_batches"))
    t.add_argument("--seed", type=flags.seed, help="seed of the initialisation, dropout and batch order (default: 0)")
    t.add_argument("--device", type=flags.device, help="cpu, cuda, cuda:N or mps (default: cuda when available, "
                   "else cpu)")
    t.add_argument("--threads", type=flags.integer(1, 1024),
                   help="CPU threads PyTorch may use, 1 to 1024 (default: PyTorch's choice)")
    t.add_argument("--no-progress", action="store_true", help="no progress bar")
    t.add_argument("--nproc", type=int, help="train data-parallel in this many processes, started with torchrun "
                   "(chapter 11); a run may resume with another number (default: 1)")
    t.add_argument("--accumulate", type=int, help="cut each process's share of the batch into this many "
                   "micro-batches whose gradients add up before each update (default: 1)")
    p.set_defaults(handler=train_command)


_MODEL_AND_TRAINING_FLAGS = ("context", "d_model", "layers", "heads", "positional", "dropout", "batch_size",
                             "max_steps", "max_tokens", "minutes", "lr", "min_lr", "warmup", "weight_decay",
                             "grad_clip", "eval_interval", "eval_batches", "seed", "objective", "mask_rate",
                             "task")
