"""The two helpers every chapter uses: one seed for everything, one choice of device."""

import contextlib
import numbers
import os
import random
import tempfile
from pathlib import Path

import numpy as np
import torch


def set_seed(seed: int = 0) -> None:
    """Seed Python's, NumPy's and PyTorch's random number generators.

    Every notebook calls this once after its imports, so a re-run prints the same numbers. Code that wants a
    stream of random numbers of its own passes a ``torch.Generator().manual_seed(...)`` explicitly.
    """
    if not isinstance(seed, numbers.Integral) or isinstance(seed, bool) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    seed = int(seed)  # a NumPy integer, say
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def positive_int(name: str, value) -> int:
    """``value`` as an int (Python or NumPy integers; not bools), or a ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


@contextlib.contextmanager
def threads(n: int):
    """Run the body with PyTorch limited to ``n`` CPU threads, then restore the previous number.

    PyTorch's reductions add numbers in an order that depends on the thread count, so results agree to the last
    bit only between runs with the same count; the book's long experiments run on one thread so that they print the
    same numbers on every machine (and small models are nearly as fast on one core).
    """
    if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 1:
        raise ValueError(f"n must be a positive integer (a number of threads), got {n!r}")
    n = int(n)
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def default_device() -> torch.device:
    """The device the book runs on: CUDA when a GPU is present, otherwise the CPU.

    Set ``GROUNDUP_DEVICE`` (for example to ``cpu``) to override the choice; a device this PyTorch build or
    machine cannot use is a ``ValueError`` that says so, here rather than at the first tensor moved there.
    """
    forced = os.environ.get("GROUNDUP_DEVICE", "").strip()
    if forced:
        try:
            device = torch.device(forced)
        except RuntimeError:
            raise ValueError(f"GROUNDUP_DEVICE={forced!r} is not a device name; use e.g. 'cpu', 'cuda' or "
                             f"'cuda:0', or unset it") from None
        if device.type == "cuda" and not torch.cuda.is_available():
            build = "this PyTorch build has no CUDA support" if torch.version.cuda is None else "no GPU is visible"
            raise ValueError(f"GROUNDUP_DEVICE={forced!r} asks for a GPU, but {build}; set GROUNDUP_DEVICE=cpu "
                             f"or unset it")
        if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"GROUNDUP_DEVICE={forced!r}: there are only {torch.cuda.device_count()} GPU(s)")
        if device.type == "mps" and not torch.backends.mps.is_available():
            raise ValueError(f"GROUNDUP_DEVICE={forced!r} asks for Apple's MPS, which is not available here; set "
                             f"GROUNDUP_DEVICE=cpu or unset it")
        return device
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def atomic_write_bytes(path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers (and crashes) see the old file or the new one, never half.

    The bytes go to a temporary file in the same folder, are flushed to disk (fsync), and the file is then
    renamed over ``path`` (atomic on POSIX and Windows); the folder is fsynced so the rename survives a power cut.
    A failure removes the temporary file and leaves any previous ``path`` untouched; an ``OSError`` that names no
    file (``write`` on a full disk) is raised again naming ``path``. The new file gets the
    permissions of the file it replaces, or those a new file gets by default (not the 0600 of a temporary file).
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"data must be bytes, got {type(data).__name__}")
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, path.stat().st_mode & 0o7777 if path.exists() else 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException as err:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(err, OSError) and err.errno is not None and err.filename is None:  # a full disk: name the file
            raise OSError(err.errno, err.strerror, str(path)) from err
        raise
    fsync_folder(path.parent)


def fsync_folder(folder) -> None:
    """Flush a folder's entries to disk, so that a rename inside it survives a power cut (POSIX; else nothing)."""
    if hasattr(os, "O_DIRECTORY"):
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write_text(path, text: str, encoding: str = "utf-8") -> None:
    """:func:`atomic_write_bytes` for text: encodes first, so an unencodable string leaves the old file intact."""
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    atomic_write_bytes(path, text.encode(encoding))


def version_counter(t: torch.Tensor) -> int | None:
    """The in-place version counter of ``t`` (None for inference-mode tensors, which have none).

    Caches keyed on a tensor (the stacked attention weights, a cross-attention context, the rotary factors)
    compare it to notice in-place edits.
    """
    try:
        return t._version
    except RuntimeError:
        return None
