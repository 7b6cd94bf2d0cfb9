"""The book's schematic diagrams, stored in the package so they show offline, in the book, JupyterLab and Colab.

``show(name)`` displays one in a notebook. The drawings are made by ``tools/make_diagrams.py`` (matplotlib, one
style for every diagram) and stored next to this file as ``<name>.png`` and ``<name>.svg``; the notebooks show the
PNG, so a cell's stored output is an image that nbval does not compare byte by byte and the book copies as is.

>>> from groundup.diagrams import names, show
>>> names()
('attention_head', 'multi_head', 'block_post_pre', 'residual_stream', 'encoder_decoder')
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

NAMES = ("attention_head", "multi_head", "block_post_pre", "residual_stream", "encoder_decoder")
"""Every diagram, in the order the book introduces them."""

DESCRIPTIONS = {
    "attention_head": "one attention head: queries, keys and values, scores, mask, softmax, weighted sum",
    "multi_head": "multi-head attention: split into heads, attention per head, concatenation, W_O",
    "block_post_pre": "the transformer block, Post-LN (the seeds' equations) and Pre-LN side by side",
    "residual_stream": "the residual stream: every sub-layer reads from it and adds its result back",
    "encoder_decoder": "the encoder-decoder transformer with cross-attention (chapter 10's example)",
}
FORMATS = ("png", "svg")


def names() -> tuple[str, ...]:
    """The names of all diagrams, for :func:`show`."""
    return NAMES


def _check(name, format):
    if not isinstance(name, str):
        raise TypeError(f"name must be a string, one of {', '.join(NAMES)}; got {type(name).__name__}")
    if name not in NAMES:
        raise ValueError(f"unknown diagram {name!r}; the diagrams are: {', '.join(NAMES)}")
    if format not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {format!r}")


def path(name: str, *, format: str = "png") -> Path:
    """The stored file of diagram ``name`` (``format`` ``"png"`` or ``"svg"``)."""
    _check(name, format)
    file = resources.files(__name__).joinpath(f"{name}.{format}")
    if not file.is_file():
        raise FileNotFoundError(f"the diagram file {name}.{format} is missing from the installed package; "
                                "run `python tools/make_diagrams.py` in the repository and reinstall")
    return Path(str(file))


def image(name: str, *, format: str = "png"):
    """Diagram ``name`` as an IPython display object (``Image`` for PNG, ``SVG`` for SVG), not yet displayed.

    The PNG is drawn at 200 pixels per inch and shown at half its pixel width (sharp on high-density screens). Only
    the width is set, so a narrow page (the book on a phone) scales it down without distorting it.
    """
    from IPython.display import SVG, Image

    data = path(name, format=format).read_bytes()
    if format == "svg":
        return SVG(data=data.decode("utf-8"))
    width = int.from_bytes(data[16:20], "big")  # the PNG header's IHDR chunk: width, then height
    return Image(data=data, format="png", width=width // 2)


def show(name: str, *, format: str = "png") -> None:
    """Display diagram ``name`` in the notebook (one output: the image; ``names()`` lists the diagrams).

    >>> show("attention_head")  # doctest: +SKIP
    """
    from IPython.display import display

    display(image(name, format=format))


__all__ = ["NAMES", "DESCRIPTIONS", "names", "path", "image", "show"]
