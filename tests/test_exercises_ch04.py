"""Each chapter-4 checker accepts the reference solution (the notebook's hidden one), rejects plausible wrong
answers with a helpful message, and treats the unattempted stub kindly."""

import math

import pytest
import torch

from groundup.exercises import checking as _checking
from groundup.exercises.ch04 import (
    check_alibi_half_life,
    check_apply_rotary,
    check_shift_matrix,
    check_sinusoidal_encoding,
)

# --- reference solutions (the same code as the notebook's hidden solution cells) ---------------------------


def sinusoidal(n_positions, d_model):
    k = torch.arange(n_positions, dtype=torch.float64)[:, None]  # positions k, as a column
    two_i = torch.arange(0, d_model, 2, dtype=torch.float64)  # 2i = 0, 2, 4, ...
    angles = k / 10000.0 ** (two_i / d_model)  # [n_positions, d_model/2]
    P = torch.zeros(n_positions, d_model)
    P[:, 0::2] = torch.sin(angles)
    P[:, 1::2] = torch.cos(angles)
    return P


def rope(x, positions):
    d = x.shape[-1]
    theta = 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)  # one frequency per pair
    angles = positions.double()[:, None] * theta  # [seq, d/2]
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    x0, x1 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1).flatten(-2)


def shift_matrix(delta, d_model):
    M = torch.zeros(d_model, d_model, dtype=torch.float64)
    for i in range(d_model // 2):
        b = delta / 10000.0 ** (2 * i / d_model)  # the angle a shift by delta adds to pair i
        # sin(a + b) = cos b sin a + sin b cos a;  cos(a + b) = -sin b sin a + cos b cos a
        M[2 * i, 2 * i], M[2 * i, 2 * i + 1] = math.cos(b), math.sin(b)
        M[2 * i + 1, 2 * i], M[2 * i + 1, 2 * i + 1] = -math.sin(b), math.cos(b)
    return M


def half_life(n_heads):
    def geometric(n):
        return [2.0 ** (-8 * h / n) for h in range(1, n + 1)]  # (4.7) for a power of two n

    power = 2 ** int(math.log2(n_heads))  # the largest power of two <= n_heads
    slopes = geometric(power) + geometric(2 * power)[0::2][: n_heads - power]  # the reference rule otherwise
    return [math.log(2) / m for m in slopes]  # exp(-m * distance) = 1/2


def stub(*args):
    raise NotImplementedError


# --- wrong answers --------------------------------------------------------------------------------------------


def sinusoidal_swapped(n_positions, d_model):
    return sinusoidal(n_positions, d_model)[:, [j ^ 1 for j in range(d_model)]]


def sinusoidal_concatenated(n_positions, d_model):
    P = sinusoidal(n_positions, d_model)
    return torch.cat([P[:, 0::2], P[:, 1::2]], dim=1)


def sinusoidal_from_one(n_positions, d_model):
    return sinusoidal(n_positions + 1, d_model)[1:]


def sinusoidal_exponent_i(n_positions, d_model):
    k = torch.arange(n_positions, dtype=torch.float64)[:, None]
    angles = k / 10000.0 ** (torch.arange(d_model // 2, dtype=torch.float64) / d_model)
    return torch.stack([angles.sin(), angles.cos()], dim=-1).flatten(1)


def rope_clockwise(x, positions):
    return rope(x, -positions)


def rope_half_split(x, positions):
    d = x.shape[-1]
    theta = 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = positions.double()[:, None] * theta
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    x0, x1 = x[..., : d // 2], x[..., d // 2:]
    return torch.cat([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1)


def rope_ignores_positions(x, positions):
    return rope(x, torch.arange(x.shape[-2]))


def shift_transposed(delta, d_model):
    return shift_matrix(delta, d_model).T


def shift_backwards(delta, d_model):
    return shift_matrix(-delta, d_model)


def half_life_inverse_slope(n_heads):
    return [1 / (2.0 ** (-8 * h / n_heads)) for h in range(1, n_heads + 1)]


def half_life_from_zero(n_heads):
    return [math.log(2) / 2.0 ** (-8 * h / n_heads) for h in range(n_heads)]


def half_life_reversed(n_heads):
    return half_life(n_heads)[::-1]


def half_life_geometric_only(n_heads):
    return [math.log(2) / 2.0 ** (-8 * h / n_heads) for h in range(1, n_heads + 1)]


def half_life_times_slope(n_heads):
    return [math.log(2) * 2.0 ** (-8 * h / n_heads) for h in range(1, n_heads + 1)]


# --- tests ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("checker, solution", [
    (check_sinusoidal_encoding, sinusoidal),
    (check_apply_rotary, rope),
    (check_shift_matrix, shift_matrix),
    (check_alibi_half_life, half_life),
])
def test_reference_solution_passes(checker, solution, capsys):
    assert checker(solution).passed is True
    assert "✅" in capsys.readouterr().out


@pytest.mark.parametrize("checker", [check_sinusoidal_encoding, check_shift_matrix, check_apply_rotary,
                                     check_alibi_half_life])
def test_stub_is_not_attempted(checker, capsys):
    assert checker(stub).passed is False
    assert "not attempted yet" in capsys.readouterr().out


@pytest.mark.parametrize("checker, wrong, hint", [
    (check_sinusoidal_encoding, sinusoidal_swapped, "swapped sine and cosine"),
    (check_sinusoidal_encoding, sinusoidal_concatenated, "all sines first"),
    (check_sinusoidal_encoding, sinusoidal_from_one, "start at 1"),
    (check_sinusoidal_encoding, sinusoidal_exponent_i, "exponent is 2i/d"),
    (check_sinusoidal_encoding, lambda n, d: torch.zeros(n, d + 1), "expected (6, 4)"),
    (check_apply_rotary, rope_clockwise, "clockwise"),
    (check_apply_rotary, rope_half_split, "paired dimension i with i + d/2"),
    (check_apply_rotary, rope_ignores_positions, "Use the given positions"),
    (check_apply_rotary, lambda x, p: x, "rotation R_t"),
    (check_shift_matrix, shift_transposed, "transpose"),
    (check_shift_matrix, shift_backwards, "shifts backwards"),
    (check_shift_matrix, lambda delta, d: torch.eye(d), "angle-addition"),
    (check_shift_matrix, lambda delta, d: shift_matrix(delta, 4), "Use the arguments"),
    (check_alibi_half_life, half_life_inverse_slope, "ln 2 / m_h"),
    (check_alibi_half_life, half_life_from_zero, "from h = 1"),
    (check_alibi_half_life, half_life_geometric_only, "not a power of two"),
    (check_alibi_half_life, half_life_reversed, "reverse order"),
    (check_alibi_half_life, half_life_times_slope, "multiplied by the slope"),
    (check_alibi_half_life, lambda n: [0.5] * (n + 1), "expected"),
])
def test_wrong_answers_fail_with_a_hint(checker, wrong, hint, capsys):
    assert checker(wrong).passed is False
    out = capsys.readouterr().out
    assert "❌" in out and hint in out


def test_crash_becomes_a_verdict(capsys):
    assert check_apply_rotary(lambda x, p: x @ torch.zeros(3, 3)).passed is False
    assert "raised RuntimeError" in capsys.readouterr().out


@pytest.fixture(autouse=True)
def _unwrapped_verdicts(monkeypatch):
    """Match hints as whole lines; tests/test_checking.py tests the wrapping to the book's width."""
    monkeypatch.setattr(_checking, "MESSAGE_WIDTH", 10_000)


def test_the_packages_encodings_are_refused(capsys):
    from groundup.positional import RotaryEmbedding, sinusoidal_encoding

    assert not check_sinusoidal_encoding(sinusoidal_encoding)
    assert "calls groundup.positional.sinusoidal_encoding" in capsys.readouterr().out
    assert not check_apply_rotary(lambda x, positions: RotaryEmbedding(x.shape[-1]).apply_rotary(x, positions))
    assert "calls groundup.positional.RotaryEmbedding.apply_rotary" in capsys.readouterr().out
