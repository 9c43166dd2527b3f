"""A GGUF file's 4-bit blocks (Q4_0, Q4_1) kept as kiln's INT4 W4A16 layout instead of widened
(`load_format="gguf-int4"`): each block of 32 inputs is one group, its codes packed 8 to an int32
word (kiln.layers.quantization.int4), its fp16 scale d as the group's scale and its min as the
group's zero in weight units (the "-min" form, w = code * scale + min). Q4_1's min is the block's
m; Q4_0's (w = d * (code - 8)) is -8d. code * d takes no rounding in fp32 (4 bits times 11), so
the values are the file's dequantized ones bit for bit, and so are Q4_0's (-8d and the sum are
exact too).

What does not map as it stands: Q8_0 (W8A16 int8 takes per-channel or 128-groups, not 32);
k-quants (Q4_K: 8 groups of 32 per 256, each scale d * sc and min dmin * m, both exact in fp32,
so the "-min" form holds them once its nibble order is read); any file whose decoder
projections are not all Q4_0 / Q4_1 loads dequantized.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterator

import numpy as np
import torch

GROUP_SIZE = 32
SCHEME = "int4-g32-min"  # kiln.layers.quantization's name for these groups
INT4_TYPES = ("Q4_0", "Q4_1")
_PROJECTION = re.compile(r"^model\.layers\.\d+\..*_proj\.weight$")


def is_projection(hf_name: str) -> bool:
    """A decoder layer's linear projection: the tensors the INT4 method takes."""
    return bool(_PROJECTION.match(hf_name))


def _blocks(raw: np.ndarray, block_bytes: int) -> torch.Tensor:
    with warnings.catch_warnings():  # a read-only memory map: only read here, never written
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(raw).view(-1, block_bytes)


def _half(blocks: torch.Tensor, start: int) -> torch.Tensor:
    return blocks[:, start : start + 2].contiguous().view(torch.float16).float()[:, 0]


def int4_groups(
    raw: np.ndarray, qtype: str, shape: tuple[int, int]
) -> Iterator[tuple[str, torch.Tensor]]:
    """(suffix, tensor) of one [N, K] projection's blocks: "" the packed codes [N, K / 8] int32,
    "_scales" and "_zeros" [N, K / 32] fp32 (the zeros holding mins)."""
    n, k = shape
    if qtype == "Q4_0":
        blocks = _blocks(raw, 18)  # fp16 d, 16 bytes of nibbles
        scales = _half(blocks, 0)
        mins = -8.0 * scales
        nibbles = blocks[:, 2:]
    elif qtype == "Q4_1":
        blocks = _blocks(raw, 20)  # fp16 d, fp16 m, 16 bytes of nibbles
        scales, mins, nibbles = _half(blocks, 0), _half(blocks, 2), blocks[:, 4:]
    else:
        raise ValueError(f"{qtype} blocks are not INT4 groups (only {', '.join(INT4_TYPES)})")
    # ggml's order: a block's low nibbles are its first 16 inputs, its high nibbles the rest.
    codes = torch.cat((nibbles & 0x0F, nibbles >> 4), dim=1).to(torch.int32).reshape(n, k)
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    # Code 8j + i of a row at bits 4i of word j; the bits do not overlap, so the sum is an OR.
    packed = (codes.reshape(n, k // 8, 8) << shifts).sum(-1, dtype=torch.int32)
    yield "", packed
    yield "_scales", scales.reshape(n, k // GROUP_SIZE)
    yield "_zeros", mins.reshape(n, k // GROUP_SIZE)
