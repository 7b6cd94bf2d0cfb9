"""Tokenizers: text -> a list of integer ids -> text (chapter 2).

Two tokenizers with the same interface (``encode``, ``decode``, ``vocab_size``, ``save``, ``load``):

- :class:`CharTokenizer`: one id per character seen in a text; characters it has never seen are an error.
- :class:`BPETokenizer`: byte-level byte-pair encoding (Sennrich et al. 2016; the GPT-2 flavour of Radford
  et al. 2019). Ids 0..255 are the 256 byte values, so *every* string can be encoded and decoded back
  exactly; ids 256.. are the learned merges in the order they were learned; the special tokens come last.

Training (:meth:`BPETokenizer.train`) is the incremental algorithm: the text is split into chunks with a
regular expression (``GPT2_SPLIT_PATTERN``), identical chunks are counted once, and after each merge only
the chunks that contain the merged pair are updated. The pair to merge is chosen by this rule:

    **the most frequent adjacent pair; among equally frequent pairs, the smallest pair (a, b) of ids,
    compared first by a, then by b.**

That is exactly what the textbook algorithm (recount every pair after every merge) picks, so both learn
the same merges; the tests check it on random texts.

The save format is JSON (see :meth:`BPETokenizer.save`): a ``"format"`` name and ``"version"``, the split
pattern, the merges as pairs of ids, and the special tokens with their ids.
"""

from __future__ import annotations

import heapq
import json
import os
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence

import regex

__all__ = ["GPT2_SPLIT_PATTERN", "CharTokenizer", "BPETokenizer", "learn_merges", "merge"]

#: The pre-tokenization pattern of GPT-2 (Radford et al. 2019): contractions, runs of letters or of digits
#: (each with at most one leading space), runs of other symbols, and whitespace. BPE merges never cross the
#: boundaries of these chunks, so a token never glues a word to the punctuation or the word after it.
GPT2_SPLIT_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""

CHAR_FORMAT = "groundup-char-tokenizer"
BPE_FORMAT = "groundup-bpe-tokenizer"
FORMAT_VERSION = 1
CACHE_SIZE = 200_000  # distinct chunks whose encoding BPETokenizer.encode remembers (then it starts afresh)


# --------------------------------------------------------------------------------------------------------
# Shared helpers
# --------------------------------------------------------------------------------------------------------

def _check_text(text, name: str = "text") -> None:
    if not isinstance(text, str):
        raise TypeError(f"{name} must be a str, got {type(text).__name__}")


def _check_ids(ids, vocab_size: int) -> list[int]:
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Iterable):
        raise TypeError(f"ids must be a list of ints, got {type(ids).__name__}")
    ids = list(ids)
    bad = [i for i in ids if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < vocab_size]
    if bad:
        raise ValueError(f"ids must be integers in [0, {vocab_size}); got {bad[:5]!r}")
    return ids


def _read_json(path, expected_format: str) -> dict:
    """Read a tokenizer file and check its format name and version; clear ValueErrors otherwise."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{os.fspath(path)!r} is not a groundup tokenizer file: it is not valid JSON ({err})") \
            from None
    if not isinstance(data, dict) or "format" not in data:
        raise ValueError(f"{os.fspath(path)!r} is not a groundup tokenizer file: expected a JSON object with "
                         f"\"format\": \"{expected_format}\" (files of other libraries cannot be loaded)")
    if data["format"] != expected_format:
        raise ValueError(f"{os.fspath(path)!r} has format {data['format']!r}, expected {expected_format!r}")
    if data.get("version") != FORMAT_VERSION:
        raise ValueError(f"{os.fspath(path)!r} has format version {data.get('version')!r}; "
                         f"this groundup reads version {FORMAT_VERSION}")
    return data


def _corrupt(path, what: str) -> ValueError:
    return ValueError(f"{os.fspath(path)!r} is a corrupt tokenizer file: {what}")


# --------------------------------------------------------------------------------------------------------
# Characters
# --------------------------------------------------------------------------------------------------------

class CharTokenizer:
    """One token per character: the vocabulary is the sorted set of characters of a text.

    >>> tok = CharTokenizer.from_text("hello")
    >>> tok.encode("hole"), tok.decode([3, 2])
    ([3, 2, 1, 0], 'ol')
    """

    def __init__(self, chars: Sequence[str]):
        chars = list(chars)
        if not all(isinstance(c, str) and len(c) == 1 for c in chars):
            raise ValueError("chars must be a sequence of single characters")
        if len(set(chars)) != len(chars):
            raise ValueError("chars must not contain a character twice")
        self.chars = chars
        self.stoi = {c: i for i, c in enumerate(chars)}

    @classmethod
    def from_text(cls, text: str) -> CharTokenizer:
        """The tokenizer whose vocabulary is every distinct character of ``text``, sorted."""
        _check_text(text)
        return cls(sorted(set(text)))

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> list[int]:
        """The id of each character; ``ValueError`` naming the characters the vocabulary does not have."""
        _check_text(text)
        try:
            return [self.stoi[c] for c in text]
        except KeyError:
            unseen = sorted(set(text) - self.stoi.keys())
            raise ValueError(f"text contains {len(unseen)} character(s) not in the vocabulary: "
                             f"{', '.join(map(repr, unseen[:10]))}; a character tokenizer can only encode "
                             f"characters of the text it was built from") from None

    def decode(self, ids: Sequence[int]) -> str:
        """The characters of ``ids``, joined."""
        return "".join(self.chars[i] for i in _check_ids(ids, self.vocab_size))

    def save(self, path) -> None:
        """Write ``{"format": "groundup-char-tokenizer", "version": 1, "chars": [...]}`` as JSON."""
        with open(path, "w", encoding="utf-8") as f:
            json.dump({"format": CHAR_FORMAT, "version": FORMAT_VERSION, "chars": self.chars}, f,
                      ensure_ascii=False, indent=1)
            f.write("\n")

    @classmethod
    def load(cls, path) -> CharTokenizer:
        """Read a file written by :meth:`save`; ``ValueError`` for corrupt files or other formats."""
        data = _read_json(path, CHAR_FORMAT)
        try:
            return cls(data["chars"])
        except (KeyError, TypeError, ValueError) as err:
            raise _corrupt(path, f"\"chars\" must be a list of distinct single characters ({err})") from None

    def __repr__(self) -> str:
        return f"CharTokenizer(vocab_size={self.vocab_size})"


# --------------------------------------------------------------------------------------------------------
# Byte-pair encoding
# --------------------------------------------------------------------------------------------------------

def merge(ids: list[int], pair: tuple[int, int], new_id: int) -> list[int]:
    """Replace every occurrence of ``pair`` in ``ids`` by ``new_id``, scanning left to right.

    Overlaps resolve to the left: merging (a, a) in [a, a, a] gives [aa, a].
    """
    a, b = pair
    out = []
    i, n = 0, len(ids)
    while i < n:
        if ids[i] == a and i + 1 < n and ids[i + 1] == b:
            out.append(new_id)
            i += 2
        else:
            out.append(ids[i])
            i += 1
    return out


def learn_merges(chunks: Sequence[Sequence[int]], counts: Sequence[int], n_merges: int) -> list[tuple[int, int]]:
    """The incremental BPE trainer: up to ``n_merges`` merges learned from ``chunks`` (id lists) x ``counts``.

    Why it is fast. The textbook algorithm recounts every pair of the whole text after each merge. Here
    (1) identical chunks are handled once, weighted by how often they occur; (2) ``pair_counts`` and the
    index ``where`` (pair -> chunks containing it) are kept up to date, and a merge only visits the chunks
    that contain the merged pair, i.e. a tiny part of the text; (3) the most frequent pair comes from a heap
    of ``(-count, pair)`` entries in which outdated entries are skipped when popped ("lazy deletion").
    Ties go to the smallest pair, the same rule the textbook algorithm uses, so both learn the same merges.
    New ids start at 256. Stops early when no adjacent pair is left.
    """
    words = [list(c) for c in chunks]
    pair_counts: dict[tuple[int, int], int] = defaultdict(int)
    where: dict[tuple[int, int], set[int]] = defaultdict(set)
    for i, (w, n) in enumerate(zip(words, counts, strict=True)):
        for p in zip(w, w[1:], strict=False):
            pair_counts[p] += n
            where[p].add(i)
    heap = [(-n, p) for p, n in pair_counts.items()]
    heapq.heapify(heap)
    merges: list[tuple[int, int]] = []
    while len(merges) < n_merges and heap:
        neg, pair = heapq.heappop(heap)
        if pair_counts.get(pair, 0) != -neg:
            continue  # an outdated entry: the count changed after it was pushed
        new_id = 256 + len(merges)
        merges.append(pair)
        touched = set()
        for i in where.pop(pair):
            old = words[i]
            new = merge(old, pair, new_id)
            if len(new) == len(old):
                continue  # the chunk lost this pair in an earlier merge
            n = counts[i]
            for p in zip(old, old[1:], strict=False):
                pair_counts[p] -= n
                touched.add(p)
            for p in zip(new, new[1:], strict=False):
                pair_counts[p] += n
                where[p].add(i)
                touched.add(p)
            words[i] = new
        del pair_counts[pair]
        touched.discard(pair)
        for p in touched:
            n = pair_counts[p]
            if n > 0:
                heapq.heappush(heap, (-n, p))
            else:
                del pair_counts[p]
    return merges


class BPETokenizer:
    """Byte-level byte-pair encoding with a regex pre-tokenizer and special tokens.

    Ids 0..255 are bytes, ids ``256 + k`` the ``k``-th merge ``merges[k] = (a, b)``, and the special tokens
    take the last ids. ``decode(encode(s)) == s`` for every string ``s``. Special tokens are matched in
    the text before anything else, so they are never split; ordinary text never produces their ids.
    """

    def __init__(self, merges: Sequence[tuple[int, int]] = (), *, pattern: str | None = GPT2_SPLIT_PATTERN,
                 special_tokens: Sequence[str] = ()):
        self.merges = [(int(a), int(b)) for a, b in merges]
        for k, (a, b) in enumerate(self.merges):
            if not (0 <= a < 256 + k and 0 <= b < 256 + k):
                raise ValueError(f"merges[{k}] = {(a, b)} uses an id that is not defined before it "
                                 f"(ids must be < {256 + k})")
        if len(set(self.merges)) != len(self.merges):
            raise ValueError("merges must not contain the same pair twice")
        self.pattern = pattern
        self._split = regex.compile(pattern).findall if pattern else (lambda s: [s] if s else [])
        self.special_tokens = _check_special_tokens(special_tokens)
        first_special = 256 + len(self.merges)
        self.special_ids = {s: first_special + k for k, s in enumerate(self.special_tokens)}
        self._special_split = (regex.compile("(" + "|".join(
            regex.escape(s) for s in sorted(self.special_tokens, key=len, reverse=True)) + ")").split
            if self.special_tokens else None)
        self.ranks = {pair: 256 + k for k, pair in enumerate(self.merges)}
        self.vocab: dict[int, bytes] = {i: bytes([i]) for i in range(256)}
        for k, (a, b) in enumerate(self.merges):
            self.vocab[256 + k] = self.vocab[a] + self.vocab[b]
        for s, i in self.special_ids.items():
            self.vocab[i] = s.encode("utf-8")
        self._cache: dict[str, list[int]] = {}

    # ---- training -------------------------------------------------------------------------------------

    @classmethod
    def train(cls, text: str, vocab_size: int, *, pattern: str | None = GPT2_SPLIT_PATTERN,
              special_tokens: Sequence[str] = ()) -> BPETokenizer:
        """Learn ``vocab_size - 256 - len(special_tokens)`` merges from ``text``.

        ``pattern`` splits the text into chunks that merges never cross (``None``: no splitting, the whole
        text is one chunk; fine for demonstrations on short texts, slow on long ones).
        Occurrences of the special tokens in ``text`` are cut out before training. If the text runs out of
        pairs first, the tokenizer has fewer merges and a smaller ``vocab_size``.
        """
        _check_text(text)
        special_tokens = _check_special_tokens(special_tokens)
        if not isinstance(vocab_size, int) or isinstance(vocab_size, bool):
            raise TypeError(f"vocab_size must be an int, got {type(vocab_size).__name__}")
        if vocab_size < 256 + len(special_tokens):
            raise ValueError(f"vocab_size must be at least 256 + len(special_tokens) = "
                             f"{256 + len(special_tokens)} (the 256 bytes come first), got {vocab_size}")
        if pattern is not None and not isinstance(pattern, str):
            raise TypeError(f"pattern must be a regular expression (str) or None, got {type(pattern).__name__}")
        tok = cls((), pattern=pattern, special_tokens=special_tokens)
        counts = Counter()
        for piece in tok._pieces(text):
            if piece not in tok.special_ids:
                counts.update(tok._split(piece))
        chunks = [c.encode("utf-8", "surrogatepass") for c in counts]
        merges = learn_merges(chunks, list(counts.values()), vocab_size - 256 - len(special_tokens))
        return cls(merges, pattern=pattern, special_tokens=special_tokens)

    # ---- encoding and decoding ------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return 256 + len(self.merges) + len(self.special_tokens)

    def _pieces(self, text: str) -> list[str]:
        """``text`` cut at the special tokens (which are kept as pieces of their own)."""
        return self._special_split(text) if self._special_split else [text]

    def _encode_chunk(self, chunk: str) -> list[int]:
        """Apply the merges to one chunk: repeatedly merge the adjacent pair that was learned first."""
        ids = list(chunk.encode("utf-8", "surrogatepass"))
        ranks = self.ranks
        while len(ids) >= 2:
            pair = min(zip(ids, ids[1:], strict=False), key=lambda p: ranks.get(p, 1 << 62))
            new_id = ranks.get(pair)
            if new_id is None:
                break
            ids = merge(ids, pair, new_id)
        return ids

    def encode(self, text: str) -> list[int]:
        """The token ids of ``text`` (special tokens appearing in it become their ids)."""
        _check_text(text)
        out: list[int] = []
        cache = self._cache
        for piece in self._pieces(text):
            special = self.special_ids.get(piece)
            if special is not None:
                out.append(special)
                continue
            for chunk in self._split(piece):
                ids = cache.get(chunk)
                if ids is None:
                    if len(cache) >= CACHE_SIZE:
                        cache.clear()
                    ids = cache[chunk] = self._encode_chunk(chunk)
                out += ids
        return out

    def decode(self, ids: Sequence[int]) -> str:
        """The text of ``ids``. Byte sequences that are not valid UTF-8 decode to U+FFFD characters."""
        data = b"".join(self.vocab[i] for i in _check_ids(ids, self.vocab_size))
        try:
            return data.decode("utf-8", "surrogatepass")
        except UnicodeDecodeError:
            return data.decode("utf-8", "replace")

    def token_str(self, i: int) -> str:
        """A readable form of token ``i`` (invalid UTF-8 shown as U+FFFD), e.g. for tables of merges."""
        return self.vocab[_check_ids([i], self.vocab_size)[0]].decode("utf-8", "replace")

    # ---- saving and loading ---------------------------------------------------------------------------

    def save(self, path) -> None:
        """Write the tokenizer as human-readable JSON, one merge per line::

            {"format": "groundup-bpe-tokenizer", "version": 1,
             "pattern": "...",                 (null: no pre-tokenization)
             "special_tokens": {"<|endoftext|>": 1024},
             "merges": [[32, 116],             (merge k makes id 256 + k from ids a and b)
                        ...]}
        """
        head = {"format": BPE_FORMAT, "version": FORMAT_VERSION, "pattern": self.pattern,
                "special_tokens": self.special_ids}
        lines = [f"  {json.dumps(k)}: {json.dumps(v, ensure_ascii=False)}," for k, v in head.items()]
        merges = ",\n".join(f"    [{a}, {b}]" for a, b in self.merges)
        with open(path, "w", encoding="utf-8") as f:
            f.write("{\n" + "\n".join(lines) + "\n  \"merges\": [\n" + merges + "\n  ]\n}\n")

    @classmethod
    def load(cls, path) -> BPETokenizer:
        """Read a file written by :meth:`save`; ``ValueError`` for corrupt files or other formats."""
        data = _read_json(path, BPE_FORMAT)
        missing = [k for k in ("pattern", "special_tokens", "merges") if k not in data]
        if missing:
            raise _corrupt(path, f"missing field(s) {', '.join(missing)}")
        merges, specials, pattern = data["merges"], data["special_tokens"], data["pattern"]
        if not isinstance(merges, list) or not all(
                isinstance(m, list) and len(m) == 2 and all(type(x) is int for x in m) for m in merges):
            raise _corrupt(path, "\"merges\" must be a list of [a, b] pairs of integer ids")
        if not isinstance(specials, dict) or not all(type(v) is int for v in specials.values()):
            raise _corrupt(path, "\"special_tokens\" must map strings to integer ids")
        if pattern is not None and not isinstance(pattern, str):
            raise _corrupt(path, "\"pattern\" must be a string or null")
        ordered = sorted(specials, key=specials.get)
        expected = list(range(256 + len(merges), 256 + len(merges) + len(ordered)))
        if [specials[s] for s in ordered] != expected:
            raise _corrupt(path, f"special token ids must be {expected} (right after the merges)")
        try:
            return cls([tuple(m) for m in merges], pattern=pattern, special_tokens=ordered)
        except (ValueError, TypeError, regex.error) as err:
            raise _corrupt(path, str(err)) from None

    def __repr__(self) -> str:
        return (f"BPETokenizer(vocab_size={self.vocab_size}, merges={len(self.merges)}, "
                f"special_tokens={self.special_tokens!r})")


def _check_special_tokens(special_tokens) -> list[str]:
    if isinstance(special_tokens, str):
        raise TypeError("special_tokens must be a sequence of strings, not a single string")
    tokens = list(special_tokens)
    if not all(isinstance(s, str) and s for s in tokens):
        raise ValueError(f"special_tokens must be non-empty strings, got {tokens!r}")
    if len(set(tokens)) != len(tokens):
        raise ValueError(f"special_tokens must be distinct, got {tokens!r}")
    return tokens
