"""Reading GGUF files: metadata as plain Python values and tensors as NumPy views."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from edgeserve.errors import ModelLoadError

GGUF_MAGIC = b"GGUF"


@dataclass
class GGUFTensor:
    name: str
    qtype: gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # row-major (PyTorch order): (rows, cols)
    data: np.ndarray  # raw bytes/blocks as stored in the file (a memory map)


@dataclass
class GGUFFile:
    path: Path
    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensor]

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))


def read_gguf(path: str | Path) -> GGUFFile:
    """Open a GGUF file; raise ModelLoadError with a precise reason when it is not a valid one."""
    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"model file not found: {path}")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ModelLoadError(f"{path}: not a GGUF file (magic {magic!r}, expected {GGUF_MAGIC!r})")
    try:
        reader = gguf.GGUFReader(path, "r")
    except Exception as exc:  # the reader raises bare ValueError/IndexError on damage
        raise ModelLoadError(f"{path}: corrupt or truncated GGUF file ({exc})") from exc
    metadata: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        metadata[key] = field.contents()
    tensors: dict[str, GGUFTensor] = {}
    for t in reader.tensors:
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        tensors[t.name] = GGUFTensor(t.name, t.tensor_type, shape, t.data)
    return GGUFFile(path, metadata, tensors)
