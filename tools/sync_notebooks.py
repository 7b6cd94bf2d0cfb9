"""Write the Colab badge, the Colab-only setup cell and the collapsed solutions into every chapter notebook.

The repository's address lives in one place, ``[project.urls] Repository`` in pyproject.toml. Every
notebook's first cell is its title followed by the badge line written here; its second cell is the setup
cell written here. ``--check`` changes nothing and exits with status 1 when a notebook is out of sync
(tests/test_notebooks.py runs it).

Exercise solutions (code cells whose source starts with ``# Solution``) are collapsed in all three places a
reader meets them:

- the book: the cell carries the ``hide-cell`` tag (a toggle hides source and output);
- JupyterLab: the cell has ``jupyter.source_hidden`` and ``jupyter.outputs_hidden``, and sits under a
  ``#### Solution`` heading cell whose ``jp-MarkdownHeadingCollapsed`` metadata folds it away;
- Colab: Colab ignores the ``jupyter`` metadata, and its ``cellView: "form"`` hides only the code of a cell whose
  first line is ``#@title`` (the output stays in view). What hides both is a collapsed section: the notebook's
  ``metadata.colab.collapsed_sections`` lists the ids (``metadata.id``) of the ``#### Solution`` heading cells.

The heading cell is tagged ``remove-cell``, so the book (which has its own toggle) does not show it. A malformed
notebook is reported with its file name, and notebooks are written atomically.

Figure code is folded in the book: a code cell that draws a figure (an image among its outputs) and is mostly
plotting calls (at least ``FIGURE_LINES`` lines that use ``plt``, ``fig`` or an ``ax``, and at least half of its
code lines) gets the ``hide-input`` tag. The book then shows the figure with a "Show code cell source" toggle
above it; JupyterLab and Colab show the code as it is, since a reader running the notebook wants to see it.

    python tools/sync_notebooks.py            # rewrite the notebooks in place
    python tools/sync_notebooks.py --check    # only report
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
import tomllib
from pathlib import Path

from groundup.utils import atomic_write_text

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"


def repository_url() -> str:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]["urls"]["Repository"].rstrip("/")


def badge_line(nb_name: str, repo: str) -> str:
    slug = repo.removeprefix("https://github.com/")
    colab = f"https://colab.research.google.com/github/{slug}/blob/main/notebooks/{nb_name}"
    download = f"{repo}/raw/main/notebooks/{nb_name}"
    return f"[Open in Colab]({colab}) · [Download this notebook]({download})"


def setup_source(repo: str) -> str:
    """The Colab-only setup cell. The book cuts code lines wider than 88 characters, so the pip requirement
    ``groundup @ git+<repo>`` is written as two adjacent string literals split after the host
    (``https://github.com/`` + ``owner/name``): every line fits for an ``owner/name`` of up to 52 characters."""
    scheme, sep, rest = repo.partition("://")
    host, slash, path = rest.partition("/")
    head, tail = (f"{scheme}{sep}{host}{slash}", path) if sep and slash else (repo, "")
    indent = " " * 20
    requirement = f'"groundup @ git+{head}"' + (f'\n{indent}"{tail}"' if tail else "")
    return (
        "# Setup: on Colab this installs the book's package, groundup;\n"
        "# on your own machine it does nothing.\n"
        "import subprocess\n"
        "import sys\n"
        "\n"
        'if "google.colab" in sys.modules:\n'
        '    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet",\n'
        f"{indent}{requirement}], check=True)"
    )


def _text(cell) -> str:
    src = cell.get("source", "")
    return "".join(src) if isinstance(src, list) else src


def synced(nb: dict, nb_name: str, repo: str) -> dict:
    """Return a copy of ``nb`` with the badge and setup cells as they must be; raise ValueError if malformed."""
    cells = nb.get("cells", [])
    if not cells or cells[0].get("cell_type") != "markdown" or not _text(cells[0]).startswith("# "):
        raise ValueError(f"{nb_name}: the first cell must be markdown starting with the '# N. Title' heading")
    lines = _text(cells[0]).split("\n")
    title, rest = lines[0], lines[1:]
    rest = [line for line in rest if not line.startswith("[Open in Colab]")]
    while rest and not rest[0].strip():
        rest.pop(0)
    first = "\n".join([title, "", badge_line(nb_name, repo)] + ([""] + rest if rest else []))
    new = json.loads(json.dumps(nb))
    new["cells"][0]["source"] = first
    setup = {
        "cell_type": "code",
        "execution_count": None,
        "metadata": {"tags": ["remove-cell"]},
        "outputs": [],
        "source": setup_source(repo),
    }
    if len(cells) > 1 and _text(cells[1]).startswith("# Setup: on Colab"):
        setup["execution_count"] = cells[1].get("execution_count")
        setup["id"] = cells[1].get("id", "setup")
        new["cells"][1] = setup
    else:
        setup["id"] = "setup"
        new["cells"].insert(1, setup)
    return new


SOLUTION_PREFIX = "# Solution"
SOLUTION_HEADING = "#### Solution"


def is_solution(cell: dict) -> bool:
    return cell.get("cell_type") == "code" and _text(cell).startswith(SOLUTION_PREFIX)


def is_solution_heading(cell: dict) -> bool:
    return cell.get("cell_type") == "markdown" and _text(cell).strip() == SOLUTION_HEADING


def _heading_id(solution: dict, index: int) -> str:
    seed = solution.get("id") or f"{index}:{_text(solution)}"
    return "solution-" + hashlib.sha1(str(seed).encode()).hexdigest()[:8]


def hide_solutions(nb: dict) -> dict:
    """Return a copy of ``nb`` whose solution cells are collapsed in the book, JupyterLab and Colab."""
    new = json.loads(json.dumps(nb))
    cells, out, collapsed = new.get("cells", []), [], []
    for i, cell in enumerate(cells):
        if is_solution_heading(cell):
            continue  # rebuilt below, in front of the solution it belongs to
        if is_solution(cell) and not (out and is_solution(out[-1])):
            previous = cells[i - 1] if i > 0 and is_solution_heading(cells[i - 1]) else None
            heading_id = (previous or {}).get("metadata", {}).get("id") or _heading_id(cell, i)
            heading = {"cell_type": "markdown", "id": (previous or {}).get("id", heading_id),
                       "metadata": {"id": heading_id, "jp-MarkdownHeadingCollapsed": True, "tags": ["remove-cell"]},
                       "source": SOLUTION_HEADING}
            out.append(heading)
            collapsed.append(heading_id)
        if is_solution(cell):
            meta = cell.setdefault("metadata", {})
            tags = meta.setdefault("tags", [])
            if "hide-cell" not in tags:
                tags.append("hide-cell")
            meta.setdefault("jupyter", {}).update({"source_hidden": True, "outputs_hidden": True})
        out.append(cell)
    new["cells"] = out
    colab = new.setdefault("metadata", {}).setdefault("colab", {})
    colab["collapsed_sections"] = collapsed
    if not collapsed:
        del colab["collapsed_sections"]
        if not colab:
            del new["metadata"]["colab"]
    return new


FIGURE_LINES = 8
_PLOTTING = re.compile(r"\b(plt|fig|figure|axs?|axes|ax\d*|ax_\w+|\w+_ax)\b\s*[.\[,=]")


def is_figure_code(cell: dict) -> bool:
    """A code cell that draws a figure and is mostly plotting calls (see the module docstring)."""
    if cell.get("cell_type") != "code" or is_solution(cell):
        return False
    if not any("image/png" in o.get("data", {}) or "image/svg+xml" in o.get("data", {})
               for o in cell.get("outputs", [])):
        return False
    lines = [line for line in _text(cell).split("\n") if line.strip() and not line.lstrip().startswith("#")]
    plotting = sum(1 for line in lines if _PLOTTING.search(line))
    return plotting >= FIGURE_LINES and 2 * plotting >= len(lines)


def hide_figure_code(nb: dict) -> dict:
    """Return a copy of ``nb`` whose figure-drawing cells carry the ``hide-input`` tag (the book folds them)."""
    new = json.loads(json.dumps(nb))
    for cell in new.get("cells", []):
        if is_figure_code(cell):
            tags = cell.setdefault("metadata", {}).setdefault("tags", [])
            if "hide-input" not in tags:
                tags.append("hide-input")
    return new


def read_notebook(path: Path) -> dict:
    """The notebook at ``path`` as a dict; a ``ValueError`` naming the file if it is not a readable notebook."""
    try:
        nb = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: not a readable notebook ({err})") from None
    if not isinstance(nb, dict) or not isinstance(nb.get("cells"), list) \
            or not all(isinstance(c, dict) and "cell_type" in c for c in nb["cells"]):
        raise ValueError(f"{path}: not a notebook (expected a JSON object with a list of cells)")
    return nb


def write_atomically(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file in the same folder: never half a notebook."""
    atomic_write_text(path, text)


def notebook_text(nb: dict) -> str:
    """The notebook as the repository stores it, the layout nbformat writes (tools/run_notebook.py): sorted keys,
    indent 1, and each cell's source as a list of lines, so that a sync changes only the lines it must."""
    out = json.loads(json.dumps(nb))
    for cell in out.get("cells", []):
        if isinstance(cell.get("source"), str):
            cell["source"] = cell["source"].splitlines(keepends=True)
    return json.dumps(out, sort_keys=True, indent=1, ensure_ascii=False) + "\n"


def synced_notebook(nb: dict, nb_name: str, repo: str) -> dict:
    """The badge, the setup cell, the collapsed solutions and the folded figure code, as they must be."""
    return hide_figure_code(hide_solutions(synced(nb, nb_name, repo)))


def _normalise(nb: dict) -> dict:
    """Cell sources as plain strings, so lists-of-lines and strings compare equal."""
    out = json.loads(json.dumps(nb))
    for c in out.get("cells", []):
        c["source"] = _text(c)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="report notebooks out of sync, change nothing")
    parser.add_argument("paths", nargs="*", type=Path, help="notebooks (default: notebooks/*.ipynb)")
    args = parser.parse_args(argv)
    repo = repository_url()
    stale, broken = [], []
    for path in args.paths or sorted(NOTEBOOKS.glob("*.ipynb")):
        try:
            nb = read_notebook(path)
            new = synced_notebook(nb, path.name, repo)
        except ValueError as err:
            message = str(err)
            broken.append(message if message.startswith(str(path)) else f"{path}: {message}")
            continue
        if _normalise(new) == _normalise(nb):
            continue
        stale.append(path.name)
        if not args.check:
            write_atomically(path, notebook_text(new))
    for message in broken:
        print(f"error: {message}", file=sys.stderr)
    if broken:
        return 2
    if stale:
        verb = "out of sync (run `python tools/sync_notebooks.py`)" if args.check else "updated"
        print(f"{verb}: {', '.join(stale)}")
    return 1 if (stale and args.check) else 0


if __name__ == "__main__":
    sys.exit(main())
