"""Cohere (Command-R) over the shared blocks: LayerNorms without biases, attention and MLP in
parallel off one norm, logits times logit_scale (folded into the final norm at load), tied
embeddings. Its rotary turns interleaved pairs of dims (2i, 2i + 1); the q/k rows of each head
are reordered at load (evens, then odds) so the shared rotate-half kernels compute the same
scores, and so are the per-head q/k LayerNorms' weights (use_qk_norm, Command R+)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from kiln.models.layer_norm import QK_NORM_LAYER_TENSOR_MAP, LayerNormDecoderForCausalLM


class CohereForCausalLM(LayerNormDecoderForCausalLM):
    layer_tensor_map = QK_NORM_LAYER_TENSOR_MAP

    def adapt_hf_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        head_dim = self.full_config.head_dim
        order = torch.cat([torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)])

        def reordered(name: str, tensor: torch.Tensor) -> torch.Tensor:
            if name.endswith(("self_attn.q_norm.weight", "self_attn.k_norm.weight")):
                return tensor[..., order]  # [heads, head_dim]: each head's dims as its rows'
            if not (".q_proj." in name or ".k_proj." in name) or tensor.numel() == 1:
                return tensor
            heads = tensor.reshape(-1, head_dim, *tensor.shape[1:])
            return heads[:, order].reshape(tensor.shape)

        return super().adapt_hf_weights((n, reordered(n, t)) for n, t in weights)
