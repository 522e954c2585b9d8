"""mx.fast.metal_kernel's and mx.fast.cuda_kernel's interface, run on the CPU: each call writes the
source MLX would compile, builds it against the language's C++ shim with the system compiler,
and runs the grid with the lanes of each SIMD group in lock-step."""

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
    CUDA_TYPE_NAMES,
    TYPE_NAMES,
    ArrayInfo,
    TemplateArg,
    attributes,
    cuda_kernel_name,
    cuda_kernel_source,
    metal_kernel_name,
    metal_kernel_source,
    shape_infos,
    template_definition,
)

SHIMS = Path(__file__).parent
COMPILE_FLAGS = ["-std=c++20", "-O1", "-w"]
# NumPy holds bfloat16 as its bits.
STORAGE = {"bfloat16": np.uint16, "float16": np.float16, "float32": np.float32}

Template = list[tuple[str, "int | bool | mx.Dtype"]]


class EmulationError(EdgeserveError):
    """The kernel did not compile, or a run aborted (a lane skipped a shuffle or a barrier)."""


def compiler() -> str | None:
    """The C++ compiler the emulation builds with: $CXX, else g++ or c++ on the PATH."""
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


@cache
def _work_folder() -> tempfile.TemporaryDirectory:
    """Where programs are built and run: one folder per process, removed at exit."""
    return tempfile.TemporaryDirectory(prefix="kernel-emulation-")


@cache
def _build(program: str) -> Path:
    """The executable of one program (a kernel instantiation and its main), compiled once."""
    cxx = compiler()
    if cxx is None:
        raise EmulationError("no C++ compiler found (set CXX or install g++)")
    work = Path(_work_folder().name)
    key = hashlib.sha256(program.encode()).hexdigest()[:16]
    src, exe = work / f"{key}.cpp", work / key
    src.write_text(program)
    done = subprocess.run([cxx, *COMPILE_FLAGS, "-I", str(SHIMS), str(src), "-o", str(exe)],
                          capture_output=True, text=True, check=False)
    if done.returncode:
        raise EmulationError(f"the kernel did not compile ({src}):\n{done.stderr}")
    return exe


def _dtype_name(dtype: mx.Dtype) -> str:
    return str(dtype).removeprefix("mlx.core.")


def _to_numpy(a: mx.array) -> np.ndarray:
    return np.ascontiguousarray(np.array(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a))


def _from_bytes(data: bytes, shape: tuple[int, ...], dtype: mx.Dtype) -> mx.array:
    name = _dtype_name(dtype)
    out = mx.array(np.frombuffer(data, STORAGE[name] if name in STORAGE else np.dtype(name)).reshape(shape))
    return out.view(mx.bfloat16) if dtype == mx.bfloat16 else out


class EmulatedKernel:
    """A kernel body for one language ('metal' or 'cuda'), callable like the object MLX returns."""

    def __init__(self, language: str, name: str, input_names: list[str], output_names: list[str], source: str,
                 header: str = ""):
        self.language, self.name = language, name
        self.input_names, self.output_names, self.source, self.header = input_names, output_names, source, header
        self.inputs_after: list[mx.array] = []  # the last call's inputs as the kernel left them

    def _describe(self, inputs: list[mx.array], output_dtypes: list[mx.Dtype], template: Template):
        """What the generated source depends on, with dtypes by their MLX names."""
        return ([ArrayInfo(_dtype_name(a.dtype), a.ndim, a.size) for a in inputs], [_dtype_name(d) for d in output_dtypes],
                [(n, _dtype_name(v) if isinstance(v, mx.Dtype) else v) for n, v in template])

    def generated_source(self, inputs: list[mx.array], output_dtypes: list[mx.Dtype], template: Template) -> str:
        """The source MLX would compile for these inputs (what its verbose=True prints), less its header."""
        write = metal_kernel_source if self.language == "metal" else cuda_kernel_source
        return write(self.name, self.input_names, self.output_names, self.source,
                     *self._describe(inputs, output_dtypes, template), self.header)

    def _main(self, inputs: list[ArrayInfo], output_dtypes: list[str], template: list[TemplateArg]) -> str:
        """A main() that loads the buffers, runs the grid and saves the outputs."""
        metal = self.language == "metal"
        types = TYPE_NAMES if metal else CUDA_TYPE_NAMES
        lines = ["int main(int, char** argv) {", "  emu::Launch launch(argv[1]);",
                 "  const emu::uint3 grid = launch.dims();", "  const emu::uint3 tg = launch.dims();"]
        args = []
        for i, (info, shape) in enumerate(zip(inputs, shape_infos(self.source, self.input_names))):
            lines.append(f"  emu::Input in{i} = launch.input({i});")
            pointer = f"reinterpret_cast<const {types[info.dtype]}*>(in{i}.data.data())"
            args.append(f"*{pointer}" if info.ndim == 0 else pointer)
            if info.ndim > 0:
                args += [f"in{i}.{'shape.data()' if metal else 'padded_shape()'}"] if shape.shape else []
                args += [f"in{i}.{'strides.data()' if metal else 'padded_strides()'}"] if shape.strides else []
                args += [f"in{i}.ndim"] if shape.ndim else []
        for i, dtype in enumerate(output_dtypes):
            lines.append(f"  std::vector<char> out{i} = launch.output();")
            args.append(f"reinterpret_cast<{types[dtype]}*>(out{i}.data())")
        if metal:
            func = metal_kernel_name(self.name, template, inputs, output_dtypes) + (
                template_definition(template) if template else "")
            args += [f"a.{attr}" for attr in attributes(self.source)]
        else:
            func = "mlx::core::cu::" + cuda_kernel_name(self.name, template)
        lines.append(f"  emu::dispatch(grid, tg, [&](const emu::Attributes& a) {{ {func}({', '.join(args)}); }});")
        lines += [f"  launch.save({i}, out{i});" for i in range(len(output_dtypes))]
        # then the inputs as the kernel left them (one that writes through an input's pointer changed it)
        lines += [f"  launch.save({len(output_dtypes) + i}, in{i}.data);" for i in range(len(inputs))]
        return "\n".join([*lines, "  return 0;", "}"]) + "\n"

    def __call__(
        self,
        *,
        inputs: list[mx.array],
        output_shapes: list[tuple[int, ...]],
        output_dtypes: list[mx.Dtype],
        grid: tuple[int, int, int],
        threadgroup: tuple[int, int, int],
        template: Template = (),
    ) -> list[mx.array]:
        if any(g % t for g, t in zip(grid, threadgroup)):
            raise EmulationError(f"grid {grid} is not a whole number of threadgroups {threadgroup}")
        shim = "metal_shim.h" if self.language == "metal" else "cuda_shim.h"
        program = (f'#include "launch.h"\n#include "{shim}"\n' + self.generated_source(inputs, output_dtypes, template)
                   + self._main(*self._describe(inputs, output_dtypes, template)))
        exe = _build(program)
        run_dir = Path(tempfile.mkdtemp(dir=_work_folder().name))
        launch = [*grid, *threadgroup]
        for i, a in enumerate(inputs):
            data = _to_numpy(a)
            (run_dir / f"in{i}.bin").write_bytes(data.tobytes())
            launch += [a.ndim, *a.shape, *(s // data.itemsize for s in data.strides)]
        launch += [int(np.prod(s)) * d.size for s, d in zip(output_shapes, output_dtypes)]
        (run_dir / "launch.txt").write_text(" ".join(map(str, launch)))
        done = subprocess.run([str(exe), str(run_dir)], capture_output=True, text=True, check=False)
        if done.returncode:
            raise EmulationError(f"{self.name} aborted (exit {done.returncode}): {done.stderr.strip()}")
        outputs = [_from_bytes((run_dir / f"out{i}.bin").read_bytes(), tuple(s), d)
                   for i, (s, d) in enumerate(zip(output_shapes, output_dtypes))]
        self.inputs_after = [_from_bytes((run_dir / f"out{len(outputs) + i}.bin").read_bytes(), a.shape, a.dtype)
                             for i, a in enumerate(inputs)]
        shutil.rmtree(run_dir)
        return outputs


def metal_kernel(name: str, input_names: list[str], output_names: list[str], source: str, header: str = "") -> EmulatedKernel:
    """Like mx.fast.metal_kernel, run on the CPU."""
    return EmulatedKernel("metal", name, input_names, output_names, source, header)


def cuda_kernel(name: str, input_names: list[str], output_names: list[str], source: str, header: str = "",
                ensure_row_contiguous: bool = True) -> EmulatedKernel:
    """Like mx.fast.cuda_kernel, run on the CPU (inputs are always passed contiguous, with their strides)."""
    return EmulatedKernel("cuda", name, input_names, output_names, source, header)
