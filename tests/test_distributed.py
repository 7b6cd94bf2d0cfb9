"""groundup.distributed and train's data-parallel hook: real 2-process gloo groups on 127.0.0.1.

Which arithmetic each comparison of two runs relies on (issue 21: a tolerance measured on an AMD CPU failed on an
Intel one, where Muon's bfloat16 products are computed differently):

* Bit for bit, on any CPU: p processes against one process accumulating p micro-batches of the same rows (one
  thread each). Every micro-batch's forward and backward are the same operations on the same numbers; DDP divides
  the summed gradients by p = 2 and gloo adds two numbers, both exact in floating point; so every update is the
  same, Muon's included, and so is a run resumed with another number of processes.
* Float32 rounding: one process on the whole batch against any split. The gradient's sums over the rows run in
  another order, so gradients differ by about float32's unit roundoff (6e-8) relative; AdamW's update is a ratio
  of such numbers, so the parameters differ by a few units in their last place (FLOAT32_TOLERANCE) -- except the
  key projections' biases, which only ever move by rounding noise (see zero_gradient).
* Bfloat16 rounding: the same with Muon. It orthogonalises each update in bfloat16, whose rounding (2^-8 relative)
  is 10^5 times float32's; a last-bit difference in its input can change its output by bfloat16's error, and the
  kernels that compute it differ between CPUs. The parameters then agree only to the bound muon_bound derives.
"""

import json
import math
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

import groundup.training as training
from groundup import cli
from groundup.distributed import launch, ring_allreduce_bytes, run_local, torchrun_command, training_memory
from groundup.models import GPT, EncoderDecoder, EncoderDecoderConfig, GPTConfig
from groundup.seq2seq import batches as seq2seq_batches
from groundup.seq2seq import date_splits, date_tokenizers, encode_pairs
from groundup.training import CHECKPOINT_NAME, TrainConfig, load_checkpoint, muon_parameters, train
from groundup.utils import threads

TINY = dict(vocab_size=12, context_length=16, d_model=16, n_layers=2, n_heads=2)

FLOAT32_TOLERANCE = 1e-6
"""Largest |difference| of a parameter between a whole-batch and a split AdamW run of 20 steps (key biases aside).

The gradients differ by float32 rounding, ~1e-7 relative; AdamW's step m / (sqrt(v) + eps) changes by about as
much relative, i.e. by ~1e-7 lr per step, and the parameters (|w| <= ~1, where float32's spacing is 1.2e-7) end a
few units in the last place apart: 1.2e-7 measured. 1e-6 is eight such units; a wrongly weighted micro-batch
(the bug of issue 21) moved chapter 10's model by 5e-3. This holds where gradients are well above the rounding
noise: an entry whose gradient is itself noise gets AdamW steps of either sign, up to lr each. In these models
only the key biases are such entries (zero_gradient); chapter 11 shows the effect in a bigger model."""
FLOAT32_LOSS_TOLERANCE = 1e-5
"""The recorded losses (means of float32 numbers of about 2.5: spacing 2.4e-7) of a whole-batch and a split run."""


def zero_gradient(name: str) -> bool:
    """The key projections' biases, whose exact gradient is 0 in models with absolute positions (these tests').

    softmax(s + c) = softmax(s) for a shift c shared by all keys of a query, and q . b_K is such a shift (rotary
    positions would rotate b_K with each key's position, giving it a real gradient). Computed in
    float32 their gradient is rounding noise (~1e-12), which AdamW divides by sqrt(v) + eps (eps = 1e-8): they move
    by noise alone, differently in two runs. Checked instead: they stay within KEY_BIAS_STEP lr per step of 0.
    """
    return name.endswith("W_k.bias")


KEY_BIAS_STEP = 1e-2
"""AdamW moves a parameter by at most lr |g| / eps per step while |g| << eps: noise below 1e-10 gives < 0.01 lr."""

BF16_UNIT = 2.0 ** -8
"""bfloat16 keeps 8 significant bits: rounding changes a number by at most 2^-8 = 0.0039 of itself."""
NS_ERROR = 12 * BF16_UNIT
"""Error of torch.optim.Muon's 5 bfloat16 Newton-Schulz iterations (15 products, each rounded), as a fraction of
the output's largest entry: at most 11.4 units (0.044) against a float64 reference on ill-conditioned random
matrices, the same under ATEN_CPU_CAPABILITY default, avx2 and avx512 here."""
NS_NORM = 1.2
"""The Newton-Schulz output's singular values end in about [0.7, 1.2] (Muon's coefficients), so |O_ij| <= 1.2."""


def muon_bound(model, lrs) -> float:
    """How far two Muon runs whose gradients differ by float32 rounding can drift apart, to first order.

    A Muon step moves a matrix W (A x B) by lr s O with s = 0.2 sqrt(max(A, B)) (``match_rms_adamw``) and O the
    orthogonalised momentum. The two runs' O differ by at most both runs' bfloat16 errors, 2 NS_ERROR NS_NORM per
    entry; summed over the steps. The feedback through later gradients is second order over a few steps at these
    learning rates (the measured drift is a tenth of the bound).
    """
    s = max(0.2 * math.sqrt(max(p.shape)) for p in muon_parameters(model))
    return sum(lrs) * s * 2 * NS_ERROR * NS_NORM


MUON_LOSS_TOLERANCE = 1e-3
"""The recorded losses of a whole-batch and a split Muon run: the loss moves by about |gradient| x the drift above
(measured: 5e-5 nats; 1e-3 is 0.04 % of a loss of 2.5)."""


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


_DATES = {}


def dates_data():
    """Chapter 10's dates task, small: (train, val) Seq2SeqData and the two vocabulary sizes."""
    if not _DATES:
        src_tok, tgt_tok = date_tokenizers()
        train_pairs, val_pairs, _ = date_splits(2000, 100, 10)
        _DATES["data"] = (encode_pairs(train_pairs, src_tok, tgt_tok), encode_pairs(val_pairs, src_tok, tgt_tok),
                          src_tok.vocab_size, tgt_tok.vocab_size)
    return _DATES["data"]


def dates_model(seed=0):
    _, _, n_src, n_tgt = dates_data()
    torch.manual_seed(seed)
    return EncoderDecoder(EncoderDecoderConfig(src_vocab_size=n_src, tgt_vocab_size=n_tgt, context_length=24,
                                               d_model=16, d_ff=32, n_encoder_layers=1, n_decoder_layers=1,
                                               n_heads=2))


def train_dates(model, accumulate=1, distributed=False, **kw):
    """5 steps on padded batches of 16 dates (targets of 5 to 11 tokens: micro-batches count different numbers)."""
    train_data, val_data, _, _ = dates_data()
    cfg = config(batch_size=16, max_steps=5, warmup_steps=1, eval_interval=5, eval_batches=1, **kw)
    return train(model, train_data, val_data, cfg, batches=seq2seq_batches, accumulate=accumulate,
                 distributed=distributed)


def snapshot_at(step, folder):
    """A callback that copies the checkpoint written at ``step`` (train calls it after checkpointing)."""
    def callback(done, model):
        if done == step:
            shutil.copy(folder / CHECKPOINT_NAME, folder / f"step{step}.pt")
    return callback


def largest_difference(a, b):
    return max((x - y).abs().max().item() for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def assert_bit_for_bit(a, b, what):
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(x, y), f"{name} differs: {what}"


def assert_float32_rounding_apart(a, b, start, lrs):
    """Parameters of a whole-batch and a split AdamW run: FLOAT32_TOLERANCE apart, key biases near 0 in both."""
    for (name, x), y, x0 in zip(a.state_dict().items(), b.state_dict().values(), start.state_dict().values()):
        if zero_gradient(name):
            for w in (x, y):
                assert (w - x0).abs().max().item() <= KEY_BIAS_STEP * sum(lrs), f"{name} moved by more than noise"
        else:
            assert (x - y).abs().max().item() <= FLOAT32_TOLERANCE, name


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
    # chapter 10's encoder-decoder on padded batches
    model = dates_model()
    history = train_dates(model, distributed=True)
    torch.save({"state": model.state_dict(), "loss": history.train_loss}, fresh / f"dates{rank}.pt")


def test_two_processes_equal_one_process_accumulating_bit_for_bit_and_the_whole_batch_to_rounding(tmp_path):
    data, val = pattern_data(), pattern_data(seed=1)
    split_dir, fresh, resumed = tmp_path / "split", tmp_path / "fresh", tmp_path / "resumed"
    split_dir.mkdir()
    with threads(1):  # as each of the two processes
        split = tiny_model()  # one process, two micro-batches of 4 rows: the two processes' arithmetic
        split_history = train(split, data, val, config(out_dir=str(split_dir)), accumulate=2,
                              callback=snapshot_at(10, split_dir))
        whole = tiny_model()  # one process, the whole batch of 8 rows
        whole_history = train(whole, data, val, config())
        dates_split, dates_whole = dates_model(), dates_model()
        dates_split_history = train_dates(dates_split, accumulate=2)
        dates_whole_history = train_dates(dates_whole)
    resumed.mkdir()
    shutil.copy(split_dir / "step10.pt", resumed / CHECKPOINT_NAME)

    run_local(_worker, 2, fresh, resumed, timeout=180)

    ranks = [torch.load(fresh / f"rank{r}.pt", weights_only=True) for r in (0, 1)]
    for name in ranks[0]["state"]:
        assert torch.equal(ranks[0]["state"][name], ranks[1]["state"][name]), f"{name} differs between processes"
    assert ranks[0]["saves"] == [10, 20] and ranks[1]["saves"] == [], "only process 0 writes checkpoints"
    assert sorted(p.name for p in fresh.iterdir()) == [CHECKPOINT_NAME, "dates0.pt", "dates1.pt", "history.json",
                                                       "rank0.pt", "rank1.pt", "step10.pt"], \
        "no temporary or per-process files remain"
    two = tiny_model()
    two.load_state_dict(ranks[0]["state"])
    assert_bit_for_bit(two, split, "two processes vs one process accumulating two micro-batches")
    assert ranks[0]["loss"] == split_history.train_loss
    stored, ckpt = load_checkpoint(fresh)
    assert ckpt["step"] == 20 and largest_difference(stored, two) == 0

    # one process on the whole batch adds in another order: float32 rounding apart
    assert_float32_rounding_apart(split, whole, tiny_model(), whole_history.lr)
    assert split_history.train_loss == pytest.approx(whole_history.train_loss, abs=FLOAT32_LOSS_TOLERANCE)

    # one process's checkpoint continued by two processes (1 -> 2)
    continued = [torch.load(resumed / f"rank{r}.pt", weights_only=True) for r in (0, 1)]
    assert continued[1]["saves"] == [] and continued[0]["saves"] == [20]
    two_after_one = tiny_model()
    two_after_one.load_state_dict(continued[0]["state"])
    assert_bit_for_bit(two_after_one, split, "a one-process run resumed on two processes")
    assert continued[0]["loss"] == split_history.train_loss

    # two processes' checkpoint continued by one process (2 -> 1)
    back = tmp_path / "back"
    back.mkdir()
    shutil.copy(fresh / "step10.pt", back / CHECKPOINT_NAME)
    one_after_two = tiny_model(seed=7)
    with threads(1):
        train(one_after_two, data, val, config(out_dir=str(back), resume=True), accumulate=2)
    assert_bit_for_bit(one_after_two, split, "a two-process run resumed on one process")

    # chapter 10's padded batches: the same, with micro-batches that count different numbers of targets
    dates = [torch.load(fresh / f"dates{r}.pt", weights_only=True) for r in (0, 1)]
    dates_two = dates_model()
    dates_two.load_state_dict(dates[0]["state"])
    assert_bit_for_bit(dates_two, dates_split, "dates: two processes vs one process accumulating two")
    assert dates[0]["loss"] == dates[1]["loss"] == dates_split_history.train_loss
    assert_float32_rounding_apart(dates_two, dates_whole, dates_model(), dates_whole_history.lr)


@pytest.mark.parametrize("accumulate", [2, 4])
def test_accumulation_on_padded_dates_equals_the_whole_batch_to_float32_rounding(accumulate):
    """Issue 21: averaging the micro-batches' mean losses moved chapter 10's model 5.2e-3 away in 5 steps."""
    whole, split = dates_model(), dates_model()
    whole_history = train_dates(whole)
    split_history = train_dates(split, accumulate=accumulate)
    assert_float32_rounding_apart(split, whole, dates_model(), whole_history.lr)
    assert split_history.train_loss == pytest.approx(whole_history.train_loss, abs=FLOAT32_LOSS_TOLERANCE)
    assert largest_difference(whole, dates_model()) > 5e-3, "the parameters moved far more than the tolerance"


@pytest.mark.parametrize("task", ["gpt", "dates"])
def test_muon_whole_batch_and_split_agree_to_the_bfloat16_bound(task):
    """Muon's bfloat16 orthogonalisation: not float32-close, but within the bound derived in muon_bound."""
    if task == "gpt":
        runs = [(tiny_model(), acc) for acc in (1, 2)]
        histories = [train(m, pattern_data(), pattern_data(seed=1), config(optimizer="muon"), accumulate=acc)
                     for m, acc in runs]
        start = tiny_model()
    else:
        runs = [(dates_model(), acc) for acc in (1, 2)]
        histories = [train_dates(m, accumulate=acc, optimizer="muon") for m, acc in runs]
        start = dates_model()
    (whole, _), (split, _) = runs
    bound = muon_bound(whole, histories[0].lr)
    assert largest_difference(whole, split) <= bound
    assert largest_difference(whole, start) > 3 * bound, "the bound is well below how far training moves them"
    assert histories[1].train_loss == pytest.approx(histories[0].train_loss, abs=MUON_LOSS_TOLERANCE)


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
    """Bit for bit with Muon (the command line's default): the one-process runs accumulate two micro-batches, the
    two processes' arithmetic, so the comparison relies on nothing a CPU may round its own way."""
    text = tmp_path / "play.txt"
    text.write_text("\n".join(["ROMEO: But soft, what light through yonder window breaks?",
                               "JULIET: O Romeo, Romeo, wherefore art thou Romeo?"] * 200) + "\n", encoding="utf-8")
    whole, run = tmp_path / "whole", tmp_path / "run"
    one_process = ["--max-steps", "20", "--accumulate", "2", *SMALL]
    assert cli.main(["train", "--text", str(text), "--out", str(whole), *one_process]) == 0

    calls = {"n": 0}
    real_get_batch = training.get_batch

    def crashing_get_batch(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 15:  # after the checkpoint of step 10
            raise RuntimeError("power cut")
        return real_get_batch(*args, **kwargs)

    monkeypatch.setattr(training, "get_batch", crashing_get_batch)
    with pytest.raises(RuntimeError, match="power cut"):
        cli.main(["train", "--text", str(text), "--out", str(run), *one_process])
    monkeypatch.setattr(training, "get_batch", real_get_batch)
    assert load_checkpoint(run)[1]["step"] == 10

    capfd.readouterr()
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    status = cli.main(["train", "--out", str(run), "--resume", "--nproc", "2", "--no-progress"])  # starts torchrun
    out, err = capfd.readouterr()
    assert status == 0, out + err
    assert out.count("resuming") == 1 and out.count("done: step 20") == 1, "process 0 alone prints"
    a, ckpt_a = load_checkpoint(whole)
    b, ckpt = load_checkpoint(run)
    assert ckpt["train_config"]["optimizer"] == "muon" and ckpt["step"] == 20
    assert_bit_for_bit(a, b, "a one-process Muon run resumed on two processes")
    assert ckpt["history"]["train_loss"] == ckpt_a["history"]["train_loss"]
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


# --- the guard: the comparisons under another CPU capability ----------------------------------------------------


def test_the_run_comparisons_hold_under_another_cpu_capability():
    """A CI-cheap guard against CPU-specific assumptions (issue 21): the comparisons that need no second process
    (float32 and bfloat16 tolerances, bit-for-bit resume) re-run with PyTorch's portable kernels
    (ATEN_CPU_CAPABILITY=default: no AVX2 / AVX-512 paths) on one thread, as on a CPU unlike this one."""
    other = "avx2" if os.environ.get("ATEN_CPU_CAPABILITY") == "default" else "default"
    selection = ["tests/test_distributed.py::test_accumulation_on_padded_dates_equals_the_whole_batch_to_float32_"
                 "rounding[2]",
                 "tests/test_distributed.py::test_muon_whole_batch_and_split_agree_to_the_bfloat16_bound",
                 "tests/test_training.py::test_resume_after_a_crash_ends_bit_for_bit_like_an_uninterrupted_run[muon]",
                 "tests/test_training.py::test_accumulated_micro_batches_give_the_whole_padded_batchs_gradient[2]"]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "ATEN_CPU_CAPABILITY": other, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *selection], cwd=root,
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"under ATEN_CPU_CAPABILITY={other}:\n{done.stdout[-3000:]}{done.stderr[-2000:]}"
