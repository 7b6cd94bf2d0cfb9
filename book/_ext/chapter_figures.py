"""Sphinx extension: number each chapter's figures N.1, N.2, ... as the prose does ("Figure 12.1").

The chapters sit in an unnumbered toctree, where Sphinx numbers figures through the whole book (Fig. 1, ..., Fig. 40).
After Sphinx has assigned its numbers, the figures of every page whose file name starts with a chapter number
(``notebooks/12_pretrained``) are renumbered ``(12, 1), (12, 2), ...`` in the order they appear on the page; the
other pages keep Sphinx's numbers. A chapter with a second notebook (``notebooks/07_training_further``, after
``notebooks/07_training`` in name order) goes on counting where the first stopped, so chapter 7's figures are 7.1 to
7.11 across its two pages. ``numfig_format`` in book/_config.yml writes them as "Figure 12.1:".

A notebook captions a figure with its code cell's metadata, which MyST-NB renders as a numbered figure::

    "mystnb": {"figure": {"caption": "...", "name": "fig-ch12-parameters"}, "image": {"alt": "..."}}

and repeats the caption, with its number, in a markdown cell tagged ``remove-cell`` for JupyterLab and Colab.
tests/test_notebooks.py checks that the two agree and that the k-th figure of chapter N is numbered N.k.
"""

import re

CHAPTER = re.compile(r"(?:^|/)(\d+)_[^/]*$")


def chapter_numbers(docname: str, figures: dict, offset: int = 0) -> dict:
    """Figure id -> (chapter, offset + k) for the figures of a chapter page, in page order; ``figures`` unchanged
    otherwise. ``offset``: the figures of the chapter's earlier pages."""
    match = CHAPTER.search(docname)
    if not match:
        return figures
    chapter = int(match.group(1))
    return {figure_id: (chapter, offset + k) for k, figure_id in enumerate(figures, start=1)}


def renumber(app, env):
    """After Sphinx's ``assign_figure_numbers`` (env-get-updated, default priority): number per chapter, a chapter's
    pages in name order. Returns the pages whose numbers changed, so that Sphinx writes them again."""
    changed, counted = [], {}
    for docname in sorted(env.toc_fignumbers):
        by_type = env.toc_fignumbers[docname]
        figures = by_type.get("figure")
        if not figures:
            continue
        match = CHAPTER.search(docname)
        chapter = int(match.group(1)) if match else None
        numbers = chapter_numbers(docname, figures, counted.get(chapter, 0))
        if chapter is not None:
            counted[chapter] = counted.get(chapter, 0) + len(figures)
        if numbers != figures:
            by_type["figure"] = numbers
            changed.append(docname)
    return changed


def setup(app):
    app.connect("env-get-updated", renumber, priority=900)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
