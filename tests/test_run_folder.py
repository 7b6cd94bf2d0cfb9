"""groundup.run_folder: the run folder's lock, removed on the way out, and the folder a run made for nothing."""

import os
import sys

import pytest

from groundup import run_folder
from groundup.run_folder import LOCK_NAME, run_lock

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="no fcntl: nothing is locked")


def test_the_lock_is_held_while_the_block_runs_and_gone_after_it(tmp_path):
    out = tmp_path / "run"
    with run_lock(out, command="finetune"):
        assert (out / LOCK_NAME).read_text() == str(os.getpid())
        with pytest.raises(ValueError, match=rf"^{out} is in use by another groundup finetune \(process "
                                             rf"{os.getpid()}\): wait for it to end, or choose another --out$"):
            with run_lock(out, command="finetune"):
                pass
        (out / "checkpoint.pt").write_bytes(b"a run's checkpoint")
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint.pt"], "the checkpoint stays, the lock goes"


@pytest.mark.parametrize("stop", [ValueError("bad flag"), RuntimeError("unexpected"), KeyboardInterrupt()])
def test_a_folder_the_run_made_for_nothing_goes_whatever_ended_it(tmp_path, stop):
    made, mine, kept = tmp_path / "made", tmp_path / "mine", tmp_path / "kept"
    mine.mkdir()
    for folder in (made, mine, kept):
        with pytest.raises(type(stop)):
            with run_lock(folder):
                if folder == kept:
                    (folder / "checkpoint.pt").write_bytes(b"resumable")
                raise stop
    assert not made.exists(), "created by the run, holding nothing: removed"
    assert list(mine.iterdir()) == [], "made by the user: kept, without the lock"
    assert [p.name for p in kept.iterdir()] == ["checkpoint.pt"], "a checkpoint to resume from: kept"


def test_a_lock_file_left_by_a_dead_process_locks_nothing(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / LOCK_NAME).write_text("2147483646")  # a killed run's: its flock ended with its process
    with run_lock(out):
        assert (out / LOCK_NAME).read_text() == str(os.getpid())
    assert list(out.iterdir()) == []


def test_a_lock_file_removed_by_its_holder_meanwhile_is_not_the_one_locked(tmp_path, monkeypatch):
    # A second run opens .lock just before the first one, ending, removes it and lets go: the second then gets the
    # flock of a file no longer in the folder, and a third run would lock a new .lock beside it. It must notice and
    # lock the file at the path instead.
    import fcntl

    out = tmp_path / "run"
    out.mkdir()
    (out / LOCK_NAME).write_text("")
    real_flock, calls = fcntl.flock, []

    def flock(fd, operation):
        if operation & fcntl.LOCK_EX and not calls:  # the first holder ends between our open and our flock
            (out / LOCK_NAME).unlink()
        calls.append(operation)
        return real_flock(fd, operation)

    monkeypatch.setattr(fcntl, "flock", flock)
    with run_lock(out):
        assert len(calls) == 2, "locked twice: the removed file, then the one at the path"
        assert (out / LOCK_NAME).read_text() == str(os.getpid())
        monkeypatch.setattr(fcntl, "flock", real_flock)
        with pytest.raises(ValueError, match="is in use by another groundup train"):
            with run_lock(out):
                pass
    assert not (out / LOCK_NAME).exists()


def test_remove_if_unused_keeps_a_folder_something_was_written_to(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / LOCK_NAME).write_text("1")
    run_folder.remove_if_unused(out, created=False)
    assert (out / LOCK_NAME).exists(), "not created by this run: left alone"
    (out / "history.json").write_text("{}")
    run_folder.remove_if_unused(out, created=True)
    assert sorted(p.name for p in out.iterdir()) == [LOCK_NAME, "history.json"]
    (out / "history.json").unlink()
    run_folder.remove_if_unused(out, created=True)
    assert not out.exists()
