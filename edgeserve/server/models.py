"""The models a server answers for: the names it serves, the engines loaded, and when each loads and unloads.

Each loaded model is one AsyncEngine with its own KV pool. A request leases the model it names for as long as it
runs, its stream included (the Gate middleware hands the lease back once the answer has gone out). A model loads
on its first request, one load at a time; it unloads once idle for its keep-alive time (Ollama's `keep_alive`,
per request, else the server's), or when another needs its place among `max_loaded` or in `max_bytes`, least
recently used first, and never while leased: the request for the newcomer waits until one is idle.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import logging
import math
import re
import time
from collections.abc import Callable, Iterable
from contextvars import ContextVar
from dataclasses import dataclass, field

from edgeserve.engine.async_engine import AsyncEngine
from edgeserve.engine.llm_engine import EngineStats
from edgeserve.models.catalog import CATALOG, names_for_file
from edgeserve.server.errors import APIError
from edgeserve.server.served_model import ServedModel
from edgeserve.system import release_free_memory
from edgeserve.units import format_size

logger = logging.getLogger("edgeserve.server")

FOREVER = math.inf
DEFAULT_KEEP_ALIVE = 300.0  # Ollama's five minutes
REAP_INTERVAL = 1.0  # seconds between looks for models idle past their keep-alive

_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?)(ns|us|µs|ms|s|m|h)")
_UNIT_SECONDS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}

# The models the current request leases: Gate sets a fresh list per request and releases them when it ends.
request_leases: ContextVar[list[ModelEntry] | None] = ContextVar("request_leases", default=None)


def settle_heap() -> None:
    """Put every object alive now (a loaded model's, the imports') out of the cyclic collector's sight: its full
    collections walked them all, ~100 ms with the default model loaded, whenever a request's parsing had allocated
    enough, and every stream's next token waited meanwhile."""
    gc.collect()
    gc.freeze()


def parse_keep_alive(value: str | float) -> float:
    """Seconds, from a keep-alive as Ollama takes it: a number of seconds or a duration ("5m", "1h30m", "0");
    negative means forever (FOREVER). ValueError for anything else."""
    if isinstance(value, bool):
        raise ValueError(f"not a duration: {value!r}")
    if isinstance(value, (int, float)):
        seconds = float(value)
    else:
        text = value.strip()
        body = text.lstrip("+-")
        try:
            seconds = float(body)
        except ValueError:
            parts = _DURATION_PART.findall(body)
            if not parts or "".join(n + u for n, u in parts) != body:
                raise ValueError(f"not a duration: {value!r} (say 30s, 5m, 1h or a number of seconds)") from None
            seconds = sum(float(n) * _UNIT_SECONDS[u] for n, u in parts)
        if text.startswith("-"):
            seconds = -seconds
    if math.isnan(seconds):
        raise ValueError(f"not a duration: {value!r}")
    return FOREVER if seconds < 0 else seconds


@dataclass(eq=False)
class ModelEntry:
    """A model the server answers for, loaded or not."""

    name: str  # the id clients pass as `model`
    aliases: tuple[str, ...] = ()  # more names it answers to
    unlisted: tuple[str, ...] = ()  # names it answers to that lists leave out (the catalog's for its file)
    load: Callable[[], AsyncEngine] | None = None  # None: it came loaded and stays for the server's life
    model: ServedModel | None = None  # while loaded
    leases: int = 0  # requests using it now
    keep_alive: float = DEFAULT_KEEP_ALIVE  # seconds idle before it unloads (the latest request's, or the server's)
    last_used: float = field(default_factory=time.monotonic)
    expires: float = FOREVER  # monotonic time it unloads at, while idle
    expires_at: float = FOREVER  # the same as a wall-clock time, for /api/ps
    size: int = 0  # bytes its last load took (weights and KV pool), else what it is expected to take

    @property
    def names(self) -> list[str]:
        return [self.name, *self.aliases]

    @property
    def pinned(self) -> bool:
        return self.load is None


class ModelPool:
    """The models of one server, by every name each answers to; see the module's docstring for the rules."""

    def __init__(self, entries: Iterable[ModelEntry], max_loaded: int = 1, keep_alive: float = DEFAULT_KEEP_ALIVE,
                 loader: Callable[[str], Callable[[], AsyncEngine]] | None = None, allow_pull: bool = False,
                 max_bytes: int | None = None):
        self.entries: list[ModelEntry] = []
        self.max_loaded = max(1, max_loaded)
        self.max_bytes = max_bytes  # the loaded models' weights and KV pools together, where limited
        self.keep_alive = keep_alive
        self.loader = loader  # how to load a model by its source (a catalog name, file or folder): for pulled ones
        self.allow_pull = allow_pull and loader is not None  # serve any catalog name a request gives, pulled at load
        self._by_name: dict[str, ModelEntry] = {}
        for entry in entries:
            self.add(entry)
        if not self.entries:
            raise ValueError("a server needs at least one model")
        self._loading = asyncio.Lock()  # one load at a time: each takes the cores and its memory
        self._idle = asyncio.Event()  # set whenever a model's last lease ends
        self._reaper: asyncio.Task | None = None

    @classmethod
    def single(cls, aengine: AsyncEngine, name: str, aliases: Iterable[str] = ()) -> ModelPool:
        """One model, loaded already and kept for the server's life; the catalog's names for its file work too."""
        source = aengine.info.model_name
        aliases = tuple(a for a in dict.fromkeys(aliases) if a != name)
        unlisted = tuple(n for n in names_for_file(source) if n not in (name, *aliases))
        entry = ModelEntry(name, aliases, unlisted, model=ServedModel(aengine), size=aengine.info.memory_bytes)
        return cls([entry], keep_alive=FOREVER)

    def add(self, entry: ModelEntry) -> None:
        """Serve one more model (ValueError where one of its names is taken)."""
        names = (*entry.names, *entry.unlisted)
        if taken := [n for n in names if n in self._by_name]:
            raise ValueError(f"two models answer to the name {taken[0]!r}")
        entry.keep_alive = self.keep_alive
        self.entries.append(entry)
        self._by_name.update(dict.fromkeys(names, entry))

    def add_catalog_model(self, name: str) -> ModelEntry | None:
        """Serve a catalog model by its name (pulled when it first loads), where the pool can load models by name;
        the entry serving it, or None."""
        if name not in self._by_name and self.loader is not None:
            self.add(ModelEntry(name, load=self.loader(name)))
        return self._by_name.get(name)

    @property
    def default(self) -> ModelEntry:
        """The first model given: the one routes without a `model` field use."""
        return self.entries[0]

    @property
    def loaded(self) -> list[ModelEntry]:
        return [e for e in self.entries if e.model is not None]

    def find(self, requested: str | None) -> ModelEntry:
        """The model a request names (None: the default; Ollama's ":latest" tag may follow a name); a 404 for a name
        this server does not serve (with allow_pull, a catalog name is served from now on)."""
        if requested is None:
            return self.default
        base = requested.removesuffix(":latest")
        entry = self._by_name.get(requested) or self._by_name.get(base)
        if entry is None and self.allow_pull and base in CATALOG:
            entry = self.add_catalog_model(base)
        if entry is None:
            served = ", ".join(repr(n) for e in self.entries for n in e.names)
            raise APIError(404, f"the model {requested!r} does not exist; this server serves {served}",
                           param="model", code="model_not_found")
        return entry

    def stats(self) -> EngineStats:
        """The loaded engines' stats, added up."""
        total = EngineStats()
        for entry in self.loaded:
            stats = entry.model.aengine.stats()
            for f in dataclasses.fields(EngineStats):
                setattr(total, f.name, getattr(total, f.name) + getattr(stats, f.name))
        return total

    # leases -------------------------------------------------------------------

    async def acquire(self, entry: ModelEntry, keep_alive: float | None = None) -> ServedModel:
        """Lease the entry's model for the current request, loading it first where it is not loaded."""
        leases = request_leases.get()
        if leases is None:
            raise RuntimeError("models are leased inside a request that the Gate middleware watches")
        entry.leases += 1
        try:
            if entry.model is None:
                await self._load(entry)
        except BaseException:
            self._end_lease(entry)
            raise
        leases.append(entry)
        entry.last_used = time.monotonic()
        if keep_alive is not None:
            entry.keep_alive = keep_alive
        if self._reaper is None:
            self._reaper = asyncio.create_task(self._reap_idle())
        return entry.model

    def release(self, entry: ModelEntry) -> None:
        """End one lease; the model's keep-alive counts from the last one's end."""
        self._end_lease(entry)
        if entry.leases == 0 and entry.keep_alive == 0 and not entry.pinned and entry.model is not None:
            self._unload(entry, "keep_alive 0")

    def _end_lease(self, entry: ModelEntry) -> None:
        entry.leases -= 1
        if entry.leases == 0:
            entry.last_used = time.monotonic()
            entry.expires = entry.last_used + entry.keep_alive
            entry.expires_at = time.time() + entry.keep_alive
            self._idle.set()

    # loading and unloading ----------------------------------------------------

    async def _load(self, entry: ModelEntry) -> None:
        async with self._loading:
            if entry.model is not None:  # another request loaded it meanwhile
                return
            if self.max_bytes is not None and entry.size > self.max_bytes:
                raise APIError(500, f"the model {entry.name!r} takes {format_size(entry.size)}, more than the server's "
                                    f"memory budget of {format_size(self.max_bytes)}", "server_error", param="model",
                               code="model_load_failed")
            while self._over_budget(entry):
                idle = [e for e in self.loaded if e.leases == 0 and not e.pinned]
                if idle:
                    self._unload(min(idle, key=lambda e: e.last_used), f"room for {entry.name}")
                    continue
                self._idle.clear()  # every loaded model is busy: wait for one to finish its requests
                await self._idle.wait()
            logger.info("loading %s", entry.name)
            started = time.perf_counter()
            try:
                aengine = await asyncio.to_thread(entry.load)
            except Exception as exc:
                logger.error("loading %s failed: %s", entry.name, exc)
                raise APIError(500, f"the model {entry.name!r} failed to load: {exc}", "server_error",
                               param="model", code="model_load_failed") from exc
            entry.model = ServedModel(aengine)
            entry.size = aengine.info.memory_bytes
            settle_heap()
            logger.info("loaded %s in %.1fs (%.0f MiB)", entry.name, time.perf_counter() - started, entry.size / 2**20)

    def _over_budget(self, newcomer: ModelEntry) -> bool:
        """Whether loading newcomer now would pass the count or the memory budget."""
        loaded = self.loaded
        if len(loaded) >= self.max_loaded:
            return True
        return self.max_bytes is not None and sum(e.size for e in loaded) + newcomer.size > self.max_bytes

    def _unload(self, entry: ModelEntry, why: str) -> None:
        model, entry.model = entry.model, None
        entry.expires = entry.expires_at = FOREVER
        model.aengine.shutdown()
        del model
        gc.unfreeze()  # the engine's objects hold cycles: its weights go back to the system now, not later
        settle_heap()
        release_free_memory()
        logger.info("unloaded %s (%s)", entry.name, why)

    async def _reap_idle(self) -> None:
        while True:
            await asyncio.sleep(REAP_INTERVAL)
            now = time.monotonic()
            for entry in self.loaded:
                if entry.leases == 0 and not entry.pinned and now >= entry.expires:
                    self._unload(entry, f"idle for {entry.keep_alive:g}s")

    def preload(self, entry: ModelEntry, aengine: AsyncEngine) -> None:
        """Hold an engine loaded before the server started (the first model, so a broken one fails at once)."""
        entry.model = ServedModel(aengine)
        entry.size = aengine.info.memory_bytes
        entry.expires = time.monotonic() + entry.keep_alive
        entry.expires_at = time.time() + entry.keep_alive
        settle_heap()

    def shutdown(self) -> None:
        """Stop every loaded engine (the server has stopped)."""
        if self._reaper is not None:
            self._reaper.cancel()
        for entry in self.loaded:
            entry.model.aengine.shutdown()
