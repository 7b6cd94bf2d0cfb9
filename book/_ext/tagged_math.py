"""Sphinx extension: let numbered multi-line equations render as they do in JupyterLab and Colab.

The notebooks number equations with ``\\tag{N.k}`` inside ``$$ ... $$``. Sphinx's MathJax writer wraps any
display math that contains a line break ``\\\\`` in a ``split`` environment, where MathJax forbids ``\\tag``.
For such equations we emit the author's TeX unchanged inside ``\\[ ... \\]`` (``nowrap``), which is exactly how
Jupyter renders it.
"""

from docutils import nodes


def _unwrap_tagged(app, doctree, docname):
    for node in doctree.findall(nodes.math_block):
        text = node.astext()
        if "\\tag" in text and "\\\\" in text and not node.get("nowrap"):
            node.children = [nodes.Text(f"\\[{text}\\]")]
            node["nowrap"] = True


def setup(app):
    app.connect("doctree-resolved", _unwrap_tagged)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
