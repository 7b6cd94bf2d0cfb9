import os
import subprocess
import sys

import pytest

from groundup import cli
from groundup.bench import Row, format_rows, median_time


def test_console_script_help_lists_the_commands():
    result = subprocess.run([sys.executable, "-m", "groundup.cli", "--help"], capture_output=True, text=True)
    assert result.returncode == 0
    assert "data" in result.stdout and "bench" in result.stdout


def test_unknown_corpus_fails_with_the_known_names(capsys):
    assert cli.main(["data", "nonsense"]) == 1
    assert "known corpora: shakespeare, tinyshakespeare" in capsys.readouterr().err


def test_unknown_bench_section_is_an_error(capsys):
    with pytest.raises(SystemExit):
        cli.main(["bench", "warp-drive"])
    assert "unknown section(s) warp-drive" in capsys.readouterr().err


def test_median_time_and_report_format():
    calls = []
    seconds = median_time(lambda: calls.append(1), repeat=5, warmup=2)
    assert len(calls) == 7 and 0 <= seconds < 1
    text = format_rows("[demo]", [Row("speed", 1234.5, "tokens/s", "ratio 1.50x")])
    assert text.splitlines()[0] == "[demo]" and "1234" in text and "ratio 1.50x" in text


def test_matmul_section_measures_a_positive_peak():
    from groundup.bench import matmul

    rows = matmul.run()
    assert rows[0].unit == "GFLOP/s" and rows[0].value > 0


def test_training_bench_reference_is_a_causal_gpt_and_flops_follow_the_formula():
    import torch

    from groundup.bench.training import TorchModulesGPT, flops_per_token
    from groundup.models import GPTConfig

    c = GPTConfig(vocab_size=11, context_length=8, d_model=16, n_layers=2, n_heads=2)
    d, f = 16, 64
    per_block = 4 * d * d + 2 * d * f  # W_q, W_k, W_v, W_o and the FFN's two matrices
    assert flops_per_token(c) == 6 * (2 * per_block + 11 * d) + 12 * 2 * 8 * d
    torch.manual_seed(0)
    ref = TorchModulesGPT(c).eval()
    idx = torch.randint(0, 11, (2, 8))
    logits, loss = ref(idx, idx)
    assert logits.shape == (2, 8, 11) and loss.item() > 0
    changed = idx.clone()
    changed[:, -1] = (changed[:, -1] + 1) % 11
    assert torch.allclose(ref(changed, changed)[0][:, :-1], logits[:, :-1], atol=1e-6), "causal: the past is unchanged"
    assert not torch.allclose(ref(changed, changed)[0][:, -1], logits[:, -1])


def test_bench_quality_section_runs_only_when_named(capsys):
    from groundup.bench.__main__ import OPTIONAL, SECTIONS

    assert "quality" in OPTIONAL and "quality" not in SECTIONS and "training" in SECTIONS


# ---- hardening: the command line -------------------------------------------------------------------------


def test_version_flag_and_python_dash_m_groundup():
    from groundup import __version__

    result = subprocess.run([sys.executable, "-m", "groundup", "--version"], capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout.strip() == f"groundup {__version__}"


def test_data_help_lists_the_corpora(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["data", "--help"])
    assert exit_.value.code == 0
    assert "shakespeare, tinyshakespeare" in capsys.readouterr().out


def test_bench_help_lists_the_sections(capsys):
    from groundup.bench.__main__ import OPTIONAL, SECTIONS

    with pytest.raises(SystemExit):
        cli.main(["bench", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert all(name in out for name in SECTIONS + OPTIONAL)


def _fake_bench(monkeypatch, behaviour):
    import groundup.bench.__main__ as bench_main

    monkeypatch.setattr(bench_main, "main", behaviour)


def test_broken_pipe_exits_quietly_with_status_141(monkeypatch, capsys):
    def reader_went_away(sections):
        raise BrokenPipeError(32, "Broken pipe")

    _fake_bench(monkeypatch, reader_went_away)
    assert cli.main(["bench"]) == cli.EXIT_BROKEN_PIPE == 141
    assert capsys.readouterr().err == ""


def test_io_error_prints_one_line_and_exits_1(monkeypatch, capsys):
    def disk_full(sections):
        raise OSError(28, "No space left on device", "run/ckpt.pt")

    _fake_bench(monkeypatch, disk_full)
    assert cli.main(["bench"]) == 1
    assert capsys.readouterr().err == "groundup: error: No space left on device: run/ckpt.pt\n"


def test_piping_into_head_prints_no_traceback():
    code = ("import sys; import groundup.bench.__main__ as b\n"
            "b.main = lambda s: [print('line', i) for i in range(200000)] and 0\n"
            "from groundup.cli import main; sys.exit(main(['bench']))")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.readline()
    proc.stdout.close()  # like `| head -1`
    err = proc.stderr.read().decode()
    assert proc.wait() == 141 and "Traceback" not in err and err == ""


@pytest.mark.skipif(not __import__("os").path.exists("/dev/full"), reason="needs /dev/full")
def test_writing_to_a_full_disk_prints_one_line():
    with open("/dev/full", "w") as full:
        result = subprocess.run([sys.executable, "-m", "groundup", "--version"], stdout=full,
                                stderr=subprocess.PIPE, text=True)
    assert result.returncode == 1
    assert result.stderr == "groundup: error: No space left on device\n"


def test_bench_tokenizers_without_the_library_says_what_to_install(monkeypatch, capsys):
    from groundup.bench.__main__ import main as bench_main

    monkeypatch.setitem(sys.modules, "tokenizers", None)  # import tokenizers now fails
    assert bench_main(["tokenizers"]) == 1
    err = capsys.readouterr().err
    assert "[tokenizers] skipped" in err and "pip install tokenizers" in err


# ---- careless and hostile input: every message names the flag the user typed, no tracebacks -----------------

TINY_RUN = ["--layers", "1", "--d-model", "16", "--heads", "2", "--context", "16", "--batch-size", "4",
            "--max-steps", "4", "--eval-interval", "2", "--eval-batches", "1", "--warmup", "1", "--no-progress",
            "--threads", "1"]


@pytest.fixture(scope="module")
def small_text(tmp_path_factory):
    path = tmp_path_factory.mktemp("text") / "t.txt"
    path.write_text("to be or not to be, that is the question.\n" * 40, encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory, small_text):
    out = tmp_path_factory.mktemp("run") / "r"
    assert cli.main(["train", "--text", str(small_text), "--out", str(out), *TINY_RUN]) == 0
    return out


@pytest.mark.parametrize("argv, message", [
    (["sample", "RUN", "--tokens", "-5"], "argument --tokens: must be an integer >= 0, got -5"),
    (["sample", "RUN", "--temperature", "-1"],
     "argument --temperature: must be a number >= 0.001, got -1; for the most probable token at every step use "
     "--greedy"),
    (["sample", "RUN", "--temperature", "1e-40"], "argument --temperature: must be a number >= 0.001, got 1e-40"),
    (["sample", "RUN", "--temperature", "nan"], "argument --temperature: must be a number >= 0.001, got nan"),
    (["sample", "RUN", "--top-p", "0"], "argument --top-p: must be a number in (0, 1], got 0"),
    (["sample", "RUN", "--top-k", "0"], "argument --top-k: must be a positive integer, got 0"),
    (["sample", "RUN", "--seed", "9999999999999999999999"],
     "argument --seed: must be an integer from 0 to 2**64 - 1 = 18446744073709551615, got 9999999999999999999999"),
    (["sample", "RUN", "--device", "bogus"], "argument --device: unknown device 'bogus': use cpu, cuda, cuda:N or mps"),
    (["train", "--out", "OUT", "--threads", "-1"], "argument --threads: must be an integer from 1 to 1024, got -1"),
    (["train", "--out", "OUT", "--threads", "100000"], "argument --threads: must be an integer from 1 to 1024"),
    (["train", "--out", "OUT", "--d-model", "-3"], "argument --d-model: must be a positive integer, got -3"),
    (["train", "--out", "OUT", "--dropout", "1"], "argument --dropout: must be a number in [0, 1), got 1"),
    (["train", "--out", "OUT", "--lr", "0"], "argument --lr: must be a number > 0, got 0"),
    (["train", "--out", "OUT", "--minutes", "inf"], "argument --minutes: must be a number > 0, got inf"),
    (["train", "--out", "OUT", "--seed", "-1"], "argument --seed: must be an integer from 0 to 2**64 - 1"),
    (["train", "--out", "OUT", "--warmup", "x"], "argument --warmup: must be an integer >= 0, got 'x'"),
])
def test_out_of_range_flags_are_usage_errors_that_name_the_flag(tmp_path, capsys, argv, message):
    argv = [str(tmp_path / "r") if a in ("RUN", "OUT") else a for a in argv]
    with pytest.raises(SystemExit) as stop:
        cli.main(argv)
    assert stop.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has CUDA")
def test_device_cuda_without_cuda_is_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit):
        cli.main(["train", "--out", str(tmp_path / "r"), "--device", "cuda"])
    assert "argument --device: cannot use 'cuda': no CUDA GPU is available here" in capsys.readouterr().err


def test_settings_the_model_refuses_are_reported_with_the_flags(tmp_path, small_text, capsys):
    assert cli.main(["train", "--text", str(small_text), "--out", str(tmp_path / "r"), "--d-model", "100",
                     "--heads", "6"]) == 1
    assert "error: --d-model (100) must be divisible by --heads (6)" in capsys.readouterr().err
    assert cli.main(["train", "--text", str(small_text), "--out", str(tmp_path / "r"), "--lr", "0.1",
                     "--min-lr", "0.5"]) == 1
    assert "error: --min-lr (0.5) must not exceed --lr (0.1)" in capsys.readouterr().err
    assert not (tmp_path / "r").exists(), "a run that never started leaves no folder"


@pytest.mark.parametrize("flags, named", [
    (["--d-model", "100000", "--heads", "4"], "--d-model 100000"),  # 4.8e11 parameters: 7,700 GB to train
    (["--positional", "learned", "--context", "100000000"], "--context 100000000"),  # a 1e8 x 192 table, logits
])
def test_absurd_model_sizes_are_refused_before_anything_is_allocated(tmp_path, small_text, capsys, flags, named):
    from groundup.footprint import device_memory

    if device_memory() is None:
        pytest.skip("this system does not report its memory")
    assert cli.main(["train", "--text", str(small_text), "--out", str(tmp_path / "r"), *flags]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: training this model (") and named in err, err
    assert "GB of memory, more than this machine's" in err and "choose smaller values" in err, err
    assert not (tmp_path / "r").exists()


def test_too_many_processes_for_the_memory_are_refused_before_any_starts(tmp_path, small_text, capsys):
    from groundup.footprint import device_memory

    if device_memory() is None:
        pytest.skip("this system does not report its memory")
    # each process: PyTorch itself (>= 200 MB) and a copy of the model: 100,000 of them need more than 20 TB
    assert cli.main(["train", "--text", str(small_text), "--out", str(tmp_path / "r"), "--nproc", "100000"]) == 1
    err = capsys.readouterr().err
    assert "; 100000 processes) needs at least" in err and "or fewer processes (--nproc)" in err, err


def test_the_training_estimate_counts_adamw_state_and_a_batch_of_logits():
    from groundup.footprint import meta_model, training_bytes
    from groundup.models import GPT, GPTConfig

    shape = meta_model(GPT, GPTConfig(vocab_size=10, context_length=8, d_model=16, n_layers=2, n_heads=2))
    n = sum(p.numel() for p in shape.parameters())
    parts = training_bytes(shape, batch_size=3, context_length=8)
    assert parts["parameters"] == 16 * n  # weights, gradients, two moments in float32
    assert parts["activations"] == 4 * 3 * 8 * (2 * 10 + 2 * 16)  # logits and their gradient, one stream per block
    assert parts["total"] == parts["parameters"] + parts["buffers"] + parts["activations"]


# Issue 40: --layers 100000 never reached the size check (building 100,000 blocks, even on the meta device, ran for
# minutes and left a .lock behind when killed); the others took seconds. Now every size is counted from the flags
# before anything is built, read or created.
ABSURD_SIZES = [
    (["--layers", "100000"], "--layers 100000"),  # 4.4e10 parameters
    (["--d-model", "1000000", "--heads", "4"], "--d-model 1000000"),  # 4.8e13 parameters
    (["--context", "10000000"], "--context 10000000"),  # attention weights of 10^7 x 10^7
    (["--batch-size", "100000000"], "--batch-size 100000000"),  # 10^10 tokens of logits per step
]


def _forbid(monkeypatch, target, name: str, what: str) -> None:
    def forbidden(*args, **kwargs):
        raise AssertionError(f"{what} before the size check refused the run")

    monkeypatch.setattr(target, name, forbidden)


@pytest.mark.parametrize("flags, named", ABSURD_SIZES)
def test_absurd_sizes_are_refused_from_the_flags_before_anything_is_built_read_or_created(
        tmp_path, capsys, monkeypatch, flags, named):
    import time

    from groundup import layers, runs
    from groundup.footprint import device_memory

    if device_memory() is None:
        pytest.skip("this system does not report its memory")
    for cls in (runs.GPT, runs.MaskedLM, runs.EncoderDecoder, layers.TransformerBlock, layers.DecoderBlock):
        _forbid(monkeypatch, cls, "__init__", f"a {cls.__name__} was built")  # not even on the meta device
    _forbid(monkeypatch, runs, "run_lock", "the run folder was created and locked")
    _forbid(monkeypatch, runs, "load_corpus", "the corpus was read")
    out = tmp_path / "R3"
    started = time.perf_counter()
    assert cli.main(["train", "--out", str(out), "--max-steps", "2", *flags]) == 1
    seconds = time.perf_counter() - started  # about 0.01 s; not asserted (a loaded machine), the forbidden calls are
    err = capsys.readouterr().err
    assert err.startswith("error: training this model (at least ") and named in err, (seconds, err)
    assert "GB of memory, more than this machine's" in err and "choose smaller values" in err, err
    assert not out.exists(), "no folder, so no lock file"


def test_a_size_refused_only_with_the_real_vocabulary_leaves_no_lock_and_builds_nothing(
        tmp_path, small_text, capsys, monkeypatch):
    # A memory between the estimate from the flags (the smallest vocabulary) and the estimate with the text's: the
    # check inside the run folder's lock refuses it, and the lock file goes with the refusal.
    from groundup import footprint, layers, runs
    from groundup.models import GPTConfig

    flags = ["--batch-size", "100000", "--context", "64", "--layers", "1", "--d-model", "32", "--heads", "2"]
    vocab = len(set(small_text.read_text(encoding="utf-8")))
    needs = {}
    for v in (1, vocab):
        config = GPTConfig(vocab_size=v, context_length=64, d_model=32, n_layers=1, n_heads=2, positional="rope")
        attention = 4 * 100000 * 2 * 64 ** 2
        needs[v] = footprint.config_training_bytes(config, 100000, 64)["total"] + attention
    assert needs[1] < needs[vocab]
    monkeypatch.setattr(footprint, "device_memory", lambda device=None: (needs[1] + needs[vocab]) // 2)
    for cls in (runs.GPT, layers.TransformerBlock):
        _forbid(monkeypatch, cls, "__init__", f"a {cls.__name__} was built")
    for out, existed in ((tmp_path / "new", False), (tmp_path / "mine", True)):
        if existed:
            out.mkdir()
        assert cli.main(["train", "--text", str(small_text), "--out", str(out), "--device", "cpu", *flags]) == 1
        err = capsys.readouterr().err
        assert err.startswith("error: training this model (") and "at least" not in err.split("needs")[0], err
        assert "--batch-size 100000" in err, err
        assert out.exists() == existed and (not existed or list(out.iterdir()) == []), "no .lock, nothing left"


def test_text_files_that_are_empty_endless_or_not_text_get_clear_errors(tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    assert cli.main(["train", "--text", str(empty), "--out", str(tmp_path / "r")]) == 1
    assert f"error: --text {empty} is empty: give a file with some text to train on" in capsys.readouterr().err
    binary = tmp_path / "b.bin"
    binary.write_bytes(b"abc\xff\xfe")
    assert cli.main(["train", "--text", str(binary), "--out", str(tmp_path / "r")]) == 1
    assert f"--text {binary} is not UTF-8 text (byte 3: invalid start byte)" in capsys.readouterr().err
    if os.path.exists("/dev/zero"):  # endless: read up to the bound, then refused
        assert cli.main(["train", "--text", "/dev/zero", "--out", str(tmp_path / "r")]) == 1
        assert "--text /dev/zero is larger than 100 MB" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_out_naming_a_file_is_a_clear_error(tmp_path, small_text, capsys):
    (tmp_path / "f").write_text("not a folder")
    assert cli.main(["train", "--text", str(small_text), "--out", str(tmp_path / "f")]) == 1
    assert capsys.readouterr().err == f"error: --out {tmp_path / 'f'} is a file: give a folder for the run (it is " \
                                      "created if need be)\n"


def test_a_text_too_short_for_the_context_names_both(tmp_path, capsys):
    short = tmp_path / "short.txt"
    short.write_text("abcdefghij" * 30)  # 300 characters: a validation tenth of 30
    assert cli.main(["train", "--text", str(short), "--out", str(tmp_path / "r"), "--context", "64"]) == 1
    assert f"--text {short} has 300 characters: too few for --context 64" in capsys.readouterr().err


def test_minutes_announce_a_time_not_a_billion_steps(tmp_path, small_text, capsys, monkeypatch):
    from groundup import runs

    def stop_at_once(*args, **kwargs):
        raise KeyboardInterrupt("stopped by the test")

    monkeypatch.setattr(runs, "train", stop_at_once)
    assert cli.main(["train", "--text", str(small_text), "--out", str(tmp_path / "r"), "--minutes", "0.3",
                     *TINY_RUN[:8], "--no-progress"]) == 130
    out, err = capsys.readouterr()
    assert "for 0.3 minutes (--minutes) of 8 x 16 tokens" in out and "1000000000" not in out, out
    assert "stopped by the test before the first checkpoint: nothing to resume" in err, err


def test_train_help_shows_the_default_corpus():
    text = " ".join(subprocess.run([sys.executable, "-m", "groundup", "train", "--help"], capture_output=True,
                                   text=True).stdout.split())
    assert ("--corpus {shakespeare,tinyshakespeare} a named corpus: shakespeare (Project Gutenberg's Shakespeare, "
            "42 works, 5.06 M characters; the default)") in text, text


def test_an_empty_prompt_starts_from_a_newline_like_no_prompt(tiny_run, capsys):
    assert cli.main(["sample", str(tiny_run), "--tokens", "20", "--prompt", ""]) == 0
    empty = capsys.readouterr().out
    assert cli.main(["sample", str(tiny_run), "--tokens", "20"]) == 0
    assert capsys.readouterr().out == empty and empty.startswith("\n") and len(empty) == 22


def test_sample_piped_into_head_exits_141_quietly(tiny_run):
    prompt = "to be or not to be " * 6_000  # echoed: 114 kB, more than a pipe holds (64 kB), so printing blocks
    proc = subprocess.Popen([sys.executable, "-m", "groundup", "sample", str(tiny_run), "--tokens", "1", "--prompt",
                             prompt], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.read(1)
    proc.stdout.close()  # like `| head -c 1`
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=300) == 141 and err == "", err


def test_a_full_disk_names_the_file_that_could_not_be_written(tmp_path, small_text, capsys, monkeypatch):
    import groundup.utils

    def no_space(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(groundup.utils.os, "fsync", no_space)
    out = tmp_path / "r"
    assert cli.main(["train", "--text", str(small_text), "--out", str(out), *TINY_RUN]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: No space left on device: {out}{os.sep}") and err.count("\n") == 1, err


def test_resume_works_from_another_directory(tmp_path, small_text, capsys, monkeypatch):
    here, elsewhere = tmp_path / "here", tmp_path / "elsewhere"
    here.mkdir()
    elsewhere.mkdir()
    (here / "t.txt").write_bytes(small_text.read_bytes())
    monkeypatch.chdir(here)
    assert cli.main(["train", "--text", "t.txt", "--out", "run", *TINY_RUN]) == 0
    from groundup.training import load_checkpoint

    assert load_checkpoint(here / "run")[1]["extra"]["source"]["text_file"] == str(here / "t.txt")
    monkeypatch.chdir(elsewhere)
    assert cli.main(["train", "--out", str(here / "run"), "--resume", "--no-progress", "--threads", "1"]) == 0
    assert "resuming" in capsys.readouterr().out
    # both moved together: found relative to the run folder
    moved = tmp_path / "moved"
    moved.mkdir()
    (here / "t.txt").rename(moved / "t.txt")
    (here / "run").rename(moved / "run")
    assert cli.main(["train", "--out", str(moved / "run"), "--resume", "--no-progress", "--threads", "1"]) == 0


def test_a_damaged_random_state_in_a_checkpoint_is_refused_on_resume(tmp_path, small_text, capsys):
    import torch

    from groundup.training import CHECKPOINT_NAME

    out = tmp_path / "r"
    assert cli.main(["train", "--text", str(small_text), "--out", str(out), *TINY_RUN]) == 0
    state = torch.load(out / CHECKPOINT_NAME, weights_only=True)
    state["sampler_rng"] = torch.zeros(3, dtype=torch.uint8)
    torch.save(state, out / CHECKPOINT_NAME)
    capsys.readouterr()
    assert cli.main(["train", "--out", str(out), "--resume", "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: {out / CHECKPOINT_NAME} holds a damaged random state (sampler_rng: "), err


def test_ctrl_c_in_a_command_without_its_own_handling_exits_130_quietly(monkeypatch, capsys):
    def interrupted(sections):
        raise KeyboardInterrupt

    _fake_bench(monkeypatch, interrupted)
    assert cli.main(["bench"]) == cli.EXIT_INTERRUPTED == 130
    assert capsys.readouterr().err == "\ninterrupted\n"
