"""What a one-byte KV cache costs in accuracy: the same model with kv_cache_dtype "auto" and "fp8",
"fp8" with prefill's Q.K products as float8 dots (the GPU backend's way, reference.uses_fp8_qk:
here the CPU reference rounds as the kernel does), and "int8" twice: with the scales measured
as the model loads (kiln.runtime.kv_calibration) and as an engine built with
`kiln build --kv-cache-dtype int8` (scales calibrated on ../shared/data).

Two measurements on real text, each run with both caches in one process:
- WikiText-2 (test split) perplexity from prompt logprobs over fixed token windows;
- greedy GSM8K answers (chat template): how many completions are token-for-token identical to
  the "auto" cache's, where they first differ, and the accuracy of the final number of each.

    python benchmarks/kv_cache_accuracy.py --out kv_fp8_accuracy.json

Defaults to the embedded SmolLM2-135M-Instruct (a real model; dummy weights have no meaningful
perplexity). Data: ../shared/data (WikiText-2 raw, GSM8K test).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

from kiln import LLM, SamplingParams
from kiln.builder.build import BuildOptions, build_engine
from kiln.checkpoint.default_model import default_model_path

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


def perplexity(llm: LLM, windows: list[list[int]]) -> float:
    outs = llm.generate(windows, SamplingParams(max_tokens=1, prompt_logprobs=0))
    nll, count = 0.0, 0
    for window, out in zip(windows, outs, strict=True):
        for token, position in zip(window[1:], out.prompt_logprobs[1:], strict=True):
            nll -= position[token].logprob
            count += 1
    return math.exp(nll / count)


def final_number(text: str) -> str | None:
    numbers = re.findall(r"-?\d[\d,]*\.?\d*", text)
    return numbers[-1].replace(",", "").rstrip(".") if numbers else None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--windows", type=int, default=32)
    p.add_argument("--window-len", type=int, default=512)
    # Below --window-len, prefill runs in chunks that read the earlier ones from the cache.
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--questions", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=192)
    p.add_argument("--out", default=None)
    # "valid": text the builds never calibrate on (their default is the test split's start).
    p.add_argument("--split", default="test", choices=("test", "valid"))
    p.add_argument("--runs", default=None, help='comma-separated run names ("auto" always runs)')
    args = p.parse_args()

    text = (DATA / "wikitext-2" / f"{args.split}.txt").read_text()
    questions = [
        json.loads(line) for line in (DATA / "gsm8k" / "test.jsonl").read_text().splitlines()
    ][: args.questions]
    results: dict[str, dict] = {}
    completions: dict[str, list[list[int]]] = {}
    from kiln.attention.torch_backend import TorchAttentionBackend

    runs = [("auto", "auto", False), ("fp8", "fp8", False), ("fp8_qk", "fp8", True)]
    runs += [("int8", "int8", False), ("int8_built", "int8", False)]
    if args.runs:
        runs = [r for r in runs if r[0] in args.runs.split(",") or r[0] == "auto"]
    workdir = tempfile.mkdtemp(prefix="kv-accuracy-")
    for name, kv, fp8_qk in runs:
        # The reference backend widens a float8 cache; the third run has it round as the Triton
        # backend's float8 Q.K dots do (prompt logprobs come from prefill).
        TorchAttentionBackend.fp8_qk = fp8_qk
        model = args.model
        if name == "int8_built":
            model = os.path.join(workdir, "int8-engine")
            options = BuildOptions(kv_cache_dtype="int8", dtype=args.dtype, accuracy_check=False)
            build_engine(args.model or default_model_path(), model, options, None)
        llm = LLM(
            model, dtype=args.dtype, kv_cache_dtype=kv, max_num_seqs=64,
            max_num_batched_tokens=args.max_num_batched_tokens,
        )  # fmt: skip
        ids = llm.engine.tokenizer.encode(text, add_special_tokens=False)
        n = args.window_len
        windows = [ids[i * n : (i + 1) * n] for i in range(args.windows)]
        start = time.perf_counter()
        ppl = perplexity(llm, windows)
        conversations = [[{"role": "user", "content": q["question"]}] for q in questions]
        outs = llm.chat(conversations, SamplingParams(max_tokens=args.max_tokens, temperature=0))
        completions[name] = [list(o.outputs[0].token_ids) for o in outs]
        correct = sum(
            final_number(o.outputs[0].text)
            == q["answer"].split("####")[-1].strip().replace(",", "")
            for o, q in zip(outs, questions, strict=True)
        )
        results[name] = {
            "kv_cache_dtype": str(llm.engine.kv_cache_dtype).removeprefix("torch."),
            "wikitext2_perplexity": ppl,
            "gsm8k_correct": correct,
            "seconds": time.perf_counter() - start,
        }
        print(name, results[name], flush=True)
        del llm
    TorchAttentionBackend.fp8_qk = False

    shutil.rmtree(workdir, ignore_errors=True)
    ref_ppl = results["auto"]["wikitext2_perplexity"]
    for name, result in results.items():
        if name == "auto":
            continue
        first_diff = []
        for a, b in zip(completions["auto"], completions[name], strict=True):
            k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
            if k is None and len(a) != len(b):
                k = min(len(a), len(b))
            first_diff.append(k)
        differing = sorted(k for k in first_diff if k is not None)
        result["perplexity_change"] = result["wikitext2_perplexity"] / ref_ppl - 1
        result["identical_greedy_completions"] = sum(k is None for k in first_diff)
        result["first_differing_token_median"] = (
            differing[len(differing) // 2] if differing else None
        )
    record = {
        "command": " ".join([sys.executable.rsplit("/", 1)[-1], *sys.argv]),
        "model": args.model or "SmolLM2-135M-Instruct (embedded GGUF)",
        "wikitext2_windows": f"{args.windows} x {args.window_len} tokens of {args.split}",
        "gsm8k_questions": len(questions),
        "max_tokens": args.max_tokens,
        "results": results,
    }
    print(json.dumps(record, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
