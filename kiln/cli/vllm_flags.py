"""vLLM's spellings of kiln's engine flags, so a vLLM command line runs unmodified.

Each vLLM flag is either an alias of something kiln has (accepted, same meaning), or refused with
a one-line "not supported: ..." naming what kiln lacks — never accepted and silently ignored.
"""

from __future__ import annotations

import argparse

from kiln.errors import KilnError

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
    if args.chat_template is not None:
        raise UnsupportedFlagError(
            "not supported: --chat-template (kiln uses the model's own chat template)"
        )
