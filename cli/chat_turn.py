"""One chat turn, the same in `edgeserve chat` and every TUI session: the user's message joins the
conversation, the conversation is fitted into the context, the answer streams, and the exchange is kept
as far as it got (or taken back, when no answer came).

The front ends only show what happens: where the text goes, how errors and stops are told.
"""

from __future__ import annotations

from collections.abc import Callable

from edgeserve.cli.chat_clients import ChatClient, ReplyChunk, ReplyStats
from edgeserve.cli.conversation import Conversation
from edgeserve.errors import EdgeserveError
from edgeserve.sampling_params import SamplingParams


class Turn:
    """One exchange under way: the user's message is in the conversation, its answer not yet."""

    def __init__(self, client: ChatClient, conversation: Conversation, params: SamplingParams, dropped: int):
        self.client = client
        self.conversation = conversation
        self.params = params
        self.dropped = dropped  # the oldest messages that went to make room
        self.text = ""  # the answer so far

    @classmethod
    def begin(cls, client: ChatClient, conversation: Conversation, text: str) -> Turn:
        """Add the user's message and fit the conversation into the client's context.

        An EdgeserveError (the message does not fit even on its own) takes the message back.
        """
        conversation.add("user", text)
        try:
            params = conversation.sampling_params()
            dropped = client.fit(conversation, params)
        except EdgeserveError:
            conversation.pop_user()
            raise
        return cls(client, conversation, params, dropped)

    async def answer(self, request_id: str, on_chunk: Callable[[ReplyChunk], None]) -> ReplyStats | None:
        """Stream the answer, handing each chunk to on_chunk; return its stats.

        However the stream ends (done, failed or cancelled), the answer joins the conversation as far as
        it got; with no answer at all, the user's message goes back out, so the history stays in turns.
        """
        stats = None
        try:
            async for chunk in self.client.stream(self.conversation.messages(), self.params, request_id):
                self.text += chunk.text
                on_chunk(chunk)
                stats = chunk.stats or stats
        finally:
            if self.text:
                self.conversation.add("assistant", self.text)
            else:
                self.conversation.pop_user()
        return stats
