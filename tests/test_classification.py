"""The which-play task (groundup.classification), its baselines and the classifier head; the works of the corpus."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from groundup.classification import (
    ATTENTION_PROJECTIONS,
    DEFAULT_PLAYS,
    METHODS,
    ClassifierHead,
    Passages,
    accuracy_and_loss,
    char_ngrams,
    classifier_for,
    encode_passages,
    fine_tune,
    majority_accuracy,
    ngram_baseline,
    play_passages,
    play_scenes,
    predict,
    speaker_names,
    spoken_text,
)
from groundup.data import WORK_JOINER, load_corpus, shakespeare_works
from groundup.lora import attach_lora, lora_layers
from groundup.models import GPT, GPTConfig, MaskedLM, MaskedLMConfig
from groundup.tokenizers import CharTokenizer

# ---- a small corpus in the Gutenberg format ---------------------------------------------------------------------

WORDS = {"AYE": "able abbey bale", "BEE": "ebb babe bee", "SEA": "case sea ace"}  # letters distinguish the plays


def fake_play(title: str, words: str, n_scenes: int = 4, lines: int = 6) -> str:
    out = [f"{title}\n\nby William Shakespeare\n\n\n\nPERSONS REPRESENTED.\n\nFIRST LORD.\nSECOND LORD.\n\n\n"]
    for s in range(n_scenes):
        if s % 2 == 0:
            out.append(f"ACT {'I' * (s // 2 + 1)}.\n")
        out.append(f"SCENE {s + 1}. A room.\n\n[Enter First Lord and\nSecond Lord.]\n")
        for i in range(lines):
            speaker = "First Lord." if i % 2 == 0 else "Sec. Lord."
            text = " ".join(words.split()[(i + j + s) % 3] for j in range(5))
            out.append(f"{speaker}\n{text} {s}{i},\n{text}.\n")
        out.append("[Exeunt.]\n")
    return "\n".join(out)


FAKE_CORPUS = WORK_JOINER.join(fake_play(title, words) for title, words in WORDS.items())


def test_works_of_a_fake_corpus_are_split_exactly():
    works = shakespeare_works(FAKE_CORPUS)
    assert list(works) == ["AYE", "BEE", "SEA"]
    assert WORK_JOINER.join(works.values()) == FAKE_CORPUS
    assert works["BEE"].startswith("BEE\n\nby William Shakespeare") and "SEA" not in works["BEE"]
    with pytest.raises(ValueError, match="must begin with a work's title page"):
        shakespeare_works("preface\n" + FAKE_CORPUS)
    with pytest.raises(ValueError, match="'AYE' occurs twice"):
        shakespeare_works(FAKE_CORPUS + WORK_JOINER + fake_play("AYE", "a b c"))


def test_scenes_and_spoken_text():
    play = fake_play("AYE", WORDS["AYE"], n_scenes=3, lines=2)
    scenes = play_scenes(play)
    assert len(scenes) == 5  # ACT I, SCENE 1, SCENE 2, ACT II, SCENE 3: the ACT parts are empty of speech
    assert speaker_names(play) == {"FIRST LORD.", "First Lord.", "Sec. Lord."}  # the cast list's first line too
    names = speaker_names(WORK_JOINER.join(scenes))
    assert names == {"First Lord.", "Sec. Lord."}
    spoken = spoken_text(scenes[1], names=names)
    assert spoken == ("able abbey bale able abbey 00,\nable abbey bale able abbey.\n"
                      "abbey bale able abbey bale 01,\nabbey bale able abbey bale.")
    assert spoken_text(scenes[0]) == ""  # the "ACT I." part holds only the scene heading's remainder
    kept = spoken_text(scenes[1], names=set())
    assert kept.startswith("First Lord.\nable") and "Enter" not in kept  # stage directions go in any case


def test_fake_task_split_by_scene_and_baselines():
    train, test = play_passages(tuple(WORDS), passage_chars=20, test_fraction=0.25, text=FAKE_CORPUS)
    assert train.classes == test.classes == ("AYE", "BEE", "SEA")
    assert all(len(t) == 20 for t in train.texts + test.texts)
    assert not set(train.sections) & set(test.sections)
    assert {s.split(" #")[0] for s in test.sections} == set(WORDS)  # every play holds out a scene
    for label, title in enumerate(WORDS):  # every whole 20-character piece of every scene's speech, once
        play = fake_play(title, WORDS[title])
        scenes = [spoken_text(s, names={"First Lord.", "Sec. Lord."}) for s in play_scenes(play)]
        assert train.counts()[label] + test.counts()[label] == sum(len(s) // 20 for s in scenes)
    assert train.counts() == [51, 42, 42] and test.counts() == [17, 14, 14]  # one scene of four held out
    assert majority_accuracy(train, test) == pytest.approx(17 / 45)  # "AYE", the commonest in training
    model = ngram_baseline(train, test)
    assert model.accuracy == 1.0  # the plays use different letters
    assert model.predict(["bee babe", "sea ace", "able bale"]).tolist() == [1, 2, 0]


def test_majority_accuracy_by_hand():
    classes = ("x", "y", "z")
    train = Passages(("a",) * 5, (0, 2, 2, 1, 2), ("s",) * 5, classes)
    test = Passages(("b",) * 4, (2, 0, 1, 2), ("t",) * 4, classes)
    assert majority_accuracy(train, test) == 0.5
    tie = Passages(("a",) * 4, (1, 0, 1, 0), ("s",) * 4, classes)  # a tie: the first class
    assert majority_accuracy(tie, test) == 0.25


def test_char_ngrams():
    assert char_ngrams("abab", (1, 2)) == {"a": 2, "b": 2, "ab": 2, "ba": 1}
    assert char_ngrams("ab", (3,)) == {}


def test_ngram_logistic_regression_reaches_the_optimum():
    """At the optimum the gradient of mean cross-entropy + l2/2 |W|^2 is zero (computed here with NumPy)."""
    rng = np.random.default_rng(0)
    letters = ["ab", "bc", "ca"]
    texts = ["".join(rng.choice(list(letters[c] + "abc"), size=12)) for c in range(3) for _ in range(20)]
    labels = tuple(c for c in range(3) for _ in range(20))
    train = Passages(tuple(texts), labels, ("s",) * 60, ("p", "q", "r"))
    l2 = 1e-2
    model = ngram_baseline(train, orders=(1, 2), l2=l2, max_iter=500)
    x = model.features(texts).numpy()
    w, b = model.weight.numpy(), model.bias.numpy()
    z = x @ w.T + b
    p = np.exp(z - z.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    y = np.eye(3)[list(labels)]
    grad_w = (p - y).T @ x / len(texts) + l2 * w
    grad_b = (p - y).mean(axis=0)
    assert np.abs(grad_w).max() < 1e-6 and np.abs(grad_b).max() < 1e-6
    assert set(model.vocab) == {t[i:i + n] for t in texts for n in (1, 2) for i in range(len(t) - n + 1)}
    assert len(model.vocab) == 3 + 9  # every 1-gram and 2-gram of "abc" occurs


def test_bad_task_arguments_are_refused():
    with pytest.raises(ValueError, match=r"plays \['NOPE'\] are not titles"):
        play_passages(("AYE", "NOPE"), text=FAKE_CORPUS)
    with pytest.raises(ValueError, match="passage_chars must be a positive integer, got 0"):
        play_passages(("AYE", "BEE"), passage_chars=0, text=FAKE_CORPUS)
    with pytest.raises(ValueError, match=r"test_fraction must be a number in \(0, 1\), got 1"):
        play_passages(("AYE", "BEE"), test_fraction=1, text=FAKE_CORPUS)
    with pytest.raises(ValueError, match="at least two different titles"):
        play_passages(("AYE", "AYE"), text=FAKE_CORPUS)
    poem = WORK_JOINER.join([fake_play("AYE", "a b c"), "POEM\n\nby William Shakespeare\n\nSing, muse.\n"])
    with pytest.raises(ValueError, match="'POEM' has 0 scenes"):
        play_passages(("AYE", "POEM"), text=poem)


# ---- the real corpus --------------------------------------------------------------------------------------------

def test_the_42_works_of_the_shakespeare_corpus():
    text = load_corpus("shakespeare")
    works = shakespeare_works(text)
    assert len(works) == 42
    assert WORK_JOINER.join(works.values()) == text
    titles = list(works)
    assert titles[0] == "ALL'S WELL THAT ENDS WELL" and titles[-1] == "THE WINTER'S TALE"
    assert "THE SONNETS" in works and works["THE SONNETS"].startswith("THE SONNETS\nby William Shakespeare")
    assert len(works["HAMLET, PRINCE OF DENMARK"]) == 173_942
    assert all(p in works for p in DEFAULT_PLAYS)


def test_the_default_task_is_deterministic_and_cannot_leak():
    train, test = play_passages()
    again_train, again_test = play_passages()
    assert (train, test) == (again_train, again_test)
    assert train.counts() == [1821, 1015, 989, 908] and test.counts() == [645, 354, 369, 427]
    assert all(len(t) == 64 for t in train.texts + test.texts)
    assert not set(train.sections) & set(test.sections)  # whole scenes on one side
    assert not set(train.texts) & set(test.texts)
    for label in range(len(DEFAULT_PLAYS)):  # about a quarter of each play's passages are held out
        n_train, n_test = train.counts()[label], test.counts()[label]
        assert 0.15 < n_test / (n_train + n_test) < 0.35
    works = shakespeare_works()
    names = set().union(*(speaker_names(works[p]) for p in DEFAULT_PLAYS))
    assert {"Ham.", "MACBETH.", "PROSPERO.", "THESEUS"} <= names
    lines = {line.strip() for t in train.texts + test.texts for line in t.split("\n")[1:-1]}  # whole lines
    assert not lines & {"Ham.", "Hor.", "MACBETH.", "LADY MACBETH.", "PROSPERO.", "THESEUS", "PUCK"}
    assert not any("[" in t or "]" in t for t in train.texts + test.texts)
    assert majority_accuracy(train, test) == pytest.approx(645 / 1795)
    other_train, _ = play_passages(seed=1)
    assert set(other_train.sections) != set(train.sections)


# ---- the classifier head ----------------------------------------------------------------------------------------

TINY = dict(vocab_size=20, context_length=16, d_model=32, n_layers=2, n_heads=4)


def test_hidden_states_are_what_the_unembedding_reads():
    torch.manual_seed(0)
    for model in (GPT(GPTConfig(**TINY)), MaskedLM(MaskedLMConfig(**TINY)),
                  GPT(GPTConfig(**TINY, norm_position="post", tie_weights=False))):
        idx = torch.randint(0, 19, (3, 9))
        with torch.no_grad():
            states = model.hidden_states(idx)
            assert states.shape == (3, 9, 32)
            assert torch.equal(model.unembedding(states), model(idx)[0])


def test_head_pools_the_last_state_of_a_gpt_and_the_mean_of_a_masked_lm():
    torch.manual_seed(0)
    gpt, mlm = GPT(GPTConfig(**TINY)).eval(), MaskedLM(MaskedLMConfig(**TINY)).eval()
    idx = torch.randint(0, 19, (4, 10))
    for body, pooled in ((gpt, lambda h: h[:, -1]), (mlm, lambda h: h.mean(dim=1))):
        head = ClassifierHead(body, 3)
        assert head.pooling == ("last" if body is gpt else "mean")
        with torch.no_grad():
            assert torch.count_nonzero(head(idx)) == 0  # zero-initialised: uniform predictions
            head.linear.weight.normal_()
            head.linear.bias.normal_()
            expected = pooled(body.hidden_states(idx)) @ head.linear.weight.T + head.linear.bias
            torch.testing.assert_close(head(idx), expected)
    first = ClassifierHead(mlm, 3, pooling="first")
    with torch.no_grad():
        first.linear.weight.normal_()
        torch.testing.assert_close(first(idx), mlm.hidden_states(idx)[:, 0] @ first.linear.weight.T)


def test_padded_batches_give_each_sequence_its_own_answer():
    torch.manual_seed(0)
    gpt = GPT(GPTConfig(**TINY)).eval()
    seqs = [torch.randint(0, 19, (n,)) for n in (5, 9, 7)]
    ids = torch.zeros(3, 9, dtype=torch.long)
    for row, s in enumerate(seqs):
        ids[row, :len(s)] = s
    lengths = torch.tensor([5, 9, 7])
    for pooling in ("last", "mean"):
        head = ClassifierHead(gpt, 2, pooling=pooling)
        with torch.no_grad():
            head.linear.weight.normal_()
            batched = head(ids, lengths)
            one_by_one = torch.cat([head(s[None]) for s in seqs])
        torch.testing.assert_close(batched, one_by_one, rtol=1e-5, atol=1e-6)
    mlm_head = ClassifierHead(MaskedLM(MaskedLMConfig(**TINY)), 2)
    with pytest.raises(ValueError, match="attends to padding"):
        mlm_head(ids, lengths)
    with pytest.raises(ValueError, match=r"lengths must have shape \(3,\) with values in \[1, 9\]"):
        ClassifierHead(gpt, 2)(ids, torch.tensor([5, 10, 7]))
    with pytest.raises(ValueError, match="pooling must be one of"):
        ClassifierHead(gpt, 2, pooling="max")
    with pytest.raises(ValueError, match="n_classes must be an integer >= 2"):
        ClassifierHead(gpt, 1)
    with pytest.raises(TypeError, match="body must be a GPT or MaskedLM"):
        ClassifierHead(torch.nn.Linear(2, 2), 2)


def test_encode_passages_and_a_lora_fine_tuning_step():
    train, _ = play_passages(tuple(WORDS), passage_chars=20, text=FAKE_CORPUS)
    tokenizer = CharTokenizer.from_text("".join(train.texts))
    ids, lengths, labels = encode_passages(train, tokenizer)
    assert ids.shape == (135, 20) and bool((lengths == 20).all()) and labels.tolist() == list(train.labels)
    assert tokenizer.decode(ids[7].tolist()) == train.texts[7]
    torch.manual_seed(0)
    body = GPT(GPTConfig(vocab_size=tokenizer.vocab_size, context_length=20, d_model=32, n_layers=2, n_heads=4))
    attach_lora(body, ("W_q", "W_v"), r=2, alpha=4)
    head = ClassifierHead(body, 3)
    trainable = {n for n, p in head.named_parameters() if p.requires_grad}
    assert trainable == {"linear.weight", "linear.bias"} | {
        f"body.blocks.{i}.attention.{w}.{ab}" for i in range(2) for w in ("W_q", "W_v") for ab in ("A", "B")}
    opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=3e-2)
    ids, labels = ids[::3], labels[::3]  # 45 passages, 15 of each play
    losses = []
    for _ in range(15):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(head(ids), labels)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(np.log(3), abs=1e-6)  # zero head: uniform predictions
    assert losses[-1] < 0.5 * losses[0]
    assert predict(head, ids, batch_size=7).shape == (45,) and head.training


# ---- fine-tuning: scratch, probe, full, lora --------------------------------------------------------------------

def toy_task(n: int, seed: int, length: int = 8):
    """Two classes told apart by their tokens: class 0 uses tokens 1-4 only, class 1 tokens 5-8 only."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.arange(n) % 2
    ids = torch.randint(1, 5, (n, length), generator=g) + 4 * labels[:, None]
    return ids, labels


def tiny_gpt(seed: int = 0, cls=GPT):
    torch.manual_seed(seed)
    config = (GPTConfig if cls is GPT else MaskedLMConfig)(vocab_size=10, context_length=8, d_model=16, n_layers=2,
                                                            n_heads=2)
    return cls(config).eval()


def weights(module):
    return {k: v.clone() for k, v in module.state_dict().items()}


@pytest.mark.parametrize("method", METHODS)
def test_every_method_learns_a_trivially_separable_task(method):
    ids, labels = toy_task(64, seed=0)
    test_ids, test_labels = toy_task(64, seed=1)
    head = classifier_for(tiny_gpt(), 2, method, seed=0, lora_rank=2, lora_targets=("W_q", "W_v"))
    history = fine_tune(head, ids, labels, steps=40, batch_size=16, lr=3e-2 if method == "probe" else 1e-2, seed=0)
    accuracy, loss = accuracy_and_loss(head, test_ids, test_labels)
    assert accuracy == 1.0 and history.train_loss[-1] < 0.5 * history.train_loss[0]
    logits = torch.cat([head(test_ids[i:i + 5]) for i in range(0, 64, 5)]).double()  # independent reference
    assert loss == pytest.approx(F.cross_entropy(logits, test_labels).item(), rel=1e-6)
    assert not head.training


def test_probe_trains_the_head_alone_and_leaves_the_body_bit_identical():
    body = tiny_gpt()
    before = weights(body)
    head = classifier_for(body, 2, "probe")
    assert {n for n, p in head.named_parameters() if p.requires_grad} == {"linear.weight", "linear.bias"}
    fine_tune(head, *toy_task(32, 0), steps=5, batch_size=8, lr=1e-2)
    assert all(torch.equal(before[k], v) for k, v in body.state_dict().items())
    assert torch.count_nonzero(head.linear.weight) > 0


def test_lora_trains_the_adapters_and_head_alone():
    body = tiny_gpt()
    before = weights(body)
    head = classifier_for(body, 2, "lora", lora_rank=2, lora_targets=ATTENTION_PROJECTIONS)
    trainable = {n for n, p in head.named_parameters() if p.requires_grad}
    assert trainable == {"linear.weight", "linear.bias"} | {
        f"body.blocks.{i}.attention.{w}.{ab}" for i in range(2) for w in ATTENTION_PROJECTIONS for ab in "AB"}
    fine_tune(head, *toy_task(32, 0), steps=5, batch_size=8, lr=1e-2)
    after = {k.replace(".base", ""): v for k, v in body.state_dict().items() if not k.endswith((".A", ".B"))}
    assert after.keys() == before.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert all(torch.count_nonzero(a.B) > 0 for a in lora_layers(body).values())


def test_full_changes_the_body_and_scratch_builds_a_new_seeded_one():
    body = tiny_gpt()
    before = weights(body)
    full = classifier_for(body, 2, "full")
    assert all(p.requires_grad for p in full.parameters())
    fine_tune(full, *toy_task(32, 0), steps=3, batch_size=8, lr=1e-2)
    assert not torch.equal(body.blocks[0].attention.W_q.weight, before["blocks.0.attention.W_q.weight"])
    given = tiny_gpt(seed=5)
    kept = weights(given)
    a, b = classifier_for(given, 2, "scratch", seed=3), classifier_for(given, 2, "scratch", seed=3)
    assert a.body is not given and all(torch.equal(kept[k], v) for k, v in given.state_dict().items())
    assert all(torch.equal(x, y) for x, y in zip(a.body.state_dict().values(), b.body.state_dict().values()))
    assert not torch.equal(a.body.token_embedding.weight, kept["token_embedding.weight"])
    assert all(p.requires_grad for p in a.parameters())


def test_fine_tune_logs_mean_losses_starting_at_ln_n_classes():
    head = classifier_for(tiny_gpt(), 3, "probe")
    ids, labels = toy_task(30, 0)
    labels = torch.arange(30) % 3
    history = fine_tune(head, ids, labels, steps=7, batch_size=10, lr=1e-2, warmup=2, log_every=1)
    assert history.step == list(range(1, 8)) and len(history.train_loss) == 7
    assert history.train_loss[0] == pytest.approx(np.log(3), abs=1e-6)  # a zero head predicts uniformly
    coarse = fine_tune(classifier_for(tiny_gpt(), 3, "probe"), ids, labels, steps=7, batch_size=10, lr=1e-2,
                       warmup=2, log_every=3)
    assert coarse.step == [3, 6, 7]
    assert coarse.train_loss[0] == pytest.approx(np.mean(history.train_loss[:3]), rel=1e-5)
    assert coarse.train_loss[2] == pytest.approx(history.train_loss[6], rel=1e-5)


def test_a_masked_lm_reads_a_long_passage_in_windows_of_its_context():
    mlm = tiny_gpt(cls=MaskedLM)
    head = ClassifierHead(mlm, 2)
    ids = torch.randint(0, 10, (3, 20))  # context 8: windows of 8, 8 and 4
    with torch.no_grad():
        head.linear.weight.normal_()
        states = torch.cat([mlm.hidden_states(ids[:, :8]), mlm.hidden_states(ids[:, 8:16]),
                            mlm.hidden_states(ids[:, 16:])], dim=1)
        torch.testing.assert_close(head(ids), states.mean(dim=1) @ head.linear.weight.T)
        with pytest.raises(ValueError, match="exceeds context_length 8"):
            ClassifierHead(tiny_gpt(), 2)(ids)


def test_bad_fine_tuning_arguments_are_refused():
    with pytest.raises(ValueError, match="method must be one of"):
        classifier_for(tiny_gpt(), 2, "frozen")
    head = classifier_for(tiny_gpt(), 2, "probe")
    ids, labels = toy_task(8, 0)
    with pytest.raises(ValueError, match="steps must be a positive integer, got 0"):
        fine_tune(head, ids, labels, steps=0)
    with pytest.raises(ValueError, match=r"batch_size must be at most the number of examples \(8\), got 9"):
        fine_tune(head, ids, labels, steps=1, batch_size=9)
    with pytest.raises(ValueError, match="labels"):
        fine_tune(head, ids, labels[:4], steps=1, batch_size=4)
    for p in head.parameters():
        p.requires_grad_(False)
    with pytest.raises(ValueError, match="no parameters that require gradients"):
        fine_tune(head, ids, labels, steps=1, batch_size=4)


def test_fine_tune_calls_back_after_every_step_without_changing_the_run():
    ids, labels = toy_task(32, 0)
    plain = classifier_for(tiny_gpt(), 2, "lora", lora_rank=2, lora_targets=("W_q",))
    fine_tune(plain, ids, labels, steps=6, batch_size=8, lr=1e-2, warmup=2)
    seen = []

    def look(step, head):
        seen.append((step, head.training, head.linear.weight.detach().clone()))
        head.eval()  # a callback that evaluates: training goes on in train mode

    watched = classifier_for(tiny_gpt(), 2, "lora", lora_rank=2, lora_targets=("W_q",))
    fine_tune(watched, ids, labels, steps=6, batch_size=8, lr=1e-2, warmup=2, callback=look)
    assert [s for s, _, _ in seen] == list(range(1, 7)) and all(training for _, training, _ in seen)
    assert torch.equal(seen[-1][2], watched.linear.weight) and not torch.equal(seen[0][2], seen[-1][2])
    assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), watched.state_dict().values()))
