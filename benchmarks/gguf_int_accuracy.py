"""load_format="gguf-int" on a real model in llama.cpp's Q4_K_M layout: the embedded SmolLM2
(Q4_1) requantized as Q4_K_M lays a Llama out (llama-quant.cpp's llama_tensor_get_type: Q6_K for
attn_v / ffn_down of the use_more_bits layers and the tied embedding, Q4_K elsewhere, and its
fallbacks Q5_0 / Q8_0 for rows that are not whole 256-blocks: SmolLM2's 576), then held-out
perplexity and the projections' bits a weight, dequantized and on the integer methods.

    python benchmarks/gguf_int_accuracy.py --out gguf_int_accuracy.json

The Q4_K / Q6_K quantizers here are plain (a group's range, no search) and start from Q4_1's
values: the requantized file's perplexity says what this file costs, not what llama.cpp's
quantizer would; the comparison is the integer methods against the same file dequantized,
which kiln.checkpoint.gguf_int makes bit-exact. Data: ../shared/data (WikiText-2 valid).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import gguf
import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from kiln import LLM, SamplingParams
from kiln.builder.accuracy import HELD_OUT_FILE, wikitext_articles
from kiln.checkpoint.default_model import default_model_path
from kiln.eval.perplexity import rolling_perplexity

FALLBACK = {"Q4_K": "Q5_0", "Q6_K": "Q8_0"}  # llama.cpp's, for rows of no whole 256-blocks


def _divide(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.divide(a, b, out=np.zeros_like(a), where=b != 0)


def q4_k(x: np.ndarray) -> np.ndarray:
    """[rows, cols] -> Q4_K blocks [rows, cols / 256 * 144]: each group of 32 its range over 15
    codes, its 6-bit scale and min against the super-block's fp16 d and dmin."""
    b = x.reshape(-1, 8, 32).astype(np.float32)
    scale, mins = (b.max(-1) - np.minimum(b.min(-1), 0)) / 15, -np.minimum(b.min(-1), 0)
    d, dmin = (scale.max(-1) / 63).astype(np.float16), (mins.max(-1) / 63).astype(np.float16)
    sc = np.clip(np.round(_divide(scale, d.astype(np.float32)[:, None])), 0, 63)
    m = np.clip(np.round(_divide(mins, dmin.astype(np.float32)[:, None])), 0, 63)
    step = (d.astype(np.float32)[:, None] * sc)[..., None]
    shifted = b + (dmin.astype(np.float32)[:, None] * m)[..., None]
    q = np.clip(np.round(_divide(shifted, np.broadcast_to(step, b.shape))), 0, 15).astype(np.uint8)
    sc8, m8 = sc.astype(np.uint8), m.astype(np.uint8)
    packed = np.zeros((len(b), 12), np.uint8)  # gguf.quants.Q4_K.get_scale_min's inverse
    for j in range(4):
        packed[:, j] = sc8[:, j] | ((sc8[:, j + 4] >> 4) << 6)
        packed[:, j + 4] = m8[:, j] | ((m8[:, j + 4] >> 4) << 6)
        packed[:, j + 8] = (sc8[:, j + 4] & 0x0F) | ((m8[:, j + 4] & 0x0F) << 4)
    runs = q.reshape(-1, 4, 64)  # a run's 32 bytes: group 2j in the low nibbles, 2j + 1 high
    qs = (runs[:, :, :32] | (runs[:, :, 32:] << 4)).reshape(-1, 128)
    halves = [t.view(np.uint8).reshape(-1, 2) for t in (d, dmin)]
    return np.concatenate([*halves, packed, qs], 1).reshape(len(x), -1)


def q6_k(x: np.ndarray) -> np.ndarray:
    """[rows, cols] -> Q6_K blocks [rows, cols / 256 * 210]: each group of 16 its largest
    magnitude at code -32, its int8 scale against the super-block's fp16 d."""
    b = x.reshape(-1, 16, 16).astype(np.float32)
    peak = np.take_along_axis(b, np.abs(b).argmax(-1)[..., None], -1)[..., 0]
    scale = -peak / 32
    d = (np.abs(scale).max(-1) / 127).astype(np.float16)
    sc = np.clip(np.round(_divide(scale, d.astype(np.float32)[:, None])), -128, 127)
    step = np.broadcast_to((d.astype(np.float32)[:, None] * sc)[..., None], b.shape)
    q = (np.clip(np.round(_divide(b, step)), -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 128)
    ql = (q[:, :, :64] & 0x0F) | ((q[:, :, 64:] & 0x0F) << 4)
    high = (q >> 4) & 3
    qh = high[:, :, :32] | (high[:, :, 32:64] << 2) | (high[:, :, 64:96] << 4)
    qh |= high[:, :, 96:] << 6
    scales = sc.astype(np.int8).view(np.uint8)
    parts = [ql.reshape(-1, 128), qh.reshape(-1, 64), scales, d.view(np.uint8).reshape(-1, 2)]
    return np.concatenate(parts, 1).reshape(len(x), -1)


def use_more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's layers whose attn_v and ffn_down Q4_K_M keeps in Q6_K."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def requantize(src: str, dst: str) -> dict[str, int]:
    """`src`'s tensors dequantized and written to `dst` in Q4_K_M's types; {type: tensors}."""
    reader = gguf.GGUFReader(src)
    arch = str(reader.fields["general.architecture"].contents())
    layers = int(reader.fields[f"{arch}.block_count"].contents())
    writer = gguf.GGUFWriter(dst, arch)
    for field in reader.fields.values():
        if field.name == "general.architecture" or field.name.startswith("GGUF."):
            continue
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub_type)
    counts: dict[str, int] = {}
    for tensor in reader.tensors:
        x = dequantize(tensor.data, tensor.tensor_type)
        if x.ndim == 1:
            writer.add_tensor(tensor.name, np.asarray(x, np.float32))
            continue
        parts = tensor.name.split(".")  # blk.<layer>.<kind>.weight, or token_embd.weight
        more = parts[0] == "blk" and parts[2] in ("attn_v", "ffn_down")
        more = more and use_more_bits(int(parts[1]), layers)
        qtype = "Q6_K" if tensor.name == "token_embd.weight" or more else "Q4_K"
        if x.shape[-1] % 256:
            qtype = FALLBACK[qtype]
        qt = GGMLQuantizationType[qtype]
        data = q4_k(x) if qtype == "Q4_K" else q6_k(x) if qtype == "Q6_K" else quantize(x, qt)
        writer.add_tensor(tensor.name, data, raw_dtype=qt)
        counts[qtype] = counts.get(qtype, 0) + 1
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return counts


def projection_bits(llm: LLM) -> float:
    """The decoder projections' stored bits per weight (codes, scales, mins)."""
    model = llm.engine.executor.runner.model
    stored = sum(
        p.numel() * p.element_size()
        for name, p in model.named_parameters()
        if "_proj." in name and not name.endswith("g_idx")
    )
    projections = [m for name, m in model.named_modules() if name.endswith("_proj")]
    weights = sum(m.in_features * m.out_features for m in projections)
    return 8 * stored / weights


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--articles", type=int, default=3)
    p.add_argument("--window", type=int, default=1024)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    source = default_model_path()
    documents = wikitext_articles(HELD_OUT_FILE, args.articles)
    prompts = ["The history of the river begins in the mountains", "def fibonacci(n):"]
    engine = dict(max_num_seqs=4, kv_cache_memory_gb=0.2, max_model_len=2 * args.window)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "q4_k_m.gguf")
        report: dict = {"types": requantize(source, path), "runs": {}}
        logprobs = {}
        for label, model, load_format in (
            ("source_q4_1", source, "auto"),
            ("q4_k_m_dequantized", path, "auto"),
            ("q4_k_m_gguf_int", path, "gguf-int"),
        ):
            llm = LLM(model, load_format=load_format, **engine)
            start = time.perf_counter()
            ppl = rolling_perplexity(llm, documents, max_length=args.window)
            outs = llm.generate(prompts, SamplingParams(max_tokens=1, prompt_logprobs=0))
            logprobs[label] = [
                o.prompt_logprobs[i][o.prompt_token_ids[i]].logprob
                for o in outs
                for i in range(1, len(o.prompt_token_ids))
            ]
            report["runs"][label] = {
                "word_perplexity": ppl.word_perplexity,
                "token_perplexity": ppl.token_perplexity,
                "projection_bits_per_weight": projection_bits(llm),
                "seconds": time.perf_counter() - start,
            }
            print(label, report["runs"][label], flush=True)
            llm.shutdown()
    pairs = zip(logprobs["q4_k_m_gguf_int"], logprobs["q4_k_m_dequantized"], strict=True)
    report["max_prompt_logprob_gap"] = max(abs(a - b) for a, b in pairs)
    print(json.dumps(report, indent=1))
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
