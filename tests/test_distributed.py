"""groundup.distributed and train's data-parallel hook: real 2-process gloo groups on 127.0.0.1.

Two processes with half the batch each, one process with the whole batch and one process accumulating two
micro-batches make the same updates (up to float rounding); only process 0 writes checkpoints; a run resumes with
another number of processes; a process that fails ends the whole group, with a clear message, never a hang.
"""

import json
import os
import shutil
import sys
import textwrap

import pytest
import torch

import groundup.training as training
from groundup import cli
from groundup.distributed import launch, ring_allreduce_bytes, run_local, torchrun_command, training_memory
from groundup.models import GPT, GPTConfig
from groundup.training import CHECKPOINT_NAME, TrainConfig, load_checkpoint, train

TINY = dict(vocab_size=12, context_length=16, d_model=16, n_layers=2, n_heads=2)
TOLERANCE = 1e-5  # float32: the processes add the same numbers in another order (measured: below 1e-6)


def tiny_model(seed=0):
    torch.manual_seed(seed)
    return GPT(GPTConfig(**TINY))


def pattern_data(n=3000, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.arange(n) % 7
    return torch.where(torch.rand(n, generator=g) < 0.1, torch.randint(0, 12, (n,), generator=g), ids)


def config(**kw):
    return TrainConfig(**{**dict(batch_size=8, max_steps=20, learning_rate=3e-3, warmup_steps=5, eval_interval=10,
                                 eval_batches=2, progress=False), **kw})


def snapshot_at(step, folder):
    """A callback that copies the checkpoint written at ``step`` (train calls it after checkpointing)."""
    def callback(done, model):
        if done == step:
            shutil.copy(folder / CHECKPOINT_NAME, folder / f"step{step}.pt")
    return callback


def largest_difference(a, b):
    return max((x - y).abs().max().item() for x, y in zip(a.state_dict().values(), b.state_dict().values()))


# --- the worker that runs in each of the two processes (importable, for spawn) --------------------------------


def _worker(rank, world, fresh, resumed):
    saves = []
    real_save = training.save_checkpoint

    def counting_save(*args, **kwargs):
        saves.append(kwargs["step"])
        real_save(*args, **kwargs)

    training.save_checkpoint = counting_save
    # a fresh run of 20 steps on two processes, keeping a copy of its step-10 checkpoint
    model = tiny_model()
    history = train(model, pattern_data(), pattern_data(seed=1), config(out_dir=str(fresh)),
                    distributed=True, callback=snapshot_at(10, fresh))
    torch.save({"state": model.state_dict(), "loss": history.train_loss, "saves": saves},
               fresh / f"rank{rank}.pt")
    # a one-process run's step-10 checkpoint, continued on two processes
    saves.clear()
    model = tiny_model(seed=5)  # any weights: resuming loads the checkpoint's
    history = train(model, pattern_data(), pattern_data(seed=1), config(out_dir=str(resumed), resume=True),
                    distributed=True)
    torch.save({"state": model.state_dict(), "loss": history.train_loss, "saves": saves},
               resumed / f"rank{rank}.pt")


def test_two_processes_equal_one_process_and_accumulation_and_resume_across_world_sizes(tmp_path):
    data, val = pattern_data(), pattern_data(seed=1)
    single_dir, fresh, resumed = tmp_path / "single", tmp_path / "fresh", tmp_path / "resumed"
    single_dir.mkdir()
    reference = tiny_model()  # one process, the whole batch of 8 rows
    ref_history = train(reference, data, val, config(out_dir=str(single_dir)), callback=snapshot_at(10, single_dir))
    accumulated = tiny_model()  # one process, two micro-batches of 4 rows
    acc_history = train(accumulated, data, val, config(), accumulate=2)
    resumed.mkdir()
    shutil.copy(single_dir / "step10.pt", resumed / CHECKPOINT_NAME)

    run_local(_worker, 2, fresh, resumed, timeout=120)

    ranks = [torch.load(fresh / f"rank{r}.pt", weights_only=True) for r in (0, 1)]
    for name in ranks[0]["state"]:
        assert torch.equal(ranks[0]["state"][name], ranks[1]["state"][name]), f"{name} differs between processes"
    assert ranks[0]["saves"] == [10, 20] and ranks[1]["saves"] == [], "only process 0 writes checkpoints"
    assert sorted(p.name for p in fresh.iterdir()) == [CHECKPOINT_NAME, "history.json", "rank0.pt", "rank1.pt",
                                                       "step10.pt"], "no temporary or per-process files remain"
    two = tiny_model()
    two.load_state_dict(ranks[0]["state"])
    assert largest_difference(two, reference) < TOLERANCE
    assert largest_difference(accumulated, reference) < TOLERANCE
    assert ranks[0]["loss"] == pytest.approx(ref_history.train_loss, abs=1e-5)
    assert acc_history.train_loss == pytest.approx(ref_history.train_loss, abs=1e-5)
    stored, ckpt = load_checkpoint(fresh)
    assert ckpt["step"] == 20 and largest_difference(stored, two) == 0

    # one process's checkpoint continued by two processes (1 -> 2)
    continued = [torch.load(resumed / f"rank{r}.pt", weights_only=True) for r in (0, 1)]
    assert continued[1]["saves"] == [] and continued[0]["saves"] == [20]
    two_after_one = tiny_model()
    two_after_one.load_state_dict(continued[0]["state"])
    assert largest_difference(two_after_one, reference) < TOLERANCE
    assert continued[0]["loss"][:10] == ref_history.train_loss[:10], "the first 10 steps come from the checkpoint"

    # two processes' checkpoint continued by one process (2 -> 1)
    back = tmp_path / "back"
    back.mkdir()
    shutil.copy(fresh / "step10.pt", back / CHECKPOINT_NAME)
    one_after_two = tiny_model(seed=7)
    train(one_after_two, data, val, config(out_dir=str(back), resume=True))
    assert largest_difference(one_after_two, reference) < TOLERANCE


def test_the_split_is_checked():
    with pytest.raises(ValueError, match="divisible by processes x accumulation steps"):
        train(tiny_model(), pattern_data(), pattern_data(), config(batch_size=6), accumulate=4)
    with pytest.raises(ValueError, match="initialised torch.distributed process group"):
        train(tiny_model(), pattern_data(), pattern_data(), config(), distributed=True)
    with pytest.raises(ValueError, match="accumulate must be >= 1"):
        train(tiny_model(), pattern_data(), pattern_data(), config(), accumulate=0)


# --- a failing process --------------------------------------------------------------------------------------

FAILING = """
    import torch
    from groundup.distributed import init_process_group
    from groundup.models import GPT, GPTConfig
    from groundup.training import TrainConfig, train
    from groundup.data import get_batch

    rank, world = init_process_group()
    calls = 0

    def batches(data, batch_size, context_length, generator):
        global calls
        calls += 1
        if rank == 1 and calls == 3:
            raise RuntimeError("injected failure in process 1 at step 3")
        x, y = get_batch(data, batch_size, context_length, generator=generator)
        return (x,), y

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=12, context_length=16, d_model=16, n_layers=1, n_heads=2))
    data = torch.arange(2000) % 7
    train(model, data, data, TrainConfig(batch_size=4, max_steps=10_000, eval_interval=10_000, eval_batches=1,
                                         progress=False), batches=batches, distributed=True)
"""


def test_a_failing_process_ends_the_launcher_quickly_with_a_clear_message(tmp_path, capfd):
    (tmp_path / "failing_worker.py").write_text(textwrap.dedent(FAILING))
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]), "OMP_NUM_THREADS": "1"}
    status = launch(2, [], module="failing_worker", env=env, timeout=120)  # 124 if it had to be stopped
    output = "".join(capfd.readouterr())
    assert status not in (0, 124), output
    assert "injected failure in process 1 at step 3" in output, output
    assert "error: the distributed run failed" in output


# --- the command line ---------------------------------------------------------------------------------------

SMALL = ["--layers", "1", "--d-model", "32", "--heads", "2", "--context", "32", "--batch-size", "4",
         "--eval-interval", "10", "--eval-batches", "2", "--warmup", "5", "--dropout", "0", "--no-progress",
         "--threads", "1"]


def test_cli_resumes_a_one_process_run_on_two_processes(tmp_path, monkeypatch, capfd):
    text = tmp_path / "play.txt"
    text.write_text("\n".join(["ROMEO: But soft, what light through yonder window breaks?",
                               "JULIET: O Romeo, Romeo, wherefore art thou Romeo?"] * 200) + "\n", encoding="utf-8")
    whole, run = tmp_path / "whole", tmp_path / "run"
    assert cli.main(["train", "--text", str(text), "--out", str(whole), "--max-steps", "20", *SMALL]) == 0

    calls = {"n": 0}
    real_get_batch = training.get_batch

    def crashing_get_batch(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 15:  # after the checkpoint of step 10
            raise RuntimeError("power cut")
        return real_get_batch(*args, **kwargs)

    monkeypatch.setattr(training, "get_batch", crashing_get_batch)
    with pytest.raises(RuntimeError, match="power cut"):
        cli.main(["train", "--text", str(text), "--out", str(run), "--max-steps", "20", *SMALL])
    monkeypatch.setattr(training, "get_batch", real_get_batch)
    assert load_checkpoint(run)[1]["step"] == 10

    capfd.readouterr()
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    status = cli.main(["train", "--out", str(run), "--resume", "--nproc", "2", "--no-progress"])  # starts torchrun
    out, err = capfd.readouterr()
    assert status == 0, out + err
    assert out.count("resuming") == 1 and out.count("done: step 20") == 1, "process 0 alone prints"
    a, _ = load_checkpoint(whole)
    b, ckpt = load_checkpoint(run)
    assert ckpt["step"] == 20 and largest_difference(a, b) < TOLERANCE
    assert json.loads((run / "history.json").read_text())["step"] == list(range(1, 21))


def test_cli_rejects_bad_process_counts(capsys, tmp_path):
    assert cli.main(["train", "--out", str(tmp_path / "r"), "--nproc", "0"]) == 1
    assert "--nproc must be a positive integer" in capsys.readouterr().err


# --- the arithmetic -----------------------------------------------------------------------------------------


def test_ring_allreduce_bytes_and_zero_memory():
    assert ring_allreduce_bytes(1000, 1) == 0
    assert ring_allreduce_bytes(1000, 2, 4) == 4000  # 2 (p-1)/p = 1: each process sends the whole tensor once
    assert ring_allreduce_bytes(10**6, 8, 2) == pytest.approx(2 * 7 / 8 * 2e6)
    assert training_memory(10**9)["total"] == 16e9  # 16 bytes per parameter
    assert training_memory(10**9, 8, 1)["total"] == pytest.approx(2e9 + 2e9 + 12e9 / 8)
    assert training_memory(10**9, 8, 2)["total"] == pytest.approx(2e9 + 2e9 / 8 + 12e9 / 8)
    assert training_memory(10**9, 8, 3)["total"] == pytest.approx(16e9 / 8)
    with pytest.raises(ValueError):
        training_memory(10, 2, stage=4)


def test_the_torchrun_command_uses_this_python_and_a_free_rendezvous():
    command = torchrun_command(2, ["--out", "run"])
    assert command[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert "--standalone" in command and "--nproc_per_node=2" in command
    assert command[-3:] == ["groundup.distributed", "--out", "run"]
    with pytest.raises(ValueError):
        torchrun_command(0, [])
