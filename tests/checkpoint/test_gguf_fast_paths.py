"""The GGUF loader's startup shortcuts against what they replace: kiln's torch dequantizers against
gguf.quants (bitwise), its own byte-level BPE tokenizer against transformers' GGUF tokenizer."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from kiln.checkpoint.gguf_dequant import FAST_DEQUANTIZERS
from kiln.checkpoint.gguf_loader import GGUFModel
from kiln.checkpoint.gguf_tokenizer import can_build


@pytest.mark.parametrize("name", sorted(FAST_DEQUANTIZERS))
def test_fast_dequantizers_equal_gguf_bitwise(name: str) -> None:
    qtype = GGMLQuantizationType[name]
    _, type_size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, size=(64, 8 * type_size), dtype=np.uint8)  # 8 blocks a row
    # Scales drawn as real float16 values (random bytes would be mostly huge or NaN).
    for block in range(8):
        start = block * type_size
        halves = (1 if name != "Q4_1" else 2) * 2
        scales = rng.normal(0, 0.05, size=(64, halves // 2)).astype(np.float16)
        raw[:, start : start + halves] = scales.view(np.uint8)
    want = dequantize(raw, qtype)
    got = FAST_DEQUANTIZERS[name](raw.reshape(-1)).reshape(want.shape).numpy()
    np.testing.assert_array_equal(got, want)


@pytest.fixture(scope="module")
def smollm2(smollm2_path: str) -> GGUFModel:
    return GGUFModel(smollm2_path)


def test_embedded_tokenizer_is_built_by_kiln_and_equals_transformers(smollm2: GGUFModel) -> None:
    from transformers import PreTrainedTokenizerFast

    assert can_build(smollm2.metadata)
    ours = smollm2.tokenizer()
    directory, name = os.path.split(smollm2.path)
    ref = PreTrainedTokenizerFast.from_pretrained(directory, gguf_file=name)
    assert type(ours) is type(ref)
    # The whole backend, as the tokenizers library serializes it: vocabulary, merges, added and
    # special tokens, normalizer, pre-tokenizer, decoder, post-processor.
    assert json.loads(ours.backend_tokenizer.to_str()) == json.loads(ref.backend_tokenizer.to_str())
    for attr in ("bos_token", "eos_token", "unk_token", "pad_token", "all_special_ids"):
        assert getattr(ours, attr) == getattr(ref, attr), attr
    assert ours.chat_template == ref.chat_template and ours.chat_template
    texts = [
        "Hello  world!\n\n  indented\ttabs",
        "<|im_start|>user\nünïcødé 😀 1234567 'll 've<|im_end|><|endoftext|>",
        "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    ]
    for text in texts:
        ids = ref(text).input_ids
        assert ours(text).input_ids == ids
        assert ours.decode(ids) == ref.decode(ids)
        plain = ref.decode(ids, skip_special_tokens=True)
        assert ours.decode(ids, skip_special_tokens=True) == plain
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    for gen in (True, False):
        assert ours.apply_chat_template(chat, add_generation_prompt=gen) == ref.apply_chat_template(
            chat, add_generation_prompt=gen
        )


def test_other_tokenizer_models_are_left_to_transformers() -> None:
    base = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.merges": ["a b"]}
    assert can_build(base)
    assert not can_build({**base, "tokenizer.ggml.model": "llama"})  # sentencepiece
    assert not can_build({"tokenizer.ggml.model": "gpt2"})  # merges missing
    assert not can_build({**base, "tokenizer.ggml.pre": "tekken"})  # a split kiln doesn't carry


def test_the_embedded_tokenizer_skips_transformers_gguf_tables(smollm2_path: str) -> None:
    """The startup saving itself: no second header read, no transformers.models import."""
    code = (
        "import sys\n"
        "from kiln.checkpoint.gguf_loader import GGUFModel\n"
        f"GGUFModel({smollm2_path!r}).tokenizer()\n"
        "slow = ('transformers.integrations.gguf', 'transformers.models.llama')\n"
        "print(sorted(m for m in slow if m in sys.modules))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "[]"
