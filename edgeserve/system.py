"""Facts about the machine the runtime sizes itself by, and where it keeps its files."""

import contextlib
import ctypes
import os
from pathlib import Path


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask where the OS has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def available_memory_bytes() -> int:
    """Memory this process may still fill: `memory_headroom`'s on Linux (page cache counts as free, a container's
    limit holds), where free pages alone left a machine whose cache filled its memory a small KV pool; half of
    physical memory where the OS does not say (macOS)."""
    headroom = memory_headroom()
    if headroom is not None:
        return max(headroom[0], 0)
    page = os.sysconf("SC_PAGE_SIZE")
    try:
        return page * os.sysconf("SC_AVPHYS_PAGES")
    except (ValueError, OSError):
        return page * os.sysconf("SC_PHYS_PAGES") // 2


def memory_headroom(proc: Path = Path("/proc"), cgroups: Path = Path("/sys/fs/cgroup")) -> tuple[int, int] | None:
    """(bytes this process may still fill with memory the kernel cannot reclaim, the memory it may use in all) on
    Linux: MemAvailable and MemTotal, or its control group's limit less its usage and that limit where lower (a
    container's `--memory`); None elsewhere."""
    try:
        meminfo = (proc / "meminfo").read_text().splitlines()
        groups = (proc / "self" / "cgroup").read_text().splitlines()
    except OSError:
        return None
    info = {}
    for line in meminfo:  # "MemAvailable:   24116920 kB"
        name, _, value = line.partition(":")
        number = value.split()[:1]
        if number and number[0].isdigit():
            info[name] = int(number[0]) * 1024
    machine = info.get("MemTotal", 0)
    room, total = info.get("MemAvailable", info.get("MemFree", 0)), machine
    for line in groups:  # v2 "0::/path"; v1 "4:memory:/path"
        if line.count(":") < 2:
            continue
        _, controllers, path = line.split(":", 2)
        if controllers not in ("", "memory") and "memory" not in controllers.split(","):
            continue
        base, files = (cgroups, ("memory.max", "memory.current")) if controllers == "" else (
            cgroups / "memory", ("memory.limit_in_bytes", "memory.usage_in_bytes"))
        parts = [p for p in path.split("/") if p]
        # the group and each above it (a limit may sit on a parent), and the mount's root, which a container sees as
        # its own group whatever path the host gives it
        for depth in range(len(parts), -1, -1):
            folder = base.joinpath(*parts[:depth])
            with contextlib.suppress(OSError, ValueError):
                limit_text, usage_text = ((folder / f).read_text().strip() for f in files)
                if limit_text != "max" and int(limit_text) < machine:  # v1 writes "no limit" as a huge number
                    room, total = min(room, int(limit_text) - int(usage_text)), min(total, int(limit_text))
    return room, total


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
