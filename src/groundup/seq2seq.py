"""Sequence to sequence (chapter 10): a translation task, its tokenizers and batches, and decoding.

The task: **dates written out in words → ISO 8601**. The package generates it deterministically::

    "tuesday, the twenty-first of march, nineteen seventy-nine"   →  "1979-03-21"
    "march of two thousand and five"                              →  "2005-03"
    "the year twenty twelve"                                      →  "2012"

The output is not a copy of the input: the words must be turned into digits, the order changes (day, month,
year in → year, month, day out), weekdays and filler words must be ignored, and the output length (4, 7 or 10
characters, ISO's reduced precisions) depends on what the input says. Sources are tokenized by words (the
hyphen and the comma are tokens of their own, so "seventy-nine" is ``seventy - nine``), targets by characters.
Both vocabularies are fixed by the task, not learned from data, and share the special ids :data:`PAD`,
:data:`START`, :data:`END`.

* :func:`date_examples` -- ``n`` (source, target) pairs from a seed, from the training or the held-out split:
  every target (a date, a month or a year) belongs to exactly one split, so no held-out example -- not even its
  date in another wording -- occurs in training;
* :func:`date_splits` -- the training, validation and test sets of chapter 10 and ``groundup train --task dates``;
* :class:`Seq2SeqTokenizer`, :func:`date_tokenizers`;
* :class:`Seq2SeqData`, :func:`collate` (padding, shifted decoder input) and :func:`batches` for
  :func:`groundup.training.train`;
* :func:`greedy_decode`, :func:`beam_search`, :func:`sequence_log_prob`, :func:`exact_match`;
* :func:`cross_attention_weights` -- what each decoder position attends to in the source, per layer and head.
"""

from __future__ import annotations

import calendar
import datetime
import json
import numbers
import random
import re
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.nn.utils.rnn import pad_sequence

from groundup.generation import beam_step, best_beam
from groundup.utils import atomic_write_text

__all__ = ["PAD", "START", "END", "SPECIALS", "date_to_words", "date_examples", "date_splits", "Seq2SeqTokenizer",
           "date_tokenizers", "Seq2SeqData", "encode_pairs", "collate", "batches", "greedy_decode", "beam_search",
           "sequence_log_prob", "exact_match", "cross_attention_weights", "YEARS", "HELD_OUT_FRACTION"]

PAD, START, END = 0, 1, 2
"""The special ids, the same in the source and the target vocabulary."""
SPECIALS = ("<pad>", "<s>", "</s>")

YEARS = (1900, 2099)
"""The first and last year the task writes."""
HELD_OUT_FRACTION = 0.1
"""The share of targets (dates, months, years) reserved for the held-out split."""

_ONES = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve",
         "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen"]
_TENS = ["", "", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety"]
_ORDINALS = ["", "first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth", "ninth", "tenth",
             "eleventh", "twelfth", "thirteenth", "fourteenth", "fifteenth", "sixteenth", "seventeenth",
             "eighteenth", "nineteenth"]
_TENS_ORDINALS = {20: "twentieth", 30: "thirtieth"}
_MONTHS = [m.lower() for m in calendar.month_name[1:]]
_WEEKDAYS = [d.lower() for d in calendar.day_name]
_FILLERS = ["the", "of", "and", "oh", "hundred", "thousand", "year"]
SOURCE_WORDS = tuple(_ONES[1:] + _TENS[2:] + _ORDINALS[1:] + list(_TENS_ORDINALS.values()) + _MONTHS + _WEEKDAYS
                     + _FILLERS + [",", "-"])
"""Every token a source can contain (after the specials)."""
TARGET_CHARS = tuple("0123456789-")
"""Every token a target can contain (after the specials)."""


def _cardinal(n: int) -> str:
    """1..99 in words: 7 → "seven", 79 → "seventy-nine"."""
    if n < 20:
        return _ONES[n]
    return _TENS[n // 10] + (f"-{_ONES[n % 10]}" if n % 10 else "")


def _ordinal(n: int) -> str:
    """1..31 as an ordinal: 7 → "seventh", 21 → "twenty-first", 30 → "thirtieth"."""
    if n < 20:
        return _ORDINALS[n]
    if n % 10 == 0:
        return _TENS_ORDINALS[n]
    return f"{_TENS[n // 10]}-{_ORDINALS[n % 10]}"


def _year(y: int, rng: random.Random) -> str:
    """A year in one of the ways people say it: "nineteen seventy-nine", "two thousand and five", "twenty twelve"."""
    hi, lo = divmod(y, 100)
    if 2000 <= y <= 2009:
        return "two thousand" + ("" if lo == 0 else rng.choice([" ", " and "]) + _cardinal(lo))
    spoken = _cardinal(hi) + (" hundred" if lo == 0 else f" oh {_ONES[lo]}" if lo < 10 else f" {_cardinal(lo)}")
    if y >= 2010:
        return rng.choice([spoken, "two thousand " + _cardinal(lo), "two thousand and " + _cardinal(lo)])
    return spoken


def date_to_words(kind: str, year: int, month: int = 1, day: int = 1, *, rng: random.Random) -> tuple[str, str]:
    """One (source, target) pair: the date in words, in a wording drawn with ``rng``, and its ISO form.

    ``kind`` is "date" (→ "YYYY-MM-DD"), "month" (→ "YYYY-MM") or "year" (→ "YYYY").
    """
    if kind not in ("date", "month", "year"):
        raise ValueError(f"kind must be 'date', 'month' or 'year', got {kind!r}")
    if not YEARS[0] <= year <= YEARS[1]:
        raise ValueError(f"year must be in {YEARS[0]}..{YEARS[1]}, got {year}")
    y = _year(year, rng)
    if kind == "year":
        return rng.choice([y, f"the year {y}"]), f"{year:04d}"
    m = _MONTHS[month - 1]
    if kind == "month":
        return rng.choice([f"{m} {y}", f"{m} of {y}", f"{m}, {y}"]), f"{year:04d}-{month:02d}"
    date = datetime.date(year, month, day)  # raises ValueError for a day the month does not have
    d = _ordinal(day)
    text = rng.choice([f"{d} of {m} {y}", f"the {d} of {m}, {y}", f"{m} {d}, {y}", f"{m} the {d} {y}",
                       f"{d} {m} {y}", f"{m} {_cardinal(day)}, {y}"])
    if rng.random() < 0.3:
        text = f"{_WEEKDAYS[date.weekday()]}, {text}"
    return text, date.isoformat()


def _is_held_out(target: str) -> bool:
    """Whether ``target`` (an ISO date, month or year) belongs to the held-out split: a fixed hash, 10 % of them."""
    return zlib.crc32(target.encode()) % 1000 < HELD_OUT_FRACTION * 1000


def date_examples(n: int, *, split: str = "train", seed: int = 0) -> list[tuple[str, str]]:
    """``n`` (source, target) pairs of the dates task, generated deterministically from ``seed``.

    80 % full dates, 12 % months, 8 % years, uniform over 1900-2099. ``split`` is "train" or "held_out"; each
    target belongs to one split only (:data:`HELD_OUT_FRACTION` of them, chosen by a hash), so the splits never
    share a date, whatever the wording. Held-out examples are all different sources; training examples may repeat.
    """
    if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 1:
        raise ValueError(f"n must be a positive integer, got {n!r}")
    if split not in ("train", "held_out"):
        raise ValueError(f"split must be 'train' or 'held_out', got {split!r}")
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise TypeError(f"seed must be an integer, got {seed!r}")
    rng = random.Random(f"dates-{split}-{int(seed)}")
    want_held_out = split == "held_out"
    out, seen = [], set()
    while len(out) < n:
        u = rng.random()
        kind = "date" if u < 0.8 else "month" if u < 0.92 else "year"
        year, month = rng.randint(*YEARS), rng.randint(1, 12)
        day = rng.randint(1, calendar.monthrange(year, month)[1])
        iso = {"date": f"{year:04d}-{month:02d}-{day:02d}", "month": f"{year:04d}-{month:02d}",
               "year": f"{year:04d}"}[kind]
        if _is_held_out(iso) != want_held_out:
            continue
        pair = date_to_words(kind, year, month, day, rng=rng)
        if want_held_out:
            if pair[0] in seen:
                continue
            seen.add(pair[0])
        out.append(pair)
    return out


def date_splits(n_train: int = 20_000, n_val: int = 500, n_test: int = 1_000, *, seed: int = 0):
    """The dates task's ``(train, val, test)`` lists of (source, target) pairs, as chapter 10 trains and tests on them.

    ``train`` is ``date_examples(n_train, split="train", seed=seed)`` and ``test`` is ``date_examples(n_test,
    split="held_out", seed=seed)``; ``val`` holds the first ``n_val`` pairs of the held-out split drawn with
    ``seed + 1`` whose source is not a test source. No date of ``val`` or ``test`` is trained on (in any wording),
    and ``val`` and ``test`` share no source (they may share a date in different wordings).
    """
    for name, value in (("n_train", n_train), ("n_val", n_val), ("n_test", n_test)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    train = date_examples(n_train, split="train", seed=seed)
    test = date_examples(n_test, split="held_out", seed=seed)
    test_sources = {s for s, _ in test}
    draws = n_val + n_val // 5  # date_examples(m) is a prefix of date_examples(m') for m < m': draw more if short
    while True:
        val = [p for p in date_examples(draws, split="held_out", seed=seed + 1) if p[0] not in test_sources]
        if len(val) >= n_val:
            return train, val[:n_val], test
        draws *= 2


_SPLIT = re.compile(r"[a-z]+|[^\sa-z]")


class Seq2SeqTokenizer:
    """A fixed vocabulary of words or characters, after the three specials ``<pad>``, ``<s>``, ``</s>``.

    ``level="word"`` splits text into runs of letters and single other characters ("seventy-nine," →
    ``seventy``, ``-``, ``nine``, ``,``); ``level="char"`` into characters. ``encode`` returns the ids without
    specials and raises ``ValueError`` naming a token that is not in the vocabulary; ``decode`` skips the
    specials and stops at the first ``</s>``.
    """

    def __init__(self, tokens, *, level: str):
        if level not in ("word", "char"):
            raise ValueError(f"level must be 'word' or 'char', got {level!r}")
        tokens = list(tokens)
        if len(set(tokens)) != len(tokens) or any(not isinstance(t, str) or not t for t in tokens):
            raise ValueError("tokens must be distinct non-empty strings")
        if set(tokens) & set(SPECIALS):
            raise ValueError(f"tokens must not include the specials {SPECIALS}: they come first automatically")
        self.level = level
        self.tokens = list(SPECIALS) + tokens
        self.ids = {t: i for i, t in enumerate(self.tokens)}

    @property
    def vocab_size(self) -> int:
        return len(self.tokens)

    def split(self, text: str) -> list[str]:
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        return list(text) if self.level == "char" else _SPLIT.findall(text.lower())

    def encode(self, text: str) -> list[int]:
        ids = []
        for t in self.split(text):
            if t not in self.ids:
                raise ValueError(f"{t!r} is not in this tokenizer's vocabulary ({self.level} level, "
                                 f"{self.vocab_size} tokens)")
            ids.append(self.ids[t])
        return ids

    def decode(self, ids) -> str:
        words = []
        for i in (ids.tolist() if isinstance(ids, torch.Tensor) else ids):
            if i == END:
                break
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"id {i} is outside the vocabulary [0, {self.vocab_size - 1}]")
            if i >= len(SPECIALS):
                words.append(self.tokens[i])
        if self.level == "char":
            return "".join(words)
        return " ".join(words).replace(" - ", "-").replace(" ,", ",")

    def save(self, path) -> None:
        atomic_write_text(Path(path), json.dumps({"level": self.level, "tokens": self.tokens[len(SPECIALS):]}))

    @classmethod
    def load(cls, path) -> Seq2SeqTokenizer:
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
            return cls(data["tokens"], level=data["level"])
        except (OSError, KeyError, TypeError, json.JSONDecodeError) as err:
            raise ValueError(f"{path} is not a Seq2SeqTokenizer file: {err}") from None

    def __eq__(self, other) -> bool:
        return isinstance(other, Seq2SeqTokenizer) and (self.level, self.tokens) == (other.level, other.tokens)

    def __repr__(self) -> str:
        return f"Seq2SeqTokenizer(level={self.level!r}, vocab_size={self.vocab_size})"


def date_tokenizers() -> tuple[Seq2SeqTokenizer, Seq2SeqTokenizer]:
    """The dates task's (source, target) tokenizers: words of :data:`SOURCE_WORDS`, characters of ISO dates."""
    return Seq2SeqTokenizer(SOURCE_WORDS, level="word"), Seq2SeqTokenizer(TARGET_CHARS, level="char")


@dataclass
class Seq2SeqData:
    """Examples as lists of ids: ``src[i]`` (no specials) and ``tgt[i]`` (no specials), for :func:`batches`."""

    src: list[list[int]]
    tgt: list[list[int]]

    def __post_init__(self):
        if len(self.src) != len(self.tgt) or not self.src:
            raise ValueError(f"src and tgt must be non-empty lists of the same length, got {len(self.src)} and "
                             f"{len(self.tgt)}")

    def __len__(self) -> int:
        return len(self.src)


def encode_pairs(pairs, src_tokenizer: Seq2SeqTokenizer, tgt_tokenizer: Seq2SeqTokenizer) -> Seq2SeqData:
    """(source text, target text) pairs as a :class:`Seq2SeqData` of ids."""
    pairs = list(pairs)
    return Seq2SeqData([src_tokenizer.encode(s) for s, _ in pairs], [tgt_tokenizer.encode(t) for _, t in pairs])


def collate(src_seqs, tgt_seqs=None, *, pad_id: int = PAD, start_id: int = START, end_id: int = END):
    """Pad a batch: ``src (batch, longest source)``, and with targets also the decoder input and the targets.

    For a target ``y = [y_1, ..., y_n]`` the decoder input is ``[start, y_1, ..., y_n]`` (shifted right) and the
    targets are ``[y_1, ..., y_n, end]``; shorter rows are filled with ``pad_id`` after their tokens. Returns
    ``src`` alone, or ``(src, tgt_in, targets)``.
    """
    def pad(rows):
        rows = [list(r) for r in rows]
        if not rows or any(len(r) == 0 for r in rows):
            raise ValueError("every sequence needs at least one token")
        return pad_sequence([torch.tensor(r, dtype=torch.long) for r in rows], batch_first=True,
                            padding_value=pad_id)

    src = pad(src_seqs)
    if tgt_seqs is None:
        return src
    tgt_seqs = [list(t) for t in tgt_seqs]
    if len(tgt_seqs) != src.shape[0]:
        raise ValueError(f"got {src.shape[0]} sources but {len(tgt_seqs)} targets")
    return src, pad([[start_id] + t for t in tgt_seqs]), pad([t + [end_id] for t in tgt_seqs])


def batches(data: Seq2SeqData, batch_size: int, context_length: int, generator: torch.Generator):
    """One training batch for :func:`groundup.training.train`: ``((src, tgt_in), targets)``.

    ``batch_size`` examples drawn uniformly (with replacement) with ``generator``, padded by :func:`collate`.
    Sources and decoder inputs longer than ``context_length`` raise ``ValueError``.
    """
    if not isinstance(data, Seq2SeqData):
        raise TypeError(f"data must be a Seq2SeqData, got {type(data).__name__}")
    idx = torch.randint(len(data), (batch_size,), generator=generator).tolist()
    src, tgt_in, targets = collate([data.src[i] for i in idx], [data.tgt[i] for i in idx])
    if max(src.shape[1], tgt_in.shape[1]) > context_length:
        raise ValueError(f"a batch holds a sequence of length {max(src.shape[1], tgt_in.shape[1])}, longer than "
                         f"context_length {context_length}")
    return (src, tgt_in), targets


def _model_ids(model):
    c = model.config
    return c.pad_id, c.start_id, c.end_id


def _check_decode_args(model, src, max_len) -> int:
    if not hasattr(model, "encode") or not hasattr(model, "decode"):
        raise TypeError(f"model must be an encoder-decoder (with encode and decode), got {type(model).__name__}")
    if not isinstance(src, torch.Tensor) or src.dim() != 2:
        raise ValueError("src must be a (batch, src_len) tensor of token ids (use collate to pad a list)")
    limit = model.config.context_length - 1
    max_len = limit if max_len is None else max_len
    if isinstance(max_len, bool) or not isinstance(max_len, numbers.Integral) or not 1 <= max_len <= limit:
        raise ValueError(f"max_len must be an integer in [1, context_length - 1 = {limit}], got {max_len!r}")
    return int(max_len)


def _strip(row: list[int], end_id: int) -> list[int]:
    """The tokens of a generated row before its end token (the start token removed)."""
    row = row[1:]
    return row[:row.index(end_id)] if end_id in row else row


@torch.no_grad()
def greedy_decode(model, src: torch.Tensor, max_len: int | None = None) -> list[list[int]]:
    """Greedy decoding: from ``[start]``, append the most probable next token until the end token.

    Batched: every row stops at its own end token (later tokens are never looked at), and the loop stops when
    every row has ended or after ``max_len`` new tokens (default: ``context_length - 1``). Returns each row's
    tokens without the start and end tokens. The source is encoded once.
    """
    max_len = _check_decode_args(model, src, max_len)
    _, start_id, end_id = _model_ids(model)
    was_training = model.training
    model.eval()
    try:
        memory, src_mask = model.encode(src)
        out = torch.full((src.shape[0], 1), start_id, dtype=torch.long, device=src.device)
        done = torch.zeros(src.shape[0], dtype=torch.bool, device=src.device)
        for _ in range(max_len):
            nxt = model.decode(out, memory, src_mask)[:, -1].argmax(-1)
            out = torch.cat([out, nxt[:, None]], dim=1)
            done |= nxt == end_id
            if bool(done.all()):
                break
    finally:
        model.train(was_training)
    return [_strip(row, end_id) for row in out.tolist()]


@torch.no_grad()
def beam_search(model, src: torch.Tensor, beam_width: int = 4, max_len: int | None = None, *,
                length_penalty: float = 0.0, return_scores: bool = False):
    """Beam search: keep the ``beam_width`` most probable partial outputs of every source, batched.

    At each step every kept hypothesis is extended by every token, and the ``beam_width`` best of the
    ``beam_width × n_V`` candidates survive. A hypothesis that emits the end token is finished: it stays in the
    beam, extended only by padding at no cost, and keeps competing with the unfinished ones. Hypotheses are
    ranked by ``log P(y | x) / len(y)^length_penalty``, with ``len(y)`` counting the end token: the default 0
    ranks by probability itself (what beam search approximates the argmax of; it favours short outputs only as
    far as the model does), 1 by the mean log-probability per token. The search stops when every hypothesis of
    every source is finished or after ``max_len`` tokens; the best finished hypothesis wins (an unfinished one
    only if none finished). ``beam_width=1`` is greedy decoding.

    Returns each source's tokens without start and end, and with ``return_scores`` also their log-probabilities.
    """
    max_len = _check_decode_args(model, src, max_len)
    if isinstance(beam_width, bool) or not isinstance(beam_width, numbers.Integral) or beam_width < 1:
        raise ValueError(f"beam_width must be a positive integer, got {beam_width!r}")
    if isinstance(length_penalty, bool) or not isinstance(length_penalty, numbers.Real) or length_penalty < 0:
        raise ValueError(f"length_penalty must be a number >= 0, got {length_penalty!r}")
    pad_id, start_id, end_id = _model_ids(model)
    k, batch = int(beam_width), src.shape[0]
    was_training = model.training
    model.eval()
    try:
        memory, src_mask = model.encode(src)
        memory, src_mask = memory.repeat_interleave(k, 0), src_mask.repeat_interleave(k, 0)
        seqs = torch.full((batch * k, 1), start_id, dtype=torch.long, device=src.device)
        scores = torch.full((batch, k), float("-inf"), device=src.device)
        scores[:, 0] = 0.0  # at the start every beam is the same: expand only one
        lengths = torch.zeros(batch, k, device=src.device)  # tokens so far, the end token included
        finished = torch.zeros(batch, k, dtype=torch.bool, device=src.device)
        for _ in range(max_len):
            logp = torch.log_softmax(model.decode(seqs, memory, src_mask)[:, -1].float(), dim=-1)
            logp[:, [pad_id, start_id]] = float("-inf")  # never generated
            beam, token, scores, lengths, finished = beam_step(  # shared with the GPT's beam search (chapter 8)
                logp.view(batch, k, -1), scores, lengths, finished, length_penalty=length_penalty, end_id=end_id,
                fill_id=pad_id)  # a finished hypothesis can only be padded, at no cost
            rows = (torch.arange(batch, device=src.device)[:, None] * k + beam).flatten()
            seqs = torch.cat([seqs[rows], token.flatten()[:, None]], dim=1)
            if bool(finished.all()):
                break
    finally:
        model.train(was_training)
    best = best_beam(scores, lengths, finished, length_penalty)
    rows = seqs.view(batch, k, -1)[torch.arange(batch), best].tolist()
    out = [_strip([t for t in row if t != pad_id], end_id) for row in rows]
    if return_scores:
        return out, scores[torch.arange(batch), best].tolist()
    return out


@torch.no_grad()
def sequence_log_prob(model, src: torch.Tensor, outputs) -> torch.Tensor:
    """``log P(y | x)`` of each output ``y`` (token lists without specials) followed by the end token."""
    _, start_id, end_id = _model_ids(model)
    outputs = [list(o) + [end_id] for o in outputs]
    if len(outputs) != src.shape[0]:
        raise ValueError(f"got {src.shape[0]} sources but {len(outputs)} outputs")
    _, tgt_in, targets = collate([[0]] * len(outputs), [o[:-1] for o in outputs])
    was_training = model.training
    model.eval()
    try:
        logits, _ = model(src, tgt_in.to(src.device))
    finally:
        model.train(was_training)
    logp = torch.log_softmax(logits.float(), dim=-1)
    targets = targets.to(src.device)
    real = targets != model.config.pad_id
    picked = logp.gather(-1, targets.clamp(min=0)[..., None])[..., 0]
    return (picked * real).sum(dim=1)


def exact_match(predictions, references) -> float:
    """The fraction of predictions equal to their reference (whole sequences: one wrong token is a miss)."""
    predictions, references = list(predictions), list(references)
    if len(predictions) != len(references) or not predictions:
        raise ValueError(f"need as many predictions as references (and at least one), got {len(predictions)} and "
                         f"{len(references)}")
    return sum(p == r for p, r in zip(predictions, references)) / len(references)


@torch.no_grad()
def cross_attention_weights(model, src: torch.Tensor, tgt_in: torch.Tensor) -> list[torch.Tensor]:
    """The cross-attention weights of every decoder layer, ``(batch, n_heads, tgt_len, src_len)`` each.

    Row ``i`` of a head's matrix is how decoder position ``i`` (predicting the token after ``tgt_in[:, i]``)
    spreads its attention over the source tokens; padded source positions get weight exactly 0. The weights are
    recomputed, with :meth:`MultiHeadAttention.forward`'s ``need_weights=True``, from the inputs each
    cross-attention module receives during a normal forward pass.
    """
    captured = []

    def hook(module, args, kwargs, output):
        x, context = args[0], args[1] if len(args) > 1 else kwargs.get("context")
        captured.append(module.forward(x, context, mask=kwargs.get("mask"), need_weights=True)[1])  # no hooks

    handles = [block.cross_attention.register_forward_hook(hook, with_kwargs=True) for block in model.decoder]
    was_training = model.training
    model.eval()
    try:
        model(src, tgt_in)
    finally:
        model.train(was_training)
        for h in handles:
            h.remove()
    return captured
