"""Builds the proposer a SpeculativeConfig names (and loads a draft model, checked against the
target's vocabulary and tokenizer)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from kiln.config import EngineConfig
from kiln.errors import ModelLoadError
from kiln.models.base import CausalLM
from kiln.spec_decode.config import SpeculativeConfig
from kiln.spec_decode.eagle3.head import Eagle3Head, load_eagle3_head
from kiln.spec_decode.proposer import Proposer


def load_draft_model(
    config: EngineConfig,
    spec: SpeculativeConfig,
    target,  # kiln.runtime.model_loader.LoadedModel
    device: torch.device,
    dtype: torch.dtype,
    load_model: Callable,  # kiln.runtime.model_loader.load_model (runtime sits above this)
) -> CausalLM:
    draft_config = dataclasses.replace(
        config, model=spec.model, speculative_config=None, quantization="none"
    )
    draft = load_model(draft_config, device, dtype)
    check_draft_matches(target, draft)
    model = draft.model
    n = spec.draft_num_hidden_layers
    if n is not None:
        if n > len(model.layers):
            raise ModelLoadError(
                f"speculative_config.draft_num_hidden_layers={n}, but the draft has only "
                f"{len(model.layers)} layers"
            )
        model.layers = model.layers[:n]
        model.config = dataclasses.replace(model.config, num_hidden_layers=n)
    return model


def load_eagle3(
    config: EngineConfig, spec: SpeculativeConfig, target, device: torch.device, dtype: torch.dtype
) -> Eagle3Head:  # target: kiln.runtime.model_loader.LoadedModel
    """The EAGLE-3 head, checked against the target, and the target told to expose the hidden
    states it fuses (rows for the largest forward: a prefill budget or a graph's padded batch)."""
    assert spec.model is not None, "SpeculativeConfig requires the head's path for eagle3"
    head = load_eagle3_head(spec.model, target.model, device, dtype)
    rows = max(config.max_num_batched_tokens, config.max_num_seqs)
    target.model.enable_aux_hidden_states(head.aux_layer_ids, rows)
    return head


def check_draft_matches(target, draft) -> None:  # two LoadedModels
    """A draft must speak the target's token ids: same vocabulary size and, where both carry a
    tokenizer, the same token -> id map."""
    tv, dv = target.config.vocab_size, draft.config.vocab_size
    if tv != dv:
        raise ModelLoadError(
            f"speculative_config.model: the draft's vocabulary has {dv} tokens, the target's "
            f"{tv}: a draft model must use the target's tokenizer"
        )
    t_tok, d_tok = target.tokenizer, draft.tokenizer
    if t_tok is not None and d_tok is not None and hasattr(t_tok, "get_vocab"):
        t_vocab, d_vocab = t_tok.get_vocab(), d_tok.get_vocab()
        if t_vocab != d_vocab:
            differ = sorted(set(t_vocab.items()) ^ set(d_vocab.items()))[:3]
            raise ModelLoadError(
                "speculative_config.model: the draft's tokenizer maps tokens to other ids than "
                f"the target's (e.g. {differ}): a draft model must use the target's tokenizer"
            )


def build_proposer(
    spec: SpeculativeConfig,
    vocab_size: int,
    *,
    draft_model: CausalLM | Eagle3Head | None,
    num_blocks: int,
    block_size: int,
    max_num_seqs: int,
    max_model_len: int,
    attention_backend: str,
    kv_cache_dtype: torch.dtype,
    max_num_batched_tokens: int = 2048,
    target_embedding: torch.nn.Module | None = None,  # eagle3: the target's token embedding
) -> Proposer:
    k = spec.num_speculative_tokens
    if spec.instrument is not None:  # kiln bench's and the tests' (kiln.bench.oracle)
        return spec.instrument.build(k, vocab_size)
    if spec.method == "ngram":
        from kiln.spec_decode.ngram import NgramProposer

        return NgramProposer(k, spec.prompt_lookup_min, spec.prompt_lookup_max)
    if spec.method == "draft_model":
        from kiln.spec_decode.draft_model import DraftModelProposer

        # As many blocks as the target's (the memory plan counted them), plus room for every
        # sequence's K draft positions past what the target holds (a few blocks a sequence, not
        # in the plan: the plan's safety margin holds them for a small draft).
        extra = max_num_seqs * -(-(k + 1) // block_size)
        assert draft_model is not None and not isinstance(draft_model, Eagle3Head)
        return DraftModelProposer(
            draft_model,
            k,
            num_blocks + extra,
            block_size,
            max_model_len,
            attention_backend,
            kv_cache_dtype,
            max_num_batched_tokens,
        )
    if spec.method == "eagle3":
        from kiln.spec_decode.eagle3.proposer import Eagle3Proposer

        head = draft_model
        assert isinstance(head, Eagle3Head)
        embedding = head.embed_tokens if head.embed_tokens is not None else target_embedding
        assert embedding is not None, "a head without an embedding shares the target's"
        extra = max_num_seqs * -(-(k + 1) // block_size)  # as for draft_model, above
        return Eagle3Proposer(
            head,
            embedding,
            k,
            num_blocks + extra,
            block_size,
            max_model_len,
            attention_backend,
            kv_cache_dtype,
            max_num_batched_tokens,
        )
    raise ValueError(f"speculative_config.method {spec.method!r} is not built")
