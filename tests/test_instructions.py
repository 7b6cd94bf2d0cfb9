"""Instruction tuning data (groundup.instructions): dates as chat instructions, labels, batches, answers, scores.

References: labels written out by hand (a byte-level tokenizer, and SmolLM2's own); the chat text rendered by
``transformers``' ``apply_chat_template`` from the Jinja template stored in SmolLM2's GGUF file; the masked loss
recomputed with ``F.cross_entropy`` over the answer positions; greedy answers recomputed by a plain loop without
the KV cache; a GPT whose weights are set by hand so that its greedy reply is known in advance.
"""

import copy
import json

import pytest
import torch
import torch.nn.functional as F

from groundup import instructions
from groundup.data import locate_smollm2
from groundup.gguf import read_gguf
from groundup.instructions import (
    DATE_FORMATS,
    ERROR_KINDS,
    INSTRUCTION,
    InstructionData,
    Prediction,
    date_format,
    date_instructions,
    encode_instructions,
    error_breakdown,
    error_kind,
    evaluate_answers,
    exact_match_eval,
    format_shots,
    generate_answer,
    generate_answers,
    instruction_batches,
    instruction_messages,
    iso_fields,
    read_task_file,
    score_predictions,
    wrong_fields,
)
from groundup.models import GPT, GPTConfig
from groundup.pretrained import SMOLLM2_SYSTEM_PROMPT, encode_chat, gguf_tokenizer
from groundup.seq2seq import date_examples, date_splits
from groundup.tokenizers import BPETokenizer
from groundup.training import TrainConfig, train

START, END = 256, 257  # the byte tokenizer's <|im_start|>, <|im_end|>


@pytest.fixture(scope="module")
def byte_tok():
    """Byte-level BPE without merges: token ``b`` is byte ``b``; the two chat tokens are 256 and 257."""
    tok = BPETokenizer((), special_tokens=("<|im_start|>", "<|im_end|>"))
    assert tok.special_ids == {"<|im_start|>": START, "<|im_end|>": END} and tok.encode_ordinary("ab") == [97, 98]
    return tok


@pytest.fixture(scope="module")
def gguf_metadata():
    return read_gguf(locate_smollm2()).metadata


@pytest.fixture(scope="module")
def smol_tok(gguf_metadata):
    return gguf_tokenizer(gguf_metadata)


@pytest.fixture(scope="module")
def reference_template(gguf_metadata):
    """``transformers``' apply_chat_template with the template of SmolLM2's GGUF file (a one-word tokenizer: only
    the template matters for ``tokenize=False``)."""
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel({"<unk>": 0}, unk_token="<unk>")),
                                 chat_template=gguf_metadata["tokenizer.chat_template"])
    return lambda messages, add: hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add)


def _bytes(text: str) -> list[int]:
    return list(text.encode())


def _tiny_gpt(vocab_size: int, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=vocab_size, context_length=512, d_model=32, n_layers=2, n_heads=4,
                         positional="rope", norm="rmsnorm", tie_weights=False)).eval()


def _successor_gpt(vocab_size: int, successor: dict[int, int], default: int) -> GPT:
    """A GPT that predicts ``successor[t]`` (else ``default``) after token ``t``, whatever came before: one-hot
    embeddings, blocks that add nothing to the residual stream (all zero), an unembedding that maps each one-hot
    to its successor's logit."""
    model = GPT(GPTConfig(vocab_size=vocab_size, context_length=512, d_model=vocab_size, n_layers=1, n_heads=2,
                          d_ff=4, positional="none", norm="rmsnorm", bias=False, tie_weights=False)).eval()
    with torch.no_grad():
        model.token_embedding.weight.copy_(torch.eye(vocab_size))
        for p in model.blocks.parameters():
            p.zero_()
        model.unembedding.weight.zero_()
        for t in range(vocab_size):
            model.unembedding.weight[successor.get(t, default), t] = 1.0
    return model


# ---- the dates as instructions ---------------------------------------------------------------------------

def test_date_instructions_are_chapter_10s_dates_with_the_instruction():
    pairs = date_instructions("train", 30, seed=3)
    assert pairs == [(INSTRUCTION.format(date=s), t) for s, t in date_examples(30, split="train", seed=3)]
    assert INSTRUCTION.format(date="the third of may, nineteen eighty-one").endswith(
        "(YYYY-MM-DD; YYYY-MM for a month, YYYY for a year): the third of may, nineteen eighty-one")
    assert date_instructions("train", 30, seed=3) == pairs and date_instructions("train", 10, seed=3) == pairs[:10]
    assert date_instructions("test", 40) == date_instructions("held_out", 40)
    _, val, test = date_splits(n_train=1, n_val=40, n_test=1000)
    assert [a for _, a in date_instructions("test", 40)] == [t for _, t in test[:40]]
    assert [a for _, a in date_instructions("val", 40)] == [t for _, t in val]
    assert date_instructions("train", 2, instruction="Date? {date}")[0][0] == "Date? " + date_examples(1)[0][0]


def test_no_test_or_val_date_is_trained_on():
    train = date_instructions("train", 5000)
    test, val = date_instructions("test", 1000), date_instructions("val", 300)
    trained = {a for _, a in train}
    assert len(trained) > 3000 and not trained & {a for _, a in test} and not trained & {a for _, a in val}
    assert not {p for p, _ in val} & {p for p, _ in test}  # chapter 10: val and test share no question


def test_date_instructions_refuse_bad_arguments():
    with pytest.raises(ValueError, match="split must be one of 'train', 'val', 'test', 'held_out', got 'dev'"):
        date_instructions("dev")
    with pytest.raises(ValueError, match="n must be an integer >= 1, got 0"):
        date_instructions("train", 0)
    with pytest.raises(ValueError, match="instruction must be a string containing '{date}'"):
        date_instructions("train", 5, instruction="no placeholder")


# ---- task files ------------------------------------------------------------------------------------------

def test_read_task_file(tmp_path):
    path = tmp_path / "task.jsonl"
    lines = [json.dumps({"prompt": "Capital of France?", "answer": "Paris", "id": 7}), "",
             json.dumps({"prompt": "Überraschung 😀", "answer": " two\nlines "}, ensure_ascii=False), "   "]
    path.write_bytes(b"\xef\xbb\xbf" + "\n".join(lines).encode() + b"\r\n")
    assert read_task_file(path) == [("Capital of France?", "Paris"), ("Überraschung 😀", " two\nlines ")]
    assert read_task_file(str(path)) == read_task_file(path)


GOOD = json.dumps({"prompt": "p", "answer": "a"})


@pytest.mark.parametrize("content, message", [
    (GOOD + "\n{\"prompt\": \"p\", \"answer\": ", r"line 2: not valid JSON \(JSONDecodeError"),
    (GOOD + "\n" + GOOD + "\n" + json.dumps({"prompt": "p"}), "line 3: the object has no 'answer' .*'prompt'"),
    (json.dumps({"prompt": 12, "answer": "a"}), "line 1: 'prompt' must be a string, got a JSON number"),
    (json.dumps({"prompt": "p", "answer": None}), "line 1: 'answer' must be a string, got a JSON null"),
    (json.dumps({"prompt": "  ", "answer": "a"}), "line 1: 'prompt' is empty"),
    (json.dumps(["p", "a"]), "line 1: a JSON array, not an object"),
    ("\n" + "[" * 100_000 + "]" * 100_000, "line 2: not valid JSON"),
    ("", "holds no examples"),
    ("\n  \n\n", "holds no examples"),
])
def test_bad_task_files_are_refused_naming_file_and_line(tmp_path, content, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(ValueError, match=message) as err:
        read_task_file(path)
    assert str(path) in str(err.value)


def test_task_file_sizes_and_encoding_are_checked(tmp_path, monkeypatch):
    path = tmp_path / "t.jsonl"
    path.write_bytes(GOOD.encode() + b'\n{"prompt": "\xff", "answer": "a"}')
    with pytest.raises(ValueError, match=r"t.jsonl, line 2: not UTF-8 text \(invalid start byte at byte 13 of "
                                         r"the line\)"):
        read_task_file(path)
    path.write_text(json.dumps({"prompt": "p" * 101, "answer": "a"}))
    monkeypatch.setattr(instructions, "MAX_TASK_TEXT_CHARS", 100)
    with pytest.raises(ValueError, match="line 1: 'prompt' holds 101 characters, more than the 100 allowed"):
        read_task_file(path)
    monkeypatch.setattr(instructions, "MAX_TASK_FILE_BYTES", 50)
    assert path.stat().st_size == 130
    with pytest.raises(ValueError, match="t.jsonl holds 130 bytes; a task file may hold at most 50"):
        read_task_file(path)
    with pytest.raises(FileNotFoundError, match="missing.jsonl not found"):
        read_task_file(tmp_path / "missing.jsonl")


# ---- tokens and labels -----------------------------------------------------------------------------------

def test_labels_by_hand_on_a_byte_tokenizer(byte_tok):
    data = encode_instructions(byte_tok, [("ab", "c")], context_length=64, system="S")
    prompt = ([START, *_bytes("system\nS"), END, *_bytes("\n"), START, *_bytes("user\nab"), END, *_bytes("\n"),
               START, *_bytes("assistant\n")])
    assert len(prompt) == 32
    assert data.ids[0].tolist() == prompt + [ord("c"), END] and data.ids[0].dtype == torch.long
    assert data.labels[0].tolist() == [-100] * 31 + [ord("c"), END, -100]
    unmasked = encode_instructions(byte_tok, [("ab", "c")], context_length=64, system="S", mask_prompt=False)
    assert unmasked.ids[0].tolist() == data.ids[0].tolist()
    assert unmasked.labels[0].tolist() == prompt[1:] + [ord("c"), END, -100]
    assert data.pad_id == END and encode_instructions(byte_tok, [("a", "b")], context_length=128, pad_id=0).pad_id == 0


def test_labels_on_smollm2s_tokenizer_and_the_chat_template(smol_tok, reference_template):
    question = "Write this date in ISO format: the third of may, nineteen eighty-one"
    data = encode_instructions(smol_tok, [(question, "1981-05-03")], context_length=128)
    ids, labels = data.ids[0].tolist(), data.labels[0].tolist()
    # the answer is one token per character (SmolLM2 splits digits), then <|im_end|>: 11 targets, all at the end
    answer = [smol_tok.token_str(t) for t in ids[-11:]]
    assert answer == [*"1981-05-03", "<|im_end|>"]
    assert labels == [-100] * (len(ids) - 12) + ids[-11:] + [-100]
    conversation = [{"role": "user", "content": question}, {"role": "assistant", "content": "1981-05-03"}]
    assert smol_tok.decode(ids) + "\n" == reference_template(conversation, False)
    assert smol_tok.decode(ids[:-11]) == reference_template(conversation[:1], True)
    assert SMOLLM2_SYSTEM_PROMPT in smol_tok.decode(ids)
    assert ids == encode_chat(smol_tok, conversation, add_generation_prompt=False)[:-1]  # the real chat's tokens
    system = encode_instructions(smol_tok, [(question, "1981-05-03")], context_length=128, system="Be exact.")
    assert smol_tok.decode(system.ids[0].tolist()) + "\n" == reference_template(
        [{"role": "system", "content": "Be exact."}, *conversation], False)


def test_an_example_longer_than_the_context_is_refused(byte_tok):
    pairs = [("ab", "c"), ("abcd", "efg")]  # 34 and 38 tokens (system message left out: "S")
    assert [len(x) for x in encode_instructions(byte_tok, pairs, context_length=38, system="S").ids] == [34, 38]
    with pytest.raises(ValueError, match=r"example 1 is 38 tokens long \(34 of prompt, 4 of answer and <\|im_end\|>"
                                         r"\), more than the context length 37"):
        encode_instructions(byte_tok, pairs, context_length=37, system="S")
    with pytest.raises(TypeError, match=r"pairs\[1\] must be a \(prompt, answer\) pair of strings"):
        encode_instructions(byte_tok, [("a", "b"), ("a", 3)], context_length=64)
    with pytest.raises(ValueError, match="pairs is empty"):
        encode_instructions(byte_tok, [], context_length=64)
    with pytest.raises(TypeError, match="special_ids"):
        encode_instructions(BPETokenizer(()), pairs, context_length=64)


def test_instruction_messages_put_shots_before_the_question():
    assert instruction_messages("Q", shots=[("q1", "a1"), ("q2", "a2")], system="S") == [
        {"role": "system", "content": "S"}, {"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "q2"}, {"role": "assistant", "content": "a2"}, {"role": "user", "content": "Q"}]
    assert instruction_messages("Q") == [{"role": "user", "content": "Q"}]
    with pytest.raises(TypeError, match=r"shots\[0\] must be a \(prompt, answer\) pair"):
        instruction_messages("Q", shots=["q1"])


# ---- batches and the masked loss -------------------------------------------------------------------------

PAIRS = [("ab", "c"), ("a longer question", "answer"), ("q", "1981-05-03"), ("why?", "because")]


def test_batches_are_reproducible_and_padded_right(byte_tok):
    data = encode_instructions(byte_tok, PAIRS, context_length=128, system="S")
    (ids,), targets = instruction_batches(data, 6, 128, torch.Generator().manual_seed(5))
    (ids2,), targets2 = instruction_batches(data, 6, 128, torch.Generator().manual_seed(5))
    assert torch.equal(ids, ids2) and torch.equal(targets, targets2)
    picked = torch.randint(len(PAIRS), (6,), generator=torch.Generator().manual_seed(5)).tolist()
    assert ids.shape == targets.shape == (6, max(len(data.ids[i]) for i in picked))
    for row, i in enumerate(picked):
        n = len(data.ids[i])
        assert torch.equal(ids[row, :n], data.ids[i]) and torch.equal(targets[row, :n], data.labels[i])
        assert (ids[row, n:] == END).all() and (targets[row, n:] == -100).all()
    longest = ids.shape[1]
    with pytest.raises(ValueError, match=f"a batch holds an example of {longest} tokens, more than context_length 20"):
        instruction_batches(data, 6, 20, torch.Generator().manual_seed(5))
    with pytest.raises(TypeError, match="data must be an InstructionData"):
        instruction_batches([data.ids], 2, 128, torch.Generator())


def test_masked_loss_is_the_cross_entropy_of_the_answers(byte_tok):
    data = encode_instructions(byte_tok, PAIRS, context_length=128, system="S")
    (ids,), targets = instruction_batches(data, 8, 128, torch.Generator().manual_seed(1))
    model = _tiny_gpt(byte_tok.vocab_size)
    with torch.no_grad():
        logits, loss = model(ids, targets)
    picked = torch.randint(len(PAIRS), (8,), generator=torch.Generator().manual_seed(1)).tolist()
    rows, positions, answer_tokens = [], [], []
    for row, i in enumerate(picked):
        prompt, answer = PAIRS[i]
        p = len(encode_chat(byte_tok, [{"role": "system", "content": "S"}, {"role": "user", "content": prompt}]))
        full = _bytes(answer) + [END]  # position p - 1 + k predicts the answer's token k, the last <|im_end|>
        rows += [row] * len(full)
        positions += range(p - 1, p - 1 + len(full))
        answer_tokens += full
        with torch.no_grad():  # right padding changes nothing before it: the example alone has the same logits
            alone, _ = model(data.ids[i][None])
        torch.testing.assert_close(logits[row, :len(data.ids[i])], alone[0], atol=1e-5, rtol=1e-5)
    assert torch.equal(ids[rows, [q + 1 for q in positions]], torch.tensor(answer_tokens))
    expected = F.cross_entropy(logits[rows, positions], torch.tensor(answer_tokens))
    torch.testing.assert_close(loss, expected)
    assert (targets != -100).sum() == len(answer_tokens)


def test_train_accepts_instruction_batches(byte_tok):
    data = encode_instructions(byte_tok, PAIRS, context_length=64, system="S")
    model = _tiny_gpt(byte_tok.vocab_size)
    start = copy.deepcopy(model)
    config = TrainConfig(batch_size=4, context_length=64, max_steps=20, learning_rate=3e-3, warmup_steps=0,
                         eval_interval=10, eval_batches=2, progress=False, device="cpu")
    history = train(model, data, data, config, batches=instruction_batches)
    (ids,), targets = instruction_batches(data, 4, 64, torch.Generator().manual_seed(config.seed))
    with torch.no_grad():  # step 1 drew its batch from a generator seeded with config.seed, before any update
        _, first = start(ids, targets)
    assert history.train_loss[0] == pytest.approx(first.item(), rel=1e-5)
    assert history.eval_step == [10, 20] and history.val_loss[1] < history.val_loss[0]


# ---- answers and scores ----------------------------------------------------------------------------------

def test_generate_answer_stops_at_im_end(byte_tok):
    # the reply follows "assistant\n": "\n" -> "4" -> "2" -> <|im_end|>; anything else -> "x"
    model = _successor_gpt(byte_tok.vocab_size, {ord("\n"): ord("4"), ord("4"): ord("2"), ord("2"): END}, ord("x"))
    assert generate_answer(model, byte_tok, "What is six times seven?") == "42"
    assert generate_answer(model, byte_tok, "Q", shots=[("q", "a")], system="S", max_new_tokens=3) == "42"
    assert generate_answer(model, byte_tok, "Q", max_new_tokens=2) == "42"
    assert generate_answer(model, byte_tok, "Q", max_new_tokens=1) == "4"
    score, predictions = exact_match_eval(model, byte_tok, [("a", "42"), ("b", " 42\n"), ("c", "41")])
    assert score == pytest.approx(2 / 3) and predictions == ["42", "42", "42"]
    with pytest.raises(ValueError, match="max_new_tokens must be an integer >= 1"):
        generate_answer(model, byte_tok, "Q", max_new_tokens=0)


def test_generate_answer_is_greedy_decoding_of_the_chat_prompt(byte_tok):
    model = _tiny_gpt(byte_tok.vocab_size, seed=1)
    shots = [("q1", "a1"), ("q2", "a2")]
    text = ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nq1<|im_end|>\n<|im_start|>assistant\na1"
            "<|im_end|>\n<|im_start|>user\nq2<|im_end|>\n<|im_start|>assistant\na2<|im_end|>\n<|im_start|>user\n"
            "Q?<|im_end|>\n<|im_start|>assistant\n")
    ids = byte_tok.encode(text)  # the chat written out by hand; encode turns the special tokens' text into ids
    reply = []
    with torch.no_grad():
        for _ in range(12):  # greedy, without the KV cache
            nxt = int(model(torch.tensor([ids + reply]))[0][0, -1].argmax())
            if nxt == END:
                break
            reply.append(nxt)
    got = generate_answer(model, byte_tok, "Q?", shots=shots, system="Be brief.", max_new_tokens=12)
    assert got == byte_tok.decode(reply)


def test_exact_match_eval_shows_progress(byte_tok, capsys):
    model = _successor_gpt(byte_tok.vocab_size, {ord("\n"): END}, ord("x"))
    assert exact_match_eval(model, byte_tok, [("a", " ")], progress=True) == (1.0, [""])
    assert "exact match" in capsys.readouterr().err
    with pytest.raises(ValueError, match="pairs is empty"):
        exact_match_eval(model, byte_tok, [])


def test_instruction_data_checks_its_fields():
    x = torch.tensor([1, 2, 3])
    with pytest.raises(ValueError, match="example 0: ids has 3 tokens but labels 2"):
        InstructionData([x], [x[:2]], 0)
    with pytest.raises(TypeError, match=r"labels\[0\] must be a non-empty 1-D int64 tensor"):
        InstructionData([x], [x.float()], 0)
    with pytest.raises(ValueError, match="pad_id must be a token id"):
        InstructionData([x], [x], -1)


# ---- batched answers ------------------------------------------------------------------------------------------

def _ending_gpt(vocab_size: int, seed: int) -> GPT:
    """A tiny random GPT in float64 (no argmax near-ties) whose <|im_end|> logit is boosted, so that some replies end
    within a few tokens and others run to max_new_tokens."""
    model = _tiny_gpt(vocab_size, seed=seed).double()
    with torch.no_grad():
        model.unembedding.weight[END] *= 4.0
    return model


def _questions(n: int) -> list[str]:
    return [f"Q {source}" for source, _ in date_examples(n, split="held_out")]


@pytest.mark.parametrize("shots, batch_size", [((), 1), ((), 3), ([("q1", "a1"), ("q2 longer", "a2")], 4),
                                               ([("q1", "a1")], 64)])
def test_batched_answers_are_the_one_at_a_time_answers(byte_tok, shots, batch_size):
    model = _ending_gpt(byte_tok.vocab_size, seed=2)
    prompts = _questions(14)
    assert len({len(p) for p in prompts}) < len(prompts)  # some prompts share a length: real batches
    one = [generate_answer(model, byte_tok, p, shots=shots, system="Be brief.", max_new_tokens=6) for p in prompts]
    batched = generate_answers(model, byte_tok, prompts, shots=shots, system="Be brief.", max_new_tokens=6,
                               batch_size=batch_size)
    assert batched == one
    predictions = evaluate_answers(model, byte_tok, [(p, "x") for p in prompts], shots=shots, system="Be brief.",
                                   max_new_tokens=6, batch_size=batch_size)
    assert [p.text for p in predictions] == one
    ended = [p.ended for p in predictions]
    assert any(ended) and not all(ended)  # rows leave their batch early, others write all 6 tokens


def test_batched_answers_in_float32_and_with_one_prompt(byte_tok):
    model = _tiny_gpt(byte_tok.vocab_size, seed=3)
    prompts = _questions(6)
    one = [generate_answer(model, byte_tok, p, system="S", max_new_tokens=5) for p in prompts]
    assert generate_answers(model, byte_tok, prompts, system="S", max_new_tokens=5) == one
    assert generate_answers(model, byte_tok, prompts[:1], system="S", max_new_tokens=5) == one[:1]
    assert model.training is False


def test_evaluate_answers_records_every_prediction(byte_tok):
    # the reply is "42" then <|im_end|>, or with max_new_tokens=1 only "4", unended
    model = _successor_gpt(byte_tok.vocab_size, {ord("\n"): ord("4"), ord("4"): ord("2"), ord("2"): END}, ord("x"))
    pairs = [(f"Write: {s}", a) for s, a in date_examples(3, split="held_out")] + [("Six times seven?", " 42\n")]
    predictions = evaluate_answers(model, byte_tok, pairs, system="S")
    assert [(p.id, p.expected, p.text, p.ended, p.answer) for p in predictions] == [
        (i, a, "42", True, "42") for i, (_, a) in enumerate(pairs)]
    assert [p.format for p in predictions] == [date_format(s) for s, _ in date_examples(3, split="held_out")] + [
        "other"]
    assert [p.correct for p in predictions] == [False, False, False, True]
    score, _ = exact_match_eval(model, byte_tok, pairs, system="S")
    assert score == sum(p.correct for p in predictions) / len(pairs)
    cut = evaluate_answers(model, byte_tok, pairs[:1], system="S", max_new_tokens=1)[0]
    assert (cut.text, cut.ended) == ("4", False)


def test_batched_answers_refuse_what_they_cannot_do(byte_tok):
    model = _tiny_gpt(byte_tok.vocab_size)
    with pytest.raises(ValueError, match="do not fit the model's context of 512"):
        generate_answers(model, byte_tok, ["x" * 600])
    with pytest.raises(ValueError, match="batch_size must be an integer >= 1"):
        generate_answers(model, byte_tok, ["x"], batch_size=0)
    with pytest.raises(TypeError, match="prompts must be a non-empty list"):
        generate_answers(model, byte_tok, "x")
    with pytest.raises(ValueError, match="pairs is empty"):
        evaluate_answers(model, byte_tok, [])


# ---- input formats and shots -----------------------------------------------------------------------------------

@pytest.mark.parametrize("source, name", [
    ("twenty-first of march nineteen seventy-nine", "D of M Y"),
    ("tuesday, the twenty-first of march, nineteen seventy-nine", "the D of M, Y"),
    ("march twenty-first, two thousand and five", "M D, Y"),
    ("march the first twenty twelve", "M the D Y"),
    ("sunday, thirtieth april nineteen oh five", "D M Y"),
    ("march twenty-one, nineteen hundred", "M N, Y"),
    ("march nineteen seventy-nine", "M Y"), ("march of two thousand", "M of Y"),
    ("december, two thousand forty-seven", "M, Y"),
    ("twenty twelve", "Y"), ("the year two thousand and two", "the year Y")])
def test_date_format_names_each_wording(source, name):
    assert date_format(source) == name and name in DATE_FORMATS


@pytest.mark.parametrize("source", ["1979-03-21", "march", "tuesday, march nineteen seventy-nine",
                                    "the year", "twenty-first of march", "march thirty-second, twenty twelve"])
def test_date_format_refuses_other_text(source):
    with pytest.raises(ValueError, match="not a date of the dates task"):
        date_format(source)


def test_every_date_of_the_task_has_a_format():
    sources = [s for s, _ in date_examples(600) + date_examples(300, split="held_out")]
    assert {date_format(s) for s in sources} == set(DATE_FORMATS) and len(DATE_FORMATS) == 11


def test_format_shots_cover_every_format_with_training_dates():
    shots = format_shots()
    assert shots == format_shots(0) and shots != format_shots(1)
    sources = [p[len(INSTRUCTION) - len("{date}"):] for p, _ in shots]
    assert all(p == INSTRUCTION.format(date=s) for (p, _), s in zip(shots, sources))
    assert sorted(date_format(s) for s in sources) == sorted(DATE_FORMATS)
    assert any(s.split(",")[0] in {"monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday"}
               for s in sources)
    train = date_examples(2000)
    assert all((s, a) in train for s, (_, a) in zip(sources, shots))  # training dates, in their order
    assert [train.index((s, a)) for s, (_, a) in zip(sources, shots)] == sorted(
        train.index((s, a)) for s, (_, a) in zip(sources, shots))
    assert not {a for _, a in shots} & {a for _, a in date_instructions("test", 1000)}
    assert format_shots(instruction="Date? {date}")[0][0] == "Date? " + sources[0]


# ---- errors ---------------------------------------------------------------------------------------------------

SHOTS = [("q", "1999-04-09"), ("q", "2031-11"), ("q", "1950")]


@pytest.mark.parametrize("expected, answer, kind", [
    ("2022-04-28", "2022-04-28", None), ("2022-04-28", " 2022-04-28\n", None),
    ("2022-04-28", "28-04-2022", "format"), ("2022-04-28", "2022-4-28", "format"),
    ("2022-04-28", "2022-04", "format"), ("2005-03", "2005-03-01", "format"), ("2012", "The year 2012", "format"),
    ("2022-04-28", "２０２２-04-28", "format"), ("2022-05-28", "1999-04", "format"),
    ("2022-05-28", "2022-04-28", "copy"),      # month 04 is the first shot's month
    ("2022-05-28", "2022-05-09", "copy"),      # day 09 is the first shot's day
    ("2022-05", "2031-05", "copy"),            # year 2031 is the second shot's year
    ("2022-05-28", "1950-05-28", "copy"),      # ... the third shot's year
    ("2022-05-28", "2022-06-28", "value"),
    ("1999-05-28", "1999-05-27", "value"),     # the right year equals a shot's: not a copy
    ("2022-05", "2022-09", "value"),           # 09 is a shot's day, not a month
    ("2022-05-28", "2022-13-28", "value"),     # ISO-shaped: an impossible month is a wrong value
])
def test_error_kind_by_hand(expected, answer, kind):
    assert error_kind(expected, answer, SHOTS) == kind
    if kind == "copy":
        assert error_kind(expected, answer) == "value"  # without shots nothing is a copy


def test_iso_and_wrong_fields_by_hand():
    assert iso_fields(" 2005-03\n") == ("2005", "03") and iso_fields("2005") == ("2005",)
    assert iso_fields("2005-3") is None and iso_fields("05-03-2005") is None and iso_fields("2005-03-01-02") is None
    assert wrong_fields("1981-05-03", "1981-04-03") == ("month",)
    assert wrong_fields("1981-05-03", "1918-05-30") == ("year", "day")
    assert wrong_fields("1981-05", "1981-05") == ()
    with pytest.raises(ValueError, match="cannot be compared"):
        wrong_fields("1981-05-03", "1981-05")
    with pytest.raises(ValueError, match="expected must be an ISO date"):
        error_kind("May 1981", "1981-05")
    assert ERROR_KINDS == ("format", "copy", "value")


def test_error_breakdown_and_scores_by_hand():
    def pred(i, fmt, expected, answer):
        return Prediction(i, fmt, expected, answer, True, answer.strip())

    predictions = [pred(0, "D M Y", "2022-05-28", "2022-05-28"), pred(1, "D M Y", "2022-05-28", "2022-04-28"),
                   pred(2, "M Y", "2022-05", "2022-06"), pred(3, "Y", "2012", "12"),
                   pred(4, "D M Y", "2022-05-28", "1923-05-09"), pred(5, "Y", "2012", " 2012")]
    found = error_breakdown(predictions, SHOTS)
    assert found == {"n": 6, "correct": 2, "kinds": {"format": 1, "copy": 2, "value": 1},
                     "fields": {"year": 1, "month": 2, "day": 1},
                     "by_format": {"D M Y": [1, 3], "M Y": [0, 1], "Y": [1, 2]}}
    assert error_breakdown(predictions)["kinds"] == {"format": 1, "copy": 0, "value": 3}
    scored = score_predictions(predictions, SHOTS)
    assert (scored["n"], scored["correct"], scored["exact_match"]) == (6, 2, 2 / 6)
    from groundup.significance import wilson_interval
    assert scored["interval"] == list(wilson_interval(2, 6))
    assert scored["kinds"] == found["kinds"] and scored["by_format"] == found["by_format"]
    with pytest.raises(ValueError, match="nothing to score"):
        score_predictions([])
    with pytest.raises(TypeError, match="Prediction objects"):
        error_breakdown(["2012"])
