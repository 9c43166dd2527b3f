"""The runner's and the engine's hooks: a feature plugs in at fixed points of a step, and a
point calls only the hooks that override it."""

from __future__ import annotations

import pytest
import torch

from kiln import LLM, SamplingParams
from kiln.engine.hooks import EngineHook
from kiln.engine.request import Request
from kiln.runtime.in_flight import InFlightStep, StepOutputs
from kiln.runtime.step_hooks import StepHook, StepHooks, StepTimer
from tests.conftest import build_tiny_hf_model

STEP_POINTS = [
    "before_forward",
    "after_forward",
    "on_logits",
    "defers_sampling",
    "sampler_launched",
    "copy_to_host",
    "finish",
    "collected",
]


class Recorder(StepHook):
    """Every point of every step, by step."""

    def __init__(self) -> None:
        self.calls: dict[InFlightStep, list[str]] = {}

    def _note(self, step: InFlightStep, point: str) -> None:
        self.calls.setdefault(step, []).append(point)

    def before_forward(self, step):
        self._note(step, "before_forward")

    def after_forward(self, step, states, batch, hidden):
        assert all(s.num_computed_tokens < s.num_tokens for s in states)  # not moved on yet
        self._note(step, "after_forward")

    def on_logits(self, step, logits):
        assert logits.shape[0] == len(step.states)
        self._note(step, "on_logits")
        return logits

    def defers_sampling(self, step):
        self._note(step, "defers_sampling")
        return False

    def sampler_launched(self, step):
        self._note(step, "sampler_launched")

    def copy_to_host(self, step):
        self._note(step, "copy_to_host")

    def finish(self, step, out: StepOutputs):
        assert len(out.row_token_ids) == len(step.states or ())
        self._note(step, "finish")

    def collected(self, step):
        assert step.output is not None and len(step.times) == 7
        self._note(step, "collected")


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("tiny-llama"))
    build_tiny_hf_model("llama-gqa", path)
    return path


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_hook_sees_every_step_at_its_points_in_order(tiny_path, async_scheduling):
    llm = LLM(tiny_path, kv_cache_memory_gb=0.02, async_scheduling=async_scheduling)
    runner = llm.engine.executor.runner
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    want = llm.generate([[5, 6, 7], [8, 9]], params)
    recorder = Recorder()
    runner.hooks.add(recorder)
    got = llm.generate([[5, 6, 7], [8, 9]], params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert len(recorder.calls) == 6  # the prompts' step, then five decodes
    assert all(points == STEP_POINTS for points in recorder.calls.values())


def test_a_point_calls_only_the_hooks_that_override_it():
    class OnlyFinish(StepHook):
        def finish(self, step, out):
            out.spec_token_ids["r"] = [1]

    hooks = StepHooks([StepHook(), OnlyFinish()])
    assert [type(h) for h in hooks._at_finish] == [OnlyFinish]
    assert not hooks._at_after_forward and not hooks._at_collected
    out = StepOutputs()
    hooks.finish(None, out)
    assert out.freeze().spec_token_ids == {"r": [1]}
    logits = torch.zeros(2, 3)
    assert hooks.on_logits(None, logits) is logits and hooks.deferring(None) is None


def test_step_timing_installs_and_removes_its_hook(tiny_path):
    runner = LLM(tiny_path, kv_cache_memory_gb=0.02).engine.executor.runner
    assert runner.step_timing is None and runner.hooks.get(StepTimer) is None
    runner.step_timing = totals = {}
    assert runner.step_timing is totals and runner.hooks.hooks[0] is runner.hooks.get(StepTimer)
    runner.step_timing = None
    assert runner.hooks.get(StepTimer) is None
    assert not any(isinstance(h, StepTimer) for h in runner.hooks._at_collected)


class HoldUntilReleased(EngineHook):
    """Holds every request that asks for 3 tokens until `ready`."""

    def __init__(self, scheduler) -> None:
        self.scheduler, self.ready, self.held = scheduler, False, []

    def hold(self, request: Request) -> bool:
        if request.sampling_params.max_tokens != 3:
            return False
        self.held.append(request)
        return True

    def release(self):
        if self.ready:
            for request in self.held:
                self.scheduler.add_request(request)
            self.held = []
        return []

    def has_work(self) -> bool:
        return bool(self.held)

    def held_req_ids(self) -> set[str]:
        return {r.req_id for r in self.held}


def test_an_engine_hook_holds_a_request_out_of_scheduling(tiny_path):
    engine = LLM(tiny_path, kv_cache_memory_gb=0.02).engine
    hook = HoldUntilReleased(engine.scheduler)
    engine.hooks.append(hook)
    engine.add_request([5, 6], SamplingParams(max_tokens=3, temperature=0), request_id="held")
    engine.add_request([5, 6], SamplingParams(max_tokens=2, temperature=0), request_id="free")
    finished = []
    for _ in range(4):
        finished += [d.request_id for d in engine.step() if d.finished]
    assert finished == ["free"] and engine.num_held == 1 and engine.has_unfinished_requests()
    hook.ready = True
    while engine.has_unfinished_requests():
        finished += [d.request_id for d in engine.step() if d.finished]
    assert finished == ["free", "held"] and engine.num_held == 0
    assert len(engine.finished_output("held").outputs[0].token_ids) == 3
