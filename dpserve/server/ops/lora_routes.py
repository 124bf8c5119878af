"""Admin routes for LoRA adapters, vLLM's shape (mounted by `admin_router`).

Scope:

    POST /v1/load_lora_adapter    {"lora_name", "lora_path"}: load the PEFT adapter
                                  in directory `lora_path` (on the server's
                                  filesystem) on every serving rank, or on none
                                  (`dpserve.frontend.lora.load_adapter`); every API
                                  server then accepts `model: <lora_name>`.
    POST /v1/unload_lora_adapter  {"lora_name"}: unload it everywhere (requests in
                                  flight with it finish).

200 with a one-line text (vLLM's); 400 for a bad body, LoRA off, a name already
loaded (vLLM answers 400 there too) or an adapter some rank refused (not an
adapter, rank over --max-lora-rank, a module the model lacks, ...: the message
names the rank and the problem; nothing stays loaded); 404 for unloading a
name not loaded; 503 when a rank could not answer.

Not here: the API key and JSON-only posts (`admin_router`'s dependencies), the
two phases (`dpserve.frontend.lora`).
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse

from dpserve.frontend.async_llm import AsyncLLM
from dpserve.frontend.lora import LoRAError, load_adapter, unload_adapter
from dpserve.server.errors import APIError
from dpserve.server.openai.protocol import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest


def lora_router(async_llm: AsyncLLM) -> APIRouter:
    """POST /v1/load_lora_adapter and /v1/unload_lora_adapter (module docstring)."""
    router = APIRouter(prefix="/v1")
    cluster = async_llm.cluster

    @router.post("/load_lora_adapter")
    async def load(request: Request) -> PlainTextResponse:
        body = LoadLoRAAdapterRequest.model_validate_json(await request.body(), strict=True)
        try:
            await load_adapter(cluster, body.lora_name, body.lora_path)
        except LoRAError as e:
            raise _api_error(e) from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added "
                                 f"successfully.")

    @router.post("/unload_lora_adapter")
    async def unload(request: Request) -> PlainTextResponse:
        body = UnloadLoRAAdapterRequest.model_validate_json(await request.body(), strict=True)
        try:
            await unload_adapter(cluster, body.lora_name)
        except LoRAError as e:
            raise _api_error(e) from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed "
                                 f"successfully.")

    return router


def _api_error(e: LoRAError) -> APIError:
    return APIError(e.status, str(e), type="invalid_request_error" if e.status < 500
                    else "server_error", code=e.code,
                    param="lora_name" if e.status in (400, 404) and "rank" not in str(e)
                    else None)
