"""One API process of `kiln serve --api-server-count N`: uvicorn + FastAPI on its listening
socket, attached to the shared engine process, its metrics in the multiprocess directory and
its stored responses in the shared database."""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys

from kiln.config import EngineConfig
from kiln.engine_core.client import ClientAddresses, EngineClient, EngineStartupError
from kiln.server.serving import ServeOptions, serve_app


def run_worker(
    index: int,
    options: ServeOptions,
    config: EngineConfig,
    sock: socket.socket,
    addresses: ClientAddresses,
    engine_pid: int,
    metrics_dir: str,
    responses_db: str,
) -> None:
    """The spawned process's body; exits with kiln serve's status (0 drained, 1 engine died)."""
    os.setpgrp()  # signals come from the launcher, once (see launcher.py)
    # Held until uvicorn's handlers are in place (DrainingServer.startup unblocks them): a
    # SIGTERM while this process still starts must drain it, not kill it.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        engine = EngineClient.attach(config, addresses, engine_pid)
    except EngineStartupError:
        sys.exit(2)  # the engine process says why (it may have failed before we listened)
    # One gRPC server (KServe v2) for the whole server: a second could not bind its port.
    grpc_port = options.grpc_port if index == 0 else None
    sys.exit(
        serve_app(
            options,
            engine,
            [sock],
            grpc_port=grpc_port,
            metrics_dir=metrics_dir,
            responses_db=responses_db,
        )
    )
