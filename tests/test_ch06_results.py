"""tools/ch06_results.py (chapter 6's Post-LN / Pre-LN runs) and the entries it stored in chapter06.json."""

import json
import math
import shlex
import sys
from importlib import resources
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from groundup import char_data

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import ch06_results  # noqa: E402

STORED = json.loads(resources.files("groundup").joinpath("results/chapter06.json").read_text())
RUNS = {key: entry for key, entry in STORED.items() if key != "corpus"}


def test_without_residual_scaling_only_the_stream_writers_change():
    scaled = dict(ch06_results.build_model("post_warmup", 3, 65).named_parameters())
    unscaled = dict(ch06_results.build_model("post_warmup_noscale", 3, 65).named_parameters())
    assert scaled.keys() == unscaled.keys()
    factor = math.sqrt(2 * 24)
    writers = [name for name in scaled if name.endswith(("attention.W_o.weight", "ffn.W_out.weight"))]
    assert len(writers) == 2 * 24
    for name, p in scaled.items():
        if name in writers:
            torch.testing.assert_close(unscaled[name], p * factor)
        else:
            assert torch.equal(unscaled[name], p), name
    # the unscaled writers are drawn like every other weight: N(0, 0.02^2)
    w = torch.cat([unscaled[name].flatten() for name in writers])
    assert abs(w.std().item() - 0.02) < 2e-4 and abs(w.mean().item()) < 2e-4


@pytest.mark.parametrize("variant, clip, steps", [("post_warmup_noclip", None, 200), ("post_warmup_800", 1.0, 800),
                                                  ("post_warmup", 1.0, 200)])
def test_run_trains_with_the_variants_settings(monkeypatch, variant, clip, steps):
    seen = {}

    def fake_train(model, train_ids, val_ids, config):
        seen.update(model=model, config=config)
        evals = list(range(25, config.max_steps + 1, 25))
        return SimpleNamespace(eval_step=evals, val_loss=[3.0] * len(evals), train_loss=[3.0] * config.max_steps,
                               grad_norm=[1.0] * config.max_steps)

    text = "to be or not to be, that is the question\n" * 50
    monkeypatch.setattr(char_data, "load_corpus", lambda name, cache_dir=None: text)  # read by char_corpus
    monkeypatch.setattr(ch06_results, "train", fake_train)
    entry = ch06_results.run(variant, 2)
    config = seen["config"]
    assert (config.grad_clip, config.max_steps, config.warmup_steps, config.learning_rate, config.seed) == (
        clip, steps, 50, 2e-3, 2)
    assert seen["model"].config.norm_position == "post" and seen["model"].config.n_layers == 24
    assert entry["command"] == f"python tools/ch06_results.py --variant {variant} --seed 2"
    assert (entry["grad_clip"], entry["steps"], entry["eval_step"][-1]) == (clip, steps, steps)


def test_confounds_and_variant_are_exclusive(capsys):
    with pytest.raises(SystemExit):
        ch06_results.main(["--confounds", "--variant", "post"])
    assert "--variant and --confounds" in capsys.readouterr().err


@pytest.mark.parametrize("key", sorted(RUNS))
def test_stored_entry_matches_its_command_and_settings(key):
    entry = RUNS[key]
    words = shlex.split(entry["command"])
    assert words[:2] == ["python", "tools/ch06_results.py"]
    variant, seed = words[words.index("--variant") + 1], int(words[words.index("--seed") + 1])
    assert key == f"{variant}/seed{seed}" and (entry["variant"], entry["seed"]) == (variant, seed)
    v = ch06_results.VARIANTS[variant]
    stored = {field: entry[field] for field in v._fields}
    assert stored == v._asdict()
    assert entry["eval_step"] == list(range(25, v.steps + 1, 25))
    assert len(entry["val_loss"]) == len(entry["eval_step"])
    assert len(entry["train_loss"]) == len(entry["grad_norm"]) == v.steps


def test_every_confound_has_three_seeds():
    for variant in ch06_results.CONFOUNDS:
        assert {RUNS[key]["seed"] for key in RUNS if key.startswith(variant + "/")} >= {0, 1, 2}, variant
