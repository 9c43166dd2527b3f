"""NVIDIA ModelOpt's static FP8 of the SmolLM2 source (make_source.py's directory):
mtq.quantize(model, mtq.FP8_DEFAULT_CFG, forward_loop) (per-tensor float8 weights, static
per-tensor input scales from its max calibration; lm_head left out by the config), the
forward loop over the build's own calibration windows (peer_llmcompressor.windows), then
export_hf_checkpoint in float32 (the unquantized tensors as the source has them), on the CPU.

    python peer_modelopt.py SOURCE_DIR OUT_DIR WINDOWS
"""

from __future__ import annotations

import sys
import time

import torch
from peer_llmcompressor import windows
from transformers import AutoTokenizer, LlamaForCausalLM


def main(source: str, out: str, n: int) -> None:
    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_hf_checkpoint

    tokenizer = AutoTokenizer.from_pretrained(source)
    model = LlamaForCausalLM.from_pretrained(source, torch_dtype=torch.float32).eval()
    ids = windows(tokenizer, n)

    def forward_loop(m: torch.nn.Module) -> None:
        with torch.no_grad():
            for w in ids:
                m(torch.tensor([w]))

    t0 = time.time()
    mtq.quantize(model, mtq.FP8_DEFAULT_CFG, forward_loop)
    print("quantize", round(time.time() - t0), "s", len(ids), "windows", flush=True)
    mtq.print_quant_summary(model)
    export_hf_checkpoint(model, dtype=torch.float32, export_dir=out)
    tokenizer.save_pretrained(out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
