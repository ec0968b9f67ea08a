"""The engine on its own thread, for the server.

    server (asyncio) --commands (queue.Queue)--> engine thread: add/abort, step(), step(), ...
    server (asyncio) <--outputs (one asyncio.Queue per request, fed with call_soon_threadsafe)--

The engine thread blocks on its command queue when it has no work, so nothing polls. The engine object is touched
only by that thread. If a step raises, every request in flight gets a final output carrying the error and the
engine is marked dead (the server's /health turns 503).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
from typing import AsyncIterator, Sequence as Seq

from jaxserve.engine.engine import LLMEngine
from jaxserve.outputs import RequestOutput
from jaxserve.sampling_params import SamplingParams

log = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine loop stopped after an error; the message says which."""


class QueueFullError(RuntimeError):
    """Admission control: too many requests are already waiting."""


@dataclasses.dataclass
class _Add:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    priority: int
    prompt_text: str | None
    outputs: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    accepted: asyncio.Future


@dataclasses.dataclass
class _Abort:
    request_id: str


_STOP = object()


class AsyncEngine:
    def __init__(self, engine: LLMEngine, max_queued_requests: int | None = None):
        self.engine = engine
        self.max_queued_requests = max_queued_requests
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, tuple[asyncio.Queue, asyncio.AbstractEventLoop]] = {}
        self._thread = threading.Thread(target=self._run, name="jaxserve-engine", daemon=True)
        self.error: BaseException | None = None
        self._stopped = threading.Event()
        self._lock = threading.Lock()  # orders admission against the engine thread's last look at its queue
        self._closed = False
        self.num_waiting = 0  # written by the engine thread, read by the server for admission
        self.num_running = 0

    # ---- lifecycle ------------------------------------------------------------------------------------------
    def start(self) -> "AsyncEngine":
        self._thread.start()
        return self

    def stop(self, timeout: float | None = 30.0) -> None:
        self._commands.put(_STOP)
        self._thread.join(timeout)

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    # ---- requests -------------------------------------------------------------------------------------------
    async def add_request(self, request_id: str, prompt: str | Seq[int], params: SamplingParams, *,
                          priority: int = 0, prompt_text: str | None = None) -> "RequestStream":
        """Queues a request and returns once the engine thread has accepted it, so a server can still answer
        with an error status: raises ValueError for a request the engine rejects, QueueFullError when admission
        refuses it, EngineDeadError if the engine is not running. Iterate the stream for the outputs; closing it
        before the last one aborts the request."""
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue = asyncio.Queue()
        accepted = loop.create_future()
        prompt = prompt if isinstance(prompt, str) else list(prompt)
        self._submit(_Add(request_id, prompt, params, priority, prompt_text, outputs, loop, accepted))
        try:
            await accepted  # raises the engine's ValueError for a bad request
        except asyncio.CancelledError:
            self.abort(request_id)  # the engine may have accepted it meanwhile
            raise
        return RequestStream(self, request_id, outputs)

    async def generate(self, request_id: str, prompt: str | Seq[int], params: SamplingParams, *,
                       priority: int = 0, prompt_text: str | None = None) -> AsyncIterator[RequestOutput]:
        """Yields the request's outputs as they are made; the last one has finished=True. Raises as add_request
        does. Cancelling the iteration (a client that went away) aborts the request."""
        stream = await self.add_request(request_id, prompt, params, priority=priority, prompt_text=prompt_text)
        try:
            async for output in stream:
                yield output
        finally:
            stream.close()

    def _submit(self, command: _Add) -> None:
        """Admission. Under the lock, so no command lands in the queue after the engine thread emptied it."""
        with self._lock:
            if self._closed or not self.is_alive:
                raise EngineDeadError(f"the engine is not running: {self.error!r}")
            if (self.max_queued_requests is not None
                    and self.num_waiting + self._commands.qsize() >= self.max_queued_requests):
                raise QueueFullError(f"{self.num_waiting} requests are already waiting")
            self._commands.put(command)

    def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))

    # ---- the engine thread ----------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                idle = not self.engine.has_unfinished_requests()
                if not self._drain_commands(block=idle):
                    break
                self._deliver(self.engine.step())
                self.num_waiting = self.engine.scheduler.num_waiting
                self.num_running = len(self.engine.scheduler.running)
        except BaseException as exc:  # noqa: BLE001 - any failure must reach every waiting client
            log.exception("engine loop failed")
            self.error = exc
            self._fail_all(exc)
        finally:
            self._reject_queued_requests()
            self._stopped.set()

    def _reject_queued_requests(self) -> None:
        """Requests still queued when the loop ends would otherwise wait for an acceptance that never comes."""
        with self._lock:
            self._closed = True
        while not self._commands.empty():
            command = self._commands.get_nowait()
            if isinstance(command, _Add):
                reason = EngineDeadError(f"the engine stopped: {self.error!r}")
                command.loop.call_soon_threadsafe(_set_exception, command.accepted, reason)

    def _drain_commands(self, block: bool) -> bool:
        """Applies queued commands; waits for one if the engine is idle. False once asked to stop."""
        while True:
            try:
                command = self._commands.get(block=block)
            except queue.Empty:
                return True
            block = False
            if command is _STOP:
                self._fail_all(EngineDeadError("the server is shutting down"))
                return False
            if isinstance(command, _Abort):
                self._abort(command.request_id)
            else:
                self._add(command)

    def _add(self, command: _Add) -> None:
        try:
            self.engine.add_request(command.request_id, command.prompt, command.params, priority=command.priority,
                                    prompt_text=command.prompt_text)
        except (ValueError, TypeError) as exc:
            command.loop.call_soon_threadsafe(_set_exception, command.accepted, exc)
            return
        self._streams[command.request_id] = (command.outputs, command.loop)
        command.loop.call_soon_threadsafe(_set_result, command.accepted, None)

    def _abort(self, request_id: str) -> None:
        output = self.engine.abort_request(request_id)
        if output is not None:
            self._deliver([output])

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            if output.finished:
                del self._streams[output.request_id]
            q, loop = stream
            loop.call_soon_threadsafe(q.put_nowait, output)

    def _fail_all(self, exc: BaseException) -> None:
        now = time.monotonic()
        for request_id, (q, loop) in list(self._streams.items()):
            state = self.engine.requests.get(request_id)
            output = state.finish_all("error") if state is not None else RequestOutput(request_id, None, [], [])
            output.finished, output.error = True, f"{type(exc).__name__}: {exc}"
            if output.metrics is not None:
                output.metrics.finished_time = now
            loop.call_soon_threadsafe(q.put_nowait, output)
        self._streams.clear()


class RequestStream:
    """One accepted request's outputs, in order; the last has finished=True. close() before then aborts it."""

    def __init__(self, engine: AsyncEngine, request_id: str, outputs: asyncio.Queue):
        self.request_id = request_id
        self.finished = False
        self._engine = engine
        self._outputs = outputs

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        output = await self._outputs.get()
        self.finished = output.finished
        return output

    def close(self) -> None:
        if not self.finished:
            self.finished = True
            self._engine.abort(self.request_id)


def _set_result(future: asyncio.Future, value) -> None:
    if not future.done():
        future.set_result(value)


def _set_exception(future: asyncio.Future, exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)
