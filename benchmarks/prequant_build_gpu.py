"""`kiln build` from pre-quantized FP8 checkpoints on a GPU (issue 13); expectations in
benchmarks/prequant_build_expected.md.

1. The test checkpoints the real tools made (tests/data/fp8_checkpoints: llm-compressor's
   FP8_DYNAMIC, ModelOpt's FP8 with KV scales), built on the GPU in bf16 with the accuracy check
   on: its report (engine vs the checkpoint loaded directly: same arithmetic), the kernel tiles
   the manifest records for this GPU class, and the engine's greedy tokens and log-probabilities
   against the checkpoint loaded directly. ModelOpt also with --kv-cache-dtype fp8 (its k/v
   scales folded into the weights).
2. Build time of an 8B-shaped compressed-tensors checkpoint (Llama-3.1-8B, per-channel float8
   weights of dummy bf16 weights quantized per row as llm-compressor's FP8_DYNAMIC does, its
   quantization_config copied from the real tool's test checkpoint, lm_head in bf16), in a cold
   `kiln build` process with an empty Triton cache (the kernel warm-up on, as by default), and
   what the command prints (the kernel tile table). No real 8B FP8 checkpoint can be downloaded
   on the H200 host.

Usage: python benchmarks/prequant_build_gpu.py --work /tmp/w --output-json F [--skip-8b]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
from safetensors.torch import save_file

from kiln.models.config import PRESETS

DATA = Path(__file__).resolve().parents[1] / "tests" / "data" / "fp8_checkpoints"
PROMPTS = [[1, 5, 9, 33, 7, 100], [1, 200, 3, 17]]
# The script is for the GPU; on the CPU it runs as a smoke test (--preset smollm2-135m).
_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _generate(llm, params) -> list:
    """Generate, then give the GPU memory back for the next engine (each sizes its KV cache
    from what is free)."""
    import gc

    try:
        return llm.generate(PROMPTS, params)
    finally:
        llm.shutdown()
        del llm
        gc.collect()
        if _DEVICE == "cuda":
            torch.cuda.empty_cache()


def tiny_builds(work: str) -> dict:
    from kiln import LLM, SamplingParams
    from kiln.builder.build import BuildOptions, build_engine
    from kiln.checkpoint.engine_dir import read_manifest

    greedy = SamplingParams(max_tokens=8, temperature=0.0, logprobs=1, ignore_eos=True)
    args = dict(gpu_memory_utilization=0.3, max_num_seqs=4)
    results = {}
    for name, kv in (("compressed_tensors", "auto"), ("modelopt", "auto"), ("modelopt", "fp8")):
        key = f"{name}_kv_{kv}"
        try:
            out = os.path.join(work, key)
            shutil.rmtree(out, ignore_errors=True)
            t0 = time.perf_counter()
            options = BuildOptions(kv_cache_dtype=kv, warm_kernels=False)
            build_engine(str(DATA / name), out, options, None)
            seconds = time.perf_counter() - t0
            manifest = read_manifest(out)
            want = _generate(LLM(str(DATA / name), kv_cache_dtype=kv, **args), greedy)
            got = _generate(LLM(out, **args), greedy)
            results[key] = {
                "build_seconds": seconds,
                "accuracy": manifest["accuracy"],
                "kv_scales_in_weights": manifest.get("kv_scales_in_weights"),
                "quantization_source": manifest.get("quantization_source"),
                "gpu_class": manifest["gpu_class"],
                "kernel_tiles_gpu_class": (manifest.get("kernel_tiles") or {}).get("gpu_class"),
                **_agreement(want, got),
            }
        except Exception:  # one failing build must not hide the others' numbers
            results[key] = {"error": traceback.format_exc()[-3000:]}
        print(key, json.dumps(results[key], default=str)[:1500], flush=True)
    return results


def _agreement(want: list, got: list) -> dict:
    """Whether two runs' greedy tokens are equal, and their largest log-probability difference
    over the tokens both scored."""
    diffs = [
        abs(a.logprobs[i][t].logprob - b.logprobs[i][t].logprob)
        for wa, ga in zip(want, got)
        for a, b in [(wa.outputs[0], ga.outputs[0])]
        for i, t in enumerate(a.token_ids)
        if t in b.logprobs[i]
    ]
    return {
        "greedy_tokens_equal": all(
            list(a.outputs[0].token_ids) == list(b.outputs[0].token_ids) for a, b in zip(want, got)
        ),
        "max_abs_greedy_logprob_diff": max(diffs, default=None),
    }


def compare(src: str, engine: str) -> dict:
    """Greedy tokens and log-probabilities of the engine against the checkpoint loaded directly,
    at the real shape (the GPU's kernels, split-K tiles included): the same arithmetic."""
    from kiln import LLM, SamplingParams

    greedy = SamplingParams(max_tokens=16, temperature=0.0, logprobs=1, ignore_eos=True)
    args = dict(gpu_memory_utilization=0.4, max_model_len=1024, max_num_seqs=4)
    t0 = time.perf_counter()
    want = _generate(LLM(src, **args), greedy)
    direct_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    got = _generate(LLM(engine, **args), greedy)
    engine_s = time.perf_counter() - t0
    return {
        **_agreement(want, got),
        "direct_load_and_generate_s": direct_s,
        "engine_load_and_generate_s": engine_s,
    }


def write_compressed_tensors_8b(path: str, preset: str) -> float:
    """An 8B-shaped checkpoint in the layout llm-compressor's FP8_DYNAMIC writes (the tiny test
    checkpoint's): float8 weights, bf16 [rows, 1] weight scales, bf16 norms and embeddings."""
    from kiln.kernels.reference import quantize_fp8

    t0 = time.time()
    os.makedirs(path, exist_ok=True)
    hf = dict(PRESETS[preset])
    hf.setdefault("torch_dtype", "bfloat16")
    with open(DATA / "compressed_tensors" / "config.json") as f:
        hf["quantization_config"] = json.load(f)["quantization_config"]  # the real tool's
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf, f)
    hidden, inter = hf["hidden_size"], hf["intermediate_size"]
    heads, kv_heads = hf["num_attention_heads"], hf["num_key_value_heads"]
    head_dim = hf.get("head_dim") or hidden // heads
    gen = torch.Generator(device=_DEVICE).manual_seed(0)

    def draw(*shape: int) -> torch.Tensor:
        t = torch.empty(shape, device=_DEVICE, dtype=torch.bfloat16)
        return t.normal_(0.0, 0.02, generator=gen)

    index: dict[str, str] = {}

    def save(tensors: dict[str, torch.Tensor], name: str) -> None:
        tensors = {k: v.cpu().contiguous() for k, v in tensors.items()}
        save_file(tensors, os.path.join(path, name), metadata={"format": "pt"})
        index.update(dict.fromkeys(tensors, name))

    vocab = hf["vocab_size"]
    ones = torch.ones(hidden, dtype=torch.bfloat16)
    save(
        {
            "model.embed_tokens.weight": draw(vocab, hidden),
            "lm_head.weight": draw(vocab, hidden),
            "model.norm.weight": ones,
        },
        "model-embed.safetensors",
    )
    shapes = {
        "self_attn.q_proj": (heads * head_dim, hidden),
        "self_attn.k_proj": (kv_heads * head_dim, hidden),
        "self_attn.v_proj": (kv_heads * head_dim, hidden),
        "self_attn.o_proj": (hidden, heads * head_dim),
        "mlp.gate_proj": (inter, hidden),
        "mlp.up_proj": (inter, hidden),
        "mlp.down_proj": (hidden, inter),
    }
    for i in range(hf["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors = {
            p + n: ones.clone()
            for n in ("input_layernorm.weight", "post_attention_layernorm.weight")
        }
        for proj, shape in shapes.items():
            weight, scale = quantize_fp8(draw(*shape), None)
            tensors[p + proj + ".weight"] = weight
            tensors[p + proj + ".weight_scale"] = scale.to(torch.bfloat16)
        save(tensors, f"model-layer{i:03d}.safetensors")
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": index}, f)
    return time.time() - t0


def build_8b(work: str, preset: str) -> dict:
    src, engine = os.path.join(work, "ct-8b"), os.path.join(work, "ct-8b.engine")
    shutil.rmtree(src, ignore_errors=True)
    shutil.rmtree(engine, ignore_errors=True)
    write_s = write_compressed_tensors_8b(src, preset)
    if _DEVICE == "cuda":
        torch.cuda.empty_cache()
    with tempfile.TemporaryDirectory(prefix="kiln-triton-") as triton_cache:
        env = {**os.environ, "TRITON_CACHE_DIR": triton_cache}
        cmd = [sys.executable, "-m", "kiln.cli.main", "build", src, "-o", engine]
        cmd += ["--no-accuracy-check"]  # random weights: no perplexity worth checking
        t0 = time.time()
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        wall = time.time() - t0
    result = {"write_checkpoint_s": write_s, "build_wall_s": wall, "returncode": proc.returncode,
              "stdout": proc.stdout[-6000:], "stderr": proc.stderr[-3000:]}  # fmt: skip
    if proc.returncode == 0:
        with open(os.path.join(engine, "kiln_engine.json")) as f:
            manifest = json.load(f)
        result.update(
            build_seconds=manifest["build_seconds"],
            quantization=manifest["quantization"],
            kernel_tiles=manifest["kernel_tiles"],
            engine_bytes=sum(e["size"] for e in manifest["files"].values()),
        )
        result["engine_vs_checkpoint"] = compare(src, engine)
    print("8b", json.dumps({k: v for k, v in result.items() if k != "kernel_tiles"})[:3000])
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", required=True, help="scratch folder for checkpoints and engines")
    ap.add_argument("--preset", default="llama-3.1-8b")
    ap.add_argument("--output-json", required=True)
    ap.add_argument("--skip-8b", action="store_true")
    args = ap.parse_args()
    os.makedirs(args.work, exist_ok=True)
    gpu = torch.cuda.get_device_name() if _DEVICE == "cuda" else None
    results = {"gpu": gpu, "tiny": tiny_builds(args.work)}
    if not args.skip_8b:
        try:
            results["build_8b"] = build_8b(args.work, args.preset)
        except Exception:
            results["build_8b"] = {"error": traceback.format_exc()[-3000:]}
    with open(args.output_json, "w") as f:
        json.dump(results, f, indent=2, default=str)
    for scratch in ("ct-8b", "ct-8b.engine"):  # 8+ GB each
        shutil.rmtree(os.path.join(args.work, scratch), ignore_errors=True)


if __name__ == "__main__":
    main()
