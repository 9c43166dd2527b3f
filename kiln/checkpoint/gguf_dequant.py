"""Whole-tensor torch dequantizers for the GGUF types kiln's default model ships (Q4_0, Q4_1, Q8_0).

`gguf.quants.dequantize` is correct but walks a tensor in row groups through numpy, which took
~2 s of SmolLM2-135M's ~4 s load on a 2-core machine; these run each tensor as a handful of torch
element-wise ops over all its blocks at once (~0.3 s for the model). They compute what gguf's
numpy code computes, in the same float32 order (scale * q [+ min]), so the results are bitwise
equal (tests/checkpoint/test_gguf_fast_paths.py checks each type against gguf.quants). Types
not here fall back to gguf.quants.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch


def _blocks(raw: np.ndarray, block_bytes: int) -> torch.Tensor:
    with warnings.catch_warnings():  # a read-only memory map: only read here, never written
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(raw).view(-1, block_bytes)


def _half(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The float16 at byte `start` of every block, as a float32 column."""
    return blocks[:, start : start + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """ggml's 4-bit layout: a block's low nibbles are its first half, high nibbles its second."""
    return torch.cat((qs & 0x0F, qs >> 4), dim=1)


def dequantize_q8_0(raw: np.ndarray) -> torch.Tensor:
    blocks = _blocks(raw, 34)  # float16 scale, 32 int8
    return blocks[:, 2:].contiguous().view(torch.int8).float() * _half(blocks, 0)


def dequantize_q4_0(raw: np.ndarray) -> torch.Tensor:
    blocks = _blocks(raw, 18)  # float16 scale, 16 bytes of nibbles (q - 8)
    q = _nibbles(blocks[:, 2:]).to(torch.int8) - 8
    return _half(blocks, 0) * q.float()


def dequantize_q4_1(raw: np.ndarray) -> torch.Tensor:
    blocks = _blocks(raw, 20)  # float16 scale, float16 min, 16 bytes of nibbles
    return _half(blocks, 0) * _nibbles(blocks[:, 4:]).float() + _half(blocks, 2)


# ggml type name -> dequantizer of the tensor's raw bytes into a flat float32 tensor.
FAST_DEQUANTIZERS = {"Q8_0": dequantize_q8_0, "Q4_0": dequantize_q4_0, "Q4_1": dequantize_q4_1}
