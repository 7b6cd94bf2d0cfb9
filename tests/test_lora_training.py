"""Training a model with LoRA adapters: adapters-only checkpoints, exact resumption, the base they belong to."""


import pytest
import torch
from ctrl_c import ctrl_c_on_call

import groundup.training as training
from groundup.lora import attach_lora, base_fingerprint, count_parameters, lora_layers
from groundup.models import GPT, GPTConfig
from groundup.training import CHECKPOINT_NAME, TrainConfig, load_checkpoint, save_checkpoint, train

TINY = dict(vocab_size=12, context_length=16, d_model=16, n_layers=2, n_heads=2)


def base_model(seed=0, **kw):
    torch.manual_seed(seed)
    return GPT(GPTConfig(**{**TINY, **kw}))


def adapted(base_seed=0, adapter_seed=1, **kw):
    """A tiny 'pretrained' GPT (seed ``base_seed``) with rank-2 adapters on W_q and W_v (dropout 0.1)."""
    model = base_model(base_seed, **kw)
    torch.manual_seed(adapter_seed)
    attach_lora(model, ("W_q", "W_v"), r=2, alpha=4, dropout=0.1)
    return model


def pattern_data(n=2000, vocab=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.arange(n) % 5
    noise = torch.rand(n, generator=g) < 0.1
    return torch.where(noise, torch.randint(0, vocab, (n,), generator=g), ids)


def config(**kw):
    return TrainConfig(**{**dict(batch_size=4, max_steps=24, learning_rate=1e-2, warmup_steps=3, eval_interval=10,
                                 eval_batches=2, progress=False), **kw})


def adapter_params(model):
    return {f"{name}.{k}": getattr(layer, k).detach().clone() for name, layer in lora_layers(model).items()
            for k in ("A", "B")}


def interrupt_at(monkeypatch, call: int) -> None:
    """Ctrl-C during step ``call`` of the next run (train saves a checkpoint at the end of that step)."""
    ctrl_c_on_call(monkeypatch, training, "get_batch", call)


def test_an_interrupted_lora_run_resumed_from_its_adapters_only_checkpoint_ends_bit_for_bit_the_same(
        tmp_path, monkeypatch):
    data, val = pattern_data(), pattern_data(seed=1)
    whole = adapted()
    frozen = {k: v.clone() for k, v in whole.state_dict().items() if not k.endswith((".A", ".B"))}
    history_whole = train(whole, data, val, config(out_dir=tmp_path / "whole"))

    interrupt_at(monkeypatch, 7)
    with pytest.raises(KeyboardInterrupt, match="after step 7"):
        train(adapted(), data, val, config(out_dir=tmp_path / "cut"))
    monkeypatch.undo()
    ckpt = torch.load(tmp_path / "cut" / CHECKPOINT_NAME, weights_only=True)
    assert ckpt["step"] == 7 and ckpt["adapters_only"] is True and ckpt["trainable"] == {}
    assert set(ckpt["model"]["A"]) == set(lora_layers(whole))  # the adapters and nothing of the base

    torch.manual_seed(12345)  # the run's own random states (LoRA dropout, batches) come back from the checkpoint
    resumed = adapted(adapter_seed=99)  # the same base; its fresh adapters are overwritten by the stored ones
    history = train(resumed, data, val, config(out_dir=tmp_path / "cut", resume=True))
    assert history.step == list(range(1, 25))
    assert history.train_loss == history_whole.train_loss and history.val_loss == history_whole.val_loss
    expected = adapter_params(whole)
    assert history_whole.train_loss[-1] < history_whole.train_loss[0]
    assert not torch.equal(expected["blocks.0.attention.W_q.B"], torch.zeros(16, 2)), "the adapters learnt"
    for name, value in adapter_params(resumed).items():
        assert torch.equal(value, expected[name]), f"{name} differs after resuming"
    for name, value in frozen.items():  # the base stayed frozen in both runs
        assert torch.equal(whole.state_dict()[name], value) and torch.equal(resumed.state_dict()[name], value), name


def test_an_adapters_only_checkpoint_is_a_small_fraction_of_the_base(tmp_path):
    kw = dict(d_model=64, n_heads=4)
    model = adapted(**kw)
    train(model, pattern_data(), pattern_data(seed=1), config(max_steps=3, out_dir=tmp_path / "lora"))
    save_checkpoint(tmp_path / "full.pt", base_model(**kw))
    ckpt = torch.load(tmp_path / "lora" / CHECKPOINT_NAME, weights_only=True)
    # stored numbers: the adapters, plus AdamW's two moments of each of them
    trainable = count_parameters(model, trainable_only=True)
    stored = sum(t.numel() for part in ("A", "B") for t in ckpt["model"][part].values())
    moments = sum(t.numel() for s in ckpt["optimizer"]["state"].values() for k, t in s.items() if k != "step")
    assert stored == trainable == 2 * 2 * 2 * (64 + 64) and moments == 2 * trainable
    assert count_parameters(model) > 40 * trainable
    size = (tmp_path / "lora" / CHECKPOINT_NAME).stat().st_size
    assert size < (tmp_path / "full.pt").stat().st_size / 8


def test_adapters_for_another_base_are_refused_on_resume_and_load(tmp_path):
    data = pattern_data()
    train(adapted(), data, data, config(max_steps=4, out_dir=tmp_path))
    with pytest.raises(ValueError, match="trained on another base model"):
        train(adapted(base_seed=5), data, data, config(max_steps=8, out_dir=tmp_path, resume=True))
    with pytest.raises(ValueError, match="trained on another base model"):
        load_checkpoint(tmp_path, base_model(5))
    with pytest.raises(ValueError, match="LoRA adapters only.*pass it as model"):
        load_checkpoint(tmp_path)
    with pytest.raises(ValueError, match="different configuration"):
        load_checkpoint(tmp_path, base_model(d_model=32))
    with pytest.raises(ValueError, match="has none: attach them"):  # resuming onto the bare base
        train(base_model(), data, data, config(max_steps=8, out_dir=tmp_path, resume=True))


def test_loading_adapters_onto_the_bare_base_attaches_them(tmp_path):
    model = adapted()
    train(model, pattern_data(), pattern_data(), config(max_steps=4, out_dir=tmp_path))
    loaded, ckpt = load_checkpoint(tmp_path, base_model())
    assert set(lora_layers(loaded)) == set(lora_layers(model))
    x = torch.randint(0, 12, (2, 16))
    model.eval(), loaded.eval()
    assert torch.equal(loaded(x)[0], model(x)[0])
    names = lora_layers(model)
    assert ckpt["model"]["base_sha256"] == base_fingerprint(base_model(), names)


def test_trainable_parameters_besides_the_adapters_are_stored_too(tmp_path):
    model = adapted()
    model.final_norm.weight.requires_grad_(True)  # a part of the base trained along with the adapters
    train(model, pattern_data(), pattern_data(), config(max_steps=4, out_dir=tmp_path))
    ckpt = torch.load(tmp_path / CHECKPOINT_NAME, weights_only=True)
    assert set(ckpt["trainable"]) == {"final_norm.weight"}
    loaded, _ = load_checkpoint(tmp_path, base_model())
    assert not torch.equal(loaded.final_norm.weight, base_model().final_norm.weight)
    assert torch.equal(loaded.final_norm.weight, model.final_norm.weight) and loaded.final_norm.weight.requires_grad


def test_a_whole_model_checkpoint_is_not_loaded_into_an_adapted_model(tmp_path):
    save_checkpoint(tmp_path / "c.pt", base_model())
    assert "adapters_only" not in torch.load(tmp_path / "c.pt", weights_only=True)  # the format of before
    with pytest.raises(ValueError, match="holds a whole model"):
        load_checkpoint(tmp_path / "c.pt", adapted())
