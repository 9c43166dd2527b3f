"""No kernel compiles mid-run: the attention kernels' arguments keep one Triton variant across
steps, and the compile watch that reports when they do not.

Triton compiles a kernel once per variant: each int argument's "equals 1" / "divides by 16" and
each pointer's 16-byte alignment are part of it. A mixed step's prefill rows start at row
num_decodes of the step's table; a table cut at the step's own width gave the prefill kernel a
row stride that divided by 16 only at some widths, and the first such step compiled a second
variant while every request waited (1.8 s on the H200 at 1000/1000: docs/performance.md, "No
kernel compiles mid-run").
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kiln.attention.torch_backend import aligned, run_split_attention
from kiln.bench.runner import _compile_warning
from kiln.kernel_cache.compile_watch import CompileWatch
from kiln.runtime.input_batch import CachedRequestState, InputBuffers
from kiln.sampling_params import SamplingParams

BS = 4  # block size


class _RecordingOps:
    """Stands in for a kernels module: records what Triton would specialize each call on."""

    def __init__(self) -> None:
        self.calls: dict[str, set] = {"decode": set(), "prefill": set()}

    @staticmethod
    def _variant(block_tables, seq_lens, query, out) -> tuple:
        return (
            block_tables.stride(0) % 16 == 0,
            block_tables.stride(0) == 1,
            *(t.data_ptr() % 16 == 0 for t in (block_tables, seq_lens, query, out)),
        )

    def paged_decode_attention(self, query, k, v, tables, lens, scale, max_len, out=None):
        self.calls["decode"].add(self._variant(tables, lens, query, out))
        return out

    def paged_prefill_attention(self, query, k, v, tables, qsl, lens, scale, mq, ms, out=None):
        self.calls["prefill"].add((*self._variant(tables, lens, query, out), qsl.stride(0)))
        return out


def _state(buf, req_id, num_tokens, computed, num_blocks) -> CachedRequestState:
    blocks = list(range(1 + 100 * len(req_id), 1 + 100 * len(req_id) + num_blocks))
    s = CachedRequestState(
        req_id, list(range(3, 3 + num_tokens)), [], SamplingParams(temperature=0), blocks, computed
    )
    s.row = buf.add_request(s.block_ids)
    return s


@pytest.mark.parametrize("num_decodes", [1, 2, 3, 5])
def test_mixed_steps_give_the_attention_kernels_one_variant(num_decodes: int) -> None:
    # max_model_len 200 at block size 4: 50 blocks a sequence, so table widths run from 1 to 50
    # and cross 16, 32 and 48. Before the fix the prefill rows' table was packed at the step's
    # width (stride 15, 16, 17, ...): three variants here.
    buf = InputBuffers(256, 8, 200, BS, torch.device("cpu"))
    ops = _RecordingOps()
    num_heads, head_dim = 4, 8
    for context in (40, 60, 63, 64, 65, 100, 128, 129, 190):
        blocks = -(-context // BS)
        decodes = [_state(buf, f"d{i}", context, context - 1, blocks) for i in range(num_decodes)]
        # Two prefill chunks: a table of one row keeps its stride even through clone().
        chunks = [_state(buf, "p", 12, 0, 3), _state(buf, "pp", 8, 0, 2)]
        batch = buf.prepare([*decodes, *chunks], [1] * num_decodes + [12, 8])
        md = batch.metadata
        assert md.num_decodes == num_decodes and md.max_seq_len == context
        query = torch.zeros(num_decodes + 20, num_heads, head_dim)
        run_split_attention(ops, query, None, None, md, 1.0)
        for s in (*decodes, *chunks):
            buf.remove_request(s.row)
    # One variant of each kernel, the table's row stride dividing by 16. (The decode rows' lengths
    # sit where the shared int32 allocation puts them, aligned or not, the same every step.)
    assert len(ops.calls["decode"]) == 1
    ((stride16, stride1, table, _, query, out),) = ops.calls["decode"]
    assert (stride16, stride1, table, query, out) == (True, False, True, True, True)
    assert ops.calls["prefill"] == {(True, False, True, True, True, True, 1)}


def test_aligned_copies_only_a_misaligned_start_and_keeps_strides() -> None:
    table = torch.arange(10 * 20, dtype=torch.int32).view(10, 20)[:, :7]
    assert aligned(table) is table
    for first_row in (1, 2, 3):
        rows = table[first_row:]
        copy = aligned(rows)
        assert copy.data_ptr() % 16 == 0 and copy.stride() == rows.stride()
        assert torch.equal(copy, rows)
    lens = torch.arange(9, dtype=torch.int32)
    assert aligned(lens[4:]).data_ptr() == lens[4:].data_ptr()  # 16 bytes in: already aligned
    assert torch.equal(aligned(lens[3:]), lens[3:]) and aligned(lens[3:]).data_ptr() % 16 == 0


def test_table_row_stride_divides_by_16() -> None:
    for max_model_len, block_size in ((2000, 16), (200, 4), (64, 16), (4096, 16)):
        buf = InputBuffers(64, 4, max_model_len, block_size, torch.device("cpu"))
        assert buf.table_row_stride % 16 == 0
        assert buf.table_row_stride >= buf.max_blocks_per_seq
        assert buf.block_tables.stride(0) == buf.table_row_stride


def test_compile_watch_records_chains_and_restores() -> None:
    knobs = pytest.importorskip("triton").knobs
    seen = []

    def earlier_hook(**kwargs):
        seen.append(kwargs["repr"])
        return None

    before = knobs.runtime.jit_cache_hook
    knobs.runtime.jit_cache_hook = earlier_hook
    watch = CompileWatch()
    try:
        assert watch.start() and watch.active
        hook = knobs.runtime.jit_cache_hook
        fn = SimpleNamespace(module="kiln.kernels.triton.prefill_attention", name="_prefill_kernel")
        args = dict(key="k", fn=fn, compile={}, already_compiled=False)
        variant = "_prefill_kernel[num_warps=8](stride: i32D)"
        assert hook(repr=variant, is_manual_warmup=False, **args) is None
        # A manual warm-up (triton's kernel.warmup) is asked for: not a stall, not recorded.
        hook(repr="warm", is_manual_warmup=True, **args)
        assert [c.kernel for c in watch.compiles] == [
            "kiln.kernels.triton.prefill_attention:_prefill_kernel"
        ]
        assert watch.compiles[0].variant.endswith("(stride: i32D)")
        assert seen == [variant, "warm"]  # chained
        assert watch.since(1) == [] and watch.since(0)[0]["kernel"].endswith("_prefill_kernel")
    finally:
        watch.stop()
        assert knobs.runtime.jit_cache_hook is earlier_hook
        knobs.runtime.jit_cache_hook = before
    assert not watch.active


def test_bench_warns_of_compiles_in_the_timed_run() -> None:
    assert _compile_warning([]) == ""
    text = _compile_warning(
        [{"kernel": "m:_prefill_kernel", "variant": "v", "after_s": 3.0}] * 2
        + [{"kernel": "m:_decode_kernel", "variant": "v", "after_s": 4.0}]
    )
    assert "3 Triton kernel variant(s)" in text and "_decode_kernel, _prefill_kernel" in text


def _variant(kernel, **args) -> tuple:
    """The part of Triton's variant key its arguments decide (types, "equals 1", "divides by 16"),
    by Triton's own rule, honouring the kernel's do_not_specialize."""
    jit = pytest.importorskip("triton.runtime.jit")
    from triton.backends.compiler import BaseBackend

    options = getattr(kernel, "kwargs", None) or {}  # the interpreter's copy of jit's options
    skip = set(options.get("do_not_specialize") or getattr(kernel, "do_not_specialize", ()) or ())
    return tuple(
        (name, jit.native_specialize_impl(BaseBackend, value, False, name not in skip, True))
        for name, value in args.items()
    )


def test_decode_reduce_variant_does_not_follow_the_split_count() -> None:
    # Graph capture runs power-of-two split counts (16 and 32 divide by 16); an eager mixed step
    # may run any count, e.g. 11 or 24. Each count's variant must be one graphs compiled.
    pytest.importorskip("triton")
    from kiln.kernels.triton.decode_attention import _decode_reduce_kernel

    keys = {n: _variant(_decode_reduce_kernel, num_splits=n) for n in (11, 16, 24, 32)}
    assert keys[11] == keys[16] == keys[24] == keys[32]
    # The rule itself, on an argument that is specialized: 16 and 11 are different variants.
    assert _variant(object(), num_splits=16) != _variant(object(), num_splits=11)


def test_moe_grouped_gemm_variants_do_not_follow_the_pair_count() -> None:
    # A step's pair count (tokens x top_k) takes any value; each must run a variant the warm-up
    # compiled, not compile one inside the run.
    pytest.importorskip("triton")
    from kiln.kernels.triton.fused_moe import _grouped_gemm_kernel
    from kiln.kernels.triton.moe_fp8 import _fp8_grouped_gemm_kernel
    from kiln.kernels.triton.moe_fp8_block import _fp8_block_grouped_kernel

    for kernel in (_grouped_gemm_kernel, _fp8_grouped_gemm_kernel, _fp8_block_grouped_kernel):
        keys = {n: _variant(kernel, num_pairs=n) for n in (1, 14, 16, 2000)}
        assert keys[1] == keys[14] == keys[16] == keys[2000], kernel
