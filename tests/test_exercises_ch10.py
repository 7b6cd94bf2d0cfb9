"""Each chapter-10 checker accepts the reference solution (the notebook's hidden one), rejects plausible wrong
answers with the right hint, treats the unattempted stub kindly and reports a function that modifies its input."""

import pytest
import torch

from groundup.exercises import checking as _checking
from groundup.exercises.ch10 import check_decoder_inputs, check_decoder_mask

# --- reference solutions (the same code as the notebook's hidden solution cells) ---------------------------


def decoder_inputs(targets, pad_id, start_id, end_id):
    width = max(len(y) for y in targets) + 1
    tgt_in = torch.full((len(targets), width), pad_id, dtype=torch.long)
    tgt_out = torch.full((len(targets), width), pad_id, dtype=torch.long)
    for i, y in enumerate(targets):
        tgt_in[i, :len(y) + 1] = torch.tensor([start_id] + list(y))
        tgt_out[i, :len(y) + 1] = torch.tensor(list(y) + [end_id])
    return tgt_in, tgt_out


def decoder_mask(tgt_in, pad_id):
    n = tgt_in.shape[1]
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    return causal & (tgt_in != pad_id)[:, None, None, :]


def stub(*args):
    raise NotImplementedError


# --- wrong answers --------------------------------------------------------------------------------------------


def inputs_without_start(targets, pad_id, start_id, end_id):
    tgt_in, tgt_out = decoder_inputs(targets, pad_id, start_id, end_id)
    return tgt_out.masked_fill(tgt_out == end_id, pad_id), tgt_out


def inputs_with_end(targets, pad_id, start_id, end_id):
    return decoder_inputs([list(y) + [end_id] for y in targets], pad_id, start_id, end_id)[0][:, :-1], \
        decoder_inputs(targets, pad_id, start_id, end_id)[1]


def inputs_swapped(targets, pad_id, start_id, end_id):
    return decoder_inputs(targets, pad_id, start_id, end_id)[::-1]


def inputs_no_end(targets, pad_id, start_id, end_id):
    tgt_in, tgt_out = decoder_inputs(targets, pad_id, start_id, end_id)
    return tgt_in, tgt_out.masked_fill(tgt_out == end_id, pad_id)


def inputs_pad_zero(targets, pad_id, start_id, end_id):
    return decoder_inputs(targets, 0, start_id, end_id)


def inputs_too_short(targets, pad_id, start_id, end_id):
    tgt_in, tgt_out = decoder_inputs(targets, pad_id, start_id, end_id)
    return tgt_in[:, :-1], tgt_out[:, :-1]


def inputs_in_place(targets, pad_id, start_id, end_id):
    out = decoder_inputs(targets, pad_id, start_id, end_id)
    targets.append([start_id])
    return out


def mask_causal_only(tgt_in, pad_id):
    n = tgt_in.shape[1]
    return torch.ones(n, n, dtype=torch.bool).tril().expand(tgt_in.shape[0], 1, n, n)


def mask_padding_only(tgt_in, pad_id):
    n = tgt_in.shape[1]
    return (tgt_in != pad_id)[:, None, None, :].expand(tgt_in.shape[0], 1, n, n)


def mask_transposed(tgt_in, pad_id):
    return decoder_mask(tgt_in, pad_id).transpose(-1, -2)


def mask_inverted(tgt_in, pad_id):
    return ~decoder_mask(tgt_in, pad_id)


def mask_float(tgt_in, pad_id):
    return decoder_mask(tgt_in, pad_id).float()


def mask_in_place(tgt_in, pad_id):
    out = decoder_mask(tgt_in, pad_id)
    tgt_in[:, 0] = pad_id
    return out


# --- tests ------------------------------------------------------------------------------------------------------

CHECKERS = [(check_decoder_inputs, decoder_inputs), (check_decoder_mask, decoder_mask)]


@pytest.mark.parametrize("checker, solution", CHECKERS)
def test_the_reference_solution_passes(checker, solution, capsys):
    assert checker(solution)
    assert "✅" in capsys.readouterr().out


@pytest.mark.parametrize("checker", [c for c, _ in CHECKERS])
def test_the_stub_gets_a_friendly_reminder(checker, capsys):
    assert not checker(stub)
    out = capsys.readouterr().out
    assert "not attempted yet" in out and "Traceback" not in out


def test_the_packages_collate_is_refused(capsys):
    from groundup.seq2seq import collate

    def calls_collate(targets, pad_id, start_id, end_id):
        return collate([[1]] * len(targets), targets, pad_id=pad_id, start_id=start_id, end_id=end_id)[1:]

    assert not check_decoder_inputs(calls_collate)
    out = capsys.readouterr().out
    assert "calls groundup.seq2seq.collate" in out and "compute it yourself" in out, out


def test_the_package_mask_passes_too():
    from groundup.attention import causal_mask

    assert check_decoder_mask(lambda t, p: causal_mask(t.shape[1]) & (t != p)[:, None, None, :])


@pytest.mark.parametrize("checker, wrong, hint", [
    (check_decoder_inputs, inputs_without_start, "must begin with the start token"),
    (check_decoder_inputs, inputs_with_end, "The end token belongs in the targets only"),
    (check_decoder_inputs, inputs_swapped, "swapped"),
    (check_decoder_inputs, inputs_no_end, "must end with the end token"),
    (check_decoder_inputs, inputs_pad_zero, "Pad with pad_id=3"),
    (check_decoder_inputs, inputs_too_short, "one position too short"),
    (check_decoder_mask, mask_causal_only, "also require tgt_in[j] != pad_id"),
    (check_decoder_mask, mask_padding_only, "add the lower triangle"),
    (check_decoder_mask, mask_transposed, "Rows are queries"),
    (check_decoder_mask, mask_inverted, "True means *may attend*"),
    (check_decoder_mask, mask_float, "Return a bool tensor"),
])
def test_wrong_answers_are_rejected_with_the_right_hint(checker, wrong, hint, capsys):
    assert not checker(wrong)
    out = capsys.readouterr().out
    assert "❌" in out and hint in out, out


@pytest.mark.parametrize("checker, wrong, name", [(check_decoder_inputs, inputs_in_place, "targets"),
                                                  (check_decoder_mask, mask_in_place, "tgt_in")])
def test_a_function_that_modifies_its_input_is_reported(checker, wrong, name, capsys):
    assert not checker(wrong)
    out = capsys.readouterr().out
    assert f"changed its input {name} in place" in out


@pytest.fixture(autouse=True)
def _unwrapped_verdicts(monkeypatch):
    """Match hints as whole lines; tests/test_checking.py tests the wrapping to the book's width."""
    monkeypatch.setattr(_checking, "MESSAGE_WIDTH", 10_000)
