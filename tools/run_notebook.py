"""Execute chapter notebooks top to bottom in place, the way CI re-runs them, and store their outputs.

    python tools/run_notebook.py notebooks/01_language_models.ipynb [more.ipynb ...]

Syncs the badge and setup cells first, runs each notebook from a fresh kernel in ``notebooks/``, numbers
the cells 1..n, sets the standard kernelspec and drops per-cell timing metadata, so the stored outputs are
what a fresh run prints.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

sys.path.insert(0, str(Path(__file__).resolve().parent))
import sync_notebooks  # noqa: E402


def run(path: Path, timeout: int = 900) -> float:
    sync_notebooks.main([str(path)])
    nb = nbformat.read(path, as_version=4)
    nb.metadata.pop("jupytext", None)
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}
    start = time.perf_counter()
    NotebookClient(nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}},
                   record_timing=False).execute()
    elapsed = time.perf_counter() - start
    for cell in nb.cells:
        cell.metadata.pop("execution", None)
    nb.metadata.pop("widgets", None)
    nbformat.write(nb, path)
    return elapsed


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    for arg in sys.argv[1:]:
        print(f"{arg}: executed in {run(Path(arg)):.0f} s")
