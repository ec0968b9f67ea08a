"""Server lifecycle: an engine that dies fails its requests (never hangs them) and turns /health 503; SIGTERM
drains (503 for new requests, in-flight streams finish, exit 0); `jaxserve serve` start-up errors and --help."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
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


def test_engine_failure_fails_in_flight_requests_and_health(converted, monkeypatch):
    model_dir = converted("llama3.1")
    engine = LLMEngine.from_model_dir(model_dir, TINY_ENGINE, show_progress=False)

    def broken_dispatch(*args, **kwargs):
        raise RuntimeError("injected device failure")

    async def scenario(url: str, async_engine):
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            whole = asyncio.create_task(client.post("/v1/completions", json=LONG))
            async with client.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as stream:
                lines = stream.aiter_lines()
                assert (await anext(lines)).startswith("data: ")
                await asyncio.to_thread(wait_for, lambda: async_engine.stats().num_running == 2, 30, "both requests running")
                monkeypatch.setattr(engine.core.runner, "dispatch", broken_dispatch)
                rest = [line async for line in lines]
            return await whole, rest

    with running_engine(engine) as async_engine, serve_in_thread(server_state(async_engine, model_dir)) as server:
        assert httpx.get(f"{server.url}/health").status_code == 200
        whole, rest = asyncio.run(scenario(server.url, async_engine))
        assert whole.status_code == 500
        assert "injected device failure" in whole.json()["error"]["message"]
        events = [line for line in rest if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
        assert "injected device failure" in json.loads(events[-2][6:])["error"]["message"]
        health = httpx.get(f"{server.url}/health")
        assert health.status_code == 503 and "injected device failure" in health.json()["error"]
        refused = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert refused.status_code == 503 and refused.json()["error"]["type"] == "service_unavailable"
        alive = [line for line in httpx.get(f"{server.url}/metrics").text.splitlines()
                 if line.startswith("jaxserve:engine_alive")]
        assert alive and alive[0].endswith(" 0.0")


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
    process, url, log_path = serve_process
    with httpx.Client(base_url=url, timeout=60) as client:
        with client.stream("POST", "/v1/completions", json={**LONG, "stream": True},
                           headers={"X-Request-Id": "drain-me"}) as stream:
            lines = stream.iter_lines()
            assert next(lines).startswith("data: ")
            process.send_signal(signal.SIGTERM)
            with httpx.Client(base_url=url, timeout=10) as other:
                wait_for(lambda: other.get("/health").status_code == 503, 10, "/health to turn 503")
                refused = other.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
                assert refused.status_code == 503 and "shutting down" in refused.json()["error"]["message"]
            rest = [line for line in lines if line]
    events = [json.loads(line[6:]) for line in rest if line.startswith("data: {")]
    assert rest[-1] == "data: [DONE]" and events[-1]["choices"][0]["finish_reason"] == "length"
    assert process.wait(60) == 0
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
