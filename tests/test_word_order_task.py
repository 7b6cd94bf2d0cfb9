"""The real-or-shuffled task (groundup.classification.word_order_task): labels, characters kept, split kept."""

import random
from collections import Counter

import pytest

from groundup.classification import (
    WORD_ORDER_CLASSES,
    Passages,
    char_ngrams,
    majority_accuracy,
    play_passages,
    word_order_task,
)


def passages(texts):
    return Passages(tuple(texts), (0,) * len(texts), tuple(f"P #{i // 2}" for i in range(len(texts))), ("P",))


TEXTS = ["to be or not to be", "that is the question", "whether tis nobler\nin the mind", "to suffer the slings",
         "word", "and arrows of outrageous", "a a a", "fortune or to take arms"]


def test_every_second_passage_is_shuffled_and_keeps_its_characters():
    task = word_order_task(passages(TEXTS), seed=3)
    assert task.classes == WORD_ORDER_CLASSES == ("real", "shuffled")
    assert task.sections == passages(TEXTS).sections
    assert task.labels == (0, 1, 0, 1, 0, 1, 0, 1)
    for i, (before, after) in enumerate(zip(TEXTS, task.texts, strict=True)):
        assert len(after) == len(before) and sorted(after) == sorted(before)
        assert Counter(after.split(" ")) == Counter(before.split(" "))  # the same words, "nobler\nin" one of them
        assert (after != before) == bool(i % 2)
        assert char_ngrams(after, (1,)) == char_ngrams(before, (1,))
    # the shuffle is random.Random(f"{seed}:{section}:{index}") applied until the text changes
    words = TEXTS[1].split(" ")
    random.Random("3:P #0:1").shuffle(words)
    assert task.texts[1] == " ".join(words) != TEXTS[1]


def test_a_passage_no_shuffle_changes_stays_real():
    task = word_order_task(passages(["x y", "word", "z", "a a a"]))
    assert task.texts == ("x y", "word", "z", "a a a") and task.labels == (0, 0, 0, 0)


def test_word_order_task_is_deterministic_and_seeded():
    assert word_order_task(passages(TEXTS), seed=1) == word_order_task(passages(TEXTS), seed=1)
    many = [f"w{i} " + " ".join(f"v{j}" for j in range(8)) for i in range(20)]
    assert word_order_task(passages(many), seed=0).texts != word_order_task(passages(many), seed=1).texts
    with pytest.raises(ValueError, match="seed must be an integer, got 0.5"):
        word_order_task(passages(TEXTS), seed=0.5)


def test_the_shakespeare_word_order_task_is_balanced_and_split_by_scene():
    train, test = (word_order_task(p) for p in play_passages())
    assert len(train) == 4733 and len(test) == 1795
    assert not set(train.sections) & set(test.sections)
    assert train.counts() == [2367, 2366] and test.counts() == [898, 897]  # no 64-character passage is one word
    assert majority_accuracy(train, test) == pytest.approx(898 / 1795)
    originals = set(play_passages()[0].texts)
    assert sum(t in originals for t, y in zip(train.texts, train.labels, strict=True) if y == 1) == 0
