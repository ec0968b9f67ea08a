"""The Starlette app: routes, error handlers, middleware. `build_app(ServerState)`; uvicorn runs it.

    POST /v1/completions        completions.py        GET /v1/models     the served model (models.py)
                                                      GET /v1/models/{id}, GET /tokenizer_info  (models.py)
    POST /v1/chat/completions   chat.py               GET /health        200 while the engine runs, else 503
    POST /v1/load_lora_adapter, /v1/unload_lora_adapter  lora.py (with --allow-runtime-lora-updating)
    POST /tokenize              text/messages -> ids  GET /metrics       Prometheus (metrics.py)
    POST /detokenize            ids -> text           GET /openapi.json  openapi.py
                                                      GET /dashboard     live plots (dashboard.py), polling
                                                      GET /dashboard/data  their JSON
"""

from __future__ import annotations

import logging

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from jaxserve.server.chat import chat_prompt, check_chat_request, create_chat_completion
from jaxserve.server.completions import create_completion
from jaxserve.server.dashboard import dashboard, dashboard_data
from jaxserve.server.errors import APIError, bad_request
from jaxserve.server.generation import check_model, read_json, run_tokenizer
from jaxserve.server.lora import load_lora_adapter, unload_lora_adapter
from jaxserve.server.metrics import CONTENT_TYPE
from jaxserve.server.middleware import ApiKeys, Gatekeeper, RequestContext
from jaxserve.server.models import list_models, retrieve_model, tokenizer_info
from jaxserve.server.openapi import openapi_document
from jaxserve.server.protocol import ChatCompletionRequest, DetokenizeRequest, TokenizeRequest, parse_request
from jaxserve.server.state import ServerState, server_of

log = logging.getLogger(__name__)


async def health(request: Request) -> Response:
    server = server_of(request)
    if server.lifecycle.draining:
        return JSONResponse({"status": "draining"}, status_code=503)
    if not server.engine.is_alive:
        status = "restarting" if getattr(server.engine, "restarting", False) else "dead"
        return JSONResponse({"status": status, "error": repr(server.engine.error)}, status_code=503)
    return JSONResponse({"status": "ok"})


async def metrics(request: Request) -> Response:
    return Response(server_of(request).metrics.exposition(), media_type=CONTENT_TYPE)


async def tokenize_route(request: Request) -> Response:
    server = server_of(request)
    body = parse_request(TokenizeRequest, await read_json(request))
    check_model(server, body.model)
    ids = await run_tokenizer(tokenize_ids, server, body)
    result = {"count": len(ids), "max_model_len": server.max_model_len, "tokens": ids}
    if body.return_token_strs:
        result["token_strs"] = [server.token_text.text_of(t) for t in ids]
    return JSONResponse(result)


def tokenize_ids(server: ServerState, body: TokenizeRequest) -> list[int]:
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("give exactly one of prompt and messages", param="prompt")
    if body.prompt is not None:
        add_special = True if body.add_special_tokens is None else body.add_special_tokens
        return server.tokenizer.encode(body.prompt, add_special_tokens=add_special)
    chat = ChatCompletionRequest(messages=body.messages, add_generation_prompt=body.add_generation_prompt)
    check_chat_request(chat)
    return chat_prompt(server, chat).token_ids


async def detokenize_route(request: Request) -> Response:
    server = server_of(request)
    body = parse_request(DetokenizeRequest, await read_json(request))
    check_model(server, body.model)
    bad = next((t for t in body.tokens if t >= server.vocab_size), None)
    if bad is not None:
        raise bad_request(f"tokens holds id {bad}, outside the vocabulary [0, {server.vocab_size})", param="tokens")
    return JSONResponse({"prompt": await run_tokenizer(server.tokenizer.decode, body.tokens)})


async def openapi(request: Request) -> Response:
    return JSONResponse(openapi_document())


ROUTES = (
    Route("/v1/completions", create_completion, methods=["POST"]),
    Route("/v1/chat/completions", create_chat_completion, methods=["POST"]),
    Route("/v1/models", list_models, methods=["GET"]),
    Route("/v1/models/{model_id:path}", retrieve_model, methods=["GET"]),
    Route("/tokenizer_info", tokenizer_info, methods=["GET"]),
    Route("/v1/load_lora_adapter", load_lora_adapter, methods=["POST"]),
    Route("/v1/unload_lora_adapter", unload_lora_adapter, methods=["POST"]),
    Route("/tokenize", tokenize_route, methods=["POST"]),
    Route("/detokenize", detokenize_route, methods=["POST"]),
    Route("/health", health, methods=["GET"]),
    Route("/metrics", metrics, methods=["GET"]),
    Route("/openapi.json", openapi, methods=["GET"]),
    Route("/dashboard", dashboard, methods=["GET"]),
    Route("/dashboard/data", dashboard_data, methods=["GET"]),
)


async def api_error(request: Request, exc: APIError) -> Response:
    return exc.response()


async def http_error(request: Request, exc: HTTPException) -> Response:
    return APIError(exc.status_code, exc.detail, type="invalid_request_error",
                    headers=dict(exc.headers or {})).response()


async def client_gone(request: Request, exc: ClientDisconnect) -> Response:
    return Response(status_code=499)  # the client left while sending its body; nobody reads this


def build_app(server: ServerState) -> Starlette:
    """Any other exception is answered by RequestContext (a 500 with the request id, logged once)."""
    config = server.config
    middleware = [
        Middleware(RequestContext, metrics=server.metrics, lifecycle=server.lifecycle,
                   routes=frozenset(route.path for route in ROUTES)),
        Middleware(Gatekeeper, lifecycle=server.lifecycle, api_keys=ApiKeys(config.api_key, config.api_key_file),
                   max_body_bytes=config.max_request_bytes, metrics=server.metrics,
                   body_timeout=config.body_timeout),
    ]
    handlers = {APIError: api_error, HTTPException: http_error, ClientDisconnect: client_gone}
    app = Starlette(routes=list(ROUTES), middleware=middleware, exception_handlers=handlers)
    app.state.server = server
    return app
