"""The embedded SmolLM2 GGUF as an HF checkpoint directory (what the peers' tools read): kiln's
own GGUF reader's float32 tensors (dequantized Q4_1, q/k un-permuted), a LlamaConfig from its
ModelConfig, its tokenizer. The same weights kiln's build quantizes, so a peer's checkpoint of
this directory and kiln's static fp8 start from one source.

    python make_source.py OUT_DIR
"""

from __future__ import annotations

import sys

from safetensors.torch import save_file
from transformers import LlamaConfig

from kiln.checkpoint.default_model import default_model_path
from kiln.checkpoint.gguf_loader import GGUFModel


def main(out: str) -> None:
    model = GGUFModel(default_model_path())
    c = model.config
    tensors = {name: t.contiguous() for name, t in model.tensors()}
    if c.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    config = LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size, num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
        head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_theta,
        rope_scaling=c.rope_scaling, max_position_embeddings=c.max_position_embeddings,
        tie_word_embeddings=c.tie_word_embeddings, attention_bias=c.attention_bias,
        bos_token_id=c.bos_token_id,
        eos_token_id=list(c.eos_token_ids) if len(c.eos_token_ids) > 1 else c.eos_token_ids[0],
        torch_dtype="float32", architectures=["LlamaForCausalLM"],
    )  # fmt: skip
    config.save_pretrained(out)
    save_file(tensors, f"{out}/model.safetensors", metadata={"format": "pt"})
    model.tokenizer().save_pretrained(out)
    print(out, len(tensors), "tensors", sorted(tensors)[:3])


if __name__ == "__main__":
    main(sys.argv[1])
