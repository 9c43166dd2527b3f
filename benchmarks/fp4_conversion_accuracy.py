"""What each conversion of an FP4 checkpoint costs in accuracy: word perplexity of the engine
loaded with each `quantization` against the exact FP4 model (load_format "dequantized"), on the
held-out text `kiln build`'s accuracy check scores (WikiText-2 valid, first three articles), with
one standard error of the paired per-token log-probability differences (tokens taken as
independent). Each configuration runs in its own process, one after another.

    python benchmarks/fp4_conversion_accuracy.py CHECKPOINT [CHECKPOINT ...] --out fp4.json

An FP4 checkpoint (llm-compressor NVFP4A16 / MXFP4A16, ModelOpt NVFP4) is made from a 16-bit one
with llm-compressor's QuantizationModifier (docs/engine_directories.md has SmolLM2-135M's table).
`--source DIR` adds that 16-bit model and its own fp8-dynamic / fp8-block cost.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import subprocess
import sys

# Per-token log-probabilities of one configuration, printed as JSON (run as a child process).
_SCORE = """
import json, sys
from kiln.builder.accuracy import _HELD_OUT_ARTICLES, HELD_OUT_FILE, wikitext_articles
from kiln.eval.perplexity import prefix_token_id, scored_windows
from kiln.llm import LLM
path, load_format, quantization = sys.argv[1:4]
llm = LLM(path, load_format=load_format, quantization=quantization, dtype="float32")
docs = wikitext_articles(HELD_OUT_FILE, _HELD_OUT_ARTICLES)
tokens = [llm.get_tokenizer().encode(d, add_special_tokens=False) for d in docs]
logprobs = [lp for _, window in scored_windows(llm, tokens, prefix_token_id(llm)) for lp in window]
print(json.dumps(logprobs))
"""
FP4_CONVERSIONS = ("fp8-dynamic", "fp8-block", "int8-w8a16-g16", "fp8-w8a16-channel")
SOURCE_SCHEMES = ("fp8-dynamic", "fp8-block")


def words() -> int:
    from kiln.builder.accuracy import _HELD_OUT_ARTICLES, HELD_OUT_FILE, wikitext_articles

    docs = wikitext_articles(HELD_OUT_FILE, _HELD_OUT_ARTICLES)
    return sum(len(re.split(r"\s+", d)) for d in docs)


def score(path: str, load_format: str, quantization: str) -> list[float] | None:
    """The configuration's per-token log-probabilities, or None where loading refuses it."""
    run = subprocess.run(
        [sys.executable, "-c", _SCORE, path, load_format, quantization],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if run.returncode:
        print(f"{path} {quantization}: {run.stderr.strip().splitlines()[-1]}", file=sys.stderr)
        return None
    return json.loads(run.stdout.strip().splitlines()[-1])


def compare(base: list[float], other: list[float], n_words: int) -> dict[str, float]:
    """Word perplexity of `other`, its increase over `base`'s and the paired standard error."""
    diffs = [a - b for a, b in zip(other, base, strict=True)]
    mean = math.fsum(diffs) / len(diffs)
    sd = math.sqrt(math.fsum((d - mean) ** 2 for d in diffs) / (len(diffs) - 1))
    ratio = math.exp(-math.fsum(diffs) / n_words)
    return {
        "word_perplexity": math.exp(-math.fsum(other) / n_words),
        "increase_pct": 100 * (ratio - 1),
        "stderr_pct": 100 * ratio * math.sqrt(len(diffs)) * sd / n_words,
        "bit_equal": other == base,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("checkpoints", nargs="+", help="FP4 checkpoint directories")
    p.add_argument("--source", default=None, help="the 16-bit model they were made from")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    n_words = words()
    runs = [(c, "dequantized", FP4_CONVERSIONS) for c in args.checkpoints]
    if args.source:
        runs.insert(0, (args.source, "auto", SOURCE_SCHEMES))
    results = []
    for path, base_format, schemes in runs:
        base = score(path, base_format, "none")
        assert base is not None, path
        row = {"model": path, "word_perplexity": math.exp(-math.fsum(base) / n_words)}
        print(f"{path}: {row['word_perplexity']:.3f} ({len(base)} tokens, {n_words} words)")
        for scheme in schemes:
            got = score(path, "auto", scheme)
            if got is None:
                row[scheme] = "refused"
                continue
            row[scheme] = compare(base, got, n_words)
            r = row[scheme]
            print(
                f"  {scheme}: {r['word_perplexity']:.3f} {r['increase_pct']:+.2f}% "
                f"+- {r['stderr_pct']:.2f}%{' (bit-equal)' if r['bit_equal'] else ''}"
            )
        results.append(row)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
