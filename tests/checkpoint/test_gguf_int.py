"""load_format="gguf-int": a GGUF file's Q4_0 / Q4_1 projections kept as INT4 W4A16 groups of
32, Q8_0 ones as INT8 W8A16 groups (kiln.checkpoint.gguf_int): the same weights as the file's
dequantization, bit for bit, so the same logprobs as loading it dequantized, in a fraction of
the bytes; a file with other projection types, or another source, is refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType

from kiln import LLM, SamplingParams
from kiln.checkpoint.gguf_loader import GGUFModel
from kiln.errors import ModelLoadError
from kiln.kernels import reference
from tests.checkpoint.test_loaders import _write_gguf
from tests.conftest import assert_same_completions, tiny_model_config


def _integer_weights(model: GGUFModel) -> dict[str, torch.Tensor]:
    """Each projection's weight dequantized from its integer codes, scales (and mins)."""
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in model.tensors(integer=True):
        for suffix in ("_scales", "_zeros", ""):
            if name.endswith(suffix):
                parts.setdefault(name.removesuffix(suffix), {})[suffix] = tensor
                break
    weights = {}
    for name, p in parts.items():
        if "_scales" not in p:
            continue
        if "_zeros" in p:
            weights[name] = reference.dequantize_int4(p[""], p["_scales"], p["_zeros"], True)
        else:
            assert p[""].dtype == torch.int8
            weights[name] = reference.dequantize_w8(p[""], p["_scales"])
    return weights


@pytest.mark.parametrize(
    ("qtype", "scheme"),
    [
        (GGMLQuantizationType.Q4_0, "int4-g32-min"),
        (GGMLQuantizationType.Q4_1, "int4-g32-min"),
        (GGMLQuantizationType.Q8_0, "int8-w8a16-g32"),
    ],
)
def test_integer_groups_are_the_files_dequantized_weights(tmp_path: Path, qtype, scheme) -> None:
    path = tmp_path / "m.gguf"
    _write_gguf(path, tiny_model_config(), qtype)
    model = GGUFModel(str(path))
    assert model.int_scheme() == scheme
    dequantized = dict(model.tensors())
    weights = _integer_weights(model)
    assert len(weights) == 2 * 7  # q, k, v, o, gate, up, down of 2 layers
    for name, weight in weights.items():
        # q/k rows unpermuted alike (llama.cpp's rotary order), inputs 96 = 3 groups for down.
        assert torch.equal(weight, dequantized[name]), name


@pytest.mark.parametrize("qtype", [GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0])
def test_an_integer_gguf_engine_answers_as_the_dequantized_one(
    tmp_path: Path, qtype, monkeypatch
) -> None:
    from kiln.runtime import model_loader

    # The tiny file names no tokenizer model: run it on token ids alone.
    monkeypatch.setattr(GGUFModel, "tokenizer", lambda self: None)
    monkeypatch.setattr(model_loader, "from_transformers", lambda tokenizer: None)
    path = str(tmp_path / "m.gguf")
    _write_gguf(Path(path), tiny_model_config(), qtype)
    args = dict(max_num_seqs=4, kv_cache_memory_gb=0.05)
    greedy = SamplingParams(max_tokens=8, temperature=0.0, logprobs=0, ignore_eos=True)
    prompts = [[1, 5, 9, 33, 7], [1, 20, 3, 17]]
    want = LLM(path, **args).generate(prompts, greedy)
    llm = LLM(path, load_format="gguf-int", **args)
    qkv = llm.engine.executor.runner.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == (torch.int32 if qtype.name.startswith("Q4") else torch.int8)
    assert_same_completions(llm.generate(prompts, greedy), want, atol=1e-5)


def test_other_projection_types_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "f16.gguf"
    _write_gguf(path, tiny_model_config(), GGMLQuantizationType.F16)
    assert GGUFModel(str(path)).int_scheme() is None
    with pytest.raises(ModelLoadError, match="needs every decoder projection in Q4_0 / Q4_1"):
        LLM(str(path), load_format="gguf-int")
    with pytest.raises(ModelLoadError, match='"gguf-int" reads GGUF files'):
        LLM(str(tmp_path), load_format="gguf-int")


def test_integer_gguf_weights_under_tensor_parallelism_are_refused(
    tmp_path: Path, monkeypatch
) -> None:
    from kiln.config import EngineConfig
    from kiln.distributed.parallel_state import ParallelContext, RankLayout
    from kiln.runtime import model_loader
    from kiln.runtime.model_loader import load_model

    monkeypatch.setattr(GGUFModel, "tokenizer", lambda self: None)
    monkeypatch.setattr(model_loader, "from_transformers", lambda tokenizer: None)
    path = tmp_path / "m.gguf"
    _write_gguf(path, tiny_model_config(), GGMLQuantizationType.Q4_1)
    config = EngineConfig(model=str(path), load_format="gguf-int", tensor_parallel_size=2)
    ctx = ParallelContext(RankLayout(2, 1, 0), None, None, None)
    with pytest.raises(ModelLoadError, match="tensor_parallel_size=1 only"):
        load_model(config, torch.device("cpu"), torch.float32, ctx)


def test_smollm2_as_int4_answers_as_dequantized_in_a_fifth_of_the_bytes(
    smollm2_path, smollm2_llm
) -> None:
    """The embedded Q4_1 model: every projection INT4, prompt logprobs the dequantized model's
    (fp32 on the CPU: to the last digits its sums' order moves), its decoder projections'
    bytes 424.7 MB -> 80.0 MB."""
    llm = LLM(smollm2_path, load_format="gguf-int", max_num_seqs=4, kv_cache_memory_gb=0.1)
    model = llm.engine.executor.runner.model
    assert model.layers[0].self_attn.qkv_proj.weight.dtype == torch.int32

    def projection_bytes(m) -> int:
        return sum(p.numel() * p.element_size() for n, p in m.named_parameters() if "_proj." in n)

    ours, theirs = (
        projection_bytes(model),
        projection_bytes(smollm2_llm.engine.executor.runner.model),
    )
    assert ours * 5 < theirs, (ours, theirs)
    prompts = ["The history of the river begins in the mountains", "def fibonacci(n):"]
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    got, want = llm.generate(prompts, params), smollm2_llm.generate(prompts, params)
    for a, b in zip(got, want, strict=True):
        ids = a.prompt_token_ids
        gaps = [
            abs(a.prompt_logprobs[i][ids[i]].logprob - b.prompt_logprobs[i][ids[i]].logprob)
            for i in range(1, len(ids))
        ]
        assert max(gaps) < 1e-4, gaps  # the same weights; fp32 sums in another order


def test_q4_k_super_blocks_are_groups_of_32_with_the_files_values() -> None:
    """No quantizer for Q4_K in the gguf package: random super-blocks (finite fp16 d and dmin,
    every 6-bit scale and min, every nibble) against gguf.quants' dequantization."""
    import numpy as np
    from gguf.quants import dequantize

    from kiln.checkpoint.gguf_int import int_groups

    n, k = 6, 512  # 2 super-blocks a row
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, size=(n * k // 256, 144), dtype=np.uint8)
    raw[:, 0:2] = np.frombuffer(rng.uniform(1e-4, 1e-2, n * k // 256).astype(np.float16).tobytes(),
                                np.uint8).reshape(-1, 2)  # fmt: skip
    raw[:, 2:4] = np.frombuffer(rng.uniform(1e-4, 1e-2, n * k // 256).astype(np.float16).tobytes(),
                                np.uint8).reshape(-1, 2)  # fmt: skip
    want = torch.from_numpy(dequantize(raw.reshape(n, -1), GGMLQuantizationType.Q4_K))
    parts = dict(int_groups(raw.reshape(-1), "Q4_K", (n, k)))
    got = reference.dequantize_int4(parts[""], parts["_scales"], parts["_zeros"], True)
    assert got.shape == want.shape and torch.equal(got, want.float())
