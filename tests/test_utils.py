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
