"""book/_ext/exercise_boxes.py: exercise sections become sphinx-exercise boxes, solution cells linked dropdowns.

The pure parts are checked on hand-made docutils trees; one small Sphinx build (MyST-NB + sphinx-exercise + the
extension, a two-exercise notebook, a few seconds) checks what the reader gets in HTML. tests/book checks the book.
"""

import importlib.util
import io
import json
from pathlib import Path

import pytest
from bs4 import BeautifulSoup
from docutils import nodes

ROOT = Path(__file__).resolve().parents[1]
EXT = ROOT / "book" / "_ext"
spec = importlib.util.spec_from_file_location("exercise_boxes", EXT / "exercise_boxes.py")
boxes = importlib.util.module_from_spec(spec)
spec.loader.exec_module(boxes)

SOLUTION = "# Solution (hidden in the book until clicked)\n"


def cell(source: str) -> nodes.container:
    """A code cell as MyST-NB builds it: a cell_code container around a cell_code_source container."""
    code = nodes.container("", nodes.literal_block(source, source), nb_element="cell_code_source")
    return nodes.container("", code, nb_element="cell_code")


@pytest.mark.parametrize("title, expected", [
    ("Exercise 5.1: attention from scratch", (5, 1)),
    ("Exercise 12.10: split `c_attn`", (12, 10)),
    ("  Exercise 3.2", (3, 2)),
    ("Exercise 6.6 where the seeds put it", (6, 6)),
    ("Exercises", None),
    ("Exercise 5: no number", None),
    ("Exercise 5.1x", None),
    ("Exercise 5.", None),
    ("More on Exercise 5.1", None),
])
def test_exercise_number_reads_the_notebooks_own_number(title, expected):
    assert boxes.exercise_number(title) == expected


def test_solution_cells_are_code_cells_whose_source_starts_with_the_marker():
    assert boxes.is_solution_cell(cell(SOLUTION + "x = 1"))
    assert boxes.is_solution_cell(cell("# Solution: another wording\nx = 1"))
    assert not boxes.is_solution_cell(cell("def my_f():\n    raise NotImplementedError"))
    assert not boxes.is_solution_cell(cell("x = 1  # Solution"))
    assert not boxes.is_solution_cell(nodes.paragraph("", SOLUTION))
    assert not boxes.is_solution_cell(nodes.container("", nb_element="cell_code"))  # source removed (remove-input)
    markdown_like = nodes.container("", nodes.literal_block(SOLUTION, SOLUTION))
    assert not boxes.is_solution_cell(markdown_like)


def test_solution_runs_group_cells_that_follow_each_other_even_in_a_subsection():
    first, second, third = cell(SOLUTION + "a = 1"), cell(SOLUTION + "b = 2"), cell(SOLUTION + "c = 3")
    stub = cell("def my_f():\n    raise NotImplementedError")
    hint = nodes.section("", nodes.title("", "Hint"), nodes.paragraph("", "look"), third)
    section = nodes.section("", nodes.title("", "Exercise 1.1: f"), nodes.paragraph("", "task"), stub, first,
                            second, nodes.paragraph("", "after"), hint)
    assert boxes.solution_runs(section) == [[first, second], [third]]
    section.remove(second)
    section.insert(section.index(first) + 1, nodes.paragraph("", "between"))
    section.insert(section.index(first) + 2, second)
    assert boxes.solution_runs(section) == [[first], [second], [third]]


def test_split_at_first_stops_at_the_first_node_that_is_or_holds_a_match():
    task, stub = nodes.paragraph("", "task"), cell("x = 1")
    holder = nodes.section("", nodes.title("", "Hint"), nodes.strong("", "here"))
    children = [task, stub, holder, nodes.paragraph("", "after")]
    assert boxes.split_at_first(children, lambda n: isinstance(n, nodes.strong)) == (children[:2], children[2:])
    assert boxes.split_at_first(children, lambda n: n is stub) == (children[:1], children[1:])
    assert boxes.split_at_first(children, lambda n: isinstance(n, nodes.image)) == (children, [])


def test_labels():
    assert boxes.exercise_label((5, 1)) == "exercise-5-1"
    assert boxes.solution_label((5, 1), 0) == "solution-5-1"
    assert boxes.solution_label((5, 1), 1) == "solution-5-1-2"


def markdown(text, **metadata):
    return {"cell_type": "markdown", "metadata": metadata, "source": text}


def code(text, output=None, **metadata):
    outputs = [{"name": "stdout", "output_type": "stream", "text": output}] if output else []
    return {"cell_type": "code", "execution_count": 1, "metadata": metadata, "outputs": outputs, "source": text}


HIDDEN = {"tags": ["hide-cell"], "jupyter": {"source_hidden": True, "outputs_hidden": True}}
NOTEBOOK = [
    markdown("# 3. A chapter\n\nText.\n\n## Exercises\n\n### Exercise 3.1: the `RMS` of a row\n\nWrite `my_rms`."),
    code("def my_rms(x):\n    raise NotImplementedError"),
    code("check_rms(my_rms)", "not attempted yet\n"),
    markdown("#### Solution", tags=["remove-cell"]),
    code(SOLUTION + "def rms_solution(x):\n    return x", "correct\n", **HIDDEN),
    markdown("### Exercise 3.2: two parts\n\nThink."),
    markdown("#### Solution", tags=["remove-cell"]),
    code(SOLUTION + "first_part = 1", **HIDDEN),
    code(SOLUTION + "second_part = 2", **HIDDEN),
    markdown("A remark after the solution."),
    markdown("### Exercise 3.3: no solution here\n\nOpen question."),
    markdown("## Summary\n\nThe end."),
]


def build(src, cells, warning=None):
    """Build a one-page book (a notebook of ``cells``) with MyST-NB, sphinx-exercise and the extension: its HTML."""
    from sphinx.application import Sphinx
    from sphinx.util.docutils import docutils_namespace

    cells = [dict(cell_, id=f"cell-{k}") for k, cell_ in enumerate(cells)]
    kernel = {"name": "python3", "display_name": "Python 3", "language": "python"}
    notebook = {"cells": cells, "metadata": {"kernelspec": kernel, "language_info": {"name": "python"}},
                "nbformat": 4, "nbformat_minor": 5}
    (src / "03_chapter.ipynb").write_text(json.dumps(notebook))
    (src / "conf.py").write_text(
        f"import sys\nsys.path.insert(0, {str(EXT)!r})\n"
        "extensions = ['myst_nb', 'exercise_boxes']\nroot_doc = '03_chapter'\nnb_execution_mode = 'off'\n"
        "html_theme = 'basic'\n")
    out = src / "_build"
    with docutils_namespace():  # each build registers its nodes afresh, as in a new process
        app = Sphinx(str(src), str(src), str(out), str(out / ".doctrees"), "html", status=None, warning=warning,
                     freshenv=True, warningiserror=warning is None)
        app.build()
    return BeautifulSoup((out / "03_chapter.html").read_text(encoding="utf-8"), "html.parser")


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    """Chapter 3 of a one-page book, built by Sphinx with MyST-NB, sphinx-exercise and the extension."""
    return build(tmp_path_factory.mktemp("book"), NOTEBOOK)


def test_a_second_exercise_with_the_same_number_is_reported_and_left_a_section(tmp_path):
    warnings = io.StringIO()
    cells = [*NOTEBOOK[:5], markdown("### Exercise 3.1: the same number again\n\nOops.")]
    page = build(tmp_path, cells, warning=warnings)
    assert "the label exercise-3-1 is taken already" in warnings.getvalue()
    assert [box["id"] for box in page.select("div.exercise")] == ["exercise-3-1"]
    assert page.select_one("div.body h3").get_text().startswith("Exercise 3.1: the same number again")


def test_each_exercise_is_a_box_titled_with_the_notebooks_number_and_title(page):
    boxes_ = page.select("div.exercise.admonition")
    assert [box["id"] for box in boxes_] == ["exercise-3-1", "exercise-3-2", "exercise-3-3"]
    titles = [" ".join(box.select_one("p.admonition-title").get_text(" ").split()) for box in boxes_]
    assert titles == ["Exercise 3.1: the RMS of a row Solution", "Exercise 3.2: two parts Solution",
                      "Exercise 3.3: no solution here"]
    assert boxes_[0].select_one("p.admonition-title code"), "inline code in the heading stays code"
    assert page.find(id="exercise-3-1-the-rms-of-a-row"), "the heading's old anchor still leads to the box"
    assert not page.select("div.body h3"), "the exercise headings are now box titles"
    box = boxes_[0]
    assert "Write" in box.get_text() and "raise NotImplementedError" in box.get_text()
    assert "not attempted yet" in box.get_text(), "the stub and the checker's verdict sit in the box"
    assert "rms_solution" not in box.get_text(), "the solution does not"


def test_each_solution_is_a_closed_dropdown_linked_both_ways_to_its_exercise(page):
    dropdowns = page.select("details.solution")
    assert [d["id"] for d in dropdowns] == ["solution-3-1", "solution-3-2"]
    for dropdown, number in zip(dropdowns, ("3.1", "3.2")):
        assert not dropdown.has_attr("open"), "closed until clicked"
        summary = dropdown.find("summary", recursive=False)
        assert " ".join(summary.get_text().split()) == f"Solution to Exercise {number}"
        assert summary.a["href"] == f"#exercise-{number.replace('.', '-')}"
        exercise = page.find(id=summary.a["href"][1:])
        assert exercise.find_next("details") is dropdown, "the dropdown follows its exercise's box"
        assert exercise.select_one("a.exercise-solution-link")["href"] == f"#{dropdown['id']}"
    assert "rms_solution" in dropdowns[0].get_text() and "correct" in dropdowns[0].get_text()
    assert "first_part" in dropdowns[1].get_text() and "second_part" in dropdowns[1].get_text(), \
        "solution cells that follow each other share one dropdown"
    assert "Show code cell" not in page.get_text(), "no second toggle inside the dropdown"
    remark = page.find(string=lambda s: "A remark after the solution" in s)
    assert remark.find_parent("details") is None and remark.find_parent("div", class_="exercise") is None
    assert dropdowns[1].find_next("p") is remark.parent, "what follows a solution stays after it"
    assert "Solution" not in page.find(id="exercise-3-3").get_text(), "no solution, no link"
