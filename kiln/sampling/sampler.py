"""Batched sampling: penalties, greedy, temperature, top-k/top-p/min-p, per-request seeds, logprobs.

Every step is a whole-batch tensor op, so the same code runs on the CPU and the GPU without host
syncs; the only Python loops are over rows (seeded generators, token-id lists), never the
vocabulary.
The sampler never writes into the caller's logits.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kiln.kernels import reference
from kiln.sampling.host_copy import to_device
from kiln.sampling.logits_processors import LogitsProcessor, default_logits_processors


@dataclass(frozen=True)
class LogprobsTensors:
    """Logprobs of one token per row plus the row's top-N alternatives."""

    token_ids: torch.Tensor  # [B, 1 + N] int64: column 0 the sampled (or given) token, then top-N
    logprobs: torch.Tensor  # [B, 1 + N] float32
    ranks: torch.Tensor  # [B] int64: rank of column 0's token in the vocabulary (1 = most likely)

    def to_host(self) -> LogprobsTensors:
        """Start the copy of each tensor to the host (pinned: asynchronous)."""
        return LogprobsTensors(
            *(t.to("cpu", non_blocking=True) for t in (self.token_ids, self.logprobs, self.ranks))
        )


@dataclass(frozen=True)
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [B] int64
    logprobs: LogprobsTensors | None
    """From the raw model logits (before penalties and temperature), as vLLM v1 reports them."""


@dataclass(frozen=True)
class SamplingMetadata:
    """One row per request that samples this step; tensors live on the logits' device."""

    temperature: torch.Tensor  # [B] float32; 0 => greedy for that row
    top_k: torch.Tensor  # [B] int64; <= 0 or >= vocab size => off
    top_p: torch.Tensor  # [B] float32; 1.0 => off
    min_p: torch.Tensor  # [B] float32; 0.0 => off
    repetition_penalty: torch.Tensor | None  # [B] float32 (1.0 => off); None when no row uses it
    presence_penalty: torch.Tensor | None  # [B] float32 (0.0 => off)
    frequency_penalty: torch.Tensor | None  # [B] float32 (0.0 => off)
    prompt_token_ids: list[list[int]] | None  # also "seen" by the repetition penalty
    output_token_ids: list[list[int]]  # tokens generated so far, per row
    generators: list[torch.Generator | None]  # per row: seeded generator on the logits' device
    min_tokens_mask_ids: list[list[int]]  # per row: ids forbidden now (EOS/stop under min_tokens)
    max_num_logprobs: int | None  # largest top-N any row asked for; None => no logprobs at all
    all_greedy: bool
    all_random: bool
    no_penalties: bool
    token_bitmask: torch.Tensor | None = None  # [B, ceil(V/32)] int32 allowed ids (grammars)
    # No row sets top-k, top-p or min-p: the random rows skip the filter's sort of the
    # vocabulary (the memory plan's profiling row leaves it False: the sort's peak counts).
    no_top_filters: bool = False


class Sampler:
    """logits [B, V] -> one token per row. Stateless: all per-request state comes in `metadata`.

    `argmax` is the kernel module's greedy argmax (ops.argmax: Triton on the GPU), the same
    function as torch's argmax(dim=-1). `processors` run in order after the penalties
    (logits_processors.py); by default the min_tokens mask.
    """

    def __init__(
        self,
        argmax: Callable[[torch.Tensor], torch.Tensor] = reference.argmax,
        processors: Sequence[LogitsProcessor] | None = None,
    ) -> None:
        self.argmax = argmax
        self.processors = tuple(default_logits_processors() if processors is None else processors)

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        md = metadata
        active = [p for p in self.processors if p.is_active(md)]
        argmax_only = md.all_greedy and md.no_penalties and all(p.preserves_argmax for p in active)
        if argmax_only and md.max_num_logprobs is None:
            # The common decode: the argmax of the model-dtype logits (a cast to fp32 is exact,
            # so it would pick the same ids after writing and re-reading a [rows, vocab] copy).
            return SamplerOutput(self.argmax(logits), None)
        logits = logits.float()  # a no-op for float32; half-precision logits lose top-p accuracy
        # (1) Logprobs describe the model, not the sampling transform, so take them first.
        raw_logprobs = None if md.max_num_logprobs is None else logits.log_softmax(dim=-1)

        sampled = self.argmax(logits) if argmax_only else self._sample(logits, md, active)

        logprobs = None
        if raw_logprobs is not None:
            assert md.max_num_logprobs is not None  # raw_logprobs are taken only then
            logprobs = gather_logprobs(raw_logprobs, sampled, md.max_num_logprobs)
        return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs)

    def _sample(  # [B] int64
        self, logits: torch.Tensor, md: SamplingMetadata, processors: list[LogitsProcessor]
    ) -> torch.Tensor:
        greedy, probs = self._target(logits, md, processors)
        if probs is None:
            assert greedy is not None, "no probs: every row is greedy"
            return greedy
        sampled = random_sample(probs, md.generators)
        return sampled if greedy is None else torch.where(md.temperature == 0, greedy, sampled)

    def target_distribution(
        self, logits: torch.Tensor, metadata: SamplingMetadata
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """What a row would be drawn from, without drawing: (greedy ids [B] or None when every row
        is random, probs [B, V] after penalties, processors, temperature and top-k/top-p/min-p, or
        None when every row is greedy). Speculative decoding verifies drafts against these."""
        active = [p for p in self.processors if p.is_active(metadata)]
        return self._target(logits.float(), metadata, active)

    def _target(
        self, logits: torch.Tensor, md: SamplingMetadata, processors: list[LogitsProcessor]
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        # (2) Penalties, (3) logits processors: both change what greedy and random rows see.
        if not md.no_penalties:
            logits = apply_penalties(
                logits,
                md.prompt_token_ids,
                md.output_token_ids,
                md.repetition_penalty,
                md.presence_penalty,
                md.frequency_penalty,
            )
        for processor in processors:
            logits = processor.apply(logits, md)

        # (4) Greedy rows: argmax, ties to the lowest id.
        greedy = None if md.all_random else self.argmax(logits)
        if md.all_greedy:
            return greedy, None

        # (5) Random rows. Greedy rows (temperature 0) divide by 1 instead and are replaced later.
        is_greedy = md.temperature == 0
        temperature = torch.where(is_greedy, torch.ones_like(md.temperature), md.temperature)
        logits = logits / temperature[:, None]
        if not md.no_top_filters:
            logits = apply_top_k_top_p_min_p(logits, md.top_k, md.top_p, md.min_p)
        return greedy, logits.softmax(dim=-1)


def apply_penalties(
    logits: torch.Tensor,  # [B, V] float32
    prompt_token_ids: list[list[int]] | None,
    output_token_ids: list[list[int]],
    repetition_penalty: torch.Tensor | None,  # [B]
    presence_penalty: torch.Tensor | None,  # [B]
    frequency_penalty: torch.Tensor | None,  # [B]
) -> torch.Tensor:  # [B, V], a new tensor
    """Repetition penalty (HF/CTRL) over prompt + output tokens: logit / p if logit > 0 else
    logit * p. Then presence and frequency penalties (OpenAI) over output tokens only:
    logit -= presence * (count > 0) + frequency * count."""
    vocab_size = logits.shape[-1]
    output_counts = token_counts(output_token_ids, vocab_size, logits.device)  # [B, V]
    if repetition_penalty is not None:
        seen = output_counts > 0
        if prompt_token_ids is not None:
            seen |= token_counts(prompt_token_ids, vocab_size, logits.device) > 0
        penalty = repetition_penalty[:, None]
        penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = torch.where(seen, penalized, logits)
    if presence_penalty is not None:
        logits = logits - presence_penalty[:, None] * (output_counts > 0)
    if frequency_penalty is not None:
        logits = logits - frequency_penalty[:, None] * output_counts
    return logits


def token_counts(
    token_ids: list[list[int]], vocab_size: int, device: torch.device
) -> torch.Tensor:  # [B, V] float32: how often each id occurs in each row
    """Scatter ragged id lists into per-row counts. Rows are padded with the id `vocab_size`,
    which lands in one spare column that is dropped, so padding needs no mask."""
    max_len = max((len(ids) for ids in token_ids), default=0)
    padded = [ids + [vocab_size] * (max_len - len(ids)) for ids in token_ids]
    ids = to_device(padded, torch.long, device).view(len(token_ids), max_len)  # [B, max_len]
    counts = torch.zeros(len(token_ids), vocab_size + 1, device=device)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=counts.dtype))
    return counts[:, :vocab_size]


def apply_top_k_top_p_min_p(
    logits: torch.Tensor,  # [B, V] float32, already divided by the temperature
    top_k: torch.Tensor,  # [B] int64
    top_p: torch.Tensor,  # [B] float32
    min_p: torch.Tensor,  # [B] float32
) -> torch.Tensor:  # [B, V], filtered tokens set to -inf
    """Mask everything outside the top k, then outside the nucleus (the smallest most-likely set
    whose mass reaches p, computed after top-k), then below min_p * max prob. The most likely token
    always survives, so no row is left empty."""
    vocab_size = logits.shape[-1]
    # Stable: among tied logits the lowest ids rank first, as in greedy argmax.
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True, stable=True)
    positions = torch.arange(vocab_size, device=logits.device)
    # Mask by sorted position rather than by a kth-value threshold: exactly k tokens even with ties.
    k = torch.where((top_k <= 0) | (top_k > vocab_size), vocab_size, top_k)
    drop = positions[None, :] >= k[:, None]
    sorted_probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    # A token is needed only while the mass strictly before it is still short of p. Rows with
    # p == 1 are exempt: rounding in the cumsum would otherwise drop the far tail.
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    drop |= (mass_before >= top_p[:, None]) & (top_p < 1)[:, None]
    drop[:, 0] = False
    keep = ~torch.zeros_like(drop).scatter_(1, sorted_ids, drop)
    # min-p in log space: p_i >= min_p * p_max  <=>  logit_i >= logit_max + log(min_p). min_p = 0
    # gives -inf, which keeps everything; no second softmax needed.
    keep &= logits >= sorted_logits[:, :1] + min_p[:, None].log()
    return logits.masked_fill(~keep, float("-inf"))


def random_sample(
    probs: torch.Tensor,  # [B, V] float32
    generators: list[torch.Generator | None],
) -> torch.Tensor:  # [B] int64
    """Exponential race: argmax(probs / q) with q ~ Exp(1) draws token i with probability probs[i],
    without the host sync torch.multinomial needs. A row with a generator draws its q from it alone,
    so its tokens do not depend on the rest of the batch; other rows share one global draw."""
    q = torch.empty_like(probs)
    if any(g is None for g in generators):
        q.exponential_()
    for row, generator in enumerate(generators):
        if generator is not None:
            q[row].exponential_(generator=generator)
    # exponential_ may return exactly 0; a 0/0 NaN would win argmax, so keep q positive.
    q.clamp_(min=torch.finfo(q.dtype).tiny)
    return (probs / q).argmax(dim=-1)


def compute_logprobs(
    logits: torch.Tensor,  # [B, V] raw model logits
    token_ids: torch.Tensor,  # [B] int64
    num_top: int,
) -> LogprobsTensors:
    """Logprobs of token_ids[i] under logits[i] plus the num_top best; also for prompt logprobs."""
    return gather_logprobs(logits.float().log_softmax(dim=-1), token_ids, num_top)


def gather_logprobs(
    logprobs: torch.Tensor,  # [B, V] float32, already log-softmaxed
    token_ids: torch.Tensor,  # [B] int64
    num_top: int,
) -> LogprobsTensors:
    token_logprobs = logprobs.gather(1, token_ids[:, None])  # [B, 1]
    # Rank counts strictly better tokens, so tied best tokens all get rank 1.
    ranks = (logprobs > token_logprobs).sum(dim=-1) + 1
    top_logprobs, top_ids = logprobs.topk(num_top, dim=-1)  # sorted descending
    return LogprobsTensors(
        token_ids=torch.cat([token_ids[:, None], top_ids], dim=1),
        logprobs=torch.cat([token_logprobs, top_logprobs], dim=1),
        ranks=ranks,
    )


def logprobs_to_lists(t: LogprobsTensors) -> list[tuple[list[int], list[float], int]]:
    """Per row, on the host: (token ids, their logprobs, the rank of the first)."""
    return list(zip(t.token_ids.tolist(), t.logprobs.tolist(), t.ranks.tolist()))
