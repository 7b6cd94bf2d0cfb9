import math

import pytest
import torch
import torch.nn.functional as F

from groundup.bigram import BigramLM, NGramLM, bigram_counts, perplexity


def test_counts_by_hand():
    # "abab" -> pairs ab, ba, ab
    counts = bigram_counts([0, 1, 0, 1], vocab_size=3)
    expected = torch.tensor([[0, 2, 0], [1, 0, 0], [0, 0, 0]])
    assert torch.equal(counts, expected)
    assert counts.sum() == 3


def test_probabilities_are_smoothed_counts_and_rows_sum_to_one():
    model = BigramLM.fit([0, 1, 0, 1], vocab_size=3, alpha=1.0)
    assert torch.allclose(model.probs[0], torch.tensor([1 / 5, 3 / 5, 1 / 5], dtype=torch.float64))
    assert torch.allclose(model.probs.sum(dim=1), torch.ones(3, dtype=torch.float64))
    # A row never seen is uniform.
    assert torch.allclose(model.probs[2], torch.full((3,), 1 / 3, dtype=torch.float64))


def test_maximum_likelihood_without_smoothing():
    model = BigramLM.fit([0, 1, 0, 1, 1], vocab_size=2, alpha=0)
    assert torch.allclose(model.probs, torch.tensor([[0.0, 1.0], [0.5, 0.5]], dtype=torch.float64))
    assert model.loss([0, 0]) == math.inf


def test_loss_equals_pytorch_cross_entropy():
    torch.manual_seed(0)
    ids = torch.randint(0, 7, (500,))
    model = BigramLM.fit(ids[:400], vocab_size=7, alpha=0.5)
    val = ids[400:]
    logits = torch.log(model.probs[val[:-1]])  # log-probabilities are valid logits
    reference = F.cross_entropy(logits, val[1:]).item()
    assert model.loss(val) == pytest.approx(reference, rel=1e-12)
    assert model.perplexity(val) == pytest.approx(math.exp(reference), rel=1e-12)


def test_uniform_model_has_perplexity_vocab_size():
    model = BigramLM(torch.zeros(10, 10, dtype=torch.long), alpha=1.0)
    assert model.perplexity([3, 1, 4, 1, 5, 9, 2, 6]) == pytest.approx(10.0, rel=1e-12)
    assert perplexity(math.log(10)) == pytest.approx(10.0)


def test_sampling_follows_the_counts_and_is_reproducible():
    model = BigramLM.fit([0, 1, 2, 0, 1, 2, 0, 1, 2], vocab_size=3, alpha=0)
    assert model.sample(0, 5) == [0, 1, 2, 0, 1, 2]  # deterministic transitions
    noisy = BigramLM.fit(torch.randint(0, 5, (200,), generator=torch.Generator().manual_seed(1)), 5)
    a = noisy.sample(0, 30, generator=torch.Generator().manual_seed(7))
    b = noisy.sample(0, 30, generator=torch.Generator().manual_seed(7))
    assert a == b and len(a) == 31


@pytest.mark.parametrize("call, error, match", [
    (lambda: bigram_counts([0, 5], vocab_size=3), ValueError, r"must lie in \[0, 3\)"),
    (lambda: bigram_counts([[0, 1]], vocab_size=3), ValueError, "1-D sequence"),
    (lambda: bigram_counts(torch.tensor([0.5, 1.0]), vocab_size=3), TypeError, "integer token ids"),
    (lambda: bigram_counts([0, 1], vocab_size=0), ValueError, "vocab_size must be a positive integer"),
    (lambda: BigramLM.fit([0, 1], 2, alpha=-1), ValueError, "alpha must be a finite non-negative number"),
    (lambda: BigramLM.fit([0, 1], 2).loss([1]), ValueError, "at least 2 tokens"),
    (lambda: BigramLM.fit([0, 1], 2).sample(2, 3), ValueError, r"token must lie in \[0, 2\)"),
    (lambda: BigramLM(torch.zeros(2, 3)), ValueError, "square"),
])
def test_bad_input_is_rejected_clearly(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_ngram_with_n_2_is_the_bigram_model():
    from groundup.bigram import NGramLM

    g = torch.Generator().manual_seed(0)
    train, val = torch.randint(0, 6, (500,), generator=g), torch.randint(0, 6, (100,), generator=g)
    for alpha in (1.0, 0.1):
        assert NGramLM.fit(train, 6, 2, alpha=alpha).loss(val) == pytest.approx(
            BigramLM.fit(train, 6, alpha=alpha).loss(val), rel=1e-12)


def test_ngram_probabilities_match_counting_by_hand():
    from collections import Counter

    from groundup.bigram import NGramLM

    g = torch.Generator().manual_seed(1)
    train, val = torch.randint(0, 4, (300,), generator=g).tolist(), torch.randint(0, 4, (50,), generator=g).tolist()
    n, alpha, v = 4, 0.5, 4
    pairs = Counter(tuple(train[i:i + n]) for i in range(len(train) - n + 1))
    contexts = Counter()
    for key, count in pairs.items():
        contexts[key[:-1]] += count
    expected = [math.log((pairs[tuple(val[i:i + n])] + alpha) / (contexts[tuple(val[i:i + n - 1])] + alpha * v))
                for i in range(len(val) - n + 1)]
    got = NGramLM.fit(train, v, n, alpha=alpha).log_probs(val)
    assert got.tolist() == pytest.approx(expected, rel=1e-12)
    assert torch.exp(NGramLM.fit(train, v, n, alpha=alpha).log_probs([0, 1, 2, 3])).item() > 0


@pytest.mark.parametrize("kwargs, message", [
    (dict(n=0), "n must be an integer"), (dict(n=2.0), "n must be an integer"),
    (dict(n=2, alpha=0), "alpha must be a positive"), (dict(n=2, alpha=float("nan")), "alpha must be a positive"),
    (dict(n=40), "overflow int64|n must be an integer"),
])
def test_ngram_rejects_bad_arguments(kwargs, message):
    from groundup.bigram import NGramLM

    with pytest.raises(ValueError, match=message):
        NGramLM.fit(list(range(5)) * 10, 5, **kwargs)


# ---- hardening: API traps --------------------------------------------------------------------------------


@pytest.mark.parametrize("alpha", [float("nan"), float("inf"), -1.0, "1", True])
def test_bigram_rejects_non_finite_or_negative_smoothing(alpha):
    with pytest.raises(ValueError, match="alpha must be a finite non-negative number"):
        BigramLM.fit([0, 1, 2], 3, alpha=alpha)


def test_bigram_rejects_negative_fractional_or_boolean_counts():
    counts = torch.tensor([[1, 0], [2, 3]])
    with pytest.raises(ValueError, match="counts must be >= 0"):
        BigramLM(counts - 2)
    with pytest.raises(ValueError, match="counts must be whole numbers"):
        BigramLM(counts + 0.5)
    with pytest.raises(ValueError, match="counts must be whole numbers"):
        BigramLM(torch.tensor([[1.0, float("nan")], [0.0, 1.0]]))
    with pytest.raises(TypeError, match="counts must hold integer counts"):
        BigramLM(counts > 0)
    with pytest.raises(TypeError, match="counts must be a torch.Tensor"):
        BigramLM([[1, 0], [2, 3]])
    assert torch.equal(BigramLM(counts.double()).probs, BigramLM(counts).probs)  # whole floats are fine


def test_bigram_refuses_float_token_ids_instead_of_truncating():
    lm = BigramLM.fit([0, 1, 2, 1], 3)
    with pytest.raises(TypeError, match="token must be an integer token id, got float 1.7"):
        lm.next_token_probs(1.7)
    with pytest.raises(TypeError, match="start must be an integer token id"):
        lm.sample(0.5, 3)
    with pytest.raises(TypeError, match="ids must hold integer token ids"):
        lm.loss([0.0, 1.5])
    assert torch.equal(lm.next_token_probs(torch.tensor(1)), lm.next_token_probs(1))


def test_bigram_sample_rejects_an_int_as_generator():
    lm = BigramLM.fit([0, 1, 2, 1], 3)
    with pytest.raises(TypeError, match=r"generator must be a torch.Generator .* got int 0"):
        lm.sample(0, 3, generator=0)


def test_bigram_and_ngram_accept_numpy_integers():
    np = pytest.importorskip("numpy")
    ids = np.array([0, 1, 2, 1, 0])
    lm = BigramLM.fit(ids, np.int64(3))
    g = torch.Generator().manual_seed(0)
    assert lm.sample(np.int64(1), np.int64(4), generator=g) == lm.sample(1, 4, generator=g.manual_seed(0))
    assert NGramLM.fit(ids, np.int64(3), np.int64(2)).loss(ids) == pytest.approx(NGramLM.fit(ids, 3, 2).loss(ids))


def test_ngram_counted_loss_is_the_training_loss_and_leave_one_out_refits_without_each_occurrence():
    from collections import Counter

    g = torch.Generator().manual_seed(2)
    train = torch.randint(0, 5, (400,), generator=g).tolist()
    n, alpha, v = 3, 0.3, 5
    model = NGramLM.fit(train, v, n, alpha=alpha)
    assert model.counted_loss() == pytest.approx(model.loss(train), rel=1e-12)
    # Leave-one-out by brute force: for every window, remove it from the counts and score it with the rest.
    pairs = Counter(tuple(train[i:i + n]) for i in range(len(train) - n + 1))
    contexts = Counter()
    for key, count in pairs.items():
        contexts[key[:-1]] += count
    expected = -sum(math.log((pairs[w] - 1 + alpha) / (contexts[w[:-1]] - 1 + alpha * v))
                    for w in (tuple(train[i:i + n]) for i in range(len(train) - n + 1))) / (len(train) - n + 1)
    assert model.counted_loss(leave_one_out=True) == pytest.approx(expected, rel=1e-12)
    assert model.counted_loss(leave_one_out=True) > model.counted_loss()
    with pytest.raises(TypeError, match="leave_one_out must be True or False"):
        model.counted_loss(leave_one_out=1)


def test_ngram_with_alpha_equals_refitting():
    g = torch.Generator().manual_seed(3)
    train, val = torch.randint(0, 6, (300,), generator=g), torch.randint(0, 6, (80,), generator=g)
    model = NGramLM.fit(train, 6, 4, alpha=1.0)
    assert model.with_alpha(0.05).loss(val) == pytest.approx(NGramLM.fit(train, 6, 4, alpha=0.05).loss(val),
                                                             rel=1e-12)
    assert model.alpha == 1.0
    with pytest.raises(ValueError, match="alpha must be a positive"):
        model.with_alpha(0)


@pytest.mark.parametrize("length, vocab, orders", [(500, 4, [2, 3, 5, 7]), (9, 3, [1, 4, 9]), (60, 2, [6, 6, 3])])
def test_ngram_fit_orders_equals_fitting_each_order(length, vocab, orders):
    ids = torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(length))
    models = NGramLM.fit_orders(ids, vocab, orders, alpha=0.2)
    assert sorted(models) == sorted(set(orders))
    for n, model in models.items():
        alone = NGramLM.fit(ids, vocab, n, alpha=0.2)
        for name in ("context_keys", "context_counts", "pair_keys", "pair_counts"):
            assert torch.equal(getattr(model, name), getattr(alone, name)), (n, name)
        assert model.n == n and model.alpha == 0.2


def test_ngram_fit_orders_rejects_bad_orders():
    with pytest.raises(ValueError, match="at least one n"):
        NGramLM.fit_orders([0, 1, 0], 2, [])
    with pytest.raises(ValueError, match="every n in orders"):
        NGramLM.fit_orders([0, 1, 0], 2, [2, 4])
    with pytest.raises(ValueError, match="every n in orders"):
        NGramLM.fit_orders([0, 1, 0], 2, [2.0])
