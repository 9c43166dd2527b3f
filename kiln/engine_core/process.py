"""The engine process: `python -m kiln.engine_core.process`, started by EngineClient.

It builds the LLMEngine, says Ready (or StartupFailed with the reason, exit 1), then loops: take
in every queued add/abort, run one step, send one Outputs message with the step's deltas. It stops
once every API process has sent Shutdown (exit 0), when its parent goes away, or on a failed step
(EngineDied, exit 1).

It serves one or more API processes (`kiln serve --api-server-count N`), one pair of sockets
each (`--inputs`/`--outputs` given once per API process, in the same order). A request belongs to
the API process that added it: its acceptance and deltas go to that process alone; Ready, the
snapshot and a failure go to all of them. The snapshot goes out before the first step out of
idle too, so each API process's /health sees a wedge in that step (kiln.server.stall).

While it starts, it ends as soon as its parent is gone (parent_watch.py), at any stage.

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
from typing import TYPE_CHECKING

import msgspec
import zmq

from kiln.config import EngineConfig
from kiln.engine_core import messages as m
from kiln.engine_core.parent_watch import ParentWatch
from kiln.errors import InvalidRequestError, KilnError

if TYPE_CHECKING:  # torch's imports wait until the parent watch runs
    from kiln.engine.step_loop import StepLoop

logger = logging.getLogger("kiln.engine_core")
IDLE_POLL_MS = 200  # how often an idle engine checks that its parent is alive


def describe(exc: BaseException) -> str:
    """The user's message: kiln's own errors say what is wrong already; others get their type."""
    if isinstance(exc, KilnError):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"


def serve(loop: StepLoop, clients: list[tuple[zmq.Socket, zmq.Socket]], parent_pid: int) -> None:
    """Run until every client has sent Shutdown. `clients`: (inputs, outputs) per API process."""
    poller = zmq.Poller()
    for inputs, _ in clients:
        poller.register(inputs, zmq.POLLIN)
    owner: dict[str, int] = {}  # req_id -> the client that added it
    open_clients = set(range(len(clients)))
    idle_snapshot_sent = False
    while True:
        busy = loop.has_work()
        if not busy and os.getppid() != parent_pid:
            logger.warning("the API process is gone: the engine process exits")
            return
        accepted: list[list[str]] = [[] for _ in clients]
        rejected: list[list[m.Rejected]] = [[] for _ in clients]
        deltas = []
        ready = dict(poller.poll(0 if busy else IDLE_POLL_MS))
        for index, (inputs, _) in enumerate(clients):
            if inputs not in ready:
                continue
            while True:
                try:
                    raw = inputs.recv(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                msg = m.decode_input(raw.buffer)
                if msg is None:
                    continue  # dropped and logged: one bad frame must not end the engine
                if isinstance(msg, m.AddRequest):
                    try:
                        loop.add(
                            msg.req_id, msg.prompt_token_ids, msg.params, msg.priority, msg.lora
                        )
                        owner[msg.req_id] = index
                        accepted[index].append(msg.req_id)
                    except InvalidRequestError as exc:
                        reason = m.Rejected(msg.req_id, str(exc), exc.param, exc.code)
                        rejected[index].append(reason)
                elif isinstance(msg, m.Abort):
                    for req_id in msg.req_ids:
                        deltas.extend(loop.abort(req_id))
                elif isinstance(msg, m.LoRACall):
                    reply = lora_call(loop, msg)
                    clients[index][1].send(m.encoder.encode(reply), copy=False)
                else:  # Shutdown: this API process is done
                    open_clients.discard(index)
                    if not open_clients:
                        return
        version = loop.snapshot
        if loop.has_work():
            if idle_snapshot_sent:
                # Out of idle: every API process learns of the work before a step that may
                # never end, or the stall watch of one that holds none of it sees an idle engine.
                loop.refresh_snapshot(force=True)
                for index in open_clients:
                    out = m.Outputs(accepted[index], rejected[index], [], loop.snapshot)
                    clients[index][1].send(m.encoder.encode(out), copy=False)
                    accepted[index], rejected[index] = [], []
                version = loop.snapshot
            deltas.extend(loop.step())
            idle_snapshot_sent = False
        elif not idle_snapshot_sent:
            loop.refresh_snapshot(force=True)  # idle now: the gauges say so at once
            idle_snapshot_sent = True
        snapshot = loop.snapshot if loop.snapshot is not version else None
        routed: list[list] = [[] for _ in clients]
        for delta in deltas:
            delta.prompt_token_ids = []  # the client has each prompt: don't resend it
            client = owner.pop(delta.request_id) if delta.finished else owner.get(delta.request_id)
            if client is not None:
                routed[client].append(delta)
        for index in open_clients:
            if accepted[index] or rejected[index] or routed[index] or snapshot is not None:
                out = m.Outputs(accepted[index], rejected[index], routed[index], snapshot)
                clients[index][1].send(m.encoder.encode(out), copy=False)


def lora_call(loop: StepLoop, call: m.LoRACall) -> m.LoRAReply:
    """Run one add_lora / remove_lora / list_loras between steps. A bad adapter's error goes
    back to the API process; it never ends the engine."""
    engine = loop.engine
    try:
        if call.lora is not None:
            return m.LoRAReply(call.call_id, result=bool(engine.add_lora(call.lora)))
        if call.remove_id is not None:
            return m.LoRAReply(call.call_id, result=bool(engine.remove_lora(call.remove_id)))
        return m.LoRAReply(call.call_id, lora_ids=sorted(engine.list_loras()))
    except Exception as exc:
        if not isinstance(exc, KilnError):
            logger.exception("a LoRA call failed")
        return m.LoRAReply(call.call_id, error=describe(exc))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kiln-engine-core")
    parser.add_argument(
        "--inputs", action="append", required=True, help="ZMQ address to pull requests from"
    )
    parser.add_argument(
        "--outputs", action="append", required=True, help="ZMQ address to push outputs to"
    )
    parser.add_argument("--config", required=True, help="EngineConfig as JSON")
    parser.add_argument("--stream-interval", type=int, default=1)
    parser.add_argument("--parent-pid", type=int, required=True)
    args = parser.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    watch = ParentWatch(args.parent_pid)  # a parent gone while this loads ends it too
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("kiln.startup").setLevel(logging.INFO)  # `kiln serve`'s start-up lines

    if len(args.inputs) != len(args.outputs):
        parser.error("give --inputs and --outputs once per API process")
    ctx = zmq.Context()
    clients: list[tuple[zmq.Socket, zmq.Socket]] = []
    for inputs_address, outputs_address in zip(args.inputs, args.outputs):
        inputs = ctx.socket(zmq.PULL)
        inputs.setsockopt(zmq.RCVHWM, 0)
        inputs.connect(inputs_address)
        outputs = ctx.socket(zmq.PUSH)
        outputs.setsockopt(zmq.SNDHWM, 0)
        outputs.setsockopt(zmq.LINGER, 5000)  # the last message (a failure) must get out
        outputs.connect(outputs_address)
        clients.append((inputs, outputs))

    def tell_everyone(msg: m.EngineOutput) -> None:
        data = m.encoder.encode(msg)
        for _, outputs in clients:
            outputs.send(data)

    try:
        try:
            config = msgspec.json.decode(args.config.encode(), type=EngineConfig)
            from kiln.engine.llm_engine import LLMEngine
            from kiln.engine.step_loop import StepLoop

            loop = StepLoop(LLMEngine(config), args.stream_interval)
        except BaseException as exc:
            if not isinstance(exc, KilnError):
                logger.exception("the engine could not start")
            tell_everyone(m.StartupFailed(describe(exc)))
            if len(clients) > 1:
                # Several API processes may not have bound their sockets yet (each is still
                # starting): the message may never reach them, so the reason is said here.
                print(f"error: {describe(exc)}", file=sys.stderr)
            return 1
        from kiln.engine.step_loop import engine_info

        watch.stop()  # from here the serve loop checks its parent between steps
        info = engine_info(loop.engine)
        tell_everyone(
            m.Ready(
                os.getpid(),
                info.max_model_len,
                info.vocab_size,
                info.default_params,
                info.cache_config,
            )
        )
        try:
            serve(loop, clients, args.parent_pid)
        except BaseException as exc:
            logger.exception("engine step failed")
            tell_everyone(m.EngineDied(describe(exc)))
            return 1
        return 0
    finally:
        for inputs, outputs in clients:
            inputs.close(linger=0)
            outputs.close()
        ctx.term()


if __name__ == "__main__":
    sys.exit(main())
