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
and the memory per GPU of mixed-precision Adam with ZeRO / FSDP sharding (:func:`training_memory`). The torchrun
entry point (``python -m groundup.distributed``) is the package's ``__main__`` module.
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
           "ring_allreduce_bytes", "training_memory", "ZERO_STAGES", "time_all_reduce"]

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


LAUNCHER_ENV = "GROUNDUP_LAUNCHER_PID"
"""Set by :func:`launch` for torchrun and its processes: the launching process, which they must not outlive."""
TORCHRUN_ENV = "GROUNDUP_TORCHRUN_PID"
"""Set by the torchrun that :func:`launch` starts, for its processes: their parent, which they must not outlive."""


def launch(nproc: int, args, *, module: str = "groundup.distributed", timeout: float | None = None,
           env: dict | None = None) -> int:
    """Run ``torchrun`` with ``nproc`` processes of ``python -m module args...``; return its exit status.

    The processes run with one CPU thread each unless ``OMP_NUM_THREADS`` is set. torchrun runs in a session of
    its own (a terminal's Ctrl-C reaches only this process) and in a thin wrapper (:func:`_torchrun_main`) that
    makes it ignore SIGINT, die with this process and report a failed process in one line, not a traceback:

    * Ctrl-C here is forwarded once, as SIGINT, through torchrun to the processes (each in a session of its own),
      which treat it as one process does (``groundup train`` stops at the end of the step, process 0 saves a
      checkpoint); the status is then 130. A second Ctrl-C stops them at once (SIGTERM; the last checkpoint
      written stays).
    * If this process dies, even by SIGKILL, torchrun gets SIGTERM and stops its processes, and ``groundup
      train``'s processes die with torchrun: Linux's parent-death signal (``PR_SET_PDEATHSIG``, set in each
      child), and elsewhere a thread in each child that checks once a second that its parent is still there.
    * When a process fails, torchrun stops the others and this prints a line saying so (status 1).

    ``timeout`` (seconds) stops the whole group (status 124) if it runs longer.
    """
    import signal

    command = [sys.executable, "-m", "groundup.distributed", "_torchrun",
               *torchrun_command(nproc, args, module=module)[3:]]
    environment = {**os.environ, **(env or {}), LAUNCHER_ENV: str(os.getpid())}
    environment.setdefault("OMP_NUM_THREADS", "1")
    process = subprocess.Popen(command, env=environment, start_new_session=True)
    deadline = None if timeout is None else time.monotonic() + timeout
    interrupted = False
    try:
        while True:
            try:
                status = process.wait(timeout=None if deadline is None else max(deadline - time.monotonic(), 0))
                break
            except subprocess.TimeoutExpired:
                _stop_group(process)
                print(f"error: the {nproc} processes ran longer than {timeout:g} s and were stopped", file=sys.stderr)
                return 124
            except KeyboardInterrupt:
                if interrupted:  # a second Ctrl-C: stop at once
                    process.send_signal(signal.SIGTERM)
                    process.wait()
                    print("\nstopped at once (a second Ctrl-C); the last checkpoint written stays", file=sys.stderr)
                    return 130
                interrupted = True
                process.send_signal(signal.SIGINT)  # torchrun forwards it: the processes stop after their step
    finally:
        if process.poll() is None:  # this function itself failed: torchrun stops its processes on SIGTERM
            _stop_group(process)
    if interrupted:
        return status or 130
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


def _die_with_parent(expected_parent: int | None, sig) -> None:
    """Get signal ``sig`` when this process's parent ends (or at once if it has ended already): Linux's
    parent-death signal, and, everywhere, a daemon thread that checks once a second that the parent is still
    ``expected_parent`` (an orphan's parent becomes another process)."""
    import threading

    if sys.platform.startswith("linux"):
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, int(sig), 0, 0, 0)  # PR_SET_PDEATHSIG = 1
        except (OSError, AttributeError):  # no prctl: the thread below still watches
            pass
    parent = expected_parent if expected_parent is not None else os.getppid()

    def orphaned() -> bool:
        return os.getppid() != parent

    def watch():
        while not orphaned():
            time.sleep(1.0)
        os.kill(os.getpid(), sig)

    if orphaned():  # the parent died before the signal was armed
        os.kill(os.getpid(), sig)
    threading.Thread(target=watch, name="die-with-parent", daemon=True).start()

    threading.Thread(target=watch, name="die-with-parent", daemon=True).start()


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid``: from ``/proc`` on Linux, ``pgrep -P`` elsewhere."""
    if not os.path.isdir("/proc"):
        found = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True, check=False)
        return [int(word) for word in found.stdout.split()]
    children = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    stat = f.read()
            except OSError:  # it ended meanwhile
                continue
            fields = stat[stat.rfind(b")") + 2:].split()  # after "pid (name) ": state, ppid, ...
            if len(fields) > 1 and int(fields[1]) == pid:
                children.append(int(entry))
    return children


def _signal_children(sig) -> None:
    """Send ``sig`` to every child of this process."""
    for pid in _children(os.getpid()):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _torchrun_main(argv) -> int:
    """torchrun as :func:`launch` runs it: ``python -m groundup.distributed _torchrun [torchrun arguments]``.

    It forwards SIGINT to its processes (torchrun starts each in a session of its own, out of reach of a signal
    to its group; torchrun itself would take SIGINT as the end of everything), gets SIGTERM when the launching
    process dies, and makes a failed process one line and torchrun's status, not a traceback.
    """
    import logging
    import signal

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    signal.signal(signal.SIGINT, lambda signum, frame: _signal_children(signal.SIGINT))
    launcher = os.environ.get(LAUNCHER_ENV)
    # SIGTERM: torchrun's own handler then stops its processes before it ends (SIGTERM, then SIGKILL after 30 s)
    _die_with_parent(int(launcher) if launcher and launcher.isdigit() else None, signal.SIGTERM)
    os.environ[TORCHRUN_ENV] = str(os.getpid())
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)  # the failures are reported below
    try:
        run(parse_args(["--signals-to-handle=SIGTERM,SIGHUP,SIGQUIT", *argv]))  # not SIGINT: forwarded above
    except ChildFailedError as err:
        rank, failure = err.get_first_failure()
        how = f"was killed by signal {failure.signal_name()}" if failure.exitcode < 0 else \
            f"exited with status {failure.exitcode}"
        print(f"error: process {rank} of the distributed run {how}", file=sys.stderr)
        return 1
    except SignalException as err:  # SIGTERM, SIGHUP, SIGQUIT: torchrun stopped its processes
        return 128 + int(err.sigval)
    return 0


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
