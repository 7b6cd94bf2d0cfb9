"""tools/ch13_results.py (chapter 13's base and LoRA runs on the dates task) and the entries it stored in
chapter13.json. SmolLM2 is replaced by a tiny GPT and a byte-level tokenizer through ``finetuning.load_base``."""

import dataclasses
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
from groundup.instructions import (
    DATE_FORMATS,
    Prediction,
    date_format,
    date_instructions,
    encode_instructions,
    error_breakdown,
    evaluate_answers,
    exact_match_eval,
    format_shots,
    generate_answer,
)
from groundup.lora import lora_layers
from groundup.models import GPT
from groundup.significance import mcnemar_test, wilson_interval

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


@pytest.fixture
def tiny_long(monkeypatch):
    """A tiny base in float64 (batched and one-at-a-time answers agree exactly) with a context long enough for the
    11 shots of format_shots written in bytes (about 2,000 tokens)."""
    def load(name=finetuning.BASE_NAME):
        model, tokenizer = tiny_base()
        torch.manual_seed(0)
        long = GPT(dataclasses.replace(model.config, context_length=4096))
        return long.double().eval(), tokenizer

    monkeypatch.setattr(finetuning, "load_base", load)
    monkeypatch.setattr(ch13_results, "MAX_NEW_TOKENS", 4)


def _stored_predictions(record: dict, n_eval: int) -> list[Prediction]:
    """The Prediction objects of a stored held-out record, rebuilt from its replies and the test dates."""
    test = date_instructions("test", n_eval, seed=finetuning.DATA_SEED)
    unended = set(record["unended"])
    return [Prediction(i, date_format(prompt.rsplit(": ", 1)[-1]), answer, text, i not in unended, text.strip())
            for i, ((prompt, answer), text) in enumerate(zip(test, record["predictions"], strict=True))]


def _check_record(record: dict, n_eval: int, shots) -> list[Prediction]:
    """A held-out record agrees with its own replies: counts, interval, errors by kind, field and format."""
    predictions = _stored_predictions(record, n_eval)
    correct = sum(p.correct for p in predictions)
    assert (record["n"], record["correct"]) == (n_eval, correct)
    assert record["exact_match"] == correct / n_eval
    assert record["interval"] == [round(v, 5) for v in wilson_interval(correct, n_eval)]
    found = error_breakdown(predictions, shots)
    assert {k: record[k] for k in ("kinds", "fields", "by_format")} == {
        k: found[k] for k in ("kinds", "fields", "by_format")}
    assert sum(record["kinds"].values()) == n_eval - correct
    return predictions


def test_the_base_eval_entry_stores_every_prediction(tiny_long):
    entry = ch13_results.run_base_eval(5, batch_size=2)
    model, tokenizer = finetuning.load_base()
    test = date_instructions("test", 5, seed=finetuning.DATA_SEED)
    shots = format_shots(finetuning.DATA_SEED)
    assert entry["shots"] == [[p.rsplit(": ", 1)[-1], a] for p, a in shots]
    assert sorted(entry["shot_formats"]) == sorted(DATE_FORMATS)
    assert (entry["n_eval"], entry["max_new_tokens"], entry["batch_size"]) == (5, 4, 2)
    found = {}
    for name, given in (("zero_shot", ()), ("11_shot", shots)):
        record = entry[name]
        # every reply is the one-at-a-time greedy reply
        assert record["predictions"] == [generate_answer(model, tokenizer, p, shots=given, max_new_tokens=4)
                                         for p, _ in test]
        found[name] = _check_record(record, 5, given)
        assert record["seconds_per_question"] >= 0
    test_ = mcnemar_test([p.correct for p in found["11_shot"]], [p.correct for p in found["zero_shot"]])
    assert entry["mcnemar"] == {"a": "11_shot", "b": "zero_shot", "a_only": test_.a_only, "b_only": test_.b_only,
                                "both": test_.both, "neither": test_.neither, "p_value": test_.p_value}


def test_a_fine_tune_entry_with_n_test_stores_every_prediction(tmp_path, tiny):
    out = tmp_path / "ft"
    entry = ch13_results.run_finetune(0, n_eval=2, out=out, settings=TINY, n_test=3, batch_size=2)
    assert (entry["n_test"], entry["batch_size"]) == (3, 2)
    model, tokenizer = tiny_base()
    finetuning.load_adapters(model, out, merge=False)
    test = date_instructions("test", 3, seed=finetuning.DATA_SEED)
    predictions = evaluate_answers(model.eval(), tokenizer, test, max_new_tokens=4, batch_size=2)
    assert entry["held_out"]["predictions"] == [p.text for p in predictions]
    _check_record(entry["held_out"], 3, ())


def test_main_stores_a_base_eval_entry_with_its_command(tiny_long, monkeypatch):
    stored = {}
    monkeypatch.setattr(ch13_results, "store", lambda key, entry: stored.update({key: entry}))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    ch13_results.main(["--entry", "base-eval", "--n-eval", "3", "--batch-size", "2"])
    (key, entry), = stored.items()
    assert key == "base-eval/n3" and entry["entry"] == "base-eval"
    assert entry["command"] == ("OMP_NUM_THREADS=1 python tools/ch13_results.py --entry base-eval --n-eval 3 "
                                "--batch-size 2")
    assert len(entry["zero_shot"]["predictions"]) == 3
    with pytest.raises(SystemExit):
        ch13_results.main(["--entry", "lora", "--n-test", "0"])


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


def test_the_answer_weighted_loss_is_the_masked_mean_plus_the_prompts_share():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 7)
    targets = torch.tensor([[1, 2, 3, 4, -100], [5, 6, 0, -100, -100]])
    answer = torch.tensor([[False, False, True, True, False], [False, True, True, True, False]])  # one on a -100
    losses = -torch.log_softmax(logits, -1)
    terms = {(b, t): losses[b, t, targets[b, t]].item() for b in range(2) for t in range(5) if targets[b, t] >= 0}
    answers = [(0, 2), (0, 3), (1, 1), (1, 2)]
    prompt = [k for k in terms if k not in answers]
    expected = sum(terms[k] for k in prompt) / len(terms) + sum(terms[k] for k in answers) / len(answers)
    found = ch13_results.answer_weighted_loss(logits, targets, answer)
    assert found.item() == pytest.approx(expected, rel=1e-6)
    # with no prompt targets it is the masked mean; the answer's share of the plain mean is N_a / N
    only = torch.where(answer, targets, torch.full_like(targets, -100))
    assert found.item() > F.cross_entropy(logits.flatten(0, 1), targets.flatten()).item()
    assert ch13_results.answer_weighted_loss(logits, only, answer).item() == pytest.approx(
        F.cross_entropy(logits.flatten(0, 1), only.flatten()).item(), rel=1e-6)


def test_weighted_batches_draw_the_same_examples_and_mark_the_answer(tiny):
    _, tokenizer = tiny_base()
    pairs = date_instructions("train", 6, seed=finetuning.DATA_SEED)
    plain = encode_instructions(tokenizer, pairs, context_length=256, mask_prompt=False)
    masked = encode_instructions(tokenizer, pairs, context_length=256, mask_prompt=True)
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    (ids, answer), targets = ch13_results.weighted_batches((plain, masked), 4, 256, g1)
    (ids_, ), targets_ = ch13_results.instruction_batches(plain, 4, 256, g2)
    assert torch.equal(ids, ids_) and torch.equal(targets, targets_)
    assert torch.equal(g1.get_state(), g2.get_state())  # the run's random stream advances as without the control
    assert torch.equal(targets[answer], targets[answer]) and bool((targets[answer] >= 0).all())
    assert 0 < int(answer.sum()) < int((targets >= 0).sum())


def test_the_weighted_control_and_the_answer_curve(tmp_path, tiny):
    entry = ch13_results.run_finetune(0, mask_prompt=False, n_eval=3, settings=TINY, weighted=True)
    assert entry["loss"] == "answer_weighted_loss" and "weighted" in entry["val_loss_counts"]
    masked = ch13_results.run_finetune(0, n_eval=3, settings=TINY)
    assert masked["answer_val_step"] == [0, 3] and masked["answer_val_loss"][1:] == masked["val_loss"]
    assert entry["answer_val_loss"][0] == masked["answer_val_loss"][0]  # the same base, B = 0
    assert entry["val_loss"][0] > entry["answer_val_loss"][1]  # its own loss adds the prompt's share
    general = masked["general_text_loss"]
    assert general["before"] == entry["general_text_loss"]["before"] and general["after"] != general["before"]
    with pytest.raises(ValueError, match="mask_prompt=False"):
        ch13_results.run_finetune(0, n_eval=3, settings=TINY, weighted=True)


def test_the_ch10_entry_trains_chapter_10s_model_and_scores_every_reply(monkeypatch):
    from groundup import runs
    from groundup.seq2seq import collate, date_tokenizers, greedy_decode

    monkeypatch.setattr(runs, "DATES_TRAINING", dict(runs.DATES_TRAINING, max_steps=4, eval_interval=4))
    entry = ch13_results.run_ch10([3], 6)
    record = entry["seeds"]["3"]
    assert (entry["n_eval"], entry["examples_seen"], entry["parameters"]) == (6, 4 * 64, 173_632)
    predictions = _check_record(record, 6, ())
    assert [p.expected for p in predictions] == [a for _, a in date_instructions("test", 6)]
    # the same replies from a model trained the same way by hand
    torch.manual_seed(3)
    src_tok, tgt_tok, train_data, val_data, test_pairs = runs._dates_data()
    config = runs._dates_model_config(lambda flag, key: runs.DATES_MODEL[key], (src_tok.vocab_size,
                                                                                 tgt_tok.vocab_size))
    model = runs.EncoderDecoder(config)
    from groundup.seq2seq import batches
    from groundup.training import TrainConfig, train
    train(model, train_data, val_data, TrainConfig(**runs.DATES_TRAINING, seed=3, progress=False), batches=batches)
    src = collate([src_tok.encode(s) for s, _ in test_pairs[:6]])
    assert record["predictions"] == [tgt_tok.decode(ids) for ids in greedy_decode(model.eval(), src)]
    assert date_tokenizers()[0] == src_tok


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
    if kind == "base-eval":
        assert key == f"base-eval/n{n_eval}" and entry["batch_size"] == int(words[words.index("--batch-size") + 1])
        shots = format_shots(finetuning.DATA_SEED)
        assert entry["shots"] == [[p.rsplit(": ", 1)[-1], a] for p, a in shots]
        found = {name: _check_record(entry[name], n_eval, given)
                 for name, given in (("zero_shot", ()), (f"{len(shots)}_shot", shots))}
        test = mcnemar_test(*[[p.correct for p in found[name]] for name in (f"{len(shots)}_shot", "zero_shot")])
        assert (entry["mcnemar"]["a_only"], entry["mcnemar"]["b_only"], entry["mcnemar"]["p_value"]) == (
            test.a_only, test.b_only, test.p_value)
        return
    if kind == "ch10":
        assert key == f"ch10/n{n_eval}" and sorted(entry["seeds"]) == ["0", "1", "2"]
        for record in entry["seeds"].values():
            _check_record(record, n_eval, ())
        return
    if kind == "base":
        assert key == f"base/n{n_eval}"
        for name in ("zero_shot", "3_shot"):
            assert entry[name]["correct"] == round(entry[name]["exact_match"] * n_eval)
            assert len(entry[name]["examples"]) == 3
        return
    seed = int(words[words.index("--seed") + 1])
    n_test = int(words[words.index("--n-test") + 1]) if "--n-test" in words else None
    assert key == f"{kind}/seed{seed}/n{n_eval}" + ("" if n_test is None else f"/test{n_test}")
    assert entry["seed"] == seed
    if n_test is not None:
        assert entry["n_test"] == n_test
        _check_record(entry["held_out"], n_test, ())
    assert entry["mask_prompt"] is (kind == "lora")
    assert entry.get("loss") == ("answer_weighted_loss" if kind == "lora-weighted" else None)
    if "answer_val_loss" in entry:
        assert entry["answer_val_step"] == [0, *entry["eval_step"]]
        assert (entry["answer_val_loss"][1:] == entry["val_loss"]) is (kind == "lora")
        assert entry["general_text_loss"]["before"] == pytest.approx(3.658, abs=0.01)  # the base model's
    assert entry["settings"] == ch13_results.FINETUNE
    assert entry["finetune_args"] == ch13_results.finetune_args("DIR", seed, n_eval, kind == "lora")
    steps = ch13_results.FINETUNE["steps"]
    assert entry["eval_step"] == list(range(ch13_results.FINETUNE["eval_interval"], steps + 1,
                                            ch13_results.FINETUNE["eval_interval"]))
    assert len(entry["val_loss"]) == len(entry["eval_step"]) and len(entry["train_loss"]) == steps
    assert entry["correct"] == round(entry["exact_match"] * n_eval) and len(entry["examples"]) == 3
    assert entry["val_token_loss"]["all_tokens"] > entry["val_token_loss"]["answer_tokens"]
