"""Checkers for chapter 7 (training): the warm-up + cosine schedule, gradient clipping, one step of Adam with L2
regularisation, gradient accumulation.

Every checker computes the expected values before it calls the reader's function, hands the function copies of
its inputs (and says so if the function changed them in place), and checks the type of what comes back. The
checkers of 7.2 and 7.3 refuse an answer that hands the work to PyTorch (its clipping functions, any of its
optimizers) or to the book's training code, however the function is reached.
"""

from __future__ import annotations

import contextlib
import importlib
import math
import re
import sys
import types
import warnings
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from groundup import training
from groundup.exercises import sandbox
from groundup.exercises.checking import (
    Forbidden,
    Mismatch,
    Shortcuts,
    Verdict,
    call_reader,
    call_refusing,
    collect_shortcuts,
    expect,
    expect_close,
    expect_number,
    expect_tensor,
    function_code,
    package_functions,
    run_checks,
)
from groundup.models import GPT, GPTConfig
from groundup.training import TrainConfig, _split_step, lr_at, train

__all__ = ["check_lr_schedule", "check_clip_gradients", "check_adam_l2_step", "check_accumulated_gradients"]


def _float(value, call: str) -> float:
    return expect_number(value, call, "Return a Python float (a number).")


# ---- Exercise 7.1 ------------------------------------------------------------------------------------------

_SCHEDULES = [dict(max_steps=100, warmup_steps=10, learning_rate=1e-3, min_lr=1e-4),
              dict(max_steps=50, warmup_steps=0, learning_rate=0.5, min_lr=0.0),
              dict(max_steps=2000, warmup_steps=100, learning_rate=2e-3, min_lr=2e-4)]


def _schedule_hint(fn, c: dict) -> str:
    warm, peak, low, total = c["warmup_steps"], c["learning_rate"], c["min_lr"], c["max_steps"]

    def cosine(p):
        return low + (peak - low) * 0.5 * (1 + math.cos(math.pi * min(max(p, 0.0), 1.0)))

    candidates = {
        "During warm-up use (step + 1) / warmup_steps, so that step 0 already has a small positive rate and step "
        "warmup_steps - 1 reaches the peak.": lambda s: peak * s / warm if s < warm else cosine((s - warm) /
                                                                                                  (total - warm)),
        "Measure the cosine's progress from the end of the warm-up: p = (step - warmup_steps) / (max_steps - "
        "warmup_steps).": lambda s: peak * (s + 1) / warm if s < warm else cosine(s / total),
        "The cosine should end at lr_min, not at 0: lr_min + (lr_max - lr_min) (1 + cos(π p)) / 2.":
            lambda s: peak * (s + 1) / warm if s < warm else peak * 0.5 * (1 + math.cos(math.pi * (s - warm) /
                                                                                          (total - warm))),
        "Remember the factor 1/2: (1 + cos(π p)) / 2 runs from 1 to 0.":
            lambda s: peak * (s + 1) / warm if s < warm else low + (peak - low) * (1 + math.cos(
                math.pi * (s - warm) / (total - warm))),
    }
    steps = [s for s in (0, 1, warm // 2, warm, (warm + total) // 2, total - 1, total) if s >= 0]
    for hint, wrong in candidates.items():
        if warm == 0 and "warm-up" in hint:
            continue
        try:
            if all(math.isclose(_float(call_reader(fn, s, total, warm, peak, low, call="my_lr"), "my_lr"), wrong(s),
                                rel_tol=1e-6, abs_tol=1e-12) for s in steps):
                return hint
        except Exception:  # noqa: BLE001 -- hint search only; the main check reports the crash
            return ""
    return ""


def check_lr_schedule(fn: Callable) -> Verdict:
    """Exercise 7.1: ``fn(step, max_steps, warmup_steps, lr_max, lr_min)`` is equation (7.6)'s learning rate."""

    def checks():
        for c in _SCHEDULES:
            config = TrainConfig(**c)
            steps = sorted({0, 1, c["warmup_steps"], c["max_steps"] // 3, c["max_steps"] - 1, c["max_steps"],
                            max(c["warmup_steps"] - 1, 0), c["max_steps"] + 5})
            expected = {s: lr_at(s, config) for s in steps}
            for s in steps:
                call = f"my_lr({s}, {c['max_steps']}, {c['warmup_steps']}, {c['learning_rate']}, {c['min_lr']})"
                got = _float(call_reader(fn, s, c["max_steps"], c["warmup_steps"], c["learning_rate"], c["min_lr"],
                                         call=call, forbid=(lr_at,)), call)
                if not math.isclose(got, expected[s], rel_tol=1e-6, abs_tol=1e-12):
                    hint = _schedule_hint(fn, c) or ("Warm up linearly with (step + 1) / warmup_steps, then follow "
                                                     "lr_min + (lr_max - lr_min) (1 + cos(π p)) / 2 with p running "
                                                     "from 0 to 1 over the remaining steps (and staying at 1 after).")
                    raise Mismatch(f"{call} returned {got:.6g}, expected {expected[s]:.6g}", hint)

    return run_checks("Exercise 7.1 (warm-up + cosine schedule)", checks,
                      "It matches groundup.training.lr_at on three schedules.")


# ---- library shortcuts (Exercises 7.2 and 7.3) -------------------------------------------------------------
#
# Both exercises ask for arithmetic that PyTorch (and the book's training code) already does: an answer that
# hands the gradients to clip_grad_norm_, or the tensors to an optimizer, passes the comparison without showing
# anything. Such calls are caught while the reader's function runs, by the tripwires of ``call_refusing`` (in
# groundup.exercises.checking): the *code* of each plain Python function is swapped (so an alias taken before the
# check, `from torch.nn.utils import clip_grad_norm_ as c`, is caught too), the optimizer classes' ``__init__`` and
# ``step`` are swapped on the class (an optimizer built inside the function, or one built before and stepped), and
# a dispatch mode sees the fused kernels however they are reached (``torch._fused_adam_``,
# ``torch.ops.aten._fused_adam_``, an alias). The checker's own reference values are computed before, with none of
# this in place.
#
# TorchScript needs care: ``torch.distributed.optim`` compiles its functional optimizers (``_FunctionalAdam``, ...)
# with ``torch.jit.script`` when it is imported, and compiling a function whose code is a tripwire fails with a
# NotSupportedError that names nothing. So the checker imports that module first, with no tripwire in place, and
# then refuses those classes by name; and it refuses ``torch.jit.script`` itself, which would otherwise compile the
# reader's code into a graph that calls an optimizer compiled before the check, out of the tripwires' sight.


_CLIP_FUNCTIONS = ("clip_grad_norm_", "clip_grad_norm", "clip_grads_with_norm_", "get_total_norm",
                   "clip_grad_value_")
_CLIP_HINT = ("Exercise 7.2 asks you to write the clipping arithmetic yourself, and {name} does it for you, so "
              "the answer cannot use it. Add up g² over all the gradients, take the square root, and multiply every "
              "gradient by min(1, max_norm / (total_norm + 1e-6)), with torch operations.")


def _clip_shortcuts() -> Shortcuts:
    """PyTorch's clipping functions (those this torch has) and the book's training code that clips."""
    entries = []
    for name in _CLIP_FUNCTIONS:
        fn = getattr(torch.nn.utils, name, None)
        if fn is None:
            continue
        inner, shown = function_code(fn), f"torch.nn.utils.{name}"
        entries.append((inner, shown) if inner is not None else (Forbidden(torch.nn.utils, name, label=shown), shown))
    entries += package_functions(training._clip_gradients, training.train, training._split_step)
    return collect_shortcuts(entries, _CLIP_HINT)


_OPTIMIZER_HINT = ("Exercise 7.3 asks you to write the arithmetic of Adam with L2 regularisation yourself, and "
                   "{name} does the update for you, so the answer cannot use it. Add λ param to the gradient, update "
                   "m and v with the result, correct their bias, and compute the new parameter with torch operations "
                   "on the tensors you are given.")
_SCRIPT_HINT = ("Exercise 7.3 asks for plain torch operations, run as Python: {name} compiles code with TorchScript, "
                "which could run one of PyTorch's compiled optimizers out of the checker's sight, so the answer "
                "cannot use it. Write the update with torch operations on the tensors you are given.")
_FUSED_KERNEL = re.compile(r"_fused_(adam|adamw|sgd|adagrad)_?")
_SCRIPTED_OPTIMIZERS = "torch.distributed.optim"  # compiles its _Functional* optimizers with TorchScript on import


def _import_scripted_optimizers() -> None:
    """Import ``torch.distributed.optim`` (when this torch has it) while no tripwire is set, so that its
    TorchScript classes are compiled from PyTorch's own code, never from a tripwire (see the comment above)."""
    if _SCRIPTED_OPTIMIZERS in sys.modules:
        return
    with warnings.catch_warnings(), contextlib.suppress(Exception):
        warnings.simplefilter("ignore")  # torch.jit.script is deprecated, and says so once per class compiled
        if torch.distributed.is_available():
            importlib.import_module(_SCRIPTED_OPTIMIZERS)


def _optimizer_classes() -> list[type]:
    """torch.optim.Optimizer and every subclass that torch or the book defines, parents before children."""
    found, todo = [], [torch.optim.Optimizer]
    while todo:
        cls = todo.pop(0)
        if cls not in found and cls.__module__.split(".")[0] in ("torch", "groundup"):
            found.append(cls)
            todo += cls.__subclasses__()
    return found


def _class_name(cls: type) -> str:
    public = cls.__module__.startswith("torch.optim") and getattr(torch.optim, cls.__name__, None) is cls
    return f"torch.optim.{cls.__name__}" if public else f"{cls.__module__}.{cls.__qualname__}"


def _functional_optimizer_classes() -> list[type]:
    """The functional optimizers of ``torch.distributed.optim`` (``_FunctionalAdam``, ``_FunctionalAdamW``, ...),
    which are no subclasses of torch.optim.Optimizer: those of the modules imported so far."""
    found = []
    for module_name, module in sorted(dict(sys.modules).items()):  # a copy: another thread may import
        if module is None or not module_name.startswith(_SCRIPTED_OPTIMIZERS + ".functional_"):
            continue
        found += [cls for name, cls in sorted(vars(module).items())
                  if isinstance(cls, type) and name.startswith("_Functional") and cls.__module__ == module_name]
    return found


def _optimizer_shortcuts() -> Shortcuts:
    """Every optimizer of torch (and the book's MuonAdamW): building one, its ``step`` (on the class, and the code
    under its decorators), the functional forms (``torch.optim._functional``, ``torch.optim.adam.adam``,
    ``_single_tensor_adam``, ``_multi_tensor_adam``, ``_fused_adam`` ...), the TorchScript functional optimizers
    of ``torch.distributed.optim`` (``_FunctionalAdam`` ...), ``torch.jit.script``, and the book's code that builds
    or steps one. Computed when a check starts: PyTorch hooks ``step`` onto a class the first time it is built."""
    entries = []
    for cls in _optimizer_classes():
        name = _class_name(cls)
        if "__init__" in vars(cls) and cls is not torch.optim.Optimizer:
            entries.append((Forbidden(cls, "__init__", label=name), name))
        if "step" in vars(cls):
            if cls is not torch.optim.Optimizer:
                entries.append((Forbidden(cls, "step", label=f"{name}.step"), f"{name}.step"))
            inner = function_code(vars(cls)["step"])
            if inner is not None:
                entries.append((inner, f"{_class_name(_owner(inner, cls))}.step"))
    for cls in _functional_optimizer_classes():
        name = f"{cls.__module__}.{cls.__qualname__}"
        entries.append((Forbidden(cls, "__init__", label=name), name))
        for method in ("step", "step_param"):
            inner = function_code(vars(cls).get(method))
            if inner is not None:
                entries.append((inner, f"{name}.{method}"))
    functional = vars(sys.modules.get("torch.optim._functional") or types.ModuleType("none"))
    public = {n for n, f in functional.items() if isinstance(f, types.FunctionType) and not n.startswith("_")}
    for module_name, module in sorted(dict(sys.modules).items()):  # a copy: another thread may import
        if module is None or not module_name.startswith("torch.optim."):
            continue
        for name, fn in sorted(vars(module).items()):
            if isinstance(fn, types.FunctionType) and fn.__module__ == module_name and (
                    name in public or name.startswith(("_single_tensor_", "_multi_tensor_", "_fused_"))):
                inner = function_code(fn)
                if inner is not None:
                    entries.append((inner, sandbox._label(inner)))
    script = function_code(torch.jit.script)
    if script is not None:
        entries.append((script, "torch.jit.script", _SCRIPT_HINT))
    entries += package_functions(training._make_optimizer, training._update, training.train, training._split_step)
    return collect_shortcuts(entries, _OPTIMIZER_HINT)


def _owner(fn: types.FunctionType, cls: type) -> type:
    """The class in ``cls``'s MRO that defines ``fn`` (AdamW's step is Adam's)."""
    for klass in cls.__mro__:
        if function_code(vars(klass).get("step")) is fn:
            return klass
    return cls


class _FusedKernelWatch(TorchDispatchMode):
    """Sees every operator the reader's code runs, however it was reached, and refuses the optimizers' fused
    kernels (``torch._fused_adam_`` and its kin), which are builtins: no code to swap, and an alias of one taken
    before the check is not an attribute the tripwires could replace."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if _FUSED_KERNEL.fullmatch(name):
            sandbox._trip(f"torch.{name}")  # recorded even if the reader's code catches it
        return func(*args, **(kwargs or {}))


def _watched(fn: Callable) -> Callable:
    """``fn`` run under :class:`_FusedKernelWatch` (a dispatch mode is per thread: entered in the reader's
    worker)."""

    def my_adam_l2_step(*args):
        with _FusedKernelWatch():
            return fn(*args)

    return my_adam_l2_step


# ---- Exercise 7.2 ------------------------------------------------------------------------------------------

# (max_norm, the gradients' total norm): clipped and not, at three thresholds. At 2.5 and 0.3 an answer that
# uses a threshold of 1 instead of max_norm clips what it must not clip, and leaves what it must clip.
_CLIP_CASES = ((1.0, 3.0), (1.0, 0.02), (2.5, 1.8), (0.3, 0.7))


def _clip_cases() -> list[tuple[list[torch.Tensor], float, list[torch.Tensor], float]]:
    """(gradients, max_norm, the clipped gradients, the total norm) by torch.nn.utils.clip_grad_norm_."""
    g = torch.Generator().manual_seed(7)
    cases = []
    for max_norm, norm in _CLIP_CASES:
        grads = [torch.randn(4, 3, generator=g), torch.randn(5, generator=g)]
        scale = norm / torch.sqrt(sum((t**2).sum() for t in grads)).item()
        grads = [t * scale for t in grads]
        params = [torch.nn.Parameter(torch.zeros_like(t)) for t in grads]
        for p, t in zip(params, grads):
            p.grad = t.clone()
        total = torch.nn.utils.clip_grad_norm_(params, max_norm).item()
        cases.append((grads, max_norm, [p.grad.detach().clone() for p in params], total))
    return cases


def _same_tensors(got, want, atol: float = 1e-7) -> bool:
    return all(a.shape == b.shape and torch.allclose(a.to(b.dtype), b, rtol=1e-5, atol=atol)
               for a, b in zip(got, want))


def check_clip_gradients(fn: Callable) -> Verdict:
    """Exercise 7.2: ``fn(grads, max_norm) -> (clipped_grads, total_norm)`` as ``clip_grad_norm_`` does it, without
    calling it (or PyTorch's other clipping functions, or the book's training code)."""

    def checks():
        cases = _clip_cases()  # every expected value first, before the reader's code runs
        shortcuts = _clip_shortcuts()
        for grads, max_norm, expected, total in cases:
            call = f"my_clip(grads, {max_norm}) with a gradient of total norm {total:.3g}"
            out = call_refusing(fn, grads, max_norm, call=call, names=("grads", "max_norm"), shortcuts=shortcuts)
            expect(isinstance(out, tuple) and len(out) == 2, f"{call} returned a {type(out).__name__}",
                   "Return a pair: (the list of clipped gradients, the total norm before clipping).")
            clipped, norm = out
            expect(isinstance(clipped, (list, tuple)) and len(clipped) == len(grads),
                   f"{call}: the first element is not a list of {len(grads)} tensors", "Return one tensor per input.")
            for i, t in enumerate(clipped):
                expect_tensor(t, f"{call}: clipped[{i}]")
            expect_close(_float(norm, call), total, f"{call}: the total norm",
                         "The total norm is the norm of all gradients together: sqrt(Σ over tensors of Σ g²), "
                         "measured before clipping.", rtol=1e-5)
            hint = "Scale every gradient by the same factor min(1, max_norm / total_norm)."
            per_tensor = [t * min(1.0, max_norm / (t.norm().item() + 1e-6)) for t in grads]
            threshold_one = [t * min(1.0, 1.0 / (total + 1e-6)) for t in grads]
            if max_norm != 1.0 and _same_tensors(clipped, threshold_one):
                hint = (f"Use the max_norm you are given: this call's is {max_norm}, and the gradients came back "
                        "clipped as if it were 1.")
            elif total < max_norm and not _same_tensors(clipped, grads, atol=1e-8):
                hint = "Below max_norm the gradients must stay as they are: the factor is min(1, ...), never above 1."
            elif _same_tensors(clipped, per_tensor, atol=1e-6):
                hint = "You clipped each tensor on its own; clip by the norm of all of them together (one factor)."
            for i, (a, b) in enumerate(zip(clipped, expected)):
                expect_close(a, b, f"{call}: clipped[{i}]", hint, rtol=1e-5, atol=1e-7)

    return run_checks("Exercise 7.2 (gradient clipping)", checks,
                      "It matches torch.nn.utils.clip_grad_norm_ at three thresholds, above and below them.")


# ---- Exercise 7.3 ------------------------------------------------------------------------------------------
#
# Adam with L2 regularisation, torch.optim.Adam(weight_decay=λ): the decay is added to the gradient before the
# moments, g' = g + λ θ, so it is averaged and divided by √v̂ like the rest (AdamW, the chapter's (7.5), keeps it
# outside). Two sets of hyperparameters, three steps each from m = v = 0, so that an argument left out or fixed
# to a number fails; a diagnostic step (t = 3 from a state of its own, a large ε) tells the typical mistakes apart.

_ADAM_SETS = (dict(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1),
              dict(lr=0.03, beta1=0.8, beta2=0.95, eps=1e-3, weight_decay=0.3))
_ADAM_SHAPES = ((6, 4), (3, 5))
_ADAM_STEPS = 3
_HYPERPARAMETERS = ("lr", "beta1", "beta2", "eps", "weight_decay")
# The diagnostic: at t = 3, from nonzero m and v, with an ε large enough that where it sits changes every digit.
_DIAGNOSTIC = dict(t=3, lr=0.05, beta1=0.8, beta2=0.95, eps=0.05, weight_decay=0.3)


def _adam_l2_reference() -> list[tuple[dict, torch.Tensor, list[torch.Tensor], list[tuple[torch.Tensor, ...]]]]:
    """For each hyperparameter set: (the set, the start, three gradients, (param, m, v) after each step of
    torch.optim.Adam with that weight_decay), in float64."""
    g = torch.Generator().manual_seed(3)
    cases = []
    for h, shape in zip(_ADAM_SETS, _ADAM_SHAPES):
        start = torch.randn(*shape, generator=g, dtype=torch.float64)
        grads = [torch.randn(*shape, generator=g, dtype=torch.float64) for _ in range(_ADAM_STEPS)]
        p = torch.nn.Parameter(start.clone())
        opt = torch.optim.Adam([p], lr=h["lr"], betas=(h["beta1"], h["beta2"]), eps=h["eps"],
                               weight_decay=h["weight_decay"], foreach=False)
        expected = []
        for grad in grads:
            p.grad = grad.clone()
            opt.step()
            state = opt.state[p]
            expected.append((p.detach().clone(), state["exp_avg"].clone(), state["exp_avg_sq"].clone()))
        cases.append((h, start, grads, expected))
    return cases


def _adam_variant(param, grad, m, v, t, lr, beta1, beta2, eps, weight_decay, *, decay="gradient",
                  v_from_decayed=True, corrected=True, eps_at="outside", hats=(False, False)):
    """One step of Adam with L2 regularisation as the exercise asks (the defaults) or with one typical mistake:
    ``decay`` "decoupled" (AdamW) or "after moments" (λ θ added to m̂); v from g, not g'; no bias correction; ε
    "inside" the square root, "before correction" ((√v + ε) / √(1 − β2ᵗ)), "inside before correction" or "none";
    m̂ and / or v̂ returned instead of m and v."""
    g = grad + weight_decay * param if decay == "gradient" else grad
    new_m = beta1 * m + (1 - beta1) * g
    new_v = beta2 * v + (1 - beta2) * (g if v_from_decayed else grad) ** 2
    c1, c2 = (1 - beta1**t, 1 - beta2**t) if corrected else (1.0, 1.0)
    m_hat, v_hat = new_m / c1, new_v / c2
    denominator = {"outside": lambda: v_hat.sqrt() + eps, "inside": lambda: (v_hat + eps).sqrt(),
                   "before correction": lambda: (new_v.sqrt() + eps) / math.sqrt(c2),
                   "inside before correction": lambda: (new_v + eps).sqrt() / math.sqrt(c2),
                   "none": lambda: v_hat.sqrt()}[eps_at]()
    if decay == "after moments":
        update = (m_hat + weight_decay * param) / denominator
    else:
        update = m_hat / denominator + (weight_decay * param if decay == "decoupled" else 0.0)
    return param - lr * update, m_hat if hats[0] else new_m, v_hat if hats[1] else new_v


_EPS_HINT = ("Everything else is right; only ε is in the wrong place. Add it to √v̂, outside the square root and "
             "after the bias correction: m̂ / (√v̂ + ε).")
_HATS_HINT = ("Return m and v themselves, not the bias-corrected m̂ and v̂: the next step starts from m and v, and "
              "corrects them again with its own t.")
_ADAM_MISTAKES = (
    (dict(decay="decoupled"), "That is AdamW: here the decay goes into the gradient. Use g' = g + λ param, update m "
                              "and v with g', and leave λ param out of the update itself."),
    (dict(decay="after moments"), "The decay goes into the gradient before the moments, not after them: g' = g + λ "
                                  "param, and both m and v are updated with g'."),
    (dict(v_from_decayed=False), "Update v with g'² too, g' = g + λ param: the decayed gradient feeds both m and v."),
    (dict(corrected=False), "Divide m by (1 − β1ᵗ) and v by (1 − β2ᵗ) before the update (the bias correction): both "
                            "started at 0, so early on they are too small."),
    (dict(eps_at="inside"), _EPS_HINT),
    (dict(eps_at="before correction"), _EPS_HINT),
    (dict(eps_at="inside before correction"), _EPS_HINT),
    (dict(eps_at="none"), _EPS_HINT),
    (dict(hats=(True, False)), _HATS_HINT),
    (dict(hats=(False, True)), _HATS_HINT),
    (dict(hats=(True, True)), _HATS_HINT),
)
_ADAM_GENERIC_HINT = ("With g' = g + λ param: m ← β1 m + (1 − β1) g'; v ← β2 v + (1 − β2) g'²; m̂ = m / (1 − β1ᵗ); "
                      "v̂ = v / (1 − β2ᵗ); param ← param − lr m̂ / (√v̂ + ε). Return the new param, m and v.")


def _adam_diagnostic() -> tuple[tuple, list[tuple[tuple[torch.Tensor, ...], str]]]:
    """(the arguments of the diagnostic step, [(what one typical mistake returns for them, its hint), ...])."""
    g = torch.Generator().manual_seed(11)
    param, grad, m = (torch.randn(4, 3, generator=g, dtype=torch.float64) for _ in range(3))
    v = torch.rand(4, 3, generator=g, dtype=torch.float64) + 0.1
    d = _DIAGNOSTIC
    args = (param, grad, m, v, d["t"], *(d[k] for k in _HYPERPARAMETERS))
    return args, [(_adam_variant(*args, **mistake), hint) for mistake, hint in _ADAM_MISTAKES]


def _adam_hint(fn: Callable, shortcuts: Shortcuts, diagnostic: tuple) -> str:
    """The hint for a wrong answer: the reader's function is run on the diagnostic step, and a typical mistake
    it matches there (parameter, m and v) is named; otherwise the update is spelled out."""
    args, mistakes = diagnostic
    try:
        out = call_refusing(fn, *args, call="my_adam_l2_step (diagnostic step)", shortcuts=shortcuts,
                            names=("param", "grad", "m", "v"))
    except Exception:  # noqa: BLE001 -- hint search only; the main check has reported the mismatch
        return _ADAM_GENERIC_HINT
    if isinstance(out, tuple) and len(out) == 3 and all(isinstance(x, torch.Tensor) for x in out):
        for wrong, hint in mistakes:
            if all(x.shape == w.shape and torch.allclose(x.to(w.dtype), w, rtol=1e-9, atol=1e-12)
                   for x, w in zip(out, wrong)):
                return hint
    return _ADAM_GENERIC_HINT


def _expect_plain(x: torch.Tensor, like: torch.Tensor, what: str) -> None:
    """``x`` is a plain torch.Tensor (no Parameter) of ``like``'s dtype and shape."""
    expect(type(x) is torch.Tensor, f"{what} is a {type(x).__name__}, expected a plain torch.Tensor",
           "Return plain tensors, the results of torch operations on the tensors you are given (no "
           "torch.nn.Parameter).")
    expect(x.dtype == like.dtype, f"{what} has dtype {x.dtype}, expected {like.dtype} like the inputs",
           "Keep the inputs' dtype: no .float() or .to(...), and no tensor of another dtype in the arithmetic.")
    expect(x.shape == like.shape, f"{what} has shape {tuple(x.shape)}, expected {tuple(like.shape)}",
           "Every update is elementwise: the new param, m and v have the shape of param.")


def check_adam_l2_step(fn: Callable) -> Verdict:
    """Exercise 7.3: ``fn(param, grad, m, v, t, lr, beta1, beta2, eps, weight_decay) -> (param, m, v)``, one step
    of Adam with L2 regularisation (the decay added to the gradient, as ``torch.optim.Adam(weight_decay=λ)``),
    without an optimizer of torch (built, stepped, in its functional or TorchScript form) or the book's training
    code."""

    # The expected values come first, outside the time bound (the first optimizer step imports a lot of PyTorch,
    # and torch.distributed.optim compiles its optimizers with TorchScript).
    cases = _adam_l2_reference()
    diagnostic = _adam_diagnostic()
    _import_scripted_optimizers()

    def checks():
        shortcuts = _optimizer_shortcuts()
        for h, start, grads, expected in cases:
            shown = ", ".join(f"{k}={h[k]:g}" for k in _HYPERPARAMETERS)
            param, m, v = start.clone(), torch.zeros_like(start), torch.zeros_like(start)
            for t, grad in enumerate(grads, start=1):
                call = f"my_adam_l2_step(param, grad, m, v, t={t}, {shown})"
                out = call_refusing(_watched(fn), param, grad, m, v, t, *(h[k] for k in _HYPERPARAMETERS),
                                    call=call, names=("param", "grad", "m", "v"), shortcuts=shortcuts)
                expect(isinstance(out, tuple) and len(out) == 3, f"{call} returned a {type(out).__name__}",
                       "Return a triple (new param, new m, new v).")
                new = [expect_tensor(x, f"{call}: element {i}") for i, x in enumerate(out)]
                for x, name in zip(new, ("param", "m", "v")):
                    _expect_plain(x, start, f"{call}: the new {name}")
                for got, want, name in zip(new, expected[t - 1], ("parameter", "m", "v")):
                    if not torch.allclose(got, want, rtol=1e-9, atol=1e-12):
                        expect_close(got, want, f"step {t}: the new {name} returned by {call}",
                                     _adam_hint(_watched(fn), shortcuts, diagnostic), rtol=1e-9, atol=1e-12)
                param, m, v = new

    return run_checks("Exercise 7.3 (one step of Adam with L2 regularisation)", checks,
                      "Three steps match torch.optim.Adam with weight_decay (parameter, m and v) to float64 "
                      "precision, for two sets of hyperparameters.")


# ---- Exercise 7.7 ------------------------------------------------------------------------------------------

_ACCUMULATION_CASES = ((10, 4), (8, 4), (9, 2))  # (windows in the batch, the most the model takes at once)
_ACCUMULATION_MODEL = dict(vocab_size=11, context_length=8, d_model=16, n_layers=1, n_heads=2, positional="rope")


class _LimitedGPT(GPT):
    """A small float64 GPT that refuses more than ``max_rows`` windows per call (as if memory allowed no more),
    records in ``seen`` how many windows each call made with gradients enabled got (calls under no_grad build no
    graph and do not count), counts in ``backwards`` the backward passes that reached its parameters (a hook on
    the token embedding, which every backward through the model reaches once), and comes with an earlier step's
    gradients in ``.grad``; a deep copy (what the reader is given) keeps all four."""

    def __init__(self, max_rows: int, seen: list, backwards: list | None = None):
        with torch.random.fork_rng():
            torch.manual_seed(0)
            super().__init__(GPTConfig(**_ACCUMULATION_MODEL))
        self.double()
        self.max_rows, self.seen = max_rows, seen
        self.backwards = [] if backwards is None else backwards
        for p in self.parameters():
            p.grad = torch.full_like(p, 0.5)
        next(self.parameters()).register_post_accumulate_grad_hook(lambda p: self.backwards.append(1))

    def forward(self, idx, *args, **kwargs):
        rows = idx.shape[0] if isinstance(idx, torch.Tensor) and idx.dim() == 2 else 0
        if torch.is_grad_enabled():
            self.seen.append(rows)
        if rows > self.max_rows:
            raise ValueError(f"model(...) was given {rows} windows at once; this model takes at most {self.max_rows} "
                             "at a time: split x into micro-batches of at most that many windows")
        return super().forward(idx, *args, **kwargs)

    def __deepcopy__(self, memo):
        twin = _LimitedGPT(self.max_rows, self.seen, self.backwards)
        twin.load_state_dict(self.state_dict())
        for mine, theirs in zip(self.parameters(), twin.parameters()):
            theirs.grad = None if mine.grad is None else mine.grad.clone()
        return twin


def _mean_loss_grads(model: GPT, parts) -> list[torch.Tensor]:
    """The gradient of sum(weight * mean loss of (xs, ys)) over ``parts`` [(xs, ys, weight), ...], from zero."""
    model.zero_grad(set_to_none=True)
    for xs, ys, weight in parts:
        (model(xs, ys)[1] * weight).backward()
    return [p.grad.clone() for p in model.parameters()]


def _accumulation_hint(got: list, wrong: dict) -> str:
    for hint, grads in wrong.items():
        if all(torch.allclose(a.to(b.dtype), b, rtol=1e-6, atol=1e-12) for a, b in zip(got, grads)):
            return hint
    return ("What the k backward passes add into .grad must sum to the gradient of the whole batch's mean loss: "
            "what is in .grad before the first one, and what share of that mean is one micro-batch's mean loss?")


def check_accumulated_gradients(fn: Callable) -> Verdict:
    """Exercise 7.7: ``fn(model, x, y, micro) -> list of gradients`` of the mean loss over the batch ``(x, y)``,
    accumulated over micro-batches of at most ``micro`` windows (the model given refuses more at once)."""

    # Everything expected comes first: the whole batch's gradient and those of the usual mistakes.
    cases = []
    for rows, micro in _ACCUMULATION_CASES:
        g = torch.Generator().manual_seed(rows * 10 + micro)
        n_c, n_v = _ACCUMULATION_MODEL["context_length"], _ACCUMULATION_MODEL["vocab_size"]
        x = torch.randint(0, n_v, (rows, n_c), generator=g)
        y = torch.randint(0, n_v, (rows, n_c), generator=g)
        reference = _LimitedGPT(rows, [])
        stale = [p.grad.clone() for p in reference.parameters()]
        chunks = list(zip(x.split(micro), y.split(micro)))
        expected = _mean_loss_grads(reference, [(x, y, 1.0)])
        wrong = {
            "Each micro-batch's mean loss counts len(xs) / len(x) of the batch's mean, not 1 / k: the last "
            "micro-batch here is shorter than the others.": _mean_loss_grads(
                reference, [(xs, ys, 1 / len(chunks)) for xs, ys in chunks]),
            "Weight each micro-batch's loss before backward (times len(xs) / len(x)): the sum of the "
            "micro-batches' mean losses has about k times the gradient.": _mean_loss_grads(
                reference, [(*c, 1.0) for c in chunks]),
            "Zero the gradients once, before the first micro-batch, not before each: backward adds into .grad, and "
            "that sum is the point.": _mean_loss_grads(reference, [(*chunks[-1], len(chunks[-1][0]) / rows)]),
            "The model came with an earlier step's gradients in .grad: set them to zero first (model.zero_grad()).":
                [e + s for e, s in zip(expected, stale)],
        }
        cases.append((x, y, micro, expected, wrong))

    def checks():
        for x, y, micro, expected, wrong in cases:
            rows = x.shape[0]
            seen, backwards = [], []
            model = _LimitedGPT(micro, seen, backwards)
            call = f"my_accumulated_grads(model, x, y, micro={micro}) with a batch of {rows} windows"
            got = call_reader(fn, model, x, y, micro, call=call, names=("model", "x", "y", "micro"),
                              forbid=(train, _split_step))
            names = [name for name, _ in model.named_parameters()]
            expect(isinstance(got, (list, tuple)) and len(got) == len(names), f"{call} returned "
                   f"{len(got) if isinstance(got, (list, tuple)) else 'no'} gradients, expected a list of "
                   f"{len(names)}", "Return [p.grad for p in model.parameters()], in that order.")
            expect(sum(seen) >= rows, f"{call}: the model saw {sum(seen)} of the {rows} windows through model(...) "
                   "with gradients enabled",
                   "Run every window through model(xs, ys), micro-batch by micro-batch, with gradients enabled.")
            expect(len(backwards) == len(seen), f"{call}: {len(seen)} forward passes with gradients enabled "
                   f"but {len(backwards)} backward passes reached the model's parameters",
                   "Call backward once per micro-batch, right after its forward pass: that frees the micro-batch's "
                   "activations before the next one. One backward over all the micro-batches' losses keeps every "
                   "graph in memory, as if the whole batch went through at once.")
            got = [expect_tensor(t, f"{call}: gradient of {name}") for t, name in zip(got, names)]
            for t, e, name in zip(got, expected, names):
                expect(t.shape == e.shape, f"{call}: the gradient of {name} has shape {tuple(t.shape)}, expected "
                       f"{tuple(e.shape)}", "Return [p.grad for p in model.parameters()], in that order.")
            hint = _accumulation_hint(got, wrong)
            for t, e, name in zip(got, expected, names):
                expect_close(t, e, f"{call}: the gradient of {name}", hint, rtol=1e-8, atol=1e-12)

    return run_checks("Exercise 7.7 (gradient accumulation)", checks,
                      "Micro-batches of at most `micro` windows give the whole batch's gradient, a shorter last one "
                      "included.")
