"""The induction-head runs behind chapter 14, stored in src/groundup/results/chapter14.json.

    OMP_NUM_THREADS=1 python tools/ch14_results.py              # seeds 0, 1, 2 (one to two minutes each)
    OMP_NUM_THREADS=1 python tools/ch14_results.py --entry smollm2-induction  # and -two-tier, -name-swap: see below
    OMP_NUM_THREADS=1 python tools/ch14_results.py --seed 1     # one seed
    python tools/ch14_results.py --windows                      # only re-read the windows off the stored curves
    OMP_NUM_THREADS=1 MKL_CBWR=COMPATIBLE ATEN_CPU_CAPABILITY=default \
        python tools/ch14_results.py --entry smollm2-copying    # SmolLM2's copying scores (485 s here)
    ... --entry smollm2-lens                                    # SmolLM2's logit lens on validation text (760 s)
    ... --entry chapter7-lens                                   # chapter 7's, on all its validation text (107 s)

Each seed trains the two-layer attention-only transformer of :mod:`groundup.induction`'s measured recipe
(``MODEL``: 2 layers x 4 heads, d_model 64, vocabulary 64, context 32, RoPE, untied; ``TRAINING``: batch 32,
learning rate 3e-3, 20 warm-up steps, no weight decay, 2000 steps) with :func:`groundup.training.train` on
``batches=induction_batches``, on one CPU thread. ``torch.manual_seed(seed)`` draws the initial weights and
``TrainConfig.seed = seed`` the training batches.

**The curve.** Every ``RECORD_EVERY`` = 25 steps (and at step 0, before training) the *in-context loss*
(:func:`groundup.induction.in_context_loss`: the loss on the predictable tokens of the repeated half) is measured
on a fixed held-out batch, :func:`held_out`: ``repeated_random_tokens(256, context_length // 2, vocab_size)`` drawn
by a generator seeded with ``HELD_OUT_SEED``, the same batch for every seed. ``train``'s own evaluation (4 fixed
batches of its training distribution, :func:`~groundup.induction.random_repeats`) is stored beside it.

**The phase change**, read off the stored (rounded) curve ``L(s)`` at the recorded steps ``s`` of a run of
``T`` steps (:func:`phase_change`):

* ``plateau``: the median of ``L(s)`` over the recorded steps with ``0.05 T <= s <= 0.10 T`` (steps 100 .. 200
  of 2000: after the first fall from the untrained model's ~4.6 and before the drop, where the stored curves
  decline slowly, every value within 0.3 of the median; the median, because of the evaluation noise);
* ``final``: ``L(T)``, the last recorded value; ``drop = plateau - final``;
* ``half_step``: the first recorded step ``s > 0.10 T`` with ``L(s) < plateau / 2``, the middle of the fall;
* ``start_step``: the *last* recorded step ``s < half_step`` with ``L(s) >= final + 0.9 drop`` (the loss still
  within 10 % of the drop of the plateau): the drop begins after it, so noise on the plateau that dips below
  that level earlier, or a rebound to it, does not move the start;
* ``end_step``: the first recorded step ``s > 0.10 T`` with ``L(s) <= final + 0.1 drop`` (90 % of the drop
  done); ``width = end_step - start_step``.

A step the curve never reaches is None (as is everything when no step lies in the plateau window or the drop is
not positive). The resolution is ``RECORD_EVERY`` steps.

**At the end**, on the held-out batch: every head's previous-token and induction scores
(:func:`groundup.interpretability.previous_token_scores`, :func:`~groundup.interpretability.induction_scores`,
lists ``[layer][head]``), its copying score (:func:`~groundup.interpretability.copying_scores`), the
K-composition scores between the layer-0 heads (rows) and the layer-1 heads (columns) of the trained model and,
as the baseline the composition docstring asks for, of the same model at initialisation; and the in-context loss
with each head ablated alone, zero-ablated and mean-ablated, the means per position
(:func:`~groundup.interpretability.mean_head_outputs` with ``per_position=True``) over a second batch of
repeated sequences (generator seed ``MEAN_SEED``); and with all heads of a layer zero-ablated at once. Layers
and heads count from 0, as in the package.

**The heads forming** (``head_scores``, every ``head_scores_every`` = ``RECORD_EVERY`` steps: at the curve's steps,
step 0 included, in the same callback): on the same held-out batch, every head's previous-token and induction scores
(lists ``[layer][head]`` per step) and the K-composition scores between the layer-0 heads (rows) and the layer-1
heads (columns) (lists ``[h0][h1]`` per step), by :func:`head_scores`. The last step's are the final ``scores`` and
``k_composition``; step 0's are the initialised model's (``k_composition_at_init``). Measuring needs no random
numbers and leaves the model in training mode, so the training (and every other number of the entry) is the same
as without it.

**SmolLM2 and chapter 7's model** (``--entry``, stored in the file's ``measurements`` section under the
entry's name, not in ``runs``):

* ``smollm2-copying``: for every one of SmolLM2's 30 x 9 heads, on ``COPY_TOKENS`` = 1024 token ids drawn
  uniformly without replacement from the 49,152 (``torch.randperm`` with a generator seeded ``COPY_SEED``: the
  same kind of tokens as the repeated-random-token test draws), the ranks of
  :func:`groundup.interpretability.copying_ranks` (rank 0: the token's own logit is the top one of its column of
  ``M^h``), summarised per head as ``copying`` (eq. 14.5: the fraction of rank 0), ``hits`` (that count),
  ``top10`` (the fraction of rank < 10) and ``median_rank``; and the eigenvalue score
  (:func:`~groundup.interpretability.ov_eigenvalue_scores`, on the whole vocabulary). A random circuit gives
  ``copying`` about 1/49,152 and a median rank about 24,576.
* ``smollm2-lens`` / ``chapter7-lens``: the logit lens (:func:`lens_statistics`) on windows of the validation
  text (the last 10 % of the Shakespeare corpus, :func:`groundup.data.train_val_split`): ``LENS_WINDOWS`` = 32
  windows of 129 SmolLM2 tokens spread evenly over it (128 predictions each, 4,096 in all), and for chapter 7's
  model every whole window of 65 characters (its context) of it. Per stream entry ``l = 0 .. n_layers``:
  ``top1`` (the fraction of positions where the lens's argmax is the next token; ``hits``, their number; for
  SmolLM2 also ``window_hits``, the numbers per window), ``prob`` (the mean probability of the next token),
  ``nll`` (its mean negative log-probability, nats) and ``median_rank`` (of the next token among all, 0 = top);
  and ``solved`` (the fraction of positions the model itself gets right) with ``first_stays`` (over those
  positions, the mean first entry from which the lens's argmax is the next token at every later entry).

Each entry records the command that made it and its wall time (not reproducible; everything else is, on one
thread with the same arithmetic). Running a command again replaces its entry.

**SmolLM2's induction circuit tested** (issue 39, items 3 and 4; ``NEW_ENTRIES``, also in ``measurements``):

    OMP_NUM_THREADS=1 python tools/ch14_results.py --entry smollm2-induction   # items 1-3 below (370 s here)
    OMP_NUM_THREADS=1 python tools/ch14_results.py --entry smollm2-two-tier    # item 4 (444 s)
    OMP_NUM_THREADS=1 python tools/ch14_results.py --entry smollm2-name-swap   # item 5 (521 s)

These run under the notebooks' arithmetic (``results_file.on_notebook_arithmetic``: the command starts itself again
with ``nbval_lanes.ARITHMETIC`` set unless the shell set it; the entries above did not, so these entries cannot be
requested in the same command as them or as the seeds), on one thread, and store ``machine`` (CPU, threads,
kernels, every variable of that arithmetic, PyTorch's version). The model is ``SMOLLM2``: the Q4_1 GGUF file of
SmolLM2-135M-Instruct, dequantized to float32. The sequences are ``SMOL_SEQ`` = 64 repeated random sequences of
``2 x SMOL_HALF`` = 2 x 16 token ids (:func:`~groundup.induction.repeated_random_tokens`, generator seeded
``SMOL_SEED``; the chapter's draw, more of them); a loss is the mean next-token loss over the 15 positions
``16 .. 30`` whose next token repeats (:func:`sequence_losses`, per sequence; their mean is
:func:`~groundup.induction.in_context_loss`). Every measurement is stored per sequence (``per_seq``) beside a
:func:`summary` (mean, sample SD, a percentile bootstrap 95 % interval of the mean over the sequences), rounded
to 4 digits. An *induction head* scores at least ``INDUCTION_CUT`` = 0.4 (mean over the sequences), a *control*
head less than ``CONTROL_MAX`` = 0.1.

* ``smollm2-induction``: (1) every head's induction score (eq. 14.4, per sequence: ``induction_mean`` / ``_sd``
  [layer][head]) and its direct share, the chapter's centred direct logit attribution (14.9) of the right next
  token, each sequence's mean over the repeat positions (``dla_mean`` / ``_sd``; the whole centred logit, the 270
  heads' and the rest's shares as summaries); ``heads`` lists, with per-sequence values, every head with
  ``|share| >= LARGE_SHARE`` = 0.2 logits, every induction head, the top five by induction score and 23.2, 23.7.
  (2) ``baseline``: the same positions of ``SMOL_SEQ`` sequences of uniform random ids that do not repeat
  (``torch.randint``, seed ``SMOL_BASELINE_SEED``), beside ln V. (3) ``ablation.conditions``: the loss per sequence
  with nothing ablated (``none``); the five top induction heads zero- and mean-ablated (``top5_zero``,
  ``top5_mean``; the means per position over ``SMOL_SEQ`` other repeated sequences, seed ``SMOL_MEAN_SEED``, as
  the chapter); 23.2 and 23.7 zeroed (``pair_zero``) and with the top five (``top5_and_pair_zero``);
  ``N_CONTROLS`` = 20 different sets of control heads drawn from the top five's layers, as many from each
  (``control0`` ..), and ``N_PAIR_CONTROLS`` = 10 (fewer if the pool holds fewer) pairs of control heads of
  layer 23 (``pair_control0`` ..), seeds ``CONTROL_SEED``, ``CONTROL_SEED + 1`` (:func:`_draw_controls`); each
  with ``minus_none``, the per-sequence difference from ``none`` summarised.
* ``smollm2-two-tier``: the two-tier hypothesis, layers 17-18's induction heads (``sources``: those of
  ``SOURCE_LAYERS`` scoring at least 0.4 on these sequences) feed the induction-like heads 23.2, 23.7 and the
  copier 29.1 (``TWO_TIER_TARGETS``). For each target and each of ``PATHS`` (``q``, ``k``, ``v`` and all three):
  the sources' summed direct output removed from what that one head reads through that path
  (:func:`~groundup.interpretability.remove_from_inputs` with ``head``, the blocks from the target's on run again
  on the clean run's stream; every other head, the FFNs and the residual stream keep it), and the loss,
  the target's induction score and its direct share per sequence (``removals["induction/q"]`` ...), beside its
  ``baseline`` and ``N_SOURCE_CONTROLS`` = 5 removals of control heads of the same layers, as many from each
  (``control0/q`` ..., seed ``CONTROL_SEED + 2``). For 29.1 also the second tier: 23.2 and 23.7 removed
  (``layer23/q`` ...) beside pairs of layer-23 control heads (``layer23_control0/q`` ..., ``CONTROL_SEED + 3``).
  ``attention`` (baseline and each removal) summarises where the target attends (:func:`attention_profile`).
  Only the direct path is removed: what the sources changed in the blocks between them and the target stays.
* ``smollm2-copiers``: on the sequences of ``smollm2-induction``, (1) the loss per sequence with the copiers of
  layers 17-18 zeroed (``copiers_1718``: copying score (14.5) above ``COPY_MIN`` = 0.01 in ``smollm2-copying``) and
  with the five top copiers zeroed (``top5_copiers``), each beside ``N_CONTROLS`` = 20 sets of heads of the same
  layers, as many from each, that neither copy nor prefix-match (copying <= 0.01, induction score < 0.1; seeds
  ``CONTROL_SEED + 4``, ``+ 5``); (2) ``top5_zeroed_dla``: the centred direct shares (14.9) of every head with
  ``|share| >= LARGE_SHARE``, the 270 heads', the FFNs' and the whole centred logit, per sequence, intact and with
  the five top induction heads zeroed (the total effect the two-tier test then takes apart).
* ``smollm2-name-swap``: name-swap patching (eq. 14.11) on ``IOI_PAIRS`` = 50 ordered pairs of the single-token
  ``NAMES`` (:func:`name_pairs`: the chapter's Mary / John, then pairs drawn with seed ``IOI_SEED``; every name is
  checked to be one token with its leading space) in the two ``TEMPLATES``, ABBA ("When {io} and {s} went to the
  store, {s} gave a drink to") and BABA ("When {s} and {io} ..."); the clean prompt's answer is `` io``, the
  corrupted prompt names ``io`` twice (its answer `` s``). Per template and direction,
  :func:`~groundup.interpretability.residual_patching` with ``per_example=True`` on every stream entry 0 .. 30 and
  every position from the changed name on (9 .. 13): ``denoising`` patches the
  clean run's vector into the corrupted run (fraction = (LD - LD_corrupted) / (LD_clean - LD_corrupted), 1: the
  clean answer restored), ``noising`` the corrupted run's into the clean run (fraction = (LD - LD_clean) /
  (LD_corrupted - LD_clean), 1: the clean answer destroyed). Stored: ``fraction`` [entry][position] with the means
  over the pairs, as :func:`~groundup.interpretability.residual_patching` normalises, a bootstrap 95 % interval
  over the pairs (``fraction_ci95``), the per-pair fractions' mean and SD, and the logit differences per pair
  (``ld_per_pair`` [entry][position][pair], ``ld_source_per_pair``, ``ld_target_per_pair``; ``patched`` False
  where the two streams are equal, the LD then the target run's by definition); ``pooled``: the fractions, their
  intervals and the per-pair means and SDs over both templates' 100 prompts.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from results_file import add_entry, machine, on_notebook_arithmetic

from groundup import interpretability as interp
from groundup.data import load_corpus, train_val_split
from groundup.induction import AttentionOnlyConfig, in_context_loss, induction_batches, repeated_random_tokens
from groundup.interpretability import (
    ablate_heads,
    attention_patterns,
    composition_scores,
    copying_ranks,
    copying_scores,
    induction_scores,
    mean_head_outputs,
    ov_eigenvalue_scores,
    previous_token_scores,
    residual_stream,
)
from groundup.models import GPT
from groundup.training import TrainConfig, train

OUT = Path(__file__).resolve().parents[1] / "src" / "groundup" / "results" / "chapter14.json"
MODEL = dict(vocab_size=64, context_length=32, d_model=64, n_layers=2, n_heads=4, positional="rope",
             tie_weights=False)
TRAINING = dict(batch_size=32, max_steps=2000, learning_rate=3e-3, warmup_steps=20, weight_decay=0.0, eval_batches=4)
RECORD_EVERY = 25
HELD_OUT_SEED, MEAN_SEED = 1400, 1401
N_HELD_OUT, N_MEAN = 256, 256
PLATEAU_WINDOW = (0.05, 0.10)  # fractions of the run's steps
DIGITS = 5
COPY_TOKENS, COPY_SEED = 1024, 14
LENS_WINDOWS, LENS_WINDOW_TOKENS = 32, 129  # SmolLM2: 32 windows of 129 tokens, 128 predictions each
ENTRIES = ("smollm2-copying", "smollm2-lens", "chapter7-lens")
# issue 39, items 3 and 4: run under the notebooks' arithmetic (results_file.on_notebook_arithmetic)
NEW_ENTRIES = ("smollm2-induction", "smollm2-two-tier", "smollm2-name-swap", "smollm2-copiers")
SMOLLM2 = "SmolLM2-135M-Instruct: the Q4_1 GGUF file dequantized to float32 (groundup.pretrained.load_smollm2)"
SMOL_SEQ, SMOL_HALF = 64, 16  # 64 repeated sequences of 2 x 16 tokens (the chapter's length), 15 predictions each
SMOL_SEED, SMOL_MEAN_SEED, SMOL_BASELINE_SEED, CONTROL_SEED = 1410, 1411, 1412, 1413
INDUCTION_CUT = 0.4  # an induction head: mean induction score >= 0.4
CONTROL_MAX = 0.1  # a control head: < 0.1 (uniform attention over the context scores about 0.04)
LARGE_SHARE = 0.2  # a large direct share: |mean centred DLA| >= 0.2 logits
N_CONTROLS, N_PAIR_CONTROLS, N_SOURCE_CONTROLS = 20, 10, 5
LAYER23_PAIR = ((23, 2), (23, 7))
SOURCE_LAYERS = (17, 18)
TWO_TIER_TARGETS = ((23, 2), (23, 7), (29, 1))
COPIER = (29, 1)
PATHS = ("q", "k", "v", "qkv")
BOOTSTRAP_SEED, BOOTSTRAP_DRAWS = 0, 2000
NAMES = ("Mary", "John", "Tom", "James", "Anna", "Sarah", "David", "Michael", "Paul", "Peter", "Lisa", "Emma",
         "Kate", "Alice", "Laura", "Susan", "Robert", "Daniel", "George", "Helen", "Chris", "Steve", "Karen",
         "Linda", "Nancy", "Frank", "Emily", "Jane", "Rachel", "Jessica")
IOI_PAIRS, IOI_SEED, IOI_FIRST = 50, 1414, ("Mary", "John")
TEMPLATES = {"ABBA": "When {io} and {s} went to the store, {s2} gave a drink to",
             "BABA": "When {s} and {io} went to the store, {s2} gave a drink to"}


def held_out(vocab_size: int, context_length: int, n_seq: int = N_HELD_OUT, seed: int = HELD_OUT_SEED):
    """The fixed batch of repeated random sequences the in-context loss is measured on."""
    return repeated_random_tokens(n_seq, context_length // 2, vocab_size, torch.Generator().manual_seed(seed))


def phase_change(steps: list[int], losses: list[float], max_steps: int) -> dict:
    """The phase-change window of a curve by the module docstring's rule."""
    lo, hi = PLATEAU_WINDOW[0] * max_steps, PLATEAU_WINDOW[1] * max_steps
    window = [loss for s, loss in zip(steps, losses) if lo <= s <= hi]
    final = losses[-1]
    empty = {"plateau": None, "final": final, "half_step": None, "start_step": None, "end_step": None,
             "width": None}
    if not window:
        return empty
    plateau = statistics.median(window)
    drop = plateau - final
    if drop <= 0:
        return {**empty, "plateau": plateau}
    after = [(s, loss) for s, loss in zip(steps, losses) if s > hi]

    def first(threshold, strict=False):
        return next((s for s, loss in after if (loss < threshold if strict else loss <= threshold)), None)

    half, end = first(plateau / 2, strict=True), first(final + 0.1 * drop)
    start = None
    if half is not None:
        start = max((s for s, loss in zip(steps, losses) if s < half and loss >= final + 0.9 * drop), default=None)
    return {"plateau": plateau, "final": final, "half_step": half, "start_step": start,
            "end_step": end, "width": None if start is None or end is None else end - start}


def recompute_windows(path: Path = OUT) -> dict:
    """Apply :func:`phase_change` again to every stored curve (no training) and store the windows; returns them
    by key. For a change of the rule: the curves are what the runs measured, the windows only read them."""

    found = {}
    for key, entry in json.loads(Path(path).read_text(encoding="utf-8"))["runs"].items():
        curve = entry["curve"]
        entry["phase_change"] = phase_change(curve["step"], curve["in_context_loss"], entry["training"]["max_steps"])
        add_entry(path, key, entry)
        found[key] = entry["phase_change"]
    return found


def _rounded(t: torch.Tensor):
    return [[round(float(x), DIGITS) for x in row] for row in t.reshape(t.shape[0], -1)]


def scores(model: GPT, tokens: torch.Tensor) -> dict:
    """Per-head scores on ``tokens`` (lists [layer][head])."""
    patterns = attention_patterns(model, tokens)
    return {"previous_token": _rounded(torch.stack([previous_token_scores(p) for p in patterns])),
            "induction": _rounded(torch.stack([induction_scores(p) for p in patterns])),
            "copying": _rounded(torch.stack([copying_scores(model, layer) for layer in range(len(patterns))]))}


def head_scores(model: GPT, tokens: torch.Tensor) -> dict:
    """What :func:`run_seed` records every ``RECORD_EVERY`` steps: each head's previous-token and induction scores
    on ``tokens`` (lists [layer][head]) and the K-composition scores of the layer-0 heads (rows) into the layer-1
    heads (columns). In eval mode without gradients, the model's mode restored; no random numbers drawn."""
    patterns = attention_patterns(model, tokens)
    return {"previous_token": _rounded(torch.stack([previous_token_scores(p) for p in patterns])),
            "induction": _rounded(torch.stack([induction_scores(p) for p in patterns])),
            "k_composition": _rounded(composition_scores(model, 0, 1, kind="k"))}


def ablations(model: GPT, tokens: torch.Tensor, reference: torch.Tensor) -> dict:
    """The in-context loss on ``tokens`` with each head ablated alone (lists [layer][head]), each layer zeroed, and
    each pair of layer-0 heads zeroed together (``"a,b"`` keys)."""
    means = mean_head_outputs(model, reference, per_position=True)
    c = model.config
    found = {"none": round(in_context_loss(model, tokens), DIGITS)}
    for mode in ("zero", "mean"):
        table = []
        for layer in range(c.n_layers):
            row = []
            for head in range(c.n_heads):
                with ablate_heads(model, [(layer, head)], mode=mode, means=means if mode == "mean" else None):
                    row.append(round(in_context_loss(model, tokens), DIGITS))
            table.append(row)
        found[mode] = table
    found["zero_layer"] = []
    for layer in range(c.n_layers):
        with ablate_heads(model, [(layer, head) for head in range(c.n_heads)]):
            found["zero_layer"].append(round(in_context_loss(model, tokens), DIGITS))
    found["zero_pairs_layer0"] = {}  # two layer-0 heads zeroed together: a backup previous-token head shows here
    for a, b in itertools.combinations(range(c.n_heads), 2):
        with ablate_heads(model, [(0, a), (0, b)]):
            found["zero_pairs_layer0"][f"{a},{b}"] = round(in_context_loss(model, tokens), DIGITS)
    return found


def run_seed(seed: int, *, model: dict | None = None, training: dict | None = None,
             record_every: int = RECORD_EVERY, record_heads: bool = True) -> tuple[dict, GPT]:
    """Train one seed and measure it: returns ``(entry, trained model)``; ``model`` / ``training`` override
    ``MODEL`` / ``TRAINING`` (for a quick check). ``record_heads=False`` leaves out ``head_scores`` (the training
    and the rest of the entry are the same)."""
    model_kwargs, train_kwargs = {**MODEL, **(model or {})}, {**TRAINING, **(training or {})}
    tick = time.perf_counter()
    torch.manual_seed(seed)
    net = GPT(AttentionOnlyConfig(**model_kwargs))
    tokens = held_out(model_kwargs["vocab_size"], model_kwargs["context_length"])
    reference = held_out(model_kwargs["vocab_size"], model_kwargs["context_length"], N_MEAN, MEAN_SEED)
    at_init = composition_scores(net, 0, 1, kind="k")
    steps, losses = [], []
    heads = {"step": [], "previous_token": [], "induction": [], "k_composition": []}

    def measure(step, m):
        steps.append(step)
        losses.append(round(in_context_loss(m, tokens), DIGITS))
        if record_heads:
            heads["step"].append(step)
            for name, table in head_scores(m, tokens).items():
                heads[name].append(table)

    def record(step, m):
        if step % record_every == 0 and step != steps[-1]:
            measure(step, m)

    measure(0, net)

    config = TrainConfig(**train_kwargs, eval_interval=record_every, seed=seed, device="cpu", progress=False)
    history = train(net, model_kwargs["vocab_size"], model_kwargs["vocab_size"], config, callback=record,
                    batches=induction_batches)
    if steps[-1] != config.max_steps:  # a run whose length is not a multiple of record_every
        measure(config.max_steps, net)
    net.eval()
    entry = {
        "seed": seed, "model": model_kwargs,
        "training": {k: v for k, v in dataclasses.asdict(config).items()
                     if k in train_kwargs or k in ("eval_interval", "seed", "grad_clip", "optimizer")},
        "held_out": {"n_seq": N_HELD_OUT, "half_len": model_kwargs["context_length"] // 2, "seed": HELD_OUT_SEED},
        "curve": {"step": steps, "in_context_loss": losses},
        "train_eval": {"step": history.eval_step, "val_loss": [round(v, DIGITS) for v in history.val_loss]},
        "phase_change": phase_change(steps, losses, config.max_steps),
        "scores": scores(net, tokens),
        "k_composition": _rounded(composition_scores(net, 0, 1, kind="k")),
        "k_composition_at_init": _rounded(at_init),
        **({"head_scores_every": record_every, "head_scores": heads} if record_heads else {}),
        "ablation": {"means": {"n_seq": N_MEAN, "seed": MEAN_SEED, "per_position": True},
                     **ablations(net, tokens, reference)},
        "threads": torch.get_num_threads(), "mkl_cbwr": os.environ.get("MKL_CBWR"),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
    }
    entry["wall_seconds"] = round(time.perf_counter() - tick, 1)
    return entry, net


# ---------------------------------------------------------------------------------------------------------------
# SmolLM2 and chapter 7's model


def copying_sample(vocab_size: int, n: int = COPY_TOKENS, seed: int = COPY_SEED) -> torch.Tensor:
    """The token ids the copying scores are measured on: ``n`` of ``vocab_size``, uniformly, without replacement."""
    return torch.randperm(vocab_size, generator=torch.Generator().manual_seed(seed))[:n]


def copying_table(model: GPT, tokens: torch.Tensor, *, layers=None, log=None) -> dict:
    """Per-head summaries of :func:`~groundup.interpretability.copying_ranks` on ``tokens`` (lists [layer][head])."""
    found = {"copying": [], "hits": [], "top10": [], "median_rank": [], "eigenvalue": []}
    for layer in range(model.config.n_layers) if layers is None else layers:
        ranks = copying_ranks(model, layer, tokens=tokens, chunk=512)
        found["hits"].append([int(x) for x in (ranks == 0).sum(dim=1)])
        found["copying"].append([round(h / ranks.shape[1], DIGITS) for h in found["hits"][-1]])
        found["top10"].append([round(float(x), DIGITS) for x in (ranks < 10).float().mean(dim=1)])
        found["median_rank"].append([int(x) for x in ranks.median(dim=1).values])  # the lower of the middle two
        found["eigenvalue"].append([round(float(x), DIGITS) for x in ov_eigenvalue_scores(model, layer)])
        if log:
            log(f"layer {layer}: copying {found['copying'][-1]}, median rank {found['median_rank'][-1]}")
    return found


def lens_windows(ids: torch.Tensor, n_windows: int | None, length: int) -> torch.Tensor:
    """``(n_windows, length)`` windows of the 1-D ``ids``, starting at evenly spaced offsets (``None``: every
    whole non-overlapping window, from the start)."""
    if n_windows is None:
        n_windows = ids.numel() // length
        return ids[:n_windows * length].view(n_windows, length)
    stride = ids.numel() // n_windows
    if stride < length:
        raise ValueError(f"{n_windows} windows of {length} tokens do not fit in {ids.numel()} tokens")
    return torch.stack([ids[k * stride:k * stride + length] for k in range(n_windows)])


def lens_statistics(model: GPT, windows: torch.Tensor, *, batch: int = 4, per_window: bool = False) -> dict:
    """The logit lens (eq. 14.10) on ``windows (n, w + 1)`` of token ids, predicting tokens 1 .. w of each from
    those before; summarised per stream entry (see the module docstring). ``hits``: per entry, the positions where
    the lens's argmax is the next token; with ``per_window`` also ``window_hits``, those counts per window. One
    entry's logits at a time, ``batch`` windows at a time, so SmolLM2's 31 x 49,152 logits a position are never
    all held."""
    n, entries = windows.shape[0], model.config.n_layers + 1
    hits = torch.zeros(entries, n, dtype=torch.long)
    right, prob, nll, rank = [], [], [], []  # per batch: (entries, positions)
    for start in range(0, n, batch):
        ids = windows[start:start + batch]
        target = ids[:, 1:, None]
        stream = residual_stream(model, ids[:, :-1])
        cols = ([], [], [], [])
        with torch.no_grad():
            for layer, x in enumerate(stream):
                logits = model.unembedding(model.final_norm(x)).float()
                top = logits.argmax(dim=-1) == target[..., 0]  # (batch, w)
                hits[layer, start:start + ids.shape[0]] = top.sum(dim=1)
                own = logits.gather(-1, target)
                logp = (own - logits.logsumexp(dim=-1, keepdim=True))[..., 0]
                above = (logits > own).sum(dim=-1)  # how many tokens the lens puts above the right one
                for col, value in zip(cols, (top, logp.exp(), -logp, above)):
                    col.append(value.flatten())
        for store_, col in zip((right, prob, nll, rank), cols):
            store_.append(torch.stack(col))
    right, prob, nll, rank = (torch.cat(x, dim=1) for x in (right, prob, nll, rank))
    stays = right.flip(0).cummin(dim=0).values.flip(0)  # right from this entry to the last
    solved = right[-1]
    first = (~stays).sum(dim=0)[solved].float()  # the entries before it stays right
    return {"n_windows": n, "window_tokens": windows.shape[1], "positions": right.shape[1],
            "hits": hits.sum(dim=1).tolist(), **({"window_hits": hits.tolist()} if per_window else {}),
            "top1": [round(float(x), DIGITS) for x in right.float().mean(dim=1)],
            "prob": [round(float(x), DIGITS) for x in prob.double().mean(dim=1)],
            "nll": [round(float(x), DIGITS) for x in nll.double().mean(dim=1)],
            "median_rank": [int(x) for x in rank.median(dim=1).values],
            "solved": round(float(solved.float().mean()), DIGITS),
            "first_stays": round(float(first.mean()), DIGITS) if first.numel() else None}


def validation_text() -> str:
    """The validation text of both lenses: the last 10 % of the Shakespeare corpus."""
    return train_val_split(load_corpus("shakespeare"))[1]


def _arithmetic() -> dict:
    return {"threads": torch.get_num_threads(), "mkl_cbwr": os.environ.get("MKL_CBWR"),
            "cpu_capability": torch.backends.cpu.get_cpu_capability()}


def measure(name: str) -> dict:
    """Make the entry ``name`` (one of ``ENTRIES``); returns it, wall time included."""
    tick = time.perf_counter()
    if name == "chapter7-lens":
        from groundup.training import chapter7_model

        model, tok = chapter7_model()
        windows = lens_windows(torch.tensor(tok.encode(validation_text())), None, model.config.context_length + 1)
        entry = {"model": "chapter 7's GPT (groundup.training.chapter7_model)", "text": "validation, characters",
                 **lens_statistics(model, windows, batch=64)}
    else:
        from groundup.pretrained import load_smollm2

        model, tok = load_smollm2()
        model.eval()
        if name == "smollm2-copying":
            tokens = copying_sample(model.config.vocab_size)
            entry = {"model": "SmolLM2-135M-Instruct (groundup.pretrained.load_smollm2)",
                     "tokens": {"n": tokens.numel(), "seed": COPY_SEED, "draw": "torch.randperm(vocab_size)[:n]"},
                     **copying_table(model, tokens, log=lambda m: print(m, flush=True))}
        else:
            windows = lens_windows(torch.tensor(tok.encode(validation_text())), LENS_WINDOWS, LENS_WINDOW_TOKENS)
            entry = {"model": "SmolLM2-135M-Instruct (groundup.pretrained.load_smollm2)",
                     "text": "validation, SmolLM2 tokens, windows at evenly spaced offsets",
                     **lens_statistics(model, windows, per_window=True)}
    return {**entry, **_arithmetic(), "wall_seconds": round(time.perf_counter() - tick, 1)}


# ---------------------------------------------------------------------------------------------------------------
# SmolLM2's induction circuit tested (issue 39, items 3 and 4): the entries of NEW_ENTRIES, under the notebooks'
# arithmetic


def summary(values, *, seed: int = BOOTSTRAP_SEED, draws: int = BOOTSTRAP_DRAWS) -> dict:
    """``n``, mean, sample standard deviation and a percentile bootstrap 95 % interval of the mean of ``values``
    (one per sequence, pair, ...), rounded. The resamples are drawn by a generator seeded ``seed``."""
    x = torch.as_tensor(values, dtype=torch.float64).flatten()
    n = x.numel()
    sd = float(x.std()) if n > 1 else 0.0
    means = x[torch.randint(n, (draws, n), generator=torch.Generator().manual_seed(seed))].mean(dim=1)
    lo, hi = torch.quantile(means, torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()
    return {"n": n, "mean": round(float(x.mean()), DIGITS), "sd": round(sd, DIGITS),
            "ci95": [round(lo, DIGITS), round(hi, DIGITS)]}


def _r(t, digits: int = 4):
    """A tensor as (nested) lists of floats rounded to ``digits``."""
    t = torch.as_tensor(t)
    return round(float(t), digits) if t.dim() == 0 else [_r(x, digits) for x in t]


def repeat_slice(tokens: torch.Tensor) -> slice:
    """The positions whose next token repeats the first half (as :func:`~groundup.induction.induction_targets`):
    ``H .. 2H - 2`` of sequences of ``2H`` tokens."""
    half = tokens.shape[1] // 2
    return slice(half, 2 * half - 1)


def sequence_losses(model: GPT, final: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Each sequence's mean next-token loss (nats) over the positions of :func:`repeat_slice`, from the last
    stream entry ``final`` ``(batch, 2H, d_model)``: only those positions are unembedded. Their mean is
    :func:`~groundup.induction.in_context_loss` when ``tokens`` repeat (for random ``tokens`` that do not, the
    loss at the same positions)."""
    s = repeat_slice(tokens)
    with torch.no_grad():
        logits = model.unembedding(model.final_norm(final[:, s])).float()
        target = tokens[:, s.start + 1:s.stop + 1]
        nll = logits.logsumexp(dim=-1) - logits.gather(-1, target[..., None])[..., 0]
    return nll.mean(dim=1)


def sequence_induction_scores(pattern: torch.Tensor) -> torch.Tensor:
    """:func:`~groundup.interpretability.induction_scores` per sequence: ``(batch, n_heads)`` for one layer's
    pattern ``(batch, n_heads, 2H, 2H)`` (or ``(batch,)`` for one head's ``(batch, 2H, 2H)``)."""
    half = pattern.shape[-1] // 2
    return pattern.diagonal(offset=-(half - 1), dim1=-2, dim2=-1)[..., 1:].mean(dim=-1)


def attention_profile(pattern: torch.Tensor) -> dict[str, torch.Tensor]:
    """Where one head attends on repeated sequences of ``2H`` tokens: its mean weight, per sequence, from the query
    positions ``i = H + 1 .. 2H - 1`` to ``i - H + 1`` (``next_of_earlier``: the token after the earlier copy of the
    query's token, what an induction head reads), ``i - H`` (``earlier_copy``: that earlier copy itself), ``i``
    (``self``) and ``0`` (``first``: the first position). ``pattern``: ``(batch, 2H, 2H)``; returns ``(batch,)``
    tensors."""
    half = pattern.shape[-1] // 2
    rows = torch.arange(half + 1, 2 * half)
    return {"next_of_earlier": pattern[:, rows, rows - half + 1].mean(-1),
            "earlier_copy": pattern[:, rows, rows - half].mean(-1),
            "self": pattern[:, rows, rows].mean(-1), "first": pattern[:, rows, 0].mean(-1)}


def _reading(model: GPT, final: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """At the positions of :func:`repeat_slice`: what one unit of the stream adds to the right next token's centred
    logit with the final norm's divisor frozen (the ``read`` of direct_logit_attribution, ``centred=True``):
    ``(batch, H - 1, d_model)``."""
    s = repeat_slice(tokens)
    u = interp._weight(model.unembedding).float()
    rows = u[tokens[:, s.start + 1:s.stop + 1]] - u.mean(0)
    return (rows @ interp._norm_map(model.final_norm, model.config.d_model, u)) * interp._final_scale(
        model.final_norm, final[:, s].float())


def head_direct_shares(model: GPT, final: torch.Tensor, tokens: torch.Tensor, layer: int,
                       z: torch.Tensor) -> torch.Tensor:
    """The centred direct logit attribution (14.9) of layer ``layer``'s heads to the right next token, each
    sequence's mean over the positions of :func:`repeat_slice`: ``(batch, n_heads)``, from the last stream entry
    ``final`` and the heads' outputs ``z`` ``(batch, 2H, n_heads, d_head)`` of that run (``z`` may also be one
    head's ``(batch, 2H, d_head)`` with ``W_o``'s columns of that head: pass ``layer=(layer, head)``)."""
    read = _reading(model, final, tokens)
    s = repeat_slice(tokens)
    if isinstance(layer, tuple):
        layer, head = layer
        d_head = z.shape[-1]
        w_o = interp._weight(model.blocks[layer].attention.W_o).float()[:, head * d_head:(head + 1) * d_head]
        return ((read @ w_o) * z[:, s].float()).sum(-1).mean(dim=1)
    w_o = interp._weight(model.blocks[layer].attention.W_o).float()
    per = (read @ w_o).reshape(*read.shape[:2], *z.shape[-2:]) * z[:, s].float()
    return per.sum(-1).mean(dim=1)


def clean_run(model: GPT, tokens: torch.Tensor) -> dict:
    """One run's residual stream, heads' outputs, attention patterns and per-sequence loss (repeat positions)."""
    stream, outputs = interp.residual_stream(model, tokens), interp.head_outputs(model, tokens)
    patterns = interp.attention_patterns(model, tokens)
    return {"stream": stream, "outputs": outputs, "patterns": patterns,
            "loss": sequence_losses(model, stream[-1], tokens)}


def ablated_losses(model: GPT, run: dict, tokens: torch.Tensor, heads, *, mode: str = "zero",
                   means=None) -> torch.Tensor:
    """Per-sequence loss (repeat positions) with ``heads`` ablated (:func:`~groundup.interpretability.ablate_heads`),
    run from the first ablated layer on the clean ``run``'s stream (the blocks before it compute as in the run)."""
    first = min(layer for layer, _ in heads)
    with interp.ablate_heads(model, heads, mode=mode, means=means):
        final = interp._run_from(model, run["stream"][first], first)
    return sequence_losses(model, final, tokens)


def _names(heads) -> list[str]:
    return [f"{layer}.{head}" for layer, head in heads]


def _draw_controls(pool_by_layer: dict[int, list[int]], counts: dict[int, int], n_sets: int, seed: int):
    """``n_sets`` different sets of heads, ``counts[layer]`` from each layer's ``pool_by_layer[layer]`` (without
    replacement within a set), drawn by ``torch.randperm`` with a generator seeded ``seed`` (a set drawn again is
    drawn anew); fewer when the pools hold fewer different sets. In the order of ``counts``."""
    g = torch.Generator().manual_seed(seed)
    possible = 1
    for layer, k in counts.items():
        if k > len(pool_by_layer[layer]):
            raise ValueError(f"layer {layer} has {len(pool_by_layer[layer])} heads to draw {k} controls from")
        possible *= math.comb(len(pool_by_layer[layer]), k)
    sets, seen = [], set()
    while len(sets) < min(n_sets, possible):
        chosen = []
        for layer, k in counts.items():
            pool = pool_by_layer[layer]
            chosen += sorted((layer, pool[int(i)]) for i in torch.randperm(len(pool), generator=g)[:k])
        if frozenset(chosen) not in seen:
            seen.add(frozenset(chosen))
            sets.append(chosen)
    return sets


def induction_heads(scores: torch.Tensor, cut: float = INDUCTION_CUT) -> list[tuple[int, int]]:
    """The heads whose mean induction score ``scores[layer, head]`` is at least ``cut``, highest first."""
    flat = scores.flatten()
    order = flat.argsort(descending=True)
    return [divmod(int(i), scores.shape[1]) for i in order if float(flat[i]) >= cut]


def induction_entry(model: GPT, *, n_seq: int = SMOL_SEQ, half_len: int = SMOL_HALF, seed: int = SMOL_SEED,
                    mean_seed: int = SMOL_MEAN_SEED, baseline_seed: int = SMOL_BASELINE_SEED,
                    pair: tuple = LAYER23_PAIR, n_controls: int = N_CONTROLS, pair_controls: int = N_PAIR_CONTROLS,
                    cut: float = INDUCTION_CUT, control_max: float = CONTROL_MAX, log=print) -> dict:
    """Items 1-3 of ``smollm2-induction`` (module docstring) for ``model``: per-head scores and direct shares,
    the no-repeat baseline and the ablations, with per-sequence values."""
    v, n_heads = model.config.vocab_size, model.config.n_heads
    tokens = repeated_random_tokens(n_seq, half_len, v, torch.Generator().manual_seed(seed))
    run = clean_run(model, tokens)
    ind = torch.stack([sequence_induction_scores(p) for p in run["patterns"]]).permute(0, 2, 1)  # (L, H, batch)
    prev = torch.stack([interp.previous_token_scores(p) for p in run["patterns"]])
    dla = torch.stack([head_direct_shares(model, run["stream"][-1], tokens, layer, run["outputs"][layer])
                       for layer in range(model.config.n_layers)]).permute(0, 2, 1)  # (L, H, batch)
    parts = interp.direct_logit_attribution(model, tokens, torch.cat([tokens[:, 1:], tokens[:, :1]], dim=1),
                                            centred=True)
    s = repeat_slice(tokens)
    total = (parts["embedding"] + parts["heads"].sum((0, 1)) + parts["rest"].sum(0) + parts["bias"])[:, s]
    heads_mean, ind_mean = dla.mean(-1), ind.mean(-1)
    log(f"in-context loss {float(run['loss'].mean()):.3f}; top induction heads "
        f"{_names(induction_heads(ind_mean, cut)[:8])}")
    top_dla = [divmod(int(i), n_heads) for i in heads_mean.flatten().argsort(descending=True)]
    large = [h for h in top_dla if abs(float(heads_mean[h])) >= LARGE_SHARE]
    induction = induction_heads(ind_mean, cut)
    top5 = [divmod(int(i), n_heads) for i in ind_mean.flatten().topk(5).indices]
    listed = list(dict.fromkeys(large + induction + top5 + [tuple(p) for p in pair]))

    # 2. the baseline: random tokens that do not repeat, the same positions
    plain = torch.randint(0, v, (n_seq, 2 * half_len), generator=torch.Generator().manual_seed(baseline_seed))
    with interp._inspecting(model):
        baseline = sequence_losses(model, interp.residual_stream(model, plain)[-1], plain)
    log(f"no-repeat baseline {float(baseline.mean()):.3f} (ln V = {math.log(v):.3f})")

    # 3. ablations
    reference = repeated_random_tokens(n_seq, half_len, v, torch.Generator().manual_seed(mean_seed))
    means = interp.mean_head_outputs(model, reference, per_position=True)
    losses = {"none": run["loss"]}
    conditions = {"none": []}
    for mode in ("zero", "mean"):
        losses[f"top5_{mode}"] = ablated_losses(model, run, tokens, top5, mode=mode,
                                                means=means if mode == "mean" else None)
        conditions[f"top5_{mode}"] = top5
    pair = [tuple(p) for p in pair]
    losses["pair_zero"], conditions["pair_zero"] = ablated_losses(model, run, tokens, pair), pair
    losses["top5_and_pair_zero"] = ablated_losses(model, run, tokens, top5 + pair)
    conditions["top5_and_pair_zero"] = top5 + pair
    log("ablations: " + ", ".join(f"{k} {float(x.mean()):.3f}" for k, x in losses.items()))
    not_induction = {layer: [h for h in range(n_heads) if float(ind_mean[layer, h]) < min(control_max, cut)
                             and (layer, h) not in top5] for layer in range(model.config.n_layers)}
    counts = {}
    for layer, _ in top5:
        counts[layer] = counts.get(layer, 0) + 1
    controls = _draw_controls(not_induction, counts, n_controls, CONTROL_SEED)
    pair_counts = {}
    for layer, _ in pair:
        pair_counts[layer] = pair_counts.get(layer, 0) + 1
    pair_pool = {layer: [h for h in not_induction[layer] if (layer, h) not in pair] for layer in pair_counts}
    pair_sets = _draw_controls(pair_pool, pair_counts, pair_controls, CONTROL_SEED + 1)
    for name, sets in (("control", controls), ("pair_control", pair_sets)):
        for k, heads in enumerate(sets):
            losses[f"{name}{k}"], conditions[f"{name}{k}"] = ablated_losses(model, run, tokens, heads), heads
        log(f"{name}s: " + ", ".join(f"{float(losses[f'{name}{k}'].mean()):.2f}" for k in range(len(sets))))

    def head_row(h):
        layer, head = h
        return {"head": f"{layer}.{head}", "induction": summary(ind[layer, head]), "dla": summary(dla[layer, head]),
                "previous_token": round(float(prev[layer, head]), DIGITS),
                "induction_per_seq": _r(ind[layer, head]), "dla_per_seq": _r(dla[layer, head])}

    return {
        "tokens": {"n_seq": n_seq, "half_len": half_len, "seed": seed,
                   "draw": "repeated_random_tokens(n_seq, half_len, vocab_size, Generator().manual_seed(seed))",
                   "predictions_per_seq": half_len - 1},
        "induction_cut": cut, "control_max": control_max, "large_share": LARGE_SHARE,
        "induction_mean": _r(ind_mean, DIGITS), "induction_sd": _r(ind.std(-1), DIGITS),
        "previous_token": _r(prev, DIGITS),
        "dla_mean": _r(heads_mean, DIGITS), "dla_sd": _r(dla.std(-1), DIGITS),
        "dla_total": summary(total.mean(1)), "dla_heads": summary(dla.sum((0, 1))),
        "dla_rest": summary(parts["rest"][..., s].mean(-1).sum(0)),
        "dla_rest_by_layer": _r(parts["rest"][..., s].mean((1, 2)), DIGITS),
        "induction_heads": _names(induction), "top5_induction": _names(top5),
        "large_share_heads": _names(large), "top_dla": _names(top_dla[:10]),
        "heads": [head_row(h) for h in listed],
        "baseline": {"seed": baseline_seed, "draw": "torch.randint(0, vocab_size, (n_seq, 2 * half_len))",
                     "ln_vocab": round(math.log(v), DIGITS), "loss": summary(baseline),
                     "per_seq": _r(baseline), "repeated": summary(run["loss"]),
                     "difference": summary(baseline - run["loss"])},
        "ablation": {
            "means": {"n_seq": n_seq, "seed": mean_seed, "per_position": True},
            "control_seed": CONTROL_SEED,
            "conditions": {k: {"heads": _names(conditions[k]), "loss": summary(x),
                               "minus_none": summary(x - losses["none"]), "per_seq": _r(x)}
                           for k, x in losses.items()}},
    }


COPY_MIN = 0.01  # a copier: copying score (14.5) above 0.01 (a random circuit scores about 2e-5)


def copiers_entry(model: GPT, *, n_seq: int = SMOL_SEQ, half_len: int = SMOL_HALF, seed: int = SMOL_SEED,
                  n_controls: int = N_CONTROLS, cut: float = INDUCTION_CUT, control_max: float = CONTROL_MAX,
                  copying: list | None = None, log=print) -> dict:
    """``smollm2-copiers`` (module docstring) for ``model``: the copiers' ablations and the direct shares with the
    top five induction heads zeroed, on the sequences of ``smollm2-induction``, with per-sequence values."""
    v, n_heads = model.config.vocab_size, model.config.n_heads
    if copying is None:
        copying = json.loads(OUT.read_text())["measurements"]["smollm2-copying"]["copying"]
    copy_t = torch.tensor(copying)
    tokens = repeated_random_tokens(n_seq, half_len, v, torch.Generator().manual_seed(seed))
    run = clean_run(model, tokens)
    ind = torch.stack([sequence_induction_scores(p) for p in run["patterns"]]).mean(1)  # (L, H)
    top5 = [divmod(int(i), n_heads) for i in ind.flatten().topk(5).indices]
    copiers = [(la, h) for la in SOURCE_LAYERS for h in range(n_heads) if float(copy_t[la, h]) > COPY_MIN]
    top_copy = [divmod(int(i), n_heads) for i in copy_t.flatten().topk(5).indices]
    # controls: heads of the same layers that neither copy nor prefix-match
    neutral = {la: [h for h in range(n_heads) if float(copy_t[la, h]) <= COPY_MIN
                    and float(ind[la, h]) < min(control_max, cut)] for la in range(model.config.n_layers)}
    losses, conditions = {"none": run["loss"]}, {"none": []}
    for name, heads, offset in (("copiers_1718", copiers, 4), ("top5_copiers", top_copy, 5)):
        losses[name], conditions[name] = ablated_losses(model, run, tokens, heads), heads
        counts = {}
        for la, _ in heads:
            counts[la] = counts.get(la, 0) + 1
        for k, control in enumerate(_draw_controls(neutral, counts, n_controls, CONTROL_SEED + offset)):
            key = f"{name}_control{k}"
            losses[key], conditions[key] = ablated_losses(model, run, tokens, control), control
        log(f"{name} {float(losses[name].mean()):.3f}; controls " + ", ".join(
            f"{float(x.mean()):.2f}" for key, x in losses.items() if key.startswith(f"{name}_control")))

    # direct shares (the chapter's centred DLA, each sequence's mean over the repeat), intact and top five zeroed
    targets = torch.cat([tokens[:, 1:], tokens[:, :1]], dim=1)
    s = repeat_slice(tokens)

    def shares():
        parts = interp.direct_logit_attribution(model, tokens, targets, centred=True)
        total = parts["embedding"] + parts["heads"].sum((0, 1)) + parts["rest"].sum(0) + parts["bias"]
        return (parts["heads"][..., s].mean(-1), parts["rest"][..., s].mean(-1).sum(0),  # (L, H, batch), (batch,)
                total[:, s].mean(-1))

    heads_on, rest_on, total_on = shares()
    with interp.ablate_heads(model, top5):
        heads_off, rest_off, total_off = shares()
    mean_on = heads_on.mean(-1)
    large = [divmod(int(i), n_heads) for i in mean_on.abs().flatten().argsort(descending=True)
             if float(mean_on.abs().flatten()[i]) >= LARGE_SHARE]
    log(f"centred logit {float(total_on.mean()):.2f} -> {float(total_off.mean()):.2f} with the top five zeroed")
    return {
        "tokens": {"n_seq": n_seq, "half_len": half_len, "seed": seed, "as": "smollm2-induction"},
        "copy_min": COPY_MIN, "copiers_1718": _names(copiers), "top5_copiers": _names(top_copy),
        "top5_induction": _names(top5), "control_seeds": {"copiers_1718": CONTROL_SEED + 4,
                                                          "top5_copiers": CONTROL_SEED + 5},
        "ablation": {k: {"heads": _names(conditions[k]), "loss": summary(x), "minus_none": summary(x - losses["none"]),
                         "per_seq": _r(x)} for k, x in losses.items()},
        "top5_zeroed_dla": {
            "total": {"intact": summary(total_on), "zeroed": summary(total_off)},
            "heads_sum": {"intact": summary(heads_on.sum((0, 1))), "zeroed": summary(heads_off.sum((0, 1)))},
            "rest": {"intact": summary(rest_on), "zeroed": summary(rest_off)},
            "large_share_heads": _names(large),
            "heads": {f"{la}.{h}": {"intact": summary(heads_on[la, h]), "zeroed": summary(heads_off[la, h]),
                                    "change": summary(heads_off[la, h] - heads_on[la, h])} for la, h in large}},
    }


def two_tier_entry(model: GPT, *, n_seq: int = SMOL_SEQ, half_len: int = SMOL_HALF, seed: int = SMOL_SEED,
                   source_layers=SOURCE_LAYERS, targets=TWO_TIER_TARGETS, second_tier=LAYER23_PAIR,
                   copier=COPIER, paths=PATHS, n_controls: int = N_SOURCE_CONTROLS, cut: float = INDUCTION_CUT,
                   control_max: float = CONTROL_MAX, log=print) -> dict:
    """Item 4, ``smollm2-two-tier`` (module docstring): each target head's loss, induction score and direct share
    per sequence with the source heads' outputs removed from its query, key or value input
    (:func:`~groundup.interpretability.remove_from_inputs` with ``head``), beside random same-layer controls."""
    v, n_heads = model.config.vocab_size, model.config.n_heads
    tokens = repeated_random_tokens(n_seq, half_len, v, torch.Generator().manual_seed(seed))
    run = clean_run(model, tokens)
    ind = torch.stack([sequence_induction_scores(p) for p in run["patterns"]]).permute(0, 2, 1)  # (L, H, batch)
    ind_mean = ind.mean(-1)
    induction = induction_heads(ind_mean, cut)
    sources = [h for h in induction if h[0] in source_layers]
    if not sources:
        raise ValueError(f"no head of layers {source_layers} scores {cut} or more")
    second = [tuple(h) for h in second_tier]
    log(f"induction heads {_names(induction)}; sources {_names(sources)}")

    def pool(layers, exclude):
        return {layer: [h for h in range(n_heads)
                        if float(ind_mean[layer, h]) < min(control_max, cut) and (layer, h) not in exclude]
                for layer in layers}

    def counts(heads):
        found = {}
        for layer, _ in heads:
            found[layer] = found.get(layer, 0) + 1
        return found

    source_sets = {"induction": sources}
    for k, heads in enumerate(_draw_controls(pool(source_layers, sources), counts(sources), n_controls,
                                             CONTROL_SEED + 2)):
        source_sets[f"control{k}"] = heads
    second_sets = {"layer23": second}
    for k, heads in enumerate(_draw_controls(pool(counts(second), second), counts(second), n_controls,
                                             CONTROL_SEED + 3)):
        second_sets[f"layer23_control{k}"] = heads
    found = {}
    for target in [tuple(t) for t in targets]:
        layer, head = target
        final = run["stream"][-1]
        entry = {"baseline": {
            "loss": summary(run["loss"]), "loss_per_seq": _r(run["loss"]),
            "induction": summary(ind[layer, head]), "induction_per_seq": _r(ind[layer, head]),
            "dla": summary(head_direct_shares(model, final, tokens, layer, run["outputs"][layer])[:, head]),
            "dla_per_seq": _r(head_direct_shares(model, final, tokens, layer, run["outputs"][layer])[:, head]),
            "attention": {k: summary(x) for k, x in attention_profile(run["patterns"][layer][:, head]).items()}},
            "removals": {}}
        sets = {**source_sets, **(second_sets if target == tuple(copier) else {})}
        for set_name, heads in sets.items():
            if any(h[0] >= layer for h in heads):
                continue
            for path in paths:
                with interp.remove_from_inputs(model, heads, layer, path, head=head, outputs=run["outputs"]) as seen:
                    final = interp._run_from(model, run["stream"][layer], layer)
                loss = sequence_losses(model, final, tokens)
                score = sequence_induction_scores(seen["pattern"])
                share = head_direct_shares(model, final, tokens, (layer, head), seen["z"])
                entry["removals"][f"{set_name}/{path}"] = {
                    "sources": _names(heads), "path": path,
                    "loss": summary(loss), "loss_minus_baseline": summary(loss - run["loss"]),
                    "induction": summary(score), "induction_minus_baseline": summary(score - ind[layer, head]),
                    "dla": summary(share),
                    "attention": {k: summary(x) for k, x in attention_profile(seen["pattern"]).items()},
                    "loss_per_seq": _r(loss), "induction_per_seq": _r(score), "dla_per_seq": _r(share)}
            log(f"target {layer}.{head}, sources {set_name} {_names(heads)}: " + ", ".join(
                f"{p} loss {entry['removals'][f'{set_name}/{p}']['loss']['mean']:.2f} ind "
                f"{entry['removals'][f'{set_name}/{p}']['induction']['mean']:.2f}" for p in paths))
        found[f"{layer}.{head}"] = entry
    return {"tokens": {"n_seq": n_seq, "half_len": half_len, "seed": seed,
                       "draw": "repeated_random_tokens(n_seq, half_len, vocab_size, Generator().manual_seed(seed))"},
            "induction_cut": cut, "control_max": control_max, "induction_heads": _names(induction),
            "induction_mean": _r(ind.mean(-1), DIGITS),
            "sources": _names(sources), "second_tier": _names(second), "copier": f"{copier[0]}.{copier[1]}",
            "control_sets": {k: _names(h) for k, h in {**source_sets, **second_sets}.items()},
            "paths": list(paths), "targets": found}


# ---- name-swap patching


def name_pairs(n: int = IOI_PAIRS, seed: int = IOI_SEED, names=NAMES, first=IOI_FIRST) -> list[tuple[str, str]]:
    """``n`` ordered pairs ``(a, b)`` of different ``names``: ``first`` (the chapter's pair), then pairs drawn
    without replacement from the others by ``torch.randperm`` with a generator seeded ``seed``."""
    every = [(a, b) for a in names for b in names if a != b and (a, b) != tuple(first)]
    order = torch.randperm(len(every), generator=torch.Generator().manual_seed(seed))
    return [tuple(first)] + [every[int(i)] for i in order[:n - 1]]


def name_swap_prompts(tokenizer, pairs, template: str):
    """Token ids ``(clean, corrupted, answer, wrong)`` of ``template`` (``{io}``, ``{s}`` the names; ``{s2}`` the
    second mention of the subject) for every pair ``(io, s)``: clean with ``s2 = s`` (the answer is `` io``),
    corrupted with ``s2 = io`` (then `` s``). Every name must be one token (with its leading space) and every
    prompt as long as the others."""
    clean, corrupted, answer, wrong = [], [], [], []
    for io, s in pairs:
        for name in (io, s):
            if len(tokenizer.encode(" " + name)) != 1:
                raise ValueError(f"{name!r} is not one token (with its leading space)")
        clean.append(tokenizer.encode(template.format(io=io, s=s, s2=s)))
        corrupted.append(tokenizer.encode(template.format(io=io, s=s, s2=io)))
        answer.append(tokenizer.encode(" " + io)[0])
        wrong.append(tokenizer.encode(" " + s)[0])
    if len({len(x) for x in clean + corrupted}) != 1:
        raise ValueError("the prompts have different lengths")
    return torch.tensor(clean), torch.tensor(corrupted), torch.tensor(answer), torch.tensor(wrong)


def fraction_restored(ld: torch.Tensor, ld_source: torch.Tensor, ld_target: torch.Tensor) -> torch.Tensor:
    """(14.11) with the means over the examples (the last dimension), as residual_patching:
    ``(mean ld - mean ld_target) / (mean ld_source - mean ld_target)``."""
    return (ld.mean(-1) - ld_target.mean()) / (ld_source.mean() - ld_target.mean())


def _bootstrap_restored(ld, ld_source, ld_target, *, seed: int = BOOTSTRAP_SEED, draws: int = BOOTSTRAP_DRAWS):
    """A percentile bootstrap 95 % interval of :func:`fraction_restored`, resampling the examples (pairs)."""
    n = ld_source.numel()
    idx = torch.randint(n, (draws, n), generator=torch.Generator().manual_seed(seed))
    ld, src, tgt = ld.double(), ld_source.double(), ld_target.double()
    draws_ = (ld[..., idx].mean(-1) - tgt[idx].mean(-1)) / (src[idx].mean(-1) - tgt[idx].mean(-1))  # (.., draws)
    q = torch.quantile(draws_, torch.tensor([0.025, 0.975], dtype=torch.float64), dim=-1)
    return q.permute(*range(1, q.dim()), 0)


def name_swap_entry(model: GPT, tokenizer, *, pairs=None, templates=TEMPLATES, log=print) -> dict:
    """Item 5, ``smollm2-name-swap`` (module docstring)."""
    pairs = name_pairs() if pairs is None else [tuple(p) for p in pairs]
    found = {"pairs": [list(p) for p in pairs], "templates": dict(templates), "directions": {
        "denoising": "the clean run's vector patched into the corrupted run; fraction = (LD - LD_corrupted) / "
                     "(LD_clean - LD_corrupted): 1 = the clean answer restored",
        "noising": "the corrupted run's vector patched into the clean run; fraction = (LD - LD_clean) / "
                   "(LD_corrupted - LD_clean): 1 = the clean answer fully destroyed"}, "by_template": {}}
    pooled = {"denoising": [], "noising": []}
    for name, template in templates.items():
        clean, corrupted, answer, wrong = name_swap_prompts(tokenizer, pairs, template)
        words = [tokenizer.decode([t]) for t in clean[0].tolist()]
        t_entry = {"tokens_of_first_pair": words, "length": clean.shape[1]}
        for direction, (src, tgt) in (("denoising", (clean, corrupted)), ("noising", (corrupted, clean))):
            tick = time.perf_counter()
            out = interp.residual_patching(model, src, tgt, answer, wrong, per_example=True)
            positions = [int(p) for p in out["patched"].any(dim=0).nonzero().flatten()]  # changed at some entry
            res = {"positions": positions, "patched": out["patched"][:, positions], "ld": out["ld"][:, positions],
                   "ld_source": out["ld_clean"], "ld_target": out["ld_corrupted"]}
            pooled[direction].append(res)
            frac = fraction_restored(res["ld"], res["ld_source"], res["ld_target"])
            per_pair = out["restored"][:, positions]
            ci = _bootstrap_restored(res["ld"], res["ld_source"], res["ld_target"])
            t_entry[direction] = {
                "positions": res["positions"], "patched": res["patched"].tolist(),
                "fraction": _r(frac), "fraction_ci95": _r(ci), "per_pair_mean": _r(per_pair.mean(-1)),
                "per_pair_sd": _r(per_pair.std(-1)),
                "ld_source": summary(res["ld_source"]), "ld_target": summary(res["ld_target"]),
                "ld_source_per_pair": _r(res["ld_source"], 3), "ld_target_per_pair": _r(res["ld_target"], 3),
                "ld_per_pair": _r(res["ld"], 3)}
            log(f"{name} {direction}: {time.perf_counter() - tick:.0f} s; LD source "
                f"{float(res['ld_source'].mean()):+.2f}, target {float(res['ld_target'].mean()):+.2f}")
        clean_ld, corrupted_ld = t_entry["denoising"]["ld_source_per_pair"], t_entry["denoising"]["ld_target_per_pair"]
        t_entry["clean_right"] = sum(x > 0 for x in clean_ld) / len(clean_ld)
        t_entry["corrupted_flipped"] = sum(x < 0 for x in corrupted_ld) / len(corrupted_ld)
        found["by_template"][name] = t_entry
    found["pooled"] = {}
    for direction, results in pooled.items():
        if len({tuple(r["positions"]) for r in results}) != 1:
            continue
        ld = torch.cat([r["ld"] for r in results], dim=-1)
        src, tgt = torch.cat([r["ld_source"] for r in results]), torch.cat([r["ld_target"] for r in results])
        per_pair = (ld - tgt) / (src - tgt)
        found["pooled"][direction] = {"positions": results[0]["positions"], "n": src.numel(),
                                      "fraction": _r(fraction_restored(ld, src, tgt)),
                                      "fraction_ci95": _r(_bootstrap_restored(ld, src, tgt)),
                                      "per_pair_mean": _r(per_pair.mean(-1)), "per_pair_sd": _r(per_pair.std(-1)),
                                      "ld_source": summary(src), "ld_target": summary(tgt)}
    return found


def store(key: str, entry: dict, section: str = "runs", path: Path = OUT) -> None:
    """Add one entry to the JSON file ``path`` (several commands may run at once: see tools/results_file.py)."""
    add_entry(path, key, entry, section=section, header={
        "about": ("Induction-head runs for chapter 14 (one CPU thread each); see tools/ch14_results.py's docstring "
                  "for what is measured and the phase-change rule. Each entry says which command made it.")})


def measure_new(name: str, log=print) -> dict:
    """Make the entry ``name`` (one of ``NEW_ENTRIES``) on SmolLM2; returns it, machine and wall time included."""
    from groundup.pretrained import load_smollm2

    tick = time.perf_counter()
    model, tok = load_smollm2()
    model.eval()
    if name == "smollm2-induction":
        entry = induction_entry(model, log=log)
    elif name == "smollm2-two-tier":
        entry = two_tier_entry(model, log=log)
    elif name == "smollm2-copiers":
        entry = copiers_entry(model, log=log)
    else:
        entry = name_swap_entry(model, tok, log=log)
    return {"model": SMOLLM2, **entry, "machine": machine(), "wall_seconds": round(time.perf_counter() - tick, 1)}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seed", type=int, action="append", help="a seed (repeatable; default: 0, 1, 2)")
    p.add_argument("--entry", choices=ENTRIES + NEW_ENTRIES, action="append",
                   help="measure SmolLM2 or chapter 7's model instead of training (repeatable)")
    p.add_argument("--windows", action="store_true",
                   help="only recompute the stored runs' phase-change windows from their stored curves")
    p.add_argument("--out", type=Path, default=OUT,
                   help=f"the JSON file the entries go to (default: {OUT.relative_to(OUT.parents[3])}); e.g. a "
                        "temporary file, to compare a run with the stored one")
    args = p.parse_args(argv)
    new = [name for name in args.entry or [] if name in NEW_ENTRIES]
    if new:
        if len(new) != len(args.entry) or args.seed or args.windows:
            p.error(f"--entry {' / '.join(NEW_ENTRIES)} run under the notebooks' arithmetic, the other entries and "
                    "the seeds did not: run them in separate commands")
        on_notebook_arithmetic()  # starts this command again under it, unless the shell set it
        torch.set_num_threads(1)
        for name in new:
            entry = measure_new(name, log=lambda m: print(m, flush=True))
            entry = {"command": f"OMP_NUM_THREADS=1 python tools/ch14_results.py --entry {name}", **entry}
            store(name, entry, section="measurements", path=args.out)
            print(f"{name}: {entry['wall_seconds']} s", flush=True)
        return
    if args.windows:
        for key, pc in recompute_windows(args.out).items():
            print(f"{key}: {pc}")
        return
    torch.set_num_threads(1)
    if args.entry:
        for name in args.entry:
            entry = measure(name)
            entry = {"command": ("OMP_NUM_THREADS=1 MKL_CBWR=COMPATIBLE ATEN_CPU_CAPABILITY=default "
                                 f"python tools/ch14_results.py --entry {name}"), **entry}
            store(name, entry, section="measurements", path=args.out)
            print(f"{name}: {entry['wall_seconds']} s", {k: v for k, v in entry.items() if k != "hits"}, flush=True)
        return
    for seed in args.seed or [0, 1, 2]:
        if seed < 0:
            p.error(f"--seed must be a non-negative integer, got {seed}")
    for seed in args.seed or [0, 1, 2]:
        entry, _ = run_seed(seed)
        entry = {"command": f"OMP_NUM_THREADS=1 python tools/ch14_results.py --seed {seed}", **entry}
        store(f"seed{seed}", entry, path=args.out)
        pc, s = entry["phase_change"], entry["scores"]
        print(f"seed {seed}: {entry['wall_seconds']} s, phase change {pc}, prev-token {s['previous_token']}, "
              f"induction {s['induction']}, ablation {entry['ablation']}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
