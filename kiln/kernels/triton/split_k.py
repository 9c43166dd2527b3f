"""Split-K for the small-batch linear kernels: several programs per output tile, each over one
slice of K, their fp32 partial sums reduced inside the same kernel.

Why: at one row a projection is a weight stream, and a program streams its [BLOCK_N, K] slice
with as many loads in flight as its pipeline stages allow. With one program per SM (o_proj, down
and qkv of Llama-3.1-8B at the tiles that keep every column in one program) that is too few
bytes in flight to reach HBM's bandwidth, and a float8 tile, half the bytes of a bf16 one for
the same loop cost, makes it worse (measured on an H200). Cutting
K over SPLIT_K programs multiplies the programs, and the loads in flight, by SPLIT_K.

How the sums meet: each program stores its partial tile to a workspace ([SPLIT_K, ...] fp32,
fresh per launch) and takes a ticket from its tile's counter (an atomic add). The program that
takes the last ticket sums the SPLIT_K partials in split order, so the result does not depend on
which program finished first (run to run, the same bits), runs the kernel's epilogue on the sum,
and puts the counter back to zero. No reduce kernel and no memset per launch: a decode step's
CUDA graph gets no extra nodes. Every program runs the epilogue's arithmetic, but only the last
one's stores are unmasked (`arrive`'s mask goes into the epilogue's column mask).

The counters live for the process, one buffer per device, zeroed once and left at zero by every
launch. Launches that share them must not overlap: kiln runs one stream per device.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Tiles one split-K launch may have (counters per device: 256 KiB).
MAX_TILES = 1 << 16

_counters: dict[torch.device, torch.Tensor] = {}


def k_per_split(k: int, split_k: int, block_k: int) -> tuple[int, int]:
    """(K per split, the number of splits launched): slices in whole BLOCK_K steps, so a split
    that would start past K is not launched (K = 72, BLOCK_K = 32, 4 asked: 3 of 32, 32, 8)."""
    per = triton.cdiv(triton.cdiv(k, split_k), block_k) * block_k
    return per, triton.cdiv(k, per) if k else 1


def counters(device: torch.device) -> torch.Tensor:
    """The device's zeroed int32 tile counters. Created by the device's first split-K launch,
    which must not be under CUDA graph capture (the zeroing would be recorded, not run); the
    graph runner's warm-up forward before each capture is such a first launch."""
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    buf = _counters.get(device)
    if buf is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "the first split-K small-batch launch on a device ran under CUDA graph capture; "
                "run the forward once outside capture first (its tile counters are made then)"
            )
        buf = torch.zeros(MAX_TILES, dtype=torch.int32, device=device)
        _counters[device] = buf
    return buf


def partials(split_k: int, *shape: int, device: torch.device) -> torch.Tensor:
    """A launch's workspace: [split_k, *shape] fp32 partial sums (every element is written by
    its split before it is read: no zeroing)."""
    return torch.empty((split_k, *shape), dtype=torch.float32, device=device)


@triton.jit
def k_range(K, k_per_split, SPLIT_K: tl.constexpr):
    """[k_start, k_stop) of this program's split, program_id(1); all of K when SPLIT_K is 1."""
    k_start = 0
    k_stop = K
    if SPLIT_K > 1:
        k_start = tl.program_id(1) * k_per_split
        k_stop = tl.minimum(k_start + k_per_split, K)
    return k_start, k_stop


@triton.jit
def arrive(counter_ptr, tile, like, SPLIT_K: tl.constexpr):
    """After this program's partials are stored: whether it is the tile's last split to arrive
    (it then reads the partials and stores the tile's result, and has reset the counter), shaped
    like `like` (an integer tensor): the mask of the tile's result stores."""
    # Every thread's partial stores before the ticket (one thread takes it, with release
    # semantics at GPU scope; the last taker's acquire orders its reads after all stores).
    tl.debug_barrier()
    taken = tl.atomic_add(counter_ptr + tile, 1, sem="acq_rel", scope="gpu")
    tl.store(counter_ptr + tile, 0, mask=taken == SPLIT_K - 1)  # no other program touches it
    return (tl.zeros_like(like) + taken) == SPLIT_K - 1


@triton.jit
def sum_partials(part_ptr, offsets, mask, split_stride, SPLIT_K: tl.constexpr):
    """The sum over splits 0..SPLIT_K-1, in that order, of the partials at part_ptr + offsets
    (+ split * split_stride); zeros where `mask` (which carries arrive's) is off. Read from L2
    (.cg): other programs wrote them during this launch."""
    total = tl.load(part_ptr + offsets, mask=mask, other=0.0, cache_modifier=".cg")
    for split in tl.static_range(1, SPLIT_K):
        total += tl.load(
            part_ptr + split * split_stride + offsets, mask=mask, other=0.0, cache_modifier=".cg"
        )
    return total
