"""Load errors name the config field that is wrong, before anything is allocated (issue 15's
tester: a bad head count or rope_scaling read as a tokenizer failure, absurd sizes gave allocator
tracebacks or a hang)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from kiln.config import EngineConfig
from kiln.engine.llm_engine import LLMEngine
from kiln.errors import ModelLoadError
from kiln.models.config import ModelConfig
from tests.conftest import build_tiny_hf_model

BASE = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
}


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"hidden_size": 65}, "hidden_size=65 is not divisible by num_attention_heads=4"),
        ({"rope_scaling": "yarn"}, "rope_scaling='yarn' must be a dict"),
        ({"rope_scaling": {"rope_type": "linear", "factor": -2}}, "rope_scaling.factor=-2"),
        ({"num_hidden_layers": 10_000_000}, "num_hidden_layers=10000000"),
        # Issue 57: tracebacks before.
        ({"hidden_size": "abc"}, "hidden_size='abc' in the model's config is not an integer"),
        ({"max_position_embeddings": 1e9}, "max_position_embeddings=1000000000 is longer"),
        ({"rms_norm_eps": "x"}, "rms_norm_eps='x'"),
        ({"num_key_value_heads": True}, "num_key_value_heads=True"),
    ],
)
def test_bad_config_names_the_field(change, named):
    with pytest.raises(ModelLoadError, match=named.replace("(", r"\(").replace(".", r"\.")):
        ModelConfig.from_hf_dict({**BASE, **change})


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny-llama")
    build_tiny_hf_model("llama-gqa", str(path))
    return path


@pytest.mark.parametrize(
    ("change", "named"),
    [({"vocab_size": 10**12}, "vocab_size=1000000000000"), ({"hidden_size": 10**9}, "hidden_size")],
)
def test_absurd_sizes_are_checked_against_memory_before_allocating(
    tiny_dir, tmp_path, change, named
):
    for f in tiny_dir.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    config = json.loads((tiny_dir / "config.json").read_text())
    if "hidden_size" in change:  # keep the heads dividing it
        config["num_attention_heads"] = config["num_key_value_heads"] = 1
    (tmp_path / "config.json").write_text(json.dumps({**config, **change}))
    t0 = time.monotonic()
    with pytest.raises(ModelLoadError, match="GiB") as info:
        LLMEngine(EngineConfig(model=str(tmp_path), kv_cache_memory_gb=0.05))
    assert named in str(info.value) and time.monotonic() - t0 < 30
