"""`kiln generate`: one prompt printed as it streams, or a file of prompts to JSONL."""

from __future__ import annotations

import argparse
import json
import os
import sys

from kiln.cli.engine_args import (
    add_engine_args,
    add_sampling_args,
    engine_config_from_args,
    sampling_params_from_args,
)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text for a prompt or a file of prompts")
    p.add_argument("prompt", nargs="?", help="the prompt (omit with --prompts-file)")
    p.add_argument("--prompts-file", help="one prompt per line; writes JSONL (one object a line)")
    p.add_argument("--output", "-o", help="JSONL output path (default: stdout)")
    p.add_argument(
        "--chat",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="apply the chat template (default: on when the model has one)",
    )
    p.add_argument(
        "--beam-width",
        type=int,
        default=None,
        help="beam search with this many beams (returns --n of them; sampling flags unused)",
    )
    p.add_argument("--length-penalty", type=float, default=1.0, help="beam search: as HF's")
    p.add_argument(
        "--lora",
        metavar="PATH",
        help="a PEFT LoRA adapter directory to generate with (turns on --enable-lora)",
    )
    add_engine_args(p)
    add_sampling_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if (args.prompt is None) == (args.prompts_file is None):
        print("error: give a prompt or --prompts-file (not both)", file=sys.stderr)
        return 2
    params = sampling_params_from_args(args)
    if args.beam_width is not None:
        from dataclasses import replace

        from kiln.errors import InvalidRequestError

        try:
            params = replace(
                params,
                use_beam_search=True,
                best_of=args.beam_width,
                length_penalty=args.length_penalty,
            )
        except InvalidRequestError as exc:
            print(f"error: --beam-width: {exc}", file=sys.stderr)
            return 2
    from dataclasses import replace

    from kiln.llm import LLM
    from kiln.lora.request import LoRARequest

    config = engine_config_from_args(args)
    lora = None
    if args.lora is not None:
        config = replace(config, enable_lora=True)
        name = os.path.basename(os.path.normpath(args.lora)) or "lora"
        lora = LoRARequest(name, 1, args.lora)
    llm = LLM(**vars(config))
    if lora is not None:
        llm.engine.add_lora(lora)  # a bad adapter fails here, before any output
    tokenizer = llm.get_tokenizer()
    use_chat = args.chat
    if use_chat is None:
        use_chat = bool(tokenizer is not None and getattr(tokenizer, "chat_template", None))

    def conversation(text: str) -> list[dict[str, str]]:
        return [{"role": "user", "content": text}]

    if args.prompt is not None:
        if params.n == 1 and not params.use_beam_search:
            prompt = conversation(args.prompt) if use_chat else args.prompt
            for piece in llm.stream(prompt, params, lora_request=lora):
                print(piece, end="", flush=True)
            print()
            return 0
        outputs = (
            llm.chat(conversation(args.prompt), params, lora_request=lora)
            if use_chat
            else llm.generate(args.prompt, params, lora_request=lora)
        )
        for completion in outputs[0].outputs:
            print(f"[{completion.index}] {completion.text}")
        return 0

    with open(args.prompts_file, encoding="utf-8") as f:
        prompts = [line.rstrip("\n") for line in f if line.strip()]
    if use_chat:
        outputs = llm.chat(
            [conversation(p) for p in prompts], params, use_tqdm=True, lora_request=lora
        )
    else:
        outputs = llm.generate(prompts, params, use_tqdm=True, lora_request=lora)
    with open(args.output or os.devnull, "w", encoding="utf-8") as file:
        sink = file if args.output else sys.stdout
        for prompt, out in zip(prompts, outputs):
            record = {
                "prompt": prompt,
                "outputs": [
                    {
                        "text": c.text,
                        "token_ids": c.token_ids,
                        "finish_reason": c.finish_reason,
                    }
                    for c in out.outputs
                ],
                "num_prompt_tokens": len(out.prompt_token_ids),
            }
            sink.write(json.dumps(record, ensure_ascii=False) + "\n")
    return 0
