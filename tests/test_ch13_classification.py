"""tools/ch13_classification.py (chapter 13's which-play and word-order classifiers) and the entries it stored in
chapter13.json.

A tiny GPT stands in for chapter 7's model in the live run; the stored entries are checked against their commands,
the tool's settings and each other (the summary, the baselines, the low-rank spectra)."""

import copy
import json
import shlex
import statistics
import sys
from importlib import resources
from pathlib import Path

import pytest
import torch

from groundup.classification import (
    DEFAULT_PLAYS,
    PROBE_L2,
    balanced_subset,
    majority_accuracy,
    play_passages,
    word_order_task,
)
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
WORD_ORDER = {k: v for k, v in RUNS.items() if k.split("/")[:2] in (["word-order", b] for b in tool.BODIES)
              and "method" in v}
LORA_RANK = {k: v for k, v in RUNS.items() if k.startswith("word-order/lora-rank/") and "method" in v}
CONVERGED = {k: v for k, v in RUNS.items() if k.startswith("classification-converged-probe/")}
WORD_ORDER_BASELINES = {k: v for k, v in RUNS.items() if k.startswith("word-order/baselines/")}
TUNED = {k: v for k, v in RUNS.items() if k.startswith("word-order-tuned/")}


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


def _command_options(entry) -> dict[str, str]:
    """The ``--flag value`` pairs of a stored entry's command, after checking that it runs this tool in its
    environment."""
    words = shlex.split(entry["command"])
    env = shlex.split(tool.OLD_ENV if entry["command"].startswith(tool.OLD_ENV) else tool.ENV)
    assert words[:len(env)] == env and words[len(env):len(env) + 2] == ["python", "tools/ch13_classification.py"]
    return {w: words[i + 1] for i, w in enumerate(words) if w.startswith("--")}


def _environment(entry) -> dict:
    """The variables an entry must have recorded: the old two and one thread, or the notebooks' arithmetic."""
    if entry["command"].startswith(tool.OLD_ENV):
        return {"OMP_NUM_THREADS": "1", "MKL_CBWR": "COMPATIBLE", "ATEN_CPU_CAPABILITY": "default"}
    return {"OMP_NUM_THREADS": "1", **tool.NOTEBOOK_ARITHMETIC}


@pytest.mark.parametrize("key", sorted(FITS))
def test_stored_fine_tune_matches_its_command_and_settings(key):
    entry = RUNS[key]
    arg = _command_options(entry)
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
    assert entry["threads"] == 1 and entry["environment"] == _environment(entry)
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


# ---- the word-order task -----------------------------------------------------------------------------------------

def test_word_order_fine_tunes_train_on_one_balanced_subset(tiny):
    body, reference, lm_loss = tiny
    train = word_order_task(play_passages(DEFAULT_PLAYS, **tool.TASK)[0])
    rows = balanced_subset(train.labels, 32, seed=tool.SUBSET_SEED)
    full, low = tool.run_classifier("gpt", "full", 1, task_name="word-order", n_train=32, steps=4)
    c = full["config"]
    assert (c["task"], c["n_train"], c["n_available"], c["n_test"], c["train_counts"]) == (
        "word-order", 32, 4733, 1795, [16, 16])
    assert c["steps"] == 4 and full["curve"]["step"] == [1, 2, 3, 4] and c["batch_size"] == 4
    assert full["curve"]["train_loss"][0] == pytest.approx(0.693147, abs=1e-4)  # two classes, head at zero
    assert full["train_accuracy_passages"] == min(tool.TRAIN_SUBSET, 32) == 16 and low is not None
    assert full["lm_loss"]["after"] == tool.sig(lm_loss(body)) != full["lm_loss"]["before"]
    assert [train.labels[r] for r in rows].count(1) == 16


def test_word_order_probe_is_fitted_to_convergence_with_l2_from_held_out_scenes(tiny):
    body, reference, _ = tiny
    probe, low = tool.run_classifier("gpt", "probe", 2, task_name="word-order", n_train=64)
    c = probe["config"]
    assert low is None and probe["curve"] is None and "lr" not in c and "steps" not in c
    assert c["probe"]["l2"] in PROBE_L2 and c["probe"]["l2_grid"] == list(PROBE_L2) and c["probe"]["folds"] == 4
    losses = c["probe"]["held_out_loss"]
    assert losses[c["probe"]["l2_grid"].index(c["probe"]["l2"])] == min(losses)
    assert probe["lm_loss"]["after"] == probe["lm_loss"]["before"]
    assert all(torch.equal(reference[k], v) for k, v in body.state_dict().items())
    assert probe["trainable_params"] == 16 * 2 + 2 and 0.0 <= probe["test_accuracy"] <= 1.0


def test_word_order_baselines_on_a_subset(tiny):
    entry = tool.run_word_order_baselines(32)
    t = entry["task"]
    assert (t["n_train"], t["n_test"], t["train_counts"], t["test_counts"]) == (32, 1795, [16, 16], [898, 897])
    assert entry["majority_accuracy"] == tool.sig(898 / 1795)  # a tie in training: the first class, real
    assert 0.0 <= entry["ngram_accuracy"] <= 1.0 and 0.0 <= entry["lm_score_accuracy"] <= 1.0
    assert set(entry["lm_score"]["mean_score"]["test"]) == {"real", "shuffled"}
    cv = entry["ngram_l2_by_held_out_scenes"]
    assert cv["l2"] in PROBE_L2 and cv["held_out_loss"][cv["l2_grid"].index(cv["l2"])] == min(cv["held_out_loss"])
    assert 0.0 <= cv["accuracy"] <= 1.0


def test_word_order_commands_store_their_entries_and_summary(tiny, tmp_path, monkeypatch):
    monkeypatch.setattr(tool, "OUT", tmp_path / "chapter13.json")
    tool.main(["--task", "word-order", "--method", "probe", "--method", "lora", "--seed", "0", "--n-train", "16",
               "--steps", "2"])
    runs = json.loads((tmp_path / "chapter13.json").read_text())["runs"]
    assert set(runs) == {"word-order/gpt/probe/n16/seed0", "word-order/gpt/lora/n16/seed0", "word-order/summary"}
    assert runs["word-order/gpt/lora/n16/seed0"]["command"] == tool.command(
        "--task word-order --n-train 16 --steps 2 --body gpt --method lora --seed 0")
    summary = runs["word-order/summary"]
    assert summary["gpt/lora/n16"]["test_accuracy"] == [runs["word-order/gpt/lora/n16/seed0"]["test_accuracy"]]
    assert summary["gpt/lora/n16"]["std"] is None and summary["baselines"] == {}


def test_another_label_subset_is_stored_under_its_seed(tiny, tmp_path, monkeypatch):
    monkeypatch.setattr(tool, "OUT", tmp_path / "chapter13.json")
    tool.main(["--task", "word-order", "--method", "full", "--seed", "0", "--n-train", "16", "--subset-seed", "1",
               "--steps", "2"])
    runs = json.loads((tmp_path / "chapter13.json").read_text())["runs"]
    entry = runs["word-order/gpt/full/n16-subset1/seed0"]
    assert entry["command"] == tool.command(
        "--task word-order --n-train 16 --subset-seed 1 --steps 2 --body gpt --method full --seed 0")
    train = word_order_task(play_passages(DEFAULT_PLAYS, **tool.TASK)[0])
    rows = balanced_subset(train.labels, 16, seed=1)
    assert rows != balanced_subset(train.labels, 16, seed=tool.SUBSET_SEED)
    assert entry["config"]["subset_seed"] == 1 and entry["config"]["train_counts"] == train.select(rows).counts()
    assert runs["word-order/summary"]["gpt/full/n16-subset1"]["test_accuracy"] == [entry["test_accuracy"]]


def test_the_tuned_entry_chooses_on_held_out_scenes_and_stops_there(tiny, monkeypatch):
    monkeypatch.setattr(tool, "TUNED", dict(tool.TUNED, n_train=16, max_steps=4, every=2, seeds=(0, 1),
                                            lr_grid={"lora": (1e-3, 1e-2)}))
    entry = tool.run_tuned("lora")
    assert entry["steps_read"] == [2, 4] and set(entry["held_out_accuracy"]) == {"0.001", "0.01"}
    # the choice is the best held-out accuracy; ties go to fewer steps, then the smaller rate
    best = max(max(row) for row in entry["held_out_accuracy"].values())
    firsts = [(row.index(best), float(lr)) for lr, row in entry["held_out_accuracy"].items() if best in row]
    step_index, lr = min(firsts)
    assert entry["chosen"] == {"lr": lr, "steps": entry["steps_read"][step_index], "held_out_accuracy": best}
    for record in entry["seeds"].values():
        assert len(record["correct"]) == record["n_test"] == 1795 and set(record["correct"]) <= {"0", "1"}
        assert record["correct_count"] == record["correct"].count("1")
        assert record["test_accuracy"] == tool.sig(record["correct_count"] / 1795)
    # held-out accuracy is a count of 16 passages over the folds: a multiple of 1/16
    assert all(abs(16 * v - round(16 * v)) < 1e-6 for row in entry["held_out_accuracy"].values() for v in row)


@pytest.mark.parametrize("key", sorted(TUNED))
def test_stored_tuned_entry_is_consistent(key):
    from groundup.significance import wilson_interval

    entry = RUNS[key]
    arg = _command_options(entry)
    method = key.split("/")[2]
    assert key == f"word-order-tuned/gpt/{method}/n{tool.TUNED['n_train']}" and arg["--entry"] == "tuned"
    assert entry["method"] == method and entry["environment"] == _environment(entry)
    assert sorted(entry["seeds"]) == [str(s) for s in tool.TUNED["seeds"]]
    for record in entry["seeds"].values():
        right = record["correct"].count("1")
        assert (record["correct_count"], record["n_test"], len(record["correct"])) == (right, 1795, 1795)
        assert record["interval"] == [round(v, 5) for v in wilson_interval(right, 1795)]
    if method == "probe":
        stored = [RUNS.get(f"word-order/gpt/probe/n128/seed{s}") for s in tool.TUNED["seeds"]]
        for s, probe in zip(entry["seeds"], stored):
            if probe is not None and probe["command"].startswith(tool.ENV):  # the same arithmetic: the same probe
                assert entry["seeds"][s]["test_accuracy"] == probe["test_accuracy"]
        return
    table = entry["held_out_accuracy"]
    assert list(table) == [str(lr) for lr in tool.TUNED["lr_grid"][method]]
    best = max(max(row) for row in table.values())
    assert entry["chosen"]["held_out_accuracy"] == best
    assert table[str(entry["chosen"]["lr"])][entry["steps_read"].index(entry["chosen"]["steps"])] == best


@pytest.mark.parametrize("argv, message", [
    (["--n-train", "128"], "--n-train and --steps are for --task word-order"),
    (["--task", "word-order", "--n-train", "127"], "--n-train 127: n must be a positive multiple"),
    (["--task", "word-order", "--n-train", "8000"], "--n-train 8000: n=8000 needs 4000"),
    (["--task", "word-order", "--steps", "0"], "--steps must be a positive integer"),
    (["--task", "word-order", "--entry", "converged-probe"], "--entry converged-probe is for --task play"),
    (["--entry", "rank-summary"], "--entry rank-summary is for --task word-order"),
    (["--entry", "tuned"], "--entry tuned is for --task word-order"),
    (["--task", "word-order", "--entry", "rank", "--rank", "0"], "--rank must be positive integers"),
    (["--task", "word-order", "--subset-seed", "1"], "--subset-seed is for --entry classify with --n-train")])
def test_bad_word_order_arguments_name_the_flag(argv, message, capsys):
    with pytest.raises(SystemExit):
        tool.main(argv)
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("key", sorted(WORD_ORDER))
def test_stored_word_order_fine_tune_matches_its_command_and_settings(key):
    entry = RUNS[key]
    arg = _command_options(entry)
    method, seed, c = entry["method"], int(arg["--seed"]), entry["config"]
    n, subset = int(arg.get("--n-train", 4733)), int(arg.get("--subset-seed", tool.SUBSET_SEED))
    size = f"n{n}" if subset == tool.SUBSET_SEED else f"n{n}-subset{subset}"
    assert arg["--task"] == "word-order" and key == f"word-order/{arg['--body']}/{arg['--method']}/{size}/seed{seed}"
    assert (entry["body"], method, entry["seed"]) == (arg["--body"], arg["--method"], seed)
    assert (c["task"], c["n_train"], c["n_available"], c["n_test"], c["train_counts"]) == (
        "word-order", n, 4733, 1795, [n // 2, n // 2] if n < 4733 else [2367, 2366])
    assert c["subset_seed"] == subset and c["shuffle_seed"] == tool.WORD_ORDER_SEED
    assert c["pooling"] == ("last" if entry["body"] == "gpt" else "mean")
    if entry["body"].startswith("mlm"):  # pretraining seed = the run's seed, as the which-play entries
        assert entry["pretrain"]["steps"] == tool.MLM_STEPS and entry["pretrain"]["seed"] == seed
        same = RUNS.get(f"classification/{entry['body']}/probe/seed{seed}")
        assert same is None or same["pretrain"] == entry["pretrain"]
    if method == "probe":
        assert entry["curve"] is None and c["probe"]["l2"] in c["probe"]["l2_grid"] == tool.PROBE["l2_grid"]
        losses = c["probe"]["held_out_loss"]
        assert losses[c["probe"]["l2_grid"].index(c["probe"]["l2"])] == min(losses)
        assert entry["lm_loss"]["after"] == entry["lm_loss"]["before"]
    else:
        assert c["steps"] == int(arg.get("--steps", tool.FINETUNE["steps"])) == entry["curve"]["step"][-1]
        assert c["lr"] == tool.LR[method] and c["lora"] == (tool.LORA if method == "lora" else None)
    assert entry["threads"] == 1 and entry["environment"] == _environment(entry)
    assert 0.0 <= entry["test_accuracy"] <= 1.0 and (entry["lm_loss"] is None) == (method == "scratch")
    if method == "lora":
        assert entry["lm_loss"]["after_merged"] == pytest.approx(entry["lm_loss"]["after"], rel=1e-3)


def test_stored_word_order_summary_is_the_mean_and_spread_of_the_stored_seeds():
    if "word-order/summary" not in RUNS:
        pytest.skip("no word-order runs stored yet")
    stored = RUNS["word-order/summary"]
    assert tool.word_order_summary(ALL) == {k: v for k, v in stored.items() if k != "command"}
    for name, s in stored.items():
        if name not in ("baselines", "command") and len(s["test_accuracy"]) > 1:
            assert s["std"] == pytest.approx(statistics.stdev(s["test_accuracy"]), rel=1e-4)


@pytest.mark.parametrize("key", sorted(WORD_ORDER_BASELINES))
def test_stored_word_order_baselines_are_those_of_the_task(key):
    entry = RUNS[key]
    train, test = (word_order_task(p) for p in play_passages(DEFAULT_PLAYS, **tool.TASK))
    n = entry["task"]["n_train"]
    assert key == f"word-order/baselines/n{n}" and entry["task"]["test_counts"] == test.counts() == [898, 897]
    subset = train if n == len(train) else train.select(balanced_subset(train.labels, n, seed=tool.SUBSET_SEED))
    assert entry["task"]["train_counts"] == subset.counts()
    assert entry["majority_accuracy"] == tool.sig(majority_accuracy(subset, test))
    assert 0.0 <= entry["ngram_accuracy"] <= 1.0 and 0.0 <= entry["lm_score_accuracy"] <= 1.0
    assert (entry["ngram_l2_by_held_out_scenes"] is None) == (n > tool.NGRAM_CV_MAX)


# ---- accuracy against LoRA's rank (word-order) and the which-play converged probe ---------------------------------

def test_word_order_rank_sweep_stores_each_rank_and_its_summary(tiny, tmp_path, monkeypatch):
    monkeypatch.setattr(tool, "OUT", tmp_path / "chapter13.json")
    tiny_body = tool.load_body  # a fresh copy of the tiny GPT for every run, as the tool loads chapter 7's afresh
    monkeypatch.setattr(tool, "load_body", lambda name, seed: (copy.deepcopy(tiny_body(name, seed)[0]),
                                                               *tiny_body(name, seed)[1:]))
    argv = ["--task", "word-order", "--entry", "rank", "--seed", "0", "--n-train", "16", "--steps", "2"]
    tool.main(argv + ["--rank", "2", "--rank", "4"])
    runs = json.loads((tmp_path / "chapter13.json").read_text())["runs"]
    assert set(runs) == {"word-order/lora-rank/n16/r2/seed0", "word-order/lora-rank/n16/r4/seed0",
                         "word-order/lora-rank/n16/summary"}
    r4 = runs["word-order/lora-rank/n16/r4/seed0"]
    assert r4["command"] == tool.command("--task word-order --n-train 16 --steps 2 --entry rank --rank 4 --seed 0")
    assert r4["config"]["lora"]["r"] == 4 and r4["trainable_params"] == 4 * 4 * (16 + 16) + 16 * 2 + 2
    summary = runs["word-order/lora-rank/n16/summary"]
    assert list(summary["ranks"]) == ["2", "4"] and summary["ranks"]["4"]["test_accuracy"] == [r4["test_accuracy"]]
    assert summary["ranks"]["4"]["scale"] == tool.LORA["alpha"] / 4 and summary["ranks"]["2"]["std"] is None
    stamp = (tmp_path / "chapter13.json").read_text()
    tool.main(argv + ["--rank", "4", "--skip-stored"])  # nothing new to run: the entry is unchanged
    assert json.loads((tmp_path / "chapter13.json").read_text())["runs"][
        "word-order/lora-rank/n16/r4/seed0"] == json.loads(stamp)["runs"]["word-order/lora-rank/n16/r4/seed0"]


def test_rank_summary_takes_the_stored_rank_8_runs_for_rank_8():
    runs = {"word-order/gpt/lora/n128/seed0": {"config": {"steps": 60}},
            "word-order/gpt/lora/n128/seed1": {"config": {"steps": 150}},
            "word-order/lora-rank/n128/r4/seed1": {}}
    assert tool.rank_sources(runs, 8, 128, 60) == ["word-order/gpt/lora/n128/seed0"]
    assert tool.rank_sources(runs, 4, 128, 60) == ["word-order/lora-rank/n128/r4/seed1"]
    assert tool.rank_sources(runs, 16, 128, 60) == []


@pytest.mark.parametrize("key", sorted(LORA_RANK))
def test_stored_lora_rank_run_matches_its_command_and_settings(key):
    entry = RUNS[key]
    arg = _command_options(entry)
    r, seed, n, c = int(arg["--rank"]), int(arg["--seed"]), int(arg["--n-train"]), entry["config"]
    assert key == f"word-order/lora-rank/n{n}/r{r}/seed{seed}" and arg["--entry"] == "rank"
    assert (entry["body"], entry["method"], entry["seed"], c["lora"]) == ("gpt", "lora", seed, {**tool.LORA, "r": r})
    assert (c["task"], c["n_train"], c["steps"], c["lr"]) == ("word-order", n, int(arg["--steps"]), tool.LR["lora"])
    assert (n, c["steps"]) == (tool.RANK_SWEEP["n_train"], tool.RANK_SWEEP["steps"])
    # r (d_in + d_out) per adapted matrix (13.3): W_q, W_k, W_v, W_o of 4 blocks of width 128; a 128 x 2 head
    assert entry["trainable_params"] == 16 * r * (128 + 128) + 128 * 2 + 2
    assert entry["threads"] == 1 and entry["environment"] == _environment(entry)
    assert entry["lm_loss"]["after_merged"] == pytest.approx(entry["lm_loss"]["after"], rel=1e-3)


def test_stored_lora_rank_summary_is_the_stored_runs():
    if "word-order/lora-rank/n128/summary" not in RUNS:
        pytest.skip("no rank sweep stored yet")
    stored = RUNS["word-order/lora-rank/n128/summary"]
    assert tool.lora_rank_summary(ALL) == {k: v for k, v in stored.items() if k != "command"}
    rank8 = stored["ranks"]["8"]["keys"][0]
    assert rank8 in WORD_ORDER and stored["lm_loss_before"] == RUNS[rank8]["lm_loss"]["before"]
    # every run of the sweep started from the same chapter-7 model: one loss before
    assert {RUNS[k]["lm_loss"]["before"] for s in stored["ranks"].values() for k in s["keys"]} == {
        stored["lm_loss_before"]}
    for r, s in stored["ranks"].items():
        assert all(RUNS[k]["config"]["lora"]["r"] == int(r) for k in s["keys"]) and len(s["keys"]) == 3
        assert s["mean"] == pytest.approx(statistics.fmean(s["test_accuracy"]), rel=1e-4)
        assert s["std"] == pytest.approx(statistics.stdev(s["test_accuracy"]), rel=1e-4)


def test_which_play_converged_probe_is_fitted_on_all_passages(tiny):
    body, reference, _ = tiny
    probe, low = tool.run_classifier("gpt", "probe", 0, converged=True)
    c = probe["config"]
    assert low is None and probe["curve"] is None and "lr" not in c and c["n_train"] == 4733
    losses = c["probe"]["held_out_loss"]
    assert c["probe"]["l2"] in PROBE_L2 and losses[c["probe"]["l2_grid"].index(c["probe"]["l2"])] == min(losses)
    assert probe["trainable_params"] == 16 * 4 + 4 and probe["lm_loss"]["after"] == probe["lm_loss"]["before"]
    assert all(torch.equal(reference[k], v) for k, v in body.state_dict().items())


@pytest.mark.parametrize("key", sorted(CONVERGED))
def test_stored_converged_probe_matches_its_command(key):
    entry = RUNS[key]
    arg = _command_options(entry)
    assert key == f"classification-converged-probe/{arg['--body']}/seed{arg['--seed']}"
    assert arg["--entry"] == "converged-probe" and entry["body"] == arg["--body"] and entry["method"] == "probe"
    c = entry["config"]
    assert (c["n_train"], c["n_test"], c["probe"]["l2_grid"], c["probe"]["folds"]) == (
        4733, 1795, tool.PROBE["l2_grid"], tool.PROBE["folds"])
    losses = c["probe"]["held_out_loss"]
    assert losses[c["probe"]["l2_grid"].index(c["probe"]["l2"])] == min(losses)
    assert entry["ngram_accuracy"] == RUNS["classification/baselines"]["ngram_accuracy"]
    assert entry["lm_loss"]["after"] == entry["lm_loss"]["before"] and entry["threads"] == 1
