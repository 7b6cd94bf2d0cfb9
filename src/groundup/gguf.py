"""Reading GGUF files by hand: the format llama.cpp stores models in (chapter 12).

A GGUF file is four parts, one after the other, all little-endian::

    header        b"GGUF", version (uint32, 2 or 3), tensor count (uint64), metadata count (uint64)
    metadata      key (string) | value type (uint32) | value          ... one per metadata entry
    tensor table  name (string) | n_dims (uint32) | ne[0..n_dims) (uint64 each) | ggml type (uint32) |
                  offset (uint64, from the start of the data section)   ... one per tensor
    data          padded to ``general.alignment`` (32 unless the metadata says otherwise); each tensor's bytes
                  start at its offset, a multiple of the alignment

A string is its length (uint64) and that many UTF-8 bytes; an array is its element type (uint32), its length
(uint64) and the elements. ``ne[0]`` is the *contiguous* size, so a PyTorch shape is ``ne`` reversed: a
``[576, 49152]`` embedding in the file is a ``(49152, 576)`` tensor.

:func:`read_gguf` parses the header, metadata and tensor table and memory-maps the file (``numpy.memmap``,
copy-on-write): the tensor bytes are never copied as a whole, and :meth:`GGUFFile.tensor` dequantizes one tensor
at a time with :func:`groundup.quantization.dequantize`. Files are untrusted input: every count, length, type,
size and offset is checked against the bytes that remain *before* anything is allocated, and a bad file raises
:class:`GGUFError` naming what is wrong and where.
"""

from __future__ import annotations

import math
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from groundup import quantization

__all__ = ["GGUFError", "GGUFFile", "TensorInfo", "read_gguf", "VALUE_TYPES", "GGML_TYPE_NAMES", "MAX_DIMS"]

MAGIC = b"GGUF"
VERSIONS = (2, 3)  # version 1 used 32-bit counts and lengths; nothing current writes it
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_STRING_BYTES = 16 * 2**20  # a key, a tensor name or a metadata string (chat templates are kilobytes)
MAX_ARRAY_DEPTH = 2  # arrays of arrays are allowed, arrays of arrays of arrays are not

# Metadata value types: (name, struct format or None for strings and arrays)
VALUE_TYPES = {
    0: ("UINT8", "<B"), 1: ("INT8", "<b"), 2: ("UINT16", "<H"), 3: ("INT16", "<h"), 4: ("UINT32", "<I"),
    5: ("INT32", "<i"), 6: ("FLOAT32", "<f"), 7: ("BOOL", "<?"), 8: ("STRING", None), 9: ("ARRAY", None),
    10: ("UINT64", "<Q"), 11: ("INT64", "<q"), 12: ("FLOAT64", "<d"),
}
STRING, ARRAY = 8, 9
_NUMPY_TYPES = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1", 10: "<u8",
                11: "<i8", 12: "<f8"}

#: GGML tensor type numbers and names (for error messages); the ones :mod:`groundup.quantization` reads are those of
#: its ``TYPE_NAMES`` (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and the k-quants Q2_K to Q6_K).
GGML_TYPE_NAMES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 9: "Q8_1",
                   10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K", 16: "IQ2_XXS",
                   24: "I8", 25: "I16", 26: "I32", 27: "I64", 28: "F64", 30: "BF16"}


class GGUFError(ValueError):
    """A file is not a GGUF file this reader accepts: truncated, inconsistent, or using unsupported types."""


@dataclass(frozen=True)
class TensorInfo:
    """One entry of the tensor table.

    ``dims`` is the file's ``ne`` (contiguous size first); ``shape`` is the PyTorch shape (``dims`` reversed);
    ``offset`` is the absolute position of the first byte in the file and ``n_bytes`` how many bytes it takes.
    """

    name: str
    dims: tuple[int, ...]
    ggml_type: int
    offset: int
    n_bytes: int

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(reversed(self.dims))

    @property
    def n_elements(self) -> int:
        return math.prod(self.dims)

    @property
    def type_name(self) -> str:
        return GGML_TYPE_NAMES.get(self.ggml_type, str(self.ggml_type))


@dataclass
class GGUFFile:
    """A parsed GGUF file: ``metadata`` (key -> Python value; arrays are lists), ``value_types`` (key -> the
    file's type numbers: ``(type,)`` or ``(ARRAY, element type)``), the ``tensors`` table (name ->
    :class:`TensorInfo`, in file order), ``alignment``, ``table_offset`` (the byte where the tensor table
    starts, right after the last metadata entry) and ``data_offset`` (where the tensor data starts: the end of
    the table rounded up to the alignment). The tensor bytes stay in the file, memory-mapped."""

    path: Path
    version: int
    metadata: dict
    value_types: dict
    tensors: dict
    alignment: int
    table_offset: int
    data_offset: int
    _data: np.ndarray = field(repr=False)

    def raw(self, name: str) -> torch.Tensor:
        """The bytes of tensor ``name`` as a 1-D uint8 tensor that shares memory with the mapped file."""
        info = self._info(name)
        return torch.from_numpy(self._data[info.offset:info.offset + info.n_bytes])

    def tensor(self, name: str, *, out: torch.Tensor | None = None) -> torch.Tensor:
        """Tensor ``name`` dequantized to float32, in PyTorch shape (``dims`` reversed): a new tensor, or ``out`` (a
        contiguous float32 tensor of that shape) written in place, a slice at a time (see
        :func:`groundup.quantization.dequantize`). A NaN or an infinity in it (a NaN scale, say) is a
        :class:`GGUFError` naming the tensor."""
        return self._read(name, lambda raw, ggml_type, shape: quantization.dequantize(raw, ggml_type, shape, out=out))

    def block_parts(self, name: str):
        """Block-quantized 2-D tensor ``name`` as :func:`groundup.quantization.block_parts` gives it (its int8
        numbers, steps and offsets, not multiplied out); errors are :class:`GGUFError` s naming the tensor."""
        return self._read(name, quantization.block_parts)

    def _read(self, name: str, read):
        info = self._info(name)
        try:
            return read(self.raw(name), info.ggml_type, info.shape)
        except ValueError as err:
            raise GGUFError(f"{self.path.name}: tensor {name!r}: {err}") from None

    def _info(self, name: str) -> TensorInfo:
        if name not in self.tensors:
            raise KeyError(f"{self.path.name} has no tensor {name!r}")
        return self.tensors[name]


class _Cursor:
    """Reads little-endian values from a byte buffer, checking that each one fits in what remains."""

    def __init__(self, buffer, size: int):
        self.buffer, self.size, self.pos = buffer, size, 0

    def need(self, n: int, what: str) -> None:
        if n > self.size - self.pos:
            raise GGUFError(f"truncated file: {what} needs {n:,} bytes at offset {self.pos:,}, but only "
                            f"{self.size - self.pos:,} remain (file size {self.size:,})")

    def scalar(self, fmt: str, what: str):
        n = struct.calcsize(fmt)
        self.need(n, what)
        value = struct.unpack_from(fmt, self.buffer, self.pos)[0]
        self.pos += n
        return value

    def string(self, what: str) -> str:
        n = self.scalar("<Q", f"the length of {what}")
        if n > MAX_STRING_BYTES:
            raise GGUFError(f"{what} at offset {self.pos - 8:,} claims {n:,} bytes, more than the "
                            f"{MAX_STRING_BYTES:,} this reader accepts for one string")
        self.need(n, what)
        raw = bytes(self.buffer[self.pos:self.pos + n])
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise GGUFError(f"{what} at offset {self.pos - n:,} is not valid UTF-8") from None


def _value_type(cursor: _Cursor, key: str) -> int:
    t = cursor.scalar("<I", f"the value type of {key!r}")
    if t not in VALUE_TYPES:
        raise GGUFError(f"metadata {key!r} has unknown value type {t} (known: 0..12)")
    return t


def _read_value(cursor: _Cursor, t: int, key: str, depth: int = 0):
    """One metadata value of type ``t``: a number, bool, str, or a list for arrays (numbers read in bulk)."""
    if t == STRING:
        return cursor.string(f"the value of {key!r}")
    if t != ARRAY:
        return cursor.scalar(VALUE_TYPES[t][1], f"the value of {key!r}")
    if depth >= MAX_ARRAY_DEPTH:
        raise GGUFError(f"metadata {key!r} nests arrays more than {MAX_ARRAY_DEPTH} deep")
    item_type = _value_type(cursor, key)
    n = cursor.scalar("<Q", f"the length of array {key!r}")
    smallest = 8 if item_type in (STRING, ARRAY) else struct.calcsize(VALUE_TYPES[item_type][1])
    if n > (cursor.size - cursor.pos) // smallest:  # checked before any element is read or allocated
        raise GGUFError(f"metadata array {key!r} claims {n:,} elements of type {VALUE_TYPES[item_type][0]}, more "
                        f"than the {cursor.size - cursor.pos:,} remaining bytes can hold")
    if item_type in _NUMPY_TYPES:
        values = np.frombuffer(cursor.buffer, dtype=_NUMPY_TYPES[item_type], count=n, offset=cursor.pos)
        cursor.pos += n * smallest
        return [bool(v) for v in values] if item_type == 7 else values.tolist()
    return [_read_value(cursor, item_type, key, depth + 1) for _ in range(n)]


def _read_metadata(cursor: _Cursor, n_kv: int) -> tuple[dict, dict]:
    metadata, types = {}, {}
    for i in range(n_kv):
        key = cursor.string(f"metadata key {i}")
        if key in metadata:
            raise GGUFError(f"metadata key {key!r} appears twice")
        t = _value_type(cursor, key)
        start = cursor.pos
        metadata[key] = _read_value(cursor, t, key)
        types[key] = (t, struct.unpack_from("<I", cursor.buffer, start)[0]) if t == ARRAY else (t,)
    return metadata, types


def _alignment(metadata: dict, types: dict) -> int:
    if "general.alignment" not in metadata:
        return DEFAULT_ALIGNMENT
    a = metadata["general.alignment"]
    if types["general.alignment"] != (4,) or a == 0 or a & (a - 1):
        raise GGUFError(f"general.alignment must be a power of two stored as UINT32, got {a!r}")
    return a


def _read_tensor_table(cursor: _Cursor, n_tensors: int) -> list[tuple[str, tuple[int, ...], int, int]]:
    table, names = [], set()
    for i in range(n_tensors):
        name = cursor.string(f"the name of tensor {i}")
        if name in names:
            raise GGUFError(f"tensor {name!r} appears twice in the tensor table")
        names.add(name)
        n_dims = cursor.scalar("<I", f"n_dims of tensor {name!r}")
        if not 1 <= n_dims <= MAX_DIMS:
            raise GGUFError(f"tensor {name!r} has n_dims = {n_dims}; GGUF tensors have 1 to {MAX_DIMS}")
        dims = tuple(cursor.scalar("<Q", f"the sizes of tensor {name!r}") for _ in range(n_dims))
        ggml_type = cursor.scalar("<I", f"the type of tensor {name!r}")
        offset = cursor.scalar("<Q", f"the offset of tensor {name!r}")
        table.append((name, dims, ggml_type, offset))
    return table


def _tensor_info(name: str, dims: tuple[int, ...], ggml_type: int, offset: int, data_offset: int, size: int,
                 alignment: int) -> TensorInfo:
    """Check one table entry against the file (type known, sizes sane, bytes inside the file) and build it."""
    if ggml_type not in quantization.BLOCK_LAYOUT:
        known = ", ".join(f"{quantization.TYPE_NAMES[t]} ({t})" for t in quantization.BLOCK_LAYOUT)
        raise GGUFError(f"tensor {name!r} has type {GGML_TYPE_NAMES.get(ggml_type, 'unknown')} ({ggml_type}), "
                        f"which this reader does not dequantize (supported: {known})")
    per_block, block_bytes = quantization.BLOCK_LAYOUT[ggml_type]
    if any(d == 0 for d in dims) or dims[0] % per_block:
        raise GGUFError(f"tensor {name!r} has sizes {list(dims)}: every size must be positive and ne[0] a multiple "
                        f"of {per_block} for {quantization.TYPE_NAMES[ggml_type]}")
    n_bytes = math.prod(dims) // per_block * block_bytes  # Python ints: no overflow however large the sizes
    if offset % alignment:
        raise GGUFError(f"tensor {name!r} starts at data offset {offset:,}, not a multiple of the alignment "
                        f"{alignment}")
    if data_offset + offset + n_bytes > size:
        raise GGUFError(f"tensor {name!r} ({quantization.TYPE_NAMES[ggml_type]}, sizes {list(dims)}) needs bytes "
                        f"{data_offset + offset:,}..{data_offset + offset + n_bytes:,}, past the end of the file "
                        f"({size:,} bytes)")
    return TensorInfo(name, dims, ggml_type, data_offset + offset, n_bytes)


def read_gguf(path: str | os.PathLike) -> GGUFFile:
    """Parse the GGUF file at ``path`` (memory-mapped; tensor bytes are read only when asked for).

    Raises :class:`GGUFError` for a file that is not GGUF, is truncated, or whose counts, lengths, types,
    sizes or offsets do not fit the file -- each checked before anything is allocated for it.
    """
    path = Path(path)
    size = path.stat().st_size
    if size < 24:
        raise GGUFError(f"{path.name} is {size} bytes long, shorter than a GGUF header (24 bytes)")
    data = np.memmap(path, dtype=np.uint8, mode="c")  # copy-on-write: writable for torch, the file untouched
    cursor = _Cursor(memoryview(data), size)  # a memoryview: slicing it is cheap
    magic = bytes(data[:4])
    if magic != MAGIC:
        raise GGUFError(f"{path.name} is not a GGUF file: it starts with {magic!r}, not {MAGIC!r}")
    cursor.pos = 4
    version = cursor.scalar("<I", "the version")
    if version not in VERSIONS:
        raise GGUFError(f"{path.name} is GGUF version {version}; this reader reads versions {VERSIONS}")
    n_tensors = cursor.scalar("<Q", "the tensor count")
    n_kv = cursor.scalar("<Q", "the metadata count")
    # the smallest metadata entry takes 8 + 4 + 1 bytes, the smallest table entry 8 + 4 + 8 + 4 + 8
    for count, smallest, what in ((n_kv, 13, "metadata entries"), (n_tensors, 32, "tensors")):
        if count > (size - cursor.pos) // smallest:
            raise GGUFError(f"{path.name} claims {count:,} {what}, more than its {size:,} bytes can hold")
    metadata, types = _read_metadata(cursor, n_kv)
    alignment = _alignment(metadata, types)
    table_offset = cursor.pos
    table = _read_tensor_table(cursor, n_tensors)
    data_offset = -(-cursor.pos // alignment) * alignment
    tensors = {name: _tensor_info(name, dims, t, offset, data_offset, size, alignment)
               for name, dims, t, offset in table}
    spans = sorted((info.offset, info.offset + info.n_bytes, info.name) for info in tensors.values())
    for (_, end, first), (start, _, second) in zip(spans, spans[1:], strict=False):
        if start < end:
            raise GGUFError(f"tensors {first!r} and {second!r} overlap in the file")
    return GGUFFile(path, version, metadata, types, tensors, alignment, table_offset, data_offset, data)
