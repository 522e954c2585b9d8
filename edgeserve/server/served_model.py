"""One loaded model as the routes use it: its engine's door, and the prompt-side work that turns what a request
says into token ids or a 400 naming the field at fault."""

from __future__ import annotations

import dataclasses

from edgeserve.engine.async_engine import AsyncEngine
from edgeserve.errors import EdgeserveError, PromptTooLongError
from edgeserve.sampling_params import SamplingParams
from edgeserve.server.errors import APIError
from edgeserve.text.chat_template import ChatTemplateError
from edgeserve.text.tool_calls import after_reasoning
from edgeserve.text.tool_stream import opens_reasoning

# A token spells at most a few dozen characters in any real vocabulary, so a text this many times
# longer than the context cannot fit whatever it says: refused before paying to tokenize it.
MAX_CHARS_PER_TOKEN = 32
REASONING_TAIL_TOKENS = 8  # enough of a prompt's end to hold "<think>" and the newlines around it


class ServedModel:
    """A loaded model: `aengine`, and the checks and prompt rendering every API shares."""

    def __init__(self, aengine: AsyncEngine):
        self.aengine = aengine

    def check_text_length(self, chars: int, param: str) -> None:
        """Refuse text too long for the context at any tokenization, before tokenizing it."""
        context = self.aengine.info.max_model_len
        if chars > MAX_CHARS_PER_TOKEN * context:
            raise APIError(400, f"{param} has {chars} characters, far more than the model's context of "
                                f"{context} tokens can hold", param=param, code="context_length_exceeded")

    def check_prompt(self, ids: list[int], param: str) -> None:
        """A 400 naming param where the prompt holds ids the tokenizer does not know, or cannot run (too long for
        the context or the pool)."""
        vocab = self.aengine.tokenizer.vocab_size  # the API speaks the tokenizer's ids, not the model's padding
        if any(not 0 <= t < vocab for t in ids):
            raise APIError(400, f"{param} holds token ids outside the vocabulary (0..{vocab - 1})",
                           param=param, code="invalid_value")
        try:
            self.aengine.check_prompt(ids)
        except PromptTooLongError as exc:
            raise APIError(400, str(exc), param=param, code="context_length_exceeded") from exc
        except EdgeserveError as exc:
            raise APIError(400, str(exc), param=param, code="invalid_value") from exc

    async def prompt_ids(self, inputs: list[str | list[int]], param: str) -> list[list[int]]:
        """Plain prompts (texts, tokenized as the model wants, or token ids) as token ids; a 400 naming param where
        one cannot run."""
        prompts = []
        for item in inputs:
            if isinstance(item, str):
                self.check_text_length(len(item), param)
                ids = await self.aengine.tokenize(item)
            else:
                ids = list(item)
            self.check_prompt(ids, param)
            prompts.append(ids)
        return prompts

    async def embed(self, inputs: list[str | list[int]], param: str) -> tuple[list[list[float]], int]:
        """Unit-length embeddings of the inputs (texts or token ids), batched in one forward pass, and the tokens
        they took; a 400 naming param where an input cannot run or all do not fit the KV pool at once."""
        prompts = await self.prompt_ids(inputs, param)
        try:
            vectors = await self.aengine.embed(prompts)
        except PromptTooLongError as exc:
            raise APIError(400, str(exc), param=param, code="context_length_exceeded") from exc
        return vectors.tolist(), sum(len(p) for p in prompts)

    async def chat_prompt(self, messages: list[dict], tools: list[dict] | None, param: str) -> list[int]:
        """Template messages (and tools) as prompt ids through the model's chat template; a 400 naming param where
        they cannot render or run."""
        context = self.aengine.info.max_model_len
        if len(messages) > context:  # each renders to a token at least: refused before rendering them all
            raise APIError(400, f"{param} holds {len(messages)} messages, more than the model's context of "
                                f"{context} tokens can hold", param=param, code="context_length_exceeded")
        self.check_text_length(sum(len(m["content"]) for m in messages), param)
        try:
            ids = await self.aengine.chat_prompt(messages, tools)
        except ChatTemplateError as exc:
            raise APIError(400, str(exc), param=param, code="invalid_value") from exc
        self.check_prompt(ids, param)
        return ids

    def opens_reasoning(self, ids: list[int]) -> bool:
        """Whether a rendered prompt opened a reasoning section for the answer (its last tokens say)."""
        return opens_reasoning(self.aengine.tokenizer.decode(ids[-REASONING_TAIL_TOKENS:]))

    @staticmethod
    def after_reasoning(params: SamplingParams, in_reasoning: bool) -> SamplingParams:
        """params, their grammar (JSON or Lark) binding only once the reasoning section the prompt opened ends (a
        grammar with a trigger waits for it anyway)."""
        if not in_reasoning or not params.constrained or params.grammar_trigger is not None:
            return params
        grammar = after_reasoning(*params.constraint)  # type: ignore[misc]
        return params if grammar is None else dataclasses.replace(params, json_schema=None, grammar=grammar)
