"""The MoE kernel tests' comparison with a twin: within a fraction of the output's peak."""

from __future__ import annotations

import torch

# Model-dtype experts: fp16 / bf16 round gate_up and the activation (bf16 keeps 8 bits).
MODEL_DTYPE_TOL = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 2e-2}
# Float8 activations: a code may flip, one float8 step of a value.
FLOAT8_TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 3e-2}
# Hopper's float8 tensor cores accumulate in fewer bits than the twin's fp32: measured up to
# 1.8e-4 of the peak on an H100.
HOPPER_FLOAT8_FLOOR = 2e-3


def close_to_peak(
    got: torch.Tensor,
    want: torch.Tensor,
    dtype: torch.dtype,
    tols: dict[torch.dtype, float] = MODEL_DTYPE_TOL,
    floor: float = 0.0,
) -> None:
    peak = want.float().abs().max()
    assert peak > 0.1  # not a vacuous zero-vs-zero comparison
    tol = max(tols[dtype], floor)
    torch.testing.assert_close(got.float(), want.float(), atol=tol * peak, rtol=0)
