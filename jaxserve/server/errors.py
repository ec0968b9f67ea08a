"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` with the matching HTTP status.

Handlers raise APIError; the app's exception handlers turn it (and any other exception) into that body.
"""

from __future__ import annotations

import json

from starlette.responses import JSONResponse


class APIError(Exception):
    """An error answered to the client. `param` names the request field at fault, when there is one."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return ErrorResponse(self.body(), status_code=self.status, headers=self.headers)


class ErrorResponse(JSONResponse):
    """JSON with every non-ASCII character escaped: an error message may quote the client's input, lone
    surrogates included, and must still encode."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode("ascii")


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def unauthorized() -> APIError:
    return APIError(401, "invalid or missing API key: send 'Authorization: Bearer <key>'",
                    type="authentication_error", code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


def payload_too_large(limit: int) -> APIError:
    return APIError(413, f"the request body exceeds the server's limit of {limit} bytes",
                    code="request_too_large")


def request_timeout(seconds: float) -> APIError:
    return APIError(408, f"the request body did not arrive within {seconds:g} s", code="request_timeout",
                    headers={"Connection": "close"})


def too_many_requests(message: str, retry_after_seconds: int) -> APIError:
    return APIError(429, message, type="rate_limit_error", code="queue_full",
                    headers={"Retry-After": str(retry_after_seconds)})


def service_unavailable(message: str) -> APIError:
    return APIError(503, message, type="service_unavailable", code="service_unavailable")


def engine_failed(detail: str) -> APIError:
    return APIError(500, f"the engine failed while generating: {detail}", type="internal_server_error",
                    code="engine_error")


def internal_error(detail: str) -> APIError:
    return APIError(500, f"internal server error: {detail}", type="internal_server_error", code="internal_error")
