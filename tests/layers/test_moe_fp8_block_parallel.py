"""Block-FP8 experts and projections cut over tensor ranks, without processes (each rank's
model loaded with its ParallelContext, as tests/layers/test_moe_parallel.py does): a Qwen FP8
release (tests/models/test_moe_fp8_block.py's) under TP=2 gives each rank its gate / up rows
with their scales and whole 128-blocks of the down projection's inputs with theirs; under EP=2
whole experts; the dense projections' block scales ride with their rows (column-parallel) or
whole input blocks (row-parallel); the ranks' block outputs sum to the whole block's; a cut
that splits a 128-block is refused by name."""

from __future__ import annotations

import functools

import pytest
import torch

from kiln.config import EngineConfig
from kiln.distributed.parallel_state import ParallelContext, RankLayout
from kiln.errors import ModelLoadError
from kiln.kernels import reference
from kiln.models import moe_blocks
from kiln.runtime.model_loader import load_model
from tests.models.family_checks import perturb_norms_and_biases, save_tiny_hf
from tests.models.test_moe_fp8_block import QWEN3_MOE, write_fp8_release


@pytest.fixture(scope="module")
def release(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("qwen3_moe_fp8_tp")
    save_tiny_hf(str(root / "src"), "qwen3_moe", "Qwen3MoeForCausalLM",
                 perturb=perturb_norms_and_biases, **QWEN3_MOE)  # fmt: skip
    write_fp8_release(str(root / "src"), str(root / "fp8"))
    return str(root / "fp8")


@functools.cache
def _models(path: str, ep: bool, quantization: str = "none"):
    config = EngineConfig(model=path, dtype="float32", quantization=quantization)
    one = load_model(config, torch.device("cpu"), torch.float32).model
    ctx = [ParallelContext(RankLayout(2, 1, r), None, None, None, expert_parallel=ep)
           for r in range(2)]  # fmt: skip
    return one, [load_model(config, torch.device("cpu"), torch.float32, c).model for c in ctx]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def test_tensor_ranks_hold_rows_and_whole_input_blocks(release) -> None:
    one, ranks = _models(release, False)
    full = one.layers[0].mlp.experts
    n = 128  # 256 columns over 2 ranks: one block each
    for r, rank in enumerate(ranks):
        part = rank.layers[0].mlp.experts
        rows = torch.cat(
            [torch.arange(r * n, (r + 1) * n), torch.arange(256 + r * n, 256 + (r + 1) * n)]
        )
        assert torch.equal(_bits(part.w13_weight), _bits(full.w13_weight)[:, rows])
        assert torch.equal(part.w13_weight_scale, full.w13_weight_scale[:, rows])
        assert torch.equal(_bits(part.w2_weight), _bits(full.w2_weight)[:, :, r * n : (r + 1) * n])
        assert torch.equal(part.w2_weight_scale, full.w2_weight_scale[:, :, r : r + 1])
        attn, whole = rank.layers[0].self_attn, one.layers[0].self_attn
        assert torch.equal(attn.o_proj.weight_scales, whole.o_proj.weight_scales[:, r : r + 1])
        q_rows = whole.qkv_proj.weight_scales[:256][r * 128 : (r + 1) * 128]
        assert torch.equal(attn.qkv_proj.weight_scales[:128], q_rows)
        k_rows = whole.qkv_proj.weight_scales[256:320][r * 32 : (r + 1) * 32]  # within a block
        assert torch.equal(attn.qkv_proj.weight_scales[128:160], k_rows)


def test_expert_ranks_hold_whole_experts(release) -> None:
    one, ranks = _models(release, True)
    full = one.layers[2].mlp.experts
    for r, rank in enumerate(ranks):
        part = rank.layers[2].mlp.experts
        held = slice(2 * r, 2 * r + 2)
        assert torch.equal(_bits(part.w2_weight), _bits(full.w2_weight)[held])
        assert torch.equal(part.w2_weight_scale, full.w2_weight_scale[held])
        assert torch.equal(part.w13_weight_scale, full.w13_weight_scale[held])


# TP at 5 tokens: the decode GEMVs on every rank; at 40 the grouped GEMM. Expert-parallel
# ranks take the grouped GEMM at every size (run_experts), so only 40 tokens compare like for
# like with one process.
@pytest.mark.parametrize(("ep", "num_tokens"), [(False, 5), (False, 40), (True, 40)])
def test_the_ranks_parts_sum_to_the_whole_block(release, ep, num_tokens, monkeypatch) -> None:
    one, ranks = _models(release, ep)
    x = torch.randn(num_tokens, 128, generator=torch.Generator().manual_seed(0))
    norm = one.layers[0].post_attention_layernorm
    want, _ = one.layers[0].mlp(reference, x, x.flip(0), norm, 1e-5)
    monkeypatch.setattr(moe_blocks, "tp_all_reduce", lambda ctx, t: t)  # no process group
    parts = [rank.layers[0].mlp(reference, x, x.flip(0), norm, 1e-5)[0] for rank in ranks]
    assert want.abs().max() > 0.1
    torch.testing.assert_close(parts[0] + parts[1], want, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(parts[0], want, atol=1e-3)


def test_a_cut_inside_a_block_is_refused(release) -> None:
    config = EngineConfig(model=release, dtype="float32")
    ctx = ParallelContext(RankLayout(4, 1, 0), None, None, None)
    with pytest.raises(ModelLoadError, match=r"splits? a 128-wide scale block"):
        load_model(config, torch.device("cpu"), torch.float32, ctx)


@pytest.mark.parametrize("ep", [False, True])
def test_an_engine_directory_is_cut_as_the_checkpoint(release, tmp_path, ep) -> None:
    """`kiln build --quantization fp8-block` from the 32-bit source rounds as the release was
    written; each rank's part of the engine equals its part of the release, codes and scales."""
    from kiln.builder.build import BuildOptions, build_engine

    out = str(tmp_path / "engine")
    options = BuildOptions(dtype="float32", quantization="fp8-block", accuracy_check=False,
                           max_model_len=256)  # fmt: skip
    build_engine(release.removesuffix("fp8") + "src", out, options, None)
    _, want = _models(release, ep)
    _, got = _models(out, ep)
    for a, b in zip(got, want):
        params = dict(b.named_parameters())
        for name, param in a.named_parameters():
            assert torch.equal(_bits(param), _bits(params[name])), name


@pytest.mark.parametrize("ep", [False, True])
def test_a_full_precision_checkpoint_rounds_each_expert_whole_before_the_cut(release, ep):
    """quantization="fp8-block" from the 32-bit source: each expert rounded per block whole,
    then cut, so every rank's codes and scales are its part of the release's."""
    _, want = _models(release, ep)
    _, got = _models(release.removesuffix("fp8") + "src", ep, "fp8-block")
    for a, b in zip(got, want):
        params = dict(b.named_parameters())
        for name, param in a.named_parameters():
            if ".experts." in name:
                assert torch.equal(_bits(param), _bits(params[name])), name
