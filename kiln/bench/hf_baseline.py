"""The baseline a user has before adopting an engine: Hugging Face transformers `generate`,
on the same requests, in the same process."""

from __future__ import annotations

import os
import time

import torch
from tqdm.auto import tqdm

from kiln.bench.metrics import RequestTiming
from kiln.bench.workload import BenchRequest


def load_hf_model(model_path: str, dtype: torch.dtype, device: torch.device):
    """The same checkpoint through transformers (a GGUF file is dequantized by transformers)."""
    import os

    from transformers import AutoConfig, AutoModelForCausalLM

    from kiln.checkpoint.engine_dir import is_engine_dir, read_manifest
    from kiln.models.config import PRESETS

    if model_path in PRESETS:  # dummy weights of a preset shape, drawn like kiln's
        config = AutoConfig.for_model(**_preset_kwargs(PRESETS[model_path]))
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() == 1:
                    p.fill_(1.0)
                else:
                    p.normal_(0.0, 0.02)
        return model.eval()
    if os.path.isdir(model_path) and is_engine_dir(model_path):
        # transformers cannot read kiln's fused tensors: the baseline runs the engine's source.
        model_path = _engine_source(model_path, read_manifest(model_path)["source"])
    if model_path.endswith(".gguf"):
        model = AutoModelForCausalLM.from_pretrained(
            os.path.dirname(model_path), gguf_file=os.path.basename(model_path), dtype=dtype
        )
    else:
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
    # transformers' decorator on `to` types its bound method as taking the model itself.
    return model.to(device).eval()  # type: ignore[arg-type]


def _preset_kwargs(preset: dict) -> dict:
    kwargs = dict(preset)
    kwargs.pop("architectures", None)
    return kwargs


@torch.inference_mode()
def run_hf(
    model,
    requests: list[BenchRequest],
    batch_size: int,
    progress: bool = True,
) -> list[RequestTiming]:
    """Static batches of `batch_size` in submission order, left-padded, each run until its
    longest output is done (that is how `generate` batches). Only the tokens each request asked
    for are counted; a request's tokens are timed when its batch finishes, since `generate`
    returns them all at once. All requests count as submitted at t=0."""
    device = next(model.parameters()).device
    model.generation_config.eos_token_id = None  # EOS ignored, as in kiln's run
    pad_id = 0
    start = time.perf_counter()
    timings: list[RequestTiming] = []
    for b in tqdm(range(0, len(requests), batch_size), desc="hf", disable=not progress):
        batch = requests[b : b + batch_size]
        longest = max(len(r.prompt_token_ids) for r in batch)
        input_ids = torch.full((len(batch), longest), pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), longest), dtype=torch.long)
        for i, r in enumerate(batch):
            n = len(r.prompt_token_ids)
            input_ids[i, longest - n :] = torch.tensor(r.prompt_token_ids)
            mask[i, longest - n :] = 1
        model.generate(
            input_ids.to(device),
            attention_mask=mask.to(device),
            max_new_tokens=max(r.output_len for r in batch),
            do_sample=False,
            pad_token_id=pad_id,
        )
        if device.type == "cuda":
            torch.cuda.synchronize()
        done = time.perf_counter()
        for r in batch:
            timings.append(RequestTiming(start, [done] * r.output_len, len(r.prompt_token_ids)))
    return timings


@torch.inference_mode()
def hf_decode_rate(model, prompt_ids: list[int], new_tokens: int) -> dict[str, float]:
    """Single-stream decode tok/s after prefill: (N - 1) / (t(N tokens) - t(1 token)), and TTFT."""
    device = next(model.parameters()).device
    model.generation_config.eos_token_id = None
    ids = torch.tensor([prompt_ids], device=device)

    def timed(n: int) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    timed(2)  # warm-up
    t_first = min(timed(1) for _ in range(2))
    t_all = timed(new_tokens)
    return {
        "ttft_ms": t_first * 1000,
        "decode_tok_s": (new_tokens - 1) / (t_all - t_first),
        "e2e_s": t_all,
    }


def _engine_source(engine: str, recorded: str) -> str:
    """The source an engine was built from: its manifest names it (an older kiln wrote the
    build machine's path); the default model is found by its name."""
    from kiln.checkpoint.default_model import default_model_path
    from kiln.errors import KilnError

    if os.path.exists(recorded):
        return recorded
    default = default_model_path()
    if os.path.basename(default) == os.path.basename(recorded):
        return default
    raise KilnError(
        f"the HF baseline runs an engine's source, and {engine} was built from {recorded!r}, "
        "which is not here: give that checkpoint as --model"
    )
