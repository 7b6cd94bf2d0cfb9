"""The arithmetic canary: fingerprints of the operations the notebooks' printed numbers depend on.

    python tools/arithmetic_canary.py               print {operation: fingerprint} (JSON), under the arithmetic in force
    python tools/arithmetic_canary.py --check       under the checked runs' arithmetic, against the stored fingerprints
    python tools/arithmetic_canary.py --write       store the fingerprints made under the checked arithmetic
    python tools/arithmetic_canary.py --variations  what a caller's settings change, capped and uncapped

The notebooks' outputs are stored from one machine and compared digit for digit on every other, under the arithmetic
of ``tools/nbval_lanes.py`` (:data:`nbval_lanes.REPRODUCIBLE`), which caps every library that picks code for the CPU
it finds. If a new CPU type computes one of these operations differently anyway, a training run turns that last bit
into other printed losses after a few hundred steps, and nbval would fail half an hour later in a cell far from the
cause. The canary computes each operation once on fixed inputs (seconds in all), hashes the result's bytes (SHA-256,
16 hex digits) and compares with ``tests/arithmetic_fingerprints.json``: a mismatch names the operation, and the CPU's
name and flags are printed beside it. ``tests/test_arithmetic_canary.py`` runs it.

``--variations`` runs the canary in subprocesses whose callers set each dispatcher variable to another value (or unset
it): once through ``nbval_lanes.notebook_env`` (the checked run: every fingerprint must stay the stored one) and once
with the caller's value winning (which operations that variable steers on this CPU).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STORED = ROOT / "tests" / "arithmetic_fingerprints.json"
sys.path.insert(0, str(Path(__file__).resolve().parent))

#: What a caller might set: each dispatcher variable at another level than the checked runs' (or unset, None).
VARIATIONS = {
    "ONEDNN_MAX_CPU_ISA=AVX2": {"ONEDNN_MAX_CPU_ISA": "AVX2", "DNNL_MAX_CPU_ISA": "AVX2"},
    "ONEDNN_MAX_CPU_ISA=AVX512_CORE": {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE", "DNNL_MAX_CPU_ISA": "AVX512_CORE"},
    "ONEDNN_DEFAULT_FPMATH_MODE=BF16": {"ONEDNN_DEFAULT_FPMATH_MODE": "BF16"},
    "ATEN_CPU_CAPABILITY=avx2": {"ATEN_CPU_CAPABILITY": "avx2"},
    "MKL_ENABLE_INSTRUCTIONS=AVX2": {"MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "MKL_CBWR=AUTO": {"MKL_CBWR": "AUTO"},
    "MKL_NUM_THREADS=1": {"MKL_NUM_THREADS": "1"},
    "GLIBC_TUNABLES=(none)": {"GLIBC_TUNABLES": ""},
    "NPY_ENABLE_CPU_FEATURES=X86_V3": {"NPY_ENABLE_CPU_FEATURES": "X86_V3", "NPY_DISABLE_CPU_FEATURES": None},
    "all unset": "unset",
}


#: Operations whose last bits the CPU's maker defines, whatever the caps (MKL's float32 square root starts from the
#: RSQRTPS instruction: tools/nbval_lanes.py). They are fingerprinted to show it on a new CPU, but a difference fails
#: nothing: the notebooks keep them off every path they print (fused optimizers; ``make notebooks-other-sqrt`` checks
#: the stored outputs with another maker's square root).
MAKER_DEFINED = ("torch.sqrt (MKL's vector sqrt: RSQRTPS, then a Newton step)", "AdamW step, per tensor (torch.sqrt)")


def fingerprint(value) -> str:
    """The first 16 hex digits of the SHA-256 of a tensor's, array's or list of floats' bytes."""
    import numpy as np
    import torch

    if isinstance(value, torch.Tensor):
        value = value.detach().contiguous().cpu()
        data = (value.view(torch.int16) if value.dtype == torch.bfloat16 else value).numpy().tobytes()
    elif isinstance(value, np.ndarray):
        data = np.ascontiguousarray(value).tobytes()
    else:
        data = np.asarray(value, dtype=np.float64).tobytes()
    return hashlib.sha256(data).hexdigest()[:16]


def fingerprints() -> dict[str, str]:
    """{operation: fingerprint} for every operation below, in this process's arithmetic."""
    import numpy as np
    import torch
    import torch.nn.functional as F

    from groundup.generation import generate
    from groundup.linear import linear
    from groundup.models import GPT, GPTConfig
    from groundup.norms import RMSNorm
    from groundup.training import CHAPTER7_MODEL

    g = torch.Generator().manual_seed(0)
    ops = {"threads PyTorch starts with (a cell's own count)": [torch.get_num_threads()],
           "sum of a million numbers on those threads": torch.randn(1_000_000, generator=g).sum()}
    x = torch.randn(12, 64, 128, generator=g)  # chapter 7's batch: 12 windows of 64 positions, d_model 128
    w = torch.randn(512, 128, generator=g) / 11.3
    a = torch.randn(20_000, generator=g) * 4

    def grad_of(fn, inp):
        inp = inp.clone().requires_grad_(True)
        out = fn(inp)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        return torch.cat([out.detach().flatten(), inp.grad.flatten()])

    ops["random numbers (randn, rand, randint, multinomial)"] = torch.cat([
        torch.randn(1000, generator=g), torch.rand(1000, generator=g), torch.randint(0, 84, (1000,), generator=g),
        torch.multinomial(torch.softmax(a[:84], 0), 200, replacement=True, generator=g)])
    for threads in (2, 1):
        torch.set_num_threads(threads)
        ops[f"matrix product, {threads} thread(s)"] = x @ w.T
        ops[f"F.linear with bias, backward, {threads} thread(s)"] = grad_of(lambda t: F.linear(t, w, w[:, 0]), x)
        ops[f"batched matrix product, {threads} thread(s)"] = torch.bmm(x[:, :, :64], x[:, :, 64:].transpose(1, 2))
    torch.set_num_threads(2)
    ops["bfloat16 matrix product"] = x[:2].bfloat16() @ w.T.bfloat16()
    ops["LAPACK (torch.linalg.svdvals, qr)"] = torch.cat([torch.linalg.svdvals(w[:64, :32]),
                                                         torch.linalg.qr(w[:64, :32]).R.flatten()])
    big = torch.randn(1024, 512, generator=g)
    with torch.no_grad():
        ops["one-row linear (groundup.linear's blocked path)"] = linear(a[:512], big)
    ops["softmax, backward"] = grad_of(lambda t: torch.softmax(t, -1), x[:4])
    ops["log_softmax, backward"] = grad_of(lambda t: torch.log_softmax(t, -1), x[:4])
    ops["layer norm, backward"] = grad_of(lambda t: F.layer_norm(t, (128,), w[0], w[1]), x[:4])
    ops["RMS norm (groundup.norms), backward"] = grad_of(RMSNorm(128), x[:4])
    ops["GELU (erf), backward"] = grad_of(F.gelu, x[:4])
    ops["GELU (tanh), backward"] = grad_of(lambda t: F.gelu(t, approximate="tanh"), x[:4])
    ops["SiLU, backward"] = grad_of(F.silu, x[:4])
    ops["causal attention (F.scaled_dot_product_attention), backward"] = grad_of(
        lambda t: F.scaled_dot_product_attention(t, t.flip(-1), t * 0.5, is_causal=True), x[:2].view(2, 4, 64, 32))
    ops["cross-entropy, backward"] = grad_of(lambda t: F.cross_entropy(t.view(-1, 128), torch.arange(256) % 128),
                                            x[:4, :64])
    for name in ("exp", "log", "sin", "cos", "tanh", "erf", "rsqrt", "sigmoid"):
        ops[f"torch.{name}"] = getattr(torch, name)(a.abs() + 1e-3 if name in ("log", "rsqrt") else a)
    # MKL's vector sqrt starts from RSQRTPS, whose bits the CPU's maker defines (see tools/nbval_lanes.py)
    ops["torch.sqrt (MKL's vector sqrt: RSQRTPS, then a Newton step)"] = torch.sqrt(a.abs() + 1e-3)
    ops["torch.pow"] = torch.pow(a.abs(), 0.7)
    values = a.double().numpy()
    for name in ("exp", "log", "sin", "cos", "sqrt"):
        arg = np.abs(values) + 1e-3 if name in ("log", "sqrt") else values
        ops[f"numpy.{name}, float64"] = getattr(np, name)(arg)
        ops[f"numpy.{name}, float32"] = getattr(np, name)(arg.astype(np.float32))
    ops["math.exp, math.log, math.sin (libm)"] = [f(v) for v in values[:2000].tolist()
                                                   for f in (math.exp, lambda t: math.log(abs(t) + 1e-3), math.sin)]
    ops["AdamW step, fused (as groundup's train)"] = _adamw_step(torch.Generator().manual_seed(1), fused=True)
    ops["AdamW step, per tensor (torch.sqrt)"] = _adamw_step(torch.Generator().manual_seed(1), fused=False)

    # Chapter 7's model: three training steps on one thread with the fused AdamW groundup's train uses (as chapter 7
    # trains), then sampling with a KV cache.
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=84, **CHAPTER7_MODEL))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, fused=True)  # as train
    ids = torch.randint(0, 84, (12, 65), generator=g)
    losses = []
    for _ in range(3):
        _, loss = model(ids[:, :-1], ids[:, 1:])
        optimizer.zero_grad()
        loss.backward()
        if not losses:
            ops["chapter 7's GPT: gradients"] = torch.cat([p.grad.flatten() for p in model.parameters()])
        optimizer.step()
        losses.append(loss.detach())
    ops["chapter 7's GPT: losses of 3 AdamW steps"] = torch.stack(losses)
    ops["chapter 7's GPT: weights after 3 steps"] = torch.cat([p.detach().flatten() for p in model.parameters()])
    torch.set_num_threads(2)
    model.eval()
    ops["chapter 7's GPT: sampled tokens (KV cache)"] = generate(
        model, ids[:1, :8], 24, temperature=0.8, generator=torch.Generator().manual_seed(0))
    return {name: fingerprint(value) for name, value in ops.items()}


def _adamw_step(g, *, fused: bool):
    import torch

    p = torch.nn.Parameter(torch.randn(4096, generator=g))
    p.grad = torch.randn(4096, generator=g)
    optimizer = torch.optim.AdamW([p], lr=3e-3, weight_decay=0.1, fused=fused)
    optimizer.step()
    p.grad = torch.randn(4096, generator=g)
    optimizer.step()
    return p.detach()


def cpu_description() -> str:
    """The CPU's name and flags (from /proc/cpuinfo) and the libraries' versions, for a report."""
    import platform

    import numpy
    import torch
    from results_file import cpu_name_and_flags

    name, flags = cpu_name_and_flags()
    libc = " ".join(platform.libc_ver()) or "unknown"
    return (f"CPU: {name or 'unknown CPU'}\nflags: {' '.join(flags) or 'unknown'}\n"
            f"C library: {libc}; torch {torch.__version__}; numpy {numpy.__version__}")


def run_canary(env: dict[str, str], timeout: float = 300) -> dict[str, str]:
    """The fingerprints computed by a fresh process in ``env`` (this script without arguments)."""
    done = subprocess.run([sys.executable, __file__], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)
    if done.returncode:
        raise RuntimeError(f"the canary failed in its subprocess (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout)


def differences(found: dict[str, str], stored: dict[str, str], *, maker_defined: bool = False) -> list[str]:
    """The operations whose fingerprints differ from (or are missing in) the stored ones, in the canary's order: those
    the notebooks rely on, or with ``maker_defined`` those of :data:`MAKER_DEFINED`."""
    return [name for name in {**stored, **found}
            if found.get(name) != stored.get(name) and (name in MAKER_DEFINED) == maker_defined]


def report(found: dict[str, str], stored: dict[str, str]) -> str:
    """What differs, for a failure message: the operations by name, the CPU and the arithmetic in force."""
    from nbval_lanes import REPRODUCIBLE

    names = differences(found, stored)
    first = "the first is where to look: a later one may only inherit it, as a model computed from it does"
    lines = [f"{len(names)} of {len(stored) - len(MAKER_DEFINED)} operations compute other bits on this CPU than on "
             f"the machine the notebooks' outputs were stored on ({first}):"]
    lines += [f"  {name}: {found.get(name, 'missing')} here, {stored.get(name, 'missing')} stored" for name in names]
    lines += [maker_defined_note(found, stored)]
    lines += [cpu_description(), "arithmetic: " + " ".join(f"{k}={v}" for k, v in REPRODUCIBLE.items())]
    return "\n".join(lines)


def maker_defined_note(found: dict[str, str], stored: dict[str, str]) -> str:
    """One line on the operations of :data:`MAKER_DEFINED`: whether they differ here (no notebook relies on them)."""
    names = differences(found, stored, maker_defined=True)
    return (f"maker-defined, not relied on ({len(names)} of {len(MAKER_DEFINED)} differ here"
            + (f": {', '.join(names)}" if names else "") + "; see `make notebooks-other-sqrt`)")


def caller_env(variation) -> dict[str, str]:
    """This process's environment as a caller with ``variation`` would have it (dispatcher variables set, or unset)."""
    from nbval_lanes import REPRODUCIBLE, UNSET

    env = {k: v for k, v in os.environ.items() if k not in REPRODUCIBLE and k not in UNSET}
    if variation == "unset":
        return env
    env.update({k: v for k, v in variation.items() if v is not None})
    return {k: v for k, v in env.items() if variation.get(k, "") is not None}


def variations() -> int:
    """Print, per variation, whether the checked run keeps every stored fingerprint, and what it steers uncapped."""
    from nbval_lanes import REPRODUCIBLE, notebook_env

    stored = json.loads(STORED.read_text())
    print(cpu_description())
    status = 0
    for label, variation in VARIATIONS.items():
        caller = caller_env(variation)
        checked = differences(run_canary(notebook_env(environ=caller)), stored)
        uncapped = caller if variation == "unset" else {
            k: v for k, v in {**REPRODUCIBLE, **caller}.items() if variation.get(k, "") is not None}
        steered = differences(run_canary(uncapped), stored)
        status |= bool(checked)
        print(f"{label:34s} checked run: {'all stored' if not checked else 'DIFFERS: ' + ', '.join(checked)}; "
              f"the caller's value winning: {len(steered)} of {len(stored)} differ"
              + (f" ({', '.join(steered[:4])}{', ...' if len(steered) > 4 else ''})" if steered else ""),
              flush=True)
    return status


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--check", action="store_true", help="compare, under the checked arithmetic, with the stored")
    group.add_argument("--write", action="store_true", help="store the fingerprints of the checked arithmetic")
    group.add_argument("--variations", action="store_true", help="what a caller's settings change")
    args = parser.parse_args(argv)
    if not (args.check or args.write or args.variations):
        print(json.dumps(fingerprints(), indent=1))
        return 0
    if args.variations:
        return variations()
    from nbval_lanes import notebook_env

    found = run_canary(notebook_env())
    if args.write:
        from groundup.utils import atomic_write_text

        atomic_write_text(STORED, json.dumps(found, indent=1) + "\n")
        print(f"{len(found)} fingerprints stored in {STORED.relative_to(ROOT)}")
        return 0
    stored = json.loads(STORED.read_text())
    if differences(found, stored):
        print(report(found, stored), file=sys.stderr)
        return 1
    print(f"all {len(stored) - len(MAKER_DEFINED)} fingerprints the notebooks rely on as stored; "
          + maker_defined_note(found, stored))
    return 0


if __name__ == "__main__":
    sys.exit(main())
