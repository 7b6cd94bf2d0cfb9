import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from groundup.plotting import plot_losses  # noqa: E402


def test_plot_losses_is_labelled():
    fig = plot_losses({"train": [3.0, 2.5, 2.0], "validation": [3.1, 2.7, 2.4]}, steps=[0, 100, 200],
                      reference={"uniform": 4.43})
    ax = fig.axes[0]
    assert ax.get_title() == "Loss" and ax.get_xlabel() == "step" and "nats" in ax.get_ylabel()
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["train", "validation"]
    assert list(ax.lines[0].get_xdata()) == [0, 100, 200]
    assert any(line.get_ydata()[0] == 4.43 for line in ax.lines[2:])
    plt.close(fig)


def test_plot_losses_rejects_bad_input():
    with pytest.raises(ValueError, match="at least one loss curve"):
        plot_losses({})
    with pytest.raises(ValueError, match="has 2 values but steps has 3"):
        plot_losses({"train": [1.0, 2.0]}, steps=[0, 1, 2])


def test_plot_attention_draws_one_labelled_panel_per_head():
    import torch

    from groundup.plotting import plot_attention

    weights = torch.softmax(torch.randn(1, 2, 3, 4), dim=-1)
    fig = plot_attention(weights, queries=["a", "b", "c"], keys=["w", "x", "y", "z"], head_titles=["h1", "h2"])
    panels = [ax for ax in fig.axes if ax.get_label() != "<colorbar>"]
    assert [ax.get_title() for ax in panels] == ["h1", "h2"]
    assert [t.get_text() for t in panels[0].get_xticklabels()] == ["w", "x", "y", "z"]
    assert panels[0].get_xlabel() == "key (attended to)" and panels[0].get_ylabel() == "query (attending)"
    assert panels[0].images[0].get_array().shape == (3, 4)
    assert fig.get_suptitle() == "Attention weights"
    plt.close(fig)
    with pytest.raises(ValueError, match=r"queries must have one label per row \(3\), got 2"):
        plot_attention(weights[0, 0], queries=["a", "b"])
    with pytest.raises(ValueError, match="weights must have shape"):
        plot_attention(torch.zeros(5))


def test_plot_gradient_norms_uses_a_log_scale_and_checks_lengths():
    from groundup.plotting import plot_gradient_norms

    fig = plot_gradient_norms({"Post-LN": [1.0, 2.0, 4.0], "Pre-LN": [1.0, 0.9, 0.8]})
    ax = fig.axes[0]
    assert ax.get_yscale() == "log" and list(ax.lines[0].get_xdata()) == [1, 2, 3]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["Post-LN", "Pre-LN"]
    plt.close(fig)
    with pytest.raises(ValueError, match="has 2 values but xs has 3"):
        plot_gradient_norms({"a": [1.0, 2.0]}, xs=[1, 2, 3])
    with pytest.raises(ValueError, match="at least one curve"):
        plot_gradient_norms({})
