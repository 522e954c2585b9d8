"""Reading GGUF files: metadata as plain Python values and tensors as NumPy views of a memory map.

The layout constants (value types, quant block sizes) come from the `gguf` package. The header is
walked here with `struct` rather than with gguf.GGUFReader, which builds a NumPy view for every
vocabulary entry and takes seconds on a 50k-token vocabulary; this takes a fraction of one.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from edgeserve.errors import ModelLoadError

GGUF_MAGIC = b"GGUF"
_SCALARS = {
    gguf.GGUFValueType.UINT8: "<B", gguf.GGUFValueType.INT8: "<b",
    gguf.GGUFValueType.UINT16: "<H", gguf.GGUFValueType.INT16: "<h",
    gguf.GGUFValueType.UINT32: "<I", gguf.GGUFValueType.INT32: "<i",
    gguf.GGUFValueType.FLOAT32: "<f", gguf.GGUFValueType.BOOL: "<?",
    gguf.GGUFValueType.UINT64: "<Q", gguf.GGUFValueType.INT64: "<q",
    gguf.GGUFValueType.FLOAT64: "<d",
}
_PLAIN_TENSOR_DTYPES = {
    gguf.GGMLQuantizationType.F32: np.float32, gguf.GGMLQuantizationType.F16: np.float16,
    gguf.GGMLQuantizationType.F64: np.float64, gguf.GGMLQuantizationType.I8: np.int8,
    gguf.GGMLQuantizationType.I16: np.int16, gguf.GGMLQuantizationType.I32: np.int32,
    gguf.GGMLQuantizationType.I64: np.int64,
}


@dataclass
class GGUFTensor:
    name: str
    qtype: gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # row-major (PyTorch order): (rows, cols)
    data: np.ndarray  # as stored: typed values for plain types, raw block bytes [rows, row bytes] otherwise


@dataclass
class GGUFFile:
    path: Path
    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensor]

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))


class _Cursor:
    def __init__(self, buf: memoryview):
        self.buf = buf
        self.pos = 0

    def unpack(self, fmt: str) -> Any:
        value = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.unpack("<Q")
        raw = bytes(self.buf[self.pos : self.pos + n])
        if len(raw) != n:
            raise struct.error("string runs past the end of the file")
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def strings(self, count: int) -> list[str]:
        """An array of count strings: a vocabulary's tokens and merges, tens of thousands each, so one tight loop."""
        buf, pos, end, out = self.buf, self.pos, len(self.buf), []
        length = struct.Struct("<Q").unpack_from
        for _ in range(count):
            (n,) = length(buf, pos)
            pos += 8
            if n > end - pos:
                raise struct.error("string runs past the end of the file")
            out.append(str(buf[pos : pos + n], "utf-8", "replace"))
            pos += n
        self.pos = pos
        return out

    def value(self, vtype: int) -> Any:
        vtype = gguf.GGUFValueType(vtype)
        if vtype == gguf.GGUFValueType.STRING:
            return self.string()
        if vtype == gguf.GGUFValueType.ARRAY:
            item_type, count = gguf.GGUFValueType(self.unpack("<I")), self.unpack("<Q")
            if item_type in _SCALARS and item_type != gguf.GGUFValueType.BOOL:
                dtype = np.dtype(_SCALARS[item_type])
                end = self.pos + count * dtype.itemsize
                if end > len(self.buf):
                    raise struct.error("array runs past the end of the file")
                items = np.frombuffer(self.buf[self.pos : end], dtype=dtype).tolist()
                self.pos = end
                return items
            if item_type == gguf.GGUFValueType.STRING:
                return self.strings(count)
            return [self.value(item_type) for _ in range(count)]
        return self.unpack(_SCALARS[vtype])


def read_gguf(path: str | Path) -> GGUFFile:
    """Open a GGUF file; raise ModelLoadError with a precise reason when it is not a valid one."""
    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"model file not found: {path}")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ModelLoadError(f"{path}: not a GGUF file (magic {magic!r}, expected {GGUF_MAGIC!r})")
    raw = np.memmap(path, dtype=np.uint8, mode="r")
    cur = _Cursor(memoryview(raw))
    try:
        cur.pos = 4
        version = cur.unpack("<I")
        if version not in (2, 3):
            raise ModelLoadError(f"{path}: unsupported GGUF version {version}")
        n_tensors, n_kv = cur.unpack("<Q"), cur.unpack("<Q")
        metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = cur.string()
            metadata[key] = cur.value(cur.unpack("<I"))
        infos = []
        for _ in range(n_tensors):
            name = cur.string()
            dims = [cur.unpack("<Q") for _ in range(cur.unpack("<I"))]
            infos.append((name, dims, gguf.GGMLQuantizationType(cur.unpack("<I")), cur.unpack("<Q")))
    except (struct.error, ValueError) as exc:
        raise ModelLoadError(f"{path}: corrupt or truncated GGUF header ({exc})") from exc
    alignment = int(metadata.get("general.alignment", 32))
    start = -(-cur.pos // alignment) * alignment
    tensors: dict[str, GGUFTensor] = {}
    for name, dims, qtype, offset in infos:
        shape = tuple(reversed(dims))
        n = int(np.prod(dims))
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        begin, end = start + offset, start + offset + n * type_size // block
        if end > len(raw):
            raise ModelLoadError(f"{path}: truncated (tensor {name} runs past the end of the file)")
        if qtype in _PLAIN_TENSOR_DTYPES:
            data = raw[begin:end].view(_PLAIN_TENSOR_DTYPES[qtype]).reshape(shape)
        else:
            data = raw[begin:end].reshape(gguf.quant_shape_to_byte_shape(shape, qtype))
        tensors[name] = GGUFTensor(name, qtype, shape, data)
    return GGUFFile(path, metadata, tensors)
