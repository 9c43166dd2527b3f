"""OpenAI's Responses API (`/v1/responses`) over the chat template, the reply parsers and a
bounded store of past responses."""

from kiln.server.responses.routes import router
from kiln.server.responses.store import ResponseStore

__all__ = ["ResponseStore", "router"]
