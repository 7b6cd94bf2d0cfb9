"""The CPU the bench runs on, printed first by ``python -m groundup.bench``.

The bench's ratios (bfloat16 against float32, fused against unfused kernels, groundup against PyTorch's modules)
depend on the CPU's vector extensions and on the kernels PyTorch chose for them, which environment variables can
lower. :func:`cpu_features` gathers them; :func:`describe_cpu` writes them as the report's header. Linux only has
``/proc/cpuinfo``; elsewhere (macOS, Windows) the flags are reported as unknown, never guessed.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

FLAGS = {"avx2": "AVX2", "fma": "FMA", "avx512f": "AVX-512F", "avx512_bf16": "AVX-512 BF16",
         "avx512_vnni": "AVX-512 VNNI", "amx_tile": "AMX tile", "amx_bf16": "AMX BF16", "amx_int8": "AMX INT8"}
"""The ``/proc/cpuinfo`` flags the bench's ratios depend on, with the names the report gives them."""

CPU_CAPS = ("ATEN_CPU_CAPABILITY", "MKL_CBWR", "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")
"""Environment variables that cap the instructions PyTorch's, MKL's or oneDNN's kernels use (reported when set)."""

CPUINFO = Path("/proc/cpuinfo")


def parse_cpuinfo(text: str) -> tuple[str | None, set[str] | None]:
    """The first CPU's model name and flags in a ``/proc/cpuinfo`` text; None for what the text does not give.

    x86 writes ``model name`` and ``flags``; ARM writes ``Features`` (and often no model name)."""
    name, flags = None, None
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        key = key.strip().lower()
        if not sep:
            continue
        if key == "model name" and name is None and value.strip():
            name = value.strip()
        elif key in ("flags", "features") and flags is None:
            flags = set(value.split())
    return name, flags


def _torch_capability() -> str:
    try:
        import torch

        return str(torch.backends.cpu.get_cpu_capability())
    except Exception:  # an old PyTorch without the call, or no PyTorch: the header still prints
        return "unknown"


def cpu_features(cpuinfo: str | os.PathLike | None = None) -> dict:
    """The CPU's model name, which of :data:`FLAGS` it has, PyTorch's CPU capability and the caps in force.

    ``cpuinfo``: the file to read (``/proc/cpuinfo`` by default). ``flags`` is None where the file is missing or
    unreadable (not Linux), else a dict flag -> bool; ``environment`` holds only the :data:`CPU_CAPS` that are set.
    """
    path = Path(cpuinfo) if cpuinfo is not None else CPUINFO
    try:
        name, flags = parse_cpuinfo(path.read_text(errors="replace"))
    except OSError:
        name, flags = None, None
    return {"model": name or platform.processor() or platform.machine() or "unknown",
            "machine": platform.machine(),
            "flags": None if flags is None else {f: f in flags for f in FLAGS},
            "cpu_capability": _torch_capability(),
            "environment": {k: os.environ[k] for k in CPU_CAPS if os.environ.get(k)}}


def describe_cpu(features: dict | None = None) -> str:
    """The report's header: the CPU, its vector extensions, PyTorch's choice of kernels and the caps set."""
    f = cpu_features() if features is None else features
    model = f["model"] + (f" ({f['machine']})" if f.get("machine") and f["machine"] not in f["model"] else "")
    if f["flags"] is None:
        extensions = "flags unknown (no /proc/cpuinfo)"
    else:
        extensions = ", ".join(f"{label} {'yes' if f['flags'][flag] else 'no'}" for flag, label in FLAGS.items())
    env = " ".join(f"{k}={v}" for k, v in f["environment"].items()) or "none set"
    return (f"CPU: {model}\n"
            f"vector extensions: {extensions}\n"
            f"PyTorch CPU capability: {f['cpu_capability']} (environment caps: {env})")
