"""A chapter's stored results (``src/groundup/results/chapterNN.json``): add one entry, safely.

The ``tools/chNN_results.py`` commands each run one experiment and add its entry here. Several may run at once
(one per seed, say), so the read-modify-write holds a lock on the folder, and the file is replaced atomically: a
reader (or a crash) sees the old file or the new one, never half of one.
"""

from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path

from groundup.utils import atomic_write_text


def add_entry(path: Path, key: str, entry, *, section: str | None = "runs", header: dict | None = None) -> None:
    """Store ``entry`` under ``key`` in the JSON file ``path`` (created if missing), keeping the other entries.

    With ``section`` the entries live in ``results[section]`` (sorted by key); with ``section=None`` at the top
    level (all keys sorted). ``header`` (e.g. ``{"about": ..., "setup": ...}``) sets top-level keys first.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path.parent, os.O_RDONLY)  # lock the folder, so no lock file is left behind
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        results = json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
        results.update(header or {})
        if section is None:
            results[key] = entry
            results = dict(sorted(results.items()))
        else:
            results.setdefault(section, {})[key] = entry
            results[section] = dict(sorted(results[section].items()))
        atomic_write_text(path, json.dumps(results, indent=1, ensure_ascii=False) + "\n")
    finally:
        os.close(fd)
