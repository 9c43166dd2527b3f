"""Speculative decoding on the GPU as a function of acceptance: Llama-3.1-8B dummy bf16.

Random weights accept nothing a real drafter proposes, so the oracle proposer stands in, deciding
acceptance by its own seeded draw: each verification accepts the first n of its K drafts with
P(n >= i) = a^i, so the mean acceptance length (tokens per verification step) is
1 + a + ... + a^K whatever the random weights make of the tokens; the target's forward and
verification run as for any proposer (a step's cost does not depend on which tokens it
verifies). In one run:

1. plain decoding (async scheduling, CUDA graphs): decode tok/s per batch size;
2. the speculative engine with K wrong drafts every step (a = 0, rejected by the target's own
   verification): each step verifies K + 1 tokens and emits one, so its time per token is the
   verification step's cost against a plain decode step;
3. the oracle at the rates that give mean acceptance lengths 2, 3 and 4 (batch 1), and at 3 for
   the larger batch sizes (where speculation stops paying: the K-by-batch-size policy follows
   it); each row reports the measured acceptance length beside the set one;
4. EAGLE-3 with a random head of the target's shapes (Llama-3.1-8B: hidden 4096, a 32,000-token
   draft vocabulary), K drafts a step at batch 1: it accepts next to nothing, so a step emits
   ~1 token and its time minus the a = 0 verification step's is the head's own cost.

Each engine runs in a process of its own (`--phase`; the default `all` runs the phases one after
another as child processes and merges their JSON), since an engine's GPU memory is not given back
within a process. Phases: `plain`, `spec` (async scheduling, the default on CUDA), `spec-sync`
(the same at batch 1 with async scheduling off: what that overlap buys), `eagle3`.

    python3 benchmarks/spec_decode_gpu.py --model llama-3.1-8b --load-format dummy \\
        --dtype bfloat16 --out spec_decode_gpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

from kiln.bench.metrics import RequestTiming, throughput_report
from kiln.bench.oracle import Oracle, acceptance_rate_for_length, oracle_config
from kiln.bench.workload import synthetic_requests
from kiln.config import EngineConfig
from kiln.engine.llm_engine import LLMEngine
from kiln.runtime.model_loader import find_model_source
from kiln.sampling_params import SamplingParams


def run(engine: LLMEngine, prompts: list[list[int]], output_len: int):
    """All prompts at once, greedy, EOS ignored: (timings, output token ids)."""
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    timings, outputs = {}, {}
    for i, prompt in enumerate(prompts):
        rid = f"r{i}"
        timings[rid] = RequestTiming(time.perf_counter(), [], len(prompt))
        outputs[rid] = []
        engine.add_request(prompt, params, request_id=rid)
    while engine.has_unfinished_requests():
        deltas = engine.step()
        now = time.perf_counter()
        for delta in deltas:
            t = timings[delta.request_id]
            for c in delta.outputs:
                t.token_times.extend([now] * len(c.token_ids))
                outputs[delta.request_id].extend(c.token_ids)
                t.num_draft_tokens += c.num_draft_tokens
                t.num_accepted_tokens += c.num_accepted_tokens
                t.num_spec_steps += c.num_spec_steps
            if delta.finished:
                engine.finished_output(delta.request_id)
    keys = [f"r{i}" for i in range(len(prompts))]
    return [timings[k] for k in keys], [outputs[k] for k in keys]


def measure(engine, prompts, output_len, label, k=0):
    timings, outputs = run(engine, prompts, output_len)
    report = throughput_report(timings)
    report["decode_tok_s_per_request"] = 1000.0 / report["tpot"]["mean_ms"]
    b = len(prompts)
    sd = report.get("spec_decode", {})
    print(
        f"{label:28s} batch {b:3d}: {report['output_tok_s']:8.1f} tok/s, TPOT "
        f"{report['tpot']['mean_ms']:.2f} ms, acceptance length "
        f"{sd.get('mean_acceptance_length')}"
    )
    return report, outputs


def write_random_eagle3_head(path: str, cfg, dtype: str) -> str:  # cfg: the target's ModelConfig
    """A random EAGLE-3 head (published layout) of the target's shapes."""
    from safetensors.torch import save_file

    h, heads, kv, hd = (
        cfg.hidden_size,
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.head_dim,
    )
    inter, draft_vocab = cfg.intermediate_size, min(32_000, cfg.vocab_size)
    torch_dtype = getattr(torch, dtype)
    g = torch.Generator().manual_seed(0)

    def rand(*shape):
        return (torch.randn(*shape, generator=g) * 0.02).to(torch_dtype)

    m = "midlayer."
    tensors = {
        "fc.weight": rand(h, 3 * h),
        m + "hidden_norm.weight": torch.ones(h, dtype=torch_dtype),
        m + "input_layernorm.weight": torch.ones(h, dtype=torch_dtype),
        m + "post_attention_layernorm.weight": torch.ones(h, dtype=torch_dtype),
        m + "self_attn.q_proj.weight": rand(heads * hd, 2 * h),
        m + "self_attn.k_proj.weight": rand(kv * hd, 2 * h),
        m + "self_attn.v_proj.weight": rand(kv * hd, 2 * h),
        m + "self_attn.o_proj.weight": rand(h, heads * hd),
        m + "mlp.gate_proj.weight": rand(inter, h),
        m + "mlp.up_proj.weight": rand(inter, h),
        m + "mlp.down_proj.weight": rand(h, inter),
        "norm.weight": torch.ones(h, dtype=torch_dtype),
        "lm_head.weight": rand(draft_vocab, h),
        "d2t": torch.zeros(draft_vocab, dtype=torch.int64),  # the first draft_vocab ids
    }
    config = {**cfg.to_hf_dict(), "architectures": ["LlamaForCausalLMEagle3"],
              "num_hidden_layers": 1, "draft_vocab_size": draft_vocab}  # fmt: skip
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return path


PHASES = ("plain", "spec", "spec-sync", "eagle3")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--load-format", default="dummy")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="auto")
    p.add_argument("--input-len", default="128")
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--lengths", type=float, nargs="+", default=[2.0, 3.0, 4.0])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 32])
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument(
        "--eagle3-head",
        default="random",
        help="an EAGLE-3 head directory, 'random' (the target's shapes), or '' to skip",
    )
    p.add_argument("--eagle3-batches", type=int, nargs="+", default=[1])
    p.add_argument("--phase", choices=("all", *PHASES), default="all")
    p.add_argument("--phases", nargs="+", choices=PHASES, default=list(PHASES))
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.phase != "all":
        record = run_phase(args)
        with open(args.out, "w") as f:
            json.dump(record, f, default=str)
        return

    record: dict = {"args": vars(args)}
    for phase in args.phases:
        if phase == "eagle3" and not args.eagle3_head:
            continue
        part = tempfile.mktemp(suffix=f"-{phase}.json")
        argv = [a for a in sys.argv[1:]]
        if "--out" in argv:  # the child writes its part; the parent the whole
            i = argv.index("--out")
            del argv[i : i + 2]
        cmd = [sys.executable, os.path.abspath(__file__), *argv, "--phase", phase, "--out", part]
        print(f"--- phase {phase}", flush=True)
        t0 = time.perf_counter()
        rc = subprocess.run(cmd).returncode
        record.setdefault("phase_seconds", {})[phase] = round(time.perf_counter() - t0, 1)
        if rc != 0 or not os.path.exists(part):
            record.setdefault("failed_phases", {})[phase] = f"exit {rc}"
            continue
        with open(part) as f:
            record.update(json.load(f))
        os.remove(part)
    derive(record)
    record["git_rev"] = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    record["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    if torch.cuda.is_available():
        record["gpu"] = torch.cuda.get_device_name()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1, default=str)
        print(f"wrote {args.out}")


def derive(record: dict) -> None:
    """The ratios across phases (batch sizes are string keys once a part went through JSON)."""
    plain = record.get("plain", {})
    for key in ("verify_a0", "verify_a0_sync"):
        for b, report in record.get(key, {}).items():
            base = plain.get(b)
            if base is None:
                continue
            report["tpot_vs_plain"] = report["tpot"]["mean_ms"] / base["tpot"]["mean_ms"]
    for key in ("oracle", "oracle_sync"):
        for name, report in record.get(key, {}).items():
            base = plain.get(name.split("@")[0])
            if base is not None:
                report["speedup_vs_plain"] = report["output_tok_s"] / base["output_tok_s"]
    for b, report in record.get("eagle3", {}).items():
        verify = record.get("verify_a0", {}).get(b)
        if verify is not None:
            tokens = report.get("spec_decode", {}).get("mean_acceptance_length") or 1.0
            step_ms = report["tpot"]["mean_ms"] * tokens
            report["head_ms_per_step"] = step_ms - verify["tpot"]["mean_ms"]
            print(f"eagle3 batch {b}: head cost per step ~{report['head_ms_per_step']:.2f} ms")
    for key in ("oracle", "oracle_sync"):
        for name, report in record.get(key, {}).items():
            print(
                f"{key:12s} {name:8s}: {report['output_tok_s']:8.1f} tok/s "
                f"({report.get('speedup_vs_plain', 0):.2f}x plain), measured L "
                f"{report.get('measured_mean_acceptance_length')}"
            )


def run_phase(args) -> dict:
    """One phase's engine, in this process: its part of the record."""
    k = args.k
    base = dict(
        model=args.model,
        load_format=args.load_format,
        dtype=args.dtype,
        device=args.device,
        max_model_len=args.max_model_len,
        enforce_eager=args.enforce_eager,
        # Every verification step must fit the decode buffers as one row per token.
        max_num_seqs=max(args.batches) * (k + 1),
    )
    # The crossover is measured, not assumed: K drafts at every batch size here.
    spec = oracle_config(
        k,
        Oracle(acceptance_rate=0.0, always_propose=True),
        num_speculative_tokens_by_batch_size={max(args.batches): k},
    )
    batches, suffix = args.batches, ""
    if args.phase == "spec-sync":  # batch 1 only: the overlap's A/B
        base["async_scheduling"], batches, suffix = False, [1], "_sync"
    if args.phase == "eagle3":
        head = args.eagle3_head
        if head == "random":  # the target's config without building an engine for it
            target = find_model_source(args.model, args.load_format).config
            head = write_random_eagle3_head(tempfile.mkdtemp(), target, args.dtype)
        spec = {"method": "eagle3", "model": head, "num_speculative_tokens": k}
    engine = LLMEngine(
        EngineConfig(**base, speculative_config=None if args.phase == "plain" else spec)
    )
    vocab = engine.model_config.vocab_size
    requests = synthetic_requests(
        max(args.batches), args.input_len, str(args.output_len), vocab, seed=0,
        avoid_ids=engine.eos_token_ids,
    )  # fmt: skip
    prompts = [r.prompt_token_ids for r in requests]
    warm = synthetic_requests(2, args.input_len, "8", vocab, seed=1, avoid_ids=engine.eos_token_ids)
    run(engine, [r.prompt_token_ids for r in warm], 8)
    record: dict = {}
    if args.phase == "plain":
        record["plain"] = {b: measure(engine, prompts[:b], args.output_len, "plain")[0]
                           for b in batches}  # fmt: skip
        return record
    if args.phase == "eagle3":
        record["eagle3"] = {}
        for b in args.eagle3_batches:
            report, _ = measure(engine, prompts[:b], args.output_len, "eagle3 (random head)", k)
            record["eagle3"][b] = report
        return record
    proposer = engine.executor.runner.proposer
    record["verify_a0" + suffix], record["oracle" + suffix] = {}, {}
    label = "" if not suffix else " sync"
    for b in batches:
        proposer.references, proposer.acceptance_rate = [], 0.0
        report, _ = measure(engine, prompts[:b], args.output_len, f"verify (a=0){label}", k)
        record["verify_a0" + suffix][b] = report
    proposer.always_propose = False
    proposer.decides_acceptance = True  # oracle_accept_by_draw from here on
    for b in batches:
        lengths = args.lengths if b == 1 else [3.0]
        if suffix:
            lengths = [3.0]
        for length in lengths:
            proposer.acceptance_rate = acceptance_rate_for_length(length, k)
            report, _ = measure(
                engine, prompts[:b], args.output_len, f"oracle L={length}{label}", k
            )
            measured = report.get("spec_decode", {}).get("mean_acceptance_length")
            report["target_mean_acceptance_length"] = length
            report["measured_mean_acceptance_length"] = measured
            report["acceptance_rate_per_token"] = proposer.acceptance_rate
            print(f"{'':28s} set L {length}, measured L {measured}")
            record["oracle" + suffix][f"{b}@{length}"] = report
    return record


if __name__ == "__main__":
    main()
