"""Facts about the machine the runtime sizes itself by, and where it keeps its files."""

import contextlib
import ctypes
import os
from pathlib import Path


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask where the OS has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def available_memory_bytes() -> int:
    """Memory free for new allocations (Linux); half of physical memory where the OS does not say (macOS)."""
    page = os.sysconf("SC_PAGE_SIZE")
    try:
        return page * os.sysconf("SC_AVPHYS_PAGES")
    except (ValueError, OSError):
        return page * os.sysconf("SC_PHYS_PAGES") // 2


def home() -> Path:
    """The edgeserve cache folder (EDGESERVE_HOME, default ~/.cache/edgeserve): models, panels, tools."""
    return Path(os.environ.get("EDGESERVE_HOME", Path.home() / ".cache" / "edgeserve"))


def write_text_whole(path: Path, text: str) -> None:
    """Write text to path whole or not at all (a reader never sees half of it, another process may be reading); a
    cache file that cannot be written (a read-only home) is left as it was."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)


def release_free_memory() -> None:
    """Hand memory the allocator holds freed back to the system: glibc keeps a heap's freed pages (an unloaded
    model's arrays among them) until told; a no-op where the C library has no malloc_trim."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError, TypeError):  # TypeError: Windows' ctypes loads no library by None
        return
    trim(0)
