"""Offline batch generation: LLM(model).generate(prompts, params) runs them all through one engine."""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from tqdm import tqdm

from edgeserve.config import EngineConfig
from edgeserve.engine.async_engine import AsyncEngine
from edgeserve.engine.llm_engine import LLMEngine
from edgeserve.engine.output import Completion
from edgeserve.sampling_params import SamplingParams

T = TypeVar("T")


class LLM:
    """`LLM(model, EngineConfig(...))`; keyword arguments override single config fields.

    The model is loaded by name or path (`models.loader.load_model`) and served by an engine thread behind
    `engine`, the same door the server and the chat use; `generate` waits for it, so needs no event loop.
    """

    def __init__(self, model: str = "smollm2-135m-instruct", config: EngineConfig | None = None, **overrides: Any):
        self.engine = AsyncEngine(LLMEngine.from_name(model, config, **overrides))
        # the engine thread holds the engine, not this object: it stops when this object goes
        weakref.finalize(self, self.engine.shutdown)

    def generate(self, prompts: list[str | list[int]], params: SamplingParams | list[SamplingParams] | None = None,
                 progress: bool = False) -> list[Completion]:
        """Generate for every prompt at once (continuous batching); results in prompt order.

        Every prompt and its params are checked before any runs: a bad one raises (EdgeserveError).
        """
        params_list = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params_list)} SamplingParams")
        ids = [self.engine.prompts.encode(p) if isinstance(p, str) else list(p) for p in prompts]
        for prompt_ids, sp in zip(ids, params_list):
            self.engine.check_prompt(prompt_ids)
            self.engine.prompts.compile_grammar(sp)
        return _wait(self._generate(ids, params_list, progress))

    async def _generate(self, prompts: list[list[int]], params: list[SamplingParams], progress: bool
                        ) -> list[Completion]:
        with tqdm(total=len(prompts), desc="generate", disable=not progress) as bar:

            async def one(prompt_ids: list[int], sp: SamplingParams) -> Completion:
                completion: Completion | None = None
                async for out in self.engine.generate(prompt_ids, sp):
                    completion = completion or Completion(out.request_id)
                    completion.add(out)
                bar.update(1)
                return completion

            return list(await asyncio.gather(*(one(p, sp) for p, sp in zip(prompts, params))))


def _wait(coro: Coroutine[Any, Any, T]) -> T:
    """Run coro to its end from synchronous code, on a loop of its own (a thread's where this one runs a loop)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with ThreadPoolExecutor(1) as pool:  # inside a running loop (a notebook): asyncio.run refuses to nest
        return pool.submit(asyncio.run, coro).result()
