"""What an operator meets besides the API: the model endpoints SDKs and lm-eval call first (GET /v1/models/{id},
GET /tokenizer_info), the default served name, and the logs (library noise silenced, progress bars only on a
terminal, --log-format json), including a real `jaxserve serve` start-up written to a file."""

from __future__ import annotations

import io
import json
import logging
import os
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest

from jaxserve.cli import main
from jaxserve.engine.engine import LLMEngine
from jaxserve.logs import configure_logging, progress
from jaxserve.server.config import ServerConfig
from jaxserve.server.state import ServerState, default_served_names
from test_server_harness import TINY_ENGINE, TINY_ENGINE_FLAGS, running_engine, serve_in_thread, server_state


@pytest.fixture(scope="module")
def engine(converted):
    model_dir = converted("llama3.1")
    llm = LLMEngine.from_model_dir(model_dir, TINY_ENGINE, show_progress=False)
    with running_engine(llm) as async_engine:
        yield async_engine, model_dir


@pytest.fixture(scope="module")
def server(engine):
    async_engine, model_dir = engine
    with serve_in_thread(server_state(async_engine, model_dir)) as live:
        yield live


# ---- models and tokenizer ---------------------------------------------------------------------------------------
def test_models_retrieve_with_the_openai_client(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
    model = client.models.retrieve("tiny-llama")
    assert model.id == "tiny-llama" and model.model_extra["max_model_len"] == TINY_ENGINE.max_model_len
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("gpt-4")
    assert "gpt-4" in str(info.value) and "tiny-llama" in str(info.value)


def test_tokenizer_info_serves_what_lm_evals_remote_tokenizer_reads(server):
    info = httpx.get(f"{server.url}/tokenizer_info").json()
    tokenizer = server.state.tokenizer
    assert info["eos_token"] == tokenizer.special_tokens.eos and info["bos_token"] == tokenizer.special_tokens.bos
    assert info["model_max_length"] == info["max_model_len"] == TINY_ENGINE.max_model_len
    assert info["chat_template"] and "messages" in info["chat_template"]
    assert info["tokenizer_class"] and "added_tokens_decoder" not in info
    # the round trip lm-eval makes: eos string -> /tokenize -> the tokenizer's eos id
    ids = httpx.post(f"{server.url}/tokenize", json={"prompt": info["eos_token"], "add_special_tokens": False})
    assert ids.json()["tokens"] == [tokenizer.eos_token_ids[0]]


def test_default_served_name_is_the_directory_base_name_and_the_path_is_accepted(engine):
    async_engine, model_dir = engine
    assert default_served_names("/srv/models/llama-3-8b/") == ("llama-3-8b", "/srv/models/llama-3-8b/")
    assert default_served_names("ckpt") == ("ckpt",)
    state = ServerState.build(async_engine, ServerConfig(), str(model_dir))
    with serve_in_thread(state) as live:
        listed = httpx.get(f"{live.url}/v1/models").json()["data"]
        assert [m["id"] for m in listed] == [model_dir.name]
        for name in (model_dir.name, str(model_dir)):
            response = httpx.post(f"{live.url}/v1/completions", json={"model": name, "prompt": "Hi", "max_tokens": 2})
            assert response.status_code == 200 and response.json()["model"] == model_dir.name
        assert httpx.get(f"{live.url}/v1/models/{model_dir}").json()["id"] == str(model_dir)
        assert f'model_name="{model_dir.name}"' in httpx.get(f"{live.url}/metrics").text


# ---- logs ---------------------------------------------------------------------------------------------------------
@pytest.fixture
def restore_logging():
    root = logging.getLogger()
    saved = (list(root.handlers), root.level,
             {name: logging.getLogger(name).level for name in ("jaxserve", "uvicorn", "absl", "orbax", "jax")})
    yield
    root.handlers[:], levels = saved[0], saved[2]
    root.setLevel(saved[1])
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)


def test_library_info_lines_are_silenced_unless_debug(restore_logging):
    stream = io.StringIO()
    configure_logging("info", "text", stream)
    logging.getLogger("absl").info("absl info")
    logging.getLogger("orbax.checkpoint").info("orbax info")
    logging.getLogger("some.library").info("library info")
    logging.getLogger("some.library").warning("library warning")
    logging.getLogger("jaxserve.engine.engine").info("engine ready")
    text = stream.getvalue()
    assert "engine ready" in text and "library warning" in text
    assert "absl info" not in text and "orbax info" not in text and "library info" not in text
    configure_logging("debug", "text", stream)
    logging.getLogger("absl").debug("absl debug")
    assert "absl debug" in stream.getvalue()
    configure_logging("warning", "text", stream)
    logging.getLogger("jaxserve.server").info("hidden")
    assert "hidden" not in stream.getvalue()


def test_json_log_lines(restore_logging):
    stream = io.StringIO()
    configure_logging("info", "json", stream)
    logging.getLogger("jaxserve.server").info("serving %s", "x")
    try:
        raise ValueError("boom")
    except ValueError:
        logging.getLogger("jaxserve.server").exception("failed")
    first, second = (json.loads(line) for line in stream.getvalue().splitlines())
    assert first["message"] == "serving x" and first["level"] == "INFO" and first["logger"] == "jaxserve.server"
    assert first["time"].endswith("Z") and "ValueError: boom" in second["exception"]


def test_bad_log_options_name_the_flag(capsys):
    with pytest.raises(ValueError, match="--log-format must be one of text, json"):
        configure_logging("info", "xml")
    with pytest.raises(ValueError, match="--log-level"):
        configure_logging("loud")
    assert main(["serve", "--log-format", "xml"]) == 1
    assert "--log-format must be one of text, json, not 'xml'" in capsys.readouterr().err


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_is_a_bar_on_a_terminal_and_log_lines_elsewhere(restore_logging, monkeypatch):
    terminal = Terminal()
    assert list(progress(range(5), "compiling", unit="executable", stream=terminal)) == [0, 1, 2, 3, 4]
    assert "\r" in terminal.getvalue() and "compiling" in terminal.getvalue()
    logged, pipe = io.StringIO(), io.StringIO()
    configure_logging("info", "text", logged)
    monkeypatch.setattr("jaxserve.logs.PROGRESS_LOG_SECONDS", 0.0)
    assert list(progress(range(3), "compiling", unit="executable", stream=pipe)) == [0, 1, 2]
    assert pipe.getvalue() == "" and "\r" not in logged.getvalue()
    lines = logged.getvalue().splitlines()
    assert "compiling: 3/3 executables (100%)" in lines[-1] and "1/3 executables (33%)" in lines[0]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_until_up(process: subprocess.Popen, url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while process.poll() is None and time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"the server did not come up within {timeout} s (exit code {process.poll()})")


def test_serve_start_up_log_in_a_file_is_one_json_object_per_line_from_our_loggers(converted, tmp_path):
    """A real start-up with stdout and stderr in a file (as under systemd or Kubernetes): no carriage return,
    nothing but JSON lines, and no INFO line from a library (absl, orbax, jax)."""
    port = free_port()
    log_path = tmp_path / "serve.log"
    command = [sys.executable, "-m", "jaxserve.cli", "serve", "--model", str(converted("llama3.1")), "--port",
               str(port), "--log-format", "json", *TINY_ENGINE_FLAGS]
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                   env={**os.environ, "JAX_PLATFORMS": "cpu"})
        try:
            wait_until_up(process, f"http://127.0.0.1:{port}", 180)
        except AssertionError as exc:
            raise AssertionError(f"{exc}; its log:\n{log_path.read_text()[-4000:]}") from None
        finally:
            process.terminate()
            process.wait(60)
    text = log_path.read_text()
    assert "\r" not in text
    entries = [json.loads(line) for line in text.splitlines()]
    info = [e for e in entries if e["level"] in ("INFO", "DEBUG")]
    assert {e["logger"].split(".")[0] for e in info} <= {"jaxserve", "uvicorn"}, info
    messages = " ".join(e["message"] for e in info)
    # ("compiling step shapes" appears only when shapes are left after the memory plan's measuring compiles: with
    # this tiny ladder and enough free memory there are none)
    assert "engine ready" in messages and "serving" in messages
    assert any(e["logger"].startswith("uvicorn") for e in info), "uvicorn's start-up lines are missing"
