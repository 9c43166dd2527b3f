"""A GGUF's byte-level BPE tokenizer (llama.cpp's "gpt2" model: SmolLM2, Llama 3, Qwen2), built
straight from the metadata kiln's own header parser already read.

transformers builds the same tokenizer with `from_pretrained(dir, gguf_file=...)`, but on the way
it re-reads the whole header with its own reader (~0.4-0.9 s for 49k strings) and imports
`transformers.models` (every model's import structure, ~1.4 s on a 2-core machine) for the
tokenizer classes of its GGUF table: together most of the 1.7-5 s the tokenizer took of `kiln
generate`'s startup. This builds the `tokenizers.Tokenizer` the way transformers' GGUF converter
does for a "gpt2" file (the byte alphabet respelling, BPE without dropout or fused unknowns, the
control tokens as special added tokens, user-defined ones as plain added tokens, the
pre-tokenizer split of the file's `tokenizer.ggml.pre`), and wraps it in the same
`PreTrainedTokenizerFast` with the same special tokens and chat template.
tests/checkpoint/test_gguf_fast_paths.py checks it against transformers' own on the embedded
model: the serialized backend, encodings of varied text, special tokens and the chat template's
output.
Other tokenizer models (sentencepiece "llama", "t5", ...) go through transformers as before.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

# transformers' GGUF_PRE_TOKENIZER_SPLITS for the byte-level "pre" types kiln's models use; any
# other "pre" value gets ByteLevel's own GPT-2 split, as transformers does.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "dbrx"), _LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen"), _QWEN2_SPLIT),
}
# Pre types transformers knows and this module does not: left to transformers, never guessed.
_LEFT_TO_TRANSFORMERS = {
    "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2", "jina-v5-nano", "tekken", "kormo",
    "f2llmv2", "megrez", "qwen35", "gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2",
}  # fmt: skip
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp's token types
_SPECIAL_IDS = {
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id",
    "pad_token": "tokenizer.ggml.padding_token_id",
}


@functools.cache
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (each byte-level token is spelled in it)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    keep += range(ord("®"), ord("ÿ") + 1)
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def can_build(metadata: dict[str, Any]) -> bool:
    """Whether this module builds the file's tokenizer (else transformers does)."""
    return (
        metadata.get("tokenizer.ggml.model") == "gpt2"
        and "tokenizer.ggml.merges" in metadata
        and metadata.get("tokenizer.ggml.pre") not in _LEFT_TO_TRANSFORMERS
    )


def build_tokenizer(metadata: dict[str, Any]) -> PreTrainedTokenizerFast:
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokens = list(metadata["tokenizer.ggml.tokens"])
    types = metadata.get("tokenizer.ggml.token_type") or ()
    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab = {
        t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")): i
        for i, t in enumerate(tokens)
    }
    merges = [tuple(m.split(" ")) for m in metadata["tokenizer.ggml.merges"]]
    backend = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=merges,
            dropout=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
        )
    )
    split = _SPLITS.get(metadata.get("tokenizer.ggml.pre", ""))
    if split is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    backend.decoder = decoders.ByteLevel()
    # A control token spelled outside the byte alphabet is a llama.cpp mislabel (transformers
    # skips it too: adding it would grow the vocabulary past the embedding).
    control = [
        AddedToken(t, normalized=False, special=True)
        for t, kind in zip(tokens, types)
        if kind == _CONTROL and set(t) <= alphabet
    ]
    backend.add_special_tokens(control)
    user_defined = [
        AddedToken(t, normalized=False, special=False)
        for t, kind in zip(tokens, types)
        if kind == _USER_DEFINED and t in vocab
    ]
    backend.add_tokens(user_defined)
    config: dict[str, Any] = {
        name: tokens[metadata[key]] if metadata.get(key) is not None else None
        for name, key in _SPECIAL_IDS.items()
    }
    for flag in ("add_bos_token", "add_eos_token"):
        if f"tokenizer.ggml.{flag}" in metadata:
            config[flag] = metadata[f"tokenizer.ggml.{flag}"]
    if metadata.get("tokenizer.chat_template"):
        config["chat_template"] = metadata["tokenizer.chat_template"]
    # `tokenizer_object=` would deep-copy the backend (~0.5 s for 49k merges); a backend already
    # in place is taken as it is, as transformers' own tokenizer classes do (GPT2Tokenizer sets
    # `_tokenizer` before its base __init__).
    tokenizer: PreTrainedTokenizerFast = PreTrainedTokenizerFast.__new__(PreTrainedTokenizerFast)
    # transformers declares the class attribute as None; its __init__ sets a backend there.
    tokenizer._tokenizer = backend  # type: ignore[assignment]
    PreTrainedTokenizerFast.__init__(tokenizer, **config)
    return tokenizer
