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
