"""tools/ch09_results.py's ``--entry masking-variants`` (chapter 9's seed-0 runs of the 80/10/10 experiment) against
the notebook's own definitions, and the entry it stored in chapter09.json."""

import dataclasses
import json
import sys
from importlib import resources
from pathlib import Path

import pytest
import torch

from groundup.masking import mask_tokens, masked_lm_batches
from groundup.models import MaskedLM, MaskedLMConfig
from groundup.training import TrainConfig, train

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import ch09_results  # noqa: E402
import notebook_cells as cells  # noqa: E402

NOTEBOOK = ROOT / "notebooks" / "09_masked_language_models.ipynb"
STORED = json.loads(resources.files("groundup").joinpath("results/chapter09.json").read_text(encoding="utf-8"))
ENTRY = STORED["runs"][ch09_results.LIVE_KEY]
N_V = 84  # the Shakespeare corpus's characters (the notebook prints it)


def notebook_definitions(marker: str, names: set[str], env: dict) -> dict:
    return cells.notebook_definitions(NOTEBOOK, marker, names, env)


SETUP = notebook_definitions("mlm_config = MaskedLMConfig", {"mlm_config", "mlm_training"},
                             {"MaskedLMConfig": MaskedLMConfig, "TrainConfig": TrainConfig, "n_V": N_V})


def experiment(val_ids, n_v=N_V, model=None):
    """The notebook's 80/10/10 cell's definitions on the validation ids ``val_ids``."""
    return notebook_definitions("def train_variant", {"variants", "questions", "probe_starts", "probe_windows",
                                                      "probe", "train_variant"},
                                {"torch": torch, "val_ids": val_ids, "MASK": n_v, "n_V": n_v,
                                 "mask_tokens": mask_tokens, "masked_lm_batches": masked_lm_batches,
                                 "MaskedLM": MaskedLM, "train": train})


def test_variants_and_configuration_are_the_notebooks():
    env = experiment(torch.zeros(100, dtype=torch.long))
    assert {name: (m, r) for name, m, r in ch09_results.VARIANTS.values()} == env["variants"]
    assert list(env["variants"]) == [name for name, _, _ in ch09_results.VARIANTS.values()]
    assert MaskedLMConfig(vocab_size=N_V + 1, **ch09_results.MLM_SHAPE) == SETUP["mlm_config"]
    assert ch09_results.mlm_training(600, 0) == SETUP["mlm_training"]
    assert [ch09_results.VARIANTS[v][0] for v in ch09_results.LIVE_VARIANTS] == [
        "80/10/10 (BERT)", "80 [MASK] / 20 unchanged", "80 [MASK] / 20 random"]


def tiny_model(n_v=12):
    torch.manual_seed(0)
    return MaskedLM(MaskedLMConfig(vocab_size=n_v + 1, context_length=32, d_model=16, n_layers=1,
                                   n_heads=2)).eval()


def test_probe_is_the_notebooks_and_a_direct_count():
    n_v = 12
    model = tiny_model(n_v)
    val_ids = torch.randint(0, n_v, (3000,), generator=torch.Generator().manual_seed(3))
    env = experiment(val_ids, n_v)
    found = ch09_results.probe(model, val_ids, n_v, n_v, digits=None)
    assert found == env["probe"](model)
    assert ch09_results.probe(model, val_ids, n_v, n_v) == {k: round(v, 5) for k, v in found.items()}
    # directly: one window at a time, the same masked inputs
    windows = env["probe_windows"]
    g = torch.Generator().manual_seed(6)
    for name, fractions in [("[MASK]", (1.0, 0.0)), ("corrupted", (0.0, 1.0))]:
        x, y = mask_tokens(windows, mask_token_id=n_v, vocab_size=n_v + 1, generator=g,
                           mask_fraction=fractions[0], random_fraction=fractions[1])
        right = total = 0
        with torch.no_grad():
            for xi, yi in zip(x, y):
                guess = model(xi[None])[0][0].argmax(-1)
                changed = (yi != -100) & (xi != yi)
                right += (guess[changed] == yi[changed]).sum().item()
                total += changed.sum().item()
        if name == "[MASK]":
            assert (x[y != -100] == n_v).all() and total == (y != -100).sum().item()
        assert found[name] == pytest.approx(right / total, abs=1e-12)
    with torch.no_grad():
        observed = sum((model(w[None])[0][0].argmax(-1) == w).sum().item() for w in windows)
    assert found["observed"] == pytest.approx(observed / windows.numel(), abs=1e-12)


def test_train_variant_is_the_tools_training():
    """The notebook's train_variant and the tool's calls build the same model (a few steps on a tiny corpus)."""
    n_v = 12
    ids = torch.randint(0, n_v, (4000,), generator=torch.Generator().manual_seed(4))
    env = experiment(ids, n_v)
    config = MaskedLMConfig(vocab_size=n_v + 1, context_length=32, d_model=16, n_layers=1, n_heads=2)
    training = TrainConfig(batch_size=8, max_steps=3, learning_rate=8e-3, warmup_steps=1, eval_interval=3,
                           eval_batches=1, seed=0, progress=False)
    env.update(mlm_config=config, mlm_training=training, train_ids=ids, val_ids=ids)
    mine = env["train_variant"]("80 [MASK] / 20 random")
    torch.manual_seed(0)
    tool = MaskedLM(config)
    train(tool, ids, ids, training, batches=masked_lm_batches(n_v, n_v + 1, mask_fraction=0.8, random_fraction=0.2))
    assert not mine.training
    for a, b in zip(mine.state_dict().values(), tool.state_dict().values()):
        assert torch.equal(a, b)
    torch.manual_seed(0)
    fresh = MaskedLM(config)
    assert any(not torch.equal(a, b) for a, b in zip(mine.state_dict().values(), fresh.state_dict().values()))


def test_the_stored_entry_has_what_the_notebook_reads():
    assert ENTRY["command"] == ch09_results.LIVE_COMMAND == "python tools/ch09_results.py --entry masking-variants"
    env = experiment(torch.zeros(100, dtype=torch.long))
    assert {name: tuple(v) for name, v in ENTRY["variants"].items()} == env["variants"]
    assert MaskedLMConfig(**ENTRY["model"]) == SETUP["mlm_config"]
    assert TrainConfig(**ENTRY["training"]) == SETUP["mlm_training"]
    assert ENTRY["training"] == dataclasses.asdict(SETUP["mlm_training"])
    machine = ENTRY["machine"]
    assert (machine["mkl_cbwr"], machine["cpu_capability"].lower(), machine["threads"]) == ("COMPATIBLE", "default", 1)
    assert list(ENTRY["probe"]) == ["80/10/10 (BERT)", "80 [MASK] / 20 unchanged", "80 [MASK] / 20 random"]
    for name, found in ENTRY["probe"].items():
        assert set(found) == {"[MASK]", "observed", "corrupted"}
        assert all(0 < v < 1 for v in found.values()), name
        # 500 windows of 32 characters: the observed accuracy counts 16 000 positions
        assert found["observed"] * 16_000 == pytest.approx(round(found["observed"] * 16_000), abs=1e-6)
    # what the section's prose reads from it: unchanged-only never learns to correct, random-only barely observes
    probe = ENTRY["probe"]
    assert probe["80 [MASK] / 20 unchanged"]["observed"] > 0.99 > 0.05 > probe["80 [MASK] / 20 unchanged"]["corrupted"]
    assert probe["80 [MASK] / 20 random"]["observed"] < 0.5 < probe["80/10/10 (BERT)"]["observed"]


def test_the_stored_accuracies_count_the_probes_positions():
    """Each stored accuracy is a count over the probe's positions of the real validation text."""
    try:
        from groundup.char_data import char_corpus

        _, _, val_ids = char_corpus("shakespeare")
    except Exception as err:  # noqa: BLE001 -- no corpus here (offline)
        pytest.skip(f"the Shakespeare corpus is not available: {err}")
    env = experiment(val_ids)
    windows, g = env["probe_windows"], torch.Generator().manual_seed(6)
    counts = {}
    for name, fractions in [("[MASK]", (1.0, 0.0)), ("corrupted", (0.0, 1.0))]:
        x, y = mask_tokens(windows, mask_token_id=N_V, vocab_size=N_V + 1, generator=g,
                           mask_fraction=fractions[0], random_fraction=fractions[1])
        counts[name] = ((y != -100) & (x != y)).sum().item()
    assert counts["[MASK]"] == 2500 and 2400 < counts["corrupted"] < 2500  # as the notebook's prose says
    for found in ENTRY["probe"].values():
        for name, n in counts.items():
            assert found[name] * n == pytest.approx(round(found[name] * n), abs=1e-6)
