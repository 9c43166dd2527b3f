"""Structured output (kiln/structured_output on xgrammar) through the Python API: every output
that finishes with "stop" parses and validates (jsonschema), grammars batch with unconstrained
requests without changing them, a grammar cut short by max_tokens says "length", bad specs are
named. Tiny random model with a tiny BPE tokenizer (tests/tiny_tokenizer.py); one test on the
real SmolLM2."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from kiln import GuidedDecodingParams, InvalidRequestError, SamplingParams
from kiln.engine.grammar_compiles import GrammarCompiles
from kiln.sampling.logits_processors import (
    TokenBitmaskProcessor,
    forbidden_by_bitmask,
    unpack_bitmask,
)
from kiln.sampling_params import GuidedDecodingParams as GDP

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {
            "type": "array",
            "items": {"type": "string", "pattern": "^[a-z]{1,6}$"},
            "maxItems": 3,
        },
        "address": {
            "type": "object",
            "properties": {
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                "ok": {"type": "boolean"},
            },
            "required": ["zip", "ok"],
        },
    },
    "required": ["name", "age", "color", "tags", "address"],
}


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    from tests.tiny_tokenizer import build_tiny_chat_model

    return build_tiny_chat_model(str(tmp_path_factory.mktemp("tiny-chat")))


@pytest.fixture(scope="module")
def tiny_llm(tiny_path):
    from kiln import LLM

    return LLM(tiny_path, max_num_seqs=16, kv_cache_memory_gb=0.05, max_model_len=512)


def _guided(**kwargs) -> SamplingParams:
    spec = kwargs.pop("spec")
    return SamplingParams(guided_decoding=GuidedDecodingParams(**spec), **kwargs)


def test_json_schema_outputs_validate_and_batch_with_plain_requests(tiny_llm):
    prompts = [f"Person {i}:" for i in range(6)]
    plain = SamplingParams(temperature=0, max_tokens=24)
    alone = tiny_llm.generate(prompts[:2], plain)
    constrained = [
        _guided(spec={"json": PERSON}, temperature=1.0, seed=i, max_tokens=200) for i in range(4)
    ]
    # One batch: two unconstrained greedy rows share the steps with four grammar rows.
    outs = tiny_llm.generate(prompts, [plain, plain, *constrained])
    assert [o.outputs[0].token_ids for o in outs[:2]] == [o.outputs[0].token_ids for o in alone]
    texts = set()
    for out in outs[2:]:
        c = out.outputs[0]
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), PERSON)
        texts.add(c.text)
    assert len(texts) == 4  # seeded sampling under the grammar, not one forced string
    # Unconstrained, the same seeds give no JSON at all: the grammar is what shapes them.
    free = tiny_llm.generate(
        prompts[2:], [SamplingParams(temperature=1.0, seed=i) for i in range(4)]
    )
    assert not any(o.outputs[0].text.startswith('{"name"') for o in free)


def test_a_deferred_grammar_row_draws_from_its_own_steps_generator(tiny_llm, monkeypatch):
    """A grammar row's sampler waits for its mask (deferred) and is launched later, but its
    seeded generator is the one of the token it samples, as for a row without a grammar: the
    n-th token draws from (seed, n), and min_tokens counts the tokens before it. (Built after
    its rows were marked pending, the deferred metadata once counted its own token: every draw
    and the min_tokens mask one step ahead.)"""
    from kiln.runtime import sampling_inputs

    calls = []
    real = sampling_inputs.step_generator

    def spy(seed, step, device):
        calls.append((seed, step))
        return real(seed, step, device)

    monkeypatch.setattr(sampling_inputs, "step_generator", spy)
    for params in (
        SamplingParams(temperature=1.0, seed=11, max_tokens=6, ignore_eos=True),
        _guided(
            spec={"regex": "[a-z]{6}"}, temperature=1.0, seed=12, max_tokens=6, ignore_eos=True
        ),
    ):
        out = tiny_llm.generate(["Steps:"], params)[0].outputs[0]
        assert len(out.token_ids) == 6, out.text
    assert calls == [(11, n) for n in range(6)] + [(12, n) for n in range(6)]


@pytest.fixture(scope="module")
def async_llm(tiny_path):
    """Async scheduling (the GPU's schedule) on a KV pool too small for the mixed batch below
    at once: requests are preempted and added back (their matchers replay their output)."""
    from kiln import LLM

    llm = LLM(
        tiny_path,
        max_num_seqs=16,
        num_kv_blocks=10,  # 160 tokens: the longest reply below (~100) fits alone
        block_size=16,
        enable_prefix_caching=False,
        max_model_len=160,
        async_scheduling=True,
    )
    assert llm.engine.async_scheduling
    return llm


# Grammar rows (seeded, greedy; some ended early by max_tokens or a stop string while the next
# step is in flight) beside plain rows.
MIXED_PROMPTS = [f"Row {i}:" for i in range(7)]
MIXED_PARAMS = [
    SamplingParams(temperature=0, max_tokens=30),
    _guided(spec={"json": PERSON}, temperature=1.0, seed=7, max_tokens=200),
    _guided(spec={"regex": "[a-z]{3,9}"}, temperature=1.0, seed=8, max_tokens=20),
    SamplingParams(temperature=1.0, seed=9, max_tokens=30),
    _guided(spec={"json": PERSON}, temperature=0, max_tokens=200),
    _guided(spec={"json": PERSON}, temperature=1.0, seed=5, max_tokens=3),
    _guided(spec={"json": PERSON}, temperature=1.0, seed=6, max_tokens=80, stop=['",']),
]


@pytest.fixture(scope="module")
def sync_llm(tiny_path):
    """The synchronous engine, explicitly: on CUDA the default is async scheduling."""
    from kiln import LLM

    return LLM(
        tiny_path,
        max_num_seqs=16,
        kv_cache_memory_gb=0.05,
        max_model_len=512,
        async_scheduling=False,
    )


def _grammar_mask(llm):
    """The runner's grammar hook (its matchers: .grammars, built on first use by .batch())."""
    from kiln.runtime.step_hooks import GrammarMask

    return llm.engine.executor.runner.hooks.get(GrammarMask)


def test_async_scheduling_gives_the_same_outputs(sync_llm, async_llm):
    """The GPU's schedule on the CPU: step N+1 is launched before N's tokens are back, and N+1's
    mask is filled from N's ids as soon as they are on the host (the worker takes them there,
    before the runner's thread collects N). Same tokens as the synchronous engine, for grammar
    rows and the plain rows beside them, through preemptions."""
    grammars = _grammar_mask(async_llm).grammars
    early = grammars.stats.num_early_fills if grammars is not None else 0
    want = sync_llm.generate(MIXED_PROMPTS, MIXED_PARAMS)
    got = async_llm.generate(MIXED_PROMPTS, MIXED_PARAMS)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    jsonschema.validate(json.loads(got[1].outputs[0].text), PERSON)
    assert [o.outputs[0].finish_reason for o in got[5:]] == ["length", "stop"]
    assert async_llm.engine.scheduler.num_preemptions_total > 0
    # The fills took the previous step's ids themselves (the synchronous engine's never do).
    assert _grammar_mask(async_llm).grammars.stats.num_early_fills > early
    assert _grammar_mask(sync_llm).grammars.stats.num_early_fills == 0


def test_requests_aborted_and_preempted_while_a_fill_runs(tiny_llm, async_llm, monkeypatch):
    """A slowed worker: each fill is still running when the next submit removes finished and
    aborted requests' matchers and adds preempted ones back (a new matcher replays the output).
    The requests left give the synchronous engine's tokens, and each matcher was given exactly
    its request's next tokens: none twice (an invalid repeat would be refused by xgrammar
    without a trace in the output), none skipped, none lost."""
    import time

    from kiln.structured_output.matchers import GrammarBatch

    engine = async_llm.engine
    grammars = _grammar_mask(async_llm).batch()
    added: dict[str, list[tuple[object, int]]] = {}  # request -> [(its matcher, replayed)]
    applied: dict[int, list[int]] = {}  # id(matcher) -> tokens given to it, in order
    real_add, real_accept, real_work = grammars.add, grammars._batch_accept, GrammarBatch._work

    def add(req_id, spec, output_token_ids):
        real_add(req_id, spec, output_token_ids)
        added.setdefault(req_id, []).append((grammars.rows[req_id].matcher, len(output_token_ids)))

    def accept(matchers, tokens):
        for m, t in zip(matchers, tokens):
            applied.setdefault(id(m), []).append(t)
        return real_accept(matchers, tokens)

    def slow_work(self, *args):
        time.sleep(0.01)
        return real_work(self, *args)

    monkeypatch.setattr(grammars, "add", add)
    monkeypatch.setattr(grammars, "_batch_accept", accept)
    monkeypatch.setattr(GrammarBatch, "_work", slow_work)
    preemptions = engine.scheduler.num_preemptions_total
    ids = [
        engine.add_request(p, params, request_id=f"abort-{i}")
        for i, (p, params) in enumerate(zip(MIXED_PROMPTS, MIXED_PARAMS))
    ]
    aborted = {ids[2], ids[6]}  # grammar rows, aborted with a grammar step in flight
    outputs, steps = {}, 0
    while engine.has_unfinished_requests():
        steps += 1
        if steps == 4:
            assert engine.executor.runner._deferred is not None
            assert not aborted & outputs.keys()  # still running
            engine.abort_request(sorted(aborted))
        for delta in engine.step():
            if delta.finished:
                outputs[delta.request_id] = engine.finished_output(delta.request_id)
    assert engine.scheduler.num_preemptions_total > preemptions
    want = tiny_llm.generate(MIXED_PROMPTS, MIXED_PARAMS)
    for i, req_id in enumerate(ids):
        if req_id in aborted:
            continue
        tokens = outputs[req_id].outputs[0].token_ids
        assert tokens == want[i].outputs[0].token_ids, i
        if MIXED_PARAMS[i].guided_decoding is None:
            continue
        for matcher, replayed in added[req_id]:
            seen = [*tokens[:replayed], *applied.get(id(matcher), [])]
            assert seen == tokens[: len(seen)], (i, replayed)  # in order, none twice or skipped
        assert len(seen) >= len(tokens) - 1, i  # the last matcher: all but maybe the last token


def test_greedy_json_object_and_n_completions(tiny_llm):
    outs = tiny_llm.generate(
        ["a", "b"],
        [
            _guided(spec={"json_object": True}, temperature=0, max_tokens=120),
            _guided(spec={"json": PERSON}, temperature=0.8, seed=3, n=3, max_tokens=200),
        ],
    )
    obj = outs[0].outputs[0]
    if obj.finish_reason == "stop":
        assert isinstance(json.loads(obj.text), dict)
    else:  # a greedy random model may nest forever: then it says so
        assert obj.finish_reason == "length" and obj.text.startswith("{")
    assert len(outs[1].outputs) == 3
    for c in outs[1].outputs:
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.text), PERSON)


def test_regex_choice_and_ebnf_grammar(tiny_llm):
    grammar = 'root ::= "(" item ("," item)* ")"\nitem ::= [a-c] | "x" [0-9]'
    specs = [
        ({"regex": r"[0-9]{3}-[0-9]{4}"}, lambda t: re.fullmatch(r"[0-9]{3}-[0-9]{4}", t)),
        (
            {"choice": ["red", "blue sky", 'say "hi"']},
            lambda t: t in ("red", "blue sky", 'say "hi"'),
        ),
        (
            {"grammar": grammar},
            lambda t: re.fullmatch(r"\((?:[a-c]|x[0-9])(?:,(?:[a-c]|x[0-9]))*\)", t),
        ),
    ]
    params = [
        _guided(spec=spec, temperature=1.0, seed=seed, max_tokens=60)
        for spec, _ in specs
        for seed in range(3)
    ]
    outs = tiny_llm.generate(["Answer:"] * len(params), params)
    for i, out in enumerate(outs):
        c = out.outputs[0]
        check = specs[i // 3][1]
        if c.finish_reason == "length":  # only the open-ended grammar may run out
            assert i // 3 == 2
            continue
        assert c.finish_reason == "stop" and check(c.text), (i, c.text)


def test_a_grammar_cut_short_says_length(tiny_llm):
    out = tiny_llm.generate(["x"], _guided(spec={"json": PERSON}, temperature=0, max_tokens=5))
    c = out[0].outputs[0]
    assert c.finish_reason == "length" and len(c.token_ids) == 5
    with pytest.raises(ValueError):
        json.loads(c.text)


def test_eos_only_where_the_grammar_accepts(tiny_llm):
    # "a" then at least four more "a"s: EOS (id 2) may not come before the fifth.
    tok = tiny_llm.get_tokenizer()
    outs = tiny_llm.generate(
        ["y"] * 4,
        [
            _guided(spec={"regex": "a{5,}"}, temperature=1.0, seed=s, max_tokens=40)
            for s in range(4)
        ],
    )
    for out in outs:
        c = out.outputs[0]
        assert re.fullmatch("a+", c.text)
        if c.finish_reason == "stop":
            assert len(c.text) >= 5 and c.token_ids[-1] == tok.eos_token_id


@pytest.mark.parametrize(
    "spec, words",
    [
        ({"json": {"type": "object", "properties": {"a": {"type": "strin"}}}}, "JSON schema"),
        ({"regex": "a(b"}, "regex"),
        ({"grammar": "root ::= undefined_rule"}, "EBNF grammar"),
    ],
)
def test_bad_specs_are_refused_with_the_problem_named(tiny_llm, spec, words):
    with pytest.raises(InvalidRequestError, match=words) as info:
        tiny_llm.generate(["x"], SamplingParams(guided_decoding=GuidedDecodingParams(**spec)))
    assert info.value.param
    # The engine keeps serving.
    assert tiny_llm.generate(["x"], SamplingParams(max_tokens=2))[0].outputs[0].token_ids


def test_guided_params_need_exactly_one_kind_and_cache_by_spec():
    with pytest.raises(InvalidRequestError, match="exactly one"):
        GDP()
    with pytest.raises(InvalidRequestError, match="exactly one"):
        GDP(json={"type": "object"}, regex="a")
    with pytest.raises(InvalidRequestError, match="guided_choice"):
        GDP(choice=[])
    assert GDP(json={"a": 1, "b": 2}).key == GDP(json='{"a": 1, "b": 2}').key
    assert GDP(json={"a": 1, "b": 2}).key != GDP(json={"b": 2, "a": 1}).key  # order generates
    assert SamplingParams(guided_decoding={"regex": "a"}).guided_decoding == GDP(regex="a")


def test_compiled_grammars_are_cached(tiny_llm):
    from kiln.structured_output import compiler_for

    engine = tiny_llm.engine
    compiler = compiler_for(engine.tokenizer, engine.model_config.vocab_size, engine.eos_token_ids)
    first = compiler.compile(GDP(json=PERSON))
    assert compiler.compile(GDP(json=dict(PERSON))) is first


def test_bitmask_processor_masks_exactly_the_cleared_bits():
    vocab = 70  # not a multiple of 32: the last word is partly padding
    bitmask = torch.full((2, 3), -1, dtype=torch.int32)
    bitmask[0] = 0
    bitmask[0, 0] = 1 << 5  # row 0 allows token 5 only
    bitmask[0, 2] = 1 << 1  # ... and token 65
    bitmask[1, 1] = 2**31 - 1  # row 1 forbids token 63 only (the sign bit)
    allowed = unpack_bitmask(bitmask, vocab)
    assert allowed[0].nonzero().flatten().tolist() == [5, 65]
    assert (~allowed[1]).nonzero().flatten().tolist() == [63]
    assert unpack_bitmask(bitmask, 100)[:, 96:].sum() == 0  # ids past the mask are not allowed
    logits = torch.randn(2, vocab)
    before = logits.clone()

    class MD:
        token_bitmask = bitmask

    out = TokenBitmaskProcessor().apply(logits, MD)
    assert torch.equal(logits, before)  # never writes into its input
    assert torch.isinf(out[0]).sum() == vocab - 2 and out[0, 5] == logits[0, 5]
    assert torch.isinf(out[1]).sum() == 1 and torch.isinf(out[1, 63])


def test_byte_lookup_is_the_negation_of_the_unpack():
    g = torch.Generator().manual_seed(0)
    for vocab in (70, 96, 384):
        words = -(-vocab // 32)
        bitmask = torch.randint(-(2**31), 2**31, (5, words), generator=g).to(torch.int32)
        bitmask[0] = -1  # all allowed
        bitmask[1] = 0  # none
        for width in (vocab - 3, vocab, words * 32, words * 32 + 9):  # narrower, padded, wider
            want = ~unpack_bitmask(bitmask, width)
            assert torch.equal(forbidden_by_bitmask(bitmask, width), want), (vocab, width)


def test_threaded_fill_equals_xgrammar_serial(tiny_llm):
    """GrammarBatch's worker over several fill threads gives xgrammar's own masks row for row:
    rows at different places in different grammars, a row without a grammar and a grammar that
    has ended (both all allowed)."""
    import xgrammar as xgr

    from kiln.structured_output import GrammarBatch, compiler_for

    engine = tiny_llm.engine
    tok = engine.tokenizer
    compiler = compiler_for(tok, engine.model_config.vocab_size, engine.eos_token_ids)
    batch = GrammarBatch(compiler, fill_threads=3)
    specs = [GDP(json=PERSON), GDP(regex="[a-z]{3,9}"), GDP(choice=["red", "blue sky"])]
    prefixes = ['{"name": "Al', "", '{"name": "Bo", "age": 3', "abc", "blue"]
    req_ids = []
    for i, prefix in enumerate(prefixes):
        req_ids.append(f"r{i}")
        spec = specs[0] if prefix.startswith("{") else specs[1 + (i == 4)]
        batch.add(f"r{i}", spec, tok.encode(prefix, add_special_tokens=False))
    ended = "r5"
    batch.add(ended, specs[2], tok.encode("red", add_special_tokens=False))
    # Queued, applied by the worker before it fills: the row ends there and is all allowed.
    batch.accept_tokens([ended], [tok.eos_token_id])
    assert not batch.matchers[ended].is_terminated()
    rows = [*req_ids[:2], "plain", *req_ids[2:], ended]
    assert batch.has_grammar(rows) and not batch.has_grammar(["plain"])

    got = batch.finish_fill(batch.start_fill(rows, torch.device("cpu")), torch.device("cpu"))
    assert batch.matchers[ended].is_terminated() and batch.rows[ended].ended
    want = xgr.allocate_token_bitmask(len(rows), compiler.vocab_size)
    for row, req_id in enumerate(rows):
        matcher = batch.matchers.get(req_id)
        if matcher is not None and not matcher.is_terminated():
            matcher.fill_next_token_bitmask(want, row)
    assert torch.equal(got, want)
    assert (got[2] == -1).all() and (got[-1] == -1).all()
    assert (got[0] != -1).any()  # a constrained row really is constrained
    assert batch.stats.num_rows_filled == 5
    # Every grammar ended: nothing to apply.
    assert batch.fill_bitmask(["plain", ended], torch.device("cpu")) is None


def test_a_fill_waits_for_incoming_ids_and_reads_them_where_they_land(tiny_llm):
    """The GPU's ordering on the CPU: a fill started before the previous step's ids are on the
    host waits for their copy's event in the worker, then reads the grammar rows' ids from the
    host buffer as they are then (written after start_fill here), applies them after the tokens
    the runner queued, and fills as xgrammar does serially. A request removed after the start
    still gets its token in that fill; the next fill applies nothing again."""
    import threading
    import time

    import xgrammar as xgr

    from kiln.structured_output import GrammarBatch, compiler_for
    from kiln.structured_output.matchers import IncomingTokens

    class Landing:  # a CUDA event's two calls that the worker makes
        def __init__(self):
            self.landed = threading.Event()

        def query(self):
            return self.landed.is_set()

        def synchronize(self):
            self.landed.wait(10)

    engine = tiny_llm.engine
    tok = engine.tokenizer
    compiler = compiler_for(tok, engine.model_config.vocab_size, engine.eos_token_ids)
    batch = GrammarBatch(compiler, fill_threads=2)
    spec_re, spec_json = GDP(regex="[a-z]{3,9}"), GDP(json=PERSON)
    enc = lambda text: tok.encode(text, add_special_tokens=False)
    batch.add("a", spec_re, [])
    batch.add("b", spec_json, enc('{"name": "'))
    batch.add("gone", spec_re, [])
    (first,), (second,) = enc("a"), enc("b")
    batch.accept_tokens(["a"], [first])  # an older step, collected: queued
    ids = torch.full((4,), -1, dtype=torch.long)  # not landed yet
    landing = Landing()
    step_rows = ["plain", "a", "gone", "b"]
    pending = batch.start_fill(
        ["b", "plain", "a"], torch.device("cpu"), [IncomingTokens(ids, landing, step_rows)]
    )
    batch.remove("gone")
    time.sleep(0.05)
    assert not pending.done.done()  # the worker waits for the landing
    b_token = enc("Al")[0]
    ids.copy_(torch.tensor([0, second, first, b_token]))
    landing.landed.set()
    got = batch.finish_fill(pending, torch.device("cpu"))
    assert batch.stats.num_early_fills == 1 and batch.stats.ids_wait_s > 0.04

    def want(tokens_by_row):
        mask = xgr.allocate_token_bitmask(len(tokens_by_row), compiler.vocab_size)
        for row, (spec, tokens) in enumerate(tokens_by_row):
            if spec is None:
                continue
            matcher = xgr.GrammarMatcher(compiler.compile(spec))
            assert all(matcher.accept_token(t) for t in tokens)
            matcher.fill_next_token_bitmask(mask, row)
        return mask

    b_tokens = [*enc('{"name": "'), b_token]
    expected = want([(spec_json, b_tokens), (None, []), (spec_re, [first, second])])
    assert torch.equal(got, expected)
    assert (got[0] != -1).any() and (got[1] == -1).all()
    assert batch.matchers["a"] is not None and "gone" not in batch.rows
    again = batch.fill_bitmask(["b", "plain", "a"], torch.device("cpu"))
    assert torch.equal(again, expected)  # nothing applied a second time


def test_the_engine_thread_makes_no_xgrammar_call_a_step(tiny_llm, monkeypatch):
    """Every xgrammar call releases the GIL and takes it back (tvm-ffi), so the runner's thread
    leaves them to the worker: per step it queues tokens and starts the fill. Counted on the
    engine's thread over a run of grammar rows: matchers made and replayed when a request is
    added, nothing per step (it made two is_terminated a row a step, and a batched accept whose
    wrapper reads its result back one call an element). Ended grammars are still known: a
    grammar that ends early leaves its row free and the others constrained."""
    import threading

    import xgrammar as xgr

    main = threading.get_ident()
    calls: dict[str, int] = {}
    for cls, name in (
        (xgr.GrammarMatcher, "is_terminated"),
        (xgr.GrammarMatcher, "accept_token"),
        (xgr.GrammarMatcher, "fill_next_token_bitmask"),
        (xgr.BatchGrammarMatcher, "batch_fill_next_token_bitmask"),
    ):
        original = getattr(cls, name)

        def counted(*args, _original=original, _name=name, **kwargs):
            if threading.get_ident() == main:
                calls[_name] = calls.get(_name, 0) + 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(cls, name, counted)
    accept = xgr.BatchGrammarMatcher.batch_accept_token
    monkeypatch.setattr(
        xgr.BatchGrammarMatcher,
        "batch_accept_token",
        staticmethod(lambda *a, **k: calls.__setitem__("batch_accept", 1) or accept(*a, **k)),
    )
    prompts = [f"Q{i}:" for i in range(4)]
    params = [
        _guided(spec={"choice": ["yes", "no"]}, temperature=0, max_tokens=12, ignore_eos=True),
        *(_guided(spec={"json": PERSON}, temperature=1.0, seed=i, max_tokens=40) for i in range(3)),
    ]
    outs = tiny_llm.generate(prompts, params)
    # A new matcher per request (the grammar cache), each asked once whether its replayed
    # output ended it: nothing that grows with the steps.
    assert calls == {"is_terminated": 4}, calls
    # The choice ended after its first tokens and EOS; with EOS ignored the row ran on free.
    choice = outs[0].outputs[0]
    eos = tiny_llm.get_tokenizer().eos_token_id
    assert len(choice.token_ids) == 12 and eos in choice.token_ids, choice.token_ids
    assert choice.text.startswith(("yes", "no"))
    after = choice.token_ids[choice.token_ids.index(eos) + 1 :]
    assert after and any(t != eos for t in after), choice.token_ids  # not held to EOS
    for out in outs[1:]:
        c = out.outputs[0]
        assert c.text.startswith('{"name": "'), c.text
        if c.finish_reason == "stop":
            jsonschema.validate(json.loads(c.text), PERSON)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_grammar_rows_beside_speculating_rows(tiny_path, tiny_llm, async_scheduling):
    """With n-gram drafts on, grammar requests get none: their outputs are those of the plain
    engine and validate, and the speculating plain rows beside them are unchanged (also with
    async scheduling: a step's outputs made while the next step runs)."""
    from kiln import LLM

    spec_llm = LLM(
        tiny_path,
        max_num_seqs=16,
        kv_cache_memory_gb=0.05,
        max_model_len=512,
        speculative_config={"method": "ngram", "num_speculative_tokens": 3},
        async_scheduling=async_scheduling,
    )
    prompts = ["ab ab ab ab ab ab", "Person:", "cd cd cd cd cd", "Row:"]
    params = [
        SamplingParams(temperature=0, max_tokens=24),
        _guided(spec={"json": PERSON}, temperature=0, max_tokens=200),
        SamplingParams(temperature=0, max_tokens=24),
        _guided(spec={"regex": "[a-z]{3,9}"}, temperature=1.0, seed=4, max_tokens=20),
    ]
    want = tiny_llm.generate(prompts, params)
    got = spec_llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert got[1].outputs[0].num_draft_tokens == 0 and got[3].outputs[0].num_draft_tokens == 0
    assert sum(o.outputs[0].num_draft_tokens for o in (got[0], got[2])) > 0
    if got[1].outputs[0].finish_reason == "stop":
        jsonschema.validate(json.loads(got[1].outputs[0].text), PERSON)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_deferred_mask_on_gpu_matches_synchronous(tiny_path):
    """On CUDA: pinned mask buffers reused every other step, asynchronous copies, CUDA graphs,
    two steps in flight. The same tokens as the synchronous engine, mixed with plain rows, and
    every finished JSON reply validates."""
    from kiln import LLM

    args = dict(device="cuda", max_num_seqs=16, kv_cache_memory_gb=0.05, max_model_len=512)
    prompts = [f"Row {i}:" for i in range(12)]
    params = [
        _guided(spec={"json": PERSON}, temperature=1.0, seed=i, max_tokens=200)
        if i % 3
        else SamplingParams(temperature=1.0, seed=i, max_tokens=40)
        for i in range(12)
    ]
    want = LLM(tiny_path, async_scheduling=False, **args).generate(prompts, params)
    got = LLM(tiny_path, async_scheduling=True, **args).generate(prompts, params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    for i, out in enumerate(got):
        if i % 3 and out.outputs[0].finish_reason == "stop":
            jsonschema.validate(json.loads(out.outputs[0].text), PERSON)


def test_smollm2_json_schema(smollm2_llm):
    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 20},
            "landmarks": {"type": "array", "items": {"type": "string"}, "maxItems": 2},
        },
        "required": ["city", "landmarks"],
    }
    tok = smollm2_llm.get_tokenizer()
    chat = [{"role": "user", "content": "Describe Paris as JSON."}]
    prompt = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    out = smollm2_llm.generate(
        [prompt, prompt],
        [
            _guided(spec={"json": schema}, temperature=0, max_tokens=60),
            SamplingParams(temperature=0, max_tokens=8),
        ],
    )
    c = out[0].outputs[0]
    assert c.finish_reason == "stop", c.text
    value = json.loads(c.text)
    jsonschema.validate(value, schema)
    assert "paris" in value["city"].lower()
    alone = smollm2_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8))
    assert out[1].outputs[0].token_ids == alone[0].outputs[0].token_ids


def test_beam_search_beside_grammar_rows(tiny_llm, monkeypatch):
    """Beam rows in steps whose sampler waits for a grammar mask (the runner's deferred sample)
    still bring back their search's candidates: the same beams and scores as the search alone."""
    beam = SamplingParams(use_beam_search=True, best_of=4, n=2, max_tokens=12)
    alone = tiny_llm.generate(["Beams:"], beam)[0]
    engine = tiny_llm.engine
    steps, submit = [], engine.executor.submit

    def recording(step):
        steps.append(step)
        return submit(step)

    monkeypatch.setattr(engine.executor, "submit", recording)
    grammar = _guided(spec={"json": PERSON}, temperature=0, max_tokens=200)
    got = tiny_llm.generate(["Beams:", "Person:"], [beam, grammar])[0]
    assert [c.token_ids for c in got.outputs] == [c.token_ids for c in alone.outputs]
    assert [c.cumulative_logprob for c in got.outputs] == pytest.approx(
        [c.cumulative_logprob for c in alone.outputs], abs=1e-4
    )
    assert any(s.beam_rows and len(s.num_scheduled_tokens) > len(s.beam_rows) for s in steps)
    assert engine.kv_cache.usage == 0.0


# ---- grammars compile off the engine loop --------------------------------------------------


# The compile waitlist under both schedules: async scheduling is the GPU's default (a step's
# tokens come back with the next step), and the CPU runs it too.
BOTH_SCHEDULES = pytest.mark.parametrize("llm_name", ["tiny_llm", "async_llm"])


@pytest.fixture
def held_compile(monkeypatch):
    """Every compile waits for the returned event (set it to let them finish)."""
    import threading

    from kiln.structured_output.compiler import GrammarCompilerCache

    release = threading.Event()
    real = GrammarCompilerCache._compile

    def slow(self, kind, text):
        assert release.wait(60), "the test never released the compile"
        return real(self, kind, text)

    monkeypatch.setattr(GrammarCompilerCache, "_compile", slow)
    yield release
    release.set()


@BOTH_SCHEDULES
def test_a_compiling_grammar_does_not_hold_back_plain_requests(llm_name, request, held_compile):
    llm = request.getfixturevalue(llm_name)
    engine = llm.engine
    spec = GuidedDecodingParams(regex=r"[0-9]{3}-held")  # a spec no other test compiles
    greedy = SamplingParams(max_tokens=8, temperature=0, guided_decoding=spec)
    engine.add_request("hello", greedy, request_id="g")
    engine.add_request("hello", SamplingParams(max_tokens=5, temperature=0), request_id="p")
    plain_tokens = steps = 0
    # The grammar request arrived first, and is still compiling: one token a step for the plain
    # one, as if the grammar request were not there (plus one step when async scheduling hands a
    # step's tokens back with the next step).
    lag = engine.max_steps_in_flight - 1
    while plain_tokens < 5 and steps < 5 + lag:
        for delta in engine.step():
            assert delta.request_id == "p"
            plain_tokens += len(delta.outputs[0].token_ids)
        steps += 1
    assert plain_tokens == 5 and steps == 5 + lag
    assert "g" in engine.hook(GrammarCompiles).waitlist and engine.finished_output("p") is not None
    held_compile.set()
    while engine.has_unfinished_requests():
        engine.step()
    text = engine.finished_output("g").outputs[0].text
    assert re.fullmatch(r"[0-9]{3}-held", text), text
    # Same output as when the grammar was cached before the request came (greedy).
    again = llm.generate(["hello"], greedy)
    assert again[0].outputs[0].text == text


@BOTH_SCHEDULES
def test_abort_while_compiling_frees_the_request(llm_name, request, held_compile):
    llm = request.getfixturevalue(llm_name)
    engine = llm.engine
    spec = GuidedDecodingParams(regex=r"[a-z]{2}-aborted")
    engine.add_request("hi", SamplingParams(max_tokens=8, guided_decoding=spec), request_id="a")
    [final] = engine.abort_request("a")
    assert final.outputs[0].finish_reason == "abort"
    assert not engine.has_unfinished_requests() and engine.kv_cache_usage == 0
    held_compile.set()
    # Room for the whole match (10 characters, one token each at worst) and its end of text.
    again = SamplingParams(max_tokens=16, temperature=0, guided_decoding=spec)
    out = llm.generate(["hi"], again)
    assert re.fullmatch(r"[a-z]{2}-aborted", out[0].outputs[0].text)


@BOTH_SCHEDULES
def test_a_compile_that_fails_after_validation_ends_that_request_only(
    llm_name, request, monkeypatch
):
    llm = request.getfixturevalue(llm_name)
    from kiln.structured_output.compiler import GrammarCompilerCache

    def fail(self, kind, text):
        raise InvalidRequestError("invalid regex: the compiler gave up", param="guided_regex")

    monkeypatch.setattr(GrammarCompilerCache, "_compile", fail)
    bad = SamplingParams(max_tokens=4, guided_decoding=GuidedDecodingParams(regex="x+failed"))
    out = llm.generate(["a", "b"], [bad, SamplingParams(max_tokens=4)])
    assert out[0].outputs[0].finish_reason == "error" and not out[0].outputs[0].token_ids
    assert "the compiler gave up" in out[0].outputs[0].error
    assert out[1].outputs[0].finish_reason == "length" and len(out[1].outputs[0].token_ids) == 4
    assert not llm.engine.has_unfinished_requests()


def test_validation_parses_without_compiling(tiny_llm, monkeypatch):
    from kiln.structured_output import compiler_for
    from kiln.structured_output.compiler import GrammarCompilerCache

    engine = tiny_llm.engine
    compiler = compiler_for(engine.tokenizer, engine.model_config.vocab_size, engine.eos_token_ids)
    monkeypatch.setattr(GrammarCompilerCache, "_compile", lambda *a: pytest.fail("compiled"))
    compiler.validate(GuidedDecodingParams(json={"type": "object", "required": ["zz"]}))
    with pytest.raises(InvalidRequestError, match="JSON schema") as info:
        compiler.validate(GuidedDecodingParams(json={"type": "strin"}))
    assert info.value.param == "response_format"


@BOTH_SCHEDULES
def test_a_compile_that_failed_before_its_request_was_queued_is_not_scheduled(
    llm_name, request, monkeypatch
):
    """The race the background compile opens: its future can be done, failed, by the time the
    engine looks at it. Such a request must end with the error, not reach the runner (whose
    own compile would raise inside the step and kill the engine loop)."""
    from concurrent.futures import Future

    llm = request.getfixturevalue(llm_name)
    from kiln.structured_output.compiler import GrammarCompilerCache

    def failed_at_once(self, spec):
        done = Future()
        done.set_exception(InvalidRequestError("invalid regex: gave up at once"))
        return done

    monkeypatch.setattr(GrammarCompilerCache, "compile_async", failed_at_once)
    bad = SamplingParams(max_tokens=4, guided_decoding=GuidedDecodingParams(regex="x+at-once"))
    out = llm.generate(["a", "b"], [bad, SamplingParams(max_tokens=4)])
    assert out[0].outputs[0].finish_reason == "error"
    assert "gave up at once" in out[0].outputs[0].error
    assert out[1].outputs[0].finish_reason == "length" and len(out[1].outputs[0].token_ids) == 4
    assert not llm.engine.has_unfinished_requests()
