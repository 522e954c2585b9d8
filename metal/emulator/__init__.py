"""Kernel bodies run on the CPU: the source MLX generates around them (`signature`), a C++ shim for
the kernel language, and SIMD groups in lock-step (`runner`), so kernels are checked where no Mac
is at hand. `signature` needs no MLX."""
