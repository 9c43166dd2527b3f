"""Greedy token ids (and text, with --tokenizer) of N requests through LLMEngine.step, as JSON:
run once per tree (PYTHONPATH picks the kiln) and compare the files.

    PYTHONPATH=/tmp/host_before python benchmarks/results/2026-12-02-cpu-step-host-512/compare_outputs.py before.json 600 [--tokenizer]
    python benchmarks/results/2026-12-02-cpu-step-host-512/compare_outputs.py after.json 600 [--tokenizer]
    cmp before.json after.json
"""  # noqa: E501

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

os.environ.setdefault("KILN_CPU_FAKE_GRAPHS", "1")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import torch
from step_host_batch_cpu import build_engine, tiny_model

from kiln.bench.workload import synthetic_requests
from kiln.sampling_params import SamplingParams


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("num_requests", type=int)
    p.add_argument("--tokenizer", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(1)
    out: dict[str, list] = {}
    with tempfile.TemporaryDirectory() as d:
        engine = build_engine(tiny_model(d, args.tokenizer), argparse.Namespace(batch=512))
        vocab = engine.model_config.vocab_size
        requests = synthetic_requests(args.num_requests, "128", "128", vocab, 0, (2,))
        params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
        for i, r in enumerate(requests):
            engine.add_request(r.prompt_token_ids, params, request_id=str(i))
        while engine.has_unfinished_requests():
            for delta in engine.step():
                if delta.finished:
                    o = engine.finished_output(delta.request_id).outputs[0]
                    out[delta.request_id] = [o.token_ids, o.text]
    with open(args.out, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
