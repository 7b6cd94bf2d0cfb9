"""Tests for groundup.induction: the repeated-token task, attention-only configs, the hand-built induction model."""

import math

import pytest
import torch
import torch.nn.functional as F

from groundup.induction import (
    IGNORE,
    AttentionOnlyConfig,
    hand_built_induction_model,
    in_context_loss,
    induction_batches,
    induction_targets,
    random_repeats,
    repeated_random_tokens,
)
from groundup.layers import TransformerBlock
from groundup.models import GPT, GPTConfig
from groundup.training import TrainConfig, train


def _permutation_repeats(n_seq, vocab_size, seed=0):
    g = torch.Generator().manual_seed(seed)
    first = torch.stack([torch.randperm(vocab_size, generator=g) for _ in range(n_seq)])
    return torch.cat([first, first], dim=1)


def test_repeated_random_tokens_repeat_and_are_reproducible():
    t = repeated_random_tokens(5, 7, 11, torch.Generator().manual_seed(3))
    assert t.shape == (5, 14) and t.dtype == torch.long
    assert torch.equal(t[:, 7:], t[:, :7]) and int(t.min()) >= 0 and int(t.max()) < 11
    assert torch.equal(t, repeated_random_tokens(5, 7, 11, torch.Generator().manual_seed(3)))
    assert not torch.equal(t, repeated_random_tokens(5, 7, 11, torch.Generator().manual_seed(4)))


@pytest.mark.parametrize("args, match", [((0, 4, 10), "n_seq"), ((2, 0, 10), "half_len"), ((2, 4, 1.5), "vocab_size")])
def test_repeated_random_tokens_bad_arguments(args, match):
    with pytest.raises(ValueError, match=match):
        repeated_random_tokens(*args)
    with pytest.raises(TypeError, match="generator"):
        repeated_random_tokens(2, 4, 10, 0)


def test_induction_targets_keep_only_the_predictable_tokens():
    t = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8]])
    assert induction_targets(t).tolist() == [[IGNORE] * 4 + [6, 7, 8, IGNORE]]
    with pytest.raises(ValueError, match="repeat"):
        induction_targets(torch.tensor([[1, 2, 3, 4]]))
    with pytest.raises(ValueError, match="shape"):
        induction_targets(torch.tensor([[1, 2, 1]]))


def test_random_repeats_targets_are_the_tokens_one_period_back():
    tokens, targets = random_repeats(50, 24, 9, torch.Generator().manual_seed(1), min_half=3)
    assert tokens.shape == targets.shape == (50, 24)
    periods = set()
    for row in range(50):
        kept = (targets[row] != IGNORE).nonzero().flatten()
        h = len(kept) + 1  # H - 1 targets per row
        assert 3 <= h <= 12
        periods.add(h)
        assert kept.tolist() == list(range(24 - h, 23))
        for p in kept.tolist():
            assert targets[row, p] == tokens[row, p + 1] == tokens[row, p + 1 - h]
    assert len(periods) > 5  # the distance to the copy varies: no positional shortcut
    (x,), y = induction_batches(9, 4, 24, torch.Generator().manual_seed(2))
    assert x.shape == y.shape == (4, 24)
    with pytest.raises(ValueError, match="min_half"):
        random_repeats(2, 10, 5, min_half=6)


def test_in_context_loss_is_cross_entropy_on_the_repeated_half():
    torch.manual_seed(0)
    model = GPT(AttentionOnlyConfig(vocab_size=13, context_length=16, d_model=16, n_heads=2))
    tokens = repeated_random_tokens(3, 8, 13, torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits, _ = model(tokens)
    expected = F.cross_entropy(logits[:, 8:15].reshape(-1, 13), tokens[:, 9:16].reshape(-1))
    assert in_context_loss(model, tokens) == pytest.approx(float(expected), rel=1e-6)
    assert model.training  # the mode is restored


def test_attention_only_blocks_have_no_ffn_and_compute_x_plus_attention():
    torch.manual_seed(0)
    for position in ("pre", "post"):
        config = AttentionOnlyConfig(vocab_size=10, context_length=8, d_model=16, n_heads=4, norm_position=position)
        block = GPT(config).blocks[0]
        assert not hasattr(block, "ffn") and not hasattr(block, "norm_2")
        x = torch.randn(2, 8, 16)
        att = block.attention
        expected = (x + att(block.norm_1(x), is_causal=True) if position == "pre"
                    else block.norm_1(x + att(x, is_causal=True)))
        assert torch.equal(block(x, is_causal=True), expected)
    with pytest.raises(ValueError, match="ffn must be False"):
        AttentionOnlyConfig(ffn=True)
    assert AttentionOnlyConfig().n_layers == 2


def test_old_configs_keep_their_ffn_and_parameters():
    """GPTConfig has no ffn field: blocks read getattr(config, "ffn", True), so old models are unchanged."""
    config = GPTConfig(vocab_size=10, context_length=8, d_model=16, n_layers=1, n_heads=4)
    assert "ffn" not in vars(config)
    torch.manual_seed(0)
    model = GPT(config)
    names = [n for n, _ in model.named_parameters()]
    assert "blocks.0.ffn.W_in.weight" in names and "blocks.0.norm_2.weight" in names
    block, x = model.blocks[0], torch.randn(2, 8, 16)
    h = x + block.attention(block.norm_1(x), is_causal=True)
    assert torch.equal(block(x, is_causal=True), h + block.ffn(block.norm_2(h)))
    with pytest.raises(TypeError, match="config.ffn"):
        TransformerBlock(type("C", (), {**vars(config), "ffn": 0})())


def test_hand_built_model_predicts_the_repeat():
    model = hand_built_induction_model(10, 20)
    tokens = _permutation_repeats(6, 10)
    assert in_context_loss(model, tokens) < 1e-6
    with torch.no_grad():
        logits, _ = model(tokens)
    assert torch.equal(logits[:, 10:19].argmax(-1), tokens[:, 11:20])
    # without the context it cannot know: the first half is predicted no better than chance
    first = F.cross_entropy(logits[:, :9].reshape(-1, 10), tokens[:, 1:10].reshape(-1))
    assert float(first) > math.log(10) - 0.5
    with pytest.raises(ValueError, match="context_length"):
        hand_built_induction_model(4, 20)


def test_induction_batches_train_through_train():
    torch.manual_seed(0)
    model = GPT(AttentionOnlyConfig(vocab_size=16, context_length=16, d_model=16, n_heads=2))
    config = TrainConfig(batch_size=4, max_steps=3, warmup_steps=1, eval_interval=3, eval_batches=2, progress=False)
    history = train(model, 16, 16, config, batches=induction_batches)
    assert len(history.val_loss) == 1 and math.isfinite(history.val_loss[0])
