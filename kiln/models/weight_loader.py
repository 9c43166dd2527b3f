"""One weight loader for every family, driven by the family's name map: Hugging Face tensors
(q/k/v into qkv_proj, gate/up into gate_up_proj, biases, a pre-quantized checkpoint's weight
scales), an engine directory's kiln-named ones, or dummy ones; each cut to this tensor rank's
part and filtered to this pipeline stage's layers, checked strictly (nothing missing, nothing
unplaced)."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

import torch
from torch import nn

from kiln.errors import ModelLoadError
from kiln.layers.linear import Linear
from kiln.layers.moe import FusedMoE
from kiln.layers.moe_w8a16 import GROUP, quantize_experts_w8
from kiln.layers.vocab_parallel import VocabParallelEmbedding
from kiln.models.blocks import RopeAttention

if TYPE_CHECKING:
    from kiln.models.decoder import DecoderForCausalLM, LayerTensorMap

_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_LOCAL_RE = re.compile(r"^layers\.(\d+)\.(.+)$")
# Read before the model is built (input scales: kiln.checkpoint.prequantized) or not applied
# (the KV cache's scales: kiln's float8 cache is unscaled; the loader says so).
_SCALES_READ_ELSEWHERE = (".input_scale", ".k_scale", ".v_scale")
_SCALE_NAMES = ("weight_scale", "weight_scales")  # an 8-bit weight's, one of them


def with_weight_scales(layer_map: LayerTensorMap) -> dict[str, tuple[str, int | None]]:
    """`layer_map` plus each projection weight's `weight_scale` (a pre-quantized checkpoint's),
    which loads into its projection's shard as its weight does."""
    scales = {  # float8: _scale; INT4 (kiln.checkpoint.int4_formats): the others
        f"{hf}{suffix}": (f"{ours}{suffix}", shard)
        for hf, (ours, shard) in layer_map.items()
        if hf.endswith("proj.weight")
        for suffix in ("_scale", "_scales", "_zeros", "_g_idx")
    }
    return {**layer_map, **scales}


def map_hf_name(
    hf_name: str, layer_map: Mapping[str, tuple[str, int | None]], architecture: str
) -> tuple[str, int | None] | None:
    """HF tensor name -> (kiln parameter name, fused shard) or None for tensors kiln ignores."""
    if hf_name.endswith("rotary_emb.inv_freq") or hf_name.endswith(_SCALES_READ_ELSEWHERE):
        return None
    if hf_name == "model.embed_tokens.weight":
        return "embed_tokens.weight", None
    if hf_name == "model.norm.weight":
        return "norm", None
    if hf_name == "model.norm.bias":  # a LayerNorm family's (StableLM)
        return "norm_bias", None
    if hf_name == "lm_head.weight":
        return "lm_head.weight", None
    match = _LAYER_RE.match(hf_name)
    if match and match.group(2) in layer_map:
        name, shard = layer_map[match.group(2)]
        return f"layers.{match.group(1)}.{name}", shard
    raise ModelLoadError(f"unexpected tensor {hf_name!r} in a {architecture} checkpoint")


def load_hf_weights(
    model: DecoderForCausalLM,
    weights: Iterable[tuple[str, torch.Tensor]],
    layer_map: LayerTensorMap,
) -> None:
    """Hugging Face-named tensors into `model`, each through its layer's loader."""
    params = dict(model.named_parameters())
    owners = linear_owners(model)
    names = with_weight_scales(layer_map)
    loaded: set[str] = set()
    codes_loaded: set[str] = set()
    for hf_name, tensor in weights:
        target = map_hf_name(hf_name, names, model.config.architecture)
        if target is None:
            continue
        name, shard = target
        if name == "lm_head.weight" and model.tied_head:
            continue  # tied: the embedding serves as the output projection (or fills it)
        local = local_name(model, name)
        if local is None:
            continue  # another pipeline stage's layer
        if local not in params:
            raise ModelLoadError(f"checkpoint tensor {hf_name!r} has no place in the model")
        _load_hf_tensor(model, params[local], owners.get(local), local, shard, tensor, hf_name)
        loaded.add(f"{local}:{shard}")
        if local == "embed_tokens.weight" and model.tied_head and model.head_quantized:
            head = quantized_head(model)
            head.weight_loader(head.weight, None, tensor)
            loaded.add("lm_head.weight:None")
        if tensor.dtype in (torch.float8_e4m3fn, torch.int8):
            codes_loaded.add(f"{local}:{shard}")
    missing = [k for k in _expected_keys(model, owners) if k not in loaded]
    # 8-bit weights loaded as they are need their scales from the checkpoint too (per row, or
    # per block / group: weight_scales).
    missing += [
        k.replace(".weight:", ".weight_scale:")
        for k in sorted(codes_loaded)
        if not any(k.replace(".weight:", f".{s}:") in loaded for s in _SCALE_NAMES)
    ]
    if missing:
        raise ModelLoadError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")


def _load_hf_tensor(
    model: DecoderForCausalLM,
    param: torch.Tensor,
    owner: Linear | None,
    name: str,
    shard: int | None,
    tensor: torch.Tensor,
    hf_name: str,
) -> None:
    """One checkpoint tensor into its parameter (a Linear's through its method's loader)."""
    if owner is not None and name.endswith("weight_scale"):
        tensor = _scale_rows(owner, param, shard, tensor)
    if tensor.dtype == torch.float8_e4m3fn and param.dtype != torch.float8_e4m3fn:
        raise ModelLoadError(
            f"checkpoint tensor {hf_name!r} is float8 but the model was built without "
            "FP8 weights (the checkpoint declares no FP8 scheme kiln reads)"
        )
    # An INT4 g_idx is one per input, not rows of the fused layer; block scales under TP come
    # one per 128 rows and are repeated down the rows before the cut: their methods check them.
    whole = name.endswith("g_idx") or (
        name.endswith("weight_scales") and owner is not None and owner.split is not None
    )
    if owner is not None and not whole and not _cut_fits(owner, param, shard, tensor):
        raise ModelLoadError(
            f"tensor {hf_name!r} has shape {tuple(tensor.shape)}, the model expects "
            f"{_checkpoint_part(owner, param, shard)} (of this tensor rank's part)"
        )
    if owner is None:
        _copy_unsplit(model, name, param, tensor, hf_name)
    else:
        owner.weight_loader(param, shard, tensor)


def load_engine_weights(
    model: DecoderForCausalLM,
    weights: Iterable[tuple[str, torch.Tensor]],
    cut: bool = True,
    adopt: bool = False,
) -> None:
    """kiln-named, already fused tensors into `model` (DecoderForCausalLM.load_fused_weights)."""
    params = dict(model.named_parameters())
    owners = linear_owners(model)
    loaded: set[str] = set()
    for engine_name, tensor in weights:
        name = local_name(model, engine_name)
        if name is None:
            continue  # another pipeline stage's layer
        param = params.get(name)
        if param is None:
            raise ModelLoadError(f"engine tensor {engine_name!r} has no place in the model")
        if name in loaded:
            raise ModelLoadError(f"engine tensor {engine_name!r} appears twice")
        owner, read = owners.get(name), tensor
        if not cut:
            pass
        elif owner is not None:  # TP: this rank's part of the fused tensor
            tensor = owner.cut(param, None, tensor)
        elif isinstance(vocab := _vocab_owner(model, name), VocabParallelEmbedding):
            tensor = vocab.cut(tensor)
        elif (experts := _expert_owner(model, name)) is not None and experts.shard is not None:
            tensor = experts.shard.cut_stacked(name.rsplit(".", 1)[1], tensor)  # TP/EP
        elif name.endswith(_SINKS):
            tensor = _sinks_owner(model, name).cut_sinks(tensor)
        # An engine built with the head in the model dtype, loaded with a float8 head: the
        # head is quantized here (its scales too), as from a checkpoint.
        quantize_head = (
            owner is not None and owner is model.lm_head and model.head_quantized
            and param is owner.weight and tensor.dtype != param.dtype
        )  # fmt: skip
        if tuple(param.shape) != tuple(tensor.shape) or (
            param.dtype != tensor.dtype and not quantize_head
        ):
            raise ModelLoadError(
                f"engine tensor {engine_name!r} is {tensor.dtype} {tuple(tensor.shape)}, the "
                f"model expects {param.dtype} {tuple(param.shape)} (built with another dtype "
                "or another tensor_parallel_size?)"
            )
        if adopt and tensor is read and _can_adopt(param, tensor):  # not a cut (a view of more)
            # The engine stores each tensor as its parameter holds it (same dtype and shape,
            # checked above), so the method's loader would copy it unchanged: take the
            # reader's (verified) device tensor as the parameter's storage instead of copying
            # it, which saves a device copy and, on the CPU, a page-faulting copy per weight.
            param.data = tensor
        elif owner is None:
            param.copy_(tensor)
        else:
            owner.method.load_weight(param, None, tensor)
        loaded.add(name)
        if quantize_head:
            loaded.add("lm_head.weight_scale")
    if model.head_quantized and model.tied_head and "lm_head.weight" not in loaded:
        fill_tied_head(model)  # an engine of a tied model built without a float8 head
        loaded.update(("lm_head.weight", "lm_head.weight_scale"))
    missing = [name for name in params if name not in loaded]
    if missing:
        raise ModelLoadError(f"engine lacks {len(missing)} tensors, e.g. {missing[:3]}")


def init_dummy_weights(model: DecoderForCausalLM, seed: int) -> None:
    """Normal(0, 0.02) weights, norms at 1 (DecoderForCausalLM.init_dummy_weights)."""
    gen = torch.Generator(device=model.device).manual_seed(seed)
    owners = linear_owners(model)
    params = dict(model.named_parameters())
    expert_scales: dict[str, torch.Tensor] = {}  # int8 experts' per-channel scales, by name
    for name, param in params.items():
        owner = owners.get(name)
        if _derived(name, owner) or name.endswith(("_weight_scales", "_weight_zeros")):
            continue  # INT4 experts' keep their dummy scales and symmetric zeros
        if name in expert_scales:  # registered after its codes
            param.copy_(expert_scales.pop(name))
        elif param.element_size() == 1:  # float8 / int8: drawn as a checkpoint would be, loaded
            drawn = torch.empty(param.shape, device=param.device).normal_(0.0, 0.02, generator=gen)
            if owner is None and param.dtype == torch.int8:  # kiln.layers.moe_w8a16's experts
                grouped = params[f"{name}_scale"].dim() == 3  # a scale per row and GROUP
                codes, expert_scales[f"{name}_scale"] = quantize_experts_w8(
                    drawn, torch.int8, GROUP if grouped else 0
                )
                param.copy_(codes)
            elif owner is None:  # float8 experts (kiln.layers.moe), at their scales of 1
                param.copy_(drawn.to(param.dtype))
            else:
                owner.method.load_weight(param, None, drawn)  # drawn at this rank's shape
        elif not param.is_floating_point():  # INT4 codes: random words
            param.random_(-(2**31), 2**31 - 1, generator=gen)
        elif (param.dim() == 1 and "bias" not in name) or name.endswith("_weight_scale"):
            param.fill_(1.0)  # norms; float8 experts' scales, per expert or per channel
        else:
            param.normal_(0.0, 0.02, generator=gen)
    if model.head_quantized and model.tied_head:
        fill_tied_head(model)


def quantized_head(model: DecoderForCausalLM) -> Linear:
    """The LM head of a model built with a quantized one (head_quantized): a Linear of its own."""
    head = model.lm_head
    assert isinstance(head, Linear), "a quantized head is a Linear of its own"
    return head


def fill_tied_head(model: DecoderForCausalLM) -> None:
    """A float8 head of a tied model: the embedding, quantized by the head's method."""
    head = quantized_head(model)
    head.method.load_weight(head.weight, None, model.embed_tokens.weight.detach())


def local_name(model: DecoderForCausalLM, name: str) -> str | None:
    """A whole-model parameter name -> this stage's (layer indices from 0), or None for a
    layer another pipeline stage holds."""
    match = _LOCAL_RE.match(name)
    if match is None or model.parallel is None:
        return name
    index = int(match.group(1)) - model.layer_start
    if not 0 <= index < len(model.layers):
        return None
    return f"layers.{index}.{match.group(2)}"


def linear_owners(model: nn.Module) -> dict[str, Linear]:
    """Each Linear-owned parameter's name -> its layer (whose method loads it)."""
    return {
        f"{prefix}.{name}": module
        for prefix, module in model.named_modules()
        if isinstance(module, Linear)
        for name, _ in module.named_parameters(recurse=False)
    }


def _vocab_owner(model: DecoderForCausalLM, name: str) -> nn.Module | None:
    return {"embed_tokens.weight": model.embed_tokens, "lm_head.weight": model.lm_head}.get(name)


def _expert_owner(model: DecoderForCausalLM, name: str) -> FusedMoE | None:
    """The mixture-of-experts layer whose stacked parameter `name` is, if it is one."""
    module_name = name.rsplit(".", 1)[0]
    if not module_name.endswith(".experts"):
        return None
    module = model.get_submodule(module_name)
    return module if isinstance(module, FusedMoE) else None


_SINKS = ".self_attn.sinks"  # attention sinks (gpt-oss), one per query head: cut as the heads


def _sinks_owner(model: DecoderForCausalLM, name: str) -> RopeAttention:
    attention = model.get_submodule(name.removesuffix(".sinks"))
    assert isinstance(attention, RopeAttention), f"{name}: sinks of a RopeAttention"
    return attention


def _copy_unsplit(
    model: DecoderForCausalLM, name: str, param: torch.Tensor, tensor: torch.Tensor, hf_name: str
) -> None:
    """A parameter no Linear owns: the norms, the embedding, a vocab-cut head."""
    owner = _vocab_owner(model, name)
    if isinstance(owner, VocabParallelEmbedding):
        tensor = owner.cut(tensor)
    elif name.endswith(_SINKS):
        tensor = _sinks_owner(model, name).cut_sinks(tensor)
    if tuple(param.shape) != tuple(tensor.shape):
        raise ModelLoadError(
            f"tensor {hf_name!r} has shape {tuple(tensor.shape)}, "
            f"the model expects {tuple(param.shape)}"
        )
    param.copy_(tensor)


def _expected_keys(model: DecoderForCausalLM, owners: dict[str, Linear]) -> list[str]:
    keys = []
    for name, _ in model.named_parameters():
        owner = owners.get(name)
        if _derived(name, owner) or _symmetric_int4_zeros(model, name):
            continue
        if owner is None or len(owner.output_sizes) == 1:
            keys.append(f"{name}:None")
        else:
            keys += [f"{name}:{shard}" for shard in range(len(owner.output_sizes))]
    return keys


def _symmetric_int4_zeros(model: DecoderForCausalLM, name: str) -> bool:
    """INT4 experts' zero points where the checkpoint declares none (symmetric: they stay 8)."""
    if not name.endswith("_weight_zeros"):
        return False
    experts = _expert_owner(model, name)
    return experts is not None and not getattr(experts.method, "needs_zeros", True)


def _can_adopt(param: torch.Tensor, tensor: torch.Tensor) -> bool:
    """Whether `tensor` can become `param`'s storage as it is: same device, dtype and shape, dense,
    and 16-byte aligned (what the kernels' vectorised loads and Triton's pointer specialisation
    expect of a freshly allocated parameter)."""
    return (
        tensor.device == param.device
        and tensor.dtype == param.dtype
        and tensor.shape == param.shape
        and tensor.is_contiguous()
        and tensor.data_ptr() % 16 == 0
    )


def _scale_rows(
    owner: Linear, param: torch.Tensor, shard: int | None, tensor: torch.Tensor
) -> torch.Tensor:
    """A pre-quantized checkpoint's weight scale as one scale per row of the full checkpoint
    tensor (what the weight's rows are cut from under TP): per channel it is [rows, 1], per
    tensor a single value, repeated for every row of the projection it scales."""
    if tensor.numel() != 1:
        return tensor.reshape(-1)
    split = owner.split
    if split is None or split.rows is None:  # TP=1, or row-parallel: every row is this rank's
        rows = owner.shard_view(param, shard).shape[0]
    else:
        assert split.full_sizes is not None, "a column-parallel split has its full sizes"
        rows = split.full_sizes[shard] if shard is not None else sum(split.full_sizes)
    return tensor.reshape(()).expand(rows)


def _checkpoint_part(owner: Linear, param: torch.Tensor, shard: int | None) -> tuple[int, ...]:
    """The shape of this rank's part of a checkpoint tensor for `param`'s shard `shard`."""
    return owner.method.checkpoint_shape(owner, param, tuple(owner.shard_view(param, shard).shape))


def _cut_fits(owner: Linear, param: torch.Tensor, shard: int | None, tensor: torch.Tensor) -> bool:
    """Whether a full checkpoint tensor, cut to this rank's part, fills its place in `param`."""
    want = _checkpoint_part(owner, param, shard)
    if owner.split is None:
        return tuple(tensor.shape) == want
    try:
        return tuple(owner.cut(param, shard, tensor).shape) == want
    except (RuntimeError, IndexError):  # narrow() past the end: the tensor is too small
        return False


def _derived(name: str, owner: Linear | None) -> bool:
    """A linear method's tensor that no HF checkpoint holds (a quantized weight's scale): its
    method's loader fills it while loading the weight."""
    return owner is not None and name.rsplit(".", 1)[-1] not in ("weight", "bias")
