"""The torchrun entry point: ``python -m groundup.distributed [allreduce | _torchrun] ...``.

One process of a torchrun group runs ``groundup train`` (:mod:`groundup.runs`) with ``distributed=True``, or times
``all_reduce``; ``_torchrun`` is :func:`groundup.distributed.launch`'s wrapper around torchrun itself. It lives
apart from the package's ``__init__`` so that the data-parallel library does not import the command line's runs,
which import it (no import circle): only this entry point needs both.
"""

from __future__ import annotations

import os
import sys

import torch.distributed as dist

from groundup.distributed import (
    TORCHRUN_ENV,
    _die_with_parent,
    _torchrun_main,
    init_process_group,
    time_all_reduce,
)


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
    """``groundup train`` as one of torchrun's processes. Started by :func:`launch`, it dies with torchrun, and
    after a Ctrl-C (which :func:`launch` forwards) it exits with status 0 once the checkpoint is saved (the
    launcher reports 130): torchrun would stop the other processes at the first non-zero status, process 0 in
    the middle of saving, say."""
    import argparse
    import signal

    from groundup import runs

    launched = os.environ.get(TORCHRUN_ENV)
    if launched and launched.isdigit():
        _die_with_parent(int(launched), signal.SIGKILL)
    parser = argparse.ArgumentParser(prog="python -m groundup.distributed",
                                     description="groundup train, as one of the processes torchrun starts")
    runs.add_train_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["train", *argv])
    args.argv = ["train", *argv]
    try:
        rank, _ = init_process_group()
    except KeyboardInterrupt:
        return 0 if launched else 130
    if rank != 0:  # one voice: the other processes print only errors
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 -- for the life of the process
    try:
        status = args.handler(args)
    finally:
        dist.destroy_process_group()
    return 0 if status == 130 and launched else status


def main(argv=None) -> int:
    """``python -m groundup.distributed [allreduce] ...``: one process of a torchrun group (see the module doc)."""
    from torch.distributed.elastic.multiprocessing.errors import record

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["_torchrun"]:  # launch's wrapper around torchrun
        return _torchrun_main(argv[1:])
    if argv[:1] == ["allreduce"]:
        return record(_allreduce_main)(argv[1:])
    return record(_train_main)(argv)


if __name__ == "__main__":
    sys.exit(main())
