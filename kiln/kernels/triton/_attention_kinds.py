"""The runtime arguments both attention kernels take for a layer's attention kind (a sliding
window, a logit soft-cap, per-head sinks: see reference.attend_math), in their order. Each is
read only under its constexpr flag, so a plain layer compiles to the kernel it always was."""

from __future__ import annotations

import torch

_LOG2E = 1.4426950408889634


def kind_args(
    query: torch.Tensor,
    scale: float,
    window: int | None,
    softcap: float | None,
    sinks: torch.Tensor | None,
) -> tuple:
    """(window, softcap_in, softcap_out, sinks pointer): placeholders where a kind is unset."""
    if window is not None and window < 1:
        raise ValueError(f"sliding window {window} must be at least 1")
    if sinks is not None:
        assert sinks.dtype == torch.float32 and sinks.shape == (query.shape[1],), sinks.shape
    cap_in, cap_out = (scale / softcap, softcap * _LOG2E) if softcap is not None else (1.0, 1.0)
    return (window or 0, cap_in, cap_out, query if sinks is None else sinks)
