"""Run the notebooks under nbval in two lanes at once, so that both cores of a small machine stay busy.

    python tools/nbval_lanes.py [--lanes 1|2] -- PYTEST-ARGS... [NOTEBOOK.ipynb ...]

With notebooks named after ``--``, only those run (in the same environment); without, every chapter does.

Chapter 7 trains the chapter 7 model and caches it; the later notebooks that load it (their source mentions
``chapter7_model``) must start only after chapter 7 has ended, or each would train the model again. So lane 1
starts with chapter 7 (the first notebook, in name order, that mentions the model) while lane 2 runs every notebook
that does not need the model, in one pytest process. When chapter 7 has ended, each lane takes the model's other
notebooks one at a time from a shared queue (name order) as it becomes free: neither core idles while the other
works through a list fixed in advance (chapter 7 alone takes longer than all the notebooks without the model).
Each notebook, or group, is one pytest process (``python -m pytest PYTEST-ARGS... NOTEBOOKS``); a lane's output
goes to a file and is printed in full when the lane ends, so the two logs never interleave. The exit status is the
first non-zero status of the lanes' processes (0 when all pass). ``--lanes 1`` runs all notebooks in a single
pytest process with its output streamed as usual.

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
import threading
import time
from collections import deque
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
    """(the chapter 7 model's notebooks, the others), each in name order; the first of the former trains it."""
    first = [p for p in notebooks if MARKER in p.read_text(encoding="utf-8")]
    return first, [p for p in notebooks if p not in first]


def _run_lanes(command: list[str], model: list[Path], others: list[Path], log_dir: str) -> int:
    """Lane 1: ``model[0]``; lane 2: ``others``; then both lanes share the queue ``model[1:]``."""
    env = notebook_env(OMP_WAIT_POLICY="PASSIVE")
    queue, lock, trained = deque(model[1:]), threading.Lock(), threading.Event()
    processes, codes, stopped = [], [], []

    def run(group: list[Path], log) -> None:
        log.write(f"\n----- {' '.join(p.name for p in group)} -----\n")
        log.flush()
        start = time.perf_counter()
        with lock:
            if stopped:
                return
            process = subprocess.Popen([*command, *map(str, group)], cwd=ROOT, env=env, stdout=log,
                                       stderr=subprocess.STDOUT)
            processes.append(process)
        code = process.wait()
        log.write(f"----- exit {code} after {time.perf_counter() - start:.0f} s -----\n")
        codes.append(code)

    def lane(own: list[Path], log, trains: bool) -> None:
        try:
            try:
                if own:
                    run(own, log)
            finally:
                if trains:
                    trained.set()
            trained.wait()
            while True:
                with lock:
                    if not queue:
                        return
                    notebook = queue.popleft()
                run([notebook], log)
        except BaseException as error:  # the lane's own failure (pytest not started): report it, fail the run
            codes.append(1)
            log.write(f"\nthe lane failed: {error!r}\n")

    print(f"lane 1: {model[0].name}", flush=True)
    print(f"lane 2: {' '.join(p.name for p in others)}", flush=True)
    if queue:
        print(f"then whichever lane is free: {' '.join(p.name for p in queue)}", flush=True)
    logs = [Path(log_dir, f"lane{i}.log").open("w+", encoding="utf-8") for i in (1, 2)]
    threads = [threading.Thread(target=lane, args=(own, log, i == 0), daemon=True)
               for i, (own, log) in enumerate(zip(([model[0]], others), logs))]
    start = time.perf_counter()
    try:
        for thread in threads:
            thread.start()
        for i, (thread, log) in enumerate(zip(threads, logs), 1):
            thread.join()
            log.seek(0)
            print(f"\n{'=' * 30} lane {i}: ended after {time.perf_counter() - start:.0f} s {'=' * 30}", flush=True)
            sys.stdout.write(log.read())
            sys.stdout.flush()
    finally:
        with lock:
            stopped.append(True)
            queue.clear()
            for process in processes:
                if process.poll() is None:
                    process.kill()
        for log in logs:
            log.close()
    return next((code for code in codes if code), 0)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lanes", type=int, choices=(1, 2), default=2)
    parser.add_argument("pytest_args", nargs=argparse.REMAINDER, help="after --: arguments for pytest")
    args = parser.parse_args(argv)
    pytest_args = args.pytest_args[1:] if args.pytest_args[:1] == ["--"] else args.pytest_args
    named = [a for a in pytest_args if a.endswith(".ipynb")]  # notebooks named on the command line: only those
    pytest_args = [a for a in pytest_args if a not in named]
    missing = [a for a in named if not Path(a).is_file()]
    if missing:
        print(f"no such notebook: {', '.join(missing)}", file=sys.stderr)
        return 2
    notebooks = sorted(Path(a).resolve() for a in named) or sorted(NOTEBOOKS.glob("*.ipynb"))
    if not notebooks:
        print(f"no notebooks in {NOTEBOOKS}", file=sys.stderr)
        return 2
    command = [sys.executable, "-m", "pytest", *pytest_args]
    model, others = lanes(notebooks)
    if args.lanes == 1 or not model or not others:
        return subprocess.call([*command, *map(str, notebooks)], cwd=ROOT, env=notebook_env())
    with tempfile.TemporaryDirectory(prefix="nbval-lanes-") as tmp:
        return _run_lanes(command, model, others, tmp)


if __name__ == "__main__":
    sys.exit(main())
