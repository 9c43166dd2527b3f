"""DeepSeek-V3's multi-head latent attention through the Triton kernels and attention backend
(TRITON_INTERPRET=1 without a GPU), end to end: one cache tensor per layer for K and V (the
[k_pe | c_kv] rows, 40 wide), written by the rotary + write kernel, read by the shared prefill
kernel as multi-query attention and by the MLA decode kernel (kiln.kernels.triton.mla_decode);
prompts in chunks beside decodes, blocks of 4. Greedy tokens equal Hugging Face's in fp32."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the kernels' @triton.jit

pytest.importorskip("triton", reason="triton is not installed (pip install kiln[triton])")

from kiln import SamplingParams
from tests.models.family_checks import hf_generated, save_tiny_hf, tokens, triton_chunked_llm
from tests.models.test_deepseek import DEEPSEEK_V3
from tests.models.test_glm4_moe import perturb_glm

NEW_TOKENS = 10
PROMPTS = [[1, *range(40, 62)], [1, 5, 9, 30], [1, *range(200, 215)]]


def test_triton_mla_equals_hf(tmp_path, monkeypatch) -> None:
    path = str(tmp_path / "src")
    model = save_tiny_hf(path, "deepseek_v3", "DeepseekV3ForCausalLM", perturb=perturb_glm,
                         **DEEPSEEK_V3)  # fmt: skip
    want = hf_generated(model, PROMPTS, NEW_TOKENS)
    llm = triton_chunked_llm(path, dtype="float32")
    runner = llm.engine.executor.runner
    assert runner.backend.name == "triton" and runner.kv_caches[0][0] is runner.kv_caches[0][1]
    from kiln.kernels import triton as triton_ops

    decodes = []  # rows each call of the MLA decode kernel took: decode steps and mixed ones

    def counted(query, *args, **kwargs):
        decodes.append(query.shape[0])
        return mla_decode_attention(query, *args, **kwargs)

    mla_decode_attention = triton_ops.mla_decode_attention
    monkeypatch.setattr(triton_ops, "mla_decode_attention", counted)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    assert tokens(llm.generate(PROMPTS, params)) == want
    assert decodes and max(decodes) == len(PROMPTS)


def test_the_attention_kernels_at_a_latent_row_of_576(tmp_path) -> None:
    """The shared decode and prefill kernels against their twins at DeepSeek's real row (64
    rotary + 512 latent dims, one KV head read as K and V) for 16 query heads (V2-Lite's; V3's
    per rank at TP=8), and the small tiles a GPU takes for such a row."""
    from kiln.kernels import reference
    from kiln.kernels import triton as triton_ops
    from kiln.kernels.kv_layout import empty_layer_cache
    from kiln.kernels.triton import decode_attention, prefill_attention
    from kiln.models.packed_prefill import packed_prefill_metadata

    cuda = torch.device("cuda")
    assert decode_attention._tile_config(16, cuda, head_dim=576) == (16, 8, 1)
    assert prefill_attention._tile_config(576, 512, 16, 1, cuda) == (16, 16, 8, 1)
    device = cuda if torch.cuda.is_available() else torch.device("cpu")
    gen = torch.Generator().manual_seed(0)
    lens = [19, 6]
    metadata, blocks = packed_prefill_metadata(lens, 16, device)
    cache, _ = empty_layer_cache((blocks, 16, 1, 576), torch.float32, device, tensors=1)
    rows = torch.randn(sum(lens), 1, 576, generator=gen).to(device)
    reference.write_kv_cache(rows, rows, cache, cache, metadata.slot_mapping)
    query = torch.randn(sum(lens), 16, 576, generator=gen).to(device)
    m, scale = metadata, 576**-0.5
    args = (cache, cache, m.block_tables, m.query_start_loc, m.seq_lens, scale, m.max_query_len,
            m.max_seq_len)  # fmt: skip
    want = reference.paged_prefill_attention(query, *args)
    torch.testing.assert_close(triton_ops.paged_prefill_attention(query, *args), want)
    last = m.query_start_loc[1:].long() - 1  # each sequence's last token, as a decode
    decode = (query[last], cache, cache, m.block_tables, m.seq_lens, scale, m.max_seq_len)
    torch.testing.assert_close(
        triton_ops.paged_decode_attention(*decode), reference.paged_decode_attention(*decode)
    )
