"""/openapi.json: the routes, with request bodies derived from the same models the server validates with
(protocol.py through schema.request_schema), so the document cannot drift from the validation."""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxserve import __version__
from jaxserve.server.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from jaxserve.server.schema import request_schema

ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type"],
    "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                   "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}
USAGE = {"type": "object", "properties": {"prompt_tokens": {"type": "integer"},
                                          "completion_tokens": {"type": "integer"},
                                          "total_tokens": {"type": "integer"}}}
COMPLETION = {"type": "object", "required": ["id", "object", "created", "model", "choices"], "properties": {
    "id": {"type": "string"}, "object": {"type": "string"}, "created": {"type": "integer"},
    "model": {"type": "string"}, "choices": {"type": "array", "items": {"type": "object"}}, "usage": USAGE}}
MODELS = {"type": "object", "properties": {"object": {"type": "string"},
                                           "data": {"type": "array", "items": {"type": "object"}}}}
TOKENIZED = {"type": "object", "properties": {"count": {"type": "integer"}, "max_model_len": {"type": "integer"},
                                              "tokens": {"type": "array", "items": {"type": "integer"}}}}
DETOKENIZED = {"type": "object", "properties": {"prompt": {"type": "string"}}}
HEALTH = {"type": "object", "properties": {"status": {"type": "string"}}}


@dataclasses.dataclass(frozen=True)
class Operation:
    path: str
    method: str
    summary: str
    response: dict
    request: type | None = None
    streams: bool = False
    needs_key: bool = True
    errors: tuple[int, ...] = (400, 401, 413, 429, 500, 503)
    media_type: str = "application/json"


OPERATIONS = (
    Operation("/v1/completions", "post", "Create a completion (OpenAI legacy completions)", COMPLETION,
              CompletionRequest, streams=True),
    Operation("/v1/chat/completions", "post", "Create a chat completion", COMPLETION, ChatCompletionRequest,
              streams=True),
    Operation("/v1/models", "get", "List the served model", MODELS, errors=(401,)),
    Operation("/tokenize", "post", "Text or chat messages to token ids", TOKENIZED, TokenizeRequest,
              errors=(400, 401, 413, 503)),
    Operation("/detokenize", "post", "Token ids to text", DETOKENIZED, DetokenizeRequest,
              errors=(400, 401, 413, 503)),
    Operation("/health", "get", "200 while the engine runs; 503 once it died or the server drains", HEALTH,
              needs_key=False, errors=(503,)),
    Operation("/metrics", "get", "Prometheus metrics", {"type": "string"}, needs_key=False, errors=(),
              media_type="text/plain"),
    Operation("/openapi.json", "get", "This document", {"type": "object"}, needs_key=False, errors=()),
    Operation("/dashboard", "get", "Live dashboard (HTML)", {"type": "string"}, needs_key=False, errors=(),
              media_type="text/html"),
    Operation("/dashboard/data", "get", "The dashboard's data: throughput totals, latency percentiles, KV usage, "
              "queues, bottleneck verdict (docs/metrics.md)", {"type": "object"}, needs_key=False, errors=()),
)


def openapi_document() -> dict[str, Any]:
    paths: dict[str, dict] = {}
    for op in OPERATIONS:
        paths.setdefault(op.path, {})[op.method] = _operation(op)
    schemas = {model.__name__: request_schema(model) for model in
               (CompletionRequest, ChatCompletionRequest, TokenizeRequest, DetokenizeRequest)}
    schemas["Error"] = ERROR
    return {
        "openapi": "3.1.0",
        "info": {"title": "jaxserve", "version": __version__,
                 "description": "OpenAI-compatible API of a jaxserve server. Unknown request fields are ignored; "
                                "a field set to null takes its default."},
        "paths": paths,
        "components": {"schemas": schemas,
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
    }


def _operation(op: Operation) -> dict:
    content = {op.media_type: {"schema": op.response}}
    if op.streams:
        content["text/event-stream"] = {"schema": {"type": "string"},
                                        "description": "with stream: true; `data: {chunk}` events, then "
                                                       "`data: [DONE]`"}
    responses = {"200": {"description": "OK", "content": content}}
    for status in op.errors:
        responses[str(status)] = {"description": ERROR_DESCRIPTIONS[status],
                                  "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
    operation: dict[str, Any] = {"summary": op.summary, "operationId": _operation_id(op), "responses": responses}
    if op.request is not None:
        ref = {"$ref": f"#/components/schemas/{op.request.__name__}"}
        operation["requestBody"] = {"required": True, "content": {"application/json": {"schema": ref}}}
    if op.needs_key:
        operation["security"] = [{"bearer": []}, {}]
    return operation


def _operation_id(op: Operation) -> str:
    return op.method + op.path.replace("/", "_").replace(".", "_")


ERROR_DESCRIPTIONS = {
    400: "invalid request; error.param names the field",
    401: "missing or wrong API key (when the server has one)",
    413: "request body over the size limit",
    429: "waiting queue full; retry after the Retry-After header's seconds",
    500: "the engine failed while generating",
    503: "the server is draining or the engine is not running",
}
