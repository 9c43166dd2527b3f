"""Stored responses, for GET / DELETE and for `previous_response_id`: the response object and
the conversation it ended (its prompt's messages and its own output as the assistant's turn),
which the next turn's prompt starts with, so the prefix cache holds that prompt already.

A SQLite database, least recently used first out, `max_entries` at most: in this process's
memory by default, or a file that every API process of `kiln serve --api-server-count N` opens
(the launcher makes it in the server's private directory), so a follow-up, a GET or a DELETE
finds the response whichever API process answers. Each call is one short statement (SQLite
serialises the processes' writes); the file is scratch, so nothing is synced to disk."""

from __future__ import annotations

import json
import sqlite3
import threading
from dataclasses import dataclass
from typing import Any

import orjson

from kiln.server.protocol import ChatMessage

DEFAULT_MAX_ENTRIES = 1024
IN_MEMORY = ":memory:"
BUSY_TIMEOUT_S = 10.0  # another process's write holds the file for microseconds, not seconds

# `used` orders the entries by their last use across processes: each put or get takes the
# largest value plus one, inside its own statement (SQLite runs one writer at a time).
_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS responses "
    "(id TEXT PRIMARY KEY, used INTEGER NOT NULL, body BLOB NOT NULL)",
    "CREATE INDEX IF NOT EXISTS responses_used ON responses (used)",
)
_NEXT_USE = "(SELECT COALESCE(MAX(used), 0) + 1 FROM responses)"


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]
    conversation: list[ChatMessage]  # without the request's instructions (not carried over)


def json_bytes(data: Any) -> bytes:
    """`data` as JSON: orjson's, or the json module's for what orjson refuses (an integer beyond
    64 bits in a client's tool schema)."""
    try:
        return orjson.dumps(data)
    except TypeError:
        return json.dumps(data).encode()


def _encode(stored: StoredResponse) -> bytes:
    messages = [m.model_dump(mode="json", exclude_none=True) for m in stored.conversation]
    return json_bytes({"response": stored.response, "conversation": messages})


def _decode(body: bytes) -> StoredResponse:
    data = orjson.loads(body)
    messages = [ChatMessage.model_validate(m) for m in data["conversation"]]
    return StoredResponse(data["response"], messages)


class ResponseStore:
    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES, path: str = IN_MEMORY) -> None:
        """`path`: the database file the API processes share; IN_MEMORY: this process's own."""
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        self.max_entries = max_entries
        self._lock = threading.Lock()  # one connection; a test may call from several threads
        # Autocommit: each statement is its own transaction, so no lock outlives a call.
        self._db = sqlite3.connect(
            path, timeout=BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False
        )
        if path != IN_MEMORY:
            self._db.execute("PRAGMA journal_mode=WAL")  # readers never wait for the writer
        self._db.execute("PRAGMA synchronous=OFF")  # scratch: lost with the server anyway
        for statement in _SCHEMA:
            self._db.execute(statement)

    def __len__(self) -> int:
        with self._lock:
            return int(self._db.execute("SELECT COUNT(*) FROM responses").fetchone()[0])

    def put(self, stored: StoredResponse) -> None:
        body = _encode(stored)
        with self._lock:
            self._db.execute(
                f"INSERT OR REPLACE INTO responses (id, used, body) VALUES (?, {_NEXT_USE}, ?)",
                (stored.response["id"], body),
            )
            self._db.execute(
                "DELETE FROM responses WHERE used <= "
                "(SELECT used FROM responses ORDER BY used DESC LIMIT 1 OFFSET ?)",
                (self.max_entries,),
            )

    def get(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            # fetchall: the statement runs to its end (and commits) before the lock goes.
            rows = self._db.execute(
                f"UPDATE responses SET used = {_NEXT_USE} WHERE id = ? RETURNING body",
                (response_id,),
            ).fetchall()
        return _decode(rows[0][0]) if rows else None

    def delete(self, response_id: str) -> bool:
        with self._lock:
            cursor = self._db.execute("DELETE FROM responses WHERE id = ?", (response_id,))
            return cursor.rowcount > 0

    def close(self) -> None:
        with self._lock:
            self._db.close()
