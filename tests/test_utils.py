import random

import numpy as np
import pytest
import torch

from groundup import default_device, set_seed


def test_set_seed_makes_every_generator_repeat():
    set_seed(123)
    first = (random.random(), np.random.rand(), torch.rand(3))
    set_seed(123)
    second = (random.random(), np.random.rand(), torch.rand(3))
    assert first[0] == second[0] and first[1] == second[1] and torch.equal(first[2], second[2])
    set_seed(124)
    assert not torch.equal(torch.rand(3), first[2])


@pytest.mark.parametrize("seed", [-1, 1.5, "0", True])
def test_set_seed_rejects_bad_seeds(seed):
    with pytest.raises(ValueError, match="seed must be a non-negative integer"):
        set_seed(seed)


def test_default_device_is_cpu_without_a_gpu_and_can_be_forced(monkeypatch):
    monkeypatch.delenv("GROUNDUP_DEVICE", raising=False)
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert default_device().type == expected
    monkeypatch.setenv("GROUNDUP_DEVICE", "cpu")
    assert default_device() == torch.device("cpu")


# ---- atomic writes -------------------------------------------------------------------------------------------

def test_atomic_write_replaces_the_file_and_leaves_no_temporary(tmp_path):
    from groundup.utils import atomic_write_bytes, atomic_write_text

    path = tmp_path / "f.txt"
    atomic_write_text(path, "first é")
    assert path.read_text(encoding="utf-8") == "first é"
    atomic_write_bytes(path, b"second")
    assert path.read_bytes() == b"second"
    assert [p.name for p in tmp_path.iterdir()] == ["f.txt"]


def test_atomic_write_failure_keeps_the_previous_file(tmp_path):
    from groundup.utils import atomic_write_text

    path = tmp_path / "f.json"
    atomic_write_text(path, "old")
    with pytest.raises(UnicodeEncodeError):
        atomic_write_text(path, "lone surrogate \ud800")  # cannot be encoded: fails before anything is written
    with pytest.raises(TypeError):
        atomic_write_text(path, None)
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["f.json"]


def test_atomic_write_interrupted_write_keeps_the_previous_file(tmp_path, monkeypatch):
    import os

    from groundup import utils

    path = tmp_path / "f.bin"
    utils.atomic_write_bytes(path, b"old")

    def failing_fsync(fd):
        raise OSError("disk full")

    monkeypatch.setattr(utils.os, "fsync", failing_fsync)
    with pytest.raises(OSError, match="disk full"):
        utils.atomic_write_bytes(path, b"new" * 1000)
    monkeypatch.undo()
    assert path.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["f.bin"]


def test_threads_limits_and_restores_the_thread_count():
    import torch

    from groundup.utils import threads

    before = torch.get_num_threads()
    with threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before
    with pytest.raises(ValueError, match="number of threads"):
        with threads(0):
            pass


def test_atomic_write_gives_normal_permissions_and_keeps_existing_ones(tmp_path):
    import os
    import stat

    from groundup.utils import atomic_write_bytes

    new = tmp_path / "new.txt"
    atomic_write_bytes(new, b"x")
    mask = os.umask(0)
    os.umask(mask)
    assert stat.S_IMODE(new.stat().st_mode) == 0o666 & ~mask, "not the 0600 of a temporary file"
    old = tmp_path / "old.sh"
    old.write_bytes(b"a")
    old.chmod(0o750)
    atomic_write_bytes(old, b"b")
    assert stat.S_IMODE(old.stat().st_mode) == 0o750


# ---- hardening: API traps --------------------------------------------------------------------------------


def test_set_seed_accepts_numpy_integers():
    set_seed(np.int64(3))
    a = torch.rand(3)
    set_seed(3)
    assert torch.equal(a, torch.rand(3))
    from groundup.utils import threads

    with threads(np.int64(1)):
        assert torch.get_num_threads() == 1


def test_groundup_device_cuda_on_a_cpu_build_is_a_clear_error(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    monkeypatch.setenv("GROUNDUP_DEVICE", "cuda")
    with pytest.raises(ValueError, match="GROUNDUP_DEVICE='cuda' asks for a GPU, but .*set GROUNDUP_DEVICE=cpu"):
        default_device()


def test_groundup_device_that_is_not_a_device_name_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("GROUNDUP_DEVICE", "gpu please")
    with pytest.raises(ValueError, match="GROUNDUP_DEVICE='gpu please' is not a device name"):
        default_device()
