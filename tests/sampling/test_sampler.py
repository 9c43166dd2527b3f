"""Sampler tests. Random behaviour is checked statistically: many rows holding the same logits are
sampled in one call under a fixed global seed, and frequencies must pass a chi-square test at a
~1e-7 false-alarm level, so a correct sampler cannot flake while a wrong distribution is caught."""

from __future__ import annotations

import math

import pytest
import torch

from kiln.sampling import Sampler, SamplingMetadata, apply_penalties, compute_logprobs

NUM_DRAWS = 10_000


def make_metadata(
    batch_size: int,
    *,
    temperature: float | list[float] = 1.0,
    top_k: int | list[int] = 0,
    top_p: float | list[float] = 1.0,
    min_p: float | list[float] = 0.0,
    repetition_penalty: list[float] | None = None,
    presence_penalty: list[float] | None = None,
    frequency_penalty: list[float] | None = None,
    prompt_token_ids: list[list[int]] | None = None,
    output_token_ids: list[list[int]] | None = None,
    generators: list[torch.Generator | None] | None = None,
    min_tokens_mask_ids: list[list[int]] | None = None,
    max_num_logprobs: int | None = None,
) -> SamplingMetadata:
    """Scalars broadcast to every row; the flags are derived the way a model runner would."""

    def per_row(value, dtype):
        values = value if isinstance(value, list) else [value] * batch_size
        return torch.tensor(values, dtype=dtype)

    def optional(values):
        return None if values is None else torch.tensor(values, dtype=torch.float32)

    temperatures = per_row(temperature, torch.float32)
    return SamplingMetadata(
        temperature=temperatures,
        top_k=per_row(top_k, torch.int64),
        top_p=per_row(top_p, torch.float32),
        min_p=per_row(min_p, torch.float32),
        repetition_penalty=optional(repetition_penalty),
        presence_penalty=optional(presence_penalty),
        frequency_penalty=optional(frequency_penalty),
        prompt_token_ids=prompt_token_ids,
        output_token_ids=output_token_ids or [[] for _ in range(batch_size)],
        generators=generators or [None] * batch_size,
        min_tokens_mask_ids=min_tokens_mask_ids or [[] for _ in range(batch_size)],
        max_num_logprobs=max_num_logprobs,
        all_greedy=bool((temperatures == 0).all()),
        all_random=bool((temperatures > 0).all()),
        no_penalties=repetition_penalty is None
        and presence_penalty is None
        and frequency_penalty is None,
    )


def draw_counts(logits: torch.Tensor, **params) -> torch.Tensor:  # [V] int64
    """Sample NUM_DRAWS tokens from one row of logits in a single batched call."""
    torch.manual_seed(1234)
    batch = logits.expand(NUM_DRAWS, -1).contiguous()
    out = Sampler()(batch, make_metadata(NUM_DRAWS, **params))
    return torch.bincount(out.sampled_token_ids, minlength=logits.numel())


def chi2_critical(dof: int, z: float = 5.0) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile at a one-sided normal z-score
    (z = 5: p ~ 3e-7); it errs high for small dof, i.e. on the side of not flaking."""
    a = 2.0 / (9.0 * dof)
    return dof * (1.0 - a + z * math.sqrt(a)) ** 3


def assert_distribution(counts: torch.Tensor, probs: torch.Tensor) -> None:
    """The support must match exactly; frequencies must be consistent with probs."""
    probs = probs.double() / probs.sum()
    support = probs > 0
    assert torch.equal(counts > 0, support), f"sampled support {counts > 0} != {support}"
    if int(support.sum()) == 1:
        return
    expected = counts.sum() * probs[support]
    stat = float(((counts[support] - expected) ** 2 / expected).sum())
    assert stat < chi2_critical(int(support.sum()) - 1), (counts, expected)


# --- greedy -----------------------------------------------------------------------------------


def test_greedy_is_argmax_on_fast_and_slow_paths() -> None:
    torch.manual_seed(0)
    logits = torch.randn(8, 100)
    fast = Sampler()(logits, make_metadata(8, temperature=0.0))
    # A penalty of 1.0 changes nothing but forces the full path.
    slow = Sampler()(logits, make_metadata(8, temperature=0.0, repetition_penalty=[1.0] * 8))
    assert torch.equal(fast.sampled_token_ids, logits.argmax(-1))
    assert torch.equal(slow.sampled_token_ids, logits.argmax(-1))
    assert fast.sampled_token_ids.dtype == torch.int64
    assert fast.logprobs is None


def test_greedy_ties_resolve_to_lowest_id() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [5.0, 5.0, 5.0, 5.0]])
    for penalty in (None, [1.0, 1.0]):
        out = Sampler()(logits, make_metadata(2, temperature=0.0, repetition_penalty=penalty))
        assert out.sampled_token_ids.tolist() == [1, 0]


def test_greedy_rows_in_a_mixed_batch_are_argmax() -> None:
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    temperature = [0.0, 1.0, 0.0, 0.7, 0.0, 1.5]
    out = Sampler()(logits, make_metadata(6, temperature=temperature))
    greedy_rows = [0, 2, 4]
    assert torch.equal(out.sampled_token_ids[greedy_rows], logits[greedy_rows].argmax(-1))


def test_sampler_does_not_modify_logits() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, 20)
    before = logits.clone()
    Sampler()(
        logits,
        make_metadata(
            3,
            temperature=[0.0, 0.5, 1.0],
            top_k=5,
            top_p=0.9,
            repetition_penalty=[1.3] * 3,
            presence_penalty=[0.5] * 3,
            frequency_penalty=[0.5] * 3,
            output_token_ids=[[1, 2], [3], []],
            min_tokens_mask_ids=[[4], [], [5]],
            max_num_logprobs=3,
        ),
    )
    assert torch.equal(logits, before)


# --- temperature, top-k, top-p, min-p ---------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_frequencies_match_softmax(temperature: float) -> None:
    logits = torch.tensor([1.0, 0.0, -0.5, 2.0, 0.3, -1.0])
    counts = draw_counts(logits, temperature=temperature)
    assert_distribution(counts, torch.softmax(logits / temperature, dim=-1))


def test_rows_without_top_filters_skip_the_vocabulary_sort(monkeypatch) -> None:
    """With no top-k, top-p or min-p in any row the filter (a sort of the whole vocabulary, 262k
    logits a row on Gemma 3) is skipped, and the draws still follow the softmax."""
    import dataclasses

    import kiln.sampling.sampler as sampler_module

    def no_sort(*args):
        raise AssertionError("filtered although no row asked for it")

    monkeypatch.setattr(sampler_module, "apply_top_k_top_p_min_p", no_sort)
    logits = torch.tensor([1.0, 0.0, -0.5, 2.0, 0.3, -1.0])
    torch.manual_seed(1234)
    metadata = dataclasses.replace(make_metadata(NUM_DRAWS), no_top_filters=True)
    out = Sampler()(logits.expand(NUM_DRAWS, -1).contiguous(), metadata)
    assert_distribution(torch.bincount(out.sampled_token_ids, minlength=6), logits.softmax(-1))
    with pytest.raises(AssertionError, match="filtered although"):
        Sampler()(logits[None], make_metadata(1))  # the flag off: the filter runs


@pytest.mark.parametrize(
    ("params", "skips"),
    [
        ({"temperature": 0.7}, True),
        ({"temperature": 0.7, "top_k": 256}, True),  # top_k at the vocabulary: off
        ({"temperature": 0.7, "top_k": 40}, False),
        ({"temperature": 0.7, "top_p": 0.9}, False),
        ({"temperature": 0.7, "min_p": 0.05}, False),
    ],
)
def test_the_runner_marks_rows_without_top_filters(params: dict, skips: bool) -> None:
    import dataclasses

    from kiln.runtime.sampling_inputs import build_sampling_metadata
    from kiln.sampling_params import SamplingParams

    @dataclasses.dataclass
    class Row:
        sampling_params: SamplingParams
        prompt_token_ids: tuple[int, ...] = (1, 2)
        output_token_ids: tuple[int, ...] = ()
        num_output_tokens: int = 0

    rows = [Row(SamplingParams(temperature=0.7)), Row(SamplingParams(**params))]
    metadata = build_sampling_metadata(rows, (2,), 256, torch.device("cpu"))  # type: ignore[arg-type]
    assert metadata.no_top_filters is skips


def test_very_low_temperature_is_greedy() -> None:
    logits = torch.tensor([0.0, 1.5, 1.0, -2.0, 0.5])
    counts = draw_counts(logits, temperature=1e-3)
    assert counts[1] == NUM_DRAWS


def test_top_k_samples_only_the_k_largest() -> None:
    logits = torch.tensor([0.1, 2.0, -1.0, 1.5, 0.0, 1.8, -0.5, 0.9])
    counts = draw_counts(logits, top_k=3)
    probs = torch.softmax(logits, dim=-1)
    probs[[0, 2, 4, 6, 7]] = 0  # keep only ids 1, 5, 3
    assert_distribution(counts, probs)


@pytest.mark.parametrize("top_k", [0, -1, 8, 100])
def test_top_k_off_values_keep_everything(top_k: int) -> None:
    logits = torch.tensor([0.1, 2.0, -1.0, 1.5, 0.0, 1.8, -0.5, 0.9])
    assert_distribution(draw_counts(logits, top_k=top_k), torch.softmax(logits, dim=-1))


def test_top_k_with_ties_keeps_exactly_k_lowest_ids() -> None:
    counts = draw_counts(torch.tensor([0.0, 1.0, 1.0, 1.0, 1.0]), top_k=2)
    assert_distribution(counts, torch.tensor([0.0, 0.5, 0.5, 0.0, 0.0]))


# Probabilities deliberately out of order in the vocabulary.
KNOWN_PROBS = torch.tensor([0.1, 0.05, 0.4, 0.15, 0.3])


@pytest.mark.parametrize(
    ("top_p", "nucleus"),
    [(0.35, [2]), (0.65, [2, 4]), (0.75, [2, 4, 3]), (0.9, [2, 4, 3, 0]), (1.0, [2, 4, 3, 0, 1])],
)
def test_top_p_samples_only_the_nucleus(top_p: float, nucleus: list[int]) -> None:
    counts = draw_counts(KNOWN_PROBS.log(), top_p=top_p)
    expected = torch.zeros_like(KNOWN_PROBS)
    expected[nucleus] = KNOWN_PROBS[nucleus]
    assert_distribution(counts, expected)


def test_top_p_tiny_keeps_the_top_token() -> None:
    assert draw_counts(KNOWN_PROBS.log(), top_p=1e-6)[2] == NUM_DRAWS


def test_top_p_is_computed_after_temperature() -> None:
    logits = torch.tensor([0.5, 0.3, 0.2]).log()
    # T=1: 0.5 + 0.3 reaches 0.75. T=100: nearly uniform, two tokens hold ~0.67 < 0.75.
    assert_distribution(draw_counts(logits, top_p=0.75), torch.tensor([0.5, 0.3, 0.0]))
    assert_distribution(
        draw_counts(logits, top_p=0.75, temperature=100.0), torch.softmax(logits / 100.0, dim=-1)
    )


def test_top_p_is_computed_after_top_k() -> None:
    # Top-2 renormalised: 0.4/0.7, 0.3/0.7 = 0.571, 0.429; p = 0.5 keeps only the top token.
    assert draw_counts(KNOWN_PROBS.log(), top_k=2, top_p=0.5)[2] == NUM_DRAWS


def test_min_p_support() -> None:
    # Threshold 0.2 * 0.4 = 0.08: keeps 0.4, 0.3, 0.15, 0.1; drops 0.05.
    counts = draw_counts(KNOWN_PROBS.log(), min_p=0.2)
    assert_distribution(counts, torch.tensor([0.1, 0.0, 0.4, 0.15, 0.3]))
    # Threshold 0.5 * 0.4 = 0.2: keeps 0.4, 0.3.
    counts = draw_counts(KNOWN_PROBS.log(), min_p=0.5)
    assert_distribution(counts, torch.tensor([0.0, 0.0, 0.4, 0.0, 0.3]))


def test_per_row_parameters_do_not_leak_across_rows() -> None:
    torch.manual_seed(7)
    logits = KNOWN_PROBS.log().expand(NUM_DRAWS, -1).contiguous()
    half = NUM_DRAWS // 2
    metadata = make_metadata(NUM_DRAWS, top_k=[1] * half + [0] * half)
    tokens = Sampler()(logits, metadata).sampled_token_ids
    assert (tokens[:half] == 2).all()
    assert_distribution(torch.bincount(tokens[half:], minlength=5), KNOWN_PROBS)


# --- seeds ------------------------------------------------------------------------------------


def sample_seeded_sequence(seed: int, position: int, batch_size: int, num_steps: int = 30):
    """Tokens of a seeded row placed at `position` in a batch of other rows (unseeded, greedy,
    or seeded differently), with the global RNG reseeded differently on every call."""
    step_logits = torch.randn(num_steps, 40, generator=torch.Generator().manual_seed(99))
    torch.manual_seed(seed * 1000 + position * 10 + batch_size)
    generators: list[torch.Generator | None] = [None] * batch_size
    for row in range(batch_size):
        if row % 3 == 1:  # some neighbours have seeds of their own
            generators[row] = torch.Generator().manual_seed(10_000 + row)
    generators[position] = torch.Generator().manual_seed(seed)
    temperature = [0.0 if row % 3 == 2 else 1.3 for row in range(batch_size)]
    temperature[position] = 1.0
    tokens = []
    for step in range(num_steps):
        logits = torch.randn(batch_size, 40)
        logits[position] = step_logits[step]
        metadata = make_metadata(
            batch_size, temperature=temperature, top_p=0.95, generators=generators
        )
        tokens.append(int(Sampler()(logits, metadata).sampled_token_ids[position]))
    return tokens


def test_seeded_row_is_independent_of_batch() -> None:
    alone = sample_seeded_sequence(seed=42, position=0, batch_size=1)
    first = sample_seeded_sequence(seed=42, position=0, batch_size=4)
    middle = sample_seeded_sequence(seed=42, position=3, batch_size=7)
    assert alone == first == middle


def test_different_seeds_give_different_sequences() -> None:
    a = sample_seeded_sequence(seed=1, position=0, batch_size=1)
    b = sample_seeded_sequence(seed=2, position=0, batch_size=1)
    assert a != b


def test_seeded_draws_follow_the_distribution() -> None:
    # One generator row sampled over many steps must still be an unbiased sampler.
    generator = torch.Generator().manual_seed(5)
    logits = torch.tensor([[1.0, 0.0, -0.5, 2.0]])
    metadata = make_metadata(1, generators=[generator])
    tokens = [int(Sampler()(logits, metadata).sampled_token_ids) for _ in range(2000)]
    counts = torch.bincount(torch.tensor(tokens), minlength=4)
    assert_distribution(counts, torch.softmax(logits[0], dim=-1))


# --- penalties --------------------------------------------------------------------------------


def test_repetition_penalty_hf_semantics() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0], [2.0, -1.0, 0.5, 3.0, -2.0]])
    out = apply_penalties(
        logits,
        prompt_token_ids=[[0], [0]],
        output_token_ids=[[1, 1], [1]],
        repetition_penalty=torch.tensor([2.0, 1.0]),
        presence_penalty=None,
        frequency_penalty=None,
    )
    # Seen ids 0 (prompt, positive: divided) and 1 (output, negative: multiplied); others untouched.
    assert torch.equal(out[0], torch.tensor([1.0, -2.0, 0.5, 3.0, -2.0]))
    assert torch.equal(out[1], logits[1])  # penalty 1.0 is off


def test_repetition_penalty_without_prompt_ids_uses_outputs_only() -> None:
    logits = torch.tensor([[2.0, 4.0, 1.0]])
    out = apply_penalties(logits, None, [[1]], torch.tensor([4.0]), None, None)
    assert torch.equal(out, torch.tensor([[2.0, 1.0, 1.0]]))


def test_presence_and_frequency_penalties_openai_semantics() -> None:
    logits = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0]])
    out = apply_penalties(
        logits,
        prompt_token_ids=[[0], [0]],  # prompt tokens are not penalised by these two
        output_token_ids=[[1, 1, 1, 2], [3]],
        repetition_penalty=None,
        presence_penalty=torch.tensor([0.5, 0.0]),
        frequency_penalty=torch.tensor([0.25, -1.0]),
    )
    expected = torch.tensor(
        [
            [1.0, 1.0 - 0.5 - 3 * 0.25, 1.0 - 0.5 - 0.25, 1.0],
            [1.0, 1.0, 1.0, 2.0],  # a negative frequency penalty encourages repeats
        ]
    )
    torch.testing.assert_close(out, expected)


def test_repetition_penalty_applies_before_presence_and_frequency() -> None:
    logits = torch.tensor([[3.0, -3.0]])
    out = apply_penalties(
        logits,
        None,
        [[0, 0, 1]],
        torch.tensor([1.5]),
        torch.tensor([0.5]),
        torch.tensor([0.5]),
    )
    torch.testing.assert_close(out, torch.tensor([[3.0 / 1.5 - 0.5 - 1.0, -3.0 * 1.5 - 0.5 - 0.5]]))


def test_penalties_steer_the_sampler() -> None:
    logits = torch.tensor([[3.0, 2.5, 0.0]])
    metadata = make_metadata(
        1, temperature=0.0, frequency_penalty=[1.0], output_token_ids=[[0]], prompt_token_ids=[[]]
    )
    assert Sampler()(logits, metadata).sampled_token_ids.tolist() == [1]


# --- min_tokens mask --------------------------------------------------------------------------


def test_min_tokens_mask_forbids_the_argmax() -> None:
    logits = torch.tensor([[0.0, 1.0, 0.5, 10.0], [0.0, 1.0, 0.5, 10.0]])
    # All greedy without penalties: the mask must disable the plain-argmax fast path.
    out = Sampler()(logits, make_metadata(2, temperature=0.0, min_tokens_mask_ids=[[3], []]))
    assert out.sampled_token_ids.tolist() == [1, 3]
    counts = draw_counts(logits[0], min_tokens_mask_ids=[[3, 1]] * NUM_DRAWS)
    expected = torch.softmax(logits[0], dim=-1)
    expected[[1, 3]] = 0
    assert_distribution(counts, expected)


# --- logprobs ---------------------------------------------------------------------------------


def test_logprobs_are_from_raw_logits() -> None:
    torch.manual_seed(3)
    logits = torch.randn(6, 32)
    metadata = make_metadata(
        6,
        temperature=[0.0, 0.5, 1.0, 2.0, 0.0, 1.0],
        top_k=[0, 5, 0, 0, 0, 3],
        repetition_penalty=[1.5] * 6,
        frequency_penalty=[0.7] * 6,
        output_token_ids=[[1, 2], [3], [], [4, 4], [int(logits[4].argmax())], [5]],
        min_tokens_mask_ids=[[0], [], [], [], [], [6]],
        max_num_logprobs=5,
    )
    out = Sampler()(logits, metadata)
    assert out.logprobs is not None
    sampled = out.sampled_token_ids
    raw = torch.log_softmax(logits, dim=-1)
    token_ids, logprobs, ranks = out.logprobs.token_ids, out.logprobs.logprobs, out.logprobs.ranks
    assert token_ids.shape == logprobs.shape == (6, 6)
    assert token_ids.dtype == ranks.dtype == torch.int64 and logprobs.dtype == torch.float32
    assert torch.equal(token_ids[:, 0], sampled)
    torch.testing.assert_close(logprobs, raw.gather(1, token_ids))
    expected_top_logprobs, expected_top_ids = raw.topk(5, dim=-1)
    assert torch.equal(token_ids[:, 1:], expected_top_ids)
    torch.testing.assert_close(logprobs[:, 1:], expected_top_logprobs)
    assert (logprobs[:, 1:-1] >= logprobs[:, 2:]).all()
    # Rank = position of the sampled token in the raw logits sorted descending (ids distinct).
    order = raw.argsort(dim=-1, descending=True)
    expected_ranks = (order == sampled[:, None]).int().argmax(dim=-1) + 1
    assert torch.equal(ranks, expected_ranks)


def test_compute_logprobs_for_given_tokens() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0], [1.0, 1.0, 0.0, 0.0]])
    out = compute_logprobs(logits, torch.tensor([2, 1]), num_top=2)
    assert out.ranks.tolist() == [3, 1]  # tied best tokens both rank 1
    assert out.token_ids[0].tolist() == [2, 1, 3]
    assert out.token_ids[1, 0] == 1 and sorted(out.token_ids[1, 1:].tolist()) == [0, 1]
    torch.testing.assert_close(out.logprobs, torch.log_softmax(logits, -1).gather(1, out.token_ids))


def test_zero_logprobs_returns_only_the_sampled_token() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0]])
    out = Sampler()(logits, make_metadata(1, temperature=0.0, max_num_logprobs=0))
    assert out.logprobs is not None
    assert out.logprobs.token_ids.tolist() == [[1]]
    assert out.logprobs.ranks.tolist() == [1]
