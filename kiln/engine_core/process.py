"""The engine process: `python -m kiln.engine_core.process`, started by EngineClient.

It builds the LLMEngine, says Ready (or StartupFailed with the reason, exit 1), then loops: take
in every queued add/abort, run one step, send one Outputs message with the step's deltas. It stops
on Shutdown (exit 0), when its parent goes away, or on a failed step (EngineDied, exit 1).

Signals: it ignores SIGINT and SIGTERM. The API process owns the shutdown (its drain lets
requests finish, then it sends Shutdown); a terminal's Ctrl-C, which reaches the whole process
group, must not kill the engine under a draining server.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys

import msgspec
import zmq

from kiln.config import EngineConfig
from kiln.engine.step_loop import StepLoop
from kiln.engine_core import messages as m
from kiln.errors import InvalidRequestError, KilnError

logger = logging.getLogger("kiln.engine_core")
IDLE_POLL_MS = 200  # how often an idle engine checks that its parent is alive


def describe(exc: BaseException) -> str:
    """The user's message: kiln's own errors say what is wrong already; others get their type."""
    if isinstance(exc, KilnError):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"


def serve(loop: StepLoop, inputs: zmq.Socket, outputs: zmq.Socket, parent_pid: int) -> None:
    poller = zmq.Poller()
    poller.register(inputs, zmq.POLLIN)
    idle_snapshot_sent = False
    while True:
        busy = loop.has_work()
        if not busy and os.getppid() != parent_pid:
            logger.warning("the API process is gone: the engine process exits")
            return
        accepted: list[str] = []
        rejected: list[m.Rejected] = []
        deltas = []
        if poller.poll(0 if busy else IDLE_POLL_MS):
            while True:
                try:
                    raw = inputs.recv(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                msg = m.input_decoder.decode(raw.buffer)
                if isinstance(msg, m.AddRequest):
                    try:
                        loop.add(msg.req_id, msg.prompt_token_ids, msg.params, msg.priority)
                        accepted.append(msg.req_id)
                    except InvalidRequestError as exc:
                        rejected.append(m.Rejected(msg.req_id, str(exc), exc.param, exc.code))
                elif isinstance(msg, m.Abort):
                    for req_id in msg.req_ids:
                        deltas.extend(loop.abort(req_id))
                else:  # Shutdown
                    return
        version = loop.snapshot
        if loop.has_work():
            deltas.extend(loop.step())
            idle_snapshot_sent = False
        elif not idle_snapshot_sent:
            loop.refresh_snapshot(force=True)  # idle now: the gauges say so at once
            idle_snapshot_sent = True
        if accepted or rejected or deltas or loop.snapshot is not version:
            for delta in deltas:
                delta.prompt_token_ids = []  # the client has each prompt: don't resend it
            snapshot = loop.snapshot if loop.snapshot is not version else None
            out = m.Outputs(accepted, rejected, deltas, snapshot)
            outputs.send(m.encoder.encode(out), copy=False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kiln-engine-core")
    parser.add_argument("--inputs", required=True, help="ZMQ address to pull requests from")
    parser.add_argument("--outputs", required=True, help="ZMQ address to push outputs to")
    parser.add_argument("--config", required=True, help="EngineConfig as JSON")
    parser.add_argument("--stream-interval", type=int, default=1)
    parser.add_argument("--parent-pid", type=int, required=True)
    args = parser.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    ctx = zmq.Context()
    inputs = ctx.socket(zmq.PULL)
    inputs.setsockopt(zmq.RCVHWM, 0)
    inputs.connect(args.inputs)
    outputs = ctx.socket(zmq.PUSH)
    outputs.setsockopt(zmq.SNDHWM, 0)
    outputs.setsockopt(zmq.LINGER, 5000)  # the last message (a failure) must get out
    outputs.connect(args.outputs)
    try:
        try:
            config = msgspec.json.decode(args.config.encode(), type=EngineConfig)
            from kiln.engine.llm_engine import LLMEngine

            loop = StepLoop(LLMEngine(config), args.stream_interval)
        except BaseException as exc:
            if not isinstance(exc, KilnError):
                logger.exception("the engine could not start")
            outputs.send(m.encoder.encode(m.StartupFailed(describe(exc))))
            return 1
        from kiln.engine.step_loop import engine_info

        info = engine_info(loop.engine)
        ready = m.Ready(
            os.getpid(),
            info.max_model_len,
            info.vocab_size,
            info.default_params,
            info.cache_config,
        )
        outputs.send(m.encoder.encode(ready))
        try:
            serve(loop, inputs, outputs, args.parent_pid)
        except BaseException as exc:
            logger.exception("engine step failed")
            outputs.send(m.encoder.encode(m.EngineDied(describe(exc))))
            return 1
        return 0
    finally:
        inputs.close(linger=0)
        outputs.close()
        ctx.term()


if __name__ == "__main__":
    sys.exit(main())
