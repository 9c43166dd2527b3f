"""The parent of `kiln serve --api-server-count N`: the port, the engine process, N API
processes, and how the server ends.

Each API process listens on its own socket, all bound to the one address with SO_REUSEPORT: the
kernel spreads new connections over them evenly (a single shared listening socket lets whichever
process wakes first accept a whole burst, and a client's keep-alive connections then load one
process). A port another program holds fails here, before anything starts. The API processes
share the Prometheus multiprocess files and the Responses API's store, in a private directory
removed when the server ends.

Signals: SIGTERM and SIGINT are forwarded to every API process (each drains, then exits 0; a
second signal aborts what is left, as with one process). The API processes sit in their own
process group, so a terminal's Ctrl-C reaches them once, through here. The server ends when:
- every API process has exited after a drain: exit 0 (the engine process stops once each has
  said it is done);
- the engine process dies: the API processes end their streams with an error event and exit;
  exit 1;
- an API process fails: the others drain and exit; exit 1.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import socket
import tempfile
import time
from multiprocessing.process import BaseProcess

from kiln.config import EngineConfig
from kiln.engine_core.client import EngineProcess
from kiln.server.api_servers.worker import run_worker
from kiln.server.responses.store import ResponseStore
from kiln.server.serving import ServeOptions

logger = logging.getLogger("kiln.server")
LISTEN_BACKLOG = 2048  # uvicorn's default
ENGINE_EXIT_WAIT_S = 10.0  # after the last API process: the engine then needs only to stop


def listen_sockets(host: str, port: int, count: int) -> list[socket.socket]:
    """`count` listening sockets on (host, port), in one SO_REUSEPORT group. Port 0: one free
    port for all of them."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # A plain bind first: it fails on a port anyone holds, a SO_REUSEPORT group of another
    # server included, which the group's own binds below would silently join.
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind((host, port))
        port = probe.getsockname()[1]
    sockets = []
    for _ in range(count):
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        sock.listen(LISTEN_BACKLOG)
        sockets.append(sock)
    return sockets


def run_api_servers(options: ServeOptions, config: EngineConfig) -> int:
    """Serve with `options.api_server_count` API processes until the server ends; its status."""
    count = options.api_server_count
    sockets = listen_sockets(options.host, options.port, count)
    engine = EngineProcess(config, options.stream_interval, num_clients=count)
    # What the API processes share, in a directory only this user reads (mkdtemp's 0700).
    shared_dir = tempfile.mkdtemp(prefix="kiln-serve-")
    metrics_dir = os.path.join(shared_dir, "metrics")  # prometheus reads every *.db in it
    os.mkdir(metrics_dir)
    # Read by prometheus_client when each API process imports it (spawned: a fresh interpreter).
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
    responses_db = os.path.join(shared_dir, "responses.sqlite")
    ResponseStore(path=responses_db).close()  # the schema, before the processes open it
    spawn = multiprocessing.get_context("spawn")
    workers: list[BaseProcess] = []

    def forward(signum: int, frame: object) -> None:
        for worker in workers:
            if worker.exitcode is None and worker.pid is not None:
                with contextlib.suppress(ProcessLookupError):  # it has just exited
                    os.kill(worker.pid, signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    try:
        for index, sock in enumerate(sockets):
            worker_args = (index, options, config, sock, engine.addresses[index], engine.pid)
            worker = spawn.Process(
                target=run_worker,
                args=(*worker_args, metrics_dir, responses_db),
                name=f"kiln-api-{index}",
            )
            worker.start()
            workers.append(worker)
    finally:
        for sock in sockets:
            sock.close()  # the API processes hold their own copies
    try:
        return _supervise(engine, workers, options.shutdown_grace)
    finally:
        shutil.rmtree(shared_dir, ignore_errors=True)


def _supervise(engine: EngineProcess, workers: list[BaseProcess], grace_s: float) -> int:
    while engine.exit_code() is None and all(w.exitcode is None for w in workers):
        multiprocessing.connection.wait([w.sentinel for w in workers], timeout=0.2)
    # Code 0: it stopped because every API process said it was done (they are exiting).
    engine_dead = engine.exit_code() not in (None, 0)
    if engine_dead:
        logger.error("the engine process exited (code %s)", engine.exit_code())
        _join(workers, ENGINE_EXIT_WAIT_S)  # each ends its streams, then exits on its own
    else:
        failed = [w for w in workers if w.exitcode not in (None, 0)]
        if failed:
            logger.error("API process %s exited with %s", failed[0].name, failed[0].exitcode)
            for w in workers:
                if w.exitcode is None and w.pid is not None:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(w.pid, signal.SIGTERM)  # drain: nobody is left mid-stream
        _join(workers, grace_s + 30.0)
    engine.stop(ENGINE_EXIT_WAIT_S)
    return 1 if engine_dead or any(w.exitcode != 0 for w in workers) else 0


def _join(workers: list[BaseProcess], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for w in workers:
        w.join(max(0.0, deadline - time.monotonic()))
    for w in workers:
        if w.exitcode is None:
            logger.error("API process %s did not exit: killed", w.name)
            w.kill()
            w.join()
