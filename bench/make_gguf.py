"""Write Llama-shaped GGUF files with random, well-scaled quantized weights, for benchmarking.

Decode and prefill speed do not depend on the weight values, so a file with the layer shapes and
tensor types of a real 1B, 3B or 8B Llama measures what that model would, without downloading it.
Two other families' shapes are written in their own GGUF architecture: Qwen 3 1.7B (`qwen3`: q and
k head norms, heads of 128 wide) and Phi-3 mini (`phi3`: q/k/v in one `attn_qkv`, gate and up in
one `ffn_up`). Mistral's GGUF files are written as `llama`, so the Llama shapes stand for them.
Quantized blocks are written directly as random bytes with float16 scales chosen so each weight
is roughly N(0, 0.02) with zero mean: activations stay finite through 32 layers and the logits
are spread like a real model's (the text is gibberish). The tokenizer and chat template are
copied from a donor GGUF (the default model's), so edgeserve and llama.cpp both load the files.

Tensor types follow what `llama-quantize` picks for each file type:

- q4_0: every matrix Q4_0, the output head (the embedding when tied) Q6_K;
- q4_k_m: Q4_K, with Q6_K for the output head, and for attn_v and ffn_down in the first and last
  eighth of the layers and every third layer between (llama.cpp's `use_more_bits`); a fused
  attn_qkv is Q5_K;
- q8_0: every matrix Q8_0.

    python bench/make_gguf.py --shape 1b --type q4_0 -o llama-1b-q4_0.gguf
    python bench/make_gguf.py --shape 1b --shape 3b --type q4_0 --type q4_k_m --out-dir models/
    python bench/make_gguf.py --shape qwen3-1.7b --shape phi3-mini --type q4_k_m --out-dir models/
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import click
import gguf
import numpy as np
from gguf import GGMLQuantizationType as QT
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

from edgeserve.models.catalog import DEFAULT_MODEL, pull
from edgeserve.quant.gguf_file import read_gguf


@dataclass(frozen=True)
class Shape:
    """The dimensions of a model of a Llama-like architecture; the vocabulary comes from the donor tokenizer."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    tied: bool  # the output head shares the token embedding (Llama 3.2 1B/3B) or has its own (3.1 8B)
    rope_base: float = 500000.0
    context: int = 8192
    arch: str = "llama"  # GGUF general.architecture: llama, qwen3 or phi3
    head_width: int | None = None  # where heads are not hidden / heads wide (Qwen 3)

    @property
    def head_dim(self) -> int:
        return self.head_width or self.hidden // self.heads


SHAPES = {
    "1b": Shape(hidden=2048, layers=16, heads=32, kv_heads=8, ffn=8192, tied=True),
    "3b": Shape(hidden=3072, layers=28, heads=24, kv_heads=8, ffn=8192, tied=True),
    "8b": Shape(hidden=4096, layers=32, heads=32, kv_heads=8, ffn=14336, tied=False),
    "qwen3-1.7b": Shape(hidden=2048, layers=28, heads=16, kv_heads=8, ffn=6144, tied=True, rope_base=1e6,
                        context=40960, arch="qwen3", head_width=128),
    "phi3-mini": Shape(hidden=3072, layers=32, heads=32, kv_heads=32, ffn=8192, tied=False, rope_base=10000.0,
                       context=4096, arch="phi3"),
}
FILE_TYPES = {"q4_0": gguf.LlamaFileType.MOSTLY_Q4_0, "q4_k_m": gguf.LlamaFileType.MOSTLY_Q4_K_M,
              "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}
TARGET_STD = 0.02  # the spread of each dequantized weight


def use_more_bits(i: int, n: int) -> bool:
    """llama.cpp's rule for which layers of a Q4_K_M file keep attn_v and ffn_down at Q6_K."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def tensor_type(file_type: str, role: str, layer: int, layers: int) -> QT:
    """The GGML type `llama-quantize` gives a matrix of this role ('output', 'embd', 'attn_v', ...)."""
    if file_type == "q8_0":
        return QT.Q8_0
    if role == "output":
        return QT.Q6_K
    if file_type == "q4_0":
        return QT.Q4_0
    if role in ("attn_v", "ffn_down") and use_more_bits(layer, layers):
        return QT.Q6_K
    if role == "attn_qkv":
        return QT.Q5_K
    return QT.Q4_K


def _f16_bytes(value: float) -> tuple[int, int]:
    lo, hi = np.array([value], np.float16).view(np.uint8)
    return int(lo), int(hi)


def random_blocks(rng: np.random.Generator, qtype: QT, rows: int, cols: int) -> np.ndarray:
    """A [rows, row bytes] uint8 array of `qtype` blocks whose weights have mean 0 and std ~TARGET_STD."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    if cols % block:
        raise ValueError(f"{qtype.name} needs rows of a multiple of {block} values, got {cols}")
    n = rows * cols // block
    words = rng.bit_generator.random_raw(-(-n * size // 8))  # raw 64-bit draws: 3x faster than rng.bytes
    b = words.view(np.uint8)[: n * size].reshape(n, size)
    if qtype in (QT.Q4_0, QT.Q8_0):
        # value = d * (q - 8) or d * q with q uniform: a random sign on d cancels the -0.5 mean of q.
        # The low byte of d stays random, a mantissa jitter of up to 25% between blocks.
        std_q = 4.61 if qtype == QT.Q4_0 else 73.9
        _, hi = _f16_bytes(TARGET_STD / std_q)
        b[:, 1] = (b[:, 1] & 0x80) | (hi & 0x7F)
    elif qtype in (QT.Q4_K, QT.Q5_K):
        # d, dmin (f16), 12 bytes of 6-bit sub-block scales and mins, then the quants (Q5_K: 32 bytes
        # of high bits first). Every sub-block gets scale 8 and min 8, and dmin = 7.5 d (15.5 d for
        # Q5_K's 0..31): value = 8 d (q - 7.5) or 8 d (q - 15.5), centred.
        centre, std_q = (7.5, 4.61) if qtype == QT.Q4_K else (15.5, 9.23)
        _, hi = _f16_bytes(TARGET_STD / (8 * std_q))
        b[:, 1] = hi & 0x7F
        d = b[:, 0:2].copy().view(np.float16)[:, 0]
        b[:, 2:4] = (d.astype(np.float32) * centre).astype(np.float16).view(np.uint8).reshape(n, 2)
        b[:, 4:12] = 8
        b[:, 12:16] = 0x88
    elif qtype == QT.Q6_K:
        # ql[128], qh[64], int8 scales[16], d (f16): value = d * scale * (q - 32); scales of +-8
        # with a random sign centre it.
        b[:, 192:208] = np.where(b[:, 192:208] & 0x80, np.uint8(0xF8), np.uint8(0x08))
        _, hi = _f16_bytes(TARGET_STD / (8 * 18.5))
        b[:, 209] = hi & 0x7F
    else:
        raise ValueError(f"no random-block recipe for {qtype.name}")
    return b.reshape(rows, -1)


@dataclass(frozen=True)
class TensorPlan:
    name: str
    rows: int  # output features (GGUF's second dimension)
    cols: int  # input features, contiguous
    qtype: QT

    @property
    def nbytes(self) -> int:
        block, size = gguf.GGML_QUANT_SIZES[self.qtype]
        return self.rows * self.cols // block * size


def plan(shape: Shape, file_type: str, vocab: int) -> list[TensorPlan]:
    """Every tensor of the file in llama.cpp's order, with its type."""
    if file_type not in FILE_TYPES:
        raise ValueError(f"unknown file type {file_type!r}; one of {', '.join(FILE_TYPES)}")
    h, q, kv, n = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim, shape.layers
    embd_role = "output" if shape.tied else "embd"
    out = [TensorPlan("token_embd.weight", vocab, h, tensor_type(file_type, embd_role, 0, n))]
    for i in range(n):
        p = f"blk.{i}."

        def matrix(role: str, rows: int, cols: int) -> TensorPlan:
            return TensorPlan(f"{p}{role}.weight", rows, cols, tensor_type(file_type, role, i, n))

        if shape.arch == "phi3":
            attention = [matrix("attn_qkv", q + 2 * kv, h)]
            ffn = [matrix("ffn_up", 2 * shape.ffn, h)]  # gate and up, one after the other
        else:
            attention = [matrix("attn_q", q, h), matrix("attn_k", kv, h), matrix("attn_v", kv, h)]
            ffn = [matrix("ffn_gate", shape.ffn, h), matrix("ffn_up", shape.ffn, h)]
        if shape.arch == "qwen3":
            attention += [TensorPlan(p + "attn_q_norm.weight", 1, shape.head_dim, QT.F32),
                          TensorPlan(p + "attn_k_norm.weight", 1, shape.head_dim, QT.F32)]
        out += [TensorPlan(p + "attn_norm.weight", 1, h, QT.F32), *attention, matrix("attn_output", h, q),
                TensorPlan(p + "ffn_norm.weight", 1, h, QT.F32), *ffn, matrix("ffn_down", h, shape.ffn)]
    out.append(TensorPlan("output_norm.weight", 1, h, QT.F32))
    if not shape.tied:
        out.append(TensorPlan("output.weight", vocab, h, tensor_type(file_type, "output", n, n)))
    return out


# GGUF's tokenizer keys hold token ids as UINT32, token types as INT32 and scores as FLOAT32.
_SCALAR_TYPES = {bool: gguf.GGUFValueType.BOOL, int: gguf.GGUFValueType.UINT32,
                 float: gguf.GGUFValueType.FLOAT32, str: gguf.GGUFValueType.STRING}
_ITEM_TYPES = {**_SCALAR_TYPES, int: gguf.GGUFValueType.INT32}


@lru_cache(maxsize=4)
def donor_tokenizer(donor: Path) -> tuple[tuple[str, Any], ...]:
    """Every tokenizer.* key of a GGUF (vocabulary, merges, special ids, chat template), read once."""
    metadata = read_gguf(donor).metadata
    keys = tuple((k, v) for k, v in metadata.items() if k.startswith("tokenizer."))
    if not metadata.get("tokenizer.ggml.tokens"):
        raise click.ClickException(f"{donor} has no tokenizer.ggml.tokens to copy")
    return keys


def _copy_tokenizer(writer: gguf.GGUFWriter, donor: Path) -> None:
    """Add the donor's tokenizer keys to the writer."""
    for key, value in donor_tokenizer(Path(donor)):
        if isinstance(value, list):
            item = _ITEM_TYPES[type(value[0])] if value else gguf.GGUFValueType.INT32
            writer.add_key_value(key, value, gguf.GGUFValueType.ARRAY, sub_type=item)
        else:
            writer.add_key_value(key, value, _SCALAR_TYPES[type(value)])


def write_model(path: Path, shape: Shape, file_type: str, donor: Path, *, name: str = "random llama",
                seed: int = 0, progress: Progress | None = None) -> int:
    """Write one GGUF file (atomically: a half-written file never has the final name); returns its size."""
    path = Path(path)
    tmp = path.with_name(path.name + ".partial")
    vocab = len(dict(donor_tokenizer(Path(donor)))["tokenizer.ggml.tokens"])
    tensors = plan(shape, file_type, vocab)
    writer = gguf.GGUFWriter(tmp, shape.arch)
    writer.add_name(name)
    writer.add_file_type(int(FILE_TYPES[file_type]))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    _copy_tokenizer(writer, donor)
    writer.add_vocab_size(vocab)
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_block_count(shape.layers)
    writer.add_feed_forward_length(shape.ffn)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_dimension_count(shape.head_dim)
    if shape.head_width is not None:
        writer.add_key_length(shape.head_dim)
        writer.add_value_length(shape.head_dim)
    writer.add_rope_freq_base(shape.rope_base)
    writer.add_layer_norm_rms_eps(1e-5)

    for t in tensors:
        if t.qtype == QT.F32:
            writer.add_tensor_info(t.name, (t.cols,), np.dtype(np.float32), t.nbytes)
        else:
            writer.add_tensor_info(t.name, (t.rows, t.nbytes // t.rows), np.dtype(np.uint8), t.nbytes, raw_dtype=t.qtype)
    rng = np.random.default_rng(seed)
    task = progress.add_task(path.name, total=sum(t.nbytes for t in tensors)) if progress else None
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for t in tensors:
            data = (np.ones(t.cols, np.float32) if t.qtype == QT.F32
                    else random_blocks(rng, t.qtype, t.rows, t.cols))
            writer.write_tensor_data(data)
            if progress is not None and task is not None:
                progress.advance(task, t.nbytes)
        writer.close()
        os.replace(tmp, path)
    finally:
        writer.close()
        tmp.unlink(missing_ok=True)
    return path.stat().st_size


@click.command()
@click.option("--shape", "shapes", multiple=True, type=click.Choice(sorted(SHAPES)), required=True,
              help="Model shape; repeat with --type to write several files.")
@click.option("--type", "types", multiple=True, type=click.Choice(sorted(FILE_TYPES)), required=True,
              help="File type; each --shape is written in each --type.")
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Output file (one shape and one type only).")
@click.option("--out-dir", type=click.Path(file_okay=False, path_type=Path), default=Path("."), show_default=True,
              help="Folder for files named llama-<shape>-<type>.gguf (or <family shape>-<type>.gguf).")
@click.option("--tokenizer", "donor", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="GGUF to copy the tokenizer and chat template from [default: the default model's].")
@click.option("--seed", type=int, default=0, show_default=True)
def main(shapes: tuple[str, ...], types: tuple[str, ...], output: Path | None, out_dir: Path,
         donor: Path | None, seed: int) -> None:
    """Write random-weight GGUF files of Llama, Qwen 3 and Phi-3 shapes for benchmarking."""
    jobs = [(s, t) for s in dict.fromkeys(shapes) for t in dict.fromkeys(types)]
    if output is not None and len(jobs) != 1:
        raise click.UsageError("-o names one file: give one --shape and one --type, or use --out-dir")
    donor = donor or pull(DEFAULT_MODEL)
    out_dir.mkdir(parents=True, exist_ok=True)
    columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TimeRemainingColumn())
    with Progress(*columns) as progress:
        for s, t in jobs:
            stem = s if "-" in s else f"llama-{s}"  # family-named shapes carry their family
            path = output or out_dir / f"{stem}-{t}.gguf"
            # llama.cpp reads a name holding "phi3" as Phi-3's own vocabulary and looks up its special
            # tokens, which the donor's vocabulary lacks
            name = f"random {stem} {t}".replace("phi3", "phi")
            size = write_model(path, SHAPES[s], t, donor, name=name, seed=seed,
                               progress=progress)
            progress.console.print(f"{path}  {size / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
