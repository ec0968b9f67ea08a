"""Server pieces without a model: config flags, request validation, logprob token text, and the AsyncEngine
admission contract (on a fake engine whose steps are computed by hand)."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import threading
import time
import types
from pathlib import Path

import pytest

from jaxserve.cli_args import ENGINE_FLAG_HELP, add_config_flags, add_engine_flags, config_from_args, \
    engine_config_from_args, field_comments
from jaxserve.config import EngineConfig
from jaxserve.engine.async_engine import AsyncEngine, EngineDeadError, QueueFullError
from jaxserve.engine.replicas import ReplicaRouter
from jaxserve.engine.client import EngineClient
from jaxserve.engine.messages import EngineRequest, SampleDelta, SchedulerStats, StepOutputs
from jaxserve.outputs import CompletionOutput, RequestOutput
from jaxserve.sampling_params import SamplingParams
from jaxserve.server.errors import APIError
from jaxserve.server.protocol import ChatCompletionRequest, CompletionRequest, parse_request
from jaxserve.server.config import ServerConfig

TOKENIZERS = Path(__file__).parent / "fixtures" / "tokenizers"


# ---- flags from config dataclasses --------------------------------------------------------------------------
def engine_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    return parser


def test_engine_flags_round_trip_every_field():
    args = engine_parser().parse_args(["--max-num-seqs", "8", "--decode-buckets", "1,2,8", "--kv-cache-memory",
                                       "1e6", "--no-enable-prefix-caching", "--compilation-cache-dir", ""])
    config = engine_config_from_args(args)
    assert config == EngineConfig(max_num_seqs=8, decode_buckets=(1, 2, 8), kv_cache_memory=1e6,
                                  enable_prefix_caching=False, compilation_cache_dir="")
    assert engine_config_from_args(engine_parser().parse_args([])) == EngineConfig()


def test_every_engine_option_has_help_text():
    """A new EngineConfig field needs a trailing comment (or an ENGINE_FLAG_HELP entry) to describe its flag."""
    comments = field_comments(EngineConfig)
    for field in dataclasses.fields(EngineConfig):
        assert ENGINE_FLAG_HELP.get(field.name) or comments.get(field.name), field.name
    assert not set(ENGINE_FLAG_HELP) - {f.name for f in dataclasses.fields(EngineConfig)}


def test_server_flags_and_bad_values():
    parser = argparse.ArgumentParser()
    add_config_flags(parser, ServerConfig)
    args = parser.parse_args(["--served-model-name", "a,b", "--port", "9000", "--no-access-log"])
    assert config_from_args(ServerConfig, args) == ServerConfig(served_model_name=("a", "b"), port=9000,
                                                                access_log=False)
    with pytest.raises(SystemExit):
        engine_parser().parse_args(["--decode-buckets", "1,x"])


def test_api_key_flag_or_environment(monkeypatch):
    from jaxserve.server.command import add_arguments, server_config
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    monkeypatch.delenv("JAXSERVE_API_KEY", raising=False)
    assert server_config(parser.parse_args([])).api_key is None
    monkeypatch.setenv("JAXSERVE_API_KEY", "sk-env")
    assert server_config(parser.parse_args([])).api_key == ("sk-env",)
    assert server_config(parser.parse_args(["--api-key", "sk-flag"])).api_key == ("sk-flag",)
    assert server_config(parser.parse_args(["--api-key", "new", "--api-key", "old"])).api_key == ("new", "old")


# ---- request validation -------------------------------------------------------------------------------------
def test_valid_request_gets_defaults_and_integral_numbers_as_ints():
    body = parse_request(CompletionRequest, {"prompt": [[1.0, 2]], "max_tokens": 3.0, "n": None, "extra": 1})
    assert body.prompt == [[1, 2]] and type(body.prompt[0][0]) is int
    assert body.max_tokens == 3 and type(body.max_tokens) is int
    assert body.n == 1 and body.temperature == 1.0


@pytest.mark.parametrize("body, param, words", [
    ({"prompt": "x", "max_tokens": True}, "max_tokens", "integer"),
    ({"prompt": "x", "top_k": 1.5}, "top_k", "integer"),
    ({"prompt": {"a": 1}}, "prompt", "a string or an array of strings"),
    ({"prompt": [[1], ["a"]]}, "prompt[1][0]", "integer"),
    ({"prompt": "x", "stop": ["a"] * 17}, "stop", "at most 16"),
    ({"prompt": "x", "logit_bias": {"1": 101}}, "logit_bias.1", "<= 100"),
])
def test_invalid_completion_requests_name_the_field(body, param, words):
    with pytest.raises(APIError) as error:
        parse_request(CompletionRequest, body)
    assert error.value.status == 400 and error.value.param == param and words in error.value.message


def test_invalid_chat_message_names_its_path():
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": [{"type": "text"}]}]
    with pytest.raises(APIError) as error:
        parse_request(ChatCompletionRequest, {"messages": messages})
    assert error.value.param == "messages[1].content[0].text"


# ---- logprob token text -------------------------------------------------------------------------------------
@pytest.mark.parametrize("directory", ["llama3_bbpe", "llama2_spm", "qwen2_bbpe"])
def test_token_bytes_concatenate_to_the_decoded_text(directory):
    from jaxserve.server.logprobs import TokenText
    from jaxserve.tokenizer import load_tokenizer
    tokenizer = load_tokenizer(TOKENIZERS / directory)
    text = "naïve café — 東京 🙂 done"
    ids = tokenizer.encode(text, add_special_tokens=False)
    token_text = TokenText(tokenizer)
    joined = b"".join(token_text.bytes_of(i) for i in ids).decode()
    assert joined.lstrip() == tokenizer.decode(ids).lstrip()
    partial = [i for i in ids if token_text.text_of(i).startswith("bytes:")]
    assert all(len(token_text.bytes_of(i)) < 4 for i in partial)


# ---- AsyncEngine admission (fake engine) --------------------------------------------------------------------
class FakeEngine:
    """An engine core whose steps give every request one token (its id counts up); a request ends after
    max_tokens."""

    def __init__(self, fail_on_step: int | None = None):
        self.tokenizer = None
        self.model_config = types.SimpleNamespace(vocab_size=100, sliding_window=None)
        self.max_model_len = 64
        self.config = EngineConfig()
        self.kv_plan = types.SimpleNamespace(num_pages=32)  # for the cache_config_info labels
        self.speculation = None  # EngineCore.speculation: no speculative decoding
        self.progress: dict[str, tuple[int, int]] = {}
        self.aborted: list[str] = []
        self.fail_on_step = fail_on_step
        self.steps = 0
        self.release = threading.Event()  # clear it to hold the engine thread at the start of its next step
        self.release.set()
        self.in_step = threading.Event()

    def add_request(self, request: EngineRequest):
        if request.params.max_tokens > 10:
            raise ValueError("max_tokens too large for the fake")
        self.progress[request.request_id] = (0, request.params.max_tokens)

    def abort_request(self, request_id):
        self.aborted.append(request_id)
        if self.progress.pop(request_id, None) is not None:
            return (SampleDelta(request_id, 0, finish_reason="abort"),)
        return ()

    def finish_sample(self, request_id, index, stop):
        return self.progress.pop(request_id, None) is not None

    def lora_infos(self):
        return ()

    def has_unfinished_requests(self):
        return bool(self.progress)

    def step(self):
        self.in_step.set()
        self.release.wait()
        self.steps += 1
        if self.fail_on_step == self.steps:
            raise RuntimeError("fake failure")
        deltas, finished = [], []
        for request_id, (done, limit) in list(self.progress.items()):
            deltas.append(SampleDelta(request_id, 0, (done,), finish_reason="length" if done + 1 == limit else None))
            self.progress[request_id] = (done + 1, limit)
            if done + 1 == limit:
                del self.progress[request_id]
                finished.append(request_id)
        return StepOutputs(tuple(deltas), SchedulerStats(), tuple(finished), time.monotonic())


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, 10))


def test_add_request_returns_a_stream_after_acceptance():
    engine = AsyncEngine(FakeEngine()).start()
    assert isinstance(engine, EngineClient) and isinstance(ReplicaRouter([engine]), EngineClient)
    try:
        async def scenario():
            stream = await engine.add_request("a", [1, 2], SamplingParams(max_tokens=3))
            outputs = [output async for output in stream]
            with pytest.raises(ValueError, match="too large"):
                await engine.add_request("b", [1], SamplingParams(max_tokens=11))
            return outputs

        outputs = run(scenario())  # steps the reader did not keep up with arrive as one output
        assert [t for o in outputs for t in o.outputs[0].token_ids] == [0, 1, 2] and outputs[-1].finished
        assert outputs[-1].outputs[0].num_tokens == 3
    finally:
        engine.stop()


def test_closing_a_stream_aborts_its_request():
    fake = FakeEngine()
    engine = AsyncEngine(fake).start()
    try:
        async def scenario():
            fake.release.clear()  # the engine accepts "a", then waits inside its first step
            stream = await engine.add_request("a", [1], SamplingParams(max_tokens=10))
            stream.close()
            fake.release.set()
            other = await engine.add_request("b", [1], SamplingParams(max_tokens=1))
            return [output async for output in other]

        assert run(scenario())[-1].finished
        assert fake.aborted == ["a"] and "a" not in fake.progress
    finally:
        engine.stop()


def test_full_queue_and_dead_engine_are_refused():
    engine = AsyncEngine(FakeEngine(), max_queued_requests=0).start()
    try:
        with pytest.raises(QueueFullError):
            run(engine.add_request("a", [1], SamplingParams(max_tokens=1)))
    finally:
        engine.stop()
    with pytest.raises(EngineDeadError):
        run(engine.add_request("b", [1], SamplingParams(max_tokens=1)))


def test_requests_queued_behind_a_failing_step_are_rejected_not_left_waiting():
    fake = FakeEngine(fail_on_step=1)
    fake.release.clear()
    engine = AsyncEngine(fake).start()

    async def scenario():
        first = await engine.add_request("a", [1], SamplingParams(max_tokens=5))
        await asyncio.to_thread(fake.in_step.wait)  # held inside its first step: "b" stays in the command queue
        second = asyncio.ensure_future(engine.add_request("b", [1], SamplingParams(max_tokens=5)))
        await asyncio.sleep(0)  # let "b" reach the queue
        fake.release.set()
        outputs = [output async for output in first]
        with pytest.raises(EngineDeadError):
            await second
        return outputs

    outputs = run(scenario())
    assert outputs[-1].finished and "fake failure" in outputs[-1].error
    assert not engine.is_alive
