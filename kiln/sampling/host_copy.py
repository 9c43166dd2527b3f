"""Host lists to device tensors without stalling the host."""

from __future__ import annotations

import torch


def to_device(data: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Host list -> tensor on device; pinned memory makes the copy to a GPU asynchronous."""
    if device.type == "cpu":
        return torch.tensor(data, dtype=dtype)
    return torch.tensor(data, dtype=dtype, pin_memory=True).to(device, non_blocking=True)
