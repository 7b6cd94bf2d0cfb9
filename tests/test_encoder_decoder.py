"""groundup.models.EncoderDecoder and groundup.seq2seq: the architecture's masks against perturbations and PyTorch's
nn.Transformer, padding, errors, decoding (greedy and beam search), checkpoints, the dates task, and a short run that
learns a tiny task to 100 %."""

import dataclasses
import itertools

import pytest
import torch
from torch import nn

from groundup.models import EncoderDecoder, EncoderDecoderConfig
from groundup.seq2seq import (
    END,
    PAD,
    START,
    Seq2SeqData,
    Seq2SeqTokenizer,
    batches,
    beam_search,
    collate,
    cross_attention_weights,
    date_examples,
    date_splits,
    date_tokenizers,
    encode_pairs,
    exact_match,
    greedy_decode,
    sequence_log_prob,
)
from groundup.training import TrainConfig, load_checkpoint, save_checkpoint, train
from groundup.utils import threads

SMALL = dict(src_vocab_size=11, tgt_vocab_size=9, context_length=8, d_model=16, n_heads=2, n_encoder_layers=2,
             n_decoder_layers=2)


def model(seed=0, **kw):
    torch.manual_seed(seed)
    return EncoderDecoder(EncoderDecoderConfig(**{**SMALL, **kw})).eval()


def loud(m, seed=0):
    """Weights far from the small initialisation, so that every dependency shows clearly in the outputs."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "norm" not in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return m


def ids(rows):
    return torch.tensor(rows, dtype=torch.long)


SRC = ids([[5, 6, 7, 8, 9], [4, 3, 10, 0, 0]])  # the second source is padded
TGT_IN = ids([[START, 3, 4, 5], [START, 6, 0, 0]])
TARGETS = ids([[3, 4, 5, END], [6, END, 0, 0]])


# --- the architecture: which positions see which ------------------------------------------------------------------


def test_the_encoder_is_bidirectional():
    m = loud(model())
    memory, _ = m.encode(SRC[:1])
    changed = SRC[:1].clone()
    changed[0, 4] = 3  # change the last source token
    memory2, _ = m.encode(changed)
    diff = (memory - memory2).abs().amax(-1)[0]
    assert (diff[:4] > 1e-2).all(), "every earlier position sees the later token"


@pytest.mark.parametrize("norm_position", ["pre", "post"])
def test_the_decoder_is_causal(norm_position):
    m = loud(model(norm_position=norm_position))
    logits, _ = m(SRC[:1], TGT_IN[:1])
    changed = TGT_IN[:1].clone()
    changed[0, 2] = 7
    logits2, _ = m(SRC[:1], changed)
    diff = (logits - logits2).abs().amax(-1)[0]
    assert torch.equal(diff[:2], torch.zeros(2)), "positions before the change see nothing of it"
    assert (diff[2:] > 1e-2).all(), "the changed position and those after it do"


def test_every_decoder_position_reads_the_whole_source_through_cross_attention():
    m = loud(model())
    logits, _ = m(SRC[:1], TGT_IN[:1])
    changed = SRC[:1].clone()
    changed[0, 4] = 3
    logits2, _ = m(changed, TGT_IN[:1])
    assert ((logits - logits2).abs().amax(-1)[0] > 1e-2).all()


def test_padded_positions_change_nothing():
    m = model()
    logits, loss = m(SRC, TGT_IN, TARGETS)
    # the same two examples alone, without any padding
    alone = [m(SRC[i:i + 1, :n], TGT_IN[i:i + 1, :t], TARGETS[i:i + 1, :t]) for i, n, t in ((0, 5, 4), (1, 3, 2))]
    torch.testing.assert_close(logits[0], alone[0][0][0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits[1, :2], alone[1][0][0], atol=1e-5, rtol=1e-5)
    # the batch loss is the mean over the 4 + 2 real target positions
    torch.testing.assert_close(loss, (4 * alone[0][1] + 2 * alone[1][1]) / 6, atol=1e-6, rtol=1e-6)
    # more padding, on both sides, changes nothing either
    more, more_loss = m(torch.cat([SRC, torch.zeros(2, 3, dtype=torch.long)], 1),
                        torch.cat([TGT_IN, torch.zeros(2, 2, dtype=torch.long)], 1),
                        torch.cat([TARGETS, torch.zeros(2, 2, dtype=torch.long)], 1))
    torch.testing.assert_close(more[:, :4], logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(more_loss, loss, atol=1e-6, rtol=1e-6)


def test_padded_source_positions_get_no_cross_attention_and_rows_sum_to_one():
    m = model()
    weights = cross_attention_weights(m, SRC, TGT_IN)
    assert len(weights) == 2 and weights[0].shape == (2, 2, 4, 5)
    for w in weights:
        assert torch.equal(w[1, :, :, 3:], torch.zeros(2, 4, 2))
        torch.testing.assert_close(w.sum(-1), torch.ones(2, 2, 4))


def test_the_loss_is_the_cross_entropy_of_the_real_positions_only():
    m = model()
    logits, loss = m(SRC, TGT_IN, TARGETS)
    real = TARGETS != PAD
    expected = nn.functional.cross_entropy(logits[real], TARGETS[real])
    torch.testing.assert_close(loss, expected)
    _, loss100 = m(SRC, TGT_IN, TARGETS.masked_fill(~real, -100))  # -100 is ignored as well
    torch.testing.assert_close(loss100, loss)


# --- against PyTorch's nn.Transformer ----------------------------------------------------------------------------


def _copy_attention(ours, theirs):
    theirs.in_proj_weight.copy_(torch.cat([ours.W_q.weight, ours.W_k.weight, ours.W_v.weight]))
    theirs.in_proj_bias.copy_(torch.cat([ours.W_q.bias, ours.W_k.bias, ours.W_v.bias]))
    theirs.out_proj.load_state_dict(ours.W_o.state_dict())


def torch_transformer_like(m: EncoderDecoder) -> nn.Transformer:
    """PyTorch's nn.Transformer with the weights of our encoder and decoder stacks copied in."""
    c = m.config
    ref = nn.Transformer(c.d_model, c.n_heads, c.n_encoder_layers, c.n_decoder_layers, c.d_ff, dropout=0.0,
                         activation="gelu", batch_first=True, norm_first=c.norm_position == "pre")
    with torch.no_grad():
        for ours, theirs in zip(m.encoder, ref.encoder.layers):
            _copy_attention(ours.attention, theirs.self_attn)
            theirs.linear1.load_state_dict(ours.ffn.W_in.state_dict())
            theirs.linear2.load_state_dict(ours.ffn.W_out.state_dict())
            theirs.norm1.load_state_dict(ours.norm_1.state_dict())
            theirs.norm2.load_state_dict(ours.norm_2.state_dict())
        for ours, theirs in zip(m.decoder, ref.decoder.layers):
            _copy_attention(ours.self_attention, theirs.self_attn)
            _copy_attention(ours.cross_attention, theirs.multihead_attn)
            theirs.linear1.load_state_dict(ours.ffn.W_in.state_dict())
            theirs.linear2.load_state_dict(ours.ffn.W_out.state_dict())
            for k in (1, 2, 3):
                getattr(theirs, f"norm{k}").load_state_dict(getattr(ours, f"norm_{k}").state_dict())
        if c.norm_position == "pre":
            ref.encoder.norm.load_state_dict(m.encoder_norm.state_dict())
            ref.decoder.norm.load_state_dict(m.decoder_norm.state_dict())
        else:  # Post-LN blocks end in a norm: no final norm (nn.Transformer always adds one)
            ref.encoder.norm, ref.decoder.norm = None, None
    return ref.eval()


@pytest.mark.filterwarnings("ignore::UserWarning")  # nn.Transformer's notes on its nested-tensor fast path
@pytest.mark.parametrize("norm_position", ["pre", "post"])
def test_the_model_equals_torch_nn_transformer_with_copied_weights(norm_position):
    m = model(norm_position=norm_position)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # random norm scales and shifts, so that the norms are really compared
        for name, p in m.named_parameters():
            if "norm" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5 + (1.0 if name.endswith("weight") else 0.0))
    ref = torch_transformer_like(m)
    logits, _ = m(SRC, TGT_IN)
    src_x, tgt_x = m._embed(SRC, m.src_embedding, "src"), m._embed(TGT_IN, m.tgt_embedding, "tgt")
    with torch.no_grad():
        out = ref(src_x, tgt_x, tgt_mask=~torch.ones(4, 4, dtype=torch.bool).tril(),  # torch: True = hidden
                  src_key_padding_mask=SRC == PAD, memory_key_padding_mask=SRC == PAD,
                  tgt_key_padding_mask=TGT_IN == PAD)
    real = TGT_IN != PAD
    torch.testing.assert_close(logits[real], m.unembedding(out)[real], atol=1e-5, rtol=1e-5)


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("norm_position", ["pre", "post"])
def test_a_decoder_layer_equals_torch_transformer_decoder_layer(norm_position):
    m = model(norm_position=norm_position)
    ref = torch_transformer_like(m).decoder.layers[0]
    x, memory = torch.randn(2, 4, 16), torch.randn(2, 5, 16)
    causal = torch.ones(4, 4, dtype=torch.bool).tril()
    ours = m.decoder[0](x, memory, mask=causal, memory_mask=(SRC != PAD)[:, None, None, :])
    with torch.no_grad():
        theirs = ref(x, memory, tgt_mask=~causal,
                     memory_key_padding_mask=SRC == PAD)
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)


# --- errors ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("args, error, match", [
    ((torch.ones(1, 9, dtype=torch.long), TGT_IN[:1]), ValueError, "src has length 9, which exceeds context_length 8"),
    ((SRC[:1], torch.ones(1, 9, dtype=torch.long)), ValueError, "tgt_in has length 9, which exceeds"),
    ((SRC[:1], ids([[3, 4, 5]])), ValueError, "must begin with the start token"),
    ((ids([[5, 11]]), TGT_IN[:1]), ValueError, r"src holds token ids from 5 to 11.*\[0, 10\]"),
    ((SRC[:1], ids([[START, 9]])), ValueError, r"tgt_in holds token ids .*\[0, 8\]"),
    ((ids([[-1, 4]]), TGT_IN[:1]), ValueError, "src holds token ids from -1"),
    ((ids([[0, 0]]), TGT_IN[:1]), ValueError, "src row 0 is all padding"),
    ((SRC.float(), TGT_IN), TypeError, "src must hold integer token ids"),
    ((SRC[0], TGT_IN), ValueError, r"src must have shape \(batch, seq\)"),
    ((SRC, TGT_IN[:1]), ValueError, "tgt_in has batch size 1 but memory 2"),
    ((SRC, TGT_IN, TARGETS[:, :3]), ValueError, "targets must have the same shape as tgt_in"),
    ((SRC, TGT_IN, ids([[3, 4, 5, END], [6, END, 7, 0]])), ValueError, "mismatched padding masks"),
    ((SRC, TGT_IN, ids([[3, 4, 5, END], [6, 0, 0, 0]])), ValueError, "mismatched padding masks"),
    ((SRC, TGT_IN, ids([[3, 4, 5, 9], [6, END, 0, 0]])), ValueError, r"targets must lie in \[0, 8\]"),
    ((SRC, TGT_IN, TARGETS.float()), TypeError, "targets must be an integer"),
])
def test_bad_input_is_a_clear_error(args, error, match):
    with pytest.raises(error, match=match):
        model()(*args)


def test_decode_refuses_a_padding_mask_that_does_not_match_memory():
    m = model()
    memory, src_mask = m.encode(SRC)
    with pytest.raises(ValueError, match="mismatched padding masks"):
        m.decode(TGT_IN, memory, src_mask[:, :4])
    with pytest.raises(ValueError, match="mismatched padding masks"):
        m.decode(TGT_IN, memory, src_mask.long())
    with pytest.raises(ValueError, match="memory must have shape"):
        m.decode(TGT_IN, memory[..., :8], src_mask)


@pytest.mark.parametrize("kw, match", [
    (dict(src_vocab_size=0), "src_vocab_size must be a positive integer"),
    (dict(start_id=9), r"start_id = 9 is outside the vocabulary \(size 9\)"),
    (dict(end_id=0), "three different ids"),
    (dict(positional="rope"), "positional must be one of"),
    (dict(d_model=15), "divisible by n_heads"),
    (dict(norm_position="middle"), "norm_position must be one of"),
    (dict(dropout=1.0), "dropout must be a number in"),
])
def test_bad_configs_are_clear_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        EncoderDecoderConfig(**{**SMALL, **kw})
    with pytest.raises(TypeError, match="EncoderDecoderConfig"):
        EncoderDecoder(SMALL)


def test_learned_positions_and_untied_weights_work_too():
    m = model(positional="learned", tie_weights=False)
    assert m.unembedding.weight is not m.tgt_embedding.weight
    tied = model()
    assert tied.unembedding.weight is tied.tgt_embedding.weight
    logits, loss = m(SRC, TGT_IN, TARGETS)
    assert logits.shape == (2, 4, 9) and torch.isfinite(loss)


# --- decoding ---------------------------------------------------------------------------------------------------


class Scripted(nn.Module):
    """A fake encoder-decoder whose next-token probabilities depend only on the decoder input so far.

    After [start]: token 3 with 0.6, token 4 with 0.4. After [start, 3]: 5 with 0.55, 6 with 0.45 (then the end).
    After [start, 4]: the end token with 0.9. So greedy picks 3 (and then 5: 0.6 · 0.55 · 1 = 0.33), while the
    most probable output is [4] with 0.4 · 0.9 = 0.36, which beam search with width 2 finds."""

    def __init__(self):
        super().__init__()
        self.config = EncoderDecoderConfig(src_vocab_size=8, tgt_vocab_size=8, context_length=6, d_model=4,
                                           n_heads=1)
        self.dummy = nn.Parameter(torch.zeros(1))

    def encode(self, src):
        return torch.zeros(src.shape[0], src.shape[1], 4), src != PAD

    def decode(self, tgt_in, memory, src_mask):
        out = torch.full((*tgt_in.shape, 8), 1e-9)
        for b, row in enumerate(tgt_in.tolist()):
            for i in range(len(row)):
                prefix = row[1:i + 1]
                table = {(): {3: 0.6, 4: 0.4}, (3,): {5: 0.55, 6: 0.45}, (4,): {END: 0.9, 7: 0.1}}.get(
                    tuple(prefix), {END: 1.0})
                for t, p in table.items():
                    out[b, i, t] = p
        return out.log()

    def forward(self, src, tgt_in, targets=None):
        return self.decode(tgt_in, *self.encode(src)), None


def test_beam_search_finds_a_more_probable_output_than_greedy():
    fake, src = Scripted(), ids([[3]])
    assert greedy_decode(fake, src) == [[3, 5]]
    assert beam_search(fake, src, beam_width=1) == [[3, 5]]
    out, scores = beam_search(fake, src, beam_width=2, return_scores=True)
    assert out == [[4]]
    assert scores[0] == pytest.approx(torch.tensor(0.36).log().item(), abs=1e-5)
    torch.testing.assert_close(sequence_log_prob(fake, ids([[3], [3]]), [[4], [3, 5]]),
                               torch.tensor([0.36, 0.33]).log())
    # length normalisation prefers the longer, per-token more probable output: mean log p of [3, 5, end] is
    # log(0.33)/3 = -0.37 > log(0.36)/2 = -0.51
    assert beam_search(fake, src, beam_width=2, length_penalty=1.0) == [[3, 5]]


def test_beam_width_1_is_greedy_and_decoding_stops_at_the_end_token():
    m = model(seed=3)
    src = ids([[5, 6, 7, 8], [4, 3, 0, 0], [9, 9, 9, 0]])
    greedy = greedy_decode(m, src)
    assert beam_search(m, src, beam_width=1) == greedy
    assert all(END not in row and START not in row and PAD not in row for row in greedy)
    # every greedy output is what the argmax of the full forward pass gives, position by position
    for i, row in enumerate(greedy):
        logits, _ = m(src[i:i + 1], torch.tensor([[START] + row]))
        picks = logits[0].argmax(-1).tolist()
        assert picks[:-1] == row and (picks[-1] == END or len(row) == m.config.context_length - 1)


def test_beam_search_never_scores_below_greedy_on_a_random_model():
    m = model(seed=4)
    src = ids([[5, 6, 7, 8], [4, 3, 0, 0], [9, 10, 9, 0], [3, 0, 0, 0]])
    greedy = sequence_log_prob(m, src, greedy_decode(m, src, max_len=4))
    out, scores = beam_search(m, src, beam_width=4, max_len=4, return_scores=True)
    torch.testing.assert_close(sequence_log_prob(m, src, out), torch.tensor(scores), atol=1e-5, rtol=1e-5)
    finished = [len(o) < 4 for o in out]
    assert all(s >= g - 1e-5 for s, g, f in zip(scores, greedy.tolist(), finished) if f)


def test_decoding_arguments_are_checked():
    m = model()
    with pytest.raises(ValueError, match="max_len must be an integer in"):
        greedy_decode(m, SRC, max_len=8)
    with pytest.raises(ValueError, match="beam_width must be a positive integer"):
        beam_search(m, SRC, beam_width=0)
    with pytest.raises(ValueError, match="src must be a"):
        greedy_decode(m, [[1, 2]])
    with pytest.raises(ValueError, match="as many predictions"):
        exact_match([[1]], [])
    assert exact_match(["a", "b", "c", "d"], ["a", "x", "c", "d"]) == 0.75


# --- checkpoints and training ------------------------------------------------------------------------------------


def test_checkpoint_round_trip(tmp_path):
    m = model(seed=5, positional="learned")
    save_checkpoint(tmp_path / "ed.pt", m, extra={"task": "dates"})
    loaded, ckpt = load_checkpoint(tmp_path / "ed.pt")
    assert type(loaded) is EncoderDecoder and ckpt["model_class"] == "EncoderDecoder"
    assert dataclasses.asdict(loaded.config) == dataclasses.asdict(m.config) and ckpt["extra"] == {"task": "dates"}
    assert torch.equal(loaded.eval()(SRC, TGT_IN)[0], m(SRC, TGT_IN)[0])


def test_a_short_deterministic_run_learns_a_tiny_task_to_100_percent():
    """Reverse 2 or 3 distinct symbols and rename each (target token = source token + 1): 80 examples."""
    pairs = [(list(s), [t + 1 for t in reversed(s)]) for n in (2, 3) for s in itertools.permutations(range(3, 8), n)]
    data = Seq2SeqData([s for s, _ in pairs], [t for _, t in pairs])
    cfg = TrainConfig(batch_size=32, max_steps=300, learning_rate=5e-3, warmup_steps=10, eval_interval=300,
                      eval_batches=2, weight_decay=0.0, progress=False)
    runs = []
    for steps in (10, 300):  # the same first 10 steps (the warm-up), then the whole run
        torch.manual_seed(0)
        m = EncoderDecoder(EncoderDecoderConfig(src_vocab_size=8, tgt_vocab_size=9, context_length=6, d_model=32,
                                                n_heads=2, n_encoder_layers=1, n_decoder_layers=1))
        with threads(1):
            history = train(m, data, data, dataclasses.replace(cfg, max_steps=steps, eval_interval=steps),
                            batches=batches)
        runs.append(history.train_loss[:10])
    assert runs[0] == runs[1], "the same seed gives the same run"
    assert exact_match(greedy_decode(m, collate(data.src)), data.tgt) == 1.0
    assert history.val_loss[-1] < 0.02


# --- the dates task -----------------------------------------------------------------------------------------------


def test_the_dates_task_is_deterministic_varied_and_splits_cleanly():
    train_pairs = date_examples(3000, split="train")
    assert train_pairs == date_examples(3000, split="train")
    assert train_pairs != date_examples(3000, split="train", seed=1)
    held_out = date_examples(600, split="held_out")
    assert len({s for s, _ in held_out}) == 600, "held-out sources are all different"
    assert not {t for _, t in train_pairs} & {t for _, t in held_out}, "no target (date) is in both splits"
    assert not {s for s, _ in train_pairs} & {s for s, _ in held_out}
    src_tok, tgt_tok = date_tokenizers()
    data = encode_pairs(train_pairs, src_tok, tgt_tok)
    src_lengths = {len(s) for s in data.src}
    assert min(src_lengths) <= 3 and max(src_lengths) >= 13, "sources from 'nineteen twelve' to long dates"
    assert {len(t) for t in data.tgt} == {4, 7, 10}, "ISO years, months and dates"
    sources = {}
    for s, t in train_pairs + held_out + date_examples(5000, split="train", seed=2):
        assert sources.setdefault(s, t) == t, f"{s!r} would have two answers"


def test_date_splits_are_the_chapters_three_sets():
    train_pairs, val_pairs, test_pairs = date_splits(300, 40, 60, seed=3)
    assert train_pairs == date_examples(300, split="train", seed=3)
    assert test_pairs == date_examples(60, split="held_out", seed=3)
    test_sources = {s for s, _ in test_pairs}
    assert val_pairs == [p for p in date_examples(200, split="held_out", seed=4) if p[0] not in test_sources][:40]
    assert len(val_pairs) == 40 and not {s for s, _ in val_pairs} & test_sources
    assert not {t for _, t in train_pairs} & {t for _, t in val_pairs + test_pairs}
    with pytest.raises(ValueError, match="n_val must be a positive integer"):
        date_splits(n_val=0)


def test_the_words_are_right():
    from groundup.seq2seq import date_to_words

    rng = __import__("random").Random(0)
    seen = {date_to_words("date", 1979, 3, 21, rng=rng) for _ in range(200)}
    assert ("wednesday, the twenty-first of march, nineteen seventy-nine", "1979-03-21") in seen  # the weekday is right
    assert ("march twenty-one, nineteen seventy-nine", "1979-03-21") in seen
    assert {date_to_words("year", 1905, rng=rng)[0] for _ in range(50)} == {"nineteen oh five",
                                                                             "the year nineteen oh five"}
    assert {date_to_words("year", 2000, rng=rng)[0] for _ in range(50)} == {"two thousand", "the year two thousand"}
    assert {date_to_words("month", 2012, 7, rng=rng)[0] for _ in range(200)} >= {
        "july twenty twelve", "july of two thousand and twelve", "july, two thousand twelve"}
    with pytest.raises(ValueError):
        date_to_words("date", 2023, 2, 29, rng=rng)
    with pytest.raises(ValueError, match="year must be in"):
        date_to_words("year", 1899, rng=rng)


def test_tokenizers_round_trip_and_refuse_unknown_tokens(tmp_path):
    src_tok, tgt_tok = date_tokenizers()
    text = "wednesday, the twenty-first of march, nineteen seventy-nine"
    encoded = src_tok.encode(text)
    assert len(encoded) == 13 and src_tok.decode(encoded) == text
    assert tgt_tok.decode(tgt_tok.encode("1979-03-21") + [END, 5]) == "1979-03-21"
    with pytest.raises(ValueError, match="'fortnight' is not in"):
        src_tok.encode("the fortnight")
    src_tok.save(tmp_path / "src.json")
    assert Seq2SeqTokenizer.load(tmp_path / "src.json") == src_tok


def test_batches_pad_and_shift_the_targets():
    data = Seq2SeqData([[5, 6, 7], [8]], [[3, 4], [5, 6, 7]])
    (src, tgt_in), targets = batches(data, 4, 8, torch.Generator().manual_seed(0))
    assert src.shape[0] == 4 and tgt_in.shape == targets.shape
    for ti, t in zip(tgt_in.tolist(), targets.tolist()):
        n = sum(x != PAD for x in t)
        assert ti[0] == START and ti[1:n] == t[:n - 1] and t[n - 1] == END
        assert all(x == PAD for x in ti[n:] + t[n:])
    src, tgt_in, targets = collate([[5, 6, 7], [8]], [[3, 4], [5, 6, 7]])
    assert src.tolist() == [[5, 6, 7], [8, 0, 0]]
    assert tgt_in.tolist() == [[START, 3, 4, 0], [START, 5, 6, 7]]
    assert targets.tolist() == [[3, 4, END, 0], [5, 6, 7, END]]
    with pytest.raises(ValueError, match="longer than context_length 3"):
        batches(data, 4, 3, torch.Generator().manual_seed(0))
