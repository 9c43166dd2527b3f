"""EAGLE-3 drafting (Li et al. 2025): one decoder layer over the target's own hidden states.

- head.py: the draft head in the published checkpoint layout (`LlamaForCausalLMEagle3`:
  `fc`, `midlayer.*`, `norm`, `lm_head` over a reduced vocabulary, `d2t`/`t2d`), its loading and
  the checks against the target.
- proposer.py: the proposer: it records the fused low/middle/high hidden states of every token
  the target computes, runs the head over the verified ones, then drafts a chain of K tokens,
  each step feeding the head its own hidden state; its own paged KV pool.

The target exposes the three hidden states only when a head is loaded
(`LlamaForCausalLM.enable_aux_hidden_states`).
"""
