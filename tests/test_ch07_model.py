"""Chapter 7's stored training run: chapter7_sample, train_chapter7_model, save/load_chapter7_run, chapter7_model."""

import dataclasses
import pickle
import re

import pytest
import torch

import groundup.char_data
import groundup.data
import groundup.training as training
from groundup.generation import generate
from groundup.models import GPT, GPTConfig
from groundup.tokenizers import CharTokenizer

TINY_MODEL = dict(context_length=16, d_model=16, n_layers=1, n_heads=2, positional="rope")
TINY_TRAINING = dict(batch_size=4, max_steps=30, learning_rate=3e-3, warmup_steps=5, eval_interval=10,
                     eval_batches=2, seed=0)
TEXT = "To be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer\n" * 30


@pytest.fixture
def tiny_chapter7(monkeypatch):
    """Chapter 7's recipe at a stand-in size (30 steps of a 1-layer GPT on a short text): the real one takes minutes."""
    monkeypatch.setattr(training, "CHAPTER7_MODEL", TINY_MODEL)
    monkeypatch.setattr(training, "CHAPTER7_TRAINING", TINY_TRAINING)
    monkeypatch.setattr(groundup.char_data, "load_corpus", lambda name, cache_dir=None: TEXT)


def _notebook_run():
    """Chapter 7's cell as the notebook writes it, with its own sample_text: the reference the package must match."""
    tokenizer = CharTokenizer.from_text(TEXT)
    ids = torch.tensor(tokenizer.encode(TEXT))
    train_ids, val_ids = groundup.data.train_val_split(ids)

    def sample_text(model, n=120, seed=0):
        prompt = torch.tensor([tokenizer.encode("\n")])
        out = generate(model, prompt, n, temperature=0.8, generator=torch.Generator().manual_seed(seed))
        return tokenizer.decode(out[0, 1:].tolist())

    with training.threads(1):
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=tokenizer.vocab_size, **TINY_MODEL))
        after_init = torch.get_rng_state()
        samples = {0: sample_text(model)}
        history = training.train(model, train_ids, val_ids, training.TrainConfig(**TINY_TRAINING, progress=False),
                                 callback=lambda step, m: samples.__setitem__(step, sample_text(m)))
    return model, history, samples, after_init


def _same_history(a, b):
    """Equal in everything but the seconds (wall-clock time is not reproducible)."""
    return all(getattr(a, f.name) == getattr(b, f.name) for f in dataclasses.fields(a) if f.name != "seconds")


def test_a_stored_run_is_bit_for_bit_the_notebooks_live_run(tmp_path, tiny_chapter7):
    model, history, samples, after_init = _notebook_run()
    # training draws no global random numbers, so the notebook's branch that loads the run leaves the same state
    assert torch.equal(torch.get_rng_state(), after_init)
    trained = training.train_chapter7_model(cache_dir=tmp_path)
    loaded = training.load_chapter7_run(cache_dir=tmp_path)
    for run in (trained, loaded):
        assert all(torch.equal(a, b) for a, b in zip(run.model.state_dict().values(), model.state_dict().values()))
        assert _same_history(run.history, history) and len(run.history.val_loss) == 3
        assert run.samples == samples and sorted(samples) == [0, 10, 20, 30]
        assert run.tokenizer.chars == CharTokenizer.from_text(TEXT).chars and not run.model.training
    assert loaded.history.seconds == trained.history.seconds
    assert all(len(text) == 120 for text in samples.values()) and samples[0] != samples[30]


def test_chapter7_sample_is_the_chapters_sample(tiny_chapter7):
    tokenizer = CharTokenizer.from_text(TEXT)
    torch.manual_seed(1)
    model = GPT(GPTConfig(vocab_size=tokenizer.vocab_size, **TINY_MODEL))
    # by hand: temperature 0.8, no cache, one multinomial draw per character from a generator seeded 0
    idx, g = torch.tensor([tokenizer.encode("\n")]), torch.Generator().manual_seed(0)
    model.eval()
    with torch.no_grad():
        for _ in range(120):
            logits, _ = model(idx[:, -TINY_MODEL["context_length"]:])
            probs = torch.softmax(logits[:, -1] / 0.8, dim=-1)
            idx = torch.cat([idx, torch.multinomial(probs, 1, generator=g)], dim=1)
    expected = tokenizer.decode(idx[0, 1:].tolist())
    assert training.chapter7_sample(model, tokenizer) == expected


def _stub_chapter7_training(monkeypatch):
    """A chapter 7-shaped model over 8 characters, and train_chapter7_model replaced by one that counts its calls
    in ``retrained`` and returns that model: (model, tokenizer, retrained)."""
    tokenizer = CharTokenizer.from_text("abcdefgh")
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=tokenizer.vocab_size, **training.CHAPTER7_MODEL))
    retrained = []
    monkeypatch.setattr(training, "train_chapter7_model", lambda **kw: retrained.append(1) or training.Chapter7Run(
        model, tokenizer, training.History(), {0: "x"}))
    return model, tokenizer, retrained


def _save(model, tokenizer, tmp_path, samples=None):
    with training.threads(1):
        return training.save_chapter7_model(model, tokenizer, training.History(), samples or {0: "ab"},
                                            cache_dir=tmp_path)


def test_chapter7_model_is_reused_only_under_the_mkl_setting_it_was_trained_with(tmp_path, monkeypatch):
    # MKL picks its kernels per CPU unless MKL_CBWR=COMPATIBLE (the notebooks' setting): a cached model trained
    # under another setting has other last bits, and the chapters that load it would print other numbers.
    monkeypatch.setenv("GROUNDUP_CACHE_DIR", str(tmp_path))
    model, tokenizer, retrained = _stub_chapter7_training(monkeypatch)
    monkeypatch.delenv("MKL_CBWR", raising=False)
    _save(model, tokenizer, tmp_path)
    loaded, _ = training.chapter7_model(cache_dir=tmp_path)
    assert retrained == []  # loaded, under the same (unset) setting
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), model.state_dict().values()))
    monkeypatch.setenv("MKL_CBWR", "COMPATIBLE")
    assert training.load_chapter7_run(cache_dir=tmp_path) is None
    training.chapter7_model(cache_dir=tmp_path)
    assert retrained == [1]


def test_chapter7_model_is_reused_only_with_the_cpu_kernels_it_was_trained_with(tmp_path, monkeypatch):
    # PyTorch's AVX-512, AVX2 and plain kernels differ in the last bits (the checked notebook runs use the plain
    # ones, ATEN_CPU_CAPABILITY=default): a model trained on others would make chapters 8, 9, 12 print other numbers.
    model, tokenizer, retrained = _stub_chapter7_training(monkeypatch)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    _save(model, tokenizer, tmp_path)
    training.chapter7_model(cache_dir=tmp_path)
    assert retrained == []  # the same kernels: loaded
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "DEFAULT")
    training.chapter7_model(cache_dir=tmp_path)
    assert retrained == [1]


@pytest.mark.parametrize("name, value", [("ONEDNN_MAX_CPU_ISA", "AVX2"), ("GLIBC_TUNABLES", "glibc.cpu.hwcaps=-AVX2"),
                                         ("NPY_DISABLE_CPU_FEATURES", "X86_V4"), ("MKL_ENABLE_INSTRUCTIONS", "AVX2")])
def test_chapter7_model_is_reused_only_under_the_same_dispatcher_caps(tmp_path, monkeypatch, name, value):
    # oneDNN (the GELU), glibc's libm and NumPy pick code for the CPU as MKL and ATen do: a model trained under
    # another cap differs in the last bits, so it gets its own file and is not reused.
    model, tokenizer, retrained = _stub_chapter7_training(monkeypatch)
    for variable in training.ARITHMETIC_VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    first = _save(model, tokenizer, tmp_path)
    training.chapter7_model(cache_dir=tmp_path)
    assert retrained == []
    monkeypatch.setenv(name, value)
    assert training.chapter7_path(tmp_path) != first and training.load_chapter7_run(cache_dir=tmp_path) is None
    training.chapter7_model(cache_dir=tmp_path)
    assert retrained == [1]


def test_chapter7_models_of_two_arithmetics_live_side_by_side(tmp_path, monkeypatch):
    # The checked notebook runs (MKL_CBWR=COMPATIBLE, plain kernels) and a run on the machine's fastest kernels each
    # keep their own file: switching between them used to overwrite the other's model and retrain it (5-10 min).
    model, tokenizer, retrained = _stub_chapter7_training(monkeypatch)
    paths = {}
    for mkl, kernels in ((None, "AVX512"), ("COMPATIBLE", "DEFAULT")):
        if mkl:
            monkeypatch.setenv("MKL_CBWR", mkl)
        else:
            monkeypatch.delenv("MKL_CBWR", raising=False)
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda k=kernels: k)
        paths[kernels] = _save(model, tokenizer, tmp_path)
    assert re.fullmatch(r"chapter07-compatible-default-[0-9a-f]{8}\.pt", paths["DEFAULT"].name)
    assert re.fullmatch(r"chapter07-auto-avx512-[0-9a-f]{8}\.pt", paths["AVX512"].name)
    assert all(p.is_file() for p in paths.values())
    monkeypatch.delenv("MKL_CBWR")
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    training.chapter7_model(cache_dir=tmp_path)
    assert retrained == [], "the other arithmetic's save left this one's model in place"


def test_a_chapter7_model_trained_by_chapter7_model_is_reused_by_the_next_call(tmp_path, monkeypatch):
    # It was saved after train's one-thread block had ended, so it recorded the machine's thread count and every
    # later call (chapters 8, 9, 12) trained it again; and it went to the default cache, not cache_dir.
    monkeypatch.setattr(groundup.char_data, "load_corpus", lambda name, cache_dir=None: "abcdefgh ijkl\n" * 200)
    trained = []

    def fake_train(model, train_ids, val_ids, config, callback):
        trained.append(torch.get_num_threads())
        return training.History()

    monkeypatch.setattr(training, "train", fake_train)
    with training.threads(2):
        first, _ = training.chapter7_model(cache_dir=tmp_path)
        second, tokenizer = training.chapter7_model(cache_dir=tmp_path)
    assert trained == [1], "trained once, on one thread, then loaded"
    assert training.chapter7_path(tmp_path).is_file() and tokenizer.vocab_size == 14
    assert all(torch.equal(a, b) for a, b in zip(first.state_dict().values(), second.state_dict().values()))
    assert set(training.load_chapter7_run(cache_dir=tmp_path).samples) == {0}


def test_a_stored_model_without_samples_is_stale_and_trained_afresh(tmp_path, monkeypatch):
    # the files stored before the samples were kept: loading one would leave chapter 7 without its samples
    model, tokenizer, retrained = _stub_chapter7_training(monkeypatch)
    path = _save(model, tokenizer, tmp_path)
    assert training.load_chapter7_run(cache_dir=tmp_path).samples == {0: "ab"}
    ckpt = torch.load(path, weights_only=True)
    del ckpt["extra"]["samples"]
    torch.save(ckpt, path)
    assert training.load_chapter7_run(cache_dir=tmp_path) is None
    training.chapter7_model(cache_dir=tmp_path)
    assert retrained == [1]


def test_a_run_of_another_recipe_or_on_more_threads_is_not_loaded(tmp_path, monkeypatch):
    model, tokenizer, _ = _stub_chapter7_training(monkeypatch)
    _save(model, tokenizer, tmp_path)
    assert training.load_chapter7_run(cache_dir=tmp_path) is not None
    monkeypatch.setattr(training, "CHAPTER7_TRAINING", {**training.CHAPTER7_TRAINING, "max_steps": 1999})
    assert training.load_chapter7_run(cache_dir=tmp_path) is None
    monkeypatch.undo()
    with training.threads(2):
        training.save_chapter7_model(model, tokenizer, training.History(), {0: "ab"}, cache_dir=tmp_path)
    assert training.load_chapter7_run(cache_dir=tmp_path) is None


@pytest.mark.parametrize("damage", ["truncated", "not a checkpoint", "code inside", "samples of other steps"])
def test_a_damaged_file_is_refused_and_trained_afresh(tmp_path, monkeypatch, damage):
    model, tokenizer, retrained = _stub_chapter7_training(monkeypatch)
    path = _save(model, tokenizer, tmp_path)
    if damage == "truncated":
        path.write_bytes(path.read_bytes()[:1000])
    elif damage == "not a checkpoint":
        torch.save({"weights": torch.zeros(3)}, path)
    elif damage == "code inside":  # weights_only=True: nothing in the file runs
        path.write_bytes(pickle.dumps(print, protocol=2))
    else:
        ckpt = torch.load(path, weights_only=True)
        ckpt["extra"]["samples"] = [[0, "ab"], [250, "cd"]]  # the history has no evaluation at 250
        torch.save(ckpt, path)
    assert training.load_chapter7_run(cache_dir=tmp_path) is None
    training.chapter7_model(cache_dir=tmp_path)
    assert retrained == [1]


def test_save_chapter7_model_wants_a_sample_for_step_0_and_each_evaluation(tmp_path):
    tokenizer = CharTokenizer.from_text("abcdefgh")
    model = GPT(GPTConfig(vocab_size=tokenizer.vocab_size, **TINY_MODEL))
    history = training.History(eval_step=[10, 20])
    with pytest.raises(ValueError, match=r"samples must map the steps \[0, 10, 20\]"):
        training.save_chapter7_model(model, tokenizer, history, {0: "a", 10: "b"}, cache_dir=tmp_path)
    with pytest.raises(ValueError, match="samples must map"):
        training.save_chapter7_model(model, tokenizer, history, {0: "a", 10: "b", 20: 3}, cache_dir=tmp_path)
    assert not training.chapter7_path(tmp_path).exists()
