"""Draining: what the first SIGTERM (or Ctrl-C) does.

    serving --signal--> draining: API routes answer 503, /health 503; requests in flight run to the end
            --in flight reaches 0 (or drain_timeout)--> uvicorn's own shutdown --> exit 0
    a second signal: uvicorn's immediate shutdown (streams still open are cut).
"""

from __future__ import annotations

import asyncio
import logging
import signal

import uvicorn

log = logging.getLogger(__name__)


class Lifecycle:
    """Whether the server takes new requests, and how many it is answering. Touched by the event loop only."""

    def __init__(self):
        self.draining = False
        self.in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()

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
    """uvicorn.Server whose first exit signal drains instead of closing at once."""

    def __init__(self, config: uvicorn.Config, lifecycle: Lifecycle, drain_timeout: float):
        super().__init__(config)
        self.lifecycle = lifecycle
        self.drain_timeout = drain_timeout
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame) -> None:
        if self.lifecycle.draining or not self.started or self._loop is None:
            super().handle_exit(sig, frame)
            return
        self.lifecycle.draining = True
        log.info("%s: draining %d request(s) in flight, refusing new ones (signal again to stop now)",
                 signal.Signals(sig).name, self.lifecycle.in_flight)
        self._loop.call_soon_threadsafe(self._start_exit_when_idle)

    def _start_exit_when_idle(self) -> None:
        self._drain_task = asyncio.ensure_future(self._exit_when_idle())

    async def _exit_when_idle(self) -> None:
        try:
            await asyncio.wait_for(self.lifecycle.wait_until_idle(), self.drain_timeout)
            log.info("drained; shutting down")
        except TimeoutError:
            log.warning("drain timeout (%.0fs) reached with %d request(s) in flight; shutting down",
                        self.drain_timeout, self.lifecycle.in_flight)
        self.should_exit = True
