"""What speculative decoding's "auto" measured of a machine's step times, kept across restarts.

A fresh engine knows neither what a step of n query rows costs here nor how long its draft model takes per guess,
so "auto" tries drafts every other step until it has timed enough steps (speculative.StepCost): the first short
answers after a start pay for the lesson. When the engine closes, what it learned is saved under
$EDGESERVE_HOME/step-costs, one small JSON file per model (its files' path, size and time), draft model, backend
(its kernels, activations and threads) and CPU, and the next engine with all of those the same starts from it; its
own steps replace the remembered ones as they come.
"""

from __future__ import annotations

import hashlib
import json
import platform
from pathlib import Path
from typing import Any

from edgeserve.models.loader import file_identity, model_files
from edgeserve.system import home, write_text_whole


def cost_dir() -> Path:
    return home() / "step-costs"


def _cpu_name() -> str:
    """The CPU's model name where the system tells it (Linux), else the platform's processor string."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _identity(source: Path) -> str:
    """A model's files' paths, sizes and modification times: what it computes with changes only with them, and
    hashing gigabytes would slow every first start."""
    return "\0".join(file_identity(p) for p in model_files(source))


def cost_key(model: Path, draft: Path | None, backend: str) -> str:
    """The file name of the step times measured for this model, draft model, backend and CPU."""
    text = "\0".join([_identity(model), "" if draft is None else _identity(draft), backend, _cpu_name(),
                      platform.machine()])
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def load(key: str) -> dict[str, Any] | None:
    """What an earlier engine saved under key; None where nothing (or nothing readable) is there."""
    try:
        data = json.loads((cost_dir() / f"{key}.json").read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def save(key: str, data: dict[str, Any]) -> None:
    """Write data under key (whole: another engine may be reading it; not at all where the home is read-only, which
    is no reason to fail a shutdown)."""
    write_text_whole(cost_dir() / f"{key}.json", json.dumps(data))
