"""What a client asks before it sends work: the served models and the tokenizer, as vLLM answers them.

    GET /v1/models             the served names (without --served-model-name: the checkpoint directory's base
                               name; its path is accepted as `model` too, but not listed)
    GET /v1/models/{id}        one of them (openai's client.models.retrieve); 404 for a name not served
    GET /tokenizer_info        tokenizer_config.json as vLLM serves it: special tokens, chat template,
                               model_max_length (= the served max_model_len), so lm-eval's remote tokenizer
                               needs no local copy of the model

Every model card carries `max_model_len`, the longest prompt + completion the server accepts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from jaxserve.server.errors import APIError
from jaxserve.server.lora import adapter_models
from jaxserve.server.state import ServerState, server_of
from jaxserve.tokenizer.files import TOKENIZER_CONFIG, chat_templates_in, read_json


def listed_names(server: ServerState) -> tuple[str, ...]:
    """--served-model-name lists every name given; the default lists the base name only."""
    return server.model_names if server.config.served_model_name else server.model_names[:1]


def model_card(server: ServerState, name: str) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": server.created, "owned_by": "jaxserve", "root": server.root,
            "parent": None, "max_model_len": server.max_model_len}


async def list_models(request: Request) -> Response:
    """The served names, then the loaded LoRA adapters (parent: the base model)."""
    server = server_of(request)
    cards = [model_card(server, name) for name in listed_names(server)] + adapter_models(server)
    return JSONResponse({"object": "list", "data": cards})


async def retrieve_model(request: Request) -> Response:
    server = server_of(request)
    name = request.path_params["model_id"]
    adapter = next((card for card in adapter_models(server) if card["id"] == name), None)
    if adapter is not None:
        return JSONResponse(adapter)
    if name not in server.model_names:
        raise APIError(404, f"the model {name!r} does not exist; this server serves "
                            f"{', '.join(listed_names(server))}", param="model", code="model_not_found")
    return JSONResponse(model_card(server, name))


async def tokenizer_info(request: Request) -> Response:
    return JSONResponse(tokenizer_config(server_of(request)))


def tokenizer_config(server: ServerState) -> dict[str, Any]:
    """vLLM's /tokenizer_info: the tokenizer's config with its special tokens as strings and the chat template
    (the default one) as text. Read from the model directory per call: a few kilobytes of JSON."""
    directory = Path(server.root)
    on_disk = read_json(directory / TOKENIZER_CONFIG)
    config = {key: value for key, value in on_disk.items() if key not in ("added_tokens_decoder", "chat_template")}
    templates = chat_templates_in(directory, on_disk)
    tokenizer = server.tokenizer
    return {
        **config,
        "tokenizer_class": config.get("tokenizer_class", "PreTrainedTokenizerFast"),
        **tokenizer.special_tokens.named,
        "chat_template": templates.get("default", next(iter(templates.values()), None)),
        "model_max_length": server.max_model_len,
        "max_model_len": server.max_model_len,
        "vocab_size": server.vocab_size,
    }
