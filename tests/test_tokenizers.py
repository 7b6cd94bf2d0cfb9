"""Tests of groundup.tokenizers: round trips, the learned merges, special tokens, save/load, errors."""

from __future__ import annotations

import json
import random
from collections import Counter

import pytest
import regex
from hypothesis import given, settings
from hypothesis import strategies as st

from groundup.tokenizers import (
    GPT2_SPLIT_PATTERN,
    BPETokenizer,
    CharTokenizer,
    learn_merges,
    merge_by_scan,
    merge_with_heap,
)

TEXT = (
    "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n\n"
    "First Citizen:\nYou are all resolved rather to die than to famish?\n\nAll:\nResolved. resolved.\n\n"
    "First Citizen:\nFirst, you know Caius Marcius is chief enemy to the people.\n\n"
    "All:\nWe know't, we know't.\n\nFirst Citizen:\nLet us kill him, and we'll have corn at our own price.\n"
) * 3
EOT = "<|endoftext|>"


# ---- the textbook algorithm, written independently of the package ----------------------------------------

def _merge_ref(ids, pair, new_id):
    out, i = [], 0
    while i < len(ids):
        if tuple(ids[i:i + 2]) == pair:
            out.append(new_id)
            i += 2
        else:
            out.append(ids[i])
            i += 1
    return out


def textbook_merges(text, n_merges, pattern=GPT2_SPLIT_PATTERN):
    """Recount every adjacent pair of every chunk after each merge; most frequent wins, ties -> smallest pair."""
    chunks = [list(c.encode("utf-8")) for c in (regex.findall(pattern, text) if pattern else [text])]
    merges = []
    for k in range(n_merges):
        counts = Counter(p for ids in chunks for p in zip(ids, ids[1:], strict=False))
        if not counts:
            break
        pair = min(counts, key=lambda p: (-counts[p], p))
        merges.append(pair)
        chunks = [_merge_ref(ids, pair, 256 + k) for ids in chunks]
    return merges


@pytest.fixture(scope="module")
def tok():
    return BPETokenizer.train(TEXT, 300, special_tokens=[EOT])


# ---- merges ----------------------------------------------------------------------------------------------

def test_first_merges_are_the_most_frequent_pairs(tok):
    # Count the byte pairs inside the regex chunks directly: the first merge is the most frequent one ("ll").
    chunks = regex.findall(GPT2_SPLIT_PATTERN, TEXT)
    counts = Counter(p for c in chunks for p in zip(c.encode(), c.encode()[1:], strict=False))
    top = max(counts.values())
    assert tok.merges[0] == min(p for p, n in counts.items() if n == top)
    assert tok.merges[0] == (108, 108) and tok.vocab[256] == b"ll"


def test_merges_equal_textbook_on_small_text(tok):
    assert tok.merges == textbook_merges(TEXT, 300 - 256 - 1)
    assert len(tok.merges) == 43 and tok.vocab_size == 300


def test_tie_rule_picks_smallest_pair():
    # (c, d), (d, " "), (" ", a) and (a, b) all occur twice: the smallest, (32, 97) = " a", wins; then
    # (c, d), (d, 256) and (256, b) tie and (99, 100) = "cd" wins, although "cd" comes first in the text.
    merges = BPETokenizer.train("cd ab cd ab", 258, pattern=None).merges
    assert merges == [(32, 97), (99, 100)] == textbook_merges("cd ab cd ab", 2, pattern=None)
    assert learn_merges([b"cdab"], [1], 1) == [(ord("a"), ord("b"))]


def test_overlapping_pair_counts_like_textbook():
    # "aaaa" holds three overlapping (a, a) pairs; merging gives [aa, aa] and then (aa, aa).
    assert learn_merges([b"aaaa", b"aaa"], [1, 1], 3) == textbook_merges("aaaa aaa", 3, pattern=r"\S+")
    assert learn_merges([b"aaaa"], [1], 5) == [(97, 97), (256, 256)]  # stops when no pair is left


@settings(max_examples=60, deadline=None)
@given(st.text(alphabet="ab c\n'.é", max_size=120), st.integers(1, 40),
       st.sampled_from([GPT2_SPLIT_PATTERN, None]))
def test_fast_trainer_equals_textbook(text, n_merges, pattern):
    assert BPETokenizer.train(text, 256 + n_merges, pattern=pattern).merges == \
        textbook_merges(text, n_merges, pattern)


def test_text_runs_out_of_pairs():
    tok = BPETokenizer.train("ab", 1000)
    assert tok.merges == [(97, 98)] and tok.vocab_size == 257
    assert tok.encode("abab ab") == [256, 256, 32, 256]  # " ab" is a chunk of its own; the merge applies inside


# ---- encoding and decoding -------------------------------------------------------------------------------

def test_encode_compresses_and_round_trips(tok):
    ids = tok.encode(TEXT)
    assert len(ids) == 594 and len(TEXT.encode()) == 1047  # 43 merges already save 43 % of the tokens
    assert tok.decode(ids) == TEXT
    assert all(0 <= i < tok.vocab_size - 1 for i in ids)


def test_encode_applies_merges_in_learned_order():
    tok = BPETokenizer([(97, 98), (98, 99), (256, 99)], pattern=None)
    # "abc": (a, b) was learned first, so it wins over (b, c); then (ab, c).
    assert tok.encode("abc") == [258]
    assert tok.encode("bcab") == [257, 256]
    assert tok.encode("xyz") == [120, 121, 122]


def textbook_encode(ids, merges):
    """Chapter 2's encoder, independent of the package: merge the earliest-learned pair present, all of it, again."""
    rank = {pair: 256 + k for k, pair in enumerate(merges)}
    while True:
        present = [rank[p] for p in zip(ids, ids[1:], strict=False) if p in rank]
        if not present:
            return ids
        new_id = min(present)
        ids = _merge_ref(ids, merges[new_id - 256], new_id)


# Merges learned on a text of a few letters, so random sequences of them hold many merges, chained and overlapping.
SMALL_ALPHABET_MERGES = BPETokenizer.train("aab abba baab aaaa bab " * 20 + "ab" * 30, 300, pattern=None).merges


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from([97, 98, 32]), max_size=300))
def test_scan_and_heap_merges_equal_the_textbook_encoder(ids):
    ranks = {pair: 256 + k for k, pair in enumerate(SMALL_ALPHABET_MERGES)}
    expected = textbook_encode(list(ids), SMALL_ALPHABET_MERGES)
    assert merge_by_scan(list(ids), ranks) == expected
    assert merge_with_heap(list(ids), ranks) == expected


def test_long_chunks_take_the_heap_and_give_the_same_tokens(monkeypatch):
    import groundup.tokenizers as module

    tok = BPETokenizer(SMALL_ALPHABET_MERGES, pattern=None)
    text = "".join(random.Random(1).choice("ab ") for _ in range(5000))
    calls = []
    monkeypatch.setattr(module, "merge_by_scan", lambda ids, ranks: calls.append(len(ids)) or ids)  # a stub
    assert tok.encode(text) == textbook_encode(list(text.encode()), SMALL_ALPHABET_MERGES)
    assert calls == []  # 5000 bytes: the heap
    assert tok.encode("ab" * 10) == list(b"ab" * 10) and calls == [20]  # 20 bytes: the (stubbed) scan


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_round_trip_any_text(tok, text):
    assert tok.decode(tok.encode(text)) == text


@settings(max_examples=100, deadline=None)
@given(st.text(st.characters(categories=["Mn", "So", "Zs", "Cc", "Lo", "Co"])))
def test_round_trip_marks_emoji_private_use(tok, text):
    assert tok.decode(tok.encode(text)) == text


def test_round_trip_unseen_scripts_and_emoji(tok):
    for s in ["Zoë naïve café", "e\u0301\u0301", "👩‍👩‍👧 🏳️‍🌈", "東京で寿司", "\x00\t\r\n  ", "", EOT + EOT]:
        assert tok.decode(tok.encode(s)) == s
    assert tok.encode("😀") == list("😀".encode())  # never seen: its four bytes


def test_decode_invalid_utf8_uses_replacement_character(tok):
    assert tok.decode([0xF0, 0x9F]) == "\ufffd"  # an incomplete 4-byte character
    assert tok.decode([0xF0, 0x9F, 0x98, 0x80]) == "😀"


# ---- special tokens --------------------------------------------------------------------------------------

def test_special_tokens_are_never_split(tok):
    eot = tok.vocab_size - 1
    assert tok.special_ids == {EOT: eot}
    ids = tok.encode("Speak." + EOT + "All:")
    assert ids.count(eot) == 1
    assert ids == tok.encode("Speak.") + [eot] + tok.encode("All:")
    assert tok.decode([eot]) == EOT


@settings(max_examples=100, deadline=None)
@given(st.text(alphabet="<|>endoftxt ab"))
def test_special_ids_never_come_from_ordinary_text(tok, text):
    eot = tok.vocab_size - 1
    assert tok.encode(text).count(eot) == text.count(EOT)


def test_training_ignores_special_token_text():
    text = ("hello world" + EOT) * 20
    tok = BPETokenizer.train(text, 300, special_tokens=[EOT])
    assert not any(b"<|" in v or b"|>" in v for i, v in tok.vocab.items() if i < tok.vocab_size - 1)
    assert tok.encode(text)[-1] == tok.vocab_size - 1


def test_longest_special_token_wins():
    tok = BPETokenizer([], special_tokens=["<a>", "<a><b>"])
    assert tok.encode("<a><b><a>") == [257, 256]


# ---- characters ------------------------------------------------------------------------------------------

def test_char_tokenizer():
    tok = CharTokenizer.from_text("hello world")
    assert tok.vocab_size == 8 and tok.chars == sorted(set("hello world"))
    assert tok.encode("hello") == [3, 2, 4, 4, 5]
    assert tok.decode(tok.encode("world hello")) == "world hello"


def test_char_tokenizer_names_unseen_characters():
    tok = CharTokenizer.from_text("hello world")
    with pytest.raises(ValueError, match=r"2 character\(s\) not in the vocabulary: 'H', 'é'"):
        tok.encode("Héllo")


# ---- save and load ---------------------------------------------------------------------------------------

def test_bpe_save_load_round_trip(tok, tmp_path):
    path = tmp_path / "tok.json"
    tok.save(path)
    data = json.loads(path.read_text())
    assert data["format"] == "groundup-bpe-tokenizer" and data["version"] == 1
    assert data["merges"][0] == list(tok.merges[0]) and data["special_tokens"] == {EOT: 299}
    assert path.read_text().count("\n") > len(tok.merges)  # one merge per line: readable
    back = BPETokenizer.load(path)
    assert back.merges == tok.merges and back.special_ids == tok.special_ids and back.pattern == tok.pattern
    assert back.encode(TEXT + EOT) == tok.encode(TEXT + EOT)


def test_bpe_without_pattern_saves_null(tmp_path):
    tok = BPETokenizer.train("abab abab", 258, pattern=None)
    tok.save(tmp_path / "t.json")
    assert json.loads((tmp_path / "t.json").read_text())["pattern"] is None
    assert BPETokenizer.load(tmp_path / "t.json").encode("abab abab") == tok.encode("abab abab")


def test_char_save_load_round_trip(tmp_path):
    tok = CharTokenizer.from_text("to be or not, é 😀")
    tok.save(tmp_path / "c.json")
    back = CharTokenizer.load(tmp_path / "c.json")
    assert back.chars == tok.chars and back.encode("not 😀") == tok.encode("not 😀")


@pytest.mark.parametrize("content, message", [
    ("not json at all", "not valid JSON"),
    ("[1, 2]", "not a groundup tokenizer file"),
    ('{"model": {"type": "BPE"}, "version": "1.0"}', "not a groundup tokenizer file"),
    ('{"format": "groundup-char-tokenizer", "version": 1, "chars": ["a"]}', "expected 'groundup-bpe-tokenizer'"),
    ('{"format": "groundup-bpe-tokenizer", "version": 7}', "format version 7"),
    ('{"format": "groundup-bpe-tokenizer", "version": 1, "pattern": null}', "missing field"),
    ('{"format": "groundup-bpe-tokenizer", "version": 1, "pattern": null, "special_tokens": {},'
     ' "merges": [[1, 2, 3]]}', "pairs of integer ids"),
    ('{"format": "groundup-bpe-tokenizer", "version": 1, "pattern": null, "special_tokens": {},'
     ' "merges": [[300, 2]]}', "not defined before it"),
    ('{"format": "groundup-bpe-tokenizer", "version": 1, "pattern": null, "special_tokens": {"<s>": 5},'
     ' "merges": []}', "special token ids must be"),
    ('{"format": "groundup-bpe-tokenizer", "version": 1, "pattern": "(", "special_tokens": {},'
     ' "merges": []}', "not one of the known patterns"),
])
def test_bpe_load_rejects_corrupt_or_foreign_files(tmp_path, content, message):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=message):
        BPETokenizer.load(path)


def test_bpe_load_rejects_truncated_file(tok, tmp_path):
    path = tmp_path / "tok.json"
    tok.save(path)
    path.write_text(path.read_text()[:-40])
    with pytest.raises(ValueError, match="not valid JSON"):
        BPETokenizer.load(path)


def test_char_load_rejects_bpe_file_and_corrupt_chars(tok, tmp_path):
    tok.save(tmp_path / "b.json")
    with pytest.raises(ValueError, match="expected 'groundup-char-tokenizer'"):
        CharTokenizer.load(tmp_path / "b.json")
    (tmp_path / "c.json").write_text('{"format": "groundup-char-tokenizer", "version": 1, "chars": ["ab"]}')
    with pytest.raises(ValueError, match="corrupt"):
        CharTokenizer.load(tmp_path / "c.json")


def test_load_rejects_huggingface_tokenizer_file(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    hf = tokenizers.Tokenizer(tokenizers.models.BPE())
    hf.save(str(tmp_path / "hf.json"))
    with pytest.raises(ValueError, match="not a groundup tokenizer file"):
        BPETokenizer.load(tmp_path / "hf.json")


# ---- bad arguments ---------------------------------------------------------------------------------------

def test_bad_arguments():
    with pytest.raises(ValueError, match=r"vocab_size must be at least .* = 257"):
        BPETokenizer.train("abc", 256, special_tokens=[EOT])
    with pytest.raises(TypeError, match="vocab_size must be an int"):
        BPETokenizer.train("abc", 300.0)
    with pytest.raises(TypeError, match="text must be a str"):
        BPETokenizer.train(b"abc", 300)
    with pytest.raises(TypeError, match="special_tokens must be a sequence"):
        BPETokenizer.train("abc", 300, special_tokens=EOT)
    with pytest.raises(ValueError, match="special_tokens must be distinct"):
        BPETokenizer.train("abc", 300, special_tokens=[EOT, EOT])
    tok = BPETokenizer.train("abc", 257)
    with pytest.raises(TypeError, match="text must be a str"):
        tok.encode(["a"])
    with pytest.raises(ValueError, match=r"ids must be integers in \[0, 257\)"):
        tok.decode([1, 257])
    with pytest.raises(ValueError, match="ids must be integers"):
        CharTokenizer.from_text("ab").decode([2])


def test_encode_cache_is_bounded(monkeypatch, tok):
    import groundup.tokenizers as module

    monkeypatch.setattr(module, "CACHE_SIZE", 3)
    tok._cache.clear()
    text = "one two three four five six seven"
    assert tok.decode(tok.encode(text)) == text
    assert len(tok._cache) <= 3


def _pair_counts_after(merges, text):
    """Equation (2.1) on the GPT-2 chunks of text after applying merges (with our encoder)."""
    before = BPETokenizer(merges)
    counts = Counter()
    for chunk in regex.findall(GPT2_SPLIT_PATTERN, text):
        ids = before.encode(chunk)
        counts.update(zip(ids, ids[1:], strict=False))
    return counts


def test_agrees_with_tokenizers_library_up_to_ties():
    # The Rust library, configured like ours (GPT-2 regex, 256-byte alphabet), breaks ties differently (it
    # numbers the bytes by their printable spelling, " " -> "G"), so its merge list may differ from ours
    # where counts tie. Check that (1) every merge it makes is a most frequent pair under our counting, and
    # (2) where its list first differs from ours, the two pairs tie.
    pytest.importorskip("tokenizers")
    from groundup.bench.tokenizers import library_tokenizer

    ours, lib = BPETokenizer.train(TEXT, 300), library_tokenizer(TEXT, 300)
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    spell = {b: chr(b) for b in keep} | {b: chr(256 + n) for n, b in enumerate(b for b in range(256) if b not in keep)}
    ids_of = {spell[b]: b for b in range(256)}
    lib_merges = []
    for left, right in json.loads(lib.to_str())["model"]["merges"]:
        lib_merges.append((ids_of[left], ids_of[right]))
        ids_of[left + right] = 255 + len(lib_merges)
    assert len(lib_merges) == len(ours.merges) == 44
    for k, pair in enumerate(lib_merges):
        counts = _pair_counts_after(lib_merges[:k], TEXT)
        assert counts[pair] == max(counts.values()), f"library merge {k} is not a most frequent pair"
    k = next((k for k in range(44) if lib_merges[k] != ours.merges[k]), None)
    if k is not None:  # on this text at k = 1: our " "+"C" against its "F"+"i", 15 times each
        counts = _pair_counts_after(ours.merges[:k], TEXT)
        assert counts[ours.merges[k]] == counts[lib_merges[k]] == max(counts.values())


# ---- hardening: tokenizer files are input from strangers -------------------------------------------------

BPE_HEAD = '{"format": "groundup-bpe-tokenizer", "version": 1, "pattern": null, "special_tokens": {}, '


def _write_merges(path, merges, pattern=None):
    path.write_text(json.dumps({"format": "groundup-bpe-tokenizer", "version": 1, "pattern": pattern,
                                "special_tokens": {}, "merges": merges}))
    return path


def test_chained_merges_file_loads_in_linear_memory(tmp_path):
    import tracemalloc

    # Each token one byte longer than the last: eager byte strings would need n**2 / 2 bytes, 1.8 GB here
    # (and 45 GB for the 4 MB file of 300,000 merges of the issue).
    n = 60_000
    path = _write_merges(tmp_path / "chain.json", [[97, 97]] + [[255 + k, 97] for k in range(1, n)])
    tracemalloc.start()
    try:
        tok = BPETokenizer.load(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 100 * 2**20, f"loading took {peak / 2**20:.0f} MiB"
    assert tok.vocab[256] == b"aa" and tok.vocab[256 + n - 1] == b"a" * (n + 1)
    assert tok.decode([256 + n - 1, 98]) == "a" * (n + 1) + "b"
    assert len(tok.vocab) == tok.vocab_size == 256 + n


def test_doubling_merges_file_is_rejected(tmp_path):
    # merge k doubles merge k-1: token 64 would be 2**65 bytes long.
    path = _write_merges(tmp_path / "double.json", [[97, 97]] + [[255 + k, 255 + k] for k in range(1, 64)])
    with pytest.raises(ValueError, match=r"corrupt tokenizer file: merge \d+ makes a token of more than"):
        BPETokenizer.load(path)


def test_lazy_vocab_equals_the_eager_one(tok):
    eager = {i: bytes([i]) for i in range(256)}
    for k, (a, b) in enumerate(tok.merges):
        eager[256 + k] = eager[a] + eager[b]
    eager[299] = EOT.encode()
    assert dict(tok.vocab) == eager and tok.vocab == eager
    assert 299 in tok.vocab and 300 not in tok.vocab and -1 not in tok.vocab
    with pytest.raises(KeyError):
        tok.vocab[300]


def test_lazy_vocab_rebuilds_long_tokens(monkeypatch):
    import groundup.tokenizers as module

    monkeypatch.setattr(module, "MEMO_TOKEN_BYTES", 4)  # tokens longer than 4 bytes are put together on demand
    tok = BPETokenizer.train("abcdefgh " * 20, 270, pattern=None)
    assert max(len(tok.vocab[i]) for i in tok.vocab) > 4
    text = "abcdefgh " * 3 + "hgfedcba"
    assert tok.decode(tok.encode(text)) == text


@pytest.mark.parametrize("name, limit, value", [
    ("MAX_FILE_BYTES", 100, None), ("MAX_MERGES", 3, None), ("MAX_SPECIAL_TOKENS", 1, None),
])
def test_load_bounds_what_a_file_may_describe(tmp_path, monkeypatch, name, limit, value):
    import groundup.tokenizers as module

    BPETokenizer.train(TEXT, 262, special_tokens=["<a>", "<b>"]).save(tmp_path / "t.json")
    monkeypatch.setattr(module, name, limit)
    with pytest.raises(ValueError, match="corrupt tokenizer file"):
        BPETokenizer.load(tmp_path / "t.json")


@pytest.mark.parametrize("content", [
    "[" * 100_000 + "]" * 100_000,                                          # nesting deeper than the recursion limit
    BPE_HEAD + '"merges": [[' + "1" * 4300 + ", 2]]}",                      # an integer Python refuses to parse
    BPE_HEAD.replace('"version": 1', '"version": true') + '"merges": []}',  # True == 1 in Python
    BPE_HEAD.replace('"version": 1', '"version": 1.0') + '"merges": []}',
    BPE_HEAD.replace('"version": 1', '"version": "1"') + '"merges": []}',
])
def test_load_gives_corrupt_file_error_for_deep_nesting_huge_ints_and_odd_versions(tmp_path, content):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ValueError, match="corrupt tokenizer file"):
        BPETokenizer.load(path)
    path.write_text(content.replace("groundup-bpe-tokenizer", "groundup-char-tokenizer"))
    with pytest.raises(ValueError, match="corrupt tokenizer file"):
        CharTokenizer.load(path)


def test_load_of_a_file_that_is_not_utf8_says_it_is_not_valid_json(tmp_path):
    (tmp_path / "bad.json").write_bytes(b"\xff\xfe not utf-8")
    with pytest.raises(ValueError, match="is not a groundup tokenizer file: it is not valid JSON"):
        BPETokenizer.load(tmp_path / "bad.json")


CATASTROPHIC = r"(?:a|a)+$"


def test_file_with_an_unknown_pattern_needs_trust(tmp_path):
    path = _write_merges(tmp_path / "evil.json", [], pattern=CATASTROPHIC)
    with pytest.raises(ValueError, match="not one of the known patterns.*trust_pattern=True"):
        BPETokenizer.load(path)
    assert BPETokenizer.load(path, trust_pattern=True).pattern == CATASTROPHIC
    with pytest.raises(ValueError, match="corrupt tokenizer file"):
        BPETokenizer.load(_write_merges(tmp_path / "broken.json", [], pattern="("), trust_pattern=True)
    for pattern in (GPT2_SPLIT_PATTERN, None):
        assert BPETokenizer.load(_write_merges(tmp_path / "ok.json", [], pattern)).pattern == pattern


def test_catastrophic_pattern_times_out_instead_of_hanging(tmp_path, monkeypatch):
    import time

    import groundup.tokenizers as module

    monkeypatch.setattr(module, "REGEX_TIMEOUT_BASE", 0.2)
    tok = BPETokenizer.load(_write_merges(tmp_path / "evil.json", [], pattern=CATASTROPHIC), trust_pattern=True)
    start = time.monotonic()
    with pytest.raises(ValueError, match="backtracks catastrophically"):
        tok.encode("a" * 60 + "!")  # 2**60 steps without the timeout
    assert time.monotonic() - start < 30
    with pytest.raises(ValueError, match="backtracks catastrophically"):
        BPETokenizer.train("a" * 60 + "!", 300, pattern=CATASTROPHIC)


@pytest.mark.parametrize("pattern", [r"\w+", r"(\w)\w*", r"\b", r"[a-z]+|\d"])
def test_pattern_gaps_are_encoded_not_dropped(pattern):
    text = "Hello, world! 42 times."
    tok = BPETokenizer.train(text * 5, 280, pattern=pattern)
    assert tok.decode(tok.encode(text)) == text
    assert tok.decode(BPETokenizer([], pattern=pattern).encode(text)) == text


def test_lines_pattern_chunks_are_its_matches():
    # A pattern that covers every character: the chunks are exactly its matches, as before.
    lines_only = r"[^\n]+\n?|\n"
    tok = BPETokenizer([], pattern=lines_only)
    text = "one\ntwo\n\nthree"
    assert tok._split(text) == regex.findall(lines_only, text)


def _fail_fsync(monkeypatch):
    from groundup import utils

    def failing_fsync(fd):
        raise OSError("disk full")

    monkeypatch.setattr(utils.os, "fsync", failing_fsync)


def test_failed_save_keeps_the_previous_file(tok, tmp_path, monkeypatch):
    path = tmp_path / "tok.json"
    tok.save(path)
    before = path.read_bytes()
    _fail_fsync(monkeypatch)
    with pytest.raises(OSError, match="disk full"):
        BPETokenizer.train("something else", 260).save(path)
    with pytest.raises(OSError, match="disk full"):
        CharTokenizer.from_text("abc").save(path)
    monkeypatch.undo()
    assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["tok.json"]
    assert BPETokenizer.load(path).merges == tok.merges


@settings(max_examples=100, deadline=None)
@given(st.text(min_size=1))
def test_every_char_tokenizer_is_savable(tmp_path_factory, text):
    # Lone surrogates included: JSON escapes them, so the file stays valid UTF-8.
    path = tmp_path_factory.mktemp("c") / "c.json"
    tok = CharTokenizer.from_text(text)
    tok.save(path)
    path.read_bytes().decode("utf-8")
    assert CharTokenizer.load(path).chars == tok.chars


@settings(max_examples=50, deadline=None)
@given(st.lists(st.text(st.characters(blacklist_categories=["Cs"]), min_size=1, max_size=8), max_size=4,
                unique=True))
def test_every_bpe_tokenizer_is_savable(tmp_path_factory, specials):
    path = tmp_path_factory.mktemp("b") / "b.json"
    tok = BPETokenizer.train("abc abd abe", 260, special_tokens=specials)
    tok.save(path)
    back = BPETokenizer.load(path)
    assert back.special_ids == tok.special_ids and back.merges == tok.merges


def test_lone_surrogates_are_refused_with_a_clear_error(tok):
    with pytest.raises(ValueError, match=r"lone surrogate '\\ud800' at index 2"):
        tok.encode("ab\ud800c")
    with pytest.raises(ValueError, match="lone surrogate"):
        BPETokenizer.train("ab\udfffc", 260)
    with pytest.raises(ValueError, match="special_tokens must not contain lone surrogates"):
        BPETokenizer([], special_tokens=["<\ud800>"])
    with pytest.raises(ValueError, match="pattern must not contain lone surrogates"):
        BPETokenizer([], pattern="\ud800+")


def test_decode_never_returns_a_lone_surrogate(tok):
    assert tok.decode([0xED, 0xA0, 0x80]) == "\ufffd" * 3  # the UTF-8-like form of U+D800 is not UTF-8
    assert tok.decode([0xED, 0x9F, 0xBF]) == "\ud7ff"  # the last code point before the surrogates is fine


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 298), max_size=12))
def test_decode_always_gives_printable_savable_text(tok, ids):
    tok.decode(ids).encode("utf-8")  # never a lone surrogate


# ---- byte-to-id maps and GPT-2's published tokenizer --------------------------------------------------------

import tiktoken  # noqa: E402

from groundup import data as data_module  # noqa: E402
from groundup.tokenizers import load_gpt2_tokenizer, merges_from_ranks, read_tiktoken_ranks  # noqa: E402


def _ranks_of(tok: BPETokenizer, byte_order: list[int]) -> dict[bytes, int]:
    """A tiktoken ranks table for the vocabulary of ``tok`` whose single bytes are ranked in ``byte_order``."""
    ranks = {bytes([b]): r for r, b in enumerate(byte_order)}
    for k in range(len(tok.merges)):
        ranks[tok.vocab[256 + k]] = 256 + k
    return ranks


def _tiktoken(ranks, specials=None):
    return tiktoken.Encoding("test", pat_str=GPT2_SPLIT_PATTERN, mergeable_ranks=ranks,
                             special_tokens=specials or {})


MIXED = ("Tokenizers: 12345 + 678 = 13023, don't   stop;\n\n  trailing  \t\nünïcödé 日本語 Ελληνικά 🙂🙂 ﬁ "
         "Aragorn, Frodo and Gandalf.")


@pytest.fixture(scope="module")
def gpt2():
    return load_gpt2_tokenizer()


@pytest.fixture(scope="module")
def gpt2_reference():
    from groundup.data import locate_asset
    ranks = read_tiktoken_ranks(locate_asset("gpt2.tiktoken")[0])
    return _tiktoken(ranks, {"<|endoftext|>": 50256})


def test_byte_ids_give_the_same_tokens_under_other_numbers_as_tiktoken():
    trained = BPETokenizer.train(TEXT, 300)
    order = list(range(256))
    random.Random(0).shuffle(order)
    ranks = _ranks_of(trained, order)
    byte_ids, merges = merges_from_ranks(ranks)
    assert byte_ids == [order.index(b) for b in range(256)]
    tok = BPETokenizer(merges, byte_ids=byte_ids)
    reference = _tiktoken(ranks)
    for text in (TEXT, MIXED, "", " ", "\x00\xff"):
        assert tok.encode(text) == reference.encode_ordinary(text)
        assert tok.decode(tok.encode(text)) == text
    # the same tokens as the identity-numbered tokenizer, only renamed
    rename = {i: (byte_ids[i] if i < 256 else i) for i in range(trained.vocab_size)}
    assert tok.encode(TEXT) == [rename[i] for i in trained.encode(TEXT)]
    assert tok.vocab[byte_ids[ord("a")]] == b"a"


@settings(max_examples=60, deadline=None)
@given(st.text(max_size=80))
def test_gpt2_tokenizer_matches_tiktoken_on_any_text(gpt2, gpt2_reference, text):
    assert gpt2.encode_ordinary(text) == gpt2_reference.encode_ordinary(text)
    assert gpt2.decode(gpt2.encode_ordinary(text)) == text


def test_gpt2_tokenizer_is_gpt2s(gpt2, gpt2_reference):
    assert gpt2.vocab_size == 50257 == gpt2_reference.n_vocab
    assert len(gpt2.merges) == 50000 and gpt2.special_ids == {"<|endoftext|>": 50256}
    assert gpt2.encode("!") == [0] and gpt2.vocab[0] == b"!" and gpt2.vocab[50256] == b"<|endoftext|>"
    assert gpt2.encode(" the") == [262] and gpt2.encode("Hello world") == [15496, 995]
    from groundup.data import load_corpus
    text = load_corpus("shakespeare")[:400_000]
    assert gpt2.encode_ordinary(text) == gpt2_reference.encode_ordinary(text)
    mixed = MIXED + "<|endoftext|>" + MIXED
    assert gpt2.encode(mixed) == gpt2_reference.encode(mixed, allowed_special="all")
    assert gpt2.encode(mixed).count(50256) == 1 and 50256 not in gpt2.encode_ordinary(mixed)
    assert gpt2.encode_ordinary(mixed) == gpt2_reference.encode_ordinary(mixed)


def _random_word(n, letters="abcdefghijklmnopqrstuvwxyz", seed=0):
    rng = random.Random(seed)
    return "".join(rng.choice(letters) for _ in range(n))


@pytest.mark.parametrize("text", [
    _random_word(32_000),  # one chunk of 32k letters: the case that was superlinear
    "a" * 10_000 + " " + "ab" * 5000,  # overlapping pairs, a repeated pair
    " " + _random_word(3000, "éü日本🙂x", seed=1),  # multi-byte letters and emoji
    "1" * 5000 + "!?" * 3000 + "\n" * 2000 + " \t" * 2000,  # digits, symbols and whitespace runs
])
def test_gpt2_tokenizer_matches_tiktoken_on_long_and_hostile_chunks(gpt2, gpt2_reference, text):
    assert gpt2.encode_ordinary(text) == gpt2_reference.encode_ordinary(text)
    assert gpt2.decode(gpt2.encode_ordinary(text)) == text


def test_gpt2_tokenizer_saves_as_version_2_and_loads_back(gpt2, tmp_path):
    gpt2.save(tmp_path / "gpt2.json")
    data = json.loads((tmp_path / "gpt2.json").read_text())
    assert data["version"] == 2 and sorted(data["byte_ids"]) == list(range(256))
    back = BPETokenizer.load(tmp_path / "gpt2.json")
    assert back.byte_ids == gpt2.byte_ids and back.encode(MIXED) == gpt2.encode(MIXED)
    plain = BPETokenizer.train(TEXT, 270)  # no byte map: still written as version 1
    plain.save(tmp_path / "plain.json")
    assert json.loads((tmp_path / "plain.json").read_text())["version"] == 1


@pytest.mark.parametrize("byte_ids, message", [
    ("[0, 0]", "corrupt tokenizer file"),
    (json.dumps(list(range(255)) + [254]), "permutation"),
    (json.dumps(list(range(1, 257))), "permutation"),
    ('"abc"', "sequence of 256 ints"),
    (None, "must hold \"byte_ids\""),
])
def test_corrupt_byte_ids_are_refused(tmp_path, byte_ids, message):
    field = "" if byte_ids is None else f', "byte_ids": {byte_ids}'
    path = tmp_path / "t.json"
    path.write_text('{"format": "groundup-bpe-tokenizer", "version": 2, "pattern": null, "special_tokens": {}'
                    f'{field}, "merges": []}}')
    with pytest.raises(ValueError, match=message):
        BPETokenizer.load(path)


def test_byte_ids_argument_is_checked():
    with pytest.raises(ValueError, match="permutation"):
        BPETokenizer((), byte_ids=[0] * 256)
    with pytest.raises(TypeError, match="256 ints"):
        BPETokenizer((), byte_ids="abc")
    assert BPETokenizer((), byte_ids=range(256)).byte_ids is None  # the identity is the ordinary case


@pytest.mark.parametrize("text, message", [
    ("IQ== 0\nIg== 2\n", "rank 1"),
    ("IQ== 0\nIQ== 1\n", "new non-empty token"),
    ("not*base64! 0\n", "invalid base64"),
    ("IQ==\n", "not '<base64 token> <rank>'"),
    ("IQ== -1\n", "not '<base64 token> <rank>'"),
])
def test_read_tiktoken_ranks_rejects_malformed_files(text, message):
    with pytest.raises(ValueError, match=message):
        read_tiktoken_ranks(text)


def test_merges_from_ranks_rejects_tables_that_are_not_byte_level_bpe():
    ranks = {bytes([b]): b for b in range(256)}
    with pytest.raises(ValueError, match="first 256 tokens"):
        merges_from_ranks({b"ab": 0, **{bytes([b]): b + 1 for b in range(255)}})
    ranks[b"abc"] = 256  # no "ab" or "bc" below it: not the merge of two earlier tokens
    with pytest.raises(ValueError, match="cannot be made by merging"):
        merges_from_ranks(ranks)


def test_gpt2_ranks_come_from_a_verified_archive(tmp_path, monkeypatch):
    fake = tmp_path / "openai_whisper-20250625.tar.gz"
    fake.write_bytes(b"not the archive")
    with pytest.raises(data_module.CorpusError, match="SHA-256"):
        data_module.gpt2_ranks_from_archive(fake)
    with pytest.raises(ValueError, match="unknown data file 'gpt3.tiktoken'"):
        data_module.locate_asset("gpt3.tiktoken")
    # a file in GROUNDUP_DATA_DIR with the wrong contents is refused, not used
    (tmp_path / "gpt2.tiktoken").write_text("IQ== 0\n")
    monkeypatch.setenv("GROUNDUP_DATA_DIR", str(tmp_path))
    with pytest.raises(data_module.CorpusError, match="SHA-256"):
        data_module.locate_asset("gpt2.tiktoken")


def test_encode_ordinary_treats_special_strings_as_text():
    tok = BPETokenizer.train(TEXT, 300, special_tokens=[EOT])
    assert tok.encode("a" + EOT) == tok.encode("a") + [tok.special_ids[EOT]]
    assert tok.special_ids[EOT] not in tok.encode_ordinary("a" + EOT)
    assert tok.decode(tok.encode_ordinary("a" + EOT)) == "a" + EOT
    with pytest.raises(TypeError):
        tok.encode_ordinary(b"bytes")


def test_gpt2_bench_fits_the_exponent_and_builds_tiktoken_from_our_ranks(gpt2):
    from groundup.bench import gpt2_tokenizer as bench

    lengths = bench.WORD_LENGTHS
    assert bench.fitted_exponent(lengths, [3e-6 * n**1.5 for n in lengths]) == pytest.approx(1.5, abs=1e-12)
    assert bench.fitted_exponent(lengths, [2e-7 * n for n in lengths]) == pytest.approx(1.0, abs=1e-12)
    word = bench.random_word(500)
    assert len(word) == 500 and word.isalpha() and word.islower() and regex.findall(GPT2_SPLIT_PATTERN, word) == [word]
    assert bench.tiktoken_gpt2().encode_ordinary(MIXED + word) == gpt2.encode_ordinary(MIXED + word)


# ---- the two speed-ups of GPT-2's tokenizer: a reordered split pattern and whole tokens -------------------------

from groundup.tokenizers import _FASTER_SPLIT  # noqa: E402

SPLIT_ALPHABET = "'stremvldST aé日1٣²_!?-\n\t\u00a0\u2009🙂"  # contraction letters, spaces, letters, digits


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=SPLIT_ALPHABET, max_size=60) | st.text(max_size=60))
def test_faster_split_finds_gpt2s_chunks(text):
    assert regex.findall(_FASTER_SPLIT[GPT2_SPLIT_PATTERN], text) == regex.findall(GPT2_SPLIT_PATTERN, text)


def test_faster_split_finds_gpt2s_chunks_on_the_corpus():
    from groundup.data import load_corpus

    text = load_corpus("shakespeare")[:1_000_000] + MIXED + " 's 'S 're're 'll'd 've  's\n 't"
    faster = regex.compile(_FASTER_SPLIT[GPT2_SPLIT_PATTERN]).findall(text)
    assert faster == regex.compile(GPT2_SPLIT_PATTERN).findall(text) and len(faster) > 250_000
    assert BPETokenizer(())._split("I'll") == ["I", "'ll"]  # the tokenizer splits with the faster form


def test_every_gpt2_token_encodes_to_itself(gpt2):
    """What whole_tokens=True promises for a tokenizer made from ranks (merges_from_ranks's argument)."""
    assert gpt2._whole and len(gpt2._whole) > 49_000
    for i in range(256, 256 + len(gpt2.merges)):
        assert merge_by_scan(list(gpt2.vocab[i].translate(gpt2._byte_table)), gpt2.ranks) == [i]
    assert all(gpt2.vocab[i] == s.encode() for s, i in gpt2._whole.items())


def test_whole_tokens_is_a_promise_not_every_tokenizer_keeps():
    # merges ab (256), bc (257), a+bc (258): "abc" encodes as ab, c, though "abc" is token 258
    a, b, c = ord("a"), ord("b"), ord("c")
    merges = [(a, b), (b, c), (a, 257)]
    assert BPETokenizer(merges, pattern=None).encode("abc") == [256, c]
    assert BPETokenizer(merges, pattern=None, whole_tokens=True).encode("abc") == [258]  # the broken promise
    assert BPETokenizer(merges, pattern=None)._whole == {}  # off by default


def test_whole_tokens_change_no_id_of_gpt2(gpt2):
    plain = load_gpt2_tokenizer()
    plain._whole = {}
    text = MIXED + "".join(gpt2.decode([i]) for i in range(0, 50_000, 7))
    assert gpt2.encode_ordinary(text) == plain.encode_ordinary(text)
    assert gpt2._cache and all(type(ids) is tuple for ids in gpt2._cache.values())
