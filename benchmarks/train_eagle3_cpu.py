"""Train a small EAGLE-3 head for SmolLM2-135M on the CPU, then measure its acceptance in kiln.

1. SmolLM2 (kiln, greedy) continues WikiText-2 validation passages: its own outputs are the
   training text, as EAGLE-3 heads are trained on the target's responses.
2. Hugging Face transformers gives the target's hidden states entering layers 2, 15 and 27 (the
   low/middle/high states kiln feeds the head) for every sequence.
3. The head, in the published layout (fc, midlayer, norm, lm_head over the most frequent output
   tokens, d2t), learns the first draft step by teacher forcing: position p reads the embedding
   of token p + 1 and the target's states at p, and predicts token p + 2 (loss on generated
   tokens only). Started from the target: lm_head from SmolLM2's tied embedding rows, norm
   from its final norm, fc passing the high state through, the layer's output projections at 0.
   EAGLE-3's training-time test (later chain steps on the head's own states) is not done, so
   drafts after the first are weaker than a published head's.
4. kiln runs held-out WikiText-2 test passages with and without the head (one thread, turns
   prompt by prompt): the tokens must be equal; acceptance length and tok/s are reported.

    python benchmarks/train_eagle3_cpu.py --minutes 4 --out-dir /tmp/eagle3-smollm2 \\
        --output-json benchmarks/results/.../eagle3_smollm2.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import time

import torch
import torch.nn.functional as F
from spec_decode_cpu import WIKITEXT, passages

from kiln import LLM
from kiln.checkpoint.default_model import default_model_path
from kiln.sampling_params import SamplingParams


def rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope(x, positions, theta):  # [n, heads, hd], rotate-half
    hd = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd)
    ang = positions[:, None].float() * inv[None]
    cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]
    x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def head_logits(t, cfg, embed, ids, target_states):
    """The head's first step over one sequence (what kiln's Eagle3Head computes), differentiable."""
    heads, kv, hd, eps = cfg["heads"], cfg["kv"], cfg["hd"], cfg["eps"]
    m, n = "midlayer.", len(ids)
    hidden = target_states @ t["fc.weight"].T
    positions = torch.arange(n)
    x = torch.cat([rms(embed[ids], t[m + "input_layernorm.weight"], eps),
                   rms(hidden, t[m + "hidden_norm.weight"], eps)], -1)  # fmt: skip
    q = rope((x @ t[m + "self_attn.q_proj.weight"].T).view(n, heads, hd), positions, cfg["theta"])
    k = rope((x @ t[m + "self_attn.k_proj.weight"].T).view(n, kv, hd), positions, cfg["theta"])
    v = (x @ t[m + "self_attn.v_proj.weight"].T).view(n, kv, hd)
    k, v = k.repeat_interleave(heads // kv, 1), v.repeat_interleave(heads // kv, 1)
    attn = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True
    ).transpose(0, 1)
    r = attn.reshape(n, -1) @ t[m + "self_attn.o_proj.weight"].T + hidden
    y = rms(r, t[m + "post_attention_layernorm.weight"], eps)
    act = F.silu(y @ t[m + "mlp.gate_proj.weight"].T) * (y @ t[m + "mlp.up_proj.weight"].T)
    pre = act @ t[m + "mlp.down_proj.weight"].T + r
    return rms(pre, t["norm.weight"], eps) @ t["lm_head.weight"].T


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2 GGUF")
    p.add_argument("--train-prompts", type=int, default=96)
    p.add_argument("--eval-prompts", type=int, default=12)
    p.add_argument("--words", type=int, default=40)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--eval-max-tokens", type=int, default=48)
    p.add_argument("--draft-vocab", type=int, default=4096)
    p.add_argument("--minutes", type=float, default=4.0)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--out-dir", default="/tmp/eagle3-smollm2")
    p.add_argument("--output-json", default=None)
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    path = args.model or default_model_path()
    engine_args = dict(kv_cache_memory_gb=0.5, max_num_seqs=32, num_threads=1)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)

    # 1. the target's own outputs on WikiText-2 validation passages
    plain = LLM(path, **engine_args)
    tok = plain.get_tokenizer()
    train_text = passages(args.train_prompts, args.words, os.path.join(WIKITEXT, "valid.txt"))
    train_prompts = [tok.encode(t, add_special_tokens=False) for t in train_text]
    t0 = time.perf_counter()
    outs = plain.generate(train_prompts, params)
    sequences = [(pr, o.outputs[0].token_ids) for pr, o in zip(train_prompts, outs)]
    gen_s = time.perf_counter() - t0
    print(f"generated {sum(len(o) for _, o in sequences)} training tokens in {gen_s:.0f} s")

    # 2. the target's states (HF, the same GGUF weights)
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
    ).eval()
    hc = hf.config
    layers = (2, hc.num_hidden_layers // 2, hc.num_hidden_layers - 3)
    data = []
    with torch.no_grad():
        for prompt, output in sequences:
            seq = prompt + output
            states = hf(torch.tensor([seq]), output_hidden_states=True).hidden_states
            data.append((seq, len(prompt), torch.cat([states[i][0] for i in layers], -1)))
    embed = hf.model.embed_tokens.weight.detach()

    # 3. the head: draft vocabulary = the most frequent output tokens
    counts = torch.bincount(
        torch.tensor([t for _, o in sequences for t in o]), minlength=hc.vocab_size
    )
    draft_ids = torch.sort(torch.argsort(counts, descending=True)[: args.draft_vocab]).values
    to_draft = torch.full((hc.vocab_size,), -100, dtype=torch.long)
    to_draft[draft_ids] = torch.arange(args.draft_vocab)
    h, inter = hc.hidden_size, hc.intermediate_size
    heads, kv = hc.num_attention_heads, hc.num_key_value_heads
    hd = h // heads
    theta = plain.engine.model_config.rope_theta  # transformers 5 folds it into rope_parameters
    cfg = dict(heads=heads, kv=kv, hd=hd, eps=hc.rms_norm_eps, theta=theta)
    g = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=g) * 0.02

    fc = torch.zeros(h, 3 * h)
    fc[:, 2 * h :] = torch.eye(h)  # start by passing the high state through
    m = "midlayer."
    t = {
        "fc.weight": fc,
        m + "hidden_norm.weight": torch.ones(h),
        m + "input_layernorm.weight": torch.ones(h),
        m + "post_attention_layernorm.weight": torch.ones(h),
        m + "self_attn.q_proj.weight": rand(heads * hd, 2 * h),
        m + "self_attn.k_proj.weight": rand(kv * hd, 2 * h),
        m + "self_attn.v_proj.weight": rand(kv * hd, 2 * h),
        m + "self_attn.o_proj.weight": torch.zeros(h, heads * hd),
        m + "mlp.gate_proj.weight": rand(inter, h),
        m + "mlp.up_proj.weight": rand(inter, h),
        m + "mlp.down_proj.weight": torch.zeros(h, inter),
        "norm.weight": hf.model.norm.weight.detach().clone(),
        "lm_head.weight": embed[draft_ids].clone(),
    }
    for v in t.values():
        v.requires_grad_(True)
    opt = torch.optim.AdamW(t.values(), lr=args.lr, weight_decay=0.0)
    t0, step, losses = time.perf_counter(), 0, []
    while time.perf_counter() - t0 < args.minutes * 60:
        order = torch.randperm(len(data), generator=g)
        for start in range(0, len(order), 8):
            opt.zero_grad()
            loss, n = 0.0, 0
            for i in order[start : start + 8].tolist():
                seq, plen, states = data[i]
                ids = torch.tensor(seq)
                labels = to_draft[ids[2:]].clone()
                labels[: max(plen - 2, 0)] = -100  # only the target's own tokens
                logits = head_logits(t, cfg, embed, ids[1:-1], states[:-2])
                loss = loss + F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum")
                n += int((labels >= 0).sum())
            (loss / max(n, 1)).backward()
            opt.step()
            step += 1
            losses.append(loss.item() / max(n, 1))
            if step % 20 == 0:
                print(f"step {step}: loss {sum(losses[-20:]) / 20:.3f}")
            if time.perf_counter() - t0 >= args.minutes * 60:
                break
    train_s = time.perf_counter() - t0
    from safetensors.torch import save_file

    tensors = {k: v.detach().contiguous() for k, v in t.items()}
    tensors["d2t"] = draft_ids - torch.arange(args.draft_vocab)
    t2d = torch.zeros(hc.vocab_size, dtype=torch.bool)
    t2d[draft_ids] = True
    tensors["t2d"] = t2d
    os.makedirs(args.out_dir, exist_ok=True)
    save_file(tensors, os.path.join(args.out_dir, "model.safetensors"))
    config = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": h, "intermediate_size": inter, "num_attention_heads": heads,
        "num_key_value_heads": kv, "head_dim": hd, "num_hidden_layers": 1,
        "rms_norm_eps": hc.rms_norm_eps, "rope_theta": theta,
        "max_position_embeddings": hc.max_position_embeddings, "vocab_size": hc.vocab_size,
        "draft_vocab_size": args.draft_vocab, "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }  # fmt: skip
    with open(os.path.join(args.out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    del hf, data

    # 4. held-out WikiText-2 test passages, with and without the head
    eval_text = passages(args.eval_prompts, args.words, os.path.join(WIKITEXT, "test.txt"))
    eval_prompts = [tok.encode(x, add_special_tokens=False) for x in eval_text]
    spec = {"method": "eagle3", "model": args.out_dir, "num_speculative_tokens": args.k}
    params = SamplingParams(temperature=0, max_tokens=args.eval_max_tokens)
    eagle = LLM(path, speculative_config=spec, **engine_args)
    plain_s = eagle_s = 0.0
    plain_tokens, results = 0, []
    for prompt in eval_prompts:  # turns, one prompt at a time (single stream)
        t1 = time.perf_counter()
        want = plain.generate([prompt], params)[0].outputs[0]
        t2 = time.perf_counter()
        got = eagle.generate([prompt], params)[0].outputs[0]
        t3 = time.perf_counter()
        plain_s, eagle_s = plain_s + t2 - t1, eagle_s + t3 - t2
        plain_tokens += len(want.token_ids)
        results.append((want.token_ids == got.token_ids, got))
    drafted = sum(r.num_draft_tokens for _, r in results)
    accepted = sum(r.num_accepted_tokens for _, r in results)
    spec_steps = sum(r.num_spec_steps for _, r in results)
    report = {
        "train_prompts": len(sequences),
        "train_tokens": sum(len(o) for _, o in sequences),
        "train_steps": step,
        "train_seconds": round(train_s, 1),
        "final_loss": round(sum(losses[-20:]) / max(len(losses[-20:]), 1), 3),
        "draft_vocab": args.draft_vocab,
        "k": args.k,
        "eval_prompts": len(eval_prompts),
        "all_equal_to_plain": all(eq for eq, _ in results),
        "num_draft_tokens": drafted,
        "num_accepted_tokens": accepted,
        "acceptance_rate": accepted / max(drafted, 1),
        "mean_acceptance_length": 1 + accepted / max(spec_steps, 1),
        "plain_tok_s": plain_tokens / plain_s,
        "eagle3_tok_s": plain_tokens / eagle_s,
        "machine": platform.processor() or platform.machine(),
        "load_average": os.getloadavg(),
        "git_rev": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip(),
    }
    print(json.dumps(report, indent=1))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
