"""llm-compressor's static FP8 of the SmolLM2 source (make_source.py's directory), calibrated
on the build's own windows: the first WINDOWS x 512 tokens of WikiText-2's test split, encoded
as the build encodes them (kiln.builder.quantize.calibration_batches: no special tokens, windows
sharing no prefix), in float32 on the CPU.

    python peer_llmcompressor.py SOURCE_DIR OUT_DIR WINDOWS {channel,tensor} {rtn,gptq}

channel: per-channel float8 weights (kiln's static fp8 layout); tensor: the tool's "FP8" preset
as it is (per-tensor weights). Both: static per-tensor input scales, observer "static_minmax"
(the absmax over all calibration tokens, the preset's). rtn: QuantizationModifier (weights
rounded to nearest); gptq: GPTQModifier (the tool's GPTQ, its defaults) with the same scheme.
lm_head stays unquantized, as in kiln's build.
"""

from __future__ import annotations

import sys
import time

import torch
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
from datasets import Dataset
from transformers import AutoTokenizer, LlamaForCausalLM

from kiln.builder.accuracy import CALIBRATION_FILE

TOKENS = 512


def windows(tokenizer, n: int) -> list[list[int]]:
    with open(CALIBRATION_FILE, encoding="utf-8") as f:
        ids = tokenizer.encode(f.read(), add_special_tokens=False)
    return [ids[i : i + TOKENS] for i in range(0, len(ids), TOKENS)][:n]


def main(source: str, out: str, n: int, weights: str, rounding: str) -> None:
    from llmcompressor import oneshot
    from llmcompressor.modifiers.gptq import GPTQModifier
    from llmcompressor.modifiers.quantization import QuantizationModifier

    tokenizer = AutoTokenizer.from_pretrained(source)
    model = LlamaForCausalLM.from_pretrained(source, torch_dtype=torch.float32)
    ids = windows(tokenizer, n)
    data = Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * len(w) for w in ids]})
    fp8 = dict(num_bits=8, type="float", symmetric=True, dynamic=False)
    scheme = QuantizationScheme(
        targets=["Linear"],
        weights=QuantizationArgs(**fp8, strategy=weights),
        input_activations=QuantizationArgs(**fp8, strategy="tensor", observer="static_minmax"),
    )
    modifier = GPTQModifier if rounding == "gptq" else QuantizationModifier
    recipe = modifier(config_groups={"group_0": scheme}, ignore=["lm_head"])
    t0 = time.time()
    oneshot(
        model=model, dataset=data, recipe=recipe, max_seq_length=TOKENS,
        num_calibration_samples=len(ids), shuffle_calibration_samples=False,
    )  # fmt: skip
    print("oneshot", round(time.time() - t0), "s", len(ids), "windows", flush=True)
    model.save_pretrained(out, save_compressed=True)
    tokenizer.save_pretrained(out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5])
