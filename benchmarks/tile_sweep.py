"""Shared by the kernel tile sweeps: run a kernel's launcher under forced tile configurations,
and time calls inside a CUDA graph."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from types import ModuleType

import torch


@contextlib.contextmanager
def forced_tile_config(
    module: ModuleType, config: tuple, attribute: str = "_tile_config"
) -> Iterator[None]:
    """Makes `module.<attribute>` (its tile choice) return `config` whatever it is asked;
    restored on exit."""
    chosen = getattr(module, attribute)
    setattr(module, attribute, lambda *args, **kwargs: config)
    try:
        yield
    finally:
        setattr(module, attribute, chosen)


def sweep(
    module: ModuleType,
    configs: Iterable[tuple],
    run: Callable[[], torch.Tensor],
    time_ms: Callable[[Callable[[], torch.Tensor]], float],
    reference: torch.Tensor | None = None,
    label: str = "",
    attribute: str = "_tile_config",
) -> list[dict]:
    """{"config", "ms"[, "max_abs_err" against `reference`]} for every configuration that
    compiles and runs (one that does not, e.g. out of shared memory, is reported and skipped)."""
    rows = []
    for config in configs:
        row: dict = {"config": list(config)}
        with forced_tile_config(module, config, attribute):
            try:
                if reference is not None:
                    row["max_abs_err"] = (run().float() - reference.float()).abs().max().item()
                row["ms"] = time_ms(run)
            except Exception as exc:
                print(label, config, "failed:", type(exc).__name__)
                continue
        rows.append(row)
    return rows


def graph_time_ms(calls: list[Callable[[], object]], reps: int, replays: int = 1) -> float:
    """Milliseconds per call of `calls` run back to back `reps` times over inside one CUDA graph
    (GPU time, no launch overhead); the best of `replays` timed replays."""
    for fn in calls:
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            for fn in calls:
                fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / (reps * len(calls)))
    return best


def rotary_inputs(
    rows: int, head_dim: int, num_kv_heads: int, dev: str, cache_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """(cos_sin, positions, slots, [k_cache, v_cache]) for a one-step qkv + rotary + KV write at
    decode: Llama-3.1's rope base, positions from 1000, a small paged cache."""
    half = torch.arange(head_dim // 2, dtype=torch.float32, device=dev)
    freqs = torch.arange(2048, dtype=torch.float32, device=dev)[:, None] / (
        500000 ** (2 * half / head_dim)
    )
    cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
    positions = torch.arange(1000, 1000 + rows, device=dev)
    slots = torch.arange(rows, device=dev) + 16
    shape = (4, 16, num_kv_heads, head_dim)
    return (
        cos_sin,
        positions,
        slots,
        [torch.zeros(shape, device=dev, dtype=cache_dtype) for _ in "kv"],
    )
