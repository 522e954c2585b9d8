"""Offline batch generation: LLM(model).generate(prompts, params) runs them all through one engine."""

from __future__ import annotations

from typing import Any

from tqdm import tqdm

from edgeserve.config import EngineConfig
from edgeserve.engine.llm_engine import LLMEngine
from edgeserve.engine.output import Completion, RequestOutput
from edgeserve.sampling_params import SamplingParams


class LLM:
    """`LLM(model, EngineConfig(...))`; keyword arguments override single config fields."""

    def __init__(self, model: str = "smollm2-135m-instruct", config: EngineConfig | None = None, **overrides: Any):
        self.engine = LLMEngine.from_name(model, config, **overrides)

    def generate(self, prompts: list[str | list[int]], params: SamplingParams | list[SamplingParams] | None = None,
                 progress: bool = False) -> list[Completion]:
        """Generate for every prompt at once (continuous batching); results in prompt order."""
        params_list = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        ids = [self.engine.add_request(p, sp) for p, sp in zip(prompts, params_list)]
        with tqdm(total=len(ids), desc="generate", disable=not progress) as bar:

            def count_finished(outputs: list[RequestOutput]) -> None:
                bar.update(sum(out.finished for out in outputs))

            results = self.engine.run_to_completion(count_finished)
        return [results[rid] for rid in ids]
