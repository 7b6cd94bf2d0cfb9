"""Each chapter-3 checker accepts the reference solution (the notebook's hidden one), rejects a plausible wrong
answer with a helpful message, and treats the unattempted stub kindly."""

import pytest
import torch

from groundup.exercises import checking as _checking
from groundup.exercises.ch03 import check_one_hot, check_rms_init, check_softmax, check_tying_savings

# --- reference solutions (the same code as the notebook's hidden solution cells) ---------------------------


def one_hot(ids, vocab_size):
    out = torch.zeros(*ids.shape, vocab_size)
    out.scatter_(-1, ids.unsqueeze(-1), 1.0)
    return out


def rms_init(vocab_size, d_model):
    w = torch.randn(vocab_size, d_model)
    return w / w.pow(2).mean(dim=1, keepdim=True).sqrt()


def softmax(logits):
    z = logits - logits.max(dim=-1, keepdim=True).values
    e = z.exp()
    return e / e.sum(dim=-1, keepdim=True)


def tying_savings(vocab_size, d_model, n_layers):
    saved = vocab_size * d_model
    untied_total = 2 * vocab_size * d_model + 12 * n_layers * d_model**2
    return saved, saved / untied_total


def stub(*args):
    raise NotImplementedError


# --- wrong answers --------------------------------------------------------------------------------------------


def one_hot_int(ids, vocab_size):
    return torch.nn.functional.one_hot(ids, vocab_size)  # integer dtype


def one_hot_transposed(ids, vocab_size):
    return torch.eye(vocab_size)[:, ids]  # [vocab_size, n]: columns instead of rows


def rms_init_unnormalised(vocab_size, d_model):
    return torch.randn(vocab_size, d_model)


def rms_init_columns(vocab_size, d_model):
    w = torch.randn(vocab_size, d_model)
    return w / w.pow(2).mean(dim=0, keepdim=True).sqrt()


def rms_init_unembedding_scale(vocab_size, d_model):
    return rms_init(vocab_size, d_model) / d_model**0.5


def rms_init_constant(vocab_size, d_model):
    return torch.ones(vocab_size, d_model)


def softmax_naive(logits):
    e = logits.exp()
    return e / e.sum(dim=-1, keepdim=True)


def softmax_wrong_dim(logits):
    return torch.softmax(logits, dim=0)


def tying_savings_wrong_denominator(vocab_size, d_model, n_layers):
    saved = vocab_size * d_model
    return saved, saved / (vocab_size * d_model + 12 * n_layers * d_model**2)  # the tied total


CASES = [
    (check_one_hot, one_hot, [(one_hot_int, "dtype"), (one_hot_transposed, "shape")]),
    (check_rms_init, rms_init, [(rms_init_unnormalised, "expected exactly 1"),
                                (rms_init_columns, "normalised the columns"),
                                (rms_init_unembedding_scale, "unembedding's scale"),
                                (rms_init_constant, "not random")]),
    (check_softmax, softmax, [(softmax_naive, "overflows"), (softmax_wrong_dim, "dim=-1")]),
    (check_tying_savings, tying_savings, [(tying_savings_wrong_denominator, "UNTIED total")]),
]


@pytest.mark.parametrize("checker, solution, wrongs", CASES, ids=[c[0].__name__ for c in CASES])
def test_checker_accepts_reference_rejects_wrong_and_handles_stub(checker, solution, wrongs, capsys):
    assert checker(solution).passed is True
    assert "✅" in capsys.readouterr().out
    for wrong, message in wrongs:
        assert checker(wrong).passed is False, wrong.__name__
        out = capsys.readouterr().out
        assert "❌" in out and "Hint:" in out and message in out, (wrong.__name__, out)
    assert checker(stub).passed is False
    assert "not attempted yet" in capsys.readouterr().out


def test_one_hot_reference_agrees_with_torch():
    ids = torch.tensor([[3, 0], [1, 1]])
    assert torch.equal(one_hot(ids, 4), torch.nn.functional.one_hot(ids, 4).float())


def test_softmax_that_overwrites_its_input_with_the_uniform_answer_fails(capsys):
    def fill_uniform(z):
        return z.fill_(1 / z.shape[-1])  # wrong, and it overwrites the checker's logits

    assert not check_softmax(fill_uniform)
    assert "changed its input logits in place" in capsys.readouterr().out


def test_a_correct_in_place_softmax_is_told_about_the_change_not_a_wrong_value(capsys):
    def in_place(z):
        z -= z.max(dim=-1, keepdim=True).values
        z.exp_()
        z /= z.sum(dim=-1, keepdim=True)
        return z

    assert not check_softmax(in_place)
    out = capsys.readouterr().out
    assert "changed its input logits in place" in out and "largest difference" not in out


def test_a_float32_softmax_of_float64_logits_passes(capsys):
    assert check_softmax(lambda z: torch.softmax(z.float(), dim=-1)), capsys.readouterr().out


@pytest.fixture(autouse=True)
def _unwrapped_verdicts(monkeypatch):
    """Match hints as whole lines; tests/test_checking.py tests the wrapping to the book's width."""
    monkeypatch.setattr(_checking, "MESSAGE_WIDTH", 10_000)
