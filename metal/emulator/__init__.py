"""Metal kernel bodies run on the CPU: MLX's generated signature, a C++ shim for the Metal
language, and SIMD groups in lock-step, so kernels are checked where no Mac is at hand."""

from edgeserve.metal.emulator.runner import EmulatedKernel, EmulationError, compiler, metal_kernel

__all__ = ["EmulatedKernel", "EmulationError", "compiler", "metal_kernel"]
