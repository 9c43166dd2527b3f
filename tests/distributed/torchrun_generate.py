"""Run under torchrun by tests/distributed/test_parallel.py: rank 0 prints the greedy tokens of
a few prompts as JSON; the other ranks serve as workers inside LLM() and exit 0 when rank 0 is
done."""

import json
import sys

from kiln import LLM, SamplingParams

model, tp, pp = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
prompts = json.loads(sys.argv[4])
llm = LLM(
    model,
    dtype="float32",
    num_threads=1,
    tensor_parallel_size=tp,
    pipeline_parallel_size=pp,
    distributed_timeout_s=120,
)
outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6))
print("TOKENS " + json.dumps([o.outputs[0].token_ids for o in outputs]), flush=True)
llm.shutdown()
