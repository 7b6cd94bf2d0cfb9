"""Run the notebooks under nbval in two lanes at once, so that both cores of a small machine stay busy.

    python tools/nbval_lanes.py [--lanes 1|2] -- PYTEST-ARGS...

Lane 1 holds the notebooks that train or load the chapter 7 model (their source mentions ``chapter7_model``):
chapter 7 trains and caches it, later chapters load the cache, so they must run one after another, in order,
and they run their long cells on one thread. Lane 2 holds every other notebook. Each lane is one pytest process
(``python -m pytest PYTEST-ARGS... NOTEBOOKS``); its output goes to a file and is printed in full when the lane
ends, so the two logs never interleave. The exit status is the first non-zero status of the lanes (0 when both
pass). ``--lanes 1`` runs all notebooks in a single pytest process with its output streamed as usual.

Two lanes run with ``OMP_WAIT_POLICY=PASSIVE`` (unless it is set already): PyTorch's OpenMP threads then sleep
when they run out of work instead of spinning. With two lanes of two-thread kernels on two cores, spinning threads
steal the cores from each other's work: a loop of small tensor operations (chapter 1's 84 x 84 table trained by
Adam) measured about 60x slower than alone, and about as fast as alone with the passive policy. The policy does
not change how work is split among threads, so every printed number stays what the stored outputs show.

Every notebook runs on one arithmetic that every x86-64 CPU performs alike (:data:`REPRODUCIBLE`, which overrides
the caller's environment; ``tools/run_notebook.py`` uses the same when it stores outputs), because a training run
amplifies a difference in the last bit of one operation into different printed losses a few hundred steps later:
- ``MKL_CBWR=COMPATIBLE``: PyTorch's float32 matrix products go through Intel MKL, which picks a kernel for the CPU
  it finds, and the kernels add up in different orders (without this setting, chapter 7's 60-step loop printed
  other losses in the third decimal on an AMD EPYC than on the machine its outputs were made on). MKL's conditional
  numerical reproducibility mode takes one code path on every x86-64 CPU, at about half the matmul throughput.
- ``ATEN_CPU_CAPABILITY=default``: PyTorch's own kernels come in versions for AVX-512, AVX2 and plain x86-64, and
  they differ in the last bits. Measured here on one forward and backward pass of chapter 10's encoder-decoder: the
  sinusoidal embedding (sin, cos, exp) differs between the plain and the vectorised kernels by up to 1.6e-6, a
  layer norm's output between AVX2 and AVX-512 by up to 4.8e-7; chapter 10's 400 training steps then end at other
  losses (final 0.0018 vs the stored 0.0021) and another greedy output. The plain x86-64 kernels run on every CPU.
- ``OMP_NUM_THREADS=2``: how a reduction is split among threads changes its sums too, so the number of threads is
  fixed rather than taken from the machine's core count (training cells use one thread, ``groundup.utils.threads``).
The package, the benchmarks and the unit tests run on the machine's fastest kernels; only the checked notebook runs
pay for this.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
MARKER = "chapter7_model"
REPRODUCIBLE = {"MKL_CBWR": "COMPATIBLE", "ATEN_CPU_CAPABILITY": "default", "OMP_NUM_THREADS": "2"}  # see above
# Checked runs give an exercise checker 60 s before they call the reader's code stuck (readers keep the 10 s of
# groundup.exercises.checking.DEFAULT_TIMEOUT): the verdict of a correct solution must not depend on how busy or
# slow the machine is (a 10x slower virtual machine, or two lanes on two cores). No stored output prints the bound.
CHECKED = {"GROUNDUP_CHECK_TIMEOUT": "60"}


def notebook_env(**extra: str) -> dict[str, str]:
    """The environment notebooks run in: this process's, with :data:`CHECKED` and ``extra`` as defaults, and
    :data:`REPRODUCIBLE` always (the stored outputs were made on that arithmetic; another prints other numbers)."""
    return {**CHECKED, **extra, **os.environ, **REPRODUCIBLE}


def lanes(notebooks: list[Path]) -> tuple[list[Path], list[Path]]:
    """(the chapter 7 model's notebooks, the others), each in name order."""
    first = [p for p in notebooks if MARKER in p.read_text(encoding="utf-8")]
    return first, [p for p in notebooks if p not in first]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lanes", type=int, choices=(1, 2), default=2)
    parser.add_argument("pytest_args", nargs=argparse.REMAINDER, help="after --: arguments for pytest")
    args = parser.parse_args(argv)
    pytest_args = args.pytest_args[1:] if args.pytest_args[:1] == ["--"] else args.pytest_args
    notebooks = sorted(NOTEBOOKS.glob("*.ipynb"))
    if not notebooks:
        print(f"no notebooks in {NOTEBOOKS}", file=sys.stderr)
        return 2
    command = [sys.executable, "-m", "pytest", *pytest_args]
    groups = [g for g in lanes(notebooks) if g] if args.lanes == 2 else [notebooks]
    if len(groups) == 1:
        return subprocess.call([*command, *map(str, groups[0])], cwd=ROOT, env=notebook_env())
    env = notebook_env(OMP_WAIT_POLICY="PASSIVE")
    with tempfile.TemporaryDirectory(prefix="nbval-lanes-") as tmp:
        runs = []
        for i, group in enumerate(groups, 1):
            log = Path(tmp, f"lane{i}.log").open("w+", encoding="utf-8")
            print(f"lane {i}: {' '.join(p.name for p in group)}", flush=True)
            runs.append((i, log, time.perf_counter(), subprocess.Popen([*command, *map(str, group)], cwd=ROOT, env=env,
                                                                      stdout=log, stderr=subprocess.STDOUT)))
        status = 0
        try:
            for i, log, start, process in runs:
                code = process.wait()
                seconds = time.perf_counter() - start
                log.seek(0)
                print(f"\n{'=' * 30} lane {i}: exit {code} after {seconds:.0f} s {'=' * 30}", flush=True)
                sys.stdout.write(log.read())
                sys.stdout.flush()
                status = status or code
        finally:
            for _, log, _, process in runs:
                if process.poll() is None:
                    process.kill()
                log.close()
    return status


if __name__ == "__main__":
    sys.exit(main())
