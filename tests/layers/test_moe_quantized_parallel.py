"""INT4 (W4A16) and 8-bit weight-only experts cut over tensor ranks, without processes: each
rank's model loaded with its ParallelContext (no process groups) and compared with the
one-process model. Tensor parallel: every expert's gate and up rows with their scales (and
INT4 zeros), down's input columns with their whole groups (INT4: the packed words from start
/ 8, the groups from start / group_size; per-channel scales whole; int8 in groups of 128 by
whole groups); expert parallel: whole experts. Checked on what the weights dequantize to, so
a cut of the wrong words or groups changes them. The checkpoints: GPTQ, AutoAWQ and
compressed-tensors INT4 written here (tests/models/test_moe_int4.py), group or per channel,
with or without zero points, Mixtral's w1 / w2 / w3 names too; llm-compressor's W8A16 (per
channel, groups of 128) and W8A8 INT8 experts; a fp32 Mixtral rounded at load ("int8-w8a16-
channel", "int8-w8a16-g128", "fp8-w8a16-channel"), each expert rounded whole before the cut.
Also: the ranks' parts sum to the whole block, an engine's whole tensors cut the same, the
memory plan counts each rank's experts, and a cut inside a group is refused by name."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import pytest
import torch

from kiln.config import EngineConfig
from kiln.distributed.parallel_state import ParallelContext, RankLayout
from kiln.errors import ModelLoadError
from kiln.kernels import reference
from kiln.layers.moe import FusedMoE
from kiln.layers.moe_int4 import Int4MoEMethod
from kiln.layers.moe_w8a16 import W8A16MoEMethod
from kiln.models import moe_blocks
from kiln.runtime.config_plan import weight_bytes
from kiln.runtime.model_loader import load_model
from tests.models.family_checks import save_tiny_hf
from tests.models.test_moe_int4 import MIXTRAL, QWEN3_MOE, write_int4

DATA = Path(__file__).parents[1] / "data" / "moe_fp8_checkpoints"
# Each tensor rank whole groups of 128: experts 256 wide (128 a rank), o_proj 256 inputs (4
# heads of 64; the dense INT4 layer needs whole groups too).
QWEN3_MOE_TP = dict(QWEN3_MOE, moe_intermediate_size=256, head_dim=64)
MIXTRAL_TP = dict(MIXTRAL, intermediate_size=256, head_dim=64)
# case -> (family, how it is made: an INT4 format, a DATA checkpoint or a quantization at
# load, the memory plan's quantization name)
CASES = {
    "gptq_g32": ("qwen3_moe", "int4:gptq_g32", "int4-g32"),
    "awq": ("qwen3_moe", "int4:awq", "int4-g64"),
    "ct": ("qwen3_moe", "int4:ct", "int4-g128-sym"),
    "ct_channel": ("qwen3_moe", "int4:ct_channel", "int4-channel-sym"),
    "gptq_channel": ("qwen3_moe", "int4:gptq_channel", "int4-channel"),
    "mixtral_awq": ("mixtral", "int4:awq", "int4-g64"),
    "ct_w8a16": ("data", "ct_w8a16", "int8-w8a16-channel"),
    "ct_w8a16_g128": ("data", "ct_w8a16_g128", "int8-w8a16-g128"),
    "ct_w8a8_int8": ("data", "ct_w8a8_int8", "int8-w8a8"),
    "int8_channel": ("mixtral", "load:int8-w8a16-channel", "int8-w8a16-channel"),
    "int8_g128": ("mixtral", "load:int8-w8a16-g128", "int8-w8a16-g128"),
    "fp8_channel": ("mixtral", "load:fp8-w8a16-channel", "fp8-w8a16-channel"),
}


def make_sources(root: Path) -> dict[str, Path]:
    """The tiny fp32 checkpoints the cases are made from, by family."""
    made = {"qwen3_moe": root / "qwen3_moe", "mixtral": root / "mixtral"}
    save_tiny_hf(str(made["qwen3_moe"]), "qwen3_moe", "Qwen3MoeForCausalLM", **QWEN3_MOE_TP)
    save_tiny_hf(str(made["mixtral"]), "mixtral", "MixtralForCausalLM", **MIXTRAL_TP)
    return made


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    return make_sources(tmp_path_factory.mktemp("moe_quantized_tp"))


def checkpoint(sources: dict[str, Path], case: str) -> tuple[str, str]:
    """(the case's checkpoint directory, the quantization to load it with); INT4 ones are
    written beside their source once (with their exact dequantization, `<dir>-dequantized`)."""
    family, how, _ = CASES[case]
    kind, _, name = how.partition(":")
    if family == "data":
        return str(DATA / how), "none"
    source = sources[family]
    if kind == "load":
        return str(source), name
    out = source.with_name(f"{source.name}-{name}")
    if not out.exists():
        write_int4(source, out, name)
    return str(out), "none"


def _load(path: str, quantization: str, tp: int = 1, rank: int = 0, ep: bool = False):
    config = EngineConfig(model=path, dtype="float32", quantization=quantization)
    ctx = None
    if tp > 1:
        ctx = ParallelContext(RankLayout(tp, 1, rank), None, None, None, expert_parallel=ep)
    return load_model(config, torch.device("cpu"), torch.float32, ctx).model


@functools.cache
def _models(path: str, quantization: str, ep: bool):
    one = _load(path, quantization)
    return one, [_load(path, quantization, 2, r, ep) for r in range(2)]


def _experts(model) -> list[FusedMoE]:
    return [m for m in model.modules() if isinstance(m, FusedMoE)]


def dequantized(experts: FusedMoE) -> tuple[torch.Tensor, torch.Tensor]:
    """The experts' (w13, w2) as fp32 values: INT4 (code - zero) * scale by group, 8-bit code
    * scale (per row, or per row and 128 inputs)."""
    if isinstance(experts.method, Int4MoEMethod):
        return tuple(
            reference.dequantize_int4_experts(
                getattr(experts, f"{w}_weight"), getattr(experts, f"{w}_weight_scales"),
                getattr(experts, f"{w}_weight_zeros"),
            )
            for w in ("w13", "w2")
        )  # fmt: skip
    assert isinstance(experts.method, W8A16MoEMethod)
    out = []
    for w in ("w13", "w2"):
        codes, scale = getattr(experts, f"{w}_weight"), getattr(experts, f"{w}_weight_scale")
        if scale.dim() == 3:
            out.append(reference.dequantize_block_rows(codes, scale))
        else:
            out.append(codes.float() * scale[..., None])
    return out[0], out[1]


@pytest.mark.parametrize("ep", [False, True], ids=["tp2", "ep2"])
@pytest.mark.parametrize("case", list(CASES))
def test_each_rank_holds_its_cut_of_the_one_process_experts(sources, case, ep) -> None:
    one, ranks = _models(*checkpoint(sources, case), ep)
    for full, *parts in zip(_experts(one), *map(_experts, ranks)):
        w13, w2 = dequantized(full)
        n = full.intermediate_size // 2
        assert w2.abs().max() > 0
        for r, part in enumerate(parts):
            got13, got2 = dequantized(part)
            if ep:  # experts [2r, 2r + 2) of 4, whole
                assert part.num_experts == 2 and part.intermediate_size == full.intermediate_size
                assert torch.equal(got13, w13[2 * r : 2 * r + 2])
                assert torch.equal(got2, w2[2 * r : 2 * r + 2])
                continue
            assert part.num_experts == 4 and part.intermediate_size == n
            gate, up = got13.split(n, dim=1)
            assert torch.equal(gate, w13[:, r * n : (r + 1) * n])
            assert torch.equal(up, w13[:, 2 * n + r * n : 2 * n + (r + 1) * n])
            assert torch.equal(got2, w2[:, :, r * n : (r + 1) * n])


@pytest.mark.parametrize("num_tokens", [5, 20])  # the decode GEMVs (TP), the grouped GEMM
@pytest.mark.parametrize("ep", [False, True], ids=["tp2", "ep2"])
@pytest.mark.parametrize("case", ["gptq_g32", "ct_channel", "mixtral_awq", "ct_w8a16_g128",
                                  "fp8_channel"])  # fmt: skip
def test_the_ranks_parts_sum_to_the_whole_block(sources, case, ep, num_tokens, monkeypatch):
    """What the block's all-reduce adds: each rank's experts on the same tokens (expert
    parallel ranks: the grouped kernels at every size, other ranks' experts skipped)."""
    one, ranks = _models(*checkpoint(sources, case), ep)
    sparse = next(i for i, layer in enumerate(one.layers) if hasattr(layer.mlp, "experts"))
    x = torch.randn(num_tokens, 128, generator=torch.Generator().manual_seed(0))
    norm = one.layers[sparse].post_attention_layernorm
    want, _ = one.layers[sparse].mlp(reference, x, x.flip(0), norm, 1e-5)
    monkeypatch.setattr(moe_blocks, "tp_all_reduce", lambda ctx, t: t)  # no process group
    parts = [r.layers[sparse].mlp(reference, x, x.flip(0), norm, 1e-5)[0] for r in ranks]
    assert want.abs().max() > 0.01
    torch.testing.assert_close(parts[0] + parts[1], want, atol=1e-5, rtol=1e-4)
    assert not torch.allclose(parts[0], want, atol=1e-4)  # each rank only a part


@pytest.mark.parametrize("ep", [False, True], ids=["tp2", "ep2"])
@pytest.mark.parametrize("case", ["gptq_g32", "ct_channel", "ct_w8a16_g128", "int8_channel"])
def test_an_engines_whole_tensors_cut_as_the_checkpoint(sources, case, ep) -> None:
    """An engine directory holds the one-process model's tensors (packed words, group scales
    and zeros, int8 codes): loaded under TP / EP (load_fused_weights, as `kiln build -tp N`
    cuts too) each rank gets what it reads from the checkpoint itself."""
    one, ranks = _models(*checkpoint(sources, case), ep)
    path, quantization = checkpoint(sources, case)
    whole = [(k, v) for k, v in one.named_parameters()]
    for r, want in enumerate(ranks):
        part = _load(path, quantization, 2, r, ep)
        with torch.no_grad():
            for param in part.parameters():  # nothing of the checkpoint's load left behind
                param.view(torch.uint8).zero_()
        part.load_fused_weights(whole)
        params = dict(want.named_parameters())
        for key, param in part.named_parameters():
            if ".experts." not in key:  # the dense layers' cuts: tests/distributed
                continue
            assert torch.equal(param.view(torch.uint8), params[key].view(torch.uint8)), key


@pytest.mark.parametrize("ep", [False, True], ids=["tp2", "ep2"])
@pytest.mark.parametrize("case", ["gptq_g32", "ct_channel", "ct_w8a16_g128", "fp8_channel"])
def test_the_memory_plan_counts_each_ranks_experts(sources, case, ep) -> None:
    _, ranks = _models(*checkpoint(sources, case), ep)
    quantization = CASES[case][2]
    for rank in ranks:
        experts = sum(p.numel() * p.element_size() for n, p in rank.named_parameters()
                      if ".experts." in n)  # fmt: skip
        none = dataclasses.replace(rank.config, expert_range=(0, 0))
        plan = weight_bytes(rank.config, torch.float32, quantization)
        assert plan - weight_bytes(none, torch.float32, quantization) == experts


def test_a_cut_inside_an_expert_group_is_refused_by_name(tmp_path) -> None:
    """Experts 128 wide over 2 ranks (64 each) in groups of 128; the attention's o_proj (256
    inputs) splits into whole groups, so the experts are what is refused. Expert parallelism
    holds whole experts and loads."""
    qwen = tmp_path / "qwen3_moe"
    save_tiny_hf(str(qwen), "qwen3_moe", "Qwen3MoeForCausalLM", **dict(QWEN3_MOE, head_dim=64))
    write_int4(qwen, tmp_path / "ct", "ct")
    message = (r"INT4 experts under tensor_parallel_size=2: each rank's 64 of the experts' 128 "
               r"down inputs \(this rank's from 64\) split a group of 128 inputs")  # fmt: skip
    with pytest.raises(ModelLoadError, match=message):
        _load(str(tmp_path / "ct"), "none", 2, 1)
    held = _load(str(tmp_path / "ct"), "none", 2, 1, ep=True).layers[0].mlp.experts
    assert held.w2_weight_scales.shape == (2, 128, 1)
    mixtral = tmp_path / "mixtral"
    save_tiny_hf(str(mixtral), "mixtral", "MixtralForCausalLM", **dict(MIXTRAL, head_dim=64))
    message = (r"8-bit experts in groups of 128 under tensor_parallel_size=2: each rank's 64 "
               r"of the experts' 128 down inputs \(this rank's from 0\) split a group")  # fmt: skip
    with pytest.raises(ModelLoadError, match=message):
        _load(str(mixtral), "int8-w8a16-g128", 2, 0)


def test_act_order_experts_stay_refused_under_tensor_parallelism(tmp_path) -> None:
    qwen = tmp_path / "qwen3_moe"
    save_tiny_hf(str(qwen), "qwen3_moe", "Qwen3MoeForCausalLM", **QWEN3_MOE_TP)
    write_int4(qwen, tmp_path / "gptq", "gptq_g32", desc_act=True)
    for ep in (False, True):
        with pytest.raises(ModelLoadError, match="desc_act"):
            _load(str(tmp_path / "gptq"), "none", 2, 0, ep)


@pytest.mark.parametrize("case", ["int8_g128", "fp8_channel"])
def test_kiln_build_tp2_writes_each_rank_its_experts_slice(sources, tmp_path, case) -> None:
    """`kiln build -tp 2` rounding 8-bit experts: each rank's shard holds what that rank
    rounds and cuts from the source itself (INT4 checkpoints load directly, unbuilt)."""
    from kiln.builder.build import BuildOptions, build_engine

    path, quantization = checkpoint(sources, case)
    out = str(tmp_path / "engine")
    options = BuildOptions(quantization=quantization, accuracy_check=False, max_model_len=256,
                           tensor_parallel_size=2)  # fmt: skip
    build_engine(path, out, options, None)
    _, want = _models(path, quantization, False)
    for r in range(2):
        config = EngineConfig(model=out, dtype="float32", tensor_parallel_size=2)
        ctx = ParallelContext(RankLayout(2, 1, r), None, None, None)
        got = dict(load_model(config, torch.device("cpu"), torch.float32, ctx).model
                   .named_parameters())  # fmt: skip
        experts = [(k, p) for k, p in want[r].named_parameters() if ".experts." in k]
        assert experts
        for key, param in experts:
            assert torch.equal(got[key].view(torch.uint8), param.view(torch.uint8)), key
