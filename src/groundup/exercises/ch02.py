"""Checkers for chapter 2 (tokenization): pair counting, merging, encoding with merges, bytes per token.

Expected values are computed before the reader's function runs; it is called through
:func:`~groundup.exercises.checking.call_reader` (copies of the inputs, in-place changes reported, answer types
checked).
"""

from __future__ import annotations

import random
from collections.abc import Callable

from groundup.exercises.checking import Mismatch, Verdict, call_reader, expect, expect_close, expect_number, run_checks
from groundup.tokenizers import BPETokenizer, CharTokenizer, merge, merge_by_scan, merge_with_heap

__all__ = ["check_most_frequent_pair", "check_merge", "check_encode_with_merges", "check_bytes_per_token"]

_ENCODERS = (merge, merge_by_scan, merge_with_heap, BPETokenizer.encode)  # the package's own solutions



def _pair(got, call: str):
    """The reader's answer as a tuple, or None; a :class:`Mismatch` naming the expected type otherwise."""
    if got is None:
        return None
    if isinstance(got, (tuple, list)) and len(got) == 2:
        return tuple(got)
    raise Mismatch(f"{call} returned {got!r:.60}, expected a pair (a, b) or None",
                   "Return the pair as a tuple of two ids, e.g. (1, 2), or None when there is no pair.")


def check_most_frequent_pair(fn: Callable) -> Verdict:
    """Exercise 2.1: ``fn(ids)`` returns the most frequent adjacent pair; ties go to the smallest pair; ``None``
    when ``ids`` has fewer than two elements."""

    def checks():
        cases = [
            ([1, 2, 3, 1, 2], (1, 2), "(1, 2) occurs twice, every other pair once."),
            ([5, 6, 1, 2], (1, 2), "All pairs occur once: the tie rule picks the smallest pair, (1, 2), even "
                                   "though (5, 6) comes first. Compare pairs as tuples: (1, 2) < (5, 6)."),
            ([7, 7, 7], (7, 7), "[7, 7, 7] holds two overlapping pairs (7, 7): count every adjacent position."),
            ([9, 3, 9, 3, 3, 9], (3, 9), "(9, 3) and (3, 9) both occur twice; the smaller one, (3, 9), wins."),
        ]
        for ids, expected, hint in cases:
            call = f"most_frequent_pair({ids})"
            got = _pair(call_reader(fn, list(ids), call=call, names=("ids",)), call)
            expect(got == expected,
                   f"most_frequent_pair({ids}) returned {got!r}, expected {expected}", hint)
        for ids in ([], [4]):
            call = f"most_frequent_pair({ids})"
            got = _pair(call_reader(fn, ids, call=call, names=("ids",)), call)
            expect(got is None, f"most_frequent_pair({ids}) returned {got!r}, expected None",
                   "A list with fewer than two ids has no pair: return None.")
        rng = random.Random(2)
        ids = [rng.randrange(6) for _ in range(300)]
        counts = {}
        for p in zip(ids, ids[1:], strict=False):
            counts[p] = counts.get(p, 0) + 1
        expected = min(counts, key=lambda p: (-counts[p], p))
        call = "most_frequent_pair(300 random ids)"
        got = _pair(call_reader(fn, list(ids), call=call, names=("ids",)), call)
        expect(got == expected,
               f"on 300 random ids in 0..5 most_frequent_pair returned {got!r}, expected {expected} "
               f"(it occurs {counts[expected]} times)",
               "Count with collections.Counter(zip(ids, ids[1:])), then take the pair with the largest count, "
               "ties to the smallest pair: min(counts, key=lambda p: (-counts[p], p)).")

    return run_checks("Exercise 2.1 (most frequent pair)", checks,
                      "That is the choice every step of BPE training makes.")


def check_merge(fn: Callable) -> Verdict:
    """Exercise 2.2: ``fn(ids, pair, new_id)`` replaces every occurrence of ``pair``, scanning left to right."""

    def checks():
        cases = [
            (([1, 2, 3, 1, 2], (1, 2), 9), [9, 3, 9], "Replace every occurrence, not only the first."),
            (([3, 1, 2], (1, 2), 9), [3, 9], "A pair at the very end counts too: check i + 1 < len(ids)."),
            (([1, 3, 2], (1, 2), 9), [1, 3, 2], "Only ADJACENT ids form a pair."),
            (([2, 1], (1, 2), 9), [2, 1], "A pair is ordered: (1, 2) is not (2, 1)."),
            (([7, 7, 7], (7, 7), 9), [9, 7], "Overlaps resolve to the left: after merging ids[i], ids[i + 1] "
                                             "skip both (i += 2), so [7, 7, 7] becomes [9, 7]."),
            (([7, 7, 7, 7], (7, 7), 9), [9, 9], "[7, 7, 7, 7] becomes [9, 9]: skip both ids of a merged pair."),
            (([], (1, 2), 9), [], "An empty list stays empty."),
            (([12, 1, 2], (1, 2), 300), [12, 300], "Ids can be larger than 255 (merged tokens)."),
        ]
        for (ids, pair, new_id), expected, hint in cases:
            call = f"merge({ids}, {pair}, {new_id})"
            got = call_reader(fn, ids, pair, new_id, call=call, names=("ids", "pair", "new_id"), returns=list,
                              expected="a list of ids", forbid=(merge,))
            expect(got == expected, f"{call} returned {got!r}, expected {expected}", hint)

    return run_checks("Exercise 2.2 (merge a pair)", checks, "This is one BPE merge step.")


def _reference_merges() -> list[tuple[int, int]]:
    text = "the thin thief thought the theme was thrilling; the other three thanked them. " * 4
    return BPETokenizer.train(text, 256 + 24, pattern=None).merges


def check_encode_with_merges(fn: Callable) -> Verdict:
    """Exercise 2.3: ``fn(text, merges)`` encodes ``text`` (no pre-tokenization) with a list of merges, where
    ``merges[k] = (a, b)`` makes id ``256 + k``."""

    def checks():
        merges = _reference_merges()
        reference = BPETokenizer(merges, pattern=None)
        names = ("text", "merges")
        got = call_reader(fn, "abc", [], call="encode_with_merges('abc', [])", names=names, returns=list,
                          expected="a list of ids", forbid=_ENCODERS)
        expect(got == [97, 98, 99], f"encode_with_merges('abc', []) returned {got!r}, expected [97, 98, 99]",
               "Start from the UTF-8 bytes: list(text.encode('utf-8')).")
        got = call_reader(fn, "é", [], call="encode_with_merges('é', [])", names=names, returns=list,
                          expected="a list of ids", forbid=_ENCODERS)
        expect(got == [195, 169], f"encode_with_merges('é', []) returned {got!r}, expected [195, 169]",
               "Use the UTF-8 bytes of the text, not ord() of its characters: 'é' is two bytes.")
        small = [(97, 98), (98, 99), (256, 99)]
        for text, expected in [("abc", [258]), ("bcab", [257, 256]), ("abcbc", [258, 257])]:
            got = call_reader(fn, text, small, call=f"encode_with_merges({text!r}, {small})", names=names,
                              returns=list, expected="a list of ids", forbid=_ENCODERS)
            expect(got == expected, f"encode_with_merges({text!r}, {small}) returned {got!r}, expected {expected}",
                   "Merges must be applied in the order they were learned: (97, 98) before (98, 99). Repeatedly "
                   "merge the adjacent pair with the lowest rank (k), until no pair has a rank.")
        for text in ["the three thin thieves", "there they go, thinking", "xyz then the", "thé thé 😀 th"]:
            expected = reference.encode(text)
            got = call_reader(fn, text, merges, call=f"encode_with_merges({text!r}, merges)", names=names,
                              returns=list, expected="a list of ids", forbid=_ENCODERS)
            expect(got == expected, f"encode_with_merges({text!r}, merges) returned {got!r}, expected {expected}",
                   "Repeat: among adjacent pairs that have a merge, merge the one learned first (smallest k), "
                   "everywhere in the list, giving id 256 + k.")

    return run_checks("Exercise 2.3 (encode with merges)", checks, "Your encoder agrees with BPETokenizer.encode.")


def check_bytes_per_token(fn: Callable) -> Verdict:
    """Exercise 2.4: ``fn(tokenizer, text)`` returns the compression, UTF-8 bytes per token."""

    def checks():
        char = CharTokenizer.from_text("héllo wörld")
        text = "hé wörld héllo"
        expected = len(text.encode("utf-8")) / len(char.encode(text))
        chars_per_token = len(text) / len(char.encode(text))
        bpe = BPETokenizer.train("to be or not to be, that is the question " * 10, 300)
        text2 = "to be, or not to be: that is the question!"
        expected2 = len(text2.encode()) / len(bpe.encode(text2))
        names = ("tokenizer", "text")

        call = f"bytes_per_token(CharTokenizer, {text!r})"
        got = expect_number(call_reader(fn, char, text, call=call, names=names), call)
        hint = "Divide the number of UTF-8 BYTES, len(text.encode('utf-8')), by the number of tokens."
        if abs(got - chars_per_token) < 1e-9:
            hint = "You counted characters; count UTF-8 bytes instead (len(text.encode('utf-8')))."
        elif got > 0 and abs(1 / got - expected) < 1e-9:
            hint = "You computed tokens per byte; invert it: bytes / tokens."
        expect_close(got, expected, call, hint, rtol=1e-9)
        call = f"bytes_per_token(BPETokenizer, {text2!r})"
        got = expect_number(call_reader(fn, bpe, text2, call=call, names=names), call)
        expect_close(got, expected2, call, "Use tokenizer.encode(text) to count the tokens.", rtol=1e-9)

    return run_checks("Exercise 2.4 (bytes per token)", checks, "Higher means more text fits in a context.")
