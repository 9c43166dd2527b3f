"""An HF Llama checkpoint rotated as QuaRot / SpinQuant do, without changing its function (in
exact arithmetic): each RMSNorm's weight folded into the projections after it, the residual
stream turned by one random orthogonal Q (embeddings, every projection reading or writing it,
an untied LM head), and each attention head's values by a random orthogonal H (folded into
v_proj's rows and o_proj's columns). What changes is what the projections' inputs look like:
a few massive channels spread over all of them, so a static per-tensor FP8 scale (set by the
largest value) leaves quiet tokens more of e4m3's range.

    python rotate.py SOURCE_DIR OUT_DIR [--seed S] [--no-heads]

down_proj's input (the SiLU-mul's output) is not rotated: that needs a Hadamard transform at run
time (QuaRot's online one), not a weight fold.
"""

from __future__ import annotations

import argparse
import json
import shutil

import torch
from safetensors.torch import load_file, save_file


def random_orthogonal(n: int, gen: torch.Generator) -> torch.Tensor:
    q, r = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=torch.float64))
    return q * torch.sign(torch.diagonal(r))  # Haar-distributed


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("source")
    p.add_argument("out")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-heads", action="store_true", help="leave the values' heads unrotated")
    args = p.parse_args()
    cfg = json.load(open(f"{args.source}/config.json"))
    t = {k: v.double() for k, v in load_file(f"{args.source}/model.safetensors").items()}
    gen = torch.Generator().manual_seed(args.seed)
    d, hd = cfg["hidden_size"], cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    q = random_orthogonal(d, gen)
    h = torch.eye(hd, dtype=torch.float64) if args.no_heads else random_orthogonal(hd, gen)
    out: dict[str, torch.Tensor] = {}
    emb = t["model.embed_tokens.weight"]
    head = t.get("lm_head.weight", emb)
    out["model.embed_tokens.weight"] = emb @ q  # rows are residual vectors
    out["lm_head.weight"] = (head * t["model.norm.weight"]) @ q  # y = x' (W diag(g) Q)^T
    out["model.norm.weight"] = torch.ones(d, dtype=torch.float64)
    for i in range(cfg["num_hidden_layers"]):
        pre = f"model.layers.{i}."
        g_attn, g_mlp = t[pre + "input_layernorm.weight"], t[pre + "post_attention_layernorm.weight"]
        for name in ("q_proj", "k_proj", "v_proj"):
            out[pre + f"self_attn.{name}.weight"] = (t[pre + f"self_attn.{name}.weight"] * g_attn) @ q
        # Values per head: v_h' = v_h H (rows of v_proj turned), o_proj's columns by the same H.
        v = out[pre + "self_attn.v_proj.weight"]
        kv_heads = v.shape[0] // hd
        out[pre + "self_attn.v_proj.weight"] = torch.einsum(
            "ji,kjd->kid", h, v.view(kv_heads, hd, d)
        ).reshape(kv_heads * hd, d)
        o = t[pre + "self_attn.o_proj.weight"]  # [d, heads * hd]
        o = (o.view(d, -1, hd) @ h).reshape(d, -1)
        out[pre + "self_attn.o_proj.weight"] = q.T @ o  # writes the residual: y' = y Q
        for name in ("gate_proj", "up_proj"):
            out[pre + f"mlp.{name}.weight"] = (t[pre + f"mlp.{name}.weight"] * g_mlp) @ q
        out[pre + "mlp.down_proj.weight"] = q.T @ t[pre + "mlp.down_proj.weight"]
        out[pre + "input_layernorm.weight"] = torch.ones(d, dtype=torch.float64)
        out[pre + "post_attention_layernorm.weight"] = torch.ones(d, dtype=torch.float64)
    assert len(out) == len(t) + (0 if "lm_head.weight" in t else 1)
    shutil.copytree(args.source, args.out, dirs_exist_ok=True)
    cfg["tie_word_embeddings"] = False
    json.dump(cfg, open(f"{args.out}/config.json", "w"), indent=2)
    save_file({k: v.float().contiguous() for k, v in out.items()}, f"{args.out}/model.safetensors",
              metadata={"format": "pt"})  # fmt: skip
    print(args.out, len(out), "tensors")


if __name__ == "__main__":
    main()
