"""A corpus of damaged copies of a GGUF file, for checking that every one loads cleanly or fails with one clear
line: each integer metadata value of the model's architecture set to 0 and to its type's largest value, tensor
dimensions, types and data offsets rewritten, the header's counts and the vocabulary's length made vast, NaN and
infinity in a norm and in a quantized block's scale, the file cut short at several points, and bytes of the header
flipped at random.

    python bench/corrupt_gguf.py MODEL.gguf OUT_DIR [--flips 22] [--seed 0]
"""

from __future__ import annotations

import random
import struct
from collections.abc import Iterator
from pathlib import Path

import click
import gguf

# GGUF's value types that hold one integer, with their struct formats
INT_FORMATS = {gguf.GGUFValueType.UINT8: "<B", gguf.GGUFValueType.INT8: "<b", gguf.GGUFValueType.UINT16: "<H",
               gguf.GGUFValueType.INT16: "<h", gguf.GGUFValueType.UINT32: "<I", gguf.GGUFValueType.INT32: "<i",
               gguf.GGUFValueType.UINT64: "<Q", gguf.GGUFValueType.INT64: "<q"}


def _extremes(fmt: str) -> list[int]:
    bits = struct.calcsize(fmt) * 8
    return [0, 2 ** (bits - 1) - 1 if fmt[-1].islower() else 2**bits - 1]  # signed formats are lower-case


def corruptions(source: Path, flips: int, seed: int) -> Iterator[tuple[str, bytes]]:
    """(name, bytes) of each damaged copy of source."""
    raw = source.read_bytes()
    reader = gguf.GGUFReader(source)
    arch = str(bytes(reader.fields["general.architecture"].parts[-1]), "utf-8")
    for field in reader.fields.values():
        if not field.name.startswith(arch + ".") or len(field.types) != 1 or field.types[0] not in INT_FORMATS:
            continue
        fmt = INT_FORMATS[field.types[0]]
        offset = int(field.offset) + sum(p.nbytes for p in field.parts[:-1])
        for value in _extremes(fmt):
            data = bytearray(raw)
            struct.pack_into(fmt, data, offset, value)
            yield f"{field.name}={value}", bytes(data)
    for tensor in reader.tensors[:3]:
        field = tensor.field
        dims_at = int(field.offset) + sum(p.nbytes for p in field.parts[:3])
        for value in (0, 2**40):
            data = bytearray(raw)
            struct.pack_into("<Q", data, dims_at, value)
            yield f"{tensor.name}.dim0={value}", bytes(data)
        type_at = dims_at + 8 * len(tensor.shape)
        for value in (int(gguf.GGMLQuantizationType.F32), 999):
            data = bytearray(raw)
            struct.pack_into("<I", data, type_at, value)
            yield f"{tensor.name}.type={value}", bytes(data)
    # the header's counts (after the magic and the version) at their largest
    for name, at in (("tensor_count", 8), ("kv_count", 16)):
        data = bytearray(raw)
        struct.pack_into("<Q", data, at, 2**63 - 1)
        yield f"header.{name}=max", bytes(data)
    # the vocabulary's length, empty and vast (an array field: key length, key, type, element type, length)
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if tokens is not None:
        at = int(tokens.offset) + sum(p.nbytes for p in tokens.parts[:4])
        for value in (0, 2**40):
            data = bytearray(raw)
            struct.pack_into("<Q", data, at, value)
            yield f"tokenizer.ggml.tokens.length={value}", bytes(data)
    # a tensor's data offset past the file's end, and off its alignment
    field = reader.tensors[0].field
    offset_at = int(field.offset) + sum(p.nbytes for p in field.parts[:-1])
    for name, value in (("past-end", len(raw)), ("unaligned", int(field.parts[-1][0]) + 1)):
        data = bytearray(raw)
        struct.pack_into("<Q", data, offset_at, value)
        yield f"{reader.tensors[0].name}.offset={name}", bytes(data)
    # NaN and infinity in a norm's weights and in a quantized tensor's first block scale (a float16 at its start)
    norm = next((t for t in reader.tensors if t.name.endswith("norm.weight")), None)
    quantized = next((t for t in reader.tensors if t.tensor_type not in (gguf.GGMLQuantizationType.F32,
                                                                        gguf.GGMLQuantizationType.F16)), None)
    for tensor, fmt, values in ((norm, "<f", (float("nan"), float("inf"))), (quantized, "<H", (0x7E00, 0x7C00))):
        if tensor is None:
            continue
        for value in values:
            data = bytearray(raw)
            struct.pack_into(fmt, data, int(tensor.data_offset), value)
            label = "nan" if value != value or value == 0x7E00 else "inf"
            yield f"{tensor.name}.first-value={label}", bytes(data)
    for fraction in (0.001, 0.01, 0.5, 0.999):
        yield f"cut-at-{fraction}", raw[: int(len(raw) * fraction)]
    header_end = int(reader.data_offset)
    rng = random.Random(seed)
    for i in range(flips):
        data = bytearray(raw)
        for _ in range(4):
            data[rng.randrange(8, header_end)] = rng.randrange(256)
        yield f"flipped-{i}", bytes(data)


@click.command()
@click.argument("source", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.argument("out_dir", type=click.Path(file_okay=False, path_type=Path))
@click.option("--flips", default=22, show_default=True, help="Copies with random header bytes changed.")
@click.option("--seed", default=0, show_default=True)
def main(source: Path, out_dir: Path, flips: int, seed: int) -> None:
    """Write the damaged copies of SOURCE into OUT_DIR, one file each, named for what was damaged."""
    out_dir.mkdir(parents=True, exist_ok=True)
    count = 0
    for name, data in corruptions(source, flips, seed):
        (out_dir / f"{name.replace('/', '_')}.gguf").write_bytes(data)
        count += 1
    click.echo(f"{count} damaged copies of {source.name} in {out_dir}")


if __name__ == "__main__":
    main()
