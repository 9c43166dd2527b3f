"""/health sees a stall: an engine that holds work and makes no step turns /health, KServe's
ready and the engine_stalled gauge to 503 / 1, with the reason; they recover when it steps again.
The wedge is a step that blocks, injected in-process into a tiny model's engine."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import httpx
import pytest

from kiln.server.lifecycle import Lifecycle
from kiln.server.stall import StallWatch
from tests.server_harness import ServerThread

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from kiln.config import EngineConfig
    from kiln.engine.async_engine import AsyncEngine
    from kiln.engine.llm_engine import LLMEngine
    from tests.tiny_tokenizer import build_tiny_chat_model

    path = build_tiny_chat_model(str(tmp_path_factory.mktemp("tiny-stall")))
    config = EngineConfig(model=path, max_model_len=256, kv_cache_memory_gb=0.02, max_num_seqs=4)
    engine = AsyncEngine(LLMEngine(config))
    yield engine
    engine.shutdown()


def _gauge(http: httpx.Client, name: str) -> float:
    for line in http.get("/metrics").text.splitlines():
        if line.startswith(f"kiln:{name} "):
            return float(line.split()[-1])
    raise KeyError(name)


def test_a_wedged_engine_turns_health_503_and_back(engine):
    from kiln.server.app import build_app

    release = threading.Event()
    core = engine.engine
    real_step = core.step
    num_steps = 0

    def step():
        nonlocal num_steps
        num_steps += 1
        if num_steps == 4:  # a few real steps first: the engine's snapshot says it has work
            release.wait(60)
        return real_step()

    app = build_app(engine, "tiny", stall_timeout_s=0.5)
    core.step = step
    try:
        with ServerThread(app) as srv, httpx.Client(base_url=srv.base_url, timeout=60) as http:
            assert http.get("/health").status_code == 200
            body = {"prompt": "Hello", "max_tokens": 20, "ignore_eos": True}
            worker = threading.Thread(target=lambda: http.post("/v1/completions", json=body))
            worker.start()
            deadline = time.monotonic() + 20
            while (health := http.get("/health")).status_code == 200:
                assert time.monotonic() < deadline, "the stall was never reported"
                time.sleep(0.1)
            assert num_steps == 4  # wedged, not done
            error = health.json()["error"]
            assert health.status_code == 503 and error["code"] == "engine_stalled"
            assert "no step for" in error["message"] and "1 running" in error["message"]
            assert http.get("/v2/health/ready").status_code == 503
            assert _gauge(http, "engine_stalled") == 1.0
            assert _gauge(http, "engine_seconds_since_step") > 0.5
            release.set()
            worker.join(30)
            assert http.get("/health").status_code == 200
            assert http.get("/v2/health/ready").status_code == 200
            assert _gauge(http, "engine_stalled") == 0.0
    finally:
        release.set()
        core.step = real_step


@dataclass
class _Snapshot:
    num_running: int = 0
    num_waiting: int = 0
    time: float = 0.0


class _Engine:
    healthy = True

    def __init__(self) -> None:
        self.stats = _Snapshot()


def test_the_watch_on_a_fake_clock():
    engine, lifecycle, now = _Engine(), Lifecycle(8), [100.0]
    watch = StallWatch(engine, lifecycle, 5.0, clock=lambda: now[0])
    assert watch.reason() is None  # idle
    engine.stats = _Snapshot(num_running=2, time=100.0)
    now[0] = 104.0
    assert watch.reason() is None
    now[0] = 106.0
    assert "no step for 6.0 s" in watch.reason()
    engine.stats = _Snapshot(num_running=2, time=105.9)  # it stepped again
    assert watch.reason() is None
    # An idle engine that wedges on the first step of a new request: the server's waiting
    # request is the work, timed from when the watch first saw it.
    engine.stats = _Snapshot(time=50.0)
    lifecycle.num_waiting = 1
    assert watch.reason() is None
    now[0] = 110.0
    assert watch.reason() is None
    now[0] = 111.5
    assert "no step for 5.5 s" in watch.reason()
    lifecycle.num_waiting = 0
    assert watch.reason() is None
    assert StallWatch(engine, lifecycle, 0).reason() is None  # off
    engine.healthy = False  # a dead loop is /health's other answer, not a stall
    engine.stats = _Snapshot(num_running=1, time=0.0)
    assert watch.reason() is None


def test_the_first_step_out_of_idle_shows_its_work_at_once(tmp_path):
    """The snapshot /health reads is refreshed at most every SNAPSHOT_PERIOD_S while stepping;
    the first step after idle refreshes it at once, or a wedge within that period would show
    an idle engine and never a stall."""
    from kiln.config import EngineConfig
    from kiln.engine.llm_engine import LLMEngine
    from kiln.engine.step_loop import StepLoop
    from kiln.sampling_params import SamplingParams
    from tests.tiny_tokenizer import build_tiny_chat_model

    path = build_tiny_chat_model(str(tmp_path / "tiny"))
    config = EngineConfig(model=path, max_model_len=256, kv_cache_memory_gb=0.02, max_num_seqs=4)
    loop = StepLoop(LLMEngine(config), 1)
    loop.refresh_snapshot(force=True)  # idle, just now
    loop.add("r1", "Hello", SamplingParams(max_tokens=8, ignore_eos=True), 0)
    loop.step()
    assert loop.snapshot.num_running == 1
