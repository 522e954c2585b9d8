"""One rank of a group that `mlx.launch` started, for tests/test_distributed.py: rank 0 runs greedy requests on
the cases' model and writes each one's tokens as JSON; the other ranks serve its steps.

    mlx.launch -n 2 -- python tests/distributed_rank.py pipeline CASES.json OUT.json
"""

from __future__ import annotations

import json
import sys

from edgeserve.cli.options import join_group
from edgeserve.config import EngineConfig
from edgeserve.engine.llm_engine import LLMEngine
from edgeserve.models.loader import load_model
from edgeserve.sampling_params import SamplingParams


def main(mode: str, cases_path: str, out_path: str) -> None:
    """CASES.json: {"model": a model file, "config": EngineConfig fields, "requests": [[id, prompt ids, max tokens],
    ...], "arrivals": {step: [id, ...]}} (requests not named in arrivals arrive at step 0)."""
    cases = json.loads(open(cases_path).read())
    config = EngineConfig(backend="mlx", distributed=None if mode == "none" else mode, **cases.get("config", {}))
    join_group(cases["model"], config)
    engine = LLMEngine(load_model(cases["model"]), config)
    # a split model's steps come back through the group one at a time: one rank alone steps so too, so that its
    # preemptions and prefix hits are comparable (it would otherwise run its decodes in bursts)
    engine.backend.chains_steps = False
    requests = {rid: (ids, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
                for rid, ids, n in cases["requests"]}
    later = {int(step): rids for step, rids in cases.get("arrivals", {}).items()}
    for rid in set(requests) - {r for rids in later.values() for r in rids}:
        engine.add_request(*requests[rid], request_id=rid)
    steps = 0

    def arrive(outputs: list) -> None:
        nonlocal steps
        steps += 1
        for rid in later.get(steps, []):
            engine.add_request(*requests[rid], request_id=rid)

    results = engine.run_to_completion(arrive)
    stats = engine.stats()
    engine.close()
    with open(out_path, "w") as f:
        json.dump({"tokens": {rid: c.token_ids for rid, c in results.items()}, "preemptions": stats.preemptions,
                   "prefix_hit_tokens": stats.prefix_hit_tokens, "prefix_ram_hit_tokens": stats.prefix_ram_hit_tokens}, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
