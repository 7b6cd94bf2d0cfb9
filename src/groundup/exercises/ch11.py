"""Checkers for chapter 11 (scaling out): a ring all-reduce simulated by hand (its messages replayed), and the memory
of ZeRO / FSDP.

Every checker computes the expected values before it calls the reader's function, hands the function copies of
its inputs (and says so if the function changed them in place), and checks the type of what comes back.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from groundup.distributed import training_memory
from groundup.exercises.checking import (
    Mismatch,
    Verdict,
    call_reader,
    expect,
    expect_close,
    expect_integer,
    expect_number,
    expect_tensor,
    run_checks,
)

__all__ = ["check_ring_allreduce", "check_zero_memory"]


# ---- Exercise 11.1 -----------------------------------------------------------------------------------------

_SEND_HINT = ("In each of the p − 1 reduce-scatter steps and each of the p − 1 all-gather steps every process sends "
              "one chunk of N / p numbers to its right-hand neighbour, never the whole tensor.")
_MESSAGE_HINT = ("A message carries the sender's copy of the chunk as it is at that step (its own numbers plus what "
                 "it has received so far), cloned when sent: compute all messages of a step before applying any, and "
                 "do not change a sent tensor afterwards.")
_ROUTE_HINT = ("Each chunk must pass once round the ring before the all-gather: in reduce-scatter step s process r "
               "sends its partial sum of one chunk to (r + 1) mod p, which adds its own copy, so that after p − 1 "
               "steps every chunk holds all p copies at one process; the all-gather then passes each summed chunk on "
               "(the receiver replaces its copy).")


def _step_messages(step, k: int, p: int, n: int, call: str) -> list[tuple[int, int, torch.Tensor]]:
    """Step ``k``'s messages checked to be one triple ``(r, c, data)`` per process ``r``, ``data`` one chunk of
    ``n`` numbers; returned sorted by sender."""
    where = f"{call}: step {k + 1} of the messages"
    expect(isinstance(step, (list, tuple)) and all(isinstance(m, (list, tuple)) and len(m) == 3 for m in step),
           f"{where} is not a list of triples (r, c, data)",
           "Each step is the list of its p messages, each a triple (r, c, data): process r sends data, its copy of "
           "chunk c, to process (r + 1) mod p.")
    triples = [(expect_integer(r, f"{where}: a sender r"), expect_integer(c, f"{where}: a chunk index c"),
                expect_tensor(data, f"{where}: a message's data")) for r, c, data in step]
    senders = sorted(r for r, _, _ in triples)
    expect(senders == list(range(p)), f"{where} has messages from processes {senders}, expected one from each of "
           f"0 to {p - 1}", _SEND_HINT)
    for r, c, data in triples:
        expect(0 <= c < p, f"{where}: process {r} sends chunk {c}, but there are only chunks 0 to {p - 1}")
        expect(data.shape == (n,), f"{where}: process {r} sends {data.numel()} numbers, expected one chunk of "
               f"N / p = {n}", _SEND_HINT)
    return sorted(triples, key=lambda m: m[0])


def _replay(tensors: list[torch.Tensor], messages, call: str) -> list[list[torch.Tensor]]:
    """Run the reader's ``messages`` on the inputs: every message must carry what its sender holds of that chunk
    at that step; the receiver adds it in the p − 1 reduce-scatter steps and takes it in the p − 1 all-gather
    steps. Return what every process holds of every chunk at the end."""
    p, n = len(tensors), tensors[0].numel() // len(tensors)
    expect(isinstance(messages, (list, tuple)) and len(messages) == 2 * (p - 1),
           f"{call}: the messages have {len(messages) if isinstance(messages, (list, tuple)) else 'no'} steps, "
           f"expected 2 (p − 1) = {2 * (p - 1)}",
           "List the steps in order: p − 1 reduce-scatter steps, then p − 1 all-gather steps, each the list of the "
           "p messages sent in it.")
    held = [[chunk.clone() for chunk in t.chunk(p)] for t in tensors]  # held[r][c]: process r's copy of chunk c
    for k, step in enumerate(messages):
        reducing = k < p - 1
        triples = _step_messages(step, k, p, n, call)
        for r, c, data in triples:
            if not torch.equal(data, held[r][c]):
                raise Mismatch(f"{call}: in step {k + 1} ({'reduce-scatter' if reducing else 'all-gather'}) process "
                               f"{r} sends chunk {c}, but not what it holds of chunk {c} at that step", _MESSAGE_HINT)
        for r, c, data in triples:
            receiver = (r + 1) % p
            held[receiver][c] = held[receiver][c] + data if reducing else data.clone()
    return held


def check_ring_allreduce(fn: Callable) -> Verdict:
    """Exercise 11.1: ``fn(tensors) -> (results, messages)``: a ring all-reduce (sum) of p equal-length 1-D tensors,
    simulated in one process. ``messages`` lists the 2 (p − 1) steps, each the p triples ``(r, c, data)`` of the
    step (process r sends ``data``, its copy of chunk c, to process (r + 1) mod p). The checker replays them on the
    inputs (each message must be what its sender holds; the receiver adds in the p − 1 reduce-scatter steps and
    replaces in the p − 1 all-gather steps), so it sees the ring itself, not only its result: every process must end
    with the sum, and ``results[r]`` must be what the messages left at process r. Each process then sent
    2 (p − 1) N / p numbers."""

    def checks():
        g = torch.Generator().manual_seed(11)
        for p, n in ((2, 6), (3, 9), (4, 8), (1, 5)):
            tensors = [torch.randn(n, generator=g, dtype=torch.float64) for _ in range(p)]
            expected = torch.stack(tensors).sum(0)
            call = f"my_ring_allreduce(tensors) with p = {p} tensors of N = {n} numbers"
            out = call_reader(fn, tensors, call=call, names=("tensors",))
            expect(isinstance(out, tuple) and len(out) == 2, f"{call} returned a {type(out).__name__}",
                   "Return a pair: (the list of p results, the list of the steps' messages).")
            results, messages = out
            expect(isinstance(results, (list, tuple)) and len(results) == p,
                   f"{call}: the results are not a list of {p} tensors", "Return one result per process.")
            results = [expect_tensor(t, f"{call}: results[{r}]") for r, t in enumerate(results)]
            for r, t in enumerate(results):
                hint = "Every process must end with the sum of all p tensors (all-reduce with op SUM)."
                if t.shape == expected.shape and torch.allclose(t, expected / p):
                    hint = "That is the average; all_reduce sums (DDP divides by p afterwards)."
                expect_close(t, expected, f"{call}: results[{r}]", hint, rtol=1e-12, atol=1e-12)
            held = _replay(tensors, messages, call)
            for r in range(p):
                for c, (chunk, want) in enumerate(zip(held[r], expected.chunk(p))):
                    expect(torch.allclose(chunk, want, rtol=1e-12, atol=1e-12),
                           f"{call}: after your messages process {r}'s copy of chunk {c} is not the sum of the p "
                           "copies", _ROUTE_HINT)
                expect(torch.equal(results[r], torch.cat(held[r])),
                       f"{call}: results[{r}] is not what your messages leave at process {r}",
                       "Return each process's own chunks at the end, concatenated in order (torch.cat): the sum "
                       "should arrive through the messages, not be computed beside them.")

    return run_checks("Exercise 11.1 (ring all-reduce)", checks,
                      "Every process ends with the sum, and each sent 2 (p − 1) N / p numbers, for p = 1 to 4.")


# ---- Exercise 11.2 -----------------------------------------------------------------------------------------


def check_zero_memory(fn: Callable) -> Verdict:
    """Exercise 11.2: ``fn(n_params, n_gpus, stage) -> bytes per GPU`` for mixed-precision Adam with ZeRO."""

    def checks():
        cases = [(124_000_000, 1, 0), (124_000_000, 8, 0), (7_000_000_000, 8, 1), (7_000_000_000, 8, 2),
                 (7_000_000_000, 8, 3), (7_000_000_000, 64, 3), (1_000, 4, 2)]
        for n, gpus, stage in cases:
            expected = training_memory(n, gpus, stage)["total"]
            call = f"my_zero_memory({n:_}, n_gpus={gpus}, stage={stage})"
            got = expect_number(call_reader(fn, n, gpus, stage, call=call, forbid=(training_memory,)), call,
                                "Return the number of bytes.")
            hints = {16 * n: "With several GPUs and stage >= 1 some parts are divided by n_gpus.",
                     16 * n / gpus: "Only stage 3 divides everything: stage 1 shards the optimizer state (12 bytes), "
                                    "stage 2 also the gradients (2 bytes); the rest stays whole on every GPU."}
            hint = hints.get(got, "Mixed-precision Adam: 2 bytes of weights + 2 of gradients + 12 of optimizer "
                                  "state (fp32 copy, m, v) per parameter; stage 1 divides the 12 by n_gpus, stage 2 "
                                  "also the gradients' 2, stage 3 also the weights' 2.") if stage or gpus > 1 else (
                "Stage 0 (plain DDP) keeps all 16 bytes per parameter on every GPU.")
            expect_close(got, expected, call, hint, rtol=1e-9, atol=0.5)

    return run_checks("Exercise 11.2 (memory per GPU with ZeRO)", checks,
                      "It matches groundup.distributed.training_memory for stages 0 to 3.")
