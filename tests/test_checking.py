"""The checker toolkit every chapter's exercises use."""

import re
import signal

import pytest
import torch

from groundup.exercises import checking
from groundup.exercises.checking import Mismatch, Verdict, expect, expect_close, expect_tensor, run_checks


@pytest.fixture(autouse=True)
def _unwrapped(monkeypatch):
    """Compare whole verdict lines here; the wrapping to the book's width has a test of its own."""
    monkeypatch.setattr(checking, "MESSAGE_WIDTH", 10_000)


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


def test_the_report_address_is_pyprojects(capsys, monkeypatch):
    import tomllib
    from pathlib import Path

    from groundup.exercises import checking

    urls = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]["urls"]
    assert checking._report_url() == urls["Repository"].rstrip("/") + "/issues"
    import importlib.metadata

    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    with monkeypatch.context() as m:  # a clone used without installing: read from its pyproject.toml
        m.setattr(importlib.metadata, "metadata", not_installed)
        assert checking._report_url() == urls["Repository"].rstrip("/") + "/issues"
    monkeypatch.setattr(checking, "_report_url", lambda: None)  # installed without metadata: no address at all
    run_checks("Exercise 0.8", functools.partial(operator.getitem, [], 1))
    out = capsys.readouterr().out
    assert "on the book's repository (its issues page)" in out and "http" not in out


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
    thread.join(120)
    assert not thread.is_alive() and results and not results[0]
    assert "did not finish within 0.3 s" in capsys.readouterr().out


def test_grad_mode_follows_the_caller_off_the_main_thread():
    seen = []
    thread = threading.Thread(target=lambda: (torch.set_grad_enabled(False),
                                              run_checks("x", lambda: seen.append(torch.is_grad_enabled()))))
    thread.start()
    thread.join(120)
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


# ---- regression tests for the judge's defences (issue 21, "Hostile and careless use", item 4) ----------------

import gc  # noqa: E402
import time  # noqa: E402

from groundup.exercises import sandbox  # noqa: E402
from groundup.exercises.checking import Forbidden, expect_integer  # noqa: E402


def _square_checks(fn):
    """A judge that expects x ** 2 for x = [1, 2, 3]."""

    def checks():
        x = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
        expected = x ** 2
        got = call_reader(fn, x, call="square(x)", names=("x",))
        expect_tensor(got, "square(x)")
        expect_close(got, expected, "square(x)", "Multiply x by itself.")

    return checks


def test_a_tensor_subclass_that_claims_equality_is_refused(capsys):
    class AlwaysEqual(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            if func in (torch.allclose, torch.equal, torch.Tensor.__eq__):
                return True
            return super().__torch_function__(func, types, args, kwargs or {})

    def cheat(x):
        return torch.zeros(3).as_subclass(AlwaysEqual)

    assert not run_checks("Exercise 0.20", _square_checks(cheat))
    out = capsys.readouterr().out
    assert "returned a AlwaysEqual (a subclass of torch.Tensor)" in out and "plain torch.Tensor" in out, out
    assert run_checks("Exercise 0.20", _square_checks(lambda x: x * x)), capsys.readouterr().out


def test_patching_torch_inside_the_readers_function_is_undone(capsys):
    original_allclose, original_eq = torch.allclose, torch.Tensor.__eq__

    def cheat(x):
        torch.allclose = lambda *args, **kwargs: True
        torch.Tensor.__eq__ = lambda self, other: torch.ones_like(self, dtype=torch.bool)
        checking.isinstance = lambda *args: True  # shadows the builtin in the checker's module
        return torch.zeros(3)

    assert not run_checks("Exercise 0.21", _square_checks(cheat))
    assert "largest difference from the expected values is 9" in capsys.readouterr().out
    assert torch.allclose is original_allclose and torch.Tensor.__eq__ is original_eq
    assert "isinstance" not in vars(checking)


def test_a_patch_made_later_by_the_readers_thread_voids_the_verdict(capsys):
    original = torch.allclose
    patched = threading.Event()

    def cheat(x):
        def later():
            time.sleep(0.05)
            torch.allclose = lambda *args, **kwargs: True
            patched.set()

        threading.Thread(target=later).start()
        return torch.zeros(3)

    def checks():
        got = call_reader(cheat, torch.ones(3), call="square(x)")
        assert patched.wait(5)
        expect_close(got, torch.ones(3), "square(x)")  # fooled by the patch ...

    assert not run_checks("Exercise 0.22", checks)  # ... but the verdict is void
    out = capsys.readouterr().out
    assert "your code replaced torch.allclose while the checker ran" in out, out
    assert torch.allclose is original


def test_the_expected_values_are_out_of_the_readers_reach(capsys):
    def frames_everywhere():
        frame = sys._getframe()
        while frame is not None:
            yield frame
            frame = frame.f_back
        for top in sys._current_frames().values():
            while top is not None:
                yield top
                top = top.f_back

    def cheat(x):
        for frame in frames_everywhere():
            if "expected" in frame.f_locals:
                return frame.f_locals["expected"]
        for obj in gc.get_objects():
            if isinstance(obj, torch.Tensor) and obj.shape == (3,) and obj.dtype == torch.float64 and obj[2] == 9:
                return obj
        return torch.zeros(3)

    assert not run_checks("Exercise 0.23", _square_checks(cheat))
    assert "largest difference from the expected values is 9" in capsys.readouterr().out
    assert sys._current_frames is sandbox._REAL["_current_frames"] and gc.get_objects is sandbox._REAL["get_objects"]


@pytest.mark.parametrize("answer, shown", [
    (lambda x: (x * x).to(torch.complex128) + 1j, "a complex tensor"),
    (lambda x: (x * x).to_sparse(), "a tensor with layout torch.sparse_coo"),
    (lambda x: torch.empty(3, device="meta"), "a tensor on the meta device"),
])
def test_complex_sparse_and_meta_answers_get_a_verdict_naming_them(answer, shown, capsys):
    verdict = run_checks("Exercise 0.24", _square_checks(answer))
    out = capsys.readouterr().out
    assert not verdict and not verdict.checker_error and f"returned {shown}" in out, out
    assert "not attempted" not in out and "bug in the book" not in out


def test_complex_numbers_are_not_cut_to_their_real_part():
    with pytest.raises(Mismatch, match="got a complex tensor"):
        expect_close(torch.tensor([1.0 + 2j]), torch.tensor([1.0]), "f(x)")
    with pytest.raises(Mismatch, match="expected a number"):
        expect_number(1 + 2j, "f()")


def test_a_torch_error_inside_the_readers_code_is_not_the_stub(capsys):
    def sparse_unsupported(x):
        return (x * x).to_sparse().cumsum(0)  # NotImplementedError raised by torch, not by the stub

    verdict = run_checks("Exercise 0.25", _square_checks(sparse_unsupported))
    out = capsys.readouterr().out
    assert not verdict and "your function raised NotImplementedError" in out and "not attempted" not in out, out

    def stub(x):
        raise NotImplementedError

    assert not run_checks("Exercise 0.25", _square_checks(stub))
    assert "not attempted yet" in capsys.readouterr().out


_RELEASE = threading.Event()  # ends the loops below once a test is over (a worker that was left behind)


def _catches_everything(x):
    while not _RELEASE.is_set():
        try:
            time.sleep(0.01)
        except BaseException:  # noqa: BLE001,S110 -- the attack: the reader's catch-all around a sleep
            pass


def _catches_everything_twice(x):
    while not _RELEASE.is_set():
        try:
            try:
                sum(range(1000))
            except BaseException:  # noqa: BLE001
                continue
        except BaseException:  # noqa: BLE001
            continue


def _stubborn(x):
    """Catches the exception that should stop it, every time, and keeps going."""
    while not _RELEASE.is_set():
        try:
            while not _RELEASE.is_set():
                try:
                    time.sleep(0.001)
                except BaseException:  # noqa: BLE001,S110
                    pass
        except BaseException:  # noqa: BLE001,S110
            pass


@pytest.mark.parametrize("loop", [_catches_everything, _catches_everything_twice, _stubborn])
def test_a_loop_that_catches_base_exception_still_gets_its_verdict_on_time(loop, capsys):
    _RELEASE.clear()
    start = time.perf_counter()
    try:
        verdict = run_checks("Exercise 0.26", _square_checks(loop), timeout=0.3)
        out = capsys.readouterr().out
        assert not verdict and "did not finish within 0.3 s" in out, out
        assert time.perf_counter() - start < 60  # a hang guard: well under 1 s on a healthy machine
        assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
        if "still running in the background" in out:
            assert "Restart the kernel" in out
        assert run_checks("Exercise 0.26", _square_checks(lambda x: x * x)), "the next check runs normally"
    finally:
        _RELEASE.set()


def test_off_the_main_thread_a_catch_all_loop_is_bounded_too(capsys):
    results = []
    _RELEASE.clear()
    thread = threading.Thread(target=lambda: results.append(run_checks(
        "Exercise 0.27", _square_checks(_catches_everything_twice), timeout=0.3)))
    thread.start()
    thread.join(120)
    _RELEASE.set()
    assert not thread.is_alive() and results and not results[0]
    assert "did not finish within 0.3 s" in capsys.readouterr().out


def test_generator_exit_and_other_base_exceptions_become_verdicts(capsys):
    def raises_generator_exit(x):
        raise GeneratorExit

    assert not run_checks("Exercise 0.28", _square_checks(raises_generator_exit))
    assert capsys.readouterr().out == "❌ Exercise 0.28: your function raised GeneratorExit\n"

    def direct():
        raise GeneratorExit

    verdict = run_checks("Exercise 0.28", direct)  # the reader's code (this file) raised it: the reader's error
    assert not verdict and "your function raised GeneratorExit" in capsys.readouterr().out


def _package_square(x):
    """Stands for the package's own solution in the tripwire tests."""
    return x * x


def test_a_call_of_the_forbidden_package_function_is_refused_however_it_is_reached(capsys):
    alias = _package_square

    def checks(fn):
        def run():
            x = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
            expected = _package_square(x)  # the judge itself may use it, before calling the reader
            got = call_reader(fn, x, call="square(x)", forbid=(_package_square,))
            expect_close(got, expected, "square(x)")

        return run

    def hidden_call(x):
        try:
            return alias(x)
        except BaseException:  # noqa: BLE001 -- swallowing the tripwire does not help
            return x * x

    for cheat in (alias, lambda x: alias(x), hidden_call):
        assert not run_checks("Exercise 0.29", checks(cheat))
        out = capsys.readouterr().out
        assert "square(x) calls test_checking._package_square" in out and "compute it yourself" in out, out
    assert run_checks("Exercise 0.29", checks(lambda x: x * x))
    assert _package_square(torch.tensor(3.0)) == 9, "the function works again after the check"


def _decorated(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):  # a closure: its own code cannot be swapped, the function under it can
        return fn(*args, **kwargs)

    return wrapper


@_decorated
def _package_cube(x):
    """Stands for a decorated package function in the shortcut tests."""
    return x * x * x


def test_call_refusing_names_the_shortcut_with_its_own_hint_and_unwraps_decorators(capsys):
    module = sys.modules[__name__]
    assert checking.function_code(_package_cube) is _package_cube.__wrapped__
    assert checking.function_code(_package_cube.__wrapped__) is _package_cube.__wrapped__
    assert checking.function_code(len) is None and checking.function_code(_decorated(len)) is None
    own = dict((label, fn) for fn, label in checking.module_functions(module))
    assert own["test_checking._package_square"] is _package_square
    assert own["test_checking._package_cube"] is _package_cube.__wrapped__
    assert not any(label.startswith("groundup.") for label in own), "imported functions are not this module's"
    shortcuts = checking.collect_shortcuts(
        [(_package_cube.__wrapped__, "the cube", "Multiply it out, not through {name}."),
         (_package_square, "the square"), (_package_square, "the square again", "never used")],
        "Do not call {name}.")
    assert len(shortcuts.forbid) == 2
    saved_cube, saved_inner = _package_cube, _package_cube.__wrapped__  # aliases taken before the check
    x = torch.tensor([1.0, 2.0], dtype=torch.float64)

    def checks(fn):
        return lambda: expect_close(checking.call_refusing(fn, x, call="cube(x)", names=("x",), shortcuts=shortcuts,
                                                           crash_hint="Cube each entry."), x ** 3, "cube(x)")

    for cheat, shown, hint in [(saved_cube, "the cube", "Multiply it out, not through the cube."),
                               (lambda t: saved_inner(t), "the cube", "Multiply it out, not through the cube."),
                               (lambda t: _package_square(t) * t, "the square", "Do not call the square.")]:
        assert not run_checks("Exercise 0.31", checks(cheat))
        out = capsys.readouterr().out
        assert f"cube(x) calls {shown}\n   Hint: {hint}" in out, out
    assert not run_checks("Exercise 0.31", checks(lambda t: t.cube()))
    assert "Hint: Cube each entry." in capsys.readouterr().out, "a crash of the reader's function gets crash_hint"
    assert run_checks("Exercise 0.31", checks(lambda t: t * t * t))
    assert saved_cube(torch.tensor(2.0)) == 8 and _package_square(torch.tensor(3.0)) == 9, "they work again"


def test_a_conditional_tripwire_refuses_only_the_calls_it_names(capsys):
    import torch.nn.functional as F

    forbid = (Forbidden(torch._C._nn, "cross_entropy_loss", when=lambda args, kwargs: bool((args[1] < 0).any()),
                        label="F.cross_entropy with ignore_index", hint="Select the positions yourself."),)
    logits, targets = torch.randn(4, 3, dtype=torch.float64), torch.tensor([0, -100, 2, -100])
    selected = targets >= 0

    def checks(fn):
        return lambda: call_reader(fn, logits, targets, forbid=forbid)

    assert not run_checks("Exercise 0.30", checks(lambda lg, t: F.cross_entropy(lg, t)))
    assert "calls F.cross_entropy with ignore_index" in capsys.readouterr().out
    assert run_checks("Exercise 0.30", checks(lambda lg, t: F.cross_entropy(lg[t >= 0], t[t >= 0])))
    assert torch._C._nn.cross_entropy_loss.__name__ == "cross_entropy_loss" and selected.sum() == 2


def test_a_torch_function_mode_left_pushed_by_the_reader_is_popped():
    from torch.overrides import TorchFunctionMode

    class Liar(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return True if func is torch.allclose else func(*args, **(kwargs or {}))

    def cheat(x):
        Liar().__enter__()
        return torch.zeros(3)

    depth = torch._C._len_torch_function_stack()
    assert not run_checks("Exercise 0.31", _square_checks(cheat))
    assert torch._C._len_torch_function_stack() == depth


def test_expect_integer_refuses_floats_and_accepts_integer_kinds():
    assert expect_integer(7, "f()") == 7 and expect_integer(np.int64(7), "f()") == 7
    assert expect_integer(torch.tensor(7), "f()") == 7
    for value in (7.0, torch.tensor(7.0), np.float64(7)):
        with pytest.raises(Mismatch, match="expected an int") as err:
            expect_integer(value, "f()")
        assert "//" in err.value.hint
    with pytest.raises(Mismatch, match="expected an int"):
        expect_integer("7", "f()")


def test_verdicts_are_wrapped_to_the_books_width(monkeypatch, capsys):
    monkeypatch.setattr(checking, "MESSAGE_WIDTH", 80)

    def checks():
        expect(False, "a rather long description of what the reader's function returned " * 2,
               "a hint that is also much longer than one line of the book, so that it has to be wrapped " * 2)

    run_checks("Exercise 0.32", checks)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) >= 5 and all(len(line) <= 80 for line in lines), lines
    assert lines[0].startswith("❌ Exercise 0.32: a rather long") and lines[1].startswith("   ") and lines[1][3] != " "
    hint = next(i for i, line in enumerate(lines) if line.startswith("   Hint: "))
    assert all(line.startswith("         ") for line in lines[hint + 1:])


def test_code_in_backticks_is_not_split_by_the_wrapping(monkeypatch, capsys):
    monkeypatch.setattr(checking, "MESSAGE_WIDTH", 80)

    def checks():
        raise NotImplementedError

    run_checks("Exercise 8.2 (top-k filter)", checks)
    out = capsys.readouterr().out
    assert "`raise NotImplementedError`" in out and all(len(line) <= 80 for line in out.splitlines()), out


def test_ctrl_c_while_the_readers_function_runs_stops_it_and_the_cell(capsys):
    started, stopped = threading.Event(), threading.Event()

    def slow(x):
        started.set()
        try:
            while True:
                time.sleep(0.01)
        finally:
            stopped.set()

    def ctrl_c():  # once the reader's function runs: a fixed delay raced the checker's setup on a loaded machine
        if started.wait(60):
            time.sleep(0.1)
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)

    threading.Thread(target=ctrl_c, daemon=True).start()
    with pytest.raises(KeyboardInterrupt):
        run_checks("Exercise 0.33", _square_checks(slow))
    assert stopped.wait(5), "the reader's function was stopped too"
    assert sys._current_frames is sandbox._REAL["_current_frames"]


def test_a_patch_made_before_the_check_is_lifted_while_it_runs_and_put_back_after(capsys):
    original = torch.allclose

    def lenient(*args, **kwargs):
        return True

    torch.allclose = lenient  # a notebook cell run before the check
    try:
        assert not run_checks("Exercise 0.34", _square_checks(lambda x: torch.zeros(3)))
        assert "largest difference from the expected values is 9" in capsys.readouterr().out
        assert torch.allclose is lenient, "the reader's own patch is theirs again after the check"
    finally:
        torch.allclose = original


def test_checked_notebook_runs_give_checkers_a_slow_machines_time(monkeypatch):
    """nbval and run_notebook run the chapters with GROUNDUP_CHECK_TIMEOUT=60 (readers keep 10 s), so a correct
    solution's stored verdict cannot turn into a timeout on a busy machine; a caller's own setting is kept."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "nbval_lanes", Path(__file__).resolve().parent.parent / "tools" / "nbval_lanes.py")
    lanes = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lanes)
    monkeypatch.delenv("GROUNDUP_CHECK_TIMEOUT", raising=False)
    assert lanes.notebook_env()["GROUNDUP_CHECK_TIMEOUT"] == "60"
    monkeypatch.setenv("GROUNDUP_CHECK_TIMEOUT", "5")
    assert lanes.notebook_env()["GROUNDUP_CHECK_TIMEOUT"] == "5"
