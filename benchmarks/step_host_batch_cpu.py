"""The host's Python per decode step at a large batch, on the CPU (issue 13's 128/128 target).

`kiln bench throughput`'s path (kiln.bench.offline.run_kiln over an LLMEngine, async scheduling
on, as on a GPU) drives a tiny random Llama (vocab 256, 2 layers, hidden 64: its forward is
cheap) through N requests of 128 in / 128 out, EOS ignored, at most 512 running; the decode
"graphs" run as on the GPU (KILN_CPU_FAKE_GRAPHS: the padded, graph-keyed path). Every
engine.step() whose submitted step is a pure decode of `--batch` rows is split into spans
(perf_counter around the engine's and the runner's methods, inclusive):

    engine_step        the whole engine.step()
      schedule           Scheduler.schedule
      submit             ModelRunner.submit
        update_states      its _update_states
        prepare            InputBuffers.prepare
        forward*           the model's forward (device work on a GPU: a graph replay there)
        logits*            compute_logits (device work on a GPU)
        sampling_build     SamplingMetadataBuilder.build
        sampler            Sampler.__call__ (with its argmax*, device work on a GPU)
      collect            ModelRunner.collect (the step's _finish: ids to lists, outputs)
      update             Scheduler.update
      process            OutputProcessor.process
    driver             run_kiln's own loop between two engine.step() calls (token times,
                       finished_output, new requests)
    gc                 the cyclic GC's pauses inside engine.step() (gc_mean_us: their mean a
                       step; the median step has none)

`host` = engine_step - forward - logits - argmax + driver: the host's Python a step, which on
a GPU must stay under the GPU's step time for the GPU to stay busy. Medians over the steps;
a fresh engine each repeat, all in one process.

    OMP_NUM_THREADS=1 python benchmarks/step_host_batch_cpu.py [--num-requests 1024]
        [--batch 512] [--repeats 3] [--tokenizer] [--profile] [--out x.json]

--profile prints cProfile's top functions over the measured steps (its overhead inflates the
Python-heavy spans: use the spans' numbers for before/after, the profile for where).
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import gc
import json
import os
import pstats
import statistics
import sys
import tempfile
import time

os.environ.setdefault("KILN_CPU_FAKE_GRAPHS", "1")

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from step_host_cpu import TINY

from kiln.bench.offline import run_kiln
from kiln.bench.workload import synthetic_requests
from kiln.config import EngineConfig
from kiln.engine.llm_engine import LLMEngine

SPANS = (
    "engine_step",
    "schedule",
    "submit",
    "update_states",
    "prepare",
    "forward",
    "logits",
    "sampling_build",
    "sampler",
    "argmax",
    "collect",
    "update",
    "process",
    "driver",
    "gc",
)
COMPUTE = ("forward", "logits", "argmax")  # device work on a GPU, done in line on the CPU
ENGINE_PARTS = ("schedule", "submit", "collect", "update", "process")
SUBMIT_PARTS = ("update_states", "prepare", "forward", "logits", "sampling_build", "sampler")


class _Clock:
    """Per-step span totals: `acc` is reset at the start of each engine.step(). `gc` is the
    cyclic GC's pauses inside the step (in whichever span allocated then)."""

    def __init__(self) -> None:
        self.acc = dict.fromkeys(SPANS, 0.0)
        self._gc_start = 0.0

    def on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_start = time.perf_counter()
        else:
            self.acc["gc"] += time.perf_counter() - self._gc_start

    def wrap(self, name: str, fn):
        acc = self.acc

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                acc[name] += time.perf_counter() - t

        return timed


class _TimedSampler:
    """The runner calls `self.sampler(logits, metadata)` and `self.sampler.argmax(...)`."""

    def __init__(self, sampler, clock: _Clock) -> None:
        self._sampler = sampler
        self._call = clock.wrap("sampler", sampler.__call__)
        self.argmax = clock.wrap("argmax", sampler.argmax)
        sampler.argmax = self.argmax  # the sampler's own calls of it too

    def __call__(self, *args, **kwargs):
        return self._call(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._sampler, name)


def tiny_model(path: str, with_tokenizer: bool) -> str:
    """step_host_cpu's tiny Llama; with the tests' byte-level BPE tokenizer (384 ids) beside
    it, the output processor detokenizes every step, as it does for a real checkpoint (the
    H200's dummy-weight runs have no tokenizer)."""
    import transformers

    cfg = dict(TINY)
    tokenizer = None
    if with_tokenizer:
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        from tests.tiny_tokenizer import build_tokenizer

        tokenizer = build_tokenizer()
        cfg["vocab_size"] = len(tokenizer)
    config = transformers.AutoConfig.for_model("llama", **cfg)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(path)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    return path


def build_engine(model: str, args: argparse.Namespace) -> LLMEngine:
    config = EngineConfig(
        model=model,
        max_model_len=256,
        max_num_seqs=args.batch,
        max_num_batched_tokens=8192,
        kv_cache_memory_gb=0.25,
        async_scheduling=True,  # as on a GPU: the next step is scheduled before this one's ids
        num_threads=1,
    )
    return LLMEngine(config)


def measure(engine: LLMEngine, args: argparse.Namespace, profile: cProfile.Profile | None):
    runner = engine.executor.runner
    clock = _Clock()
    acc = clock.acc
    sched_wrapped = clock.wrap("schedule", engine.scheduler.schedule)
    submitted: list = []

    def schedule():
        out = sched_wrapped()
        submitted.append(out)
        return out

    engine.scheduler.schedule = schedule
    engine.scheduler.update = clock.wrap("update", engine.scheduler.update)
    engine.output_processor.process = clock.wrap("process", engine.output_processor.process)
    runner.submit = clock.wrap("submit", runner.submit)
    runner.collect = clock.wrap("collect", runner.collect)
    runner._update_states = clock.wrap("update_states", runner._update_states)
    runner.inputs.prepare = clock.wrap("prepare", runner.inputs.prepare)
    runner.model.forward = clock.wrap("forward", runner.model.forward)
    runner.model.compute_logits = clock.wrap("logits", runner.model.compute_logits)
    runner.sampling.build = clock.wrap("sampling_build", runner.sampling.build)
    runner.sampler = _TimedSampler(runner.sampler, clock)

    rows: list[dict] = []
    gc.callbacks.append(clock.on_gc)
    step = engine.step
    last_end = [None]

    def timed_step():
        t0 = time.perf_counter()
        driver = t0 - last_end[0] if last_end[0] is not None else 0.0
        for k in acc:
            acc[k] = 0.0
        submitted.clear()
        steady = False
        if profile is not None:
            profile.enable()
        try:
            return step()
        finally:
            t1 = time.perf_counter()
            if profile is not None:
                profile.disable()
            last_end[0] = t1
            sched = submitted[0] if submitted else None
            steady = (
                sched is not None
                and sched.total_num_scheduled_tokens == args.batch
                and len(sched.num_scheduled_tokens) == args.batch
                and not sched.new_requests
            )
            if steady:
                row = dict(acc)
                row["engine_step"] = t1 - t0
                row["driver"] = driver
                rows.append(row)

    engine.step = timed_step
    requests = synthetic_requests(
        args.num_requests, "128", "128", engine.model_config.vocab_size, 0, engine.eos_token_ids
    )
    t = time.perf_counter()
    try:
        timings = run_kiln(engine, requests, progress=False)
    finally:
        gc.callbacks.remove(clock.on_gc)
    wall = time.perf_counter() - t
    num_tokens = sum(len(r.token_times) for r in timings)
    assert num_tokens == 128 * args.num_requests, num_tokens
    rows = rows[1:]  # the first steady call follows a prefill step's collect: not a decode's
    for r in rows:
        r["host"] = r["engine_step"] - sum(r[c] for c in COMPUTE) + r["driver"]
        # What the spans above do not cover: the engine's own lines, and submit's.
        r["engine_other"] = r["engine_step"] - sum(r[c] for c in ENGINE_PARTS)
        r["submit_other"] = r["submit"] - sum(r[c] for c in SUBMIT_PARTS)
    out: dict = {"steps": len(rows), "run_s": round(wall, 3), "tok_s": round(num_tokens / wall)}
    for name in (*SPANS, "engine_other", "submit_other", "host"):
        out[name + "_us"] = round(statistics.median(r[name] for r in rows) * 1e6, 1)
    # The mean counts the GC's collections, which land in whichever span allocates then.
    out["host_mean_us"] = round(statistics.fmean(r["host"] for r in rows) * 1e6, 1)
    out["gc_mean_us"] = round(statistics.fmean(r["gc"] for r in rows) * 1e6, 1)
    out["host_per_row_us"] = round(out["host_us"] / args.batch, 2)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--num-requests", type=int, default=1024)
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--tokenizer", action="store_true", help="detokenize (see tiny_model)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    torch.set_num_threads(1)
    import kiln
    from kiln.bench.report import environment

    record: dict = {"env": environment(torch.device("cpu")), "args": vars(args), "runs": []}
    record["kiln_path"] = os.path.dirname(kiln.__file__)  # which tree ran (PYTHONPATH)
    profile = cProfile.Profile() if args.profile else None
    with tempfile.TemporaryDirectory() as d:
        model = tiny_model(d, args.tokenizer)
        for _ in range(args.repeats):
            engine = build_engine(model, args)
            record["runs"].append(measure(engine, args, profile))
            print(json.dumps(record["runs"][-1]))
            del engine
    runs = record["runs"]
    record["median"] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    print("median", json.dumps(record["median"]))
    if profile is not None:
        # The host's Python only (the forward's torch calls are device work on a GPU).
        host_code = r"kiln/(engine|kv_cache|runtime|bench|sampling)"
        pstats.Stats(profile).sort_stats("tottime").print_stats(host_code, 40)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
