"""The offline API on the embedded model: parameters, errors, n > 1, seeds, stop strings,
logprobs, aborts, the CLI."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kiln import LLM, InvalidRequestError, ModelLoadError, SamplingParams


@pytest.mark.parametrize(
    "kwargs, param",
    [
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"n": 0}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_p": 2.0}, "min_p"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ({"stop": [""]}, "stop"),
    ],
)
def test_invalid_sampling_params_name_the_field(kwargs, param):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**kwargs)
    assert info.value.param == param and param in str(info.value)


def test_empty_and_too_long_prompts(smollm2_llm):
    with pytest.raises(InvalidRequestError, match="empty"):
        smollm2_llm.generate("", SamplingParams())
    with pytest.raises(InvalidRequestError, match="empty"):
        smollm2_llm.generate([[]], SamplingParams())
    too_long = [5] * smollm2_llm.engine.max_model_len
    with pytest.raises(InvalidRequestError) as info:
        smollm2_llm.generate([too_long], SamplingParams())
    assert info.value.code == "context_length_exceeded"
    with pytest.raises(InvalidRequestError, match="vocabulary"):
        smollm2_llm.generate([[10**9]], SamplingParams())
    with pytest.raises(InvalidRequestError) as info:
        smollm2_llm.generate("Hi", SamplingParams(stop_token_ids=[-5], min_tokens=1))
    assert info.value.param == "stop_token_ids"
    # A bad prompt in a batch queues nothing, and the engine keeps serving.
    with pytest.raises(InvalidRequestError):
        smollm2_llm.generate(["fine", ""], SamplingParams())
    assert not smollm2_llm.engine.has_unfinished_requests()
    assert smollm2_llm.generate("Hello", SamplingParams(max_tokens=2))[0].outputs[0].token_ids


def test_unknown_model_path():
    with pytest.raises(ModelLoadError, match="not found"):
        LLM("/no/such/model/dir")
    with pytest.raises(ModelLoadError, match="GGUF file not found"):
        LLM("/no/such/file.gguf")


def test_max_tokens_and_context_cap(smollm2_llm):
    out = smollm2_llm.generate("Count: 1, 2, 3,", SamplingParams(max_tokens=7, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 7 and out[0].outputs[0].finish_reason == "length"


def test_n_completions_and_seeds(smollm2_llm):
    params = SamplingParams(n=3, temperature=1.0, seed=1234, max_tokens=12, ignore_eos=True)
    a = smollm2_llm.generate("Once upon a time", params)[0]
    assert [c.index for c in a.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in a.outputs}) > 1  # distinct completions
    # Same seed, same output, whatever else is in the batch.
    noise = SamplingParams(temperature=1.5, max_tokens=20, ignore_eos=True)
    batch = smollm2_llm.generate(
        ["Other prompt", "Once upon a time", "More noise here"], [noise, params, noise]
    )
    assert [c.token_ids for c in batch[1].outputs] == [c.token_ids for c in a.outputs]


def test_stop_strings_never_leak(smollm2_llm):
    base = SamplingParams(temperature=0, max_tokens=40)
    full = smollm2_llm.generate("The days of the week are Monday,", base)[0].outputs[0].text
    assert "Wednesday" in full
    stopped = smollm2_llm.generate(
        "The days of the week are Monday,",
        SamplingParams(temperature=0, max_tokens=40, stop=["Wed"]),
    )[0].outputs[0]
    assert stopped.text == full[: full.index("Wed")]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == "Wed"
    assert not smollm2_llm.engine.has_unfinished_requests()  # its blocks were released


def test_stop_token_ids_and_min_tokens(smollm2_llm):
    greedy = smollm2_llm.generate("1, 2, 3, 4,", SamplingParams(temperature=0, max_tokens=8))
    ids = greedy[0].outputs[0].token_ids
    stop_id = ids[2]
    out = smollm2_llm.generate(
        "1, 2, 3, 4,", SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[stop_id])
    )[0].outputs[0]
    assert out.token_ids == ids[: ids.index(stop_id) + 1] and out.stop_reason == stop_id
    chat = [{"role": "user", "content": "Say hi."}]
    short = smollm2_llm.chat(chat, SamplingParams(temperature=0, max_tokens=64))[0].outputs[0]
    longer = smollm2_llm.chat(
        chat, SamplingParams(temperature=0, max_tokens=64, min_tokens=len(short.token_ids) + 5)
    )[0].outputs[0]
    assert len(longer.token_ids) >= len(short.token_ids) + 5


def test_logprobs_shape(smollm2_llm):
    out = smollm2_llm.generate(
        "Hello", SamplingParams(temperature=0, max_tokens=4, logprobs=3, prompt_logprobs=1)
    )[0]
    for token_id, position in zip(out.outputs[0].token_ids, out.outputs[0].logprobs):
        assert token_id in position and position[token_id].rank == 1  # greedy: the top token
        assert 3 <= len(position) <= 4
        assert all(lp.logprob <= 0 and lp.decoded_token is not None for lp in position.values())
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(out.prompt_token_ids)


def test_penalties_change_output(smollm2_llm):
    prompt = "Repeat after me: la la la la la la"
    plain = smollm2_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=16))
    penal = smollm2_llm.generate(
        prompt, SamplingParams(temperature=0, max_tokens=16, repetition_penalty=1.8)
    )
    assert plain[0].outputs[0].token_ids != penal[0].outputs[0].token_ids


def test_abort_frees_blocks(smollm2_llm):
    engine = smollm2_llm.engine
    req_id = engine.add_request("A long story begins", SamplingParams(max_tokens=200))
    engine.step()
    assert engine.kv_cache_usage > 0
    final = engine.abort_request(req_id)
    assert final[0].outputs[0].finish_reason == "abort"
    assert engine.kv_cache_usage == 0 and not engine.has_unfinished_requests()


def test_stream_stops_early_and_frees(smollm2_llm):
    stream = smollm2_llm.stream("Tell me a story", SamplingParams(max_tokens=100))
    next(stream)
    stream.close()
    assert smollm2_llm.engine.kv_cache_usage == 0


def test_stream_takes_every_prompt_form(smollm2_llm):
    params = SamplingParams(temperature=0, max_tokens=4)
    ids = smollm2_llm.get_tokenizer().encode("Hello", add_special_tokens=True)
    texts = [
        "".join(smollm2_llm.stream(prompt, params))
        for prompt in ("Hello", ids, {"prompt": "Hello"}, {"prompt_token_ids": ids})
    ]
    assert texts[0] and len(set(texts)) == 1


def test_cli_generate_prompts_file(tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("What is 2+2?\nName a colour.\n")
    out = tmp_path / "out.jsonl"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "kiln.cli.main",
            "generate",
            "--prompts-file",
            str(prompts),
            "--max-tokens",
            "8",
            "-o",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["prompt"] for r in records] == ["What is 2+2?", "Name a colour."]
    assert all(r["outputs"][0]["token_ids"] for r in records)


def test_cli_reports_bad_input_clearly():
    result = subprocess.run(
        [sys.executable, "-m", "kiln.cli.main", "generate", "hi", "--temperature", "-1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2 and "temperature" in result.stderr


@pytest.fixture(scope="module")
def tiny_chat_path(tmp_path_factory) -> str:
    """A tiny random model with a tokenizer: the engine-wiring tests below need an engine, not
    SmolLM2's weights (each SmolLM2 load is seconds)."""
    from tests.tiny_tokenizer import build_tiny_chat_model

    return build_tiny_chat_model(str(tmp_path_factory.mktemp("tiny-chat")))


def test_async_scheduling_defaults_off_on_the_cpu_and_can_be_forced(tiny_chat_path):
    """On the CPU a step computes while it is submitted: overlapping would only hold each step's
    tokens back one step. Forced on, it runs the same path the GPU uses."""
    from kiln import LLM

    assert LLM(tiny_chat_path, kv_cache_memory_gb=0.05).engine.async_scheduling is False
    forced = LLM(tiny_chat_path, kv_cache_memory_gb=0.05, async_scheduling=True)
    assert forced.engine.async_scheduling is True
    engine = forced.engine
    engine.add_request("Hello", SamplingParams(temperature=0, max_tokens=3))
    assert engine.step() == []  # launched; its token comes out of the next call
    assert engine.has_unfinished_requests()
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert outputs[-1].finished and len(outputs) == 3


def test_engine_raises_the_gc_gen0_threshold(tiny_chat_path):
    """Python's default (700) gives hundreds of running requests a full collection every ~30
    steps, each walking every live token list; the engine raises gen 0's threshold at startup
    (process-wide, like its gc.freeze), and 0 leaves Python's setting alone."""
    import gc

    from kiln import LLM

    saved = gc.get_threshold()
    try:
        gc.set_threshold(700, *saved[1:])
        LLM(tiny_chat_path, kv_cache_memory_gb=0.05, gc_gen0_threshold=0)
        assert gc.get_threshold() == (700, *saved[1:])
        LLM(tiny_chat_path, kv_cache_memory_gb=0.05)
        assert gc.get_threshold() == (20_000, *saved[1:])
    finally:
        gc.set_threshold(*saved)


def test_dropped_llm_frees_its_engine(tmp_path, thawed_heap):
    # Startup freezes the engine's objects out of the cyclic GC; without the thaw on drop every
    # LLM made in a process stayed in memory (the suite grew by 0.6 GB an engine).
    import gc
    import weakref

    from tests.conftest import build_tiny_hf_model

    build_tiny_hf_model("llama-gqa", str(tmp_path))
    llm = LLM(str(tmp_path), kv_cache_memory_gb=0.01)
    assert gc.get_freeze_count() > 0  # startup froze the heap, the engine's objects with it
    engine = weakref.ref(llm.engine)
    del llm
    assert gc.get_freeze_count() == 0  # the drop thawed it
    gc.collect()
    assert engine() is None


def test_an_engine_keeps_a_frozen_heap_frozen(tmp_path):
    """In a process that froze its heap (this session does, after collecting the tests) an
    engine neither freezes its objects on top at startup nor thaws the heap at shutdown;
    dropped, it is collected all the same. (Frozen objects that lose their last reference are
    still freed, so the count can only drop.)"""
    import gc
    import weakref

    from tests.conftest import build_tiny_hf_model

    build_tiny_hf_model("llama-gqa", str(tmp_path))
    frozen = gc.get_freeze_count()
    assert frozen > 0
    llm = LLM(str(tmp_path), kv_cache_memory_gb=0.01)
    assert gc.get_freeze_count() <= frozen  # the engine's objects were not frozen on top
    engine = weakref.ref(llm.engine)
    del llm
    assert gc.get_freeze_count() > frozen // 2  # not thawed
    gc.collect()
    assert engine() is None
