"""Stored responses, for GET / DELETE and for `previous_response_id`: the response object and
the conversation it ended (its prompt's messages and its own output as the assistant's turn),
which the next turn's prompt starts with, so the prefix cache holds that prompt already. One
API process's memory, least recently used first out, `max_entries` at most."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from kiln.server.protocol import ChatMessage

DEFAULT_MAX_ENTRIES = 1024


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]
    conversation: list[ChatMessage]  # without the request's instructions (not carried over)


class ResponseStore:
    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        self.max_entries = max_entries
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, stored: StoredResponse) -> None:
        key = stored.response["id"]
        self._entries[key] = stored
        self._entries.move_to_end(key)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        stored = self._entries.get(response_id)
        if stored is not None:
            self._entries.move_to_end(response_id)
        return stored

    def delete(self, response_id: str) -> bool:
        return self._entries.pop(response_id, None) is not None
