"""The tokenizer as kiln's API layers call it (the offline `LLM`, the server, the engine client).

A Hugging Face tokenizer (a GGUF file's is built as one) is what the loader hands over; this
Protocol names the part of it kiln uses, so a test may pass anything shaped like it. Optional
parts (`chat_template`, `get_vocab`, `bos_token_id`) are read with getattr where they are used.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, Protocol, cast

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class Tokenizer(Protocol):
    def encode(self, text: str, *, add_special_tokens: bool = ...) -> list[int]:
        """The ids of `text`; `add_special_tokens` adds what the model wants around it (BOS)."""
        ...

    def decode(
        self, token_ids: Sequence[int], skip_special_tokens: bool = ..., **kwargs: Any
    ) -> str:
        """Text of `token_ids`; bytes of an incomplete UTF-8 character come out as U+FFFD."""
        ...

    def convert_ids_to_tokens(self, ids: int) -> str:
        """The vocabulary entry (raw token string) of one id."""
        ...

    def apply_chat_template(
        self,
        conversation: Sequence[Mapping[str, Any]],
        *,
        tokenize: Literal[False],
        add_generation_prompt: bool = ...,
        **kwargs: Any,
    ) -> str:
        """The conversation rendered by the model's chat template, as text (kiln encodes it
        itself, without adding special tokens: the template holds them)."""
        ...


def from_transformers(tokenizer: PreTrainedTokenizerBase) -> Tokenizer:
    """A transformers tokenizer as a Tokenizer. It is one, though the type checker cannot tell:
    its methods also take a list of ids, `tokenize=True` and more, so their declared results are
    unions (one token or a list, text or ids) of which kiln's calls get the one named here."""
    return cast(Tokenizer, tokenizer)
