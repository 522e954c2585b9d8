"""The prompt side of an engine: a chat rendered through the model's template, texts tokenized, prompts checked
against the context and the KV pool, grammars compiled.

None of it needs the engine thread: the tokenizer, the template and the limits are read-only once the
engine is built, and the grammar cache takes its own lock. So any thread may call it, and the door
(`AsyncEngine`) runs the slow parts on worker threads for callers on an event loop.
"""

from __future__ import annotations

from edgeserve.engine.constraints import Constraints
from edgeserve.engine.llm_engine import EngineInfo, LLMEngine
from edgeserve.sampling_params import SamplingParams
from edgeserve.text.chat_template import ChatTemplate
from edgeserve.text.tokenizer import Tokenizer
from edgeserve.text.tool_calls import ToolCallFormat


class Prompts:
    """Synchronous and safe on any thread; for an event loop, await AsyncEngine's methods instead."""

    def __init__(self, tokenizer: Tokenizer, info: EngineInfo, grammars: Constraints):
        self.tokenizer = tokenizer
        self.info = info
        self.chat_template = ChatTemplate.for_tokenizer(tokenizer)
        self._grammars = grammars

    @classmethod
    def for_engine(cls, engine: LLMEngine) -> Prompts:
        """The prompt side of engine (its tokenizer, limits and grammar cache)."""
        return cls(engine.tokenizer, engine.info, engine.constraints)

    @property
    def tool_format(self) -> ToolCallFormat:
        """How this model's chat template offers tools and how its answers call them."""
        return self.chat_template.tool_format

    def chat(self, messages: list[dict], tools: list[dict] | None = None,
             add_generation_prompt: bool = True) -> list[int]:
        """Render messages (offering tools) with the model's chat template and tokenize (BOS comes from the template).

        Raises ChatTemplateError where the template refuses the messages.
        """
        messages = [self._as_text(m) for m in messages]
        text = self.chat_template.render(messages, add_generation_prompt=add_generation_prompt, tools=tools)
        return self.tokenizer.encode(text, add_bos=False)

    def _as_text(self, message: dict) -> dict:
        """The message with the special tokens its text spells defused: control tokens come from the template alone,
        so a user cannot forge a turn (a "system" one, say) by writing its markup."""
        content = message.get("content")
        return {**message, "content": self.tokenizer.defuse(content)} if isinstance(content, str) else message

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        """A plain text prompt's token ids (with BOS where the model wants one, add_bos None, or as told)."""
        return self.tokenizer.encode(text, add_bos)

    def check(self, prompt_ids: list[int]) -> None:
        """Raise PromptTooLongError where the prompt cannot run even alone, EdgeserveError where it is malformed."""
        self.info.check_prompt(prompt_ids)

    def compile_grammar(self, params: SamplingParams) -> None:
        """Check params against the model's vocabulary and compile their grammar, if any, into the engine's cache
        (so the engine thread finds it compiled); InvalidParamsError, naming the parameter, where either fails."""
        self.info.check_params(params)
        self._grammars.compile(params)
