"""A real browser looks at the book: headless Chromium renders chapter 1 from a local server.

Skipped, with instructions, where Chromium is not installed (`apt-get install chromium`; .ci/run does it).
"""

import html as html_lib
import re
import shutil
import subprocess
import tempfile
import urllib.request
from pathlib import Path

import pytest

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
pytestmark = pytest.mark.skipif(
    CHROMIUM is None,
    reason="Chromium not found: to run the browser check, install Debian's chromium package (apt-get install chromium)",
)
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-extensions",
         "--virtual-time-budget=20000", "--run-all-compositor-stages-before-draw"]


def rendered_dom(url: str) -> str:
    with tempfile.TemporaryDirectory() as profile:
        result = subprocess.run([CHROMIUM, *FLAGS, f"--user-data-dir={profile}", "--dump-dom", url],
                                capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


def visible_text(dom: str) -> str:
    dom = re.sub(r"<(script|style)\b.*?</\1>", " ", dom, flags=re.DOTALL | re.IGNORECASE)
    dom = re.sub(r"<mjx-container\b.*?</mjx-container>", " ", dom, flags=re.DOTALL)
    return html_lib.unescape(re.sub(r"<[^>]+>", " ", dom))


@pytest.fixture(scope="module")
def chapter1(server):
    return rendered_dom(f"{server}/notebooks/01_language_models.html")


def test_math_is_typeset(chapter1):
    typeset = chapter1.count("<mjx-container")
    assert typeset >= 20, f"MathJax typeset only {typeset} formulas: is the vendored MathJax served?"
    assert "<mjx-merror" not in chapter1, "MathJax reports a TeX error on the page"
    text = visible_text(chapter1)
    assert "\\tag{" not in text and "\\mathcal" not in text, "raw TeX is visible: the math was not typeset"


def test_figure_is_present_and_loads(chapter1, server):
    images = re.findall(r'<img[^>]+src="([^"]*_images/[^"]+\.png)"', chapter1)
    assert len(images) >= 2, "chapter 1 shows two figures"
    src = images[0].replace("../", "")
    with urllib.request.urlopen(f"{server}/{src}") as response:
        assert response.read(8) == b"\x89PNG\r\n\x1a\n"


def test_no_myst_syntax_leaks_as_text(chapter1):
    text = visible_text(chapter1)
    for raw in ("```{", "{cite}", "{bibliography}", ":::", "{toggle}", "{exercise}", "{solution}"):
        assert raw not in text, f"MyST syntax {raw!r} shows as text on the page"


def test_solutions_are_hidden_until_clicked(chapter1):
    hidden = re.findall(r'<details class="[^"]*hide[^"]*"(?![^>]*\bopen\b)', chapter1)
    assert len(hidden) >= 5, "the exercise solutions must be collapsed when the page opens"


NOTEBOOKS = sorted((Path(__file__).resolve().parents[2] / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("nb", NOTEBOOKS[1:], ids=lambda p: p.stem)
def test_every_other_chapter_renders(server, nb):
    dom = rendered_dom(f"{server}/notebooks/{nb.stem}.html")
    assert dom.count("<mjx-container") >= 5, "the math was not typeset"
    assert "<mjx-merror" not in dom, "MathJax reports a TeX error on the page"
    assert re.search(r'<img[^>]+src="[^"]*_images/[^"]+\.png"', dom), "every chapter shows at least one figure"
    text = visible_text(dom)
    for raw in ("```{", "{cite}", ":::", "\\tag{"):
        assert raw not in text, f"{raw!r} shows as text on the page"
