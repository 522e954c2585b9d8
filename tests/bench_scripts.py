"""The scripts of bench/ as modules for tests, tiny GGUF files from bench/make_gguf.py, and copies of a GGUF file
with a metadata value changed."""

import importlib.util
import struct
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).parents[1] / "bench"


def load_script(name: str) -> ModuleType:
    """bench/<name>.py imported as the module `name`."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


make_gguf = load_script("make_gguf")

# the 1B family's proportions (GQA 2:1 here, untied head), small enough to write and run in a second
TINY = make_gguf.Shape(hidden=256, layers=8, heads=4, kv_heads=2, ffn=512, tied=False)


def write_tiny(path: Path, file_type: str, donor: Path, seed: int = 3, shape: make_gguf.Shape = TINY) -> Path:
    """A TINY-shaped (or `shape`d) file of `file_type` with the donor GGUF's tokenizer."""
    make_gguf.write_model(path, shape, file_type, donor, seed=seed)
    return path


def patch_metadata(src: Path, dst: Path, key: str, value: int) -> None:
    """A copy of src whose integer metadata `key` holds value (in the width the file stores it with)."""
    data = bytearray(src.read_bytes())
    name = key.encode()
    at = data.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
    kind = struct.unpack_from("<I", data, at)[0]
    fmt = {4: "<I", 5: "<i", 10: "<Q", 11: "<q"}[kind]
    struct.pack_into(fmt, data, at + 4, value)
    dst.write_bytes(bytes(data))
