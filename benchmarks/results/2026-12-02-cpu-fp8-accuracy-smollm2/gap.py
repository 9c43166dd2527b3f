"""The explore-vs-build gap (gptq2 folder: +0.38% in-process, +1.02% built, same rounding):
one process rounds fp8-dynamic layer-sequentially as the build does, then measures the build's
held-out article (a) through explore.py's fake quantization, (b) through the engine's own
ops.fp8_linear with the same codes, and compares the codes with a built engine's, whose
perplexity it then measures with the prefix cache off and on (the build's check: on).

    OMP_NUM_THREADS=1 python gap.py OUT.json ENGINE_DIR
"""

from __future__ import annotations

import json
import sys
from types import ModuleType

import torch
from safetensors.torch import load_file

from kiln.builder.accuracy import CALIBRATION_FILE, HELD_OUT_FILE, measuring_llm
from kiln.builder.accuracy import wikitext_articles
from kiln.builder.quantize import calibration_batches
from kiln.checkpoint.default_model import default_model_path
from kiln.eval.perplexity import rolling_perplexity
from kiln.kernels.reference import quantize_fp8
from kiln.layers.linear import Linear, LinearMethod
from kiln.quantization.sequential import RoundingSpec, round_sequentially


class Fake(LinearMethod):
    """explore.py's FakeQuant: dequantized weight, fake-quantized input, fp32 matmul."""

    def __init__(self, inner, codes, scale):
        self.inner, self.w = inner, codes.float() * scale

    def create_weights(self, layer, dtype):
        raise RuntimeError

    def apply(self, layer: Linear, ops: ModuleType, x: torch.Tensor) -> torch.Tensor:
        q, s = quantize_fp8(x.reshape(-1, x.shape[-1]).float(), None)
        y = ((q.float() * s) @ self.w.T).reshape(*x.shape[:-1], -1).to(x.dtype)
        return y if layer.bias is None else y + layer.bias


class Real(LinearMethod):
    """The engine's arithmetic: ops.fp8_linear on the codes (unfused)."""

    def __init__(self, inner, codes, scale):
        self.inner, self.codes, self.scale = inner, codes, scale.view(-1)

    def create_weights(self, layer, dtype):
        raise RuntimeError

    def apply(self, layer: Linear, ops: ModuleType, x: torch.Tensor) -> torch.Tensor:
        return ops.fp8_linear(x, self.codes, self.scale, None, layer.bias)


def main(out_path: str, engine: str) -> None:
    docs = wikitext_articles(HELD_OUT_FILE, 1)
    result: dict = {}
    with measuring_llm(default_model_path(), dtype="float32", enable_prefix_caching=False) as llm:
        runner = llm.engine.executor.runner
        model = runner.model
        with open(CALIBRATION_FILE, encoding="utf-8") as f:
            batches = calibration_batches(llm, f.read(200_000))
        result["source"] = rolling_perplexity(llm, docs).word_perplexity
        print("source", result["source"], flush=True)
        with torch.no_grad():
            found = round_sequentially(
                model, runner.ops, runner.backend, batches, RoundingSpec(aware=False), None
            )
        modules = dict(model.named_modules())
        for kind, cls in (("fake", Fake), ("real_ops", Real)):
            saved = []
            for n, (q, s) in found.items():
                saved.append((modules[n], modules[n].method))
                modules[n].method = cls(modules[n].method, q, s)
            try:
                result[kind] = rolling_perplexity(llm, docs).word_perplexity
            finally:
                for m, method in saved:
                    m.method = method
            print(kind, result[kind], flush=True)
    tensors = {}
    import glob

    for f in glob.glob(f"{engine}/*.safetensors"):
        tensors.update(load_file(f))
    diff = {}
    for n, (q, s) in found.items():
        key = next(k for k in tensors if k.endswith(n + ".weight"))
        eq = (tensors[key].view(torch.uint8) == q.view(torch.uint8)).float().mean().item()
        diff[n] = eq
    result["codes_equal_fraction_min"] = min(diff.values())
    result["codes_equal_fraction_mean"] = sum(diff.values()) / len(diff)
    print("codes equal", result["codes_equal_fraction_min"], flush=True)
    for prefix in (False, True):
        with measuring_llm(engine, enable_prefix_caching=prefix) as llm:
            ppl = rolling_perplexity(llm, docs).word_perplexity
        result[f"engine_prefix_caching_{prefix}"] = ppl
        print("engine prefix", prefix, ppl, flush=True)
    for k in list(result):
        if isinstance(result[k], float) and k != "source" and "fraction" not in k:
            result[k + "_increase_pct"] = 100 * (result[k] / result["source"] - 1)
    with open(out_path, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
