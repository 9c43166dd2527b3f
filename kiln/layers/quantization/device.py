"""Whether this GPU runs float8: Triton's kernels and torch._scaled_mm take float8 e4m3 from
compute capability 8.9 (Ada) on. On an A100 Triton refuses the type only when the first kernel
compiles, deep in an engine's start-up or a build's calibration, as a traceback; this check says
so before anything loads. The CPU runs the PyTorch twins, any float8."""

from __future__ import annotations

import torch

FLOAT8_MIN_CAPABILITY = (8, 9)


def check_float8_device(
    device: torch.device,
    weight_scheme: str,
    float8_head: bool,
    float8_kv_cache: bool,
    error: type[Exception],
    advice: str,
) -> None:
    """Raises `error` naming what asks for float8 (quantized weights of `weight_scheme` unless
    "none", a float8 LM head, a float8 KV cache) when the GPU cannot run it; `advice` says how to
    run without."""
    uses = {
        # INT4 (W4A16) runs on 16-bit dot products, INT8 on int8 ones: no float8 needed.
        f"{weight_scheme} weights": weight_scheme != "none"
        and not weight_scheme.startswith(("int4", "int8")),
        "a float8 LM head": float8_head,
        "a float8 KV cache": float8_kv_cache,
    }
    asked = [what for what, used in uses.items() if used]
    if device.type != "cuda" or not asked:
        return
    capability = torch.cuda.get_device_capability(device)
    if capability >= FLOAT8_MIN_CAPABILITY:
        return
    need = "needs" if len(asked) == 1 else "need"
    raise error(
        f"{' and '.join(asked)} {need} float8 support, NVIDIA compute capability "
        f"{'.'.join(map(str, FLOAT8_MIN_CAPABILITY))} or newer (Ada, Hopper, Blackwell); "
        f"{torch.cuda.get_device_name(device)} is {capability[0]}.{capability[1]}. {advice}"
    )
