"""Structured output's cost: N concurrent JSON-schema requests against the same N unconstrained,
in one process, alternating rounds (A B A B ...), output tok/s from first submission to last
completion (MEASURING.md), through the offline `LLM` API. Needs xgrammar.

A preset with dummy weights has no tokenizer and produces garbage, so the run makes the grammar's
work real:
- A synthetic tokenizer of the model's full vocabulary (128,256 for Llama 3.1): a Llama-2-style
  byte-fallback Unigram vocabulary of 256 byte tokens and random ASCII pieces of 1-10 chars, so
  xgrammar's mask covers as many tokens as the real one would, with a realistic mix of pieces
  that are and are not allowed in each grammar state. It is saved with the preset's config.json
  in a temporary model directory, which the engine loads with dummy weights.
- A schema of free-form (unbounded) strings, an integer, an enum and an array of strings, the
  last field a free-form string: a garbage model under the grammar almost never closes it, so
  replies run to max_tokens with every token constrained, and both arms generate N x output_len
  tokens (EOS ignored in both). No minLength/maxLength: xgrammar 0.2.9 builds masks inside
  length-bounded strings token by token (5-15 ms a row on a CPU core, measured), a cost of its
  own that this benchmark does not hide behind a workload that avoids it (see docs).
  Each constrained reply is replayed through a fresh matcher afterwards: every token up to the
  grammar's end must be one it allowed, and `constrained_token_fraction` says how many of the
  generated tokens were under the grammar (a reply that completes early is followed by forced
  EOS and then, EOS ignored, unconstrained tokens).

    python3 benchmarks/structured_output_bench.py --model llama-3.1-8b --load-format dummy \\
        --dtype bfloat16 --num-requests 64 --output-len 128 --out structured_output.json
    # a real checkpoint brings its own tokenizer: --model DIR_OR_GGUF --load-format auto
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import string
import time

SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "year": {"type": "integer"},
        "genre": {"enum": ["drama", "comedy", "documentary", "thriller"]},
        "tags": {"type": "array", "items": {"type": "string"}},
        "review": {"type": "string"},
    },
    "required": ["title", "year", "genre", "tags", "review"],
}


def synthetic_tokenizer(vocab_size: int, seed: int = 0):
    """A byte-fallback Unigram tokenizer with exactly vocab_size tokens (ids 0-2 <unk> <s> </s>,
    then <0x00>..<0xFF>, then unique random pieces; '▁' marks a leading space)."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    rng = random.Random(seed)
    pieces = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256))]
    seen = set(pieces)
    alphabet = string.ascii_letters + string.digits + string.punctuation + "▁" * 8
    while len(pieces) < vocab_size:
        piece = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 10)))
        if piece not in seen:
            seen.add(piece)
            pieces.append(piece)
    vocab = [(p, -1.0 - 0.0001 * i) for i, p in enumerate(pieces)]
    tok = Tokenizer(models.Unigram(vocab, unk_id=0, byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )


def run_round(llm, prompts, params, label: str) -> dict:
    t0 = time.perf_counter()
    outs = [o.outputs[0] for o in llm.generate(prompts, params)]
    wall = time.perf_counter() - t0
    tokens = sum(len(o.token_ids) for o in outs)
    return {
        "label": label,
        "wall_s": round(wall, 4),
        "output_tokens": tokens,
        "output_tok_s": round(tokens / wall, 1),
        "finish_reasons": sorted({o.finish_reason for o in outs}),
        "_outputs": outs,
    }


def model_with_tokenizer(preset: str, vocab_size: int | None = None) -> str:
    """A model directory for `load_format="dummy"`: the preset's config.json and a synthetic
    tokenizer of its vocabulary size."""
    import tempfile

    from kiln.models.config import PRESETS

    config = PRESETS[preset]
    path = tempfile.mkdtemp(prefix="kiln-so-")
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    synthetic_tokenizer(vocab_size or config["vocab_size"]).save_pretrained(path)
    return path


def check_constrained(compiler, spec, outs) -> dict:
    import xgrammar as xgr

    compiled = compiler.compile(spec)
    bad = constrained = total = 0
    for out in outs:
        matcher = xgr.GrammarMatcher(compiled)
        total += len(out.token_ids)
        for token_id in out.token_ids:
            if matcher.is_terminated():
                break
            if not matcher.accept_token(token_id):
                bad += 1
                break
            constrained += 1
    return {
        "replies_replayed": len(outs),
        "replies_with_a_disallowed_token": bad,
        "constrained_token_fraction": round(constrained / max(total, 1), 4),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--load-format", default="dummy")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--rounds", type=int, default=5, help="rounds of each arm, alternating")
    p.add_argument("--kv-cache-memory-gb", type=float, default=None)
    p.add_argument(
        "--async-scheduling",
        choices=("auto", "on", "off"),
        default="auto",
        help="auto: the engine's default (on with CUDA, off on the CPU)",
    )
    p.add_argument("--out", default=None)
    args = p.parse_args()

    from kiln import LLM
    from kiln.sampling_params import GuidedDecodingParams, SamplingParams
    from kiln.structured_output import compiler_for

    t = time.perf_counter()
    model = args.model
    if args.load_format == "dummy" and not os.path.exists(model):
        model = model_with_tokenizer(model)  # a preset: give it a tokenizer
    tokenizer_s = time.perf_counter() - t
    async_scheduling = {"auto": None, "on": True, "off": False}[args.async_scheduling]
    llm = LLM(
        model,
        load_format=args.load_format,
        dtype=args.dtype,
        max_num_seqs=max(args.num_requests, 8),
        kv_cache_memory_gb=args.kv_cache_memory_gb,
        async_scheduling=async_scheduling,
    )
    engine = llm.engine
    tokenizer = engine.tokenizer
    vocab = engine.model_config.vocab_size

    rng = random.Random(0)
    prompts = [
        {"prompt_token_ids": [rng.randrange(259, vocab) for _ in range(args.input_len)]}
        for _ in range(args.num_requests)
    ]
    spec = GuidedDecodingParams(json=SCHEMA)
    n = args.output_len
    plain = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    guided = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, guided_decoding=spec)

    t = time.perf_counter()
    compiler = compiler_for(tokenizer, vocab, engine.eos_token_ids)
    compiler.compile(spec)
    compile_s = time.perf_counter() - t
    # Warm-up of both paths at the measured batch (CUDA graphs, allocator, the sampler's full
    # path, the fill threads at every row), not measured: a warm-up of 8 rows left the first
    # 64-row round of each arm cold (on the H200: plain 9,440 and JSON 3,216 tok/s against
    # ~11,700 and 10,300-11,300 in the rounds after it).
    warm = dict(temperature=0, max_tokens=32, ignore_eos=True)
    run_round(llm, prompts, SamplingParams(**warm), "w0")
    run_round(llm, prompts, SamplingParams(**warm, guided_decoding=spec), "w1")

    rounds = []
    for r in range(args.rounds):
        rounds.append(run_round(llm, prompts, plain, f"plain{r}"))
        rounds.append(run_round(llm, prompts, guided, f"json{r}"))
    check = check_constrained(compiler, spec, rounds[-1]["_outputs"])
    sample = rounds[-1]["_outputs"][0].text[:160]
    for r in rounds:
        r.pop("_outputs")
    plain_tps = [r["output_tok_s"] for r in rounds if r["label"].startswith("plain")]
    json_tps = [r["output_tok_s"] for r in rounds if r["label"].startswith("json")]
    from kiln.structured_output.matchers import default_fill_threads

    record = {
        "what": "structured output cost: JSON-schema vs unconstrained, same run",
        "args": vars(args),
        "device": engine.device,
        "async_scheduling": engine.async_scheduling,
        "host_cpus": {
            "os_cpu_count": os.cpu_count(),
            "affinity": len(os.sched_getaffinity(0)),
            "grammar_fill_threads": default_fill_threads(),
        },
        "vocab_size": vocab,
        "model_dir_and_tokenizer_s": round(tokenizer_s, 2),
        "schema_compile_s": round(compile_s, 3),
        "rounds": rounds,
        "plain_output_tok_s_median": statistics.median(plain_tps),
        "json_output_tok_s_median": statistics.median(json_tps),
        "json_over_plain": round(statistics.median(json_tps) / statistics.median(plain_tps), 4),
        "constrained_check": check,
        "sample_reply_start": sample,
    }
    print(json.dumps(record, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
