"""Draining: what the first SIGTERM (or Ctrl-C) does; and what an engine that stops for good does.

    serving --signal--> draining: API routes answer 503, /health 503; requests in flight run to the end, except
                        those whose body is still arriving (503 at once: a slow sender does not hold up exit)
            --in flight reaches 0 (or drain_timeout)--> uvicorn's own shutdown --> exit 0
    a second signal: uvicorn's immediate shutdown (streams still open are cut).
    serving --the engine is dead (no restart left) or hung--> shutdown --> exit 1, for a supervisor (systemd,
            Kubernetes) to restart the process, as vLLM and TGI do; requests in flight already got their error.

Connections are bounded too (TimedH11Protocol): a request's headers must arrive within header_timeout of the
connection opening (or of the previous response), and an idle keep-alive connection closes after
timeout_keep_alive (uvicorn's).
"""

from __future__ import annotations

import asyncio
import logging
import signal

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger(__name__)


class Lifecycle:
    """Whether the server takes new requests, and how many it is answering. Touched by the event loop only."""

    def __init__(self):
        self.draining = False
        self.drain_started = asyncio.Event()  # set with `draining`, on the loop: wakes bodies still arriving
        self.in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def start_draining(self) -> None:
        self.draining = True
        self.drain_started.set()

    def request_started(self) -> None:
        self.in_flight += 1
        self._idle.clear()

    def request_finished(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self._idle.set()

    async def wait_until_idle(self) -> None:
        await self._idle.wait()


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose first exit signal drains instead of closing at once, and that shuts down with
    `exit_code` 1 when `engine_stopped` is called (from any thread)."""

    def __init__(self, config: uvicorn.Config, lifecycle: Lifecycle, drain_timeout: float):
        super().__init__(config)
        self.lifecycle = lifecycle
        self.drain_timeout = drain_timeout
        self.exit_code = 0
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def engine_stopped(self, error: BaseException) -> None:
        """The engine stopped for good: nothing can be served any more."""
        log.critical("the engine stopped for good (%r); exiting with status 1 for the supervisor to restart "
                     "the server", error)
        self.exit_code = 1
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._stop_now)
        else:  # not serving yet: uvicorn's main loop reads this flag when it starts
            self.should_exit = True

    def _stop_now(self) -> None:
        self.lifecycle.start_draining()
        self.should_exit = True

    def handle_exit(self, sig: int, frame) -> None:
        if self.lifecycle.draining or not self.started or self._loop is None:
            super().handle_exit(sig, frame)
            return
        self.lifecycle.draining = True
        log.info("%s: draining %d request(s) in flight, refusing new ones (signal again to stop now)",
                 signal.Signals(sig).name, self.lifecycle.in_flight)
        self._loop.call_soon_threadsafe(self._start_exit_when_idle)

    def _start_exit_when_idle(self) -> None:
        self.lifecycle.start_draining()
        self._drain_task = asyncio.ensure_future(self._exit_when_idle())

    async def _exit_when_idle(self) -> None:
        try:
            await asyncio.wait_for(self.lifecycle.wait_until_idle(), self.drain_timeout)
            log.info("drained; shutting down")
        except TimeoutError:
            log.warning("drain timeout (%.0fs) reached with %d request(s) in flight; shutting down",
                        self.drain_timeout, self.lifecycle.in_flight)
        self.should_exit = True


class TimedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a header deadline: a connection that has not sent a whole request head within
    `header_timeout` seconds of opening (or of its previous response) is closed. uvicorn's own keep-alive timer
    stops at the first byte, so without this a client trickling its headers holds a connection forever."""

    header_timeout: float = 30.0

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._header_timer = None
        self._arm_header_timer()

    def data_received(self, data: bytes) -> None:
        cycle = self.cycle
        super().data_received(data)
        if self.cycle is not cycle:  # a request head arrived
            self._disarm_header_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm_header_timer()

    def connection_lost(self, exc) -> None:
        self._disarm_header_timer()
        super().connection_lost(exc)

    def _arm_header_timer(self) -> None:
        self._disarm_header_timer()
        if self.header_timeout:
            self._header_timer = self.loop.call_later(self.header_timeout, self._header_timeout_expired)

    def _disarm_header_timer(self) -> None:
        if getattr(self, "_header_timer", None) is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_timeout_expired(self) -> None:
        self._header_timer = None
        waiting_for_head = self.cycle is None or self.cycle.response_complete
        if waiting_for_head and not self.transport.is_closing():
            log.debug("closing a connection that sent no request head within %.0f s", self.header_timeout)
            self.transport.close()


def timed_protocol(header_timeout: float) -> type[TimedH11Protocol]:
    return type("TimedH11Protocol", (TimedH11Protocol,), {"header_timeout": header_timeout})
