"""The masked language model of chapter 9: BERT's masking procedure, the bidirectional MaskedLM, its loss, its
checkpoints, training through groundup.training.train(batches=...) and the command line."""

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from groundup import cli
from groundup.generation import generate
from groundup.masking import (
    MASKED,
    NOT_SELECTED,
    RANDOM,
    UNCHANGED,
    apply_masking,
    mask_tokens,
    masked_lm_batches,
    masking_plan,
)
from groundup.models import GPT, GPTConfig, MaskedLM, MaskedLMConfig
from groundup.training import TrainConfig, evaluate, load_checkpoint, save_checkpoint, train

TINY = dict(vocab_size=13, context_length=16, d_model=32, n_layers=2, n_heads=2)  # ids 0..11 and [MASK] = 12


def tiny(**kw):
    torch.manual_seed(0)
    return MaskedLM(MaskedLMConfig(**{**TINY, **kw}))


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


# --- the masking procedure -------------------------------------------------------------------------------------


def test_masking_selects_15_percent_and_splits_them_80_10_10():
    ids = torch.randint(0, 84, (400, 100), generator=gen(1))
    inputs, targets = mask_tokens(ids, mask_token_id=84, vocab_size=85, generator=gen(2))
    selected = targets != -100
    assert (selected.sum(-1) == 15).all(), "exactly round(0.15 * 100) positions per row, as in BERT's pipeline"
    assert torch.equal(targets[selected], ids[selected]) and torch.equal(inputs[~selected], ids[~selected])
    n = selected.sum().item()  # 6000 selected positions: the binomial standard deviation of 80 % is 0.52 %
    masked = (inputs == 84).sum().item() / n
    changed = ((inputs != ids) & (inputs != 84)).sum().item() / n  # a random token that differs from the original
    same = (selected & (inputs == ids)).sum().item() / n
    assert masked == pytest.approx(0.8, abs=0.02)
    # a random token equals the original with probability 1/84, so 10 % · 83/84 change and 10 % · 1/84 look unchanged
    assert changed == pytest.approx(0.1 * 83 / 84, abs=0.012)
    assert same == pytest.approx(0.1 + 0.1 / 84, abs=0.012)
    assert not (inputs[~selected] == 84).any()


def test_the_plan_follows_the_given_proportions_and_the_generator_alone():
    plan = masking_plan((300, 64), generator=gen(0), rate=0.25, mask_fraction=0.5, random_fraction=0.3)
    assert ((plan != NOT_SELECTED).sum(-1) == 16).all()  # round(0.25 * 64)
    kinds = plan[plan != NOT_SELECTED]
    for kind, share in ((MASKED, 0.5), (RANDOM, 0.3), (UNCHANGED, 0.2)):
        assert (kinds == kind).float().mean().item() == pytest.approx(share, abs=0.02)
    assert torch.equal(plan, masking_plan((300, 64), generator=gen(0), rate=0.25, mask_fraction=0.5,
                                          random_fraction=0.3))
    assert not torch.equal(plan, masking_plan((300, 64), generator=gen(1), rate=0.25, mask_fraction=0.5,
                                              random_fraction=0.3))
    only_mask = masking_plan((50, 10), generator=gen(0), mask_fraction=1.0, random_fraction=0.0)
    assert set(only_mask.unique().tolist()) == {NOT_SELECTED, MASKED}
    assert ((masking_plan((5, 3), generator=gen(0)) != NOT_SELECTED).sum(-1) == 1).all(), "at least one per row"


def test_random_replacements_never_use_the_mask_token_and_cover_the_other_ids():
    ids = torch.zeros(200, 50, dtype=torch.long)
    plan = torch.full_like(ids, RANDOM)
    inputs, targets = apply_masking(ids, plan, mask_token_id=3, vocab_size=6, generator=gen(0))
    assert set(inputs.unique().tolist()) == {0, 1, 2, 4, 5}
    assert (targets == 0).all()


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(rate=0.0), ValueError, "rate"), (dict(rate=1.5), ValueError, "rate"), (dict(rate="0.15"), TypeError, "rate"),
    (dict(mask_fraction=-0.1), ValueError, "mask_fraction"), (dict(random_fraction=float("nan")), TypeError, "random"),
    (dict(mask_fraction=0.8, random_fraction=0.3), ValueError, "at most 1"),
    (dict(mask_token_id=10), ValueError, "mask_token_id"), (dict(mask_token_id=1.0), TypeError, "mask_token_id"),
    (dict(vocab_size=1, mask_token_id=0), ValueError, "vocab_size"),
    (dict(generator=0), TypeError, "torch.Generator"),
])
def test_masking_rejects_bad_arguments(kwargs, error, match):
    args = {**dict(mask_token_id=9, vocab_size=10, generator=gen(0)), **kwargs}
    with pytest.raises(error, match=match):
        mask_tokens(torch.zeros(2, 8, dtype=torch.long), **args)


def test_masking_rejects_bad_ids_and_plans():
    with pytest.raises(ValueError, match="already contain the mask token"):
        mask_tokens(torch.tensor([[1, 9, 2]]), mask_token_id=9, vocab_size=10, generator=gen(0))
    with pytest.raises(ValueError, match=r"ids must lie in \[0, 10\)"):
        mask_tokens(torch.tensor([[1, 12]]), mask_token_id=9, vocab_size=10, generator=gen(0))
    with pytest.raises(TypeError, match="integer token ids"):
        mask_tokens(torch.zeros(2, 3), mask_token_id=9, vocab_size=10, generator=gen(0))
    with pytest.raises(TypeError, match="torch.Tensor"):
        mask_tokens([[1, 2]], mask_token_id=9, vocab_size=10, generator=gen(0))
    with pytest.raises(ValueError, match="plan must be a tensor of the shape"):
        apply_masking(torch.zeros(2, 3, dtype=torch.long), torch.zeros(3, 2, dtype=torch.long), mask_token_id=9,
                      vocab_size=10, generator=gen(0))
    with pytest.raises(ValueError, match="n >= 1"):
        masking_plan((4, 0), generator=gen(0))
    with pytest.raises(ValueError, match="mask_token_id"):
        masked_lm_batches(10, 10)


def test_masked_lm_batches_draw_windows_and_mask_them_with_the_generator_only():
    data = torch.arange(100) % 12
    batches = masked_lm_batches(12, 13)
    (inputs,), targets = batches(data, 4, 20, gen(5))
    (again,), targets_again = batches(data, 4, 20, gen(5))
    assert torch.equal(inputs, again) and torch.equal(targets, targets_again)
    assert inputs.shape == targets.shape == (4, 20) and ((targets != -100).sum(-1) == 3).all()
    originals = torch.where(targets != -100, targets, inputs)
    for row in originals:  # unmasked, each row is a window of the data: consecutive values mod 12
        assert torch.equal((row[1:] - row[:-1]) % 12, torch.ones(19, dtype=torch.long))


# --- the model -------------------------------------------------------------------------------------------------


def test_the_config_reserves_the_last_id_for_the_mask_token_unless_told_otherwise():
    assert MaskedLMConfig(**TINY).mask_token_id == 12
    assert MaskedLMConfig(**{**TINY, "mask_token_id": 0}).mask_token_id == 0
    for bad in (13, -1, 2.0, True):
        with pytest.raises(ValueError, match="mask_token_id"):
            MaskedLMConfig(**{**TINY, "mask_token_id": bad})
    with pytest.raises(TypeError, match="MaskedLMConfig"):
        MaskedLM(GPTConfig(**TINY))


def test_the_loss_counts_the_masked_positions_only():
    model = tiny().eval()
    idx = torch.randint(0, 12, (3, 16), generator=gen(0))
    inputs, targets = mask_tokens(idx, mask_token_id=12, vocab_size=13, generator=gen(1))
    logits, loss = model(inputs, targets)
    selected = targets != -100
    expected = F.cross_entropy(logits[selected], targets[selected])
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    # Changing the targets at unselected positions to other ignored values, or the logits there, changes nothing:
    # the gradient reaches the logits only at the selected positions.
    logits = logits.detach().requires_grad_(True)
    F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100).backward()
    assert (logits.grad[~selected] == 0).all() and (logits.grad[selected].abs().sum(-1) > 0).all()
    shuffled = logits.detach().clone()
    shuffled[~selected] = torch.randn(int((~selected).sum()), 13, generator=gen(2)) * 10
    same = F.cross_entropy(shuffled.flatten(0, 1), targets.flatten())
    assert same.item() == pytest.approx(loss.item(), rel=1e-6)


def test_the_encoder_is_bidirectional_and_the_gpt_is_not():
    model = tiny().eval()
    idx = torch.randint(0, 12, (1, 16), generator=gen(0))
    later = idx.clone()
    later[0, 12] = (later[0, 12] + 1) % 12
    with torch.no_grad():
        a, b = model(idx)[0], model(later)[0]
    assert (a[0, :12] - b[0, :12]).abs().max() > 1e-4, "a later token changes every earlier position's output"
    torch.manual_seed(0)
    gpt = GPT(GPTConfig(**TINY)).eval()
    gpt.load_state_dict(model.state_dict())  # the very same weights, with the causal mask
    with torch.no_grad():
        c, d = gpt(idx)[0], gpt(later)[0]
    assert torch.equal(c[0, :12], d[0, :12])
    assert not torch.allclose(a, c), "the only difference between the two models is the mask"


def test_relative_positions_get_both_directions_in_the_encoder():
    assert tiny(positional="relative").relative_bias.bidirectional
    torch.manual_seed(0)
    assert not GPT(GPTConfig(**TINY, positional="relative")).relative_bias.bidirectional


def test_forward_errors_match_the_gpt_and_there_is_no_cache():
    model = tiny()
    with pytest.raises(ValueError, match="exceeds context_length 16"):
        model(torch.zeros(1, 17, dtype=torch.long))
    with pytest.raises(TypeError, match="integer token ids"):
        model(torch.zeros(1, 4))
    with pytest.raises(ValueError, match="same shape as idx"):
        model(torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="every target is -100"):
        model(torch.zeros(1, 4, dtype=torch.long), torch.full((1, 4), -100))
    with pytest.raises(TypeError, match="no KV cache"):
        model(torch.zeros(1, 4, dtype=torch.long), cache=[])
    with pytest.raises(TypeError, match="not a generator"):
        model.new_cache()
    with pytest.raises(TypeError, match="not a generator"):
        generate(model, torch.zeros(1, 2, dtype=torch.long), 3)


def test_initialisation_follows_the_gpt():
    model = tiny()
    assert model.token_embedding.weight is model.unembedding.weight  # tied, as GPT by default
    w = model.blocks[0].ffn.W_in.weight
    assert w.std().item() == pytest.approx(0.02, rel=0.1)
    assert model.blocks[0].ffn.W_out.weight.std().item() == pytest.approx(0.02 / math.sqrt(4), rel=0.15)


# --- checkpoints and training ----------------------------------------------------------------------------------


def pattern(n=2000, seed=0):
    """Random two-token words (a, a + 1) with a in {0, 2, 4, 6, 8}, each followed by the separator 10: every token
    is determined by its neighbours, the first of a word only by the one on its right."""
    words = torch.randint(0, 5, (n // 3 + 1,), generator=gen(seed)) * 2
    return torch.stack([words, words + 1, torch.full_like(words, 10)], dim=1).flatten()[:n]


def test_checkpoint_round_trip(tmp_path):
    model = tiny(mask_token_id=0)
    save_checkpoint(tmp_path / "m.pt", model)
    loaded, ckpt = load_checkpoint(tmp_path / "m.pt")
    assert type(loaded) is MaskedLM and ckpt["model_class"] == "MaskedLM"
    assert loaded.config == model.config and loaded.config.mask_token_id == 0
    assert ckpt["model_config"] == dataclasses.asdict(model.config)
    for (name, a), b in zip(model.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), name
    with pytest.raises(ValueError, match="different configuration"):
        load_checkpoint(tmp_path / "m.pt", tiny())


def test_a_short_deterministic_run_learns_to_fill_in_blanks(tmp_path):
    batches = masked_lm_batches(12, 13)
    data, val = pattern(), pattern(seed=1)
    config = TrainConfig(batch_size=32, max_steps=200, learning_rate=3e-3, warmup_steps=10, eval_interval=100,
                         eval_batches=4, progress=False, out_dir=str(tmp_path / "a"))
    before = evaluate(tiny(), val, batch_size=32, max_batches=4, batches=batches)
    history = train(tiny(), data, val, config, batches=batches)
    assert before == pytest.approx(math.log(13), abs=0.3)
    assert history.val_loss[-1] < 0.5 * before, (before, history.val_loss)
    loaded, ckpt = load_checkpoint(tmp_path / "a")
    assert ckpt["step"] == 200 and type(loaded) is MaskedLM
    short = dataclasses.replace(config, max_steps=10, eval_interval=10, out_dir=None)
    runs = [train(tiny(), data, val, dataclasses.replace(short, seed=s), batches=batches) for s in (0, 0, 1)]
    assert runs[0].train_loss == runs[1].train_loss != runs[2].train_loss, "the seed alone decides the run"


# --- the command line ------------------------------------------------------------------------------------------


def test_the_cli_trains_a_masked_lm_and_sample_refuses_it(tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_text("to be or not to be, that is the question. " * 60)
    out = tmp_path / "run"
    status = cli.main(["train", "--objective", "masked", "--out", str(out), "--text", str(text), "--context", "16",
                       "--d-model", "32", "--layers", "1", "--heads", "2", "--batch-size", "8", "--max-steps", "40",
                       "--eval-interval", "20", "--eval-batches", "2", "--lr", "1e-2", "--no-progress"])
    printed = capsys.readouterr()
    assert status == 0, printed.err
    assert "masked" in printed.out
    model, ckpt = load_checkpoint(out)
    assert type(model) is MaskedLM and model.config.vocab_size == len(set(text.read_text())) + 1
    assert ckpt["history"]["val_loss"][-1] < ckpt["history"]["val_loss"][0]
    assert cli.main(["sample", str(out), "--tokens", "5"]) == 1
    assert "not a generator" in capsys.readouterr().err
    status = cli.main(["train", "--out", str(out), "--resume", "--no-progress"])
    assert status == 0 and "resuming" in capsys.readouterr().out


def test_the_cli_rejects_a_masked_option_for_a_gpt_run(tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_text("abcdefgh " * 50)
    status = cli.main(["train", "--out", str(tmp_path / "r"), "--text", str(text), "--mask-rate", "0.2",
                       "--max-steps", "1", "--no-progress"])
    assert status == 1 and "--objective masked" in capsys.readouterr().err


# --- the stored multi-seed results chapter 9 loads -------------------------------------------------------------


def test_chapter9_results_hold_every_run_the_notebook_reads_with_its_command():
    import json
    from importlib import resources

    runs = json.loads(resources.files("groundup").joinpath("results/chapter09.json").read_text())["runs"]
    needed = [f"gpt/seed{s}" for s in range(3)] + [f"mlm/{v}/steps{n}/seed{s}" for v in
                                                   ("mask", "bert", "unchanged", "random")
                                                   for n in (600, 2400) for s in range(3)]
    for key in needed:
        run = runs[key]
        assert run["command"].startswith("OMP_NUM_THREADS=1 python tools/ch09_results.py"), key
        assert f"--seed {run['seed']}" in run["command"], key
        blanks = run["blanks"]
        assert len(blanks["correct"]) == 1000 and set(blanks["correct"]) <= {"0", "1"}, key
        assert blanks["accuracy"] == pytest.approx(blanks["correct"].count("1") / 1000, abs=1e-5), key
        if run["kind"] == "mlm":
            assert f"--steps {run['steps']}" in run["command"] and set(run["probe"]) == {"[MASK]", "observed",
                                                                                      "corrupted"}, key
            assert all(0 <= v <= 1 for v in run["probe"].values()), key
    assert runs["gpt/seed0"]["same_weights_as_chapter7_model"] is True
