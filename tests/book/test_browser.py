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
    boxes = re.findall(r'<div class="exercise admonition" id="exercise-1-\d+"', chapter1)
    hidden = re.findall(r'<details class="solution admonition" id="solution-1-\d+"(?![^>]*\bopen\b)', chapter1)
    assert len(boxes) >= 5, "chapter 1's exercises are numbered boxes"
    assert len(hidden) >= len(boxes), "the exercise solutions must be collapsed when the page opens"


# Loads chapter 1 in a same-origin iframe, clicks a solution's title as a reader would, and writes what it saw.
PROBE = """<!doctype html><html><body><pre id="result">no result</pre>
<iframe id="page" src="/notebooks/01_language_models.html" style="width:1300px;height:900px"></iframe>
<script>
document.getElementById("page").addEventListener("load", () => {
  const doc = document.getElementById("page").contentDocument;
  const box = doc.querySelector("div.exercise");
  const dropdown = doc.querySelector("details.solution");
  const summary = dropdown.querySelector("summary");
  const code = dropdown.querySelector("div.cell_input pre");
  const shown = (el) => el.checkVisibility ? el.checkVisibility() : el.getClientRects().length > 0;
  const seen = {title: box.querySelector(".admonition-title").textContent.trim(),
                summary: summary.textContent.replace(/\\s+/g, " ").trim(),
                openBefore: dropdown.open, codeShownBefore: shown(code),
                summaryShown: shown(summary), theirButton: !!dropdown.querySelector(".toggle-button")};
  const back = summary.querySelector("a");
  seen.linksTo = doc.getElementById(back.getAttribute("href").slice(1)) === box;
  summary.click();
  seen.openAfter = dropdown.open;
  seen.codeShownAfter = shown(code);
  summary.click();
  seen.closedAgain = !dropdown.open;
  document.getElementById("result").textContent = JSON.stringify(seen);
});
</script></body></html>"""


def test_a_solution_dropdown_opens_on_click_and_links_to_its_exercise(server, extra_pages):
    import json

    extra_pages["/probe-solution.html"] = PROBE
    dom = rendered_dom(f"{server}/probe-solution.html")
    result = re.search(r'<pre id="result">([^<]*)</pre>', dom)
    assert result and result.group(1) != "no result", "the probe page did not run"
    seen = json.loads(html_lib.unescape(result.group(1)))
    assert seen["title"].startswith("Exercise 1.1: ")
    assert seen["summary"] == "Solution to Exercise 1.1" and seen["linksTo"], seen
    assert not seen["openBefore"] and not seen["codeShownBefore"] and seen["summaryShown"], \
        f"the solution must be closed, its title shown, when the page opens: {seen}"
    assert not seen["theirButton"], "sphinx-togglebutton must not add a second toggle"
    assert seen["openAfter"] and seen["codeShownAfter"], f"a click on the title must show the solution: {seen}"
    assert seen["closedAgain"], "a second click closes it"


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
