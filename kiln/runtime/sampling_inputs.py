"""Builds the sampler's per-row tensors (SamplingMetadata) from the runner's request states."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from kiln.runtime.input_batch import CachedRequestState
from kiln.sampling.host_copy import to_device
from kiln.sampling.sampler import SamplingMetadata
from kiln.sampling_params import SamplingParams


class SamplingRow(Protocol):
    """What the metadata reads of a row: a request's state, or one of its verification rows."""

    @property
    def sampling_params(self) -> SamplingParams: ...

    @property
    def prompt_token_ids(self) -> list[int]: ...

    @property
    def output_token_ids(self) -> list[int]: ...

    @property
    def num_output_tokens(self) -> int: ...


def step_generator(seed: int, step: int, device: torch.device) -> torch.Generator:
    """A generator for one request's `step`-th token, derived from its seed alone: the draw does
    not depend on the batch, and survives preemption and recompute unchanged."""
    digest = hashlib.blake2b(f"{seed}:{step}".encode(), digest_size=8).digest()
    return torch.Generator(device=device).manual_seed(int.from_bytes(digest, "little") >> 1)


class SamplingMetadataBuilder:
    """`build(states)` per step. A batch of plain greedy rows (the common decode) costs one pass
    over the states and no tensor work: its metadata is cached per batch size, since the greedy
    fast path reads none of the per-row tensors."""

    def __init__(self, eos_token_ids: tuple[int, ...], vocab_size: int, device: torch.device):
        self.eos_token_ids = eos_token_ids
        self.vocab_size = vocab_size
        self.device = device
        self._greedy: dict[int, SamplingMetadata] = {}

    def build(self, states: list[CachedRequestState]) -> SamplingMetadata:
        if all(s.plain_greedy for s in states):
            metadata = self._greedy.get(len(states))
            if metadata is None:
                metadata = self._greedy[len(states)] = _plain_greedy_metadata(
                    len(states), self.device
                )
            return metadata
        return build_sampling_metadata(states, self.eos_token_ids, self.vocab_size, self.device)


def _plain_greedy_metadata(num_rows: int, device: torch.device) -> SamplingMetadata:
    def column(value: float, dtype: torch.dtype) -> torch.Tensor:
        return torch.full((num_rows,), value, dtype=dtype, device=device)

    return SamplingMetadata(
        temperature=column(0.0, torch.float32),
        top_k=column(0, torch.int64),
        top_p=column(1.0, torch.float32),
        min_p=column(0.0, torch.float32),
        repetition_penalty=None,
        presence_penalty=None,
        frequency_penalty=None,
        prompt_token_ids=None,
        output_token_ids=[[] for _ in range(num_rows)],  # unused: no penalties
        generators=[None] * num_rows,
        min_tokens_mask_ids=[[] for _ in range(num_rows)],
        max_num_logprobs=None,
        all_greedy=True,
        all_random=False,
        no_penalties=True,
        no_top_filters=True,
    )


def build_sampling_metadata(
    states: Sequence[SamplingRow],
    eos_token_ids: tuple[int, ...],
    vocab_size: int,
    device: torch.device,
) -> SamplingMetadata:
    params = [s.sampling_params for s in states]

    def column(values: list, dtype: torch.dtype) -> torch.Tensor:
        return to_device(values, dtype, device)

    any_repetition = any(p.repetition_penalty != 1.0 for p in params)
    any_presence = any(p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 for p in params)
    masks = []
    for state, p in zip(states, params):
        if state.num_output_tokens < p.min_tokens:
            masks.append(sorted(set(eos_token_ids) | set(p.stop_token_ids)))
        else:
            masks.append([])
    generators = [
        None if p.seed is None or p.greedy else step_generator(p.seed, s.num_output_tokens, device)
        for s, p in zip(states, params)
    ]
    wanted_logprobs = [p.logprobs for p in params if p.logprobs is not None]
    return SamplingMetadata(
        temperature=column([p.temperature for p in params], torch.float32),
        top_k=column([p.top_k if p.top_k > 0 else vocab_size for p in params], torch.int64),
        top_p=column([p.top_p for p in params], torch.float32),
        min_p=column([p.min_p for p in params], torch.float32),
        repetition_penalty=(
            column([p.repetition_penalty for p in params], torch.float32)
            if any_repetition
            else None
        ),
        presence_penalty=(
            column([p.presence_penalty for p in params], torch.float32) if any_presence else None
        ),
        frequency_penalty=(
            column([p.frequency_penalty for p in params], torch.float32) if any_presence else None
        ),
        prompt_token_ids=[s.prompt_token_ids for s in states] if any_repetition else None,
        output_token_ids=[s.output_token_ids for s in states],
        generators=generators,
        min_tokens_mask_ids=masks,
        max_num_logprobs=max(wanted_logprobs) if wanted_logprobs else None,
        all_greedy=all(p.greedy for p in params),
        all_random=not any(p.greedy for p in params),
        no_penalties=not (any_repetition or any_presence),
        no_top_filters=all(
            (p.top_k <= 0 or p.top_k >= vocab_size) and p.top_p >= 1.0 and p.min_p <= 0.0
            for p in params
        ),
    )


@dataclass(frozen=True)
class _VerifyRow:
    """One position a request verifies: the request as it would be after its first i drafts
    (penalties see them, min_tokens counts them, the seed's step is theirs)."""

    sampling_params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)


def verification_rows(states: list[CachedRequestState]) -> list[_VerifyRow]:
    """K + 1 rows per request verifying K drafts, in order: drafts 0..K-1, then the bonus row."""
    rows = []
    for s in states:
        for i in range(len(s.spec_token_ids) + 1):
            outputs = s.output_token_ids + s.spec_token_ids[:i] if i else s.output_token_ids
            rows.append(_VerifyRow(s.sampling_params, s.prompt_token_ids, outputs))
    return rows
