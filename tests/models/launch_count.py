"""What one batch-1 decode step of a tiny model launches, layer by layer, through the Triton
kernels (under TRITON_INTERPRET=1 on the CPU; the launch sequence is the GPU's): each decoder
layer's Triton launches by kernel name, and the torch ops it runs between them (kernels of
their own on the GPU, or allocations and views, which a CUDA graph replays for free). A
launch in a CUDA graph costs ~2-4 us on an H100 whatever its size: what a 48-layer model's
batch-1 step spends beyond its bytes."""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# Ops that make no kernel: allocations (a graph's pool; every "empty*") and views / metadata.
_FREE_OPS = frozenset((
    "promote_types", "view", "reshape", "_unsafe_view", "as_strided", "transpose", "t",
    "expand", "slice", "select", "unsqueeze", "squeeze", "permute", "alias", "detach", "split",
    "chunk", "unbind", "lift_fresh", "_reshape_alias",
))  # fmt: skip


@dataclass
class LayerLaunches:
    """One decoder layer's launches in one step."""

    triton: list[str] = field(default_factory=list)  # kernel names, in launch order
    torch_ops: list[str] = field(default_factory=list)  # aten ops that launch a kernel
    free_ops: Counter[str] = field(default_factory=Counter)  # allocations and views

    @property
    def kernels(self) -> int:
        return len(self.triton) + len(self.torch_ops)


class _Counter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.current: LayerLaunches | None = None
        self.in_triton = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        if self.current is not None and not self.in_triton:
            name = func.overloadpacket.__name__
            if name in _FREE_OPS or name.startswith("empty"):
                self.current.free_ops[name] += 1
            else:
                self.current.torch_ops.append(name)
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _count_triton(counter: _Counter) -> Iterator[None]:
    """Each interpreted kernel's run recorded (by its function's name), its torch ops not."""
    from triton.runtime.interpreter import InterpretedFunction

    run = InterpretedFunction.run

    def counted(self, *args, **kwargs):
        if counter.current is not None and not counter.in_triton:
            counter.current.triton.append(self.fn.__name__)
        counter.in_triton += 1
        try:
            return run(self, *args, **kwargs)
        finally:
            counter.in_triton -= 1

    InterpretedFunction.run = counted  # type: ignore[method-assign]
    try:
        yield
    finally:
        InterpretedFunction.run = run  # type: ignore[method-assign]


def decode_step_launches(model: torch.nn.Module, kv_dtype: torch.dtype) -> list[LayerLaunches]:
    """Each decoder layer's launches in one batch-1 decode step at 8 tokens of context (the
    cache's dtype `kv_dtype`), through the Triton ops and attention backend."""
    from kiln.attention.backend import AttentionMetadata, get_attention_backend
    from kiln.kernels import triton as triton_ops
    from kiln.kernels.kv_layout import empty_cache

    cfg = model.config
    device = torch.device("cpu")
    context = 8
    metadata = AttentionMetadata(
        slot_mapping=torch.tensor([context - 1]),
        query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
        seq_lens=torch.tensor([context], dtype=torch.int32),
        block_tables=torch.zeros(1, 1, dtype=torch.int32),
        num_decodes=1,
        max_query_len=1,
        max_seq_len=context,
    )
    shape = (1, 16, cfg.num_key_value_heads, cfg.head_dim)
    caches = [
        (empty_cache(*shape, kv_dtype, device), empty_cache(*shape, kv_dtype, device))
        for _ in range(cfg.num_hidden_layers)
    ]
    counter = _Counter()
    layers = [LayerLaunches() for _ in model.layers]
    hooks = []
    for i, layer in enumerate(model.layers):
        hooks.append(layer.register_forward_pre_hook(
            lambda _m, _a, i=i: setattr(counter, "current", layers[i])))  # fmt: skip
        hooks.append(layer.register_forward_hook(
            lambda _m, _a, _o: setattr(counter, "current", None)))  # fmt: skip
    attention = get_attention_backend("triton", device)
    ids = torch.tensor([5])
    try:
        with torch.no_grad(), _count_triton(counter), counter:
            model(triton_ops, attention, ids, torch.tensor([context - 1]), caches, metadata)
    finally:
        for hook in hooks:
            hook.remove()
    return layers
