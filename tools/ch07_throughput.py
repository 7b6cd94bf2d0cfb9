"""Chapter 7's training step in tokens per second and model FLOPs utilisation, eager and under ``torch.compile``;
stored in src/groundup/results/chapter07.json under "throughput" (key ``chapter7_step``).

    python tools/ch07_throughput.py                          # 1 and 2 threads, 20 alternating steps a side
    python tools/ch07_throughput.py --threads 1 --steps 20   # one thread only
    python tools/ch07_throughput.py --smoke                  # 2 steps, one thread, nothing stored

The model and step are chapter 7's (``CHAPTER7_MODEL`` with the corpus's 84 characters, 0.80 M parameters;
``CHAPTER7_TRAINING``'s batch of 12 windows of 64 characters, fused AdamW, clipping at 1) on a fixed random batch,
measured by :func:`groundup.bench.throughput.measure_throughput` on the device
:func:`groundup.utils.default_device` chooses: for each thread count, the matmul peak (before and after), the eager
and the compiled step (compiled once, in a fresh compiler cache; then ``--warmup`` untimed and ``--steps`` timed
steps a side, alternating), their medians and quartiles, tokens/s, achieved GFLOP/s and MFU, the compile time and
the per-step ratio eager / compiled. The entry also stores the FLOP count by formula and by ``FlopCounterMode`` and
the graph breaks ``torch._dynamo.explain`` finds (:func:`groundup.bench.throughput.model_graph_breaks`).

Timings, on the machine's fastest kernels: unlike the tools whose numbers a notebook prints as its own, this one
does not switch to the notebooks' arithmetic (MKL's reproducible code path, PyTorch's plain x86-64 kernels), which
would measure a slower machine than a reader has. ``machine()`` records what was in force. Run it on a quiet
machine: the load averages at the start and the end are stored too.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from results_file import add_entry, machine

from groundup.bench.throughput import CHAPTER7_BATCH, chapter7_config, measure_throughput, model_graph_breaks
from groundup.training import CHAPTER7_MODEL

OUT = Path(__file__).resolve().parents[1] / "src" / "groundup" / "results" / "chapter07.json"
SECTION, KEY = "throughput", "chapter7_step"
STEPS, WARMUP, THREADS = 20, 3, (1, 2)
FORMULA = ("FLOPs per token = 6 N + 12 n_L n_C d_attn: N the entries of every matrix a product multiplies by "
           "(W_Q, W_K, W_V, W_O, the FFN's two matrices per layer, the tied unembedding once), n_C the window, "
           "d_attn = n_H d_head; matrix products only, the attention square counted whole (no causal saving)")


def rounded(x, digits: int = 6):
    """``x`` (a number, or a dict or list of them) with floats rounded to ``digits`` significant digits."""
    if isinstance(x, float):
        return float(f"{x:.{digits}g}")
    if isinstance(x, dict):
        return {k: rounded(v, digits) for k, v in x.items()}
    if isinstance(x, list):
        return [rounded(v, digits) for v in x]
    return x


def load() -> list[float]:
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except OSError:
        return []


def entry(thread_counts, steps: int, warmup: int, compile: bool = True) -> dict:
    """Measure chapter 7's step at each thread count; the entry to store."""
    config = chapter7_config()
    result = {"machine": machine(), "model": {**CHAPTER7_MODEL, "vocab_size": config.vocab_size},
              "batch_size": CHAPTER7_BATCH, "steps": steps, "warmup": warmup, "formula": FORMULA,
              "load_average_start": load(), "runs": {}}
    for n in thread_counts:
        start = time.perf_counter()
        r = measure_throughput(config, CHAPTER7_BATCH, steps=steps, warmup=warmup, compile=compile, n_threads=n)
        r["wall_seconds"] = time.perf_counter() - start
        result["runs"][f"{n} thread{'s' if n > 1 else ''}"] = rounded(r)
        line = {side: f"{r[side]['seconds_per_step']['median'] * 1e3:.1f} ms, {r[side]['tokens_per_second']:,.0f} "
                      f"tokens/s, MFU {r[side]['mfu']:.0%}" for side in ("eager", "compiled") if side in r}
        print(f"{n} thread(s): peak {r['matmul_peak_gflops']:.1f} GFLOP/s; {line}; "
              f"compile {r.get('compile_seconds', 0):.0f} s; eager/compiled {r.get('eager_over_compiled')}", flush=True)
    result["graph_breaks"] = model_graph_breaks(config, CHAPTER7_BATCH)
    result["load_average_end"] = load()
    return result


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, nargs="+", default=list(THREADS), help="thread counts (default: 1 2)")
    p.add_argument("--steps", type=int, default=STEPS, help="timed steps per side, alternating")
    p.add_argument("--warmup", type=int, default=WARMUP, help="untimed steps per side first")
    p.add_argument("--smoke", action="store_true", help="2 steps, 1 warm-up, one thread, nothing stored")
    a = p.parse_args(argv)
    if a.smoke:
        print(entry([1], 2, 1))
        return
    start = time.perf_counter()
    result = entry(a.threads, a.steps, a.warmup)
    env = " ".join(f"{k}={os.environ[k]}" for k in ("MKL_CBWR", "ATEN_CPU_CAPABILITY", "OMP_NUM_THREADS")
                   if k in os.environ)
    args = " ".join(sys.argv[1:]) if argv is None else " ".join(argv)
    result["command"] = f"{env} python tools/ch07_throughput.py {args}".strip()
    result["wall_seconds"] = round(time.perf_counter() - start, 1)
    add_entry(OUT, KEY, result, section=SECTION)
    print(f"stored {KEY} in {OUT} (section {SECTION!r}) after {result['wall_seconds']} s")


if __name__ == "__main__":
    main()
