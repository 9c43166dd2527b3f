"""Build time and time to first token from a cold process, for a preset's shape.

Writes an HF-format checkpoint of the preset with dummy weights (normal, std 0.02; norms at 1, as
`load_format="dummy"` draws them) and no tokenizer, then, each in its own fresh process:
  1. `kiln build SRC -o ENGINE --quantization Q --no-accuracy-check` (random weights have no
     perplexity worth checking), wall time of the whole command;
  2. first token from the engine directory: process start to the first generated token of a
     `prompt_len`-token prompt (`LLM(ENGINE).generate`, token ids, max_tokens=1), and the same
     from the HF source directory (unquantized, fused at load) for comparison.
Every "first process" gets an empty Triton cache of its own (TRITON_CACHE_DIR), as on a fresh
machine (a GPU-built engine carries its compiled kernels); its "again" run reuses that cache (a
second process). With --base-tree the same engine is loaded by an older kiln checkout too
(PYTHONPATH), the before of one run.

    python3 benchmarks/build_and_first_token.py --preset llama-3.1-8b --work /tmp/w \\
        --output-json F [--base-tree DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

import torch
from safetensors.torch import save_file

from kiln.models.config import PRESETS

_FIRST_TOKEN = r"""
import json, sys, time
t0 = float(sys.argv[2])
t_python = time.time()
from kiln import LLM, SamplingParams
t_imported = time.time()
# The engine's own max_model_len, as `kiln build`'s kernel warm-up runs it: the block table's
# width is a kernel argument whose divisibility Triton specialises on.
llm = LLM(sys.argv[1], enforce_eager=sys.argv[4] == "eager")
t_loaded = time.time()
out = llm.generate(
    [{"prompt_token_ids": list(range(100, 100 + int(sys.argv[3])))}],
    SamplingParams(max_tokens=1, temperature=0),
)
print("RESULT", time.time() - t0, t_loaded - t0, len(out[0].outputs[0].token_ids))
phases = {"python_start_s": t_python - t0, "import_kiln_s": t_imported - t_python,
          "llm_init_s": t_loaded - t_imported}
print("PHASES", json.dumps(phases))
"""


def write_dummy_checkpoint(preset: str, path: str, device: str) -> float:
    """HF Llama tensor names, one safetensors file per layer (as large checkpoints shard)."""
    t0 = time.time()
    os.makedirs(path, exist_ok=True)
    hf = dict(PRESETS[preset])
    hf.setdefault("torch_dtype", "bfloat16")
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf, f)
    hidden, inter = hf["hidden_size"], hf["intermediate_size"]
    heads, kv_heads = hf["num_attention_heads"], hf["num_key_value_heads"]
    head_dim = hf.get("head_dim") or hidden // heads
    gen = torch.Generator(device=device).manual_seed(0)

    def draw(*shape: int) -> torch.Tensor:
        t = torch.empty(shape, device=device, dtype=torch.bfloat16)
        return t.normal_(0.0, 0.02, generator=gen).cpu()

    index: dict[str, str] = {}

    def save(tensors: dict[str, torch.Tensor], name: str) -> None:
        save_file(tensors, os.path.join(path, name), metadata={"format": "pt"})
        index.update(dict.fromkeys(tensors, name))

    vocab = hf["vocab_size"]
    save(
        {
            "model.embed_tokens.weight": draw(vocab, hidden),
            "lm_head.weight": draw(vocab, hidden),
            "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16),
        },
        "model-embed.safetensors",
    )
    for i in range(hf["num_hidden_layers"]):
        p = f"model.layers.{i}."
        save(
            {
                p + "self_attn.q_proj.weight": draw(heads * head_dim, hidden),
                p + "self_attn.k_proj.weight": draw(kv_heads * head_dim, hidden),
                p + "self_attn.v_proj.weight": draw(kv_heads * head_dim, hidden),
                p + "self_attn.o_proj.weight": draw(hidden, heads * head_dim),
                p + "mlp.gate_proj.weight": draw(inter, hidden),
                p + "mlp.up_proj.weight": draw(inter, hidden),
                p + "mlp.down_proj.weight": draw(hidden, inter),
                p + "input_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
                p + "post_attention_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
            },
            f"model-layer{i:03d}.safetensors",
        )
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": index}, f)
    return time.time() - t0


def first_token(
    model: str, prompt_len: int, eager: bool = False, env: dict[str, str] | None = None
) -> dict[str, object]:
    t0 = time.time()
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            _FIRST_TOKEN,
            model,
            repr(t0),
            str(prompt_len),
            "eager" if eager else "graphs",
        ],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, **(env or {})},
        # `python -c` puts the working directory first on sys.path, before PYTHONPATH: another
        # tree's kiln must be run from inside it.
        cwd=(env or {}).get("PYTHONPATH"),
    )
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")), None)
    if proc.returncode or line is None:
        raise RuntimeError(f"first-token run of {model} failed:\n{proc.stderr[-3000:]}")
    _, total, loaded, _ = line.split()
    phases = next((ln for ln in proc.stdout.splitlines() if ln.startswith("PHASES ")), None)
    return {
        "process_start_to_first_token_s": float(total),
        "process_start_to_loaded_s": float(loaded),
        "phases": json.loads(phases.removeprefix("PHASES ")) if phases else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="llama-3.1-8b")
    ap.add_argument("--work", required=True, help="scratch folder for the checkpoint and engine")
    ap.add_argument("--quantization", default="fp8-dynamic")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-json", required=True)
    ap.add_argument("--base-tree", help="an older kiln checkout: its first and second process")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    src = os.path.join(args.work, "source")
    engine = os.path.join(args.work, "engine")
    result: dict[str, object] = {"preset": args.preset, "quantization": args.quantization}
    result["write_checkpoint_s"] = write_dummy_checkpoint(args.preset, src, device)
    result["checkpoint_bytes"] = sum(os.path.getsize(os.path.join(src, f)) for f in os.listdir(src))
    t0 = time.time()
    build = subprocess.run(
        [sys.executable, "-m", "kiln.cli.main", "build", src, "-o", engine,
         "--quantization", args.quantization, "--no-accuracy-check"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    result["build_s"] = time.time() - t0
    result["build_exit"] = build.returncode
    result["build_stdout_tail"] = build.stdout[-2000:]
    if build.returncode:
        result["build_stderr_tail"] = build.stderr[-3000:]
    else:
        result["engine_bytes"] = sum(
            os.path.getsize(os.path.join(engine, f)) for f in os.listdir(engine)
        )
        caches = os.path.join(args.work, "triton-caches")
        shutil.rmtree(caches, ignore_errors=True)

        def cache(name: str) -> dict[str, str]:
            return {"TRITON_CACHE_DIR": os.path.join(caches, name)}

        if args.base_tree:  # before: the older loader, compiling every kernel itself
            base = {**cache("base"), "PYTHONPATH": os.path.abspath(args.base_tree)}
            result["base_first_token_from_engine"] = first_token(engine, args.prompt_len, env=base)
            result["base_first_token_from_engine_again"] = first_token(
                engine, args.prompt_len, env=base
            )
        result["first_token_from_engine"] = first_token(engine, args.prompt_len, env=cache("on"))
        # A second cold process: the page cache now holds the engine's files either way.
        result["first_token_from_engine_again"] = first_token(
            engine, args.prompt_len, env=cache("on")
        )
        # Without CUDA graphs: what startup costs besides capturing them.
        result["first_token_from_engine_eager"] = first_token(
            engine, args.prompt_len, eager=True, env=cache("on")
        )
        kernels = os.path.join(engine, "triton_cache")
        result["engine_kernel_files"] = sum(len(f) for _, _, f in os.walk(kernels))
    result["first_token_from_source_bf16"] = first_token(src, args.prompt_len)
    with open(args.output_json, "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
