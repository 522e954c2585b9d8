"""Parsing and printing sizes like '2GiB'."""

import re

from edgeserve.errors import EdgeserveError

_UNITS = {"": 1, "B": 1, "K": 1000, "KB": 1000, "KIB": 2**10, "M": 1000**2, "MB": 1000**2, "MIB": 2**20,
          "G": 1000**3, "GB": 1000**3, "GIB": 2**30}


def parse_size(text: str) -> int:
    """'2GiB' -> 2147483648; '512MB' -> 512000000; plain numbers are bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).upper() not in _UNITS:
        raise EdgeserveError(f"invalid size {text!r} (use e.g. 512MiB, 2GiB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def format_size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"
