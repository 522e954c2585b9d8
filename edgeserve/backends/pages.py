"""Memory brought to where the steps want it, on background threads: a new KV pool's pages mapped in ahead of the
steps that would first touch them, and mapped weights moved into anonymous huge pages; and arrays the kernels stream
placed to start on a cache line.

A fresh pool is zero pages the kernel has not mapped yet: the first write to each costs a fault and a page zeroed
(with transparent huge pages, 2 MiB at a time). A step that opens new blocks for many sequences at once (n answers
forking one prompt) waited 20-40 ms for that on a fresh server: the victim stream's worst gap doubled.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import sys
import threading
from collections.abc import Sequence

import numpy as np

from edgeserve.system import memory_headroom

MADV_POPULATE_WRITE = 23  # Linux 5.14+: map pages writable, contents unchanged
CHUNK_BYTES = 64 << 20  # one call's span: the GIL is free throughout, and a stop costs at most one chunk
PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def populate_in_background(arrays: Sequence[np.ndarray]) -> threading.Thread | None:
    """Map the arrays' pages in on a daemon thread, their contents unchanged (safe beside steps that use them);
    the thread, or None where the system cannot (not Linux, or a kernel before 5.14: pages then map on first use,
    as before)."""
    if not sys.platform.startswith("linux") or not arrays:
        return None
    thread = threading.Thread(target=_populate, args=(list(arrays),), name="edgeserve-kv-pages", daemon=True)
    thread.start()
    return thread


def _populate(arrays: list[np.ndarray]) -> None:
    libc = _libc()
    for array in arrays:
        start, end = aligned_inside(array, PAGE)
        for at in range(start, end, CHUNK_BYTES):
            if libc.madvise(at, min(CHUNK_BYTES, end - at), MADV_POPULATE_WRITE) != 0:
                return  # not supported here (EINVAL), or no memory for it now: the pages map on first use


def aligned_inside(array: np.ndarray, align: int) -> tuple[int, int]:
    """The first and the end address of the whole `align`-sized, `align`-aligned spans inside array's memory."""
    return _round_up(array.ctypes.data, align), (array.ctypes.data + array.nbytes) // align * align


def _round_up(address: int, align: int) -> int:
    return -(-address // align) * align


CACHE_LINE = 64  # bytes: one AVX-512 vector too


def aligned_zeros(shape: tuple[int, ...], dtype: type) -> np.ndarray:
    """Zeros whose first byte starts a cache line. NumPy's large arrays start 16 bytes into a page, so each 64-byte
    vector a kernel loads from them spans two lines: a 1B decode's weight pass on one thread read 23.3 GB/s from such
    panels, 25.5 aligned."""
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    buf = np.zeros(nbytes + CACHE_LINE, dtype=np.uint8)
    start = _round_up(buf.ctypes.data, CACHE_LINE) - buf.ctypes.data
    return buf[start : start + nbytes].view(dtype).reshape(shape)


def aligned_copy(a: np.ndarray) -> np.ndarray:
    """a as a C-contiguous array starting a cache line (see aligned_zeros)."""
    out = aligned_zeros(a.shape, a.dtype)
    np.copyto(out, a)
    return out


def _libc() -> ctypes.CDLL:
    """The C library, with the prototypes of the memory calls made here (their pointers and sizes as 64 bits)."""
    libc = ctypes.CDLL(None, use_errno=True)
    ptr, size, num = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int
    for name, result, args in (("madvise", num, [ptr, size, num]), ("mprotect", num, [ptr, size, num]),
                               ("munmap", num, [ptr, size]), ("mmap", ptr, [ptr, size, num, num, num, ctypes.c_long]),
                               ("mremap", ptr, [ptr, size, size, num, ptr])):
        call = getattr(libc, name)
        call.restype, call.argtypes = result, args
    return libc


HUGE_PAGE = 2 << 20  # a transparent huge page on x86-64 and on arm64 with 4 KiB pages
MOVE_BYTES = 16 << 20  # a chunk held twice (file pages and copy) while it moves: 64 MiB read 1.23x a 1B file in RSS
MOVER_NICENESS = 5  # the mover yields most of a core to the steps it shares one with: a first answer waits less
MREMAP_MAYMOVE, MREMAP_FIXED = 1, 2  # Linux's, on every architecture
MAP_FAILED = ctypes.c_void_p(-1).value


def move_to_anonymous_in_background(mapped: np.ndarray) -> threading.Thread | None:
    """Replace a read-only file mapping's pages by anonymous copies in huge pages, the same bytes at the same
    addresses, on a daemon thread: the thread, or None where the system cannot (not Linux).

    Why: streaming a file's pages, mapped 4 KiB at a time, reads slower than the same bytes in anonymous huge pages
    (one thread over a 1B model's panels: 19 against 29 GB/s; its decode on one thread 28-30 against 37 tok/s),
    most likely as each 4 KiB page takes a TLB entry and stops the hardware prefetcher. Copying happens in chunks
    beside the steps that read the array (mremap swaps each chunk in whole), so a start waits for none of it. Only
    the 2 MiB-aligned inside of the mapping moves; the caller must not unmap it while the thread runs (the thread
    holds a reference)."""
    if not sys.platform.startswith("linux") or mapped.nbytes < HUGE_PAGE:
        return None
    thread = threading.Thread(target=_move, args=(mapped,), name="edgeserve-weights-to-ram", daemon=True)
    thread.start()
    return thread


def _room_for(size: int) -> bool:
    """Whether `size` more bytes of memory the kernel cannot reclaim leave this process (its container's limit
    included) a margin: 1 GiB or a tenth of its memory, whichever is more."""
    headroom = memory_headroom()
    return headroom is not None and headroom[0] - size > max(1 << 30, headroom[1] // 10)


def _move(mapped: np.ndarray) -> None:
    libc = _libc()
    start, end = aligned_inside(mapped, HUGE_PAGE)
    with contextlib.suppress(OSError):  # Linux: this thread's own niceness
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), MOVER_NICENESS)
    for at in range(start, end, MOVE_BYTES):
        size = min(MOVE_BYTES, end - at)
        if not _room_for(size):
            return  # the file's pages can be dropped under pressure, a copy could not: the rest stays as it is
        raw = libc.mmap(None, size + HUGE_PAGE, mmap.PROT_READ | mmap.PROT_WRITE,
                        mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
        if raw == MAP_FAILED:
            return  # no memory for a copy now: the rest stays mapped from the file
        copy = _round_up(raw, HUGE_PAGE)
        # the slack around the aligned copy goes now: unmapped after the move, its range might hold another mapping
        if copy > raw:
            libc.munmap(raw, copy - raw)
        libc.munmap(copy + size, raw + HUGE_PAGE - copy)
        libc.madvise(copy, size, mmap.MADV_HUGEPAGE)  # refused where huge pages are off: the copy is 4 KiB pages then
        ctypes.memmove(copy, at, size)
        libc.mprotect(copy, size, mmap.PROT_READ)
        if libc.mremap(copy, size, size, MREMAP_MAYMOVE | MREMAP_FIXED, at) == MAP_FAILED:
            libc.munmap(copy, size)
            return
