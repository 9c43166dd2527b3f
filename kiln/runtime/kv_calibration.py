"""The int8 KV cache's scales, one per (layer, KV head): measured over sample text by running the
model's own layers, each layer's keys and values read back from the cache they wrote.

`kiln build --kv-cache-dtype int8` measures them over its calibration text (../shared/data)
and stores them in the engine. A model that brings none (a checkpoint, a GGUF file, an engine
built without them) is measured as it loads, over SAMPLE_TEXT (a few hundred tokens of English
prose, code and numbers), with no headroom (LOAD_HEADROOM 1): on SmolLM2 that leaves 8 key heads
and 14 value heads of 90 whose WikiText-2 maxima saturate, and still measured better than
doubling the scales (held-out perplexity +0.29% against +1.79%): clipping a head's rare extremes
costs less than a bit of resolution on every value. Without a tokenizer (dummy weights), a
fixed run of token ids stands in for the text.

Keys are measured as each rotary pair's norm (kiln.builder.calibrate.kv_scales: rotation moves
a pair's magnitude between its two elements, never past the pair's norm), so a key at a position
the text never reached stays in range too.
"""

from __future__ import annotations

import math
from types import ModuleType

import torch

from kiln.attention.backend import AttentionBackend
from kiln.kernels.kv_layout import empty_cache
from kiln.kernels.reference import INT8_KV_MAX
from kiln.models.base import CausalLM
from kiln.models.blocks import decoder_layers
from kiln.models.kv_scales import KVHeadScales
from kiln.models.packed_prefill import packed_prefill_metadata
from kiln.tokenizer import Tokenizer

LOAD_HEADROOM = 1.0  # times each measured maximum (see above)
_BLOCK_SIZE = 16  # the measuring pass's own cache (any size works: one prefill)
_FALLBACK_TOKENS = 256  # token ids standing in for text when there is no tokenizer

SAMPLE_TEXT = """\
The history of the river begins in the mountains, where snow melts each spring and feeds a \
hundred small streams. By the time the water reaches the valley it is wide and slow, and the \
towns along its banks have used it for trade, for mills and for drinking water for more than \
eight hundred years. In 1852 a flood destroyed the old stone bridge; the new one, finished in \
1861, still carries 14,000 vehicles a day.

Q: What is 17 multiplied by 23? A: 17 x 23 = 391.
Q: Name three prime numbers greater than 50. A: 53, 59 and 61.

def fibonacci(n: int) -> list[int]:
    \"\"\"The first n Fibonacci numbers.\"\"\"
    numbers = [0, 1]
    while len(numbers) < n:
        numbers.append(numbers[-1] + numbers[-2])
    return numbers[:n]

User: Can you recommend a good book about the ocean?
Assistant: "The Sea Around Us" by Rachel Carson is a classic: it explains how the oceans formed, \
why the tides rise and fall, and how life in the deep sea survives without sunlight. It won the \
National Book Award in 1952 and remains readable today.

{"name": "kiln", "version": "1.0", "features": ["paged cache", "int8", "float8"], "ok": true}
"""


def int8_head_scale(absmax: float) -> float:
    """The smallest power of two s with absmax / s <= 127 (powers of two fold into 16-bit
    weights without changing a mantissa bit: kiln.models.kv_scales)."""
    if not absmax > 0:
        return 1.0
    return 2.0 ** math.ceil(math.log2(absmax / INT8_KV_MAX))


def sample_token_ids(tokenizer: Tokenizer | None, vocab_size: int) -> list[int]:
    """SAMPLE_TEXT's tokens, or without a tokenizer a fixed spread of token ids."""
    if tokenizer is not None:
        ids = tokenizer.encode(SAMPLE_TEXT, add_special_tokens=True)
        if ids:
            return list(ids)
    return [(i * 7919) % vocab_size for i in range(_FALLBACK_TOKENS)]


@torch.no_grad()
def measure_kv_head_absmax(
    model: CausalLM,
    token_batches: list[list[int]],
    ops: ModuleType,
    backend: AttentionBackend,
) -> list[tuple[torch.Tensor, torch.Tensor]]:  # per layer ([kv_heads] keys, [kv_heads] values)
    """Each decoder layer's largest key pair-norm and value magnitude per KV head over
    `token_batches` (each a sequence prefilled from position 0, all as one step), run layer by
    layer through the model's own forward in the model dtype (one whole model, TP=1)."""
    if model.parallel is not None:
        raise ValueError("measuring KV-cache scales runs the whole model in one process")
    lens = [len(b) for b in token_batches]
    if not lens or min(lens) == 0:
        raise ValueError("measuring KV-cache scales needs non-empty token windows")
    cfg, device = model.config, model.device
    metadata, num_blocks = packed_prefill_metadata(lens, _BLOCK_SIZE, device)
    shape = (num_blocks, _BLOCK_SIZE, cfg.num_key_value_heads, cfg.head_dim)
    k_cache, v_cache = (empty_cache(*shape, model.dtype, device) for _ in "kv")
    positions = torch.cat([torch.arange(n) for n in lens]).to(device)
    ids = torch.tensor([t for b in token_batches for t in b], device=device)
    inputs = model.step_inputs(ops, backend, positions, metadata)
    hidden, residual, hidden_norm = model.embed(ids), None, None
    slots = metadata.slot_mapping
    found = []
    for layer in decoder_layers(model):
        hidden, residual = layer(inputs, hidden, residual, (k_cache, v_cache), None, hidden_norm)
        hidden_norm = layer.output_norm
        # [tokens, kv_heads, head_dim] as written (keys rotated: pair norms are rotation-free).
        keys = k_cache[slots // _BLOCK_SIZE, slots % _BLOCK_SIZE].float()
        values = v_cache[slots // _BLOCK_SIZE, slots % _BLOCK_SIZE].float()
        half = keys.shape[-1] // 2
        pair_norm = torch.hypot(keys[..., :half], keys[..., half : 2 * half])
        found.append((pair_norm.amax(dim=(0, 2)).cpu(), values.abs().amax(dim=(0, 2)).cpu()))
    return found


def head_scales(
    absmax: list[tuple[torch.Tensor, torch.Tensor]], headroom: float = 1.0
) -> KVHeadScales:
    """Per layer (k, v) scales per KV head: int8_head_scale of each absmax times `headroom`."""
    return [
        (
            [int8_head_scale(float(a) * headroom) for a in k],
            [int8_head_scale(float(a) * headroom) for a in v],
        )
        for k, v in absmax
    ]


def load_time_head_scales(model: CausalLM, tokenizer: Tokenizer | None) -> KVHeadScales:
    """The default scales of a model that brings none: measured over SAMPLE_TEXT by the
    reference kernels (any device), with LOAD_HEADROOM."""
    from kiln.attention.torch_backend import TorchAttentionBackend
    from kiln.kernels import reference

    # No longer than the model's positions (a short max_model_len's rotary table ends there).
    ids = sample_token_ids(tokenizer, model.config.vocab_size)[: model.cos_sin_cache.shape[0]]
    absmax = measure_kv_head_absmax(model, [ids], reference, TorchAttentionBackend())
    return head_scales(absmax, LOAD_HEADROOM)
