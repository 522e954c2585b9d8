"""Paged attention for the MLX backend: custom Metal kernels, their CUDA twins, and the plain-MLX reference."""

from edgeserve.metal.dispatch import ENV_VAR, active_attention_path, mlx_gpu_available, select_attention

__all__ = ["ENV_VAR", "active_attention_path", "mlx_gpu_available", "select_attention"]
