"""The OpenAI-compatible server, end to end: a real uvicorn on 127.0.0.1 serving the tiny llama3.1 fixture, driven by
the official `openai` client and raw httpx. Greedy and seeded results are checked against the offline engine
(the same compiled engine, run through `LLM` before the server starts)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from jaxserve.config import sampling_defaults
from jaxserve.engine.engine import LLMEngine
from jaxserve.engine.llm import LLM
from jaxserve.sampling_params import SamplingParams
from jaxserve.server.config import ServerConfig
from jaxserve.server.state import ServerState
from test_server_harness import SMALL_ENGINE, running_engine, serve_in_thread, server_state

MODEL = "tiny-llama"
PROMPTS = ["The river ran", "The engineer wrote a test first, and", "Hello"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, logprobs=2)
SEEDED = SamplingParams(temperature=1.0, seed=1234, max_tokens=16)
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Write one line."}]
CONCURRENT_PROMPTS = [f"Client {i} says" for i in range(64)]
CONCURRENT = SamplingParams(temperature=0.0, max_tokens=16)
SCORED = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
# 32 concurrent streams x 2 samples x 64 tokens with 5 alternatives each: the load under which a shared, growing
# logprob list used to hand a chunk the logprobs of later tokens.
STREAMED_PROMPTS = [f"Stream {i} of the race:" for i in range(32)]
STREAMED = SamplingParams(n=2, temperature=1.0, seed=77, max_tokens=64, ignore_eos=True, logprobs=5)


@pytest.fixture(scope="module")
def model_dir(converted):
    return converted("llama3.1")


@pytest.fixture(scope="module")
def offline(model_dir):
    """The engine and what the offline API (LLM) generates with it, before the server takes it over."""
    engine = LLMEngine.from_model_dir(model_dir, SMALL_ENGINE, show_progress=False)
    llm = LLM(engine=engine)
    chat_ids = engine.tokenizer.encode_chat(CHAT)
    return {
        "engine": engine,
        "greedy": llm.generate(PROMPTS, GREEDY),
        "seeded": llm.generate(PROMPTS[0], SEEDED)[0],
        "chat": llm.generate([chat_ids], SamplingParams(temperature=0.0, max_tokens=16, logprobs=3))[0],
        "concurrent": llm.generate(CONCURRENT_PROMPTS, CONCURRENT),
        "scored": llm.generate(PROMPTS[0], SCORED)[0],
        "streamed": llm.generate(STREAMED_PROMPTS, STREAMED),
    }


@pytest.fixture(scope="module")
def server(offline, model_dir):
    with running_engine(offline["engine"]) as engine, serve_in_thread(server_state(engine, model_dir)) as live:
        yield live


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=120, max_retries=0)


# ---- helpers ------------------------------------------------------------------------------------------------
def sse_payloads(raw: bytes) -> list:
    """Each event's payload (decoded JSON, or the string "[DONE]"); asserts the byte framing on the way."""
    assert raw.endswith(b"\n\n"), raw[-50:]
    events = raw[:-2].split(b"\n\n")
    payloads = []
    for event in events:
        assert event.startswith(b"data: ") and b"\n" not in event, event
        data = event[len(b"data: "):]
        payloads.append("[DONE]" if data == b"[DONE]" else json.loads(data))
    return payloads


def metric_samples(server) -> dict[tuple[str, tuple], float]:
    text = httpx.get(f"{server.url}/metrics").text
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[sample.name, tuple(sorted(sample.labels.items()))] = sample.value
    return samples


def metric(server, name: str, **labels) -> float:
    labels.setdefault("model_name", MODEL)
    return metric_samples(server).get((name, tuple(sorted(labels.items()))), 0.0)


def kv_usage(server) -> float:
    return metric(server, "jaxserve:kv_cache_usage_perc")


def wait_for(predicate, timeout: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def wait_until_idle(server) -> None:
    wait_for(lambda: server.engine.stats().num_running == 0 and server.engine.stats().num_waiting == 0
             and kv_usage(server) == 0.0,
             what="the engine to go idle")


def streamed_texts(chunks) -> dict[int, str]:
    texts: dict[int, str] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            piece = choice.text if hasattr(choice, "text") else (choice.delta.content or "")
            texts[choice.index] = texts.get(choice.index, "") + piece
    return texts


# ---- the openai client: results equal the offline engine's -------------------------------------------------
def test_completions_greedy_equal_the_offline_engine(client, offline):
    response = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=24, temperature=0, logprobs=2)
    assert [c.index for c in response.choices] == [0, 1, 2]
    for choice, reference in zip(response.choices, offline["greedy"]):
        sample = reference.outputs[0]
        assert choice.text == sample.text
        assert choice.finish_reason == sample.finish_reason
        assert len(choice.logprobs.tokens) == len(sample.token_ids)
        assert choice.logprobs.token_logprobs == pytest.approx([t.logprob for t in sample.logprobs], abs=1e-4)
        for top, entry in zip(choice.logprobs.top_logprobs, sample.logprobs):
            assert len(top) >= 2 and max(top.values()) == pytest.approx(entry.top[0][1], abs=1e-4)
    assert response.usage.prompt_tokens == sum(len(r.prompt_token_ids) for r in offline["greedy"])
    assert response.usage.completion_tokens == sum(len(r.outputs[0].token_ids) for r in offline["greedy"])
    assert response.object == "text_completion" and response.model == MODEL and response.id.startswith("cmpl-")


def test_completions_token_id_prompts(client, offline):
    ids = [list(r.prompt_token_ids) for r in offline["greedy"]]
    response = client.completions.create(model=MODEL, prompt=ids, max_tokens=24, temperature=0)
    assert [c.text for c in response.choices] == [r.outputs[0].text for r in offline["greedy"]]


def test_completions_streaming_equal_the_offline_engine(client, offline):
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=24, temperature=0,
                                            stream=True))
    assert streamed_texts(chunks) == {i: r.outputs[0].text for i, r in enumerate(offline["greedy"])}
    finishes = {c.index: c.finish_reason for chunk in chunks for c in chunk.choices if c.finish_reason}
    assert finishes == {i: r.outputs[0].finish_reason for i, r in enumerate(offline["greedy"])}


def test_chat_equals_the_offline_engine(client, offline):
    reference = offline["chat"].outputs[0]
    response = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=16, temperature=0,
                                              logprobs=True, top_logprobs=3)
    choice = response.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == reference.text
    assert choice.finish_reason == reference.finish_reason
    content = choice.logprobs.content
    assert [c.logprob for c in content] == pytest.approx([t.logprob for t in reference.logprobs], abs=1e-4)
    assert all(len(c.top_logprobs) == 3 for c in content)
    assert b"".join(bytes(c.bytes) for c in content).decode("utf-8", errors="replace") == reference.text
    assert response.usage.prompt_tokens == len(offline["chat"].prompt_token_ids)
    assert response.object == "chat.completion" and response.id.startswith("chatcmpl-")


def test_chat_streaming_equals_the_offline_engine(client, offline):
    reference = offline["chat"].outputs[0]
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=16,
                                                 temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
    assert streamed_texts(chunks) == {0: reference.text}
    assert chunks[-1].choices[0].finish_reason == reference.finish_reason
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)


def test_stop_string_ends_the_text_before_it(client, offline):
    text = offline["greedy"][0].outputs[0].text
    stop = next(text[i:i + 2] for i in range(3, len(text) - 2) if text[i:i + 2].isprintable())
    response = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=24, temperature=0, stop=[stop])
    choice = response.choices[0]
    assert choice.text == text[:text.index(stop)]
    assert choice.finish_reason == "stop" and choice.model_extra["stop_reason"] == stop


def test_seed_gives_the_offline_engines_sample(client, offline):
    runs = [client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=16, temperature=1.0, seed=1234)
            for _ in range(2)]
    assert runs[0].choices[0].text == runs[1].choices[0].text == offline["seeded"].outputs[0].text


def test_n_samples_non_streaming(client):
    response = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=1.0, n=3,
                                         seed=7, extra_body={"ignore_eos": True})
    assert [c.index for c in response.choices] == [0, 1, 2]
    assert len({c.text for c in response.choices}) > 1
    assert response.usage.completion_tokens == 36


def test_n_samples_streaming_interleave_by_index(client):
    kwargs = dict(model=MODEL, prompt=PROMPTS[:2], max_tokens=12, temperature=1.0, n=2, seed=7)
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(**kwargs, stream=True))
    assert streamed_texts(chunks) == {c.index: c.text for c in whole.choices}
    finished = [c.index for chunk in chunks for c in chunk.choices if c.finish_reason]
    assert sorted(finished) == [0, 1, 2, 3]


def test_chat_n_samples_stream_opens_every_choice(client):
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, n=2, seed=3,
                                                 stream=True))
    assert [(c.index, c.delta.role) for c in chunks[0].choices + chunks[1].choices] == [(0, "assistant"),
                                                                                      (1, "assistant")]
    assert sorted(c.index for chunk in chunks for c in chunk.choices if c.finish_reason) == [0, 1]


def test_echo_with_max_tokens_zero_scores_the_prompt(client, offline):
    """lm-evaluation-harness's loglikelihood request: the prompt's logprobs, nothing generated."""
    scored = offline["scored"]
    response = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=0, echo=True, logprobs=1,
                                         temperature=0)
    choice = response.choices[0]
    assert choice.text == PROMPTS[0] and choice.finish_reason == "length"
    assert choice.logprobs.token_logprobs[0] is None and choice.logprobs.top_logprobs[0] is None
    assert choice.logprobs.token_logprobs[1:] == pytest.approx([t.logprob for t in scored.prompt_logprobs[1:]],
                                                               abs=1e-4)
    assert len(choice.logprobs.tokens) == len(scored.prompt_token_ids)
    assert choice.logprobs.text_offset[-1] < len(PROMPTS[0])
    assert response.usage.completion_tokens == 0


def test_echo_with_one_token_appends_it(client, offline):
    scored = offline["scored"]
    response = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=1, echo=True, logprobs=1,
                                         temperature=0)
    choice = response.choices[0]
    assert choice.text == PROMPTS[0] + scored.outputs[0].text
    assert len(choice.logprobs.tokens) == len(scored.prompt_token_ids) + 1
    streamed = list(client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=1, echo=True, logprobs=1,
                                              temperature=0, stream=True))
    assert streamed_texts(streamed) == {0: choice.text}


# ---- raw HTTP -----------------------------------------------------------------------------------------------
def test_sse_bytes_done_and_usage_chunk(server):
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 5, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = b"".join(response.iter_raw())
    payloads = sse_payloads(raw)
    assert payloads[-1] == "[DONE]"
    *chunks, usage_chunk = payloads[:-1]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 5
    assert usage_chunk["usage"]["total_tokens"] == usage_chunk["usage"]["prompt_tokens"] + 5
    assert all(c["usage"] is None and c["object"] == "text_completion" for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_chat_sse_without_usage_has_no_usage_field(server):
    body = {"messages": CHAT, "max_tokens": 3, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=60) as response:
        payloads = sse_payloads(response.read())
    assert payloads[-1] == "[DONE]"
    assert all("usage" not in p for p in payloads[:-1])
    assert payloads[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert payloads[-2]["choices"][0]["delta"] == {} and payloads[-2]["choices"][0]["finish_reason"]


def test_64_concurrent_streaming_clients_get_complete_correct_outputs(server, offline):
    async def one(client: httpx.AsyncClient, prompt: str) -> tuple[str, str | None, bool]:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 16, "temperature": 0, "stream": True}
        text, finish, done = "", None, False
        async with client.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    choice = json.loads(line[6:])["choices"][0]
                    text += choice["text"]
                    finish = choice["finish_reason"] or finish
        return text, finish, done

    async def everyone():
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(base_url=server.url, timeout=180, limits=limits) as client:
            return await asyncio.gather(*(one(client, p) for p in CONCURRENT_PROMPTS))

    results = asyncio.run(everyone())
    expected = [(r.outputs[0].text, r.outputs[0].finish_reason, True) for r in offline["concurrent"]]
    assert results == expected


def test_client_disconnect_mid_stream_frees_its_pages(server):
    wait_until_idle(server)
    aborted = metric(server, "jaxserve:request_success_total", finished_reason="abort")
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 240, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        for _ in range(3):
            assert next(line for line in lines if line.startswith("data: "))
        assert kv_usage(server) > 0.0
    wait_until_idle(server)
    assert metric(server, "jaxserve:request_success_total", finished_reason="abort") == aborted + 1


def test_client_disconnect_while_waiting_for_a_whole_completion_frees_its_pages(server, monkeypatch):
    wait_until_idle(server)
    aborted = metric(server, "jaxserve:request_success_total", finished_reason="abort")
    # The client gives up after 0.1 s. 4 x 240 tokens took the tiny model 0.1-1 s on 2-core CPUs (decode bursts: 8
    # tokens a step), so each engine step is made 20 ms longer: 30-odd steps outlast the client on any machine.
    core = server.engine._core
    step = core.step

    def slow_step():
        time.sleep(0.02)
        return step()

    monkeypatch.setattr(core, "step", slow_step)
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 240, "n": 4, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=body, timeout=httpx.Timeout(60, read=0.1))
    wait_until_idle(server)
    assert metric(server, "jaxserve:request_success_total", finished_reason="abort") == aborted + 4  # per sample


def test_full_queue_answers_429_with_retry_after(server):
    wait_until_idle(server)
    engine, limit = server.engine, server.engine.max_queued_requests
    long = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 200, "ignore_eos": True, "stream": True}
    engine.max_queued_requests = 2  # requests accepted and not yet scheduled
    try:
        with httpx.Client(base_url=server.url, timeout=60) as http, contextlib.ExitStack() as streams:
            running = streams.enter_context(http.stream("POST", "/v1/completions", json={**long, "n": 16}))
            assert running.status_code == 200  # its 16 samples take every slot
            wait_for(lambda: engine.stats().num_running == 16 and engine.num_queued == 0, what="16 running")
            for _ in range(2):
                waiting = streams.enter_context(http.stream("POST", "/v1/completions", json=long))
                assert waiting.status_code == 200
            assert engine.num_queued == 2
            for stream in (False, True):
                refused = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "stream": stream})
                assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
                assert refused.json()["error"]["type"] == "rate_limit_error"
                assert "2 requests are already waiting" in refused.json()["error"]["message"]
    finally:
        engine.max_queued_requests = limit
    wait_until_idle(server)
    assert metric(server, "jaxserve:requests_rejected_total", reason="queue_full") == 2
    assert client_can_still_complete(server)


def client_can_still_complete(server) -> bool:
    response = httpx.post(f"{server.url}/v1/completions", json={"prompt": "ok", "max_tokens": 2}, timeout=60)
    return response.status_code == 200 and len(response.json()["choices"]) == 1


BAD_COMPLETIONS = [
    (b"{not json", None),
    (b"[1, 2]", None),
    (b'{"prompt": "x", "temperature": NaN}', None),
    ({"prompt": "x", "max_tokens": "5"}, "max_tokens"),
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": "x", "n": 1.5}, "n"),
    ({"prompt": "x", "stream": "yes"}, "stream"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [[1, 2], []]}, "prompt[1]"),
    ({"prompt": ["a", 3]}, "prompt[1]"),
    ({}, "prompt"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "max_tokens": -1}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 300}, "max_tokens"),
    ({"prompt": "x " * 300}, "prompt"),
    ({"prompt": ["ok", "x " * 300]}, "prompt[1]"),
    ({"prompt": [1, 2, 100000]}, "prompt"),
    ({"prompt": "x", "model": "gpt-4"}, "model"),
    ({"prompt": "x", "logprobs": 21}, "logprobs"),
    ({"prompt": "x", "stop": [""]}, "stop[0]"),
    ({"prompt": "x", "logit_bias": {"abc": 1}}, "logit_bias.abc"),
    ({"prompt": "x", "logit_bias": {"99999": 1}}, "logit_bias"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "seed": -1}, "seed"),
    ({"prompt": "x", "suffix": "y"}, "suffix"),
    ({"prompt": "x", "best_of": 3}, "best_of"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
]
USER = {"role": "user", "content": "hi"}
BAD_CHATS = [
    ({"messages": []}, "messages"),
    ({}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages[0].content[0].type"),
    ({"messages": [USER], "max_completion_tokens": 0}, "max_completion_tokens"),
    ({"messages": [USER], "max_tokens": 1000}, "max_tokens"),
    ({"messages": [USER], "top_logprobs": 2}, "top_logprobs"),
    ({"messages": [USER], "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"messages": [USER], "response_format": {"type": "json_schema"}}, "response_format.json_schema"),  # no schema
    ({"messages": [USER], "model": "gpt-4"}, "model"),
    ({"messages": [USER], "chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
]


@pytest.mark.parametrize("path, body, param", [("/v1/completions", b, p) for b, p in BAD_COMPLETIONS]
                         + [("/v1/chat/completions", b, p) for b, p in BAD_CHATS])
def test_bad_input_is_a_400_naming_the_parameter(server, path, body, param):
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    response = httpx.post(f"{server.url}{path}", timeout=60, **kwargs)
    assert response.status_code == (404 if param == "model" else 400), response.text  # OpenAI: unknown model 404
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    assert error["param"] == param, error


def test_generation_config_sets_the_defaults_of_unset_fields(server, offline, model_dir, tmp_path):
    """--generation-config FOLDER: a request without temperature/max_tokens gets the file's (greedy, 24 tokens: the
    offline greedy run); one that sets them keeps its own (the seeded run)."""
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "max_new_tokens": 24}))
    defaults = sampling_defaults(model_dir, str(tmp_path))
    state = ServerState.build(server.engine, ServerConfig(served_model_name=(MODEL,)), str(model_dir), defaults)
    with serve_in_thread(state) as live:
        unset = httpx.post(f"{live.url}/v1/completions", json={"prompt": PROMPTS[0], "logprobs": 2}, timeout=60)
        seeded = httpx.post(f"{live.url}/v1/completions", timeout=60, json={
            "prompt": PROMPTS[0], "temperature": 1.0, "seed": 1234, "max_tokens": 16})
    assert unset.json()["choices"][0]["text"] == offline["greedy"][0].outputs[0].text
    assert seeded.json()["choices"][0]["text"] == offline["seeded"].outputs[0].text
    assert LLM(model_dir, engine=offline["engine"]).get_default_sampling_params().temperature == 0.6
    assert LLM(model_dir, engine=offline["engine"], generation_config="vllm").get_default_sampling_params() == \
        SamplingParams()


def test_unknown_fields_are_ignored_and_null_means_default(server):
    body = {"prompt": "x", "max_tokens": 2, "frobnicate": {"a": 1}, "temperature": None, "n": None, "stop": None}
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200 and len(response.json()["choices"]) == 1


def test_body_over_the_size_limit_is_a_413(server):
    big = {"prompt": "x" * (server.state.config.max_request_bytes + 1)}
    response = httpx.post(f"{server.url}/v1/completions", json=big, timeout=60)
    assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"
    chunked = httpx.post(f"{server.url}/v1/completions", content=iter([json.dumps(big).encode()]), timeout=60)
    assert chunked.status_code == 413


def test_api_key_is_required_when_configured(server, model_dir):
    with serve_in_thread(server_state(server.engine, model_dir, api_key="sk-test")) as keyed:
        url = f"{keyed.url}/v1/completions"
        body = {"prompt": "x", "max_tokens": 2}
        for headers in ({}, {"Authorization": "Bearer sk-wrong"}, {"Authorization": "sk-test"}):
            response = httpx.post(url, json=body, headers=headers, timeout=60)
            assert response.status_code == 401 and response.json()["error"]["type"] == "authentication_error"
        assert httpx.get(f"{keyed.url}/v1/models").status_code == 401
        ok = httpx.post(url, json=body, headers={"Authorization": "Bearer sk-test"}, timeout=60)
        assert ok.status_code == 200
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{keyed.url}/v1", api_key="sk-wrong", max_retries=0).models.list()
        assert openai.OpenAI(base_url=f"{keyed.url}/v1", api_key="sk-test").models.list().data[0].id == MODEL
        assert all(httpx.get(f"{keyed.url}{p}").status_code == 200 for p in ("/health", "/metrics", "/openapi.json"))


def test_request_id_is_returned_and_logged(server, caplog):
    caplog.set_level(logging.INFO, logger="jaxserve.access")
    mine = httpx.get(f"{server.url}/v1/models", headers={"X-Request-Id": "trace-42"})
    assert mine.headers["x-request-id"] == "trace-42"
    generated = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", "max_tokens": 1}, timeout=60)
    assert re.fullmatch(r"[0-9a-f]{32}", generated.headers["x-request-id"])

    def logged(*parts: str) -> bool:  # the line is written just after the response is sent, on the server thread
        return any(all(p in r.getMessage() for p in parts) for r in caplog.records if r.name == "jaxserve.access")

    wait_for(lambda: logged("GET /v1/models", " 200 ", "request_id=trace-42"), timeout=5, what="the access log")
    wait_for(lambda: logged(f"request_id={generated.headers['x-request-id']}"), timeout=5, what="the access log")


def test_metrics_count_requests_tokens_and_latencies(server):
    before = metric_samples(server)
    response = httpx.post(f"{server.url}/v1/completions", timeout=60,
                          json={"prompt": PROMPTS[1], "max_tokens": 7, "ignore_eos": True}).json()
    after = metric_samples(server)

    def delta(name, **labels):
        key = (name, tuple(sorted({"model_name": MODEL, **labels}.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert delta("jaxserve:prompt_tokens_total") == response["usage"]["prompt_tokens"]
    assert delta("jaxserve:generation_tokens_total") == 7
    assert delta("jaxserve:request_success_total", finished_reason="length") == 1
    assert delta("jaxserve:time_to_first_token_seconds_count") == 1
    assert delta("jaxserve:e2e_request_latency_seconds_count") == 1
    assert delta("jaxserve:request_time_per_output_token_seconds_count") == 1
    http_key = ("jaxserve:http_requests_total",
                (("method", "POST"), ("model_name", MODEL), ("route", "/v1/completions"), ("status", "200")))
    assert after[http_key] - before.get(http_key, 0.0) == 1
    for gauge in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "engine_alive"):
        assert (f"jaxserve:{gauge}", (("model_name", MODEL),)) in after


def test_tokenize_and_detokenize(server, offline):
    tokenizer = offline["engine"].tokenizer
    tokens = httpx.post(f"{server.url}/tokenize", json={"prompt": PROMPTS[0], "return_token_strs": True}).json()
    assert tokens["tokens"] == tokenizer.encode(PROMPTS[0]) and tokens["count"] == len(tokens["tokens"])
    assert tokens["max_model_len"] == 256 and len(tokens["token_strs"]) == tokens["count"]
    chat = httpx.post(f"{server.url}/tokenize", json={"messages": CHAT}).json()
    assert chat["tokens"] == tokenizer.encode_chat(CHAT)
    text = httpx.post(f"{server.url}/detokenize", json={"tokens": tokens["tokens"]}).json()
    assert text == {"prompt": PROMPTS[0]}
    assert httpx.post(f"{server.url}/tokenize", json={}).status_code == 400
    assert httpx.post(f"{server.url}/detokenize", json={"tokens": [10**6]}).json()["error"]["param"] == "tokens"


def test_models_and_health(server):
    models = httpx.get(f"{server.url}/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == [MODEL]
    assert models["data"][0]["max_model_len"] == 256
    assert httpx.get(f"{server.url}/health").status_code == 200
    unknown = httpx.get(f"{server.url}/v2/nothing")
    assert unknown.status_code == 404 and "error" in unknown.json()
    assert httpx.get(f"{server.url}/v1/completions").status_code == 405


def test_openapi_describes_every_route(server):
    from jaxserve.server.app import ROUTES
    document = httpx.get(f"{server.url}/openapi.json").json()
    assert document["openapi"].startswith("3.1")
    documented = {(path, method.upper()) for path, ops in document["paths"].items() for method in ops}
    served = {(route.path.replace(":path}", "}"), method) for route in ROUTES for method in route.methods
              if method != "HEAD"}
    assert documented == served
    completion = document["components"]["schemas"]["CompletionRequest"]
    assert completion["required"] == ["prompt"] and "max_tokens" in completion["properties"]


def test_property_based_run_over_the_openapi_schema_has_no_5xx(server):
    """schemathesis generates valid and invalid requests for every operation in /openapi.json."""
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, given, settings, strategies as st
    from schemathesis import GenerationMode

    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    strategies = [op.as_strategy(GenerationMode.POSITIVE) for op in operations]
    strategies += [op.as_strategy(GenerationMode.NEGATIVE) for op in operations if op.body]
    seen: list[int] = []

    @settings(max_examples=200, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(case=st.one_of(strategies))
    def no_server_error(case):
        limit_cost(case.body)
        response = case.call(base_url=server.url, timeout=120)
        seen.append(response.status_code)
        assert response.status_code < 500, f"{case.method} {case.path} {case.body!r}: {response.text[:500]}"

    no_server_error()
    assert any(s == 200 for s in seen) and any(400 <= s < 500 for s in seen)
    wait_until_idle(server)
    assert client_can_still_complete(server)


def limit_cost(body) -> None:
    """Keeps generated requests cheap on a CPU: at most 2 samples of 4 tokens per prompt, 8 prompts."""
    if not isinstance(body, dict):
        return
    for field in ("max_tokens", "max_completion_tokens"):
        if isinstance(body.get(field), int) and not isinstance(body.get(field), bool):
            body[field] = min(body[field], 4)
    if "messages" in body and not isinstance(body.get("max_completion_tokens"), int):
        body["max_completion_tokens"] = 4
    if isinstance(body.get("n"), int) and not isinstance(body.get("n"), bool):
        body["n"] = min(body["n"], 2)
    if isinstance(body.get("prompt"), list) and len(body["prompt"]) > 8:
        body["prompt"] = body["prompt"][:8]


def test_serve_bench_runs_against_the_server(server, tmp_path, monkeypatch):
    import importlib.util
    import sys
    from pathlib import Path
    path = Path(__file__).parents[1] / "bench" / "serve_bench.py"
    spec = importlib.util.spec_from_file_location("serve_bench", path)
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "serve_bench", bench)  # dataclasses look their module up
    spec.loader.exec_module(bench)
    out = tmp_path / "bench.json"
    for dataset in ("random", "synthetic-chat"):
        assert bench.main(["--base-url", server.url, "--model", MODEL, "--dataset", dataset, "--input-len", "12",
                           "--output-len", "6", "--num-prompts", "8", "--request-rate", "50",
                           "--max-concurrency", "4", "--result-file", str(out)]) == 0
        result = json.loads(out.read_text())
        assert result["completed"] == 8 and result["failed"] == 0 and result["total_output_tokens"] == 48
        assert result["ttft"]["median_ms"] > 0 and result["tpot"]["mean_ms"] > 0 and result["itl"]["p99_ms"] > 0
    assert result["total_input_tokens"] > 8 * 12  # the chat template's tokens come on top of the words


# ---- streamed logprobs belong to their chunk's tokens ---------------------------------------------------------
def test_streamed_logprobs_belong_to_their_chunks_tokens(server, offline):
    """Every chunk's logprob entries are those of the chunk's own tokens: their strings are the strings of the
    offline engine's tokens at those positions, and their values the offline engine's (same seed)."""
    from jaxserve.server.logprobs import TokenText
    token_text = TokenText(offline["engine"].tokenizer)
    body = {"model": MODEL, "n": 2, "temperature": 1.0, "seed": 77, "max_tokens": 64, "ignore_eos": True,
            "logprobs": 5, "stream": True}

    async def stream(client, prompt):
        async with client.stream("POST", "/v1/completions", json={**body, "prompt": prompt}) as response:
            assert response.status_code == 200
            return [json.loads(line[6:]) for line in [line async for line in response.aiter_lines()]
                    if line.startswith("data: {")]

    async def everyone():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            return await asyncio.gather(*(stream(client, p) for p in STREAMED_PROMPTS))

    for chunks, reference in zip(asyncio.run(everyone()), offline["streamed"]):
        seen = {0: 0, 1: 0}
        for chunk in chunks:
            for choice in chunk["choices"]:
                sample = reference.outputs[choice["index"]]
                logprobs, start = choice["logprobs"], seen[choice["index"]]
                if logprobs is None:
                    continue
                count = len(logprobs["tokens"])
                expected_ids = sample.token_ids[start:start + count]
                assert logprobs["tokens"] == [token_text.text_of(t) for t in expected_ids]
                assert logprobs["token_logprobs"] == pytest.approx(
                    [e.logprob for e in sample.logprobs[start:start + count]], abs=1e-4)
                for top, token in zip(logprobs["top_logprobs"], logprobs["tokens"]):
                    assert len(top) >= 5 and token in top
                seen[choice["index"]] = start + count
        assert seen == {0: 64, 1: 64}
