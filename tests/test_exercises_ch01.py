import math

import pytest
import torch

from groundup.exercises import ch01
from groundup.exercises import checking as _checking


def perplexity_solution(probs):
    return math.exp(-sum(math.log(p) for p in probs) / len(probs))


def counts_solution(ids, vocab_size):
    counts = torch.zeros(vocab_size, vocab_size, dtype=torch.long)
    for a, b in zip(ids[:-1], ids[1:]):
        counts[a, b] += 1
    return counts


def cross_entropy_solution(logits, targets):
    shifted = logits - logits.max(dim=1, keepdim=True).values
    log_probs = shifted - shifted.exp().sum(dim=1, keepdim=True).log()
    return -log_probs[torch.arange(len(targets)), targets].mean()


def stub(*args):
    raise NotImplementedError


def test_checkers_accept_the_reference_solutions(capsys):
    assert ch01.check_perplexity(perplexity_solution)
    assert ch01.check_bigram_counts(counts_solution)
    assert ch01.check_cross_entropy(cross_entropy_solution)
    assert capsys.readouterr().out.count("✅") == 3


def test_checkers_treat_the_stub_as_not_attempted(capsys):
    for check in (ch01.check_perplexity, ch01.check_bigram_counts, ch01.check_cross_entropy):
        assert check(stub).passed is False
    assert capsys.readouterr().out.count("not attempted yet") == 3


def test_perplexity_without_the_mean_is_rejected(capsys):
    assert not ch01.check_perplexity(lambda probs: math.exp(-sum(math.log(p) for p in probs)))
    out = capsys.readouterr().out
    assert "❌" in out and "expected 4, got 256" in out and "*mean* negative log-probability" in out


def test_transposed_counts_are_rejected(capsys):
    assert not ch01.check_bigram_counts(lambda ids, v: counts_solution(ids, v).T)
    assert "transposed" in capsys.readouterr().out


def test_wrap_around_counts_are_rejected(capsys):
    def wrapping(ids, v):
        counts = counts_solution(ids, v)
        counts[ids[-1], ids[0]] += 1
        return counts

    assert not ch01.check_bigram_counts(wrapping)
    assert "no wrap-around" in capsys.readouterr().out


def test_unstable_cross_entropy_is_rejected(capsys):
    def naive(logits, targets):
        probs = logits.exp() / logits.exp().sum(dim=1, keepdim=True)
        return -probs[torch.arange(len(targets)), targets].log().mean()

    assert not ch01.check_cross_entropy(naive)
    assert "subtract each row's maximum" in capsys.readouterr().out


def test_summed_cross_entropy_is_rejected(capsys):
    assert not ch01.check_cross_entropy(lambda lg, t: cross_entropy_solution(lg, t) * len(t))
    assert "averaged over the rows" in capsys.readouterr().out


def test_perplexity_of_the_wrong_type_names_the_expected_type(capsys):
    for wrong, shown in ((lambda probs: None, "NoneType None"), (lambda probs: [4.0], "list [4.0]"),
                         (lambda probs: "4.0", "str '4.0'")):
        assert not ch01.check_perplexity(wrong)
        out = capsys.readouterr().out
        assert f"returned the {shown}, expected a number" in out, out


def test_cross_entropy_that_shifts_the_logits_in_place_is_reported(capsys):
    def shifts_in_place(logits, targets):
        logits -= logits.max(dim=1, keepdim=True).values
        return cross_entropy_solution(logits, targets)

    assert not ch01.check_cross_entropy(shifts_in_place)
    assert "changed its input logits in place" in capsys.readouterr().out


@pytest.fixture(autouse=True)
def _unwrapped_verdicts(monkeypatch):
    """Match hints as whole lines; tests/test_checking.py tests the wrapping to the book's width."""
    monkeypatch.setattr(_checking, "MESSAGE_WIDTH", 10_000)
