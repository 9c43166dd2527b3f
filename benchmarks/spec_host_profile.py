"""The host's share of a speculative step, measured on the CPU (issue 16's missing ~1 ms a step).

A batch-1 speculative step on the H200 took 5.42-5.86 ms of wall against 4.79 ms of GPU time:
what the host does between one step's sampled ids and the next step's launch is not hidden. On
the CPU the device's work (the forward, the LM head, argmax) is computed in-line, so this script
times every engine phase by wrapping it and subtracts the compute phases: what is left is the
host's own work per step, by phase. The real SmolLM2-135M (its tokenizer makes detokenization
real), K = 4, the oracle accepting by its own draw at mean acceptance length L (default 3), batch
1, greedy; plain decoding beside it for the same phases.

    OMP_NUM_THREADS=1 python benchmarks/spec_host_profile.py [--async-scheduling] [--out x.json]

Numbers on this 2-core shared machine are slower than an H200 host's CPU; their proportions are
the point (which phase is worth cutting), and a before/after of one change in one run.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from collections import defaultdict

from kiln import LLM
from kiln.checkpoint.default_model import default_model_path
from kiln.sampling_params import SamplingParams
from kiln.spec_decode.oracle import acceptance_rate_for_length

# Phases that are device work on a GPU (computed in-line here): subtracted from the host's time.
COMPUTE = ("forward", "compute_logits", "argmax")


class Timers:
    def __init__(self) -> None:
        self.total: dict[str, float] = defaultdict(float)
        self._undo: list[tuple[object, str, object]] = []

    def wrap(self, obj: object, name: str, label: str) -> None:
        fn = getattr(obj, name)
        self._undo.append((obj, name, vars(obj).get(name)))

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.total[label] += time.perf_counter() - t

        setattr(obj, name, timed)

    def restore(self) -> None:
        """Put back what was there: an instance attribute, or nothing (the class's method)."""
        for obj, name, original in reversed(self._undo):
            if original is None:
                delattr(obj, name)
            else:
                setattr(obj, name, original)


def instrument(llm: LLM) -> Timers:
    engine = llm.engine
    runner = engine.executor.runner
    runner.step_timing = {}
    t = Timers()
    t.wrap(engine, "step", "step")
    t.wrap(engine.scheduler, "schedule", "scheduler.schedule")
    t.wrap(engine.scheduler, "update", "scheduler.update")
    t.wrap(engine.output_processor, "process", "output_processor.process")
    t.wrap(runner, "submit", "runner.submit")
    t.wrap(runner, "collect", "runner.collect")
    t.wrap(runner.inputs, "prepare", "inputs.prepare")
    t.wrap(runner, "_update_states", "runner._update_states")
    t.wrap(runner, "_verify", "runner._verify")
    t.wrap(runner, "_finish", "runner._finish")
    t.wrap(runner.model, "forward", "forward")
    t.wrap(runner.model, "compute_logits", "compute_logits")
    t.wrap(runner.sampler, "argmax", "argmax")
    if runner.proposer is not None:
        t.wrap(runner.proposer, "propose", "proposer.propose")
    return t


def profile(llm: LLM, prompt: list[int], max_tokens: int, repeats: int) -> dict:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))  # warm
    runs = []
    for _ in range(repeats):
        timers = instrument(llm)
        engine = llm.engine
        engine.add_request(prompt, params, request_id="p")
        steps, tokens = 0, 0
        t0 = time.perf_counter()
        while engine.has_unfinished_requests():
            for delta in engine.step():
                tokens += sum(len(o.token_ids) for o in delta.outputs)
                if delta.finished:
                    engine.finished_output(delta.request_id)
            steps += 1
        wall = time.perf_counter() - t0
        timers.restore()
        ms = {k: v * 1000 / steps for k, v in timers.total.items()}
        compute = sum(ms.get(k, 0.0) for k in COMPUTE)
        ms["host (step - compute)"] = ms["step"] - compute
        ms["outside step (the driving loop)"] = wall * 1000 / steps - ms["step"]
        # The runner's own phase clock (ModelRunner.step_timing): submit up to the forward's
        # launch ("prepare"), after it ("sample_launch": logits, verification, sampling), and
        # collect's work once the ids are back ("finish", the proposer included).
        rt = engine.executor.runner.step_timing
        for name in ("prepare", "sample_launch", "finish"):
            ms["runner." + name] = rt.get(name, 0.0) * 1000 / steps
        engine.executor.runner.step_timing = None
        # On a GPU, between one step's ids coming back and the next step's forward launching,
        # the host does this whatever the engine overlaps: apply the tokens, schedule, prepare.
        ms["critical path (GPU idle)"] = (
            ms["runner.finish"] + ms["scheduler.update"] + ms["scheduler.schedule"]
            + ms["runner.prepare"]
        )  # fmt: skip
        # ... and this can run while a step is on the device (it does under async scheduling):
        # the launches after the forward, the outputs, the caller's loop.
        ms["overlappable"] = (
            ms["runner.sample_launch"] - ms.get("compute_logits", 0.0) - ms.get("argmax", 0.0)
            + ms["output_processor.process"] + ms["outside step (the driving loop)"]
        )  # fmt: skip
        runs.append({"steps": steps, "tokens": tokens, "ms_per_step": ms})
    # The median over repeats of each phase (a shared machine: single runs are noisy).
    keys = runs[0]["ms_per_step"].keys()
    median = {k: round(statistics.median(r["ms_per_step"][k] for r in runs), 4) for k in keys}
    return {"steps": runs[0]["steps"], "tokens": runs[0]["tokens"], "ms_per_step": median}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--length", type=float, default=3.0)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--async-scheduling", action="store_true")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    model = default_model_path()
    common = dict(kv_cache_memory_gb=0.1, max_num_seqs=8, num_threads=1,
                  async_scheduling=args.async_scheduling)  # fmt: skip
    prompt = list(range(100, 164))
    record: dict = {"args": vars(args)}
    plain = LLM(model, **common)
    record["plain"] = profile(plain, prompt, args.max_tokens, args.repeats)
    del plain
    rate = acceptance_rate_for_length(args.length, args.k)
    spec = {"method": "oracle", "num_speculative_tokens": args.k, "acceptance_rate": rate,
            "oracle_accept_by_draw": True}  # fmt: skip
    llm = LLM(model, speculative_config=spec, **common)
    record["spec"] = profile(llm, prompt, args.max_tokens, args.repeats)
    for name in ("plain", "spec"):
        r = record[name]
        print(f"== {name}: {r['steps']} steps, {r['tokens']} tokens, ms per step:")
        for k, v in sorted(r["ms_per_step"].items(), key=lambda kv: -kv[1]):
            print(f"   {k:34s} {v:8.3f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
