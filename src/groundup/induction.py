"""The induction task and attention-only transformers (chapter 14; Elhage et al. 2021, Olsson et al. 2022).

A sequence of random tokens whose second half repeats the first, ``[A B C D | A B C D]``, can be predicted in its
second half only by looking back: at the second ``B``, find the earlier ``B``, read the token after it (``C``)
and copy it. A two-layer attention-only transformer learns this with two heads working together: a
*previous-token head* in layer 0 writes "the token before me" into every position, and an *induction head* in
layer 1 matches its current token against that written information (K-composition) and copies the token it
lands on. :mod:`groundup.interpretability` has the scores, ablations and patching that find them.

* :func:`repeated_random_tokens` -- the sequences; :func:`induction_targets` marks the predictable positions;
* :class:`AttentionOnlyConfig` -- a :class:`~groundup.models.GPTConfig` whose blocks have no FFN;
* :func:`in_context_loss` -- the loss on the repeated half, the number that shows the phase change;
* :func:`random_repeats` -- training sequences whose repeat distance varies, and :func:`induction_batches`, their
  batches for :func:`groundup.training.train` (``batches=``);
* :func:`hand_built_induction_model` -- a two-layer model whose weights are set by hand to do induction.

A recipe measured on one CPU thread: ``AttentionOnlyConfig(vocab_size=64, context_length=32, d_model=64,
n_heads=4, positional="rope", tie_weights=False)``, ``train(model, 64, 64, TrainConfig(batch_size=32,
max_steps=2000, learning_rate=3e-3, warmup_steps=20, weight_decay=0.0, eval_batches=4), batches=induction_batches)``
(seeds 0, 1, 2; 105-138 s each on a shared machine): the in-context loss on a fixed batch of
``repeated_random_tokens(256, 16, 64)`` falls from about 4.6 to about 4 within 100 steps, declines slowly to about 3.5
by step 250, then falls within 100-125 steps (the runs stored by ``tools/ch14_results.py`` in
``groundup/results/chapter14.json``, windows by that tool's stated rule: seed 0 250-350, seed 1 250-350, seed 2
225-350) and ends at 0.07. Each run then has one layer-0 head with previous-token score 0.89-0.99 and layer-1 heads
with induction scores 0.82-0.92. The token embedding starts at the package's N(0, 0.02²); with rows at RMS 1 (the
untied default before chapter 3's runs changed it; the runs stored at commit a2e3944) the same recipe sat near 3
until step 675-850 and fell within 175 steps. With learned absolute positions (seed 0, the same steps, learning
rates 1e-3 and 3e-3; runs made while writing chapter 14, not stored) no induction head formed (largest induction
score 0.16, in-context loss 2.46 and 2.31 at the end); on fixed-length repeats a one-layer positional shortcut forms
instead (see :func:`random_repeats`).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch

from groundup.models import GPT, GPTConfig
from groundup.utils import positive_int

IGNORE = -100
"""The target value :func:`torch.nn.functional.cross_entropy` (and :class:`GPT`'s loss) skips."""


def repeated_random_tokens(n_seq: int, half_len: int, vocab_size: int,
                           generator: torch.Generator | None = None) -> torch.Tensor:
    """``n_seq`` sequences of ``2 * half_len`` token ids: ``half_len`` uniform random ids, then the same again.

    Returns a ``torch.long`` tensor ``(n_seq, 2 * half_len)`` with ``out[:, half_len:] == out[:, :half_len]``.
    The ids are drawn independently (with replacement) from ``0 .. vocab_size - 1`` by ``generator`` (the global
    generator when None), so a token may also occur twice within a half.
    """
    n_seq, half_len = positive_int("n_seq", n_seq), positive_int("half_len", half_len)
    vocab_size = positive_int("vocab_size", vocab_size)
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
    first = torch.randint(0, vocab_size, (n_seq, half_len), generator=generator)
    return torch.cat([first, first], dim=1)


def _check_repeated(tokens) -> int:
    if not isinstance(tokens, torch.Tensor) or tokens.dtype.is_floating_point or tokens.dtype == torch.bool:
        got = tokens.dtype if isinstance(tokens, torch.Tensor) else type(tokens).__name__
        raise TypeError(f"tokens must be an integer torch.Tensor of token ids, got {got}")
    if tokens.dim() != 2 or tokens.shape[1] < 4 or tokens.shape[1] % 2:
        raise ValueError(f"tokens must have shape (batch, 2 * half_len) with half_len >= 2 (from "
                         f"repeated_random_tokens), got {tuple(tokens.shape)}")
    half = tokens.shape[1] // 2
    if not torch.equal(tokens[:, half:], tokens[:, :half]):
        raise ValueError("tokens must repeat: the second half of every row must equal its first half")
    return half


def induction_targets(tokens: torch.Tensor) -> torch.Tensor:
    """Next-token targets for repeated sequences, with only the predictable positions kept.

    With ``H = half_len`` and positions ``0 .. 2H-1``, position ``p`` predicts the token at ``p + 1``. The tokens
    at ``H + 1 .. 2H - 1`` repeat the ones after an earlier copy of the current token, so they can be predicted
    from the context; the first half is random and the token at ``H`` (the start of the repeat) cannot be known.
    So ``targets[:, p] = tokens[:, p + 1]`` for ``p = H .. 2H - 2`` and ``IGNORE`` (-100) elsewhere: ``H - 1``
    targets per sequence.
    """
    half = _check_repeated(tokens)
    targets = torch.full_like(tokens, IGNORE)
    targets[:, half:-1] = tokens[:, half + 1:]
    return targets


def in_context_loss(model: GPT, tokens: torch.Tensor) -> float:
    """The in-context loss: the mean next-token cross-entropy (nats) over the repeated half's predictable tokens.

    ``tokens`` from :func:`repeated_random_tokens`; the targets are :func:`induction_targets`. A model that
    ignores the context scores at best ``ln(vocab_size)`` (the tokens are uniform); a model that copies from
    the first half scores near 0. Computed without gradients, in eval mode (the mode is restored).
    """
    targets = induction_targets(tokens)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            _, loss = model(tokens, targets)
    finally:
        model.train(was_training)
    return float(loss)


def random_repeats(n_seq: int, length: int, vocab_size: int, generator: torch.Generator | None = None, *,
                   min_half: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequences that repeat a random segment after a random prefix, with varying lengths: ``(tokens, targets)``.

    Each row of ``length`` tokens is ``[prefix, A, A]``: a segment ``A`` of ``H`` uniform random tokens, ``H``
    drawn uniformly from ``min_half .. length // 2`` for each row, repeated once, after ``length - 2H`` random
    tokens. ``targets`` (same shape) holds the next token where it can be predicted from the context (the
    tokens 2 .. H of the second copy, as in :func:`induction_targets`) and ``IGNORE`` elsewhere.

    Why not train on :func:`repeated_random_tokens` alone: there the copy is always exactly ``H`` positions back,
    so a single layer with learned positions can attend to position ``i - H + 1`` by position alone, without
    reading the tokens -- a positional shortcut, not induction (measured: a one-layer head then scores 0.86 on
    :func:`~groundup.interpretability.induction_scores`). A varying distance leaves only the content-based
    mechanism, previous-token head and induction head, which then also works on the fixed-length test sequences.
    """
    n_seq, length = positive_int("n_seq", n_seq), positive_int("length", length)
    vocab_size, min_half = positive_int("vocab_size", vocab_size), positive_int("min_half", min_half)
    if min_half < 2 or 2 * min_half > length:
        raise ValueError(f"min_half must be in 2 .. length // 2 = {length // 2}, got {min_half}")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
    tokens = torch.randint(0, vocab_size, (n_seq, length), generator=generator)
    halves = torch.randint(min_half, length // 2 + 1, (n_seq,), generator=generator)
    targets = torch.full_like(tokens, IGNORE)
    for row, h in enumerate(halves.tolist()):
        start = length - 2 * h
        tokens[row, start + h:] = tokens[row, start:start + h]
        targets[row, start + h:-1] = tokens[row, start + h + 1:]
    return tokens, targets


def induction_batches(vocab_size: int, batch_size: int, context_length: int,
                      generator: torch.Generator) -> tuple[tuple[torch.Tensor], torch.Tensor]:
    """One training batch for :func:`groundup.training.train` with ``batches=induction_batches``.

    ``vocab_size`` is what ``train`` passes as its data (``train(model, vocab_size, vocab_size, config,
    batches=induction_batches)``); ``context_length`` is the length of a sequence. The rows come from
    :func:`random_repeats` (``min_half=4``), whose targets count only the predictable tokens: the training loss
    is an in-context loss. Returns ``((tokens,), targets)``.
    """
    tokens, targets = random_repeats(batch_size, context_length, vocab_size, generator)
    return (tokens,), targets


@dataclass
class AttentionOnlyConfig(GPTConfig):
    """A :class:`~groundup.models.GPTConfig` for an attention-only transformer: every block is
    ``x + Attn(LN(x))``, with no feed-forward network (``ffn=False``, read by
    :class:`~groundup.layers.TransformerBlock`). Two layers by default, as in Elhage et al. (2021).

    ``ffn`` is a field so that it shows in the configuration stored with a checkpoint; it must stay False (use
    :class:`GPTConfig` for blocks with an FFN). ``d_ff`` is kept (and ignored) so every other field means what
    it means in :class:`GPTConfig`.
    """

    n_layers: int = 2
    ffn: bool = False

    def __post_init__(self):
        if self.ffn is not False:
            raise ValueError(f"AttentionOnlyConfig has no FFN: ffn must be False (use GPTConfig for blocks with an "
                             f"FFN), got {self.ffn!r}")
        super().__post_init__()


def hand_built_induction_model(vocab_size: int, context_length: int, *, sharpness: float = 40.0,
                               confidence: float = 30.0, decoy_gain: float = 2.0) -> GPT:
    """A two-layer, two-heads-a-layer attention-only :class:`GPT` whose weights do induction, set by hand.

    The residual stream has five blocks of one-hot coordinates, ``d_model = 4 vocab_size + context_length``
    (plus one when that is odd, to split into two heads): ``TOK`` (the current token, from ``W_E``), ``POS`` (the
    position, from the learned positional embedding), ``PREV``, ``OUT`` and ``SCRATCH`` (all empty at the input).
    The norms are RMSNorms with γ = 1: every position's stream has the same squared norm (one per unit vector,
    ``decoy_gain ** 2`` per decoy write), so a norm multiplies all positions by the same factor, which the
    weights divide out.

    * Layer 1, head 0, the **previous-token head**: query ``POS_{i-1}`` (a shift of ``POS_i``), key ``POS_j``,
      so position ``i`` attends to ``i - 1`` (position 0 to itself); value ``TOK``, written to ``PREV``.
    * Layer 2, head 0, the **induction head**: query ``TOK_i``, key ``PREV_j``, so position ``i`` attends to the
      positions right after earlier copies of its token (position 0, whose ``PREV`` holds its own token, is
      pushed away by one more key coordinate); value ``TOK``, written to ``OUT``. This is K-composition: the
      key reads what head 1.0 wrote.
    * Heads 0.1 and 1.1 are **decoys**: each attends to its own position and writes ``decoy_gain`` times its
      token into ``SCRATCH``, which no later weight reads. With ``decoy_gain > 1`` their ``W_O`` slices and OV
      matrices are *larger* than the planted heads', so only the attention patterns (or an intervention) tell
      the heads apart, not the size of the weights.
    * The unembedding reads ``OUT``: the logit of token ``v`` is ``confidence`` times ``OUT_v`` (up to the final
      norm's common factor).

    ``sharpness`` is the gap between the matching and the other attention scores (after the 1/√d_head), so the
    softmax puts all but about ``exp(-sharpness)`` of the weight on the match. On sequences whose first half has
    no repeated token (e.g. a random permutation, repeated), the in-context loss is near 0.
    """
    v, n = positive_int("vocab_size", vocab_size), positive_int("context_length", context_length)
    for name, value in (("sharpness", sharpness), ("confidence", confidence), ("decoy_gain", decoy_gain)):
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value <= 0:
            raise ValueError(f"{name} must be a positive number, got {value!r}")
    d = 4 * v + n + (4 * v + n) % 2
    d_head = d // 2
    if d_head < max(n, v + 1):  # needs 4v >= n
        raise ValueError(f"context_length ({n}) must be at most 4 * vocab_size ({4 * v}) for the hand-built heads "
                         "to fit in d_head = d_model / 2")
    tok, pos, prev, out, scratch = 0, v, v + n, 2 * v + n, 3 * v + n  # where each block of coordinates starts
    config = AttentionOnlyConfig(vocab_size=v, context_length=n, d_model=d, n_layers=2, n_heads=2,
                                 positional="learned", norm="rmsnorm", bias=False, tie_weights=False)
    model = GPT(config)
    g = float(decoy_gain)
    # RMSNorm's factor d / |x|^2: layer 0 sees TOK + POS; layer 1 also PREV and g SCRATCH; the end also OUT, 2g SCRATCH
    s1, s2, s_f = math.sqrt(d / 2), math.sqrt(d / (3 + g * g)), math.sqrt(d / (4 + 4 * g * g))
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        for name, p in model.named_parameters():
            if name.endswith("norm_1.weight") or name == "final_norm.weight":
                p.fill_(1.0)
        model.token_embedding.weight[:, tok:tok + v] = torch.eye(v)
        model.position_embedding.weight[:, pos:pos + n] = torch.eye(n)
        att1, att2 = model.blocks[0].attention, model.blocks[1].attention
        h1 = slice(d_head, 2 * d_head)  # rows of head 1 in W_q / W_k / W_v, columns of head 1 in W_o
        for att, s in ((att1, s1), (att2, s2)):  # the decoys: attend to oneself, write g TOK into SCRATCH
            a = sharpness * math.sqrt(d_head) / s ** 2  # query scale: the score gap is `sharpness`
            att.W_q.weight[h1][:n, pos:pos + n] = a * torch.eye(n)
            att.W_k.weight[h1][:n, pos:pos + n] = torch.eye(n)
            att.W_v.weight[h1][:v, tok:tok + v] = torch.eye(v)
            att.W_o.weight[scratch:scratch + v, h1][:, :v] = g * torch.eye(v) / s
        a1 = sharpness * math.sqrt(d_head) / s1 ** 2
        a2 = sharpness * math.sqrt(d_head) / s2 ** 2
        # layer 0 (att1), head 0: previous token (query row r reads POS_{r+1}, key row r reads POS_r)
        for r in range(n - 1):
            att1.W_q.weight[r, pos + r + 1] = a1
        att1.W_k.weight[:n, pos:pos + n] = torch.eye(n)
        att1.W_v.weight[:v, tok:tok + v] = torch.eye(v)
        att1.W_o.weight[prev:prev + v, :v] = torch.eye(v) / s1
        # layer 1 (att2), head 0: induction (query TOK, key PREV; key coordinate v pushes position 0 away)
        att2.W_q.weight[:v, tok:tok + v] = a2 * torch.eye(v)
        att2.W_q.weight[v, tok:tok + v] = a2
        att2.W_k.weight[:v, prev:prev + v] = torch.eye(v)
        att2.W_k.weight[v, pos] = -2.0
        att2.W_v.weight[:v, tok:tok + v] = torch.eye(v)
        att2.W_o.weight[out:out + v, :v] = torch.eye(v) / s2
        model.unembedding.weight[:, out:out + v] = confidence / s_f * torch.eye(v)
    return model
