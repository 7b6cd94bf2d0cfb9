"""Few labels (groundup.classification): balanced subsets, folds of whole scenes, a probe fitted to convergence with
its l2 chosen on held-out scenes, and the language model's own score of a passage."""

from collections import Counter

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from groundup.classification import (
    ClassifierHead,
    Passages,
    balanced_subset,
    fit_logistic_regression,
    fit_probe,
    fit_standardised_logistic_regression,
    lm_scores,
    pooled_features,
    scene_folds,
)
from groundup.models import GPT, GPTConfig, MaskedLM, MaskedLMConfig


def tiny_gpt(seed=0, vocab=11):
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=vocab, context_length=16, d_model=8, n_layers=1, n_heads=2))


def test_select_keeps_texts_labels_and_sections_together():
    p = Passages(("a", "b", "c", "d"), (0, 1, 1, 0), ("s0", "s0", "s1", "s2"), ("x", "y"))
    q = p.select([3, 1])
    assert (q.texts, q.labels, q.sections, q.classes) == (("d", "b"), (0, 1), ("s2", "s0"), ("x", "y"))


def test_balanced_subset_is_balanced_seeded_and_nested():
    labels = [0] * 70 + [1] * 30 + [2] * 20
    rows = balanced_subset(labels, 30, seed=3)
    assert rows == sorted(set(rows)) and Counter(labels[r] for r in rows) == {0: 10, 1: 10, 2: 10}
    assert rows == balanced_subset(labels, 30, seed=3) and rows != balanced_subset(labels, 30, seed=4)
    assert set(balanced_subset(labels, 12, seed=3)) <= set(rows) <= set(balanced_subset(labels, 60, seed=3))
    # by hand: the first 10 rows of each class in the order of the seeded permutation
    order = torch.randperm(120, generator=torch.Generator().manual_seed(3)).tolist()
    by_hand = [r for c in range(3) for r in [r for r in order if labels[r] == c][:10]]
    assert rows == sorted(by_hand)


@pytest.mark.parametrize("n, message", [(31, "multiple of the number of classes"), (0, "positive multiple"),
                                        (True, "positive multiple"), (63, "the rarest class has 20")])
def test_balanced_subset_refuses_what_it_cannot_give(n, message):
    with pytest.raises(ValueError, match=message):
        balanced_subset([0] * 70 + [1] * 30 + [2] * 20, n)


def test_scene_folds_keep_scenes_whole_and_are_about_equal():
    sections = [f"s{i % 13}" for i in range(200)]
    folds = scene_folds(sections, 4, seed=1)
    scene_fold = {}
    for s, f in zip(sections, folds):
        assert scene_fold.setdefault(s, f) == f  # a scene never straddles two folds
    sizes = Counter(folds)
    assert set(sizes) == {0, 1, 2, 3} and max(sizes.values()) - min(sizes.values()) <= 16  # one scene is 15-16
    assert folds == scene_folds(sections, 4, seed=1) and folds != scene_folds(sections, 4, seed=2)
    with pytest.raises(ValueError, match=r"k must be an integer from 2 to the number of scenes \(13\)"):
        scene_folds(sections, 14)


def test_standardised_logistic_regression_reaches_the_optimum_on_standardised_features():
    """The gradient of mean cross-entropy + l2/2 |W_z|^2 in the standardised features z is zero (NumPy here)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(90, 3, generator=g, dtype=torch.float64) * torch.tensor([0.01, 1.0, 100.0]) + 5.0
    x[:, 1] = 2.0  # a constant feature: centred, not divided by zero
    y = (x[:, 0] * 100 + x[:, 2] / 100 + 0.5 * torch.randn(90, generator=g, dtype=torch.float64) > 5.05).long()
    l2 = 0.1
    w, b = fit_standardised_logistic_regression(x, y, 2, l2=l2, max_iter=500)
    xn = x.numpy()
    mean, std = xn.mean(0), xn.std(0)
    std[1] = 1.0
    z = (xn - mean) / std
    w_z = w.numpy() * std  # the same classifier written for z
    logits = z @ w_z.T + (b.numpy() + w.numpy() @ mean)
    np.testing.assert_allclose(logits, (x @ w.T + b).numpy(), atol=1e-9)
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    onehot = np.eye(2)[y.numpy()]
    assert np.abs((p - onehot).T @ z / 90 + l2 * w_z).max() < 1e-6 and np.abs((p - onehot).mean(0)).max() < 1e-6
    assert w_z[:, 1] == pytest.approx([0.0, 0.0], abs=1e-9)  # the constant feature carries nothing


def labelled_head(seed=0, n=96):
    """A probe-ready head on a tiny GPT, token ids, and labels that a linear function of its states predicts."""
    body = tiny_gpt(seed)
    for p in body.parameters():
        p.requires_grad_(False)
    head = ClassifierHead(body, 2)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 11, (n, 12), generator=g)
    x = pooled_features(head, ids)
    score = x @ torch.randn(8, generator=g, dtype=torch.float64)
    labels = (score > score.median()).long()
    sections = [f"scene {i % 12}" for i in range(n)]
    return head, ids, labels, sections


def test_fit_probe_picks_the_l2_with_the_lowest_held_out_loss_and_refits_on_everything():
    head, ids, labels, sections = labelled_head()
    before = {k: v.clone() for k, v in head.body.state_dict().items()}
    grid = [1e-3, 1e-1, 10.0]
    fit = fit_probe(head, ids, labels, sections, l2_grid=grid, folds=3, seed=5)
    x = pooled_features(head, ids)
    fold = torch.tensor(scene_folds(sections, 3, seed=5))
    held_out = []
    for l2 in grid:  # the cross-validation written out: standardise each training part, score the held-out part
        loss = 0.0
        for f in range(3):
            tr, te = fold != f, fold == f
            mean, std = x[tr].mean(0), x[tr].std(0, unbiased=False)
            w, b = fit_logistic_regression((x[tr] - mean) / std, labels[tr], 2, l2=l2)
            loss += F.cross_entropy(((x[te] - mean) / std) @ w.T + b, labels[te], reduction="sum").item()
        held_out.append(loss / len(labels))
    assert fit["held_out_loss"] == pytest.approx(held_out, rel=1e-6)
    assert fit["l2"] == grid[int(np.argmin(held_out))] and fit["l2_grid"] == grid and fit["folds"] == 3
    mean, std = x.mean(0), x.std(0, unbiased=False)
    w, b = fit_logistic_regression((x - mean) / std, labels, 2, l2=fit["l2"])
    with torch.no_grad():
        np.testing.assert_allclose(head(ids).double().numpy(), (((x - mean) / std) @ w.T + b).numpy(), atol=1e-4)
    assert (head(ids).argmax(1) == labels).double().mean() > 0.9  # the labels are linear in the states
    assert all(torch.equal(before[k], v) for k, v in head.body.state_dict().items())
    assert 0.0 <= min(fit["held_out_accuracy"]) <= max(fit["held_out_accuracy"]) <= 1.0


def test_fit_probe_refuses_a_bad_grid():
    head, ids, labels, sections = labelled_head(n=24)
    with pytest.raises(ValueError, match="l2_grid must be positive numbers"):
        fit_probe(head, ids, labels, sections, l2_grid=[0.1, 0.0])


def test_features_are_what_the_linear_layer_reads():
    head, ids, _, _ = labelled_head(n=8)
    torch.nn.init.normal_(head.linear.weight)
    with torch.no_grad():
        assert torch.equal(head(ids), head.linear(head.features(ids)))


def test_lm_scores_are_each_rows_mean_next_token_loss():
    model = tiny_gpt(1)
    ids = torch.randint(0, 11, (5, 10), generator=torch.Generator().manual_seed(0))
    scores = lm_scores(model, ids, batch_size=2)
    by_row = [model(row[None, :-1], row[None, 1:])[1].item() for row in ids]  # the model's own loss, one row each
    assert scores.dtype == torch.float64 and scores.tolist() == pytest.approx(by_row, rel=1e-5)
    with pytest.raises(ValueError, match="seq >= 2"):
        lm_scores(model, ids[:, :1])
    encoder = MaskedLM(MaskedLMConfig(vocab_size=12, context_length=16, d_model=8, n_layers=1, n_heads=2))
    with pytest.raises(ValueError, match="needs a causal language model"):
        lm_scores(encoder, ids)
