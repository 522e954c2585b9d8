"""Repacked weight panels kept in a file beside the model, mapped instead of rebuilt on later runs.

`qmatmul.prepare` repacks a GGUF file's matrices into the kernels' panels: on a 3B model that
is a minute or more of NumPy work on two cores, at every start. Repacking is a pure function of
the file's bytes and of the layout code, so its output is saved once, in one file under
$EDGESERVE_HOME/panels, and later runs map it (np.memmap): the model answers after reading the
GGUF header and the tokenizer, and the panels' pages come in as the first steps touch them,
from the page cache or the disk, as llama.cpp's mapped file does.

The cache file of a model is named from its path, and its content is valid for one file identity
(resolved path, size, modification time) and one layout version (a hash of the code that decides
the packed bytes): either changing makes a miss, and the rebuilt file replaces the old one. A
file that does not parse (truncated, corrupt, another format) is a miss as well, never an error.

File format: b"EDGEPNL1", then every array's bytes at 64-byte aligned offsets, then a JSON index
(matrix key -> segments -> field -> offset, dtype, shape), then the index's offset and length
(two little-endian uint64) and b"EDGEPNL1" again.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import json
import mmap
import os
import struct
import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from edgeserve.backends import pages, qmatmul
from edgeserve.backends.qmatmul import QMatrix, _Segment
from edgeserve.system import home

MAGIC = b"EDGEPNL1"
_TAIL = struct.Struct("<QQ8s")
ENV_VAR = "EDGESERVE_PANEL_CACHE"  # "0" or "off": repack at every start, write nothing
_MAPS: weakref.WeakValueDictionary[tuple, np.memmap] = weakref.WeakValueDictionary()  # see _mapped
_MOVING: list[threading.Thread] = []


def enabled() -> bool:
    return os.environ.get(ENV_VAR, "1").lower() not in ("0", "off", "no", "false")


def layout_version() -> str:
    """A hash of the code that decides the packed bytes: the panel layout and the GGUF conversions."""
    from edgeserve.quant import affine, gguf_blocks, kquants

    h = hashlib.sha256(str(qmatmul.PANEL_LAYOUT_VERSION).encode())
    for module in (qmatmul, kquants, gguf_blocks, affine):
        h.update(inspect.getsource(module).encode())
    return h.hexdigest()[:16]


def cache_dir() -> Path:
    return home() / "panels"


class PanelCache:
    """One model file's prepared matrices: looked up by key, added on a miss, saved by `commit`.

    A matrix added on a miss is written to the new cache file on a writer thread while the caller
    repacks the next one, then mapped from the file, so its in-memory copy is freed: a first run
    holds two matrices' repacking at a time besides the model file's pages.
    """

    def __init__(self, path: Path, identity: str):
        self.path = path
        self.identity = identity
        self._entries: dict[str, Any] = {}
        self._map: np.ndarray | None = None
        self._hits: dict[str, QMatrix] = {}
        self._index: dict[str, Any] = {}  # matrices written to the partial file this run
        self._added: dict[str, QMatrix] = {}  # those matrices: `commit` points them at the finished file
        self._tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.partial")
        self._out: Any = None
        self._failed = False  # the cache file could not be written: this run stops trying
        self._writer: ThreadPoolExecutor | None = None
        self._writing: Future | None = None
        self._load()

    @classmethod
    def for_file(cls, identity: str, directory: Path | None = None) -> PanelCache:
        """The cache of the model file with this identity (path|size|mtime), under `directory`."""
        path_part = identity.split("|", 1)[0]
        stem = hashlib.sha256(path_part.encode()).hexdigest()[:16]
        version = hashlib.sha256(f"{identity}|{layout_version()}".encode()).hexdigest()[:16]
        name = f"{Path(path_part).stem[:40]}-{stem}-{version}.panels"
        return cls((directory or cache_dir()) / name, identity)

    @property
    def pending(self) -> bool:
        """Whether matrices were built this run that the cache file does not hold yet."""
        return self._writing is not None or self._out is not None

    def get(self, key: str, shape: tuple[int, int]) -> QMatrix | None:
        """The mapped matrix saved under `key`, or None (also when it does not have `shape`)."""
        entry = self._entries.get(key)
        if entry is None or self._map is None:
            return None
        try:
            m = QMatrix([_segment(self._map, s) for s in entry["segments"]], int(entry["k"]))
        except (KeyError, TypeError, ValueError):
            return None
        if m.shape != shape:
            return None
        self._hits[key] = m
        return m

    def add(self, key: str, m: QMatrix) -> None:
        """A matrix repacked this run: written to the new cache file (after the one added before it), then `m`
        takes the mapped arrays. Until `commit`, `m` may still hold its own arrays."""
        self._wait()
        if self._failed:
            return
        if self._writer is None:
            # writing overlaps the next matrix's repacking: a 3B file's first start spent 1-3 s in writes alone
            self._writer = ThreadPoolExecutor(1, thread_name_prefix="panel-cache")
        self._writing = self._writer.submit(self._write, key, m)

    def _wait(self) -> None:
        """Let the write in flight finish."""
        if self._writing is not None:
            self._writing.result()
            self._writing = None

    def _write(self, key: str, m: QMatrix) -> None:
        try:
            if self._out is None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._out = open(self._tmp, "wb")
                self._out.write(MAGIC)
            entry = _write_matrix(self._out, m)
            self._out.flush()
        except OSError:
            self._abandon()  # a read-only or full disk: this run keeps its matrices in memory
            return
        self._index[key] = entry
        self._added[key] = m
        written = np.memmap(self._tmp, dtype=np.uint8, mode="r")
        # the model holds `m`: it takes the mapped arrays in place, and its own copies are freed
        QMatrix.__init__(m, [_segment(written, s) for s in entry["segments"]], m.shape[1])

    def commit(self) -> None:
        """Finish the new cache file (the matrices this run found in the old one go in too) and
        put it in place of the old one, atomically."""
        self._wait()
        if self._writer is not None:
            self._writer.shutdown()
            self._writer = None
        if self._out is None:
            return
        try:
            for key, m in self._hits.items():
                self._index.setdefault(key, _write_matrix(self._out, m))
            self._out.write(b"\0" * (-self._out.tell() % pages.CACHE_LINE))
            offset = self._out.tell()
            raw = json.dumps({"identity": self.identity, "matrices": self._index}).encode()
            self._out.write(raw)
            self._out.write(_TAIL.pack(offset, len(raw), MAGIC))
            self._out.close()
            os.replace(self._tmp, self.path)
        except OSError:
            self._abandon()
            return
        self._out = None
        for old in self.path.parent.glob(self.path.name.rsplit("-", 1)[0] + "-*.panels"):
            if old != self.path:
                _remove(old)  # the same model's cache for an older file or layout
        held = {**self._hits, **self._added}
        self._hits, self._index, self._added = {}, {}, {}
        self._load()
        # this run's matrices take the views of the new file's map, whose pages move to anonymous memory (`_mapped`)
        for key, m in held.items():
            if (entry := self._entries.get(key)) is not None:
                QMatrix.__init__(m, [_segment(self._map, s) for s in entry["segments"]], m.shape[1])
                self._hits[key] = m

    def _abandon(self) -> None:
        if self._out is not None:
            self._out.close()
        self._out, self._index, self._added, self._failed = None, {}, {}, True
        _remove(self._tmp)

    def _load(self) -> None:
        """Map the cache file and read its index; anything unreadable leaves the cache empty."""
        self._entries, self._map = {}, None
        try:
            size = self.path.stat().st_size
            if size < len(MAGIC) + _TAIL.size:
                raise ValueError("too short")
            data = _mapped(self.path)
            offset, length, magic = _TAIL.unpack(bytes(data[-_TAIL.size:]))
            if bytes(data[: len(MAGIC)]) != MAGIC or magic != MAGIC or offset + length + _TAIL.size != size:
                raise ValueError("bad magic or index position")
            index = json.loads(bytes(data[offset : offset + length]))
            if index.get("identity") != self.identity:
                raise ValueError("made from another file")
            for entry in index["matrices"].values():
                for seg in entry["segments"]:
                    for spec in seg.values():
                        if isinstance(spec, dict) and "offset" in spec:
                            end = spec["offset"] + np.dtype(spec["dtype"]).itemsize * int(np.prod(spec["shape"]))
                            if not 0 < spec["offset"] <= end <= offset:
                                raise ValueError("array outside the data")
        except FileNotFoundError:
            return
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            _remove(self.path)  # unreadable: rebuilt by this run
            return
        self._entries, self._map = index["matrices"], data


def _mapped(path: Path) -> np.memmap:
    """The cache file mapped, shared by every cache of it in this process (an engine per workload in `edgeserve
    bench`): the first map reads ahead, as llama.cpp does with its mapped file, and its pages move to anonymous huge
    pages in the background (`pages.move_to_anonymous_in_background`), once."""
    stat = path.stat()
    key = (str(path), stat.st_ino, stat.st_size, stat.st_mtime_ns)
    data = _MAPS.get(key)
    if data is None:
        data = _MAPS[key] = np.memmap(path, dtype=np.uint8, mode="r")
        if hasattr(data._mmap, "madvise") and hasattr(mmap, "MADV_WILLNEED"):
            data._mmap.madvise(mmap.MADV_WILLNEED)
        thread = pages.move_to_anonymous_in_background(data)
        _MOVING[:] = [t for t in _MOVING if t.is_alive()] + ([thread] if thread is not None else [])
    return data


def moving() -> list[threading.Thread]:
    """The threads still moving a cache file's pages to anonymous memory (a benchmark waits for them)."""
    return [t for t in _MOVING if t.is_alive()]


def _remove(path: Path) -> None:
    try:
        path.unlink(missing_ok=True)
    except OSError:
        pass  # not there, or not ours to remove: nothing to clean


def _segment(data: np.ndarray, spec: dict[str, Any]) -> _Segment:
    """A segment whose arrays are views of the mapped cache file `data`."""
    fields: dict[str, Any] = {}
    shared: dict[str, str] = {}
    for name, value in spec.items():
        if isinstance(value, dict) and "offset" in value:
            count = int(np.prod(value["shape"]))
            dtype = np.dtype(value["dtype"])
            start = value["offset"]
            fields[name] = data[start : start + count * dtype.itemsize].view(dtype).reshape(value["shape"])
        elif isinstance(value, dict) and "same" in value:
            shared[name] = value["same"]
        else:
            fields[name] = value
    for name, other in shared.items():
        fields[name] = fields[other]  # an array shared with another field (Q6_K's km is its ksc)
    return _Segment(**fields)


def _write_matrix(f: Any, m: QMatrix) -> dict[str, Any]:
    return {"k": m.shape[1], "segments": [_write_segment(f, s) for s in m.segments]}


def _write_segment(f: Any, s: _Segment) -> dict[str, Any]:
    spec: dict[str, Any] = {}
    written: dict[int, str] = {}
    for field in dataclasses.fields(s):
        value = getattr(s, field.name)
        if isinstance(value, np.ndarray):
            if id(value) in written:
                spec[field.name] = {"same": written[id(value)]}
                continue
            f.write(b"\0" * (-f.tell() % pages.CACHE_LINE))
            spec[field.name] = {"offset": f.tell(), "dtype": value.dtype.str, "shape": list(value.shape)}
            np.ascontiguousarray(value).tofile(f)
            written[id(value)] = field.name
        else:
            spec[field.name] = int(value) if isinstance(value, np.integer) else value
    return spec


def drop_pages(file_map: mmap.mmap | None) -> None:
    """Tell the kernel this process no longer needs a mapped file's pages (they leave its RSS)."""
    if file_map is not None and hasattr(file_map, "madvise"):
        try:
            file_map.madvise(mmap.MADV_DONTNEED)
        except (OSError, ValueError):
            pass
