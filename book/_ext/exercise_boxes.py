"""Sphinx extension: each chapter exercise becomes a numbered box, its hidden solution a linked dropdown.

A notebook writes an exercise as plain Markdown and code cells, so that it reads the same in JupyterLab and Colab::

    ### Exercise 5.1: attention from scratch      (markdown: the task)
    def my_attention(...): raise NotImplementedError   (the reader's stub)
    check_attention(my_attention)                  (the checker)
    #### Solution                                  (tag remove-cell: JupyterLab and Colab only)
    # Solution (hidden in the book until clicked)  (code, tag hide-cell)

At build time, after MyST-NB has parsed the notebook, the section of every heading "Exercise N.M: title" is replaced
by sphinx-exercise's nodes, the ones its ``exercise`` and ``solution`` directives make:

* an ``exercise_node`` box titled "Exercise N.M: title" (the number is the notebook's own, not a count) holding the
  exercise's cells up to its solution, with the anchor ``exercise-N-M`` (the heading's old anchor is kept too) and,
  in its title, a link to the solution;
* each run of solution cells (code cells whose source starts with ``# Solution``, one after the other) becomes a
  ``solution_node`` (anchor ``solution-N-M``; a second run ``solution-N-M-2``) that sphinx-exercise titles
  "Solution to Exercise N.M", with a link back to the box. In HTML it is written as a ``<details>`` element, closed
  until the reader clicks it: it works without JavaScript, unlike sphinx-togglebutton's dropdowns. The cells lose
  MyST-NB's own "Show code cell content" toggle. exercise_boxes.css styles it as sphinx-exercise styles solutions.

Whatever follows a solution inside the exercise's section stays after it, in order. The notebooks do not change.
"""

from __future__ import annotations

import re
from pathlib import Path

from docutils import nodes
from sphinx.transforms import SphinxTransform
from sphinx.transforms.post_transforms import SphinxPostTransform
from sphinx.util import logging
from sphinx.util.fileutil import copy_asset
from sphinx_exercise.nodes import (
    depart_solution_node,
    exercise_node,
    exercise_title,
    solution_node,
    solution_title,
    visit_solution_node,
)

logger = logging.getLogger(__name__)

EXERCISE = re.compile(r"Exercise (\d+)\.(\d+)(?=$|[\s:])")
SOLUTION_PREFIX = "# Solution"
CSS = Path(__file__).with_name("exercise_boxes.css")


class solution_dropdown(solution_node):
    """A sphinx-exercise solution written as a closed ``<details>`` element in HTML."""


class solution_summary(nodes.TextElement, nodes.Element):
    """The dropdown's always-visible line: the resolved solution title ("Solution to Exercise N.M")."""


# --- the pure parts: which sections are exercises, which cells are solutions, what goes in the box -------------


def exercise_number(title: str) -> tuple[int, int] | None:
    """(N, M) for a heading that starts "Exercise N.M" (alone or followed by ":" and a title); else None."""
    match = EXERCISE.match(title.strip())
    return (int(match.group(1)), int(match.group(2))) if match else None


def is_solution_cell(node: nodes.Node) -> bool:
    """A MyST-NB code cell whose source starts with "# Solution" (the rule of tests/test_notebooks.py)."""
    if not (isinstance(node, nodes.container) and node.get("nb_element") == "cell_code"):
        return False
    sources = [c for c in node.children if isinstance(c, nodes.Element) and c.get("nb_element") == "cell_code_source"]
    return bool(sources) and sources[0].astext().lstrip().startswith(SOLUTION_PREFIX)


def solution_runs(section: nodes.section) -> list[list[nodes.container]]:
    """The solution cells of a section, grouped into runs of siblings that follow each other, in page order."""
    runs: list[list[nodes.container]] = []
    for cell in section.findall(is_solution_cell):
        last = runs[-1][-1] if runs else None
        if last is not None and last.parent is cell.parent and last.parent.index(last) + 1 == cell.parent.index(cell):
            runs[-1].append(cell)
        else:
            runs.append([cell])
    return runs


def split_at_first(children: list[nodes.Node], is_start) -> tuple[list[nodes.Node], list[nodes.Node]]:
    """(children before the first one that is or holds a node matching ``is_start``, that one and the rest)."""
    for i, child in enumerate(children):
        if is_start(child) or (isinstance(child, nodes.Element) and next(iter(child.findall(is_start)), None)):
            return children[:i], children[i:]
    return children, []


def exercise_label(number: tuple[int, int]) -> str:
    return "exercise-{}-{}".format(*number)


def solution_label(number: tuple[int, int], run: int) -> str:
    return "solution-{}-{}".format(*number) + (f"-{run + 1}" if run else "")


# --- the Sphinx glue ---------------------------------------------------------------------------------------------


class ExerciseBoxes(SphinxTransform):
    """Replace every "Exercise N.M" section by a sphinx-exercise box followed by its solution dropdowns.

    Runs after docutils' reference transforms and before Sphinx's domains collect the labels (850), so that
    ``exercise-N-M`` and ``solution-N-M`` are labels like the ones the directives make."""

    default_priority = 700

    def apply(self, **kwargs) -> None:
        if not hasattr(self.env, "sphinx_exercise_registry"):
            self.env.sphinx_exercise_registry = {}
        for section in list(self.document.findall(nodes.section)):
            title = section[0] if section.children and isinstance(section[0], nodes.title) else None
            number = exercise_number(title.astext()) if title is not None else None
            if number and self._is_free(exercise_label(number), section):
                self._transform(section, title, number)

    def _is_free(self, label: str, section: nodes.section) -> bool:
        other = self.env.sphinx_exercise_registry.get(label)
        if other is None and self.document.ids.get(label, section) is section:
            return True
        where = other["docname"] if other else self.env.docname
        logger.warning(f"exercise boxes: the label {label} is taken already (in {where}); this exercise stays a "
                       "plain section", location=section)
        return False

    def _transform(self, section: nodes.section, title: nodes.title, number: tuple[int, int]) -> None:
        label = exercise_label(number)
        dropdowns = []
        for run, cells in enumerate(solution_runs(section)):
            dropdown = self._dropdown(solution_label(number, run), label, cells)
            cells[0].parent.replace(cells[0], dropdown)
            for cell in cells[1:]:
                cell.parent.remove(cell)
            dropdowns.append(dropdown)
        inside, after = split_at_first(section.children[1:], lambda n: isinstance(n, solution_dropdown))
        box = self._box(label, number, section, title, dropdowns[0]["label"] if dropdowns else None)
        box.extend(inside)
        section.parent.replace(section, box)
        parent = box.parent
        for offset, node in enumerate(after, start=1):
            parent.insert(parent.index(box) + offset, node)

    def _box(self, label, number, section, title, solution) -> exercise_node:
        heading = nodes.title("", "", *(child.deepcopy() for child in title.children))
        if solution:
            # refuri, not refid: sphinx-exercise would rewrite a refid link's text to the solution's full title
            heading += nodes.reference("", "Solution", internal=True, refuri=f"#{solution}",
                                       classes=["exercise-solution-link"])
        box = exercise_node("", heading, classes=["exercise"])
        kept_ids = [i for i in section["ids"] if i != label]
        self._register(box, label, "exercise", title=title.astext(), extra_ids=kept_ids,
                       extra_names=section["names"])
        # sphinx-exercise titles a solution "Solution to" + the registered exercise's title: register "Exercise N.M".
        reference = exercise_node("", exercise_title("", "Exercise {}.{}".format(*number)))
        for key in ("label", "docname", "title", "type", "hidden", "serial_number"):
            reference[key] = box[key]
        self.env.sphinx_exercise_registry[label] = {"type": "exercise", "docname": self.env.docname,
                                                    "node": reference}
        return box

    def _dropdown(self, label: str, target: str, cells: list[nodes.container]) -> solution_dropdown:
        # No class "dropdown": sphinx-togglebutton would add its own button to the <details>.
        dropdown = solution_dropdown("", solution_title("", "Solution to"), classes=["solution"])
        for cell in cells:
            cell.attributes.pop("hide_mode", None)  # no second toggle ("Show code cell content") inside
            dropdown += cell.deepcopy()
        dropdown["target_label"] = target
        self._register(dropdown, label, "solution", title="Solution to")
        self.env.sphinx_exercise_registry[label] = {"type": "solution", "docname": self.env.docname,
                                                    "node": dropdown}
        return dropdown

    def _register(self, node, label, kind, *, title, extra_ids=(), extra_names=()) -> None:
        """Give the node the attributes sphinx-exercise's directives give theirs, and make ``label`` an explicit
        target of the page (the heading's old anchors now point at the node)."""
        node["ids"] = [label, *extra_ids]
        node["names"] = [label, *extra_names]
        attributes = {"label": label, "docname": self.env.docname, "title": title, "type": kind, "hidden": False,
                      "serial_number": self.env.new_serialno()}
        for key, value in attributes.items():
            node[key] = value
        for node_id in node["ids"]:
            self.document.ids[node_id] = node
        self.document.nameids[label] = label
        self.document.nametypes[label] = True


class DropdownSummaries(SphinxPostTransform):
    """After sphinx-exercise has resolved the solution titles (post-transforms 20-22): put each dropdown's title
    into a ``<summary>`` line, so that HTML shows it while the rest stays closed."""

    default_priority = 30
    formats = ("html",)

    def run(self, **kwargs) -> None:
        for dropdown in self.document.findall(solution_dropdown):
            title = dropdown[0]
            if isinstance(title, nodes.title):
                dropdown.replace(title, solution_summary("", "", *title.children, classes=["admonition-title"]))
                self._space_outside_links(dropdown[0])

    @staticmethod
    def _space_outside_links(summary: solution_summary) -> None:
        """sphinx-exercise writes "Solution to" + a link " Exercise N.M": move the space out of the underlined link."""
        for link in list(summary.findall(nodes.reference)):
            text = link.children[0] if link.children else None
            if isinstance(text, nodes.Text) and text.startswith(" "):
                link.replace(text, nodes.Text(text.lstrip()))
                link.parent.insert(link.parent.index(link), nodes.Text(" "))


def visit_dropdown(self, node) -> None:
    self.body.append(self.starttag(node, "details", CLASS="admonition"))


def depart_dropdown(self, node) -> None:
    self.body.append("</details>\n")


def visit_summary(self, node) -> None:
    self.body.append(self.starttag(node, "summary", ""))


def depart_summary(self, node) -> None:
    self.body.append("</summary>\n")


def copy_css(app, exc) -> None:
    if exc is None and app.builder.format == "html":
        copy_asset(str(CSS), str(Path(app.outdir) / "_static"))


def setup(app):
    app.setup_extension("sphinx_exercise")
    app.add_node(solution_dropdown, html=(visit_dropdown, depart_dropdown),
                 latex=(visit_solution_node, depart_solution_node))
    app.add_node(solution_summary, html=(visit_summary, depart_summary))
    app.add_transform(ExerciseBoxes)
    app.add_post_transform(DropdownSummaries)
    app.add_css_file(CSS.name)
    app.connect("build-finished", copy_css)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
