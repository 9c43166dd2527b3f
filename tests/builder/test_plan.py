"""`kiln build`'s memory plan (kiln.builder.plan) is the runtime's config plan: a hybrid
model's windowed layers are counted at their window, so Gemma-3-12B's long sequences fit
several times over what counting every layer fully would say."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kiln.builder.plan import plan_memory
from kiln.config import EngineConfig
from kiln.models.config import PRESETS, ModelConfig
from kiln.runtime.config_plan import plan_from_config

GiB = 1 << 30


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_gemma3_12b_build_plan_counts_windowed_layers_at_the_window(device, monkeypatch) -> None:
    cfg = ModelConfig.from_hf_dict(PRESETS["gemma-3-12b"])
    card = 141 * GiB
    props = SimpleNamespace(total_memory=card)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda _device: props)
    plan = plan_memory(cfg, torch.bfloat16, torch.float8_e4m3fn, "fp8", 131072,
                       torch.device(device))  # fmt: skip
    runtime = plan_from_config(cfg, EngineConfig(quantization="fp8"), 131072, torch.bfloat16,
                               torch.float8_e4m3fn, card if device == "cuda" else None)  # fmt: skip
    assert plan == runtime  # one calculation: what the engine logs before it loads
    assert [g.window for g in plan.groups] == [None, 1024, 1024, 1024, 1024, 1024]
    lengths = (4096, 32768, 131072)
    fits = [plan.sequences_of(n) for n in lengths]
    counted_fully = [plan.sequences_keeping_every_layer(n) for n in lengths]
    # A 141 GiB card: 2.6x the 4k sequences, 5x the 32k, 6x the 128k; the CPU's 2 GiB: 5 x 4k
    # instead of 2.
    want = ([394, 97, 27], [150, 18, 4]) if device == "cuda" else ([5, 1, 0], [2, 0, 0])
    assert (fits, counted_fully) == want
    text = plan.describe()
    assert "layers of window 1024 counted at it" in text, text
