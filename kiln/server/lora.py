"""LoRA adapters by name: a request's `model` naming one routes it to that adapter, /v1/models
lists them, and vLLM's `/v1/load_lora_adapter` / `/v1/unload_lora_adapter` change them at run
time. Each name gets the next `lora_int_id` (1, 2, ...); a name loaded again after an unload gets
a new id, so the engine never serves an old adapter's weights under it."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from fastapi import APIRouter
from starlette.responses import PlainTextResponse

from kiln.errors import LoRAError
from kiln.lora.request import LoRARequest
from kiln.server.errors import APIError
from kiln.server.lora_modules import LoRAModule
from kiln.server.protocol import (
    ERROR_RESPONSES,
    LoadLoRAAdapterRequest,
    UnloadLoRAAdapterRequest,
)
from kiln.server.state import ServedEngine, ServerState, State, check_text

router = APIRouter()


@dataclass(frozen=True)
class ServedAdapter:
    request: LoRARequest
    parent: str  # /v1/models' `parent`: the base model it was trained on
    created: int


class LoRAAdapters:
    """The adapters one API process serves. Loads and unloads are serialized: two loads of one
    name cannot both pass the "already loaded" check."""

    def __init__(self, base_model_name: str, runtime_updates: bool = True) -> None:
        self.base_model_name = base_model_name
        # Off with several API processes: each keeps its own names, which would drift apart.
        self.runtime_updates = runtime_updates
        self._by_name: dict[str, ServedAdapter] = {}
        self._next_id = 1
        self._lock = asyncio.Lock()

    def get(self, name: str) -> LoRARequest | None:
        served = self._by_name.get(name)
        return None if served is None else served.request

    def names(self) -> list[str]:
        return list(self._by_name)

    def cards(self, max_model_len: int) -> list[dict]:
        """The /v1/models entries of the adapters, as vLLM lists them."""
        return [
            {
                "id": name,
                "object": "model",
                "created": served.created,
                "owned_by": "kiln",
                "root": served.request.lora_path,
                "parent": served.parent,
                "max_model_len": max_model_len,
            }
            for name, served in self._by_name.items()
        ]

    async def load(self, engine: ServedEngine, module: LoRAModule) -> LoRARequest:
        """Read and check the adapter in the engine, then serve it under its name. LoRAError
        (a bad adapter) and a taken name raise APIError 400; the server keeps serving."""
        async with self._lock:
            if module.name == self.base_model_name or module.name in self._by_name:
                raise APIError(
                    400,
                    f"The LoRA adapter `{module.name}` is already loaded"
                    if module.name in self._by_name
                    else f"`{module.name}` is the base model's name",
                    param="lora_name",
                    code="lora_already_loaded",
                )
            request = LoRARequest(module.name, self._next_id, module.path)
            try:
                await engine.add_lora(request)
            except LoRAError as exc:
                raise APIError(400, str(exc), param="lora_path", code="invalid_lora") from None
            self._next_id += 1
            parent = module.base_model_name or self.base_model_name
            self._by_name[module.name] = ServedAdapter(request, parent, int(time.time()))
            return request

    async def unload(self, engine: ServedEngine, name: str) -> None:
        """Stop serving `name` and drop its weights from the engine; an unknown name is a 404,
        one the engine refuses to drop (a request runs with it) a 400."""
        async with self._lock:
            served = self._by_name.get(name)
            if served is None:
                raise APIError(
                    404,
                    f"The LoRA adapter `{name}` is not loaded",
                    param="lora_name",
                    code="lora_not_found",
                )
            try:
                await engine.remove_lora(served.request.lora_int_id)
            except LoRAError as exc:  # in use by a running request: it stays served
                raise APIError(400, str(exc), param="lora_name", code="lora_in_use") from None
            del self._by_name[name]


async def load_modules(state: ServerState, modules: tuple[LoRAModule, ...]) -> None:
    """The adapters of `--lora-modules`, loaded before the server takes requests."""
    assert state.adapters is not None
    for module in modules:
        try:
            await state.adapters.load(state.engine, module)
        except APIError as exc:
            raise LoRAError(f"--lora-modules {module.name}={module.path}: {exc.message}") from None
    state.metrics.set_adapters(state.adapters.names())


def _adapters(state: ServerState) -> LoRAAdapters:
    if state.adapters is None:
        raise APIError(
            404,
            "LoRA adapters are not served: start the server with --enable-lora",
            code="not_supported",
        )
    if not state.adapters.runtime_updates:
        raise APIError(
            400,
            "adapters cannot be loaded or unloaded at run time with --api-server-count above 1 "
            "(each API process keeps its own names): give them with --lora-modules",
            code="not_supported",
        )
    return state.adapters


@router.post("/v1/load_lora_adapter", responses=ERROR_RESPONSES)
async def load_lora_adapter(body: LoadLoRAAdapterRequest, state: State) -> PlainTextResponse:
    """vLLM's endpoint: read `lora_path` (PEFT's format) and serve it as `lora_name`."""
    adapters = _adapters(state)
    check_text(body.lora_name, "lora_name")
    check_text(body.lora_path, "lora_path")
    await adapters.load(state.engine, LoRAModule(body.lora_name, body.lora_path))
    state.metrics.set_adapters(adapters.names())
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter", responses=ERROR_RESPONSES)
async def unload_lora_adapter(body: UnloadLoRAAdapterRequest, state: State) -> PlainTextResponse:
    """vLLM's endpoint: stop serving `lora_name`."""
    adapters = _adapters(state)
    await adapters.unload(state.engine, body.lora_name)
    state.metrics.set_adapters(adapters.names())
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
