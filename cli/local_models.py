"""The models on this machine: pulled catalog files, and the folders `edgeserve convert` wrote (recorded in
the cache's converted.json, wherever the folders are)."""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

from edgeserve.errors import EdgeserveError
from edgeserve.models.catalog import CATALOG, DEFAULT_MODEL, home, local_models, local_path


@dataclass
class LocalModel:
    name: str  # what --model takes: the catalog name, or the folder's path
    path: str
    kind: str  # "catalog" (pulled), "cache" (another file in the cache) or "converted"
    size_bytes: int
    detail: str  # the catalog description, or what it was converted from and to


def _registry() -> Path:
    return home() / "converted.json"


def _converted() -> list[dict]:
    try:
        entries = json.loads(_registry().read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    return [e for e in entries if isinstance(e, dict) and {"path", "source", "format"} <= e.keys()]


def _write(entries: list[dict]) -> None:
    _registry().parent.mkdir(parents=True, exist_ok=True)
    _registry().write_text(json.dumps(entries, indent=1), encoding="utf-8")


def record_conversion(out: Path, source: str, format_: str) -> None:
    """Remember a folder convert wrote, so `models` lists it (a later one at the same path replaces it)."""
    path = str(out.resolve())
    _write([e for e in _converted() if e["path"] != path] + [{"path": path, "source": source, "format": format_}])


def _size(path: Path) -> int:
    return path.stat().st_size if path.is_file() else sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def list_local() -> list[LocalModel]:
    """Pulled catalog models, then converted folders that still exist."""
    found = []
    for path in local_models():
        entry = next((e for e in CATALOG.values() if local_path(e) == path), None)
        detail = entry.description + (" (default)" if entry.name == DEFAULT_MODEL else "") if entry else ""
        found.append(LocalModel(entry.name if entry else str(path), str(path), "catalog" if entry else "cache",
                                _size(path), detail))
    for e in _converted():
        path = Path(e["path"])
        if path.is_dir():
            found.append(LocalModel(str(path), str(path), "converted", _size(path),
                                    f"{e['format']} from {e['source']}"))
    return found


def find_local(name: str) -> LocalModel:
    """The local model a catalog name or a converted folder's path names."""
    wanted = str(Path(name).expanduser().resolve()) if Path(name).expanduser().exists() else name
    for model in list_local():
        if name in (model.name, model.path) or wanted == model.path:
            return model
    raise EdgeserveError(f"no local model {name!r} (`edgeserve models` lists them)")


def remove_local(model: LocalModel) -> None:
    """Delete a pulled model's files or a converted folder, and forget it."""
    path = Path(model.path)
    if model.kind == "catalog":
        shutil.rmtree(path.parent)  # the model's own folder in the cache
    elif path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink()
    if model.kind == "converted":
        _write([e for e in _converted() if e["path"] != model.path])


def as_json(models: list[LocalModel]) -> list[dict]:
    return [asdict(m) for m in models]
