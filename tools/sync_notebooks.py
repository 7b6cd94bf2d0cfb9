"""Write the Colab badge and the Colab-only setup cell into every chapter notebook.

The repository's address lives in one place, ``[project.urls] Repository`` in pyproject.toml. Every
notebook's first cell is its title followed by the badge line written here; its second cell is the setup
cell written here. ``--check`` changes nothing and exits with status 1 when a notebook is out of sync
(tests/test_notebooks_sync.py runs it).

    python tools/sync_notebooks.py            # rewrite the notebooks in place
    python tools/sync_notebooks.py --check    # only report
"""

from __future__ import annotations

import argparse
import json
import sys
import tomllib
from pathlib import Path

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
    return (
        "# Setup: on Colab this installs the book's package, groundup; on your own machine it does nothing.\n"
        "import subprocess\n"
        "import sys\n"
        "\n"
        'if "google.colab" in sys.modules:\n'
        '    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet",\n'
        f'                    "groundup @ git+{repo}"], check=True)'
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
    stale = []
    for path in args.paths or sorted(NOTEBOOKS.glob("*.ipynb")):
        nb = json.loads(path.read_text(encoding="utf-8"))
        new = synced(nb, path.name, repo)
        if _normalise(new) == _normalise(nb):
            continue
        stale.append(path.name)
        if not args.check:
            path.write_text(json.dumps(new, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    if stale:
        verb = "out of sync (run `python tools/sync_notebooks.py`)" if args.check else "updated"
        print(f"{verb}: {', '.join(stale)}")
    return 1 if (stale and args.check) else 0


if __name__ == "__main__":
    sys.exit(main())
