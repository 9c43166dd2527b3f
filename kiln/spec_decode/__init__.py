"""Speculative decoding: proposers of draft tokens, their configuration and the K policy.

A decode request with K drafts is scheduled as K + 1 tokens of the same request (the scheduler's
ordinary chunked-prefill path); the runner scores all of them in one forward, verifies the drafts
(kiln.sampling.rejection_sampler) and asks the proposer for the next step's drafts; the scheduler
appends the accepted tokens plus one bonus token and gives back the KV slots of the rejected ones.

- config.py: `SpeculativeConfig` (vLLM's `speculative_config` dict) and the batch-size policy.
- proposer.py: the `Proposer` interface.
- ngram.py: prompt lookup, no second model.
- draft_model.py: a smaller model of the same vocabulary with its own paged KV pool.
- eagle3/: an EAGLE-3 head over the target's fused low/middle/high hidden states (the
  published checkpoint layout), chain drafting, its own paged KV pool.

This module imports nothing heavy: the engine reads the config and policy without torch.
"""
