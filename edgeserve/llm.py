"""Offline batch generation: LLM(model).generate(prompts, params) runs them all through one engine."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tqdm import tqdm

from edgeserve.engine.llm_engine import LLMEngine
from edgeserve.sampling_params import SamplingParams


@dataclass
class Completion:
    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    ttft: float | None
    elapsed: float
    logprobs: list[dict] = field(default_factory=list)


class LLM:
    def __init__(self, model: str = "smollm2-135m-instruct", **engine_kwargs: Any):
        self.engine = LLMEngine.from_name(model, **engine_kwargs)

    def generate(self, prompts: list[str | list[int]], params: SamplingParams | list[SamplingParams] | None = None,
                 progress: bool = False) -> list[Completion]:
        """Generate for every prompt at once (continuous batching); results in prompt order."""
        params_list = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        ids = [self.engine.add_request(p, sp) for p, sp in zip(prompts, params_list)]
        results: dict[str, Completion] = {
            rid: Completion(rid, "", [], None, 0, 0, None, 0.0) for rid in ids
        }
        with tqdm(total=len(ids), desc="generate", disable=not progress) as bar:
            while self.engine.has_unfinished():
                for out in self.engine.step():
                    c = results[out.request_id]
                    c.text += out.text
                    c.token_ids += out.token_ids
                    c.logprobs += out.logprobs
                    c.num_prompt_tokens, c.num_cached_tokens = out.num_prompt_tokens, out.num_cached_tokens
                    c.ttft, c.elapsed = out.ttft, out.elapsed
                    if out.finished:
                        c.finish_reason = out.finish_reason
                        bar.update(1)
        return [results[rid] for rid in ids]
