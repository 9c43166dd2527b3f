"""Speculative decoding on the CPU with the real SmolLM2-135M: plain vs n-gram vs a draft model.

Workload where prompt lookup pays: the chat model is asked to repeat a passage of WikiText-2
(../shared/data/wikitext-2/test.txt) word for word, greedy, single stream. The three engines are
loaded once and run prompt by prompt in turn (plain, ngram, draft, plain, ...), so load drift on
a shared machine hits them alike. Greedy outputs must be identical across the three (checked).

    python benchmarks/spec_decode_cpu.py --output-json cpu_spec_decode.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import time

from kiln import LLM
from kiln.checkpoint.default_model import default_model_path
from kiln.sampling_params import SamplingParams

WIKITEXT = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "wikitext-2")


def passages(num: int, words: int, path: str) -> list[str]:
    """Paragraphs of WikiText-2 test, detokenized (" @-@ " -> "-", " , " -> ", "), cut to about
    `words` words at a sentence end."""
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if len(line.split()) < words or line.startswith("=") or "<unk>" in line:
                continue
            text = line.replace(" @-@ ", "-").replace(" @,@ ", ",").replace(" @.@ ", ".")
            for a, b in ((" , ", ", "), (" . ", ". "), (" ; ", "; "), (" 's", "'s"), (" :", ":")):
                text = text.replace(a, b)
            cut = " ".join(text.split()[:words])
            out.append(cut[: cut.rfind(".") + 1] or cut)
            if len(out) == num:
                break
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--passage-words", type=int, default=90)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--draft-k", type=int, default=3)
    p.add_argument("--draft-layers", type=int, default=10)
    p.add_argument("--wikitext", default=os.path.join(WIKITEXT, "test.txt"))
    p.add_argument("--output-json", default=None)
    args = p.parse_args()

    model = default_model_path()
    common = dict(kv_cache_memory_gb=0.2, max_num_seqs=4, num_threads=1)
    specs = {
        "plain": None,
        "ngram": {"method": "ngram", "num_speculative_tokens": args.k},
        "draft_model": {
            "method": "draft_model",
            "num_speculative_tokens": args.draft_k,
            "model": model,
            "draft_num_hidden_layers": args.draft_layers,
        },
    }
    engines = {name: LLM(model, speculative_config=spec, **common) for name, spec in specs.items()}
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0)
    texts = passages(args.num_prompts, args.passage_words, args.wikitext)
    messages = [
        [{"role": "user", "content": f"Repeat the following text exactly, word for word:\n\n{t}"}]
        for t in texts
    ]
    for llm in engines.values():  # warm-up: a short generation each
        llm.chat(messages[0], SamplingParams(max_tokens=4, temperature=0))
    runs: dict[str, list[dict]] = {name: [] for name in engines}
    load = []
    for i, conversation in enumerate(messages):
        for name, llm in engines.items():
            load.append(os.getloadavg()[0])
            start = time.perf_counter()
            (out,) = llm.chat(conversation, params)
            wall = time.perf_counter() - start
            o = out.outputs[0]
            runs[name].append(
                {
                    "prompt": i,
                    "prompt_tokens": len(out.prompt_token_ids),
                    "output_tokens": len(o.token_ids),
                    "wall_s": wall,
                    "tok_s": len(o.token_ids) / wall,
                    "num_draft_tokens": o.num_draft_tokens,
                    "num_accepted_tokens": o.num_accepted_tokens,
                    "num_verification_steps": o.num_spec_steps,
                    "mean_acceptance_length": o.mean_acceptance_length,
                    "token_ids": o.token_ids,
                }
            )
            rate = len(o.token_ids) / wall
            print(
                f"prompt {i} {name:12s} {len(o.token_ids)} tokens {wall:6.1f} s {rate:5.2f} tok/s"
            )

    summary = {}
    for name, rows in runs.items():
        tokens = sum(r["output_tokens"] for r in rows)
        wall = sum(r["wall_s"] for r in rows)
        drafted = sum(r["num_draft_tokens"] for r in rows)
        accepted = sum(r["num_accepted_tokens"] for r in rows)
        steps = sum(r["num_verification_steps"] for r in rows)
        summary[name] = {
            "output_tokens": tokens,
            "wall_s": wall,
            "tok_s": tokens / wall,
            "num_draft_tokens": drafted,
            "num_accepted_tokens": accepted,
            "acceptance_rate": accepted / drafted if drafted else None,
            "mean_acceptance_length": 1 + accepted / steps if steps else None,
        }
    for name in ("ngram", "draft_model"):
        summary[name]["speedup_vs_plain"] = summary[name]["tok_s"] / summary["plain"]["tok_s"]
        summary[name]["greedy_identical_to_plain"] = all(
            a["token_ids"] == b["token_ids"] for a, b in zip(runs[name], runs["plain"])
        )
    record = {
        "benchmark": "spec_decode_cpu",
        "command": "python benchmarks/spec_decode_cpu.py "
        + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "output_json"
        ),
        "model": model,
        "workload": "repeat a WikiText-2 test passage word for word (chat template), greedy",
        "specs": specs,
        "summary": summary,
        "runs": runs,
        "passages": texts,
        "load_avg_1m": {"min": min(load), "max": max(load)},
        "git_rev": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "host": {"machine": platform.machine(), "cpus": os.cpu_count()},
    }
    print(json.dumps(summary, indent=2))
    if args.output_json:
        os.makedirs(os.path.dirname(args.output_json), exist_ok=True)
        with open(args.output_json, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
