"""Package discovery for the top-level folders and the optional C kernels; every other setting lives in pyproject.toml."""

import sys

from setuptools import Extension, find_packages, setup

# Each top-level folder is one part of the project, installed as a subpackage of `edgeserve`.
# setuptools' automatic discovery cannot put a prefix on a folder's name, so it runs per folder here.
PARTS = {
    "edgeserve": "edgeserve",
    "edgeserve.models": "models",
    "edgeserve.quant": "quant",
    "edgeserve.metal": "metal",
    "edgeserve.cli": "cli",
}


def discover_packages() -> list[str]:
    """Every package under each part, by its installed name."""
    return [f"{name}.{sub}" if sub else name for name, folder in PARTS.items()
            for sub in ["", *find_packages(where=folder)]]


# The quantized matmul kernels and fused CPU ops pick their instruction set at run time, so they are compiled
# without -march flags and a wheel runs on any CPU of its architecture. optional=True: where no
# compiler is found the install still succeeds and edgeserve runs its numba kernels instead.
UNIX = sys.platform != "win32"
QMATMUL = Extension(
    "edgeserve.backends._qmatmul",
    sources=["edgeserve/backends/_qmatmul.c", "edgeserve/backends/_cpu_ops.c",
             "edgeserve/backends/_decoder.c", "edgeserve/backends/_pool.c", "edgeserve/backends/_logits.c"],
    depends=["edgeserve/backends/_qmatmul.h", "edgeserve/backends/_pool.h", "edgeserve/backends/_vmath.h"],
    extra_compile_args=["-O3", "-std=c11", "-pthread", "-fno-trapping-math"] if UNIX else ["/O2"],
    extra_link_args=["-pthread"] if UNIX else [],
    optional=True,
)

setup(packages=discover_packages(), package_dir=PARTS, ext_modules=[QMATMUL])
