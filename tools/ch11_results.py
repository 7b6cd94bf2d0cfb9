"""Chapter 11's measurements: what data parallelism buys on this CPU, and how far a resumed run drifts; stored in
src/groundup/results/chapter11.json under "runs".

    OMP_NUM_THREADS=1 python tools/ch11_results.py --entry dp-speed     # step times, 1x1 / 1x2 threads vs 2x1
    MKL_CBWR=COMPATIBLE ATEN_CPU_CAPABILITY=default OMP_NUM_THREADS=1 \\
        python tools/ch11_results.py --entry drift                      # 600 steps: 2 processes, resumed on 1

Both use the chapter's setting: the first million characters of the Shakespeare corpus (90 % training), chapter
7's GPT (``CHAPTER7_MODEL``), batches of 12 windows, AdamW at 3e-3.

``dp-speed`` times one training step (forward, backward, gradient clipping, AdamW) three ways, on the same global
batch of 12: one process on one thread, one process on two threads (this tool's own process), and two processes of
one thread each with ``DistributedDataParallel`` over gloo (6 rows each; started by torchrun, as the chapter does).
The sides alternate round by round (the order turns over every round), each round timing ``STEPS`` steps after
``WARMUP`` untimed ones inside the processes, so the processes' start-up is not counted; the entry stores every
round's median step time, the median ratios with quartiles (``groundup.bench.ratio_quartiles``) and the load
averages at start and end, because the machine may be shared.

``drift`` trains for ``DRIFT_STEPS`` steps (warm-up 20, cosine to a tenth) four ways: two processes uninterrupted
(their checkpoint of step ``RESUME_AT`` is kept); that checkpoint resumed on one process on the whole batch (the
micro-batches change, so the sums are rounded differently); one process on the whole batch from the start; and one
process with another seed (initial weights and batches), the yardstick for "a different training". It stores the
largest parameter differences, the training and validation losses along the way and each run's loss on the whole
validation text. All on one thread per process.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from results_file import add_entry, machine

from groundup.bench import ratio_quartiles
from groundup.data import get_batch, load_corpus, train_val_split
from groundup.models import GPT, GPTConfig
from groundup.tokenizers import CharTokenizer
from groundup.training import CHAPTER7_MODEL, TrainConfig, evaluate, load_checkpoint, train
from groundup.utils import threads

OUT = Path(__file__).resolve().parents[1] / "src" / "groundup" / "results" / "chapter11.json"
HEADER = {"about": "Chapter 11: data parallelism timed on this CPU, and a 2-process run resumed on 1 process against "
                   "uninterrupted runs (tools/ch11_results.py)"}
CHARS, BATCH, LR = 1_000_000, 12, 3e-3
ROUNDS, WARMUP, STEPS = 7, 2, 5
DRIFT_STEPS, RESUME_AT, EVAL_INTERVAL, EVAL_BATCHES = 600, 300, 100, 20
SMOKE = 1  # --smoke: every length divided by 50, to check the tool runs (nothing stored)
SIDES = ("1 process x 1 thread", "1 process x 2 threads", "2 processes x 1 thread")
ENTRIES = ("dp-speed", "drift")


def chapter_data():
    """The chapter's text, tokenizer and 90/10 split."""
    text = load_corpus("shakespeare")[:CHARS]
    tokenizer = CharTokenizer.from_text(text)
    train_ids, val_ids = train_val_split(torch.tensor(tokenizer.encode(text)), val_fraction=0.1)
    return tokenizer.vocab_size, train_ids, val_ids


def new_model(vocab_size: int, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=vocab_size, **CHAPTER7_MODEL))


def drift_config(seed: int = 0, **kw) -> TrainConfig:
    return TrainConfig(batch_size=BATCH, max_steps=DRIFT_STEPS // SMOKE, learning_rate=LR, warmup_steps=20,
                       optimizer="adamw", eval_interval=EVAL_INTERVAL // SMOKE, eval_batches=EVAL_BATCHES, seed=seed,
                       progress=False, **kw)


def step_times(model, optimizer, x, y) -> list[float]:
    """Seconds of each of ``STEPS`` training steps after ``WARMUP`` untimed ones."""
    times = []
    for i in range(WARMUP + STEPS):
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        model(x, y)[1].backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if i >= WARMUP:
            times.append(time.perf_counter() - start)
    return times


def batch(train_ids):
    return get_batch(train_ids, BATCH, CHAPTER7_MODEL["context_length"], generator=torch.Generator().manual_seed(0))


# ---- the two processes' side (run by torchrun) ----------------------------------------------------------------


def worker(kind: str, folder: Path) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    vocab_size, train_ids, val_ids = chapter_data()
    model = new_model(vocab_size)
    if kind == "speed":
        x, y = batch(train_ids)
        mine = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
        ddp = DistributedDataParallel(model, forward_sync_buffers=False)
        times = step_times(ddp, torch.optim.AdamW(model.parameters(), lr=LR), x[mine], y[mine])
        if rank == 0:
            print(json.dumps({"step_s": times}), flush=True)
    else:
        def keep(step, _model):
            if step == RESUME_AT // SMOKE:
                shutil.copy(folder / "two" / "checkpoint.pt", folder / "resume.pt")
        train(model, train_ids, val_ids, drift_config(out_dir=str(folder / "two")), callback=keep, distributed=True)
    dist.destroy_process_group()


def torchrun(kind: str, folder: Path) -> str:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", __file__,
               "--worker", kind, "--folder", str(folder), *(["--smoke"] if SMOKE > 1 else [])]
    result = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if result.returncode != 0:
        raise RuntimeError(f"torchrun failed ({result.returncode}):\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}")
    return result.stdout


# ---- the entries ---------------------------------------------------------------------------------------------


def load_average() -> list[float]:
    return [round(v, 2) for v in os.getloadavg()]


def dp_speed() -> dict:
    """Median step time of each side per round, alternating; ratios with quartiles."""
    load_start = load_average()
    vocab_size, train_ids, _ = chapter_data()
    x, y = batch(train_ids)
    folder = Path(tempfile.mkdtemp(prefix="ch11-speed-"))

    def one_process(n_threads):
        def run():
            model = new_model(vocab_size)
            with threads(n_threads):
                return step_times(model, torch.optim.AdamW(model.parameters(), lr=LR), x, y)
        return run

    def two_processes():
        out = torchrun("speed", folder)
        return next(json.loads(line) for line in out.splitlines() if line.startswith("{"))["step_s"]

    sides = dict(zip(SIDES, (one_process(1), one_process(2), two_processes)))
    rounds = {name: [] for name in SIDES}
    for r in range(ROUNDS if SMOKE == 1 else 2):
        for name in SIDES if r % 2 == 0 else SIDES[::-1]:
            rounds[name].append(statistics.median(sides[name]()))
            print(r, name, f"{rounds[name][-1] * 1e3:.1f} ms", flush=True)
    shutil.rmtree(folder, ignore_errors=True)
    one, two_threads, two_procs = (rounds[name] for name in SIDES)
    ratios = {"1x1 / 2x1 (speed-up of two processes over one thread)": ratio_quartiles(one, two_procs),
              "1x1 / 1x2 (speed-up of two threads over one)": ratio_quartiles(one, two_threads),
              "1x2 / 2x1 (two processes against one process on two threads)": ratio_quartiles(two_threads, two_procs)}
    return {"machine": machine(), "load_average_start": load_start, "load_average_end": load_average(),
            "model": CHAPTER7_MODEL, "batch": BATCH, "rounds": ROUNDS, "warmup_steps": WARMUP, "steps_per_round": STEPS,
            "median_step_s": {n: round(statistics.median(v), 5) for n, v in rounds.items()},
            "round_median_step_s": {n: [round(t, 5) for t in v] for n, v in rounds.items()},
            "ratio_median_q1_q3": {k: [round(v, 3) for v in r] for k, r in ratios.items()}}


def largest_difference(a, b) -> float:
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


def one_process_run(vocab_size, train_ids, val_ids, seed=0, resume_from=None):
    model = new_model(vocab_size, seed)
    out_dir = None
    if resume_from is not None:
        out_dir = tempfile.mkdtemp(prefix="ch11-resumed-")
        shutil.copy(resume_from, Path(out_dir) / "checkpoint.pt")
    with threads(1):
        history = train(model, train_ids, val_ids, drift_config(seed, out_dir=out_dir, resume=out_dir is not None))
    if out_dir is not None:
        shutil.rmtree(out_dir, ignore_errors=True)
    return model, history


def drift() -> dict:
    """Two processes uninterrupted, resumed on one at RESUME_AT, one process throughout, another seed."""
    vocab_size, train_ids, val_ids = chapter_data()
    folder = Path(tempfile.mkdtemp(prefix="ch11-drift-"))
    torchrun("drift", folder)
    two, ckpt = load_checkpoint(folder / "two")
    runs = {"two processes": (two, ckpt["history"])}
    resumed, resumed_history = one_process_run(vocab_size, train_ids, val_ids, resume_from=folder / "resume.pt")
    runs["resumed on one process"] = (resumed, resumed_history.__dict__)
    one, one_history = one_process_run(vocab_size, train_ids, val_ids)
    runs["one process"] = (one, one_history.__dict__)
    other, other_history = one_process_run(vocab_size, train_ids, val_ids, seed=1)
    runs["one process, seed 1"] = (other, other_history.__dict__)
    initial = new_model(vocab_size)
    with threads(1):
        full_val = {name: round(evaluate(m, val_ids), 6) for name, (m, _) in runs.items()}
    shutil.rmtree(folder, ignore_errors=True)

    def train_gap(a, b, first=0):
        return max(abs(u - v) for u, v in zip(runs[a][1]["train_loss"][first:], runs[b][1]["train_loss"][first:]))

    return {"machine": machine(), "model": CHAPTER7_MODEL,
            "training": {k: v for k, v in drift_config().__dict__.items() if k not in ("progress", "out_dir")},
            "resume_at": RESUME_AT, "moved_from_initialisation": round(largest_difference(two, initial), 4),
            "largest_parameter_difference": {
                "resumed on one process vs two processes": largest_difference(resumed, two),
                "one process vs two processes": largest_difference(one, two),
                "resumed on one process vs one process": largest_difference(resumed, one)},
            "largest_train_loss_gap": {
                f"resumed vs two processes, steps {RESUME_AT + 1}-{DRIFT_STEPS}":
                    train_gap("resumed on one process", "two processes", RESUME_AT // SMOKE),
                "one process vs two processes": train_gap("one process", "two processes"),
                "seed 1 vs seed 0 (one process)": train_gap("one process, seed 1", "one process")},
            "eval_step": runs["two processes"][1]["eval_step"],
            "val_loss": {name: [round(v, 6) for v in h["val_loss"]] for name, (_, h) in runs.items()},
            "full_val_loss": full_val}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--entry", choices=ENTRIES)
    p.add_argument("--worker", choices=("speed", "drift"), help=argparse.SUPPRESS)
    p.add_argument("--folder", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--smoke", action="store_true", help="a 50 times shorter run that stores nothing")
    a = p.parse_args(argv)
    global SMOKE
    SMOKE = 50 if a.smoke else 1
    if a.worker:
        return worker(a.worker, a.folder)
    if a.entry is None:
        p.error("--entry is required")
    env = " ".join(f"{k}={os.environ[k]}" for k in ("MKL_CBWR", "ATEN_CPU_CAPABILITY", "OMP_NUM_THREADS",
                                                   "OMP_WAIT_POLICY") if k in os.environ)
    key = a.entry.replace("-", "_")
    start = time.perf_counter()
    entry = {"dp-speed": dp_speed, "drift": drift}[a.entry]()
    entry["command"] = f"{env} python tools/ch11_results.py --entry {a.entry}".strip()
    entry["wall_seconds"] = round(time.perf_counter() - start, 1)
    if SMOKE > 1:
        print(json.dumps(entry, indent=1)[:3000])
        return None
    add_entry(OUT, key, entry, header=HEADER)
    print(f"stored {a.entry} in {OUT} after {entry['wall_seconds']} s")


if __name__ == "__main__":
    main()
