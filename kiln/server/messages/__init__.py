"""Anthropic's Messages API (`/v1/messages`) over the chat template and the reply parsers."""

from kiln.server.messages.routes import router

__all__ = ["router"]
