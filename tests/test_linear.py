"""groundup.linear: the single-row path gives F.linear's numbers, and is taken only where it should be."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from groundup.linear import ALIGN, BLOCKED, BLOCKED_MIN_ELEMENTS, BLOCKS, Linear, linear

pytestmark = pytest.mark.skipif(not BLOCKED, reason="the blocked path is taken only with MKL")

# GPT-2 small, SmolLM2-135M and chapter 7's widths: (out_features, in_features)
SHAPES = [(2304, 768), (3072, 768), (768, 3072), (50257, 768), (50255, 768), (960, 576), (1536, 576),
          (576, 1536), (49152, 576), (1152, 384), (1536, 384), (1155, 768), (2306, 768), (600, 576)]


def _taken(monkeypatch) -> list:
    """Record every call of torch.matmul (the single-row path's batched product)."""
    calls, matmul = [], torch.matmul
    monkeypatch.setattr(torch, "matmul", lambda *a, **k: calls.append(a) or matmul(*a, **k))
    return calls


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("lead", [(1, 1), (1,), ()])
def test_single_row_equals_f_linear_bit_for_bit(shape, lead, monkeypatch):
    out_f, in_f = shape
    g = torch.Generator().manual_seed(out_f + in_f)
    w, b = torch.randn(out_f, in_f, generator=g), torch.randn(out_f, generator=g)
    x = torch.randn(*lead, in_f, generator=g)
    calls = _taken(monkeypatch)
    for bias in (None, b):
        got = linear(x, w, bias)
        assert got.shape == (*lead, out_f)
        assert torch.equal(got, F.linear(x, w, bias))
    assert len(calls) == 2  # the blocked product was used


def test_many_widths_equal_f_linear_bit_for_bit():
    """55 widths whose remainders modulo BLOCKS * ALIGN spread over 0..127: aligned blocks round like one F.linear."""
    g = torch.Generator().manual_seed(0)
    widths = [n for n in range(BLOCKS * ALIGN, 1400, 13) if n * 384 >= BLOCKED_MIN_ELEMENTS]
    assert len(widths) == 55 and len({n % (BLOCKS * ALIGN) for n in widths}) == 55
    for out_f in widths:
        w, b, x = (torch.randn(out_f, 384, generator=g), torch.randn(out_f, generator=g),
                   torch.randn(384, generator=g))
        assert torch.equal(linear(x, w), F.linear(x, w)), out_f
        assert torch.equal(linear(x, w, b), F.linear(x, w, b)), out_f


def test_other_cases_are_f_linear(monkeypatch):
    w = torch.randn(1536, 384)
    calls = _taken(monkeypatch)
    for x, weight in [(torch.randn(2, 384), w),  # two rows: a matrix product already
                      (torch.randn(1, 384, dtype=torch.float64), w.double()),  # float64
                      (torch.randn(1, 384), torch.randn(64, 384)),  # small: in the cache
                      (torch.randn(1, 384), torch.randn(384, 1536).T)]:  # not contiguous
        assert torch.equal(linear(x, weight), F.linear(x, weight))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):  # autocast: F.linear's precision
        x, b = torch.randn(1, 1, 384), torch.randn(1536)
        assert linear(x, w, b).dtype == torch.bfloat16 and torch.equal(linear(x, w, b), F.linear(x, w, b))
    with pytest.raises(RuntimeError):  # a float64 bias: F.linear's own error, not a silent float64 result
        linear(torch.randn(1, 384), w, torch.zeros(1536, dtype=torch.float64))
    x, wg = torch.randn(1, 384, requires_grad=True), w.clone().requires_grad_()
    linear(x, wg).sum().backward()  # a recorded gradient: F.linear, exactly as in training
    assert torch.equal(wg.grad, x.detach().expand(1536, 384))
    assert calls == [] and BLOCKED_MIN_ELEMENTS == 1 << 18


def test_linear_layer_is_nn_linear():
    torch.manual_seed(0)
    ours = Linear(768, 2304)
    torch.manual_seed(0)
    theirs = nn.Linear(768, 2304)
    assert isinstance(ours, nn.Linear) and repr(ours) == repr(theirs)
    assert all(torch.equal(a, b) for a, b in zip(ours.state_dict().values(), theirs.state_dict().values(), strict=True))
    x = torch.randn(1, 1, 768)
    with torch.no_grad():
        assert torch.equal(ours(x), theirs(x))
    batch = torch.randn(3, 5, 768)
    assert torch.equal(ours(batch), theirs(batch))  # with gradients: nn.Linear's own path
