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
