"""Tensor parallelism over the quantized linear methods (INT4 W4A16, block FP8, W8A16 and
W8A8 INT8) on the CPU: the tools' tiny checkpoints (tests/data/int4_checkpoints,
eight_bit_checkpoints) and 16-bit weights rounded as they load.

Without processes: each rank's codes, scales and zeros are its cut of the one-process model's
(column-parallel: output rows; row-parallel: input columns with their groups' or blocks' scale
columns), so the ranks' partial products sum to one process's and their rows stack to it; a cut
that would split an INT4 group or a 128-block, or act-order INT4 under a row-parallel cut, is
refused by name. With 2 gloo processes: greedy tokens equal one process's.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kiln import LLM, SamplingParams
from kiln.config import EngineConfig
from kiln.distributed.parallel_state import ParallelContext, RankLayout
from kiln.errors import ModelLoadError
from kiln.kernels import reference
from kiln.runtime.model_loader import load_model
from tests.distributed.test_parallel import COMMON, PROMPTS, _save_tiny

DATA = Path(__file__).parents[1] / "data"
# name -> (checkpoint directory, the method every projection should have)
CHECKPOINTS = {
    "int4-awq-g64": ("int4_checkpoints/awq", "Int4LinearMethod"),
    "int4-gptq-channel": ("int4_checkpoints/gptq_channel", "Int4LinearMethod"),
    "int4-ct-channel": ("int4_checkpoints/ct_channel", "Int4LinearMethod"),
    "fp8-block": ("eight_bit_checkpoints/ct_fp8_block", "Fp8BlockLinearMethod"),
    "fp8-block-release": ("eight_bit_checkpoints/fp8_block_hf", "Fp8BlockLinearMethod"),
    "int8-w8a16-g128": ("eight_bit_checkpoints/ct_w8a16_int8", "W8A16LinearMethod"),
    "fp8-w8a16-channel": ("eight_bit_checkpoints/ct_w8a16_fp8", "W8A16LinearMethod"),
    "int8-w8a8": ("eight_bit_checkpoints/ct_w8a8_int8", "Int8LinearMethod"),
}
GREEDY = SamplingParams(temperature=0, max_tokens=12, logprobs=2, ignore_eos=True)


def _load(path: str, tp: int = 1, rank: int = 0, **engine: object):
    config = EngineConfig(model=path, dtype="float32", **engine)
    ctx = None if tp == 1 else ParallelContext(RankLayout(tp, 1, rank), None, None, None)
    return load_model(config, torch.device("cpu"), torch.float32, ctx).model


def _projections(model, i: int = 0) -> dict:
    layer = model.layers[i]
    return {"qkv": layer.self_attn.qkv_proj, "o": layer.self_attn.o_proj,
            "gate_up": layer.mlp.gate_up_proj, "down": layer.mlp.down_proj}  # fmt: skip


def _assert_ranks_compute_one_process(path: str, method: str, exact: bool, **engine):
    """Row-parallel o / down: the ranks' partial products over their input columns sum to one
    process's product; column-parallel gate_up: each rank's gate and up rows are its slice of
    one process's. `exact`: the weights dequantize to the same values (not INT8's activations,
    which each rank scales over its own columns)."""
    one = _projections(_load(path, **engine))
    ranks = [_projections(_load(path, 2, r, **engine)) for r in range(2)]
    gen = torch.Generator().manual_seed(0)
    for name in ("o", "down"):
        full, parts = one[name], [r[name] for r in ranks]
        assert type(full.method).__name__ == method
        x = torch.randn(5, full.in_features, generator=gen)
        want = full.method.apply(full, reference, x)
        n = parts[0].in_features
        got = sum(
            p.method.apply(p, reference, x[:, r * n : (r + 1) * n]) for r, p in enumerate(parts)
        )
        if exact:
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        else:  # per-token int8 scales of each rank's half: close, not equal
            assert (got - want).abs().max() < 0.02 * want.abs().max()
    full, parts = one["gate_up"], [r["gate_up"] for r in ranks]
    x = torch.randn(5, full.in_features, generator=gen)
    want = full.method.apply(full, reference, x)
    got = [p.method.apply(p, reference, x) for p in parts]
    h = got[0].shape[1] // 2
    stacked = torch.cat([g[:, :h] for g in got] + [g[:, h:] for g in got], dim=1)
    assert torch.equal(stacked, want)
    full = one["qkv"]  # q, k and v rows cut where no 128-block ends (k, v: 64 of 128 rows)
    x = torch.randn(5, full.in_features, generator=gen)
    want = full.method.apply(full, reference, x).split(full.output_sizes, dim=1)
    for r in ranks:
        part = r["qkv"]
        got = part.method.apply(part, reference, x).split(part.output_sizes, dim=1)
        for g, w, (start, length) in zip(got, want, part.split.rows):
            assert torch.equal(g, w[:, start : start + length])
    return one, ranks


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_a_checkpoints_ranks_compute_one_processs_products(name) -> None:
    folder, method = CHECKPOINTS[name]
    _assert_ranks_compute_one_process(str(DATA / folder), method, exact=name != "int8-w8a8")


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_an_engines_whole_tensors_cut_as_the_checkpoints(name) -> None:
    """An engine directory holds the one-process model's tensors as they are (packed INT4
    words, per-row block scales, group scale columns): loaded under TP (load_fused_weights, as
    `kiln build -tp N` cuts too) each rank gets what it reads from the checkpoint itself."""
    path = str(DATA / CHECKPOINTS[name][0])
    whole = dict(_load(path).named_parameters())
    for rank in range(2):
        part = _load(path, 2, rank)
        want = {k: v.detach().clone() for k, v in part.named_parameters()}
        with torch.no_grad():
            for param in part.parameters():  # nothing of the checkpoint's load left behind
                param.view(torch.uint8).zero_()
        part.load_fused_weights(whole.items())
        for key, param in part.named_parameters():
            assert torch.equal(param.view(torch.uint8), want[key].view(torch.uint8)), key


@pytest.mark.parametrize(
    ("quantization", "method"),
    [("fp8-block", "Fp8BlockLinearMethod"), ("int8-w8a16-channel", "W8A16LinearMethod"),
     ("int8-w8a16-g128", "W8A16LinearMethod"), ("int8-w8a8", "Int8LinearMethod")],
)  # fmt: skip
def test_16_bit_weights_are_rounded_whole_then_cut(tmp_path, quantization, method) -> None:
    """Rounded as they load: whole rows (a per-channel scale) and whole 128x128 blocks are
    rounded before the cut, so each rank holds one process's codes and scales exactly."""
    path = _save_tiny(str(tmp_path / "m"), "llama-gqa", hidden_size=256, intermediate_size=256,
                      num_attention_heads=4, head_dim=64, num_key_value_heads=2)  # fmt: skip
    one, ranks = _assert_ranks_compute_one_process(
        path, method, exact=quantization != "int8-w8a8", quantization=quantization
    )
    codes = [r["down"].weight.view(torch.uint8) for r in ranks]
    assert torch.equal(torch.cat(codes, dim=1), one["down"].weight.view(torch.uint8))


@pytest.mark.parametrize(
    ("folder", "tp", "message"),
    [
        ("int4_checkpoints/gptq", 2, "split a group of 128 inputs"),  # o_proj: 64 of 128
        ("int4_checkpoints/ct_g128_asym", 2, "split a group of 128 inputs"),
        ("int4_checkpoints/gptq_desc_act", 2, r"act-order \(desc_act\)"),
        ("eight_bit_checkpoints/ct_fp8_block", 4, "FP8 block-scaled.*split a group of 128"),
        ("eight_bit_checkpoints/ct_w8a16_int8", 4, "W8A16 weights.*split a group of 128"),
    ],
)
def test_a_cut_inside_a_group_or_block_is_refused(folder, tp, message) -> None:
    with pytest.raises(ModelLoadError, match=message):
        _load(str(DATA / folder), tp, 0)


# ---- two processes ---------------------------------------------------------------------------


def _int8_per_rank_share(llm: LLM, tp: int = 2) -> None:
    """One process's W8A8 INT8 model computing what `tp` ranks compute: its row-parallel
    projections (o_proj, down_proj) quantize each rank's share of a token's inputs per token
    on its own, and sum the shares' products (a rank's share is scaled by its own absmax)."""
    model = llm.engine.executor.runner.model

    def per_share(proj):
        def apply(layer, ops, x: torch.Tensor) -> torch.Tensor:
            rows = x.reshape(-1, x.shape[-1])
            y = 0
            for part, w in zip(rows.chunk(tp, dim=1), proj.weight.chunk(tp, dim=1)):
                codes, scale = ops.quantize_int8(part)
                y = y + ops.int8_matmul(codes, scale, w, proj.weight_scale, None, x.dtype)
            return y.reshape(*x.shape[:-1], -1)

        return apply

    for layer in model.layers:
        for proj in (layer.self_attn.o_proj, layer.mlp.down_proj):
            assert proj.bias is None
            proj.method.apply = per_share(proj)
            proj.method.int8_input = lambda layer: False


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_tp2_greedy_tokens_equal_one_process(name) -> None:
    """W8A8 INT8: each rank scales its share of a row-parallel input itself (no collective for
    a scale; vLLM's choice too), so its one process quantizes each share alone the same way."""
    path = str(DATA / CHECKPOINTS[name][0])
    one = LLM(path, **COMMON)
    if name == "int8-w8a8":
        plain = LLM(path, **COMMON).generate(PROMPTS, GREEDY)
        _int8_per_rank_share(one)
    want = one.generate(PROMPTS, GREEDY)
    llm = LLM(path, tensor_parallel_size=2, **COMMON)
    try:
        got = llm.generate(PROMPTS, GREEDY)
    finally:
        llm.shutdown()
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    for a, b in zip(got, want):
        for pa, pb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert pa.keys() == pb.keys()
            assert all(abs(pa[t].logprob - pb[t].logprob) < 1e-4 for t in pa)
    if name == "int8-w8a8":  # the shares' own scales are a rounding of their own
        assert [o.outputs[0].token_ids for o in plain] != [o.outputs[0].token_ids for o in want]
