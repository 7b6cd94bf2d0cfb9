"""Execute chapter notebooks top to bottom in place, the way CI re-runs them, and store their outputs.

    python tools/run_notebook.py notebooks/01_language_models.ipynb [more.ipynb ...]

Syncs the badge, setup and solution cells first (in memory), runs each notebook from a fresh kernel in
``notebooks/``, numbers the cells 1..n, sets the standard kernelspec and drops per-cell timing metadata, so the
stored outputs are what a fresh run prints. The kernel gets the environment the checked runs use
(``nbval_lanes.notebook_env``: every library that picks code for the CPU capped at a level every CPU the book runs
on has, two threads), so the stored numbers are those of every x86-64 CPU.
The file is rewritten, atomically, only when the whole run succeeded: a malformed notebook is an error naming
the file, and a failed execution leaves the file as it was.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

sys.path.insert(0, str(Path(__file__).resolve().parent))
import nbval_lanes  # noqa: E402
import sync_notebooks  # noqa: E402


class NotebookError(Exception):
    """A notebook that could not be read or executed; the message names the file."""


def run(path: Path, timeout: int = 1800) -> float:
    try:
        raw = sync_notebooks.synced_notebook(sync_notebooks.read_notebook(path), path.name,
                                             sync_notebooks.repository_url())
        nb = nbformat.reads(sync_notebooks.notebook_text(raw), as_version=4)
    except (ValueError, nbformat.reader.NotJSONError) as err:
        message = str(err)
        raise NotebookError(message if message.startswith(str(path)) else f"{path}: {message}") from None
    nb.metadata.pop("jupytext", None)
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}
    start = time.perf_counter()
    env = nbval_lanes.notebook_env()  # the kernel inherits it
    os.environ.update(env)
    for name in set(os.environ) - set(env):  # nbval_lanes.UNSET
        del os.environ[name]
    try:
        NotebookClient(nb, timeout=timeout, kernel_name="python3",
                       resources={"metadata": {"path": str(path.parent)}}, record_timing=False).execute()
    except Exception as err:  # noqa: BLE001 -- CellExecutionError, timeouts, a dead kernel: the file stays as it was
        raise NotebookError(f"{path}: execution failed, the notebook was not rewritten:\n{err}") from err
    elapsed = time.perf_counter() - start
    for cell in nb.cells:
        cell.metadata.pop("execution", None)
    nb.metadata.pop("widgets", None)
    text = nbformat.writes(nb)
    sync_notebooks.write_atomically(path, text if text.endswith("\n") else text + "\n")
    return elapsed


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    for arg in sys.argv[1:]:
        try:
            print(f"{arg}: executed in {run(Path(arg)):.0f} s")
        except NotebookError as err:
            sys.exit(f"error: {err}")
