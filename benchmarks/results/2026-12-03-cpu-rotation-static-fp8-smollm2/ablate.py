"""Which projections' static input scales cost SmolLM2's static FP8 its accuracy: every
projection's activations quantized per tensor with the build's static scales (amax of 8
calibration windows) except one kind's, quantized per token instead, and the reverse; weights
rounded to nearest per channel; scored as the build's check scores (word perplexity on held-out
WikiText-2 articles, the engine's own fp8_linear arithmetic in float32).

    OMP_NUM_THREADS=1 python ablate.py OUT.json N_ARTICLES [MODEL_DIR]

A trimmed copy of ../2026-12-02-cpu-static-fp8-peers-smollm2/tries.py (the same arithmetic)."""

import json
import math
import sys
import time

import torch

from kiln.builder import quantize as bq
from kiln.builder.accuracy import CALIBRATION_FILE, HELD_OUT_FILE, wikitext_articles
from kiln.eval.perplexity import count_words, prefix_token_id, token_loglikelihoods
from kiln.kernels.reference import quantize_fp8
from kiln.layers.linear import Linear, LinearMethod
from kiln.llm import LLM
from kiln.quantization.calibration import calibrate_input_scales
from kiln.sampling_params import SamplingParams

KINDS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


class Real(LinearMethod):
    def __init__(self, codes, scale, input_scale):
        self.codes, self.scale = codes, scale.view(-1)
        self.input_scale = None if input_scale is None else torch.tensor(input_scale)

    def create_weights(self, layer, dtype):
        raise RuntimeError

    def apply(self, layer, ops, x):
        return ops.fp8_linear(x, self.codes, self.scale, self.input_scale, layer.bias)


def main() -> None:
    n_articles = int(sys.argv[2])
    t0 = time.time()
    kw = {"model": sys.argv[3]} if len(sys.argv) > 3 else {}
    llm = LLM(dtype="float32", enable_prefix_caching=False, **kw)
    model = llm.engine.executor.runner.model
    tok = llm.get_tokenizer()
    docs = wikitext_articles(HELD_OUT_FILE, n_articles)
    ids = [tok.encode(d, add_special_tokens=False) for d in docs]
    words = [count_words(d) for d in docs]

    def score():
        lls = token_loglikelihoods(llm, ids, prefix_token_id(llm))
        per = [math.exp(-ll / w) for ll, w in zip(lls, words)]
        return per + [math.exp(-math.fsum(lls) / sum(words))]

    source = score()
    print("source", [round(p, 4) for p in source], flush=True)
    text = open(CALIBRATION_FILE, encoding="utf-8").read(2_000_000)
    one = SamplingParams(max_tokens=1, temperature=0.0)
    layers = {n: m for n, m in model.named_modules() if isinstance(m, Linear) and n != "lm_head"}
    assert all(any(n.endswith(k) for k in KINDS) for n in layers), sorted(layers)[:8]
    codes = {n: quantize_fp8(m.weight.detach().float(), None) for n, m in layers.items()}
    static = calibrate_input_scales(
        model, bq.calibration_batches(llm, text, 8), lambda b: llm.generate(b, one), "amax"
    )
    configs = {"dynamic": set(), "static": set(KINDS)}
    for k in KINDS:
        configs[f"static-except-{k}"] = set(KINDS) - {k}
        configs[f"static-only-{k}"] = {k}
    result = {"source": source, "configs": {}}
    for name, static_kinds in configs.items():
        saved = []
        for n, m in layers.items():
            saved.append((m, m.method))
            kind = next(k for k in KINDS if n.endswith(k))
            q, s = codes[n]
            m.method = Real(q, s, static[n] if kind in static_kinds else None)
        try:
            ppl = score()
        finally:
            for m, method in saved:
                m.method = method
        inc = [100 * (p / s - 1) for p, s in zip(ppl, source)]
        result["configs"][name] = {"word_perplexity": ppl, "increase_pct": inc}
        print(name, "article 1", f"{inc[0]:+.2f}%", "all", f"{inc[-1]:+.2f}%",
              round(time.time() - t0), flush=True)  # fmt: skip
        json.dump(result, open(sys.argv[1], "w"), indent=1)


if __name__ == "__main__":
    main()
