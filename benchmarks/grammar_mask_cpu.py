"""Host cost of a step's grammar mask at 64 rows, the runner's old way against its new one, on
the CPU and without a model: the H200 benchmark's schema and 128,256-id synthetic tokenizer
(benchmarks/structured_output_bench.py), 64 matchers driven in lockstep by the same random
allowed tokens, so both ways fill the same masks (checked every step).

- old: accept each row's token (one call a row), allocate the mask, fill it with xgrammar's
  BatchGrammarMatcher("auto") on the runner's thread, unpack it with 32 shifts a word and mask.
- new: GrammarBatch (the runner's thread queues the tokens; a worker applies them in one
  batched accept and fills over `--fill-threads` of xgrammar's threads, the runner's thread
  free until it needs the mask) and forbidden_by_bitmask's byte lookup.

Per step it reports the runner's thread's CPU and wall time on mask work (what the step loop
waits for; `--engine-work-ms` of busy Python between starting and needing the mask stands for
the collect/schedule/prepare the new way overlaps; its CPU time is counted in both ways), the
process's CPU time over the new way's step (every thread), and the apply timed on the CPU (on
a GPU it is two kernels).

    python3 benchmarks/grammar_mask_cpu.py --rows 64 --steps 24 --fill-threads 1
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def busy(ms: float) -> None:
    end = time.perf_counter() + ms / 1000
    while time.perf_counter() < end:
        pass


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vocab-size", type=int, default=128256)
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--fill-threads", type=int, default=None, help="default: the runner's")
    p.add_argument("--engine-work-ms", type=float, default=0.0)
    p.add_argument("--out", default=None)
    args = p.parse_args()

    import torch
    import xgrammar as xgr
    from structured_output_bench import SCHEMA, synthetic_tokenizer

    from kiln.sampling.logits_processors import forbidden_by_bitmask, unpack_bitmask
    from kiln.sampling_params import GuidedDecodingParams
    from kiln.structured_output import GrammarBatch, compiler_for

    torch.set_num_threads(1)
    vocab, rows = args.vocab_size, args.rows
    tokenizer = synthetic_tokenizer(vocab)
    compiler = compiler_for(tokenizer, vocab, (tokenizer.eos_token_id,))
    spec = GuidedDecodingParams(json=SCHEMA)
    compiled = compiler.compile(spec)
    cpu = torch.device("cpu")

    old_matchers = [xgr.GrammarMatcher(compiled) for _ in range(rows)]
    old_batch = xgr.BatchGrammarMatcher()
    new = GrammarBatch(compiler, args.fill_threads)
    req_ids = [f"r{i}" for i in range(rows)]
    for req_id in req_ids:
        new.add(req_id, spec, [])
    rng = random.Random(0)
    gen = torch.Generator().manual_seed(0)
    pieces = tokenizer.convert_ids_to_tokens(list(range(vocab)))
    no_quote = torch.tensor([float('"' not in t and t != "<0x22>") for t in pieces])
    logits = torch.randn(rows, vocab)
    names = ("old_main_cpu", "old_wall", "old_apply", "new_main_cpu", "new_wall", "new_all_cpu")
    totals = dict.fromkeys((*names, "new_apply"), 0.0)  # busy-loop time included where it ran
    tokens: list[int] | None = None
    for step in range(args.steps):
        # old: the runner's thread does it all, in series
        w, c = time.perf_counter(), time.thread_time()
        if tokens is not None:
            for matcher, token_id in zip(old_matchers, tokens):
                matcher.accept_token(token_id)
        old_mask = xgr.allocate_token_bitmask(rows, vocab)
        old_batch.batch_fill_next_token_bitmask(old_matchers, old_mask, list(range(rows)))
        busy(args.engine_work_ms)
        totals["old_main_cpu"] += time.thread_time() - c
        totals["old_wall"] += time.perf_counter() - w
        t = time.perf_counter()
        old_out = logits.masked_fill(~unpack_bitmask(old_mask, vocab), float("-inf"))
        totals["old_apply"] += time.perf_counter() - t

        # new: accept, start the fill, the engine's own work, then wait for the mask
        w, c, all_cpu = time.perf_counter(), time.thread_time(), time.process_time()
        if tokens is not None:
            new.accept_tokens(req_ids, tokens)
        pending = new.start_fill(req_ids, cpu)
        busy(args.engine_work_ms)
        mask = new.finish_fill(pending, cpu)
        totals["new_main_cpu"] += time.thread_time() - c
        totals["new_wall"] += time.perf_counter() - w
        totals["new_all_cpu"] += time.process_time() - all_cpu
        t = time.perf_counter()
        new_out = logits.masked_fill(forbidden_by_bitmask(mask, vocab), float("-inf"))
        totals["new_apply"] += time.perf_counter() - t

        assert torch.equal(old_mask, mask), f"step {step}: the masks differ"
        assert torch.equal(old_out, new_out)
        # Mostly pieces without a quote: replies stay inside the free-form strings the H200 run
        # spends its steps in, and fields still close now and then.
        allowed = unpack_bitmask(mask, vocab).float()
        inside = allowed * no_quote
        tokens = []
        for r in range(rows):
            weights = inside[r] if inside[r].any() and rng.random() < 0.9 else allowed[r]
            tokens.append(int(torch.multinomial(weights, 1, generator=gen)))
    per_step = {k: round(1000 * v / args.steps, 3) for k, v in totals.items()}
    record = {
        "what": "host ms a step of grammar-mask work: old (serial, the runner's thread) vs new",
        "args": vars(args),
        "fill_threads": new.fill_threads,
        "ms_per_step": per_step,
        "rows_filled_per_step": new.stats.num_rows_filled / max(new.stats.num_fills, 1),
        "masks_identical": True,
    }
    print(json.dumps(record, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
