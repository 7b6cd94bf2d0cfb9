"""``groundup train``'s messages name the flag the user typed (issue 22): a --text too short to split, an empty
--out, a --context whose attention could never be trained here."""

import pytest

from groundup import cli


def test_a_text_too_short_to_split_names_the_flag(tmp_path, capsys):
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("abc", encoding="utf-8")
    assert cli.main(["train", "--text", str(tiny), "--out", str(tmp_path / "r"), "--no-progress"]) == 1
    assert capsys.readouterr().err == (f"error: --text {tiny} has 3 characters: too few to keep a tenth for "
                                       "validation; give a longer text\n")
    assert not (tmp_path / "r").exists()


def test_an_empty_out_is_refused_before_anything_is_written(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    text = tmp_path / "t.txt"
    text.write_text("to be or not to be\n" * 20, encoding="utf-8")
    for empty in ("", "  "):
        assert cli.main(["train", "--text", str(text), "--out", empty, "--no-progress"]) == 1
        assert capsys.readouterr().err == "error: --out is empty: give a folder for the run (it is created if " \
                                          "need be)\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.txt"], "nothing trained into the current folder"


def test_a_context_whose_attention_cannot_fit_names_the_flag(tmp_path, capsys):
    from groundup.footprint import device_memory

    if device_memory() is None:
        pytest.skip("this system does not report its memory")
    text = tmp_path / "t.txt"
    text.write_text("to be or not to be\n" * 20, encoding="utf-8")
    # 8 windows x 6 heads x 100,000^2 float32 attention weights: 1.9 TB, far beyond any machine of this book
    assert cli.main(["train", "--text", str(text), "--out", str(tmp_path / "r"), "--context", "100000",
                     "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: training this model (") and "--context 100000" in err, err
    assert "needs at least 1,9" in err and "GB of memory" in err, err
    assert not (tmp_path / "r").exists()
