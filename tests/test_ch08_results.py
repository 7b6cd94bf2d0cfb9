"""tools/ch08_results.py (chapter 8's decoding-settings sweep) against the notebook's own definitions, and the
entry it stored in chapter08.json."""

import ast
import json
import math
import statistics
import sys
from importlib import resources
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from groundup.generation import generate
from groundup.models import GPT, GPTConfig
from groundup.tokenizers import CharTokenizer

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import ch08_results  # noqa: E402
import notebook_cells as cells  # noqa: E402

NOTEBOOK = ROOT / "notebooks" / "08_generation.ipynb"
STORED = json.loads(resources.files("groundup").joinpath("results/chapter08.json").read_text(encoding="utf-8"))
ENTRY = STORED["runs"]["decoding-sweep"]


def notebook_cell(marker: str):
    return cells.notebook_cell(NOTEBOOK, marker)


def notebook_definitions(marker: str, names: set[str], env: dict) -> dict:
    return cells.notebook_definitions(NOTEBOOK, marker, names, env)


SWEEP = notebook_definitions("def distinct_bigrams", {"SETTINGS", "N_SAMPLES", "N_NEW", "SEEDS", "distinct_bigrams",
                                                      "repetition", "sample", "measure"},
                             {"statistics": statistics, "torch": torch, "generate": generate})


def function_ast(tree, name):
    node = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == name)
    return ast.dump(node)


def test_settings_and_metric_code_are_the_notebooks():
    assert ch08_results.SETTINGS == SWEEP["SETTINGS"]
    assert list(ch08_results.SETTINGS) == list(SWEEP["SETTINGS"])
    assert (ch08_results.N_SAMPLES, ch08_results.N_NEW, ch08_results.SEEDS) == (
        SWEEP["N_SAMPLES"], SWEEP["N_NEW"], SWEEP["SEEDS"])
    tool = ast.parse(Path(ch08_results.__file__).read_text(encoding="utf-8"))
    cell = notebook_cell("def distinct_bigrams")
    for name in ("distinct_bigrams", "repetition"):
        assert function_ast(tool, name) == function_ast(cell, name), name


def test_metrics_on_known_strings():
    for distinct, rep in [(ch08_results.distinct_bigrams, ch08_results.repetition),
                          (SWEEP["distinct_bigrams"], SWEEP["repetition"])]:
        # pairs (a b) (b a) | (a b): 2 distinct of 3
        assert distinct(["a b a", "a b"]) == 2 / 3
        assert distinct(["one", ""]) == 0.0  # no pairs at all
        assert distinct(["to be or", "not to be"]) == 3 / 4  # (to be) twice
        # abc bca cab abc bca cab abc: the last 4 of 7 seen before
        assert rep("abcabcabc", n=3) == 4 / 7
        assert rep("abcdefghijk") == 0.0
        assert rep("a" * 12) == 2 / 3


def tiny_model():
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=30, context_length=16, d_model=16, n_layers=1, n_heads=2)).eval()


def reference_mean_loss(model, ids):
    """Mean loss per row: windows of the context, each predicting its next tokens, written out directly."""
    n_C, out = model.config.context_length, []
    for row in ids:
        total, count = 0.0, 0
        for s in range(0, len(row) - 1, n_C):
            x, y = row[s:s + n_C], row[s + 1:s + n_C + 1]
            with torch.no_grad():
                logits, _ = model(x[None, :len(y)])
            total += F.cross_entropy(logits[0], y, reduction="sum").item()
            count += len(y)
        out.append(total / count)
    return out


def test_mean_loss_is_the_notebooks_and_a_direct_computation():
    model = tiny_model()
    env = notebook_definitions("def mean_loss", {"mean_loss"},
                               {"math": math, "torch": torch, "F": F, "n_C": model.config.context_length})
    ids = torch.randint(0, 30, (3, 40), generator=torch.Generator().manual_seed(1))
    found = ch08_results.mean_loss(model, ids)
    assert found == env["mean_loss"](model, ids)
    assert found == pytest.approx(reference_mean_loss(model, ids), rel=1e-5)


def test_one_setting_equals_a_direct_generate_call_and_the_notebooks_measure():
    model = tiny_model()
    tokenizer = CharTokenizer(list("abcdefghijklmnopqrstuvwxyz .,\n"))
    prompt = torch.tensor([tokenizer.encode("ab c")])
    for name, kw, seed in [("T 0.8, top-p 0.9", dict(temperature=0.8, top_p=0.9), 1), ("greedy", {}, 0)]:
        ids = ch08_results.sample(model, prompt, name, seed)
        direct = generate(model, prompt.repeat(8, 1), 150, generator=torch.Generator().manual_seed(seed),
                          greedy=name == "greedy", **kw)
        assert torch.equal(ids, direct)
        env = notebook_definitions("def distinct_bigrams", {"SETTINGS", "N_SAMPLES", "N_NEW", "distinct_bigrams",
                                                            "repetition", "sample", "measure"},
                                   {"statistics": statistics, "torch": torch, "generate": generate, "model": model,
                                    "prompt": prompt, "tokenizer": tokenizer, "mean_loss": ch08_results.mean_loss})
        assert torch.equal(env["sample"](name, seed), ids)
        row = ch08_results.measure_row(model, tokenizer, prompt, ids)
        assert row == env["measure"](ids)
        texts = [tokenizer.decode(r[4:].tolist()) for r in ids]
        assert row[:2] == (ch08_results.distinct_bigrams(texts), statistics.mean(map(ch08_results.repetition, texts)))
        assert row[2] == pytest.approx(statistics.mean(reference_mean_loss(model, ids[:, 3:])), rel=1e-5)
        assert row[3] == sum(ch08_results.repetition(t) > 0 for t in texts)
    results, sample_ids = ch08_results.sweep(model, tokenizer, prompt, names=["T = 1.5"], seeds=[2, 0])
    assert list(results) == ["T = 1.5"] and len(results["T = 1.5"]) == 2
    assert torch.equal(sample_ids["T = 1.5"], ch08_results.sample(model, prompt, "T = 1.5", 2))
    assert results["T = 1.5"][1] == ch08_results.measure_row(
        model, tokenizer, prompt, ch08_results.sample(model, prompt, "T = 1.5", 0))


def test_the_stored_entry_has_what_the_notebook_reads():
    assert ENTRY["command"] == "python tools/ch08_results.py"
    assert ENTRY["settings"] == SWEEP["SETTINGS"]
    assert (ENTRY["n_samples"], ENTRY["n_new"], ENTRY["seeds"]) == (SWEEP["N_SAMPLES"], SWEEP["N_NEW"], SWEEP["SEEDS"])
    assert ENTRY["prompt"] == ch08_results.PROMPT == "KING.\nMy lord, "
    machine = ENTRY["machine"]
    assert (machine["mkl_cbwr"], machine["cpu_capability"].lower(), machine["threads"]) == ("COMPATIBLE", "default", 1)
    assert list(ENTRY["results"]) == list(SWEEP["SETTINGS"]) == list(ENTRY["sample_ids"])
    length = len(ch08_results.PROMPT) + SWEEP["N_NEW"]  # one character a token
    for name in SWEEP["SETTINGS"]:
        rows = ENTRY["results"][name]
        assert len(rows) == len(SWEEP["SEEDS"])
        for diversity, rep, loss, repeating in rows:
            assert 0 <= diversity <= 1 and 0 <= rep < 1 and 0.5 < loss < 4
            assert isinstance(repeating, int) and 0 <= repeating <= SWEEP["N_SAMPLES"]
        ids = torch.tensor(ENTRY["sample_ids"][name])
        assert ids.shape == (SWEEP["N_SAMPLES"], length) and ids.dtype == torch.long
    greedy = torch.tensor(ENTRY["sample_ids"]["greedy"])
    assert (greedy == greedy[0]).all()  # greedy ignores the seed: 8 equal samples
    assert len({tuple(r) for r in ENTRY["results"]["greedy"]}) == 1


def test_the_stored_samples_give_the_stored_text_measures():
    try:
        from groundup.data import load_corpus

        tokenizer = CharTokenizer.from_text(load_corpus("shakespeare"))
    except Exception as err:  # noqa: BLE001 -- no corpus here (offline): nothing to decode with
        pytest.skip(f"the Shakespeare corpus is not available: {err}")
    P = len(ch08_results.PROMPT)
    for name in SWEEP["SETTINGS"]:
        ids = ENTRY["sample_ids"][name]
        assert {tokenizer.decode(r[:P]) for r in ids} == {ch08_results.PROMPT}
        texts = [tokenizer.decode(r[P:]) for r in ids]
        diversity, rep, _, repeating = ENTRY["results"][name][0]  # seed 0's row
        reps = [ch08_results.repetition(t) for t in texts]
        assert (diversity, rep, repeating) == (ch08_results.distinct_bigrams(texts), statistics.mean(reps),
                                               sum(r > 0 for r in reps))
