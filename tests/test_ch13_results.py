"""tools/ch13_results.py (chapter 13's base and LoRA runs on the dates task) and the entries it stored in
chapter13.json. SmolLM2 is replaced by a tiny GPT and a byte-level tokenizer through ``finetuning.load_base``."""

import json
import shlex
import sys
from importlib import resources
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from tiny_chat_base import tiny_base

from groundup import finetuning
from groundup.instructions import date_instructions, encode_instructions, exact_match_eval
from groundup.lora import lora_layers

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import ch13_results  # noqa: E402

STORED_PATH = resources.files("groundup").joinpath("results/chapter13.json")
RUNS = {key: entry for key, entry in (json.loads(STORED_PATH.read_text())["runs"] if STORED_PATH.is_file() else {})
        .items() if "tools/ch13_results.py" in entry["command"]}  # the classification runs: test_ch13_classification
TINY = dict(ch13_results.FINETUNE, steps=3, batch_size=2, n_train=8, eval_interval=3, eval_batches=1, warmup=1,
            lr=1e-2, context=256)




@pytest.fixture
def tiny(monkeypatch):
    monkeypatch.setattr(finetuning, "load_base", lambda name=finetuning.BASE_NAME: tiny_base())
    monkeypatch.setattr(ch13_results, "MAX_NEW_TOKENS", 4)


@pytest.mark.parametrize("mask_prompt", [True, False])
def test_a_fine_tune_entry_records_what_its_adapters_do(tmp_path, tiny, mask_prompt):
    out = tmp_path / "ft"
    entry = ch13_results.run_finetune(1, mask_prompt=mask_prompt, n_eval=3, out=out, settings=TINY)
    assert (entry["seed"], entry["mask_prompt"], entry["n_eval"], entry["settings"]) == (1, mask_prompt, 3, TINY)
    assert ("--no-mask" in entry["finetune_args"]) is not mask_prompt
    assert entry["eval_step"] == [3] and len(entry["val_loss"]) == 1 and len(entry["train_loss"]) == 3
    assert entry["val_loss_counts"] == ("answer tokens" if mask_prompt else "all tokens")
    # independently: the stored adapters on a fresh base give the recorded exact match and answers
    model, tokenizer = tiny_base()
    settings = finetuning.load_adapters(model, out, merge=False)
    assert settings["mask_prompt"] is mask_prompt and settings["train"]["seed"] == 1
    assert set(lora_layers(model)) == {"blocks.0.attention.W_q", "blocks.0.attention.W_v"}
    test = date_instructions("test", 3, seed=finetuning.DATA_SEED)
    score, predictions = exact_match_eval(model.eval(), tokenizer, test, max_new_tokens=4)
    assert entry["exact_match"] == score and entry["correct"] == round(3 * score)
    assert [e["answer"] for e in entry["examples"]] == predictions
    assert [e["expected"] for e in entry["examples"]] == [answer for _, answer in test]
    # the answer-token loss, one example at a time, from the logits
    val = date_instructions("val", 3, seed=finetuning.DATA_SEED)
    data = encode_instructions(tokenizer, val, context_length=256, mask_prompt=True)
    with torch.no_grad():
        nll = [F.cross_entropy(model(x[None])[0][0], y, ignore_index=-100, reduction="sum") for x, y in
               zip(data.ids, data.labels)]
    n = sum(int((y != -100).sum()) for y in data.labels)
    assert entry["val_token_loss"]["answer_tokens"] == n
    assert entry["val_token_loss"]["answer"] == pytest.approx(sum(nll).item() / n, abs=2e-5)
    assert entry["val_token_loss"]["all_tokens"] > n


def test_the_base_entry_scores_zero_and_three_shots(tiny):
    entry = ch13_results.run_base(2)
    model, tokenizer = tiny_base()
    test = date_instructions("test", 2, seed=finetuning.DATA_SEED)
    shots = date_instructions("train", 3, seed=finetuning.DATA_SEED)
    assert entry["shots"] == [list(s) for s in shots]
    for name, given in (("zero_shot", ()), ("3_shot", shots)):
        score, predictions = exact_match_eval(model, tokenizer, test, shots=given, max_new_tokens=4)
        assert entry[name]["exact_match"] == score
        assert [e["answer"] for e in entry[name]["examples"]] == predictions


def test_the_finetune_args_are_the_commands_flags():
    argv = ch13_results.finetune_args("DIR", 2, 50, False)
    parser = __import__("argparse").ArgumentParser()
    finetuning.add_finetune_parser(parser.add_subparsers())
    args = parser.parse_args(["finetune", *argv])
    s = ch13_results.FINETUNE
    assert (args.steps, args.batch_size, args.rank, args.lr, args.targets, args.seed, args.n_eval, args.no_mask) == (
        s["steps"], s["batch_size"], s["rank"], s["lr"], s["targets"], 2, 50, True)


@pytest.mark.parametrize("key", sorted(RUNS))
def test_stored_entry_matches_its_command_and_settings(key):
    entry = RUNS[key]
    words = shlex.split(entry["command"])
    assert words[0] == f"OMP_NUM_THREADS={entry['threads']}" and words[1:3] == ["python", "tools/ch13_results.py"]
    kind, n_eval = words[words.index("--entry") + 1], int(words[words.index("--n-eval") + 1])
    assert entry["entry"] == kind and entry["n_eval"] == n_eval
    if kind == "base":
        assert key == f"base/n{n_eval}"
        for name in ("zero_shot", "3_shot"):
            assert entry[name]["correct"] == round(entry[name]["exact_match"] * n_eval)
            assert len(entry[name]["examples"]) == 3
        return
    seed = int(words[words.index("--seed") + 1])
    assert key == f"{kind}/seed{seed}/n{n_eval}" and entry["seed"] == seed
    assert entry["mask_prompt"] is (kind == "lora")
    assert entry["settings"] == ch13_results.FINETUNE
    assert entry["finetune_args"] == ch13_results.finetune_args("DIR", seed, n_eval, kind == "lora")
    steps = ch13_results.FINETUNE["steps"]
    assert entry["eval_step"] == list(range(ch13_results.FINETUNE["eval_interval"], steps + 1,
                                            ch13_results.FINETUNE["eval_interval"]))
    assert len(entry["val_loss"]) == len(entry["eval_step"]) and len(entry["train_loss"]) == steps
    assert entry["correct"] == round(entry["exact_match"] * n_eval) and len(entry["examples"]) == 3
    assert entry["val_token_loss"]["all_tokens"] > entry["val_token_loss"]["answer_tokens"]
