"""Run the notebooks under nbval, and the unit tests, in two lanes at once, so that both cores of a small machine
stay busy.

    python tools/nbval_lanes.py [--lanes 1|2] [--unit "PYTEST-ARGS"] -- PYTEST-ARGS... [NOTEBOOK.ipynb ...]

With notebooks named after ``--``, only those run (in the same environment); without, every chapter does.
``--unit`` also runs ``python -m pytest`` with those arguments (the unit tests), in the caller's environment.

The notebooks that mention ``chapter7_model`` (chapters 7, 8, 9, 12, 13, 14) need chapter 7's trained GPT, which
:func:`groundup.training.chapter7_model` trains once (about 6.5 minutes on one thread, under the checked arithmetic
below) and caches; started before it is cached, each would train it again. So the work is a list of jobs taken by
two lanes, each lane taking the first job it may start whenever it is free:

1. the chapter 7 model (one thread; a second or two when it is cached already);
2. the unit tests (``--unit``), one pytest process on the other core, with one thread (``OMP_NUM_THREADS=1`` unless
   the caller set it): beside the model's one thread, a second would only contend for the model's core;
3. each notebook that does not need the model, one pytest process each (longest first: ``EXPECTED_SECONDS``);
4. each notebook that needs it, once job 1 has succeeded (longest first).

On a fresh machine lane 1 trains while lane 2 runs the unit tests, and then both share the notebooks: neither core
idles while the other works through a list fixed in advance. If the model cannot be trained, its notebooks are not
started (each would try again for minutes) and the run fails. A job's output goes to a file and is printed in full
when it ends, so two logs never interleave; the exit status is the first non-zero status of the jobs (0 when all
pass). ``--lanes 1`` runs the unit tests and then all notebooks in a single pytest process, its output streamed.

Two lanes run with ``OMP_WAIT_POLICY=PASSIVE`` (unless it is set already): PyTorch's OpenMP threads then sleep
when they run out of work instead of spinning. With two lanes of two-thread kernels on two cores, spinning threads
steal the cores from each other's work: a loop of small tensor operations (chapter 1's 84 x 84 table trained by
Adam) measured about 60x slower than alone, and about as fast as alone with the passive policy. The policy does
not change how work is split among threads, so every printed number stays what the stored outputs show.

Every notebook runs on one arithmetic that every x86-64 CPU the book runs on performs alike (:data:`REPRODUCIBLE`,
which overrides the caller's environment; ``tools/run_notebook.py`` and the results tools that call
``results_file.on_notebook_arithmetic`` use the same), because a
training run amplifies a difference in the last bit of one operation into different printed losses a few hundred
steps later. The floor is x86-64-v2 (SSE4.2): the book's pinned NumPy (2.4) is built for it and does not import on an
older CPU, so every machine that runs the notebooks has SSE4.1 and SSE4.2. Library by library, the code in the
notebooks' path that picks instructions for the CPU it finds at run time, and how each is held to one choice:

- PyTorch's own kernels (ATen) come in versions for AVX-512, AVX2 and plain x86-64 that differ in the last bits
  (chapter 10's sinusoidal embedding by up to 1.6e-6 between plain and vectorised; a layer norm by 4.8e-7 between
  AVX2 and AVX-512; then other losses and another greedy output after 400 steps). ``ATEN_CPU_CAPABILITY=default``
  takes the plain versions, compiled for the wheel's baseline, which every CPU that runs PyTorch has.
- Intel MKL does PyTorch's float32 matrix products, with a kernel per CPU, and the kernels add up in different
  orders (chapter 7's 60-step loop printed other losses in the third decimal on an AMD EPYC). ``MKL_CBWR=COMPATIBLE``
  is MKL's conditional numerical reproducibility mode for its BLAS and LAPACK: one SSE2 code path on Intel and
  AMD CPUs alike, at about half the throughput (its vector-math functions ignore it: next item).
  ``MKL_ENABLE_INSTRUCTIONS=SSE4_2`` caps the instruction set of MKL's other dispatch at x86-64-v2 (on this AMD CPU
  it changed no fingerprint: MKL already takes the same kernels under every setting); ``MKL_DYNAMIC=FALSE`` keeps
  its thread count, because the mode's results hold for one thread count. A caller's ``MKL_NUM_THREADS`` (and
  ``MKL_DOMAIN_*``) is removed: PyTorch sizes its OpenMP pool from MKL's count, so a process started with
  ``OMP_NUM_THREADS=1`` (chapter 11's torchrun workers) would otherwise compute on MKL's count of threads instead
  (measured: chapter 11's two processes then no longer equal one process accumulating two micro-batches bit for
  bit).
- MKL's vector-math functions (VML) compute PyTorch's float32 ``torch.sqrt`` (a debugger shows ``vmsSqrt``) and,
  through the same ATen file (``vml.h``), its ``exp``, ``log``, ``sin``, ``cos``, ``tanh`` and ``erf``. On this
  Zen 4 a debugger shows its "EX" kernels under every MKL setting, and QEMU's Haswell (which MKL sees as an Intel
  CPU), Nehalem and EPYC-Milan models compute every canary fingerprint as this CPU does but two. Those two are what
  no setting caps: the float32 square root of that kernel (and its log2, log10, tan, atan, asin, acos) starts from
  the RSQRTPS instruction and refines it with a Newton step, and RSQRTPS is an approximation whose exact bits each
  CPU maker defines (QEMU computes it exactly: 2,548 of 20,000 square roots then differ from this CPU's in the last
  bit). So the notebooks keep MKL's square root off every path a training run amplifies: their Adam and AdamW are
  the fused kernels (``fused=True``, as groundup's ``train``; a test refuses any other), whose square root is IEEE
  ``sqrtps`` on every CPU, and ``TokenEmbedding``'s RMS start divides by ``rsqrt`` (1 / IEEE square root). What still
  calls it (an RMS printed once, chapter 6's layer norms by hand, chapter 7's AdamW by hand) is tried with another
  maker's square root: ``make notebooks-other-sqrt`` runs the checked notebooks with every float32 ``sqrt``
  correctly rounded instead (``tools/other_sqrt``: it differs from this CPU's in the last bit of one result in six),
  and every stored output holds but the float32 differences of chapter 7's AdamW by hand, which print under
  ``nbval-ignore-output`` and assert their size. The canary fingerprints ``torch.sqrt`` and the per-tensor AdamW
  as maker-defined: reported, failing nothing.
- oneDNN computes PyTorch's float32 GELU, forward and backward (``ONEDNN_VERBOSE=1`` shows ``eltwise_gelu_erf``, and
  nothing else in chapter 7's training step), with code generated at run time for the best instruction set it finds:
  AVX-512 and AVX2 polynomials round differently (on a Zen 3 CPU, 42 cells of chapters 7-14 failed against outputs
  stored on a Zen 4). ``ONEDNN_MAX_CPU_ISA=SSE41`` caps it at its lowest level, SSE4.1, which x86-64-v2 includes
  (``DNNL_MAX_CPU_ISA``, the older name, is set alike); ``ONEDNN_DEFAULT_FPMATH_MODE=STRICT`` keeps float32 in
  float32 (a caller's ``BF16`` would let it compute in bfloat16). The generated code then uses the same SSE4.1
  instructions on every CPU. ONEDNN_VERBOSE shows no other oneDNN primitive in chapter 7's training step; the
  canary also fingerprints a bfloat16 matrix product, which oneDNN would take at a higher level.
- glibc's libm picks variants of expf, logf, powf, sinf, cosf, sin, cos, tan, atan, expm1, log2, exp2f and fma for
  CPUs with FMA, FMA4 or AVX2 (its ``ifunc`` resolvers; the resolved addresses change with the setting below), and
  NumPy's float64 exp on such a CPU differs from the plain one. ``GLIBC_TUNABLES=glibc.cpu.hwcaps=-AVX,-AVX2,-FMA,
  -FMA4,-AVX512F,-SSE4_1`` makes libm see a plain x86-64 CPU, so every CPU runs its SSE2 versions. (The caller's
  other glibc tunables are dropped for the checked run.) This holds for one glibc, Debian 12's 2.36, where the
  book's checks run: another release may choose among other variants, or compute some functions anew (glibc 2.41
  made several float functions correctly rounded), and the canary's report names the C library beside the CPU.
- NumPy dispatches its float32 log, sin and exp and float64 log to AVX2 (X86_V3) and AVX-512 (X86_V4) versions that
  differ in the last bits (measured: three of five functions). ``NPY_DISABLE_CPU_FEATURES`` turns off every target
  the pinned NumPy dispatches to (``numpy._core._multiarray_umath.__cpu_dispatch__``; a test checks the list), leaving
  its baseline, x86-64-v2; ``NPY_ENABLE_CPU_FEATURES`` is removed from the environment (NumPy refuses both at once).
  NumPy's own BLAS (OpenBLAS, which also dispatches per CPU) is not on the notebooks' path: no notebook multiplies
  NumPy matrices. The machine's OPENBLAS_* settings are left as they are.
- OpenMP: how a reduction is split among threads changes its sums, so ``OMP_NUM_THREADS=2`` (training cells use one
  thread, ``groundup.utils.threads``), ``OMP_DYNAMIC=FALSE`` (the runtime may not hand out fewer threads) and no
  ``OMP_THREAD_LIMIT`` (it would cap the teams while PyTorch still counts two threads). PyTorch
  splits loops statically by the thread count (``at::parallel_for``), so the schedule does not depend on the CPU.
- Python's ``math`` and ``random``, the tokenizers (integer work) and Matplotlib (its PNGs are not compared) call
  nothing else that dispatches on the CPU in a printed number's path.

The canary test (``tests/test_arithmetic_canary.py``, ``tools/arithmetic_canary.py``) fingerprints the operations the
notebooks use under this arithmetic, compares them with fingerprints stored in the repository and names the first
that differs, so a new CPU type fails in seconds; it also checks that a caller's own values of these variables change
nothing. The package, the benchmarks and the unit tests run on the machine's fastest kernels; only the checked
notebook runs pay for this.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
MARKER = "chapter7_model"
#: The arithmetic of the checked runs, less their thread count (see above; the results tools use this with their own).
ARITHMETIC = {
    "ATEN_CPU_CAPABILITY": "default",
    "MKL_CBWR": "COMPATIBLE", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2", "MKL_DYNAMIC": "FALSE",
    "ONEDNN_MAX_CPU_ISA": "SSE41", "DNNL_MAX_CPU_ISA": "SSE41", "ONEDNN_DEFAULT_FPMATH_MODE": "STRICT",
    "GLIBC_TUNABLES": "glibc.cpu.hwcaps=-AVX,-AVX2,-FMA,-FMA4,-AVX512F,-SSE4_1",
    "NPY_DISABLE_CPU_FEATURES": "X86_V3 X86_V4 AVX512_ICL AVX512_SPR",
    "OMP_DYNAMIC": "FALSE",
}
#: Their threads: two for every cell (a training cell sets one itself).
THREADS = {"OMP_NUM_THREADS": "2"}
REPRODUCIBLE = {**ARITHMETIC, **THREADS}
#: Variables a checked run must not see: NumPy refuses NPY_ENABLE_CPU_FEATURES beside NPY_DISABLE_CPU_FEATURES;
#: MKL_NUM_THREADS and MKL_DOMAIN_* would size PyTorch's threads instead of OMP_NUM_THREADS, OMP_THREAD_LIMIT would cap
#: the teams below it (see above); the VERBOSE switches print into the cells' outputs.
UNSET = ("NPY_ENABLE_CPU_FEATURES", "MKL_NUM_THREADS", "MKL_DOMAIN_NUM_THREADS", "MKL_DOMAIN_ALL", "MKL_DOMAIN_BLAS",
         "MKL_DOMAIN_VML", "OMP_THREAD_LIMIT", "MKL_VERBOSE", "ONEDNN_VERBOSE", "DNNL_VERBOSE")
# Checked runs give an exercise checker 60 s before they call the reader's code stuck (readers keep the 10 s of
# groundup.exercises.checking.DEFAULT_TIMEOUT): the verdict of a correct solution must not depend on how busy or
# slow the machine is (a 10x slower virtual machine, or two lanes on two cores). No stored output prints the bound.
CHECKED = {"GROUNDUP_CHECK_TIMEOUT": "60"}
#: A hang guard for one job of a two-lane run (the chapter 7 model trains in about 400 s on a healthy 2-core machine).
JOB_TIMEOUT = 3600


def notebook_env(environ=None, **extra: str) -> dict[str, str]:
    """The environment notebooks run in: this process's (or ``environ``), with :data:`CHECKED` and ``extra`` as
    defaults, and :data:`REPRODUCIBLE` always, :data:`UNSET` removed (the stored outputs were made on that
    arithmetic; another prints other numbers)."""
    env = {**CHECKED, **extra, **(os.environ if environ is None else environ), **REPRODUCIBLE}
    return {k: v for k, v in env.items() if k not in UNSET}


#: Seconds each notebook took under nbval in a fresh-clone ``make test`` (2026-11-29, AMD EPYC, two lanes). Only
#: their order matters: each lane takes the longest job it may start first, so that no long notebook starts last
#: while the other lane idles (the run measured 838 s with name order, the last job chapter 12's 173 s).
EXPECTED_SECONDS = {"12_pretrained.ipynb": 173, "09_masked_language_models.ipynb": 127,
                    "11_scaling_out.ipynb": 107, "10_encoder_decoder.ipynb": 96, "13_fine_tuning.ipynb": 105,
                    "07_training.ipynb": 60, "07_training_further.ipynb": 40, "08_generation.ipynb": 117,
                    "06_transformer_block.ipynb": 58,
                    "03_embeddings.ipynb": 33, "14_inside_the_transformer.ipynb": 32, "02_tokenization.ipynb": 23,
                    "05_attention.ipynb": 22, "04_positional_encoding.ipynb": 15, "01_language_models.ipynb": 13}


def lanes(notebooks: list[Path]) -> tuple[list[Path], list[Path]]:
    """(the chapter 7 model's notebooks, the others), each longest first by ``EXPECTED_SECONDS`` (then name order,
    which is the order of notebooks not in the table); the first of the former trains it."""
    notebooks = sorted(notebooks, key=lambda p: (-EXPECTED_SECONDS.get(p.name, 0), p.name))
    first = [p for p in notebooks if MARKER in p.read_text(encoding="utf-8")]
    return first, [p for p in notebooks if p not in first]


class Job:
    """One process of the run: its name, command, environment and (optionally) the job it waits for."""

    def __init__(self, name: str, command: list[str], env: dict[str, str], after: Job | None = None):
        self.name, self.command, self.env, self.after = name, command, env, after
        self.code: int | None = None  # the exit status, once it has ended

    def ready(self) -> bool:
        return self.after is None or self.after.code is not None


def train_model_command() -> list[str]:
    """The command that trains (or finds cached) chapter 7's model under the environment it is given."""
    return [sys.executable, "-c", "from groundup.training import chapter7_model; chapter7_model()"]


def _run_jobs(jobs: list[Job], log_dir: str, lanes: int = 2, timeout: float = JOB_TIMEOUT) -> int:
    """Run ``jobs`` in ``lanes`` lanes, each taking the first job it may start (see the module's docstring). A job
    runs in a process group of its own (a notebook's kernel and chapter 11's torchrun workers included), which is
    killed when the job outlives ``timeout`` seconds or the run ends early."""
    pending, lock, changed = list(jobs), threading.Lock(), threading.Condition()
    processes, stopped = [], []
    start = time.perf_counter()

    def take() -> Job | None:
        with changed:
            while True:
                if stopped or not pending:
                    return None
                job = next((j for j in pending if j.ready()), None)
                if job is not None:
                    pending.remove(job)
                    return job
                changed.wait()

    def report(text: str) -> None:
        with lock:
            sys.stdout.write(text)
            sys.stdout.flush()

    def run(job: Job) -> None:
        if job.after is not None and job.after.code != 0:
            job.code = 1
            report(f"\n----- {job.name}: not started, because {job.after.name} failed -----\n")
            return
        began = time.perf_counter()
        with Path(log_dir, f"job{jobs.index(job)}.log").open("w+", encoding="utf-8", errors="replace") as log:
            with lock:
                if stopped:
                    return
                process = subprocess.Popen(job.command, cwd=ROOT, env=job.env, stdout=log, stderr=subprocess.STDOUT,
                                           start_new_session=True)
                processes.append(process)
            try:
                job.code = process.wait(timeout=timeout)
                note = ""
            except subprocess.TimeoutExpired:
                _kill_group(process)
                job.code, note = 124, f"stopped after {timeout:.0f} s: "
            log.seek(0)
            text = log.read()
        report(f"\n{'=' * 20} {job.name}: {note}exit {job.code} after {time.perf_counter() - began:.0f} s "
                    f"(at {time.perf_counter() - start:.0f} s) {'=' * 20}\n{text}")

    def lane() -> None:
        while (job := take()) is not None:
            try:
                run(job)
            except BaseException as error:  # the lane's own failure (the process not started): report it
                job.code = job.code or 1
                report(f"\n{job.name}: the lane failed: {error!r}\n")
            finally:
                with changed:
                    changed.notify_all()

    print("jobs, in the order the lanes take them: " + "; ".join(j.name for j in jobs), flush=True)
    threads = [threading.Thread(target=lane, daemon=True) for _ in range(lanes)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        with changed:
            stopped.append(True)
            changed.notify_all()
        with lock:
            for process in processes:
                _kill_group(process)
    missed = [job.name for job in jobs if job.code is None]
    if missed:
        print(f"\nnot run: {', '.join(missed)}", flush=True)
    print(f"\nall jobs ended after {time.perf_counter() - start:.0f} s", flush=True)
    return next((1 if job.code is None else job.code for job in jobs if job.code != 0), 0)


def _kill_group(process: subprocess.Popen) -> None:
    """Kill ``process``'s whole process group (started with ``start_new_session``), if anything of it is left."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    process.poll()


def jobs_for(notebooks: list[Path], pytest_args: list[str], unit_args: list[str] | None) -> list[Job]:
    """The jobs of a two-lane run, in the order the lanes take them (see the module's docstring)."""
    env = notebook_env(OMP_WAIT_POLICY="PASSIVE")
    model, others = lanes(notebooks)
    jobs, trained = [], None
    if model:
        trained = Job("the chapter 7 model", train_model_command(), env)
        jobs.append(trained)
    if unit_args is not None:
        jobs.append(Job("unit tests", [sys.executable, "-m", "pytest", *unit_args],
                        {"OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": "1", **os.environ}))
    command = [sys.executable, "-m", "pytest", *pytest_args]
    jobs += [Job(p.name, [*command, str(p)], env) for p in others]
    jobs += [Job(p.name, [*command, str(p)], env, after=trained) for p in model]
    return jobs


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lanes", type=int, choices=(1, 2), default=2)
    parser.add_argument("--unit", metavar="PYTEST-ARGS", help="also run the unit tests: pytest with these arguments")
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
    try:
        unit_args = shlex.split(args.unit) if args.unit is not None else None
    except ValueError as err:
        parser.error(f"--unit {args.unit!r}: {err}")
    if args.lanes == 1:
        unit = subprocess.call([sys.executable, "-m", "pytest", *unit_args], cwd=ROOT) if unit_args is not None else 0
        notebooks_status = subprocess.call([sys.executable, "-m", "pytest", *pytest_args, *map(str, notebooks)],
                                           cwd=ROOT, env=notebook_env())
        return unit or notebooks_status
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))  # so the jobs' groups are killed
    with tempfile.TemporaryDirectory(prefix="nbval-lanes-") as tmp:
        return _run_jobs(jobs_for(notebooks, pytest_args, unit_args), tmp)


if __name__ == "__main__":
    sys.exit(main())
