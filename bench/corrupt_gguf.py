"""A corpus of damaged copies of a GGUF file, for checking that every one loads cleanly or fails with one clear
line: each integer metadata value of the model's architecture set to 0 and to its type's largest value, tensor
dimensions and types rewritten, the file cut short at several points, and bytes of the header flipped at random.

    python bench/corrupt_gguf.py MODEL.gguf OUT_DIR [--flips 16] [--seed 0]
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
@click.option("--flips", default=16, show_default=True, help="Copies with random header bytes changed.")
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
