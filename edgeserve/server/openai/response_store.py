"""The Responses API's stored responses, in memory: each body (for GET /v1/responses/{id}) and its conversation (for
a later request's previous_response_id), the most recent STORED_RESPONSES of them; a restart forgets them all."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

STORED_RESPONSES = 256


@dataclass(frozen=True)
class StoredResponse:
    body: dict[str, Any]
    conversation: list[dict[str, Any]]  # template messages: the input (less its instructions) and the output


class ResponseStore:
    """The last `size` responses stored, by id; the oldest go first."""

    def __init__(self, size: int = STORED_RESPONSES):
        self.size = size
        self._responses: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, response: StoredResponse) -> None:
        self._responses[response.body["id"]] = response
        self._responses.move_to_end(response.body["id"])
        while len(self._responses) > self.size:
            self._responses.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        return self._responses.get(response_id)
