"""groundup.footprint's sizes from a configuration alone equal those of the model built from it (issue 40)."""

import itertools

import pytest

from groundup.footprint import (
    buffer_bytes,
    config_model_bytes,
    config_training_bytes,
    meta_model,
    model_bytes,
    parameter_count,
    training_bytes,
)
from groundup.induction import AttentionOnlyConfig
from groundup.layers import ACTIVATIONS, NORM_POSITIONS, NORMS
from groundup.models import (
    ENCODER_DECODER_POSITIONALS,
    GPT,
    POSITIONALS,
    EncoderDecoder,
    EncoderDecoderConfig,
    GPTConfig,
    MaskedLM,
    MaskedLMConfig,
)

SMALL = dict(vocab_size=7, context_length=5, d_model=8, n_layers=2, n_heads=4, d_ff=12)


def _gpt_configs():
    """Every norm, norm position, positional, tying, activation and bias flag together (384), with grouped-query
    heads (None, 1, 2 of 4), QK-norm and parallel blocks (Pre-LN only) taking each of their values in turn."""
    grid = itertools.product(NORMS, NORM_POSITIONS, POSITIONALS, (True, False), ACTIVATIONS, (True, False))
    for i, (norm, position, positional, tie, activation, bias) in enumerate(grid):
        yield dict(norm=norm, norm_position=position, positional=positional, tie_weights=tie, activation=activation,
                   bias=bias, n_kv_heads=(None, 1, 2)[i % 3], qk_norm=bool(i // 3 % 2),
                   parallel_block=position == "pre" and bool(i // 6 % 2))


def _assert_counted(model, config):
    n = sum(p.numel() for p in model.parameters())
    assert parameter_count(config) == n, config
    assert config_model_bytes(config) == model_bytes(model) == 4 * n + buffer_bytes(config), config
    assert config_training_bytes(config, 3, 5) == training_bytes(model, 3, 5), config


@pytest.mark.parametrize("model_cls, config_cls", [(GPT, GPTConfig), (MaskedLM, MaskedLMConfig),
                                                    (GPT, AttentionOnlyConfig)])
def test_the_count_from_the_configuration_is_the_built_models(model_cls, config_cls):
    options = list(_gpt_configs())
    assert len(options) == 384
    for option in options:
        config = config_cls(**SMALL, **option)
        _assert_counted(model_cls(config), config)


def test_the_count_follows_every_size_and_the_default_d_ff():
    for sizes in (dict(vocab_size=1, context_length=1, d_model=2, n_layers=1, n_heads=1),
                  dict(vocab_size=65, context_length=33, d_model=24, n_layers=3, n_heads=6, d_ff=40),
                  dict(vocab_size=11, context_length=9, d_model=12, n_layers=1, n_heads=3, n_kv_heads=1)):
        for positional in POSITIONALS:
            config = GPTConfig(**sizes, positional=positional)
            _assert_counted(GPT(config), config)


def test_the_encoder_decoders_count_is_its_models():
    for norm, position, positional, tie in itertools.product(NORMS, NORM_POSITIONS, ENCODER_DECODER_POSITIONALS,
                                                             (True, False)):
        config = EncoderDecoderConfig(src_vocab_size=9, tgt_vocab_size=6, context_length=5, d_model=8,
                                      n_encoder_layers=2, n_decoder_layers=3, n_heads=2, d_ff=12,
                                      positional=positional, norm=norm, norm_position=position, tie_weights=tie)
        _assert_counted(EncoderDecoder(config), config)


def test_chapter_6s_count_by_hand():
    # the book's CPU recipe with 65 characters: embedding 65 x 192 (tied), per block 2 LayerNorms (2 x 2 x 192),
    # attention 4 x (192^2 + 192), FFN 192 x 768 + 768 + 768 x 192 + 192; the final LayerNorm; RoPE: no parameters
    d, f = 192, 768
    block = 2 * 2 * d + 4 * (d * d + d) + (d * f + f) + (f * d + d)
    config = GPTConfig(vocab_size=65, context_length=128, d_model=d, n_layers=4, n_heads=6, positional="rope")
    assert parameter_count(config) == 65 * d + 4 * block + 2 * d
    assert buffer_bytes(config) == 8 * 16  # d_head / 2 = 16 frequencies in float64


def test_absurd_configurations_are_counted_without_building_anything(monkeypatch):
    from groundup import layers

    def forbidden(*args, **kwargs):
        raise AssertionError("a block was built")

    monkeypatch.setattr(layers.TransformerBlock, "__init__", forbidden)
    monkeypatch.setattr(layers.DecoderBlock, "__init__", forbidden)
    huge = GPTConfig(vocab_size=65, context_length=10**7, d_model=192, n_layers=10**5, n_heads=6, positional="alibi")
    n = parameter_count(huge)
    assert n == 65 * 192 + 10**5 * (4 * 192 + 4 * (192**2 + 192) + 2 * 192 * 768 + 768 + 192) + 2 * 192
    assert buffer_bytes(huge) == 4 * 6 * 10**14  # ALiBi's table, n_H x n_C x n_C float32
    assert config_training_bytes(huge, 8, 10**7)["total"] > 10**15
    dates = EncoderDecoderConfig(src_vocab_size=79, tgt_vocab_size=14, n_encoder_layers=10**5, n_decoder_layers=10**5)
    assert parameter_count(dates) > 10**5 * 2 * 4 * 64**2
    with pytest.raises(TypeError, match="GPTConfig or an EncoderDecoderConfig"):
        parameter_count(dict(d_model=8))


def test_the_meta_models_sizes_agree_too():
    config = GPTConfig(vocab_size=50, context_length=16, d_model=32, n_layers=3, n_heads=4, tie_weights=False,
                       positional="sinusoidal", norm="rmsnorm", activation="swiglu", bias=False, n_kv_heads=2)
    shape = meta_model(GPT, config)
    assert config_training_bytes(config, 4, 16) == training_bytes(shape, 4, 16)
