"""The checker toolkit every chapter's exercises use."""

import pytest
import torch

from groundup.exercises.checking import Mismatch, Verdict, expect, expect_close, expect_tensor, run_checks


def test_a_passing_check_prints_a_tick_and_returns_a_true_verdict(capsys):
    verdict = run_checks("Exercise 0.1 (demo)", lambda: None, "Well done.")
    assert verdict.passed is True and bool(verdict) and repr(verdict) == "Verdict(passed=True)"
    assert capsys.readouterr().out == "✅ Exercise 0.1 (demo): correct. Well done.\n"


def test_a_verdict_displays_nothing_more_in_a_notebook():
    assert Verdict(True)._ipython_display_() is None


def test_a_mismatch_prints_what_went_wrong_and_the_hint(capsys):
    def checks():
        expect(1 + 1 == 3, "1 + 1 gave 2", "Count again.")

    verdict = run_checks("Exercise 0.2", checks)
    assert verdict.passed is False and not verdict
    assert capsys.readouterr().out == "❌ Exercise 0.2: 1 + 1 gave 2\n   Hint: Count again.\n"


def test_the_stub_is_reported_as_not_attempted(capsys):
    def checks():
        raise NotImplementedError

    assert run_checks("Exercise 0.3", checks).passed is False
    assert "⏳ Exercise 0.3: not attempted yet" in capsys.readouterr().out


def test_a_crash_in_the_readers_code_becomes_a_verdict(capsys):
    assert run_checks("Exercise 0.4", lambda: [][1]).passed is False
    assert capsys.readouterr().out == "❌ Exercise 0.4: your function raised IndexError: list index out of range\n"


def test_expect_close_reports_shape_values_and_types():
    expect_close(torch.tensor([1.0, 2.0]), [1.0, 2.0 + 1e-7], "pair")
    with pytest.raises(Mismatch, match=r"pair: expected shape \(2,\), got \(3,\)"):
        expect_close(torch.zeros(3), [0.0, 0.0], "pair")
    with pytest.raises(Mismatch, match="value: expected 2, got 2.5"):
        expect_close(2.5, 2.0, "value")
    with pytest.raises(Mismatch, match="largest difference from the expected values is 0.5"):
        expect_close(torch.tensor([1.0, 2.5]), torch.tensor([1.0, 2.0]), "pair")
    with pytest.raises(Mismatch, match="expected a number or tensor, got str"):
        expect_close("two", 2.0, "value")


def test_expect_tensor_names_the_call_and_returns_the_tensor():
    t = torch.ones(2)
    assert expect_tensor(t, "f(x)") is t
    with pytest.raises(Mismatch, match=r"f\(x\) returned a list") as err:
        expect_tensor([1.0], "f(x)", "Use torch.tensor.")
    assert err.value.hint == "Use torch.tensor."


def test_checkers_leave_the_readers_random_state_alone():
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)

    def seeding_checks():
        torch.manual_seed(123)
        torch.rand(100)

    run_checks("Exercise 0.5", seeding_checks)
    assert torch.equal(torch.rand(3), expected)
