"""`kiln build` from the pre-quantized INT4 and 8-bit checkpoints the loader's tests make
(tests/data/int4_checkpoints, eight_bit_checkpoints, moe_fp8_checkpoints: GPTQ with and without
desc_act, AutoAWQ GEMM, compressed-tensors pack-quantized, block FP8 in both formats, W8A8 INT8,
W8A16 int8 / float8; dense and mixture-of-experts): the engine holds the tensors loading the
checkpoint makes, answers as it does, records its scheme; a contradicting --quantization is a
one-line error; -tp 2 writes each rank what that rank loads from the checkpoint."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from kiln import LLM, SamplingParams
from kiln.builder.build import BuildOptions, build_engine
from kiln.builder.prequantized import inspect, resolve_quantization
from kiln.builder.weights import engine_tensors
from kiln.checkpoint.engine_dir import MANIFEST_FILE, rank_dir_name
from kiln.cli.main import main
from kiln.config import EngineConfig
from kiln.distributed.parallel_state import ParallelContext, RankLayout
from kiln.errors import BuildError, ModelLoadError
from kiln.runtime.model_loader import load_model
from tests.builder.test_build_prequantized import _char_tokenizer

DATA = Path(__file__).parents[1] / "data"
INT4 = DATA / "int4_checkpoints"
EIGHT = DATA / "eight_bit_checkpoints"
MOE = DATA / "moe_fp8_checkpoints"
# checkpoint -> (the scheme it builds, its format in the manifest)
CHECKPOINTS = {
    INT4 / "gptq": ("int4-g128", "gptq"),
    INT4 / "gptq_desc_act": ("int4-g64", "gptq"),
    INT4 / "gptq_channel": ("int4-channel", "gptq"),
    INT4 / "awq": ("int4-g64", "awq"),
    INT4 / "ct_g128": ("int4-g128-sym", "compressed-tensors"),
    INT4 / "ct_g128_asym": ("int4-g128", "compressed-tensors"),
    INT4 / "ct_channel": ("int4-channel-sym", "compressed-tensors"),
    EIGHT / "fp8_block_hf": ("fp8-block", "fp8"),
    EIGHT / "ct_fp8_block": ("fp8-block", "compressed-tensors"),
    EIGHT / "ct_w8a8_int8": ("int8-w8a8", "compressed-tensors"),
    EIGHT / "ct_w8a16_int8": ("int8-w8a16-g128", "compressed-tensors"),
    EIGHT / "ct_w8a16_int8_channel": ("int8-w8a16-channel", "compressed-tensors"),
    EIGHT / "ct_w8a16_fp8": ("fp8-w8a16-channel", "compressed-tensors"),
    MOE / "ct_w4a16": ("int4-g128-sym", "compressed-tensors"),
    MOE / "ct_w8a16": ("int8-w8a16-channel", "compressed-tensors"),
    MOE / "ct_w8a16_g128": ("int8-w8a16-g128", "compressed-tensors"),
    MOE / "ct_w8a8_int8": ("int8-w8a8", "compressed-tensors"),
    MOE / "ct_fp8_block": ("fp8-block", "compressed-tensors"),
}
PROMPTS = [[1, 5, 9, 33, 7, 100], [1, 200, 3, 17]]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, logprobs=2, ignore_eos=True)
ARGS = dict(kv_cache_memory_gb=0.02, max_num_seqs=4, dtype="float32")
CPU, FP32 = torch.device("cpu"), torch.float32


def _id(path: Path) -> str:
    return f"{path.parent.name.split('_')[0]}/{path.name}"


def _files(engine: str | Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted(Path(engine).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            tensors.update({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118
    return tensors


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def _model(path: str | Path, ctx: ParallelContext | None = None, **kwargs):
    tp = 1 if ctx is None else ctx.tp_size
    config = EngineConfig(model=str(path), dtype="float32", tensor_parallel_size=tp, **kwargs)
    return load_model(config, CPU, FP32, ctx).model


def _assert_same_model(got, want, where: object) -> None:
    """Every parameter (as an engine writes it) and every INT4 input order equal, bit for bit."""
    want_params = dict(engine_tensors(want))
    got_params = dict(engine_tensors(got))
    assert got_params.keys() == want_params.keys()
    for name, tensor in got_params.items():
        assert torch.equal(_bits(tensor), _bits(want_params[name])), (where, name)
    want_orders = {n: b for n, b in want.named_buffers() if n.endswith("input_order")}
    got_orders = {n: b for n, b in got.named_buffers() if n.endswith("input_order")}
    assert got_orders.keys() == want_orders.keys(), where
    for name, order in got_orders.items():
        assert torch.equal(order, want_orders[name]), (where, name)


def _tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize("src", list(CHECKPOINTS), ids=_id)
def test_an_int4_or_8_bit_checkpoint_builds_the_engine_it_loads_as(src, tmp_path):
    """--quantization left out: the engine's files are the tensors loading the checkpoint makes
    (INT4 codes in kiln's layout, act-order inputs reordered, 8-bit codes unpacked), it loads to
    the same model and answers with the checkpoint's tokens; the manifest names the scheme."""
    scheme, fmt = CHECKPOINTS[src]
    out = tmp_path / "engine"
    built = build_engine(str(src), str(out), BuildOptions(accuracy_check=False), None)
    assert built.quantization == scheme
    origin = built.quantization_source
    assert origin["format"] == fmt and "no re-quantization" in origin["method"]
    config = json.loads((src / "config.json").read_text())["quantization_config"]
    assert origin["config_file"] == "config.json" and origin["config"] == config
    with open(out / MANIFEST_FILE) as f:
        assert json.load(f)["quantization"] == scheme

    direct = _model(src)
    files = _files(out)
    written = dict(engine_tensors(direct))
    assert files.keys() == written.keys()
    for name, tensor in files.items():
        assert torch.equal(_bits(tensor), _bits(written[name])), name
    _assert_same_model(_model(out), direct, "engine")
    assert _tokens(LLM(str(out), **ARGS)) == _tokens(LLM(str(src), **ARGS))


def test_an_act_order_engine_keeps_the_checkpoints_input_order(tmp_path):
    """GPTQ desc_act: the engine holds the codes reordered as loading reorders them and the
    g_idx, from which its load takes the same input order (without it the tokens differ)."""
    src = INT4 / "gptq_desc_act"
    out = tmp_path / "engine"
    build_engine(str(src), str(out), BuildOptions(accuracy_check=False), None)
    engine = _model(out)
    orders = [b for n, b in engine.named_buffers() if n.endswith("input_order")]
    assert orders and all(o is not None for o in orders)
    arange = torch.arange(orders[0].numel())
    assert not torch.equal(orders[0], arange)  # really reordered
    for layer in engine.layers:  # dropped, the codes' columns no longer meet x's
        layer.self_attn.qkv_proj.input_order = None
    hidden = torch.randn(3, engine.config.hidden_size)
    want = _model(src).layers[0].self_attn.qkv_proj
    got = engine.layers[0].self_attn.qkv_proj
    from kiln.kernels import reference

    assert not torch.allclose(got.method.apply(got, reference, hidden),
                              want.method.apply(want, reference, hidden))  # fmt: skip


@pytest.mark.parametrize(
    "src", [INT4 / "gptq_desc_act", EIGHT / "ct_w8a8_int8", MOE / "ct_w4a16"], ids=_id
)
def test_the_accuracy_check_compares_the_engine_with_the_checkpoint(src, tmp_path):
    """Both perplexities measured; the same arithmetic, so equal within float noise."""
    built = build_engine(str(src), str(tmp_path / "engine"), BuildOptions(max_model_len=64), None)
    accuracy = built.accuracy
    assert accuracy["checked"] and accuracy["passed"] and accuracy["baseline_is_quantized"]
    assert "pre-quantized checkpoint as kiln loads it directly" in accuracy["baseline"]
    assert accuracy["max_ppl_increase_pct"] == 0.01 and accuracy["tokens"] > 100
    assert accuracy["max_abs_token_logprob_diff"] <= 1e-6
    assert accuracy["source_token_perplexity"] > 1
    assert accuracy["engine_token_perplexity"] == pytest.approx(
        accuracy["source_token_perplexity"], rel=1e-6
    )


@pytest.mark.parametrize(
    "src",
    [INT4 / "gptq_channel", INT4 / "awq", EIGHT / "fp8_block_hf", EIGHT / "ct_w8a8_int8",
     EIGHT / "ct_w8a16_int8_channel", MOE / "ct_w8a16"],
    ids=_id,
)  # fmt: skip
def test_a_tp2_build_writes_each_rank_what_it_loads_from_the_checkpoint(src, tmp_path):
    out = tmp_path / "tp2"
    options = BuildOptions(accuracy_check=False, tensor_parallel_size=2)
    built = build_engine(str(src), str(out), options, None)
    assert built.tensor_parallel_size == 2
    for rank in range(2):
        assert (out / rank_dir_name(rank, 2)).is_dir()
        ctx = ParallelContext(RankLayout(2, 1, rank), None, None, None)
        _assert_same_model(_model(out, ctx), _model(src, ctx), rank)


@pytest.mark.parametrize(
    ("src", "tp", "message"),
    [
        (INT4 / "gptq_desc_act", 2, r"act-order \(desc_act\) inputs.*build it without -tp"),
        (INT4 / "ct_g128", 2, "whole groups"),  # 128 inputs in one group: no cut by columns
    ],
    ids=["desc_act", "one-group"],
)
def test_a_tp_cut_the_loader_refuses_is_refused_by_name(src, tp, message, tmp_path):
    options = BuildOptions(accuracy_check=False, tensor_parallel_size=tp)
    with pytest.raises((BuildError, ModelLoadError), match=message):
        build_engine(str(src), str(tmp_path / "e"), options, None)
    assert not os.path.exists(tmp_path / "e")


@pytest.mark.parametrize(
    ("src", "quantization", "message"),
    [
        (INT4 / "gptq", "fp8-dynamic", r"gptq INT4 .* would re-quantize it"),
        (INT4 / "gptq", "int4-awq", "would re-quantize it"),
        (INT4 / "awq", "none", "does not dequantize them"),
        (EIGHT / "ct_w8a8_int8", "fp8-block", r"W8A8 INT8 checkpoint \(int8-w8a8\)"),
        (EIGHT / "fp8_block_hf", "fp8", r"block FP8 checkpoint \(fp8-block\)"),
        (EIGHT / "ct_w8a16_int8", "int8-w8a16-channel", r"\(int8-w8a16-g128\); --quantization"),
    ],
)
def test_a_quantization_that_contradicts_the_checkpoint_is_refused(
    src, quantization, message, tmp_path, capsys
):
    with pytest.raises(BuildError, match=message):
        build_engine(str(src), str(tmp_path / "e"), BuildOptions(quantization), None)
    argv = ["build", str(src), "-o", str(tmp_path / "e"), "--quantization", quantization]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err
    assert not os.path.exists(tmp_path / "e")


def test_the_checkpoints_own_scheme_named_is_the_same_build():
    """Its kiln name, or for GPTQ / AWQ kiln build's name for that rounding (vLLM's
    --quantization gptq / awq)."""
    for src, named in ((INT4 / "gptq", "int4-gptq"), (INT4 / "gptq", "int4-g128"),
                       (INT4 / "awq", "int4-awq"), (EIGHT / "ct_w8a16_int8", "int8-w8a16-g128"),
                       (EIGHT / "ct_fp8_block", "fp8-block")):  # fmt: skip
        scheme = inspect(str(src))
        assert resolve_quantization(named, scheme, str(src)) == CHECKPOINTS[src][0]
        BuildOptions(quantization=CHECKPOINTS[src][0])  # a valid option by that name
    with pytest.raises(BuildError, match="names a pre-quantized checkpoint's scheme"):
        resolve_quantization("int4-g128", None, "plain")


def test_a_float8_cache_calibrates_as_for_an_fp8_checkpoint(tmp_path):
    """No KV scales in an INT4 checkpoint: a float8 cache's are calibrated at build time when
    it has a tokenizer (checked against its model-dtype cache), else it stays unscaled, as
    loading the checkpoint leaves it (checked as the same arithmetic)."""
    options = BuildOptions(kv_cache_dtype="fp8", max_model_len=64)
    plain = build_engine(str(INT4 / "gptq"), str(tmp_path / "plain"), options, None)
    assert plain.kv_scales is None and plain.accuracy["max_ppl_increase_pct"] == 0.01
    assert plain.accuracy["passed"]
    fp8 = dict(ARGS, kv_cache_dtype="fp8")
    assert _tokens(LLM(str(tmp_path / "plain"), **fp8)) == _tokens(LLM(str(INT4 / "gptq"), **fp8))
    src = tmp_path / "with-tokenizer"
    shutil.copytree(INT4 / "gptq", src)
    _char_tokenizer(src)
    built = build_engine(str(src), str(tmp_path / "calibrated"), options, None)
    assert len(built.kv_scales) == 2 and built.kv_scales_in_weights
    assert built.quantization_source["kv_scales"].startswith("calibrated at build time")
    assert built.accuracy["passed"] and "model-dtype KV cache" in built.accuracy["baseline"]
    assert built.quantization == "int4-g128"


def test_an_int8_cache_measures_its_scales_at_load_as_the_checkpoint_does(tmp_path):
    """No per-head scales are stored (none are calibrated for a pre-quantized source): the
    engine measures them at load as the checkpoint loaded directly does, the same arithmetic."""
    src = tmp_path / "with-tokenizer"
    shutil.copytree(INT4 / "awq", src)
    _char_tokenizer(src)
    options = BuildOptions(kv_cache_dtype="int8", max_model_len=64)
    built = build_engine(str(src), str(tmp_path / "int8kv"), options, None)
    assert built.kv_scales is None and built.kv_head_scales is None
    assert built.accuracy["passed"] and built.accuracy["max_ppl_increase_pct"] == 0.01
    int8 = dict(ARGS, kv_cache_dtype="int8")
    assert _tokens(LLM(str(tmp_path / "int8kv"), **int8)) == _tokens(LLM(str(src), **int8))


def test_kiln_build_names_the_checkpoints_scheme_on_the_command_line(tmp_path, capsys):
    """`kiln build gptq_desc_act --quantization int4-g64`: the scheme --help does not list (it
    is the checkpoint's) is the same build as leaving it out."""
    src, out = INT4 / "gptq_desc_act", tmp_path / "e"
    argv = ["build", str(src), "-o", str(out), "--quantization", "int4-g64", "--no-accuracy-check"]
    assert main(argv) == 0
    with open(out / MANIFEST_FILE) as f:
        assert json.load(f)["quantization"] == "int4-g64"
    capsys.readouterr()
    argv[3], argv[5] = str(tmp_path / "f"), "int4-g128"  # a valid name, not this checkpoint's
    assert main(argv) == 2
    assert "would re-quantize it" in capsys.readouterr().err
