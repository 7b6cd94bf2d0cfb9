"""tools/ch14_results.py (chapter 14's induction-head runs) and the entries it stored in chapter14.json."""

import copy
import json
import math
import shlex
import statistics
import sys
from importlib import resources
from pathlib import Path

import pytest
import torch

from groundup import interpretability as interp
from groundup import training
from groundup.induction import in_context_loss, repeated_random_tokens
from groundup.models import GPT, GPTConfig

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import ch14_results  # noqa: E402

STORED = json.loads(resources.files("groundup").joinpath("results/chapter14.json").read_text())
RUNS = STORED["runs"]


def window_by_rule(steps, losses, max_steps):
    """The docstring's phase-change rule, written out again."""
    window = [v for s, v in zip(steps, losses) if 0.05 * max_steps <= s <= 0.10 * max_steps]
    final = losses[-1]
    if not window:
        return {"plateau": None, "final": final, "half_step": None, "start_step": None, "end_step": None,
                "width": None}
    plateau = statistics.median(window)
    later = [(s, v) for s, v in zip(steps, losses) if s > 0.10 * max_steps]
    half = min((s for s, v in later if v < plateau / 2), default=None)
    start = None if half is None else max(
        (s for s, v in zip(steps, losses) if s < half and v >= final + 0.9 * (plateau - final)), default=None)
    end = min((s for s, v in later if v <= final + 0.1 * (plateau - final)), default=None)
    return {"plateau": plateau, "final": final, "half_step": half, "start_step": start, "end_step": end,
            "width": None if start is None or end is None else end - start}


def test_phase_change_on_a_made_up_curve():
    steps = list(range(0, 201, 5))
    losses = [4.0, 3.6, 3.0, 3.2, 3.1, 3.0, 2.9, 3.0, 2.5, 1.5, 1.0, 0.6, 0.3, 0.2, 0.15, 0.12] + [0.1] * 25
    # plateau: median of steps 10 .. 20 (3.0, 3.2, 3.1) = 3.1; drop 3.0; 90 % level 2.8, 10 % level 0.4;
    # below half the plateau (1.55) first at 45; the last step before it still at >= 2.8 is 35 (3.0)
    found = ch14_results.phase_change(steps, losses, 200)
    assert found == pytest.approx({"plateau": 3.1, "final": 0.1, "half_step": 45, "start_step": 35,
                                   "end_step": 60, "width": 25})
    assert found == window_by_rule(steps, losses, 200)
    # a dip of the plateau's noise below the 90 % level and a rebound above it: the start is the rebound
    bumpy = losses[:5] + [2.7, 2.9, 2.5] + losses[8:]
    found = ch14_results.phase_change(steps, bumpy, 200)
    assert (found["half_step"], found["start_step"], found["end_step"]) == (45, 30, 60)
    assert found == window_by_rule(steps, bumpy, 200)
    assert ch14_results.phase_change([0, 5, 50, 100], [4.0, 3.0, 2.9, 3.5], 100)["start_step"] is None  # no drop
    assert ch14_results.phase_change([0, 100], [4.0, 1.0], 100)["plateau"] is None  # nothing in the window


def test_run_seed_on_a_tiny_model_records_what_the_model_computes():
    shape = dict(vocab_size=16, context_length=12, d_model=16)
    entry, model = ch14_results.run_seed(5, model=shape, training=dict(max_steps=40, batch_size=8, eval_batches=1),
                                         record_every=5)
    assert entry["seed"] == 5 and entry["model"] == {**ch14_results.MODEL, **shape}
    assert entry["training"]["max_steps"] == 40 and entry["training"]["seed"] == 5
    assert entry["curve"]["step"] == list(range(0, 41, 5)) and len(entry["curve"]["in_context_loss"]) == 9
    assert entry["train_eval"]["step"] == list(range(5, 41, 5))
    # the last recorded loss is the returned model's, on the held-out batch built here from its description
    tokens = repeated_random_tokens(256, 6, 16, torch.Generator().manual_seed(entry["held_out"]["seed"]))
    assert entry["held_out"] == {"n_seq": 256, "half_len": 6, "seed": ch14_results.HELD_OUT_SEED}
    final = in_context_loss(model, tokens)
    assert entry["curve"]["in_context_loss"][-1] == pytest.approx(final, abs=1e-5)
    assert entry["ablation"]["none"] == pytest.approx(final, abs=1e-5)
    assert entry["phase_change"] == window_by_rule(entry["curve"]["step"], entry["curve"]["in_context_loss"], 40)
    # zero-ablating head (1, 2) is the model with that head's columns of W_o set to zero
    cut = copy.deepcopy(model)
    with torch.no_grad():
        cut.blocks[1].attention.W_o.weight[:, 2 * 4:3 * 4] = 0.0
    assert entry["ablation"]["zero"][1][2] == pytest.approx(in_context_loss(cut, tokens), abs=1e-5)
    for name in ("previous_token", "induction", "copying"):
        assert torch.tensor(entry["scores"][name]).shape == (2, 4)
    for name in ("k_composition", "k_composition_at_init"):
        assert torch.tensor(entry[name]).shape == (4, 4)
    json.dumps(entry)  # plain data


# ---------------------------------------------------------------------------------------------------------------
# the heads forming: head_scores every RECORD_EVERY steps

TINY = dict(model=dict(vocab_size=16, context_length=12, d_model=16),
            training=dict(max_steps=22, batch_size=8, eval_batches=1), record_every=5)


def _by_hand(model, tokens):
    """Previous-token and induction scores ([layer][head]) and the layer-0 -> layer-1 K-composition, from the
    attention weights and the weights themselves, unrounded."""
    patterns = interp.attention_patterns(model, tokens)
    half = tokens.shape[1] // 2
    prev = [[float(p[:, h, 1:, :-1].diagonal(dim1=-2, dim2=-1).mean()) for h in range(p.shape[1])] for p in patterns]
    ind = [[float(torch.stack([p[:, h, i, i - half + 1] for i in range(half, 2 * half)]).mean())
            for h in range(p.shape[1])] for p in patterns]
    att0, att1 = model.blocks[0].attention, model.blocks[1].attention
    d, d_head = model.config.d_model, model.config.d_model // model.config.n_heads
    rows = [slice(h * d_head, (h + 1) * d_head) for h in range(model.config.n_heads)]
    with torch.no_grad():  # each block's LayerNorm reads x through diag(gamma) (I - 11^T / d), folded in
        n0, n1 = (torch.diag(model.blocks[i].norm_1.weight) @ (torch.eye(d) - 1 / d) for i in (0, 1))
        ov = [att0.W_o.weight[:, r] @ att0.W_v.weight[r] @ n0 for r in rows]
        qk = [(att1.W_q.weight[r] @ n1).T @ att1.W_k.weight[r] @ n1 for r in rows]
        comp = [[float((b @ a).norm() / (b.norm() * a.norm())) for b in qk] for a in ov]
    return {"previous_token": prev, "induction": ind, "k_composition": comp}


def _close(found, expected, abs=2e-5):
    for name in ("previous_token", "induction", "k_composition"):
        for row, want in zip(found[name], expected[name], strict=True):
            assert row == pytest.approx(want, abs=abs), name


def _tiny_run(record_heads):
    """The tiny run: (entry, model, history, copies of the model at each of train's callbacks)."""
    histories, snapshots = [], []

    def train(model, train_data, val_data, config, *, callback, batches):
        def snapshot(step, m):
            snapshots.append((step, copy.deepcopy(m).train()))
            callback(step, m)

        histories.append(training.train(model, train_data, val_data, config, callback=snapshot, batches=batches))
        return histories[-1]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ch14_results, "train", train)
        entry, model = ch14_results.run_seed(7, **TINY, record_heads=record_heads)
    return entry, model, histories[0], snapshots


@pytest.fixture(scope="module")
def tiny_runs():
    """The tiny run with and without recording the heads."""
    return {record_heads: _tiny_run(record_heads) for record_heads in (True, False)}


def test_recording_the_heads_leaves_the_training_alone(tiny_runs):
    (entry, model, history, _), (plain, plain_model, plain_history, _) = tiny_runs[True], tiny_runs[False]
    assert "head_scores" not in plain and entry["head_scores_every"] == 5
    assert history.train_loss == plain_history.train_loss and len(history.train_loss) == 22
    assert history.grad_norm == plain_history.grad_norm and history.val_loss == plain_history.val_loss
    for (name, p), q in zip(model.state_dict().items(), plain_model.state_dict().values(), strict=True):
        assert torch.equal(p, q), name
    drop = ("wall_seconds", "head_scores", "head_scores_every")
    assert {k: v for k, v in entry.items() if k not in drop} == {k: v for k, v in plain.items() if k not in drop}


def test_head_scores_are_recorded_on_the_curves_schedule(tiny_runs):
    entry, model, _, snapshots = tiny_runs[True]
    heads = entry["head_scores"]
    # every 5 steps from the initialisation, and the last step of a run that is not a multiple of 5
    assert heads["step"] == entry["curve"]["step"] == [0, 5, 10, 15, 20, 22]
    assert [s for s, _ in snapshots] == [5, 10, 15, 20, 22]  # train's callback: every evaluation and the end
    for name, shape in (("previous_token", (2, 4)), ("induction", (2, 4)), ("k_composition", (4, 4))):
        assert torch.tensor(heads[name]).shape == (6, *shape)
    # the last step's are the entry's final scores, the first the initialisation's composition
    assert heads["previous_token"][-1] == entry["scores"]["previous_token"]
    assert heads["induction"][-1] == entry["scores"]["induction"]
    assert heads["k_composition"][-1] == entry["k_composition"]
    assert heads["k_composition"][0] == entry["k_composition_at_init"]
    # each step's are those of the model at that step, computed again by hand
    tokens = ch14_results.held_out(16, 12)
    for i, (step, snapshot) in enumerate(snapshots, start=1):
        assert heads["step"][i] == step
        _close({k: heads[k][i] for k in ("previous_token", "induction", "k_composition")}, _by_hand(snapshot, tokens))
    torch.manual_seed(7)
    fresh = GPT(ch14_results.AttentionOnlyConfig(**{**ch14_results.MODEL, **TINY["model"]}))
    _close({k: heads[k][0] for k in ("previous_token", "induction", "k_composition")}, _by_hand(fresh, tokens))
    assert heads["induction"][0] != heads["induction"][-1]  # the scores did move


def test_head_scores_draw_no_random_numbers_and_restore_the_mode():
    torch.manual_seed(3)
    model = GPT(ch14_results.AttentionOnlyConfig(**{**ch14_results.MODEL, **TINY["model"]}))
    tokens = ch14_results.held_out(16, 12)
    state = torch.get_rng_state()
    for mode in (True, False):
        model.train(mode)
        found = ch14_results.head_scores(model, tokens)
        assert model.training is mode
    assert torch.equal(torch.get_rng_state(), state)
    _close(found, _by_hand(model, tokens))


def test_the_stored_runs_are_the_three_seeds():
    assert sorted(RUNS) == ["seed0", "seed1", "seed2"]


@pytest.mark.parametrize("key", sorted(RUNS))
def test_stored_entry_is_complete_and_consistent(key):
    entry = RUNS[key]
    words = shlex.split(entry["command"])
    assert words[:3] == ["OMP_NUM_THREADS=1", "python", "tools/ch14_results.py"]
    seed = int(words[words.index("--seed") + 1])
    assert key == f"seed{seed}" and entry["seed"] == seed and entry["threads"] == 1
    assert entry["model"] == ch14_results.MODEL
    assert {k: entry["training"][k] for k in ch14_results.TRAINING} == ch14_results.TRAINING
    assert entry["training"]["seed"] == seed and entry["wall_seconds"] > 0
    steps, losses = entry["curve"]["step"], entry["curve"]["in_context_loss"]
    max_steps = ch14_results.TRAINING["max_steps"]
    assert steps == list(range(0, max_steps + 1, ch14_results.RECORD_EVERY)) and len(losses) == len(steps)
    assert all(math.isfinite(v) and v >= 0 for v in losses)
    assert entry["train_eval"]["step"] == steps[1:] and len(entry["train_eval"]["val_loss"]) == len(steps) - 1
    assert entry["phase_change"] == window_by_rule(steps, losses, max_steps)
    assert entry["ablation"]["none"] == losses[-1]  # the same model on the same batch
    for name in ("previous_token", "induction", "copying"):
        table = entry["scores"][name]
        assert len(table) == 2 and all(len(row) == 4 and all(0 <= x <= 1 for x in row) for row in table)
    for name in ("k_composition", "k_composition_at_init"):
        table = entry[name]
        assert len(table) == 4 and all(len(row) == 4 and all(0 <= x <= 1 for x in row) for row in table)
    assert len(entry["ablation"]["zero_layer"]) == 2
    pairs = entry["ablation"]["zero_pairs_layer0"]  # every pair of layer-0 heads zeroed together
    assert sorted(pairs) == ["0,1", "0,2", "0,3", "1,2", "1,3", "2,3"]
    assert all(math.isfinite(v) for v in pairs.values())
    assert pairs["2,3"] != pairs["0,1"]
    assert entry["ablation"]["zero_layer"][0] not in pairs.values()  # two heads are not the whole layer
    for mode in ("zero", "mean"):
        table = entry["ablation"][mode]
        assert len(table) == 2 and all(len(row) == 4 and all(math.isfinite(x) for x in row) for row in table)


@pytest.mark.parametrize("key", sorted(RUNS))
def test_stored_head_scores_follow_the_curve_from_the_initialisation_to_the_final_scores(key):
    entry = RUNS[key]
    heads = entry["head_scores"]
    assert entry["head_scores_every"] == ch14_results.RECORD_EVERY
    assert heads["step"] == entry["curve"]["step"]
    for name, rows, cols in (("previous_token", 2, 4), ("induction", 2, 4), ("k_composition", 4, 4)):
        assert len(heads[name]) == len(heads["step"])
        assert all(len(t) == rows and all(len(r) == cols and all(0 <= x <= 1 for x in r) for r in t)
                   for t in heads[name])
    assert heads["previous_token"][-1] == entry["scores"]["previous_token"]
    assert heads["induction"][-1] == entry["scores"]["induction"]
    assert heads["k_composition"][-1] == entry["k_composition"]
    assert heads["k_composition"][0] == entry["k_composition_at_init"]
    # step 0: the freshly initialised model of that seed, on the held-out batch
    torch.manual_seed(entry["seed"])
    fresh = GPT(ch14_results.AttentionOnlyConfig(**entry["model"]))
    tokens = ch14_results.held_out(entry["model"]["vocab_size"], entry["model"]["context_length"])
    _close({k: heads[k][0] for k in ("previous_token", "induction", "k_composition")}, _by_hand(fresh, tokens))
    # the heads form: an induction head in layer 1 and a previous-token head in layer 0, neither at the start
    assert max(heads["induction"][0][1]) < 0.2 < 0.8 < max(heads["induction"][-1][1])
    assert max(heads["previous_token"][0][0]) < 0.2 < 0.8 < max(heads["previous_token"][-1][0])


# ---------------------------------------------------------------------------------------------------------------
# the SmolLM2 and chapter 7 measurements (--entry)

MEASURED = STORED["measurements"]


def _small_gpt(seed=0, vocab=23):
    torch.manual_seed(seed)
    model = GPT(GPTConfig(vocab_size=vocab, context_length=16, d_model=24, n_layers=2, n_heads=4, norm="rmsnorm"))
    with torch.no_grad():
        for p in model.parameters():  # non-trivial norm gains, so that folding them in is tested
            if p.dim() == 1:
                p.uniform_(0.5, 1.5)
    return model.eval()


def test_copying_ranks_count_the_tokens_above_the_diagonal_of_the_full_ov_matrix():
    model = _small_gpt()
    u, w_e = model.unembedding.weight.detach(), model.token_embedding.weight.detach()
    gamma_f = model.final_norm.weight.detach()
    for layer in range(2):
        att, gamma = model.blocks[layer].attention, model.blocks[layer].norm_1.weight.detach()
        expected = []
        for h in range(4):
            rows = slice(6 * h, 6 * h + 6)
            m = (u * gamma_f) @ att.W_o.weight.detach()[:, rows] @ att.W_v.weight.detach()[rows] @ (w_e * gamma).T
            # rank of the diagonal entry in its column, from a descending sort: its position
            order = m.argsort(dim=0, descending=True)
            expected.append([int((order[:, t] == t).nonzero()) for t in range(23)])
        expected = torch.tensor(expected)
        assert torch.equal(interp.copying_ranks(model, layer), expected)
        assert torch.equal(interp.copying_ranks(model, layer, chunk=5), expected)
        assert torch.equal(interp.copying_ranks(model, layer, tokens=[3, 0, 22]), expected[:, [3, 0, 22]])
        torch.testing.assert_close(interp.copying_scores(model, layer), (expected == 0).float().mean(dim=1))
        table = ch14_results.copying_table(model, torch.arange(23), layers=[layer])
        assert table["hits"] == [(expected == 0).sum(dim=1).tolist()]
        assert table["copying"] == [pytest.approx((expected == 0).float().mean(dim=1).tolist(), abs=1e-5)]
        assert table["top10"] == [pytest.approx((expected < 10).float().mean(dim=1).tolist(), abs=1e-5)]
        assert table["median_rank"] == [[sorted(row)[11] for row in expected.tolist()]]  # 23 values: the middle one
        assert table["eigenvalue"] == [pytest.approx(interp.ov_eigenvalue_scores(model, layer).tolist(), abs=1e-5)]
    with pytest.raises(ValueError, match="chunk"):
        interp.copying_ranks(model, 0, chunk=0)


def test_lens_windows_are_evenly_spaced_or_consecutive():
    ids = torch.arange(100)
    assert ch14_results.lens_windows(ids, 4, 10).tolist() == [list(range(s, s + 10)) for s in (0, 25, 50, 75)]
    assert ch14_results.lens_windows(ids, None, 30).tolist() == [list(range(s, s + 30)) for s in (0, 30, 60)]
    with pytest.raises(ValueError, match="do not fit"):
        ch14_results.lens_windows(ids, 4, 26)


def test_lens_statistics_match_the_logit_lens_position_by_position():
    model = _small_gpt(1)
    windows = torch.randint(0, 23, (5, 17), generator=torch.Generator().manual_seed(3))
    found = ch14_results.lens_statistics(model, windows, batch=2, per_window=True)
    assert found == ch14_results.lens_statistics(model, windows, batch=5, per_window=True)  # batching: no change
    assert ch14_results.lens_statistics(model, windows) == {k: v for k, v in found.items() if k != "window_hits"}
    lens = interp.logit_lens(model, windows[:, :-1])  # (3, 5, 16, 23)
    target = windows[:, 1:]
    probs = lens.softmax(dim=-1)
    right = lens.argmax(dim=-1) == target
    assert found["window_hits"] == right.sum(dim=2).tolist() and found["hits"] == right.sum(dim=(1, 2)).tolist()
    assert found["positions"] == 80
    for layer in range(3):
        p = probs[layer].gather(-1, target[..., None])[..., 0]
        assert found["top1"][layer] == pytest.approx(float(right[layer].float().mean()), abs=1e-5)
        assert found["prob"][layer] == pytest.approx(float(p.mean()), abs=1e-5)
        assert found["nll"][layer] == pytest.approx(float(-p.log().mean()), abs=1e-4)
        ranks = sorted(int((probs[layer, b, i] > probs[layer, b, i, target[b, i]]).sum())
                       for b in range(5) for i in range(16))
        assert found["median_rank"][layer] == ranks[39]  # torch's median of 80 values: the lower middle one
    # the first entry from which the lens stays right, by a plain loop over the positions the model gets right
    firsts = [next(layer for layer in range(3) if right[layer:, b, i].all())
              for b in range(5) for i in range(16) if right[-1, b, i]]
    assert found["solved"] == pytest.approx(float(right[-1].float().mean()), abs=1e-5)
    assert found["first_stays"] == pytest.approx(statistics.mean(firsts), abs=1e-5)


def _command(entry, name):
    words = shlex.split(entry["command"])
    assert words == ["OMP_NUM_THREADS=1", "MKL_CBWR=COMPATIBLE", "ATEN_CPU_CAPABILITY=default", "python",
                     "tools/ch14_results.py", "--entry", name]
    assert entry["threads"] == 1 and entry["mkl_cbwr"] == "COMPATIBLE" and entry["wall_seconds"] > 0


def test_the_stored_measurements_are_the_seven_entries():
    assert sorted(MEASURED) == sorted(ch14_results.ENTRIES + ch14_results.NEW_ENTRIES)


def test_stored_smollm2_copying_is_complete_and_consistent():
    entry = MEASURED["smollm2-copying"]
    _command(entry, "smollm2-copying")
    n = ch14_results.COPY_TOKENS
    assert entry["tokens"] == {"n": n, "seed": ch14_results.COPY_SEED, "draw": "torch.randperm(vocab_size)[:n]"}
    for name in ("copying", "hits", "top10", "median_rank", "eigenvalue"):
        assert len(entry[name]) == 30 and all(len(row) == 9 for row in entry[name])
    for hits, copying, top10, rank, eig in zip(*(entry[k] for k in ("hits", "copying", "top10", "median_rank",
                                                                     "eigenvalue"))):
        assert copying == pytest.approx([h / n for h in hits], abs=1e-5)
        assert all(c <= t <= 1 for c, t in zip(copying, top10))  # rank 0 is among the top 10
        assert all(0 <= r < 49152 for r in rank) and all(-1 <= e <= 1 for e in eig)
        assert all((r < 10) <= (t >= 0.5) for r, t in zip(rank, top10))  # median rank < 10: half are in the top 10


def _lens_is_consistent(entry, n_entries):
    assert entry["positions"] == entry["n_windows"] * (entry["window_tokens"] - 1)
    for name in ("top1", "prob", "nll", "median_rank", "hits"):
        assert len(entry[name]) == n_entries
    for hits, top1, prob, nll in zip(entry["hits"], entry["top1"], entry["prob"], entry["nll"]):
        assert top1 == pytest.approx(hits / entry["positions"], abs=1e-5)
        assert 0 <= top1 <= 1 and 0 < prob <= 1
        assert nll >= -math.log(prob) - 1e-4  # Jensen: the mean of -ln p is at least -ln of the mean p
    assert entry["solved"] == entry["top1"][-1]  # the last entry is the model's own prediction
    assert 0 <= entry["first_stays"] <= n_entries - 1


def test_stored_lenses_are_complete_and_consistent():
    smol = MEASURED["smollm2-lens"]
    _command(smol, "smollm2-lens")
    assert (smol["n_windows"], smol["window_tokens"]) == (ch14_results.LENS_WINDOWS, ch14_results.LENS_WINDOW_TOKENS)
    _lens_is_consistent(smol, 31)
    assert [sum(row) for row in smol["window_hits"]] == smol["hits"]
    assert all(len(row) == smol["n_windows"] and all(0 <= h < smol["window_tokens"] for h in row)
               for row in smol["window_hits"])
    assert smol["median_rank"][-1] < smol["median_rank"][1] < smol["median_rank"][0]  # the lens sharpens
    ch7 = MEASURED["chapter7-lens"]
    _command(ch7, "chapter7-lens")
    assert "window_hits" not in ch7  # 7,780 windows: only the totals are stored
    assert ch7["window_tokens"] == 65 and ch7["n_windows"] == len(ch14_results.validation_text()) // 65
    _lens_is_consistent(ch7, 5)


@pytest.fixture(scope="module")
def smollm2():
    from groundup.pretrained import load_smollm2

    torch.set_num_threads(1)
    model, tok = load_smollm2()
    return model.eval(), tok


def test_smollm2_lens_first_window_recomputed(smollm2):
    model, tok = smollm2
    entry = MEASURED["smollm2-lens"]
    windows = ch14_results.lens_windows(torch.tensor(tok.encode(ch14_results.validation_text())),
                                        entry["n_windows"], entry["window_tokens"])
    found = ch14_results.lens_statistics(model, windows[:1])
    stored = [row[0] for row in entry["window_hits"]]
    # another arithmetic may flip a near tie: allow one position per entry
    assert all(abs(a - b) <= 1 for a, b in zip(found["hits"], stored)), (found["hits"], stored)


def test_smollm2_copying_of_one_layer_recomputed(smollm2):
    model, _ = smollm2
    entry = MEASURED["smollm2-copying"]
    tokens = ch14_results.copying_sample(model.config.vocab_size)
    found = ch14_results.copying_table(model, tokens, layers=[18])
    assert all(abs(a - b) <= 1 for a, b in zip(found["hits"][0], entry["hits"][18]))
    assert found["eigenvalue"][0] == pytest.approx(entry["eigenvalue"][18], abs=1e-4)


# ---------------------------------------------------------------------------------------------------------------
# issue 39, items 3 and 4: SmolLM2's circuit tested (the tools, on tiny random models; then the stored entries)

NEW = ch14_results.NEW_ENTRIES


def _tiny_gpt(seed=0, **over):
    """A small random model shaped like SmolLM2: RoPE, RMSNorm, SwiGLU, grouped-query attention, tied, no biases."""
    torch.manual_seed(seed)
    config = dict(vocab_size=40, context_length=16, d_model=32, n_layers=4, n_heads=8, n_kv_heads=2,
                  positional="rope", norm="rmsnorm", activation="swiglu", bias=False, tie_weights=True)
    return GPT(GPTConfig(**{**config, **over})).eval()


@pytest.fixture(scope="module")
def tiny_gpt():
    model = _tiny_gpt()
    tokens = repeated_random_tokens(6, 6, 40, torch.Generator().manual_seed(1))
    return model, tokens, ch14_results.clean_run(model, tokens)


def test_sequence_losses_and_scores_average_to_the_packages(tiny_gpt):
    model, tokens, run = tiny_gpt
    losses = ch14_results.sequence_losses(model, run["stream"][-1], tokens)
    assert losses.shape == (6,)
    assert float(losses.mean()) == pytest.approx(in_context_loss(model, tokens), abs=1e-6)
    for k in range(6):  # each sequence's loss is in_context_loss on that sequence alone
        assert float(losses[k]) == pytest.approx(in_context_loss(model, tokens[k:k + 1]), abs=1e-5)
    for pattern in run["patterns"]:
        per = ch14_results.sequence_induction_scores(pattern)
        assert per.shape == (6, 8)
        torch.testing.assert_close(per.mean(0), interp.induction_scores(pattern))
        torch.testing.assert_close(per[2], interp.induction_scores(pattern[2:3]))
        torch.testing.assert_close(ch14_results.sequence_induction_scores(pattern[:, 3]), per[:, 3])


def test_head_direct_shares_are_the_package_attribution_on_the_repeat(tiny_gpt):
    model, tokens, run = tiny_gpt
    parts = interp.direct_logit_attribution(model, tokens, torch.cat([tokens[:, 1:], tokens[:, :1]], dim=1),
                                            centred=True)
    for layer in range(4):
        shares = ch14_results.head_direct_shares(model, run["stream"][-1], tokens, layer, run["outputs"][layer])
        torch.testing.assert_close(shares, parts["heads"][layer][..., 6:11].mean(-1).T, atol=1e-5, rtol=1e-5)
        one = ch14_results.head_direct_shares(model, run["stream"][-1], tokens, (layer, 5),
                                              run["outputs"][layer][..., 5, :])
        torch.testing.assert_close(one, shares[:, 5])


def test_attention_profile_reads_the_four_places():
    half = 4
    pattern = torch.zeros(2, 8, 8)
    for i in range(8):
        pattern[0, i, max(i - half + 1, 0)] = 1.0  # an induction head (on the repeat)
        pattern[1, i, i] = 0.5
        pattern[1, i, 0] += 0.5
    found = ch14_results.attention_profile(pattern)
    assert found["next_of_earlier"].tolist() == [1.0, 0.0] and found["earlier_copy"].tolist() == [0.0, 0.0]
    assert found["self"].tolist() == [0.0, 0.5] and found["first"].tolist() == [0.0, 0.5]
    random = torch.softmax(torch.randn(3, 8, 8).masked_fill(~torch.ones(8, 8).tril().bool(), float("-inf")), -1)
    found = ch14_results.attention_profile(random)
    rows = range(half + 1, 2 * half)
    assert found["earlier_copy"] == pytest.approx(torch.stack([random[:, i, i - half] for i in rows]).mean(0))
    assert float(found["next_of_earlier"].mean()) == pytest.approx(
        float(interp.induction_scores(random[:, None, :, :])) * 4 / 3 - float(random[:, half, 1].mean()) / 3)


def test_draw_controls_gives_different_sets_from_the_pools():
    pools = {3: [0, 1, 4, 5], 7: [2, 6]}
    sets = ch14_results._draw_controls(pools, {3: 2, 7: 1}, 5, seed=0)
    assert len(sets) == 5 and len({frozenset(s) for s in sets}) == 5
    for chosen in sets:
        assert [layer for layer, _ in chosen] == [3, 3, 7] and all(h in pools[layer] for layer, h in chosen)
    assert len(ch14_results._draw_controls(pools, {3: 2, 7: 1}, 50, seed=0)) == 12  # C(4, 2) * 2
    assert sets == ch14_results._draw_controls(pools, {3: 2, 7: 1}, 5, seed=0)
    with pytest.raises(ValueError, match="layer 7"):
        ch14_results._draw_controls(pools, {7: 3}, 1, seed=0)


def test_summary_is_the_mean_sd_and_a_bootstrap_interval():
    values = [1.0, 2.0, 4.0, 7.0]
    found = ch14_results.summary(values)
    assert found["n"] == 4 and found["mean"] == 3.5 and found["sd"] == pytest.approx(statistics.stdev(values), abs=1e-5)
    assert 1.0 <= found["ci95"][0] < 3.5 < found["ci95"][1] <= 7.0
    assert ch14_results.summary([2.0] * 5)["ci95"] == [2.0, 2.0]


def test_induction_entry_on_a_tiny_model_stores_what_the_model_computes():
    model = _tiny_gpt(seed=2, n_layers=3, vocab_size=50)
    tokens = repeated_random_tokens(8, 6, 50, torch.Generator().manual_seed(11))
    run = ch14_results.clean_run(model, tokens)
    ind = torch.stack([ch14_results.sequence_induction_scores(p) for p in run["patterns"]]).mean(1)
    cut = sorted(ind.flatten().tolist(), reverse=True)[1]  # the two best heads are "induction heads"
    entry = ch14_results.induction_entry(model, n_seq=8, half_len=6, seed=11, mean_seed=12, baseline_seed=13,
                                         pair=((2, 1), (2, 6)), n_controls=4, pair_controls=3, cut=cut,
                                         control_max=1.0, log=lambda m: None)
    json.dumps(entry)
    assert len(entry["induction_heads"]) == 2 and entry["tokens"]["n_seq"] == 8
    assert torch.tensor(entry["induction_mean"]) == pytest.approx(ind, abs=1e-5)
    cond = entry["ablation"]["conditions"]
    assert cond["none"]["loss"]["mean"] == pytest.approx(in_context_loss(model, tokens), abs=1e-4)
    top5 = [tuple(map(int, h.split("."))) for h in entry["top5_induction"]]
    with interp.ablate_heads(model, top5):
        assert cond["top5_zero"]["loss"]["mean"] == pytest.approx(in_context_loss(model, tokens), abs=1e-4)
    reference = repeated_random_tokens(8, 6, 50, torch.Generator().manual_seed(12))
    with interp.ablate_heads(model, top5, mode="mean", means=interp.mean_head_outputs(model, reference,
                                                                                      per_position=True)):
        assert cond["top5_mean"]["loss"]["mean"] == pytest.approx(in_context_loss(model, tokens), abs=1e-4)
    with interp.ablate_heads(model, [(2, 1), (2, 6)]):
        assert cond["pair_zero"]["per_seq"] == pytest.approx(
            [in_context_loss(model, tokens[k:k + 1]) for k in range(8)], abs=1e-3)
    controls = [k for k in cond if k.startswith("control")]
    assert len(controls) == 4 and all(len(cond[k]["heads"]) == 5 for k in controls)
    for k in controls:  # the controls come from the top-5's layers, never an induction head or a top-5 head
        assert sorted(h.split(".")[0] for h in cond[k]["heads"]) == sorted(h.split(".")[0] for h in
                                                                           entry["top5_induction"])
        assert not set(cond[k]["heads"]) & set(entry["top5_induction"] + entry["induction_heads"])
        assert cond[k]["minus_none"]["mean"] == pytest.approx(cond[k]["loss"]["mean"] - cond["none"]["loss"]["mean"],
                                                              abs=1e-4)
    assert len([k for k in cond if k.startswith("pair_control")]) == 3
    plain = torch.randint(0, 50, (8, 12), generator=torch.Generator().manual_seed(13))
    with torch.no_grad():
        logits, _ = model(plain)
    want = torch.nn.functional.cross_entropy(logits[:, 6:11].reshape(-1, 50), plain[:, 7:12].reshape(-1))
    assert entry["baseline"]["loss"]["mean"] == pytest.approx(float(want), abs=1e-4)
    assert entry["baseline"]["ln_vocab"] == pytest.approx(math.log(50), abs=1e-5)
    for row in entry["heads"]:
        layer, head = map(int, row["head"].split("."))
        assert statistics.mean(row["induction_per_seq"]) == pytest.approx(float(ind[layer, head]), abs=1e-3)
        assert row["dla"]["mean"] == pytest.approx(entry["dla_mean"][layer][head], abs=1e-4)
    shares = torch.tensor(entry["dla_mean"])
    assert entry["dla_heads"]["mean"] == pytest.approx(float(shares.sum()), abs=1e-3)
    listed = {row["head"] for row in entry["heads"]}
    assert set(entry["large_share_heads"]) <= listed and set(entry["induction_heads"]) <= listed
    assert all(abs(shares[tuple(map(int, h.split(".")))]) >= ch14_results.LARGE_SHARE
               for h in entry["large_share_heads"])


def test_two_tier_entry_on_a_tiny_model_stores_what_the_removal_computes():
    model = _tiny_gpt(seed=5, n_layers=4, vocab_size=50)
    tokens = repeated_random_tokens(6, 6, 50, torch.Generator().manual_seed(21))
    run = ch14_results.clean_run(model, tokens)
    ind = torch.stack([ch14_results.sequence_induction_scores(p) for p in run["patterns"]]).mean(1)
    cut = sorted(ind[:2].flatten().tolist(), reverse=True)[2]  # three sources in layers 0 and 1
    entry = ch14_results.two_tier_entry(model, n_seq=6, half_len=6, seed=21, source_layers=(0, 1),
                                        targets=((2, 3), (3, 1)), second_tier=((2, 3), (2, 4)), copier=(3, 1),
                                        n_controls=2, cut=cut, control_max=1.0, log=lambda m: None)
    json.dumps(entry)
    sources = [tuple(map(int, h.split("."))) for h in entry["sources"]]
    assert len(sources) == 3 and all(layer in (0, 1) for layer, _ in sources)
    assert set(entry["targets"]) == {"2.3", "3.1"}
    assert set(entry["targets"]["3.1"]["removals"]) > set(entry["targets"]["2.3"]["removals"])  # the second tier
    for target, found in entry["targets"].items():
        layer, head = map(int, target.split("."))
        assert found["baseline"]["loss"]["mean"] == pytest.approx(in_context_loss(model, tokens), abs=1e-4)
        assert found["baseline"]["induction"]["mean"] == pytest.approx(float(ind[layer, head]), abs=1e-4)
        for key, removal in found["removals"].items():
            set_name, path = key.split("/")
            heads = [tuple(map(int, h.split("."))) for h in removal["sources"]]
            assert heads == ([tuple(h) for h in sources] if set_name == "induction" else
                             [tuple(map(int, h.split("."))) for h in entry["control_sets"][set_name]])
            if set_name.startswith("control"):
                assert not set(heads) & set(sources) and sorted(h[0] for h in heads) == sorted(h[0] for h in sources)
            with interp.remove_from_inputs(model, heads, layer, path, head=head) as seen:  # a whole forward pass
                loss = in_context_loss(model, tokens)
            assert removal["loss"]["mean"] == pytest.approx(loss, abs=1e-4)
            assert removal["induction_per_seq"] == pytest.approx(
                ch14_results.sequence_induction_scores(seen["pattern"]).tolist(), abs=1e-4)
            assert removal["loss_minus_baseline"]["mean"] == pytest.approx(loss - found["baseline"]["loss"]["mean"],
                                                                           abs=1e-4)
        for attention in [found["baseline"]["attention"]] + [r["attention"] for r in found["removals"].values()]:
            assert sorted(attention) == ["earlier_copy", "first", "next_of_earlier", "self"]
            assert sum(a["mean"] for a in attention.values()) <= 1 + 1e-4
    v = entry["targets"]["2.3"]["removals"]["induction/v"]
    assert v["induction"]["mean"] == pytest.approx(entry["targets"]["2.3"]["baseline"]["induction"]["mean"],
                                                   abs=1e-4)  # the values do not move the attention


class _WordTokenizer:
    """Words (with their leading space) as tokens, for the name-swap prompts on a tiny model."""

    split = r" ?[^ ,]+|,"

    def __init__(self, text):
        import re

        self.words = sorted(set(re.findall(self.split, text)))

    def encode(self, text):
        import re

        return [self.words.index(w) for w in re.findall(self.split, text)]

    def decode(self, ids):
        return "".join(self.words[i] for i in ids)


def test_bootstrap_interval_of_the_fraction_restored():
    ld = torch.tensor([[1.0, 2.0, 3.0, 2.5], [0.0, 0.0, 0.0, 0.0]])
    src, tgt = torch.tensor([4.0, 4.0, 4.0, 4.0]), torch.tensor([0.0, 0.0, 0.0, 0.0])
    frac = ch14_results.fraction_restored(ld, src, tgt)
    assert frac.tolist() == [0.53125, 0.0]
    ci = ch14_results._bootstrap_restored(ld, src, tgt)
    assert ci.shape == (2, 2) and ci[0, 0] < 0.53125 < ci[0, 1] and ci[1].tolist() == [0.0, 0.0]


def test_name_pairs_and_prompts():
    pairs = ch14_results.name_pairs()
    assert len(pairs) == ch14_results.IOI_PAIRS >= 50 and pairs[0] == ("Mary", "John")
    assert len(set(pairs)) == len(pairs) and all(a != b and {a, b} <= set(ch14_results.NAMES) for a, b in pairs)
    assert pairs == ch14_results.name_pairs()
    tok = _WordTokenizer("When Mary and John went to the store, gave a drink to Tom Anna , John Mary Tom Anna")
    clean, corrupted, answer, wrong = ch14_results.name_swap_prompts(tok, [("Mary", "John"), ("Tom", "Anna")],
                                                                     ch14_results.TEMPLATES["ABBA"])
    assert tok.decode(clean[0].tolist()) == "When Mary and John went to the store, John gave a drink to"
    assert tok.decode(corrupted[0].tolist()) == "When Mary and John went to the store, Mary gave a drink to"
    assert tok.decode(answer.tolist()) == " Mary Tom" and tok.decode(wrong.tolist()) == " John Anna"
    clean, _, _, _ = ch14_results.name_swap_prompts(tok, [("Mary", "John")], ch14_results.TEMPLATES["BABA"])
    assert tok.decode(clean[0].tolist()) == "When John and Mary went to the store, John gave a drink to"
    with pytest.raises(ValueError, match="one token"):
        ch14_results.name_swap_prompts(tok, [("Mary", "John Tom")], ch14_results.TEMPLATES["ABBA"])


def test_name_swap_entry_on_a_tiny_model():
    words = "When Mary and John went to the store, gave a drink to Tom Anna , John Mary Tom Anna"
    tok = _WordTokenizer(words)
    model = _tiny_gpt(seed=8, vocab_size=len(tok.words))
    pairs = [("Mary", "John"), ("Tom", "Anna"), ("Anna", "Mary"), ("John", "Tom")]
    entry = ch14_results.name_swap_entry(model, tok, pairs=pairs, log=lambda m: None)
    json.dumps(entry)
    assert entry["pairs"] == [list(p) for p in pairs]
    for name, found in entry["by_template"].items():
        clean, corrupted, answer, wrong = ch14_results.name_swap_prompts(tok, pairs, ch14_results.TEMPLATES[name])
        with torch.no_grad():
            ld_clean = interp.logit_difference(model(clean)[0], answer, wrong)
            ld_corrupted = interp.logit_difference(model(corrupted)[0], answer, wrong)
        den, noi = found["denoising"], found["noising"]
        assert den["ld_source_per_pair"] == pytest.approx(ld_clean.tolist(), abs=2e-3)
        assert den["ld_target_per_pair"] == pytest.approx(ld_corrupted.tolist(), abs=2e-3)
        assert noi["ld_source_per_pair"] == den["ld_target_per_pair"]  # the roles swap
        assert noi["ld_target_per_pair"] == den["ld_source_per_pair"]
        assert den["positions"] == noi["positions"] == [9, 10, 11, 12, 13]
        frac = interp.residual_patching(model, clean, corrupted, answer, wrong)[:, 9:]
        assert torch.tensor(den["fraction"]) == pytest.approx(frac, abs=2e-3)
        frac = interp.residual_patching(model, corrupted, clean, answer, wrong)[:, 9:]
        assert torch.tensor(noi["fraction"]) == pytest.approx(frac, abs=2e-3)
        assert den["fraction"][-1] == [0.0, 0.0, 0.0, 0.0, 1.0]  # the last entry: only the last position counts
        assert found["clean_right"] == sum(x > 0 for x in ld_clean.tolist()) / 4
    pooled = entry["pooled"]["denoising"]
    assert pooled["n"] == 8 and len(pooled["fraction"]) == 5


# ---- the stored entries of NEW_ENTRIES


def _head(name):
    return tuple(map(int, name.split(".")))


def _summary_of(summary, values, abs=2e-4):
    """``summary`` (of :func:`ch14_results.summary`) describes ``values`` (rounded to 4 digits)."""
    assert summary["n"] == len(values)
    assert summary["mean"] == pytest.approx(statistics.mean(values), abs=abs)
    assert summary["sd"] == pytest.approx(statistics.stdev(values), abs=abs)
    assert summary["ci95"][0] - abs <= summary["mean"] <= summary["ci95"][1] + abs


@pytest.mark.parametrize("name", NEW)
def test_stored_new_entries_ran_under_the_notebooks_arithmetic(name):
    from results_file import NOTEBOOK_ARITHMETIC

    entry = MEASURED[name]
    assert entry["command"] == f"OMP_NUM_THREADS=1 python tools/ch14_results.py --entry {name}"
    assert entry["model"] == ch14_results.SMOLLM2 and "Q4_1" in entry["model"] and "float32" in entry["model"]
    assert entry["machine"]["threads"] == 1 and entry["machine"]["arithmetic"] == NOTEBOOK_ARITHMETIC
    assert entry["machine"]["cpu_capability"] == "DEFAULT" and entry["wall_seconds"] > 0


def test_stored_smollm2_induction_is_complete_and_consistent():
    e = MEASURED["smollm2-induction"]
    n = ch14_results.SMOL_SEQ
    assert e["tokens"]["n_seq"] == n >= 32 and e["tokens"]["seed"] == ch14_results.SMOL_SEED
    ind, dla = torch.tensor(e["induction_mean"]), torch.tensor(e["dla_mean"])
    assert ind.shape == dla.shape == (30, 9)
    assert e["induction_heads"] == [f"{la}.{h}" for la, h in ch14_results.induction_heads(ind)]
    assert e["top5_induction"] == [f"{la}.{h}" for la, h in ch14_results.induction_heads(ind, 0.0)[:5]]
    assert set(e["large_share_heads"]) == {f"{la}.{h}" for la in range(30) for h in range(9)
                                           if abs(dla[la, h]) >= ch14_results.LARGE_SHARE}
    rows = {row["head"]: row for row in e["heads"]}
    assert set(e["large_share_heads"]) | set(e["induction_heads"]) | {"23.2", "23.7"} <= set(rows)
    for name, row in rows.items():
        assert len(row["induction_per_seq"]) == len(row["dla_per_seq"]) == n
        _summary_of(row["induction"], row["induction_per_seq"])
        _summary_of(row["dla"], row["dla_per_seq"])
        assert row["induction"]["mean"] == pytest.approx(float(ind[_head(name)]), abs=2e-4)
        assert row["dla"]["mean"] == pytest.approx(float(dla[_head(name)]), abs=2e-4)
    assert e["dla_heads"]["mean"] == pytest.approx(float(dla.sum()), abs=2e-3)
    base = e["baseline"]
    _summary_of(base["loss"], base["per_seq"])
    assert base["ln_vocab"] == pytest.approx(math.log(49152), abs=1e-5)
    cond = e["ablation"]["conditions"]
    none = cond["none"]["per_seq"]
    assert base["repeated"]["mean"] == cond["none"]["loss"]["mean"]
    _summary_of(base["difference"], [a - b for a, b in zip(base["per_seq"], none)], abs=5e-4)
    assert cond["top5_zero"]["heads"] == cond["top5_mean"]["heads"] == e["top5_induction"]
    assert cond["pair_zero"]["heads"] == ["23.2", "23.7"]
    controls = [k for k in cond if k.startswith("control")]
    pairs = [k for k in cond if k.startswith("pair_control")]
    assert len(controls) == ch14_results.N_CONTROLS >= 10 and 1 <= len(pairs) <= ch14_results.N_PAIR_CONTROLS
    assert len({frozenset(cond[k]["heads"]) for k in controls}) == len(controls)
    for k in controls + pairs:
        heads = cond[k]["heads"]
        assert all(ind[_head(h)] < ch14_results.CONTROL_MAX for h in heads)
        want = e["top5_induction"] if k in controls else ["23.2", "23.7"]
        assert sorted(h.split(".")[0] for h in heads) == sorted(h.split(".")[0] for h in want)
    for c in cond.values():
        assert len(c["per_seq"]) == n
        _summary_of(c["loss"], c["per_seq"])
        _summary_of(c["minus_none"], [a - b for a, b in zip(c["per_seq"], none)], abs=5e-4)


def test_stored_smollm2_two_tier_is_complete_and_consistent():
    e, ind_entry = MEASURED["smollm2-two-tier"], MEASURED["smollm2-induction"]
    n = ch14_results.SMOL_SEQ
    assert e["tokens"] == {k: ind_entry["tokens"][k] for k in e["tokens"]}  # the same sequences
    assert e["induction_mean"] == ind_entry["induction_mean"]
    assert e["sources"] == [h for h in ind_entry["induction_heads"] if _head(h)[0] in ch14_results.SOURCE_LAYERS]
    assert e["second_tier"] == ["23.2", "23.7"] and e["copier"] == "29.1"
    ind = torch.tensor(e["induction_mean"])
    for name, heads in e["control_sets"].items():
        if "control" in name:
            assert all(ind[_head(h)] < ch14_results.CONTROL_MAX for h in heads)
            want = e["second_tier"] if name.startswith("layer23") else e["sources"]
            assert sorted(_head(h)[0] for h in heads) == sorted(_head(h)[0] for h in want)
    assert sorted(e["targets"]) == ["23.2", "23.7", "29.1"]
    none = ind_entry["ablation"]["conditions"]["none"]["per_seq"]
    rows = {row["head"]: row for row in ind_entry["heads"]}
    for target, found in e["targets"].items():
        base = found["baseline"]
        assert base["loss_per_seq"] == none
        assert base["induction_per_seq"] == rows[target]["induction_per_seq"]
        assert base["dla_per_seq"] == pytest.approx(rows[target]["dla_per_seq"], abs=1e-4)
        sets = ["induction"] + [f"control{k}" for k in range(ch14_results.N_SOURCE_CONTROLS)]
        if target == "29.1":
            sets += ["layer23"] + [k for k in e["control_sets"] if k.startswith("layer23_control")]
        assert sorted(found["removals"]) == sorted(f"{s}/{p}" for s in sets for p in ch14_results.PATHS)
        for key, removal in found["removals"].items():
            set_name, path = key.split("/")
            assert removal["path"] == path and removal["sources"] == e["control_sets"][set_name]
            for what in ("loss", "induction", "dla"):
                assert len(removal[f"{what}_per_seq"]) == n
                _summary_of(removal[what], removal[f"{what}_per_seq"])
            _summary_of(removal["loss_minus_baseline"], [a - b for a, b in zip(removal["loss_per_seq"], none)],
                        abs=5e-4)
            if path == "v":  # the values move no attention
                assert removal["induction_per_seq"] == pytest.approx(base["induction_per_seq"], abs=2e-4)
                assert {k: a["mean"] for k, a in removal["attention"].items()} == pytest.approx(
                    {k: a["mean"] for k, a in base["attention"].items()}, abs=2e-4)
            assert sum(a["mean"] for a in removal["attention"].values()) <= 1 + 1e-3


def test_stored_smollm2_name_swap_is_complete_and_consistent():
    e = MEASURED["smollm2-name-swap"]
    assert [tuple(p) for p in e["pairs"]] == ch14_results.name_pairs() and len(e["pairs"]) >= 50
    assert e["templates"] == ch14_results.TEMPLATES
    for t in e["by_template"].values():
        assert t["length"] == 14 and t["tokens_of_first_pair"][9] in (" John", " Mary")
        den, noi = t["denoising"], t["noising"]
        assert noi["ld_source_per_pair"] == den["ld_target_per_pair"]
        assert noi["ld_target_per_pair"] == den["ld_source_per_pair"]
        for d in (den, noi):
            assert d["positions"] == [9, 10, 11, 12, 13]
            ld = torch.tensor(d["ld_per_pair"])
            src, tgt = torch.tensor(d["ld_source_per_pair"]), torch.tensor(d["ld_target_per_pair"])
            assert ld.shape == (31, 5, len(e["pairs"]))
            frac = ch14_results.fraction_restored(ld, src, tgt)
            assert torch.tensor(d["fraction"]) == pytest.approx(frac, abs=2e-3)  # the per-pair LDs: 3 decimals
            assert d["fraction"][-1] == [0.0, 0.0, 0.0, 0.0, 1.0]
            assert d["patched"][0] == [True, False, False, False, False] and all(all(r) for r in d["patched"][1:])
            lo, hi = torch.tensor(d["fraction_ci95"]).unbind(-1)
            assert bool(((lo <= torch.tensor(d["fraction"]) + 1e-3) & (torch.tensor(d["fraction"]) <= hi + 1e-3)).all())
        assert t["clean_right"] == sum(x > 0 for x in den["ld_source_per_pair"]) / len(e["pairs"])
    for d in e["pooled"].values():
        assert d["n"] == 2 * len(e["pairs"]) and len(d["fraction"]) == 31


def test_smollm2_new_entries_recomputed_on_a_few_sequences(smollm2):
    model, tok = smollm2
    e = MEASURED["smollm2-induction"]
    tokens = repeated_random_tokens(e["tokens"]["n_seq"], e["tokens"]["half_len"], 49152,
                                    torch.Generator().manual_seed(e["tokens"]["seed"]))[:3]
    cond = e["ablation"]["conditions"]
    for k in range(3):  # another arithmetic moves the last digits
        assert in_context_loss(model, tokens[k:k + 1]) == pytest.approx(cond["none"]["per_seq"][k], abs=2e-3)
        with interp.ablate_heads(model, [(23, 2), (23, 7)]):
            assert in_context_loss(model, tokens[k:k + 1]) == pytest.approx(cond["pair_zero"]["per_seq"][k],
                                                                            abs=2e-3)
    swap = MEASURED["smollm2-name-swap"]["by_template"]["ABBA"]["denoising"]
    clean, corrupted, answer, wrong = ch14_results.name_swap_prompts(tok, [("Mary", "John")],
                                                                     ch14_results.TEMPLATES["ABBA"])
    with torch.no_grad():
        ld_clean = float(interp.logit_difference(model(clean, last_only=True)[0], answer, wrong)[0])
    assert ld_clean == pytest.approx(swap["ld_source_per_pair"][0], abs=5e-3)
    restored = interp.residual_patching(model, clean, corrupted, answer, wrong, layers=[21])[0, 9:]
    ld = torch.tensor(swap["ld_per_pair"])[21, :, 0]
    src, tgt = swap["ld_source_per_pair"][0], swap["ld_target_per_pair"][0]
    assert restored == pytest.approx(((ld - tgt) / (src - tgt)).tolist(), abs=5e-3)


def test_stored_smollm2_copiers_is_consistent_with_the_other_entries():
    e, ind = MEASURED["smollm2-copiers"], MEASURED["smollm2-induction"]
    assert "smollm2-copiers" in NEW  # its command and arithmetic: test_stored_new_entries_ran_under_...
    copying = torch.tensor(MEASURED["smollm2-copying"]["copying"])
    expected = [f"{la}.{h}" for la in ch14_results.SOURCE_LAYERS for h in range(9)
                if float(copying[la, h]) > ch14_results.COPY_MIN]
    assert e["copiers_1718"] == expected and len(expected) == 4
    assert e["top5_copiers"] == [f"{i // 9}.{i % 9}" for i in copying.flatten().topk(5).indices.tolist()]
    assert e["top5_induction"] == ind["top5_induction"]
    # the same sequences: the unablated losses are the induction entry's, sequence by sequence
    assert e["ablation"]["none"]["per_seq"] == ind["ablation"]["conditions"]["none"]["per_seq"]
    assert e["top5_zeroed_dla"]["total"]["intact"]["mean"] == pytest.approx(ind["dla_total"]["mean"], abs=1e-3)
    ind_mean = torch.tensor(ind["induction_mean"])
    for name in ("copiers_1718", "top5_copiers"):
        targets = e["ablation"][name]["heads"]
        controls = [v["heads"] for k, v in e["ablation"].items() if k.startswith(f"{name}_control")]
        assert len(controls) == ch14_results.N_CONTROLS and len({tuple(c) for c in controls}) == len(controls)
        for heads in controls:  # same layers, as many from each; neither copiers nor induction heads
            assert sorted(h.split(".")[0] for h in heads) == sorted(h.split(".")[0] for h in targets)
            for h in heads:
                la, hd = map(int, h.split("."))
                assert float(copying[la, hd]) <= ch14_results.COPY_MIN and float(ind_mean[la, hd]) < 0.1
    dla = e["top5_zeroed_dla"]
    assert dla["total"]["zeroed"]["mean"] < dla["total"]["intact"]["mean"] - 3  # the total effect on the logit
    assert "29.1" in dla["large_share_heads"]
