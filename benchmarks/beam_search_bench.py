"""Beam search's cost per step: beam width W at batch 1 against a plain batch-W greedy decode,
and HF's generate(num_beams=W) on the same weights, in one process.

kiln's beam step is W one-token requests, each forked copy-on-write from the request that ran
its parent beam (engine/beam_search.py): the full blocks shared, the last partial block copied
on the device, so after the prompt a beam step is a decode step of W rows (CUDA graphs on the
GPU). It cannot overlap the host with the device as async scheduling does for a plain decode:
the next step's beams are known only once the selection has read this step's logprobs.

`--cprofile N` adds the N functions of most own time per beam step (cProfile of one more beam
run: its overhead inflates Python-heavy code, so read it for shares).

    python3 benchmarks/beam_search_bench.py --model llama-3.1-8b --load-format dummy \\
        --dtype bfloat16 --width 4 --input-len 128 --output-len 64 --out beam_search.json
    # on the CPU, a tiny model: --model DIR --load-format auto --dtype float32 --no-hf
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--load-format", default="dummy")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--width", type=int, default=4)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=1, help="timed runs of each (the median)")
    p.add_argument("--no-hf", action="store_true")
    p.add_argument("--cprofile", type=int, default=0, help="top N functions per beam step")
    p.add_argument("--out", default=None)
    args = p.parse_args()

    import torch

    from kiln import LLM, SamplingParams

    llm = LLM(args.model, load_format=args.load_format, dtype=args.dtype)
    vocab = llm.engine.model_config.vocab_size
    rng = random.Random(0)
    prompt = [rng.randrange(vocab // 4, vocab) for _ in range(args.input_len)]
    W, n_out = args.width, args.output_len

    def timed(fn) -> float:
        times = []
        for _ in range(args.repeats):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            t = time.perf_counter()
            fn()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        return statistics.median(times)

    beam = SamplingParams(use_beam_search=True, best_of=W, n=1, max_tokens=n_out, ignore_eos=True)
    plain = SamplingParams(temperature=0, max_tokens=n_out, ignore_eos=True)
    short = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    prompts = [[*prompt[:-1], prompt[-1] - i] for i in range(W)]  # W distinct prompts
    llm.generate([prompt], SamplingParams(use_beam_search=True, best_of=W, max_tokens=4))  # warm
    llm.generate(prompts, plain)
    record = {"args": vars(args), "device": llm.engine.device}
    # Plain: batch W, the decode steps alone (the prefill measured apart and subtracted).
    prefill_s = timed(lambda: llm.generate(prompts, short))
    plain_s = timed(lambda: llm.generate(prompts, plain))
    record["plain_batch_step_ms"] = round(1000 * (plain_s - prefill_s) / (n_out - 1), 3)
    beam_s = timed(lambda: llm.generate([prompt], beam))
    out = llm.generate([prompt], beam)[0].outputs[0]
    steps = len(out.token_ids)
    one_prefill_s = timed(lambda: llm.generate([prompt], short))
    record["beam_steps"] = steps
    record["beam_step_ms"] = round(1000 * (beam_s - one_prefill_s) / max(steps - 1, 1), 3)
    record["beam_over_plain"] = round(record["beam_step_ms"] / record["plain_batch_step_ms"], 3)
    if args.cprofile:
        record["beam_cprofile_us_per_step"] = cprofile(
            lambda: llm.generate([prompt], beam), steps, args.cprofile
        )
    if not args.no_hf:
        record["hf"] = hf_beam_step_ms(args, prompt, W, n_out)
    print(json.dumps(record, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)


def cprofile(run, steps: int, top: int) -> list[list]:
    """The `top` functions of most own time in one more run, in us per beam step."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    run()
    profiler.disable()
    stats = pstats.Stats(profiler).stats  # {(file, line, name): (cc, nc, tottime, cumtime, _)}
    rows = sorted(stats.items(), key=lambda item: -item[1][2])[:top]
    return [
        [f"{file.rsplit('/', 1)[-1]}:{line}({name})", round(1e6 * tt / steps, 1), nc]
        for (file, line, name), (_, nc, tt, _, _) in rows
    ]


def hf_beam_step_ms(args, prompt, width, n_out) -> dict:
    """HF generate(num_beams=W) on the same architecture (kiln's HF baseline loader)."""
    import torch

    from kiln.bench.hf_baseline import load_hf_model

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(args.dtype, torch.float32)
    model = load_hf_model(args.model, dtype, device)
    ids = torch.tensor([prompt], device=device)

    def run(num_beams: int, new: int) -> float:
        torch.cuda.synchronize() if torch.cuda.is_available() else None
        t = time.perf_counter()
        model.generate(
            ids, num_beams=num_beams, do_sample=False, max_new_tokens=new, min_new_tokens=new
        )
        torch.cuda.synchronize() if torch.cuda.is_available() else None
        return time.perf_counter() - t

    run(width, 4)
    full, first = run(width, n_out), run(width, 1)
    return {"hf_beam_step_ms": round(1000 * (full - first) / (n_out - 1), 3)}


if __name__ == "__main__":
    main()
