"""The layer contract: every module of edgeserve imports only its own layer and the layers below.

Read from the source's syntax trees, not by importing, so it is fast and sees every import:
module level, inside functions (lazy ones) and under `if TYPE_CHECKING:`. The folders are found
through setup.py's PARTS (models/ is installed as edgeserve.models and so on), which static
import checkers that follow folder names cannot see. ARCHITECTURE.md ("Layers") draws the same list.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Top layer first. A layer holds one or more groups: a module may import its own group and any
# lower layer; groups of one layer are independent (none imports another).
LAYERS: list[tuple[str, list[list[str]]]] = [
    ("commands", [["edgeserve.cli"]]),
    ("front ends and tools", [["edgeserve.server"], ["edgeserve.llm"], ["edgeserve.bench"], ["edgeserve.evaluation"]]),
    ("engine", [["edgeserve.engine", "edgeserve.distributed"]]),
    ("models", [["edgeserve.models"]]),
    ("backends", [["edgeserve.backends", "edgeserve.metal"]]),
    ("formats", [["edgeserve.quant"], ["edgeserve.text"]]),
    ("foundations", [["edgeserve.errors", "edgeserve.units", "edgeserve.system", "edgeserve.config",
                      "edgeserve.sampling_params", "edgeserve.batch"]]),
]
ROOT_PACKAGE = "edgeserve"  # holds nothing; every module imports it implicitly


def package_parts() -> dict[str, str]:
    """setup.py's PARTS (import name -> folder), read from its syntax tree rather than by running it."""
    for node in ast.parse((ROOT / "setup.py").read_text()).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "PARTS" for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError("setup.py defines no PARTS")


def package_sources() -> dict[str, Path]:
    """Every module of the installed package by its import name (a package by its __init__.py)."""
    modules = {}
    for name, folder in package_parts().items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join([name, *parts])] = path
    return modules


def imported_modules(module: str, is_package: bool, source: str, known: set[str]) -> set[str]:
    """The edgeserve modules `source` imports anywhere in its body; `from p import name` counts p.name where that is a module."""
    package = module if is_package else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                found.add(f"{target}.{alias.name}" if f"{target}.{alias.name}" in known else target)
    return {name for name in found if name == ROOT_PACKAGE or name.startswith(ROOT_PACKAGE + ".")}


def place(module: str) -> tuple[int, int] | None:
    """(layer index from the top, group index) of a module, or None where LAYERS does not place it."""
    for layer, (_, groups) in enumerate(LAYERS):
        for group, prefixes in enumerate(groups):
            if any(module == p or module.startswith(p + ".") for p in prefixes):
                return layer, group
    return None


def violations(sources: dict[str, tuple[bool, str]]) -> list[str]:
    """Each import that breaks the contract, and each module no layer holds; sources: name -> (is_package, text)."""
    known = set(sources)
    found = []
    for module, (is_package, source) in sorted(sources.items()):
        if module == ROOT_PACKAGE:
            continue
        here = place(module)
        if here is None:
            found.append(f"{module}: in no layer (add it to LAYERS and ARCHITECTURE.md)")
            continue
        for target in sorted(imported_modules(module, is_package, source, known)):
            there = place(target) if target != ROOT_PACKAGE else (len(LAYERS), 0)
            if there is None:
                found.append(f"{module} imports {target}, which is in no layer")
            elif there[0] < here[0]:
                found.append(f"{module} ({LAYERS[here[0]][0]}) imports {target} ({LAYERS[there[0]][0]}): upward")
            elif there[0] == here[0] and there[1] != here[1]:
                found.append(f"{module} imports {target}: independent groups of the {LAYERS[here[0]][0]} layer")
    return found


def test_every_import_points_down() -> None:
    sources = {name: (path.name == "__init__.py", path.read_text()) for name, path in package_sources().items()}
    assert len(sources) > 50  # the walk found the package
    assert violations(sources) == []


def test_an_upward_import_fails_wherever_it_is() -> None:
    lazy = "def f():\n    from edgeserve.engine.constraints import JSON_OPTIONS\n"
    typing_only = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..engine import kv_pool\n"
    sources = {
        "edgeserve.engine": (True, ""), "edgeserve.engine.constraints": (False, ""),
        "edgeserve.engine.kv_pool": (False, ""),
        "edgeserve.text.tool_calls": (False, lazy),
        "edgeserve.backends.cpu_decoder": (False, typing_only),
        "edgeserve.models.llama": (False, "import edgeserve.backends.base\nfrom edgeserve import errors\n"),
        "edgeserve.backends.base": (False, ""), "edgeserve.errors": (False, ""),
    }
    assert violations(sources) == [
        "edgeserve.backends.cpu_decoder (backends) imports edgeserve.engine.kv_pool (engine): upward",
        "edgeserve.text.tool_calls (formats) imports edgeserve.engine.constraints (engine): upward",
    ]


def test_independent_groups_and_unplaced_modules_fail() -> None:
    sources = {
        "edgeserve.server.app": (False, "from edgeserve.bench import workloads\n"),
        "edgeserve.bench.workloads": (False, ""),
        "edgeserve.plugins": (False, ""),
        "edgeserve.text.tokenizer": (False, "from edgeserve.gadgets import thing\n"),
    }
    assert violations(sources) == [
        "edgeserve.plugins: in no layer (add it to LAYERS and ARCHITECTURE.md)",
        "edgeserve.server.app imports edgeserve.bench.workloads: independent groups of the front ends and tools layer",
        "edgeserve.text.tokenizer imports edgeserve.gadgets, which is in no layer",
    ]


def test_relative_imports_resolve_against_the_package() -> None:
    known = {"edgeserve.models", "edgeserve.models.base", "edgeserve.models.llama", "edgeserve.batch"}
    assert imported_modules("edgeserve.models.llama", False, "from .base import X\nfrom .. import batch\n", known) == {
        "edgeserve.models.base", "edgeserve.batch"}
    assert imported_modules("edgeserve.models", True, "from . import base\n", known) == {"edgeserve.models.base"}
