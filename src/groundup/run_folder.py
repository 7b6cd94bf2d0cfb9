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
    """Remove the run folder this command created if it holds nothing but its lock (a run that never started);
    :func:`run_lock` calls it on the way out."""
    if created and out.is_dir() and {p.name for p in out.iterdir()} <= {LOCK_NAME}:
        (out / LOCK_NAME).unlink(missing_ok=True)
        with contextlib.suppress(OSError):  # something was written there meanwhile: it stays
            out.rmdir()


def describe_error(err: Exception) -> str:
    """An error in one line; an OSError names its file (a full disk: which file could not be written)."""
    if isinstance(err, OSError) and err.strerror:
        return f"{err.strerror}: {err.filename}" if err.filename else err.strerror
    return str(err)


LOCK_NAME = ".lock"
"""The lock file inside a run folder; a running ``groundup train`` / ``groundup finetune`` holds an exclusive ``flock``
on it, and removes it when it ends."""
LOCKED_ENV = "GROUNDUP_RUN_LOCKED"
"""Set by ``groundup train --nproc N`` for its processes: the folder whose lock the launching process holds."""


@contextlib.contextmanager
def run_lock(out: Path, distributed: bool = False, rank: int = 0, command: str = "train"):
    """Hold the exclusive lock of run folder ``out`` (creating the folder) for the duration of the block.

    Two runs writing one folder would interleave their checkpoints; the second gets a ``ValueError`` naming the
    folder. The lock is an advisory ``fcntl.flock`` on ``out/.lock``, released when this process ends however it
    ends (even by SIGKILL), so a lock file a killed run left behind locks nothing and a resume goes ahead. However
    the block ends (normally, an error, Ctrl-C), the lock file is removed while still held, and a folder this call
    created that holds nothing else is removed too (:func:`remove_if_unused`: a run that never wrote a checkpoint);
    a folder with a checkpoint stays, to be resumed. A process that opened the lock file just before it was removed
    finds, once it holds the lock, that the file is no longer the one at ``out/.lock``, and locks afresh.

    Inside ``groundup train --nproc N`` the launching process holds the lock for its processes; under a bare
    ``torchrun``, process 0 takes it. Where ``fcntl`` does not exist (Windows) nothing is locked.
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
    created = not out.exists()
    f = _locked_file(out, command, fcntl)
    try:
        f.seek(0)
        f.truncate()
        f.write(str(os.getpid()))
        f.flush()
        yield
    finally:
        try:  # still holding the lock: nobody else can be using the file or the folder
            (out / LOCK_NAME).unlink(missing_ok=True)
            remove_if_unused(out, created)
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)
            f.close()


def _locked_file(out: Path, command: str, fcntl):
    """``out/.lock`` opened and exclusively locked (the folder created if need be), or a ``ValueError`` if another
    process holds it."""
    path = out / LOCK_NAME
    while True:
        out.mkdir(parents=True, exist_ok=True)
        try:
            f = open(path, "a+", encoding="utf-8")
        except FileNotFoundError:  # the folder went away between the two lines: its last holder removed it
            continue
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip()
            f.close()
            raise ValueError(f"{out} is in use by another groundup {command}"
                             f"{f' (process {holder})' if holder else ''}: "
                             "wait for it to end, or choose another --out") from None
        try:
            current = os.stat(path)
        except FileNotFoundError:
            current = None
        if current is not None and os.path.samestat(os.fstat(f.fileno()), current):
            return f
        f.close()  # a lock file its holder removed as it ended: lock the one at the path now
