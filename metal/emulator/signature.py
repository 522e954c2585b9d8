"""The source MLX compiles around a kernel body: for mx.fast.metal_kernel its write_signature,
write_template and kernel naming (mlx/backend/common/metal_kernel.cpp), for mx.fast.cuda_kernel
its build_kernel (mlx/backend/cuda/custom_kernel.cpp), line for line in Python. The headers MLX
puts first are left out: the emulation puts its shims there."""

from __future__ import annotations

from dataclasses import dataclass

# Inputs with fewer elements are bound in the constant address space.
MAX_CONSTANT_ARRAY_SIZE = 8

# Every attribute variable MLX declares when the body mentions its name, in MLX's order.
METAL_ATTRIBUTES = (
    ("dispatch_quadgroups_per_threadgroup", "uint"),
    ("dispatch_simdgroups_per_threadgroup", "uint"),
    ("dispatch_threads_per_threadgroup", "uint3"),
    ("grid_origin", "uint3"),
    ("grid_size", "uint3"),
    ("quadgroup_index_in_threadgroup", "uint"),
    ("quadgroups_per_threadgroup", "uint"),
    ("simdgroup_index_in_threadgroup", "uint"),
    ("simdgroups_per_threadgroup", "uint"),
    ("thread_execution_width", "uint"),
    ("thread_index_in_quadgroup", "uint"),
    ("thread_index_in_simdgroup", "uint"),
    ("thread_index_in_threadgroup", "uint"),
    ("thread_position_in_grid", "uint3"),
    ("thread_position_in_threadgroup", "uint3"),
    ("threadgroup_position_in_grid", "uint3"),
    ("threadgroups_per_grid", "uint3"),
    ("threads_per_grid", "uint3"),
    ("threads_per_simdgroup", "uint"),
    ("threads_per_threadgroup", "uint3"),
)

TYPE_NAMES = {
    "float32": "float",
    "float16": "float16_t",
    "bfloat16": "bfloat16_t",
    "float64": "double",
    "bool": "bool",
    "int8": "int8_t",
    "int16": "int16_t",
    "int32": "int32_t",
    "int64": "int64_t",
    "uint8": "uint8_t",
    "uint16": "uint16_t",
    "uint32": "uint32_t",
    "uint64": "uint64_t",
}

TemplateArg = tuple[str, "int | bool | str"]  # a dtype template argument is its MLX name, e.g. "float16"


@dataclass(frozen=True)
class ArrayInfo:
    """What the generated source depends on for one input: its dtype, rank and size."""

    dtype: str  # MLX dtype name, e.g. "float16"
    ndim: int
    size: int


@dataclass(frozen=True)
class ShapeInfo:
    """Which of `<name>_shape`, `_strides`, `_ndim` the body mentions."""

    shape: bool
    strides: bool
    ndim: bool


def shape_infos(source: str, input_names: list[str]) -> list[ShapeInfo]:
    return [ShapeInfo(f"{n}_shape" in source, f"{n}_strides" in source, f"{n}_ndim" in source) for n in input_names]


def attributes(source: str) -> list[str]:
    """The attribute variables the body mentions (MLX looks for each name as a substring)."""
    return [name for name, _ in METAL_ATTRIBUTES if name in source]


def _template_value(arg: int | bool | str) -> str:
    if isinstance(arg, bool):
        return str(int(arg))
    if isinstance(arg, int):
        return str(arg)
    return TYPE_NAMES[arg]


def template_definition(template: list[TemplateArg]) -> str:
    """MLX's write_template: `<float16_t, 64, ...>`."""
    return "<" + ", ".join(_template_value(arg) for _, arg in template) + ">"


def metal_kernel_name(name: str, template: list[TemplateArg], inputs: list[ArrayInfo], output_dtypes: list[str]) -> str:
    """The host name MLX gives one instantiation: template values and input/output types in the name."""
    kernel = "custom_kernel_" + name
    if template:
        kernel += "_" + template_definition(template).replace(", ", "_").replace("<", "_").replace(">", "_")[:-1]
    for info in inputs:
        kernel += "_" + TYPE_NAMES[info.dtype]
        if info.ndim == 0:
            kernel += "s"
        elif info.size < MAX_CONSTANT_ARRAY_SIZE:
            kernel += "c"
    for dtype in output_dtypes:
        kernel += "_" + TYPE_NAMES[dtype]
    return kernel


def metal_kernel_source(
    name: str,
    input_names: list[str],
    output_names: list[str],
    source: str,
    inputs: list[ArrayInfo],
    output_dtypes: list[str],
    template: list[TemplateArg],
    header: str = "",
) -> str:
    """The Metal source of one instantiation: the signature around `source`, then the explicit
    instantiation under its host name."""
    func = metal_kernel_name(name, template, inputs, output_dtypes)
    infos = shape_infos(source, input_names)
    attrs = attributes(source)
    text = header
    if template:
        kinds = ["bool" if isinstance(a, bool) else "int" if isinstance(a, int) else "typename" for _, a in template]
        text += "template <" + ", ".join(f"{kind} {n}" for kind, (n, _) in zip(kinds, template)) + ">\n"
    text += f"[[kernel]] void {func}(\n"
    index = 0
    for input_name, info, shape in zip(input_names, inputs, infos):
        location = "constant" if info.size < MAX_CONSTANT_ARRAY_SIZE else "device"
        ref = "&" if info.ndim == 0 else "*"
        text += f"  const {location} {TYPE_NAMES[info.dtype]}{ref} {input_name} [[buffer({index})]],\n"
        index += 1
        if info.ndim > 0:
            for wanted, suffix, kind in ((shape.shape, "shape", "int*"), (shape.strides, "strides", "int64_t*"),
                                         (shape.ndim, "ndim", "int&")):
                if wanted:
                    text += f"  const constant {kind} {input_name}_{suffix} [[buffer({index})]],\n"
                    index += 1
    for output_name, dtype in zip(output_names, output_dtypes):
        text += f"  device {TYPE_NAMES[dtype]}* {output_name} [[buffer({index})]]"
        text += ",\n" if index < len(inputs) + len(output_names) - 1 or attrs else ") {\n"
        index += 1
    kinds = dict(METAL_ATTRIBUTES)
    text += ",\n".join(f"  {kinds[a]} {a} [[{a}]]" for a in attrs) + (") {\n" if attrs else "")
    text += source + "\n}\n"
    if template:
        definition = func + template_definition(template)
        text += f'\ntemplate [[host_name("{func}")]] [[kernel]] decltype({definition}) {definition};\n'
    return text


CUDA_TYPE_NAMES = {**TYPE_NAMES, "float16": "__half", "bfloat16": "__nv_bfloat16"}


def cuda_kernel_name(name: str, template: list[TemplateArg]) -> str:
    """MLX's name for one CUDA instantiation: template values appended."""
    suffix = "".join("_" + ("t" if a else "f") if isinstance(a, bool) else f"_{a}" if isinstance(a, int)
                     else "_" + TYPE_NAMES[a] for _, a in template)
    return "custom_kernel_" + name + suffix


def cuda_kernel_source(
    name: str,
    input_names: list[str],
    output_names: list[str],
    source: str,
    inputs: list[ArrayInfo],
    output_dtypes: list[str],
    template: list[TemplateArg],
    header: str = "",
) -> str:
    """The CUDA source of one instantiation: a __global__ function in mlx::core::cu whose template
    arguments are constants at the top of the body."""
    text = header + "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n"
    text += f"__global__ void {cuda_kernel_name(name, template)}(\n"
    for input_name, info, shape in zip(input_names, inputs, shape_infos(source, input_names)):
        text += f"    const {CUDA_TYPE_NAMES[info.dtype]}* {input_name},\n"
        if info.ndim > 0:
            for wanted, suffix, kind in ((shape.shape, "shape", "Shape"), (shape.strides, "strides", "Strides"),
                                         (shape.ndim, "ndim", "int")):
                if wanted:
                    text += f"    const __grid_constant__ {kind} {input_name}_{suffix},\n"
    for i, (output_name, dtype) in enumerate(zip(output_names, output_dtypes)):
        text += f"    {CUDA_TYPE_NAMES[dtype]}* {output_name}" + (",\n" if i < len(output_names) - 1 else ") {\n")
    for constant, arg in template:
        if isinstance(arg, bool):
            text += f"  constexpr bool {constant} = {str(arg).lower()};\n"
        elif isinstance(arg, int):
            text += f"  constexpr int {constant} = {arg};\n"
        else:
            text += f"  using {constant} = {CUDA_TYPE_NAMES[arg]};\n"
    if template:
        text += "\n"
    return text + source + "\n}\n\n} // namespace mlx::core::cu\n"
