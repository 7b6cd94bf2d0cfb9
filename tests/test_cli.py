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
