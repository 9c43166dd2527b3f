"""Incremental detokenization: token ids in, text deltas that are safe to show out.

One `IncrementalDetokenizer` lives per request (per completion). Each engine step feeds it the new
token ids; it answers with the text those tokens add, never a broken UTF-8 character and never
any part of a stop string. The cost per token is O(1): only a small window of ids is decoded, the
way vLLM's `detokenize_incrementally` does it with `prefix_offset`/`read_offset`.

Pure Python on purpose (no torch): the engine's control plane imports it.
"""

from __future__ import annotations

import re
import weakref
from collections.abc import Sequence
from functools import lru_cache
from typing import Any, Protocol

# What decoding yields for bytes that do not (yet) form a whole UTF-8 character.
_REPLACEMENT_CHAR = "\ufffd"

# Prompt ids decoded in front of the output. The output continues the prompt, so its first token
# must be decoded *after* something: sentencepiece decoders strip the leading "▁" of whatever
# comes first in a decode. Several ids rather than one, so that a skipped special token or two at
# the end of a chat prompt still leave a real token in front (vLLM uses 5 too).
_NUM_PROMPT_CONTEXT_IDS = 5


class TokenizerLike(Protocol):
    """What the detokenizer needs: a Hugging Face tokenizer, or anything shaped like one."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = ..., **kwargs: Any) -> str:
        """Text of `token_ids`; bytes of an incomplete UTF-8 character come out as U+FFFD."""
        ...

    def convert_ids_to_tokens(self, ids: int) -> str:
        """The vocabulary entry (raw token string) of one id."""
        ...


class IncrementalDetokenizer:
    """Turns one request's generated token ids into streamed text, with stop strings.

    Contract:
    - `append(ids)` returns the text delta that is now final; `text` is the concatenation of all
      deltas. After `flush()` (and when no stop string matched), `text` equals
      `tokenizer.decode(output_token_ids, skip_special_tokens=...)` for tokenizers whose decoding
      is context free (byte-level BPE). A sentencepiece tokenizer keeps the leading space of the
      first output token, which `decode` alone would strip: the output continues the prompt.
    - Text after each call is a prefix of the final text: a character whose bytes are split across
      tokens is held back until it completes, a stop string that may be forming is held back until
      it either matches or cannot match any more.
    - When a stop string matches, `stop_string` is set, the text ends right before it (right after
      it with `include_stop_str_in_output`), and every later `append`/`flush` returns "".
      Among several stop strings, the one whose match ends first wins (ties: the one that starts
      first), which is what feeding the text one character at a time would find.
    - `output_token_ids` holds the ids appended, up to and including the one whose text completed
      the stop string; ids after it in the same `append` are dropped.
    - Tokenizers with `clean_up_tokenization_spaces` set are decoded without that cleanup: it
      rewrites text across token boundaries, which a stream cannot take back.
    """

    def __init__(
        self,
        tokenizer: TokenizerLike,
        prompt_token_ids: Sequence[int],
        *,
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
        spaces_between_special_tokens: bool = True,
    ) -> None:
        self._stop = [stop] if isinstance(stop, str) else list(stop)
        if any(not s for s in self._stop):
            raise ValueError(f"stop strings must not be empty, got {self._stop!r}")
        self._tokenizer = tokenizer
        self._decode_kwargs: dict[str, Any] = {"skip_special_tokens": skip_special_tokens}
        if getattr(tokenizer, "clean_up_tokenization_spaces", False):
            self._decode_kwargs["clean_up_tokenization_spaces"] = False
        if not spaces_between_special_tokens:
            # Only passed when off: True is every tokenizer's default, and a duck-typed tokenizer
            # need not know the keyword (fast HF tokenizers accept and ignore it).
            self._decode_kwargs["spaces_between_special_tokens"] = False
        self._include_stop = include_stop_str_in_output
        self._single_id_text = _single_id_cache(tokenizer, self._decode_kwargs)
        max_partial_stop_len = max(map(len, self._stop), default=1) - 1
        # A stop string still forming is either held back (its start may not be shown) or, when
        # it is kept in the output anyway, emitted; then the next search must look back into the
        # emitted text for it. One or the other, never both.
        self._max_held_chars = 0 if include_stop_str_in_output else max_partial_stop_len
        self._max_lookback_chars = max_partial_stop_len if include_stop_str_in_output else 0

        self.text = ""
        self.output_token_ids: list[int] = []
        self.stop_string: str | None = None
        self._finished = False
        self._held_text = ""  # decoded, complete characters not yet emitted (stop strings)

        context_ids = list(prompt_token_ids[-_NUM_PROMPT_CONTEXT_IDS:])
        context_text = self._decode(context_ids)
        if context_text.endswith(_REPLACEMENT_CHAR):
            # The prompt ends inside a character; the output's first bytes may complete it, and
            # the text before them would change. Decoding the output on its own stays exact.
            context_ids, context_text = [], ""
        # The window: ids[:read_offset] were already turned into text (it starts at vLLM's
        # prefix_offset and is trimmed there, so it never grows past a few tokens);
        # `_prefix_text` is their decode, which decodes of the longer window extend.
        self._window_ids = context_ids
        self._read_offset = len(context_ids)
        self._prefix_text = context_text

    def append(self, new_token_ids: Sequence[int]) -> str:
        """Feed newly generated ids; return the text delta that is now safe to show (maybe "")."""
        deltas = []
        for token_id in new_token_ids:
            if self._finished:
                break
            self.output_token_ids.append(token_id)
            new_text = self._decode_next(token_id)
            if new_text:
                deltas.append(self._release(new_text, final=False))
        return "".join(deltas)

    def flush(self) -> str:
        """The request finished (EOS, length, abort): release all held-back text.

        Text held only because it could start a stop string is real output now. A character that
        never completed is released the way `decode` shows it (U+FFFD), so `text` stays equal to
        the decode of the ids. Calls after the first return "".
        """
        if self._finished:
            return ""
        full_text = self._decode(self._window_ids)
        delta = self._release(full_text[len(self._prefix_text) :], final=True)
        self._finished = True
        return delta

    def _decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, **self._decode_kwargs) if token_ids else ""

    def _decode_next(self, token_id: int) -> str:
        """Add one id to the window; return the complete characters it adds (maybe "")."""
        self._window_ids.append(token_id)
        window_text = self._decode(self._window_ids)
        if len(window_text) <= len(self._prefix_text) or window_text.endswith(_REPLACEMENT_CHAR):
            # Nothing visible yet (a skipped special token), or a character still incomplete: keep
            # the window as is, so the next decode sees these bytes together with what follows.
            return ""
        new_text = window_text[len(self._prefix_text) :]
        # Slide: the ids just read become the prefix that leads the next decode.
        del self._window_ids[: self._read_offset]
        self._read_offset = len(self._window_ids)
        if self._read_offset == 1 and self._single_id_text is not None:
            # Nearly always one id (the one just read): its decode alone, the same for every
            # request, is looked up rather than decoded again; one of the two decodes a token
            # costs (~3.5 us each, a few ms a step at 512 requests).
            token_id = self._window_ids[0]
            text = self._single_id_text.get(token_id)
            if text is None:
                text = self._single_id_text[token_id] = self._decode(self._window_ids)
            self._prefix_text = text
        else:
            self._prefix_text = self._decode(self._window_ids)
        return new_text

    def _release(self, new_text: str, *, final: bool) -> str:
        """Emit held + new text, minus what may start a stop string (all of it when final)."""
        if not self._stop:  # nothing is ever held or looked back at: all of it, as is
            self.text += new_text
            return new_text
        lookback = self.text[max(0, len(self.text) - self._max_lookback_chars) :]
        text = lookback + self._held_text + new_text
        # Any match ends in the new text: the rest was searched when it came in. So the search
        # costs O(new text + longest stop string), whatever the length of the output.
        match = self._find_stop(text)
        if match is not None:
            stop_str, start = match
            self.stop_string = stop_str
            self._finished = True
            self._held_text = ""
            # Held-back text never contains the start of a match, so `start >= len(lookback)`.
            delta = text[len(lookback) : start + len(stop_str) if self._include_stop else start]
        else:
            num_held = 0 if final else self._num_chars_to_hold(text)
            delta = text[len(lookback) : len(text) - num_held]
            self._held_text = text[len(text) - num_held :]
        self.text += delta
        return delta

    def _find_stop(self, text: str) -> tuple[str, int] | None:
        """The stop string whose first match in `text` ends first (then starts first), and where."""
        best: tuple[int, int, str] | None = None
        for stop_str in self._stop:
            start = text.find(stop_str)
            if start >= 0:
                candidate = (start + len(stop_str), start, stop_str)
                if best is None or candidate[:2] < best[:2]:
                    best = candidate
        return None if best is None else (best[2], best[1])

    def _num_chars_to_hold(self, text: str) -> int:
        """Length of the longest tail of `text` that is a proper prefix of some stop string."""
        for num_chars in range(min(len(text), self._max_held_chars), 0, -1):
            tail = text[-num_chars:]
            if any(stop_str.startswith(tail) for stop_str in self._stop):
                return num_chars
        return 0


# tokenizer -> {decode kwargs -> {token id -> its decode alone}}: decode is a pure function of the
# ids and the kwargs, so every detokenizer of a tokenizer shares one table (at most a vocabulary's
# worth of short strings), which goes with the tokenizer.
_SINGLE_ID_TEXT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _single_id_cache(tokenizer: TokenizerLike, decode_kwargs: dict) -> dict[int, str] | None:
    """The shared table of one-id decodes for this tokenizer and these kwargs (None: the
    tokenizer cannot be weakly referenced, so nothing is cached)."""
    try:
        per_kwargs = _SINGLE_ID_TEXT.get(tokenizer)
        if per_kwargs is None:
            per_kwargs = _SINGLE_ID_TEXT[tokenizer] = {}
    except TypeError:
        return None
    return per_kwargs.setdefault(tuple(sorted(decode_kwargs.items())), {})


_BYTE_FALLBACK_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def decode_token(tokenizer: TokenizerLike, token_id: int) -> str:
    """The text of one token, for logprob display.

    A token that holds only part of a UTF-8 character (byte-level BPE, sentencepiece byte
    fallback) has no text of its own; it is shown as OpenAI's API shows such tokens:
    "bytes:" followed by its bytes, printable ASCII as is and the rest as `\\xNN`.
    Special tokens are shown as their text.
    """
    text = tokenizer.decode([token_id], skip_special_tokens=False)
    token = tokenizer.convert_ids_to_tokens(token_id)
    if _REPLACEMENT_CHAR in text:
        raw = _token_bytes(token) if isinstance(token, str) else None
        if raw is not None:
            return "bytes:" + "".join(
                chr(b) if 0x20 <= b < 0x7F and b != 0x5C else f"\\x{b:02x}" for b in raw
            )
    elif isinstance(token, str) and token.startswith("▁") and not text.startswith(" "):
        # Sentencepiece decoders drop the leading space of the first token of a decode; a lone
        # token is always first, yet " Paris" and "Paris" are different tokens to show.
        text = " " + text
    return text


def _token_bytes(token: str) -> bytes | None:
    """The bytes a raw token string stands for, if it is a byte-fallback or byte-level token."""
    match = _BYTE_FALLBACK_TOKEN.fullmatch(token)
    if match:
        return bytes([int(match.group(1), 16)])
    byte_of_char = _byte_level_decoder()
    if token and all(c in byte_of_char for c in token):
        return bytes(byte_of_char[c] for c in token)
    return None


@lru_cache(maxsize=1)
def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, char -> byte: printable bytes stand for themselves, the other
    68 are shifted to U+0100 and up (so that every byte is a visible character in vocab files)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    byte_of_char = {chr(b): b for b in printable}
    shifted = sorted(set(range(256)) - set(printable))
    byte_of_char.update({chr(0x100 + n): b for n, b in enumerate(shifted)})
    return byte_of_char
