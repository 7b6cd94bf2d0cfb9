"""Each chapter-7 checker accepts the reference solution, rejects plausible wrong answers with the right hint,
treats the unattempted stub kindly and reports answers that modify their inputs."""

import json
import math
import re
from pathlib import Path

import pytest
import torch

from groundup.exercises import ch07 as _ch07
from groundup.exercises import checking as _checking
from groundup.exercises.ch07 import (
    check_accumulated_gradients,
    check_adam_l2_step,
    check_clip_gradients,
    check_lr_schedule,
)

# --- reference solutions (the notebook's hidden solutions) ----------------------------------------------------


def lr_solution(step, max_steps, warmup_steps, lr_max, lr_min):
    if step < warmup_steps:
        return lr_max * (step + 1) / warmup_steps
    p = min((step - warmup_steps) / max(max_steps - warmup_steps, 1), 1.0)
    return lr_min + (lr_max - lr_min) * 0.5 * (1 + math.cos(math.pi * p))


def clip_solution(grads, max_norm):
    total = torch.sqrt(sum((g**2).sum() for g in grads))
    scale = min(1.0, max_norm / (total.item() + 1e-6))
    return [g * scale for g in grads], total.item()


def adam_l2_solution(param, grad, m, v, t, lr, beta1, beta2, eps, weight_decay):
    g = grad + weight_decay * param  # L2: the decay goes into the gradient
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g**2
    m_hat, v_hat = m / (1 - beta1**t), v / (1 - beta2**t)
    return param - lr * m_hat / (v_hat.sqrt() + eps), m, v


def accumulation_solution(model, x, y, micro):
    model.zero_grad()
    for xs, ys in zip(x.split(micro), y.split(micro)):
        _, loss = model(xs, ys)
        (loss * len(xs) / len(x)).backward()
    return [p.grad for p in model.parameters()]


def stub(*args):
    raise NotImplementedError


def verdict(checker, fn, capsys):
    ok = checker(fn)
    return bool(ok), capsys.readouterr().out


@pytest.mark.parametrize("checker, solution", [(check_lr_schedule, lr_solution), (check_clip_gradients, clip_solution),
                                               (check_adam_l2_step, adam_l2_solution),
                                               (check_accumulated_gradients, accumulation_solution)])
def test_reference_passes_and_stub_is_not_attempted(checker, solution, capsys):
    ok, out = verdict(checker, solution, capsys)
    assert ok and "✅" in out, out
    ok, out = verdict(checker, stub, capsys)
    assert not ok and "not attempted yet" in out


# --- 7.1 ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("wrong, hint", [
    (lambda s, n, w, hi, lo: hi * s / w if s < w else lr_solution(s, n, w, hi, lo), "(step + 1) / warmup_steps"),
    (lambda s, n, w, hi, lo: lr_solution(s, n, w, hi, 0.0) if s >= w else hi * (s + 1) / w, "end at lr_min"),
    (lambda s, n, w, hi, lo: hi * (s + 1) / w if s < w else lo + (hi - lo) * 0.5 * (1 + math.cos(math.pi * min(
        s / n, 1.0))), "from the end of the warm-up"),
    (lambda s, n, w, hi, lo: "0.001", "Return a Python float"),
])
def test_lr_schedule_mistakes_get_their_hint(wrong, hint, capsys):
    ok, out = verdict(check_lr_schedule, wrong, capsys)
    assert not ok and hint in out, out


# --- 7.2 ---------------------------------------------------------------------------------------------------


def test_clip_per_tensor_is_named(capsys):
    def per_tensor(grads, max_norm):
        total = torch.sqrt(sum((g**2).sum() for g in grads)).item()
        return [g * min(1.0, max_norm / (g.norm().item() + 1e-6)) for g in grads], total

    ok, out = verdict(check_clip_gradients, per_tensor, capsys)
    assert not ok and "each tensor on its own" in out, out


def test_clip_that_scales_up_small_gradients_is_named(capsys):
    def always_scale(grads, max_norm):
        total = torch.sqrt(sum((g**2).sum() for g in grads)).item()
        return [g * max_norm / total for g in grads], total

    ok, out = verdict(check_clip_gradients, always_scale, capsys)
    assert not ok and "never above 1" in out, out


def test_clip_cases_cover_three_thresholds_clipped_and_not():
    cases = _ch07._clip_cases()
    seen = {(max_norm, total > max_norm) for _, max_norm, _, total in cases}
    assert seen == {(1.0, True), (1.0, False), (2.5, False), (0.3, True)}
    for grads, max_norm, expected, total in cases:
        got, norm = clip_solution(grads, max_norm)
        assert math.isclose(norm, total, rel_tol=1e-6)
        assert all(torch.allclose(a, b, rtol=1e-6, atol=1e-8) for a, b in zip(got, expected))


@pytest.mark.parametrize("fixed", [1.0, 2.5, 0.3])
def test_clip_that_ignores_max_norm_fails(fixed, capsys):
    ok, out = verdict(check_clip_gradients, lambda grads, max_norm: clip_solution(grads, fixed), capsys)
    assert not ok and "❌" in out, out
    if fixed == 1.0:
        assert "Use the max_norm you are given: this call's is 2.5" in out, out


def test_clip_in_place_is_reported(capsys):
    def in_place(grads, max_norm):
        total = torch.sqrt(sum((g**2).sum() for g in grads)).item()
        for g in grads:
            g.mul_(min(1.0, max_norm / (total + 1e-6)))
        return grads, total

    ok, out = verdict(check_clip_gradients, in_place, capsys)
    assert not ok and "in place" in out, out


# Library shortcuts: each one gives the right numbers (checked against the reference solution outside the checker),
# so only the refusal fails it.

from torch.nn.utils import clip_grad_norm_ as _aliased_clip  # noqa: E402 -- an alias taken before the check


def _as_parameters(grads):
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    return params


def clip_by_alias(grads, max_norm):
    params = _as_parameters(grads)
    total = _aliased_clip(params, max_norm)
    return [p.grad for p in params], total.item()


def clip_by_parameters(grads, max_norm):
    params = _as_parameters(grads)
    total = torch.nn.utils.clip_grad_norm_(params, max_norm)
    return [p.grad for p in params], total.item()


def clip_by_total_norm(grads, max_norm):
    total = torch.nn.utils.get_total_norm(grads).item()
    return [g * min(1.0, max_norm / (total + 1e-6)) for g in grads], total


def clip_with_norm(grads, max_norm):
    params = _as_parameters(grads)
    total = torch.sqrt(sum((g**2).sum() for g in grads))
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return [p.grad for p in params], total.item()


def clip_deprecated(grads, max_norm):
    params = _as_parameters(grads)
    with pytest.warns(FutureWarning):
        total = torch.nn.utils.clip_grad_norm(params, max_norm)
    return [p.grad for p in params], total.item()


def clip_by_the_books_training_code(grads, max_norm):
    from groundup.training import _clip_gradients

    model = torch.nn.ParameterList(_as_parameters(grads))
    total = _clip_gradients(model, max_norm)
    return [p.grad for p in model], total


def clip_and_swallow_the_refusal(grads, max_norm):
    try:
        return clip_by_parameters(grads, max_norm)
    except BaseException:  # noqa: BLE001 -- the dodge tested: the tripwire is caught, the arithmetic done by hand
        return clip_solution(grads, max_norm)


@pytest.mark.parametrize("shortcut, name", [
    (clip_by_alias, "torch.nn.utils.clip_grad_norm_"),
    (clip_by_parameters, "torch.nn.utils.clip_grad_norm_"),
    (clip_by_total_norm, "torch.nn.utils.get_total_norm"),
    (clip_with_norm, "torch.nn.utils.clip_grads_with_norm_"),
    (clip_deprecated, "torch.nn.utils.clip_grad_norm"),
    (clip_by_the_books_training_code, "groundup.training._clip_gradients"),
    (clip_and_swallow_the_refusal, "torch.nn.utils.clip_grad_norm_"),
])
def test_clip_shortcuts_are_refused_by_name(shortcut, name, capsys):
    g = torch.Generator().manual_seed(1)
    grads = [torch.randn(4, 3, generator=g) * 2, torch.randn(5, generator=g)]
    got, want = shortcut(grads, 1.0), clip_solution(grads, 1.0)
    assert math.isclose(got[1], want[1], rel_tol=1e-5)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(got[0], want[0]))  # the numbers are right

    ok, out = verdict(check_clip_gradients, shortcut, capsys)
    assert not ok and f"calls {name}\n" in out, out
    assert "asks you to write the clipping arithmetic yourself" in out and f"{name} does it for you" in out, out
    assert clip_by_parameters(grads, 1.0)[1] == pytest.approx(want[1])  # the tripwires are gone afterwards


def test_clip_value_is_refused(capsys):
    def by_value(grads, max_norm):
        params = _as_parameters(grads)
        torch.nn.utils.clip_grad_value_(params, max_norm)
        return [p.grad for p in params], torch.sqrt(sum((g**2).sum() for g in grads)).item()

    ok, out = verdict(check_clip_gradients, by_value, capsys)
    assert not ok and "calls torch.nn.utils.clip_grad_value_" in out, out


# --- 7.3 ---------------------------------------------------------------------------------------------------

HYPERPARAMETERS = ("lr", "beta1", "beta2", "eps", "weight_decay")
SETS = (dict(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1),
        dict(lr=0.03, beta1=0.8, beta2=0.95, eps=1e-3, weight_decay=0.3))


def test_the_expected_values_are_torch_optim_adams_with_weight_decay():
    """The checker's reference (three steps per set, float64) equals a fresh torch.optim.Adam(weight_decay=λ) run
    here, and the reference solution's own trajectory."""
    cases = _ch07._adam_l2_reference()
    assert [c[0] for c in cases] == list(SETS) and all(c[1].dtype == torch.float64 for c in cases)
    for h, start, grads, expected in cases:
        p = torch.nn.Parameter(start.clone())
        opt = torch.optim.Adam([p], lr=h["lr"], betas=(h["beta1"], h["beta2"]), eps=h["eps"],
                               weight_decay=h["weight_decay"])
        param, m, v = start.clone(), torch.zeros_like(start), torch.zeros_like(start)
        for t, (grad, want) in enumerate(zip(grads, expected), start=1):
            p.grad = grad.clone()
            opt.step()
            state = opt.state[p]
            assert all(torch.equal(a, b) for a, b in zip((p.detach(), state["exp_avg"], state["exp_avg_sq"]), want))
            param, m, v = adam_l2_solution(param, grad, m, v, t, *(h[k] for k in HYPERPARAMETERS))
            assert all(torch.allclose(a, b, rtol=1e-12, atol=1e-15) for a, b in zip((param, m, v), want))


def test_the_diagnostic_tells_every_typical_mistake_apart():
    """On the diagnostic step, the right answer and each typical mistake differ from one another (by far more than
    the tolerance the hints match with), so a hint can name the one mistake made."""
    args, mistakes = _ch07._adam_diagnostic()
    right = adam_l2_solution(*args)
    outputs = [right] + [out for out, _ in mistakes]
    for i, a in enumerate(outputs):
        for b in outputs[i + 1:]:
            assert max((x - y).abs().max().item() for x, y in zip(a, b)) > 1e-4


def _l2_variant(**mistake):
    def wrong(param, grad, m, v, t, lr, beta1, beta2, eps, weight_decay):
        return _ch07._adam_variant(param, grad, m, v, t, lr, beta1, beta2, eps, weight_decay, **mistake)

    return wrong


def adamw_decoupled(param, grad, m, v, t, lr, beta1, beta2, eps, weight_decay):
    """AdamW, the chapter's (7.5), written out."""
    m = beta1 * m + (1 - beta1) * grad
    v = beta2 * v + (1 - beta2) * grad**2
    m_hat, v_hat = m / (1 - beta1**t), v / (1 - beta2**t)
    return param - lr * (m_hat / (v_hat.sqrt() + eps) + weight_decay * param), m, v


def decay_after_the_moments(param, grad, m, v, t, lr, beta1, beta2, eps, weight_decay):
    m = beta1 * m + (1 - beta1) * grad
    v = beta2 * v + (1 - beta2) * grad**2
    m_hat, v_hat = m / (1 - beta1**t), v / (1 - beta2**t)
    return param - lr * (m_hat + weight_decay * param) / (v_hat.sqrt() + eps), m, v


def v_from_the_plain_gradient(param, grad, m, v, t, lr, beta1, beta2, eps, weight_decay):
    m = beta1 * m + (1 - beta1) * (grad + weight_decay * param)
    v = beta2 * v + (1 - beta2) * grad**2
    m_hat, v_hat = m / (1 - beta1**t), v / (1 - beta2**t)
    return param - lr * m_hat / (v_hat.sqrt() + eps), m, v


def no_bias_correction(param, grad, m, v, t, lr, beta1, beta2, eps, weight_decay):
    g = grad + weight_decay * param
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g**2
    return param - lr * m / (v.sqrt() + eps), m, v


def eps_inside_the_root(param, grad, m, v, t, lr, beta1, beta2, eps, weight_decay):
    g = grad + weight_decay * param
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g**2
    m_hat, v_hat = m / (1 - beta1**t), v / (1 - beta2**t)
    return param - lr * m_hat / (v_hat + eps).sqrt(), m, v


def eps_before_the_correction(param, grad, m, v, t, lr, beta1, beta2, eps, weight_decay):
    g = grad + weight_decay * param
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g**2
    m_hat = m / (1 - beta1**t)
    return param - lr * m_hat * math.sqrt(1 - beta2**t) / (v.sqrt() + eps), m, v


def eps_left_out(param, grad, m, v, t, lr, beta1, beta2, eps, weight_decay):
    return adam_l2_solution(param, grad, m, v, t, lr, beta1, beta2, 0.0, weight_decay)


def returns_the_corrected_moments(param, grad, m, v, t, lr, beta1, beta2, eps, weight_decay):
    new, m, v = adam_l2_solution(param, grad, m, v, t, lr, beta1, beta2, eps, weight_decay)
    return new, m / (1 - beta1**t), v / (1 - beta2**t)


def returns_the_corrected_m(param, grad, m, v, t, lr, beta1, beta2, eps, weight_decay):
    new, m, v = adam_l2_solution(param, grad, m, v, t, lr, beta1, beta2, eps, weight_decay)
    return new, m / (1 - beta1**t), v


@pytest.mark.parametrize("wrong, hint", [
    (adamw_decoupled, "That is AdamW: here the decay goes into the gradient."),
    (_l2_variant(decay="decoupled"), "That is AdamW: here the decay goes into the gradient."),
    (decay_after_the_moments, "The decay goes into the gradient before the moments, not after them"),
    (v_from_the_plain_gradient, "Update v with g'² too"),
    (no_bias_correction, "(the bias correction)"),
    (eps_inside_the_root, "only ε is in the wrong place"),
    (eps_before_the_correction, "only ε is in the wrong place"),
    (_l2_variant(eps_at="inside before correction"), "only ε is in the wrong place"),
    (eps_left_out, "only ε is in the wrong place"),
    (returns_the_corrected_moments, "not the bias-corrected m̂ and v̂"),
    (returns_the_corrected_m, "not the bias-corrected m̂ and v̂"),
])
def test_adam_l2_mistakes_get_their_hint(wrong, hint, capsys):
    ok, out = verdict(check_adam_l2_step, wrong, capsys)
    assert not ok and hint in out, out
    others = {h for _, h in _ch07._ADAM_MISTAKES} - {h for h in {h for _, h in _ch07._ADAM_MISTAKES} if hint in h}
    assert not any(h in out for h in others), out  # one hint, the right one


@pytest.mark.parametrize("wrong", [eps_inside_the_root, eps_before_the_correction, eps_left_out])
def test_an_eps_mistake_is_never_called_a_missing_bias_correction(wrong, capsys):
    """At t = 1 with betas (0.9, 0.99) the uncorrected update differs from the right one by ε-sized amounts only,
    as ε mistakes do: the hint comes from the diagnostic step (t = 3), where they differ by far more."""
    ok, out = verdict(check_adam_l2_step, wrong, capsys)
    assert not ok and "Divide m by" not in out and "only ε is in the wrong place" in out, out


def test_a_mixture_of_mistakes_gets_the_update_spelled_out(capsys):
    def two_mistakes(param, grad, m, v, t, lr, beta1, beta2, eps, weight_decay):
        return no_bias_correction(param, grad, m, v, t, lr, beta1, beta2, 0.0, weight_decay)

    ok, out = verdict(check_adam_l2_step, two_mistakes, capsys)
    assert not ok and "With g' = g + λ param: m ← β1 m + (1 − β1) g'" in out, out


@pytest.mark.parametrize("fixed_set", [0, 1])
@pytest.mark.parametrize("name", ["lr", "beta1", "beta2", "eps", "weight_decay", "t"])
def test_an_argument_fixed_to_a_number_fails(name, fixed_set, capsys):
    """An answer that ignores one argument and uses the value of one set (or t = 1) fails on the other set."""
    def fixed(param, grad, m, v, t, lr, beta1, beta2, eps, weight_decay):
        given = dict(t=t, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay)
        given[name] = 1 + fixed_set if name == "t" else SETS[fixed_set][name]
        return adam_l2_solution(param, grad, m, v, **given)

    ok, out = verdict(check_adam_l2_step, fixed, capsys)
    assert not ok and "❌" in out, out


def test_adam_l2_in_place_is_reported(capsys):
    def in_place(param, grad, m, v, t, lr, beta1, beta2, eps, weight_decay):
        new, m2, v2 = adam_l2_solution(param, grad, m, v, t, lr, beta1, beta2, eps, weight_decay)
        param.copy_(new)
        return param, m2, v2

    ok, out = verdict(check_adam_l2_step, in_place, capsys)
    assert not ok and "changed its input param in place" in out, out

    def moments_in_place(param, grad, m, v, t, lr, beta1, beta2, eps, weight_decay):
        g = grad + weight_decay * param
        m.mul_(beta1).add_((1 - beta1) * g)
        v.mul_(beta2).add_((1 - beta2) * g**2)
        new = param - lr * (m / (1 - beta1**t)) / ((v / (1 - beta2**t)).sqrt() + eps)
        return new, m, v

    ok, out = verdict(check_adam_l2_step, moments_in_place, capsys)
    assert not ok and "changed its input m in place" in out, out


def test_adam_l2_wrong_return_type(capsys):
    ok, out = verdict(check_adam_l2_step, lambda *a: None, capsys)
    assert not ok and "returned a NoneType" in out and "triple" in out


@pytest.mark.parametrize("change, message", [
    (lambda x: torch.nn.Parameter(x), "the new param is a Parameter, expected a plain torch.Tensor"),
    (lambda x: x.float(), "the new param has dtype torch.float32, expected torch.float64"),
    (lambda x: x.reshape(-1), "the new param has shape (24,), expected (6, 4)"),
])
def test_adam_l2_answers_must_be_plain_tensors_of_the_inputs_dtype_and_shape(change, message, capsys):
    def changed(*args):
        new, m, v = adam_l2_solution(*args)
        return change(new), m, v

    ok, out = verdict(check_adam_l2_step, changed, capsys)
    assert not ok and message in out, out


# Library shortcuts for 7.3: each gives the right numbers (checked against the reference solution outside the
# checker), so only the refusal fails it.

from torch.optim import Adam as _AliasedAdam  # noqa: E402 -- an alias taken before the check


def _stepped(opt, p, grad, m, v, t):
    """``opt`` (over the one parameter ``p``) stepped from the state (m, v, t - 1) the reader was given."""
    opt.state[p] = {"step": torch.tensor(float(t - 1)), "exp_avg": m.clone(), "exp_avg_sq": v.clone()}
    p.grad = grad.clone()
    opt.step()
    state = opt.state[p]
    return p.detach().clone(), state["exp_avg"].clone(), state["exp_avg_sq"].clone()


def adam_by_injected_state(param, grad, m, v, t, lr, beta1, beta2, eps, weight_decay):
    p = torch.nn.Parameter(param.clone())
    opt = _AliasedAdam([p], lr=lr, betas=(beta1, beta2), eps=eps, weight_decay=weight_decay)
    return _stepped(opt, p, grad, m, v, t)


def adamw_with_the_decay_in_the_gradient(param, grad, m, v, t, lr, beta1, beta2, eps, weight_decay):
    p = torch.nn.Parameter(param.clone())
    opt = torch.optim.AdamW([p], lr=lr, betas=(beta1, beta2), eps=eps, weight_decay=0.0)
    return _stepped(opt, p, grad + weight_decay * param, m, v, t)


def adam_functional(param, grad, m, v, t, lr, beta1, beta2, eps, weight_decay):
    from torch.optim.adam import adam

    p, m, v = param.clone(), m.clone(), v.clone()
    adam([p], [grad], [m], [v], [], [torch.tensor(float(t - 1))], amsgrad=False, beta1=beta1, beta2=beta2, lr=lr,
         weight_decay=weight_decay, eps=eps, maximize=False)
    return p, m, v


def adam_functional_module(param, grad, m, v, t, lr, beta1, beta2, eps, weight_decay):
    import torch.optim._functional as functional

    p, m, v = param.clone(), m.clone(), v.clone()
    functional.adam([p], [grad], [m], [v], [], [torch.tensor(float(t - 1))], amsgrad=False, beta1=beta1,
                    beta2=beta2, lr=lr, weight_decay=weight_decay, eps=eps, maximize=False)
    return p, m, v


def adam_private_functional(param, grad, m, v, t, lr, beta1, beta2, eps, weight_decay):
    from torch.optim.adam import _single_tensor_adam

    p, m, v = param.clone(), m.clone(), v.clone()
    _single_tensor_adam([p], [grad], [m], [v], [], [torch.tensor(float(t - 1))], grad_scale=None, found_inf=None,
                        amsgrad=False, has_complex=False, beta1=beta1, beta2=beta2, lr=lr, weight_decay=weight_decay,
                        eps=eps, maximize=False, capturable=False, differentiable=False,
                        decoupled_weight_decay=False)
    return p, m, v


_fused = torch._fused_adam_  # a builtin, aliased before the check


def adam_fused_kernel(param, grad, m, v, t, lr, beta1, beta2, eps, weight_decay):
    p, m, v = param.clone(), m.clone(), v.clone()
    _fused([p], [grad], [m], [v], [], [torch.tensor(float(t))], lr=lr, beta1=beta1, beta2=beta2,
           weight_decay=weight_decay, eps=eps, amsgrad=False, maximize=False)
    return p, m, v


def _functional_adam(cls_name, param, grad, m, v, t, lr, beta1, beta2, eps, weight_decay):
    """torch.distributed.optim's TorchScript optimizer (built in Python, as a reader would), stepped from the
    state it was given; _FunctionalAdamW with the decay added to the gradient by hand."""
    module = __import__(f"torch.distributed.optim.functional_{cls_name.lower()[11:]}", fromlist=[cls_name])
    p = param.clone()  # (the class warns that TorchScript optimizers are deprecated, however warnings are filtered)
    opt = getattr(module, cls_name)([p], lr=lr, betas=(beta1, beta2), eps=eps,
                                    weight_decay=weight_decay if cls_name == "_FunctionalAdam" else 0.0)
    opt.state[p] = {"step": torch.tensor(float(t - 1)), "exp_avg": m.clone(), "exp_avg_sq": v.clone()}
    opt.step_param(p, grad if cls_name == "_FunctionalAdam" else grad + weight_decay * param)
    return p, opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"]


def functional_adam_scripted(*args):
    return _functional_adam("_FunctionalAdam", *args)


def functional_adamw_scripted(*args):
    return _functional_adam("_FunctionalAdamW", *args)


import torch.optim._functional as _optim_functional  # noqa: E402 -- for the TorchScript function below


def _adam_in_torchscript(p: torch.Tensor, grad: torch.Tensor, m: torch.Tensor, v: torch.Tensor, step: torch.Tensor,
                         lr: float, beta1: float, beta2: float, eps: float, weight_decay: float):
    _optim_functional.adam([p], [grad], [m], [v], [], [step], amsgrad=False, beta1=beta1, beta2=beta2, lr=lr,
                           weight_decay=weight_decay, eps=eps, maximize=False)


def adam_compiled_with_torchscript(param, grad, m, v, t, lr, beta1, beta2, eps, weight_decay):
    """The reader's own function, compiled: its graph would call a compiled torch.optim.adam.adam, out of the
    tripwires' sight, once something compiled that before the check (torch.distributed.optim does)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        scripted = torch.jit.script(_adam_in_torchscript)
    p, m, v = param.clone(), m.clone(), v.clone()
    scripted(p, grad, m, v, torch.tensor(float(t - 1)), lr, beta1, beta2, eps, weight_decay)
    return p, m, v


_PREBUILT = {}


def adam_prebuilt(param, grad, m, v, t, lr, beta1, beta2, eps, weight_decay):
    """An optimizer built before the check (at the first call outside it), its parameter refilled and stepped."""
    if "opt" not in _PREBUILT:
        p = torch.nn.Parameter(torch.zeros_like(param))
        _PREBUILT.update(p=p, opt=torch.optim.Adam([p], lr=lr, betas=(beta1, beta2), eps=eps,
                                                   weight_decay=weight_decay))
    p, opt = _PREBUILT["p"], _PREBUILT["opt"]
    for group in opt.param_groups:
        group.update(lr=lr, betas=(beta1, beta2), eps=eps, weight_decay=weight_decay)
    p.data = param.clone()
    return _stepped(opt, p, grad, m, v, t)


def adam_by_the_books_training_code(param, grad, m, v, t, lr, beta1, beta2, eps, weight_decay):
    from groundup.training import TrainConfig, _make_optimizer

    model = torch.nn.ParameterList([torch.nn.Parameter(param.clone())])
    config = TrainConfig(learning_rate=lr, beta1=beta1, beta2=beta2, weight_decay=0.0)
    opt = _make_optimizer(model, config, torch.device("cpu"))
    opt.param_groups[0]["eps"] = eps
    return _stepped(opt, model[0], grad + weight_decay * param, m, v, t)


def adam_by_the_books_muon(param, grad, m, v, t, lr, beta1, beta2, eps, weight_decay):
    from groundup.training import MuonAdamW

    MuonAdamW(torch.nn.Linear(2, 3), lr=lr, betas=(beta1, beta2), weight_decay=weight_decay)  # built, not used
    return adam_l2_solution(param, grad, m, v, t, lr, beta1, beta2, eps, weight_decay)


def adam_and_swallow_the_refusal(param, grad, m, v, t, lr, beta1, beta2, eps, weight_decay):
    try:
        return adam_by_injected_state(param, grad, m, v, t, lr, beta1, beta2, eps, weight_decay)
    except BaseException:  # noqa: BLE001 -- the dodge tested: the tripwire is caught, the arithmetic done by hand
        return adam_l2_solution(param, grad, m, v, t, lr, beta1, beta2, eps, weight_decay)


@pytest.mark.parametrize("shortcut, name", [
    (adam_by_injected_state, "torch.optim.Adam"),
    (adamw_with_the_decay_in_the_gradient, "torch.optim.AdamW"),
    (adam_functional, "torch.optim.adam.adam"),
    (adam_functional_module, "torch.optim.adam.adam"),
    (adam_private_functional, "torch.optim.adam._single_tensor_adam"),
    (adam_fused_kernel, "torch._fused_adam_"),
    (functional_adam_scripted, "torch.distributed.optim.functional_adam._FunctionalAdam"),
    (functional_adamw_scripted, "torch.distributed.optim.functional_adamw._FunctionalAdamW"),
    (adam_compiled_with_torchscript, "torch.jit.script"),
    (adam_prebuilt, "torch.optim.Adam.step"),
    (adam_by_the_books_training_code, "groundup.training._make_optimizer"),
    (adam_and_swallow_the_refusal, "torch.optim.Adam"),
])
def test_adam_l2_shortcuts_are_refused_by_name(shortcut, name, capsys):
    g = torch.Generator().manual_seed(5)
    param, m, v = (torch.randn(3, 2, generator=g, dtype=torch.float64) for _ in range(3))
    v, grad = v.abs(), torch.randn(3, 2, generator=g, dtype=torch.float64)
    args = (param, grad, m, v, 2, 0.03, 0.8, 0.95, 1e-3, 0.3)
    for got, want in zip(shortcut(*args), adam_l2_solution(*args)):
        assert torch.allclose(got, want, rtol=1e-9, atol=1e-12)  # the numbers are right

    ok, out = verdict(check_adam_l2_step, shortcut, capsys)
    assert not ok and f"calls {name}\n" in out, out
    if name == "torch.jit.script":
        assert "torch.jit.script compiles code with TorchScript" in out, out
    else:
        assert "the arithmetic of Adam with L2 regularisation yourself" in out, out
        assert f"{name} does the update for you" in out, out
    for got, want in zip(adam_by_injected_state(*args), adam_l2_solution(*args)):  # the tripwires are gone afterwards
        assert torch.allclose(got, want, rtol=1e-9, atol=1e-12)


def test_the_books_muon_is_refused(capsys):
    ok, out = verdict(check_adam_l2_step, adam_by_the_books_muon, capsys)
    assert not ok and "calls groundup.training.MuonAdamW\n" in out, out


@pytest.mark.parametrize("optimizer", ["SGD", "RMSprop", "NAdam", "Adagrad"])
def test_every_torch_optimizer_is_refused(optimizer, capsys):
    def other_optimizer(param, grad, m, v, t, lr, beta1, beta2, eps, weight_decay):
        p = torch.nn.Parameter(param.clone())
        getattr(torch.optim, optimizer)([p], lr=lr).step()
        return adam_l2_solution(param, grad, m, v, t, lr, beta1, beta2, eps, weight_decay)

    ok, out = verdict(check_adam_l2_step, other_optimizer, capsys)
    assert not ok and f"calls torch.optim.{optimizer}\n" in out, out


def test_torchscripts_functional_optimizer_is_named_in_a_fresh_interpreter():
    """Where nothing imported torch.distributed.optim before the check, the reader's import of _FunctionalAdam
    would compile PyTorch's optimizers with TorchScript while their code is a tripwire (a NotSupportedError that
    names nothing): the checker imports it first, and names the class."""
    import subprocess
    import sys

    code = ("import sys, torch\n"
            "from groundup.exercises.ch07 import check_adam_l2_step\n"
            "assert 'torch.distributed.optim' not in sys.modules\n"
            "def fn(param, grad, m, v, t, lr, beta1, beta2, eps, weight_decay):\n"
            "    from torch.distributed.optim.functional_adam import _FunctionalAdam\n"
            "    p = param.clone()\n"
            "    opt = _FunctionalAdam([p], lr=lr, betas=(beta1, beta2), eps=eps, weight_decay=weight_decay)\n"
            "    opt.step_param(p, grad)\n"
            "    return p, opt.state[p]['exp_avg'], opt.state[p]['exp_avg_sq']\n"
            "check_adam_l2_step(fn)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    flat = " ".join(out.stdout.split())
    assert out.returncode == 0, out.stderr
    assert "calls torch.distributed.optim.functional_adam._FunctionalAdam " in flat, flat
    assert "NotSupportedError" not in flat, flat


@pytest.fixture(autouse=True)
def _unwrapped_verdicts(monkeypatch):
    """Match hints as whole lines; tests/test_checking.py tests the wrapping to the book's width."""
    monkeypatch.setattr(_checking, "MESSAGE_WIDTH", 10_000)


def test_calling_the_packages_schedule_is_refused(capsys):
    from groundup.training import TrainConfig, lr_at

    def calls_lr_at(step, max_steps, warmup_steps, lr_max, lr_min):
        config = TrainConfig(max_steps=max_steps, warmup_steps=warmup_steps, learning_rate=lr_max, min_lr=lr_min)
        return lr_at(step, config)

    assert not check_lr_schedule(calls_lr_at)
    out = capsys.readouterr().out
    assert "calls groundup.training.lr_at" in out and "compute it yourself" in out, out


def test_the_schedule_checker_cites_the_chapters_number_for_the_schedule():
    """Chapter 7 numbers its display equations with \\tag; the warm-up + cosine schedule is the one with a cosine,
    and check_lr_schedule must cite that number and no other."""
    notebook = Path(__file__).resolve().parents[1] / "notebooks" / "07_training.ipynb"
    cells = json.loads(notebook.read_text(encoding="utf-8"))["cells"]
    displays = [eq for c in cells if c["cell_type"] == "markdown" for eq in "".join(c["source"]).split("$$")[1::2]]
    numbered = {tag: eq for eq in displays for tag in re.findall(r"\\tag\{(7\.\d+)\}", eq)}
    schedule = [tag for tag, eq in numbered.items() if r"\cos" in eq]
    assert len(numbered) >= 7 and len(schedule) == 1, numbered.keys()
    assert re.findall(r"\((7\.\d+)\)", check_lr_schedule.__doc__) == schedule


# --- 7.7 ---------------------------------------------------------------------------------------------------


def _accumulate(model, x, y, micro, *, weight, zero_first=True, zero_each=False):
    if zero_first:
        model.zero_grad()
    chunks = list(zip(x.split(micro), y.split(micro)))
    for xs, ys in chunks:
        if zero_each:
            model.zero_grad()
        (model(xs, ys)[1] * weight(xs, x, len(chunks))).backward()
    return [p.grad for p in model.parameters()]


def _share(xs, x, k):
    return len(xs) / len(x)


@pytest.mark.parametrize("wrong, hint", [
    (lambda m, x, y, c: _accumulate(m, x, y, c, weight=lambda xs, x, k: 1 / k), "not 1 / k"),
    (lambda m, x, y, c: _accumulate(m, x, y, c, weight=lambda xs, x, k: 1.0), "about k times the gradient"),
    (lambda m, x, y, c: _accumulate(m, x, y, c, weight=_share, zero_each=True), "not before each"),
    (lambda m, x, y, c: _accumulate(m, x, y, c, weight=_share, zero_first=False), "earlier step's gradients"),
    (lambda m, x, y, c: [p.grad for p in m.parameters()], "saw 0 of the 10 windows"),  # the stale ones, unchanged
])
def test_accumulation_wrong_answers_get_their_hint(wrong, hint, capsys):
    ok, out = verdict(check_accumulated_gradients, wrong, capsys)
    assert not ok and hint in " ".join(out.split()), out


def test_accumulation_refuses_the_whole_batch_at_once_and_a_model_bypassed(capsys):
    def whole(model, x, y, micro):
        model.zero_grad()
        model(x, y)[1].backward()
        return [p.grad for p in model.parameters()]

    ok, out = verdict(check_accumulated_gradients, whole, capsys)
    assert not ok and "was given 10 windows at once; this model takes at most 4" in " ".join(out.split()), out

    def bypass(model, x, y, micro):
        from groundup.models import GPT

        model.zero_grad()
        GPT.forward(model, x, y)[1].backward()  # the whole batch, around the model's own forward
        return [p.grad for p in model.parameters()]

    ok, out = verdict(check_accumulated_gradients, bypass, capsys)
    assert not ok and "saw 0 of the 10 windows" in " ".join(out.split()), out


def test_accumulation_refuses_one_backward_over_all_micro_batches(capsys):
    """Every micro-batch through model(...), the logits concatenated, one backward: the right gradient, but all k
    graphs are kept until the end, so nothing is saved; the checker counts the backward passes."""
    import torch.nn.functional as F

    def one_backward(model, x, y, micro):
        model.zero_grad()
        logits = torch.cat([model(xs)[0] for xs in x.split(micro)])
        F.cross_entropy(logits.flatten(0, 1), y.flatten()).backward()
        return [p.grad for p in model.parameters()]

    ok, out = verdict(check_accumulated_gradients, one_backward, capsys)
    flat = " ".join(out.split())
    assert not ok and "3 forward passes with gradients enabled but 1 backward passes" in flat, out
    assert "Call backward once per micro-batch" in flat, out


@pytest.mark.parametrize("dummy_grad", [False, True])
def test_accumulation_refuses_dummy_calls_beside_a_bypassed_whole_batch(dummy_grad, capsys):
    """The whole batch through GPT.forward (around the model's own forward), plus calls model(xs) that only meet the
    window count: under no_grad they do not count; with gradients they leave the backward passes short."""
    from groundup.models import GPT

    def dummies(model, x, y, micro):
        model.zero_grad()
        with torch.set_grad_enabled(dummy_grad):
            for xs, ys in zip(x.split(micro), y.split(micro)):
                model(xs, ys)
        GPT.forward(model, x, y)[1].backward()
        return [p.grad for p in model.parameters()]

    ok, out = verdict(check_accumulated_gradients, dummies, capsys)
    flat = " ".join(out.split())
    want = "3 forward passes with gradients enabled but 1 backward passes" if dummy_grad else "saw 0 of the 10"
    assert not ok and want in flat, out


def test_accumulation_generic_hint_does_not_give_the_answer(capsys):
    ok, out = verdict(check_accumulated_gradients,
                      lambda m, x, y, c: _accumulate(m, x, y, c, weight=lambda xs, x, k: 0.5), capsys)
    flat = " ".join(out.split())
    assert not ok and "what share of that mean is one micro-batch's mean loss?" in flat, out
    assert "len(xs) / len(x)" not in flat, out


@pytest.mark.parametrize("package_call", ["train", "_split_step"])
def test_accumulation_refuses_the_packages_own_accumulation(package_call, capsys):
    import groundup.training as training

    def calls_package(model, x, y, micro):
        if package_call == "train":
            training.train(model, x.flatten(), x.flatten(), training.TrainConfig(max_steps=1, batch_size=2,
                                                                                 progress=False))
        else:
            opt = torch.optim.SGD(model.parameters(), lr=0.0)
            training._split_step(model, (x,), y, "cpu", opt, 0, 1, 2, None)
        return [p.grad for p in model.parameters()]

    ok, out = verdict(check_accumulated_gradients, calls_package, capsys)
    assert not ok and f"calls groundup.training.{package_call}" in out, out


def test_accumulation_wrong_shapes_and_counts_are_named(capsys):
    ok, out = verdict(check_accumulated_gradients, lambda m, x, y, c: accumulation_solution(m, x, y, c)[:-1], capsys)
    assert not ok and "gradients, expected a list of" in out, out
    ok, out = verdict(check_accumulated_gradients,
                      lambda m, x, y, c: [g.reshape(-1) for g in accumulation_solution(m, x, y, c)], capsys)
    assert not ok and "has shape" in out, out
