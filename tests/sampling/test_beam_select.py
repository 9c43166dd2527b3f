"""kiln.sampling.beam: a beam step's selection on the device is HF's top-K over the W x vocab
accumulated log-probabilities of each search (log_softmax of the fp32 logits + the beam score),
whatever the logits' dtype and however a step's rows are grouped."""

from __future__ import annotations

import pytest
import torch

from kiln.sampling.beam import beam_top_k


def hf_top_k(logits, scores, keep):
    """transformers' _beam_search selection for one search: flat top-K over beams x vocab."""
    acc = torch.nn.functional.log_softmax(logits.float(), dim=-1) + scores[:, None]
    values, flat = torch.topk(acc.view(1, -1), k=keep)
    vocab = logits.shape[-1]
    return values[0].tolist(), (flat[0] // vocab).tolist(), (flat[0] % vocab).tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_beam_top_k_is_hfs_flat_top_k_per_group(dtype):
    gen = torch.Generator().manual_seed(5)
    groups = [(4, 8), (1, 8), (2, 6), (3, 4)]  # (rows, keep): a whole search, a lone row, ...
    num_rows, vocab = sum(n for n, _ in groups), 300
    logits = (4 * torch.randn(num_rows, vocab, generator=gen)).to(dtype)
    scores = -10 * torch.rand(num_rows, generator=gen)
    scores[5] = -1.0e9  # a beam HF starts at -1e9
    got = beam_top_k(logits, scores, groups)
    assert got.sizes == [keep for _, keep in groups]
    start = offset = 0
    for num, keep in groups:
        want = hf_top_k(logits[start : start + num], scores[start : start + num], keep)
        end = offset + keep
        part = [t[offset:end].tolist() for t in (got.scores, got.rows, got.token_ids)]
        assert part[0] == want[0]  # the same fp32 values, best first
        # Half-precision logits tie (equal log-probs): the order among equals is the host's to
        # fix (engine/beam_search.py sorts by beam, then token), so compare as sorted triples.
        assert sorted(zip(*part)) == sorted(zip(*want))
        start, offset = start + num, end


def test_beam_top_k_keeps_at_most_every_candidate():
    logits = torch.tensor([[0.0, 1.0, 2.0]])
    got = beam_top_k(logits, torch.zeros(1), [(1, 8)])
    assert got.sizes == [3] and got.token_ids.tolist() == [2, 1, 0]
