"""A GGUF file's integer blocks kept as kiln's integer linear methods instead of widened
(`load_format="gguf-int"`), each block of 32 inputs one group:

- Q4_0 / Q4_1 -> INT4 W4A16 (kiln.layers.quantization.int4): codes packed 8 to an int32 word,
  the block's fp16 scale d as the group's scale and its min as the group's zero in weight units
  (the "-min" form, w = code * scale + min). Q4_1's min is the block's m; Q4_0's
  (w = d * (code - 8)) is -8d. code * d takes no rounding in fp32 (4 bits times 11), nor do -8d
  and Q4_0's sum, so the values are the file's dequantized ones bit for bit.
- Q4_K -> the same INT4 groups: a super-block of 256 is 8 groups of 32, group j's scale
  d * sc_j and min -dmin * m_j (6-bit sc_j, m_j): both products exact in fp32, and so is
  code * scale (4 + 17 bits), so code * scale + min rounds once, as ggml's d * q - dm does.
- Q8_0 -> INT8 W8A16 (kiln.layers.quantization.w8a16): the int8 codes as they are, d as the
  group's scale (w = code * d, exact in fp32 too).

Every decoder projection must map to one scheme (INT4 or INT8): a file mixing them, or holding
other types (Q5_*, Q6_K: no 5- or 6-bit method; llama.cpp's Q4_K_M mixes in Q6_K), is refused and
loads dequantized by default.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterator

import numpy as np
import torch

GROUP_SIZE = 32
# ggml type -> kiln.layers.quantization's scheme for its groups.
SCHEMES = {
    "Q4_0": "int4-g32-min",
    "Q4_1": "int4-g32-min",
    "Q4_K": "int4-g32-min",
    "Q8_0": "int8-w8a16-g32",
}
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


def scheme_of(types: list[str]) -> str | None:
    """The one scheme every projection type maps to (None: none, or several)."""
    schemes = {SCHEMES.get(t) for t in types}
    return schemes.pop() if len(schemes) == 1 and None not in schemes else None


def int_groups(
    raw: np.ndarray, qtype: str, shape: tuple[int, int]
) -> Iterator[tuple[str, torch.Tensor]]:
    """(suffix, tensor) of one [N, K] projection's blocks: "" the codes (INT4: packed [N, K / 8]
    int32; INT8: [N, K] int8), "_scales" [N, K / 32] fp32, and for INT4 "_zeros" (mins)."""
    n, k = shape
    if qtype == "Q8_0":
        blocks = _blocks(raw, 34)  # fp16 d, 32 int8 codes
        yield "", blocks[:, 2:].contiguous().view(torch.int8).reshape(n, k)
        yield "_scales", _half(blocks, 0).reshape(n, k // GROUP_SIZE)
        return
    if qtype == "Q4_K":
        yield from _q4_k_groups(raw, n, k)
        return
    if qtype == "Q4_0":
        blocks = _blocks(raw, 18)  # fp16 d, 16 bytes of nibbles
        scales = _half(blocks, 0)
        mins = -8.0 * scales
        nibbles = blocks[:, 2:]
    elif qtype == "Q4_1":
        blocks = _blocks(raw, 20)  # fp16 d, fp16 m, 16 bytes of nibbles
        scales, mins, nibbles = _half(blocks, 0), _half(blocks, 2), blocks[:, 4:]
    else:
        raise ValueError(f"{qtype} blocks map to no integer method (only {', '.join(SCHEMES)})")
    # ggml's order: a block's low nibbles are its first 16 inputs, its high nibbles the rest.
    codes = torch.cat((nibbles & 0x0F, nibbles >> 4), dim=1)
    yield from _int4_parts(codes, scales, mins, n, k)


def _q4_k_groups(raw: np.ndarray, n: int, k: int) -> Iterator[tuple[str, torch.Tensor]]:
    """Q4_K's super-blocks (fp16 d, fp16 dmin, 12 bytes of 6-bit scales and mins, 128 bytes of
    nibbles) as 8 groups of 32 each, unpacked as gguf.quants.Q4_K does."""
    blocks = _blocks(raw, 144)
    d, dmin = _half(blocks, 0)[:, None], _half(blocks, 2)[:, None]
    packed = blocks[:, 4:16].reshape(-1, 3, 4)
    lo, hi, both = packed[:, 0], packed[:, 1], packed[:, 2]
    sc = torch.cat((lo & 0x3F, (both & 0x0F) | ((lo >> 2) & 0x30)), dim=1)  # [blocks, 8]
    mn = torch.cat((hi & 0x3F, (both >> 4) | ((hi >> 2) & 0x30)), dim=1)
    # 4 runs of 32 bytes: a run's low nibbles are group 2j, its high nibbles group 2j + 1.
    qs = blocks[:, 16:].reshape(-1, 4, 1, 32)
    codes = torch.cat((qs & 0x0F, qs >> 4), dim=2).reshape(-1, 256)
    yield from _int4_parts(codes, d * sc.float(), -(dmin * mn.float()), n, k)


def _int4_parts(
    codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, n: int, k: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """Codes in input order (any block shape, [n * k] elements) packed as kiln's INT4 words,
    and the groups' scales and mins [n, k / 32]."""
    codes = codes.to(torch.int32).reshape(n, k)
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    # Code 8j + i of a row at bits 4i of word j; the bits do not overlap, so the sum is an OR.
    packed = (codes.reshape(n, k // 8, 8) << shifts).sum(-1, dtype=torch.int32)
    yield "", packed
    yield "_scales", scales.reshape(n, k // GROUP_SIZE)
    yield "_zeros", mins.reshape(n, k // GROUP_SIZE)
