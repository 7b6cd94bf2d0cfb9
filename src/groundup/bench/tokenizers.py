"""Our byte-level BPE against the ``tokenizers`` library (Hugging Face, Rust), trained on the same text.

Apples to apples: the library gets a ByteLevel pre-tokenizer (the GPT-2 split pattern, no prefix space) and
a BpeTrainer with the same vocabulary size and the 256-byte initial alphabet. Training: 1 MB of Shakespeare
(tiny Shakespeare, else the first 1 MB of the corpus) to vocabulary 1024. Encoding: the whole 5 MB corpus
with the tokenizers trained above, as one string (and, for the library, also as a batch of lines, which
it spreads over threads); our per-chunk cache is emptied before every timed run, so each run starts cold.
The two sides are timed alternately, round by round, and each ratio is the median of the per-round ratios
(with its quartiles); the encoding ratio is taken against the faster of the library's two modes in each round.
Targets: training at most 1.5x the library's time and encoding no slower; bytes per token within 5 % of the
library's.
"""

from __future__ import annotations

import statistics

from groundup.bench import Row, alternate, ratio_row
from groundup.data import load_corpus
from groundup.tokenizers import BPETokenizer

VOCAB_SIZE = 1024


def training_text() -> tuple[str, str]:
    """About 1 MB of Shakespeare and its name."""
    try:
        return load_corpus("tinyshakespeare"), "tiny Shakespeare"
    except Exception:  # noqa: BLE001 -- offline without the tiny file: fall back to the main corpus
        return load_corpus("shakespeare")[:1_000_000], "first 1 MB of the corpus"


def library_tokenizer(text: str, vocab_size: int = VOCAB_SIZE):
    """The ``tokenizers`` library's byte-level BPE trained on ``text`` (imported here: a dev dependency)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator([text], trainer)
    return tok


def require_library() -> None:
    """Fail fast, with what to install, when the optional ``tokenizers`` library is missing."""
    try:
        import tokenizers  # noqa: F401
    except ImportError:
        raise ModuleNotFoundError(
            "the tokenizers section compares with Hugging Face's `tokenizers` library, which is not installed; "
            "install it with `pip install tokenizers` (or the dev extra: `pip install -e '.[dev]'`)",
            name="tokenizers") from None


def run() -> list[Row]:
    require_library()
    small, small_name = training_text()
    corpus = load_corpus("shakespeare")
    mb_small, mb_corpus = len(small.encode()) / 1e6, len(corpus.encode()) / 1e6

    ours = BPETokenizer.train(small, VOCAB_SIZE)  # these first runs are the warm-up
    lib = library_tokenizer(small)
    train = alternate({"groundup": lambda: BPETokenizer.train(small, VOCAB_SIZE),
                       "tokenizers": lambda: library_tokenizer(small)}, repeat=5, warmup=0)
    t_ours, t_lib = statistics.median(train["groundup"]), statistics.median(train["tokenizers"])

    n_tokens = {}

    def encode_ours():
        ours._cache.clear()
        n_tokens["groundup"] = len(ours.encode(corpus))

    def encode_lib():
        n_tokens["tokenizers"] = len(lib.encode(corpus).ids)

    lines = corpus.splitlines(keepends=True)
    enc = alternate({"groundup": encode_ours, "tokenizers": encode_lib,
                     "batch": lambda: lib.encode_batch(lines)}, repeat=3, warmup=0)
    e_ours, e_lib, e_lib_batch = (statistics.median(enc[k]) for k in ("groundup", "tokenizers", "batch"))
    best = [min(a, b) for a, b in zip(enc["tokenizers"], enc["batch"], strict=True)]  # per round
    bpt_ours = mb_corpus * 1e6 / n_tokens["groundup"]
    bpt_lib = mb_corpus * 1e6 / n_tokens["tokenizers"]

    train_note = f"{small_name}, {mb_small:.2f} MB, vocab {VOCAB_SIZE}"
    enc_note = f"{mb_corpus:.2f} MB corpus, one string"
    return [
        Row("BPE training, groundup", t_ours, "s", train_note),
        Row("BPE training, tokenizers", t_lib, "s", train_note),
        ratio_row("BPE training ratio", train["groundup"], train["tokenizers"], "tokenizers' time", "target <= 1.5"),
        Row("BPE encoding, groundup", e_ours, "s", enc_note + f", {mb_corpus / e_ours:.2f} MB/s, cold cache"),
        Row("BPE encoding, tokenizers", e_lib, "s", enc_note + f", {mb_corpus / e_lib:.2f} MB/s"),
        Row("BPE encoding, tokenizers batch", e_lib_batch, "s",
            f"{mb_corpus:.2f} MB corpus as {len(lines):,} lines, encode_batch (multi-threaded)"),
        ratio_row("BPE encoding ratio", enc["groundup"], best, "the faster tokenizers mode's time", "target <= 1"),
        Row("bytes per token, groundup", bpt_ours, "B/token", f"vocab {ours.vocab_size}, whole corpus"),
        Row("bytes per token, tokenizers", bpt_lib, "B/token", f"vocab {lib.get_vocab_size()}, whole corpus"),
        Row("bytes per token ratio", bpt_ours / bpt_lib, "x", "groundup / tokenizers (target within 5 %)"),
    ]
