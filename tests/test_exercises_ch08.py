"""Each chapter-8 checker accepts the reference solution (the notebook's hidden one), rejects plausible wrong
answers with the right hint, treats the unattempted stub kindly and reports a function that modifies its input."""

import math

import pytest
import torch

from groundup.exercises import checking as _checking
from groundup.exercises.ch08 import (
    check_kv_cache_memory_gqa,
    check_min_p_filter,
    check_repetition_penalty,
    check_top_p_filter,
)

INF = float("-inf")

# --- reference solutions (the same code as the notebook's hidden solution cells) ---------------------------


def top_p_filter(logits, p):
    probs = torch.softmax(logits, dim=-1)
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    remove_sorted = mass_before >= p - 1e-6  # "reaches p" up to rounding: 0.1 + 0.05 + 0.03 may be 0.17999999
    remove = torch.zeros_like(remove_sorted).scatter(-1, order, remove_sorted)
    return logits.masked_fill(remove, INF)


def stub(*args):
    raise NotImplementedError


# --- wrong answers --------------------------------------------------------------------------------------------


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


# --- tests ------------------------------------------------------------------------------------------------------


CHECKERS = [(check_top_p_filter, top_p_filter)]


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

    for checker, package in ((check_top_p_filter, generation.top_p_filter),
                             (check_top_p_filter, generation.top_k_filter),
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


@pytest.mark.parametrize("checker, wrong, hint", [
    (check_top_p_filter, top_p_drops_the_crossing_token, "You dropped the token whose probability makes"),
    (check_top_p_filter, top_p_drops_fruit, "You dropped fruit"),
    (check_top_p_filter, top_p_without_tolerance_keeping_cake, "within 1e-6 of p"),
    (check_top_p_filter, top_p_keeps_one_too_many, "You also kept cake"),
    (check_top_p_filter, top_p_mask_not_unsorted, "original order"),
    (check_top_p_filter, top_p_ascending, "descending order"),
    (check_top_p_filter, top_p_returns_probabilities, "not probabilities"),
])
def test_wrong_answers_are_rejected_with_the_right_hint(checker, wrong, hint, capsys):
    assert not checker(wrong)
    out = capsys.readouterr().out
    assert "❌" in out and hint in out, out


@pytest.mark.parametrize("checker, wrong", [(check_top_p_filter, top_p_in_place)])
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

    def via_the_package(config, n_tokens, batch_size, bytes_per_number):  # the right numbers (n_kv_heads counted)
        return bench_generation.kv_cache_bytes(config, n_tokens, batch=batch_size, bytes_per_number=bytes_per_number)

    assert not check_kv_cache_memory_gqa(via_the_package)
    out = capsys.readouterr().out
    assert "calls groundup.bench.generation.kv_cache_bytes" in out and "compute it yourself" in out, out
    config = GPTConfig(vocab_size=2, context_length=4, d_model=8, n_layers=3, n_heads=2, n_kv_heads=1)
    expected = 2 * 3 * 1 * 4 * 4 * 4  # 2 n_layers n_kv_heads d_head n_tokens bytes: grouped-query attention counted
    assert bench_generation.kv_cache_bytes(config, 4) == expected, "the package works again afterwards"


# --- min-p, a repetition penalty, the KV cache of a model with grouped-query attention -----------------------
# The reference solutions (the notebook's hidden solution cells), then the typical mistakes.


def min_p_filter(logits, min_p):
    probs = torch.softmax(logits, dim=-1)
    p_max = probs.amax(dim=-1, keepdim=True)  # keepdim: one maximum per row, broadcast
    return logits.masked_fill(probs < min_p * p_max, float("-inf"))


def repetition_penalty(logits, ids, theta):
    # True where the row's text holds the token: once, however often it occurs
    seen = torch.zeros_like(logits, dtype=torch.bool).scatter(1, ids, True)
    penalised = torch.where(logits > 0, logits / theta, logits * theta)
    return torch.where(seen, penalised, logits)


def kv_cache_memory_gqa(config, n_tokens, batch_size, bytes_per_number):
    n_kv_heads = config.n_heads if config.n_kv_heads is None else config.n_kv_heads
    per_token = 2 * config.n_layers * n_kv_heads * config.d_head  # keys and values
    return per_token * n_tokens * batch_size * bytes_per_number


def min_p_in_log_space(logits, min_p):  # also correct: p / p_max = exp(logit - max logit)
    gap = logits - logits.amax(dim=-1, keepdim=True)
    return logits.masked_fill(gap < math.log(min_p), INF)


def repetition_penalty_row_by_row(logits, ids, theta):  # also correct, with a loop
    out = logits.clone()
    for b in range(logits.shape[0]):
        for t in set(ids[b].tolist()):
            out[b, t] = out[b, t] / theta if out[b, t] > 0 else out[b, t] * theta
    return out


def min_p_logits_compared(logits, min_p):
    return logits.masked_fill(logits < min_p * logits.amax(dim=-1, keepdim=True), INF)


def min_p_absolute(logits, min_p):
    return logits.masked_fill(torch.softmax(logits, dim=-1) < min_p, INF)


def min_p_at_or_below(logits, min_p):
    probs = torch.softmax(logits, dim=-1)
    return logits.masked_fill(probs <= min_p * probs.amax(dim=-1, keepdim=True), INF)


def min_p_batch_maximum(logits, min_p):
    probs = torch.softmax(logits, dim=-1)
    return logits.masked_fill(probs < min_p * probs.max(), INF)


def min_p_softmax_over_dim0(logits, min_p):
    probs = torch.softmax(logits, dim=0)
    return logits.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), INF)


def min_p_without_keepdim(logits, min_p):
    probs = torch.softmax(logits, dim=-1)
    return logits.masked_fill(probs < min_p * probs.amax(dim=-1), INF)


def min_p_zero(logits, min_p):
    return min_p_filter(logits, min_p).nan_to_num(neginf=0.0)


def min_p_large_negative(logits, min_p):
    return min_p_filter(logits, min_p).nan_to_num(neginf=-1e9)


def min_p_probabilities(logits, min_p):
    return torch.softmax(min_p_filter(logits, min_p), dim=-1)


def min_p_log_probabilities(logits, min_p):
    return torch.log_softmax(min_p_filter(logits, min_p), dim=-1)


def min_p_always_float64(logits, min_p):
    return min_p_filter(logits.double(), min_p)


def min_p_in_place(logits, min_p):
    probs = torch.softmax(logits, dim=-1)
    logits[probs < min_p * probs.amax(dim=-1, keepdim=True)] = INF
    return logits


def _seen(logits, ids):
    return torch.zeros_like(logits, dtype=torch.bool).scatter(1, ids, True)


def repetition_across_rows(logits, ids, theta):
    seen = _seen(logits, ids).any(dim=0, keepdim=True)
    return torch.where(seen, torch.where(logits > 0, logits / theta, logits * theta), logits)


def repetition_divides_all(logits, ids, theta):  # CTRL's formula without the sign rule
    return torch.where(_seen(logits, ids), logits / theta, logits)


def repetition_signs_swapped(logits, ids, theta):
    return torch.where(_seen(logits, ids), torch.where(logits > 0, logits * theta, logits / theta), logits)


def repetition_per_occurrence(logits, ids, theta):
    out = logits.clone()
    for b in range(ids.shape[0]):
        for t in ids[b].tolist():
            out[b, t] = out[b, t] / theta if out[b, t] > 0 else out[b, t] * theta
    return out


def repetition_subtracts(logits, ids, theta):
    return torch.where(_seen(logits, ids), logits - theta, logits)


def repetition_subtracts_log(logits, ids, theta):
    return torch.where(_seen(logits, ids), logits - math.log(theta), logits)


def repetition_at_positions(logits, ids, theta):
    out = logits.clone()
    part = out[:, :ids.shape[1]]
    out[:, :ids.shape[1]] = torch.where(part > 0, part / theta, part * theta)
    return out


def repetition_nothing(logits, ids, theta):
    return logits.clone()


def repetition_always_float32(logits, ids, theta):
    return repetition_penalty(logits.float(), ids, theta)


def repetition_in_place(logits, ids, theta):
    seen = _seen(logits, ids)
    logits[seen] = torch.where(logits[seen] > 0, logits[seen] / theta, logits[seen] * theta)
    return logits


def _kv_parts(config):
    n_kv_heads = config.n_heads if config.n_kv_heads is None else config.n_kv_heads
    return config.n_layers, config.n_heads, n_kv_heads, config.d_head, config.d_model


def kv_n_heads(config, n_tokens, batch_size, b):
    n_layers, n_heads, _, d_head, _ = _kv_parts(config)
    return 2 * n_layers * n_heads * d_head * n_tokens * batch_size * b


def kv_d_model(config, n_tokens, batch_size, b):  # d_model in place of n_kv_heads * d_head
    n_layers, _, _, _, d_model = _kv_parts(config)
    return 2 * n_layers * d_model * n_tokens * batch_size * b


def kv_d_model_per_head(config, n_tokens, batch_size, b):  # d_model in place of d_head
    n_layers, _, n_kv_heads, _, d_model = _kv_parts(config)
    return 2 * n_layers * n_kv_heads * d_model * n_tokens * batch_size * b


def kv_no_two(config, n_tokens, batch_size, b):
    return kv_cache_memory_gqa(config, n_tokens, batch_size, b) // 2


def kv_no_batch(config, n_tokens, batch_size, b):
    return kv_cache_memory_gqa(config, n_tokens, 1, b)


def kv_no_bytes(config, n_tokens, batch_size, b):
    return kv_cache_memory_gqa(config, n_tokens, batch_size, 1)


def kv_no_layers(config, n_tokens, batch_size, b):
    return kv_cache_memory_gqa(config, n_tokens, batch_size, b) // config.n_layers


def kv_no_tokens(config, n_tokens, batch_size, b):
    return kv_cache_memory_gqa(config, 1, batch_size, b)


def kv_n_kv_heads_as_given(config, n_tokens, batch_size, b):  # None for GPT-2: TypeError
    return 2 * config.n_layers * config.n_kv_heads * config.d_head * n_tokens * batch_size * b


def kv_as_string(*args):
    return str(kv_cache_memory_gqa(*args))


NEW_CHECKERS = [(check_min_p_filter, min_p_filter), (check_repetition_penalty, repetition_penalty),
                (check_kv_cache_memory_gqa, kv_cache_memory_gqa)]


@pytest.mark.parametrize("checker, solution", NEW_CHECKERS + [
    (check_min_p_filter, min_p_in_log_space), (check_repetition_penalty, repetition_penalty_row_by_row),
    (check_kv_cache_memory_gqa, lambda *args: float(kv_cache_memory_gqa(*args)))])
def test_the_new_checkers_accept_correct_solutions(checker, solution, capsys):
    assert checker(solution), capsys.readouterr().out
    assert "✅" in capsys.readouterr().out


@pytest.mark.parametrize("checker", [c for c, _ in NEW_CHECKERS])
def test_the_new_checkers_greet_the_stub(checker, capsys):
    assert not checker(stub)
    out = capsys.readouterr().out
    assert "not attempted yet" in out and "Traceback" not in out


@pytest.mark.parametrize("checker, wrong, hint", [
    (check_min_p_filter, min_p_logits_compared, "Compare probabilities, not logits"),
    (check_min_p_filter, min_p_absolute, "not p < min_p"),
    (check_min_p_filter, min_p_at_or_below, "strictly below the threshold"),
    (check_min_p_filter, min_p_batch_maximum, "not of the whole batch"),
    (check_min_p_filter, min_p_softmax_over_dim0, "not over dim=0"),
    (check_min_p_filter, min_p_without_keepdim, "keepdim=True"),
    (check_min_p_filter, min_p_zero, "float('-inf'): a logit of 0"),
    (check_min_p_filter, min_p_large_negative, "rather than a large negative number"),
    (check_min_p_filter, min_p_probabilities, "not probabilities"),
    (check_min_p_filter, min_p_log_probabilities, "Leave the kept logits unchanged"),
    (check_min_p_filter, min_p_always_float64, "Keep the input's dtype"),
    (check_repetition_penalty, repetition_across_rows, "by its own ids"),
    (check_repetition_penalty, repetition_divides_all, "negative ones too"),
    (check_repetition_penalty, repetition_signs_swapped, "raises the repeated tokens"),
    (check_repetition_penalty, repetition_per_occurrence, "once however often it occurs"),
    (check_repetition_penalty, repetition_subtracts, "do not subtract theta"),
    (check_repetition_penalty, repetition_subtracts_log, "do not subtract log(theta)"),
    (check_repetition_penalty, repetition_at_positions, "not logits[b, j] (the position j)"),
    (check_repetition_penalty, repetition_nothing, "Nothing changed"),
    (check_repetition_penalty, repetition_always_float32, "Keep the input's dtype"),
    (check_kv_cache_memory_gqa, kv_n_heads, "only the n_kv_heads key/value heads are cached"),
    (check_kv_cache_memory_gqa, kv_d_model, "only the n_kv_heads key/value heads are cached"),
    (check_kv_cache_memory_gqa, kv_d_model_per_head, "d_head = config.d_head = d_model / n_heads"),
    (check_kv_cache_memory_gqa, kv_no_two, "a factor 2"),
    (check_kv_cache_memory_gqa, kv_no_batch, "multiply by batch_size"),
    (check_kv_cache_memory_gqa, kv_no_bytes, "multiply by bytes_per_number"),
    (check_kv_cache_memory_gqa, kv_no_layers, "times n_layers"),
    (check_kv_cache_memory_gqa, kv_no_tokens, "multiply by n_tokens"),
    (check_kv_cache_memory_gqa, kv_n_kv_heads_as_given, "which is None in a model with ordinary multi-head"),
    (check_kv_cache_memory_gqa, kv_as_string, "Return the number of bytes"),
])
def test_the_new_checkers_name_each_mistake(checker, wrong, hint, capsys):
    assert not checker(wrong)
    out = capsys.readouterr().out
    assert "❌" in out and hint in out, out


@pytest.mark.parametrize("checker, wrong, name", [(check_min_p_filter, min_p_in_place, "logits"),
                                                  (check_repetition_penalty, repetition_in_place, "logits")])
def test_the_new_checkers_report_an_input_changed_in_place(checker, wrong, name, capsys):
    assert not checker(wrong)
    out = capsys.readouterr().out
    assert f"changed its input {name} in place" in out and "compute new values" in out, out


def test_the_kv_checker_reports_a_config_changed_in_place(capsys):
    def sets_n_kv_heads(config, n_tokens, batch_size, b):
        if config.n_kv_heads is None:
            config.n_kv_heads = config.n_heads
        return kv_cache_memory_gqa(config, n_tokens, batch_size, b)

    assert not check_kv_cache_memory_gqa(sets_n_kv_heads)
    assert "changed its input config in place" in capsys.readouterr().out


def test_the_new_checkers_refuse_transformers(capsys):
    from transformers import (
        EncoderRepetitionPenaltyLogitsProcessor,
        MinPLogitsWarper,
        RepetitionPenaltyLogitsProcessor,
    )

    def min_p_by_transformers(logits, min_p):
        return MinPLogitsWarper(min_p, min_tokens_to_keep=1)(None, logits)

    def penalty_by_transformers(logits, ids, theta):
        return RepetitionPenaltyLogitsProcessor(penalty=float(theta))(ids, logits)

    def penalty_by_the_encoder_processor(logits, ids, theta):  # its penalty works the other way round
        return EncoderRepetitionPenaltyLogitsProcessor(penalty=1 / theta, encoder_input_ids=ids)(ids, logits)

    def min_p_importing_transformers_itself(logits, min_p):
        from transformers.generation.logits_process import MinPLogitsWarper as Warper

        return Warper(min_p)(None, logits)

    for checker, cheat, name in [(check_min_p_filter, min_p_by_transformers, "MinPLogitsWarper"),
                                 (check_min_p_filter, min_p_importing_transformers_itself, "MinPLogitsWarper"),
                                 (check_repetition_penalty, penalty_by_transformers,
                                  "RepetitionPenaltyLogitsProcessor"),
                                 (check_repetition_penalty, penalty_by_the_encoder_processor,
                                  "EncoderRepetitionPenaltyLogitsProcessor")]:
        assert not checker(cheat)
        out = capsys.readouterr().out
        assert f"calls transformers.{name}" in out and "library's own implementation" in out, out
    x = torch.tensor([[2.0, 1.0, -3.0]])
    assert torch.isneginf(MinPLogitsWarper(0.5)(None, x)).sum() == 2, "transformers works again afterwards"
    assert RepetitionPenaltyLogitsProcessor(2.0)(torch.tensor([[0]]), x)[0, 0] == 1.0


def test_the_new_checkers_refuse_the_package(capsys):
    from groundup import generation
    from groundup.bench import generation as bench_generation
    from groundup.generation import top_k_filter as imported_before
    from groundup.models import GPT

    def min_p_through_sampling_logits(logits, min_p):
        return min_p_filter(generation.sampling_logits(logits, 1.0, None, None), min_p)

    def penalty_after_a_no_op_top_k(logits, ids, theta):
        return repetition_penalty(imported_before(logits, logits.shape[-1]), ids, theta)

    def kv_by_the_benchmark(config, n_tokens, batch_size, b):
        return bench_generation.kv_cache_bytes(config, n_tokens, batch=batch_size, bytes_per_number=b)

    def kv_by_building_the_model(config, n_tokens, batch_size, b):
        GPT(config)
        return kv_cache_memory_gqa(config, n_tokens, batch_size, b)

    for checker, cheat, called, hint in [
            (check_min_p_filter, min_p_through_sampling_logits, "groundup.generation.sampling_logits",
             "groundup.generation is the book's own"),
            (check_repetition_penalty, penalty_after_a_no_op_top_k, "groundup.generation.top_k_filter",
             "groundup.generation is the book's own"),
            (check_kv_cache_memory_gqa, kv_by_the_benchmark, "groundup.bench.generation.kv_cache_bytes",
             "compute it yourself"),
            (check_kv_cache_memory_gqa, kv_by_building_the_model, "groundup.models.GPT", "with arithmetic")]:
        assert not checker(cheat)
        out = capsys.readouterr().out
        assert f"calls {called}" in out and hint in out, out
    x = torch.tensor([[1.0, 2.0, 3.0]])
    assert torch.isfinite(generation.top_k_filter(x, 2)).sum() == 2, "the package works again afterwards"


# --- the checkers' expected values are transformers' --------------------------------------------------------


def _random_logits(g, shape, dtype):
    x = torch.randn(*shape, generator=g, dtype=torch.float64) * float(torch.empty(1).uniform_(0.5, 4, generator=g))
    x[x.abs() < 0.05] = 0.0
    if shape[-1] > 3:  # ties at the top of some rows
        x[..., 1] = torch.where(torch.rand(shape[:-1], generator=g, dtype=torch.float64) < 0.3,
                                x.amax(dim=-1), x[..., 1])
    return x.to(dtype)


def test_the_min_p_reference_is_transformers_min_p_logits_warper():
    from transformers import MinPLogitsWarper

    from groundup.exercises.ch08 import _min_p_cases, _reference_min_p

    g = torch.Generator().manual_seed(0)
    cases = [(x, min_p) for x, min_p, _ in _min_p_cases()]
    for i in range(300):
        shape = [(17,), (4, 9), (3, 5, 30), (2, 64)][i % 4]
        min_p = [1.0, 0.5, 0.1, 0.01][i % 7] if i % 7 < 4 else float(torch.rand(1, generator=g)) or 1.0
        cases.append((_random_logits(g, shape, (torch.float32, torch.float64)[i % 2]), min_p))
    for x, min_p in cases:
        expected = MinPLogitsWarper(min_p, min_tokens_to_keep=1)(None, x.clone())
        assert torch.equal(_reference_min_p(x, min_p), expected), (x, min_p)
        assert torch.equal(min_p_filter(x, min_p), expected)


def test_the_min_p_cases_keep_a_margin_from_every_threshold():
    """Any correct way of comparing (probabilities in either dtype, logit gaps against log(min_p)) keeps the same
    tokens: no probability lies near its threshold, except the exact ties with the top at min_p = 1."""
    from groundup.exercises.ch08 import _min_p_cases

    for x, min_p, _ in _min_p_cases():
        probs = torch.softmax(x.double(), dim=-1)
        ratio = (probs / probs.amax(dim=-1, keepdim=True))[torch.isfinite(x)]
        near = (ratio - min_p).abs() <= 1e-4 * min_p
        assert not near.any() or (min_p == 1.0 and bool((ratio[near] == 1.0).all())), (x, min_p)


def test_the_repetition_reference_is_transformers_repetition_penalty():
    from transformers import RepetitionPenaltyLogitsProcessor

    from groundup.exercises.ch08 import _reference_repetition_penalty, _repetition_cases

    g = torch.Generator().manual_seed(1)
    cases = [(x, ids, theta) for x, ids, theta, _ in _repetition_cases()]
    for i in range(300):
        batch, vocab, seq = 1 + i % 4, [5, 16, 50][i % 3], 1 + (7 * i) % 40  # seq > vocab: many repeats
        x = _random_logits(g, (batch, vocab), (torch.float32, torch.float64)[i % 2])
        ids = torch.randint(0, vocab, (batch, seq), generator=g)
        cases.append((x, ids, [1.2, 1.5, 2.0, 1.05, 3.0][i % 5]))
    for x, ids, theta in cases:
        expected = RepetitionPenaltyLogitsProcessor(penalty=float(theta))(ids.clone(), x.clone())
        assert torch.equal(_reference_repetition_penalty(x, ids, theta), expected), (x, ids, theta)
        assert torch.equal(repetition_penalty(x, ids, theta), expected)


def test_the_kv_cache_cases_are_the_models_they_say():
    from groundup.exercises.ch08 import _kv_bytes, _kv_configs

    smollm2 = _kv_configs()[0][1]
    assert (smollm2.n_layers, smollm2.n_heads, smollm2.n_kv_heads, smollm2.d_model, smollm2.d_head,
            smollm2.context_length) == (30, 9, 3, 576, 64, 8192)
    assert _kv_bytes(smollm2, 1, 1, 2) == 22.5 * 1024  # the success message's 22.5 KiB per token in bfloat16
    gpt2 = _kv_configs()[1][1]
    assert gpt2.n_kv_heads is None and _kv_bytes(gpt2, 1, 1, 2) == 36 * 1024  # GPT-2 small: 36 KiB per token in float16


# --- shortcuts saved before the check: the checker's own references, transformers' processors -----------------
# Each cheat below gives the right numbers (the ones that compute an answer passed the checkers before they swapped
# the functions' code for tripwires); now each is refused by name, and everything works again afterwards.

from groundup.exercises import ch08 as _ch08  # noqa: E402 -- with the section that uses it

_saved_min_p = _ch08._reference_min_p  # aliases taken before any check
_saved_kv_bytes = _ch08._kv_bytes


def _min_p_caught(logits, min_p):  # calls the reference, catches the refusal, answers by itself
    try:
        _ch08._reference_min_p(logits, min_p)
    except BaseException:  # noqa: BLE001,S110 -- the point of the test
        pass
    return min_p_filter(logits, min_p)


def _repetition_by_the_mistakes_helper(logits, ids, theta):  # one row at a time, "across rows" is the right rule
    return torch.cat([_ch08._repetition_wrong(logits[b:b + 1], ids[b:b + 1], theta)[0][0]
                      for b in range(logits.shape[0])])


REFERENCE_CHEATS = [
    (check_min_p_filter, lambda logits, min_p: _ch08._reference_min_p(logits, min_p), "_reference_min_p"),
    (check_min_p_filter, lambda logits, min_p: _saved_min_p(logits, min_p), "_reference_min_p"),
    (check_min_p_filter, _min_p_caught, "_reference_min_p"),
    (check_repetition_penalty, lambda logits, ids, theta: _ch08._reference_repetition_penalty(logits, ids, theta),
     "_reference_repetition_penalty"),
    (check_repetition_penalty, _repetition_by_the_mistakes_helper, "_repetition_wrong"),
    (check_top_p_filter, lambda logits, p: _ch08._reference_top_p(logits, p), "_reference_top_p"),
    (check_top_p_filter, lambda logits, p: logits.masked_fill(~_ch08._hugging_face_style(logits, p, 1e-6), INF),
     "_hugging_face_style"),
    (check_kv_cache_memory_gqa, lambda config, n, batch, b: _ch08._kv_bytes(config, n, batch, b), "_kv_bytes"),
    (check_kv_cache_memory_gqa, lambda config, n, batch, b: _saved_kv_bytes(config, n, batch, b), "_kv_bytes"),
]


@pytest.mark.parametrize("checker, cheat, name", REFERENCE_CHEATS)
def test_the_checkers_own_references_are_refused_however_they_are_reached(checker, cheat, name, capsys):
    assert not checker(cheat)
    out = capsys.readouterr().out
    assert f"calls groundup.exercises.ch08.{name}" in out and "the checker's own code" in out, out


def test_the_reference_cheats_give_the_right_numbers_and_the_references_work_again_afterwards(capsys):
    for checker, cheat, _ in REFERENCE_CHEATS:
        assert not checker(cheat)
    capsys.readouterr()
    seeds = torch.tensor([0.1, 0.05, 0.03, 0.02] + [0.01] * 80, dtype=torch.float64).log()
    logits = torch.tensor([[2.0, -1.0, 0.5, 0.0, -3.0, 1.5], [1.0, 1.0, -2.0, 0.3, 0.0, -0.5]], dtype=torch.float64)
    ids = torch.tensor([[0, 1, 3, 0, 0], [2, 2, 5, 4, 1]])
    config = _ch08._kv_configs()[0][1]
    for checker, cheat, _ in REFERENCE_CHEATS:  # outside the checker, each cheat is a right answer
        if checker is check_min_p_filter:
            assert torch.equal(cheat(seeds, 0.25), min_p_filter(seeds, 0.25))
        elif checker is check_repetition_penalty:
            assert torch.equal(cheat(logits, ids, 2.0), repetition_penalty(logits, ids, 2.0))
        elif checker is check_top_p_filter:
            assert torch.equal(cheat(seeds, 0.18), top_p_filter(seeds, 0.18))
        else:
            assert cheat(config, 8192, 5, 4) == kv_cache_memory_gqa(config, 8192, 5, 4)
    assert check_min_p_filter(min_p_filter) and check_top_p_filter(top_p_filter), "the checkers work again"
    assert check_repetition_penalty(repetition_penalty) and check_kv_cache_memory_gqa(kv_cache_memory_gqa)


def test_transformers_saved_before_the_check_is_refused(capsys):
    from transformers import (
        EncoderRepetitionPenaltyLogitsProcessor,
        MinPLogitsWarper,
        RepetitionPenaltyLogitsProcessor,
        TopPLogitsWarper,
    )

    min_p_call = MinPLogitsWarper.__call__  # the class's method, saved before the check
    min_p_warper = MinPLogitsWarper(0.1)  # an instance built before the check
    penalty_call = RepetitionPenaltyLogitsProcessor.__call__
    penalty = RepetitionPenaltyLogitsProcessor(2.0)
    penalty_bound = penalty.__call__  # a bound method
    encoder_call = EncoderRepetitionPenaltyLogitsProcessor.__call__
    encoder = EncoderRepetitionPenaltyLogitsProcessor(penalty=0.5, encoder_input_ids=torch.tensor([[0]]))
    top_p_warper = TopPLogitsWarper(0.5)

    def min_p_by_the_saved_call(logits, min_p):
        min_p_warper.min_p = min_p
        return min_p_call(min_p_warper, None, logits)

    def min_p_by_the_instance(logits, min_p):
        min_p_warper.min_p = min_p
        return min_p_warper(None, logits)

    def penalty_by_the_saved_call(logits, ids, theta):
        penalty.penalty = float(theta)
        return penalty_call(penalty, ids, logits.clone())

    def penalty_by_the_bound_method(logits, ids, theta):
        penalty.penalty = float(theta)
        return penalty_bound(ids, logits.clone())

    def penalty_by_the_saved_encoder_call(logits, ids, theta):
        encoder.penalty, encoder.encoder_input_ids = float(theta), ids  # __init__ stores 1 / penalty
        return encoder_call(encoder, ids, logits.clone())

    def top_p_by_the_instance(logits, p):
        top_p_warper.top_p = p
        return top_p_warper(None, logits)

    seeds = torch.tensor([0.1, 0.05, 0.03, 0.02] + [0.01] * 80, dtype=torch.float64).log()
    logits = torch.tensor([[2.0, -1.0, 0.5, 0.0, -3.0, 1.5], [1.0, 1.0, -2.0, 0.3, 0.0, -0.5]], dtype=torch.float64)
    ids = torch.tensor([[0, 1, 3, 0, 0], [2, 2, 5, 4, 1]])
    cheats = [(check_min_p_filter, min_p_by_the_saved_call, "MinPLogitsWarper"),
              (check_min_p_filter, min_p_by_the_instance, "MinPLogitsWarper"),
              (check_repetition_penalty, penalty_by_the_saved_call, "RepetitionPenaltyLogitsProcessor"),
              (check_repetition_penalty, penalty_by_the_bound_method, "RepetitionPenaltyLogitsProcessor"),
              (check_repetition_penalty, penalty_by_the_saved_encoder_call, "EncoderRepetitionPenaltyLogitsProcessor"),
              (check_top_p_filter, top_p_by_the_instance, "TopPLogitsWarper")]
    for checker, cheat, name in cheats:
        assert not checker(cheat)
        out = capsys.readouterr().out
        assert f"calls transformers.{name}" in out and "library's own implementation" in out, out
    for checker, cheat, _ in cheats[:-1]:  # the right numbers outside the checker, and transformers works again
        if checker is check_min_p_filter:
            assert torch.equal(cheat(seeds, 0.25), min_p_filter(seeds, 0.25))
        else:
            assert torch.equal(cheat(logits, ids, 2.0), repetition_penalty(logits, ids, 2.0))
    x = torch.tensor([[2.0, 1.0, -3.0]])
    assert torch.isneginf(MinPLogitsWarper(0.5)(None, x)).sum() == 2
    assert torch.isneginf(top_p_by_the_instance(x, 0.5)).sum() == 2
    assert RepetitionPenaltyLogitsProcessor(2.0)(torch.tensor([[0]]), x)[0, 0] == 1.0

