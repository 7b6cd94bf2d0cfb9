"""Tests for groundup.embeddings against one-hot products, PyTorch built-ins and the closed-form scales."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from groundup.embeddings import INITS, SMALL_STD, TokenEmbedding, Unembedding, rms


def test_rms_closed_form():
    x = torch.tensor([[3.0, 4.0], [1.0, -1.0]])
    torch.testing.assert_close(rms(x), torch.tensor([math.sqrt(12.5), 1.0]))
    assert rms(torch.ones(5, 7), dim=0).shape == (7,)
    assert rms(x, keepdim=True).shape == (2, 1)
    # a one-hot vector in R^n has RMS norm 1/sqrt(n)
    assert rms(F.one_hot(torch.tensor(3), 32000)).item() == pytest.approx(1 / math.sqrt(32000))
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        rms([1.0, 2.0])


def test_one_hot_times_matrix_is_the_lookup():
    torch.manual_seed(0)
    emb = TokenEmbedding(11, 6)
    ids = torch.tensor([[0, 3, 10], [5, 5, 1]])
    one_hot = F.one_hot(ids, 11).to(emb.weight.dtype)           # [2, 3, 11]
    torch.testing.assert_close(one_hot @ emb.weight, emb(ids))   # exact: each sum has one non-zero term
    torch.testing.assert_close(emb(ids), F.embedding(ids, emb.weight))
    assert emb(ids).shape == (2, 3, 6)
    assert torch.equal(emb(torch.tensor(4)), emb.weight[4])


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8])
def test_integer_dtypes_accepted(dtype):
    emb = TokenEmbedding(5, 3)
    assert torch.equal(emb(torch.tensor([4, 0], dtype=dtype)), emb.weight[[4, 0]])


def test_rms_init_every_row_exactly_rms_one():
    torch.manual_seed(1)
    emb = TokenEmbedding(1000, 64, init="rms")
    assert emb.weight.shape == (1000, 64)
    torch.testing.assert_close(rms(emb.weight), torch.ones(1000))
    # the rows still point in random directions: mean about 0, not all equal
    assert abs(emb.weight.mean().item()) < 0.02
    assert emb.weight.std(dim=0).min() > 0.5


def test_normal_init_rms_one_only_in_expectation_and_small_init():
    torch.manual_seed(2)
    w = TokenEmbedding(2000, 64, init="normal").weight
    row_rms = rms(w)
    assert row_rms.mean().item() == pytest.approx(1.0, abs=0.01)
    # fluctuates by about 1/sqrt(2 d) = 0.088 from row to row
    assert row_rms.std().item() == pytest.approx(1 / math.sqrt(2 * 64), rel=0.15)
    small = TokenEmbedding(2000, 64, init="small").weight
    assert small.std().item() == pytest.approx(SMALL_STD, rel=0.02)


def test_unembedding_scale_gives_unit_logits():
    torch.manual_seed(3)
    d, n_v = 256, 500
    unemb = Unembedding(d, n_v)
    assert unemb.weight.shape == (n_v, d)
    assert unemb.weight.std().item() == pytest.approx(1 / math.sqrt(d), rel=0.02)
    x = TokenEmbedding(50, d)(torch.arange(50))            # hidden vectors at RMS exactly 1
    logits = unemb(x)
    assert logits.shape == (50, n_v)
    assert logits.std().item() == pytest.approx(1.0, rel=0.05)
    torch.testing.assert_close(logits, F.linear(x, unemb.weight))


def test_logits_softmax_is_a_distribution():
    torch.manual_seed(4)
    emb, unemb = TokenEmbedding(30, 16), Unembedding(16, 30)
    probs = torch.softmax(unemb(emb(torch.tensor([[1, 2, 3]]))), dim=-1)
    assert (probs > 0).all()
    torch.testing.assert_close(probs.sum(-1), torch.ones(1, 3))


def test_tying_shares_the_parameter_and_its_gradient():
    torch.manual_seed(5)
    emb = TokenEmbedding(20, 8)
    unemb = Unembedding(8, 20, tied_to=emb)
    assert unemb.weight is emb.weight and unemb.tied
    model = nn.ModuleDict({"emb": emb, "unemb": unemb})
    assert len(list(model.parameters())) == 1                     # counted (and optimised) once
    assert sum(p.numel() for p in model.parameters()) == 20 * 8
    ids = torch.tensor([2, 7, 7])
    loss = F.cross_entropy(unemb(emb(ids)), torch.tensor([7, 1, 2]))
    loss.backward()
    # the one gradient is the sum of the two uses' gradients: compare with an untied copy
    w_in = emb.weight.detach().clone().requires_grad_()
    w_out = emb.weight.detach().clone().requires_grad_()
    F.cross_entropy(w_in[ids] @ w_out.T, torch.tensor([7, 1, 2])).backward()
    torch.testing.assert_close(emb.weight.grad, w_in.grad + w_out.grad)
    # an update to the one parameter moves both uses
    with torch.no_grad():
        emb.weight[3] += 1.0
    assert torch.equal(unemb.weight[3], emb.weight[3])


def test_tying_to_nn_embedding_and_shape_mismatch():
    e = nn.Embedding(9, 4)
    assert Unembedding(4, 9, tied_to=e).weight is e.weight
    with pytest.raises(ValueError, match=r"tied_to.weight must have shape .*\(9, 5\).*\(9, 4\)"):
        Unembedding(5, 9, tied_to=e)
    with pytest.raises(ValueError, match="tied_to.weight must have shape"):
        Unembedding(4, 10, tied_to=TokenEmbedding(9, 4))
    with pytest.raises(TypeError, match="tied_to must be a TokenEmbedding"):
        Unembedding(4, 9, tied_to=torch.zeros(9, 4))


def test_bad_arguments():
    with pytest.raises(ValueError, match=r"init must be one of 'rms', 'normal', 'small'; got 'xavier'"):
        TokenEmbedding(5, 3, init="xavier")
    assert INITS == ("rms", "normal", "small")
    for bad in (0, -2, 2.0, True, None):
        with pytest.raises(ValueError, match="vocab_size must be a positive integer"):
            TokenEmbedding(bad, 3)
        with pytest.raises(ValueError, match="d_model must be a positive integer"):
            Unembedding(bad, 3)
    emb = TokenEmbedding(5, 3)
    with pytest.raises(ValueError, match=r"ids must lie in \[0, 4\] \(vocab_size=5\), got 5"):
        emb(torch.tensor([0, 5]))
    with pytest.raises(ValueError, match=r"ids must lie in \[0, 4\].*got -1"):
        emb(torch.tensor([-1, 2]))
    with pytest.raises(TypeError, match="ids must have an integer dtype"):
        emb(torch.tensor([0.0, 1.0]))
    with pytest.raises(TypeError, match="ids must be a torch.Tensor"):
        emb([0, 1])
    assert emb(torch.zeros(0, dtype=torch.long)).shape == (0, 3)
    unemb = Unembedding(3, 5)
    with pytest.raises(ValueError, match=r"x must have shape \[\.\.\., d_model=3\], got \(2, 4\)"):
        unemb(torch.zeros(2, 4))
    with pytest.raises(TypeError, match="x must be a floating-point tensor"):
        unemb(torch.zeros(2, 3, dtype=torch.long))


def test_reprs():
    assert "init='small'" in repr(TokenEmbedding(5, 3, init="small"))
    assert "tied=True" in repr(Unembedding(3, 5, tied_to=TokenEmbedding(5, 3)))


def test_chapter3_plots_label_and_reject_bad_input():
    import matplotlib

    matplotlib.use("Agg")
    from groundup.plotting import plot_init_comparison, plot_loss_vs_logit_scale

    fig = plot_init_comparison(["a", "b"], [1.0, 0.1], [4.9, 250.0], reference_loss=math.log(84))
    left, right = fig.axes
    assert "RMS" in left.get_xlabel() and "nats" in right.get_xlabel()
    assert [t.get_text() for t in left.get_yticklabels()] == ["a", "b"]
    with pytest.raises(ValueError, match="equal length"):
        plot_init_comparison(["a"], [1.0, 2.0], [3.0])
    fig = plot_loss_vs_logit_scale([0.5, 1.0, 8.0], [4.6, 4.9, 19.0], vocab_size=84)
    ax = fig.axes[0]
    assert "nats" in ax.get_ylabel() and len(ax.get_legend().get_texts()) == 4
    with pytest.raises(ValueError, match="vocab_size must be an integer >= 2"):
        plot_loss_vs_logit_scale([1.0], [4.0], vocab_size=1)
    with pytest.raises(ValueError, match="equal length"):
        plot_loss_vs_logit_scale([1.0], [], vocab_size=84)
    import matplotlib.pyplot as plt

    plt.close("all")


# ---- hardening: API traps --------------------------------------------------------------------------------


def test_unembedding_names_a_dtype_mismatch():
    with pytest.raises(TypeError, match=r"x has dtype torch.float64 but the unembedding's weight is torch.float32"):
        Unembedding(4, 7)(torch.randn(2, 4, dtype=torch.float64))


def test_embedding_sizes_accept_numpy_integers_and_ids_of_small_integer_dtypes():
    np = pytest.importorskip("numpy")
    emb = TokenEmbedding(np.int64(7), np.int32(4))
    assert (emb.vocab_size, emb.d_model) == (7, 4) and type(emb.vocab_size) is int
    assert Unembedding(np.int64(4), np.int64(7), tied_to=emb).weight is emb.weight
    ids = torch.tensor([[0, 6, 3]])
    for dtype in (torch.uint8, torch.int8, torch.int16, torch.int32):
        assert torch.equal(emb(ids.to(dtype)), emb(ids))


# ---- no host sync per step: the ids are never reduced on the happy path ------------------------------------


class _RecordCalls(torch.overrides.TorchFunctionMode):
    """Records the name of every torch function and tensor method called while the mode is active."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.names.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


_REDUCTIONS = {"min", "max", "amin", "amax", "aminmax", "any", "all", "item", "tolist", "__bool__", "__int__",
               "nonzero", "unique"}


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_forward_does_not_reduce_the_ids(dtype):
    # On a GPU, ids.min() / ids.max() turned into Python numbers make the host wait for the device every step.
    # The forward pass must leave the range check to F.embedding (which checks on the CPU for free).
    emb = TokenEmbedding(10, 4)
    ids = torch.tensor([[0, 9, 3], [2, 2, 1]], dtype=dtype)
    with _RecordCalls() as calls:
        out = emb(ids)
    assert "embedding" in calls.names                      # the mode sees the calls forward makes ...
    assert not _REDUCTIONS & set(calls.names), calls.names  # ... and none of them reduces the ids
    torch.testing.assert_close(out, emb.weight[ids.long()])


def test_forward_does_not_call_min_or_max_methods(monkeypatch):
    # The same guarantee seen from the tensor methods themselves: make them fail loudly if called.
    emb = TokenEmbedding(10, 4)

    def forbidden(*args, **kwargs):
        raise AssertionError("TokenEmbedding.forward called a reduction over the ids")

    for name in ("min", "max", "aminmax", "amin", "amax"):
        monkeypatch.setattr(torch.Tensor, name, forbidden)
    out = emb(torch.tensor([1, 5, 9]))
    monkeypatch.undo()
    torch.testing.assert_close(out, emb.weight[[1, 5, 9]])


def test_out_of_range_ids_still_give_a_clear_error_on_the_cpu():
    emb = TokenEmbedding(6, 4)
    with pytest.raises(ValueError, match=r"ids must lie in \[0, 5\] \(vocab_size=6\), got 6") as info:
        emb(torch.tensor([[0, 6, 2]]))
    assert info.value.__cause__ is None and info.value.__suppress_context__  # not a chained IndexError dump
    with pytest.raises(ValueError, match=r"got -3"):
        emb(torch.tensor([1, -3, 7], dtype=torch.int32))   # the smallest bad id is named when one is negative
    # the reference itself: PyTorch's lookup raises IndexError for the same ids
    with pytest.raises(IndexError):
        F.embedding(torch.tensor([6]), emb.weight)


def test_chapter3_new_plots_label_and_reject_bad_input():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from groundup.plotting import plot_embedding_projection, plot_excess_loss_vs_logit_scale, plot_seed_bands

    ln84 = math.log(84)
    fig = plot_excess_loss_vs_logit_scale([0.5, 1.0, 10.0], [ln84 + 0.13, ln84 + 0.5, 24.7], vocab_size=84,
                                          expected_max=2.447)
    ax = fig.axes[0]
    assert ax.get_yscale() == "log" and "ln n_V" in ax.get_ylabel()
    assert len(ax.get_legend().get_texts()) == 4
    measured = [line for line in ax.get_lines() if line.get_label() == "measured"][0]
    assert measured.get_ydata()[1] == pytest.approx(0.5)          # the plotted value is loss - ln n_V
    with pytest.raises(ValueError, match="must exceed ln n_V"):
        plot_excess_loss_vs_logit_scale([1.0], [ln84 - 0.1], vocab_size=84)
    with pytest.raises(ValueError, match="vocab_size must be an integer >= 2"):
        plot_excess_loss_vs_logit_scale([1.0], [5.0], vocab_size=True)

    fig = plot_seed_bands({"Post-LN": {"a": [[3.0, 2.0], [3.2, 2.2]], "b": [[4.0, 2.5]] * 3}}, [0, 100])
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["a (mean of 2)", "b (mean of 3)"]
    assert list(ax.get_lines()[0].get_ydata()) == pytest.approx([3.1, 2.1])
    assert ax.get_lines()[0].get_linestyle() != ax.get_lines()[1].get_linestyle()
    two = plot_seed_bands({"p": {"a": [[3.0, 2.0]]}, "q": {"a": [[30.0, 20.0]]}}, [0, 100], sharey=False)
    assert [t.get_text() for t in two.legends[0].get_texts()] == ["a (mean of 1)"]   # one legend, below the panels
    assert two.axes[0].get_legend() is None and two.axes[1].get_ylim()[1] > 20
    with pytest.raises(ValueError, match="one per step"):
        plot_seed_bands({"p": {"a": [[1.0, 2.0, 3.0]]}}, [0, 1])
    with pytest.raises(ValueError, match="at least one panel"):
        plot_seed_bands({}, [0])

    fig = plot_embedding_projection({"red": (1.0, 2.0), "two": (-1.0, 0.5)}, {"colours": ["red"], "numbers": ["two"]})
    ax = fig.axes[0]
    assert sorted(t.get_text() for t in ax.texts) == ["red", "two"]
    assert "component" in ax.get_xlabel()
    with pytest.raises(ValueError, match=r"have no point: \['blue'\]"):
        plot_embedding_projection({"red": (1.0, 2.0)}, {"colours": ["red", "blue"]})
    plt.close("all")


def test_chapter3_results_hold_every_run_the_notebook_reads_with_its_command():
    import json
    from importlib import resources

    runs = json.loads(resources.files("groundup").joinpath("results/chapter03.json").read_text())["runs"]
    n_v = 84  # Shakespeare's characters
    start_rms = {"rms": 1.0, "linear": 1 / math.sqrt(3 * n_v), "small": SMALL_STD}
    for norm in ("post", "pre"):
        for init, expected in start_rms.items():
            for seed in range(3):
                run = runs[f"init/{norm}/{init}/seed{seed}"]
                assert run["command"] == f"OMP_NUM_THREADS=1 python tools/ch03_results.py --kind init --seed {seed}"
                assert (run["norm_position"], run["init"], run["seed"]) == (norm, init, seed)
                assert run["steps"][0] == 0 and run["steps"][-1] == 600
                assert len(run["val_loss"]) == len(run["token_rms"]) == len(run["steps"])
                # the stored start is the one named: rows at RMS 1 exactly, the others in expectation
                assert run["token_rms"][0] == pytest.approx(expected, rel=0.1 if init != "rms" else 1e-3)
                # an untrained model is near ln n_V + 1/2 (3.8); training brings the loss well below ln n_V
                assert math.log(n_v) < run["val_loss"][0] < math.log(n_v) + 1 and run["val_loss"][-1] < 2.5
    for init, expected in start_rms.items():
        for seed in range(3):
            run = runs[f"control/post-no-positions/{init}/seed{seed}"]
            assert run["command"] == f"OMP_NUM_THREADS=1 python tools/ch03_results.py --kind control --seed {seed}"
            assert (run["norm_position"], run["positional"], run["init"]) == ("post", "none", init)
            assert run["token_rms"][0] == pytest.approx(expected, rel=0.1 if init != "rms" else 1e-3)
    for init in ("small", "rms"):
        for seed in range(3):
            run = runs[f"words/{init}/seed{seed}"]
            assert run["command"] == f"OMP_NUM_THREADS=1 python tools/ch03_results.py --kind words --seed {seed}"
            assert set(run["precision_at_5"]) == {"colours", "numbers", "kinship", "pronouns"}
            assert all(0 <= p <= 1 for p in run["precision_at_5"].values())
            for word, neighbours in run["neighbours"].items():
                sims = [c for _, c in neighbours]
                assert len(neighbours) == 5 and sims == sorted(sims, reverse=True), word
                assert word not in [n for n, _ in neighbours] and "<unk>" not in [n for n, _ in neighbours]
            assert run["rank_of_blue_for_white"] >= 1 and -1 <= run["cos_white_blue"] <= 1
    assert len(runs["words/small/seed0"]["pca"]) == 38
