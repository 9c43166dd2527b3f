"""Tensor and pipeline parallelism (kiln/distributed, kiln/executor/multiproc.py) on the CPU:
gloo, several processes on this machine.

Greedy tokens equal one process's in fp32 (logprobs close) for TP=2, PP=2 and TP=2 x PP=2, on
tiny random Llama, Qwen2 (q/k/v biases) and Mistral models with KV heads that divide the tensor
ranks and with fewer KV heads than ranks; batched, chunked and preempted requests equal each
request alone; two torchrun "nodes" on localhost; a killed rank ends the engine, named, with no
process left. Without processes: the layout arithmetic, the step message round trip, and each
rank's weights (unquantized and FP8) being exactly its cut of the one-process model's.

One multi-rank engine per configuration, module-scoped: each start costs a few seconds of
imports per process on a 2-core host.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from kiln import LLM, SamplingParams
from kiln.config import EngineConfig
from kiln.distributed.parallel_state import (
    ParallelContext,
    RankLayout,
    kv_head_range,
    split_layers,
)
from kiln.errors import ModelLoadError
from kiln.executor.messages import decode_step, encode_step
from kiln.interfaces import CachedRequestData, NewRequestData, SchedulerOutput
from kiln.runtime.model_loader import load_model
from tests.conftest import TINY_BASE, TINY_VARIANTS

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROMPTS = [
    [1, 5, 9, 13, 40],
    [1, 7, 8, 100, 200, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18],  # chunked
    [1, 30, 31, 32],
]
GREEDY = SamplingParams(temperature=0, max_tokens=8, logprobs=2)
# KILN_PARALLEL_TEST_DEVICE=cuda: the same on GPUs (NCCL; benchmarks/run_suite.sh
# tests_parallel), less the two tests that need the CPU (below).
DEVICE = os.environ.get("KILN_PARALLEL_TEST_DEVICE", "cpu")
COMMON = dict(dtype="float32", num_threads=1, distributed_timeout_s=60, device=DEVICE)
cpu_only = pytest.mark.skipif(
    DEVICE != "cpu",
    reason="a killed NCCL rank hangs its peers until the watchdog ends the process (pytest); "
    "torchrun's two local 'nodes' would share GPU 0",
)


def _save_tiny(path: str, variant: str, **overrides: object) -> str:
    import transformers

    cfg = {**TINY_BASE, **TINY_VARIANTS[variant], **overrides}
    model_type = cfg.pop("model_type")
    config = transformers.AutoConfig.for_model(model_type, **cfg)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("parallel")
    return {
        # 4 query heads, 2 KV heads: both divide TP=2.
        "llama": _save_tiny(str(root / "llama"), "llama-gqa", num_hidden_layers=3),
        # 1 KV head: replicated on both tensor ranks; q/k/v biases.
        "qwen2": _save_tiny(str(root / "qwen2"), "qwen2-bias", num_key_value_heads=1),
        # 1 KV head, tied embeddings: the vocab-cut embedding is also the LM head.
        "mistral": _save_tiny(
            str(root / "mistral"), "mistral", num_key_value_heads=1, tie_word_embeddings=True
        ),
    }


def _tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def _assert_same(got, want) -> None:
    assert _tokens(got) == _tokens(want)
    for a, b in zip(got, want):
        for pa, pb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert pa.keys() == pb.keys()
            assert all(abs(pa[t].logprob - pb[t].logprob) < 1e-4 for t in pa)


def _reference(path: str, **engine) -> list:
    llm = LLM(path, **COMMON, **engine)
    return llm.generate(PROMPTS, GREEDY)


def _parallel_engine(path: str, tp: int, pp: int, **engine):  # a fixture's body
    engine = {**COMMON, **engine}
    llm = LLM(path, tensor_parallel_size=tp, pipeline_parallel_size=pp, **engine)
    yield llm
    llm.shutdown()


# ---- without processes -----------------------------------------------------------------------


def test_layout_puts_the_sampling_driver_on_the_last_stage() -> None:
    grid = [RankLayout(2, 2, r) for r in range(4)]
    assert [(g.tp_rank, g.pp_rank) for g in grid] == [(0, 1), (1, 1), (0, 0), (1, 0)]
    assert [g.samples for g in grid] == [True, False, False, False]
    assert grid[2].global_rank(1, 1) == 1 and grid[0].tp_group_ranks(0) == [2, 3]
    assert [split_layers(7, 3, s) for s in range(3)] == [range(0, 3), range(3, 5), range(5, 7)]
    with pytest.raises(ValueError, match="2 layers"):
        split_layers(2, 3, 0)
    assert [kv_head_range(2, 4, r) for r in range(4)] == [(0, 1), (0, 1), (1, 1), (1, 1)]
    assert [kv_head_range(4, 2, r) for r in range(2)] == [(0, 2), (2, 2)]
    with pytest.raises(ValueError, match="evenly"):
        kv_head_range(2, 3, 0)


def test_step_message_round_trips_as_json() -> None:
    params = SamplingParams(temperature=0.7, top_k=5, stop=["x"], seed=3, logprobs=1)
    step = SchedulerOutput(
        new_requests=[NewRequestData("a", [1, 2, 3], [4], params, [0, 1], 2)],
        cached_requests=[CachedRequestData("b", [7], 9)],
        num_scheduled_tokens={"a": 2, "b": 1},
        total_num_scheduled_tokens=3,
        finished_req_ids=frozenset({"c"}),
        num_preempted=1,
        step_id=12,
        block_copies=[(3, 5), (3, 6)],
    )
    data = encode_step(step)
    assert data.startswith(b"{")  # JSON, never pickle
    assert decode_step(data) == step


def _rank_models(path: str, tp: int, quantization: str = "none", **engine: object):
    config = EngineConfig(model=path, dtype="float32", quantization=quantization, **engine)
    one = load_model(config, torch.device("cpu"), torch.float32).model
    ranks = [
        load_model(
            config,
            torch.device("cpu"),
            torch.float32,
            ParallelContext(RankLayout(tp, 1, r), None, None, None),
        ).model
        for r in range(tp)
    ]
    return one, ranks


@pytest.mark.parametrize("quantization", ["none", "fp8-dynamic", "int8-w8a8"])
def test_each_rank_holds_exactly_its_cut_of_the_weights(models, quantization) -> None:
    """Column-parallel q/k/v (KV head replicated) and gate/up keep their rows, with FP8 / INT8
    scales riding along; row-parallel o/down keep their columns and the whole [out] scale
    (quantized from the full rows, so the bytes equal one process's)."""
    one, (r0, r1) = _rank_models(models["qwen2"], 2, quantization)
    as_bits = (lambda t: t.view(torch.uint8)) if quantization != "none" else (lambda t: t)
    full, a, b = one.layers[1].self_attn, r0.layers[1].self_attn, r1.layers[1].self_attn
    q, kv = full.q_size, full.kv_size
    w = as_bits(full.qkv_proj.weight)
    for part, rank in ((a, 0), (b, 1)):
        wq, wk, wv = as_bits(part.qkv_proj.weight).split([q // 2, kv, kv])
        assert torch.equal(wq, w[rank * q // 2 : (rank + 1) * q // 2])
        assert torch.equal(wk, w[q : q + kv]) and torch.equal(wv, w[q + kv :])  # replicated
        assert torch.equal(
            part.qkv_proj.bias[: q // 2], full.qkv_proj.bias[rank * q // 2 :][: q // 2]
        )
    cols = q // 2
    assert torch.equal(as_bits(a.o_proj.weight), as_bits(full.o_proj.weight)[:, :cols])
    assert torch.equal(as_bits(b.o_proj.weight), as_bits(full.o_proj.weight)[:, cols:])
    if quantization != "none":
        assert torch.equal(a.o_proj.weight_scale, full.o_proj.weight_scale)
        n = full.qkv_proj.weight_scale
        assert torch.equal(b.qkv_proj.weight_scale[: q // 2], n[q // 2 : q])
    down = one.layers[0].mlp.down_proj.weight
    halves = (r0.layers[0].mlp.down_proj.weight, r1.layers[0].mlp.down_proj.weight)
    assert torch.equal(torch.cat([as_bits(h) for h in halves], 1), as_bits(down))
    vocab = one.embed_tokens.weight
    assert torch.equal(torch.cat([r0.embed_tokens.weight, r1.embed_tokens.weight]), vocab)
    assert r0.config.num_key_value_heads == 1 and r0.config.num_attention_heads == 2


@pytest.mark.parametrize("tied", [False, True])
def test_a_float8_lm_head_is_cut_by_vocabulary_rows(tmp_path, tied) -> None:
    """A float8 head under TP: each rank holds the one-process head's rows (float8 bytes and
    per-row scales) of its vocabulary part, the last rank's part zero-padded as the embedding's
    (97 rows over 2 ranks: 49 and 48 + 1). Tied: quantized from the rank's embedding rows."""
    path = _save_tiny(str(tmp_path / "m"), "llama-gqa", vocab_size=97, tie_word_embeddings=tied)
    one, ranks = _rank_models(path, 2, lm_head_quantization="fp8")
    heads = [r.lm_head for r in ranks]
    assert [h.weight.shape[0] for h in heads] == [49, 49]
    assert all(h.reduce is None for h in heads)  # column-parallel: gathered, not summed
    weight = torch.cat([h.weight.view(torch.uint8) for h in heads])
    assert torch.equal(weight[:97], one.lm_head.weight.view(torch.uint8))
    assert not weight[97:].any()  # the padding row: zeros, its logit cut off after the gather
    scales = torch.cat([h.weight_scale for h in heads])
    assert torch.equal(scales[:97], one.lm_head.weight_scale)


def test_heads_that_do_not_split_are_refused(models) -> None:
    with pytest.raises(ModelLoadError, match="num_attention_heads=4 does not split"):
        _rank_models(models["llama"], 3)


# ---- several processes -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama_refs(models):
    return _reference(models["llama"])


# Beam search: its copy-on-write forks' block copies travel in the step message to every rank.
BEAM = SamplingParams(use_beam_search=True, best_of=4, n=2, max_tokens=10)
BEAM_PROMPT = [1, *range(40, 58)]  # 19 tokens: the beams fork a partial block


@pytest.fixture(scope="module")
def llama_beam_ref(models):
    return LLM(models["llama"], **COMMON).generate([BEAM_PROMPT], BEAM)[0]


# One parallel engine at a time (torch.distributed has one default group per process): each
# class's engine is class-scoped, so it is shut down before the next class starts its own.


@pytest.fixture(scope="class")
def llama_tp2(models):
    yield from _parallel_engine(models["llama"], 2, 1)


class TestLlamaTP2:
    def test_tp2_equals_one_process(self, llama_tp2, llama_refs) -> None:
        _assert_same(llama_tp2.generate(PROMPTS, GREEDY), llama_refs)

    def test_tp2_beam_search_equals_one_process(self, llama_tp2, llama_beam_ref) -> None:
        got = llama_tp2.generate([BEAM_PROMPT], BEAM)[0].outputs
        assert [c.token_ids for c in got] == [c.token_ids for c in llama_beam_ref.outputs]
        want = [c.cumulative_logprob for c in llama_beam_ref.outputs]
        assert [c.cumulative_logprob for c in got] == pytest.approx(want, abs=1e-4)
        assert llama_tp2.engine.kv_cache.usage == 0.0

    def test_a_second_parallel_engine_in_the_process_is_refused(self, llama_tp2, models) -> None:
        from kiln.executor.multiproc import RankFailedError

        with pytest.raises(RankFailedError, match="already runs in this process"):
            LLM(models["llama"], **COMMON, tensor_parallel_size=2)
        assert llama_tp2.generate(PROMPTS[:1], GREEDY)  # the first one still serves


@pytest.fixture(scope="module")
def tied97(tmp_path_factory) -> str:
    """A tied model whose vocabulary (97) does not split over 2 ranks: the padded float8 head."""
    path = str(tmp_path_factory.mktemp("tied97"))
    return _save_tiny(path, "llama-gqa", vocab_size=97, tie_word_embeddings=True)


PROMPTS_97 = [[t % 97 for t in p] for p in PROMPTS]


@pytest.fixture(scope="module")
def tied97_fp8_head_ref(tied97):
    return LLM(tied97, **COMMON, lm_head_quantization="fp8").generate(PROMPTS_97, GREEDY)


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)])
def test_a_float8_head_in_parallel_equals_one_process(tied97, tied97_fp8_head_ref, tp, pp) -> None:
    # TP: each rank its vocabulary rows (the last zero-padded), the logits gathered; PP: the last
    # stage holds the whole head, quantized from its (whole) embedding.
    llm = LLM(tied97, tensor_parallel_size=tp, pipeline_parallel_size=pp, **COMMON,
              lm_head_quantization="fp8")  # fmt: skip
    try:
        _assert_same(llm.generate(PROMPTS_97, GREEDY), tied97_fp8_head_ref)
    finally:
        llm.shutdown()


@pytest.fixture(scope="class")
def llama_tp2_graphs(models):
    """TP=2 with decode graphs: on the CPU FakeGraph (KILN_CPU_FAKE_GRAPHS, inherited by the
    worker rank), which re-runs the captured forward, all-reduces included; on the GPU stage
    real CUDA graphs with the NCCL all-reduces captured inside."""
    from kiln.envs import envs

    before = os.environ.get("KILN_CPU_FAKE_GRAPHS")
    os.environ["KILN_CPU_FAKE_GRAPHS"] = "1"
    envs.cache_clear()
    try:
        yield from _parallel_engine(models["llama"], 2, 1, max_num_seqs=4)
    finally:
        if before is None:
            os.environ.pop("KILN_CPU_FAKE_GRAPHS")
        else:
            os.environ["KILN_CPU_FAKE_GRAPHS"] = before
        envs.cache_clear()


class TestLlamaTP2DecodeGraphs:
    def test_tp2_decode_graphs_equal_one_process(self, llama_tp2_graphs, llama_refs) -> None:
        """Every rank captured the same (batch size, context) keys in the same order: a rank
        that captured other keys, or none, would leave the others waiting in a capture's
        collectives until the step timeout. The decode steps replay them (3 requests pad to 4)."""
        graphs = llama_tp2_graphs.engine.executor.stats().cuda_graphs
        assert graphs is not None and graphs["batch_sizes"] == [1, 2, 4]
        llama_tp2_graphs.engine.executor.enable_step_timing()
        _assert_same(llama_tp2_graphs.generate(PROMPTS, GREEDY), llama_refs)
        timing = llama_tp2_graphs.engine.executor.runner.step_timing
        assert timing["graph_steps"] > 0 and timing["eager_steps"] > 0  # decodes, prefills


@pytest.fixture(scope="class")
def llama_pp2(models):
    # 3 layers over 2 stages (2 + 1); async scheduling: two micro-batches in flight, of
    # different requests (16-token steps split the prompts between them); a 32-token KV cache:
    # requests are preempted, some with a token in flight.
    yield from _parallel_engine(
        models["llama"],
        1,
        2,
        async_scheduling=True,
        max_num_batched_tokens=16,
        num_kv_blocks=8,
        block_size=4,
    )


class TestLlamaPP2:
    def test_pp2_micro_batches_equal_one_process(self, llama_pp2, llama_refs) -> None:
        """Two steps in flight at once (stage 0 may run one while the last stage runs the
        other), never both decoding the same request: its input token is not known before the
        older step's sample. Batched, chunked and preempted, equal to one process."""
        engine = llama_pp2.engine
        assert engine.max_steps_in_flight == engine.scheduler.num_micro_batches == 2
        submit, overlaps = engine.executor.submit, []

        def recording_submit(step):
            decodes = {r for r, n in step.num_scheduled_tokens.items() if n == 1}
            for older in engine._in_flight:
                overlaps.append(decodes & set(older.num_scheduled_tokens))
            return submit(step)

        engine.executor.submit = recording_submit
        try:
            got = llama_pp2.generate(PROMPTS, GREEDY)
        finally:
            engine.executor.submit = submit
        _assert_same(got, llama_refs)
        assert overlaps and not any(overlaps)  # steps overlapped; no request in two of them
        assert engine.scheduler.num_preemptions_total > 0

    def test_pp2_prompt_logprobs_come_from_the_last_stage(self, llama_pp2, models) -> None:
        params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1)
        (got,) = llama_pp2.generate([PROMPTS[1]], params)
        (want,) = LLM(models["llama"], **COMMON).generate([PROMPTS[1]], params)
        assert len(got.prompt_logprobs) == len(want.prompt_logprobs) == len(PROMPTS[1])
        for a, b in zip(got.prompt_logprobs[1:], want.prompt_logprobs[1:]):
            assert a.keys() == b.keys()
            assert all(abs(a[t].logprob - b[t].logprob) < 1e-4 for t in a)


@pytest.fixture(scope="class")
def mistral_tp2_pp2(models):
    # TP=2 x PP=2 (4 processes), 1 KV head over 2 tensor ranks, tied embeddings; a KV
    # cache of 32 tokens and 16-token steps: prompts chunk and requests are preempted.
    yield from _parallel_engine(
        models["mistral"], 2, 2, num_kv_blocks=8, block_size=4, max_num_batched_tokens=16
    )


class TestMistralTP2PP2:
    def test_batched_chunked_preempted_equal_alone_in_one_process(
        self, mistral_tp2_pp2, models
    ) -> None:
        batched = mistral_tp2_pp2.generate(PROMPTS, GREEDY)
        assert mistral_tp2_pp2.engine.scheduler.num_preemptions_total > 0
        ref = LLM(models["mistral"], **COMMON)
        _assert_same(batched, [ref.generate([p], GREEDY)[0] for p in PROMPTS])

    @cpu_only
    def test_a_killed_rank_ends_the_engine_named_with_no_orphan(self, mistral_tp2_pp2) -> None:
        """Last in the class: it takes the engine down. The death is seen in the step's
        collective (gloo: the peer's socket closes) and named; the other ranks are killed (none
        is left blocked in a collective); later steps are refused at once."""
        from kiln.executor.multiproc import RankFailedError

        procs = mistral_tp2_pp2.engine.executor._procs
        assert len(procs) == 3
        os.kill(procs[2].pid, signal.SIGKILL)  # a stage-0 rank
        start = time.monotonic()
        with pytest.raises(RankFailedError, match=r"rank \d \(pid \d+\) exited with code"):
            mistral_tp2_pp2.generate(PROMPTS, GREEDY)
        assert time.monotonic() - start < 30
        assert all(p.poll() is not None for p in procs.values())
        with pytest.raises(RankFailedError):
            mistral_tp2_pp2.generate(PROMPTS[:1], GREEDY)


@pytest.fixture(scope="class")
def qwen2_tp2(models):
    # A short collective timeout: the hang test below waits it out.
    yield from _parallel_engine(models["qwen2"], 2, 1, distributed_timeout_s=6)


class TestQwen2TP2:
    def test_tp2_with_fewer_kv_heads_than_ranks(self, qwen2_tp2, models) -> None:
        _assert_same(qwen2_tp2.generate(PROMPTS, GREEDY), _reference(models["qwen2"]))

    def test_idle_longer_than_the_timeout_is_fine(self, qwen2_tp2) -> None:
        """Workers wait for the next step on an untimed control group: an idle engine (a quiet
        server) outlives distributed_timeout_s."""
        time.sleep(6.5)
        assert qwen2_tp2.generate(PROMPTS[:1], GREEDY)[0].outputs[0].token_ids

    @cpu_only
    def test_a_hung_rank_ends_the_engine_within_the_timeout(self, qwen2_tp2) -> None:
        """Last in the class: a stopped (not dead) rank. The step's collective times out after
        distributed_timeout_s (6 s here: short enough to wait out, long enough for a busy 2-core
        host), the engine stops with the error, the rank is killed."""
        from kiln.executor.multiproc import RankFailedError

        (proc,) = qwen2_tp2.engine.executor._procs.values()
        os.kill(proc.pid, signal.SIGSTOP)
        start = time.monotonic()
        with pytest.raises(RankFailedError, match=r"stopped: a rank failed .*[Tt]imed out"):
            qwen2_tp2.generate(PROMPTS[:1], GREEDY)
        assert time.monotonic() - start < 20
        assert proc.wait(timeout=10) is not None


@cpu_only
def test_two_torchrun_nodes_on_localhost_give_the_same_tokens(models, llama_refs) -> None:
    """The multi-node path: `torchrun --nnodes 2 --node-rank N` with a localhost rendezvous,
    one process a "node", TP=2 across them."""
    with __import__("socket").socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = os.path.join(REPO, "tests", "distributed", "torchrun_generate.py")
    env = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"}
    nodes = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                "2",
                "--node-rank",
                str(n),
                "--nproc-per-node",
                "1",
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                str(port),
                script,
                models["llama"],
                "2",
                "1",
                json.dumps(PROMPTS),
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for n in (0, 1)
    ]
    logs = [node.communicate(timeout=240)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], logs
    (line,) = [x for x in logs[0].splitlines() if x.startswith("TOKENS ")]
    assert json.loads(line.removeprefix("TOKENS ")) == [t[:6] for t in _tokens(llama_refs)]


@pytest.mark.skipif(DEVICE != "cpu", reason="three ranks: the GPU stage has two GPUs")
def test_smollm2_at_tp3_equals_one_process(smollm2_llm, smollm2_path) -> None:
    """The real model: 9 query heads and 3 KV heads over 3 tensor ranks; vocab 49152 cut in 3
    (tied). Kept cheap for every run: the one-process side is the suite's shared engine, two
    prompts, 8 tokens (~8 s of three ranks starting and stepping on a quiet 2-core host)."""
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=1)
    prompts = ["The capital of France is", "def fibonacci(n):"]
    want = smollm2_llm.generate(prompts, params)
    llm = LLM(
        smollm2_path,
        num_threads=1,
        kv_cache_memory_gb=0.25,
        tensor_parallel_size=3,
        distributed_timeout_s=120,
    )
    try:
        _assert_same(llm.generate(prompts, params), want)
    finally:
        llm.shutdown()


def test_kiln_build_tp2_writes_each_rank_its_cut(models, tmp_path) -> None:
    """`kiln build -tp 2`: rank R's shard holds exactly what rank R cuts from the whole model
    (FP8 included, the float8 LM head's vocabulary rows too), each rank reads only its folder,
    and the engine refuses another -tp."""
    from kiln.builder.build import BuildOptions, build_engine
    from kiln.checkpoint.engine_dir import rank_dir_name

    out = str(tmp_path / "engine")
    options = BuildOptions(
        dtype="float32",
        quantization="fp8-dynamic", accuracy_check=False, tensor_parallel_size=2,
        lm_head_quantization="fp8",
    )  # fmt: skip
    manifest = build_engine(models["qwen2"], out, options, None)
    assert manifest.tensor_parallel_size == 2
    assert all(
        n.startswith(("rank-0-of-2/", "rank-1-of-2/")) or "/" not in n for n in manifest.files
    )
    assert os.path.isdir(os.path.join(out, rank_dir_name(1, 2)))
    _, want = _rank_models(models["qwen2"], 2, "fp8-dynamic", lm_head_quantization="fp8")
    for rank in range(2):
        ctx = ParallelContext(RankLayout(2, 1, rank), None, None, None)
        config = EngineConfig(model=out, dtype="float32", tensor_parallel_size=2)
        got = load_model(config, torch.device("cpu"), torch.float32, ctx).model
        expected = dict(want[rank].named_parameters())
        for name, param in got.named_parameters():
            a, b = param.detach(), expected[name].detach()
            if a.dtype == torch.float8_e4m3fn:
                a, b = a.view(torch.uint8), b.view(torch.uint8)
            assert torch.equal(a, b), name
    with pytest.raises(ModelLoadError, match="tensor_parallel_size=2; it cannot load at"):
        load_model(EngineConfig(model=out, dtype="float32"), torch.device("cpu"), torch.float32)
