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
