"""In-process sweep of the layer-sequential rounding's knobs (gap.json shows this arithmetic is
the build's, bit for bit: the same codes, the same perplexity), each configuration rounded from
the source and scored on the first N held-out articles with the engine's ops.fp8_linear;
article 1 alone is the build's check. The source loads once.

    OMP_NUM_THREADS=1 python sweep.py OUT.json N CONFIG [CONFIG ...]

CONFIG: MODE[/damp=D][/batches=B][/shift=S][/alpha=A][/smooth=ALPHA], MODE dynamic or static;
batches: calibration windows of 512 tokens (the build: 8); shift: the calibration text starts
S tokens later (an equally valid sample: the spread it causes is the measure's noise for one
rounding); static: the input scales by calibrate_input_scales ("amax"), /mse their search.
"""

from __future__ import annotations

import json
import math
import sys
import time
from types import ModuleType

import torch

from kiln.builder import quantize as bq
from kiln.builder.accuracy import CALIBRATION_FILE, HELD_OUT_FILE, wikitext_articles
from kiln.eval.perplexity import count_words, prefix_token_id, token_loglikelihoods
from kiln.layers.linear import Linear, LinearMethod
from kiln.llm import LLM
from kiln.quantization.calibration import calibrate_input_scales
from kiln.quantization.sequential import RoundingSpec, round_sequentially
from kiln.sampling_params import SamplingParams


class Real(LinearMethod):
    """The engine's arithmetic: ops.fp8_linear on the codes."""

    def __init__(self, inner, codes, scale, input_scale):
        self.inner, self.codes, self.scale = inner, codes, scale.view(-1)
        self.input_scale = None if input_scale is None else torch.tensor(input_scale)

    def create_weights(self, layer, dtype):
        raise RuntimeError

    def apply(self, layer: Linear, ops: ModuleType, x: torch.Tensor) -> torch.Tensor:
        return ops.fp8_linear(x, self.codes, self.scale, self.input_scale, layer.bias)


def main(out_path: str, n: int, configs: list[str]) -> None:
    t0 = time.time()
    llm = LLM(dtype="float32", enable_prefix_caching=False)
    runner = llm.engine.executor.runner
    model = runner.model
    tok = llm.get_tokenizer()
    docs = wikitext_articles(HELD_OUT_FILE, n)
    ids = [tok.encode(d, add_special_tokens=False) for d in docs]
    words = [count_words(d) for d in docs]
    with open(CALIBRATION_FILE, encoding="utf-8") as f:
        text = f.read(800_000)

    def score() -> list[float]:
        lls = token_loglikelihoods(llm, ids, prefix_token_id(llm))
        return [math.exp(-ll / w) for ll, w in zip(lls, words)] + [
            math.exp(-math.fsum(lls) / sum(words))
        ]

    source = score()
    result = {"articles": n, "source": source, "configs": {}}
    print("source", [round(p, 3) for p in source], round(time.time() - t0), flush=True)
    modules = dict(model.named_modules())
    one = SamplingParams(max_tokens=1, temperature=0.0)
    for config in configs:
        parts = config.split("/")
        opts = dict(p.split("=") for p in parts[1:] if "=" in p)
        static = parts[0] == "static"
        bq._CALIBRATION_BATCHES = int(opts.get("batches", 8))
        shift = int(opts.get("shift", 0))
        all_ids = tok.encode(text, add_special_tokens=False)[shift:]
        n_tok = 512
        batches = [all_ids[i : i + n_tok] for i in range(0, len(all_ids), n_tok)]
        batches = batches[: bq._CALIBRATION_BATCHES]
        scales = None
        if static:
            run = lambda b: llm.generate(b, one)
            scales = calibrate_input_scales(model, batches, run, opts.get("scales", "amax"))
        spec = RoundingSpec(aware=False, damp=float(opts.get("damp", 0.01)))
        with torch.no_grad():
            found = round_sequentially(model, runner.ops, runner.backend, batches, spec, scales)
        saved = []
        for name, (q, s) in found.items():
            saved.append((modules[name], modules[name].method))
            modules[name].method = Real(modules[name].method, q, s, scales and scales[name])
        try:
            ppl = score()
        finally:
            for m, method in saved:
                m.method = method
        inc = [100 * (p / s - 1) for p, s in zip(ppl, source)]
        result["configs"][config] = {"word_perplexity": ppl, "increase_pct": inc}
        print(config, "article 1", f"{inc[0]:+.2f}%", "all", f"{inc[-1]:+.2f}%",
              [round(i, 2) for i in inc], round(time.time() - t0), flush=True)  # fmt: skip
        result["seconds"] = time.time() - t0
        with open(out_path, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3:])
