"""Generating text with a trained GPT (chapter 8): the decoder feeds its own predictions back.

* :func:`generate` -- the sampling loop: greedy (argmax) decoding or sampling with a temperature, top-k and
  top-p (nucleus) filtering, with or without a KV cache, for a batch of prompts;
* :func:`generate_batch` -- prompts of different lengths at once: left padding, an attention mask and a stop
  token per sequence;
* :func:`beam_search` -- keep the ``beam_width`` most probable continuations instead of sampling one; its step
  (:func:`beam_step`) and final choice (:func:`best_beam`) are shared with chapter 10's encoder-decoder
  (:func:`groundup.seq2seq.beam_search`);
* :func:`top_k_filter` -- keep the ``k`` largest logits of every distribution (Fan et al., 2018);
* :func:`top_p_filter` -- keep the smallest set of most probable tokens whose probability reaches ``p``
  (Holtzman et al., 2020);
* :func:`sampling_logits` -- the temperature and both filters in ``generate``'s order (the sampling view of
  :mod:`groundup.widgets` shows the same distribution).

The filters return new logits with the removed entries set to ``-inf`` (so a softmax gives them probability
exactly 0); they never modify their input.
"""

from __future__ import annotations

import contextlib
import inspect
import math

import torch
from torch import nn

from groundup.attention import reusing_stacked_weights

__all__ = ["generate", "generate_batch", "beam_search", "beam_step", "best_beam", "sampling_logits", "top_k_filter",
           "top_p_filter", "TOP_P_TOLERANCE"]

TOP_P_TOLERANCE = 1e-6
"""Probability mass by which a cumulative sum may fall short of ``p`` and still count as reaching it.

The seeds' example (bananas 0.1, cherries 0.05, fruit 0.03, p = 0.18) sums to 0.18 exactly in decimal, but in
floating point ``0.1 + 0.05 + 0.03`` may come out a few units of 1e-8 below 0.18, and a softmax adds errors of
the same size; without a tolerance the filter would then also keep the next token (cake).
"""


def _check_logits(logits) -> None:
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"logits must be a torch.Tensor, got {type(logits).__name__}")
    if not logits.is_floating_point():
        raise TypeError(f"logits must be a floating-point tensor, got dtype {logits.dtype}")
    if logits.dim() < 1 or logits.shape[-1] == 0:
        raise ValueError(f"logits must have shape (..., vocab_size) with vocab_size >= 1, got {tuple(logits.shape)}")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_top_k(k) -> None:
    if not _is_int(k) or k < 1:
        raise ValueError(f"top_k must be an integer >= 1 (or None for no top-k filtering), got {k!r}")


def _check_top_p(p) -> None:
    if not _is_number(p) or not 0.0 < p <= 1.0:  # also rejects nan
        raise ValueError(f"top_p must be a number in (0, 1] (or None for no top-p filtering), got {p!r}")


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the ``k`` largest logits along the last dimension; set every other entry to ``-inf``.

    A logit is kept when it is ``>=`` the k-th largest value, so tokens tied with the k-th are all kept (as in
    nanoGPT and Hugging Face's ``TopKLogitsWarper``) and the result may keep more than ``k`` tokens. A ``k``
    larger than the vocabulary keeps everything. Returns a new tensor; ``logits`` is not modified.
    """
    _check_logits(logits)
    _check_top_k(k)
    k = min(k, logits.shape[-1])
    kth_largest = torch.topk(logits, k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth_largest, float("-inf"))


def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Keep the smallest set of most probable tokens whose total probability reaches ``p`` (nucleus sampling).

    Along the last dimension the tokens are sorted by probability (softmax of ``logits``), most probable first,
    ties in index order. A token is kept when the probability of the tokens before it is still below ``p``, so
    the token whose probability makes the total cross (or reach) ``p`` is kept and at least one token always
    is. "Reaches" allows a shortfall of :data:`TOP_P_TOLERANCE` (1e-6) for floating-point rounding: with the
    seeds' probabilities bananas 0.1, cherries 0.05, fruit 0.03, cake 0.02 and ``p = 0.18``, bananas,
    cherries and fruit are kept and cake is not. ``p = 1`` keeps every token. Removed entries become ``-inf``;
    returns a new tensor, ``logits`` is not modified.
    """
    _check_logits(logits)
    _check_top_p(p)
    if p == 1.0:
        return logits.clone()
    work_dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    probs = torch.softmax(logits.to(work_dtype), dim=-1)
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # probability of the tokens ranked higher
    remove_sorted = mass_before >= p - TOP_P_TOLERANCE
    remove_sorted[..., 0] = False  # the most probable token always stays
    remove = torch.zeros_like(remove_sorted).scatter(-1, order, remove_sorted)
    return logits.masked_fill(remove, float("-inf"))


def _check_generate_args(model, idx, max_new_tokens, temperature, top_k, top_p, greedy, use_cache, generator):
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module such as groundup.models.GPT, got {type(model).__name__}")
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "context_length") or not hasattr(config, "vocab_size"):
        raise TypeError("model must have a config with context_length and vocab_size (a groundup.models.GPT)")
    if getattr(model, "causal", True) is False:
        raise TypeError(f"{type(model).__name__} is not a generator: it predicts the tokens at masked positions from "
                        "both sides, not the next token (chapter 9); use a GPT")
    if not isinstance(idx, torch.Tensor):
        raise TypeError(f"idx must be a torch.Tensor of token ids of shape (batch, seq), got {type(idx).__name__}")
    if idx.dtype.is_floating_point or idx.dtype.is_complex or idx.dtype == torch.bool:
        raise TypeError(f"idx must hold integer token ids (e.g. torch.long), got dtype {idx.dtype}")
    if idx.dim() != 2:
        raise ValueError(f"idx must have shape (batch, seq), got {tuple(idx.shape)}"
                         + ("; for a single prompt use idx.unsqueeze(0)" if idx.dim() == 1 else ""))
    if idx.shape[0] == 0:
        raise ValueError(f"idx must hold at least one prompt (batch >= 1), got shape {tuple(idx.shape)}")
    if idx.shape[1] == 0:
        raise ValueError("the prompt is empty (idx has shape (batch, 0)): give at least one token id per prompt, "
                         "e.g. a newline or a start token")
    lo, hi = int(idx.min()), int(idx.max())
    if lo < 0 or hi >= config.vocab_size:
        raise ValueError(f"idx holds token ids from {lo} to {hi}, outside the vocabulary: ids must be in "
                         f"[0, vocab_size - 1] = [0, {config.vocab_size - 1}]")
    if not _is_int(max_new_tokens) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
    if not _is_number(temperature) or not math.isfinite(temperature) or temperature <= 0:
        raise ValueError(f"temperature must be a finite number > 0 (1.0 samples from the model's own "
                         f"distribution; for argmax decoding use greedy=True), got {temperature!r}")
    if top_k is not None:
        _check_top_k(top_k)
    if top_p is not None:
        _check_top_p(top_p)
    for name, value in (("greedy", greedy), ("use_cache", use_cache)):
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be True or False, got {value!r}")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")


def sampling_logits(logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float | None) -> torch.Tensor:
    """The logits a sampling step of :func:`generate` takes the softmax of: ``logits`` divided by ``temperature``,
    then :func:`top_k_filter` with ``top_k`` and :func:`top_p_filter` with ``top_p`` (``None``: no filter)."""
    logits = logits / temperature
    if top_k is not None:
        logits = top_k_filter(logits, top_k)
    if top_p is not None:
        logits = top_p_filter(logits, top_p)
    return logits


def _next_token(logits: torch.Tensor, *, temperature, top_k, top_p, greedy, generator) -> torch.Tensor:
    """One new id per row of ``logits (batch, vocab_size)``: the argmax, or a sample after the transformations."""
    logits = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    if greedy:
        return logits.argmax(dim=-1, keepdim=True)
    probs = torch.softmax(sampling_logits(logits, temperature, top_k, top_p), dim=-1)
    if generator is not None and generator.device != probs.device:  # e.g. a CPU generator for a CUDA model
        return torch.multinomial(probs.to(generator.device), 1, generator=generator).to(probs.device)
    return torch.multinomial(probs, 1, generator=generator)


def _takes_last_only(model: nn.Module) -> bool:
    """Whether ``model``'s forward accepts ``last_only`` (the book's GPT does; a reader's own model may not)."""
    try:
        return "last_only" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):  # a forward whose signature cannot be read
        return False


@contextlib.contextmanager
def _generating(model: nn.Module):
    """Run ``model`` for generation: eval mode (no dropout), no gradients, W_Q, W_K, W_V stacked once for the
    whole loop instead of per token; its training flag is restored at the end, also after an error."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), reusing_stacked_weights():
            yield
    finally:
        model.train(was_training)


def generate(model: nn.Module, idx: torch.Tensor, max_new_tokens: int, *, temperature: float = 1.0,
             top_k: int | None = None, top_p: float | None = None, use_cache: bool = True,
             generator: torch.Generator | None = None, greedy: bool = False) -> torch.Tensor:
    """Continue each prompt in ``idx (batch, seq)`` by ``max_new_tokens`` tokens, feeding every prediction back.

    Returns the prompts followed by the new ids, a ``(batch, seq + max_new_tokens)`` LongTensor on the model's
    device. Each step turns the model's last-position logits into one token per row:

    * ``greedy=True``: the most probable token (argmax); the other sampling options change nothing;
    * otherwise a sample from ``softmax`` of the logits after, in this order (as in nanoGPT and Hugging Face):
      division by ``temperature`` (< 1 sharpens, > 1 flattens), :func:`top_k_filter` with ``top_k`` and
      :func:`top_p_filter` with ``top_p``. ``generator`` (a ``torch.Generator``) makes the samples
      reproducible; one ``torch.multinomial`` draw per step.

    The model runs under ``torch.no_grad()`` in eval mode (no dropout); its training flag is restored at the end.

    **Context and KV cache.** Every step conditions on the last ``min(length, context_length)`` tokens, so
    generation goes on past the context by cropping the oldest tokens. With ``use_cache=True`` the keys and values
    of earlier positions are kept (a :class:`~groundup.attention.KVCache` per layer) and each step runs only the
    newest token, while the sequence fits the context. Once it no longer fits, every step re-runs the cropped
    window from scratch, because cropping invalidates the cache in every positional family: with learned or
    sinusoidal positions every token's position shifts, so even layer 1's keys change; with RoPE, ALiBi or the
    relative bias (and with no positions at all) layer 1's keys depend only on the token and its offset and would
    stay valid, but from layer 2 on every key was computed from hidden states that attended to the dropped
    tokens. A rolling-buffer cache that keeps them anyway (sliding-window attention) is an approximation, which
    we do not make: cached and uncached generation produce the same tokens, up to floating-point rounding in
    the logits (identical in practice).

    A model whose ``forward`` takes ``last_only`` (the book's :class:`~groundup.models.GPT`) is asked for the
    last position's logits only: the rest would be unembedded and thrown away.

    Raises ``ValueError``/``TypeError`` for an empty prompt, ids outside ``[0, vocab_size)``, ``temperature <= 0``,
    ``top_k < 1``, ``top_p`` outside (0, 1], a negative ``max_new_tokens`` or arguments of the wrong type.
    """
    _check_generate_args(model, idx, max_new_tokens, temperature, top_k, top_p, greedy, use_cache, generator)
    context_length = model.config.context_length
    device = next(model.parameters()).device
    out = idx.to(device=device, dtype=torch.long)
    last = {"last_only": True} if _takes_last_only(model) else {}
    with _generating(model):  # W_Q, W_K, W_V stacked once, not per token
        cache = model.new_cache() if use_cache else None
        for _ in range(max_new_tokens):
            if cache is not None and out.shape[1] <= context_length:
                cached = len(cache[0])
                logits, _ = model(out[:, cached:], cache=cache, **last)  # the whole prompt once, then one token
            else:  # no cache, or the sequence outgrew the context: run the last context_length tokens
                logits, _ = model(out[:, -context_length:], **last)
            new = _next_token(logits[:, -1, :], temperature=temperature, top_k=top_k, top_p=top_p,
                              greedy=greedy, generator=generator)
            out = torch.cat([out, new.to(torch.long)], dim=1)
    return out


def _prompt_ids(prompts, vocab_size: int) -> list[list[int]]:
    """``prompts`` as lists of ints, or a clear error naming the argument."""
    if not isinstance(prompts, (list, tuple)):
        raise TypeError(f"prompts must be a list of prompts (lists of token ids or 1-D integer tensors), got "
                        f"{type(prompts).__name__}" + ("; for a (batch, seq) tensor use generate"
                                                       if isinstance(prompts, torch.Tensor) else ""))
    if not prompts:
        raise ValueError("prompts is empty: give at least one prompt")
    ids = []
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, torch.Tensor):
            if prompt.dim() != 1 or prompt.dtype.is_floating_point or prompt.dtype.is_complex \
                    or prompt.dtype == torch.bool:
                raise TypeError(f"prompts[{i}] must be a 1-D integer tensor, got dtype {prompt.dtype} of shape "
                                f"{tuple(prompt.shape)}")
            prompt = prompt.tolist()
        if not isinstance(prompt, (list, tuple)) or not all(_is_int(t) for t in prompt):
            raise TypeError(f"prompts[{i}] must be a list of int token ids or a 1-D integer tensor, got {prompt!r}")
        if not prompt:
            raise ValueError(f"prompts[{i}] is empty: give at least one token id per prompt, e.g. a start token")
        bad = [t for t in prompt if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"prompts[{i}] holds token id {bad[0]}, outside the vocabulary: ids must be in "
                             f"[0, vocab_size - 1] = [0, {vocab_size - 1}]")
        ids.append(list(prompt))
    return ids


def generate_batch(model: nn.Module, prompts, max_new_tokens: int, *, stop_id: int | None = None, pad_id: int = 0,
                   temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
                   greedy: bool = False, use_cache: bool = True,
                   generator: torch.Generator | None = None) -> list[list[int]]:
    """Continue several prompts of different lengths at once; returns each prompt's new tokens, in order.

    ``prompts`` is a list of non-empty lists of token ids (or 1-D integer tensors). They are padded on the left
    with ``pad_id`` into one ``(batch, longest)`` tensor, and an attention mask (1 = a real token, 0 = padding)
    tells the model which columns are real: each row then gets the positions and the attention it would get
    alone (see :meth:`groundup.models.GPT.hidden_states`), and every step runs all rows in one forward pass.
    Left, not right: each row's newest token is then in the last column, where the next token is read.

    A row that produces ``stop_id`` stops: its list ends with that token and its later columns are padding
    (mask 0). Generation ends after ``max_new_tokens`` steps or when every row has stopped. The KV cache is used
    while the padded length fits the context; past it every step re-runs the last ``context_length`` columns
    with their mask, so a row conditions on its last ``min(length, context_length)`` tokens, as in
    :func:`generate`. Sampling options as in :func:`generate`; eval mode, no gradients.

    **Batched versus one at a time.** Greedy output equals :func:`generate` on each prompt alone, truncated after
    its first ``stop_id``, token for token up to floating-point rounding: the padded batch computes the same sums
    in matrices of other shapes (and with an explicit mask), which can round differently in the last bits and,
    in a near tie, flip an argmax (identical in the tests). Sampled output draws each row's token from the same
    distribution as alone, but not with the same random numbers: one ``torch.multinomial`` per step over the
    whole batch (stopped rows included), so a row's samples depend on the other rows; a ``generator`` makes the
    whole run reproducible, and a single prompt draws what :func:`generate` draws with the same generator (up to
    the same rounding).
    """
    config = getattr(model, "config", None)
    if not isinstance(model, nn.Module) or not hasattr(config, "vocab_size"):
        raise TypeError(f"model must be a groundup.models.GPT, got {type(model).__name__}")
    ids = _prompt_ids(prompts, config.vocab_size)
    ids_range = f"a token id in [0, vocab_size - 1] = [0, {config.vocab_size - 1}]"
    if stop_id is not None and (not _is_int(stop_id) or not 0 <= stop_id < config.vocab_size):
        raise ValueError(f"stop_id must be {ids_range} or None, got {stop_id!r}")
    if not _is_int(pad_id) or not 0 <= pad_id < config.vocab_size:
        raise ValueError(f"pad_id must be {ids_range}, got {pad_id!r}")
    try:
        takes_mask = "attention_mask" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        takes_mask = False
    if not takes_mask:
        raise TypeError(f"{type(model).__name__}.forward takes no attention_mask: generate_batch needs a model that "
                        "masks padding (groundup.models.GPT); generate each prompt alone with generate")
    device = next(model.parameters()).device
    width, context_length = max(map(len, ids)), config.context_length
    out = torch.full((len(ids), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(ids), width, dtype=torch.bool)
    for row, prompt in enumerate(ids):  # left padding: every prompt ends in the last column
        out[row, width - len(prompt):] = torch.tensor(prompt)
        mask[row, width - len(prompt):] = True
    _check_generate_args(model, out, max_new_tokens, temperature, top_k, top_p, greedy, use_cache, generator)
    out, mask = out.to(device), mask.to(device)
    stopped = torch.zeros(len(ids), dtype=torch.bool, device=device)
    last = {"last_only": True} if _takes_last_only(model) else {}
    with _generating(model):
        cache = model.new_cache() if use_cache else None
        for _ in range(max_new_tokens):
            if cache is not None and out.shape[1] <= context_length:
                logits, _ = model(out[:, len(cache[0]):], attention_mask=mask, cache=cache, **last)
            else:  # no cache, or past the context: the last context_length columns and their mask
                logits, _ = model(out[:, -context_length:], attention_mask=mask[:, -context_length:], **last)
            new = _next_token(logits[:, -1, :], temperature=temperature, top_k=top_k, top_p=top_p,
                              greedy=greedy, generator=generator)[:, 0].to(torch.long)
            new = new.masked_fill(stopped, pad_id)  # a stopped row gets padding
            out = torch.cat([out, new[:, None]], dim=1)
            mask = torch.cat([mask, ~stopped[:, None]], dim=1)
            if stop_id is not None:
                stopped = stopped | (new == stop_id)
                if bool(stopped.all()):
                    break
    result = []
    for row in out[:, width:].tolist():
        result.append(row[:row.index(stop_id) + 1] if stop_id in row else row)
    return result


# ---- beam search -------------------------------------------------------------------------------------------


def _rank(scores: torch.Tensor, lengths: torch.Tensor, length_penalty: float) -> torch.Tensor:
    """``scores / lengths^length_penalty`` (``scores`` itself for 0), ``-inf`` scores staying ``-inf``."""
    if not length_penalty:
        return scores.clone()
    return (scores / lengths.clamp(min=1) ** length_penalty).masked_fill(torch.isneginf(scores), float("-inf"))


def beam_step(logp: torch.Tensor, scores: torch.Tensor, lengths: torch.Tensor, finished: torch.Tensor, *,
              length_penalty: float = 0.0, end_id: int | None = None, fill_id: int | None = None):
    """One step of beam search for ``batch`` searches of ``k`` hypotheses each.

    ``logp (batch, k, n_V)`` holds each hypothesis's next-token log-probabilities, ``scores (batch, k)`` their
    log-probabilities so far (``-inf`` for an empty slot), ``lengths (batch, k)`` their token counts (the end token
    included) and ``finished (batch, k)`` whether they have emitted ``end_id``. A finished hypothesis is extended
    only by ``fill_id``, at no cost and without growing; every other one by every token. The ``k`` best of the
    ``k × n_V`` candidates survive, ranked by ``score / length^length_penalty``.

    Returns ``(beam, token, scores, lengths, finished)``: for each survivor ``(batch, k)``, the index of the
    hypothesis it extends, its new token, and its updated score, length and finished flag.
    """
    batch, k, n_v = logp.shape
    if finished.any():
        frozen = torch.full((n_v,), float("-inf"), dtype=logp.dtype, device=logp.device)
        frozen[fill_id] = 0.0
        logp = torch.where(finished[..., None], frozen, logp)
    cand = scores[..., None] + logp  # (batch, k, n_V)
    cand_len = (lengths[..., None] + (~finished[..., None]).to(lengths.dtype)).expand(-1, -1, n_v)
    top = _rank(cand, cand_len, length_penalty).view(batch, -1).topk(k, dim=-1).indices  # (batch, k)
    beam, token = top // n_v, top % n_v
    scores = cand.reshape(batch, -1).gather(1, top)
    lengths = cand_len.reshape(batch, -1).gather(1, top)
    finished = finished.gather(1, beam)
    if end_id is not None:
        finished = finished | (token == end_id)
    return beam, token, scores, lengths, finished


def best_beam(scores: torch.Tensor, lengths: torch.Tensor, finished: torch.Tensor,
              length_penalty: float = 0.0) -> torch.Tensor:
    """The index ``(batch,)`` of each search's winner: the best-ranked finished hypothesis, or the best-ranked
    of all when none finished (ranked as in :func:`beam_step`)."""
    final = _rank(scores, lengths, length_penalty)
    final = final.masked_fill(~finished & finished.any(dim=1, keepdim=True), float("-inf"))  # finished first
    return final.argmax(dim=1)


def _check_beam_args(beam_width, length_penalty, end_id, vocab_size, return_scores) -> None:
    if not _is_int(beam_width) or beam_width < 1:
        raise ValueError(f"beam_width must be an integer >= 1 (1 is greedy decoding), got {beam_width!r}")
    if not _is_number(length_penalty) or not math.isfinite(length_penalty) or length_penalty < 0:
        raise ValueError(f"length_penalty must be a finite number >= 0, got {length_penalty!r}")
    if end_id is not None and (not _is_int(end_id) or not 0 <= end_id < vocab_size):
        raise ValueError(f"end_id must be a token id in [0, vocab_size - 1] = [0, {vocab_size - 1}] or None, "
                         f"got {end_id!r}")
    if not isinstance(return_scores, bool):
        raise TypeError(f"return_scores must be True or False, got {return_scores!r}")


def beam_search(model: nn.Module, idx: torch.Tensor, max_new_tokens: int, *, beam_width: int = 4,
                length_penalty: float = 0.0, end_id: int | None = None, use_cache: bool = True,
                return_scores: bool = False):
    """Continue each prompt in ``idx (batch, seq)`` by the most probable continuation beam search finds.

    Every step extends each of the ``beam_width`` kept hypotheses by every token and keeps the ``beam_width``
    candidates with the highest log-probability ``sum log P(token | before)`` (the step is :func:`beam_step`,
    shared with chapter 10's :func:`groundup.seq2seq.beam_search`). ``beam_width=1`` is greedy decoding; a beam
    wide enough to hold every sequence finds the most probable continuation exactly.

    Without ``end_id`` every hypothesis has ``max_new_tokens`` tokens and the most probable one wins. With
    ``end_id`` a hypothesis that emits it is finished: it keeps its score, is padded with ``end_id`` at no cost,
    and competes with the others ranked by ``log P / len^length_penalty`` (``len`` counting the end token;
    ``length_penalty`` only matters then); the best finished hypothesis wins, an unfinished one only if none did.

    Returns the prompts followed by the chosen continuations, a ``(batch, seq + max_new_tokens)`` LongTensor,
    and with ``return_scores=True`` also their log-probabilities, a float tensor ``(batch,)``. The KV cache works
    as in :func:`generate` (after each step the caches' rows are reordered to follow their hypotheses); once the
    sequence outgrows the context every step re-runs the cropped window. Eval mode, no gradients.

    **Compared with Hugging Face.** ``transformers``' ``generate(num_beams=k, do_sample=False)`` (read in 5.23)
    keeps the ``k`` best *unfinished* hypotheses running, ranked by ``log P`` alone, and the finished ones apart, in
    a list of at most ``k`` ranked by ``log P / L^length_penalty`` (``L`` the new tokens, end token included). A
    candidate that emits the end token enters that list only if it is among the step's ``k`` best candidates by
    ``log P``, and leaves it only for a better finished one; at ``max_new_tokens`` the ``k`` best candidates
    enter it too, unfinished or not; the best of the list wins (``early_stopping`` may end the search before
    ``max_new_tokens``; with ``length_penalty > 0`` and ``False``, its default, by a heuristic that can miss
    a better hypothesis). Here a finished hypothesis takes one of the ``k`` places, so fewer hypotheses run; it is
    ranked against the unfinished ones, whose ``len`` is their current length, at every step, and ``k``
    better-ranked candidates push it out even if all of them later fall below it; and at the end a finished
    hypothesis beats every unfinished one. The results are therefore the same without ``end_id`` (every
    hypothesis has ``max_new_tokens`` tokens, so ``length_penalty`` changes no ranking; transformers' sequence
    score is the log-probability returned here divided by ``max_new_tokens^length_penalty``), and with ``end_id``
    when no hypothesis in the beam ends with it before the last step and at the last step only the best one
    may; otherwise they can differ, even with ``length_penalty=0``. transformers also pads after the end token
    with ``pad_token_id`` and crops the sequences to the longest one. ``tests/test_generation.py`` checks both
    cases of agreement on a random GPT-2 loaded into both.
    """
    _check_generate_args(model, idx, max_new_tokens, 1.0, None, None, True, use_cache, None)
    _check_beam_args(beam_width, length_penalty, end_id, model.config.vocab_size, return_scores)
    context_length, k, batch = model.config.context_length, beam_width, idx.shape[0]
    device = next(model.parameters()).device
    out = idx.to(device=device, dtype=torch.long).repeat_interleave(k, dim=0)  # (batch * k, seq)
    last = {"last_only": True} if _takes_last_only(model) else {}
    scores = torch.full((batch, k), float("-inf"), dtype=torch.float64, device=device)
    scores[:, 0] = 0.0  # at the start every hypothesis is the prompt: expand only one
    lengths = torch.zeros(batch, k, dtype=torch.float64, device=device)
    finished = torch.zeros(batch, k, dtype=torch.bool, device=device)
    offsets = torch.arange(batch, device=device)[:, None] * k
    with _generating(model):
        cache = model.new_cache() if use_cache else None
        for _ in range(max_new_tokens):
            if cache is not None and out.shape[1] <= context_length:
                logits, _ = model(out[:, len(cache[0]):], cache=cache, **last)
            else:  # no cache, or the sequence outgrew the context (the cache is invalid from now on)
                cache = None
                logits, _ = model(out[:, -context_length:], **last)
            logp = torch.log_softmax(logits[:, -1, :].to(torch.float64), dim=-1).view(batch, k, -1)
            beam, token, scores, lengths, finished = beam_step(
                logp, scores, lengths, finished, length_penalty=length_penalty, end_id=end_id, fill_id=end_id)
            rows = (offsets + beam).flatten()
            out = torch.cat([out[rows], token.reshape(-1, 1)], dim=1)
            if cache is not None:
                for layer in cache:
                    if layer.k is not None:
                        layer.k, layer.v = layer.k[rows], layer.v[rows]
    best = best_beam(scores, lengths, finished, length_penalty)
    chosen = out.view(batch, k, -1)[torch.arange(batch, device=device), best]
    if return_scores:
        return chosen, scores[torch.arange(batch, device=device), best]
    return chosen
