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
