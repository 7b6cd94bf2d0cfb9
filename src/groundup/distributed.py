"""Data-parallel training on PyTorch's distributed engine (chapter 11): ``torch.distributed``, DDP, ``torchrun``.

    torchrun --standalone --nproc_per_node=2 -m groundup.distributed --out run/ [groundup train options]
    groundup train --nproc 2 --out run/ [options]        # the same: starts torchrun for you
    groundup train --out run/ --resume --nproc 1         # continue it with another number of processes
    torchrun --standalone --nproc_per_node=2 -m groundup.distributed allreduce   # time all_reduce here

Every process builds the same model (same seed), draws the same whole batch of ``batch_size`` windows from the
same seeded generator and keeps its own slice of rows; ``DistributedDataParallel`` averages the gradients with an
all-reduce during ``backward``, so every process makes the same update — the update one process would make on the
whole batch. Chapter 7's :func:`groundup.training.train` runs the loop (``distributed=True``); only process 0
writes checkpoints (atomically), the history and the progress bar. On CPUs the processes talk through gloo, on
GPUs through NCCL; across machines ``torchrun --nnodes N --node_rank ... --rdzv-endpoint HOST:PORT`` starts the
same program on each.

The module also holds the chapter's arithmetic: the bytes a ring all-reduce moves (:func:`ring_allreduce_bytes`)
and the memory per GPU of mixed-precision Adam with ZeRO / FSDP sharding (:func:`training_memory`).
"""

from __future__ import annotations

import datetime
import os
import socket
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist

__all__ = ["init_process_group", "rank_and_world", "free_port", "torchrun_command", "launch", "run_local",
           "ring_allreduce_bytes", "training_memory", "ZERO_STAGES", "time_all_reduce", "main"]

LAUNCH_TIMEOUT = 30.0
"""Seconds a process waits for the others to join the group (rendezvous) before it gives up."""


def init_process_group(backend: str | None = None, *, timeout: float = 600.0) -> tuple[int, int]:
    """Join the process group ``torchrun`` describes in the environment; return ``(rank, world_size)``.

    ``torchrun`` sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` for each process
    it starts. The backend is NCCL when this process has a GPU (each process then uses GPU ``LOCAL_RANK``), gloo
    otherwise. ``timeout`` bounds how long a collective waits for a process that stopped answering.
    """
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise RuntimeError(f"{', '.join(missing)} not set: start this program with torchrun (e.g. torchrun "
                           "--standalone --nproc_per_node=2 -m groundup.distributed ...) or groundup train --nproc N")
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout))
    return dist.get_rank(), dist.get_world_size()


def rank_and_world() -> tuple[int, int]:
    """``(rank, world_size)`` of this process: ``(0, 1)`` outside a process group."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now (for a local rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_command(nproc: int, args, *, module: str = "groundup.distributed") -> list[str]:
    """The ``torchrun`` command line that starts ``nproc`` processes of ``python -m module args...`` here.

    ``--standalone`` runs the rendezvous on this machine on a free port; ``torch.distributed.run`` is what the
    ``torchrun`` script calls (spelled this way it uses the current Python).
    """
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"nproc must be a positive integer (a number of processes), got {nproc!r}")
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            "--max-restarts=0", "--monitor-interval=0.5", "-m", module, *map(str, args)]


def launch(nproc: int, args, *, module: str = "groundup.distributed", timeout: float | None = None,
           env: dict | None = None) -> int:
    """Run ``torchrun`` with ``nproc`` processes of ``python -m module args...``; return its exit status.

    The processes run with one CPU thread each unless ``OMP_NUM_THREADS`` is set. When any process fails, torchrun
    stops the others and exits non-zero with a summary naming the failed rank; this adds a line saying so.
    ``timeout`` (seconds) stops the whole group (status 124) if it runs longer.
    """
    command = torchrun_command(nproc, args, module=module)
    environment = {**os.environ, **(env or {})}
    environment.setdefault("OMP_NUM_THREADS", "1")
    process = subprocess.Popen(command, env=environment, start_new_session=True)
    try:
        status = process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        _stop_group(process)
        print(f"error: the {nproc} processes ran longer than {timeout:g} s and were stopped", file=sys.stderr)
        return 124
    except KeyboardInterrupt:  # Ctrl-C reached torchrun too; wait for it to stop its processes
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            _stop_group(process)
        raise
    if status != 0:
        print(f"error: the distributed run failed (torchrun exit status {status}); the failed process's error is "
              "shown above", file=sys.stderr)
    return status


def _stop_group(process: subprocess.Popen) -> None:
    import signal

    try:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=15)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait()


def _local_worker(rank: int, fn, world_size: int, port: int, args: tuple) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    init_process_group("gloo", timeout=LAUNCH_TIMEOUT)
    try:
        fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()


def run_local(fn, nproc: int, *args, timeout: float = 120.0) -> None:
    """Run ``fn(rank, world_size, *args)`` in ``nproc`` fresh processes joined in a gloo group on 127.0.0.1.

    ``torch.multiprocessing.spawn`` without ``torchrun`` (the tests use it): ``fn`` must be importable (defined in a
    module, not a notebook). If one process raises, the others are stopped and the error is raised here; a group
    still running after ``timeout`` seconds is stopped with a ``TimeoutError``.
    """
    import torch.multiprocessing as mp

    context = mp.start_processes(_local_worker, args=(fn, nproc, free_port(), args), nprocs=nproc, join=False,
                                 start_method="spawn")
    deadline = time.monotonic() + timeout
    while not context.join(timeout=0.2):
        if time.monotonic() > deadline:
            for p in context.processes:
                if p.is_alive():
                    p.kill()
            raise TimeoutError(f"the {nproc} processes did not finish within {timeout:g} s")


# ---- the chapter's arithmetic ------------------------------------------------------------------------------


def ring_allreduce_bytes(n_numbers: int, world_size: int, bytes_per_number: int = 4) -> float:
    """Bytes each process sends (and receives) in a ring all-reduce of ``n_numbers`` values: 2 (p − 1)/p · N · b.

    The ring cuts the tensor into p chunks; in p − 1 reduce-scatter steps each process sends one chunk and adds
    the chunk it receives, then in p − 1 all-gather steps the reduced chunks travel round the ring.
    """
    if world_size < 1 or n_numbers < 0:
        raise ValueError(f"need world_size >= 1 and n_numbers >= 0, got {world_size}, {n_numbers}")
    return 2 * (world_size - 1) / world_size * n_numbers * bytes_per_number


ZERO_STAGES = {0: "DDP (everything replicated)", 1: "ZeRO-1 (optimizer state sharded)",
               2: "ZeRO-2 (+ gradients sharded)", 3: "ZeRO-3 / FSDP (+ parameters sharded)"}


def training_memory(n_params: int, n_gpus: int = 1, stage: int = 0, *, param_bytes: int = 2, grad_bytes: int = 2,
                    optimizer_bytes: int = 12) -> dict:
    """Bytes per GPU for the parameters, gradients and optimizer state of mixed-precision Adam, with ZeRO sharding.

    Mixed-precision Adam keeps 16 bytes per parameter (Rajbhandari et al. 2020): 2 for the bf16/fp16 weights, 2 for
    their gradients and 12 of optimizer state (fp32 master weights, Adam's m and v). ZeRO stage 1 divides the
    optimizer state by the number of GPUs N, stage 2 also the gradients, stage 3 (FSDP) also the parameters.
    Activations and temporary buffers come on top. Returns the three parts and their ``total`` in bytes.
    """
    if stage not in ZERO_STAGES:
        raise ValueError(f"stage must be one of {sorted(ZERO_STAGES)}, got {stage!r}")
    if n_gpus < 1:
        raise ValueError(f"n_gpus must be >= 1, got {n_gpus!r}")
    parts = {"parameters": n_params * param_bytes / (n_gpus if stage >= 3 else 1),
             "gradients": n_params * grad_bytes / (n_gpus if stage >= 2 else 1),
             "optimizer": n_params * optimizer_bytes / (n_gpus if stage >= 1 else 1)}
    parts["total"] = sum(parts.values())
    return parts


def time_all_reduce(sizes, *, repeats: int = 10, warmup: int = 2) -> list[dict]:
    """Time ``dist.all_reduce`` of float32 tensors of the given sizes in the current group; process 0 reports.

    For each size: ``repeats`` timed all-reduces after ``warmup`` untimed ones, each started together (a barrier
    before it); the median seconds, and the "bus bandwidth" 2 (p − 1)/p · bytes / time, the rate at which each
    process moves data in a ring all-reduce.
    """
    rank, world = rank_and_world()
    rows = []
    for n in sizes:
        x = torch.ones(int(n))
        seconds = []
        for i in range(warmup + repeats):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(x)
            elapsed = time.perf_counter() - start
            if i >= warmup:
                seconds.append(elapsed)
        # everyone's time: the slowest process sets the pace of a collective
        times = torch.tensor(seconds, dtype=torch.float64)
        dist.all_reduce(times, op=dist.ReduceOp.MAX)
        median = statistics.median(times.tolist())
        moved = ring_allreduce_bytes(int(n), world, 4)
        rows.append({"numbers": int(n), "bytes": 4 * int(n), "median_s": median, "bus_GB_s": moved / median / 1e9,
                     "correct": bool(x[0].item() == world ** (warmup + repeats))})
    return rows


# ---- the torchrun entry point ------------------------------------------------------------------------------


def _allreduce_main(argv) -> int:
    import argparse
    import json

    p = argparse.ArgumentParser(prog="python -m groundup.distributed allreduce",
                                description="Time dist.all_reduce of float32 tensors of several sizes (run under "
                                            "torchrun); process 0 prints one JSON line per size.")
    p.add_argument("--sizes", type=int, nargs="+", default=[1_000, 10_000, 100_000, 1_000_000, 4_000_000])
    p.add_argument("--repeats", type=int, default=10)
    args = p.parse_args(argv)
    rank, world = init_process_group()
    try:
        rows = time_all_reduce(args.sizes, repeats=args.repeats)
        if rank == 0:
            for row in rows:
                print(json.dumps({"world_size": world, **row}), flush=True)
    finally:
        dist.destroy_process_group()
    return 0


def _train_main(argv) -> int:
    import argparse

    from groundup import runs

    parser = argparse.ArgumentParser(prog="python -m groundup.distributed",
                                     description="groundup train, as one of the processes torchrun starts")
    runs.add_train_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["train", *argv])
    args.argv = ["train", *argv]
    rank, _ = init_process_group()
    if rank != 0:  # one voice: the other processes print only errors
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 -- for the life of the process
    try:
        return args.handler(args)
    finally:
        dist.destroy_process_group()


def main(argv=None) -> int:
    """``python -m groundup.distributed [allreduce] ...``: one process of a torchrun group (see the module doc)."""
    from torch.distributed.elastic.multiprocessing.errors import record

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["allreduce"]:
        return record(_allreduce_main)(argv[1:])
    return record(_train_main)(argv)


if __name__ == "__main__":
    sys.exit(main())
