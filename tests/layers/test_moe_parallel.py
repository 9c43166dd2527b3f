"""Mixture-of-experts layers cut over tensor ranks (kiln.layers.moe_parallel), without processes:
each rank's model loaded with its ParallelContext (no process groups), then compared with the
one-process model. Tensor parallel: every expert's gate/up rows and down columns sliced, the
shared expert as a dense MLP; expert parallel: whole experts, contiguous, the first ranks one
more when they do not divide. Float8 experts (fp8-dynamic) are quantized whole before the cut,
so each rank's bytes and scales are exactly the one-process model's; an engine directory cuts
the same. The ranks' block outputs, summed (what the block's all-reduce does), equal the whole
block's; the memory plan counts each rank's experts; impossible splits are refused by name."""

from __future__ import annotations

import dataclasses
import functools
import json

import pytest
import torch

from kiln.config import EngineConfig
from kiln.distributed.parallel_state import ParallelContext, RankLayout
from kiln.errors import ModelLoadError
from kiln.kernels import reference
from kiln.layers.moe_parallel import ExpertShard, expert_range
from kiln.models import moe_blocks
from kiln.runtime.config_plan import weight_bytes
from kiln.runtime.model_loader import load_model
from tests.models.family_checks import perturb_norms_and_biases, save_tiny_hf

EXPERTS = dict(num_experts_per_tok=2, moe_intermediate_size=32)


@pytest.fixture(scope="module")
def qwen2_moe(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("qwen2_moe"))
    save_tiny_hf(path, "qwen2_moe", "Qwen2MoeForCausalLM", perturb=perturb_norms_and_biases,
                 num_experts=4, norm_topk_prob=False, shared_expert_intermediate_size=48,
                 **EXPERTS)  # fmt: skip
    return path


@pytest.fixture(scope="module")
def mixtral3(tmp_path_factory) -> str:
    """Three experts: uneven over two expert-parallel ranks (2 + 1)."""
    path = str(tmp_path_factory.mktemp("mixtral3"))
    save_tiny_hf(path, "mixtral", "MixtralForCausalLM", num_local_experts=3,
                 intermediate_size=32, num_experts_per_tok=2)  # fmt: skip
    return path


@functools.cache
def _models(path: str, tp: int, ep: bool, quantization: str = "none"):
    config = EngineConfig(model=path, dtype="float32", quantization=quantization)
    one = load_model(config, torch.device("cpu"), torch.float32).model
    ranks = [
        load_model(config, torch.device("cpu"), torch.float32,
                   ParallelContext(RankLayout(tp, 1, r), None, None, None, expert_parallel=ep),
                   ).model
        for r in range(tp)
    ]  # fmt: skip
    return one, ranks


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def test_expert_ranges_spread_the_remainder_over_the_first_ranks() -> None:
    assert [expert_range(8, 2, r) for r in range(2)] == [(0, 4), (4, 4)]
    assert [expert_range(7, 3, r) for r in range(3)] == [(0, 3), (3, 2), (5, 2)]
    with pytest.raises(ValueError, match="num_experts=2 cannot be spread over 4"):
        expert_range(2, 4, 0)


@pytest.mark.parametrize("quantization", ["none", "fp8-dynamic"])
def test_tensor_parallel_ranks_hold_a_slice_of_every_expert(qwen2_moe, quantization) -> None:
    one, ranks = _models(qwen2_moe, 2, False, quantization)
    full = one.layers[0].mlp
    w13, w2 = _bits(full.experts.w13_weight), _bits(full.experts.w2_weight)
    n = 16  # 32 columns over 2 ranks
    for r, rank in enumerate(ranks):
        part = rank.layers[0].mlp
        assert part.experts.num_experts == 4 and part.experts.intermediate_size == n
        gate, up = _bits(part.experts.w13_weight).split(n, dim=1)
        assert torch.equal(gate, w13[:, r * n : (r + 1) * n])
        assert torch.equal(up, w13[:, 32 + r * n : 32 + (r + 1) * n])
        assert torch.equal(_bits(part.experts.w2_weight), w2[:, :, r * n : (r + 1) * n])
        if quantization != "none":  # per-expert scales of the whole expert: the same
            assert torch.equal(part.experts.w13_weight_scale, full.experts.w13_weight_scale)
            assert torch.equal(part.experts.w2_weight_scale, full.experts.w2_weight_scale)
        shared = part.shared_expert.down_proj
        assert shared.in_features == 24 and shared.reduce is None  # summed with the experts
        assert part.reduce is not None and torch.equal(part.gate.weight, full.gate.weight)


@pytest.mark.parametrize("quantization", ["none", "fp8-dynamic"])
def test_expert_parallel_ranks_hold_whole_experts(mixtral3, quantization) -> None:
    one, ranks = _models(mixtral3, 2, True, quantization)
    full = one.layers[1].mlp.experts
    for rank, (first, count) in zip(ranks, [(0, 2), (2, 1)]):
        part = rank.layers[1].mlp.experts
        assert rank.config.expert_range == (first, count)
        held = slice(first, first + count)
        assert torch.equal(_bits(part.w13_weight), _bits(full.w13_weight)[held])
        assert torch.equal(_bits(part.w2_weight), _bits(full.w2_weight)[held])
        if quantization != "none":
            assert torch.equal(part.w13_weight_scale, full.w13_weight_scale[held])


@pytest.mark.parametrize(
    ("family", "ep"), [("qwen2_moe", False), ("qwen2_moe", True), ("mixtral3", True)]
)
def test_the_ranks_parts_sum_to_the_whole_block(family, ep, request, monkeypatch) -> None:
    """What the block's all-reduce adds: each rank's experts (and shared-expert slice) on the
    same tokens, its own all-reduce left out. Under EP some tokens chose none of a rank's
    experts: that rank adds zeros for them."""
    one, ranks = _models(request.getfixturevalue(family), 2, ep)
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(0))
    norm = one.layers[0].post_attention_layernorm
    want, _ = one.layers[0].mlp(reference, x, x.flip(0), norm, 1e-5)
    monkeypatch.setattr(moe_blocks, "tp_all_reduce", lambda ctx, t: t)  # no process group
    parts = [rank.layers[0].mlp(reference, x, x.flip(0), norm, 1e-5)[0] for rank in ranks]
    assert want.abs().max() > 0.1
    torch.testing.assert_close(parts[0] + parts[1], want, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(parts[0], want, atol=1e-3)  # each rank only a part


@pytest.mark.parametrize("ep", [False, True])
def test_an_engine_directory_is_cut_as_the_checkpoint(qwen2_moe, tmp_path, ep) -> None:
    from kiln.builder.build import BuildOptions, build_engine

    out = str(tmp_path / "engine")
    options = BuildOptions(quantization="fp8-dynamic", accuracy_check=False, max_model_len=256)
    build_engine(qwen2_moe, out, options, None)
    _, want = _models(qwen2_moe, 2, ep, "fp8-dynamic")
    _, got = _models(out, 2, ep)
    for a, b in zip(got, want):
        for (name, p), q in zip(a.named_parameters(), b.parameters()):
            if ".experts." in name:
                assert torch.equal(_bits(p.detach()), _bits(q.detach())), name


@pytest.mark.parametrize(("family", "ep"), [("qwen2_moe", False), ("mixtral3", True)])
@pytest.mark.parametrize("quantization", ["none", "fp8-dynamic"])
def test_the_memory_plan_counts_each_ranks_experts(family, ep, quantization, request) -> None:
    _, ranks = _models(request.getfixturevalue(family), 2, ep, quantization)
    for rank in ranks:
        experts = sum(p.numel() * p.element_size() for n, p in rank.named_parameters()
                      if ".experts." in n)  # fmt: skip
        # The plan of this rank's config less the same with no experts held: its experts.
        plan = weight_bytes(rank.config, torch.float32, quantization)
        none = dataclasses.replace(rank.config, expert_range=(0, 0))
        assert plan - weight_bytes(none, torch.float32, quantization) == experts


def test_impossible_splits_are_refused_by_name(tmp_path) -> None:
    path = str(tmp_path / "m")
    # 2 experts of width 30, 4 query heads: heads split over 4 ranks, experts do not.
    save_tiny_hf(path, "mixtral", "MixtralForCausalLM", num_local_experts=2,
                 intermediate_size=30, num_experts_per_tok=1)  # fmt: skip
    named = r"moe_intermediate_size=30 does not split over tensor_parallel_size=4 \(--enable-e"
    with pytest.raises(ModelLoadError, match=named):
        _models(path, 4, False)
    with pytest.raises(ModelLoadError, match="num_experts=2 cannot be spread over 4"):
        _models(path, 4, True)
    _, ranks = _models(path, 2, True)  # one whole expert each: fine, width 30 and all
    assert [r.layers[0].mlp.experts.w13_weight.shape for r in ranks] == [(1, 60, 64)] * 2


def test_each_rank_is_checked_against_its_device_for_its_own_share(qwen2_moe, monkeypatch) -> None:
    """The size check before loading counts a rank's shard (its experts' slices), so a model
    larger than one device but whose shard fits is not refused under TP."""
    from kiln.models.config import ModelConfig
    from kiln.runtime import model_loader

    with open(f"{qwen2_moe}/config.json") as f:
        cfg = ModelConfig.from_hf_dict(json.load(f))
    whole = sum(cfg.parameter_counts().values()) * 4
    monkeypatch.setattr(model_loader, "_memory_of", lambda device: (whole - 1, "a small device"))
    config = EngineConfig(model=qwen2_moe, dtype="float32")
    with pytest.raises(ModelLoadError, match=r"more than the .* of a small device"):
        load_model(config, torch.device("cpu"), torch.float32)
    rank = ParallelContext(RankLayout(2, 1, 1), None, None, None)
    load_model(config, torch.device("cpu"), torch.float32, rank)  # about half each: fits


def test_kiln_build_tp2_writes_each_rank_its_experts_slice(qwen2_moe, tmp_path) -> None:
    """`kiln build -tp 2`: each rank's shard holds the experts it cuts when loading the whole
    model; such an engine holds slices, so expert parallelism is refused by name."""
    from kiln.builder.build import BuildOptions, build_engine

    out = str(tmp_path / "engine")
    options = BuildOptions(quantization="fp8-dynamic", accuracy_check=False, max_model_len=256,
                           tensor_parallel_size=2)  # fmt: skip
    build_engine(qwen2_moe, out, options, None)
    _, want = _models(qwen2_moe, 2, False, "fp8-dynamic")
    for r in range(2):
        config = EngineConfig(model=out, dtype="float32", tensor_parallel_size=2)
        ctx = ParallelContext(RankLayout(2, 1, r), None, None, None)
        got = load_model(config, torch.device("cpu"), torch.float32, ctx).model
        for (name, p), q in zip(got.named_parameters(), want[r].parameters()):
            assert torch.equal(_bits(p.detach()), _bits(q.detach())), name
    ep = EngineConfig(model=out, dtype="float32", tensor_parallel_size=2,
                      enable_expert_parallel=True)  # fmt: skip
    ctx = ParallelContext(RankLayout(2, 1, 0), None, None, None, expert_parallel=True)
    with pytest.raises(ModelLoadError, match="tensor-parallel slices of every expert"):
        load_model(ep, torch.device("cpu"), torch.float32, ctx)


def test_per_row_scales_ride_with_their_rows() -> None:
    """Scales per output row (per channel): w13's are cut with its gate and up rows, w2's
    rows are the hidden size and stay whole; a per-expert scale is whole."""
    shard = ExpertShard(None, 4, (0, 4), (2, 2), 4)  # type: ignore[arg-type]
    w13_rows = torch.arange(4 * 8).reshape(4, 8)  # [E, 2 * width] scales
    assert shard.cut_stacked("w13_weight_scale", w13_rows)[1].tolist() == [10, 11, 14, 15]
    w2_rows = torch.arange(4 * 3).reshape(4, 3)  # [E, hidden]
    assert torch.equal(shard.cut_stacked("w2_weight_scale", w2_rows), w2_rows)
    assert torch.equal(shard.cut_stacked("w13_weight_scale", torch.ones(4)), torch.ones(4))
    w2 = torch.arange(3 * 4).reshape(3, 4)  # one expert's [hidden, width]
    assert shard.cut_expert("w2_weight", w2).tolist() == [[2, 3], [6, 7], [10, 11]]


@pytest.mark.parametrize("ep", [False, True])
def test_dummy_weights_fill_each_ranks_experts(qwen2_moe, ep) -> None:
    """The benchmarks' dummy weights (float8 experts too) at each rank's shapes."""
    config = EngineConfig(model=qwen2_moe, dtype="float32", load_format="dummy",
                          quantization="fp8-dynamic")  # fmt: skip
    ctx = ParallelContext(RankLayout(2, 1, 1), None, None, None, expert_parallel=ep)
    experts = (
        load_model(config, torch.device("cpu"), torch.float32, ctx).model.layers[0].mlp.experts
    )
    assert experts.w13_weight.shape == ((2, 64, 64) if ep else (4, 32, 64))
    assert experts.w13_weight.dtype == torch.float8_e4m3fn and experts.w13_weight.float().std() > 0


@pytest.mark.parametrize("ep", [False, True])
def test_experts_that_come_stacked_are_cut_too(qwen2_moe, ep) -> None:
    """A family whose adapter yields its experts already stacked (as gpt-oss's checkpoint
    holds them): each rank keeps the same part as from per-expert tensors."""
    from safetensors.torch import load_file

    from kiln.models.moe_blocks import stack_expert_weights
    from kiln.models.qwen3_moe import QWEN_EXPERT_PARTS

    _, want = _models(qwen2_moe, 2, ep)
    tensors = load_file(f"{qwen2_moe}/model.safetensors")
    stacked = list(stack_expert_weights(tensors.items(), 4, QWEN_EXPERT_PARTS))
    assert any(name.endswith("experts.w13_weight") for name, _ in stacked)
    config = EngineConfig(model=qwen2_moe, dtype="float32", load_format="dummy")
    for r in range(2):
        ctx = ParallelContext(RankLayout(2, 1, r), None, None, None, expert_parallel=ep)
        got = load_model(config, torch.device("cpu"), torch.float32, ctx).model
        got.load_weights(iter(stacked))
        for (name, p), q in zip(got.named_parameters(), want[r].parameters()):
            assert torch.equal(p, q), name


def test_per_channel_float8_and_biases_are_cut_with_their_rows() -> None:
    """What a family with per-row expert scales and expert biases needs (gpt-oss): w13's
    per-row scales quantized from the whole expert, then cut with its rows; w2's bias added
    once, by the first tensor rank."""

    def per_row(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scale = w.abs().amax(dim=2) / 448
        return (w / scale[..., None]).to(torch.float8_e4m3fn), scale

    ctx1 = ParallelContext(RankLayout(2, 1, 1), None, None, None)
    shard = ExpertShard(ctx1, 4, (0, 4), (2, 2), 4)
    whole = torch.randn(8, 6)  # one expert's [gate; up] rows, width 4
    (_, codes), (suffix, scale) = shard.keep("w13_weight", 1, whole, per_row)
    all_codes, all_scale = per_row(whole[None])
    rows = [2, 3, 6, 7]  # this rank's 2 of the gate's 4 rows, and of the up's
    assert suffix == "_scale"
    assert torch.equal(codes.view(torch.uint8), all_codes[0, rows].view(torch.uint8))
    assert torch.equal(scale, all_scale[0, rows])
    assert shard.cut_expert("w13_bias", torch.arange(8.0)).tolist() == [2, 3, 6, 7]
    assert not shard.cut_stacked("w2_bias", torch.ones(4, 6)).any()  # rank 1: rank 0 adds it
    ctx0 = ParallelContext(RankLayout(2, 1, 0), None, None, None)
    rank0 = ExpertShard(ctx0, 4, (0, 4), (0, 2), 4)
    assert rank0.cut_stacked("w2_bias", torch.ones(4, 6)).all()


def test_pipeline_stages_hold_their_layers_experts(tmp_path) -> None:
    """TP=2 x PP=2 with expert parallelism: each rank loads its stage's layers with its whole
    experts (the stage's tensor group is its expert group), skipping the other stage's."""
    path = str(tmp_path / "m")
    save_tiny_hf(path, "qwen3_moe", "Qwen3MoeForCausalLM", num_experts=4, num_hidden_layers=3,
                 mlp_only_layers=[1], head_dim=32, **EXPERTS)  # fmt: skip
    config = EngineConfig(model=path, dtype="float32")
    one = load_model(config, torch.device("cpu"), torch.float32).model
    for rank in range(4):
        ctx = ParallelContext(RankLayout(2, 2, rank), None, None, None, expert_parallel=True)
        got = load_model(config, torch.device("cpu"), torch.float32, ctx).model
        first = 2 * (rank % 2)  # tensor rank r holds experts 2r, 2r + 1
        for i, layer in enumerate(got.layers):
            whole = one.layers[got.layer_start + i].mlp
            if hasattr(whole, "experts"):
                part = layer.mlp.experts.w2_weight
                assert torch.equal(part, whole.experts.w2_weight[first : first + 2])
