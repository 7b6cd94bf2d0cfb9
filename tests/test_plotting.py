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


def _boxes_and_texts(ax):
    from matplotlib.patches import Rectangle

    boxes = sorted((p for p in ax.patches if isinstance(p, Rectangle)), key=lambda p: (-p.get_y(), p.get_x()))
    return boxes, [t for t in ax.texts]


def test_token_spans_draws_one_box_per_token_alternating_colours_with_ids_below():
    from matplotlib.colors import to_hex

    from groundup.plotting import SPAN_COLORS, token_spans

    fig, ax = plt.subplots()
    width = token_spans(ax, ["The", " cat", "\n"], ids=[464, 3797, 198], y=2.0)
    boxes, texts = _boxes_and_texts(ax)
    assert len(boxes) == 3
    assert [to_hex(b.get_facecolor()) for b in boxes] == [SPAN_COLORS[0], SPAN_COLORS[1], SPAN_COLORS[0]]
    # boxes touch end to end, each at least as wide as its text in character cells, and the row's width is returned
    xs = [(b.get_x(), b.get_x() + b.get_width()) for b in boxes]
    assert xs[0][0] == 0 and all(a[1] == b[0] for a, b in zip(xs, xs[1:])) and xs[-1][1] == width
    assert [b.get_width() >= n for b, n in zip(boxes, [3, 4, 1])] == [True] * 3
    # whitespace made visible; ids written below the box of their token
    tokens = [t for t in texts if t.get_position()[1] == 2.0]
    ids = [t for t in texts if t.get_position()[1] < 2.0 - boxes[0].get_height() / 2]
    assert [t.get_text() for t in tokens] == ["The", "\u2423cat", "\u21b5"]
    assert [t.get_text() for t in ids] == ["464", "3797", "198"]
    assert [t.get_position()[0] for t in ids] == [t.get_position()[0] for t in tokens]
    plt.close(fig)


def test_token_spans_rejects_bad_input():
    from groundup.plotting import token_spans

    fig, ax = plt.subplots()
    with pytest.raises(ValueError, match=r"ids must have one id per piece \(2\), got 1"):
        token_spans(ax, ["a", "b"], ids=[1])
    with pytest.raises(TypeError, match="pieces must be a list of strings"):
        token_spans(ax, "ab")
    with pytest.raises(TypeError, match="pieces must be a list of strings"):
        token_spans(ax, [97, 98])
    plt.close(fig)


@pytest.mark.parametrize("dpi", [72, 100, 200])
def test_plot_token_spans_labels_rows_and_every_token_fits_its_box_when_rendered(dpi):
    from groundup.plotting import plot_token_spans

    rows = {"characters: 19 tokens": list("To be, or not to be"),
            "BPE: 6 tokens": ["To", " be", ",", " or", " not", " to be"]}
    fig = plot_token_spans(rows, ids={"BPE: 6 tokens": [2514, 307, 11, 393, 407, 50000]}, title="Two tokenizers")
    fig.set_dpi(dpi)
    ax = fig.axes[0]
    labels = [t.get_text() for t in ax.texts if t.get_text() in rows]
    assert labels == list(rows) and fig.get_suptitle() == "Two tokenizers"
    boxes, _ = _boxes_and_texts(ax)
    assert len(boxes) == 19 + 6
    # the independent check: matplotlib's own text extents, in pixels, lie inside each token's box
    renderer = fig.canvas.get_renderer()
    inside = 0
    for box in boxes:
        bx = box.get_window_extent(renderer)
        for t in ax.texts:
            x, y = t.get_position()
            if box.get_x() < x < box.get_x() + box.get_width() and box.get_y() < y < box.get_y() + box.get_height():
                tb = t.get_window_extent(renderer)
                assert bx.x0 <= tb.x0 and tb.x1 <= bx.x1 and bx.y0 <= tb.y0 and tb.y1 <= bx.y1, t.get_text()
                inside += 1
    assert inside == 25
    # the whole drawing lies on the figure
    fb = fig.bbox
    assert all(fb.x0 <= b.get_window_extent(renderer).x0 and b.get_window_extent(renderer).x1 <= fb.x1 + 0.5
               for b in boxes)
    plt.close(fig)


def test_plot_token_spans_shrinks_the_font_for_a_long_row_and_rejects_bad_input():
    from groundup.plotting import plot_token_spans

    fig = plot_token_spans({"long": ["word"] * 40}, width=6.4)
    sizes = {t.get_fontsize() for t in fig.axes[0].texts if t.get_text() == "word"}
    assert len(sizes) == 1 and sizes.pop() < 9.0
    renderer = fig.canvas.get_renderer()
    assert max(p.get_window_extent(renderer).x1 for p in fig.axes[0].patches) <= fig.bbox.x1 + 0.5
    plt.close(fig)
    with pytest.raises(ValueError, match="at least one tokenization"):
        plot_token_spans({})
    with pytest.raises(ValueError, match=r"ids has labels that rows lacks: \['b'\]"):
        plot_token_spans({"a": ["x"]}, ids={"b": [1]})


def test_plot_accuracy_by_position_draws_seeds_thin_and_the_mean_thick():
    from matplotlib.patches import StepPatch

    from groundup.plotting import plot_accuracy_by_position

    runs = {"rope": [[1.0, 0.5], [1.0, 0.7]], "relative": [[1.0, 0.9], [0.8, 0.9]]}
    fig = plot_accuracy_by_position({"2 heads": runs, "4 heads": runs}, [3, 32, 256], chance=1 / 16,
                                    train_length=32)
    ax = fig.axes[0]
    steps = [p for p in ax.patches if isinstance(p, StepPatch)]
    assert len(steps) == 2 * (2 + 1)
    means = [p for p in steps if p.get_linewidth() > 2]
    assert [list(p.get_data().values) for p in means] == [[1.0, 0.6], [0.9, 0.9]]
    assert [list(p.get_data().edges) for p in means] == [[3, 32, 256]] * 2
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["rope (mean of 2)", "relative (mean of 2)",
                                                                  "chance (0.06)"]
    assert [a.get_title() for a in fig.axes] == ["2 heads", "4 heads"]
    plt.close(fig)
    single = plot_accuracy_by_position({"one seed": {"PI": [[0.1, 0.06]], "NTK": [[1.0, 0.6]]}}, [3, 32, 256])
    ax = single.axes[0]
    assert [list(p.get_data().values) for p in ax.patches] == [[0.1, 0.06], [1.0, 0.6]]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["PI", "NTK"]
    plt.close(single)
    with pytest.raises(ValueError, match=r"method 'rope' of panel 'p' must be a list of runs with 2 values each"):
        plot_accuracy_by_position({"p": {"rope": [[1.0]]}}, [3, 32, 256])
    with pytest.raises(ValueError, match="edges must be at least two increasing positions"):
        plot_accuracy_by_position({"p": runs}, [32, 3])
    with pytest.raises(ValueError, match="at least one panel"):
        plot_accuracy_by_position({}, [3, 32])


def test_plot_head_statistics_writes_every_value_and_centres_the_reference_panel_on_its_level():
    import numpy as np
    import torch

    from groundup.plotting import plot_head_statistics

    itself = torch.tensor([[0.13, 0.17, 0.40], [0.05, 0.24, 0.30]])
    gap = np.array([[0.18, 0.20, 0.23], [0.08, 0.36, 0.48]])
    fig = plot_head_statistics({"itself": itself, "latest gap": gap, "distance": [[6.5, 2.65, 2.5], [12.03, 2, 4]]},
                               reference={"latest gap": torch.tensor(0.21)}, units={"distance": "characters"},
                               title="Heads")
    panels = [ax for ax in fig.axes if ax.get_label() != "<colorbar>" and ax.get_visible()]
    assert [ax.get_title() for ax in panels] == ["itself", "latest gap\n(white: even spread, 0.21)", "distance"]
    assert fig.get_suptitle() == "Heads" and len(fig.axes) == 4 + 3  # 2 x 2 panels (one unused) and 3 colour bars
    for ax, table in zip(panels, (itself.numpy(), gap, np.array([[6.5, 2.65, 2.5], [12.03, 2, 4]]))):
        np.testing.assert_allclose(ax.images[0].get_array(), table)
        written = {(round(t.get_position()[1]), round(t.get_position()[0])): t.get_text() for t in ax.texts}
        assert written == {(i, j): f"{table[i, j]:.2f}" for i in range(2) for j in range(3)}
        assert [t.get_text() for t in ax.get_xticklabels()] == ["1", "2", "3"] and ax.get_xlabel() == "head"
        assert [t.get_text() for t in ax.get_yticklabels()] == ["1", "2"] and ax.get_ylabel() == "layer"
    image = panels[1].images[0]
    # white at the level, symmetric: 0.27 either side
    assert image.norm(0.21) == pytest.approx(0.5) and image.norm(0.48) == pytest.approx(1.0)
    np.testing.assert_allclose(image.cmap(0.5)[:3], (0.97, 0.97, 0.97), atol=0.02)  # RdBu_r's middle is white
    assert panels[0].images[0].norm.vmin == 0.0 and panels[0].images[0].norm.vmax == np.float32(0.40)
    assert "characters" in [ax.get_ylabel() for ax in fig.axes]
    plt.close(fig)


def test_plot_head_statistics_rejects_bad_input():
    from groundup.plotting import plot_head_statistics

    with pytest.raises(ValueError, match="at least one statistic"):
        plot_head_statistics({})
    with pytest.raises(ValueError, match=r"same shape, got \{'a': \(2, 2\), 'b': \(2, 3\)\}"):
        plot_head_statistics({"a": [[1, 2], [3, 4]], "b": [[1, 2, 3], [4, 5, 6]]})
    with pytest.raises(ValueError, match="same shape"):
        plot_head_statistics({"a": [1, 2, 3]})
    with pytest.raises(ValueError, match=r"reference names \['gap'\], which are not among the statistics \['a'\]"):
        plot_head_statistics({"a": [[1, 2]]}, reference={"gap": 0.2})
