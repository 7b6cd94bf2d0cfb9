"""Checks on the chapter notebooks as stored: table of contents, badge and setup cells, stored outputs, nbval
coverage, exercises and markdown that reads cleanly in JupyterLab and Colab."""

import ast
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


BOOK_CODE_WIDTH = 88  # the book (jupyter-book) cuts code lines wider than this


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_code_lines_fit_the_book(path):
    wide = [f"cell {i}: {len(line)} characters: {line!r}"
            for i, cell in enumerate(cells(path)) if cell["cell_type"] == "code"
            for line in source(cell).splitlines() if len(line) > BOOK_CODE_WIDTH]
    assert not wide, (f"{path.name}: code lines wider than {BOOK_CODE_WIDTH} characters (the book cuts them):\n"
                      + "\n".join(wide))


def optimizer_calls(code):
    """The text of every ``torch.optim.Adam(...)`` and ``torch.optim.AdamW(...)`` call in ``code``, brackets matched."""
    calls = []
    for match in re.finditer(r"torch\.optim\.AdamW?\(", code):
        depth, end = 0, match.end() - 1
        for end in range(match.end() - 1, len(code)):
            depth += {"(": 1, ")": -1}.get(code[end], 0)
            if depth == 0:
                break
        calls.append(code[match.start():end + 1])
    return calls


def test_optimizer_calls_are_found_whole():
    code = 'a = torch.optim.AdamW(f(x), lr=3e-3,\n    fused=True)\nb = torch.optim.Adam([w], lr=0.1)'
    assert optimizer_calls(code) == ["torch.optim.AdamW(f(x), lr=3e-3,\n    fused=True)",
                                     "torch.optim.Adam([w], lr=0.1)"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_every_adam_in_the_notebooks_is_fused(path):
    """PyTorch's per-tensor Adam and AdamW (their default on a CPU) take MKL's float32 square root, whose last bit the
    CPU's maker defines (tools/nbval_lanes.py): a training run would then print other losses on another maker's CPU.
    The fused kernels (``fused=True``, as groundup's ``train``) take the IEEE square root on every CPU."""
    unfused = [f"cell {i}: {call}" for i, cell in enumerate(cells(path, "code"))
               for call in optimizer_calls(source(cell)) if not re.search(r"\bfused\s*=\s*True\b", call)]
    assert not unfused, f"{path.name}: Adam or AdamW without fused=True:\n" + "\n".join(unfused)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_nbval_markers_are_cell_tags_not_comments(path):
    """nbval reads the tags nbval-ignore-output / nbval-skip; a '# NBVAL_...' comment would be noise in the reader's
    code (issue 26), so none may come back."""
    noisy = [i for i, c in enumerate(cells(path)) if c["cell_type"] == "code" and "# NBVAL_" in source(c)]
    assert not noisy, f"{path.name}: cells {noisy} carry a '# NBVAL_' comment; use the cell tag instead"


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
    chapter = [p for p in NOTEBOOKS if p.name[:2] == path.name[:2]]  # a second notebook counts with its chapter
    in_chapter = sum(1 for p in chapter for c in cells(p) if c["cell_type"] == "markdown"
                     and re.search(r"^###? Exercise \d+\.\d+", source(c), re.MULTILINE))
    assert exercises and in_chapter >= 4, "every chapter has at least four exercises"
    solutions = [c for c in all_cells if c["cell_type"] == "code" and source(c).startswith("# Solution")]
    assert len(solutions) >= len(exercises), "every exercise has a worked solution"
    for cell in solutions:
        assert "hide-cell" in cell["metadata"].get("tags", []), "solutions are hidden in the book (tag hide-cell)"
        assert cell["metadata"].get("jupyter", {}).get("source_hidden"), "solutions are collapsed in JupyterLab"
    checked = [c for p in chapter for c in cells(p)
               if c["cell_type"] == "code" and "raise NotImplementedError" in source(c)]
    assert len(checked) >= 2, "at least two exercises are auto-checked (a stub cell for the reader)"
    stub_outputs = [json.dumps(c["outputs"]) for c in all_cells if c["cell_type"] == "code"
                    and re.search(r"check_\w+\(", source(c)) and not source(c).startswith("# Sol")]
    assert any("not attempted yet" in s for s in stub_outputs), "the checker is run on the reader's stub"


EXERCISE = re.compile(r"^###? Exercise \d+\.\d+", re.MULTILINE)
HEADING = re.compile(r"^(#{1,6}) ")


def _bound_names(code):
    """Names a cell binds at module level (defs, classes, assignments, imports, loop and with targets, walrus), plus
    names its functions declare ``global``: what running the cell can (re)define in the reader's namespace."""
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return set()
    names = set()

    def targets(node):
        for sub in ast.walk(node):
            if isinstance(sub, ast.Name) and isinstance(sub.ctx, (ast.Store, ast.Del)):
                names.add(sub.id)

    def visit(stmts):
        for node in stmts:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
                for sub in ast.walk(node):
                    if isinstance(sub, (ast.Global, ast.Nonlocal)):
                        names.update(sub.names)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names.update((a.asname or a.name).split(".")[0] for a in node.names)
            elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
                for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    targets(t)
            elif isinstance(node, (ast.For, ast.AsyncFor)):
                targets(node.target)
            elif isinstance(node, (ast.With, ast.AsyncWith)):
                for item in node.items:
                    if item.optional_vars is not None:
                        targets(item.optional_vars)
            for sub in ast.walk(node) if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                                ast.ClassDef, ast.Lambda)) else ():
                if isinstance(sub, ast.NamedExpr):
                    names.add(sub.target.id)
            for field in ("body", "orelse", "finalbody", "handlers"):
                if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    visit(getattr(node, field, []) or [])
            if isinstance(node, ast.ExceptHandler) and node.name:
                names.add(node.name)

    visit(tree.body)
    return names


def exercises(all_cells):
    """(heading index, indices of the exercise's cells) for every exercise: up to the next exercise or section."""
    starts = [i for i, c in enumerate(all_cells) if c["cell_type"] == "markdown" and EXERCISE.search(source(c))]
    for k, start in enumerate(starts):
        end = starts[k + 1] if k + 1 < len(starts) else len(all_cells)
        for i in range(start + 1, end):
            if all_cells[i]["cell_type"] == "markdown" and re.match(r"^##? ", source(all_cells[i])):
                end = i
                break
        yield start, range(start + 1, end)


def test_bound_names_sees_every_way_a_cell_can_redefine_a_name():
    code = ("import math as m\nfrom x import y\ndef f():\n    global g\n    g = 1\nclass C: pass\na = b = 1\n"
            "for i in []: pass\nwith open('p') as fh: pass\nif True:\n    h = 2\n(w := 3)\nk += 1\n")
    assert _bound_names(code) == {"m", "y", "f", "g", "C", "a", "b", "i", "fh", "h", "w", "k"}
    assert _bound_names("def f():\n    local = 1\n") == {"f"}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_solutions_never_redefine_the_readers_names_and_are_collapsed_everywhere(path):
    """'Run all' must not replace the reader's function with the solution (then the checker would say ✅ for the
    reader), and every solution is collapsed, source and output: in the book (hide-cell), in JupyterLab
    (source/outputs hidden, under a collapsed '#### Solution' heading) and in Colab (that heading's section listed
    in metadata.colab.collapsed_sections). tools/sync_notebooks.py writes the metadata."""
    nb = json.loads(path.read_text(encoding="utf-8"))
    all_cells = nb["cells"]
    collapsed = nb["metadata"].get("colab", {}).get("collapsed_sections", [])
    for start, region in exercises(all_cells):
        title = source(all_cells[start]).strip().splitlines()[0]
        code = [i for i in region if all_cells[i]["cell_type"] == "code"]
        solutions = [i for i in code if source(all_cells[i]).startswith("# Solution")]
        stubs = [i for i in code if i not in solutions]
        readers = set().union(set(), *(_bound_names(source(all_cells[i])) for i in stubs))
        for i in stubs:
            for node in ast.parse(source(all_cells[i])).body:
                if isinstance(node, ast.FunctionDef):
                    assert node.name.startswith("my_"), f"{title}: the reader's function is named my_<name>"
        for i in solutions:
            clash = _bound_names(source(all_cells[i])) & readers
            assert not clash, f"{title}: the solution redefines the reader's {sorted(clash)}"
            meta = all_cells[i]["metadata"]
            assert "hide-cell" in meta.get("tags", []), f"{title}: solution not hidden in the book (hide-cell)"
            jupyter = meta.get("jupyter", {})
            assert jupyter.get("source_hidden") and jupyter.get("outputs_hidden"), \
                f"{title}: solution source and outputs must be collapsed in JupyterLab"
            first = i
            while first - 1 in solutions:
                first -= 1
            heading = all_cells[first - 1]
            assert heading["cell_type"] == "markdown" and source(heading).strip() == "#### Solution", \
                f"{title}: a '#### Solution' heading must open the solution's section (run tools/sync_notebooks.py)"
            assert heading["metadata"].get("jp-MarkdownHeadingCollapsed") is True, \
                f"{title}: the solution heading must be collapsed in JupyterLab"
            assert heading["metadata"].get("id") in collapsed, \
                f"{title}: the solution section must be listed in metadata.colab.collapsed_sections"
            assert "remove-cell" in heading["metadata"].get("tags", []), \
                f"{title}: the solution heading is for JupyterLab and Colab only (tag remove-cell)"
            after = first
            while after < len(all_cells) and (after == first or after in solutions):
                after += 1
            if after < len(all_cells):
                nxt = all_cells[after]
                level = HEADING.match(source(nxt))
                assert nxt["cell_type"] == "markdown" and level and len(level.group(1)) <= 4, \
                    f"{title}: only solution cells may sit in the collapsed section; the reader would miss cell {after}"


CAPTIONS_PENDING: set[str] = set()  # chapters whose figure captions are still to come
UNCAPTIONED_CELLS: set[tuple[str, str]] = set()  # (notebook, cell id) of image cells left without a caption
FIGURE_NAME = re.compile(r"^fig-ch(\d\d)-[a-z0-9]+(-[a-z0-9]+)*$")
FIGURE_REF = re.compile(r"\bFigure\s+(\d+)\.(\d+)\b")


def image_outputs(cell):
    return [out for out in cell.get("outputs", []) if any(key.startswith("image/") for key in out.get("data", {}))]


def plain(text):
    return " ".join(text.split())


def figure_cells(path):
    """Indices of ``path``'s code cells that show a figure (an image output), captioned ones only."""
    return [i for i, c in enumerate(cells(path)) if c["cell_type"] == "code" and image_outputs(c)
            and (path.name, c.get("id")) not in UNCAPTIONED_CELLS]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_every_figure_has_a_number_caption_name_and_alt_text(path):
    """Every code cell with an image output is a numbered figure in the book: MyST-NB reads the cell's
    ``mystnb.figure`` (caption, name) and ``mystnb.image.alt``. The markdown cell right after it repeats the caption
    for JupyterLab and Colab as ``*Figure N.k: caption*`` (tagged remove-cell, so the book shows it once), numbered in
    the order the figures appear, which is how book/_ext/chapter_figures.py numbers them in the book. The prose
    refers to every figure by its number and to no figure that does not exist."""
    if path.name[:2] in CAPTIONS_PENDING:
        pytest.skip("caption metadata pending")
    number = int(path.name[:2])
    all_cells = cells(path)
    figures = figure_cells(path)
    # a chapter's second notebook (07_training_further after 07_training) goes on counting where the first stopped
    chapter = [p for p in NOTEBOOKS if p.name[:2] == path.name[:2]]
    offset = sum(len(figure_cells(p)) for p in chapter[:chapter.index(path)])
    total = sum(len(figure_cells(p)) for p in chapter)
    names = []
    for k, i in enumerate(figures, start=offset + 1):
        where = f"{path.name}, cell {i} (Figure {number}.{k})"
        assert len(image_outputs(all_cells[i])) == 1, f"{where}: one image per cell (the caption covers every output)"
        meta = all_cells[i]["metadata"].get("mystnb", {})
        figure, alt = meta.get("figure", {}), plain(meta.get("image", {}).get("alt", ""))
        caption, name = plain(figure.get("caption", "")), figure.get("name", "")
        assert caption and "*" not in caption and not caption.startswith("Figure"), \
            f"{where}: mystnb.figure.caption must be the caption text (the book adds 'Figure {number}.{k}:')"
        match = FIGURE_NAME.match(name)
        assert match and int(match.group(1)) == number, f"{where}: mystnb.figure.name must be fig-ch{number:02d}-slug"
        names.append(name)
        assert len(alt) >= 40 and not re.search(r"[0-9a-f]{16}|\.(png|svg)$", alt), \
            f"{where}: mystnb.image.alt must describe the picture"
        shown = all_cells[i + 1] if i + 1 < len(all_cells) else {}
        assert shown.get("cell_type") == "markdown" and "remove-cell" in shown["metadata"].get("tags", []), \
            f"{where}: the next cell must be the caption for JupyterLab and Colab, tagged remove-cell"
        assert plain(source(shown)) == f"*Figure {number}.{k}: {caption}*", \
            f"{where}: the caption cell must read '*Figure {number}.{k}: ' + the metadata caption + '*'"
    assert len(set(names)) == len(names), f"{path.name}: figure names repeat"
    prose = "\n".join(source(c) for c in all_cells if c["cell_type"] == "markdown"
                      and "remove-cell" not in c["metadata"].get("tags", []))
    refs = {(int(a), int(b)) for a, b in FIGURE_REF.findall(prose)}
    missing = [f"Figure {number}.{k}" for k in range(offset + 1, offset + len(figures) + 1) if (number, k) not in refs]
    assert not missing, f"{path.name}: the prose never refers to {', '.join(missing)}"
    dangling = sorted(f"Figure {a}.{b}" for a, b in refs if a == number and not 1 <= b <= total)
    assert not dangling, f"{path.name}: the prose refers to {', '.join(dangling)}, which does not exist"
    assert not re.search(r"^\*Figure \d+\.\d+:", prose, re.MULTILINE), \
        f"{path.name}: an italic caption is left in the prose (it belongs in the remove-cell caption cell)"
