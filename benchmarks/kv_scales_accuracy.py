"""Held-out perplexity of a model with its own cache dtype, an unscaled float8 KV cache, and a
float8 cache with per-layer scales calibrated as `kiln build --kv-cache-dtype fp8` does (the
same calibration text and held-out articles as the build's accuracy check). Speed is not
measured: the scales are folded into the weights, so a scaled cache runs the same kernels.

Usage: python benchmarks/kv_scales_accuracy.py [--model M] --out FILE
"""

from __future__ import annotations

import argparse
import json
import time

from kiln import LLM
from kiln.builder.accuracy import CALIBRATION_FILE, measure
from kiln.builder.quantize import calibrate
from kiln.quantization.kv_scales import fold_kv_scales


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    common = dict(max_model_len=args.max_model_len, enable_prefix_caching=False)
    results: dict[str, object] = {"model": args.model or "embedded SmolLM2-135M-Instruct (GGUF)"}
    for name, kv in (("model_dtype_cache", "auto"), ("fp8_unscaled", "fp8"), ("fp8_scaled", "fp8")):
        t0 = time.time()
        llm = LLM(args.model, kv_cache_dtype=kv, **common)
        if name == "fp8_scaled":
            with open(CALIBRATION_FILE, encoding="utf-8") as f:
                text = f.read(200_000)
            _, scales = calibrate(llm, text, input_scales=False, kv_scales=True)
            fold_kv_scales(llm.engine.executor.runner.model, scales)
            results["kv_scales"] = scales
        results[name] = {**measure(llm, args.max_model_len), "seconds": time.time() - t0}
        print(name, results[name], flush=True)
        llm.shutdown()
    base = results["model_dtype_cache"]["word_perplexity"]
    for name in ("fp8_unscaled", "fp8_scaled"):
        results[name]["word_perplexity_increase_pct"] = 100 * (
            results[name]["word_perplexity"] / base - 1
        )
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)
    print(json.dumps({k: v for k, v in results.items() if k != "kv_scales"}, indent=2))


if __name__ == "__main__":
    main()
