"""mx.fast.metal_kernel's interface, run on the CPU: each call writes the Metal source MLX would
compile, builds it against the C++ shim with the system compiler, and runs the grid."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

import mlx.core as mx
import numpy as np

from edgeserve.errors import EdgeserveError
from edgeserve.metal.emulator.signature import (
    TYPE_NAMES,
    ArrayInfo,
    TemplateArg,
    attributes,
    kernel_name,
    kernel_source,
    shape_infos,
    template_definition,
)

SHIM = Path(__file__).parent
COMPILE_FLAGS = ["-std=c++20", "-O1", "-w", "-U_FORTIFY_SOURCE"]
# NumPy holds bfloat16 as its bits.
STORAGE = {"bfloat16": np.uint16, "float16": np.float16, "float32": np.float32}


class EmulationError(EdgeserveError):
    """The kernel did not compile, or a run aborted (a lane skipped a shuffle or a barrier)."""


@cache
def _work_dir() -> Path:
    """Where programs are built and run: one folder per process, removed at exit."""
    return Path(_work_folder().name)


@cache
def _work_folder() -> tempfile.TemporaryDirectory:
    return tempfile.TemporaryDirectory(prefix="metal-emulation-")


@cache
def _build(program: str) -> Path:
    """The executable of one program (a kernel instantiation and its main), compiled once."""
    cxx = compiler()
    if cxx is None:
        raise EmulationError("no C++ compiler found (set CXX or install g++)")
    key = hashlib.sha256(program.encode()).hexdigest()[:16]
    src, exe = _work_dir() / f"{key}.cpp", _work_dir() / key
    src.write_text(program)
    done = subprocess.run([cxx, *COMPILE_FLAGS, "-I", str(SHIM), str(src), "-o", str(exe)], capture_output=True, text=True)
    if done.returncode:
        raise EmulationError(f"the kernel did not compile ({src}):\n{done.stderr}")
    return exe


def compiler() -> str | None:
    """The C++ compiler the emulation builds with: $CXX, else g++ or c++ on the PATH."""
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


def _dtype_name(dtype: mx.Dtype) -> str:
    return str(dtype).removeprefix("mlx.core.")


def _to_numpy(a: mx.array) -> np.ndarray:
    if a.dtype == mx.bfloat16:
        a = a.view(mx.uint16)
    return np.ascontiguousarray(np.array(a))


def _from_numpy(data: bytes, shape: tuple[int, ...], dtype: mx.Dtype) -> mx.array:
    name = _dtype_name(dtype)
    out = mx.array(np.frombuffer(data, STORAGE[name] if name in STORAGE else np.dtype(name)).reshape(shape))
    return out.view(mx.bfloat16) if dtype == mx.bfloat16 else out


def _describe(
    inputs: list[mx.array], output_dtypes: list[mx.Dtype], template: list[tuple[str, int | bool | mx.Dtype]]
) -> tuple[list[ArrayInfo], list[str], list[TemplateArg]]:
    """What the generated source depends on, with dtypes by their MLX names."""
    return ([ArrayInfo(_dtype_name(a.dtype), a.ndim, a.size) for a in inputs], [_dtype_name(d) for d in output_dtypes],
            [(n, _dtype_name(v) if isinstance(v, mx.Dtype) else v) for n, v in template])


class EmulatedKernel:
    """A Metal kernel body, callable like the object mx.fast.metal_kernel returns."""

    def __init__(self, name: str, input_names: list[str], output_names: list[str], source: str, header: str = ""):
        self.name, self.input_names, self.output_names = name, input_names, output_names
        self.source, self.header = source, header

    def metal_source(
        self, inputs: list[mx.array], output_dtypes: list[mx.Dtype], template: list[tuple[str, int | bool | mx.Dtype]]
    ) -> str:
        """The source mx.fast.metal_kernel would compile for these inputs (what its verbose=True prints)."""
        return kernel_source(self.name, self.input_names, self.output_names, self.source, *_describe(inputs, output_dtypes,
                                                                                                     template), self.header)

    def _main(self, inputs: list[ArrayInfo], output_dtypes: list[str], template: list[TemplateArg]) -> str:
        """A main() that loads the buffers, runs the grid and saves the outputs."""
        lines = ["int main(int, char** argv) {", "  emu::Launch launch(argv[1]);",
                 "  const uint3 grid = launch.dims();", "  const uint3 tg = launch.dims();"]
        args = []
        for i, (info, shape) in enumerate(zip(inputs, shape_infos(self.source, self.input_names))):
            lines += [f"  std::vector<int> shape{i};", f"  std::vector<int64_t> strides{i};", f"  int ndim{i};",
                      f"  const std::vector<char> in{i} = launch.input({i}, shape{i}, strides{i}, ndim{i});"]
            pointer = f"reinterpret_cast<const {TYPE_NAMES[info.dtype]}*>(in{i}.data())"
            args.append(f"*{pointer}" if info.ndim == 0 else pointer)
            if info.ndim > 0:
                args += [f"{part}{i}.data()" for part, wanted in (("shape", shape.shape), ("strides", shape.strides))
                         if wanted]
                args += [f"ndim{i}"] if shape.ndim else []
        for i, dtype in enumerate(output_dtypes):
            lines.append(f"  std::vector<char> out{i} = launch.output();")
            args.append(f"reinterpret_cast<{TYPE_NAMES[dtype]}*>(out{i}.data())")
        args += [f"a.{attr}" for attr in attributes(self.source)]
        func = kernel_name(self.name, template, inputs, output_dtypes) + (template_definition(template) if template else "")
        lines.append(f"  emu::dispatch(grid, tg, [&](const emu::Attributes& a) {{ {func}({', '.join(args)}); }});")
        lines += [f"  launch.save({i}, out{i});" for i in range(len(output_dtypes))]
        lines += ["  return 0;", "}"]
        return "\n".join(lines) + "\n"

    def __call__(
        self,
        *,
        inputs: list[mx.array],
        output_shapes: list[tuple[int, ...]],
        output_dtypes: list[mx.Dtype],
        grid: tuple[int, int, int],
        threadgroup: tuple[int, int, int],
        template: list[tuple[str, int | bool | mx.Dtype]] = (),
    ) -> list[mx.array]:
        if any(g % t for g, t in zip(grid, threadgroup)):
            raise EmulationError(f"grid {grid} is not a whole number of threadgroups {threadgroup}")
        infos, out_names, names = _describe(inputs, output_dtypes, template)
        program = ('#include "launch.h"\n' + self.metal_source(inputs, output_dtypes, template)
                   + self._main(infos, out_names, names))
        exe = _build(program)
        run_dir = Path(tempfile.mkdtemp(dir=_work_dir()))
        launch = [*grid, *threadgroup]
        for i, a in enumerate(inputs):
            data = _to_numpy(a)
            (run_dir / f"in{i}.bin").write_bytes(data.tobytes())
            launch += [a.ndim, *a.shape, *(s // data.itemsize for s in data.strides)]
        launch += [int(np.prod(s)) * d.size for s, d in zip(output_shapes, output_dtypes)]
        (run_dir / "launch.txt").write_text(" ".join(map(str, launch)))
        done = subprocess.run([str(exe), str(run_dir)], capture_output=True, text=True)
        if done.returncode:
            raise EmulationError(f"{self.name} aborted (exit {done.returncode}): {done.stderr.strip()}")
        outputs = [_from_numpy((run_dir / f"out{i}.bin").read_bytes(), tuple(s), d)
                   for i, (s, d) in enumerate(zip(output_shapes, output_dtypes))]
        shutil.rmtree(run_dir)
        return outputs


def metal_kernel(name: str, input_names: list[str], output_names: list[str], source: str, header: str = "") -> EmulatedKernel:
    """Like mx.fast.metal_kernel, for the CPU emulation."""
    return EmulatedKernel(name, input_names, output_names, source, header)
