"""Each chapter-8 checker accepts the reference solution (the notebook's hidden one), rejects plausible wrong
answers with the right hint, treats the unattempted stub kindly and reports a function that modifies its input."""

import pytest
import torch

from groundup.exercises import checking as _checking
from groundup.exercises.ch08 import (
    check_kv_cache_memory,
    check_temperature_softmax,
    check_top_k_filter,
    check_top_p_filter,
)

INF = float("-inf")

# --- reference solutions (the same code as the notebook's hidden solution cells) ---------------------------


def temperature_softmax(logits, temperature):
    z = logits / temperature
    z = z - z.max(dim=-1, keepdim=True).values  # the softmax is unchanged; exp no longer overflows
    e = z.exp()
    return e / e.sum(dim=-1, keepdim=True)


def top_k_filter(logits, k):
    k = min(k, logits.shape[-1])
    kth_largest = torch.topk(logits, k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth_largest, INF)


def top_p_filter(logits, p):
    probs = torch.softmax(logits, dim=-1)
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    remove_sorted = mass_before >= p - 1e-6  # "reaches p" up to rounding: 0.1 + 0.05 + 0.03 may be 0.17999999
    remove = torch.zeros_like(remove_sorted).scatter(-1, order, remove_sorted)
    return logits.masked_fill(remove, INF)


def kv_cache_memory(n_layers, n_heads, d_head, n_tokens, bytes_per_number):
    return 2 * n_layers * n_heads * d_head * n_tokens * bytes_per_number


def stub(*args):
    raise NotImplementedError


# --- wrong answers --------------------------------------------------------------------------------------------


def temperature_multiplied(logits, temperature):
    return torch.softmax(logits * temperature, dim=-1)


def temperature_naive_exp(logits, temperature):
    e = (logits / temperature).exp()
    return e / e.sum(dim=-1, keepdim=True)


def temperature_wrong_dim(logits, temperature):
    return torch.softmax(logits / temperature, dim=0)


def temperature_no_softmax(logits, temperature):
    return logits / temperature


def temperature_in_place(logits, temperature):
    logits /= temperature
    return torch.softmax(logits, dim=-1)


def temperature_always_float32(logits, temperature):
    return torch.softmax(logits.float() / temperature, dim=-1)


def temperature_returns_list(logits, temperature):
    return torch.softmax(logits / temperature, dim=-1).tolist()


def top_k_strict(logits, k):
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits <= kth, INF)


def top_k_exactly_k(logits, k):
    k = min(k, logits.shape[-1])
    idx = torch.topk(logits, k, dim=-1).indices
    return torch.full_like(logits, INF).scatter(-1, idx, logits.gather(-1, idx))


def top_k_whole_tensor(logits, k):
    kth = torch.topk(logits.flatten(), k).values[-1]
    return logits.masked_fill(logits < kth, INF)


def top_k_zero(logits, k):
    return top_k_filter(logits, k).nan_to_num(neginf=0.0)


def top_k_large_negative(logits, k):
    return top_k_filter(logits, k).nan_to_num(neginf=-1e9)


def top_k_no_clamp(logits, k):
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, INF)


def top_k_probabilities(logits, k):
    return torch.softmax(top_k_filter(logits, k), dim=-1)


def top_k_in_place(logits, k):
    kth = torch.topk(logits, min(k, logits.shape[-1]), dim=-1).values[..., -1:]
    logits[logits < kth] = INF
    return logits


def top_p_drops_the_crossing_token(logits, p):
    probs = torch.softmax(logits, dim=-1)
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
    remove_sorted = sorted_probs.cumsum(dim=-1) > p
    remove = torch.zeros_like(remove_sorted).scatter(-1, order, remove_sorted)
    return logits.masked_fill(remove, INF)


def top_p_drops_fruit(logits, p):  # exact arithmetic in the seeds' example: the sum reaches p at fruit
    probs = torch.softmax(logits, dim=-1)
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
    remove_sorted = sorted_probs.cumsum(dim=-1) > p - 1e-6
    remove = torch.zeros_like(remove_sorted).scatter(-1, order, remove_sorted)
    return logits.masked_fill(remove, INF)


def top_p_without_tolerance_keeping_cake(logits, p):  # as if 0.1 + 0.05 + 0.03 had come out below 0.18
    probs = torch.softmax(logits, dim=-1)
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
    remove_sorted = sorted_probs.cumsum(dim=-1) - sorted_probs >= p + 1e-9
    remove = torch.zeros_like(remove_sorted).scatter(-1, order, remove_sorted)
    return logits.masked_fill(remove, INF)


def top_p_keeps_one_too_many(logits, p):
    probs = torch.softmax(logits, dim=-1)
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    remove_sorted = torch.zeros_like(mass_before, dtype=torch.bool)
    remove_sorted[..., 1:] = (mass_before >= p - 1e-6)[..., :-1]
    remove = torch.zeros_like(remove_sorted).scatter(-1, order, remove_sorted)
    return logits.masked_fill(remove, INF)


def top_p_mask_not_unsorted(logits, p):
    probs = torch.softmax(logits, dim=-1)
    sorted_probs, _ = torch.sort(probs, dim=-1, descending=True)
    return logits.masked_fill(sorted_probs.cumsum(-1) - sorted_probs >= p - 1e-6, INF)


def top_p_ascending(logits, p):
    probs = torch.softmax(logits, dim=-1)
    sorted_probs, order = torch.sort(probs, dim=-1)
    remove_sorted = sorted_probs.cumsum(-1) - sorted_probs >= p
    remove = torch.zeros_like(remove_sorted).scatter(-1, order, remove_sorted)
    return logits.masked_fill(remove, INF)


def top_p_in_place(logits, p):
    out = top_p_filter(logits, p)
    logits.copy_(out)
    return logits


def top_p_returns_probabilities(logits, p):
    return torch.softmax(top_p_filter(logits, p), dim=-1)


def kv_without_values(n_layers, n_heads, d_head, n_tokens, b):
    return n_layers * n_heads * d_head * n_tokens * b


def kv_one_layer(n_layers, n_heads, d_head, n_tokens, b):
    return 2 * n_heads * d_head * n_tokens * b


def kv_numbers_not_bytes(n_layers, n_heads, d_head, n_tokens, b):
    return 2 * n_layers * n_heads * d_head * n_tokens


def kv_string(*args):
    return str(kv_cache_memory(*args))


# --- tests ------------------------------------------------------------------------------------------------------


CHECKERS = [(check_temperature_softmax, temperature_softmax), (check_top_k_filter, top_k_filter),
            (check_top_p_filter, top_p_filter), (check_kv_cache_memory, kv_cache_memory)]


@pytest.mark.parametrize("checker, solution", CHECKERS)
def test_the_reference_solution_passes(checker, solution, capsys):
    assert checker(solution)
    assert "✅" in capsys.readouterr().out


@pytest.mark.parametrize("checker", [c for c, _ in CHECKERS])
def test_the_stub_gets_a_friendly_reminder(checker, capsys):
    assert not checker(stub)
    out = capsys.readouterr().out
    assert "not attempted yet" in out and "Traceback" not in out


def test_the_package_functions_are_refused_however_they_are_called(capsys):
    from groundup import generation
    from groundup.generation import top_p_filter as imported_before

    for checker, package in ((check_top_k_filter, generation.top_k_filter),
                             (check_top_p_filter, generation.top_p_filter),
                             (check_top_p_filter, lambda logits, p: imported_before(logits, p))):
        assert not checker(package)
        out = capsys.readouterr().out
        assert "calls groundup.generation.top_" in out and "compute it yourself" in out, out
    x = torch.tensor([[1.0, 2.0, 3.0]])
    assert torch.isfinite(generation.top_p_filter(x, 0.5)).sum() == 1, "the package works again afterwards"


def hugging_face_top_p(logits, p, tolerance=1e-6):
    """Ascending order, as in Hugging Face's TopPLogitsWarper, with the exercise's tolerance."""
    sorted_logits, order = torch.sort(logits, descending=False)
    remove = sorted_logits.softmax(-1).cumsum(-1) <= 1 - p + tolerance
    remove[..., -1:] = False
    return logits.masked_fill(remove.scatter(-1, order, remove), INF)


def test_a_hugging_face_style_top_p_passes_with_the_tolerance_and_is_told_how_without(capsys):
    assert check_top_p_filter(hugging_face_top_p), capsys.readouterr().out
    capsys.readouterr()
    assert not check_top_p_filter(lambda logits, p: hugging_face_top_p(logits, p, tolerance=0.0))
    out = capsys.readouterr().out
    assert "You also kept cake" in out and "<= 1 - p + 1e-6" in out, out


def test_kv_cache_memory_as_a_float_is_refused(capsys):
    assert not check_kv_cache_memory(lambda *args: float(kv_cache_memory(*args)))
    out = capsys.readouterr().out
    assert "expected an int" in out and "//" in out, out


@pytest.mark.parametrize("checker, wrong, hint", [
    (check_temperature_softmax, temperature_multiplied, "You multiplied by the temperature"),
    (check_temperature_softmax, temperature_naive_exp, "subtract the largest logit"),
    (check_temperature_softmax, temperature_wrong_dim, "not dim=0"),
    (check_temperature_softmax, temperature_no_softmax, "apply the softmax"),
    (check_temperature_softmax, temperature_always_float32, "Keep the input's dtype"),
    (check_temperature_softmax, temperature_returns_list, "Return a torch.Tensor"),
    (check_top_k_filter, top_k_strict, "removes the k-th largest logit itself"),
    (check_top_k_filter, top_k_exactly_k, "must all be kept"),
    (check_top_k_filter, top_k_whole_tensor, "Filter each row"),
    (check_top_k_filter, top_k_zero, "float('-inf'): a logit of 0"),
    (check_top_k_filter, top_k_large_negative, "rather than a large negative number"),
    (check_top_k_filter, top_k_no_clamp, "min(k, logits.shape[-1])"),
    (check_top_k_filter, top_k_probabilities, "not probabilities"),
    (check_top_p_filter, top_p_drops_the_crossing_token, "You dropped the token whose probability makes"),
    (check_top_p_filter, top_p_drops_fruit, "You dropped fruit"),
    (check_top_p_filter, top_p_without_tolerance_keeping_cake, "within 1e-6 of p"),
    (check_top_p_filter, top_p_keeps_one_too_many, "You also kept cake"),
    (check_top_p_filter, top_p_mask_not_unsorted, "original order"),
    (check_top_p_filter, top_p_ascending, "descending order"),
    (check_top_p_filter, top_p_returns_probabilities, "not probabilities"),
    (check_kv_cache_memory, kv_without_values, "a factor 2"),
    (check_kv_cache_memory, kv_one_layer, "times n_layers"),
    (check_kv_cache_memory, kv_numbers_not_bytes, "bytes_per_number"),
    (check_kv_cache_memory, kv_string, "as an int"),
])
def test_wrong_answers_are_rejected_with_the_right_hint(checker, wrong, hint, capsys):
    assert not checker(wrong)
    out = capsys.readouterr().out
    assert "❌" in out and hint in out, out


@pytest.mark.parametrize("checker, wrong", [(check_temperature_softmax, temperature_in_place),
                                            (check_top_k_filter, top_k_in_place),
                                            (check_top_p_filter, top_p_in_place)])
def test_a_function_that_modifies_its_input_is_reported(checker, wrong, capsys):
    assert not checker(wrong)
    out = capsys.readouterr().out
    assert "changed its input logits in place" in out and "compute new values" in out


def test_a_crash_in_the_readers_function_becomes_a_verdict(capsys):
    def broken(logits, p):
        return logits[99]

    assert not check_top_p_filter(broken)
    out = capsys.readouterr().out
    assert "raised IndexError" in out and "Hint:" in out


def test_a_top_p_without_the_tolerance_is_rejected_and_the_random_cases_have_a_margin(capsys):
    """The random cases give the same tokens with and without the 1e-6 tolerance; the seeds' example at
    p = 0.1800005 does not, so a solution without the tolerance the exercise demands fails there."""
    from groundup.generation import top_p_filter as package_top_p

    g = torch.Generator().manual_seed(83)
    rows = torch.randn(4, 12, generator=g, dtype=torch.float64) * 1.5
    for x, p in [(rows, 0.5), (rows, 0.9), (rows, 1e-3), (rows.float(), 0.7)]:
        assert torch.equal(top_p_filter(x, p), package_top_p(x, p))
        probs = torch.sort(torch.softmax(x.double(), -1), descending=True).values
        before = (probs.cumsum(-1) - probs)[..., 1:]  # the most probable token is always kept
        assert ((before - p).abs() > 1e-4).all()

    def without_tolerance(logits, p):
        probs = torch.softmax(logits, dim=-1)
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        remove_sorted = sorted_probs.cumsum(dim=-1) - sorted_probs >= p
        return logits.masked_fill(torch.zeros_like(remove_sorted).scatter(-1, order, remove_sorted), INF)

    assert not check_top_p_filter(without_tolerance)
    out = capsys.readouterr().out  # at p = 0.18 already where 0.1 + 0.05 + 0.03 rounds below 0.18 (some CPUs)
    assert "p=0.18" in out and "within 1e-6 of p" in out, out


def test_checkers_leave_the_global_random_state_alone():
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    check_top_p_filter(top_p_filter)
    assert torch.equal(torch.rand(3), expected)


@pytest.fixture(autouse=True)
def _unwrapped_verdicts(monkeypatch):
    """Match hints as whole lines; tests/test_checking.py tests the wrapping to the book's width."""
    monkeypatch.setattr(_checking, "MESSAGE_WIDTH", 10_000)


def test_the_benchmarks_kv_cache_bytes_is_refused(capsys):
    from groundup.bench import generation as bench_generation
    from groundup.models import GPTConfig

    def via_the_package(n_layers, n_heads, d_head, n_tokens, bytes_per_number):
        config = GPTConfig(vocab_size=2, context_length=n_tokens, d_model=n_heads * d_head, n_layers=n_layers,
                           n_heads=n_heads)
        return bench_generation.kv_cache_bytes(config, n_tokens, bytes_per_number=bytes_per_number)

    assert not check_kv_cache_memory(via_the_package)
    out = capsys.readouterr().out
    assert "calls groundup.bench.generation.kv_cache_bytes" in out and "compute it yourself" in out, out
    config = GPTConfig(vocab_size=2, context_length=4, d_model=8, n_layers=3, n_heads=2)
    assert bench_generation.kv_cache_bytes(config, 4) == 2 * 3 * 8 * 4 * 4, "the package works again afterwards"
