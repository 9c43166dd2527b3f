"""gpt-oss under tensor and expert parallelism on the CPU, as tests/distributed/test_moe_parallel.py
runs the other MoE families. Tensor-parallel experts: each rank a slice of every expert's width
(gate and up rows alike, the gate_up bias and per-channel float8 scales with them; down's
columns under its whole per-channel scales; the down bias on rank 0 only). Expert parallelism:
each rank 2 of the 4 experts whole, with their biases. Either way the attention heads, their
sinks among them, split over the ranks and o_proj's bias is added once. The tiny checkpoint is
tests/models/test_gpt_oss.py's (sinks, alternating 8-token windows, q/k/v/o and expert biases
away from zero, the clamped SwiGLU, interleaved gate_up).

Without processes: each rank's tensors are its cut of the one-process model's (float8 codes and
scales quantized whole, then cut; `kiln build -tp 2`'s rank shards too), and the ranks' block
outputs sum to the whole block's (the down bias once). With 2 gloo processes: greedy tokens
over 32 new tokens equal HF's in fp32, batched with 16-token steps (the 51-token prompt, past
the window, in 4 chunks) and alone (from the prefix cache); float8 experts (an fp8-dynamic
engine directory whose attention stays fp32) equal the one-process engine's tokens; the MXFP4
checkpoint (float8 at load) HF's dequantized.
A whole-model fp8-dynamic engine is not compared token for token: its row-parallel o_proj
scales each rank's slice of the activations per token on its own (any family's, under TP)."""

from __future__ import annotations

import functools

import pytest
import torch

from kiln import LLM
from kiln.config import EngineConfig
from kiln.distributed.parallel_state import ParallelContext, RankLayout
from kiln.kernels import reference
from kiln.models import moe_blocks
from kiln.runtime.config_plan import weight_bytes
from kiln.runtime.model_loader import load_model
from tests.checkpoint.test_gpt_oss_mxfp4 import save_tiny_mxfp4
from tests.models.family_checks import hf_tokens, tokens
from tests.models.test_qwen3 import GREEDY, PROMPTS

ENGINE = dict(dtype="float32", device="cpu", num_threads=1, distributed_timeout_s=60,
              block_size=16, kv_cache_memory_gb=0.05, max_num_seqs=8,
              max_num_batched_tokens=16)  # fmt: skip
LONG = PROMPTS[2]  # 51 tokens: past the 8-token window, 4 chunks of a 16-token step
MODES = {"tp2": False, "ep2": True}
WIDTH = 32  # each of the 4 experts' intermediate width


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory) -> dict[str, object]:
    """The checkpoints (fp32 and MXFP4), HF's tokens for each, HF's sinks, and an fp8-dynamic
    engine directory with fp32 attention beside its one-process tokens."""
    from transformers import AutoModelForCausalLM, Mxfp4Config

    from kiln.builder.build import BuildOptions, build_engine

    root = tmp_path_factory.mktemp("gpt_oss_parallel")
    source, mxfp4 = save_tiny_mxfp4(root)
    hf = AutoModelForCausalLM.from_pretrained(source, attn_implementation="eager").eval()
    dequantized = AutoModelForCausalLM.from_pretrained(
        mxfp4, quantization_config=Mxfp4Config(dequantize=True), dtype=torch.float32,
        attn_implementation="eager",
    ).eval()  # fmt: skip
    want, want_mxfp4 = hf_tokens(hf, PROMPTS), hf_tokens(dequantized, PROMPTS)
    engine = str(root / "experts_fp8")
    options = BuildOptions(
        dtype="float32", quantization="fp8-dynamic", accuracy_check=False, max_model_len=256,
        unquantized_layers=("layers.*.self_attn.*",),
    )  # fmt: skip
    build_engine(source, engine, options, None)
    one = LLM(engine, **ENGINE)
    return {
        "source": source,
        "mxfp4": mxfp4,
        "engine": engine,
        "want": [want[tuple(p)] for p in PROMPTS],
        "want_mxfp4": [want_mxfp4[tuple(p)] for p in PROMPTS],
        "engine_one_rank": tokens(one.generate(PROMPTS, GREEDY)),
        "sinks": hf.model.layers[0].self_attn.sinks.detach(),
    }


# ---- without processes -----------------------------------------------------------------------


@functools.cache
def _models(path: str, ep: bool, quantization: str):
    config = EngineConfig(model=path, dtype="float32", quantization=quantization)
    one = load_model(config, torch.device("cpu"), torch.float32).model
    ranks = [
        load_model(config, torch.device("cpu"), torch.float32,
                   ParallelContext(RankLayout(2, 1, r), None, None, None, expert_parallel=ep),
                   ).model
        for r in range(2)
    ]  # fmt: skip
    return one, ranks


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def _rows(r: int, ep: bool) -> list[int]:
    """Rank r's rows of an expert's [gate; up] (TP: its half of each)."""
    if ep:
        return list(range(2 * WIDTH))
    half = WIDTH // 2
    return [*range(r * half, (r + 1) * half), *range(WIDTH + r * half, WIDTH + (r + 1) * half)]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("quantization", ["none", "fp8-dynamic"])
def test_each_rank_holds_its_cut_of_the_experts_and_sinks(gpt_oss, mode, quantization) -> None:
    ep = MODES[mode]
    one, ranks = _models(gpt_oss["source"], ep, quantization)
    full = one.layers[1].mlp.experts
    for r, rank in enumerate(ranks):
        part, attn = rank.layers[1].mlp.experts, rank.layers[1].self_attn
        held = slice(2 * r, 2 * r + 2) if ep else slice(0, 4)
        rows, half = _rows(r, ep), WIDTH // 2
        cols = slice(0, WIDTH) if ep else slice(r * half, (r + 1) * half)
        assert torch.equal(_bits(part.w13_weight), _bits(full.w13_weight)[held][:, rows])
        assert torch.equal(_bits(part.w2_weight), _bits(full.w2_weight)[held][:, :, cols])
        assert torch.equal(part.w13_bias, full.w13_bias[held][:, rows])
        if ep or r == 0:  # the down bias: its expert's rank adds it (TP: the first alone)
            assert torch.equal(part.w2_bias, full.w2_bias[held]) and part.w2_bias.abs().min() > 0
        else:
            assert not part.w2_bias.any()
        if quantization != "none":  # per output channel: gate_up's with their rows, down's whole
            assert torch.equal(part.w13_weight_scale, full.w13_weight_scale[held][:, rows])
            assert torch.equal(part.w2_weight_scale, full.w2_weight_scale[held])
        heads = one.layers[1].self_attn.sinks[2 * r : 2 * r + 2]
        assert attn.num_heads == 2 and torch.equal(attn.sinks, heads)
        assert rank.layers[1].self_attn.o_proj.bias.any() == (r == 0)  # row-parallel: once
        assert torch.equal(rank.layers[1].mlp.gate.bias, one.layers[1].mlp.gate.bias)
        # The plan counts the rank's share (less the vocabulary: whole in weight_bytes, cut by
        # rows on each rank whatever the family).
        made = sum(p.numel() * p.element_size() for n, p in rank.named_parameters()
                   if not n.startswith(("embed_tokens.", "lm_head.")))  # fmt: skip
        vocab = 2 * rank.config.vocab_size * rank.config.hidden_size * 4  # untied, fp32
        assert weight_bytes(rank.config, torch.float32, quantization) - vocab == made


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("quantization", ["none", "fp8-dynamic"])
def test_the_ranks_parts_sum_to_the_whole_block(gpt_oss, mode, quantization, monkeypatch) -> None:
    """What the block's all-reduce adds: each rank's experts on the same tokens (a decode
    step's 5 and a prefill's 21: the kernels of both sizes), each chosen expert's down bias
    once, weighted by its routing weight."""
    one, ranks = _models(gpt_oss["source"], MODES[mode], quantization)
    monkeypatch.setattr(moe_blocks, "tp_all_reduce", lambda ctx, t: t)  # no process group
    norm = one.layers[0].post_attention_layernorm
    for tokens_in_step in (5, 21):
        x = torch.randn(tokens_in_step, 64, generator=torch.Generator().manual_seed(0))
        want, _ = one.layers[0].mlp(reference, x, x.flip(0), norm, 1e-5)
        parts = [rank.layers[0].mlp(reference, x, x.flip(0), norm, 1e-5)[0] for rank in ranks]
        torch.testing.assert_close(parts[0] + parts[1], want, atol=1e-5, rtol=1e-5)
        assert not torch.allclose(parts[0], want, atol=1e-3)  # each rank only a part


def test_kiln_build_tp2_writes_each_rank_its_cut(gpt_oss, tmp_path) -> None:
    """`kiln build -tp 2`: each rank's shard holds what that rank cuts when loading the whole
    model (its heads' sinks, its experts' float8 slices), and loads without a cut."""
    from kiln.builder.build import BuildOptions, build_engine

    out = str(tmp_path / "engine")
    options = BuildOptions(dtype="float32", quantization="fp8-dynamic", accuracy_check=False,
                           max_model_len=256, tensor_parallel_size=2)  # fmt: skip
    build_engine(gpt_oss["source"], out, options, None)
    _, want = _models(gpt_oss["source"], False, "fp8-dynamic")
    for r in range(2):
        config = EngineConfig(model=out, dtype="float32", tensor_parallel_size=2)
        ctx = ParallelContext(RankLayout(2, 1, r), None, None, None)
        got = load_model(config, torch.device("cpu"), torch.float32, ctx).model
        assert got.layers[0].self_attn.sinks.shape == (2,)
        for (name, p), q in zip(got.named_parameters(), want[r].parameters()):
            assert torch.equal(_bits(p.detach()), _bits(q.detach())), name


# ---- two processes ---------------------------------------------------------------------------


def _check_rank_zero(llm: LLM, ep: bool, sinks: torch.Tensor | None = None) -> None:
    model = llm.engine.executor.runner.model
    attn, experts = model.layers[0].self_attn, model.layers[0].mlp.experts
    assert attn.num_heads == 2 and attn.sinks is not None
    assert sinks is None or torch.equal(attn.sinks, sinks[:2])  # rank 0's heads' own
    assert experts.w13_weight.shape == ((2, 2 * WIDTH, 64) if ep else (4, WIDTH, 64))


@pytest.mark.parametrize("mode", MODES)
def test_two_ranks_equal_hf(gpt_oss, mode) -> None:
    ep = MODES[mode]
    llm = LLM(gpt_oss["source"], tensor_parallel_size=2, enable_expert_parallel=ep, **ENGINE)
    try:
        _check_rank_zero(llm, ep, gpt_oss["sinks"])
        want = gpt_oss["want"]
        assert tokens(llm.generate(PROMPTS, GREEDY)) == want
        hits = llm.engine.kv_cache.stats.hits
        assert tokens(llm.generate(LONG, GREEDY))[0] == want[2]
        assert llm.engine.kv_cache.stats.hits > hits
    finally:
        llm.shutdown()


@pytest.mark.parametrize("mode", MODES)
def test_float8_experts_equal_one_process(gpt_oss, mode) -> None:
    """The one-process fp8-dynamic engine directory (float8 experts, fp32 attention) at two
    ranks: its stacked experts cut by rows / columns or by expert, its sinks by head. Every
    rank's codes and scales are the one-process model's cut, so only the order of the sums
    differs: the same tokens."""
    ep = MODES[mode]
    llm = LLM(gpt_oss["engine"], tensor_parallel_size=2, enable_expert_parallel=ep, **ENGINE)
    try:
        _check_rank_zero(llm, ep, gpt_oss["sinks"])
        experts = llm.engine.executor.runner.model.layers[0].mlp.experts
        assert experts.w13_weight.dtype == torch.float8_e4m3fn
        assert tokens(llm.generate(PROMPTS, GREEDY)) == gpt_oss["engine_one_rank"]
    finally:
        llm.shutdown()


def test_the_mxfp4_checkpoint_at_two_ranks_equals_hf_dequantized(gpt_oss) -> None:
    """OpenAI's MXFP4 experts converted to float8 per output channel (exactly) on each rank,
    then cut: gate_up's rows with their scales, down's columns under its whole scales."""
    llm = LLM(gpt_oss["mxfp4"], tensor_parallel_size=2, **ENGINE)
    try:
        _check_rank_zero(llm, False)
        experts = llm.engine.executor.runner.model.layers[0].mlp.experts
        assert experts.w13_weight_scale.shape == (4, WIDTH)
        assert tokens(llm.generate(PROMPTS, GREEDY)) == gpt_oss["want_mxfp4"]
    finally:
        llm.shutdown()
