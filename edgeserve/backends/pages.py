"""A new KV pool's memory mapped in ahead of the steps that would first touch it.

A fresh pool is zero pages the kernel has not mapped yet: the first write to each costs a fault and a page zeroed
(with transparent huge pages, 2 MiB at a time). A step that opens new blocks for many sequences at once (n answers
forking one prompt) waited 20-40 ms for that on a fresh server: the victim stream's worst gap doubled.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
from collections.abc import Sequence

import numpy as np

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
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    for array in arrays:
        start = -(-array.ctypes.data // PAGE) * PAGE  # whole pages inside the array only
        end = (array.ctypes.data + array.nbytes) // PAGE * PAGE
        for at in range(start, end, CHUNK_BYTES):
            if madvise(at, min(CHUNK_BYTES, end - at), MADV_POPULATE_WRITE) != 0:
                return  # not supported here (EINVAL), or no memory for it now: the pages map on first use
