"""Auto-checkers for the book's exercises: one submodule per chapter (``groundup.exercises.ch01``, ...).

Every checker is called as ``check_<name>(fn)`` with the reader's function. It prints one verdict --
what was tested, what went wrong and a hint -- and returns a ``Verdict``, true when the function passed
(it displays nothing more in a notebook).
A function that still raises ``NotImplementedError`` gets a friendly reminder instead of a traceback.
"""

from groundup.exercises.checking import Mismatch, Verdict, expect, expect_close, expect_tensor, run_checks

__all__ = ["Mismatch", "Verdict", "expect", "expect_close", "expect_tensor", "run_checks"]
