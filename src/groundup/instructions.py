"""Instruction tuning data (chapter 13): chapter 10's dates task as chat instructions for SmolLM2-135M-Instruct.

    train = date_instructions("train", 2000)            # (prompt, answer) pairs; test: date_instructions("test")
    data = encode_instructions(tokenizer, train, context_length=128)   # ids + labels, prompt masked
    train(model, data, val_data, config, batches=instruction_batches)  # groundup.training.train
    score, predictions = exact_match_eval(model, tokenizer, test_pairs, shots=train[:3])
    predictions = evaluate_answers(model, tokenizer, test_pairs, shots=format_shots())  # batched, every reply kept
    score_predictions(predictions, format_shots())   # exact match, its Wilson interval, the errors by kind and field

An instruction is one user turn of SmolLM2's chat format (:func:`groundup.pretrained.encode_chat`: ChatML with
its default system message), and the answer is the assistant's reply::

    <|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n
    <|im_start|>user\\nWrite this date in ISO 8601 format (...): the third of may, nineteen eighty-one<|im_end|>\\n
    <|im_start|>assistant\\n1981-05-03<|im_end|>

Instruction tuning trains on exactly this sequence with the next-token loss of pretraining, but only the reply's
tokens (and the ``<|im_end|>`` that ends it, so the model learns to stop) are targets: the prompt is context the
model is given, not text it should learn to write, so its targets are -100, which the loss ignores
(:meth:`groundup.models.GPT.forward`). Examples have different lengths; :func:`instruction_batches` pads them
on the right, where causal attention keeps the padding from reaching any real position.

The dates are :func:`groundup.seq2seq.date_examples`' (chapter 10), with its split: a date, month or year
belongs to the training or the held-out split, never both, so no test question is trained on in any wording,
and the test set is chapter 10's, so the fine-tuned SmolLM2 and chapter 10's encoder-decoder score the same
questions. Other tasks come from JSON Lines files (:func:`read_task_file`).

Scoring many questions: :func:`evaluate_answers` answers them in batches (the same greedy replies as
:func:`generate_answer`, many times faster) and returns every :class:`Prediction`; :func:`score_predictions` gives the
exact match with its 95 % Wilson interval (:mod:`groundup.significance`), the errors by kind (:data:`ERROR_KINDS`:
not ISO, copied from the shots, wrong value) and by field, and the exact match per input format
(:data:`DATE_FORMATS`); :func:`format_shots` are k-shot examples that show every input format.
"""

from __future__ import annotations

import calendar
import json
import numbers
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.nn.utils.rnn import pad_sequence

from groundup.attention import KVCache, reusing_stacked_weights
from groundup.generation import generate
from groundup.pretrained import encode_chat
from groundup.seq2seq import _cardinal, _ordinal, date_examples, date_splits

__all__ = ["INSTRUCTION", "IGNORE_INDEX", "SPLITS", "date_instructions", "read_task_file", "instruction_messages",
           "InstructionData", "encode_instructions", "instruction_batches", "generate_answer", "exact_match_eval",
           "MAX_TASK_FILE_BYTES", "MAX_TASK_TEXT_CHARS", "DATE_FORMATS", "date_format", "format_shots",
           "Prediction", "generate_answers", "evaluate_answers", "iso_fields", "wrong_fields", "error_kind",
           "ERROR_KINDS", "error_breakdown", "score_predictions"]

INSTRUCTION = "Write this date in ISO 8601 format (YYYY-MM-DD; YYYY-MM for a month, YYYY for a year): {date}"
"""The user's request for one date of the dates task; ``{date}`` is replaced by the date in words.

Chapter 10's task has three precisions (a day, a month or a year: ``1981-05-03``, ``2005-03``, ``2012``), so the
instruction names all three: a model that has never seen the task (zero-shot) is told what is wanted."""

IGNORE_INDEX = -100
"""The target of a position that is not trained (``F.cross_entropy``'s default ``ignore_index``)."""

SPLITS = ("train", "val", "test", "held_out")
"""The splits of :func:`date_instructions`: chapter 10's ``date_splits`` (``held_out`` is ``test``)."""

MAX_TASK_FILE_BYTES = 64 << 20
"""The largest task file :func:`read_task_file` reads (64 MiB: hundreds of thousands of examples)."""
MAX_TASK_TEXT_CHARS = 100_000
"""The longest prompt or answer a task file may hold (far beyond any context a model here has)."""

IM_START, IM_END = "<|im_start|>", "<|im_end|>"


# ---- the data: dates as instructions, or a task file ---------------------------------------------------------

def _check_int(name: str, value, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def date_instructions(split: str = "train", n: int = 1000, *, seed: int = 0,
                      instruction: str = INSTRUCTION) -> list[tuple[str, str]]:
    """``n`` (prompt, answer) pairs of chapter 10's dates task: ``instruction`` with the date in words, the ISO date.

    Deterministic in ``split``, ``n`` and ``seed``; a smaller ``n`` gives a prefix of a larger one. The splits are
    chapter 10's (:func:`groundup.seq2seq.date_splits` with the same ``seed``): ``"train"`` is
    ``date_examples(n, split="train")``; ``"test"`` (also called ``"held_out"``) is ``date_examples(n,
    split="held_out")``, whose dates, months and years never occur in training; ``"val"`` is ``date_splits``'
    validation set: held-out dates drawn with ``seed + 1``, none with the wording of one of the first 1,000 test
    questions (chapter 10's test set). ``instruction`` must contain ``{date}``.
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {', '.join(map(repr, SPLITS))}, got {split!r}")
    n = _check_int("n", n)
    if not isinstance(instruction, str) or "{date}" not in instruction:
        raise ValueError(f"instruction must be a string containing '{{date}}', got {instruction!r}")
    if split == "train":
        pairs = date_examples(n, split="train", seed=seed)
    elif split == "val":
        pairs = date_splits(n_train=1, n_val=n, seed=seed)[1]
    else:
        pairs = date_examples(n, split="held_out", seed=seed)
    return [(instruction.replace("{date}", source), target) for source, target in pairs]


def _task_error(path: Path, line: int, message: str) -> ValueError:
    return ValueError(f"{path}, line {line}: {message}; a task file holds one JSON object "
                      f'{{"prompt": "...", "answer": "..."}} per line')


def read_task_file(path: str | os.PathLike) -> list[tuple[str, str]]:
    """The (prompt, answer) pairs of a JSON Lines file: one ``{"prompt": ..., "answer": ...}`` object per line.

    The file is untrusted input. It must be UTF-8 (a byte-order mark is allowed), at most
    :data:`MAX_TASK_FILE_BYTES`; every non-blank line must be a JSON object whose ``"prompt"`` and ``"answer"`` are
    non-blank strings of at most :data:`MAX_TASK_TEXT_CHARS` characters (other keys are ignored); blank lines are
    skipped. Anything else raises ``ValueError`` naming the file and the line (counted from 1).
    """
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a file path, got {type(path).__name__}")
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"task file {path} not found (or not a file)")
    size = path.stat().st_size
    if size > MAX_TASK_FILE_BYTES:
        raise ValueError(f"{path} holds {size:,} bytes; a task file may hold at most {MAX_TASK_FILE_BYTES:,}")
    pairs = []
    with path.open("rb") as fh:
        for number, raw in enumerate(fh.read(MAX_TASK_FILE_BYTES + 1).splitlines(), start=1):
            try:
                line = raw.decode("utf-8-sig" if number == 1 else "utf-8")
            except UnicodeDecodeError as err:
                reason = f"not UTF-8 text ({err.reason} at byte {err.start + 1} of the line)"
                raise _task_error(path, number, reason) from None
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except (ValueError, RecursionError) as err:
                raise _task_error(path, number, f"not valid JSON ({type(err).__name__}: {err})") from None
            if not isinstance(obj, dict):
                raise _task_error(path, number, f"a JSON {_json_type(obj)}, not an object")
            pairs.append(tuple(_task_field(path, number, obj, key) for key in ("prompt", "answer")))
    if not pairs:
        raise ValueError(f"{path} holds no examples: a task file holds one JSON object "
                         f'{{"prompt": "...", "answer": "..."}} per line')
    return pairs


def _json_type(value) -> str:
    """The JSON name of a parsed value's type (``null``, ``boolean``, ``number``, ``array``, ...)."""
    if value is None:
        return "null"
    return {bool: "boolean", int: "number", float: "number", str: "string", list: "array", dict: "object"}.get(
        type(value), type(value).__name__)


def _task_field(path: Path, line: int, obj: dict, key: str) -> str:
    if key not in obj:
        raise _task_error(path, line, f"the object has no {key!r} (its keys: {', '.join(map(repr, list(obj)[:5]))})")
    value = obj[key]
    if not isinstance(value, str):
        raise _task_error(path, line, f"{key!r} must be a string, got a JSON {_json_type(value)}")
    if not value.strip():
        raise _task_error(path, line, f"{key!r} is empty")
    if len(value) > MAX_TASK_TEXT_CHARS:
        raise _task_error(path, line, f"{key!r} holds {len(value):,} characters, more than the "
                                      f"{MAX_TASK_TEXT_CHARS:,} allowed")
    return value


def _check_pairs(name: str, pairs, *, allow_empty: bool = False) -> list[tuple[str, str]]:
    if isinstance(pairs, (str, bytes)) or not isinstance(pairs, Sequence):
        raise TypeError(f"{name} must be a list of (prompt, answer) string pairs, got {type(pairs).__name__}")
    out = []
    for i, pair in enumerate(pairs):
        if (isinstance(pair, (str, bytes)) or not isinstance(pair, Sequence) or len(pair) != 2
                or not all(isinstance(s, str) for s in pair)):
            raise TypeError(f"{name}[{i}] must be a (prompt, answer) pair of strings, got {pair!r}")
        out.append((pair[0], pair[1]))
    if not out and not allow_empty:
        raise ValueError(f"{name} is empty: give at least one (prompt, answer) pair")
    return out


# ---- tokens and labels ---------------------------------------------------------------------------------------

def instruction_messages(prompt: str, *, shots=(), system: str | None = None) -> list[dict]:
    """The chat messages that ask ``prompt``: ``system`` (if given), each shot as a user turn and the assistant's
    answer, then ``prompt`` as the last user turn. Without ``system`` the chat format adds SmolLM2's default one."""
    if not isinstance(prompt, str):
        raise TypeError(f"prompt must be a string, got {type(prompt).__name__}")
    if system is not None and not isinstance(system, str):
        raise TypeError(f"system must be a string or None, got {type(system).__name__}")
    messages = [{"role": "system", "content": system}] if system is not None else []
    for question, answer in _check_pairs("shots", shots, allow_empty=True):
        messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    return messages + [{"role": "user", "content": prompt}]


def _end_id(tokenizer) -> int:
    special = getattr(tokenizer, "special_ids", None)
    if not isinstance(special, dict) or IM_START not in special or IM_END not in special:
        raise TypeError(f"tokenizer must have the chat tokens {IM_START} and {IM_END} among its special_ids (e.g. "
                        f"SmolLM2's, from groundup.pretrained.load_smollm2), got {type(tokenizer).__name__}")
    return special[IM_END]


@dataclass
class InstructionData:
    """Encoded instructions: per example, ``ids`` (1-D int64: prompt, answer, ``<|im_end|>``) and ``labels`` (the
    same length: ``labels[i] = ids[i + 1]``, or -100 where not trained, always at the last position), and the id
    :func:`instruction_batches` pads with."""

    ids: list[torch.Tensor]
    labels: list[torch.Tensor]
    pad_id: int

    def __post_init__(self):
        if not isinstance(self.ids, list) or not isinstance(self.labels, list) or not self.ids:
            raise TypeError("ids and labels must be non-empty lists of 1-D int64 tensors")
        if len(self.ids) != len(self.labels):
            raise ValueError(f"ids and labels must hold as many examples, got {len(self.ids)} and {len(self.labels)}")
        for i, (x, y) in enumerate(zip(self.ids, self.labels)):
            for name, t in (("ids", x), ("labels", y)):
                if not isinstance(t, torch.Tensor) or t.dtype != torch.long or t.dim() != 1 or not len(t):
                    raise TypeError(f"{name}[{i}] must be a non-empty 1-D int64 tensor, got "
                                    f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}")
            if x.shape != y.shape:
                raise ValueError(f"example {i}: ids has {len(x)} tokens but labels {len(y)}")
        if isinstance(self.pad_id, bool) or not isinstance(self.pad_id, numbers.Integral) or self.pad_id < 0:
            raise ValueError(f"pad_id must be a token id (an integer >= 0), got {self.pad_id!r}")

    def __len__(self) -> int:
        return len(self.ids)


def encode_instructions(tokenizer, pairs, *, context_length: int, mask_prompt: bool = True,
                        system: str | None = None, pad_id: int | None = None) -> InstructionData:
    """(prompt, answer) pairs as token ids and next-token labels for instruction tuning.

    Example ``k`` is ``encode_chat(tokenizer, instruction_messages(prompt, system=system))`` (the chat prompt, ending
    in ``<|im_start|>assistant\\n``), then ``tokenizer.encode_ordinary(answer)`` and the ``<|im_end|>`` id: the
    prompt exactly as :func:`generate_answer` gives it to the model, so training and answering see the same
    tokens. Its labels are ``ids[1:]`` followed by -100 (the last token predicts nothing); with ``mask_prompt``
    the labels whose target is a prompt token are -100 too, so only the answer and its ``<|im_end|>`` are learned.
    An example of more than ``context_length`` tokens raises ``ValueError`` naming it. ``pad_id`` defaults to the
    ``<|im_end|>`` id (its value never matters: padded positions have no targets and come after the real ones).
    """
    end = _end_id(tokenizer)
    pairs = _check_pairs("pairs", pairs)
    context_length = _check_int("context_length", context_length, minimum=2)
    if not isinstance(mask_prompt, bool):
        raise TypeError(f"mask_prompt must be True or False, got {mask_prompt!r}")
    ids, labels = [], []
    for k, (prompt, answer) in enumerate(pairs):
        prompt_ids = encode_chat(tokenizer, instruction_messages(prompt, system=system))
        example = prompt_ids + tokenizer.encode_ordinary(answer) + [end]
        if len(example) > context_length:
            raise ValueError(f"example {k} is {len(example)} tokens long ({len(prompt_ids)} of prompt, "
                             f"{len(example) - len(prompt_ids)} of answer and <|im_end|>), more than the context "
                             f"length {context_length}: give a longer context or shorter examples")
        x = torch.tensor(example, dtype=torch.long)
        y = torch.cat([x[1:], torch.tensor([IGNORE_INDEX])])
        if mask_prompt:
            y[:len(prompt_ids) - 1] = IGNORE_INDEX  # position i predicts ids[i + 1], a prompt token for i < P - 1
        ids.append(x)
        labels.append(y)
    return InstructionData(ids, labels, end if pad_id is None else pad_id)


def instruction_batches(data: InstructionData, batch_size: int, context_length: int,
                        generator: torch.Generator) -> tuple[tuple[torch.Tensor], torch.Tensor]:
    """One batch for :func:`groundup.training.train` (``batches=instruction_batches``): ``((ids,), targets)``.

    ``batch_size`` examples drawn uniformly with replacement by one ``torch.randint`` call on ``generator`` (its only
    randomness, so training stays reproducible and resumable), right-padded to the batch's longest example: ids
    with ``data.pad_id``, targets with -100. A batch longer than ``context_length`` raises ``ValueError``.
    """
    if not isinstance(data, InstructionData):
        raise TypeError(f"data must be an InstructionData (from encode_instructions), got {type(data).__name__}")
    batch_size = _check_int("batch_size", batch_size)
    idx = torch.randint(len(data), (batch_size,), generator=generator).tolist()
    longest = max(len(data.ids[i]) for i in idx)
    if longest > context_length:
        raise ValueError(f"a batch holds an example of {longest} tokens, more than context_length {context_length}")
    ids = pad_sequence([data.ids[i] for i in idx], batch_first=True, padding_value=data.pad_id)
    targets = pad_sequence([data.labels[i] for i in idx], batch_first=True, padding_value=IGNORE_INDEX)
    return (ids,), targets


# ---- answering and scoring -----------------------------------------------------------------------------------

def generate_answer(model, tokenizer, prompt: str, *, shots=(), max_new_tokens: int = 16,
                    system: str | None = None) -> str:
    """The model's greedy reply to ``prompt``: the text it writes after ``<|im_start|>assistant\\n``, up to
    ``<|im_end|>``.

    ``shots`` are (prompt, answer) pairs put before the question as earlier user and assistant turns (few-shot
    prompting, no training). Decoding is :func:`groundup.generation.generate` with ``greedy=True`` and the KV cache;
    it writes ``max_new_tokens`` tokens and the reply is cut at the first ``<|im_end|>`` (a reply that has not ended
    by then is returned as far as it got).
    """
    end = _end_id(tokenizer)
    max_new_tokens = _check_int("max_new_tokens", max_new_tokens)
    prompt_ids = encode_chat(tokenizer, instruction_messages(prompt, shots=shots, system=system))
    out = generate(model, torch.tensor([prompt_ids]), max_new_tokens, greedy=True, use_cache=True)
    reply = out[0, len(prompt_ids):].tolist()
    return tokenizer.decode(reply[:reply.index(end)] if end in reply else reply)


def exact_match_eval(model, tokenizer, pairs, *, shots=(), max_new_tokens: int = 16, progress: bool = False,
                     system: str | None = None) -> tuple[float, list[str]]:
    """``(fraction correct, predictions)``: :func:`generate_answer` for every (prompt, answer) pair, correct when the
    reply equals the answer once leading and trailing whitespace is stripped from both. ``progress`` shows a tqdm
    bar."""
    from tqdm import tqdm

    pairs = _check_pairs("pairs", pairs)
    predictions = [generate_answer(model, tokenizer, prompt, shots=shots, max_new_tokens=max_new_tokens,
                                   system=system)
                   for prompt, _ in tqdm(pairs, disable=not progress, desc="exact match", unit="question")]
    correct = sum(p.strip() == answer.strip() for p, (_, answer) in zip(predictions, pairs))
    return correct / len(pairs), predictions


# ---- the dates' input formats, and shots that cover them ------------------------------------------------------

_YEAR_WORD = "(?:" + "|".join(sorted({_cardinal(n) for n in range(1, 20)} | {_cardinal(n) for n in range(20, 100, 10)}
                                     | {"hundred", "thousand", "and", "oh"}, key=len, reverse=True)) + ")"
_YEAR = rf"{_YEAR_WORD}(?:[ -]{_YEAR_WORD})*"
_MONTH = "(?:" + "|".join(m.lower() for m in calendar.month_name[1:]) + ")"
_ORD = "(?:" + "|".join(_ordinal(d) for d in range(31, 0, -1)) + ")"
_CARD = "(?:" + "|".join(_cardinal(d) for d in range(31, 0, -1)) + ")"
_WEEKDAY = re.compile("(?:" + "|".join(d.lower() for d in calendar.day_name) + "), ")
_FORMAT_PATTERNS = {
    "D of M Y": rf"{_ORD} of {_MONTH} {_YEAR}", "the D of M, Y": rf"the {_ORD} of {_MONTH}, {_YEAR}",
    "M D, Y": rf"{_MONTH} {_ORD}, {_YEAR}", "M the D Y": rf"{_MONTH} the {_ORD} {_YEAR}",
    "D M Y": rf"{_ORD} {_MONTH} {_YEAR}", "M N, Y": rf"{_MONTH} {_CARD}, {_YEAR}",
    "M Y": rf"{_MONTH} {_YEAR}", "M of Y": rf"{_MONTH} of {_YEAR}", "M, Y": rf"{_MONTH}, {_YEAR}",
    "Y": _YEAR, "the year Y": rf"the year {_YEAR}"}
_FORMAT_RE = {name: re.compile(pattern) for name, pattern in _FORMAT_PATTERNS.items()}
DATE_FORMATS = tuple(_FORMAT_PATTERNS)
"""The input formats of the dates task (:func:`groundup.seq2seq.date_to_words`' wordings), named by their shape:
``D`` an ordinal day ("twenty-first"), ``N`` a cardinal day ("twenty-one"), ``M`` a month, ``Y`` a year in any
of its wordings ("nineteen oh five", "two thousand and five", "twenty twelve"). The first six are full dates,
each also written with a weekday in front ("tuesday, ...") 30 % of the time; then three for a month; two for a
year."""


def date_format(source: str) -> str:
    """The name in :data:`DATE_FORMATS` of the wording of ``source``, a date in words of the dates task.

    ``"tuesday, the twenty-first of march, nineteen seventy-nine"`` -> ``"the D of M, Y"`` (the weekday is not
    part of the format); ``"march of two thousand and five"`` -> ``"M of Y"``. A text that is none of them raises
    ``ValueError``."""
    if not isinstance(source, str):
        raise TypeError(f"source must be a string, got {type(source).__name__}")
    weekday = _WEEKDAY.match(source)
    text = source[weekday.end():] if weekday else source
    for name, pattern in _FORMAT_RE.items():
        if pattern.fullmatch(text) and (not weekday or name in DATE_FORMATS[:6]):
            return name
    raise ValueError(f"{source!r} is not a date of the dates task in any of its formats ({', '.join(DATE_FORMATS)})")


def format_shots(seed: int = 0, *, instruction: str = INSTRUCTION) -> list[tuple[str, str]]:
    """k-shot examples for the dates task that show every input format once: ``len(DATE_FORMATS)`` (prompt,
    answer) pairs of :func:`date_instructions` ``("train", seed=seed)``, never a held-out date.

    For each format, the first training example written in it; if none of the six full dates chosen so has a
    weekday, the first training example with a weekday replaces the one of its format. The shots keep the order
    in which they occur in the training examples (a random order of the formats, fixed by ``seed``)."""
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise TypeError(f"seed must be an integer, got {seed!r}")
    pool = date_examples(2000, split="train", seed=seed)
    first: dict[str, int] = {}
    for i, (source, _) in enumerate(pool):
        first.setdefault(date_format(source), i)
    if set(first) != set(DATE_FORMATS):  # cannot happen with 2,000 examples; checked rather than assumed
        raise ValueError(f"the first 2,000 training dates of seed {seed} lack the formats "
                         f"{sorted(set(DATE_FORMATS) - set(first))}")
    if not any(_WEEKDAY.match(pool[first[name]][0]) for name in DATE_FORMATS[:6]):
        i = next(i for i, (source, _) in enumerate(pool) if _WEEKDAY.match(source))
        first[date_format(pool[i][0])] = i
    if not isinstance(instruction, str) or "{date}" not in instruction:
        raise ValueError(f"instruction must be a string containing '{{date}}', got {instruction!r}")
    return [(instruction.replace("{date}", pool[i][0]), pool[i][1]) for i in sorted(first.values())]


# ---- batched greedy answers -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Prediction:
    """One answered question: ``id`` (its index among the pairs evaluated), ``format`` (:func:`date_format` of the
    date in the prompt, the text after its last ``": "``, or ``"other"``), ``expected`` (the reference answer),
    ``text`` (the raw reply, decoded, up to and without ``<|im_end|>``), ``ended`` (whether the reply ended with
    ``<|im_end|>`` within ``max_new_tokens``), ``answer`` (the parsed answer: ``text`` stripped of surrounding
    whitespace, what exact match compares)."""

    id: int
    format: str
    expected: str
    text: str
    ended: bool
    answer: str

    @property
    def correct(self) -> bool:
        """Exact match: the parsed answer equals the expected one (both stripped)."""
        return self.answer == self.expected.strip()


def _reply_tokens(model, prompt_ids: list[list[int]], end: int, max_new_tokens: int, batch_size: int,
                  progress: bool) -> list[list[int]]:
    """Greedy replies to every prompt, each cut after its first ``end`` (kept), computed in batches.

    The prompts' longest common prefix (the system message, shots and the instruction's words) runs once and its
    keys and values are shared; the rest of each prompt is batched with the prompts whose rest has as many
    tokens, so no padding is needed; a row leaves the batch (its cache rows dropped) when it writes ``end``."""
    from tqdm import tqdm

    shortest = min(len(ids) for ids in prompt_ids)
    common = 0
    while common < shortest - 1 and all(ids[common] == prompt_ids[0][common] for ids in prompt_ids):
        common += 1
    device = next(model.parameters()).device
    last = {"last_only": True}
    groups: dict[int, list[int]] = {}
    for i, ids in enumerate(prompt_ids):
        groups.setdefault(len(ids), []).append(i)
    replies: list[list[int]] = [[] for _ in prompt_ids]
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), reusing_stacked_weights(), tqdm(total=len(prompt_ids), disable=not progress,
                                                              desc="answers", unit="question") as bar:
            prefix = model.new_cache()
            if common:
                model(torch.tensor([prompt_ids[0][:common]], device=device), cache=prefix, **last)
            for length in sorted(groups):
                for start in range(0, len(groups[length]), batch_size):
                    rows = groups[length][start:start + batch_size]
                    cache = [KVCache() for _ in prefix]
                    for layer, shared in zip(cache, prefix):
                        if shared.k is not None:
                            layer.k = shared.k.expand(len(rows), -1, -1, -1)
                            layer.v = shared.v.expand(len(rows), -1, -1, -1)
                    x = torch.tensor([prompt_ids[i][common:] for i in rows], device=device)
                    active = list(rows)
                    for _ in range(max_new_tokens):
                        logits, _ = model(x, cache=cache, **last)
                        logits = logits[:, -1, :]
                        if logits.dtype in (torch.float16, torch.bfloat16):
                            logits = logits.float()  # as generate does
                        new = logits.argmax(dim=-1).tolist()
                        keep = []
                        for r, (i, token) in enumerate(zip(active, new)):
                            replies[i].append(token)
                            if token != end:
                                keep.append(r)
                        if not keep:
                            break
                        if len(keep) < len(active):
                            index = torch.tensor(keep, device=device)
                            for layer in cache:
                                layer.k, layer.v = layer.k[index], layer.v[index]
                            active = [active[r] for r in keep]
                        x = torch.tensor([[new[r]] for r in keep], device=device)
                    bar.update(len(rows))
    finally:
        model.train(was_training)
    return replies


def _answer_tokens(model, tokenizer, prompts, shots, max_new_tokens, system, batch_size, progress):
    end = _end_id(tokenizer)
    max_new_tokens = _check_int("max_new_tokens", max_new_tokens)
    batch_size = _check_int("batch_size", batch_size)
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or not prompts:
        raise TypeError(f"prompts must be a non-empty list of strings, got {prompts!r:.80}")
    shots = _check_pairs("shots", shots, allow_empty=True)
    prompt_ids = [encode_chat(tokenizer, instruction_messages(p, shots=shots, system=system)) for p in prompts]
    longest = max(len(ids) for ids in prompt_ids)
    if longest + max_new_tokens - 1 > model.config.context_length:
        raise ValueError(f"a prompt of {longest} tokens and max_new_tokens {max_new_tokens} do not fit the "
                         f"model's context of {model.config.context_length} tokens (batched answers never crop)")
    return end, _reply_tokens(model, prompt_ids, end, max_new_tokens, batch_size, progress)


def generate_answers(model, tokenizer, prompts, *, shots=(), max_new_tokens: int = 16, system: str | None = None,
                     batch_size: int = 32, progress: bool = False) -> list[str]:
    """:func:`generate_answer` for every prompt in ``prompts``, computed in batches: the same greedy replies.

    The prompts (each after the same ``shots`` and ``system``) share their longest common token prefix, which the
    model reads once; the rest of each is decoded with the KV cache in batches of at most ``batch_size`` prompts
    of the same length (no padding, so every row computes what it would alone), and decoding stops when every
    row of a batch has written ``<|im_end|>`` or after ``max_new_tokens`` tokens. Batched matrix products may
    round differently from one-at-a-time ones, so in float32 an argmax that is a near-tie may (rarely) differ;
    in float64 the two agree. A prompt that with ``max_new_tokens`` does not fit the context raises
    ``ValueError`` (this path never crops)."""
    end, replies = _answer_tokens(model, tokenizer, prompts, shots, max_new_tokens, system, batch_size, progress)
    return [tokenizer.decode(r[:-1] if r and r[-1] == end else r) for r in replies]


def _prompt_format(prompt: str) -> str:
    try:
        return date_format(prompt.rsplit(": ", 1)[-1])
    except ValueError:
        return "other"


def evaluate_answers(model, tokenizer, pairs, *, shots=(), max_new_tokens: int = 16, system: str | None = None,
                     batch_size: int = 32, progress: bool = False) -> list[Prediction]:
    """Every (prompt, answer) pair of ``pairs`` answered by greedy decoding (:func:`generate_answers`, batched):
    one :class:`Prediction` per pair, in order, with its input format, the raw reply and the parsed answer.

    The exact match is ``mean(p.correct for p in predictions)`` (:func:`score_predictions` adds its interval and
    the errors); it equals :func:`exact_match_eval`'s for the same pairs, as the replies are the same."""
    pairs = _check_pairs("pairs", pairs)
    end, replies = _answer_tokens(model, tokenizer, [p for p, _ in pairs], shots, max_new_tokens, system,
                                  batch_size, progress)
    out = []
    for i, ((prompt, expected), reply) in enumerate(zip(pairs, replies)):
        ended = bool(reply) and reply[-1] == end
        text = tokenizer.decode(reply[:-1] if ended else reply)
        out.append(Prediction(i, _prompt_format(prompt), expected, text, ended, text.strip()))
    return out


# ---- what went wrong: the errors of ISO dates --------------------------------------------------------------------

FIELDS = ("year", "month", "day")
ERROR_KINDS = ("format", "copy", "value")
"""The kinds of a wrong answer to a dates question, in the order they are tested (the first that applies):

* ``"format"``: the answer is not an ISO 8601 date of the expected precision: not ``YYYY``, ``YYYY-MM`` or
  ``YYYY-MM-DD`` in ASCII digits (after stripping surrounding whitespace), or with another number of fields than
  the expected answer (``2005-03-01`` for the month ``2005-03``). Field values are not checked (``2005-13`` has
  the format; its month is a wrong value);
* ``"copy"`` (only with shots): well formed, and at least one of its wrong fields equals the same field (year,
  month or day) of one of the shots' answers. The right value of a field is never a copy. A wrong field can
  equal a shot's by chance (with 11 shots, many months occur in them), so this counts what copying would
  produce, an upper bound on copying itself;
* ``"value"``: well formed, and no wrong field is a shot's: the model wrote a wrong year, month or day.
"""
_ISO = re.compile(r"[0-9]{4}(?:-[0-9]{2}){0,2}")


def iso_fields(text: str) -> tuple[str, ...] | None:
    """The fields (year, then month, then day) of ``text`` stripped if it is ISO-shaped (``YYYY``, ``YYYY-MM`` or
    ``YYYY-MM-DD``, ASCII digits), else None: ``" 2005-03"`` -> ``("2005", "03")``."""
    if not isinstance(text, str):
        raise TypeError(f"text must be a string, got {type(text).__name__}")
    text = text.strip()
    return tuple(text.split("-")) if _ISO.fullmatch(text) else None


def _expected_fields(expected: str) -> tuple[str, ...]:
    fields = iso_fields(expected)
    if fields is None:
        raise ValueError(f"expected must be an ISO date (YYYY, YYYY-MM or YYYY-MM-DD), got {expected!r}")
    return fields


def wrong_fields(expected: str, answer: str) -> tuple[str, ...]:
    """The fields of :data:`FIELDS` in which the well-formed ``answer`` differs from ``expected``: ``("month",)``
    for ``1981-04-03`` against ``1981-05-03``; ``()`` when it is right. An answer that is not ISO-shaped with the
    expected precision (a ``"format"`` error) has no fields to compare: ``ValueError``."""
    want = _expected_fields(expected)
    got = iso_fields(answer)
    if got is None or len(got) != len(want):
        raise ValueError(f"answer {answer!r} is not an ISO date of the precision of {expected!r}: its fields cannot "
                         "be compared")
    return tuple(name for name, a, b in zip(FIELDS, got, want) if a != b)


def _shot_answers(shots) -> list[tuple[str, ...]]:
    answers = [iso_fields(a) for _, a in _check_pairs("shots", shots, allow_empty=True)]
    return [a for a in answers if a is not None]


def error_kind(expected: str, answer: str, shots=()) -> str | None:
    """The kind (:data:`ERROR_KINDS`) of the error of ``answer`` to a question whose answer is ``expected`` asked
    after ``shots`` ((prompt, answer) pairs), or None when it is right (equal once stripped)."""
    want = _expected_fields(expected)
    if answer.strip() == expected.strip():
        return None
    got = iso_fields(answer)
    if got is None or len(got) != len(want):
        return "format"
    examples = _shot_answers(shots)
    for k, (a, b) in enumerate(zip(got, want)):
        if a != b and any(len(s) > k and s[k] == a for s in examples):
            return "copy"
    return "value"


def error_breakdown(predictions, shots=()) -> dict:
    """The errors of ``predictions`` (:class:`Prediction` s of the dates task asked after ``shots``), counted.

    ``{"n", "correct", "kinds": {kind: count for ERROR_KINDS}, "fields": {field: count}, "by_format":
    {format: [correct, n]}}``: every wrong prediction has one kind (:func:`error_kind`); ``fields`` counts, over
    the well-formed wrong ones (kinds ``copy`` and ``value``), each field that is wrong (:func:`wrong_fields`; one
    answer can count in several); ``by_format`` is the exact match per input format."""
    predictions = list(predictions)
    kinds = dict.fromkeys(ERROR_KINDS, 0)
    fields = dict.fromkeys(FIELDS, 0)
    by_format: dict[str, list[int]] = {}
    for p in predictions:
        if not isinstance(p, Prediction):
            raise TypeError(f"predictions must be Prediction objects (from evaluate_answers), got {type(p).__name__}")
        counts = by_format.setdefault(p.format, [0, 0])
        counts[0] += p.correct
        counts[1] += 1
        kind = error_kind(p.expected, p.answer, shots)
        if kind is None:
            continue
        kinds[kind] += 1
        if kind != "format":
            for name in wrong_fields(p.expected, p.answer):
                fields[name] += 1
    return {"n": len(predictions), "correct": sum(p.correct for p in predictions), "kinds": kinds, "fields": fields,
            "by_format": {name: by_format[name] for name in sorted(by_format, key=_format_order)}}


def _format_order(name: str) -> tuple[int, str]:
    return (DATE_FORMATS.index(name) if name in DATE_FORMATS else len(DATE_FORMATS), name)


def score_predictions(predictions, shots=(), *, confidence: float = 0.95) -> dict:
    """The exact match of ``predictions`` with its Wilson interval (:func:`groundup.significance.wilson_interval`)
    and, for the dates task, :func:`error_breakdown`: ``{"n", "correct", "exact_match", "interval": [lo, hi],
    "kinds", "fields", "by_format"}``."""
    from groundup.significance import wilson_interval

    found = error_breakdown(predictions, shots)
    if not found["n"]:
        raise ValueError("predictions is empty: nothing to score")
    lo, hi = wilson_interval(found["correct"], found["n"], confidence=confidence)
    return {"n": found["n"], "correct": found["correct"], "exact_match": found["correct"] / found["n"],
            "interval": [lo, hi], **{k: found[k] for k in ("kinds", "fields", "by_format")}}
