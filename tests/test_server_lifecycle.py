"""Server lifecycle: a failing step fails only its requests; a dead engine fails its requests (never hangs them)
and the server exits 1; SIGTERM drains (503 for new requests, in-flight streams finish, a half-sent request does
not hold up exit, exit 0); `jaxserve serve` start-up errors and --help."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import jax
import pytest

from jaxserve.cli import main
from jaxserve.config import EngineConfig
from jaxserve.engine.engine import LLMEngine
from jaxserve.server.config import ServerConfig
from test_server_harness import TINY_ENGINE, TINY_ENGINE_FLAGS, running_engine, serve_in_thread, server_state

LONG = {"prompt": "The river ran", "max_tokens": 200, "ignore_eos": True}


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def test_a_failing_step_fails_its_requests_and_the_server_serves_on(converted, monkeypatch):
    """A host-side error in a step (not the device's): the requests in that step fail cleanly (a 500, an error
    event), the engine goes on, /health stays 200."""
    model_dir = converted("llama3.1")
    engine = LLMEngine.from_model_dir(model_dir, TINY_ENGINE, show_progress=False)
    real_dispatch = engine.core.runner.dispatch

    def broken_dispatch(*args, **kwargs):
        monkeypatch.setattr(engine.core.runner, "dispatch", real_dispatch)  # once
        raise RuntimeError("injected host failure")

    async def scenario(url: str, async_engine):
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            whole = asyncio.create_task(client.post("/v1/completions", json=LONG))
            async with client.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as stream:
                lines = stream.aiter_lines()
                assert (await anext(lines)).startswith("data: ")
                await asyncio.to_thread(wait_for, lambda: async_engine.stats().num_running == 2, 30,
                                        "both requests running")
                monkeypatch.setattr(engine.core.runner, "dispatch", broken_dispatch)
                rest = [line async for line in lines]
            return await whole, rest

    with running_engine(engine) as async_engine, serve_in_thread(server_state(async_engine, model_dir)) as server:
        assert httpx.get(f"{server.url}/health").status_code == 200
        whole, rest = asyncio.run(scenario(server.url, async_engine))
        assert whole.status_code == 500 and whole.headers["x-request-id"]
        assert "injected host failure" in whole.json()["error"]["message"]
        events = [line for line in rest if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
        assert "injected host failure" in json.loads(events[-2][6:])["error"]["message"]
        assert httpx.get(f"{server.url}/health").status_code == 200
        ok = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=60)
        assert ok.status_code == 200


def test_a_device_failure_fails_in_flight_requests_and_the_server_exits_1(converted, monkeypatch):
    """The device fails (no --engine-restart): the stream in flight ends with an error event, the engine is
    marked dead (what /health reports), and `serve` returns 1 at once, for the supervisor to restart the
    process."""
    from jaxserve.engine.async_engine import AsyncEngine, bottleneck_monitor
    from jaxserve.server.command import serve
    model_dir = converted("llama3.1")
    engine = LLMEngine.from_model_dir(model_dir, TINY_ENGINE, show_progress=False)
    async_engine = AsyncEngine(engine.core, monitor=bottleneck_monitor(engine.core)).start()
    port = free_port()
    result: list[int] = []
    server = threading.Thread(target=lambda: result.append(serve(
        async_engine, ServerConfig(port=port, log_level="warning", served_model_name=("tiny",)), str(model_dir))))
    server.start()
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: responds(url) or not server.is_alive(), 60, "the server to start")
        assert server.is_alive(), result

        def device_failure(*args, **kwargs):
            raise jax.errors.JaxRuntimeError("INTERNAL: injected device failure")

        with httpx.Client(base_url=url, timeout=60) as client:
            with client.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as stream:
                lines = stream.iter_lines()
                assert next(lines).startswith("data: ")
                monkeypatch.setattr(engine.core.runner, "dispatch", device_failure)
                rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]" and "injected device failure" in rest[-2]
        assert not async_engine.is_alive
        server.join(10)
        assert result == [1]
    finally:
        async_engine.stop()
        server.join(10)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def serve_process(converted, tmp_path):
    """`jaxserve serve` in a subprocess on a free port; yields (process, url); killed if the test leaves it."""
    port = free_port()
    command = [sys.executable, "-m", "jaxserve.cli", "serve", "--model", str(converted("llama3.1")),
               "--port", str(port), "--served-model-name", "tiny", *TINY_ENGINE_FLAGS]
    log = open(tmp_path / "serve.log", "w+")
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                               env={**os.environ, "JAX_PLATFORMS": "cpu"})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: process.poll() is not None or responds(url), 180, "the server to start")
        assert process.poll() is None, (tmp_path / "serve.log").read_text()
        yield process, url, tmp_path / "serve.log"
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(30)
        log.close()


def responds(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def test_sigterm_drains_in_flight_streams_then_exits(serve_process):
    """The generating stream finishes; a request whose body is still arriving gets 503 at once and does not hold
    up exit: the process exits within 2 s of the last generating request."""
    process, url, log_path = serve_process
    host, port = url.removeprefix("http://").split(":")
    with httpx.Client(base_url=url, timeout=60) as client, socket.create_connection((host, int(port))) as slow:
        slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"prompt\": ")  # and nothing more
        with client.stream("POST", "/v1/completions", json={**LONG, "stream": True},
                           headers={"X-Request-Id": "drain-me"}) as stream:
            lines = stream.iter_lines()
            assert next(lines).startswith("data: ")
            process.send_signal(signal.SIGTERM)
            with httpx.Client(base_url=url, timeout=10) as other:
                wait_for(lambda: other.get("/health").status_code == 503, 10, "/health to turn 503")
                refused = other.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
                assert refused.status_code == 503 and "shutting down" in refused.json()["error"]["message"]
            slow.settimeout(10)
            assert slow.recv(65536).startswith(b"HTTP/1.1 503")
            rest = [line for line in lines if line]
            generated = time.monotonic()
    events = [json.loads(line[6:]) for line in rest if line.startswith("data: {")]
    assert rest[-1] == "data: [DONE]" and events[-1]["choices"][0]["finish_reason"] == "length"
    assert process.wait(60) == 0
    assert time.monotonic() - generated < 2.0
    log = log_path.read_text()
    assert "request_id=drain-me" in log and "draining" in log


def test_serve_help_has_a_flag_for_every_config_field(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for config in (ServerConfig, EngineConfig):
        for name in config.__dataclass_fields__:
            assert f"--{name.replace('_', '-')}" in text
    assert "--model DIR" in text and "checkpoints/demo" in text


def test_serve_without_a_model_explains_what_to_do(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["serve"]) == 1
    message = capsys.readouterr().err
    assert "checkpoints/demo" in message and "jaxserve convert" in message
    assert main(["serve", "--model", str(tmp_path / "missing")]) == 1
    assert "no such directory" in capsys.readouterr().err
    (tmp_path / "not-a-checkpoint").mkdir()
    assert main(["serve", "--model", str(tmp_path / "not-a-checkpoint")]) == 1
    assert "jaxserve convert" in capsys.readouterr().err
