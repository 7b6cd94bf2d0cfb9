"""tools/ch12_results.py: the stored check of SmolLM2 in the book's GPT against transformers (chapter 12), read back
and partly recomputed (the book's model only: transformers' GGUF loading takes too long for the unit tests)."""

import json
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import ch12_results  # noqa: E402

ENTRY = json.loads(ch12_results.OUT.read_text())["runs"][ch12_results.KEY]


@pytest.fixture(scope="module")
def smollm2():
    from groundup.pretrained import load_smollm2

    return load_smollm2()


def test_the_stored_entry_says_what_the_issue_asks():
    for name in ("ours_vs_transformers", "kept_quantized_vs_ours"):
        c = ENTRY[name]
        assert c["max_logit_gap"] < 1e-3 and c["argmax_agreement"] >= 0.98, name
        assert abs(c["loss"][0] - c["loss"][1]) < 0.01, name
        assert set(c["greedy"]) == set(ch12_results.PROMPTS)
        for g in c["greedy"].values():
            assert g["equal"] == (g["tokens"][0] == g["tokens"][1]) and len(g["tokens"][0]) == ch12_results.NEW_TOKENS
    assert ENTRY["command"] == "python tools/ch12_results.py" and ENTRY["machine"]["threads"] == 1
    assert ENTRY["machine"]["arithmetic"]["ONEDNN_MAX_CPU_ISA"] == "SSE41"


def test_the_slice_prompts_and_the_book_models_numbers_recomputed(smollm2):
    model, tok = smollm2
    text = ch12_results.slice_text()
    assert len(text) == ch12_results.SLICE
    ids = [tok.special_ids["<|endoftext|>"], *tok.encode_ordinary(text)]
    assert ENTRY["slice"]["tokens"] == len(ids) - 1
    assert {n: p["ids"] for n, p in ENTRY["prompts"].items()} == ch12_results.prompt_ids(tok)
    n = ENTRY["ours_loss_first_tokens"]["tokens"]  # a causal model: the first n positions need only n tokens
    with torch.no_grad():
        logits = model(torch.tensor([ids[:n]]))[0][0]
    loss = F.cross_entropy(logits, torch.tensor(ids[1:n + 1])).item()
    assert loss == pytest.approx(ENTRY["ours_loss_first_tokens"]["loss"], abs=1e-5)
    plain = ENTRY["ours_vs_transformers"]["greedy"]["plain"]["tokens"][0]
    assert ch12_results.greedy(model, ENTRY["prompts"]["plain"]["ids"])[:8] == plain[:8]


def test_the_stored_types_table_adds_up():
    from groundup import quantization as Q

    table = json.loads(ch12_results.OUT.read_text())["runs"]["quantization-types"]
    rows = table["rows"]
    assert list(rows) == ["file", *ch12_results.TYPES]
    for name in ch12_results.TYPES:
        by_type = rows[name]["weights_by_type"]
        assert set(by_type) <= {name, ch12_results.FALLBACK.get(name, name)}
        # bits per weight from the weights each type got and GGML's bytes per block
        layouts = {t: Q.BLOCK_LAYOUT[Q.TYPE_NUMBERS[t]] for t in by_type}
        bits = sum(8 * n * layouts[t][1] / layouts[t][0] for t, n in by_type.items()) / sum(by_type.values())
        assert rows[name]["bits_per_weight"] == pytest.approx(bits, rel=1e-12), name
    assert ch12_results.type_for("Q4_K", 576) == "Q5_0" and ch12_results.type_for("Q4_K", 1536) == "Q4_K"
    assert min(ch12_results.TYPES, key=lambda n: rows[n]["relative_rms_error"]) == "Q8_0"
    assert rows["Q8_0"]["relative_rms_error"] < rows["Q4_0"]["relative_rms_error"] < rows["Q2_K"]["relative_rms_error"]
    assert table["slice"]["tokens"] == json.loads(ch12_results.OUT.read_text())["runs"][ch12_results.KEY]["slice"][
        "tokens"]
