"""The streaming hot path without a model: SSE frames built from a pre-serialized head equal
`sse`'s byte for byte, and deltas that queued up while the event loop was busy come out as one
batch (one socket write), in order, with an engine failure raised after what preceded it."""

from __future__ import annotations

import asyncio

import orjson
import pytest

from kiln.engine.async_engine import EngineDeadError, RequestStream, _Stream
from kiln.outputs import CompletionOutput, RequestOutput
from kiln.sampling_params import SamplingParams
from kiln.server.generation import ChunkFrames, EngineRequest, Generation, sse
from kiln.server.lifecycle import Lifecycle
from kiln.server.metrics import RequestTimer, ServerMetrics


@pytest.mark.parametrize(
    "choice",
    [
        {"index": 0, "text": "héllo ✓", "logprobs": None, "finish_reason": None},
        {"index": 3, "delta": {"content": ""}, "logprobs": {"content": [{1: -0.5}]}},
        {"index": 1, "text": "", "logprobs": {"top_logprobs": [{"a": float("nan")}]}},
    ],
)
def test_chunk_frames_equal_sse(choice):
    head = {"id": "cmpl-1", "object": "text_completion", "created": 17, "model": "m/ö"}
    frame = ChunkFrames(head).chunk(choice)
    assert frame == sse({**head, "choices": [choice]})
    assert orjson.loads(frame[len(b"data: ") :])["choices"] == [
        orjson.loads(orjson.dumps(choice, option=orjson.OPT_NON_STR_KEYS))
    ]


class _Engine:
    def __init__(self) -> None:
        self._streams: dict = {}
        self.aborted: list[str] = []

    def abort(self, req_id: str) -> None:
        self.aborted.append(req_id)


def _delta(req_id: str, token: int, finished: bool = False) -> RequestOutput:
    out = CompletionOutput(0, f"t{token}", [token], None, "length" if finished else None, None)
    return RequestOutput(req_id, None, [1, 2], [out], finished)


def _generation(items_per_request: list[list[object]]) -> tuple[Generation, _Engine]:
    loop = asyncio.get_running_loop()
    engine = _Engine()
    metrics = ServerMetrics("m", 64, {"block_size": "16"})
    lifecycle = Lifecycle(max_waiting=16)
    gen = Generation(engine, lifecycle, metrics, len(items_per_request))
    for i, items in enumerate(items_per_request):
        req_id = f"r{i}"
        queue: asyncio.Queue = asyncio.Queue()
        for item in items:
            queue.put_nowait(item)
        accepted = loop.create_future()
        accepted.set_result(None)
        engine._streams[req_id] = None
        gen.requests.append(EngineRequest(req_id, [1, 2], SamplingParams(max_tokens=8)))
        gen._timers.append(RequestTimer(metrics, 2, 1))
        gen._started.append(set())
        gen._done.append(False)
        lifecycle.in_flight.add(req_id)
        lifecycle.num_waiting += 1
        gen.streams.append(RequestStream(engine, req_id, _Stream(loop, queue, accepted)))
    gen._admitted = True
    return gen, engine


def test_queued_deltas_come_as_one_batch_in_order():
    async def go():
        items = [_delta("r0", 1), _delta("r0", 2), _delta("r0", 3, finished=True)]
        gen, engine = _generation([items])
        batches = [b async for b in gen.batches()]
        assert [[d.outputs[0].token_ids[0] for _, d in b] for b in batches] == [[1, 2, 3]]
        assert engine.aborted == [] and not gen.lifecycle.in_flight
        assert gen.lifecycle.num_waiting == 0

    asyncio.run(go())


def test_a_failure_comes_after_the_deltas_before_it():
    async def go():
        items = [_delta("r0", 1), _delta("r0", 2), EngineDeadError("gone"), _delta("r0", 9)]
        gen, _ = _generation([items])
        seen = []
        with pytest.raises(EngineDeadError):
            async for batch in gen.batches():
                seen += [d.outputs[0].token_ids[0] for _, d in batch]
        assert seen == [1, 2]

        # Several requests (a list of prompts): merged from their pumps, the same rule.
        items = [[_delta("r0", 1), EngineDeadError("gone")], [_delta("r1", 5)]]
        gen, _ = _generation(items)
        seen = []
        with pytest.raises(EngineDeadError):
            async for batch in gen.batches():
                seen += [(i, d.outputs[0].token_ids[0]) for i, d in batch]
        assert (0, 1) in seen

    asyncio.run(go())


def test_deltas_of_several_requests_keep_each_requests_order():
    async def go():
        items = [
            [_delta("r0", 1), _delta("r0", 2, finished=True)],
            [_delta("r1", 7), _delta("r1", 8), _delta("r1", 9, finished=True)],
        ]
        gen, _ = _generation(items)
        seen = [(i, d.outputs[0].token_ids[0]) async for i, d in gen.deltas()]
        assert [t for i, t in seen if i == 0] == [1, 2]
        assert [t for i, t in seen if i == 1] == [7, 8, 9]
        assert not gen.lifecycle.in_flight

    asyncio.run(go())
