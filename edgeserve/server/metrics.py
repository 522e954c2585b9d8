"""The server's /metrics in the Prometheus text format.

Request counters and latency histograms are kept here as requests finish; the engine's gauges
(queue, KV blocks, prefix cache, preemptions) are read from its latest stats at scrape time.
"""

from __future__ import annotations

import bisect
from collections import Counter

from edgeserve.engine.llm_engine import EngineStats

TTFT_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.5, 5.0, 10.0, 30.0)
TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)

Sample = tuple[dict[str, str], float]


class Histogram:
    def __init__(self, buckets: tuple[float, ...]):
        self.buckets = buckets
        self.counts = [0] * len(buckets)  # per bucket, not cumulative
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        i = bisect.bisect_left(self.buckets, value)
        if i < len(self.buckets):
            self.counts[i] += 1
        self.sum += value
        self.count += 1

    def samples(self) -> list[tuple[str, dict[str, str], float]]:
        """(suffix, labels, value) rows: cumulative buckets, then _sum and _count."""
        rows, running = [], 0
        for bound, n in zip(self.buckets, self.counts):
            running += n
            rows.append(("_bucket", {"le": f"{bound:g}"}, running))
        rows.append(("_bucket", {"le": "+Inf"}, self.count))
        rows.append(("_sum", {}, self.sum))
        rows.append(("_count", {}, self.count))
        return rows


class ServerMetrics:
    def __init__(self) -> None:
        self.http_requests: Counter[str] = Counter()  # by status code
        self.finish_reasons: Counter[str] = Counter()  # stop, length, abort, disconnect, error
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.ttft = Histogram(TTFT_BUCKETS)
        self.tpot = Histogram(TPOT_BUCKETS)

    def observe_choice(self, finish_reason: str, completion_tokens: int, ttft: float | None,
                       elapsed: float) -> None:
        """Record one finished generation (one choice of a request)."""
        self.finish_reasons[finish_reason] += 1
        self.completion_tokens += completion_tokens
        if ttft is not None:
            self.ttft.observe(ttft)
            if completion_tokens > 1:
                self.tpot.observe((elapsed - ttft) / (completion_tokens - 1))

    def render(self, stats: EngineStats) -> str:
        out: list[str] = []

        def metric(name: str, kind: str, help_: str, samples: list[Sample]) -> None:
            out.append(f"# HELP {name} {help_}")
            out.append(f"# TYPE {name} {kind}")
            out.extend(f"{name}{_labels(labels)} {_number(value)}" for labels, value in samples)

        def histogram(name: str, help_: str, h: Histogram) -> None:
            out.append(f"# HELP {name} {help_}")
            out.append(f"# TYPE {name} histogram")
            out.extend(f"{name}{suffix}{_labels(labels)} {_number(v)}" for suffix, labels, v in h.samples())

        metric("edgeserve_http_requests_total", "counter", "API requests answered, by HTTP status code.",
               [({"code": code}, n) for code, n in sorted(self.http_requests.items())])
        metric("edgeserve_generations_total", "counter",
               "Finished generations (one per choice), by finish reason.",
               [({"reason": r}, n) for r, n in sorted(self.finish_reasons.items())])
        metric("edgeserve_prompt_tokens_total", "counter", "Prompt tokens of served requests.",
               [({}, self.prompt_tokens)])
        metric("edgeserve_completion_tokens_total", "counter", "Tokens generated for served requests.",
               [({}, self.completion_tokens)])
        histogram("edgeserve_time_to_first_token_seconds", "Time from arrival to the first token.", self.ttft)
        histogram("edgeserve_time_per_output_token_seconds", "Mean time between tokens after the first.",
                  self.tpot)
        metric("edgeserve_requests_running", "gauge", "Requests in the running batch.", [({}, stats.running)])
        metric("edgeserve_requests_waiting", "gauge", "Requests waiting for admission.", [({}, stats.waiting)])
        metric("edgeserve_kv_blocks", "gauge", "KV pool blocks by state (cached: free but holding a prefix).",
               [({"state": "used"}, stats.kv_blocks_used), ({"state": "cached"}, stats.kv_blocks_cached),
                ({"state": "free"}, stats.kv_blocks_free)])
        metric("edgeserve_kv_blocks_total", "gauge", "KV pool size in blocks.", [({}, stats.kv_blocks_total)])
        metric("edgeserve_prefix_cache_hit_tokens_total", "counter", "Prompt tokens found in the prefix cache.",
               [({}, stats.prefix_hit_tokens)])
        metric("edgeserve_prefix_cache_tier_hit_tokens_total", "counter",
               "Of the prefix-cache hits, prompt tokens loaded from a tier of the prefix store instead of computed.",
               [({"tier": "ram"}, stats.prefix_ram_hit_tokens), ({"tier": "disk"}, stats.prefix_disk_hit_tokens)])
        metric("edgeserve_prefix_store_bytes", "gauge", "K/V bytes the prefix store holds, by tier (disk: the whole store, as each loaded model counts it).",
               [({"tier": "ram"}, stats.prefix_store_ram_bytes), ({"tier": "disk"}, stats.prefix_store_disk_bytes)])
        metric("edgeserve_prefix_cache_query_tokens_total", "counter", "Prompt tokens looked up in the prefix cache.",
               [({}, stats.prefix_query_tokens)])
        metric("edgeserve_preemptions_total", "counter", "Requests preempted when the KV pool ran out.",
               [({}, stats.preemptions)])
        metric("edgeserve_speculative_draft_tokens_total", "counter",
               "Tokens speculative decoding guessed, by whether checking accepted them.",
               [({"result": "accepted"}, stats.accepted_draft_tokens),
                ({"result": "rejected"}, stats.draft_tokens - stats.accepted_draft_tokens)])
        metric("edgeserve_speculative_checks_total", "counter", "Decode steps of a request that checked a draft.",
               [({}, stats.draft_checks)])
        metric("edgeserve_generation_tokens_per_second", "gauge", "Output tokens per second, recent window.",
               [({}, stats.tokens_per_second)])
        return "\n".join(out) + "\n"


def _labels(labels: dict[str, str]) -> str:
    return "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else ""


def _number(value: float) -> str:
    return str(value) if isinstance(value, int) else repr(float(value))
