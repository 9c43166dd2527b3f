"""Makes the pre-quantized FP8 test checkpoints with the real tools, on a tiny random Llama.

    python tests/data/fp8_checkpoints/make.py   # in a venv with llmcompressor, nvidia-modelopt

compressed_tensors/: llm-compressor's FP8_DYNAMIC scheme (per-channel float8 weights, dynamic
per-token activations), lm_head left in bf16, saved compressed. modelopt/: NVIDIA ModelOpt's
FP8_DEFAULT_CFG (per-tensor weight and input scales, calibrated on a few random batches) with
the KV cache's scales, exported
with export_hf_checkpoint (hf_quant_config.json). Both from the same bf16 source, kept in
source/ so the tests can compare against it. Small by design (a few hundred KB), committed, so CI
needs neither tool.
"""

from __future__ import annotations

import copy
import os
import shutil
import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM

HERE = os.path.dirname(os.path.abspath(__file__))
CONFIG = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
    rms_norm_eps=1e-5, tie_word_embeddings=False,
)  # fmt: skip


def source() -> LlamaForCausalLM:
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**CONFIG)).to(torch.bfloat16)
    model.save_pretrained(os.path.join(HERE, "source"))
    return model


def compressed_tensors() -> None:
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier

    model = LlamaForCausalLM.from_pretrained(os.path.join(HERE, "source"))
    recipe = QuantizationModifier(targets="Linear", scheme="FP8_DYNAMIC", ignore=["lm_head"])
    oneshot(model=model, recipe=recipe)
    model.save_pretrained(os.path.join(HERE, "compressed_tensors"), save_compressed=True)


def modelopt() -> None:
    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_hf_checkpoint

    model = LlamaForCausalLM.from_pretrained(os.path.join(HERE, "source"))
    gen = torch.Generator().manual_seed(1)

    def forward_loop(m: torch.nn.Module) -> None:
        for _ in range(4):
            m(torch.randint(0, CONFIG["vocab_size"], (2, 32), generator=gen))

    # FP8 weights and activations, and the KV cache's k_scale / v_scale (ModelOpt's FP8 KV).
    cfg = copy.deepcopy(mtq.FP8_DEFAULT_CFG)
    cfg["quant_cfg"] += copy.deepcopy(mtq.FP8_KV_CFG["quant_cfg"])
    mtq.quantize(model, cfg, forward_loop)
    export_hf_checkpoint(model, export_dir=os.path.join(HERE, "modelopt"))


if __name__ == "__main__":
    which = sys.argv[1:] or ["source", "compressed_tensors", "modelopt"]
    for name in which:
        shutil.rmtree(os.path.join(HERE, name), ignore_errors=True)
        globals()[name]()
        print("made", name)
