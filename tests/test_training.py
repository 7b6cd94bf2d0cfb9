"""groundup.training: the schedule, the parameter groups, evaluation, the loop, checkpoints and exact resumption."""

import dataclasses
import json
import math
import signal
import time

import pytest
import torch
import torch.nn.functional as F
from ctrl_c import ctrl_c_on_call

import groundup.training as training
from groundup.footprint import parameter_count
from groundup.models import (
    GPT,
    EncoderDecoder,
    EncoderDecoderConfig,
    GPTConfig,
    MaskedLM,
    MaskedLMConfig,
)
from groundup.training import (
    HISTORY_NAME,
    History,
    TrainConfig,
    evaluate,
    load_checkpoint,
    lr_at,
    param_groups,
    save_checkpoint,
    train,
)

TINY = dict(vocab_size=12, context_length=16, d_model=16, n_layers=2, n_heads=2)


def tiny_model(seed=0, **kw):
    torch.manual_seed(seed)
    return GPT(GPTConfig(**{**TINY, **kw}))


def pattern_data(n=3000, vocab=12, seed=0):
    """A learnable sequence: a repeating pattern of 7 tokens with 10 % random noise."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.arange(n) % 7
    noise = torch.rand(n, generator=g) < 0.1
    return torch.where(noise, torch.randint(0, vocab, (n,), generator=g), ids)


def config(**kw):
    return TrainConfig(**{**dict(batch_size=4, max_steps=30, learning_rate=3e-3, warmup_steps=5, eval_interval=10,
                                 eval_batches=4, progress=False), **kw})


# --- the schedule --------------------------------------------------------------------------------------------


def test_lr_schedule_warms_up_linearly_then_follows_the_cosine():
    c = TrainConfig(max_steps=110, learning_rate=1.0, min_lr=0.1, warmup_steps=10)
    assert [lr_at(s, c) for s in range(10)] == pytest.approx([(s + 1) / 10 for s in range(10)])
    assert lr_at(10, c) == pytest.approx(1.0)  # the peak, right after warm-up
    assert lr_at(60, c) == pytest.approx(0.55)  # half way down the cosine: (1.0 + 0.1) / 2
    assert lr_at(35, c) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4)))
    assert lr_at(110, c) == pytest.approx(0.1) and lr_at(500, c) == pytest.approx(0.1)
    values = [lr_at(s, c) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(values, values[1:])), "the cosine part never increases"


def test_lr_schedule_without_warmup_starts_at_the_peak_and_min_lr_defaults_to_a_tenth():
    c = TrainConfig(max_steps=100, learning_rate=2e-3, warmup_steps=0)
    assert c.min_lr == pytest.approx(2e-4)
    assert lr_at(0, c) == pytest.approx(2e-3)


def test_train_uses_the_scheduled_learning_rates():
    history = train(tiny_model(), pattern_data(), pattern_data(seed=1), config())
    c = config()
    assert history.lr == pytest.approx([lr_at(s, c) for s in range(c.max_steps)])


# --- parameter groups ----------------------------------------------------------------------------------------


def test_weight_decay_applies_to_matrices_only_and_every_parameter_once():
    model = tiny_model()
    decay, no_decay = param_groups(model, 0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() < 2 for p in no_decay["params"])
    ids = [id(p) for p in decay["params"] + no_decay["params"]]
    assert len(ids) == len(set(ids)) == len(list(model.parameters()))
    names = {id(p): n for n, p in model.named_parameters()}
    assert names[id(model.token_embedding.weight)] in {names[id(p)] for p in decay["params"]}
    assert all("norm" in names[id(p)] or names[id(p)].endswith("bias") for p in no_decay["params"])


def test_weight_decay_leaves_vectors_alone_during_training():
    """With zero gradients for a vector, AdamW with decay would still shrink it; ours must not."""
    model = tiny_model()
    with torch.no_grad():
        model.blocks[0].norm_1.bias.fill_(0.5)
    before = model.blocks[0].norm_1.bias.detach().clone()
    optimizer = torch.optim.AdamW(param_groups(model, 0.5), lr=0.1)
    for p in model.parameters():  # zero gradients: Adam's own update is 0, only weight decay can move a weight
        p.grad = torch.zeros_like(p)
    matrix_before = model.blocks[0].ffn.W_in.weight.detach().clone()
    optimizer.step()
    assert torch.equal(model.blocks[0].norm_1.bias, before), "a bias must not be decayed"
    assert torch.allclose(model.blocks[0].ffn.W_in.weight, matrix_before * (1 - 0.1 * 0.5)), "matrices are decayed"


# --- config validation ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, error", [
    (dict(batch_size=0), ValueError), (dict(batch_size=2.5), TypeError), (dict(max_steps=True), TypeError),
    (dict(learning_rate=0), ValueError), (dict(learning_rate=float("nan")), TypeError),
    (dict(min_lr=1.0, learning_rate=0.1), ValueError), (dict(beta2=1.0), ValueError),
    (dict(grad_clip=-1.0), ValueError), (dict(warmup_steps=-1), ValueError), (dict(resume=True), ValueError),
    (dict(eval_batches=0), ValueError), (dict(out_dir=3), TypeError), (dict(progress="yes"), TypeError),
])
def test_train_config_rejects_bad_values(kwargs, error):
    with pytest.raises(error):
        TrainConfig(**kwargs)


def test_train_rejects_bad_inputs(tmp_path):
    model, data = tiny_model(), pattern_data()
    with pytest.raises(TypeError, match="config must be a TrainConfig"):
        train(model, data, data, {"max_steps": 3})
    with pytest.raises(ValueError, match="val_data has 5 tokens"):
        train(model, data, data[:5], config())
    with pytest.raises(ValueError, match="train_data must be a 1-D"):
        train(model, data.float(), data, config())
    with pytest.raises(ValueError, match="exceeds the model's context_length"):
        train(model, data, data, config(context_length=64))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        train(model, data, data, config(out_dir=tmp_path, resume=True))


# --- evaluation ----------------------------------------------------------------------------------------------


def test_evaluate_is_the_mean_loss_over_non_overlapping_windows():
    model, data = tiny_model(), pattern_data(200)
    n_c = TINY["context_length"]
    windows = [data[s:s + n_c + 1] for s in range(0, len(data) - n_c, n_c)]
    model.eval()
    with torch.no_grad():
        losses = [F.cross_entropy(model(w[None, :-1])[0][0], w[1:], reduction="sum") for w in windows]
    expected = sum(loss.item() for loss in losses) / (len(windows) * n_c)
    model.train()
    assert evaluate(model, data, batch_size=3) == pytest.approx(expected, rel=1e-6)
    assert model.training, "evaluate restores training mode"
    assert evaluate(model, data, batch_size=3, max_batches=2) == evaluate(model, data, batch_size=3, max_batches=2)


def test_evaluate_at_initialisation_is_about_ln_vocab_size():
    assert evaluate(tiny_model(), pattern_data()) == pytest.approx(math.log(12), abs=0.1)


# --- the loop ------------------------------------------------------------------------------------------------


def test_training_learns_the_pattern_and_records_its_history():
    data, val = pattern_data(), pattern_data(seed=1)
    before = evaluate(tiny_model(), val)
    history = train(tiny_model(), data, val, config(max_steps=60, eval_interval=20))
    assert history.step == list(range(1, 61))
    assert history.eval_step == [20, 40, 60] and history.tokens == [s * 4 * 16 for s in (20, 40, 60)]
    assert len(history.train_loss) == len(history.grad_norm) == 60
    assert history.val_loss[-1] < before - 0.8, (before, history.val_loss)


def test_gradient_clipping_caps_the_update_norm_and_records_the_unclipped_norm():
    model, data = tiny_model(), pattern_data()
    history = train(model, data, data, config(max_steps=3, grad_clip=1e-3, learning_rate=1e-3))
    assert all(g > 1e-3 for g in history.grad_norm), "the recorded norm is the one before clipping"
    # Clipping must be what the loop does: redo step 1 by hand with and without it.
    x = torch.randn(5, requires_grad=True)
    (x * torch.arange(5.0)).sum().backward()
    total = torch.nn.utils.clip_grad_norm_([x], 1.0)
    assert total.item() == pytest.approx(math.sqrt(30)) and x.grad.norm().item() == pytest.approx(1.0)


def test_the_same_seed_gives_the_same_run_and_another_seed_another():
    runs = [train(tiny_model(), pattern_data(), pattern_data(seed=1), config(seed=s)) for s in (0, 0, 1)]
    assert runs[0].train_loss == runs[1].train_loss
    assert runs[0].train_loss != runs[2].train_loss


# --- checkpoints ---------------------------------------------------------------------------------------------


def test_checkpoint_round_trip_restores_model_optimizer_and_configs(tmp_path):
    model, data = tiny_model(), pattern_data()
    history = train(model, data, data, config(out_dir=tmp_path))
    loaded, ckpt = load_checkpoint(tmp_path)
    assert ckpt["step"] == 30 and ckpt["model_config"] == dataclasses.asdict(model.config)
    assert ckpt["train_config"]["max_steps"] == 30
    for (name, a), b in zip(model.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), name
    assert History.from_dict(ckpt["history"]) == history
    assert (tmp_path / HISTORY_NAME).is_file() and not list(tmp_path.glob("*.tmp*"))
    optimizer = torch.optim.AdamW(param_groups(loaded, 0.1), lr=1.0)
    load_checkpoint(tmp_path, loaded, optimizer=optimizer)
    assert optimizer.state_dict()["state"][0]["exp_avg"].abs().sum() > 0


def test_checkpoint_loading_refuses_pickled_code(tmp_path):
    path = tmp_path / "evil.pt"

    class Boom:
        def __reduce__(self):
            return (print, ("this must never run",))

    torch.save({"format": "groundup-checkpoint", "payload": Boom()}, path)
    with pytest.raises(ValueError, match="not a readable groundup checkpoint"):
        load_checkpoint(path)


@pytest.mark.parametrize("damage, message", [
    (lambda c: c.pop("model"), "'model' is missing"),
    (lambda c: c.update(format="something-else"), "has format"),
    (lambda c: c.update(model_class="Transformer9000"), "unknown model class"),
    (lambda c: c["model_config"].update(d_model=17), "invalid model configuration"),
    (lambda c: c["model"].pop("final_norm.weight"), "do not (fit the model|match the stored model configuration)"),
    (lambda c: c.update(step="12"), "'step' is missing or not a int"),
])
def test_corrupt_checkpoints_give_clear_errors(tmp_path, damage, message):
    path = tmp_path / "c.pt"
    save_checkpoint(path, tiny_model(), step=3)
    ckpt = torch.load(path, weights_only=True)
    damage(ckpt)
    torch.save(ckpt, path)
    with pytest.raises(ValueError, match=message):
        load_checkpoint(path)


def _never_build_a_block(monkeypatch):
    from groundup.layers import TransformerBlock

    def refuse(self, *args, **kwargs):
        raise AssertionError("a block was built from an unchecked configuration")

    monkeypatch.setattr(TransformerBlock, "__init__", refuse)


def test_a_checkpoint_claiming_100000_layers_is_refused_before_any_block_is_built(tmp_path, monkeypatch):
    # building 100000 blocks, even on the meta device, would take about ten minutes (about 6 ms a block)
    path = tmp_path / "deep.pt"
    save_checkpoint(path, tiny_model(), step=3)
    ckpt = torch.load(path, weights_only=True)
    ckpt["model_config"]["n_layers"] = 100_000
    torch.save(ckpt, path)
    _never_build_a_block(monkeypatch)
    start = time.perf_counter()
    with pytest.raises(ValueError, match="is inconsistent") as err:
        load_checkpoint(path)
    assert time.perf_counter() - start < 5
    assert str(path) in str(err.value) and "100,000 blocks" in str(err.value), err.value


def test_a_checkpoint_with_the_right_count_of_numbers_but_too_few_tensors_is_refused(tmp_path, monkeypatch):
    # every number the configuration claims is there, in one tensor: the blocks' tensors are not
    path = tmp_path / "flat.pt"
    save_checkpoint(path, tiny_model(), step=3)
    ckpt = torch.load(path, weights_only=True)
    claimed = GPTConfig(**{**TINY, "n_layers": 20_000, "d_model": 2, "n_heads": 1, "d_ff": 1})
    ckpt["model_config"] = dataclasses.asdict(claimed)
    ckpt["model"] = {"token_embedding.weight": torch.zeros(parameter_count(claimed) + 12 * 2)}  # tied: twice
    torch.save(ckpt, path)
    _never_build_a_block(monkeypatch)
    with pytest.raises(ValueError, match=r"is inconsistent.*at least 80,000 tensors.* in 1 tensors") as err:
        load_checkpoint(path)
    assert str(path) in str(err.value)


def test_a_checkpoint_whose_configuration_would_not_fit_in_memory_is_refused_as_too_large(tmp_path, monkeypatch):
    # ALiBi's table is a buffer (not stored): the numbers agree, the memory does not
    monkeypatch.setattr("groundup.footprint.device_memory", lambda device=None: 1000)  # a 1 kB machine
    path = tmp_path / "big.pt"
    save_checkpoint(path, tiny_model(positional="alibi"), step=3)
    _never_build_a_block(monkeypatch)
    with pytest.raises(ValueError, match="too large for this machine") as err:
        load_checkpoint(path)
    assert str(path) in str(err.value)


@pytest.mark.parametrize("field, value", [("n_layers", "4"), ("n_layers", 2.5), ("d_model", -16),
                                          ("vocab_size", True), ("n_heads", None)])
def test_a_checkpoint_whose_configuration_has_a_wrong_type_is_refused_clearly(tmp_path, monkeypatch, field, value):
    path = tmp_path / "typed.pt"
    save_checkpoint(path, tiny_model(), step=3)
    ckpt = torch.load(path, weights_only=True)
    ckpt["model_config"][field] = value
    torch.save(ckpt, path)
    _never_build_a_block(monkeypatch)
    with pytest.raises(ValueError, match=f"invalid model configuration: {field} must be a positive integer") as err:
        load_checkpoint(path)
    assert str(path) in str(err.value)


@pytest.mark.parametrize("make", [
    lambda: tiny_model(tie_weights=False, positional="relative"),
    lambda: MaskedLM(MaskedLMConfig(**TINY, mask_token_id=11, positional="relative")),
    lambda: EncoderDecoder(EncoderDecoderConfig(src_vocab_size=9, tgt_vocab_size=7, context_length=8, d_model=8,
                                                n_heads=2, n_decoder_layers=3, positional="learned")),
    lambda: EncoderDecoder(EncoderDecoderConfig(src_vocab_size=9, tgt_vocab_size=7, context_length=8, d_model=8,
                                                n_heads=2, tie_weights=False)),
])
def test_genuine_checkpoints_of_every_model_class_pass_the_size_checks(tmp_path, make):
    model = make()
    save_checkpoint(tmp_path / "c.pt", model)
    loaded, _ = load_checkpoint(tmp_path / "c.pt")
    assert type(loaded) is type(model)
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), model.state_dict().values()))


def test_truncated_and_missing_checkpoints(tmp_path):
    path = tmp_path / "c.pt"
    save_checkpoint(path, tiny_model(), step=3)
    path.write_bytes(path.read_bytes()[:1000])
    with pytest.raises(ValueError, match="not a readable"):
        load_checkpoint(path)
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        load_checkpoint(tmp_path / "nothing-here")


def test_a_checkpoint_for_another_configuration_is_refused(tmp_path):
    save_checkpoint(tmp_path / "c.pt", tiny_model(), step=0)
    with pytest.raises(ValueError, match="different configuration"):
        load_checkpoint(tmp_path / "c.pt", tiny_model(d_model=32))


def test_an_existing_run_is_not_overwritten(tmp_path):
    train(tiny_model(), pattern_data(), pattern_data(), config(max_steps=10, out_dir=tmp_path))
    with pytest.raises(FileExistsError, match="resume=True"):
        train(tiny_model(), pattern_data(), pattern_data(), config(max_steps=10, out_dir=tmp_path))


# --- resuming ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("optimizer", ["adamw", "muon", "sgd"])
def test_resume_after_a_crash_ends_bit_for_bit_like_an_uninterrupted_run(tmp_path, monkeypatch, optimizer):
    """Bit for bit on any CPU: both runs do the same operations on the same numbers in the same process, Muon's
    bfloat16 products included; only the state between the steps goes through the checkpoint, exactly."""
    data, val = pattern_data(), pattern_data(seed=1)
    common = dict(max_steps=40, eval_interval=10, optimizer=optimizer)
    whole = tiny_model(dropout=0.1)
    train(whole, data, val, config(**common))

    calls = {"n": 0}
    real_get_batch = training.get_batch

    def crashing_get_batch(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 26:  # in the middle of the run, after the checkpoint of step 20
            raise RuntimeError("power cut")
        return real_get_batch(*args, **kwargs)

    monkeypatch.setattr(training, "get_batch", crashing_get_batch)
    with pytest.raises(RuntimeError, match="power cut"):
        train(tiny_model(dropout=0.1), data, val, config(out_dir=tmp_path, **common))
    monkeypatch.setattr(training, "get_batch", real_get_batch)
    assert load_checkpoint(tmp_path)[1]["step"] == 20

    torch.manual_seed(12345)  # whatever the global random state is now, resuming restores the run's own
    resumed = tiny_model(seed=99, dropout=0.1)
    history = train(resumed, data, val, config(out_dir=tmp_path, resume=True, **common))
    assert history.step == list(range(1, 41))
    for (name, a), b in zip(whole.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), f"{name} differs after resuming"


def test_ctrl_c_saves_a_checkpoint_at_the_end_of_the_step(tmp_path, monkeypatch):
    ctrl_c_on_call(monkeypatch, training, "get_batch", 7)  # as if the reader pressed Ctrl-C during step 7
    with pytest.raises(KeyboardInterrupt, match="after step 7"):
        train(tiny_model(), pattern_data(), pattern_data(), config(out_dir=tmp_path))
    assert load_checkpoint(tmp_path)[1]["step"] == 7
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler, "the handler is restored"


def test_a_time_budget_ends_the_run_and_decays_over_the_time(monkeypatch):
    clock = {"now": 0.0}

    def fake_perf_counter():  # every reading of the clock advances it by 10 ms: a run of 100 readings per second
        clock["now"] += 0.01
        return clock["now"]

    monkeypatch.setattr(training.time, "perf_counter", fake_perf_counter)
    c = config(max_steps=10**6, warmup_steps=3, time_budget=1.0, eval_interval=10**6)
    history = train(tiny_model(), pattern_data(), pattern_data(seed=1), c)
    assert 10 < history.step[-1] < 100 and history.eval_step == [history.step[-1]]
    assert history.seconds[-1] >= 1.0
    assert history.lr[:3] == pytest.approx([lr_at(s, c) for s in range(3)])
    after = history.lr[3:]
    assert all(a >= b for a, b in zip(after, after[1:])) and after[-1] < 0.15 * c.learning_rate
    assert lr_at(5, c, progress=1.0) == pytest.approx(c.min_lr) and lr_at(5, c, progress=0.0) == c.learning_rate


# --- the batches hook (models trained on other objectives, chapters 9-10) ------------------------------------


def windows_batches(data, batch_size, context_length, generator):
    """The default next-token windows, through the hook."""
    from groundup.data import get_batch

    x, y = get_batch(data, batch_size, context_length, generator=generator)
    return (x,), y


def test_a_batches_function_drives_the_steps_exactly_like_the_default_windows():
    plain = tiny_model()
    hooked = tiny_model()
    a = train(plain, pattern_data(), pattern_data(seed=1), config())
    b = train(hooked, pattern_data(), pattern_data(seed=1), config(), batches=windows_batches)
    assert a.train_loss == b.train_loss
    for p, q in zip(plain.parameters(), hooked.parameters()):
        assert torch.equal(p, q)
    assert b.val_loss != a.val_loss  # evaluation differs: fixed random batches instead of spread windows
    assert b.val_loss[-1] == evaluate(hooked, pattern_data(seed=1), batch_size=4, max_batches=4,
                                      batches=windows_batches)


def test_evaluate_with_batches_draws_the_same_held_out_batches_every_time():
    model = tiny_model()
    seen = []

    def recording(data, batch_size, context_length, generator):
        inputs, y = windows_batches(data, batch_size, context_length, generator)
        seen.append(inputs[0])
        return inputs, y

    first = evaluate(model, pattern_data(), batch_size=3, max_batches=2, batches=recording)
    second = evaluate(model, pattern_data(), batch_size=3, max_batches=2, batches=recording)
    assert first == second and len(seen) == 4
    assert torch.equal(seen[0], seen[2]) and not torch.equal(seen[0], seen[1])


def test_the_batches_hook_rejects_bad_uses():
    with pytest.raises(TypeError, match="batches must be a function"):
        train(tiny_model(), pattern_data(), pattern_data(), config(), batches=3)
    with pytest.raises(ValueError, match="eval_batches"):
        train(tiny_model(), pattern_data(), pattern_data(), config(eval_batches=None), batches=windows_batches)
    with pytest.raises(ValueError, match="needs max_batches"):
        evaluate(tiny_model(), pattern_data(), batches=windows_batches)
    with pytest.raises(TypeError, match=r"must return \(inputs, targets\)"):
        train(tiny_model(), pattern_data(), pattern_data(), config(),
              batches=lambda d, b, n, g: windows_batches(d, b, n, g)[0])


# --- Muon --------------------------------------------------------------------------------------------------------


def test_muon_takes_the_linear_weights_and_adamw_the_rest():
    model = tiny_model()
    opt = training.MuonAdamW(model, lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1)
    linear = [n for n, p in model.named_parameters() if any(p is q for q in training.muon_parameters(model))]
    assert linear and all(n.endswith(".weight") and ".W_" in n for n in linear)
    assert not any("embedding" in n for n in linear)
    in_muon = {id(p) for g in opt.muon.param_groups for p in g["params"]}
    in_adamw = {id(p) for g in opt.adamw.param_groups for p in g["params"]}
    assert in_muon.isdisjoint(in_adamw) and in_muon | in_adamw == {id(p) for p in model.parameters()}
    assert opt.param_groups[0] is opt.adamw.param_groups[0] and opt.param_groups[-1] is opt.muon.param_groups[0]


def test_muon_step_is_pytorchs_muon_and_adamw_step(tmp_path):
    """One MuonAdamW step equals torch.optim.Muon on the matrices plus torch.optim.AdamW on the rest."""
    torch.manual_seed(0)
    a, b = tiny_model(), tiny_model()
    b.load_state_dict(a.state_dict())
    x = torch.randint(0, 12, (4, 8))
    for model in (a, b):
        model(x, x)[1].backward()
    ours = training.MuonAdamW(a, lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1)
    matrices = training.muon_parameters(b)
    rest = [p for p in b.parameters() if all(p is not q for q in matrices)]
    muon = torch.optim.Muon(matrices, lr=1e-2, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    adamw = torch.optim.AdamW([{"params": [p for p in rest if p.dim() >= 2], "weight_decay": 0.1},
                               {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0}],
                              lr=1e-2, betas=(0.9, 0.99))
    ours.step()
    muon.step()
    adamw.step()
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), f"{name} differs"  # the same operations on the same numbers: bit for bit


def test_optimizer_names_are_checked_and_states_do_not_mix(tmp_path):
    with pytest.raises(ValueError, match="optimizer must be one of adamw, muon, sgd, got 'rmsprop'"):
        config(optimizer="rmsprop")
    train(tiny_model(), pattern_data(), pattern_data(), config(max_steps=10, out_dir=tmp_path))
    opt = training.MuonAdamW(tiny_model(), lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1)
    with pytest.raises(ValueError, match="optimizer state does not fit"):
        load_checkpoint(tmp_path, tiny_model(), optimizer=opt)


# --- exact micro-batches, diverged runs, stale files, crafted steps (issue 21) --------------------------------


def dates_setup(batch_size=16):
    """Chapter 10's dates task at a small size: an EncoderDecoder and padded batches of dates of unequal length."""
    from groundup.models import EncoderDecoder, EncoderDecoderConfig
    from groundup.seq2seq import batches, date_splits, date_tokenizers, encode_pairs

    src_tok, tgt_tok = date_tokenizers()
    train_pairs, _, _ = date_splits(2000, 100, 10)
    torch.manual_seed(0)
    model = EncoderDecoder(EncoderDecoderConfig(
        src_vocab_size=src_tok.vocab_size, tgt_vocab_size=tgt_tok.vocab_size, context_length=24, d_model=16, d_ff=32,
        n_encoder_layers=1, n_decoder_layers=1, n_heads=2))
    inputs, y = batches(encode_pairs(train_pairs, src_tok, tgt_tok), batch_size, 24, torch.Generator().manual_seed(0))
    return model, inputs, y


class _NoStop:
    requested = False


def gradients_of_split_step(model, inputs, y, accumulate):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    loss = training._split_step(model, inputs, y, "cpu", optimizer, 0, 1, accumulate, _NoStop())
    return loss, [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("accumulate", [2, 4, 8])
def test_accumulated_micro_batches_give_the_whole_padded_batchs_gradient(accumulate):
    """The micro-batches' losses are weighted by the targets they count, so accumulating equals the whole batch.

    In float64, so the comparison is of the formulas, not of float32 rounding (any CPU): equal to 1e-12 against
    gradient entries of about 0.1. The batch is padded: its micro-batches count different numbers of targets,
    where the plain mean of the micro-batch means is off by far more (checked too).
    """
    model, inputs, y = dates_setup()
    model.double()
    counts = [training.counted_targets(model, part) for part in y.chunk(accumulate)]
    assert len(set(counts)) > 1, "the test needs micro-batches of unequal target counts"
    assert sum(counts) == training.counted_targets(model, y) == int((y != model.config.pad_id).sum())
    model.zero_grad()
    whole_loss = model(*inputs, y)[1]
    whole_loss.backward()
    whole = [p.grad.clone() for p in model.parameters()]
    loss, split = gradients_of_split_step(model, inputs, y, accumulate)
    assert loss.item() == pytest.approx(whole_loss.item(), rel=1e-6)  # returned in float32
    for a, b in zip(whole, split):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    # what the old code did -- backpropagate the mean of the micro-batch means -- misses by far more
    model.zero_grad()
    for part in zip(*(t.chunk(accumulate) for t in (*inputs, y))):
        (model(*part)[1] / accumulate).backward()
    assert max((a - p.grad).abs().max().item() for a, p in zip(whole, model.parameters())) > 1e-5


def test_counted_targets_follow_each_models_ignore_rule():
    model, _, y = dates_setup(batch_size=4)
    pad = model.config.pad_id
    assert training.counted_targets(model, y) == int((y != pad).sum()) < y.numel()
    y2 = y.clone()
    y2[0, 0] = -100
    assert y[0, 0] != pad and training.counted_targets(model, y2) == int((y != pad).sum()) - 1
    gpt_targets = torch.tensor([[1, 2, -100], [pad, -100, 3]])
    assert training.counted_targets(tiny_model(), gpt_targets) == 4  # a GPT ignores -100 only, even a 0


def test_a_diverged_run_stops_and_keeps_the_last_good_checkpoint(tmp_path):
    """Issue 21: train --lr 1e4 --grad-clip 0 replaced the good checkpoint by a nan one and exited 0."""
    def poison(step, model):  # called after the checkpoint of step 20: a parameter turns nan, as after a blow-up
        if step == 20:
            with torch.no_grad():
                model.blocks[0].ffn.W_in.weight[0, 0] = math.nan

    with pytest.raises(training.TrainingDiverged) as caught:
        train(tiny_model(), pattern_data(), pattern_data(), config(max_steps=30, out_dir=tmp_path), callback=poison)
    message = str(caught.value)
    assert "training diverged at step 21: the training loss is nan" in message
    assert f"the last good checkpoint (step 20) in {tmp_path} is kept" in message
    assert "lower learning rate (--lr" in message and "--grad-clip" in message
    _, ckpt = load_checkpoint(tmp_path)
    assert ckpt["step"] == 20 and all(torch.isfinite(t).all() for t in ckpt["model"].values())
    assert json.loads((tmp_path / HISTORY_NAME).read_text())["step"][-1] == 20
    assert isinstance(caught.value, ValueError), "the command line reports it as an error (exit status 1)"


def test_a_learning_rate_that_blows_up_stops_with_a_clear_error_and_no_nan_checkpoint(tmp_path):
    with pytest.raises(training.TrainingDiverged, match=r"not finite.*--lr.*now 10000.*--grad-clip 1.*now off"):
        train(tiny_model(), pattern_data(), pattern_data(),
              config(max_steps=200, learning_rate=1e4, warmup_steps=0, grad_clip=None, eval_interval=1,
                     out_dir=tmp_path))
    if (tmp_path / training.CHECKPOINT_NAME).exists():
        _, ckpt = load_checkpoint(tmp_path)
        assert all(torch.isfinite(t).all() for t in ckpt["model"].values())
        assert all(math.isfinite(v) for v in ckpt["history"]["val_loss"])


def test_stale_temporary_files_of_a_killed_write_are_removed_on_start_and_resume(tmp_path):
    """Issue 21: SIGKILL during an atomic write leaves .checkpoint.pt.XXXX.tmp (as large as a checkpoint)."""
    stale = [tmp_path / ".checkpoint.pt.k3j_x9ab.tmp", tmp_path / ".history.json.a1b2c3d4.tmp"]
    kept = [tmp_path / "notes.tmp", tmp_path / ".checkpoint.pt.backup", tmp_path / ".other.pt.abcd1234.tmp"]
    for path in stale + kept:
        path.write_bytes(b"half a file")
    train(tiny_model(), pattern_data(), pattern_data(), config(max_steps=10, out_dir=tmp_path))
    assert not any(path.exists() for path in stale) and all(path.exists() for path in kept)
    for path in stale:
        path.write_bytes(b"half a file")
    train(tiny_model(), pattern_data(), pattern_data(), config(max_steps=20, out_dir=tmp_path, resume=True))
    assert not any(path.exists() for path in stale) and all(path.exists() for path in kept)
    assert training.remove_stale_temporary_files(tmp_path) == []


@pytest.mark.parametrize("step, message", [(-3, "saved at step -3, outside"), (31, "saved at step 31, outside"),
                                           (7, "saved at step 7 but its history holds 10 steps")])
def test_a_checkpoint_with_a_crafted_step_is_refused(tmp_path, step, message):
    train(tiny_model(), pattern_data(), pattern_data(), config(max_steps=10, out_dir=tmp_path))
    path = tmp_path / training.CHECKPOINT_NAME
    ckpt = torch.load(path, weights_only=True)
    ckpt["step"] = step
    torch.save(ckpt, path)
    with pytest.raises(ValueError, match=message):
        train(tiny_model(), pattern_data(), pattern_data(), config(max_steps=30, out_dir=tmp_path, resume=True))


@pytest.mark.parametrize("key", ["torch_rng", "sampler_rng"])
def test_train_refuses_a_checkpoint_with_a_damaged_random_state(tmp_path, key):
    # train() itself checks, not only the command line: a resumed run must continue exactly or not at all
    train(tiny_model(), pattern_data(), pattern_data(), config(max_steps=10, out_dir=tmp_path))
    path = tmp_path / training.CHECKPOINT_NAME
    ckpt = torch.load(path, weights_only=True)
    ckpt[key] = torch.zeros(3, dtype=torch.uint8)
    torch.save(ckpt, path)
    with pytest.raises(ValueError, match=f"damaged random state \\({key}: "):
        train(tiny_model(), pattern_data(), pattern_data(), config(max_steps=30, out_dir=tmp_path, resume=True))
