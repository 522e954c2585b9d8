"""How an engine is set up: backend, KV pool, batching limits. The per-request knobs are SamplingParams."""

from __future__ import annotations

from dataclasses import dataclass

from edgeserve.errors import EdgeserveError
from edgeserve.system import available_memory_bytes
from edgeserve.units import parse_size

DEFAULT_KV_MEMORY = "1GiB"
SPECULATIVE_MODES = ("auto", "ngram", "draft", "off")  # see engine/speculative.py
DISTRIBUTED_MODES = ("pipeline", "tensor")  # see edgeserve/distributed
# The commands' prefix-store tiers. RAM: a fixed modest size, since it fills only as the KV pool overflows and
# should stay small beside the model; disk: for `serve` only, whose clients (agents) resend long prompts across
# restarts, and a few GiB hold tens of thousands of tokens of a 1B model's K/V; a one-shot command keeps nothing.
DEFAULT_PREFIX_CACHE_RAM = "512MiB"
DEFAULT_SERVE_PREFIX_CACHE_DISK = "4GiB"


@dataclass(frozen=True)
class EngineConfig:
    backend: str = "auto"  # array backend: "auto", "numpy" or "mlx"
    weights: str = "auto"  # NumPy backend's weights mode: "auto", "float32" or "quantized"
    kv_memory: str | int = DEFAULT_KV_MEMORY  # KV pool budget, see kv_budget_bytes()
    kv_dtype: str = "auto"  # KV pool element type: "auto", "float32", "float16" or "int8" (backends.get_backend)
    block_size: int = 16  # tokens per KV block
    max_num_seqs: int = 64  # sequences in one batch
    max_num_batched_tokens: int = 512  # tokens in one step (decodes plus prefill chunks)
    enable_prefix_caching: bool = True
    # map the whole KV pool's memory in at start, in the background (the server's: a long life, many new blocks)
    populate_kv: bool = False
    # start speculative decoding's "auto" from the step times an earlier engine of this model, draft model and
    # backend measured on this machine, and keep this one's when it closes (engine/cost_memory.py; the commands')
    remember_step_costs: bool = False
    static_batching: bool = False  # fixed padded batches, only to measure continuous batching against
    max_model_len: int | None = None  # context limit; None: the model's own
    threads: int | None = None  # CPU threads for the NumPy backend's kernels; None: every core
    activations: str | None = None  # NumPy kernels' activation integers, "int8" or "int16"; None: their default
    # speculative decoding: "auto", "ngram", "draft" or "off" (engine/speculative.py); None: the engine's default
    speculative: str | None = None
    draft_model: str | None = None  # a smaller model with the target's vocabulary that drafts (engine/drafter.py)
    # the model split across the ranks `mlx.launch` started: "pipeline" or "tensor" (edgeserve.distributed); None:
    # this process alone
    distributed: str | None = None
    # the prefix store's tiers (engine/prefix_store.py): bytes of evicted prefix blocks kept in RAM and on disk
    # under EDGESERVE_HOME ('512MiB', a byte count; 0 turns a tier off). Off here; the commands choose their own.
    prefix_cache_ram: str | int = 0
    prefix_cache_disk: str | int = 0

    def prefix_cache_bytes(self) -> tuple[int, int]:
        """The RAM and disk tiers' limits in bytes."""
        return tuple(v if isinstance(v, int) else parse_size(v)  # type: ignore[return-value]
                     for v in (self.prefix_cache_ram, self.prefix_cache_disk))

    def kv_budget_bytes(self) -> int:
        """kv_memory in bytes: '2GiB', '512MB', a byte count, or a fraction of available memory ('0.25', '25%')."""
        if isinstance(self.kv_memory, int):
            return self.kv_memory
        text = self.kv_memory.strip()
        fraction = None
        if text.endswith("%"):
            fraction = float(text[:-1]) / 100
        elif text.replace(".", "", 1).isdigit() and float(text) < 1:
            fraction = float(text)
        if fraction is not None:
            if not 0 < fraction < 1:
                raise EdgeserveError(f"invalid KV memory fraction {self.kv_memory!r}")
            return int(fraction * available_memory_bytes())
        return parse_size(text)
