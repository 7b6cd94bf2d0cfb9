"""Draw the book's schematic diagrams with matplotlib and store them in the package (``src/groundup/diagrams/``).

    python tools/make_diagrams.py               (re-draws every diagram, writes <name>.svg and <name>.png)
    python tools/make_diagrams.py --out DIR     (writes into DIR instead, e.g. to compare with the stored files)

Every diagram uses one style: the same fonts, one colour per kind of part (attention, normalisation, feed-forward
network, embeddings, ...), the same boxes, arrows and residual additions (⊕). The files are deterministic: the SVG
ids come from a fixed salt and neither file carries a date or a software version, so re-running the script with the
pinned matplotlib rewrites identical bytes (tests/test_diagrams.py checks it). The notebooks show the PNG through
``groundup.diagrams.show(name)``; the SVG is the same drawing as a vector file.
"""

from __future__ import annotations

import argparse
import io
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Circle, FancyArrowPatch, FancyBboxPatch, Rectangle  # noqa: E402
from PIL import Image  # noqa: E402

from groundup.plotting import DIAGRAM_COLORS, DIAGRAM_INK  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "src" / "groundup" / "diagrams"
UNIT = 0.5  # inches per drawing unit: every diagram is drawn in units, 1 unit = half an inch
PNG_DPI = 200  # shown at half its pixel size (retina), i.e. at 100 pixels per inch

STYLE = {
    "font.family": "DejaVu Sans",
    "font.size": 8,
    "mathtext.fontset": "cm",
    "svg.fonttype": "path",  # glyphs as paths: the SVG looks the same without the font installed
    "svg.hashsalt": "groundup-diagrams",  # fixed ids: the same file on every run
    "path.simplify": False,
}

# One colour per kind of part, in every diagram: (fill, edge); the diagrams drawn at run time share the palette.
COLORS = DIAGRAM_COLORS
INK = DIAGRAM_INK  # arrows and text
RESIDUAL = "#555555"  # residual connections and the residual stream
STREAM = "#bdbdbd"
HEADS = ["#4c78a8", "#f58518", "#54a24b", "#b279a2"]  # one colour per attention head


# --- drawing helpers ---------------------------------------------------------------------------------------------

def canvas(width: float, height: float):
    """A figure ``width`` x ``height`` units with one axes filling it, data coordinates in units, no frame."""
    fig = plt.figure(figsize=(width * UNIT, height * UNIT))
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(0, width)
    ax.set_ylim(0, height)
    ax.set_aspect("equal")
    ax.axis("off")
    return fig, ax


def box(ax, x, y, w, h, text="", kind="tensor", *, fontsize=8, dashed=False, weight="normal"):
    """A rounded box centred at (x, y), filled with the colour of its kind, with centred text."""
    fill, edge = COLORS[kind]
    ax.add_patch(FancyBboxPatch((x - w / 2, y - h / 2), w, h, boxstyle="round,pad=0,rounding_size=0.12",
                                facecolor=fill, edgecolor=edge, linewidth=0.9,
                                linestyle=(0, (3, 2)) if dashed else "solid", zorder=2))
    if text:
        ax.text(x, y, text, ha="center", va="center", fontsize=fontsize, color=INK, zorder=3,
                linespacing=1.35, fontweight=weight)
    return (x - w / 2, x + w / 2, y - h / 2, y + h / 2)


def arrow(ax, a, b, *, color=INK, lw=0.9, style="-|>", connection=None, zorder=1, dashed=False):
    """An arrow from point a to point b (optionally bent: a matplotlib connection style)."""
    ax.add_patch(FancyArrowPatch(a, b, arrowstyle=style, mutation_scale=9, shrinkA=0, shrinkB=0, color=color,
                                 linewidth=lw, connectionstyle=connection, zorder=zorder,
                                 linestyle=(0, (3, 2)) if dashed else "solid"))


def elbow(ax, a, b, x_turn, *, color=INK, lw=0.9):
    """A right-angled arrow: from a horizontally to x_turn, vertically to b's height, horizontally into b."""
    line(ax, [a[0], x_turn, x_turn], [a[1], a[1], b[1]], color=color, lw=lw)
    arrow(ax, (x_turn, b[1]), b, color=color, lw=lw)


def line(ax, xs, ys, *, color=RESIDUAL, lw=0.9, zorder=1):
    """A polyline without a head (the first legs of a residual path)."""
    ax.plot(xs, ys, color=color, linewidth=lw, solid_capstyle="butt", solid_joinstyle="miter", zorder=zorder)


def add(ax, x, y, r=0.2):
    """The residual addition ⊕ at (x, y)."""
    ax.add_patch(Circle((x, y), r, facecolor="white", edgecolor=INK, linewidth=0.9, zorder=3))
    ax.plot([x - r * 0.6, x + r * 0.6], [y, y], color=INK, linewidth=0.9, zorder=4)
    ax.plot([x, x], [y - r * 0.6, y + r * 0.6], color=INK, linewidth=0.9, zorder=4)


def text(ax, x, y, s, *, size=8, ha="center", va="center", color=INK, **kw):
    ax.text(x, y, s, ha=ha, va=va, fontsize=size, color=color, zorder=5, linespacing=1.35, **kw)


def title(ax, x, y, s):
    text(ax, x, y, s, size=9.5, ha="left", va="top", fontweight="bold")


def grid_icon(ax, x, y, n=5, cell=0.16, causal=True, color=HEADS[0]):
    """A tiny n x n weight matrix centred at (x, y): shaded cells are weights, blank ones masked (causal)."""
    x0, y0 = x - n * cell / 2, y + n * cell / 2
    for i in range(n):  # row i = query i, from the top
        for j in range(n):
            visible = j <= i or not causal
            ax.add_patch(Rectangle((x0 + j * cell, y0 - (i + 1) * cell), cell, cell, linewidth=0.4,
                                   edgecolor="#999999", facecolor=color if visible else "white",
                                   alpha=(0.35 + 0.6 * ((i + 2 * j) % 3) / 2) if visible else 1.0, zorder=3))


# --- the diagrams --------------------------------------------------------------------------------------------------

def attention_head():
    """One attention head: X -> Q, K, V -> scores -> mask -> softmax -> weights -> weighted sum of the values."""
    fig, ax = canvas(13.6, 5.9)
    title(ax, 0.2, 5.75, "One attention head")
    ys = {"Q": 4.45, "K": 2.95, "V": 1.3}
    # input
    box(ax, 0.95, 2.875, 1.4, 3.9, "", "tensor")
    text(ax, 0.95, 3.5, r"$\mathbf{X}$", size=13)
    text(ax, 0.95, 2.55, "inputs\n" + r"$\mathbf{x}_1, \dots, \mathbf{x}_n$" + "\n" + r"$n \times d_\mathcal{M}$",
         size=7.5)
    names = {"Q": ("query", r"\mathbf{W}_Q"), "K": ("key", r"\mathbf{W}_K"), "V": ("value", r"\mathbf{W}_V")}
    for key, y in ys.items():
        word, sym = names[key]
        arrow(ax, (1.65, y), (2.3, y))
        box(ax, 2.95, y, 1.3, 0.85, f"${sym}$\n{word}", "attention", fontsize=8)
        arrow(ax, (3.6, y), (4.1, y))
        size = r"$n \times d_k$" if key != "V" else r"$n \times d_v$"
        box(ax, 4.85, y, 1.5, 0.85, rf"$\mathbf{{{key}}} = \mathbf{{X}}{sym}^\top$" + "\n" + size, "tensor",
            fontsize=7.5)
    # scores, mask, softmax
    sy = (ys["Q"] + ys["K"]) / 2
    box(ax, 7.1, sy, 1.75, 1.1, "scores\n" + r"$\mathbf{Q}\mathbf{K}^\top / \sqrt{d_k}$" + "\n" + r"$n \times n$",
        "attention", fontsize=7.5)
    elbow(ax, (5.6, ys["Q"]), (6.225, sy + 0.3), 5.95)
    elbow(ax, (5.6, ys["K"]), (6.225, sy - 0.3), 5.95)
    arrow(ax, (7.975, sy), (8.35, sy))
    box(ax, 9.3, sy, 1.9, 1.1, "mask (if any)\n" + r"score $-\infty$ where" + "\n" + r"$i$ may not see $j$",
        "mask", fontsize=7.5, dashed=True)
    arrow(ax, (10.25, sy), (10.6, sy))
    box(ax, 11.45, sy, 1.7, 1.1, "softmax\nover each row", "attention", fontsize=7.5)
    # weights and the weighted sum
    arrow(ax, (11.45, sy - 0.55), (11.45, ys["V"] + 0.45))
    text(ax, 11.3, 2.55, r"weights $w_{ij}$", size=7.5, ha="right")
    text(ax, 11.3, 2.1, "rows sum to 1", size=7, ha="right")
    grid_icon(ax, 12.45, 2.3, n=5, cell=0.15)
    arrow(ax, (5.6, ys["V"]), (10.55, ys["V"]))
    text(ax, 8.0, ys["V"] + 0.22, r"values $\mathbf{v}_j$", size=7.5)
    box(ax, 11.45, ys["V"], 1.8, 0.9, "weighted sum\n" + r"$\hat{\mathbf{z}}_i = w_{i1}\mathbf{v}_1 + \cdots$",
        "attention", fontsize=7.5)
    arrow(ax, (11.45, ys["V"] - 0.45), (11.45, 0.15))
    text(ax, 11.6, 0.45, r"head output, $n \times d_v$", size=7.5, ha="left")
    text(ax, 0.2, 0.35, r"$\mathrm{AH}(\mathbf{X}) = \mathrm{softmax}\left(\mathbf{Q}\mathbf{K}^\top / \sqrt{d_k}"
         r"\right)\mathbf{V}$, with masked scores set to $-\infty$ before the softmax", size=8.5, ha="left")
    return fig


def multi_head():
    """Multi-head attention: project, split d into n_H heads, attend per head, concatenate, W_O."""
    fig, ax = canvas(13.6, 7.3)
    title(ax, 0.2, 7.15, "Multi-head attention")
    lanes = [5.6, 4.1, 1.7]  # y of the heads drawn: 1, 2 and n_H (dots between)
    labels = ["1", "2", r"n_\mathcal{H}"]
    seg_h, mid = 1.1, 3.65  # segment height of one head in the bars, and the bars' centre

    def bar(x, inner):
        for k in range(3):
            y0 = mid + (0.5 - k) * seg_h
            ax.add_patch(Rectangle((x - 0.4, y0), 0.8, seg_h, facecolor=HEADS[k], alpha=0.5, edgecolor=INK,
                                   linewidth=0.7, zorder=2))
            text(ax, x, y0 + seg_h / 2, inner[k], size=7.5)
        return [mid + (1 - k) * seg_h for k in range(3)]  # segment centres

    box(ax, 0.95, mid, 1.4, 4.4, "", "tensor")
    text(ax, 0.95, 4.2, r"$\mathbf{X}$", size=13)
    text(ax, 0.95, 3.3, "inputs\n" + r"$n \times d_\mathcal{M}$", size=7.5)
    arrow(ax, (1.65, mid), (2.15, mid))
    box(ax, 3.0, mid, 1.7, 2.2, r"$\mathbf{W}_Q, \mathbf{W}_K, \mathbf{W}_V$" + "\nall heads\nat once", "attention",
        fontsize=7.5)
    arrow(ax, (3.85, mid), (4.4, mid))
    left = bar(4.8, [r"$h = 1$", r"$h = 2$", r"$h = n_\mathcal{H}$"])
    text(ax, 4.8, 6.3, r"$\mathbf{Q}, \mathbf{K}, \mathbf{V}$, split" + "\ninto heads", size=7.5)
    text(ax, 4.6, 1.5, r"$n_\mathcal{H} d_h$ columns", size=7)
    right_x = 10.3
    for k, (y, lab) in enumerate(zip(lanes, labels)):
        elbow(ax, (5.2, left[k]), (6.1, y), 5.65, color=HEADS[k])
        box(ax, 7.55, y, 2.9, 1.0, f"head ${lab}$:  " + r"$\mathrm{softmax}\left(\frac{\mathbf{Q}_h"
            r"\mathbf{K}_h^\top}{\sqrt{d_h}}\right)\mathbf{V}_h$", "attention", fontsize=7.5)
    right = [mid + (1 - k) * seg_h for k in range(3)]
    for k, y in enumerate(lanes):
        elbow(ax, (9.0, y), (right_x - 0.4, right[k]), 9.45, color=HEADS[k])
    bar(right_x, [r"$\mathbf{z}_1$", r"$\mathbf{z}_2$", r"$\mathbf{z}_{n_\mathcal{H}}$"])
    text(ax, 7.55, 2.95, r"$\vdots$", size=12)
    text(ax, right_x, 6.35, "concatenate\n" + r"$\mathbf{z} = \mathbf{z}_1 \| \cdots \| \mathbf{z}_{n_\mathcal{H}}$",
         size=7.5)
    text(ax, right_x, 1.45, r"$n \times n_\mathcal{H} d_h$", size=7)
    arrow(ax, (right_x + 0.4, mid), (10.95, mid))
    box(ax, 11.6, mid, 1.3, 1.0, r"$\mathbf{W}_O$" + "\noutput", "attention")
    arrow(ax, (12.25, mid), (12.7, mid))
    box(ax, 13.05, mid, 0.7, 2.2, "", "tensor")
    text(ax, 13.05, mid, r"$n \times d_\mathcal{M}$", size=7.5, rotation=90)
    text(ax, 0.2, 0.45, r"$\mathrm{Attention}(\mathbf{X}) = \mathbf{W}_O\,\mathbf{z}$ at every position;"
         r" usually $d_h = d_\mathcal{M} / n_\mathcal{H}$, so all heads together cost as much as one head of size"
         r" $d_\mathcal{M}$", size=8, ha="left")
    return fig


def _sublayer_post(ax, x, y, label, kind, *, width=2.4, res_x=None):
    """Post-LN sub-layer from height y: sub-layer -> ⊕ (input added back) -> LayerNorm; returns the new top."""
    res_x = res_x if res_x is not None else x - width / 2 - 0.45
    arrow(ax, (x, y), (x, y + 0.45))
    box(ax, x, y + 0.85, width, 0.8, label, kind)
    arrow(ax, (x, y + 1.25), (x, y + 1.55))
    add(ax, x, y + 1.75)
    line(ax, [x, res_x, res_x], [y + 0.2, y + 0.2, y + 1.75])
    arrow(ax, (res_x, y + 1.75), (x - 0.2, y + 1.75), color=RESIDUAL)
    arrow(ax, (x, y + 1.95), (x, y + 2.2))
    box(ax, x, y + 2.5, width * 0.75, 0.6, "LayerNorm (LN)", "norm")
    return y + 2.8


def _sublayer_pre(ax, x, y, label, kind, *, width=2.4, res_x=None):
    """Pre-LN sub-layer from height y: LayerNorm -> sub-layer -> ⊕ (input added back); returns the new top."""
    res_x = res_x if res_x is not None else x - width / 2 - 0.45
    arrow(ax, (x, y), (x, y + 0.45))
    box(ax, x, y + 0.75, width * 0.75, 0.6, "LayerNorm (LN)", "norm")
    arrow(ax, (x, y + 1.05), (x, y + 1.3))
    box(ax, x, y + 1.7, width, 0.8, label, kind)
    arrow(ax, (x, y + 2.1), (x, y + 2.4))
    add(ax, x, y + 2.6)
    line(ax, [x, res_x, res_x], [y + 0.2, y + 0.2, y + 2.6])
    arrow(ax, (res_x, y + 2.6), (x - 0.2, y + 2.6), color=RESIDUAL)
    return y + 2.8


def block_post_pre():
    """The transformer block twice: Post-LN (the seeds' equations) and Pre-LN, side by side."""
    fig, ax = canvas(13.6, 9.1)
    for x0, name, sub, eqs in [
        (0.2, "Post-LN (the seeds' block)", _sublayer_post,
         [r"$\mathbf{x}^{(\ell-1,*)} = \mathrm{LN}(\mathbf{x}^{(\ell-1)} + \mathrm{Attention}(\mathbf{x}^{(\ell-1)})"
          r")$", r"$\mathbf{x}^{(\ell)} = \mathrm{LN}(\mathbf{x}^{(\ell-1,*)} + \mathrm{FFN}"
          r"(\mathbf{x}^{(\ell-1,*)}))$"]),
        (7.0, "Pre-LN (GPT-2 and most recent models)", _sublayer_pre,
         [r"$\mathbf{x}^{(\ell-1,*)} = \mathbf{x}^{(\ell-1)} + \mathrm{Attention}(\mathrm{LN}(\mathbf{x}^{(\ell-1)})"
          r")$", r"$\mathbf{x}^{(\ell)} = \mathbf{x}^{(\ell-1,*)} + \mathrm{FFN}(\mathrm{LN}"
          r"(\mathbf{x}^{(\ell-1,*)}))$"]),
    ]:
        cx = x0 + 3.6
        title(ax, x0, 8.95, name)
        text(ax, cx, 0.5, r"$\mathbf{x}^{(\ell-1)}$ (from the block below)", size=8)
        y = sub(ax, cx, 0.8, "self-attention (SA)\n" + r"masked, $n_\mathcal{H}$ heads", "attention", width=2.8)
        text(ax, cx + 0.15, y + 0.22, r"$\mathbf{x}^{(\ell-1,*)}$", size=8, ha="left")
        y = sub(ax, cx, y, "feed-forward (FFN)\n" + r"$d_\mathcal{M} \to d_\mathrm{FFN} \to d_\mathcal{M}$", "ffn",
                width=2.8)
        arrow(ax, (cx, y), (cx, y + 0.35))
        text(ax, cx, y + 0.55, r"$\mathbf{x}^{(\ell)}$ (to the block above)", size=8)
        ax.add_patch(FancyBboxPatch((cx - 2.35, 0.85), 4.7, y - 0.9, boxstyle="round,pad=0,rounding_size=0.2",
                                    fill=False, edgecolor="#999999", linestyle=(0, (4, 3)), linewidth=0.8))
        text(ax, cx + 2.3, 0.95, r"block $\ell$", size=7.5, ha="right", va="bottom", style="italic", color="#666666")
        for k, eq in enumerate(eqs):
            text(ax, x0 + 0.1, 8.3 - 0.45 * k, eq, size=7.5, ha="left")
    text(ax, 7.1, 7.4, "and one more LayerNorm after the last block", size=7, ha="left", color="#555555")
    return fig


def residual_stream():
    """The residual stream: each sub-layer reads (through a norm) from the stream and adds its result back."""
    fig, ax = canvas(13.6, 5.4)
    title(ax, 0.2, 5.25, "The residual stream (Pre-LN)")
    ys = 1.75  # the stream's height
    ax.add_patch(Rectangle((1.6, ys - 0.16), 9.9, 0.32, facecolor=STREAM, edgecolor="none", zorder=0))
    box(ax, 0.85, ys, 1.4, 1.2, "token\nembedding\n+ position", "embed", fontsize=7.5)
    text(ax, 0.85, ys - 0.9, r"$\mathbf{W}_E$, $\mathrm{PosEmbed}$", size=7.5)
    for first, block in [(2.8, r"$\ell = 1$"), (7.7, r"$\ell = n_\mathcal{L}$")]:
        for x, label, kind in [(first, "attention", "attention"), (first + 1.6, "FFN", "ffn")]:
            arrow(ax, (x - 0.3, ys + 0.16), (x - 0.3, ys + 0.825))  # read from the stream
            box(ax, x, ys + 1.05, 1.1, 0.45, "LN", "norm", fontsize=7.5)
            arrow(ax, (x, ys + 1.275), (x, ys + 1.525))
            box(ax, x, ys + 1.9, 1.1, 0.75, label, kind, fontsize=8)
            line(ax, [x + 0.55, x + 0.8, x + 0.8], [ys + 1.9, ys + 1.9, ys + 0.6], color=INK)
            arrow(ax, (x + 0.8, ys + 0.7), (x + 0.8, ys + 0.17))  # write: add back into the stream
            add(ax, x + 0.8, ys, r=0.17)
        ax.add_patch(FancyBboxPatch((first - 0.75, ys - 0.5), 3.45, 3.15, boxstyle="round,pad=0,rounding_size=0.2",
                                    fill=False, edgecolor="#999999", linestyle=(0, (4, 3)), linewidth=0.8))
        text(ax, first - 0.65, ys + 2.55, f"block {block}", size=7.5, ha="left", va="top", style="italic",
             color="#555555")
    text(ax, 6.15, ys + 0.4, r"$\cdots$", size=12)
    for x, lab in [(1.75, r"$\mathbf{x}^{(0)}$"), (5.55, r"$\mathbf{x}^{(1)}$"),
                   (6.6, r"$\mathbf{x}^{(n_\mathcal{L}-1)}$"), (10.75, r"$\mathbf{x}^{(n_\mathcal{L})}$")]:
        text(ax, x, ys - 0.38, lab, size=8)
    text(ax, 6.15, ys - 0.95, "the stream:\none vector per position", size=7, color="#555555")
    arrow(ax, (1.55, ys), (2.2, ys), color=RESIDUAL, lw=1.2)
    arrow(ax, (11.2, ys), (11.95, ys), color=RESIDUAL, lw=1.2)
    box(ax, 12.55, ys, 1.1, 0.5, "LN", "norm", fontsize=7.5)
    arrow(ax, (12.55, ys + 0.25), (12.55, ys + 0.75))
    box(ax, 12.55, ys + 1.2, 1.5, 0.85, r"$U$" + "\nunembedding", "unembed", fontsize=7.5)
    arrow(ax, (12.55, ys + 1.625), (12.55, ys + 2.15))
    text(ax, 12.55, ys + 2.55, "logits\n" + r"$\to$ softmax", size=7.5)
    text(ax, 0.2, 0.3, r"Each sub-layer reads the stream through a norm and writes back by addition:"
         r" $\mathbf{x} \leftarrow \mathbf{x} + \mathrm{sublayer}(\mathrm{LN}(\mathbf{x}))$", size=8, ha="left")
    return fig


def _stack_sublayer(ax, x, y, label, kind, *, width=3.5, height=0.75, res_off=2.0):
    """A Pre-LN sub-layer in an encoder or decoder stack (LN -> sub-layer -> ⊕); returns (top, centre of box)."""
    arrow(ax, (x, y), (x, y + 0.3))
    box(ax, x, y + 0.52, 1.5, 0.44, "LayerNorm", "norm", fontsize=7)
    arrow(ax, (x, y + 0.74), (x, y + 0.95))
    centre = y + 0.95 + height / 2
    box(ax, x, centre, width, height, label, kind, fontsize=7.5)
    arrow(ax, (x, y + 0.95 + height), (x, y + 1.15 + height))
    add(ax, x, y + 1.33 + height, r=0.17)
    line(ax, [x, x - res_off, x - res_off], [y + 0.12, y + 0.12, y + 1.33 + height])
    arrow(ax, (x - res_off, y + 1.33 + height), (x - 0.17, y + 1.33 + height), color=RESIDUAL)
    return y + 1.5 + height, centre


def _stack_frame(ax, x, bottom, top, label):
    ax.add_patch(FancyBboxPatch((x - 2.3, bottom), 4.45, top - bottom, boxstyle="round,pad=0,rounding_size=0.2",
                                fill=False, edgecolor="#999999", linestyle=(0, (4, 3)), linewidth=0.8))
    text(ax, x + 2.3, (bottom + top) / 2, label, size=7.5, ha="left", style="italic", color="#555555")


def encoder_decoder():
    """The encoder-decoder transformer as chapter 10 trains it (Pre-LN), with chapter 10's date example."""
    fig, ax = canvas(13.6, 12.7)
    title(ax, 0.2, 12.55, "The encoder–decoder transformer (Pre-LN)")
    E, D = 3.2, 10.0
    text(ax, 0.3, 10.6, "Each sub-layer, Pre-LN as trained here:\n"
         r"$\quad\mathbf{x} \leftarrow \mathbf{x} + \mathrm{sublayer}(\mathrm{LN}(\mathbf{x}))$" + "\n"
         "Vaswani et al.'s original, Post-LN:\n"
         r"$\quad\mathbf{x} \leftarrow \mathrm{LN}(\mathbf{x} + \mathrm{sublayer}(\mathbf{x}))$" + "\n"
         r"$\oplus$: the residual connection", size=8, ha="left")
    # encoder
    box(ax, E, 0.55, 4.4, 0.8, "source $\\mathbf{x}$ (words, padded)\n\u201cmarch of two thousand and five\u201d",
        "tensor", fontsize=7.5)
    arrow(ax, (E, 0.95), (E, 1.3))
    box(ax, E, 1.6, 3.4, 0.6, r"$\mathbf{W}_E[x_j]$ + PosEmbed$(j)$", "embed", fontsize=7.5)
    y = 1.9
    y, _ = _stack_sublayer(ax, E, y, "self-attention (bidirectional)\nmask: source padding", "attention")
    y, _ = _stack_sublayer(ax, E, y, "feed-forward network", "ffn")
    _stack_frame(ax, E, 1.95, y + 0.05, "encoder\nblock\n" + r"$\times\, n_\mathcal{L}$")
    arrow(ax, (E, y), (E, y + 0.4))
    box(ax, E, y + 0.62, 1.5, 0.44, "LayerNorm", "norm", fontsize=7)
    arrow(ax, (E, y + 0.84), (E, y + 1.2))
    mem_y = y + 1.65
    box(ax, E, mem_y, 3.8, 0.9, "memory $\\mathbf{m}$: one contextual\nembedding per source word", "memory",
        fontsize=7.5)
    # decoder
    box(ax, D, 0.55, 4.6, 0.8, "decoder input $\\mathbf{u}$: <s> + target, shifted\n<s> 2 0 0 5 - 0 3", "tensor",
        fontsize=7.5)
    arrow(ax, (D, 0.95), (D, 1.3))
    box(ax, D, 1.6, 3.4, 0.6, r"$\mathbf{W}_E[u_i]$ + PosEmbed$(i)$", "embed", fontsize=7.5)
    y = 1.9
    y, _ = _stack_sublayer(ax, D, y, "masked self-attention\nmask: causal (+ target padding)", "attention")
    y, cross_c = _stack_sublayer(ax, D, y, "cross-attention: queries from the\ndecoder, keys and values from\n"
                                 "the memory; mask: source padding", "cross", height=1.05,
                                 width=3.75)
    y, _ = _stack_sublayer(ax, D, y, "feed-forward network", "ffn")
    _stack_frame(ax, D, 1.95, y + 0.05, "decoder\nblock\n" + r"$\times\, n_\mathcal{L}$")
    arrow(ax, (D, y), (D, y + 0.4))
    box(ax, D, y + 0.62, 1.5, 0.44, "LayerNorm", "norm", fontsize=7)
    arrow(ax, (D, y + 0.84), (D, y + 1.2))
    box(ax, D, y + 1.65, 4.2, 0.9, "unembedding $U$ (tied to the target\nembedding) " + r"$\to$ logits $\to$ softmax",
        "unembed", fontsize=7.5)
    arrow(ax, (D, y + 2.1), (D, y + 2.5))
    box(ax, D, y + 2.95, 4.6, 0.8, "targets: the next token at every position\n2 0 0 5 - 0 3 </s>", "tensor",
        fontsize=7.5)
    # memory -> cross-attention (keys and values)
    col, turn = COLORS["cross"][1], 6.55
    line(ax, [E + 1.9, turn, turn], [mem_y, mem_y, cross_c], color=col, lw=1.2)
    arrow(ax, (turn, cross_c), (D - 1.875, cross_c), color=col, lw=1.2)
    text(ax, (E + 1.9 + turn) / 2, mem_y + 0.1, "keys and\nvalues, to\nevery decoder\nblock", size=7.5,
         va="bottom", color=col)
    return fig


DIAGRAMS = {
    "attention_head": attention_head,
    "multi_head": multi_head,
    "block_post_pre": block_post_pre,
    "residual_stream": residual_stream,
    "encoder_decoder": encoder_decoder,
}


def render(name: str, folder: Path) -> list[Path]:
    """Draw diagram ``name`` and write ``folder/<name>.svg`` and ``folder/<name>.png``; returns the two paths."""
    if name not in DIAGRAMS:
        raise ValueError(f"unknown diagram {name!r}; the diagrams are {', '.join(DIAGRAMS)}")
    folder.mkdir(parents=True, exist_ok=True)
    with plt.rc_context(STYLE):
        fig = DIAGRAMS[name]()
        paths = [folder / f"{name}.svg", folder / f"{name}.png"]
        fig.savefig(paths[0], format="svg", metadata={"Date": None, "Creator": None})
        buffer = io.BytesIO()
        fig.savefig(buffer, format="png", dpi=PNG_DPI, metadata={"Software": None})
        plt.close(fig)
    # A palette of 96 colours (no dithering) looks the same and makes the file (and every notebook showing it)
    # three times smaller.
    with Image.open(buffer) as png:
        small = png.convert("RGB").quantize(colors=96, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE)
        small.save(paths[1], format="png", optimize=True)
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT, help="folder to write into (default: the package's)")
    parser.add_argument("names", nargs="*", help="diagrams to draw (default: all)")
    args = parser.parse_args(argv)
    for name in args.names or DIAGRAMS:
        for path in render(name, args.out):
            print(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
