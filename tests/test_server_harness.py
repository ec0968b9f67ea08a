"""Helpers for the server tests (no tests here): a real uvicorn on 127.0.0.1 in a thread of the test process,
and the small engine configuration the server suites share."""

from __future__ import annotations

import contextlib
import socket
import threading
from typing import Iterator

import uvicorn

from jaxserve.config import EngineConfig
from jaxserve.engine.async_engine import AsyncEngine, bottleneck_monitor
from jaxserve.engine.engine import LLMEngine
from jaxserve.server.app import build_app
from jaxserve.server.command import uvicorn_config
from jaxserve.server.config import ServerConfig
from jaxserve.server.state import ServerState

# Ten step shapes, compiled in ~20 s on a loaded 2-core CPU. 16 sequences x 256 tokens fit the KV cache.
SMALL_ENGINE = EngineConfig(max_num_seqs=16, max_num_batched_tokens=128, page_size=8, max_model_len=256,
                            decode_buckets=(4, 16), prefill_token_buckets=(32, 128), prefill_seq_buckets=(4, 16),
                            context_buckets=(256,), kv_cache_memory=2**23, xla_optimization_level=0,
                            compilation_cache_dir="")
# Three shapes, for servers a test kills (engine failure).
TINY_ENGINE = SMALL_ENGINE.replace(max_num_seqs=4, max_num_batched_tokens=32, decode_buckets=(4,),
                                   prefill_token_buckets=(32,), prefill_seq_buckets=(4,))
TINY_ENGINE_FLAGS = ["--max-num-seqs", "4", "--max-num-batched-tokens", "32", "--page-size", "8",
                     "--max-model-len", "256", "--decode-buckets", "4", "--prefill-token-buckets", "32",
                     "--prefill-seq-buckets", "4", "--context-buckets", "256", "--kv-cache-memory", str(2**23),
                     "--xla-optimization-level", "0", "--compilation-cache-dir", ""]


class _ThreadServer(uvicorn.Server):
    """uvicorn that says when it is listening (no polling for readiness)."""

    def __init__(self, config: uvicorn.Config):
        super().__init__(config)
        self.ready = threading.Event()

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        self.ready.set()


class LiveServer:
    """A started server: `url`, the ServerState (engine, metrics, lifecycle) and the app."""

    def __init__(self, state: ServerState, port: int):
        self.state = state
        self.url = f"http://127.0.0.1:{port}"

    @property
    def engine(self) -> AsyncEngine:
        return self.state.engine


@contextlib.contextmanager
def serve_in_thread(state: ServerState) -> Iterator[LiveServer]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    config = uvicorn_config(build_app(state), state.config.replace(log_level="warning"))  # `jaxserve serve`'s
    server = _ThreadServer(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="uvicorn", daemon=True)
    thread.start()
    if not server.ready.wait(60):
        raise RuntimeError("uvicorn did not start")
    try:
        yield LiveServer(state, sock.getsockname()[1])
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


@contextlib.contextmanager
def running_engine(engine: LLMEngine, max_queued_requests: int | None = 256) -> Iterator[AsyncEngine]:
    async_engine = AsyncEngine(engine.core, max_queued_requests, bottleneck_monitor(engine.core)).start()
    try:
        yield async_engine
    finally:
        async_engine.stop()


@contextlib.contextmanager
def live_server(model_dir, config: EngineConfig) -> Iterator[LiveServer]:
    """An engine built from `model_dir` with `config`, served in a thread with the default server settings."""
    engine = LLMEngine.from_model_dir(model_dir, config, show_progress=False)
    with running_engine(engine) as async_engine, serve_in_thread(server_state(async_engine, model_dir)) as live:
        yield live


def server_state(async_engine: AsyncEngine, model_dir, **config) -> ServerState:
    return ServerState.build(async_engine, ServerConfig(served_model_name=("tiny-llama",), **config), str(model_dir))
