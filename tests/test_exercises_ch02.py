"""Each chapter-2 checker accepts the reference solution (the notebook's hidden one), rejects a plausible wrong
answer with a helpful message, and treats the unattempted stub kindly."""

from collections import Counter

import pytest

from groundup.exercises import checking as _checking
from groundup.exercises.ch02 import (
    check_bytes_per_token,
    check_encode_with_merges,
    check_merge,
    check_most_frequent_pair,
)

# --- reference solutions (the same code as the notebook's hidden solution cells) ---------------------------


def most_frequent_pair(ids):
    counts = Counter(zip(ids, ids[1:], strict=False))
    if not counts:
        return None
    return min(counts, key=lambda p: (-counts[p], p))


def merge(ids, pair, new_id):
    out, i = [], 0
    while i < len(ids):
        if i + 1 < len(ids) and (ids[i], ids[i + 1]) == pair:
            out.append(new_id)
            i += 2
        else:
            out.append(ids[i])
            i += 1
    return out


def encode_with_merges(text, merges):
    ranks = {pair: 256 + k for k, pair in enumerate(merges)}
    ids = list(text.encode("utf-8"))
    while len(ids) >= 2:
        pair = min(zip(ids, ids[1:], strict=False), key=lambda p: ranks.get(p, float("inf")))
        if pair not in ranks:
            break
        ids = merge(ids, pair, ranks[pair])
    return ids


def bytes_per_token(tokenizer, text):
    return len(text.encode("utf-8")) / len(tokenizer.encode(text))


def stub(*args):
    raise NotImplementedError


# --- wrong answers --------------------------------------------------------------------------------------------


def most_frequent_pair_first_seen(ids):
    counts = Counter(zip(ids, ids[1:], strict=False))
    return counts.most_common(1)[0][0] if counts else None  # ties -> the pair seen first


def merge_first_only(ids, pair, new_id):
    for i in range(len(ids) - 1):
        if (ids[i], ids[i + 1]) == pair:
            return ids[:i] + [new_id] + ids[i + 2:]
    return list(ids)


def merge_in_place(ids, pair, new_id):
    out = merge(ids, pair, new_id)
    ids[:] = out
    return out


def encode_by_characters(text, merges):
    ranks = {pair: 256 + k for k, pair in enumerate(merges)}
    ids = [ord(c) for c in text]
    for pair in ranks:
        ids = merge(ids, pair, ranks[pair])
    return ids


def encode_longest_match(text, merges):
    vocab = {bytes([i]): i for i in range(256)}
    pieces = {i: bytes([i]) for i in range(256)}
    for k, (a, b) in enumerate(merges):
        pieces[256 + k] = pieces[a] + pieces[b]
        vocab[pieces[256 + k]] = 256 + k
    data, out, i = text.encode(), [], 0
    while i < len(data):
        j = max(j for j in range(i + 1, len(data) + 1) if data[i:j] in vocab)
        out.append(vocab[data[i:j]])
        i = j
    return out


def chars_per_token(tokenizer, text):
    return len(text) / len(tokenizer.encode(text))


def tokens_per_byte(tokenizer, text):
    return len(tokenizer.encode(text)) / len(text.encode("utf-8"))


# --- tests ----------------------------------------------------------------------------------------------------

CASES = [
    (check_most_frequent_pair, most_frequent_pair, most_frequent_pair_first_seen, "tie rule picks the smallest"),
    (check_merge, merge, merge_first_only, "Replace every occurrence"),
    (check_merge, merge, merge_in_place, "changed its input ids in place"),
    (check_encode_with_merges, encode_with_merges, encode_by_characters, "not ord"),
    (check_encode_with_merges, encode_with_merges, encode_longest_match, "merge the one learned first"),
    (check_bytes_per_token, bytes_per_token, chars_per_token, "You counted characters"),
    (check_bytes_per_token, bytes_per_token, tokens_per_byte, "tokens per byte"),
]


@pytest.mark.parametrize("checker, right, wrong, hint", CASES, ids=[f"{c[0].__name__}-{c[2].__name__}" for c in CASES])
def test_checker_accepts_reference_and_rejects_wrong(checker, right, wrong, hint, capsys):
    assert checker(right).passed is True
    assert "✅" in capsys.readouterr().out
    assert checker(wrong).passed is False
    out = capsys.readouterr().out
    assert "❌" in out and "Hint:" in out and hint in out


@pytest.mark.parametrize("checker", [check_most_frequent_pair, check_merge, check_encode_with_merges,
                                     check_bytes_per_token])
def test_checker_handles_stub(checker, capsys):
    assert checker(stub).passed is False
    assert "not attempted yet" in capsys.readouterr().out


def test_checker_reports_crash(capsys):
    assert check_merge(lambda ids, pair, new_id: ids[99]).passed is False
    assert "raised IndexError" in capsys.readouterr().out


@pytest.fixture(autouse=True)
def _unwrapped_verdicts(monkeypatch):
    """Match hints as whole lines; tests/test_checking.py tests the wrapping to the book's width."""
    monkeypatch.setattr(_checking, "MESSAGE_WIDTH", 10_000)


def test_the_packages_merging_and_encoding_are_refused(capsys):
    from groundup import tokenizers

    assert not check_merge(tokenizers.merge)
    assert "calls groundup.tokenizers.merge" in capsys.readouterr().out

    def via_the_package(text, merges):
        return tokenizers.merge_by_scan(list(text.encode("utf-8")), {pair: k for k, pair in enumerate(merges)})

    assert not check_encode_with_merges(via_the_package)
    assert "calls groundup.tokenizers.merge_by_scan" in capsys.readouterr().out
    assert tokenizers.merge([1, 2, 1, 2], (1, 2), 9) == [9, 9], "the package works again afterwards"
