"""Positional information for attention: absolute encodings added to the input, and relative ones inside it.

Chapter 4 builds each of these; the GPT of chapter 6 selects one with ``GPTConfig.positional``.

* **Absolute**, added to the token embeddings (``x_t = W_E[w_t] + p_t``):
  :func:`sinusoidal_encoding` (fixed, Vaswani et al. 2017) and :class:`LearnedPositionalEmbedding`
  (a learned table, GPT-2).
* **Relative**, added to the attention scores before the softmax (``s_{t,i} + b_{t-i}``):
  :class:`RelativePositionBias` (learned, Shaw et al. 2018 / T5's buckets, Raffel et al. 2020) and
  :func:`alibi_bias` (fixed linear penalty, Press et al. 2022). Both return ``[n_heads, n, n]`` with entry
  ``[h, t, i]`` the bias of query position ``t`` looking at key position ``i``.
* **Rotary** (RoPE, Su et al. 2021), applied to queries and keys: :class:`RotaryEmbedding`.

Convention everywhere: positions are counted from 0, ``t`` is the query (row) and ``i`` the key (column).
"""

from __future__ import annotations

import math
import numbers

import torch
from torch import Tensor, nn

from groundup.utils import version_counter

__all__ = [
    "LearnedPositionalEmbedding",
    "RelativePositionBias",
    "RotaryEmbedding",
    "alibi_bias",
    "alibi_slopes",
    "relative_position_bucket",
    "sinusoidal_encoding",
]


def _check_int(name: str, value, *, minimum: int = 1) -> int:
    """``value`` as an int (Python or NumPy integers are accepted), or a clear error naming ``name``."""
    if not isinstance(value, numbers.Integral) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value}")
    return int(value)


def _check_even(name: str, value) -> int:
    value = _check_int(name, value)
    if value % 2:
        raise ValueError(f"{name} must be even (dimensions are used in (sin, cos) pairs), got {value}")
    return value


def _check_base(base) -> None:
    if isinstance(base, bool) or not isinstance(base, (int, float)) or not math.isfinite(base) or base <= 1:
        raise ValueError(f"base must be a finite number > 1 (usually 10000.0), got {base!r}")


def _frequencies(d: int, base: float) -> Tensor:
    """The d/2 angular frequencies ``base^(-2i/d)``, i = 0..d/2-1, in float64."""
    return base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)


# ----------------------------------------------------------------------------------------------------------
# Absolute encodings: added to the token embeddings
# ----------------------------------------------------------------------------------------------------------


def sinusoidal_encoding(n_positions: int, d_model: int, *, base: float = 10000.0) -> Tensor:
    """The fixed sinusoidal table of Vaswani et al. (2017), shape ``[n_positions, d_model]``, float32.

    Row ``k`` (position ``k = 0, 1, ...``) holds ``P[k, 2i] = sin(k / base^(2i/d))`` and
    ``P[k, 2i+1] = cos(k / base^(2i/d))`` for ``i = 0 .. d_model/2 - 1``. Angles are computed in float64.
    """
    n_positions, d_model = _check_int("n_positions", n_positions), _check_even("d_model", d_model)
    _check_base(base)
    angles = torch.arange(n_positions, dtype=torch.float64)[:, None] * _frequencies(d_model, base)[None, :]
    table = torch.empty(n_positions, d_model, dtype=torch.float64)
    table[:, 0::2] = torch.sin(angles)
    table[:, 1::2] = torch.cos(angles)
    return table.to(torch.float32)


def _check_positions(positions, limit: int | None = None, limit_name: str = "") -> None:
    """A clear error unless ``positions`` is an integer tensor of positions ``>= 0`` (and ``< limit``).

    The range checks read values (``int(positions.min())``), which ``torch.compile`` cannot put in a graph: each
    would break it in two. While compiling they are skipped; the type checks, which read no values, stay. Eager
    calls check everything, as before.
    """
    if not isinstance(positions, Tensor):
        raise TypeError(f"positions must be a torch.Tensor of integer positions, got {type(positions).__name__}")
    if positions.dtype.is_floating_point or positions.dtype.is_complex or positions.dtype == torch.bool:
        raise TypeError(f"positions must be an integer tensor (e.g. torch.long), got dtype {positions.dtype}")
    if torch.compiler.is_compiling():
        return
    if positions.numel() and int(positions.min()) < 0:
        raise ValueError(f"positions must be >= 0, got {int(positions.min())}")
    if limit is not None and positions.numel() and int(positions.max()) >= limit:
        raise ValueError(f"positions must be < {limit_name}={limit} (the table has one row per position), "
                         f"got position {int(positions.max())}")


class LearnedPositionalEmbedding(nn.Module):
    """A learned vector ``p_t`` for each position ``t = 0 .. context_length-1`` (GPT-2's ``wpe``).

    ``weight`` has shape ``[context_length, d_model]``, initialised from N(0, 0.02²) as in GPT-2. Call it with
    an integer tensor of positions of any shape ``(...)`` to get ``(..., d_model)``. A learned table knows
    nothing about positions it has no row for: positions ``>= context_length`` raise ``ValueError``.
    """

    def __init__(self, context_length: int, d_model: int):
        super().__init__()
        context_length, d_model = _check_int("context_length", context_length), _check_int("d_model", d_model)
        self.context_length = context_length
        self.d_model = d_model
        self.weight = nn.Parameter(torch.randn(context_length, d_model) * 0.02)

    def forward(self, positions: Tensor) -> Tensor:
        _check_positions(positions, self.context_length, "context_length")
        # .long(): indexing with a uint8 (or bool) tensor would select rows by mask, not by position; int16 and
        # int8 are not valid indices at all. int64 positions pass through unchanged.
        return self.weight[positions.long()]

    def extra_repr(self) -> str:
        return f"context_length={self.context_length}, d_model={self.d_model}"


# ----------------------------------------------------------------------------------------------------------
# Relative biases: added to the attention scores
# ----------------------------------------------------------------------------------------------------------


def relative_position_bucket(offset: Tensor, *, num_buckets: int, max_distance: int,
                             bidirectional: bool = True) -> Tensor:
    """T5's bucket for each offset ``t - i`` (query minus key), as in Raffel et al. (2020).

    With ``bidirectional`` the buckets are split in half: ``[0, num_buckets/2)`` for ``t >= i`` (the past) and
    the upper half for ``t < i`` (the future); otherwise every future offset shares bucket 0. Within a half of
    ``B`` buckets, distances ``0 .. B/2 - 1`` get a bucket each, and larger distances share ``B/2``
    logarithmically spaced buckets up to ``max_distance``; all distances ``>= max_distance`` share the last one.
    """
    num_buckets = _check_int("num_buckets", num_buckets, minimum=2 if not bidirectional else 4)
    max_distance = _check_int("max_distance", max_distance)
    offset = offset.long()
    bucket = torch.zeros_like(offset)
    if bidirectional:
        num_buckets //= 2
        bucket = bucket + (offset < 0).long() * num_buckets
        distance = offset.abs()
    else:
        distance = offset.clamp(min=0)
    max_exact = num_buckets // 2
    if max_distance <= max_exact:
        raise ValueError(f"max_distance must exceed the {max_exact} exactly-represented distances, got {max_distance}")
    # Log-spaced buckets for distance >= max_exact (clamp avoids log(0) in the unused branch).
    log_ratio = torch.log(distance.clamp(min=1).double() / max_exact) / math.log(max_distance / max_exact)
    large = max_exact + (log_ratio * (num_buckets - max_exact)).long()
    large = large.clamp(max=num_buckets - 1)
    return bucket + torch.where(distance < max_exact, distance, large)


class RelativePositionBias(nn.Module):
    """A learned scalar ``b_h(t - i)`` per head and offset, added to the attention scores (Shaw et al. 2018).

    Called with a sequence length ``n``, returns ``[n_heads, n, n]`` with entry ``[h, t, i] = b_h(t - i)``:
    the attention weights become ``softmax_i(s_{t,i} + b_{t-i})``.

    * Default (``num_buckets=None``): one parameter per offset, offsets clipped to
      ``[-max_distance, max_distance]`` (``2*max_distance + 1`` parameters per head; with
      ``bidirectional=False`` future offsets ``t < i`` share the offset-0 entry, which the causal mask hides
      anyway, and there are ``max_distance + 1`` per head).
    * ``num_buckets=B``: T5-style buckets (:func:`relative_position_bucket`), exact for small distances,
      logarithmic up to ``max_distance`` (``B`` parameters per head).

    ``bias`` (shape ``[n_heads, n_entries]``) starts at zero, i.e. the model starts with no positional
    information and learns it.
    """

    def __init__(self, n_heads: int, max_distance: int, *, num_buckets: int | None = None,
                 bidirectional: bool = True):
        super().__init__()
        n_heads, max_distance = _check_int("n_heads", n_heads), _check_int("max_distance", max_distance)
        self.n_heads = n_heads
        self.max_distance = max_distance
        self.num_buckets = num_buckets
        self.bidirectional = bool(bidirectional)
        if num_buckets is None:
            n_entries = 2 * max_distance + 1 if self.bidirectional else max_distance + 1
        else:
            relative_position_bucket(torch.zeros(1), num_buckets=num_buckets, max_distance=max_distance,
                                     bidirectional=self.bidirectional)  # validates the arguments
            n_entries = num_buckets
        self.bias = nn.Parameter(torch.zeros(n_heads, n_entries))

    def index(self, n: int) -> Tensor:
        """The ``[n, n]`` table of which entry of ``bias`` each (query t, key i) pair uses."""
        n = _check_int("n", n)
        positions = torch.arange(n, device=self.bias.device)
        offset = positions[:, None] - positions[None, :]  # t - i
        if self.num_buckets is not None:
            return relative_position_bucket(offset, num_buckets=self.num_buckets, max_distance=self.max_distance,
                                            bidirectional=self.bidirectional)
        if self.bidirectional:
            return offset.clamp(-self.max_distance, self.max_distance) + self.max_distance
        return offset.clamp(0, self.max_distance)

    def forward(self, n: int) -> Tensor:
        return self.bias[:, self.index(n)]

    def extra_repr(self) -> str:
        extra = f", num_buckets={self.num_buckets}" if self.num_buckets is not None else ""
        return f"n_heads={self.n_heads}, max_distance={self.max_distance}{extra}, bidirectional={self.bidirectional}"


def alibi_slopes(n_heads: int) -> Tensor:
    """ALiBi's head slopes (Press et al. 2022), float32 of shape ``[n_heads]``.

    For a power of two ``n_heads`` they are the geometric sequence ``m_h = 2^(-8h/n_heads)``, h = 1..n_heads.
    For any other ``n_heads`` we follow the rule of the ALiBi reference code: take the ``2^k`` slopes of the
    largest power of two ``2^k < n_heads``, then append every other slope (the 1st, 3rd, 5th, ...) of the
    ``2^(k+1)``-head sequence until there are ``n_heads`` (for 12 heads: the 8 slopes ``2^-1 .. 2^-8``, then
    ``2^-0.5, 2^-1.5, 2^-2.5, 2^-3.5``).
    """
    n_heads = _check_int("n_heads", n_heads)

    def geometric(n: int) -> Tensor:
        h = torch.arange(1, n + 1, dtype=torch.float64)
        return 2.0 ** (-8.0 * h / n)

    power = 1 << (n_heads.bit_length() - 1)  # the largest power of two <= n_heads
    slopes = geometric(power)
    if power < n_heads:
        slopes = torch.cat([slopes, geometric(2 * power)[0::2][: n_heads - power]])
    return slopes.to(torch.float32)


def alibi_bias(n_heads: int, n: int) -> Tensor:
    """ALiBi's fixed linear bias (Press et al. 2022): ``[n_heads, n, n]`` with entry ``-m_h * |t - i|``.

    For the causal part ``i <= t`` this is the paper's ``-m_h (t - i)``: each head penalises distant keys
    linearly, with its own slope :func:`alibi_slopes`. For ``i > t`` we use the same penalty on the distance
    ``|t - i|`` (symmetric), which a causal mask removes anyway and which keeps the bias usable without one.
    """
    n_heads, n = _check_int("n_heads", n_heads), _check_int("n", n)
    positions = torch.arange(n, dtype=torch.float32)
    distance = (positions[:, None] - positions[None, :]).abs()
    return 0.0 - alibi_slopes(n_heads)[:, None, None] * distance  # 0.0 - x: no -0.0 on the diagonal


# ----------------------------------------------------------------------------------------------------------
# Rotary embedding: rotates queries and keys
# ----------------------------------------------------------------------------------------------------------


ROPE_PAIRINGS = ("interleaved", "half")


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (RoPE, Su et al. 2021) for per-head vectors of size ``d_head``.

    Pairing convention: dimensions ``(2i, 2i+1)`` form one plane (interleaved pairs, as in the RoFormer paper;
    LLaMA's Hugging Face code pairs ``(i, i + d/2)`` instead, which is the same up to a fixed permutation).
    At position ``t`` the pair is rotated by the angle ``t * theta_i``, ``theta_i = base^(-2i/d_head)``::

        out[2i]   = x[2i] cos(t theta_i) - x[2i+1] sin(t theta_i)
        out[2i+1] = x[2i] sin(t theta_i) + x[2i+1] cos(t theta_i)

    so ``<R_t q, R_i k> = q^T R_{i-t} k`` depends on positions only through the offset. No parameters.

    Options:

    * ``pairing="half"`` rotates the pairs ``(i, i + d_head/2)`` instead ("rotate-half", the convention of the
      LLaMA and GPT-NeoX Hugging Face code). It equals the interleaved rotation conjugated by the fixed
      permutation of head dimensions that sends ``2i -> i`` and ``2i+1 -> i + d_head/2``; a checkpoint trained
      with one convention must be run with the same one (or have its W_Q, W_K rows permuted).
    * ``position_scale`` s >= 1: position interpolation (Chen et al. 2023) uses the angles ``(t / s) theta_i``,
      so a model trained on n positions sees positions ``0..s n`` inside its trained angle range.
    * NTK-aware scaling is just a larger ``base`` (``base * s^(d_head/(d_head-2))`` in its usual form): it
      stretches the low frequencies a lot and the high ones hardly at all.
    """

    inv_freq: Tensor

    def __init__(self, d_head: int, *, base: float = 10000.0, pairing: str = "interleaved",
                 position_scale: float = 1.0):
        super().__init__()
        d_head = _check_even("d_head", d_head)
        _check_base(base)
        if pairing not in ROPE_PAIRINGS:
            raise ValueError(f"pairing must be one of {ROPE_PAIRINGS}, got {pairing!r}")
        if isinstance(position_scale, bool) or not isinstance(position_scale, (int, float)):
            raise TypeError(f"position_scale must be a number >= 1, got {type(position_scale).__name__}")
        if not math.isfinite(position_scale) or position_scale < 1.0:
            raise ValueError(f"position_scale must be a finite number >= 1, got {position_scale!r}")
        self.d_head = d_head
        self.base = float(base)
        self.pairing = pairing
        self.position_scale = float(position_scale)
        self.register_buffer("inv_freq", _frequencies(d_head, self.base), persistent=False)

    def angles(self, positions: Tensor) -> Tensor:
        """The rotation angles ``t * theta_i``: ``[seq, d_head/2]`` (or ``[batch, seq, d_head/2]`` for positions of
        shape ``(batch, seq)``) in float64."""
        _check_positions(positions)
        if positions.dim() not in (1, 2):
            raise ValueError(f"positions must have shape (seq,) or (batch, seq), got {tuple(positions.shape)}")
        t = positions.to(torch.float64)
        if self.position_scale != 1.0:
            t = t / self.position_scale
        return t[..., None] * self.inv_freq.to(positions.device)

    def _rotation_factors(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """The factors ``C`` and ``S`` of :meth:`apply_rotary` in ``dtype``, remembered for the last ``positions``.

        ``C`` holds ``cos(t theta_i)`` and ``S`` holds ``-sin(t theta_i)`` and ``+sin(t theta_i)`` in the two
        slots of pair ``i`` (``(2i, 2i+1)``, or ``(i, i + d_head/2)`` with ``pairing="half"``), each ``(seq,
        d_head)`` (``(batch, seq, d_head)`` for per-example positions). A model's forward pass rotates the queries
        and keys of every layer at the same ``positions`` tensor (SmolLM2: 60 calls per generated token), so they
        are computed once per forward pass instead of once per call. The memo is kept for that very ``positions``
        tensor and ``inv_freq`` (held, so their ids cannot be reused) as long as their in-place version counters,
        the dtype, ``position_scale`` and ``pairing`` stay the same; any change recomputes. (Inference-mode
        tensors have no version counter: an in-place edit of ``positions`` inside ``torch.inference_mode`` goes
        unnoticed.) While ``torch.compile`` traces, there is no memo: its version counters and identity tests would
        break the graph, and the compiler shares the factors between layers itself (common subexpressions).
        """
        if torch.compiler.is_compiling():
            return self._factors(positions, dtype)
        key = (version_counter(positions), version_counter(self.inv_freq), dtype, self.position_scale, self.pairing)
        memo = getattr(self, "_memo", None)
        if memo is not None and memo[0] is positions and memo[1] is self.inv_freq and memo[2] == key:
            return memo[3], memo[4]
        c, s = self._factors(positions, dtype)
        self._memo = (positions, self.inv_freq, key, c, s)
        return c, s

    def _factors(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """``C`` and ``S`` of :meth:`_rotation_factors`, computed (no memo)."""
        angles = self.angles(positions)
        cos, sin = torch.cos(angles).to(dtype), torch.sin(angles).to(dtype)
        if self.pairing == "half":
            return torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)
        return cos.repeat_interleave(2, dim=-1), torch.stack((-sin, sin), dim=-1).flatten(-2)

    def apply_rotary(self, x: Tensor, positions: Tensor) -> Tensor:
        """Rotate ``x`` of shape ``(..., seq, d_head)`` at integer ``positions`` of shape ``(seq,)``.

        Positions of shape ``(batch, seq)`` give each example its own positions (left-padded prompts, chapter 8):
        ``x`` must then be ``(batch, ..., seq, d_head)``, e.g. ``(batch, n_heads, seq, d_head)``.
        """
        if not isinstance(x, Tensor) or not x.dtype.is_floating_point:
            raise TypeError("x must be a floating-point torch.Tensor of shape (..., seq, d_head)")
        if x.dim() < 2 or x.shape[-1] != self.d_head:
            raise ValueError(f"x must have shape (..., seq, d_head={self.d_head}), got {tuple(x.shape)}")
        if isinstance(positions, Tensor) and positions.dim() == 2 and (x.dim() < 3 or positions.shape[0] != x.shape[0]):
            raise ValueError(f"positions must have shape (seq,), or (batch, seq) for x of shape (batch, ..., seq, "
                             f"d_head); got positions {tuple(positions.shape)} for x {tuple(x.shape)}")
        c, s = self._rotation_factors(positions, x.dtype)
        if c.shape[-2] != x.shape[-2]:
            raise ValueError(f"positions must have one entry per sequence position: x has seq={x.shape[-2]}, "
                             f"positions has {c.shape[-2]}")
        if c.dim() == 3:  # (batch, seq, d_head) -> (batch, 1, ..., seq, d_head)
            c = c.view(c.shape[0], *[1] * (x.dim() - 3), *c.shape[1:])
            s = s.view(c.shape)
        # The formula above for every pair at once: out = x * C + swapped(x) * S, where swapped(x) exchanges
        # the two coordinates of each pair. Slot 2i gets x[2i] cos + x[2i+1] (-sin), slot 2i+1 gets
        # x[2i+1] cos + x[2i] sin: the same products and sums as written above, so the same bits, in four
        # tensor operations instead of nine.
        if self.pairing == "half":
            half = self.d_head // 2
            swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
        else:
            swapped = x.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)
        return (x * c + swapped * s).contiguous()  # contiguous, as attention's kernels got it before

    def forward(self, x: Tensor, positions: Tensor) -> Tensor:
        return self.apply_rotary(x, positions)

    def extra_repr(self) -> str:
        extra = f", pairing={self.pairing!r}" if self.pairing != "interleaved" else ""
        if self.position_scale != 1.0:
            extra += f", position_scale={self.position_scale}"
        return f"d_head={self.d_head}, base={self.base}{extra}"
