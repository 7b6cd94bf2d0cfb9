"""Build the book's static HTML with jupyter-book 1.x from the stored notebook outputs, offline.

    python tools/build_book.py        (what `make book` runs)

1. Vendors MathJax 3 from the ``django-static-mathjax`` wheel into ``book/_vendor/mathjax`` (not committed),
   so math renders without a CDN.
2. Builds into a temporary folder under ``_build/`` and only on success moves the HTML to ``_build/html``:
   a failed build never leaves a half-written book behind.
3. Prints the path of ``index.html``.
"""

from __future__ import annotations

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


def vendor_mathjax() -> None:
    source = Path(mathjax.__file__).parent / "static" / "mathjax" / "es5"
    if (VENDOR / "tex-chtml.js").exists():
        return
    tmp = VENDOR.with_name("mathjax.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for part in MATHJAX_PARTS:
        src = source / part
        if src.is_dir():
            shutil.copytree(src, tmp / part)
        else:
            shutil.copy2(src, tmp / part)
    tmp.rename(VENDOR)


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
        old = BUILD / ".html-old"
        shutil.rmtree(old, ignore_errors=True)
        if html.exists():
            html.rename(old)
        (Path(tmp) / "_build" / "html").rename(html)
        shutil.rmtree(old, ignore_errors=True)
    return html / "index.html"


if __name__ == "__main__":
    index = build()
    print(f"The book is built: {index}")
