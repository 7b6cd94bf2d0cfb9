"""Chapter 7's runs on the chapter's own model (tools/ch07_chapter_runs.py): the tool trains what chapter 7 trains,
and the stored entries of chapter07.json's "chapter_runs" hold what the notebook reads."""

import dataclasses
import json
import math
import re
import shlex
import statistics
import sys
from importlib import resources
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from groundup.cli import _parser
from groundup.models import GPT, GPTConfig
from groundup.runs import _configs_from_args
from groundup.training import CHAPTER7_MODEL, CHAPTER7_TRAINING, History, TrainConfig, train

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import ch07_chapter_runs as tool  # noqa: E402

TINY = dict(context_length=16, d_model=16, n_layers=2, n_heads=2, positional="rope")


def pattern_data(n=3000):
    g = torch.Generator().manual_seed(0)
    ids = torch.arange(n) % 7
    return torch.where(torch.rand(n, generator=g) < 0.1, torch.randint(0, 12, (n,), generator=g), ids)


def tiny_corpus():
    data = pattern_data()
    return SimpleNamespace(vocab_size=12), data[:2500], data[2500:]


# --- the tool trains chapter 7's run ---------------------------------------------------------------------------


def test_the_tools_model_and_training_are_chapter_7s():
    assert tool.MODEL == CHAPTER7_MODEL and tool.TRAINING == CHAPTER7_TRAINING
    assert tool.CORPUS == "shakespeare" and tool.SEEDS == (0, 1, 2)
    assert dataclasses.asdict(tool.config()) == dataclasses.asdict(TrainConfig(**CHAPTER7_TRAINING, progress=False))
    for seed in tool.SEEDS:
        assert dataclasses.asdict(tool.config(seed=seed)) == dataclasses.asdict(
            TrainConfig(**{**CHAPTER7_TRAINING, "seed": seed}, progress=False))
    long = tool.config(steps=tool.LONG_STEPS, eval_interval=tool.LONG_EVAL_INTERVAL)
    assert (long.max_steps, long.eval_interval, long.warmup_steps, long.learning_rate) == (8000, 500, 100, 3e-3)


def test_optimizer_configs_change_only_the_update():
    base = dataclasses.asdict(tool.config())
    for name, (_, settings) in tool.OPTIMIZERS.items():
        cfg = dataclasses.asdict(tool.config(name, 0.5, 1))
        changed = {k for k in cfg if cfg[k] != base[k]}
        assert changed <= set(settings) | {"learning_rate", "min_lr", "seed"}, name
        assert cfg["grad_clip"] == 1.0 and cfg["max_steps"] == 2000 and cfg["min_lr"] == 0.05
    assert tool.config("sgd", 1.0, 0, grad_clip=None).grad_clip is None
    assert tool.OPTIMIZERS["sgd"][1] == dict(optimizer="sgd", beta1=0.0, weight_decay=0.0)
    assert tool.OPTIMIZERS["sgd_momentum"][1]["beta1"] == 0.9


def test_a_run_through_the_tool_is_a_direct_train_call_bit_for_bit():
    corpus = tiny_corpus()
    cfg = TrainConfig(batch_size=4, max_steps=12, learning_rate=3e-3, warmup_steps=3, eval_interval=5,
                      eval_batches=2, seed=1, progress=False)
    entry, model = tool.run(cfg, corpus, shape=TINY)
    torch.manual_seed(1)
    direct = GPT(GPTConfig(vocab_size=12, **TINY))
    history = train(direct, corpus[1], corpus[2], cfg)
    a, b = model.state_dict(), direct.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert entry["val_loss_exact"][1:] == history.val_loss and entry["eval_step"] == [0, 5, 10, 12]
    assert entry["weights_sha256"][-1] == tool.weights_sha256(direct)
    assert entry["grad_norm"]["fraction_above"] == round(sum(g > 1 for g in history.grad_norm) / 12, 4)


def test_the_cli_flags_give_chapter_7s_configs():
    args = _parser().parse_args(tool.cli_args(seed=2, out="somewhere"))
    model_config, train_config = _configs_from_args(args, 84)
    assert model_config == GPTConfig(vocab_size=84, **CHAPTER7_MODEL)
    got = dataclasses.asdict(train_config)
    want = dataclasses.asdict(tool.config(seed=2))
    assert {k: v for k, v in got.items() if k not in ("out_dir", "device")} == \
        {k: v for k, v in want.items() if k not in ("out_dir", "device")}


def test_grad_norm_summary_counts_the_clipped_steps_per_window():
    h = History()
    for i, g in enumerate([2.0, 0.5, 1.5, 0.2, 3.0]):
        h.add_step(i + 1, 1.0, 1e-3, g)
    s = tool.grad_norm_summary(h, 1.0, 2)
    assert s["fraction_above"] == 0.6 and s["window_end_step"] == [2, 4, 5]
    assert s["window_fraction_above"] == [0.5, 0.5, 1.0] and s["window_median"] == [1.25, 0.85, 3.0]
    assert tool.grad_norm_summary(h, None, 5)["clipped"] is False


def test_loss_at_step_is_linear_between_evaluations():
    entry = {"eval_step": [0, 250, 500], "val_loss": [4.0, 3.0, 2.0]}
    assert tool.loss_at_step(entry, 125) == 3.5 and tool.loss_at_step(entry, 500) == 2.0
    assert tool.loss_at_step(entry, 501) is None


def test_the_grid_is_extended_beyond_the_edge_at_its_own_ratio():
    assert tool.next_value([0.3, 1.0, 3.0], lower=False) == 9.0
    assert tool.next_value([0.03, 0.1, 0.3], lower=True) == 0.009


# --- the stored entries ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stored():
    results = json.loads(resources.files("groundup").joinpath("results/chapter07.json").read_text())
    return results[tool.SECTION]


def check_run(run, steps=2000, interval=250):
    assert run["eval_step"] == [0, *range(interval, steps + 1, interval)]
    assert len(run["val_loss"]) == len(run["eval_step"]) == len(run["tokens"])
    assert all(math.isfinite(v) for v in run["val_loss"]) and math.isfinite(run["full_val_loss"])
    assert run["full_val_loss"] == round(run["full_val_loss_exact"], 5)
    assert run["command"].startswith(tool.TOOL + " --entry ") and run["made_by"].startswith("python tools/")
    assert run["machine"]["threads"] == 1
    if run["command"].endswith(" --fast-kernels"):  # Muon's runs: no arithmetic caps
        assert run["machine"]["arithmetic"]["MKL_CBWR"] is None and run["kernels"].startswith("the machine's")
    else:  # the notebooks' arithmetic
        assert run["machine"]["cpu_capability"] == "DEFAULT"
        assert run["machine"]["arithmetic"]["MKL_CBWR"] == "COMPATIBLE"
    assert run["settings"]["max_steps"] == steps


def test_the_stored_seeds_are_the_chapters_run(stored):
    for seed in tool.SEEDS:
        run = stored[f"seeds/seed{seed}"]
        check_run(run)
        assert run["command"] == f"{tool.TOOL} --entry seeds --seed {seed}"
        assert run["settings"] == {**{k: v for k, v in dataclasses.asdict(tool.config(seed=seed)).items()
                                      if k not in ("progress", "out_dir", "resume", "device")}}
    check = stored["seeds/seed0"]["notebook_check"]
    assert check["cached"] and check["equal_weights"] and check["equal_full_val_loss"] and check["equal_curve"]
    assert check["cached_full_val_loss_exact"] == stored["seeds/seed0"]["full_val_loss_exact"]


def test_the_cli_run_is_seed_0(stored):
    cli = stored["seeds/cli"]
    assert cli["cli"] == "groundup " + shlex.join(tool.cli_args())
    assert all(cli["equal_to_seed0"].values()) and cli["equal_to_cached_chapter7_model"]
    assert cli["full_val_loss"] == stored["seeds/seed0"]["full_val_loss"]


def test_the_long_run(stored):
    run = stored["long_run"]
    check_run(run, steps=tool.LONG_STEPS, interval=tool.LONG_EVAL_INTERVAL)
    assert run["settings"]["warmup_steps"] == 100 and run["settings"]["learning_rate"] == 3e-3
    assert run["full_val_loss"] < stored["seeds/seed0"]["full_val_loss"]


def test_each_tuned_rate_is_inside_its_grid(stored):
    grids = stored["summary"]["grids"]
    for name in ("sgd", "sgd_momentum", "muon"):
        grid = grids[name]
        assert set(tool.GRIDS[name]) <= set(grid["lr"]) and grid["inside"] and grid["chosen"] == grid["best"]
        assert grid["lr"][0] < grid["chosen"] < grid["lr"][-1]
        for lr, loss in zip(grid["lr"], grid["full_val_loss"]):
            run = stored[tool.tune_key(name, lr)]
            assert run["full_val_loss"] == loss and run["settings"]["max_steps"] == tool.TUNE_STEPS
            assert run["settings"]["warmup_steps"] == tool.TUNE_WARMUP and run["seed"] == 0
        finite = [v for v in grid["full_val_loss"] if v is not None]
        assert grid["full_val_loss"][grid["lr"].index(grid["chosen"])] == min(finite)
    assert grids.get("adamw", {"chosen": 3e-3})["chosen"] == 3e-3


def test_three_seeds_per_optimizer_at_the_chosen_rate(stored):
    summary = stored["summary"]["optimizers"]
    assert set(summary) == set(tool.OPTIMIZERS)
    for name, s in summary.items():
        runs = [stored[key] for key in s["runs"]]
        assert [r["seed"] for r in runs] == list(tool.SEEDS) and all(r["lr"] == s["lr"] for r in runs)
        for r in runs:
            check_run(r)
            assert r["settings"]["optimizer"] == tool.OPTIMIZERS[name][1]["optimizer"]
        assert s["full_val_loss"] == [r["full_val_loss"] for r in runs]
        assert s["mean"] == round(statistics.mean(s["full_val_loss"]), 5)
        assert s["sd"] == round(statistics.stdev(s["full_val_loss"]), 5)
    assert summary["adamw"]["runs"] == [f"seeds/seed{s}" for s in tool.SEEDS] and summary["adamw"]["lr"] == 3e-3
    assert summary["adamw"]["full_val_loss"][0] == stored["seeds/seed0"]["full_val_loss"]
    for name in ("sgd", "sgd_momentum", "muon"):
        assert summary[name]["lr"] == stored["summary"]["grids"][name]["chosen"]
        for seed in tool.SEEDS:
            fast = " --fast-kernels" if name == "muon" else ""
            assert stored[f"optimizers/{name}/seed{seed}"]["command"] == \
                f"{tool.TOOL} --entry optimizers --optimizer {name} --seed {seed}{fast}"


def test_sgd_without_clipping(stored):
    run = stored["optimizers/sgd_no_clip/seed0"]
    assert run["settings"]["grad_clip"] is None and run["lr"] == stored["summary"]["grids"]["sgd"]["chosen"]
    assert run["command"] == f"{tool.TOOL} --entry no-clip"
    clipping = stored["summary"]["sgd_clipping"]
    assert 0 <= clipping["fraction_of_steps_clipped"] <= 1
    assert clipping["with_clipping"] == stored["optimizers/sgd/seed0"]["full_val_loss"]
    assert clipping["without_clipping"] == run["full_val_loss"] and clipping["diverged_without"] == run["diverged_at"]
    assert clipping["short_runs"]
    for lr, short in clipping["short_runs"].items():
        unclipped = stored[tool.tune_key("sgd_no_clip", float(lr))]
        assert unclipped["settings"]["grad_clip"] is None and unclipped["settings"]["max_steps"] == tool.TUNE_STEPS
        assert unclipped["command"] == f"{tool.TOOL} --entry tune --optimizer sgd --lr {lr} --no-clip"
        assert short["unclipped"] == unclipped["full_val_loss"]


def test_step_times_per_optimizer(stored):
    times = stored["step_times"]
    assert set(times["median"]) == set(tool.OPTIMIZERS) and times["kernels"] == "the notebooks' arithmetic"
    for name, rounds in times["per_round"].items():
        assert len(rounds) == tool.ROUNDS and times["median"][name] == round(statistics.median(rounds), 6)
        assert 0.01 < times["median"][name] < 2
    assert times["machine"]["threads"] == 1 and times["command"] == f"{tool.TOOL} --entry step-times"
    equal = stored["summary"]["equal_time"]
    for name, e in equal["optimizers"].items():
        assert e["seconds_per_step"] == times["median"][name] and e["steps"] <= 2000
        assert math.isclose(e["steps"] * e["seconds_per_step"], equal["seconds"], rel_tol=0.01)


def test_every_command_names_an_entry_the_tool_has(stored):
    for key, entry in stored.items():
        if isinstance(entry, dict) and "command" in entry:
            words = shlex.split(entry["command"])
            assert words[:2] == ["python", "tools/ch07_chapter_runs.py"], key
            tool_args = words[2:]
            assert re.fullmatch(r"--entry [a-z-]+.*", " ".join(tool_args)), key
            assert tool_args[1] in tool.ENTRIES, key
