"""How many long sequences a hybrid model (Gemma 2/3: windowed and global layers) holds at once:
the memory plan's numbers (windowed layers at their window, and every layer counted fully),
then long prompts run through the engine, counting the most requests running together, the
preemptions and each KV cache group's blocks.

    python benchmarks/hybrid_kv_fit.py --model gemma-3-12b --load-format dummy \\
        --quantization fp8 --kv-cache-dtype fp8 --kv-cache-memory-gb 8 \\
        --prompt-len 16384 --num-prompts 16 --out /tmp/hybrid_kv_fit.json

A fixed --kv-cache-memory-gb keeps the run short: the plan's count of sequences that fit and
the measured peak are then small numbers that can be compared directly.
"""

from __future__ import annotations

import argparse
import json
import random
import time

from kiln import SamplingParams
from kiln.config import EngineConfig
from kiln.engine.llm_engine import LLMEngine
from kiln.kv_cache.manager import BEHIND_WINDOW


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gemma-3-12b")
    parser.add_argument("--load-format", default="dummy")
    parser.add_argument("--quantization", default="none")
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--kv-cache-memory-gb", type=float, default=8.0)
    parser.add_argument("--prompt-len", type=int, default=16384)
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--device", default=None)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    extra = {"device": args.device} if args.device else {}
    config = EngineConfig(
        model=args.model,
        load_format=args.load_format,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        kv_cache_memory_gb=args.kv_cache_memory_gb,
        max_model_len=args.prompt_len + args.max_tokens,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=max(args.num_prompts, 1),
        block_size=args.block_size,
        enable_prefix_caching=False,
        **extra,
    )
    engine = LLMEngine(config)
    plan = engine.memory_plan
    length = args.prompt_len + args.max_tokens
    layers = sum(g.num_layers for g in plan.groups) or engine.model_config.num_hidden_layers
    every_layer_bytes = -(-length // plan.block_size) * plan.block_size * layers
    every_layer = (
        plan.num_blocks * plan.bytes_per_block // max(every_layer_bytes * plan.layer_token_bytes, 1)
    )
    print("memory plan:", plan.describe(length), flush=True)

    rng = random.Random(0)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    for i in range(args.num_prompts):
        prompt = [rng.randrange(3, vocab) for _ in range(args.prompt_len)]
        engine.add_request(prompt, params, request_id=f"r{i}")
    kv = engine.kv_cache
    groups = getattr(kv, "groups", [kv])
    peak_running, peak_group_blocks = 0, [0] * len(groups)
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        peak_running = max(peak_running, len(engine.scheduler.running))
        for g, group in enumerate(groups):
            held = sum(
                b is not BEHIND_WINDOW for blocks in group.req_to_blocks.values() for b in blocks
            )
            peak_group_blocks[g] = max(peak_group_blocks[g], held)
    seconds = time.perf_counter() - start
    result = {
        "model": args.model,
        "prompt_len": args.prompt_len,
        "num_prompts": args.num_prompts,
        "kv_blocks": plan.num_blocks,
        "plan_sequences_that_fit": plan.max_concurrent_seqs(length),
        "plan_sequences_every_layer_fully": every_layer,
        "peak_running": peak_running,
        "preemptions": engine.scheduler.num_preemptions_total,
        "group_windows": [g.window for g in plan.groups],
        "peak_blocks_per_group": peak_group_blocks,
        "seconds": seconds,
    }
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
