"""The bench's header: the CPU's vector extensions and PyTorch's kernels, read from a (fake) /proc/cpuinfo."""

import sys
import types

import pytest
import torch

from groundup.bench import Row
from groundup.bench.cpu import FLAGS, cpu_features, describe_cpu, parse_cpuinfo

AVX2_ONLY = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Core(TM) i7-8700 CPU @ 3.20GHz
flags\t\t: fpu vme sse sse2 ssse3 fma cx16 sse4_1 sse4_2 avx f16c avx2 bmi2

processor\t: 1
model name\t: Intel(R) Core(TM) i7-8700 CPU @ 3.20GHz
flags\t\t: fpu vme sse sse2 ssse3 fma cx16 sse4_1 sse4_2 avx f16c avx2 bmi2
"""

AVX512_BF16 = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 9654 96-Core Processor
flags\t\t: fpu sse2 avx fma avx2 avx512f avx512dq avx512cd avx512bw avx512vl avx512_bf16 avx512vbmi avx512_vnni
"""

AMX = """processor\t: 0
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: sse2 avx fma avx2 avx512f avx512bw avx512_vnni avx512_bf16 avx512_fp16 amx_bf16 amx_tile amx_int8
"""

ARM = """processor\t: 0
BogoMIPS\t: 50.00
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics bf16 i8mm
CPU implementer\t: 0x41
"""


def _present(features):
    return sorted(f for f, has in features["flags"].items() if has)


@pytest.mark.parametrize("text, model, expected", [
    (AVX2_ONLY, "Intel(R) Core(TM) i7-8700 CPU @ 3.20GHz", ["avx2", "fma"]),
    (AVX512_BF16, "AMD EPYC 9654 96-Core Processor", ["avx2", "avx512_bf16", "avx512_vnni", "avx512f", "fma"]),
    (AMX, "Intel(R) Xeon(R) Platinum 8480+",
     ["amx_bf16", "amx_int8", "amx_tile", "avx2", "avx512_bf16", "avx512_vnni", "avx512f", "fma"]),
    (ARM, None, []),
])
def test_flags_read_from_a_fake_cpuinfo(tmp_path, text, model, expected):
    path = tmp_path / "cpuinfo"
    path.write_text(text)
    features = cpu_features(path)
    assert set(features["flags"]) == set(FLAGS)
    assert _present(features) == expected
    assert parse_cpuinfo(text)[0] == model
    if model is not None:
        assert features["model"] == model
    line = describe_cpu(features).splitlines()[1]
    for flag, label in FLAGS.items():
        assert f"{label} {'yes' if flag in expected else 'no'}" in line


def test_avx512_bf16_cpu_is_described_exactly(tmp_path):
    path = tmp_path / "cpuinfo"
    path.write_text(AVX512_BF16)
    text = describe_cpu(cpu_features(path))
    assert text.splitlines()[1] == ("vector extensions: AVX2 yes, FMA yes, AVX-512F yes, AVX-512 BF16 yes, "
                                    "AVX-512 VNNI yes, AMX tile no, AMX BF16 no, AMX INT8 no")


def test_missing_cpuinfo_reports_flags_unknown(tmp_path):
    features = cpu_features(tmp_path / "absent")
    assert features["flags"] is None and features["model"]  # platform.processor()/machine() or "unknown"
    text = describe_cpu(features)
    assert "flags unknown" in text
    assert torch.backends.cpu.get_cpu_capability() in text


def test_environment_caps_are_reported_only_when_set(tmp_path, monkeypatch):
    for name in ("ATEN_CPU_CAPABILITY", "MKL_CBWR", "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA",
                 "DNNL_MAX_CPU_ISA"):
        monkeypatch.delenv(name, raising=False)
    assert cpu_features(tmp_path / "absent")["environment"] == {}
    assert "environment caps: none set" in describe_cpu(cpu_features(tmp_path / "absent"))
    monkeypatch.setenv("MKL_CBWR", "COMPATIBLE")
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    features = cpu_features(tmp_path / "absent")
    assert features["environment"] == {"MKL_CBWR": "COMPATIBLE", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    assert "MKL_CBWR=COMPATIBLE ONEDNN_MAX_CPU_ISA=AVX2" in describe_cpu(features)


def test_bench_prints_the_cpu_header_first(monkeypatch, capsys):
    """main() with one instant fake section: the header comes first and names PyTorch's capability."""
    import groundup.bench.__main__ as bench_main

    fake = types.ModuleType("groundup.bench.fake")
    fake.run = lambda: [Row("nothing", 1.0, "s")]
    monkeypatch.setitem(sys.modules, "groundup.bench.fake", fake)
    monkeypatch.setattr(bench_main, "SECTIONS", ["fake"])
    assert bench_main.main([]) == 0
    out = capsys.readouterr().out
    capability = torch.backends.cpu.get_cpu_capability()
    first = out.splitlines()[:3]
    assert first[0].startswith("CPU: ") and first[1].startswith("vector extensions: ")
    assert first[2].startswith(f"PyTorch CPU capability: {capability}")
    assert out.index("load average at start") < out.index("[fake]")
