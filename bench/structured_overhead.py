"""Decode step time with every stream constrained by a JSON Schema vs none: the cost of grammar masks.

    python bench/structured_overhead.py            # 16 streams, 64 decode steps, the default model
    python bench/structured_overhead.py --streams 32 --steps 128 --backend mlx

Two engines on the same weights, one with every stream constrained and one with none, take their
steps in turn, so both see the same load on a shared machine; each decode step (every stream one
token) is timed, and the figure is the median.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from edgeserve.config import EngineConfig
from edgeserve.engine.llm_engine import LLMEngine
from edgeserve.engine.prompts import Prompts
from edgeserve.models.catalog import DEFAULT_MODEL
from edgeserve.models.loader import load_model
from edgeserve.sampling_params import SamplingParams

# Long enough that no stream's grammar completes within the timed steps.
SCHEMA = {"type": "array", "minItems": 64, "items": {
    "type": "object", "required": ["name", "count", "tags"], "additionalProperties": False,
    "properties": {"name": {"type": "string"}, "count": {"type": "integer"},
                   "tags": {"type": "array", "items": {"enum": ["new", "used", "sale"]}}}}}


def add_streams(engine: LLMEngine, streams: int, max_tokens: int, temperature: float, constrained: bool) -> None:
    prompt = Prompts.for_engine(engine).chat([{"role": "user", "content": "List the items in the shop as JSON."}])
    for i in range(streams):
        engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=i,
                                                  ignore_eos=True, json_schema=SCHEMA if constrained else None))


def timed_step(engine: LLMEngine, streams: int) -> float | None:
    """One step's seconds, if it was a decode step of every stream; else None."""
    start = time.perf_counter()
    engine.step()
    took = time.perf_counter() - start
    st = engine.stats()
    return took if st.last_batch_seqs == streams and st.last_batch_tokens == streams else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="0 (greedy) times the masks alone; above, each row also samples in Python")
    args = parser.parse_args()
    model = load_model(args.model)
    # guesses checked against the grammar (speculative decoding, on by default on the CPU) would blur what masks cost
    config = EngineConfig(backend=args.backend, kv_memory="256MiB", speculative="off")
    engines = {"free": LLMEngine(model, config), "constrained": LLMEngine(model, config)}
    for name, engine in engines.items():
        add_streams(engine, args.streams, args.steps + 4, args.temperature, name == "constrained")
    times: dict[str, list[float]] = {name: [] for name in engines}
    while any(e.has_unfinished() for e in engines.values()):
        for name, engine in engines.items():  # in turn: the same load on the machine for both
            if engine.has_unfinished() and (took := timed_step(engine, args.streams)) is not None:
                times[name].append(took)
    free, constrained = (statistics.median(times[name]) * 1e3 for name in engines)
    print(json.dumps({"backend": engines["free"].backend.describe(), "streams": args.streams,
                      "temperature": args.temperature, "steps_timed": len(times["free"]),
                      "free_step_ms": round(free, 2), "constrained_step_ms": round(constrained, 2),
                      "overhead_pct": round(100 * (constrained / free - 1), 1)}))


if __name__ == "__main__":
    main()
