"""Tokenizers: text -> a list of integer ids -> text (chapter 2).

Two tokenizers with the same interface (``encode``, ``decode``, ``vocab_size``, ``save``, ``load``):

- :class:`CharTokenizer`: one id per character seen in a text; characters it has never seen are an error.
- :class:`BPETokenizer`: byte-level byte-pair encoding (Sennrich et al. 2016; the GPT-2 flavour of Radford
  et al. 2019). Ids 0..255 are the 256 byte values, so *every* string can be encoded and decoded back
  exactly; ids 256.. are the learned merges in the order they were learned; the special tokens come last.

:func:`load_gpt2_tokenizer` returns GPT-2's published tokenizer (50,257 tokens) as a :class:`BPETokenizer`.

Training (:meth:`BPETokenizer.train`) is the incremental algorithm: the text is split into chunks with a
regular expression (``GPT2_SPLIT_PATTERN``), identical chunks are counted once, and after each merge only
the chunks that contain the merged pair are updated. The pair to merge is chosen by this rule:

    **the most frequent adjacent pair; among equally frequent pairs, the smallest pair (a, b) of ids,
    compared first by a, then by b.**

That is exactly what the textbook algorithm (recount every pair after every merge) picks, so both learn
the same merges; the tests check it on random texts.

The save format is JSON (see :meth:`BPETokenizer.save`): a ``"format"`` name and ``"version"``, the split
pattern, the merges as pairs of ids, and the special tokens with their ids. Files are written atomically
(a failure leaves the previous file intact). Tokenizer files are treated as input from strangers: their
size is bounded, the vocabulary is built lazily (a file of chained merges cannot make loading quadratic),
only known split patterns are accepted unless the caller trusts the file, every pattern other than the
known ones runs with a timeout, and anything malformed is a "corrupt tokenizer file" ``ValueError``.
"""

from __future__ import annotations

import base64
import binascii
import functools
import heapq
import itertools
import json
import os
import re
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator, Mapping, Sequence

import regex

from groundup.utils import atomic_write_text

__all__ = ["GPT2_SPLIT_PATTERN", "KNOWN_PATTERNS", "CharTokenizer", "BPETokenizer", "learn_merges", "merge",
           "load_gpt2_tokenizer", "merges_from_ranks", "read_tiktoken_ranks"]

#: The pre-tokenization pattern of GPT-2 (Radford et al. 2019): contractions, runs of letters or of digits
#: (each with at most one leading space), runs of other symbols, and whitespace. BPE merges never cross the
#: boundaries of these chunks, so a token never glues a word to the punctuation or the word after it.
GPT2_SPLIT_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""

CHAR_FORMAT = "groundup-char-tokenizer"
BPE_FORMAT = "groundup-bpe-tokenizer"
FORMAT_VERSION = 1
LONG_CHUNK = 64  # chunks of more bytes than this are merged with a heap (merge_with_heap)
CACHE_SIZE = 200_000  # distinct chunks whose encoding BPETokenizer.encode remembers (then it starts afresh)

#: Split patterns a tokenizer file may name without ``trust_pattern=True`` (``null``, no pattern, is fine too).
#: Both cover every character, and neither can backtrack catastrophically.
KNOWN_PATTERNS = frozenset({GPT2_SPLIT_PATTERN})

# The same split, written so that the regex package finds it 15 % faster (measured on Shakespeare): the common
# case, a word, is tried first, and the contractions share their apostrophe. It matches the same chunks at
# every position: the regex package takes the first alternative that matches; no two alternatives of the
# contraction group are prefixes of each other; and a contraction starts with an apostrophe, which neither a
# letter nor a space is, so ` ?\p{L}+` and a contraction never both match at one position and their order
# cannot matter. (Tested on the corpus and on random text against the pattern as GPT-2 writes it.)
_FASTER_SPLIT = {GPT2_SPLIT_PATTERN: r""" ?\p{L}+|'(?:s|t|re|ve|m|ll|d)| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""}

# Bounds on what a tokenizer file may describe (GPT-2 has 50,000 merges in a file of about 1 MB here).
MAX_FILE_BYTES = 32 * 2**20
MAX_MERGES = 1_000_000
MAX_SPECIAL_TOKENS = 10_000
MAX_SPECIAL_TOKEN_CHARS = 1_000
MAX_PATTERN_CHARS = 10_000
MAX_TOKEN_BYTES = 16 * 2**20  # the longest token a file may make by chaining merges

# The vocabulary keeps the bytes of tokens up to this length (and up to this many bytes in all); longer
# tokens are put together from their merges when asked for.
MEMO_TOKEN_BYTES = 1024
MEMO_BUDGET_BYTES = 16 * 2**20

# A split pattern that is not one of KNOWN_PATTERNS may take at most this long on a text (seconds):
# generous for any sane pattern (100 kB/s), and a stop for catastrophic backtracking such as (?:a|a)+$.
REGEX_TIMEOUT_BASE = 1.0
REGEX_TIMEOUT_PER_CHAR = 1e-5

_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


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


def _read_json(path, expected_format: str, versions: tuple[int, ...] = (FORMAT_VERSION,)) -> dict:
    """Read a tokenizer file and check its format name and version; clear ValueErrors otherwise."""
    name = os.fspath(path)
    with open(path, "rb") as f:
        raw = f.read(MAX_FILE_BYTES + 1)
    if len(raw) > MAX_FILE_BYTES:
        raise _corrupt(path, f"it is larger than {MAX_FILE_BYTES // 2**20} MiB, more than any tokenizer needs")
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{name!r} is not a groundup tokenizer file: it is not valid JSON ({err})") from None
    except RecursionError:
        raise _corrupt(path, "its JSON is nested too deeply for a tokenizer") from None
    except ValueError as err:  # an integer too long to convert (Python refuses more than 4300 digits)
        raise _corrupt(path, f"it holds a number no tokenizer needs ({str(err)[:80]})") from None
    if not isinstance(data, dict) or "format" not in data:
        raise ValueError(f"{name!r} is not a groundup tokenizer file: expected a JSON object with "
                         f"\"format\": \"{expected_format}\" (files of other libraries cannot be loaded)")
    if data["format"] != expected_format:
        raise ValueError(f"{name!r} has format {_short(data['format'])}, expected {expected_format!r}")
    version = data.get("version")
    if type(version) is not int:
        raise _corrupt(path, f"\"version\" must be an integer, got {_short(version)}")
    if version not in versions:
        readable = " or ".join(map(str, versions))
        raise ValueError(f"{name!r} has format version {version}; this groundup reads version {readable}")
    return data


def _short(value) -> str:
    """``repr`` of a value from a file, cut short (a file may hold huge values)."""
    text = repr(value) if not isinstance(value, int) or abs(value) < 10**50 else "a huge integer"
    return text if len(text) <= 60 else text[:57] + "..."


def _json_text(obj, **kwargs) -> str:
    """``json.dumps`` without ASCII escapes, except for lone surrogates (which UTF-8 cannot hold)."""
    text = json.dumps(obj, ensure_ascii=False, **kwargs)
    return _LONE_SURROGATE.sub(lambda m: f"\\u{ord(m.group()):04x}", text)


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
        atomic_write_text(path, _json_text({"format": CHAR_FORMAT, "version": FORMAT_VERSION, "chars": self.chars},
                                           indent=1) + "\n")

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


NOT_A_MERGE = 1 << 62  # the rank of a pair that is not a merge: larger than every merge's id


def merge_by_scan(ids: list[int], ranks: Mapping[tuple[int, int], int]) -> list[int]:
    """BPE-encode ``ids`` with ``ranks`` (pair -> new id; a smaller id was learned earlier), in place.

    Keeps the rank of every adjacent pair in a list; each step merges the leftmost pair of smallest rank and
    recomputes only the two pairs beside it. Each step scans the whole list (fast, in C), so the time grows
    as n^2 with the length n: the choice for short chunks. The result is that of repeating :func:`merge` with
    the earliest-learned pair present, because a merge's neighbours can only form pairs learned later.
    """
    pair_ranks = [ranks.get(pair, NOT_A_MERGE) for pair in zip(ids, ids[1:], strict=False)]
    while pair_ranks:
        best = min(pair_ranks)
        if best == NOT_A_MERGE:
            break
        i = pair_ranks.index(best)  # the leftmost occurrence
        ids[i:i + 2] = [best]
        del pair_ranks[i]
        if i > 0:
            pair_ranks[i - 1] = ranks.get((ids[i - 1], best), NOT_A_MERGE)
        if i < len(pair_ranks):
            pair_ranks[i] = ranks.get((best, ids[i + 1]), NOT_A_MERGE)
    return ids


def merge_with_heap(ids: list[int], ranks: Mapping[tuple[int, int], int]) -> list[int]:
    """The same result as :func:`merge_by_scan` in O(n log n): a linked list of tokens and a heap of pairs.

    Token ``i`` sits at position ``i`` of ``ids`` (the first token of a merge keeps its position); ``nxt`` and
    ``prv`` link the living positions in order. The heap holds ``(rank, position of the pair's left token)``;
    popping gives the earliest-learned pair, leftmost first. A merge pushes the two new pairs beside it and
    leaves the old entries in the heap: an entry is skipped when popped if its left token has died or its pair
    no longer has that rank ("lazy deletion").
    """
    n = len(ids)
    nxt, prv = list(range(1, n + 1)), list(range(-1, n - 1))  # n and -1 mark the ends
    heap = [(r, i) for i, pair in enumerate(zip(ids, ids[1:], strict=False))
            if (r := ranks.get(pair, NOT_A_MERGE)) != NOT_A_MERGE]
    heapq.heapify(heap)
    alive = [True] * n
    while heap:
        rank, i = heapq.heappop(heap)
        j = nxt[i]
        if not alive[i] or j >= n or ranks.get((ids[i], ids[j])) != rank:
            continue  # an outdated entry
        ids[i] = rank  # i becomes the merged token; j dies
        alive[j] = False
        nxt[i] = k = nxt[j]
        if k < n:
            prv[k] = i
            if (r := ranks.get((rank, ids[k]))) is not None:
                heapq.heappush(heap, (r, i))
        if (h := prv[i]) >= 0 and (r := ranks.get((ids[h], rank))) is not None:
            heapq.heappush(heap, (r, h))
    return [t for t, keep in zip(ids, alive, strict=True) if keep]


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


class TokenBytes(Mapping):
    """The vocabulary of a :class:`BPETokenizer` as a read-only mapping ``id -> bytes``, built lazily.

    Short tokens (the usual case) are put together once, when the tokenizer is made; a token longer than
    ``MEMO_TOKEN_BYTES`` is put together from its merges each time it is asked for, without recursion. So a
    file of chained merges, whose tokens grow by one byte per merge, needs memory linear in its length
    rather than quadratic.
    """

    def __init__(self, merges: Sequence[tuple[int, int]], specials: Sequence[bytes],
                 byte_ids: Sequence[int] | None = None):
        self._merges = merges
        self._size = 256 + len(merges) + len(specials)
        memo = {i: bytes([i]) for i in range(256)} if byte_ids is None else \
            {i: bytes([b]) for b, i in enumerate(byte_ids)}
        budget = MEMO_BUDGET_BYTES
        for k, (a, b) in enumerate(merges):
            x, y = memo.get(a), memo.get(b)
            if x is not None and y is not None and len(x) + len(y) <= MEMO_TOKEN_BYTES and budget > 0:
                memo[256 + k] = x + y
                budget -= len(x) + len(y)
        first_special = 256 + len(merges)
        for k, s in enumerate(specials):
            memo[first_special + k] = s
        self._memo = memo

    def __len__(self) -> int:
        return self._size

    def __iter__(self) -> Iterator[int]:
        return iter(range(self._size))

    def __contains__(self, i) -> bool:
        return type(i) is int and 0 <= i < self._size

    def __getitem__(self, i) -> bytes:
        token = self._memo.get(i)
        if token is not None:
            return token
        if i not in self:
            raise KeyError(i)
        parts, stack, memo, merges = [], [i], self._memo, self._merges
        while stack:
            j = stack.pop()
            token = memo.get(j)
            if token is None:
                a, b = merges[j - 256]
                stack += (b, a)
            else:
                parts.append(token)
        return b"".join(parts)

    def join(self, ids: Sequence[int]) -> bytes:
        """The bytes of the tokens ``ids`` (valid ids), concatenated."""
        try:
            return b"".join(map(self._memo.__getitem__, ids))
        except KeyError:
            return b"".join(map(self.__getitem__, ids))

    def __repr__(self) -> str:
        return f"TokenBytes({self._size} tokens)"


def _token_lengths(merges: Sequence[tuple[int, int]], cap: int) -> list[int]:
    """The byte length of every token made by ``merges`` (capped at ``cap + 1``), in one pass."""
    lengths = [1] * 256
    for a, b in merges:
        lengths.append(min(lengths[a] + lengths[b], cap + 1))
    return lengths[256:]


def _make_splitter(pattern: str | None):
    """The pre-tokenizer of ``pattern``: a function from a text to its chunks, which join to the text again.

    ``None``: the text is one chunk. A known pattern (``KNOWN_PATTERNS``) covers every character, so its matches
    are the chunks. Any other pattern runs with a timeout, and the text between its matches (which ``findall``
    would drop, e.g. the spaces and commas of ``\\w+``) becomes chunks of its own, so no character is lost.
    """
    if pattern is None:
        return lambda text: [text] if text else []
    if pattern in KNOWN_PATTERNS:
        return regex.compile(_FASTER_SPLIT.get(pattern, pattern)).findall
    compiled = regex.compile(pattern)
    finditer = compiled.finditer

    def split(text: str) -> list[str]:
        timeout = REGEX_TIMEOUT_BASE + REGEX_TIMEOUT_PER_CHAR * len(text)
        out, pos = [], 0
        try:
            for m in finditer(text, timeout=timeout):
                start, end = m.span()
                if start > pos:
                    out.append(text[pos:start])
                if end > start:
                    out.append(text[start:end])
                pos = end
        except TimeoutError:
            raise ValueError(f"the split pattern {_short(pattern)} took more than {timeout:.1f} s on a text of "
                             f"{len(text):,} characters: it backtracks catastrophically; use another pattern "
                             f"(e.g. GPT2_SPLIT_PATTERN)") from None
        if pos < len(text):
            out.append(text[pos:])
        return out

    return split


def _check_pattern(pattern) -> None:
    if pattern is None:
        return
    if not isinstance(pattern, str):
        raise TypeError(f"pattern must be a regular expression (str) or None, got {type(pattern).__name__}")
    if _LONE_SURROGATE.search(pattern):
        raise ValueError("pattern must not contain lone surrogates (they are not Unicode characters)")


def _lone_surrogate_error(text: str) -> ValueError:
    i = _LONE_SURROGATE.search(text).start()
    return ValueError(f"text contains a lone surrogate {text[i]!r} at index {i}: it is not a Unicode character "
                      f"and has no UTF-8 bytes, so a byte-level tokenizer cannot encode it (fix the text, e.g. "
                      f"decode it with errors='replace')")


class BPETokenizer:
    """Byte-level byte-pair encoding with a regex pre-tokenizer and special tokens.

    Ids 0..255 are bytes, ids ``256 + k`` the ``k``-th merge ``merges[k] = (a, b)``, and the special tokens
    take the last ids. By default byte ``b`` has id ``b``; ``byte_ids`` (a permutation of 0..255) gives byte
    ``b`` the id ``byte_ids[b]`` instead, as GPT-2 numbers them (:func:`load_gpt2_tokenizer`); the merges are
    then written in those ids. The map is applied once per distinct chunk, so it costs nothing per token.
    ``decode(encode(s)) == s`` for every string ``s`` of Unicode characters (a lone
    surrogate, which is not a character and has no UTF-8 bytes, is refused with a ``ValueError``). Special
    tokens are matched in the text before anything else, so they are never split; ordinary text never
    produces their ids. ``vocab`` maps every id to its bytes (:class:`TokenBytes`).

    ``whole_tokens=True`` promises that every token's own bytes, encoded, give that token alone; a chunk that
    spells a whole token then gets its id without merging (tiktoken's shortcut). The promise holds for a
    tokenizer made from a ranks table by :func:`merges_from_ranks` (see there), such as GPT-2's; it does not
    hold for every list of merges (with merges ``ab``, ``bc``, ``a+bc`` the token ``abc`` encodes to
    ``ab, c``), so it is off by default, and it is not saved with the tokenizer.
    """

    def __init__(self, merges: Sequence[tuple[int, int]] = (), *, pattern: str | None = GPT2_SPLIT_PATTERN,
                 special_tokens: Sequence[str] = (), byte_ids: Sequence[int] | None = None,
                 whole_tokens: bool = False):
        self.byte_ids = _check_byte_ids(byte_ids)
        self.merges = [(int(a), int(b)) for a, b in merges]
        for k, (a, b) in enumerate(self.merges):
            if not (0 <= a < 256 + k and 0 <= b < 256 + k):
                raise ValueError(f"merges[{k}] = {(a, b)} uses an id that is not defined before it "
                                 f"(ids must be < {256 + k})")
        if len(set(self.merges)) != len(self.merges):
            raise ValueError("merges must not contain the same pair twice")
        _check_pattern(pattern)
        self.pattern = pattern
        self._split = _make_splitter(pattern)
        self.special_tokens = _check_special_tokens(special_tokens)
        first_special = 256 + len(self.merges)
        self.special_ids = {s: first_special + k for k, s in enumerate(self.special_tokens)}
        self._special_split = (regex.compile("(" + "|".join(
            regex.escape(s) for s in sorted(self.special_tokens, key=len, reverse=True)) + ")").split
            if self.special_tokens else None)
        self.ranks = {pair: 256 + k for k, pair in enumerate(self.merges)}
        self.vocab = TokenBytes(self.merges, [s.encode("utf-8") for s in self.special_tokens], self.byte_ids)
        self._byte_table = None if self.byte_ids is None else bytes(self.byte_ids)  # for bytes.translate
        self._whole = self._whole_token_ids() if whole_tokens else {}
        self._cache: dict[str, tuple[int, ...]] = {}

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
        tok = cls((), pattern=pattern, special_tokens=special_tokens)
        counts = Counter()
        for piece in tok._pieces(text):
            if piece not in tok.special_ids:
                counts.update(tok._split(piece))
        try:
            chunks = [c.encode("utf-8") for c in counts]
        except UnicodeEncodeError:
            raise _lone_surrogate_error(text) from None
        merges = learn_merges(chunks, list(counts.values()), vocab_size - 256 - len(special_tokens))
        return cls(merges, pattern=pattern, special_tokens=special_tokens)

    # ---- encoding and decoding ------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return 256 + len(self.merges) + len(self.special_tokens)

    def _whole_token_ids(self) -> dict[str, int]:
        """``text -> id`` for every ordinary token whose bytes are UTF-8 text (the ``whole_tokens`` shortcut)."""
        whole = {}
        for i in range(256 + len(self.merges)):
            try:
                whole[self.vocab[i].decode("utf-8")] = i
            except UnicodeDecodeError:
                pass  # part of a character: no chunk of text spells it
        return whole

    def _pieces(self, text: str) -> list[str]:
        """``text`` cut at the special tokens (which are kept as pieces of their own)."""
        return self._special_split(text) if self._special_split else [text]

    def _encode_chunk(self, chunk: str) -> list[int]:
        """Apply the merges to one chunk: repeatedly merge the adjacent pair that was learned first.

        A merge's new id is ``256 + k`` for the ``k``-th merge, so "learned first" means "smallest new id", and
        ``self.ranks`` (pair -> new id) is both the rank table and the result. Short chunks (nearly all of
        them) rescan their few pairs after each merge; long ones use a heap, so a 32k-letter word costs
        O(n log n) instead of O(n^2).
        """
        data = chunk.encode("utf-8")
        ids = list(data if self._byte_table is None else data.translate(self._byte_table))
        if len(ids) > LONG_CHUNK:
            return merge_with_heap(ids, self.ranks)
        return merge_by_scan(ids, self.ranks)

    def encode(self, text: str) -> list[int]:
        """The token ids of ``text`` (special tokens appearing in it become their ids)."""
        _check_text(text)
        out: list[int] = []
        try:
            for piece in self._pieces(text):
                special = self.special_ids.get(piece)
                if special is not None:
                    out.append(special)
                else:
                    self._encode_plain(piece, out)
        except UnicodeEncodeError:
            raise _lone_surrogate_error(text) from None
        return out

    def encode_ordinary(self, text: str) -> list[int]:
        """The token ids of ``text`` read as plain text: a special token's string in it is encoded like any
        other text (so text from users cannot smuggle in, say, ``<|endoftext|>``)."""
        _check_text(text)
        out: list[int] = []
        try:
            self._encode_plain(text, out)
        except UnicodeEncodeError:
            raise _lone_surrogate_error(text) from None
        return out

    def _encode_plain(self, text: str, out: list[int]) -> None:
        """Append the ids of ``text`` (no special tokens in it) to ``out``.

        Prose repeats its chunks (5 MB of Shakespeare: 1.36 M chunks, 36 k distinct), so each distinct chunk is
        encoded once, and the results are remembered across calls (up to ``CACHE_SIZE`` chunks). With
        ``whole_tokens``, a chunk that is a token needs no merging (12.7 k of GPT-2's 36 k on Shakespeare).
        """
        chunks = self._split(text)
        table = dict.fromkeys(chunks)  # the distinct chunks, in order of first appearance
        cache, whole = self._cache, self._whole
        for chunk in table:
            ids = cache.get(chunk)
            if ids is None:
                if len(cache) >= CACHE_SIZE:
                    cache.clear()
                i = whole.get(chunk)
                ids = cache[chunk] = (i,) if i is not None else tuple(self._encode_chunk(chunk))
            table[chunk] = ids
        out += itertools.chain.from_iterable(map(table.__getitem__, chunks))

    def decode(self, ids: Sequence[int]) -> str:
        """The text of ``ids``. Byte sequences that are not valid UTF-8 decode to U+FFFD characters.

        (That includes the three-byte forms of surrogates, ED A0 80 to ED BF BF: the result is always text that
        can be printed and saved, never a string holding a lone surrogate.)
        """
        return self.vocab.join(_check_ids(ids, self.vocab_size)).decode("utf-8", "replace")

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

        A tokenizer with ``byte_ids`` is written as version 2, with ``"byte_ids": [...]`` (the id of each byte)
        after the special tokens; version 1 files have none (byte ``b`` is id ``b``).
        """
        head = {"format": BPE_FORMAT, "version": FORMAT_VERSION if self.byte_ids is None else 2,
                "pattern": self.pattern, "special_tokens": self.special_ids}
        if self.byte_ids is not None:
            head["byte_ids"] = self.byte_ids
        lines = [f"  {json.dumps(k)}: {_json_text(v)}," for k, v in head.items()]
        merges = ",\n".join(f"    [{a}, {b}]" for a, b in self.merges)
        atomic_write_text(path, "{\n" + "\n".join(lines) + "\n  \"merges\": [\n" + merges + "\n  ]\n}\n")

    @classmethod
    def load(cls, path, *, trust_pattern: bool = False) -> BPETokenizer:
        """Read a file written by :meth:`save`; ``ValueError`` for corrupt files or other formats.

        A tokenizer file is input from strangers: its size and what it describes are bounded (``MAX_*``), and
        its split pattern must be one of ``KNOWN_PATTERNS`` (or null). A pattern can make ``encode`` take
        exponential time, so pass ``trust_pattern=True`` to accept any other pattern from a file you trust
        (such a pattern still runs with a timeout, and text between its matches is kept).
        """
        data = _read_json(path, BPE_FORMAT, versions=(1, 2))
        byte_ids = data.get("byte_ids") if data["version"] == 2 else None
        if data["version"] == 2 and "byte_ids" not in data:
            raise _corrupt(path, "a version 2 file must hold \"byte_ids\"")
        if byte_ids is not None:
            try:
                byte_ids = _check_byte_ids(byte_ids)
            except (TypeError, ValueError) as err:
                raise _corrupt(path, str(err)[:300]) from None
        missing = [k for k in ("pattern", "special_tokens", "merges") if k not in data]
        if missing:
            raise _corrupt(path, f"missing field(s) {', '.join(missing)}")
        merges, specials, pattern = data["merges"], data["special_tokens"], data["pattern"]
        if not isinstance(merges, list) or not all(
                isinstance(m, list) and len(m) == 2 and all(type(x) is int for x in m) for m in merges):
            raise _corrupt(path, "\"merges\" must be a list of [a, b] pairs of integer ids")
        if len(merges) > MAX_MERGES:
            raise _corrupt(path, f"{len(merges):,} merges, more than the {MAX_MERGES:,} a tokenizer file may hold")
        if not isinstance(specials, dict) or not all(type(v) is int for v in specials.values()):
            raise _corrupt(path, "\"special_tokens\" must map strings to integer ids")
        if len(specials) > MAX_SPECIAL_TOKENS or any(len(s) > MAX_SPECIAL_TOKEN_CHARS for s in specials):
            raise _corrupt(path, f"at most {MAX_SPECIAL_TOKENS:,} special tokens of at most "
                                 f"{MAX_SPECIAL_TOKEN_CHARS:,} characters each")
        if pattern is not None and not isinstance(pattern, str):
            raise _corrupt(path, "\"pattern\" must be a string or null")
        if pattern is not None and pattern not in KNOWN_PATTERNS:
            if not trust_pattern:
                raise ValueError(
                    f"{os.fspath(path)!r} uses the split pattern {_short(pattern)}, which is not one of the known "
                    "patterns (GPT2_SPLIT_PATTERN, or null). A pattern from a file can make encode take exponential "
                    "time; if you trust this file, load it with trust_pattern=True")
            if len(pattern) > MAX_PATTERN_CHARS:
                raise _corrupt(path, f"\"pattern\" is longer than {MAX_PATTERN_CHARS:,} characters")
        ordered = sorted(specials, key=specials.get)
        expected = list(range(256 + len(merges), 256 + len(merges) + len(ordered)))
        if [specials[s] for s in ordered] != expected:
            raise _corrupt(path, f"special token ids must be {expected[:5]}... (right after the merges)"
                           if len(expected) > 5 else f"special token ids must be {expected} (right after the merges)")
        try:
            tok = cls([tuple(m) for m in merges], pattern=pattern, special_tokens=ordered, byte_ids=byte_ids)
        except (ValueError, TypeError, regex.error, RecursionError, OverflowError) as err:
            raise _corrupt(path, str(err)[:300]) from None
        lengths = _token_lengths(tok.merges, MAX_TOKEN_BYTES)
        if lengths and max(lengths) > MAX_TOKEN_BYTES:
            k = max(range(len(lengths)), key=lengths.__getitem__)
            raise _corrupt(path, f"merge {k} makes a token of more than {MAX_TOKEN_BYTES // 2**20} MiB")
        return tok

    def __repr__(self) -> str:
        return (f"BPETokenizer(vocab_size={self.vocab_size}, merges={len(self.merges)}, "
                f"special_tokens={self.special_tokens!r})")


def _check_byte_ids(byte_ids) -> list[int] | None:
    """``None``, or ``byte_ids`` as a list after checking it is a permutation of 0..255 (None if the identity)."""
    if byte_ids is None:
        return None
    if isinstance(byte_ids, (str, bytes)) or not isinstance(byte_ids, Iterable):
        raise TypeError(f"byte_ids must be a sequence of 256 ints, got {type(byte_ids).__name__}")
    ids = list(byte_ids)
    if len(ids) != 256 or not all(type(i) is int for i in ids) or sorted(ids) != list(range(256)):
        raise ValueError("byte_ids must give each of the 256 bytes a distinct id in 0..255 (a permutation)")
    return None if ids == list(range(256)) else ids


def _check_special_tokens(special_tokens) -> list[str]:
    if isinstance(special_tokens, str):
        raise TypeError("special_tokens must be a sequence of strings, not a single string")
    tokens = list(special_tokens)
    if not all(isinstance(s, str) and s for s in tokens):
        raise ValueError(f"special_tokens must be non-empty strings, got {tokens!r}")
    if any(_LONE_SURROGATE.search(s) for s in tokens):
        raise ValueError("special_tokens must not contain lone surrogates (they are not Unicode characters)")
    if len(set(tokens)) != len(tokens):
        raise ValueError(f"special_tokens must be distinct, got {tokens!r}")
    return tokens


# --------------------------------------------------------------------------------------------------------
# Published tokenizers: GPT-2
# --------------------------------------------------------------------------------------------------------

GPT2_END_OF_TEXT = "<|endoftext|>"


def read_tiktoken_ranks(text: str) -> dict[bytes, int]:
    """Parse a tiktoken ranks file: one ``<base64 of the token's bytes> <rank>`` line per token.

    The ranks must be 0, 1, 2, ... in order and the tokens distinct and non-empty; ``ValueError`` otherwise,
    naming the line.
    """
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    ranks: dict[bytes, int] = {}
    for n, line in enumerate(text.splitlines(), 1):
        if not line:
            continue
        parts = line.split(" ")
        if len(parts) != 2 or not parts[1].isdigit() or len(parts[1]) > 9:
            raise ValueError(f"line {n} of the ranks file is not '<base64 token> <rank>': {_short(line)}")
        try:
            token = base64.b64decode(parts[0], validate=True)
        except (binascii.Error, ValueError):
            raise ValueError(f"line {n} of the ranks file holds invalid base64: {_short(parts[0])}") from None
        if not token or len(token) > MEMO_TOKEN_BYTES or token in ranks or int(parts[1]) != len(ranks):
            raise ValueError(f"line {n} of the ranks file: expected a new non-empty token of at most "
                             f"{MEMO_TOKEN_BYTES} bytes with rank {len(ranks)}, got {_short(line)}")
        ranks[token] = len(ranks)
    return ranks


def merges_from_ranks(ranks: dict[bytes, int]) -> tuple[list[int], list[tuple[int, int]]]:
    """``(byte_ids, merges)`` of a :class:`BPETokenizer` equivalent to a rank-based BPE (tiktoken's form).

    A ranks table lists tokens, not merges: the first 256 tokens are the single bytes (in the table's own order,
    which gives ``byte_ids``), and every later token of rank r is the merge of the two tokens that BPE, using
    only the tokens ranked below r, leaves when it encodes r's bytes. Encoding with those merges then gives
    the same ids as the table.

    Every token's own bytes then encode to that token alone (so such a tokenizer may take ``whole_tokens=True``):
    the loop below is BPE on the token's bytes with the earlier ranks, and it must end at two parts, ``(a, b)``,
    or the table is refused; BPE with all ranks takes the same steps, since some pair ranked below r was always
    present, and then merges ``(a, b)`` into the token.
    """
    tokens = sorted(ranks, key=ranks.get)
    if len(tokens) < 256 or sorted(len(t) for t in tokens[:256]) != [1] * 256:
        raise ValueError("the first 256 tokens of a byte-level BPE must be the 256 single bytes")
    byte_ids = [ranks[bytes([b])] for b in range(256)]
    merges = []
    for r in range(256, len(tokens)):
        parts = [bytes([b]) for b in tokens[r]]
        while len(parts) > 2:
            best = min(range(len(parts) - 1), key=lambda i: ranks.get(parts[i] + parts[i + 1], 1 << 62))
            if ranks.get(parts[best] + parts[best + 1], r) >= r:
                break
            parts[best:best + 2] = [parts[best] + parts[best + 1]]
        if len(parts) != 2:
            raise ValueError(f"token {r} ({_short(tokens[r])}) cannot be made by merging two earlier tokens")
        merges.append((ranks[parts[0]], ranks[parts[1]]))
    return byte_ids, merges


@functools.lru_cache(maxsize=2)
def _gpt2_merges(cache_dir: str | None) -> tuple[tuple[int, ...], tuple[tuple[int, int], ...]]:
    from groundup.data import locate_asset

    text = locate_asset("gpt2.tiktoken", cache_dir=cache_dir)[0]  # SHA-256 verified
    byte_ids, merges = merges_from_ranks(read_tiktoken_ranks(text))
    return tuple(byte_ids), tuple(merges)


def load_gpt2_tokenizer(*, cache_dir: str | os.PathLike | None = None) -> BPETokenizer:
    """GPT-2's tokenizer (Radford et al. 2019) as a :class:`BPETokenizer`: 50,257 tokens, the same ids as GPT-2.

    50,257 = 256 single bytes + 50,000 merges + the special token ``<|endoftext|>`` (id 50256); the split
    pattern is :data:`GPT2_SPLIT_PATTERN`. GPT-2 does not give byte ``b`` the id ``b`` (its first ids are the
    printable bytes, ``!`` is 0), so the tokenizer carries GPT-2's ``byte_ids``.

    The merge ranks come from the ``openai-whisper==20250625`` source archive on the Python package index
    (``whisper/assets/gpt2.tiktoken``), fetched with pip in hash-checking mode, verified by SHA-256 and cached
    like the corpora (:func:`groundup.data.locate_asset`; ``$GROUNDUP_DATA_DIR/gpt2.tiktoken`` is used when
    present). Text is encoded with :meth:`BPETokenizer.encode` (``<|endoftext|>`` in the text becomes id 50256)
    or :meth:`BPETokenizer.encode_ordinary` (it stays text).
    """
    byte_ids, merges = _gpt2_merges(None if cache_dir is None else os.fspath(cache_dir))
    return BPETokenizer(merges, pattern=GPT2_SPLIT_PATTERN, special_tokens=[GPT2_END_OF_TEXT], byte_ids=byte_ids,
                        whole_tokens=True)
