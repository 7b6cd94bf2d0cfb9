"""The two helpers every chapter uses: one seed for everything, one choice of device."""

import os
import random

import numpy as np
import torch


def set_seed(seed: int = 0) -> None:
    """Seed Python's, NumPy's and PyTorch's random number generators.

    Every notebook calls this once after its imports, so a re-run prints the same numbers. Code that wants a
    stream of random numbers of its own passes a ``torch.Generator().manual_seed(...)`` explicitly.
    """
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def default_device() -> torch.device:
    """The device the book runs on: CUDA when a GPU is present, otherwise the CPU.

    Set ``GROUNDUP_DEVICE`` (for example to ``cpu``) to override the choice.
    """
    forced = os.environ.get("GROUNDUP_DEVICE")
    if forced:
        return torch.device(forced)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
