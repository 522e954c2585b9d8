"""The prefix store: KV blocks evicted from the pool, kept in RAM and then on disk, loaded instead of recomputed.

A block the pool evicts while it holds a known prefix (a chained hash, block_manager.py) is put here with the
(parent hash, tokens) key it was filled from and its K/V bytes (every layer's K and V, as the pool holds them:
int8 blocks carry their scales). The RAM tier keeps the latest within its byte limit; what it drops goes to the
disk tier (straight there when the RAM tier is off), LRU within its own limit. A lookup checks the key exactly
as the pool checks its cached blocks, so a block is served only for the tokens and parent it was made from.

On disk, entries live under $EDGESERVE_HOME/prefix-cache/<namespace>/<hash>.kv, where the namespace is a
fingerprint of the model's files, the backend, the KV dtype, the block size and the model's KV shape: a
model changed by one byte, or a pool of another layout, never reads another's K/V. A background thread writes
each entry to a temporary file in the same folder and renames it into place, so a crash mid-write leaves no
entry; each entry ends with a BLAKE2b checksum of the rest, so a truncated or corrupt one is detected on read,
deleted and taken as a miss. The disk limit covers every namespace together (a user trying models one after
another does not pile up a store per model); its LRU order is the files' modification times, which a hit
renews, so it survives restarts.

Entry format: MAGIC, then struct `<B16sIQ` (has parent, parent hash, token count, data length), the tokens as
int64, the data, and a 16-byte BLAKE2b digest of everything before it.
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import shutil
import struct
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edgeserve.system import home

MAGIC = b"EDGEKV01"
_HEADER = struct.Struct("<B16sIQ")
_DIGEST = 16
SUFFIX = ".kv"
META = "meta.json"  # what a namespace holds (model, dtype, block size), for `edgeserve cache ls`

BlockKey = tuple[bytes | None, tuple[int, ...]]  # (parent hash, tokens): what a block was filled from


def store_root() -> Path:
    return home() / "prefix-cache"


@dataclass(frozen=True)
class StoredBlock:
    """A block's K/V found in a tier, checked against the key asked for."""

    block_hash: bytes
    key: BlockKey
    data: bytes
    tier: str  # "ram" or "disk"


@dataclass(frozen=True)
class StoreUsage:
    ram_entries: int
    ram_bytes: int
    disk_entries: int  # this process's view of the whole disk tier, every namespace
    disk_bytes: int


def encode_entry(key: BlockKey, data: bytes) -> bytes:
    parent, tokens = key
    body = (MAGIC + _HEADER.pack(parent is not None, parent or b"", len(tokens), len(data))
            + np.asarray(tokens, dtype=np.int64).tobytes() + data)
    return body + hashlib.blake2b(body, digest_size=_DIGEST).digest()


def decode_entry(raw: bytes) -> tuple[BlockKey, bytes]:
    """The key and data of an entry file's bytes; ValueError where they are truncated or corrupt."""
    head = len(MAGIC) + _HEADER.size
    if len(raw) < head + _DIGEST or raw[: len(MAGIC)] != MAGIC:
        raise ValueError("not a prefix-cache entry")
    body, digest = raw[:-_DIGEST], raw[-_DIGEST:]
    if hashlib.blake2b(body, digest_size=_DIGEST).digest() != digest:
        raise ValueError("checksum mismatch")
    has_parent, parent, n, size = _HEADER.unpack_from(raw, len(MAGIC))
    if head + 8 * n + size != len(body):
        raise ValueError("lengths do not add up")
    tokens = tuple(int(t) for t in np.frombuffer(body, dtype=np.int64, count=n, offset=head))
    return ((parent if has_parent else None), tokens), body[head + 8 * n :]


class PrefixStore:
    """The RAM and disk tiers of one engine's namespace. `put` and `get` run on the engine thread; disk writes run
    on a background thread of the store's own, so a step never waits on the disk."""

    def __init__(self, namespace: str, ram_bytes: int, disk_bytes: int, root: Path | None = None,
                 meta: dict | None = None):
        self.ram_limit = ram_bytes
        self.disk_limit = disk_bytes
        self.root = root or store_root()
        self.dir = self.root / namespace
        self._ram: OrderedDict[bytes, tuple[BlockKey, bytes]] = OrderedDict()  # LRU first
        self._ram_bytes = 0
        self._lock = threading.Lock()  # the disk index and the queued writes, shared with the writer
        self._disk: OrderedDict[Path, int] = OrderedDict()  # every namespace's entries -> size, LRU first
        self._disk_bytes = 0
        self._queued: dict[bytes, tuple[BlockKey, bytes]] = {}  # written soon: still served from here
        self._writes: queue.Queue[tuple[bytes, BlockKey, bytes] | None] = queue.Queue()
        self._writer: threading.Thread | None = None
        if disk_bytes > 0:
            self._open_disk(meta or {})

    # the engine's side ---------------------------------------------------------------------------

    def get(self, block_hash: bytes, key: BlockKey) -> StoredBlock | None:
        """The block stored under block_hash, if it was filled from exactly key."""
        found = self._ram.get(block_hash)
        if found is not None:
            if found[0] != key:
                return None
            self._ram.move_to_end(block_hash)
            return StoredBlock(block_hash, key, found[1], "ram")
        with self._lock:
            found = self._queued.get(block_hash)
        if found is not None:
            return StoredBlock(block_hash, key, found[1], "disk") if found[0] == key else None
        return self._read_disk(block_hash, key)

    def put(self, block_hash: bytes, key: BlockKey, data: bytes) -> None:
        """Keep a block the pool evicted: in RAM, and what RAM drops, on disk."""
        if block_hash in self._ram:
            self._ram.move_to_end(block_hash)
            return
        self._ram[block_hash] = (key, data)
        self._ram_bytes += len(data)
        while self._ram_bytes > self.ram_limit:
            old, (old_key, old_data) = self._ram.popitem(last=False)
            self._ram_bytes -= len(old_data)
            self._to_disk(old, old_key, old_data)

    def save(self, block_hash: bytes, key: BlockKey, data: bytes) -> None:
        """Write a block to the disk tier (unless it is there), past the RAM tier: a pool being kept as it stops."""
        self._to_disk(block_hash, key, data)

    def persist(self) -> None:
        """Send the RAM tier to disk (a server stopping: what it computed serves the next start)."""
        for block_hash, (key, data) in self._ram.items():
            self._to_disk(block_hash, key, data)

    def close(self, timeout: float = 60.0) -> None:
        """Finish the queued disk writes (waiting at most timeout seconds) and stop the writer."""
        if self._writer is not None:
            self._writes.put(None)
            self._writer.join(timeout)
            self._writer = None

    def usage(self) -> StoreUsage:
        with self._lock:
            return StoreUsage(len(self._ram), self._ram_bytes, len(self._disk), self._disk_bytes)

    # the disk tier -------------------------------------------------------------------------------

    def _path(self, block_hash: bytes) -> Path:
        return self.dir / (block_hash.hex() + SUFFIX)

    def _open_disk(self, meta: dict) -> None:
        """Index the entries on disk, oldest use first; clear what crashed writers left; start the writer."""
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            (self.dir / META).write_text(json.dumps(meta))
        except OSError:
            self.disk_limit = 0  # a read-only home: the RAM tier alone
            return
        found = []
        for folder in self.root.iterdir():
            if not folder.is_dir():
                continue
            for entry in os.scandir(folder):
                if entry.name.endswith(".tmp"):
                    _remove_stale_temp(Path(entry.path))
                elif entry.name.endswith(SUFFIX):
                    try:
                        st = entry.stat()
                    except OSError:
                        continue  # removed meanwhile by another process's eviction
                    found.append((st.st_mtime_ns, Path(entry.path), st.st_size))
        for _, path, size in sorted(found):
            self._disk[path] = size
            self._disk_bytes += size
        self._writer = threading.Thread(target=self._write_loop, name="edgeserve-prefix-store", daemon=True)
        self._writer.start()

    def _to_disk(self, block_hash: bytes, key: BlockKey, data: bytes) -> None:
        if self.disk_limit <= 0:
            return
        with self._lock:
            if self._path(block_hash) in self._disk or block_hash in self._queued:
                return
            self._queued[block_hash] = (key, data)
        self._writes.put((block_hash, key, data))

    def _read_disk(self, block_hash: bytes, key: BlockKey) -> StoredBlock | None:
        path = self._path(block_hash)
        with self._lock:
            if path not in self._disk:
                return None
        try:
            stored_key, data = decode_entry(path.read_bytes())
        except FileNotFoundError:
            self._forget(path)  # another process's eviction took it
            return None
        except (OSError, ValueError):
            self._forget(path)
            _remove(path)  # truncated or corrupt: never served, and gone
            return None
        if stored_key != key:
            return None
        with self._lock:
            if path in self._disk:
                self._disk.move_to_end(path)
        try:
            os.utime(path)  # the LRU order a restart reads
        except OSError:
            pass  # evicted since by another process: the data read is whole and checked
        return StoredBlock(block_hash, key, data, "disk")

    def _forget(self, path: Path) -> None:
        with self._lock:
            self._disk_bytes -= self._disk.pop(path, 0)

    def _write_loop(self) -> None:
        while (item := self._writes.get()) is not None:
            block_hash, key, data = item
            path = self._path(block_hash)
            raw = encode_entry(key, data)
            # a temporary file in the same folder, renamed into place: a crash leaves no half entry under the name
            tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp")
            try:
                tmp.write_bytes(raw)
                os.replace(tmp, path)
            except OSError:
                _remove(tmp)  # a full or read-only disk: this block is not kept
                with self._lock:
                    self._queued.pop(block_hash, None)
                continue
            with self._lock:
                self._queued.pop(block_hash, None)
                self._disk_bytes += len(raw) - self._disk.pop(path, 0)
                self._disk[path] = len(raw)
                victims = []
                while self._disk_bytes > self.disk_limit and len(self._disk) > 1:
                    old, size = self._disk.popitem(last=False)
                    self._disk_bytes -= size
                    victims.append(old)
            for old in victims:
                _remove(old)


def _remove(path: Path) -> None:
    try:
        path.unlink(missing_ok=True)
    except OSError:
        pass  # not ours to remove: it stays, and its next read checks it again


def _remove_stale_temp(path: Path) -> None:
    """Remove a temporary entry file whose writer process is gone (killed mid-write)."""
    try:
        pid = int(path.name.rsplit(".", 2)[-2])
        if pid != os.getpid():
            os.kill(pid, 0)
            return  # its writer still runs: it renames or removes it itself
    except (ValueError, IndexError, ProcessLookupError):
        pass
    except PermissionError:
        return  # another user's live process
    _remove(path)


@dataclass(frozen=True)
class Namespace:
    """One namespace folder of the disk tier, as `edgeserve cache ls` lists it."""

    path: Path
    meta: dict
    entries: int
    bytes: int
    last_used: float | None  # the latest entry's modification time


def namespaces(root: Path | None = None) -> list[Namespace]:
    """The disk tier's namespaces, most recently used first."""
    root = root or store_root()
    if not root.is_dir():
        return []
    out = []
    for folder in root.iterdir():
        if not folder.is_dir():
            continue
        try:
            meta = json.loads((folder / META).read_text())
        except (OSError, ValueError):
            meta = {}
        stats = [e.stat() for e in os.scandir(folder) if e.name.endswith(SUFFIX)]
        out.append(Namespace(folder, meta, len(stats), sum(s.st_size for s in stats),
                             max((s.st_mtime for s in stats), default=None)))
    return sorted(out, key=lambda n: -(n.last_used or 0))


def clear(spaces: list[Namespace]) -> int:
    """Delete these namespaces' entries; the bytes freed."""
    freed = 0
    for space in spaces:
        freed += space.bytes
        shutil.rmtree(space.path, ignore_errors=True)
    return freed


def namespace_key(*parts: object) -> str:
    """A namespace folder name from what decides a block's K/V bytes."""
    return hashlib.blake2b("\0".join(map(str, parts)).encode(), digest_size=12).hexdigest()

