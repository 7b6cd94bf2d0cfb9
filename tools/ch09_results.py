"""The multi-seed runs behind chapter 9's experiments, stored in src/groundup/results/chapter09.json.

    OMP_NUM_THREADS=1 python tools/ch09_results.py                       # everything (under an hour)
    OMP_NUM_THREADS=1 python tools/ch09_results.py --kind gpt --seed 1   # one entry
    python tools/ch09_results.py --entry masking-variants                # the notebook's seed-0 runs (~3 min)

Two kinds of run, each trained on one CPU thread (so the numbers are the same on every run of this script):

- ``mlm``: the chapter's masked LM (2 layers, d_model 64, 4 heads, RoPE, context 32, batch 64, peak learning rate
  8e-3) trained for ``--steps`` steps with one of four ways of showing the selected 15 %: ``mask`` (always
  [MASK]), ``bert`` (80 % [MASK] / 10 % random / 10 % unchanged), ``unchanged`` (80 % [MASK] / 20 % unchanged),
  ``random`` (80 % [MASK] / 20 % random). The ``bert`` run with 600 steps and seed 0 is the notebook's model.
- ``gpt``: chapter 7's GPT (``CHAPTER7_MODEL`` trained with ``CHAPTER7_TRAINING``) with the seed replaced by
  ``--seed``; seed 0 is the model ``groundup.training.chapter7_model()`` returns.

Every run is scored exactly as the notebook scores it: on the 1000 blanks of the chapter's "Use it" section (loss,
accuracy and, per blank, whether the most probable character is right) and, for the masked LMs, on the three
probes of the 80/10/10 experiment ([MASK], observed and corrupted accuracy). Each entry records the command that
made it; running a command again replaces its entry.

``--entry masking-variants`` stores ``runs["masking-variants/seed0"]``: the three seed-0 runs the notebook's 80/10/10
experiment shows (80/10/10, 80/20 unchanged, 80/20 random; 600 steps), made exactly as the notebook's cell made them
before it loaded this entry: the same calls, on the notebooks' arithmetic (``nbval_lanes.ARITHMETIC``: every library
that picks code for the CPU capped, set here if the shell did not: the script starts itself again with it) and on one
thread, as the notebook sets. Its probe accuracies are kept unrounded (JSON reads a float back exactly), so the notebook
prints what it printed when it trained them live. The other entries were made on another CPU's kernels.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

from results_file import add_entry, machine, on_notebook_arithmetic

if __name__ == "__main__" and "--entry" in sys.argv:
    on_notebook_arithmetic()

import torch  # noqa: E402

import groundup  # noqa: E402
from groundup.char_data import char_corpus  # noqa: E402
from groundup.masking import mask_tokens, masked_lm_batches  # noqa: E402
from groundup.models import GPT, GPTConfig, MaskedLM, MaskedLMConfig  # noqa: E402
from groundup.training import CHAPTER7_MODEL, CHAPTER7_TRAINING, TrainConfig, chapter7_model, train  # noqa: E402

OUT = Path(__file__).resolve().parents[1] / "src" / "groundup" / "results" / "chapter09.json"
VARIANTS = {  # name in the command: (name in the notebook, mask_fraction, random_fraction)
    "mask": ("always [MASK]", 1.0, 0.0),
    "bert": ("80/10/10 (BERT)", 0.8, 0.1),
    "unchanged": ("80 [MASK] / 20 unchanged", 0.8, 0.0),
    "random": ("80 [MASK] / 20 random", 0.8, 0.2),
}
MLM_SHAPE = dict(context_length=32, d_model=64, n_layers=2, n_heads=4, positional="rope")


def mlm_training(steps: int, seed: int) -> TrainConfig:
    """The notebook's TrainConfig for 600 steps; longer runs evaluate four times."""
    return TrainConfig(batch_size=64, max_steps=steps, learning_rate=8e-3, warmup_steps=60,
                       eval_interval=200 if steps == 600 else steps // 4, eval_batches=10, seed=seed, progress=False)


def data():
    return char_corpus("shakespeare")


def blanks(val_ids):
    """The chapter's 1000 blanks: positions and true characters (the notebook's "Use it" cell)."""
    g = torch.Generator().manual_seed(9)
    pos = torch.randint(64, len(val_ids) - 64, (1000,), generator=g)
    return pos, val_ids[pos]


def score(logp, truth):
    correct = logp.argmax(-1) == truth
    return {"loss": round(-logp[torch.arange(len(truth)), truth].mean().item(), 5),
            "accuracy": round(correct.double().mean().item(), 5),
            "correct": "".join("1" if c else "0" for c in correct.tolist())}


def probe(model, val_ids, mask_id, n_v, digits: int | None = 5):
    """[MASK], observed and corrupted accuracy on 500 fixed validation windows (the notebook's probe), rounded to
    ``digits`` (None: as computed)."""
    def rounded(value):
        return value if digits is None else round(value, digits)

    starts = torch.randint(0, len(val_ids) - 32, (500,), generator=torch.Generator().manual_seed(5))
    windows = val_ids[starts[:, None] + torch.arange(32)]
    g = torch.Generator().manual_seed(6)
    found = {}
    with torch.no_grad():
        for name, (mask_fraction, random_fraction) in [("[MASK]", (1.0, 0.0)), ("corrupted", (0.0, 1.0))]:
            x, y = mask_tokens(windows, mask_token_id=mask_id, vocab_size=n_v + 1, generator=g,
                               mask_fraction=mask_fraction, random_fraction=random_fraction)
            sel = (y != -100) & (x != y)  # selected and actually changed
            found[name] = rounded((model(x)[0].argmax(-1)[sel] == y[sel]).double().mean().item())
        found["observed"] = rounded((model(windows)[0].argmax(-1) == windows).double().mean().item())
    return found


def run_mlm(variant: str, steps: int, seed: int):
    tokenizer, train_ids, val_ids = data()
    n_v = tokenizer.vocab_size
    _, mask_fraction, random_fraction = VARIANTS[variant]
    torch.manual_seed(seed)
    model = MaskedLM(MaskedLMConfig(vocab_size=n_v + 1, **MLM_SHAPE))
    history = train(model, train_ids, val_ids, mlm_training(steps, seed),
                    batches=masked_lm_batches(n_v, n_v + 1, mask_fraction=mask_fraction,
                                              random_fraction=random_fraction))
    model.eval()
    pos, truth = blanks(val_ids)
    window = val_ids[pos[:, None] + torch.arange(-16, 16)]
    window[:, 16] = n_v
    with torch.no_grad():
        logp = model(window)[0][:, 16, :n_v].log_softmax(-1)
    return {"val_loss": round(history.val_loss[-1], 5), "blanks": score(logp, truth),
            "probe": probe(model, val_ids, n_v, n_v)}


LIVE_KEY = "masking-variants/seed0"
LIVE_COMMAND = "python tools/ch09_results.py --entry masking-variants"
LIVE_VARIANTS = ["bert", "unchanged", "random"]  # in the notebook's order


def masking_variants() -> dict:
    """The notebook's seed-0 runs of the 80/10/10 experiment, on its arithmetic and thread count."""
    tick = time.perf_counter()
    groundup.set_seed(0)
    torch.set_num_threads(1)  # as the notebook
    tokenizer, train_ids, val_ids = data()
    n_v = tokenizer.vocab_size
    config, training = MaskedLMConfig(vocab_size=n_v + 1, **MLM_SHAPE), mlm_training(600, 0)
    found = {}
    for variant in LIVE_VARIANTS:
        name, mask_fraction, random_fraction = VARIANTS[variant]
        torch.manual_seed(0)
        model = MaskedLM(config)
        train(model, train_ids, val_ids, training, batches=masked_lm_batches(
            n_v, n_v + 1, mask_fraction=mask_fraction, random_fraction=random_fraction))
        found[name] = probe(model.eval(), val_ids, n_v, n_v, digits=None)
        print(name, found[name], flush=True)
    return {"command": LIVE_COMMAND,
            "variants": {name: [m, r] for name, m, r in VARIANTS.values()},
            "model": dataclasses.asdict(config), "training": dataclasses.asdict(training),
            "probe_windows": {"count": 500, "length": 32, "seed": 5}, "probe_seed": 6,
            "probe": found, "machine": machine(), "wall_seconds": round(time.perf_counter() - tick, 1)}


def run_gpt(seed: int):
    tokenizer, train_ids, val_ids = data()
    torch.manual_seed(seed)
    model = GPT(GPTConfig(vocab_size=tokenizer.vocab_size, **CHAPTER7_MODEL))
    history = train(model, train_ids, val_ids, TrainConfig(**{**CHAPTER7_TRAINING, "seed": seed}, progress=False))
    model.eval()
    pos, truth = blanks(val_ids)
    with torch.no_grad():
        logp = model(val_ids[pos[:, None] + torch.arange(-63, 0)])[0][:, -1].log_softmax(-1)
    entry = {"val_loss": round(history.val_loss[-1], 5), "blanks": score(logp, truth)}
    if seed == 0:  # the same weights as the chapter 7 model the notebook loads?
        reference, _ = chapter7_model()
        entry["same_weights_as_chapter7_model"] = all(
            torch.equal(a, b) for a, b in zip(model.state_dict().values(), reference.state_dict().values()))
    return entry


def store(key: str, entry: dict) -> None:
    add_entry(OUT, key, entry, header={"about": ("Runs for chapter 9 (one CPU thread each, see tools/ch09_results.py); "
                                                 "each entry says which command made it.")})


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kind", choices=("mlm", "gpt"), action="append")
    p.add_argument("--variant", choices=tuple(VARIANTS), action="append")
    p.add_argument("--steps", type=int, action="append")
    p.add_argument("--seed", type=int, action="append")
    p.add_argument("--entry", choices=("masking-variants",),
                   help="the notebook's seed-0 runs of the 80/10/10 experiment, on the notebooks' arithmetic")
    a = p.parse_args(argv)
    if a.entry:
        entry = masking_variants()
        store(LIVE_KEY, entry)
        print(f"{LIVE_KEY}: {entry['wall_seconds']} s, stored in {OUT}")
        return
    torch.set_num_threads(1)
    seeds = a.seed or [0, 1, 2]
    jobs = []
    for kind in a.kind or ["mlm", "gpt"]:
        if kind == "gpt":
            jobs += [("gpt", None, 2000, s) for s in seeds]
        else:
            jobs += [("mlm", v, n, s) for n in a.steps or [600, 2400] for v in a.variant or list(VARIANTS)
                     for s in seeds]
    for kind, variant, steps, seed in jobs:
        if kind == "gpt":
            key, command = f"gpt/seed{seed}", f"OMP_NUM_THREADS=1 python tools/ch09_results.py --kind gpt --seed {seed}"
            entry = {"kind": "gpt", "steps": steps, "seed": seed, **run_gpt(seed)}
        else:
            key = f"mlm/{variant}/steps{steps}/seed{seed}"
            command = (f"OMP_NUM_THREADS=1 python tools/ch09_results.py --kind mlm --variant {variant} "
                       f"--steps {steps} --seed {seed}")
            name, mask_fraction, random_fraction = VARIANTS[variant]
            entry = {"kind": "mlm", "variant": name, "mask_fraction": mask_fraction,
                     "random_fraction": random_fraction, "steps": steps, "seed": seed,
                     **run_mlm(variant, steps, seed)}
        store(key, {"command": command, **entry})
        print(key, {k: v for k, v in entry.items() if k != "blanks"}, entry["blanks"]["accuracy"], flush=True)


if __name__ == "__main__":
    sys.exit(main())
