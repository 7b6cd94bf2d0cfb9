"""Chapter 7's extras: the learning-rate range test (groundup.lr_range), the loss-law fit (groundup.loss_law),
gradient accumulation, and the stored entries of chapter07.json's "extras" against the tool that made them
(tools/ch07_extras.py)."""

import json
import math
import statistics
import sys
from importlib import resources
from pathlib import Path

import pytest
import torch

from groundup.data import get_batch
from groundup.loss_law import fit_loss_law, predict_loss
from groundup.lr_range import lr_range_test, moving_average, range_test_lrs, smooth_losses, suggest_lr
from groundup.models import GPT, GPTConfig
from groundup.training import TrainConfig, param_groups

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import ch07_extras as tool  # noqa: E402

TINY = dict(vocab_size=12, context_length=16, d_model=16, n_layers=2, n_heads=2)


def tiny_model(seed=0, **kw):
    torch.manual_seed(seed)
    return GPT(GPTConfig(**{**TINY, **kw}))


def pattern_data(n=2000):
    g = torch.Generator().manual_seed(0)
    ids = torch.arange(n) % 7
    return torch.where(torch.rand(n, generator=g) < 0.1, torch.randint(0, 12, (n,), generator=g), ids)


# --- the range test ------------------------------------------------------------------------------------------


def test_range_test_lrs_grow_by_one_factor_from_lr_min_to_lr_max():
    lrs = range_test_lrs(1e-6, 1.0, 150)
    reference = torch.logspace(-6, 0, 150, dtype=torch.float64)
    assert len(lrs) == 150 and lrs[0] == 1e-6
    assert torch.allclose(torch.tensor(lrs, dtype=torch.float64), reference, rtol=1e-12, atol=0)
    ratios = [b / a for a, b in zip(lrs, lrs[1:])]
    assert max(ratios) - min(ratios) < 1e-12 and math.isclose(ratios[0], 10 ** (6 / 149), rel_tol=1e-12)


@pytest.mark.parametrize("kw, word", [(dict(lr_min=0.0), "lr_min"), (dict(lr_max=-1.0), "lr_max"),
                                      (dict(lr_min=1.0, lr_max=0.1), "smaller"), (dict(steps=1), "steps"),
                                      (dict(steps=2.5), "steps")])
def test_range_test_lrs_name_the_bad_argument(kw, word):
    args = {"lr_min": 1e-6, "lr_max": 1.0, "steps": 10, **kw}
    with pytest.raises(ValueError, match=word):
        range_test_lrs(**args)


def hand_range_test(model, data, lrs, batch_size, seed):
    """The range test written out: AdamW on the package's groups, one batch per step at lrs[k], clipping at 1."""
    optimizer = torch.optim.AdamW(param_groups(model, 0.1), lr=lrs[0], betas=(0.9, 0.99))
    generator = torch.Generator().manual_seed(seed)
    losses = []
    for lr in lrs:
        for group in optimizer.param_groups:
            group["lr"] = lr
        x, y = get_batch(data, batch_size, model.config.context_length, generator=generator)
        _, loss = model(x, y)
        losses.append(loss.item())
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
    return losses


def test_range_test_is_the_loop_written_out_and_leaves_the_model_and_random_state_alone():
    data = pattern_data()
    model = tiny_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    config = TrainConfig(batch_size=4, seed=3, progress=False)
    lrs, losses = lr_range_test(model, data, config, lr_min=1e-4, lr_max=1e-1, steps=20, stop_factor=None)
    assert lrs == range_test_lrs(1e-4, 1e-1, 20) and len(losses) == 20
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert torch.equal(torch.get_rng_state(), rng)
    expected = hand_range_test(tiny_model(), data, lrs, 4, seed=3)
    assert losses == pytest.approx(expected, rel=1e-5, abs=1e-6)
    assert losses[-1] < losses[0] - 0.3  # 0.1 is a fine rate for this model: it learned


def test_range_test_stops_when_the_loss_explodes():
    lrs, losses = lr_range_test(tiny_model(), pattern_data(), TrainConfig(batch_size=4, progress=False),
                                lr_min=1e-3, lr_max=1e4, steps=80, stop_factor=1.5)
    assert len(lrs) == len(losses) < 80
    smoothed = smooth_losses(losses)
    assert smoothed[-1] > 1.5 * min(smoothed[:-1]) and all(s <= 1.5 * min(smoothed[:k + 1])
                                                            for k, s in enumerate(smoothed[:-1]))


def test_range_test_refuses_bad_arguments():
    with pytest.raises(TypeError, match="model"):
        lr_range_test(torch.nn.Linear(2, 2), pattern_data())
    with pytest.raises(TypeError, match="config"):
        lr_range_test(tiny_model(), pattern_data(), {"batch_size": 4})
    with pytest.raises(ValueError, match="stop_factor"):
        lr_range_test(tiny_model(), pattern_data(), stop_factor=0.5)


def test_smooth_losses_is_a_bias_corrected_moving_average():
    values = [3.0, 1.0, 2.0, 5.0]
    beta = 0.9
    by_hand, avg = [], 0.0
    for k, v in enumerate(values):
        avg = beta * avg + (1 - beta) * v
        by_hand.append(avg / (1 - beta ** (k + 1)))
    assert smooth_losses(values, beta) == pytest.approx(by_hand, rel=1e-12)
    assert smooth_losses(values, beta)[0] == pytest.approx(3.0)  # the correction: no pull towards 0
    assert smooth_losses(values, 0.0) == values


def test_moving_average_is_centred_and_shrinks_at_the_ends():
    values = [4.0, 1.0, 2.0, 8.0, 5.0]
    assert moving_average(values, 3) == pytest.approx([2.5, 7 / 3, 11 / 3, 5.0, 6.5])
    assert moving_average(values, 1) == values
    inner = torch.nn.functional.avg_pool1d(torch.tensor([values]), 3, stride=1)[0].tolist()
    assert moving_average(values, 3)[1:-1] == pytest.approx(inner)
    ramp = list(range(20))  # a centred average leaves a straight line where it is: no lag
    assert moving_average(ramp, 9)[4:-4] == pytest.approx(ramp[4:-4])
    with pytest.raises(ValueError, match="odd"):
        moving_average(values, 4)


def test_suggest_lr_finds_the_steepest_fall_and_the_minimum_of_a_known_curve():
    lrs = range_test_lrs(1e-5, 1.0, 101)  # log10(lr) = -5 + k / 20
    # a loss that falls like a logistic centred on lr = 1e-3 (k = 40), then rises after lr = 1e-1 (k = 80)
    losses = [3 - 2 / (1 + math.exp(-(math.log10(lr) + 3) * 4)) + 50 * max(0.0, math.log10(lr) + 1) ** 2
              for lr in lrs]
    s = suggest_lr(lrs, losses, window=1, skip_end=5)
    assert s["steepest"] == pytest.approx(1e-3, rel=1e-9)
    lowest = min(range(96), key=losses.__getitem__)
    assert s["minimum"] == lrs[lowest] and s["minimum_over_10"] == pytest.approx(lrs[lowest] / 10)
    assert 70 <= lowest <= 81
    with pytest.raises(ValueError, match="as long"):
        suggest_lr(lrs, losses[:-1])


# --- the loss-law fit ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("E", [0.0, 1.2])
def test_fit_recovers_the_law_that_made_the_points(E):
    K, a, b = 40.0, 0.07, 0.2
    n = [8e5, 8e5, 1.8e6, 1.8e6, 2.7e6, 2.7e6]
    d = [1e6, 1.1e7, 1e6, 7.7e6, 1e6, 3.8e6]
    losses = [E + K * ni ** -a * di ** -b for ni, di in zip(n, d)]
    fit = fit_loss_law(n, d, losses, irreducible=E)
    assert fit["K"] == pytest.approx(K, rel=1e-9) and fit["a"] == pytest.approx(a, rel=1e-9)
    assert fit["b"] == pytest.approx(b, rel=1e-9) and fit["E"] == E and fit["points"] == 6
    assert fit["rms_log_residual"] < 1e-10 and max(map(abs, fit["residuals"])) < 1e-10
    assert predict_loss(fit, 4e6, 2e7) == pytest.approx(E + K * 4e6 ** -a * 2e7 ** -b, rel=1e-9)


def test_fit_is_least_squares_on_log_loss():
    n = [1e6, 1e6, 2e6, 2e6, 4e6]
    d = [1e6, 4e6, 1e6, 4e6, 2e6]
    losses = [1.9, 1.6, 1.85, 1.55, 1.6]
    fit = fit_loss_law(n, d, losses)
    X = torch.tensor([[1.0, -math.log(a), -math.log(b)] for a, b in zip(n, d)], dtype=torch.float64)
    y = torch.tensor([math.log(v) for v in losses], dtype=torch.float64)
    coef = torch.linalg.solve(X.T @ X, X.T @ y)  # the normal equations
    assert [math.log(fit["K"]), fit["a"], fit["b"]] == pytest.approx(coef.tolist(), rel=1e-9)
    res = y - X @ coef
    assert fit["rms_log_residual"] == pytest.approx(math.sqrt((res ** 2).mean().item()), rel=1e-9)


@pytest.mark.parametrize("args, kw, word", [
    (([1e6, 2e6, 3e6], [1e6, 2e6, 3e6], [2.0, 1.9, 1.8]), {}, "at least 4"),
    (([1e6] * 4, [1e6, 2e6, 3e6, 4e6], [2.0, 1.9, 1.8, 1.7]), {}, "two different"),
    (([1e6, 2e6, 3e6, 4e6], [1e6, 2e6, 3e6, 4e6], [2.0, 1.9, 1.8, 1.7]), {"irreducible": 1.75}, "exceed"),
    (([1e6, 2e6, 3e6, -4e6], [1e6, 2e6, 3e6, 4e6], [2.0, 1.9, 1.8, 1.7]), {}, "n_params"),
    (([1e6, 2e6, 3e6, 4e6], [1e6, 2e6, 3e6], [2.0, 1.9, 1.8, 1.7]), {}, "as long"),
])
def test_fit_refuses_what_it_cannot_fit(args, kw, word):
    with pytest.raises(ValueError, match=word):
        fit_loss_law(*args, **kw)


# --- gradient accumulation and the tool's helpers ---------------------------------------------------------------


def test_accumulated_micro_batches_give_the_whole_batchs_gradient_and_loss():
    data = pattern_data()
    x, y = get_batch(data, 8, 16, generator=torch.Generator().manual_seed(0))
    model = tiny_model()
    whole = tool.accumulate_gradients(model, x, y, 1)
    grads = [p.grad.clone() for p in model.parameters()]
    _, loss = model(x, y)  # the reference: PyTorch's cross-entropy over all 8 x 16 targets at once
    assert whole == pytest.approx(loss.item(), rel=1e-6)
    for parts in (2, 4, 8):
        mean = tool.accumulate_gradients(model, x, y, parts)
        assert mean == pytest.approx(whole, rel=1e-6)
        for g, p in zip(grads, model.parameters()):
            torch.testing.assert_close(p.grad, g, rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="3 equal"):
        tool.accumulate_gradients(model, x, y, 3)


def test_autocast_forward_casts_each_call_and_one_context_keeps_stale_weights():
    model = tiny_model()
    x = torch.randint(0, 12, (2, 16), generator=torch.Generator().manual_seed(0))
    tool.autocast_forward(model)
    logits, loss = model(x, x)
    assert logits.dtype == torch.bfloat16 and loss.dtype == torch.float32
    assert not torch.is_autocast_enabled("cpu")  # the context ended with the call
    del model.forward
    assert model(x)[0].dtype == torch.float32
    # the pitfall the tool's third side measures: one context caches the bfloat16 weights of its first use
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 4, bias=False)
    v = torch.randn(3, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        first = lin(v)
        with torch.no_grad():
            lin.weight.mul_(0.5)
        stale = lin(v)
    assert torch.equal(first, stale)
    tool.autocast_forward(lin)
    fresh = lin(v)
    torch.testing.assert_close(fresh.float(), (v @ lin.weight.T).float(), rtol=2e-2, atol=2e-2)
    assert not torch.allclose(fresh.float(), first.float(), rtol=0.1)


def test_alternate_times_every_side_once_per_round_in_turn_and_summary_takes_medians():
    calls = []
    times = tool.alternate({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, rounds=3)
    assert calls == ["a", "b"] * 3 and [len(v) for v in times.values()] == [3, 3]
    s = tool._summary({"x": [3.0, 1.0, 2.0], "y": [1.0, 1.0, 0.5]}, "s")
    assert s["median"] == {"x": 2.0, "y": 1.0} and s["ratio"] == 2.0


def test_machine_names_the_cpu_and_its_bfloat16_flags():
    m = tool.machine()
    assert m["cpu"] and set(m["flags"]) >= {"avx512_bf16", "amx_bf16"} and m["threads"] >= 1
    assert m["cpu_capability"] == torch.backends.cpu.get_cpu_capability()


def test_main_stores_the_entry_under_extras_with_its_command(tmp_path, monkeypatch):
    out = tmp_path / "chapter07.json"
    out.write_text(json.dumps({"about": "x", "extras": {"other": 1}}))
    monkeypatch.setattr(tool, "OUT", out)
    monkeypatch.setattr(tool, "bf16_speed", lambda: {"ratio": 1.5})
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    tool.main(["--entry", "bf16-speed"])
    stored = json.loads(out.read_text())
    entry = stored["extras"]["bf16_speed"]
    assert stored["about"] == "x" and stored["extras"]["other"] == 1 and entry["ratio"] == 1.5
    assert "OMP_NUM_THREADS=1 python tools/ch07_extras.py --entry bf16-speed" in entry["command"]


# --- the stored entries ------------------------------------------------------------------------------------------


def stored(key):
    results = json.loads(resources.files("groundup").joinpath("results/chapter07.json").read_text())
    entry = results.get("extras", {}).get(key)
    if entry is None:
        pytest.skip(f"chapter07.json holds no extras/{key} yet")
    return entry


def check_summary(summary):
    medians = {side: statistics.median(ts) for side, ts in summary["per_round"].items()}
    assert summary["median"] == pytest.approx(medians, abs=1e-6)
    first, second = summary["median"]
    ratio = medians[first] / medians[second]
    # the times are stored rounded to 1e-6 s: that moves the ratio of two medians by up to this much
    rounding = ratio * (5e-7 / medians[first] + 5e-7 / medians[second])
    assert summary["ratio"] == pytest.approx(ratio, abs=rounding + 5e-4)


def test_stored_bf16_speed_holds_its_medians_ratios_and_machine():
    entry = stored("bf16_speed")
    assert entry["command"].endswith("python tools/ch07_extras.py --entry bf16-speed")
    assert entry["machine"]["cpu"] and "avx512_bf16" in entry["machine"]["flags"]
    assert set(entry["models"]) == set(tool.SPEED_SHAPES)
    assert set(entry["matmul"]) == {str(n) for n in tool.MATMUL_SIZES}
    for summary in [*entry["models"].values(), *entry["matmul"].values()]:
        assert all(len(ts) == entry["rounds"] for ts in summary["per_round"].values())
        check_summary(summary)


def test_stored_bf16_training_means_are_its_runs():
    entry = stored("bf16_training")
    assert "ATEN_CPU_CAPABILITY=default" in entry["command"] and "MKL_CBWR=COMPATIBLE" in entry["command"]
    assert set(entry["runs"]) == {f"{side}/seed{s}" for side in tool.SIDES[:2] for s in tool.SEEDS} | {
        f"{tool.SIDES[2]}/seed0"}
    for side in tool.SIDES[:2]:
        finals = [entry["runs"][f"{side}/seed{s}"]["full_val_loss_float32"] for s in tool.SEEDS]
        assert entry["final_mean"][side] == pytest.approx(statistics.fmean(finals), abs=1e-5)
        assert entry["final_sd"][side] == pytest.approx(statistics.stdev(finals), abs=1e-5)
        assert all(r["eval_step"][-1] == tool.TRAIN_STEPS for k, r in entry["runs"].items() if k.startswith(side))


def test_stored_accumulation_speed_holds_its_medians():
    entry = stored("accumulation_speed")
    check_summary(entry)
    assert set(entry["per_round"]) == {"1 x 32 rows", "4 x 8 rows accumulated"}


def test_stored_range_tests_suggest_what_their_losses_say():
    entry = stored("lr_range")
    assert entry["steps"] == tool.RANGE_STEPS and (entry["lr_min"], entry["lr_max"]) == tool.RANGE_LR
    for setup in entry["setups"].values():
        for run in setup["runs"].values():
            lrs = range_test_lrs(entry["lr_min"], entry["lr_max"], entry["steps"])[:run["stopped_at"]]
            assert len(run["losses"]) == run["stopped_at"]
            again = suggest_lr(lrs, run["losses"])
            assert run["suggestions"] == pytest.approx(again, rel=5e-3)  # stored to 3 significant digits


def test_stored_lr_rules_train_each_seed_at_its_range_tests_suggestions():
    entry = stored("lr_rules")
    assert "ATEN_CPU_CAPABILITY=default" in entry["command"] and "MKL_CBWR=COMPATIBLE" in entry["command"]
    setup = stored("lr_range")["setups"]["chapter 7"]
    assert set(entry["runs"]) == {f"{rule}/seed{s}" for rule in tool.RULES for s in tool.SEEDS}
    for seed in tool.SEEDS:
        rates = {rule: entry["runs"][f"{rule}/seed{seed}"]["lr"] for rule in tool.RULES}
        assert rates == tool.rule_rates(setup, seed) and rates["tuned_peak"] == 3e-3
        assert rates["steepest"] < rates["minimum"] and rates["minimum_over_10"] < rates["minimum"]
    for rule in tool.RULES:
        finals = [entry["runs"][f"{rule}/seed{s}"]["full_val_loss"] for s in tool.SEEDS]
        assert entry["final_mean"][rule] == pytest.approx(statistics.fmean(finals), abs=1e-5)
        assert entry["final_sd"][rule] == pytest.approx(statistics.stdev(finals), abs=1e-5)
    assert all(r["eval_step"][-1] == entry["training"]["max_steps"] == tool.TRAIN_STEPS for r in entry["runs"].values())
    # seeds 1 and 2 of the tuned peak are bf16-training's float32 runs; seed 0, trained again, gave the same loss
    bf16 = stored("bf16_training")
    assert entry["training"] == {k: v for k, v in bf16["training"].items() if k != "seed"}
    for seed in tool.SEEDS:
        assert entry["runs"][f"tuned_peak/seed{seed}"]["full_val_loss"] == \
            bf16["runs"][f"float32/seed{seed}"]["full_val_loss_float32"]
