"""Pure ASGI middleware (Starlette's BaseHTTPMiddleware would buffer streamed responses), outermost first:

    RequestContext   request id (X-Request-Id in and out), one access-log line per request, HTTP metrics,
                     the in-flight count that draining waits on, and the one place an unexpected exception
                     becomes a 500: JSON, with the request id, logged once, the connection kept
    Gatekeeper       on API routes: draining (503), API keys (401), body-size limit (413), body-read deadline
                     (408), and a body still arriving when draining starts (503: shutdown does not wait for it)
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import re
import time
import uuid

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from jaxserve.config import ConfigError
from jaxserve.server.errors import (APIError, internal_error, payload_too_large, request_timeout, service_unavailable,
                                   unauthorized)
from jaxserve.server.lifecycle import Lifecycle
from jaxserve.server.metrics import ServerMetrics

access_log = logging.getLogger("jaxserve.access")
log = logging.getLogger(__name__)

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
                scope["state"]["response_started"] = True
                message["headers"] = [*message.get("headers", []), (b"x-request-id", request_id.encode())]
            await send(message)

        started = time.perf_counter()
        self.lifecycle.request_started()
        try:
            await self.app(scope, receive, send_with_id)
        except Exception as exc:  # noqa: BLE001 - answered here, so Starlette's outer handler never re-raises it
            status[0] = await _answer_unexpected(scope, receive, send_with_id, exc, request_id,
                                                 response_started=started_response(scope))
        finally:
            self.lifecycle.request_finished()
            self._record(scope, request_id, status[0], time.perf_counter() - started)

    def _record(self, scope: Scope, request_id: str, status: int, seconds: float) -> None:
        route = scope["path"] if scope["path"] in self.routes else "other"
        self.metrics.observe_http(scope["method"], route, status)
        client = scope.get("client") or ("-", 0)
        access_log.info('%s:%s "%s %s HTTP/%s" %d %.1fms request_id=%s', client[0], client[1], scope["method"],
                        scope["path"], scope.get("http_version", "1.1"), status, seconds * 1000, request_id)


def started_response(scope: Scope) -> bool:
    return scope["state"].get("response_started", False)


async def _answer_unexpected(scope: Scope, receive: Receive, send: Send, exc: Exception, request_id: str,
                             response_started: bool) -> int:
    """A 500 for an exception no handler answered. After the response started there is no status left to
    send: the body is ended so the connection stays usable (a streamed response ends with its own error
    event: jaxserve.server.responses)."""
    log.error("unhandled error in %s %s (request_id=%s)", scope["method"], scope["path"], request_id,
              exc_info=exc)
    try:
        if response_started:
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return 500
        await internal_error(f"{type(exc).__name__}: {exc}").response()(scope, receive, send)
    except Exception:  # noqa: BLE001 - the client is gone, or the response had already ended
        log.debug("could not finish the response of request %s", request_id, exc_info=True)
    return 500


def _request_id(headers: Headers) -> str:
    incoming = headers.get(REQUEST_ID_HEADER, "")
    return incoming if CLIENT_REQUEST_ID.fullmatch(incoming) else uuid.uuid4().hex


class ApiKeys:
    """The keys a request may bear: those given (--api-key, repeatable) and those of a keys file (one per line,
    '#' comments), re-read when it changes, so keys rotate without a restart: add the new key, move the
    clients, remove the old one. Keys are compared as UTF-8 bytes, against the header's raw bytes."""

    RECHECK_SECONDS = 1.0  # how often the file's mtime is looked at, at most

    def __init__(self, keys: str | tuple[str, ...] | None = None, path: str | None = None):
        keys = (keys,) if isinstance(keys, str) else tuple(keys or ())
        self._given = tuple(key.encode() for key in keys if key)
        self._path = path
        self._from_file: tuple[bytes, ...] = ()
        self._mtime: int | None = None
        self._checked = -float("inf")
        if path is not None:
            self._reload(required=True)

    @property
    def enabled(self) -> bool:
        return bool(self._given) or self._path is not None

    def accepts(self, authorization: bytes) -> bool:
        """`Authorization: Bearer KEY`, the scheme in any case (RFC 7235)."""
        scheme, _, token = authorization.strip().partition(b" ")
        token = token.strip()
        if scheme.lower() != b"bearer" or not token:
            return False
        matched = False
        for key in self._current():  # every key is compared: the time taken says nothing about which matched
            matched |= hmac.compare_digest(token, key)
        return matched

    def _current(self) -> tuple[bytes, ...]:
        if self._path is not None and time.monotonic() - self._checked >= self.RECHECK_SECONDS:
            self._reload(required=False)
        return self._given + self._from_file

    def _reload(self, required: bool) -> None:
        self._checked = time.monotonic()
        try:
            mtime = os.stat(self._path).st_mtime_ns
            if mtime == self._mtime:
                return
            with open(self._path, encoding="utf-8") as file:
                lines = [line.split("#", 1)[0].strip() for line in file]
        except (OSError, UnicodeDecodeError) as exc:
            if required:
                raise ConfigError(f"--api-key-file {self._path}: {exc}") from None
            log.error("API keys file %s cannot be read (%s); keeping the keys read before", self._path, exc)
            return
        self._from_file, self._mtime = tuple(line.encode() for line in lines if line), mtime
        log.info("API keys file %s: %d key(s)", self._path, len(self._from_file))


class Gatekeeper:
    def __init__(self, app: ASGIApp, lifecycle: Lifecycle, api_keys: ApiKeys, max_body_bytes: int,
                 metrics: ServerMetrics, body_timeout: float | None = None):
        self.app = app
        self.lifecycle = lifecycle
        self.api_keys = api_keys
        self.max_body_bytes = max_body_bytes
        self.body_timeout = body_timeout
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not is_api_path(scope["path"]):
            await self.app(scope, receive, send)
            return
        try:
            self._admit(scope)
        except APIError as error:
            await error.response()(scope, receive, send)
            return
        await self.app(scope, self._limited(receive), send)

    def _admit(self, scope: Scope) -> None:
        if self.lifecycle.draining:
            self.metrics.observe_rejected("draining")
            raise service_unavailable("the server is shutting down and accepts no new requests")
        if self.api_keys.enabled:
            authorization = next((value for name, value in scope["headers"] if name == b"authorization"), b"")
            if not self.api_keys.accepts(authorization):
                raise unauthorized()
        length = Headers(scope=scope).get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            raise payload_too_large(self.max_body_bytes)

    def _limited(self, receive: Receive) -> Receive:
        """While the body arrives: counts its bytes (a chunked body has no Content-Length to check up front),
        holds it to the body deadline, and gives up on it when draining starts. Later messages (the
        disconnect) pass through."""
        received = [0]
        body_done = [False]
        deadline = time.monotonic() + self.body_timeout if self.body_timeout else None

        async def limited_receive() -> Message:
            if body_done[0]:
                return await receive()
            message = await self._body_message(receive, deadline)
            if message["type"] == "http.request":
                received[0] += len(message.get("body", b""))
                body_done[0] = not message.get("more_body", False)
                if received[0] > self.max_body_bytes:
                    raise payload_too_large(self.max_body_bytes)
            return message

        return limited_receive

    async def _body_message(self, receive: Receive, deadline: float | None) -> Message:
        receiving = asyncio.ensure_future(receive())
        draining = asyncio.ensure_future(self.lifecycle.drain_started.wait())
        timeout = None if deadline is None else max(deadline - time.monotonic(), 0.0)
        try:
            done, _ = await asyncio.wait({receiving, draining}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            draining.cancel()
        if receiving in done:
            return receiving.result()
        receiving.cancel()
        if draining in done:
            self.metrics.observe_rejected("draining")
            raise APIError(503, "the server is shutting down: the request body had not arrived",
                           type="service_unavailable", code="service_unavailable", headers={"Connection": "close"})
        raise request_timeout(self.body_timeout)
