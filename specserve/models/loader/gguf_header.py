"""A GGUF file's metadata and tensor directory, read without its arrays of strings: what a config needs.

gguf.GGUFReader builds a numpy view for every part of every field, so a file whose tokenizer holds ~50k
tokens and ~50k merges (the demo SmolLM2) takes ~4.8 s to open on the 2-core AVX2 EPYC, and a worker's
start opened it several times over before reading a weight. This reads the same header with struct,
stepping over string arrays (their contents are read only when asked for), in tens of milliseconds, and
gives each tensor's data as GGUFReader gives it (`GGUFTensors`: numpy views of the memory-mapped file), which
loader/gguf.py reads the weights from.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MAGIC = b"GGUF"
# GGUF value types: struct format of the scalar ones (8: string, 9: array)
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class HeaderField:
    """One key's value: a scalar, a string, or an array (read in full when `contents` is called)."""

    _buf: Any
    _type: int
    _offset: int  # where the value starts (after the key and the value type)
    _count: int  # elements of an array; 1 otherwise
    _elem: int  # an array's element type; the value's type otherwise

    def contents(self) -> Any:
        if self._type != _ARRAY:
            return _value(self._buf, self._type, self._offset)[0]
        if self._elem in _SCALARS:
            fmt = _SCALARS[self._elem]
            values = struct.unpack_from(f"<{self._count}{fmt}", self._buf, self._offset + 12)
            return list(values)
        out, at = [], self._offset + 12
        for _ in range(self._count):
            value, at = _value(self._buf, self._elem, at)
            out.append(value)
        return out


@dataclass(frozen=True)
class HeaderTensor:
    name: str
    shape: tuple[int, ...]  # GGUF's order (innermost first), as GGUFReader's tensors give it
    tensor_type: int
    offset: int  # of its data, from the start of the data section


class GGUFHeader:
    """get_field(key) and tensors, as gguf.GGUFReader offers them to loader.gguf.gguf_config."""

    def __init__(self, path: str | Path) -> None:
        with open(path, "rb") as f:
            try:
                buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except ValueError as e:  # an empty file
                raise ValueError(f"{path}: not a GGUF file ({e})") from e
        try:
            self._fields: dict[str, HeaderField] = {}
            self.tensors: list[HeaderTensor] = []
            self._read(buf, Path(path))
        except struct.error as e:
            raise ValueError(f"{path}: truncated GGUF header ({e})") from e
        # the fields' contents are read from it on demand, so it stays open as long as they live
        self._buf = buf
        self.path = Path(path)

    def get_field(self, key: str) -> HeaderField | None:
        return self._fields.get(key)

    def _read(self, buf: Any, path: Path) -> None:
        if buf[:4] != MAGIC:
            raise ValueError(f"{path}: not a GGUF file (magic {bytes(buf[:4])!r})")
        version, tensor_count, kv_count = struct.unpack_from("<IQQ", buf, 4)
        if version not in (2, 3):
            raise ValueError(f"{path}: GGUF version {version} (big-endian or unknown); this reads 2 and 3")
        at = 24
        for _ in range(kv_count):
            key, at = _string(buf, at)
            (vtype,) = struct.unpack_from("<I", buf, at)
            at += 4
            if vtype == _ARRAY:
                elem, count = struct.unpack_from("<IQ", buf, at)
                self._fields[key] = HeaderField(buf, vtype, at, count, elem)
                at = _skip_array(buf, elem, count, at + 12)
            else:
                self._fields[key] = HeaderField(buf, vtype, at, 1, vtype)
                at = _value(buf, vtype, at)[1]
        for _ in range(tensor_count):
            name, at = _string(buf, at)
            (n_dims,) = struct.unpack_from("<I", buf, at)
            dims = struct.unpack_from(f"<{n_dims}Q", buf, at + 4)
            at += 4 + 8 * n_dims
            ttype, offset = struct.unpack_from("<IQ", buf, at)
            at += 12
            self.tensors.append(HeaderTensor(name, tuple(int(d) for d in dims), ttype, int(offset)))
        alignment = self._fields.get("general.alignment")
        align = int(alignment.contents()) if alignment is not None else 32
        if align <= 0 or align & (align - 1):
            raise ValueError(f"{path}: general.alignment {align} is not a power of two")
        self.data_offset = at + (-at) % align  # where the tensors' data starts


def _string(buf: Any, at: int) -> tuple[str, int]:
    (n,) = struct.unpack_from("<Q", buf, at)
    return bytes(buf[at + 8 : at + 8 + n]).decode("utf-8", errors="replace"), at + 8 + n


def _value(buf: Any, vtype: int, at: int) -> tuple[Any, int]:
    if vtype == _STRING:
        return _string(buf, at)
    fmt = _SCALARS.get(vtype)
    if fmt is None:
        raise ValueError(f"GGUF value type {vtype} is not a scalar or a string")
    return struct.unpack_from("<" + fmt, buf, at)[0], at + struct.calcsize(fmt)


def _skip_array(buf: Any, elem: int, count: int, at: int) -> int:
    if elem in _SCALARS:
        return at + count * struct.calcsize(_SCALARS[elem])
    if elem == _STRING:
        for _ in range(count):
            at += 8 + struct.unpack_from("<Q", buf, at)[0]
        return at
    if elem == _ARRAY:
        for _ in range(count):
            inner, n = struct.unpack_from("<IQ", buf, at)
            at = _skip_array(buf, inner, n, at + 12)
        return at
    raise ValueError(f"GGUF array element type {elem} is unknown")


@dataclass(frozen=True)
class TensorData:
    """A tensor as loader/gguf.py reads it, as GGUFReader's ReaderTensor gives it: `data` a numpy view of the
    file (typed for float and integer types, [rows, bytes a row] of uint8 for quantized ones)."""

    name: str
    shape: tuple[int, ...]
    tensor_type: Any  # gguf.GGMLQuantizationType
    data_offset: int  # in the file
    n_bytes: int
    data: Any


class GGUFTensors:
    """The tensors of a file whose header `header` read, as numpy views of one read-only memory map of it
    (`map`): what GGUFReader builds for the weights, without its views of every field."""

    def __init__(self, header: GGUFHeader) -> None:
        import numpy as np
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
        from gguf.quants import quant_shape_to_byte_shape

        typed = {
            GGMLQuantizationType.F16: np.float16,
            GGMLQuantizationType.F32: np.float32,
            GGMLQuantizationType.F64: np.float64,
            GGMLQuantizationType.I8: np.int8,
            GGMLQuantizationType.I16: np.int16,
            GGMLQuantizationType.I32: np.int32,
            GGMLQuantizationType.I64: np.int64,
        }
        with open(header.path, "rb") as f:
            self.map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self.tensors: list[TensorData] = []
        for t in header.tensors:
            try:
                ttype = GGMLQuantizationType(t.tensor_type)
            except ValueError as e:
                raise ValueError(f"{header.path}: tensor {t.name}: unknown GGML type {t.tensor_type}") from e
            n_elems = 1
            for d in t.shape:
                n_elems *= d
            block, size = GGML_QUANT_SIZES[ttype]
            n_bytes = n_elems * size // block
            start = header.data_offset + t.offset
            if start + n_bytes > len(self.map):
                raise ValueError(f"{header.path}: tensor {t.name} runs past the end of the file (truncated?)")
            dims = tuple(reversed(t.shape))
            item = typed.get(ttype)
            if item is None:
                item, dims = np.uint8, quant_shape_to_byte_shape(dims, ttype)
            count = n_bytes // np.dtype(item).itemsize
            view = np.frombuffer(self.map, dtype=item, count=count, offset=start).reshape(dims)
            self.tensors.append(TensorData(t.name, t.shape, ttype, start, n_bytes, view))
