"""`groundup train` and `groundup sample` as a reader runs them: real processes, a SIGKILL mid-run, exact resume."""

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from groundup import cli
from groundup.training import CHECKPOINT_NAME, load_checkpoint

SMALL = ["--layers", "1", "--d-model", "32", "--heads", "2", "--context", "32", "--batch-size", "4",
         "--eval-interval", "25", "--eval-batches", "2", "--warmup", "10", "--dropout", "0.1", "--no-progress",
         "--threads", "1"]


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    lines = ["ROMEO: But soft, what light through yonder window breaks?",
             "JULIET: O Romeo, Romeo, wherefore art thou Romeo?",
             "MERCUTIO: A plague o' both your houses!"]
    path = tmp_path_factory.mktemp("text") / "play.txt"
    path.write_text("\n".join(lines[i % 3] for i in range(600)) + "\n", encoding="utf-8")
    return path


def groundup(*args, **kwargs):
    return subprocess.run([sys.executable, "-m", "groundup.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"}, **kwargs)


def test_sigkill_mid_run_then_resume_gives_the_uninterrupted_parameters(tmp_path, text_file):
    steps = "400"
    whole = groundup("train", "--text", text_file, "--out", tmp_path / "whole", "--max-steps", steps, *SMALL)
    assert whole.returncode == 0, whole.stderr

    run = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, "-m", "groundup.cli", "train", "--text", str(text_file), "--out", str(run),
                             "--max-steps", steps, *SMALL], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.monotonic() + 120
    killed_at = None
    while time.monotonic() < deadline and proc.poll() is None:
        if (run / CHECKPOINT_NAME).exists():
            try:
                step = load_checkpoint(run)[1]["step"]
            except (ValueError, FileNotFoundError):
                step = 0
            if step >= 50:
                proc.send_signal(signal.SIGKILL)
                killed_at = step
                break
        time.sleep(0.02)
    proc.wait(timeout=30)
    assert killed_at is not None and proc.returncode == -signal.SIGKILL, "the run was not killed mid-way"
    assert load_checkpoint(run)[1]["step"] < int(steps), "the run had already finished when it was killed"
    assert not list(run.glob(".*tmp*")) or True  # a temporary file from the kill may remain; it is never read

    resumed = groundup("train", "--out", run, "--resume", "--no-progress", "--threads", "1")
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming" in resumed.stdout
    a, ckpt_a = load_checkpoint(tmp_path / "whole")
    b, ckpt_b = load_checkpoint(run)
    assert ckpt_b["step"] == int(steps)
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(x, y), f"{name} differs between the uninterrupted and the resumed run"
    assert ckpt_a["history"]["train_loss"] == ckpt_b["history"]["train_loss"]


def test_sample_continues_the_prompt_and_is_reproducible(tmp_path, text_file):
    out = tmp_path / "run"
    result = groundup("train", "--text", text_file, "--out", out, "--max-steps", "60", *SMALL)
    assert result.returncode == 0, result.stderr
    assert "validation loss" in result.stdout
    first = groundup("sample", out, "--prompt", "ROMEO:", "--tokens", "40", "--seed", "3")
    second = groundup("sample", out, "--prompt", "ROMEO:", "--tokens", "40", "--seed", "3", "--no-cache")
    assert first.returncode == 0, first.stderr
    assert first.stdout.startswith("ROMEO:") and len(first.stdout.rstrip("\n")) == len("ROMEO:") + 40
    assert first.stdout == second.stdout, "the KV cache changes nothing"
    greedy = groundup("sample", out, "--prompt", "JULIET:", "--tokens", "20", "--greedy")
    assert greedy.returncode == 0 and greedy.stdout.startswith("JULIET:")


def test_sample_from_a_folder_without_a_checkpoint_is_a_clear_error(tmp_path, capsys):
    assert cli.main(["sample", str(tmp_path)]) == 1
    assert f"{tmp_path} holds no {CHECKPOINT_NAME}" in capsys.readouterr().err


def test_sample_rejects_characters_the_model_never_saw(tmp_path, text_file, capsys):
    out = tmp_path / "run"
    assert cli.main(["train", "--text", str(text_file), "--out", str(out), "--max-steps", "5", *SMALL]) == 0
    assert cli.main(["sample", str(out), "--prompt", "Zebra ∆"]) == 1
    assert "not in the vocabulary" in capsys.readouterr().err


def test_train_refuses_to_overwrite_and_resume_refuses_new_settings(tmp_path, text_file, capsys):
    out = tmp_path / "run"
    assert cli.main(["train", "--text", str(text_file), "--out", str(out), "--max-steps", "5", *SMALL]) == 0
    assert cli.main(["train", "--text", str(text_file), "--out", str(out), "--max-steps", "5", *SMALL]) == 1
    assert "add --resume" in capsys.readouterr().err
    assert cli.main(["train", "--out", str(out), "--resume", "--layers", "3"]) == 1
    assert "do not give --layers" in capsys.readouterr().err


def test_train_help_explains_every_option():
    result = groundup("train", "--help")
    assert result.returncode == 0
    for option in ("--out", "--resume", "--corpus", "--text", "--context", "--d-model", "--layers", "--heads",
                   "--positional", "--dropout", "--batch-size", "--max-steps", "--max-tokens", "--lr", "--warmup",
                   "--weight-decay", "--grad-clip", "--eval-interval", "--seed", "--device", "--no-progress"):
        assert option in result.stdout, option
    assert "recipe: rope" in result.stdout
