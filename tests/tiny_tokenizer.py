"""A tiny byte-level BPE tokenizer (trained here on JSON-like text, no hub) with a Hermes-style
chat template that renders tools, tool calls and tool results, and a tiny random Llama that uses
it: what the structured-output and tool-call tests run on."""

from __future__ import annotations

import json
import os

SPECIALS = ["<|pad|>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]  # bos 1, eos 2 as TINY_BASE

# Qwen2.5's tool format, shortened: tools in the system turn, calls in <tool_call> blocks, tool
# results as a user turn in <tool_response> blocks.
CHAT_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nYou may call these tools:\n<tools>"
    "{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n</tools>\n"
    'Answer with <tool_call>{"name": ..., "arguments": ...}</tool_call>.<|im_end|>\n'
    "{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n"
    "</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content or '' }}"
    "{%- for call in m.tool_calls or [] %}\n<tool_call>\n"
    '{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}'
    "\n</tool_call>{%- endfor %}<|im_end|>\n"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)

CORPUS = [
    '{"name": "Ada", "age": 36, "tags": ["math", "code"], "ok": true, "x": null}',
    '{"city": "Paris", "unit": "celsius", "items": [1, 2, 3], "nested": {"a": 1.5}}',
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
    "The quick brown fox jumps over the lazy dog. Hello world! 0123456789 -_.:,;",
]


def build_tokenizer(vocab_size: int = 384):
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer)
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<|pad|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
        chat_template=CHAT_TEMPLATE,
    )


def build_tiny_chat_model(path: str, seed: int = 0) -> str:
    """Save a tiny random Llama with the tokenizer above to `path`; returns path."""
    import torch
    import transformers

    from tests.conftest import TINY_BASE

    tokenizer = build_tokenizer()
    cfg = {**TINY_BASE, "vocab_size": len(tokenizer), "architectures": ["LlamaForCausalLM"]}
    config = transformers.AutoConfig.for_model("llama", **cfg)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": 1, "eos_token_id": 2}, f)
    return path
