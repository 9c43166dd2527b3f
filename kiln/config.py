"""Engine configuration: typed, frozen, validated once. Every field has a default and a reason.

Field metadata, read by `__post_init__` and by the CLI (kiln.cli.engine_args, which makes one
flag per field, its help the field's docstring): "choices", the values a field accepts, declared
once for both; "cli": False keeps a field off the command line.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING

from kiln.errors import ConfigError

if TYPE_CHECKING:
    from kiln.spec_decode.config import SpeculativeConfig

    # speculative_config: Python callers may also pass a SpeculativeConfig (a benchmark
    # instrument's, which SpeculativeConfig.from_dict takes as it is).
    _SpeculativeSpec = dict | SpeculativeConfig
else:
    # At run time the annotation is the dict alone: the CLI's flags and the engine process's
    # JSON decoding read it.
    _SpeculativeSpec = dict


def _one_of(default: str, *choices: str) -> str:
    """A string field that accepts only `choices` (validated, and the CLI flag's choices)."""
    return field(default=default, metadata={"choices": (default, *choices)})


@dataclass(frozen=True)
class EngineConfig:
    """Knobs of the runtime. Construct with keyword arguments. "auto" and None values are kept as
    given: the engine resolves them where the device and the model are known (kiln.engine,
    kiln.runtime), so a config means the same on every machine."""

    model: str | None = None
    """HF model directory, .gguf file, architecture preset (with load_format="dummy") or hub id.
    None means the embedded default (SmolLM2-135M-Instruct)."""
    load_format: str = _one_of("auto", "dummy", "dequantized", "gguf-int")
    """"auto" (read the checkpoint), "dummy" (random weights at a sane scale, for benchmarks),
    "dequantized" (an FP4 checkpoint's weights widened exactly to the model dtype and run
    unquantized, instead of converted to FP8: what the FP8 conversion is checked against) or
    "gguf-int" (a GGUF file's decoder projections kept on the integer methods, exactly the
    file's values: Q2_K / Q3_K / Q4_0 / Q4_1 / Q4_K on INT4 W4A16, Q5_0 / Q5_1 / Q5_K / Q6_K /
    Q8_0 / IQ4_NL / IQ4_XS on INT8 W8A16, so llama.cpp's K_M mixes too; a fused layer mixing
    widths all on INT8; other types refused; embeddings and LM head dequantized; TP=1; "auto"
    dequantizes GGUF files, and runs faster on the CPU, where the methods' twins widen the
    weights every step)."""
    dtype: str = _one_of("auto", "float32", "float16", "bfloat16")
    """"auto" (float32 on CPU, bfloat16 on GPU), "float32", "float16" or "bfloat16"."""
    device: str = "auto"
    """"auto" (cuda if available, else cpu), "cpu" or "cuda"."""
    max_model_len: int | None = None
    """Longest prompt + output; None means the model's own context length."""
    max_num_seqs: int = 256
    """Most requests running at once (the decode batch size ceiling)."""
    max_num_batched_tokens: int = 2048
    """Token budget of one step: decodes plus prefill chunks. A long prompt is chunked to fit."""
    block_size: int = 16
    """Tokens per KV cache block (page)."""
    kv_cache_dtype: str = _one_of("auto", "fp8", "fp8_e4m3", "int8")
    """"auto" (the model dtype), "fp8" (float8 e4m3, unscaled: half the bytes of bf16, so twice
    the tokens and half the reads per decode step, at a small accuracy cost) or "int8" (int8
    codes with a power-of-two scale per layer and KV head, folded into the weights: one byte a
    value on GPUs without float8; an engine built with `kiln build --kv-cache-dtype int8` brings
    scales calibrated on its text, any other model is measured over a short built-in text as
    it loads: kiln.runtime.kv_calibration). int8 takes no LoRA, no draft
    model or EAGLE-3 head, and, without an engine's scales, no TP or PP."""
    quantization: str = _one_of(
        "none", "fp8", "fp8-dynamic", "int4-g128", "int8-w8a8", "fp8-block",
        "int8-w8a16-channel", "int8-w8a16-g128", "int8-w8a16-g16", "fp8-w8a16-channel",
    )  # fmt: skip
    """Weights and activations of the decoder's projections: "none" (the model dtype),
    "fp8-dynamic" (float8 e4m3 weights with per-output-channel scales, activations scaled per
    token at run time) or "fp8" (vLLM's meaning: an engine built with `kiln build --quantization
    fp8` or a checkpoint with static scales runs with them; any other source is quantized as it
    loads, activations per token as "fp8-dynamic"). The LM head stays unquantized.
    "int4-g128" (W4A16, groups of 128 inputs) runs dummy weights; INT4 checkpoints (GPTQ, AWQ,
    compressed-tensors) bring their own scheme. "int8-w8a8" (int8 weights per output channel,
    activations per token, int8 GEMMs; no float8 needed) and "fp8-block" (float8 weights with a
    scale per 128x128 block, activations per group of 128 inputs), and the weight-only
    "int8-w8a16-channel", "int8-w8a16-g128" (or "-g16") and "fp8-w8a16-channel" round 16-bit
    weights to nearest as they load; their pre-quantized checkpoints bring their own scheme. An
    FP4 checkpoint (NVFP4, MXFP4) converts to "fp8-dynamic" by default ("none", "fp8"), or to
    "fp8-block", "int8-w8a16-g16" (exact) or, MXFP4 only, "fp8-w8a16-channel" (exact)."""
    lm_head_quantization: str = _one_of("none", "fp8")
    """The LM head's weights: "none" (the model dtype) or "fp8" (float8 e4m3 per vocabulary row,
    activations per token: half the head's bytes, at a measured accuracy cost). A tied embedding
    keeps its own copy for the lookup. An engine built with `--lm-head-quantization fp8` loads with
    its float8 head whatever this says. Under TP it is cut by vocabulary rows, as the embedding
    is."""
    kv_cache_memory_gb: float | None = None
    """KV cache budget in GiB. None: 2 GiB on the CPU; on GPU, from gpu_memory_utilization."""
    gpu_memory_utilization: float = 0.9
    """Fraction of GPU memory kiln may use (weights + activations + KV cache)."""
    num_kv_blocks: int | None = None
    """Exact number of KV blocks, overriding the budget (tests use it to force preemption)."""
    enable_prefix_caching: bool = True
    """Reuse KV blocks of identical prompt prefixes (chained block hashes)."""
    scheduling_policy: str = _one_of("fcfs", "priority")
    """"fcfs" or "priority" (lower priority value is served first; ties by arrival)."""
    attention_backend: str = _one_of("auto", "torch", "triton")
    """The kernels everything runs on (attention, norms, linears, rotary, argmax; one choice, in
    kiln.kernels.ops): "auto" (triton on CUDA when it imports, else torch), "torch" (the
    pure-PyTorch reference) or "triton"."""
    seed: int = 0
    """Seed of the global RNG (rows without their own seed) and of dummy weights."""
    enforce_eager: bool = False
    """Disable CUDA graphs (GPU only)."""
    async_scheduling: bool | None = None
    """Schedule step N+1 while step N runs on the device (the host's Python overlaps the GPU).
    Outputs are the same either way; off, every step waits for its sampled ids first. None: on
    with CUDA, off on the CPU, where a step computes while it is submitted, so there is nothing to
    overlap and each step's tokens would only come out one step later (TTFT + one decode step)."""
    gc_gen0_threshold: int = 20_000
    """Python's cyclic-GC gen-0 threshold, set process-wide when the engine starts (0: leave
    Python's, 700). With 700, hundreds of running requests allocate enough per step for a full
    collection every ~30 steps, and a full collection walks every live token list: 60-120 ms
    host stalls that the GPU waited out at 1000/1000. TensorRT-LLM's executor raises it too."""
    num_threads: int | None = None
    """torch's intra-op CPU threads, set process-wide when the engine starts. None: on the CPU,
    the usable cores (affinity, cgroup quota) less the busy ones by the 1-minute load, at least
    one (kiln.runtime.cpu_threads; logged at start-up); on a GPU, torch's default. On a shared
    machine fewer can be much faster: with two busy cores, two threads collapsed batch-1 decode
    to 0.7 tok/s where one gave 2.5."""

    tensor_parallel_size: int = 1
    """Tensor-parallel ranks (vLLM's -tp): every layer's heads and MLP rows, the embedding and
    the LM head are cut over this many processes (one GPU each), which all-reduce twice per
    layer. With 1, one process as before. See docs/parallelism.md."""
    pipeline_parallel_size: int = 1
    """Pipeline stages (vLLM's -pp): the decoder layers split into this many consecutive groups,
    each on its own tensor_parallel_size ranks; hidden states pass from stage to stage. kiln
    starts the tensor_parallel_size x pipeline_parallel_size processes itself, or joins
    torchrun's (several machines: torchrun --nnodes ... --rdzv-endpoint ...)."""
    enable_expert_parallel: bool = False
    """Mixture-of-experts layers under tensor_parallel_size > 1 (vLLM's flag): each rank holds
    whole experts (num_experts / tensor_parallel_size, the first ranks one more when they do
    not divide) instead of a slice of every expert; attention and dense layers stay
    tensor-parallel, the router runs on every rank, and the experts' partial outputs are summed
    in the layer's one all-reduce. No effect on dense models or at tensor_parallel_size=1."""
    distributed_timeout_s: float = 300.0
    """Under TP/PP: how long a rank waits for the others (startup, a collective) before the
    engine stops with an error naming the rank, rather than hanging."""
    engine_kernel_cache: bool = True
    """Load the compiled Triton kernels an engine directory built on a GPU carries, when the GPU
    and Triton match, instead of compiling them: the first process starts seconds sooner. They
    are native code from the directory; off, kiln compiles its own as for a checkpoint."""
    speculative_config: _SpeculativeSpec | None = None
    """Speculative decoding, vLLM's dict: {"method": "ngram" | "draft_model",
    "num_speculative_tokens": K, "model": DRAFT, "prompt_lookup_min": N, "prompt_lookup_max": N,
    ...} (all keys: kiln.spec_decode.config.SpeculativeConfig; on the command line, JSON).
    None: off."""

    enable_lora: bool = False
    """Serve LoRA adapters (PEFT format) over the base model: requests name one with a
    LoRARequest (kiln.lora), requests of different adapters (and of none) run in the same
    step. The q/k/v/o and gate/up/down projections then run unfused from their norms (LoRA
    reads their unquantized input), whatever adapters are loaded."""
    max_loras: int = 4
    """With enable_lora: adapters a step may use at once (the device's slots); requests of
    other adapters wait until a slot's adapter has no running request (least recently used
    first)."""
    max_lora_rank: int = 16
    """With enable_lora: the largest adapter rank; the slots are sized for it."""
    max_cpu_loras: int | None = None
    """With enable_lora: adapters kept loaded in host memory; past it, adding one drops the
    least recently used adapter no request uses (a later request that names it by path loads
    it again). None: no limit."""

    def __post_init__(self) -> None:
        def fail(name: str, why: str) -> None:
            raise ConfigError(f"EngineConfig.{name} {why}, got {getattr(self, name)!r}")

        if self.max_num_seqs < 1:
            fail("max_num_seqs", "must be >= 1")
        if self.num_threads is not None and self.num_threads < 1:
            fail("num_threads", "must be >= 1")
        if self.gc_gen0_threshold < 0:
            fail("gc_gen0_threshold", "must be >= 0")
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            if getattr(self, name) < 1:
                fail(name, "must be >= 1")
        if self.distributed_timeout_s <= 0:
            fail("distributed_timeout_s", "must be > 0")
        if self.max_num_batched_tokens < 1:
            fail("max_num_batched_tokens", "must be >= 1")
        if self.block_size < 1:
            fail("block_size", "must be >= 1")
        for f in fields(self):
            choices = f.metadata.get("choices")
            if choices is not None and getattr(self, f.name) not in choices:
                fail(f.name, "must be one of " + ", ".join(f'"{c}"' for c in choices))
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            fail("device", 'must be "auto", "cpu" or "cuda[:N]"')
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            fail("gpu_memory_utilization", "must be in (0, 1]")
        if self.kv_cache_memory_gb is not None and self.kv_cache_memory_gb <= 0:
            fail("kv_cache_memory_gb", "must be > 0")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            fail("num_kv_blocks", "must be >= 1")
        if self.max_model_len is not None and self.max_model_len < 1:
            fail("max_model_len", "must be >= 1")
        if self.max_loras < 1:
            fail("max_loras", "must be >= 1")
        if self.max_lora_rank < 1:
            fail("max_lora_rank", "must be >= 1")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            fail("max_cpu_loras", f"must be >= max_loras ({self.max_loras})")
        if self.speculative_config is not None:
            from kiln.spec_decode.config import SpeculativeConfig  # pure Python, no cycle

            spec = SpeculativeConfig.from_dict(self.speculative_config)  # raises, naming the key
            if self.kv_cache_dtype == "int8" and spec.method in ("draft_model", "eagle3"):
                fail("kv_cache_dtype", f"int8 takes no {spec.method} drafts (no scales of theirs)")
        if self.kv_cache_dtype == "int8" and self.enable_lora:
            fail("kv_cache_dtype", "int8 takes no LoRA (adapters do not see per-head KV scales)")

    @property
    def speculative(self) -> SpeculativeConfig | None:
        """The parsed speculative_config (None: off)."""
        if self.speculative_config is None:
            return None
        from kiln.spec_decode.config import SpeculativeConfig

        return SpeculativeConfig.from_dict(self.speculative_config)

    @property
    def world_size(self) -> int:
        """Processes (one device each) the engine runs on: tensor x pipeline parallel ranks."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in fields(cls)}
