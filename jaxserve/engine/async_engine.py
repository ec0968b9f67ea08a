"""One engine core on its own thread, with the output processor on the caller's event loop (an EngineClient).

    event loop: add_request ─validate─► commands (queue.Queue) ─► engine thread: core.add / abort / finish, step()
    event loop: OutputProcessor ◄── StepOutputs (frozen), one call_soon_threadsafe per loop per step ──┘
                 └─► RequestOutput (frozen) ─► the request's asyncio.Queue ─► RequestStream

Nothing mutable crosses: requests go in as frozen EngineRequests, results come out as frozen StepOutputs, and
each side keeps its own bookkeeping (the engine thread: which loop each request belongs to; each loop: its
OutputProcessor). A stop string found on the loop goes back as a command, and the engine frees the sequence.

The engine thread blocks on its command queue when it has no work, so nothing polls. If a step raises, every
request in flight gets a final output carrying the error and the engine is marked dead (/health turns 503).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import queue
import threading
import time
import weakref
from typing import AsyncIterator, Sequence as Seq

from jaxserve.engine.client import EngineDeadError, EngineInfo, QueueFullError
from jaxserve.engine.engine import EngineCore, tokenize
from jaxserve.engine.messages import EngineRequest, SchedulerStats, StepOutputs
from jaxserve.engine.output import OutputProcessor
from jaxserve.outputs import OutputKind, RequestOutput
from jaxserve.sampling_params import SamplingParams
from jaxserve.validation import validate_request

log = logging.getLogger(__name__)

__all__ = ["AsyncEngine", "EngineDeadError", "QueueFullError", "RequestStream"]


@dataclasses.dataclass(frozen=True)
class _Add:
    request: EngineRequest
    loop: asyncio.AbstractEventLoop
    accepted: asyncio.Future


@dataclasses.dataclass(frozen=True)
class _Abort:
    request_id: str


@dataclasses.dataclass(frozen=True)
class _Finish:
    request_id: str
    index: int
    stop: str


_STOP = object()


def engine_info(core: EngineCore) -> EngineInfo:
    return EngineInfo(core.tokenizer, core.model_config, core.max_model_len, core.config.compilation_cache_dir)


def bottleneck_monitor(core: EngineCore):
    """The bottleneck monitor for a core's steps (replicas of one model can share it): its prices, and its
    device's ceilings (measured once and cached with the compilation cache)."""
    from jaxserve.config import default_compilation_cache_dir
    from jaxserve.observability.bottleneck import monitor_for
    return monitor_for(core, core.config.compilation_cache_dir or default_compilation_cache_dir())


class AsyncEngine:
    """An EngineClient over one EngineCore. After start() the core belongs to the engine thread: every other
    thread sees only `info`, `stats()` (a frozen snapshot), the monitor (fed frozen step records through its
    inbox) and the queues. `monitor`: the bottleneck monitor the step records go to (bottleneck_monitor(core);
    replicas share one); without one there is no verdict to read."""

    def __init__(self, core: EngineCore, max_queued_requests: int | None = None, monitor=None):
        self._core = core
        self.info = engine_info(core)
        # the core's grammar compiler (thread-safe; the rest of the core is the engine thread's), if it has one
        self._grammars = getattr(getattr(core, "structured", None), "compiler", None)
        self._monitor = monitor
        self.max_queued_requests = max_queued_requests
        self._commands: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="jaxserve-engine", daemon=True)
        self.error: BaseException | None = None
        self._lock = threading.Lock()  # orders admission against the engine thread's last look at its queue
        self._closed = False
        self._stats = SchedulerStats()  # replaced (never changed) by the engine thread after each step
        self._loops: dict[str, asyncio.AbstractEventLoop] = {}  # engine thread only: where each request's outputs go
        self._processors: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # loop -> its OutputProcessor

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

    def stats(self) -> SchedulerStats:
        return self._stats

    @property
    def monitor(self):
        if self._monitor is None:
            raise RuntimeError("this AsyncEngine was built without a bottleneck monitor (see bottleneck_monitor)")
        return self._monitor

    # ---- requests (event loop) ------------------------------------------------------------------------------
    async def add_request(self, request_id: str, prompt: str | Seq[int], params: SamplingParams, *,
                          priority: int = 0, prompt_text: str | None = None,
                          kind: OutputKind = OutputKind.DELTA) -> "RequestStream":
        """Validates and queues a request; returns once the engine thread has accepted it, so a server can still
        answer with an error status. Raises InvalidRequestError (a ValueError naming the parameter), ValueError
        for a request id in use, QueueFullError, or EngineDeadError. Iterate the stream for the outputs;
        closing it before the last one aborts the request."""
        text, prompt_ids = tokenize(self.info.tokenizer, prompt)
        validate_request(prompt_ids, params, self.info.limits)
        if params.structured_outputs is not None and self._grammars is not None:
            # compiled here, off the engine thread and the event loop; the core finds it cached
            await asyncio.to_thread(self._grammars.compile, params.structured_outputs)
        loop = asyncio.get_running_loop()
        processor = self._processor(loop)
        if request_id in processor.states:
            raise ValueError(f"request id {request_id!r} is already in use")
        outputs: asyncio.Queue = asyncio.Queue()
        arrival = time.monotonic()
        # Registered before the engine can produce anything for it: its first outputs may reach this loop
        # before this coroutine resumes.
        processor.add(request_id, text if prompt_text is None else prompt_text, prompt_ids, params, arrival, kind,
                      sink=outputs.put_nowait)
        accepted = loop.create_future()
        try:
            self._submit(_Add(EngineRequest(request_id, prompt_ids, params, arrival, priority), loop, accepted))
            await accepted  # raises the engine's ValueError (an id already in use on another loop)
        except BaseException:
            processor.drop(request_id)
            self.abort(request_id)  # the engine may have accepted it meanwhile (a cancelled wait)
            raise
        return RequestStream(request_id, outputs, functools.partial(self._close, processor, request_id))

    async def generate(self, request_id: str, prompt: str | Seq[int], params: SamplingParams, *,
                       priority: int = 0, prompt_text: str | None = None) -> AsyncIterator[RequestOutput]:
        """Yields the request's outputs (deltas) as they are made; the last one has finished=True. Raises as
        add_request does. Cancelling the iteration (a client that went away) aborts the request."""
        stream = await self.add_request(request_id, prompt, params, priority=priority, prompt_text=prompt_text)
        try:
            async for output in stream:
                yield output
        finally:
            stream.close()

    def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))

    def _close(self, processor: OutputProcessor, request_id: str) -> None:
        processor.drop(request_id)
        self.abort(request_id)

    def _processor(self, loop: asyncio.AbstractEventLoop) -> OutputProcessor:
        processor = self._processors.get(loop)
        if processor is None:
            processor = self._processors[loop] = OutputProcessor(self.info.tokenizer)
        return processor

    def _submit(self, command: _Add) -> None:
        """Admission. Under the lock, so no command lands in the queue after the engine thread emptied it."""
        with self._lock:
            if self._closed or not self.is_alive:
                raise EngineDeadError(f"the engine is not running: {self.error!r}")
            waiting = self._stats.num_waiting + self._commands.qsize()
            if self.max_queued_requests is not None and waiting >= self.max_queued_requests:
                raise QueueFullError(f"{self._stats.num_waiting} requests are already waiting")
            self._commands.put(command)

    def _on_step(self, loop: asyncio.AbstractEventLoop, step: StepOutputs) -> None:
        """On the loop: the step's deltas for this loop's requests become outputs; stop strings go back."""
        _, stops = self._processor(loop).process(step)
        for stop in stops:
            self._commands.put(_Finish(stop.request_id, stop.index, stop.stop))

    def _on_failure(self, loop: asyncio.AbstractEventLoop, request_ids: tuple[str, ...], error: str) -> None:
        self._processor(loop).fail(request_ids, error, time.monotonic())

    # ---- the engine thread ----------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                idle = not self._core.has_unfinished_requests()
                if not self._drain_commands(block=idle):
                    break
                step = self._core.step()
                self._stats = step.stats
                if self._monitor is not None:
                    self._monitor.submit(step.records)
                self._deliver(step)
        except BaseException as exc:  # noqa: BLE001 - any failure must reach every waiting client
            log.exception("engine loop failed")
            self.error = exc
            self._fail_all(exc)
        finally:
            self._reject_queued_requests()

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
            if isinstance(command, _Add):
                self._add(command)
            elif isinstance(command, _Abort):
                deltas = self._core.abort_request(command.request_id)
                self._deliver(StepOutputs(deltas, self._stats, (command.request_id,), time.monotonic()))
            elif self._core.finish_sample(command.request_id, command.index, command.stop):
                self._loops.pop(command.request_id, None)

    def _add(self, command: _Add) -> None:
        try:
            self._core.add_request(command.request)
        except ValueError as exc:
            command.loop.call_soon_threadsafe(_set_exception, command.accepted, exc)
            return
        self._loops[command.request.request_id] = command.loop
        command.loop.call_soon_threadsafe(_set_result, command.accepted, None)

    def _deliver(self, step: StepOutputs) -> None:
        """One callback per event loop with that loop's deltas (usually there is one loop)."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for delta in step.deltas:
            loop = self._loops.get(delta.request_id)
            if loop is not None:
                by_loop.setdefault(loop, []).append(delta)
        for request_id in step.finished_requests:
            self._loops.pop(request_id, None)
        for loop, deltas in by_loop.items():
            part = StepOutputs(tuple(deltas), step.stats, (), step.time)
            _call_soon(loop, self._on_step, loop, part)

    def _fail_all(self, exc: BaseException) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[str]] = {}
        for request_id, loop in self._loops.items():
            by_loop.setdefault(loop, []).append(request_id)
        self._loops.clear()
        for loop, request_ids in by_loop.items():
            _call_soon(loop, self._on_failure, loop, tuple(request_ids), f"{type(exc).__name__}: {exc}")


class RequestStream:
    """One accepted request's outputs, in order; the last has finished=True. close() before then aborts it."""

    def __init__(self, request_id: str, outputs: asyncio.Queue, on_close):
        self.request_id = request_id
        self.finished = False
        self._outputs = outputs
        self._on_close = on_close

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
            self._on_close()


def _call_soon(loop: asyncio.AbstractEventLoop, callback, *args) -> None:
    try:
        loop.call_soon_threadsafe(callback, *args)
    except RuntimeError:  # that loop is closed: nobody is left to read these outputs
        pass


def _set_result(future: asyncio.Future, value) -> None:
    if not future.done():
        future.set_result(value)


def _set_exception(future: asyncio.Future, exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)
