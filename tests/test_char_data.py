"""groundup.char_data.char_corpus: the same data as the three lines it replaces, written out."""

import pytest
import torch

from groundup import data
from groundup.char_data import char_corpus
from groundup.data import load_corpus, train_val_split
from groundup.tokenizers import CharTokenizer


def _available(name: str) -> bool:
    """Whether ``name`` can be read without downloading it (GROUNDUP_DATA_DIR or the cache)."""
    filename = data.CORPORA[name].filename
    folders = [data.corpus_data_dir(), data.corpus_cache_dir()]
    return any(folder is not None and (folder / filename).is_file() for folder in folders)


@pytest.mark.parametrize("name", ["tinyshakespeare", "shakespeare"])
def test_char_corpus_is_the_three_lines_written_out(name):
    if name == "tinyshakespeare" and not _available(name):
        pytest.skip("tiny Shakespeare is neither in GROUNDUP_DATA_DIR nor in the cache (make test sets the folder)")
    text = load_corpus(name)
    expected_tokenizer = CharTokenizer.from_text(text)
    expected_train, expected_val = train_val_split(torch.tensor(expected_tokenizer.encode(text)), 0.1)

    tokenizer, train_ids, val_ids = char_corpus(name)

    assert tokenizer.chars == expected_tokenizer.chars
    assert train_ids.dtype == val_ids.dtype == torch.long
    assert torch.equal(train_ids, expected_train) and torch.equal(val_ids, expected_val)
    # the split itself, independently: the first 90 % and the last 10 % of the text's characters, in order
    n_train = round(0.9 * len(text))
    assert len(train_ids) == n_train and len(val_ids) == len(text) - n_train
    assert tokenizer.decode(train_ids[:50].tolist()) == text[:50]
    assert tokenizer.decode(val_ids[-50:].tolist()) == text[-50:]


def test_char_corpus_passes_val_fraction_and_cache_dir(tmp_path, monkeypatch):
    text = "abcabcabcd" * 10  # 100 characters
    fake = data.Corpus("tinyshakespeare", "tinyshakespeare.txt", data.sha256_bytes(text.encode()), lambda _: text)
    monkeypatch.setitem(data.CORPORA, "tinyshakespeare", fake)
    monkeypatch.delenv("GROUNDUP_DATA_DIR", raising=False)

    tokenizer, train_ids, val_ids = char_corpus("tinyshakespeare", val_fraction=0.25, cache_dir=tmp_path)

    assert tokenizer.chars == ["a", "b", "c", "d"]
    assert (len(train_ids), len(val_ids)) == (75, 25)
    assert tokenizer.decode(val_ids.tolist()) == text[75:]
    assert (tmp_path / "tinyshakespeare.txt").read_text() == text, "the text must be cached where cache_dir says"


def test_char_corpus_errors_name_the_argument():
    with pytest.raises(ValueError, match="unknown corpus 'hamlet'"):
        char_corpus("hamlet")
    with pytest.raises(ValueError, match="val_fraction must be a number strictly between 0 and 1, got 1.5"):
        char_corpus("shakespeare", val_fraction=1.5)
    with pytest.raises(TypeError, match="name must be a string"):
        char_corpus(None)
