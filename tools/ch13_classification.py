"""The classification runs behind chapter 13 (which play? real or word-shuffled?), stored in chapter13.json.

    E="OMP_NUM_THREADS=1"
    env $E python tools/ch13_classification.py --entry baselines                 # majority and n-gram (10 s)
    env $E python tools/ch13_classification.py --body gpt --method full --seed 0 # one fine-tune (2-3 minutes)
    env $E python tools/ch13_classification.py --entry rank --rank 4             # LoRA of rank 4 on the GPT
    env $E python tools/ch13_classification.py --entry all                       # everything (about 40 minutes)
    W="--task word-order"                                                         # real or word-shuffled?
    env $E python tools/ch13_classification.py $W --entry baselines --n-train 128  # majority, n-gram, LM score
    env $E python tools/ch13_classification.py $W --method full --seed 0 --n-train 128 --steps 60
    env $E python tools/ch13_classification.py $W --entry all                    # WORD_ORDER_PLAN, in order
    env $E python tools/ch13_classification.py $W --entry rank --skip-stored     # LoRA ranks 1-64, 128 labels
    env $E python tools/ch13_classification.py $W --n-train 128 --steps 60 --body mlm-bert --method probe
    env $E python tools/ch13_classification.py $W --n-train 128 --subset-seed 1 --steps 60 --method full --seed 0
    env $E python tools/ch13_classification.py --entry converged-probe --body gpt # which-play, converged probe
    env $E python tools/ch13_classification.py $W --entry tuned --method full     # lr and steps by held-out scenes

The tool runs under the notebooks' arithmetic (``nbval_lanes.ARITHMETIC``, set by the tool itself when the shell did
not), so ``chapter7_model()`` gives it the model the chapter's live cells get and a live run prints a stored seed's
numbers. Entries whose command starts with ``OLD_ENV`` ran before the tool did that, under MKL's compatible path
and PyTorch's default kernels only (the which-play runs, the masked LMs' runs and their chapter-7 bodies' baselines):
their chapter-7 model was another training of the same recipe, and their AdamW was PyTorch's per-tensor one (the
fine-tunes now use the fused kernel, whose square root is the same on every CPU), so their numbers are of the same
kind, not the same digits.

The task is :func:`groundup.classification.play_passages` with ``TASK``: 64-character passages of four plays, split
by scene. Three bodies:

- ``gpt``: chapter 7's GPT (``chapter7_model()``), the last position's final state (the only position of a causal
  model that has read the whole passage). ``gpt-mean``: the same body, the mean of the states over all positions
  (each position has read only the passage up to itself), for contrast.
- ``mlm-bert`` / ``mlm-mask``: chapter 9's masked LM pretrained for ``MLM_STEPS`` steps with the 80/10/10 rule or
  with always-[MASK], built exactly as ``tools/ch09_results.py`` builds them (pretraining seed = the entry's seed;
  cached under the data cache's ``models/`` folder, never committed; its final validation loss is stored next to
  chapter09.json's entry for the same run). The mean of the final states over all positions: the model has no
  [CLS] token that pretraining shaped into a summary, and every position has seen its whole 32-character window
  (a passage is two windows, each encoded on its own).

Four methods (:func:`groundup.classification.classifier_for`): ``scratch``, ``probe``, ``full``, ``lora`` (rank 8
adapters on W_q, W_k, W_v, W_o), each trained by :func:`groundup.classification.fine_tune` with ``FINETUNE`` and
the method's learning rate ``LR``. Every entry stores its command, configuration, test accuracy and loss, the
training curve, and the body's language-model loss on held-out text before and after (catastrophic forgetting).
The ``gpt/full/seed0`` run also stores the singular values of its weight update (``lowrank/gpt/full/seed0``).
``--entry rank`` (which-play) stored ``lora_rank/gpt/r{1,32}/seed0``: LoRA of rank 1 and 32 on which-play, kept as
the record of that task's first rank comparison (both constant predictors like every which-play fine-tune).

``--task word-order`` (keys ``word-order/...``): the same passages and split, relabelled by
:func:`groundup.classification.word_order_task` (every second passage has its words shuffled: real or shuffled?).
``--n-train N`` trains every method on one balanced, seeded subset of N training passages
(:func:`groundup.classification.balanced_subset`, seed ``SUBSET_SEED``, the same for all methods and seeds);
``--steps`` sets the fine-tuning steps; ``--subset-seed k`` draws the subset with seed k instead (keys
``word-order/<body>/<method>/n<N>-subset<k>/seed<s>``: does the comparison hold for another draw of the labels?).
``--body mlm-bert`` / ``mlm-mask`` put chapter 9's masked LMs (pretraining seed = the run's seed) on the task.
There the probe is a logistic regression on the frozen body's states
fitted to convergence, its l2 chosen on held-out training scenes (:func:`groundup.classification.fit_probe`), and
the baselines add the "LM score": a logistic regression on one feature, the GPT's mean next-character loss on the
passage (:func:`groundup.classification.lm_scores`). ``--task word-order --entry rank`` trains LoRA of every rank
of ``WORD_ORDER_RANKS`` (alpha fixed at ``LORA["alpha"]``, so the scale alpha/r falls as r grows) on
``RANK_SWEEP``'s labels and steps, seeds 0-2 (keys ``word-order/lora-rank/n<N>/r<r>/seed<s>``; rank 8 is the stored
``word-order/gpt/lora/...`` run), and stores their summary ``word-order/lora-rank/n<N>/summary``.

``--task word-order --entry tuned --method M`` (M = ``full`` or ``lora``; about 12 minutes each): the learning rate
and the number of steps chosen on held-out scenes, as the probe's l2 is. The 128 labels of ``RANK_SWEEP`` are cut
into the probe's 4 folds of whole scenes (:func:`groundup.classification.scene_folds`, seed 0); for every learning
rate of ``TUNED["lr_grid"][M]`` the method is trained on three folds for ``TUNED["max_steps"]`` steps (fine-tuning
seed 0) and its accuracy on the fourth read every ``TUNED["every"]`` steps; the (learning rate, step) with the most
held-out passages right, pooled over the folds (ties: fewer steps, then the smaller rate), is the choice. Each seed
of ``TUNED["seeds"]`` then trains on all 128 labels with that rate and the same ``max_steps`` schedule and stops at
that step (early stopping at the chosen step). Keys ``word-order-tuned/gpt/<M>/n128``; each stores the held-out
table, the choice, and per seed the test accuracy with its 95 % Wilson interval and which of the 1,795 test
passages it got right (``correct``, a string of 0 and 1), as does ``word-order-tuned/gpt/probe/n128`` for the probe
(fitted as in ``word-order/gpt/probe/n128/seed*``), so any two can be compared passage by passage (McNemar).

``--entry converged-probe`` (which-play): the diagnostic that made us change task. The probe of the which-play
entries is trained by 150 AdamW steps; this one is the word-order probe (a logistic regression on the frozen
states, fitted to convergence, l2 chosen on held-out training scenes) on the which-play task, all 4,733 training
passages, keys ``classification-converged-probe/<body>/seed<s>``: is the best linear read-out of these bodies'
states better than the n-gram baseline?
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from results_file import NOTEBOOK_ARITHMETIC, add_entry, on_notebook_arithmetic

from groundup.classification import (
    ATTENTION_PROJECTIONS,
    DEFAULT_PLAYS,
    METHODS,
    PROBE_L2,
    accuracy_and_loss,
    balanced_subset,
    classifier_for,
    cross_validate_l2,
    encode_passages,
    fine_tune,
    fit_logistic_regression,
    fit_probe,
    fit_standardised_logistic_regression,
    lm_scores,
    majority_accuracy,
    ngram_baseline,
    play_passages,
    predict,
    scene_folds,
    word_order_task,
)
from groundup.data import load_corpus, train_val_split
from groundup.lora import count_parameters, merge_lora

OUT = Path(__file__).resolve().parents[1] / "src" / "groundup" / "results" / "chapter13.json"
ENV = "OMP_NUM_THREADS=1"
"""How a command is run; the tool sets the notebooks' arithmetic itself (``results_file.on_notebook_arithmetic``)."""
OLD_ENV = "MKL_CBWR=COMPATIBLE ATEN_CPU_CAPABILITY=default OMP_NUM_THREADS=1"
"""How the entries made before the tool set the notebooks' whole arithmetic were run (their commands start so)."""
ENVIRONMENT = ("OMP_NUM_THREADS", *NOTEBOOK_ARITHMETIC)
TASK = dict(passage_chars=64, test_fraction=0.25, seed=0)
FINETUNE = dict(steps=150, batch_size=32, warmup=10, weight_decay=0.0)
LR = {"scratch": 1e-3, "probe": 1e-2, "full": 3e-4, "lora": 2e-3}
LORA = dict(r=8, alpha=16.0, targets=list(ATTENTION_PROJECTIONS))
NGRAM = dict(orders=[1, 2, 3], max_features=2000, l2=1e-3)
BODIES = ("gpt", "gpt-mean", "mlm-bert", "mlm-mask")
MLM_STEPS = 600
TRAIN_SUBSET = 512  # training accuracy on this many fixed training passages (all of them would cost 40 s a run)
LM_EVAL = dict(batch_size=16, max_batches=16)  # the GPT's held-out loss: 256 windows of 64 characters
MLM_EVAL = dict(batch_size=64, max_batches=10)  # the masked LM's: as its training's evaluation
RANKS = (1, 32)
ENERGY_RANKS = (1, 2, 4, 8, 16)
TOP_SINGULAR = 32
TASKS = ("play", "word-order")
WORD_ORDER_SEED = 0  # word_order_task's shuffle seed
SUBSET_SEED = 0  # balanced_subset's seed for --n-train: one subset for every method and seed
PROBE = dict(l2_grid=list(PROBE_L2), folds=4)  # word-order probe: l2 by held-out scenes
NGRAM_CV_MAX = 1024  # up to this many training passages the n-gram baseline's l2 is also chosen on held-out scenes
LM_SCORE_L2 = 1e-3  # the one-feature LM-score baseline's l2 (standardised feature), as the n-gram's
WORD_ORDER_PLAN = ((128, 60, (0, 1, 2)), (None, 150, (0,)), (None, 150, (1, 2)))  # (n_train, steps, seeds), in order
WORD_ORDER_RANKS = (1, 2, 4, 8, 16, 32, 64)  # --task word-order --entry rank
RANK_SWEEP = dict(n_train=128, steps=60)  # its defaults: the 128-label runs of WORD_ORDER_PLAN
TUNED = dict(n_train=128, max_steps=120, every=10, folds=4, fold_seed=0, seeds=(0, 1, 2),
             lr_grid={"full": (1e-4, 3e-4, 1e-3), "lora": (7e-4, 2e-3, 6e-3)})
"""--entry tuned: each grid spans a factor of 10 around the method's ``LR``."""


def sig(x: float, digits: int = 5) -> float:
    """``x`` rounded to ``digits`` significant digits."""
    return float(f"{x:.{digits}g}")


def command(*args: str) -> str:
    return f"{ENV} python tools/ch13_classification.py " + " ".join(args)


# ---- bodies --------------------------------------------------------------------------------------------------

def gpt_body():
    """Chapter 7's GPT, its tokenizer, and its held-out loss function (chapter 7's validation text)."""
    from groundup.training import chapter7_model, evaluate

    model, tokenizer = chapter7_model()
    val_ids = train_val_split(torch.tensor(tokenizer.encode(load_corpus("shakespeare"))), 0.1)[1]
    held_out = "next-character loss (nats) on 256 windows of 64 characters of chapter 7's validation text"
    return model, tokenizer, lambda m: evaluate(m, val_ids, **LM_EVAL), held_out, None


def mlm_body(variant: str, seed: int):
    """Chapter 9's masked LM of ``variant`` ("bert" or "mask") after MLM_STEPS steps, pretraining seed ``seed``."""
    import ch09_results

    from groundup.data import corpus_cache_dir
    from groundup.masking import masked_lm_batches
    from groundup.models import MaskedLM, MaskedLMConfig
    from groundup.training import evaluate, train

    tokenizer, train_ids, val_ids = ch09_results.data()
    n_v = tokenizer.vocab_size
    _, mask_fraction, random_fraction = ch09_results.VARIANTS[variant]
    batches = masked_lm_batches(n_v, n_v + 1, mask_fraction=mask_fraction, random_fraction=random_fraction)
    torch.manual_seed(seed)
    model = MaskedLM(MaskedLMConfig(vocab_size=n_v + 1, **ch09_results.MLM_SHAPE))
    path = corpus_cache_dir() / "models" / f"ch13_mlm_{variant}_steps{MLM_STEPS}_seed{seed}.pt"
    if path.is_file():
        cached = torch.load(path, weights_only=True)
        model.load_state_dict(cached["model"])
        val_loss = cached["val_loss"]
    else:
        history = train(model, train_ids, val_ids, ch09_results.mlm_training(MLM_STEPS, seed), batches=batches)
        val_loss = history.val_loss[-1]
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"model": model.state_dict(), "val_loss": val_loss}, path)
    model.eval()
    stored = json.loads(ch09_results.OUT.read_text())["runs"].get(f"mlm/{variant}/steps{MLM_STEPS}/seed{seed}", {})
    pretrain = {"variant": ch09_results.VARIANTS[variant][0], "steps": MLM_STEPS, "seed": seed,
                "val_loss": sig(val_loss), "ch09_stored_val_loss": stored.get("val_loss")}
    held_out = (f"masked-LM loss (nats) of its own masking ({pretrain['variant']}) on 10 batches of 64 windows of "
                "32 characters of chapter 9's validation text, as its pretraining evaluated it")
    return model, tokenizer, lambda m: evaluate(m, val_ids, batches=batches, **MLM_EVAL), held_out, pretrain


def load_body(body: str, seed: int):
    if body in ("gpt", "gpt-mean"):
        return gpt_body()
    return mlm_body(body.removeprefix("mlm-"), seed)


# ---- one fine-tune -------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=2)
def task(name: str = "play"):
    """``(train, test)`` passages of ``TASK``: which play (``"play"``) or real vs word-shuffled (``"word-order"``)."""
    train, test = play_passages(DEFAULT_PLAYS, **TASK)
    if name == "word-order":
        return word_order_task(train, seed=WORD_ORDER_SEED), word_order_task(test, seed=WORD_ORDER_SEED)
    if name != "play":
        raise ValueError(f"task must be one of {TASKS}, got {name!r}")
    return train, test


def training_set(train, n_train: int | None, subset_seed: int = SUBSET_SEED):
    """All training passages, or the balanced subset of ``n_train`` of them (seed ``subset_seed``)."""
    return train if n_train is None else train.select(balanced_subset(train.labels, n_train, seed=subset_seed))


def task_config(name: str, available: int, train, subset_seed: int = SUBSET_SEED) -> dict:
    """What a word-order entry adds to its config: the task, and which training passages it used."""
    if name == "play":
        return {}
    return {"task": name, "shuffle_seed": WORD_ORDER_SEED, "n_available": available, "subset_seed": subset_seed,
            "train_counts": train.counts()}


def lowrank_spectra(before: dict, after: dict) -> dict:
    """Singular values of ``after[name] - before[name]`` for the attention and feed-forward weight matrices."""
    matrices = {}
    for name, w0 in before.items():
        if w0.dim() != 2 or name.rsplit(".", 2)[-2] not in ("W_q", "W_k", "W_v", "W_o", "W_in", "W_out", "W_gate"):
            continue
        dw = (after[name].double() - w0.double())
        s = torch.linalg.svdvals(dw)
        energy = (s ** 2).cumsum(0) / (s ** 2).sum()
        matrices[name.removesuffix(".weight")] = {
            "shape": list(dw.shape), "dW_fro": sig(dw.norm().item()), "W_fro": sig(w0.double().norm().item()),
            "singular_values": [sig(v) for v in (s[:TOP_SINGULAR] / s[0]).tolist()],
            "energy_top_r": {str(r): sig(energy[r - 1].item()) for r in ENERGY_RANKS}}
    kinds = {"attention": ("W_q", "W_k", "W_v", "W_o"), "ffn": ("W_in", "W_out", "W_gate")}
    mean = {kind: {str(r): sig(statistics.fmean(m["energy_top_r"][str(r)] for n, m in matrices.items()
                                                 if n.rsplit(".", 1)[-1] in names))
                   for r in ENERGY_RANKS}
            for kind, names in kinds.items() if any(n.rsplit(".", 1)[-1] in names for n in matrices)}
    reference = {}
    g = torch.Generator().manual_seed(0)
    for shape in sorted({tuple(m["shape"]) for m in matrices.values()}):
        s = torch.linalg.svdvals(torch.randn(*shape, generator=g, dtype=torch.float64))
        energy = (s ** 2).cumsum(0) / (s ** 2).sum()
        reference[f"{shape[0]}x{shape[1]}"] = {str(r): sig(energy[r - 1].item()) for r in ENERGY_RANKS}
    return {"matrices": matrices, "mean_energy_top_r": mean, "random_reference_energy_top_r": reference}


def run_classifier(body_name: str, method: str, seed: int, *, rank: int = LORA["r"], task_name: str = "play",
                   n_train: int | None = None, steps: int | None = None,
                   converged: bool = False, subset_seed: int = SUBSET_SEED) -> tuple[dict, dict | None]:
    """One fine-tune: its entry, and (for gpt/full) the low-rank analysis of its update.

    ``task_name="word-order"``: ``n_train`` passages (all if None), ``steps`` (``FINETUNE``'s if None), and the
    probe fitted to convergence by :func:`groundup.classification.fit_probe` instead of AdamW steps (on which-play
    too with ``converged=True``); ``subset_seed`` draws the ``n_train`` passages."""
    start = time.perf_counter()
    body, tokenizer, lm_loss, held_out, pretrain = load_body(body_name, seed)
    train, test = task(task_name)
    available = len(train)
    train = training_set(train, n_train, subset_seed)
    finetune = {**FINETUNE, "steps": steps or FINETUNE["steps"], "batch_size": min(FINETUNE["batch_size"], len(train))}
    ids, _, labels = encode_passages(train, tokenizer)
    test_ids, _, test_labels = encode_passages(test, tokenizer)
    before = None if method == "scratch" else lm_loss(body)
    weights = {k: v.clone() for k, v in body.state_dict().items()}
    head = classifier_for(body, len(train.classes), method, seed=seed, lora_rank=rank, lora_alpha=LORA["alpha"],
                          lora_targets=LORA["targets"], pooling="mean" if body_name == "gpt-mean" else None)
    config = {**finetune, "lr": LR[method], "optimizer": "AdamW", "passage_chars": TASK["passage_chars"],
              "n_train": len(train), "n_test": len(test), "pooling": head.pooling,
              "lora": {**LORA, "r": rank} if method == "lora" else None,
              "body_source": "chapter7_model()" if body_name.startswith("gpt") else
              f"tools/ch09_results.py's MaskedLM, {pretrain['variant']}, {MLM_STEPS} steps, seed {seed}",
              **task_config(task_name, available, train, subset_seed)}
    if method == "probe" and (task_name == "word-order" or converged):
        t0 = time.perf_counter()
        probe = fit_probe(head, ids, labels, train.sections, seed=seed, **PROBE)
        config = {k: v for k, v in config.items() if k not in (*FINETUNE, "lr")}
        config.update(optimizer="L-BFGS to convergence (fit_probe), standardised features",
                      probe={**probe, "held_out_loss": [sig(v) for v in probe["held_out_loss"]],
                             "held_out_accuracy": [sig(v) for v in probe["held_out_accuracy"]]})
        curve, train_seconds = None, round(time.perf_counter() - t0, 1)
    else:
        history = fine_tune(head, ids, labels, steps=finetune["steps"], batch_size=finetune["batch_size"],
                            lr=LR[method], warmup=finetune["warmup"], weight_decay=finetune["weight_decay"],
                            seed=seed)
        curve = {"step": history.step, "train_loss": [sig(v) for v in history.train_loss]}
        train_seconds = round(history.seconds, 1)
    accuracy, loss = accuracy_and_loss(head, test_ids, test_labels)
    subset = torch.randperm(len(ids), generator=torch.Generator().manual_seed(0))[:TRAIN_SUBSET]
    train_accuracy, _ = accuracy_and_loss(head, ids[subset], labels[subset])
    lm = None
    if method != "scratch":
        lm = {"held_out": held_out, "before": sig(before), "after": sig(lm_loss(head.body))}
        if method == "lora":
            merge_lora(head.body)
            lm["after_merged"] = sig(lm_loss(head.body))
    entry = {"body": body_name, "method": method, "seed": seed, "config": config, "pretrain": pretrain,
             "trainable_params": count_parameters(head, trainable_only=True), "total_params": count_parameters(head),
             "test_accuracy": sig(accuracy), "test_loss": sig(loss),
             "train_accuracy": sig(train_accuracy), "train_accuracy_passages": len(subset),
             "curve": curve, "lm_loss": lm, "train_seconds": train_seconds}
    low = None
    if body_name == "gpt" and method == "full":
        low = lowrank_spectra(weights, head.body.state_dict())
    entry["wall_seconds"] = round(time.perf_counter() - start, 1)
    return entry, low


def run_word_order_baselines(n_train: int | None = None) -> dict:
    """Majority, n-gram and LM-score baselines of the word-order task, trained on ``n_train`` passages."""
    train, test = task("word-order")
    available = len(train)
    train = training_set(train, n_train)
    ngram_settings = {k: tuple(v) if isinstance(v, list) else v for k, v in NGRAM.items()}
    ngram = ngram_baseline(train, test, **ngram_settings)
    ngram_cv = None
    if len(train) <= NGRAM_CV_MAX:  # the same choice of l2 the probe gets (all labels: ~25 fits of 4733 x 2000)
        cv = cross_validate_l2(ngram.features(train.texts), torch.tensor(train.labels), 2, train.sections,
                               fit=fit_logistic_regression, seed=0, **PROBE)
        refit = ngram_baseline(train, test, **{**ngram_settings, "l2": cv["l2"]})
        ngram_cv = {"accuracy": sig(refit.accuracy), "l2": cv["l2"], "l2_grid": cv["l2_grid"], "folds": cv["folds"],
                    "held_out_loss": [sig(v) for v in cv["held_out_loss"]],
                    "held_out_accuracy": [sig(v) for v in cv["held_out_accuracy"]]}
    gpt, tokenizer, *_ = load_body("gpt", 0)
    scores = {name: lm_scores(gpt, encode_passages(p, tokenizer)[0]) for name, p in (("train", train), ("test", test))}
    y, test_y = torch.tensor(train.labels), torch.tensor(test.labels)
    w, b = fit_standardised_logistic_regression(scores["train"][:, None], y, 2, l2=LM_SCORE_L2)
    lm_accuracy = ((scores["test"][:, None] @ w.T + b).argmax(1) == test_y).double().mean().item()
    means = {name: {c: sig(s[(torch.tensor(p.labels) == i)].mean().item()) for i, c in enumerate(p.classes)}
             for name, s, p in (("train", scores["train"], train), ("test", scores["test"], test))}
    return {"task": {"task": "word-order", "plays": list(DEFAULT_PLAYS), "passage_chars": TASK["passage_chars"],
                     "test_fraction": TASK["test_fraction"], "split_seed": TASK["seed"],
                     "shuffle_seed": WORD_ORDER_SEED, "n_available": available, "subset_seed": SUBSET_SEED,
                     "n_train": len(train), "n_test": len(test), "train_counts": train.counts(),
                     "test_counts": test.counts()},
            "majority_accuracy": sig(majority_accuracy(train, test)), "ngram_accuracy": sig(ngram.accuracy),
            "ngram": NGRAM, "ngram_l2_by_held_out_scenes": ngram_cv, "lm_score_accuracy": sig(lm_accuracy),
            "lm_score": {"feature": "chapter7_model()'s mean next-character loss (nats) on the passage's 63 "
                                    "predicted characters", "l2": LM_SCORE_L2, "mean_score": means,
                         "threshold": sig((-(b[1] - b[0]) / (w[1, 0] - w[0, 0])).item())}}


def run_baselines() -> dict:
    train, test = task()
    ngram = ngram_baseline(train, test, **{k: tuple(v) if isinstance(v, list) else v for k, v in NGRAM.items()})
    return {"task": {"plays": list(DEFAULT_PLAYS), "passage_chars": TASK["passage_chars"],
                     "test_fraction": TASK["test_fraction"], "split_seed": TASK["seed"], "n_train": len(train),
                     "n_test": len(test), "train_counts": train.counts(), "test_counts": test.counts()},
            "majority_accuracy": sig(majority_accuracy(train, test)), "ngram_accuracy": sig(ngram.accuracy),
            "ngram": NGRAM}


# ---- storing ---------------------------------------------------------------------------------------------------

def store(key: str, entry: dict) -> None:
    add_entry(OUT, key, entry, header={
        "about": ("Runs for chapter 13: SmolLM2-135M-Instruct on the dates task (tools/ch13_results.py) and the "
                  "classifiers on the which-play and word-order (real or shuffled?) tasks "
                  "(tools/ch13_classification.py); each entry says which command made it.")})


def summary(runs: dict) -> dict:
    """Mean and sample standard deviation over the seeds of every (body, method) with classification entries."""
    groups: dict[str, list[dict]] = {}
    for key, entry in sorted(runs.items()):
        parts = key.split("/")
        if parts[0] == "classification" and len(parts) == 4:
            groups.setdefault(f"{parts[1]}/{parts[2]}", []).append(entry)
    out = {}
    for name, entries in groups.items():
        accs = [e["test_accuracy"] for e in entries]
        after = [e["lm_loss"]["after"] for e in entries if e["lm_loss"]]
        out[name] = {"seeds": [e["seed"] for e in entries], "test_accuracy": accs, "mean": sig(statistics.fmean(accs)),
                     "std": sig(statistics.stdev(accs)) if len(accs) > 1 else None,
                     "lm_loss_before": [e["lm_loss"]["before"] for e in entries] if after else None,
                     "lm_loss_after_mean": sig(statistics.fmean(after)) if after else None}
    base = runs.get("classification/baselines", {})
    out["majority_accuracy"], out["ngram_accuracy"] = base.get("majority_accuracy"), base.get("ngram_accuracy")
    return out


def store_summary() -> None:
    runs = json.loads(OUT.read_text())["runs"]
    store("classification/summary", {"command": command("--entry summary"), **summary(runs)})


def word_order_summary(runs: dict) -> dict:
    """Mean and sample standard deviation over the seeds of every word-order (body, method, n_train), and the
    baselines of every n_train, from the ``word-order/...`` entries of ``runs``."""
    groups: dict[str, list[dict]] = {}
    baselines = {}
    for key, entry in sorted(runs.items()):
        parts = key.split("/")
        if parts[0] == "word-order" and len(parts) == 5 and parts[4].startswith("seed") and parts[1] != "lora-rank":
            groups.setdefault("/".join(parts[1:4]), []).append(entry)
        elif parts[0] == "word-order" and len(parts) == 3 and parts[1] == "baselines":
            baselines[parts[2]] = {k: entry[k] for k in ("majority_accuracy", "ngram_accuracy", "lm_score_accuracy")}
    out = {}
    for name, entries in sorted(groups.items(), key=lambda item: item[0]):
        accs = [e["test_accuracy"] for e in entries]
        after = [e["lm_loss"]["after"] for e in entries if e["lm_loss"]]
        out[name] = {"seeds": [e["seed"] for e in entries], "test_accuracy": accs, "mean": sig(statistics.fmean(accs)),
                     "std": sig(statistics.stdev(accs)) if len(accs) > 1 else None,
                     "steps": sorted({e["config"].get("steps") for e in entries}, key=str),
                     "lm_loss_before": [e["lm_loss"]["before"] for e in entries] if after else None,
                     "lm_loss_after_mean": sig(statistics.fmean(after)) if after else None}
    out["baselines"] = baselines
    return out


def store_word_order_summary() -> None:
    runs = json.loads(OUT.read_text())["runs"]
    store("word-order/summary", {"command": command("--task word-order --entry summary"), **word_order_summary(runs)})


def environment() -> dict:
    return {"threads": torch.get_num_threads(), "environment": {k: os.environ.get(k) for k in ENVIRONMENT}}


def classify(body: str, method: str, seed: int) -> None:
    entry, low = run_classifier(body, method, seed)
    key = f"classification/{body}/{method}/seed{seed}"
    cmd = command(f"--body {body} --method {method} --seed {seed}")
    store(key, {"command": cmd, **entry, **environment()})
    if low is not None:
        store(f"lowrank/{body}/{method}/seed{seed}", {"command": cmd, "source": key, **low})
    store_summary()
    print(key, entry["test_accuracy"], entry["lm_loss"], entry["wall_seconds"], "s", flush=True)


def n_name(n_train: int | None, subset_seed: int = SUBSET_SEED) -> str:
    """``n<N>``, or ``n<N>-subset<k>`` for a subset drawn with another seed than ``SUBSET_SEED``."""
    name = f"n{len(task('word-order')[0]) if n_train is None else n_train}"
    return name if subset_seed == SUBSET_SEED else f"{name}-subset{subset_seed}"


def word_order_args(n_train: int | None, steps: int | None, subset_seed: int = SUBSET_SEED) -> str:
    return ("--task word-order" + (f" --n-train {n_train}" if n_train else "")
            + (f" --subset-seed {subset_seed}" if subset_seed != SUBSET_SEED else "")
            + (f" --steps {steps}" if steps else ""))


def word_order_baselines(n_train: int | None) -> None:
    entry = run_word_order_baselines(n_train)
    cmd = command(f"{word_order_args(n_train, None)} --entry baselines")
    store(f"word-order/baselines/{n_name(n_train)}", {"command": cmd, **entry})
    store_word_order_summary()
    print(f"word-order/baselines/{n_name(n_train)}", entry["majority_accuracy"], entry["ngram_accuracy"],
          entry["lm_score_accuracy"], flush=True)


def word_order_classify(body: str, method: str, seed: int, n_train: int | None, steps: int | None,
                        subset_seed: int = SUBSET_SEED) -> None:
    steps = None if steps == FINETUNE["steps"] else steps
    entry, low = run_classifier(body, method, seed, task_name="word-order", n_train=n_train, steps=steps,
                                subset_seed=subset_seed)
    key = f"word-order/{body}/{method}/{n_name(n_train, subset_seed)}/seed{seed}"
    cmd = command(f"{word_order_args(n_train, steps, subset_seed)} --body {body} --method {method} --seed {seed}")
    store(key, {"command": cmd, **entry, **environment()})
    if low is not None:
        low_key = f"word-order-lowrank/{body}/{method}/{n_name(n_train, subset_seed)}/seed{seed}"
        store(low_key, {"command": cmd, "source": key, **low})
    store_word_order_summary()
    print(key, entry["test_accuracy"], entry["lm_loss"] and entry["lm_loss"]["after"], entry["wall_seconds"], "s",
          flush=True)


class _StopTraining(Exception):
    """Raised by the early-stopping callback at the chosen step."""


def correct_string(head, ids: torch.Tensor, labels: torch.Tensor) -> str:
    """Which rows of ``ids`` ``head`` classifies right, as a string of 0 and 1 (row order)."""
    return "".join("1" if c else "0" for c in (predict(head, ids) == labels).tolist())


def test_record(correct: str) -> dict:
    from groundup.significance import wilson_interval

    right, n = correct.count("1"), len(correct)
    return {"test_accuracy": sig(right / n), "correct_count": right, "n_test": n,
            "interval": [round(v, 5) for v in wilson_interval(right, n)], "correct": correct}


def run_tuned(method: str) -> dict:
    """``--entry tuned``: ``method``'s learning rate and steps chosen on held-out scenes, then its seeds."""
    import copy

    start = time.perf_counter()
    body, tokenizer, *_ = load_body("gpt", 0)
    train, test = task("word-order")
    train = training_set(train, TUNED["n_train"])
    ids, _, labels = encode_passages(train, tokenizer)
    test_ids, _, test_labels = encode_passages(test, tokenizer)
    n_classes = len(train.classes)
    if method == "probe":
        seeds = {}
        for seed in TUNED["seeds"]:
            head = classifier_for(copy.deepcopy(body), n_classes, "probe", seed=seed)
            probe = fit_probe(head, ids, labels, train.sections, seed=seed, **PROBE)
            seeds[str(seed)] = {"l2": probe["l2"], **test_record(correct_string(head, test_ids, test_labels))}
        return {"method": method, "n_train": len(train), "probe": PROBE, "seeds": seeds,
                "wall_seconds": round(time.perf_counter() - start, 1)}
    fold = torch.tensor(scene_folds(train.sections, TUNED["folds"], seed=TUNED["fold_seed"]))
    checkpoints = list(range(TUNED["every"], TUNED["max_steps"] + 1, TUNED["every"]))
    batch = min(FINETUNE["batch_size"], int((fold != 0).sum()))
    settings = dict(batch_size=batch, warmup=FINETUNE["warmup"], weight_decay=FINETUNE["weight_decay"])
    lora = dict(lora_rank=LORA["r"], lora_alpha=LORA["alpha"], lora_targets=LORA["targets"])
    table = {}
    for lr in TUNED["lr_grid"][method]:
        right = [0] * len(checkpoints)
        for f in range(TUNED["folds"]):
            held, kept = fold == f, fold != f

            def read(step, head, held=held, right=right):
                if step % TUNED["every"] == 0:
                    right[step // TUNED["every"] - 1] += int((predict(head, ids[held]) == labels[held]).sum())

            head = classifier_for(copy.deepcopy(body), n_classes, method, seed=0, **lora)
            fine_tune(head, ids[kept], labels[kept], steps=TUNED["max_steps"], lr=lr, seed=0, callback=read,
                      **settings)
        table[str(lr)] = [sig(r / len(ids)) for r in right]
        print(f"tuned {method} lr {lr}: held-out accuracy by step {table[str(lr)]}", flush=True)
    best = max(((a, -checkpoints[i], -lr) for lr in TUNED["lr_grid"][method]
                for i, a in enumerate(table[str(lr)])))
    chosen_lr, chosen_step = -best[2], -best[1]
    seeds = {}
    for seed in TUNED["seeds"]:
        head = classifier_for(copy.deepcopy(body), n_classes, method, seed=seed, **lora)

        def stop(step, head):
            if step == chosen_step:
                raise _StopTraining

        try:
            fine_tune(head, ids, labels, steps=TUNED["max_steps"], lr=chosen_lr, seed=seed, callback=stop,
                      **dict(settings, batch_size=min(FINETUNE["batch_size"], len(ids))))
        except _StopTraining:
            pass
        seeds[str(seed)] = test_record(correct_string(head, test_ids, test_labels))
        print(f"tuned {method} seed {seed}: {seeds[str(seed)]['test_accuracy']}", flush=True)
    return {"method": method, "n_train": len(train), "tuned": {k: (list(v) if isinstance(v, tuple) else v)
                                                                 for k, v in TUNED.items() if k != "lr_grid"},
            "lr_grid": list(TUNED["lr_grid"][method]), "steps_read": checkpoints, "held_out_accuracy": table,
            "chosen": {"lr": chosen_lr, "steps": chosen_step, "held_out_accuracy": best[0]},
            "finetune": {**settings, "optimizer": "AdamW", "schedule": f"warm-up then cosine over {TUNED['max_steps']}"
                         " steps, stopped at the chosen step"},
            "lora": LORA if method == "lora" else None, "seeds": seeds,
            "wall_seconds": round(time.perf_counter() - start, 1)}


def rank_key(r: int, seed: int, n_train: int) -> str:
    return f"word-order/lora-rank/n{n_train}/r{r}/seed{seed}"


def rank_sources(runs: dict, r: int, n_train: int, steps: int) -> list[str]:
    """The stored keys of rank ``r``'s seeds: the sweep's own, or (for LORA's rank) the plan's LoRA runs."""
    own = sorted(k for k in runs if k.startswith(f"word-order/lora-rank/n{n_train}/r{r}/seed"))
    if own or r != LORA["r"]:
        return own
    plan = sorted(k for k in runs if k.startswith(f"word-order/gpt/lora/n{n_train}/seed"))
    return [k for k in plan if runs[k]["config"]["steps"] == steps]


def lora_rank_summary(runs: dict, n_train: int = RANK_SWEEP["n_train"], steps: int = RANK_SWEEP["steps"]) -> dict:
    """Per LoRA rank of the word-order sweep: the seeds' test accuracy (mean and sample sd), test loss, training
    accuracy, trainable parameters and the body's next-character loss after (merged), and the keys they came from."""
    ranks = {}
    for r in WORD_ORDER_RANKS:
        keys = rank_sources(runs, r, n_train, steps)
        if not keys:
            continue
        entries = [runs[k] for k in keys]
        accs = [e["test_accuracy"] for e in entries]
        ranks[str(r)] = {"r": r, "scale": LORA["alpha"] / r, "trainable_params": entries[0]["trainable_params"],
                         "seeds": [e["seed"] for e in entries], "test_accuracy": accs,
                         "mean": sig(statistics.fmean(accs)),
                         "std": sig(statistics.stdev(accs)) if len(accs) > 1 else None,
                         "test_loss": [e["test_loss"] for e in entries],
                         "train_accuracy": [e["train_accuracy"] for e in entries],
                         "lm_loss_after": [e["lm_loss"]["after"] for e in entries], "keys": keys}
    return {"n_train": n_train, "steps": steps, "alpha": LORA["alpha"], "targets": LORA["targets"],
            "lm_loss_before": lm_loss_before(runs), "ranks": ranks}


def lm_loss_before(runs: dict) -> float | None:
    """The body's next-character loss before fine-tuning, as the stored LoRA runs measured it."""
    before = {e["lm_loss"]["before"] for k, e in runs.items()
              if k.startswith(("word-order/gpt/", "word-order/lora-rank/")) and e.get("lm_loss")}
    return before.pop() if len(before) == 1 else None


def word_order_rank(ranks, seeds, n_train: int, steps: int, skip_stored: bool) -> None:
    """LoRA of each of ``ranks`` on ``n_train`` labels for ``steps`` steps, each seed; then the rank summary."""
    stored = json.loads(OUT.read_text())["runs"] if skip_stored and OUT.is_file() else {}
    for r in ranks:
        for seed in seeds:
            if any(k.endswith(f"/seed{seed}") for k in rank_sources(stored, r, n_train, steps)):
                continue
            entry, _ = run_classifier("gpt", "lora", seed, rank=r, task_name="word-order", n_train=n_train,
                                      steps=steps)
            cmd = command(f"{word_order_args(n_train, steps)} --entry rank --rank {r} --seed {seed}")
            store(rank_key(r, seed, n_train), {"command": cmd, **entry, **environment()})
            print(rank_key(r, seed, n_train), entry["test_accuracy"], entry["lm_loss"]["after"],
                  entry["wall_seconds"], "s", flush=True)
    runs = json.loads(OUT.read_text())["runs"]
    store(f"word-order/lora-rank/n{n_train}/summary", {
        "command": command(f"{word_order_args(n_train, steps)} --entry rank-summary"),
        **lora_rank_summary(runs, n_train, steps)})


def converged_probe(body: str, seed: int) -> None:
    """The which-play diagnostic: the converged probe on ``body``'s frozen states, all training passages."""
    entry, _ = run_classifier(body, "probe", seed, converged=True)
    base = json.loads(OUT.read_text())["runs"].get("classification/baselines", {})
    entry["ngram_accuracy"] = base.get("ngram_accuracy")
    key = f"classification-converged-probe/{body}/seed{seed}"
    store(key, {"command": command(f"--entry converged-probe --body {body} --seed {seed}"), **entry, **environment()})
    print(key, entry["test_accuracy"], entry["config"]["probe"]["l2"], entry["wall_seconds"], "s", flush=True)


def main_word_order(a) -> None:
    """``--task word-order``: baselines, fine-tunes, the summary, or (``--entry all``) ``WORD_ORDER_PLAN``."""
    if a.entry == "baselines":
        word_order_baselines(a.n_train)
    elif a.entry == "classify":
        for method in a.method or METHODS:
            for seed in a.seed or [0, 1, 2]:
                word_order_classify(a.body, method, seed, a.n_train, a.steps, a.subset_seed)
    elif a.entry == "summary":
        store_word_order_summary()
    elif a.entry in ("rank", "rank-summary"):
        n_train, steps = a.n_train or RANK_SWEEP["n_train"], a.steps or RANK_SWEEP["steps"]
        ranks = [] if a.entry == "rank-summary" else a.rank or WORD_ORDER_RANKS
        word_order_rank(ranks, a.seed or [0, 1, 2], n_train, steps, a.skip_stored)
    elif a.entry == "tuned":
        for method in a.method or ("probe", "full", "lora"):
            if method == "scratch":
                raise SystemExit("--entry tuned: --method must be probe, full or lora")
            key = f"word-order-tuned/gpt/{method}/n{TUNED['n_train']}"
            entry = run_tuned(method)
            store(key, {"command": command(f"--task word-order --entry tuned --method {method}"), **entry,
                        **environment()})
            print(key, {s: r["test_accuracy"] for s, r in entry["seeds"].items()}, entry.get("chosen"), flush=True)
    elif a.entry == "all":  # --skip-stored: go on where an interrupted run stopped
        stored = json.loads(OUT.read_text())["runs"] if a.skip_stored and OUT.is_file() else {}
        for n_train in dict.fromkeys(n for n, _, _ in WORD_ORDER_PLAN):
            if f"word-order/baselines/{n_name(n_train)}" not in stored:
                word_order_baselines(n_train)
        for n_train, steps, seeds in WORD_ORDER_PLAN:
            for seed in seeds:
                for method in METHODS:
                    if f"word-order/gpt/{method}/{n_name(n_train)}/seed{seed}" not in stored:
                        word_order_classify("gpt", method, seed, n_train, steps)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--entry", choices=("classify", "baselines", "rank", "rank-summary", "summary", "all",
                                       "converged-probe", "tuned"), default="classify")
    p.add_argument("--body", choices=BODIES, default="gpt")
    p.add_argument("--method", choices=METHODS, action="append")
    p.add_argument("--seed", type=int, action="append", help="seeds (default 0 1 2; rank: 0)")
    p.add_argument("--rank", type=int, action="append",
                   help=f"LoRA ranks for --entry rank (default {RANKS}; word-order: {WORD_ORDER_RANKS})")
    p.add_argument("--task", choices=TASKS, default="play", help="which play (default) or real vs word-shuffled")
    p.add_argument("--n-train", type=int, help="word-order: train on this many passages (balanced, seeded)")
    p.add_argument("--steps", type=int, help=f"word-order: fine-tuning steps (default {FINETUNE['steps']})")
    p.add_argument("--subset-seed", type=int, default=SUBSET_SEED,
                   help=f"word-order --entry classify with --n-train: the subset's seed (default {SUBSET_SEED}); "
                        "another seed stores under n<N>-subset<seed>")
    p.add_argument("--skip-stored", action="store_true",
                   help="word-order --entry all or rank: skip entries already stored")
    a = p.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if a.task == "play" and (a.n_train is not None or a.steps is not None):
        p.error("--n-train and --steps are for --task word-order (the which-play entries use all passages)")
    if a.task == "word-order":
        if a.entry == "converged-probe":
            p.error("--entry converged-probe is for --task play (word-order's probe is always converged)")
        if a.entry == "rank" and any(r < 1 for r in a.rank or ()):
            p.error(f"--rank must be positive integers, got {a.rank}")
        if a.steps is not None and a.steps < 1:
            p.error(f"--steps must be a positive integer, got {a.steps}")
        if a.subset_seed != SUBSET_SEED and (a.n_train is None or a.entry != "classify"):
            p.error("--subset-seed is for --entry classify with --n-train")
        if a.n_train is not None:
            try:
                training_set(task("word-order")[0], a.n_train, a.subset_seed)
            except ValueError as err:
                p.error(f"--n-train {a.n_train}: {err}")
        return main_word_order(a)
    if a.entry in ("rank-summary", "tuned"):
        p.error(f"--entry {a.entry} is for --task word-order")
    if a.entry == "converged-probe":
        for seed in a.seed or [0]:
            converged_probe(a.body, seed)
        return None
    if a.entry in ("baselines", "all"):
        store("classification/baselines", {"command": command("--entry baselines"), **run_baselines()})
    if a.entry == "classify":
        for method in a.method or METHODS:
            for seed in a.seed or [0, 1, 2]:
                classify(a.body, method, seed)
    if a.entry == "all":
        for body, methods in (("gpt", METHODS), ("mlm-bert", METHODS), ("mlm-mask", ("probe", "full"))):
            for method in methods:
                for seed in (0, 1, 2):
                    classify(body, method, seed)
    if a.entry in ("rank", "all"):
        for r in a.rank or RANKS:
            for seed in a.seed or [0]:
                entry, _ = run_classifier("gpt", "lora", seed, rank=r)
                store(f"lora_rank/gpt/r{r}/seed{seed}",
                      {"command": command(f"--entry rank --rank {r} --seed {seed}"), **entry, **environment()})
                print(f"lora_rank r{r}", entry["test_accuracy"], entry["wall_seconds"], "s", flush=True)
    if a.entry == "summary":
        store_summary()


if __name__ == "__main__":
    on_notebook_arithmetic()  # the arithmetic the notebook's live cells run under: the same chapter-7 model
    sys.exit(main())
