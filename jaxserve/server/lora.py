"""LoRA adapters over HTTP, as vLLM serves them: a request's `model` names an adapter (generation.check_model),
/v1/models lists adapters with the base model as `parent`, and, with --allow-runtime-lora-updating, adapters are
loaded and unloaded at run time:

    POST /v1/load_lora_adapter    {"lora_name": "sql", "lora_path": "/adapters/sql"}   200 text | 400 | 404
    POST /v1/unload_lora_adapter  {"lora_name": "sql"}                                 200 text | 404 | 409

Both sit under /v1, behind the API key. Without the flag they answer 404 (vLLM does not serve them then). An
adapter in use by unfinished requests is not unloaded: 409, retry when they have finished.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response

from jaxserve.lora.adapter import LoraError
from jaxserve.lora.registry import LoraInUseError
from jaxserve.server.errors import APIError, bad_request
from jaxserve.server.generation import read_json
from jaxserve.server.protocol import LoadLoraAdapterRequest, UnloadLoraAdapterRequest, parse_request
from jaxserve.server.state import ServerState, server_of


def adapter_models(server: ServerState) -> list[dict]:
    """/v1/models entries of the loaded adapters."""
    return [{"id": info.name, "object": "model", "created": server.created, "owned_by": "jaxserve",
             "root": info.path, "parent": server.model_name, "max_model_len": server.max_model_len}
            for info in server.engine.loras()]


async def load_lora_adapter(request: Request) -> Response:
    server = server_of(request)
    check_runtime_updating(server)
    body = parse_request(LoadLoraAdapterRequest, await read_json(request))
    try:
        await server.engine.load_lora(body.lora_name, body.lora_path)
    except LoraError as exc:
        raise bad_request(str(exc), param="lora_path", code="invalid_lora_adapter") from None
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


async def unload_lora_adapter(request: Request) -> Response:
    server = server_of(request)
    check_runtime_updating(server)
    body = parse_request(UnloadLoraAdapterRequest, await read_json(request))
    try:
        await server.engine.unload_lora(body.lora_name)
    except KeyError:
        raise APIError(404, f"The lora adapter '{body.lora_name}' cannot be found.", param="lora_name",
                       code="lora_adapter_not_found") from None
    except LoraInUseError as exc:
        raise APIError(409, str(exc), param="lora_name", code="lora_adapter_in_use") from None
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


def check_runtime_updating(server: ServerState) -> None:
    if not server.config.allow_runtime_lora_updating:
        raise APIError(404, "loading and unloading LoRA adapters at run time is off: start the server with "
                            "--allow-runtime-lora-updating (or JAXSERVE_ALLOW_RUNTIME_LORA_UPDATING=true)",
                       code="runtime_lora_updating_disabled")
