"""Read a chapter notebook's code cells in tests: a cell's parsed source, and running only some of its definitions.

The results tools (tools/chNN_results.py) repeat a few definitions that a chapter's cell shows the reader; the
tests run the cell's own definitions and compare them with the tool's.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path


def notebook_cell(notebook: Path, marker: str) -> ast.Module:
    """The parsed source of ``notebook``'s one code cell that contains ``marker``."""
    cells = json.loads(Path(notebook).read_text(encoding="utf-8"))["cells"]
    found = [c for c in cells if c["cell_type"] == "code" and marker in "".join(c["source"])]
    assert len(found) == 1, f"{len(found)} code cells of {Path(notebook).name} contain {marker!r}"
    return ast.parse("".join(found[0]["source"]))


def notebook_definitions(notebook: Path, marker: str, names: set[str], env: dict) -> dict:
    """Run only the top-level definitions ``names`` (functions and assignments) of that cell in ``env``."""
    def defines(node):
        if isinstance(node, ast.FunctionDef):
            return {node.name}
        if isinstance(node, ast.Assign):
            return {n.id for t in node.targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        return set()

    keep = [node for node in notebook_cell(notebook, marker).body if defines(node) & names]
    exec(compile(ast.Module(body=keep, type_ignores=[]), str(notebook), "exec"), env)  # noqa: S102
    return env
