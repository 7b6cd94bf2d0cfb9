"""The arithmetic canary (tools/arithmetic_canary.py): the operations the notebooks depend on compute, under the checked
runs' arithmetic, the bits stored in tests/arithmetic_fingerprints.json, whatever the caller's environment says.

A CPU type that computes one of them differently fails here in seconds, naming the operation and printing the CPU's
flags, instead of in a notebook half an hour later (see tools/nbval_lanes.py for the caps and why each holds)."""

import json
import sys
from pathlib import Path

import numpy
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import arithmetic_canary  # noqa: E402
import nbval_lanes  # noqa: E402

from groundup import training  # noqa: E402

STORED = json.loads(arithmetic_canary.STORED.read_text())


def _check(found):
    if arithmetic_canary.differences(found, STORED):
        pytest.fail(arithmetic_canary.report(found, STORED), pytrace=False)


def test_the_checked_arithmetic_computes_the_stored_bits():
    _check(arithmetic_canary.run_canary(nbval_lanes.notebook_env()))


@pytest.mark.parametrize("caller", [
    {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE", "DNNL_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2",
     "MKL_ENABLE_INSTRUCTIONS": "AVX2", "MKL_CBWR": "AUTO", "GLIBC_TUNABLES": "", "NPY_ENABLE_CPU_FEATURES": "X86_V3",
     "ONEDNN_DEFAULT_FPMATH_MODE": "BF16", "MKL_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "OMP_DYNAMIC": "TRUE",
     "OMP_THREAD_LIMIT": "1", "MKL_DOMAIN_NUM_THREADS": "MKL_DOMAIN_ALL=1"},
    "unset"], ids=["other values", "unset"])
def test_the_checked_run_ignores_the_callers_settings(caller):
    env = arithmetic_canary.caller_env(caller)
    if caller != "unset":
        assert all(env.get(k) == v for k, v in caller.items())
    else:
        assert not set(env) & set(nbval_lanes.REPRODUCIBLE)
    _check(arithmetic_canary.run_canary(nbval_lanes.notebook_env(environ=env)))


def test_uncapped_the_canary_sees_this_cpus_own_kernels():
    # Not a test that cannot fail: on a CPU with AVX2, lifting the caps must change what they guard (oneDNN's GELU,
    # the matrix products of MKL and ATen). Two threads as in the checked runs, so only the caps differ.
    if " avx2 " not in f" {arithmetic_canary.cpu_description().splitlines()[1]} ":
        pytest.skip("no AVX2 here: the capped and uncapped kernels may be the same")
    found = arithmetic_canary.run_canary({**arithmetic_canary.caller_env("unset"), "OMP_NUM_THREADS": "2"})
    differ = arithmetic_canary.differences(found, STORED)
    assert "GELU (erf), backward" in differ and "matrix product, 2 thread(s)" in differ, differ


def test_a_mismatch_names_the_operation_and_the_cpu():
    found = {**STORED, "GELU (erf), backward": "0" * 16}
    del found["torch.exp"]
    text = arithmetic_canary.report(found, STORED)
    assert "2 of" in text and "GELU (erf), backward: 0000000000000000 here" in text
    assert "torch.exp: missing here" in text and "\nflags: " in text and "ONEDNN_MAX_CPU_ISA=SSE41" in text
    assert "C library: glibc" in text and "torch 2.13.0" in text


def test_numpy_dispatch_is_off_for_every_target_it_has():
    from numpy._core._multiarray_umath import __cpu_dispatch__

    disabled = set(nbval_lanes.ARITHMETIC["NPY_DISABLE_CPU_FEATURES"].split())
    assert set(__cpu_dispatch__) <= disabled, f"numpy {numpy.__version__} dispatches to {__cpu_dispatch__}"


def test_the_chapter7_model_is_keyed_on_every_cap():
    # ATen's capability is read back from PyTorch; the DYNAMIC switches fix threads, which the file records itself.
    keyed = set(nbval_lanes.ARITHMETIC) - {"ATEN_CPU_CAPABILITY", "MKL_DYNAMIC", "OMP_DYNAMIC"}
    assert keyed == set(training.ARITHMETIC_VARIABLES)


def test_the_fingerprints_cover_what_the_issue_names():
    names = " ".join(STORED)
    for op in ("chapter 7's GPT: gradients", "softmax", "layer norm", "GELU", "matrix product", "torch.exp",
               "torch.log", "torch.sin", "torch.sqrt", "AdamW step, fused", "AdamW step, per tensor", "LAPACK",
               "bfloat16", "sum of a million"):
        assert op in names


def test_a_maker_defined_difference_is_reported_but_fails_nothing():
    name = arithmetic_canary.MAKER_DEFINED[0]
    found = {**STORED, name: "0" * 16}
    assert set(arithmetic_canary.MAKER_DEFINED) <= set(STORED)
    assert arithmetic_canary.differences(found, STORED) == []
    assert arithmetic_canary.differences(found, STORED, maker_defined=True) == [name]
    assert f"1 of {len(arithmetic_canary.MAKER_DEFINED)} differ here: {name}" in arithmetic_canary.report(found, STORED)


def test_the_other_makers_square_root_changes_exactly_the_maker_defined_operations():
    # make notebooks-other-sqrt runs the notebooks with tools/other_sqrt: it must perturb MKL's square root (else the
    # run shows nothing) and nothing the notebooks rely on (else a failure there would not be about the square root).
    env = {**nbval_lanes.notebook_env(), "GROUNDUP_OTHER_SQRT": "1", "PYTHONPATH": str(ROOT / "tools" / "other_sqrt")}
    found = arithmetic_canary.run_canary(env)
    assert arithmetic_canary.differences(found, STORED) == []
    assert arithmetic_canary.differences(found, STORED, maker_defined=True) == list(arithmetic_canary.MAKER_DEFINED)
