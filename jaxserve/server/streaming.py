"""Server-Sent Events and the plumbing between engine streams and HTTP: nothing here polls.

    engine thread --RequestStream (asyncio.Queue)--> merge_streams --> formatter --> sse_event bytes --> client

A client that goes away cancels the response task; closing the request streams then aborts the requests, so their
KV pages are freed at the engine's next step.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, AsyncIterator, Awaitable, Callable, Sequence

from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from jaxserve.engine.client import RequestStream
from jaxserve.outputs import RequestOutput

SSE_DONE = b"data: [DONE]\n\n"


def to_json(payload: Any) -> str:
    return json.dumps(payload, ensure_ascii=False, allow_nan=False, separators=(",", ":"))


def sse_event(payload: dict) -> bytes:
    return f"data: {to_json(payload)}\n\n".encode()


def sse_error(error) -> bytes:
    """An APIError as an event; ASCII JSON, since its message may quote anything."""
    return f"data: {json.dumps(error.body(), ensure_ascii=True, separators=(',', ':'))}\n\n".encode()


class EventStreamResponse(StreamingResponse):
    """text/event-stream that runs `on_close` however the response ends (finished, client gone, cancelled),
    even when the body iterator never started."""

    def __init__(self, events: AsyncIterator[bytes], on_close: Callable[[], None]):
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def close_all(streams: Sequence[RequestStream]) -> None:
    for stream in streams:
        stream.close()


async def merge_streams(streams: Sequence[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(stream index, output) as each stream produces them, until every stream has finished."""
    if len(streams) == 1:
        async for output in streams[0]:
            yield 0, output
        return
    pending = {asyncio.ensure_future(anext(stream)): i for i, stream in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for future in done:
                index = pending.pop(future)
                try:
                    output = future.result()
                except StopAsyncIteration:
                    continue
                yield index, output
                pending[asyncio.ensure_future(anext(streams[index]))] = index
    finally:
        for future in pending:
            future.cancel()


class ClientDisconnected(Exception):
    """The client closed the connection before the response was ready."""


async def until_disconnect(request: Request, work: Awaitable):
    """Awaits `work`, cancelling it if the client disconnects first (raises ClientDisconnected then)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise ClientDisconnected()
    return task.result()


async def _wait_for_disconnect(request: Request) -> None:
    """After the body has been read, the next ASGI message for this request is its disconnect."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
