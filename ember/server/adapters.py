"""LoRA adapters at run time: POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's
names and bodies). Both sit behind the API key, as every model endpoint does. /v1/models lists
the loaded adapters, each with its base model as `parent` (openai.py)."""
from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from ember.errors import ConfigError, InvalidRequest
from ember.server.protocol import LoadLoraAdapterRequest, UnloadLoraAdapterRequest
from ember.server.state import read_json_body, server_state

router = APIRouter()


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(request: Request) -> JSONResponse:
    state = server_state(request)
    body = await read_json_body(request, LoadLoraAdapterRequest)
    if body.lora_name == state.model_name or body.lora_name in state.engine.lora_names():
        raise InvalidRequest(f"the name {body.lora_name!r} is taken (the base model or a "
                             "loaded adapter); unload it first or choose another",
                             param="lora_name")
    try:
        await state.engine.load_lora(body.lora_name, body.lora_path)
    except ConfigError as e:  # the file is missing, not a LoRA, or not for this model
        raise InvalidRequest(str(e), param="lora_path") from e
    return JSONResponse({"status": "loaded", "lora_name": body.lora_name})


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(request: Request) -> JSONResponse:
    state = server_state(request)
    body = await read_json_body(request, UnloadLoraAdapterRequest)
    state.engine.unload_lora(body.lora_name)
    return JSONResponse({"status": "unloaded", "lora_name": body.lora_name})
