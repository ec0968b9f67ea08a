"""Engine outputs back to the client, shared by completions and chat.

    respond(): stream=True  -> EventStreamResponse: chunks as the engine makes them, usage chunk, [DONE]
               stream=False -> waits for every request's final output (cancelled if the client leaves) -> JSON

A ResponseView subclass says how one endpoint shapes choices; this module frames them. Choice indices: prompt p,
sample s -> p * n + s (vLLM's order); streamed chunks of different choices interleave as tokens arrive.
Streamed requests run with OutputKind.DELTA (each output holds only new text, tokens and logprobs), the others
with FINAL_ONLY (one output holding everything), so no step copies a request's whole history.
An engine failure fails the request: 500 before the response started, else a final `data: {"error": ...}` event.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import AsyncIterator, Sequence

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from jaxserve.engine.client import RequestStream
from jaxserve.outputs import CompletionOutput, RequestOutput
from jaxserve.server.errors import engine_failed, internal_error
from jaxserve.server.generation import Prompt
from jaxserve.server.protocol import SamplingFields
from jaxserve.server.state import ServerState
from jaxserve.server.streaming import (SSE_DONE, ClientDisconnected, EventStreamResponse, merge_streams, sse_error,
                                       sse_event, until_disconnect)

log = logging.getLogger(__name__)


class ResponseView:
    """One request's response: ids and framing here, choice shapes in subclasses."""

    object_name = ""  # "text_completion" | "chat.completion"
    id_prefix = ""

    def __init__(self, server: ServerState, body: SamplingFields, prompts: Sequence[Prompt]):
        self.server = server
        self.body = body
        self.prompts = prompts
        self.id = f"{self.id_prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model_name = server.model_name  # or the LoRA adapter the request named
        self._finished: set[int] = set()  # choices whose last chunk has been streamed

    # ---- what subclasses provide ----------------------------------------------------------------------------
    def choice(self, prompt_index: int, output: RequestOutput, sample: CompletionOutput) -> dict:
        raise NotImplementedError

    def delta_choices(self, prompt_index: int, output: RequestOutput, sample: CompletionOutput) -> list[dict]:
        """Chunks' choices for what `sample` gained in `output` (a delta); when it finished, the last carries the
        reason."""
        raise NotImplementedError

    def opening_choices(self) -> list[dict]:
        return []

    def completion_tokens(self, sample: CompletionOutput) -> int:
        return sample.num_tokens

    # ---- framing --------------------------------------------------------------------------------------------
    def index(self, prompt_index: int, sample: CompletionOutput) -> int:
        return prompt_index * self.body.n + sample.index

    def response(self, finals: Sequence[RequestOutput]) -> dict:
        choices = [self.choice(p, output, sample) for p, output in enumerate(finals) for sample in output.outputs]
        return {"id": self.id, "object": self.object_name, "created": self.created,
                "model": self.model_name, "choices": sorted(choices, key=lambda c: c["index"]),
                "usage": self.usage(finals)}

    def chunk(self, choices: list[dict], usage: dict | None = None) -> bytes:
        payload = {"id": self.id, "object": f"{self.object_name}.chunk" if self.object_name.startswith("chat")
                   else self.object_name, "created": self.created, "model": self.model_name,
                   "choices": choices}
        if self.body.include_usage:
            payload["usage"] = usage
        return sse_event(payload)

    def usage(self, finals: Sequence[RequestOutput]) -> dict:
        prompt_tokens = sum(len(p.token_ids) for p in self.prompts)
        completion_tokens = sum(self.completion_tokens(s) for output in finals for s in output.outputs)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens}

    async def events(self, outputs: AsyncIterator[tuple[int, RequestOutput]]) -> AsyncIterator[bytes]:
        """The stream's events. A failure (the engine's, or shaping a chunk) ends it with an error event and
        [DONE]: the status line is long gone, and the connection stays usable."""
        try:
            async for event in self._events(outputs):
                yield event
        except Exception as exc:  # noqa: BLE001
            log.exception("streamed response %s failed", self.id)
            yield sse_error(internal_error(f"{type(exc).__name__}: {exc}"))
            yield SSE_DONE

    async def _events(self, outputs: AsyncIterator[tuple[int, RequestOutput]]) -> AsyncIterator[bytes]:
        for choice in self.opening_choices():
            yield self.chunk([choice])
        finals: list[RequestOutput] = []
        async for prompt_index, output in outputs:
            if output.error is not None:
                yield sse_error(engine_failed(output.error))
                yield SSE_DONE
                return
            for sample in output.outputs:
                for choice in self._new_choices(prompt_index, output, sample):
                    yield self.chunk([choice])
            if output.finished:
                finals.append(output)
        if self.body.include_usage:
            yield self.chunk([], usage=self.usage(finals))
        yield SSE_DONE

    def _new_choices(self, prompt_index: int, output: RequestOutput, sample: CompletionOutput) -> list[dict]:
        """A finished sample stays in its request's later outputs (its siblings go on): stream it once."""
        index = self.index(prompt_index, sample)
        if index in self._finished:
            return []
        choices = self.delta_choices(prompt_index, output, sample)
        if sample.finished and choices:
            self._finished.add(index)
        return choices


async def respond(request: Request, view: ResponseView, streams: list[RequestStream]) -> Response:
    server = view.server
    if view.body.stream:
        return EventStreamResponse(view.events(observed(server, streams, view.model_name)),
                                   on_close=lambda: release(server, streams, view.body.n))
    try:
        finals = await until_disconnect(request, collect(server, streams, view.model_name))
    except ClientDisconnected:
        return Response(status_code=499)  # nobody is there to read it
    finally:
        release(server, streams, view.body.n)
    failed = next((output.error for output in finals if output.error is not None), None)
    if failed is not None:
        raise engine_failed(failed)
    return JSONResponse(view.response(finals))


async def observed(server: ServerState, streams: Sequence[RequestStream], model_name: str | None = None
                   ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """merge_streams, recording each finished request in the metrics (under `model_name`: the adapter's)."""
    async for index, output in merge_streams(streams):
        if output.finished and output.error is None:
            server.metrics.observe_finished(output, model_name)
        yield index, output


async def collect(server: ServerState, streams: Sequence[RequestStream], model_name: str | None = None
                  ) -> list[RequestOutput]:
    finals: list[RequestOutput | None] = [None] * len(streams)
    async for index, output in observed(server, streams, model_name):
        if output.finished:
            finals[index] = output
    return finals  # type: ignore[return-value]


def release(server: ServerState, streams: Sequence[RequestStream], n: int) -> None:
    """Aborts what has not finished (the client left); counts it."""
    unfinished = [stream for stream in streams if not stream.finished]
    for stream in unfinished:
        stream.close()
    if unfinished:
        server.metrics.observe_aborted(len(unfinished) * n)
