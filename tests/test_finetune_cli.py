"""``groundup finetune``: options, errors naming the flag, adapters-only run folders and exact --resume.

SmolLM2 is replaced by a tiny GPT and a byte-level tokenizer with the chat tokens (``finetuning.load_base`` is the
command's one place that loads a base model), so every run here takes a second or two.
"""

import argparse
import dataclasses
import json
import math
import sys
from importlib import resources
from pathlib import Path

import pytest
import torch
from ctrl_c import ctrl_c_on_call
from tiny_chat_base import tiny_base

import groundup.instructions as instructions
from groundup import finetuning
from groundup.cli import main
from groundup.footprint import device_memory
from groundup.lora import lora_layers
from groundup.models import GPT
from groundup.run_folder import LOCK_NAME
from groundup.training import CHECKPOINT_NAME, load_checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
STORED = resources.files("groundup").joinpath("results/chapter13.json")


@pytest.fixture
def base(monkeypatch):
    """The command's base model is the tiny one (seed 0); ``base.seed = 1`` makes it another base."""

    class Base:
        seed = 0
        loads = 0

        def __call__(self, name):
            assert name == finetuning.BASE_NAME
            self.loads += 1
            return tiny_base(self.seed)

    fake = Base()
    monkeypatch.setattr(finetuning, "load_base", fake)
    return fake


@pytest.fixture
def task_file(tmp_path):
    path = tmp_path / "sums.jsonl"
    lines = [json.dumps({"prompt": f"{a}+{b}", "answer": str(a + b)}) for a in range(6) for b in range(4)]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def finetune(*argv):
    return main(["finetune", "--no-progress", *map(str, argv)])


QUICK = ("--steps", 6, "--batch-size", 4, "--n-eval", 4, "--eval-interval", 6, "--eval-batches", 1, "--lr", 1e-2,
         "--warmup", 2, "--context", 160)


def _ctrl_c_at_step(monkeypatch, step: int):
    """Ctrl-C as the training loop asks for step ``step``'s batch; returns the real batch function."""
    return ctrl_c_on_call(monkeypatch, instructions, "instruction_batches", step)


def test_help_documents_every_option_with_its_default(capsys):
    with pytest.raises(SystemExit) as exit_:
        finetune("--help")
    assert exit_.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for option in ("--out", "--resume", "--task", "--data", "--rank", "--alpha", "--targets", "--steps",
                   "--batch-size", "--lr", "--warmup", "--seed", "--context", "--no-mask", "--n-train", "--n-eval",
                   "--eval-interval", "--eval-batches", "--threads", "--device", "--no-progress"):
        assert option in text, option
    d = finetuning.FINETUNE_DEFAULTS
    for flag, key in (("--rank", "rank"), ("--alpha", "alpha"), ("--steps", "steps"), ("--lr", "lr"),
                      ("--context", "context"), ("--n-eval", "n_eval"), ("--batch-size", "batch_size")):
        assert f"(default: {d[key]})" in text, flag
    assert "(default: W_q W_v" in text


@pytest.mark.parametrize("rank", ["0", "-3", "two"])
def test_a_rank_that_is_not_positive_is_a_usage_error_naming_rank(tmp_path, capsys, rank, base):
    with pytest.raises(SystemExit) as exit_:
        finetune("--out", tmp_path / "ft", f"--rank={rank}")
    assert exit_.value.code == 2
    assert f"argument --rank: must be a positive integer, got {rank if rank == 'two' else int(rank)}" in \
        capsys.readouterr().err.replace("'", "")
    assert base.loads == 0 and not (tmp_path / "ft").exists()


def test_a_rank_above_the_layers_size_names_rank(tmp_path, capsys, base, task_file):
    assert finetune("--out", tmp_path / "ft", "--data", task_file, "--rank", 17, *QUICK) == 1
    err = capsys.readouterr().err
    assert "error: --rank 17: r = 17 exceeds 16, the smallest min(in_features, out_features)" in err
    assert not (tmp_path / "ft").exists(), "a run that never started leaves no folder"


def test_an_impossible_rank_names_the_smallest_bound_of_all_the_targets_at_once(tmp_path, capsys, task_file,
                                                                               monkeypatch):
    # grouped-query attention, as SmolLM2's: W_q is 16 -> 16 but W_v 16 -> 8 (one key-value head of width 8)
    def gqa_base(name):
        model, tokenizer = tiny_base()
        torch.manual_seed(0)
        return GPT(dataclasses.replace(model.config, n_kv_heads=1)).eval(), tokenizer

    monkeypatch.setattr(finetuning, "load_base", gqa_base)
    for rank in (20, 12):  # above both bounds, then between them: one message, the real bound
        assert finetune("--out", tmp_path / "ft", "--data", task_file, "--rank", rank, *QUICK) == 1
        assert f"error: --rank {rank}: r = {rank} exceeds 8, the smallest min(in_features, out_features) among the " \
               "layers to adapt (blocks.0.attention.W_v: 16 -> 8): an update of rank above 8 is impossible there, " \
               "so r must be at most 8" in capsys.readouterr().err
    assert finetune("--out", tmp_path / "ft", "--data", task_file, "--rank", 8, *QUICK) == 0


@pytest.mark.skipif(device_memory() is None, reason="this system does not report its memory")
def test_a_batch_too_large_for_the_memory_is_refused_before_the_run_naming_batch_size(tmp_path, capsys, base,
                                                                                     task_file):
    out = tmp_path / "ft"
    assert finetune("--out", out, "--data", task_file, *QUICK, "--batch-size", 10**10) == 1
    said = capsys.readouterr()
    assert said.out == "", "refused before the announcement"
    assert said.err.startswith("error: --batch-size 10000000000 (batches of at least 10,000,000,000 x ")
    assert "GB of memory, more than this machine's" in said.err and said.err.endswith(
        "; choose a smaller --batch-size\n"), said.err
    assert not out.exists()


@pytest.mark.parametrize("stop", [RuntimeError("an error no handler expects"), KeyboardInterrupt()])
def test_a_run_that_stops_before_its_first_checkpoint_leaves_no_folder(tmp_path, capsys, base, task_file,
                                                                      monkeypatch, stop):
    def failing(*args, **kwargs):
        raise stop

    monkeypatch.setattr(finetuning, "train", failing)
    out, kept = tmp_path / "ft", tmp_path / "mine"
    kept.mkdir()  # a folder the user made is kept (empty: no lock left in it)
    for folder in (out, kept):
        if isinstance(stop, KeyboardInterrupt):
            assert finetune("--out", folder, "--data", task_file, *QUICK) == 130
            assert "before the first checkpoint: nothing to resume" in capsys.readouterr().err
        else:
            with pytest.raises(RuntimeError, match="no handler expects"):
                finetune("--out", folder, "--data", task_file, *QUICK)
    assert not out.exists() and list(kept.iterdir()) == []


def test_no_lock_stays_after_a_run_and_a_dead_runs_lock_does_not_block_resume(tmp_path, capsys, base, task_file,
                                                                             monkeypatch):
    out = tmp_path / "ft"
    real = _ctrl_c_at_step(monkeypatch, 3)
    assert finetune("--out", out, "--data", task_file, *QUICK) == 130
    assert sorted(p.name for p in out.iterdir()) == [CHECKPOINT_NAME, "history.json"], "the checkpoint, no lock"
    monkeypatch.setattr(instructions, "instruction_batches", real)
    # a killed run leaves its lock file with its process id; nobody holds the lock on it any more
    (out / LOCK_NAME).write_text("2147483646", encoding="utf-8")
    assert finetune("--out", out, "--resume") == 0
    assert "resuming" in capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir()) == [CHECKPOINT_NAME, "history.json"]
    assert torch.load(out / CHECKPOINT_NAME, weights_only=True)["step"] == 6


def test_the_defaults_are_the_chapters_settings_and_its_stored_commands_still_mean_what_they_stored():
    import ch13_results

    parser = argparse.ArgumentParser()
    finetuning.add_finetune_parser(parser.add_subparsers())

    def settings(argv):
        return finetuning._settings_from_args(parser.parse_args(["finetune", *map(str, argv)]), Path("DIR"))

    runs = {key: entry for key, entry in json.loads(STORED.read_text())["runs"].items()
            if "tools/ch13_results.py" in entry["command"] and "finetune_args" in entry}
    assert runs, "the chapter's stored fine-tunes"
    for key, entry in runs.items():
        stored = settings(entry["finetune_args"])
        s, t = entry["settings"], stored["train"]
        assert (stored["rank"], stored["alpha"], stored["targets"], stored["context"], stored["n_train"],
                stored["n_eval"], stored["mask_prompt"]) == (s["rank"], s["alpha"], s["targets"], s["context"],
                                                             s["n_train"], entry["n_eval"], entry["mask_prompt"]), key
        assert (t["max_steps"], t["batch_size"], t["learning_rate"], t["warmup_steps"], t["eval_interval"],
                t["eval_batches"], t["seed"]) == (s["steps"], s["batch_size"], s["lr"], s["warmup"],
                                                  s["eval_interval"], s["eval_batches"], entry["seed"]), key
        assert entry["max_new_tokens"] == finetuning.FINETUNE_DEFAULTS["max_new_tokens"]
        # the chapter's run is the command's default run: only the seed, the held-out size and --no-mask to give
        plain = ["--out", "DIR", "--seed", entry["seed"], "--n-eval", entry["n_eval"]]
        assert settings(plain + ([] if entry["mask_prompt"] else ["--no-mask"])) == stored, key
    d = finetuning.FINETUNE_DEFAULTS
    assert (d["steps"], d["warmup"], d["eval_interval"]) == (40, 4, 10)
    assert {k: d[k] for k in ch13_results.FINETUNE if k != "targets"} == {
        k: v for k, v in ch13_results.FINETUNE.items() if k != "targets"}


def test_unknown_targets_are_named(tmp_path, capsys, base, task_file):
    assert finetune("--out", tmp_path / "ft", "--data", task_file, "--targets", "W_q", "W_x", *QUICK) == 1
    assert "error: --targets W_q W_x: targets ['W_x'] name no nn.Linear layer" in capsys.readouterr().err


@pytest.mark.parametrize("content, message", [
    (None, "--data: task file .*missing.jsonl not found"),
    ('{"prompt": "1+1", "answer": "2"}\n{"prompt": oops}\n', "--data: .*line 2: not valid JSON"),
    ('{"prompt": "1+1"}\n', "--data: .*line 1: the object has no 'answer'"),
])
def test_a_missing_or_invalid_data_file_names_data(tmp_path, capsys, base, content, message):
    path = tmp_path / "missing.jsonl"
    if content is not None:
        path.write_text(content, encoding="utf-8")
    assert finetune("--out", tmp_path / "ft", "--data", path, *QUICK) == 1
    assert pytest.importorskip("re").search(message, capsys.readouterr().err)
    assert not (tmp_path / "ft").exists()


def test_too_few_examples_for_n_eval_and_examples_longer_than_the_context_name_the_flags(tmp_path, capsys, base,
                                                                                        task_file):
    assert finetune("--out", tmp_path / "a", "--data", task_file, *QUICK, "--n-eval", 24) == 1
    assert "holds 24 examples: too few to hold out --n-eval 24" in capsys.readouterr().err
    assert finetune("--out", tmp_path / "b", "--data", task_file, *QUICK, "--context", 50) == 1
    err = capsys.readouterr().err
    assert f"error: --context 50 is too short for --data {task_file}: its training example 0 is" in err


def test_a_tiny_run_writes_adapters_only_and_resume_after_ctrl_c_ends_as_the_uninterrupted_run(
        tmp_path, capsys, base, task_file, monkeypatch):
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    assert finetune("--out", whole, "--data", task_file, *QUICK) == 0
    said = capsys.readouterr().out
    assert "rank-8 adapters on W_q W_v" in said and "held-out exact match" in said

    real = _ctrl_c_at_step(monkeypatch, 4)
    assert finetune("--out", cut, "--data", task_file, *QUICK) == 130
    assert f"after step 4; checkpoint saved in {cut}; continue with: groundup finetune --out {cut} --resume" in \
        capsys.readouterr().err
    monkeypatch.setattr(instructions, "instruction_batches", real)
    assert finetune("--out", cut, "--resume") == 0
    resumed_said = capsys.readouterr().out
    assert f"resuming {cut} at step 4 of 6" in resumed_said

    a, b = (torch.load(d / CHECKPOINT_NAME, weights_only=True) for d in (whole, cut))
    assert a["adapters_only"] and b["adapters_only"] and a["step"] == b["step"] == 6
    assert a["history"]["train_loss"] == b["history"]["train_loss"]
    assert a["history"]["val_loss"] == b["history"]["val_loss"]
    for part in ("A", "B"):
        for name, t in a["model"][part].items():
            assert torch.equal(t, b["model"][part][name]), f"{part} of {name}"
    assert a["extra"]["finetune"]["data_sha256"] == b["extra"]["finetune"]["data_sha256"]
    # the same exact match and losses printed by both
    assert said.split("done: ")[1].split(" (greedy")[0] == resumed_said.split("done: ")[1].split(" (greedy")[0]
    # the checkpoint: the adapters (2 layers x r 8 x (16 + 16) each) and AdamW's moments, not the base
    n_adapter = sum(t.numel() for part in ("A", "B") for t in a["model"][part].values())
    assert n_adapter == 2 * 8 * (16 + 16)
    assert not any(k.startswith("token_embedding") for k in a["model"])
    model, _ = load_checkpoint(whole, tiny_base()[0])
    assert set(lora_layers(model)) == {"blocks.0.attention.W_q", "blocks.0.attention.W_v"}


def test_resume_refuses_adapters_for_another_base_and_new_settings(tmp_path, capsys, base, task_file):
    out = tmp_path / "ft"
    assert finetune("--out", out, "--data", task_file, *QUICK) == 0
    capsys.readouterr()
    assert finetune("--out", out, "--data", task_file, *QUICK) == 1
    assert "exists: add --resume" in capsys.readouterr().err
    assert finetune("--out", out, "--resume", "--rank", 4) == 1
    assert "do not give --rank" in capsys.readouterr().err
    base.seed = 1
    assert finetune("--out", out, "--resume") == 1
    assert f"error: --resume {out}: these adapters were trained on another base model" in capsys.readouterr().err
    base.seed = 0
    task_file.write_text(task_file.read_text() + '{"prompt": "9+9", "answer": "18"}\n')
    assert finetune("--out", out, "--resume") == 1
    assert "changed since the run started" in capsys.readouterr().err
    assert main(["train", "--out", str(out), "--resume"]) == 1
    assert f"continue it with groundup finetune --out {out} --resume" in capsys.readouterr().err


def test_the_dates_task_is_the_default(tmp_path, capsys, base):
    assert finetune("--out", tmp_path / "ft", "--n-train", 16, *QUICK, "--context", 256) == 0
    out = capsys.readouterr().out
    assert "on the dates task: 16 training examples" in out and "held-out exact match 0.0% of 4" in out
    settings = torch.load(tmp_path / "ft" / CHECKPOINT_NAME, weights_only=True)["extra"]["finetune"]
    assert settings["task"] == "dates" and settings["targets"] == ["W_q", "W_v"] and settings["mask_prompt"]


def test_sample_with_an_adapter_answers_as_the_fine_tuned_model_and_refuses_another_base(tmp_path, capsys, base,
                                                                                       task_file, monkeypatch):
    import groundup.pretrained as pretrained

    out = tmp_path / "ft"
    assert finetune("--out", out, "--data", task_file, *QUICK) == 0
    capsys.readouterr()
    monkeypatch.setattr(pretrained, "load_smollm2", lambda **_: tiny_base(base.seed))
    assert main(["sample", "--pretrained", "smollm2", "--adapter", str(out), "--chat", "--greedy", "--tokens", "16",
                 "--prompt", "4+3"]) == 0
    answer = capsys.readouterr().out.rstrip("\n")
    model, _ = load_checkpoint(out, tiny_base()[0])  # the adapters, not merged
    assert answer == instructions.generate_answer(model.eval(), tiny_base()[1], "4+3", max_new_tokens=16)
    base.seed = 1
    assert main(["sample", "--pretrained", "smollm2", "--adapter", str(out), "--prompt", "4+3"]) == 1
    assert f"error: --adapter {out}: these adapters were trained on another base model" in capsys.readouterr().err
    assert main(["sample", str(out)]) == 1
    assert f"sample with --pretrained smollm2 --adapter {out}" in capsys.readouterr().err
    assert main(["sample", "--pretrained", "gpt2", "--adapter", str(out)]) == 2
    assert "--adapter needs --pretrained smollm2" in capsys.readouterr().err


def test_sample_with_a_missing_adapter_folder_says_to_fine_tune_first(tmp_path, capsys, base, monkeypatch):
    import groundup.pretrained as pretrained

    monkeypatch.setattr(pretrained, "load_smollm2", lambda **_: tiny_base())
    missing = tmp_path / "nothing"
    for folder in (missing, tmp_path):  # no such folder; a folder without a checkpoint
        assert main(["sample", "--pretrained", "smollm2", "--adapter", str(folder), "--prompt", "4+3"]) == 1
        err = capsys.readouterr().err
        assert err == f"error: --adapter {folder}: no {CHECKPOINT_NAME} there: fine-tune first (groundup finetune " \
                      f"--out {folder})\n", err
    assert finetune("--out", missing, "--resume") == 1
    assert f"error: --resume {missing}: no {CHECKPOINT_NAME} there: fine-tune first" in capsys.readouterr().err
    assert not missing.exists()
    file = tmp_path / CHECKPOINT_NAME
    file.write_bytes(b"")
    assert main(["sample", "--pretrained", "smollm2", "--adapter", str(file), "--prompt", "4+3"]) == 1
    assert capsys.readouterr().err == f"error: --adapter {file} is a file: give the run folder groundup finetune " \
                                      f"wrote (it holds {CHECKPOINT_NAME})\n"


@pytest.mark.parametrize("part, value, message", [
    ("A", math.nan, r"the adapter's A of layer blocks.0.attention.W_q holds values that are not finite in "
                    r"torch.float32 \(nan or inf"),
    ("B", math.inf, r"the adapter's B of layer blocks.0.attention.W_q holds values that are not finite"),
    ("A", 1e38, r"the adapter of layer blocks.0.attention.W_q is too large for torch.float32: for inputs x whose "
                r"entries are at most 1, A x reaches 1e\+38, beyond 1.84e\+19 \(the square root of the largest "
                r"torch.float32 number: the next norm or dot product would overflow\); its A holds entries up to "
                r"1e\+38"),
    ("B", 1e38, r"the adapter of layer blocks.0.attention.W_q is too large for torch.float32: for inputs x whose "
                r"entries are at most 1, \(alpha / r\) B A x "
                r"reaches .*, beyond 1.84e\+19 .* its B up to 1e\+38:"),
])
def test_sample_refuses_adapters_that_are_not_finite_or_too_large_naming_the_tensor(
        tmp_path, capsys, base, task_file, monkeypatch, part, value, message):
    import re

    import groundup.pretrained as pretrained

    out = tmp_path / "ft"
    assert finetune("--out", out, "--data", task_file, *QUICK) == 0
    capsys.readouterr()
    ckpt = torch.load(out / CHECKPOINT_NAME, weights_only=True)
    ckpt["model"][part]["blocks.0.attention.W_q"][0, 0] = value  # one entry
    torch.save(ckpt, out / CHECKPOINT_NAME)
    monkeypatch.setattr(pretrained, "load_smollm2", lambda **_: tiny_base())
    assert main(["sample", "--pretrained", "smollm2", "--adapter", str(out), "--chat", "--greedy", "--tokens", "4",
                 "--prompt", "4+3"]) == 1
    said = capsys.readouterr()
    assert said.out == "" and re.search(f"^error: --adapter {re.escape(str(out))}: {message}", said.err), said.err
    assert finetune("--out", out, "--resume") == 1  # nor does a resume start from it
    assert re.search(message, capsys.readouterr().err)
