"""Server lifecycle on a tiny random model (token-id prompts, no tokenizer): SIGTERM drain of
`kiln serve` as a subprocess, and an engine loop that dies under open streams."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from kiln.config import EngineConfig
from kiln.engine.async_engine import AsyncEngine
from kiln.engine.llm_engine import LLMEngine
from kiln.server.app import build_app
from tests.conftest import build_tiny_hf_model
from tests.lazy_import import lazy_import
from tests.server_harness import ServerThread, free_port, read_completion_stream

openai = lazy_import("openai")

PROMPT = [5, 17, 42, 9, 33, 71, 12, 8]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("tiny-llama"))
    build_tiny_hf_model("llama-gqa", path)
    return path


def _start_serve(model_dir: str, port: int, grace: float) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "kiln.cli.main", "serve", "--model", model_dir]
    cmd += ["--served-model-name", "tiny", "--port", str(port), "--shutdown-grace", str(grace)]
    cmd += ["--max-num-seqs", "2", "--log-level", "warning", "--kv-cache-memory-gb", "0.05"]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait_healthy(proc: subprocess.Popen, base: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stdout.read()
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise TimeoutError("kiln serve did not become healthy")


class _Stream(threading.Thread):
    """One streaming completion read to its end: records chunks, finish reason, [DONE]."""

    def __init__(self, base: str, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.base, self.max_tokens = base, max_tokens
        self.accepted = threading.Event()  # response headers arrived: the server took it
        self.first = threading.Event()
        self.num_tokens, self.finish, self.done, self.error = 0, None, False, None
        self.error_event: dict | None = None
        self.status: int | None = None

    def run(self) -> None:
        # logprobs: a model without a tokenizer has no text, but each token still streams.
        body = {"prompt": PROMPT, "max_tokens": self.max_tokens, "ignore_eos": True, "logprobs": 0}
        body["stream_options"] = {"include_usage": True}
        try:
            with httpx.stream(
                "POST", self.base + "/v1/completions", json={**body, "stream": True}, timeout=120
            ) as response:
                self.status = response.status_code
                self.accepted.set()
                for _ in read_completion_stream(response, self):
                    self.first.set()
        except Exception as exc:
            self.error = exc
            self.accepted.set()
            self.first.set()


@pytest.mark.timeout(400)
def test_sigterm_drains_in_flight_requests_then_exits_0(tiny_dir):
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    # A wall-clock grace: 60 s aborted these streams on a loaded 2-core machine (issue 58).
    proc = _start_serve(tiny_dir, port, grace=300)
    try:
        _wait_healthy(proc, base)
        # Two run (max_num_seqs=2), two wait: all four are in flight when SIGTERM comes.
        streams = [_Stream(base, max_tokens=400) for _ in range(4)]
        for s in streams:
            s.start()
        assert streams[0].first.wait(60) and streams[1].first.wait(60)
        assert all(s.accepted.wait(60) and s.status == 200 for s in streams)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        refused = httpx.post(base + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"]["code"] == "shutting_down"
        assert httpx.get(base + "/health").status_code == 503
        for s in streams:
            s.join(300)
        assert proc.wait(60) == 0
        for s in streams:
            assert s.error is None and s.done and s.finish == "length"
            assert s.num_tokens == 400  # every token, none cut off by the shutdown
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.timeout(240)
def test_drain_deadline_aborts_the_rest_then_exits_0(tiny_dir):
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = _start_serve(tiny_dir, port, grace=0.5)
    try:
        _wait_healthy(proc, base)
        streams = [_Stream(base, max_tokens=480) for _ in range(4)]
        for s in streams:
            s.start()
        assert streams[0].first.wait(60)
        assert all(s.accepted.wait(60) and s.status == 200 for s in streams)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        for s in streams:
            s.join(30)
            assert not s.is_alive() and s.error is None and s.done
        assert any(s.finish == "abort" for s in streams)
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.timeout(180)
def test_engine_death_turns_health_503_and_ends_streams_with_an_error(tiny_dir):
    core = LLMEngine(EngineConfig(model=tiny_dir, kv_cache_memory_gb=0.05))
    real_step, fail = core.step, threading.Event()

    def step():
        time.sleep(0.005)  # slow enough that the streams are still open when it fails
        if fail.is_set():
            raise RuntimeError("injected step failure")
        return real_step()

    core.step = step
    engine = AsyncEngine(core)
    try:
        with ServerThread(build_app(engine, "tiny")) as srv:
            assert httpx.get(srv.base_url + "/health").status_code == 200
            raw = _Stream(srv.base_url, max_tokens=400)
            raw.start()
            client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="-", max_retries=0)
            stream = client.completions.create(
                model="tiny",
                prompt=PROMPT,
                max_tokens=400,
                stream=True,
                logprobs=0,
                extra_body={"ignore_eos": True},
            )
            next(iter(stream))
            assert raw.first.wait(30)
            fail.set()
            with pytest.raises(openai.APIError, match="engine"):
                for _ in stream:
                    pass
            raw.join(30)
            assert not raw.is_alive() and raw.done and raw.finish is None
            assert raw.error_event["code"] == "engine_dead"
            health = httpx.get(srv.base_url + "/health")
            assert health.status_code == 503 and health.json()["error"]["code"] == "engine_dead"
            late = httpx.post(srv.base_url + "/v1/completions", json={"prompt": PROMPT})
            assert late.status_code == 503
            assert httpx.get(srv.base_url + "/metrics").status_code == 200
    finally:
        engine.shutdown()
