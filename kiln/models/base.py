"""What the runtime may use of a model (the model <-> runner contract): every model class a
family registers (kiln.models.registry) has these names, and the runner, the memory plan, the
executor and speculative decoding use nothing else."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from types import ModuleType
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch
from torch import nn

from kiln.attention.backend import AttentionBackend, AttentionMetadata
from kiln.distributed.parallel_state import ParallelContext
from kiln.layers.linear import LinearMethod
from kiln.models.config import ModelConfig

if TYPE_CHECKING:
    from kiln.models.blocks import LinearMethodFactory, StepInputs


@runtime_checkable
class CausalLM(Protocol):
    """A decoder-only language model over packed tokens (no padding)."""

    config: ModelConfig
    """This rank's shard: its heads, MLP width and pipeline stage's layers (the KV cache, the
    memory plan and the runner are sized by it)."""
    full_config: ModelConfig
    """The whole model's shape."""
    parallel: ParallelContext | None
    """This rank's place under tensor/pipeline parallelism (None: the whole model)."""
    computes_logits: bool
    """Whether this rank computes logits (the last pipeline stage's)."""
    layer_start: int
    """The global index of this stage's first decoder layer."""
    layers: nn.ModuleList
    """This stage's decoder layers (their count sizes the KV cache)."""

    @property
    def embed_tokens(self) -> nn.Module:
        """The token embedding (EAGLE-3 and draft models share it)."""
        ...

    cos_sin_cache: torch.Tensor
    """[max_positions, head_dim] fp32 rotary table; its length is the longest context."""
    norm: torch.Tensor
    """The final RMSNorm's weight."""
    aux_hidden_states: torch.Tensor | None
    """EAGLE-3's captured residual streams (enable_aux_hidden_states), else None."""

    def __init__(
        self,
        cfg: ModelConfig,
        max_positions: int,
        linear_method: LinearMethodFactory | None = None,
        dtype: torch.dtype | None = None,
        parallel: ParallelContext | None = None,
        lm_head_method: LinearMethod | None = None,
    ) -> None:
        """How the loader and the builder make one (registry.model_class): `linear_method` gives
        each decoder projection its LinearMethod by qualified name (None: unquantized), `dtype`
        is where the parameters are made, `lm_head_method` a quantized head's (None: not)."""
        ...

    @property
    def device(self) -> torch.device: ...

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype (the model dtype)."""
        ...

    def __call__(
        self,
        ops: ModuleType,
        backend: AttentionBackend,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden], final-normed (the last stage's)
        ...

    def compute_logits(
        self, hidden: torch.Tensor, ops: ModuleType | None = None
    ) -> torch.Tensor:  # [n, vocab]
        ...

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The first layer's input for these tokens (the embedding, times its multiplier)."""
        ...

    def step_inputs(
        self,
        ops: ModuleType,
        backend: AttentionBackend,
        positions: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> StepInputs:
        """What every layer of one forward shares (build-time calibration runs the layers)."""
        ...

    def enable_aux_hidden_states(self, layer_ids: tuple[int, ...], max_num_tokens: int) -> None: ...

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Hugging Face-named tensors (a checkpoint's, or a GGUF file's renamed)."""
        ...

    def load_fused_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], cut: bool = True, adopt: bool = False
    ) -> None:
        """Tensors named as named_parameters() names them (an engine directory's)."""
        ...

    def init_dummy_weights(self, seed: int) -> None: ...

    # nn.Module's, which every model is: the memory plan counts the parameters, the loader
    # switches to inference mode, the builder writes the parameters and walks the projections.
    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]: ...

    def named_buffers(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, torch.Tensor]]: ...

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]: ...

    def named_modules(self) -> Iterator[tuple[str, nn.Module]]: ...

    def eval(self) -> nn.Module: ...
