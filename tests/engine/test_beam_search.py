"""Beam search (engine/beam_search.py) against Hugging Face's generate(num_beams=W,
do_sample=False, length_penalty, early_stopping) in fp32: the same sequences in the same order
and the same scores, for tiny random models and SmolLM2; beams batch with ordinary requests,
fork their KV copy-on-write (a beam step computes one token a beam), and free every block when
done or aborted."""

from __future__ import annotations

import os

import pytest
import torch

from kiln import InvalidRequestError, SamplingParams
from kiln.engine.beam_search import BeamSearchManager
from kiln.interfaces import SchedulerOutput
from kiln.runtime.graph_runner import GraphRunner
from tests.conftest import build_tiny_hf_model

PROMPTS = [[1, 17, 42, 99, 5, 7], [1, 200, 3, 3, 150], [1, 64, 65, 66, 67, 68, 69, 70, 71, 72]]
# (the comparisons use the first two; the third only batches beside a beam search)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from kiln import LLM

    path = str(tmp_path_factory.mktemp("beam"))
    hf = build_tiny_hf_model("llama-gqa", path)
    return hf, LLM(path, dtype="float32", max_num_seqs=32, kv_cache_memory_gb=0.05)


def hf_beams(hf, prompt, width, n, max_tokens, length_penalty, early_stopping, eos=2):
    out = hf.generate(
        torch.tensor([prompt]),
        num_beams=width,
        num_return_sequences=n,
        do_sample=False,
        max_new_tokens=max_tokens,
        length_penalty=length_penalty,
        early_stopping=early_stopping,
        output_scores=True,
        return_dict_in_generate=True,
        eos_token_id=eos,
        pad_token_id=0,
    )
    seqs = []
    for s in out.sequences[:, len(prompt) :].tolist():
        seqs.append(s[: s.index(eos) + 1] if eos in s else s)
    return seqs, out.sequences_scores.tolist()


def kiln_beams(llm, prompt, width, n, max_tokens, length_penalty, early_stopping):
    params = SamplingParams(
        use_beam_search=True,
        best_of=width,
        n=n,
        max_tokens=max_tokens,
        length_penalty=length_penalty,
        early_stopping=early_stopping,
    )
    return llm.generate([prompt], params)[0]


@pytest.mark.parametrize(
    "width, n, max_tokens, length_penalty, early_stopping",
    [
        (2, 2, 8, 1.0, False),
        (4, 3, 10, 1.0, True),
        (4, 4, 10, 2.0, "never"),
        (8, 3, 12, 0.5, False),
        (8, 8, 6, 0.0, True),
    ],
)
def test_same_beams_and_scores_as_hf(tiny, width, n, max_tokens, length_penalty, early_stopping):
    hf, llm = tiny
    for prompt in PROMPTS[:2]:
        want, want_scores = hf_beams(
            hf, prompt, width, n, max_tokens, length_penalty, early_stopping
        )
        got = kiln_beams(llm, prompt, width, n, max_tokens, length_penalty, early_stopping)
        assert [c.token_ids for c in got.outputs] == want
        scores = [c.cumulative_logprob / len(c.token_ids) ** length_penalty for c in got.outputs]
        assert scores == pytest.approx(want_scores, abs=1e-4)
        assert all(
            c.finish_reason == "length" and len(c.token_ids) == max_tokens for c in got.outputs
        ) or any(c.token_ids[-1] == 2 for c in got.outputs)


@pytest.fixture(scope="module")
def tiny_eos(tiny, tmp_path_factory):
    """The same weights with EOS moved to a token the beams pick early (found by a first search),
    so that beams end in EOS before max_tokens."""
    import json
    import shutil

    from kiln import LLM

    hf, llm = tiny
    src = llm.engine.config.model
    first = kiln_beams(llm, PROMPTS[0], 8, 8, 12, 0.5, False)
    eos = first.outputs[0].token_ids[2]
    path = str(tmp_path_factory.mktemp("beam-eos"))
    shutil.copytree(src, path, dirs_exist_ok=True)
    for name in ("config.json", "generation_config.json"):
        file = os.path.join(path, name)
        if os.path.exists(file):
            with open(file) as f:
                cfg = json.load(f)
            cfg["eos_token_id"] = eos
            with open(file, "w") as f:
                json.dump(cfg, f)
    return hf, LLM(path, dtype="float32", max_num_seqs=32, kv_cache_memory_gb=0.05), eos


@pytest.mark.parametrize(
    "width, n, length_penalty, early_stopping",
    [(2, 2, 1.0, False), (4, 3, 1.0, True), (8, 8, 0.5, False), (8, 4, 2.0, "never")],
)
def test_beams_ending_in_eos_match_hf(tiny_eos, width, n, length_penalty, early_stopping):
    hf, llm, eos = tiny_eos
    ended = 0
    for prompt in PROMPTS[:2]:
        want, want_scores = hf_beams(
            hf, prompt, width, n, 12, length_penalty, early_stopping, eos=eos
        )
        got = kiln_beams(llm, prompt, width, n, 12, length_penalty, early_stopping)
        assert [c.token_ids for c in got.outputs] == want
        scores = [c.cumulative_logprob / len(c.token_ids) ** length_penalty for c in got.outputs]
        assert scores == pytest.approx(want_scores, abs=1e-4)
        for c in got.outputs:
            assert c.finish_reason == ("stop" if c.token_ids[-1] == eos else "length")
            ended += c.token_ids[-1] == eos
    if length_penalty <= 1.0:  # (a penalty of 2 favours the long beams: they may all run on)
        assert ended  # EOS inside the beams (the tiny fixture's searches have none)


LONG_PROMPT = [1, *range(100, 139)]  # 40 tokens: two full blocks of 16, 8 tokens of a third


def record_steps(monkeypatch, engine) -> list[tuple[SchedulerOutput, int]]:
    """Every step the engine submits, with the KV blocks referenced at that moment."""
    steps = []
    submit = engine.executor.submit
    pool = engine.kv_cache.pool

    def recording(step: SchedulerOutput) -> bool:
        steps.append((step, pool.num_blocks - pool.num_free_blocks))
        return submit(step)

    monkeypatch.setattr(engine.executor, "submit", recording)
    return steps


def is_beam(req_id: str) -> bool:
    return "#beam" in req_id


def test_beams_batch_with_ordinary_requests_and_free_their_blocks(tiny, monkeypatch):
    hf, llm = tiny
    engine = llm.engine
    plain = SamplingParams(temperature=0, max_tokens=12)
    alone = llm.generate(PROMPTS[1:], plain)
    beam = SamplingParams(use_beam_search=True, best_of=4, n=2, max_tokens=10)
    steps = record_steps(monkeypatch, engine)
    mixed = llm.generate([LONG_PROMPT, *PROMPTS[1:]], [beam, plain, plain])
    assert [o.outputs[0].token_ids for o in mixed[1:]] == [o.outputs[0].token_ids for o in alone]
    want, _ = hf_beams(hf, LONG_PROMPT, 4, 2, 10, 1.0, False)
    assert [c.token_ids for c in mixed[0].outputs] == want
    # Beams and ordinary requests in the same steps; after the prompt's step every beam computes
    # one token (forked from its parent's KV, not recomputed from the prefix cache).
    assert any(
        any(map(is_beam, s.num_scheduled_tokens)) and not all(map(is_beam, s.num_scheduled_tokens))
        for s, _ in steps
    )
    beam_rows = [(r, n) for s, _ in steps for r, n in s.num_scheduled_tokens.items() if is_beam(r)]
    assert beam_rows[0][0].endswith("#beam0.0")  # the prompt's step: beam 0 alone
    assert len(beam_rows) == 1 + 9 * 4 and all(n == 1 for _, n in beam_rows[1:])
    assert engine.kv_cache.usage == 0.0 and not engine.has_unfinished_requests()
    assert not engine.scheduler.retained


def test_each_beam_step_is_a_graph_step_of_one_row_a_beam(tiny, monkeypatch):
    """After the prompt, a beam step is a pure decode step of W rows: the decode-graph path
    (FakeGraph on the CPU), one token a beam, the prompt's full blocks shared, partial blocks
    copied on the device, and the same beams as HF."""
    hf, llm = tiny
    engine = llm.engine
    runner = engine.executor.runner
    graphs = GraphRunner(
        runner.model,
        runner.ops,
        runner.backend,
        runner.kv_caches,
        runner.inputs,
        runner.max_num_seqs,
        runner.max_model_len,
        fake=True,
    )
    graphs.capture()
    monkeypatch.setattr(runner, "graphs", graphs)
    monkeypatch.setattr(runner, "step_timing", {})
    steps = record_steps(monkeypatch, engine)
    width, max_tokens = 4, 12  # 40 + 8 tokens reach a block boundary: a fork that copies nothing
    got = kiln_beams(llm, LONG_PROMPT, width, width, max_tokens, 1.0, False)
    want, want_scores = hf_beams(hf, LONG_PROMPT, width, width, max_tokens, 1.0, False)
    assert [c.token_ids for c in got.outputs] == want
    scores = [c.cumulative_logprob / len(c.token_ids) for c in got.outputs]
    assert scores == pytest.approx(want_scores, abs=1e-4)
    assert len(steps) == max_tokens
    first, _ = steps[0]  # the prompt, once (past its prefix-cache hits)
    assert len(first.num_scheduled_tokens) == 1 and first.total_num_scheduled_tokens > 1
    for step, _ in steps[1:]:
        assert list(step.num_scheduled_tokens.values()) == [1] * width
        assert {new.num_computed_tokens for new in step.new_requests} == {
            len(new.prompt_token_ids) - 1 for new in step.new_requests
        }
    assert sum(len(s.block_copies) for s, _ in steps) > 0
    trace = runner.step_timing["trace"]  # [graph, num_seqs, num_tokens, ...] per step
    assert [row[:3] for row in trace[1:]] == [[True, width, width]] * (max_tokens - 1)
    # The prompt's two full blocks are held once; each beam adds at most its last two blocks.
    assert max(in_use for _, in_use in steps) <= 2 + 2 * width
    assert engine.kv_cache.usage == 0.0 and not engine.scheduler.retained


def test_beams_under_async_scheduling_match_hf(tiny, monkeypatch):
    """Async scheduling: a beam step's children are queued while the next step already runs."""
    hf, llm = tiny
    monkeypatch.setattr(llm.engine, "async_scheduling", True)
    plain = SamplingParams(temperature=0, max_tokens=12)
    alone = llm.generate(PROMPTS[1:], plain)
    beam = SamplingParams(use_beam_search=True, best_of=4, n=3, max_tokens=10)
    mixed = llm.generate([LONG_PROMPT, *PROMPTS[1:]], [beam, plain, plain])
    assert [o.outputs[0].token_ids for o in mixed[1:]] == [o.outputs[0].token_ids for o in alone]
    want, _ = hf_beams(hf, LONG_PROMPT, 4, 3, 10, 1.0, False)
    assert [c.token_ids for c in mixed[0].outputs] == want
    assert llm.engine.kv_cache.usage == 0.0 and not llm.engine.has_unfinished_requests()


def record_outputs(monkeypatch, engine) -> list:
    """Every step's ModelRunnerOutput, as the engine collects it."""
    outputs = []
    collect = engine.executor.collect

    def recording():
        outputs.append(collect())
        return outputs[-1]

    monkeypatch.setattr(engine.executor, "collect", recording)
    return outputs


@pytest.mark.parametrize("max_num_seqs", [32, 3])
def test_only_each_searchs_top_k_comes_back(tiny, monkeypatch, max_num_seqs):
    """The selection's top K runs on the device: a step of a search's W beams sends back K = 2W
    candidates (no logprobs over the vocabulary); a step that holds only some of its beams (3
    sequence slots for 4 beams) sends K a row, which the search merges once all are back; the
    beams are HF's either way."""
    hf, llm = tiny
    engine = llm.engine
    monkeypatch.setattr(engine.scheduler, "max_num_seqs", max_num_seqs)
    outputs = record_outputs(monkeypatch, engine)
    width, max_tokens = 4, 8
    got = kiln_beams(llm, LONG_PROMPT, width, width, max_tokens, 1.0, False)
    want, want_scores = hf_beams(hf, LONG_PROMPT, width, width, max_tokens, 1.0, False)
    assert [c.token_ids for c in got.outputs] == want
    scores = [c.cumulative_logprob / len(c.token_ids) for c in got.outputs]
    assert scores == pytest.approx(want_scores, abs=1e-4)
    groups = [c for out in outputs for c in out.beam_candidates.values()]
    assert groups and not any(out.logprobs for out in outputs)
    assert {len(c.scores) for c in groups} == {2 * width}
    for c in groups:
        assert c.scores == sorted(c.scores, reverse=True) and set(c.beams) <= set(range(width))
    per_step = [len(out.beam_candidates) for out in outputs if out.beam_candidates]
    if max_num_seqs >= width:  # one group a step: the prompt's, then the search's 4 beams
        assert per_step == [1] * max_tokens
    else:  # 3 rows, then 1: a group a row
        assert per_step[0] == 1 and set(per_step[1:]) == {3, 1}
        assert sum(per_step[1:]) == width * (max_tokens - 1)
    assert engine.kv_cache.usage == 0.0 and not engine.scheduler.retained


@pytest.mark.parametrize("num_kv_blocks, plain_tokens", [(6, 60), (9, 12)])
def test_beams_in_a_tight_pool_match_hf(tiny, num_kv_blocks, plain_tokens):
    """A pool too small for every fork: forks that find no room for their blocks fall back to a
    recompute, retained KV is reclaimed rather than waited for, forked beams (holding their
    blocks) are admitted before a queue the pool has stopped, an ordinary request is preempted
    (6 blocks); the beams and the ordinary outputs are the same, and nothing stalls."""
    from kiln import LLM

    hf, roomy = tiny
    plain = SamplingParams(temperature=0, max_tokens=plain_tokens)
    alone = roomy.generate(PROMPTS[1:], plain)
    llm = LLM(roomy.engine.config.model, dtype="float32", num_kv_blocks=num_kv_blocks)
    engine = llm.engine
    engine.add_request(
        LONG_PROMPT,
        SamplingParams(use_beam_search=True, best_of=8, n=4, max_tokens=12),
        request_id="beams",
    )
    for i, prompt in enumerate(PROMPTS[1:]):
        engine.add_request(prompt, plain, request_id=f"plain{i}")
    finals = {}
    for _ in range(500):
        for delta in engine.step():
            if delta.finished:
                finals[delta.request_id] = engine.finished_output(delta.request_id)
        if not engine.has_unfinished_requests():
            break
    assert not engine.has_unfinished_requests(), "stalled"
    want, _ = hf_beams(hf, LONG_PROMPT, 8, 4, 12, 1.0, False)
    assert [c.token_ids for c in finals["beams"].outputs] == want
    assert [finals[f"plain{i}"].outputs[0].token_ids for i in range(2)] == [
        o.outputs[0].token_ids for o in alone
    ]
    assert engine.kv_cache.usage == 0.0 and not engine.scheduler.retained
    if num_kv_blocks == 6:
        assert engine.scheduler.num_preemptions_total > 0


def test_abort_frees_every_block(tiny):
    _, llm = tiny
    engine = llm.engine
    long_prompt = list(range(3, 60))
    params = SamplingParams(use_beam_search=True, best_of=4, max_tokens=40)
    engine.add_request(long_prompt, params, request_id="beam-abort")
    for _ in range(6):
        engine.step()
    # Between steps the search holds only its next step's queued children (the last step's
    # finished and let go of their blocks).
    assert engine.scheduler.has_unfinished_requests()
    assert engine.hook(BeamSearchManager).active
    [final] = engine.abort_request("beam-abort")
    assert final.finished and final.outputs[0].finish_reason == "abort"
    assert not engine.scheduler.has_unfinished_requests() and not engine.has_unfinished_requests()
    assert not [r for r in engine.output_processor.requests if r.startswith("beam-abort")]
    assert engine.kv_cache.usage == 0.0 and not engine.scheduler.retained
    assert engine.finished_output("beam-abort") is None
    # Mid-step: the children are running and hold blocks; an abort frees them.
    engine.add_request(long_prompt, params, request_id="beam-abort-2")
    sched = engine.scheduler.schedule()
    assert engine.kv_cache.usage > 0.0
    engine._to_deltas(engine._apply_to_scheduler(sched, engine.executor.execute(sched)))
    engine.abort_request("beam-abort-2")
    assert engine.kv_cache.usage == 0.0 and not engine.has_unfinished_requests()


def test_beam_params_are_validated():
    with pytest.raises(InvalidRequestError, match="best_of"):
        SamplingParams(use_beam_search=True, best_of=2, n=3)
    with pytest.raises(InvalidRequestError, match="early_stopping"):
        SamplingParams(use_beam_search=True, early_stopping="sometimes")
    with pytest.raises(InvalidRequestError, match="use_beam_search"):
        SamplingParams(use_beam_search=True, stop=["x"])


def test_host_fp32_arithmetic_is_torchs():
    """The search's host arithmetic (Python doubles rounded to fp32 after each op) gives what
    HF's torch fp32 ops give: sums with -1e9 and divisions by a Python float's fp32 value."""
    from kiln.engine.beam_search import NEG, _fp32

    gen = torch.Generator().manual_seed(3)
    a = (-30 * torch.rand(2000, generator=gen) - 1e-3 * torch.rand(2000, generator=gen)).float()
    values = a.tolist()
    assert _fp32(values) == values  # fp32 values stay exact
    assert _fp32([x + NEG for x in values]) == (a + NEG).tolist()
    for length, penalty in [(7, 1.0), (13, 0.5), (64, 2.0), (3, 1.3)]:
        [divisor] = _fp32([length**penalty])
        assert _fp32([x / divisor for x in values]) == (a / length**penalty).tolist()
