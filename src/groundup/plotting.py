"""Figures for the book: matplotlib, labelled (title, axes, units, legend), sized for the book's column.

Every function returns the matplotlib ``Figure`` it drew, so a notebook can adjust or save it.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.patches import Rectangle

COLUMN = (6.4, 3.6)  # inches: the width of the book's text column


def _as_array(values) -> np.ndarray:
    """A tensor (detached, on the CPU) or array-like as a NumPy array."""
    return values.detach().cpu().numpy() if hasattr(values, "detach") else np.asarray(values)


def plot_losses(curves: Mapping[str, Sequence[float]], *, steps: Sequence[int] | None = None,
                title: str = "Loss", ylabel: str = "cross-entropy loss (nats)", xlabel: str = "step",
                reference: Mapping[str, float] | None = None):
    """Plot one line per named loss curve (e.g. ``{"train": [...], "validation": [...]}``).

    ``reference`` draws labelled horizontal lines, such as the loss of a uniform guess, ``ln n_V``.
    """
    if not curves:
        raise ValueError("curves must name at least one loss curve")
    fig, ax = plt.subplots(figsize=COLUMN)
    for name, values in curves.items():
        xs = list(steps) if steps is not None else list(range(len(values)))
        if len(xs) != len(values):
            raise ValueError(f"curve {name!r} has {len(values)} values but steps has {len(xs)}")
        ax.plot(xs, list(values), label=name, marker="o" if len(values) < 20 else None)
    for name, y in (reference or {}).items():
        ax.axhline(y, linestyle="--", color="grey", linewidth=1)
        ax.annotate(name, (ax.get_xlim()[0], y), textcoords="offset points", xytext=(4, 4), color="grey")
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def plot_init_comparison(names: Sequence[str], activation_rms: Sequence[float], initial_loss: Sequence[float], *,
                         reference_loss: float | None = None, title: str = "Embedding initialisations at step 0"):
    """Two bar charts side by side: the RMS of the embeddings ``x^(0)`` and the initial loss, per initialisation.

    Both axes are logarithmic (a bad initialisation is off by orders of magnitude). ``reference_loss`` draws the
    loss of a uniform guess, ``ln n_V``, as a dashed line.
    """
    if not names or not len(names) == len(activation_rms) == len(initial_loss):
        raise ValueError(f"names, activation_rms and initial_loss must be non-empty and of equal length, got "
                         f"{len(names)}, {len(activation_rms)}, {len(initial_loss)}")
    fig, (ax_rms, ax_loss) = plt.subplots(1, 2, figsize=(COLUMN[0], COLUMN[1] + 0.6))
    colors = [f"C{i}" for i in range(len(names))]
    ys = list(range(len(names)))
    ax_rms.barh(ys, list(activation_rms), color=colors)
    ax_rms.axvline(1.0, linestyle="--", color="grey", linewidth=1, label="RMS 1")
    ax_rms.set(xscale="log", xlabel="RMS norm of $x^{(0)}$ (mean over tokens)", yticks=ys,
               title="activation scale")
    ax_rms.set_yticklabels(list(names))
    ax_rms.invert_yaxis()
    ax_loss.barh(ys, list(initial_loss), color=colors)
    if reference_loss is not None:
        ax_loss.axvline(reference_loss, linestyle="--", color="black", linewidth=1,
                        label=f"$\\ln n_V$ = {reference_loss:.2f}")
    ax_loss.set(xscale="log", xlabel="initial cross-entropy (nats)", yticks=ys, yticklabels=[],
                title="initial loss", xlim=(min(initial_loss) / 2, max(initial_loss) * 1.5))
    ax_loss.invert_yaxis()
    for ax in (ax_rms, ax_loss):
        ax.legend(loc="lower right", fontsize="small")
        ax.grid(alpha=0.3, axis="x")
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def plot_loss_vs_logit_scale(logit_rms: Sequence[float], losses: Sequence[float], *, vocab_size: int,
                             title: str = "Initial loss against the scale of the logits"):
    """Measured initial losses against the RMS ``s`` of the logits, with the two closed forms of chapter 3.

    Draws ``ln n_V`` (a uniform guess), ``ln n_V + s^2/2`` (small logits) and ``s sqrt(2 ln n_V)`` (large logits,
    where the loss is set by the largest of ``n_V`` Gaussian logits).
    """
    if len(logit_rms) != len(losses) or not losses:
        raise ValueError(f"logit_rms and losses must be non-empty and of equal length, got {len(logit_rms)} and "
                         f"{len(losses)}")
    if not isinstance(vocab_size, int) or vocab_size < 2:
        raise ValueError(f"vocab_size must be an integer >= 2, got {vocab_size!r}")
    ln_v = float(np.log(vocab_size))
    s = np.geomspace(min(logit_rms) / 1.5, max(logit_rms) * 1.5, 200)
    fig, ax = plt.subplots(figsize=COLUMN)
    ax.plot(list(logit_rms), list(losses), "o", color="C0", label="measured")
    ax.plot(s, ln_v + s**2 / 2, color="C1", label=r"$\ln n_V + s^2/2$ (small $s$)")
    ax.plot(s, s * np.sqrt(2 * ln_v), color="C2", linestyle=":", label=r"$s\sqrt{2\ln n_V}$ (large $s$)")
    ax.axhline(ln_v, linestyle="--", color="grey", linewidth=1, label=r"$\ln n_V$ (uniform guess)")
    ax.set(xscale="log", yscale="log", xlabel="RMS $s$ of the logits at initialisation",
           ylabel="initial cross-entropy (nats)", title=title, ylim=(ln_v * 0.8, max(losses) * 2))
    ax.legend(fontsize="small")
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    return fig


def plot_attention(weights, *, queries: Sequence[str] | None = None, keys: Sequence[str] | None = None,
                   title: str = "Attention weights", head_titles: Sequence[str] | None = None,
                   annotate: bool = False):
    """Heat-map(s) of attention weights: rows are queries (the attending positions), columns the keys.

    ``weights`` is ``(n_q, n_k)`` for one map or ``(n_heads, n_q, n_k)`` for one panel per head (a tensor or
    array; a leading batch dimension of 1 is dropped). ``queries`` / ``keys`` label the rows / columns (e.g. the
    tokens); ``annotate`` writes each weight into its cell (for small maps). The colour scale is 0..1.
    """
    w = _as_array(weights)
    if w.ndim == 4 and w.shape[0] == 1:
        w = w[0]
    if w.ndim == 2:
        w = w[None]
    if w.ndim != 3:
        raise ValueError(f"weights must have shape (n_q, n_k) or (n_heads, n_q, n_k), got {tuple(w.shape)}")
    n_heads, n_q, n_k = w.shape
    if queries is not None and len(queries) != n_q:
        raise ValueError(f"queries must have one label per row ({n_q}), got {len(queries)}")
    if keys is not None and len(keys) != n_k:
        raise ValueError(f"keys must have one label per column ({n_k}), got {len(keys)}")
    if head_titles is not None and len(head_titles) != n_heads:
        raise ValueError(f"head_titles must have one title per head ({n_heads}), got {len(head_titles)}")
    width = COLUMN[0] if n_heads == 1 else min(3.2 * n_heads, 13.0)
    fig, axes = plt.subplots(1, n_heads, figsize=(width, COLUMN[1] + 0.4 * (n_heads == 1)), squeeze=False,
                             layout="constrained")
    image = None
    for h, ax in enumerate(axes[0]):
        image = ax.imshow(w[h], cmap="viridis", vmin=0.0, vmax=1.0, aspect="auto")
        ax.set_xticks(range(n_k), labels=list(keys) if keys is not None else range(n_k),
                      rotation=90 if keys is not None else 0)
        ax.set_yticks(range(n_q), labels=list(queries) if queries is not None else range(n_q))
        ax.set_xlabel("key (attended to)")
        if h == 0:
            ax.set_ylabel("query (attending)")
        if head_titles is not None:
            ax.set_title(head_titles[h])
        elif n_heads > 1:
            ax.set_title(f"head {h}")
        if annotate:
            for i in range(n_q):
                for j in range(n_k):
                    ax.text(j, i, f"{w[h, i, j]:.2f}", ha="center", va="center", fontsize=7,
                            color="black" if w[h, i, j] > 0.5 else "white")
    fig.colorbar(image, ax=list(axes[0]), label="attention weight", shrink=0.9)
    fig.suptitle(title)
    return fig


def plot_positional_encoding(table, *, title: str = "Sinusoidal positional encoding", xlabel: str = "dimension",
                             ylabel: str = "position k", colorbar_label: str = "value"):
    """Heat-map of a positional table ``[n_positions, d]`` (one row per position), e.g. ``sinusoidal_encoding``.

    Also draws an additive score bias ``[n, n]`` (one head of ``alibi_bias`` or ``RelativePositionBias``) when
    given suitable labels, e.g. ``xlabel="key position i", ylabel="query position t"``.
    """
    p = _as_array(table)
    if p.ndim != 2:
        raise ValueError(f"table must have shape (n_positions, d), got {tuple(p.shape)}")
    fig, ax = plt.subplots(figsize=COLUMN, layout="constrained")
    limit = float(np.abs(p).max()) or 1.0
    image = ax.imshow(p, cmap="RdBu_r", vmin=-limit, vmax=limit, aspect="auto", interpolation="nearest")
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    fig.colorbar(image, ax=ax, label=colorbar_label)
    return fig


def plot_length_generalisation(accuracy: Mapping[str, Sequence[float | None]], lengths: Sequence[int], *,
                               train_length: int | None = None, title: str = "Accuracy by sequence length",
                               ylabel: str = "accuracy (fraction of tokens)"):
    """One line per method of ``accuracy[name][j]`` at sequence length ``lengths[j]``.

    ``None`` or NaN marks a length a method cannot run at (e.g. a learned table beyond its size): the line stops
    there. ``train_length`` draws a dashed vertical line at the length seen in training.
    """
    if not accuracy:
        raise ValueError("accuracy must name at least one method")
    fig, ax = plt.subplots(figsize=COLUMN, layout="constrained")
    markers = "osD^vP*X"
    for m, (name, values) in enumerate(accuracy.items()):
        if len(values) != len(lengths):
            raise ValueError(f"accuracy[{name!r}] has {len(values)} values but lengths has {len(lengths)}")
        ys = [float("nan") if v is None else float(v) for v in values]
        ax.plot(list(lengths), ys, marker=markers[m % len(markers)], label=name)
    if train_length is not None:
        ax.axvline(train_length, linestyle="--", color="grey", linewidth=1)
        ax.annotate("training length", (train_length, 0.02), textcoords="offset points", xytext=(4, 0),
                    color="grey")
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(lengths), labels=[str(n) for n in lengths])
    ax.set(title=title, xlabel="sequence length (tokens)", ylabel=ylabel, ylim=(0, 1.05))
    ax.legend(fontsize=8, loc="lower left", bbox_to_anchor=(1.0, 0.0))
    ax.grid(alpha=0.3)
    return fig


def plot_gradient_norms(curves: Mapping[str, Sequence[float]], *, xs: Sequence[int] | None = None,
                        title: str = "Gradient norm per layer at initialisation", xlabel: str = "layer ℓ",
                        ylabel: str = "gradient norm (L2, log scale)", logx: bool = False):
    """One line per named curve of gradient norms (e.g. ``{"Post-LN": [...], "Pre-LN": [...]}``), log y axis.

    ``xs`` defaults to the layer numbers 1, 2, ...; ``logx`` puts the x axis on a log-2 scale (for depths).
    """
    if not curves:
        raise ValueError("curves must name at least one curve of gradient norms")
    fig, ax = plt.subplots(figsize=COLUMN, layout="constrained")
    markers = "osD^v"
    for m, (name, values) in enumerate(curves.items()):
        x = list(xs) if xs is not None else list(range(1, len(values) + 1))
        if len(x) != len(values):
            raise ValueError(f"curve {name!r} has {len(values)} values but xs has {len(x)}")
        ax.plot(x, list(values), marker=markers[m % len(markers)], markersize=4, label=name)
    ax.set_yscale("log")
    if logx:
        ax.set_xscale("log", base=2)
        ax.set_xticks(x, labels=[str(v) for v in x])
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    ax.legend()
    ax.grid(alpha=0.3, which="both")
    return fig


# ---- chapter 3: excess initial loss, training bands over seeds, word-embedding projection --------------------


def plot_excess_loss_vs_logit_scale(logit_rms: Sequence[float], losses: Sequence[float], *, vocab_size: int,
                                    expected_max: float | None = None,
                                    title: str = "Initial loss above the uniform guess"):
    """The initial loss minus ``ln n_V`` against the RMS ``s`` of the logits, both axes logarithmic.

    Subtracting ``ln n_V`` keeps the small-``s`` end visible (there the loss itself is nearly ``ln n_V``). Drawn with
    the closed forms of chapter 3: ``s^2/2`` (small logits), ``s sqrt(2 ln n_V) - ln n_V`` (large logits, asymptotic
    size of the largest of ``n_V`` Gaussians) and, when ``expected_max`` (the expected largest of ``n_V`` standard
    Gaussians) is given, ``s * expected_max - ln n_V`` (large logits, finite vocabulary). A closed form is drawn only
    where it is positive.
    """
    if len(logit_rms) != len(losses) or not losses:
        raise ValueError(f"logit_rms and losses must be non-empty and of equal length, got {len(logit_rms)} and "
                         f"{len(losses)}")
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 2:
        raise ValueError(f"vocab_size must be an integer >= 2, got {vocab_size!r}")
    ln_v = float(np.log(vocab_size))
    excess = _as_array(losses) - ln_v
    if (excess <= 0).any():
        raise ValueError(f"every loss must exceed ln n_V = {ln_v:.4f} to be drawn on a log axis, got {list(losses)}")
    s = np.geomspace(min(logit_rms) / 1.5, max(logit_rms) * 1.5, 200)
    fig, ax = plt.subplots(figsize=COLUMN, layout="constrained")
    ax.plot(s, s**2 / 2, color="C1", label=r"$s^2/2$ (small $s$)")
    large = s * np.sqrt(2 * ln_v) - ln_v
    ax.plot(s[large > 0], large[large > 0], color="C2", linestyle=":",
            label=r"$s\sqrt{2\ln n_V} - \ln n_V$ (large $s$, asymptotic)")
    if expected_max is not None:
        finite = s * expected_max - ln_v
        ax.plot(s[finite > 0], finite[finite > 0], color="C3", linestyle="--",
                label=rf"$s \cdot {expected_max:.3f} - \ln n_V$ (large $s$, $n_V = {vocab_size}$)")
    ax.plot(list(logit_rms), list(excess), "o", color="C0", label="measured", zorder=3)
    ax.set(xscale="log", yscale="log", xlabel="RMS $s$ of the logits at initialisation",
           ylabel=r"initial loss $-\ln n_V$ (nats)", title=title)
    ax.legend(fontsize="small")
    ax.grid(alpha=0.3, which="both")
    return fig


def plot_seed_bands(panels: Mapping[str, Mapping[str, Sequence[Sequence[float]]]], steps: Sequence[int], *,
                    ylabel: str = "validation loss (nats)", xlabel: str = "training step",
                    title: str = "Training curves over seeds", ylim: tuple[float, float] | None = None,
                    sharey: bool = True):
    """One panel per entry of ``panels``; in each, one line per named run: the mean over seeds with a min-max band.

    ``panels[panel][name]`` is a list of curves (one per seed), each with one value per entry of ``steps``. Lines get
    different styles as well as colours, so a curve lying on top of another stays visible. ``sharey=False`` lets
    the panels have their own y axes (e.g. the full range on a log scale beside a linear zoom).
    """
    if not panels or not all(panels.values()):
        raise ValueError("panels must name at least one panel, each with at least one run")
    fig, axes = plt.subplots(1, len(panels), figsize=(COLUMN[0], COLUMN[1] + (0.3 if len(panels) == 1 else 0.8)),
                             sharey=sharey, squeeze=False,
                             layout="constrained")
    styles = ["-", "--", ":", "-."]
    for ax, (panel, runs) in zip(axes[0], panels.items()):
        for k, (name, curves) in enumerate(runs.items()):
            y = np.array([list(c) for c in curves], dtype=float)
            if y.ndim != 2 or y.shape[1] != len(steps):
                raise ValueError(f"run {name!r} of panel {panel!r} must be a list of curves with {len(steps)} values "
                                 f"each (one per step), got shape {y.shape}")
            ax.plot(list(steps), y.mean(axis=0), color=f"C{k}", linestyle=styles[k % len(styles)],
                    label=f"{name} (mean of {len(y)})")
            ax.fill_between(list(steps), y.min(axis=0), y.max(axis=0), color=f"C{k}", alpha=0.2, linewidth=0)
        ax.set(title=panel, xlabel=xlabel)
        if ylim is not None:
            ax.set_ylim(*ylim)
        ax.grid(alpha=0.3)
        if not sharey:
            ax.set_ylabel(ylabel)
    axes[0][0].set_ylabel(ylabel)
    if len(panels) == 1:
        axes[0][0].legend(fontsize="small")
    else:  # below the panels, where it hides no curve
        handles, labels = axes[0][0].get_legend_handles_labels()
        fig.legend(handles, labels, loc="outside lower center", ncol=min(len(labels), 3), fontsize="small")
    fig.suptitle(title)
    return fig


def plot_embedding_projection(points: Mapping[str, Sequence[float]], groups: Mapping[str, Sequence[str]], *,
                              title: str = "Word embeddings projected on two principal components",
                              xlabel: str = "principal component 1", ylabel: str = "principal component 2"):
    """A labelled scatter plot of 2-D points (e.g. a PCA of word vectors), one colour and marker per group.

    ``points`` maps each word to its ``(x, y)``; ``groups`` maps a group name to its words (each must be in
    ``points``).
    """
    if not groups:
        raise ValueError("groups must name at least one group of words")
    missing = [w for words in groups.values() for w in words if w not in points]
    if missing:
        raise ValueError(f"these words of groups have no point: {missing}")
    fig, ax = plt.subplots(figsize=(COLUMN[0], COLUMN[1] + 1.0), layout="constrained")
    markers = "os^Dv<>"
    for k, (name, words) in enumerate(groups.items()):
        xy = np.array([list(points[w]) for w in words], dtype=float)
        ax.scatter(xy[:, 0], xy[:, 1], color=f"C{k}", marker=markers[k % len(markers)], label=name)
        for w, (x, y) in zip(words, xy):
            ax.annotate(w, (x, y), xytext=(3, 3), textcoords="offset points", fontsize=8, color=f"C{k}")
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    ax.legend(fontsize="small")
    ax.grid(alpha=0.3)
    return fig


# ---- chapter 2: a tokenization as coloured spans -------------------------------------------------------------------

SPAN_COLORS = ("#c6dbef", "#fdd0a2")  # pale blue, pale orange: neighbouring tokens alternate
VISIBLE = {" ": "\u2423", "\n": "\u21b5", "\t": "\u21e5"}  # space, newline, tab drawn as ␣ ↵ ⇥
MONO_ADVANCE = 0.66  # one character cell, in font sizes: DejaVu Sans Mono advances 0.602, rounded up for hinting
ID_SCALE = 0.75  # token ids are written at this fraction of the tokens' font size
SPAN_PAD = 0.3  # padding inside each box, in character cells


def _shown(piece: str) -> str:
    """A token as drawn: whitespace made visible."""
    return "".join(VISIBLE.get(c, c) for c in piece)


def _cells(text: str) -> int:
    """The width of text in monospace character cells (East Asian wide characters take two)."""
    return sum(2 if unicodedata.east_asian_width(c) in "WF" else 1 for c in text)


def _span_widths(pieces: Sequence[str], ids: Sequence[int] | None) -> list[float]:
    """Each token's box width in character cells: its text or its id (smaller font), whichever is wider, + padding."""
    if isinstance(pieces, str) or not all(isinstance(p, str) for p in pieces):
        raise TypeError(f"pieces must be a list of strings (the tokens' text), got {pieces!r:.80}")
    if ids is not None and len(ids) != len(pieces):
        raise ValueError(f"ids must have one id per piece ({len(pieces)}), got {len(ids)}")
    return [max(_cells(_shown(p)), ID_SCALE * len(str(i)) if ids is not None else 0) + SPAN_PAD
            for p, i in zip(pieces, ids if ids is not None else [None] * len(pieces))]


def token_spans(ax, pieces: Sequence[str], *, ids: Sequence[int] | None = None, y: float = 0.0,
                fontsize: float = 9.0, height: float = 0.6, colors: Sequence[str] = SPAN_COLORS) -> float:
    """Draw one tokenization on ``ax``: a row of boxes, one per token, in alternating colours, centred at height
    ``y``, with each token's text inside its box and, when ``ids`` is given, its id below it.

    x is measured in character cells: a box is as wide as its text (or its id, in a smaller font) plus padding, so
    the text fits when one x unit is one character at ``fontsize`` (``plot_token_spans`` sizes its axes so).
    Spaces, newlines and tabs are drawn as ␣, ↵ and ⇥. Returns the row's width in cells.
    """
    widths = _span_widths(pieces, ids)
    x = 0.0
    for k, (piece, width) in enumerate(zip(pieces, widths)):
        ax.add_patch(Rectangle((x, y - height / 2), width, height, facecolor=colors[k % len(colors)],
                               edgecolor="white", linewidth=1.0))
        ax.text(x + width / 2, y, _shown(piece), ha="center", va="center", fontsize=fontsize,
                fontfamily="DejaVu Sans Mono")
        if ids is not None:
            ax.text(x + width / 2, y - 0.55 * height, str(ids[k]), ha="center", va="top",
                    fontsize=fontsize * ID_SCALE, fontfamily="DejaVu Sans Mono", color="0.35")
        x += width
    return x


def plot_token_spans(rows: Mapping[str, Sequence[str]], *, ids: Mapping[str, Sequence[int]] | None = None,
                     title: str | None = None, fontsize: float = 9.0, width: float = COLUMN[0]):
    """Tokenizations one above the other, each a row of coloured boxes (``token_spans``) under its label.

    ``rows`` maps a label (e.g. "characters: 42 tokens") to the tokens' text, in order; ``ids`` maps some of those
    labels to the tokens' ids, written below the boxes. The font shrinks from ``fontsize`` if the longest row would
    not fit in ``width`` inches.
    """
    if not rows:
        raise ValueError("rows must name at least one tokenization")
    ids = dict(ids or {})
    unknown = sorted(set(ids) - set(rows))
    if unknown:
        raise ValueError(f"ids has labels that rows lacks: {unknown}")
    cells = max([sum(_span_widths(pieces, ids.get(label))) for label, pieces in rows.items()] + [1.0])
    avail_in = width - 0.2
    fontsize = min(fontsize, avail_in * 72 / (cells * MONO_ADVANCE))
    line_in = fontsize / 72
    # per row, from the top: its label (9 pt), the boxes (1.5 lines high), the ids, a gap
    label_in, box_in, ids_in, gap_in = 1.4 * 9 / 72, 1.5 * line_in, 1.2 * line_in, 0.5 * line_in
    row_in = label_in + box_in + (ids_in if ids else 0.0) + gap_in
    top_in = 0.35 if title else 0.05
    height_in = len(rows) * row_in + top_in
    fig = plt.figure(figsize=(width, height_in))
    ax = fig.add_axes((0.1 / width, 0.0, avail_in / width, len(rows) * row_in / height_in))
    ax.set_xlim(0, avail_in * 72 / (fontsize * MONO_ADVANCE))
    ax.set_ylim(0, len(rows) * row_in)  # y in inches, from the bottom
    for i, (label, pieces) in enumerate(rows.items()):
        top = (len(rows) - i) * row_in
        ax.text(0, top, label, ha="left", va="top", fontsize=9, color="0.2")
        token_spans(ax, pieces, ids=ids.get(label), y=top - label_in - box_in / 2, fontsize=fontsize,
                    height=box_in)
    ax.set_axis_off()
    if title:
        fig.suptitle(title, fontsize=10, y=1 - 0.05 / height_in, va="top")
    return fig


# ---- chapter 4: accuracy by position over seeds -------------------------------------------------------------------


def plot_accuracy_by_position(panels: Mapping[str, Mapping[str, Sequence[Sequence[float]]]], edges: Sequence[int], *,
                              chance: float | None = None, train_length: int | None = None,
                              title: str = "Accuracy by position", xlabel: str = "position $t$",
                              ylabel: str = "accuracy"):
    """One panel per entry of ``panels``; in each, one step line per method: the accuracy over each range of
    positions ``edges[j] <= t < edges[j + 1]``, thin for each seed and thick for the mean over seeds (a method with
    a single run gets only the thick line, labelled with its name).

    ``panels[panel][method]`` is a list of runs (one per seed), each with ``len(edges) - 1`` values. ``chance`` draws
    a dashed horizontal line, ``train_length`` a dotted vertical one at the length seen in training.
    """
    if not panels or not all(panels.values()):
        raise ValueError("panels must name at least one panel, each with at least one method")
    if len(edges) < 2 or any(b <= a for a, b in zip(edges, edges[1:])):
        raise ValueError(f"edges must be at least two increasing positions, got {list(edges)}")
    fig, axes = plt.subplots(1, len(panels), figsize=(COLUMN[0], COLUMN[1] + (0.3 if len(panels) == 1 else 0.6)),
                             sharey=True, squeeze=False, layout="constrained")
    styles = ["-", "--", ":", "-.", (0, (5, 1, 1, 1, 1, 1))]  # a fifth method stays apart from the first
    for ax, (panel, methods) in zip(axes[0], panels.items()):
        for k, (method, runs) in enumerate(methods.items()):
            acc = np.array([list(r) for r in runs], dtype=float)
            if acc.ndim != 2 or acc.shape[1] != len(edges) - 1:
                raise ValueError(f"method {method!r} of panel {panel!r} must be a list of runs with {len(edges) - 1} "
                                 f"values each (one per range of positions), got shape {acc.shape}")
            for run in acc if len(acc) > 1 else ():
                ax.stairs(run, list(edges), baseline=None, color=f"C{k}", linewidth=0.8, alpha=0.45)
            ax.stairs(acc.mean(axis=0), list(edges), baseline=None, color=f"C{k}", linewidth=2.2,
                      linestyle=styles[k % len(styles)],
                      label=method if len(acc) == 1 else f"{method} (mean of {len(acc)})")
        if chance is not None:
            ax.axhline(chance, color="grey", linestyle="--", linewidth=1, label=f"chance ({chance:.2f})")
        if train_length is not None:
            ax.axvline(train_length, color="grey", linestyle=":", linewidth=1)
        ax.set(title=panel, xlabel=xlabel, ylim=(0, 1.05), xlim=(0, edges[-1]))
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel(ylabel)
    handles, labels = axes[0][0].get_legend_handles_labels()
    if len(panels) == 1:
        axes[0][0].legend(handles, labels, fontsize="small")
    else:
        fig.legend(handles, labels, loc="outside lower center", ncol=min(len(labels), 4), fontsize="small")
    fig.suptitle(title)
    return fig


def plot_head_statistics(stats: Mapping[str, object], *, reference: Mapping[str, float] | None = None,
                         reference_label: str = "even spread", units: Mapping[str, str] | None = None,
                         decimals: int = 2, title: str = "Attention heads"):
    """One heat-map per statistic of the attention heads, layers down and heads across, each value written in its
    cell; panels two to a row, each with its own colour scale and colour bar.

    ``stats[name]`` is an ``(n_layers, n_heads)`` tensor or array; ``name`` is the panel's title. A panel named in
    ``reference`` (``{name: level}``) is coloured by a red-white-blue scale with white at the level, symmetric about
    it (red above, blue below), and the level is marked on its colour bar and written in its title as
    ``reference_label``. ``units[name]`` labels a colour bar. Layers and heads are numbered from 1.
    """
    if not stats:
        raise ValueError("stats must name at least one statistic")
    values = {name: np.asarray(_as_array(v), dtype=float) for name, v in stats.items()}
    shapes = {name: v.shape for name, v in values.items()}
    first = next(iter(shapes.values()))
    if len(first) != 2 or any(shape != first for shape in shapes.values()):
        raise ValueError(f"every statistic must be one (n_layers, n_heads) table of the same shape, got {shapes}")
    unknown = sorted(set(reference or {}) - set(values))
    if unknown:
        raise ValueError(f"reference names {unknown}, which are not among the statistics {list(values)}")
    n_layers, n_heads = first
    ncols = min(2, len(values))
    nrows = -(-len(values) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(COLUMN[0], 0.55 * n_layers * nrows + 0.6), squeeze=False,
                             layout="constrained")
    for ax, (name, v) in zip(axes.flat, values.items()):
        level = float(reference[name]) if name in (reference or {}) else None  # a 0-d tensor too
        if level is None:
            cmap = plt.get_cmap("viridis")
            norm = plt.Normalize(min(0.0, v.min()), v.max() if v.max() > min(0.0, v.min()) else 1.0)
        else:
            half = float(np.abs(v - level).max()) or 1.0
            cmap, norm = plt.get_cmap("RdBu_r"), plt.Normalize(level - half, level + half)
        image = ax.imshow(v, cmap=cmap, norm=norm, aspect="auto")
        for i in range(n_layers):
            for j in range(n_heads):
                r, g, b, _ = cmap(norm(v[i, j]))
                ax.text(j, i, f"{v[i, j]:.{decimals}f}", ha="center", va="center", fontsize=8,
                        color="black" if 0.299 * r + 0.587 * g + 0.114 * b > 0.5 else "white")
        ax.set_xticks(range(n_heads), labels=[str(h + 1) for h in range(n_heads)])
        ax.set_yticks(range(n_layers), labels=[str(layer + 1) for layer in range(n_layers)])
        ax.set_xlabel("head", fontsize=8)
        ax.set_ylabel("layer", fontsize=8)
        ax.tick_params(labelsize=8, length=0)
        bar = fig.colorbar(image, ax=ax, shrink=0.9)
        bar.ax.tick_params(labelsize=7)
        if (units or {}).get(name):
            bar.set_label(units[name], fontsize=8)
        if level is not None:
            bar.ax.set_ylim(min(v.min(), level), max(v.max(), level))  # the scale's span beyond the data is unused
            bar.ax.axhline(level, color="black", linewidth=1.2)
            name = f"{name}\n(white: {reference_label}, {level:.{decimals}f})"
        ax.set_title(name, fontsize=9)
    for ax in list(axes.flat)[len(values):]:
        ax.set_visible(False)
    fig.suptitle(title, fontsize=10)
    return fig


# ---- schematic diagrams drawn at run time: data parallelism (ch 11), tensor names (ch 12) -------------------------
# The look of the stored diagrams of tools/make_diagrams.py (groundup.diagrams): a canvas measured in units of half an
# inch, DejaVu Sans at 8 pt, Computer Modern maths, rounded boxes filled by kind. These two are drawn when the
# notebook runs because what they show comes from the package (the loaders' name tables) or from an argument (p).

DIAGRAM_UNIT = 0.5  # inches per drawing unit, as in tools/make_diagrams.py
DIAGRAM_INK = "#222222"
DIAGRAM_COLORS = {  # (fill, edge) per kind of part, in every diagram (tools/make_diagrams.py imports it)
    "attention": ("#cfe2f3", "#3d6b99"),
    "cross": ("#f4cccc", "#a64d4d"),
    "norm": ("#ececec", "#666666"),
    "ffn": ("#d9ead3", "#4e7d43"),
    "embed": ("#fde9c9", "#a87a2f"),
    "unembed": ("#ead1dc", "#8a4f6b"),
    "memory": ("#fff2cc", "#a88c2f"),
    "tensor": ("#ffffff", "#7f7f7f"),
    "mask": ("#f7f7f7", "#7f7f7f"),
}
PROCESS_COLORS = ("#4c78a8", "#f58518", "#54a24b", "#b279a2", "#e45756", "#72b7b2")  # one per process (the heads')
MONO = "DejaVu Sans Mono"


def _canvas(width: float, height: float):
    """A figure ``width`` x ``height`` units with one frameless axes filling it, data coordinates in units."""
    fig = plt.figure(figsize=(width * DIAGRAM_UNIT, height * DIAGRAM_UNIT))
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set(xlim=(0, width), ylim=(0, height), aspect="equal")
    ax.axis("off")
    return fig, ax


def _label(ax, x, y, s, *, size=8.0, ha="center", va="center", color=DIAGRAM_INK, family="DejaVu Sans", **kw):
    """Text in the diagrams' fonts (maths in Computer Modern, whatever the rcParams say)."""
    return ax.text(x, y, s, ha=ha, va=va, fontsize=size, color=color, family=family, math_fontfamily="cm",
                   linespacing=1.35, zorder=5, **kw)


def _box(ax, x, y, w, h, text="", kind="tensor", *, size=8.0, family="DejaVu Sans", dashed=False):
    """A rounded box centred at (x, y), filled with the colour of its kind, with centred text (dashed: a frame)."""
    from matplotlib.patches import FancyBboxPatch

    fill, edge = DIAGRAM_COLORS[kind]
    ax.add_patch(FancyBboxPatch((x - w / 2, y - h / 2), w, h, boxstyle="round,pad=0,rounding_size=0.12",
                                facecolor="none" if dashed else fill, edgecolor=edge, linewidth=0.9,
                                zorder=2, linestyle=(0, (3, 2)) if dashed else "solid"))
    if text:
        _label(ax, x, y, text, size=size, family=family)


def _arrow(ax, a, b, *, color=DIAGRAM_INK, lw=0.9, style="-|>", connection=None):
    """An arrow from point a to point b (optionally bent: a matplotlib connection style)."""
    from matplotlib.patches import FancyArrowPatch

    ax.add_patch(FancyArrowPatch(a, b, arrowstyle=style, mutation_scale=9, shrinkA=0, shrinkB=0, color=color,
                                 linewidth=lw, connectionstyle=connection, zorder=1))


def _chunks(ax, x, y, width, height, colors_of_chunk, gid: str):
    """A gradient as a row of chunks centred at (x, y): chunk k is striped with the colours ``colors_of_chunk[k]``
    (one colour: one process's numbers; p colours: the sum over all processes; none: partial sums, grey). Chunk
    k's outline carries the id ``{gid}:{k}:{number of colours}``, so a test can read what the picture shows."""
    n = len(colors_of_chunk)
    w = width / n
    for k, colors in enumerate(colors_of_chunk):
        x0 = x - width / 2 + k * w
        stripes = colors or ["#dddddd"]
        for j, color in enumerate(stripes):
            ax.add_patch(Rectangle((x0 + j * w / len(stripes), y - height / 2), w / len(stripes), height,
                                   facecolor=color, edgecolor="none", alpha=0.85, zorder=2))
        ax.add_patch(Rectangle((x0, y - height / 2), w, height, facecolor="none", edgecolor="#555555",
                               linewidth=0.6, zorder=3, gid=f"{gid}:{k}:{len(colors or [])}"))


def _ring_row(ax, xs, y, strip, lane):
    """The ring's links at height y: process r sends to r + 1, the last one back to the first over ``lane``."""
    for a, b in zip(xs, xs[1:]):
        _arrow(ax, (a + strip / 2 + 0.08, y), (b - strip / 2 - 0.08, y))
    right, left = xs[-1] + strip / 2 + 0.08, xs[0] - strip / 2 - 0.08
    ax.plot([right, right + 0.25, right + 0.25, left - 0.25, left - 0.25], [y, y, lane, lane, y],
            color=DIAGRAM_INK, linewidth=0.9, zorder=1, solid_joinstyle="miter")
    _arrow(ax, (left - 0.25, y), (left, y))


def plot_data_parallel(n_processes: int = 3):
    """Data-parallel training, one step, as chapter 11 derives and runs it, for ``n_processes`` = p processes.

    From the top: one batch of B windows, cut into p shards S_1 … S_p; every process holds a full copy of the
    model θ and runs forward and backward on its shard, giving its loss L_r and gradient g_r (11.2); the ring
    all-reduce (reduce-scatter, then all-gather, p − 1 steps each) leaves the sum of all g_r in every process, each
    having sent 2(p − 1)/p · N b bytes (11.5); divided by p that is the gradient of the whole batch (11.3), and
    every process makes the same AdamW step. Each gradient is drawn as p chunks in its process's colour; a summed
    chunk is striped with all p colours; a grey chunk holds partial sums that the all-gather overwrites.
    """
    if isinstance(n_processes, bool) or not isinstance(n_processes, int) or not 2 <= n_processes <= 6:
        raise ValueError(f"n_processes must be an integer from 2 to 6 (the diagram's columns), got {n_processes!r}")
    p = n_processes
    width, height, left = 13.6, 11.4, 2.9
    fig, ax = _canvas(width, height)
    col = (width - left - 0.3) / p
    xs = [left + col * (r + 0.5) for r in range(p)]
    box_w, strip = col - 0.35, min(col - 0.9, 2.2)
    colors = PROCESS_COLORS[:p]
    _label(ax, 0.2, height - 0.2, f"Data-parallel training: one step on $p = {p}$ processes", size=9.5, ha="left",
           va="top", fontweight="bold")
    rows = {"batch": 9.9, "model": 8.8, "backward": 7.7, "grad": 6.65, "scatter": 5.35, "gather": 4.05,
            "average": 2.45, "step": 1.35}
    stage = {"batch": "one batch of $B$ windows,\ncut into $p$ shards",
             "model": "every process: a full\ncopy of the model",
             "backward": "forward and backward\non its own shard",
             "grad": "its gradient $\\mathbf{g}_r$,\nin $p$ chunks of $N/p$",
             "scatter": "all-reduce, part 1:\nreduce-scatter,\n$p - 1$ steps",
             "gather": "all-reduce, part 2:\nall-gather,\n$p - 1$ steps",
             "average": "divide by $p$",
             "step": "the same step\nin every process"}
    for key, text in stage.items():
        _label(ax, 0.2, rows[key], text, size=7.5, ha="left", color="#555555", style="italic")
    for r, (x, color) in enumerate(zip(xs, colors), start=1):  # the batch, cut into shards; each process alone
        ax.add_patch(Rectangle((x - col / 2 + 0.04, rows["batch"] - 0.3), col - 0.08, 0.6, facecolor=color,
                               alpha=0.3, edgecolor=color, linewidth=0.9, zorder=2))
        _label(ax, x, rows["batch"], f"shard $S_{r}$: $B/p$ rows")
        _arrow(ax, (x, rows["batch"] - 0.32), (x, rows["model"] + 0.36))
        _box(ax, x, rows["model"], box_w, 0.7, f"process {r}: model $\\theta$", "embed")
        _arrow(ax, (x, rows["model"] - 0.36), (x, rows["backward"] + 0.36))
        _box(ax, x, rows["backward"], box_w, 0.7, f"loss $\\mathcal{{L}}_{r}$ (11.2), gradient $\\mathbf{{g}}_{r}$",
             "ffn")
        _arrow(ax, (x, rows["backward"] - 0.36), (x, rows["grad"] + 0.22))
        _chunks(ax, x, rows["grad"], strip, 0.4, [[color]] * p, f"gradient:{r}")
        _label(ax, x - strip / 2 - 0.12, rows["grad"], f"$\\mathbf{{g}}_{r}$", ha="right")
    middle = left + (width - left - 0.3) / 2
    _box(ax, middle, (rows["scatter"] + rows["gather"]) / 2 - 0.2, width - left - 0.2, 3.05, "", "tensor",
         dashed=True)  # the ring all-reduce, in a dashed frame
    for r, x in enumerate(xs):
        owned = (r + 1) % p  # after reduce-scatter, process r holds chunk r + 1 summed (Exercise 11.1's ring)
        _chunks(ax, x, rows["scatter"], strip, 0.4, [list(colors) if k == owned else None for k in range(p)],
                f"reduce-scatter:{r + 1}")
        _chunks(ax, x, rows["gather"], strip, 0.4, [list(colors)] * p, f"all-gather:{r + 1}")
        _arrow(ax, (x, rows["grad"] - 0.22), (x, rows["scatter"] + 0.22), connection="arc3,rad=0")
        _arrow(ax, (x, rows["gather"] - 0.22), (x, rows["average"] + 0.36))
    _ring_row(ax, xs, rows["scatter"], strip, rows["scatter"] + 0.45)
    _ring_row(ax, xs, rows["gather"], strip, rows["gather"] + 0.45)
    _label(ax, middle, rows["gather"] - 0.75, "every process sends $2(p-1)$ chunks of $N/p$ numbers of $b$ bytes: "
           "$2(p-1)\\,N\\,b\\,/\\,p$ bytes (11.5)", size=7.5,
           bbox={"facecolor": "white", "edgecolor": "none", "pad": 1.0})
    for x in xs:  # the same average and the same step everywhere
        _box(ax, x, rows["average"], box_w, 0.7,
             "$\\frac{1}{p}\\sum_r \\mathbf{g}_r = \\nabla_\\theta \\mathcal{L}$ (11.3)", "memory")
        _arrow(ax, (x, rows["average"] - 0.36), (x, rows["step"] + 0.36))
        _box(ax, x, rows["step"], box_w, 0.7, "AdamW: the same new $\\theta$", "embed")
    _label(ax, 0.2, 0.35, "Chunks: one colour, one process's numbers; striped, the sum over all $p$ processes; "
           "grey, partial sums that the all-gather overwrites.", size=7, ha="left", color="#555555")
    return fig


BLOCK_ORDER = ("norm_1", "attention.W_q", "attention.W_k", "attention.W_v", "attention.W_o", "norm_2", "ffn.W_gate",
               "ffn.W_in", "ffn.W_out")
"""The modules of a block of the book's ``GPT``, in its own order (for sorting the rows; any other module follows)."""
BLOCK_SYMBOLS = {"norm_1": r"$\gamma, \beta$ of norm 1", "attention.W_q": r"$\mathbf{W}_Q$",
                 "attention.W_k": r"$\mathbf{W}_K$", "attention.W_v": r"$\mathbf{W}_V$",
                 "attention.W_o": r"$\mathbf{W}_O$", "norm_2": r"$\gamma, \beta$ of norm 2",
                 "ffn.W_gate": r"$\mathbf{W}_\mathrm{gate}$",
                 "ffn.W_in": r"$\mathbf{W}_\mathrm{in}$ or $\mathbf{W}_\mathrm{up}$",
                 "ffn.W_out": r"$\mathbf{W}_\mathrm{out}$ or $\mathbf{W}_\mathrm{down}$"}
"""The chapters' symbol for each module of a block (chapter 12 writes W_up, W_down for LLaMA's W_in, W_out)."""
_SUFFIXES = (".weight", ".bias")


def _module(name: str, prefix: str, where: str) -> tuple[str, str]:
    """``prefix`` + module + ``.weight``/``.bias`` -> (module, suffix)."""
    for suffix in _SUFFIXES:
        if name.startswith(prefix) and name.endswith(suffix):
            return name[len(prefix):-len(suffix)], suffix
    raise ValueError(f"{where}: tensor name {name!r} is not {prefix!r} + a module + .weight or .bias")


def _block_prefix(names, layer: int, column: str) -> str:
    """The part of a checkpoint's names before block ``layer``'s modules, e.g. ``transformer.h.0.``."""
    import re

    found = {m.group(1) for m in (re.match(rf"^((?:[^.]+\.)*?{layer}\.)", n) for n in names) if m}
    if len(found) != 1:
        raise ValueError(f"column {column!r}: block {layer}'s tensor names must share one prefix ending in "
                         f"'{layer}.', found {sorted(found)}")
    return found.pop()


def tensor_name_rows(columns: Mapping[str, Mapping[str, str]], *, layer: int = 0):
    """The tensor-name map of one block, row by row, from loaders' name tables.

    ``columns`` maps a column title to a loader's table, our parameter name -> the checkpoint's tensor name (the
    second value of :func:`groundup.pretrained.gpt2_state_dict` or ``llama_state_dict``, or
    :func:`groundup.pretrained.gguf_tensor_names`). Only block ``layer`` is kept. Returns ``(rows, prefixes,
    suffixes)``: ``rows`` is a list of ``(our module, (the module's name in each column, or None))``, in the block's
    order (``BLOCK_ORDER``); ``prefixes[column]`` is what precedes a module's name there (``transformer.h.0.``) and
    ``suffixes[column]`` the endings it has (``(".weight", ".bias")``). A module whose ``.weight`` and ``.bias``
    come from different modules of a checkpoint is refused.
    """
    if not columns:
        raise ValueError("columns must name at least one loader table")
    ours_prefix = f"blocks.{layer}."
    found: dict[str, dict[str, str]] = {}
    prefixes, suffixes = {}, {}
    for column, table in columns.items():
        block = {ours: theirs for ours, theirs in table.items() if ours.startswith(ours_prefix)}
        if not block:
            raise ValueError(f"column {column!r} has no tensor of block {layer} (no name starts with {ours_prefix!r})")
        prefixes[column] = prefix = _block_prefix(block.values(), layer, column)
        ends = set()
        for ours, theirs in block.items():
            module, suffix = _module(ours, ours_prefix, f"column {column!r}")
            their_module, their_suffix = _module(theirs, prefix, f"column {column!r}")
            ends.add(their_suffix)
            if found.setdefault(module, {}).setdefault(column, their_module) != their_module:
                raise ValueError(f"column {column!r}: {module}'s weight and bias come from different tensors "
                                 f"({found[module][column]!r}, {their_module!r})")
        suffixes[column] = tuple(s for s in _SUFFIXES if s in ends)
    order = sorted(found, key=lambda m: (BLOCK_ORDER.index(m) if m in BLOCK_ORDER else len(BLOCK_ORDER), m))
    rows = [(module, tuple(found[module].get(column) for column in columns)) for module in order]
    return rows, prefixes, suffixes


def _conversion(value, source) -> str | None:
    """How ``value`` was made from ``source``: copied (""), transposed, split (a slice along the first axis) or
    split and transposed; None if it is none of these."""
    import torch

    for kind, whole in (("", source), ("transposed", source.t() if source.dim() == 2 else None)):
        if whole is None or whole.shape[1:] != value.shape[1:] or whole.shape[0] % value.shape[0]:
            continue
        if any(torch.equal(value, part) for part in whole.split(value.shape[0])):
            return ", ".join(w for w in ("split" if whole.shape[0] > value.shape[0] else "", kind) if w)
    return None


def loader_conversions(state: Mapping, tensors: Mapping, sources: Mapping[str, str]) -> dict[str, str]:
    """What a loader did to each tensor, found from the values: our name -> ``""`` (copied), ``"transposed"``,
    ``"split"`` (a slice of the checkpoint's tensor) or ``"split, transposed"``.

    ``state`` and ``sources`` are what a loader returns (our name -> tensor, our name -> the checkpoint's name) and
    ``tensors`` the checkpoint's tensors under those names. With random weights a transposed or sliced copy cannot
    pass for another; a tensor that is none of these is refused.
    """
    found = {}
    for ours, theirs in sources.items():
        if ours not in state or theirs not in tensors:
            raise ValueError(f"sources maps {ours!r} to {theirs!r}, but state or tensors lacks it")
        kind = _conversion(state[ours], tensors[theirs])
        if kind is None:
            raise ValueError(f"{ours} is not {theirs!r} copied, transposed or sliced")
        found[ours] = kind
    return found


def _mono_width(names, size: float) -> float:
    """The width in diagram units of the longest of ``names`` in DejaVu Sans Mono at ``size`` points."""
    return max([len(n) for n in names if n] + [1]) * MONO_ADVANCE * size / 72 / DIAGRAM_UNIT


def _name_columns_x(order, box_ws, noted) -> tuple[list[float], list[float]]:
    """The centre x and the width of each column: its boxes or its bold title, whichever is wider; the spare width
    goes to the gaps, two and a half times as much to a gap whose lines carry notes."""
    widths = [max(b, len(t or "the book") * 0.62 * 8 / 72 / DIAGRAM_UNIT + 0.1) for t, b in zip(order, box_ws)]
    spare = 13.6 - 0.4 - sum(widths)
    weights = [2.5 if n else 1.0 for n in noted]
    if spare < 0.5 * len(noted):
        raise ValueError("the names are too long for the book's column: use fewer columns")
    xs, x = [], 0.2
    for w, g in zip(widths, [spare * w_ / sum(weights) for w_ in weights] + [0.0]):
        xs.append(x + w / 2)
        x += w + g
    return xs, widths


def _book_column(ax, rows, x, w, y_of, row_h, size, header):
    """The book's column: each module's symbol over its attribute, coloured as the diagrams colour its kind."""
    _label(ax, x, header + 0.75, "the book", size=8, fontweight="bold")
    _label(ax, x, header + 0.35, "blocks.$\\ell$.", size=size, family=MONO)
    _label(ax, x, header + 0.05, "(module of GPT)", size=6.5, color="#555555")
    for y, (module, _) in zip(y_of, rows):
        kind = "attention" if module.startswith("attention") else "ffn" if module.startswith("ffn") else "norm"
        _box(ax, x, y, w, row_h - 0.12, "", kind)
        _label(ax, x, y + 0.15, BLOCK_SYMBOLS.get(module, module), size=size)
        _label(ax, x, y - 0.16, module, size=size - 0.5, family=MONO)


def plot_tensor_names(columns: Mapping[str, Mapping[str, str]], *, left: int = 1, layer: int = 0,
                      notes: Mapping[str, Mapping[str, str]] | None = None,
                      title: str = "One block's tensors under four names"):
    """Three or more columns joined by lines: the names of one block's tensors in checkpoints and in the book.

    ``columns`` as for :func:`tensor_name_rows` (the rows are its rows); the first ``left`` columns are drawn left
    of the book's column, the others right of it, each joined by a line per row to its neighbour on the book's
    side, so the names in one row are the same tensor. A checkpoint module that holds several of ours (GPT-2's
    ``c_attn``: W_Q, W_K, W_V) is one tall box with a line to each. ``notes[column]`` maps our module
    (``attention.W_o``) or parameter name (as :func:`loader_conversions` gives them) to a note written on the
    line into that column ("transposed"). Names are shown without the block's prefix (in the column's header,
    with the block number as ℓ) and without ``.weight`` / ``.bias`` (the header lists the endings).
    """
    if isinstance(left, bool) or not isinstance(left, int) or not 0 <= left <= len(columns):
        raise ValueError(f"left must be an integer from 0 to the number of columns ({len(columns)}), got {left!r}")
    unknown = sorted(set(notes or {}) - set(columns))
    if unknown:
        raise ValueError(f"notes names columns that columns lacks: {unknown}")
    notes = {column: _module_notes(found, layer) for column, found in (notes or {}).items()}
    rows, prefixes, suffixes = tensor_name_rows(columns, layer=layer)
    titles, size, row_h = list(columns), 7.0, 0.78
    order = titles[:left] + [None] + titles[left:]  # None: the book's column
    box_ws = [_mono_width([m for m, _ in rows] if t is None else [r[1][titles.index(t)] for r in rows], size)
              + 0.45 for t in order]
    noted = [bool(notes.get(order[j + 1 if j >= left else j])) for j in range(len(order) - 1)]
    xs, _ = _name_columns_x(order, box_ws, noted)
    height, top = 1.75 + len(rows) * row_h + 0.95, 1.75
    fig, ax = _canvas(13.6, height)
    _label(ax, 0.2, height - 0.2, title, size=9.5, ha="left", va="top", fontweight="bold")
    y_of = [height - top - (i + 0.5) * row_h for i in range(len(rows))]
    header = height - top + 0.1
    _book_column(ax, rows, xs[left], box_ws[left], y_of, row_h, size, header)
    for j, column in enumerate(order):
        if column is None:
            continue
        _label(ax, xs[j], header + 0.75, column, size=8, fontweight="bold")
        _label(ax, xs[j], header + 0.35, prefixes[column][:-len(f"{layer}.")] + "$\\ell$.", size=size, family=MONO)
        _label(ax, xs[j], header + 0.05, "(" + ", ".join(suffixes[column]) + ")", size=6.5, color="#555555")
        toward = j + 1 if j < left else j - 1  # the neighbour on the book's side
        _draw_name_column(ax, rows, titles.index(column), (xs[j], box_ws[j]), (xs[toward], box_ws[toward]), y_of,
                          row_h, size, notes.get(column, {}))
    _label(ax, 0.2, 0.3, "Rows: the same tensor. Names without their prefix (above each column, ℓ the block) and "
           "ending (.weight, .bias).", size=6.5, ha="left", color="#555555")
    return fig


def _module_notes(notes: Mapping[str, str], layer: int) -> dict[str, str]:
    """Notes keyed by our module (``attention.W_o``), from notes keyed by module or by parameter name
    (``blocks.0.attention.W_o.weight``, as :func:`loader_conversions` gives them: other blocks and biases dropped)."""
    prefix = f"blocks.{layer}."
    return {name.removeprefix(prefix).removesuffix(".weight"): note for name, note in notes.items()
            if note and (not name.startswith("blocks.") or name.startswith(prefix) and name.endswith(".weight"))}


def _draw_name_column(ax, rows, k, at, to, y_of, row_h, size, notes):
    """Column ``k``'s boxes at ``at`` = (x, width) (a module over consecutive rows as one box) and their lines to the
    boxes at ``to``, with each module's note on its lines."""
    (x, w), (x_to, w_to) = at, to
    i = 0
    while i < len(rows):
        name = rows[i][1][k]
        j = i
        while j + 1 < len(rows) and name is not None and rows[j + 1][1][k] == name:
            j += 1
        top, bottom = y_of[i] + (row_h - 0.12) / 2, y_of[j] - (row_h - 0.12) / 2
        if name is None:
            _label(ax, x, y_of[i], "(none)", size=size - 0.5, color="#999999")
        else:
            _box(ax, x, (top + bottom) / 2, w, top - bottom, name, "tensor", size=size, family=MONO)
            sign = 1 if x_to > x else -1
            start, end = x + sign * w / 2, x_to - sign * w_to / 2
            mid = (top + bottom) / 2
            for row in range(i, j + 1):  # from the box's middle, bent once toward each of its rows
                ax.plot([start, (start + end) / 2, end], [mid, y_of[row], y_of[row]], color="#555555",
                        linewidth=0.8, zorder=1)
            note = notes.get(rows[i][0], "")
            if note:
                _label(ax, (start + end) / 2, (top + bottom) / 2, note.replace(", ", ",\n"), size=6.5,
                       color="#a64d4d", bbox={"facecolor": "white", "edgecolor": "none", "pad": 0.5})
        i = j + 1
