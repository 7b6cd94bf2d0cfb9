"""Each chapter-9 checker accepts the reference solution (the notebook's hidden one), rejects plausible wrong
answers, treats the unattempted stub kindly and reports a function that modifies its input."""

import pytest
import torch
import torch.nn.functional as F

from groundup.exercises import checking as _checking
from groundup.exercises.ch09 import check_apply_masking, check_masked_accuracy, check_masked_loss

# --- reference solutions (the same code as the notebook's hidden solution cells) ---------------------------


def masked_loss(logits, targets):
    selected = targets != -100
    log_probs = logits[selected].log_softmax(dim=-1)
    return -log_probs.gather(-1, targets[selected][:, None]).mean().item()


def apply_masking(ids, plan, mask_id, random_ids):
    inputs = torch.where(plan == 1, mask_id, torch.where(plan == 2, random_ids, ids))
    targets = torch.where(plan == 0, -100, ids)
    return inputs, targets


def masked_accuracy(logits, targets):
    selected = targets != -100
    return (logits.argmax(dim=-1)[selected] == targets[selected]).float().mean().item()


def stub(*args):
    raise NotImplementedError


# --- wrong answers --------------------------------------------------------------------------------------------


def loss_over_every_position(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.clamp(min=0).flatten()).item()


def loss_divided_by_all_positions(logits, targets):
    selected = targets != -100
    picked = -logits.log_softmax(-1).gather(-1, targets.clamp(min=0)[..., None])[..., 0]
    return ((picked * selected).sum() / targets.numel()).item()


def loss_sum(logits, targets):
    keep = targets != -100
    return F.cross_entropy(logits[keep], targets[keep], reduction="sum").item()


def loss_in_place(logits, targets):
    targets[targets == -100] = 0
    return masked_loss(logits, targets)


def masking_targets_are_inputs(ids, plan, mask_id, random_ids):
    inputs, _ = apply_masking(ids, plan, mask_id, random_ids)
    return inputs, torch.where(plan == 0, -100, inputs)


def masking_targets_everywhere(ids, plan, mask_id, random_ids):
    return apply_masking(ids, plan, mask_id, random_ids)[0], ids.clone()


def masking_random_ignored(ids, plan, mask_id, random_ids):
    return torch.where(plan == 1, mask_id, ids), torch.where(plan == 0, -100, ids)


def masking_single_tensor(ids, plan, mask_id, random_ids):
    return apply_masking(ids, plan, mask_id, random_ids)[0]


def accuracy_every_position(logits, targets):
    return (logits.argmax(-1) == targets).double().mean().item()


def accuracy_percent(logits, targets):
    return 100 * masked_accuracy(logits, targets)


# --- the tests ------------------------------------------------------------------------------------------------


def test_reference_solutions_pass():
    assert check_masked_loss(masked_loss)
    assert check_apply_masking(apply_masking)
    assert check_masked_accuracy(masked_accuracy)


def test_cross_entropy_on_the_selected_positions_passes_and_ignore_index_is_refused(capsys):
    def selected_only(logits, targets):
        keep = targets != -100
        return F.cross_entropy(logits[keep], targets[keep])

    assert check_masked_loss(selected_only), capsys.readouterr().out
    capsys.readouterr()
    for leaves_it_to_ignore_index in (
            lambda lg, t: F.cross_entropy(lg.flatten(0, 1), t.flatten(), ignore_index=-100),
            lambda lg, t: F.cross_entropy(lg.flatten(0, 1), t.flatten()),  # -100 is the default
            lambda lg, t: torch.nn.CrossEntropyLoss()(lg.transpose(1, 2), t),
            lambda lg, t: F.nll_loss(lg.log_softmax(-1).flatten(0, 1), t.flatten())):
        assert not check_masked_loss(leaves_it_to_ignore_index)
        out = capsys.readouterr().out
        assert "skips the -100 targets by ignore_index" in out and "without ignore_index" in out, out


def _aten_nll(logits, targets):
    out, _ = torch.ops.aten.nll_loss_forward(logits.flatten(0, 1).log_softmax(-1), targets.flatten(), None, 1, -100)
    return out


def _aten_overload_nll(logits, targets):
    return torch.ops.aten.nll_loss_forward.default(logits.flatten(0, 1).log_softmax(-1), targets.flatten(), None, 1,
                                                   -100)[0]


def _aten_nll_2d(logits, targets):
    log_probs = logits.log_softmax(-1).transpose(1, 2)[..., None]  # (batch, vocab, seq, 1)
    return torch.ops.aten.nll_loss2d_forward(log_probs, targets[..., None], None, 1, -100)[0]


def _aten_cross_entropy(logits, targets):
    return torch.ops.aten.cross_entropy_loss(logits.flatten(0, 1), targets.flatten())


_PREMADE = torch.ops.aten.nll_loss_forward.default  # taken before the checker runs


@pytest.mark.parametrize("through_aten", [_aten_nll, _aten_overload_nll, _aten_nll_2d, _aten_cross_entropy,
                                          lambda lg, t: _PREMADE(lg.flatten(0, 1).log_softmax(-1), t.flatten(),
                                                                 None, 1, -100)[0]])
def test_torchs_operators_with_ignore_index_are_refused_too(through_aten, capsys):
    assert not check_masked_loss(through_aten)
    out = capsys.readouterr().out
    assert "skips the -100 targets by ignore_index" in out and "without ignore_index" in out, out
    logits, targets = torch.randn(2, 3, 4, dtype=torch.float64), torch.tensor([[1, -100, 2], [-100, 0, 3]])
    keep = targets != -100
    assert torch.allclose(torch.as_tensor(through_aten(logits, targets)),
                          F.cross_entropy(logits[keep], targets[keep])), "the operators work again afterwards"


def test_an_operator_on_the_selected_positions_alone_passes(capsys):
    def selected_then_aten(logits, targets):
        keep = targets != -100
        return torch.ops.aten.nll_loss_forward(logits[keep].log_softmax(-1), targets[keep], None, 1, -100)[0]

    assert check_masked_loss(selected_then_aten), capsys.readouterr().out


def test_the_packages_masking_is_refused(capsys):
    from groundup.masking import apply_masking as package

    def calls_the_package(ids, plan, mask_id, random_ids):
        return package(ids, plan, mask_token_id=mask_id, vocab_size=11), None

    assert not check_apply_masking(calls_the_package)
    assert "calls groundup.masking.apply_masking" in capsys.readouterr().out


def test_the_stub_is_not_attempted_yet(capsys):
    for check in (check_masked_loss, check_apply_masking, check_masked_accuracy):
        assert not check(stub)
        assert "not attempted yet" in capsys.readouterr().out


def test_wrong_losses_fail_with_the_right_hint(capsys):
    for wrong, hint in [(loss_over_every_position, "averaged over every position"),
                        (loss_divided_by_all_positions, "divided by the number of all positions"),
                        (loss_sum, "take the mean"), (loss_in_place, "in place")]:
        assert not check_masked_loss(wrong)
        assert hint in capsys.readouterr().out, wrong.__name__


def test_wrong_maskings_fail_with_the_right_hint(capsys):
    for wrong, hint in [(masking_targets_are_inputs, "original ids, not the corrupted inputs"),
                        (masking_targets_everywhere, "must have target -100"),
                        (masking_random_ignored, "random (plan 2"),
                        (masking_single_tensor, "a pair (inputs, targets)")]:
        assert not check_apply_masking(wrong)
        assert hint in capsys.readouterr().out, wrong.__name__


def test_wrong_accuracies_fail_with_the_right_hint(capsys):
    for wrong, hint in [(accuracy_every_position, "counted every position"), (accuracy_percent, "not a percentage")]:
        assert not check_masked_accuracy(wrong)
        assert hint in capsys.readouterr().out, wrong.__name__


@pytest.fixture(autouse=True)
def _unwrapped_verdicts(monkeypatch):
    """Match hints as whole lines; tests/test_checking.py tests the wrapping to the book's width."""
    monkeypatch.setattr(_checking, "MESSAGE_WIDTH", 10_000)
