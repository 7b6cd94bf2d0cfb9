"""Each chapter-11 checker accepts the reference solution, rejects plausible wrong answers with the right hint,
treats the unattempted stub kindly and reports answers that modify their inputs."""

import pytest
import torch

from groundup.exercises import checking as _checking
from groundup.exercises.ch11 import check_ring_allreduce, check_zero_memory

# --- reference solutions (the notebook's hidden solutions) ----------------------------------------------------


def ring_solution(tensors):
    p = len(tensors)
    chunks = [list(t.clone().chunk(p)) for t in tensors]  # chunks[r][c]: process r's copy of chunk c
    sent = [0] * p
    for step in range(p - 1):  # reduce-scatter: after it, process r holds the full sum of chunk (r + 1) % p
        messages = [(r, (r - step) % p, chunks[r][(r - step) % p].clone()) for r in range(p)]
        for r, c, data in messages:
            chunks[(r + 1) % p][c] += data
            sent[r] += data.numel()
    for step in range(p - 1):  # all-gather: the reduced chunks travel once round the ring
        messages = [(r, (r + 1 - step) % p, chunks[r][(r + 1 - step) % p].clone()) for r in range(p)]
        for r, c, data in messages:
            chunks[(r + 1) % p][c] = data
            sent[r] += data.numel()
    return [torch.cat(c) for c in chunks], sent


def zero_solution(n_params, n_gpus, stage):
    weights, grads, optimizer = 2 * n_params, 2 * n_params, 12 * n_params
    if stage >= 1:
        optimizer /= n_gpus
    if stage >= 2:
        grads /= n_gpus
    if stage >= 3:
        weights /= n_gpus
    return weights + grads + optimizer


def stub(*args):
    raise NotImplementedError


def verdict(checker, fn, capsys):
    ok = checker(fn)
    return bool(ok), capsys.readouterr().out


@pytest.mark.parametrize("checker, solution", [(check_ring_allreduce, ring_solution),
                                               (check_zero_memory, zero_solution)])
def test_reference_passes_and_stub_is_not_attempted(checker, solution, capsys):
    ok, out = verdict(checker, solution, capsys)
    assert ok and "✅" in out, out
    ok, out = verdict(checker, stub, capsys)
    assert not ok and "not attempted yet" in out


# --- 11.1 --------------------------------------------------------------------------------------------------


def test_ring_that_averages_is_told_it_should_sum(capsys):
    def averaging(tensors):
        results, sent = ring_solution(tensors)
        return [r / len(tensors) for r in results], sent

    ok, out = verdict(check_ring_allreduce, averaging, capsys)
    assert not ok and "That is the average" in out, out


def test_ring_that_sends_whole_tensors_is_named(capsys):
    def naive(tensors):
        total = torch.stack(tensors).sum(0)
        return [total.clone() for _ in tensors], [2 * (len(tensors) - 1) * t.numel() for t in tensors]

    ok, out = verdict(check_ring_allreduce, naive, capsys)
    assert not ok and "one chunk of N / p numbers" in out, out


def test_ring_in_place_is_reported(capsys):
    def in_place(tensors):
        results, sent = ring_solution(tensors)
        for t, r in zip(tensors, results):
            t.copy_(r)
        return results, sent

    ok, out = verdict(check_ring_allreduce, in_place, capsys)
    assert not ok and "in place" in out, out


def test_ring_wrong_return_type(capsys):
    ok, out = verdict(check_ring_allreduce, lambda tensors: None, capsys)
    assert not ok and "returned a NoneType" in out and "pair" in out


# --- 11.2 --------------------------------------------------------------------------------------------------


def test_zero_that_divides_everything_is_named(capsys):
    ok, out = verdict(check_zero_memory, lambda n, g, s: 16 * n / g if s else 16 * n, capsys)
    assert not ok and "Only stage 3 divides everything" in out, out


def test_zero_that_never_divides_is_named(capsys):
    ok, out = verdict(check_zero_memory, lambda n, g, s: 16 * n, capsys)
    assert not ok and "divided by n_gpus" in out, out


def test_zero_returning_a_string_is_refused(capsys):
    ok, out = verdict(check_zero_memory, lambda n, g, s: "16", capsys)
    assert not ok and "Return the number of bytes" in out, out


@pytest.fixture(autouse=True)
def _unwrapped_verdicts(monkeypatch):
    """Match hints as whole lines; tests/test_checking.py tests the wrapping to the book's width."""
    monkeypatch.setattr(_checking, "MESSAGE_WIDTH", 10_000)


def test_a_sum_computed_in_one_place_with_the_byte_formula_is_not_a_ring(capsys):
    def no_ring(tensors):
        p, n = len(tensors), tensors[0].numel()
        return [sum(tensors)] * p, [2 * (p - 1) * n // p] * p

    def stacked(tensors):
        p, n = len(tensors), tensors[0].numel()
        return [torch.stack(tensors).sum(0) for _ in range(p)], [2 * (p - 1) * n // p] * p

    for cheat in (no_ring, stacked):
        ok, out = verdict(check_ring_allreduce, cheat, capsys)
        assert not ok and "every chunk was added up in the same order" in out, out
        assert "different orders" in out


def test_a_ring_turning_the_other_way_passes_too(capsys):
    def left_ring(tensors):
        flipped = ring_solution(tensors[::-1])  # process r sends to r - 1
        return flipped[0][::-1], flipped[1][::-1]

    ok, out = verdict(check_ring_allreduce, left_ring, capsys)
    assert ok, out


def test_calling_training_memory_is_refused(capsys):
    from groundup.distributed import training_memory

    ok, out = verdict(check_zero_memory, lambda n, g, s: training_memory(n, g, s)["total"], capsys)
    assert not ok and "calls groundup.distributed.training_memory" in out, out
