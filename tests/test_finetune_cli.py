"""``groundup finetune``: options, errors naming the flag, adapters-only run folders and exact --resume.

SmolLM2 is replaced by a tiny GPT and a byte-level tokenizer with the chat tokens (``finetuning.load_base`` is the
command's one place that loads a base model), so every run here takes a second or two.
"""

import json
import signal

import pytest
import torch
from tiny_chat_base import tiny_base

import groundup.instructions as instructions
from groundup import finetuning
from groundup.cli import main
from groundup.lora import lora_layers
from groundup.training import CHECKPOINT_NAME, load_checkpoint


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
    assert "error: --rank 17: r = 17 exceeds min(in_features, out_features) = 16" in err
    assert not (tmp_path / "ft").exists(), "a run that never started leaves no folder"


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

    calls = {"n": 0}
    real = instructions.instruction_batches

    def interrupting(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 4:
            signal.raise_signal(signal.SIGINT)  # Ctrl-C during step 4
        return real(*args, **kwargs)

    monkeypatch.setattr(instructions, "instruction_batches", interrupting)
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
