"""tools/ch08_results.py (chapter 8's decoding-settings sweep) against the notebook's own definitions, and the
entry it stored in chapter08.json."""

import ast
import itertools
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


SWEEP_NAMES = {"SETTINGS", "N_SAMPLES", "N_NEW", "SEEDS", "distinct_words", "shared_4grams", "repetition", "sample",
               "measure"}
SWEEP = notebook_definitions("def distinct_words", SWEEP_NAMES,
                             {"statistics": statistics, "itertools": itertools, "torch": torch, "generate": generate})


def function_ast(tree, name):
    node = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == name)
    return ast.dump(node)


def test_settings_and_metric_code_are_the_notebooks():
    assert ch08_results.SETTINGS == SWEEP["SETTINGS"]
    assert list(ch08_results.SETTINGS) == list(SWEEP["SETTINGS"])
    assert (ch08_results.N_SAMPLES, ch08_results.N_NEW, ch08_results.SEEDS) == (
        SWEEP["N_SAMPLES"], SWEEP["N_NEW"], SWEEP["SEEDS"])
    tool = ast.parse(Path(ch08_results.__file__).read_text(encoding="utf-8"))
    cell = notebook_cell("def distinct_words")
    for name in ("distinct_words", "shared_4grams", "repetition"):
        assert function_ast(tool, name) == function_ast(cell, name), name
    assert function_ast(tool, "copy_probabilities") == function_ast(notebook_cell("def copy_probabilities"),
                                                                     "copy_probabilities")


def test_metrics_on_known_strings():
    for distinct, shared, rep in [(ch08_results.distinct_words, ch08_results.shared_4grams, ch08_results.repetition),
                                  (SWEEP["distinct_words"], SWEEP["shared_4grams"], SWEEP["repetition"])]:
        assert distinct("a b a") == 2 / 3
        assert distinct("") == 0.0  # no words at all
        assert distinct("to be or not to be") == 4 / 6
        # {abcd, bcde} and {bcde, cdef}: each shares 1 of its 2 with the other
        assert shared(["abcde", "bcdef"]) == 0.5
        assert shared(["abcd", "abcd", "wxyz"]) == (1 + 0 + 1 + 0 + 0 + 0) / 6
        assert shared(["abc", "abcd"]) == 0.0  # a text too short for a 4-gram shares nothing
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
        env = notebook_definitions("def distinct_words", SWEEP_NAMES,
                                   {"statistics": statistics, "itertools": itertools, "torch": torch,
                                    "generate": generate, "model": model, "prompt": prompt, "tokenizer": tokenizer,
                                    "mean_loss": ch08_results.mean_loss})
        assert torch.equal(env["sample"](name, seed), ids)
        row = ch08_results.measure_row(model, tokenizer, prompt, ids)
        assert row == env["measure"](ids)
        texts = [tokenizer.decode(r[4:].tolist()) for r in ids]
        assert row[:3] == (statistics.mean(map(ch08_results.distinct_words, texts)), ch08_results.shared_4grams(texts),
                           statistics.mean(map(ch08_results.repetition, texts)))
        assert row[3] == pytest.approx(statistics.mean(reference_mean_loss(model, ids[:, 3:])), rel=1e-5)
        assert row[4] == sum(ch08_results.repetition(t) > 0 for t in texts)
    results, sample_ids = ch08_results.sweep(model, tokenizer, prompt, names=["T = 1.5"], seeds=[2, 0])
    assert list(results) == ["T = 1.5"] and len(results["T = 1.5"]) == 2
    assert torch.equal(sample_ids["T = 1.5"], ch08_results.sample(model, prompt, "T = 1.5", 2))
    assert results["T = 1.5"][1] == ch08_results.measure_row(
        model, tokenizer, prompt, ch08_results.sample(model, prompt, "T = 1.5", 0))


def test_the_stored_entry_has_what_the_notebook_reads():
    assert ENTRY["command"] == "python tools/ch08_results.py"
    assert ENTRY["settings"] == SWEEP["SETTINGS"]
    assert ENTRY["columns"] == ch08_results.COLUMNS == ["distinct_words", "shared_4grams", "repetition", "own_loss",
                                                        "repeating"]
    assert (ENTRY["n_samples"], ENTRY["n_new"], ENTRY["seeds"]) == (SWEEP["N_SAMPLES"], SWEEP["N_NEW"], SWEEP["SEEDS"])
    assert ENTRY["prompt"] == ch08_results.PROMPT == "KING.\nMy lord, "
    machine = ENTRY["machine"]
    assert (machine["mkl_cbwr"], machine["cpu_capability"].lower(), machine["threads"]) == ("COMPATIBLE", "default", 1)
    assert list(ENTRY["results"]) == list(SWEEP["SETTINGS"]) == list(ENTRY["sample_ids"])
    length = len(ch08_results.PROMPT) + SWEEP["N_NEW"]  # one character a token
    for name in SWEEP["SETTINGS"]:
        rows = ENTRY["results"][name]
        assert len(rows) == len(SWEEP["SEEDS"])
        for distinct, shared, rep, loss, repeating in rows:
            assert 0 < distinct <= 1 and 0 <= shared <= 1 and 0 <= rep < 1 and 0.5 < loss < 4
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
        distinct, shared, rep, _, repeating = ENTRY["results"][name][0]  # seed 0's row
        reps = [ch08_results.repetition(t) for t in texts]
        assert (distinct, shared, rep, repeating) == (
            statistics.mean(map(ch08_results.distinct_words, texts)), ch08_results.shared_4grams(texts),
            statistics.mean(reps), sum(r > 0 for r in reps))


def reference_copy_probabilities(model, phrases, n_copies):
    """Each copy's mean probability, one sequence and one position at a time (softmax written out)."""
    out = []
    for phrase in phrases:
        x = phrase.repeat(n_copies)
        with torch.no_grad():
            logits, _ = model(x[None])
        row = []
        for k in range(n_copies):
            ps = []
            for j in range(k * len(phrase), (k + 1) * len(phrase)):
                if j == 0:
                    continue  # nothing before the first token
                z = logits[0, j - 1].double()
                ps.append((z[x[j]] - torch.logsumexp(z, 0)).exp().item())
            row.append(sum(ps) / len(ps))
        out.append(row)
    return torch.tensor(out, dtype=torch.float64)


def test_copy_probabilities_is_a_direct_computation():
    model = tiny_model()
    phrases = torch.randint(0, 30, (3, 5), generator=torch.Generator().manual_seed(2))
    got = ch08_results.copy_probabilities(model, phrases, 3)
    assert got.shape == (3, 3)
    assert torch.allclose(got.double(), reference_copy_probabilities(model, phrases, 3), atol=1e-6)
    batched = ch08_results.copy_probabilities_batched(model, phrases, 3, batch=2)
    assert torch.allclose(batched, got, atol=1e-6)


def test_phrases_are_drawn_as_documented():
    tokenizer = CharTokenizer(list("abcdefghijklmnopqrstuvwxyz .,\n"))
    text = ("the cat sat on the mat and the dog ran.\nthen it rained all day long " * 20)
    phrases = ch08_results.smollm2_phrases(tokenizer, text, n=6, length=8)
    assert phrases.shape == (6, 8)
    for row in phrases.tolist():
        piece = tokenizer.decode(row)
        assert piece.startswith(" ") and piece[1] != " " and "\n" not in piece and piece[1:] in text
    assert torch.equal(phrases, ch08_results.smollm2_phrases(tokenizer, text, n=6, length=8))
    rnd = ch08_results.random_phrases(50, n=4, length=3)
    assert rnd.shape == (4, 3) and 0 <= int(rnd.min()) and int(rnd.max()) < 50


def test_the_smollm2_entry_has_what_the_notebook_reads():
    entry = STORED["runs"]["smollm2-repeats"]
    assert entry["command"] == "python tools/ch08_results.py --entry smollm2-repeats"
    n, length, copies = ch08_results.N_PHRASES, ch08_results.PHRASE_TOKENS, ch08_results.SMOL_COPIES
    assert (entry["n_phrases"], entry["phrase_tokens"], entry["copies"]) == (n, length, copies)
    assert entry["machine"]["threads"] == 1 and entry["machine"]["mkl_cbwr"] == "COMPATIBLE"
    for kind in ("real", "random"):
        phrases, probs = torch.tensor(entry[kind]["phrases"]), torch.tensor(entry[kind]["probabilities"])
        assert phrases.shape == (n, length) and probs.shape == (n, copies)
        assert ((0 <= probs) & (probs <= 1)).all()
    assert torch.equal(torch.tensor(entry["random"]["phrases"]), ch08_results.random_phrases(49152))
    real = torch.tensor(entry["real"]["probabilities"]).mean(0)
    assert real[-1] > real[1] > real[0]  # what the chapter says: each copy more probable than the last


def test_the_kv_timing_entry_has_what_the_notebook_reads():
    entry = STORED["runs"]["kv-timing"]
    assert entry["command"] == "python tools/ch08_results.py --entry kv-timing"
    assert entry["lengths"] == ch08_results.KV_LENGTHS and entry["repeats"] == ch08_results.KV_REPEATS
    from groundup.bench.generation import CONFIG

    assert entry["model"]["config"] == CONFIG
    assert entry["machine"]["mkl_cbwr"] is None  # the fast kernels
    for n in entry["lengths"]:
        t = entry["seconds"][str(n)]
        assert len(t["cached"]) == len(t["uncached"]) == entry["repeats"]
        assert all(x > 0 for x in t["cached"] + t["uncached"])
    p = entry["profile"]
    assert p["n_new"] == entry["lengths"][-1] and p["operator_calls_per_token"] > 10
    assert set(p["operator_seconds_per_token"]) <= {*ch08_results.OPERATOR_KINDS, "other operators"}
    assert p["seconds_per_token_profiled"] == pytest.approx(
        sum(p["operator_seconds_per_token"].values()) + p["unaccounted_seconds_per_token"])


def test_operator_kinds():
    assert ch08_results.operator_kind("aten::addmm") == "matrix products"
    assert ch08_results.operator_kind("aten::_scaled_dot_product_flash_attention_for_cpu") == "attention"
    assert ch08_results.operator_kind("aten::cat") == "copies (cache, cat)"
    assert ch08_results.operator_kind("aten::layer_norm") == "norms"
    assert ch08_results.operator_kind("aten::gelu") == "other operators"
