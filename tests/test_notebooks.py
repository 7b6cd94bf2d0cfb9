"""Checks on the chapter notebooks as stored: table of contents, badge and setup cells, stored outputs, nbval
coverage, exercises and markdown that reads cleanly in JupyterLab and Colab."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
NAME = re.compile(r"^(\d\d)_[a-z0-9_]+\.ipynb$")
# MyST syntax that JupyterLab and Colab would show as raw text.
MYST = re.compile(r"^\s*(```|~~~)\s*\{|^\s*:::|\{(cite|ref|doc|numref|eq|term|download)(:\w+)?\}`", re.MULTILINE)
LEAKS = re.compile(r"(/work/|/tmp/|/root/|/home/\w+/|\.\./shared|site-packages)")
IGNORE = "# NBVAL_IGNORE_OUTPUT"


def cells(path, kind=None):
    nb = json.loads(path.read_text(encoding="utf-8"))
    return [c for c in nb["cells"] if kind is None or c["cell_type"] == kind]


def source(cell):
    src = cell["source"]
    return "".join(src) if isinstance(src, list) else src


def toc_files():
    toc = yaml.safe_load((ROOT / "book" / "_toc.yml").read_text())
    files = [toc["root"]]

    def walk(entries):
        for entry in entries:
            if "file" in entry:
                files.append(entry["file"])
            walk(entry.get("sections", []))
            walk(entry.get("chapters", []))

    for part in toc.get("parts", []):
        walk(part.get("chapters", []))
    walk(toc.get("chapters", []))
    return files


def test_there_are_chapters():
    assert NOTEBOOKS, "no notebooks found in notebooks/"


def test_table_of_contents_matches_the_notebooks():
    listed = toc_files()
    chapters = [f for f in listed if f.startswith("notebooks/")]
    on_disk = [f"notebooks/{p.stem}" for p in NOTEBOOKS]
    assert sorted(chapters) == on_disk, "book/_toc.yml and notebooks/ disagree"
    assert chapters == sorted(chapters), "chapters must appear in the table of contents in numeric order"
    for entry in listed:
        assert any((ROOT / f"{entry}{ext}").exists() for ext in (".md", ".ipynb")), f"{entry} has no file"


def test_notebooks_are_in_sync_with_the_repository_url():
    result = subprocess.run([sys.executable, str(ROOT / "tools" / "sync_notebooks.py"), "--check"],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_chapter_shape(path):
    assert NAME.match(path.name), f"{path.name} must be named NN_slug.ipynb"
    number = int(path.name[:2])
    all_cells = cells(path)
    title = source(all_cells[0])
    assert title.startswith(f"# {number}. "), f"the first cell must start with '# {number}. Title'"
    assert "[Open in Colab](https://colab.research.google.com/github/" in title
    assert "[Download this notebook](" in title
    assert "![" not in title, "the badge must be a text link: a remote image breaks offline builds"
    assert source(all_cells[1]).startswith("# Setup: on Colab"), "the second cell must be the setup cell"
    code = [source(c) for c in cells(path, "code")]
    assert "groundup.set_seed(" in code[1], "the first code cell after setup imports and seeds"
    assert sum(c.count("set_seed(") for c in code) == 1, "seed once, in the first code cell"
    headings = [line for c in cells(path, "markdown") for line in source(c).splitlines() if line.startswith("## ")]
    for needed in ("## Learning goals", "## Summary", "## Exercises", "## References"):
        assert needed in headings, f"missing section {needed!r}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_markdown_has_no_myst_syntax(path):
    for cell in cells(path, "markdown"):
        match = MYST.search(source(cell))
        assert not match, f"MyST syntax {match.group(0)!r} would show as raw text in JupyterLab/Colab"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_stored_executed_top_to_bottom_without_errors_or_paths(path):
    code = [c for c in cells(path, "code") if source(c).strip()]
    counts = [c["execution_count"] for c in code]
    assert counts == list(range(1, len(code) + 1)), "re-run the notebook top to bottom (tools/run_notebook.py)"
    for cell in code:
        for out in cell["outputs"]:
            assert out["output_type"] != "error", f"stored error output: {out.get('ename')}"
            text = json.dumps(out.get("text", "")) + json.dumps(out.get("data", {}).get("text/plain", ""))
            assert not LEAKS.search(text), f"an output shows a machine path: {LEAKS.search(text).group(0)}"
            assert "image/svg+xml" not in out.get("data", {}), "SVG outputs embed ids and dates: use PNG"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_nbval_compares_at_least_80_percent_of_outputs(path):
    with_output = [c for c in cells(path, "code") if c["outputs"]]
    ignored = [c for c in with_output if source(c).lstrip().startswith(IGNORE)
               or "nbval-ignore-output" in c["metadata"].get("tags", [])
               or "nbval-skip" in c["metadata"].get("tags", []) or "# NBVAL_SKIP" in source(c)]
    compared = 1 - len(ignored) / max(len(with_output), 1)
    assert compared >= 0.8, f"only {compared:.0%} of the output cells are compared by nbval"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_exercises_have_stub_checker_and_hidden_solution(path):
    all_cells = cells(path)
    exercises = [i for i, c in enumerate(all_cells) if c["cell_type"] == "markdown"
                 and re.search(r"^###? Exercise \d+\.\d+", source(c), re.MULTILINE)]
    assert len(exercises) >= 4, "every chapter has at least four exercises"
    solutions = [c for c in all_cells if c["cell_type"] == "code" and source(c).startswith("# Solution")]
    assert len(solutions) >= len(exercises), "every exercise has a worked solution"
    for cell in solutions:
        assert "hide-cell" in cell["metadata"].get("tags", []), "solutions are hidden in the book (tag hide-cell)"
        assert cell["metadata"].get("jupyter", {}).get("source_hidden"), "solutions are collapsed in JupyterLab"
    checked = [c for c in all_cells if c["cell_type"] == "code" and "raise NotImplementedError" in source(c)]
    assert len(checked) >= 2, "at least two exercises are auto-checked (a stub cell for the reader)"
    stub_outputs = [json.dumps(c["outputs"]) for c in all_cells if c["cell_type"] == "code"
                    and re.search(r"check_\w+\(", source(c)) and not source(c).startswith("# Sol")]
    assert any("not attempted yet" in s for s in stub_outputs), "the checker is run on the reader's stub"
