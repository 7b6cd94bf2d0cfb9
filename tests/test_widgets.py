"""groundup.widgets: the sampling and attention views, their static figures and their ipywidgets explorers."""

import math
import sys

import matplotlib
import matplotlib.pyplot as plt
import pytest
import torch
from torch import nn

from groundup.generation import generate
from groundup.widgets import (
    attention_explorer,
    attention_layers,
    plot_attention_head,
    plot_sampling,
    sampling_distribution,
    sampling_explorer,
)

matplotlib.use("Agg")


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


def logits_30(seed=0):
    return torch.randn(30, generator=torch.Generator().manual_seed(seed)) * 2


def plain_kept(logits, temperature, top_k, top_p):
    """The kept set by the definitions, in float64 Python: the k most probable (ties with the k-th too), then,
    renormalised among those, the most probable tokens while the mass before them is below p."""
    z = [float(v) / temperature for v in logits]
    order = sorted(range(len(z)), key=lambda i: (-z[i], i))
    allowed = order
    if top_k is not None:
        kth = z[order[min(top_k, len(z)) - 1]]
        allowed = [i for i in order if z[i] >= kth]
    if top_p is not None:
        top = max(z[i] for i in allowed)
        weights = {i: math.exp(z[i] - top) for i in allowed}
        total, kept, mass = sum(weights.values()), [], 0.0
        for i in allowed:
            if kept and mass >= top_p - 1e-6:
                break
            kept.append(i)
            mass += weights[i] / total
        allowed = kept
    return set(allowed)


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, None, None), (0.8, None, 0.9), (1.5, 5, None),
                                                       (0.5, 10, 0.6), (2.0, 3, 0.99), (0.3, None, 0.05),
                                                       (1.0, 2, 0.7)])  # top-p before top-k would keep 2
def test_sampling_distribution_keeps_what_the_definitions_keep(temperature, top_k, top_p):
    logits = logits_30()
    view = sampling_distribution(logits, temperature=temperature, top_k=top_k, top_p=top_p)
    kept = set(torch.nonzero(view.kept).flatten().tolist())
    assert kept == plain_kept(logits, temperature, top_k, top_p)
    assert view.n_kept == len(kept)
    torch.testing.assert_close(view.model_probs, torch.nn.functional.softmax(logits, dim=0))
    tempered = torch.tensor([math.exp(v / temperature) for v in logits.double()], dtype=torch.float64)
    tempered /= tempered.sum()
    torch.testing.assert_close(view.tempered.double(), tempered)
    assert view.kept_mass == pytest.approx(tempered[view.kept].sum().item(), rel=1e-5)
    expected = torch.where(view.kept, tempered, 0.0) / tempered[view.kept].sum()  # renormalised over the kept set
    torch.testing.assert_close(view.probs.double(), expected)
    assert view.probs.sum().item() == pytest.approx(1.0, abs=1e-6)
    assert (view.probs[~view.kept] == 0).all()


class FixedLogits(nn.Module):
    """A stand-in model whose next-token logits are always the same."""

    def __init__(self, logits):
        super().__init__()
        self.logits = nn.Parameter(logits.clone(), requires_grad=False)
        self.config = type("Config", (), {"context_length": 8, "vocab_size": logits.numel()})()

    def forward(self, idx):
        return self.logits.expand(idx.shape[0], idx.shape[1], -1), None


def test_sampling_distribution_is_what_generate_draws_from(monkeypatch):
    """The probabilities generate hands to torch.multinomial are the view's, bit for bit (another order of the
    operations, or a multiplication by 1/T instead of a division, changes them), and its tokens are kept ones."""
    logits = logits_30(1)
    multinomial, seen = torch.multinomial, []

    def spy(probs, *args, **kwargs):
        seen.append(probs.clone())
        return multinomial(probs, *args, **kwargs)

    monkeypatch.setattr(torch, "multinomial", spy)
    for settings in ({"temperature": 0.7, "top_p": 0.8}, {"temperature": 1.3, "top_k": 6},
                     {"temperature": 0.9, "top_k": 2, "top_p": 0.6}, {"temperature": 0.3}):
        seen.clear()
        view = sampling_distribution(logits, **settings)
        tokens = generate(FixedLogits(logits), torch.zeros(1, 1, dtype=torch.long), 50, use_cache=False,
                          generator=torch.Generator().manual_seed(5), **settings)[0, 1:]
        assert len(seen) == 50 and all(torch.equal(probs, view.probs[None]) for probs in seen), settings
        assert view.kept[tokens].all()


def test_sampling_distribution_rejects_bad_input_naming_it():
    with pytest.raises(ValueError, match="temperature"):
        sampling_distribution(logits_30(), temperature=0)
    with pytest.raises(ValueError, match="top_p"):
        sampling_distribution(logits_30(), top_p=1.5)
    with pytest.raises(ValueError, match="top_k"):
        sampling_distribution(logits_30(), top_k=0)
    with pytest.raises(ValueError, match=r"shape \(vocab_size,\)"):
        sampling_distribution(torch.zeros(2, 30))
    with pytest.raises(TypeError, match="floating-point"):
        sampling_distribution(torch.arange(30))


def test_plot_sampling_draws_the_views_numbers():
    logits = logits_30(2)
    view = sampling_distribution(logits, temperature=0.8, top_p=0.9)
    labels = [f"t{i}" for i in range(30)]
    fig = plot_sampling(view, labels, n_shown=12)
    ax = fig.axes[0]
    bars = [p.get_height() for p in ax.patches]
    order = torch.argsort(torch.softmax(logits, 0), descending=True)[:12]
    assert bars[:12] == pytest.approx(view.tempered[order].tolist())
    assert bars[12:] == pytest.approx(view.probs[order].tolist())
    assert [t.get_text() for t in ax.get_xticklabels()] == [labels[i] for i in order.tolist()]
    assert f"{view.n_kept} of 30 tokens kept, holding {view.kept_mass:.2f}" in ax.get_title()
    with pytest.raises(ValueError, match="labels must be a list of 30"):
        plot_sampling(view, labels[:5])


def test_sampling_explorer_sliders_and_redraw():
    pytest.importorskip("ipywidgets")
    logits = logits_30(3)
    labels = [f"t{i}" for i in range(30)]
    box = sampling_explorer(logits, labels, temperature=0.8, top_p=0.9, n_shown=10)
    sliders, summary, image = box.children
    t, k, p = sliders.children
    assert (t.min, t.max, t.value) == (-1, 0.5, pytest.approx(0.8))  # 10^-1 .. 10^0.5
    assert (k.min, k.max, k.value) == (0, 30, 0)
    assert (p.min, p.max, p.value) == (pytest.approx(0.01), 1.0, pytest.approx(0.9))
    view = sampling_distribution(logits, temperature=0.8, top_p=0.9)
    assert f"{view.n_kept} of 30 tokens kept, holding {view.kept_mass:.3f}" in summary.value
    assert image.value[:4] == b"\x89PNG"
    before = (summary.value, image.value)
    k.value = 2
    narrower = sampling_distribution(logits, temperature=0.8, top_k=2, top_p=0.9)
    assert "top-k 2" in summary.value and f"{narrower.n_kept} of 30 tokens kept" in summary.value
    assert image.value != before[1]
    p.value = 1.0  # 1: off
    assert "top-p off" in summary.value
    assert "sampling explorer" in repr(box) and "PNG" not in repr(box)


def sentence_weights():
    g = torch.Generator().manual_seed(0)
    return {"three heads": torch.softmax(torch.randn(1, 3, 5, 5, generator=g), -1),
            "one head": torch.softmax(torch.randn(1, 5, 5, generator=g), -1)}


def test_attention_layers_reads_dicts_lists_and_tensors():
    w = sentence_weights()
    layers = attention_layers(w)
    assert list(layers) == ["three heads", "one head"] and layers["three heads"].shape == (3, 5, 5)
    stacked = torch.softmax(torch.randn(2, 4, 6, 6), -1)
    assert list(attention_layers(stacked)) == ["layer 0", "layer 1"]
    assert torch.equal(attention_layers(list(stacked))["layer 1"], stacked[1])
    with pytest.raises(ValueError, match=r"weights\['x'\] must have shape"):
        attention_layers({"x": torch.zeros(5, 5)})
    with pytest.raises(TypeError, match="weights must be"):
        attention_layers(3)


def test_plot_attention_head_draws_the_chosen_row():
    w = sentence_weights()
    tokens = list("abcde")
    fig = plot_attention_head(w, tokens, layer="three heads", head=2, query=3)
    ax_map, ax_row = fig.axes[:2]
    row = w["three heads"][0, 2, 3]
    assert [p.get_height() for p in ax_row.patches] == pytest.approx(row.tolist())
    assert sum(p.get_height() for p in ax_row.patches) == pytest.approx(1.0, abs=1e-6)
    assert torch.equal(torch.as_tensor(ax_map.images[0].get_array()), w["three heads"][0, 2])
    with pytest.raises(ValueError, match=r"head must be an integer in \[0, 0\]"):
        plot_attention_head(w, tokens, layer="one head", head=1)
    with pytest.raises(ValueError, match="query must be a position"):
        plot_attention_head(w, tokens, query=5)
    with pytest.raises(ValueError, match="layer must be one of"):
        plot_attention_head(w, tokens, layer="two heads")


def test_attention_explorer_pickers_and_redraw():
    pytest.importorskip("ipywidgets")
    box = attention_explorer(sentence_weights(), list("abcde"), head=2, query=3)
    pickers, image = box.children
    layer, head, query = pickers.children
    assert list(layer.options) == ["three heads", "one head"] and list(head.options) == [0, 1, 2]
    assert (head.value, query.value) == (2, 3) and [label for label, _ in query.options][3] == "3: d"
    first = image.value
    query.value = 0
    assert image.value != first
    second = image.value
    layer.value = "one head"  # one head only: the head picker follows
    assert list(head.options) == [0] and head.value == 0 and image.value != second
    assert "attention explorer" in repr(box)


def test_explorers_without_ipywidgets_say_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "ipywidgets", None)  # import ipywidgets now raises ImportError
    with pytest.raises(ImportError, match="pip install ipywidgets"):
        sampling_explorer(logits_30(), [str(i) for i in range(30)])
    with pytest.raises(ImportError, match="pip install ipywidgets"):
        attention_explorer(sentence_weights(), list("abcde"))
    # the static figures need nothing more
    plot_sampling(sampling_distribution(logits_30(), top_k=3), [str(i) for i in range(30)])
    plot_attention_head(sentence_weights(), list("abcde"))
