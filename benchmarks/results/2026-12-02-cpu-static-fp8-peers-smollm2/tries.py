"""Static fp8 on SmolLM2: input scales amax * A (headroom above the calibration absmax) and more
calibration windows, scored on held-out articles (the build's word perplexity), beside per-token
dynamic scales. Weights rounded to nearest, or with /gptq=1 by gptq-sequential as the build
rounds them (32 windows, damp 0.1, aware of the static scales).

    OMP_NUM_THREADS=2 python headroom.py OUT.json N_ARTICLES CONFIG [CONFIG ...]

CONFIG: dynamic | static[/A=a][/windows=w][/gptq=1][/mse=GRID][/search=held]

This folder's copy of ../2026-12-02-cpu-static-fp8-headroom-smollm2/headroom.py (same arithmetic:
the engine's ops.fp8_linear on the codes; /gptq=1 reproduces the build's static fp8 to the last
digit), with the "mse" search of kiln/quantization/calibration.py added:
/mse=up: the search's grid extended above 1 (2.0 ... 0.7, GRID_UP); /mse=build: the build's own
grid (1.0 ... 0.3). /wt=tensor: one float8 weight scale per (fused) projection, absmax / 448 of
the whole tensor, as ModelOpt's FP8_DEFAULT_CFG (which keeps q, k, v's own), for nearest and for
GPTQ (gptq.round_with_factor patched to the tensor's scale; the error feedback as it is). /search=held: the search scores its candidates on the next `windows` windows
of the calibration text, not the ones absmax came from (on the same tokens a scale above 1 only
adds underflow: no calibration token clips at absmax, so it can never win there)."""
import json, math, sys, time
import torch
from kiln.builder import quantize as bq
from kiln.builder.accuracy import CALIBRATION_FILE, HELD_OUT_FILE, wikitext_articles
from kiln.eval.perplexity import count_words, prefix_token_id, token_loglikelihoods
from kiln.kernels.reference import quantize_fp8
from kiln.layers.linear import Linear, LinearMethod
from kiln.llm import LLM
from kiln.quantization import calibration
from kiln.quantization.calibration import calibrate_input_scales, search_input_scales
GRID_UP = (2.0, 1.75, 1.5, 1.3, 1.2, 1.1, 1.0, 0.9, 0.8, 0.7)
from kiln.sampling_params import SamplingParams
from kiln.quantization.sequential import RoundingSpec, round_sequentially

class Real(LinearMethod):
    def __init__(self, inner, codes, scale, input_scale):
        self.inner, self.codes, self.scale = inner, codes, scale.view(-1)
        self.input_scale = None if input_scale is None else torch.tensor(input_scale)
    def create_weights(self, layer, dtype):
        raise RuntimeError
    def apply(self, layer, ops, x):
        return ops.fp8_linear(x, self.codes, self.scale, self.input_scale, layer.bias)

N = int(sys.argv[2])
t0 = time.time()
llm = LLM(dtype="float32", enable_prefix_caching=False)
model = llm.engine.executor.runner.model
tok = llm.get_tokenizer()
docs = wikitext_articles(HELD_OUT_FILE, N)
ids = [tok.encode(d, add_special_tokens=False) for d in docs]
words = [count_words(d) for d in docs]
def score():
    lls = token_loglikelihoods(llm, ids, prefix_token_id(llm))
    return [math.exp(-ll / w) for ll, w in zip(lls, words)] + [math.exp(-math.fsum(lls) / sum(words))]
source = score()
print("source", [round(p, 3) for p in source], flush=True)
text = open(CALIBRATION_FILE, encoding="utf-8").read(2_000_000)
one = SamplingParams(max_tokens=1, temperature=0.0)
run = lambda b: llm.generate(b, one)
modules = dict(model.named_modules())
layers = {n: m for n, m in modules.items() if isinstance(m, Linear) and n != "lm_head"}
codes = {n: quantize_fp8(m.weight.detach().float(), None) for n, m in layers.items()}
scales_by_windows = {}
from kiln.kernels.reference import FP8_E4M3_MAX
from kiln.quantization import gptq
_per_row = gptq.round_with_factor
def _tensor_scale(weight, hinv, order=None):
    """round_with_factor with one scale for the tensor: the rows scaled to the tensor's absmax
    and back, so each row's own absmax / 448 step is the tensor's."""
    t = float(weight.abs().max()) / FP8_E4M3_MAX
    return _patched_rows(weight, hinv, order, t)
def _patched_rows(weight, hinv, order, t):
    # The per-row routine rounds w / (rowmax / 448); one pinned element per row at the tensor's
    # absmax in a column of its own makes every row's scale t (the column is dropped after).
    rows = weight.shape[0]
    pin = torch.full((rows, 1), t * FP8_E4M3_MAX, dtype=weight.dtype, device=weight.device)
    w = torch.cat([weight, pin], dim=1)
    h = torch.zeros(hinv.shape[0] + 1, hinv.shape[1] + 1, dtype=hinv.dtype, device=hinv.device)
    h[:-1, :-1] = hinv
    h[-1, -1] = 1.0  # the last column: rounded last, its error goes nowhere
    if order is not None:
        order = torch.cat([order, torch.tensor([len(order)], device=order.device)])
    codes, scale = _per_row(w, h, order)
    return codes[:, :-1].contiguous(), scale
def tensor_codes(w):
    t = (w.abs().max() / FP8_E4M3_MAX).clamp(min=1e-12)
    q = (w / t).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return q, t.expand(w.shape[0], 1).float().contiguous()
result = {"source": source, "configs": {}}
for config in sys.argv[3:]:
    kind, *rest = config.split("/")
    opts = dict(p.split("=") for p in rest)
    input_scales = None
    if kind == "static":
        w = int(opts.get("windows", 8))
        if w not in scales_by_windows:
            scales_by_windows[w] = calibrate_input_scales(model, bq.calibration_batches(llm, text, w), run, "amax")
        a = float(opts.get("A", 1.0))
        input_scales = {n: s * a for n, s in scales_by_windows[w].items()}
        if "mse" in opts:
            calibration.ACTIVATION_SCALE_GRID = GRID_UP if opts["mse"] == "up" else (1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3)
            b = bq.calibration_batches(llm, text, 2 * w)
            b = b[w:] if opts.get("search") == "held" else b[:w]
            input_scales = search_input_scales(model, b, run, input_scales)
            ratio = sorted(round(input_scales[n] / scales_by_windows[w][n], 2) for n in input_scales)
            print(config, "alpha chosen (sorted)", ratio, flush=True)
    found = codes
    tensor = opts.get("wt") == "tensor"
    gptq.round_with_factor = _tensor_scale if tensor else _per_row
    if tensor:
        found = {n: tensor_codes(m.weight.detach().float()) for n, m in layers.items()}
    if "gptq" in opts:  # gptq-sequential as the build's defaults: 32 windows, damp 0.1
        with torch.no_grad():
            found = round_sequentially(model, llm.engine.executor.runner.ops, llm.engine.executor.runner.backend,
                                       bq.calibration_batches(llm, text, 32), RoundingSpec(aware=False, damp=0.1), input_scales)
    saved = []
    for n, m in layers.items():
        saved.append((m, m.method))
        q, s = found[n]
        m.method = Real(m.method, q, s, None if input_scales is None else input_scales[n])
    try:
        ppl = score()
    finally:
        for m, method in saved:
            m.method = method
    inc = [100 * (p / s - 1) for p, s in zip(ppl, source)]
    result["configs"][config] = {"word_perplexity": ppl, "increase_pct": inc, "input_scales": input_scales}
    print(config, "article 1", f"{inc[0]:+.2f}%", "all", f"{inc[-1]:+.2f}%", [round(i, 2) for i in inc], round(time.time() - t0), flush=True)
    json.dump(result, open(sys.argv[1], "w"), indent=1)
