"""What a float8 LM head costs in accuracy (issue 13: "The LM head may stay bf16: measure").

On the real SmolLM2-135M (the embedded GGUF; its head is the tied embedding), on the CPU, this
scores the unquantized model and the fp8-dynamic (W8A8) model each with its head as it is and
with the head's weights in float8 e4m3 with per-row (per-vocabulary-entry) scales:
- "w8a8": the hidden state quantized per token too (what the FP8 tensor cores would run:
  reference.fp8_linear),
- "w8a16": float8 weights only, widened to the model dtype before the product (what a
  batch-1 kernel that only halves the weight bytes would run).
Metrics: word and token perplexity on the held-out text of `kiln build`'s accuracy check
(kiln.builder.accuracy.measure: WikiText-2 valid, first article), the fraction of held-out
positions whose top-1 token is unchanged (teacher forced), and greedy continuations of prompts
from the same text, token for token against the same model with its own head.

Usage: OMP_NUM_THREADS=1 python benchmarks/fp8_lm_head_accuracy.py --out FILE.json
"""

from __future__ import annotations

import argparse
import json
import time
import types

import torch
import torch.nn.functional as F

from kiln import LLM, SamplingParams
from kiln.builder.accuracy import HELD_OUT_FILE, measure, wikitext_articles
from kiln.kernels import reference


def _head_weight(model) -> torch.Tensor:
    return (model.embed_tokens if model.lm_head is None else model.lm_head).weight


def set_head(llm: LLM, mode: str) -> None:
    """Replace compute_logits with a float8 head ("w8a8" / "w8a16"), or restore it ("bf16")."""
    model = llm.engine.executor.runner.model
    if mode == "bf16":
        model.__dict__.pop("compute_logits", None)
        return
    weight = _head_weight(model).detach()
    w_fp8, w_scale = reference.quantize_fp8(weight.float(), None)  # per vocabulary row
    w_scale = w_scale.view(-1)
    widened = (w_fp8.float() * w_scale[:, None]).to(weight.dtype)

    def compute_logits(self, hidden: torch.Tensor, ops: object = None) -> torch.Tensor:
        if mode == "w8a8":
            return reference.fp8_linear(hidden, w_fp8, w_scale, None)
        return F.linear(hidden, widened)

    model.compute_logits = types.MethodType(compute_logits, model)


def top1_tokens(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1, ignore_eos=True)
    out = []
    for o in llm.generate(prompts, params):
        out.append([min(p.items(), key=lambda kv: kv[1].rank)[0] for p in o.prompt_logprobs[1:]])
    return out


def greedy(llm: LLM, prompts: list[list[int]], n: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def agreement(a: list[list[int]], b: list[list[int]]) -> dict[str, float]:
    same = sum(x == y for s, t in zip(a, b) for x, y in zip(s, t))
    total = sum(len(s) for s in a)
    first_diff = []
    for s, t in zip(a, b):
        d = next((i for i, (x, y) in enumerate(zip(s, t)) if x != y), len(s))
        first_diff.append(d)
    identical = sum(d == len(s) for d, s in zip(first_diff, a))
    return {"same_fraction": same / total, "identical": identical, "first_diff": first_diff}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--greedy-prompts", type=int, default=8)
    parser.add_argument("--greedy-tokens", type=int, default=48)
    parser.add_argument("--quantizations", nargs="+", default=["none", "fp8-dynamic"])
    parser.add_argument("--heads", nargs="+", default=["w8a8", "w8a16"], help="besides bf16")
    args = parser.parse_args()
    article = wikitext_articles(HELD_OUT_FILE, 1)[0]
    results: dict[str, object] = {
        "model": "SmolLM2-135M-Instruct (embedded GGUF, dequantized), CPU, float32",
        "held_out": "wikitext-2 valid.txt, first article (kiln build's accuracy check)",
    }
    rows = {}
    for quantization in args.quantizations:
        llm = LLM(quantization=quantization, enable_prefix_caching=False)
        tokenizer = llm.get_tokenizer()
        tokens = tokenizer.encode(article, add_special_tokens=False)
        # Greedy prompts: consecutive 64-token slices of the article.
        prompts = [tokens[i * 64 : (i + 1) * 64] for i in range(args.greedy_prompts)]
        base_top1 = base_greedy = None
        for head in ("bf16", *args.heads):
            set_head(llm, head)
            t0 = time.perf_counter()
            ppl = measure(llm, None)
            top1 = top1_tokens(llm, [tokens])
            gen = greedy(llm, prompts, args.greedy_tokens)
            row = {**ppl, "seconds": round(time.perf_counter() - t0, 1)}
            if head == "bf16":
                base_top1, base_greedy = top1, gen
            else:
                row["top1_vs_own_head"] = agreement(top1, base_top1)["same_fraction"]
                row["greedy_vs_own_head"] = agreement(gen, base_greedy)
            name = f"{quantization}/{head}"
            rows[name] = row
            print(name, json.dumps(row), flush=True)
            results["rows"] = rows
            if args.out:  # after every row: a run cut short keeps what it measured
                with open(args.out, "w") as f:
                    json.dump(results, f, indent=1)
        set_head(llm, "bf16")
        llm.shutdown()
    for quantization in args.quantizations:
        base = rows[f"{quantization}/bf16"]["word_perplexity"]
        for name, row in rows.items():
            if name.startswith(f"{quantization}/"):
                row["word_ppl_increase_pct_vs_own_head"] = 100 * (row["word_perplexity"] / base - 1)
    results["rows"] = rows
    text = json.dumps(results, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
