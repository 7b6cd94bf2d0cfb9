"""The notebook sync script and the book builder, on throw-away inputs."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import build_book  # noqa: E402
import sync_notebooks  # noqa: E402

REPO = sync_notebooks.repository_url()


def notebook(*cells):
    return {"cells": [{"cell_type": kind, "metadata": {}, "source": src, **({"outputs": [], "execution_count": None}
                                                                            if kind == "code" else {})}
                      for kind, src in cells], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}


def test_repository_url_comes_from_pyproject():
    assert REPO.startswith("https://github.com/") and not REPO.endswith("/")


def test_sync_inserts_badge_and_setup_cell():
    nb = notebook(("markdown", "# 9. Test\n\nIntro."), ("code", "import groundup"))
    new = sync_notebooks.synced(nb, "09_test.ipynb", REPO)
    first = new["cells"][0]["source"]
    assert first.startswith("# 9. Test\n\n[Open in Colab](https://colab.research.google.com/github/")
    assert "/blob/main/notebooks/09_test.ipynb)" in first and first.endswith("\n\nIntro.")
    setup = new["cells"][1]
    assert setup["cell_type"] == "code" and setup["source"].startswith("# Setup: on Colab")
    assert f"groundup @ git+{REPO}" in setup["source"] and "google.colab" in setup["source"]
    assert setup["metadata"]["tags"] == ["remove-cell"]
    assert new["cells"][2]["source"] == "import groundup"
    again = sync_notebooks.synced(new, "09_test.ipynb", REPO)
    assert again == new, "syncing twice changes nothing"


def test_sync_replaces_a_stale_badge_and_setup_cell():
    stale = notebook(("markdown", "# 9. Test\n\n[Open in Colab](https://old.example/x.ipynb)\n\nIntro."),
                     ("code", "# Setup: on Colab (old)\nprint('old')"))
    new = sync_notebooks.synced(stale, "09_test.ipynb", REPO)
    assert "old.example" not in new["cells"][0]["source"]
    assert "print('old')" not in new["cells"][1]["source"] and len(new["cells"]) == 2


def test_sync_rejects_a_notebook_without_a_title():
    with pytest.raises(ValueError, match="first cell must be markdown starting with the '# N. Title' heading"):
        sync_notebooks.synced(notebook(("code", "x = 1")), "09_test.ipynb", REPO)


def test_check_mode_fails_on_a_stale_notebook(tmp_path):
    path = tmp_path / "09_test.ipynb"
    path.write_text(json.dumps(notebook(("markdown", "# 9. Test"), ("code", "x = 1"))))
    script = ROOT / "tools" / "sync_notebooks.py"
    check = subprocess.run([sys.executable, str(script), "--check", str(path)], capture_output=True, text=True)
    assert check.returncode == 1 and "out of sync" in check.stdout
    assert subprocess.run([sys.executable, str(script), str(path)], capture_output=True).returncode == 0
    check = subprocess.run([sys.executable, str(script), "--check", str(path)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout


def test_failed_book_build_leaves_nothing_half_written(tmp_path, monkeypatch):
    build = tmp_path / "_build"
    (build / "html").mkdir(parents=True)
    (build / "html" / "index.html").write_text("the previous book")
    monkeypatch.setattr(build_book, "BUILD", build)
    monkeypatch.setattr(build_book, "vendor_mathjax", lambda: None)

    def failing_build(cmd, **kwargs):
        out = Path(cmd[cmd.index("--path-output") + 1]) / "_build" / "html"
        out.mkdir(parents=True)
        (out / "index.html").write_text("half a book")
        return subprocess.CompletedProcess(cmd, 1)

    monkeypatch.setattr(build_book.subprocess, "run", failing_build)
    with pytest.raises(SystemExit, match="book build failed"):
        build_book.build()
    assert (build / "html" / "index.html").read_text() == "the previous book"
    assert sorted(p.name for p in build.iterdir()) == ["html"], "no temporary build folder may remain"


def test_successful_book_build_replaces_the_previous_one(tmp_path, monkeypatch):
    build = tmp_path / "_build"
    (build / "html").mkdir(parents=True)
    (build / "html" / "old.html").write_text("old")
    monkeypatch.setattr(build_book, "BUILD", build)
    monkeypatch.setattr(build_book, "vendor_mathjax", lambda: None)

    def good_build(cmd, **kwargs):
        out = Path(cmd[cmd.index("--path-output") + 1]) / "_build" / "html"
        out.mkdir(parents=True)
        (out / "index.html").write_text("new book")
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(build_book.subprocess, "run", good_build)
    index = build_book.build()
    assert index == build / "html" / "index.html" and index.read_text() == "new book"
    assert sorted(p.name for p in build.iterdir()) == ["html"]
