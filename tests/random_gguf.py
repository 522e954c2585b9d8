"""bench/make_gguf.py for tests: tiny Llama-shaped GGUF files with random quantized weights."""

import importlib.util
import sys
from pathlib import Path

SCRIPT = Path(__file__).parents[1] / "bench" / "make_gguf.py"
_spec = importlib.util.spec_from_file_location("make_gguf", SCRIPT)
make_gguf = importlib.util.module_from_spec(_spec)
sys.modules["make_gguf"] = make_gguf  # dataclasses look their module up there
_spec.loader.exec_module(make_gguf)

# the 1B family's proportions (GQA 2:1 here, untied head), small enough to write and run in a second
TINY = make_gguf.Shape(hidden=256, layers=8, heads=4, kv_heads=2, ffn=512, tied=False)


def write_tiny(path: Path, file_type: str, donor: Path, seed: int = 3) -> Path:
    """A TINY-shaped file of `file_type` with the donor GGUF's tokenizer."""
    make_gguf.write_model(path, TINY, file_type, donor, seed=seed)
    return path
