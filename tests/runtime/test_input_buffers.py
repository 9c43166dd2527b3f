"""InputBuffers.prepare's packing of verification steps and pending inputs, from first principles.

The buffers of one dtype share an allocation (one copy a step) and a step's views of them are
cached by size: these check the values a step's views show, step after step of the same size, so
a view that aliases the wrong part of an allocation, or one left from an earlier step, fails.
(Mixed and padded decode steps: tests/runtime/test_graph_runner.py.)
"""

from __future__ import annotations

import torch

from kiln.runtime.input_batch import CachedRequestState, InputBuffers
from kiln.sampling_params import SamplingParams

BS = 4  # block size


def _state(buf, req_id, prompt, outputs, computed, blocks, drafts=()) -> CachedRequestState:
    s = CachedRequestState(
        req_id, list(prompt), list(outputs), SamplingParams(temperature=0), list(blocks), computed
    )
    s.row = buf.add_request(s.block_ids)
    s.spec_token_ids = list(drafts)
    return s


def _slot(blocks, p):
    return blocks[p // BS] * BS + p % BS


def test_flattened_verification_step_padded_then_repeated():
    buf = InputBuffers(64, 8, 64, BS, torch.device("cpu"))
    blocks = [7, 3, 5, 2]
    # 12 known tokens, 11 computed: the last known token, then 4 drafts, at positions 11..15.
    s = _state(buf, "v", range(100, 110), [50, 51], 11, blocks, drafts=[60, 61, 62, 63])
    for step in range(2):  # the second step of the same sizes reads the cached views
        batch = buf.prepare([s], [5], num_padded_seqs=8, flatten=True)
        assert batch.input_ids.tolist() == [51, 60, 61, 62, 63]
        assert batch.positions.tolist() == list(range(11, 16))
        md = batch.metadata
        assert md.slot_mapping.tolist() == [_slot(blocks, p) for p in range(11, 16)]
        assert md.seq_lens.tolist() == list(range(12, 17))
        assert md.query_start_loc.tolist() == list(range(6))
        assert md.block_tables.tolist() == [blocks] * 5
        assert (md.num_decodes, md.max_query_len, md.max_seq_len) == (5, 1, 16)
        assert batch.sampling_rows == [0]
        # The logits rows lead the batch: the runner takes hidden[:5], no gather.
        assert batch.logits_indices is None and batch.num_logits_rows == 5
        # Padding rows: write nowhere, read one key of block 0, one row each.
        assert buf.slot_mapping[5:8].tolist() == [-1, -1, -1]
        assert buf.seq_lens[5:8].tolist() == [1, 1, 1]
        assert buf.query_start_loc[:9].tolist() == list(range(9))
        assert buf.block_tables[5:8, :4].tolist() == [[0] * 4] * 3
        assert buf.input_ids[5:8].tolist() == [0, 0, 0]
        # The next step verifies 4 new drafts one block further on.
        s.output_token_ids += [60, 61]
        s.token_ids += [60, 61]
        s.num_computed_tokens = 13
        s.spec_token_ids = [70, 71, 72, 73]
        blocks = [7, 3, 5, 2, 9]
        buf.append_blocks(s.row, 4, [9])
        s.block_ids = blocks
        if step == 0:
            batch = buf.prepare([s], [5], num_padded_seqs=8, flatten=True)
            assert batch.input_ids.tolist() == [61, 70, 71, 72, 73]
            assert batch.metadata.slot_mapping.tolist() == [_slot(blocks, p) for p in range(13, 18)]
            assert batch.metadata.block_tables.tolist() == [blocks] * 5
            assert batch.metadata.max_seq_len == 18
            # Back to the first step's state for the repeat.
            s.output_token_ids[-2:], s.token_ids[-2:] = [], []
            s.num_computed_tokens, s.spec_token_ids = 11, [60, 61, 62, 63]
            blocks = [7, 3, 5, 2]


def test_mixed_step_with_drafts_and_a_pending_decode():
    """A verification beside a prefill chunk and a decode whose token is still on the device."""
    buf = InputBuffers(64, 8, 64, BS, torch.device("cpu"))
    # A decode of the token the running step sampled: index 3 of its ids.
    d = _state(buf, "d", range(10), [], 10, [1, 2, 3])
    d.num_pending, d.pending_index = 1, 3
    v = _state(buf, "v", range(200, 208), [40], 8, [4, 5, 6], drafts=[41, 42])
    c = _state(buf, "c", range(300, 320), [], 4, [7, 8, 9, 10, 11])  # 6 tokens of 20
    batch = buf.prepare([d, v, c], [1, 3, 6])
    ids = batch.input_ids.tolist()
    assert ids[1:] == [40, 41, 42, *range(304, 310)]
    assert batch.num_pending_inputs == 1
    assert (buf.pending_dst[:1].tolist(), buf.pending_src[:1].tolist()) == ([0], [3])
    assert batch.positions.tolist() == [10, 8, 9, 10, *range(4, 10)]
    md = batch.metadata
    want = [_slot([1, 2, 3], 10)] + [_slot([4, 5, 6], p) for p in (8, 9, 10)]
    want += [_slot([7, 8, 9, 10, 11], p) for p in range(4, 10)]
    assert md.slot_mapping.tolist() == want
    assert md.query_start_loc.tolist() == [0, 1, 4, 10]
    assert md.seq_lens.tolist() == [11, 11, 10]
    assert md.block_tables.tolist() == [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    assert (md.num_decodes, md.max_query_len, md.max_seq_len) == (1, 6, 11)
    assert batch.sampling_rows == [0, 1]  # the chunk stops short of its prompt's end
    # The decode's row, then the verification's 3: the first 4 tokens, a view.
    assert batch.logits_indices is None and batch.num_logits_rows == 4
    assert batch.query_start_loc_np.tolist() == [0, 1, 4, 10]

    # The chunk first (it reaches its prompt's end: it samples), the verification after it:
    # the logits rows are not the first ones, so they are gathered by index.
    c.num_computed_tokens = 14
    batch = buf.prepare([d, c, v], [1, 6, 3])
    assert batch.sampling_rows == [0, 1, 2]
    assert batch.num_logits_rows == 5
    assert batch.logits_indices.tolist() == [0, 6, 7, 8, 9]
    assert batch.metadata.num_decodes == 1 and batch.metadata.max_seq_len == 20


def test_each_kv_cache_group_gets_its_own_table_and_slots():
    """A hybrid model's groups (kiln.models.kv_groups): the same step through each group's
    block ids, for a mixed step (a decode and a prefill chunk), a padded decode step and a
    flattened verification step, each repeated so cached views are read again."""
    buf = InputBuffers(64, 8, 64, BS, torch.device("cpu"), num_groups=3)
    groups = [[7, 3, 5], [1, 9, 4], [0, 0, 6]]  # the last group: two blocks behind a window
    d = CachedRequestState(
        "d", list(range(10)), [], SamplingParams(temperature=0), list(groups[0]), 9
    )
    d.row = buf.add_request([i for g in groups for i in g])
    other = [[11], [12], [13]]
    p = CachedRequestState("p", list(range(100, 103)), [], SamplingParams(temperature=0), [11], 0)
    p.row = buf.add_request([i for g in other for i in g])
    for _ in range(2):
        batch = buf.prepare([d, p], [1, 3])
        md = batch.metadata
        assert len(md.group_metadata) == 2
        for blocks, blocks_p, m in zip(groups, other, (md, *md.group_metadata), strict=True):
            assert m.slot_mapping.tolist() == [_slot(blocks, 9)] + [
                _slot(blocks_p, q) for q in range(3)
            ]
            assert m.block_tables.tolist() == [blocks, [blocks_p[0], 0, 0]]
            assert m.seq_lens.tolist() == [10, 3] and m.num_decodes == 1
    # New blocks arrive as each group's in turn.
    buf.append_blocks(d.row, 3, [20, 21, 22])
    d.num_computed_tokens = 12
    groups = [[*g, new] for g, new in zip(groups, (20, 21, 22), strict=True)]
    for _ in range(2):
        batch = buf.prepare([d], [1], num_padded_seqs=4)
        for blocks, g in zip(groups, range(3), strict=True):
            m = batch.metadata if g == 0 else batch.metadata.group_metadata[g - 1]
            assert m.slot_mapping.tolist() == [_slot(blocks, 12)]
            assert m.block_tables.tolist() == [blocks]
            # Padding rows write nothing and read block 0, in every group.
            assert buf.group_slot_mappings[g][1:4].tolist() == [-1, -1, -1]
            assert buf.group_block_tables[g, 1:4, :4].tolist() == [[0] * 4] * 3
    d.spec_token_ids = [60, 61]
    d.token_ids.append(59)
    for _ in range(2):
        batch = buf.prepare([d], [3], num_padded_seqs=4, flatten=True)
        for blocks, g in zip(groups, range(3), strict=True):
            m = batch.metadata if g == 0 else batch.metadata.group_metadata[g - 1]
            assert m.slot_mapping.tolist() == [_slot(blocks, q) for q in range(12, 15)]
            assert m.block_tables.tolist() == [blocks] * 3
            assert buf.group_slot_mappings[g][3:4].tolist() == [-1]
