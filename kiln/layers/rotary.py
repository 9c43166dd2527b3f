"""Rotary position embedding tables, as transformers computes them: plain, linear, llama3, yarn,
dynamic NTK and longrope (LongRoPE's short and long factors), over the first `dim` dims of a
head (partial rotary: the rest pass unturned).

Two of them depend on the sequence's length, not only on a token's position (transformers
recomputes their frequencies each forward from its longest position): `StepRope` gives each
step the table its tokens index, per sequence."""

from __future__ import annotations

import math

import torch

from kiln.errors import ModelLoadError

ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic", "longrope")
# The types whose frequencies change with the sequence's length (StepRope).
LENGTH_DEPENDENT = ("dynamic", "longrope")


def rope_type_of(rope_scaling: dict | None) -> str:
    scaling = rope_scaling or {}
    return scaling.get("rope_type") or scaling.get("type") or "default"


def rope_inv_freq(
    dim: int,
    theta: float,
    rope_scaling: dict | None,
    max_position_embeddings: int = 2048,
    seq_len: int | None = None,
) -> torch.Tensor:
    """Inverse frequencies exactly as transformers computes them (fp32). `seq_len`: the
    sequence's length, for the length-dependent types (None: at most the trained context)."""
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv_freq = 1.0 / (theta**exponents)
    scaling = rope_scaling or {}
    rope_type = rope_type_of(rope_scaling)
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    if rope_type == "yarn":
        return _yarn_inv_freq(dim, theta, scaling, max_position_embeddings)
    if rope_type == "dynamic":
        if seq_len is None or seq_len <= max_position_embeddings:
            return inv_freq
        return dynamic_inv_freq(dim, theta, scaling, max_position_embeddings, torch.tensor(seq_len))
    if rope_type == "longrope":
        original = _original_max(scaling, max_position_embeddings)
        long = seq_len is not None and seq_len > original
        factors = scaling["long_factor" if long else "short_factor"]
        ext = torch.tensor(factors, dtype=torch.float32)
        if ext.shape != inv_freq.shape:
            raise ModelLoadError(
                f"rope_scaling has {ext.numel()} longrope factors for {inv_freq.numel()} "
                "rotary frequencies"
            )
        return 1.0 / (ext * theta**exponents)
    raise ModelLoadError(
        f"unsupported rope_scaling type {rope_type!r}; supported: {', '.join(ROPE_TYPES)}"
    )


def attention_factor(rope_scaling: dict | None, max_position_embeddings: int) -> float:
    """The factor transformers multiplies cos and sin by (yarn's and longrope's mscale)."""
    scaling = rope_scaling or {}
    rope_type = rope_type_of(rope_scaling)
    given = scaling.get("attention_factor")
    if rope_type == "yarn":
        if given is not None:
            return float(given)
        factor = _yarn_factor(scaling, max_position_embeddings)
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            return float(_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim))
        return _yarn_mscale(factor)
    if rope_type == "longrope":
        if given is not None:
            return float(given)
        original = _original_max(scaling, max_position_embeddings)
        factor = scaling.get("factor") or max_position_embeddings / original
        if factor <= 1.0:
            return 1.0
        return math.sqrt(1 + math.log(factor) / math.log(original))
    return 1.0


def dynamic_inv_freq(
    dim: int,
    theta: float,
    scaling: dict,
    max_position_embeddings: int,
    seq_len: torch.Tensor,  # [n] or []: each row's sequence length, > max_position_embeddings
) -> torch.Tensor:  # [n, dim // 2] (or [dim // 2])
    """Dynamic NTK: the base grown for `seq_len` (transformers' _compute_dynamic_ntk_parameters)."""
    factor = float(scaling["factor"])
    ratio = factor * seq_len.float() / max_position_embeddings - (factor - 1)
    base = theta * ratio ** (dim / (dim - 2))
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=seq_len.device).float() / dim
    return 1.0 / (base[..., None] ** exponents)


def _original_max(scaling: dict, max_position_embeddings: int) -> int:
    return int(scaling.get("original_max_position_embeddings") or max_position_embeddings)


def _yarn_factor(scaling: dict, max_position_embeddings: int) -> float:
    factor = scaling.get("factor")
    if factor is None:
        return max_position_embeddings / _original_max(scaling, max_position_embeddings)
    return float(factor)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(dim: int, theta: float, scaling: dict, max_pos: int) -> torch.Tensor:
    # YaRN: high frequencies extrapolated, low ones interpolated by `factor`, a linear ramp
    # between the dims where the trained context holds beta_fast and beta_slow rotations.
    factor = _yarn_factor(scaling, max_pos)
    original = _original_max(scaling, max_pos)
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp
    return interpolation * (1 - keep) + extrapolation * keep


def _llama3_inv_freq(inv_freq: torch.Tensor, cfg: dict) -> torch.Tensor:
    # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, the band between them
    # interpolated smoothly.
    factor = float(cfg["factor"])
    low_freq_factor = float(cfg["low_freq_factor"])
    high_freq_factor = float(cfg["high_freq_factor"])
    old_context_len = float(cfg["original_max_position_embeddings"])
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def cos_sin_rows(
    positions: torch.Tensor, inv_freq: torch.Tensor, scale: float = 1.0
) -> torch.Tensor:  # [n, dim] fp32: cos(half) then sin(half)
    """Rows of a rotary table; `inv_freq` [dim // 2], or [n, dim // 2] one per position."""
    freqs = positions.float()[:, None] * inv_freq
    table = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
    return table * scale if scale != 1.0 else table


def build_cos_sin_cache(
    dim: int,
    max_positions: int,
    theta: float,
    rope_scaling: dict | None,
    max_position_embeddings: int = 2048,
    seq_len: int | None = None,
) -> torch.Tensor:  # [max_positions, dim] fp32: cos(half) then sin(half)
    """The table a position indexes, for sequences of `seq_len` (see rope_inv_freq)."""
    inv_freq = rope_inv_freq(dim, theta, rope_scaling, max_position_embeddings, seq_len)
    scale = attention_factor(rope_scaling, max_position_embeddings)
    return cos_sin_rows(torch.arange(max_positions), inv_freq, scale)


def token_seq_lens(
    num_tokens: int,
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
) -> torch.Tensor:  # [num_tokens]: each token's sequence's length after this step
    """Each packed token's sequence length, without a host sync (a graph may capture it);
    padding tokens past the last sequence take its length."""
    tokens = torch.arange(num_tokens, device=seq_lens.device, dtype=query_start_loc.dtype)
    seq = torch.searchsorted(query_start_loc[1:].contiguous(), tokens, right=True)
    return seq_lens[seq.clamp_(max=max(seq_lens.shape[0] - 1, 0))]


class StepRope(torch.nn.Module):
    short_long: torch.Tensor  # longrope: [2 * max_positions, dim], short rows then long
    """The rotary rows of one step for the length-dependent types, as transformers applies them
    to one sequence: its tokens rotate with the frequencies of the sequence's length after this
    step (a decode's, its position + 1; a prefill's, its prompt's). longrope: the short table
    while that length is within original_max_position_embeddings, else the long one (the two
    tables stacked, positions offset into the long half); dynamic NTK: frequencies computed
    per token past max_position_embeddings. A prompt prefilled in chunks rotates its chunks by
    the length each has reached, as transformers rotates tokens generated past the threshold."""

    def __init__(
        self,
        dim: int,
        max_positions: int,
        theta: float,
        rope_scaling: dict,
        max_position_embeddings: int,
        dtype: torch.dtype | None,
    ) -> None:
        super().__init__()
        self.rope_type = rope_type_of(rope_scaling)
        self.dim, self.theta, self.scaling = dim, theta, rope_scaling
        self.max_position_embeddings, self.max_positions = max_position_embeddings, max_positions
        self.round_to = dtype or torch.float32
        self.threshold = max_position_embeddings
        both = torch.empty(0)
        if self.rope_type == "longrope":
            self.threshold = _original_max(rope_scaling, max_position_embeddings)
            tables = [
                build_cos_sin_cache(dim, max_positions, theta, rope_scaling,
                                    max_position_embeddings, seq_len)
                for seq_len in (None, self.threshold + 1)
            ]  # fmt: skip
            # Rounded to the model dtype as the main table is (transformers rounds cos/sin too).
            both = torch.cat(tables).to(self.round_to).float()
        self.register_buffer("short_long", both, persistent=False)

    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens]
        query_start_loc: torch.Tensor,
        seq_lens: torch.Tensor,
        table: torch.Tensor,  # the model's table (short / trained-length frequencies)
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (positions into the step's table, the table)
        lengths = token_seq_lens(positions.shape[0], query_start_loc, seq_lens)
        long = lengths > self.threshold
        if self.rope_type == "longrope":
            return positions + long.to(positions.dtype) * self.max_positions, self.short_long
        # dynamic NTK: each token's rows at its sequence's grown base (the trained one within).
        grown = dynamic_inv_freq(
            self.dim, self.theta, self.scaling, self.max_position_embeddings,
            torch.where(long, lengths, self.threshold + 1),
        )  # fmt: skip
        rows = cos_sin_rows(positions, grown).to(self.round_to).float()
        rows = torch.where(long[:, None], rows, table[positions])
        return torch.arange(positions.shape[0], device=positions.device), rows
