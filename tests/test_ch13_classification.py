"""tools/ch13_classification.py (chapter 13's which-play classifiers) and the entries it stored in chapter13.json.

A tiny GPT stands in for chapter 7's model in the live run; the stored entries are checked against their commands,
the tool's settings and each other (the summary, the baselines, the low-rank spectra)."""

import json
import shlex
import statistics
import sys
from importlib import resources
from pathlib import Path

import pytest
import torch

from groundup.classification import DEFAULT_PLAYS, majority_accuracy, play_passages
from groundup.data import load_corpus, train_val_split
from groundup.models import GPT, GPTConfig
from groundup.tokenizers import CharTokenizer
from groundup.training import evaluate

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import ch13_classification as tool  # noqa: E402

STORED_PATH = resources.files("groundup").joinpath("results/chapter13.json")
ALL = json.loads(STORED_PATH.read_text())["runs"] if STORED_PATH.is_file() else {}
RUNS = {k: v for k, v in ALL.items() if "tools/ch13_classification.py" in v["command"]}
FITS = {k: v for k, v in RUNS.items() if k.startswith(("classification/", "lora_rank/")) and "method" in v}


@pytest.fixture
def tiny(monkeypatch):
    """Chapter 7's GPT replaced by a tiny one (same tokenizer and context); 3 fine-tuning steps."""
    tokenizer = CharTokenizer.from_text(load_corpus("shakespeare"))
    torch.manual_seed(0)
    body = GPT(GPTConfig(vocab_size=tokenizer.vocab_size, context_length=64, d_model=16, n_layers=1, n_heads=2))
    val_ids = train_val_split(torch.tensor(tokenizer.encode(load_corpus("shakespeare"))), 0.1)[1]
    lm_loss = lambda m: evaluate(m, val_ids, batch_size=4, max_batches=2)  # noqa: E731
    reference = {k: v.clone() for k, v in body.state_dict().items()}
    monkeypatch.setattr(tool, "load_body", lambda name, seed: (body, tokenizer, lm_loss, "tiny", None))
    monkeypatch.setattr(tool, "FINETUNE", dict(tool.FINETUNE, steps=3, batch_size=4, warmup=1))
    monkeypatch.setattr(tool, "TRAIN_SUBSET", 16)
    return body, reference, lm_loss


def test_a_full_fine_tune_entry_and_its_update_spectra(tiny):
    body, reference, lm_loss = tiny
    entry, low = tool.run_classifier("gpt", "full", 0)
    fresh = GPT(body.config)
    fresh.load_state_dict(reference)
    assert entry["lm_loss"]["before"] == tool.sig(lm_loss(fresh)) and entry["lm_loss"]["after"] == tool.sig(
        lm_loss(body))
    assert entry["trainable_params"] == entry["total_params"] == sum(p.numel() for p in body.parameters()) + 16 * 4 + 4
    assert entry["curve"]["step"] == [1, 2, 3] and entry["curve"]["train_loss"][0] == pytest.approx(1.38629, abs=1e-4)
    name = "blocks.0.attention.W_q"
    dw = (body.state_dict()[name + ".weight"] - reference[name + ".weight"]).double()
    s = torch.linalg.svdvals(dw)  # independent of the tool's loop over matrices
    m = low["matrices"][name]
    assert m["shape"] == [16, 16] and m["dW_fro"] == pytest.approx(dw.norm().item(), rel=1e-4)
    assert m["singular_values"] == pytest.approx((s / s[0]).tolist(), rel=1e-4)
    assert m["energy_top_r"]["1"] == pytest.approx((s[0] ** 2 / (s ** 2).sum()).item(), rel=1e-4)
    assert m["energy_top_r"]["16"] == pytest.approx(1.0)  # a 16 x 16 update has at most 16 singular values
    assert set(low["matrices"]) == {f"blocks.0.{part}" for part in (
        "attention.W_q", "attention.W_k", "attention.W_v", "attention.W_o", "ffn.W_in", "ffn.W_out")}


def test_probe_and_lora_entries_count_their_parameters_and_merge(tiny):
    body, reference, _ = tiny
    probe, low = tool.run_classifier("gpt", "probe", 0)
    assert low is None and probe["trainable_params"] == 16 * 4 + 4
    assert probe["lm_loss"]["after"] == probe["lm_loss"]["before"]  # the frozen body is unchanged
    assert all(torch.equal(reference[k], v) for k, v in body.state_dict().items())
    lora, _ = tool.run_classifier("gpt", "lora", 0, rank=2)
    assert lora["trainable_params"] == 4 * 2 * (16 + 16) + 16 * 4 + 4 and lora["config"]["lora"]["r"] == 2
    assert lora["lm_loss"]["after_merged"] == pytest.approx(lora["lm_loss"]["after"], rel=1e-4)
    scratch, _ = tool.run_classifier("gpt", "scratch", 0)
    assert scratch["lm_loss"] is None and 0.0 <= scratch["test_accuracy"] <= 1.0


@pytest.mark.parametrize("key", sorted(FITS))
def test_stored_fine_tune_matches_its_command_and_settings(key):
    entry = RUNS[key]
    words = shlex.split(entry["command"])
    assert words[:3] == shlex.split(tool.ENV) and words[3:5] == ["python", "tools/ch13_classification.py"]
    arg = {w: words[i + 1] for i, w in enumerate(words) if w.startswith("--")}
    method, seed = entry["method"], int(arg["--seed"])
    if key.startswith("lora_rank/"):
        assert key == f"lora_rank/gpt/r{arg['--rank']}/seed{seed}" and method == "lora"
        assert entry["config"]["lora"]["r"] == int(arg["--rank"])
    else:
        assert key == f"classification/{arg['--body']}/{arg['--method']}/seed{seed}"
        assert entry["body"] == arg["--body"] and method == arg["--method"]
        assert entry["config"]["lora"] == (tool.LORA if method == "lora" else None)
    c = entry["config"]
    assert entry["seed"] == seed and {k: c[k] for k in tool.FINETUNE} == tool.FINETUNE and c["lr"] == tool.LR[method]
    assert (c["n_train"], c["n_test"], c["passage_chars"]) == (4733, 1795, tool.TASK["passage_chars"])
    assert c["pooling"] == ("last" if entry["body"] == "gpt" else "mean")
    assert entry["curve"]["step"][-1] == c["steps"] and len(entry["curve"]["step"]) <= 40
    assert entry["threads"] == 1 and entry["environment"] == {
        "OMP_NUM_THREADS": "1", "MKL_CBWR": "COMPATIBLE", "ATEN_CPU_CAPABILITY": "default"}
    assert 0.0 <= entry["test_accuracy"] <= 1.0 and entry["test_loss"] > 0
    assert (entry["lm_loss"] is None) == (method == "scratch")
    if method == "probe":
        assert entry["lm_loss"]["after"] == entry["lm_loss"]["before"]
    if method == "lora":
        assert entry["lm_loss"]["after_merged"] == pytest.approx(entry["lm_loss"]["after"], rel=1e-3)
    if entry["body"].startswith("mlm"):
        assert entry["pretrain"]["steps"] == tool.MLM_STEPS and entry["pretrain"]["seed"] == seed


def test_stored_summary_is_the_mean_and_spread_of_the_stored_seeds():
    if "classification/summary" not in RUNS:
        pytest.skip("no classification runs stored yet")
    stored = RUNS["classification/summary"]
    assert tool.summary(ALL) == {k: v for k, v in stored.items() if k != "command"}
    for name, s in stored.items():
        if "/" in name and len(s["test_accuracy"]) > 1:
            assert s["mean"] == pytest.approx(statistics.fmean(s["test_accuracy"]), rel=1e-4)
            assert s["std"] == pytest.approx(statistics.stdev(s["test_accuracy"]), rel=1e-4)


def test_stored_baselines_are_those_of_the_task():
    if "classification/baselines" not in RUNS:
        pytest.skip("no baselines stored yet")
    entry = RUNS["classification/baselines"]
    train, test = play_passages(DEFAULT_PLAYS, **tool.TASK)
    assert entry["task"]["n_train"] == len(train) and entry["task"]["test_counts"] == test.counts()
    assert entry["majority_accuracy"] == tool.sig(majority_accuracy(train, test))
    assert 0.25 < entry["majority_accuracy"] < entry["ngram_accuracy"] < 1.0


def test_stored_update_spectra_are_normalised_and_cumulative():
    lows = {k: v for k, v in RUNS.items() if k.startswith("lowrank/")}
    if not lows:
        pytest.skip("no low-rank analysis stored yet")
    for low in lows.values():
        for m in low["matrices"].values():
            sv = m["singular_values"]
            assert sv[0] == 1.0 and all(a >= b for a, b in zip(sv, sv[1:])) and len(sv) == tool.TOP_SINGULAR
            energy = [m["energy_top_r"][str(r)] for r in tool.ENERGY_RANKS]
            assert all(0 < a <= b <= 1 for a, b in zip(energy, energy[1:]))
            assert energy[0] <= (1 + 1e-4) / sum(v * v for v in sv)  # the top 32 hold at most all of ||dW||^2
