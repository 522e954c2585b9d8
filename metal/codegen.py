"""The Metal and CUDA paged-attention sources, generated from one template per kernel.

A template (`*.kernel`) is the kernel body written once, with a few macros where the two
languages differ: thread indices, SIMD shuffles, the barrier, shared memory, math functions,
vector loads and the load of an int8 pool's float16 scale. Each target gives every macro its text; a function-like macro's `{0}`, `{1}`...
are its arguments, and one that expands to a block takes the place of a statement (the `;` after
it goes). The generated `.metal` and `.cu` files are checked in so they can be read and compiled
as they are; `python -m edgeserve.metal.codegen` rewrites them after a template changes, and
`--check` fails when one is stale.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

HERE = Path(__file__).parent
TEMPLATES = ("paged_attention", "paged_attention_reduce")

METAL = {
    "TARGET_CONSTANTS": "",
    "TG_X": "int(threadgroup_position_in_grid.x)",
    "TG_Y": "int(threadgroup_position_in_grid.y)",
    "TG_Z": "int(threadgroup_position_in_grid.z)",
    "NUM_TG_Z": "int(threadgroups_per_grid.z)",
    "TG_THREAD": "int(thread_index_in_threadgroup)",
    "SIMD_ID": "int(simdgroup_index_in_threadgroup)",
    "SIMD_LANE": "int(thread_index_in_simdgroup)",
    "SHUFFLE_XOR": "simd_shuffle_xor({0}, ushort({1}))",
    "SHARED": "threadgroup",
    "BARRIER": "threadgroup_barrier(mem_flags::mem_threadgroup)",
    "MAX": "metal::max({0}, {1})",
    "EXP": "metal::exp({0})",
    "RSQRT": "metal::rsqrt({0})",
    # Metal has no 8-wide vector type; the loads of one lane are contiguous all the same.
    "LOAD_VEC": "for (int e = 0; e < VEC; ++e) {{\n  {0}[e] = float({1}[{2} + e]);\n}}",
    "LOAD_HALF": "float(*reinterpret_cast<const device half*>({0} + {1}))",
}

CUDA = {
    "TARGET_CONSTANTS": "constexpr unsigned FULL = 0xffffffffu;\nstruct alignas(16) Chunk {\n  T v[VEC];\n};",
    "TG_X": "int(blockIdx.x)",
    "TG_Y": "int(blockIdx.y)",
    "TG_Z": "int(blockIdx.z)",
    "NUM_TG_Z": "int(gridDim.z)",
    "TG_THREAD": "int(threadIdx.x)",
    "SIMD_ID": "int(threadIdx.x) / 32",
    "SIMD_LANE": "int(threadIdx.x) % 32",
    "SHUFFLE_XOR": "__shfl_xor_sync(FULL, {0}, {1})",
    "SHARED": "__shared__",
    "BARRIER": "__syncthreads()",
    "MAX": "fmaxf({0}, {1})",
    "EXP": "expf({0})",
    "RSQRT": "rsqrtf({0})",
    # One 16-byte load per lane.
    "LOAD_VEC": "{{\n  const Chunk chunk = *reinterpret_cast<const Chunk*>({1} + {2});\n"
                "  for (int e = 0; e < VEC; ++e) {{\n    {0}[e] = float(chunk.v[e]);\n  }}\n}}",
    "LOAD_HALF": "float(*reinterpret_cast<const __half*>({0} + {1}))",
}

TARGETS = {"metal": (METAL, "metal", "Metal body for mx.fast.metal_kernel"),
           "cuda": (CUDA, "cu", "CUDA body for mx.fast.cuda_kernel")}

# A macro name, then its arguments: up to one level of nested parentheses.
_MACRO = re.compile(r"\b([A-Z][A-Z0-9_]*)\b(?:\(((?:[^()]|\([^()]*\))*)\))?(;?)")


def _expand_line(line: str, macros: dict[str, str]) -> list[str]:
    indent = line[: len(line) - len(line.lstrip())]

    def expand(match: re.Match[str]) -> str:
        name, args, semicolon = match.group(1), match.group(2), match.group(3)
        if name not in macros:
            return match.group(0)
        text = macros[name] if args is None else macros[name].format(*[a.strip() for a in args.split(",")])
        return text if text.endswith("}") else text + semicolon

    return [indent + part if i else part for i, part in enumerate(_MACRO.sub(expand, line).split("\n"))]


def generate(template: str, target: str) -> str:
    """The source of one kernel for one target ('metal' or 'cuda')."""
    macros, _, what = TARGETS[target]
    lines = [f"// {what}, generated from {template}.kernel by",
             "// `python -m edgeserve.metal.codegen`: edit the template, not this file.", "//"]
    for line in (HERE / f"{template}.kernel").read_text().splitlines():
        expanded = _expand_line(line, macros)
        if any(part.strip() for part in expanded) or not line.strip():  # a macro that expands to nothing leaves no line
            lines += [part.rstrip() for part in expanded]
    return "\n".join(lines) + "\n"


def generated_path(template: str, target: str) -> Path:
    return HERE / f"{template}.{TARGETS[target][1]}"


def stale() -> list[Path]:
    """The generated files whose text differs from what the templates give now."""
    return [generated_path(t, target) for t in TEMPLATES for target in TARGETS
            if not generated_path(t, target).is_file() or generated_path(t, target).read_text() != generate(t, target)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m edgeserve.metal.codegen", description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only report stale files (exit 1 if any)")
    args = parser.parse_args(argv)
    paths = stale()
    if args.check:
        for path in paths:
            print(f"stale: {path.name}")
        return 1 if paths else 0
    for template in TEMPLATES:
        for target in TARGETS:
            generated_path(template, target).write_text(generate(template, target))
    return 0


if __name__ == "__main__":
    sys.exit(main())
