"""Static checks on the built HTML: every chapter is there, with its links, and nothing loads from the internet."""

import re
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parents[2] / "notebooks").glob("*.ipynb"))
REMOTE = re.compile(r"""<(script|img|link|iframe)\b[^>]*\b(src|href)=["'](https?:)?//""", re.IGNORECASE)


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.stem)
def test_chapter_page_has_badge_and_download(html_root, nb):
    page = html_root / "notebooks" / f"{nb.stem}.html"
    assert page.exists(), f"{nb.name} has no page in the built book"
    html = page.read_text(encoding="utf-8")
    assert re.search(rf'href="https://colab\.research\.google\.com/github/[^"]+/{nb.name}"', html), "no Colab link"
    assert re.search(rf'href="[^"]+/raw/main/notebooks/{nb.name}"', html), "no download link"
    assert "_sources/notebooks/" + nb.name in html, "the theme's download button for the .ipynb is missing"
    assert "# Setup: on Colab" not in html, "the Colab-only setup cell must not show in the book"


def test_no_page_loads_anything_from_the_internet(html_root):
    pages = list(html_root.rglob("*.html"))
    assert len(pages) > 5
    for page in pages:
        match = REMOTE.search(page.read_text(encoding="utf-8"))
        assert not match, f"{page.relative_to(html_root)} loads a remote resource: {match.group(0)}"


def test_mathjax_is_served_locally(html_root):
    html = (html_root / "notebooks" / "01_language_models.html").read_text(encoding="utf-8")
    assert re.search(r'src="\.\./_static/mathjax/tex-chtml\.js', html)
    assert (html_root / "_static" / "mathjax" / "tex-chtml.js").stat().st_size > 100_000
    assert (html_root / "_static" / "mathjax" / "output" / "chtml" / "fonts" / "woff-v2").is_dir()


def test_front_matter_pages_exist(html_root):
    for page in ("preface", "setup", "notation", "references"):
        assert (html_root / "book" / f"{page}.html").exists(), f"book/{page} is missing"
    references = (html_root / "book" / "references.html").read_text(encoding="utf-8")
    assert "attention is all you need" in references.lower() and "{bibliography}" not in references


CAPTIONS_PENDING: set[str] = set()  # caption metadata pending (as in tests/test_notebooks.py)
UNCAPTIONED_CELLS: set[tuple[str, str]] = set()  # (notebook, cell id) of image cells left without a caption


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.stem)
def test_figures_are_numbered_per_chapter_with_caption_and_alt_text(html_root, nb):
    """Every image output of a chapter is a figure numbered 'Figure N.k:' in page order (book/_ext/chapter_figures.py),
    with the notebook's caption and alt text; the JupyterLab copy of the caption (remove-cell) is not shown."""
    if nb.name[:2] in CAPTIONS_PENDING:
        pytest.skip("caption metadata pending")
    import html as html_lib
    import json

    number = int(nb.name[:2])
    cells = json.loads(nb.read_text(encoding="utf-8"))["cells"]
    metas = [c["metadata"]["mystnb"] for c in cells if c["cell_type"] == "code"
             and any(k.startswith("image/") for out in c["outputs"] for k in out.get("data", {}))
             and (nb.name, c.get("id")) not in UNCAPTIONED_CELLS]
    page = (html_root / "notebooks" / f"{nb.stem}.html").read_text(encoding="utf-8")
    figures = re.findall(r'<figure class="[^"]*" id="([^"]+)">\s*(?:<a [^>]*>)?<img alt="([^"]*)".*?'
                         r'<span class="caption-number">([^<]*)</span>', page, re.DOTALL)
    assert page.count("<figcaption") == len(figures) == len(metas) > 0
    # a chapter's second notebook (07_training_further) goes on counting where the first stopped
    earlier = [p for p in NOTEBOOKS if p.name[:2] == nb.name[:2] and p.name < nb.name]
    offset = sum(1 for p in earlier for c in json.loads(p.read_text(encoding="utf-8"))["cells"]
                 if c["cell_type"] == "code"
                 and any(k.startswith("image/") for out in c["outputs"] for k in out.get("data", {}))
                 and (p.name, c.get("id")) not in UNCAPTIONED_CELLS)
    for k, ((fig_id, alt, label), meta) in enumerate(zip(figures, metas), start=offset + 1):
        assert label.strip() == f"Figure {number}.{k}:"
        assert fig_id == meta["figure"]["name"]
        assert html_lib.unescape(alt) == meta["image"]["alt"]
    assert f"*Figure {number}.{offset + 1}:" not in page and f"<em>Figure {number}.{offset + 1}:" not in page


EXERCISE = re.compile(r"^###? (Exercise (\d+)\.(\d+)\b.*)$", re.MULTILINE)


def notebook_exercises(nb):
    """The exercise headings (matches of EXERCISE) of a notebook's markdown cells, and its solution cells' sources."""
    import json

    cells = json.loads(nb.read_text(encoding="utf-8"))["cells"]
    sources = [(c["cell_type"], "".join(c["source"])) for c in cells]
    headings = [m for kind, text in sources if kind == "markdown" for m in EXERCISE.finditer(text)]
    solutions = [text for kind, text in sources if kind == "code" and text.startswith("# Solution")]
    return headings, solutions


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.stem)
def test_exercises_are_numbered_boxes_and_solutions_closed_dropdowns_linked_to_them(html_root, nb):
    """book/_ext/exercise_boxes.py: one sphinx-exercise box per "### Exercise N.M" heading of the notebook, titled
    "Exercise N.M: title" with the notebook's own number; every solution cell inside a closed <details> "Solution to
    Exercise N.M" that follows its box and links to it (and the box links to it); none left behind MyST-NB's
    "Show code cell content" toggle."""
    from bs4 import BeautifulSoup

    headings, solutions = notebook_exercises(nb)
    page = BeautifulSoup((html_root / "notebooks" / f"{nb.stem}.html").read_text(encoding="utf-8"), "html.parser")
    article = page.select_one("article")
    boxes = article.select("div.exercise.admonition")
    # a chapter's second notebook (07_training_further) counts with its chapter: at least four exercises in all
    in_chapter = sum(len(notebook_exercises(p)[0]) for p in NOTEBOOKS if p.name[:2] == nb.name[:2])
    assert len(boxes) == len(headings) >= 1 and in_chapter >= 4, \
        f"{len(boxes)} exercise boxes for {len(headings)} exercise headings ({in_chapter} in the chapter)"
    for box, heading in zip(boxes, headings):
        chapter, k = heading.group(2), heading.group(3)
        assert chapter == str(int(nb.name[:2])), f"{heading.group(1)!r} is in chapter {nb.name[:2]}"
        assert box["id"] == f"exercise-{chapter}-{k}"
        title = box.find("p", class_="admonition-title", recursive=False)
        assert title is not None and title.get_text().startswith(f"Exercise {chapter}.{k}: "), title

    dropdowns = article.select("details.solution")
    owners = []
    for dropdown in dropdowns:
        assert not dropdown.has_attr("open"), f"{dropdown['id']} must be closed when the page opens"
        summary = dropdown.find("summary", recursive=False)
        link = summary.find("a") if summary else None
        box = article.find(id=link["href"].removeprefix("#")) if link else None
        assert box in boxes, f"{dropdown['id']}: its title links to no exercise box"
        number = box["id"].removeprefix("exercise-").replace("-", ".")
        assert " ".join(summary.get_text().split()) == f"Solution to Exercise {number}"
        assert box.find_next("details", class_="solution") is dropdown or box in owners, \
            f"{dropdown['id']} does not follow its exercise"
        owners.append(box)
    assert [box["id"] for box in boxes] == list(dict.fromkeys(box["id"] for box in owners)), \
        "every exercise, in order, has its solution dropdown"
    for box in boxes:
        link = box.select_one("p.admonition-title a.exercise-solution-link")
        target = article.find(id=link["href"].removeprefix("#")) if link else None
        assert target in dropdowns and target.find_previous("div", class_="exercise") is box, \
            f"{box['id']}: the box's title does not link to its solution"

    code = {pre.get_text().strip(): pre for pre in article.select("div.cell_input pre")}
    for source in solutions:
        pre = code.get(source.strip())
        assert pre is not None, f"solution cell {source.splitlines()[1:2]} is not shown"
        assert pre.find_parent("details", class_="solution"), \
            f"solution cell {source.splitlines()[1:2]} is not inside a solution dropdown"
    assert "Show code cell content" not in article.get_text(), "a solution still hides behind MyST-NB's toggle"
