"""Chapter 7's optimizer experiment: the package's SGD option against eq. (7.3) and torch.optim.SGD, and the stored
entry "optimizers" of chapter07.json against the tool that made it (tools/ch07_optimizers.py)."""

import json
import shlex
import statistics
import sys
from importlib import resources
from pathlib import Path

import pytest
import torch

from groundup.data import get_batch
from groundup.models import GPT, GPTConfig
from groundup.training import TrainConfig, train

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import ch07_optimizers as tool  # noqa: E402

TINY = dict(vocab_size=12, context_length=16, d_model=16, n_layers=2, n_heads=2)


def tiny_pair():
    torch.manual_seed(0)
    a = GPT(GPTConfig(**TINY))
    b = GPT(GPTConfig(**TINY))
    b.load_state_dict(a.state_dict())
    return a, b


def pattern_data(n=2000):
    g = torch.Generator().manual_seed(0)
    ids = torch.arange(n) % 7
    return torch.where(torch.rand(n, generator=g) < 0.1, torch.randint(0, 12, (n,), generator=g), ids)


def sgd_config(**kw):
    """Constant learning rate (no warm-up, min_lr = peak), no clipping: each step is the optimizer's update alone."""
    return TrainConfig(**{**dict(batch_size=4, max_steps=5, learning_rate=0.05, min_lr=0.05, warmup_steps=0,
                                 grad_clip=None, eval_interval=100, eval_batches=2, optimizer="sgd",
                                 progress=False), **kw})


def batches_of(config, data):
    """The batches train draws: its sampler is a generator seeded with config.seed."""
    g = torch.Generator().manual_seed(config.seed)
    return [get_batch(data, config.batch_size, TINY["context_length"], generator=g) for _ in range(config.max_steps)]


# --- the package's SGD -------------------------------------------------------------------------------------------


def test_plain_sgd_is_equation_7_3():
    """beta1=0, no decay: every step is θ <- θ - η g, computed here by hand from autograd's gradient."""
    data, ours, ref = pattern_data(), *tiny_pair()
    config = sgd_config(beta1=0.0, weight_decay=0.0, max_steps=3)
    train(ours, data, data, config)
    for x, y in batches_of(config, data):
        ref.zero_grad()
        ref(x, y)[1].backward()
        with torch.no_grad():
            for p in ref.parameters():
                p -= 0.05 * p.grad
    for (name, p), q in zip(ours.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=f"{name} differs from eq. (7.3)")
    assert not torch.equal(next(ours.parameters()), next(tiny_pair()[0].parameters()))  # it did move


def test_sgd_with_momentum_and_decay_is_torch_sgd_on_the_matrices():
    """beta1 is torch.optim.SGD's momentum; weight decay reaches the matrices only (as AdamW's param_groups)."""
    data, ours, ref = pattern_data(), *tiny_pair()
    config = sgd_config(beta1=0.9, weight_decay=0.1)
    train(ours, data, data, config)
    matrices = [p for p in ref.parameters() if p.dim() >= 2]
    vectors = [p for p in ref.parameters() if p.dim() < 2]
    assert matrices and vectors
    opt = torch.optim.SGD([{"params": matrices, "weight_decay": 0.1}, {"params": vectors, "weight_decay": 0.0}],
                          lr=0.05, momentum=0.9)
    for x, y in batches_of(config, data):
        opt.zero_grad()
        ref(x, y)[1].backward()
        opt.step()
    for (name, p), q in zip(ours.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=f"{name} differs from torch.optim.SGD")


def test_momentum_changes_the_update():
    """The momentum run is not the plain one (the option is not ignored)."""
    data = pattern_data()
    plain, heavy = tiny_pair()
    train(plain, data, data, sgd_config(beta1=0.0))
    train(heavy, data, data, sgd_config(beta1=0.9))
    assert any(not torch.allclose(p, q, atol=1e-4) for p, q in zip(plain.parameters(), heavy.parameters()))


# --- the stored entry --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def entry():
    stored = json.loads(resources.files("groundup").joinpath("results/chapter07.json").read_text())
    return stored["optimizers"]


def test_entry_has_its_parts_and_the_tools_settings(entry):
    assert set(entry) == {"about", "setup", "runs", "grid", "summary"}
    setup = entry["setup"]
    assert setup["shape"] == tool.SHAPE and setup["grids"] == tool.GRIDS
    assert (setup["batch_size"], setup["steps"], setup["warmup_steps"]) == (tool.BATCH, tool.STEPS, tool.WARMUP)
    assert (setup["eval_interval"], setup["eval_batches"]) == (tool.EVAL_INTERVAL, tool.EVAL_BATCHES)
    assert setup["tokens"] == tool.BATCH * tool.SHAPE["context_length"] * tool.STEPS
    assert set(entry["summary"]) == set(entry["grid"]) == set(tool.OPTIMIZERS)


def test_every_run_says_how_it_was_made(entry):
    for key, run in entry["runs"].items():
        assert key == tool.run_key(run["optimizer"], run["lr"], run["seed"])
        args = shlex.split(run["command"].split("python tools/ch07_optimizers.py", 1)[1])
        assert args == ["--optimizer", run["optimizer"], "--lr", f"{run['lr']:g}", "--seed", str(run["seed"])]
        assert run["command"].startswith(tool.ENV)
        assert run["settings"] == tool.OPTIMIZERS[run["optimizer"]][1]
        if run["diverged_at"] is None:
            assert run["eval_step"] == list(range(0, tool.STEPS + 1, tool.EVAL_INTERVAL))
            assert len(run["val_loss"]) == len(run["eval_step"])


def test_curves_fall_at_the_start(entry):
    """Every run that did not diverge is below its untrained loss at the first two evaluations; the initial loss
    is the same model's for one seed whatever the optimizer (the same weights, the same batches)."""
    first = {}
    for run in entry["runs"].values():
        first.setdefault(run["seed"], set()).add(run["val_loss"][0])
        if run["diverged_at"] is None:
            v = run["val_loss"]
            assert v[1] < v[0] and v[2] < v[0], run["command"]
    assert all(len(values) == 1 for values in first.values())


def test_chosen_rate_is_the_best_of_the_grid_and_inside_it(entry):
    runs = entry["runs"]
    for optimizer, grid in entry["grid"].items():
        lrs = grid["lr"]
        assert lrs == sorted(lrs) and set(tool.GRIDS[optimizer]) <= set(lrs)
        finals = [tool.final(runs[tool.run_key(optimizer, lr, 0)]) for lr in lrs]
        assert grid["full_val_loss"] == [runs[tool.run_key(optimizer, lr, 0)]["full_val_loss"] for lr in lrs]
        assert grid["chosen"] == lrs[finals.index(min(finals))]
        assert lrs[0] < grid["chosen"] < lrs[-1], f"{optimizer}: the chosen rate is the grid's edge"
        assert grid["inside"] is True


def test_summary_is_the_three_seeds_at_the_chosen_rate(entry):
    for optimizer, row in entry["summary"].items():
        assert row["lr"] == entry["grid"][optimizer]["chosen"] and row["seeds"] == [0, 1, 2]
        finals = [entry["runs"][tool.run_key(optimizer, row["lr"], s)]["full_val_loss"] for s in row["seeds"]]
        assert row["full_val_loss"] == finals and None not in finals
        assert row["mean"] == pytest.approx(statistics.mean(finals), abs=1e-5)
        assert row["sd"] == pytest.approx(statistics.stdev(finals), abs=1e-5)
        assert row["label"] == tool.OPTIMIZERS[optimizer][0]
