"""Interactive views for the notebooks: sliders and pickers where moving them teaches (chapters 5 and 8).

Each view is one computation drawn two ways: a static figure at fixed settings, which the book and the checked
notebook runs show, and an ipywidgets explorer that redraws the same figure whenever the reader moves a control
(JupyterLab, Colab).

* :func:`sampling_distribution` computes the distribution :func:`groundup.generation.generate` draws the next
  token from after a temperature, top-k and top-p, with the same operations in the same order;
  :func:`plot_sampling` draws it and :func:`sampling_explorer` adds the three sliders.
* :func:`plot_attention_head` draws one head's attention map with one query's row as bars;
  :func:`attention_explorer` adds layer, head and query pickers.

Only the explorers need ipywidgets; without it they raise an ``ImportError`` that names the package to install.
"""

from __future__ import annotations

import io
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import matplotlib.pyplot as plt
import numpy as np
import torch

from groundup.generation import sampling_logits
from groundup.plotting import COLUMN

__all__ = ["SamplingView", "sampling_distribution", "plot_sampling", "sampling_explorer", "attention_layers",
           "plot_attention_head", "attention_explorer"]


def _ipywidgets():
    """The ipywidgets module, or an ImportError that says what to install."""
    try:
        import ipywidgets
    except ImportError as err:
        raise ImportError("the interactive view needs the ipywidgets package: pip install ipywidgets (then restart "
                          "the kernel); the static figure before it needs nothing more") from err
    return ipywidgets


def _png(fig) -> bytes:
    """``fig`` as PNG bytes; the figure is closed (an explorer shows the image, not the figure)."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    plt.close(fig)
    return buffer.getvalue()


def _explorer(widgets, children, what: str):
    """A VBox of ``children`` whose text form (all a frontend without widgets shows) says what it is."""

    class Explorer(widgets.VBox):
        def __repr__(self):
            return f"{what}: interactive controls, shown in JupyterLab or Colab with ipywidgets"

    return Explorer(children)


# ---- sampling: temperature, top-k, top-p (chapter 8) -------------------------------------------------------


@dataclass(frozen=True)
class SamplingView:
    """One next-token distribution before and after the sampling transformations (all tensors ``(n_V,)``).

    ``model_probs`` is the model's own distribution (softmax of the logits), ``tempered`` the softmax of the logits
    divided by ``temperature``, ``probs`` what :func:`~groundup.generation.generate` samples from (``tempered``
    after top-k and top-p, renormalised) and ``kept`` marks the tokens the filters keep.
    """

    model_probs: torch.Tensor
    tempered: torch.Tensor
    probs: torch.Tensor
    kept: torch.Tensor
    temperature: float
    top_k: int | None
    top_p: float | None

    @property
    def n_kept(self) -> int:
        """How many tokens the filters keep."""
        return int(self.kept.sum())

    @property
    def kept_mass(self) -> float:
        """The kept tokens' total probability at the temperature, before the filters renormalise it."""
        return float(self.tempered[self.kept].sum())


def _check_logits(logits) -> torch.Tensor:
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point():
        raise TypeError(f"logits must be a floating-point torch.Tensor, got {type(logits).__name__}"
                        + (f" of dtype {logits.dtype}" if isinstance(logits, torch.Tensor) else ""))
    if logits.dim() != 1 or logits.numel() == 0:
        raise ValueError(f"logits must have shape (vocab_size,): one distribution, got {tuple(logits.shape)}")
    logits = logits.detach().cpu()
    return logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits  # as generate does


def sampling_distribution(logits: torch.Tensor, *, temperature: float = 1.0, top_k: int | None = None,
                          top_p: float | None = None) -> SamplingView:
    """The distribution :func:`~groundup.generation.generate` draws from for the next-token ``logits (n_V,)``.

    A sampling step of ``generate``: :func:`~groundup.generation.sampling_logits` (divide by ``temperature``, then
    top-k with ``top_k`` and top-p with ``top_p``; ``None``: no filter), then a softmax.
    Raises ``ValueError`` for a temperature that is not a finite
    number > 0 and for the filters' invalid ``top_k`` / ``top_p``.
    """
    logits = _check_logits(logits)
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) \
            or not math.isfinite(temperature) or temperature <= 0:
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    filtered = sampling_logits(logits, temperature, top_k, top_p)
    return SamplingView(model_probs=torch.softmax(logits, dim=-1), tempered=torch.softmax(logits / temperature, dim=-1),
                        probs=torch.softmax(filtered, dim=-1), kept=torch.isfinite(filtered),
                        temperature=float(temperature), top_k=top_k, top_p=top_p)


def _check_labels(labels, n: int, name: str = "labels") -> list[str]:
    if isinstance(labels, str) or not isinstance(labels, Sequence) or len(labels) != n:
        got = len(labels) if isinstance(labels, Sequence) and not isinstance(labels, str) else type(labels).__name__
        raise ValueError(f"{name} must be a list of {n} strings, one per token, got {got}")
    return [str(label) for label in labels]


def _settings(view: SamplingView) -> str:
    k = "off" if view.top_k is None else view.top_k
    p = "off" if view.top_p is None else f"{view.top_p:g}"
    return f"T = {view.temperature:.3g}, top-k {k}, top-p {p}"


def plot_sampling(view: SamplingView, labels: Sequence[str], *, n_shown: int = 20, title: str | None = None):
    """Bars of one :class:`SamplingView` over its ``n_shown`` most probable tokens (the model's ranking, which a
    temperature does not change): the probabilities after the temperature (grey), what is sampled from after
    top-k and top-p (coloured, the kept tokens) and the model's own probabilities (dots). ``labels`` names every
    token id. Returns the figure."""
    labels = _check_labels(labels, view.probs.numel())
    if isinstance(n_shown, bool) or not isinstance(n_shown, int) or n_shown < 1:
        raise ValueError(f"n_shown must be an integer >= 1, got {n_shown!r}")
    order = torch.sort(view.model_probs, descending=True, stable=True).indices[:n_shown]
    x = np.arange(len(order))
    fig, ax = plt.subplots(figsize=COLUMN, layout="constrained")
    ax.bar(x - 0.2, view.tempered[order].numpy(), width=0.4, color="0.75",
           label=f"after the temperature, T = {view.temperature:.3g}")
    ax.bar(x + 0.2, view.probs[order].numpy(), width=0.4, color="tab:blue",
           label="sampled from: after top-k, top-p, renormalised")
    ax.plot(x, view.model_probs[order].numpy(), "k.", label="the model's own (T = 1)")
    ax.set_xticks(x, labels=[labels[i] for i in order.tolist()])
    ax.set(ylabel="probability", xlabel=f"the {len(order)} most probable next tokens")
    summary = (f"{view.n_kept} of {view.probs.numel()} tokens kept, holding {view.kept_mass:.2f} of the "
               "probability at this temperature")
    ax.set_title(f"{title or _settings(view)}\n{summary}", fontsize="medium")
    ax.legend(fontsize="small")
    return fig


def sampling_explorer(logits: torch.Tensor, labels: Sequence[str], *, temperature: float = 1.0,
                      top_k: int | None = None, top_p: float | None = None, n_shown: int = 20):
    """:func:`plot_sampling` with sliders for the temperature, top-k (0: off) and top-p (1: off), starting at the
    given settings; every change redraws the figure and the line above it. Needs ipywidgets. Returns the widget
    (a ``VBox``: the sliders, a summary line, the figure as an image)."""
    widgets = _ipywidgets()
    view = sampling_distribution(logits, temperature=temperature, top_k=top_k, top_p=top_p)
    labels = _check_labels(labels, view.probs.numel())
    style, wide = {"description_width": "initial"}, widgets.Layout(width="32%")
    t = widgets.FloatLogSlider(value=temperature, base=10, min=-1, max=0.5, step=0.01, description="temperature",
                               continuous_update=False, style=style, layout=wide)
    k = widgets.IntSlider(value=top_k or 0, min=0, max=view.probs.numel(), description="top-k (0: off)",
                          continuous_update=False, style=style, layout=wide)
    p = widgets.FloatSlider(value=1.0 if top_p is None else top_p, min=0.01, max=1.0, step=0.01,
                            description="top-p (1: off)", continuous_update=False, style=style, layout=wide)
    summary, image = widgets.HTML(), widgets.Image(format="png")

    def redraw(_change=None):
        shown = sampling_distribution(logits, temperature=t.value, top_k=k.value or None,
                                      top_p=p.value if p.value < 1.0 else None)
        summary.value = (f"{_settings(shown)}: {shown.n_kept} of {shown.probs.numel()} tokens kept, holding "
                         f"{shown.kept_mass:.3f} of the probability at this temperature")
        image.value = _png(plot_sampling(shown, labels, n_shown=n_shown))

    for slider in (t, k, p):
        slider.observe(redraw, names="value")
    redraw()
    return _explorer(widgets, [widgets.HBox([t, k, p]), summary, image], "sampling explorer")


# ---- attention maps: layer, head, query (chapter 5) ---------------------------------------------------------


def attention_layers(weights) -> dict[str, torch.Tensor]:
    """Attention weights as ``{name: (n_heads, n_q, n_k)}``, from a mapping of names to weights, a list of
    layers' weights (named ``layer 0``, ``layer 1``, ...; what :func:`groundup.interpretability.attention_patterns`
    returns) or one tensor ``(n_layers, n_heads, n_q, n_k)``. A leading batch dimension of 1 is dropped."""
    if isinstance(weights, torch.Tensor) and weights.dim() == 4:
        weights = list(weights)
    if isinstance(weights, Mapping):
        items = list(weights.items())
    elif isinstance(weights, Sequence) and not isinstance(weights, str):
        items = [(f"layer {i}", w) for i, w in enumerate(weights)]
    else:
        raise TypeError(f"weights must be a dict of names to (n_heads, n_q, n_k) tensors, a list of them or a "
                        f"(n_layers, n_heads, n_q, n_k) tensor, got {type(weights).__name__}")
    if not items:
        raise ValueError("weights holds no layer")
    layers = {}
    for name, w in items:
        if not isinstance(w, torch.Tensor):
            raise TypeError(f"weights[{name!r}] must be a torch.Tensor, got {type(w).__name__}")
        w = w.detach().cpu().float()
        if w.dim() == 4 and w.shape[0] == 1:
            w = w[0]
        if w.dim() != 3:
            raise ValueError(f"weights[{name!r}] must have shape (n_heads, n_q, n_k), got {tuple(w.shape)}")
        layers[str(name)] = w
    return layers


def _pick(layers: dict[str, torch.Tensor], layer, head, query) -> torch.Tensor:
    """The map ``(n_q, n_k)`` of ``layer``'s ``head``, checking the three choices."""
    if layer not in layers:
        raise ValueError(f"layer must be one of {list(layers)}, got {layer!r}")
    w = layers[layer]
    if isinstance(head, bool) or not isinstance(head, int) or not 0 <= head < w.shape[0]:
        raise ValueError(f"head must be an integer in [0, {w.shape[0] - 1}] for {layer!r}, got {head!r}")
    if isinstance(query, bool) or not isinstance(query, int) or not 0 <= query < w.shape[1]:
        raise ValueError(f"query must be a position in [0, {w.shape[1] - 1}], got {query!r}")
    return w[head]


def plot_attention_head(weights, queries: Sequence[str], *, layer: str | None = None, head: int = 0,
                        query: int = 0, keys: Sequence[str] | None = None):
    """One head's attention map (left, the ``query`` row outlined) and that query's weights over the keys as bars
    (right, the row of the map, which sums to 1). ``weights`` is anything :func:`attention_layers` reads; ``layer``
    names one of its layers (default: the first); ``queries`` / ``keys`` label rows and columns (``keys`` defaults
    to ``queries``, as in self-attention). Returns the figure."""
    layers = attention_layers(weights)
    layer = next(iter(layers)) if layer is None else layer
    w = _pick(layers, layer, head, query)
    queries = _check_labels(queries, w.shape[0], "queries")
    keys = queries if keys is None else _check_labels(keys, w.shape[1], "keys")
    fig, (ax_map, ax_row) = plt.subplots(1, 2, figsize=(COLUMN[0], COLUMN[1] + 0.4), layout="constrained")
    ax_map.imshow(w.numpy(), cmap="viridis", vmin=0.0, vmax=1.0, aspect="auto")
    ax_map.add_patch(plt.Rectangle((-0.5, query - 0.5), w.shape[1], 1, fill=False, edgecolor="tab:red",
                                   linewidth=2))
    ax_map.set_xticks(range(len(keys)), labels=keys, rotation=90)
    ax_map.set_yticks(range(len(queries)), labels=queries)
    ax_map.set(xlabel="key (attended to)", ylabel="query (attending)", title=f"{layer}, head {head}")
    row = w[query].numpy()
    ax_row.bar(range(len(keys)), row, color="tab:red")
    ax_row.set_xticks(range(len(keys)), labels=keys, rotation=90)
    ax_row.set(ylim=(0, 1.05), ylabel="attention weight", xlabel="key (attended to)",
               title=f"query {query} ({queries[query]!r}): its row")
    return fig


def attention_explorer(weights, queries: Sequence[str], *, layer: str | None = None, head: int = 0,
                       query: int = 0, keys: Sequence[str] | None = None):
    """:func:`plot_attention_head` with pickers for the layer, the head and the query position, starting at the
    given choice; every change redraws the figure. Needs ipywidgets. Returns the widget (a ``VBox``)."""
    widgets = _ipywidgets()
    layers = attention_layers(weights)
    layer = next(iter(layers)) if layer is None else layer
    _pick(layers, layer, head, query)
    queries = _check_labels(queries, layers[layer].shape[1], "queries")
    style = {"description_width": "initial"}
    pick_layer = widgets.Dropdown(options=list(layers), value=layer, description="layer", style=style)
    pick_head = widgets.Dropdown(options=list(range(layers[layer].shape[0])), value=head, description="head",
                                 style=style)
    pick_query = widgets.Dropdown(options=[(f"{i}: {t}", i) for i, t in enumerate(queries)], value=query,
                                  description="query", style=style)
    image = widgets.Image(format="png")

    busy = []  # non-empty while redraw itself changes the head picker

    def redraw(_change=None):
        if busy:
            return
        n_heads = layers[pick_layer.value].shape[0]
        if list(pick_head.options) != list(range(n_heads)):  # another layer may have another number of heads
            busy.append(True)
            try:
                pick_head.options = list(range(n_heads))
                if pick_head.value not in pick_head.options:
                    pick_head.value = 0
            finally:
                busy.clear()
        image.value = _png(plot_attention_head(layers, queries, layer=pick_layer.value, head=pick_head.value,
                                               query=pick_query.value, keys=keys))

    for picker in (pick_layer, pick_head, pick_query):
        picker.observe(redraw, names="value")
    redraw()
    return _explorer(widgets, [widgets.HBox([pick_layer, pick_head, pick_query]), image], "attention explorer")
