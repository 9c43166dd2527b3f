"""vLLM's spellings of kiln's engine flags, so a vLLM command line runs unmodified.

Each vLLM flag is either an alias of something kiln has (accepted, same meaning), or refused with
a one-line "not supported: ..." naming what kiln lacks — never accepted and silently ignored.
"""

from __future__ import annotations

import argparse
import logging
import math
import os

import kiln
from kiln.errors import KilnError

logger = logging.getLogger(__name__)

# vLLM's --dtype names -> kiln's.
DTYPE_ALIASES = {"half": "float16", "float": "float32", "bf16": "bfloat16", "fp16": "float16"}


class UnsupportedFlagError(KilnError):
    """A vLLM flag whose feature kiln does not have."""


def add_vllm_engine_flags(g: argparse._ArgumentGroup) -> None:
    g.add_argument(
        "--enable-chunked-prefill",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="vLLM's flag: kiln always chunks long prompts to the step budget "
        "(--max-num-batched-tokens); turning it off is not supported",
    )
    g.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="vLLM's flag, accepted: kiln never runs code shipped with a checkpoint, so it "
        "changes nothing",
    )
    g.add_argument(
        "--tokenizer", default=None, help="vLLM's flag; only the model's own tokenizer is supported"
    )


def check_vllm_engine_flags(args: argparse.Namespace) -> None:
    """Refuse what kiln does not have, naming it; normalise vLLM's dtype names."""
    if not args.enable_chunked_prefill:
        raise UnsupportedFlagError(
            "not supported: --no-enable-chunked-prefill (kiln always chunks prompts longer "
            "than --max-num-batched-tokens)"
        )
    if args.tokenizer is not None and args.tokenizer != args.model:
        raise UnsupportedFlagError(
            f"not supported: --tokenizer {args.tokenizer} (kiln uses the model's own tokenizer)"
        )
    args.dtype = DTYPE_ALIASES.get(args.dtype, args.dtype)


def add_vllm_serve_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--enable-log-requests",
        action="store_true",
        help="log every HTTP request (uvicorn's access log; off by default: one line per "
        "request costs the event loop under load)",
    )
    p.add_argument(
        "--disable-log-requests",
        "--disable-uvicorn-access-log",
        dest="enable_log_requests",
        action="store_false",
        help="vLLM's names: no per-request log lines (kiln's default)",
    )
    p.add_argument(
        "--generation-config",
        default="auto",
        help="vLLM's flag; \"auto\" (the model's generation_config.json, kiln's behaviour) only",
    )
    p.add_argument(
        "--max-logprobs",
        type=int,
        default=20,
        help="vLLM's flag; kiln's limit is OpenAI's 20 (no other value is supported)",
    )
    p.add_argument(
        "--chat-template",
        default=None,
        help="vLLM's flag; not supported yet (the model's own template is used)",
    )
    p.add_argument("--version", action="version", version=f"kiln {kiln.__version__}")
    p.add_argument(
        "--swap-space",
        type=float,
        default=None,
        metavar="GIB",
        help="vLLM's flag, accepted: kiln preempts by recomputing (as vLLM V1 does), so it keeps "
        "no CPU swap; a warning says so",
    )
    p.add_argument(
        "--download-dir",
        default=None,
        help="vLLM's flag: where a hub model is downloaded (sets HF_HUB_CACHE)",
    )
    p.add_argument(
        "--guided-decoding-backend",
        default="auto",
        help="vLLM's flag: kiln's structured output runs on xgrammar (auto or xgrammar only)",
    )
    p.add_argument(
        "--lora-modules",
        nargs="+",
        default=None,
        metavar="NAME=PATH",
        help="LoRA adapters (PEFT directories) served from the start, each as name=path or "
        'vLLM\'s JSON \'{"name": ..., "path": ..., "base_model_name": ...}\'; a request\'s '
        "model names one (needs --enable-lora)",
    )
    p.add_argument(
        "--lora-dtype",
        default="auto",
        help="vLLM's flag; \"auto\" only (adapters run in the model's dtype)",
    )
    for flag, why in _REFUSED_SERVE_FLAGS.items():
        p.add_argument(flag, default=None, help=f"vLLM's flag; not supported ({why})")


# vLLM serve flags whose feature kiln lacks: parsed, so that the refusal names them and why.
_REFUSED_SERVE_FLAGS = {
    "--revision": "kiln downloads a hub model's default branch; give a local directory",
    "--tokenizer-revision": "kiln uses the model's own tokenizer",
    "--code-revision": "kiln never runs code shipped with a checkpoint",
    "--limit-mm-per-prompt": "kiln serves no multimodal models",
    "--task": "kiln serves generation only",
}


def check_vllm_serve_flags(args: argparse.Namespace) -> None:
    """The positional model (`kiln serve MODEL`), and refusals of what kiln lacks."""
    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            raise UnsupportedFlagError(
                f"two models given: {args.model_tag!r} and --model {args.model!r}"
            )
        args.model = args.model_tag
    if args.generation_config != "auto":
        raise UnsupportedFlagError(
            f"not supported: --generation-config {args.generation_config} (kiln reads the "
            'model\'s generation_config.json: only "auto")'
        )
    if args.max_logprobs != 20:
        raise UnsupportedFlagError(
            f"not supported: --max-logprobs {args.max_logprobs} (kiln's limit is 20)"
        )
    if args.lora_dtype != "auto":
        raise UnsupportedFlagError(
            f"not supported: --lora-dtype {args.lora_dtype} (adapters run in the model's dtype)"
        )
    if args.chat_template is not None:
        raise UnsupportedFlagError(
            "not supported: --chat-template (kiln uses the model's own chat template)"
        )
    for flag, why in _REFUSED_SERVE_FLAGS.items():
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None:
            raise UnsupportedFlagError(f"not supported: {flag} {value} ({why})")
    if args.guided_decoding_backend not in ("auto", "xgrammar"):
        raise UnsupportedFlagError(
            f"not supported: --guided-decoding-backend {args.guided_decoding_backend} (kiln's "
            "structured output runs on xgrammar)"
        )
    if args.swap_space is not None:
        logger.warning(
            "--swap-space %s has no effect: kiln preempts by recomputing (as vLLM V1 does), "
            "keeping no CPU swap",
            args.swap_space,
        )
    if args.download_dir is not None:  # read by huggingface_hub in the engine process too
        os.environ["HF_HUB_CACHE"] = os.path.abspath(os.path.expanduser(args.download_dir))


def add_vllm_bench_flags(p: argparse.ArgumentParser, mode: str) -> None:
    """`vllm bench MODE`'s flags, so its command line runs as `kiln bench MODE`."""
    g = p.add_argument_group("vLLM's benchmark flags")
    g.add_argument(
        "--dataset-path",
        default=None,
        help="with --dataset-name sharegpt: vLLM's ShareGPT JSON file (the first human turn is "
        "the prompt, the reply's token count the output length)",
    )
    g.add_argument(
        "--sharegpt-output-len",
        type=int,
        default=None,
        help="with sharegpt: every request's output length (default: the reply's)",
    )
    g.add_argument(
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="random lengths drawn from [LEN*(1-R), LEN*(1+R)] (vLLM's; kiln's LOW:HIGH too)",
    )
    g.add_argument(
        "--ignore-eos",
        action="store_true",
        help="accepted: kiln's benchmark requests always ignore EOS (their lengths are the "
        "workload's)",
    )
    if mode == "serve":
        g.add_argument("--model", default=None, help="vLLM's flag: the model whose tokenizer "
                       "a sharegpt dataset needs (default: kiln's; requests name the server's "
                       "model as /v1/models does)")  # fmt: skip
        g.add_argument("--tokenizer", default=None, help="for sharegpt (default: --model)")
        g.add_argument("--host", default=None, help="with --port: the server (--base-url)")
        g.add_argument("--port", type=int, default=None)
        g.add_argument(
            "--endpoint",
            default="/v1/completions",
            help="only /v1/completions (what kiln bench sends)",
        )
        g.add_argument(
            "--percentile-metrics",
            default="ttft,tpot,itl",
            help="accepted: kiln reports ttft, tpot, itl and e2el always",
        )
        g.add_argument(
            "--metric-percentiles",
            default="99",
            help="accepted: kiln reports p50, p90 and p99 always",
        )
        g.add_argument(
            "--burstiness",
            type=float,
            default=1.0,
            help="arrivals' gamma shape at --request-rate (1: Poisson; lower: burstier)",
        )
    if mode == "latency":
        g.add_argument("--num-iters", type=int, default=None, help="= --num-requests")
        g.add_argument("--num-iters-warmup", type=int, default=None, help="= --warmup")
        g.add_argument(
            "--batch-size",
            type=int,
            default=1,
            help="1 only: kiln's latency runs one request at a time (kiln bench throughput "
            "--concurrency N measures N at once)",
        )


_PERCENTILE_METRICS = ("ttft", "tpot", "itl", "e2el")
_PERCENTILES = ("50", "90", "99")


def resolve_vllm_bench_flags(args: argparse.Namespace) -> None:
    """vLLM's benchmark flags onto kiln's, refusing what kiln cannot honour in one line."""
    if args.dataset_name not in ("random", "sharegpt"):
        raise UnsupportedFlagError(
            f"not supported: --dataset-name {args.dataset_name} (kiln bench has 'random', "
            "synthetic token ids of --input-len/--output-len, and 'sharegpt' with --dataset-path)"
        )
    if (args.dataset_name == "sharegpt") != (args.dataset_path is not None):
        raise UnsupportedFlagError("--dataset-name sharegpt and --dataset-path go together")
    ratio = args.random_range_ratio
    if not 0 <= ratio < 1:
        raise UnsupportedFlagError(f"--random-range-ratio must be in [0, 1), got {ratio}")
    if ratio:
        args.input_len, args.output_len = (
            _ranged(spec, ratio, flag)
            for spec, flag in ((args.input_len, "--input-len"), (args.output_len, "--output-len"))
        )
    if args.mode == "serve":
        _resolve_serve_target(args)
    if args.mode == "latency":
        if args.batch_size != 1:
            raise UnsupportedFlagError(
                f"not supported: --batch-size {args.batch_size} (kiln bench latency runs one "
                "request at a time; kiln bench throughput --concurrency N measures N at once)"
            )
        if args.num_iters is not None:
            args.num_requests = args.num_iters
        if args.num_iters_warmup is not None:
            args.warmup = args.num_iters_warmup


def _ranged(spec: str, ratio: float, flag: str) -> str:
    """vLLM's random lengths: uniform over [floor(N * (1 - R)), ceil(N * (1 + R))]."""
    if not spec.isdigit():
        raise UnsupportedFlagError(f"--random-range-ratio needs a single {flag}, got {spec}")
    n = int(spec)
    return f"{max(1, math.floor(n * (1 - ratio)))}:{math.ceil(n * (1 + ratio))}"


def _resolve_serve_target(args: argparse.Namespace) -> None:
    if args.endpoint != "/v1/completions":
        raise UnsupportedFlagError(
            f"not supported: --endpoint {args.endpoint} (kiln bench serve sends /v1/completions)"
        )
    unknown = set(args.percentile_metrics.split(",")) - set(_PERCENTILE_METRICS)
    if unknown:
        raise UnsupportedFlagError(
            f"not supported: --percentile-metrics {','.join(sorted(unknown))} (kiln reports "
            f"{', '.join(_PERCENTILE_METRICS)})"
        )
    wanted = {p.strip().removesuffix(".0") for p in args.metric_percentiles.split(",")}
    if wanted - set(_PERCENTILES):
        raise UnsupportedFlagError(
            f"not supported: --metric-percentiles {args.metric_percentiles} (kiln reports p50, "
            "p90 and p99)"
        )
    if args.burstiness <= 0:
        raise UnsupportedFlagError(f"--burstiness must be > 0, got {args.burstiness}")
    if args.host is not None or args.port is not None:
        if args.base_url is not None:
            raise UnsupportedFlagError("give --base-url or --host/--port, not both")
        args.base_url = f"http://{args.host or '127.0.0.1'}:{args.port or 8000}"
    args.base_url = args.base_url or DEFAULT_BASE_URL


DEFAULT_BASE_URL = "http://127.0.0.1:8000"
