"""Structured output end to end on the tiny llama3.1 fixture (a random model, so only the grammar makes its output
well-formed): the offline engine first (constraints, n > 1, seeds, logprobs, stop strings, preemption, mixed
batches), then a real server driven by the official `openai` client (response_format, parse(), vLLM's fields,
streaming, 400s, tools)."""

from __future__ import annotations

import json
import re
import threading
from typing import Literal, Optional

import httpx
import jsonschema
import openai
import pydantic
import pytest

from jaxserve.engine.engine import LLMEngine
from jaxserve.engine.llm import LLM
from jaxserve.sampling_params import SamplingParams
from jaxserve.structured import StructuredOutputsParams
from jaxserve.validation import InvalidRequestError
from test_server_harness import SMALL_ENGINE, TINY_ENGINE, running_engine, serve_in_thread, server_state


class Address(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")  # additionalProperties: false
    city: str = pydantic.Field(max_length=12)
    zip: int = pydantic.Field(ge=0, le=99999)


class Person(pydantic.BaseModel):
    """Nested objects, arrays, enums, numbers, required and optional fields."""

    model_config = pydantic.ConfigDict(extra="forbid")

    name: str = pydantic.Field(max_length=12)
    age: int = pydantic.Field(ge=0, le=150)
    score: float
    role: Literal["admin", "user", "guest"]
    address: Address
    tags: list[Literal["x", "y", "z"]] = pydantic.Field(max_length=3)
    nickname: Optional[str] = pydantic.Field(None, max_length=8)


PERSON = Person.model_json_schema()
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                     "unit": {"enum": ["C", "F"]}}, "required": ["city", "unit"],
    "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "maxLength": 6}}, "required": ["zone"],
    "additionalProperties": False}}}
CHAT = [{"role": "user", "content": "Describe a person as JSON."}]


@pytest.fixture(scope="module")
def model_dir(converted):
    return converted("llama3.1")


@pytest.fixture(scope="module")
def engine(model_dir):
    return LLMEngine.from_model_dir(model_dir, SMALL_ENGINE, show_progress=False)


@pytest.fixture(scope="module")
def llm(engine):
    return LLM(engine=engine)


def constrained(max_tokens=160, **fields) -> SamplingParams:
    return SamplingParams(temperature=1.0, max_tokens=max_tokens, structured_outputs=StructuredOutputsParams(**fields))


def finished_texts(outputs) -> list[str]:
    samples = [s for o in outputs for s in o.outputs]
    assert all(s.finish_reason in ("stop", "length") for s in samples)
    return [s.text for s in samples if s.finish_reason == "stop"]


# ---- offline -----------------------------------------------------------------------------------------------
def test_json_schema_outputs_validate_offline(llm):
    outputs = llm.generate([f"Person {i}:" for i in range(16)], SamplingParams(
        n=2, temperature=1.0, seed=5, max_tokens=200, structured_outputs=StructuredOutputsParams(json=PERSON)))
    texts = finished_texts(outputs)
    assert len(texts) >= 16, "most samples should finish within 200 tokens"
    for text in texts:
        jsonschema.validate(json.loads(text), PERSON)


def test_regex_choice_and_grammar_offline(llm):
    prompts = [f"Item {i}" for i in range(8)]
    for text in finished_texts(llm.generate(prompts, constrained(regex=r"[A-Z][a-z]{1,6} [0-9]{2,4}"))):
        assert re.fullmatch(r"[A-Z][a-z]{1,6} [0-9]{2,4}", text)
    choices = ["positive", "negative", "neutral"]
    texts = finished_texts(llm.generate(prompts, constrained(choice=choices)))
    assert len(texts) == len(prompts) and set(texts) <= set(choices)
    lark = 'start: expr\nexpr: NUM | "(" expr OP expr ")"\nOP: "+" | "*"\nNUM: /[1-9]/'
    for text in finished_texts(llm.generate(prompts, constrained(grammar=lark, max_tokens=120))):
        assert re.fullmatch(r"[()0-9+*]+", text) and text.count("(") == text.count(")")


def test_constraints_compose_with_seeds_logprobs_and_stop_strings(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=80, logprobs=2,
                            structured_outputs=StructuredOutputsParams(json=PERSON, disable_any_whitespace=True))
    first, again = llm.generate(["Seeded"], params)[0], llm.generate(["Seeded"], params)[0]
    assert [s.token_ids for s in first.outputs] == [s.token_ids for s in again.outputs]
    assert all(len(s.logprobs) == len(s.token_ids) for s in first.outputs)
    stopped = llm.generate(["Stop"], SamplingParams(temperature=0.0, max_tokens=80, stop=['"age"'],
                                                    structured_outputs=StructuredOutputsParams(json=PERSON)))[0]
    assert stopped.outputs[0].finish_reason == "stop" and stopped.outputs[0].stop_reason == '"age"'
    assert stopped.outputs[0].text.startswith("{")
    assert len(llm.engine.core.structured) == 0  # every matcher was dropped with its sample


def test_unconstrained_rows_are_unchanged_beside_constrained_ones(llm):
    plain = SamplingParams(temperature=0.0, max_tokens=32)
    prompts = ["The river ran", "Hello there", "A test of"]
    alone = llm.generate(prompts, plain)
    mixed = llm.generate(prompts + [f"JSON {i}" for i in range(6)],
                         [plain] * 3 + [constrained(json=PERSON, max_tokens=60)] * 6)
    assert [o.outputs[0].token_ids for o in mixed[:3]] == [o.outputs[0].token_ids for o in alone]


def test_uncompilable_constraint_is_refused_before_queueing(llm):
    with pytest.raises(InvalidRequestError, match="does not compile"):
        llm.generate(["x"], constrained(json={"type": "object", "properties": {"a": {"type": "nope"}}}))
    assert not llm.engine.has_unfinished_requests() and len(llm.engine.core.structured) == 0
    assert llm.generate(["x"], constrained(choice=["ok"]))[0].outputs[0].text == "ok"


def test_preempted_constrained_sequences_stay_valid(model_dir):
    """A KV cache too small for four long samples: sequences are preempted and recomputed mid-structure."""
    engine = LLMEngine.from_model_dir(model_dir, TINY_ENGINE.replace(kv_cache_memory=2**18), show_progress=False)
    outputs = LLM(engine=engine).generate([f"P{i}" for i in range(6)], SamplingParams(
        temperature=1.0, seed=3, max_tokens=200, structured_outputs=StructuredOutputsParams(json=PERSON)))
    assert engine.core.scheduler.num_preemptions > 0
    texts = finished_texts(outputs)
    assert texts
    for text in texts:
        jsonschema.validate(json.loads(text), PERSON)


def test_late_masks_keep_constrained_rows_one_step_ahead(model_dir):
    """With async scheduling, a decode step carrying constrained rows goes out as its forward half before the
    previous step is read and gets its masks after: the same tokens as the engine without the overlap (seeded
    samples and a greedy row beside them), one engine step per token rather than two. The split executables
    are not compiled at start-up; the first constrained request starts their compile in the background."""
    regex = "[a-z]{24}"
    prompts = ["Letters:", "More letters:", "Some text", "Plain"]
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=24,
                             structured_outputs=StructuredOutputsParams(regex=regex)) for i in range(3)]
    params.append(SamplingParams(temperature=0.0, max_tokens=24))
    tokens, late, steps = {}, {}, {}
    for overlap in (True, False):
        engine = LLMEngine.from_model_dir(model_dir, TINY_ENGINE.replace(async_scheduling=overlap),
                                          show_progress=False)
        core = engine.core
        assert not core.runner.forwards and not core.runner.samplers
        assert core.prepare_late_masks(wait=True) == overlap  # (a constrained request would start it too)
        plans = []
        schedule, step = core.scheduler.schedule, core.step
        core.scheduler.schedule = lambda: plans.append(schedule()) or plans[-1]
        outputs = LLM(engine=engine).generate(prompts, params)
        tokens[overlap] = [o.outputs[0].token_ids for o in outputs]
        assert all(re.fullmatch(regex, o.outputs[0].text) for o in outputs[:3])
        late[overlap] = sum(plan.late_mask for plan in plans)
        calls = [0]
        core.step = lambda: calls.__setitem__(0, calls[0] + 1) or step()
        alone = LLM(engine=engine).generate(["Alone:"], params[0])[0].outputs[0]
        steps[overlap] = (calls[0], len(alone.token_ids))
        if overlap:
            decodes = {shape for shape in core.buckets.shapes() if shape.kind == "decode"}
            assert set(core.runner.forwards) == decodes
            assert set(core.runner.samplers) == {shape.seqs for shape in decodes}
        else:
            assert not core.runner.forwards and not core.runner.samplers
        engine.close()
    assert tokens[True] == tokens[False]
    assert late[True] >= max(len(t) for t in tokens[True][:3]) - 2 and late[False] == 0
    calls, generated = steps[True]
    assert calls <= generated + 3, steps  # without late masks a lone constrained row took two steps per token


def test_the_first_constrained_request_starts_the_split_compile(llm):
    core = llm.engine.core
    llm.generate(["x"], constrained(choice=["ok"]))
    assert core._split_decode is not None  # compiling in the background, or done
    core._split_decode.result(timeout=600)
    texts = finished_texts(llm.generate(["y", "z"], constrained(regex="[a-z]{12}", max_tokens=12)))
    assert all(re.fullmatch("[a-z]{12}", text) for text in texts)
    assert core.scheduler.config.late_masks and core.runner.forwards  # picked up by the engine thread


# ---- the server --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(engine, model_dir):
    with running_engine(engine) as async_engine, serve_in_thread(server_state(async_engine, model_dir)) as live:
        yield live


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=120, max_retries=0)


def test_response_format_json_schema(client):
    response = client.chat.completions.create(
        model="tiny-llama", messages=CHAT, n=16, temperature=1.0, max_tokens=200,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}})
    finished = [c.message.content for c in response.choices if c.finish_reason == "stop"]
    assert len(finished) >= 8
    for text in finished:
        Person.model_validate_json(text)
        jsonschema.validate(json.loads(text), PERSON)


def test_parse_returns_a_parsed_object(client):
    class Verdict(pydantic.BaseModel):
        label: Literal["good", "bad"]
        confidence: int = pydantic.Field(ge=0, le=9)

    parse = getattr(getattr(client, "beta").chat.completions, "parse", None) or client.chat.completions.parse
    parsed = parse_with_retries(parse, Verdict, max_tokens=60)
    assert isinstance(parsed, Verdict) and parsed.label in ("good", "bad")


def parse_with_retries(parse, model, max_tokens: int, attempts: int = 5):
    """parse() raises when a sample runs out of tokens (a random model may ramble inside a string): new seed."""
    for seed in range(attempts):
        try:
            return parse(model="tiny-llama", messages=CHAT, response_format=model, temperature=1.0, seed=seed,
                         max_tokens=max_tokens).choices[0].message.parsed
        except openai.LengthFinishReasonError:
            continue
    raise AssertionError(f"{attempts} samples all ran out of tokens")


def test_json_object_streamed_and_not(client):
    response = client.chat.completions.create(model="tiny-llama", messages=CHAT, temperature=0.7, max_tokens=120,
                                              n=4, seed=2, response_format={"type": "json_object"},
                                              extra_body={"structured_outputs": None})
    for choice in response.choices:
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.message.content), dict)
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    for chunk in client.completions.create(model="tiny-llama", prompt="JSON:", temperature=0.7, max_tokens=120, n=4,
                                           seed=2, stream=True,
                                           extra_body={"response_format": {"type": "json_object"}}):
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            reasons[choice.index] = choice.finish_reason or reasons.get(choice.index)
    assert sorted(texts) == [0, 1, 2, 3]
    for i, text in texts.items():
        assert text.lstrip().startswith("{")
        if reasons[i] == "stop":
            assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize("extra", [{"structured_outputs": {"regex": r"(yes|no), [0-9]{3}"}},
                                   {"guided_regex": r"(yes|no), [0-9]{3}"}])
def test_regex_over_http(client, extra):
    response = client.completions.create(model="tiny-llama", prompt="Answer:", temperature=1.0, max_tokens=20, n=4,
                                         extra_body=extra)
    assert all(re.fullmatch(r"(yes|no), [0-9]{3}", c.text) for c in response.choices)


@pytest.mark.parametrize("extra", [{"structured_outputs": {"choice": ["alpha", "beta", "gamma"]}},
                                   {"guided_choice": ["alpha", "beta", "gamma"]}])
def test_choice_over_http_streamed(client, extra):
    texts: dict[int, str] = {}
    stream = client.chat.completions.create(model="tiny-llama", messages=CHAT, temperature=1.0, max_tokens=10, n=3,
                                            stream=True, extra_body=extra)
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
    assert len(texts) == 3 and set(texts.values()) <= {"alpha", "beta", "gamma"}


def test_grammar_over_http(client):
    gbnf = 'root ::= "[" item ("," item)* "]"\nitem ::= [a-c]'
    response = client.completions.create(model="tiny-llama", prompt="List:", temperature=1.0, max_tokens=40, n=4,
                                         extra_body={"structured_outputs": {"grammar": gbnf}})
    for choice in response.choices:
        if choice.finish_reason == "stop":
            assert re.fullmatch(r"\[[a-c](,[a-c])*\]", choice.text)


@pytest.mark.parametrize("body, param, message", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format", "does not compile"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs", "regex does not compile"),
    ({"guided_grammar": "start: missing_rule"}, "guided_grammar", "grammar does not compile"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one of"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex", "not several"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs.structural_tag", ""),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema",
     "needs json_schema.schema"),
])
def test_bad_constraints_are_400s(client, body, param, message):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="tiny-llama", messages=CHAT, max_tokens=5, extra_body=body)
    error = caught.value.body
    assert error["param"] == param and message in error["message"]


def test_a_bad_schema_does_not_disturb_a_concurrent_stream(client):
    reference = client.completions.create(model="tiny-llama", prompt="Concurrent", temperature=0.0, max_tokens=48)
    text, errors = [], []

    def stream():
        for chunk in client.completions.create(model="tiny-llama", prompt="Concurrent", temperature=0.0,
                                               max_tokens=48, stream=True):
            text.append(chunk.choices[0].text if chunk.choices else "")

    worker = threading.Thread(target=stream)
    worker.start()
    for _ in range(5):
        try:
            client.completions.create(model="tiny-llama", prompt="x", max_tokens=5, extra_body={
                "guided_json": {"type": "object", "properties": {"a": {"type": "frob"}}}})
        except openai.BadRequestError as exc:
            errors.append(exc.status_code)
    worker.join(120)
    assert errors == [400] * 5
    assert "".join(text) == reference.choices[0].text


# ---- tools ------------------------------------------------------------------------------------------------
def arguments_schema(name: str) -> dict:
    return {tool["function"]["name"]: tool["function"]["parameters"] for tool in (WEATHER, CLOCK)}[name]


def test_tool_choice_required_always_calls_valid_tools(client):
    response = client.chat.completions.create(model="tiny-llama", messages=CHAT, tools=[WEATHER, CLOCK],
                                              tool_choice="required", n=8, temperature=1.0, max_tokens=160)
    called = [c for c in response.choices if c.finish_reason == "tool_calls"]
    assert len(called) >= 6
    for choice in called:
        assert choice.message.tool_calls and choice.message.content is None
        for call in choice.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), arguments_schema(call.function.name))
            assert call.type == "function" and call.id.startswith("call_")


def test_named_tool_choice_streamed_and_not(client):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    response = client.chat.completions.create(model="tiny-llama", messages=CHAT, tools=[WEATHER, CLOCK],
                                              tool_choice=choice, temperature=1.0, max_tokens=80, n=4, seed=9)
    for c in response.choices:
        if c.finish_reason != "length":
            assert c.finish_reason == "tool_calls" and c.message.tool_calls[0].function.name == "get_weather"
            jsonschema.validate(json.loads(c.message.tool_calls[0].function.arguments), arguments_schema("get_weather"))
    with client.beta.chat.completions.stream(model="tiny-llama", messages=CHAT, tools=[WEATHER, CLOCK],
                                             tool_choice=choice, temperature=1.0, max_tokens=80, seed=9) as stream:
        final = stream.get_final_completion()
    streamed = final.choices[0]
    if streamed.finish_reason != "length":
        assert streamed.finish_reason == "tool_calls"
        assert streamed.message.tool_calls[0].function.arguments == \
            response.choices[0].message.tool_calls[0].function.arguments


@pytest.mark.parametrize("stream", [False, True])
def test_auto_tool_calls_are_parsed(client, server, stream):
    """The model's own Llama 3.1 JSON call syntax, made certain with a regex constraint, comes back as a call."""
    forced = r'\{"name": "get_weather", "parameters": \{"city": "Oslo", "unit": "C"\}\}'
    body = dict(model="tiny-llama", messages=CHAT, tools=[WEATHER, CLOCK], tool_choice="auto", max_tokens=60,
                temperature=0.0, extra_body={"structured_outputs": {"regex": forced}})
    if not stream:
        choice = client.chat.completions.create(**body).choices[0]
        calls, reason, content = choice.message.tool_calls, choice.finish_reason, choice.message.content
    else:
        calls, reason, content = {}, None, ""
        for chunk in client.chat.completions.create(stream=True, **body):
            for c in chunk.choices:
                content += c.delta.content or ""
                for call in c.delta.tool_calls or []:
                    calls.setdefault(call.index, call)
                reason = c.finish_reason or reason
        calls = [calls[i] for i in sorted(calls)]
    assert reason == "tool_calls" and not content
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == \
        [("get_weather", {"city": "Oslo", "unit": "C"})]


def test_auto_without_a_call_is_content_and_tool_results_reach_the_template(client):
    messages = CHAT + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                           "arguments": '{"city": "Oslo", "unit": "C"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12 degrees"}]
    response = client.chat.completions.create(model="tiny-llama", messages=messages, tools=[WEATHER],
                                              max_tokens=8, temperature=0.0, extra_body={"guided_choice": ["Mild."]})
    assert response.choices[0].message.content == "Mild." and response.choices[0].finish_reason == "stop"
    assert not response.choices[0].message.tool_calls


def test_tool_request_errors(server):
    cases = [({"tool_choice": "required"}, "tool_choice"),
             ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
             ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
             ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
              "response_format")]
    for extra, param in cases:
        response = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": CHAT, **extra}, timeout=60)
        assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
