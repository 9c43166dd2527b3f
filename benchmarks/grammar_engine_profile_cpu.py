"""Where the engine loop's host time goes in a JSON-schema run, on the CPU: a tiny random Llama
with the H200 benchmark's 128,256-id synthetic tokenizer and schema
(benchmarks/structured_output_bench.py), 64 concurrent requests, async scheduling on (the GPU's
schedule: the next step is launched before the previous one's tokens are back), EOS ignored.

cProfile times the engine's thread in CPU time (time.thread_time), so other processes on a
shared machine do not inflate it; the worker thread's own time is in GrammarStats. Reports the
top functions by own CPU time and by cumulative CPU time, and the mask stats a step.

    python3 benchmarks/grammar_engine_profile_cpu.py --num-requests 64 --output-len 24
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def tiny_llama(path: str, vocab_size: int) -> None:
    import torch
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vocab-size", type=int, default=128256)
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--input-len", type=int, default=16)
    p.add_argument("--output-len", type=int, default=24)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--out", default=None)
    args = p.parse_args()

    import random

    import torch
    from structured_output_bench import SCHEMA, run_round, synthetic_tokenizer

    from kiln.config import EngineConfig
    from kiln.engine.llm_engine import LLMEngine
    from kiln.sampling_params import GuidedDecodingParams, SamplingParams

    torch.set_num_threads(1)
    path = tempfile.mkdtemp(prefix="kiln-grammar-profile-")
    tiny_llama(path, args.vocab_size)
    engine = LLMEngine(
        EngineConfig(
            model=path,
            max_num_seqs=args.num_requests,
            kv_cache_memory_gb=0.2,
            max_model_len=256,
            async_scheduling=True,
        )
    )
    tokenizer = synthetic_tokenizer(args.vocab_size)
    engine.tokenizer = tokenizer
    engine.output_processor.tokenizer = tokenizer
    engine.executor.runner.tokenizer = tokenizer
    rng = random.Random(0)
    prompts = [
        [rng.randrange(259, args.vocab_size) for _ in range(args.input_len)]
        for _ in range(args.num_requests)
    ]
    spec = GuidedDecodingParams(json=SCHEMA)
    n = args.output_len
    guided = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, guided_decoding=spec)
    run_round(engine, prompts[:4], guided, "warm")  # compile, first matchers, buffers

    profiler = cProfile.Profile(time.thread_time)
    t = time.perf_counter()
    profiler.enable()
    record = run_round(engine, prompts, guided, "json")
    profiler.disable()
    wall = time.perf_counter() - t
    record.pop("_outputs")
    stats = pstats.Stats(profiler)
    tables = {}
    for key in ("tottime", "cumtime"):
        buf = io.StringIO()
        pstats.Stats(profiler, stream=buf).sort_stats(key).print_stats(args.top)
        tables[key] = buf.getvalue()
    total_cpu = sum(v[2] for v in stats.stats.values())  # own time summed: the thread's CPU
    # The engine thread's CPU in the grammar layer (cumulative, so xgrammar's calls from there
    # count) and in xgrammar itself (calls from any kiln function).
    mask_cpu = {
        f"{Path(file).name}:{name}": round(1000 * v[3] / record["engine_steps"], 3)
        for (file, _, name), v in stats.stats.items()
        if file.endswith(("structured_output/matchers.py", "xgrammar/matcher.py"))
    }
    grammar = asdict(engine.executor.runner._grammars.stats)
    steps = record["engine_steps"]
    out = {
        "what": "engine thread CPU profile of a JSON-schema round, tiny model, 128k vocab, CPU",
        "args": vars(args),
        "round": record,
        "wall_s": round(wall, 3),
        "engine_thread_cpu_ms_per_step": round(1000 * total_cpu / steps, 3),
        "engine_thread_mask_cpu_ms_per_step": dict(sorted(mask_cpu.items())),
        "grammar_stats": grammar,
    }
    print(json.dumps(out, indent=1))
    for key, table in tables.items():
        print(f"==== by {key} (engine thread CPU) ====")
        print(table)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n" + tables["tottime"])


if __name__ == "__main__":
    main()
