"""load_format="gguf-int": a GGUF file's 2- to 4-bit projections kept as INT4 W4A16 groups (of 32,
or 16 for Q2_K / Q3_K), its 5-, 6- and 8-bit ones (and fused layers mixing them with narrower
ones: llama.cpp's Q4_K_M) as INT8 W8A16 groups (kiln.checkpoint.gguf_int): the same weights as
the file's dequantization, bit for bit, so the same logprobs as loading it dequantized, in a
fraction of the bytes; a file with other projection types, or another source, is refused."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from kiln import LLM, SamplingParams
from kiln.checkpoint.gguf_int import TYPES, int_groups, projection_schemes, scheme_for
from kiln.checkpoint.gguf_loader import GGUFModel
from kiln.errors import ModelLoadError
from kiln.kernels import reference
from tests.checkpoint.test_loaders import _write_gguf, gguf_writer
from tests.conftest import assert_same_completions, tiny_model_config


def _integer_weights(model: GGUFModel) -> dict[str, torch.Tensor]:
    """Each projection's weight dequantized from its integer codes, scales (and mins), in the
    scheme its layer takes."""
    _, schemes = _schemes(model)
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in model.tensors(schemes):
        for suffix in ("_scales", "_zeros", ""):
            if name.endswith(suffix):
                parts.setdefault(name.removesuffix(suffix), {})[suffix] = tensor
                break
    weights = {}
    for name, p in parts.items():
        if "_scales" not in p:
            continue
        if p[""].dtype == torch.int32:
            assert schemes[name].startswith("int4-")
            weights[name] = reference.dequantize_int4(p[""], p["_scales"], p["_zeros"], True)
        else:
            assert p[""].dtype == torch.int8 and ("_zeros" in p) == schemes[name].endswith("min")
            weights[name] = reference.dequantize_w8(p[""], p["_scales"], p.get("_zeros"))
    return weights


def _schemes(model: GGUFModel) -> tuple[dict[str, str], dict[str, str]]:
    from kiln.models.llama import LAYER_TENSOR_MAP

    return projection_schemes(model.projection_types(), LAYER_TENSOR_MAP)


@pytest.mark.parametrize(
    ("qtype", "scheme"),
    [
        (GGMLQuantizationType.Q4_0, "int4-g32-min"),
        (GGMLQuantizationType.Q4_1, "int4-g32-min"),
        (GGMLQuantizationType.Q5_0, "int8-w8a16-g32"),
        (GGMLQuantizationType.Q5_1, "int8-w8a16-g32-min"),
        (GGMLQuantizationType.Q8_0, "int8-w8a16-g32"),
    ],
)
def test_integer_groups_are_the_files_dequantized_weights(tmp_path: Path, qtype, scheme) -> None:
    path = tmp_path / "m.gguf"
    _write_gguf(path, tiny_model_config(), qtype)
    model = GGUFModel(str(path))
    assert set(_schemes(model)[0].values()) == {scheme}
    dequantized = dict(model.tensors())
    weights = _integer_weights(model)
    assert len(weights) == 2 * 7  # q, k, v, o, gate, up, down of 2 layers
    for name, weight in weights.items():
        # q/k rows unpermuted alike (llama.cpp's rotary order), inputs 96 = 3 groups for down.
        assert torch.equal(weight, dequantized[name]), name


# A Llama whose rows are whole k-quant super-blocks of 256, with 8 layers for llama.cpp's rule.
K_CONFIG = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=8, head_dim=64)
_FP16_FIELDS = {  # ggml type -> byte offsets of its fp16 scale (and min) fields
    "Q2_K": (80, 82), "Q3_K": (108,), "Q4_0": (0,), "Q4_1": (0, 2), "Q4_K": (0, 2),
    "Q5_0": (0,), "Q5_1": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "Q8_0": (0,), "IQ4_NL": (0,),
    "IQ4_XS": (0,), "IQ3_S": (0,),
}  # fmt: skip
# ggml type -> (its scale d over 1e-4, its min field over d): values at about the 0.02 spread
# of a model's weights, centred near 0 (a K-quant's dmin against its unsigned codes).
_SPREAD = {"Q2_K": (17, 1.5), "Q3_K": (5, 0), "Q4_K": (1, 7.5), "Q5_0": (24, 0),
           "Q5_1": (24, -16), "Q5_K": (0.5, 15.5), "Q6_K": (1, 0), "Q8_0": (3, 0),
           "IQ4_NL": (3, 0), "IQ4_XS": (0.16, 0), "IQ3_S": (1, 0)}  # fmt: skip


def _random_blocks(qtype: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random but valid blocks [rows, row bytes] of `qtype`: random bytes with the fp16 scale
    (and min) fields set to finite values (_SPREAD; Q6_K's int8 sub-scales within +-8)."""
    if qtype == "F16":
        values = rng.normal(0.0, 0.02, (rows, cols)).astype(np.float16)
        return values.view(np.uint8).reshape(rows, -1)
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]
    blocks = rng.integers(0, 256, size=(rows * cols // block, size), dtype=np.uint8)
    if qtype == "Q6_K":
        blocks[:, 192:208] = rng.integers(-8, 9, (len(blocks), 16)).astype(np.int8).view(np.uint8)
    scale, min_over_d = _SPREAD[qtype]
    d = rng.uniform(0.6, 1.2, len(blocks)) * scale * 1e-4
    for at, field in zip(_FP16_FIELDS[qtype], (d, d * min_over_d), strict=False):
        blocks[:, at : at + 2] = field.astype(np.float16).view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


def use_more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's rule (llama-quant.cpp) for the layers whose attn_v and ffn_down Q4_K_M and
    Q5_K_M store in Q6_K: the first and last eighth, and every third one between."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def k_mix_types(ftype: str, layers: int, fallback: bool = False) -> dict[str, str]:
    """{gguf tensor name: ggml type} as llama.cpp's `ftype` chooses them (llama-quant.cpp's
    llama_tensor_get_type for a Llama): Q4_K_M / Q5_K_M Q6_K for attn_v and ffn_down of the
    use_more_bits layers, Q4_K / Q5_K elsewhere; Q3_K_M Q3_K, with attn_v in Q5_K on the first
    two layers and Q4_K on the rest, ffn_down Q5_K in the first 16th and Q4_K after, attn_output
    Q4_K; an IQ type, every projection in it; the output Q6_K. `fallback`: attn_q / attn_k /
    attn_output in Q5_0 and gate in Q5_1, the types llama.cpp falls back to where rows are no
    whole super-blocks (SmolLM2's 576)."""
    base = ftype if ftype.startswith("IQ") else ftype[:4]
    types = {"token_embd.weight": base, "output.weight": "Q6_K"}
    for i in range(layers):
        more = use_more_bits(i, layers)
        for name in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up",
                     "ffn_down"):  # fmt: skip
            qtype = "Q6_K" if more and name in ("attn_v", "ffn_down") else base
            if ftype.startswith("IQ"):  # every projection in it (here, not llama.cpp's rule)
                qtype = base
            if ftype == "Q3_K_M":
                down = "Q5_K" if i < layers // 16 else "Q4_K"
                qtype = {"attn_v": "Q5_K" if i < 2 else "Q4_K", "attn_output": "Q4_K",
                         "ffn_down": down}.get(name, base)  # fmt: skip
            if fallback and name in ("attn_q", "attn_k", "attn_output"):
                qtype = "Q5_0"
            if fallback and name == "ffn_gate":
                qtype = "Q5_1"
            types[f"blk.{i}.{name}.weight"] = qtype
    return types


def write_k_mix(path: Path, types: dict[str, str], seed: int = 0) -> None:
    """A tiny Llama (K_CONFIG) GGUF with each matrix in its type of `types`, random blocks."""
    config = tiny_model_config(**K_CONFIG)
    h, inter = config.hidden_size, config.intermediate_size
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * 64
    shapes = {"token_embd": (config.vocab_size, h), "output": (config.vocab_size, h),
              "attn_q": (q, h), "attn_k": (kv, h), "attn_v": (kv, h), "attn_output": (h, q),
              "ffn_gate": (inter, h), "ffn_up": (inter, h), "ffn_down": (h, inter)}  # fmt: skip
    rng = np.random.default_rng(seed)
    writer = gguf_writer(path, config)
    for name, qtype in types.items():
        rows, cols = shapes[name.split(".")[-2]]
        raw_type = GGMLQuantizationType[qtype]
        writer.add_tensor(name, _random_blocks(qtype, rows, cols, rng), raw_dtype=raw_type)
    writer.add_tensor("output_norm.weight", np.ones(h, np.float32))
    for i in range(config.num_hidden_layers):
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{i}.{norm}.weight", np.ones(h, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


I4, I4G16 = "int4-g32-min", "int4-g16-min"
G16, G16M, G32, G32M = ("int8-w8a16-g16", "int8-w8a16-g16-min", "int8-w8a16-g32",
                        "int8-w8a16-g32-min")  # fmt: skip
# (ftype, fallback, a use_more_bits layer (Q3_K_M: one of the first two)) -> its qkv_proj's,
# o_proj's, gate_up_proj's and down_proj's schemes: INT4 where every part has 4 bits or fewer,
# else INT8, in the smallest group (16 with a Q2_K / Q3_K / Q6_K part), with mins where a part
# has them (Q4_K, Q5_K, Q5_1).
K_MIX_SCHEMES = {
    ("Q4_K_M", False, False): (I4, I4, I4, I4),
    ("Q4_K_M", False, True): (G16M, I4, I4, G16),
    ("Q5_K_M", False, False): (G32M, G32M, G32M, G32M),
    ("Q5_K_M", False, True): (G16M, G32M, G32M, G16),
    ("Q4_K_M", True, False): (G32M, G32, G32M, I4),
    ("Q4_K_M", True, True): (G16, G32, G32M, G16),
    ("Q3_K_M", False, False): (I4G16, I4, I4G16, I4),
    ("Q3_K_M", False, True): (G16M, I4, I4G16, I4),
}


@pytest.mark.parametrize(("ftype", "fallback"), [("Q4_K_M", False), ("Q5_K_M", False),
                                                  ("Q4_K_M", True), ("Q3_K_M", False)])  # fmt: skip
def test_a_k_quant_mix_keeps_each_layers_values_in_its_scheme(
    tmp_path: Path, ftype: str, fallback: bool
) -> None:
    """llama.cpp's Q4_K_M, Q5_K_M and Q3_K_M (and Q4_K_M's 5-bit fallbacks): each layer on the
    scheme its parts' types need, every projection's values gguf's own, exactly."""
    path = tmp_path / "m.gguf"
    write_k_mix(path, k_mix_types(ftype, 8, fallback))
    model = GGUFModel(str(path))
    layers, _ = _schemes(model)
    for i in range(8):
        names = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
        got = tuple(layers[f"layers.{i}.{name}"] for name in names)
        flag = i < 2 if ftype == "Q3_K_M" else use_more_bits(i, 8)
        assert got == K_MIX_SCHEMES[ftype, fallback, flag], i
    dequantized = dict(model.tensors())
    weights = _integer_weights(model)
    assert len(weights) == 8 * 7
    for name, weight in weights.items():
        assert torch.equal(weight, dequantized[name]), name


def _tiny_llm_without_tokenizer(monkeypatch) -> None:
    from kiln.runtime import model_loader

    # The tiny files name no tokenizer model: run them on token ids alone.
    monkeypatch.setattr(GGUFModel, "tokenizer", lambda self: None)
    monkeypatch.setattr(model_loader, "from_transformers", lambda tokenizer: None)


@pytest.mark.parametrize(
    "qtype", [GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q5_1, GGMLQuantizationType.Q8_0]
)
def test_an_integer_gguf_engine_answers_as_the_dequantized_one(
    tmp_path: Path, qtype, monkeypatch
) -> None:
    _tiny_llm_without_tokenizer(monkeypatch)
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


def _bits(scheme: str) -> float:
    """Bits a weight of a scheme's layer: its code and its share of the fp32 scales (and
    mins) of its group."""
    group = int(scheme.split("-g")[1].split("-")[0])
    code = 4 if scheme.startswith("int4") else 8
    return code + 32 * (2 if scheme.endswith("min") else 1) / group


@pytest.mark.parametrize(
    ("ftype", "average_bits"), [("Q4_K_M", 7.11), ("Q3_K_M", 7.56), ("IQ4_XS", 9.0)]
)
def test_a_k_quant_engine_answers_as_the_dequantized_one_in_its_bytes(
    tmp_path: Path, monkeypatch, ftype: str, average_bits: float
) -> None:
    """llama.cpp's Q4_K_M and Q3_K_M mixes and IQ4_XS on the integer methods: the dequantized
    model's greedy tokens and logprobs; each projection in its scheme's bytes (Q4_K_M: INT4 at 6
    bits a weight, the more-bits layers' qkv_proj at 12 and down_proj at 10, the file's 5.0;
    Q3_K_M: INT4 in groups of 16 at 8 bits where Q3_K parts are, the file's 4.0; IQ4_XS: INT8 at
    9, the file's 4.25; bf16's 16). The fp32 scales and mins cost more than the codes save."""
    _tiny_llm_without_tokenizer(monkeypatch)
    path = str(tmp_path / "m.gguf")
    write_k_mix(Path(path), k_mix_types(ftype, 8))
    args = dict(max_num_seqs=4, kv_cache_memory_gb=0.05)
    greedy = SamplingParams(max_tokens=8, temperature=0.0, logprobs=0, ignore_eos=True)
    prompts = [[1, 5, 9, 33, 7], [1, 20, 3, 17]]
    want = LLM(path, **args).generate(prompts, greedy)
    llm = LLM(path, load_format="gguf-int", **args)
    model = llm.engine.executor.runner.model
    assert model.layers[0].self_attn.qkv_proj.weight.dtype == torch.int8  # v in Q6_K / Q5_K
    int4 = not ftype.startswith("IQ")  # IQ4_XS's table values are int8 codes
    assert model.layers[2].self_attn.qkv_proj.weight.dtype == (torch.int32 if int4 else torch.int8)
    assert_same_completions(llm.generate(prompts, greedy), want, atol=1e-5)
    layers, _ = _schemes(GGUFModel(path))
    weights = bits = 0.0
    for name, scheme in layers.items():
        layer = model.get_submodule(name)
        n = layer.in_features * layer.out_features
        stored = sum(p.numel() * p.element_size() for k, p in layer.named_parameters()
                     if k != "weight_g_idx")  # fmt: skip
        assert stored * 8 == n * _bits(scheme), name
        weights, bits = weights + n, bits + n * _bits(scheme)
    assert abs(bits / weights - average_bits) < 0.05, bits / weights


@pytest.mark.parametrize("qtype", ["F16", "IQ3_S"])
def test_other_projection_types_are_refused_by_name(tmp_path: Path, qtype: str) -> None:
    types = k_mix_types("Q4_K_M", 8)
    types["blk.2.attn_k.weight"] = qtype
    path = tmp_path / "m.gguf"
    write_k_mix(path, types)
    with pytest.raises(ModelLoadError, match=rf"{qtype} projections \(e\.g\. model\.layers\.2\."
                       r"self_attn\.k_proj\.weight\) map to no integer method"):  # fmt: skip
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


@pytest.mark.parametrize("qtype", list(TYPES))
def test_each_types_blocks_are_the_files_values_in_every_scheme_that_holds_them(qtype) -> None:
    """No quantizer for the k-quants in the gguf package: random blocks (finite fp16 scales and
    mins of either sign, every sub-scale, every code bit) against gguf.quants' dequantization,
    in the type's own scheme and in the wider ones a fused layer may give it."""
    from gguf.quants import dequantize

    n, k = 6, 512  # 2 super-blocks a row
    rng = np.random.default_rng(0)
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]
    raw = rng.integers(0, 256, size=(n * k // block, size), dtype=np.uint8)
    for at in _FP16_FIELDS[qtype]:
        d = rng.uniform(-1e-2, 1e-2, len(raw)).astype(np.float16)
        raw[:, at : at + 2] = d.view(np.uint8).reshape(-1, 2)
    want = torch.from_numpy(dequantize(raw.reshape(n, -1), GGMLQuantizationType[qtype])).float()
    wider = ([qtype, "Q2_K"], [qtype, "Q6_K"], [qtype, "Q4_K", "Q6_K"])
    for scheme in {scheme_for([qtype]), *(scheme_for(types) for types in wider)}:
        parts = dict(int_groups(raw.reshape(-1), qtype, (n, k), scheme))
        if scheme.startswith("int4"):
            got = reference.dequantize_int4(parts[""], parts["_scales"], parts["_zeros"], True)
        else:
            got = reference.dequantize_w8(parts[""], parts["_scales"], parts.get("_zeros"))
        assert got.shape == want.shape and torch.equal(got, want), scheme


@pytest.mark.parametrize("scheme", ["int4-g32-min", "int8-w8a16-g16-min"])
def test_scaling_output_rows_scales_the_mins_too(scheme: str) -> None:
    """An int8 / float8 KV cache's scales fold into qkv_proj's rows (kiln.models.kv_scales):
    a GGUF group's w = code * scale + min scales through its scale and its min alike."""
    from kiln.layers.linear import Linear
    from kiln.layers.quantization import linear_method_factory

    layer = Linear(64, 8, method=linear_method_factory(scheme)("layers.0.self_attn.qkv_proj"))
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (8, 64), generator=gen)
    groups = layer.weight_scales.shape[1]
    layer.weight_scales.copy_(torch.rand(8, groups, generator=gen) * 0.01)
    layer.weight_zeros.copy_(-torch.rand(8, groups, generator=gen) * 0.05)
    int4 = scheme.startswith("int4")
    layer.weight.copy_(reference.pack_int4(codes) if int4 else codes.to(torch.int8))
    x = torch.randn(3, 64, generator=gen)
    want = layer.method.apply(layer, reference, x)
    want[:, 2:5] *= 0.25
    layer.scale_output_rows(slice(2, 5), 0.25)
    torch.testing.assert_close(layer.method.apply(layer, reference, x), want)


@pytest.mark.parametrize("ftype", ["Q4_K_M", "Q3_K_M"])
def test_each_k_mix_projection_through_triton_equals_the_twin(
    tmp_path: Path, monkeypatch, ftype: str
) -> None:
    """The GPU path of a mixed file's layers (TRITON_INTERPRET=1 without a GPU): INT4 in groups
    of 32 and 16, INT8 in groups of 16 with and without mins, at decode's and prefill's rows."""
    pytest.importorskip("triton", reason="triton is not installed (pip install kiln[triton])")
    from kiln.config import EngineConfig
    from kiln.kernels import triton as triton_ops
    from kiln.runtime.model_loader import load_model

    _tiny_llm_without_tokenizer(monkeypatch)
    path = tmp_path / "m.gguf"
    write_k_mix(path, k_mix_types(ftype, 8))
    config = EngineConfig(model=str(path), load_format="gguf-int")
    model = load_model(config, torch.device("cpu"), torch.float32).model
    gen = torch.Generator().manual_seed(0)
    layer = model.layers[0]  # a more-bits layer (Q3_K_M: with a Q5_K attn_v)
    seen = set()
    for proj in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                 layer.mlp.down_proj):  # fmt: skip
        seen.add((type(proj.method).__name__, proj.weight_scales.shape[1]))
        for rows in (2, 20):
            x = torch.randn(rows, proj.in_features, generator=gen) * 0.5
            got = proj.method.apply(proj, triton_ops, x)
            want = proj.method.apply(proj, reference, x)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert len(seen) == 3, seen  # INT8 g16 (with mins), INT4 g32, and INT8 g16 / INT4 g16
