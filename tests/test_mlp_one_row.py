"""The one-kernel FP8 MLP block of one row (kiln/kernels/triton/mlp_one_row.py) against its
pure-PyTorch twin, reference.add_rms_norm_mlp_fp8: under the interpreter at tiny shapes (the
activation's chunks and down's output tiles not dividing their widths), and on a GPU at
Llama-3.1-8B's shapes, in a CUDA graph too; then the decoder's switch (KILN_MLP_ONE_KERNEL)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the kernels' @triton.jit

pytest.importorskip("triton", reason="triton is not installed (pip install kiln[triton])")

from kiln.envs import envs
from kiln.kernels import reference
from kiln.kernels import triton as triton_ops
from kiln.kernels.triton import mlp_one_row, split_k
from kiln.layers.linear import Linear
from kiln.quantization.fp8 import Fp8LinearMethod
from kiln.quantization.outlier_columns import OutlierColumnsFp8LinearMethod

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = torch.device("cpu" if INTERPRET else "cuda")
on_gpu = pytest.mark.skipif(INTERPRET, reason="needs a CUDA GPU (interpreter run)")
# hidden 72 over the interpreter's 16-wide output tiles (4.5 of them), intermediate 88 over its
# 16-column chunks (5.5): the last chunk and tile are masked.
HIDDEN, INTER = 72, 88
EPS = 1e-5


def _weight(n: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    # Rows of very different magnitudes, as real projections have.
    w = torch.randn(n, k, generator=gen) * torch.logspace(-3, -1, n)[:, None]
    w_fp8, w_scale = reference.quantize_fp8(w, None)
    return w_fp8, w_scale.view(-1)


def _block(hidden: int, inter: int, dtype: torch.dtype, static: bool, seed: int) -> dict:
    """One row's inputs and an FP8 MLP's weights; down's static scale small enough that some
    activations saturate at +-448."""
    gen = torch.Generator().manual_seed(seed)
    gate_up, gate_up_scale = _weight(2 * inter, hidden, gen)
    down, down_scale = _weight(hidden, inter, gen)
    block = {
        "x": (3 * torch.randn(1, hidden, generator=gen)).to(dtype),
        "residual": torch.randn(1, hidden, generator=gen).to(dtype),
        "norm_weight": (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype),
        "eps": EPS,
        "gate_up_weight": gate_up,
        "gate_up_scale": gate_up_scale,
        "gate_up_input_scale": torch.tensor(0.01) if static else None,
        "down_weight": down,
        "down_scale": down_scale,
        "down_input_scale": torch.tensor(2e-4),
    }
    return {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in block.items()}


def _reference(block: dict) -> tuple[torch.Tensor, torch.Tensor]:
    cpu = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in block.items()}
    return reference.add_rms_norm_mlp_fp8(**cpu)


def _assert_close(got: torch.Tensor, want: torch.Tensor, rel: float) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(
        got.cpu().float(), want.float(), rtol=0, atol=rel * float(want.abs().max())
    )


def _no_two_kernel_path(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*args: object, **kwargs: object) -> None:
        raise AssertionError("the block ran as two kernels")

    monkeypatch.setattr(mlp_one_row, "add_rms_norm_linear_silu_mul_fp8", fail)


@pytest.mark.parametrize(
    ("dtype", "rel"),
    [
        (torch.float32, 1e-5),
        (torch.float16, 3e-3),
        pytest.param(torch.bfloat16, 2e-2, marks=on_gpu),
    ],
)
@pytest.mark.parametrize("static", [True, False])
@pytest.mark.parametrize("with_residual", [True, False])
def test_one_row_block_is_the_reference(monkeypatch, dtype, rel, static, with_residual) -> None:
    """Norm (the residual add first), gate_up with its input quantized statically or per row,
    SiLU-mul, the activation quantized with down's static scale, down summed over chunks: the
    reference's float8 products; the residual stream exact; the tile counters left at zero."""
    block = _block(HIDDEN, INTER, dtype, static, seed=int(static) + 2 * int(with_residual))
    if not with_residual:
        block["residual"] = None
    assert mlp_one_row.fits(*(block[k] for k in _OPERANDS))
    _no_two_kernel_path(monkeypatch)
    want, want_sum = _reference(block)
    got, got_sum = triton_ops.add_rms_norm_mlp_fp8(**block)
    _assert_close(got, want, rel)
    assert torch.equal(got_sum.cpu(), want_sum)
    assert int(split_k.counters(DEVICE).abs().sum()) == 0
    again, _ = triton_ops.add_rms_norm_mlp_fp8(**block)  # the chunks summed in one order
    assert torch.equal(again, got)


_OPERANDS = (
    "x", "residual", "norm_weight", "gate_up_weight", "gate_up_scale", "gate_up_input_scale",
    "down_weight", "down_scale", "down_input_scale",
)  # fmt: skip


def test_tiles_change_the_chunks_not_the_result() -> None:
    """One program's chunk of 16, 32 or all 88 columns (one program), output tiles of 16 or 64:
    the same block within fp32's summation order."""
    block = _block(HIDDEN, INTER, torch.float32, True, seed=5)
    want, _ = _reference(block)
    args = [block[k] for k in _OPERANDS]
    base = mlp_one_row.INTERPRETER_TILES
    for tiles in (base, base._replace(block_c=32, block_h=64), base._replace(block_c=128)):
        got, _ = mlp_one_row.launch(args[0], args[1], args[2], EPS, *args[3:], tiles=tiles)
        _assert_close(got, want, 1e-5)
    assert int(split_k.counters(DEVICE).abs().sum()) == 0


def test_more_chunks_than_one_load_of_the_sum() -> None:
    """41 chunks (the last one partial): the tile's sum takes its partial rows 32 at a time."""
    block = _block(HIDDEN, 16 * 40 + 8, torch.float32, True, seed=6)
    want, _ = _reference(block)
    got, _ = triton_ops.add_rms_norm_mlp_fp8(**block)
    _assert_close(got, want, 1e-5)
    assert int(split_k.counters(DEVICE).abs().sum()) == 0


def test_what_the_kernel_does_not_take_runs_as_two_kernels() -> None:
    """Three rows, or a dynamic scale for down's input (every chunk's absmax first), are not one
    kernel's: the op composes gate_up's kernels and down's, still the reference's block."""
    block = _block(HIDDEN, INTER, torch.float32, True, seed=7)
    gen = torch.Generator().manual_seed(8)
    three = dict(block, x=torch.randn(3, HIDDEN, generator=gen).to(DEVICE), residual=None)
    dynamic = dict(block, down_input_scale=None)
    for case in (three, dynamic):
        assert not mlp_one_row.fits(*(case[k] for k in _OPERANDS))
        got, got_sum = triton_ops.add_rms_norm_mlp_fp8(**case)
        want, want_sum = _reference(case)
        _assert_close(got, want, 1e-5)
        assert torch.equal(got_sum.cpu(), want_sum)


def _mlp_layers(static: bool, method=Fp8LinearMethod) -> tuple[Linear, Linear]:
    gen = torch.Generator().manual_seed(11)
    layers = []
    for k, n, sizes in ((HIDDEN, 2 * INTER, [INTER, INTER]), (INTER, HIDDEN, None)):
        scale = 0.02 if static else None
        m = method("static" if static else "dynamic", scale)
        layer = Linear(k, n, method=m, dtype=torch.float32, output_sizes=sizes).to(DEVICE)
        layer.weight_loader(layer.weight, None, torch.randn(n, k, generator=gen) * 0.05)
        m.process_weights_after_loading(layer)
        layers.append(layer)
    return layers[0], layers[1]


@pytest.fixture
def one_kernel_switch(monkeypatch: pytest.MonkeyPatch):
    """KILN_MLP_ONE_KERNEL=1 for the test (envs() read again on both sides)."""
    monkeypatch.setenv("KILN_MLP_ONE_KERNEL", "1")
    envs.cache_clear()
    yield
    monkeypatch.delenv("KILN_MLP_ONE_KERNEL")
    envs.cache_clear()


@pytest.mark.parametrize("ops", [reference, triton_ops], ids=["reference", "triton"])
def test_the_switch_runs_the_decoders_block_as_one_op(one_kernel_switch, monkeypatch, ops) -> None:
    """Linear.silu_mul_into with the switch on takes the one op for static FP8 gate_up and down
    (on the Triton side one kernel: the two-kernel path fails if called) and gives what the
    block gave as two ops; dynamic FP8 and outlier columns keep their own paths."""
    gate_up, down = _mlp_layers(static=True)
    gen = torch.Generator().manual_seed(12)
    x, residual = (torch.randn(1, HIDDEN, generator=gen).to(DEVICE) for _ in range(2))
    norm = torch.ones(HIDDEN, device=DEVICE)
    assert envs().mlp_one_kernel
    two_ops = gate_up.method.add_rms_norm_silu_mul_fp8  # what the block runs without the switch
    want, want_sum = _two_op_block(gate_up, down, ops, x, residual, norm)
    assert gate_up.method.add_rms_norm_mlp(gate_up, ops, down, x, residual, norm, EPS) is not None
    if ops is triton_ops:
        _no_two_kernel_path(monkeypatch)
    monkeypatch.setattr(gate_up.method, "add_rms_norm_silu_mul_fp8", _fails)
    got, got_sum = gate_up.silu_mul_into(ops, down, x, residual, norm, EPS)
    monkeypatch.setattr(gate_up.method, "add_rms_norm_silu_mul_fp8", two_ops)
    if ops is reference:
        assert torch.equal(got, want)
    else:
        _assert_close(got, want, 1e-5)
    assert torch.equal(got_sum, want_sum)
    for other in (_mlp_layers(static=False), _mlp_layers(True, _outlier_method)):
        up, dn = other
        assert up.method.add_rms_norm_mlp(up, ops, dn, x, residual, norm, EPS) is None


def _fails(*args: object, **kwargs: object) -> None:
    raise AssertionError("the block ran as two ops")


def _outlier_method(scheme: str, scale: float | None) -> OutlierColumnsFp8LinearMethod:
    return OutlierColumnsFp8LinearMethod(scheme, scale, channels=list(range(0, 32, 2)))


def _two_op_block(gate_up, down, ops, x, residual, norm) -> tuple[torch.Tensor, torch.Tensor]:
    """The block as it runs without the switch."""
    into = down.method.fp8_input(down)
    act, scale, summed = gate_up.method.add_rms_norm_silu_mul_fp8(
        gate_up, ops, x, residual, norm, EPS, into
    )
    if scale is None:
        return down(ops, act), summed
    return down.method.apply_fp8(down, ops, act, scale, x.dtype), summed


def test_the_switch_is_off_by_default() -> None:
    gate_up, down = _mlp_layers(static=True)
    x = torch.randn(1, HIDDEN, device=DEVICE)
    norm = torch.ones(HIDDEN, device=DEVICE)
    assert gate_up.method.add_rms_norm_mlp(gate_up, reference, down, x, x, norm, EPS) is None


@on_gpu
def test_one_row_block_llama8b_in_a_cuda_graph() -> None:
    """Llama-3.1-8B's block (hidden 4096, intermediate 14336) at the GPU's tiles, bf16, against
    the fp32 reference; then replayed in a CUDA graph with new inputs."""
    block = _block(4096, 14336, torch.bfloat16, True, seed=3)
    block["down_input_scale"] = torch.tensor(0.004, device=DEVICE)
    want, _ = _reference(block)
    got, _ = triton_ops.add_rms_norm_mlp_fp8(**block)
    _assert_close(got, want, 2e-2)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, _ = triton_ops.add_rms_norm_mlp_fp8(**block)
    block["x"].copy_(torch.randn_like(block["x"]) * 3)
    graph.replay()
    torch.cuda.synchronize()
    want, _ = _reference(block)
    _assert_close(out, want, 2e-2)
    assert int(split_k.counters(DEVICE).abs().sum()) == 0


@on_gpu
def test_an_8b_static_fp8_engine_decodes_alike_with_the_switch(monkeypatch) -> None:
    """Batch-1 greedy decode of a dummy Llama-3.1-8B static-FP8 engine, CUDA graphs on, with
    KILN_MLP_ONE_KERNEL=1 against without: the same tokens' logprobs within the summation
    order's rounding (the one-kernel block's graphs capture and replay)."""
    from kiln import LLM, SamplingParams
    from tests.conftest import generated_logprob_gaps

    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=0)
    prompts = [[1, 450, 7483, 310, 3444, 338], [1, 22172, 3186, 29892, 278]]
    runs = []
    for switch in ("0", "1"):
        monkeypatch.setenv("KILN_MLP_ONE_KERNEL", switch)
        envs.cache_clear()
        llm = LLM("llama-3.1-8b", load_format="dummy", quantization="fp8", device="cuda",
                  max_model_len=256, max_num_seqs=1, kv_cache_memory_gb=1.0)  # fmt: skip
        runs.append(llm.generate(prompts, params))
        llm.shutdown()
        del llm
        torch.cuda.empty_cache()
    envs.cache_clear()
    gaps = generated_logprob_gaps(runs[1], runs[0])
    assert len(gaps) >= len(prompts) * 4 and float(gaps.mean()) < 0.05, gaps
