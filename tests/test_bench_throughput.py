"""groundup.bench.throughput: the FLOP formula against PyTorch's FLOP counter, the throughput and MFU arithmetic, the
graph breaks under torch.compile, and chapter07.json's "throughput" entry against its tool (tools/ch07_throughput.py).
No time is ever asserted."""

import json
import math
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from groundup.bench import throughput as tp
from groundup.models import GPT, GPTConfig

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import ch07_throughput as tool  # noqa: E402

SMALL = dict(vocab_size=11, context_length=8, d_model=16, n_layers=2, n_heads=2)
CONFIGS = {
    "learned, tied": {},
    "rope (chapter 7's family)": dict(positional="rope"),
    "relative, untied": dict(positional="relative", tie_weights=False),
    "alibi, grouped-query, swiglu": dict(positional="alibi", n_heads=4, n_kv_heads=2, activation="swiglu"),
    "rope, parallel block, no biases, 3 layers": dict(positional="rope", parallel_block=True, bias=False, n_layers=3),
}


def _count(config: GPTConfig, batch: int, n: int) -> tuple[int, dict]:
    torch.manual_seed(0)
    model = GPT(config)
    x, y = (torch.randint(0, config.vocab_size, (batch, n)) for _ in range(2))
    counter = FlopCounterMode(display=False, custom_mapping=tp._cpu_attention_formulas())
    with counter:
        _, loss = model(x, y)
        loss.backward()
    assert tp.counted_flops(model, x, y) == counter.get_total_flops()
    return counter.get_total_flops(), {str(k) for k in counter.get_flop_counts()["Global"]}


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("n", [8, 5])
def test_the_formula_equals_the_flop_counter_exactly(name, n):
    """Tolerance: none. Both count the matrix products only (neither counts layer norms, softmax, GELU, rotary,
    residual and bias additions, the cross-entropy, the lookup, clipping or AdamW); the counter also counts the
    scores a flash-attention backward recomputes (recomputed_flops), which the formula, as PaLM's MFU, leaves out."""
    config = GPTConfig(**{**SMALL, **CONFIGS[name]})
    counted, ops = _count(config, 3, n)
    formula = tp.flops_per_step(config, 3, n)
    flash = "aten._scaled_dot_product_flash_attention_for_cpu_backward" in ops
    assert counted == formula + (tp.recomputed_flops(config, 3, n) if flash else 0), (name, ops)
    if name.startswith(("learned", "rope")):
        assert counted > 0 and any("attention" in op or "bmm" in op for op in ops), "attention must be counted"


def test_flops_per_token_is_6n_plus_12_nl_nc_d_for_chapter_7():
    c = tp.chapter7_config()
    d, n_l, n_c, vocab = 128, 4, 64, 84
    n = n_l * (4 * d * d + 2 * d * 4 * d) + vocab * d  # W_Q, W_K, W_V, W_O, the FFN; the tied unembedding once
    assert tp.flops_per_token(c) == 6 * n + 12 * n_l * n_c * d == 5_176_320
    assert tp.flops_per_step(c, 12) == 5_176_320 * 12 * 64
    assert tp.flops_per_token(c, 32) == 6 * n + 12 * n_l * 32 * d
    model = GPT(c)
    assert tp.matmul_weights(model) == n and sum(p.numel() for p in model.parameters()) == 804_096


def test_matmul_weights_count_products_not_lookups():
    tied, untied = GPT(GPTConfig(**SMALL)), GPT(GPTConfig(**SMALL, tie_weights=False))
    relative = GPT(GPTConfig(**SMALL, positional="relative"))
    assert tp.matmul_weights(tied) == tp.matmul_weights(untied) == tp.matmul_weights(relative)
    assert tp.matmul_weights(tied) == 2 * (4 * 16 * 16 + 2 * 16 * 64) + 11 * 16
    gqa = GPT(GPTConfig(**{**SMALL, "n_heads": 4, "n_kv_heads": 1}))  # W_K and W_V: one head of 4 each
    assert tp.matmul_weights(gqa) == 2 * (2 * 16 * 16 + 2 * 16 * 4 + 2 * 16 * 64) + 11 * 16


def test_throughput_and_mfu_arithmetic_on_fake_timings():
    assert tp.tokens_per_second(12, 64, 0.1) == pytest.approx(7680.0)
    assert tp.achieved_gflops(4e9, 0.1) == pytest.approx(40.0)
    assert tp.mfu(4e9, 0.1, 80.0) == pytest.approx(0.5)
    assert tp.mfu(3_975_413_760, 0.09, 90.0) == pytest.approx(3_975_413_760 / 0.09 / 1e9 / 90.0)
    assert tp.quartiles([3.0]) == (3.0, 3.0, 3.0)
    assert tp.quartiles([1.0, 2.0, 3.0, 4.0, 5.0]) == (2.0, 3.0, 4.0)


def _check_consistent(r: dict, batch: int, n_c: int, rel: float = 1e-12):
    peak, flops = r["matmul_peak_gflops"], r["flops_per_step"]["formula"]
    assert r["tokens_per_step"] == batch * n_c
    for side in ("eager", "compiled"):
        if side not in r:
            continue
        s = r[side]
        median = s["seconds_per_step"]["median"]
        assert s["seconds_per_step"]["q1"] <= median <= s["seconds_per_step"]["q3"]
        assert s["tokens_per_second"] == pytest.approx(batch * n_c / median, rel=rel)
        assert s["achieved_gflops"] == pytest.approx(flops / median / 1e9, rel=rel)
        assert s["mfu"] == pytest.approx(flops / median / 1e9 / peak, rel=rel)


def test_measure_throughput_eager_reports_consistent_numbers():
    config = GPTConfig(**SMALL, positional="rope")
    r = tp.measure_throughput(config, 3, steps=3, warmup=1, compile=False, n_threads=1, peak_gflops=50.0,
                              device="cpu")
    assert r["device"] == "cpu" and r["threads"] == 1 and r["matmul_peak_gflops"] == 50.0
    assert r["flops_per_step"]["formula"] == tp.flops_per_step(config, 3)
    assert r["flops_per_step"]["counted"] == r["flops_per_step"]["formula"] + \
        r["flops_per_step"]["recomputed_by_flash_backward"]
    assert len(r["eager"]["per_step"]) == 3 and "compiled" not in r and "compile_seconds" not in r
    _check_consistent(r, 3, 8)


def test_measure_throughput_alternates_eager_and_compiled(monkeypatch):
    """The compiled side's bookkeeping, with torch.compile replaced by the identity (a real compile takes minutes:
    tools/ch07_throughput.py --smoke runs one)."""
    monkeypatch.setattr(torch, "compile", lambda model: model)
    r = tp.measure_throughput(GPTConfig(**SMALL), 2, n_c=6, steps=4, warmup=1, n_threads=1, device="cpu")
    assert r["compile_seconds"] > 0 and len(r["compiled"]["per_step"]) == len(r["eager"]["per_step"]) == 4
    assert len(r["matmul_peak_gflops_before_after"]) == 2
    assert r["matmul_peak_gflops"] == max(r["matmul_peak_gflops_before_after"])
    ratio = r["eager_over_compiled"]
    assert ratio["q1"] <= ratio["median"] <= ratio["q3"]
    _check_consistent(r, 2, 6)


def test_the_training_step_is_the_step_train_takes():
    """One call of training_step = forward, backward, clipping at 1, the fused AdamW update of train."""
    from groundup.training import TrainConfig, _make_optimizer

    config = GPTConfig(**SMALL)
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(GPT(config))
    x, y = (torch.randint(0, 11, (2, 8), generator=torch.Generator().manual_seed(1)) for _ in range(2))
    settings = TrainConfig(batch_size=2, learning_rate=3e-3)
    loss = tp.training_step(models[0], _make_optimizer(models[0], settings, torch.device("cpu")), x, y)()
    optimizer = _make_optimizer(models[1], settings, torch.device("cpu"))
    _, ref = models[1](x, y)
    optimizer.zero_grad(set_to_none=True)
    ref.backward()
    torch.nn.utils.clip_grad_norm_(models[1].parameters(), 1.0)
    optimizer.step()
    assert loss == ref.item()
    assert all(torch.equal(a, b) for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True))


@pytest.mark.parametrize("positional", ["rope", "alibi"])
def test_the_model_forward_and_loss_compile_without_graph_breaks(positional):
    torch.manual_seed(0)
    model = GPT(GPTConfig(**SMALL, positional=positional))
    x, y = (torch.randint(0, 11, (2, 8)) for _ in range(2))
    result = tp.graph_breaks(lambda x, y: model(x, y)[1], x, y)
    assert (result["graphs"], result["breaks"]) == (1, 0), result["reasons"]


def test_a_training_step_breaks_only_inside_torch_optim():
    """zero_grad (not traced), Optimizer.step's own graph_break() and the fused AdamW (not traced): PyTorch's own."""
    result = tp.model_graph_breaks(GPTConfig(**SMALL, positional="rope"), 2)
    assert result["forward_and_loss"]["breaks"] == 0, result["forward_and_loss"]["reasons"]
    step = result["training_step"]
    assert step["breaks"] <= 3, step["reasons"]
    for reason in step["reasons"]:
        where = reason.rsplit("(", 1)[1]
        assert where.startswith(("optimizer.py", "adam.py")) or (
            where.startswith("throughput.py") and "skipped" in reason), reason


def test_eager_results_are_unchanged_by_the_compile_guards():
    """The checks skipped while compiling still run eagerly: bad positions and an all-ignored loss are refused."""
    from groundup.positional import RotaryEmbedding

    with pytest.raises(ValueError, match=">= 0"):
        RotaryEmbedding(4).apply_rotary(torch.zeros(1, 3, 4), torch.tensor([0, -1, 2]))
    model = GPT(GPTConfig(**SMALL))
    with pytest.raises(ValueError, match="every target is -100"):
        model(torch.zeros(1, 4, dtype=torch.long), torch.full((1, 4), -100))


def test_bench_section_rows(monkeypatch):
    from groundup.bench.__main__ import SECTIONS

    assert SECTIONS.index("throughput") == SECTIONS.index("training") + 1
    fake = {"parameters": 804_096, "matmul_peak_gflops": 80.0, "threads": 2, "device": "cpu",
            "flops_per_step": {"formula": 4e9, "counted": 4.05e9, "ratio": 4e9 / 4.05e9},
            "eager": {"seconds_per_step": {"median": 0.1}, "tokens_per_second": 7680.0, "achieved_gflops": 40.0,
                      "mfu": 0.5}}
    monkeypatch.setattr(tp, "measure_throughput", lambda *a, **k: fake)
    rows = tp.run()
    assert rows[0].value == pytest.approx(100.0) and "7,680 tokens/s" in rows[0].note and "50%" in rows[0].note
    assert rows[1].unit == "GFLOP" and rows[1].value == pytest.approx(4.0)


# ---- the stored entry -----------------------------------------------------------------------------------------


def test_tool_rounds_to_significant_digits():
    assert tool.rounded({"a": [0.123456789, 2], "b": 12345.678}) == {"a": [0.123457, 2], "b": 12345.7}


def _stored():
    path = ROOT / "src" / "groundup" / "results" / "chapter07.json"
    entry = json.loads(path.read_text()).get(tool.SECTION, {}).get(tool.KEY)
    if entry is None:
        pytest.skip("no throughput entry stored yet (python tools/ch07_throughput.py)")
    return entry


def test_stored_entry_matches_the_formula_and_its_own_arithmetic():
    entry = _stored()
    assert entry["model"] == {**tool.CHAPTER7_MODEL, "vocab_size": tp.CHAPTER7_VOCAB}
    assert entry["command"].split("python ", 1)[1].startswith("tools/ch07_throughput.py")
    assert {run["threads"] for run in entry["runs"].values()} == {1, 2}
    for run in entry["runs"].values():
        assert run["flops_per_step"]["formula"] == tp.flops_per_step(tp.chapter7_config(), tool.CHAPTER7_BATCH)
        assert run["flops_per_step"]["counted"] - run["flops_per_step"]["formula"] in (
            0, run["flops_per_step"]["recomputed_by_flash_backward"])
        assert len(run["eager"]["per_step"]) == len(run["compiled"]["per_step"]) == entry["steps"]
        _check_consistent(run, tool.CHAPTER7_BATCH, 64, rel=2e-5)  # stored to 6 significant digits
        assert math.isclose(run["matmul_peak_gflops"], max(run["matmul_peak_gflops_before_after"]), rel_tol=1e-5)
    assert entry["graph_breaks"]["forward_and_loss"]["breaks"] == 0
