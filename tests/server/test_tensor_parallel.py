"""`kiln serve --tensor-parallel-size 2` as a subprocess (the CLI, the engine process, one worker
rank) passes test_openai_api.py's OpenAI-SDK client checks, imported from there unchanged: text,
chat, streaming, n and seeds, stop strings, logprobs, prompt logprobs (lm-eval's echo), 64
concurrent streams, a disconnect that frees its KV blocks.

The model is the tiny random Llama with a tiny BPE tokenizer (tests/tiny_tokenizer.py: 4 query
heads, 2 KV heads, both split over 2 ranks), served in fp32 under the name test_openai_api.py asks
for. test_openai_api.py's `offline(engine, fn)` references run here on a one-process engine over the
same weights: each check then says "TP=2 behind the server equals one process offline".
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from kiln.config import EngineConfig
from kiln.engine.llm_engine import LLMEngine
from tests.lazy_import import lazy_import

# The checks themselves: pytest collects them here, with this module's fixtures.
from tests.server.test_openai_api import (  # noqa: F401
    test_64_concurrent_streams_equal_alone,
    test_chat_equals_offline,
    test_completions_equal_offline,
    test_disconnect_aborts_and_frees_kv,
    test_echo_prompt_logprobs_for_lm_eval,
    test_logprobs_equal_offline,
    test_models_health_version,
    test_n_seed_and_stop_equal_offline,
    test_token_id_prompts_equal_text_prompts,
)
from tests.server_harness import MODEL_NAME, free_port

openai = lazy_import("openai")

pytestmark = pytest.mark.timeout(300)
ENGINE_ARGS = dict(dtype="float32", num_threads=1, max_model_len=512, kv_cache_memory_gb=0.05)


def start_tp2_server(root: Path) -> SimpleNamespace:
    """The tiny chat model saved under `root` and `kiln serve -tp 2` started on it, not waited
    for: tests/server/conftest.py calls this when the package's first test begins, so the
    server's three processes import (seconds each) while the tests before this module run."""
    from tests.tiny_tokenizer import build_tiny_chat_model

    model_dir = build_tiny_chat_model(str(root / "tiny-chat-tp"))
    port = free_port()
    log_path = root / "serve.log"
    cmd = [sys.executable, "-m", "kiln.cli.main", "serve", "--model", model_dir]
    cmd += ["--served-model-name", MODEL_NAME, "--port", str(port), "--log-level", "info"]
    cmd += ["--tensor-parallel-size", "2", "--dtype", "float32", "--threads", "1"]
    cmd += ["--max-model-len", "512", "--kv-cache-memory-gb", "0.05"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    return SimpleNamespace(base_url=base, log_path=log_path, proc=proc, model_dir=model_dir)


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class _OneProcessReference:
    """What test_openai_api.py's `offline()` and `engine.engine` read, on a one-process engine."""

    def __init__(self, model: str) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **ENGINE_ARGS))

    async def call(self, fn):
        return fn(self.engine)


@pytest.fixture(scope="module")
def tiny_chat_dir(early_servers) -> str:
    return early_servers["tp2"].model_dir


@pytest.fixture(scope="module")
def engine(tiny_chat_dir) -> _OneProcessReference:
    return _OneProcessReference(tiny_chat_dir)


@pytest.fixture(scope="module")
def server(early_servers):
    started = early_servers["tp2"]
    proc = started.proc
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, started.log_path.read_text()
            assert time.monotonic() < deadline, "kiln serve -tp 2 did not become healthy"
            try:
                if httpx.get(started.base_url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        yield started
    finally:
        stop(proc)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="-", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=120) as c:
        yield c


def _descendants(pid: int) -> list[str]:
    """The command lines of every process below `pid` (Linux /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], list(children.get(pid, []))
    while todo:
        child = todo.pop()
        try:
            with open(f"/proc/{child}/cmdline", "rb") as f:
                found.append(f.read().replace(b"\0", b" ").decode())
        except OSError:
            continue
        todo += children.get(child, [])
    return found


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads the process tree in /proc")
def test_the_server_runs_two_tensor_ranks(server, http) -> None:
    """Not one process in disguise: the engine process has started one worker rank."""
    assert http.get("/health").status_code == 200
    workers = [c for c in _descendants(server.proc.pid) if "kiln.executor.worker" in c]
    assert len(workers) == 1, _descendants(server.proc.pid)
