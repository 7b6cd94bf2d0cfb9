"""`groundup train` and `groundup sample` as a reader runs them: real processes, a SIGKILL mid-run, exact resume."""

import dataclasses
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from groundup import cli, run_folder
from groundup.seq2seq import batches
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


# --- groundup train --task dates: chapter 10's encoder-decoder ----------------------------------------------------

TINY_DATES = ["--task", "dates", "--d-model", "16", "--heads", "2", "--layers", "1", "--batch-size", "8",
              "--max-steps", "6", "--eval-interval", "3", "--eval-batches", "1", "--warmup", "2", "--no-progress",
              "--threads", "1"]


@pytest.fixture(scope="module")
def dates_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("dates") / "run"
    assert cli.main(["train", "--out", str(out), *TINY_DATES]) == 0
    return out


def test_train_task_dates_writes_an_encoder_decoder_run_and_reports_exact_match(dates_run, capsys):
    from groundup.models import EncoderDecoder

    model, ckpt = load_checkpoint(dates_run)
    assert type(model) is EncoderDecoder and ckpt["step"] == 6 and ckpt["extra"] == {"task": "dates"}
    c = model.config
    assert (c.d_model, c.d_ff, c.n_heads, c.n_encoder_layers, c.n_decoder_layers) == (16, 32, 2, 1, 1)
    assert (c.context_length, c.positional, c.norm_position) == (16, "sinusoidal", "pre")
    assert ckpt["train_config"]["batch_size"] == 8 and ckpt["train_config"]["eval_batches"] == 1
    for name in ("history.json", "source_tokenizer.json", "target_tokenizer.json"):
        assert (dates_run / name).is_file(), name
    assert ckpt["history"]["eval_step"] == [3, 6]


def test_train_task_dates_prints_held_out_exact_match_and_defaults_to_the_chapter(tmp_path, capsys, monkeypatch):
    from groundup import runs

    seen, real_train = {}, runs.train

    def fake_train(model, train_data, val_data, config, **kw):  # one step: check what would be trained
        seen.update(model=model, train=train_data, val=val_data, config=config, batches=kw["batches"])
        return real_train(model, train_data, val_data, dataclasses.replace(config, max_steps=1, warmup_steps=0,
                                                                          eval_interval=1, out_dir=None), **kw)

    monkeypatch.setattr(runs, "train", fake_train)
    assert cli.main(["train", "--task", "dates", "--out", str(tmp_path / "r"), "--no-progress", "--threads", "1"]) == 0
    printed = capsys.readouterr().out
    assert "held-out exact match" in printed and "of 1,000 test dates (greedy decoding)" in printed
    c, t = seen["model"].config, seen["config"]
    assert (c.d_model, c.d_ff, c.n_heads, c.n_encoder_layers, c.n_decoder_layers, c.context_length) == \
        (64, 128, 4, 2, 2, 16), "the chapter's model"
    assert (t.batch_size, t.max_steps, t.learning_rate, t.warmup_steps, t.weight_decay, t.eval_interval,
            t.eval_batches, t.grad_clip, t.seed) == (64, 400, 3e-3, 50, 0.01, 50, 4, 1.0, 0), "the chapter's training"
    assert len(seen["train"]) == 20_000 and len(seen["val"]) == 500 and seen["batches"] is batches


def test_an_interrupted_dates_run_resumes_exactly(dates_run, tmp_path, capsys, monkeypatch):
    from groundup import runs

    real_train = runs.train

    def stopped_at_3(*args, **kwargs):
        def callback(step, model):
            if step == 3:
                raise KeyboardInterrupt("training interrupted after step 3")
        return real_train(*args, callback=callback, **kwargs)

    out = tmp_path / "run"
    monkeypatch.setattr(runs, "train", stopped_at_3)
    assert cli.main(["train", "--out", str(out), *TINY_DATES]) == 130
    assert "--resume" in capsys.readouterr().err and load_checkpoint(out)[1]["step"] == 3
    monkeypatch.setattr(runs, "train", real_train)
    assert cli.main(["train", "--out", str(out), "--resume", "--no-progress", "--threads", "1"]) == 0
    printed = capsys.readouterr().out
    assert "resuming" in printed and "held-out exact match" in printed
    a, ckpt_a = load_checkpoint(dates_run)
    b, ckpt_b = load_checkpoint(out)
    assert ckpt_b["step"] == 6
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(x, y), f"{name} differs between the uninterrupted and the resumed run"
    assert ckpt_a["history"]["train_loss"] == ckpt_b["history"]["train_loss"]


def test_sample_translates_a_date_with_a_dates_run(dates_run, capsys):
    from groundup.seq2seq import date_tokenizers, greedy_decode

    prompt = "Friday, the thirteenth of October, two thousand and twenty-three"
    assert cli.main(["sample", str(dates_run), "--prompt", prompt]) == 0
    model, _ = load_checkpoint(dates_run)
    src_tok, tgt_tok = date_tokenizers()
    expected = tgt_tok.decode(greedy_decode(model, torch.tensor([src_tok.encode(prompt)]))[0])
    assert capsys.readouterr().out == expected + "\n"
    assert cli.main(["sample", str(dates_run), "--prompt", prompt, "--greedy"]) == 0  # greedy anyway


@pytest.mark.parametrize("extra, message", [
    (["--top-k", "3"], "--top-k does not apply"),
    (["--temperature", "0.5", "--tokens", "9"], "--tokens and --temperature do not apply"),
    ([], "give the date in words to translate"),
    (["--prompt", "July 4th"], "the dates task knows only these words"),
])
def test_sample_with_a_dates_run_refuses_what_does_not_apply(dates_run, capsys, extra, message):
    assert cli.main(["sample", str(dates_run), *extra]) == 1
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("extra, message", [
    (["--objective", "masked", "--max-steps", "1"], "--objective does not apply"),
    (["--mask-rate", "0.2", "--max-tokens", "100"], "--mask-rate and --max-tokens do not apply"),
    (["--positional", "rope", "--max-steps", "1"], "--positional rope is not available with --task dates"),
    (["--context", "8", "--max-steps", "1"], "--context 8 is too short for --task dates"),
    (["--eval-batches", "0", "--max-steps", "1"], "give --eval-batches 1 or more"),
])
def test_train_task_dates_refuses_incompatible_options(tmp_path, capsys, extra, message):
    assert cli.main(["train", "--task", "dates", "--out", str(tmp_path / "r"), *extra]) == 1
    assert message in capsys.readouterr().err
    assert not (tmp_path / "r" / CHECKPOINT_NAME).exists()


def test_task_dates_and_a_text_are_mutually_exclusive(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        cli.main(["train", "--task", "dates", "--text", str(tmp_path / "t.txt"), "--out", str(tmp_path / "r")])
    assert stop.value.code == 2 and "not allowed with argument --task" in capsys.readouterr().err


def test_help_explains_the_dates_task():
    train_help = " ".join(groundup("train", "--help").stdout.split())  # argparse wraps lines anywhere
    assert "--task {dates}" in train_help and "EncoderDecoder" in train_help and "exact-match" in train_help
    sample_help = " ".join(groundup("sample", "--help").stdout.split())
    assert "translates --prompt" in sample_help and "(default: 500)" in sample_help and "None" not in sample_help


def test_sample_pretrained_argument_errors(tmp_path, capsys):
    assert cli.main(["sample"]) == 2
    assert "exactly one" in capsys.readouterr().err
    assert cli.main(["sample", str(tmp_path), "--pretrained", "gpt2"]) == 2
    assert cli.main(["sample", "--pretrained", str(tmp_path / "nowhere")]) == 1
    assert "neither a checkpoint folder" in capsys.readouterr().err


def test_sample_pretrained_from_a_local_gpt2_folder(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    from groundup.tokenizers import load_gpt2_tokenizer

    try:
        tok = load_gpt2_tokenizer()
    except Exception as err:  # the merge table is not cached and cannot be fetched
        pytest.skip(f"GPT-2 tokenizer unavailable: {err}")
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_positions=64, n_embd=8, n_layer=1, n_head=2))
    hf.save_pretrained(tmp_path)
    assert cli.main(["sample", "--pretrained", str(tmp_path), "--prompt", "Hello world", "--tokens", "5",
                     "--greedy"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("Hello world")
    from groundup.generation import generate
    from groundup.pretrained import load_gpt2

    model, _ = load_gpt2(tmp_path, tokenizer=False)
    prompt = torch.tensor([tok.encode("Hello world")])
    with torch.no_grad():  # the same greedy continuation, computed directly
        ref = tok.decode(generate(model, prompt, 5, greedy=True)[0].tolist())
    assert text == ref + "\n"


def test_the_default_recipe_and_a_token_budget_that_is_never_exceeded(tmp_path):
    from groundup import runs
    from groundup.cli import _parser

    args = _parser().parse_args(["train", "--out", str(tmp_path / "r"), "--max-tokens", "1000000"])
    model_config, train_config = runs._configs_from_args(args, vocab_size=65)
    assert train_config.max_steps == 976 and 976 * 8 * 128 <= 1_000_000 < 977 * 8 * 128
    assert (train_config.optimizer, train_config.learning_rate, train_config.batch_size) == ("muon", 2e-3, 8)
    assert (model_config.n_layers, model_config.d_model, model_config.n_heads, model_config.context_length,
            model_config.positional) == (4, 192, 6, 128, "rope")
    args = _parser().parse_args(["train", "--out", str(tmp_path / "r"), "--optimizer", "adamw", "--max-tokens", "5"])
    assert runs._configs_from_args(args, vocab_size=65)[1].optimizer == "adamw"
    assert runs._configs_from_args(args, vocab_size=65)[1].max_steps == 1
    args = _parser().parse_args(["train", "--out", str(tmp_path / "r"), "--optimizer", "sgd", "--lr", "0.3",
                                 "--weight-decay", "0"])
    sgd = runs._configs_from_args(args, vocab_size=65)[1]
    assert (sgd.optimizer, sgd.learning_rate, sgd.weight_decay, sgd.beta1) == ("sgd", 0.3, 0.0, 0.9)
    with pytest.raises(SystemExit):
        _parser().parse_args(["train", "--out", str(tmp_path / "r"), "--optimizer", "rmsprop"])


# --- untrusted sizes: refused before anything is allocated --------------------------------------------------


def _crafted_checkpoint(tmp_path, **config_changes):
    """A real checkpoint of a tiny GPT whose stored model configuration is then edited (as an attacker could)."""
    from groundup.models import GPT, GPTConfig
    from groundup.training import save_checkpoint

    positional = config_changes.pop("positional", "rope")
    model = GPT(GPTConfig(vocab_size=12, context_length=16, d_model=16, n_layers=1, n_heads=2,
                          positional=positional))
    path = tmp_path / CHECKPOINT_NAME
    save_checkpoint(path, model)
    state = torch.load(path, weights_only=True)
    state["model_config"].update(config_changes)
    torch.save(state, path)
    return path


def test_a_checkpoint_claiming_a_billion_token_vocabulary_is_refused_before_allocating(tmp_path, capsys):
    path = _crafted_checkpoint(tmp_path, vocab_size=10**9)  # 10^9 x 16 floats: 64 GB if it were built
    with pytest.raises(ValueError, match="is inconsistent: the stored weights do not match the stored model "
                                         "configuration") as err:
        load_checkpoint(path)
    assert str(path) in str(err.value)
    assert cli.main(["sample", str(tmp_path), "--tokens", "3"]) == 1
    err = capsys.readouterr().err
    # counted from the configuration by arithmetic (10^9 x 16 numbers, tied: stored twice), nothing built
    assert f"{path} is inconsistent" in err and "describes 32,000,00" in err and "holds 3,696 numbers" in err, err


def test_a_checkpoint_whose_buffers_would_exceed_memory_is_refused(tmp_path):
    from groundup.footprint import device_memory

    # ALiBi's bias table is a buffer (not stored): n_heads x n_C x n_C floats, 8 TB for n_C = 10^6
    path = _crafted_checkpoint(tmp_path, positional="alibi", context_length=10**6)
    if device_memory() is None:
        pytest.skip("this system does not report its memory")
    with pytest.raises(ValueError, match=r"model configuration in .* needs at least 8,000 GB of memory"):
        load_checkpoint(path)


# --- several processes: Ctrl-C, kill -9 of the launcher, one run per folder -----------------------------------

PARALLEL = ["--max-steps", "100000", "--layers", "1", "--d-model", "32", "--heads", "2", "--context", "32",
            "--batch-size", "4", "--eval-interval", "20", "--eval-batches", "1", "--warmup", "5", "--no-progress",
            "--threads", "1", "--nproc", "2"]


def _start_two_process_run(text_file, run):
    """``groundup train --nproc 2`` in the background, once its first checkpoint is written."""
    proc = subprocess.Popen([sys.executable, "-m", "groundup.cli", "train", "--text", str(text_file), "--out",
                             str(run), *PARALLEL], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.monotonic() + 120
    while not (run / CHECKPOINT_NAME).exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.1)
    return proc


def _descendants(pid):
    """The processes below ``pid`` (children, grandchildren, ...), from /proc."""
    from groundup.distributed import _children

    found, todo = [], [pid]
    while todo:
        kids = _children(todo.pop())
        found += kids
        todo += kids
    return found


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2:][:1] != b"Z"  # a zombie has ended, only its exit status is left


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_ctrl_c_on_a_two_process_run_saves_a_checkpoint_and_exits_130(tmp_path, text_file):
    run = tmp_path / "run"
    proc = _start_two_process_run(text_file, run)
    time.sleep(1.0)
    proc.send_signal(signal.SIGINT)  # what a terminal's Ctrl-C does: torchrun runs in a session of its own
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "Error" not in err, err
    said = [line for line in err.splitlines() if "training interrupted after step" in line]
    assert len(said) == 1, err  # process 0 alone says it
    step = load_checkpoint(run)[1]["step"]
    assert said[0] == f"training interrupted after step {step}; checkpoint saved in {run}; continue with: " \
                      f"groundup train --out {run} --resume"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_kill_9_of_the_launcher_stops_torchrun_and_its_processes(tmp_path, text_file):
    run = tmp_path / "run"
    proc = _start_two_process_run(text_file, run)
    below = _descendants(proc.pid)
    assert len(below) >= 3, below  # torchrun and two processes
    proc.kill()
    proc.communicate(timeout=120)
    deadline = time.monotonic() + 120  # a hang guard: the parent's death is noticed within a second
    while any(map(_alive, below)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(map(_alive, below)), "torchrun or a process outlived the killed launcher"
    step = load_checkpoint(run)[1]["step"]
    time.sleep(2.0)
    assert load_checkpoint(run)[1]["step"] == step, "training went on"


def test_a_second_run_in_a_folder_in_use_is_refused_naming_it(tmp_path, text_file, capsys):

    out = tmp_path / "run"
    with run_folder.run_lock(out, False, 0):  # as a run in another process holds it
        assert cli.main(["train", "--text", str(text_file), "--out", str(out), "--max-steps", "2", *SMALL]) == 1
        err = capsys.readouterr().err
        assert f"{out} is in use by another groundup train (process {os.getpid()})" in err, err
        assert not (out / CHECKPOINT_NAME).exists()
    assert cli.main(["train", "--text", str(text_file), "--out", str(out), "--max-steps", "2", *SMALL]) == 0
    assert load_checkpoint(out)[1]["step"] == 2


# --- the task table: every task is a --task choice (or the default) and starts and resumes through its own functions

def test_every_task_is_on_the_command_line_and_starts_and_resumes_its_own_runs(dates_run, tmp_path, text_file,
                                                                               monkeypatch):
    from groundup import runs
    from groundup.cli import _parser
    from groundup.training import MODEL_CLASSES

    train_parser = _parser()._subparsers._group_actions[0].choices["train"]
    choices = next(action.choices for action in train_parser._actions if action.dest == "task")
    assert runs.DEFAULT_TASK not in choices and {*choices, runs.DEFAULT_TASK} == set(runs.TASKS)
    assert all(task.name == name for name, task in runs.TASKS.items())
    for cls, _ in MODEL_CLASSES.values():  # a checkpoint's model tells which task resumes it: exactly one
        assert [name for name, task in runs.TASKS.items() if issubclass(cls, task.models)] in \
            ([name] for name in runs.TASKS), cls.__name__
    new_run = {"text": ["--text", str(text_file), "--max-steps", "2", *SMALL], "dates": TINY_DATES}
    assert set(new_run) == set(runs.TASKS), "give each task a tiny run here"

    called = []

    def spy(function, what):
        def recorded(*args):
            called.append(what)
            return function(*args)
        return recorded

    for name, task in runs.TASKS.items():
        monkeypatch.setitem(runs.TASKS, name, dataclasses.replace(task, new=spy(task.new, ("new", name)),
                                                                  resume=spy(task.resume, ("resume", name))))
    for name in runs.TASKS:
        out = tmp_path / "new" / name
        run = runs._prepare(_parser().parse_args(["train", "--out", str(out), *new_run[name]]), out)
        assert called.pop() == ("new", name) and run.task is runs.TASKS[name]
    text_run = tmp_path / "text"
    assert cli.main(["train", "--out", str(text_run), *new_run["text"]]) == 0 and called.pop() == ("new", "text")
    finished = {"text": text_run, "dates": dates_run}
    assert set(finished) == set(runs.TASKS), "give each task a finished run here"
    for name, out in finished.items():
        run = runs._prepare(_parser().parse_args(["train", "--out", str(out), "--resume"]), out)
        assert called.pop() == ("resume", name) and run.task is runs.TASKS[name]
