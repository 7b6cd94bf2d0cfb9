"""A chapter's stored results (``src/groundup/results/chapterNN.json``): add one entry, safely.

The ``tools/chNN_results.py`` commands each run one experiment and add its entry here. Several may run at once
(one per seed, say), so the read-modify-write holds a lock on the folder, and the file is replaced atomically: a
reader (or a crash) sees the old file or the new one, never half of one.
"""

from __future__ import annotations

import fcntl
import json
import os
import platform
import sys
from pathlib import Path

from nbval_lanes import ARITHMETIC, UNSET

from groundup.utils import atomic_write_text

#: The notebooks' arithmetic without their thread count (a results tool sets its own, as its notebook cell does).
NOTEBOOK_ARITHMETIC = dict(ARITHMETIC)


def on_notebook_arithmetic() -> None:
    """Start this command again with :data:`NOTEBOOK_ARITHMETIC` set, unless the shell set it already: MKL and
    PyTorch read it when they load, so a process cannot switch later. For a tool whose stored numbers a notebook
    prints as if it had computed them."""
    if any(os.environ.get(k) != v for k, v in NOTEBOOK_ARITHMETIC.items()) or any(k in os.environ for k in UNSET):
        env = {k: v for k, v in {**os.environ, **NOTEBOOK_ARITHMETIC}.items() if k not in UNSET}
        os.execve(sys.executable, [sys.executable, *sys.argv], env)


def add_entry(path: Path, key: str, entry, *, section: str | None = "runs", header: dict | None = None) -> None:
    """Store ``entry`` under ``key`` in the JSON file ``path`` (created if missing), keeping the other entries.

    With ``section`` the entries live in ``results[section]`` (sorted by key); with ``section=None`` at the top
    level (all keys sorted). ``header`` (e.g. ``{"about": ..., "setup": ...}``) sets top-level keys first.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path.parent, os.O_RDONLY)  # lock the folder, so no lock file is left behind
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        results = json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
        results.update(header or {})
        if section is None:
            results[key] = entry
            results = dict(sorted(results.items()))
        else:
            results.setdefault(section, {})[key] = entry
            results[section] = dict(sorted(results[section].items()))
        atomic_write_text(path, json.dumps(results, indent=1, ensure_ascii=False) + "\n")
    finally:
        os.close(fd)


def cpu_name_and_flags() -> tuple[str | None, list[str]]:
    """The CPU's model name (None if unknown) and its flags, as /proc/cpuinfo gives them for the first CPU
    (:func:`groundup.bench.cpu.parse_cpuinfo`; no flags where the file cannot be read)."""
    from groundup.bench.cpu import CPUINFO, parse_cpuinfo

    try:
        name, flags = parse_cpuinfo(CPUINFO.read_text(errors="replace"))
    except OSError:
        return None, []
    return name, sorted(flags or ())


def machine() -> dict:
    """Where a stored measurement ran: the CPU's name and core count, its flags that matter for bfloat16, the threads,
    PyTorch's kernels and MKL's code path in force, every variable of the notebooks' arithmetic
    (:data:`NOTEBOOK_ARITHMETIC`, None where unset), and PyTorch's version."""
    import torch  # only the tools that describe their machine need it

    name, flags = cpu_name_and_flags()
    name, flags = name or platform.processor() or "unknown", set(flags)
    wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "avx512_fp16")
    return {"cpu": name, "cpu_count": os.cpu_count(), "flags": {f: f in flags for f in wanted},
            "threads": torch.get_num_threads(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "mkl_cbwr": os.environ.get("MKL_CBWR"),
            "arithmetic": {k: os.environ.get(k) for k in NOTEBOOK_ARITHMETIC},
            "torch": torch.__version__}
