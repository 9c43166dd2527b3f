"""One xgrammar compiler per tokenizer, with compiled grammars cached by the spec's key.

The engine validates a request's spec when it arrives (validate(): xgrammar parses it without
the tokenizer, so a bad schema is a 400 before anything is queued, at a fraction of a compile's
cost) and starts its compile on a background thread (compile_async(): xgrammar compiles in C++
without the GIL, so the engine loop goes on stepping everyone else). The runner asks again when
the request first runs and gets the cached grammar. Both reach the same cache through
compiler_for() when they share a process (the in-process executor, also inside the server's
engine process; structured output is refused under the multiprocess executor).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from kiln.errors import InvalidRequestError
from kiln.sampling_params import GuidedDecodingParams

MAX_CACHED_GRAMMARS = 512  # distinct specs kept compiled; least recently used go first

_compilers: dict[tuple[int, int, tuple[int, ...]], GrammarCompilerCache] = {}
_compilers_lock = threading.Lock()


def compiler_for(
    tokenizer: Any, vocab_size: int, eos_token_ids: tuple[int, ...]
) -> GrammarCompilerCache:
    """The process's compiler for this tokenizer object and logits width."""
    key = (id(tokenizer), vocab_size, tuple(eos_token_ids))
    with _compilers_lock:
        compiler = _compilers.get(key)
        if compiler is None:
            compiler = _compilers[key] = GrammarCompilerCache(tokenizer, vocab_size, eos_token_ids)
        return compiler


class GrammarCompilerCache:
    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        import xgrammar as xgr

        if tokenizer is None:
            raise InvalidRequestError(
                "structured output needs the model's tokenizer (this model has none)",
                param="guided_decoding",
            )
        self.tokenizer = tokenizer  # held so its id() stays this compiler's key
        self.vocab_size = vocab_size
        self.info = _tokenizer_info(xgr, tokenizer, vocab_size, eos_token_ids)
        self._compiler = xgr.GrammarCompiler(self.info, max_threads=4, cache_enabled=False)
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._lock = threading.Lock()
        # One background compile at a time (each uses xgrammar's own threads); compiles under
        # way by spec key, so requests with the same new spec share one.
        self._background = ThreadPoolExecutor(1, thread_name_prefix="kiln-grammar-compile")
        self._compiling: dict[tuple[str, str], Future] = {}

    def validate(self, spec: GuidedDecodingParams) -> None:
        """Parse the spec without the tokenizer: InvalidRequestError names a bad one. Cheap
        next to a compile (no pass over the vocabulary); a cached spec is not parsed again."""
        with self._lock:
            if spec.key in self._cache or spec.key in self._compiling:
                return
        self._parse(*spec.key)

    def compile_async(self, spec: GuidedDecodingParams) -> Future:
        """A future of the CompiledGrammar, compiled on the background thread (done at once
        when cached). A failed compile's future holds its InvalidRequestError."""
        key = spec.key
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is None:
                future = self._compiling.get(key)
                if future is None:
                    future = self._compiling[key] = self._background.submit(self._run, spec)
                return future
            self._cache.move_to_end(key)
        done: Future = Future()
        done.set_result(compiled)
        return done

    def _run(self, spec: GuidedDecodingParams) -> Any:
        try:
            return self.compile(spec)
        finally:
            with self._lock:
                self._compiling.pop(spec.key, None)

    def compile(self, spec: GuidedDecodingParams) -> Any:
        """The xgrammar CompiledGrammar for a spec; InvalidRequestError names a bad one."""
        key = spec.key
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
                return compiled
        compiled = self._compile(*key)
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > MAX_CACHED_GRAMMARS:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, kind: str, text: str) -> Any:
        grammar = self._parse(kind, text)
        try:
            return self._compiler.compile_grammar(grammar)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise _invalid(kind, exc) from exc

    def _parse(self, kind: str, text: str) -> Any:
        """The spec as an xgrammar Grammar (parsed, not compiled: no tokenizer needed)."""
        import xgrammar as xgr

        try:
            if kind == "json":
                schema = json.loads(text)
                if not isinstance(schema, dict | bool):
                    raise ValueError("a JSON schema is an object")
                return self._json_schema_grammar(xgr, text)
            if kind == "json_object":
                return self._json_schema_grammar(xgr, '{"type": "object"}')
            if kind == "regex":
                return xgr.Grammar.from_regex(text)
            if kind == "choice":
                alternatives = " | ".join(_ebnf_literal(c) for c in json.loads(text))
                return xgr.Grammar.from_ebnf(f"root ::= {alternatives}")
            return xgr.Grammar.from_ebnf(text)
        except (RuntimeError, ValueError, TypeError) as exc:  # xgrammar's, with its parser's text
            raise _invalid(kind, exc) from exc

    def _json_schema_grammar(self, xgr: Any, schema: str) -> Any:
        # Compact JSON (no free whitespace): a model may otherwise emit spaces or newlines
        # until max_tokens, which is valid JSON never finished.
        grammar = str(xgr.Grammar.from_json_schema(schema, any_whitespace=False))
        # Two fixes to xgrammar 0.2.9's JSON strings: a string with minLength/maxLength takes
        # any character but quote, backslash, CR and LF, so raw control characters get through
        # (json.loads rejects them); and both kinds of string accept UTF-8-encoded surrogates
        # (U+D800..U+DFFF), which decode to three U+FFFD each. Use one strict class for both.
        for loose in _LOOSE_STRING_CHARS:
            grammar = grammar.replace(loose, _JSON_STRING_CHAR)
        return xgr.Grammar.from_ebnf(grammar)


def _invalid(kind: str, exc: BaseException) -> InvalidRequestError:
    param = "response_format" if kind in ("json", "json_object") else f"guided_{kind}"
    what = {
        "json": "JSON schema",
        "json_object": "JSON object",
        "regex": "regex",
        "choice": "choice",
        "grammar": "EBNF grammar",
    }[kind]
    message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return InvalidRequestError(f"invalid {what}: {message}", param=param)


def _tokenizer_info(xgr: Any, tokenizer: Any, vocab_size: int, eos_token_ids: tuple[int, ...]):
    """xgrammar's view of the vocabulary. The model's EOS ids end a grammar (EOS is allowed
    exactly when the grammar accepts). Special tokens (chat markers such as <|im_start|>) are
    blanked, so xgrammar never allows them: left as text they would match inside a JSON string,
    and vanish from the output under skip_special_tokens."""
    stop = list(eos_token_ids)
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop)
    special = set(getattr(tokenizer, "all_special_ids", []))
    decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    special |= {i for i, added in decoder.items() if getattr(added, "special", False)}
    special -= set(stop)
    if not special:
        return info
    encoded = [""] * vocab_size
    for token, index in tokenizer.get_vocab().items():
        if index < vocab_size and index not in special:
            encoded[index] = token
    return xgr.TokenizerInfo(
        encoded,
        vocab_type=info.vocab_type,
        vocab_size=vocab_size,
        stop_token_ids=stop,
        add_prefix_space=info.add_prefix_space,
    )


_LOOSE_STRING_CHARS = (r"[^\"\\\r\n]", r"[^\0-\x1f\"\\\r\n]")
_JSON_STRING_CHAR = r"[^\0-\x1f\"\\\uD800-\uDFFF]"


def _ebnf_literal(text: str) -> str:
    """A string literal of xgrammar's EBNF: double-quoted, with backslash escapes."""
    out = []
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\r":
            out.append("\\r")
        elif ch == "\t":
            out.append("\\t")
        elif ord(ch) < 0x20:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'
