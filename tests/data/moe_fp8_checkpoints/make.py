"""Makes the pre-quantized mixture-of-experts test checkpoints with llm-compressor, on the CPU.

    PYTHONPATH=<a target dir with llmcompressor 0.14, compressed-tensors 0.19, transformers
    5.17>:<the checkout> python tests/data/moe_fp8_checkpoints/make.py

The source is tests/models/test_moe_fp8_block.py's tiny Qwen3-MoE (save_tiny_hf, seed 0) in
bf16; `oneshot` (QuantizationModifier, round to nearest) quantizes every Linear, the experts
too (llm-compressor linearizes transformers' stacked experts into per-expert projections), and
leaves out lm_head and the routers ("re:.*mlp.gate$", llm-compressor's MoE default), saved
compressed: ct_fp8_block/ FP8_BLOCK (128x128 weight blocks, activations per token-group of 128
at run time), ct_fp8_dynamic/ FP8_DYNAMIC (float8 weights per channel, activations per token),
ct_w4a16/ W4A16 (int4 weights in groups of 128, symmetric; pack-quantized), ct_w8a16/ W8A16
per channel (int8 weights, symmetric; pack-quantized: the W8A16 preset's scheme with strategy
"channel" in place of its groups of 128), ct_w8a16_g128/ the W8A16 preset itself (int8 weights
in groups of 128 inputs), ct_w8a8_int8/ W8A8 (int8 weights per channel, int8 activations per
token at run time; int-quantized). Arguments: which.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(HERE))))


# W8A16 per output channel: the preset's int8 weights, one scale a row.
W8A16_CHANNEL = {"group_0": {"targets": ["Linear"], "weights": {
    "num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}}}  # fmt: skip


def make(name: str, scheme: str | dict) -> None:
    import transformers
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier

    from tests.models.family_checks import perturb_norms_and_biases, save_tiny_hf
    from tests.models.test_moe_fp8_block import QWEN3_MOE

    with tempfile.TemporaryDirectory() as tmp:
        save_tiny_hf(tmp, "qwen3_moe", "Qwen3MoeForCausalLM", perturb=perturb_norms_and_biases,
                     **QWEN3_MOE)  # fmt: skip
        model = transformers.AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.bfloat16)
        ignore = ["lm_head", "re:.*mlp.gate$"]
        if isinstance(scheme, dict):
            recipe = QuantizationModifier(config_groups=scheme, ignore=ignore)
        else:
            recipe = QuantizationModifier(targets="Linear", scheme=scheme, ignore=ignore)
        oneshot(model=model, recipe=recipe)
        out = os.path.join(HERE, name)
        shutil.rmtree(out, ignore_errors=True)
        model.save_pretrained(out, save_compressed=True)
        for extra in ("recipe.yaml", "generation_config.json"):
            if os.path.exists(os.path.join(out, extra)):
                os.remove(os.path.join(out, extra))


if __name__ == "__main__":
    schemes = {"ct_fp8_block": "FP8_BLOCK", "ct_fp8_dynamic": "FP8_DYNAMIC", "ct_w4a16": "W4A16",
               "ct_w8a16": W8A16_CHANNEL, "ct_w8a16_g128": "W8A16",
               "ct_w8a8_int8": "W8A8"}  # fmt: skip
    which = sys.argv[1:] or list(schemes)
    for name in which:
        make(name, schemes[name])
