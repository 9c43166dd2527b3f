"""EAGLE-3: a head in the published checkpoint layout drafts from the target's hidden states.

Heads here are random (written with the key names of yuhuili/EAGLE3-LLaMA3.1-Instruct-8B and
SpecForge's outputs: `fc`, `midlayer.*`, `norm`, `lm_head` over a reduced vocabulary, `d2t`,
`t2d`), so they accept few drafts; what is checked is the mechanism: greedy tokens identical to
decoding without drafts (fp32 CPU) on a tiny random Llama and on SmolLM2, batched with requests
that get no drafts, under chunked prefill, preemption and prefix caching, through the decode
graphs, the KV pools empty after; the head's
forward equal to a plain-torch transcription of EAGLE-3's layer; and a clear error for a head
trained for another model.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from kiln import LLM
from kiln.errors import ModelLoadError
from kiln.sampling_params import SamplingParams
from tests.conftest import TINY_BASE

GREEDY = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
ENGINE = dict(dtype="float32", device="cpu", kv_cache_memory_gb=0.05, num_threads=1)


def write_eagle3_head(
    path: str,
    target: dict,  # the target's hidden_size, heads, kv heads, intermediate_size, vocab_size
    draft_vocab_size: int,
    seed: int = 0,
    with_embedding: bool = False,
    std: float = 0.1,
    aux_layer_ids: list[int] | None = None,  # eagle_config's; None: the default 2, L/2, L-3
) -> None:
    """A random EAGLE-3 head in the published layout (config.json + model.safetensors)."""
    from safetensors.torch import save_file

    h, v = target["hidden_size"], target["vocab_size"]
    heads, kv = target["num_attention_heads"], target["num_key_value_heads"]
    hd = target.get("head_dim") or h // heads
    inter = target["intermediate_size"]
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=g) * std

    draft_ids = torch.sort(torch.randperm(v, generator=g)[:draft_vocab_size]).values
    t2d = torch.zeros(v, dtype=torch.bool)
    t2d[draft_ids] = True
    tensors = {
        "fc.weight": rand(h, 3 * h),
        "midlayer.hidden_norm.weight": 1 + rand(h),
        "midlayer.input_layernorm.weight": 1 + rand(h),
        "midlayer.post_attention_layernorm.weight": 1 + rand(h),
        "midlayer.self_attn.q_proj.weight": rand(heads * hd, 2 * h),
        "midlayer.self_attn.k_proj.weight": rand(kv * hd, 2 * h),
        "midlayer.self_attn.v_proj.weight": rand(kv * hd, 2 * h),
        "midlayer.self_attn.o_proj.weight": rand(h, heads * hd),
        "midlayer.mlp.gate_proj.weight": rand(inter, h),
        "midlayer.mlp.up_proj.weight": rand(inter, h),
        "midlayer.mlp.down_proj.weight": rand(h, inter),
        "norm.weight": 1 + rand(h),
        "lm_head.weight": rand(draft_vocab_size, h),
        "d2t": draft_ids - torch.arange(draft_vocab_size),
        "t2d": t2d,
    }
    if with_embedding:
        tensors["embed_tokens.weight"] = rand(v, h)
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": h,
        "intermediate_size": inter,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": hd,
        "num_hidden_layers": 1,
        "rms_norm_eps": target.get("rms_norm_eps", 1e-5),
        "rope_theta": target.get("rope_theta", 10000.0),
        "max_position_embeddings": 2048,
        "vocab_size": v,
        "draft_vocab_size": draft_vocab_size,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }
    if aux_layer_ids is not None:
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": aux_layer_ids}
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    save_file(
        {k: t.contiguous() for k, t in tensors.items()}, os.path.join(path, "model.safetensors")
    )


TARGET = {**TINY_BASE, "num_hidden_layers": 8}  # the default low/middle/high layers: 2, 4, 5


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    import transformers

    base = tmp_path_factory.mktemp("eagle3")
    cfg = transformers.AutoConfig.for_model("llama", **TARGET)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(str(base / "target"))
    write_eagle3_head(str(base / "head"), TARGET, draft_vocab_size=64)
    write_eagle3_head(str(base / "head_emb"), TARGET, draft_vocab_size=256, with_embedding=True)
    write_eagle3_head(str(base / "wide"), {**TARGET, "hidden_size": 96}, draft_vocab_size=64)
    return {name: str(base / name) for name in ("target", "head", "head_emb", "wide")}


def _prompts():
    g = torch.Generator().manual_seed(3)
    rep = [[int(t) for t in torch.randint(3, 250, (5,), generator=g)] * 4 for _ in range(2)]
    return [*rep, [int(t) for t in torch.randint(3, 250, (30,), generator=g)]]


@pytest.fixture(scope="module")
def reference(paths):
    prompts = _prompts()
    outs = LLM(paths["target"], **ENGINE).generate(prompts, GREEDY)
    return prompts, [o.outputs[0].token_ids for o in outs]


def _spec(head, k=3):
    return {"method": "eagle3", "model": head, "num_speculative_tokens": k}


def _check_pools_empty(llm):
    kv = llm.engine.kv_cache
    assert kv.pool.num_free_blocks == kv.pool.num_blocks and not kv.req_to_blocks
    proposer = llm.engine.executor.runner.proposer
    llm.engine.step()  # the runner (and so the proposer) hear of finished requests next step
    pool = proposer.pool
    assert not proposer.states and pool.num_free_blocks == pool.kv_caches[0][0].shape[0]


@pytest.mark.parametrize(
    "head, engine_args",
    [
        ("head", {}),
        ("head", {"max_num_batched_tokens": 8}),  # prompts in chunks next to verifications
        ("head", {"num_kv_blocks": 16, "block_size": 4}),  # preemption
        ("head_emb", {}),  # a head with its own embedding
        # Async scheduling: a step's outputs made while the next one runs.
        ("head", {"async_scheduling": True, "max_num_batched_tokens": 8}),
        ("head", {"async_scheduling": True, "num_kv_blocks": 16, "block_size": 4}),
    ],
    ids=["plain", "chunked", "preempt", "own-embedding", "async-chunked", "async-preempt"],
)
def test_eagle3_greedy_is_exact(paths, reference, head, engine_args):
    prompts, want = reference
    llm = LLM(paths["target"], speculative_config=_spec(paths[head]), **{**ENGINE, **engine_args})
    # The last request asks for logprobs: it gets no drafts, batched with those that do.
    params = [GREEDY] * (len(prompts) - 1) + [
        SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, logprobs=1)
    ]
    outs = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == want
    drafted = [o.outputs[0].num_draft_tokens for o in outs]
    assert all(d > 0 for d in drafted[:-1]) and drafted[-1] == 0
    if "num_kv_blocks" in engine_args:
        assert llm.engine.scheduler.num_preemptions_total > 0
    else:  # again: the prompts' first blocks now come from the prefix cache (no target states)
        outs = llm.generate(prompts, params)
        assert [o.outputs[0].token_ids for o in outs] == want
        assert sum(o.num_cached_tokens for o in outs) > 0
    _check_pools_empty(llm)


def test_eagle3_through_decode_graphs_with_named_layers(paths, reference, tmp_path):
    """Verification steps replayed by the decode graphs (FakeGraph, the CPU stand-in) write the
    target's states into the same buffer; the head names its layers (eagle_config)."""
    from kiln.runtime.graph_runner import GraphRunner

    prompts, want = reference
    head = str(tmp_path / "named")
    write_eagle3_head(head, TARGET, draft_vocab_size=64, aux_layer_ids=[1, 3, 6])
    llm = LLM(paths["target"], speculative_config=_spec(head), max_num_seqs=16, **ENGINE)
    r = llm.engine.executor.runner
    assert sorted(r.model._aux_columns) == [1, 3, 6]
    r.graphs = GraphRunner(
        r.model, r.ops, r.backend, r.kv_caches, r.inputs, 16, r.max_model_len, fake=True
    )
    r.graphs.capture()
    r.step_timing = {}
    outs = llm.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert any(row[0] and row[2] > row[1] for row in r.step_timing["trace"])  # graph steps
    _check_pools_empty(llm)


def test_eagle3_head_of_another_model_is_refused(paths):
    with pytest.raises(ModelLoadError, match=r"hidden states of size 96.*hidden size is 64"):
        LLM(paths["target"], speculative_config=_spec(paths["wide"]), **ENGINE)
    with pytest.raises(ModelLoadError, match="not an EAGLE-3 head"):
        LLM(paths["target"], speculative_config=_spec(paths["target"]), **ENGINE)


# ---- the head and the target's hidden states, against plain torch ------------------------------


def _rms(x, w, eps=1e-5):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x, positions, theta=10000.0):  # [n, heads, hd], rotate-half
    hd = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd)
    ang = positions[:, None].float() * inv[None]
    cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]
    x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def _reference_drafts(t: dict, embed: torch.Tensor, tokens: list[int], target_hidden, k: int):
    """EAGLE-3's chain, transcribed: position p reads (embed(token p+1), hidden p); the first
    positions take fc(low, middle, high) of the target, the chain the head's own pre-norm output."""
    heads, kv = TARGET["num_attention_heads"], TARGET["num_key_value_heads"]
    hd = TARGET["hidden_size"] // heads
    fused = target_hidden @ t["fc.weight"].T  # [P, H]
    keys, values, drafts, outputs = [], [], [], []
    ids, hidden = tokens[1:], fused
    positions = torch.arange(len(ids))
    d2t = t["d2t"]
    for _ in range(k):
        m = "midlayer."
        e = _rms(embed[torch.tensor(ids)], t[m + "input_layernorm.weight"])
        hn = _rms(hidden, t[m + "hidden_norm.weight"])
        x = torch.cat([e, hn], -1)
        q = (x @ t[m + "self_attn.q_proj.weight"].T).view(-1, heads, hd)
        kk = (x @ t[m + "self_attn.k_proj.weight"].T).view(-1, kv, hd)
        vv = (x @ t[m + "self_attn.v_proj.weight"].T).view(-1, kv, hd)
        q, kk = _rope(q, positions), _rope(kk, positions)
        keys.append(kk)
        values.append(vv)
        key, value = torch.cat(keys), torch.cat(values)
        rep = heads // kv
        key, value = key.repeat_interleave(rep, 1), value.repeat_interleave(rep, 1)
        n, total = q.shape[0], key.shape[0]
        scores = torch.einsum("qhd,khd->hqk", q, key) / hd**0.5
        mask = torch.arange(total)[None] > (torch.arange(n) + total - n)[:, None]
        attn = torch.einsum("hqk,khd->qhd", scores.masked_fill(mask, -1e9).softmax(-1), value)
        o = attn.reshape(n, -1) @ t[m + "self_attn.o_proj.weight"].T
        r = o + hidden
        y = _rms(r, t[m + "post_attention_layernorm.weight"])
        gate, up = y @ t[m + "mlp.gate_proj.weight"].T, y @ t[m + "mlp.up_proj.weight"].T
        pre = (torch.nn.functional.silu(gate) * up) @ t[m + "mlp.down_proj.weight"].T + r
        outputs.append(_rms(pre[-1], t["norm.weight"]))
        logits = outputs[-1] @ t["lm_head.weight"].T
        draft = int(logits.argmax())
        drafts.append(draft + int(d2t[draft]))
        ids, hidden, positions = [drafts[-1]], pre[-1:], positions[-1:] + 1
    return drafts, torch.stack(outputs)


def test_eagle3_target_states_and_drafts_match_plain_torch(paths):
    """The target's low/middle/high states are HF's hidden_states[2], [4], [5] (the inputs of
    those layers), and the proposer's first drafts are the transcription's."""
    import transformers
    from safetensors.torch import load_file

    hf = transformers.AutoModelForCausalLM.from_pretrained(paths["target"], dtype=torch.float32)
    llm = LLM(paths["target"], speculative_config=_spec(paths["head"], k=3), **ENGINE)
    runner = llm.engine.executor.runner
    proposed = []
    propose = runner.proposer.propose

    def spy(requests):
        out = propose(requests)
        proposed.append(([list(r.token_ids) for r in requests], out))
        return out

    runner.proposer.propose = spy
    head_outputs = []  # the head's final-normed output at each draft step
    draft_token_ids = runner.proposer.head.draft_token_ids

    def spy_head(ops, normed):
        head_outputs.append(normed.clone())
        return draft_token_ids(ops, normed)

    runner.proposer.head.draft_token_ids = spy_head
    prompt = _prompts()[2]
    llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0))
    with torch.no_grad():
        states = hf(torch.tensor([prompt]), output_hidden_states=True).hidden_states
    aux = runner.model.aux_hidden_states[: len(prompt)]
    want = torch.cat([states[i][0] for i in (2, 4, 5)], dim=-1)
    torch.testing.assert_close(aux, want, rtol=1e-4, atol=1e-4)
    (tokens,), drafts = proposed[0]
    head = load_file(os.path.join(paths["head"], "model.safetensors"))
    embed = hf.model.embed_tokens.weight.detach()
    want_drafts, want_outputs = _reference_drafts(head, embed, tokens, want, 3)
    torch.testing.assert_close(torch.cat(head_outputs), want_outputs, rtol=1e-4, atol=1e-4)
    assert list(drafts.values()) == [want_drafts]


def test_smollm2_eagle3_greedy_is_exact(smollm2_llm, smollm2_path, tmp_path):
    """A random head in the layout a SmolLM2 head would have (hidden 576, 49,152 tokens, a
    4,096-token draft vocabulary): the same greedy tokens as without drafts."""
    cfg = smollm2_llm.engine.model_config
    target = {
        "hidden_size": cfg.hidden_size,
        "vocab_size": cfg.vocab_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "intermediate_size": cfg.intermediate_size,
        "rope_theta": cfg.rope_theta,
    }
    write_eagle3_head(str(tmp_path / "head"), target, draft_vocab_size=4096, std=0.02)
    prompts = ["The capital of France is", "Copy this: red, green, blue, red, green,"]
    params = SamplingParams(max_tokens=12, temperature=0)
    want = [o.outputs[0].token_ids for o in smollm2_llm.generate(prompts, params)]
    llm = LLM(
        smollm2_path,
        speculative_config=_spec(str(tmp_path / "head"), k=3),
        kv_cache_memory_gb=0.1,
        max_num_seqs=4,
        num_threads=1,
    )
    outs = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert all(o.outputs[0].num_draft_tokens > 0 for o in outs)
    _check_pools_empty(llm)


def _train_head(head_dir: str, out_dir: str, sequences, hf, steps: int = 150) -> None:
    """Fit the head's first draft step to `sequences` (teacher forcing on the target's own
    states): memorised, so its drafts are often right and verification accepts some."""
    from safetensors.torch import load_file, save_file

    t = {k: v.clone().requires_grad_(v.is_floating_point()) for k, v in load_file(
        os.path.join(head_dir, "model.safetensors")).items()}  # fmt: skip
    trained = [v for k, v in t.items() if v.requires_grad]
    embed = hf.model.embed_tokens.weight.detach()
    data = []
    with torch.no_grad():
        for seq in sequences:
            states = hf(torch.tensor([seq]), output_hidden_states=True).hidden_states
            data.append((seq, torch.cat([states[i][0] for i in (2, 4, 5)], dim=-1)))
    opt = torch.optim.Adam(trained, lr=1e-2)
    d2t = t["d2t"]
    for _ in range(steps):
        opt.zero_grad()
        loss = 0.0
        for seq, aux in data:
            logits = _head_logits(t, embed, seq[1:-1], aux[:-2])  # position p predicts p + 2
            draft_targets = torch.tensor(seq[2:]) - d2t[torch.tensor(seq[2:])]  # full vocab
            loss = loss + torch.nn.functional.cross_entropy(logits, draft_targets)
        loss.backward()
        opt.step()
    os.makedirs(out_dir, exist_ok=True)
    save_file({k: v.detach().contiguous() for k, v in t.items()},
              os.path.join(out_dir, "model.safetensors"))  # fmt: skip
    with (
        open(os.path.join(head_dir, "config.json")) as f,
        open(os.path.join(out_dir, "config.json"), "w") as g,
    ):
        g.write(f.read())


def _head_logits(t, embed, ids, target_hidden):
    """The head's first step over a whole sequence, differentiable (the transcription above)."""
    heads, kv = TARGET["num_attention_heads"], TARGET["num_key_value_heads"]
    hd = TARGET["hidden_size"] // heads
    m, n = "midlayer.", len(ids)
    hidden = target_hidden @ t["fc.weight"].T
    positions = torch.arange(n)
    x = torch.cat([_rms(embed[torch.tensor(ids)], t[m + "input_layernorm.weight"]),
                   _rms(hidden, t[m + "hidden_norm.weight"])], -1)  # fmt: skip
    q = _rope((x @ t[m + "self_attn.q_proj.weight"].T).view(n, heads, hd), positions)
    k = _rope((x @ t[m + "self_attn.k_proj.weight"].T).view(n, kv, hd), positions)
    v = (x @ t[m + "self_attn.v_proj.weight"].T).view(n, kv, hd)
    k, v = k.repeat_interleave(heads // kv, 1), v.repeat_interleave(heads // kv, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / hd**0.5
    mask = torch.ones(n, n, dtype=torch.bool).triu(1)
    attn = torch.einsum("hqk,khd->qhd", scores.masked_fill(mask, -1e9).softmax(-1), v)
    r = attn.reshape(n, -1) @ t[m + "self_attn.o_proj.weight"].T + hidden
    y = _rms(r, t[m + "post_attention_layernorm.weight"])
    act = torch.nn.functional.silu(y @ t[m + "mlp.gate_proj.weight"].T)
    pre = (act * (y @ t[m + "mlp.up_proj.weight"].T)) @ t[m + "mlp.down_proj.weight"].T + r
    return _rms(pre, t["norm.weight"]) @ t["lm_head.weight"].T


def test_eagle3_trained_head_accepts_drafts_and_stays_exact(paths, reference, tmp_path):
    """A head fitted to these very outputs: verification accepts many of its drafts (the
    bookkeeping after accepted drafts: states kept, rejected ones dropped), tokens unchanged."""
    import transformers

    prompts, want = reference
    hf = transformers.AutoModelForCausalLM.from_pretrained(paths["target"], dtype=torch.float32)
    trained = str(tmp_path / "trained")
    sequences = [p + o for p, o in zip(prompts, want)]
    write_eagle3_head(str(tmp_path / "start"), TARGET, draft_vocab_size=256)
    _train_head(str(tmp_path / "start"), trained, sequences, hf)
    llm = LLM(paths["target"], speculative_config=_spec(trained, k=3), **ENGINE)
    outs = llm.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == want
    drafted = sum(o.outputs[0].num_draft_tokens for o in outs)
    accepted = sum(o.outputs[0].num_accepted_tokens for o in outs)
    print(f"trained tiny head: {accepted} of {drafted} drafts accepted")
    assert 0 < accepted < drafted
    _check_pools_empty(llm)
