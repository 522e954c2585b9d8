"""The scripts of bench/ as modules for tests, and tiny GGUF files from bench/make_gguf.py."""

import importlib.util
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
