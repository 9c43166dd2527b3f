"""Speculative decoding: scheduling K+1 tokens of a decode, verification, proposers, policy.

Exactness: greedy tokens with drafts equal plain decoding (fp32 CPU) on a tiny random model and
the real SmolLM2, with the n-gram and draft-model proposers and kiln bench's oracle (a known mix
of right and wrong drafts, so both acceptance and rejection are exercised in every case), alone
and batched with requests that get no drafts, under chunked prefill, preemption and prefix
caching, with and without async scheduling (with it, a step's outputs are made while the next
step runs, checked to happen); the KV pool is empty after every run. Sampling: the
rejection sampler's output follows the target distribution (chi-square over many draws) and the
same statistic flags a sampler that is biased on purpose.
"""

from __future__ import annotations

import json

import pytest
import torch

from kiln import LLM
from kiln.bench.oracle import (
    Oracle,
    acceptance_rate_for_length,
    num_accepted_for_draw,
    oracle_at_length,
    oracle_config,
)
from kiln.engine.request import Request
from kiln.engine.scheduler import Scheduler
from kiln.errors import ModelLoadError
from kiln.interfaces import ModelRunnerOutput
from kiln.kv_cache.manager import KVCacheManager
from kiln.sampling.rejection_sampler import emitted_tokens, rejection_sample
from kiln.sampling_params import SamplingParams
from kiln.spec_decode.config import SpeculativeConfig
from kiln.spec_decode.ngram import ngram_lookup
from tests.conftest import build_tiny_hf_model

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
ENGINE = dict(dtype="float32", device="cpu", kv_cache_memory_gb=0.05, num_threads=1)


# ---- the scheduler alone (no torch): K+1 tokens, rejected slots given back -------------------


def test_scheduler_verifies_drafts_and_frees_rejected_slots():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    s = Scheduler(kv, 4, 64, 1024, num_spec_tokens=lambda batch: 4)
    req = Request("a", list(range(10, 16)), SamplingParams(max_tokens=20), (2,), 20)
    s.add_request(req)
    out = s.schedule()  # the prompt
    s.update(out, ModelRunnerOutput({"a": [7]}, spec_token_ids={"a": [8, 9, 10, 11]}))
    out = s.schedule()
    assert out.num_scheduled_tokens == {"a": 5}
    assert out.scheduled_spec_decode_tokens == {"a": [8, 9, 10, 11]}
    assert req.num_computed_tokens == 11 and len(kv.block_ids("a")) == 3  # positions 0..10
    # Two drafts accepted, then the bonus: 3 tokens; positions 9 and 10 were computed for nothing.
    (core,) = s.update(out, ModelRunnerOutput({"a": [8, 9, 5]}, spec_token_ids={"a": [1]}))
    assert core.new_token_ids == [8, 9, 5]
    assert (core.num_draft_tokens, core.num_accepted_tokens) == (4, 2)
    assert req.num_tokens == 10 and req.num_computed_tokens == 9
    assert len(kv.block_ids("a")) == 3  # ceil(9 / 4): nothing to give back yet
    out = s.schedule()
    assert out.num_scheduled_tokens == {"a": 2}
    s.update(out, ModelRunnerOutput({"a": [3]}))  # the draft rejected
    assert req.num_computed_tokens == 10 and len(kv.block_ids("a")) == 3
    s.finish_requests(["a"], req.status.FINISHED_ABORTED)
    assert kv.pool.num_free_blocks == 16


def test_scheduler_caps_drafts_by_policy_budget_and_max_tokens():
    kv = KVCacheManager(num_blocks=64, block_size=4)
    s = Scheduler(kv, 4, 64, 1024, num_spec_tokens=lambda batch: 3 if batch < 2 else 0)
    req = Request("a", [10, 11, 12], SamplingParams(max_tokens=4), (2,), 4)
    s.add_request(req)
    out = s.schedule()
    s.update(out, ModelRunnerOutput({"a": [7]}, spec_token_ids={"a": [1, 1, 1, 1, 1]}))
    out = s.schedule()
    assert out.scheduled_spec_decode_tokens == {"a": [1, 1]}  # max_tokens 4: 1 out, 2 + bonus
    s.update(out, ModelRunnerOutput({"a": [1, 1, 1]}))
    assert req.is_finished and kv.pool.num_free_blocks == 64
    # Two running: the policy says no drafts.
    for rid in "bc":
        s.add_request(Request(rid, [20, 21], SamplingParams(max_tokens=9), (2,), 9))
    out = s.schedule()
    s.update(out, ModelRunnerOutput({r: [7] for r in "bc"}, spec_token_ids={"b": [1], "c": [1]}))
    assert s.schedule().scheduled_spec_decode_tokens == {}


def test_policy_by_batch_size_and_overrides():
    spec = SpeculativeConfig("ngram", 4)
    assert [spec.num_tokens_for_batch(b) for b in (1, 32, 33, 64, 65)] == [4, 4, 2, 2, 0]
    table = SpeculativeConfig.from_dict(
        {
            "method": "ngram",
            "num_speculative_tokens": 4,
            "num_speculative_tokens_by_batch_size": {"2": 3, "8": 1},
        }
    )
    assert [table.num_tokens_for_batch(b) for b in (1, 2, 3, 8, 9)] == [3, 3, 1, 1, 0]
    off = SpeculativeConfig("ngram", 4, disable_by_batch_size=2)
    assert [off.num_tokens_for_batch(b) for b in (2, 3)] == [4, 0]


@pytest.mark.parametrize(
    "bad, key",
    [
        ({"method": "medusa", "num_speculative_tokens": 2}, "method"),
        ({"method": "eagle3", "num_speculative_tokens": 2}, "model"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "model"),
        ({"method": "ngram", "num_speculative_tokens": 2, "colour": 1}, "unknown keys"),
        ({"method": "ngram"}, "num_speculative_tokens"),
    ],
)
def test_bad_config_names_the_key(bad, key):
    with pytest.raises(ValueError, match=key):
        LLM(None, speculative_config=bad)


def test_the_oracle_is_no_method_and_no_key():
    # A measuring instrument whose output need not be the model's text: no dict or command line
    # reaches it, and no message offers it; kiln bench and the tests build it in Python.
    with pytest.raises(ValueError, match="method") as err:
        SpeculativeConfig.from_dict({"method": "oracle", "num_speculative_tokens": 2})
    offered = str(err.value).split(", got")[0]
    assert offered.endswith('"ngram", "draft_model", "eagle3"') and "oracle" not in offered
    with pytest.raises(ValueError, match="unknown keys") as err:
        SpeculativeConfig.from_dict(
            {"method": "ngram", "num_speculative_tokens": 2, "instrument": 1}
        )
    assert "instrument" not in str(err.value).split("known:")[1]
    spec = oracle_config(2, Oracle(0.5))
    assert SpeculativeConfig.from_dict(spec) is spec and spec.method == "oracle"


def test_cli_takes_speculative_config_as_json():
    import argparse

    from kiln.cli.engine_args import add_engine_args, engine_config_from_args

    p = argparse.ArgumentParser()
    add_engine_args(p)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}
    args = p.parse_args(["--speculative-config", json.dumps(spec)])
    assert engine_config_from_args(args).speculative.prompt_lookup_max == 4
    with pytest.raises(SystemExit):
        p.parse_args(["--speculative-config", "{not json"])


def test_ngram_lookup_takes_the_longest_latest_match():
    assert ngram_lookup([1, 2, 3, 9, 1, 2, 3, 8, 7, 1, 2, 3], 1, 3, 2) == [8, 7]
    assert ngram_lookup([5, 1, 2, 6, 1, 2], 2, 2, 4) == [6, 1, 2]
    assert ngram_lookup([1, 2, 3, 4], 1, 3, 4) == []
    assert ngram_lookup([4, 9, 4], 2, 3, 4) == []  # no 2-gram repeats; 1-grams are not tried


def test_oracle_rate_gives_the_mean_length():
    a = acceptance_rate_for_length(3.0, 4)
    assert abs(sum(a**i for i in range(5)) - 3.0) < 1e-9
    # The draw's distribution: P(n >= i) = a^i, so 1 + E[n] over evenly spread u is 3.
    draws = [num_accepted_for_draw((i + 0.5) / 10_000, a, 4) for i in range(10_000)]
    assert abs(1 + sum(draws) / len(draws) - 3.0) < 1e-3
    assert num_accepted_for_draw(0.0, a, 4) == 4 and num_accepted_for_draw(0.999, a, 4) == 0


def test_oracle_accepting_by_its_draw_measures_the_set_length(tiny_paths):
    """The speed benchmark's oracle: the acceptance length measured is the one set, whatever the
    target's tokens are (here a random model's), and the pool is empty after."""
    k, length = 4, 3.0
    llm = LLM(tiny_paths[0], speculative_config=oracle_at_length(k, length), **ENGINE)
    params = SamplingParams(max_tokens=241, temperature=0, ignore_eos=True)
    outs = llm.generate([[5, 6, 7], [8, 9, 10, 11]], params)
    steps = sum(o.outputs[0].num_spec_steps for o in outs)
    accepted = sum(o.outputs[0].num_accepted_tokens for o in outs)
    assert steps > 100 and abs(1 + accepted / steps - length) < 0.05
    assert all(len(o.outputs[0].token_ids) == 241 for o in outs)
    kv = llm.engine.kv_cache
    assert kv.pool.num_free_blocks == kv.pool.num_blocks and not kv.req_to_blocks


# ---- rejection sampling: the target distribution, whatever the drafts ------------------------


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def _draw(p0, p1, q0, q1, n, generator, claimed_q0=None):
    """n requests, each verifying 2 drafts drawn from q0, q1; returns the emitted tokens."""
    d0 = torch.multinomial(q0, n, replacement=True, generator=generator)
    d1 = torch.multinomial(q1, n, replacement=True, generator=generator)
    probs = torch.stack([p0, p1, p1] * n)  # rows: draft 0, draft 1, bonus
    q = torch.stack([claimed_q0 if claimed_q0 is not None else q0, q1, q1] * n)
    drafts = torch.stack([d0, d1, torch.full_like(d0, -1)], dim=1).flatten().tolist()
    accepted, recovered = rejection_sample(
        drafts, None, probs, torch.zeros(3 * n, dtype=torch.bool), [None] * (3 * n), q
    )
    return emitted_tokens([2] * n, drafts, accepted.tolist(), recovered.tolist())


@pytest.mark.parametrize("one_hot", [False, True])
def test_rejection_sampling_preserves_the_target_and_catches_a_biased_sampler(one_hot):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    v, n = 6, 40_000
    p0 = torch.tensor([0.05, 0.4, 0.1, 0.25, 0.15, 0.05])
    p1 = torch.tensor([0.3, 0.1, 0.1, 0.1, 0.2, 0.2])
    q0 = torch.tensor([0.3, 0.1, 0.3, 0.1, 0.1, 0.1])
    q1 = torch.tensor([0.1, 0.1, 0.1, 0.1, 0.1, 0.5])
    if one_hot:  # a deterministic drafter (n-gram, greedy draft model): q is one-hot
        q0, q1 = torch.eye(v)[2], torch.eye(v)[5]
    out = _draw(p0, p1, q0, q1, n, g)
    first = torch.bincount(torch.tensor([t[0] for t in out]), minlength=v).float()
    second = torch.bincount(torch.tensor([t[1] for t in out if len(t) > 1]), minlength=v).float()
    # chi-square, 5 degrees of freedom: P(X > 25) ~ 1e-4, so a correct sampler passes.
    assert _chi2(first, p0) < 25 and _chi2(second, p1) < 25
    # The same statistic on a sampler that assumes the wrong q (uniform) for draft 0.
    biased = _draw(p0, p1, q0, q1, n, g, claimed_q0=torch.full((v,), 1 / v))
    first_b = torch.bincount(torch.tensor([t[0] for t in biased]), minlength=v).float()
    assert _chi2(first_b, p0) > 100


def test_greedy_rows_accept_only_the_argmax():
    greedy = torch.tensor([3, 1, 4, 4, 6])
    drafts = [3, 2, -1, 4, -1]  # request 0: two drafts and its bonus row; request 1: one
    accepted, recovered = rejection_sample(
        drafts, greedy, None, torch.ones(5, dtype=torch.bool), [None] * 5
    )
    assert accepted.tolist() == [True, False, False, True, False]
    tokens = emitted_tokens([2, 1], drafts, accepted.tolist(), recovered.tolist())
    assert tokens == [[3, 1], [4, 6]]


# ---- engines: exact greedy, batching, chunking, preemption, prefix caching -------------------


@pytest.fixture(scope="module")
def tiny_paths(tmp_path_factory):
    base = tmp_path_factory.mktemp("spec")
    target = str(base / "target")
    hf = build_tiny_hf_model("llama-gqa", target)
    # A layer-truncated draft of the same model (its first layer), and one of another vocabulary.
    hf.model.layers = hf.model.layers[:1]
    hf.config.num_hidden_layers = 1
    hf.save_pretrained(str(base / "draft"))
    other = str(base / "other")
    import transformers

    from tests.conftest import TINY_BASE

    cfg = transformers.AutoConfig.for_model("llama", **{**TINY_BASE, "vocab_size": 200})
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(other)
    return target, str(base / "draft"), other


def _prompts():
    # Repetitive prompts (the n-gram proposer finds matches) and one without repeats.
    g = torch.Generator().manual_seed(3)
    rep = [[int(t) for t in torch.randint(3, 250, (5,), generator=g)] * 4 for _ in range(3)]
    return [*rep, [int(t) for t in torch.randint(3, 250, (30,), generator=g)]]


@pytest.fixture(scope="module")
def tiny_reference(tiny_paths):
    llm = LLM(tiny_paths[0], **ENGINE)
    prompts = _prompts()
    outs = llm.generate(prompts, GREEDY)
    return prompts, [o.outputs[0].token_ids for o in outs]


def _oracle(prompts, outputs, rate=0.6):
    refs = [p + o for p, o in zip(prompts, outputs)]
    return oracle_config(3, Oracle(rate, refs))


def _check_overlap(llm, overlapped: bool) -> None:
    """Under async scheduling a speculative step's outputs are made while the next step runs:
    the first call launches the prompt's step and returns nothing, the second returns its token
    (synchronous: the first call does). Leaves the engine idle."""
    engine = llm.engine
    engine.add_request([5, 6, 7], SamplingParams(max_tokens=2, temperature=0), request_id="o")
    first = engine.step()
    assert (first == []) == overlapped
    while engine.has_unfinished_requests():
        engine.step()
    engine.finished_output("o")


def _check(llm, prompts, want, params=GREEDY):
    outs = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == want
    kv = llm.engine.kv_cache
    assert kv.pool.num_free_blocks == kv.pool.num_blocks and not kv.req_to_blocks
    return outs


@pytest.mark.parametrize(
    "engine_args",
    [
        {},
        {"max_num_batched_tokens": 8},  # chunked prefill next to verification steps
        {"num_kv_blocks": 16, "block_size": 4},  # preemption
        {"async_scheduling": True},
        {"async_scheduling": True, "max_num_batched_tokens": 8},
        {"async_scheduling": True, "num_kv_blocks": 16, "block_size": 4},
    ],
    ids=["plain", "chunked", "preempt", "async", "async-chunked", "async-preempt"],
)
def test_oracle_drafts_are_exact(tiny_paths, tiny_reference, engine_args):
    prompts, want = tiny_reference
    # Only the first two prompts have references: the others run without drafts in the batch.
    spec = _oracle(prompts[:2], want[:2])
    llm = LLM(tiny_paths[0], speculative_config=spec, **{**ENGINE, **engine_args})
    _check_overlap(llm, engine_args.get("async_scheduling", False))
    outs = _check(llm, prompts, want)
    drafted = [o.outputs[0].num_draft_tokens for o in outs]
    accepted = [o.outputs[0].num_accepted_tokens for o in outs]
    assert drafted[0] > 0 and drafted[1] > 0 and drafted[2:] == [0, 0]
    assert 0 < accepted[0] < drafted[0]  # both accepted and rejected drafts
    if "num_kv_blocks" in engine_args:
        assert llm.engine.scheduler.num_preemptions_total > 0


def test_verification_steps_replay_decode_graphs(tiny_paths, tiny_reference):
    """Decodes and verifications alone are one attention row per token: the decode graphs (here
    FakeGraph, the CPU stand-in for CUDA graphs) replay them, padded to a captured size."""
    from kiln.runtime.graph_runner import GraphRunner

    prompts, want = tiny_reference
    llm = LLM(tiny_paths[0], speculative_config=_oracle(prompts, want), max_num_seqs=16, **ENGINE)
    r = llm.engine.executor.runner
    r.graphs = GraphRunner(
        r.model, r.ops, r.backend, r.kv_caches, r.inputs, 16, r.max_model_len, fake=True
    )
    r.graphs.capture()
    r.step_timing = {}
    outs = _check(llm, prompts, want)
    assert all(o.outputs[0].num_accepted_tokens > 0 for o in outs)
    graph_rows = [row for row in r.step_timing["trace"] if row[0]]
    assert any(row[2] > row[1] for row in graph_rows)  # a graph step of more tokens than requests


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_ngram_and_draft_model_are_exact_with_prefix_caching(
    tiny_paths, tiny_reference, async_scheduling
):
    prompts, want = tiny_reference
    ngram = LLM(
        tiny_paths[0],
        speculative_config={"method": "ngram", "num_speculative_tokens": 3},
        async_scheduling=async_scheduling,
        **ENGINE,
    )
    _check(ngram, prompts, want)
    outs = _check(ngram, prompts, want)  # again: prompts now hit the prefix cache
    assert sum(o.num_cached_tokens for o in outs) > 0
    assert sum(o.outputs[0].num_accepted_tokens for o in outs) > 0
    draft = LLM(
        tiny_paths[0],
        speculative_config={
            "method": "draft_model",
            "num_speculative_tokens": 3,
            "model": tiny_paths[1],
        },
        max_num_batched_tokens=16,  # the draft catches up on 20-30-token prompts in chunks
        async_scheduling=async_scheduling,
        **ENGINE,
    )
    _check_overlap(draft, async_scheduling)
    outs = _check(draft, prompts, want)
    assert all(o.outputs[0].num_draft_tokens > 0 for o in outs)
    _check_prometheus(draft.engine, outs)
    proposer = draft.engine.executor.runner.proposer
    draft.engine.step()  # the runner (and so the draft) hear of finished requests next step
    pool = proposer.pool
    assert not proposer.states and pool.num_free_blocks == pool.kv_caches[0][0].shape[0]
    # The draft's KV pool is in the memory plan: fewer target blocks than without a draft.
    assert draft.engine.memory_plan.bytes_per_block > ngram.engine.memory_plan.bytes_per_block


def _check_prometheus(engine, outs):
    """vLLM's spec_decode_* counters, equal to the sums of the per-request counts."""
    from prometheus_client import CollectorRegistry, generate_latest

    from kiln.engine.step_loop import read_snapshot
    from kiln.server.metrics import _EngineCollector

    collector = _EngineCollector({"model_name": "m"}, {})
    collector.snapshot = read_snapshot(engine, {}, 0.0)
    registry = CollectorRegistry()
    registry.register(collector)
    text = generate_latest(registry).decode()
    drafted = sum(o.outputs[0].num_draft_tokens for o in outs)
    accepted = sum(o.outputs[0].num_accepted_tokens for o in outs)
    steps = sum(o.outputs[0].num_spec_steps for o in outs)
    assert f'spec_decode_num_draft_tokens_total{{model_name="m"}} {drafted:.1f}' in text
    assert f'spec_decode_num_accepted_tokens_total{{model_name="m"}} {accepted:.1f}' in text
    assert f'spec_decode_num_drafts_total{{model_name="m"}} {steps:.1f}' in text
    assert 'spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="0"}' in text


def test_draft_of_another_vocabulary_is_refused_at_load(tiny_paths):
    spec = {"method": "draft_model", "num_speculative_tokens": 2, "model": tiny_paths[2]}
    with pytest.raises(ModelLoadError, match="vocabulary has 200 tokens"):
        LLM(tiny_paths[0], speculative_config=spec, **ENGINE)


def test_seeded_sampling_with_drafts_does_not_depend_on_the_batch(tiny_paths, tiny_reference):
    prompts, _ = tiny_reference
    seeded = SamplingParams(max_tokens=16, temperature=0.2, seed=7, ignore_eos=True)
    other = SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True)
    # Drafts: the same seeded request's plain output (its first token is drawn as without drafts,
    # then each draft is accepted with the target's probability of it).
    plain = LLM(tiny_paths[0], **ENGINE).generate([prompts[0]], seeded)[0].outputs[0].token_ids
    llm = LLM(tiny_paths[0], speculative_config=_oracle([prompts[0]], [plain], 1.0), **ENGINE)
    alone = llm.generate([prompts[0]], seeded)[0].outputs[0]
    batched = llm.generate(prompts, [seeded, other, other, GREEDY])[0].outputs[0]
    assert alone.token_ids == batched.token_ids
    assert alone.num_draft_tokens > 0 and alone.num_accepted_tokens > 0


# ---- the real SmolLM2 ----------------------------------------------------------------------


def test_smollm2_ngram_and_truncated_draft_are_exact(smollm2_llm, smollm2_path):
    prompts = [
        "Copy this list: apples, pears, plums, apples, pears, plums, apples, pears,",
        "The capital of France is",
    ]
    params = SamplingParams(max_tokens=12, temperature=0)
    want = [o.outputs[0].token_ids for o in smollm2_llm.generate(prompts, params)]
    base = dict(kv_cache_memory_gb=0.1, max_num_seqs=4, num_threads=1)
    # n-gram under async scheduling (a step's outputs made while the next one runs); a stop
    # string then ends its request one step after the step that produced it: same text.
    ngram = LLM(
        smollm2_path,
        speculative_config={"method": "ngram", "num_speculative_tokens": 4},
        async_scheduling=True,
        **base,
    )
    outs = _check(ngram, prompts, want, params)
    assert outs[0].outputs[0].num_accepted_tokens > 0
    stop = SamplingParams(max_tokens=24, temperature=0, stop=["plums, apples, pears"])
    want_stop = smollm2_llm.generate(prompts[:1], stop)[0].outputs[0]
    got_stop = _check(ngram, prompts[:1], [want_stop.token_ids], stop)[0].outputs[0]
    assert want_stop.finish_reason == "stop" and want_stop.text == got_stop.text
    assert got_stop.finish_reason == "stop" and got_stop.num_accepted_tokens > 0
    del ngram
    # A layer-truncated SmolLM2 as its own draft: few drafts accepted, tokens unchanged.
    spec = {"method": "draft_model", "num_speculative_tokens": 2, "model": smollm2_path,
            "draft_num_hidden_layers": 6}  # fmt: skip
    outs = _check(LLM(smollm2_path, speculative_config=spec, **base), prompts[:1], want[:1], params)
    assert outs[0].outputs[0].num_draft_tokens > 0
