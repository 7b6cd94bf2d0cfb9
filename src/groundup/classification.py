"""Sequence classification (chapter 13): which play does a passage of Shakespeare come from?

    train, test = play_passages()                       # 64-character passages of 4 plays, split by scene
    majority_accuracy(train, test)                      # the floor: always answer the commonest play
    ngram_baseline(train, test).accuracy                # bag of character 1-3-grams + logistic regression
    word_order_task(train)                              # another task: real passage or its words shuffled?
    head = ClassifierHead(gpt, n_classes=len(train.classes))   # pools the body's final hidden states
    logits = head(ids)                                  # (batch, n_classes)
    head = classifier_for(body, 4, "lora", seed=0)       # or "scratch", "probe", "full": what trains
    fine_tune(head, ids, labels, steps=150, lr=2e-3)    # AdamW on the trainable parameters
    accuracy_and_loss(head, test_ids, test_labels)
    train.select(balanced_subset(train.labels, 128))    # few labels: 64 of each class, seeded
    fit_probe(head, ids, labels, sections)               # frozen body: logistic regression, l2 by held-out scenes
    lm_scores(gpt, ids)                                 # the language model's mean loss on each passage

The task is built deterministically from :func:`groundup.data.shakespeare_works`. Passages are cut from the
spoken text only (speaker names and stage directions removed: "HAMLET." above a speech would give the answer
away), and whole scenes go to one split or the other, never a passage of one scene to both, so a test passage
shares no text, and no scene, with the training passages.
"""

from __future__ import annotations

import math
import numbers
import random
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pad_sequence

from groundup.utils import positive_int

DEFAULT_PLAYS = ("HAMLET, PRINCE OF DENMARK", "MACBETH", "A MIDSUMMER NIGHT'S DREAM", "THE TEMPEST")
"""Four plays readers know: two tragedies, two comedies with spirits and magic."""

_HEADING = re.compile(r"^\s*(ACT|Act|SCENE|Scene)\s+([IVXLC]+|\d+)\b.*$", re.MULTILINE)  # "ACT I.", "Scene II. ..."
_STAGE_DIRECTION = re.compile(r"[\[{][^\]]*\]")  # "[Enter Horatio and Marcellus.]", over lines; a typo's "{...]"
_NAME_WORD = re.compile(r"[A-Z][A-Za-z'.,-]*|and|of|the|&")  # "Ber.", "KING.", "First Lord.", "Mar. and Ber."
MAX_SPEAKER_CHARS = 40


# ---- the task: passages of k plays, split by scene ------------------------------------------------------------

def play_scenes(work: str) -> list[str]:
    """The text of each act or scene of a play, in order: the parts between its "ACT ..." / "SCENE ..." headings.

    Whatever precedes the first heading (title, cast list) is dropped. A work without headings (a poem) has none.
    """
    heads = list(_HEADING.finditer(work))
    return [work[h.end():nxt.start() if nxt else len(work)] for h, nxt in zip(heads, heads[1:] + [None])]


def _paragraphs(text: str) -> list[list[str]]:
    """The non-empty lines of each paragraph (paragraphs are separated by empty lines); stage directions removed.

    A paragraph left holding a "]" is the end of a direction whose "[" was misplaced in the source: dropped too.
    """
    paragraphs = (p.split("\n") for p in re.split(r"\n\s*\n", _STAGE_DIRECTION.sub("", text)) if "]" not in p)
    return [lines for lines in ([ln.rstrip() for ln in p if ln.strip()] for p in paragraphs) if lines]


def _looks_like_speaker(line: str) -> bool:
    line = line.strip()
    shouted = line.upper() == line and sum(c.isalpha() for c in line) >= 2  # "THESEUS" (no full stop)
    return (len(line) <= MAX_SPEAKER_CHARS and (line.endswith(".") or shouted)
            and all(_NAME_WORD.fullmatch(word) for word in line.split()))


def speaker_names(work: str) -> set[str]:
    """The speaker headings in a play's text: short capitalised lines ending in a full stop ("Ber.", "First Lord.")
    or in capitals ("THESEUS") that open a paragraph of several lines (a heading above its speech)."""
    return {lines[0].strip() for lines in _paragraphs(work) if len(lines) > 1 and _looks_like_speaker(lines[0])}


def spoken_text(scene: str, *, names: set[str] | None = None) -> str:
    """The words spoken in ``scene``: stage directions ``[...]`` and speaker headings removed, one line per line.

    A paragraph's first line is a speaker heading if it is one of ``names`` (default: :func:`speaker_names` of the
    scene itself; pass the whole play's, which also catches a heading standing alone above an indented song).
    """
    names = speaker_names(scene) if names is None else names
    lines = []
    for par_lines in _paragraphs(scene):
        lines.extend(par_lines[1:] if par_lines[0].strip() in names else par_lines)
    return "\n".join(lines)


@dataclass(frozen=True)
class Passages:
    """Labelled passages: ``texts[i]`` comes from play ``classes[labels[i]]``, scene ``sections[i]``."""

    texts: tuple[str, ...]
    labels: tuple[int, ...]
    sections: tuple[str, ...]  # "MACBETH #3": the play and the index of the scene in play_scenes
    classes: tuple[str, ...]

    def __len__(self) -> int:
        return len(self.texts)

    def counts(self) -> list[int]:
        """The number of passages of each class."""
        counts = Counter(self.labels)
        return [counts[c] for c in range(len(self.classes))]

    def select(self, rows: Sequence[int]) -> Passages:
        """The passages at indices ``rows``, in that order (e.g. a :func:`balanced_subset`)."""
        rows = [int(r) for r in rows]
        return Passages(tuple(self.texts[r] for r in rows), tuple(self.labels[r] for r in rows),
                        tuple(self.sections[r] for r in rows), self.classes)


def _check_fraction(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0.0 < value < 1.0:
        raise ValueError(f"{name} must be a number in (0, 1), got {value!r}")
    return float(value)


def _held_out_scenes(sizes: list[int], fraction: float, seed: str) -> set[int]:
    """Scenes taken in a seeded random order until they hold ``fraction`` of the characters (>= 1, < all)."""
    order = list(range(len(sizes)))
    random.Random(seed).shuffle(order)
    held, total = set(), 0
    for index in order[:-1]:
        if held and total >= fraction * sum(sizes):
            break
        held.add(index)
        total += sizes[index]
    return held


def play_passages(plays: Sequence[str] = DEFAULT_PLAYS, *, passage_chars: int = 64, test_fraction: float = 0.25,
                  seed: int = 0, speakers: bool = False, text: str | None = None,
                  cache_dir=None) -> tuple[Passages, Passages]:
    """The which-play task: ``(train, test)`` passages of ``passage_chars`` characters from ``plays``.

    Each play's scenes (:func:`play_scenes` with spoken text) are shuffled with ``random.Random(f"{seed}:{title}")``
    and held out in that order until the held-out scenes hold ``test_fraction`` of the play's spoken characters (at
    least one scene, and at least one left for training); every scene's spoken text (:func:`spoken_text`) is cut
    into consecutive, non-overlapping passages of exactly ``passage_chars`` characters (a shorter remainder is
    dropped). Passages are ordered by play, scene, position; ``sections`` name the scene by its index among the
    play's scenes with spoken text. ``speakers=True`` keeps the speaker headings (an easier task: the names
    give the play away).
    The same arguments give the same passages on every machine. ``text``: the corpus (default: the
    ``"shakespeare"`` corpus from ``cache_dir``), as :func:`groundup.data.shakespeare_works` reads it.
    """
    from groundup.data import WORK_JOINER, shakespeare_works

    passage_chars = positive_int("passage_chars", passage_chars)
    test_fraction = _check_fraction("test_fraction", test_fraction)
    if isinstance(plays, str) or len(plays) < 2 or len(set(plays)) != len(plays):
        raise ValueError(f"plays must be at least two different titles, got {plays!r}")
    works = shakespeare_works(text, cache_dir=cache_dir)
    unknown = [p for p in plays if p not in works]
    if unknown:
        raise ValueError(f"plays {unknown} are not titles of the corpus; its titles are {list(works)}")
    splits = {"train": ([], [], []), "test": ([], [], [])}
    for label, title in enumerate(plays):
        scenes = play_scenes(works[title])
        names = set() if speakers else speaker_names(WORK_JOINER.join(scenes))  # not the cast list's lines
        scenes = [spoken_text(scene, names=names) for scene in scenes]
        scenes = [scene for scene in scenes if scene]  # an "ACT II" heading right above "SCENE 1" has no text
        if len(scenes) < 2:
            raise ValueError(f"{title!r} has {len(scenes)} scenes with spoken text; a play needs at least two to "
                             "split (poems have no act or scene headings)")
        held_out = _held_out_scenes([len(scene) for scene in scenes], test_fraction, f"{seed}:{title}")
        for index, spoken in enumerate(scenes):
            texts, labels, sections = splits["test" if index in held_out else "train"]
            for start in range(0, len(spoken) - passage_chars + 1, passage_chars):
                texts.append(spoken[start:start + passage_chars])
                labels.append(label)
                sections.append(f"{title} #{index}")
    classes = tuple(plays)
    train, test = (Passages(tuple(t), tuple(la), tuple(s), classes) for t, la, s in splits.values())
    return train, test


WORD_ORDER_CLASSES = ("real", "shuffled")
"""The classes of :func:`word_order_task`: label 0 is a passage as written, 1 the same words in a random order."""
SHUFFLE_TRIES = 10


def _shuffle_words(text: str, rng: random.Random) -> str | None:
    """``text`` with its space-separated words in a random order, or None if no try changed it ("a a", "word")."""
    words = text.split(" ")
    for _ in range(SHUFFLE_TRIES):
        rng.shuffle(words)
        shuffled = " ".join(words)
        if shuffled != text:
            return shuffled
    return None


def word_order_task(passages: Passages, *, seed: int = 0) -> Passages:
    """Real or shuffled? ``passages`` relabelled: every second one (odd index) has its words shuffled, label 1.

    The words are the pieces between single spaces (a newline stays inside its piece, "day\\nAnd"), shuffled with
    ``random.Random(f"{seed}:{section}:{index}")`` until the text changes; a passage no shuffle changes (one word,
    or all words equal) stays as written, label 0. A shuffled passage has exactly the characters of the original
    and the same character n-grams inside words: only n-grams across a space differ, so a bag of character
    n-grams sees little, while a language model notices the broken syntax. Apply it to each split of
    :func:`play_passages` separately: the split by scene is kept, and no passage appears both as written and
    shuffled (a passage is one or the other). ``sections`` are kept; ``classes`` are :data:`WORD_ORDER_CLASSES`.
    """
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise ValueError(f"seed must be an integer, got {seed!r}")
    texts, labels = [], []
    for index, (text, section) in enumerate(zip(passages.texts, passages.sections, strict=True)):
        shuffled = _shuffle_words(text, random.Random(f"{seed}:{section}:{index}")) if index % 2 else None
        texts.append(text if shuffled is None else shuffled)
        labels.append(0 if shuffled is None else 1)
    return Passages(tuple(texts), tuple(labels), passages.sections, WORD_ORDER_CLASSES)


def encode_passages(passages: Passages, tokenizer, *, pad_id: int = 0):
    """Token ids of the passages, right-padded with ``pad_id``: ``(ids (n, L), lengths (n,), labels (n,))``.

    With a character tokenizer every passage has the same length and nothing is padded.
    """
    encoded = [tokenizer.encode(t) for t in passages.texts]
    if any(len(e) == 0 for e in encoded):
        raise ValueError("a passage encodes to no tokens")
    lengths = torch.tensor([len(e) for e in encoded])
    ids = pad_sequence([torch.tensor(e, dtype=torch.long) for e in encoded], batch_first=True, padding_value=pad_id)
    return ids, lengths, torch.tensor(passages.labels)


# ---- honest baselines ----------------------------------------------------------------------------------------

def majority_accuracy(train: Passages, test: Passages) -> float:
    """Test accuracy of always answering the class most frequent in ``train`` (ties: the first such class)."""
    counts = train.counts()
    guess = counts.index(max(counts))
    return sum(label == guess for label in test.labels) / len(test)


def char_ngrams(text: str, orders: Sequence[int] = (1, 2, 3)) -> Counter:
    """Counts of the character n-grams of ``text`` for every n in ``orders``."""
    return Counter(text[i:i + n] for n in orders for i in range(len(text) - n + 1))


@dataclass
class NgramClassifier:
    """A bag of character n-grams, log(1 + count) features, and a multinomial logistic regression (L2)."""

    vocab: dict[str, int]
    orders: tuple[int, ...]
    weight: torch.Tensor  # (n_classes, n_features)
    bias: torch.Tensor  # (n_classes,)
    accuracy: float | None = None  # on the test passages ngram_baseline was given

    def features(self, texts: Sequence[str]) -> torch.Tensor:
        """``log(1 + count)`` of each vocabulary n-gram in each text: ``(len(texts), n_features)``, float64."""
        rows, cols, values = [], [], []
        for row, text in enumerate(texts):
            for gram, count in char_ngrams(text, self.orders).items():
                col = self.vocab.get(gram)
                if col is not None:
                    rows.append(row)
                    cols.append(col)
                    values.append(math.log1p(count))
        x = torch.zeros(len(texts), len(self.vocab), dtype=torch.float64)
        x[rows, cols] = torch.tensor(values, dtype=torch.float64)
        return x

    def predict(self, texts: Sequence[str]) -> torch.Tensor:
        """The most probable class of each text."""
        return (self.features(texts) @ self.weight.T + self.bias).argmax(dim=1)


def fit_logistic_regression(x: torch.Tensor, y: torch.Tensor, n_classes: int, *, l2: float = 1e-3,
                            max_iter: int = 200) -> tuple[torch.Tensor, torch.Tensor]:
    """Minimise ``mean cross-entropy(x W^T + b, y) + l2/2 |W|^2`` with L-BFGS (float64); return ``(W, b)``.

    The objective is strictly convex in ``W`` (for ``l2 > 0``), so the answer does not depend on the start.
    """
    w = torch.zeros(n_classes, x.shape[1], dtype=torch.float64, requires_grad=True)
    b = torch.zeros(n_classes, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([w, b], lr=1.0, max_iter=max_iter, tolerance_grad=1e-10, tolerance_change=1e-14,
                            history_size=20, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = F.cross_entropy(x @ w.T + b, y) + 0.5 * l2 * (w * w).sum()
        loss.backward()
        return loss

    opt.step(closure)
    return w.detach(), b.detach()


def ngram_baseline(train: Passages, test: Passages | None = None, *, orders: Sequence[int] = (1, 2, 3),
                   max_features: int = 2000, l2: float = 1e-3, max_iter: int = 200) -> NgramClassifier:
    """The bag-of-character-n-grams baseline, fitted on ``train`` (and its accuracy on ``test`` if given).

    The vocabulary is the ``max_features`` n-grams most frequent in the training passages (ties broken by the
    n-gram's text, so it is deterministic); features are ``log(1 + count)``; the classifier is the logistic
    regression of :func:`fit_logistic_regression`. No word order beyond n characters, no pretraining: the floor a
    transformer must beat.
    """
    orders = tuple(orders)
    if not orders or not all(isinstance(n, int) and n >= 1 for n in orders):
        raise ValueError(f"orders must be positive integers such as (1, 2, 3), got {orders!r}")
    totals = Counter()
    for text in train.texts:
        totals.update(char_ngrams(text, orders))
    kept = sorted(totals, key=lambda g: (-totals[g], g))[:max_features]
    model = NgramClassifier({g: i for i, g in enumerate(kept)}, orders, torch.empty(0), torch.empty(0))
    model.weight, model.bias = fit_logistic_regression(model.features(train.texts), torch.tensor(train.labels),
                                                       len(train.classes), l2=l2, max_iter=max_iter)
    if test is not None:
        model.accuracy = (model.predict(test.texts) == torch.tensor(test.labels)).double().mean().item()
    return model


# ---- a classification head on a pretrained body ---------------------------------------------------------------

POOLINGS = ("last", "mean", "first")


class ClassifierHead(nn.Module):
    """A linear classifier on a body's pooled final hidden states: ``head(ids) -> logits (batch, n_classes)``.

    ``body`` is a :class:`~groundup.models.GPT` or :class:`~groundup.models.MaskedLM` (anything with
    ``hidden_states(ids)``). ``pooling`` turns the states ``(batch, seq, d_model)`` into one vector per sequence:

    * ``"last"`` (default for a causal body, a GPT): the last token's state, the only position that has attended
      to the whole passage (Radford et al. 2018 classify from the last token's state in the same way).
    * ``"mean"`` (default for a bidirectional body, the masked LM): the mean over positions. Every position of a
      masked LM has seen the whole passage, but none was trained to summarise it: chapter 9's model has no [CLS]
      token whose state pre-training shaped into a summary, so averaging uses every position's evidence.
    * ``"first"``: the first position's state (BERT's [CLS] choice; meaningful after fine-tuning only).

    ``lengths`` (batch,) gives each sequence's length when right-padded: pooling then ignores the padding. A
    causal body's states at real positions never see the padding; a bidirectional body's do, so it refuses padded
    batches (give it equal-length passages). A bidirectional body reads a sequence longer than its context in
    consecutive windows of ``context_length`` tokens (the last may be shorter), each encoded on its own, and the
    states of all windows are pooled together (chapter 9's masked LM has a context of 32 characters; a 64-character
    passage is two windows). A causal body refuses sequences longer than its context. The linear layer starts at
    zero: the head's first predictions are uniform (loss ln n_classes), whatever the body.
    """

    def __init__(self, body: nn.Module, n_classes: int, *, pooling: str | None = None, dropout: float = 0.0):
        super().__init__()
        if not hasattr(body, "hidden_states") or not hasattr(body, "config"):
            raise TypeError(f"body must be a GPT or MaskedLM (with hidden_states), got {type(body).__name__}")
        if isinstance(n_classes, bool) or not isinstance(n_classes, numbers.Integral) or n_classes < 2:
            raise ValueError(f"n_classes must be an integer >= 2, got {n_classes!r}")
        causal = getattr(body, "causal", True)
        pooling = ("last" if causal else "mean") if pooling is None else pooling
        if pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {POOLINGS}, got {pooling!r}")
        self.body, self.pooling, self.causal = body, pooling, causal
        self.dropout = nn.Dropout(dropout)
        weight = next(body.parameters())
        self.linear = nn.Linear(body.config.d_model, int(n_classes), dtype=weight.dtype, device=weight.device)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def pool(self, states: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
        """One vector per sequence, ``(batch, d_model)``, from ``states (batch, seq, d_model)``."""
        batch, seq, _ = states.shape
        if lengths is None:
            lengths = torch.full((batch,), seq, device=states.device)
        elif lengths.shape != (batch,) or int(lengths.min()) < 1 or int(lengths.max()) > seq:
            raise ValueError(f"lengths must have shape ({batch},) with values in [1, {seq}], got "
                             f"{tuple(lengths.shape)} with values {lengths.tolist()[:8]}")
        if self.pooling == "first":
            return states[:, 0]
        if self.pooling == "last":
            return states[torch.arange(batch, device=states.device), lengths - 1]
        keep = torch.arange(seq, device=states.device) < lengths[:, None]
        return (states * keep[..., None]).sum(dim=1) / lengths[:, None].to(states.dtype)

    def features(self, idx: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
        """The pooled vectors ``(batch, d_model)`` that the linear layer reads (dropout not applied)."""
        if lengths is not None and not self.causal and bool((lengths != idx.shape[1]).any()):
            raise ValueError("a bidirectional body (MaskedLM) attends to padding too, so its states depend on it; "
                             "give it equal-length sequences (lengths all equal to idx.shape[1])")
        n_c = self.body.config.context_length
        if self.causal or idx.shape[1] <= n_c:
            states = self.body.hidden_states(idx)
        else:
            states = torch.cat([self.body.hidden_states(window) for window in idx.split(n_c, dim=1)], dim=1)
        return self.pool(states, lengths)

    def forward(self, idx: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
        return self.linear(self.dropout(self.features(idx, lengths)))


@torch.no_grad()
def predict(head: ClassifierHead, ids: torch.Tensor, lengths: torch.Tensor | None = None, *,
            batch_size: int = 256) -> torch.Tensor:
    """The predicted class of every row of ``ids``, in batches, in eval mode (the mode is restored after)."""
    was_training = head.training
    head.eval()
    try:
        out = [head(ids[i:i + batch_size], None if lengths is None else lengths[i:i + batch_size]).argmax(dim=1)
               for i in range(0, len(ids), batch_size)]
    finally:
        head.train(was_training)
    return torch.cat(out)


# ---- fine-tuning the head (and the body, or adapters on it) -----------------------------------------------------

METHODS = ("scratch", "probe", "full", "lora")
"""How much of a pretrained body a classifier trains: ``scratch`` (the same architecture, randomly initialised, all
weights), ``probe`` (the pretrained body frozen, the linear head alone), ``full`` (every weight), ``lora``
(low-rank adapters on the body's attention projections, and the head)."""
ATTENTION_PROJECTIONS = ("W_q", "W_k", "W_v", "W_o")


def classifier_for(body: nn.Module, n_classes: int, method: str, *, seed: int = 0, pooling: str | None = None,
                   lora_rank: int = 8, lora_alpha: float = 16.0,
                   lora_targets: Sequence[str] = ATTENTION_PROJECTIONS) -> ClassifierHead:
    """A :class:`ClassifierHead` on ``body`` with exactly the parameters ``method`` trains requiring gradients.

    ``body`` is modified in place for ``probe`` (frozen), ``full`` (unfrozen) and ``lora`` (adapters attached with
    :func:`groundup.lora.attach_lora`, everything else frozen); pass a copy to keep the original. ``scratch``
    builds a new body of the same class and config and leaves ``body`` alone. ``torch.manual_seed(seed)`` is
    called first, so the scratch body's weights and the adapters' ``A`` depend on ``seed`` only. The head's linear
    layer always trains.
    """
    from groundup.lora import attach_lora

    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    torch.manual_seed(seed)  # the scratch body's initialisation, the adapters' A
    if method == "scratch":
        weight = next(body.parameters())
        body = type(body)(body.config).to(dtype=weight.dtype, device=weight.device)
    elif method == "lora":
        attach_lora(body, lora_targets, r=lora_rank, alpha=lora_alpha)
    else:
        for p in body.parameters():
            p.requires_grad_(method == "full")
    if method == "scratch":
        for p in body.parameters():
            p.requires_grad_(True)
    return ClassifierHead(body, n_classes, pooling=pooling)


@dataclass
class FineTuneHistory:
    """What :func:`fine_tune` did: the mean training loss over each stretch of ``log_every`` steps."""

    step: list[int]  # the last step (1-based) of each stretch
    train_loss: list[float]
    seconds: float


def fine_tune(head: ClassifierHead, ids: torch.Tensor, labels: torch.Tensor, *, steps: int, batch_size: int = 32,
              lr: float = 1e-3, warmup: int = 0, weight_decay: float = 0.0, seed: int = 0,
              log_every: int | None = None, callback=None) -> FineTuneHistory:
    """Train the parameters of ``head`` that require gradients on ``(ids, labels)`` with AdamW and cross-entropy.

    Batches of ``batch_size`` rows are taken in order from random permutations of the data (one permutation an
    epoch, from a generator seeded with ``seed``); the learning rate warms up linearly over ``warmup`` steps, then
    decays on a cosine to a tenth (:func:`groundup.training.lr_at`). Frozen parameters are left bit for bit as
    they were. The head is put in train mode and back in eval mode at the end. ``callback(step, head)``, if given,
    is called after every step (``step`` counts from 1): early stopping reads held-out accuracy there; the head is
    put back in train mode after it returns.
    """
    import time

    from groundup.training import TrainConfig, lr_at

    steps, batch_size = positive_int("steps", steps), positive_int("batch_size", batch_size)
    if ids.dim() != 2 or labels.shape != (len(ids),):
        raise ValueError(f"ids must be (n, seq) and labels (n,), got {tuple(ids.shape)} and {tuple(labels.shape)}")
    if not 1 <= batch_size <= len(ids):
        raise ValueError(f"batch_size must be at most the number of examples ({len(ids)}), got {batch_size}")
    trainable = [p for p in head.parameters() if p.requires_grad]
    if not trainable:
        raise ValueError("the head has no parameters that require gradients: nothing to train")
    schedule = TrainConfig(batch_size=batch_size, max_steps=steps, learning_rate=lr, warmup_steps=warmup,
                           eval_interval=steps, progress=False)
    optimizer = torch.optim.AdamW(trainable, lr=lr, weight_decay=weight_decay, fused=True)  # IEEE sqrt on every CPU
    generator = torch.Generator().manual_seed(seed)
    log_every = log_every or max(1, steps // 30)
    order, position, losses = torch.randperm(len(ids), generator=generator), 0, []
    history, start = FineTuneHistory([], [], 0.0), time.perf_counter()
    head.train()
    for step in range(steps):
        if position + batch_size > len(ids):
            order, position = torch.randperm(len(ids), generator=generator), 0
        rows = order[position:position + batch_size]
        position += batch_size
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, schedule)
        loss = F.cross_entropy(head(ids[rows]), labels[rows])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        if (step + 1) % log_every == 0 or step + 1 == steps:
            history.step.append(step + 1)
            history.train_loss.append(sum(losses) / len(losses))
            losses = []
        if callback is not None:
            callback(step + 1, head)
            head.train()
    head.eval()
    history.seconds = time.perf_counter() - start
    return history


@torch.no_grad()
def accuracy_and_loss(head: ClassifierHead, ids: torch.Tensor, labels: torch.Tensor, *,
                      batch_size: int = 256) -> tuple[float, float]:
    """``(accuracy, mean cross-entropy in nats)`` of ``head`` on ``(ids, labels)``, in eval mode."""
    was_training = head.training
    head.eval()
    try:
        logits = torch.cat([head(ids[i:i + batch_size]) for i in range(0, len(ids), batch_size)]).double()
    finally:
        head.train(was_training)
    return (logits.argmax(1) == labels).double().mean().item(), F.cross_entropy(logits, labels).item()


# ---- few labels: balanced subsets, probes fitted to convergence, the language model's own score ----------------

def balanced_subset(labels: Sequence[int], n: int, *, seed: int = 0) -> list[int]:
    """``n`` indices into ``labels``, ``n / k`` of each of the ``k`` classes present, in increasing order.

    One permutation of all indices (``torch.randperm`` seeded with ``seed``) is walked, keeping an index while its
    class has fewer than ``n / k``: a smaller subset of the same seed is contained in a larger one.
    """
    classes = sorted(set(int(c) for c in labels))
    if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < len(classes) or n % len(classes):
        raise ValueError(f"n must be a positive multiple of the number of classes ({len(classes)}), got {n!r}")
    counts = Counter(int(c) for c in labels)
    if min(counts.values()) < n // len(classes):
        raise ValueError(f"n={n} needs {n // len(classes)} passages of each class; the rarest class has "
                         f"{min(counts.values())}")
    taken, rows = Counter(), []
    for row in torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed)).tolist():
        if taken[int(labels[row])] < n // len(classes):
            taken[int(labels[row])] += 1
            rows.append(row)
    return sorted(rows)


def scene_folds(sections: Sequence[str], k: int = 4, *, seed: int = 0) -> list[int]:
    """A fold in ``0 .. k-1`` for every passage, whole scenes (equal ``sections``) to one fold.

    The scenes are shuffled with ``random.Random(f"{seed}:folds")`` and each in turn goes to the fold holding the
    fewest passages so far, so the folds are about equal in size and a held-out fold shares no scene with the rest.
    """
    counts = Counter(sections)
    if isinstance(k, bool) or not isinstance(k, numbers.Integral) or not 2 <= k <= len(counts):
        raise ValueError(f"k must be an integer from 2 to the number of scenes ({len(counts)}), got {k!r}")
    scenes = sorted(counts)
    random.Random(f"{seed}:folds").shuffle(scenes)
    sizes, fold_of = [0] * k, {}
    for scene in scenes:
        fold_of[scene] = sizes.index(min(sizes))
        sizes[fold_of[scene]] += counts[scene]
    return [fold_of[s] for s in sections]


def fit_standardised_logistic_regression(x: torch.Tensor, y: torch.Tensor, n_classes: int, *, l2: float = 1e-3,
                                         max_iter: int = 200) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`fit_logistic_regression` on the features standardised with their mean and standard deviation over
    the rows of ``x`` (a constant feature is only centred), returned as ``(W, b)`` for the raw features."""
    x = x.double()
    mean, std = x.mean(dim=0), x.std(dim=0, unbiased=False)
    std = torch.where(std > 0, std, torch.ones_like(std))
    w, b = fit_logistic_regression((x - mean) / std, y, n_classes, l2=l2, max_iter=max_iter)
    return w / std, b - (w / std) @ mean


PROBE_L2 = (1e-4, 1e-3, 1e-2, 1e-1, 1.0, 10.0, 100.0, 1000.0)  # wide: few labels want a large l2


@torch.no_grad()
def pooled_features(head: ClassifierHead, ids: torch.Tensor, *, batch_size: int = 256) -> torch.Tensor:
    """``head.features`` of every row of ``ids`` in eval mode, as float64 ``(n, d_model)``."""
    was_training = head.training
    head.eval()
    try:
        return torch.cat([head.features(ids[i:i + batch_size]) for i in range(0, len(ids), batch_size)]).double()
    finally:
        head.train(was_training)


def cross_validate_l2(x: torch.Tensor, y: torch.Tensor, n_classes: int, sections: Sequence[str], *,
                      l2_grid: Sequence[float] = PROBE_L2, folds: int = 4, seed: int = 0, max_iter: int = 200,
                      fit=fit_standardised_logistic_regression) -> dict:
    """The ``l2`` of ``l2_grid`` whose ``fit(x, y, n_classes, l2=...)`` predicts held-out scenes best.

    Every ``l2`` is fitted on all but one of ``folds`` groups of whole scenes (:func:`scene_folds` of ``sections``
    with ``seed``) and scored on the held-out one; the chosen ``l2`` has the lowest held-out cross-entropy over all
    rows (ties: the larger ``l2``). Returns it with each ``l2``'s held-out cross-entropy and accuracy.
    """
    if not l2_grid or any(isinstance(v, bool) or not isinstance(v, numbers.Real) or v <= 0 for v in l2_grid):
        raise ValueError(f"l2_grid must be positive numbers, got {l2_grid!r}")
    x, y = x.double(), y.long()
    fold = torch.tensor(scene_folds(sections, folds, seed=seed))
    losses, accuracies = [], []
    for l2 in l2_grid:
        logits = torch.empty(len(y), n_classes, dtype=torch.float64)
        for f in range(folds):
            w, b = fit(x[fold != f], y[fold != f], n_classes, l2=l2, max_iter=max_iter)
            logits[fold == f] = x[fold == f] @ w.T + b
        losses.append(F.cross_entropy(logits, y).item())
        accuracies.append((logits.argmax(1) == y).double().mean().item())
    best = min(range(len(l2_grid)), key=lambda i: (losses[i], -l2_grid[i]))
    return {"l2": float(l2_grid[best]), "l2_grid": [float(v) for v in l2_grid], "folds": folds,
            "held_out_loss": losses, "held_out_accuracy": accuracies}


def fit_probe(head: ClassifierHead, ids: torch.Tensor, labels: torch.Tensor, sections: Sequence[str], *,
              l2_grid: Sequence[float] = PROBE_L2, folds: int = 4, seed: int = 0, max_iter: int = 200) -> dict:
    """Set ``head.linear`` to a logistic regression on the body's pooled states, fitted to convergence.

    The states are standardised (:func:`fit_standardised_logistic_regression`); the ``l2`` is the one of
    ``l2_grid`` that predicts held-out training scenes best (:func:`cross_validate_l2`), refitted on all the
    passages. Nothing of a test set is seen. Returns :func:`cross_validate_l2`'s answer.
    """
    x, y, k = pooled_features(head, ids), labels.long(), head.linear.out_features
    chosen = cross_validate_l2(x, y, k, sections, l2_grid=l2_grid, folds=folds, seed=seed, max_iter=max_iter)
    w, b = fit_standardised_logistic_regression(x, y, k, l2=chosen["l2"], max_iter=max_iter)
    with torch.no_grad():
        head.linear.weight.copy_(w)
        head.linear.bias.copy_(b)
    return chosen


@torch.no_grad()
def lm_scores(model: nn.Module, ids: torch.Tensor, *, batch_size: int = 256) -> torch.Tensor:
    """Each row's mean next-token loss (nats, float64) under a causal language model: ``(n,)``.

    Position ``t`` is predicted from positions ``< t`` for ``t = 1 .. seq-1`` (the first token has no context).
    A language model's own surprise at a passage: one number per passage, no labels needed to compute it.
    """
    if not getattr(model, "causal", True):
        raise ValueError("lm_scores needs a causal language model (a GPT); a masked LM predicts no next token")
    if ids.dim() != 2 or ids.shape[1] < 2:
        raise ValueError(f"ids must be (n, seq) with seq >= 2, got {tuple(ids.shape)}")
    was_training = model.training
    model.eval()
    try:
        out = []
        for i in range(0, len(ids), batch_size):
            rows = ids[i:i + batch_size]
            logits, _ = model(rows[:, :-1])
            logp = torch.log_softmax(logits.double(), dim=-1).gather(-1, rows[:, 1:, None])[..., 0]
            out.append(-logp.mean(dim=1))
    finally:
        model.train(was_training)
    return torch.cat(out)
