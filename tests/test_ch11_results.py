"""Chapter 11's stored measurements (src/groundup/results/chapter11.json) against the tool that made them
(tools/ch11_results.py), and the tool's timed step against the training step written out."""

import json
import statistics
import sys
from importlib import resources
from pathlib import Path

import pytest
import torch

from groundup.bench import ratio_quartiles
from groundup.models import GPT, GPTConfig

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import ch11_results as tool  # noqa: E402


def stored(key):
    path = resources.files("groundup").joinpath("results/chapter11.json")
    if not path.is_file():
        pytest.skip("chapter11.json is not stored yet")
    entry = json.loads(path.read_text()).get("runs", {}).get(key)
    if entry is None:
        pytest.skip(f"chapter11.json holds no runs/{key} yet")
    return entry


def tiny_model():
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=12, context_length=16, d_model=16, n_layers=1, n_heads=2))


def test_timed_step_is_a_training_step_with_clipping_and_adamw():
    g = torch.Generator().manual_seed(0)
    x, y = torch.randint(0, 12, (4, 16), generator=g), torch.randint(0, 12, (4, 16), generator=g)
    model, reference = tiny_model(), tiny_model()
    times = tool.step_times(model, torch.optim.AdamW(model.parameters(), lr=1e-2), x, y)
    assert len(times) == tool.STEPS and all(t > 0 for t in times)
    optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    for _ in range(tool.WARMUP + tool.STEPS):  # written out: loss, backward, clip at 1, AdamW
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(reference(x)[0].flatten(0, 1), y.flatten()).backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
        optimizer.step()
    for a, b in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert (next(model.parameters()) - next(tiny_model().parameters())).abs().max() > 1e-3, "the step trains"


def test_stored_speed_holds_its_rounds_medians_and_ratios():
    entry = stored("dp_speed")
    assert entry["command"].endswith("python tools/ch11_results.py --entry dp-speed")
    assert len(entry["load_average_start"]) == len(entry["load_average_end"]) == 3
    rounds = entry["round_median_step_s"]
    assert list(rounds) == list(tool.SIDES) and all(len(r) == entry["rounds"] for r in rounds.values())
    for side, times in rounds.items():
        assert entry["median_step_s"][side] == pytest.approx(statistics.median(times), abs=1e-5)
    one, two_threads, two_processes = (rounds[s] for s in tool.SIDES)
    expected = [ratio_quartiles(one, two_processes), ratio_quartiles(one, two_threads),
                ratio_quartiles(two_threads, two_processes)]
    for got, want in zip(entry["ratio_median_q1_q3"].values(), expected, strict=True):
        assert got == pytest.approx(list(want), abs=2e-3)


def test_stored_drift_is_rounding_next_to_training_and_seeds():
    entry = stored("drift")
    assert "ATEN_CPU_CAPABILITY=default" in entry["command"] and "MKL_CBWR=COMPATIBLE" in entry["command"]
    assert entry["training"]["max_steps"] == tool.DRIFT_STEPS and entry["resume_at"] == tool.RESUME_AT
    runs = entry["val_loss"]
    assert set(runs) == {"two processes", "resumed on one process", "one process", "one process, seed 1"}
    assert all(len(v) == len(entry["eval_step"]) for v in runs.values())
    shared = entry["eval_step"].index(tool.RESUME_AT) + 1  # the resumed run's history up to the checkpoint
    assert runs["resumed on one process"][:shared] == runs["two processes"][:shared]
    gaps = entry["largest_parameter_difference"]
    assert 0 < max(gaps.values()) < entry["moved_from_initialisation"]
    full = entry["full_val_loss"]
    same = [full[k] for k in ("two processes", "resumed on one process", "one process")]
    assert max(same) - min(same) < abs(full["one process, seed 1"] - full["one process"]), \
        "rounding moves the validation loss less than another seed does"
