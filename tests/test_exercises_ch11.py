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
    log = []
    for step in range(p - 1):  # reduce-scatter: after it, process r holds the full sum of chunk (r + 1) % p
        messages = [(r, (r - step) % p, chunks[r][(r - step) % p].clone()) for r in range(p)]
        for r, c, data in messages:
            chunks[(r + 1) % p][c] += data
        log.append(messages)
    for step in range(p - 1):  # all-gather: the reduced chunks travel once round the ring
        messages = [(r, (r + 1 - step) % p, chunks[r][(r + 1 - step) % p].clone()) for r in range(p)]
        for r, c, data in messages:
            chunks[(r + 1) % p][c] = data
        log.append(messages)
    return [torch.cat(c) for c in chunks], log


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
        results, log = ring_solution(tensors)
        return [r / len(tensors) for r in results], log

    ok, out = verdict(check_ring_allreduce, averaging, capsys)
    assert not ok and "That is the average" in out, out


def test_ring_that_sends_whole_tensors_is_named(capsys):
    def naive(tensors):
        p, total = len(tensors), torch.stack(tensors).sum(0)
        log = [[(r, 0, tensors[r].clone()) for r in range(p)] for _ in range(2 * (p - 1))]
        return [total.clone() for _ in tensors], log

    ok, out = verdict(check_ring_allreduce, naive, capsys)
    assert not ok and "process 0 sends 6 numbers, expected one chunk of N / p = 3" in out, out
    assert "one chunk of N / p numbers to its right-hand neighbour, never the whole tensor" in out, out


def test_ring_in_place_is_reported(capsys):
    def in_place(tensors):
        results, log = ring_solution(tensors)
        for t, r in zip(tensors, results):
            t.copy_(r)
        return results, log

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


def _no_messages_at_all(tensors):
    """The audit's cheat: each chunk summed in a rotated order (as a ring would), no messages."""
    p = len(tensors)
    out = []
    for c in range(p):
        order = [(c + 1 + k) % p for k in range(p)]
        acc = tensors[order[0]].chunk(p)[c].clone()
        for r in order[1:]:
            acc = acc + tensors[r].chunk(p)[c]
        out.append(acc)
    return [torch.cat(out) for _ in range(p)], []


def _sum_in_one_place_with_made_up_messages(tensors):
    """The sum computed at once, with messages of the right size that carry the final sum."""
    p, total = len(tensors), torch.stack(tensors).sum(0)
    log = [[(r, (r - k) % p, total.chunk(p)[(r - k) % p].clone()) for r in range(p)] for k in range(2 * (p - 1))]
    return [total.clone() for _ in range(p)], log


def _messages_beside_the_sum(tensors):
    """A correct ring's messages, but results summed elsewhere (float additions in another order)."""
    results, log = ring_solution(tensors)
    p = len(tensors)
    rotated = _no_messages_at_all(tensors[::-1])[0]
    return [rotated[0].clone() for _ in range(p)] if p > 2 else results, log


@pytest.mark.parametrize("cheat, message, hint", [
    (_no_messages_at_all, "the messages have 0 steps, expected 2 (p − 1) = 2", "p − 1 reduce-scatter steps"),
    (_sum_in_one_place_with_made_up_messages, "in step 1 (reduce-scatter) process 0 sends chunk 0, but not what it "
     "holds of chunk 0 at that step", "its own numbers plus what it has received so far"),
])
def test_a_sum_without_the_rings_messages_is_refused(cheat, message, hint, capsys):
    ok, out = verdict(check_ring_allreduce, cheat, capsys)
    assert not ok and message in out and hint in out, out


def test_results_that_do_not_come_from_the_messages_are_refused(capsys):
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(9, generator=g, dtype=torch.float64) for _ in range(3)]
    assert not torch.equal(_messages_beside_the_sum(tensors)[0][0], ring_solution(tensors)[0][0]), \
        "the cheat's sum differs from the ring's in the last bits"
    ok, out = verdict(check_ring_allreduce, _messages_beside_the_sum, capsys)
    assert not ok and "results[0] is not what your messages leave at process 0" in out, out


def test_a_ring_whose_chunks_do_not_go_round_is_named(capsys):
    def same_chunk_each_step(tensors):  # reduce-scatter sends chunk r + step: chunks never pass through everyone
        p = len(tensors)
        chunks = [list(t.clone().chunk(p)) for t in tensors]
        log = []
        for step in range(2 * (p - 1)):
            messages = [(r, (r + step) % p, chunks[r][(r + step) % p].clone()) for r in range(p)]
            for r, c, data in messages:
                if step < p - 1:
                    chunks[(r + 1) % p][c] += data
                else:
                    chunks[(r + 1) % p][c] = data
            log.append(messages)
        return [torch.stack(tensors).sum(0) for _ in range(p)], log

    ok, out = verdict(check_ring_allreduce, same_chunk_each_step, capsys)
    assert not ok and "copy of chunk 0 is not the sum of the p copies" in out and "once round the ring" in out, out


def test_messages_applied_before_the_others_are_computed_are_named(capsys):
    def one_by_one(tensors):  # each message applied before the next is computed: not "at the same time"
        p = len(tensors)
        chunks = [list(t.clone().chunk(p)) for t in tensors]
        log = []
        for step in range(p - 1):
            messages = []
            for r in range(p):
                c = (r - step) % p
                messages.append((r, c, chunks[r][c].clone()))
                chunks[(r + 1) % p][(r - step - 1) % p] += chunks[r][(r - step - 1) % p]  # wrong chunk, early
            log.append(messages)
        results, rest = ring_solution(tensors)
        return results, log + rest[p - 1:]

    ok, out = verdict(check_ring_allreduce, one_by_one, capsys)
    assert not ok and "but not what it holds of chunk" in out, out


def test_messages_of_other_kinds_are_named(capsys):
    def pairs(tensors):
        results, log = ring_solution(tensors)
        return results, [[(r, data) for r, _, data in step] for step in log]

    def twice_from_zero(tensors):
        results, log = ring_solution(tensors)
        return results, [[(0, c, data) for _, c, data in step] for step in log]

    ok, out = verdict(check_ring_allreduce, pairs, capsys)
    assert not ok and "step 1 of the messages is not a list of triples (r, c, data)" in out, out
    ok, out = verdict(check_ring_allreduce, twice_from_zero, capsys)
    assert not ok and "has messages from processes [0, 0], expected one from each of 0 to 1" in out, out


def test_integer_like_indices_are_accepted(capsys):
    import numpy as np

    def numpy_indices(tensors):
        results, log = ring_solution(tensors)
        return results, [[(np.int64(r), torch.tensor(c), data) for r, c, data in step] for step in log]

    ok, out = verdict(check_ring_allreduce, numpy_indices, capsys)
    assert ok, out


def test_calling_training_memory_is_refused(capsys):
    from groundup.distributed import training_memory

    ok, out = verdict(check_zero_memory, lambda n, g, s: training_memory(n, g, s)["total"], capsys)
    assert not ok and "calls groundup.distributed.training_memory" in out, out
