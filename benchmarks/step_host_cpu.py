"""The runner's host work per step on the CPU: `prepare` and `sample_launch` (issue 16).

The runner's own phase clock (ModelRunner.step_timing) splits submit() into `prepare` (states,
packing the batch: everything up to the forward's launch) and `sample_launch` (logits,
verification, sampling: everything after it). On a GPU both are host time only; on the CPU
`sample_launch` also runs the LM head and argmax in line, so those two are timed by wrapping them
and subtracted. A tiny random Llama (vocab 256, 2 layers) keeps that compute small, and the
decode "graphs" run as on the GPU (KILN_CPU_FAKE_GRAPHS: the padded, graph-keyed path).

Two workloads at batch 1, greedy: plain decoding, and K = 4 verification steps (the oracle
proposer, accepting by its own draw at mean acceptance length L = 3). Medians over every step
with the same shape, over several repeats.

    OMP_NUM_THREADS=1 python benchmarks/step_host_cpu.py [--repeats 5] [--out x.json] [--profile]

--profile prints cProfile's top functions of submit() for each workload as well. The engine's
numbers move with the machine's load (the forward between two steps evicts the host code's
caches, and other processes share the cores); `direct` beside them calls InputBuffers.prepare
alone in a tight loop, the same two step shapes, for a steadier before/after of the packing.
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import json
import os
import pstats
import statistics
import tempfile
import time

os.environ.setdefault("KILN_CPU_FAKE_GRAPHS", "1")

import torch

from kiln import LLM
from kiln.sampling_params import SamplingParams
from kiln.spec_decode.oracle import acceptance_rate_for_length

TINY = dict(
    architectures=["LlamaForCausalLM"],
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    rms_norm_eps=1e-5,
    initializer_range=0.15,
    bos_token_id=1,
    eos_token_id=2,
)


def tiny_model(path: str) -> str:
    import transformers

    cfg = dict(TINY)
    config = transformers.AutoConfig.for_model("llama", **cfg)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    return path


def _timed(fn, acc: list):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            acc[-1] += time.perf_counter() - t

    return wrapper


def measure(llm: LLM, prompt: list[int], max_tokens: int, repeats: int, profile: bool) -> dict:
    engine = llm.engine
    runner = engine.executor.runner
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))  # warm
    # Compute done in line on the CPU after the forward (device work on a GPU): per step.
    compute: list[float] = [0.0]
    prep: list[float] = [0.0]
    runner.model.compute_logits = _timed(runner.model.compute_logits, compute)
    runner.sampler.argmax = _timed(runner.sampler.argmax, compute)
    runner.inputs.prepare = _timed(runner.inputs.prepare, prep)
    submit = runner.submit
    rows: list[tuple[int, float, float, float]] = []  # (tokens, prepare, sample_launch, inputs)

    def submit_and_record(sched):
        compute[-1] = prep[-1] = 0.0
        out = submit(sched)
        # The phase boundaries submit() records on its step (ModelRunner._record_timing's t0-t3).
        step = runner._in_flight[-1] if runner._in_flight else None
        if out and step is not None and len(step.times) == 4:
            t0, t1, t2, t3 = step.times
            launch = (t3 - t2) - compute[-1]
            rows.append((sched.total_num_scheduled_tokens, t1 - t0, launch, prep[-1]))
        return out

    runner.submit = submit_and_record
    profiler = cProfile.Profile() if profile else None
    try:
        for _ in range(repeats):
            engine.add_request(prompt, params, request_id="p")
            if profiler:
                profiler.enable()
            while engine.has_unfinished_requests():
                for delta in engine.step():
                    if delta.finished:
                        engine.finished_output(delta.request_id)
            if profiler:
                profiler.disable()
    finally:
        del runner.submit, runner.inputs.prepare, runner.model.compute_logits
        del runner.sampler.argmax
    if profiler:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
    by_shape: dict[int, list] = {}
    for r in rows[1:]:  # the first is the prompt's prefill
        by_shape.setdefault(r[0], []).append(r)
    out = {}
    for tokens, rs in sorted(by_shape.items()):
        if len(rs) < 5:
            continue
        out[f"{tokens} tokens"] = {
            "steps": len(rs),
            "prepare_us": round(statistics.median(r[1] for r in rs) * 1e6, 1),
            "inputs.prepare_us": round(statistics.median(r[3] for r in rs) * 1e6, 1),
            "sample_launch_us": round(statistics.median(r[2] for r in rs) * 1e6, 1),
        }
    return out


def direct(iters: int = 3000) -> dict:
    """InputBuffers.prepare alone: a batch-1 decode (padded to graph size 1) and a batch-1
    verification of 4 drafts flattened to 5 rows padded to 8; median and 10th percentile."""
    from kiln.runtime.input_batch import CachedRequestState, InputBuffers

    buf = InputBuffers(2048, 8, 1024, 16, torch.device("cpu"))

    def state(drafts: list[int]) -> CachedRequestState:
        s = CachedRequestState("r", list(range(64)), list(range(100)), SamplingParams(),
                               list(range(11)), 163)  # fmt: skip
        s.row = buf.add_request(s.block_ids)
        s.spec_token_ids = drafts
        return s

    decode, verify = state([]), state([1, 2, 3, 4])
    steps = {
        "decode": lambda: buf.prepare([decode], [1], 1, False),
        "verify": lambda: buf.prepare([verify], [5], 8, True),
    }
    out = {}
    with torch.inference_mode():
        for name, fn in steps.items():
            for _ in range(200):
                fn()
            times = []
            for _ in range(iters):
                t = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t)
            times.sort()
            out[name] = {
                "median_us": round(times[len(times) // 2] * 1e6, 1),
                "p10_us": round(times[len(times) // 10] * 1e6, 1),
            }
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--length", type=float, default=3.0)
    p.add_argument("--max-tokens", type=int, default=200)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    torch.set_num_threads(1)
    from kiln.bench.report import environment

    record: dict = {"env": environment(torch.device("cpu")), "args": vars(args)}
    record["direct"] = direct()
    with tempfile.TemporaryDirectory() as d:
        model = tiny_model(d)
        common = dict(kv_cache_memory_gb=0.05, max_num_seqs=8, num_threads=1)
        prompt = list(range(10, 74))
        plain = LLM(model, **common)
        record["decode"] = measure(plain, prompt, args.max_tokens, args.repeats, args.profile)
        del plain
        rate = acceptance_rate_for_length(args.length, args.k)
        spec = {"method": "oracle", "num_speculative_tokens": args.k, "acceptance_rate": rate,
                "oracle_accept_by_draw": True, "oracle_always_propose": True}  # fmt: skip
        llm = LLM(model, speculative_config=spec, **common)
        record["verify"] = measure(llm, prompt, args.max_tokens, args.repeats, args.profile)
    for name in ("decode", "verify"):
        for shape, r in record[name].items():
            print(f"{name:7s} {shape:10s} {r}")
        print(f"{name:7s} direct     inputs.prepare {record['direct'][name]}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
