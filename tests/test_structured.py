"""Structured output without a model: constraints, compiling them with llguidance against this project's
tokenizers, the token bitmask (host side and its application on device), and tool-call parsing."""

from __future__ import annotations

import json
import random
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.engine.sampler import apply_token_bitmask
from jaxserve.sampling_params import SamplingParams
from jaxserve.structured import StructuredOutputsParams
from jaxserve.structured.grammar import GrammarCompiler
from jaxserve.structured.matchers import StructuredOutputs
from jaxserve.structured.tools import (ToolCallStream, ToolError, calls_from_required, parse_hermes,
                                       parse_llama3_json, parse_mistral, plan_tools)
from jaxserve.tokenizer import load_tokenizer
from jaxserve.validation import InvalidRequestError, validate_sampling_params

ROOT = Path(__file__).resolve().parents[1]
TOKENIZERS = {"demo": ROOT / "checkpoints" / "demo", **{name: ROOT / "tests" / "fixtures" / "tokenizers" / name
                                                       for name in ("llama3_bbpe", "llama2_spm", "qwen2_bbpe",
                                                                    "mistral_json")}}
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module", params=sorted(TOKENIZERS))
def compiler(request):
    tokenizer = load_tokenizer(TOKENIZERS[request.param])
    return GrammarCompiler(tokenizer, tokenizer.vocab_size, tokenizer.eos_token_ids)


def allowed_ids(mask_row: np.ndarray, vocab: int) -> list[int]:
    return [t for t in range(vocab) if not (int(mask_row[t // 32]) >> (t % 32)) & 1]


def walk(compiler: GrammarCompiler, params: StructuredOutputsParams, seed: int, max_tokens: int = 200) -> str:
    """Samples uniformly among the allowed tokens until EOS: the text a grammar lets through."""
    state = StructuredOutputs(compiler)
    state.add("r", SamplingParams(structured_outputs=params))
    rng = random.Random(seed)
    vocab = compiler.tokenizer.vocab_size
    tokens = []
    for _ in range(max_tokens):
        allowed = allowed_ids(state.disallowed([("r", 0, True)], vocab)[0], vocab)
        token = rng.choice(allowed)
        if token in compiler.eos_token_ids:
            return compiler.tokenizer.decode(tokens)
        state.accept("r", 0, token)
        tokens.append(token)
    raise AssertionError(f"no EOS within {max_tokens} tokens: {compiler.tokenizer.decode(tokens)!r}")


# ---- the constraint -------------------------------------------------------------------------------------------
def test_params_are_canonical_and_hashable():
    a = StructuredOutputsParams(json={"b": 1, "a": {"type": "object"}})
    b = StructuredOutputsParams(json='{"b": 1,\n "a": {"type":  "object"}}')
    assert a == b and hash(a) == hash(b) and a.kind == "json"
    assert StructuredOutputsParams(choice=["x", "y"]).choice == ("x", "y")
    assert hash(SamplingParams(structured_outputs=a)) == hash(SamplingParams(structured_outputs=b))
    assert SamplingParams(structured_outputs={"regex": "a+"}).structured_outputs.kind == "regex"


@pytest.mark.parametrize("fields, message", [
    ({}, "exactly one of"), ({"regex": "a", "choice": ["a"]}, "got regex, choice"), ({"choice": []}, "non-empty"),
    ({"choice": ["a", ""]}, "non-empty strings"), ({"json": "{not json"}, "not valid JSON"),
    ({"json": "[1]"}, "is an object"), ({"grammar": ""}, "non-empty string")])
def test_malformed_constraints_are_refused_by_validation(fields, message):
    with pytest.raises(InvalidRequestError, match=message) as caught:
        validate_sampling_params(SamplingParams(structured_outputs=StructuredOutputsParams(**fields)))
    assert caught.value.param == "structured_outputs"


# ---- compiling, per tokenizer ----------------------------------------------------------------------------------
def test_json_schema_outputs_validate(compiler):
    jsonschema = pytest.importorskip("jsonschema")
    params = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    for seed in range(4):
        text = walk(compiler, params, seed)
        jsonschema.validate(json.loads(text), SCHEMA)


def test_regex_choice_grammar_and_json_object(compiler):
    import re
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", walk(compiler, StructuredOutputsParams(regex=r"[0-9]{3}-[a-z]{2}"), 1))
    assert walk(compiler, StructuredOutputsParams(choice=["red", "green", "blue"]), 2) in {"red", "green", "blue"}
    lark = 'start: "(" num ("+" num)* ")"\nnum: /[0-9]/'
    assert re.fullmatch(r"\([0-9](\+[0-9])*\)", walk(compiler, StructuredOutputsParams(grammar=lark), 3))
    gbnf = 'root ::= "yes" | "no"'
    assert walk(compiler, StructuredOutputsParams(grammar=gbnf), 4) in {"yes", "no"}

    state = StructuredOutputs(compiler)  # any object: a random walk may never close one, so check a given one
    state.add("r", SamplingParams(structured_outputs=StructuredOutputsParams(json_object=True)))
    vocab = compiler.tokenizer.vocab_size
    first = {compiler.tokenizer.decode([t]).strip()[:1] for t in allowed_ids(state.disallowed([("r", 0, True)],
                                                                                             vocab)[0], vocab)}
    assert first <= {"{", ""}
    for token in compiler.ll_tokenizer.tokenize_str('{"a":[1,{"b":null}],"c":"d"}'):  # no sentencepiece "▁"
        assert token in allowed_ids(state.disallowed([("r", 0, True)], vocab)[0], vocab)
        state.accept("r", 0, token)
    assert set(compiler.eos_token_ids) & set(allowed_ids(state.disallowed([("r", 0, True)], vocab)[0], vocab))


@pytest.mark.parametrize("fields, message", [
    ({"json": {"type": "frobnicate"}}, "JSON schema does not compile: .*frobnicate"),
    ({"json": {"type": "string", "format": "no-such-format"}}, "no-such-format"),
    ({"regex": "(unclosed"}, "regex does not compile"),
    ({"grammar": "start: undefined_rule"}, "grammar does not compile: .*undefined_rule")])
def test_what_does_not_compile_is_an_invalid_request(fields, message):
    tokenizer = load_tokenizer(TOKENIZERS["demo"])
    compiler = GrammarCompiler(tokenizer, tokenizer.vocab_size, tokenizer.eos_token_ids)
    with pytest.raises(InvalidRequestError, match=message) as caught:
        compiler.compile(StructuredOutputsParams(**fields))
    assert caught.value.param == "structured_outputs"


def test_compiled_grammars_are_cached_and_evicted():
    tokenizer = load_tokenizer(TOKENIZERS["demo"])
    compiler = GrammarCompiler(tokenizer, tokenizer.vocab_size, tokenizer.eos_token_ids, cache_size=2)
    first = compiler.compile(StructuredOutputsParams(json=SCHEMA))
    assert compiler.compile(StructuredOutputsParams(json=json.dumps(SCHEMA))) is first
    compiler.compile(StructuredOutputsParams(regex="a"))
    compiler.compile(StructuredOutputsParams(regex="b"))
    assert compiler.compile(StructuredOutputsParams(json=SCHEMA)) is not first


# ---- the bitmask ------------------------------------------------------------------------------------------------
def test_mask_rows_follow_the_plan_rows():
    tokenizer = load_tokenizer(TOKENIZERS["demo"])
    state = StructuredOutputs(GrammarCompiler(tokenizer, 4096 + 40, tokenizer.eos_token_ids))
    state.add("a", SamplingParams(n=2, structured_outputs=StructuredOutputsParams(choice=["yes", "no"])))
    assert state.disallowed([("b", 0, True), ("a", 0, False)], 4096 + 40) is None  # nothing constrained samples
    mask = state.disallowed([("b", 0, True), ("a", 1, True), ("a", 0, False)], 4096 + 40)
    assert mask.shape == (3, (4096 + 40 + 31) // 32) and mask.dtype == np.int32
    assert not mask[0].any() and not mask[2].any()  # unconstrained and non-sampling rows: nothing banned
    allowed = allowed_ids(mask[1], 4096 + 40)
    assert allowed and all(t < 4096 for t in allowed)  # ids past the tokenizer's vocabulary never
    assert {tokenizer.decode([t]) for t in allowed} <= {"y", "ye", "yes", "n", "no"}
    assert tokenizer.eos_token_ids[0] not in allowed  # EOS only where the grammar may end
    state.drop("a", 1)
    assert state.disallowed([("a", 1, True)], 4096) is None


def test_device_mask_matches_the_bits():
    rng = np.random.default_rng(0)
    vocab = 1000
    words = rng.integers(-2**31, 2**31, size=(3, (vocab + 31) // 32), dtype=np.int64).astype(np.int32)
    words[1] = 0
    logits = rng.normal(size=(3, vocab)).astype(np.float32)
    out = np.asarray(apply_token_bitmask(jnp.asarray(logits), jnp.asarray(words)))
    banned = np.array([[(int(words[r, t // 32]) >> (t % 32)) & 1 for t in range(vocab)] for r in range(3)], bool)
    np.testing.assert_array_equal(np.isneginf(out), banned)
    np.testing.assert_array_equal(out[~banned], logits[~banned])


# ---- tools ------------------------------------------------------------------------------------------------------
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


def test_tool_choice_plans():
    assert plan_tools(None, None).mode == "none" and plan_tools([WEATHER], None).mode == "auto"
    assert plan_tools([WEATHER], "none").constraint is None
    named = plan_tools([WEATHER, TIME], {"type": "function", "function": {"name": "get_weather"}})
    assert named.mode == "named" and json.loads(named.constraint.json)["required"] == ["city"]
    required = json.loads(plan_tools([WEATHER, TIME], "required", parallel_tool_calls=False).constraint.json)
    assert required["maxItems"] == 1 and len(required["items"]["anyOf"]) == 2
    for tools, choice, param in [(None, "required", "tool_choice"), ([WEATHER], "sometimes", "tool_choice"),
                                 ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "tool_choice"),
                                 ([{"type": "function", "function": {"name": "bad name"}}], "auto",
                                  "tools[0].function.name")]:
        with pytest.raises(ToolError) as caught:
            plan_tools(tools, choice)
        assert caught.value.param == param
    calls = calls_from_required('[{"name": "get_time", "parameters": {}}, {"name": "get_weather", '
                                '"parameters": {"city": "Oslo"}}]')
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_time", {}), ("get_weather", {"city": "Oslo"})]


HAND_WRITTEN = {  # parser -> (model output, content, [(name, arguments)])
    "hermes": ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
               '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
               "Let me check.", [("get_weather", {"city": "Oslo"}), ("get_time", {})]),
    "llama3_json": ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; '
                    '{"name": "get_time", "parameters": {}}',
                    "", [("get_weather", {"city": "Oslo"}), ("get_time", {})]),
    "mistral": ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}]', "",
                [("get_weather", {"city": "Oslo"})]),
    "mistral_v11": ('[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}[TOOL_CALLS]get_time[ARGS]{}', "",
                    [("get_weather", {"city": "Oslo"}), ("get_time", {})]),
}
PARSE = {"hermes": parse_hermes, "llama3_json": parse_llama3_json, "mistral": parse_mistral,
         "mistral_v11": parse_mistral}


@pytest.mark.parametrize("name", sorted(HAND_WRITTEN))
def test_tool_calls_are_parsed(name):
    text, content, expected = HAND_WRITTEN[name]
    got_content, calls = PARSE[name](text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in calls] == expected
    assert all(c.id.startswith("call_") for c in calls)
    assert PARSE[name]("Just words, no call.") == ("Just words, no call.", [])


@pytest.mark.parametrize("name", sorted(HAND_WRITTEN))
def test_tool_calls_are_parsed_streamed_in_any_chunking(name):
    text, content, expected = HAND_WRITTEN[name]
    parser = "mistral" if name.startswith("mistral") else name
    rng = random.Random(0)
    for _ in range(20):
        stream, sent, position = ToolCallStream(parser), "", 0
        while position < len(text):
            size = rng.randint(1, 6)
            sent += stream.feed(text[position:position + size])
            position += size
        rest, calls = stream.finish()
        assert (sent + rest).strip() == content
        assert [(c.name, json.loads(c.arguments)) for c in calls] == expected
    stream = ToolCallStream(parser)
    plain = "<tool_ca is not a call" if parser == "hermes" else "plain text"
    streamed = "".join(stream.feed(piece) for piece in (plain[:5], plain[5:]))
    rest, calls = stream.finish()
    assert streamed + rest == plain and calls == []
