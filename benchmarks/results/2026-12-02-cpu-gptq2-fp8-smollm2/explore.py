"""The exploration loop behind this folder's builds: SmolLM2 loaded once, its calibration
statistics collected once, each rounding configuration applied in-process as fake-quantized
W8A8 (weights e4m3 per output row, dequantized to fp32; inputs through the engine's own
quantize_fp8 twin, per token or with the static scale), then the build's own accuracy measure.
Exploration only: the folder's table comes from `kiln build` (run.sh).

    OMP_NUM_THREADS=1 python explore.py OUT.json CONFIG [CONFIG ...]

CONFIG: MODE/ROUNDING[/damp=D][/act][/seq], MODE dynamic or static, ROUNDING nearest, gptq
(H = X X^T of the inputs), gptq-hq (H = Xq Xq^T, the float8 inputs), aware (W' = W C B^-1,
GPTQ with B); `seq`: layer-sequentially (kiln.quantization.sequential: the inputs of the
model whose earlier projections are float8 already; aware's X the source's).
ARTICLES=N (env) measures on the first N held-out articles (default 1, the build's).
"""

from __future__ import annotations

import json
import os
import sys
import time
from types import ModuleType

import torch

from kiln.builder.accuracy import CALIBRATION_FILE, HELD_OUT_FILE, wikitext_articles
from kiln.builder.quantize import calibration_batches
from kiln.eval.perplexity import rolling_perplexity
from kiln.kernels.reference import quantize_fp8
from kiln.layers.linear import Linear, LinearMethod
from kiln.llm import LLM
from kiln.quantization import gptq
from kiln.quantization.calibration import calibrate_input_scales
from kiln.sampling_params import SamplingParams


def fake_quant(x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    q, s = quantize_fp8(x.reshape(-1, x.shape[-1]), scale)
    return (q.float() * s).reshape(x.shape).to(x.dtype)


class Stats(LinearMethod):
    """Collects H = X X^T, and per mode C = X Xq^T and B = Xq Xq^T (xq: the input through
    quantize_fp8, per token or with the layer's static scale)."""

    def __init__(self, inner, static_scale):
        self.inner, self.static = inner, static_scale
        self.m: dict[str, torch.Tensor] = {}
        self.rows = 0

    def create_weights(self, layer, dtype):
        raise RuntimeError

    def _add(self, key, a, b):
        if key not in self.m:
            self.m[key] = torch.zeros(a.shape[1], b.shape[1])
        self.m[key].addmm_(a.T, b)

    def apply(self, layer: Linear, ops: ModuleType, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).float()
        self._add("H", rows, rows)
        for mode, scale in (("dynamic", None), ("static", self.static)):
            xq = fake_quant(rows, scale)
            self._add(f"C_{mode}", rows, xq)
            self._add(f"B_{mode}", xq, xq)
        self.rows += rows.shape[0]
        return self.inner.apply(layer, ops, x)


class FakeQuant(LinearMethod):
    def __init__(self, inner, weight, static_scale):
        self.inner, self.w, self.static = inner, weight, static_scale

    def create_weights(self, layer, dtype):
        raise RuntimeError

    def apply(self, layer: Linear, ops: ModuleType, x: torch.Tensor) -> torch.Tensor:
        y = fake_quant(x.float(), self.static) @ self.w.T
        return y if layer.bias is None else y + layer.bias


def quantized_weight(w, stats, mode, rounding, damp, act):
    if rounding == "nearest":
        q, s = quantize_fp8(w, None)
        return q.float() * s
    h = {"gptq": stats["H"], "gptq-hq": stats[f"B_{mode}"], "aware": stats[f"B_{mode}"]}[rounding]
    if rounding == "aware":
        w = gptq.activation_aware_weight(w, stats[f"C_{mode}"], h, damp).float()
    q, s = gptq.gptq_fp8(w, h, damp, act)
    return q.float() * s


def main(out_path: str, configs: list[str]) -> None:
    t0 = time.time()
    llm = LLM(dtype="float32", enable_prefix_caching=False)
    model = llm.engine.executor.runner.model
    with open(CALIBRATION_FILE, encoding="utf-8") as f:
        batches = calibration_batches(llm, f.read(200_000))
    one = SamplingParams(max_tokens=1, temperature=0.0)
    run = lambda b: llm.generate(b, one)
    scales = calibrate_input_scales(model, batches, run)
    static = {n: torch.tensor(s) for n, s in scales.items()}
    names = [n for n, m in model.named_modules() if isinstance(m, Linear) and n != "lm_head"]
    stats = {}
    if any("seq" not in c.split("/") and c.split("/")[1] != "nearest" for c in configs):
        obs = {}
        wrapped = {}
        for name, module in model.named_modules():
            if isinstance(module, Linear) and name != "lm_head":
                wrapped[name] = (module, Stats(module.method, static[name]))
                module.method = wrapped[name][1]
        try:
            run(batches)
        finally:
            for module, ob in wrapped.values():
                module.method = ob.inner
        for name, (_, ob) in wrapped.items():
            obs[name] = {k: v / ob.rows for k, v in ob.m.items()}
        stats = obs
        print("stats", round(time.time() - t0), flush=True)
    articles = int(os.environ.get("ARTICLES", "1"))
    docs = wikitext_articles(HELD_OUT_FILE, articles)
    modules = dict(model.named_modules())
    source = rolling_perplexity(llm, docs).word_perplexity
    result = {"source_word_perplexity": source, "articles": articles, "configs": {}}
    print("source", source, round(time.time() - t0), flush=True)
    for config in configs:
        parts = config.split("/")
        mode, rounding = parts[0], parts[1]
        damp = next((float(p[5:]) for p in parts if p.startswith("damp=")), gptq._DAMP)
        act = "act" in parts
        if "seq" in parts:
            from kiln.quantization.sequential import RoundingSpec, round_sequentially

            runner = llm.engine.executor.runner
            spec = RoundingSpec(
                aware=rounding == "aware", quantized_input=rounding != "gptq", damp=damp,
                act_order=act,
            )  # fmt: skip
            with torch.no_grad():
                found = round_sequentially(
                    model, runner.ops, runner.backend, batches, spec,
                    scales if mode == "static" else None,
                )  # fmt: skip
            weights = {n: q.float() * s for n, (q, s) in found.items()}
        else:
            weights = {
                n: quantized_weight(
                    modules[n].weight.detach().float(), stats.get(n), mode, rounding, damp, act
                )
                for n in names
            }
        saved = []
        for n in names:
            m = modules[n]
            saved.append((m, m.method))
            m.method = FakeQuant(m.method, weights[n], static[n] if mode == "static" else None)
        try:
            ppl = rolling_perplexity(llm, docs).word_perplexity
        finally:
            for m, method in saved:
                m.method = method
        inc = 100 * (ppl / source - 1)
        result["configs"][config] = {"word_perplexity": ppl, "increase_pct": inc}
        print(config, round(ppl, 3), f"{inc:+.2f}%", round(time.time() - t0), flush=True)
        result["seconds"] = time.time() - t0
        with open(out_path, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
