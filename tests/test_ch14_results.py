"""tools/ch14_results.py (chapter 14's induction-head runs) and the entries it stored in chapter14.json."""

import copy
import json
import math
import shlex
import statistics
import sys
from importlib import resources
from pathlib import Path

import pytest
import torch

from groundup.induction import in_context_loss, repeated_random_tokens

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import ch14_results  # noqa: E402

STORED = json.loads(resources.files("groundup").joinpath("results/chapter14.json").read_text())
RUNS = STORED["runs"]


def window_by_rule(steps, losses, max_steps):
    """The docstring's phase-change rule, written out again."""
    window = [v for s, v in zip(steps, losses) if 0.25 * max_steps <= s <= 0.35 * max_steps]
    final = losses[-1]
    if not window:
        return {"plateau": None, "final": final, "half_step": None, "start_step": None, "end_step": None,
                "width": None}
    plateau = statistics.median(window)
    later = [(s, v) for s, v in zip(steps, losses) if s > 0.35 * max_steps]
    half = min((s for s, v in later if v < plateau / 2), default=None)
    start = None if half is None else max(
        (s for s, v in zip(steps, losses) if s < half and v >= final + 0.9 * (plateau - final)), default=None)
    end = min((s for s, v in later if v <= final + 0.1 * (plateau - final)), default=None)
    return {"plateau": plateau, "final": final, "half_step": half, "start_step": start, "end_step": end,
            "width": None if start is None or end is None else end - start}


def test_phase_change_on_a_made_up_curve():
    steps = list(range(0, 101, 5))
    losses = [4.0, 3.6, 3.4, 3.3, 3.2, 3.0, 3.2, 3.1, 2.9, 3.0, 2.5, 1.5, 1.0, 0.6, 0.3, 0.2, 0.15, 0.12, 0.1, 0.1,
              0.1]
    # plateau: median of steps 25 .. 35 (3.0, 3.2, 3.1) = 3.1; drop 3.0; 90 % level 2.8, 10 % level 0.4;
    # below half the plateau (1.55) first at 55; the last step before it still at >= 2.8 is 45 (3.0)
    found = ch14_results.phase_change(steps, losses, 100)
    assert found == pytest.approx({"plateau": 3.1, "final": 0.1, "half_step": 55, "start_step": 45,
                                   "end_step": 70, "width": 25})
    assert found == window_by_rule(steps, losses, 100)
    # a dip of the plateau's noise below the 90 % level and a rebound above it: the start is the rebound
    bumpy = losses[:8] + [2.7, 2.9, 2.5] + losses[11:]
    found = ch14_results.phase_change(steps, bumpy, 100)
    assert (found["half_step"], found["start_step"], found["end_step"]) == (55, 45, 70)
    assert found == window_by_rule(steps, bumpy, 100)
    assert ch14_results.phase_change([0, 30, 50, 100], [4.0, 3.0, 2.9, 3.5], 100)["start_step"] is None  # no drop
    assert ch14_results.phase_change([0, 100], [4.0, 1.0], 100)["plateau"] is None  # nothing in the window


def test_run_seed_on_a_tiny_model_records_what_the_model_computes():
    shape = dict(vocab_size=16, context_length=12, d_model=16)
    entry, model = ch14_results.run_seed(5, model=shape, training=dict(max_steps=40, batch_size=8, eval_batches=1),
                                         record_every=5)
    assert entry["seed"] == 5 and entry["model"] == {**ch14_results.MODEL, **shape}
    assert entry["training"]["max_steps"] == 40 and entry["training"]["seed"] == 5
    assert entry["curve"]["step"] == list(range(0, 41, 5)) and len(entry["curve"]["in_context_loss"]) == 9
    assert entry["train_eval"]["step"] == list(range(5, 41, 5))
    # the last recorded loss is the returned model's, on the held-out batch built here from its description
    tokens = repeated_random_tokens(256, 6, 16, torch.Generator().manual_seed(entry["held_out"]["seed"]))
    assert entry["held_out"] == {"n_seq": 256, "half_len": 6, "seed": ch14_results.HELD_OUT_SEED}
    final = in_context_loss(model, tokens)
    assert entry["curve"]["in_context_loss"][-1] == pytest.approx(final, abs=1e-5)
    assert entry["ablation"]["none"] == pytest.approx(final, abs=1e-5)
    assert entry["phase_change"] == window_by_rule(entry["curve"]["step"], entry["curve"]["in_context_loss"], 40)
    # zero-ablating head (1, 2) is the model with that head's columns of W_o set to zero
    cut = copy.deepcopy(model)
    with torch.no_grad():
        cut.blocks[1].attention.W_o.weight[:, 2 * 4:3 * 4] = 0.0
    assert entry["ablation"]["zero"][1][2] == pytest.approx(in_context_loss(cut, tokens), abs=1e-5)
    for name in ("previous_token", "induction", "copying"):
        assert torch.tensor(entry["scores"][name]).shape == (2, 4)
    for name in ("k_composition", "k_composition_at_init"):
        assert torch.tensor(entry[name]).shape == (4, 4)
    json.dumps(entry)  # plain data


def test_the_stored_runs_are_the_three_seeds():
    assert sorted(RUNS) == ["seed0", "seed1", "seed2"]


@pytest.mark.parametrize("key", sorted(RUNS))
def test_stored_entry_is_complete_and_consistent(key):
    entry = RUNS[key]
    words = shlex.split(entry["command"])
    assert words[:3] == ["OMP_NUM_THREADS=1", "python", "tools/ch14_results.py"]
    seed = int(words[words.index("--seed") + 1])
    assert key == f"seed{seed}" and entry["seed"] == seed and entry["threads"] == 1
    assert entry["model"] == ch14_results.MODEL
    assert {k: entry["training"][k] for k in ch14_results.TRAINING} == ch14_results.TRAINING
    assert entry["training"]["seed"] == seed and entry["wall_seconds"] > 0
    steps, losses = entry["curve"]["step"], entry["curve"]["in_context_loss"]
    max_steps = ch14_results.TRAINING["max_steps"]
    assert steps == list(range(0, max_steps + 1, ch14_results.RECORD_EVERY)) and len(losses) == len(steps)
    assert all(math.isfinite(v) and v >= 0 for v in losses)
    assert entry["train_eval"]["step"] == steps[1:] and len(entry["train_eval"]["val_loss"]) == len(steps) - 1
    assert entry["phase_change"] == window_by_rule(steps, losses, max_steps)
    assert entry["ablation"]["none"] == losses[-1]  # the same model on the same batch
    for name in ("previous_token", "induction", "copying"):
        table = entry["scores"][name]
        assert len(table) == 2 and all(len(row) == 4 and all(0 <= x <= 1 for x in row) for row in table)
    for name in ("k_composition", "k_composition_at_init"):
        table = entry[name]
        assert len(table) == 4 and all(len(row) == 4 and all(0 <= x <= 1 for x in row) for row in table)
    assert len(entry["ablation"]["zero_layer"]) == 2
    for mode in ("zero", "mean"):
        table = entry["ablation"][mode]
        assert len(table) == 2 and all(len(row) == 4 and all(math.isfinite(x) for x in row) for row in table)
