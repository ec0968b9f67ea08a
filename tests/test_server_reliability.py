"""The server under hostile-but-fair use (a real uvicorn with the production settings, serving the tiny llama3.1
fixture): every error is a clean 4xx/5xx with the request id and a usable connection; text that is not valid
Unicode is a 400; hypothesis over the parameter space finds no 5xx; API keys; prompt, header and body limits;
stalled readers cost the event loop nothing."""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import socket
import threading
import time

import httpx
import psutil
import pytest
from hypothesis import HealthCheck, example, given, settings, strategies as st

from jaxserve.engine.engine import LLMEngine
from test_server_harness import SMALL_ENGINE, running_engine, serve_in_thread, server_state

USER = {"role": "user", "content": "hi"}


@pytest.fixture(scope="module")
def model_dir(converted):
    return converted("llama3.1")


@pytest.fixture(scope="module")
def engine(model_dir):
    with running_engine(LLMEngine.from_model_dir(model_dir, SMALL_ENGINE, show_progress=False)) as engine:
        yield engine


@pytest.fixture(scope="module")
def server(engine, model_dir):
    with serve_in_thread(server_state(engine, model_dir)) as live:
        yield live


def completes(url: str) -> bool:
    response = httpx.post(f"{url}/v1/completions", json={"prompt": "ok", "max_tokens": 2}, timeout=60)
    return response.status_code == 200 and len(response.json()["choices"]) == 1


def raw_exchange(sock: socket.socket, request: bytes) -> bytes:
    """Sends one HTTP/1.1 request on a kept-alive socket and reads one whole (Content-Length) response."""
    sock.sendall(request)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError(f"the server closed the connection: {data!r}")
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length"))
    while len(body) < length:
        body += sock.recv(65536)
    return head + b"\r\n\r\n" + body


def post(path: str, body: bytes) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


# ---- text that is not valid Unicode ---------------------------------------------------------------------------
@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", '{"prompt": "a\\ud800b", "max_tokens": 2}', "prompt"),
    ("/v1/completions", '{"prompt": ["ok", "\\udfff"], "max_tokens": 2}', "prompt[1]"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages[0].content"),
    ("/v1/completions", '{"prompt": "x", "logit_bias": {"\\ud800": 1}}', "logit_bias"),
    ("/v1/completions", '{"prompt": "x", "stop": ["\\ud800"]}', "stop[0]"),
    ("/tokenize", '{"prompt": "\\ud800"}', "prompt"),
])
def test_a_lone_surrogate_is_a_400_naming_where_it_is(server, path, body, param):
    response = httpx.post(f"{server.url}{path}", content=body.encode(), timeout=60,
                          headers={"Content-Type": "application/json", "X-Request-Id": "surrogate-1"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and "not valid Unicode" in error["message"]
    assert response.headers["x-request-id"] == "surrogate-1"


# ---- a 500 ----------------------------------------------------------------------------------------------------
def test_an_unexpected_error_is_one_json_500_with_the_request_id_on_a_connection_that_stays(server, monkeypatch,
                                                                                              caplog):
    tokenizer_class = type(server.state.tokenizer)
    real_encode = tokenizer_class.encode

    def encode(self, text, *args, **kwargs):
        if text == "explode":
            raise RuntimeError("injected tokenizer bug")
        return real_encode(self, text, *args, **kwargs)

    monkeypatch.setattr(tokenizer_class, "encode", encode)
    caplog.set_level(logging.INFO)
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        failed = raw_exchange(sock, post("/tokenize", b'{"prompt": "explode"}').replace(
            b"Host: test", b"Host: test\r\nX-Request-Id: boom-1"))
        head, _, body = failed.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 500") and b"x-request-id: boom-1" in head.lower()
        assert json.loads(body)["error"]["message"] == "internal server error: RuntimeError: injected tokenizer bug"
        again = raw_exchange(sock, post("/tokenize", b'{"prompt": "fine"}'))  # the same connection
        assert again.startswith(b"HTTP/1.1 200")
    time.sleep(0.2)  # the server thread logs after answering
    tracebacks = [r for r in caplog.records if r.exc_info is not None]
    assert len(tracebacks) == 1 and "boom-1" in tracebacks[0].getMessage()


# ---- the whole parameter space against the server -------------------------------------------------------------
NUMBERS = st.one_of(st.integers(-2, 40), st.sampled_from([2**31 - 1, 2**31, 2**63, -2**63, 10**30]),
                    st.floats(allow_nan=False, allow_infinity=False), st.booleans(), st.none(),
                    st.just("5"))
TEXT = st.one_of(st.text(max_size=10), st.text(max_size=3).map(lambda t: t + "\ud800"))
SAMPLING = {name: NUMBERS for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty",
                                       "frequency_penalty", "repetition_penalty", "seed", "min_tokens")}
SAMPLING.update(n=st.one_of(st.integers(1, 2), st.sampled_from([0, 129, 2**31, 1.5, "2"])),
                stop=st.one_of(TEXT, st.lists(TEXT, max_size=20)),
                stop_token_ids=st.lists(st.one_of(st.integers(0, 2000), st.just(2**31)), max_size=20),
                logit_bias=st.dictionaries(st.one_of(st.integers(0, 2000).map(str), TEXT), NUMBERS, max_size=3),
                ignore_eos=st.one_of(st.booleans(), st.just(1)), stream=st.booleans())
COMPLETION = st.fixed_dictionaries(
    {"prompt": st.one_of(TEXT, st.lists(TEXT, min_size=1, max_size=3), st.lists(st.integers(-1, 2**32), max_size=5),
                         st.just([[1, 2]] * 200))},
    optional={**SAMPLING, "max_tokens": st.one_of(st.integers(0, 4), st.sampled_from([2**31, 300, -1, 2.5])),
              "logprobs": st.one_of(st.integers(0, 3), st.sampled_from([21, 2**31])), "echo": st.booleans()})
CHAT = st.fixed_dictionaries(
    {"messages": st.one_of(st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "robot"]),
                                                            "content": TEXT}), min_size=1, max_size=2),
                           st.just([]))},
    optional={**SAMPLING, "max_completion_tokens": st.one_of(st.integers(1, 4), st.sampled_from([0, 2**31])),
              "logprobs": st.booleans(), "top_logprobs": st.integers(0, 21)})


KILLERS = [{"prompt": "x", "top_k": 2**31, "temperature": 1.0}, {"messages": [USER], "min_tokens": 2**31}]


def test_hypothesis_over_the_parameter_space_finds_no_5xx(server):
    """Every generated request is answered 200, or 4xx naming the field; the engine lives and serves after."""
    statuses: list[int] = []

    @settings(max_examples=150, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(chat=st.booleans(), completion=COMPLETION, chat_body=CHAT)
    @example(chat=False, completion=KILLERS[0], chat_body={"messages": []})
    @example(chat=True, completion={"prompt": "x"}, chat_body=KILLERS[1])
    def no_server_error(chat, completion, chat_body):
        path, body = ("/v1/chat/completions", chat_body) if chat else ("/v1/completions", completion)
        if chat and "max_completion_tokens" not in body and body.get("min_tokens", 0) in (0, None):
            body["max_completion_tokens"] = 4  # keeps accepted chats cheap
        response = httpx.post(f"{server.url}{path}", content=json.dumps(body).encode(), timeout=120,
                              headers={"Content-Type": "application/json"})
        statuses.append(response.status_code)
        assert response.status_code < 500, f"{path} {body!r}: {response.text[:500]}"
        if response.status_code == 400:
            error = response.json()["error"]
            assert error["message"] and error["param"], error  # names the field at fault
        if body in KILLERS:  # the two requests that used to kill the engine, each refused for its own field
            assert response.status_code == 400 and response.json()["error"]["param"] in ("top_k", "min_tokens")

    no_server_error()
    assert statuses.count(200) > 5 and sum(400 <= s < 500 for s in statuses) > 5
    assert server.engine.is_alive and completes(server.url)


# ---- limits ---------------------------------------------------------------------------------------------------
def test_prompts_per_request_are_capped(server):
    response = httpx.post(f"{server.url}/v1/completions", timeout=60,
                          json={"prompt": ["x"] * (server.state.config.max_prompts_per_request + 1), "max_tokens": 1})
    assert response.status_code == 400 and response.json()["error"]["param"] == "prompt"
    assert "at most 128" in response.json()["error"]["message"]


def test_api_keys_any_case_scheme_utf8_several_and_a_file_that_rotates(engine, model_dir, tmp_path):
    keys_file = tmp_path / "keys"
    keys_file.write_text("# rotated by ops\nfile-key-1\n")
    state = server_state(engine, model_dir, api_key=("sk-one", "sk-twö"), api_key_file=str(keys_file))
    with serve_in_thread(state) as keyed:
        def status(authorization: bytes | None) -> int:
            headers = {} if authorization is None else {"Authorization": authorization}
            return httpx.get(f"{keyed.url}/v1/models", headers=headers, timeout=30).status_code

        assert status(b"bearer sk-one") == 200 and status(b"BEARER  sk-one") == 200
        assert status("Bearer sk-twö".encode()) == 200  # a non-ASCII key, sent as UTF-8
        assert status(b"Bearer file-key-1") == 200
        assert status(b"Bearer sk-tw\xf6") == 401 and status(b"Basic sk-one") == 401 and status(None) == 401
        keys_file.write_text("file-key-2\n")
        os.utime(keys_file, ns=(time.time_ns(), time.time_ns() + 10**9))
        time.sleep(1.1)  # the file is looked at once a second at most
        assert status(b"Bearer file-key-2") == 200 and status(b"Bearer file-key-1") == 401


@contextlib.contextmanager
def timed_server(engine, model_dir, **config):
    with serve_in_thread(server_state(engine, model_dir, **config)) as live:
        host, port = live.url.removeprefix("http://").split(":")
        yield live, (host, int(port))


def closed_within(sock: socket.socket, seconds: float) -> bytes | None:
    """What the server sent before closing the connection, or None if it is still open after `seconds`."""
    sock.settimeout(seconds)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except TimeoutError:
        return None
    return data


def test_slow_headers_idle_connections_and_slow_bodies_time_out(engine, model_dir):
    with timed_server(engine, model_dir, header_timeout=1.0, body_timeout=1.0, timeout_keep_alive=1) as (live, addr):
        with socket.create_connection(addr) as idle, socket.create_connection(addr) as trickle, \
                socket.create_connection(addr) as slow_body:
            trickle.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # never finishes its headers
            slow_body.sendall(post("/v1/completions", b'{"prompt": "x", "max_tokens": 2}')[:-10])
            started = time.monotonic()
            assert closed_within(idle, 5) == b"" and closed_within(trickle, 5) == b""
            answer = closed_within(slow_body, 5)
            assert answer is not None and answer.startswith(b"HTTP/1.1 408")
            assert b"request_timeout" in answer and time.monotonic() - started < 4
        assert completes(live.url)


# ---- stalled readers ------------------------------------------------------------------------------------------
HOLD_SECONDS = float(os.environ.get("JAXSERVE_STALL_SECONDS", "30"))


def test_stalled_readers_cost_the_event_loop_nothing(server):
    """8 streams (n=8, 200 tokens each) are opened and left unread for 30 s while other requests run; /health
    answers in under 100 ms throughout; the streams are dropped; RSS comes back within 10%."""
    process = psutil.Process()
    body = {"prompt": "The river ran", "max_tokens": 200, "ignore_eos": True, "n": 8, "stream": True,
            "logprobs": 5}

    def hold_streams(seconds: float, load: bool) -> list[float]:
        latencies: list[float] = []
        done = threading.Event()

        def traffic():
            with httpx.Client(base_url=server.url, timeout=60) as client:
                while not done.is_set():
                    client.post("/v1/completions", json={"prompt": "load", "max_tokens": 8})

        host, port = server.url.removeprefix("http://").split(":")
        with contextlib.ExitStack() as stack:
            sockets = []
            for _ in range(8):
                sock = stack.enter_context(socket.create_connection((host, int(port))))
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                sock.sendall(post("/v1/completions", json.dumps(body).encode()))
                sockets.append(sock)  # never read: the server's writes back up
            worker = threading.Thread(target=traffic)
            if load:
                worker.start()
            deadline = time.monotonic() + seconds
            with httpx.Client(base_url=server.url, timeout=30) as probe:
                while time.monotonic() < deadline:
                    started = time.perf_counter()
                    assert probe.get("/health").status_code == 200
                    latencies.append(time.perf_counter() - started)
                    time.sleep(0.1)
            done.set()
            if load:
                worker.join()
        return latencies  # leaving the ExitStack drops the 8 connections

    hold_streams(3, load=False)  # warm-up: the allocator's pools, the compiled paths
    wait_idle(server)
    gc.collect()
    rss_before = process.memory_info().rss
    latencies = hold_streams(HOLD_SECONDS, load=True)
    assert max(latencies) < 0.1, sorted(latencies)[-5:]
    wait_idle(server)
    gc.collect()
    rss_after = process.memory_info().rss
    print(f"stalled readers: /health max {max(latencies) * 1000:.1f} ms over {len(latencies)} probes; "
          f"RSS {rss_before / 2**20:.1f} -> {rss_after / 2**20:.1f} MiB")
    assert rss_after < rss_before * 1.10, (rss_before / 2**20, rss_after / 2**20)
    assert completes(server.url)


def wait_idle(server, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while server.engine.stats().num_running or server.engine.stats().num_waiting or server.engine.num_queued:
        assert time.monotonic() < deadline, "the engine did not go idle"
        time.sleep(0.05)
    time.sleep(0.2)
