"""The checker toolkit every chapter's exercises use."""

import re
import signal

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


# ---- regression tests for the hardening of the checkers -------------------------------------------------------

import functools  # noqa: E402
import operator  # noqa: E402
import random  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402

import numpy as np  # noqa: E402

from groundup.exercises.checking import ReaderError, call_reader, expect_number, expect_type  # noqa: E402


def test_call_reader_hands_over_copies_and_reports_in_place_changes():
    q = torch.ones(3)

    def scales_in_place(q):
        q /= 2
        return q

    with pytest.raises(Mismatch, match=r"scale\(q\) changed its input q in place") as err:
        call_reader(scales_in_place, q, call="scale(q)", names=("q",))
    assert "x /= n" in err.value.hint
    assert torch.equal(q, torch.ones(3)), "the checker's own tensor must stay untouched"
    assert torch.equal(call_reader(lambda q: q / 2, q, call="scale(q)"), torch.full((3,), 0.5))


def test_call_reader_detects_changes_to_lists_modules_and_keyword_arguments():
    with pytest.raises(Mismatch, match="changed its input ids in place"):
        call_reader(lambda ids: ids.append(1), [0], call="f(ids)", names=["ids"])
    layer = torch.nn.Linear(2, 2)

    def zero_params(block):
        with torch.no_grad():
            block.weight.zero_()
        return 0

    with pytest.raises(Mismatch, match="changed its input block in place"):
        call_reader(zero_params, block=layer, call="f(block)")
    assert layer.weight.abs().sum() > 0
    nan = torch.tensor([float("nan"), 1.0])
    assert call_reader(lambda x: 3, nan, call="f(x)") == 3, "NaN inputs left alone are not a change"


def test_call_reader_names_the_expected_type():
    with pytest.raises(Mismatch, match=r"f\(\) returned the NoneType None, expected a pair") as err:
        call_reader(lambda: None, call="f()", returns=tuple, expected="a pair")
    assert "return" in err.value.hint
    with pytest.raises(Mismatch, match=r"returned the list \[1\], expected Tensor"):
        call_reader(lambda: [1], call="f()", returns=torch.Tensor)


def test_wrong_return_types_get_a_verdict_naming_the_expected_type(capsys):
    for value, shown in ((None, "NoneType None"), ([4.0], "list [4.0]"), ("4.0", "str '4.0'"), (True, "bool True")):
        with pytest.raises(Mismatch, match=f"returned the {re.escape(shown)}, expected a number"):
            expect_number(value, "f()")
    assert expect_number(torch.tensor(4.0), "f()") == 4.0 and expect_number(np.float32(2), "f()") == 2.0
    assert expect_number(3, "f()") == 3.0
    with pytest.raises(Mismatch, match="expected a torch.Tensor"):
        expect_tensor(None, "f()")
    with pytest.raises(Mismatch, match="expected int"):
        expect_type(1.5, int, "f()")


def test_reader_errors_are_the_readers_and_checker_crashes_are_the_books(capsys):
    def checks():
        call_reader(lambda: 1 / 0, call="f()")

    assert not run_checks("Exercise 0.6", checks)
    assert capsys.readouterr().out == "❌ Exercise 0.6: your function raised ZeroDivisionError: division by zero\n"
    verdict = run_checks("Exercise 0.7", functools.partial(operator.getitem, [], 1))  # no reader code involved
    out = capsys.readouterr().out
    assert not verdict and verdict.checker_error
    assert out.startswith("⚠️ Exercise 0.7: the checker itself crashed (IndexError")
    assert "bug in the book" in out and "Please report it at https://github.com/" in out
    with pytest.raises(ReaderError):
        call_reader(lambda: [][0])


def test_float32_against_float64_uses_a_float32_tolerance():
    x = torch.randn(4, 8, dtype=torch.float64)
    expect_close(torch.softmax(x.float(), -1), torch.softmax(x, -1), "softmax", rtol=1e-9, atol=1e-12)
    with pytest.raises(Mismatch):
        expect_close(torch.softmax(x.float(), -1) + 1e-3, torch.softmax(x, -1), "softmax")


def test_sys_exit_in_the_readers_function_does_not_escape(capsys):
    def checks():
        call_reader(lambda: sys.exit(3), call="f()")

    assert not run_checks("Exercise 0.8", checks)
    assert "your function called sys.exit(3)" in capsys.readouterr().out

    def direct():
        sys.exit()

    assert not run_checks("Exercise 0.8", direct)
    assert "called sys.exit()" in capsys.readouterr().out


def test_an_infinite_loop_gets_a_verdict_after_the_time_bound(capsys):
    def loop_forever():
        while True:
            try:
                pass
            except Exception:  # noqa: BLE001 -- the reader's catch-all must not hold the timeout
                pass

    before = signal.getsignal(signal.SIGALRM)
    verdict = run_checks("Exercise 0.9", lambda: call_reader(loop_forever), timeout=0.3)
    assert not verdict and "did not finish within 0.3 s" in capsys.readouterr().out
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0), "the timer is disarmed afterwards"
    assert signal.getsignal(signal.SIGALRM) == before, "the previous SIGALRM handler is back"


def test_an_infinite_loop_off_the_main_thread_is_bounded_too(capsys):
    results = []

    def loop_forever():
        while True:
            pass

    thread = threading.Thread(target=lambda: results.append(run_checks("Exercise 0.10",
                                                                       lambda: loop_forever(), timeout=0.3)))
    thread.start()
    thread.join(10)
    assert not thread.is_alive() and results and not results[0]
    assert "did not finish within 0.3 s" in capsys.readouterr().out


def test_grad_mode_follows_the_caller_off_the_main_thread():
    seen = []
    thread = threading.Thread(target=lambda: (torch.set_grad_enabled(False),
                                              run_checks("x", lambda: seen.append(torch.is_grad_enabled()))))
    thread.start()
    thread.join(10)
    assert seen == [False]


def test_a_slow_checker_is_not_blamed_on_the_reader(capsys):
    import time

    # A checker busy in library code (here a sleep, with no reader code on the stack) runs past the bound.
    verdict = run_checks("Exercise 0.11", functools.partial(time.sleep, 0.6), timeout=0.2)
    assert verdict, capsys.readouterr().out


def test_global_state_the_readers_function_changes_is_restored():
    dtype, grad, threads = torch.get_default_dtype(), torch.is_grad_enabled(), torch.get_num_threads()
    random.seed(5)
    np.random.seed(5)
    py_expected, np_expected = random.random(), np.random.rand()
    random.seed(5)
    np.random.seed(5)

    def meddle():
        torch.set_default_dtype(torch.float64)
        torch.set_grad_enabled(False)
        torch.set_num_threads(1)
        random.seed(1)
        np.random.seed(1)
        random.random()
        np.random.rand(10)

    run_checks("Exercise 0.12", meddle)
    assert torch.get_default_dtype() == dtype and torch.is_grad_enabled() == grad
    assert torch.get_num_threads() == threads
    assert random.random() == py_expected and np.random.rand() == np_expected


def test_ctrl_c_still_interrupts_a_check():
    def interrupted():
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_checks("Exercise 0.13", interrupted)
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
