"""Pure ASGI middleware (Starlette's BaseHTTPMiddleware would buffer streamed responses), outermost first:

    RequestContext   request id (X-Request-Id in and out), one access-log line per request, HTTP metrics,
                     the in-flight count that draining waits on
    Gatekeeper       on API routes: draining (503), API key (401), body-size limit (413)
"""

from __future__ import annotations

import hmac
import logging
import re
import time
import uuid

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from jaxserve.server.errors import APIError, payload_too_large, service_unavailable, unauthorized
from jaxserve.server.lifecycle import Lifecycle
from jaxserve.server.metrics import ServerMetrics

access_log = logging.getLogger("jaxserve.access")

REQUEST_ID_HEADER = "x-request-id"
CLIENT_REQUEST_ID = re.compile(r"[\x21-\x7e]{1,128}")  # printable ASCII, no spaces: safe to log and echo
API_PATHS = ("/v1/", "/tokenize", "/detokenize")


def is_api_path(path: str) -> bool:
    return path.startswith(API_PATHS)


class RequestContext:
    def __init__(self, app: ASGIApp, metrics: ServerMetrics, lifecycle: Lifecycle, routes: frozenset[str]):
        self.app = app
        self.metrics = metrics
        self.lifecycle = lifecycle
        self.routes = routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = _request_id(Headers(scope=scope))
        scope.setdefault("state", {})["request_id"] = request_id
        status = [500]

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                message["headers"] = [*message.get("headers", []), (b"x-request-id", request_id.encode())]
            await send(message)

        started = time.perf_counter()
        self.lifecycle.request_started()
        try:
            await self.app(scope, receive, send_with_id)
        finally:
            self.lifecycle.request_finished()
            self._record(scope, request_id, status[0], time.perf_counter() - started)

    def _record(self, scope: Scope, request_id: str, status: int, seconds: float) -> None:
        route = scope["path"] if scope["path"] in self.routes else "other"
        self.metrics.observe_http(scope["method"], route, status)
        client = scope.get("client") or ("-", 0)
        access_log.info('%s:%s "%s %s HTTP/%s" %d %.1fms request_id=%s', client[0], client[1], scope["method"],
                        scope["path"], scope.get("http_version", "1.1"), status, seconds * 1000, request_id)


def _request_id(headers: Headers) -> str:
    incoming = headers.get(REQUEST_ID_HEADER, "")
    return incoming if CLIENT_REQUEST_ID.fullmatch(incoming) else uuid.uuid4().hex


class Gatekeeper:
    def __init__(self, app: ASGIApp, lifecycle: Lifecycle, api_key: str | None, max_body_bytes: int,
                 metrics: ServerMetrics):
        self.app = app
        self.lifecycle = lifecycle
        self.expected_authorization = f"Bearer {api_key}".encode() if api_key else None
        self.max_body_bytes = max_body_bytes
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not is_api_path(scope["path"]):
            await self.app(scope, receive, send)
            return
        try:
            self._admit(Headers(scope=scope))
        except APIError as error:
            await error.response()(scope, receive, send)
            return
        await self.app(scope, self._limited(receive), send)

    def _admit(self, headers: Headers) -> None:
        if self.lifecycle.draining:
            self.metrics.observe_rejected("draining")
            raise service_unavailable("the server is shutting down and accepts no new requests")
        if self.expected_authorization is not None:
            provided = headers.get("authorization", "").encode()
            if not hmac.compare_digest(provided, self.expected_authorization):
                raise unauthorized()
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            raise payload_too_large(self.max_body_bytes)

    def _limited(self, receive: Receive) -> Receive:
        """Counts body bytes as they arrive (a chunked body has no Content-Length to check up front)."""
        received = [0]

        async def limited_receive() -> Message:
            message = await receive()
            if message["type"] == "http.request":
                received[0] += len(message.get("body", b""))
                if received[0] > self.max_body_bytes:
                    raise payload_too_large(self.max_body_bytes)
            return message

        return limited_receive
