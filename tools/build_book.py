"""Build the book's static HTML with jupyter-book 1.x from the stored notebook outputs, offline.

    python tools/build_book.py        (what `make book` runs)

1. Vendors MathJax 3 from the ``django-static-mathjax`` wheel into ``book/_vendor/mathjax`` (not committed),
   so math renders without a CDN. A stamp file records the MathJax version and the parts copied; a folder
   without it, from another version, or missing a part is stale and is replaced as a whole (copied to a
   temporary folder, then swapped in), never patched in place.
2. Builds into a temporary folder under ``_build/`` and only on success swaps it in as ``_build/html``:
   a failed build never leaves a half-written book behind, and on Linux the swap is one atomic
   ``renameat2(RENAME_EXCHANGE)``, so ``_build/html`` is always either the whole old book or the whole new one
   (elsewhere: two renames, rolled back if the second fails).
3. Prints the path of ``index.html``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import mathjax

ROOT = Path(__file__).resolve().parents[1]
VENDOR = ROOT / "book" / "_vendor" / "mathjax"
BUILD = ROOT / "_build"
# What tex-chtml.js loads at run time: the input and output jax, fonts, the menu and its accessibility parts.
MATHJAX_PARTS = ["tex-chtml.js", "input", "output", "ui", "a11y", "sre", "adaptors"]


STAMP = ".groundup-vendored.json"


def _stamp() -> dict:
    return {"mathjax": getattr(mathjax, "__version__", None) or _package_version(), "parts": MATHJAX_PARTS}


def _package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    for name in ("django-static-mathjax", "mathjax"):
        try:
            return version(name)
        except PackageNotFoundError:
            continue
    return "unknown"


def _is_current(folder: Path) -> bool:
    try:
        stamp = json.loads((folder / STAMP).read_text())
    except (OSError, ValueError):
        return False
    return stamp == _stamp() and all((folder / part).exists() for part in MATHJAX_PARTS)


def swap_into_place(new: Path, target: Path) -> None:
    """Put the folder ``new`` at ``target`` (replacing what was there) and delete the old one.

    On Linux the two are exchanged in one atomic ``renameat2(RENAME_EXCHANGE)``; elsewhere ``target`` is moved
    aside, ``new`` moved in, and the old folder put back if that second move fails.
    """
    if target.exists() and _exchange(new, target):
        shutil.rmtree(new, ignore_errors=True)  # ``new`` now holds the old folder
        return
    old = target.with_name(f".{target.name}-old")
    shutil.rmtree(old, ignore_errors=True)
    if target.exists():
        target.rename(old)
    try:
        new.rename(target)
    except BaseException:
        if old.exists() and not target.exists():
            old.rename(target)
        raise
    shutil.rmtree(old, ignore_errors=True)


def _exchange(a: Path, b: Path) -> bool:
    """Atomically exchange two paths with Linux's renameat2; False where that is not available."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    return renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


def vendor_mathjax() -> None:
    if _is_current(VENDOR):
        return
    source = Path(mathjax.__file__).parent / "static" / "mathjax" / "es5"
    tmp = VENDOR.with_name("mathjax.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        for part in MATHJAX_PARTS:
            src = source / part
            if src.is_dir():
                shutil.copytree(src, tmp / part)
            else:
                shutil.copy2(src, tmp / part)
        (tmp / STAMP).write_text(json.dumps(_stamp()))
        swap_into_place(tmp, VENDOR)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def build() -> Path:
    vendor_mathjax()
    BUILD.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(dir=BUILD, prefix=".building-") as tmp:
        cmd = [str(Path(sys.executable).parent / "jupyter-book"), "build", str(ROOT),
               "--config", str(ROOT / "book/_config.yml"), "--toc", str(ROOT / "book/_toc.yml"),
               "--path-output", tmp, "--warningiserror", "--keep-going"]
        result = subprocess.run(cmd, cwd=ROOT)
        if result.returncode != 0:
            sys.exit(f"book build failed (exit {result.returncode}); the previous _build/html is untouched")
        html = BUILD / "html"
        swap_into_place(Path(tmp) / "_build" / "html", html)
    return html / "index.html"


if __name__ == "__main__":
    index = build()
    print(f"The book is built: {index}")
