"""Package discovery for the top-level folders; every other setting lives in pyproject.toml."""

from setuptools import find_packages, setup

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


setup(packages=discover_packages(), package_dir=PARTS)
