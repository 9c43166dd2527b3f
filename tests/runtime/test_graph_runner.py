"""The decode-graph and persistent-input machinery on the CPU: FakeGraph stands in for CUDA graphs,
so bucketing, padding (slot -1 rows), static buffers and context buckets are checked here, and
tests/runtime/test_gpu.py repeats the end-to-end checks with real graphs."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from kiln import LLM, SamplingParams
from kiln.attention.torch_backend import TorchAttentionBackend
from kiln.runtime.graph_runner import GraphRunner, graph_batch_sizes
from kiln.runtime.input_batch import CachedRequestState, InputBuffers
from kiln.runtime.sampling_inputs import SamplingMetadataBuilder
from tests.conftest import build_tiny_hf_model

PROMPTS = [[1, *range(10 + 7 * i, 10 + 7 * i + 3 + 11 * i)] for i in range(11)]
PARAMS = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


def test_graph_batch_sizes():
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    sizes = graph_batch_sizes(256)
    assert sizes[:11] == [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128]
    assert sizes[11:] == [160, 192, 224, 256]
    assert graph_batch_sizes(300)[-2:] == [288, 300]


class _BucketedTorchBackend(TorchAttentionBackend):
    """The reference backend with context buckets, as the Triton one has for small batches."""

    def decode_graph_seq_lens(self, num_seqs, num_kv_heads, max_model_len, device):
        return [32, 64, max_model_len] if num_seqs <= 4 else [max_model_len]


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    build_tiny_hf_model("llama-gqa", str(path))
    return str(path)


def _tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def test_fake_graphs_match_eager(tiny_path):
    eager = _tokens(LLM(tiny_path, max_num_seqs=8).generate(PROMPTS, PARAMS))
    llm = LLM(tiny_path, max_num_seqs=8)
    runner = llm.engine.executor.runner
    runner.graphs = GraphRunner(
        runner.model,
        runner.ops,
        _BucketedTorchBackend(),
        runner.kv_caches,
        runner.inputs,
        runner.max_num_seqs,
        runner.max_model_len,
        fake=True,
    )
    runner.graphs.capture()
    assert (4, 32) in runner.graphs.graphs and (8, 512) in runner.graphs.graphs
    runner.step_timing = {}
    # 11 prompts through 8 slots: decode batches of 1..8 rows, padded to 1, 2, 4, 8.
    assert _tokens(llm.generate(PROMPTS, PARAMS)) == eager
    assert runner.step_timing["graph_steps"] > 0
    # One at a time: batch 1 crosses the 32 and 64 context buckets.
    assert _tokens(llm.generate(PROMPTS[-1:], PARAMS)) == eager[-1:]


def test_lookup_picks_smallest_bucket(tiny_path):
    llm = LLM(tiny_path, max_num_seqs=8)
    r = llm.engine.executor.runner
    graphs = GraphRunner(
        r.model, r.ops, _BucketedTorchBackend(), r.kv_caches, r.inputs, 8, 512, fake=True
    )
    assert graphs.lookup(1, 5) == (1, 32)
    assert graphs.lookup(3, 33) == (4, 64)
    assert graphs.lookup(3, 65) == (4, 512)
    assert graphs.lookup(5, 65) == (8, 512)
    assert graphs.lookup(9, 10) is None
    assert graphs.lookup(2, 513) is None


def test_triton_buckets_at_8b_shapes(monkeypatch):
    # Llama-3.1-8B on an H200: 8 KV heads, 132 SMs, 15 batch sizes up to 256, 131072 context. The
    # decode kernel's partitions follow each sequence's length, so a graph freezes only the grid's
    # split count: buckets with equal counts collapse into the largest (78 graphs before: every
    # batch that splits had all 10 power-of-two buckets from 256).
    from kiln.attention import triton_backend
    from kiln.kernels.triton.decode_attention import choose_num_splits

    monkeypatch.setattr(triton_backend, "num_sms", lambda device: 132)
    kv = (torch.empty(1, 1, 8, 1), torch.empty(1, 1, 8, 1))
    buffers = SimpleNamespace(max_num_seqs=256, device=torch.device("cpu"))
    max_len = 131072
    runner = GraphRunner(
        None, None, triton_backend.TritonAttentionBackend(), [kv], buffers, 256, max_len
    )
    buckets = runner.seq_len_buckets
    # Batch 1 and 2 saturate at 64 and 33 splits from 4k; batch 4 at 16 from 1k; 8 at 8 from
    # 512; from batch 16 up the SM target allows 4, 2, 1 splits at every bucket, except batches
    # whose programs fill their last wave poorly (96, 160, 224: 1.45, 2.4, 3.4 waves of 528),
    # which split from 2k tokens on (decode_attention._long_context_splits).
    assert buckets[1] == buckets[2] == [256, 512, 1024, 2048, max_len]
    assert buckets[4] == [256, 512, max_len]
    assert buckets[8] == [256, max_len]
    poorly_filled = (96, 160, 224)
    assert all(buckets[b] == [1024, max_len] for b in poorly_filled)
    assert all(
        buckets[b] == [max_len] for b in runner.batch_sizes if b >= 16 and b not in poorly_filled
    )
    assert sum(len(c) for c in buckets.values()) == 29

    def old_bucket(batch: int, seq_len: int) -> int:  # the power-of-two bucket eager used to get
        if choose_num_splits(batch, 8, max_len, 132) == 1:
            return max_len
        c = 256
        while c < seq_len and c < max_len:
            c *= 2
        return min(c, max_len)

    keys = {(b, c) for b, cs in buckets.items() for c in cs}
    lengths = [1, 200, 256, 257, 700, 1024, 1025, 2048, 2049, 4096, 4097, 9000, 65537, max_len]
    for num_seqs in [1, 2, 3, 4, 5, 8, 9, 16, 17, 30, 33, 64, 100, 250, 256]:
        for seq_len in lengths:
            batch, bucket = runner.lookup(num_seqs, seq_len)
            assert (batch, bucket) in keys and batch >= num_seqs and bucket >= seq_len
            # The captured grid is the one eager mode chooses at the step's old bucket.
            old = choose_num_splits(batch, 8, old_bucket(batch, seq_len), 132)
            assert choose_num_splits(batch, 8, bucket, 132) == old, (num_seqs, seq_len)
        assert runner.lookup(num_seqs, max_len + 1) is None
    assert runner.lookup(257, 10) is None


def _state(req_id, prompt, computed, blocks) -> CachedRequestState:
    return CachedRequestState(
        req_id, list(prompt), [], SamplingParams(temperature=0), list(blocks), computed
    )


def test_input_buffers_pack_mixed_and_padded_steps():
    block_size = 4
    buf = InputBuffers(64, 8, 64, block_size, torch.device("cpu"))
    decode = _state("d", range(100, 110), 9, [7, 3, 5])  # one token at position 9
    chunk = _state("p", range(200, 213), 4, [2, 6, 1, 4])  # 6 tokens at positions 4..9
    for s in (decode, chunk):
        s.row = buf.add_request(s.block_ids)
    batch = buf.prepare([decode, chunk], [1, 6])
    assert batch.input_ids.tolist() == [109, *range(204, 210)]
    assert batch.positions.tolist() == [9, 4, 5, 6, 7, 8, 9]
    table = {"d": [7, 3, 5], "p": [2, 6, 1, 4]}
    want = [table["d"][9 // 4] * 4 + 1] + [table["p"][p // 4] * 4 + p % 4 for p in range(4, 10)]
    assert batch.metadata.slot_mapping.tolist() == want
    assert batch.metadata.seq_lens.tolist() == [10, 10]
    assert batch.metadata.num_decodes == 1
    assert batch.metadata.block_tables.tolist() == [[7, 3, 5], [2, 6, 1]]
    assert batch.sampling_rows == [0]  # the chunk stops short of its last prompt token
    assert batch.logits_indices is None and batch.num_logits_rows == 1  # row 0: a view

    # A decode-only step padded to 4 rows: padding writes nowhere and reads block 0.
    other = _state("e", range(300, 305), 4, [0, 1])
    other.row = buf.add_request(other.block_ids)
    batch = buf.prepare([decode, other], [1, 1], num_padded_seqs=4)
    assert batch.logits_indices is None and batch.sampling_rows == [0, 1]
    assert batch.num_logits_rows == 2
    assert buf.slot_mapping[:4].tolist() == [5 * 4 + 1, 1 * 4 + 0, -1, -1]
    assert buf.seq_lens[:4].tolist() == [10, 5, 1, 1]
    assert buf.query_start_loc[:5].tolist() == [0, 1, 2, 3, 4]
    assert buf.block_tables[2:4, :3].tolist() == [[0, 0, 0], [0, 0, 0]]

    # Rows are reused after a request leaves; appended blocks land after the old ones.
    buf.remove_request(decode.row)
    again = _state("f", range(10), 9, [9])
    again.row = buf.add_request(again.block_ids)
    buf.append_blocks(again.row, 1, [8, 11])
    assert np.array_equal(buf.req_block_table[again.row, :3], [9, 8, 11])


def test_plain_greedy_metadata_is_cached():
    builder = SamplingMetadataBuilder((2,), 256, torch.device("cpu"))
    states = [_state(str(i), [1, 2], 2, [0]) for i in range(3)]
    first = builder.build(states)
    assert first.all_greedy and first.no_penalties and builder.build(states) is first
    seeded = CachedRequestState("s", [1], [], SamplingParams(temperature=0.7, seed=3), [0], 1)
    mixed = builder.build([*states, seeded])
    assert not mixed.all_greedy and mixed.temperature.tolist()[-1] == pytest.approx(0.7)
