"""A GGUF file's integer blocks kept as kiln's integer linear methods instead of widened
(`load_format="gguf-int"`). Every type here is a code times a group's scale, plus for some a
group's min (w = code * scale + min), and each product and sum takes at most the one rounding
gguf.quants' own dequantization takes, so the values are the file's bit for bit:

- Q4_0 / Q4_1 / Q4_K -> INT4 W4A16 (kiln.layers.quantization.int4) in groups of 32, the "-min"
  form: codes packed 8 to an int32 word, a block's fp16 scale d as the group's scale and its
  min as the group's min in weight units. Q4_1's min is the block's m; Q4_0's (w = d * (code -
  8)) is -8d. Q4_K: a super-block of 256 is 8 groups of 32, group j's scale d * sc_j and min
  -dmin * m_j (6-bit sc_j, m_j), both exact in fp32, as is code * scale (4 + 17 bits), so code *
  scale + min rounds once, as ggml's d * q - dm does.
- Q2_K / Q3_K -> the same INT4 form in groups of 16: Q2_K's 2-bit q with scale d * sc_j and
  min -dmin * m_j (4-bit sc_j, m_j); Q3_K's q in -4..3 as code q + 4 with min -4 * scale, its
  scale d * (sc_j - 32) (6-bit sc_j): every product exact, the sum rounding once or not at
  all (Q3_K's is d * sc_j * q, representable).
- Q5_0 / Q5_1 / Q5_K / Q6_K / Q8_0 -> INT8 W8A16 (kiln.layers.quantization.w8a16), one int8
  code a weight: Q8_0's codes as they are, Q5_0's q - 16 and Q6_K's q - 32 (signed, no min:
  w = code * scale), Q5_1's and Q5_K's 5-bit q with a min as Q4_1's and Q4_K's. Q6_K scales
  groups of 16 (d * its int8 sc_j: 11 + 8 bits, times a 6-bit code, exact), the others 32.
- IQ4_NL / IQ4_XS -> the same INT8 form: their 4-bit indices into llama.cpp's table of 16 int8
  values stored as the values themselves, scale d (IQ4_XS: d * (sc_j - 32), 6-bit sc_j, per 32):
  11 + 6 + 7 bits, exact. (A 4-bit kernel with the table would read half the bytes.)

A layer kiln fuses (q/k/v into qkv_proj, gate/up into gate_up_proj) takes one method: INT4
when every part has 4 bits or fewer, else INT8, in the smallest group any part needs (16 with
a Q2_K / Q3_K / Q6_K part, a 32-group's scale and min repeated over its two halves), with mins
when any part has them (the others' 0). llama.cpp's Q4_K_M puts attn_v and ffn_down in Q6_K
on some layers: those layers' qkv_proj runs INT8 in groups of 16 with mins, their down_proj
INT8 in groups of 16, the rest INT4. Other types (IQ1-IQ3, TQ*, MXFP4, 16- and 32-bit floats)
are refused.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterator, Mapping

import numpy as np
import torch

from kiln.checkpoint.int4_formats import pack_int4

# ggml type -> (bits of the codes kiln keeps for it, inputs per scale, whether a group has a min).
TYPES: dict[str, tuple[int, int, bool]] = {
    "Q2_K": (2, 16, True),
    "Q3_K": (3, 16, False),
    "Q4_0": (4, 32, False),
    "Q4_1": (4, 32, True),
    "Q4_K": (4, 32, True),
    "Q5_0": (5, 32, False),
    "Q5_1": (5, 32, True),
    "Q5_K": (5, 32, True),
    "Q6_K": (6, 16, False),
    "Q8_0": (8, 32, False),
    "IQ4_NL": (8, 32, False),
    "IQ4_XS": (8, 32, False),
}
# llama.cpp's IQ4_NL / IQ4_XS values of the 4-bit indices (gguf.quants.IQ4_NL.kvalues).
IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
_PROJECTION = re.compile(r"^model\.layers\.(\d+)\.(.*_proj\.weight)$")


def is_projection(hf_name: str) -> bool:
    """A decoder layer's linear projection: the tensors the integer methods take."""
    return bool(_PROJECTION.match(hf_name))


def scheme_for(types: list[str]) -> str:
    """The one scheme that holds every part of a (fused) layer exactly, in the smallest group any
    part needs: INT4 with mins when all have 4 bits or fewer, else INT8 W8A16, with mins when
    any part has them (projection_schemes has refused types outside TYPES)."""
    group = min(TYPES[t][1] for t in types)
    if all(TYPES[t][0] <= 4 for t in types):
        return f"int4-g{group}-min"
    return f"int8-w8a16-g{group}" + ("-min" if any(TYPES[t][2] for t in types) else "")


def projection_schemes(
    types: Mapping[str, str], layer_map: Mapping[str, tuple[str, int | None]]
) -> tuple[dict[str, str], dict[str, str]]:
    """({kiln layer name: scheme}, {hf tensor name: its layer's scheme}) from each projection's
    {hf tensor name: ggml type}; `layer_map` is the family's (hf name in a layer -> kiln's
    fused parameter and shard). A ValueError names a type no method takes."""
    parts: dict[str, list[str]] = {}
    layer_of: dict[str, str] = {}
    for hf_name, qtype in types.items():
        match = _PROJECTION.match(hf_name)
        assert match is not None, hf_name
        ours = layer_map.get(match.group(2), (match.group(2), None))[0]
        layer = f"layers.{match.group(1)}.{ours.removesuffix('.weight')}"
        parts.setdefault(layer, []).append(qtype)
        layer_of[hf_name] = layer
    unknown = {name: t for name, t in types.items() if t not in TYPES}
    if unknown:
        example = next(iter(unknown))
        raise ValueError(
            f"{', '.join(sorted(set(unknown.values())))} projections (e.g. {example}) map to no "
            f"integer method; it takes {', '.join(TYPES)}"
        )
    layers = {layer: scheme_for(qtypes) for layer, qtypes in parts.items()}
    return layers, {name: layers[layer] for name, layer in layer_of.items()}


def _blocks(raw: np.ndarray, block_bytes: int) -> torch.Tensor:
    with warnings.catch_warnings():  # a read-only memory map: only read here, never written
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(raw).view(-1, block_bytes)


def _half(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The fp16 at byte `start` of every block, as an fp32 column [blocks, 1]."""
    return blocks[:, start : start + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """Bytes [..., b] -> their low nibbles, then their high ones [..., 2b] (ggml's order)."""
    return torch.cat((qs & 0x0F, qs >> 4), dim=-1)


def _high_bits(qh: torch.Tensor, count: int) -> torch.Tensor:
    """Bit i of a block's little-endian bit field qh [blocks, count / 8], for i < count."""
    i = torch.arange(count)
    return (qh[:, i // 8] >> (i % 8).to(torch.uint8)) & 1


def _k_scales(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K's / Q5_K's 12 bytes -> 8 six-bit scales and 8 mins, as gguf.quants.Q4_K unpacks."""
    packed = packed.reshape(-1, 3, 4)
    lo, hi, both = packed[:, 0], packed[:, 1], packed[:, 2]
    sc = torch.cat((lo & 0x3F, (both & 0x0F) | ((lo >> 2) & 0x30)), dim=1)
    mn = torch.cat((hi & 0x3F, (both >> 4) | ((hi >> 2) & 0x30)), dim=1)
    return sc.float(), mn.float()


def decode(raw: np.ndarray, qtype: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A tensor's blocks as (codes [blocks, block size] int8 in input order, scales [blocks,
    groups] fp32, mins as scales or None: w = code * scale (+ min))."""
    if qtype == "Q8_0":
        blocks = _blocks(raw, 34)  # fp16 d, 32 int8 codes
        return blocks[:, 2:].contiguous().view(torch.int8), _half(blocks, 0), None
    if qtype == "Q4_0":
        blocks = _blocks(raw, 18)  # fp16 d, 16 bytes of nibbles: w = d * (q - 8)
        return (_nibbles(blocks[:, 2:]).to(torch.int8) - 8), _half(blocks, 0), None
    if qtype == "Q4_1":
        blocks = _blocks(raw, 20)  # fp16 d, fp16 m, 16 bytes of nibbles: w = d * q + m
        return _nibbles(blocks[:, 4:]).to(torch.int8), _half(blocks, 0), _half(blocks, 2)
    if qtype == "Q5_0":
        blocks = _blocks(raw, 22)  # fp16 d, 4 bytes of fifth bits, 16 of nibbles: d * (q - 16)
        q = _nibbles(blocks[:, 6:]) | (_high_bits(blocks[:, 2:6], 32) << 4)
        return q.to(torch.int8) - 16, _half(blocks, 0), None
    if qtype == "Q5_1":
        blocks = _blocks(raw, 24)  # fp16 d, fp16 m, fifth bits, nibbles: w = d * q + m
        q = _nibbles(blocks[:, 8:]) | (_high_bits(blocks[:, 4:8], 32) << 4)
        return q.to(torch.int8), _half(blocks, 0), _half(blocks, 2)
    if qtype in ("Q4_K", "Q5_K"):
        return _k_quant(raw, qtype)
    if qtype == "Q2_K":
        # 16 bytes of 4-bit scales (low) and mins (high), 64 of 2-bit codes, fp16 d, fp16 dmin.
        blocks = _blocks(raw, 84)
        shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).reshape(1, 1, 4, 1)
        q = ((blocks[:, 16:80].reshape(-1, 2, 1, 32) >> shifts) & 3).reshape(-1, 256)
        sc, mn = (blocks[:, :16] & 0x0F).float(), (blocks[:, :16] >> 4).float()
        return q.to(torch.int8), _half(blocks, 80) * sc, -(_half(blocks, 82) * mn)
    if qtype == "Q3_K":
        return _q3_k(raw)
    if qtype == "IQ4_NL":
        blocks = _blocks(raw, 18)  # fp16 d, 16 bytes of 4-bit indices: w = d * value
        table = torch.tensor(IQ4_VALUES, dtype=torch.int8)
        return table[_nibbles(blocks[:, 2:]).long()], _half(blocks, 0), None
    if qtype == "IQ4_XS":
        return _iq4_xs(raw)
    if qtype == "Q6_K":
        # 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8 scales, fp16 d.
        blocks = _blocks(raw, 210)
        ql = _nibbles(blocks[:, :128].reshape(-1, 2, 1, 64)).reshape(-1, 256)
        shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).reshape(1, 1, 4, 1)
        qh = ((blocks[:, 128:192].reshape(-1, 2, 1, 32) >> shifts) & 3).reshape(-1, 256)
        codes = (ql | (qh << 4)).to(torch.int8) - 32
        sc = blocks[:, 192:208].contiguous().view(torch.int8).float()
        return codes, _half(blocks, 208) * sc, None
    raise ValueError(f"{qtype} blocks map to no integer method (only {', '.join(TYPES)})")


def _k_quant(raw: np.ndarray, qtype: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_K's (fp16 d, fp16 dmin, 12 bytes of 6-bit scales and mins, 128 bytes of nibbles) and
    Q5_K's (the same with 32 bytes of fifth bits before the nibbles) super-blocks of 256: 8
    groups of 32, group j's scale d * sc_j and min -dmin * m_j."""
    five = qtype == "Q5_K"
    blocks = _blocks(raw, 176 if five else 144)
    sc, mn = _k_scales(blocks[:, 4:16])
    # 4 runs of 32 bytes: a run's low nibbles are group 2j, its high nibbles group 2j + 1.
    q = _nibbles(blocks[:, 48 if five else 16 :].reshape(-1, 4, 1, 32)).reshape(-1, 256)
    if five:  # group g's fifth bits: bit g of each of the 32 bytes
        shifts = torch.arange(8, dtype=torch.uint8).reshape(1, 8, 1)
        q = q | (((blocks[:, 16:48].reshape(-1, 1, 32) >> shifts) & 1).reshape(-1, 256) << 4)
    return q.to(torch.int8), _half(blocks, 0) * sc, -(_half(blocks, 2) * mn)


def _q3_k(raw: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, None]:
    """Q3_K's super-blocks (32 bytes of high bits, 64 of 2-bit low bits, 12 of 6-bit scales,
    fp16 d) as 16 groups of 16, w = d * (sc_j - 32) * q, q in -4..3 (4 less where the high bit
    is clear), unpacked as gguf.quants.Q3_K does."""
    blocks = _blocks(raw, 110)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8)
    low = (blocks[:, 96:104].reshape(-1, 1, 8) >> torch.tensor([0, 4], dtype=torch.uint8)
           .reshape(1, 2, 1)).reshape(-1, 16)  # fmt: skip
    high = (blocks[:, 104:108].reshape(-1, 1, 4) >> shifts.reshape(1, 4, 1)).reshape(-1, 16)
    sc = ((low & 0x0F) | ((high & 3) << 4)).float() - 32
    ql = (blocks[:, 32:96].reshape(-1, 2, 1, 32) >> shifts.reshape(1, 1, 4, 1)) & 3
    bits = torch.arange(8, dtype=torch.uint8).reshape(1, 1, 8, 1)
    qh = (blocks[:, :32].reshape(-1, 1, 1, 32) >> bits) & 1
    q = ql.reshape(-1, 256).to(torch.int8) - 4 * (1 - qh.reshape(-1, 256).to(torch.int8))
    return q, _half(blocks, 108) * sc, None


def _iq4_xs(raw: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, None]:
    """IQ4_XS's super-blocks (fp16 d, 2 bytes of the scales' high 2 bits, 4 of their low 4, 128
    of 4-bit indices) as 8 groups of 32, group j's scale d * (sc_j - 32), as gguf.quants
    unpacks them."""
    blocks = _blocks(raw, 136)
    low = _nibbles(blocks[:, 4:8].reshape(-1, 4, 1)).reshape(-1, 8)  # byte j: groups 2j, 2j + 1
    high = blocks[:, 2:4].contiguous().view(torch.int16).int() & 0xFFFF
    high = (high >> torch.arange(0, 16, 2)) & 3
    sc = (low.int() | (high << 4)).float() - 32
    table = torch.tensor(IQ4_VALUES, dtype=torch.int8)
    codes = table[_nibbles(blocks[:, 8:].reshape(-1, 8, 16)).reshape(-1, 256).long()]
    return codes, _half(blocks, 0) * sc, None


def int_groups(
    raw: np.ndarray, qtype: str, shape: tuple[int, int], scheme: str
) -> Iterator[tuple[str, torch.Tensor]]:
    """(suffix, tensor) of one [N, K] projection's blocks in its layer's `scheme`
    (projection_schemes): "" the codes (INT4: packed [N, K / 8] int32; INT8: [N, K] int8),
    "_scales" [N, groups] fp32, and where the scheme has mins "_zeros" (the mins, 0 for a type
    without)."""
    n, k = shape
    codes, scales, mins = decode(raw, qtype)
    per_scale = codes.shape[1] // scales.shape[1]
    group = int(re.sub(r"^int(4|8-w8a16)-g(\d+)(-min)?$", r"\2", scheme))
    if per_scale % group:
        raise ValueError(f"{qtype}'s groups of {per_scale} do not fit {scheme}")
    repeat = per_scale // group
    if scheme.startswith("int4-"):
        if mins is None:  # Q4_0's / Q3_K's signed codes from 0, the offset's share the min
            offset = 1 << (TYPES[qtype][0] - 1)  # -8d, -4d: exact, as d * (q - offset)
            codes, mins = codes + offset, -float(offset) * scales
        yield from _int4_parts(
            codes, scales.repeat_interleave(repeat, 1), mins.repeat_interleave(repeat, 1), n, k
        )
        return
    yield "", codes.reshape(n, k)
    yield "_scales", scales.reshape(n, -1).repeat_interleave(repeat, dim=1)
    if scheme.endswith("-min"):
        mins = torch.zeros_like(scales) if mins is None else mins
        yield "_zeros", mins.reshape(n, -1).repeat_interleave(repeat, dim=1)
    elif mins is not None:
        raise ValueError(f"{qtype} has mins; {scheme} has none")


def _int4_parts(
    codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, n: int, k: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """Codes 0..15 in input order (any block shape, [n * k] elements) packed as kiln's INT4
    words, and the groups' scales and mins [n, groups]."""
    yield "", pack_int4(codes.reshape(n, k))
    yield "_scales", scales.reshape(n, -1)
    yield "_zeros", mins.reshape(n, -1)
