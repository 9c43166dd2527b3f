"""What an H200 reads at float8 decode attention's access pattern with no attention in it: the
ceiling that decode kernel's 3.6-3.7 TB/s (docs/performance.md) is to be judged against.

    PYTHONPATH=. python3 benchmarks/kv_read_ceiling.py --out kv_read_ceiling.json

One layer's K and V at 1000/1000's decode shape (768 sequences x 1.5k tokens, 8 KV heads,
head_dim 128, 16-token blocks, float8: 2.36 GB), read by:
- `stream`: consecutive BLOCK-word chunks of one flat buffer, one chunk a program;
- `paged`: exactly the packed decode kernel's loads (a program per sequence and KV head, 16-key
  sub-tiles of one cache block found through the block table, PACK sub-tiles of K then of V a
  trip) with the arithmetic replaced by an int32 sum of the words: its loop as if compute were
  free, over tiles (PACK, warps, stages);
- `copy`: torch's device-to-device copy of the same bytes (read + written: MEASURING.md's
  ceiling);
and, on the same cache, the engine's decode attention (kiln's packed kernel). Blocks placed at
random (a churned cache) and in order (a fresh one). Measuring tools, not engine code: these
kernels have no reference twin and compute nothing the engine uses.
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import triton
import triton.language as tl
from tile_sweep import graph_time_ms

from kiln.kernels.triton import decode_attention as da

KV_HEADS, GROUP, HEAD_DIM, BLOCK_SIZE = 8, 4, 128, 16
WORDS = HEAD_DIM // 4  # int32 words per key row of one head (float8: 1 byte a value)


@triton.jit
def _stream_read(src_ptr, out_ptr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + tl.program_id(0), tl.sum(tl.load(src_ptr + offs), 0))


@triton.jit
def _sub_tile_words(
    cache_ptr, block_table, n0, offs_n, words, seq_len, kv_head,
    NUM_KV_HEADS: tl.constexpr, WORDS: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):  # fmt: skip
    """One 16-key sub-tile of one cache block, as the packed kernel's _sub_tile loads it."""
    block_id = tl.load(block_table + n0 // BLOCK_SIZE, mask=n0 < seq_len, other=0)
    slots = block_id.to(tl.int64) * BLOCK_SIZE + offs_n
    offsets = (slots[:, None] * NUM_KV_HEADS + kv_head) * WORDS + words[None, :]
    return tl.load(cache_ptr + offsets, mask=(n0 + offs_n < seq_len)[:, None], other=0)


@triton.jit
def _paged_read(
    k_ptr, v_ptr, block_tables_ptr, seq_lens_ptr, out_ptr, stride_bt_seq,
    NUM_KV_HEADS: tl.constexpr, WORDS: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    PACK: tl.constexpr,
):  # fmt: skip
    """The packed decode kernel's K/V loads (16-key sub-tiles, one cache block each) as int32
    words, summed."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    offs_n = tl.arange(0, BLOCK_SIZE)
    words = tl.arange(0, WORDS)
    block_table = block_tables_ptr + seq.to(tl.int64) * stride_bt_seq
    acc = tl.zeros([BLOCK_SIZE, WORDS], dtype=tl.int32)
    for n_start in range(0, seq_len, PACK * BLOCK_SIZE):
        for sub in tl.static_range(PACK):
            acc += _sub_tile_words(k_ptr, block_table, n_start + sub * BLOCK_SIZE, offs_n, words,
                                   seq_len, kv_head, NUM_KV_HEADS, WORDS, BLOCK_SIZE)  # fmt: skip
        for sub in tl.static_range(PACK):
            acc ^= _sub_tile_words(v_ptr, block_table, n_start + sub * BLOCK_SIZE, offs_n, words,
                                   seq_len, kv_head, NUM_KV_HEADS, WORDS, BLOCK_SIZE)  # fmt: skip
    tl.store(out_ptr + seq * NUM_KV_HEADS + kv_head, tl.sum(tl.sum(acc, 1), 0))


def caches(batch: int, context: int, placement: str):
    gen = torch.Generator(device="cuda").manual_seed(batch + context)
    blocks = -(-context // BLOCK_SIZE)
    shape = (batch * blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    k = torch.randn(shape, device="cuda", generator=gen).to(torch.float8_e4m3fn)
    v = torch.randn(shape, device="cuda", generator=gen).to(torch.float8_e4m3fn)
    if placement == "sequential":
        perm = torch.arange(batch * blocks, device="cuda", dtype=torch.int32)
    else:
        perm = torch.randperm(batch * blocks, device="cuda", generator=gen).to(torch.int32)
    table = perm.view(batch, blocks).contiguous()
    lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, KV_HEADS * GROUP, HEAD_DIM, device="cuda", generator=gen) * 2.5
    return q.bfloat16(), k, v, table, lens


def kv_bytes(batch: int, context: int) -> int:
    """One layer's float8 K and V: what decode attention must read."""
    return 2 * batch * context * KV_HEADS * HEAD_DIM


def tbps(nbytes: int, ms: float) -> float:
    return nbytes / ms / 1e9


def placement_row(batch: int, context: int, placement: str) -> dict:
    """The engine's kernel and the paged reads over one cache."""
    q, k, v, table, lens = caches(batch, context, placement)
    nbytes = kv_bytes(batch, context)
    row: dict = {}

    def attn() -> None:
        da.paged_decode_attention(q, k, v, table, lens, HEAD_DIM**-0.5, context)

    row["engine_kernel_TBps"] = tbps(nbytes, graph_time_ms([attn], 10, 3))
    kw, vw = k.view(torch.int32), v.view(torch.int32)
    sums = torch.empty(batch * KV_HEADS, dtype=torch.int32, device="cuda")
    paged = []
    for pack, warps, stages in itertools.product((1, 2, 4, 8), (1, 2, 4), (1, 2, 3)):

        def read(pack=pack, warps=warps, stages=stages) -> None:
            _paged_read[(batch, KV_HEADS)](
                kw, vw, table, lens, sums, table.stride(0), NUM_KV_HEADS=KV_HEADS, WORDS=WORDS,
                BLOCK_SIZE=BLOCK_SIZE, PACK=pack, num_warps=warps, num_stages=stages,
            )  # fmt: skip

        entry: dict = {"pack": pack, "warps": warps, "stages": stages}
        try:
            entry["TBps"] = tbps(nbytes, graph_time_ms([read], 10, 3))
        except Exception as exc:  # a tile that does not compile or fit
            entry["failed"] = f"{type(exc).__name__}: {str(exc)[:160]}"
        paged.append(entry)
    row["paged"] = paged
    row["paged_best"] = max((p for p in paged if "TBps" in p), key=lambda p: p["TBps"])
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="kv_read_ceiling.json")
    parser.add_argument("--batch", type=int, default=768)
    parser.add_argument("--context", type=int, default=1500)
    args = parser.parse_args()
    batch, context = args.batch, args.context
    record: dict = {"gpu": torch.cuda.get_device_name(), "batch": batch, "context": context}
    for placement in ("random", "sequential"):
        row = placement_row(batch, context, placement)
        record[placement] = row
        print(placement, f"engine kernel {row['engine_kernel_TBps']:.2f} TB/s,",
              f"paged best {row['paged_best']}", flush=True)  # fmt: skip
    nbytes = kv_bytes(batch, context)
    flat = torch.randint(-(2**31), 2**31 - 1, (nbytes // 4,), dtype=torch.int32, device="cuda")
    stream = []
    for block, warps in itertools.product((2048, 8192, 32768), (4, 8, 16)):
        n = flat.numel() // block
        sums = torch.empty(n, dtype=torch.int32, device="cuda")

        def run(block=block, warps=warps, n=n, sums=sums) -> None:
            _stream_read[(n,)](flat, sums, BLOCK=block, num_warps=warps)

        stream.append({"block": block, "warps": warps,
                       "TBps": tbps(n * block * 4, graph_time_ms([run], 10, 3))})  # fmt: skip
    record["stream"] = stream
    record["stream_best"] = max(stream, key=lambda s: s["TBps"])
    dst = torch.empty_like(flat)
    record["copy_TBps"] = tbps(2 * nbytes, graph_time_ms([lambda: dst.copy_(flat)], 10, 3))
    print(f"stream best {record['stream_best']}, copy {record['copy_TBps']:.2f} TB/s "
          "(read + written)", flush=True)  # fmt: skip
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
