"""Where SmolLM2's FP8 activation error comes from: activations fake-quantized to e4m3 at one
projection kind at a time (weights unquantized, fp32), the build's own held-out word perplexity;
the inputs' per-channel statistics; and SmoothQuant's alpha chosen on the calibration text with
W8A8 fake-quantized everywhere.

    OMP_NUM_THREADS=1 python activation_error.py OUT.json [PARTS [ALPHAS [ARTICLE]]]

PARTS (comma-separated, default all): stats (the inputs' per-channel amax), kinds (the
per-kind table), keep (projections kept unquantized, on the calibration text), grid (alpha on
the calibration text; ALPHAS, default none,0.3,0.5,0.7). The JSON is rewritten after each part.
"""

from __future__ import annotations

import json
import os
import sys
import time
from types import ModuleType

import torch

from kiln.builder.accuracy import CALIBRATION_FILE, measure, wikitext_articles
from kiln.builder.quantize import calibration_batches
from kiln.eval.perplexity import rolling_perplexity
from kiln.kernels.reference import FP8_E4M3_MAX, quantize_fp8
from kiln.layers.linear import Linear, LinearMethod
from kiln.llm import LLM
from kiln.quantization.smoothing import KINDS, calibrate_channel_amax, smoothing_factors
from kiln.sampling_params import SamplingParams


def fake_quant(x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    q, s = quantize_fp8(x.reshape(-1, x.shape[-1]), scale)
    return (q.float() * s).reshape(x.shape).to(x.dtype)


class FakeQuant(LinearMethod):
    """inner's arithmetic on fake-quantized inputs (per token, or a static scale) and, with
    `smooth`, smoothed inputs x / s against fake-quantized weights W * s (per-row e4m3)."""

    def __init__(self, inner, layer, static_scale=None, smooth=None, weights=False):
        self.inner, self.static, self.smooth = inner, static_scale, smooth
        w = layer.weight.detach().float()
        if smooth is not None:
            w = w * smooth
        self.w = fake_quant(w, None) if weights else w

    def create_weights(self, layer, dtype):
        raise RuntimeError

    def apply(self, layer: Linear, ops: ModuleType, x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        if self.smooth is not None:
            x = x / self.smooth
        xq = fake_quant(x, self.static)
        y = xq @ self.w.T
        if layer.bias is not None:
            y = y + layer.bias
        return y


def wrap(model, make):
    saved = []
    for name, m in model.named_modules():
        if isinstance(m, Linear) and name != "lm_head":
            new = make(name, m)
            if new is not None:
                saved.append((m, m.method))
                m.method = new
    return saved


def unwrap(saved):
    for m, method in saved:
        m.method = method


def kind_of(name):
    return name.rsplit(".", 1)[-1]


# Projections kept unquantized (fp32), the rest W8A8 fake-quantized and smoothed at KEEP_ALPHA
# (env, default 0.8; KEEP_MODES, default both):
# which layers are worth `--unquantized-layers`, on the calibration text.
KEEP = {
    "none": (),
    "gate_up all layers": ("layers.*.mlp.gate_up_proj",),
    "MLP of layers 28-29": ("layers.28.mlp.*", "layers.29.mlp.*"),
    "massive: down 11, 28; gate_up 28, 29": (
        "layers.11.mlp.down_proj",
        "layers.28.mlp.*",
        "layers.29.mlp.gate_up_proj",
    ),
}
KEEP_MODES = ("dynamic", "static")


KEEP_ALPHA = float(os.environ.get("KEEP_ALPHA", "0.8"))
if os.environ.get("KEEP_MODES"):
    KEEP_MODES = tuple(os.environ["KEEP_MODES"].split(","))
ARTICLE = 1  # which article of the test split the grid and keep parts read (argv[4])


def keep_candidates(llm, model, amax, result, save):
    from fnmatch import fnmatchcase

    docs = wikitext_articles(CALIBRATION_FILE, ARTICLE)[ARTICLE - 1 :]
    base = rolling_perplexity(llm, docs).word_perplexity
    s = smoothing_factors(model, amax, KEEP_ALPHA)
    table = {}
    for label, patterns in KEEP.items():
        for mode in KEEP_MODES:

            def make(name, m, patterns=patterns, mode=mode):
                if any(fnmatchcase(name, p) for p in patterns):
                    return None
                sc = None
                if mode == "static":
                    sc = torch.tensor(float((amax[name] / s[name]).max()) / FP8_E4M3_MAX)
                return FakeQuant(m.method, m, sc, s[name], weights=True)

            saved = wrap(model, make)
            try:
                ppl = rolling_perplexity(llm, docs).word_perplexity
            finally:
                unwrap(saved)
            inc = 100 * (ppl / base - 1)
            table[f"{mode}/{label}"] = {"word_perplexity": ppl, "word_ppl_increase_pct": inc}
            print("keep", mode, label, f"{inc:+.2f}%", flush=True)
    result["keep_unquantized_calibration_text"] = {"source": base, **table}
    save()


def main(out_path, parts, alphas):
    t0 = time.time()
    llm = LLM(dtype="float32", enable_prefix_caching=False)
    model = llm.engine.executor.runner.model
    with open(CALIBRATION_FILE, encoding="utf-8") as f:
        calib_text = f.read(200_000)
    batches = calibration_batches(llm, calib_text)
    one = SamplingParams(max_tokens=1, temperature=0.0)
    amax = calibrate_channel_amax(model, batches, lambda b: llm.generate(b, one))
    result = {"source": measure(llm, None)} if "kinds" in parts else {}
    print("source", result.get("source"), time.time() - t0, flush=True)

    def save():
        result["seconds"] = time.time() - t0
        with open(out_path, "w") as f:
            json.dump(result, f, indent=1)

    # Statistics of each kind's inputs: per-channel amax against the median channel's.
    stats = {}
    for kind in KINDS:
        rows = []
        for name, a in amax.items():
            if kind_of(name) != kind:
                continue
            top = torch.topk(a, 3)
            rows.append(
                {
                    "layer": int(name.split(".")[1]),
                    "amax": float(a.max()),
                    "median_channel_amax": float(a.median()),
                    "ratio": float(a.max() / a.median()),
                    "top_channels": top.indices.tolist(),
                    "top_values": [round(v, 2) for v in top.values.tolist()],
                }
            )
        stats[kind] = rows
    result["input_stats"] = stats
    save()

    def ppl_with(make, text=None):
        saved = wrap(model, make)
        try:
            if text is None:
                return measure(llm, None)
            r = rolling_perplexity(llm, text)
            return {"word_perplexity": r.word_perplexity, "token_perplexity": r.token_perplexity}
        finally:
            unwrap(saved)

    static_scale = {n: torch.tensor(float(a.max()) / FP8_E4M3_MAX) for n, a in amax.items()}
    table = {}
    for mode in ("dynamic", "static") if "kinds" in parts else ():
        for kind in (*KINDS, "all"):

            def make(name, m, kind=kind, mode=mode):
                if kind != "all" and kind_of(name) != kind:
                    return None
                return FakeQuant(m.method, m, static_scale[name] if mode == "static" else None)

            r = ppl_with(make)
            inc = 100 * (r["word_perplexity"] / result["source"]["word_perplexity"] - 1)
            table[f"{mode}/{kind}"] = {**r, "word_ppl_increase_pct": inc}
            print(mode, kind, f"{inc:+.2f}%", round(time.time() - t0), flush=True)
    if table:
        result["activations_only"] = table
        save()
    if "keep" in parts:
        keep_candidates(llm, model, amax, result, save)
    if "grid" not in parts:
        return

    # alpha on the calibration text (its first articles, not the held-out valid split): W8A8
    # fake-quantized at every kind, nearest rounding, both activation modes.
    calib_docs = wikitext_articles(CALIBRATION_FILE, ARTICLE)[ARTICLE - 1 :]
    base = ppl_with(lambda n, m: None, calib_docs)
    grid = {"source": base}
    for alpha in alphas:
        s = None if alpha is None else smoothing_factors(model, amax, alpha)
        for mode in ("dynamic", "static"):

            def make(name, m, s=s, mode=mode):
                sm = None if s is None else s[name]
                sc = None
                if mode == "static":
                    a = amax[name] if sm is None else amax[name] / sm
                    sc = torch.tensor(float(a.max()) / FP8_E4M3_MAX)
                return FakeQuant(m.method, m, sc, sm, weights=True)

            r = ppl_with(make, calib_docs)
            inc = 100 * (r["word_perplexity"] / base["word_perplexity"] - 1)
            grid[f"{mode}/alpha={alpha}"] = {**r, "word_ppl_increase_pct": inc}
            print("calib", mode, alpha, f"{inc:+.2f}%", round(time.time() - t0), flush=True)
        result["alpha_grid_calibration_text"] = grid
        save()


if __name__ == "__main__":
    ARTICLE = int(sys.argv[4]) if len(sys.argv) > 4 else 1
    alphas = [None, 0.3, 0.5, 0.7]
    if len(sys.argv) > 3:
        alphas = [None if a == "none" else float(a) for a in sys.argv[3].split(",")]
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "stats,kinds,grid", alphas)
