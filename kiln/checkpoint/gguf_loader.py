"""Read a GGUF file (llama.cpp's format) as Hugging Face-named float32 tensors plus a ModelConfig.

The header is parsed here with `struct` over a memory map rather than with `gguf.GGUFReader`: the
reader builds a numpy view per vocabulary string and takes 3-6 s on SmolLM2's 49k-token vocabulary,
while this parser skips string arrays it is not asked for and takes ~0.1 s. The `gguf` package still
supplies the type table and the dequantizers (`gguf.quants.dequantize`).

    model = GGUFModel(path)            # parses the header once
    model.config                       # ModelConfig
    for name, tensor in model.tensors(): ...
    tokenizer = model.tokenizer()
"""

from __future__ import annotations

import functools
import math
import mmap
import os
import struct
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf.quants import dequantize

from kiln.checkpoint import gguf_int, gguf_tokenizer
from kiln.checkpoint.gguf_dequant import FAST_DEQUANTIZERS
from kiln.errors import ModelLoadError
from kiln.models import family_config, registry
from kiln.models.config import ModelConfig, attention_layout

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

_SCALAR_FORMATS: dict[int, str] = {  # keyed by GGUFValueType, an IntEnum
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}
_ROPE_FREQS = "rope_freqs.weight"  # llama3 rope scaling, folded into ModelConfig.rope_scaling
# Phi-3's longrope factors (llama.cpp's converter writes them as tensors), likewise folded.
_LONGROPE = ("rope_factors_long.weight", "rope_factors_short.weight")
_ROPE_TENSORS = (_ROPE_FREQS, *_LONGROPE)
_TYPE_IDS = {int(t) for t in GGMLQuantizationType}


class _Corrupt(Exception):
    """The header does not parse; turned into a ModelLoadError naming the file."""


class GGUFStringArray(Sequence[str]):
    """A string array of the header, decoded on first use (a vocabulary is ~100k strings)."""

    def __init__(self, buf: mmap.mmap, offset: int, count: int) -> None:
        self._buf, self._offset, self._count = buf, offset, count
        self._values: list[str] | None = None

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, index: Any) -> Any:
        return self._decoded()[index]

    def __iter__(self) -> Iterator[str]:  # Sequence's default indexes one item at a time
        return iter(self._decoded())

    def _decoded(self) -> list[str]:
        if self._values is not None:
            return self._values
        values, pos = [], self._offset
        for _ in range(self._count):
            (length,) = struct.unpack_from("<Q", self._buf, pos)
            values.append(self._buf[pos + 8 : pos + 8 + length].decode("utf-8", "replace"))
            pos += 8 + length
        self._values = values
        return values


class _Header:
    """Parses metadata and the tensor table; `pos` walks the file."""

    def __init__(self, buf: mmap.mmap) -> None:
        self.buf, self.pos = buf, 0

    def take(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        length = self.take("<Q")
        if self.pos + length > len(self.buf):
            raise _Corrupt(f"a string of {length} bytes runs past the end of the file")
        value = self.buf[self.pos : self.pos + length].decode("utf-8", "replace")
        self.pos += length
        return value

    def value(self, value_type: int) -> Any:
        if value_type == GGUFValueType.STRING:
            return self.string()
        if value_type != GGUFValueType.ARRAY:
            fmt = _SCALAR_FORMATS.get(value_type)
            if fmt is None:
                raise _Corrupt(f"unknown metadata value type {value_type}")
            value = self.take(fmt)
            # A float32 like 1e-5 reads back as 9.9999997e-06; its shortest repr is the original.
            return float(str(np.float32(value))) if value_type == GGUFValueType.FLOAT32 else value
        item_type, count = self.take("<I"), self.take("<Q")
        if count > len(self.buf):
            raise _Corrupt(f"an array claims {count} items")
        if item_type == GGUFValueType.STRING:
            start = self.pos
            for _ in range(count):  # only walk the lengths; GGUFStringArray decodes on demand
                self.pos += 8 + struct.unpack_from("<Q", self.buf, self.pos)[0]
            return GGUFStringArray(self.buf, start, count)
        fmt = _SCALAR_FORMATS.get(item_type)
        if fmt is None:
            raise _Corrupt(f"unsupported metadata array item type {item_type}")
        values = np.frombuffer(self.buf, np.dtype(fmt), count, self.pos)
        self.pos += values.nbytes
        return values.tolist()


class _TensorInfo:
    """Where one tensor's bytes are and how to turn them into a float32 torch tensor."""

    def __init__(self, name: str, dims: tuple[int, ...], qtype: GGMLQuantizationType) -> None:
        self.name, self.qtype = name, qtype
        self.shape = tuple(reversed(dims))  # ggml lists the fastest-moving dim first; torch last
        block_size, type_size = GGML_QUANT_SIZES[qtype]
        if dims[0] % block_size:
            raise _Corrupt(f"tensor {name!r}: row of {dims[0]} is not a multiple of {block_size}")
        self.row_bytes = dims[0] // block_size * type_size
        self.nbytes = self.row_bytes * math.prod(dims[1:])
        self.start = 0  # absolute file offset, set once the data section is located


class GGUFModel:
    """An opened GGUF file: the header is parsed once, tensors are read and dequantized lazily."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._buf = _open(path)
        try:
            self.metadata, self._tensors = _parse(self._buf, path)
        except (_Corrupt, struct.error, ValueError) as e:
            raise ModelLoadError(f"{path}: truncated or corrupt GGUF header ({e})") from e
        self.gguf_architecture: str = self.metadata["general.architecture"]
        # The family's table of tensor names (kiln.models.gguf_names).
        self.layout = registry.gguf_layout(self.gguf_architecture, path)
        for name in self._tensors:
            if name not in _ROPE_TENSORS:
                self._hf_name(name)  # fails now, not halfway through tensors()
        self.config = _config(self)

    @property
    def tensor_types(self) -> dict[str, str]:
        """{gguf tensor name: ggml type name}, e.g. {"blk.0.attn_q.weight": "Q4_1"}."""
        return {name: info.qtype.name for name, info in self._tensors.items()}

    @property
    def tokenizer_metadata(self) -> dict[str, Any]:
        """What a tokenizer/chat layer needs: chat template and special token ids."""
        meta = self.metadata
        return {
            "chat_template": meta.get("tokenizer.chat_template"),
            "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
            "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
            "eos_token_ids": self.config.eos_token_ids,
            "unk_token_id": meta.get("tokenizer.ggml.unknown_token_id"),
            "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
            "add_bos_token": meta.get("tokenizer.ggml.add_bos_token"),
            "add_eos_token": meta.get("tokenizer.ggml.add_eos_token"),
            "tokenizer_model": meta.get("tokenizer.ggml.model"),
            "tokenizer_pre": meta.get("tokenizer.ggml.pre"),
            "model_name": meta.get("general.name"),
        }

    def tensors(
        self, schemes: Mapping[str, str] | None = None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """(hf_name, float32 tensor) for every weight, in file order, one dequantized at a time.
        `schemes` ({hf tensor name: scheme}, gguf_int.projection_schemes): those projections as
        kiln's integer codes, scales (and mins) instead (kiln.checkpoint.gguf_int)."""
        cfg = self.config
        for info in self._tensors.values():
            if info.name in _ROPE_TENSORS:
                continue
            hf_name = self._hf_name(info.name)
            scheme = None if schemes is None else schemes.get(hf_name)
            if scheme is not None:
                raw = np.frombuffer(self._buf, np.uint8, info.nbytes, info.start)
                n, k = info.shape
                for suffix, part in gguf_int.int_groups(raw, info.qtype.name, (n, k), scheme):
                    # q/k rows back in rotate-half order: codes, scales and mins alike.
                    yield (
                        hf_name + suffix,
                        self.layout.to_hf_layout(
                            hf_name, part, cfg.num_attention_heads, cfg.num_key_value_heads
                        ),
                    )
                continue
            tensor = self.layout.to_hf_layout(
                hf_name, self._read(info), cfg.num_attention_heads, cfg.num_key_value_heads
            )
            yield hf_name, tensor

    def projection_types(self) -> dict[str, str]:
        """{hf name: ggml type name} of the decoder projections (what gguf-int keeps integer)."""
        return {
            hf_name: info.qtype.name
            for info in self._tensors.values()
            if info.name not in _ROPE_TENSORS
            and gguf_int.is_projection(hf_name := self._hf_name(info.name))
        }

    def _hf_name(self, gguf_name: str) -> str:
        hf_name = self.layout.hf_name(gguf_name)
        if hf_name is None:
            raise ModelLoadError(
                f"{self.path}: tensor {gguf_name!r} has no Hugging Face name in a "
                f"{self.gguf_architecture} GGUF"
            )
        return hf_name

    def tokenizer(self) -> PreTrainedTokenizerFast:
        """The file's tokenizer: a byte-level BPE one built by gguf_tokenizer.py from the header
        parsed here, any other by transformers from the file (which re-reads the header and
        imports its GGUF tables: 1.7-5 s of startup on a 2-core machine)."""
        if gguf_tokenizer.can_build(self.metadata):  # byte-level BPE: from our own header parse
            return gguf_tokenizer.build_tokenizer(self.metadata)
        from transformers import PreTrainedTokenizerFast

        directory, name = os.path.split(os.path.abspath(self.path))
        try:
            tokenizer = PreTrainedTokenizerFast.from_pretrained(directory, gguf_file=name)
        except Exception as e:  # transformers raises ValueError/KeyError/OSError variously
            raise ModelLoadError(f"{self.path}: cannot build a tokenizer: {e}") from e
        template = self.metadata.get("tokenizer.chat_template")
        if template and not tokenizer.chat_template:
            tokenizer.chat_template = template
        return tokenizer

    def _read(self, info: _TensorInfo) -> torch.Tensor:
        raw = np.frombuffer(self._buf, np.uint8, info.nbytes, info.start)
        fast = FAST_DEQUANTIZERS.get(info.qtype.name)
        if fast is not None:
            return fast(raw).reshape(info.shape)
        values = dequantize(raw.reshape(-1, info.row_bytes), info.qtype).reshape(info.shape)
        if not values.flags.writeable:  # F32 comes back as a view of the read-only map
            values = values.copy()
        return torch.from_numpy(values.astype(np.float32, copy=False))


def load_gguf(path: str) -> tuple[ModelConfig, Iterator[tuple[str, torch.Tensor]], dict[str, Any]]:
    """(config, lazy iterator of (hf_name, float32 tensor), tokenizer metadata) for a GGUF file."""
    model = GGUFModel(path)
    return model.config, model.tensors(), model.tokenizer_metadata


def load_gguf_tokenizer(path: str) -> PreTrainedTokenizerFast:
    """The tokenizer of a GGUF file, chat template included."""
    return GGUFModel(path).tokenizer()


def _open(path: str) -> mmap.mmap:
    if not os.path.isfile(path):
        raise ModelLoadError(f"GGUF file {path!r} does not exist")
    with open(path, "rb") as f:
        magic = f.read(4)
        if magic != b"GGUF":
            old = " (an old GGML/GGJT file: reconvert it)" if magic in (b"lmgg", b"tjgg") else ""
            raise ModelLoadError(f"{path} is not a GGUF file: magic {magic!r}, not b'GGUF'{old}")
        return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)


def _parse(buf: mmap.mmap, path: str) -> tuple[dict[str, Any], dict[str, _TensorInfo]]:
    header = _Header(buf)
    header.pos = 4
    version = header.take("<I")
    if version not in (2, 3):
        endian = " (a big-endian file?)" if version > 0xFFFF else ""
        raise ModelLoadError(f"{path}: GGUF version {version} is not supported (2, 3){endian}")
    num_tensors, num_fields = header.take("<Q"), header.take("<Q")
    metadata: dict[str, Any] = {}
    for _ in range(num_fields):
        key = header.string()
        metadata[key] = header.value(header.take("<I"))
    if "general.architecture" not in metadata:
        raise _Corrupt("no general.architecture in the metadata")
    tensors: dict[str, _TensorInfo] = {}
    for _ in range(num_tensors):
        name = header.string()
        num_dims = header.take("<I")
        if not 0 < num_dims <= 4:  # GGML_MAX_DIMS
            raise _Corrupt(f"tensor {name!r} has {num_dims} dimensions")
        dims = struct.unpack_from(f"<{num_dims}Q", buf, header.pos)
        header.pos += 8 * num_dims
        type_id, offset = header.take("<I"), header.take("<Q")
        qtype = _dequantizable().get(type_id)
        if qtype is None:
            known = GGMLQuantizationType(type_id).name if type_id in _TYPE_IDS else f"id {type_id}"
            raise ModelLoadError(
                f"{path}: tensor {name!r} has ggml type {known}, which gguf.quants cannot "
                f"dequantize; supported: {', '.join(t.name for t in _dequantizable().values())}"
            )
        tensors[name] = info = _TensorInfo(name, dims, qtype)
        info.start = offset  # relative until the data section is known
    alignment = int(metadata.get("general.alignment", 32))  # 32: llama.cpp's default
    data_start = -(-header.pos // alignment) * alignment
    for info in tensors.values():
        info.start += data_start
        if info.start + info.nbytes > len(buf):
            raise ModelLoadError(
                f"{path} is truncated: tensor {info.name!r} needs bytes up to "
                f"{info.start + info.nbytes}, the file has {len(buf)}"
            )
    return metadata, tensors


@functools.cache
def _dequantizable() -> dict[int, GGMLQuantizationType]:
    """{type id: type} of the ggml types gguf.quants can dequantize.

    Probed on one zero block per type: the package has no public list, and its coverage grows
    between versions (0.19 has no I8/I16/I32/I64/F64).
    """
    types = {}
    for qtype, (_, type_size) in GGML_QUANT_SIZES.items():
        try:
            dequantize(np.zeros((1, type_size), np.uint8), qtype)
        except (NotImplementedError, ValueError, TypeError):
            continue
        types[int(qtype)] = qtype
    return types


def _config(model: GGUFModel) -> ModelConfig:
    meta, path = model.metadata, model.path
    arch = model.gguf_architecture

    def field(key: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise ModelLoadError(f"{path}: metadata has no {arch}.{key}")
        if isinstance(value, list):  # per-layer values (some hybrid models): not a Llama
            raise ModelLoadError(f"{path}: {arch}.{key} varies per layer, which is not supported")
        return value

    hidden, num_heads = field("embedding_length"), field("attention.head_count")
    head_dim = field("attention.key_length", hidden // num_heads)
    rotary_dim = field("rope.dimension_count", head_dim)
    if rotary_dim != head_dim and model.layout.permuted_rotary:
        raise ModelLoadError(f"{path}: partial rotary ({rotary_dim} of {head_dim}) unsupported")
    tokens = meta.get("tokenizer.ggml.tokens")
    embedding = model._tensors.get("token_embd.weight")
    vocab_size = len(tokens) if tokens else embedding.shape[0] if embedding else field("vocab_size")
    theta = float(field("rope.freq_base", 10000.0))
    eos_keys = ("eos_token_id", "eot_token_id", "eom_token_id")  # llama.cpp stops on all three
    eos_ids = [meta[f"tokenizer.ggml.{key}"] for key in eos_keys if f"tokenizer.ggml.{key}" in meta]
    types = {info.qtype for info in model._tensors.values()}
    dtype = "float32"
    if GGMLQuantizationType.BF16 in types:
        dtype = "bfloat16"
    elif GGMLQuantizationType.F16 in types:
        dtype = "float16"
    num_layers, architecture = field("block_count"), model.layout.architecture
    window = meta.get(f"{arch}.attention.sliding_window")
    if architecture == "llama":  # llama.cpp's llama carries Mistral: a window is every layer's
        layer_types = None
    else:  # the family's own alternation of local and global layers (Gemma 2/3), as HF's
        window, layer_types = attention_layout(
            architecture, {"sliding_window": window, "num_hidden_layers": num_layers}
        )
    try:
        fields: dict[str, Any] = dict(
            architecture=architecture,
            vocab_size=vocab_size,
            hidden_size=hidden,
            intermediate_size=field("feed_forward_length"),
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=field("attention.head_count_kv", num_heads),
            head_dim=head_dim,
            rms_norm_eps=float(field("attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=theta,
            rope_scaling=_rope_scaling(model, field, theta, head_dim),
            max_position_embeddings=field("context_length"),
            tie_word_embeddings="output.weight" not in model._tensors,
            attention_bias="blk.0.attn_q.bias" in model._tensors,
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=tuple(dict.fromkeys(eos_ids)),
            torch_dtype=dtype,
            sliding_window=window,
            layer_types=layer_types,
            attn_logit_softcapping=meta.get(f"{arch}.attn_logit_softcapping"),
        )
        # The block options, by their config.json names: what the family's converter implies
        # (Gemma's GeGLU, scaled embedding) and what the file's metadata and tensors say.
        shape = {"num_hidden_layers": num_layers, "hidden_size": hidden,
                 "num_attention_heads": num_heads, "head_dim": head_dim}  # fmt: skip
        implied: dict[str, Any] = {
            **model.layout.hf_config,
            **(model.layout.implied_by_shape(shape) if model.layout.implied_by_shape else {}),
            **shape,
            "tie_word_embeddings": fields["tie_word_embeddings"],
            "partial_rotary_factor": rotary_dim / head_dim,
            "mlp_bias": "blk.0.ffn_down.bias" in model._tensors,
            "use_bias": "blk.0.attn_q.bias" in model._tensors,  # Starcoder2's one flag
            "final_logit_softcapping": meta.get(f"{arch}.final_logit_softcapping"),
        }
        local_base = meta.get(f"{arch}.rope.freq_base_swa")
        if local_base is not None:
            implied["rope_local_base_freq"] = local_base
        layer_norm_eps = meta.get(f"{arch}.attention.layer_norm_epsilon")
        if layer_norm_eps is not None:  # a LayerNorm family's, by its config.json names
            implied.update(layer_norm_eps=layer_norm_eps, norm_epsilon=layer_norm_eps)
        fields.update(family_config.family_fields(architecture, implied))
        return ModelConfig(**fields)
    except ModelLoadError as e:
        raise ModelLoadError(f"{path}: {e}") from e


def _rope_scaling(model: GGUFModel, field: Any, theta: float, head_dim: int) -> dict | None:
    """HF rope_scaling from `rope.scaling.*` metadata, or llama3's from the rope_freqs tensor."""
    kind = field("rope.scaling.type", "none")
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(field("rope.scaling.factor"))}
    if kind == "yarn":
        return {
            "rope_type": "yarn",
            "factor": float(field("rope.scaling.factor")),
            "original_max_position_embeddings": field("rope.scaling.original_context_length"),
        }
    if kind != "none":
        raise ModelLoadError(f"{model.path}: rope scaling type {kind!r} is not supported")
    if _LONGROPE[0] in model._tensors:  # Phi-3's 128k models
        long, short = (model._read(model._tensors[name]).tolist() for name in _LONGROPE)
        scaling = {
            "rope_type": "longrope",
            "long_factor": long,
            "short_factor": short,
            "original_max_position_embeddings": field("rope.scaling.original_context_length"),
        }
        attention_factor = model.metadata.get(f"{model.gguf_architecture}.rope.scaling.attn_factor")
        if attention_factor is not None:
            scaling["attention_factor"] = attention_factor
        return scaling
    info = model._tensors.get(_ROPE_FREQS)
    if info is None:
        return None
    # llama.cpp's convert stores llama3 scaling as per-frequency divisors; rebuild HF's parameters
    # (factor = the largest divisor; the other three are fixed across Llama 3.x) and check they
    # reproduce the tensor exactly, rather than guess.
    divisors = model._read(info).double()
    factor = float(divisors.max())
    if factor == 1.0:
        return None
    scaling = {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": field("rope.scaling.original_context_length", 8192),
    }
    if not torch.allclose(divisors, llama3_rope_divisors(scaling, theta, head_dim), rtol=1e-4):
        raise ModelLoadError(f"{model.path}: {_ROPE_FREQS} is not llama3 rope scaling")
    return scaling


def llama3_rope_divisors(scaling: dict[str, Any], theta: float, head_dim: int) -> torch.Tensor:
    """llama.cpp's rope_freqs tensor for HF llama3 rope scaling (inv_freq / scaled inv_freq)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    factor, original = scaling["factor"], scaling["original_max_position_embeddings"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (original / wavelen - low) / (high - low)
    divisors = 1 / ((1 - smooth) / factor + smooth)
    divisors = torch.where(wavelen < original / high, 1.0, divisors)
    return torch.where(wavelen > original / low, factor, divisors)
