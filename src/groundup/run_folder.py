"""A run folder of ``groundup train`` / ``groundup finetune``: its lock, and what a command says and tidies when
a run stops early.

One run writes a folder at a time (:func:`run_lock`); after Ctrl-C the command says how to continue
(:func:`interrupted_message`); a folder the command created for a run that never started is removed again
(:func:`remove_if_unused`); an error is told in one line (:func:`describe_error`).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from groundup.training import CHECKPOINT_NAME


def interrupted_message(stop: KeyboardInterrupt, out: Path, command: str = "train") -> str:
    """What to say after Ctrl-C: where the run stands and how to continue it (with ``groundup <command>``)."""
    said = str(stop) or "interrupted"
    if (out / CHECKPOINT_NAME).is_file():
        return f"{said}; continue with: groundup {command} --out {out} --resume"
    return f"{said} before the first checkpoint: nothing to resume"


def remove_if_unused(out: Path, created: bool) -> None:
    """Remove the run folder this command created if it holds nothing but its lock (a run that never started)."""
    if created and out.is_dir() and {p.name for p in out.iterdir()} <= {LOCK_NAME}:
        (out / LOCK_NAME).unlink(missing_ok=True)
        out.rmdir()


def describe_error(err: Exception) -> str:
    """An error in one line; an OSError names its file (a full disk: which file could not be written)."""
    if isinstance(err, OSError) and err.strerror:
        return f"{err.strerror}: {err.filename}" if err.filename else err.strerror
    return str(err)


LOCK_NAME = ".lock"
"""The lock file inside a run folder; ``groundup train`` holds an exclusive ``flock`` on it while it runs."""
LOCKED_ENV = "GROUNDUP_RUN_LOCKED"
"""Set by ``groundup train --nproc N`` for its processes: the folder whose lock the launching process holds."""


@contextlib.contextmanager


def run_lock(out: Path, distributed: bool = False, rank: int = 0, command: str = "train"):
    """Hold the exclusive lock of run folder ``out`` (creating the folder) for the duration of the block.

    Two runs writing one folder would interleave their checkpoints; the second gets a ``ValueError`` naming the
    folder. The lock is an advisory ``fcntl.flock`` on ``out/.lock``, released when this process ends however it
    ends (even by SIGKILL); a stale lock file without a holder locks nothing. Inside ``groundup train --nproc N``
    the launching process holds it for its processes; under a bare ``torchrun``, process 0 takes it. Where
    ``fcntl`` does not exist (Windows) nothing is locked.
    """
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file: give a folder for the run (it is created if need be)")
    if distributed and (rank != 0 or os.environ.get(LOCKED_ENV) == str(out.absolute())):
        yield
        return
    try:
        import fcntl
    except ImportError:
        yield
        return
    out.mkdir(parents=True, exist_ok=True)
    with open(out / LOCK_NAME, "a+", encoding="utf-8") as f:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip()
            raise ValueError(f"{out} is in use by another groundup {command}"
                             f"{f' (process {holder})' if holder else ''}: "
                             "wait for it to end, or choose another --out") from None
        f.seek(0)
        f.truncate()
        f.write(str(os.getpid()))
        f.flush()
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)
