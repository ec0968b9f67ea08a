"""One engine core on its own thread, with the output processor on the caller's event loop (an EngineClient).

    event loop: add_request ─validate─► commands (queue.Queue) ─► engine thread: core.add / abort / finish, step()
    event loop: OutputProcessor ◄── StepOutputs (frozen), one call_soon_threadsafe per loop per step ──┘
                 └─► RequestOutput (frozen) ─► the request's asyncio.Queue ─► RequestStream

Nothing mutable crosses: requests go in as frozen EngineRequests, results come out as frozen StepOutputs, and
each side keeps its own bookkeeping (the engine thread: which loop each request belongs to; each loop: its
OutputProcessor). A stop string found on the loop goes back as a command, and the engine frees the sequence.

The engine thread blocks on its command queue when it has no work, so nothing polls.

What can go wrong, and what it costs:
    one request's step preparation or output raises      that request fails (an output carrying the error)
    a step raises on the host                             the requests in that step fail; the engine goes on
    the device fails (EngineCore.step raises)             every request in flight fails; the engine is dead:
                                                          rebuilt in place when `rebuild` is given and restarts
                                                          are left, else the fatal listeners are told (the
                                                          server exits non-zero for its supervisor to restart it)
    a step runs longer than `step_timeout` (a hang)       the watchdog fails every request in flight, marks the
                                                          engine hung and tells the fatal listeners: a thread
                                                          stuck on the device can be neither stopped nor
                                                          replaced beside it, so a hang is never restarted in place
Admission is exact: `max_queued_requests` counts the requests accepted and not yet scheduled, at the moment
of admission (not a count that is a step old).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import gc
import logging
import queue
import threading
import time
import weakref
from typing import AsyncIterator, Callable, Sequence as Seq

from jaxserve.engine.client import EngineDeadError, EngineHungError, EngineInfo, QueueFullError
from jaxserve.engine.engine import EngineCore, tokenize
from jaxserve.engine.messages import EngineRequest, SchedulerStats, StepOutputs
from jaxserve.engine.output import OutputProcessor, RequestState
from jaxserve.outputs import OutputKind, RequestOutput
from jaxserve.sampling_params import SamplingParams
from jaxserve.validation import validate_request

log = logging.getLogger(__name__)

__all__ = ["AsyncEngine", "EngineDeadError", "EngineHungError", "QueueFullError", "RequestStream"]


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


@dataclasses.dataclass(frozen=True)
class _AdapterCommand:
    """Load (path given) or unload (path None) a LoRA adapter on the engine thread; `done` gets the outcome."""

    name: str
    path: str | None
    loop: asyncio.AbstractEventLoop
    done: asyncio.Future


_STOP = object()


def engine_info(core: EngineCore) -> EngineInfo:
    return EngineInfo(core.tokenizer, core.model_config, core.max_model_len, core.config.compilation_cache_dir,
                      cache_config(core), core.speculation is not None)


def cache_config(core: EngineCore) -> tuple[tuple[str, str], ...]:
    """vLLM's cache_config_info labels with this engine's values (num_gpu_blocks: KV pages per replica)."""
    config = core.config
    return (("block_size", str(config.page_size)), ("cache_dtype", config.kv_cache_dtype),
            ("enable_prefix_caching", str(config.enable_prefix_caching)),
            ("gpu_memory_utilization", str(config.kv_cache_fraction)), ("num_cpu_blocks", "0"),
            ("num_gpu_blocks", str(core.kv_plan.num_pages)),
            ("sliding_window", str(core.model_config.sliding_window)))


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
    replicas share one); without one there is no verdict to read.

    `rebuild`: makes a new core when the device failed (the old one is dropped first), at most `max_restarts`
    times. `step_timeout`: seconds a step may run before the watchdog declares the engine hung (None: no
    watchdog)."""

    def __init__(self, core: EngineCore, max_queued_requests: int | None = None, monitor=None, *,
                 rebuild: Callable[[], EngineCore] | None = None, max_restarts: int = 0,
                 step_timeout: float | None = None):
        self._core = core
        self.info = engine_info(core)
        # the core's grammar compiler (thread-safe; the rest of the core is the engine thread's), if it has one
        self._grammars = getattr(getattr(core, "structured", None), "compiler", None)
        self._monitor = monitor
        self.max_queued_requests = max_queued_requests
        self._rebuild = rebuild
        self.restarts_left = max_restarts if rebuild is not None else 0
        self.step_timeout = step_timeout
        self._commands: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="jaxserve-engine", daemon=True)
        self._watchdog = threading.Thread(target=self._watch, name="jaxserve-engine-watchdog", daemon=True)
        self._stopping = threading.Event()
        self.error: BaseException | None = None
        self.restarting = False
        self._lock = threading.Lock()  # admission against the engine thread's last look at its queue; _queued
        self._closed = False
        self._abandoned = False  # the watchdog gave up on a stuck engine thread: it must deliver nothing more
        self._queued: set[str] = set()  # accepted, not yet scheduled (under _lock)
        self._step_started: float | None = None  # time.monotonic while a step runs (engine thread writes)
        self._fatal_listeners: list[Callable[[BaseException], None]] = []
        self._stats = SchedulerStats()  # replaced (never changed) by the engine thread after each step
        self._loras = core.lora_infos()  # replaced by the engine thread after each adapter load / unload
        self._loops: dict[str, asyncio.AbstractEventLoop] = {}  # engine thread only: where each request's outputs go
        self._processors: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # loop -> its OutputProcessor

    # ---- lifecycle ------------------------------------------------------------------------------------------
    def start(self) -> "AsyncEngine":
        self._thread.start()
        if self.step_timeout:
            self._watchdog.start()
        return self

    def stop(self, timeout: float | None = 30.0) -> None:
        self._stopping.set()
        self._commands.put(_STOP)
        if not self._abandoned:  # a thread stuck on the device would never join
            self._thread.join(timeout)

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def add_fatal_listener(self, callback: Callable[[BaseException], None]) -> None:
        """`callback(error)` is called once, on an engine thread, when the engine stops for good (dead with no
        restart left, or hung)."""
        self._fatal_listeners.append(callback)

    @property
    def num_queued(self) -> int:
        """Requests accepted and not yet scheduled."""
        return len(self._queued)

    def stats(self) -> SchedulerStats:
        return self._stats

    def loras(self):
        """The LoRA adapters loaded now (jaxserve.lora.registry.LoraInfo), a snapshot."""
        return self._loras

    async def load_lora(self, name: str, path: str) -> None:
        """Reads and registers a PEFT adapter on the engine thread; raises LoraError naming the problem."""
        await self._adapter_command(name, path)

    async def unload_lora(self, name: str) -> None:
        """Forgets an adapter: KeyError if unknown, LoraInUseError while requests run or wait with it."""
        await self._adapter_command(name, None)

    async def _adapter_command(self, name: str, path: str | None) -> None:
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        with self._lock:
            if self._closed or not self.is_alive:
                raise EngineDeadError(f"the engine is not running: {self.error!r}")
            self._commands.put(_AdapterCommand(name, path, loop, done))
        await done

    @property
    def monitor(self):
        if self._monitor is None:
            raise RuntimeError("this AsyncEngine was built without a bottleneck monitor (see bottleneck_monitor)")
        return self._monitor

    # ---- requests (event loop) ------------------------------------------------------------------------------
    async def add_request(self, request_id: str, prompt: str | Seq[int], params: SamplingParams, *,
                          priority: int = 0, prompt_text: str | None = None,
                          kind: OutputKind = OutputKind.DELTA, lora_name: str | None = None) -> "RequestStream":
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
        news = asyncio.Event()
        arrival = time.monotonic()
        # Registered before the engine can produce anything for it: its first outputs may reach this loop
        # before this coroutine resumes.
        state = processor.add(request_id, text if prompt_text is None else prompt_text, prompt_ids, params, arrival,
                              kind, notify=news.set)
        accepted = loop.create_future()
        try:
            self._submit(_Add(EngineRequest(request_id, prompt_ids, params, arrival, priority, lora_name), loop,
                              accepted))
            await accepted  # raises the engine's ValueError (an id already in use on another loop)
        except BaseException:
            processor.drop(request_id)
            self.abort(request_id)  # the engine may have accepted it meanwhile (a cancelled wait)
            raise
        return RequestStream(request_id, state, news, functools.partial(self._close, processor, request_id))

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
        """Admission. Under the lock, so no command lands in the queue after the engine thread emptied it, and
        the waiting count is exact."""
        request_id = command.request.request_id
        with self._lock:
            if self._closed or not self.is_alive:
                what = "restarting" if self.restarting else "not running"
                raise EngineDeadError(f"the engine is {what}: {self.error!r}")
            if self.max_queued_requests is not None and len(self._queued) >= self.max_queued_requests:
                raise QueueFullError(f"{len(self._queued)} requests are already waiting, the most this server "
                                     f"queues")
            self._queued.add(request_id)
            self._commands.put(command)

    def _dequeue(self, request_ids) -> None:
        with self._lock:
            self._queued.difference_update(request_ids)

    def _on_step(self, loop: asyncio.AbstractEventLoop, step: StepOutputs) -> None:
        """On the loop: the step's deltas for this loop's requests become outputs; stop strings go back, and so
        do requests whose output could not be processed."""
        processor = self._processor(loop)
        _, stops = processor.process(step)
        for stop in stops:
            self._commands.put(_Finish(stop.request_id, stop.index, stop.stop))
        while processor.failed:
            self.abort(processor.failed.pop())

    def _on_failure(self, loop: asyncio.AbstractEventLoop, request_ids: tuple[str, ...], error: str) -> None:
        self._processor(loop).fail(request_ids, error, time.monotonic())

    # ---- the engine thread ----------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                try:
                    self._serve()
                    return  # asked to stop
                except BaseException as exc:  # noqa: BLE001 - any failure must reach every waiting client
                    if self._abandoned:
                        return
                    log.exception("engine loop failed")
                    exc = self.error = _without_traceback(exc)  # its frames would keep the dead core alive
                    self._fail_all(exc)
                    if not self._restart(exc):
                        self._give_up(exc)
                        return
        finally:
            if not self._abandoned:
                self._reject_queued_requests()

    def _serve(self) -> None:
        """Steps while there is work, blocks on the command queue when there is none; returns when stopped."""
        while True:
            idle = not self._core.has_unfinished_requests()
            if not self._drain_commands(block=idle):
                return
            self._step_started = time.monotonic()
            try:
                step = self._core.step()
            finally:
                self._step_started = None  # a rebuild after a failed step is no hang
            if self._abandoned:
                return  # the watchdog already failed this step's requests
            self._stats = step.stats
            if self._monitor is not None:
                self._monitor.submit(step.records)
            self._deliver(step)

    def _restart(self, exc: BaseException) -> bool:
        """Replaces a core whose device failed, if restarts are left. True once the new core serves."""
        if self.restarts_left <= 0 or self._stopping.is_set():
            return False
        self.restarts_left -= 1
        self.restarting = True
        log.warning("rebuilding the engine after %r (%d restart(s) left after this one)", exc, self.restarts_left)
        self._reject_queued_requests(closing=False)
        self._core = None  # dropped (device memory freed) before the new one plans its memory
        gc.collect()
        try:
            core = self._rebuild()
        except Exception:  # noqa: BLE001
            log.exception("rebuilding the engine failed")
            self.restarting = False
            return False
        self._core, self._stats, self._step_started = core, SchedulerStats(), None
        self.restarting = False
        self.error = None
        log.warning("the engine was rebuilt and serves again")
        return True

    def _give_up(self, exc: BaseException) -> None:
        """The engine stops for good: admission closes and the fatal listeners are told (once)."""
        with self._lock:
            self._closed = True
            listeners, self._fatal_listeners = self._fatal_listeners, []
        for listener in listeners:
            try:
                listener(exc)
            except Exception:  # noqa: BLE001
                log.exception("a fatal-error listener failed")

    def _watch(self) -> None:
        """The watchdog: a step that runs past step_timeout is a hang."""
        interval = min(self.step_timeout / 4, 1.0)
        while not self._stopping.wait(interval):
            started = self._step_started
            if started is not None and time.monotonic() - started > self.step_timeout:
                self._abandon(EngineHungError(f"no engine step finished in {self.step_timeout:g} s: the device "
                                              f"or the step is stuck"))
                return

    def _abandon(self, exc: EngineHungError) -> None:
        """From the watchdog: the engine thread is stuck in a step. Everything waiting on it fails now; if the
        thread ever comes back, it delivers nothing."""
        log.critical("%s; failing every request in flight", exc)
        self.error = exc
        self._abandoned = True
        self._fail_all(exc)
        self._reject_queued_requests()
        self._give_up(exc)

    def _reject_queued_requests(self, closing: bool = True) -> None:
        """Requests still queued when the loop ends would otherwise wait for an acceptance that never comes."""
        with self._lock:
            self._closed = self._closed or closing
            self._queued.clear()
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, _Add):
                reason = EngineDeadError(f"the engine stopped: {self.error!r}")
                _call_soon(command.loop, _set_exception, command.accepted, reason)

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
            elif isinstance(command, _AdapterCommand):
                self._change_adapters(command)
            elif isinstance(command, _Abort):
                self._dequeue((command.request_id,))
                deltas = self._core.abort_request(command.request_id)
                self._deliver(StepOutputs(deltas, self._stats, (command.request_id,), time.monotonic()))
            elif self._core.finish_sample(command.request_id, command.index, command.stop):
                self._loops.pop(command.request_id, None)

    def _add(self, command: _Add) -> None:
        try:
            self._core.add_request(command.request)
        except Exception as exc:  # noqa: BLE001 - refused alone (ValueError: an id in use; anything else: a bug)
            if not isinstance(exc, ValueError):
                log.exception("request %s could not be queued", command.request.request_id)
            self._dequeue((command.request.request_id,))
            _call_soon(command.loop, _set_exception, command.accepted, exc)
            return
        self._loops[command.request.request_id] = command.loop
        _call_soon(command.loop, _set_result, command.accepted, None)

    def _change_adapters(self, command: _AdapterCommand) -> None:
        try:
            if command.path is not None:
                self._core.add_lora(command.name, command.path)
            else:
                self._core.remove_lora(command.name)
        except Exception as exc:  # noqa: BLE001 - refused: the caller gets the reason, the engine goes on
            command.loop.call_soon_threadsafe(_set_exception, command.done, exc)
            return
        self._loras = self._core.lora_infos()
        command.loop.call_soon_threadsafe(_set_result, command.done, None)

    def _deliver(self, step: StepOutputs) -> None:
        """One callback per event loop with that loop's deltas (usually there is one loop)."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        scheduled = []
        for delta in step.deltas:
            if delta.scheduled_time is not None:
                scheduled.append(delta.request_id)
            loop = self._loops.get(delta.request_id)
            if loop is not None:
                by_loop.setdefault(loop, []).append(delta)
        self._dequeue(scheduled + list(step.finished_requests) + [request_id for request_id, _ in step.failed])
        for request_id in step.finished_requests:
            self._loops.pop(request_id, None)
        for loop, deltas in by_loop.items():
            part = StepOutputs(tuple(deltas), step.stats, (), step.time)
            _call_soon(loop, self._on_step, loop, part)
        for request_id, error in step.failed:
            loop = self._loops.pop(request_id, None)
            if loop is not None:
                _call_soon(loop, self._on_failure, loop, (request_id,), error)

    def _fail_all(self, exc: BaseException) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[str]] = {}
        for request_id, loop in list(self._loops.items()):
            by_loop.setdefault(loop, []).append(request_id)
        self._loops.clear()
        with self._lock:
            self._queued.clear()
        for loop, request_ids in by_loop.items():
            _call_soon(loop, self._on_failure, loop, tuple(request_ids), f"{type(exc).__name__}: {exc}")


class RequestStream:
    """One accepted request's outputs, in order; the last has finished=True. close() before then aborts it.

    Nothing is queued: the output processor applies each step to the request's state and sets `news`; reading
    takes everything new since the last read as one output. A reader that stalls costs no memory beyond the
    request's own text and tokens, and one that comes back has no backlog to work through."""

    def __init__(self, request_id: str, state: RequestState, news: asyncio.Event, on_close):
        self.request_id = request_id
        self.finished = False
        self._state = state
        self._news = news
        self._on_close = on_close

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        while not self.finished:
            await self._news.wait()
            self._news.clear()
            output = self._state.output(time.monotonic())
            if output is not None:
                self.finished = output.finished
                return output
        raise StopAsyncIteration

    def close(self) -> None:
        if not self.finished:
            self.finished = True
            self._on_close()


def _without_traceback(exc: BaseException) -> BaseException:
    exc.__traceback__ = exc.__context__ = exc.__cause__ = None
    return exc


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
