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


def fake_build(returncode, page):
    """A stand-in for the jupyter-book run: writes ``page`` as index.html into its output folder."""

    def run(cmd, **kwargs):
        out = Path(cmd[cmd.index("--path-output") + 1]) / "_build" / "html"
        out.mkdir(parents=True)
        (out / "index.html").write_text(page)
        return subprocess.CompletedProcess(cmd, returncode)

    return run


@pytest.fixture
def previous_book(tmp_path, monkeypatch):
    build = tmp_path / "_build"
    (build / "html").mkdir(parents=True)
    (build / "html" / "index.html").write_text("the previous book")
    monkeypatch.setattr(build_book, "BUILD", build)
    monkeypatch.setattr(build_book, "vendor_mathjax", lambda: None)
    return build


def test_failed_book_build_leaves_nothing_half_written(previous_book, monkeypatch):
    monkeypatch.setattr(build_book.subprocess, "run", fake_build(1, "half a book"))
    with pytest.raises(SystemExit, match="book build failed"):
        build_book.build()
    assert (previous_book / "html" / "index.html").read_text() == "the previous book"
    assert sorted(p.name for p in previous_book.iterdir()) == ["html"], "no temporary build folder may remain"


def test_successful_book_build_replaces_the_previous_one(previous_book, monkeypatch):
    monkeypatch.setattr(build_book.subprocess, "run", fake_build(0, "new book"))
    index = build_book.build()
    assert index == previous_book / "html" / "index.html" and index.read_text() == "new book"
    assert sorted(p.name for p in previous_book.iterdir()) == ["html"]
