"""``groundup sample``'s messages name the flag the user typed (issue 22): a prompt with characters the run's
tokenizer does not know, an unknown --pretrained name, --greedy with the sampling options it would ignore."""

import pytest

from groundup import cli
from groundup.pretrained import GPT2_NAMES

TINY_RUN = ["--layers", "1", "--d-model", "16", "--heads", "2", "--context", "16", "--batch-size", "4",
            "--max-steps", "2", "--eval-interval", "2", "--eval-batches", "1", "--warmup", "1", "--no-progress",
            "--threads", "1"]
TEXT = "to be or not to be, that is the question.\n" * 40


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sample")
    text = folder / "t.txt"
    text.write_text(TEXT, encoding="utf-8")
    assert cli.main(["train", "--text", str(text), "--out", str(folder / "r"), *TINY_RUN]) == 0
    return folder / "r"


def test_a_prompt_with_unknown_characters_names_the_flag_and_the_characters(tiny_run, capsys):
    capsys.readouterr()
    assert cli.main(["sample", str(tiny_run), "--tokens", "5", "--prompt", "to be€ or ü€"]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith("error: --prompt holds 2 characters not in the vocabulary of this run's tokenizer: 'ü', '€'; "
                          f"it knows only the {len(set(TEXT))} characters "
                          "of the text the run was trained on"), err
    assert err.count("\n") == 1, err


def test_a_prompt_of_known_characters_still_samples(tiny_run, capsys):
    assert cli.main(["sample", str(tiny_run), "--tokens", "5", "--prompt", "to be"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("to be") and len(out) == len("to be") + 5 + 1


def test_an_unknown_pretrained_name_lists_every_accepted_name(capsys):
    assert cli.main(["sample", "--pretrained", "nonsense", "--prompt", "hi"]) == 1
    err = capsys.readouterr().err
    names = ", ".join(("smollm2",) + GPT2_NAMES)
    assert err == (f"error: --pretrained 'nonsense' is neither a checkpoint folder nor a published model the book "
                   f"loads: give one of {names}, or a folder with config.json and model.safetensors\n"), err


@pytest.mark.parametrize("extra, named", [
    (["--temperature", "0.5"], "--temperature"),
    (["--top-k", "3"], "--top-k"),
    (["--temperature", "2", "--top-p", "0.9"], "--temperature and --top-p"),
])
def test_greedy_with_sampling_options_is_refused_naming_them(tiny_run, capsys, extra, named):
    capsys.readouterr()
    assert cli.main(["sample", str(tiny_run), "--tokens", "5", "--greedy", *extra]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == (f"error: --greedy always takes the most probable token, so {named} would be "
                                 "ignored: give --greedy or the sampling options, not both\n"), err
    assert cli.main(["sample", "--pretrained", "nonsense", "--greedy", *extra]) == 2  # before any model is loaded
    assert f"so {named} would be ignored" in capsys.readouterr().err


def test_greedy_alone_is_the_most_probable_token_at_every_step(tiny_run, capsys):
    import torch

    from groundup.tokenizers import CharTokenizer
    from groundup.training import load_checkpoint

    capsys.readouterr()
    assert cli.main(["sample", str(tiny_run), "--tokens", "6", "--greedy", "--prompt", "to"]) == 0
    out = capsys.readouterr().out
    model, _ = load_checkpoint(tiny_run / "checkpoint.pt")
    tokenizer = CharTokenizer.load(tiny_run / "tokenizer.json")
    ids = tokenizer.encode("to")
    with torch.no_grad():
        for _ in range(6):
            logits, _ = model(torch.tensor([ids]))
            ids.append(int(logits[0, -1].argmax()))
    assert out == tokenizer.decode(ids) + "\n"


def test_a_date_with_unknown_words_names_the_prompt(tmp_path, capsys):
    out = tmp_path / "dates"
    assert cli.main(["train", "--out", str(out), "--task", "dates", "--d-model", "16", "--heads", "2", "--layers",
                     "1", "--batch-size", "8", "--max-steps", "2", "--eval-interval", "2", "--eval-batches", "1",
                     "--warmup", "1", "--no-progress", "--threads", "1"]) == 0
    capsys.readouterr()
    assert cli.main(["sample", str(out), "--prompt", "July 4th"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: --prompt: ") and "the dates task knows only these words: " in err, err
