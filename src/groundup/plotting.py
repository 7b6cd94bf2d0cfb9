"""Figures for the book: matplotlib, labelled (title, axes, units, legend), sized for the book's column.

Every function returns the matplotlib ``Figure`` it drew, so a notebook can adjust or save it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt

COLUMN = (6.4, 3.6)  # inches: the width of the book's text column


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


def plot_positional_encoding(table, *, title: str = "Sinusoidal positional encoding", xlabel: str = "dimension",
                             ylabel: str = "position k", colorbar_label: str = "value"):
    """Heat-map of a positional table ``[n_positions, d]`` (one row per position), e.g. ``sinusoidal_encoding``.

    Also draws an additive score bias ``[n, n]`` (one head of ``alibi_bias`` or ``RelativePositionBias``) when
    given suitable labels, e.g. ``xlabel="key position i", ylabel="query position t"``.
    """
    import numpy as np

    p = table.detach().cpu().numpy() if hasattr(table, "detach") else np.asarray(table)
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
