"""Rolling-window loglikelihood perplexity, as lm-evaluation-harness defines it.

lm-eval's `loglikelihood_rolling` (lm_eval/utils.py `get_rolling_token_windows` with
`context_len=1`, then `make_disjoint_window`) cuts a document's tokens into disjoint windows: the
first is conditioned on a prefix token (BOS, else EOS), each later one on the single token before
it. Every token is predicted exactly once, so the document's loglikelihood is the sum over its
windows. Its metrics (lm_eval/api/metrics.py) weight documents by their size: word and byte
perplexity are exp(-sum(loglikelihood) / sum(words or bytes)), bits per byte is
-sum(loglikelihood) / sum(bytes) / ln 2. A word is what `re.split(r"\\s+", text)` separates.

`max_length` is lm-eval's `max_length` model argument for its API models (`local-completions`
against `kiln serve`): one token is kept back for generation, so a window's prompt holds at most
`max_length - 1` tokens and predicts up to `max_length - 2` of them. kiln's engine has the same
limit (a prompt plus one generated token fit in `max_model_len`), so the default, the engine's
`max_model_len`, is the longest window the engine accepts, and these scores equal lm-eval's
`local-completions` run with `max_length=max_model_len`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from kiln.sampling_params import SamplingParams

# Windows per `llm.generate` call: the engine batches them; the bound keeps the held prompt
# logprobs (one dict per token) to a few hundred thousand entries.
WINDOWS_PER_CALL = 256


@dataclass(frozen=True)
class PerplexityResult:
    word_perplexity: float
    byte_perplexity: float
    bits_per_byte: float
    token_perplexity: float
    """exp(-loglikelihood / predicted tokens): depends on the tokenizer, unlike the three above."""
    num_tokens: int
    num_words: int
    num_documents: int
    loglikelihood: float
    """Sum over the documents, in nats."""


def rolling_token_windows(
    tokens: Sequence[int], prefix_token: int, max_seq_len: int
) -> Iterator[tuple[list[int], list[int]]]:
    """lm-eval's `get_rolling_token_windows(tokens, prefix_token, max_seq_len, context_len=1)`
    mapped through `make_disjoint_window`: (context, continuation) pairs whose continuations
    partition `tokens`; context + continuation is at most `max_seq_len + 1` tokens (the last
    needs no logits). A full window's context is the one token before it; the last window's
    context is longer, filling it to `max_seq_len + 1` tokens as lm-eval's does."""
    if max_seq_len < 1:
        raise ValueError(f"max_seq_len must be >= 1, got {max_seq_len}")
    tokens = list(tokens)
    if not tokens:
        return
    first = min(max_seq_len, len(tokens))
    yield [prefix_token], tokens[:first]
    predicted = first
    while predicted < len(tokens):
        # A window predicts up to max_seq_len tokens; its context fills it to max_seq_len + 1:
        # the one token before a full window, more before the shorter last one.
        end = predicted + min(len(tokens) - predicted, max_seq_len)
        yield tokens[end - max_seq_len - 1 : predicted], tokens[predicted:end]
        predicted = end


def count_words(text: str) -> int:
    return len(re.split(r"\s+", text))


def count_bytes(text: str) -> int:
    return len(text.encode("utf-8"))


def prefix_token_id(llm) -> int:
    """lm-eval's prefix token: the tokenizer's BOS, else its EOS (the model config's without a
    tokenizer)."""
    tokenizer = llm.get_tokenizer()
    for tid in (
        getattr(tokenizer, "bos_token_id", None),
        getattr(tokenizer, "eos_token_id", None),
    ):
        if tid is not None:
            return tid
    config = llm.engine.model_config
    return config.bos_token_id if config.bos_token_id is not None else config.eos_token_ids[0]


def scored_windows(
    llm,
    documents: Sequence[Sequence[int]],
    prefix_token: int,
    max_length: int | None = None,
    progress: Callable[[int, int], None] | None = None,
    show_progress: bool = False,
) -> Iterator[tuple[int, list[float]]]:
    """(document index, the log-probabilities of the window's predicted tokens) for every
    rolling window of every token document, in document and token order, scored by the engine's
    prompt logprobs; the windows go to the engine together. `progress(scored, total)`, if given,
    hears the predicted tokens scored so far: 0 first, then after each engine call.
    `show_progress`: a bar on stderr that moves as each window is scored (one engine call may
    hold every window of a task: minutes on a CPU)."""
    limit = llm.engine.max_model_len
    max_length = max_length or limit
    if not 3 <= max_length <= limit:
        raise ValueError(f"max_length must be in [3, max_model_len={limit}], got {max_length}")
    windows = [
        (doc_index, context, continuation)
        for doc_index, tokens in enumerate(documents)
        for context, continuation in rolling_token_windows(tokens, prefix_token, max_length - 2)
    ]
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0, ignore_eos=True)
    total_tokens = sum(len(tokens) for tokens in documents)
    scored = 0
    if progress is not None:
        progress(scored, total_tokens)
    for start in range(0, len(windows), WINDOWS_PER_CALL):
        batch = windows[start : start + WINDOWS_PER_CALL]
        outputs = llm.generate(
            [ctx + cont for _, ctx, cont in batch], params, use_tqdm=show_progress
        )
        for (doc_index, context, continuation), out in zip(batch, outputs, strict=True):
            positions = out.prompt_logprobs[len(context) :]
            yield (
                doc_index,
                [lps[t].logprob for lps, t in zip(positions, continuation, strict=True)],
            )
            scored += len(continuation)
        if progress is not None:
            progress(scored, total_tokens)


def token_loglikelihoods(
    llm,
    documents: Sequence[Sequence[int]],
    prefix_token: int,
    max_length: int | None = None,
    progress: Callable[[int, int], None] | None = None,
    show_progress: bool = False,
) -> list[float]:
    """Each token document's rolling loglikelihood (nats): scored_windows' sums."""
    totals = [0.0] * len(documents)
    windows = scored_windows(llm, documents, prefix_token, max_length, progress, show_progress)
    for doc_index, logprobs in windows:
        totals[doc_index] += math.fsum(logprobs)
    return totals


def perplexity_metrics(
    loglikelihoods: Sequence[float],
    num_tokens: Sequence[int],
    counted_texts: Sequence[str],
) -> PerplexityResult:
    """lm-eval's weighted perplexities over documents, words and bytes counted in
    `counted_texts` (wikitext counts them in the page before detokenization)."""
    ll = math.fsum(loglikelihoods)
    words = sum(count_words(t) for t in counted_texts)
    nbytes = sum(count_bytes(t) for t in counted_texts)
    tokens = sum(num_tokens)
    return PerplexityResult(
        word_perplexity=math.exp(-ll / words),
        byte_perplexity=math.exp(-ll / nbytes),
        bits_per_byte=-ll / nbytes / math.log(2),
        token_perplexity=math.exp(-ll / tokens),
        num_tokens=tokens,
        num_words=words,
        num_documents=len(loglikelihoods),
        loglikelihood=ll,
    )


def rolling_perplexity(
    llm,
    documents: list[str],
    max_length: int | None = None,
    *,
    counted_texts: list[str] | None = None,
    progress: Callable[[int, int], None] | None = None,
    show_progress: bool = False,
) -> PerplexityResult:
    """Perplexity of `llm` on text documents: each is tokenized without special tokens (as
    lm-eval's `tok_encode`), scored in rolling windows of `max_length` (default: the engine's
    max_model_len); words and bytes are counted in `counted_texts` (default: the documents, as
    lm-eval's generic loglikelihood_rolling tasks count them). `progress`: token_loglikelihoods'."""
    if not documents:
        raise ValueError("no documents to score")
    tokenizer = llm.get_tokenizer()
    if tokenizer is None:
        raise ValueError("this model has no tokenizer: use token_loglikelihoods")
    token_docs = [tokenizer.encode(d, add_special_tokens=False) for d in documents]
    lls = token_loglikelihoods(
        llm, token_docs, prefix_token_id(llm), max_length, progress, show_progress
    )
    return perplexity_metrics(lls, [len(t) for t in token_docs], counted_texts or documents)
