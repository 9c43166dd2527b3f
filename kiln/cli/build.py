"""`kiln build`: an HF directory (pre-quantized FP8, INT4 and 8-bit ones too) or GGUF file -> an
engine directory (see kiln.builder)."""

from __future__ import annotations

import argparse
import re

# kiln.builder.options.QUANTIZATIONS, spelled out: importing the builder here would import torch
# for every verb's --help (tests/cli/test_cli_args.py checks that the two agree).
_QUANTIZATIONS = ("auto", "none", "fp8", "fp8-dynamic", "int8-w8a8", "fp8-block",
                  "int8-w8a16-channel", "int8-w8a16-g128", "int8-w8a16-g16", "fp8-w8a16-channel",
                  "int4-gptq", "int4-awq")  # fmt: skip
_KV_CACHE_DTYPES = ("auto", "fp8", "int8")  # kiln.builder.options.KV_CACHE_DTYPES
# kiln.builder.options.CHECKPOINT_SCHEMES: a pre-quantized checkpoint's own scheme, named.
_CHECKPOINT_SCHEMES = re.compile(r"int4-(g\d+|channel)(-sym)?|(int8|fp8)-w8a16-(g\d+|channel)")


class _Quantizations(tuple):
    """The choices --help lists, and a pre-quantized checkpoint's own scheme ("int4-g64")."""

    def __contains__(self, name: object) -> bool:
        named = isinstance(name, str) and _CHECKPOINT_SCHEMES.fullmatch(name) is not None
        return named or tuple.__contains__(self, name)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("build", help="build an engine directory from a checkpoint")
    p.add_argument(
        "model", nargs="?", default=None, help="HF directory or .gguf (default: SmolLM2)"
    )
    p.add_argument("-o", "--output", default=None, help="engine directory (default: in the cache)")
    p.add_argument(
        "--quantization", choices=_Quantizations(_QUANTIZATIONS),
        default="auto", help="auto: a pre-quantized (FP8, INT4, 8-bit) checkpoint's own scheme "
        "(carried as written; naming it, e.g. int4-g128, is the same), an FP4 checkpoint's FP8 "
        "conversion, else none; int8-w8a8: int8 weights per "
        "channel, activations per token; *-w8a16-*: weight-only; int4-gptq / int4-awq: W4A16 "
        "groups of 128 rounded by GPTQ or AWQ on the calibration text",
    )  # fmt: skip
    p.add_argument(
        "--kv-cache-dtype", choices=_KV_CACHE_DTYPES, default="auto",
        help="fp8: per-layer scales calibrated on the calibration text; int8: per-(layer, KV "
        "head) scales calibrated there, for GPUs without float8",
    )  # fmt: skip
    p.add_argument(
        "--weight-rounding", choices=("nearest", "gptq", "gptq-sequential"), default="nearest",
        help="gptq: float8 weights rounded by GPTQ on the calibration text (slower build); "
        "gptq-sequential: layer after layer, from the float8 model's own inputs",
    )  # fmt: skip
    p.add_argument(
        "--smoothing", default="none", metavar="none|smoothquant[:ALPHA]",
        help="smoothquant: FP8 inputs' outlier channels moved into the weights (SmoothQuant, "
        "folded into the ops before; default alpha 0.7 for fp8-dynamic, 0.3 for fp8, 0.5 for "
        "int8-w8a8); none",
    )  # fmt: skip
    p.add_argument(
        "--unquantized-layers", default="", metavar="PATTERN[,PATTERN]",
        help="decoder projections kept in the model dtype, fnmatch over names like "
        "layers.3.mlp.gate_up_proj (an ignore list: their accuracy for their speed)",
    )  # fmt: skip
    p.add_argument(
        "--outlier-columns", type=int, default=0, metavar="N",
        help="carry each FP8 projection's N loudest input channels (a multiple of 16) as a "
        "second float8 term: static fp8 near per-token accuracy for K + N GEMM columns (an 8B "
        "engine on an H200: ~2%% slower at high throughput, more at batch 1)",
    )  # fmt: skip
    p.add_argument(
        "--lm-head-quantization", choices=("none", "fp8"), default="none",
        help="fp8: the LM head in float8 with per-row scales (half its bytes; see docs)",
    )  # fmt: skip
    p.add_argument(
        "--dtype", choices=("auto", "float32", "float16", "bfloat16"), default="auto",
        help="unquantized weights' dtype (auto: float32 on the CPU, bfloat16 on CUDA)",
    )  # fmt: skip
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--calibration-data", default=None, help="text file for static fp8 scales")
    p.add_argument(
        "--max-ppl-increase", type=float, default=None, metavar="PCT",
        help="most word-perplexity increase over the source, percent (default: 1 for models "
        "of 1B parameters and more, 5 below: small models move more under float8)",
    )  # fmt: skip
    p.add_argument("--no-accuracy-check", dest="accuracy_check", action="store_false")
    p.add_argument(
        "--accept", action="store_true",
        help="publish the engine even if it fails the accuracy check (one a failed build kept "
        "as OUTPUT.rejected is taken as it is, not rebuilt); its manifest records the numbers",
    )  # fmt: skip
    p.add_argument(
        "--no-warm-kernels", dest="warm_kernels", action="store_false",
        help="on a GPU, do not run the engine once to carry its compiled Triton kernels",
    )  # fmt: skip
    p.add_argument(
        "--tensor-parallel-size", "-tp", type=int, default=1,
        help="write one weight shard per tensor rank (the engine then loads at this -tp only)",
    )  # fmt: skip
    p.add_argument(
        "--cache-dir", default=None,
        help="engine cache (default with no -o: $XDG_CACHE_HOME/kiln/engines or ~/.cache/...)",
    )  # fmt: skip
    p.add_argument(
        "--lora", default=None, metavar="PATH",
        help="merge this PEFT LoRA adapter into the weights first (W += scaling * B @ A): the "
        "engine is the fine-tuned model, checked against it",
    )  # fmt: skip
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kiln.builder.build import BuildOptions, build_engine
    from kiln.builder.cache import default_cache_dir
    from kiln.builder.tiles import describe as describe_tiles

    options = BuildOptions(
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        calibration_data=args.calibration_data,
        max_ppl_increase=args.max_ppl_increase,
        accuracy_check=args.accuracy_check,
        tensor_parallel_size=args.tensor_parallel_size,
        warm_kernels=args.warm_kernels,
        weight_rounding=args.weight_rounding,
        smoothing=args.smoothing,
        unquantized_layers=tuple(p for p in args.unquantized_layers.split(",") if p),
        lm_head_quantization=args.lm_head_quantization,
        outlier_columns=args.outlier_columns,
        lora=args.lora,
    )
    manifest = build_engine(args.model, args.output, options, args.cache_dir, accept=args.accept)
    where = args.output or f"{args.cache_dir or default_cache_dir()}/{manifest.engine_id}"
    print(describe_tiles(manifest.kernel_tiles, manifest.kernel_tiles_reason))
    print(f"engine {manifest.engine_id}: {where}")
    return 0
